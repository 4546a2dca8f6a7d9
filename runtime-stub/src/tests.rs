//! Tests with hand-built descriptors whose entry points are Rust `extern "C"` functions.

use super::*;
use std::vec;
use std::vec::Vec;

static SHAPE_2X3: [i64; 2] = [2, 3];

/// add: out = a + b * 2, staging `b * 2` in the arena (so a wrong arena shows up).
unsafe extern "C" fn add_run(
    inputs: *const *const c_void,
    outputs: *const *mut c_void,
    arena: *mut c_void,
) -> i32 {
    if inputs.is_null() || outputs.is_null() || arena.is_null() {
        return Status::NullPointer as i32;
    }
    if !(arena as usize).is_multiple_of(64) {
        return Status::Misaligned as i32;
    }
    // SAFETY: the wrapper passes 2 inputs and 1 output of 6 f32 each and a 24-byte arena.
    unsafe {
        let a = core::slice::from_raw_parts(*inputs as *const f32, 6);
        let b = core::slice::from_raw_parts(*inputs.add(1) as *const f32, 6);
        let out = core::slice::from_raw_parts_mut(*outputs as *mut f32, 6);
        let tmp = core::slice::from_raw_parts_mut(arena as *mut f32, 6);
        for i in 0..6 {
            tmp[i] = b[i] * 2.0;
        }
        for i in 0..6 {
            out[i] = a[i] + tmp[i];
        }
    }
    0
}

unsafe extern "C" fn yes() -> i32 {
    1
}

unsafe extern "C" fn no() -> i32 {
    0
}

unsafe extern "C" fn fails(_: *const *const c_void, _: *const *mut c_void, _: *mut c_void) -> i32 {
    Status::Misaligned as i32
}

unsafe extern "C" fn weird(_: *const *const c_void, _: *const *mut c_void, _: *mut c_void) -> i32 {
    42
}

const fn info(name: &'static CStr, dtype: DType) -> TensorInfo {
    TensorInfo {
        name: name.as_ptr(),
        dtype: dtype.0,
        rank: 2,
        shape: SHAPE_2X3.as_ptr(),
        elems: 6,
        bytes: 24,
    }
}

static ADD_INPUTS: [TensorInfo; 2] = [info(c"a", DType::FLOAT), info(c"b", DType::FLOAT)];
static ADD_OUTPUTS: [TensorInfo; 1] = [info(c"sum", DType::FLOAT)];

const fn desc(run: RunFn, cpu: Option<unsafe extern "C" fn() -> i32>) -> ModelDesc {
    ModelDesc {
        abi_version: ABI_VERSION,
        n_inputs: 2,
        n_outputs: 1,
        reserved0: 0,
        name: c"add".as_ptr(),
        inputs: ADD_INPUTS.as_ptr(),
        outputs: ADD_OUTPUTS.as_ptr(),
        arena_bytes: 24,
        arena_align: 64,
        run: Some(run),
        cpu_supported: cpu,
        run_parallel: None,
    }
}

static ADD: ModelDesc = desc(add_run, Some(yes));
static ADD_NO_CPU: ModelDesc = desc(add_run, Some(no));
static FAILS: ModelDesc = desc(fails, None);
static WEIRD: ModelDesc = desc(weird, None);

fn add() -> Model {
    // SAFETY: ADD is a valid 'static descriptor built above.
    unsafe { Model::from_raw(&ADD) }.unwrap()
}

fn bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_ne_bytes()).collect()
}

#[test]
fn descriptor_views() {
    let m = add();
    assert_eq!(m.name(), "add");
    assert_eq!(m.inputs().len(), 2);
    assert_eq!(m.outputs().len(), 1);
    let b = m.inputs().get(1).unwrap();
    assert_eq!(b.name(), "b");
    assert_eq!(b.dtype(), DType::FLOAT);
    assert_eq!(b.shape(), &[2, 3]);
    assert_eq!((b.elems(), b.bytes()), (6, 24));
    assert_eq!(m.outputs().by_name("sum").map(|(i, _)| i), Some(0));
    assert!(m.outputs().by_name("nope").is_none());
    assert_eq!(
        (m.arena_bytes(), m.arena_align(), m.arena_capacity()),
        (24, 64, 87)
    );
    assert!(m.cpu_supported());
}

#[test]
fn run_typed_computes_through_the_arena() {
    let m = add();
    let a = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0];
    let b = [0.5f32, -1.0, 0.0, 2.0, 10.0, -3.0];
    let mut out = [0f32; 6];
    let mut arena = Arena64::<64>::new();
    m.run_f32(&[&a, &b], &mut [&mut out], arena.as_mut_slice())
        .unwrap();
    assert_eq!(out, [2.0, 0.0, 3.0, 8.0, 25.0, 0.0]);
}

/// A threaded add: each of 6 tasks writes one element of `out = a + 2 b`.
struct AddCtx {
    a: *const f32,
    b: *const f32,
    out: *mut f32,
}

unsafe extern "C" fn add_task(ctx: *mut c_void, i: u32) {
    // SAFETY: `ctx` is the AddCtx of add_parallel's frame; index i < 6 is written once.
    unsafe {
        let c = &*(ctx as *const AddCtx);
        let i = i as usize;
        *c.out.add(i) = *c.a.add(i) + 2.0 * *c.b.add(i);
    }
}

unsafe extern "C" fn add_parallel(
    inputs: *const *const c_void,
    outputs: *const *mut c_void,
    _arena: *mut c_void,
    threads: *const Threads,
) -> i32 {
    // SAFETY: the wrapper passes 2 inputs and 1 output of 6 f32 each; `threads` is the
    // caller's hook.
    unsafe {
        let mut c = AddCtx {
            a: *inputs as *const f32,
            b: *inputs.add(1) as *const f32,
            out: *outputs as *mut f32,
        };
        match threads
            .as_ref()
            .and_then(|t| t.parallel_for.map(|f| (f, t.pool)))
        {
            Some((pf, pool)) => pf(pool, add_task, (&raw mut c).cast(), 6),
            None => return 99,
        }
    }
    0
}

/// parallel_for over scoped std threads (the pattern the `Threads` docs show); counts
/// its calls in the AtomicU32 `pool` points to.
unsafe extern "C" fn scoped_for(pool: *mut c_void, task: TaskFn, ctx: *mut c_void, n: u32) {
    use std::sync::atomic::{AtomicU32, Ordering};
    // SAFETY: `pool` is the test's AtomicU32.
    unsafe { &*(pool as *const AtomicU32) }.fetch_add(1, Ordering::Relaxed);
    let next = AtomicU32::new(0);
    let ctx = ctx as usize;
    let work = || loop {
        let i = next.fetch_add(1, Ordering::Relaxed);
        if i >= n {
            break;
        }
        // SAFETY: the model's task and context; each index runs once.
        unsafe { task(ctx as *mut c_void, i) };
    };
    std::thread::scope(|s| {
        s.spawn(work);
        work();
    });
}

#[test]
fn run_parallel_goes_through_the_hook() {
    use std::sync::atomic::{AtomicU32, Ordering};
    static PAR: ModelDesc = ModelDesc {
        run_parallel: Some(add_parallel),
        ..desc(add_run, Some(yes))
    };
    static V1: ModelDesc = ModelDesc {
        abi_version: 1,
        run_parallel: Some(add_parallel),
        ..desc(add_run, Some(yes))
    };
    let calls = AtomicU32::new(0);
    let threads = Threads {
        parallel_for: Some(scoped_for),
        pool: (&raw const calls).cast_mut().cast(),
    };
    let a = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0];
    let b = [0.5f32, -1.0, 0.0, 2.0, 10.0, -3.0];
    let mut arena = Arena64::<64>::new();
    // SAFETY: valid 'static descriptors.
    let (par, v1) = unsafe {
        (
            Model::from_raw(&PAR).unwrap(),
            Model::from_raw(&V1).unwrap(),
        )
    };
    let mut out = [0f32; 6];
    par.run_typed_parallel(&[&a, &b], &mut [&mut out], arena.as_mut_slice(), &threads)
        .unwrap();
    assert_eq!(out, [2.0, 0.0, 3.0, 8.0, 25.0, 0.0]);
    assert_eq!(calls.load(Ordering::Relaxed), 1);
    // A version-1 descriptor has no run_parallel: the serial entry point runs.
    let mut out = [0f32; 6];
    v1.run_typed_parallel(&[&a, &b], &mut [&mut out], arena.as_mut_slice(), &threads)
        .unwrap();
    assert_eq!(out, [2.0, 0.0, 3.0, 8.0, 25.0, 0.0]);
    assert_eq!(calls.load(Ordering::Relaxed), 1);
}

/// onnxc_pool.h: every index of every job runs exactly once, on 1 to 4 threads, over
/// many back-to-back jobs of varying size (the reuse the model makes of one pool).
#[test]
fn c_pool_runs_every_index_once() {
    use std::process::Command;
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let dir = std::env::temp_dir().join(std::format!("onnxc-pool-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let src = dir.join("pool.c");
    let exe = dir.join("pool");
    std::fs::write(
        &src,
        r#"
#include <stdio.h>
#include "onnxc_pool.h"
typedef struct { atomic_uint *hits; } job_t;
static void task(void *ctx, uint32_t i) { atomic_fetch_add(&((job_t *)ctx)->hits[i], 1u); }
int main(void) {
  static atomic_uint hits[64];
  for (int t = 1; t <= 4; t++) {
    onnxc_pool_t *p = onnxc_pool_create(t);
    if (!p) { printf("no pool\n"); return 1; }
    onnxc_threads_t th = onnxc_pool_threads(p);
    for (int rep = 0; rep < 2000; rep++) {
      uint32_t n = (uint32_t)(rep % 13);
      for (int i = 0; i < 64; i++) atomic_store(&hits[i], 0u);
      job_t job = { hits };
      th.parallel_for(th.pool, task, &job, n);
      for (uint32_t i = 0; i < 64; i++) {
        unsigned want = i < n ? 1u : 0u;
        if (atomic_load(&hits[i]) != want) { printf("threads %d job %d index %u ran %u times\n", t, rep, i, atomic_load(&hits[i])); return 1; }
      }
    }
    onnxc_pool_destroy(p);
  }
  printf("ok\n");
  return 0;
}
"#,
    )
    .unwrap();
    let include = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("include");
    let built = match Command::new(&cc)
        .args([
            "-std=c11", "-O2", "-Wall", "-Wextra", "-Werror", "-pthread", "-I",
        ])
        .arg(&include)
        .arg(&src)
        .arg("-o")
        .arg(&exe)
        .output()
    {
        Ok(b) => b,
        Err(e) => {
            std::eprintln!("skipping: no C compiler ({cc}): {e}");
            return;
        }
    };
    assert!(
        built.status.success(),
        "{}",
        std::string::String::from_utf8_lossy(&built.stderr)
    );
    let run = Command::new(&exe).output().unwrap();
    assert_eq!(
        std::string::String::from_utf8_lossy(&run.stdout).trim(),
        "ok"
    );
    // The same under ThreadSanitizer, where the compiler has it: the pool's plain
    // fields (the job, written between jobs) and its atomics must not race.
    let tsan = dir.join("pool_tsan");
    let built = Command::new(&cc)
        .args([
            "-std=c11",
            "-O1",
            "-g",
            "-fsanitize=thread",
            "-pthread",
            "-I",
        ])
        .arg(&include)
        .arg(&src)
        .arg("-o")
        .arg(&tsan)
        .output()
        .unwrap();
    let probe = built
        .status
        .success()
        .then(|| Command::new(&tsan).output().unwrap());
    let _ = std::fs::remove_dir_all(&dir);
    match probe {
        Some(r) => {
            let err = std::string::String::from_utf8_lossy(&r.stderr);
            assert!(!err.contains("WARNING: ThreadSanitizer"), "{err}");
            if err.contains("FATAL: ThreadSanitizer") {
                // (Its runtime cannot map its shadow memory on some kernels.)
                std::eprintln!("skipping the ThreadSanitizer run: {err}");
            } else {
                assert!(r.status.success(), "{err}");
                assert_eq!(std::string::String::from_utf8_lossy(&r.stdout).trim(), "ok");
            }
        }
        None => std::eprintln!(
            "skipping the ThreadSanitizer run: {cc} does not build with -fsanitize=thread"
        ),
    }
}

#[test]
fn run_bytes_with_a_carved_arena() {
    let m = add();
    let a = bytes(&[1.0, 1.0, 1.0, 1.0, 1.0, 1.0]);
    let b = bytes(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
    let mut out = vec![0u8; 24];
    // An unaligned buffer of arena_capacity() bytes always holds an aligned arena.
    let mut storage = vec![0u8; m.arena_capacity() as usize + 1];
    for shift in 0..2 {
        let arena = m.carve_arena(&mut storage[shift..]).unwrap();
        assert_eq!(arena.len(), 24);
        assert_eq!(arena.as_ptr() as usize % 64, 0);
        m.run(&[&a, &b], &mut [&mut out], arena).unwrap();
        assert_eq!(out, bytes(&[3.0, 5.0, 7.0, 9.0, 11.0, 13.0]));
    }
    assert!(matches!(
        m.carve_arena(&mut storage[..10]),
        Err(Error::ArenaTooSmall { .. })
    ));
}

#[test]
fn checks_before_calling() {
    let m = add();
    let a = [0f32; 6];
    let mut out = [0f32; 6];
    let mut arena = Arena64::<64>::new();
    let ar = arena.as_mut_slice();
    assert_eq!(
        m.run_f32(&[&a], &mut [&mut out], ar),
        Err(Error::InputCount {
            expected: 2,
            found: 1
        })
    );
    assert_eq!(
        m.run_f32(&[&a, &a], &mut [], ar),
        Err(Error::OutputCount {
            expected: 1,
            found: 0
        })
    );
    assert_eq!(
        m.run_f32(&[&a, &a[..5]], &mut [&mut out], ar),
        Err(Error::InputSize {
            index: 1,
            expected: 24,
            found: 20
        })
    );
    assert_eq!(
        m.run_f32(&[&a, &a], &mut [&mut out[..3]], ar),
        Err(Error::OutputSize {
            index: 0,
            expected: 24,
            found: 12
        })
    );
    let d = [0f64; 3];
    assert_eq!(
        m.run_typed::<f64, f32>(&[&d, &d], &mut [&mut out], ar),
        Err(Error::InputType {
            index: 0,
            expected: DType::FLOAT,
            found: DType::DOUBLE
        })
    );
    let mut i = [0i32; 6];
    assert_eq!(
        m.run_typed::<f32, i32>(&[&a, &a], &mut [&mut i], ar),
        Err(Error::OutputType {
            index: 0,
            expected: DType::FLOAT,
            found: DType::INT32
        })
    );
    assert_eq!(
        m.run_f32(&[&a, &a], &mut [&mut out], &mut ar[..23]),
        Err(Error::ArenaTooSmall {
            needed: 24,
            found: 23
        })
    );
    assert_eq!(
        m.run_f32(&[&a, &a], &mut [&mut out], &mut ar[4..]),
        Err(Error::ArenaMisaligned { align: 64 })
    );
    // A byte buffer that is not aligned for f32.
    let raw = [0u8; 32];
    let off = if (raw.as_ptr() as usize).is_multiple_of(4) {
        1
    } else {
        0
    };
    let mut ob = [0u8; 24];
    let ok = bytes(&a);
    assert_eq!(
        m.run(&[&raw[off..off + 24], &ok], &mut [&mut ob], ar),
        Err(Error::TensorMisaligned {
            output: false,
            index: 0,
            align: 4
        })
    );
    assert_eq!(out, [0.0; 6], "nothing ran");
}

#[test]
fn cpu_and_status_errors() {
    let a = [0f32; 6];
    let mut out = [0f32; 6];
    let mut arena = Arena64::<64>::new();
    // SAFETY: valid 'static descriptors built above.
    let (no_cpu, fails, weird) = unsafe {
        (
            Model::from_raw(&ADD_NO_CPU).unwrap(),
            Model::from_raw(&FAILS).unwrap(),
            Model::from_raw(&WEIRD).unwrap(),
        )
    };
    assert!(!no_cpu.cpu_supported());
    assert_eq!(
        no_cpu.name(),
        "add",
        "an unsupported model can still be inspected"
    );
    assert_eq!(
        no_cpu.run_f32(&[&a, &a], &mut [&mut out], arena.as_mut_slice()),
        Err(Error::CpuUnsupported)
    );
    assert_eq!(
        fails.run_f32(&[&a, &a], &mut [&mut out], arena.as_mut_slice()),
        Err(Error::Status(Status::Misaligned))
    );
    assert_eq!(
        weird.run_f32(&[&a, &a], &mut [&mut out], arena.as_mut_slice()),
        Err(Error::UnknownStatus(42))
    );
}

#[test]
fn from_raw_rejects_bad_descriptors() {
    static NEWER: ModelDesc = ModelDesc {
        abi_version: ABI_VERSION + 1,
        ..desc(add_run, None)
    };
    static NO_RUN: ModelDesc = ModelDesc {
        run: None,
        ..desc(add_run, None)
    };
    static NULL_TABLE: ModelDesc = ModelDesc {
        inputs: core::ptr::null(),
        ..desc(add_run, None)
    };
    static ODD_ALIGN: ModelDesc = ModelDesc {
        arena_align: 48,
        ..desc(add_run, None)
    };
    // SAFETY: null or valid 'static descriptors.
    unsafe {
        assert_eq!(
            Model::from_raw(core::ptr::null()).err(),
            Some(Error::NullDescriptor)
        );
        assert_eq!(
            Model::from_raw(&NEWER).err(),
            Some(Error::AbiVersion {
                expected: ABI_VERSION,
                found: ABI_VERSION + 1
            })
        );
        assert!(matches!(
            Model::from_raw(&NO_RUN),
            Err(Error::BadDescriptor(_))
        ));
        assert!(matches!(
            Model::from_raw(&NULL_TABLE),
            Err(Error::BadDescriptor(_))
        ));
        assert!(matches!(
            Model::from_raw(&ODD_ALIGN),
            Err(Error::BadDescriptor(_))
        ));
    }
}

#[test]
fn models_run_concurrently_with_their_own_arenas() {
    let m = add();
    std::thread::scope(|s| {
        for t in 0..4 {
            s.spawn(move || {
                let a = [t as f32; 6];
                let mut out = [0f32; 6];
                let mut arena = Arena64::<64>::new();
                for _ in 0..1000 {
                    m.run_f32(&[&a, &a], &mut [&mut out], arena.as_mut_slice())
                        .unwrap();
                    assert_eq!(out, [3.0 * t as f32; 6]);
                }
            });
        }
    });
}

#[test]
fn dtype_facts() {
    assert_eq!(DType::FLOAT.bits(), Some(32));
    assert_eq!(DType::INT4.bits(), Some(4));
    assert_eq!(DType::STRING.bits(), None);
    assert_eq!(DType(99).bits(), None);
    assert_eq!(DType::COMPLEX64.align(), 4);
    assert_eq!(DType::DOUBLE.align(), 8);
    assert_eq!(DType::UINT4.align(), 1);
    assert_eq!(std::format!("{}", DType::BFLOAT16), "bfloat16");
    assert_eq!(std::format!("{}", DType(99)), "dtype#99");
    assert_eq!(<i8 as Element>::DTYPE, DType::INT8);
    assert_eq!(<u64 as Element>::DTYPE, DType::UINT64);
}

#[test]
fn errors_read_well() {
    let e = Error::InputSize {
        index: 1,
        expected: 24,
        found: 20,
    };
    assert_eq!(
        std::format!("{e}"),
        "input 1: expected 24 bytes, buffer has 20"
    );
    let e = Error::Status(Status::CpuUnsupported);
    assert_eq!(
        std::format!("{e}"),
        "model returned status 3: CPU lacks a required instruction-set feature"
    );
}

/// Compiles a C program against the header and checks that its layout, constants and
/// `onnxc_status_str` agree with the Rust definitions. Skipped when no C compiler exists.
#[test]
fn c_header_matches_rust_layout() {
    use core::mem::{offset_of, size_of};
    use std::process::Command;
    use std::string::String;

    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let dir = std::env::temp_dir().join(std::format!("onnxc-runtime-abi-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let src = dir.join("abi.c");
    let exe = dir.join("abi");
    std::fs::write(
        &src,
        r#"
#include <stddef.h>
#include <stdio.h>
#include "onnxc_runtime.h"
int main(void) {
  printf("%d %d %d %d %d %d\n", ONNXC_ABI_VERSION, ONNXC_FLOAT, ONNXC_INT8, ONNXC_BOOL, ONNXC_FLOAT16, ONNXC_BFLOAT16);
  printf("%zu %zu %zu %zu %zu %zu %zu\n", sizeof(onnxc_tensor_info_t), offsetof(onnxc_tensor_info_t, name),
    offsetof(onnxc_tensor_info_t, dtype), offsetof(onnxc_tensor_info_t, rank), offsetof(onnxc_tensor_info_t, shape),
    offsetof(onnxc_tensor_info_t, elems), offsetof(onnxc_tensor_info_t, bytes));
  printf("%zu %zu %zu %zu %zu %zu %zu %zu %zu %zu %zu %zu\n", sizeof(onnxc_model_t), offsetof(onnxc_model_t, abi_version),
    offsetof(onnxc_model_t, n_inputs), offsetof(onnxc_model_t, n_outputs), offsetof(onnxc_model_t, reserved0),
    offsetof(onnxc_model_t, name), offsetof(onnxc_model_t, inputs), offsetof(onnxc_model_t, outputs),
    offsetof(onnxc_model_t, arena_bytes), offsetof(onnxc_model_t, arena_align), offsetof(onnxc_model_t, run),
    offsetof(onnxc_model_t, cpu_supported));
  printf("%zu %zu %zu %zu\n", sizeof(onnxc_threads_t), offsetof(onnxc_threads_t, parallel_for),
    offsetof(onnxc_threads_t, pool), offsetof(onnxc_model_t, run_parallel));
  for (int s = 0; s <= 4; s++) printf("%s\n", onnxc_status_str(s));
  return 0;
}
"#,
    )
    .unwrap();
    let include = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("include");
    let built = Command::new(&cc)
        .args(["-std=c99", "-Wall", "-Wextra", "-Werror", "-pedantic", "-I"])
        .arg(&include)
        .arg(&src)
        .arg("-o")
        .arg(&exe)
        .output();
    let built = match built {
        Ok(b) => b,
        Err(e) => {
            std::eprintln!("skipping: no C compiler ({cc}): {e}");
            return;
        }
    };
    assert!(
        built.status.success(),
        "{}",
        String::from_utf8_lossy(&built.stderr)
    );
    let run = Command::new(&exe).output().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    let text = String::from_utf8(run.stdout).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    let nums = |l: &str| {
        l.split_whitespace()
            .map(|x| x.parse::<usize>().unwrap())
            .collect::<Vec<_>>()
    };
    assert_eq!(
        nums(lines[0]),
        [
            ABI_VERSION as i32,
            DType::FLOAT.0,
            DType::INT8.0,
            DType::BOOL.0,
            DType::FLOAT16.0,
            DType::BFLOAT16.0
        ]
        .map(|x| x as usize)
        .to_vec(),
        "constants"
    );
    assert_eq!(
        nums(lines[1]),
        vec![
            size_of::<TensorInfo>(),
            offset_of!(TensorInfo, name),
            offset_of!(TensorInfo, dtype),
            offset_of!(TensorInfo, rank),
            offset_of!(TensorInfo, shape),
            offset_of!(TensorInfo, elems),
            offset_of!(TensorInfo, bytes),
        ]
    );
    assert_eq!(
        nums(lines[2]),
        vec![
            size_of::<ModelDesc>(),
            offset_of!(ModelDesc, abi_version),
            offset_of!(ModelDesc, n_inputs),
            offset_of!(ModelDesc, n_outputs),
            offset_of!(ModelDesc, reserved0),
            offset_of!(ModelDesc, name),
            offset_of!(ModelDesc, inputs),
            offset_of!(ModelDesc, outputs),
            offset_of!(ModelDesc, arena_bytes),
            offset_of!(ModelDesc, arena_align),
            offset_of!(ModelDesc, run),
            offset_of!(ModelDesc, cpu_supported),
        ]
    );
    assert_eq!(
        nums(lines[3]),
        vec![
            size_of::<Threads>(),
            offset_of!(Threads, parallel_for),
            offset_of!(Threads, pool),
            offset_of!(ModelDesc, run_parallel),
        ]
    );
    for code in 0..4 {
        assert_eq!(
            lines[4 + code as usize],
            Status::from_code(code).unwrap().as_str()
        );
    }
    assert_eq!(lines[8], "unknown status");
}

static SHAPE_2: [i64; 1] = [2];

/// pick: for each of 2 strings, out_len = its length (int64) and out_str = the string
/// itself when it is not empty, else a constant "(empty)".
unsafe extern "C" fn pick_run(
    inputs: *const *const c_void,
    outputs: *const *mut c_void,
    _arena: *mut c_void,
) -> i32 {
    // SAFETY: the wrapper passes 1 string input and 2 outputs (2 int64, 2 strings).
    unsafe {
        let s = core::slice::from_raw_parts(*inputs as *const *const c_char, 2);
        let lens = core::slice::from_raw_parts_mut(*outputs as *mut i64, 2);
        let out = core::slice::from_raw_parts_mut(*outputs.add(1) as *mut *const c_char, 2);
        for i in 0..2 {
            let n = CStr::from_ptr(s[i]).to_bytes().len();
            lens[i] = n as i64;
            out[i] = if n == 0 { c"(empty)".as_ptr() } else { s[i] };
        }
    }
    0
}

const fn info1(name: &'static CStr, dtype: DType, bytes: u64) -> TensorInfo {
    TensorInfo {
        name: name.as_ptr(),
        dtype: dtype.0,
        rank: 1,
        shape: SHAPE_2.as_ptr(),
        elems: 2,
        bytes,
    }
}

static PICK_INPUTS: [TensorInfo; 1] = [info1(c"words", DType::STRING, 16)];
static PICK_OUTPUTS: [TensorInfo; 2] = [
    info1(c"lens", DType::INT64, 16),
    info1(c"same", DType::STRING, 16),
];
static PICK: ModelDesc = ModelDesc {
    abi_version: ABI_VERSION,
    n_inputs: 1,
    n_outputs: 2,
    reserved0: 0,
    name: c"pick".as_ptr(),
    inputs: PICK_INPUTS.as_ptr(),
    outputs: PICK_OUTPUTS.as_ptr(),
    arena_bytes: 0,
    arena_align: 64,
    run: Some(pick_run),
    cpu_supported: None,
    run_parallel: None,
};

#[test]
fn string_tensors_run_as_c_string_pointers() {
    // SAFETY: PICK is a valid 'static descriptor built above.
    let m = unsafe { Model::from_raw(&PICK) }.unwrap();
    assert_eq!(m.inputs().get(0).unwrap().dtype().align(), 8);
    let text = std::string::String::from("hello\0");
    let word = CStr::from_bytes_with_nul(text.as_bytes()).unwrap();
    let words = [StrRef::new(word), StrRef::new(c"")];
    let mut lens = Arena64::<16>::new();
    let mut same = [StrRef::EMPTY; 2];
    let mut arena = Arena64::<0>::new();
    m.run_tensors(
        &[Input::Strings(&words)],
        &mut [
            Output::Bytes(lens.as_mut_slice()),
            Output::Strings(&mut same),
        ],
        arena.as_mut_slice(),
    )
    .unwrap();
    assert_eq!(lens.0[..8], 5i64.to_ne_bytes());
    assert_eq!(lens.0[8..], 0i64.to_ne_bytes());
    assert_eq!(same[0].to_str(), Some("hello"));
    assert_eq!(same[0].as_ptr(), word.as_ptr(), "the input's own pointer");
    assert_eq!(same[1].as_cstr(), c"(empty)");
}

#[test]
fn string_tensors_never_go_through_bytes_and_are_counted() {
    // SAFETY: PICK is a valid 'static descriptor built above.
    let m = unsafe { Model::from_raw(&PICK) }.unwrap();
    let (mut lens, mut raw) = (Arena64::<16>::new(), Arena64::<16>::new());
    let (lens, raw) = (lens.as_mut_slice(), raw.as_mut_slice());
    let mut arena = Arena64::<0>::new();
    let arena = arena.as_mut_slice();
    let fake = [0x41u8; 16];
    // Bytes for a string input: refused before the model could follow them.
    assert_eq!(
        m.run(&[&fake], &mut [&mut *lens, &mut *raw], arena),
        Err(Error::StringTensor {
            output: false,
            index: 0
        })
    );
    let words = [StrRef::new(c"a"), StrRef::new(c"b")];
    // Strings for an int64 output, and too few strings.
    let mut two = [StrRef::EMPTY; 2];
    assert_eq!(
        m.run_tensors(
            &[Input::Strings(&words)],
            &mut [Output::Strings(&mut two), Output::Bytes(&mut *raw)],
            arena
        ),
        Err(Error::StringTensor {
            output: true,
            index: 0
        })
    );
    let mut one = [StrRef::EMPTY; 1];
    assert!(matches!(
        m.run_tensors(
            &[Input::Strings(&words)],
            &mut [Output::Bytes(&mut *lens), Output::Strings(&mut one)],
            arena
        ),
        Err(Error::OutputSize { index: 1, .. })
    ));
    assert!(matches!(
        m.run_tensors(
            &[Input::Strings(&words[..1])],
            &mut [Output::Bytes(&mut *lens), Output::Strings(&mut two)],
            arena
        ),
        Err(Error::InputSize { index: 0, .. })
    ));
}
