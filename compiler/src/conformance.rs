//! Runs the ONNX backend node test cases (`CASE/model.onnx` plus
//! `CASE/test_data_set_0/{input,output}_K.pb`) and compares outputs the way ONNX's own
//! runner does: |a-b| <= atol + rtol*|b|, NaN equals NaN, integers and strings exact.

use crate::error::Error;
use crate::ir::{DType, Tensor, Value};
use crate::{eval, onnx};
use std::collections::BTreeMap;
use std::fmt::Write;
use std::path::{Path, PathBuf};

pub const RTOL: f64 = 1e-3;
pub const ATOL: f64 = 1e-7;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Status {
    Passed,
    Failed(String),
    Unsupported(String),
}

#[derive(Clone, Debug)]
pub struct CaseResult {
    pub name: String,
    pub op: String,
    pub status: Status,
}

/// Every case folder under `dir` (folders holding a `model.onnx`), sorted by name.
pub fn list_cases(dir: &Path) -> std::io::Result<Vec<PathBuf>> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.join("model.onnx").is_file())
        .collect();
    v.sort();
    Ok(v)
}

/// The op each case tests, from `ops.tsv` (written by the case generator) if present.
pub fn case_ops(dir: &Path) -> BTreeMap<String, String> {
    let mut m = BTreeMap::new();
    if let Ok(s) = std::fs::read_to_string(dir.join("ops.tsv")) {
        for line in s.lines() {
            if let Some((c, o)) = line.split_once('\t') {
                m.insert(c.to_string(), o.to_string());
            }
        }
    }
    m
}

/// Runs one case through the reference evaluator.
pub fn run_case(case: &Path) -> Status {
    let result = std::panic::catch_unwind(|| run_case_inner(case));
    match result {
        Ok(s) => s,
        Err(p) => {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            Status::Failed(format!("panic: {msg}"))
        }
    }
}

/// Cases whose expected outputs cannot be reproduced by any implementation: ONNX drew
/// them from NumPy's unseeded global random state (see onnx's case/node/bernoulli.py).
const NONDETERMINISTIC: &[&str] = &["test_bernoulli"];

fn run_case_inner(case: &Path) -> Status {
    let name = case
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or_default();
    if NONDETERMINISTIC.iter().any(|p| name.starts_with(p)) {
        return Status::Unsupported(
            "non-deterministic: the expected output was drawn from NumPy's unseeded random state"
                .into(),
        );
    }
    let model = match onnx::load(&case.join("model.onnx")) {
        Ok(m) => m,
        Err(Error::Unsupported(v)) => return Status::Unsupported(v.join("; ")),
        Err(e) => return Status::Failed(format!("import: {e}")),
    };
    let g = &model.graph;
    let data = case.join("test_data_set_0");
    let mut inputs = Vec::new();
    for (k, &id) in g.inputs.iter().enumerate() {
        let p = data.join(format!("input_{k}.pb"));
        match crate::io::read_value(&p, &g.value(id).ty) {
            Ok(v) => inputs.push(v),
            Err(e) => return Status::Failed(format!("reading {}: {e}", p.display())),
        }
    }
    let outputs = match eval::run(g, inputs) {
        Ok(o) => o,
        Err(Error::Eval { node, msg }) if msg.starts_with(crate::ir::UNSUPPORTED_PREFIX) => {
            return Status::Unsupported(format!("{node}: {msg}"))
        }
        Err(e) => return Status::Failed(e.to_string()),
    };
    for (k, &id) in g.outputs.iter().enumerate() {
        let p = data.join(format!("output_{k}.pb"));
        let expected = match crate::io::read_value(&p, &g.value(id).ty) {
            Ok(v) => v,
            Err(e) => return Status::Failed(format!("reading {}: {e}", p.display())),
        };
        if let Err(e) = compare_values(&outputs[k], &expected) {
            return Status::Failed(format!("output {k} `{}`: {e}", g.value(id).name));
        }
    }
    Status::Passed
}

/// Where compiled cases are built and run.
pub struct CompiledEnv {
    pub target: String,
    pub triple: String,
    pub toolchain: crate::runner::Toolchain,
    pub harness: PathBuf,
    pub scratch: PathBuf,
}

impl CompiledEnv {
    /// Prepares the C harness for `target` in `scratch`.
    pub fn new(target: &str, scratch: &Path) -> Result<CompiledEnv, String> {
        let t = crate::targets::Target::load(target)?;
        let tc = crate::runner::Toolchain::for_triple(&t.triple);
        if !tc.available() {
            return Err(format!(
                "the toolchain for {} is not installed ({} {:?})",
                t.triple, tc.cc, tc.exec
            ));
        }
        std::fs::create_dir_all(scratch).map_err(|e| e.to_string())?;
        let harness =
            crate::runner::build_harness(&tc, scratch, "model").map_err(|e| e.to_string())?;
        Ok(CompiledEnv {
            target: target.to_string(),
            triple: t.triple,
            toolchain: tc,
            harness,
            scratch: scratch.to_path_buf(),
        })
    }
}

/// Runs one case compiled for `env`'s target. Graph inputs that decide shapes (Reshape's
/// shape, TopK's k, ...) are bound as constants for the compile.
pub fn run_case_compiled(case: &Path, env: &CompiledEnv, worker: usize) -> Status {
    let r = std::panic::catch_unwind(|| run_case_compiled_inner(case, env, worker));
    r.unwrap_or_else(|_| Status::Failed("panic".into()))
}

fn run_case_compiled_inner(case: &Path, env: &CompiledEnv, worker: usize) -> Status {
    let name = case
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or_default();
    if NONDETERMINISTIC.iter().any(|p| name.starts_with(p)) {
        return Status::Unsupported("non-deterministic expected output".into());
    }
    let model = match onnx::load(&case.join("model.onnx")) {
        Ok(m) => m,
        Err(Error::Unsupported(v)) => return Status::Unsupported(v.join("; ")),
        Err(e) => return Status::Failed(format!("import: {e}")),
    };
    let g = model.graph;
    let data = case.join("test_data_set_0");
    let mut inputs = Vec::new();
    for (k, &id) in g.inputs.iter().enumerate() {
        match crate::io::read_value(&data.join(format!("input_{k}.pb")), &g.value(id).ty) {
            Ok(Value::Tensor(t)) => inputs.push((g.value(id).name.clone(), t)),
            Ok(_) => {
                return Status::Unsupported(format!(
                    "input `{}` is {}: compiled code holds tensors only (sequences and \
                     optionals have run-time lengths and presence)",
                    g.value(id).name,
                    g.value(id).ty
                ))
            }
            Err(e) => return Status::Failed(e.to_string()),
        }
    }
    // Inputs whose values reach a shape-deciding slot (directly or through other nodes;
    // not through Shape/Size, which read only the shape) become constants.
    let mut producer = std::collections::HashMap::new();
    for n in g.nodes.node_indices() {
        for &o in &g.nodes[n].outputs {
            producer.insert(o, n);
        }
    }
    let mut stack: Vec<crate::ir::ValueId> = Vec::new();
    for n in g.nodes.node_indices() {
        let node = &g.nodes[n];
        for &i in node.op.shape_inputs() {
            if let Some(Some(v)) = node.inputs.get(i) {
                stack.push(*v);
            }
        }
    }
    let mut seen = std::collections::HashSet::new();
    let mut shape_inputs = std::collections::HashSet::new();
    while let Some(v) = stack.pop() {
        if !seen.insert(v) {
            continue;
        }
        if g.inputs.contains(&v) {
            shape_inputs.insert(g.value(v).name.clone());
        }
        if let Some(&n) = producer.get(&v) {
            let node = &g.nodes[n];
            if node.domain.is_empty() && matches!(node.op_type.as_str(), "Shape" | "Size") {
                continue;
            }
            stack.extend(node.inputs.iter().flatten().copied());
            stack.extend(node.implicit.iter().copied());
        }
    }
    let mut opts = crate::driver::Options {
        target: env.target.clone(),
        ..Default::default()
    };
    let mut run_inputs = Vec::new();
    for (n, t) in inputs {
        if shape_inputs.contains(&n) {
            opts.constants.push((n, t));
        } else {
            opts.shapes.push((n.clone(), t.shape().to_vec()));
            run_inputs.push(Value::Tensor(t));
        }
    }
    let c = match crate::driver::compile_graph(g, "model", &opts) {
        Ok(c) => c,
        Err(Error::Unsupported(v)) => return Status::Unsupported(v.join("; ")),
        Err(Error::Shape(m)) => return Status::Unsupported(format!("shapes: {m}")),
        Err(e) => return Status::Failed(format!("compile: {e}")),
    };
    let dir = env.scratch.join(format!("w{worker}"));
    let _ = std::fs::create_dir_all(&dir);
    let obj = dir.join("model.o");
    let exe = dir.join("model.exe");
    if let Err(e) = std::fs::write(&obj, &c.artifacts.object) {
        return Status::Failed(e.to_string());
    }
    if let Err(e) = crate::runner::link(&env.toolchain, &env.harness, &obj, &exe) {
        return Status::Failed(e.to_string());
    }
    let ins: Vec<Tensor> = run_inputs
        .into_iter()
        .filter_map(|v| v.into_tensor())
        .collect();
    let outs: Vec<(DType, Vec<usize>)> = c
        .graph
        .outputs
        .iter()
        .map(|&o| {
            (
                c.graph.value(o).ty.dtype().unwrap_or(DType::F32),
                c.graph.value(o).ty.static_shape().unwrap_or_default(),
            )
        })
        .collect();
    let got = match crate::runner::execute(&env.toolchain, &exe, &dir, &ins, &outs) {
        Ok(v) => v,
        Err(e) => return Status::Failed(e.to_string()),
    };
    for (k, &id) in c.graph.outputs.iter().enumerate() {
        let expected = match crate::io::read_value(
            &data.join(format!("output_{k}.pb")),
            &c.graph.value(id).ty,
        ) {
            Ok(v) => v,
            Err(e) => return Status::Failed(e.to_string()),
        };
        if let Err(e) = compare_values(&Value::Tensor(got[k].clone()), &expected) {
            return Status::Failed(format!("output {k} `{}`: {e}", c.graph.value(id).name));
        }
    }
    Status::Passed
}

/// Runs every case matching `filter` compiled, on `threads` workers.
pub fn run_suite_compiled(
    dir: &Path,
    filter: Option<&regex::Regex>,
    env: &CompiledEnv,
    threads: usize,
) -> std::io::Result<Vec<CaseResult>> {
    let ops = case_ops(dir);
    let cases: Vec<PathBuf> = list_cases(dir)?
        .into_iter()
        .filter(|c| {
            let n = c.file_name().and_then(|n| n.to_str()).unwrap_or_default();
            filter.is_none_or(|f| f.is_match(n))
        })
        .collect();
    let next = std::sync::atomic::AtomicUsize::new(0);
    let results = std::sync::Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for w in 0..threads.max(1) {
            let (next, results, cases, ops) = (&next, &results, &cases, &ops);
            s.spawn(move || loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some(case) = cases.get(i) else { break };
                let name = case
                    .file_name()
                    .and_then(|n| n.to_str())
                    .unwrap_or_default()
                    .to_string();
                let status = run_case_compiled(case, env, w);
                let op = ops.get(&name).cloned().unwrap_or_else(|| "?".into());
                results
                    .lock()
                    .expect("no poisoning")
                    .push((i, CaseResult { name, op, status }));
            });
        }
    });
    let mut v = results.into_inner().expect("no poisoning");
    v.sort_by_key(|(i, _)| *i);
    Ok(v.into_iter().map(|(_, r)| r).collect())
}

/// Compares an actual value with an expected one.
pub fn compare_values(got: &Value, want: &Value) -> Result<(), String> {
    match (got, want) {
        (Value::Tensor(a), Value::Tensor(b)) => compare_tensors(a, b, RTOL, ATOL),
        (Value::Sequence { items: a, .. }, Value::Sequence { items: b, .. }) => {
            if a.len() != b.len() {
                return Err(format!(
                    "sequence of {} items, expected {}",
                    a.len(),
                    b.len()
                ));
            }
            for (i, (x, y)) in a.iter().zip(b).enumerate() {
                compare_values(x, y).map_err(|e| format!("item {i}: {e}"))?;
            }
            Ok(())
        }
        (Value::Optional { value: a, .. }, Value::Optional { value: b, .. }) => match (a, b) {
            (None, None) => Ok(()),
            (Some(x), Some(y)) => compare_values(x, y),
            _ => Err("optional presence differs".into()),
        },
        (Value::Optional { value: Some(x), .. }, y) => compare_values(x, y),
        (x, Value::Optional { value: Some(y), .. }) => compare_values(x, y),
        _ => Err(format!(
            "got {}, expected {}",
            got.value_type(),
            want.value_type()
        )),
    }
}

/// Compares tensors: same dtype and shape; floats within `atol + rtol*|want|`.
pub fn compare_tensors(got: &Tensor, want: &Tensor, rtol: f64, atol: f64) -> Result<(), String> {
    if got.dtype() != want.dtype() {
        return Err(format!("dtype {} expected {}", got.dtype(), want.dtype()));
    }
    if got.shape() != want.shape() {
        return Err(format!(
            "shape {:?} expected {:?}",
            got.shape(),
            want.shape()
        ));
    }
    let dt = got.dtype();
    if dt == DType::Str {
        return if got.standard() == want.standard() {
            Ok(())
        } else {
            Err(format!("strings differ: {got:?} expected {want:?}"))
        };
    }
    if dt.is_float() {
        let a = got.to_f64().expect("float");
        let b = want.to_f64().expect("float");
        let mut worst: Option<(usize, f64, f64)> = None;
        let mut bad = 0usize;
        for (i, (&x, &y)) in a.iter().zip(b.iter()).enumerate() {
            let ok = (x.is_nan() && y.is_nan()) || x == y || (x - y).abs() <= atol + rtol * y.abs();
            if !ok {
                bad += 1;
                if worst.is_none() {
                    worst = Some((i, x, y));
                }
            }
        }
        return match worst {
            None => Ok(()),
            Some((i, x, y)) => Err(format!(
                "{bad} of {} values differ; first at flat index {i}: {x} expected {y}",
                a.len()
            )),
        };
    }
    let a = got.to_i128().expect("int");
    let b = want.to_i128().expect("int");
    match a.iter().zip(b.iter()).position(|(x, y)| x != y) {
        None => Ok(()),
        Some(i) => Err(format!(
            "values differ at flat index {i}: {} expected {}",
            a.iter().nth(i).expect("idx"),
            b.iter().nth(i).expect("idx")
        )),
    }
}

/// Runs every case whose name matches `filter`.
pub fn run_suite(dir: &Path, filter: Option<&regex::Regex>) -> std::io::Result<Vec<CaseResult>> {
    let ops = case_ops(dir);
    let mut out = Vec::new();
    for case in list_cases(dir)? {
        let name = case
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default()
            .to_string();
        if filter.is_some_and(|f| !f.is_match(&name)) {
            continue;
        }
        let status = run_case(&case);
        let op = ops.get(&name).cloned().unwrap_or_else(|| "?".into());
        out.push(CaseResult { name, op, status });
    }
    Ok(out)
}

/// Counts (passed, failed, unsupported).
pub fn counts(results: &[CaseResult]) -> (usize, usize, usize) {
    let mut c = (0, 0, 0);
    for r in results {
        match r.status {
            Status::Passed => c.0 += 1,
            Status::Failed(_) => c.1 += 1,
            Status::Unsupported(_) => c.2 += 1,
        }
    }
    c
}

/// Runs the wheel's other suites laid out under `dir/<suite>/<case>` (as written by
/// `tests/conformance/gen_node_cases.py --other`); case names become `suite/case`.
pub fn run_other_suites(dir: &Path) -> std::io::Result<Vec<CaseResult>> {
    let mut out = Vec::new();
    let mut suites: Vec<PathBuf> = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_dir())
        .collect();
    suites.sort();
    for s in suites {
        let suite = s
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default()
            .to_string();
        for mut r in run_suite(&s, None)? {
            r.name = format!("{suite}/{}", r.name);
            r.op = suite.clone();
            out.push(r);
        }
    }
    Ok(out)
}

/// The Markdown of `docs/conformance.md`: a summary line, then a table per op, then the
/// wheel's other suites and every case that does not pass.
pub fn markdown(results: &[CaseResult], other: &[CaseResult], onnx_version: &str) -> String {
    let (p, f, u) = counts(results);
    let n = results.len();
    let mut s = String::new();
    let _ = writeln!(s, "# ONNX node test conformance\n");
    let _ = writeln!(
        s,
        "Reference evaluator: **{p} of {n} passed ({:.1}%)**, {f} failed, {u} unsupported \
         (ONNX {onnx_version} backend node tests).\n",
        100.0 * p as f64 / n.max(1) as f64
    );
    let _ = writeln!(
        s,
        "Regenerate with `bash tests/conformance.sh --write`. The list of passing cases \
         (`tests/conformance/reference-pass.txt`) is enforced by `cargo test`; the tolerance \
         is ONNX's own, |a-b| <= 1e-7 + 1e-3*|b|, NaN equal to NaN.\n"
    );
    let mut by_op: BTreeMap<&str, Vec<&CaseResult>> = BTreeMap::new();
    for r in results {
        by_op.entry(r.op.as_str()).or_default().push(r);
    }
    let _ = writeln!(s, "| op | passed | failed | unsupported |");
    let _ = writeln!(s, "|---|---:|---:|---:|");
    for (op, rs) in &by_op {
        let (p, f, u) = counts(&rs.iter().map(|r| (*r).clone()).collect::<Vec<_>>());
        let _ = writeln!(s, "| {op} | {p} | {f} | {u} |");
    }
    if !other.is_empty() {
        let (p, f, u) = counts(other);
        let _ = writeln!(
            s,
            "\n## The wheel's other suites\n\nReference evaluator: **{p} of {} passed**, {f} failed, {u} unsupported.\n",
            other.len()
        );
        let mut by_suite: BTreeMap<&str, Vec<CaseResult>> = BTreeMap::new();
        for r in other {
            by_suite.entry(r.op.as_str()).or_default().push(r.clone());
        }
        let _ = writeln!(s, "| suite | passed | failed | unsupported |");
        let _ = writeln!(s, "|---|---:|---:|---:|");
        for (suite, rs) in &by_suite {
            let (p, f, u) = counts(rs);
            let _ = writeln!(s, "| {suite} | {p} | {f} | {u} |");
        }
    }
    let _ = writeln!(s, "\n## Cases that do not pass\n");
    let _ = writeln!(s, "| case | status | reason |");
    let _ = writeln!(s, "|---|---|---|");
    for r in results.iter().chain(other) {
        let (st, why) = match &r.status {
            Status::Passed => continue,
            Status::Failed(w) => ("failed", w),
            Status::Unsupported(w) => ("unsupported", w),
        };
        let mut why: String = why.replace('|', "\\|").replace('\n', " ");
        if why.len() > 160 {
            let mut cut = 160;
            while !why.is_char_boundary(cut) {
                cut -= 1;
            }
            why.truncate(cut);
            why.push('…');
        }
        let _ = writeln!(s, "| {} | {st} | {why} |", r.name);
    }
    s
}

/// The Markdown section for a compiled run, appended to `docs/conformance.md`.
pub fn markdown_compiled(results: &[CaseResult], target: &str, triple: &str) -> String {
    let (p, f, u) = counts(results);
    let mut s = String::new();
    let _ = writeln!(s, "\n## Compiled: {target} ({triple})\n");
    let _ = writeln!(
        s,
        "Native code from the Cranelift back end, linked with the C harness{}: compiled for {target}: **{p} of {} passed**, {f} failed, {u} unsupported (not compiled yet, or data-dependent shapes).\n",
        if triple.starts_with(std::env::consts::ARCH) { "" } else { " and run under qemu" },
        results.len()
    );
    let mut by_op: BTreeMap<&str, (usize, usize, usize)> = BTreeMap::new();
    for r in results {
        let e = by_op.entry(r.op.as_str()).or_default();
        match r.status {
            Status::Passed => e.0 += 1,
            Status::Failed(_) => e.1 += 1,
            Status::Unsupported(_) => e.2 += 1,
        }
    }
    let _ = writeln!(s, "<details><summary>per op</summary>\n\n| op | passed | failed | unsupported |\n|---|---:|---:|---:|");
    for (op, (p, f, u)) in by_op {
        let _ = writeln!(s, "| {op} | {p} | {f} | {u} |");
    }
    let _ = writeln!(s, "\n</details>");
    let not_passed: Vec<(&str, &str, &str)> = results
        .iter()
        .filter_map(|r| match &r.status {
            Status::Passed => None,
            Status::Failed(w) => Some((r.name.as_str(), "failed", w.as_str())),
            Status::Unsupported(w) => Some((r.name.as_str(), "unsupported", w.as_str())),
        })
        .collect();
    if !not_passed.is_empty() {
        let _ = writeln!(
            s,
            "\n<details><summary>cases not compiled, with the compiler's reason</summary>\n\n| case | status | reason |\n|---|---|---|"
        );
        for (name, status, why) in not_passed {
            let why = why.split_whitespace().collect::<Vec<_>>().join(" ");
            let _ = writeln!(s, "| {name} | {status} | {} |", why.replace('|', "\\|"));
        }
        let _ = writeln!(s, "\n</details>");
    }
    s
}
