//! String tensors compiled: a model that maps, compares, matches, gathers and selects
//! strings, linked into a C program that passes `const char *` arrays, checked against
//! the reference evaluator on the host and on aarch64 (under qemu); the run allocates
//! nothing, and string outputs point at the caller's input strings or at constants in
//! the object. Ops that would have to create string bytes are refused with the reason.

mod common;

use common::{ints_attr, model, node, value_info};
use onnxc::driver::{compile_file, Options};
use onnxc::ir::{DType, Tensor, Value};
use onnxc::onnx::proto::{
    tensor_proto::DataType, AttributeProto, GraphProto, ModelProto, OperatorSetIdProto, TensorProto,
};
use onnxc::{eval, onnx, runner};
use std::process::Command;

fn strings_attr(name: &str, v: &[&str]) -> AttributeProto {
    AttributeProto {
        name: Some(name.into()),
        r#type: Some(8),
        strings: v.iter().map(|s| s.as_bytes().to_vec()).collect(),
        ..Default::default()
    }
}

fn string_attr(name: &str, v: &str) -> AttributeProto {
    AttributeProto {
        name: Some(name.into()),
        r#type: Some(3),
        s: Some(v.as_bytes().to_vec()),
        ..Default::default()
    }
}

fn string_tensor(name: &str, dims: &[i64], v: &[&str]) -> TensorProto {
    TensorProto {
        name: Some(name.into()),
        dims: dims.to_vec(),
        data_type: Some(DataType::String as i32),
        string_data: v.iter().map(|s| s.as_bytes().to_vec()).collect(),
        ..Default::default()
    }
}

fn with_ml(mut m: ModelProto) -> ModelProto {
    m.opset_import.push(OperatorSetIdProto {
        domain: Some("ai.onnx.ml".into()),
        version: Some(4),
    });
    m
}

/// words: string[4], codes: int64[3] ->
///   ids    = LabelEncoder(words)  {cat: 1, dog: 2, bird: 3}, default 0   (int64[4])
///   is_dog = Equal(words, "dog")                                         (bool[4])
///   names  = LabelEncoder(codes)  {1: one, 2: two, 3: three}, "many"     (string[3])
///   picked = Gather(words, [3, 0])                                       (string[2])
///   plural = RegexFullMatch(words, "[a-z]+s")                            (bool[4])
///   masked = Where(is_dog, words, "?")                                   (string[4])
///   echo   = Identity(words)                                             (string[4])
fn strings_model() -> ModelProto {
    let mut le_words = node("LabelEncoder", &["words"], &["ids"]);
    le_words.domain = Some("ai.onnx.ml".into());
    le_words.attribute = vec![
        strings_attr("keys_strings", &["cat", "dog", "bird"]),
        ints_attr("values_int64s", &[1, 2, 3]),
        common::int_attr("default_int64", 0),
    ];
    let mut le_codes = node("LabelEncoder", &["codes"], &["names"]);
    le_codes.domain = Some("ai.onnx.ml".into());
    le_codes.attribute = vec![
        ints_attr("keys_int64s", &[1, 2, 3]),
        strings_attr("values_strings", &["one", "two", "three"]),
        string_attr("default_string", "many"),
    ];
    let mut re = node("RegexFullMatch", &["words"], &["plural"]);
    re.attribute = vec![string_attr("pattern", "[a-z]+s")];
    let g = GraphProto {
        name: Some("strmodel".into()),
        node: vec![
            le_words,
            node("Equal", &["words", "dog"], &["is_dog"]),
            le_codes,
            node("Gather", &["words", "at"], &["picked"]),
            re,
            node("Where", &["is_dog", "words", "unknown"], &["masked"]),
            node("Identity", &["words"], &["echo"]),
        ],
        input: vec![
            value_info("words", DataType::String, &[4]),
            value_info("codes", DataType::Int64, &[3]),
        ],
        output: vec![
            value_info("ids", DataType::Int64, &[4]),
            value_info("is_dog", DataType::Bool, &[4]),
            value_info("names", DataType::String, &[3]),
            value_info("picked", DataType::String, &[2]),
            value_info("plural", DataType::Bool, &[4]),
            value_info("masked", DataType::String, &[4]),
            value_info("echo", DataType::String, &[4]),
        ],
        initializer: vec![
            string_tensor("dog", &[], &["dog"]),
            string_tensor("unknown", &[1], &["?"]),
            TensorProto {
                name: Some("at".into()),
                dims: vec![2],
                data_type: Some(DataType::Int64 as i32),
                int64_data: vec![3, 0],
                ..Default::default()
            },
        ],
        ..Default::default()
    };
    with_ml(model(g))
}

const WORDS: [&str; 4] = ["cat", "dog", "fish", "dogs"];
const CODES: [i64; 3] = [2, 7, 1];

/// Links the compiled model with a C program that runs it once (counting allocations)
/// and prints every output as `name: v|v|...`, then whether the string outputs point
/// at the input strings.
const C_MAIN: &str = r#"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "strmodel.h"
static int counting, calls;
void *__real_malloc(size_t); void *__real_calloc(size_t, size_t); void *__real_realloc(void *, size_t);
void *__wrap_malloc(size_t n) { if (counting) calls++; return __real_malloc(n); }
void *__wrap_calloc(size_t a, size_t b) { if (counting) calls++; return __real_calloc(a, b); }
void *__wrap_realloc(void *p, size_t n) { if (counting) calls++; return __real_realloc(p, n); }
static unsigned char arena[STRMODEL_ARENA_BYTES + 1] __attribute__((aligned(64)));
int main(void) {
    const char *words[STRMODEL_INPUT_0_ELEMS] = {WORDS};
#ifdef HEAP_WORDS
    /* Each string in its own allocation of its exact size: a read past a NUL shows. */
    for (int i = 0; i < STRMODEL_INPUT_0_ELEMS; i++) words[i] = strdup(words[i]);
#endif
    int64_t codes[STRMODEL_INPUT_1_ELEMS] = {CODES};
    int64_t ids[STRMODEL_OUTPUT_0_ELEMS];
    uint8_t is_dog[STRMODEL_OUTPUT_1_ELEMS];
    const char *names[STRMODEL_OUTPUT_2_ELEMS];
    const char *picked[STRMODEL_OUTPUT_3_ELEMS];
    uint8_t plural[STRMODEL_OUTPUT_4_ELEMS];
    const char *masked[STRMODEL_OUTPUT_5_ELEMS];
    const char *echo[STRMODEL_OUTPUT_6_ELEMS];
    counting = 1;
    int s = strmodel_run(words, codes, ids, is_dog, names, picked, plural, masked, echo, arena);
    counting = 0;
    printf("status: %d\nallocations: %d\n", s, calls);
    printf("ids: "); for (int i = 0; i < STRMODEL_OUTPUT_0_ELEMS; i++) printf("%s%lld", i ? "|" : "", (long long)ids[i]);
    printf("\nis_dog: "); for (int i = 0; i < STRMODEL_OUTPUT_1_ELEMS; i++) printf("%s%d", i ? "|" : "", is_dog[i]);
    printf("\nnames: "); for (int i = 0; i < STRMODEL_OUTPUT_2_ELEMS; i++) printf("%s%s", i ? "|" : "", names[i]);
    printf("\npicked: "); for (int i = 0; i < STRMODEL_OUTPUT_3_ELEMS; i++) printf("%s%s", i ? "|" : "", picked[i]);
    printf("\nplural: "); for (int i = 0; i < STRMODEL_OUTPUT_4_ELEMS; i++) printf("%s%d", i ? "|" : "", plural[i]);
    printf("\nmasked: "); for (int i = 0; i < STRMODEL_OUTPUT_5_ELEMS; i++) printf("%s%s", i ? "|" : "", masked[i]);
    printf("\necho: "); for (int i = 0; i < STRMODEL_OUTPUT_6_ELEMS; i++) printf("%s%s", i ? "|" : "", echo[i]);
    /* Pointers, not copies: picked = words[3], words[0]; masked[1] = words[1]; echo. */
    int same = picked[0] == words[3] && picked[1] == words[0] && masked[1] == words[1];
    for (int i = 0; i < STRMODEL_OUTPUT_6_ELEMS; i++) same &= echo[i] == words[i];
    printf("\nsame pointers: %d\n", same);
    return 0;
}
"#;

/// `name: v|v|...` of a reference output.
fn line(name: &str, t: &Tensor) -> String {
    let vals: Vec<String> = match t.dtype() {
        DType::Str => t
            .array::<String>()
            .expect("strings")
            .iter()
            .cloned()
            .collect(),
        _ => t
            .to_i128()
            .expect("integers")
            .iter()
            .map(|v| v.to_string())
            .collect(),
    };
    format!("{name}: {}", vals.join("|"))
}

/// Compiles the model for `target` at `opt_level`, links and runs the C program (under
/// valgrind, with every input string in its own heap block, when `memcheck`), and
/// compares its output with the reference evaluator's.
fn compiled_against_reference(target: &str, opt_level: u8, memcheck: bool) {
    let d = tempfile::tempdir().unwrap();
    let path = common::write_model(d.path(), "strmodel.onnx", &strings_model());
    let c = compile_file(
        &path,
        &Options {
            target: target.into(),
            opt_level,
            ..Options::default()
        },
    )
    .unwrap_or_else(|e| panic!("{target} -O{opt_level}: {e}"));
    let tc = runner::Toolchain::for_triple(&c.target.triple);
    assert!(
        tc.available(),
        "{} is needed (tests/run.sh installs it)",
        tc.cc
    );
    assert!(
        c.artifacts
            .header
            .contains("const char *const *input_0, const int64_t *input_1"),
        "{}",
        c.artifacts.header
    );
    let obj = d.path().join("strmodel.o");
    std::fs::write(&obj, &c.artifacts.object).unwrap();
    std::fs::write(d.path().join("strmodel.h"), &c.artifacts.header).unwrap();
    std::fs::write(d.path().join("onnxc_runtime.h"), runner::RUNTIME_H).unwrap();
    std::fs::write(d.path().join("main.c"), C_MAIN).unwrap();
    let words: Vec<String> = WORDS.iter().map(|w| format!("\"{w}\"")).collect();
    let codes: Vec<String> = CODES.iter().map(|c| c.to_string()).collect();
    let exe = d.path().join("strmodel");
    let st = Command::new(&tc.cc)
        .args(["-O1", "-Wl,--wrap=malloc,--wrap=calloc,--wrap=realloc"])
        .arg(format!("-DWORDS={}", words.join(",")))
        .arg(format!("-DCODES={}", codes.join(",")))
        .args(memcheck.then_some("-DHEAP_WORDS"))
        .arg("-I")
        .arg(d.path())
        .arg(d.path().join("main.c"))
        .arg(&obj)
        .args(["-lm", "-o"])
        .arg(&exe)
        .status()
        .unwrap();
    assert!(st.success(), "{target}: linking the C program");
    let mut cmd = match tc.exec.split_first() {
        Some((e, rest)) => {
            let mut c = Command::new(e);
            c.args(rest).arg(&exe);
            c
        }
        None if memcheck => {
            let mut c = Command::new("valgrind");
            c.args(["--error-exitcode=9", "--quiet", "--leak-check=no"])
                .arg(&exe);
            c
        }
        None => Command::new(&exe),
    };
    let out = cmd.output().unwrap();
    let got = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{target}: {got}{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // The reference evaluator on the same inputs.
    let m = onnx::load(&path).unwrap();
    let words = Tensor::from_vec(&[4], WORDS.iter().map(|s| s.to_string()).collect());
    let codes = Tensor::from_vec(&[3], CODES.to_vec());
    let want = eval::run(&m.graph, vec![Value::Tensor(words), Value::Tensor(codes)]).unwrap();
    let mut expected = vec!["status: 0".to_string(), "allocations: 0".to_string()];
    for (v, &o) in want.iter().zip(&m.graph.outputs) {
        expected.push(line(&m.graph.value(o).name, v.as_tensor().expect("tensor")));
    }
    expected.push("same pointers: 1".into());
    assert_eq!(
        got.lines().collect::<Vec<_>>(),
        expected,
        "{target} -O{opt_level}"
    );
    // The values themselves (a reference that went wrong the same way would hide it).
    assert!(got.contains("ids: 1|2|0|0\n"), "{got}");
    assert!(got.contains("names: two|many|one\n"), "{got}");
    assert!(got.contains("masked: ?|dog|?|?\n"), "{got}");
    assert!(got.contains("plural: 0|0|0|1\n"), "{got}");
}

#[test]
fn string_model_compiled_for_the_host_matches_the_reference() {
    // -O0 lowers every node as written (Identity included), -O2 after the optimizer.
    compiled_against_reference("host", 0, false);
    compiled_against_reference("host", 2, false);
}

#[test]
fn string_kernels_read_no_byte_past_a_nul_under_valgrind() {
    let have = Command::new("valgrind")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(have, "valgrind is needed (tests/run.sh installs it)");
    // valgrind emulates a CPU without AVX-512: compile for a baseline it implements.
    compiled_against_reference("x86_64-sse4", 2, true);
}

#[test]
fn string_model_compiled_for_aarch64_matches_the_reference() {
    compiled_against_reference("aarch64-neon", 2, false);
}

/// A one-node model of `op` on string inputs `x` and `y` (string[2]) with output `z`.
fn one_node(op: &str, out: DataType) -> ModelProto {
    model(GraphProto {
        name: Some("g".into()),
        node: vec![node(
            op,
            &["x", "y"][..if op == "Cast" { 1 } else { 2 }],
            &["z"],
        )],
        input: vec![
            value_info("x", DataType::String, &[2]),
            value_info("y", DataType::String, &[2]),
        ],
        output: vec![value_info("z", out, &[2])],
        ..Default::default()
    })
}

#[test]
fn ops_that_make_strings_are_refused_with_the_reason() {
    let d = tempfile::tempdir().unwrap();
    let p = common::write_model(
        d.path(),
        "concat.onnx",
        &one_node("StringConcat", DataType::String),
    );
    let e = compile_file(&p, &Options::default())
        .err()
        .expect("refused");
    let msg = e.to_string();
    assert!(msg.contains("(StringConcat)"), "{msg}");
    assert!(
        msg.contains("lengths depend on the input data") && msg.contains("allocates nothing"),
        "{msg}"
    );
    // A lowering written for numbers that meets strings is refused, naming the node.
    let mut m = one_node("Cast", DataType::Float);
    m.graph.as_mut().unwrap().node[0].attribute = vec![common::int_attr("to", 1)];
    let p = common::write_model(d.path(), "cast.onnx", &m);
    let e = compile_file(&p, &Options::default())
        .err()
        .expect("refused");
    let msg = e.to_string();
    assert!(msg.contains("(Cast)") && msg.contains("string"), "{msg}");
}
