//! Innermost loops as AVX-512 machine code: 16 f32 lanes in zmm registers, the last
//! partial vector under a k-mask (no scalar remainder).
//!
//! Cranelift emits only 128-bit vectors on x86. The loops its f32x4 vectoriser takes
//! (elementwise chains, depthwise convolution and pooling rows, softmax and normalisation
//! passes) run four times wider here: the Cranelift back end translates a qualifying
//! kernel-IR loop into a [`Loop`], straight-line SSA over one vector of iterations, and
//! calls the function [`generate`] assembles for it:
//!
//! ```c
//! void loop(void *args);
//! ```
//!
//! `args` (see [`Loop::layout`]) holds one base pointer per stream (the address of the
//! stream's element at iteration 0, displacement 0), the loop-invariant f32 values
//! ("uniforms", used as `{1to16}` memory operands) and one 64-byte slot per reduction:
//! the caller writes the accumulator's starting value in its first 4 bytes, the loop
//! writes back the 16 partial accumulators for the caller to fold.
//!
//! The operations are IEEE operations; [`Bin::Min`] / [`Bin::Max`] propagate NaN and
//! order -0 below +0 as Cranelift's do. In exact mode the caller builds only the
//! operations kernel IR names, in its order (no FMA, the f32x4 code's `exp`/`erf`/
//! `tanh`), so a loop computes the same bits here as in 128-bit code, reductions aside
//! (their partial sums are added in another order); otherwise it contracts
//! multiply-adds ([`Inst::Fma`]) and builds shorter `exp`/`erf`/`tanh` from
//! [`Bin::MinX`], [`Bin::MaxX`] and [`Inst::Scalef`].

use iced_x86::code_asm::*;
use std::collections::HashMap;

/// A value of the loop body: the index of the instruction that makes it.
pub type V = u32;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Un {
    Neg,
    Abs,
    Sqrt,
    Floor,
    Ceil,
    /// Round half to even.
    Nearest,
    Trunc,
    /// f64 loops only: rounded to the nearest f32 (the f64 lanes then hold the f32
    /// value an f32 operation on f32 values gives: one f64 operation then this is
    /// correctly rounded, 53 >= 2 * 24 + 2 bits).
    ToF32,
    /// f64 loops only: the value of the scalar code's `u8(i64(x))` / `i8(i64(x))`
    /// (truncated toward zero, saturating, the low byte kept), as an f64.
    ByteU8,
    ByteI8,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Bin {
    Add,
    Sub,
    Mul,
    Div,
    /// NaN if either is NaN; -0 < +0.
    Min,
    Max,
    /// x86's `a < b ? a : b` / `a > b ? a : b`: `b` when either is NaN (so a clamp
    /// `MaxX(lo, MinX(hi, x))` keeps a NaN `x`).
    MinX,
    MaxX,
    /// IEEE maxNum / minNum (`vrangeps`, AVX-512DQ): the number when one operand is
    /// NaN, NaN only when both are; +0 above -0.
    MaxNum,
    MinNum,
}

/// A fused multiply-add's sign pattern: `a b + c`, `c - a b`, `a b - c` (one rounding).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FmaKind {
    Add,
    NegMulAdd,
    Sub,
}

/// An ordered comparison (false on NaN), except `Ne` (true on NaN).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Cmp {
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
}

/// How a reduction combines a value into its accumulator: `acc + v`, [`Bin::Min`] /
/// [`Bin::Max`], or the NaN-skipping `v > acc ? v : acc` / `v < acc ? v : acc`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Red {
    Add,
    Max,
    Min,
    SelGt,
    SelLt,
}

/// One instruction of the loop body. Values are f32 vectors unless noted.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Inst {
    /// The lanes of stream `s` at elements `i + disp` (i: the iteration of lane 0).
    /// `epoch` counts the stores before it, so a load is never merged across a store.
    Load {
        s: u16,
        disp: i32,
        epoch: u32,
    },
    /// The lanes of stream `s` at elements `2 (i + l) + disp` for lane `l` (every other
    /// element: the even or odd phase of a row). f32 or byte streams.
    Load2 {
        s: u16,
        disp: i32,
        epoch: u32,
    },
    /// The lanes of stream `s` at elements `stride (i + l) + disp` for lane `l`
    /// (gathered; `stride * n` fits 31 bits).
    LoadS {
        s: u16,
        disp: i32,
        stride: i32,
        epoch: u32,
    },
    /// Uniform `u` of the args block in every lane.
    Uni(u16),
    /// A constant (f32 or i32 bits) in every lane.
    Const(u32),
    Un(Un, V),
    Bin(Bin, V, V),
    /// A mask.
    Cmp(Cmp, V, V),
    /// Masks.
    MAnd(V, V),
    MOr(V, V),
    /// `mask ? a : b`.
    Select(V, V, V),
    /// i32 lanes (the same registers, reinterpreted).
    IAdd(V, V),
    ISub(V, V),
    /// Arithmetic shift right, shift left, by a constant.
    Sra(V, u8),
    Shl(V, u8),
    /// `a b + c` etc. with one rounding.
    Fma(FmaKind, V, V, V),
    /// `a * 2^floor(b)` (vscalefps; `b` an integral float).
    Scalef(V, V),
    /// `1 / a` to 14 bits (vrcp14ps).
    Rcp14(V),
    /// `v` into stream `s` at elements `step (i + l) + disp` for lane `l`, `step` 1, 2
    /// or 4 (with 2 or 4: one column phase of a row, as Winograd's output transforms
    /// write it; the elements between are left as they are). A byte stream takes steps
    /// 1 and 4 (every fourth byte: one channel of an 8-bit conv's quads).
    Store {
        s: u16,
        disp: i32,
        v: V,
        step: u8,
    },
    /// Reduction `r` takes in `v`.
    Reduce {
        r: u16,
        v: V,
    },
}

impl Inst {
    /// The values the instruction reads.
    pub(crate) fn operands(&self) -> Vec<V> {
        match *self {
            Inst::Load { .. }
            | Inst::Load2 { .. }
            | Inst::LoadS { .. }
            | Inst::Uni(_)
            | Inst::Const(_) => vec![],
            Inst::Un(_, a) | Inst::Sra(a, _) | Inst::Shl(a, _) | Inst::Rcp14(a) => vec![a],
            Inst::Fma(_, a, b, c) => vec![a, b, c],
            Inst::Bin(_, a, b)
            | Inst::Scalef(a, b)
            | Inst::Cmp(_, a, b)
            | Inst::MAnd(a, b)
            | Inst::MOr(a, b)
            | Inst::IAdd(a, b)
            | Inst::ISub(a, b) => vec![a, b],
            Inst::Select(m, a, b) => vec![m, a, b],
            Inst::Store { v, .. } | Inst::Reduce { v, .. } => vec![v],
        }
    }

    /// Whether the value lives in memory (a broadcast operand), not in a register.
    fn is_mem(&self) -> bool {
        matches!(self, Inst::Uni(_) | Inst::Const(_))
    }

    fn is_mask(&self) -> bool {
        matches!(self, Inst::Cmp(..) | Inst::MAnd(..) | Inst::MOr(..))
    }
}

/// A loop `for i in 0..n` whose body is `insts`, evaluated 16 iterations at a time;
/// with `rows > 1`, inside `for row in 0..rows`, each stream's base advancing by its
/// `row_step` (bytes) from one row to the next.
#[derive(Clone, Debug, Default)]
pub struct Loop {
    pub n: u64,
    pub rows: u64,
    /// Per stream (empty when `rows <= 1`).
    pub row_step: Vec<i64>,
    pub streams: u16,
    pub unis: u16,
    pub reds: Vec<Red>,
    pub insts: Vec<Inst>,
    /// Per stream (empty: all f32), its elements' type. Only unit-stride
    /// [`Inst::Load`]s and step-1 [`Inst::Store`]s take a stream of another type than
    /// f32.
    pub elem: Vec<Elem>,
    /// The values are f64, 8 lanes to a vector ([`Loop::lanes`]), and so are the
    /// uniforms (8 bytes each in the args block). Such a loop takes a subset of the
    /// instructions (see [`check_f64`]): unit-stride loads of f64, f32, i32 and byte
    /// streams (converted exactly), stores to f64, f32 (rounded) and byte streams, the
    /// IEEE arithmetic, rounding (to integers, and to f32: [`Un::ToF32`]), comparisons
    /// and selects; no reductions, constants or gathers.
    pub f64: bool,
}

/// The elements of a stream. Loads widen them to f32, stores narrow f32 lanes to them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Elem {
    #[default]
    F32,
    /// 2 bytes each: loads widen (`vcvtph2ps`), stores round to nearest even
    /// (`vcvtps2ph`) with a NaN stored as the canonical quiet one (sign kept), as the
    /// scalar code stores it.
    F16,
    /// 1 byte each, zero- or sign-extended by loads (`vpmovzxbd` / `vpmovsxbd`, then
    /// `vcvtdq2ps`); stores truncate toward zero and keep the low byte, as the scalar
    /// code's saturating conversion to i64 then wrap: a lane of 2^63 and above (+inf)
    /// stores 0xff, NaN 0 (`vcvttps2dq`'s 0x80000000 for NaN and out-of-range lanes has
    /// the low byte of every other case: f32 values of 2^31 and above are multiples of
    /// 256).
    U8,
    I8,
    /// 4 bytes each, an i32 converted by loads (`vcvtdq2ps`, rounding to nearest even as
    /// the scalar conversion does; `vcvtdq2pd`, exact, in f64 loops); read at unit
    /// stride only, never stored.
    I32,
    /// 8 bytes each: the elements of an f64 loop's streams ([`Loop::f64`]) only.
    F64,
}

impl Elem {
    pub fn bytes(self) -> i64 {
        match self {
            Elem::F32 | Elem::I32 => 4,
            Elem::F16 => 2,
            Elem::F64 => 8,
            Elem::U8 | Elem::I8 => 1,
        }
    }
}

/// Byte offsets of the args block.
#[derive(Clone, Copy, Debug)]
pub struct Layout {
    pub uni0: usize,
    /// Bytes per uniform: 4, or 8 in an f64 loop.
    pub uni_bytes: usize,
    pub red0: usize,
    pub bytes: usize,
}

impl Layout {
    pub fn stream(&self, s: usize) -> usize {
        8 * s
    }
    pub fn uni(&self, u: usize) -> usize {
        self.uni0 + self.uni_bytes * u
    }
    pub fn red(&self, r: usize) -> usize {
        self.red0 + 64 * r
    }
}

/// Lanes per vector (f32; an f64 loop has half as many).
pub const LANES: u64 = 16;

impl Loop {
    /// The elements of stream `s`.
    pub fn elem(&self, s: u16) -> Elem {
        self.elem.get(s as usize).copied().unwrap_or_default()
    }

    /// Whether stream `s` holds other elements than f32.
    pub fn is_narrow(&self, s: u16) -> bool {
        self.elem(s) != Elem::F32
    }

    /// Whether stream `s` holds bytes (u8 or i8).
    pub fn is_byte(&self, s: u16) -> bool {
        matches!(self.elem(s), Elem::U8 | Elem::I8)
    }

    /// Lanes per vector: 16 f32, or 8 f64.
    pub fn lanes(&self) -> u64 {
        if self.f64 {
            LANES / 2
        } else {
            LANES
        }
    }

    pub fn layout(&self) -> Layout {
        let uni0 = 8 * self.streams as usize;
        let uni_bytes = if self.f64 { 8 } else { 4 };
        let red0 = (uni0 + uni_bytes * self.unis as usize).div_ceil(8) * 8;
        Layout {
            uni0,
            uni_bytes,
            red0,
            bytes: red0 + 64 * self.reds.len(),
        }
    }
}

/// Builds a [`Loop`] with structural sharing: an instruction equal to an earlier one
/// (same operation on the same values) is that value, so repeated subexpressions are
/// computed once.
#[derive(Default)]
pub struct Builder {
    pub lp: Loop,
    memo: HashMap<Inst, V>,
    epoch: u32,
}

impl Builder {
    pub fn new(n: u64) -> Builder {
        Builder {
            lp: Loop {
                n,
                rows: 1,
                ..Default::default()
            },
            ..Default::default()
        }
    }

    pub fn push(&mut self, i: Inst) -> V {
        if !matches!(i, Inst::Store { .. } | Inst::Reduce { .. }) {
            if let Some(v) = self.memo.get(&i) {
                return *v;
            }
        }
        let v = self.lp.insts.len() as V;
        self.lp.insts.push(i);
        match i {
            Inst::Store { .. } => self.epoch += 1,
            Inst::Reduce { .. } => {}
            _ => {
                self.memo.insert(i, v);
            }
        }
        v
    }

    pub fn load(&mut self, s: u16, disp: i32) -> V {
        let epoch = self.epoch;
        self.push(Inst::Load { s, disp, epoch })
    }

    pub fn load2(&mut self, s: u16, disp: i32) -> V {
        let epoch = self.epoch;
        self.push(Inst::Load2 { s, disp, epoch })
    }

    pub fn load_strided(&mut self, s: u16, disp: i32, stride: i32) -> V {
        let epoch = self.epoch;
        self.push(Inst::LoadS {
            s,
            disp,
            stride,
            epoch,
        })
    }

    pub fn c(&mut self, x: f32) -> V {
        self.push(Inst::Const(x.to_bits()))
    }

    pub fn ci(&mut self, x: i32) -> V {
        self.push(Inst::Const(x as u32))
    }

    pub fn bin(&mut self, op: Bin, a: V, b: V) -> V {
        self.push(Inst::Bin(op, a, b))
    }

    pub fn add(&mut self, a: V, b: V) -> V {
        self.bin(Bin::Add, a, b)
    }

    pub fn sub(&mut self, a: V, b: V) -> V {
        self.bin(Bin::Sub, a, b)
    }

    pub fn mul(&mut self, a: V, b: V) -> V {
        self.bin(Bin::Mul, a, b)
    }

    pub fn cmp(&mut self, op: Cmp, a: V, b: V) -> V {
        self.push(Inst::Cmp(op, a, b))
    }

    pub fn select(&mut self, m: V, a: V, b: V) -> V {
        self.push(Inst::Select(m, a, b))
    }
}

type R<T> = Result<T, String>;

fn e(x: IcedError) -> String {
    format!("x86 loop assembly: {x}")
}

const ZMM: [AsmRegisterZmm; 32] = [
    zmm0, zmm1, zmm2, zmm3, zmm4, zmm5, zmm6, zmm7, zmm8, zmm9, zmm10, zmm11, zmm12, zmm13, zmm14,
    zmm15, zmm16, zmm17, zmm18, zmm19, zmm20, zmm21, zmm22, zmm23, zmm24, zmm25, zmm26, zmm27,
    zmm28, zmm29, zmm30, zmm31,
];
const YMM: [AsmRegisterYmm; 32] = [
    ymm0, ymm1, ymm2, ymm3, ymm4, ymm5, ymm6, ymm7, ymm8, ymm9, ymm10, ymm11, ymm12, ymm13, ymm14,
    ymm15, ymm16, ymm17, ymm18, ymm19, ymm20, ymm21, ymm22, ymm23, ymm24, ymm25, ymm26, ymm27,
    ymm28, ymm29, ymm30, ymm31,
];
const XMM: [AsmRegisterXmm; 32] = [
    xmm0, xmm1, xmm2, xmm3, xmm4, xmm5, xmm6, xmm7, xmm8, xmm9, xmm10, xmm11, xmm12, xmm13, xmm14,
    xmm15, xmm16, xmm17, xmm18, xmm19, xmm20, xmm21, xmm22, xmm23, xmm24, xmm25, xmm26, xmm27,
    xmm28, xmm29, xmm30, xmm31,
];
/// Mask registers for values (k6 is a temporary, k7 the tail mask).
const KVAL: [AsmRegisterK; 5] = [k1, k2, k3, k4, k5];
/// Stream base pointers, then: rdi = args, rax = element index, r11 = constant pool.
const STREAMS: [AsmRegister64; 12] = [rsi, rdx, rcx, r8, r9, r10, rbx, rbp, r12, r13, r14, r15];
const CALLEE_SAVED: [AsmRegister64; 6] = [rbx, rbp, r12, r13, r14, r15];

/// Where a value is while the body is emitted.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Loc {
    Z(usize),
    K(usize),
    /// A broadcast memory operand: args + offset, or constant pool + offset.
    Uni(i32),
    Pool(i32),
    /// Stores and reductions make no value.
    None,
}

struct Gen<'l> {
    a: CodeAssembler,
    lp: &'l Loop,
    lay: Layout,
    pool: CodeLabel,
    consts: Vec<u32>,
    /// Last instruction reading each value.
    last: Vec<usize>,
    /// Tile mode (see [`tile_stream`]).
    tile: Option<Tile>,
    /// Extra byte displacement of each stream's accesses (the row within a tile).
    rdisp: Vec<i32>,
    /// The row within a tile whose transposed vector a gather reads.
    tile_row: i32,
    /// Uniforms and constants held in registers for the whole call (broadcast once at
    /// entry), by the instruction that makes each: (instruction, register).
    resident: Vec<(Inst, usize)>,
    /// A register holding the even-element permutation of [`Inst::Load2`] for the whole
    /// call (loaded once at entry; else reloaded for every such load).
    perm: Option<usize>,
    /// A general register for the addresses of stride-4 accesses (`base + 8 i`, see
    /// [`Gen::quad_base`]), when the body has any.
    quad: Option<AsmRegister64>,
}

/// General registers after the streams' that a loop's code holds: with rows, the row
/// counter; in tile mode, the block's address. [`Gen::quad`] comes after them.
fn extra_gprs(lp: &Loop, tile: bool) -> usize {
    usize::from(lp.rows > 1) + usize::from(tile)
}

/// Whether the body has a stride-4 access outside tile mode (it then needs
/// [`Gen::quad`]).
fn needs_quad(lp: &Loop, tile: bool) -> bool {
    lp.insts.iter().any(|i| match i {
        Inst::Store { step, s, .. } => *step == 4 && !lp.is_byte(*s),
        Inst::LoadS { stride, .. } => *stride == 4 && !tile,
        _ => false,
    })
}

/// The gathered stream of tile mode: `s[stride (i + l) + disp]` for lane `l`.
#[derive(Clone, Copy)]
struct Tile {
    s: u16,
    stride: i32,
    /// Byte displacement.
    disp: i32,
}

/// Bytes of stack a tile of transposed vectors takes.
const TILE_BYTES: i32 = 16 * 64;

/// A tile-mode loop whose body only stores the gathered value (a transposing copy): the
/// stream and displacement of that store.
fn copy_only(lp: &Loop) -> Option<(u16, i32)> {
    match lp.insts[..] {
        [Inst::LoadS { .. }, Inst::Store {
            s,
            disp,
            v: 0,
            step: 1,
        }] => Some((s, disp)),
        _ => None,
    }
}

/// Tile mode: a loop over rows whose one gathered stream (`LoadS`) advances by one
/// element from row to row reads, for 16 rows and 16 iterations, a 16x16 block of
/// elements: the lanes of 16 plain vector loads, transposed in registers (64
/// shuffles), instead of 16 gathers (which are slow on some cores: about 22 cycles
/// each measured on Zen 4). The body then runs once per row with the gather replaced
/// by a load of that row's transposed vector. Transposing copies (channels-in-lanes
/// convolutions, their copies back) are such loops. Needs two spare general registers
/// (the row-block counter and the block's address) and no reductions.
fn tile_stream(lp: &Loop) -> Option<Tile> {
    if lp.rows < 2
        || !lp.reds.is_empty()
        || lp.streams as usize + 2 > STREAMS.len()
        || lp.elem.iter().any(|&e| e != Elem::F32)
    {
        return None;
    }
    let mut found = None;
    for i in &lp.insts {
        if let Inst::LoadS {
            s, stride, disp, ..
        } = *i
        {
            if found.is_some() {
                return None;
            }
            found = Some(Tile { s, stride, disp });
        }
    }
    let tile = found?;
    let (s, stride) = (tile.s, tile.stride);
    let fits = |x: i64| x.checked_mul(16).is_some_and(|b| i32::try_from(b).is_ok());
    let ok = lp.row_step.get(s as usize) == Some(&4)
        && lp.row_step.iter().all(|&st| fits(st))
        && fits(i64::from(stride) * 4);
    ok.then_some(tile)
}

/// Assembles `lp` for AVX-512F. Fails (and the caller keeps its 128-bit code) when the
/// body needs more registers than there are, or the loop is out of the supported range.
pub fn generate(lp: &Loop) -> R<Vec<u8>> {
    if lp.n == 0 || lp.n >= 1 << 28 {
        return Err("x86 loop: trip count out of range".into());
    }
    // With rows, the register after the streams counts them.
    let gprs = lp.streams as usize + usize::from(lp.rows > 1);
    if gprs > STREAMS.len() {
        return Err("x86 loop: too many streams".into());
    }
    if lp.rows > 1 && lp.row_step.len() != lp.streams as usize {
        return Err("x86 loop: a row step per stream".into());
    }
    if lp.rows == 0 || lp.rows >= 1 << 31 {
        return Err("x86 loop: row count out of range".into());
    }
    if lp.reds.len() > 8 {
        return Err("x86 loop: too many reductions".into());
    }
    if lp.f64 {
        check_f64(lp)?;
    } else if lp.elem.contains(&Elem::F64) {
        return Err("x86 loop: an f64 stream in an f32 loop".into());
    }
    for i in &lp.insts {
        let narrow = match *i {
            Inst::Load2 { s, .. } => lp.is_narrow(s) && !lp.is_byte(s),
            Inst::LoadS { s, .. } => lp.is_narrow(s),
            Inst::Store { s, step, .. } => {
                step != 1 && lp.is_narrow(s) && !(step == 4 && lp.is_byte(s))
            }
            _ => false,
        };
        if narrow {
            return Err("x86 loop: a narrow stream read or written with a stride".into());
        }
        if let Inst::LoadS { stride, .. } = i {
            let span = (lp.n + lp.lanes()) as i128 * i128::from(*stride);
            if span.abs() >= 1 << 31 {
                return Err("x86 loop: strided index out of range".into());
            }
        }
    }
    let mut last = vec![usize::MAX; lp.insts.len()];
    for (j, i) in lp.insts.iter().enumerate() {
        for o in i.operands() {
            let o = o as usize;
            if o >= j {
                return Err("x86 loop: a value used before it is made".into());
            }
            last[o] = j;
        }
    }
    let tile = if std::env::var_os("ONNXC_NO_TILE").is_some() || lp.f64 {
        None
    } else {
        tile_stream(lp)
    };
    let quad = needs_quad(lp, tile.is_some());
    let gprs = lp.streams as usize + extra_gprs(lp, tile.is_some());
    if gprs + usize::from(quad) > STREAMS.len() {
        return Err("x86 loop: too many streams".into());
    }
    // The uniforms and constants the body reads, in order of first use: as many as the
    // registers allow are held in registers (each a broadcast memory operand otherwise,
    // a load on every use: a 3x3 depthwise row's nine weights were nine loads per
    // vector beside its nine taps). Fewer are tried until the body fits.
    let mut mem: Vec<Inst> = Vec::new();
    for i in &lp.insts {
        if i.is_mem() && !mem.contains(i) {
            mem.push(*i);
        }
    }
    let resident_ok = tile.is_none() && std::env::var_os("ONNXC_NO_RESIDENT").is_none();
    let perm = (resident_ok && lp.insts.iter().any(|i| matches!(i, Inst::Load2 { .. })))
        .then_some(31 - lp.reds.len());
    let avail = 32 - lp.reds.len() - usize::from(perm.is_some());
    // (Each try at most the first: more than `avail` would leave no register at all.)
    let most = mem.len().min(avail.saturating_sub(MIN_FREE));
    let mut tries = vec![most, (mem.len() / 2).min(most), 0];
    tries.dedup();
    if !resident_ok {
        tries = vec![0];
    }
    let mut err = String::new();
    for n in tries {
        let mut g = Gen {
            a: CodeAssembler::new(64).map_err(e)?,
            lp,
            lay: lp.layout(),
            pool: CodeLabel::default(),
            consts: Vec::new(),
            last: last.clone(),
            tile,
            rdisp: vec![0; lp.streams as usize],
            tile_row: 0,
            quad: quad.then(|| STREAMS[gprs]),
            resident: mem[..n]
                .iter()
                .enumerate()
                .map(|(k, &i)| (i, avail - 1 - k))
                .collect(),
            perm,
        };
        g.pool = g.a.create_label();
        match g.body() {
            Ok(()) => return g.a.assemble(0).map_err(e),
            Err(m) => err = m,
        }
    }
    Err(err)
}

/// The mask of a vector's elements (relative to element `from` of a row) at or before
/// element `last`: what a masked tail's strided load may read.
fn elems_up_to(from: u32, last: u32) -> u32 {
    (0..16)
        .filter(|e| from + e <= last)
        .fold(0, |m, e| m | 1 << e)
}

/// Vector registers left free for the body when uniforms are made resident.
const MIN_FREE: usize = 12;
/// [`Inst::Load2`]'s permutation: lanes 0..16 are elements 0, 2, .., 30 from the lane-0
/// address, out of the vector there and the one at element 15 (elements 15..31).
const EVEN: [u32; 16] = [0, 2, 4, 6, 8, 10, 12, 14, 17, 19, 21, 23, 25, 27, 29, 31];

impl Gen<'_> {
    fn body(&mut self) -> R<()> {
        let lp = self.lp;
        let rows = lp.rows > 1;
        let gprs = lp.streams as usize
            + extra_gprs(lp, self.tile.is_some())
            + usize::from(self.quad.is_some());
        let saved: Vec<AsmRegister64> = STREAMS[..gprs]
            .iter()
            .copied()
            .filter(|r| CALLEE_SAVED.contains(r))
            .collect();
        for r in &saved {
            self.a.push(*r).map_err(e)?;
        }
        for (s, &reg) in STREAMS.iter().enumerate().take(lp.streams as usize) {
            let off = self.lay.stream(s) as i32;
            self.a.mov(reg, qword_ptr(rdi + off)).map_err(e)?;
        }
        self.a.lea(r11, ptr(self.pool)).map_err(e)?;
        if let Some(r) = self.perm {
            let io = self.pool_slice(&EVEN);
            self.a.vmovups(ZMM[r], zmmword_ptr(r11 + io)).map_err(e)?;
        }
        for k in 0..self.resident.len() {
            let (inst, r) = self.resident[k];
            let l = match inst {
                Inst::Uni(u) => Loc::Uni(self.lay.uni(u as usize) as i32),
                Inst::Const(bits) => Loc::Pool(self.pool_off(bits)),
                _ => return Err("x86 loop: a resident value must be uniform".into()),
            };
            let m = self.scalar(l);
            self.broadcast(ZMM[r], m)?;
        }
        // Accumulators from the top register down.
        for r in 0..lp.reds.len() {
            let off = self.lay.red(r) as i32;
            self.a
                .vbroadcastss(ZMM[31 - r], dword_ptr(rdi + off))
                .map_err(e)?;
        }
        let lanes = lp.lanes();
        let full = lp.n / lanes;
        let rem = lp.n % lanes;
        if rem > 0 {
            self.a.mov(eax, (1u32 << rem) - 1).map_err(e)?;
            self.a.kmovw(k7, eax).map_err(e)?;
        }
        let counter = STREAMS[lp.streams as usize];
        if let Some(tile) = self.tile {
            self.tiles(tile, counter)?;
            return self.epilogue(&saved);
        }
        let mut row_top = self.a.create_label();
        if rows {
            self.a.mov(counter, lp.rows).map_err(e)?;
            self.a.set_label(&mut row_top).map_err(e)?;
        }
        self.a.xor(eax, eax).map_err(e)?;
        if full > 1 {
            let mut top = self.a.create_label();
            self.a.set_label(&mut top).map_err(e)?;
            self.iteration(false)?;
            self.a.add(rax, lanes as i32).map_err(e)?;
            self.a.cmp(rax, (full * lanes) as i32).map_err(e)?;
            self.a.jne(top).map_err(e)?;
        } else if full == 1 {
            self.iteration(false)?;
            if rem > 0 {
                self.a.add(rax, lanes as i32).map_err(e)?;
            }
        }
        if rem > 0 {
            self.iteration(true)?;
        }
        if rows {
            self.advance_rows(1)?;
            self.a.dec(counter).map_err(e)?;
            self.a.jne(row_top).map_err(e)?;
        }
        self.epilogue(&saved)
    }

    /// Folds each reduction's 16 lanes into lane 0 and writes the vector back (the
    /// caller reads lane 0), restores the saved registers, returns; then the constant
    /// pool.
    ///
    /// The fold is a tree: lane `i` takes in lane `i + d` for `d` = 1, 2, 4, 8, the
    /// lower lane as the accumulator: for sums the caller's pairwise order before (the
    /// same bits), for the NaN-skipping selects the first lane holding the extreme (the
    /// lanes hold no NaN unless the incoming value was one, and then all do), as the
    /// caller's lane-by-lane fold gave. The caller folded 16 lanes from memory after the
    /// call: a softmax row of 128 spent about a third of its time there.
    fn epilogue(&mut self, saved: &[AsmRegister64]) -> R<()> {
        let lp = self.lp;
        for r in 0..lp.reds.len() {
            let acc = ZMM[31 - r];
            let (t, d, u) = (ZMM[0], ZMM[1], ZMM[2]);
            for step in 0..4 {
                match step {
                    0 => self.a.vpermilps(t, acc, 0xB1),
                    1 => self.a.vpermilps(t, acc, 0x4E),
                    2 => self.a.vshuff32x4(t, acc, acc, 0xB1),
                    _ => self.a.vshuff32x4(t, acc, acc, 0x4E),
                }
                .map_err(e)?;
                match lp.reds[r] {
                    Red::Add => self.a.vaddps(acc, acc, t).map_err(e)?,
                    // `t > acc ? t : acc`, `t < acc ? t : acc`.
                    Red::SelGt => self.a.vmaxps(acc, t, acc).map_err(e)?,
                    Red::SelLt => self.a.vminps(acc, t, acc).map_err(e)?,
                    kind @ (Red::Max | Red::Min) => {
                        self.minmax(kind == Red::Max, d, acc, Loc::Z(0), u, None)?;
                        self.a.vmovaps(acc, d).map_err(e)?;
                    }
                }
            }
            let off = self.lay.red(r) as i32;
            self.a.vmovups(zmmword_ptr(rdi + off), acc).map_err(e)?;
        }
        self.a.vzeroupper().map_err(e)?;
        for r in saved.iter().rev() {
            self.a.pop(*r).map_err(e)?;
        }
        self.a.ret().map_err(e)?;
        self.a.set_label(&mut self.pool).map_err(e)?;
        // The pool needs at least one entry for its label to name data.
        if self.consts.is_empty() {
            self.consts.push(0);
        }
        let consts = self.consts.clone();
        self.a.dd(&consts).map_err(e)?;
        Ok(())
    }

    /// Every stream's base `rows` rows on.
    fn advance_rows(&mut self, rows: i64) -> R<()> {
        for (s, &step) in self.lp.row_step.iter().enumerate() {
            let step = i32::try_from(step * rows).map_err(|_| "x86 loop: row step too large")?;
            if step != 0 {
                self.a.add(STREAMS[s], step).map_err(e)?;
            }
        }
        Ok(())
    }

    /// The rows in blocks of 16 (see [`tile_stream`]), `counter` free for the
    /// row-block count.
    fn tiles(&mut self, tile: Tile, counter: AsmRegister64) -> R<()> {
        let lp = self.lp;
        // (A copy-only loop stores its tiles straight to their rows: no stack.)
        let stack = if copy_only(lp).is_some() {
            0
        } else {
            TILE_BYTES
        };
        if stack > 0 {
            self.a.sub(rsp, stack).map_err(e)?;
        }
        let blocks = lp.rows / LANES;
        let rest = (lp.rows % LANES) as u32;
        if blocks > 0 {
            let mut top = self.a.create_label();
            self.a.mov(counter, blocks).map_err(e)?;
            self.a.set_label(&mut top).map_err(e)?;
            self.tile_rows(16, tile)?;
            self.advance_rows(16)?;
            self.a.dec(counter).map_err(e)?;
            self.a.jne(top).map_err(e)?;
        }
        if rest > 0 {
            self.tile_rows(rest, tile)?;
        }
        if stack > 0 {
            self.a.add(rsp, stack).map_err(e)?;
        }
        Ok(())
    }

    /// `nr` rows (at most 16) from the streams' current bases: every block of 16
    /// iterations, then the masked tail.
    fn tile_rows(&mut self, nr: u32, tile: Tile) -> R<()> {
        let lp = self.lp;
        let full = lp.n / LANES;
        let rem = (lp.n % LANES) as u32;
        self.a.xor(eax, eax).map_err(e)?;
        if full > 0 {
            let mut top = self.a.create_label();
            self.a.set_label(&mut top).map_err(e)?;
            self.tile_block(16, nr, tile, false)?;
            self.a.add(rax, LANES as i32).map_err(e)?;
            self.a.cmp(rax, (full * LANES) as i32).map_err(e)?;
            self.a.jne(top).map_err(e)?;
        }
        if rem > 0 {
            self.tile_block(rem, nr, tile, true)?;
        }
        Ok(())
    }

    /// Iterations `rax .. rax + ni` of `nr` rows: the gathered elements as 16 vector
    /// loads (lane = row; rows past `nr` masked off, iterations past `ni` zero),
    /// transposed onto the stack (vector = row, lane = iteration), then the body once
    /// per row.
    fn tile_block(&mut self, ni: u32, nr: u32, tile: Tile, masked: bool) -> R<()> {
        let lp = self.lp;
        let Tile {
            s: ts,
            stride,
            disp,
        } = tile;
        let addr = STREAMS[lp.streams as usize + 1];
        if nr < 16 {
            // The rows' mask (the body may have used k6 since the last block).
            let mo = self.pool_off((1u32 << nr) - 1);
            self.a.kmovw(k6, word_ptr(r11 + mo)).map_err(e)?;
        }
        self.a.imul_3(addr, rax, stride * 4).map_err(e)?;
        self.a.add(addr, STREAMS[ts as usize]).map_err(e)?;
        for i in 0..16u32 {
            let z = ZMM[i as usize];
            if i >= ni {
                self.a.vpxord(z, z, z).map_err(e)?;
                continue;
            }
            let m = zmmword_ptr(addr + (i as i32 * stride * 4 + disp));
            if nr < 16 {
                self.a.vmovups(z.k6().z(), m).map_err(e)?;
            } else {
                self.a.vmovups(z, m).map_err(e)?;
            }
        }
        if let Some((dst, ddisp)) = copy_only(lp) {
            // Each transposed vector straight to its row's store.
            let mut to = Vec::with_capacity(nr as usize);
            for r in 0..nr as i32 {
                self.rdisp[dst as usize] = (lp.row_step[dst as usize] * r as i64) as i32;
                to.push(self.stream_at(dst, ddisp));
            }
            self.rdisp.iter_mut().for_each(|d| *d = 0);
            return self.transpose16(Some((&to, masked)));
        }
        self.transpose16(None)?;
        for r in 0..nr as i32 {
            for (s, d) in self.rdisp.iter_mut().enumerate() {
                *d = (lp.row_step[s] * r as i64) as i32;
            }
            self.tile_row = r;
            self.iteration(masked)?;
        }
        self.rdisp.iter_mut().for_each(|d| *d = 0);
        Ok(())
    }

    /// zmm0..16 (vector i, lane r) transposed onto the stack: vector r at
    /// `rsp + 64 r` holds lane r of every input vector. Unpacks of 32- and 64-bit
    /// elements transpose the 4x4 blocks within 128-bit lanes, then two rounds of
    /// 128-bit lane shuffles gather each output's four blocks. With `to` (a copy-only
    /// loop), vector r goes to `to[r]` instead (rows past its length are dropped;
    /// masked: only the valid iterations' lanes, mask k7).
    fn transpose16(&mut self, to: Option<(&[AsmMemoryOperand], bool)>) -> R<()> {
        let z = |i: usize| ZMM[i];
        for i in 0..8 {
            self.a
                .vunpcklps(z(16 + 2 * i), z(2 * i), z(2 * i + 1))
                .map_err(e)?;
            self.a
                .vunpckhps(z(17 + 2 * i), z(2 * i), z(2 * i + 1))
                .map_err(e)?;
        }
        // zmm(4i + k), 128-bit lane j: column 4j + k of rows 4i .. 4i + 4.
        for i in 0..4 {
            let t = |x: usize| z(16 + 4 * i + x);
            self.a.vunpcklpd(z(4 * i), t(0), t(2)).map_err(e)?;
            self.a.vunpckhpd(z(4 * i + 1), t(0), t(2)).map_err(e)?;
            self.a.vunpcklpd(z(4 * i + 2), t(1), t(3)).map_err(e)?;
            self.a.vunpckhpd(z(4 * i + 3), t(1), t(3)).map_err(e)?;
        }
        for k in 0..4 {
            self.a.vshuff32x4(z(16), z(k), z(4 + k), 0x44).map_err(e)?;
            self.a.vshuff32x4(z(17), z(k), z(4 + k), 0xEE).map_err(e)?;
            self.a
                .vshuff32x4(z(18), z(8 + k), z(12 + k), 0x44)
                .map_err(e)?;
            self.a
                .vshuff32x4(z(19), z(8 + k), z(12 + k), 0xEE)
                .map_err(e)?;
            let outs = [
                (16, 18, 0x88, k),
                (16, 18, 0xDD, 4 + k),
                (17, 19, 0x88, 8 + k),
                (17, 19, 0xDD, 12 + k),
            ];
            for (a, b, imm, row) in outs {
                let (m, masked) = match to {
                    Some((to, _)) if row >= to.len() => continue,
                    Some((to, masked)) => (to[row], masked),
                    None => (zmmword_ptr(rsp + 64 * row as i32), false),
                };
                self.a.vshuff32x4(z(20), z(a), z(b), imm).map_err(e)?;
                if masked {
                    self.a.vmovups(m.k7(), z(20)).map_err(e)?;
                } else {
                    self.a.vmovups(m, z(20)).map_err(e)?;
                }
            }
        }
        Ok(())
    }

    /// Offset of constant `bits` in the pool.
    fn pool_off(&mut self, bits: u32) -> i32 {
        self.pool_slice(&[bits])
    }

    /// Offset of the dwords `ws` (contiguous) in the pool.
    fn pool_slice(&mut self, ws: &[u32]) -> i32 {
        let k = match self.consts.windows(ws.len()).position(|w| w == ws) {
            Some(k) => k,
            None => {
                self.consts.extend_from_slice(ws);
                self.consts.len() - ws.len()
            }
        };
        4 * k as i32
    }

    fn bcst(&self, l: Loc) -> AsmMemoryOperand {
        match (l, self.lp.f64) {
            (Loc::Uni(off), false) => dword_bcst(rdi + off),
            (Loc::Pool(off), false) => dword_bcst(r11 + off),
            (Loc::Uni(off), true) => qword_bcst(rdi + off),
            (Loc::Pool(off), true) => qword_bcst(r11 + off),
            _ => unreachable!("not a memory value"),
        }
    }

    fn scalar(&self, l: Loc) -> AsmMemoryOperand {
        match (l, self.lp.f64) {
            (Loc::Uni(off), false) => dword_ptr(rdi + off),
            (Loc::Pool(off), false) => dword_ptr(r11 + off),
            (Loc::Uni(off), true) => qword_ptr(rdi + off),
            (Loc::Pool(off), true) => qword_ptr(r11 + off),
            _ => unreachable!("not a memory value"),
        }
    }

    /// One vector of iterations at element rax; `masked`: only the lanes in k7.
    fn iteration(&mut self, masked: bool) -> R<()> {
        let lp = self.lp;
        let nred = lp.reds.len();
        let mut loc: Vec<Loc> = vec![Loc::None; lp.insts.len()];
        let nres = self.resident.len() + usize::from(self.perm.is_some());
        let mut zfree: Vec<usize> = (0..32 - nred - nres).rev().collect();
        let mut kfree: Vec<usize> = (0..KVAL.len()).rev().collect();
        for (j, inst) in lp.insts.iter().enumerate() {
            let ops = inst.operands();
            // Resident values are in their registers for the whole call.
            if let Some(&(_, r)) = self.resident.iter().find(|(i, _)| i == inst) {
                loc[j] = Loc::Z(r);
                continue;
            }
            // Memory operands need no register.
            match *inst {
                Inst::Uni(u) => {
                    loc[j] = Loc::Uni(self.lay.uni(u as usize) as i32);
                    continue;
                }
                Inst::Const(bits) => {
                    loc[j] = Loc::Pool(self.pool_off(bits));
                    continue;
                }
                _ => {}
            }
            // Registers whose value dies here (an operand may appear twice); never a
            // resident one.
            let mut dying: Vec<Loc> = Vec::new();
            for &o in &ops {
                let l = loc[o as usize];
                let resident = matches!(l, Loc::Z(r) if r >= 32 - nred - nres);
                if self.last[o as usize] == j && !dying.contains(&l) && !resident {
                    dying.push(l);
                }
            }
            // A single instruction may write a dying operand's register; min/max and
            // reductions write before they have read everything, so they take fresh ones.
            let minmax_red = matches!(inst, Inst::Reduce { r, .. }
                if matches!(lp.reds[*r as usize], Red::Max | Red::Min));
            // An every-other-element store loads its permutation into a temporary while
            // its value is still live: it too takes fresh ones.
            let fresh = matches!(
                inst,
                Inst::Bin(Bin::Min | Bin::Max, ..) | Inst::Store { step: 2 | 4, .. }
            ) || minmax_red;
            let any_mem = ops
                .iter()
                .any(|&o| matches!(loc[o as usize], Loc::Uni(_) | Loc::Pool(_)));
            let ntmp = if matches!(inst, Inst::LoadS { stride: 4, .. }) && self.tile.is_none() {
                3
            } else if minmax_red
                || matches!(
                    inst,
                    Inst::Load2 { .. }
                        | Inst::LoadS { .. }
                        | Inst::Fma(..)
                        | Inst::Store { step: 2 | 4, .. }
                )
                || matches!(inst, Inst::Store { s, .. } if lp.is_narrow(*s) || lp.f64)
            {
                2
            } else {
                usize::from(any_mem || matches!(inst, Inst::Bin(Bin::Min | Bin::Max, ..)))
            };
            if !fresh {
                release(&dying, &mut zfree, &mut kfree);
            }
            let out = if inst.is_mask() {
                Loc::K(kfree.pop().ok_or("x86 loop: out of mask registers")?)
            } else if matches!(inst, Inst::Store { .. } | Inst::Reduce { .. }) {
                Loc::None
            } else {
                Loc::Z(zfree.pop().ok_or("x86 loop: out of vector registers")?)
            };
            let mut tmp = Vec::new();
            for _ in 0..ntmp {
                tmp.push(zfree.pop().ok_or("x86 loop: out of vector registers")?);
            }
            self.emit(inst, &ops, &loc, out, &tmp, masked)?;
            for t in tmp {
                zfree.push(t);
            }
            if fresh {
                release(&dying, &mut zfree, &mut kfree);
            }
            loc[j] = out;
            // A value nobody reads frees its register at once.
            if self.last[j] == usize::MAX {
                release(&[out], &mut zfree, &mut kfree);
            }
        }
        Ok(())
    }

    /// A register holding `l` (a memory value is broadcast into scratch `tmp`).
    fn reg(&mut self, l: Loc, tmp: Option<usize>) -> R<AsmRegisterZmm> {
        Ok(match l {
            Loc::Z(r) => ZMM[r],
            Loc::Uni(_) | Loc::Pool(_) => {
                let t = tmp.ok_or("x86 loop: no scratch register")?;
                let m = self.scalar(l);
                self.broadcast(ZMM[t], m)?;
                ZMM[t]
            }
            _ => return Err("x86 loop: a mask used as a vector".into()),
        })
    }

    /// `d` = the scalar at `m` (f32, or f64 in an f64 loop) in every lane.
    fn broadcast(&mut self, d: AsmRegisterZmm, m: AsmMemoryOperand) -> R<()> {
        if self.lp.f64 {
            self.a.vbroadcastsd(d, m)
        } else {
            self.a.vbroadcastss(d, m)
        }
        .map_err(e)
    }

    /// The lanes an iteration computes: all, or the tail's (f32 lanes).
    fn valid_lanes(&self, masked: bool) -> u64 {
        if masked {
            self.lp.n % LANES
        } else {
            LANES
        }
    }

    fn kreg(l: Loc) -> R<AsmRegisterK> {
        match l {
            Loc::K(k) => Ok(KVAL[k]),
            _ => Err("x86 loop: a vector used as a mask".into()),
        }
    }

    fn stream_at(&self, s: u16, disp: i32) -> AsmMemoryOperand {
        zmmword_ptr(STREAMS[s as usize] + rax * 4 + (disp + self.rdisp[s as usize]))
    }

    /// Element `i + disp / 2` of f16 stream `s`: the 16 lanes' 32 bytes.
    fn stream_at_half(&self, s: u16, disp: i32) -> AsmMemoryOperand {
        ymmword_ptr(STREAMS[s as usize] + rax * 2 + (disp + self.rdisp[s as usize]))
    }

    /// Element `i + disp` of a stream of bytes: the 16 lanes' 16 bytes.
    fn stream_at_byte(&self, s: u16, disp: i32) -> AsmMemoryOperand {
        xmmword_ptr(STREAMS[s as usize] + rax + (disp + self.rdisp[s as usize]))
    }

    /// The same for an every-other-element access (element `2 i`): a vector's worth of
    /// iterations spans two vectors of the stream.
    fn stream_at2(&self, s: u16, disp: i32) -> AsmMemoryOperand {
        zmmword_ptr(STREAMS[s as usize] + rax * 8 + (disp + self.rdisp[s as usize]))
    }

    /// For accesses of every fourth element of stream `s` (element `4 i`, past what one
    /// address can scale): the quad register, set to the base plus `8 i`; the caller's
    /// addresses are then [`Gen::quad_at`].
    fn quad_base(&mut self, s: u16) -> R<AsmRegister64> {
        let q = self
            .quad
            .ok_or("x86 loop: no register for a stride-4 access")?;
        self.a
            .lea(q, ptr(STREAMS[s as usize] + rax * 8))
            .map_err(e)?;
        Ok(q)
    }

    /// Element `4 i + disp / 4` of stream `s`, after [`Gen::quad_base`] put its base in `q`.
    fn quad_at(&self, q: AsmRegister64, s: u16, disp: i32) -> AsmMemoryOperand {
        zmmword_ptr(q + rax * 8 + (disp + self.rdisp[s as usize]))
    }

    /// `d = max(x, y)` (or min) with NaN propagated and -0 < +0: x86's max returns its
    /// second operand on NaN or on equal zeros, so both orders are combined (and for max,
    /// or for min, picks +0 or -0), and unordered lanes get `x + y` (a NaN). `d` and `t`
    /// must differ from `x` and `y`.
    ///
    /// Where `y` is a constant (its bits `c`) other than NaN, one instruction with `y`
    /// first does (x86 returns the second operand, `x`, on NaN or equal values), but for
    /// max with +0 (`x = -0` would stay -0: adding +0 makes it +0 and keeps the rest) and
    /// min with -0 (left to the general sequence). A ReLU epilogue: 5 -> 2 instructions.
    fn minmax(
        &mut self,
        max: bool,
        d: AsmRegisterZmm,
        x: AsmRegisterZmm,
        y: Loc,
        t: AsmRegisterZmm,
        c: Option<u32>,
    ) -> R<()> {
        let (yr, ym) = match y {
            Loc::Z(r) => (Some(ZMM[r]), None),
            m => (None, Some(m)),
        };
        if let Some(m) = ym {
            let sc = self.scalar(m);
            self.a.vbroadcastss(t, sc).map_err(e)?;
        }
        let y = yr.unwrap_or(t);
        const NEG_ZERO: u32 = 0x8000_0000;
        match c {
            Some(c) if !f32::from_bits(c).is_nan() && (max || c != NEG_ZERO) => {
                if max {
                    self.a.vmaxps(d, y, x).map_err(e)?;
                    if c == 0 {
                        self.a.vaddps(d, d, y).map_err(e)?;
                    }
                } else {
                    self.a.vminps(d, y, x).map_err(e)?;
                }
                return Ok(());
            }
            _ => {}
        }
        if max {
            self.a.vmaxps(d, x, y).map_err(e)?;
            self.a.vmaxps(t, y, x).map_err(e)?;
            self.a.vpandd(d, d, t).map_err(e)?;
        } else {
            self.a.vminps(d, x, y).map_err(e)?;
            self.a.vminps(t, y, x).map_err(e)?;
            self.a.vpord(d, d, t).map_err(e)?;
        }
        // t may have been y: compare against the operands as they were.
        match (yr, ym) {
            (Some(y), _) => {
                self.a.vcmpps(k6, x, y, 3).map_err(e)?;
                self.a.vaddps(d.k6(), x, y).map_err(e)?;
            }
            (None, Some(m)) => {
                let b = self.bcst(m);
                self.a.vcmpps(k6, x, b, 3).map_err(e)?;
                let b = self.bcst(m);
                self.a.vaddps(d.k6(), x, b).map_err(e)?;
            }
            _ => unreachable!(),
        }
        Ok(())
    }

    /// `d = a b + c` (or the other sign patterns) with one rounding. At most one operand
    /// may be in memory (scratch registers `tmp` take the others); `d` may be one of
    /// the operands' registers.
    fn fma(
        &mut self,
        kind: FmaKind,
        d: AsmRegisterZmm,
        a: Loc,
        b: Loc,
        c: Loc,
        tmp: &[usize],
    ) -> R<()> {
        let is_mem = |l: Loc| matches!(l, Loc::Uni(_) | Loc::Pool(_));
        let (mut a, mut b, mut c) = (a, b, c);
        // Keep one memory operand, in b if a product operand.
        if is_mem(a) {
            std::mem::swap(&mut a, &mut b);
        }
        let mut t = tmp.iter().copied();
        if is_mem(a) {
            a = Loc::Z(self.materialize(a, t.next())?);
        }
        if is_mem(b) && is_mem(c) {
            c = Loc::Z(self.materialize(c, t.next())?);
        }
        let z = |l: Loc| match l {
            Loc::Z(r) => ZMM[r],
            _ => zmm0,
        };
        let mem = |g: &Self, l: Loc| g.bcst(l);
        macro_rules! f3 {
            ($m231:ident, $m213:ident, $m132:ident) => {{
                let (ar, cr) = (z(a), z(c));
                if !is_mem(c) && cr == d {
                    // d = a b + d
                    if is_mem(b) {
                        let bm = mem(self, b);
                        self.a.$m231(d, ar, bm)
                    } else {
                        self.a.$m231(d, ar, z(b))
                    }
                } else {
                    // d = one product operand, then d = d * other + c.
                    let (p, q) = if !is_mem(b) && z(b) == d {
                        (b, a)
                    } else {
                        (a, b)
                    };
                    if z(p) != d {
                        self.a.vmovaps(d, z(p)).map_err(e)?;
                    }
                    match (is_mem(q), is_mem(c)) {
                        (false, false) => self.a.$m213(d, z(q), cr),
                        (false, true) => {
                            let cm = mem(self, c);
                            self.a.$m213(d, z(q), cm)
                        }
                        (true, false) => {
                            let qm = mem(self, q);
                            self.a.$m132(d, cr, qm)
                        }
                        (true, true) => unreachable!("one memory operand"),
                    }
                }
            }};
        }
        match kind {
            FmaKind::Add => f3!(vfmadd231ps, vfmadd213ps, vfmadd132ps),
            FmaKind::NegMulAdd => f3!(vfnmadd231ps, vfnmadd213ps, vfnmadd132ps),
            FmaKind::Sub => f3!(vfmsub231ps, vfmsub213ps, vfmsub132ps),
        }
        .map_err(e)
    }

    /// The memory value `l` broadcast into scratch register `t`.
    fn materialize(&mut self, l: Loc, t: Option<usize>) -> R<usize> {
        let t = t.ok_or("x86 loop: no scratch register")?;
        let m = self.scalar(l);
        self.a.vbroadcastss(ZMM[t], m).map_err(e)?;
        Ok(t)
    }

    fn emit(
        &mut self,
        inst: &Inst,
        ops: &[V],
        loc: &[Loc],
        out: Loc,
        tmp: &[usize],
        masked: bool,
    ) -> R<()> {
        if self.lp.f64 {
            return self.emit64(inst, ops, loc, out, tmp, masked);
        }
        let l = |k: usize| loc[ops[k] as usize];
        let t0 = tmp.first().copied();
        let d = match out {
            Loc::Z(r) => ZMM[r],
            _ => zmm0,
        };
        let is_mem = |l: Loc| matches!(l, Loc::Uni(_) | Loc::Pool(_));
        match *inst {
            Inst::Load { s, disp, .. } if matches!(self.lp.elem(s), Elem::U8 | Elem::I8) => {
                // The bytes into the low 16 of d (masked: vmovdqu8 suppresses faults
                // past the buffer's end), widened to i32 lanes, converted.
                let m = self.stream_at_byte(s, disp);
                let x = XMM[match out {
                    Loc::Z(r) => r,
                    _ => 0,
                }];
                let src = if masked {
                    self.a.vmovdqu8(x.k7().z(), m).map_err(e)?;
                    Some(x)
                } else {
                    None
                };
                match (self.lp.elem(s), src) {
                    (Elem::U8, Some(x)) => self.a.vpmovzxbd(d, x).map_err(e)?,
                    (Elem::U8, None) => self.a.vpmovzxbd(d, m).map_err(e)?,
                    (_, Some(x)) => self.a.vpmovsxbd(d, x).map_err(e)?,
                    (_, None) => self.a.vpmovsxbd(d, m).map_err(e)?,
                }
                self.a.vcvtdq2ps(d, d).map_err(e)?;
            }
            Inst::Load { s, disp, .. } if self.lp.elem(s) == Elem::F16 => {
                let m = self.stream_at_half(s, disp);
                if masked {
                    self.a.vcvtph2ps(d.k7().z(), m).map_err(e)?;
                } else {
                    self.a.vcvtph2ps(d, m).map_err(e)?;
                }
            }
            // f32, or int32 converted (`vcvtdq2ps`).
            Inst::Load { s, disp, .. } => {
                let m = self.stream_at(s, disp);
                let d = if masked { d.k7().z() } else { d };
                match self.lp.elem(s) {
                    Elem::I32 => self.a.vcvtdq2ps(d, m),
                    _ => self.a.vmovups(d, m),
                }
                .map_err(e)?;
            }
            Inst::Load2 { s, disp, .. } if self.lp.is_byte(s) => {
                // The 31 bytes from the lane-0 address (masked: the 32nd, which no lane
                // needs, could be past the buffer's end; with a tail, the valid lanes'
                // bytes only), as 16 words zero-extended to dwords, each lane's byte the
                // low one of its dword: kept (u8) or sign-extended (i8), converted.
                let r = match out {
                    Loc::Z(r) => r,
                    _ => 0,
                };
                let lanes = self.valid_lanes(masked);
                let mo = self.pool_off(((1u64 << (2 * lanes - 1)) - 1) as u32);
                self.a.kmovd(k6, dword_ptr(r11 + mo)).map_err(e)?;
                let at = disp + self.rdisp[s as usize];
                let m = ymmword_ptr(STREAMS[s as usize] + rax * 2 + at);
                self.a.vmovdqu8(YMM[r].k6().z(), m).map_err(e)?;
                self.a.vpmovzxwd(d, YMM[r]).map_err(e)?;
                if self.lp.elem(s) == Elem::U8 {
                    let ff = self.pool_off(0xff);
                    self.a.vpandd(d, d, dword_bcst(r11 + ff)).map_err(e)?;
                } else {
                    self.a.vpslld(d, d, 24).map_err(e)?;
                    self.a.vpsrad(d, d, 24).map_err(e)?;
                }
                self.a.vcvtdq2ps(d, d).map_err(e)?;
            }
            Inst::Load2 { s, disp, .. } => {
                // Lanes 0..16 of the result are elements 0, 2, .., 30 from the lane-0
                // address: the vector there and the one at element 15 (not 16, so that
                // element 31, which no lane needs, is not read: past a buffer's end it
                // could be on an unmapped page).
                let io = self.pool_slice(&EVEN);
                let (lo, hi) = (ZMM[tmp[0]], ZMM[tmp[1]]);
                let (m0, m1) = (self.stream_at2(s, disp), self.stream_at2(s, disp + 60));
                let rem = (self.lp.n % LANES) as u32;
                if masked && (1..=8).contains(&rem) {
                    // At most 8 valid lanes: their elements all lie in the first vector,
                    // so one masked load and a permute of it within the vector (the lanes
                    // past the valid ones zeroed, as the two-vector form leaves them).
                    // Short rows (a Winograd F(2x2) transform's 7 tiles) took a second,
                    // fully masked load, two mask loads and a copy of the index.
                    let oa = self.pool_off(elems_up_to(0, 2 * rem - 2));
                    self.a.kmovw(k6, word_ptr(r11 + oa)).map_err(e)?;
                    self.a.vmovups(lo.k6().z(), m0).map_err(e)?;
                    let idx = match self.perm {
                        Some(r) => ZMM[r],
                        None => {
                            self.a.vmovups(d, zmmword_ptr(r11 + io)).map_err(e)?;
                            d
                        }
                    };
                    self.a.vpermps(d.k7().z(), idx, lo).map_err(e)?;
                } else if masked {
                    // Only the even elements of the valid lanes are read.
                    let last = 2 * rem - 2;
                    let (ma, mb) = (elems_up_to(0, last), elems_up_to(15, last));
                    let oa = self.pool_off(ma);
                    self.a.kmovw(k6, word_ptr(r11 + oa)).map_err(e)?;
                    self.a.vmovups(lo.k6().z(), m0).map_err(e)?;
                    let ob = self.pool_off(mb);
                    self.a.kmovw(k6, word_ptr(r11 + ob)).map_err(e)?;
                    self.a.vmovups(hi.k6().z(), m1).map_err(e)?;
                    match self.perm {
                        Some(r) => self.a.vmovaps(d, ZMM[r]).map_err(e)?,
                        None => self.a.vmovups(d, zmmword_ptr(r11 + io)).map_err(e)?,
                    }
                    self.a.vpermi2ps(d, lo, hi).map_err(e)?;
                } else if let Some(r) = self.perm {
                    // The first vector into d, permuted with the second in place: the
                    // index stays in its register.
                    self.a.vmovups(d, m0).map_err(e)?;
                    self.a.vpermt2ps(d, ZMM[r], m1).map_err(e)?;
                } else {
                    self.a.vmovups(lo, m0).map_err(e)?;
                    self.a.vmovups(d, zmmword_ptr(r11 + io)).map_err(e)?;
                    self.a.vpermi2ps(d, lo, m1).map_err(e)?;
                }
            }
            Inst::LoadS { .. } if self.tile.is_some() => {
                let m = zmmword_ptr(rsp + 64 * self.tile_row);
                self.a.vmovups(d, m).map_err(e)?;
            }
            Inst::LoadS {
                s, disp, stride: 4, ..
            } => {
                // Every fourth element of four vectors: two permutes each pick 8 lanes out
                // of two vectors, and an insert joins their halves (a gather of 16 lanes
                // takes about 22 cycles on Zen 4). The second vector of each pair is read
                // 3 elements early so that nothing past the last lane's element is read
                // (the index is then the same for both pairs); in the masked tail every
                // vector is read under a mask of the elements up to the last valid lane's,
                // and a tail of at most 8 lanes reads only the first pair.
                let (t0, t1, t2) = (ZMM[tmp[0]], ZMM[tmp[1]], ZMM[tmp[2]]);
                let idx: Vec<u32> = (0..16)
                    .map(|j| (if j < 4 { 4 * j } else { 4 * j + 3 }) % 32)
                    .collect();
                let io = self.pool_slice(&idx);
                self.a.vmovups(d, zmmword_ptr(r11 + io)).map_err(e)?;
                let q = self.quad_base(s)?;
                let valid = if masked {
                    (self.lp.n % LANES) as u32
                } else {
                    16
                };
                let last = 4 * valid - 4;
                let bits = |from: u32| elems_up_to(from, last);
                if valid <= 8 {
                    for (t, from) in [(t0, 0), (t1, 13)] {
                        let ob = self.pool_off(bits(from));
                        self.a.kmovw(k6, word_ptr(r11 + ob)).map_err(e)?;
                        let m = self.quad_at(q, s, disp + 4 * from as i32);
                        self.a.vmovups(t.k6().z(), m).map_err(e)?;
                    }
                    self.a.vpermi2ps(d, t0, t1).map_err(e)?;
                    return Ok(());
                }
                for (t, first) in [(t0, 0u32), (t1, 32)] {
                    let m0 = self.quad_at(q, s, disp + 4 * first as i32);
                    let m1 = self.quad_at(q, s, disp + 4 * (first as i32 + 13));
                    if masked {
                        let oa = self.pool_off(bits(first));
                        self.a.kmovw(k6, word_ptr(r11 + oa)).map_err(e)?;
                        self.a.vmovups(t.k6().z(), m0).map_err(e)?;
                        let ob = self.pool_off(bits(first + 13));
                        self.a.kmovw(k6, word_ptr(r11 + ob)).map_err(e)?;
                        self.a.vmovups(t2.k6().z(), m1).map_err(e)?;
                        self.a.vpermt2ps(t, d, t2).map_err(e)?;
                    } else {
                        self.a.vmovups(t, m0).map_err(e)?;
                        self.a.vpermt2ps(t, d, m1).map_err(e)?;
                    }
                }
                self.a.vinsertf32x8(d, t0, YMM[tmp[1]], 1).map_err(e)?;
            }
            Inst::LoadS {
                s, disp, stride, ..
            } => {
                // Lane l's element index: (i + l) * stride, i32.
                let t = ZMM[tmp[0]];
                let lanes: Vec<u32> = (0..16).map(|l| (l * stride) as u32).collect();
                let lo = self.pool_slice(&lanes);
                let so = self.pool_off(stride as u32);
                self.a.vpbroadcastd(t, eax).map_err(e)?;
                self.a.vpmulld(t, t, dword_bcst(r11 + so)).map_err(e)?;
                self.a.vpaddd(t, t, zmmword_ptr(r11 + lo)).map_err(e)?;
                if masked {
                    self.a.kmovw(k6, k7).map_err(e)?;
                    self.a.vpxord(d, d, d).map_err(e)?;
                } else {
                    self.a.kxnorw(k6, k6, k6).map_err(e)?;
                }
                let at = zmmword_ptr(STREAMS[s as usize] + t * 4 + disp);
                self.a.vgatherdps(d.k6(), at).map_err(e)?;
            }
            Inst::Uni(_) | Inst::Const(_) => {}
            Inst::Un(op, _) => {
                let x = self.reg(l(0), t0)?;
                match op {
                    Un::Neg => {
                        let off = self.pool_off(0x8000_0000);
                        self.a.vpxord(d, x, dword_bcst(r11 + off)).map_err(e)?;
                    }
                    Un::Abs => {
                        let off = self.pool_off(0x7fff_ffff);
                        self.a.vpandd(d, x, dword_bcst(r11 + off)).map_err(e)?;
                    }
                    Un::Sqrt => self.a.vsqrtps(d, x).map_err(e)?,
                    // Rounding mode in imm[1:0], precision exception suppressed (bit 3).
                    Un::Nearest => self.a.vrndscaleps(d, x, 8).map_err(e)?,
                    Un::Floor => self.a.vrndscaleps(d, x, 9).map_err(e)?,
                    Un::Ceil => self.a.vrndscaleps(d, x, 10).map_err(e)?,
                    Un::Trunc => self.a.vrndscaleps(d, x, 11).map_err(e)?,
                    Un::ToF32 | Un::ByteU8 | Un::ByteI8 => {
                        return Err(format!("x86 loop: {op:?} in an f32 loop"))
                    }
                }
            }
            Inst::Bin(op, _, _) => {
                let (mut x, mut y) = (l(0), l(1));
                let (mut yv, xv) = (ops[1], ops[0]);
                let symmetric = matches!(
                    op,
                    Bin::Add | Bin::Mul | Bin::Min | Bin::Max | Bin::MaxNum | Bin::MinNum
                );
                let lp = self.lp;
                let konst = |v: V| match lp.insts[v as usize] {
                    Inst::Const(b) => Some(b),
                    _ => None,
                };
                // Memory operands second; for min/max, a constant second too.
                let const_first = matches!(op, Bin::Min | Bin::Max)
                    && konst(xv).is_some()
                    && konst(yv).is_none()
                    && matches!(y, Loc::Z(_));
                if symmetric && (is_mem(x) || const_first) {
                    std::mem::swap(&mut x, &mut y);
                    yv = xv;
                }
                if matches!(op, Bin::Min | Bin::Max) {
                    let xr = match x {
                        Loc::Z(r) => ZMM[r],
                        _ => return Err("x86 loop: min/max of two uniforms".into()),
                    };
                    let t = ZMM[t0.ok_or("x86 loop: no scratch register")?];
                    return self.minmax(op == Bin::Max, d, xr, y, t, konst(yv));
                }
                let xr = self.reg(x, t0)?;
                macro_rules! op3 {
                    ($m:ident) => {
                        match y {
                            Loc::Z(yr) => self.a.$m(d, xr, ZMM[yr]),
                            m => {
                                let b = self.bcst(m);
                                self.a.$m(d, xr, b)
                            }
                        }
                    };
                }
                match op {
                    Bin::Add => op3!(vaddps),
                    Bin::Sub => op3!(vsubps),
                    Bin::Mul => op3!(vmulps),
                    Bin::MinX => op3!(vminps),
                    Bin::MaxX => op3!(vmaxps),
                    // imm8[1:0]: 1 max, 0 min; imm8[3:2] = 01: the sign of the
                    // compared result.
                    Bin::MaxNum | Bin::MinNum => {
                        let imm = if op == Bin::MaxNum { 5 } else { 4 };
                        match y {
                            Loc::Z(yr) => self.a.vrangeps(d, xr, ZMM[yr], imm),
                            m => {
                                let b = self.bcst(m);
                                self.a.vrangeps(d, xr, b, imm)
                            }
                        }
                    }
                    _ => op3!(vdivps),
                }
                .map_err(e)?;
            }
            Inst::Scalef(..) => {
                let xr = self.reg(l(0), t0)?;
                match l(1) {
                    Loc::Z(yr) => self.a.vscalefps(d, xr, ZMM[yr]),
                    m => {
                        let b = self.bcst(m);
                        self.a.vscalefps(d, xr, b)
                    }
                }
                .map_err(e)?;
            }
            Inst::Fma(kind, ..) => self.fma(kind, d, l(0), l(1), l(2), tmp)?,
            Inst::Rcp14(_) => {
                let xr = self.reg(l(0), t0)?;
                self.a.vrcp14ps(d, xr).map_err(e)?;
            }
            Inst::Cmp(..) | Inst::MAnd(..) | Inst::MOr(..) | Inst::Select(..) => {
                self.emit_mask(inst, ops, loc, out, t0)?
            }
            Inst::IAdd(..) | Inst::ISub(..) => {
                let add = matches!(inst, Inst::IAdd(..));
                let (mut x, mut y) = (l(0), l(1));
                if add && is_mem(x) {
                    std::mem::swap(&mut x, &mut y);
                }
                let xr = self.reg(x, t0)?;
                match (y, add) {
                    (Loc::Z(yr), true) => self.a.vpaddd(d, xr, ZMM[yr]),
                    (Loc::Z(yr), false) => self.a.vpsubd(d, xr, ZMM[yr]),
                    (m, true) => {
                        let b = self.bcst(m);
                        self.a.vpaddd(d, xr, b)
                    }
                    (m, false) => {
                        let b = self.bcst(m);
                        self.a.vpsubd(d, xr, b)
                    }
                }
                .map_err(e)?;
            }
            Inst::Sra(_, n) | Inst::Shl(_, n) => {
                let xr = self.reg(l(0), t0)?;
                if matches!(inst, Inst::Sra(..)) {
                    self.a.vpsrad(d, xr, n as u32).map_err(e)?;
                } else {
                    self.a.vpslld(d, xr, n as u32).map_err(e)?;
                }
            }
            Inst::Store {
                s,
                disp,
                step: step @ (2 | 4),
                ..
            } if !self.lp.is_byte(s) => {
                // Lanes 0..16/step spread to every step-th element of the vector at the
                // lane-0 address, the next 16/step lanes to those of the next vector, and
                // so on; the elements between keep their values (masked stores).
                let x = self.reg(l(0), t0)?;
                let t = ZMM[tmp[1]];
                let step = u32::from(step);
                let per = 16 / step;
                let q = if step == 4 {
                    Some(self.quad_base(s)?)
                } else {
                    None
                };
                let valid = if masked {
                    (self.lp.n % LANES) as u32
                } else {
                    16
                };
                for part in 0..step {
                    let lanes = valid.saturating_sub(per * part).min(per);
                    if lanes == 0 {
                        continue;
                    }
                    let idx: Vec<u32> = (0..16).map(|j| per * part + j / step).collect();
                    let io = self.pool_slice(&idx);
                    let mask = (0..lanes).fold(0u32, |m, l| m | 1 << (step * l));
                    let mo = self.pool_off(mask);
                    let pd = disp + 64 * part as i32;
                    let m = match q {
                        Some(q) => self.quad_at(q, s, pd),
                        None => self.stream_at2(s, pd),
                    };
                    self.a.vmovups(t, zmmword_ptr(r11 + io)).map_err(e)?;
                    self.a.vpermps(t, t, x).map_err(e)?;
                    self.a.kmovw(k6, word_ptr(r11 + mo)).map_err(e)?;
                    self.a.vmovups(m.k6(), t).map_err(e)?;
                }
            }
            Inst::Store { s, disp, step, .. } if self.lp.is_byte(s) => {
                let x = self.reg(l(0), t0)?;
                let t = ZMM[tmp[1]];
                self.a.vcvttps2dq(t, x).map_err(e)?;
                // Lanes of 2^63 and above (+inf): the scalar code's i64::MAX, 0xff.
                let big = self.pool_off(0x5f00_0000);
                self.a
                    .vcmpps(k6, x, dword_bcst(r11 + big), cmp_pred(Cmp::Ge))
                    .map_err(e)?;
                self.a.vpternlogd(t.k6(), t, t, 0xff).map_err(e)?;
                if step == 4 {
                    // Every fourth byte: lane l's low byte is byte 4 l of the vector, so
                    // a byte-masked store of the dwords writes those bytes alone (bits
                    // 4 l of the mask; with a tail, the first lanes' only).
                    let lanes = self.valid_lanes(masked);
                    let bits = (0..lanes).fold(0u64, |m, l| m | 1 << (4 * l));
                    let mo = self.pool_slice(&[bits as u32, (bits >> 32) as u32]);
                    self.a.kmovq(k6, qword_ptr(r11 + mo)).map_err(e)?;
                    let at = disp + self.rdisp[s as usize];
                    let m = zmmword_ptr(STREAMS[s as usize] + rax * 4 + at);
                    self.a.vmovdqu8(m.k6(), t).map_err(e)?;
                    return Ok(());
                }
                let xt = XMM[tmp[1]];
                self.a.vpmovdb(xt, t).map_err(e)?;
                let m = self.stream_at_byte(s, disp);
                if masked {
                    self.a.vmovdqu8(m.k7(), xt).map_err(e)?;
                } else {
                    self.a.vmovdqu8(m, xt).map_err(e)?;
                }
            }
            Inst::Store { s, disp, .. } if self.lp.elem(s) == Elem::F16 => {
                // NaN lanes become sign | the quiet NaN (vcvtps2ph would keep the top of
                // their payload; the scalar code stores 0x7e00 | sign).
                let x = self.reg(l(0), t0)?;
                let t = ZMM[tmp[1]];
                let keep = self.pool_off(0xffc0_0000);
                let quiet = self.pool_off(0x0040_0000);
                self.a.vcmpps(k6, x, x, 3).map_err(e)?;
                if t != x {
                    self.a.vmovaps(t, x).map_err(e)?;
                }
                self.a
                    .vpandd(t.k6(), t, dword_bcst(r11 + keep))
                    .map_err(e)?;
                self.a
                    .vpord(t.k6(), t, dword_bcst(r11 + quiet))
                    .map_err(e)?;
                let m = self.stream_at_half(s, disp);
                let m = if masked { m.k7() } else { m };
                // Imm 0: round to nearest even (not MXCSR's mode).
                self.a.vcvtps2ph(m, t, 0).map_err(e)?;
            }
            Inst::Store { s, disp, .. } => {
                let x = self.reg(l(0), t0)?;
                let m = self.stream_at(s, disp);
                if masked {
                    self.a.vmovups(m.k7(), x).map_err(e)?;
                } else {
                    self.a.vmovups(m, x).map_err(e)?;
                }
            }
            Inst::Reduce { r, .. } => {
                let acc = ZMM[31 - r as usize];
                let kind = self.lp.reds[r as usize];
                match kind {
                    Red::Add => {
                        let xr = self.reg(l(0), t0)?;
                        if masked {
                            self.a.vaddps(acc.k7(), acc, xr).map_err(e)?;
                        } else {
                            self.a.vaddps(acc, acc, xr).map_err(e)?;
                        }
                    }
                    Red::Max | Red::Min => {
                        let (t1, t2) = (ZMM[tmp[0]], ZMM[tmp[1]]);
                        self.minmax(kind == Red::Max, t1, acc, l(0), t2, None)?;
                        if masked {
                            self.a.vmovaps(acc.k7(), t1).map_err(e)?;
                        } else {
                            self.a.vmovaps(acc, t1).map_err(e)?;
                        }
                    }
                    Red::SelGt | Red::SelLt => {
                        // `v > acc ? v : acc` is exactly vmaxps(v, acc) (its second
                        // operand on a tie or a NaN), `v < acc ? v : acc` vminps: one
                        // instruction on the accumulator's chain instead of a compare
                        // and a masked move.
                        let xr = self.reg(l(0), t0)?;
                        let dst = if masked { acc.k7() } else { acc };
                        if kind == Red::SelGt {
                            self.a.vmaxps(dst, xr, acc).map_err(e)?;
                        } else {
                            self.a.vminps(dst, xr, acc).map_err(e)?;
                        }
                    }
                }
            }
        }
        Ok(())
    }
}

/// Whether an f64 loop ([`Loop::f64`]) keeps to what [`Gen::emit64`] emits.
fn check_f64(lp: &Loop) -> R<()> {
    if !lp.reds.is_empty() {
        return Err("x86 loop: reductions in an f64 loop".into());
    }
    for i in &lp.insts {
        let ok = match *i {
            Inst::Load { s, .. } => {
                matches!(
                    lp.elem(s),
                    Elem::F64 | Elem::F32 | Elem::I32 | Elem::U8 | Elem::I8
                )
            }
            Inst::Store { s, step, .. } => {
                step == 1 && matches!(lp.elem(s), Elem::F64 | Elem::F32 | Elem::U8 | Elem::I8)
            }
            Inst::Bin(op, ..) => matches!(
                op,
                Bin::Add | Bin::Sub | Bin::Mul | Bin::Div | Bin::MinX | Bin::MaxX
            ),
            Inst::Uni(_)
            | Inst::Un(..)
            | Inst::Cmp(..)
            | Inst::MAnd(..)
            | Inst::MOr(..)
            | Inst::Select(..) => true,
            _ => false,
        };
        if !ok {
            return Err(format!("x86 loop: {i:?} in an f64 loop"));
        }
    }
    Ok(())
}

impl Gen<'_> {
    /// [`Gen::emit`] for an f64 loop (8 lanes; the instructions [`check_f64`] admits).
    fn emit64(
        &mut self,
        inst: &Inst,
        ops: &[V],
        loc: &[Loc],
        out: Loc,
        tmp: &[usize],
        masked: bool,
    ) -> R<()> {
        let l = |k: usize| loc[ops[k] as usize];
        let t0 = tmp.first().copied();
        let dr = match out {
            Loc::Z(r) => r,
            _ => 0,
        };
        let d = ZMM[dr];
        let is_mem = |l: Loc| matches!(l, Loc::Uni(_) | Loc::Pool(_));
        // Element `i + disp / bytes` of stream `s`, elements of `bytes`.
        let at = |s: u16, disp: i32, bytes: i32| {
            let base = STREAMS[s as usize];
            match bytes {
                8 => base + rax * 8 + disp,
                4 => base + rax * 4 + disp,
                _ => base + rax + disp,
            }
        };
        match *inst {
            Inst::Load { s, disp, .. } => {
                let dz = if masked { d.k7().z() } else { d };
                match self.lp.elem(s) {
                    Elem::F64 => self.a.vmovupd(dz, zmmword_ptr(at(s, disp, 8))),
                    // Exact: every f32 and every i32 is an f64.
                    Elem::F32 => self.a.vcvtps2pd(dz, ymmword_ptr(at(s, disp, 4))),
                    Elem::I32 => self.a.vcvtdq2pd(dz, ymmword_ptr(at(s, disp, 4))),
                    elem => {
                        // The 8 bytes (masked: vmovdqu8 suppresses faults past the
                        // buffer's end) widened to i32 lanes, converted.
                        let r = match out {
                            Loc::Z(r) => r,
                            _ => 0,
                        };
                        let (x, y) = (XMM[r], YMM[r]);
                        let m = at(s, disp, 1);
                        let src = if masked {
                            self.a.vmovdqu8(x.k7().z(), xmmword_ptr(m)).map_err(e)?;
                            Some(x)
                        } else {
                            None
                        };
                        match (elem, src) {
                            (Elem::U8, Some(x)) => self.a.vpmovzxbd(y, x),
                            (Elem::U8, None) => self.a.vpmovzxbd(y, qword_ptr(m)),
                            (_, Some(x)) => self.a.vpmovsxbd(y, x),
                            (_, None) => self.a.vpmovsxbd(y, qword_ptr(m)),
                        }
                        .map_err(e)?;
                        self.a.vcvtdq2pd(d, y)
                    }
                }
                .map_err(e)?;
            }
            Inst::Uni(_) => {}
            Inst::Un(op, _) => {
                let x = self.reg(l(0), t0)?;
                match op {
                    Un::Neg => {
                        let off = self.pool_slice(&[0, 0x8000_0000]);
                        self.a.vpxorq(d, x, qword_bcst(r11 + off)).map_err(e)?;
                    }
                    Un::Abs => {
                        let off = self.pool_slice(&[u32::MAX, 0x7fff_ffff]);
                        self.a.vpandq(d, x, qword_bcst(r11 + off)).map_err(e)?;
                    }
                    Un::Sqrt => self.a.vsqrtpd(d, x).map_err(e)?,
                    // Rounding mode in imm[1:0], precision exception suppressed (bit 3).
                    Un::Nearest => self.a.vrndscalepd(d, x, 8).map_err(e)?,
                    Un::Floor => self.a.vrndscalepd(d, x, 9).map_err(e)?,
                    Un::Ceil => self.a.vrndscalepd(d, x, 10).map_err(e)?,
                    Un::Trunc => self.a.vrndscalepd(d, x, 11).map_err(e)?,
                    Un::ToF32 => {
                        let h = YMM[dr];
                        self.a.vcvtpd2ps(h, x).map_err(e)?;
                        self.a.vcvtps2pd(d, h).map_err(e)?;
                    }
                    Un::ByteU8 | Un::ByteI8 => {
                        // As the byte store (below) converts, then the byte widened back:
                        // `d` may be `x`'s register, so `x` is compared first.
                        let big = self.pool_slice(&[0, 0x43e0_0000]);
                        self.a
                            .vcmppd(k6, x, qword_bcst(r11 + big), cmp_pred(Cmp::Ge))
                            .map_err(e)?;
                        self.a.vcvttpd2qq(d, x).map_err(e)?;
                        self.a.vpternlogq(d.k6(), d, d, 0xff).map_err(e)?;
                        let h = XMM[dr];
                        self.a.vpmovqb(h, d).map_err(e)?;
                        if op == Un::ByteU8 {
                            self.a.vpmovzxbq(d, h).map_err(e)?;
                        } else {
                            self.a.vpmovsxbq(d, h).map_err(e)?;
                        }
                        self.a.vcvtqq2pd(d, d).map_err(e)?;
                    }
                }
            }
            Inst::Bin(op, _, _) => {
                let (mut x, mut y) = (l(0), l(1));
                // A memory operand second.
                if matches!(op, Bin::Add | Bin::Mul) && is_mem(x) {
                    std::mem::swap(&mut x, &mut y);
                }
                let xr = self.reg(x, t0)?;
                macro_rules! op3 {
                    ($m:ident) => {
                        match y {
                            Loc::Z(yr) => self.a.$m(d, xr, ZMM[yr]),
                            m => {
                                let b = self.bcst(m);
                                self.a.$m(d, xr, b)
                            }
                        }
                    };
                }
                match op {
                    Bin::Add => op3!(vaddpd),
                    Bin::Sub => op3!(vsubpd),
                    Bin::Mul => op3!(vmulpd),
                    Bin::Div => op3!(vdivpd),
                    Bin::MinX => op3!(vminpd),
                    Bin::MaxX => op3!(vmaxpd),
                    _ => return Err(format!("x86 loop: {op:?} in an f64 loop")),
                }
                .map_err(e)?;
            }
            Inst::Cmp(..) | Inst::MAnd(..) | Inst::MOr(..) | Inst::Select(..) => {
                self.emit_mask(inst, ops, loc, out, t0)?
            }
            Inst::Store { s, disp, .. } if self.lp.elem(s) == Elem::F64 => {
                let x = self.reg(l(0), t0)?;
                let m = zmmword_ptr(at(s, disp, 8));
                let m = if masked { m.k7() } else { m };
                self.a.vmovupd(m, x).map_err(e)?;
            }
            Inst::Store { s, disp, .. } if self.lp.elem(s) == Elem::F32 => {
                // Rounded to nearest even, as the scalar code's f64 -> f32 conversion.
                let x = self.reg(l(0), t0)?;
                let t = YMM[tmp[1]];
                self.a.vcvtpd2ps(t, x).map_err(e)?;
                // vmovdqu32, EVEX only: the assembler writes a masked ymm vmovups in
                // its VEX form, without the mask.
                let m = ymmword_ptr(at(s, disp, 4));
                let m = if masked { m.k7() } else { m };
                self.a.vmovdqu32(m, t).map_err(e)?;
            }
            Inst::Store { s, disp, .. } => {
                // Bytes: truncated toward zero to i64 (saturating: NaN 0, -2^63 and below
                // i64::MIN) and the low byte kept, as the scalar code stores `u8(i64(x))`:
                // vcvttpd2qq gives 2^63 for NaN and out-of-range lanes, whose low byte is
                // right but for lanes of 2^63 and above (i64::MAX: 0xff).
                let x = self.reg(l(0), t0)?;
                let t = ZMM[tmp[1]];
                self.a.vcvttpd2qq(t, x).map_err(e)?;
                let big = self.pool_slice(&[0, 0x43e0_0000]);
                self.a
                    .vcmppd(k6, x, qword_bcst(r11 + big), cmp_pred(Cmp::Ge))
                    .map_err(e)?;
                self.a.vpternlogq(t.k6(), t, t, 0xff).map_err(e)?;
                let m = qword_ptr(at(s, disp, 1));
                if masked {
                    self.a.vpmovqb(m.k7(), t).map_err(e)?;
                } else {
                    self.a.vpmovqb(m, t).map_err(e)?;
                }
            }
            _ => return Err(format!("x86 loop: {inst:?} in an f64 loop")),
        }
        Ok(())
    }
}

impl Gen<'_> {
    /// Comparisons, mask logic and selects, for f32 (`vcmpps`, `vblendmps`) or f64 loops
    /// (`vcmppd`, `vblendmpd`): a memory operand goes second (a comparison's sense
    /// reversed).
    fn emit_mask(
        &mut self,
        inst: &Inst,
        ops: &[V],
        loc: &[Loc],
        out: Loc,
        t0: Option<usize>,
    ) -> R<()> {
        let l = |k: usize| loc[ops[k] as usize];
        let f64 = self.lp.f64;
        let d = match out {
            Loc::Z(r) => ZMM[r],
            _ => zmm0,
        };
        match *inst {
            Inst::Cmp(op, _, _) => {
                let (mut x, mut y) = (l(0), l(1));
                let mut op = op;
                if matches!(x, Loc::Uni(_) | Loc::Pool(_)) {
                    std::mem::swap(&mut x, &mut y);
                    op = match op {
                        Cmp::Lt => Cmp::Gt,
                        Cmp::Gt => Cmp::Lt,
                        Cmp::Le => Cmp::Ge,
                        Cmp::Ge => Cmp::Le,
                        o => o,
                    };
                }
                let pred = cmp_pred(op);
                let k = Self::kreg(out)?;
                let xr = self.reg(x, t0)?;
                match (y, f64) {
                    (Loc::Z(yr), false) => self.a.vcmpps(k, xr, ZMM[yr], pred),
                    (Loc::Z(yr), true) => self.a.vcmppd(k, xr, ZMM[yr], pred),
                    (m, false) => {
                        let b = self.bcst(m);
                        self.a.vcmpps(k, xr, b, pred)
                    }
                    (m, true) => {
                        let b = self.bcst(m);
                        self.a.vcmppd(k, xr, b, pred)
                    }
                }
                .map_err(e)?;
            }
            Inst::MAnd(..) | Inst::MOr(..) => {
                let (x, y) = (Self::kreg(l(0))?, Self::kreg(l(1))?);
                let k = Self::kreg(out)?;
                if matches!(inst, Inst::MAnd(..)) {
                    self.a.kandw(k, x, y).map_err(e)?;
                } else {
                    self.a.korw(k, x, y).map_err(e)?;
                }
            }
            Inst::Select(..) => {
                // vblendmps d{m}, b, a: d = m ? a : b.
                let Loc::K(m) = l(0) else {
                    return Err("x86 loop: a vector used as a mask".into());
                };
                let br = self.reg(l(2), t0)?;
                let dm = masked_by(d, m);
                match (l(1), f64) {
                    (Loc::Z(ar), false) => self.a.vblendmps(dm, br, ZMM[ar]),
                    (Loc::Z(ar), true) => self.a.vblendmpd(dm, br, ZMM[ar]),
                    (m, false) => {
                        let b = self.bcst(m);
                        self.a.vblendmps(dm, br, b)
                    }
                    (m, true) => {
                        let b = self.bcst(m);
                        self.a.vblendmpd(dm, br, b)
                    }
                }
                .map_err(e)?;
            }
            _ => return Err(format!("x86 loop: {inst:?} is no mask operation")),
        }
        Ok(())
    }
}

/// `vcmpps`/`vcmppd`'s predicate for `op`: EQ_OQ, NEQ_UQ, LT_OQ, LE_OQ, GT_OQ, GE_OQ.
pub(crate) fn cmp_pred(op: Cmp) -> i32 {
    match op {
        Cmp::Eq => 0x00,
        Cmp::Ne => 0x04,
        Cmp::Lt => 0x11,
        Cmp::Le => 0x12,
        Cmp::Gt => 0x1e,
        Cmp::Ge => 0x1d,
    }
}

/// `d` written under value mask register `m` (k1..k5, [`KVAL`]).
fn masked_by(d: AsmRegisterZmm, m: usize) -> AsmRegisterZmm {
    match m {
        0 => d.k1(),
        1 => d.k2(),
        2 => d.k3(),
        3 => d.k4(),
        _ => d.k5(),
    }
}

fn release(locs: &[Loc], zfree: &mut Vec<usize>, kfree: &mut Vec<usize>) {
    for l in locs {
        match *l {
            Loc::Z(r) if !zfree.contains(&r) => zfree.push(r),
            Loc::K(k) if !kfree.contains(&k) => kfree.push(k),
            _ => {}
        }
    }
}
