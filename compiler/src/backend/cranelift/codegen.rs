//! One kernel of kernel IR -> one Cranelift function.

use crate::kir::verify::type_of;
use crate::kir::{BinOp, BufId, BufKind, CmpOp, Expr, Kernel, MathFn, Program, Stmt, Ty, UnOp};
use cranelift_codegen::ir::condcodes::{FloatCC, IntCC};
use cranelift_codegen::ir::{
    types, AbiParam, Function, InstBuilder, MemFlagsData, Signature, Type, Value,
};
use cranelift_frontend::{FunctionBuilder, FunctionBuilderContext, Variable};
use cranelift_module::{DataId, FuncId, Linkage, Module};
use cranelift_object::ObjectModule;
use std::collections::{HashMap, HashSet};

use crate::kir::VarId;

/// A parallel loop is cut into at most this many tasks (runs of whole iterations).
const MAX_LOOP_TASKS: u64 = 16;

#[path = "vectorize.rs"]
mod vectorize;
#[path = "wide.rs"]
mod wide;

pub use wide::WideFuncs;

pub fn clty(t: Ty) -> Type {
    match t {
        Ty::F32 => types::F32,
        Ty::F64 => types::F64,
        Ty::I8 | Ty::U8 => types::I8,
        // Minifloats and packed types are loaded and stored as bytes.
        Ty::F8E4M3FN
        | Ty::F8E4M3FNUZ
        | Ty::F8E5M2
        | Ty::F8E5M2FNUZ
        | Ty::F8E8M0
        | Ty::F4E2M1
        | Ty::I4
        | Ty::U4
        | Ty::I2
        | Ty::U2 => types::I8,
        Ty::I16 | Ty::U16 | Ty::F16 | Ty::BF16 => types::I16,
        Ty::I32 | Ty::U32 => types::I32,
        // String pointers: the back ends target 64-bit ISAs.
        Ty::I64 | Ty::U64 | Ty::Str => types::I64,
    }
}

/// The layout of a minifloat storage type.
#[derive(Clone, Copy)]
struct Mini {
    exp: u32,
    man: u32,
    bias: i64,
    /// E5M2: all-ones exponent is Inf (mantissa 0) or NaN.
    ieee: bool,
    /// E4M3FN: all-ones exponent and mantissa is NaN.
    fn_nan: bool,
    /// FNUZ: the negative-zero code is NaN.
    uz: bool,
    /// Largest finite positive code.
    max_code: u32,
    /// Code of a positive overflow (non-saturating conversion).
    overflow_code: u32,
    /// Code of NaN; -1: F4E2M1 (no NaN).
    nan_code: i32,
}

fn minifloat(t: Ty) -> Option<Mini> {
    let m = |exp, man, bias, ieee, fn_nan, uz, max_code, overflow_code, nan_code| Mini {
        exp,
        man,
        bias,
        ieee,
        fn_nan,
        uz,
        max_code,
        overflow_code,
        nan_code,
    };
    Some(match t {
        Ty::F8E4M3FN => m(4, 3, 7, false, true, false, 0x7e, 0x7f, 0x7f),
        Ty::F8E4M3FNUZ => m(4, 3, 8, false, false, true, 0x7f, 0x80, 0x80),
        Ty::F8E5M2 => m(5, 2, 15, true, false, false, 0x7b, 0x7c, 0x7f),
        Ty::F8E5M2FNUZ => m(5, 2, 16, false, false, true, 0x7f, 0x80, 0x80),
        Ty::F4E2M1 => m(2, 1, 1, false, false, false, 0x7, 0x7, -1),
        _ => return None,
    })
}

struct Gen<'a, 'b> {
    b: FunctionBuilder<'b>,
    module: &'a mut ObjectModule,
    k: &'a Kernel,
    p: &'a Program,
    vars: Vec<Variable>,
    bases: HashMap<BufId, Value>,
    libm: &'a mut HashMap<&'static str, FuncId>,
    /// Machine-code calls for the kernel's `Stmt::Gemm`s, in statement order.
    gemms: std::vec::IntoIter<super::gemm::Plan>,
    /// The kernel's `const onnxc_threads_t *` (null: run on the caller's thread).
    threads: Value,
    /// Loops whose iterations may go to the `parallel_for` hook (kir::parallel).
    par: HashSet<VarId>,
    /// This function's symbol name, the stem of its task functions' names.
    fname: String,
    /// Task functions made so far.
    ntasks: u32,
    /// The object's AVX-512 loop functions (see wide.rs).
    wide: &'a mut WideFuncs,
}

/// Emits kernel `k` into `func` (whose signature is `(inputs, outputs, arena, threads)`);
/// `bufs` are [`kernel_bufs`] of `k` and `gemms`, every constant among them in `consts`;
/// loops doing fewer than `min_work` element operations stay on the calling thread.
#[allow(clippy::too_many_arguments)]
pub fn kernel(
    module: &mut ObjectModule,
    func: &mut Function,
    fbc: &mut FunctionBuilderContext,
    k: &Kernel,
    bufs: &[BufId],
    p: &Program,
    consts: &HashMap<usize, DataId>,
    libm: &mut HashMap<&'static str, FuncId>,
    gemms: Vec<super::gemm::Plan>,
    fname: &str,
    wide: &mut WideFuncs,
    min_work: u64,
) -> Result<(), String> {
    if let Err(e) = crate::kir::verify::verify_program(&Program {
        buffers: p.buffers.clone(),
        kernels: vec![k.clone()],
        arena_bytes: p.arena_bytes,
        inputs: vec![],
        outputs: vec![],
    }) {
        return Err(e.join("\n"));
    }
    let ptr = module.isa().pointer_type();
    let cfg = module.isa().frontend_config();
    let mut b = FunctionBuilder::new(func, fbc);
    let entry = b.create_block();
    b.append_block_params_for_function_params(entry);
    b.switch_to_block(entry);
    b.seal_block(entry);
    let (ins, outs, arena, threads) = {
        let v = b.block_params(entry);
        (v[0], v[1], v[2], v[3])
    };
    // Base address of every buffer the kernel touches, computed once in the entry block.
    let mut bases = HashMap::new();
    for &id in bufs {
        let buf = &p.buffers[id];
        let v = match &buf.kind {
            BufKind::Input(i) => b
                .ins()
                .load(ptr, MemFlagsData::trusted(), ins, (8 * i) as i32),
            BufKind::Output(i) => b
                .ins()
                .load(ptr, MemFlagsData::trusted(), outs, (8 * i) as i32),
            BufKind::Arena { offset } => b.ins().iadd_imm_s(arena, *offset as i64),
            BufKind::Const { .. } => {
                let gv = module.declare_data_in_func(consts[&id], b.func);
                b.ins().symbol_value(ptr, gv)
            }
        };
        bases.insert(id, v);
    }
    let vars: Vec<Variable> = k.vars.iter().map(|t| b.declare_var(clty(*t))).collect();
    for (i, t) in k.vars.iter().enumerate() {
        let z = zero(&mut b, *t);
        b.def_var(vars[i], z);
    }
    if let Some(v) = k.threaded {
        // threads != NULL && threads->parallel_for != NULL (as `with_hook` tests).
        let (check, join) = (b.create_block(), b.create_block());
        b.append_block_param(join, types::I8);
        let no = b.ins().iconst(types::I8, 0);
        b.ins().brif(threads, check, &[], join, &[no.into()]);
        b.switch_to_block(check);
        let pf = b.ins().load(ptr, MemFlagsData::trusted(), threads, 0);
        let has = b.ins().icmp_imm_u(IntCC::NotEqual, pf, 0);
        b.ins().jump(join, &[has.into()]);
        b.switch_to_block(join);
        let flag = b.block_params(join)[0];
        b.def_var(vars[v], flag);
    }
    let mut g = Gen {
        b,
        module,
        k,
        p,
        vars,
        bases,
        libm,
        gemms: gemms.into_iter(),
        threads,
        par: crate::kir::parallel::parallel_loops(k, p, min_work),
        fname: fname.to_string(),
        ntasks: 0,
        wide,
    };
    g.stmts(&k.body)?;
    g.b.ins().return_(&[]);
    g.b.seal_all_blocks();
    g.b.finalize(cfg);
    Ok(())
}

/// The GEMM calls in `body`, nested ones included.
fn count_gemms(body: &[Stmt]) -> usize {
    body.iter()
        .map(|s| match s {
            Stmt::Gemm(_) => 1,
            Stmt::For { body, .. } | Stmt::While { body, .. } => count_gemms(body),
            Stmt::If { then, els, .. } => count_gemms(then) + count_gemms(els),
            _ => 0,
        })
        .sum()
}

fn zero(b: &mut FunctionBuilder, t: Ty) -> Value {
    match t {
        Ty::F32 => b.ins().f32const(0.0),
        Ty::F64 => b.ins().f64const(0.0),
        t => b.ins().iconst(clty(t), 0),
    }
}

/// The buffers kernel `k` reads or writes, in order of first use, with the GEMM calls
/// planned as `plans`: an operand that a call reads prepacked is not one of them.
pub fn kernel_bufs(k: &Kernel, plans: &[super::gemm::Plan]) -> Vec<BufId> {
    let mut used = Vec::new();
    collect_bufs(&k.body, &mut plans.iter(), &mut used);
    used
}

/// [`kernel_bufs`] of `body`, whose GEMM calls take their plans from `plans` in order.
fn collect_bufs(
    body: &[Stmt],
    plans: &mut std::slice::Iter<super::gemm::Plan>,
    out: &mut Vec<BufId>,
) {
    fn e(x: &Expr, out: &mut Vec<BufId>) {
        match x {
            Expr::Load(b, i) => {
                if !out.contains(b) {
                    out.push(*b);
                }
                e(i, out);
            }
            Expr::Un(_, a) | Expr::Cast(_, a) => e(a, out),
            Expr::Bin(_, a, b) | Expr::Cmp(_, a, b) => {
                e(a, out);
                e(b, out);
            }
            Expr::Select(c, a, b) => {
                e(c, out);
                e(a, out);
                e(b, out);
            }
            Expr::Call(_, args) => args.iter().for_each(|a| e(a, out)),
            Expr::StrByte(b, i, j) => {
                if !out.contains(b) {
                    out.push(*b);
                }
                e(i, out);
                e(j, out);
            }
            Expr::Var(_) | Expr::Int(_) | Expr::Float(..) => {}
        }
    }
    for s in body {
        match s {
            Stmt::For { body, .. } => collect_bufs(body, plans, out),
            Stmt::Store { buf, index, value } => {
                if !out.contains(buf) {
                    out.push(*buf);
                }
                e(index, out);
                e(value, out);
            }
            Stmt::Set { value, .. } => e(value, out),
            Stmt::If { cond, then, els } => {
                e(cond, out);
                collect_bufs(then, plans, out);
                collect_bufs(els, plans, out);
            }
            Stmt::While { cond, body } => {
                e(cond, out);
                collect_bufs(body, plans, out);
            }
            Stmt::Gemm(g) => {
                let packed =
                    |o: &super::gemm::Operand| matches!(o, super::gemm::Operand::Packed(_));
                let (pa, pb) = match plans.next() {
                    Some(super::gemm::Plan::Asm { a, b, .. }) => (packed(a), packed(b)),
                    _ => (false, false),
                };
                let direct = [(&g.a, !pa), (&g.b, !pb), (&g.c, true)]
                    .into_iter()
                    .chain(g.init.as_ref().map(|v| (v, true)))
                    .chain(g.add.as_ref().map(|v| (v, true)))
                    .filter_map(|(v, direct)| direct.then_some(v));
                for v in direct {
                    if !out.contains(&v.buf) {
                        out.push(v.buf);
                    }
                    e(&v.offset, out);
                }
            }
        }
    }
}

impl Gen<'_, '_> {
    fn ty(&self, e: &Expr) -> Result<Ty, String> {
        type_of(e, self.k, self.p).map_err(|m| format!("kernel `{}`: {m}", self.k.name))
    }

    fn stmts(&mut self, body: &[Stmt]) -> Result<(), String> {
        for s in body {
            self.stmt(s)?;
        }
        Ok(())
    }

    fn stmt(&mut self, s: &Stmt) -> Result<(), String> {
        match s {
            Stmt::For { var, extent, body } if self.par.contains(var) => {
                // The body's GEMM calls (kir::parallel lets in those that read a block
                // the body packs) run whole inside the tasks; the serial path, for a
                // null hook, takes their plans again.
                let plans: Vec<_> = self.gemms.by_ref().take(count_gemms(body)).collect();
                let (task, n, args) = self.par_task(*var, *extent, body, &plans)?;
                let rest: Vec<_> = plans.into_iter().chain(self.gemms.by_ref()).collect();
                self.gemms = rest.into_iter();
                self.with_hook(task, n, &args, &mut |g| g.serial_for(*var, *extent, body))?;
            }
            Stmt::For { var, extent, body } => self.serial_for(*var, *extent, body)?,
            Stmt::Store { buf, index, value } if self.p.buffers[*buf].elem.bits() < 8 => {
                let elem = self.p.buffers[*buf].elem;
                let v = self.expr(value)?;
                let v = self.narrow_for_store(v, elem);
                self.store_packed(*buf, index, v, elem.bits())?;
            }
            Stmt::Store { buf, index, value } => {
                let elem = self.p.buffers[*buf].elem;
                let addr = self.addr(*buf, index)?;
                let v = self.expr(value)?;
                let v = self.narrow_for_store(v, elem);
                self.b.ins().store(MemFlagsData::trusted(), v, addr, 0);
            }
            Stmt::Set { var, value } => {
                let v = self.expr(value)?;
                self.b.def_var(self.vars[*var], v);
            }
            Stmt::If { cond, then, els } => {
                let c = self.expr(cond)?;
                let t = self.b.create_block();
                let e = self.b.create_block();
                let m = self.b.create_block();
                self.b.ins().brif(c, t, &[], e, &[]);
                self.b.switch_to_block(t);
                self.stmts(then)?;
                self.b.ins().jump(m, &[]);
                self.b.switch_to_block(e);
                self.stmts(els)?;
                self.b.ins().jump(m, &[]);
                self.b.switch_to_block(m);
            }
            Stmt::While { cond, body } => {
                let header = self.b.create_block();
                let body_blk = self.b.create_block();
                let exit = self.b.create_block();
                self.b.ins().jump(header, &[]);
                self.b.switch_to_block(header);
                let c = self.expr(cond)?;
                self.b.ins().brif(c, body_blk, &[], exit, &[]);
                self.b.switch_to_block(body_blk);
                self.stmts(body)?;
                self.b.ins().jump(header, &[]);
                self.b.switch_to_block(exit);
            }
            Stmt::Gemm(g) => {
                let plan = self
                    .gemms
                    .next()
                    .ok_or_else(|| format!("kernel `{}`: gemm without a plan", self.k.name))?;
                let (func, pa, pb, split) = match plan {
                    super::gemm::Plan::Vec4 => return self.gemm_vec4(g),
                    super::gemm::Plan::Asm { func, a, b, split } => (func, a, b, split),
                };
                let ptr = self.module.isa().pointer_type();
                let mut args = Vec::new();
                for (v, op) in [(&g.a, Some(pa)), (&g.b, Some(pb)), (&g.c, None)] {
                    args.push(match op {
                        Some(super::gemm::Operand::Packed(id)) => {
                            let gv = self.module.declare_data_in_func(id, self.b.func);
                            self.b.ins().symbol_value(ptr, gv)
                        }
                        _ => self.addr(v.buf, &v.offset)?,
                    });
                }
                args.push(match &g.init {
                    Some(v) => self.addr(v.buf, &v.offset)?,
                    None => self.b.ins().iconst(ptr, 0),
                });
                // The add view by its byte offset from C (the plan took it only at C's
                // strides).
                if let Some(v) = &g.add {
                    let r = self.addr(v.buf, &v.offset)?;
                    let d = self.b.ins().isub(r, args[2]);
                    args.push(d);
                }
                match split {
                    Some(sp) => self.gemm_split(func, sp, &args),
                    None => {
                        let fr = self.module.declare_func_in_func(func, self.b.func);
                        self.b.ins().call(fr, &args);
                    }
                }
            }
        }
        Ok(())
    }

    /// `for var in 0..extent { body }` on this thread.
    fn serial_for(&mut self, var: VarId, extent: u64, body: &[Stmt]) -> Result<(), String> {
        // Rows of a loop nest as one AVX-512 call.
        if self.wide_rows(var, extent, body)? {
            return Ok(());
        }
        self.serial_loop(var, extent, body)
    }

    /// [`Gen::serial_for`] without the rows of a nest as one AVX-512 call.
    pub(super) fn serial_loop(
        &mut self,
        var: VarId,
        extent: u64,
        body: &[Stmt],
    ) -> Result<(), String> {
        // Innermost loops that qualify run four lanes at a time; the scalar loop below
        // finishes the remainder.
        let start = self.vectorize_for(var, extent, body)?;
        if start == extent {
            return Ok(());
        }
        let v = self.vars[var];
        // One iteration, or a few of a body without loops (the remainder of a vector
        // loop, say): straight code.
        let flat = body
            .iter()
            .all(|s| matches!(s, Stmt::Store { .. } | Stmt::Set { .. }));
        if extent - start == 1 || (flat && extent - start <= 3) {
            for i in start..extent {
                let i = self.b.ins().iconst(types::I64, i as i64);
                self.b.def_var(v, i);
                self.stmts(body)?;
            }
            return Ok(());
        }
        let zero = self.b.ins().iconst(types::I64, start as i64);
        self.b.def_var(v, zero);
        let header = self.b.create_block();
        let body_blk = self.b.create_block();
        let exit = self.b.create_block();
        self.b.ins().jump(header, &[]);
        self.b.switch_to_block(header);
        let i = self.b.use_var(v);
        let c = self
            .b
            .ins()
            .icmp_imm_s(IntCC::UnsignedLessThan, i, extent as i64);
        self.b.ins().brif(c, body_blk, &[], exit, &[]);
        self.b.switch_to_block(body_blk);
        self.stmts(body)?;
        let i = self.b.use_var(v);
        let n = self.b.ins().iadd_imm_s(i, 1);
        self.b.def_var(v, n);
        self.b.ins().jump(header, &[]);
        self.b.switch_to_block(exit);
        Ok(())
    }

    /// A task function `void task(void *ctx, uint32_t i)` that runs part `i` of the
    /// parallel loop `for var in 0..extent { body }`, cut into at most [`MAX_LOOP_TASKS`]
    /// runs of whole iterations. `ctx` holds the base address of every buffer the body
    /// uses and then the value of every variable it only reads, 8 bytes each, in the
    /// order of the returned arguments (values in this function).
    fn par_task(
        &mut self,
        var: VarId,
        extent: u64,
        body: &[Stmt],
        plans: &[super::gemm::Plan],
    ) -> Result<(FuncId, u32, Vec<Value>), String> {
        use crate::kir::parallel::{assigned, captured, rename, subst};
        let ptr = self.module.isa().pointer_type();
        let mut bufs = Vec::new();
        collect_bufs(body, &mut plans.iter(), &mut bufs);
        let caps = captured(var, body);
        let mut args: Vec<Value> = bufs.iter().map(|b| self.bases[b]).collect();
        for v in &caps {
            args.push(self.b.use_var(self.vars[*v]));
        }
        let chunk = extent.div_ceil(MAX_LOOP_TASKS.min(extent));
        let n = extent.div_ceil(chunk);
        let last = extent - (n - 1) * chunk;
        // The task's kernel: three more variables (the task index, its first iteration,
        // the counter) and the body with `var` = first + counter.
        // A task that reads the threaded flag gets the caller's value (captured).
        let mut tk = Kernel {
            name: format!("{} (task)", self.k.name),
            vars: self.k.vars.clone(),
            body: vec![],
            threaded: None,
            bands: None,
        };
        let nv = tk.vars.len();
        let (idx, first, q) = (nv, nv + 1, nv + 2);
        tk.vars.extend([Ty::I64; 3]);
        let inner = subst(
            body,
            var,
            &Expr::bin(BinOp::Add, Expr::Var(first), Expr::Var(q)),
        );
        let run = |len: u64, body: Vec<Stmt>| Stmt::For {
            var: q,
            extent: len,
            body,
        };
        tk.body.push(Stmt::Set {
            var: first,
            value: Expr::bin(BinOp::Mul, Expr::Var(idx), Expr::Int(chunk as i64)),
        });
        tk.body.push(if last == chunk {
            run(chunk, inner)
        } else {
            // The last task's copy gets its own locals: a local read in both copies would
            // look read outside its loop, and the vectorisers would leave it scalar.
            let mut copy = inner.clone();
            for v in assigned(&inner) {
                let fresh = tk.vars.len();
                tk.vars.push(tk.vars[v]);
                copy = rename(&copy, v, fresh);
            }
            Stmt::If {
                cond: Expr::cmp(CmpOp::Eq, Expr::Var(idx), Expr::Int(n as i64 - 1)),
                then: vec![run(last, copy)],
                els: vec![run(chunk, inner)],
            }
        });
        crate::kir::verify::verify_program(&Program {
            buffers: self.p.buffers.clone(),
            kernels: vec![tk.clone()],
            arena_bytes: self.p.arena_bytes,
            inputs: vec![],
            outputs: vec![],
        })
        .map_err(|e| format!("parallel task of `{}`: {}", self.k.name, e.join("\n")))?;

        let name = format!("{}_task{}", self.fname, self.ntasks);
        self.ntasks += 1;
        let mut sig = Signature::new(self.module.isa().default_call_conv());
        sig.params.push(AbiParam::new(ptr));
        sig.params.push(AbiParam::new(types::I32));
        let id = self
            .module
            .declare_function(&name, Linkage::Local, &sig)
            .map_err(|e| format!("declare {name}: {e}"))?;
        let mut ctx = self.module.make_context();
        ctx.func.signature = sig;
        let mut fbc = FunctionBuilderContext::new();
        {
            let mut b = FunctionBuilder::new(&mut ctx.func, &mut fbc);
            let entry = b.create_block();
            b.append_block_params_for_function_params(entry);
            b.switch_to_block(entry);
            b.seal_block(entry);
            let (cx, ix) = {
                let v = b.block_params(entry);
                (v[0], v[1])
            };
            let mut bases = HashMap::new();
            for (j, id) in bufs.iter().enumerate() {
                let v = b
                    .ins()
                    .load(ptr, MemFlagsData::trusted(), cx, (8 * j) as i32);
                bases.insert(*id, v);
            }
            let vars: Vec<Variable> = tk.vars.iter().map(|t| b.declare_var(clty(*t))).collect();
            for (i, t) in tk.vars.iter().enumerate() {
                let z = zero(&mut b, *t);
                b.def_var(vars[i], z);
            }
            for (j, v) in caps.iter().enumerate() {
                let x = b.ins().load(
                    clty(tk.vars[*v]),
                    MemFlagsData::trusted(),
                    cx,
                    (8 * (bufs.len() + j)) as i32,
                );
                b.def_var(vars[*v], x);
            }
            let i = b.ins().uextend(types::I64, ix);
            b.def_var(vars[idx], i);
            let null = b.ins().iconst(ptr, 0);
            let mut g = Gen {
                b,
                module: &mut *self.module,
                k: &tk,
                p: self.p,
                vars,
                bases,
                libm: &mut *self.libm,
                // A task's GEMMs run on its thread: no split (parallel_for is not
                // reentrant).
                gemms: plans
                    .iter()
                    .map(super::gemm::Plan::whole)
                    .collect::<Vec<_>>()
                    .into_iter(),
                threads: null,
                par: HashSet::new(),
                fname: name.clone(),
                ntasks: 0,
                wide: &mut *self.wide,
            };
            g.stmts(&tk.body)?;
            g.b.ins().return_(&[]);
            g.b.seal_all_blocks();
            g.b.finalize(self.module.isa().frontend_config());
        }
        self.module
            .define_function(id, &mut ctx)
            .map_err(|e| format!("{name}: {e:?}"))?;
        Ok((id, n as u32, args))
    }

    /// Runs `n` tasks of `task` through the kernel's `parallel_for` hook, the `args`
    /// stored in a stack slot as the tasks' context; without a hook, `serial` instead.
    fn with_hook(
        &mut self,
        task: FuncId,
        n: u32,
        args: &[Value],
        serial: &mut dyn FnMut(&mut Self) -> Result<(), String>,
    ) -> Result<(), String> {
        let ptr = self.module.isa().pointer_type();
        let (ser, check, par, done) = (
            self.b.create_block(),
            self.b.create_block(),
            self.b.create_block(),
            self.b.create_block(),
        );
        self.b.ins().brif(self.threads, check, &[], ser, &[]);
        self.b.switch_to_block(check);
        let pf = self
            .b
            .ins()
            .load(ptr, MemFlagsData::trusted(), self.threads, 0);
        self.b.ins().brif(pf, par, &[], ser, &[]);
        self.b.switch_to_block(par);
        let ss = self
            .b
            .create_sized_stack_slot(cranelift_codegen::ir::StackSlotData::new(
                cranelift_codegen::ir::StackSlotKind::ExplicitSlot,
                (8 * args.len().max(1)) as u32,
                3,
            ));
        for (k, v) in args.iter().enumerate() {
            self.b.ins().stack_store(ptr, *v, ss, (8 * k) as i32);
        }
        let cx = self.b.ins().stack_addr(ptr, ss, 0);
        let pool = self
            .b
            .ins()
            .load(ptr, MemFlagsData::trusted(), self.threads, 8);
        let tf = self.module.declare_func_in_func(task, self.b.func);
        let taddr = self.b.ins().func_addr(ptr, tf);
        let nv = self.b.ins().iconst(types::I32, i64::from(n));
        let mut sig = Signature::new(self.module.isa().default_call_conv());
        for t in [ptr, ptr, ptr, types::I32] {
            sig.params.push(AbiParam::new(t));
        }
        let sref = self.b.import_signature(sig);
        self.b.ins().call_indirect(sref, pf, &[pool, taddr, cx, nv]);
        self.b.ins().jump(done, &[]);
        self.b.switch_to_block(ser);
        serial(self)?;
        self.b.ins().jump(done, &[]);
        self.b.switch_to_block(done);
        Ok(())
    }

    /// A split microkernel call: with a `parallel_for` hook, the operand pointers go to a
    /// stack slot and the hook runs the parts; without one, the whole call runs here.
    fn gemm_split(&mut self, func: FuncId, sp: super::gemm::Split, args: &[Value]) {
        let _ = self.with_hook(sp.task, sp.tasks, args, &mut |g| {
            let fr = g.module.declare_func_in_func(func, g.b.func);
            g.b.ins().call(fr, args);
            Ok(())
        });
    }

    /// `for i in 0..n { body(i) }` with an i64 counter.
    fn counted(
        &mut self,
        n: i64,
        body: &mut dyn FnMut(&mut Self, Value) -> Result<(), String>,
    ) -> Result<(), String> {
        let v = self.b.declare_var(types::I64);
        let zero = self.b.ins().iconst(types::I64, 0);
        self.b.def_var(v, zero);
        let header = self.b.create_block();
        let body_blk = self.b.create_block();
        let exit = self.b.create_block();
        self.b.ins().jump(header, &[]);
        self.b.switch_to_block(header);
        let i = self.b.use_var(v);
        let c = self.b.ins().icmp_imm_s(IntCC::SignedLessThan, i, n);
        self.b.ins().brif(c, body_blk, &[], exit, &[]);
        self.b.switch_to_block(body_blk);
        let i = self.b.use_var(v);
        body(self, i)?;
        let i = self.b.use_var(v);
        let n1 = self.b.ins().iadd_imm_s(i, 1);
        self.b.def_var(v, n1);
        self.b.ins().jump(header, &[]);
        self.b.switch_to_block(exit);
        Ok(())
    }

    /// A GEMM as f32x4 register tiles (`VEC_MR x VEC_NR`, fewer rows at the edge); n is a
    /// multiple of `VEC_NR`, B's and C's columns are contiguous.
    fn gemm_vec4(&mut self, g: &crate::kir::GemmCall) -> Result<(), String> {
        use super::gemm::{VEC_MR, VEC_NR};
        let pa = self.addr(g.a.buf, &g.a.offset)?;
        let pb = self.addr(g.b.buf, &g.b.offset)?;
        let pc = self.addr(g.c.buf, &g.c.offset)?;
        let pi = match &g.init {
            Some(v) => Some(self.addr(v.buf, &v.offset)?),
            None => None,
        };
        let pr = match &g.add {
            Some(v) => Some(self.addr(v.buf, &v.offset)?),
            None => None,
        };
        let full = (g.m / VEC_MR) as i64;
        let rem = (g.m % VEC_MR) as usize;
        let ntiles = (g.n / VEC_NR) as i64;
        let tiles = |me: &mut Self, rows: usize, i0: Value| {
            me.counted(ntiles, &mut |me, jt| {
                let j0 = me.b.ins().imul_imm_s(jt, VEC_NR as i64);
                me.vec4_tile(g, rows, i0, j0, [pa, pb, pc], [pi, pr])
            })
        };
        if full > 0 {
            self.counted(full, &mut |me, it| {
                let i0 = me.b.ins().imul_imm_s(it, VEC_MR as i64);
                tiles(me, VEC_MR as usize, i0)
            })?;
        }
        if rem > 0 {
            let i0 = self.b.ins().iconst(types::I64, full * VEC_MR as i64);
            tiles(self, rem, i0)?;
        }
        Ok(())
    }

    fn vec4_tile(
        &mut self,
        g: &crate::kir::GemmCall,
        rows: usize,
        i0: Value,
        j0: Value,
        [pa, pb, pc]: [Value; 3],
        [pi, pr]: [Option<Value>; 2],
    ) -> Result<(), String> {
        use crate::kir::GemmAct;
        let v4 = types::F32X4;
        let fl = MemFlagsData::trusted();
        // Byte address `base + (i0 + r) * rs * 4 + (j0 * cs + c) * 4`.
        let at = |me: &mut Self, base: Value, i: Value, rs: i64, j: Value, cs: i64| {
            let a = me.b.ins().imul_imm_s(i, rs * 4);
            let bj = me.b.ins().imul_imm_s(j, cs * 4);
            let s = me.b.ins().iadd(a, bj);
            me.b.ins().iadd(base, s)
        };
        let nv = 2usize;
        let zero_s = self.b.ins().f32const(0.0);
        let zero = self.b.ins().splat(v4, zero_s);
        let accs: Vec<Variable> = (0..rows * nv).map(|_| self.b.declare_var(v4)).collect();
        for &a in &accs {
            self.b.def_var(a, zero);
        }
        let zi = self.b.ins().iconst(types::I64, 0);
        let arow = at(self, pa, i0, g.a.rs, zi, 0);
        let bcol = at(self, pb, zi, 0, j0, 1);
        let (pav, pbv) = (
            self.b.declare_var(types::I64),
            self.b.declare_var(types::I64),
        );
        self.b.def_var(pav, arow);
        self.b.def_var(pbv, bcol);
        let (ars, acs, brs) = (g.a.rs * 4, g.a.cs * 4, g.b.rs * 4);
        self.counted(g.k as i64, &mut |me, _| {
            let a = me.b.use_var(pav);
            let b = me.b.use_var(pbv);
            let bv: Vec<Value> = (0..nv)
                .map(|v| me.b.ins().load(v4, fl, b, (16 * v) as i32))
                .collect();
            for r in 0..rows {
                let ar = me.b.ins().iadd_imm_s(a, r as i64 * ars);
                let x = me.b.ins().load(types::F32, fl, ar, 0);
                let xs = me.b.ins().splat(v4, x);
                for (v, bvv) in bv.iter().enumerate() {
                    let acc = me.b.use_var(accs[r * nv + v]);
                    let n = me.b.ins().fma(xs, *bvv, acc);
                    me.b.def_var(accs[r * nv + v], n);
                }
            }
            let a2 = me.b.ins().iadd_imm_s(a, acs);
            let b2 = me.b.ins().iadd_imm_s(b, brs);
            me.b.def_var(pav, a2);
            me.b.def_var(pbv, b2);
            Ok(())
        })?;
        let crow = at(self, pc, i0, g.c.rs, j0, 1);
        let irow = match (&g.init, pi) {
            (Some(v), Some(p)) => Some((at(self, p, i0, v.rs, j0, v.cs), v.rs * 4, v.cs)),
            _ => None,
        };
        let rrow = match (&g.add, pr) {
            (Some(v), Some(p)) => Some((at(self, p, i0, v.rs, j0, 1), v.rs * 4)),
            _ => None,
        };
        let alpha = if g.alpha != 1.0 {
            let a = self.b.ins().f32const(g.alpha);
            Some(self.b.ins().splat(v4, a))
        } else {
            None
        };
        let splat_c = |me: &mut Self, x: f32| {
            let s = me.b.ins().f32const(x);
            me.b.ins().splat(v4, s)
        };
        for r in 0..rows {
            for v in 0..nv {
                let mut x = self.b.use_var(accs[r * nv + v]);
                if let Some(al) = alpha {
                    x = self.b.ins().fmul(x, al);
                }
                if let Some((ib, irs, ics)) = irow {
                    let off = r as i64 * irs + (16 * v) as i64 * ics;
                    let addr = self.b.ins().iadd_imm_s(ib, off);
                    let y = if ics == 0 {
                        let s = self.b.ins().load(types::F32, fl, addr, 0);
                        self.b.ins().splat(v4, s)
                    } else {
                        self.b.ins().load(v4, fl, addr, 0)
                    };
                    x = self.b.ins().fadd(y, x);
                }
                if let Some((rb, rrs)) = rrow {
                    let addr = self
                        .b
                        .ins()
                        .iadd_imm_s(rb, r as i64 * rrs + (16 * v) as i64);
                    let y = self.b.ins().load(v4, fl, addr, 0);
                    x = self.b.ins().fadd(x, y);
                }
                x = match g.act {
                    GemmAct::None => x,
                    GemmAct::Relu => self.b.ins().fmax(x, zero),
                    GemmAct::Clip(lo, hi) => {
                        let (l, h) = (splat_c(self, lo), splat_c(self, hi));
                        let y = self.b.ins().fmax(x, l);
                        self.b.ins().fmin(y, h)
                    }
                    GemmAct::Leaky(al) => {
                        let a = splat_c(self, al);
                        let neg = self.b.ins().fcmp(FloatCC::LessThan, x, zero);
                        let neg = self.b.ins().bitcast(v4, MemFlagsData::new(), neg);
                        let y = self.b.ins().fmul(x, a);
                        self.b.ins().bitselect(neg, y, x)
                    }
                    GemmAct::Silu => {
                        // The scalar act_expr's arithmetic, four lanes at a time.
                        let n = self.b.ins().fneg(x);
                        let e = crate::backend::cranelift::vmath::emit(&mut self.b, MathFn::Exp, n)
                            .ok_or("vmath: no inline exp")?;
                        let one = splat_c(self, 1.0);
                        let d = self.b.ins().fadd(one, e);
                        let s = self.b.ins().fdiv(one, d);
                        self.b.ins().fmul(x, s)
                    }
                };
                let addr = self
                    .b
                    .ins()
                    .iadd_imm_s(crow, r as i64 * g.c.rs * 4 + (16 * v) as i64);
                self.b.ins().store(fl, x, addr, 0);
            }
        }
        Ok(())
    }

    /// Byte address and bit shift (i32) of element `index` of a packed buffer.
    fn packed_addr(
        &mut self,
        buf: BufId,
        index: &Expr,
        bits: u64,
    ) -> Result<(Value, Value), String> {
        let per = (8 / bits) as i64;
        let i = self.expr(index)?;
        let b = &mut self.b;
        // Indices are never negative: a shift divides.
        let byte = b.ins().ushr_imm_u(i, per.trailing_zeros() as i64);
        let lane = b.ins().band_imm_s(i, per - 1);
        let shift = b.ins().imul_imm_s(lane, bits as i64);
        let shift = b.ins().ireduce(types::I32, shift);
        let addr = b.ins().iadd(self.bases[&buf], byte);
        Ok((addr, shift))
    }

    /// The element's bits, in the low bits of an i8 (upper bits zero).
    fn load_packed(&mut self, buf: BufId, index: &Expr, bits: u64) -> Result<Value, String> {
        let (addr, shift) = self.packed_addr(buf, index, bits)?;
        let b = &mut self.b;
        let byte = b.ins().load(types::I8, MemFlagsData::trusted(), addr, 0);
        let w = b.ins().uextend(types::I32, byte);
        let w = b.ins().ushr(w, shift);
        let w = b.ins().band_imm_s(w, (1 << bits) - 1);
        Ok(b.ins().ireduce(types::I8, w))
    }

    /// Replaces the element's bits with the low bits of `v` (an i8), keeping its neighbours.
    fn store_packed(
        &mut self,
        buf: BufId,
        index: &Expr,
        v: Value,
        bits: u64,
    ) -> Result<(), String> {
        let (addr, shift) = self.packed_addr(buf, index, bits)?;
        let b = &mut self.b;
        let old = b.ins().load(types::I8, MemFlagsData::trusted(), addr, 0);
        let old = b.ins().uextend(types::I32, old);
        let ones = b.ins().iconst(types::I32, (1 << bits) - 1);
        let mask = b.ins().ishl(ones, shift);
        let keep = b.ins().bnot(mask);
        let old = b.ins().band(old, keep);
        let nv = b.ins().uextend(types::I32, v);
        let nv = b.ins().band_imm_s(nv, (1 << bits) - 1);
        let nv = b.ins().ishl(nv, shift);
        let r = b.ins().bor(old, nv);
        let r = b.ins().ireduce(types::I8, r);
        b.ins().store(MemFlagsData::trusted(), r, addr, 0);
        Ok(())
    }

    fn addr(&mut self, buf: BufId, index: &Expr) -> Result<Value, String> {
        let size = self.p.buffers[buf].elem.bytes() as i64;
        let i = self.expr(index)?;
        let off = self.b.ins().imul_imm_s(i, size);
        Ok(self.b.ins().iadd(self.bases[&buf], off))
    }

    fn expr(&mut self, e: &Expr) -> Result<Value, String> {
        Ok(match e {
            Expr::Var(v) => self.b.use_var(self.vars[*v]),
            Expr::Int(i) => self.b.ins().iconst(types::I64, *i),
            Expr::Float(x, Ty::F32) => self.b.ins().f32const(*x as f32),
            Expr::Float(x, _) => self.b.ins().f64const(*x),
            Expr::Load(buf, idx) if self.p.buffers[*buf].elem.bits() < 8 => {
                let elem = self.p.buffers[*buf].elem;
                let raw = self.load_packed(*buf, idx, elem.bits())?;
                self.widen_loaded(raw, elem)
            }
            Expr::Load(buf, idx) => {
                let elem = self.p.buffers[*buf].elem;
                let addr = self.addr(*buf, idx)?;
                let raw = self
                    .b
                    .ins()
                    .load(clty(elem), MemFlagsData::trusted(), addr, 0);
                self.widen_loaded(raw, elem)
            }
            Expr::Un(op, a) => {
                let t = self.ty(a)?;
                let x = self.expr(a)?;
                let f = t.is_float();
                let ins = self.b.ins();
                match op {
                    UnOp::Neg if f => ins.fneg(x),
                    UnOp::Neg => ins.ineg(x),
                    UnOp::Abs if f => ins.fabs(x),
                    UnOp::Abs if t.is_signed() => ins.iabs(x),
                    UnOp::Abs => x,
                    UnOp::Sqrt => ins.sqrt(x),
                    UnOp::Floor => ins.floor(x),
                    UnOp::Ceil => ins.ceil(x),
                    UnOp::Nearest => ins.nearest(x),
                    UnOp::Trunc => ins.trunc(x),
                    UnOp::Not => ins.bnot(x),
                }
            }
            Expr::Bin(op, a, bx) => {
                let t = self.ty(a)?;
                let x = self.expr(a)?;
                let y = self.expr(bx)?;
                self.bin(*op, t, x, y)
            }
            Expr::Cmp(op, a, bx) => {
                let t = self.ty(a)?;
                let x = self.expr(a)?;
                let y = self.expr(bx)?;
                if t.is_float() {
                    let cc = match op {
                        CmpOp::Eq => FloatCC::Equal,
                        CmpOp::Ne => FloatCC::NotEqual,
                        CmpOp::Lt => FloatCC::LessThan,
                        CmpOp::Le => FloatCC::LessThanOrEqual,
                        CmpOp::Gt => FloatCC::GreaterThan,
                        CmpOp::Ge => FloatCC::GreaterThanOrEqual,
                    };
                    self.b.ins().fcmp(cc, x, y)
                } else {
                    let s = t.is_signed();
                    let cc = match op {
                        CmpOp::Eq => IntCC::Equal,
                        CmpOp::Ne => IntCC::NotEqual,
                        CmpOp::Lt if s => IntCC::SignedLessThan,
                        CmpOp::Le if s => IntCC::SignedLessThanOrEqual,
                        CmpOp::Gt if s => IntCC::SignedGreaterThan,
                        CmpOp::Ge if s => IntCC::SignedGreaterThanOrEqual,
                        CmpOp::Lt => IntCC::UnsignedLessThan,
                        CmpOp::Le => IntCC::UnsignedLessThanOrEqual,
                        CmpOp::Gt => IntCC::UnsignedGreaterThan,
                        CmpOp::Ge => IntCC::UnsignedGreaterThanOrEqual,
                    };
                    self.b.ins().icmp(cc, x, y)
                }
            }
            Expr::Select(c, a, bx) => {
                let c = self.expr(c)?;
                let x = self.expr(a)?;
                let y = self.expr(bx)?;
                self.b.ins().select(c, x, y)
            }
            Expr::Cast(to, a) => {
                let from = self.ty(a)?;
                let x = self.expr(a)?;
                self.cast(x, from, *to)
            }
            Expr::Call(f, args) => {
                let t = self.ty(&args[0])?;
                let vals = args
                    .iter()
                    .map(|a| self.expr(a))
                    .collect::<Result<Vec<_>, _>>()?;
                self.call(*f, t, &vals)?
            }
            Expr::StrByte(buf, i, j) => {
                // The string's pointer, then its byte: never past the NUL (the lowering
                // walks bytes in order and stops there).
                let ptr = self.module.isa().pointer_type();
                let at = self.addr(*buf, i)?;
                let s = self.b.ins().load(ptr, MemFlagsData::trusted(), at, 0);
                let j = self.expr(j)?;
                let a = self.b.ins().iadd(s, j);
                self.b.ins().load(types::I8, MemFlagsData::trusted(), a, 0)
            }
        })
    }

    fn bin(&mut self, op: BinOp, t: Ty, x: Value, y: Value) -> Value {
        let ins = self.b.ins();
        if t.is_float() {
            return match op {
                BinOp::Add => ins.fadd(x, y),
                BinOp::Sub => ins.fsub(x, y),
                BinOp::Mul => ins.fmul(x, y),
                BinOp::Div => ins.fdiv(x, y),
                BinOp::Min => ins.fmin(x, y),
                BinOp::Max => ins.fmax(x, y),
                _ => unreachable!("verified: {op:?} on floats"),
            };
        }
        let s = t.is_signed();
        match op {
            BinOp::Add => ins.iadd(x, y),
            BinOp::Sub => ins.isub(x, y),
            BinOp::Mul => ins.imul(x, y),
            BinOp::Div | BinOp::Rem => {
                // Never trap: a zero divisor gives 0, and MIN / -1 wraps (as the
                // reference evaluator does).
                let ct = clty(t);
                let zero = self.b.ins().iconst(ct, 0);
                let one = self.b.ins().iconst(ct, 1);
                let is_zero = self.b.ins().icmp(IntCC::Equal, y, zero);
                let mut safe_y = self.b.ins().select(is_zero, one, y);
                if s {
                    let minus1 = self.b.ins().iconst(ct, -1);
                    let is_m1 = self.b.ins().icmp(IntCC::Equal, safe_y, minus1);
                    safe_y = self.b.ins().select(is_m1, one, safe_y);
                    let r = if op == BinOp::Div {
                        self.b.ins().sdiv(x, safe_y)
                    } else {
                        self.b.ins().srem(x, safe_y)
                    };
                    let neg = if op == BinOp::Div {
                        self.b.ins().ineg(x)
                    } else {
                        zero
                    };
                    let r = self.b.ins().select(is_m1, neg, r);
                    self.b.ins().select(is_zero, zero, r)
                } else {
                    let r = if op == BinOp::Div {
                        self.b.ins().udiv(x, safe_y)
                    } else {
                        self.b.ins().urem(x, safe_y)
                    };
                    self.b.ins().select(is_zero, zero, r)
                }
            }
            BinOp::Min if s => ins.smin(x, y),
            BinOp::Min => ins.umin(x, y),
            BinOp::Max if s => ins.smax(x, y),
            BinOp::Max => ins.umax(x, y),
            BinOp::And => ins.band(x, y),
            BinOp::Or => ins.bor(x, y),
            BinOp::Xor => ins.bxor(x, y),
            BinOp::Shl => ins.ishl(x, y),
            BinOp::Shr if s => ins.sshr(x, y),
            BinOp::Shr => ins.ushr(x, y),
        }
    }

    pub(super) fn cast(&mut self, x: Value, from: Ty, to: Ty) -> Value {
        if from == to {
            return x;
        }
        let (ft, tt) = (clty(from), clty(to));
        let ins = self.b.ins();
        match (from.is_float(), to.is_float()) {
            (true, true) => {
                if to == Ty::F64 {
                    ins.fpromote(types::F64, x)
                } else {
                    ins.fdemote(types::F32, x)
                }
            }
            (true, false) => {
                // Truncate toward zero, saturating (NaN -> 0), via i64 then wrap.
                let wide = if to.is_signed() || to.bytes() < 8 {
                    ins.fcvt_to_sint_sat(types::I64, x)
                } else {
                    ins.fcvt_to_uint_sat(types::I64, x)
                };
                if tt == types::I64 {
                    wide
                } else {
                    self.b.ins().ireduce(tt, wide)
                }
            }
            (false, true) => {
                if from.is_signed() {
                    ins.fcvt_from_sint(tt, x)
                } else {
                    ins.fcvt_from_uint(tt, x)
                }
            }
            (false, false) => {
                if ft.bits() == tt.bits() {
                    x
                } else if ft.bits() > tt.bits() {
                    ins.ireduce(tt, x)
                } else if from.is_signed() {
                    ins.sextend(tt, x)
                } else {
                    ins.uextend(tt, x)
                }
            }
        }
    }

    fn call(&mut self, f: MathFn, t: Ty, args: &[Value]) -> Result<Value, String> {
        if t == Ty::F32 && crate::backend::cranelift::vmath::is_inline(f) {
            return self.inline_math(f, args[0]);
        }
        self.libm(f, t, args)
    }

    /// vmath's inline `f` of an f32 or f32x4 `x`; for sin and cos, guarded
    /// ([`Gen::guarded_trig`]).
    pub(super) fn inline_math(&mut self, f: MathFn, x: Value) -> Result<Value, String> {
        if matches!(f, MathFn::Sin | MathFn::Cos | MathFn::Tan) {
            return self.guarded_trig(f, x);
        }
        crate::backend::cranelift::vmath::emit(&mut self.b, f, x)
            .ok_or_else(|| format!("vmath: no inline {f:?}"))
    }

    /// vmath's inline sin / cos / tan of an f32 or f32x4 `x`, and a branch (taken when
    /// some `|x|` exceeds `vmath::SINCOS_MAX`, infinities included) to libm's `sinf` /
    /// `cosf` / `tanf` of each lane instead: the inline reduction loses accuracy there.
    fn guarded_trig(&mut self, f: MathFn, x: Value) -> Result<Value, String> {
        use crate::backend::cranelift::vmath::{emit, SINCOS_MAX};
        let ty = self.b.func.dfg.value_type(x);
        let fast = emit(&mut self.b, f, x).ok_or("vmath: no inline sin/cos/tan")?;
        let a = self.b.ins().fabs(x);
        let lim = self.b.ins().f32const(SINCOS_MAX);
        let lim = if ty == types::F32 {
            lim
        } else {
            self.b.ins().splat(ty, lim)
        };
        let big = self.b.ins().fcmp(FloatCC::GreaterThan, a, lim);
        let any = if ty == types::F32 {
            big
        } else {
            self.b.ins().vany_true(big)
        };
        let slow = self.b.create_block();
        let join = self.b.create_block();
        self.b.append_block_param(join, ty);
        self.b.ins().brif(any, slow, &[], join, &[fast.into()]);
        self.b.switch_to_block(slow);
        let y = if ty == types::F32 {
            self.libm(f, Ty::F32, &[x])?
        } else {
            let lanes = ty.lane_count() as u8;
            let mut y = fast;
            for l in 0..lanes {
                let xl = self.b.ins().extractlane(x, l);
                let yl = self.libm(f, Ty::F32, &[xl])?;
                y = self.b.ins().insertlane(y, yl, l);
            }
            y
        };
        self.b.ins().jump(join, &[y.into()]);
        self.b.switch_to_block(join);
        Ok(self.b.block_params(join)[0])
    }

    /// A call of libm's `f` on `t` (f32 or f64).
    fn libm(&mut self, f: MathFn, t: Ty, args: &[Value]) -> Result<Value, String> {
        let name = f.symbol(t);
        let ct = clty(t);
        let fid = match self.libm.get(name) {
            Some(id) => *id,
            None => {
                let mut sig = Signature::new(self.module.isa().default_call_conv());
                for _ in 0..f.arity() {
                    sig.params.push(AbiParam::new(ct));
                }
                sig.returns.push(AbiParam::new(ct));
                let id = self
                    .module
                    .declare_function(name, Linkage::Import, &sig)
                    .map_err(|e| format!("declare {name}: {e}"))?;
                self.libm.insert(name, id);
                id
            }
        };
        let fr = self.module.declare_func_in_func(fid, self.b.func);
        let call = self.b.ins().call(fr, args);
        Ok(self.b.inst_results(call)[0])
    }

    /// Widens a loaded storage value to its compute type (f16/bf16 -> f32).
    fn widen_loaded(&mut self, raw: Value, elem: Ty) -> Value {
        match elem {
            Ty::BF16 => {
                let w = self.b.ins().uextend(types::I32, raw);
                let s = self.b.ins().ishl_imm_u(w, 16);
                self.b.ins().bitcast(types::F32, MemFlagsData::new(), s)
            }
            Ty::F16 => self.f16_to_f32(raw),
            Ty::F8E8M0 => {
                let b = &mut self.b;
                let w = b.ins().uextend(types::I32, raw);
                let bits = b.ins().ishl_imm_u(w, 23);
                let is_zero = b.ins().icmp_imm_s(IntCC::Equal, w, 0);
                let tiny = b.ins().iconst(types::I32, 0x0040_0000); // 2^-127
                let bits = b.ins().select(is_zero, tiny, bits);
                let is_nan = b.ins().icmp_imm_s(IntCC::Equal, w, 0xff);
                let nan = b.ins().iconst(types::I32, 0x7fc0_0000);
                let bits = b.ins().select(is_nan, nan, bits);
                b.ins().bitcast(types::F32, MemFlagsData::new(), bits)
            }
            Ty::I4 | Ty::I2 => {
                // Sign-extend the low `bits` bits.
                let up = 8 - elem.bits() as i64;
                let b = &mut self.b;
                let x = b.ins().ishl_imm_u(raw, up);
                b.ins().sshr_imm_u(x, up)
            }
            t => match minifloat(t) {
                Some(f) => self.mini_to_f32(raw, f),
                None => raw,
            },
        }
    }

    /// Decodes a minifloat code (low bits of an i8) to f32.
    fn mini_to_f32(&mut self, raw: Value, f: Mini) -> Value {
        let b = &mut self.b;
        let c = b.ins().uextend(types::I32, raw);
        let mmask = (1i64 << f.man) - 1;
        let emask = (1i64 << f.exp) - 1;
        let e = b.ins().ushr_imm_u(c, f.man as i64);
        let e = b.ins().band_imm_s(e, emask);
        let m = b.ins().band_imm_s(c, mmask);
        // value = mm * 2^(ee - bias - man), mm = m (+ implicit one), ee = max(e, 1).
        let is_sub = b.ins().icmp_imm_s(IntCC::Equal, e, 0);
        let one = b.ins().iconst(types::I32, 1);
        let ee = b.ins().select(is_sub, one, e);
        let mi = b.ins().bor_imm_s(m, 1 << f.man);
        let mm = b.ins().select(is_sub, m, mi);
        let p = b.ins().iadd_imm_s(ee, 127 - f.bias - f.man as i64);
        let p = b.ins().ishl_imm_u(p, 23);
        let scale = b.ins().bitcast(types::F32, MemFlagsData::new(), p);
        let mf = b.ins().fcvt_from_uint(types::F32, mm);
        let mut v = b.ins().fmul(mf, scale);
        let nan = b.ins().f32const(f32::NAN);
        if f.ieee {
            let inf = b.ins().f32const(f32::INFINITY);
            let is_m0 = b.ins().icmp_imm_s(IntCC::Equal, m, 0);
            let special = b.ins().select(is_m0, inf, nan);
            let is_max = b.ins().icmp_imm_s(IntCC::Equal, e, emask);
            v = b.ins().select(is_max, special, v);
        }
        if f.fn_nan {
            let low = b.ins().band_imm_s(c, (1 << (f.exp + f.man)) - 1);
            let is_nan = b
                .ins()
                .icmp_imm_s(IntCC::Equal, low, (1 << (f.exp + f.man)) - 1);
            v = b.ins().select(is_nan, nan, v);
        }
        let sign_bit = 1i64 << (f.exp + f.man);
        let s = b.ins().band_imm_s(c, sign_bit);
        let neg = b.ins().icmp_imm_s(IntCC::NotEqual, s, 0);
        let nv = b.ins().fneg(v);
        let v = b.ins().select(neg, nv, v);
        if f.uz {
            let is_nan = b.ins().icmp_imm_s(IntCC::Equal, c, sign_bit);
            b.ins().select(is_nan, nan, v)
        } else {
            v
        }
    }

    /// Encodes an f32 as a minifloat code (i8), rounding to nearest even. Out-of-range
    /// values give the type's Inf (E5M2) or NaN, or saturate where the type has neither
    /// (F4E2M1), like the reference's non-saturating conversion; saturating casts clamp
    /// before the store.
    fn f32_to_mini(&mut self, x: Value, f: Mini) -> Value {
        let b = &mut self.b;
        let emin = 1 - f.bias; // smallest normal exponent
        let bits = b.ins().bitcast(types::I32, MemFlagsData::new(), x);
        let abits = b.ins().band_imm_s(bits, 0x7fff_ffff);
        let a = b.ins().bitcast(types::F32, MemFlagsData::new(), abits);
        let ea = b.ins().ushr_imm_u(abits, 23);
        let ea = b.ins().iadd_imm_s(ea, -127);
        let emin_v = b.ins().iconst(types::I32, emin);
        let big = b.ins().icmp(IntCC::SignedGreaterThan, ea, emin_v);
        let e = b.ins().select(big, ea, emin_v);
        // Clamp the exponent so the scale stays a normal f32 (huge values overflow below).
        let hundred = b.ins().iconst(types::I32, 100);
        let e = b.ins().smin(e, hundred);
        // r = nearest_even(a / 2^(e - man)); code = (e - emin) << man + r.
        let p = b.ins().iadd_imm_s(e, 127 - f.man as i64);
        let p = b.ins().ishl_imm_u(p, 23);
        let q = b.ins().bitcast(types::F32, MemFlagsData::new(), p);
        let r = b.ins().fdiv(a, q);
        let r = b.ins().nearest(r);
        let r = b.ins().fcvt_to_uint_sat(types::I32, r);
        let de = b.ins().iadd_imm_s(e, -emin);
        let de = b.ins().ishl_imm_u(de, f.man as i64);
        let code = b.ins().iadd(de, r);
        // Overflow and infinities.
        let max_code = f.max_code as i64;
        let over = b.ins().icmp_imm_s(IntCC::SignedGreaterThan, code, max_code);
        let is_inf = b.ins().icmp_imm_s(IntCC::Equal, abits, 0x7f80_0000);
        let over = b.ins().bor(over, is_inf);
        let over_code = b.ins().iconst(types::I32, f.overflow_code as i64);
        let code = b.ins().select(over, over_code, code);
        // Sign (the FNUZ types have no negative zero, and their NaN is unsigned).
        let sign_bit = 1i64 << (f.exp + f.man);
        let neg = b.ins().icmp_imm_s(IntCC::SignedLessThan, bits, 0);
        let signed = b.ins().bor_imm_s(code, sign_bit);
        let neg_ok = if f.uz {
            let nonzero = b.ins().icmp_imm_s(IntCC::NotEqual, code, 0);
            b.ins().band(neg, nonzero)
        } else {
            neg
        };
        let code = b.ins().select(neg_ok, signed, code);
        // NaN.
        let is_nan = b.ins().fcmp(FloatCC::Unordered, x, x);
        let nan_code = if f.nan_code < 0 {
            // F4E2M1 has no NaN: the reference maps NaN to 0x8 (or 0 when negative).
            let eight = b.ins().iconst(types::I32, 8);
            let zero = b.ins().iconst(types::I32, 0);
            b.ins().select(neg, zero, eight)
        } else {
            b.ins().iconst(types::I32, f.nan_code as i64)
        };
        let code = b.ins().select(is_nan, nan_code, code);
        b.ins().ireduce(types::I8, code)
    }

    /// f32 -> E8M0 (a power of two, rounding up), like Cast's default round_mode.
    fn f32_to_e8m0(&mut self, x: Value) -> Value {
        let b = &mut self.b;
        let bits = b.ins().bitcast(types::I32, MemFlagsData::new(), x);
        let e = b.ins().ushr_imm_u(bits, 23);
        let e = b.ins().band_imm_s(e, 0xff);
        let m = b.ins().band_imm_s(bits, 0x7f_ffff);
        let has_m = b.ins().icmp_imm_s(IntCC::NotEqual, m, 0);
        let up = b.ins().uextend(types::I32, has_m);
        let code = b.ins().iadd(e, up);
        // Subnormal inputs: 2^-127 (code 0) when m <= 2^22, else 2^-126 (code 1).
        let is_sub = b.ins().icmp_imm_s(IntCC::Equal, e, 0);
        let big_m = b.ins().icmp_imm_s(IntCC::UnsignedGreaterThan, m, 0x40_0000);
        let sub_code = b.ins().uextend(types::I32, big_m);
        let code = b.ins().select(is_sub, sub_code, code);
        let ff = b.ins().iconst(types::I32, 0xff);
        let code = b.ins().umin(code, ff);
        // Zero -> 0; negative, NaN, Inf and overflow -> 0xff.
        let is_zero = b.ins().icmp_imm_s(IntCC::Equal, bits, 0);
        let zero = b.ins().iconst(types::I32, 0);
        let code = b.ins().select(is_zero, zero, code);
        let neg = b.ins().icmp_imm_s(IntCC::SignedLessThan, bits, 0);
        let is_nan = b.ins().fcmp(FloatCC::Unordered, x, x);
        let bad = b.ins().bor(neg, is_nan);
        let code = b.ins().select(bad, ff, code);
        b.ins().ireduce(types::I8, code)
    }

    /// Narrows a compute value to storage (f32 -> f16/bf16, round to nearest even).
    pub(super) fn narrow_for_store(&mut self, v: Value, elem: Ty) -> Value {
        match elem {
            Ty::BF16 => {
                let b = &mut self.b;
                let bits = b.ins().bitcast(types::I32, MemFlagsData::new(), v);
                let lsb = b.ins().ushr_imm_u(bits, 16);
                let lsb = b.ins().band_imm_s(lsb, 1);
                let r = b.ins().iadd_imm_s(bits, 0x7fff);
                let r = b.ins().iadd(r, lsb);
                let r = b.ins().ushr_imm_u(r, 16);
                let is_nan = b.ins().fcmp(FloatCC::Unordered, v, v);
                let nan = b.ins().iconst(types::I32, 0x7fc0);
                let r = b.ins().select(is_nan, nan, r);
                b.ins().ireduce(types::I16, r)
            }
            Ty::F16 => self.f32_to_f16(v),
            Ty::F8E8M0 => self.f32_to_e8m0(v),
            t => match minifloat(t) {
                Some(f) => self.f32_to_mini(v, f),
                None => v,
            },
        }
    }

    fn f16_to_f32(&mut self, raw: Value) -> Value {
        let b = &mut self.b;
        let h = b.ins().uextend(types::I32, raw);
        let sign = b.ins().band_imm_s(h, 0x8000);
        let sign = b.ins().ishl_imm_u(sign, 16);
        let exp = b.ins().ushr_imm_u(h, 10);
        let exp = b.ins().band_imm_s(exp, 0x1f);
        let mant = b.ins().band_imm_s(h, 0x3ff);
        // Normal numbers.
        let e = b.ins().iadd_imm_s(exp, 112);
        let e = b.ins().ishl_imm_u(e, 23);
        let m = b.ins().ishl_imm_u(mant, 13);
        let normal = b.ins().bor(e, m);
        // Inf/NaN (a NaN quiet, as F16C's vcvtph2ps and the half crate make it).
        let is_nan = b.ins().icmp_imm_s(IntCC::NotEqual, mant, 0);
        let qnan = b.ins().iconst(types::I32, 0x7fc0_0000);
        let inf = b.ins().iconst(types::I32, 0x7f80_0000);
        let top = b.ins().select(is_nan, qnan, inf);
        let infnan = b.ins().bor(m, top);
        let is_max = b.ins().icmp_imm_s(IntCC::Equal, exp, 0x1f);
        let bits = b.ins().select(is_max, infnan, normal);
        let bits = b.ins().bor(bits, sign);
        let f = b.ins().bitcast(types::F32, MemFlagsData::new(), bits);
        // Zero and subnormals: mant * 2^-24, with the sign.
        let mf = b.ins().fcvt_from_uint(types::F32, mant);
        let scale = b.ins().f32const(5.960_464_5e-8);
        let sub = b.ins().fmul(mf, scale);
        let sign_f = b.ins().bitcast(types::F32, MemFlagsData::new(), sign);
        let sub = b.ins().fcopysign(sub, sign_f);
        let is_sub = b.ins().icmp_imm_s(IntCC::Equal, exp, 0);
        b.ins().select(is_sub, sub, f)
    }

    fn f32_to_f16(&mut self, v: Value) -> Value {
        // Round to nearest even, after F. Giesen's float_to_half_fast3_rtne.
        let b = &mut self.b;
        let bits = b.ins().bitcast(types::I32, MemFlagsData::new(), v);
        let sign = b.ins().band_imm_s(bits, 0x8000_0000u32 as i64);
        let f = b.ins().bxor(bits, sign);
        // Inf or NaN (f >= 0x47800000 means overflow to inf).
        let is_nan = b
            .ins()
            .icmp_imm_s(IntCC::UnsignedGreaterThan, f, 0x7f80_0000);
        let c7e00 = b.ins().iconst(types::I32, 0x7e00);
        let c7c00 = b.ins().iconst(types::I32, 0x7c00);
        let big = b.ins().select(is_nan, c7e00, c7c00);
        // Subnormal results.
        let denorm_magic: u32 = ((127 - 15) + (23 - 10) + 1) << 23;
        let ff = b.ins().bitcast(types::F32, MemFlagsData::new(), f);
        let magic = b.ins().f32const(f32::from_bits(denorm_magic));
        let sum = b.ins().fadd(ff, magic);
        let sb = b.ins().bitcast(types::I32, MemFlagsData::new(), sum);
        let sub = b.ins().iadd_imm_s(sb, -(denorm_magic as i64));
        // Normal results.
        let odd = b.ins().ushr_imm_u(f, 13);
        let odd = b.ins().band_imm_s(odd, 1);
        let n = b
            .ins()
            .iadd_imm_s(f, (((15i64 - 127) << 23) + 0xfff) & 0xffff_ffff);
        let n = b.ins().iadd(n, odd);
        let n = b.ins().ushr_imm_u(n, 13);
        let is_big = b.ins().icmp_imm_s(
            IntCC::UnsignedGreaterThanOrEqual,
            f,
            ((127 + 16) << 23) as i64,
        );
        let is_sub = b
            .ins()
            .icmp_imm_s(IntCC::UnsignedLessThan, f, (113 << 23) as i64);
        let r = b.ins().select(is_sub, sub, n);
        let r = b.ins().select(is_big, big, r);
        let s16 = b.ins().ushr_imm_u(sign, 16);
        let r = b.ins().bor(r, s16);
        b.ins().ireduce(types::I16, r)
    }
}
