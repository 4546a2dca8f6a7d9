//! Kernel IR: target-independent kernels over flat buffers. A [`Program`] is the list of
//! buffers (model inputs and outputs, arena slices, constant data) and the kernels that
//! run in order; each kernel is a loop nest of scalar statements. The native back end
//! turns every kernel into one function; buffers are named by id, never by ONNX node.

pub mod build;
pub mod parallel;
mod print;
pub mod verify;

pub use print::print_program;

use std::fmt;

/// Scalar types kernels compute with and buffers hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Ty {
    F32,
    F64,
    I8,
    I16,
    I32,
    I64,
    U8,
    U16,
    U32,
    U64,
    /// Storage only: loads widen to F32, stores round to nearest even.
    F16,
    /// Storage only: loads widen to F32, stores round to nearest even.
    BF16,
    /// 8-bit floats (storage only, like F16): loads widen to F32, stores round to
    /// nearest even; out-of-range stores give the type's NaN (Inf for E5M2).
    F8E4M3FN,
    F8E4M3FNUZ,
    F8E5M2,
    F8E5M2FNUZ,
    /// Power-of-two scale (storage only): stores round up.
    F8E8M0,
    /// Packed two per byte (low nibble first), storage only, computes as F32.
    F4E2M1,
    /// Packed sub-byte integers (low bits first); compute as I8 / U8.
    I4,
    U4,
    I2,
    U2,
    /// An element of a string tensor: a pointer to a NUL-terminated UTF-8 string that
    /// lives outside every buffer (the caller's input strings, or constant bytes in the
    /// object). 64 bits (the back ends target 64-bit ISAs). Loads and stores copy the
    /// pointer, `Select` and variables carry it, [`Expr::StrByte`] reads the bytes; there
    /// is no arithmetic, comparison or cast on it.
    Str,
}

impl Ty {
    /// Bytes one element occupies; 1 for the packed sub-byte types (see [`Ty::bits`]).
    pub fn bytes(self) -> u64 {
        self.bits().div_ceil(8)
    }

    /// Bits one element occupies (4 and 2 for the packed types).
    pub fn bits(self) -> u64 {
        match self {
            Ty::F64 | Ty::I64 | Ty::U64 | Ty::Str => 64,
            Ty::F32 | Ty::I32 | Ty::U32 => 32,
            Ty::I16 | Ty::U16 | Ty::F16 | Ty::BF16 => 16,
            Ty::I8
            | Ty::U8
            | Ty::F8E4M3FN
            | Ty::F8E4M3FNUZ
            | Ty::F8E5M2
            | Ty::F8E5M2FNUZ
            | Ty::F8E8M0 => 8,
            Ty::F4E2M1 | Ty::I4 | Ty::U4 => 4,
            Ty::I2 | Ty::U2 => 2,
        }
    }

    pub fn is_float(self) -> bool {
        self.compute() == Ty::F32 || self == Ty::F64
    }

    pub fn is_signed(self) -> bool {
        matches!(self, Ty::I8 | Ty::I16 | Ty::I32 | Ty::I64 | Ty::I4 | Ty::I2)
    }

    /// Whether the type exists only in memory (loads widen, stores narrow).
    pub fn is_storage_only(self) -> bool {
        self.compute() != self
    }

    /// The type a load of this storage type produces.
    pub fn compute(self) -> Ty {
        match self {
            Ty::F16
            | Ty::BF16
            | Ty::F8E4M3FN
            | Ty::F8E4M3FNUZ
            | Ty::F8E5M2
            | Ty::F8E5M2FNUZ
            | Ty::F8E8M0
            | Ty::F4E2M1 => Ty::F32,
            Ty::I4 | Ty::I2 => Ty::I8,
            Ty::U4 | Ty::U2 => Ty::U8,
            t => t,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Ty::F32 => "f32",
            Ty::F64 => "f64",
            Ty::I8 => "i8",
            Ty::I16 => "i16",
            Ty::I32 => "i32",
            Ty::I64 => "i64",
            Ty::U8 => "u8",
            Ty::U16 => "u16",
            Ty::U32 => "u32",
            Ty::U64 => "u64",
            Ty::F16 => "f16",
            Ty::BF16 => "bf16",
            Ty::F8E4M3FN => "f8e4m3fn",
            Ty::F8E4M3FNUZ => "f8e4m3fnuz",
            Ty::F8E5M2 => "f8e5m2",
            Ty::F8E5M2FNUZ => "f8e5m2fnuz",
            Ty::F8E8M0 => "f8e8m0",
            Ty::F4E2M1 => "f4e2m1",
            Ty::I4 => "i4",
            Ty::U4 => "u4",
            Ty::I2 => "i2",
            Ty::U2 => "u2",
            Ty::Str => "str",
        }
    }
}

impl fmt::Display for Ty {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

pub type BufId = usize;
pub type VarId = usize;

/// Where a buffer's memory is.
#[derive(Clone, Debug, PartialEq)]
pub enum BufKind {
    /// The k-th model input (read-only).
    Input(usize),
    /// The k-th model output.
    Output(usize),
    /// A slice of the caller's arena, at a byte offset the memory plan fixes.
    Arena { offset: u64 },
    /// Read-only data placed in the object (weights, index tables). For a buffer of
    /// [`Ty::Str`], `data` holds the strings' bytes one after another, each followed by
    /// a NUL (`len` strings); the back end places them and a table of pointers to them.
    Const { data: Vec<u8> },
}

#[derive(Clone, Debug)]
pub struct Buffer {
    pub name: String,
    pub kind: BufKind,
    pub elem: Ty,
    /// Number of elements.
    pub len: u64,
}

impl Buffer {
    pub fn bytes(&self) -> u64 {
        (self.len * self.elem.bits()).div_ceil(8)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UnOp {
    Neg,
    Abs,
    Sqrt,
    Floor,
    Ceil,
    /// Round half to even.
    Nearest,
    Trunc,
    /// Bitwise not (integers).
    Not,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BinOp {
    Add,
    Sub,
    Mul,
    Div,
    /// Integer remainder with the sign of the dividend (C's %).
    Rem,
    Min,
    Max,
    And,
    Or,
    Xor,
    Shl,
    /// Arithmetic for signed types, logical for unsigned.
    Shr,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CmpOp {
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
}

/// Math functions the back end calls (libm on the target).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MathFn {
    Exp,
    Log,
    Pow,
    Sin,
    Cos,
    Tan,
    Asin,
    Acos,
    Atan,
    Sinh,
    Cosh,
    Tanh,
    Asinh,
    Acosh,
    Atanh,
    Erf,
    Fmod,
}

impl MathFn {
    pub fn arity(self) -> usize {
        match self {
            MathFn::Pow | MathFn::Fmod => 2,
            _ => 1,
        }
    }

    /// The libm symbol for the given float type.
    pub fn symbol(self, t: Ty) -> &'static str {
        let f32 = t == Ty::F32;
        macro_rules! pick {
            ($a:literal, $b:literal) => {
                if f32 {
                    $a
                } else {
                    $b
                }
            };
        }
        match self {
            MathFn::Exp => pick!("expf", "exp"),
            MathFn::Log => pick!("logf", "log"),
            MathFn::Pow => pick!("powf", "pow"),
            MathFn::Sin => pick!("sinf", "sin"),
            MathFn::Cos => pick!("cosf", "cos"),
            MathFn::Tan => pick!("tanf", "tan"),
            MathFn::Asin => pick!("asinf", "asin"),
            MathFn::Acos => pick!("acosf", "acos"),
            MathFn::Atan => pick!("atanf", "atan"),
            MathFn::Sinh => pick!("sinhf", "sinh"),
            MathFn::Cosh => pick!("coshf", "cosh"),
            MathFn::Tanh => pick!("tanhf", "tanh"),
            MathFn::Asinh => pick!("asinhf", "asinh"),
            MathFn::Acosh => pick!("acoshf", "acosh"),
            MathFn::Atanh => pick!("atanhf", "atanh"),
            MathFn::Erf => pick!("erff", "erf"),
            MathFn::Fmod => pick!("fmodf", "fmod"),
        }
    }
}

/// A scalar expression. Integer literals and loop variables are i64.
#[derive(Clone, Debug, PartialEq)]
pub enum Expr {
    Var(VarId),
    Int(i64),
    Float(f64, Ty),
    /// `buf[index]`; yields the buffer's compute type.
    Load(BufId, Box<Expr>),
    Un(UnOp, Box<Expr>),
    Bin(BinOp, Box<Expr>, Box<Expr>),
    /// Yields a U8 that is 0 or 1.
    Cmp(CmpOp, Box<Expr>, Box<Expr>),
    /// `cond != 0 ? a : b`.
    Select(Box<Expr>, Box<Expr>, Box<Expr>),
    /// Numeric conversion: float->int truncates (saturating), int->int wraps.
    Cast(Ty, Box<Expr>),
    Call(MathFn, Vec<Expr>),
    /// Byte `j` (third field) of string element `i` (second field) of a [`Ty::Str`]
    /// buffer, as a U8. Reading a byte past the string's NUL is undefined: kernels reach
    /// byte `j` only after bytes `0..j` were seen to be non-zero (see [`Stmt::While`]).
    StrByte(BufId, Box<Expr>, Box<Expr>),
}

impl Expr {
    /// `self` with every use of `var` replaced by `with`.
    pub fn subst(&self, var: VarId, with: &Expr) -> Expr {
        let b = |y: &Expr| Box::new(y.subst(var, with));
        match self {
            Expr::Var(v) if *v == var => with.clone(),
            Expr::Var(_) | Expr::Int(_) | Expr::Float(..) => self.clone(),
            Expr::Load(buf, i) => Expr::Load(*buf, b(i)),
            Expr::Un(op, a) => Expr::Un(*op, b(a)),
            Expr::Cast(t, a) => Expr::Cast(*t, b(a)),
            Expr::Bin(op, a, c) => Expr::Bin(*op, b(a), b(c)),
            Expr::Cmp(op, a, c) => Expr::Cmp(*op, b(a), b(c)),
            Expr::Select(c, a, d) => Expr::Select(b(c), b(a), b(d)),
            Expr::Call(f, args) => {
                Expr::Call(*f, args.iter().map(|a| a.subst(var, with)).collect())
            }
            Expr::StrByte(buf, i, j) => Expr::StrByte(*buf, b(i), b(j)),
        }
    }

    /// Whether `self` reads `var`.
    pub fn reads(&self, var: VarId) -> bool {
        matches!(self, Expr::Var(v) if *v == var) || self.children().iter().any(|c| c.reads(var))
    }

    /// The direct subexpressions.
    pub fn children(&self) -> Vec<&Expr> {
        match self {
            Expr::Var(_) | Expr::Int(_) | Expr::Float(..) => Vec::new(),
            Expr::Load(_, a) | Expr::Un(_, a) | Expr::Cast(_, a) => vec![&**a],
            Expr::Bin(_, a, b) | Expr::Cmp(_, a, b) | Expr::StrByte(_, a, b) => vec![&**a, &**b],
            Expr::Select(c, a, b) => vec![&**c, &**a, &**b],
            Expr::Call(_, args) => args.iter().collect(),
        }
    }

    /// The direct subexpressions, for rewrites that walk the tree.
    pub fn children_mut(&mut self) -> Vec<&mut Expr> {
        match self {
            Expr::Var(_) | Expr::Int(_) | Expr::Float(..) => Vec::new(),
            Expr::Load(_, a) | Expr::Un(_, a) | Expr::Cast(_, a) => vec![&mut **a],
            Expr::Bin(_, a, b) | Expr::Cmp(_, a, b) | Expr::StrByte(_, a, b) => {
                vec![&mut **a, &mut **b]
            }
            Expr::Select(c, a, b) => vec![&mut **c, &mut **a, &mut **b],
            Expr::Call(_, args) => args.iter_mut().collect(),
        }
    }
}

/// Shorthands for building expressions.
impl Expr {
    pub fn load(buf: BufId, idx: Expr) -> Expr {
        Expr::Load(buf, Box::new(idx))
    }
    pub fn un(op: UnOp, a: Expr) -> Expr {
        Expr::Un(op, Box::new(a))
    }
    pub fn bin(op: BinOp, a: Expr, b: Expr) -> Expr {
        Expr::Bin(op, Box::new(a), Box::new(b))
    }
    pub fn cmp(op: CmpOp, a: Expr, b: Expr) -> Expr {
        Expr::Cmp(op, Box::new(a), Box::new(b))
    }
    pub fn select(c: Expr, a: Expr, b: Expr) -> Expr {
        Expr::Select(Box::new(c), Box::new(a), Box::new(b))
    }
    pub fn cast(t: Ty, a: Expr) -> Expr {
        Expr::Cast(t, Box::new(a))
    }
    pub fn call(f: MathFn, args: Vec<Expr>) -> Expr {
        Expr::Call(f, args)
    }
    pub fn str_byte(buf: BufId, elem: Expr, byte: Expr) -> Expr {
        Expr::StrByte(buf, Box::new(elem), Box::new(byte))
    }
    // Node constructors (like `bin`, `cast`), not arithmetic on expressions: they take
    // two operands and are not the std::ops traits' methods.
    #[allow(clippy::should_implement_trait)]
    pub fn add(a: Expr, b: Expr) -> Expr {
        Expr::bin(BinOp::Add, a, b)
    }
    #[allow(clippy::should_implement_trait)]
    pub fn mul(a: Expr, b: Expr) -> Expr {
        Expr::bin(BinOp::Mul, a, b)
    }
    pub fn f(x: f64, t: Ty) -> Expr {
        Expr::Float(x, t)
    }
}

#[derive(Clone, Debug, PartialEq)]
pub enum Stmt {
    /// `for var in 0..extent { body }` (var is i64).
    For {
        var: VarId,
        extent: u64,
        body: Vec<Stmt>,
    },
    /// `buf[index] = value` (converted to the buffer's storage type).
    Store {
        buf: BufId,
        index: Expr,
        value: Expr,
    },
    /// `var = value`.
    Set { var: VarId, value: Expr },
    If {
        cond: Expr,
        then: Vec<Stmt>,
        els: Vec<Stmt>,
    },
    /// A matrix product `C = act(init + alpha * A B)` over f32 buffer views: the back end
    /// picks a microkernel for the target or expands it to loops.
    Gemm(Box<GemmCall>),
    /// `while cond != 0 { body }`: the one loop without a compile-time trip count, for
    /// walking NUL-terminated strings. The lowering that emits it guarantees that it ends
    /// (its condition reads the next byte of a string and stops at the NUL). Analyses
    /// treat it as a loop of unknown length: the vectorisers and the parallel-loop
    /// analysis leave loops that contain one alone.
    While { cond: Expr, body: Vec<Stmt> },
}

/// A strided 2-D view of a buffer: element `(i, j)` is at `offset + i * rs + j * cs`
/// (elements, not bytes; `offset` is an i64 expression that may use loop variables).
///
/// With `panel: Some((w, ps))` on a B view, the columns are stored in panels of `w`:
/// element `(i, j)` is at `offset + (j / w) * ps + i * rs + (j % w) * cs` (e.g.
/// `[n/w][k][w]` with `rs = w, cs = 1, ps = k * w`, the layout GEMM microkernels read B
/// in). On an A view the rows are: element `(i, j)` is at
/// `offset + (i / w) * ps + (i % w) * rs + j * cs` (`[m/w][k][w]` with `rs = 1, cs = w`,
/// the layout microkernels read A in, broadcasting `w` consecutive elements per k step).
/// C and init views have no panels. The last panel is whole inside the buffer (its
/// padding may be read but does not affect the result).
#[derive(Clone, Debug, PartialEq)]
pub struct MatView {
    pub buf: BufId,
    pub offset: Expr,
    pub rs: i64,
    pub cs: i64,
    pub panel: Option<(u64, i64)>,
}

impl MatView {
    /// A view without panels.
    pub fn strided(buf: BufId, offset: Expr, rs: i64, cs: i64) -> MatView {
        MatView {
            buf,
            offset,
            rs,
            cs,
            panel: None,
        }
    }

    /// `buf` from element 0 in the microkernels' packed layout, panels of `w` of a
    /// `depth`-deep operand: as B, `[n/w][depth][w]` (`rs = w, cs = 1`); as A,
    /// `[m/w][depth][w]` (`rs = 1, cs = w`).
    pub fn packed(buf: BufId, w: usize, depth: usize, as_a: bool) -> MatView {
        let (rs, cs) = if as_a { (1, w as i64) } else { (w as i64, 1) };
        MatView {
            buf,
            offset: Expr::Int(0),
            rs,
            cs,
            panel: Some((w as u64, (depth * w) as i64)),
        }
    }
}

/// An activation a [`GemmCall`] applies to each result before storing it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum GemmAct {
    None,
    Relu,
    /// `min(max(x, lo), hi)`.
    Clip(f32, f32),
    /// `x < 0 ? alpha * x : x`.
    Leaky(f32),
    /// `x * (1 / (1 + exp(-x)))` (SiLU, Swish).
    Silu,
}

/// `C[i, j] = act((init[i, j] + alpha * sum_p A[i, p] * B[p, j]) + add[i, j])` for `i < m,
/// j < n, p < k`, all views f32 (with `int8`: 8-bit A and B, C and init i32, see there).
/// `init` absent means 0; `init` equal to `c` accumulates
/// into C. `add` (a residual: the second addend of a bias-then-residual epilogue, summed
/// in that order) is absent or a view of another buffer. C must not overlap A, B or
/// `add`. A constant-buffer operand (weights) with a literal offset may be repacked by
/// the back end at compile time.
#[derive(Clone, Debug, PartialEq)]
pub struct GemmCall {
    pub m: u64,
    pub n: u64,
    pub k: u64,
    pub a: MatView,
    pub b: MatView,
    pub c: MatView,
    pub alpha: f32,
    pub init: Option<MatView>,
    pub add: Option<MatView>,
    pub act: GemmAct,
    /// An 8-bit product: A u8 and B i8, or A i8 and B u8; C and init i32; `C = init +
    /// sum_p A B` in wrapping i32 arithmetic (alpha 1, no add, no activation, no panels,
    /// k a multiple of 4). B is stored in quads, four k of a column together: element
    /// `(p, j)` at `offset + (p / 4) * rs + j * cs + p % 4` (`[k/4][n][4]` with `rs = 4n,
    /// cs = 4`, one i32 lane of `vpdpbusd` per column). MatMulInteger by a constant
    /// weight and ConvInteger lower to it; x86 AVX-512 VNNI runs it as `vpdpbusd` tiles.
    pub int8: bool,
}

impl GemmCall {
    /// The views the call reads and writes: A, B, C, then init and add.
    pub fn views(&self) -> Vec<&MatView> {
        self.named_views().into_iter().map(|(_, v)| v).collect()
    }

    /// [`GemmCall::views`], each with its name (`"A"`, `"B"`, `"C"`, `"init"`, `"add"`).
    pub fn named_views(&self) -> Vec<(&'static str, &MatView)> {
        let mut v = vec![("A", &self.a), ("B", &self.b), ("C", &self.c)];
        v.extend(self.init.as_ref().map(|i| ("init", i)));
        v.extend(self.add.as_ref().map(|r| ("add", r)));
        v
    }

    /// [`GemmCall::views`], to change.
    pub fn views_mut(&mut self) -> Vec<&mut MatView> {
        let mut v = vec![&mut self.a, &mut self.b, &mut self.c];
        v.extend(self.init.as_mut());
        v.extend(self.add.as_mut());
        v
    }
}

/// One kernel: a function over the program's buffers.
#[derive(Clone, Debug, Default)]
pub struct Kernel {
    pub name: String,
    /// Type of each variable (loop variables are I64).
    pub vars: Vec<Ty>,
    pub body: Vec<Stmt>,
    /// A U8 variable the back end sets on entry: 1 when the run may hand loops to the
    /// application's threads (a `parallel_for` hook), else 0. For lowerings whose best
    /// split of the work depends on it ([`Kernel::threaded`]); the kernel never sets it.
    pub threaded: Option<VarId>,
    /// Set by a lowering whose kernel writes its output in [`Bands`] (a depthwise conv
    /// by bands of output rows), for `lower::bands` to append the next kernel's GEMM on
    /// that output to each band.
    pub bands: Option<Bands>,
}

/// How a kernel writes buffer `buf`, seen as `images x rows` rows of `cols` elements (an
/// NCHW output: channels of `cols` pixels): iteration `b` of the loop over `band` (inside
/// the loop over `image`) writes columns `[b * width, (b + 1) * width)` of every row of
/// its image, and nothing else of `buf`; statements appended to that loop's body run
/// after those columns are written, in the same iteration.
#[derive(Clone, Debug, PartialEq)]
pub struct Bands {
    pub buf: BufId,
    pub image: VarId,
    pub band: VarId,
    pub images: u64,
    pub rows: u64,
    pub cols: u64,
    pub width: u64,
}

impl Kernel {
    pub fn new(name: impl Into<String>) -> Kernel {
        Kernel {
            name: name.into(),
            ..Default::default()
        }
    }

    pub fn var(&mut self, t: Ty) -> VarId {
        self.vars.push(t);
        self.vars.len() - 1
    }

    /// The [`Kernel::threaded`] variable (made on first use). Every `If` on it must
    /// compute the same values in both branches: it picks how the work splits, not what
    /// it computes.
    pub fn threaded(&mut self) -> VarId {
        match self.threaded {
            Some(v) => v,
            None => {
                let v = self.var(Ty::U8);
                self.threaded = Some(v);
                v
            }
        }
    }
}

/// A whole compiled model in kernel IR.
#[derive(Clone, Debug, Default)]
pub struct Program {
    pub buffers: Vec<Buffer>,
    pub kernels: Vec<Kernel>,
    /// Bytes of scratch the caller provides (the memory plan's result).
    pub arena_bytes: u64,
    pub inputs: Vec<BufId>,
    pub outputs: Vec<BufId>,
}

impl Program {
    pub fn add_buffer(
        &mut self,
        name: impl Into<String>,
        kind: BufKind,
        elem: Ty,
        len: u64,
    ) -> BufId {
        self.buffers.push(Buffer {
            name: name.into(),
            kind,
            elem,
            len,
        });
        self.buffers.len() - 1
    }
}
