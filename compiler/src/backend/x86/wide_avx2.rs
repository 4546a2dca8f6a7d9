//! The loops of [`super::wide`] as AVX2 code: 8 f32 lanes in ymm registers, for x86
//! targets with AVX2 and FMA but not AVX-512, where Cranelift's own code is 128-bit and
//! has no fused multiply-add (a Zen 3's depthwise convs and elementwise chains).
//!
//! The same [`Loop`] and the same calling convention (the args block of
//! [`Loop::layout`]); a subset of the instructions: unit-stride f32 streams (loads and
//! step-1 stores), uniforms, constants, the f32 arithmetic, comparisons and selects
//! (masks are vectors of all-ones lanes), integer lane operations, fused multiply-adds,
//! [`Inst::Scalef`] (two multiplications by powers of two built in the exponent bits)
//! and [`Inst::Rcp14`] (`vrcpps` and a Newton step: more than 14 bits), and every
//! reduction. [`generate`] refuses the rest (byte, f16 and i32 streams, gathers,
//! every-other-element accesses, strided stores, f64 loops, `vrangeps`), and the caller
//! keeps such a loop 128-bit.
//!
//! The last partial vector runs under a lane mask (`vmaskmovps`, which does not fault
//! on the lanes it leaves out); reductions take in only its valid lanes.

use super::wide::{cmp_pred, Bin, FmaKind, Inst, Layout, Loop, Red, Un, V};
use iced_x86::code_asm::*;

type R<T> = Result<T, String>;

fn e(x: IcedError) -> String {
    format!("x86 AVX2 loop assembly: {x}")
}

/// Lanes per vector.
pub const LANES: u64 = 8;

const XMM: [AsmRegisterXmm; 16] = [
    xmm0, xmm1, xmm2, xmm3, xmm4, xmm5, xmm6, xmm7, xmm8, xmm9, xmm10, xmm11, xmm12, xmm13, xmm14,
    xmm15,
];
const YMM: [AsmRegisterYmm; 16] = [
    ymm0, ymm1, ymm2, ymm3, ymm4, ymm5, ymm6, ymm7, ymm8, ymm9, ymm10, ymm11, ymm12, ymm13, ymm14,
    ymm15,
];
/// Stream base pointers, then the row counter: rdi = args, rax = element index, r11 =
/// constant pool.
const STREAMS: [AsmRegister64; 12] = [rsi, rdx, rcx, r8, r9, r10, rbx, rbp, r12, r13, r14, r15];
const CALLEE_SAVED: [AsmRegister64; 6] = [rbx, rbp, r12, r13, r14, r15];
/// Stack slots for values spilled when the registers run out (16 ymm registers against
/// AVX-512's 32: a Winograd transform's tile holds more values than that).
const SPILLS: usize = 48;
/// Vector registers left free for the body when uniforms are made resident.
const MIN_FREE: usize = 8;

/// Where a value is while the body is emitted.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Loc {
    Y(usize),
    /// A whole vector in memory: a uniform broadcast on the stack at entry (offset from
    /// rsp), or a constant's 8 lanes in the pool (offset from r11).
    Stack(i32),
    Pool(i32),
    /// A loaded vector evicted from its register: read again from its stream (stream,
    /// byte displacement), outside the masked tail and only from streams the body
    /// never stores to.
    Stream(u16, i32),
    None,
}

impl Loc {
    fn is_mem(self) -> bool {
        matches!(self, Loc::Stack(_) | Loc::Pool(_) | Loc::Stream(..))
    }
}

struct Gen<'l> {
    a: CodeAssembler,
    lp: &'l Loop,
    lay: Layout,
    pool: CodeLabel,
    /// The pool's vectors, 8 lanes each.
    consts: Vec<u32>,
    last: Vec<usize>,
    /// Uniforms and constants in registers for the whole call.
    resident: Vec<(Inst, usize)>,
    /// Uniforms' stack slots (by uniform index).
    uni_slot: Vec<i32>,
    /// The tail mask's register, when the trip count is not a multiple of 8.
    tail: Option<usize>,
    /// Registers from this one up are reserved (resident values, accumulators, the tail
    /// mask).
    top: usize,
}

/// Whether the body uses only what this generator emits.
fn check(lp: &Loop) -> R<()> {
    if lp.f64 {
        return Err("AVX2 loop: f64 lanes".into());
    }
    if lp.elem.iter().any(|&el| el != super::wide::Elem::F32) {
        return Err("AVX2 loop: a stream of other elements than f32".into());
    }
    for i in &lp.insts {
        let ok = match *i {
            Inst::Store { step, .. } => matches!(step, 1 | 2 | 4),
            Inst::Un(u, _) => !matches!(u, Un::ToF32 | Un::ByteU8 | Un::ByteI8),
            Inst::Bin(b, ..) => !matches!(b, Bin::MaxNum | Bin::MinNum),
            _ => true,
        };
        if !ok {
            return Err(format!("AVX2 loop: {i:?} is not supported"));
        }
    }
    Ok(())
}

/// The AVX2 code of `lp` (see the module's documentation), or why not.
pub fn generate(lp: &Loop) -> R<Vec<u8>> {
    if lp.n == 0 || lp.n >= 1 << 28 {
        return Err("AVX2 loop: trip count out of range".into());
    }
    if lp.rows == 0 || lp.rows >= 1 << 31 {
        return Err("AVX2 loop: row count out of range".into());
    }
    if lp.rows > 1 && lp.row_step.len() != lp.streams as usize {
        return Err("AVX2 loop: a row step per stream".into());
    }
    let gprs = lp.streams as usize + usize::from(lp.rows > 1);
    if gprs > STREAMS.len() {
        return Err("AVX2 loop: too many streams".into());
    }
    if lp.reds.len() > 4 {
        return Err("AVX2 loop: too many reductions".into());
    }
    check(lp)?;
    for i in &lp.insts {
        if let Inst::LoadS { stride, .. } = i {
            let span = (lp.n + LANES) as i128 * i128::from(*stride);
            if span.abs() >= 1 << 31 {
                return Err("AVX2 loop: strided index out of range".into());
            }
        }
    }
    let mut last = vec![usize::MAX; lp.insts.len()];
    for (j, i) in lp.insts.iter().enumerate() {
        for o in i.operands() {
            let o = o as usize;
            if o >= j {
                return Err("AVX2 loop: a value used before it is made".into());
            }
            last[o] = j;
        }
    }
    let mut mem: Vec<Inst> = Vec::new();
    for i in &lp.insts {
        if matches!(i, Inst::Uni(_) | Inst::Const(_)) && !mem.contains(i) {
            mem.push(*i);
        }
    }
    let tail = (!lp.n.is_multiple_of(LANES)).then_some(15);
    let fixed = lp.reds.len() + usize::from(tail.is_some());
    let avail = 16 - fixed;
    let most = mem.len().min(avail.saturating_sub(MIN_FREE));
    let mut tries = vec![most, (mem.len() / 2).min(most), 0];
    tries.dedup();
    let mut err = String::new();
    for n in tries {
        let top = avail - n;
        let mut g = Gen {
            a: CodeAssembler::new(64).map_err(e)?,
            lp,
            lay: lp.layout(),
            pool: CodeLabel::default(),
            consts: Vec::new(),
            last: last.clone(),
            resident: mem[..n]
                .iter()
                .enumerate()
                .map(|(k, &i)| (i, top + k))
                .collect(),
            uni_slot: Vec::new(),
            tail,
            top,
        };
        g.pool = g.a.create_label();
        match g.body() {
            Ok(()) => return g.a.assemble(0).map_err(e),
            Err(m) => err = m,
        }
    }
    Err(err)
}

fn release(regs: &[usize], free: &mut Vec<usize>) {
    for &r in regs {
        if !free.contains(&r) {
            free.push(r);
        }
    }
}

/// The accumulator register of reduction `r`.
fn acc_reg(tail: Option<usize>, r: usize) -> usize {
    15 - usize::from(tail.is_some()) - r
}

impl Gen<'_> {
    fn body(&mut self) -> R<()> {
        let lp = self.lp;
        let rows = lp.rows > 1;
        let gprs = lp.streams as usize + usize::from(rows);
        let saved: Vec<AsmRegister64> = STREAMS[..gprs]
            .iter()
            .copied()
            .filter(|r| CALLEE_SAVED.contains(r))
            .collect();
        for r in &saved {
            self.a.push(*r).map_err(e)?;
        }
        // rdi (the args block) is free in the body for the strided stores' addresses.
        self.a.push(rdi).map_err(e)?;
        // Each uniform broadcast once into a 32-byte stack slot (a whole-vector operand).
        let frame = 32 * (i32::from(lp.unis) + SPILLS as i32);
        if frame > 0 {
            self.a.sub(rsp, frame).map_err(e)?;
        }
        for u in 0..lp.unis as usize {
            let off = self.lay.uni(u) as i32;
            self.a.vbroadcastss(ymm0, dword_ptr(rdi + off)).map_err(e)?;
            let slot = 32 * u as i32;
            self.a.vmovups(ymmword_ptr(rsp + slot), ymm0).map_err(e)?;
            self.uni_slot.push(slot);
        }
        for (s, &reg) in STREAMS.iter().enumerate().take(lp.streams as usize) {
            let off = self.lay.stream(s) as i32;
            self.a.mov(reg, qword_ptr(rdi + off)).map_err(e)?;
        }
        self.a.lea(r11, ptr(self.pool)).map_err(e)?;
        for k in 0..self.resident.len() {
            let (inst, r) = self.resident[k];
            let m = self.mem_of(inst)?;
            self.a.vmovups(YMM[r], m).map_err(e)?;
        }
        for r in 0..lp.reds.len() {
            let off = self.lay.red(r) as i32;
            let acc = YMM[acc_reg(self.tail, r)];
            self.a.vbroadcastss(acc, dword_ptr(rdi + off)).map_err(e)?;
        }
        let full = lp.n / LANES;
        let rem = lp.n % LANES;
        if let Some(t) = self.tail {
            // 8 lanes of -1 then 8 of 0: the mask of `rem` lanes starts at lane 8 - rem.
            let mut bits = vec![u32::MAX; 8];
            bits.extend([0u32; 8]);
            let at = self.pool_words(&bits) + 4 * (8 - rem as i32);
            self.a.vmovups(YMM[t], ymmword_ptr(r11 + at)).map_err(e)?;
        }
        let counter = STREAMS[lp.streams as usize];
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
            self.a.add(rax, LANES as i32).map_err(e)?;
            self.a.cmp(rax, (full * LANES) as i32).map_err(e)?;
            self.a.jne(top).map_err(e)?;
        } else if full == 1 {
            self.iteration(false)?;
            if rem > 0 {
                self.a.add(rax, LANES as i32).map_err(e)?;
            }
        }
        if rem > 0 {
            self.iteration(true)?;
        }
        if rows {
            for (s, &step) in lp.row_step.iter().enumerate() {
                let step = i32::try_from(step).map_err(|_| "AVX2 loop: row step too large")?;
                if step != 0 {
                    self.a.add(STREAMS[s], step).map_err(e)?;
                }
            }
            self.a.dec(counter).map_err(e)?;
            self.a.jne(row_top).map_err(e)?;
        }
        self.epilogue(&saved, frame)
    }

    /// Folds each reduction's 8 lanes into lane 0 (a tree: lane `i` takes in lane
    /// `i + d` for `d` = 1, 2, 4, the lower lane as the accumulator, as the AVX-512
    /// loops do), writes the vector back, restores, returns; then the constant pool.
    fn epilogue(&mut self, saved: &[AsmRegister64], frame: i32) -> R<()> {
        let lp = self.lp;
        if frame > 0 {
            self.a.add(rsp, frame).map_err(e)?;
        }
        self.a.pop(rdi).map_err(e)?;
        for r in 0..lp.reds.len() {
            let acc = YMM[acc_reg(self.tail, r)];
            for step in 0..3 {
                match step {
                    0 => self.a.vpermilps(ymm0, acc, 0xB1),
                    1 => self.a.vpermilps(ymm0, acc, 0x4E),
                    _ => self.a.vperm2f128(ymm0, acc, acc, 0x01),
                }
                .map_err(e)?;
                self.combine(lp.reds[r], 1, acc, ymm0, (ymm2, ymm3))?;
                self.a.vmovaps(acc, ymm1).map_err(e)?;
            }
            let off = self.lay.red(r) as i32;
            self.a.vmovups(ymmword_ptr(rdi + off), acc).map_err(e)?;
        }
        self.a.vzeroupper().map_err(e)?;
        for r in saved.iter().rev() {
            self.a.pop(*r).map_err(e)?;
        }
        self.a.ret().map_err(e)?;
        self.a.set_label(&mut self.pool).map_err(e)?;
        if self.consts.is_empty() {
            self.consts.push(0);
        }
        let consts = self.consts.clone();
        self.a.dd(&consts).map_err(e)?;
        Ok(())
    }

    /// `YMM[d]` = reduction `kind` of accumulator `acc` and value `v` (temporaries
    /// `t`): `acc + v`, the NaN-propagating max/min, or the NaN-skipping selects.
    fn combine(
        &mut self,
        kind: Red,
        d: usize,
        acc: AsmRegisterYmm,
        v: AsmRegisterYmm,
        t: (AsmRegisterYmm, AsmRegisterYmm),
    ) -> R<()> {
        let dr = YMM[d];
        match kind {
            Red::Add => self.a.vaddps(dr, acc, v).map_err(e),
            // `v > acc ? v : acc`, `v < acc ? v : acc`.
            Red::SelGt => self.a.vmaxps(dr, v, acc).map_err(e),
            Red::SelLt => self.a.vminps(dr, v, acc).map_err(e),
            Red::Max | Red::Min => self.minmax(kind == Red::Max, dr, acc, v, t, None),
        }
    }

    /// Offset in the pool of `words` (appended, or found).
    fn pool_words(&mut self, words: &[u32]) -> i32 {
        if let Some(at) = self
            .consts
            .windows(words.len())
            .position(|w| w == words)
            .filter(|p| p % 8 == 0)
        {
            return 4 * at as i32;
        }
        let at = self.consts.len();
        self.consts.extend_from_slice(words);
        4 * at as i32
    }

    /// The pool's vector of `bits` in every lane.
    fn pool_vec(&mut self, bits: u32) -> AsmMemoryOperand {
        let at = self.pool_words(&[bits; 8]);
        ymmword_ptr(r11 + at)
    }

    /// The whole-vector memory operand of a uniform or a constant.
    fn mem_of(&mut self, i: Inst) -> R<AsmMemoryOperand> {
        match i {
            Inst::Uni(u) => Ok(ymmword_ptr(rsp + self.uni_slot[u as usize])),
            Inst::Const(bits) => Ok(self.pool_vec(bits)),
            _ => Err("AVX2 loop: not a memory value".into()),
        }
    }

    /// Whether value `v` is a constant.
    fn is_const(&self, v: usize) -> bool {
        matches!(self.lp.insts[v], Inst::Const(_))
    }

    fn loc_mem(&self, l: Loc) -> AsmMemoryOperand {
        match l {
            Loc::Stack(o) => ymmword_ptr(rsp + o),
            Loc::Stream(st, disp) => self.stream_at(st, disp),
            _ => {
                let Loc::Pool(o) = l else { unreachable!() };
                ymmword_ptr(r11 + o)
            }
        }
    }

    fn iteration(&mut self, masked: bool) -> R<()> {
        let lp = self.lp;
        let mut loc: Vec<Loc> = vec![Loc::None; lp.insts.len()];
        let mut free: Vec<usize> = (0..self.top).rev().collect();
        let mut spilled = 0usize;
        for (j, inst) in lp.insts.iter().enumerate() {
            let ops = inst.operands();
            if let Some(&(_, r)) = self.resident.iter().find(|(i, _)| i == inst) {
                loc[j] = Loc::Y(r);
                continue;
            }
            match *inst {
                Inst::Uni(u) => {
                    loc[j] = Loc::Stack(self.uni_slot[u as usize]);
                    continue;
                }
                Inst::Const(bits) => {
                    let at = self.pool_words(&[bits; 8]);
                    loc[j] = Loc::Pool(at);
                    continue;
                }
                _ => {}
            }
            let mut dying: Vec<usize> = Vec::new();
            for &o in &ops {
                if let Loc::Y(r) = loc[o as usize] {
                    if self.last[o as usize] == j && r < self.top && !dying.contains(&r) {
                        dying.push(r);
                    }
                }
            }
            // Instructions that write their result before reading every operand, or
            // that read a dying operand after writing a temporary, take a fresh register.
            let fresh = matches!(
                inst,
                Inst::Bin(Bin::Min | Bin::Max, ..) | Inst::Scalef(..) | Inst::Rcp14(_)
            );
            let mem = |k: usize| -> usize {
                ops.get(k)
                    .map_or(0, |&o| usize::from(loc[o as usize].is_mem()))
            };
            let ntmp = match inst {
                Inst::Bin(Bin::Min | Bin::Max, ..) => 2 + mem(0) + mem(1),
                Inst::Scalef(..) => 2 + mem(0),
                Inst::Load2 { .. } | Inst::LoadS { .. } => 2,
                Inst::Store { step: 2 | 4, .. } => 3 + mem(0),
                Inst::Reduce { r, .. } => match (masked, lp.reds[*r as usize]) {
                    (false, Red::Add | Red::SelGt | Red::SelLt) => mem(0),
                    _ => 3,
                },
                Inst::Fma(..) | Inst::Select(..) => 2,
                Inst::Rcp14(_) => 1 + mem(0),
                Inst::Load { .. } => 0,
                _ => mem(0).max(mem(1)),
            };
            // Temporaries first: they never share a register with an operand (they
            // are written before every operand is read). The result may take a dying
            // operand's register where the emitted code reads all operands first.
            let mut tmp = Vec::new();
            for _ in 0..ntmp {
                tmp.push(self.alloc(&mut free, &mut loc, &mut spilled, (j, masked), &ops)?);
            }
            if !fresh {
                release(&dying, &mut free);
            }
            let out = if matches!(inst, Inst::Store { .. } | Inst::Reduce { .. }) {
                None
            } else {
                Some(self.alloc(&mut free, &mut loc, &mut spilled, (j, masked), &ops)?)
            };
            self.emit(inst, &ops, &loc, out, &tmp, masked)?;
            free.extend(tmp);
            if fresh {
                release(&dying, &mut free);
            }
            if let Some(r) = out {
                loc[j] = Loc::Y(r);
                if self.last[j] == usize::MAX {
                    free.push(r);
                }
            }
        }
        Ok(())
    }

    /// A free register; when none is, the value in a register whose next use lies
    /// furthest after instruction `j` (not one of `ops`, the instruction's operands) is
    /// stored to a stack slot and read from there as a memory operand from then on.
    fn alloc(
        &mut self,
        free: &mut Vec<usize>,
        loc: &mut [Loc],
        spilled: &mut usize,
        (j, masked): (usize, bool),
        ops: &[V],
    ) -> R<usize> {
        if let Some(r) = free.pop() {
            return Ok(r);
        }
        let insts = &self.lp.insts;
        let next_use = |v: usize| {
            (j + 1..insts.len())
                .find(|&k| insts[k].operands().contains(&(v as V)))
                .unwrap_or(usize::MAX)
        };
        // A load from a stream the body never stores to is read again instead (no
        // store, no slot), outside the masked tail (a whole-vector read there could
        // pass the buffer's end).
        let remat = |v: usize| match insts[v] {
            Inst::Load { s, disp, .. } if !masked => {
                let stored = insts
                    .iter()
                    .any(|i| matches!(i, Inst::Store { s: t, .. } if *t == s));
                (!stored).then_some((s, disp))
            }
            _ => None,
        };
        let candidates = (0..j)
            .filter(|&v| matches!(loc[v], Loc::Y(r) if r < self.top))
            .filter(|&v| self.last[v] != usize::MAX && self.last[v] > j)
            .filter(|&v| !ops.contains(&(v as V)));
        let victim = candidates
            .clone()
            .filter(|&v| remat(v).is_some())
            .max_by_key(|&v| next_use(v))
            .or_else(|| candidates.max_by_key(|&v| next_use(v)))
            .ok_or("AVX2 loop: out of vector registers")?;
        let Loc::Y(r) = loc[victim] else {
            unreachable!()
        };
        if let Some((st, disp)) = remat(victim) {
            loc[victim] = Loc::Stream(st, disp);
            return Ok(r);
        }
        if *spilled >= SPILLS {
            return Err("AVX2 loop: out of vector registers".into());
        }
        let slot = 32 * (i32::from(self.lp.unis) + *spilled as i32);
        *spilled += 1;
        self.a.vmovups(ymmword_ptr(rsp + slot), YMM[r]).map_err(e)?;
        loc[victim] = Loc::Stack(slot);
        Ok(r)
    }

    /// A register holding `l` (a memory value loaded into `tmp`).
    fn reg(&mut self, l: Loc, tmp: usize) -> R<AsmRegisterYmm> {
        match l {
            Loc::Y(r) => Ok(YMM[r]),
            Loc::Stack(_) | Loc::Pool(_) | Loc::Stream(..) if tmp >= 16 => {
                Err("AVX2 loop: no temporary for a memory value".into())
            }
            Loc::Stack(_) | Loc::Pool(_) | Loc::Stream(..) => {
                let m = self.loc_mem(l);
                self.a.vmovups(YMM[tmp], m).map_err(e)?;
                Ok(YMM[tmp])
            }
            Loc::None => Err("AVX2 loop: a value without a place".into()),
        }
    }

    fn stream_at(&self, s: u16, disp: i32) -> AsmMemoryOperand {
        ymmword_ptr(STREAMS[s as usize] + rax * 4 + disp)
    }

    /// `d = max(x, y)` / `min(x, y)` propagating NaN, -0 below +0 (temporaries `t`;
    /// `d` is neither operand). With `c`, `y` is that constant (not NaN): one
    /// instruction, two for a max with +0 (which turns -0 into +0).
    fn minmax(
        &mut self,
        max: bool,
        d: AsmRegisterYmm,
        x: AsmRegisterYmm,
        y: AsmRegisterYmm,
        t: (AsmRegisterYmm, AsmRegisterYmm),
        c: Option<u32>,
    ) -> R<()> {
        const NEG_ZERO: u32 = 0x8000_0000;
        match c {
            // `vmaxps d, y, x` gives x when either is NaN: a NaN x stays.
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
        let (t0, t1) = t;
        // Both orders, joined so that -0 and +0 give the right zero; then NaN where
        // either operand is.
        if max {
            self.a.vmaxps(d, x, y).map_err(e)?;
            self.a.vmaxps(t0, y, x).map_err(e)?;
            self.a.vandps(d, d, t0).map_err(e)?;
        } else {
            self.a.vminps(d, x, y).map_err(e)?;
            self.a.vminps(t0, y, x).map_err(e)?;
            self.a.vorps(d, d, t0).map_err(e)?;
        }
        self.a.vcmpps(t0, x, y, 3).map_err(e)?;
        self.a.vaddps(t1, x, y).map_err(e)?;
        self.a.vblendvps(d, d, t1, t0).map_err(e)
    }

    fn emit(
        &mut self,
        inst: &Inst,
        ops: &[V],
        loc: &[Loc],
        out: Option<usize>,
        tmp: &[usize],
        masked: bool,
    ) -> R<()> {
        let l = |k: usize| loc[ops[k] as usize];
        let d = YMM[out.unwrap_or(0)];
        // An out-of-range temporary for instructions given none (never used as one).
        let tmp: Vec<usize> = if tmp.is_empty() {
            vec![usize::MAX]
        } else {
            tmp.to_vec()
        };
        let tmp = &tmp[..];
        let is_mem = |l: Loc| l.is_mem();
        let tail = self.tail.map(|t| YMM[t]);
        // `d = x op y`, y a register or a whole-vector memory operand.
        macro_rules! b2 {
            ($m:ident, $xr:expr, $y:expr) => {
                if is_mem($y) {
                    let ym = self.loc_mem($y);
                    self.a.$m(d, $xr, ym)
                } else {
                    let yr = self.reg($y, tmp[0])?;
                    self.a.$m(d, $xr, yr)
                }
            };
        }
        match *inst {
            Inst::Load { s, disp, .. } => {
                let m = self.stream_at(s, disp);
                match (masked, tail) {
                    (true, Some(t)) => self.a.vmaskmovps(d, t, m),
                    _ => self.a.vmovups(d, m),
                }
                .map_err(e)?;
            }
            Inst::Load2 { s, disp, .. } => {
                // Elements 0..16 from lane 0's address in two halves, the even ones of
                // each 128-bit quarter picked (vshufps), the quarters put in order
                // (vpermpd). The tail reads only up to its last lane's element.
                let lo = ymmword_ptr(STREAMS[s as usize] + rax * 8 + disp);
                let hi = ymmword_ptr(STREAMS[s as usize] + rax * 8 + (disp + 32));
                let (t0, t1) = (YMM[tmp[0]], YMM[tmp[1]]);
                if masked {
                    let rem = (self.lp.n % LANES) as i32;
                    let elems = 2 * rem - 1;
                    let mut bits = vec![u32::MAX; 8];
                    bits.extend([0u32; 8]);
                    let table = self.pool_words(&bits);
                    let lo_mask = ymmword_ptr(r11 + (table + 4 * (8 - elems.min(8))));
                    let hi_mask = ymmword_ptr(r11 + (table + 4 * (8 - (elems - 8).max(0))));
                    self.a.vmovups(t0, lo_mask).map_err(e)?;
                    self.a.vmaskmovps(d, t0, lo).map_err(e)?;
                    self.a.vmovups(t0, hi_mask).map_err(e)?;
                    self.a.vmaskmovps(t1, t0, hi).map_err(e)?;
                    self.a.vshufps(d, d, t1, 0x88).map_err(e)?;
                } else {
                    self.a.vmovups(d, lo).map_err(e)?;
                    self.a.vshufps(d, d, hi, 0x88).map_err(e)?;
                }
                self.a.vpermpd(d, d, 0xD8).map_err(e)?;
            }
            Inst::LoadS {
                s, disp, stride, ..
            } => {
                // Lane l's element index (i + l) stride, as i32; the gather's mask (all
                // lanes, or the tail's) is consumed.
                let (t, m) = (YMM[tmp[0]], YMM[tmp[1]]);
                let lanes: Vec<u32> = (0..8).map(|l| (l * stride) as u32).collect();
                let lo = self.pool_words(&lanes);
                let st = self.pool_vec(stride as u32);
                self.a.vmovd(XMM[tmp[0]], eax).map_err(e)?;
                self.a.vpbroadcastd(t, XMM[tmp[0]]).map_err(e)?;
                self.a.vpmulld(t, t, st).map_err(e)?;
                self.a.vpaddd(t, t, ymmword_ptr(r11 + lo)).map_err(e)?;
                match (masked, tail) {
                    (true, Some(tl)) => {
                        self.a.vmovaps(m, tl).map_err(e)?;
                        self.a.vxorps(d, d, d).map_err(e)?;
                    }
                    _ => self.a.vpcmpeqd(m, m, m).map_err(e)?,
                }
                let at = ptr(STREAMS[s as usize] + t * 4 + disp);
                self.a.vgatherdps_3(d, at, m).map_err(e)?;
            }
            Inst::Store {
                s,
                disp,
                step: step @ (2 | 4),
                ..
            } => {
                // Each group of 8 elements from lane 0's (`step` of them) takes its
                // lanes spread to every `step`th position (vpermps) and is stored under
                // the mask of those positions (vmaskmovps leaves the others as they
                // are); the tail's groups only up to its last lane's element.
                let v = self.reg(l(0), *tmp.get(3).unwrap_or(&usize::MAX))?;
                let (idx, mk, p) = (YMM[tmp[0]], YMM[tmp[1]], YMM[tmp[2]]);
                let step = i32::from(step);
                let per = 8 / step;
                let valid = if masked {
                    (self.lp.n % LANES) as i32
                } else {
                    8
                };
                // rdi = 2 i (step 4: the address is base + 16 i, past x86's scale 8).
                if step == 4 {
                    self.a.lea(rdi, ptr(rax + rax)).map_err(e)?;
                }
                for q in 0..step {
                    let first = q * per;
                    if first >= valid {
                        break;
                    }
                    let ix: Vec<u32> = (0..8).map(|k| (first + k / step) as u32).collect();
                    let bits: Vec<u32> = (0..8)
                        .map(|k| {
                            if k % step == 0 && first + k / step < valid {
                                u32::MAX
                            } else {
                                0
                            }
                        })
                        .collect();
                    let io = self.pool_words(&ix);
                    let mo = self.pool_words(&bits);
                    self.a.vmovups(idx, ymmword_ptr(r11 + io)).map_err(e)?;
                    self.a.vpermps(p, idx, v).map_err(e)?;
                    self.a.vmovups(mk, ymmword_ptr(r11 + mo)).map_err(e)?;
                    let at = if step == 2 {
                        ymmword_ptr(STREAMS[s as usize] + rax * 8 + (disp + 32 * q))
                    } else {
                        ymmword_ptr(STREAMS[s as usize] + rdi * 8 + (disp + 32 * q))
                    };
                    self.a.vmaskmovps(at, mk, p).map_err(e)?;
                }
            }
            Inst::Store {
                s, disp, step: 1, ..
            } => {
                let v = self.reg(l(0), tmp[0])?;
                let m = self.stream_at(s, disp);
                match (masked, tail) {
                    (true, Some(t)) => self.a.vmaskmovps(m, t, v),
                    _ => self.a.vmovups(m, v),
                }
                .map_err(e)?;
            }
            Inst::Reduce { r, .. } => {
                let v = self.reg(l(0), tmp[0])?;
                let acc = YMM[acc_reg(self.tail, r as usize)];
                let kind = self.lp.reds[r as usize];
                match (masked, tail, kind) {
                    (false, _, Red::Add) => self.a.vaddps(acc, acc, v).map_err(e)?,
                    (false, _, Red::SelGt) => self.a.vmaxps(acc, v, acc).map_err(e)?,
                    (false, _, Red::SelLt) => self.a.vminps(acc, v, acc).map_err(e)?,
                    (_, t, _) => {
                        // The combination in a temporary, kept in the valid lanes only
                        // in the tail.
                        let (t1, t2) = (YMM[tmp[1]], YMM[tmp[2]]);
                        self.combine(kind, tmp[1], acc, v, (t2, YMM[tmp[0]]))?;
                        match (masked, t) {
                            (true, Some(t)) => self.a.vblendvps(acc, acc, t1, t),
                            _ => self.a.vmovaps(acc, t1),
                        }
                        .map_err(e)?;
                    }
                }
            }
            Inst::Un(op, _) => {
                let x = l(0);
                match op {
                    Un::Neg | Un::Abs => {
                        let bits = if op == Un::Neg {
                            0x8000_0000
                        } else {
                            0x7fff_ffff
                        };
                        let c = self.pool_vec(bits);
                        let xr = self.reg(x, tmp[0])?;
                        if op == Un::Neg {
                            self.a.vxorps(d, xr, c)
                        } else {
                            self.a.vandps(d, xr, c)
                        }
                        .map_err(e)?;
                    }
                    Un::Sqrt => {
                        if is_mem(x) {
                            let m = self.loc_mem(x);
                            self.a.vsqrtps(d, m)
                        } else {
                            let xr = self.reg(x, tmp[0])?;
                            self.a.vsqrtps(d, xr)
                        }
                        .map_err(e)?;
                    }
                    Un::Floor | Un::Ceil | Un::Nearest | Un::Trunc => {
                        // Imprecision exceptions suppressed (bit 3), as vrndscaleps.
                        let mode = match op {
                            Un::Nearest => 8,
                            Un::Floor => 9,
                            Un::Ceil => 10,
                            _ => 11,
                        };
                        let xr = self.reg(x, tmp[0])?;
                        self.a.vroundps(d, xr, mode).map_err(e)?;
                    }
                    _ => return Err(format!("AVX2 loop: {op:?}")),
                }
            }
            Inst::Bin(op, ..) => {
                let (mut vx, mut vy) = (ops[0] as usize, ops[1] as usize);
                // Min and Max (NaN either way, -0 below +0) are symmetric.
                let commutes = matches!(op, Bin::Add | Bin::Mul | Bin::Min | Bin::Max);
                if commutes && (is_mem(loc[vx]) && !is_mem(loc[vy]) || self.is_const(vx)) {
                    std::mem::swap(&mut vx, &mut vy);
                }
                let (x, y) = (loc[vx], loc[vy]);
                if let Bin::Min | Bin::Max = op {
                    let c = match self.lp.insts[vy] {
                        Inst::Const(bits) => Some(bits),
                        _ => None,
                    };
                    // Temporaries in turn: x's, y's (each if in memory), minmax's two.
                    let mut next = tmp.iter().copied();
                    let mut take = || next.next().ok_or("AVX2 loop: min/max temporaries");
                    let tx = if is_mem(x) { take()? } else { usize::MAX };
                    let ty = if is_mem(y) { take()? } else { usize::MAX };
                    let t = (YMM[take()?], YMM[take()?]);
                    let xr = self.reg(x, tx)?;
                    let yr = self.reg(y, ty)?;
                    return self.minmax(op == Bin::Max, d, xr, yr, t, c);
                }
                let xr = self.reg(x, tmp[0])?;
                match op {
                    Bin::Add => b2!(vaddps, xr, y),
                    Bin::Sub => b2!(vsubps, xr, y),
                    Bin::Mul => b2!(vmulps, xr, y),
                    Bin::Div => b2!(vdivps, xr, y),
                    Bin::MinX => b2!(vminps, xr, y),
                    Bin::MaxX => b2!(vmaxps, xr, y),
                    _ => return Err(format!("AVX2 loop: {op:?}")),
                }
                .map_err(e)?;
            }
            Inst::Cmp(op, ..) => {
                let xr = self.reg(l(0), tmp[0])?;
                let y = l(1);
                let p = cmp_pred(op);
                if is_mem(y) {
                    let ym = self.loc_mem(y);
                    self.a.vcmpps(d, xr, ym, p)
                } else {
                    let yr = self.reg(y, tmp[0])?;
                    self.a.vcmpps(d, xr, yr, p)
                }
                .map_err(e)?;
            }
            Inst::MAnd(..) | Inst::MOr(..) | Inst::IAdd(..) | Inst::ISub(..) => {
                let (mut x, mut y) = (l(0), l(1));
                if !matches!(inst, Inst::ISub(..)) && is_mem(x) && !is_mem(y) {
                    std::mem::swap(&mut x, &mut y);
                }
                let xr = self.reg(x, tmp[0])?;
                match inst {
                    Inst::MAnd(..) => b2!(vandps, xr, y),
                    Inst::MOr(..) => b2!(vorps, xr, y),
                    Inst::IAdd(..) => b2!(vpaddd, xr, y),
                    _ => b2!(vpsubd, xr, y),
                }
                .map_err(e)?;
            }
            Inst::Sra(_, n) | Inst::Shl(_, n) => {
                let xr = self.reg(l(0), tmp[0])?;
                if matches!(inst, Inst::Sra(..)) {
                    self.a.vpsrad(d, xr, i32::from(n))
                } else {
                    self.a.vpslld(d, xr, i32::from(n))
                }
                .map_err(e)?;
            }
            Inst::Select(..) => {
                // d = m ? a : b.
                let mr = self.reg(l(0), tmp[0])?;
                let br = self.reg(l(2), tmp[1])?;
                let a = l(1);
                if is_mem(a) {
                    let am = self.loc_mem(a);
                    self.a.vblendvps(d, br, am, mr)
                } else {
                    let ar = self.reg(a, tmp[1])?;
                    self.a.vblendvps(d, br, ar, mr)
                }
                .map_err(e)?;
            }
            Inst::Fma(kind, ..) => self.fma(kind, d, (l(0), l(1), l(2)), tmp)?,
            Inst::Scalef(..) => {
                // y 2^n = (y 2^a) 2^b with n clamped to [-250, 250] (beyond, y 2^n is 0
                // or infinite all the same for the y of the exp kernels), a = n >> 1,
                // b = n - a: both powers are normal floats, the first product is exact
                // and the second rounds once, as vscalefps does.
                let yr = self.reg(l(0), *tmp.get(2).unwrap_or(&usize::MAX))?;
                let (t0, t1) = (YMM[tmp[0]], YMM[tmp[1]]);
                let nr = self.reg(l(1), tmp[1])?;
                let lo = self.pool_vec((-250.0f32).to_bits());
                let hi = self.pool_vec(250.0f32.to_bits());
                // t1 = clamp(n) as i32 (a NaN n gives a NaN y anyway).
                self.a.vmaxps(t1, nr, lo).map_err(e)?;
                self.a.vminps(t1, t1, hi).map_err(e)?;
                self.a.vcvtps2dq(t1, t1).map_err(e)?;
                if yr == t0 {
                    return Err("AVX2 loop: scalef operand in a temporary".into());
                }
                let bias = self.pool_vec(127);
                // t0 = 2^a, d = y 2^a.
                self.a.vpsrad(t0, t1, 1).map_err(e)?;
                self.a.vpsubd(t1, t1, t0).map_err(e)?;
                self.a.vpaddd(t0, t0, bias).map_err(e)?;
                self.a.vpslld(t0, t0, 23).map_err(e)?;
                self.a.vmulps(d, yr, t0).map_err(e)?;
                let bias = self.pool_vec(127);
                self.a.vpaddd(t1, t1, bias).map_err(e)?;
                self.a.vpslld(t1, t1, 23).map_err(e)?;
                self.a.vmulps(d, d, t1).map_err(e)?;
            }
            Inst::Rcp14(_) => {
                // vrcpps (12 bits) and one Newton step: about 2^-22, finer than the
                // 14-bit vrcp14ps the caller's own Newton step expects.
                let xr = self.reg(l(0), *tmp.get(1).unwrap_or(&usize::MAX))?;
                let one = self.pool_vec(1.0f32.to_bits());
                self.a.vrcpps(d, xr).map_err(e)?;
                let t = YMM[tmp[0]];
                if xr == t {
                    return Err("AVX2 loop: reciprocal operand in a temporary".into());
                }
                self.a.vmovups(t, one).map_err(e)?;
                self.a.vfnmadd231ps(t, xr, d).map_err(e)?;
                self.a.vfmadd231ps(d, d, t).map_err(e)?;
            }
            _ => return Err(format!("AVX2 loop: {inst:?} is not supported")),
        }
        Ok(())
    }

    /// `d = a b + c` (or the other sign patterns) with one rounding; `d` may be one of
    /// the operands' registers (a dying one).
    fn fma(
        &mut self,
        kind: FmaKind,
        d: AsmRegisterYmm,
        (a, b, c): (Loc, Loc, Loc),
        tmp: &[usize],
    ) -> R<()> {
        let is_mem = |l: Loc| l.is_mem();
        let (mut a, mut b) = (a, b);
        if is_mem(a) && !is_mem(b) {
            std::mem::swap(&mut a, &mut b);
        }
        let ar = self.reg(a, tmp[0])?;
        let cr = self.reg(c, tmp[1])?;
        let br = match b {
            Loc::Y(r) => Some(YMM[r]),
            _ => None,
        };
        macro_rules! f3 {
            ($m231:ident, $m213:ident, $m132:ident) => {{
                if cr == d {
                    match br {
                        Some(br) => self.a.$m231(d, ar, br),
                        None => {
                            let bm = self.loc_mem(b);
                            self.a.$m231(d, ar, bm)
                        }
                    }
                } else if ar == d {
                    // d = d b + c.
                    match br {
                        Some(br) => self.a.$m213(d, br, cr),
                        None => {
                            let bm = self.loc_mem(b);
                            self.a.$m132(d, cr, bm)
                        }
                    }
                } else if br == Some(d) {
                    // d = a d + c.
                    self.a.$m213(d, ar, cr)
                } else {
                    self.a.vmovaps(d, cr).map_err(e)?;
                    match br {
                        Some(br) => self.a.$m231(d, ar, br),
                        None => {
                            let bm = self.loc_mem(b);
                            self.a.$m231(d, ar, bm)
                        }
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::x86::wide::Builder;

    #[test]
    fn refuses_what_it_cannot_emit() {
        // An f16 stream (the AVX-512 loops convert them; these do not).
        let mut b = Builder::new(100);
        b.lp.streams = 2;
        b.lp.elem = vec![super::super::wide::Elem::F16, super::super::wide::Elem::F32];
        let x = b.load(0, 0);
        b.push(Inst::Store {
            s: 1,
            disp: 0,
            v: x,
            step: 1,
        });
        assert!(generate(&b.lp).is_err());
        let mut b = Builder::new(100);
        b.lp.streams = 2;
        let x = b.load(0, 0);
        let y = b.mul(x, x);
        b.push(Inst::Store {
            s: 1,
            disp: 0,
            v: y,
            step: 1,
        });
        assert!(generate(&b.lp).is_ok());
    }
}
