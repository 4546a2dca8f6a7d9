//! 8-bit GEMM on the AMX tile unit (AMX-INT8: `tdpbusd` / `tdpbsud`), for the same
//! [`Spec`] and signature as the AVX-512 VNNI microkernel of [`super::gemm`]:
//!
//! ```c
//! void gemm(const uint8_t *a, const uint8_t *b, int32_t *c, const int32_t *init);
//! ```
//!
//! A block of C of 32 x 32 is four 16 x 16 int32 tiles (tmm0..3), summed over the whole
//! k range from two A tiles (tmm4/5: 16 rows of 64 bytes, read in place at A's row
//! stride) and two B tiles (tmm6/7: 16 quads of k by 16 columns, four bytes each, read
//! in place at B's quad stride: B's quad layout of `kir::GemmCall::int8` is the tiles'
//! own). A tile multiply-add is 16 x 16 x 64 products (`tdpbusd` in 16 cycles on
//! Sapphire Rapids: 1024 per cycle, eight times `vpdpbusd` on two ports).
//!
//! Edges: the blocks of the last rows and of the last columns run under their own tile
//! configurations (fewer rows in the A and C tiles, fewer bytes in the B and C tile
//! rows), loaded when the kind of block changes, so no tile reads past A's rows or B's
//! columns. When k is not a whole number of tile steps (16 quads, 64 products), A must
//! be padded with zero quads to the next step ([`Spec::a_padded`], a conv's weights copied
//! so at compile time), and B's quads of the last step are copied per column block into
//! a zero-padded 16-quad tile on the stack.
//!
//! The tiles go through a 4 KiB scratch on the stack to C: each row of a tile is one zmm,
//! plus the init view (or C itself, accumulating), stored under a k-mask at the column
//! edge.
//!
//! The tile state needs the OS's permission: Linux grants it per process on
//! `arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)` and kills a process that uses a
//! tile without it. The function asks on every call (a system call, 96 ns measured here,
//! granted once and then only confirmed) so that the object needs no set-up call, and
//! releases the tiles (`tilerelease`) on return so that context switches stop saving them.

use super::gemm::{ActBits, Int8, Isa, Spec};
use iced_x86::code_asm::*;

type R<T> = Result<T, String>;

fn e(x: IcedError) -> String {
    format!("x86 amx gemm assembly: {x}")
}

fn d32(x: i64) -> R<i32> {
    i32::try_from(x).map_err(|_| format!("x86 amx gemm: displacement {x} does not fit 32 bits"))
}

const ZMM: [AsmRegisterZmm; 2] = [zmm0, zmm1];
const TMM: [AsmRegisterTmm; 8] = [tmm0, tmm1, tmm2, tmm3, tmm4, tmm5, tmm6, tmm7];

/// Rows and columns of a C block (two tiles each way).
pub const BLOCK: usize = 32;
/// Rows and columns (int32) of a tile; quads of k per tile multiply.
pub const TILE: usize = 16;
/// Stack bytes: the four entry arguments, the C scratch (four 1 KiB tiles), then B's
/// last tile step when k is not whole steps (16 quads of 32 columns, zero past k).
const ARGS: i32 = 32;
const SCRATCH: i32 = 4096;
const B_TAIL: i32 = ARGS + SCRATCH;
const FRAME: i32 = B_TAIL + 2048;

/// `arch_prctl` and its request for the tile data state (also asked by the object's
/// `cpu_supported()`).
pub const SYS_ARCH_PRCTL: u32 = 158;
pub const ARCH_REQ_XCOMP_PERM: u32 = 0x1023;
pub const XFEATURE_XTILEDATA: u32 = 18;

/// Whether an 8-bit spec can run on the tiles: k at least one tile step (16 quads) and
/// whole steps or A padded, A unpacked with rows of four-byte quads, B in quads (panels
/// of 32 columns or read in place), no epilogue but the init view. (Below one step the
/// blocks' trips through the scratch cost more than `vpdpbusd`: 1x1 convs of 16 to 32
/// channels measured 1.3-2.5x slower on the tiles; from 48 channels 3x3 or 96 1x1 they
/// are as fast or faster.)
pub fn fits(s: &Spec) -> bool {
    (s.k.is_multiple_of(TILE) || s.a_padded) && tiles_take(s.k) && plain(s)
}

/// Whether a product of `k` quads goes to the tiles at all (one whole step or more).
pub fn tiles_take(k: usize) -> bool {
    k >= TILE
}

/// Whether a product of `k` quads on the tiles needs A's rows padded to whole steps.
pub fn pads_a(k: usize) -> bool {
    tiles_take(k) && !k.is_multiple_of(TILE)
}

/// The operands and epilogue [`fits`] asks for.
fn plain(s: &Spec) -> bool {
    s.int8.is_some()
        && s.isa == Isa::Avx512
        && s.a_k == 4
        && s.a_tile == Isa::Avx512.mr() as i64 * s.a_row
        && s.b_group == 1
        && !s.add
        && s.act == ActBits::None
        && s.init.is_none_or(|(_, col)| col == 0 || col == 4)
}

/// Runs of blocks along a dimension of `size`: (count, extent) of the whole blocks and
/// of the partial last one.
fn kinds(size: usize) -> Vec<(usize, usize)> {
    let (full, rest) = (size / BLOCK, size % BLOCK);
    let mut v = Vec::new();
    if full > 0 {
        v.push((full, BLOCK));
    }
    if rest > 0 {
        v.push((1, rest));
    }
    v
}

/// The shape of one kind of C block: rows of its two tile rows and columns of its two
/// tile columns (0: absent).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
struct Shape {
    rows: [usize; 2],
    cols: [usize; 2],
}

impl Shape {
    fn new(rows: usize, cols: usize) -> Shape {
        let split = |x: usize| [x.min(TILE), x.saturating_sub(TILE)];
        Shape {
            rows: split(rows),
            cols: split(cols),
        }
    }

    /// The 64-byte tile configuration (palette 1): C tile `2r + c` is rows[r] x cols[c],
    /// A tile 4 + r is rows[r] x 64 bytes, B tile 6 + c is 16 quads x cols[c] dwords.
    fn config(&self) -> [u8; 64] {
        let mut cfg = [0u8; 64];
        cfg[0] = 1;
        let mut set = |t: usize, rows: usize, bytes: usize| {
            if rows > 0 && bytes > 0 {
                cfg[16 + 2 * t..18 + 2 * t].copy_from_slice(&(bytes as u16).to_le_bytes());
                cfg[48 + t] = rows as u8;
            }
        };
        for r in 0..2 {
            for c in 0..2 {
                set(2 * r + c, self.rows[r], 4 * self.cols[c]);
            }
            set(4 + r, self.rows[r], 64);
        }
        for c in 0..2 {
            set(6 + c, TILE, 4 * self.cols[c]);
        }
        cfg
    }
}

struct Gen<'s> {
    a: CodeAssembler,
    s: &'s Spec,
    /// Distinct tile configurations and their labels.
    configs: Vec<(Shape, CodeLabel)>,
}

// Registers: the arguments are saved at rsp (a, b, c, init); r8 = A row block, r9 = C row
// block, r10 = init row block; r11 = B column block, rbx / rbp = bytes from the C / init
// row block to the column block; rax / r15 = A / B in the k-loop, ecx its counter; r12 =
// A's row stride, r13 = B's quad stride, rdx = 64 (the scratch's row stride); rdi / r14 =
// row / column block counters; rsi a temporary.
const SAVED: [AsmRegister64; 6] = [rbx, rbp, r12, r13, r14, r15];

/// Assembles the tile function for `s` (see [`fits`]).
pub fn generate(s: &Spec) -> R<Vec<u8>> {
    if !fits(s) || s.m == 0 || s.n == 0 {
        return Err("x86 amx gemm: not an 8-bit shape for the tiles".into());
    }
    let irs = s.init.map_or(0, |(r, _)| r);
    for x in [
        16 * s.a_row,
        (BLOCK as i64) * s.c_rs,
        (BLOCK as i64) * irs,
        (TILE as i64) * s.b_k,
        s.b_panel,
    ] {
        d32(x)?;
    }
    let mut g = Gen {
        a: CodeAssembler::new(64).map_err(e)?,
        s,
        configs: Vec::new(),
    };
    g.body()?;
    g.a.assemble(0).map_err(e)
}

impl Gen<'_> {
    fn body(&mut self) -> R<()> {
        let s = self.s;
        for r in SAVED {
            self.a.push(r).map_err(e)?;
        }
        // Page by page (6 KiB): no access skips a guard page below the stack.
        self.a.sub(rsp, 4096).map_err(e)?;
        self.a.mov(qword_ptr(rsp), 0).map_err(e)?;
        self.a.sub(rsp, FRAME - 4096).map_err(e)?;
        for (i, r) in [rdi, rsi, rdx, rcx].into_iter().enumerate() {
            self.a.mov(qword_ptr(rsp + 8 * i as i32), r).map_err(e)?;
        }
        // The tile state, asked for each call (clobbers rax, rcx, r11; the result is not
        // checked: a refusal ends the process at the first tile instruction either way).
        self.a.mov(eax, SYS_ARCH_PRCTL).map_err(e)?;
        self.a.mov(edi, ARCH_REQ_XCOMP_PERM).map_err(e)?;
        self.a.mov(esi, XFEATURE_XTILEDATA).map_err(e)?;
        self.a.syscall().map_err(e)?;
        self.a.mov(r12, s.a_row).map_err(e)?;
        self.a.mov(r13, s.b_k).map_err(e)?;
        self.a.mov(edx, 64u32).map_err(e)?;
        let (full_k, tail_k) = (s.k / TILE, s.k % TILE);
        if tail_k > 0 {
            self.a.vpxord(zmm0, zmm0, zmm0).map_err(e)?;
            for i in tail_k..TILE {
                for h in 0..2 {
                    let at = rsp + B_TAIL + (128 * i + 64 * h) as i32;
                    self.a.vmovdqu32(zmmword_ptr(at), zmm0).map_err(e)?;
                }
            }
        }
        // Column blocks outside, row blocks inside: a B column block (k x 32 bytes x 4)
        // is read from L2 once and then from L1 by every row block, while A stays in L2.
        let (rows, cols) = (kinds(s.m), kinds(s.n));
        let ics = s.init.map_or(0, |(_, c)| c);
        let irs = s.init.map_or(0, |(r, _)| r);
        self.a.mov(r11, qword_ptr(rsp + 8)).map_err(e)?;
        self.a.xor(ebx, ebx).map_err(e)?;
        self.a.xor(ebp, ebp).map_err(e)?;
        for &(ccount, width) in &cols {
            if let [(_, height)] = rows[..] {
                self.configure(Shape::new(height, width))?;
            }
            let halves = [width.min(TILE), width.saturating_sub(TILE)];
            if tail_k > 0 {
                for (h, &w) in halves.iter().enumerate() {
                    if w > 0 && w < TILE {
                        self.a.mov(eax, (1u32 << w) - 1).map_err(e)?;
                        self.a.kmovw(if h == 0 { k3 } else { k4 }, eax).map_err(e)?;
                    }
                }
            }
            let mut ctop = self.a.create_label();
            self.a.mov(r14d, ccount as u32).map_err(e)?;
            self.a.set_label(&mut ctop).map_err(e)?;
            // B's quads of the last step into the stack tile (columns past the edge 0).
            for i in 0..tail_k {
                for (h, &w) in halves.iter().enumerate() {
                    if w == 0 {
                        continue;
                    }
                    let src = r11 + d32((full_k * TILE + i) as i64 * s.b_k + 64 * h as i64)?;
                    if w < TILE {
                        let dst = if h == 0 { zmm0.k3() } else { zmm0.k4() };
                        self.a.vmovdqu32(dst.z(), zmmword_ptr(src)).map_err(e)?;
                    } else {
                        self.a.vmovdqu32(zmm0, zmmword_ptr(src)).map_err(e)?;
                    }
                    let at = rsp + B_TAIL + (128 * i + 64 * h) as i32;
                    self.a.vmovdqu32(zmmword_ptr(at), zmm0).map_err(e)?;
                }
            }
            self.a.mov(r8, qword_ptr(rsp)).map_err(e)?;
            self.a.mov(r9, qword_ptr(rsp + 16)).map_err(e)?;
            self.a.mov(r10, qword_ptr(rsp + 24)).map_err(e)?;
            for &(rcount, height) in &rows {
                if rows.len() > 1 {
                    self.configure(Shape::new(height, width))?;
                }
                let mut rtop = self.a.create_label();
                self.a.mov(edi, rcount as u32).map_err(e)?;
                self.a.set_label(&mut rtop).map_err(e)?;
                self.block(Shape::new(height, width))?;
                self.add(r8, BLOCK as i64 * s.a_row)?;
                self.add(r9, BLOCK as i64 * s.c_rs)?;
                self.add(r10, BLOCK as i64 * irs)?;
                self.a.dec(edi).map_err(e)?;
                self.a.jne(rtop).map_err(e)?;
            }
            self.add(r11, s.b_panel)?;
            self.add(rbx, BLOCK as i64 * 4)?;
            self.add(rbp, BLOCK as i64 * ics)?;
            self.a.dec(r14d).map_err(e)?;
            self.a.jne(ctop).map_err(e)?;
        }
        self.a.tilerelease().map_err(e)?;
        self.a.vzeroupper().map_err(e)?;
        self.a.add(rsp, FRAME).map_err(e)?;
        for r in SAVED.iter().rev() {
            self.a.pop(*r).map_err(e)?;
        }
        self.a.ret().map_err(e)?;
        for (shape, label) in &mut self.configs {
            self.a.set_label(label).map_err(e)?;
            self.a.db(&shape.config()).map_err(e)?;
        }
        Ok(())
    }

    /// `r += x` (through rsi when x needs 64 bits).
    fn add(&mut self, r: AsmRegister64, x: i64) -> R<()> {
        super::gemm::add_imm(&mut self.a, r, x, rsi)
    }

    /// Loads the tile configuration of `shape`.
    fn configure(&mut self, shape: Shape) -> R<()> {
        let label = match self.configs.iter().find(|c| c.0 == shape) {
            Some(c) => c.1,
            None => {
                let l = self.a.create_label();
                self.configs.push((shape, l));
                l
            }
        };
        self.a.ldtilecfg(ptr(label)).map_err(e)
    }

    /// One tile step: the A tiles at rax (A's row stride in r12), the B tiles at `b` and
    /// `b + 64` (the stride its index register holds), and the products.
    fn step(&mut self, sh: Shape, tiles: &[(usize, usize)], b: AsmMemoryOperand) -> R<()> {
        for r in 0..2 {
            if sh.rows[r] > 0 {
                let at = rax + r12 + d32(r as i64 * TILE as i64 * self.s.a_row)?;
                self.a.tileloadd(TMM[4 + r], ptr(at)).map_err(e)?;
            }
        }
        for c in 0..2 {
            if sh.cols[c] > 0 {
                self.a
                    .tileloadd(TMM[6 + c], ptr(b + 64 * c as i32))
                    .map_err(e)?;
            }
        }
        for &(r, c) in tiles {
            let (dst, x, y) = (TMM[2 * r + c], TMM[4 + r], TMM[6 + c]);
            match self.s.int8 {
                Some(Int8::SignedA) => self.a.tdpbsud(dst, x, y),
                _ => self.a.tdpbusd(dst, x, y),
            }
            .map_err(e)?;
        }
        Ok(())
    }

    /// One C block: the tile products over all of k, then the tiles through the scratch
    /// to C.
    fn block(&mut self, sh: Shape) -> R<()> {
        let s = self.s;
        let tiles: Vec<(usize, usize)> = (0..2)
            .flat_map(|r| (0..2).map(move |c| (r, c)))
            .filter(|&(r, c)| sh.rows[r] > 0 && sh.cols[c] > 0)
            .collect();
        for &(r, c) in &tiles {
            self.a.tilezero(TMM[2 * r + c]).map_err(e)?;
        }
        self.a.mov(rax, r8).map_err(e)?;
        let (full_k, tail_k) = (s.k / TILE, s.k % TILE);
        if full_k > 0 {
            self.a.mov(r15, r11).map_err(e)?;
            self.a.mov(ecx, full_k as u32).map_err(e)?;
            let mut top = self.a.create_label();
            self.a.set_label(&mut top).map_err(e)?;
            self.step(sh, &tiles, r15 + r13)?;
            self.a.add(rax, 64).map_err(e)?;
            self.add(r15, TILE as i64 * s.b_k)?;
            self.a.dec(ecx).map_err(e)?;
            self.a.jne(top).map_err(e)?;
        }
        if tail_k > 0 {
            // B from the stack tile, rows 128 bytes apart.
            self.a.mov(esi, 128u32).map_err(e)?;
            self.step(sh, &tiles, rsp + rsi + B_TAIL)?;
        }
        for &(r, c) in &tiles {
            let at = rsp + rdx + ARGS + 1024 * (2 * r + c) as i32;
            self.a.tilestored(ptr(at), TMM[2 * r + c]).map_err(e)?;
        }
        // C = tile (+ init or C), row by row.
        let (irs, ics) = s.init.unwrap_or((0, 0));
        for c in 0..2 {
            if sh.cols[c] > 0 && sh.cols[c] < TILE {
                self.a.mov(eax, (1u32 << sh.cols[c]) - 1).map_err(e)?;
                self.a.kmovw(if c == 0 { k1 } else { k2 }, eax).map_err(e)?;
            }
        }
        for &(r, c) in &tiles {
            let masked = sh.cols[c] < TILE;
            for i in 0..sh.rows[r] {
                let row = (r * TILE + i) as i64;
                let scratch = rsp + d32(ARGS as i64 + 1024 * (2 * r + c) as i64 + 64 * i as i64)?;
                self.a.vmovdqu32(ZMM[0], zmmword_ptr(scratch)).map_err(e)?;
                let at_c = r9 + rbx + d32(row * s.c_rs + 64 * c as i64)?;
                let other = if s.init_is_c {
                    Some(at_c)
                } else if s.init.is_some() {
                    Some(r10 + rbp + d32(row * irs + (c * TILE) as i64 * ics)?)
                } else {
                    None
                };
                match other {
                    Some(at) if !s.init_is_c && ics == 0 => {
                        self.a.vpbroadcastd(ZMM[1], dword_ptr(at)).map_err(e)?;
                        self.a.vpaddd(ZMM[0], ZMM[0], ZMM[1]).map_err(e)?;
                    }
                    Some(at) if masked => {
                        let dst = if c == 0 { ZMM[1].k1() } else { ZMM[1].k2() };
                        self.a.vmovdqu32(dst.z(), zmmword_ptr(at)).map_err(e)?;
                        self.a.vpaddd(ZMM[0], ZMM[0], ZMM[1]).map_err(e)?;
                    }
                    Some(at) => {
                        self.a.vpaddd(ZMM[0], ZMM[0], zmmword_ptr(at)).map_err(e)?;
                    }
                    None => {}
                }
                if masked {
                    let mem = zmmword_ptr(at_c);
                    let mem = if c == 0 { mem.k1() } else { mem.k2() };
                    self.a.vmovdqu32(mem, ZMM[0]).map_err(e)?;
                } else {
                    self.a.vmovdqu32(zmmword_ptr(at_c), ZMM[0]).map_err(e)?;
                }
            }
        }
        Ok(())
    }
}
