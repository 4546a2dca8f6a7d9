//! `onnxc bench`: in one run, times a compiled model and ONNX Runtime on the same inputs
//! (after warm-up), checks that their outputs agree, and reports medians, p90s, the
//! ratio, the model's FLOPs and the fraction of this core's measured FMA peak.
//!
//! The compiled model runs under `runner/bench.c` (linked with the system C compiler);
//! ONNX Runtime runs under `runner/ort_bench.py` (the Python `onnxruntime` package,
//! ORT_ENABLE_ALL, the same thread count); the peak comes from `runner/peak.c`.

use crate::check::{random_inputs, rel_err};
use crate::driver::{self, Options};
use crate::error::{Error, Result};
use crate::runner::{self, io, read_outputs, run_cmd, Toolchain};
use serde::Serialize;
use std::path::{Path, PathBuf};
use std::process::Command;

pub const BENCH_C: &str = include_str!("runner/bench.c");
pub const PEAK_C: &str = include_str!("runner/peak.c");
pub const ORT_BENCH_PY: &str = include_str!("runner/ort_bench.py");

/// What to benchmark and how.
#[derive(Clone, Debug)]
pub struct BenchOptions {
    pub compile: Options,
    pub threads: usize,
    pub iters: usize,
    pub warmup: usize,
    /// Rounds alternating the engines, `iters` timed runs of each per round.
    pub rounds: usize,
    /// Also time ONNX Runtime (needs `python3` with `onnxruntime`).
    pub with_ort: bool,
    /// Measure the core's FMA peak for the target's widest vectors.
    pub peak: bool,
    /// Scratch folder (kept when given; a temporary one is removed otherwise).
    pub dir: Option<PathBuf>,
    /// After timing, run each engine this many more times with per-kernel (per-node)
    /// timing and report where the time goes; 0: no profile.
    pub profile: usize,
}

/// One kernel of the compiled model, or one node of ONNX Runtime's optimised graph, and
/// its mean time per run in the profile runs.
#[derive(Clone, Debug, Serialize)]
pub struct Span {
    pub name: String,
    /// ONNX Runtime's op type (empty for the compiled model's kernels).
    pub op: String,
    pub ms: f64,
}

/// Where each engine's time goes (`--profile`), longest first.
#[derive(Clone, Debug, Serialize)]
pub struct Profile {
    pub runs: usize,
    pub onnxc: Vec<Span>,
    pub ort: Vec<Span>,
}

/// Kernels (nodes) the text report lists per engine.
const PROFILE_TOP: usize = 25;

/// Median, 90th percentile and fastest run of a round, in milliseconds.
#[derive(Clone, Debug, Serialize)]
pub struct Timing {
    pub median_ms: f64,
    pub p90_ms: f64,
    /// The fastest run: the statistic the FMA peak is measured by (best of its loops).
    pub min_ms: f64,
    pub runs: usize,
}

impl Timing {
    fn from_ns(mut ns: Vec<u64>) -> Option<Timing> {
        if ns.is_empty() {
            return None;
        }
        ns.sort_unstable();
        let at = |q: f64| ns[((ns.len() - 1) as f64 * q).round() as usize] as f64 / 1e6;
        Some(Timing {
            median_ms: at(0.5),
            p90_ms: at(0.9),
            min_ms: at(0.0),
            runs: ns.len(),
        })
    }

    /// The round with the lowest median (its median and p90; `runs` counts every round):
    /// a slow spell of a shared machine that lasts a round leaves the others.
    fn best_round(rounds: Vec<Vec<u64>>) -> Option<Timing> {
        let runs = rounds.iter().map(Vec::len).sum();
        let best = rounds
            .into_iter()
            .filter_map(Timing::from_ns)
            .min_by(|a, b| a.median_ms.total_cmp(&b.median_ms))?;
        Some(Timing { runs, ..best })
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct BenchReport {
    pub model: String,
    pub target: String,
    pub threads: usize,
    /// Threads the compiled model ran on (through `run_parallel` and onnxc_pool.h).
    pub onnxc_threads: usize,
    /// Rounds alternating the engines; the timings are each engine's best round.
    pub rounds: usize,
    pub flops: Option<u64>,
    pub onnxc: Timing,
    pub ort: Option<Timing>,
    pub ort_version: Option<String>,
    /// onnxc median / ONNX Runtime median (below 1: onnxc is faster).
    pub ratio: Option<f64>,
    /// Largest relative error of each output against ONNX Runtime's.
    pub max_rel_err: Vec<f64>,
    /// The relative error each output may have ([`crate::check::tolerance`] of its type;
    /// for 8- and 16-bit integer outputs [`crate::check::quantized_tolerance`], for
    /// outputs of a DequantizeLinear [`crate::check::dequantized_tolerance`]).
    pub tolerance: Vec<f64>,
    /// The core's measured FP32 FMA peak for the target's vectors, GFLOP/s.
    pub peak_gflops: Option<f64>,
    pub kernels: usize,
    pub arena_bytes: u64,
    pub profile: Option<Profile>,
}

impl BenchReport {
    /// Achieved GFLOP/s of a timing.
    pub fn gflops(&self, t: &Timing) -> Option<f64> {
        self.flops.map(|f| f as f64 / (t.median_ms * 1e-3) / 1e9)
    }

    /// A readable summary.
    pub fn text(&self) -> String {
        let mut s = format!(
            "{} on {} ({} thread{}; onnxc used {}), {} kernels, arena {} bytes\n",
            self.model,
            self.target,
            self.threads,
            if self.threads == 1 { "" } else { "s" },
            self.onnxc_threads,
            self.kernels,
            self.arena_bytes
        );
        let pct = |t: &Timing| match (self.gflops(t), self.peak_gflops) {
            (Some(g), Some(p)) => format!("{g:8.1} GFLOP/s {:5.1}% of peak", 100.0 * g / p),
            (Some(g), None) => format!("{g:8.1} GFLOP/s"),
            _ => String::new(),
        };
        let row = |name: &str, t: &Timing| {
            format!(
                "  {name:12} median {:9.3} ms  p90 {:9.3} ms  {}\n",
                t.median_ms,
                t.p90_ms,
                pct(t)
            )
        };
        if self.rounds > 1 {
            let what = if self.ort.is_some() {
                "each engine's best of {} rounds, the engines alternating"
            } else {
                "the best of {} rounds"
            };
            s.push_str(&format!(
                "  ({})\n",
                what.replace("{}", &self.rounds.to_string())
            ));
        }
        s.push_str(&row("onnxc", &self.onnxc));
        if let Some(o) = &self.ort {
            s.push_str(&row("onnxruntime", o));
        }
        if let Some(r) = self.ratio {
            s.push_str(&format!(
                "  ratio onnxc/onnxruntime {r:.3} ({})\n",
                if r <= 1.0 {
                    "onnxc faster"
                } else {
                    "onnxruntime faster"
                }
            ));
        }
        if let Some(f) = self.flops {
            s.push_str(&format!("  FLOPs {:.3} G", f as f64 / 1e9));
            if let Some(p) = self.peak_gflops {
                s.push_str(&format!(", measured core peak {p:.1} GFLOP/s"));
            }
            s.push('\n');
        }
        if !self.max_rel_err.is_empty() {
            let e: Vec<String> = self
                .max_rel_err
                .iter()
                .map(|e| format!("{e:.2e}"))
                .collect();
            s.push_str(&format!(
                "  outputs vs onnxruntime: max relative error {}\n",
                e.join(", ")
            ));
        }
        if let Some(p) = &self.profile {
            s.push_str(&p.text());
        }
        s
    }
}

impl Profile {
    /// Each engine's longest kernels (nodes), with the sum of all of them: timed one
    /// by one, so the sums run a little over the medians above.
    fn text(&self) -> String {
        let mut s = String::new();
        for (engine, spans) in [
            ("onnxc kernels", &self.onnxc),
            ("onnxruntime nodes", &self.ort),
        ] {
            if spans.is_empty() {
                continue;
            }
            let total: f64 = spans.iter().map(|k| k.ms).sum();
            s.push_str(&format!(
                "  {engine}, mean of {} profiled runs, {} in all, {total:.3} ms:\n",
                self.runs,
                spans.len()
            ));
            for k in spans.iter().take(PROFILE_TOP) {
                let op = if k.op.is_empty() {
                    String::new()
                } else {
                    format!("{:14} ", k.op)
                };
                s.push_str(&format!(
                    "    {:8.3} ms {:5.1}%  {op}{}\n",
                    k.ms,
                    100.0 * k.ms / total.max(1e-12),
                    k.name
                ));
            }
            if spans.len() > PROFILE_TOP {
                let rest: f64 = spans[PROFILE_TOP..].iter().map(|k| k.ms).sum();
                s.push_str(&format!(
                    "    {rest:8.3} ms {:5.1}%  ({} more)\n",
                    100.0 * rest / total.max(1e-12),
                    spans.len() - PROFILE_TOP
                ));
            }
        }
        let pairs = self.matched();
        if !pairs.is_empty() {
            s.push_str(
                "  kernels against the nodes whose names they share most of (a guess from \
                 the names: a fused kernel gathers its nodes), largest difference first:\n",
            );
            for (k, ort, n) in pairs.iter().take(PROFILE_TOP) {
                s.push_str(&format!(
                    "    {:8.3} ms vs {ort:8.3} ms ({n} node{}) {:+8.3}  {}\n",
                    k.ms,
                    if *n == 1 { "" } else { "s" },
                    k.ms - ort,
                    k.name
                ));
            }
        }
        s
    }

    /// Each ONNX Runtime node charged to the kernel whose name shares the longest prefix
    /// with it (the first such kernel in run order, "kN " aside): per kernel, its time,
    /// the nodes' time and their count, by the difference, largest first. Layout
    /// reorders and other nodes of no ONNX node's name charge to where they share most.
    pub fn matched(&self) -> Vec<(&Span, f64, usize)> {
        if self.onnxc.is_empty() || self.ort.is_empty() {
            return Vec::new();
        }
        // Each kernel's run order and its node name ("kN name").
        let keys: Vec<(usize, &str)> = self
            .onnxc
            .iter()
            .map(|k| match k.name.split_once(' ') {
                Some((i, n)) => (
                    i.strip_prefix('k')
                        .and_then(|r| r.parse().ok())
                        .unwrap_or(usize::MAX),
                    n,
                ),
                None => (usize::MAX, k.name.as_str()),
            })
            .collect();
        let mut sum = vec![(0.0, 0usize); self.onnxc.len()];
        for node in &self.ort {
            let common = |n: &str| {
                n.bytes()
                    .zip(node.name.bytes())
                    .take_while(|(a, b)| a == b)
                    .count()
            };
            let best =
                (0..keys.len()).max_by_key(|&i| (common(keys[i].1), std::cmp::Reverse(keys[i].0)));
            if let Some(i) = best {
                sum[i].0 += node.ms;
                sum[i].1 += 1;
            }
        }
        let mut pairs: Vec<(&Span, f64, usize)> = self
            .onnxc
            .iter()
            .zip(sum)
            .map(|(k, (ms, n))| (k, ms, n))
            .collect();
        pairs.sort_by(|a, b| (b.0.ms - b.1).total_cmp(&(a.0.ms - a.1)));
        pairs
    }
}

/// Reads "mean_ns name" (the compiled model) or "mean_ns op name" (ONNX Runtime) lines,
/// longest first.
fn read_spans(path: &Path, with_op: bool) -> Result<Vec<Span>> {
    let text = std::fs::read_to_string(path).map_err(io(path))?;
    let mut spans: Vec<Span> = text
        .lines()
        .filter_map(|l| {
            let (ns, rest) = l.split_once(' ')?;
            let (op, name) = if with_op {
                let (op, name) = rest.split_once(' ')?;
                (op.to_string(), name.to_string())
            } else {
                (String::new(), rest.to_string())
            };
            Some(Span {
                name,
                op,
                ms: ns.trim().parse::<f64>().ok()? / 1e6,
            })
        })
        .collect();
    spans.sort_by(|a, b| b.ms.total_cmp(&a.ms));
    Ok(spans)
}

fn read_times(path: &Path) -> Result<Vec<u64>> {
    let text = std::fs::read_to_string(path).map_err(io(path))?;
    Ok(text.lines().filter_map(|l| l.trim().parse().ok()).collect())
}

/// The peak ISA name `peak.c` understands for a target.
fn peak_isa(t: &crate::targets::Target) -> Option<&'static str> {
    if !t.triple.starts_with(std::env::consts::ARCH) || !t.triple.starts_with("x86_64") {
        return None;
    }
    Some(if t.has("avx512f") {
        "avx512"
    } else if t.has("avx2") && t.has("fma") {
        "avx2"
    } else {
        "sse"
    })
}

/// Measures the core's FP32 FMA peak (GFLOP/s) for `isa` (avx512, avx2 or sse).
pub fn measure_peak(dir: &Path, isa: &str) -> Result<f64> {
    let src = dir.join("peak.c");
    std::fs::write(&src, PEAK_C).map_err(io(&src))?;
    let exe = dir.join("peak");
    run_cmd(
        Command::new("cc").arg("-O2").arg(&src).arg("-o").arg(&exe),
        "compiling the peak benchmark",
    )?;
    let out = run_cmd(Command::new(&exe).arg(isa), "measuring the FMA peak")?;
    out.trim()
        .parse()
        .map_err(|_| Error::Usage(format!("peak benchmark printed `{}`", out.trim())))
}

/// Benchmarks one model.
pub fn bench(model: &Path, opts: &BenchOptions) -> Result<BenchReport> {
    let mut copts = opts.compile.clone();
    copts.kernel_table |= opts.profile > 0;
    let c = driver::compile_file(model, &copts)?;
    let tc = Toolchain::for_triple(&c.target.triple);
    if !tc.exec.is_empty() {
        return Err(Error::Usage(format!(
            "target `{}` does not run natively here; benchmarks need the host's ISA",
            c.target.name
        )));
    }
    let tmp;
    let dir = match &opts.dir {
        Some(d) => d.clone(),
        None => {
            tmp = std::env::temp_dir().join(format!("onnxc-bench-{}", std::process::id()));
            tmp.clone()
        }
    };
    std::fs::create_dir_all(&dir).map_err(io(&dir))?;
    let result = bench_in(model, opts, &c, &tc, &dir);
    if opts.dir.is_none() {
        let _ = std::fs::remove_dir_all(&dir);
    }
    result
}

fn bench_in(
    model: &Path,
    opts: &BenchOptions,
    c: &driver::Compiled,
    tc: &Toolchain,
    dir: &Path,
) -> Result<BenchReport> {
    let g = &c.graph;
    let inputs = random_inputs(g, 42)?;
    for (k, v) in inputs.iter().enumerate() {
        let t = v.as_tensor().expect("random inputs are tensors");
        let bytes = crate::ops::lowering::tensor_bytes(t).map_err(|e| Error::Usage(e.0))?;
        let p = dir.join(format!("in_{k}.bin"));
        std::fs::write(&p, bytes).map_err(io(&p))?;
        crate::io::write_npy(&dir.join(format!("in_{k}.npy")), v)?;
    }
    // The compiled model.
    let obj = dir.join("model.o");
    std::fs::write(&obj, &c.artifacts.object).map_err(io(&obj))?;
    std::fs::write(dir.join("onnxc_runtime.h"), runner::RUNTIME_H).map_err(io(dir))?;
    std::fs::write(dir.join("onnxc_pool.h"), runner::POOL_H).map_err(io(dir))?;
    let src = dir.join("bench.c");
    std::fs::write(&src, BENCH_C).map_err(io(&src))?;
    let exe = dir.join("bench");
    let mut cc = Command::new(&tc.cc);
    if opts.profile > 0 {
        cc.arg(format!("-DONNXC_KERNELS={}_kernels", c.prefix));
    }
    run_cmd(
        cc.arg("-O2")
            .arg(format!("-DONNXC_MODEL={}_model", c.prefix))
            .arg("-I")
            .arg(dir)
            .arg(&src)
            .arg(&obj)
            .arg("-lm")
            .arg("-pthread")
            .arg("-o")
            .arg(&exe),
        "linking the benchmark",
    )?;
    let run_onnxc = |profile: usize| -> Result<Vec<u64>> {
        run_cmd(
            Command::new(&exe)
                .arg(dir)
                .arg(opts.iters.to_string())
                .arg(opts.warmup.to_string())
                .arg(opts.threads.to_string())
                .arg(profile.to_string()),
            "running the compiled model",
        )?;
        read_times(&dir.join("times_ns.txt"))
    };
    let shapes = g
        .outputs
        .iter()
        .map(|&o| {
            let ty = &g.value(o).ty;
            match (ty.dtype(), ty.static_shape()) {
                (Some(dt), Some(shape)) => Ok((dt, shape)),
                _ => Err(Error::Shape(format!(
                    "output `{}` has no static type",
                    g.value(o).name
                ))),
            }
        })
        .collect::<Result<Vec<_>>>()?;
    // ONNX Runtime on the same inputs, alternating with the compiled model by rounds.
    let (mut ort, mut ort_version, mut errs) = (None, None, Vec::new());
    let ort_files = if opts.with_ort {
        let py = dir.join("ort_bench.py");
        std::fs::write(&py, ORT_BENCH_PY).map_err(io(&py))?;
        Some((py, std::fs::canonicalize(model).map_err(io(model))?))
    } else {
        None
    };
    let (mut onnxc_ns, mut ort_ns, mut outs) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..opts.rounds {
        // The profile runs come after the last round's timed runs.
        let last = round + 1 == opts.rounds;
        let profile = if last { opts.profile } else { 0 };
        onnxc_ns.push(run_onnxc(profile)?);
        if round == 0 {
            outs = read_outputs(dir, &shapes)?;
        }
        if let Some((py, abs)) = &ort_files {
            let v = run_cmd(
                Command::new("python3")
                    .arg(py)
                    .arg(abs)
                    .arg(dir)
                    .arg(opts.threads.to_string())
                    .arg(opts.iters.to_string())
                    .arg(opts.warmup.to_string())
                    .arg(profile.to_string()),
                "running ONNX Runtime (python3 with onnxruntime)",
            )?;
            ort_version = Some(v.trim().to_string());
            ort_ns.push(read_times(&dir.join("ort_times_ns.txt"))?);
        }
    }
    let profile = if opts.profile > 0 {
        Some(Profile {
            runs: opts.profile,
            onnxc: read_spans(&dir.join("kernels_ns.txt"), false)?,
            ort: if opts.with_ort {
                read_spans(&dir.join("ort_nodes_ns.txt"), true)?
            } else {
                Vec::new()
            },
        })
    } else {
        None
    };
    // The model as written (before fusion): FLOPs, and which outputs a
    // DequantizeLinear makes.
    let mut orig = crate::onnx::load(model)?;
    driver::prepare(&mut orig.graph, &opts.compile)?;
    let mut tolerance: Vec<f64> = g
        .outputs
        .iter()
        .map(|&o| crate::check::tolerance(g.value(o).ty.dtype()))
        .collect();
    if opts.with_ort {
        ort = Timing::best_round(ort_ns);
        for (k, (got, &o)) in outs.iter().zip(&g.outputs).enumerate() {
            let p = dir.join(format!("ort_out_{k}.npy"));
            let want = crate::io::read_value(&p, &g.value(o).ty)?;
            let want = want.as_tensor().expect("npy holds a tensor");
            let written = orig.graph.outputs.get(k).copied();
            if let Some(t) = crate::check::quantized_tolerance(want).or_else(|| {
                written.and_then(|w| crate::check::dequantized_tolerance(&orig.graph, w, want))
            }) {
                tolerance[k] = tolerance[k].max(t);
            }
            errs.push(rel_err(got, want).map_err(|e| {
                Error::Usage(format!(
                    "output {k} (`{}`) disagrees with onnxruntime: {e}",
                    g.value(o).name
                ))
            })?);
        }
    }
    let peak_gflops = match (opts.peak, peak_isa(&c.target)) {
        (true, Some(isa)) => Some(measure_peak(dir, isa)?),
        _ => None,
    };
    // FLOPs of the model as written (fused nodes do not count theirs).
    let flops = crate::inspect::summarize(&orig.graph).flops;
    let onnxc = Timing::best_round(onnxc_ns)
        .ok_or_else(|| Error::Usage("the benchmark wrote no times".into()))?;
    let ratio = ort.as_ref().map(|o| onnxc.median_ms / o.median_ms);
    Ok(BenchReport {
        model: model.display().to_string(),
        target: c.target.name.clone(),
        threads: opts.threads,
        onnxc_threads: opts.threads.max(1),
        rounds: opts.rounds,
        flops,
        onnxc,
        ort,
        ort_version,
        ratio,
        max_rel_err: errs,
        tolerance,
        peak_gflops,
        kernels: c.lowered.program.kernels.len(),
        arena_bytes: c.lowered.plan.arena_bytes,
        profile,
    })
}
