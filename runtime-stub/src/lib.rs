//! The runtime stub that models compiled by onnxc link against: the shared C types of
//! `include/onnxc_runtime.h` (as `#[repr(C)]` Rust types) and a safe wrapper, [`Model`],
//! that checks counts, sizes, types and the arena before calling a compiled model.
//!
//! `no_std`, no allocator, no dependencies: it builds for any target the compiler emits
//! code for. All compute lives in the compiled object; the caller provides every buffer
//! (inputs, outputs and the scratch arena), so nothing here allocates.
//!
//! ```ignore
//! extern "C" { static resnet18_model: onnxc_runtime::ModelDesc; }
//! // SAFETY: the symbol is the descriptor onnxc emitted for this object.
//! let model = unsafe { Model::from_raw(&resnet18_model) }?;
//! let mut arena = [0u8; 1 << 20];
//! let arena = model.carve_arena(&mut arena)?;
//! model.run_typed::<f32>(&[&image], &mut [&mut logits], arena)?;
//! ```
//!
//! String tensors are arrays of `const char *`; they go through [`Model::run_tensors`]
//! as slices of [`StrRef`] (a C string pointer with a lifetime), never as bytes.
#![no_std]

#[cfg(test)]
extern crate std;

use core::ffi::{c_char, c_void, CStr};
use core::fmt;
use core::marker::PhantomData;

/// Version of the layout of [`ModelDesc`] and [`TensorInfo`] (`ONNXC_ABI_VERSION`).
/// Version 2 added [`ModelDesc::run_parallel`]; descriptors of version 1 are still
/// accepted (they run serially).
pub const ABI_VERSION: u32 = 2;

/// The most inputs (and, separately, outputs) the safe [`Model::run`] accepts: it passes
/// the pointer arrays on the stack, without allocating. Models with more use
/// [`Model::run_raw`].
pub const MAX_TENSORS: usize = 64;

/// A status code returned by a model's run function (`onnxc_status_t`).
#[repr(i32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Status {
    Ok = 0,
    NullPointer = 1,
    Misaligned = 2,
    CpuUnsupported = 3,
}

impl Status {
    /// The status for a code, `None` for a code this ABI version does not define.
    pub fn from_code(code: i32) -> Option<Status> {
        match code {
            0 => Some(Status::Ok),
            1 => Some(Status::NullPointer),
            2 => Some(Status::Misaligned),
            3 => Some(Status::CpuUnsupported),
            _ => None,
        }
    }

    /// The same text as `onnxc_status_str` in the C header.
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Ok => "ok",
            Status::NullPointer => "null pointer",
            Status::Misaligned => "misaligned pointer",
            Status::CpuUnsupported => "CPU lacks a required instruction-set feature",
        }
    }
}

/// An element type: an ONNX `TensorProto.DataType` code (`onnxc_dtype_t`). A newtype
/// rather than an enum so that a descriptor carrying a code this stub does not know is
/// still a valid value.
#[repr(transparent)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DType(pub i32);

impl DType {
    pub const UNDEFINED: DType = DType(0);
    pub const FLOAT: DType = DType(1);
    pub const UINT8: DType = DType(2);
    pub const INT8: DType = DType(3);
    pub const UINT16: DType = DType(4);
    pub const INT16: DType = DType(5);
    pub const INT32: DType = DType(6);
    pub const INT64: DType = DType(7);
    pub const STRING: DType = DType(8);
    pub const BOOL: DType = DType(9);
    pub const FLOAT16: DType = DType(10);
    pub const DOUBLE: DType = DType(11);
    pub const UINT32: DType = DType(12);
    pub const UINT64: DType = DType(13);
    pub const COMPLEX64: DType = DType(14);
    pub const COMPLEX128: DType = DType(15);
    pub const BFLOAT16: DType = DType(16);
    pub const FLOAT8E4M3FN: DType = DType(17);
    pub const FLOAT8E4M3FNUZ: DType = DType(18);
    pub const FLOAT8E5M2: DType = DType(19);
    pub const FLOAT8E5M2FNUZ: DType = DType(20);
    pub const UINT4: DType = DType(21);
    pub const INT4: DType = DType(22);
    pub const FLOAT4E2M1: DType = DType(23);
    pub const FLOAT8E8M0: DType = DType(24);
    pub const UINT2: DType = DType(25);
    pub const INT2: DType = DType(26);

    /// The ONNX name of the type (`"float"`, `"int8"`, ...), `None` for an unknown code.
    pub fn name(self) -> Option<&'static str> {
        Some(match self.0 {
            1 => "float",
            2 => "uint8",
            3 => "int8",
            4 => "uint16",
            5 => "int16",
            6 => "int32",
            7 => "int64",
            8 => "string",
            9 => "bool",
            10 => "float16",
            11 => "double",
            12 => "uint32",
            13 => "uint64",
            14 => "complex64",
            15 => "complex128",
            16 => "bfloat16",
            17 => "float8e4m3fn",
            18 => "float8e4m3fnuz",
            19 => "float8e5m2",
            20 => "float8e5m2fnuz",
            21 => "uint4",
            22 => "int4",
            23 => "float4e2m1",
            24 => "float8e8m0",
            25 => "uint2",
            26 => "int2",
            _ => return None,
        })
    }

    /// Bits per element of a dense buffer (sub-byte types are packed), `None` for an
    /// unknown code or for `string`, which has no dense layout.
    pub fn bits(self) -> Option<u32> {
        Some(match self.0 {
            2 | 3 | 9 | 17..=20 | 24 => 8,
            4 | 5 | 10 | 16 => 16,
            1 | 6 | 12 => 32,
            7 | 11 | 13 | 14 => 64,
            15 => 128,
            21..=23 => 4,
            25 | 26 => 2,
            _ => return None,
        })
    }

    /// The alignment a buffer of this type needs: its scalar's natural alignment
    /// (complex types align as their components, strings as pointers), 1 for packed
    /// sub-byte types.
    pub fn align(self) -> usize {
        match self.0 {
            8 => core::mem::align_of::<*const c_char>(),
            14 => 4,
            15 => 8,
            _ => match self.bits() {
                Some(b) if b >= 8 => (b / 8) as usize,
                _ => 1,
            },
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.name() {
            Some(n) => f.write_str(n),
            None => write!(f, "dtype#{}", self.0),
        }
    }
}

/// One input or output of a model (`onnxc_tensor_info_t`).
#[repr(C)]
#[derive(Debug)]
pub struct TensorInfo {
    pub name: *const c_char,
    pub dtype: i32,
    pub rank: i32,
    pub shape: *const i64,
    pub elems: u64,
    pub bytes: u64,
}

/// A model's entry point (`onnxc_run_fn`).
pub type RunFn = unsafe extern "C" fn(
    inputs: *const *const c_void,
    outputs: *const *mut c_void,
    arena: *mut c_void,
) -> i32;

/// One part of a parallel loop (`onnxc_task_fn`): called with the model's context and an
/// index in `[0, n_tasks)`.
pub type TaskFn = unsafe extern "C" fn(ctx: *mut c_void, index: u32);

/// The application's `parallel_for` (`onnxc_threads_t.parallel_for`): must call
/// `task(ctx, i)` exactly once for every `i` in `[0, n_tasks)`, on any threads, and
/// return only when every call has returned.
pub type ParallelForFn =
    unsafe extern "C" fn(pool: *mut c_void, task: TaskFn, ctx: *mut c_void, n_tasks: u32);

/// The application's thread pool as a model sees it (`onnxc_threads_t`). The object never
/// creates threads; [`Model::run_parallel`] hands the parts of large GEMMs to this hook.
///
/// ```
/// use core::ffi::c_void;
/// use onnxc_runtime::{TaskFn, Threads};
/// use std::sync::atomic::{AtomicU32, Ordering};
///
/// /// parallel_for over scoped std threads: `pool` points to the thread count.
/// unsafe extern "C" fn scoped(pool: *mut c_void, task: TaskFn, ctx: *mut c_void, n: u32) {
///     // SAFETY: `pool` is the `usize` below, alive for the whole run.
///     let threads = unsafe { *(pool as *const usize) };
///     let next = AtomicU32::new(0);
///     let ctx = ctx as usize; // the model's context, valid until we return
///     let work = || loop {
///         let i = next.fetch_add(1, Ordering::Relaxed);
///         if i >= n {
///             break;
///         }
///         // SAFETY: the model's task and context, each index run once.
///         unsafe { task(ctx as *mut c_void, i) };
///     };
///     std::thread::scope(|s| {
///         for _ in 1..threads {
///             s.spawn(work);
///         }
///         work();
///     });
/// }
/// let mut n_threads: usize = 2;
/// let threads = Threads {
///     parallel_for: Some(scoped),
///     pool: (&raw mut n_threads).cast(),
/// };
/// # let _ = threads;
/// ```
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Threads {
    pub parallel_for: Option<ParallelForFn>,
    pub pool: *mut c_void,
}

/// A model's threaded entry point (`onnxc_run_parallel_fn`, ABI 2).
pub type RunParallelFn = unsafe extern "C" fn(
    inputs: *const *const c_void,
    outputs: *const *mut c_void,
    arena: *mut c_void,
    threads: *const Threads,
) -> i32;

/// The generic descriptor every compiled model exports (`onnxc_model_t`).
#[repr(C)]
#[derive(Debug)]
pub struct ModelDesc {
    pub abi_version: u32,
    pub n_inputs: u32,
    pub n_outputs: u32,
    pub reserved0: u32,
    pub name: *const c_char,
    pub inputs: *const TensorInfo,
    pub outputs: *const TensorInfo,
    pub arena_bytes: u64,
    pub arena_align: u64,
    pub run: Option<RunFn>,
    pub cpu_supported: Option<unsafe extern "C" fn() -> i32>,
    /// ABI 2 and later only: read it only when `abi_version >= 2` (a version-1
    /// descriptor ends before it).
    pub run_parallel: Option<RunParallelFn>,
}

// SAFETY: by the ABI contract a descriptor and everything it points to (names, shapes,
// tensor infos) is immutable data in the model's object, and its functions are
// reentrant (no globals written, no locks), so sharing it between threads is sound.
unsafe impl Sync for ModelDesc {}
// SAFETY: as above: immutable data and reentrant functions.
unsafe impl Send for ModelDesc {}
// SAFETY: a TensorInfo is immutable data in the model's object (see ModelDesc).
unsafe impl Sync for TensorInfo {}
// SAFETY: as above.
unsafe impl Send for TensorInfo {}

#[cfg(target_pointer_width = "64")]
const _: () = {
    assert!(core::mem::size_of::<TensorInfo>() == 40);
    assert!(core::mem::size_of::<ModelDesc>() == 80);
};

/// Why a call through [`Model`] did not run, or what the model reported.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Error {
    /// The descriptor pointer was null.
    NullDescriptor,
    /// The descriptor was emitted for another ABI version.
    AbiVersion {
        expected: u32,
        found: u32,
    },
    /// The descriptor is malformed (a null table for a non-zero count, no entry point,
    /// a non-power-of-two arena alignment, ...).
    BadDescriptor(&'static str),
    /// This CPU lacks a feature the compiled code assumes (from `cpu_supported`).
    CpuUnsupported,
    InputCount {
        expected: usize,
        found: usize,
    },
    OutputCount {
        expected: usize,
        found: usize,
    },
    /// More inputs or outputs than [`MAX_TENSORS`]: use [`Model::run_raw`].
    TooManyTensors {
        count: usize,
    },
    InputSize {
        index: usize,
        expected: u64,
        found: u64,
    },
    OutputSize {
        index: usize,
        expected: u64,
        found: u64,
    },
    InputType {
        index: usize,
        expected: DType,
        found: DType,
    },
    OutputType {
        index: usize,
        expected: DType,
        found: DType,
    },
    /// An input or output buffer is not aligned for its element type.
    TensorMisaligned {
        output: bool,
        index: usize,
        align: usize,
    },
    ArenaTooSmall {
        needed: u64,
        found: u64,
    },
    ArenaMisaligned {
        align: u64,
    },
    /// The model ran and returned a non-zero status.
    Status(Status),
    /// The model returned a status code this ABI version does not define.
    UnknownStatus(i32),
    /// A string tensor was given as bytes (or a numeric one as strings): string tensors
    /// are arrays of C string pointers and go through [`Model::run_tensors`] as
    /// [`Input::Strings`] / [`Output::Strings`].
    StringTensor {
        output: bool,
        index: usize,
    },
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Error::NullDescriptor => f.write_str("model descriptor pointer is null"),
            Error::AbiVersion { expected, found } => write!(
                f,
                "model was compiled for onnxc ABI version {found}, this runtime speaks version {expected}; recompile the model or update the runtime"
            ),
            Error::BadDescriptor(what) => write!(f, "malformed model descriptor: {what}"),
            Error::CpuUnsupported => f.write_str(
                "this CPU lacks an instruction-set feature the model was compiled for; recompile with a matching --target (or --target host)",
            ),
            Error::InputCount { expected, found } => {
                write!(f, "model takes {expected} inputs, {found} given")
            }
            Error::OutputCount { expected, found } => {
                write!(f, "model produces {expected} outputs, {found} buffers given")
            }
            Error::TooManyTensors { count } => write!(
                f,
                "{count} tensors exceed the safe wrapper's limit of {MAX_TENSORS}; use Model::run_raw"
            ),
            Error::InputSize { index, expected, found } => {
                write!(f, "input {index}: expected {expected} bytes, buffer has {found}")
            }
            Error::OutputSize { index, expected, found } => {
                write!(f, "output {index}: expected {expected} bytes, buffer has {found}")
            }
            Error::InputType { index, expected, found } => {
                write!(f, "input {index}: model expects {expected}, buffer holds {found}")
            }
            Error::OutputType { index, expected, found } => {
                write!(f, "output {index}: model produces {expected}, buffer holds {found}")
            }
            Error::TensorMisaligned { output, index, align } => write!(
                f,
                "{} {index}: buffer is not aligned to {align} bytes",
                if output { "output" } else { "input" }
            ),
            Error::ArenaTooSmall { needed, found } => {
                write!(f, "arena too small: model needs {needed} bytes, {found} given")
            }
            Error::ArenaMisaligned { align } => {
                write!(f, "arena is not aligned to {align} bytes (see Model::carve_arena)")
            }
            Error::Status(s) => write!(f, "model returned status {}: {}", s as i32, s.as_str()),
            Error::UnknownStatus(code) => write!(f, "model returned unknown status {code}"),
            Error::StringTensor { output, index } => write!(
                f,
                "{} {index}: string tensors (arrays of C string pointers) go through Model::run_tensors as Strings, other tensors as Bytes",
                if output { "output" } else { "input" }
            ),
        }
    }
}

/// Element types the typed helpers accept: plain-old-data scalars whose every bit
/// pattern is a valid value.
///
/// # Safety
/// Implementors must be `Copy` types without padding or invalid bit patterns, whose
/// in-memory layout is exactly the ONNX element type [`Element::DTYPE`].
pub unsafe trait Element: Copy + 'static {
    const DTYPE: DType;
}

macro_rules! element {
    ($($t:ty => $d:ident),* $(,)?) => {$(
        // SAFETY: a primitive number type: no padding, every bit pattern valid, and the
        // layout of the named ONNX type.
        unsafe impl Element for $t { const DTYPE: DType = DType::$d; }
    )*};
}
element!(f32 => FLOAT, f64 => DOUBLE, i8 => INT8, u8 => UINT8, i16 => INT16, u16 => UINT16,
         i32 => INT32, u32 => UINT32, i64 => INT64, u64 => UINT64);

/// One element of a string tensor: a pointer to a NUL-terminated string that lives for
/// `'a`, laid out exactly as the C `const char *` a model reads and writes, so a
/// `&[StrRef]` is the model's string tensor itself (no copy, no allocation).
///
/// A model reads its input strings and writes into string outputs only pointers it
/// already has: its inputs' (which live for `'a`) or its constant strings (which live
/// for the program). So outputs filled by [`Model::run_tensors`] are valid for `'a`.
#[repr(transparent)]
#[derive(Clone, Copy)]
pub struct StrRef<'a> {
    ptr: *const c_char,
    life: PhantomData<&'a CStr>,
}

impl<'a> StrRef<'a> {
    /// The empty string (for initialising output arrays).
    pub const EMPTY: StrRef<'static> = StrRef {
        ptr: c"".as_ptr(),
        life: PhantomData,
    };

    pub const fn new(s: &'a CStr) -> StrRef<'a> {
        StrRef {
            ptr: s.as_ptr(),
            life: PhantomData,
        }
    }

    pub fn as_cstr(&self) -> &'a CStr {
        // SAFETY: `ptr` came from a `&'a CStr` (new), or a model wrote it into an output
        // during a run whose inputs live for 'a: by the ABI contract it is then one of
        // those inputs or one of the model's constant strings ('static).
        unsafe { CStr::from_ptr(self.ptr) }
    }

    /// The string as UTF-8, `None` if it is not valid UTF-8.
    pub fn to_str(&self) -> Option<&'a str> {
        self.as_cstr().to_str().ok()
    }

    pub fn as_ptr(&self) -> *const c_char {
        self.ptr
    }
}

impl<'a> From<&'a CStr> for StrRef<'a> {
    fn from(s: &'a CStr) -> StrRef<'a> {
        StrRef::new(s)
    }
}

impl Default for StrRef<'_> {
    fn default() -> Self {
        StrRef::EMPTY
    }
}

impl PartialEq for StrRef<'_> {
    fn eq(&self, other: &Self) -> bool {
        self.as_cstr() == other.as_cstr()
    }
}

impl Eq for StrRef<'_> {}

impl fmt::Debug for StrRef<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self.as_cstr(), f)
    }
}

// SAFETY: a StrRef is a shared reference to immutable bytes (a `&'a CStr` in effect).
unsafe impl Send for StrRef<'_> {}
// SAFETY: as above.
unsafe impl Sync for StrRef<'_> {}

/// An input for [`Model::run_tensors`]: a dense buffer's bytes, or a string tensor.
#[derive(Clone, Copy, Debug)]
pub enum Input<'i, 'a> {
    Bytes(&'i [u8]),
    Strings(&'i [StrRef<'a>]),
}

/// An output for [`Model::run_tensors`]: a dense buffer's bytes, or a string tensor whose
/// elements the run sets (to strings that live as long as the inputs').
#[derive(Debug)]
pub enum Output<'o, 'a> {
    Bytes(&'o mut [u8]),
    Strings(&'o mut [StrRef<'a>]),
}

/// A safe view of one input or output of a model.
#[derive(Clone, Copy)]
pub struct Tensor {
    info: &'static TensorInfo,
}

impl Tensor {
    /// The ONNX name; empty if the descriptor has none or it is not UTF-8 (see
    /// [`Tensor::name_cstr`]).
    pub fn name(&self) -> &'static str {
        self.name_cstr().and_then(|c| c.to_str().ok()).unwrap_or("")
    }

    pub fn name_cstr(&self) -> Option<&'static CStr> {
        if self.info.name.is_null() {
            return None;
        }
        // SAFETY: Model::from_raw's contract: non-null names are NUL-terminated strings
        // that live as long as the descriptor ('static).
        Some(unsafe { CStr::from_ptr(self.info.name) })
    }

    pub fn dtype(&self) -> DType {
        DType(self.info.dtype)
    }

    /// The dimensions (empty for a scalar).
    pub fn shape(&self) -> &'static [i64] {
        let rank = self.info.rank.max(0) as usize;
        if rank == 0 || self.info.shape.is_null() {
            return &[];
        }
        // SAFETY: Model::from_raw's contract: `shape` points to `rank` i64s that live
        // as long as the descriptor ('static).
        unsafe { core::slice::from_raw_parts(self.info.shape, rank) }
    }

    pub fn elems(&self) -> u64 {
        self.info.elems
    }

    pub fn bytes(&self) -> u64 {
        self.info.bytes
    }

    pub fn raw(&self) -> &'static TensorInfo {
        self.info
    }
}

impl fmt::Debug for Tensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tensor")
            .field("name", &self.name())
            .field("dtype", &self.dtype())
            .field("shape", &self.shape())
            .field("bytes", &self.bytes())
            .finish()
    }
}

/// The tensors of one side of a model (inputs or outputs), in graph order.
#[derive(Clone, Copy)]
pub struct Tensors {
    infos: &'static [TensorInfo],
}

impl Tensors {
    pub fn len(&self) -> usize {
        self.infos.len()
    }

    pub fn is_empty(&self) -> bool {
        self.infos.is_empty()
    }

    pub fn get(&self, index: usize) -> Option<Tensor> {
        self.infos.get(index).map(|info| Tensor { info })
    }

    /// The tensor with this ONNX name.
    pub fn by_name(&self, name: &str) -> Option<(usize, Tensor)> {
        self.iter().enumerate().find(|(_, t)| t.name() == name)
    }

    pub fn iter(&self) -> impl ExactSizeIterator<Item = Tensor> + 'static {
        self.infos.iter().map(|info| Tensor { info })
    }
}

impl fmt::Debug for Tensors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

/// A compiled model, reached through its descriptor. Cheap to copy; safe to share
/// between threads (each concurrent run needs its own arena and outputs, which the
/// borrow checker enforces through `&mut`).
#[derive(Clone, Copy)]
pub struct Model {
    desc: &'static ModelDesc,
    cpu_ok: bool,
}

impl Model {
    /// Wraps a descriptor, checking its ABI version and shape, and asks the model once
    /// whether this CPU supports it (a model on an unsupported CPU can still be
    /// inspected; [`Model::run`] then fails with [`Error::CpuUnsupported`]).
    ///
    /// # Safety
    /// `desc` must be null or point to an `onnxc_model_t` that lives for the rest of the
    /// program and never changes, as the one onnxc emits into a model's object does:
    /// `name` and every tensor name null or NUL-terminated; `inputs`/`outputs` pointing
    /// to `n_inputs`/`n_outputs` entries; each `shape` to `rank` dimensions; and `run` a
    /// function that, given buffers of the sizes the descriptor states and an arena of
    /// `arena_bytes` bytes aligned to `arena_align`, reads and writes only those (and
    /// the strings its string inputs point to, up to their NUL), and writes into a string
    /// output only pointers from its string inputs or to NUL-terminated constants that
    /// live for the rest of the program.
    pub unsafe fn from_raw(desc: *const ModelDesc) -> Result<Model, Error> {
        // SAFETY: the caller guarantees `desc` is null or valid for 'static.
        let desc: &'static ModelDesc = match unsafe { desc.as_ref() } {
            Some(d) => d,
            None => return Err(Error::NullDescriptor),
        };
        if !(1..=ABI_VERSION).contains(&desc.abi_version) {
            return Err(Error::AbiVersion {
                expected: ABI_VERSION,
                found: desc.abi_version,
            });
        }
        if desc.run.is_none() {
            return Err(Error::BadDescriptor("no run function"));
        }
        if desc.n_inputs > 0 && desc.inputs.is_null() {
            return Err(Error::BadDescriptor("null input table"));
        }
        if desc.n_outputs > 0 && desc.outputs.is_null() {
            return Err(Error::BadDescriptor("null output table"));
        }
        if desc.arena_align != 0 && !desc.arena_align.is_power_of_two() {
            return Err(Error::BadDescriptor(
                "arena alignment is not a power of two",
            ));
        }
        let cpu_ok = match desc.cpu_supported {
            // SAFETY: the caller guarantees the descriptor's functions are valid; this one
            // takes no arguments and only inspects the CPU.
            Some(f) => (unsafe { f() }) == 1,
            None => true,
        };
        Ok(Model { desc, cpu_ok })
    }

    /// The descriptor itself.
    pub fn desc(&self) -> &'static ModelDesc {
        self.desc
    }

    /// The model name (`--name`); empty if absent or not UTF-8.
    pub fn name(&self) -> &'static str {
        if self.desc.name.is_null() {
            return "";
        }
        // SAFETY: from_raw's contract: a non-null name is NUL-terminated and 'static.
        unsafe { CStr::from_ptr(self.desc.name) }
            .to_str()
            .unwrap_or("")
    }

    pub fn inputs(&self) -> Tensors {
        Tensors {
            infos: table(self.desc.inputs, self.desc.n_inputs),
        }
    }

    pub fn outputs(&self) -> Tensors {
        Tensors {
            infos: table(self.desc.outputs, self.desc.n_outputs),
        }
    }

    /// Exact scratch bytes a run needs.
    pub fn arena_bytes(&self) -> u64 {
        self.desc.arena_bytes
    }

    /// Required arena alignment in bytes (a power of two, at least 1).
    pub fn arena_align(&self) -> u64 {
        self.desc.arena_align.max(1)
    }

    /// Bytes of an arbitrarily aligned buffer that always hold an aligned arena (see
    /// [`Model::carve_arena`]).
    pub fn arena_capacity(&self) -> u64 {
        self.arena_bytes() + self.arena_align() - 1
    }

    /// Whether this CPU has every feature the compiled code assumes.
    pub fn cpu_supported(&self) -> bool {
        self.cpu_ok
    }

    /// The aligned sub-slice of `buf` of exactly `arena_bytes()` bytes to pass as the
    /// arena; `buf` of [`Model::arena_capacity`] bytes always suffices.
    pub fn carve_arena<'a>(&self, buf: &'a mut [u8]) -> Result<&'a mut [u8], Error> {
        let align = self.arena_align() as usize;
        let skip = buf.as_ptr().align_offset(align);
        let found = buf.len() as u64;
        let needed = self.arena_bytes();
        if skip == usize::MAX || (skip as u64).saturating_add(needed) > found {
            return Err(Error::ArenaTooSmall {
                needed: needed + self.arena_align() - 1,
                found,
            });
        }
        Ok(&mut buf[skip..skip + needed as usize])
    }

    /// Runs the model on byte buffers, in graph order, after checking the counts, each
    /// buffer's size and alignment, and the arena's size and alignment.
    pub fn run(
        &self,
        inputs: &[&[u8]],
        outputs: &mut [&mut [u8]],
        arena: &mut [u8],
    ) -> Result<(), Error> {
        self.run_bytes(inputs, outputs, arena, None)
    }

    /// [`Model::run`] with the application's threads: the model's large GEMMs are cut
    /// into parts that `threads.parallel_for` runs. The results are bit-identical to
    /// [`Model::run`]'s. A model of ABI version 1 runs serially.
    pub fn run_parallel(
        &self,
        inputs: &[&[u8]],
        outputs: &mut [&mut [u8]],
        arena: &mut [u8],
        threads: &Threads,
    ) -> Result<(), Error> {
        self.run_bytes(inputs, outputs, arena, Some(threads))
    }

    fn run_bytes(
        &self,
        inputs: &[&[u8]],
        outputs: &mut [&mut [u8]],
        arena: &mut [u8],
        threads: Option<&Threads>,
    ) -> Result<(), Error> {
        self.check_counts(inputs.len(), outputs.len())?;
        let mut ip = [core::ptr::null::<c_void>(); MAX_TENSORS];
        let mut op = [core::ptr::null_mut::<c_void>(); MAX_TENSORS];
        for (index, (buf, t)) in inputs.iter().zip(self.inputs().iter()).enumerate() {
            not_strings(false, index, t)?;
            check_buffer(false, index, buf.as_ptr(), buf.len(), t)?;
            ip[index] = buf.as_ptr().cast();
        }
        for (index, (buf, t)) in outputs.iter_mut().zip(self.outputs().iter()).enumerate() {
            not_strings(true, index, t)?;
            check_buffer(true, index, buf.as_ptr(), buf.len(), t)?;
            op[index] = buf.as_mut_ptr().cast();
        }
        self.call(&ip, &op, arena, threads)
    }

    /// Runs the model on a mix of dense buffers and string tensors, in graph order:
    /// what [`Model::run`] checks, plus each tensor's kind (strings for string tensors,
    /// bytes for the others) and each string tensor's element count. String outputs are
    /// set to pointers that live as long as the input strings (`'a`).
    ///
    /// ```ignore
    /// let words = [StrRef::new(c"cat"), StrRef::new(c"dog")];
    /// let mut ids = [0u8; 16];            // two int64 outputs
    /// let mut echo = [StrRef::EMPTY; 2];  // a string output
    /// model.run_tensors(&[Input::Strings(&words)],
    ///                   &mut [Output::Bytes(&mut ids), Output::Strings(&mut echo)], arena)?;
    /// ```
    pub fn run_tensors<'a>(
        &self,
        inputs: &[Input<'_, 'a>],
        outputs: &mut [Output<'_, 'a>],
        arena: &mut [u8],
    ) -> Result<(), Error> {
        self.tensors(inputs, outputs, arena, None)
    }

    /// [`Model::run_tensors`] with the application's threads (see [`Model::run_parallel`]).
    pub fn run_tensors_parallel<'a>(
        &self,
        inputs: &[Input<'_, 'a>],
        outputs: &mut [Output<'_, 'a>],
        arena: &mut [u8],
        threads: &Threads,
    ) -> Result<(), Error> {
        self.tensors(inputs, outputs, arena, Some(threads))
    }

    fn tensors<'a>(
        &self,
        inputs: &[Input<'_, 'a>],
        outputs: &mut [Output<'_, 'a>],
        arena: &mut [u8],
        threads: Option<&Threads>,
    ) -> Result<(), Error> {
        self.check_counts(inputs.len(), outputs.len())?;
        let mut ip = [core::ptr::null::<c_void>(); MAX_TENSORS];
        let mut op = [core::ptr::null_mut::<c_void>(); MAX_TENSORS];
        for (index, (x, t)) in inputs.iter().zip(self.inputs().iter()).enumerate() {
            ip[index] = match *x {
                Input::Bytes(buf) => {
                    not_strings(false, index, t)?;
                    check_buffer(false, index, buf.as_ptr(), buf.len(), t)?;
                    buf.as_ptr().cast()
                }
                Input::Strings(s) => {
                    check_strings(false, index, s.len(), t)?;
                    s.as_ptr().cast()
                }
            };
        }
        for (index, (x, t)) in outputs.iter_mut().zip(self.outputs().iter()).enumerate() {
            op[index] = match x {
                Output::Bytes(buf) => {
                    not_strings(true, index, t)?;
                    check_buffer(true, index, buf.as_ptr(), buf.len(), t)?;
                    buf.as_mut_ptr().cast()
                }
                Output::Strings(s) => {
                    check_strings(true, index, s.len(), t)?;
                    s.as_mut_ptr().cast()
                }
            };
        }
        // The model writes into string outputs only pointers to its input strings ('a)
        // or to its own constant strings (see StrRef).
        self.call(&ip, &op, arena, threads)
    }

    /// Runs the model on typed buffers, all inputs of type `I` and all outputs of type
    /// `O`, checking each tensor's dtype as well as what [`Model::run`] checks.
    pub fn run_typed<I: Element, O: Element>(
        &self,
        inputs: &[&[I]],
        outputs: &mut [&mut [O]],
        arena: &mut [u8],
    ) -> Result<(), Error> {
        self.typed(inputs, outputs, arena, None)
    }

    /// [`Model::run_typed`] with the application's threads (see [`Model::run_parallel`]).
    pub fn run_typed_parallel<I: Element, O: Element>(
        &self,
        inputs: &[&[I]],
        outputs: &mut [&mut [O]],
        arena: &mut [u8],
        threads: &Threads,
    ) -> Result<(), Error> {
        self.typed(inputs, outputs, arena, Some(threads))
    }

    fn typed<I: Element, O: Element>(
        &self,
        inputs: &[&[I]],
        outputs: &mut [&mut [O]],
        arena: &mut [u8],
        threads: Option<&Threads>,
    ) -> Result<(), Error> {
        self.check_counts(inputs.len(), outputs.len())?;
        let mut ip = [core::ptr::null::<c_void>(); MAX_TENSORS];
        let mut op = [core::ptr::null_mut::<c_void>(); MAX_TENSORS];
        for (index, (buf, t)) in inputs.iter().zip(self.inputs().iter()).enumerate() {
            not_strings(false, index, t)?;
            if t.dtype() != I::DTYPE {
                return Err(Error::InputType {
                    index,
                    expected: t.dtype(),
                    found: I::DTYPE,
                });
            }
            check_buffer(
                false,
                index,
                buf.as_ptr().cast(),
                core::mem::size_of_val(*buf),
                t,
            )?;
            ip[index] = buf.as_ptr().cast();
        }
        for (index, (buf, t)) in outputs.iter_mut().zip(self.outputs().iter()).enumerate() {
            not_strings(true, index, t)?;
            if t.dtype() != O::DTYPE {
                return Err(Error::OutputType {
                    index,
                    expected: t.dtype(),
                    found: O::DTYPE,
                });
            }
            check_buffer(
                true,
                index,
                buf.as_ptr().cast(),
                core::mem::size_of_val(*buf),
                t,
            )?;
            op[index] = buf.as_mut_ptr().cast();
        }
        self.call(&ip, &op, arena, threads)
    }

    /// [`Model::run_typed`] for the common float32 model.
    pub fn run_f32(
        &self,
        inputs: &[&[f32]],
        outputs: &mut [&mut [f32]],
        arena: &mut [u8],
    ) -> Result<(), Error> {
        self.run_typed(inputs, outputs, arena)
    }

    /// Calls the entry point with caller-built pointer arrays, checking only the CPU and
    /// the arena. For models with more than [`MAX_TENSORS`] inputs or outputs.
    ///
    /// # Safety
    /// `inputs` must hold `inputs().len()` pointers and `outputs` `outputs().len()`
    /// pointers, each to a buffer of the tensor's `bytes()` size aligned for its dtype,
    /// outputs writable and not aliasing anything else in use; a string input's buffer
    /// holds `elems()` pointers to NUL-terminated strings (which a string output's
    /// pointers may then point to, so they must outlive the outputs' use).
    pub unsafe fn run_raw(
        &self,
        inputs: *const *const c_void,
        outputs: *const *mut c_void,
        arena: &mut [u8],
    ) -> Result<(), Error> {
        self.check_cpu_and_arena(arena)?;
        // SAFETY: the caller guarantees the pointer arrays; the arena is checked above.
        unsafe { self.invoke(inputs, outputs, arena, None) }
    }

    fn check_counts(&self, n_in: usize, n_out: usize) -> Result<(), Error> {
        let (ei, eo) = (self.inputs().len(), self.outputs().len());
        if n_in != ei {
            return Err(Error::InputCount {
                expected: ei,
                found: n_in,
            });
        }
        if n_out != eo {
            return Err(Error::OutputCount {
                expected: eo,
                found: n_out,
            });
        }
        if ei > MAX_TENSORS || eo > MAX_TENSORS {
            return Err(Error::TooManyTensors { count: ei.max(eo) });
        }
        Ok(())
    }

    fn check_cpu_and_arena(&self, arena: &[u8]) -> Result<(), Error> {
        if !self.cpu_ok {
            return Err(Error::CpuUnsupported);
        }
        if (arena.len() as u64) < self.arena_bytes() {
            return Err(Error::ArenaTooSmall {
                needed: self.arena_bytes(),
                found: arena.len() as u64,
            });
        }
        if !(arena.as_ptr() as usize).is_multiple_of(self.arena_align() as usize) {
            return Err(Error::ArenaMisaligned {
                align: self.arena_align(),
            });
        }
        Ok(())
    }

    fn call(
        &self,
        ip: &[*const c_void; MAX_TENSORS],
        op: &[*mut c_void; MAX_TENSORS],
        arena: &mut [u8],
        threads: Option<&Threads>,
    ) -> Result<(), Error> {
        self.check_cpu_and_arena(arena)?;
        // SAFETY: every pointer in `ip`/`op` up to the model's counts comes from a live
        // slice of exactly the tensor's byte size and alignment (checked above); outputs
        // come from `&mut` slices, so they alias nothing; the arena is checked.
        unsafe { self.invoke(ip.as_ptr(), op.as_ptr(), arena, threads) }
    }

    /// # Safety
    /// The pointer arrays are valid for the model (see `run_raw`) and the arena checked.
    unsafe fn invoke(
        &self,
        ip: *const *const c_void,
        op: *const *mut c_void,
        arena: &mut [u8],
        threads: Option<&Threads>,
    ) -> Result<(), Error> {
        let run = self
            .desc
            .run
            .ok_or(Error::BadDescriptor("no run function"))?;
        // Version 1 descriptors end before `run_parallel`.
        let parallel = match threads {
            Some(t) if self.desc.abi_version >= 2 => self.desc.run_parallel.map(|f| (f, t)),
            _ => None,
        };
        let code = match parallel {
            // SAFETY: from_raw's contract on the descriptor's functions, the buffers the
            // caller vouches for, and a `Threads` whose hook honours its documented
            // contract (every index once, return when all are done).
            Some((f, t)) => unsafe { f(ip, op, arena.as_mut_ptr().cast(), t) },
            // SAFETY: from_raw's contract on `run`, plus the buffers the caller vouches for.
            None => unsafe { run(ip, op, arena.as_mut_ptr().cast()) },
        };
        match Status::from_code(code) {
            Some(Status::Ok) => Ok(()),
            Some(s) => Err(Error::Status(s)),
            None => Err(Error::UnknownStatus(code)),
        }
    }
}

impl fmt::Debug for Model {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Model")
            .field("name", &self.name())
            .field("inputs", &self.inputs())
            .field("outputs", &self.outputs())
            .field("arena_bytes", &self.arena_bytes())
            .field("arena_align", &self.arena_align())
            .field("cpu_supported", &self.cpu_ok)
            .finish()
    }
}

fn table(ptr: *const TensorInfo, n: u32) -> &'static [TensorInfo] {
    if n == 0 || ptr.is_null() {
        return &[];
    }
    // SAFETY: Model::from_raw's contract: a non-null table holds `n` entries that live
    // for 'static and never change.
    unsafe { core::slice::from_raw_parts(ptr, n as usize) }
}

/// String tensors never go through the byte paths: their buffers hold pointers the
/// model follows.
fn not_strings(output: bool, index: usize, t: Tensor) -> Result<(), Error> {
    if t.dtype() == DType::STRING {
        return Err(Error::StringTensor { output, index });
    }
    Ok(())
}

/// A string tensor given for tensor `t`: it must be one, of `t.elems()` strings.
fn check_strings(output: bool, index: usize, len: usize, t: Tensor) -> Result<(), Error> {
    if t.dtype() != DType::STRING {
        return Err(Error::StringTensor { output, index });
    }
    let (expected, found) = (t.bytes(), (len * core::mem::size_of::<StrRef>()) as u64);
    if len as u64 != t.elems() || expected != found {
        return Err(if output {
            Error::OutputSize {
                index,
                expected,
                found,
            }
        } else {
            Error::InputSize {
                index,
                expected,
                found,
            }
        });
    }
    Ok(())
}

fn check_buffer(
    output: bool,
    index: usize,
    ptr: *const u8,
    len: usize,
    t: Tensor,
) -> Result<(), Error> {
    let found = len as u64;
    if found != t.bytes() {
        return Err(if output {
            Error::OutputSize {
                index,
                expected: t.bytes(),
                found,
            }
        } else {
            Error::InputSize {
                index,
                expected: t.bytes(),
                found,
            }
        });
    }
    let align = t.dtype().align();
    if !(ptr as usize).is_multiple_of(align) {
        return Err(Error::TensorMisaligned {
            output,
            index,
            align,
        });
    }
    Ok(())
}

/// A statically sized arena with the 64-byte alignment onnxc uses by default, for
/// programs without an allocator: `static`/stack storage of `N` bytes.
#[repr(C, align(64))]
pub struct Arena64<const N: usize>(pub [u8; N]);

impl<const N: usize> Arena64<N> {
    pub const fn new() -> Self {
        Arena64([0; N])
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut self.0
    }
}

impl<const N: usize> Default for Arena64<N> {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests;
