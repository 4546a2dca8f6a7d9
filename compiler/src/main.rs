//! The `onnxc` command line.

use clap::{Args, Parser, Subcommand, ValueEnum};
use onnxc::error::{Error, Result};
use onnxc::ir::{print_graph, Value};
use onnxc::{conformance, driver, eval, inspect, io, onnx, passes};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

/// onnxc: an ahead-of-time compiler for ONNX models.
///
/// Compiles a model into one object file plus a C header: no interpreter, no heap
/// allocation, every shape fixed at compile time.
///
///   onnxc model.onnx -o model.o                          # model.o + model.h, for this machine
///   onnxc model.onnx --target aarch64-neon -o model.o    # cross-compile for an ARM board
///   cc app.c model.o -lm -o app                          # link it (see model.h for the API)
///   onnxc model.onnx --emit report                       # arena, weights, code size (JSON)
///   onnxc inspect model.onnx                             # opsets, signature, ops, FLOPs
///   onnxc run model.onnx --input x=x.npy --output-dir out/ [--engine compiled]
///   onnxc check model.onnx                               # compiled vs reference, random inputs
///   onnxc bench model.onnx [--threads 2]                 # compiled vs ONNX Runtime, timed
///   onnxc bench model.onnx --profile 20                  # ... and each one's time per kernel
///
/// Symbolic dims (batch, sequence) are fixed with --shape NAME=1x3x224x224.
#[derive(Parser, Debug)]
#[command(
    name = "onnxc",
    version,
    args_conflicts_with_subcommands = true,
    verbatim_doc_comment
)]
struct Cli {
    #[command(subcommand)]
    cmd: Option<Cmd>,
    #[command(flatten)]
    compile: CompileArgs,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Show a model's opsets, inputs and outputs, op histogram, parameters, FLOPs and
    /// every unsupported op.
    Inspect {
        model: PathBuf,
        #[command(flatten)]
        shapes: ShapeArgs,
    },
    /// Run a model and write each output as DIR/<output name>.npy.
    Run {
        model: PathBuf,
        /// An input value: NAME=FILE, FILE being .npy or an ONNX TensorProto .pb.
        /// Inputs not given are an error.
        #[arg(long = "input", short = 'i', value_name = "NAME=FILE")]
        inputs: Vec<String>,
        /// Folder for the outputs (created if missing).
        #[arg(long, value_name = "DIR")]
        output_dir: PathBuf,
        /// Which engine runs the model.
        #[arg(long, value_enum, default_value_t = Engine::Reference)]
        engine: Engine,
        /// Also print each output (dtype, shape and its first 32 values).
        #[arg(long)]
        print: bool,
    },
    /// Run a model compiled and through the reference evaluator on the same inputs
    /// (random ones unless given) and print the largest relative error per output.
    /// Fails when an error exceeds --tolerance.
    Check {
        model: PathBuf,
        /// An input value: NAME=FILE (.npy or TensorProto .pb); the others are random.
        #[arg(long = "input", short = 'i', value_name = "NAME=FILE")]
        inputs: Vec<String>,
        /// Target to compile for (aarch64 targets run under qemu-aarch64-static).
        #[arg(long, default_value = "host")]
        target: String,
        #[arg(long = "opt-level", short = 'O', default_value_t = 2,
              value_parser = clap::value_parser!(u8).range(0..=3))]
        opt_level: u8,
        /// Seed of the random inputs.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Largest accepted relative error (max |compiled - reference| / max |reference|).
        #[arg(long, default_value_t = 1e-4)]
        tolerance: f64,
        /// Float code computes exactly kernel IR's operations in its order on every
        /// target (no fused multiply-adds in the AVX-512 loops, the portable exp/erf/tanh):
        /// the same bits as 128-bit code. Default: faster, within a few ulp.
        #[arg(long)]
        exact_math: bool,
        #[command(flatten)]
        shapes: ShapeArgs,
    },
    /// Time the compiled model and ONNX Runtime (Python `onnxruntime`, ORT_ENABLE_ALL, the
    /// same thread count) on the same random inputs, in one run, after warm-up; print
    /// median and p90, their ratio, FLOPs and the fraction of this core's measured FMA
    /// peak, and check that the outputs agree (1e-4 relative; for f16 outputs 1e-3 and
    /// for bf16 8e-3, a unit in their last place; for 8- and 16-bit integer outputs one
    /// unit).
    Bench {
        model: PathBuf,
        /// Threads for both: ONNX Runtime's intra-op threads, and the compiled model's
        /// `run_parallel` through onnxc_pool.h (the caller plus N-1 workers).
        #[arg(long, default_value_t = 1)]
        threads: usize,
        /// Timed runs of each engine.
        #[arg(long, default_value_t = 50)]
        iters: usize,
        /// Untimed runs before timing (each engine warms up for at least 200 ms too).
        #[arg(long, default_value_t = 5)]
        warmup: usize,
        /// Alternate the engines this many times, each round timing --iters runs of each,
        /// and report each engine's round with the lowest median. On a machine shared
        /// with other work, a slow spell then costs both engines a round instead of
        /// skewing the one that happened to be running.
        #[arg(long, default_value_t = 1)]
        rounds: usize,
        /// After timing, run each engine N more times timing every kernel of the compiled
        /// model (the model is compiled with its kernel table) and every node of ONNX
        /// Runtime's optimised graph (its profiler), and list where the time goes, longest
        /// first. Kernel names are the ONNX node names they were lowered from.
        #[arg(long, value_name = "N", default_value_t = 0)]
        profile: usize,
        /// Target to compile for; must run on this machine.
        #[arg(long, default_value = "host")]
        target: String,
        #[arg(long = "opt-level", short = 'O', default_value_t = 2,
              value_parser = clap::value_parser!(u8).range(0..=3))]
        opt_level: u8,
        /// Time only the compiled model.
        #[arg(long)]
        no_ort: bool,
        /// Print the result as JSON.
        #[arg(long)]
        json: bool,
        /// Keep the scratch files (objects, inputs, times) in this folder.
        #[arg(long, value_name = "DIR")]
        keep: Option<PathBuf>,
        /// Float code computes exactly kernel IR's operations in its order on every
        /// target (no fused multiply-adds in the AVX-512 loops, the portable exp/erf/tanh):
        /// the same bits as 128-bit code. Default: faster, within a few ulp.
        #[arg(long)]
        exact_math: bool,
        #[command(flatten)]
        shapes: ShapeArgs,
    },
    /// Run ONNX backend node test cases (folders of model.onnx + test_data_set_0)
    /// through the reference evaluator and report passed/failed/unsupported.
    Conformance {
        /// The folder holding one sub-folder per case.
        dir: PathBuf,
        /// Only cases whose name matches this regular expression.
        #[arg(long)]
        filter: Option<String>,
        /// Also run the wheel's other suites laid out in this folder (one sub-folder per
        /// suite, as `tests/conformance/gen_node_cases.py --other` writes them).
        #[arg(long, value_name = "DIR")]
        other: Option<PathBuf>,
        /// Print every case, not only the summary and failures.
        #[arg(long, short)]
        verbose: bool,
        /// Write the Markdown report to this file.
        #[arg(long, value_name = "FILE")]
        write_doc: Option<PathBuf>,
        /// Append a section with the results (for --compiled runs) to this Markdown file.
        #[arg(long, value_name = "FILE")]
        append_doc: Option<PathBuf>,
        /// Write the names of the passing cases, one per line, to this file.
        #[arg(long, value_name = "FILE")]
        write_pass_list: Option<PathBuf>,
        /// Run the cases compiled (object + C harness) instead of through the reference
        /// evaluator.
        #[arg(long)]
        compiled: bool,
        /// Target for --compiled (aarch64 targets run under qemu-aarch64-static).
        #[arg(long, default_value = "host")]
        target: String,
        /// The ONNX version the cases come from (for the report).
        #[arg(long, default_value = "1.23.2")]
        onnx_version: String,
    },
}

#[derive(Clone, Copy, Debug, ValueEnum, PartialEq)]
enum Engine {
    /// The ndarray reference evaluator (every supported op).
    Reference,
    /// Compile for the host, link with the system C compiler and run natively.
    Compiled,
}

#[derive(Args, Debug, Default)]
struct ShapeArgs {
    /// Fix an input's shape: NAME=1x3x224x224 (binds its symbolic dims everywhere).
    #[arg(long = "shape", value_name = "NAME=DIMS")]
    shapes: Vec<String>,
}

#[derive(Args, Debug, Default)]
struct CompileArgs {
    /// The .onnx model to compile.
    model: Option<PathBuf>,
    /// Target name (see --list-targets) or path to a target .toml file.
    #[arg(long, default_value = "host")]
    target: String,
    /// Symbol prefix of the generated API (default: the model file's stem).
    #[arg(long)]
    name: Option<String>,
    /// List the bundled targets and exit.
    #[arg(long)]
    list_targets: bool,
    /// What to produce.
    #[arg(long, value_enum, default_value_t = Emit::Obj)]
    emit: Emit,
    /// Output file (default: standard output for text).
    #[arg(short, long)]
    output: Option<PathBuf>,
    /// Graph optimisation: 0 none, 1 basic cleanup (folding, dead code, common
    /// subexpressions, no-op removal), 2 also fusion, 3 also layout choice.
    #[arg(long = "opt-level", short = 'O', default_value_t = 2,
          value_parser = clap::value_parser!(u8).range(0..=3))]
    opt_level: u8,
    /// Float code computes exactly kernel IR's operations in its order on every
    /// target (no fused multiply-adds in the AVX-512 loops, the portable exp/erf/tanh):
    /// the same bits as 128-bit code. Default: faster, within a few ulp.
    #[arg(long)]
    exact_math: bool,
    #[command(flatten)]
    shapes: ShapeArgs,
}

#[derive(Clone, Copy, Debug, Default, ValueEnum, PartialEq)]
enum Emit {
    /// A native object file (-o model.o) plus its C header (model.h).
    #[default]
    Obj,
    /// The graph IR as readable text, after shape inference.
    Ir,
    /// The kernel IR as readable text, after lowering and memory planning.
    Kir,
    /// The compile report: arena bytes and lower bound, weights, code, per-tensor offsets (JSON).
    Report,
    /// The graph after the --opt-level passes as a standard ONNX model (-o OUT.onnx;
    /// default MODEL.opt.onnx), shapes bound by --shape.
    Onnx,
}

fn parse_shape(s: &str) -> Result<(String, Vec<usize>)> {
    let (name, dims) = s.rsplit_once('=').ok_or_else(|| {
        Error::Usage(format!(
            "--shape `{s}` should be NAME=DIMS, e.g. input=1x3x224x224"
        ))
    })?;
    let dims = if dims.is_empty() || dims == "scalar" {
        Vec::new()
    } else {
        dims.split(['x', ','])
            .map(|d| d.trim().parse::<usize>())
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|_| {
                Error::Usage(format!(
                    "--shape `{s}`: dims must be numbers separated by x"
                ))
            })?
    };
    Ok((name.to_string(), dims))
}

fn load_bound(model: &Path, shapes: &ShapeArgs) -> Result<onnx::Model> {
    let mut m = onnx::load(model)?;
    let binds = shapes
        .shapes
        .iter()
        .map(|s| parse_shape(s))
        .collect::<Result<Vec<_>>>()?;
    passes::bind_input_shapes(&mut m.graph, &binds)?;
    Ok(m)
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match real_main(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn real_main(cli: Cli) -> Result<()> {
    match cli.cmd {
        Some(Cmd::Inspect { model, shapes }) => {
            let (mut m, unsupported) = onnx::load_lenient(&model)?;
            let binds = shapes
                .shapes
                .iter()
                .map(|s| parse_shape(s))
                .collect::<Result<Vec<_>>>()?;
            passes::bind_input_shapes(&mut m.graph, &binds)?;
            let mut rep = passes::infer_shapes(&mut m.graph)?;
            // What stays unresolved once control flow is inlined and unrolled, as a
            // compile does it (the report describes the model as written).
            if let Ok(r) = passes::infer_and_inline(&mut m.graph.clone()) {
                rep.unresolved = r.unresolved;
            }
            print!(
                "{}",
                inspect::report(
                    &model.display().to_string(),
                    &m.graph,
                    &m.opsets,
                    &m.producer,
                    &unsupported,
                    &rep.unresolved
                )
            );
            Ok(())
        }
        Some(Cmd::Check {
            model,
            inputs,
            target,
            opt_level,
            seed,
            tolerance,
            exact_math,
            shapes,
        }) => check(
            &model, &inputs, &target, opt_level, seed, tolerance, exact_math, &shapes,
        ),
        Some(Cmd::Bench {
            model,
            threads,
            iters,
            warmup,
            rounds,
            profile,
            target,
            opt_level,
            no_ort,
            json,
            keep,
            exact_math,
            shapes,
        }) => {
            let binds = shapes
                .shapes
                .iter()
                .map(|s| parse_shape(s))
                .collect::<Result<Vec<_>>>()?;
            let opts = onnxc::bench::BenchOptions {
                compile: driver::Options {
                    target,
                    shapes: binds,
                    opt_level,
                    exact_math,
                    ..driver::Options::default()
                },
                threads: threads.max(1),
                iters: iters.max(1),
                warmup,
                rounds: rounds.max(1),
                with_ort: !no_ort,
                peak: true,
                dir: keep,
                profile,
            };
            let r = onnxc::bench::bench(&model, &opts)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&r).expect("json"));
            } else {
                print!("{}", r.text());
            }
            if let Some((e, t)) = r
                .max_rel_err
                .iter()
                .zip(&r.tolerance)
                .find(|(e, t)| **e > **t)
            {
                let why = onnx::load(&model)
                    .ok()
                    .and_then(|m| {
                        onnxc::check::run_time_quantization_note(&m.graph)
                            .or_else(|| onnxc::check::requantization_note(&m.graph))
                    })
                    .map(|n| format!("\n  note: {n}"))
                    .unwrap_or_default();
                return Err(Error::Usage(format!(
                    "compiled outputs differ from onnxruntime's: relative error {e:.2e} > {t:.0e}{why}"
                )));
            }
            Ok(())
        }
        Some(Cmd::Run {
            model,
            inputs,
            output_dir,
            engine,
            print,
        }) => {
            let m = onnx::load(&model)?;
            let g = &m.graph;
            let mut given = std::collections::HashMap::new();
            for s in &inputs {
                let (name, file) = s
                    .split_once('=')
                    .ok_or_else(|| Error::Usage(format!("--input `{s}` should be NAME=FILE")))?;
                given.insert(name.to_string(), PathBuf::from(file));
            }
            let mut vals: Vec<Value> = Vec::new();
            let mut missing = Vec::new();
            for &id in &g.inputs {
                let info = g.value(id);
                match given.remove(&info.name) {
                    Some(p) => vals.push(io::read_value(&p, &info.ty)?),
                    None => missing.push(format!("{} ({})", info.name, info.ty)),
                }
            }
            if !missing.is_empty() {
                return Err(Error::Usage(format!(
                    "missing --input for: {}",
                    missing.join(", ")
                )));
            }
            if let Some(extra) = given.keys().next() {
                return Err(Error::Usage(format!(
                    "--input `{extra}` is not an input of the model"
                )));
            }
            eval::check_inputs(g, &vals)?;
            let outs = if engine == Engine::Compiled {
                let shapes = g
                    .inputs
                    .iter()
                    .zip(&vals)
                    .filter_map(|(&id, v)| {
                        Some((g.value(id).name.clone(), v.as_tensor()?.shape().to_vec()))
                    })
                    .collect();
                let opts = driver::Options {
                    shapes,
                    ..driver::Options::default()
                };
                let c = driver::compile_graph(m.graph.clone(), "model", &opts)?;
                let dir = std::env::temp_dir().join(format!("onnxc-run-{}", std::process::id()));
                std::fs::create_dir_all(&dir).map_err(|e| Error::Io {
                    path: dir.clone(),
                    source: e,
                })?;
                let r = onnxc::runner::run_compiled(&c, &vals, &dir);
                let _ = std::fs::remove_dir_all(&dir);
                r?
            } else {
                eval::run(g, vals)?
            };
            std::fs::create_dir_all(&output_dir).map_err(|e| Error::Io {
                path: output_dir.clone(),
                source: e,
            })?;
            for (&id, v) in g.outputs.iter().zip(&outs) {
                let name = sanitize(&g.value(id).name);
                let path = output_dir.join(format!("{name}.npy"));
                io::write_npy(&path, v)?;
                println!("{} -> {}", g.value(id).name, path.display());
                if print {
                    match v {
                        Value::Tensor(t) => println!("  {}", t.summary(32)),
                        other => println!("  {}", other.value_type()),
                    }
                }
            }
            Ok(())
        }
        Some(Cmd::Conformance {
            dir,
            filter,
            other,
            verbose,
            write_doc,
            write_pass_list,
            onnx_version,
            compiled,
            target,
            append_doc,
        }) => {
            let re = filter
                .map(|f| regex::Regex::new(&f).map_err(|e| Error::Usage(format!("--filter: {e}"))))
                .transpose()?;
            let results = if compiled {
                let scratch =
                    std::env::temp_dir().join(format!("onnxc-conf-{}", std::process::id()));
                let env = conformance::CompiledEnv::new(&target, &scratch).map_err(Error::Usage)?;
                let threads = std::thread::available_parallelism()
                    .map(|n| n.get())
                    .unwrap_or(1);
                let r = conformance::run_suite_compiled(&dir, re.as_ref(), &env, threads);
                let _ = std::fs::remove_dir_all(&scratch);
                r.map_err(|e| Error::Io {
                    path: dir.clone(),
                    source: e,
                })?
            } else {
                conformance::run_suite(&dir, re.as_ref()).map_err(|e| Error::Io {
                    path: dir.clone(),
                    source: e,
                })?
            };
            let others = match &other {
                Some(o) => conformance::run_other_suites(o).map_err(|e| Error::Io {
                    path: o.clone(),
                    source: e,
                })?,
                None => Vec::new(),
            };
            if !others.is_empty() {
                let (p, f, u) = conformance::counts(&others);
                println!(
                    "other suites: {} cases: {p} passed, {f} failed, {u} unsupported",
                    others.len()
                );
            }
            for r in results.iter().chain(&others) {
                match &r.status {
                    conformance::Status::Passed if verbose => println!("PASS {}", r.name),
                    conformance::Status::Failed(w) => println!("FAIL {}: {w}", r.name),
                    conformance::Status::Unsupported(w) if verbose => {
                        println!("UNSUPPORTED {}: {w}", r.name)
                    }
                    _ => {}
                }
            }
            let (p, f, u) = conformance::counts(&results);
            println!(
                "{} cases: {p} passed, {f} failed, {u} unsupported",
                results.len()
            );
            if let Some(path) = write_doc {
                std::fs::write(
                    &path,
                    conformance::markdown(&results, &others, &onnx_version),
                )
                .map_err(|e| Error::Io {
                    path: path.clone(),
                    source: e,
                })?;
            }
            if let Some(path) = append_doc {
                let t = onnxc::targets::Target::load(&target).map_err(Error::Usage)?;
                let mut doc = std::fs::read_to_string(&path).unwrap_or_default();
                doc.push_str(&conformance::markdown_compiled(
                    &results, &target, &t.triple,
                ));
                std::fs::write(&path, doc).map_err(|e| Error::Io {
                    path: path.clone(),
                    source: e,
                })?;
            }
            if let Some(path) = write_pass_list {
                let mut s: String = results
                    .iter()
                    .chain(&others)
                    .filter(|r| r.status == conformance::Status::Passed)
                    .map(|r| format!("{}\n", r.name))
                    .collect();
                if s.is_empty() {
                    s.push('\n');
                }
                std::fs::write(&path, s).map_err(|e| Error::Io {
                    path: path.clone(),
                    source: e,
                })?;
            }
            Ok(())
        }
        None => compile(cli.compile),
    }
}

fn compile(args: CompileArgs) -> Result<()> {
    if args.list_targets {
        for (name, desc) in onnxc::targets::Target::list() {
            println!("{name:16} {desc}");
        }
        return Ok(());
    }
    let model = args
        .model
        .ok_or_else(|| Error::Usage("no model given; see `onnxc --help`".into()))?;
    let binds = args
        .shapes
        .shapes
        .iter()
        .map(|s| parse_shape(s))
        .collect::<Result<Vec<_>>>()?;
    if args.emit == Emit::Ir {
        let mut m = load_bound(&model, &args.shapes)?;
        passes::check_static_inputs(&m.graph)?;
        let rep = passes::infer_shapes(&mut m.graph)?;
        let mut text = print_graph(&m.graph);
        if !rep.unresolved.is_empty() {
            text.push_str(&format!(
                "# shapes not inferred:\n#   {}\n",
                rep.unresolved.join("\n#   ")
            ));
        }
        return write_text(args.output.as_deref(), &text);
    }
    let opts = driver::Options {
        name: args.name.clone(),
        target: args.target.clone(),
        shapes: binds,
        opt_level: args.opt_level,
        exact_math: args.exact_math,
        ..driver::Options::default()
    };
    if args.emit == Emit::Onnx {
        let mut m = onnx::load(&model)?;
        let target = onnxc::targets::Target::load(&opts.target).map_err(Error::Usage)?;
        m.graph.int8_dot = driver::int8_dot(&target);
        let mut known = driver::prepare(&mut m.graph, &opts)?;
        let stats = driver::optimize(&mut m.graph, opts.opt_level, &mut known)?;
        let bytes = onnxc::emit::onnx::model_bytes(&m.graph, &m.opsets, m.ir_version);
        let out = args
            .output
            .unwrap_or_else(|| model.with_extension("opt.onnx"));
        std::fs::write(&out, bytes).map_err(|e| Error::Io {
            path: out.clone(),
            source: e,
        })?;
        let before = stats
            .first()
            .map_or(m.graph.node_count(), |s| s.nodes_before);
        eprintln!(
            "wrote {}: {} nodes (was {before}) after -O{}",
            out.display(),
            m.graph.node_count(),
            opts.opt_level
        );
        return Ok(());
    }
    let c = driver::compile_file(&model, &opts)?;
    match args.emit {
        Emit::Kir => write_text(
            args.output.as_deref(),
            &onnxc::kir::print_program(&c.lowered.program),
        ),
        Emit::Report => {
            let json = serde_json::to_string_pretty(&c.artifacts.report).expect("json");
            let plan = &c.lowered.plan;
            eprintln!(
                "arena {} bytes (lower bound {}), {} kernels, object {} bytes",
                plan.arena_bytes,
                plan.lower_bound,
                c.lowered.program.kernels.len(),
                c.artifacts.object.len()
            );
            write_text(args.output.as_deref(), &format!("{json}\n"))
        }
        _ => {
            let out = args.output.unwrap_or_else(|| model.with_extension("o"));
            let header = out.with_extension("h");
            std::fs::write(&out, &c.artifacts.object).map_err(|e| Error::Io {
                path: out.clone(),
                source: e,
            })?;
            std::fs::write(&header, &c.artifacts.header).map_err(|e| Error::Io {
                path: header.clone(),
                source: e,
            })?;
            let rt = header.with_file_name("onnxc_runtime.h");
            std::fs::write(&rt, onnxc::runner::RUNTIME_H).map_err(|e| Error::Io {
                path: rt.clone(),
                source: e,
            })?;
            let pool = header.with_file_name("onnxc_pool.h");
            std::fs::write(&pool, onnxc::runner::POOL_H).map_err(|e| Error::Io {
                path: pool.clone(),
                source: e,
            })?;
            eprintln!(
                "wrote {} ({} bytes), {} and {} for target {}: arena {} bytes, call {}_run()",
                out.display(),
                c.artifacts.object.len(),
                header.display(),
                rt.display(),
                c.target.name,
                c.lowered.plan.arena_bytes,
                c.prefix
            );
            Ok(())
        }
    }
}

/// `onnxc check`: compiled vs reference on the same inputs.
#[allow(clippy::too_many_arguments)]
fn check(
    model: &Path,
    inputs: &[String],
    target: &str,
    opt_level: u8,
    seed: u64,
    tolerance: f64,
    exact_math: bool,
    shapes: &ShapeArgs,
) -> Result<()> {
    let m = onnx::load(model)?;
    let binds = shapes
        .shapes
        .iter()
        .map(|s| parse_shape(s))
        .collect::<Result<Vec<_>>>()?;
    let opts = driver::Options {
        target: target.to_string(),
        shapes: binds,
        opt_level,
        exact_math,
        ..driver::Options::default()
    };
    // The static signature decides the random inputs.
    let mut bound = m.graph.clone();
    driver::prepare(&mut bound, &opts)?;
    let mut vals = onnxc::check::random_inputs(&bound, seed)?;
    for s in inputs {
        let (name, file) = s
            .split_once('=')
            .ok_or_else(|| Error::Usage(format!("--input `{s}` should be NAME=FILE")))?;
        let k = bound
            .inputs
            .iter()
            .position(|&i| bound.value(i).name == name)
            .ok_or_else(|| {
                Error::Usage(format!("--input `{name}` is not an input of the model"))
            })?;
        vals[k] = io::read_value(Path::new(file), &bound.value(bound.inputs[k]).ty)?;
    }
    eval::check_inputs(&bound, &vals)?;
    let want = eval::run(&m.graph, vals.clone())?;
    let stem = model
        .file_stem()
        .and_then(|s| s.to_str())
        .unwrap_or("model");
    let c = driver::compile_graph(m.graph.clone(), &onnxc::emit::c_ident(stem), &opts)?;
    let dir = std::env::temp_dir().join(format!("onnxc-check-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| Error::Io {
        path: dir.clone(),
        source: e,
    })?;
    let got = onnxc::runner::run_compiled(&c, &vals, &dir);
    let _ = std::fs::remove_dir_all(&dir);
    let got = got?;
    let mut over = false;
    println!(
        "{} compiled for {} (-O{opt_level}) vs the reference evaluator, seed {seed}:",
        model.display(),
        c.target.name
    );
    for ((g, w), &o) in got.iter().zip(&want).zip(&m.graph.outputs) {
        let name = &m.graph.value(o).name;
        let (Some(g), Some(w)) = (g.as_tensor(), w.as_tensor()) else {
            return Err(Error::Usage(format!("output `{name}` is not a tensor")));
        };
        let e = onnxc::check::rel_err(g, w)
            .map_err(|e| Error::Usage(format!("output `{name}`: {e}")))?;
        // A dequantized output may be one quantization step off.
        let step = onnxc::check::dequantized_tolerance(&m.graph, o, w).filter(|&t| t > tolerance);
        let note = match step {
            Some(t) => format!(" ({:.1} quantization steps)", e / t * 1.001),
            None => String::new(),
        };
        over |= e > step.unwrap_or(tolerance);
        println!(
            "  {name:24} {:?}  max relative error {e:.2e}{note}",
            g.shape()
        );
    }
    if over {
        let why = onnxc::check::run_time_quantization_note(&m.graph)
            .map(|n| format!("\n  note: {n}"))
            .unwrap_or_default();
        return Err(Error::Usage(format!(
            "an output exceeds its tolerance ({tolerance:.0e}, or one quantization step for \
             a DequantizeLinear's output){why}"
        )));
    }
    Ok(())
}

fn write_text(path: Option<&Path>, text: &str) -> Result<()> {
    match path {
        Some(p) => std::fs::write(p, text).map_err(|e| Error::Io {
            path: p.to_path_buf(),
            source: e,
        }),
        None => {
            print!("{text}");
            Ok(())
        }
    }
}

fn sanitize(name: &str) -> String {
    name.chars()
        .map(|c| {
            if c.is_alphanumeric() || c == '_' || c == '-' || c == '.' {
                c
            } else {
                '_'
            }
        })
        .collect()
}
