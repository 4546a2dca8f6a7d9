//! Runs compiled models: links an object with the generic C harness (`runner.c`, driven
//! by the model's descriptor) using the system C compiler, or `aarch64-linux-gnu-gcc`
//! plus `qemu-aarch64-static` for aarch64, and exchanges tensors as raw files.

use crate::driver::Compiled;
use crate::error::{Error, Result};
use crate::ir::{Tensor, Value};
use std::path::{Path, PathBuf};
use std::process::Command;

pub const RUNNER_C: &str = include_str!("runner.c");
pub const RUNTIME_H: &str = include_str!("../../../runtime-stub/include/onnxc_runtime.h");
pub const POOL_H: &str = include_str!("../../../runtime-stub/include/onnxc_pool.h");

/// How to build and run programs for one architecture.
#[derive(Clone, Debug)]
pub struct Toolchain {
    pub cc: String,
    /// Prefix command to run a binary (e.g. qemu), empty for native.
    pub exec: Vec<String>,
}

impl Toolchain {
    pub fn for_triple(triple: &str) -> Toolchain {
        let host_arch = std::env::consts::ARCH;
        if triple.starts_with(host_arch) {
            Toolchain {
                cc: std::env::var("CC").unwrap_or_else(|_| "cc".into()),
                exec: vec![],
            }
        } else if triple.starts_with("aarch64") {
            Toolchain {
                cc: "aarch64-linux-gnu-gcc".into(),
                exec: vec![
                    "qemu-aarch64-static".into(),
                    "-L".into(),
                    "/usr/aarch64-linux-gnu".into(),
                ],
            }
        } else {
            Toolchain {
                cc: "cc".into(),
                exec: vec![],
            }
        }
    }

    /// True when the compiler (and emulator) can be found.
    pub fn available(&self) -> bool {
        let found = |c: &str| {
            Command::new("sh")
                .arg("-c")
                .arg(format!("command -v {c}"))
                .output()
                .is_ok_and(|o| o.status.success())
        };
        found(&self.cc) && self.exec.first().is_none_or(|e| found(e))
    }
}

pub(crate) fn io(path: &Path) -> impl Fn(std::io::Error) -> Error + '_ {
    move |e| Error::Io {
        path: path.to_path_buf(),
        source: e,
    }
}

/// Runs a command; its standard output, or an error naming `what` with both streams.
pub(crate) fn run_cmd(cmd: &mut Command, what: &str) -> Result<String> {
    let out = cmd
        .output()
        .map_err(|e| Error::Usage(format!("{what}: cannot start {:?}: {e}", cmd.get_program())))?;
    if !out.status.success() {
        return Err(Error::Usage(format!(
            "{what} failed ({}):\n{}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Reads the raw output tensors `DIR/out_K.bin` a harness wrote.
pub(crate) fn read_outputs(
    dir: &Path,
    outputs: &[(crate::ir::DType, Vec<usize>)],
) -> Result<Vec<Tensor>> {
    let mut res = Vec::new();
    for (k, (dt, shape)) in outputs.iter().enumerate() {
        let p = dir.join(format!("out_{k}.bin"));
        let bytes = std::fs::read(&p).map_err(io(&p))?;
        let n: usize = shape.iter().product();
        if *dt == crate::ir::DType::Str {
            res.push(read_strings(&bytes, shape, n, k)?);
            continue;
        }
        res.push(crate::onnx::tensor::from_raw(
            *dt,
            shape,
            n,
            &bytes,
            &format!("output {k}"),
        )?);
    }
    Ok(res)
}

/// A string output as the harness writes it: `n` NUL-terminated strings in a row.
fn read_strings(bytes: &[u8], shape: &[usize], n: usize, k: usize) -> Result<Tensor> {
    let mut parts: Vec<String> = bytes
        .split(|&b| b == 0)
        .map(|s| String::from_utf8_lossy(s).into_owned())
        .collect();
    // The last NUL leaves an empty piece after it.
    if parts.pop().is_none_or(|last| !last.is_empty()) || parts.len() != n {
        return Err(Error::Usage(format!(
            "output {k}: expected {n} NUL-terminated strings from the harness"
        )));
    }
    let a = ndarray::ArrayD::from_shape_vec(ndarray::IxDyn(shape), parts)
        .map_err(|e| Error::Usage(format!("output {k}: {e}")))?;
    Ok(Tensor::from_array(a))
}

/// Compiles the harness for a model prefix into `dir/runner.o`.
pub fn build_harness(tc: &Toolchain, dir: &Path, prefix: &str) -> Result<PathBuf> {
    std::fs::write(dir.join("runner.c"), RUNNER_C).map_err(io(dir))?;
    std::fs::write(dir.join("onnxc_runtime.h"), RUNTIME_H).map_err(io(dir))?;
    std::fs::write(dir.join("onnxc_pool.h"), POOL_H).map_err(io(dir))?;
    let obj = dir.join("runner.o");
    run_cmd(
        Command::new(&tc.cc)
            .arg("-O1")
            .arg("-c")
            .arg(format!("-DONNXC_MODEL={prefix}_model"))
            .arg("-I")
            .arg(dir)
            .arg(dir.join("runner.c"))
            .arg("-o")
            .arg(&obj),
        "compiling the C harness",
    )?;
    Ok(obj)
}

/// Links `model.o` with the harness into an executable.
pub fn link(tc: &Toolchain, harness: &Path, object: &Path, exe: &Path) -> Result<()> {
    run_cmd(
        Command::new(&tc.cc)
            .arg(harness)
            .arg(object)
            .arg("-lm")
            .arg("-pthread")
            .arg("-o")
            .arg(exe),
        "linking",
    )
    .map(|_| ())
}

/// Runs a linked model on tensors; returns its outputs.
pub fn execute(
    tc: &Toolchain,
    exe: &Path,
    dir: &Path,
    inputs: &[Tensor],
    outputs: &[(crate::ir::DType, Vec<usize>)],
) -> Result<Vec<Tensor>> {
    execute_threads(tc, exe, dir, inputs, outputs, 1)
}

/// [`execute`] on `threads` threads (the harness's onnxc_pool.h pool and `run_parallel`
/// when above 1).
pub fn execute_threads(
    tc: &Toolchain,
    exe: &Path,
    dir: &Path,
    inputs: &[Tensor],
    outputs: &[(crate::ir::DType, Vec<usize>)],
    threads: usize,
) -> Result<Vec<Tensor>> {
    for (k, t) in inputs.iter().enumerate() {
        let bytes = crate::ops::lowering::tensor_bytes(t).map_err(|e| Error::Usage(e.0))?;
        let p = dir.join(format!("in_{k}.bin"));
        std::fs::write(&p, bytes).map_err(io(&p))?;
    }
    let mut cmd = if tc.exec.is_empty() {
        Command::new(exe)
    } else {
        let mut c = Command::new(&tc.exec[0]);
        c.args(&tc.exec[1..]).arg(exe);
        c
    };
    run_cmd(
        cmd.arg(dir).env("ONNXC_THREADS", threads.to_string()),
        "running the compiled model",
    )?;
    read_outputs(dir, outputs)
}

/// Compiles, links and runs a compiled model once in a scratch folder.
pub fn run_compiled(c: &Compiled, inputs: &[Value], dir: &Path) -> Result<Vec<Value>> {
    run_compiled_threads(c, inputs, dir, 1)
}

/// [`run_compiled`] on `threads` threads.
pub fn run_compiled_threads(
    c: &Compiled,
    inputs: &[Value],
    dir: &Path,
    threads: usize,
) -> Result<Vec<Value>> {
    let tc = Toolchain::for_triple(&c.target.triple);
    let obj = dir.join("model.o");
    std::fs::write(&obj, &c.artifacts.object).map_err(io(&obj))?;
    let harness = build_harness(&tc, dir, &c.prefix)?;
    let exe = dir.join("model.exe");
    link(&tc, &harness, &obj, &exe)?;
    let ins: Vec<Tensor> = inputs
        .iter()
        .map(|v| {
            v.as_tensor()
                .cloned()
                .ok_or_else(|| Error::Usage("compiled models take tensors only".into()))
        })
        .collect::<Result<_>>()?;
    let outs: Vec<(crate::ir::DType, Vec<usize>)> = c
        .graph
        .outputs
        .iter()
        .map(|&o| {
            let ty = &c.graph.value(o).ty;
            (
                ty.dtype().expect("tensor"),
                ty.static_shape().expect("static"),
            )
        })
        .collect();
    Ok(execute_threads(&tc, &exe, dir, &ins, &outs, threads)?
        .into_iter()
        .map(Value::Tensor)
        .collect())
}
