//! How the native back end runs `Stmt::Gemm`: on x86_64 with AVX-512 or AVX2+FMA, a call
//! to a shape-specialised machine-code function (backend/x86/gemm.rs) with constant
//! operands prepacked into its panel layout at compile time; elsewhere (or for views the
//! microkernel cannot read), the call expands to a kernel-IR loop nest. A B view in column
//! panels of the microkernel's width is read in place; other panel widths run as one call
//! per panel.

use crate::backend::x86::amx;
use crate::backend::x86::gemm::{self as x86, Isa, Spec};
use crate::kir::{BinOp, BufKind, CmpOp, Expr, GemmAct, GemmCall, Kernel, MatView, Program};
use crate::kir::{Stmt, Ty, UnOp};
use cranelift_codegen::ir::{condcodes::IntCC, InstBuilder, MemFlagsData};
use cranelift_codegen::ir::{types, AbiParam, Block, Signature, Type, Value};
use cranelift_frontend::{FunctionBuilder, FunctionBuilderContext};
use cranelift_module::{DataDescription, DataId, FuncId, Linkage, Module};
use cranelift_object::ObjectModule;
use std::collections::HashMap;

/// Where the microkernel finds an operand.
#[derive(Clone, Copy, Debug)]
pub enum Operand {
    /// The view itself (base + offset).
    Direct,
    /// A prepacked copy in the object.
    Packed(DataId),
}

/// How one kept `Stmt::Gemm` runs.
#[derive(Clone, Debug)]
pub enum Plan {
    /// A call to a machine-code function.
    Asm {
        func: FuncId,
        a: Operand,
        b: Operand,
        /// How the call splits into tasks for the application's `parallel_for`, when it
        /// is large enough to pay for the dispatch.
        split: Option<Split>,
    },
    /// f32x4 register tiles in Cranelift IR (NEON); n is a multiple of [`VEC_NR`].
    Vec4,
}

impl Plan {
    /// The plan run whole on the calling thread (inside a parallel task, where
    /// `parallel_for` cannot be called again).
    pub fn whole(&self) -> Plan {
        match self {
            Plan::Asm { func, a, b, .. } => Plan::Asm {
                func: *func,
                a: *a,
                b: *b,
                split: None,
            },
            p => p.clone(),
        }
    }
}

/// A microkernel call cut into `tasks` equal parts of whole register tiles (the last may
/// be smaller), by columns or, when C has too few columns, by rows. Part `t` runs `func`
/// (`last` for the final part) on the operands advanced by `t` times the steps (bytes).
/// Every part accumulates over k in the same blocks as the whole call, so the results are
/// bit-identical to the serial call.
#[derive(Clone, Copy, Debug)]
pub struct Split {
    pub tasks: u32,
    /// The task function `(ctx, index)` that runs part `index` (ctx: the operand pointers
    /// a, b, c, init, then the add view's byte offset from C when the call has one).
    pub task: FuncId,
}

/// The least work (multiply-adds) of a GEMM worth handing to threads: below it the
/// dispatch (a microsecond or two with a spinning pool) costs more than it saves. A
/// matrix-vector product of 512 x 784 (an MLP layer, bound by reading its weights) is
/// above it: split by columns, each core reads half the weights, from its own cache once
/// the pool gives a thread the same share on every run (mlp on 2 threads 0.067 ->
/// 0.019 ms).
pub const SPLIT_MIN_MACS: usize = 1 << 18;
/// The fewest rows of a call on panels the kernel packed just before (on the caller's
/// core) worth splitting: each part reads its panels from the other core's cache, and
/// with few rows using each panel element the transfer costs about what the multiply
/// does (small_cnn's 32 x 210 x 144 conv on 2 threads: 0.026 -> 0.032 ms, slower than
/// on one).
pub const SPLIT_MIN_ROWS_PACKED: usize = 64;
/// The most parts one call is cut into (12: divisible by 2, 3, 4 and 6 threads).
pub const SPLIT_MAX_TASKS: usize = 12;

/// Columns of a Cranelift f32x4 tile (two vectors) and its rows.
pub const VEC_NR: u64 = 8;
pub const VEC_MR: u64 = 4;

/// Per-object state: the microkernel ISA and blocking, and the functions and packed
/// constants made so far (shared by calls of one shape or one weight).
pub struct GemmCtx {
    isa: Option<Isa>,
    /// aarch64: f32x4 tiles from Cranelift.
    vec4: bool,
    /// AVX-512 VNNI: 8-bit products as `vpdpbusd` tiles.
    vnni: bool,
    /// AMX-INT8: 8-bit products on the tile unit where the shape fits.
    amx: bool,
    l1_kib: u32,
    l2_kib: u32,
    prefix: String,
    funcs: HashMap<Spec, FuncId>,
    /// Task functions made so far (for their names).
    tasks: usize,
    packs: HashMap<PackKey, DataId>,
}

type R<T> = Result<T, String>;

/// A packed constant: buffer, offset, strides, the two sizes, alpha's bits, B or A.
type PackKey = (usize, i64, i64, i64, usize, usize, u32, bool);

impl GemmCtx {
    pub fn new(prefix: &str, triple: &str, features: &[String], l1_kib: u32, l2_kib: u32) -> Self {
        let isa = if triple.starts_with("x86_64") && std::env::var_os("ONNXC_NO_ASM_GEMM").is_none()
        {
            Isa::from_features(features)
        } else {
            None
        };
        GemmCtx {
            vnni: isa == Some(Isa::Avx512) && features.iter().any(|f| f == "avx512vnni"),
            amx: isa == Some(Isa::Avx512) && features.iter().any(|f| f == "amx-int8"),
            isa,
            vec4: triple.starts_with("aarch64"),
            l1_kib,
            l2_kib,
            prefix: prefix.to_string(),
            funcs: HashMap::new(),
            tasks: 0,
            packs: HashMap::new(),
        }
    }

    /// Rewrites `k` for this target: GEMMs the microkernel takes stay (their plans are
    /// returned in statement order), the others become loops.
    pub fn prepare(
        &mut self,
        module: &mut ObjectModule,
        k: &Kernel,
        p: &Program,
    ) -> R<(Kernel, Vec<Plan>)> {
        let mut out = k.clone();
        let mut calls = Vec::new();
        let body = std::mem::take(&mut out.body);
        out.body = self.stmts(module, body, &mut out.vars, p, &mut calls)?;
        Ok((out, calls))
    }

    fn stmts(
        &mut self,
        module: &mut ObjectModule,
        body: Vec<Stmt>,
        vars: &mut Vec<Ty>,
        p: &Program,
        calls: &mut Vec<Plan>,
    ) -> R<Vec<Stmt>> {
        let mut out = Vec::with_capacity(body.len());
        for s in body {
            match s {
                Stmt::For { var, extent, body } => out.push(Stmt::For {
                    var,
                    extent,
                    body: self.stmts(module, body, vars, p, calls)?,
                }),
                Stmt::If { cond, then, els } => out.push(Stmt::If {
                    cond,
                    then: self.stmts(module, then, vars, p, calls)?,
                    els: self.stmts(module, els, vars, p, calls)?,
                }),
                Stmt::While { cond, body } => out.push(Stmt::While {
                    cond,
                    body: self.stmts(module, body, vars, p, calls)?,
                }),
                Stmt::Gemm(g) => self.gemm(module, g, vars, p, calls, &mut out)?,
                s => out.push(s),
            }
        }
        Ok(out)
    }

    /// One GEMM: a microkernel call, f32x4 tiles, or loops; a B in panels the microkernel
    /// cannot read runs as one call per panel.
    fn gemm(
        &mut self,
        module: &mut ObjectModule,
        g: Box<GemmCall>,
        vars: &mut Vec<Ty>,
        p: &Program,
        calls: &mut Vec<Plan>,
        out: &mut Vec<Stmt>,
    ) -> R<()> {
        if let Some(c) = self.plan(module, &g, p)? {
            calls.push(c);
            out.push(Stmt::Gemm(g));
            return Ok(());
        }
        if g.a.panel.is_some() || g.b.panel.is_some() {
            for part in unpanel(&g) {
                self.gemm(module, Box::new(part), vars, p, calls, out)?;
            }
            return Ok(());
        }
        match self.vec4_split(&g) {
            Some((main, rest)) => {
                calls.push(Plan::Vec4);
                out.push(Stmt::Gemm(Box::new(main)));
                if let Some(r) = rest {
                    out.extend(expand(&r, vars));
                }
            }
            None => out.extend(expand(&g, vars)),
        }
        Ok(())
    }

    /// For f32x4 tiles: the columns that fill whole tiles, and the rest (as loops).
    fn vec4_split(&self, g: &GemmCall) -> Option<(GemmCall, Option<GemmCall>)> {
        let init_ok = g.init.as_ref().is_none_or(|v| v.cs == 0 || v.cs == 1);
        let add_ok = g.add.as_ref().is_none_or(|v| v.cs == 1);
        if !self.vec4 || g.int8 || g.b.cs != 1 || g.c.cs != 1 || !init_ok || !add_ok || g.n < VEC_NR
        {
            return None;
        }
        let n8 = g.n / VEC_NR * VEC_NR;
        let mut main = g.clone();
        main.n = n8;
        if n8 == g.n {
            return Some((main, None));
        }
        let shift = |v: &MatView| MatView {
            offset: Expr::add(v.offset.clone(), Expr::Int(n8 as i64 * v.cs)),
            ..v.clone()
        };
        let mut rest = g.clone();
        rest.n = g.n - n8;
        rest.b = shift(&g.b);
        rest.c = shift(&g.c);
        rest.init = g.init.as_ref().map(shift);
        rest.add = g.add.as_ref().map(shift);
        Some((main, Some(rest)))
    }

    /// The microkernel plan for `g`, or None when it must run as loops.
    fn plan(&mut self, module: &mut ObjectModule, g: &GemmCall, p: &Program) -> R<Option<Plan>> {
        let Some(isa) = self.isa else {
            return Ok(None);
        };
        if g.int8 {
            return self.plan_int8(module, g, p);
        }
        let (m, n, k) = (g.m as usize, g.n as usize, g.k as usize);
        let (mr, nr) = (isa.mr() as i64, isa.nr() as i64);
        if g.c.cs != 1 {
            return Ok(None);
        }
        let ca = konst(p, &g.a);
        let cb = konst(p, &g.b);
        if g.alpha != 1.0 && ca.is_none() && cb.is_none() {
            return Ok(None);
        }
        // alpha goes into one packed operand (B when both are).
        let alpha_in_b = cb.is_some();
        let Some(init) = init_strides(g) else {
            return Ok(None);
        };
        let init_is_c = g.init.as_ref() == Some(&g.c);
        // The add view at C's positions in another buffer: one byte offset from C.
        let add = match &g.add {
            None => false,
            Some(v) if v.rs == g.c.rs && v.cs == 1 && v.panel.is_none() => true,
            Some(_) => return Ok(None),
        };
        let (a_tile, a_row, a_k, a_op) = match (ca, g.a.panel) {
            // Row panels of the microkernel's height: its packed layout, read in place.
            (None, Some((w, ps))) if w as i64 == mr => {
                (ps * 4, g.a.rs * 4, g.a.cs * 4, Operand::Direct)
            }
            (_, Some(_)) => return Ok(None),
            (Some((data, off)), None) => {
                let alpha = if alpha_in_b { 1.0 } else { g.alpha };
                let key = (g.a.buf, off, g.a.rs, g.a.cs, m, k, alpha.to_bits(), false);
                let id = self.pack(module, key, || {
                    le_bytes(&x86::pack_a(
                        isa,
                        &floats(data),
                        off,
                        g.a.rs,
                        g.a.cs,
                        m,
                        k,
                        alpha,
                    ))
                })?;
                (k as i64 * mr * 4, 4, mr * 4, Operand::Packed(id))
            }
            (None, None) => (mr * g.a.rs * 4, g.a.rs * 4, g.a.cs * 4, Operand::Direct),
        };
        let mut b_group = 1;
        let (b_panel, b_k, b_padded, b_op) = match (cb, g.b.panel) {
            // Panels of a multiple of the microkernel's width, padding included: read in
            // place.
            (None, Some((w, ps))) if w > 0 && w as i64 % nr == 0 && g.b.cs == 1 => {
                b_group = (w as i64 / nr) as usize;
                (ps * 4, g.b.rs * 4, true, Operand::Direct)
            }
            (_, Some(_)) => return Ok(None),
            (Some((data, off)), None) => {
                let key = (g.b.buf, off, g.b.rs, g.b.cs, k, n, g.alpha.to_bits(), true);
                let id = self.pack(module, key, || {
                    le_bytes(&x86::pack_b(
                        isa,
                        &floats(data),
                        off,
                        g.b.rs,
                        g.b.cs,
                        k,
                        n,
                        g.alpha,
                    ))
                })?;
                (k as i64 * nr * 4, nr * 4, true, Operand::Packed(id))
            }
            (None, None) if g.b.cs == 1 => (nr * 4, g.b.rs * 4, false, Operand::Direct),
            (None, None) => return Ok(None),
        };
        let (kc, nc) = x86::blocking(isa, m, k, n, self.l1_kib, self.l2_kib);
        // Column blocks start at whole B panels.
        let gw = b_group * nr as usize;
        let nc = nc.div_ceil(gw) * gw;
        let spec = Spec {
            isa,
            m,
            n,
            k,
            a_tile,
            a_row,
            a_k,
            b_panel,
            b_k,
            b_padded,
            b_group,
            c_rs: g.c.rs * 4,
            init,
            init_is_c,
            add,
            act: g.act.into(),
            kc,
            nc,
            int8: None,
            amx: false,
            a_padded: false,
        };
        let Some(func) = self.func(module, &spec)? else {
            return Ok(None);
        };
        // B panels written by the kernel just before (a convolution's im2col block): split
        // by columns, so each thread reads only its own panels.
        let b_packed_here = matches!(b_op, Operand::Direct) && g.b.panel.is_some();
        let split = self.split(module, &spec, b_packed_here)?;
        Ok(Some(Plan::Asm {
            func,
            a: a_op,
            b: b_op,
            split,
        }))
    }

    /// The `vpdpbusd` plan for an 8-bit product: A read in place as rows of dwords (four
    /// k, contiguous); B a constant (packed into the microkernel's panels) or read in
    /// place from its quads when they are contiguous along the columns (`cs == 4`). Each k
    /// step of the microkernel is four of the product's.
    fn plan_int8(
        &mut self,
        module: &mut ObjectModule,
        g: &GemmCall,
        p: &Program,
    ) -> R<Option<Plan>> {
        let (m, n, k) = (g.m as usize, g.n as usize, g.k as usize);
        let Some(init) = init_strides(g) else {
            return Ok(None);
        };
        if !self.vnni || !k.is_multiple_of(4) || g.a.cs != 1 || g.c.cs != 1 {
            return Ok(None);
        }
        let isa = Isa::Avx512;
        let steps = k / 4;
        let nr = isa.nr() as i64;
        let int8 = match p.buffers.get(g.a.buf).map(|b| b.elem) {
            Some(Ty::I8) => x86::Int8::SignedA,
            _ => x86::Int8::UnsignedA,
        };
        let (b_panel, b_k, b_padded, b_op) = match konst(p, &g.b) {
            Some((data, off)) => {
                // (alpha 1: an 8-bit buffer is never an f32 call's B, so the keys cannot
                // meet.)
                let key = (g.b.buf, off, g.b.rs, g.b.cs, k, n, 1f32.to_bits(), true);
                let id = self.pack(module, key, || {
                    x86::pack_b_int8(data, off, g.b.rs, g.b.cs, k, n)
                })?;
                (steps as i64 * nr * 4, nr * 4, true, Operand::Packed(id))
            }
            None if g.b.cs == 4 => (nr * 4, g.b.rs, false, Operand::Direct),
            None => return Ok(None),
        };
        let (kc, nc) = x86::blocking(isa, m, steps, n, self.l1_kib, self.l2_kib);
        // On the tiles, a k that is not whole tile steps needs A's rows padded with zero
        // quads: a constant A (a conv's weights) is copied so at compile time.
        let pad = self.amx && amx::pads_a(steps);
        let (a_row, a_op) = match konst(p, &g.a) {
            Some((data, off)) if pad => {
                let row = steps.next_multiple_of(amx::TILE) * 4;
                let key = (g.a.buf, off, g.a.rs, g.a.cs, m, row, 1f32.to_bits(), false);
                let id = self.pack(module, key, || {
                    x86::pack_a_int8(data, off, g.a.rs, m, k, row)
                })?;
                (row as i64, Operand::Packed(id))
            }
            _ => (g.a.rs, Operand::Direct),
        };
        let mut spec = Spec {
            isa,
            m,
            n,
            k: steps,
            a_tile: isa.mr() as i64 * a_row,
            a_row,
            a_k: 4,
            b_panel,
            b_k,
            b_padded,
            b_group: 1,
            c_rs: g.c.rs * 4,
            init,
            init_is_c: g.init.as_ref() == Some(&g.c),
            add: false,
            act: x86::ActBits::None,
            kc,
            nc,
            int8: Some(int8),
            amx: false,
            a_padded: matches!(&a_op, Operand::Packed(_)),
        };
        spec.amx = self.amx && amx::fits(&spec);
        let Some(func) = self.func(module, &spec)? else {
            return Ok(None);
        };
        let split = self.split(module, &spec, false)?;
        Ok(Some(Plan::Asm {
            func,
            a: a_op,
            b: b_op,
            split,
        }))
    }

    /// The machine-code function of `spec`, generated once per distinct spec.
    fn func(&mut self, module: &mut ObjectModule, spec: &Spec) -> R<Option<FuncId>> {
        if let Some(f) = self.funcs.get(spec) {
            return Ok(Some(*f));
        }
        let code = match x86::generate(spec) {
            Ok(c) => c,
            // Shapes the generator refuses (huge strides) run as loops.
            Err(_) => return Ok(None),
        };
        let mut sig = Signature::new(module.isa().default_call_conv());
        for _ in 0..4 + usize::from(spec.add) {
            sig.params.push(AbiParam::new(types::I64));
        }
        // The shape in the name, for profiles.
        // (AMX functions marked, for profiles and tests.)
        let name = format!(
            "{}__gemm{}_{}x{}x{}{}",
            self.prefix,
            self.funcs.len(),
            spec.m,
            spec.n,
            spec.k,
            if spec.amx { "_amx" } else { "" }
        );
        let id = module
            .declare_function(&name, Linkage::Local, &sig)
            .map_err(|e| format!("declare {name}: {e}"))?;
        module
            .define_function_bytes(id, 64, &code, &[])
            .map_err(|e| format!("define {name}: {e}"))?;
        self.funcs.insert(spec.clone(), id);
        Ok(Some(id))
    }

    /// Cuts a large call into parts for `parallel_for`: by columns in whole B panels when
    /// there are at least as many as rows tiles, or when `b_cols` (B is panels the kernel
    /// packed: split by rows, every thread would read all of them, half from the other
    /// core's cache; ResNet-18 on 2 threads -7%), else by rows in whole register tiles.
    fn split(&mut self, module: &mut ObjectModule, spec: &Spec, b_cols: bool) -> R<Option<Split>> {
        if spec.m * spec.n * spec.k < SPLIT_MIN_MACS || (b_cols && spec.m < SPLIT_MIN_ROWS_PACKED) {
            return Ok(None);
        }
        let isa = spec.isa;
        let gw = spec.b_group * isa.nr();
        let col_units = spec.n.div_ceil(gw);
        // Rows in register tiles, or on the AMX tiles in the kernel's 32-row blocks (in
        // 12-row units a part's 16-row tiles ended in partial ones).
        let row_unit = if spec.amx { amx::BLOCK } else { isa.mr() };
        let row_units = spec.m.div_ceil(row_unit);
        // (Packed panels: when the columns share out evenly among 2 or 4 threads, or
        // there are enough of them not to matter.)
        let even_cols = col_units.is_multiple_of(4) || col_units >= 12;
        let by_cols = col_units >= row_units || (b_cols && even_cols);
        // A few column panels of odd count (MobileNetV2's 7x7 projections: 49 x 160, five
        // panels, three on one thread and two on the other): each panel's rows in two
        // halves, the halves of a panel next to each other (one thread mostly takes
        // both, reading the panel once). Not on panels the kernel packed just before,
        // which each part should read on the core that packed them.
        if by_cols && !b_cols && col_units % 2 == 1 && col_units < 8 && spec.m >= 2 * isa.mr() {
            return self.split_halves(module, spec, col_units);
        }
        let units = if by_cols { col_units } else { row_units };
        if units < 2 {
            return Ok(None);
        }
        // Parts of q or q + 1 units, the larger ones spread evenly (part i ends at unit
        // floor((i + 1) U / T)): the contiguous shares the pool gives 2, 3, 4 or 6
        // threads then hold equal work within a unit, so no thread waits on another's
        // last part (equal parts plus a short last one left a share a whole part
        // heavier: ResNet-18's 196-row layers were cut 5 : 4 between two threads).
        let tasks = units.min(SPLIT_MAX_TASKS);
        let q = units / tasks;
        let (whole, unit) = if by_cols {
            (spec.n, gw)
        } else {
            (spec.m, row_unit)
        };
        let caches = (self.l1_kib, self.l2_kib);
        let part = |size: usize| {
            if by_cols {
                cols_part(spec, size, caches)
            } else {
                Spec {
                    m: size,
                    ..spec.clone()
                }
            }
        };
        // The last part ends at the whole size (its last unit may be partial).
        let last_start = (tasks - 1) * units / tasks;
        let f_small = self.func(module, &part(q * unit))?;
        let f_big = if units.is_multiple_of(tasks) {
            f_small
        } else {
            self.func(module, &part((q + 1) * unit))?
        };
        let f_last = self.func(module, &part(whole - last_start * unit))?;
        let (Some(f_small), Some(f_big), Some(f_last)) = (f_small, f_big, f_last) else {
            return Ok(None);
        };
        let steps = if by_cols {
            steps(spec, gw, 0)
        } else {
            steps(spec, 0, row_unit)
        };
        let name = self.task_name();
        let task = task_function(
            module,
            &name,
            [f_small, f_big, f_last],
            (tasks as u32, units as u32),
            &steps,
        )?;
        Ok(Some(Split {
            tasks: tasks as u32,
            task,
        }))
    }

    /// [`Split`] of `cols` column units, each in two halves of rows (the first a whole
    /// number of register tiles): task `2 u + r` runs half `r` of unit `u`.
    fn split_halves(
        &mut self,
        module: &mut ObjectModule,
        spec: &Spec,
        cols: usize,
    ) -> R<Option<Split>> {
        let isa = spec.isa;
        let gw = spec.b_group * isa.nr();
        let mr = isa.mr();
        let h = (spec.m / 2 / mr).max(1) * mr;
        let caches = (self.l1_kib, self.l2_kib);
        let mut funcs = [[None; 2]; 2];
        for (last, n) in [(0, gw), (1, spec.n - (cols - 1) * gw)] {
            for (half, m) in [(0, h), (1, spec.m - h)] {
                let s = Spec {
                    m,
                    ..cols_part(spec, n, caches)
                };
                funcs[last][half] = self.func(module, &s)?;
            }
        }
        let [[Some(a), Some(b)], [Some(c), Some(d)]] = funcs else {
            return Ok(None);
        };
        let name = self.task_name();
        let task = grid_task_function(
            module,
            &name,
            [[a, b], [c, d]],
            cols as u32,
            (&steps(spec, gw, 0), &steps(spec, 0, h)),
        )?;
        Ok(Some(Split {
            tasks: 2 * cols as u32,
            task,
        }))
    }

    /// A new task function's name.
    fn task_name(&mut self) -> String {
        self.tasks += 1;
        format!("{}__gemm_task{}", self.prefix, self.tasks - 1)
    }

    fn pack(
        &mut self,
        module: &mut ObjectModule,
        key: PackKey,
        f: impl FnOnce() -> Vec<u8>,
    ) -> R<DataId> {
        if let Some(id) = self.packs.get(&key) {
            return Ok(*id);
        }
        let bytes = f();
        let name = format!("{}__gemm_pack{}", self.prefix, self.packs.len());
        let id = module
            .declare_data(&name, Linkage::Local, false, false)
            .map_err(|e| format!("declare {name}: {e}"))?;
        let mut dd = DataDescription::new();
        dd.define(bytes.into_boxed_slice());
        dd.set_align(64);
        module
            .define_data(id, &dd)
            .map_err(|e| format!("define {name}: {e}"))?;
        self.packs.insert(key, id);
        Ok(id)
    }
}

/// A view's constant data and literal offset, when it is of a constant buffer (the
/// operands the microkernels take prepacked).
fn konst<'p>(p: &'p Program, v: &MatView) -> Option<(&'p Vec<u8>, i64)> {
    match (p.buffers.get(v.buf).map(|b| &b.kind), &v.offset) {
        (Some(BufKind::Const { data }), Expr::Int(off)) => Some((data, *off)),
        _ => None,
    }
}

/// The init view's byte strides for the microkernel (`None` inside: no init), or `None`
/// when its columns are neither contiguous nor broadcast.
fn init_strides(g: &GemmCall) -> Option<Option<(i64, i64)>> {
    match &g.init {
        None => Some(None),
        Some(v) if v.cs == 0 || v.cs == 1 => Some(Some((v.rs * 4, v.cs * 4))),
        Some(_) => None,
    }
}

fn le_bytes(x: &[f32]) -> Vec<u8> {
    x.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn floats(data: &[u8]) -> Vec<f32> {
    data.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// `v.offset + r * rs + c * cs`.
fn at(v: &MatView, r: usize, c: usize) -> Expr {
    let term = |x: usize, s: i64| match s {
        0 => None,
        1 => Some(Expr::Var(x)),
        s => Some(Expr::mul(Expr::Var(x), Expr::Int(s))),
    };
    let mut e = v.offset.clone();
    for t in [term(r, v.rs), term(c, v.cs)].into_iter().flatten() {
        e = match e {
            Expr::Int(0) => t,
            e => Expr::add(e, t),
        };
    }
    e
}

/// An 8-bit product's B element `(r, c)` in quads: `v.offset + (r / 4) * rs + c * cs + r % 4`.
fn quad_at(v: &MatView, r: usize, c: usize) -> Expr {
    let (row, four) = (|| Expr::Var(r), || Expr::Int(4));
    let quad = Expr::mul(Expr::bin(BinOp::Div, row(), four()), Expr::Int(v.rs));
    let byte = Expr::bin(BinOp::Rem, row(), four());
    // The row's part in the offset; `at` adds the column's.
    let rows = MatView {
        offset: Expr::add(v.offset.clone(), Expr::add(quad, byte)),
        rs: 0,
        ..v.clone()
    };
    at(&rows, r, c)
}

/// A GEMM whose B is in panels as one GEMM per panel, each with a plain B view.
pub fn unpanel(g: &GemmCall) -> Vec<GemmCall> {
    let shift = |v: &MatView, by: i64| MatView {
        offset: match (by, &v.offset) {
            (0, _) => v.offset.clone(),
            (_, Expr::Int(o)) => Expr::Int(o + by),
            _ => Expr::add(v.offset.clone(), Expr::Int(by)),
        },
        panel: None,
        ..v.clone()
    };
    // A in row panels: one call per panel of rows (each then split by B's panels).
    if let Some((w, ps)) = g.a.panel {
        let w = w.max(1);
        return (0..g.m.div_ceil(w))
            .flat_map(|q| {
                let i0 = (q * w) as i64;
                unpanel(&GemmCall {
                    m: w.min(g.m - q * w),
                    a: shift(&g.a, q as i64 * ps),
                    c: shift(&g.c, i0 * g.c.rs),
                    init: g.init.as_ref().map(|v| shift(v, i0 * v.rs)),
                    add: g.add.as_ref().map(|v| shift(v, i0 * v.rs)),
                    ..g.clone()
                })
            })
            .collect();
    }
    let Some((w, ps)) = g.b.panel else {
        return vec![g.clone()];
    };
    let w = w.max(1);
    (0..g.n.div_ceil(w))
        .map(|q| {
            let j0 = (q * w) as i64;
            GemmCall {
                n: w.min(g.n - q * w),
                b: shift(&g.b, q as i64 * ps),
                c: shift(&g.c, j0 * g.c.cs),
                init: g.init.as_ref().map(|v| shift(v, j0 * v.cs)),
                add: g.add.as_ref().map(|v| shift(v, j0 * v.cs)),
                ..g.clone()
            }
        })
        .collect()
}

/// The GEMM as a scalar loop nest (new variables are added to `vars`).
pub fn expand(g: &GemmCall, vars: &mut Vec<Ty>) -> Vec<Stmt> {
    if g.a.panel.is_some() || g.b.panel.is_some() {
        return unpanel(g)
            .iter()
            .flat_map(|part| expand(part, vars))
            .collect();
    }
    let mut var = |t: Ty| {
        vars.push(t);
        vars.len() - 1
    };
    let (i, j, p) = (var(Ty::I64), var(Ty::I64), var(Ty::I64));
    let acc = var(if g.int8 { Ty::I32 } else { Ty::F32 });
    let f = |x: f32| match g.int8 {
        false => Expr::f(x as f64, Ty::F32),
        true => Expr::cast(Ty::I32, Expr::Int(x as i64)),
    };
    let widen = |e: Expr| if g.int8 { Expr::cast(Ty::I32, e) } else { e };
    let b_at = if g.int8 {
        quad_at(&g.b, p, j)
    } else {
        at(&g.b, p, j)
    };
    let prod = Expr::mul(
        widen(Expr::load(g.a.buf, at(&g.a, i, p))),
        widen(Expr::load(g.b.buf, b_at)),
    );
    let mut val = Expr::Var(acc);
    if g.alpha != 1.0 {
        val = Expr::mul(val, f(g.alpha));
    }
    if let Some(v) = &g.init {
        val = Expr::add(Expr::load(v.buf, at(v, i, j)), val);
    }
    if let Some(v) = &g.add {
        val = Expr::add(val, Expr::load(v.buf, at(v, i, j)));
    }
    val = act_expr(g.act, val);
    let inner = vec![
        Stmt::Set {
            var: acc,
            value: f(0.0),
        },
        Stmt::For {
            var: p,
            extent: g.k,
            body: vec![Stmt::Set {
                var: acc,
                value: Expr::add(Expr::Var(acc), prod),
            }],
        },
        Stmt::Store {
            buf: g.c.buf,
            index: at(&g.c, i, j),
            value: val,
        },
    ];
    vec![Stmt::For {
        var: i,
        extent: g.m,
        body: vec![Stmt::For {
            var: j,
            extent: g.n,
            body: inner,
        }],
    }]
}

/// A GEMM activation as a scalar f32 expression.
pub fn act_expr(a: GemmAct, x: Expr) -> Expr {
    let f = |x: f32| Expr::f(x as f64, Ty::F32);
    match a {
        GemmAct::None => x,
        GemmAct::Relu => Expr::bin(BinOp::Max, x, f(0.0)),
        GemmAct::Clip(lo, hi) => Expr::bin(BinOp::Min, Expr::bin(BinOp::Max, x, f(lo)), f(hi)),
        GemmAct::Leaky(al) => Expr::select(
            Expr::cmp(CmpOp::Lt, x.clone(), f(0.0)),
            Expr::mul(x.clone(), f(al)),
            x,
        ),
        GemmAct::Silu => {
            let e = Expr::Call(
                crate::kir::MathFn::Exp,
                vec![Expr::un(UnOp::Neg, x.clone())],
            );
            let s = Expr::bin(BinOp::Div, f(1.0), Expr::bin(BinOp::Add, f(1.0), e));
            Expr::mul(x, s)
        }
    }
}

/// `spec` on `n` of its columns (whole column units from a unit's start), blocked for
/// that width with the caches `(l1, l2)` (KiB; k blocks as the whole call's: they depend
/// on the rows and depth only).
fn cols_part(spec: &Spec, n: usize, (l1, l2): (u32, u32)) -> Spec {
    let gw = spec.b_group * spec.isa.nr();
    let (kc, nc) = x86::blocking(spec.isa, spec.m, spec.k, n, l1, l2);
    Spec {
        n,
        kc,
        nc: nc.div_ceil(gw) * gw,
        ..spec.clone()
    }
}

/// Byte steps of a split part's operands a, b, c, init (and add's offset from C, when
/// `spec` has one: none) for a part `cols` columns (whole column units) and `rows` rows
/// (whole register tiles of a packed A; any count of A's rows unpacked) on.
fn steps(spec: &Spec, cols: usize, rows: usize) -> Vec<i64> {
    let gw = spec.b_group * spec.isa.nr();
    let (ia, ib) = spec.init.unwrap_or((0, 0));
    let (c, r) = (cols as i64, rows as i64);
    let mr = spec.isa.mr();
    let a = if spec.a_tile == mr as i64 * spec.a_row {
        r * spec.a_row
    } else {
        (rows / mr) as i64 * spec.a_tile
    };
    let mut s = vec![
        a,
        (cols / gw) as i64 * spec.b_panel,
        c * 4 + r * spec.c_rs,
        c * ib + r * ia,
    ];
    if spec.add {
        s.push(0);
    }
    s
}

/// `void name(void *ctx, uint32_t index)`, the `onnxc_task_fn` of a split call: `route`
/// emits, from `ctx` and the index (as i64), the operand pointers the part gets (read
/// from `ctx`, the pointer-sized slots a, b, c, init and, with an add view, its offset)
/// and the blocks that each call one of the call's functions with them.
fn define_task(
    module: &mut ObjectModule,
    name: &str,
    route: impl FnOnce(&mut FunctionBuilder, Type, Value, Value) -> (Vec<Value>, Vec<(Block, FuncId)>),
) -> R<FuncId> {
    let ptr = module.isa().pointer_type();
    let mut sig = Signature::new(module.isa().default_call_conv());
    sig.params.push(AbiParam::new(ptr));
    sig.params.push(AbiParam::new(types::I32));
    let id = module
        .declare_function(name, Linkage::Local, &sig)
        .map_err(|e| format!("declare {name}: {e}"))?;
    let mut ctx = module.make_context();
    ctx.func.signature = sig;
    let mut fbc = FunctionBuilderContext::new();
    {
        let mut b = FunctionBuilder::new(&mut ctx.func, &mut fbc);
        let entry = b.create_block();
        b.append_block_params_for_function_params(entry);
        b.switch_to_block(entry);
        let (cx, idx) = {
            let v = b.block_params(entry);
            (v[0], v[1])
        };
        let i = b.ins().uextend(types::I64, idx);
        let (args, leaves) = route(&mut b, ptr, cx, i);
        let done = b.create_block();
        for (blk, f) in leaves {
            b.switch_to_block(blk);
            let fr = module.declare_func_in_func(f, b.func);
            b.ins().call(fr, &args);
            b.ins().jump(done, &[]);
        }
        b.switch_to_block(done);
        b.ins().return_(&[]);
        b.seal_all_blocks();
        b.finalize(module.isa().frontend_config());
    }
    module
        .define_function(id, &mut ctx)
        .map_err(|e| format!("{name}: {e:?}"))?;
    Ok(id)
}

/// Operand `k` of a task's context advanced by `var * step` for each pair.
fn ctx_operand(
    b: &mut FunctionBuilder,
    ptr: Type,
    cx: Value,
    k: usize,
    by: &[(Value, i64)],
) -> Value {
    let mut p = b
        .ins()
        .load(ptr, MemFlagsData::trusted(), cx, (8 * k) as i32);
    for &(var, step) in by {
        if step != 0 {
            let off = b.ins().imul_imm_s(var, step);
            p = b.ins().iadd(p, off);
        }
    }
    p
}

/// The task function of a 1-D split: part `i` covers units `[i U / T, (i + 1) U / T)`,
/// runs `small` or `big` (parts of `U / T` units or one more), `last` for the final part,
/// on the operands advanced by the part's first unit times `steps`.
fn task_function(
    module: &mut ObjectModule,
    name: &str,
    [small, big, last]: [FuncId; 3],
    (tasks, units): (u32, u32),
    steps: &[i64],
) -> R<FuncId> {
    define_task(module, name, |b, ptr, cx, i| {
        let bound = |b: &mut FunctionBuilder, k: Value| {
            let p = b.ins().imul_imm_s(k, i64::from(units));
            b.ins().udiv_imm_u(p, i64::from(tasks))
        };
        let start = bound(b, i);
        let i1 = b.ins().iadd_imm_s(i, 1);
        let end = bound(b, i1);
        let len = b.ins().isub(end, start);
        let args = (0..steps.len())
            .map(|k| ctx_operand(b, ptr, cx, k, &[(start, steps[k])]))
            .collect();
        let q = i64::from(units / tasks);
        let is_last = b.ins().icmp_imm_s(IntCC::Equal, i, i64::from(tasks) - 1);
        let is_big = b.ins().icmp_imm_s(IntCC::UnsignedGreaterThan, len, q);
        let (lb, nb, bb, sb) = (
            b.create_block(),
            b.create_block(),
            b.create_block(),
            b.create_block(),
        );
        b.ins().brif(is_last, lb, &[], nb, &[]);
        b.switch_to_block(nb);
        b.ins().brif(is_big, bb, &[], sb, &[]);
        (args, vec![(lb, last), (bb, big), (sb, small)])
    })
}

/// The task function of [`GemmCtx::split_halves`]: task `i` runs half `i % 2` of column
/// unit `i / 2`, `funcs[last unit][half]` on the operands advanced by the unit's and the
/// half's steps.
fn grid_task_function(
    module: &mut ObjectModule,
    name: &str,
    funcs: [[FuncId; 2]; 2],
    cols: u32,
    (col_steps, row_steps): (&[i64], &[i64]),
) -> R<FuncId> {
    define_task(module, name, |b, ptr, cx, i| {
        let u = b.ins().ushr_imm_u(i, 1);
        let r = b.ins().band_imm_s(i, 1);
        let args = (0..col_steps.len())
            .map(|k| ctx_operand(b, ptr, cx, k, &[(u, col_steps[k]), (r, row_steps[k])]))
            .collect();
        let is_last = b.ins().icmp_imm_s(IntCC::Equal, u, i64::from(cols) - 1);
        let is_top = b.ins().icmp_imm_s(IntCC::Equal, r, 0);
        let (lb, ob) = (b.create_block(), b.create_block());
        b.ins().brif(is_last, lb, &[], ob, &[]);
        let mut leaves = Vec::new();
        for (blk, [top, bottom]) in [(ob, funcs[0]), (lb, funcs[1])] {
            b.switch_to_block(blk);
            let (t, bo) = (b.create_block(), b.create_block());
            b.ins().brif(is_top, t, &[], bo, &[]);
            leaves.extend([(t, top), (bo, bottom)]);
        }
        (args, leaves)
    })
}
