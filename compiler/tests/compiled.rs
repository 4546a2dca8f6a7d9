//! The native back end: compiled node tests (x86_64 natively, aarch64 under
//! qemu-aarch64-static), fixture models against ONNX Runtime, no heap allocation inside
//! `PREFIX_run`, valgrind memcheck, deterministic objects, and the arena against its
//! lower bound.

mod common;

use onnxc::conformance::{counts, run_suite_compiled, CompiledEnv, Status};
use onnxc::driver::{compile_file, Options};
use onnxc::ir::Value;
use onnxc::{eval, io, onnx, runner};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

fn node_cases() -> PathBuf {
    let d = common::repo_root().join("tests/onnx-node");
    assert!(
        d.join("COUNT").is_file(),
        "node test cases missing: run tests/run.sh (it generates them)"
    );
    d
}

/// Runs the compiled node tests for `target` and enforces its pass list.
fn compiled_suite(target: &str, list: &str) {
    let root = common::repo_root();
    let scratch = tempfile::tempdir().unwrap();
    let env = CompiledEnv::new(target, scratch.path()).unwrap_or_else(|e| {
        panic!("{e}; tests/run.sh installs gcc-aarch64-linux-gnu and qemu-user-static")
    });
    let threads = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let results = run_suite_compiled(&node_cases(), None, &env, threads).unwrap();
    let (p, f, u) = counts(&results);
    println!(
        "node tests compiled for {target}: {p} passed, {f} failed, {u} unsupported of {}",
        results.len()
    );
    let failed: Vec<String> = results
        .iter()
        .filter_map(|r| match &r.status {
            Status::Failed(w) => Some(format!("{}: {w}", r.name)),
            _ => None,
        })
        .collect();
    assert!(
        failed.is_empty(),
        "compiled cases give wrong results or crash:\n{}",
        failed.join("\n")
    );
    let text =
        std::fs::read_to_string(root.join("tests/conformance").join(list)).expect("pass list");
    let must: BTreeSet<&str> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    let lost: Vec<&str> = results
        .iter()
        .filter(|r| must.contains(r.name.as_str()) && r.status != Status::Passed)
        .map(|r| r.name.as_str())
        .collect();
    assert!(
        lost.is_empty(),
        "compiled cases that no longer pass on {target}: {lost:?}"
    );
    let doc = std::fs::read_to_string(root.join("docs/conformance.md")).unwrap();
    let stated = format!("compiled for {target}: **{p} of {} passed**", results.len());
    assert!(
        doc.contains(&stated),
        "docs/conformance.md should state `{stated}`; run `bash tests/conformance.sh --write`"
    );
}

#[test]
fn node_tests_compiled_host() {
    compiled_suite("host", "compiled-host-pass.txt");
}

#[test]
fn node_tests_compiled_aarch64_qemu() {
    compiled_suite("aarch64-neon", "compiled-aarch64-neon-pass.txt");
}

fn digits() -> PathBuf {
    common::repo_root().join("examples/digits/model.onnx")
}

#[test]
fn objects_are_deterministic() {
    let a = compile_file(&digits(), &Options::default()).unwrap();
    let b = compile_file(&digits(), &Options::default()).unwrap();
    assert_eq!(
        a.artifacts.object, b.artifacts.object,
        "two compiles of one model differ"
    );
    assert_eq!(a.artifacts.header, b.artifacts.header);
}

/// The symbols an object leaves undefined.
fn undefined_symbols(obj: &Path) -> Vec<String> {
    let out = Command::new("nm")
        .arg("-u")
        .arg(obj)
        .output()
        .expect("nm (binutils) runs");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().last().map(str::to_string))
        .collect()
}

const C_NO_HEAP: &str = r#"
#include <stdio.h>
#include <stdlib.h>
#include "digits.h"
static int counting, calls;
void *__real_malloc(size_t); void *__real_calloc(size_t, size_t); void *__real_realloc(void *, size_t);
void *__wrap_malloc(size_t n) { if (counting) calls++; return __real_malloc(n); }
void *__wrap_calloc(size_t a, size_t b) { if (counting) calls++; return __real_calloc(a, b); }
void *__wrap_realloc(void *p, size_t n) { if (counting) calls++; return __real_realloc(p, n); }
static unsigned char arena[DIGITS_ARENA_BYTES + 1] __attribute__((aligned(64)));
int main(void) {
    float x[DIGITS_INPUT_0_ELEMS], y[DIGITS_OUTPUT_0_ELEMS];
    for (int i = 0; i < DIGITS_INPUT_0_ELEMS; i++) x[i] = (float)(i % 7) / 7.0f;
    counting = 1;
    int s = digits_run(x, y, arena);
    counting = 0;
    /* Status codes, never aborts: null and misaligned pointers. */
    int s_null = digits_run(NULL, y, arena);
    int s_mis = DIGITS_ARENA_BYTES ? digits_run(x, y, arena + 1) : 2;
    printf("%d %d %d %d\n", s, calls, s_null, s_mis);
    return 0;
}
"#;

#[test]
fn no_heap_allocation_in_run_and_only_libm_imports() {
    let d = tempfile::tempdir().unwrap();
    let c = compile_file(
        &digits(),
        &Options {
            name: Some("digits".into()),
            ..Options::default()
        },
    )
    .unwrap();
    let obj = d.path().join("digits.o");
    std::fs::write(&obj, &c.artifacts.object).unwrap();
    std::fs::write(d.path().join("digits.h"), &c.artifacts.header).unwrap();
    std::fs::write(d.path().join("onnxc_runtime.h"), runner::RUNTIME_H).unwrap();
    std::fs::write(d.path().join("main.c"), C_NO_HEAP).unwrap();
    let libm = [
        "expf", "logf", "powf", "sinf", "cosf", "tanf", "asinf", "acosf", "atanf", "sinhf",
        "coshf", "tanhf", "asinhf", "acoshf", "atanhf", "erff", "fmodf", "exp", "log", "pow",
        "sin", "cos", "tan", "asin", "acos", "atan", "sinh", "cosh", "tanh", "asinh", "acosh",
        "atanh", "erf", "fmod",
    ];
    for s in undefined_symbols(&obj) {
        assert!(
            libm.contains(&s.as_str()),
            "the object imports `{s}`, which is not a libm function"
        );
    }
    let exe = d.path().join("nohea");
    let st = Command::new("cc")
        .args([
            "-O1",
            "-Wl,--wrap=malloc,--wrap=calloc,--wrap=realloc",
            "-I",
        ])
        .arg(d.path())
        .arg(d.path().join("main.c"))
        .arg(&obj)
        .args(["-lm", "-o"])
        .arg(&exe)
        .status()
        .unwrap();
    assert!(st.success());
    let out = Command::new(&exe).output().unwrap();
    let s = String::from_utf8_lossy(&out.stdout);
    let v: Vec<i32> = s.split_whitespace().map(|x| x.parse().unwrap()).collect();
    assert_eq!(
        v,
        vec![0, 0, 1, 2],
        "status, allocations during run, null status, misaligned status: {s}"
    );
}

#[test]
fn valgrind_memcheck_on_compiled_models() {
    let have = Command::new("valgrind")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(have, "valgrind is needed (tests/run.sh installs it)");
    let root = common::repo_root();
    let models = [
        digits(),
        root.join("tests/fixtures/resnet_tiny/model.onnx"),
        root.join("tests/onnx-node/test_gemm_default_matrix_bias/model.onnx"),
    ];
    for m in models {
        let model = onnx::load(&m).unwrap();
        let shapes: Vec<(String, Vec<usize>)> = model
            .graph
            .inputs
            .iter()
            .map(|&i| {
                let ty = &model.graph.value(i).ty;
                let s = match &ty {
                    onnxc::ir::ValueType::Tensor { shape: Some(s), .. } => s
                        .iter()
                        .map(|d| {
                            if let onnxc::ir::Dim::Fixed(n) = d {
                                *n
                            } else {
                                1
                            }
                        })
                        .collect(),
                    _ => vec![],
                };
                (model.graph.value(i).name.clone(), s)
            })
            .collect();
        let c = onnxc::driver::compile_graph(
            model.graph,
            "model",
            // valgrind emulates a CPU without AVX-512: compile for a baseline it implements.
            &Options {
                shapes,
                target: "x86_64-sse4".into(),
                ..Options::default()
            },
        )
        .unwrap();
        let d = tempfile::tempdir().unwrap();
        let tc = runner::Toolchain::for_triple(&c.target.triple);
        let obj = d.path().join("model.o");
        std::fs::write(&obj, &c.artifacts.object).unwrap();
        let h = runner::build_harness(&tc, d.path(), "model").unwrap();
        let exe = d.path().join("model.exe");
        runner::link(&tc, &h, &obj, &exe).unwrap();
        for (k, &i) in c.graph.inputs.iter().enumerate() {
            let ty = &c.graph.value(i).ty;
            let t = onnxc::ir::Tensor::zeros(ty.dtype().unwrap(), &ty.static_shape().unwrap());
            std::fs::write(
                d.path().join(format!("in_{k}.bin")),
                onnxc::ops::lowering::tensor_bytes(&t).unwrap(),
            )
            .unwrap();
        }
        let out = Command::new("valgrind")
            .args(["--error-exitcode=9", "--quiet", "--leak-check=no"])
            .arg(&exe)
            .arg(d.path())
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "valgrind reports errors for {}:\n{}",
            m.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

fn rel_err(a: &Value, b: &Value) -> f64 {
    let (a, b) = (
        a.as_tensor().unwrap().to_f64().unwrap(),
        b.as_tensor().unwrap().to_f64().unwrap(),
    );
    let diff = a
        .iter()
        .zip(b.iter())
        .map(|(x, y)| common::abs_diff(*x, *y))
        .fold(0.0, f64::max);
    diff / b.iter().map(|y| y.abs()).fold(0.0, f64::max).max(1e-30)
}

/// Fixture models compiled for `target` match the reference evaluator (itself checked
/// against ONNX Runtime in tests/fixtures.rs) within 1e-4, and the arena is within 10%
/// of its lower bound.
fn fixtures_compiled(target: &str) {
    let dir = common::repo_root().join("tests/fixtures");
    let mut names: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.join("model.onnx").is_file())
        .collect();
    names.sort();
    names.push(common::repo_root().join("examples/digits"));
    let mut tasks = 0;
    for d in names {
        let name = d.file_name().unwrap().to_string_lossy().to_string();
        let model = onnx::load(&d.join("model.onnx")).unwrap();
        let inputs: Vec<Value> = (0..)
            .map(|k| d.join(format!("input_{k}.npy")))
            .take_while(|p| p.is_file())
            .map(|p| Value::Tensor(io::from_npy(&std::fs::read(p).unwrap(), "input").unwrap()))
            .collect();
        let inputs = if inputs.is_empty() {
            vec![Value::Tensor(
                io::from_npy(&std::fs::read(d.join("digit_7.npy")).unwrap(), "digit").unwrap(),
            )]
        } else {
            inputs
        };
        let expected = eval::run(&model.graph, inputs.clone()).unwrap();
        let shapes = model
            .graph
            .inputs
            .iter()
            .zip(&inputs)
            .map(|(&i, v)| {
                (
                    model.graph.value(i).name.clone(),
                    v.as_tensor().unwrap().shape().to_vec(),
                )
            })
            .collect();
        // Every loop that qualifies goes to the threads, small as these models are.
        let opts = Options {
            target: target.into(),
            shapes,
            min_program_work: 0,
            ..Options::default()
        };
        let c = onnxc::driver::compile_graph(model.graph, "model", &opts)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let scratch = tempfile::tempdir().unwrap();
        let got = runner::run_compiled(&c, &inputs, scratch.path())
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        // On a pool of 2 and 3 threads (parallel loops and split GEMMs through the
        // parallel_for hook) the outputs are bit for bit the serial ones.
        let bits = |vs: &[Value]| -> Vec<Vec<u64>> {
            vs.iter()
                .map(|v| {
                    let t = v.as_tensor().unwrap().to_f64().unwrap();
                    t.iter().map(|x| x.to_bits()).collect()
                })
                .collect()
        };
        for threads in [2, 3] {
            let dir = scratch.path().join(format!("t{threads}"));
            std::fs::create_dir_all(&dir).unwrap();
            let par = runner::run_compiled_threads(&c, &inputs, &dir, threads)
                .unwrap_or_else(|e| panic!("{name} on {threads} threads: {e}"));
            assert!(
                bits(&par) == bits(&got),
                "{name} on {target}: {threads} threads differ from the serial run"
            );
        }
        tasks += c
            .artifacts
            .object
            .windows(5)
            .filter(|w| *w == b"_task")
            .count();
        for (k, (g, e)) in got.iter().zip(&expected).enumerate() {
            let err = rel_err(g, e);
            println!("{name} [{target}] output {k}: relative error {err:.2e}");
            assert!(
                err <= 1e-4,
                "{name} output {k} on {target}: relative error {err:.3e}"
            );
        }
        let plan = &c.lowered.plan;
        println!(
            "{name}: arena {} bytes, lower bound {}",
            plan.arena_bytes, plan.lower_bound
        );
        assert!(
            plan.arena_bytes as f64 <= plan.lower_bound as f64 * 1.10,
            "{name}: arena {} is more than 10% above the lower bound {}",
            plan.arena_bytes,
            plan.lower_bound
        );
    }
    // Else the threaded runs above never left the calling thread.
    assert!(
        tasks > 0,
        "no fixture has a parallel task function on {target}"
    );
}

#[test]
fn fixtures_compiled_host() {
    fixtures_compiled("host");
}

#[test]
fn fixtures_compiled_aarch64_qemu() {
    fixtures_compiled("aarch64-neon");
}

/// The C thread pool (runtime-stub/include/onnxc_pool.h) runs every index of every job
/// exactly once, with that job's task and context, on 1 to 4 threads, for jobs of 1 to 40
/// indices (fewer than the threads included), 20,000 jobs per pool, the jobs alternating
/// between two tasks on two contexts: its per-thread shares and the taking of what is
/// left of the others' must neither skip nor repeat an index, and a worker still in a
/// finished job must not run an index of the next with the old task.
#[test]
fn thread_pool_runs_every_index_once() {
    const PROG: &str = r#"
#include "onnxc_pool.h"
#include <stdio.h>
static atomic_uint cnt[2][64];
static atomic_uint wrong;
static void task_a(void *c, uint32_t i) { if (c != &cnt[0]) atomic_fetch_add(&wrong, 1u); atomic_fetch_add(&cnt[0][i], 1u); }
static void task_b(void *c, uint32_t i) { if (c != &cnt[1]) atomic_fetch_add(&wrong, 1u); atomic_fetch_add(&cnt[1][i], 1u); }
int main(void) {
  for (int th = 1; th <= 4; th++) {
    onnxc_pool_t *p = onnxc_pool_create(th);
    if (!p) return 2;
    for (int k = 0; k < 20000; k++) {
      uint32_t n = 1 + (uint32_t)(k % 40);
      int j = k & 1;
      for (uint32_t i = 0; i < 64; i++) atomic_store(&cnt[0][i], 0u), atomic_store(&cnt[1][i], 0u);
      onnxc_pool_parallel_for(p, j ? task_b : task_a, &cnt[j], n);
      for (uint32_t i = 0; i < 64; i++) {
        unsigned want = i < n ? 1u : 0u;
        if (atomic_load(&cnt[j][i]) != want || atomic_load(&cnt[1 - j][i]) != 0 || atomic_load(&wrong)) {
          printf("threads %d, job %d of %u: index %u ran %u times (other task %u, wrong context %u)\n",
                 th, k, n, i, atomic_load(&cnt[j][i]), atomic_load(&cnt[1 - j][i]), atomic_load(&wrong));
          return 1;
        }
      }
    }
    onnxc_pool_destroy(p);
  }
  return 0;
}
"#;
    let d = tempfile::tempdir().unwrap();
    let src = d.path().join("pool.c");
    let exe = d.path().join("pool");
    std::fs::write(&src, PROG).unwrap();
    let inc = common::repo_root().join("runtime-stub/include");
    let cc = Command::new("cc")
        .args([
            "-std=c11", "-O2", "-Wall", "-Wextra", "-Werror", "-pthread", "-I",
        ])
        .arg(&inc)
        .arg(&src)
        .arg("-o")
        .arg(&exe)
        .output()
        .unwrap();
    assert!(
        cc.status.success(),
        "{}",
        String::from_utf8_lossy(&cc.stderr)
    );
    let run = Command::new(&exe).output().unwrap();
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stdout)
    );
}

/// `onnxc bench --profile`: the harness runs the model kernel by kernel through the
/// kernel table, times every kernel, and the outputs of those runs (the last ones it
/// writes) match the reference evaluator on the bench's inputs.
#[test]
fn bench_profile_runs_every_kernel_in_order() {
    let dir = tempfile::tempdir().unwrap();
    let opts = onnxc::bench::BenchOptions {
        compile: Options::default(),
        threads: 2,
        iters: 3,
        warmup: 1,
        rounds: 1,
        with_ort: false,
        peak: false,
        dir: Some(dir.path().to_path_buf()),
        profile: 4,
    };
    let r = onnxc::bench::bench(&digits(), &opts).unwrap();
    let p = r.profile.as_ref().expect("a profile");
    assert_eq!(p.runs, 4);
    assert_eq!(p.onnxc.len(), r.kernels, "one time per kernel");
    let mut order: Vec<usize> = p
        .onnxc
        .iter()
        .map(|k| k.name[1..].split_once(' ').unwrap().0.parse().unwrap())
        .collect();
    order.sort_unstable();
    assert_eq!(order, (0..r.kernels).collect::<Vec<_>>());
    assert!(
        p.onnxc.windows(2).all(|w| w[0].ms >= w[1].ms),
        "longest first"
    );
    assert!(r.text().contains("onnxc kernels, mean of 4 profiled runs"));
    let input = io::from_npy(&std::fs::read(dir.path().join("in_0.npy")).unwrap(), "in").unwrap();
    let model = onnx::load(&digits()).unwrap();
    let want = eval::run(&model.graph, vec![Value::Tensor(input)]).unwrap();
    let bytes = std::fs::read(dir.path().join("out_0.bin")).unwrap();
    let got: Vec<f64> = bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]) as f64)
        .collect();
    let want = want[0].as_tensor().unwrap().to_f64().unwrap();
    let want: Vec<f64> = want.iter().copied().collect();
    assert_eq!(got.len(), want.len());
    let scale = want.iter().map(|y| y.abs()).fold(0.0, f64::max);
    let err = got
        .iter()
        .zip(&want)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max)
        / scale;
    assert!(err < 1e-4, "kernel-by-kernel outputs off by {err:.2e}");
}

/// `m` (named by its graph) compiled for `target` and run on `inputs` (aarch64 under
/// qemu), beside the reference evaluator's outputs: (compiled, got, want).
fn compiled_and_reference(
    scratch: &Path,
    m: &onnxc::onnx::proto::ModelProto,
    target: &str,
    inputs: &[Value],
) -> (onnxc::driver::Compiled, Vec<Value>, Vec<Value>) {
    let name = m
        .graph
        .as_ref()
        .and_then(|g| g.name.clone())
        .unwrap_or_default();
    let m = onnx::load(&common::write_model(scratch, &format!("{name}.onnx"), m)).unwrap();
    let want = eval::run(&m.graph, inputs.to_vec()).unwrap();
    let opts = Options {
        target: target.into(),
        ..Options::default()
    };
    let c = onnxc::driver::compile_graph(m.graph, "model", &opts)
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    let dir = scratch.join(format!("{name}_{target}"));
    std::fs::create_dir_all(&dir).unwrap();
    let got = runner::run_compiled(&c, inputs, &dir)
        .unwrap_or_else(|e| panic!("{name} on {target}: {e}"));
    (c, got, want)
}

/// `m` compiled for `target` with every loop that may go to threads going (small as a
/// test model is: `min_program_work` 0), run on two threads; and whether the object
/// has a task function (loops too small for threads stay serial even so).
fn on_two_threads(
    scratch: &Path,
    m: &onnxc::onnx::proto::ModelProto,
    target: &str,
    inputs: &[Value],
) -> (bool, Vec<Value>) {
    let name = m
        .graph
        .as_ref()
        .and_then(|g| g.name.clone())
        .unwrap_or_default();
    let m = onnx::load(&common::write_model(scratch, &format!("{name}_2t.onnx"), m)).unwrap();
    let opts = Options {
        target: target.into(),
        min_program_work: 0,
        ..Options::default()
    };
    let c = onnxc::driver::compile_graph(m.graph, "model", &opts)
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    let task = b"_task";
    let tasks = c.artifacts.object.windows(task.len()).any(|w| w == task);
    let dir = scratch.join(format!("{name}_{target}_2t"));
    std::fs::create_dir_all(&dir).unwrap();
    let got = runner::run_compiled_threads(&c, inputs, &dir, 2)
        .unwrap_or_else(|e| panic!("{name} on {target}, two threads: {e}"));
    (tasks, got)
}

/// A tensor's elements as f64 bits (every NaN one value, zeros by sign).
fn bits(v: &Value) -> Vec<u64> {
    let t = v.as_tensor().unwrap().to_f64().unwrap();
    t.iter()
        .map(|x| if x.is_nan() { u64::MAX } else { x.to_bits() })
        .collect()
}

/// The op types of a compiled model's optimized graph.
fn op_types(c: &onnxc::driver::Compiled) -> Vec<String> {
    c.graph
        .nodes
        .node_weights()
        .map(|n| n.op_type.clone())
        .collect()
}

/// A deterministic stream of 31-bit values (a linear congruential generator).
fn lcg(seed: u64) -> impl FnMut() -> i64 {
    let mut s = seed;
    move || {
        s = s
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (s >> 33) as i64
    }
}

/// An integer initializer of dtype `dt` (8- and 16-bit types are held in `int32_data`).
fn int_tensor(
    name: &str,
    dt: onnxc::onnx::proto::tensor_proto::DataType,
    dims: &[i64],
    v: &[i64],
) -> onnxc::onnx::proto::TensorProto {
    onnxc::onnx::proto::TensorProto {
        name: Some(name.into()),
        dims: dims.to_vec(),
        data_type: Some(dt as i32),
        int32_data: v.iter().map(|&x| x as i32).collect(),
        ..Default::default()
    }
}

/// TopK on long lanes (the outputs kept sorted while the lane is read, elements
/// inserted among them) against the reference evaluator, values bit for bit and indices
/// exactly, on the host and on aarch64 under qemu: f32 rows of 300 with many ties, NaNs,
/// a row of equal values, rows in ascending and descending order (every element
/// inserted, or none after the first k), signed zeros and infinities; k = 1, 7 and the
/// whole lane (a full sort), largest and smallest; a layout with the axis in the middle
/// (lanes 4 apart); and int64 rows.
#[test]
fn topk_on_long_lanes_matches_the_reference() {
    use common::{i64_tensor, int_attr, model, node, value_info};
    use onnxc::ir::Tensor;
    use onnxc::onnx::proto::tensor_proto::DataType;
    use onnxc::onnx::proto::GraphProto;
    let scratch = tempfile::tempdir().unwrap();
    let n = 300usize;
    let mut x = Vec::with_capacity(6 * n);
    let mut s = 12345u64;
    for row in 0..6 {
        for e in 0..n {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let r = ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0;
            x.push(match row {
                0 => (r * 8.0).round() / 8.0,
                1 if e % 37 == 5 => f32::NAN,
                1 => (r * 4.0).round() / 4.0,
                2 => 0.5,
                3 => e as f32 * 0.25 - 10.0,
                4 => 50.0 - e as f32 * 0.5,
                _ => match e % 5 {
                    0 => 0.0,
                    1 => -0.0,
                    2 => f32::INFINITY,
                    3 => f32::NEG_INFINITY,
                    _ => r,
                },
            });
        }
    }
    let xi: Vec<i64> = x
        .iter()
        .map(|v| if v.is_finite() { (v * 8.0) as i64 } else { 7 })
        .collect();
    // (name, input, shape, axis, k, largest)
    let mut cases: Vec<(String, Tensor, Vec<usize>, i64, usize, i64)> = Vec::new();
    for k in [1, 7, n] {
        for largest in [1, 0] {
            let t = Tensor::from_vec(&[6, n], x.clone());
            cases.push((
                format!("rows_k{k}_l{largest}"),
                t,
                vec![6, n],
                -1,
                k,
                largest,
            ));
        }
    }
    let lanes = Tensor::from_vec(&[3, 150, 4], x[..1800].to_vec());
    cases.push(("lanes_k6".into(), lanes, vec![3, 150, 4], 1, 6, 1));
    let ints = Tensor::from_vec(&[6, n], xi);
    cases.push(("int64_k9".into(), ints, vec![6, n], 1, 9, 0));
    let mut ran = 0;
    for target in ["host", "aarch64-neon"] {
        for (name, input, shape, axis, k, largest) in &cases {
            let float = !name.starts_with("int");
            let elem = if float {
                DataType::Float
            } else {
                DataType::Int64
            };
            let ax = axis.rem_euclid(shape.len() as i64) as usize;
            let mut out: Vec<i64> = shape.iter().map(|&d| d as i64).collect();
            out[ax] = *k as i64;
            let mut nd = node("TopK", &["x", "k"], &["y", "i"]);
            nd.attribute = vec![int_attr("axis", *axis), int_attr("largest", *largest)];
            let dims: Vec<i64> = shape.iter().map(|&d| d as i64).collect();
            let g = GraphProto {
                name: Some(name.clone()),
                node: vec![nd],
                input: vec![value_info("x", elem, &dims)],
                output: vec![
                    value_info("y", elem, &out),
                    value_info("i", DataType::Int64, &out),
                ],
                initializer: vec![i64_tensor("k", &[*k as i64])],
                ..Default::default()
            };
            let inputs = vec![Value::Tensor(input.clone())];
            let (_, got, want) = compiled_and_reference(scratch.path(), &model(g), target, &inputs);
            for (o, (g, w)) in got.iter().zip(&want).enumerate() {
                assert_eq!(bits(g), bits(w), "{name} output {o} on {target}");
            }
            ran += 1;
        }
    }
    assert_eq!(ran, 2 * cases.len());
}

/// Pad in reflect, edge and wrap modes with constant pads: the interior copied by a loop
/// nest and only the border positions through index tables (the output less the input),
/// bit for bit the reference's on the host and on aarch64 under qemu; pads on the
/// batch and channel axes too, a rank-3 input, and pads that crop (negative: all through
/// the tables, no interior kernel).
#[test]
fn pad_modes_copy_the_interior_and_tabulate_the_borders() {
    use common::{i64_tensor, model, node, value_info};
    use onnxc::ir::Tensor;
    use onnxc::onnx::proto::tensor_proto::DataType;
    use onnxc::onnx::proto::{AttributeProto, GraphProto};
    let scratch = tempfile::tempdir().unwrap();
    // (mode, opset, input shape, pads, output shape)
    type PadCase = (&'static str, i64, Vec<usize>, Vec<i64>, Vec<usize>);
    let cases: [PadCase; 5] = [
        (
            "reflect",
            18,
            vec![1, 6, 11, 10],
            vec![0, 0, 1, 1, 0, 0, 1, 1],
            vec![1, 6, 13, 12],
        ),
        (
            "edge",
            18,
            vec![2, 3, 7, 9],
            vec![0, 1, 2, 3, 1, 0, 1, 2],
            vec![3, 4, 10, 14],
        ),
        (
            "wrap",
            19,
            vec![1, 4, 6, 5],
            vec![0, 0, 2, 1, 0, 0, 1, 3],
            vec![1, 4, 9, 9],
        ),
        (
            "reflect",
            18,
            vec![5, 8, 9],
            vec![1, 0, 2, 2, 3, 1],
            vec![8, 11, 12],
        ),
        (
            "reflect",
            18,
            vec![2, 3, 7, 9],
            vec![0, 0, -1, 2, 0, 0, 1, -2],
            vec![2, 3, 7, 9],
        ),
    ];
    let mut ran = 0;
    for target in ["host", "aarch64-neon"] {
        for (ci, (mode, opset, shape, pads, out)) in cases.iter().enumerate() {
            let name = format!("pad_{mode}_{ci}");
            let mut nd = node("Pad", &["x", "p"], &["y"]);
            nd.attribute = vec![AttributeProto {
                name: Some("mode".into()),
                r#type: Some(3),
                s: Some(mode.as_bytes().to_vec()),
                ..Default::default()
            }];
            let d = |s: &[usize]| s.iter().map(|&v| v as i64).collect::<Vec<i64>>();
            let g = GraphProto {
                name: Some(name.clone()),
                node: vec![nd],
                input: vec![value_info("x", DataType::Float, &d(shape))],
                output: vec![value_info("y", DataType::Float, &d(out))],
                initializer: vec![i64_tensor("p", pads)],
                ..Default::default()
            };
            let mut m = model(g);
            m.opset_import[0].version = Some(*opset);
            let len: usize = shape.iter().product();
            let x: Vec<f32> = (0..len).map(|i| i as f32 * 0.5 - 7.0).collect();
            let inputs = vec![Value::Tensor(Tensor::from_vec(shape, x))];
            let (c, got, want) = compiled_and_reference(scratch.path(), &m, target, &inputs);
            let crops = pads.iter().any(|&p| p < 0);
            let interior = c
                .lowered
                .program
                .kernels
                .iter()
                .any(|k| k.name.ends_with("/interior"));
            assert_eq!(interior, !crops, "{name}: interior kernel");
            let out_len: u64 = out.iter().product::<usize>() as u64;
            for b in &c.lowered.program.buffers {
                if b.name.ends_with("/pos") && !crops {
                    assert_eq!(b.len, out_len - len as u64, "{name}: not the borders alone");
                }
            }
            assert_eq!(bits(&got[0]), bits(&want[0]), "{name} on {target}");
            ran += 1;
        }
    }
    assert_eq!(ran, 10);
}

/// Bytes through the vector loops: Cast u8 / i8 -> f32 of every value, Cast f32 -> u8 /
/// i8 (truncation toward zero, then the low byte) of values at the edges (halves, the
/// type's ends and past them, 2^31, 2^63, infinities, NaN), QuantizeLinear f32 -> u8 /
/// i8 (ties to even, saturation, NaN) and DequantizeLinear u8 / i8 -> f32, each at a
/// length with a partial last vector. Every target's bytes must be the first target's,
/// and the reference evaluator's wherever ONNX defines the result (Cast of a value
/// within the type's range). On x86_64-avx512 the loops must be AVX-512 ones (byte
/// streams: vpmovzxbd / vpmovsxbd, vcvttps2dq and vpmovdb); x86_64-sse4 and
/// aarch64-neon (under qemu) take the f32x4 code, which stores bytes lane by lane.
#[test]
fn byte_streams_convert_as_the_reference() {
    use common::{f32_tensor, model, node, value_info};
    use onnxc::ir::Tensor;
    use onnxc::onnx::proto::tensor_proto::DataType;
    use onnxc::onnx::proto::{AttributeProto, GraphProto};
    let scratch = tempfile::tempdir().unwrap();
    let one = |name: &str, op: &str, ins: &[&str], from: DataType, to: DataType, n: usize| {
        let mut nd = node(op, ins, &["y"]);
        let mut inits = Vec::new();
        if op == "Cast" {
            nd.attribute = vec![AttributeProto {
                name: Some("to".into()),
                r#type: Some(2),
                i: Some(to as i64),
                ..Default::default()
            }];
        } else {
            let zdt = if op == "QuantizeLinear" { to } else { from };
            let z = if zdt == DataType::Uint8 { 128 } else { -3 };
            inits.push(f32_tensor("s", &[], &[0.25]));
            inits.push(int_tensor("z", zdt, &[], &[z]));
        }
        let mut m = model(GraphProto {
            name: Some(name.into()),
            node: vec![nd],
            input: vec![value_info("x", from, &[n as i64])],
            output: vec![value_info("y", to, &[n as i64])],
            initializer: inits,
            ..Default::default()
        });
        m.opset_import[0].version = Some(13);
        m
    };
    let mut x: Vec<f32> = vec![
        0.0,
        -0.0,
        0.5,
        -0.5,
        0.99,
        -0.99,
        1.5,
        2.5,
        -2.5,
        31.875,
        32.125,
        127.0,
        127.9,
        128.0,
        -128.0,
        -128.9,
        -129.0,
        255.0,
        255.9,
        256.0,
        257.0,
        -1.0,
        1e10,
        -1e10,
        2147483648.0,
        -2147483648.0,
        4294967296.0,
        9.2e18,
        9.223372e18,
        -9.223372e18,
        1e19,
        3.4e38,
        -3.4e38,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        -f32::NAN,
    ];
    let mut next = lcg(17);
    while x.len() < 16 * 9 + 7 {
        x.push((next() % 200_000) as f32 / 256.0 - 390.0);
    }
    let n = x.len();
    let u: Vec<u8> = (0..=255u8).chain(0..=255).chain([7, 8, 9]).collect();
    let i8s: Vec<i8> = u.iter().map(|&b| b as i8).collect();
    let (u_in, i8_in) = (
        Value::Tensor(Tensor::from_vec(&[u.len()], u.clone())),
        Value::Tensor(Tensor::from_vec(&[u.len()], i8s)),
    );
    let x_in = Value::Tensor(Tensor::from_vec(&[n], x.clone()));
    let mut first: std::collections::HashMap<String, Vec<u64>> = Default::default();
    let mut ran = 0;
    for target in ["host", "x86_64-sse4", "aarch64-neon"] {
        let wide = target == "host" && std::arch::is_x86_feature_detected!("avx512bw");
        let has_wide = |c: &onnxc::driver::Compiled| {
            c.artifacts.object.windows(12).any(|w| w == b"model__wide0")
        };
        let cases = [
            ("u8_to_f32", "Cast", DataType::Uint8, DataType::Float),
            ("i8_to_f32", "Cast", DataType::Int8, DataType::Float),
            ("f32_to_u8", "Cast", DataType::Float, DataType::Uint8),
            ("f32_to_i8", "Cast", DataType::Float, DataType::Int8),
            (
                "quantize_u8",
                "QuantizeLinear",
                DataType::Float,
                DataType::Uint8,
            ),
            (
                "quantize_i8",
                "QuantizeLinear",
                DataType::Float,
                DataType::Int8,
            ),
            (
                "dequantize_u8",
                "DequantizeLinear",
                DataType::Uint8,
                DataType::Float,
            ),
            (
                "dequantize_i8",
                "DequantizeLinear",
                DataType::Int8,
                DataType::Float,
            ),
        ];
        for (case, op, from, to) in cases {
            let input = match from {
                DataType::Uint8 => &u_in,
                DataType::Int8 => &i8_in,
                _ => &x_in,
            };
            let len = input.as_tensor().unwrap().len();
            let ins: &[&str] = if op == "Cast" {
                &["x"]
            } else {
                &["x", "s", "z"]
            };
            let m = one(case, op, ins, from, to, len);
            let (c, got, want) =
                compiled_and_reference(scratch.path(), &m, target, std::slice::from_ref(input));
            assert_eq!(has_wide(&c), wide, "{case} on {target}: AVX-512 loop");
            let (g, w) = (bits(&got[0]), bits(&want[0]));
            let firsts = first.entry(case.to_string()).or_insert_with(|| g.clone());
            assert!(
                *firsts == g,
                "{case} on {target}: other bytes than the first target's"
            );
            for i in 0..len {
                // Cast to bytes is defined within the type's range only, QuantizeLinear
                // of all but NaN.
                let defined = match (op, to) {
                    ("Cast", DataType::Uint8) => x[i] > -1.0 && x[i] < 256.0,
                    ("Cast", DataType::Int8) => x[i] > -129.0 && x[i] < 128.0,
                    ("QuantizeLinear", _) => !x[i].is_nan(),
                    _ => true,
                };
                if defined {
                    assert_eq!(g[i], w[i], "{case} of element {i} on {target}");
                }
            }
        }
        ran += 1;
    }
    assert_eq!(ran, 3);
}

/// Max pools of u8 and i8 values (a QDQ model's pools once `quantized_max_pool` has
/// taken their DequantizeLinear and QuantizeLinear away): 3x3 stride 2 with pads and
/// ceil mode (the column phases read every other byte), 2x2 stride 2 and 3x3 stride 1,
/// on planes whose rows end in partial vectors; every byte value in the input. Bit for
/// bit against the reference evaluator on every target, and on the host on two threads
/// too (the planes in parts, each part's column phases in a scratch slot of its own);
/// on an AVX-512 host the pools are AVX-512 loops.
#[test]
fn byte_max_pools_match_the_reference() {
    use common::{int_attr, ints_attr, model, node, value_info};
    use onnxc::ir::Tensor;
    use onnxc::onnx::proto::tensor_proto::DataType;
    use onnxc::onnx::proto::GraphProto;
    let scratch = tempfile::tempdir().unwrap();
    let (c, h, w) = (24usize, 23usize, 37usize);
    // (name, kernel, strides, pads, ceil_mode)
    type Pool = (&'static str, [i64; 2], [i64; 2], [i64; 4], i64);
    let pools: [Pool; 3] = [
        ("s2", [3, 3], [2, 2], [1, 1, 1, 1], 1),
        ("k2", [2, 2], [2, 2], [0, 0, 0, 0], 0),
        ("s1", [3, 3], [1, 1], [1, 1, 1, 1], 0),
    ];
    let mut ran = 0;
    for target in ["host", "x86_64-sse4", "aarch64-neon"] {
        let wide = target == "host" && std::arch::is_x86_feature_detected!("avx512bw");
        for dt in [DataType::Uint8, DataType::Int8] {
            for (name, k, st, pads, ceil) in pools {
                let out = |i: usize, d: usize| {
                    let span = i as i64 + pads[d] + pads[d + 2] - k[d];
                    let q = if ceil == 1 {
                        span.div_euclid(st[d]) + i64::from(span.rem_euclid(st[d]) != 0)
                    } else {
                        span.div_euclid(st[d])
                    };
                    q + 1
                };
                let (oh, ow) = (out(h, 0), out(w, 1));
                let mut nd = node("MaxPool", &["x"], &["y"]);
                nd.attribute = vec![
                    ints_attr("kernel_shape", &k),
                    ints_attr("strides", &st),
                    ints_attr("pads", &pads),
                    int_attr("ceil_mode", ceil),
                ];
                let case = format!("maxpool_{name}_{}", dt.as_str_name().to_lowercase());
                let mut m = model(GraphProto {
                    name: Some(case.clone()),
                    node: vec![nd],
                    input: vec![value_info("x", dt, &[1, c as i64, h as i64, w as i64])],
                    output: vec![value_info("y", dt, &[1, c as i64, oh, ow])],
                    ..Default::default()
                });
                m.opset_import[0].version = Some(13);
                let n = c * h * w;
                let x = match dt {
                    DataType::Uint8 => Value::Tensor(Tensor::from_vec(
                        &[1, c, h, w],
                        (0..n).map(|i| (i * 37 % 256) as u8).collect(),
                    )),
                    _ => Value::Tensor(Tensor::from_vec(
                        &[1, c, h, w],
                        (0..n).map(|i| (i * 37 % 256) as u8 as i8).collect(),
                    )),
                };
                let (cm, got, want) =
                    compiled_and_reference(scratch.path(), &m, target, std::slice::from_ref(&x));
                let has_wide = cm
                    .artifacts
                    .object
                    .windows(12)
                    .any(|w| w == b"model__wide0");
                assert_eq!(has_wide, wide, "{case} on {target}: AVX-512 loop");
                assert_eq!(bits(&got[0]), bits(&want[0]), "{case} on {target}");
                if target == "host" {
                    let (tasks, got2) =
                        on_two_threads(scratch.path(), &m, target, std::slice::from_ref(&x));
                    assert!(tasks, "{case}: the planes go to threads");
                    assert_eq!(bits(&got2[0]), bits(&want[0]), "{case}, two threads");
                }
            }
        }
        ran += 1;
    }
    assert_eq!(ran, 3);
}

/// f64 through the AVX-512 f64 loops (8 lanes): Cast f64 -> u8 / i8 (truncation toward
/// zero, then the low byte) of values at the edges (halves, the types' ends and past
/// them, 2^31, 2^63 and past it, the largest f64, infinities, NaN); u8, i8 and i32 ->
/// f64 (exact); a chain of f64 arithmetic and rounding; Clip and Where (selects and
/// comparisons); each at a length with a partial last vector. Then QLinearMatMul (u8
/// out, a scale per column) and QLinearConv (i8 out, a bias and a scale per channel),
/// whose requantization the reference computes in f64, alone, dequantized and scaled
/// (f32 arithmetic in the f64 loop, each operation rounded to f32), and into a depthwise
/// QLinearConv (whose f32 input conversion joins the requantization's loop); f32
/// arithmetic on f64 values cast to f32; bytes cast from f64 then to f32;
/// BatchNormalization in training mode (f64 statistics, f32 rows with partial last
/// vectors, the store's mask). Every target's bits must be the
/// first's (x86_64-sse4: scalar f64 code), and the reference evaluator's wherever ONNX
/// defines the result. On an AVX-512 host the f64 kernels must be AVX-512 loops.
#[test]
fn f64_loops_compute_as_the_reference() {
    use common::{model, node, value_info};
    use onnxc::ir::Tensor;
    use onnxc::onnx::proto::tensor_proto::DataType;
    use onnxc::onnx::proto::{AttributeProto, GraphProto, NodeProto, TensorProto};
    let scratch = tempfile::tempdir().unwrap();
    let f64_tensor = |name: &str, dims: &[i64], v: &[f64]| TensorProto {
        name: Some(name.into()),
        dims: dims.to_vec(),
        data_type: Some(DataType::Double as i32),
        double_data: v.to_vec(),
        ..Default::default()
    };
    let f32_scalar = common::f32_tensor;
    let cast = |to: DataType, out: &str| {
        let mut nd = node("Cast", &["x"], &[out]);
        nd.attribute = vec![AttributeProto {
            name: Some("to".into()),
            r#type: Some(2),
            i: Some(to as i64),
            ..Default::default()
        }];
        nd
    };
    let graph = |name: &str, nodes: Vec<_>, inputs: Vec<_>, out: (DataType, Vec<i64>), inits| {
        let mut m = model(GraphProto {
            name: Some(name.into()),
            node: nodes,
            input: inputs,
            output: vec![value_info("y", out.0, &out.1)],
            initializer: inits,
            ..Default::default()
        });
        m.opset_import[0].version = Some(13);
        m
    };
    let mut x: Vec<f64> = vec![
        0.0,
        -0.0,
        0.5,
        -0.5,
        0.99,
        -0.99,
        1.5,
        2.5,
        -2.5,
        127.0,
        127.9,
        128.0,
        -128.0,
        -128.9,
        -129.0,
        255.0,
        255.9,
        256.0,
        257.0,
        2147483648.0,
        -2147483649.0,
        4294967296.5,
        9007199254740993.0,
        9.223372036854775e18,
        9.223372036854776e18,
        -9.223372036854776e18,
        1e19,
        -1e19,
        f64::MAX,
        f64::MIN,
        f64::INFINITY,
        f64::NEG_INFINITY,
        f64::NAN,
        -f64::NAN,
    ];
    let mut next = lcg(23);
    while x.len() < 8 * 11 + 5 {
        x.push((next() % 400_000) as f64 / 512.0 - 390.0);
    }
    let n = x.len() as i64;
    let x_in = Value::Tensor(Tensor::from_vec(&[x.len()], x.clone()));
    let xv = || vec![value_info("x", DataType::Double, &[n])];
    let u: Vec<u8> = (0..=255u8).chain([7, 8, 9]).collect();
    let nu = u.len() as i64;
    let i8s: Vec<i8> = u.iter().map(|&b| b as i8).collect();
    let i32s: Vec<i32> = (0..nu as i32)
        .map(|i| i.wrapping_mul(-1_234_567_891).wrapping_add(i))
        .collect();
    // Cast(x, f64) * 0.37
    let mul_c = |name: &str, from: DataType| {
        graph(
            name,
            vec![
                cast(DataType::Double, "d"),
                node("Mul", &["d", "c"], &["y"]),
            ],
            vec![value_info("x", from, &[nu])],
            (DataType::Double, vec![nu]),
            vec![f64_tensor("c", &[], &[0.37])],
        )
    };
    // Floor(x) + Ceil(x) * -x / Sqrt(|x|) - Round(x)
    let chain = graph(
        "f64_chain",
        vec![
            node("Floor", &["x"], &["f"]),
            node("Ceil", &["x"], &["c"]),
            node("Neg", &["x"], &["ng"]),
            node("Abs", &["x"], &["a"]),
            node("Sqrt", &["a"], &["s"]),
            node("Round", &["x"], &["r"]),
            node("Mul", &["c", "ng"], &["m"]),
            node("Div", &["m", "s"], &["d"]),
            node("Add", &["f", "d"], &["p"]),
            node("Sub", &["p", "r"], &["y"]),
        ],
        xv(),
        (DataType::Double, vec![n]),
        vec![],
    );
    let clip = graph(
        "f64_clip",
        vec![node("Clip", &["x", "lo", "hi"], &["y"])],
        xv(),
        (DataType::Double, vec![n]),
        vec![
            f64_tensor("lo", &[], &[-3.25]),
            f64_tensor("hi", &[], &[200.5]),
        ],
    );
    let where_ = graph(
        "f64_where",
        vec![
            node("Greater", &["x", "t"], &["g"]),
            node("Neg", &["x"], &["ng"]),
            node("Where", &["g", "x", "ng"], &["y"]),
        ],
        xv(),
        (DataType::Double, vec![n]),
        vec![f64_tensor("t", &[], &[0.5])],
    );
    // QLinearMatMul: 13 x 24 by 24 x 21 (u8), b's scale and zero point per column.
    let (m_, k_, n_) = (13usize, 24usize, 21usize);
    let a: Vec<u8> = (0..m_ * k_).map(|_| (next() % 256) as u8).collect();
    let b: Vec<i64> = (0..k_ * n_).map(|_| next() % 256).collect();
    let bs: Vec<f32> = (0..n_).map(|j| 0.002 + 0.0007 * j as f32).collect();
    let bz: Vec<i64> = (0..n_ as i64).map(|j| 100 + j).collect();
    let mut qmm = node(
        "QLinearMatMul",
        &["x", "as", "az", "b", "bs", "bz", "ys", "yz"],
        &["y"],
    );
    qmm.name = Some("qmm".into());
    let qmm = graph(
        "f64_qlinear_matmul",
        vec![qmm],
        vec![value_info("x", DataType::Uint8, &[m_ as i64, k_ as i64])],
        (DataType::Uint8, vec![m_ as i64, n_ as i64]),
        vec![
            f32_scalar("as", &[], &[0.05]),
            int_tensor("az", DataType::Uint8, &[], &[117]),
            int_tensor("b", DataType::Uint8, &[k_ as i64, n_ as i64], &b),
            f32_scalar("bs", &[n_ as i64], &bs),
            int_tensor("bz", DataType::Uint8, &[n_ as i64], &bz),
            f32_scalar("ys", &[], &[0.3]),
            int_tensor("yz", DataType::Uint8, &[], &[131]),
        ],
    );
    // QLinearConv: 8 -> 12 channels 3x3 (pads 1) on 7 x 9 (i8), a bias, a scale per
    // output channel.
    let (ci, co, h, w) = (8usize, 12usize, 7usize, 9usize);
    let xq: Vec<i8> = (0..ci * h * w)
        .map(|_| (next() % 256 - 128) as i8)
        .collect();
    let wq: Vec<i64> = (0..co * ci * 9).map(|_| next() % 255 - 127).collect();
    let ws: Vec<f32> = (0..co).map(|j| 0.001 + 0.0003 * j as f32).collect();
    let bias: Vec<i64> = (0..co as i64).map(|j| j * 997 - 5000).collect();
    let mut qc = node(
        "QLinearConv",
        &["x", "xs", "xz", "w", "ws", "wz", "ys", "yz", "bias"],
        &["y"],
    );
    qc.attribute = vec![common::ints_attr("pads", &[1, 1, 1, 1])];
    let qc = graph(
        "f64_qlinear_conv",
        vec![qc],
        vec![value_info(
            "x",
            DataType::Int8,
            &[1, ci as i64, h as i64, w as i64],
        )],
        (DataType::Int8, vec![1, co as i64, h as i64, w as i64]),
        vec![
            f32_scalar("xs", &[], &[0.04]),
            int_tensor("xz", DataType::Int8, &[], &[-3]),
            int_tensor("w", DataType::Int8, &[co as i64, ci as i64, 3, 3], &wq),
            f32_scalar("ws", &[co as i64], &ws),
            int_tensor("wz", DataType::Int8, &[co as i64], &vec![0; co]),
            f32_scalar("ys", &[], &[0.2]),
            int_tensor("yz", DataType::Int8, &[], &[5]),
            int_tensor("bias", DataType::Int32, &[co as i64], &bias),
        ],
    );
    // The same conv's output dequantized and scaled (f32 arithmetic on the requantized
    // bytes: the f64 loop rounds each f32 operation to f32), and fed to a depthwise
    // QLinearConv (whose input conversion joins the requantization's loop).
    let to = |i: &str, o: &str, dt: DataType| {
        let mut nd = node("Cast", &[i], &[o]);
        nd.attribute = vec![common::int_attr("to", dt as i64)];
        nd
    };
    let conv_then =
        |name: &str, mut tail: Vec<NodeProto>, out: DataType, inits: Vec<TensorProto>| {
            let mut g = qc.clone();
            let gp = g.graph.as_mut().unwrap();
            gp.name = Some(name.into());
            gp.node[0].output = vec!["q".into()];
            gp.node.append(&mut tail);
            gp.output[0] = value_info("y", out, &[1, co as i64, h as i64, w as i64]);
            gp.initializer.extend(inits);
            g
        };
    let qc_dq = conv_then(
        "f64_qlinear_conv_dq",
        vec![
            node("DequantizeLinear", &["q", "ys", "yz"], &["d"]),
            node("Mul", &["d", "k"], &["p"]),
            node("Add", &["p", "k"], &["y"]),
        ],
        DataType::Float,
        vec![f32_scalar("k", &[], &[0.7013])],
    );
    let mut dw = node(
        "QLinearConv",
        &["q", "ys", "yz", "w2", "ws2", "wz2", "ys2", "yz2"],
        &["y"],
    );
    dw.attribute = vec![
        common::ints_attr("pads", &[1, 1, 1, 1]),
        common::int_attr("group", co as i64),
    ];
    let w2: Vec<i64> = (0..co * 9).map(|_| next() % 255 - 127).collect();
    let qc_dw = conv_then(
        "f64_qlinear_conv_depthwise",
        vec![dw],
        DataType::Int8,
        vec![
            int_tensor("w2", DataType::Int8, &[co as i64, 1, 3, 3], &w2),
            f32_scalar("ws2", &[], &[0.013]),
            int_tensor("wz2", DataType::Int8, &[], &[0]),
            f32_scalar("ys2", &[], &[0.11]),
            int_tensor("yz2", DataType::Int8, &[], &[-7]),
        ],
    );
    // Cast(Cast(x, u8 / i8), f32) * 0.37: the bytes of f64 lanes, as f32.
    let bytes_f32 = |name: &str, dt: DataType| {
        graph(
            name,
            vec![
                to("x", "b", dt),
                to("b", "f", DataType::Float),
                node("Mul", &["f", "c"], &["y"]),
            ],
            xv(),
            (DataType::Float, vec![n]),
            vec![f32_scalar("c", &[], &[0.37])],
        )
    };
    // f32 arithmetic on f64 values cast to f32, each operation rounded to f32:
    // ((f32(x) * 1.1 + 0.3) / 0.7 - 3) * 1.1 on values of full f64 mantissas.
    let f32_chain = graph(
        "f64_f32_chain",
        vec![
            to("x", "f", DataType::Float),
            node("Mul", &["f", "a"], &["m"]),
            node("Add", &["m", "b"], &["s"]),
            node("Div", &["s", "c"], &["d"]),
            node("Sub", &["d", "e"], &["t"]),
            node("Mul", &["t", "a"], &["y"]),
        ],
        vec![value_info("x", DataType::Double, &[3, n / 3])],
        (DataType::Float, vec![3, n / 3]),
        vec![
            f32_scalar("a", &[], &[1.1]),
            f32_scalar("b", &[], &[0.3]),
            f32_scalar("c", &[], &[0.7]),
            f32_scalar("e", &[], &[3.0]),
        ],
    );
    let x_full: Vec<f64> = (0..n)
        .map(|i| (i as f64 - 40.0) / 3.0 + 1e-9 * i as f64)
        .collect();
    // Rows of 31: each row's last vector is partial (a store past it would overwrite the
    // next row's first elements).
    let x_full = Value::Tensor(Tensor::from_vec(&[3, x_full.len() / 3], x_full));
    // BatchNormalization in training mode (statistics in f64): rows of 20 with partial
    // last vectors, visited so that a store past a row's end would land on a row
    // written before (row 0 of channel 2 is followed by row 1 of channel 0).
    let mut bn = node(
        "BatchNormalization",
        &["x", "s", "b", "m", "v"],
        &["y", "", ""],
    );
    bn.attribute = vec![common::int_attr("training_mode", 1)];
    let bn = graph(
        "f64_batchnorm_training",
        vec![bn],
        vec![value_info("x", DataType::Float, &[2, 3, 4, 5])],
        (DataType::Float, vec![2, 3, 4, 5]),
        vec![
            f32_scalar("s", &[3], &[1.5, 0.7, -2.0]),
            f32_scalar("b", &[3], &[0.1, -0.3, 0.2]),
            f32_scalar("m", &[3], &[0.0, 0.5, -1.0]),
            f32_scalar("v", &[3], &[1.0, 2.0, 0.5]),
        ],
    );
    let bn_in = Value::Tensor(Tensor::from_vec(
        &[2, 3, 4, 5],
        (0..120)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
            .collect::<Vec<f32>>(),
    ));
    let u_in = Value::Tensor(Tensor::from_vec(&[u.len()], u.clone()));
    let i8_in = Value::Tensor(Tensor::from_vec(&[u.len()], i8s));
    let i32_in = Value::Tensor(Tensor::from_vec(&[u.len()], i32s));
    let a_in = Value::Tensor(Tensor::from_vec(&[m_, k_], a));
    let xq_in = Value::Tensor(Tensor::from_vec(&[1, ci, h, w], xq));
    // (name, model, input, where the result is defined: everywhere, or for the Casts to
    // bytes where x[i] is within the type's range)
    type Defined = Option<fn(f64) -> bool>;
    let all: Defined = None;
    let cases: Vec<(&str, onnxc::onnx::proto::ModelProto, &Value, Defined)> = vec![
        (
            "f64_to_u8",
            graph(
                "f64_to_u8",
                vec![cast(DataType::Uint8, "y")],
                xv(),
                (DataType::Uint8, vec![n]),
                vec![],
            ),
            &x_in,
            Some(|v| v > -1.0 && v < 256.0),
        ),
        (
            "f64_to_i8",
            graph(
                "f64_to_i8",
                vec![cast(DataType::Int8, "y")],
                xv(),
                (DataType::Int8, vec![n]),
                vec![],
            ),
            &x_in,
            Some(|v| v > -129.0 && v < 128.0),
        ),
        ("u8_to_f64", mul_c("u8_to_f64", DataType::Uint8), &u_in, all),
        ("i8_to_f64", mul_c("i8_to_f64", DataType::Int8), &i8_in, all),
        (
            "i32_to_f64",
            mul_c("i32_to_f64", DataType::Int32),
            &i32_in,
            all,
        ),
        ("f64_chain", chain, &x_in, all),
        ("f64_clip", clip, &x_in, all),
        ("f64_where", where_, &x_in, all),
        ("f64_qlinear_matmul", qmm, &a_in, all),
        ("f64_qlinear_conv", qc, &xq_in, all),
        ("f64_f32_chain", f32_chain, &x_full, all),
        ("f64_batchnorm_training", bn, &bn_in, all),
        ("f64_qlinear_conv_dq", qc_dq, &xq_in, all),
        ("f64_qlinear_conv_depthwise", qc_dw, &xq_in, all),
        (
            "f64_u8_f32",
            bytes_f32("f64_u8_f32", DataType::Uint8),
            &x_in,
            Some(|v| v > -1.0 && v < 256.0),
        ),
        (
            "f64_i8_f32",
            bytes_f32("f64_i8_f32", DataType::Int8),
            &x_in,
            Some(|v| v > -129.0 && v < 128.0),
        ),
    ];
    let mut first: std::collections::HashMap<String, Vec<u64>> = Default::default();
    let mut ran = 0;
    for target in ["x86_64-sse4", "host", "aarch64-neon"] {
        let wide = target == "host"
            && std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512dq");
        for (case, m, input, defined) in &cases {
            let (c, got, want) =
                compiled_and_reference(scratch.path(), m, target, std::slice::from_ref(*input));
            let has_wide = c.artifacts.object.windows(12).any(|w| w == b"model__wide0");
            // An AVX2 host (no AVX-512) runs the f32 parts' loops as AVX2 ones.
            let avx2_loops = target == "host"
                && !std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma");
            if !avx2_loops {
                assert_eq!(has_wide, wide, "{case} on {target}: AVX-512 loop");
            }
            let (g, w) = (bits(&got[0]), bits(&want[0]));
            let firsts = first.entry(case.to_string()).or_insert_with(|| g.clone());
            assert!(
                *firsts == g,
                "{case} on {target}: other bits than x86_64-sse4's"
            );
            for i in 0..g.len() {
                if defined.is_none_or(|d| d(x[i])) {
                    assert_eq!(g[i], w[i], "{case}: element {i} on {target}");
                }
            }
        }
        ran += 1;
    }
    assert_eq!(ran, 3);
}

/// Casts join the elementwise kernels around them when their target is its own compute
/// type (u8 -> f32 here, and f16 -> f32), and a Cast to f16 (whose rounding in between
/// a fused kernel would skip) stays a kernel of its own: `Cast(Cast(((f32(x) - 3) *
/// 0.1), f16), f32) + 1`, on the host and aarch64 under qemu, bit for bit against the
/// reference evaluator.
#[test]
fn casts_fuse_into_elementwise_kernels_unless_they_round() {
    use common::{f32_tensor, int_attr, model, node, value_info};
    use onnxc::ir::Tensor;
    use onnxc::onnx::proto::tensor_proto::DataType;
    use onnxc::onnx::proto::GraphProto;
    let scratch = tempfile::tempdir().unwrap();
    let cast = |i: &str, o: &str, to: DataType| {
        let mut n = node("Cast", &[i], &[o]);
        n.attribute = vec![int_attr("to", to as i64)];
        n
    };
    let n = 16 * 7 + 3;
    let g = GraphProto {
        name: Some("cast_chain".into()),
        node: vec![
            cast("x", "xf", DataType::Float),
            node("Sub", &["xf", "three"], &["d"]),
            node("Mul", &["d", "tenth"], &["p"]),
            cast("p", "h", DataType::Float16),
            cast("h", "hf", DataType::Float),
            node("Add", &["hf", "one"], &["y"]),
        ],
        input: vec![value_info("x", DataType::Uint8, &[n])],
        output: vec![value_info("y", DataType::Float, &[n])],
        initializer: vec![
            f32_tensor("three", &[], &[3.0]),
            f32_tensor("tenth", &[], &[0.1]),
            f32_tensor("one", &[], &[1.0]),
        ],
        ..Default::default()
    };
    let x: Vec<u8> = (0..n as usize).map(|i| (i * 37 % 256) as u8).collect();
    let inputs = vec![Value::Tensor(Tensor::from_vec(&[n as usize], x))];
    for target in ["host", "aarch64-neon"] {
        let (c, got, want) =
            compiled_and_reference(scratch.path(), &model(g.clone()), target, &inputs);
        let mut ops = op_types(&c);
        ops.sort();
        assert_eq!(ops, ["Cast", "Fused", "Fused"], "on {target}");
        assert_eq!(bits(&got[0]), bits(&want[0]), "on {target}");
    }
}

/// f16 through the vector loops: Cast f32 -> f16 of values chosen at the rounding edges
/// (ties to even, the largest finite f16 and the first value past it, subnormal results
/// and their ties, signed zeros, infinities, NaNs with payloads), Cast f16 -> f32 of
/// every f16 bit pattern, and an f16 Mul (exact in f32, so one rounding), each at a
/// length with a partial last vector, against the reference evaluator: bit for bit, NaN
/// for NaN with its sign. On x86_64-avx512 the loops must be AVX-512 ones (f16 streams:
/// vcvtph2ps, vcvtps2ph); x86_64-sse4 and aarch64-neon (under qemu) take the f32x4 code,
/// which stores f16 lane by lane.
#[test]
fn f16_streams_round_and_widen_as_the_reference() {
    use common::{model, node, value_info};
    use half::f16;
    use onnxc::ir::Tensor;
    use onnxc::onnx::proto::tensor_proto::DataType;
    use onnxc::onnx::proto::{AttributeProto, GraphProto};
    let scratch = tempfile::tempdir().unwrap();
    // f16 bits, NaN as one value per sign.
    let hbits = |t: &Tensor| -> Vec<u16> {
        t.array::<f16>()
            .expect("an f16 output")
            .iter()
            .map(|h| {
                if h.is_nan() {
                    0x7e00 | (h.to_bits() & 0x8000)
                } else {
                    h.to_bits()
                }
            })
            .collect()
    };
    let fbits = |t: &Tensor| -> Vec<u32> {
        t.array::<f32>()
            .expect("an f32 output")
            .iter()
            .map(|x| {
                if x.is_nan() {
                    0x7fc0_0000 | (x.to_bits() & 0x8000_0000)
                } else {
                    x.to_bits()
                }
            })
            .collect()
    };
    let cast = |name: &str, from: DataType, to: DataType, n: usize| {
        let mut nd = node("Cast", &["x"], &["y"]);
        nd.attribute = vec![AttributeProto {
            name: Some("to".into()),
            r#type: Some(2),
            i: Some(to as i64),
            ..Default::default()
        }];
        model(GraphProto {
            name: Some(name.into()),
            node: vec![nd],
            input: vec![value_info("x", from, &[n as i64])],
            output: vec![value_info("y", to, &[n as i64])],
            ..Default::default()
        })
    };
    // Cast f32 -> f16: the edges, then a spread of magnitudes; 16 k + 13 elements.
    let ulp = |x: f32, k: i32| f32::from_bits((x.to_bits() as i32 + k) as u32);
    let mut x: Vec<f32> = vec![
        0.0,
        -0.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        -f32::NAN,
        f32::from_bits(0x7f80_0001),
        f32::from_bits(0xffa1_2345),
        65504.0,
        65519.996,
        65520.0,
        -65520.0,
        1.0 + 1.0 / 2048.0,
        1.0 + 3.0 / 2048.0,
        ulp(1.0 + 1.0 / 2048.0, 1),
        ulp(1.0 + 1.0 / 2048.0, -1),
        2f32.powi(-24),
        2f32.powi(-25),
        ulp(2f32.powi(-25), 1),
        3.0 * 2f32.powi(-25),
        -5.0 * 2f32.powi(-25),
        2f32.powi(-14),
        ulp(2f32.powi(-14), -1),
        1e-30,
        -1e-45,
        3.4e38,
    ];
    let mut s = 99u64;
    while x.len() < 16 * 20 + 13 {
        s = s
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let m = ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0;
        let e = ((s >> 8) % 48) as i32 - 30;
        x.push(m * 2f32.powi(e));
    }
    let n = x.len();
    // Every f16 bit pattern, 65536 = 16 k: one more element for a masked tail.
    let all: Vec<f16> = (0..=0xffffu32)
        .chain([0x3c01])
        .map(|b| f16::from_bits(b as u16))
        .collect();
    let na = all.len();
    // Raw output bits per case from the first target: the others must match them
    // (NaN payloads included).
    let mut first: std::collections::HashMap<&str, Vec<u8>> = Default::default();
    let mut same_bits = |case: &'static str, target: &str, t: &Tensor| {
        let raw: Vec<u8> = match t.data() {
            onnxc::ir::Data::F16(a) => a.iter().flat_map(|h| h.to_bits().to_le_bytes()).collect(),
            onnxc::ir::Data::F32(a) => a.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect(),
            _ => panic!("{case}: not f16 or f32"),
        };
        let want = first.entry(case).or_insert_with(|| raw.clone());
        assert!(
            *want == raw,
            "{case} on {target}: other bits than the first target's"
        );
    };
    let mut ran = 0;
    for target in ["host", "x86_64-sse4", "aarch64-neon"] {
        let wide = target == "host" && std::arch::is_x86_feature_detected!("avx512f");
        let has_wide = |c: &onnxc::driver::Compiled| {
            c.artifacts.object.windows(12).any(|w| w == b"model__wide0")
        };
        // f32 -> f16.
        let m = cast("cast_to_f16", DataType::Float, DataType::Float16, n);
        let inputs = vec![Value::Tensor(Tensor::from_vec(&[n], x.clone()))];
        let (c, got, want) = compiled_and_reference(scratch.path(), &m, target, &inputs);
        assert_eq!(has_wide(&c), wide, "cast_to_f16 on {target}: AVX-512 loop");
        let (g, w) = (got[0].as_tensor().unwrap(), want[0].as_tensor().unwrap());
        same_bits("cast_to_f16", target, g);
        for (i, (a, b)) in hbits(g).iter().zip(hbits(w)).enumerate() {
            assert_eq!(
                *a,
                b,
                "f32 -> f16 of {:e} ({:#x}) on {target}",
                x[i],
                x[i].to_bits()
            );
        }
        // f16 -> f32.
        let m = cast("cast_from_f16", DataType::Float16, DataType::Float, na);
        let inputs = vec![Value::Tensor(Tensor::from_vec(&[na], all.clone()))];
        let (c, got, want) = compiled_and_reference(scratch.path(), &m, target, &inputs);
        assert_eq!(
            has_wide(&c),
            wide,
            "cast_from_f16 on {target}: AVX-512 loop"
        );
        let (g, w) = (got[0].as_tensor().unwrap(), want[0].as_tensor().unwrap());
        same_bits("cast_from_f16", target, g);
        for (i, (a, b)) in fbits(g).iter().zip(fbits(w)).enumerate() {
            assert_eq!(*a, b, "f16 {:#x} -> f32 on {target}", all[i].to_bits());
        }
        // An f16 product: every pattern times a value that moves it across the rounding
        // and overflow edges.
        let factors: Vec<f16> = (0..na)
            .map(|i| f16::from_f32([1.5, -0.75, 3.0, 1.0 / 3.0, 2048.0, 0.0][i % 6]))
            .collect();
        let g = GraphProto {
            name: Some("mul_f16".into()),
            node: vec![node("Mul", &["a", "b"], &["y"])],
            input: vec![
                value_info("a", DataType::Float16, &[na as i64]),
                value_info("b", DataType::Float16, &[na as i64]),
            ],
            output: vec![value_info("y", DataType::Float16, &[na as i64])],
            ..Default::default()
        };
        let inputs = vec![
            Value::Tensor(Tensor::from_vec(&[na], all.clone())),
            Value::Tensor(Tensor::from_vec(&[na], factors)),
        ];
        let (c, got, want) = compiled_and_reference(scratch.path(), &model(g), target, &inputs);
        assert_eq!(has_wide(&c), wide, "mul_f16 on {target}: AVX-512 loop");
        let (g, w) = (got[0].as_tensor().unwrap(), want[0].as_tensor().unwrap());
        same_bits("mul_f16", target, g);
        for (i, (a, b)) in hbits(g).iter().zip(hbits(w)).enumerate() {
            assert_eq!(
                *a,
                b,
                "f16 product {i} ({:#x}) on {target}",
                all[i].to_bits()
            );
        }
        ran += 1;
    }
    assert_eq!(ran, 3);
}

/// An f16 Conv (bias, pads), Relu and MatMul by a constant run on the f32 kernels
/// (the `widen_f16` pass: casts around them, the weights converted at compile time), on
/// the host and on aarch64 under qemu: within a unit in f16's last place (1e-3) of the
/// reference evaluator, which computes in f64 and rounds once per op.
#[test]
fn f16_convs_and_products_run_on_the_f32_kernels() {
    use common::{model, node, value_info};
    use half::f16;
    use onnxc::ir::{DType, Tensor};
    use onnxc::onnx::proto::tensor_proto::DataType;
    use onnxc::onnx::proto::{AttributeProto, GraphProto, TensorProto};
    let scratch = tempfile::tempdir().unwrap();
    let vals = |n: usize, seed: u64, scale: f32| -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                (((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0) * scale
            })
            .collect()
    };
    let half_tensor = |name: &str, dims: &[i64], v: &[f32]| TensorProto {
        name: Some(name.into()),
        dims: dims.to_vec(),
        data_type: Some(DataType::Float16 as i32),
        int32_data: v
            .iter()
            .map(|x| i32::from(f16::from_f32(*x).to_bits()))
            .collect(),
        ..Default::default()
    };
    let mut conv = node("Conv", &["x", "w", "b"], &["c"]);
    conv.attribute = vec![AttributeProto {
        name: Some("pads".into()),
        r#type: Some(7),
        ints: vec![1, 1, 1, 1],
        ..Default::default()
    }];
    let g = GraphProto {
        name: Some("f16_conv_matmul".into()),
        node: vec![
            conv,
            node("Relu", &["c"], &["r"]),
            node("MatMul", &["r", "m"], &["y"]),
        ],
        input: vec![value_info("x", DataType::Float16, &[1, 8, 10, 10])],
        output: vec![value_info("y", DataType::Float16, &[1, 16, 10, 6])],
        initializer: vec![
            half_tensor("w", &[16, 8, 3, 3], &vals(16 * 72, 5, 0.3)),
            half_tensor("b", &[16], &vals(16, 6, 1.0)),
            half_tensor("m", &[10, 6], &vals(60, 7, 0.5)),
        ],
        ..Default::default()
    };
    let m = model(g);
    let x: Vec<f16> = vals(800, 8, 2.0).into_iter().map(f16::from_f32).collect();
    let inputs = vec![Value::Tensor(Tensor::from_vec(&[1, 8, 10, 10], x))];
    for target in ["host", "aarch64-neon"] {
        let (c, got, want) = compiled_and_reference(scratch.path(), &m, target, &inputs);
        for n in c.graph.nodes.node_weights() {
            if matches!(n.op_type.as_str(), "Conv" | "MatMul") {
                for v in n.inputs.iter().flatten() {
                    assert_eq!(
                        c.graph.value(*v).ty.dtype(),
                        Some(DType::F32),
                        "{} on {target} reads f16",
                        n.op_type
                    );
                }
            }
        }
        let (g, w) = (got[0].as_tensor().unwrap(), want[0].as_tensor().unwrap());
        assert_eq!(g.dtype(), DType::F16);
        let e = onnxc::check::rel_err(g, w).unwrap();
        assert!(
            e <= 1e-3,
            "f16 conv and matmul on {target}: relative error {e:.2e}"
        );
    }
}

/// MatMulInteger by a constant int8 weight (per-column zero points) with a run-time
/// uint8 zero point for A, as dynamic quantization makes it: on the f32 GEMM (the
/// `widen_integer` pass, exact while the sums stay within 2^24), on the host and
/// on aarch64 under qemu, against the reference evaluator bit for bit; and a weight
/// whose sums could pass 2^24 as f32 products over ranges of K, summed in int32.
#[test]
fn integer_products_run_exactly_on_the_f32_gemm() {
    use common::{model, node, value_info};
    use onnxc::ir::Tensor;
    use onnxc::onnx::proto::tensor_proto::DataType;
    use onnxc::onnx::proto::GraphProto;
    let scratch = tempfile::tempdir().unwrap();
    let (m, k, n) = (37usize, 200usize, 45usize);
    let mut next = lcg(77);
    let int8 = |name: &str, dims: &[i64], v: &[i64]| int_tensor(name, DataType::Int8, dims, v);
    // Full-range weights, extremes included; column 0 all 127 and row 0 of A all 255,
    // so that one sum is large (200 x 124 x 130, past 2^21).
    let w: Vec<i64> = (0..k * n)
        .map(|i| match (i % n, i % 50) {
            (0, _) => 127,
            (_, 0) => -128,
            (_, 1) => 127,
            _ => next() % 256 - 128,
        })
        .collect();
    let zb: Vec<i64> = (0..n).map(|j| (j as i64 % 7) - 3).collect();
    let a: Vec<u8> = (0..m * k)
        .map(|i| match (i < k, i % 31) {
            (true, _) | (_, 1) => 255,
            (_, 0) => 0,
            _ => (next() % 256) as u8,
        })
        .collect();
    for (case, kk, wide) in [("mmi_exact", k, true), ("mmi_in_ranges", 600, false)] {
        let wv: Vec<i64> = if wide { w.clone() } else { vec![-128; kk * n] };
        let zv: Vec<i64> = if wide { zb.clone() } else { vec![127; n] };
        let g = GraphProto {
            name: Some(case.into()),
            node: vec![node("MatMulInteger", &["a", "b", "za", "zb"], &["y"])],
            input: vec![
                value_info("a", DataType::Uint8, &[m as i64, kk as i64]),
                value_info("za", DataType::Uint8, &[]),
            ],
            output: vec![value_info("y", DataType::Int32, &[m as i64, n as i64])],
            initializer: vec![
                int8("b", &[kk as i64, n as i64], &wv),
                int8("zb", &[n as i64], &zv),
            ],
            ..Default::default()
        };
        let av: Vec<u8> = (0..m * kk).map(|i| a[i % a.len()]).collect();
        let inputs = vec![
            Value::Tensor(Tensor::from_vec(&[m, kk], av)),
            Value::Tensor(Tensor::from_vec(&[], vec![131u8])),
        ];
        for target in ["host", "aarch64-neon"] {
            let (c, got, want) =
                compiled_and_reference(scratch.path(), &model(g.clone()), target, &inputs);
            let ops = op_types(&c);
            // |w - zb| = 255 by a run-time zero point: 258 rows of K per f32 product.
            let products = ops.iter().filter(|o| *o == "MatMul").count();
            assert_eq!(
                products,
                if wide { 1 } else { 3 },
                "{case} on {target}: {ops:?}"
            );
            let (g, w) = (got[0].as_tensor().unwrap(), want[0].as_tensor().unwrap());
            assert_eq!(g.array::<i32>(), w.array::<i32>(), "{case} on {target}");
            let top = w.array::<i32>().unwrap().iter().map(|v| v.abs()).max();
            assert!(top > Some(1 << 21), "{case}: small sums only");
        }
    }
}

/// Integer products on a target with 8-bit dot products (x86 AVX-512 VNNI): MatMulInteger
/// of u8 by a constant i8 weight stays an integer product and runs as the `vpdpbusd`
/// microkernel, bit for bit against the reference evaluator: A with batch dims folded
/// into 46 rows (a partial register tile), 45 columns (a masked vector), k = 2100 (two k
/// blocks), extremes of both operands and a run-time zero point for A; QLinearMatMul by
/// uint8 weights with zero point 128 (the weight less it fits i8) then requantizes. On
/// aarch64 under qemu both run on the f32 GEMM (the first, too wide for f32 to hold
/// exactly, over ranges of K summed in int32).
#[test]
fn int8_products_run_on_dot_product_kernels() {
    use common::{f32_tensor, model, node, value_info};
    use onnxc::ir::Tensor;
    use onnxc::onnx::proto::tensor_proto::DataType;
    use onnxc::onnx::proto::GraphProto;
    let scratch = tempfile::tempdir().unwrap();
    let mut next = lcg(2026);
    let (b2, m, k, n) = (2usize, 23usize, 2100usize, 45usize);
    let w: Vec<i64> = (0..k * n)
        .map(|i| match (i % n, i % 41) {
            (0, _) | (_, 1) => -128,
            (1, _) | (_, 2) => 127,
            _ => next() % 256 - 128,
        })
        .collect();
    let a: Vec<u8> = (0..b2 * m * k)
        .map(|i| match (i % (m * k) < k, i % 29) {
            (true, _) | (_, 1) => 255,
            (_, 0) => 0,
            _ => (next() % 256) as u8,
        })
        .collect();
    let mmi = GraphProto {
        name: Some("mmi_int8".into()),
        node: vec![node("MatMulInteger", &["a", "b", "za"], &["y"])],
        input: vec![
            value_info("a", DataType::Uint8, &[b2 as i64, m as i64, k as i64]),
            value_info("za", DataType::Uint8, &[]),
        ],
        output: vec![value_info(
            "y",
            DataType::Int32,
            &[b2 as i64, m as i64, n as i64],
        )],
        initializer: vec![int_tensor("b", DataType::Int8, &[k as i64, n as i64], &w)],
        ..Default::default()
    };
    let mmi_in = vec![
        Value::Tensor(Tensor::from_vec(&[b2, m, k], a)),
        Value::Tensor(Tensor::from_vec(&[], vec![3u8])),
    ];
    let (qm, qk, qn) = (19usize, 96usize, 33usize);
    let qw: Vec<i64> = (0..qk * qn).map(|_| next() % 256).collect();
    let qlm = GraphProto {
        name: Some("qlinear_matmul_int8".into()),
        node: vec![node(
            "QLinearMatMul",
            &["a", "sa", "za", "b", "sb", "zb", "sy", "zy"],
            &["y"],
        )],
        input: vec![value_info("a", DataType::Uint8, &[qm as i64, qk as i64])],
        output: vec![value_info("y", DataType::Uint8, &[qm as i64, qn as i64])],
        initializer: vec![
            f32_tensor("sa", &[], &[0.2]),
            int_tensor("za", DataType::Uint8, &[], &[121]),
            int_tensor("b", DataType::Uint8, &[qk as i64, qn as i64], &qw),
            f32_tensor("sb", &[], &[0.003]),
            int_tensor("zb", DataType::Uint8, &[], &[128]),
            f32_tensor("sy", &[], &[0.4]),
            int_tensor("zy", DataType::Uint8, &[], &[117]),
        ],
        ..Default::default()
    };
    let qa: Vec<u8> = (0..qm * qk).map(|_| (next() % 256) as u8).collect();
    let qlm_in = vec![Value::Tensor(Tensor::from_vec(&[qm, qk], qa))];
    let vnni = vnni_host(
        "int8_products_run_on_dot_product_kernels",
        "the f32 and loop forms only",
    );
    for target in ["host", "aarch64-neon"] {
        let dot = vnni && target == "host";
        for (g, inputs, steps) in [(&mmi, &mmi_in, k / 4), (&qlm, &qlm_in, qk / 4)] {
            let name = g.name.clone().unwrap();
            let (c, got, want) =
                compiled_and_reference(scratch.path(), &model(g.clone()), target, inputs);
            let ops = op_types(&c);
            let int8_calls = int8_gemms(&c.lowered.program.kernels);
            assert_eq!(int8_calls > 0, dot, "{name} on {target}: {ops:?}");
            let products = ops.iter().filter(|o| *o == "MatMul").count();
            let ranges = if name == "mmi_int8" { 5 } else { 1 };
            let f32_products = if dot { 0 } else { ranges };
            assert_eq!(products, f32_products, "{name} on {target}: {ops:?}");
            if dot {
                // The microkernel, named by its shape with k counted in steps of four.
                let rows = if name == "mmi_int8" { b2 * m } else { qm };
                let cols = if name == "mmi_int8" { n } else { qn };
                let sym = format!("model__gemm0_{rows}x{cols}x{steps}");
                let obj = &c.artifacts.object;
                assert!(
                    obj.windows(sym.len()).any(|w| w == sym.as_bytes()),
                    "{name}: no {sym} microkernel"
                );
            }
            let (g, w) = (got[0].as_tensor().unwrap(), want[0].as_tensor().unwrap());
            if name == "mmi_int8" {
                assert_eq!(g.array::<i32>(), w.array::<i32>(), "{name} on {target}");
                let top = w.array::<i32>().unwrap().iter().map(|v| v.abs()).max();
                assert!(top > Some(1 << 24), "{name}: small sums only");
            } else {
                assert_eq!(g.array::<u8>(), w.array::<u8>(), "{name} on {target}");
                let w = w.array::<u8>().unwrap();
                assert!(
                    w.iter().filter(|&&v| v > 0 && v < 255).count() > qm * qn / 2,
                    "{name}: mostly saturated"
                );
            }
        }
    }
}

/// 32-bit integer copies in the AVX-512 loops (moved as f32 lanes): a Transpose (the
/// in-register tile transpose), a Concat (unit-stride copies) and a strided Slice of
/// int32 values whose bits are f32 NaNs (quiet and signalling, both signs), infinities,
/// subnormals and negative zero must come out bit for bit, on the host and on aarch64
/// under qemu.
#[test]
fn int32_copies_keep_every_bit() {
    use common::{ints_attr, model, node, value_info};
    use onnxc::ir::Tensor;
    use onnxc::onnx::proto::tensor_proto::DataType;
    use onnxc::onnx::proto::GraphProto;
    let scratch = tempfile::tempdir().unwrap();
    let (r, c) = (37usize, 70usize);
    let special: [u32; 8] = [
        0x7fc0_0001,
        0x7f80_0001,
        0xffc0_0000,
        0xff80_0123,
        0x7f80_0000,
        0x0000_0001,
        0x8000_0000,
        0xffff_ffff,
    ];
    let mut next = lcg(32);
    let x: Vec<i32> = (0..r * c)
        .map(|i| match i % 11 {
            k if k < 8 => special[k] as i32,
            _ => next() as i32,
        })
        .collect();
    let mut slice = node("Slice", &["x", "st", "en", "ax", "sp"], &["s"]);
    slice.attribute = vec![];
    let mut transpose = node("Transpose", &["x"], &["t"]);
    transpose.attribute = vec![ints_attr("perm", &[1, 0])];
    let mut concat = node("Concat", &["x", "x"], &["k"]);
    concat.attribute = vec![common::int_attr("axis", 1)];
    let i64s = common::i64_tensor;
    let g = GraphProto {
        name: Some("int32_copies".into()),
        node: vec![transpose, concat, slice],
        input: vec![value_info("x", DataType::Int32, &[r as i64, c as i64])],
        output: vec![
            value_info("t", DataType::Int32, &[c as i64, r as i64]),
            value_info("k", DataType::Int32, &[r as i64, 2 * c as i64]),
            value_info("s", DataType::Int32, &[r as i64, 23]),
        ],
        initializer: vec![
            i64s("st", &[1]),
            i64s("en", &[70]),
            i64s("ax", &[1]),
            i64s("sp", &[3]),
        ],
        ..Default::default()
    };
    let inputs = vec![Value::Tensor(Tensor::from_vec(&[r, c], x))];
    for target in ["host", "aarch64-neon"] {
        let (_, got, want) =
            compiled_and_reference(scratch.path(), &model(g.clone()), target, &inputs);
        for (o, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(bits(g), bits(w), "output {o} on {target}");
        }
    }
}

/// int32 converted to float in the vector loops (the AVX-512 ones read the int32 stream
/// with `vcvtdq2ps`): a Cast alone and a Cast feeding a Mul (a fused loop whose local holds
/// the load), values past 2^24 that round (ties to even), i32's ends and negative ones, at
/// a length with a partial last vector; bit for bit against the reference on the host (the
/// AVX-512 loop required where the CPU has AVX-512) and on aarch64 under qemu.
#[test]
fn int32_conversions_round_as_the_reference() {
    use common::{f32_tensor, model, node, value_info};
    use onnxc::ir::Tensor;
    use onnxc::onnx::proto::tensor_proto::DataType;
    use onnxc::onnx::proto::{AttributeProto, GraphProto};
    let scratch = tempfile::tempdir().unwrap();
    let special = [
        i32::MIN,
        i32::MAX,
        -1,
        0,
        (1 << 24) + 1,
        (1 << 24) + 3,
        -(1 << 24) - 1,
        (1 << 25) + 2,
        (1 << 25) + 6,
        0x7fff_ffc0,
        -0x7fff_ffc0,
    ];
    let mut next = lcg(9);
    let n = 16 * 7 + 5;
    let x: Vec<i32> = (0..n)
        .map(|i| match special.get(i) {
            Some(&v) => v,
            None => (next() as i32).wrapping_mul(3),
        })
        .collect();
    let to_float = AttributeProto {
        name: Some("to".into()),
        r#type: Some(2),
        i: Some(DataType::Float as i64),
        ..Default::default()
    };
    let mut cast = node("Cast", &["x"], &["c"]);
    cast.attribute = vec![to_float];
    let g = GraphProto {
        name: Some("int32_to_float".into()),
        node: vec![cast, node("Mul", &["c", "h"], &["y"])],
        input: vec![value_info("x", DataType::Int32, &[n as i64])],
        output: vec![
            value_info("c", DataType::Float, &[n as i64]),
            value_info("y", DataType::Float, &[n as i64]),
        ],
        initializer: vec![f32_tensor("h", &[], &[0.75])],
        ..Default::default()
    };
    let inputs = vec![Value::Tensor(Tensor::from_vec(&[n], x))];
    for target in ["host", "aarch64-neon"] {
        let (c, got, want) =
            compiled_and_reference(scratch.path(), &model(g.clone()), target, &inputs);
        #[cfg(target_arch = "x86_64")]
        if target == "host" && std::arch::is_x86_feature_detected!("avx512f") {
            let obj = &c.artifacts.object;
            assert!(
                obj.windows(12).any(|w| w == b"model__wide0"),
                "no AVX-512 loop"
            );
        }
        let _ = &c;
        for (o, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(bits(g), bits(w), "output {o} on {target}");
        }
    }
}

/// Whether this host has AVX-512 VNNI (the 8-bit GEMM's instructions); when it has not,
/// says on stderr that `test` checks `what` on the host.
fn vnni_host(test: &str, what: &str) -> bool {
    #[cfg(target_arch = "x86_64")]
    let vnni = std::arch::is_x86_feature_detected!("avx512vnni");
    #[cfg(not(target_arch = "x86_64"))]
    let vnni = false;
    if !vnni {
        eprintln!("{test}: no AVX-512 VNNI here, so the host runs {what}");
    }
    vnni
}

/// The 8-bit `Stmt::Gemm` calls in `kernels`.
fn int8_gemms(kernels: &[onnxc::kir::Kernel]) -> usize {
    fn count(body: &[onnxc::kir::Stmt]) -> usize {
        use onnxc::kir::Stmt;
        body.iter()
            .map(|s| match s {
                Stmt::Gemm(g) => usize::from(g.int8),
                Stmt::For { body, .. } | Stmt::While { body, .. } => count(body),
                Stmt::If { then, els, .. } => count(then) + count(els),
                _ => 0,
            })
            .sum()
    }
    kernels.iter().map(|k| count(&k.body)).sum()
}

/// ConvInteger and QLinearConv by constant int8 weights on the f32 convs (the
/// `widen_integer` pass), on the host and on aarch64 under qemu, bit for bit against the
/// reference evaluator: a 3x3 conv the size Winograd takes for f32 (it must not: its
/// rounding would show in the int32 sums), per-channel weight zero points and a
/// constant x zero point; a grouped, strided, asymmetrically padded conv with a run-time
/// x zero point; QLinearConv with an int32 bias and per-channel scales, saturating at
/// both ends; and weights whose sums could pass 2^24 keep the integer conv.
#[test]
fn integer_convs_run_exactly_on_the_f32_convs() {
    use common::{f32_tensor, int_attr, ints_attr, model, node, value_info};
    use onnxc::ir::Tensor;
    use onnxc::onnx::proto::tensor_proto::DataType;
    use onnxc::onnx::proto::GraphProto;
    let scratch = tempfile::tempdir().unwrap();
    let mut next = lcg(91);
    let mut full = |n: usize| -> Vec<i64> { (0..n).map(|_| next() % 256 - 128).collect() };
    let (c, hw) = (16i64, 24i64);
    let w3 = full(16 * 16 * 9);
    let wg = full(8 * 4 * 9);
    let wq = full(16 * 16 * 9);
    let wz: Vec<i64> = (0..16).map(|j| j % 5 - 2).collect();
    let bias: Vec<i64> = (0..16).map(|j| (j - 8) * 9000).collect();
    let ws: Vec<f32> = (0..16).map(|j| 0.01 + 0.002 * j as f32).collect();
    let x_dims = [1, c, hw, hw];
    let mut x_vals = lcg(3);
    let x: Vec<u8> = (0..(c * hw * hw) as usize)
        .map(|i| match i % 37 {
            0 => 0,
            1 => 255,
            _ => (x_vals() % 256) as u8,
        })
        .collect();
    let x_in = || Value::Tensor(Tensor::from_vec(&[1, 16, 24, 24], x.clone()));
    let u8s = |name: &str, dims: &[i64], v: &[i64]| int_tensor(name, DataType::Uint8, dims, v);
    let i8s = |name: &str, dims: &[i64], v: &[i64]| int_tensor(name, DataType::Int8, dims, v);
    let conv = |op: &str, ins: &[&str], attrs: Vec<_>| {
        let mut n = node(op, ins, &["y"]);
        n.attribute = attrs;
        n
    };
    // (graph, inputs, widened)
    let cases: Vec<(GraphProto, Vec<Value>, bool)> = vec![
        (
            GraphProto {
                name: Some("convinteger_3x3".into()),
                node: vec![conv(
                    "ConvInteger",
                    &["x", "w", "xz", "wz"],
                    vec![ints_attr("pads", &[1, 1, 1, 1])],
                )],
                input: vec![value_info("x", DataType::Uint8, &x_dims)],
                output: vec![value_info("y", DataType::Int32, &x_dims)],
                initializer: vec![
                    i8s("w", &[16, 16, 3, 3], &w3),
                    u8s("xz", &[], &[131]),
                    i8s("wz", &[16], &wz),
                ],
                ..Default::default()
            },
            vec![x_in()],
            true,
        ),
        (
            GraphProto {
                name: Some("convinteger_grouped".into()),
                node: vec![conv(
                    "ConvInteger",
                    &["x", "w", "xz"],
                    vec![
                        int_attr("group", 4),
                        ints_attr("strides", &[2, 2]),
                        ints_attr("pads", &[0, 1, 1, 0]),
                    ],
                )],
                input: vec![
                    value_info("x", DataType::Uint8, &x_dims),
                    value_info("xz", DataType::Uint8, &[]),
                ],
                output: vec![value_info("y", DataType::Int32, &[1, 8, 12, 12])],
                initializer: vec![i8s("w", &[8, 4, 3, 3], &wg)],
                ..Default::default()
            },
            vec![x_in(), Value::Tensor(Tensor::from_vec(&[], vec![7u8]))],
            true,
        ),
        (
            GraphProto {
                name: Some("qlinearconv_bias".into()),
                node: vec![conv(
                    "QLinearConv",
                    &["x", "xs", "xz", "w", "ws", "wz", "ys", "yz", "b"],
                    vec![ints_attr("pads", &[1, 1, 1, 1])],
                )],
                input: vec![value_info("x", DataType::Uint8, &x_dims)],
                output: vec![value_info("y", DataType::Uint8, &x_dims)],
                initializer: vec![
                    f32_tensor("xs", &[], &[0.05]),
                    u8s("xz", &[], &[128]),
                    i8s("w", &[16, 16, 3, 3], &wq),
                    f32_tensor("ws", &[16], &ws),
                    i8s("wz", &[16], &[0; 16]),
                    f32_tensor("ys", &[], &[0.9]),
                    u8s("yz", &[], &[120]),
                    int_tensor("b", DataType::Int32, &[16], &bias),
                ],
                ..Default::default()
            },
            vec![x_in()],
            true,
        ),
        (
            // 255 x (16 x 25 x 255) > 2^24.
            GraphProto {
                name: Some("convinteger_too_wide".into()),
                node: vec![conv("ConvInteger", &["x", "w", "xz", "wz"], vec![])],
                input: vec![value_info("x", DataType::Uint8, &x_dims)],
                output: vec![value_info("y", DataType::Int32, &[1, 2, 20, 20])],
                initializer: vec![
                    i8s("w", &[2, 16, 5, 5], &[-128; 800]),
                    u8s("xz", &[], &[0]),
                    i8s("wz", &[], &[127]),
                ],
                ..Default::default()
            },
            vec![x_in()],
            false,
        ),
    ];
    let vnni = vnni_host(
        "integer_convs_run_exactly_on_the_f32_convs",
        "the f32 convs only",
    );
    for (g, inputs, widened) in cases {
        let case = g.name.clone().unwrap();
        for target in ["host", "aarch64-neon"] {
            let (c, got, want) =
                compiled_and_reference(scratch.path(), &model(g.clone()), target, &inputs);
            let ops = op_types(&c);
            // With 8-bit dot products the weight that fits i8 takes the 8-bit GEMM
            // (`int8_convs_run_on_dot_product_kernels`).
            let int8 = vnni && target == "host" && case == "qlinearconv_bias";
            assert_eq!(
                ops.contains(&"Conv".into()),
                widened && !int8,
                "{case} on {target}: {ops:?}"
            );
            assert_eq!(int8_gemms(&c.lowered.program.kernels) > 0, int8, "{case}");
            assert_eq!(bits(&got[0]), bits(&want[0]), "{case} on {target}");
            let w = want[0].as_tensor().unwrap().to_f64().unwrap();
            if case.starts_with("qlinear") {
                assert!(w.iter().any(|&v| v == 0.0) && w.iter().any(|&v| v == 255.0));
                assert!(w.iter().filter(|&&v| v > 0.0 && v < 255.0).count() > w.len() / 2);
            } else {
                let top = w.iter().map(|v| v.abs()).fold(0.0, f64::max);
                assert!(top > (1 << 17) as f64, "{case}: small sums only ({top})");
            }
        }
    }
}

/// ConvInteger and QLinearConv on the 8-bit GEMM where the target has dot products (x86
/// AVX-512 VNNI), bit for bit against the reference evaluator: x copied to pixels x
/// channels, an im2col padded with the zero point (rows padded to a multiple of 4), the
/// product by pixels, the output transposed back. 3x3 with padding, a run-time zero
/// point and two images; 1x1 read in place (8 channels); 3 channels (27 taps, rows of
/// 28) by a 5x5 kernel with strides, dilations and uneven pads; a 1-D conv; QLinearConv
/// by uint8 weights at zero point 128 with a bias, requantized. Without dot products
/// (aarch64 under qemu) the same models run on the f32 convs or loops.
#[test]
fn int8_convs_run_on_dot_product_kernels() {
    use common::{f32_tensor, ints_attr, model, node, value_info};
    use onnxc::ir::Tensor;
    use onnxc::onnx::proto::tensor_proto::DataType;
    use onnxc::onnx::proto::GraphProto;
    let scratch = tempfile::tempdir().unwrap();
    let mut next = lcg(4242);
    let mut bytes = |n: usize| -> Vec<u8> {
        (0..n)
            .map(|i| match i % 23 {
                0 => 0,
                1 => 255,
                _ => (next() % 256) as u8,
            })
            .collect()
    };
    let mut wnext = lcg(17);
    let mut weights = |n: usize| -> Vec<i64> {
        (0..n)
            .map(|i| match i % 19 {
                0 => -128,
                1 => 127,
                _ => wnext() % 256 - 128,
            })
            .collect()
    };
    let i8s = |name: &str, dims: &[i64], v: &[i64]| int_tensor(name, DataType::Int8, dims, v);
    let u8s = |name: &str, dims: &[i64], v: &[i64]| int_tensor(name, DataType::Uint8, dims, v);
    let x_of = |dims: &[usize], v: Vec<u8>| Value::Tensor(Tensor::from_vec(dims, v));
    let conv = |op: &str, ins: &[&str], attrs: Vec<_>| {
        let mut n = node(op, ins, &["y"]);
        n.attribute = attrs;
        n
    };
    // (graph, inputs)
    let wq: Vec<i64> = weights(24 * 16 * 9).iter().map(|w| w + 128).collect();
    let bias: Vec<i64> = (0..24).map(|j| (j - 12) * 700).collect();
    let cases: Vec<(GraphProto, Vec<Value>)> = vec![
        (
            GraphProto {
                name: Some("ci8_3x3".into()),
                node: vec![conv(
                    "ConvInteger",
                    &["x", "w", "xz"],
                    vec![ints_attr("pads", &[1, 1, 1, 1])],
                )],
                input: vec![
                    value_info("x", DataType::Uint8, &[2, 16, 13, 13]),
                    value_info("xz", DataType::Uint8, &[]),
                ],
                output: vec![value_info("y", DataType::Int32, &[2, 20, 13, 13])],
                initializer: vec![i8s("w", &[20, 16, 3, 3], &weights(20 * 16 * 9))],
                ..Default::default()
            },
            vec![
                x_of(&[2, 16, 13, 13], bytes(2 * 16 * 169)),
                x_of(&[], vec![9]),
            ],
        ),
        (
            GraphProto {
                name: Some("ci8_1x1".into()),
                node: vec![conv("ConvInteger", &["x", "w", "xz"], vec![])],
                input: vec![value_info("x", DataType::Uint8, &[1, 8, 7, 9])],
                output: vec![value_info("y", DataType::Int32, &[1, 33, 7, 9])],
                initializer: vec![
                    i8s("w", &[33, 8, 1, 1], &weights(33 * 8)),
                    u8s("xz", &[], &[200]),
                ],
                ..Default::default()
            },
            vec![x_of(&[1, 8, 7, 9], bytes(8 * 63))],
        ),
        (
            GraphProto {
                name: Some("ci8_5x5_strided".into()),
                node: vec![conv(
                    "ConvInteger",
                    &["x", "w"],
                    vec![
                        ints_attr("strides", &[2, 3]),
                        ints_attr("dilations", &[2, 1]),
                        ints_attr("pads", &[2, 1, 0, 3]),
                    ],
                )],
                input: vec![value_info("x", DataType::Uint8, &[1, 3, 17, 19])],
                output: vec![value_info("y", DataType::Int32, &[1, 12, 5, 6])],
                initializer: vec![i8s("w", &[12, 3, 5, 5], &weights(12 * 75))],
                ..Default::default()
            },
            vec![x_of(&[1, 3, 17, 19], bytes(3 * 17 * 19))],
        ),
        (
            GraphProto {
                name: Some("ci8_1d".into()),
                node: vec![conv(
                    "ConvInteger",
                    &["x", "w", "xz"],
                    vec![ints_attr("pads", &[1, 2])],
                )],
                input: vec![value_info("x", DataType::Uint8, &[1, 8, 30])],
                output: vec![value_info("y", DataType::Int32, &[1, 5, 31])],
                initializer: vec![
                    i8s("w", &[5, 8, 3], &weights(5 * 8 * 3)),
                    u8s("xz", &[], &[128]),
                ],
                ..Default::default()
            },
            vec![x_of(&[1, 8, 30], bytes(8 * 30))],
        ),
        (
            GraphProto {
                name: Some("qlc8_3x3_s2".into()),
                node: vec![conv(
                    "QLinearConv",
                    &["x", "xs", "xz", "w", "ws", "wz", "ys", "yz", "b"],
                    vec![
                        ints_attr("pads", &[1, 1, 1, 1]),
                        ints_attr("strides", &[2, 2]),
                    ],
                )],
                input: vec![value_info("x", DataType::Uint8, &[1, 16, 15, 15])],
                output: vec![value_info("y", DataType::Uint8, &[1, 24, 8, 8])],
                initializer: vec![
                    f32_tensor("xs", &[], &[0.05]),
                    u8s("xz", &[], &[121]),
                    u8s("w", &[24, 16, 3, 3], &wq),
                    f32_tensor("ws", &[], &[0.004]),
                    u8s("wz", &[], &[128]),
                    f32_tensor("ys", &[], &[0.1]),
                    u8s("yz", &[], &[110]),
                    int_tensor("b", DataType::Int32, &[24], &bias),
                ],
                ..Default::default()
            },
            vec![x_of(&[1, 16, 15, 15], bytes(16 * 225))],
        ),
    ];
    let vnni = vnni_host(
        "int8_convs_run_on_dot_product_kernels",
        "the f32 and loop forms only",
    );
    for (g, inputs) in cases {
        let case = g.name.clone().unwrap();
        for target in ["host", "aarch64-neon"] {
            let dot = vnni && target == "host";
            let (c, got, want) =
                compiled_and_reference(scratch.path(), &model(g.clone()), target, &inputs);
            let ops = op_types(&c);
            assert_eq!(
                int8_gemms(&c.lowered.program.kernels) > 0,
                dot,
                "{case} on {target}: {ops:?}"
            );
            if dot {
                assert!(ops.contains(&"ConvInteger".into()), "{case}: {ops:?}");
                // The microkernel (not loops): output channels x output pixels x k
                // steps of four (taps times channels padded to quads).
                let shape = match case.as_str() {
                    "ci8_3x3" => "20x169x36",
                    "ci8_1x1" => "33x63x2",
                    "ci8_5x5_strided" => "12x42x25",
                    "ci8_1d" => "5x31x6",
                    _ => "24x64x36",
                };
                let sym = format!("_{shape}");
                let obj = &c.artifacts.object;
                assert!(
                    obj.windows(sym.len()).any(|w| w == sym.as_bytes()),
                    "{case}: no {sym} microkernel"
                );
            }
            assert_eq!(bits(&got[0]), bits(&want[0]), "{case} on {target}");
            let w = want[0].as_tensor().unwrap().to_f64().unwrap();
            if case.starts_with("qlc") {
                assert!(
                    w.iter().any(|&v| v == 0.0) && w.iter().any(|&v| v == 255.0),
                    "{case}"
                );
                assert!(
                    w.iter().filter(|&&v| v > 0.0 && v < 255.0).count() > w.len() / 2,
                    "{case}"
                );
            } else {
                let top = w.iter().map(|v| v.abs()).fold(0.0, f64::max);
                assert!(top > 30000.0, "{case}: small sums only ({top})");
            }
        }
    }
}

/// QuantizeLinear of values on a grid of half its scale (x = k * 0.01 at scale 0.02, so
/// the quotients sit a bit or so off .5): each rounded quotient must be the division's,
/// as the reference's, on every target (the AVX-512 loops once multiplied by the scale's
/// reciprocal, 2.21 * 50 = 110.49999 where 2.21 / 0.02 = 110.50001: a step off).
#[test]
fn quantize_linear_rounds_the_quotient_itself() {
    use common::{f32_tensor, model, node, value_info};
    use onnxc::ir::Tensor;
    use onnxc::onnx::proto::tensor_proto::DataType;
    use onnxc::onnx::proto::GraphProto;
    let scratch = tempfile::tempdir().unwrap();
    let x: Vec<f32> = (-300..=300).map(|k| k as f32 * 0.01).collect();
    let n = x.len() as i64;
    let g = GraphProto {
        name: Some("quantize_ties".into()),
        node: vec![node("QuantizeLinear", &["x", "s", "z"], &["y"])],
        input: vec![value_info("x", DataType::Float, &[n])],
        output: vec![value_info("y", DataType::Uint8, &[n])],
        initializer: vec![
            f32_tensor("s", &[], &[0.02]),
            int_tensor("z", DataType::Uint8, &[], &[110]),
        ],
        ..Default::default()
    };
    let inputs = vec![Value::Tensor(Tensor::from_vec(&[x.len()], x))];
    for target in ["host", "x86_64-sse4", "aarch64-neon"] {
        let (_, got, want) =
            compiled_and_reference(scratch.path(), &model(g.clone()), target, &inputs);
        assert_eq!(bits(&got[0]), bits(&want[0]), "on {target}");
    }
}

/// QuantizeLinear by one scale and zero point fuses into the elementwise kernel before it
/// (`x * 0.5 + -0.0` to u8 and `x * 0.3` to i8, at scale 0.02: quotients near .5,
/// saturation at both ends), stored as bytes by the vector loops (two AVX-512 ones on
/// such a host); a per-channel QuantizeLinear over a shape whose last dimension equals the
/// channel count (so that numpy broadcasting would line the scales up with the wrong
/// axis) stays a kernel of its own. Bit for bit against the reference on the host, on
/// x86_64-sse4 and on aarch64 under qemu.
#[test]
fn quantize_linear_fuses_into_elementwise_kernels() {
    use common::{f32_tensor, int_attr, model, node, value_info};
    use onnxc::ir::Tensor;
    use onnxc::onnx::proto::tensor_proto::DataType;
    use onnxc::onnx::proto::GraphProto;
    let scratch = tempfile::tempdir().unwrap();
    let mut per_channel = node("QuantizeLinear", &["x", "sc", "zc"], &["yc"]);
    per_channel.attribute = vec![int_attr("axis", 1)];
    let g = GraphProto {
        name: Some("quantize_fused".into()),
        node: vec![
            node("Mul", &["x", "half"], &["a"]),
            node("Add", &["a", "bump"], &["b"]),
            node("QuantizeLinear", &["b", "s", "zu"], &["yu"]),
            node("Mul", &["x", "third"], &["c"]),
            node("QuantizeLinear", &["c", "s", "zi"], &["yi"]),
            per_channel,
        ],
        input: vec![value_info("x", DataType::Float, &[1, 4, 4, 4])],
        output: vec![
            value_info("yu", DataType::Uint8, &[1, 4, 4, 4]),
            value_info("yi", DataType::Int8, &[1, 4, 4, 4]),
            value_info("yc", DataType::Uint8, &[1, 4, 4, 4]),
        ],
        initializer: vec![
            f32_tensor("half", &[], &[0.5]),
            f32_tensor("bump", &[], &[-0.0]),
            f32_tensor("third", &[], &[0.3]),
            f32_tensor("s", &[], &[0.02]),
            int_tensor("zu", DataType::Uint8, &[], &[110]),
            int_tensor("zi", DataType::Int8, &[], &[-5]),
            f32_tensor("sc", &[4], &[0.02, 0.05, 0.1, 0.01]),
            int_tensor("zc", DataType::Uint8, &[4], &[0, 50, 128, 255]),
        ],
        ..Default::default()
    };
    // Half on a grid of 0.02 (0.5 x at scale 0.02: quotients k / 2, ties), half far out
    // (saturating).
    let x: Vec<f32> = (0..64)
        .map(|k| match k < 32 {
            true => (k - 16) as f32 * 0.02,
            false => (k - 48) as f32 * 0.5,
        })
        .collect();
    let inputs = vec![Value::Tensor(Tensor::from_vec(&[1, 4, 4, 4], x))];
    for target in ["host", "x86_64-sse4", "aarch64-neon"] {
        let (c, got, want) =
            compiled_and_reference(scratch.path(), &model(g.clone()), target, &inputs);
        let ops = op_types(&c);
        let count = |op: &str| ops.iter().filter(|o| *o == op).count();
        assert_eq!(
            count("QuantizeLinear"),
            1,
            "the per-channel one on {target}: {ops:?}"
        );
        assert_eq!(count("Fused"), 2, "on {target}: {ops:?}");
        #[cfg(target_arch = "x86_64")]
        if target == "host" && std::arch::is_x86_feature_detected!("avx512bw") {
            let obj = &c.artifacts.object;
            assert!(
                obj.windows(12).any(|w| w == b"model__wide1"),
                "AVX-512 loops"
            );
        }
        for (o, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(bits(g), bits(w), "output {o} on {target}");
        }
    }
}

/// A QDQ conv (x quantized and dequantized, a per-channel int8 weight and an int32 bias
/// dequantized, into an f32 Conv) on the host and on aarch64 under qemu: with VNNI the
/// host runs the conv of the quantized values on the 8-bit GEMM (its microkernel in the
/// object) and scales the exact sums back; either way the outputs stay within 1e-5 of the
/// reference's f32 conv (they differ by its rounding only). A 3x3 conv padded and a 1x1
/// one strided, 16 and 20 input channels, and a 3-channel 7x7 stride-2 stem.
#[test]
fn qdq_convs_run_on_dot_product_kernels() {
    use common::{f32_tensor, ints_attr, model, node, value_info};
    use onnxc::ir::Tensor;
    use onnxc::onnx::proto::tensor_proto::DataType;
    use onnxc::onnx::proto::{AttributeProto, GraphProto};
    let scratch = tempfile::tempdir().unwrap();
    let mut next = lcg(77);
    let vnni = vnni_host("qdq_convs_run_on_dot_product_kernels", "the f32 conv");
    let axis0 = AttributeProto {
        name: Some("axis".into()),
        r#type: Some(onnxc::onnx::proto::attribute_proto::AttributeType::Int as i32),
        i: Some(0),
        ..Default::default()
    };
    // (name, c, co, h, kernel, attrs, output size, microkernel shape)
    let cases = [
        (
            "qdq_3x3",
            16,
            24,
            9,
            3,
            vec![ints_attr("pads", &[1, 1, 1, 1])],
            9,
            "24x81x36",
        ),
        (
            "qdq_1x1_s2",
            20,
            12,
            10,
            1,
            vec![ints_attr("strides", &[2, 2])],
            5,
            "12x25x5",
        ),
        (
            // An image model's stem: 3 channels (one quad, a zero-point byte), 7x7 stride
            // 2, its taps copied from phase planes.
            "qdq_stem_7x7_s2",
            3,
            16,
            20,
            7,
            vec![
                ints_attr("pads", &[3, 3, 3, 3]),
                ints_attr("strides", &[2, 2]),
            ],
            10,
            "16x100x49",
        ),
    ];
    for (name, c, co, h, kk, attrs, oh, shape) in cases {
        let w: Vec<i64> = (0..co * c * kk * kk).map(|_| next() % 255 - 127).collect();
        let sw: Vec<f32> = (0..co).map(|j| 0.002 + 0.0005 * j as f32).collect();
        let b: Vec<i64> = (0..co).map(|j| (j as i64 - 7) * 300).collect();
        let sb: Vec<f32> = sw.iter().map(|s| s * 0.02).collect();
        let mut conv = node("Conv", &["xd", "wd", "bd"], &["y"]);
        conv.attribute = attrs;
        let mut wd = node("DequantizeLinear", &["wq", "sw"], &["wd"]);
        wd.attribute = vec![axis0.clone()];
        let mut bd = node("DequantizeLinear", &["bq", "sb"], &["bd"]);
        bd.attribute = vec![axis0.clone()];
        let (c, co, h, kk, oh) = (c as i64, co as i64, h as i64, kk as i64, oh as i64);
        let g = GraphProto {
            name: Some(name.into()),
            node: vec![
                node("QuantizeLinear", &["x", "sx", "zx"], &["xq"]),
                node("DequantizeLinear", &["xq", "sx", "zx"], &["xd"]),
                wd,
                bd,
                conv,
            ],
            input: vec![value_info("x", DataType::Float, &[1, c, h, h])],
            output: vec![value_info("y", DataType::Float, &[1, co, oh, oh])],
            initializer: vec![
                f32_tensor("sx", &[], &[0.02]),
                int_tensor("zx", DataType::Uint8, &[], &[110]),
                int_tensor("wq", DataType::Int8, &[co, c, kk, kk], &w),
                f32_tensor("sw", &[co], &sw),
                int_tensor("bq", DataType::Int32, &[co], &b),
                f32_tensor("sb", &[co], &sb),
            ],
            ..Default::default()
        };
        let n = (c * h * h) as usize;
        let x: Vec<f32> = (0..n).map(|_| (next() % 600 - 250) as f32 * 0.01).collect();
        let inputs = vec![Value::Tensor(Tensor::from_vec(
            &[1, c as usize, h as usize, h as usize],
            x,
        ))];
        for target in ["host", "aarch64-neon"] {
            let dot = vnni && target == "host";
            let (cm, got, want) =
                compiled_and_reference(scratch.path(), &model(g.clone()), target, &inputs);
            let ops = op_types(&cm);
            assert_eq!(
                ops.contains(&"ConvInteger".into()),
                dot,
                "{name} on {target}: {ops:?}"
            );
            assert_eq!(
                ops.contains(&"Conv".into()),
                !dot,
                "{name} on {target}: {ops:?}"
            );
            if dot {
                let sym = format!("_{shape}");
                let obj = &cm.artifacts.object;
                assert!(
                    obj.windows(sym.len()).any(|w| w == sym.as_bytes()),
                    "{name}: no {sym} microkernel"
                );
            }
            let (g0, w0) = (got[0].as_tensor().unwrap(), want[0].as_tensor().unwrap());
            let e = onnxc::check::rel_err(g0, w0).unwrap();
            assert!(e < 1e-5, "{name} on {target}: relative error {e:.2e}");
        }
    }
}

/// QDQ products (`integer_qdq_gemm`): a classifier's Gemm (transB, weights per output
/// column, a bias) at batch 1 and 5, and a MatMul of a 3-D x by per-tensor weights, run
/// as MatMulInteger on the 8-bit GEMM where the host has VNNI (the batch-1 one on the
/// few-row tiles' accumulator sets), as f32 on aarch64; against the reference.
#[test]
fn qdq_products_run_on_dot_product_kernels() {
    use common::{f32_tensor, model, node, value_info};
    use onnxc::ir::Tensor;
    use onnxc::onnx::proto::tensor_proto::DataType;
    use onnxc::onnx::proto::{AttributeProto, GraphProto};
    let scratch = tempfile::tempdir().unwrap();
    let mut next = lcg(91);
    let vnni = vnni_host("qdq_products_run_on_dot_product_kernels", "the f32 GEMM");
    let int_attr = |name: &str, v: i64| AttributeProto {
        name: Some(name.into()),
        r#type: Some(onnxc::onnx::proto::attribute_proto::AttributeType::Int as i32),
        i: Some(v),
        ..Default::default()
    };
    let (k, n) = (200i64, 40i64);
    // (name, x shape, Gemm)
    let cases: [(&str, Vec<i64>, bool); 3] = [
        ("qdq_gemm_batch1", vec![1, k], true),
        ("qdq_gemm_batch5", vec![5, k], true),
        ("qdq_matmul_3d", vec![2, 3, k], false),
    ];
    for (name, xs, gemm) in cases {
        let w: Vec<i64> = (0..k * n).map(|_| next() % 255 - 127).collect();
        let mut ys = xs.clone();
        *ys.last_mut().unwrap() = n;
        let mut inits = vec![
            f32_tensor("sx", &[], &[0.02]),
            int_tensor("zx", DataType::Uint8, &[], &[110]),
        ];
        let mut nodes = vec![
            node("QuantizeLinear", &["x", "sx", "zx"], &["xq"]),
            node("DequantizeLinear", &["xq", "sx", "zx"], &["xd"]),
        ];
        if gemm {
            let sw: Vec<f32> = (0..n).map(|j| 0.002 + 0.0005 * j as f32).collect();
            let b: Vec<f32> = (0..n).map(|j| (j as f32 - 20.0) * 0.1).collect();
            inits.push(int_tensor("wq", DataType::Int8, &[n, k], &w));
            inits.push(f32_tensor("sw", &[n], &sw));
            inits.push(int_tensor("zw", DataType::Int8, &[n], &vec![0; n as usize]));
            inits.push(f32_tensor("b", &[n], &b));
            let mut wd = node("DequantizeLinear", &["wq", "sw", "zw"], &["wd"]);
            wd.attribute = vec![int_attr("axis", 0)];
            let mut gm = node("Gemm", &["xd", "wd", "b"], &["y"]);
            gm.attribute = vec![int_attr("transB", 1)];
            nodes.extend([wd, gm]);
        } else {
            inits.push(int_tensor("wq", DataType::Int8, &[k, n], &w));
            inits.push(f32_tensor("sw", &[], &[0.003]));
            nodes.push(node("DequantizeLinear", &["wq", "sw"], &["wd"]));
            nodes.push(node("MatMul", &["xd", "wd"], &["y"]));
        }
        let g = GraphProto {
            name: Some(name.into()),
            node: nodes,
            input: vec![value_info("x", DataType::Float, &xs)],
            output: vec![value_info("y", DataType::Float, &ys)],
            initializer: inits,
            ..Default::default()
        };
        let len = xs.iter().product::<i64>() as usize;
        let x: Vec<f32> = (0..len)
            .map(|_| (next() % 600 - 250) as f32 * 0.01)
            .collect();
        let shape: Vec<usize> = xs.iter().map(|&d| d as usize).collect();
        let inputs = vec![Value::Tensor(Tensor::from_vec(&shape, x))];
        for target in ["host", "aarch64-neon"] {
            let dot = vnni && target == "host";
            let (cm, got, want) =
                compiled_and_reference(scratch.path(), &model(g.clone()), target, &inputs);
            let ops = op_types(&cm);
            assert_eq!(
                ops.contains(&"MatMulInteger".into()),
                dot,
                "{name} on {target}: {ops:?}"
            );
            if dot {
                let int8 = int8_gemms(&cm.lowered.program.kernels);
                assert!(int8 > 0, "{name}: no 8-bit GEMM");
            }
            let (g0, w0) = (got[0].as_tensor().unwrap(), want[0].as_tensor().unwrap());
            let e = onnxc::check::rel_err(g0, w0).unwrap();
            assert!(e < 1e-5, "{name} on {target}: relative error {e:.2e}");
        }
    }
}

/// QLinearMatMul by a constant int8 weight with per-column scales and zero points: the
/// exact product on the f32 GEMM, then the reference's requantization in f64, on the
/// host and on aarch64 under qemu, bit for bit against the reference (outputs that
/// saturate at both ends included).
#[test]
fn quantized_products_requantize_as_the_reference() {
    use common::{f32_tensor, model, node, value_info};
    use onnxc::ir::Tensor;
    use onnxc::onnx::proto::tensor_proto::DataType;
    use onnxc::onnx::proto::GraphProto;
    let scratch = tempfile::tempdir().unwrap();
    let (m, k, n) = (19usize, 96usize, 33usize);
    let mut next = lcg(5);
    let ints = int_tensor;
    let w: Vec<i64> = (0..k * n).map(|_| next() % 256 - 128).collect();
    let zb: Vec<i64> = (0..n).map(|j| (j as i64 % 5) - 2).collect();
    let sb: Vec<f32> = (0..n).map(|j| 0.002 + 0.0003 * j as f32).collect();
    let g = GraphProto {
        name: Some("qlinear_matmul".into()),
        node: vec![node(
            "QLinearMatMul",
            &["a", "sa", "za", "b", "sb", "zb", "sy", "zy"],
            &["y"],
        )],
        input: vec![
            value_info("a", DataType::Uint8, &[m as i64, k as i64]),
            value_info("za", DataType::Uint8, &[]),
        ],
        output: vec![value_info("y", DataType::Uint8, &[m as i64, n as i64])],
        initializer: vec![
            f32_tensor("sa", &[], &[0.2]),
            ints("b", DataType::Int8, &[k as i64, n as i64], &w),
            f32_tensor("sb", &[n as i64], &sb),
            ints("zb", DataType::Int8, &[n as i64], &zb),
            f32_tensor("sy", &[], &[0.7]),
            ints("zy", DataType::Uint8, &[], &[117]),
        ],
        ..Default::default()
    };
    let a: Vec<u8> = (0..m * k).map(|_| (next() % 256) as u8).collect();
    let inputs = vec![
        Value::Tensor(Tensor::from_vec(&[m, k], a)),
        Value::Tensor(Tensor::from_vec(&[], vec![124u8])),
    ];
    for target in ["host", "aarch64-neon"] {
        let (c, got, want) =
            compiled_and_reference(scratch.path(), &model(g.clone()), target, &inputs);
        let ops = op_types(&c);
        assert!(
            !ops.contains(&"QLinearMatMul".into()),
            "on {target}: {ops:?}"
        );
        let (g, w) = (got[0].as_tensor().unwrap(), want[0].as_tensor().unwrap());
        assert_eq!(
            g.array::<u8>(),
            w.array::<u8>(),
            "QLinearMatMul on {target}"
        );
        let w = w.array::<u8>().unwrap();
        assert!(
            w.iter().any(|&v| v == 0) && w.iter().any(|&v| v == 255),
            "no saturation"
        );
        assert!(
            w.iter().filter(|&&v| v > 0 && v < 255).count() > m * n / 2,
            "mostly saturated"
        );
    }
}

/// 8-bit products on the AMX tiles (`--target x86_64-amx`), bit for bit against the
/// reference evaluator: MatMulInteger of u8 activations by constant i8 weights (B packed
/// in panels; 45 rows: a whole 32-row block and a partial one of a full and a 13-row
/// tile; 50 columns: a block and a partial one of 18, a full tile and a 2-column one;
/// k = 128, two tile steps) with a zero point for A and without; ConvInteger of 64 channels 3x3
/// (weights as a signed A, the input's columns read in place; 48 x 110 x 576) with a
/// run-time zero point; convs whose k is not whole tile steps (weights padded, B's last
/// quads through a stack tile). Compiled on every machine (the tile functions must be there);
/// run where the CPU and OS give AMX, and the plain AVX-512 target must not use them.
#[test]
fn int8_products_run_on_amx_tiles() {
    use common::{ints_attr, model, node, value_info};
    use onnxc::ir::Tensor;
    use onnxc::onnx::proto::tensor_proto::DataType;
    use onnxc::onnx::proto::GraphProto;
    let scratch = tempfile::tempdir().unwrap();
    let mut next = lcg(777);
    let (m, k, n) = (45usize, 128usize, 50usize);
    let w: Vec<i64> = (0..k * n)
        .map(|i| match i % 37 {
            0 => -128,
            1 => 127,
            _ => next() % 256 - 128,
        })
        .collect();
    let a: Vec<u8> = (0..m * k)
        .map(|i| match i % 31 {
            0 => 255,
            1 => 0,
            _ => (next() % 256) as u8,
        })
        .collect();
    let mmi = GraphProto {
        name: Some("mmi_amx".into()),
        node: vec![node("MatMulInteger", &["a", "b", "za"], &["y"])],
        input: vec![
            value_info("a", DataType::Uint8, &[m as i64, k as i64]),
            value_info("za", DataType::Uint8, &[]),
        ],
        output: vec![value_info("y", DataType::Int32, &[m as i64, n as i64])],
        initializer: vec![int_tensor("b", DataType::Int8, &[k as i64, n as i64], &w)],
        ..Default::default()
    };
    // Without a zero point: no init view, the tiles' sums are C.
    let mut mmi0 = mmi.clone();
    mmi0.name = Some("mmi_amx_no_zero_point".into());
    mmi0.node = vec![node("MatMulInteger", &["a", "b"], &["y"])];
    mmi0.input.truncate(1);
    let mmi0_in = vec![Value::Tensor(Tensor::from_vec(&[m, k], a.clone()))];
    let mmi_in = vec![
        Value::Tensor(Tensor::from_vec(&[m, k], a)),
        Value::Tensor(Tensor::from_vec(&[], vec![7u8])),
    ];
    let (ci, co, h, wd) = (64usize, 48usize, 10usize, 11usize);
    let cw: Vec<i64> = (0..co * ci * 9)
        .map(|i| match i % 29 {
            0 => -128,
            1 => 127,
            _ => next() % 256 - 128,
        })
        .collect();
    let x: Vec<u8> = (0..ci * h * wd)
        .map(|i| match i % 23 {
            0 => 0,
            1 => 255,
            _ => (next() % 256) as u8,
        })
        .collect();
    let mut conv = node("ConvInteger", &["x", "w", "xz"], &["y"]);
    conv.attribute = vec![ints_attr("pads", &[1, 1, 1, 1])];
    let dims = |v: &[usize]| v.iter().map(|&d| d as i64).collect::<Vec<_>>();
    let cii = GraphProto {
        name: Some("ci_amx".into()),
        node: vec![conv],
        input: vec![
            value_info("x", DataType::Uint8, &dims(&[1, ci, h, wd])),
            value_info("xz", DataType::Uint8, &[]),
        ],
        output: vec![value_info("y", DataType::Int32, &dims(&[1, co, h, wd]))],
        initializer: vec![int_tensor("w", DataType::Int8, &dims(&[co, ci, 3, 3]), &cw)],
        ..Default::default()
    };
    let cii_in = vec![
        Value::Tensor(Tensor::from_vec(&[1, ci, h, wd], x)),
        Value::Tensor(Tensor::from_vec(&[], vec![131u8])),
    ];
    // k not whole tile steps: 24 channels 3x3 (54 quads: three steps and 6 quads of B
    // through the stack tile), 84 channels 1x1 (21 quads: one step and 5), with
    // partial row and column blocks.
    let mut tail_conv = |name: &str, ci: usize, co: usize, kk: usize, h: usize, wd: usize| {
        let cw: Vec<i64> = (0..co * ci * kk * kk)
            .map(|i| match i % 13 {
                0 => -128,
                1 => 127,
                _ => next() % 256 - 128,
            })
            .collect();
        let x: Vec<u8> = (0..ci * h * wd).map(|_| (next() % 256) as u8).collect();
        let mut conv = node("ConvInteger", &["x", "w", "xz"], &["y"]);
        let p = (kk / 2) as i64;
        conv.attribute = vec![ints_attr("pads", &[p, p, p, p])];
        let g = GraphProto {
            name: Some(name.into()),
            node: vec![conv],
            input: vec![
                value_info("x", DataType::Uint8, &dims(&[1, ci, h, wd])),
                value_info("xz", DataType::Uint8, &[]),
            ],
            output: vec![value_info("y", DataType::Int32, &dims(&[1, co, h, wd]))],
            initializer: vec![int_tensor(
                "w",
                DataType::Int8,
                &dims(&[co, ci, kk, kk]),
                &cw,
            )],
            ..Default::default()
        };
        let inputs = vec![
            Value::Tensor(Tensor::from_vec(&[1, ci, h, wd], x)),
            Value::Tensor(Tensor::from_vec(&[], vec![250u8])),
        ];
        let sym = format!("_{co}x{}x{}_amx", h * wd, ci.div_ceil(4) * kk * kk);
        (g, inputs, sym)
    };
    let (t3, t3_in, t3_sym) = tail_conv("ci_amx_tail3x3", 24, 40, 3, 9, 13);
    let (t1, t1_in, t1_sym) = tail_conv("ci_amx_tail1x1", 84, 17, 1, 7, 5);
    let host = onnxc::targets::Target::load("host").unwrap();
    let amx = host.has("amx-int8");
    if !amx {
        eprintln!(
            "int8_products_run_on_amx_tiles: no AMX here, so the tile code is compiled, not run"
        );
    }
    for (g, inputs, sym) in [
        (&mmi, &mmi_in, format!("_{m}x{n}x{}_amx", k / 4)),
        (&mmi0, &mmi0_in, format!("_{m}x{n}x{}_amx", k / 4)),
        (
            &cii,
            &cii_in,
            format!("_{co}x{}x{}_amx", h * wd, ci * 9 / 4),
        ),
        (&t3, &t3_in, t3_sym),
        (&t1, &t1_in, t1_sym),
    ] {
        let name = g.name.clone().unwrap();
        let has = |c: &onnxc::driver::Compiled, s: &str| {
            let obj = &c.artifacts.object;
            obj.windows(s.len()).any(|w| w == s.as_bytes())
        };
        if amx {
            let (c, got, want) =
                compiled_and_reference(scratch.path(), &model(g.clone()), "x86_64-amx", inputs);
            assert!(has(&c, &sym), "{name}: no {sym} tile function");
            let (gt, wt) = (got[0].as_tensor().unwrap(), want[0].as_tensor().unwrap());
            assert_eq!(gt.array::<i32>(), wt.array::<i32>(), "{name} on the tiles");
            // Two threads: the conv's chains of copies split by channel quads (the
            // products here are too small to split).
            let (tasks, got2) =
                on_two_threads(scratch.path(), &model(g.clone()), "x86_64-amx", inputs);
            assert!(tasks || name != "ci_amx", "{name}: no task function");
            assert_eq!(bits(&got2[0]), bits(&want[0]), "{name} on two threads");
        }
        let m = onnx::load(&common::write_model(
            scratch.path(),
            &format!("{name}.onnx"),
            &model(g.clone()),
        ))
        .unwrap();
        for (target, tiles) in [("x86_64-amx", true), ("x86_64-avx512", false)] {
            let opts = Options {
                target: target.into(),
                ..Options::default()
            };
            let c = onnxc::driver::compile_graph(m.graph.clone(), "model", &opts).unwrap();
            assert_eq!(has(&c, "_amx"), tiles, "{name} for {target}");
        }
    }
}

/// ONNX Runtime's quantized operators (`com.microsoft`), imported as bodies of standard
/// ops, against ONNX Runtime itself (the `onnxruntime` package, run live) and, compiled,
/// against the reference evaluator bit for bit on the host, x86_64-sse4 and aarch64
/// under qemu: QLinearAdd (broadcast, and int8 without an output zero point: the output int8 too), QLinearMul,
/// QLinearLeakyRelu, QLinearSigmoid, QLinearGlobalAveragePool (channels first and last),
/// QLinearAveragePool (padding, ceil mode, channels last), QLinearConcat (three scales),
/// QLinearSoftmax (opset 13 and the coerced 2-D form of opset 11),
/// QLinearWhere and QGemm (transposed B with per-column scales and zero points, an int32
/// bias, alpha; quantized and float outputs). ONNX Runtime computes some of them by
/// other arithmetic (QLinearAdd by scale ratios, QLinearSigmoid by a table), so its
/// quantized outputs may differ by one step where a quotient lies at a rounding boundary:
/// at most one step, and on at most 5% of the elements (a wrong rounding would put half
/// of them off); float outputs within 1e-5.
#[test]
fn microsoft_quantized_ops_match_onnxruntime() {
    use common::{f32_tensor, int_attr, ints_attr, model, value_info};
    use onnxc::ir::Tensor;
    use onnxc::onnx::proto::tensor_proto::DataType;
    use onnxc::onnx::proto::{AttributeProto, GraphProto, NodeProto, OperatorSetIdProto};
    let scratch = tempfile::tempdir().unwrap();
    let (u8t, i8t) = (DataType::Uint8, DataType::Int8);
    let float_attr = |name: &str, v: f32| AttributeProto {
        name: Some(name.into()),
        r#type: Some(1),
        f: Some(v),
        ..Default::default()
    };
    // A graph input of random bytes (or booleans).
    struct In {
        name: &'static str,
        dt: DataType,
        dims: Vec<i64>,
    }
    struct Case {
        name: &'static str,
        op: &'static str,
        inputs: Vec<&'static str>,
        attrs: Vec<AttributeProto>,
        feeds: Vec<In>,
        inits: Vec<onnxc::onnx::proto::TensorProto>,
        out: (DataType, Vec<i64>),
    }
    let s = |name: &str, v: f32| f32_tensor(name, &[], &[v]);
    let z = |name: &str, dt: DataType, v: i64| int_tensor(name, dt, &[], &[v]);
    let x4 = |name: &'static str, dt| In {
        name,
        dt,
        dims: vec![1, 24, 13, 17],
    };
    // (x scale, x zero point, y scale, y zero point)
    let unary = |name, op, dt, q: (f32, i64, f32, i64), attrs, out_dims: Vec<i64>| Case {
        name,
        op,
        inputs: vec!["x", "xs", "xz", "ys", "yz"],
        attrs,
        feeds: vec![x4("x", dt)],
        inits: vec![
            s("xs", q.0),
            z("xz", dt, q.1),
            s("ys", q.2),
            z("yz", dt, q.3),
        ],
        out: (dt, out_dims),
    };
    let full = vec![1, 24, 13, 17];
    let mut cases = vec![
        Case {
            name: "qadd_u8_broadcast",
            op: "QLinearAdd",
            inputs: vec!["a", "as", "az", "b", "bs", "bz", "cs", "cz"],
            attrs: vec![],
            feeds: vec![
                x4("a", u8t),
                In {
                    name: "b",
                    dt: u8t,
                    dims: vec![1, 24, 1, 1],
                },
            ],
            inits: vec![
                s("as", 0.05),
                z("az", u8t, 120),
                s("bs", 0.03),
                z("bz", u8t, 131),
                s("cs", 0.07),
                z("cz", u8t, 125),
            ],
            out: (u8t, full.clone()),
        },
        Case {
            name: "qadd_i8_no_zero",
            op: "QLinearAdd",
            inputs: vec!["a", "as", "az", "b", "bs", "bz", "cs"],
            attrs: vec![],
            feeds: vec![x4("a", i8t), x4("b", i8t)],
            inits: vec![
                s("as", 0.0513),
                z("az", i8t, -5),
                s("bs", 0.0291),
                z("bz", i8t, 3),
                s("cs", 0.0617),
            ],
            out: (i8t, full.clone()),
        },
        Case {
            name: "qmul_u8",
            op: "QLinearMul",
            inputs: vec!["a", "as", "az", "b", "bs", "bz", "cs", "cz"],
            attrs: vec![],
            feeds: vec![x4("a", u8t), x4("b", u8t)],
            inits: vec![
                s("as", 0.05),
                z("az", u8t, 120),
                s("bs", 0.03),
                z("bz", u8t, 131),
                s("cs", 0.2),
                z("cz", u8t, 128),
            ],
            out: (u8t, full.clone()),
        },
        unary(
            "qleaky_u8",
            "QLinearLeakyRelu",
            u8t,
            (0.0371, 128, 0.0313, 85),
            vec![float_attr("alpha", 0.1)],
            full.clone(),
        ),
        unary(
            "qsigmoid_i8",
            "QLinearSigmoid",
            i8t,
            (0.0371, 0, 0.00391, -128),
            vec![],
            full.clone(),
        ),
        unary(
            "qgap_u8",
            "QLinearGlobalAveragePool",
            u8t,
            (0.0371, 128, 0.00457, 131),
            vec![],
            vec![1, 24, 1, 1],
        ),
        unary(
            "qgap_i8_last",
            "QLinearGlobalAveragePool",
            i8t,
            (0.0371, 0, 0.00457, 3),
            vec![int_attr("channels_last", 1)],
            vec![1, 1, 1, 17],
        ),
        unary(
            "qavgpool_u8",
            "QLinearAveragePool",
            u8t,
            (0.0371, 128, 0.0297, 125),
            vec![
                ints_attr("kernel_shape", &[3, 3]),
                ints_attr("strides", &[2, 2]),
                ints_attr("pads", &[1, 1, 1, 1]),
                int_attr("ceil_mode", 1),
            ],
            vec![1, 24, 8, 9],
        ),
        unary(
            "qavgpool_i8_last",
            "QLinearAveragePool",
            i8t,
            (0.0371, 0, 0.0297, -2),
            vec![
                ints_attr("kernel_shape", &[2, 2]),
                ints_attr("strides", &[2, 2]),
                int_attr("channels_last", 1),
                int_attr("count_include_pad", 1),
            ],
            vec![1, 12, 6, 17],
        ),
        unary(
            "qsoftmax_u8",
            "QLinearSoftmax",
            u8t,
            (0.0371, 128, 0.00391, 0),
            vec![int_attr("opset", 13), int_attr("axis", -1)],
            full.clone(),
        ),
        unary(
            "qsoftmax_u8_v11",
            "QLinearSoftmax",
            u8t,
            (0.0371, 128, 0.000197, 0),
            vec![int_attr("opset", 11), int_attr("axis", 2)],
            full.clone(),
        ),
        Case {
            name: "qconcat_u8",
            op: "QLinearConcat",
            inputs: vec![
                "ys", "yz", "a", "as", "az", "b", "bs", "bz", "c", "cs", "cz",
            ],
            attrs: vec![int_attr("axis", 1)],
            feeds: vec![
                x4("a", u8t),
                In {
                    name: "b",
                    dt: u8t,
                    dims: vec![1, 5, 13, 17],
                },
                x4("c", u8t),
            ],
            inits: vec![
                s("ys", 0.04),
                z("yz", u8t, 128),
                s("as", 0.04),
                z("az", u8t, 128),
                s("bs", 0.02),
                z("bz", u8t, 100),
                s("cs", 0.09),
                z("cz", u8t, 140),
            ],
            out: (u8t, vec![1, 53, 13, 17]),
        },
        Case {
            name: "qwhere_u8",
            op: "QLinearWhere",
            inputs: vec!["c", "x", "xs", "xz", "w", "ws", "wz", "zs", "zz"],
            attrs: vec![],
            feeds: vec![
                In {
                    name: "c",
                    dt: DataType::Bool,
                    dims: vec![1, 24, 13, 17],
                },
                x4("x", u8t),
                In {
                    name: "w",
                    dt: u8t,
                    dims: vec![17],
                },
            ],
            inits: vec![
                s("xs", 0.04),
                z("xz", u8t, 128),
                s("ws", 0.02),
                z("wz", u8t, 100),
                s("zs", 0.05),
                z("zz", u8t, 120),
            ],
            out: (u8t, full.clone()),
        },
    ];
    // QGemm: A [37, 70] u8, B^T [45, 70] i8 with per-column scales and zero points, an
    // int32 bias, alpha 0.5; quantized to u8, and in float.
    for (name, quantized) in [("qgemm_u8", true), ("qgemm_float", false)] {
        let mut next = lcg(7);
        let cols = 45;
        let mut inits = vec![
            s("as", 0.02),
            z("az", u8t, 118),
            f32_tensor(
                "bs",
                &[cols],
                &(0..cols)
                    .map(|j| 0.01 + 0.001 * j as f32)
                    .collect::<Vec<_>>(),
            ),
            int_tensor(
                "bz",
                i8t,
                &[cols],
                &(0..cols).map(|j| j % 5 - 2).collect::<Vec<_>>(),
            ),
            int_tensor(
                "c",
                DataType::Int32,
                &[cols],
                &(0..cols)
                    .map(|_| next() % 20001 - 10000)
                    .collect::<Vec<_>>(),
            ),
        ];
        let mut inputs = vec!["a", "as", "az", "b", "bs", "bz", "c"];
        if quantized {
            inits.extend([s("ys", 0.9), z("yz", u8t, 60)]);
            inputs.extend(["ys", "yz"]);
        }
        cases.push(Case {
            name,
            op: "QGemm",
            inputs,
            attrs: vec![int_attr("transB", 1), float_attr("alpha", 0.5)],
            feeds: vec![
                In {
                    name: "a",
                    dt: u8t,
                    dims: vec![37, 70],
                },
                In {
                    name: "b",
                    dt: i8t,
                    dims: vec![cols, 70],
                },
            ],
            inits,
            out: (
                if quantized { u8t } else { DataType::Float },
                vec![37, cols],
            ),
        });
    }
    let ort_script = common::repo_root().join("tests/fixtures/ort_run.py");
    for (ci, case) in cases.iter().enumerate() {
        let node = NodeProto {
            op_type: Some(case.op.into()),
            domain: Some("com.microsoft".into()),
            name: Some(case.name.into()),
            input: case.inputs.iter().map(|s| s.to_string()).collect(),
            output: vec!["y".into()],
            attribute: case.attrs.clone(),
            ..Default::default()
        };
        let mut m = model(GraphProto {
            name: Some(case.name.into()),
            node: vec![node],
            input: case
                .feeds
                .iter()
                .map(|f| value_info(f.name, f.dt, &f.dims))
                .collect(),
            output: vec![value_info("y", case.out.0, &case.out.1)],
            initializer: case.inits.clone(),
            ..Default::default()
        });
        m.opset_import.push(OperatorSetIdProto {
            domain: Some("com.microsoft".into()),
            version: Some(1),
        });
        let mut next = lcg(100 + ci as u64);
        let feeds: Vec<Value> = case
            .feeds
            .iter()
            .map(|f| {
                let dims: Vec<usize> = f.dims.iter().map(|&d| d as usize).collect();
                let n: usize = dims.iter().product();
                Value::Tensor(match f.dt {
                    DataType::Uint8 => {
                        Tensor::from_vec(&dims, (0..n).map(|_| next() as u8).collect())
                    }
                    // QGemm's weights in 7 bits, as ONNX Runtime's quantizer makes them
                    // (`reduce_range`) for x86 without VNNI: there its u8 x s8 kernels
                    // (`vpmaddubsw`) sum pairs of products in saturating i16, so full-range
                    // weights put its own outputs off by up to 22 steps (seen on a Zen 3).
                    DataType::Int8 if case.op == "QGemm" => {
                        Tensor::from_vec(&dims, (0..n).map(|_| (next() as u8 as i8) >> 1).collect())
                    }
                    DataType::Int8 => {
                        Tensor::from_vec(&dims, (0..n).map(|_| next() as u8 as i8).collect())
                    }
                    _ => Tensor::from_vec(&dims, (0..n).map(|_| next() % 3 == 0).collect()),
                })
            })
            .collect();
        // ONNX Runtime.
        let dir = scratch.path().join(case.name);
        std::fs::create_dir_all(&dir).unwrap();
        let path = common::write_model(scratch.path(), &format!("{}_ort.onnx", case.name), &m);
        let mut cmd = Command::new("python3");
        cmd.arg(&ort_script).arg(&path).arg(dir.join("ort"));
        for (k, v) in feeds.iter().enumerate() {
            let p = dir.join(format!("input_{k}.npy"));
            io::write_npy(&p, v).unwrap();
            cmd.arg(p);
        }
        let r = cmd.output().expect("python3 runs");
        assert!(
            r.status.success(),
            "{}: onnxruntime failed:\n{}",
            case.name,
            String::from_utf8_lossy(&r.stderr)
        );
        let ort = io::from_npy(
            &std::fs::read(dir.join("ort/output_0.npy")).unwrap(),
            "ort output",
        )
        .unwrap();
        for target in ["host", "x86_64-sse4", "aarch64-neon"] {
            let (_, got, want) = compiled_and_reference(scratch.path(), &m, target, &feeds);
            assert_eq!(bits(&got[0]), bits(&want[0]), "{} on {target}", case.name);
        }
        let want = eval::run(&onnx::load(&path).unwrap().graph, feeds.clone()).unwrap();
        let want = want[0].as_tensor().unwrap();
        assert_eq!(want.dtype(), ort.dtype(), "{}", case.name);
        assert_eq!(want.shape(), ort.shape(), "{}", case.name);
        let (a, b) = (want.to_f64().unwrap(), ort.to_f64().unwrap());
        if case.out.0 == DataType::Float {
            let scale = b.iter().fold(0.0f64, |m, y| m.max(y.abs()));
            let err = a
                .iter()
                .zip(b.iter())
                .fold(0.0f64, |m, (x, y)| m.max((x - y).abs()))
                / scale;
            println!("{}: relative error {err:.2e} vs onnxruntime", case.name);
            assert!(err <= 1e-5, "{}: relative error {err:.2e}", case.name);
        } else {
            let diffs: Vec<f64> = a.iter().zip(b.iter()).map(|(x, y)| (x - y).abs()).collect();
            let (max, off) = (
                diffs.iter().fold(0.0f64, |m, &d| m.max(d)),
                diffs.iter().filter(|&&d| d != 0.0).count(),
            );
            let spread = b.iter().fold(f64::MAX, |m, &y| m.min(y))
                ..=b.iter().fold(f64::MIN, |m, &y| m.max(y));
            println!("{}: {off} of {} elements one step off onnxruntime (max {max}), outputs span {spread:?}", case.name, a.len());
            assert!(
                max <= 1.0 && off * 20 <= a.len(),
                "{}: {off} of {} differ, by up to {max}",
                case.name,
                a.len()
            );
            // A test whose outputs saturate or sit at one value would check little.
            assert!(
                spread.end() - spread.start() >= 20.0,
                "{}: outputs span only {spread:?}",
                case.name
            );
        }
    }
}

/// A whole model in ONNX Runtime's operator format, as its quantizer writes it
/// (`tests/bench/make_qdq.py --qoperator` on the resnet_tiny fixture: QLinearConv,
/// com.microsoft QLinearAdd, QLinearGlobalAveragePool and QGemm, per-channel int8
/// weights): the reference evaluator within two quantization steps of the output of
/// ONNX Runtime (run live; a step upstream may carry), and the compiled model (host and
/// aarch64 under qemu) bit for bit the reference's.
#[test]
fn qoperator_model_matches_onnxruntime() {
    let scratch = tempfile::tempdir().unwrap();
    let root = common::repo_root();
    let path = scratch.path().join("resnet_tiny_qop.onnx");
    let r = Command::new("python3")
        .arg(root.join("tests/bench/make_qdq.py"))
        .arg("--qoperator")
        .arg(root.join("tests/fixtures/resnet_tiny/model.onnx"))
        .arg(&path)
        .output()
        .expect("python3 runs");
    assert!(
        r.status.success(),
        "quantizing failed:\n{}",
        String::from_utf8_lossy(&r.stderr)
    );
    use prost::Message;
    let proto = onnxc::onnx::proto::ModelProto::decode(&*std::fs::read(&path).unwrap()).unwrap();
    let ops: BTreeSet<String> = proto
        .graph
        .as_ref()
        .unwrap()
        .node
        .iter()
        .map(|n| format!("{}.{}", n.domain(), n.op_type()))
        .collect();
    for op in [
        ".QLinearConv",
        "com.microsoft.QLinearAdd",
        "com.microsoft.QLinearGlobalAveragePool",
        "com.microsoft.QGemm",
    ] {
        assert!(ops.contains(op), "{op} not in {ops:?}");
    }
    // The output's quantization step: the scale of the last DequantizeLinear.
    let g = proto.graph.as_ref().unwrap();
    let last = g.node.last().unwrap();
    assert_eq!(last.op_type(), "DequantizeLinear");
    let step = g
        .initializer
        .iter()
        .find(|t| t.name() == last.input[1])
        .map(|t| {
            t.float_data
                .first()
                .copied()
                .unwrap_or_else(|| f32::from_le_bytes(t.raw_data()[..4].try_into().unwrap()))
        })
        .expect("a constant scale") as f64;
    let x: Vec<f32> = {
        let mut next = lcg(5);
        (0..3 * 64 * 64)
            .map(|_| (next() % 2001) as f32 / 1000.0 - 1.0)
            .collect()
    };
    let x = Value::Tensor(onnxc::ir::Tensor::from_vec(&[1, 3, 64, 64], x));
    let xin = scratch.path().join("x.npy");
    io::write_npy(&xin, &x).unwrap();
    let r = Command::new("python3")
        .arg(root.join("tests/fixtures/ort_run.py"))
        .arg(&path)
        .arg(scratch.path().join("ort"))
        .arg(&xin)
        .output()
        .expect("python3 runs");
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let ort = io::from_npy(
        &std::fs::read(scratch.path().join("ort/output_0.npy")).unwrap(),
        "ort output",
    )
    .unwrap();
    let shapes = vec![("image".to_string(), vec![1, 3, 64, 64])];
    let mut m = onnx::load(&path).unwrap();
    onnxc::passes::bind_input_shapes(&mut m.graph, &shapes).unwrap();
    let want = eval::run(&m.graph, vec![x.clone()]).unwrap();
    let w = want[0].as_tensor().unwrap().to_f64().unwrap();
    let o = ort.to_f64().unwrap();
    assert_eq!(w.shape(), o.shape());
    let off = w
        .iter()
        .zip(o.iter())
        .map(|(a, b)| (a - b).abs() / step)
        .fold(0.0f64, f64::max);
    println!(
        "resnet_tiny QOperator: reference vs onnxruntime, at most {off:.2} steps of {step:.3e}"
    );
    assert!(off <= 2.01, "{off} quantization steps from onnxruntime");
    let spread =
        o.iter().fold(f64::MIN, |m, &v| m.max(v)) - o.iter().fold(f64::MAX, |m, &v| m.min(v));
    assert!(spread >= 10.0 * step, "the logits span only {spread}");
    for target in ["host", "aarch64-neon"] {
        let opts = Options {
            target: target.into(),
            shapes: shapes.clone(),
            ..Options::default()
        };
        let c = onnxc::driver::compile_graph(m.graph.clone(), "model", &opts).unwrap();
        let dir = scratch.path().join(target);
        std::fs::create_dir_all(&dir).unwrap();
        let got = runner::run_compiled(&c, std::slice::from_ref(&x), &dir).unwrap();
        assert_eq!(bits(&got[0]), bits(&want[0]), "on {target}");
    }
}
