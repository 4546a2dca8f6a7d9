//! Kernel IR -> Cranelift IR -> a relocatable object file (cranelift-object), for x86_64
//! and aarch64. Each kernel becomes a local function `(inputs, outputs, arena, threads)`;
//! the exported entry points check their pointers and call the kernels in order.
//! `threads` is the caller's `const onnxc_threads_t *` (or null): kernels with large
//! GEMMs hand their parts to its `parallel_for` (see gemm.rs, [`gemm::Split`]).

mod codegen;
pub mod gemm;
pub(crate) mod vmath;

use crate::kir::{BufKind, Program};
use cranelift_codegen::ir::{types, AbiParam, InstBuilder, MemFlagsData, Signature};
use cranelift_codegen::isa::{self, CallConv};
use cranelift_codegen::settings::{self, Configurable};
use cranelift_codegen::Context;
use cranelift_frontend::{FunctionBuilder, FunctionBuilderContext};
use cranelift_module::{default_libcall_names, DataDescription, DataId, FuncId, Linkage, Module};
use cranelift_object::{ObjectBuilder, ObjectModule};
use std::collections::HashMap;
use std::str::FromStr;

/// What the object exposes about one input or output (for the descriptor).
#[derive(Clone, Debug)]
pub struct TensorDesc {
    pub name: String,
    /// ONNX dtype code.
    pub dtype: i32,
    pub shape: Vec<u64>,
    pub bytes: u64,
}

/// Everything the back end needs to write one object.
pub struct ObjectSpec<'a> {
    /// Symbol prefix (`PREFIX_run`, ...).
    pub prefix: &'a str,
    pub program: &'a Program,
    pub inputs: &'a [TensorDesc],
    pub outputs: &'a [TensorDesc],
    /// target-lexicon triple, e.g. `x86_64-unknown-linux-gnu`.
    pub triple: &'a str,
    /// ISA features from the target file (`avx2`, `fma`, `neon`, ...).
    pub features: &'a [String],
    /// See `driver::Options::exact_math`.
    pub exact_math: bool,
    /// Also export `PREFIX_kernels`, the kernels in order with their names, so that a
    /// profiler can time each (see `driver::Options::kernel_table`).
    pub kernel_table: bool,
    /// See `driver::Options::min_program_work`.
    pub min_program_work: u64,
}

/// Alignment the arena must have (bytes); checked by the entry points.
pub const ARENA_ALIGN: u64 = 64;

type R<T> = Result<T, String>;

fn err<E: std::fmt::Display>(what: &str) -> impl Fn(E) -> String + '_ {
    move |e| format!("{what}: {e}")
}

/// Builds the target ISA with the features the target file lists (each set explicitly;
/// Cranelift's flags do not imply their prerequisites).
pub fn make_isa(triple: &str, features: &[String]) -> R<std::sync::Arc<dyn isa::TargetIsa>> {
    let triple = target_lexicon::Triple::from_str(triple)
        .map_err(|e| format!("bad triple `{triple}`: {e}"))?;
    let mut flags = settings::builder();
    flags.set("opt_level", "speed").map_err(err("opt_level"))?;
    flags.set("is_pic", "true").map_err(err("is_pic"))?;
    flags
        .set(
            "enable_verifier",
            if cfg!(debug_assertions) {
                "true"
            } else {
                "false"
            },
        )
        .map_err(err("verifier"))?;
    flags
        .set("log2_min_function_alignment", "4")
        .map_err(err("alignment"))?;
    let mut ib = isa::lookup(triple.clone())
        .map_err(|e| format!("no Cranelift back end for `{triple}`: {e}"))?;
    if triple.architecture.to_string().starts_with("x86_64") {
        for f in features {
            let flag = match f.as_str() {
                "sse3" => "has_sse3",
                "ssse3" => "has_ssse3",
                "sse4.1" => "has_sse41",
                "sse4.2" => "has_sse42",
                "popcnt" => "has_popcnt",
                "avx" => "has_avx",
                "avx2" => "has_avx2",
                "fma" => "has_fma",
                "bmi1" => "has_bmi1",
                "bmi2" => "has_bmi2",
                "lzcnt" => "has_lzcnt",
                "avx512f" => "has_avx512f",
                "avx512bw" => "has_avx512bw",
                "avx512dq" => "has_avx512dq",
                "avx512vl" => "has_avx512vl",
                _ => continue,
            };
            // Settings this Cranelift version does not know are skipped: the code it
            // emits never needs them.
            let _ = ib.enable(flag);
        }
    }
    ib.finish(settings::Flags::new(flags)).map_err(err("ISA"))
}

/// Compiles a program into object-file bytes.
pub fn compile_object(spec: &ObjectSpec) -> R<Vec<u8>> {
    let isa = make_isa(spec.triple, spec.features)?;
    let ptr = isa.pointer_type();
    let fcfg = isa.frontend_config();
    let builder = ObjectBuilder::new(isa, spec.prefix.to_string(), default_libcall_names())
        .map_err(err("object"))?;
    let mut module = ObjectModule::new(builder);
    let p = spec.program;

    // Constant buffers, 64-byte aligned read-only data: defined when a kernel first
    // reads them, so that weights the GEMMs only read prepacked (a copy in the panel
    // layout) are not in the object twice.
    let mut consts: HashMap<usize, DataId> = HashMap::new();

    // The kernels.
    let mut ksig = Signature::new(CallConv::SystemV);
    let call_conv = module.isa().default_call_conv();
    ksig.call_conv = call_conv;
    for _ in 0..4 {
        ksig.params.push(AbiParam::new(ptr));
    }
    let mut ctx = module.make_context();
    let mut fbc = FunctionBuilderContext::new();
    let mut kernel_ids: Vec<FuncId> = Vec::new();
    let mut libm: HashMap<&'static str, FuncId> = HashMap::new();
    // Cache sizes for GEMM blocking (KiB): a current x86 core's L1d and per-core L2.
    let mut gemms = gemm::GemmCtx::new(spec.prefix, spec.triple, spec.features, 48, 1024);
    let mut wide =
        codegen::WideFuncs::new(spec.prefix, spec.triple, spec.features, spec.exact_math);
    // Loops worth handing out (kir::parallel): none in a program too small to pay for it.
    let min_work = if crate::kir::parallel::program_work(p) < spec.min_program_work {
        u64::MAX
    } else {
        crate::kir::parallel::MIN_WORK
    };
    for (ki, k) in p.kernels.iter().enumerate() {
        let (k, calls) = gemms.prepare(&mut module, k, p)?;
        let k = &k;
        let bufs = codegen::kernel_bufs(k, &calls);
        for &i in &bufs {
            if let std::collections::hash_map::Entry::Vacant(slot) = consts.entry(i) {
                if let Some(id) = define_const(&mut module, spec.prefix, p, i)? {
                    slot.insert(id);
                }
            }
        }
        let fname = format!("{}__k{ki}_{}", spec.prefix, sanitize(&k.name));
        let fid = module
            .declare_function(&fname, Linkage::Local, &ksig)
            .map_err(err("declare kernel"))?;
        ctx.func.signature = ksig.clone();
        codegen::kernel(
            &mut module,
            &mut ctx.func,
            &mut fbc,
            k,
            &bufs,
            p,
            &consts,
            &mut libm,
            calls,
            &fname,
            &mut wide,
            min_work,
        )?;
        module
            .define_function(fid, &mut ctx)
            .map_err(|e| format!("kernel `{}`: {e:?}", k.name))?;
        module.clear_context(&mut ctx);
        kernel_ids.push(fid);
    }

    // PREFIX_run_parallel(inputs, outputs, arena, threads) -> status.
    let mut psig = Signature::new(call_conv);
    for _ in 0..4 {
        psig.params.push(AbiParam::new(ptr));
    }
    psig.returns.push(AbiParam::new(types::I32));
    let run_p = module
        .declare_function(
            &format!("{}_run_parallel", spec.prefix),
            Linkage::Export,
            &psig,
        )
        .map_err(err("declare run_parallel"))?;
    ctx.func.signature = psig.clone();
    {
        let mut b = FunctionBuilder::new(&mut ctx.func, &mut fbc);
        let entry = b.create_block();
        b.append_block_params_for_function_params(entry);
        b.switch_to_block(entry);
        b.seal_block(entry);
        let (ins, outs, arena, threads) = {
            let v = b.block_params(entry);
            (v[0], v[1], v[2], v[3])
        };
        let fail = |b: &mut FunctionBuilder, cond, code: i64| {
            let bad = b.create_block();
            let ok = b.create_block();
            b.ins().brif(cond, bad, &[], ok, &[]);
            b.switch_to_block(bad);
            b.seal_block(bad);
            let c = b.ins().iconst(types::I32, code);
            b.ins().return_(&[c]);
            b.switch_to_block(ok);
            b.seal_block(ok);
        };
        // Null pointers: the arrays, each entry, and the arena when one is needed.
        for (arr, n) in [(ins, spec.inputs.len()), (outs, spec.outputs.len())] {
            if n == 0 {
                continue;
            }
            let z = b
                .ins()
                .icmp_imm_s(cranelift_codegen::ir::condcodes::IntCC::Equal, arr, 0);
            fail(&mut b, z, 1);
            for k in 0..n {
                let v = b
                    .ins()
                    .load(ptr, MemFlagsData::trusted(), arr, (8 * k) as i32);
                let z = b
                    .ins()
                    .icmp_imm_s(cranelift_codegen::ir::condcodes::IntCC::Equal, v, 0);
                fail(&mut b, z, 1);
            }
        }
        if p.arena_bytes > 0 {
            let z = b
                .ins()
                .icmp_imm_s(cranelift_codegen::ir::condcodes::IntCC::Equal, arena, 0);
            fail(&mut b, z, 1);
            let m = b.ins().band_imm_s(arena, (ARENA_ALIGN - 1) as i64);
            fail(&mut b, m, 2);
        }
        for &fid in &kernel_ids {
            let fr = module.declare_func_in_func(fid, b.func);
            b.ins().call(fr, &[ins, outs, arena, threads]);
        }
        let zero = b.ins().iconst(types::I32, 0);
        b.ins().return_(&[zero]);
        b.finalize(fcfg);
    }
    module
        .define_function(run_p, &mut ctx)
        .map_err(|e| format!("run_parallel: {e:?}"))?;
    module.clear_context(&mut ctx);

    // PREFIX_run_v(inputs, outputs, arena) -> status: run_parallel without threads.
    let mut rsig = Signature::new(call_conv);
    for _ in 0..3 {
        rsig.params.push(AbiParam::new(ptr));
    }
    rsig.returns.push(AbiParam::new(types::I32));
    let run_v = module
        .declare_function(&format!("{}_run_v", spec.prefix), Linkage::Export, &rsig)
        .map_err(err("declare run_v"))?;
    ctx.func.signature = rsig;
    {
        let mut b = FunctionBuilder::new(&mut ctx.func, &mut fbc);
        let entry = b.create_block();
        b.append_block_params_for_function_params(entry);
        b.switch_to_block(entry);
        b.seal_block(entry);
        let mut args = b.block_params(entry).to_vec();
        args.push(b.ins().iconst(ptr, 0));
        let fr = module.declare_func_in_func(run_p, b.func);
        let call = b.ins().call(fr, &args);
        let r = b.inst_results(call)[0];
        b.ins().return_(&[r]);
        b.finalize(fcfg);
    }
    module
        .define_function(run_v, &mut ctx)
        .map_err(|e| format!("run_v: {e:?}"))?;
    module.clear_context(&mut ctx);

    // PREFIX_run(in0, ..., out0, ..., arena) -> status: packs the pointers and calls run_v.
    let n_in = spec.inputs.len();
    let n_out = spec.outputs.len();
    let mut sig = Signature::new(call_conv);
    for _ in 0..n_in + n_out + 1 {
        sig.params.push(AbiParam::new(ptr));
    }
    sig.returns.push(AbiParam::new(types::I32));
    let run = module
        .declare_function(&format!("{}_run", spec.prefix), Linkage::Export, &sig)
        .map_err(err("declare run"))?;
    ctx.func.signature = sig;
    {
        let mut b = FunctionBuilder::new(&mut ctx.func, &mut fbc);
        let entry = b.create_block();
        b.append_block_params_for_function_params(entry);
        b.switch_to_block(entry);
        b.seal_block(entry);
        let params: Vec<_> = b.block_params(entry).to_vec();
        let slot = |b: &mut FunctionBuilder, vals: &[cranelift_codegen::ir::Value]| {
            let ss = b.create_sized_stack_slot(cranelift_codegen::ir::StackSlotData::new(
                cranelift_codegen::ir::StackSlotKind::ExplicitSlot,
                (8 * vals.len().max(1)) as u32,
                3,
            ));
            for (k, v) in vals.iter().enumerate() {
                b.ins().stack_store(ptr, *v, ss, (8 * k) as i32);
            }
            b.ins().stack_addr(ptr, ss, 0)
        };
        let ia = slot(&mut b, &params[..n_in]);
        let oa = slot(&mut b, &params[n_in..n_in + n_out]);
        let fr = module.declare_func_in_func(run_v, b.func);
        let call = b.ins().call(fr, &[ia, oa, params[n_in + n_out]]);
        let r = b.inst_results(call)[0];
        b.ins().return_(&[r]);
        b.finalize(fcfg);
    }
    module
        .define_function(run, &mut ctx)
        .map_err(|e| format!("run: {e:?}"))?;
    module.clear_context(&mut ctx);
    if spec.kernel_table {
        kernel_table(&mut module, spec.prefix, p, &kernel_ids)?;
    }

    // PREFIX_cpu_supported() -> 1/0.
    let cpu = define_cpu_supported(&mut module, spec, &mut ctx, &mut fbc)?;

    // The descriptor (onnxc_model_t) and its tensor tables.
    define_descriptor(&mut module, spec, run_v, cpu, run_p)?;

    let product = module.finish();
    product.emit().map_err(err("emit object"))
}

/// Defines buffer `i` of `p` as data when it is a constant: `PREFIX__cI`.
fn define_const(
    module: &mut ObjectModule,
    prefix: &str,
    p: &Program,
    i: usize,
) -> R<Option<DataId>> {
    let b = &p.buffers[i];
    let BufKind::Const { data } = &b.kind else {
        return Ok(None);
    };
    let name = format!("{prefix}__c{i}");
    if b.elem == crate::kir::Ty::Str {
        return define_strings(module, &name, data).map(Some);
    }
    let id = module
        .declare_data(&name, Linkage::Local, false, false)
        .map_err(err("declare data"))?;
    let mut dd = DataDescription::new();
    // Never an all-zero `.bss` object: define explicit bytes (even for zeros).
    dd.define(data.clone().into_boxed_slice());
    dd.set_align(64);
    module.define_data(id, &dd).map_err(err("define data"))?;
    Ok(Some(id))
}

/// A constant string buffer: its NUL-terminated strings (`data`, one after another) as
/// read-only bytes, and the buffer itself as a table of pointers to them (relocations;
/// explicit zero bytes, so the table is never `.bss`).
fn define_strings(module: &mut ObjectModule, name: &str, data: &[u8]) -> R<DataId> {
    let bytes = module
        .declare_data(&format!("{name}_s"), Linkage::Local, false, false)
        .map_err(err("declare strings"))?;
    let mut dd = DataDescription::new();
    dd.define(data.to_vec().into_boxed_slice());
    module
        .define_data(bytes, &dd)
        .map_err(err("define strings"))?;
    let starts: Vec<usize> = std::iter::once(0)
        .chain(
            data.iter()
                .enumerate()
                .filter(|(_, &b)| b == 0)
                .map(|(k, _)| k + 1),
        )
        .take(data.iter().filter(|&&b| b == 0).count())
        .collect();
    let table = module
        .declare_data(name, Linkage::Local, false, false)
        .map_err(err("declare string table"))?;
    let mut dd = DataDescription::new();
    dd.define(vec![0u8; 8 * starts.len()].into_boxed_slice());
    dd.set_align(64);
    let gv = module.declare_data_in_data(bytes, &mut dd);
    for (k, &at) in starts.iter().enumerate() {
        dd.write_data_addr((8 * k) as u32, gv, at as i64);
    }
    module
        .define_data(table, &dd)
        .map_err(err("define string table"))?;
    Ok(table)
}

fn sanitize(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' {
                c
            } else {
                '_'
            }
        })
        .take(48)
        .collect()
}

/// `cpu_supported`: on x86_64 a cpuid/xgetbv check of the target's features, written as
/// machine code (Cranelift has no cpuid instruction); elsewhere 1, the target file's
/// features being the documented assumption.
fn define_cpu_supported(
    module: &mut ObjectModule,
    spec: &ObjectSpec,
    ctx: &mut Context,
    fbc: &mut FunctionBuilderContext,
) -> R<FuncId> {
    let mut sig = Signature::new(module.isa().default_call_conv());
    sig.returns.push(AbiParam::new(types::I32));
    let id = module
        .declare_function(
            &format!("{}_cpu_supported", spec.prefix),
            Linkage::Export,
            &sig,
        )
        .map_err(err("declare cpu_supported"))?;
    let fcfg = module.isa().frontend_config();
    if spec.triple.starts_with("x86_64") {
        let code = x86_cpu_check(spec.features);
        module
            .define_function_bytes(id, 16, &code, &[])
            .map_err(err("cpu_supported bytes"))?;
        return Ok(id);
    }
    ctx.func.signature = sig;
    {
        let mut b = FunctionBuilder::new(&mut ctx.func, fbc);
        let e = b.create_block();
        b.switch_to_block(e);
        b.seal_block(e);
        let one = b.ins().iconst(types::I32, 1);
        b.ins().return_(&[one]);
        b.finalize(fcfg);
    }
    module
        .define_function(id, ctx)
        .map_err(|e| format!("cpu_supported: {e:?}"))?;
    module.clear_context(ctx);
    Ok(id)
}

/// x86_64 machine code for `int cpu_supported(void)`: cpuid leaves 1 and 7 plus xgetbv
/// (OS support for the ymm/zmm state), against the bits the features need; with AMX, also
/// the tile bits and Linux's permission for the tile state (`arch_prctl`), which it asks
/// for (the tile kernels ask again on each call).
fn x86_cpu_check(features: &[String]) -> Vec<u8> {
    let has = |f: &str| features.iter().any(|x| x == f);
    // Required bits: leaf 1 ecx, leaf 7 ebx, leaf 7 ecx, xcr0 mask.
    let mut l1_ecx: u32 = 0;
    let mut l7_ebx: u32 = 0;
    let mut l7_ecx: u32 = 0;
    let mut l7_edx: u32 = 0;
    let mut xcr0: u32 = 0;
    if has("sse4.1") {
        l1_ecx |= 1 << 19;
    }
    if has("sse4.2") {
        l1_ecx |= 1 << 20;
    }
    if has("fma") {
        l1_ecx |= 1 << 12;
    }
    if has("avx") || has("avx2") || has("fma") || has("avx512f") {
        l1_ecx |= (1 << 28) | (1 << 27); // avx, osxsave
        xcr0 |= 0b110; // xmm, ymm state
    }
    if has("avx2") {
        l7_ebx |= 1 << 5;
    }
    if has("avx512f") {
        l7_ebx |= 1 << 16;
        xcr0 |= 0b1110_0000; // opmask, zmm_hi256, hi16_zmm
    }
    if has("avx512dq") {
        l7_ebx |= 1 << 17;
    }
    if has("avx512bw") {
        l7_ebx |= 1 << 30;
    }
    if has("avx512vl") {
        l7_ebx |= 1 << 31;
    }
    if has("avx512vnni") {
        l7_ecx |= 1 << 11;
    }
    let amx = has("amx-int8");
    if amx {
        l7_edx |= (1 << 24) | (1 << 25); // amx-tile, amx-int8
        xcr0 |= (1 << 17) | (1 << 18); // xtilecfg, xtiledata
    }
    let mut c: Vec<u8> = Vec::new();
    let imm = |c: &mut Vec<u8>, v: u32| c.extend_from_slice(&v.to_le_bytes());
    c.push(0x53); // push rbx
                  // eax = 1; ecx = 0; cpuid; and ecx, l1_ecx; cmp ecx, l1_ecx; jne fail
    c.push(0xB8);
    imm(&mut c, 1); // mov eax, 1
    c.extend_from_slice(&[0x31, 0xC9]); // xor ecx, ecx
    c.extend_from_slice(&[0x0F, 0xA2]); // cpuid
    let mut fails: Vec<usize> = Vec::new();
    // `and reg, mask; cmp reg, mask; jne fail` (patched) for a 32-bit register by its
    // ModRM register number (eax 0, ecx 1, edx 2, ebx 3).
    let require = |c: &mut Vec<u8>, fails: &mut Vec<usize>, reg: u8, mask: u32| {
        c.extend_from_slice(&[0x81, 0xE0 | reg]);
        imm(c, mask);
        c.extend_from_slice(&[0x81, 0xF8 | reg]);
        imm(c, mask);
        c.extend_from_slice(&[0x0F, 0x85, 0, 0, 0, 0]);
        fails.push(c.len());
    };
    require(&mut c, &mut fails, 1, l1_ecx);
    // eax = 7; ecx = 0; cpuid; check ebx, ecx and edx.
    c.push(0xB8);
    imm(&mut c, 7);
    c.extend_from_slice(&[0x31, 0xC9]);
    c.extend_from_slice(&[0x0F, 0xA2]);
    require(&mut c, &mut fails, 3, l7_ebx);
    require(&mut c, &mut fails, 1, l7_ecx);
    require(&mut c, &mut fails, 2, l7_edx);
    if xcr0 != 0 {
        // ecx = 0; xgetbv; check eax.
        c.extend_from_slice(&[0x31, 0xC9]);
        c.extend_from_slice(&[0x0F, 0x01, 0xD0]);
        require(&mut c, &mut fails, 0, xcr0);
    }
    if amx {
        // arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0, else fail.
        use crate::backend::x86::amx::{ARCH_REQ_XCOMP_PERM, SYS_ARCH_PRCTL, XFEATURE_XTILEDATA};
        c.push(0xB8);
        imm(&mut c, SYS_ARCH_PRCTL); // mov eax, imm32
        c.push(0xBF);
        imm(&mut c, ARCH_REQ_XCOMP_PERM); // mov edi, imm32
        c.push(0xBE);
        imm(&mut c, XFEATURE_XTILEDATA); // mov esi, imm32
        c.extend_from_slice(&[0x0F, 0x05]); // syscall
        c.extend_from_slice(&[0x85, 0xC0]); // test eax, eax
        c.extend_from_slice(&[0x0F, 0x85, 0, 0, 0, 0]);
        fails.push(c.len());
    }
    // success: mov eax, 1; pop rbx; ret
    c.push(0xB8);
    imm(&mut c, 1);
    c.push(0x5B);
    c.push(0xC3);
    let fail_at = c.len();
    // fail: xor eax, eax; pop rbx; ret
    c.extend_from_slice(&[0x31, 0xC0, 0x5B, 0xC3]);
    for end in fails {
        let rel = (fail_at as i64 - end as i64) as i32;
        c[end - 4..end].copy_from_slice(&rel.to_le_bytes());
    }
    c
}

/// The `onnxc_model_t` layout version written (`ONNXC_ABI_VERSION`).
pub const ABI_VERSION: u32 = 2;

/// Writes `PREFIX_model` (onnxc_model_t, ABI version 2) and its tables.
fn define_descriptor(
    module: &mut ObjectModule,
    spec: &ObjectSpec,
    run_v: FuncId,
    cpu: FuncId,
    run_p: FuncId,
) -> R<()> {
    let p = spec.prefix;
    let counter = std::cell::Cell::new(0usize);
    let data = |module: &mut ObjectModule, bytes: Vec<u8>, align: u64| -> R<DataId> {
        counter.set(counter.get() + 1);
        let id = module
            .declare_data(
                &format!("{p}__d{}", counter.get()),
                Linkage::Local,
                false,
                false,
            )
            .map_err(err("declare data"))?;
        let mut dd = DataDescription::new();
        dd.define(bytes.into_boxed_slice());
        dd.set_align(align);
        module.define_data(id, &dd).map_err(err("define data"))?;
        Ok(id)
    };
    let cstr = |module: &mut ObjectModule, s: &str| -> R<DataId> {
        let mut b = s.as_bytes().to_vec();
        b.push(0);
        data(module, b, 1)
    };
    // onnxc_tensor_info_t: name ptr, i32 dtype, i32 rank, shape ptr, u64 elems, u64 bytes (40 bytes).
    let table = |module: &mut ObjectModule, ts: &[TensorDesc], what: &str| -> R<Option<DataId>> {
        if ts.is_empty() {
            return Ok(None);
        }
        let mut names = Vec::new();
        let mut shapes = Vec::new();
        for t in ts {
            names.push(cstr(module, &t.name)?);
            let mut b = Vec::new();
            for d in &t.shape {
                b.extend_from_slice(&(*d as i64).to_le_bytes());
            }
            if b.is_empty() {
                b.extend_from_slice(&0i64.to_le_bytes());
            }
            shapes.push(data(module, b, 8)?);
        }
        let id = module
            .declare_data(&format!("{p}__{what}"), Linkage::Local, false, false)
            .map_err(err("declare table"))?;
        let mut dd = DataDescription::new();
        let mut bytes = vec![0u8; 40 * ts.len()];
        for (i, t) in ts.iter().enumerate() {
            let o = 40 * i;
            bytes[o + 8..o + 12].copy_from_slice(&t.dtype.to_le_bytes());
            bytes[o + 12..o + 16].copy_from_slice(&(t.shape.len() as i32).to_le_bytes());
            let elems: u64 = t.shape.iter().product();
            bytes[o + 24..o + 32].copy_from_slice(&elems.to_le_bytes());
            bytes[o + 32..o + 40].copy_from_slice(&t.bytes.to_le_bytes());
        }
        dd.define(bytes.into_boxed_slice());
        dd.set_align(8);
        for i in 0..ts.len() {
            let gv = module.declare_data_in_data(names[i], &mut dd);
            dd.write_data_addr((40 * i) as u32, gv, 0);
            let gv = module.declare_data_in_data(shapes[i], &mut dd);
            dd.write_data_addr((40 * i + 16) as u32, gv, 0);
        }
        module.define_data(id, &dd).map_err(err("define table"))?;
        Ok(Some(id))
    };
    let ins = table(module, spec.inputs, "inputs")?;
    let outs = table(module, spec.outputs, "outputs")?;
    let name = cstr(module, p)?;
    // onnxc_model_t: u32 abi, u32 n_in, u32 n_out, u32 reserved, name, inputs, outputs,
    // u64 arena_bytes, u64 arena_align, run, cpu_supported, run_parallel (80 bytes).
    let mut bytes = vec![0u8; 80];
    bytes[0..4].copy_from_slice(&ABI_VERSION.to_le_bytes());
    bytes[4..8].copy_from_slice(&(spec.inputs.len() as u32).to_le_bytes());
    bytes[8..12].copy_from_slice(&(spec.outputs.len() as u32).to_le_bytes());
    bytes[40..48].copy_from_slice(&spec.program.arena_bytes.to_le_bytes());
    bytes[48..56].copy_from_slice(&ARENA_ALIGN.to_le_bytes());
    let id = module
        .declare_data(&format!("{p}_model"), Linkage::Export, false, false)
        .map_err(err("declare descriptor"))?;
    let mut dd = DataDescription::new();
    dd.define(bytes.into_boxed_slice());
    dd.set_align(8);
    let gv = module.declare_data_in_data(name, &mut dd);
    dd.write_data_addr(16, gv, 0);
    if let Some(t) = ins {
        let gv = module.declare_data_in_data(t, &mut dd);
        dd.write_data_addr(24, gv, 0);
    }
    if let Some(t) = outs {
        let gv = module.declare_data_in_data(t, &mut dd);
        dd.write_data_addr(32, gv, 0);
    }
    let fr = module.declare_func_in_data(run_v, &mut dd);
    dd.write_function_addr(56, fr);
    let fr = module.declare_func_in_data(cpu, &mut dd);
    dd.write_function_addr(64, fr);
    let fr = module.declare_func_in_data(run_p, &mut dd);
    dd.write_function_addr(72, fr);
    module
        .define_data(id, &dd)
        .map_err(err("define descriptor"))?;
    Ok(())
}

/// `PREFIX_kernels`: u64 count, then per kernel in run order its function (the kernel
/// signature: inputs, outputs, arena, threads) and its NUL-terminated name. Calling them
/// in order with checked pointers is what `PREFIX_run_parallel` does.
fn kernel_table(module: &mut ObjectModule, prefix: &str, p: &Program, ids: &[FuncId]) -> R<()> {
    let mut names = Vec::with_capacity(ids.len());
    for (i, k) in p.kernels.iter().enumerate() {
        let id = module
            .declare_data(&format!("{prefix}__kname{i}"), Linkage::Local, false, false)
            .map_err(err("declare kernel name"))?;
        let mut dd = DataDescription::new();
        let mut b = format!("k{i} {}", k.name).into_bytes();
        b.push(0);
        dd.define(b.into_boxed_slice());
        module
            .define_data(id, &dd)
            .map_err(err("define kernel name"))?;
        names.push(id);
    }
    let id = module
        .declare_data(&format!("{prefix}_kernels"), Linkage::Export, false, false)
        .map_err(err("declare kernel table"))?;
    let mut dd = DataDescription::new();
    let mut bytes = vec![0u8; 8 + 16 * ids.len()];
    bytes[0..8].copy_from_slice(&(ids.len() as u64).to_le_bytes());
    dd.define(bytes.into_boxed_slice());
    dd.set_align(8);
    for (i, (&f, &n)) in ids.iter().zip(&names).enumerate() {
        let fr = module.declare_func_in_data(f, &mut dd);
        dd.write_function_addr((8 + 16 * i) as u32, fr);
        let gv = module.declare_data_in_data(n, &mut dd);
        dd.write_data_addr((16 + 16 * i) as u32, gv, 0);
    }
    module
        .define_data(id, &dd)
        .map_err(err("define kernel table"))?;
    Ok(())
}
