//! Dense tensors held by the compiler: constants in the graph IR, and the values the
//! reference evaluator computes with (ndarray underneath).

use super::{minifloat, DType, Storage};
use half::{bf16, f16};
use ndarray::{ArrayD, IxDyn};
use std::fmt;

/// Element storage: one ndarray per storage class. Sub-byte and 8-bit float dtypes use
/// the `I8`/`U8` arrays (see [`DType::storage`]).
#[derive(Clone, PartialEq)]
pub enum Data {
    F32(ArrayD<f32>),
    F64(ArrayD<f64>),
    F16(ArrayD<f16>),
    BF16(ArrayD<bf16>),
    I8(ArrayD<i8>),
    I16(ArrayD<i16>),
    I32(ArrayD<i32>),
    I64(ArrayD<i64>),
    U8(ArrayD<u8>),
    U16(ArrayD<u16>),
    U32(ArrayD<u32>),
    U64(ArrayD<u64>),
    Bool(ArrayD<bool>),
    Str(ArrayD<String>),
}

/// A Rust element type that a [`Data`] variant holds.
pub trait Elem: Clone + Default + PartialEq + fmt::Debug + Send + Sync + 'static {
    const STORAGE: Storage;
    /// The natural dtype for this Rust type.
    const DTYPE: DType;
    fn view(d: &Data) -> Option<&ArrayD<Self>>;
    fn wrap(a: ArrayD<Self>) -> Data;
}

macro_rules! impl_elem {
    ($t:ty, $var:ident, $dt:ident) => {
        impl Elem for $t {
            const STORAGE: Storage = Storage::$var;
            const DTYPE: DType = DType::$dt;
            fn view(d: &Data) -> Option<&ArrayD<Self>> {
                match d {
                    Data::$var(a) => Some(a),
                    _ => None,
                }
            }
            fn wrap(a: ArrayD<Self>) -> Data {
                Data::$var(a)
            }
        }
    };
}
impl_elem!(f32, F32, F32);
impl_elem!(f64, F64, F64);
impl_elem!(f16, F16, F16);
impl_elem!(bf16, BF16, BF16);
impl_elem!(i8, I8, I8);
impl_elem!(i16, I16, I16);
impl_elem!(i32, I32, I32);
impl_elem!(i64, I64, I64);
impl_elem!(u8, U8, U8);
impl_elem!(u16, U16, U16);
impl_elem!(u32, U32, U32);
impl_elem!(u64, U64, U64);
impl_elem!(bool, Bool, Bool);
impl_elem!(String, Str, Str);

/// Runs `$body` with `$T` bound to the Rust element type of storage `$st`.
#[macro_export]
macro_rules! with_storage_type {
    ($st:expr, $T:ident => $body:expr) => {{
        use $crate::ir::Storage as __S;
        match $st {
            __S::F32 => {
                type $T = f32;
                $body
            }
            __S::F64 => {
                type $T = f64;
                $body
            }
            __S::F16 => {
                type $T = half::f16;
                $body
            }
            __S::BF16 => {
                type $T = half::bf16;
                $body
            }
            __S::I8 => {
                type $T = i8;
                $body
            }
            __S::I16 => {
                type $T = i16;
                $body
            }
            __S::I32 => {
                type $T = i32;
                $body
            }
            __S::I64 => {
                type $T = i64;
                $body
            }
            __S::U8 => {
                type $T = u8;
                $body
            }
            __S::U16 => {
                type $T = u16;
                $body
            }
            __S::U32 => {
                type $T = u32;
                $body
            }
            __S::U64 => {
                type $T = u64;
                $body
            }
            __S::Bool => {
                type $T = bool;
                $body
            }
            __S::Str => {
                type $T = String;
                $body
            }
        }
    }};
}

/// Maps every variant of a tensor's data through a generic expression that returns an
/// array of the same element type, keeping the dtype: `map_data!(t, a => a.t().to_owned())`.
#[macro_export]
macro_rules! map_data {
    ($t:expr, $a:ident => $body:expr) => {{
        use $crate::ir::Data as __D;
        let __t: &$crate::ir::Tensor = &$t;
        let __d = match __t.data() {
            __D::F32($a) => __D::F32($body),
            __D::F64($a) => __D::F64($body),
            __D::F16($a) => __D::F16($body),
            __D::BF16($a) => __D::BF16($body),
            __D::I8($a) => __D::I8($body),
            __D::I16($a) => __D::I16($body),
            __D::I32($a) => __D::I32($body),
            __D::I64($a) => __D::I64($body),
            __D::U8($a) => __D::U8($body),
            __D::U16($a) => __D::U16($body),
            __D::U32($a) => __D::U32($body),
            __D::U64($a) => __D::U64($body),
            __D::Bool($a) => __D::Bool($body),
            __D::Str($a) => __D::Str($body),
        };
        $crate::ir::Tensor::from_data(__t.dtype(), __d)
    }};
}

/// Like [`map_data!`] but the body returns `Result<ArrayD<T>>`.
#[macro_export]
macro_rules! try_map_data {
    ($t:expr, $a:ident => $body:expr) => {{
        use $crate::ir::Data as __D;
        let __t: &$crate::ir::Tensor = &$t;
        let __d = match __t.data() {
            __D::F32($a) => __D::F32($body?),
            __D::F64($a) => __D::F64($body?),
            __D::F16($a) => __D::F16($body?),
            __D::BF16($a) => __D::BF16($body?),
            __D::I8($a) => __D::I8($body?),
            __D::I16($a) => __D::I16($body?),
            __D::I32($a) => __D::I32($body?),
            __D::I64($a) => __D::I64($body?),
            __D::U8($a) => __D::U8($body?),
            __D::U16($a) => __D::U16($body?),
            __D::U32($a) => __D::U32($body?),
            __D::U64($a) => __D::U64($body?),
            __D::Bool($a) => __D::Bool($body?),
            __D::Str($a) => __D::Str($body?),
        };
        $crate::ir::Tensor::from_data(__t.dtype(), __d)
    }};
}

/// A dense tensor: a dtype and an n-dimensional array of elements.
#[derive(Clone, PartialEq)]
pub struct Tensor {
    dt: DType,
    data: Data,
}

fn storage_of(d: &Data) -> Storage {
    match d {
        Data::F32(_) => Storage::F32,
        Data::F64(_) => Storage::F64,
        Data::F16(_) => Storage::F16,
        Data::BF16(_) => Storage::BF16,
        Data::I8(_) => Storage::I8,
        Data::I16(_) => Storage::I16,
        Data::I32(_) => Storage::I32,
        Data::I64(_) => Storage::I64,
        Data::U8(_) => Storage::U8,
        Data::U16(_) => Storage::U16,
        Data::U32(_) => Storage::U32,
        Data::U64(_) => Storage::U64,
        Data::Bool(_) => Storage::Bool,
        Data::Str(_) => Storage::Str,
    }
}

impl Tensor {
    /// Builds a tensor; panics if the data's storage does not hold `dt` (a programming
    /// error, not an input error).
    pub fn from_data(dt: DType, data: Data) -> Tensor {
        assert_eq!(
            dt.storage(),
            Some(storage_of(&data)),
            "dtype {dt} held in the wrong storage"
        );
        Tensor { dt, data }
    }

    pub fn from_array<T: Elem>(a: ArrayD<T>) -> Tensor {
        Tensor {
            dt: T::DTYPE,
            data: T::wrap(a),
        }
    }

    /// An array held as dtype `dt` (for the sub-byte and 8-bit float dtypes).
    pub fn from_array_as<T: Elem>(dt: DType, a: ArrayD<T>) -> Tensor {
        Tensor::from_data(dt, T::wrap(a))
    }

    pub fn from_vec<T: Elem>(shape: &[usize], v: Vec<T>) -> Tensor {
        Tensor::from_array(ArrayD::from_shape_vec(IxDyn(shape), v).expect("shape matches data"))
    }

    pub fn scalar<T: Elem>(v: T) -> Tensor {
        Tensor::from_vec(&[], vec![v])
    }

    pub fn zeros(dt: DType, shape: &[usize]) -> Tensor {
        let st = dt.storage().expect("dtype has storage");
        with_storage_type!(st, T => Tensor::from_data(dt, T::wrap(ArrayD::<T>::default(IxDyn(shape)))))
    }

    pub fn dtype(&self) -> DType {
        self.dt
    }

    pub fn data(&self) -> &Data {
        &self.data
    }

    pub fn into_data(self) -> Data {
        self.data
    }

    pub fn shape(&self) -> &[usize] {
        match &self.data {
            Data::F32(a) => a.shape(),
            Data::F64(a) => a.shape(),
            Data::F16(a) => a.shape(),
            Data::BF16(a) => a.shape(),
            Data::I8(a) => a.shape(),
            Data::I16(a) => a.shape(),
            Data::I32(a) => a.shape(),
            Data::I64(a) => a.shape(),
            Data::U8(a) => a.shape(),
            Data::U16(a) => a.shape(),
            Data::U32(a) => a.shape(),
            Data::U64(a) => a.shape(),
            Data::Bool(a) => a.shape(),
            Data::Str(a) => a.shape(),
        }
    }

    pub fn rank(&self) -> usize {
        self.shape().len()
    }

    pub fn len(&self) -> usize {
        self.shape().iter().product()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The array of element type `T`, if this tensor is stored that way.
    pub fn array<T: Elem>(&self) -> Option<&ArrayD<T>> {
        T::view(&self.data)
    }

    /// Elements converted to f64 (numbers and bools; None for strings).
    pub fn to_f64(&self) -> Option<ArrayD<f64>> {
        Some(match (&self.data, self.dt) {
            (Data::F32(a), _) => a.mapv(|x| x as f64),
            (Data::F64(a), _) => a.clone(),
            (Data::F16(a), _) => a.mapv(|x| x.to_f64()),
            (Data::BF16(a), _) => a.mapv(|x| x.to_f64()),
            (Data::U8(a), dt) if dt.is_float() => a.mapv(|x| minifloat::decode(dt, x)),
            (Data::I8(a), _) => a.mapv(|x| x as f64),
            (Data::I16(a), _) => a.mapv(|x| x as f64),
            (Data::I32(a), _) => a.mapv(|x| x as f64),
            (Data::I64(a), _) => a.mapv(|x| x as f64),
            (Data::U8(a), _) => a.mapv(|x| x as f64),
            (Data::U16(a), _) => a.mapv(|x| x as f64),
            (Data::U32(a), _) => a.mapv(|x| x as f64),
            (Data::U64(a), _) => a.mapv(|x| x as f64),
            (Data::Bool(a), _) => a.mapv(|x| x as u8 as f64),
            (Data::Str(_), _) => return None,
        })
    }

    /// Integer and bool elements as i128 (exact for every integer dtype); floats are
    /// truncated toward zero. None for strings.
    pub fn to_i128(&self) -> Option<ArrayD<i128>> {
        Some(match &self.data {
            Data::I8(a) => a.mapv(|x| x as i128),
            Data::I16(a) => a.mapv(|x| x as i128),
            Data::I32(a) => a.mapv(|x| x as i128),
            Data::I64(a) => a.mapv(|x| x as i128),
            Data::U8(a) if !self.dt.is_float() => a.mapv(|x| x as i128),
            Data::U16(a) => a.mapv(|x| x as i128),
            Data::U32(a) => a.mapv(|x| x as i128),
            Data::U64(a) => a.mapv(|x| x as i128),
            Data::Bool(a) => a.mapv(|x| x as i128),
            Data::Str(_) => return None,
            _ => self.to_f64()?.mapv(|x| x as i128),
        })
    }

    /// Elements as i64 in a flat vector (shape inputs, axes, indices).
    pub fn to_i64_vec(&self) -> Option<Vec<i64>> {
        Some(self.to_i128()?.iter().map(|&x| x as i64).collect())
    }

    pub fn to_f64_vec(&self) -> Option<Vec<f64>> {
        Some(self.to_f64()?.iter().copied().collect())
    }

    /// Truthiness of each element (non-zero numbers are true).
    pub fn to_bool(&self) -> Option<ArrayD<bool>> {
        match &self.data {
            Data::Bool(a) => Some(a.clone()),
            Data::Str(a) => Some(a.map(|s| !s.is_empty())),
            _ => Some(self.to_f64()?.mapv(|x| x != 0.0)),
        }
    }

    /// Builds a tensor of dtype `dt` from f64 values: floats round to nearest even,
    /// integers truncate toward zero and saturate, minifloats saturate when `saturate`.
    pub fn from_f64(dt: DType, a: ArrayD<f64>, saturate: bool) -> Tensor {
        let data = match dt {
            DType::F32 => Data::F32(a.mapv(|x| x as f32)),
            DType::F64 => Data::F64(a),
            DType::F16 => Data::F16(a.mapv(f16::from_f64)),
            DType::BF16 => Data::BF16(a.mapv(bf16::from_f64)),
            // Like C on x86: truncate toward zero, then wrap to the width.
            DType::I8 => Data::I8(a.mapv(|x| x as i64 as i8)),
            DType::I16 => Data::I16(a.mapv(|x| x as i64 as i16)),
            DType::I32 => Data::I32(a.mapv(|x| x as i64 as i32)),
            DType::I64 => Data::I64(a.mapv(|x| x as i64)),
            DType::U8 => Data::U8(a.mapv(|x| x as i64 as u8)),
            DType::U16 => Data::U16(a.mapv(|x| x as i64 as u16)),
            DType::U32 => Data::U32(a.mapv(|x| x as i64 as u32)),
            DType::U64 => Data::U64(a.mapv(|x| if x >= 0.0 { x as u64 } else { x as i64 as u64 })),
            DType::I4 => Data::I8(a.mapv(|x| (x.round_ties_even()).clamp(-8.0, 7.0) as i8)),
            DType::I2 => Data::I8(a.mapv(|x| (x.round_ties_even()).clamp(-2.0, 1.0) as i8)),
            DType::U4 => Data::U8(a.mapv(|x| (x.round_ties_even()).clamp(0.0, 15.0) as u8)),
            DType::U2 => Data::U8(a.mapv(|x| (x.round_ties_even()).clamp(0.0, 3.0) as u8)),
            DType::Bool => Data::Bool(a.mapv(|x| x != 0.0)),
            DType::Str => Data::Str(a.mapv(format_float)),
            DType::F8E4M3FN
            | DType::F8E4M3FNUZ
            | DType::F8E5M2
            | DType::F8E5M2FNUZ
            | DType::F4E2M1
            | DType::F8E8M0 => Data::U8(a.mapv(|x| minifloat::encode(dt, x, saturate))),
            DType::C64 | DType::C128 => panic!("complex tensors are not held"),
        };
        Tensor::from_data(dt, data)
    }

    /// Builds an integer (or bool) tensor from i128 values, wrapping like C casts.
    pub fn from_i128(dt: DType, a: ArrayD<i128>) -> Tensor {
        let data = match dt {
            // Like C on x86: truncate toward zero, then wrap to the width.
            DType::I8 => Data::I8(a.mapv(|x| x as i8)),
            DType::I16 => Data::I16(a.mapv(|x| x as i16)),
            DType::I32 => Data::I32(a.mapv(|x| x as i32)),
            DType::I64 => Data::I64(a.mapv(|x| x as i64)),
            DType::U8 => Data::U8(a.mapv(|x| x as u8)),
            DType::U16 => Data::U16(a.mapv(|x| x as u16)),
            DType::U32 => Data::U32(a.mapv(|x| x as u32)),
            DType::U64 => Data::U64(a.mapv(|x| x as u64)),
            DType::I4 => Data::I8(a.mapv(|x| ((x as i8) << 4) >> 4)),
            DType::I2 => Data::I8(a.mapv(|x| ((x as i8) << 6) >> 6)),
            DType::U4 => Data::U8(a.mapv(|x| (x as u8) & 0xF)),
            DType::U2 => Data::U8(a.mapv(|x| (x as u8) & 0x3)),
            DType::Bool => Data::Bool(a.mapv(|x| x != 0)),
            DType::Str => Data::Str(a.mapv(|x| x.to_string())),
            _ => return Tensor::from_f64(dt, a.mapv(|x| x as f64), false),
        };
        Tensor::from_data(dt, data)
    }

    /// Converts to another dtype with ONNX `Cast` semantics.
    pub fn cast(&self, to: DType, saturate: bool) -> Option<Tensor> {
        if to == self.dt {
            return Some(self.clone());
        }
        to.storage()?;
        let from = self.dt;
        Some(match (&self.data, to) {
            (Data::Str(a), DType::Bool) => Tensor::from_array(a.map(|s| {
                s.trim()
                    .parse::<f64>()
                    .map(|v| v != 0.0)
                    .unwrap_or(!s.is_empty())
            })),
            (Data::Str(a), to) if to.is_int() => Tensor::from_i128(
                to,
                a.map(|s| {
                    let s = s.trim();
                    s.parse::<i128>()
                        .unwrap_or_else(|_| s.parse::<f64>().unwrap_or(0.0) as i128)
                }),
            ),
            (Data::Str(a), to) => Tensor::from_f64(to, a.map(|s| parse_float(s.trim())), saturate),
            (_, DType::Str) if from.is_int() || from == DType::Bool => {
                let v = self.to_i128()?;
                if from == DType::Bool {
                    Tensor::from_array(v.mapv(|x| {
                        if x != 0 {
                            "True".to_string()
                        } else {
                            "False".to_string()
                        }
                    }))
                } else {
                    Tensor::from_array(v.mapv(|x| x.to_string()))
                }
            }
            (_, DType::Str) => {
                let v = self.to_f64()?;
                match from {
                    DType::F32 => Tensor::from_array(v.mapv(|x| format_float32(x as f32))),
                    _ => Tensor::from_array(v.mapv(format_float)),
                }
            }
            (_, to)
                if (from.is_int() || from == DType::Bool) && (to.is_int() || to == DType::Bool) =>
            {
                Tensor::from_i128(to, self.to_i128()?)
            }
            // Like ONNX's reference: truncate toward zero and wrap to the width.
            (_, to) if matches!(to, DType::I4 | DType::U4 | DType::I2 | DType::U2) => {
                Tensor::from_i128(
                    to,
                    self.to_f64()?
                        .mapv(|e| if e.is_finite() { e.trunc() as i128 } else { 0 }),
                )
            }
            (_, to) => Tensor::from_f64(to, self.to_f64()?, saturate),
        })
    }

    /// Same data, new shape (element count must match).
    pub fn reshape(&self, shape: &[usize]) -> Option<Tensor> {
        if shape.iter().product::<usize>() != self.len() {
            return None;
        }
        Some(map_data!(self, a => a
            .as_standard_layout()
            .into_owned()
            .into_shape_with_order(IxDyn(shape))
            .expect("count checked")))
    }

    /// A tensor with a standard (row-major, contiguous) layout.
    pub fn standard(&self) -> Tensor {
        map_data!(self, a => a.as_standard_layout().into_owned())
    }

    /// A one-line, bounded description of the contents, for IR dumps and messages.
    pub fn summary(&self, max_elems: usize) -> String {
        let mut s = format!("{}{:?}", self.dt, self.shape());
        let shown: Vec<String> = match &self.data {
            Data::Str(a) => a.iter().take(max_elems).map(|x| format!("{x:?}")).collect(),
            Data::Bool(a) => a.iter().take(max_elems).map(|x| x.to_string()).collect(),
            Data::F32(a) => a.iter().take(max_elems).map(|x| format!("{x}")).collect(),
            _ if self.dt.is_float() => self
                .to_f64()
                .map(|a| a.iter().take(max_elems).map(|x| format!("{x}")).collect())
                .unwrap_or_default(),
            _ => self
                .to_i128()
                .map(|a| a.iter().take(max_elems).map(|x| x.to_string()).collect())
                .unwrap_or_default(),
        };
        s.push_str(" [");
        s.push_str(&shown.join(", "));
        if self.len() > max_elems {
            s.push_str(", ...");
        }
        s.push(']');
        s
    }
}

impl fmt::Debug for Tensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.summary(16))
    }
}

fn parse_float(s: &str) -> f64 {
    let l = s.to_ascii_lowercase();
    match l.as_str() {
        "inf" | "+inf" | "infinity" | "+infinity" => f64::INFINITY,
        "-inf" | "-infinity" => f64::NEG_INFINITY,
        "nan" | "+nan" | "-nan" => f64::NAN,
        _ => s.parse::<f64>().unwrap_or(f64::NAN),
    }
}

/// Formats like Python's `repr(float)` (shortest round-trip, exponent past 1e16).
fn format_float(x: f64) -> String {
    py_repr(format!("{x:e}"), x.is_nan(), x.is_infinite(), x < 0.0)
}

fn format_float32(x: f32) -> String {
    py_repr(format!("{x:e}"), x.is_nan(), x.is_infinite(), x < 0.0)
}

fn py_repr(sci: String, nan: bool, inf: bool, neg: bool) -> String {
    if nan {
        return "nan".into();
    }
    if inf {
        return if neg { "-inf".into() } else { "inf".into() };
    }
    // `sci` is like "-1.2345e-7": digits and a decimal exponent.
    let (mant, exp) = sci.split_once('e').expect("scientific format");
    let exp: i32 = exp.parse().expect("exponent");
    let (sign, mant) = mant
        .strip_prefix('-')
        .map(|m| ("-", m))
        .unwrap_or(("", mant));
    let digits: String = mant.chars().filter(|c| *c != '.').collect();
    if (-4..16).contains(&exp) {
        let point = exp + 1; // position of the decimal point in `digits`
        let s = if point <= 0 {
            format!("0.{}{}", "0".repeat((-point) as usize), digits)
        } else if point as usize >= digits.len() {
            format!("{}{}.0", digits, "0".repeat(point as usize - digits.len()))
        } else {
            format!(
                "{}.{}",
                &digits[..point as usize],
                &digits[point as usize..]
            )
        };
        format!("{sign}{s}")
    } else {
        let m = if digits.len() > 1 {
            format!("{}.{}", &digits[..1], &digits[1..])
        } else {
            digits
        };
        format!(
            "{sign}{m}e{}{:02}",
            if exp < 0 { '-' } else { '+' },
            exp.abs()
        )
    }
}

/// NumPy-style broadcasting of two shapes.
pub fn broadcast_shapes(a: &[usize], b: &[usize]) -> Option<Vec<usize>> {
    let n = a.len().max(b.len());
    let mut out = vec![0; n];
    for i in 0..n {
        let da = if i + a.len() >= n {
            a[i + a.len() - n]
        } else {
            1
        };
        let db = if i + b.len() >= n {
            b[i + b.len() - n]
        } else {
            1
        };
        out[i] = match (da, db) {
            (x, y) if x == y => x,
            (1, y) => y,
            (x, 1) => x,
            _ => return None,
        };
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn python_float_repr() {
        assert_eq!(format_float(1.0), "1.0");
        assert_eq!(format_float(0.5), "0.5");
        assert_eq!(format_float(1e-5), "1e-05");
        assert_eq!(format_float(123456.0), "123456.0");
        assert_eq!(format_float(1e16), "1e+16");
        assert_eq!(format_float(-0.001), "-0.001");
        assert_eq!(format_float32(0.1f32), "0.1");
    }

    #[test]
    fn broadcast() {
        assert_eq!(broadcast_shapes(&[2, 1, 3], &[4, 1]), Some(vec![2, 4, 3]));
        assert_eq!(broadcast_shapes(&[2], &[3]), None);
    }

    #[test]
    fn cast_roundtrips() {
        let t = Tensor::from_vec(&[3], vec![1.5f32, -2.0, 300.0]);
        let i = t.cast(DType::U8, false).unwrap();
        assert_eq!(i.to_i64_vec().unwrap(), vec![1, 254, 44]);
    }
}
