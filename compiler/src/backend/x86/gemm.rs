//! Shape-specialised f32 GEMM for x86_64, AVX-512 (zmm, k-masks) or AVX2+FMA (ymm,
//! `vmaskmovps`), as one machine-code function per distinct call shape:
//!
//! ```c
//! void gemm(const float *a, const float *b, float *c, const float *init);
//! void gemm(const float *a, const float *b, float *c, const float *init, ptrdiff_t add);
//! ```
//!
//! (the second when the spec has an `add` view: a residual at C's positions plus `add`
//! bytes, summed after the product and before the activation).
//!
//! Every size and stride is a constant of the code. A register tile of `MR x NR`
//! accumulators (AVX-512: 12 x 32, 24 zmm; AVX2: 6 x 16, 12 ymm) runs a looped k-loop of
//! broadcast-A times vector-B FMAs. Blocking, outermost first: columns by `nc` (the B
//! block stays in L2), k by `kc`, row tiles, column panels (the A tile stays in L1).
//! Column edges are masked, row edges get a tile with fewer rows, so any m, n, k works.
//!
//! A is read by scalar broadcasts, so it may have any strides (or be prepacked as
//! `[m/MR][k][MR]`); B is read by vectors, so its columns must be contiguous (or it is
//! prepacked as `[n/NR][k][NR]`, zero-padded, see [`pack_b`]).

use crate::kir::GemmAct;
use iced_x86::code_asm::*;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Isa {
    Avx512,
    Avx2,
}

impl Isa {
    /// Rows of the register tile.
    pub fn mr(self) -> usize {
        match self {
            Isa::Avx512 => 12,
            Isa::Avx2 => 6,
        }
    }
    /// Columns of the register tile (two vectors).
    pub fn nr(self) -> usize {
        2 * self.lanes()
    }
    pub fn lanes(self) -> usize {
        match self {
            Isa::Avx512 => 16,
            Isa::Avx2 => 8,
        }
    }
    /// From the target's features: AVX-512F, else AVX2 with FMA, else none.
    pub fn from_features(features: &[String]) -> Option<Isa> {
        let has = |f: &str| features.iter().any(|x| x == f);
        if has("avx512f") {
            Some(Isa::Avx512)
        } else if has("avx2") && has("fma") {
            Some(Isa::Avx2)
        } else {
            None
        }
    }
}

/// One GEMM's shape and byte strides. Element addresses (bytes from the base pointer):
/// `A(i, p) = (i / MR) * a_tile + (i % MR) * a_row + p * a_k`,
/// `B(p, j) = (j / NR) * b_panel + p * b_k + (j % NR) * 4`,
/// `C(i, j) = i * c_rs + j * 4`, `init(i, j) = i * init.0 + j * init.1` (init.1 is 0 or 4).
#[derive(Clone, Debug, PartialEq, Hash, Eq)]
pub struct Spec {
    pub isa: Isa,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub a_tile: i64,
    pub a_row: i64,
    pub a_k: i64,
    pub b_panel: i64,
    pub b_k: i64,
    /// B is packed with zero padding: edge panels may be loaded whole.
    pub b_padded: bool,
    /// Register-tile panels per B panel (B panels `b_group * NR` wide: `B(p, j) =
    /// (j / (g NR)) * b_panel + p * b_k + (j % (g NR)) * 4`); 1 for panels of NR. `nc`
    /// is then a multiple of `g NR`.
    pub b_group: usize,
    pub c_rs: i64,
    pub init: Option<(i64, i64)>,
    /// The init view is C itself (accumulate).
    pub init_is_c: bool,
    /// A second addend `add(i, j)` at `C(i, j)`'s address plus the fifth argument (bytes),
    /// summed after init and the product, before the activation.
    pub add: bool,
    pub act: ActBits,
    /// k block and column block.
    pub kc: usize,
    pub nc: usize,
    /// An 8-bit product (AVX-512 VNNI): each k step is four k of the product, A's
    /// elements are four bytes (one dword, broadcast), B's four bytes along k (packed by
    /// [`pack_b_int8`], or quads read in place), and `vpdpbusd` sums their products into
    /// i32 accumulators. The init view is i32; no alpha, add or activation.
    pub int8: Option<Int8>,
    /// The 8-bit product on the AMX tiles ([`super::amx`]) instead of `vpdpbusd`.
    pub amx: bool,
    /// A (8-bit, unpacked rows) is padded with zero quads up to k rounded up to 16
    /// quads, so the tiles may read whole 64-byte rows at k's end.
    pub a_padded: bool,
}

/// Which operand of an 8-bit product is signed (`vpdpbusd` multiplies unsigned bytes
/// by signed ones).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Int8 {
    /// A u8, B i8 (MatMulInteger: activations by weights).
    UnsignedA,
    /// A i8, B u8 (a convolution's weights by its input's columns).
    SignedA,
}

/// [`GemmAct`] with its floats as bits (hashable).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ActBits {
    None,
    Relu,
    Clip(u32, u32),
    Leaky(u32),
    Silu,
}

impl From<GemmAct> for ActBits {
    fn from(a: GemmAct) -> ActBits {
        match a {
            GemmAct::None => ActBits::None,
            GemmAct::Relu => ActBits::Relu,
            GemmAct::Clip(lo, hi) => ActBits::Clip(lo.to_bits(), hi.to_bits()),
            GemmAct::Leaky(a) => ActBits::Leaky(a.to_bits()),
            GemmAct::Silu => ActBits::Silu,
        }
    }
}

/// Rows up to which a GEMM is not blocked for reuse of B (see [`blocking`]).
pub const FEW_ROWS: usize = 4;
/// Their k block: an A tile of `FEW_ROWS x FEW_ROWS_KC` floats is 16 KiB.
const FEW_ROWS_KC: usize = 1024;

/// Cache blocking from the target's cache sizes (KiB; 0 = unknown): the k block keeps the
/// A tile (`MR x kc`) within half of L1, the column block keeps the B block (`kc x nc`)
/// within half of L2.
///
/// A GEMM of at most [`FEW_ROWS`] rows reads each B element once whatever the blocking:
/// it gets one column block and k blocks of up to [`FEW_ROWS_KC`], so that each B panel
/// streams in one run (a batch-1 MLP's weights come from L3).
pub fn blocking(
    isa: Isa,
    m: usize,
    k: usize,
    n: usize,
    l1_kib: u32,
    l2_kib: u32,
) -> (usize, usize) {
    let l1 = if l1_kib == 0 { 32 } else { l1_kib as usize } * 1024;
    let l2 = if l2_kib == 0 { 512 } else { l2_kib as usize } * 1024;
    let nr = isa.nr();
    if m <= FEW_ROWS {
        let kc = k.div_ceil(k.div_ceil(FEW_ROWS_KC));
        return (kc, n.div_ceil(nr) * nr);
    }
    let kc_max = (l1 / 2 / (isa.mr() * 4)).clamp(64, 512);
    // Even k blocks: 520 = 2 x 260, not 512 + 8.
    let nblk = k.div_ceil(kc_max);
    let kc = k.div_ceil(nblk);
    let nc_max = ((l2 / 2 / (kc * 4)) / nr * nr).max(nr);
    let ncb = n.div_ceil(nc_max);
    let nc = n.div_ceil(ncb).div_ceil(nr) * nr;
    (kc, nc)
}

/// Element `off + r * rs + c * c_step` of `data`, or `None` where that is outside it
/// (packed as 0; the kernel-IR verifier reports such a view).
fn element<T: Copy>(
    data: &[T],
    off: i64,
    (r, rs): (usize, i64),
    (c, c_step): (usize, i64),
) -> Option<T> {
    let idx = off + r as i64 * rs + c as i64 * c_step;
    usize::try_from(idx).ok().and_then(|x| data.get(x)).copied()
}

/// Packs B (`k x n`, element `(p, j)` at `off + p * rs + j * col_s` of `data`) scaled by
/// `alpha` into `[ceil(n / NR)][k][NR]` panels, zero-padded (elements outside `data` read
/// as 0, see [`element`]).
#[allow(clippy::too_many_arguments)]
pub fn pack_b(
    isa: Isa,
    data: &[f32],
    off: i64,
    rs: i64,
    col_s: i64,
    k: usize,
    n: usize,
    alpha: f32,
) -> Vec<f32> {
    let nr = isa.nr();
    let panels = n.div_ceil(nr);
    let mut out = vec![0f32; panels * k * nr];
    for jp in 0..panels {
        for p in 0..k {
            for jj in 0..nr {
                let j = jp * nr + jj;
                if j < n {
                    out[(jp * k + p) * nr + jj] =
                        element(data, off, (p, rs), (j, col_s)).map_or(0.0, |x| x * alpha);
                }
            }
        }
    }
    out
}

/// Packs an 8-bit B (`k x n` in quads, element `(p, j)` at `off + (p / 4) * rs + j *
/// col_s + p % 4` of `data`, see `kir::GemmCall::int8`) for the 8-bit microkernel:
/// `[ceil(n / NR)][k / 4][NR][4]`, the four bytes of a column for k steps `4q..4q + 4`
/// together (one i32 lane of `vpdpbusd`), the last panel zero-padded (padding multiplies
/// A by 0). With NR = 32 a k step is 128 bytes, as the f32 panels' are.
pub fn pack_b_int8(data: &[u8], off: i64, rs: i64, col_s: i64, k: usize, n: usize) -> Vec<u8> {
    let nr = Isa::Avx512.nr();
    let (panels, steps) = (n.div_ceil(nr), k / 4);
    let mut out = vec![0u8; panels * steps * nr * 4];
    for jp in 0..panels {
        for q in 0..steps {
            for jj in 0..nr {
                let j = jp * nr + jj;
                if j < n {
                    for t in 0..4 {
                        out[((jp * steps + q) * nr + jj) * 4 + t] =
                            element(data, off + t as i64, (q, rs), (j, col_s)).unwrap_or(0);
                    }
                }
            }
        }
    }
    out
}

/// Copies an 8-bit A (`m x k` bytes, row `i` at `off + i * rs` of `data`) into rows of
/// `row` bytes, the bytes past k zero (the AMX tiles read whole 64-byte rows).
pub fn pack_a_int8(data: &[u8], off: i64, rs: i64, m: usize, k: usize, row: usize) -> Vec<u8> {
    let mut out = vec![0u8; m * row];
    for i in 0..m {
        for p in 0..k {
            out[i * row + p] = element(data, off, (i, rs), (p, 1)).unwrap_or(0);
        }
    }
    out
}

/// Packs A (`m x k`) scaled by `alpha` into `[ceil(m / MR)][k][MR]`, zero-padded.
#[allow(clippy::too_many_arguments)]
pub fn pack_a(
    isa: Isa,
    data: &[f32],
    off: i64,
    rs: i64,
    col_s: i64,
    m: usize,
    k: usize,
    alpha: f32,
) -> Vec<f32> {
    let mr = isa.mr();
    let tiles = m.div_ceil(mr);
    let mut out = vec![0f32; tiles * k * mr];
    for it in 0..tiles {
        for p in 0..k {
            for ii in 0..mr {
                let i = it * mr + ii;
                if i < m {
                    out[(it * k + p) * mr + ii] =
                        element(data, off, (i, rs), (p, col_s)).map_or(0.0, |x| x * alpha);
                }
            }
        }
    }
    out
}

const ZMM: [AsmRegisterZmm; 32] = [
    zmm0, zmm1, zmm2, zmm3, zmm4, zmm5, zmm6, zmm7, zmm8, zmm9, zmm10, zmm11, zmm12, zmm13, zmm14,
    zmm15, zmm16, zmm17, zmm18, zmm19, zmm20, zmm21, zmm22, zmm23, zmm24, zmm25, zmm26, zmm27,
    zmm28, zmm29, zmm30, zmm31,
];
const YMM: [AsmRegisterYmm; 16] = [
    ymm0, ymm1, ymm2, ymm3, ymm4, ymm5, ymm6, ymm7, ymm8, ymm9, ymm10, ymm11, ymm12, ymm13, ymm14,
    ymm15,
];
const XMM: [AsmRegisterXmm; 32] = [
    xmm0, xmm1, xmm2, xmm3, xmm4, xmm5, xmm6, xmm7, xmm8, xmm9, xmm10, xmm11, xmm12, xmm13, xmm14,
    xmm15, xmm16, xmm17, xmm18, xmm19, xmm20, xmm21, xmm22, xmm23, xmm24, xmm25, xmm26, xmm27,
    xmm28, xmm29, xmm30, xmm31,
];

type R<T> = Result<T, String>;

/// k steps per loop iteration. Measured on Zen 5 (512^3): 1, 2 and 4 run alike within
/// noise, so the loop stays short.
const UNROLL: usize = 1;

/// Bytes ahead of the A stream to prefetch.
const A_PREFETCH: i64 = 1024;

/// k steps ahead of the B stream to prefetch. Measured on an Intel core with two 512-bit
/// FMA ports (interleaved A/B runs): 8 to 16 steps ahead took 3-4% off a 512^3 GEMM and
/// 2-7% off ResNet-18, BERT and ViT; without it the FMAs wait on B's second vector.
const B_PREFETCH_STEPS: i64 = 12;

fn e(x: IcedError) -> String {
    format!("x86 gemm assembly: {x}")
}

/// `r += x`, through `tmp` when x needs 64 bits.
pub(super) fn add_imm(
    a: &mut CodeAssembler,
    r: AsmRegister64,
    x: i64,
    tmp: AsmRegister64,
) -> R<()> {
    if x == 0 {
        return Ok(());
    }
    if let Ok(v) = i32::try_from(x) {
        a.add(r, v).map_err(e)?;
    } else {
        a.mov(tmp, x).map_err(e)?;
        a.add(r, tmp).map_err(e)?;
    }
    Ok(())
}

/// A displacement that must fit the instruction's 32 bits.
fn d32(x: i64) -> R<i32> {
    i32::try_from(x).map_err(|_| format!("x86 gemm: displacement {x} does not fit 32 bits"))
}

struct Gen<'s> {
    a: CodeAssembler,
    s: &'s Spec,
    mask_table: CodeLabel,
    /// The SiLU epilogue's constants, one vector each ([`SILU_CONSTS`]).
    consts: CodeLabel,
    /// The B block after the current one, fetched into L2 by the tiles being emitted.
    far: Option<Far>,
}

/// How the whole row tiles of a B block fetch the next B block into L2 (see
/// [`Gen::rows`]): row tile `r` of every panel fetches `per_tile` bytes of that panel's
/// next block from `rbx + base + r * per_tile` (held in rdx), `lines` lines every
/// `every` k steps.
#[derive(Clone, Copy)]
struct Far {
    base: i64,
    per_tile: i64,
    lines: usize,
    every: usize,
}

/// SiLU's constants: Cephes' `expf` (as in the Cranelift back end's vmath) with the
/// argument clamped to [-87.34, 89] and n rounded by the rounding instruction, FMA for
/// the reduction and the polynomial. AVX2 scales by 2^(n - 1), a normal float for n up
/// to 128, then doubles: e^89 overflows to infinity, so x below -88.72 (where f32's
/// sigmoid is subnormal or 0) gives x / inf = -0, as the reference's f32 arithmetic does
/// from about -103 on; a clamp at 88 had left x / e^88, up to 7e-37 too large.
const SILU_CONSTS: [f32; 13] = [
    -1.0,                     // 0: negate
    89.0,                     // 1: clamp high
    -87.336_54,               // 2: clamp low
    std::f32::consts::LOG2_E, // 3
    0.693_359_4,              // 4: ln 2, high part
    -2.121_944_4e-4,          // 5: ln 2, low part
    1.987_569_1e-4,           // 6..11: polynomial, highest power first
    1.398_199_9e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    1.666_666_5e-1,
    5e-1,
    1.0, // 12
];
/// Slot of the integer 126 (AVX2's 2^(n - 1) from the exponent bits).
const SILU_I126: usize = 13;
/// Slots of AVX-512's clamp of x (e^-x stays a normal float), -log2 e and -ln 2's high
/// part.
const SILU_XHI: usize = 14;
const SILU_NLOG2E: usize = 15;
const SILU_NLN2HI: usize = 16;

// Registers: rdi/rsi/rdx/rcx/r8 = a/b/c/init/add on entry (saved to the stack); r8 = A at the k
// block; r9 = B at the k block and column block; r12 = A row tile; r13 = C row tile;
// rsi = init row tile; rbx = B panel; rbp = C tile; rdi = init tile; rax / r11 = A / B in
// the k-loop; rcx = k counter; r10 / r14 / r15 = column / row / k-block loop counters.
const SAVED: [AsmRegister64; 6] = [rbx, rbp, r12, r13, r14, r15];
/// Stack bytes for the entry arguments (the fifth only with an add view).
fn frame(s: &Spec) -> i32 {
    if s.add {
        40
    } else {
        32
    }
}

/// Assembles the function for `s`.
pub fn generate(s: &Spec) -> R<Vec<u8>> {
    if s.amx {
        return super::amx::generate(s);
    }
    if s.m == 0
        || s.n == 0
        || s.k == 0
        || s.kc == 0
        || s.nc == 0
        || !s.nc.is_multiple_of(s.isa.nr())
    {
        return Err("x86 gemm: empty or badly blocked shape".into());
    }
    if s.int8.is_some() && (s.isa != Isa::Avx512 || s.add || s.act != ActBits::None) {
        return Err("x86 gemm: an 8-bit product is AVX-512 without add or activation".into());
    }
    if let Some((_, ics)) = s.init {
        if ics != 0 && ics != 4 {
            return Err("x86 gemm: init columns must be contiguous or broadcast".into());
        }
    }
    // Every displacement the code uses must fit 32 bits.
    let mr = s.isa.mr() as i64;
    let nr = s.isa.nr() as i64;
    for x in [
        s.a_tile,
        (mr - 1) * s.a_row,
        s.a_k * s.kc as i64,
        s.b_panel,
        s.b_k * s.kc as i64,
        mr * s.c_rs,
        nr * 4,
        s.init.map_or(0, |(r, _)| r * mr),
    ] {
        d32(x)?;
    }
    let mut g = Gen {
        a: CodeAssembler::new(64).map_err(e)?,
        s,
        mask_table: CodeLabel::default(),
        consts: CodeLabel::default(),
        far: None,
    };
    g.mask_table = g.a.create_label();
    g.consts = g.a.create_label();
    g.body()?;
    g.a.assemble(0).map_err(e)
}

impl Gen<'_> {
    fn body(&mut self) -> R<()> {
        let s = self.s;
        for r in SAVED {
            self.a.push(r).map_err(e)?;
        }
        self.a.sub(rsp, frame(s)).map_err(e)?;
        self.a.mov(qword_ptr(rsp), rdi).map_err(e)?;
        self.a.mov(qword_ptr(rsp + 8), rsi).map_err(e)?;
        self.a.mov(qword_ptr(rsp + 16), rdx).map_err(e)?;
        self.a.mov(qword_ptr(rsp + 24), rcx).map_err(e)?;
        if s.add {
            self.a.mov(qword_ptr(rsp + 32), r8).map_err(e)?;
        }
        // k blocks: (start, length); consecutive blocks of one length form a loop.
        let mut blocks = Vec::new();
        let mut p = 0;
        while p < s.k {
            let kc = s.kc.min(s.k - p);
            blocks.push((p, kc));
            p += kc;
        }
        let nb = blocks.len();
        let mut jc = 0;
        while jc < s.n {
            let ncb = s.nc.min(s.n - jc);
            // Groups: first block, the middle ones (looped), the last block.
            let mut groups: Vec<(usize, usize, usize, bool, bool)> = Vec::new();
            for (bi, &(p0, kc)) in blocks.iter().enumerate() {
                let first = bi == 0;
                let last = bi + 1 == nb;
                match groups.last_mut() {
                    Some(gr) if !first && !last && !gr.3 && !gr.4 && gr.1 == kc => gr.2 += 1,
                    _ => groups.push((p0, kc, 1, first, last)),
                }
            }
            for (p0, kc, count, first, last) in groups {
                self.group(jc, ncb, p0, kc, count, first, last)?;
            }
            jc += ncb;
        }
        if s.isa == Isa::Avx2 || s.isa == Isa::Avx512 {
            self.a.vzeroupper().map_err(e)?;
        }
        self.a.add(rsp, frame(s)).map_err(e)?;
        for r in SAVED.iter().rev() {
            self.a.pop(*r).map_err(e)?;
        }
        self.a.ret().map_err(e)?;
        // AVX2 column-edge masks: 8 x -1 then 8 x 0; a mask of L lanes starts at 8 - L.
        self.a.set_label(&mut self.mask_table).map_err(e)?;
        let mut t = [0u32; 16];
        t[..8].fill(u32::MAX);
        self.a.dd(&t).map_err(e)?;
        if self.s.act == ActBits::Silu {
            self.a.set_label(&mut self.consts).map_err(e)?;
            let lanes = self.s.isa.lanes();
            for c in SILU_CONSTS {
                self.a.dd(&vec![c.to_bits(); lanes]).map_err(e)?;
            }
            self.a.dd(&vec![126u32; lanes]).map_err(e)?;
            for c in [87.336_54f32, -std::f32::consts::LOG2_E, -0.693_359_4] {
                self.a.dd(&vec![c.to_bits(); lanes]).map_err(e)?;
            }
        }
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn group(
        &mut self,
        jc: usize,
        ncb: usize,
        p0: usize,
        kc: usize,
        count: usize,
        first: bool,
        last: bool,
    ) -> R<()> {
        let s = self.s;
        // r8 = a + p0 * a_k; r9 = b + p0 * b_k + B's column jc.
        self.a.mov(r8, qword_ptr(rsp)).map_err(e)?;
        self.add_imm(r8, p0 as i64 * s.a_k)?;
        self.a.mov(r9, qword_ptr(rsp + 8)).map_err(e)?;
        self.add_imm(r9, p0 as i64 * s.b_k + self.b_col(jc))?;
        let mut top = self.a.create_label();
        if count > 1 {
            self.a.mov(r15, count as u64).map_err(e)?;
            self.a.set_label(&mut top).map_err(e)?;
        }
        self.rows(jc, ncb, kc, first, last)?;
        if count > 1 {
            self.add_imm(r8, kc as i64 * s.a_k)?;
            self.add_imm(r9, kc as i64 * s.b_k)?;
            self.a.dec(r15).map_err(e)?;
            self.a.jne(top).map_err(e)?;
        }
        Ok(())
    }

    /// Bytes from B to its column `j` (at k = 0): `(j / (g NR)) * b_panel + (j % (g NR)) * 4`.
    fn b_col(&self, j: usize) -> i64 {
        let gw = self.s.b_group.max(1) * self.s.isa.nr();
        (j / gw) as i64 * self.s.b_panel + (j % gw * 4) as i64
    }

    fn add_imm(&mut self, r: AsmRegister64, x: i64) -> R<()> {
        add_imm(&mut self.a, r, x, rax)
    }

    fn rows(&mut self, jc: usize, ncb: usize, kc: usize, first: bool, last: bool) -> R<()> {
        let s = self.s;
        let mr = s.isa.mr();
        self.a.mov(r12, r8).map_err(e)?;
        self.a.mov(r13, qword_ptr(rsp + 16)).map_err(e)?;
        self.add_imm(r13, jc as i64 * 4)?;
        if let Some((_, ics)) = s.init {
            self.a.mov(rsi, qword_ptr(rsp + 24)).map_err(e)?;
            self.add_imm(rsi, jc as i64 * ics)?;
        }
        let full = s.m / mr;
        let rem = s.m % mr;
        if full > 0 {
            self.far = self.far_plan(jc, ncb, kc, full, last);
            let mut top = self.a.create_label();
            self.a.mov(r14, full as u64).map_err(e)?;
            self.a.set_label(&mut top).map_err(e)?;
            self.cols(mr, ncb, kc, first, last)?;
            self.add_imm(r12, s.a_tile)?;
            self.add_imm(r13, mr as i64 * s.c_rs)?;
            if let Some((irs, _)) = s.init {
                self.add_imm(rsi, mr as i64 * irs)?;
            }
            self.a.dec(r14).map_err(e)?;
            self.a.jne(top).map_err(e)?;
            self.far = None;
        }
        if rem > 0 {
            self.cols(rem, ncb, kc, first, last)?;
        }
        Ok(())
    }

    /// The next B block's fetch, when B outgrows one block (then it streams from L3 or
    /// memory on every call: ResNet-18's 7x7 layers read 9 MB of weights each, and the
    /// first row tile of each block waited on them). The next block is the next k block
    /// of these columns, or after the last one the next column block's first; spread over
    /// the `full` whole row tiles, the fetch asks the memory for about as many bytes per
    /// cycle as the tiles consume, instead of bursts on the first tile.
    fn far_plan(&self, jc: usize, ncb: usize, kc: usize, full: usize, last: bool) -> Option<Far> {
        let s = self.s;
        let delta = if !last {
            kc as i64 * s.b_k
        } else if jc + ncb < s.n {
            // From this block's (k = k - kc, column jc) to (k = 0, column jc + ncb).
            self.b_col(jc + ncb) - self.b_col(jc) - (s.k - kc) as i64 * s.b_k
        } else {
            return None;
        };
        // Lines of B per k step, and how the tiles share them.
        let lines = (s.isa.nr() * 4).div_ceil(64);
        let (every, per_step) = if full >= lines {
            ((full / lines).min(4), 1)
        } else {
            (1, lines.div_ceil(full))
        };
        let per_tile = (kc.div_ceil(every) * per_step * 64) as i64;
        let base = delta + full as i64 * per_tile;
        // The displacements and the immediate must fit 32 bits.
        d32(base.abs() + per_tile * full as i64).ok()?;
        Some(Far {
            base,
            per_tile,
            lines: per_step,
            every,
        })
    }

    fn cols(&mut self, rows: usize, ncb: usize, kc: usize, first: bool, last: bool) -> R<()> {
        let s = self.s;
        let nr = s.isa.nr();
        self.a.mov(rbx, r9).map_err(e)?;
        self.a.mov(rbp, r13).map_err(e)?;
        if s.init.is_some() {
            self.a.mov(rdi, rsi).map_err(e)?;
        }
        let full = ncb / nr;
        let rem = ncb % nr;
        // Whole B panels of g tiles (looped), then the tiles left.
        let g = s.b_group.max(1);
        let (loops, left) = (full / g, full % g);
        // The B step after tile q of a panel: along the panel, or to the next panel.
        let step = |q: usize| {
            if q + 1 == g {
                s.b_panel - ((g - 1) * nr * 4) as i64
            } else {
                (nr * 4) as i64
            }
        };
        if loops > 0 {
            let mut top = self.a.create_label();
            self.a.mov(r10, loops as u64).map_err(e)?;
            self.a.set_label(&mut top).map_err(e)?;
            for q in 0..g {
                self.tile(rows, nr, kc, first, last)?;
                self.add_imm(rbx, step(q))?;
                self.add_imm(rbp, nr as i64 * 4)?;
                if let Some((_, ics)) = s.init {
                    self.add_imm(rdi, nr as i64 * ics)?;
                }
            }
            self.a.dec(r10).map_err(e)?;
            self.a.jne(top).map_err(e)?;
        }
        for q in 0..left {
            self.tile(rows, nr, kc, first, last)?;
            self.add_imm(rbx, step(q))?;
            self.add_imm(rbp, nr as i64 * 4)?;
            if let Some((_, ics)) = s.init {
                self.add_imm(rdi, nr as i64 * ics)?;
            }
        }
        if rem > 0 {
            self.tile(rows, rem, kc, first, last)?;
        }
        Ok(())
    }

    /// One register tile of `rows x cols` at rbp (C), rdi (init), r12 (A), rbx (B).
    fn tile(&mut self, rows: usize, cols: usize, kc: usize, first: bool, last: bool) -> R<()> {
        let s = self.s;
        let lanes = s.isa.lanes();
        let nv = cols.div_ceil(lanes);
        let tail = cols - (nv - 1) * lanes;
        let masked = tail < lanes;
        if masked {
            match s.isa {
                Isa::Avx512 => {
                    self.a.mov(eax, (1u32 << tail) - 1).map_err(e)?;
                    self.a.kmovw(k1, eax).map_err(e)?;
                }
                Isa::Avx2 => {
                    // (A label operand cannot take an offset: it names the label.)
                    let off = ((lanes - tail) * 4) as i32;
                    self.a.lea(rax, ptr(self.mask_table)).map_err(e)?;
                    self.a.vmovups(ymm15, ymmword_ptr(rax + off)).map_err(e)?;
                }
            }
        }
        let msk = |v: usize| masked && v + 1 == nv;
        let sets = self.sets(rows, kc);
        // Accumulators: C, the init view, or zero (the other sets' zero).
        for r in 2 * rows..2 * rows * sets {
            self.zero(r)?;
        }
        let load_c = !first || s.init_is_c;
        let load_init = first && !s.init_is_c && s.init.is_some();
        for i in 0..rows {
            for v in 0..nv {
                let acc = 2 * i + v;
                if load_c {
                    let at = rbp + d32(i as i64 * s.c_rs + (v * lanes * 4) as i64)?;
                    self.load(acc, at, msk(v))?;
                } else if load_init {
                    let (irs, ics) = s.init.unwrap_or((0, 0));
                    let off = d32(i as i64 * irs + (v * lanes) as i64 * ics)?;
                    if ics == 0 {
                        match s.isa {
                            Isa::Avx512 => self
                                .a
                                .vbroadcastss(ZMM[acc], dword_ptr(rdi + off))
                                .map_err(e)?,
                            Isa::Avx2 => self
                                .a
                                .vbroadcastss(YMM[acc], dword_ptr(rdi + off))
                                .map_err(e)?,
                        }
                    } else {
                        self.load(acc, rdi + off, msk(v))?;
                    }
                } else {
                    self.zero(acc)?;
                }
            }
        }
        // The k-loop, unrolled by UNROLL (or the far fetch's period); the remainder steps
        // follow it.
        self.a.mov(rax, r12).map_err(e)?;
        self.a.mov(r11, rbx).map_err(e)?;
        let far = self.far;
        if let Some(f) = far {
            // rdx = rbx + base - r14 * per_tile: row tile full - r14's share.
            self.a.imul_3(rdx, r14, d32(-f.per_tile)?).map_err(e)?;
            self.a.add(rdx, rbx).map_err(e)?;
            self.add_imm(rdx, f.base)?;
        }
        let u = far.map_or(UNROLL.max(sets), |f| f.every);
        let (iters, rest) = (kc / u, kc % u);
        if iters > 0 {
            self.a.mov(ecx, iters as u32).map_err(e)?;
            let mut top = self.a.create_label();
            self.a.set_label(&mut top).map_err(e)?;
            for q in 0..u as i64 {
                if let (Some(f), 0) = (far, q) {
                    for l in 0..f.lines as i32 {
                        self.a.prefetcht1(byte_ptr(rdx + 64 * l)).map_err(e)?;
                    }
                    self.add_imm(rdx, 64 * f.lines as i64)?;
                }
                let set = q as usize % sets;
                self.kstep(rows, nv, masked, set, q * s.a_k, q * s.b_k)?;
            }
            self.add_imm(rax, u as i64 * s.a_k)?;
            self.add_imm(r11, u as i64 * s.b_k)?;
            self.a.dec(ecx).map_err(e)?;
            self.a.jne(top).map_err(e)?;
        }
        for q in 0..rest as i64 {
            let set = q as usize % sets;
            self.kstep(rows, nv, masked, set, q * s.a_k, q * s.b_k)?;
        }
        self.sum_sets(rows, nv, sets)?;
        if last && s.add {
            // rax = add - C (bytes): the k-loop is done with it.
            self.a.mov(rax, qword_ptr(rsp + 32)).map_err(e)?;
            for i in 0..rows {
                for v in 0..nv {
                    let at = rbp + rax + d32(i as i64 * s.c_rs + (v * lanes * 4) as i64)?;
                    self.add_from(2 * i + v, at, msk(v))?;
                }
            }
        }
        if last {
            self.act(rows, nv)?;
        }
        for i in 0..rows {
            for v in 0..nv {
                let at = rbp + d32(i as i64 * s.c_rs + (v * lanes * 4) as i64)?;
                self.store(2 * i + v, at, msk(v))?;
            }
        }
        Ok(())
    }

    /// How many sets of accumulators a tile of `rows` sums its k steps into, in turn
    /// (step p into set p % sets), added together after the k-loop. A tile of few rows
    /// has few accumulators, each a chain of dependent multiply-adds: with one set, a
    /// 1 x 32 tile (two chains) waits on the FMA's latency (4 cycles) at every step,
    /// where more independent chains let the loads of B set the pace. Only for GEMMs of
    /// at most [`FEW_ROWS`] rows (a batch-1 layer's GEMV), whose tiles leave registers
    /// free: `sets * rows <= MR`, at most 4.
    fn sets(&self, rows: usize, kc: usize) -> usize {
        if self.s.m > FEW_ROWS || kc < 8 {
            return 1;
        }
        (self.s.isa.mr() / rows).clamp(1, 4)
    }

    /// Adds accumulator sets `1..sets` into set 0 (pairwise).
    fn sum_sets(&mut self, rows: usize, nv: usize, sets: usize) -> R<()> {
        let mut live = sets;
        while live > 1 {
            let half = live.div_ceil(2);
            for q in half..live {
                for i in 0..rows {
                    for v in 0..nv {
                        let (d, x) = (2 * i + v + 2 * rows * (q - half), 2 * i + v + 2 * rows * q);
                        match self.s.isa {
                            Isa::Avx512 if self.s.int8.is_some() => {
                                self.a.vpaddd(ZMM[d], ZMM[d], ZMM[x])
                            }
                            Isa::Avx512 => self.a.vaddps(ZMM[d], ZMM[d], ZMM[x]),
                            Isa::Avx2 => self.a.vaddps(YMM[d], YMM[d], YMM[x]),
                        }
                        .map_err(e)?;
                    }
                }
            }
            live = half;
        }
        Ok(())
    }

    /// One k step of the tile into accumulator set `set` (see [`Gen::sets`]): B vectors
    /// at r11 + `db`, A broadcasts at rax + `da`.
    fn kstep(
        &mut self,
        rows: usize,
        nv: usize,
        masked: bool,
        set: usize,
        da: i64,
        db: i64,
    ) -> R<()> {
        let s = self.s;
        let base = 2 * rows * set;
        let bmask = |v: usize| masked && v + 1 == nv && !s.b_padded;
        // A packed as [m/MR][k][MR] is one sequential stream (from memory when the
        // weights outgrow the caches): fetch it ahead, once per k step.
        if s.a_row == 4 && s.a_k == s.isa.mr() as i64 * 4 {
            self.a
                .prefetcht0(byte_ptr(rax + d32(da + A_PREFETCH)?))
                .map_err(e)?;
        }
        // The B panel streams from L2 (the A tile is what stays in L1): fetch the lines
        // of a later k step into L1 now. Not with few rows: then B streams once, from L3
        // or memory, where the hardware's prefetch runs ahead of it alone, and ours got
        // in its way (the zoo MLP's 1.6 and 1 MB layers: 28 us a run without it, 38
        // with it, on Zen 4).
        let lines = if s.m <= FEW_ROWS {
            0
        } else {
            (nv * s.isa.lanes() * 4).div_ceil(64) as i64
        };
        for l in 0..lines {
            let at = db + B_PREFETCH_STEPS * s.b_k + 64 * l;
            self.a.prefetcht0(byte_ptr(r11 + d32(at)?)).map_err(e)?;
        }
        match s.isa {
            Isa::Avx512 => {
                for v in 0..nv {
                    let at = zmmword_ptr(r11 + d32(db + (v * 64) as i64)?);
                    if bmask(v) {
                        self.a
                            .vmovups(ZMM[2 * s.isa.mr() + v].k1().z(), at)
                            .map_err(e)?;
                    } else {
                        self.a.vmovups(ZMM[2 * s.isa.mr() + v], at).map_err(e)?;
                    }
                }
                if nv == 1 && s.int8.is_none() {
                    for i in 0..rows {
                        let at = dword_bcst(rax + d32(da + i as i64 * s.a_row)?);
                        for v in 0..nv {
                            self.a
                                .vfmadd231ps(ZMM[base + 2 * i + v], ZMM[2 * s.isa.mr() + v], at)
                                .map_err(e)?;
                        }
                    }
                } else {
                    // One broadcast per A element, shared by the row's two FMAs: an
                    // embedded broadcast loads it once per FMA, which measured 8%
                    // slower on a 512^3 GEMM (Intel, two 512-bit FMA ports). An 8-bit
                    // product always broadcasts: `vpdpbusd` takes its unsigned operand
                    // first, the signed one second (the broadcast A dword and B, or B
                    // and A when A is the signed one).
                    for i in 0..rows {
                        let t = ZMM[30 + (i & 1)];
                        let at = dword_ptr(rax + d32(da + i as i64 * s.a_row)?);
                        if s.int8.is_some() {
                            self.a.vpbroadcastd(t, at).map_err(e)?;
                        } else {
                            self.a.vbroadcastss(t, at).map_err(e)?;
                        }
                        for v in 0..nv {
                            let (acc, bv) = (ZMM[base + 2 * i + v], ZMM[2 * s.isa.mr() + v]);
                            match s.int8 {
                                Some(Int8::UnsignedA) => self.a.vpdpbusd(acc, t, bv),
                                Some(Int8::SignedA) => self.a.vpdpbusd(acc, bv, t),
                                None => self.a.vfmadd231ps(acc, bv, t),
                            }
                            .map_err(e)?;
                        }
                    }
                }
            }
            Isa::Avx2 => {
                for v in 0..nv {
                    let at = ymmword_ptr(r11 + d32(db + (v * 32) as i64)?);
                    if bmask(v) {
                        self.a.vmaskmovps(YMM[12 + v], ymm15, at).map_err(e)?;
                    } else {
                        self.a.vmovups(YMM[12 + v], at).map_err(e)?;
                    }
                }
                for i in 0..rows {
                    let at = dword_ptr(rax + d32(da + i as i64 * s.a_row)?);
                    self.a.vbroadcastss(ymm14, at).map_err(e)?;
                    for v in 0..nv {
                        self.a
                            .vfmadd231ps(YMM[base + 2 * i + v], YMM[12 + v], ymm14)
                            .map_err(e)?;
                    }
                }
            }
        }
        Ok(())
    }

    fn load(&mut self, acc: usize, at: AsmMemoryOperand, masked: bool) -> R<()> {
        match (self.s.isa, masked) {
            (Isa::Avx512, false) => self.a.vmovups(ZMM[acc], zmmword_ptr(at)),
            (Isa::Avx512, true) => self.a.vmovups(ZMM[acc].k1().z(), zmmword_ptr(at)),
            (Isa::Avx2, false) => self.a.vmovups(YMM[acc], ymmword_ptr(at)),
            (Isa::Avx2, true) => self.a.vmaskmovps(YMM[acc], ymm15, ymmword_ptr(at)),
        }
        .map_err(e)
    }

    /// `acc += [at]` (masked: the edge lanes only; AVX2 loads through ymm14, free after
    /// the k-loop).
    fn add_from(&mut self, acc: usize, at: AsmMemoryOperand, masked: bool) -> R<()> {
        match (self.s.isa, masked) {
            (Isa::Avx512, false) => self.a.vaddps(ZMM[acc], ZMM[acc], zmmword_ptr(at)),
            // Merge-masked: the lanes past the edge are not read (no fault) and not stored.
            (Isa::Avx512, true) => self.a.vaddps(ZMM[acc].k1(), ZMM[acc], zmmword_ptr(at)),
            (Isa::Avx2, false) => self.a.vaddps(YMM[acc], YMM[acc], ymmword_ptr(at)),
            (Isa::Avx2, true) => {
                self.a
                    .vmaskmovps(ymm14, ymm15, ymmword_ptr(at))
                    .map_err(e)?;
                self.a.vaddps(YMM[acc], YMM[acc], ymm14)
            }
        }
        .map_err(e)
    }

    fn store(&mut self, acc: usize, at: AsmMemoryOperand, masked: bool) -> R<()> {
        match (self.s.isa, masked) {
            (Isa::Avx512, false) => self.a.vmovups(zmmword_ptr(at), ZMM[acc]),
            (Isa::Avx512, true) => self.a.vmovups(zmmword_ptr(at).k1(), ZMM[acc]),
            (Isa::Avx2, false) => self.a.vmovups(ymmword_ptr(at), YMM[acc]),
            (Isa::Avx2, true) => self.a.vmaskmovps(ymmword_ptr(at), ymm15, YMM[acc]),
        }
        .map_err(e)
    }

    fn zero(&mut self, r: usize) -> R<()> {
        match self.s.isa {
            Isa::Avx512 => self.a.vxorps(ZMM[r], ZMM[r], ZMM[r]),
            Isa::Avx2 => self.a.vxorps(YMM[r], YMM[r], YMM[r]),
        }
        .map_err(e)
    }

    /// Broadcasts the f32 `bits` into vector register `r` (through eax).
    fn splat(&mut self, r: usize, bits: u32) -> R<()> {
        self.a.mov(eax, bits).map_err(e)?;
        match self.s.isa {
            // EVEX broadcast from a general register: VEX vmovd cannot name xmm16..31.
            Isa::Avx512 => self.a.vpbroadcastd(ZMM[r], eax),
            Isa::Avx2 => {
                self.a.vmovd(XMM[r], eax).map_err(e)?;
                self.a.vbroadcastss(YMM[r], XMM[r])
            }
        }
        .map_err(e)
    }

    /// The activation on the accumulators (constants in registers the k-loop is done with:
    /// zmm24..29 or ymm12..14).
    fn act(&mut self, rows: usize, nv: usize) -> R<()> {
        let (c0, c1) = match self.s.isa {
            Isa::Avx512 => (2 * self.s.isa.mr(), 2 * self.s.isa.mr() + 1),
            Isa::Avx2 => (12, 13),
        };
        let regs: Vec<usize> = (0..rows)
            .flat_map(|i| (0..nv).map(move |v| 2 * i + v))
            .collect();
        match self.s.act {
            ActBits::None => {}
            ActBits::Relu => {
                self.zero(c0)?;
                for &r in &regs {
                    self.vmax(r, r, c0)?;
                }
            }
            ActBits::Clip(lo, hi) => {
                self.splat(c0, lo)?;
                self.splat(c1, hi)?;
                for &r in &regs {
                    self.vmax(r, r, c0)?;
                    match self.s.isa {
                        Isa::Avx512 => self.a.vminps(ZMM[r], ZMM[r], ZMM[c1]),
                        Isa::Avx2 => self.a.vminps(YMM[r], YMM[r], YMM[c1]),
                    }
                    .map_err(e)?;
                }
            }
            ActBits::Silu => match self.s.isa {
                Isa::Avx512 => self.silu512(&regs)?,
                Isa::Avx2 => self.silu256(&regs)?,
            },
            ActBits::Leaky(alpha) => {
                self.splat(c0, alpha)?;
                match self.s.isa {
                    Isa::Avx512 => {
                        self.zero(c1)?;
                        for &r in &regs {
                            // k2 = x < 0 (LT_OS); x{k2} = x * alpha.
                            self.a.vcmpps(k2, ZMM[r], ZMM[c1], 1).map_err(e)?;
                            self.a.vmulps(ZMM[r].k2(), ZMM[r], ZMM[c0]).map_err(e)?;
                        }
                    }
                    Isa::Avx2 => {
                        for &r in &regs {
                            // Blend in x * alpha where the sign bit of x is set.
                            self.a.vmulps(YMM[c1], YMM[r], YMM[c0]).map_err(e)?;
                            self.a
                                .vblendvps(YMM[r], YMM[r], YMM[c1], YMM[r])
                                .map_err(e)?;
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// `x / (1 + exp(-x))` on each accumulator, two at a time, each pair's instructions
    /// interleaved (zmm24..26 and zmm27..29 as temporaries): one accumulator's chain is
    /// about 22 dependent instructions, and the out-of-order window holds few of them.
    fn silu512(&mut self, regs: &[usize]) -> R<()> {
        let t = 2 * self.s.isa.mr();
        self.a.lea(rax, ptr(self.consts)).map_err(e)?;
        let c = |i: usize| zmmword_ptr(rax + (64 * i) as i32);
        for pair in regs.chunks(2) {
            // (x, t1, t2, t3) per accumulator of the pair.
            let quads: Vec<_> = pair
                .iter()
                .enumerate()
                .map(|(j, &r)| {
                    (
                        ZMM[r],
                        ZMM[t + 3 * j],
                        ZMM[t + 3 * j + 1],
                        ZMM[t + 3 * j + 2],
                    )
                })
                .collect();
            let a = &mut self.a;
            macro_rules! each {
                (|$x:ident, $t1:ident, $t2:ident, $t3:ident| $body:expr) => {
                    for &($x, $t1, $t2, $t3) in &quads {
                        let _ = ($x, $t1, $t2, $t3);
                        $body.map_err(e)?;
                    }
                };
            }
            // n = round(-x log2 e) on x clamped above (e^-x stays normal), r = -x - n ln 2
            // in two parts.
            each!(|x, t1, t2, t3| a.vminps(t1, x, c(SILU_XHI)));
            each!(|x, t1, t2, t3| a.vmulps(t2, t1, c(SILU_NLOG2E)));
            each!(|x, t1, t2, t3| a.vrndscaleps(t2, t2, 0));
            each!(|x, t1, t2, t3| a.vfmsub231ps(t1, t2, c(SILU_NLN2HI)));
            each!(|x, t1, t2, t3| a.vfnmadd231ps(t1, t2, c(5)));
            // e^r = 1 + r (1 + r P(r)) as one Horner chain of fused multiply-adds.
            each!(|x, t1, t2, t3| a.vmovups(t3, c(6)));
            for i in 7..12 {
                each!(|x, t1, t2, t3| a.vfmadd213ps(t3, t1, c(i)));
            }
            each!(|x, t1, t2, t3| a.vfmadd213ps(t3, t1, c(12)));
            each!(|x, t1, t2, t3| a.vfmadd213ps(t3, t1, c(12)));
            // d = 1 + e^r 2^n (infinite for x below about -88: x / d is then -0), and
            // x / d by the division instruction: on Zen 4 its unit runs beside the FMA
            // pipes, and the 14-bit reciprocal with a Newton step (four instructions
            // there) made a 96x12544x16 GEMM with this epilogue 11% slower.
            each!(|x, t1, t2, t3| a.vscalefps(t3, t3, t2));
            each!(|x, t1, t2, t3| a.vaddps(t3, t3, c(12)));
            each!(|x, t1, t2, t3| a.vdivps(x, x, t3));
        }
        Ok(())
    }

    /// As [`silu512`](Self::silu512) on ymm12..14, 2^n built in the exponent bits.
    fn silu256(&mut self, regs: &[usize]) -> R<()> {
        let (t1, t2, t3) = (ymm12, ymm13, ymm14);
        self.a.lea(rax, ptr(self.consts)).map_err(e)?;
        let c = |i: usize| ymmword_ptr(rax + (32 * i) as i32);
        for &r in regs {
            let x = YMM[r];
            let a = &mut self.a;
            a.vmulps(t1, x, c(0)).map_err(e)?;
            a.vminps(t1, t1, c(1)).map_err(e)?;
            a.vmaxps(t1, t1, c(2)).map_err(e)?;
            a.vmulps(t2, t1, c(3)).map_err(e)?;
            a.vroundps(t2, t2, 0).map_err(e)?;
            a.vfnmadd231ps(t1, t2, c(4)).map_err(e)?;
            a.vfnmadd231ps(t1, t2, c(5)).map_err(e)?;
            a.vmovups(t3, c(6)).map_err(e)?;
            for i in 7..12 {
                a.vfmadd213ps(t3, t1, c(i)).map_err(e)?;
            }
            a.vmulps(t3, t3, t1).map_err(e)?;
            a.vfmadd213ps(t3, t1, t1).map_err(e)?;
            a.vaddps(t3, t3, c(12)).map_err(e)?;
            a.vcvtps2dq(t2, t2).map_err(e)?;
            a.vpaddd(t2, t2, c(SILU_I126)).map_err(e)?;
            a.vpslld(t2, t2, 23).map_err(e)?;
            a.vmulps(t3, t3, t2).map_err(e)?;
            a.vaddps(t3, t3, t3).map_err(e)?;
            a.vaddps(t3, t3, c(12)).map_err(e)?;
            a.vdivps(x, x, t3).map_err(e)?;
        }
        Ok(())
    }

    fn vmax(&mut self, d: usize, x: usize, y: usize) -> R<()> {
        match self.s.isa {
            Isa::Avx512 => self.a.vmaxps(ZMM[d], ZMM[x], ZMM[y]),
            Isa::Avx2 => self.a.vmaxps(YMM[d], YMM[x], YMM[y]),
        }
        .map_err(e)
    }
}
