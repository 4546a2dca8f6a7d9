//! Emit: the object file (through the Cranelift back end), the per-model C header, and
//! the JSON report.

pub mod onnx;

use crate::backend::cranelift::{compile_object, TensorDesc, ARENA_ALIGN};
use crate::error::{Error, Result};
use crate::ir::Graph;
use crate::lower::Lowered;
use std::fmt::Write;

/// What compiling a model produces.
pub struct Artifacts {
    pub object: Vec<u8>,
    pub header: String,
    pub report: serde_json::Value,
}

/// Input/output descriptions in graph order.
pub fn interface(g: &Graph) -> (Vec<TensorDesc>, Vec<TensorDesc>) {
    let desc = |ids: &[usize]| -> Vec<TensorDesc> {
        ids.iter()
            .map(|&v| {
                let info = g.value(v);
                let shape: Vec<u64> = info
                    .ty
                    .static_shape()
                    .unwrap_or_default()
                    .iter()
                    .map(|&d| d as u64)
                    .collect();
                let dt = info.ty.dtype().expect("lowered values are tensors");
                let elems: u64 = shape.iter().product();
                let bits = crate::ops::lowering::kir_ty(dt)
                    .map(|t| t.bits())
                    .unwrap_or(8);
                TensorDesc {
                    name: info.name.clone(),
                    dtype: dt.onnx_code(),
                    shape,
                    bytes: (elems * bits).div_ceil(8),
                }
            })
            .collect()
    };
    (desc(&g.inputs), desc(&g.outputs))
}

/// A C identifier from a model name (`--name` or the file stem).
pub fn c_ident(s: &str) -> String {
    let mut out: String = s
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '_'
            }
        })
        .collect();
    if out.is_empty() || out.starts_with(|c: char| c.is_ascii_digit()) {
        out.insert(0, 'm');
    }
    out
}

/// How the code is generated (see `driver::Options`).
#[derive(Clone, Copy, Debug, Default)]
pub struct CodeOptions {
    pub exact_math: bool,
    pub kernel_table: bool,
    pub min_program_work: u64,
}

/// Compiles a lowered program for a target into object bytes, header and report.
pub fn emit(
    g: &Graph,
    lowered: &Lowered,
    prefix: &str,
    triple: &str,
    features: &[String],
    code: &CodeOptions,
) -> Result<Artifacts> {
    let (inputs, outputs) = interface(g);
    let spec = crate::backend::cranelift::ObjectSpec {
        prefix,
        program: &lowered.program,
        inputs: &inputs,
        outputs: &outputs,
        triple,
        features,
        exact_math: code.exact_math,
        kernel_table: code.kernel_table,
        min_program_work: code.min_program_work,
    };
    let object =
        compile_object(&spec).map_err(|e| Error::Model(format!("code generation failed: {e}")))?;
    let header = header(
        prefix,
        &inputs,
        &outputs,
        lowered.program.arena_bytes,
        triple,
        features,
    );
    let weights: u64 = lowered
        .program
        .buffers
        .iter()
        .filter_map(|b| match &b.kind {
            crate::kir::BufKind::Const { data } => Some(data.len() as u64),
            _ => None,
        })
        .sum();
    let report = serde_json::json!({
        "name": prefix,
        "target": { "triple": triple, "features": features },
        "arena_bytes": lowered.plan.arena_bytes,
        "arena_lower_bound": lowered.plan.lower_bound,
        "weights_bytes": weights,
        "object_bytes": object.len(),
        "kernels": lowered.program.kernels.len(),
        "tensors": lowered.plan.placements.iter().map(|(n, o, b, f, l)| serde_json::json!({
            "name": n, "offset": o, "bytes": b, "first_kernel": f, "last_kernel": l
        })).collect::<Vec<_>>(),
    });
    Ok(Artifacts {
        object,
        header,
        report,
    })
}

fn ctype(dtype: i32) -> &'static str {
    match dtype {
        1 => "float",
        11 => "double",
        2 | 9 => "uint8_t",
        3 => "int8_t",
        4 | 10 | 16 => "uint16_t",
        5 => "int16_t",
        6 => "int32_t",
        7 => "int64_t",
        12 => "uint32_t",
        13 => "uint64_t",
        8 => "const char *",
        _ => "void",
    }
}

/// The C parameter of an input (`const T *input_0`) or output (`T *output_0`); string
/// tensors are arrays of `const char *`.
fn c_param(dtype: i32, output: bool, i: usize) -> String {
    match (dtype, output) {
        (8, false) => format!("const char *const *input_{i}"),
        (8, true) => format!("const char **output_{i}"),
        (d, false) => format!("const {} *input_{i}", ctype(d)),
        (d, true) => format!("{} *output_{i}", ctype(d)),
    }
}

/// The per-model C header.
pub fn header(
    prefix: &str,
    inputs: &[TensorDesc],
    outputs: &[TensorDesc],
    arena: u64,
    triple: &str,
    features: &[String],
) -> String {
    let up = prefix.to_ascii_uppercase();
    let mut h = String::new();
    let _ = writeln!(
        h,
        "/* Generated by onnxc {}: the C API of model `{prefix}`.",
        env!("CARGO_PKG_VERSION")
    );
    let _ = writeln!(
        h,
        " * Target: {triple} ({}).",
        if features.is_empty() {
            "baseline".to_string()
        } else {
            features.join(", ")
        }
    );
    let _ = writeln!(h, " *");
    let _ = writeln!(h, " * Call {prefix}_cpu_supported() once before the first run: it returns 1 when this CPU has");
    let _ = writeln!(h, " * every feature the code was compiled for (on aarch64 the target's features are assumed).");
    if features.iter().any(|f| f == "amx-int8") {
        let _ = writeln!(h, " * 8-bit products run on the AMX tiles: Linux (5.16+) lets a process use the tiles once it");
        let _ = writeln!(h, " * asks (arch_prctl), which {prefix}_cpu_supported() and each tile kernel do; a process the");
        let _ = writeln!(
            h,
            " * kernel refuses stops at the first tile instruction (SIGILL)."
        );
    }
    let _ = writeln!(h, " * {prefix}_run() is reentrant: it allocates nothing, writes no globals and takes no locks;");
    let _ = writeln!(h, " * the caller provides {up}_ARENA_BYTES of scratch aligned to {up}_ARENA_ALIGN bytes, and two");
    let _ = writeln!(h, " * threads with two arenas may run at once. It returns 0 (ONNXC_OK) or a status code for a");
    let _ = writeln!(h, " * null (1) or misaligned (2) pointer. The code calls only libm's float functions (link -lm). */");
    let _ = writeln!(h, "#ifndef {up}_H\n#define {up}_H\n");
    let _ = writeln!(h, "#include <stdint.h>\n#include \"onnxc_runtime.h\"\n");
    let _ = writeln!(h, "#ifdef __cplusplus\nextern \"C\" {{\n#endif\n");
    let _ = writeln!(h, "#define {up}_ARENA_BYTES {arena}ull");
    let _ = writeln!(h, "#define {up}_ARENA_ALIGN {ARENA_ALIGN}");
    let _ = writeln!(h, "#define {up}_NUM_INPUTS {}", inputs.len());
    let _ = writeln!(h, "#define {up}_NUM_OUTPUTS {}\n", outputs.len());
    for (kind, ts) in [("INPUT", inputs), ("OUTPUT", outputs)] {
        for (i, t) in ts.iter().enumerate() {
            let shape: Vec<String> = t.shape.iter().map(|d| d.to_string()).collect();
            let _ = writeln!(
                h,
                "/* {kind} {i}: `{}` {}[{}]{} */",
                t.name,
                ctype(t.dtype),
                shape.join("x"),
                match (t.dtype, kind) {
                    (8, "INPUT") => ": NUL-terminated UTF-8 strings, read only",
                    (8, _) => ": pointers to input strings or to constants in the object",
                    _ => "",
                }
            );
            let _ = writeln!(
                h,
                "#define {up}_{kind}_{i}_NAME \"{}\"",
                t.name.replace('\\', "\\\\").replace('"', "\\\"")
            );
            let _ = writeln!(h, "#define {up}_{kind}_{i}_DTYPE {}", t.dtype);
            let _ = writeln!(h, "#define {up}_{kind}_{i}_RANK {}", t.shape.len());
            let _ = writeln!(
                h,
                "#define {up}_{kind}_{i}_SHAPE {{{}}}",
                if shape.is_empty() {
                    "0".into()
                } else {
                    shape.join(", ")
                }
            );
            let _ = writeln!(
                h,
                "#define {up}_{kind}_{i}_ELEMS {}",
                t.shape.iter().product::<u64>()
            );
            let _ = writeln!(h, "#define {up}_{kind}_{i}_BYTES {}\n", t.bytes);
        }
    }
    let mut params: Vec<String> = Vec::new();
    for (i, t) in inputs.iter().enumerate() {
        params.push(c_param(t.dtype, false, i));
    }
    for (i, t) in outputs.iter().enumerate() {
        params.push(c_param(t.dtype, true, i));
    }
    params.push("void *arena".into());
    let _ = writeln!(h, "/* Inputs and outputs in graph order. */");
    let _ = writeln!(h, "int32_t {prefix}_run({});", params.join(", "));
    let _ = writeln!(
        h,
        "/* The same with arrays of pointers (the descriptor's entry point). */"
    );
    let _ = writeln!(
        h,
        "int32_t {prefix}_run_v(const void *const *inputs, void *const *outputs, void *arena);"
    );
    let _ = writeln!(
        h,
        "/* The same on the application's threads: large GEMMs and convolutions are cut into parts\n * that threads->parallel_for runs (see onnxc_runtime.h, onnxc_pool.h); NULL runs serially. */"
    );
    let _ = writeln!(
        h,
        "int32_t {prefix}_run_parallel(const void *const *inputs, void *const *outputs, void *arena,\n                              const onnxc_threads_t *threads);"
    );
    let _ = writeln!(h, "int32_t {prefix}_cpu_supported(void);");
    let _ = writeln!(
        h,
        "/* Names, dtypes, shapes, arena size and entry point, for generic harnesses. */"
    );
    let _ = writeln!(h, "extern const onnxc_model_t {prefix}_model;\n");
    let _ = writeln!(h, "#ifdef __cplusplus\n}}\n#endif\n#endif");
    h
}
