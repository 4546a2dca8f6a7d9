//! Element types of tensors, numbered as ONNX's `TensorProto.DataType`.

use std::fmt;

/// An element type. The discriminants are ONNX's `TensorProto.DataType` codes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DType {
    F32 = 1,
    U8 = 2,
    I8 = 3,
    U16 = 4,
    I16 = 5,
    I32 = 6,
    I64 = 7,
    Str = 8,
    Bool = 9,
    F16 = 10,
    F64 = 11,
    U32 = 12,
    U64 = 13,
    C64 = 14,
    C128 = 15,
    BF16 = 16,
    F8E4M3FN = 17,
    F8E4M3FNUZ = 18,
    F8E5M2 = 19,
    F8E5M2FNUZ = 20,
    U4 = 21,
    I4 = 22,
    F4E2M1 = 23,
    F8E8M0 = 24,
    U2 = 25,
    I2 = 26,
}

/// How a dtype's elements are held in memory by [`crate::ir::Tensor`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Storage {
    F32,
    F64,
    F16,
    BF16,
    I8,
    I16,
    I32,
    I64,
    U8,
    U16,
    U32,
    U64,
    Bool,
    Str,
}

impl DType {
    pub const ALL: [DType; 26] = [
        DType::F32,
        DType::U8,
        DType::I8,
        DType::U16,
        DType::I16,
        DType::I32,
        DType::I64,
        DType::Str,
        DType::Bool,
        DType::F16,
        DType::F64,
        DType::U32,
        DType::U64,
        DType::C64,
        DType::C128,
        DType::BF16,
        DType::F8E4M3FN,
        DType::F8E4M3FNUZ,
        DType::F8E5M2,
        DType::F8E5M2FNUZ,
        DType::U4,
        DType::I4,
        DType::F4E2M1,
        DType::F8E8M0,
        DType::U2,
        DType::I2,
    ];

    pub fn from_onnx(code: i32) -> Option<DType> {
        DType::ALL.iter().copied().find(|d| *d as i32 == code)
    }

    pub fn onnx_code(self) -> i32 {
        self as i32
    }

    /// The ONNX spelling, as used in `tensor(float)` type strings.
    pub fn onnx_name(self) -> &'static str {
        match self {
            DType::F32 => "float",
            DType::U8 => "uint8",
            DType::I8 => "int8",
            DType::U16 => "uint16",
            DType::I16 => "int16",
            DType::I32 => "int32",
            DType::I64 => "int64",
            DType::Str => "string",
            DType::Bool => "bool",
            DType::F16 => "float16",
            DType::F64 => "double",
            DType::U32 => "uint32",
            DType::U64 => "uint64",
            DType::C64 => "complex64",
            DType::C128 => "complex128",
            DType::BF16 => "bfloat16",
            DType::F8E4M3FN => "float8e4m3fn",
            DType::F8E4M3FNUZ => "float8e4m3fnuz",
            DType::F8E5M2 => "float8e5m2",
            DType::F8E5M2FNUZ => "float8e5m2fnuz",
            DType::U4 => "uint4",
            DType::I4 => "int4",
            DType::F4E2M1 => "float4e2m1",
            DType::F8E8M0 => "float8e8m0",
            DType::U2 => "uint2",
            DType::I2 => "int2",
        }
    }

    /// Where the element lives in memory in the evaluator. Sub-byte and 8-bit float
    /// formats are held one element per byte: integers by value, floats by bit pattern.
    /// `None` for dtypes the evaluator does not hold (complex).
    pub fn storage(self) -> Option<Storage> {
        Some(match self {
            DType::F32 => Storage::F32,
            DType::F64 => Storage::F64,
            DType::F16 => Storage::F16,
            DType::BF16 => Storage::BF16,
            DType::I8 | DType::I4 | DType::I2 => Storage::I8,
            DType::I16 => Storage::I16,
            DType::I32 => Storage::I32,
            DType::I64 => Storage::I64,
            DType::U8 | DType::U4 | DType::U2 => Storage::U8,
            DType::F8E4M3FN
            | DType::F8E4M3FNUZ
            | DType::F8E5M2
            | DType::F8E5M2FNUZ
            | DType::F4E2M1
            | DType::F8E8M0 => Storage::U8,
            DType::U16 => Storage::U16,
            DType::U32 => Storage::U32,
            DType::U64 => Storage::U64,
            DType::Bool => Storage::Bool,
            DType::Str => Storage::Str,
            DType::C64 | DType::C128 => return None,
        })
    }

    /// Size in bits of one element in ONNX's packed `raw_data` encoding.
    pub fn bits(self) -> usize {
        match self {
            DType::F64 | DType::I64 | DType::U64 => 64,
            DType::C128 => 128,
            DType::C64 => 64,
            DType::F32 | DType::I32 | DType::U32 => 32,
            DType::F16 | DType::BF16 | DType::I16 | DType::U16 => 16,
            DType::I8 | DType::U8 | DType::Bool => 8,
            DType::F8E4M3FN
            | DType::F8E4M3FNUZ
            | DType::F8E5M2
            | DType::F8E5M2FNUZ
            | DType::F8E8M0 => 8,
            DType::U4 | DType::I4 | DType::F4E2M1 => 4,
            DType::U2 | DType::I2 => 2,
            DType::Str => 0,
        }
    }

    /// Bytes one element takes in a compiled model's memory (sub-byte types round up).
    pub fn size_bytes(self) -> usize {
        self.bits().div_ceil(8).max(1)
    }

    pub fn is_float(self) -> bool {
        matches!(
            self,
            DType::F32
                | DType::F64
                | DType::F16
                | DType::BF16
                | DType::F8E4M3FN
                | DType::F8E4M3FNUZ
                | DType::F8E5M2
                | DType::F8E5M2FNUZ
                | DType::F4E2M1
                | DType::F8E8M0
        )
    }

    pub fn is_int(self) -> bool {
        self.is_signed_int() || self.is_unsigned_int()
    }

    pub fn is_signed_int(self) -> bool {
        matches!(
            self,
            DType::I8 | DType::I16 | DType::I32 | DType::I64 | DType::I4 | DType::I2
        )
    }

    pub fn is_unsigned_int(self) -> bool {
        matches!(
            self,
            DType::U8 | DType::U16 | DType::U32 | DType::U64 | DType::U4 | DType::U2
        )
    }

    pub fn is_numeric(self) -> bool {
        self.is_float() || self.is_int()
    }

    /// Integer range of an integer dtype, as i128.
    pub fn int_range(self) -> Option<(i128, i128)> {
        Some(match self {
            DType::I8 => (i8::MIN as i128, i8::MAX as i128),
            DType::I16 => (i16::MIN as i128, i16::MAX as i128),
            DType::I32 => (i32::MIN as i128, i32::MAX as i128),
            DType::I64 => (i64::MIN as i128, i64::MAX as i128),
            DType::I4 => (-8, 7),
            DType::I2 => (-2, 1),
            DType::U8 => (0, u8::MAX as i128),
            DType::U16 => (0, u16::MAX as i128),
            DType::U32 => (0, u32::MAX as i128),
            DType::U64 => (0, u64::MAX as i128),
            DType::U4 => (0, 15),
            DType::U2 => (0, 3),
            _ => return None,
        })
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.onnx_name())
    }
}

impl std::str::FromStr for DType {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        DType::ALL
            .iter()
            .copied()
            .find(|d| d.onnx_name() == s)
            .ok_or_else(|| format!("unknown dtype `{s}`"))
    }
}
