//! Reading and writing tensors: NumPy `.npy` files and ONNX TensorProto `.pb` files.
//!
//! `.npy` is a small format (a magic string, a Python-dict header, raw little-endian
//! data); it is written here directly because onnxc needs every dtype, chosen at run
//! time from the header, which the typed `.npy` crates do not offer.

use crate::error::{Error, Result};
use crate::ir::{DType, Tensor, Value, ValueType};
use crate::onnx;
use std::path::Path;

fn descr(dt: DType) -> Option<&'static str> {
    Some(match dt {
        DType::F32 => "<f4",
        DType::F64 => "<f8",
        DType::F16 => "<f2",
        DType::I8 => "|i1",
        DType::I16 => "<i2",
        DType::I32 => "<i4",
        DType::I64 => "<i8",
        DType::U8 => "|u1",
        DType::U16 => "<u2",
        DType::U32 => "<u4",
        DType::U64 => "<u8",
        DType::Bool => "|b1",
        _ => return None,
    })
}

/// Encodes a tensor as `.npy` bytes. bfloat16 and the 8/4-bit float types are written
/// as float32 (NumPy has no such dtypes); 4/2-bit integers as int8/uint8; strings as
/// NumPy's fixed-width unicode (`<U` + the longest string's length in characters).
pub fn to_npy(t: &Tensor) -> Result<Vec<u8>> {
    let t = match t.dtype() {
        DType::BF16
        | DType::F8E4M3FN
        | DType::F8E4M3FNUZ
        | DType::F8E5M2
        | DType::F8E5M2FNUZ
        | DType::F4E2M1
        | DType::F8E8M0 => t.cast(DType::F32, false).expect("float cast"),
        DType::I4 | DType::I2 => t.cast(DType::I8, false).expect("int cast"),
        DType::U4 | DType::U2 => t.cast(DType::U8, false).expect("int cast"),
        _ => t.clone(),
    };
    let strings = t.array::<String>();
    let width = strings.map_or(0, |a| {
        a.iter().map(|s| s.chars().count()).max().unwrap_or(0)
    });
    let unicode = format!("<U{}", width.max(1));
    let d = match strings {
        Some(_) => unicode.as_str(),
        None => descr(t.dtype()).ok_or_else(|| {
            Error::Usage(format!("{} tensors cannot be written as .npy", t.dtype()))
        })?,
    };
    let shape: Vec<String> = t.shape().iter().map(|d| d.to_string()).collect();
    let shape = match shape.len() {
        1 => format!("({},)", shape[0]),
        _ => format!("({})", shape.join(", ")),
    };
    let mut header = format!("{{'descr': '{d}', 'fortran_order': False, 'shape': {shape}, }}");
    let unpadded = 10 + header.len() + 1;
    header.push_str(&" ".repeat((64 - unpadded % 64) % 64));
    header.push('\n');
    let mut out = b"\x93NUMPY\x01\x00".to_vec();
    out.extend_from_slice(&(header.len() as u16).to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    match strings {
        Some(a) => {
            for s in a.iter() {
                let mut n = 0;
                for c in s.chars() {
                    out.extend_from_slice(&(c as u32).to_le_bytes());
                    n += 1;
                }
                out.resize(out.len() + 4 * (width.max(1) - n), 0);
            }
        }
        None => {
            let p = onnx::tensor::to_proto(&t, "");
            out.extend_from_slice(p.raw_data.as_deref().unwrap_or(&[]));
        }
    }
    Ok(out)
}

/// Decodes `.npy` bytes (C order; the dtypes of [`to_npy`]).
pub fn from_npy(bytes: &[u8], what: &str) -> Result<Tensor> {
    let bad = |m: &str| Error::Usage(format!("{what}: not a valid .npy file ({m})"));
    if bytes.len() < 10 || &bytes[..6] != b"\x93NUMPY" {
        return Err(bad("missing the \\x93NUMPY magic"));
    }
    let (hlen, start) = match bytes[6] {
        1 => (u16::from_le_bytes([bytes[8], bytes[9]]) as usize, 10),
        2 | 3 if bytes.len() >= 12 => (
            u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize,
            12,
        ),
        _ => return Err(bad("unknown version")),
    };
    let header = bytes
        .get(start..start + hlen)
        .and_then(|h| std::str::from_utf8(h).ok())
        .ok_or_else(|| bad("truncated header"))?;
    let field = |key: &str| -> Option<&str> {
        let i = header.find(&format!("'{key}'"))?;
        Some(
            header[i + key.len() + 2..]
                .trim_start()
                .trim_start_matches(':')
                .trim_start(),
        )
    };
    let descr_s = field("descr")
        .and_then(|s| s.strip_prefix('\''))
        .and_then(|s| s.split('\'').next());
    let descr_s = descr_s.ok_or_else(|| bad("no descr"))?;
    if field("fortran_order").is_some_and(|s| s.starts_with("True")) {
        return Err(bad(
            "Fortran order is not supported; save with np.ascontiguousarray",
        ));
    }
    let width = descr_s
        .strip_prefix("<U")
        .and_then(|w| w.parse::<usize>().ok());
    let dt = match width {
        Some(_) => DType::Str,
        None => DType::ALL
            .iter()
            .copied()
            .find(|d| descr(*d).is_some_and(|x| x == descr_s || x.replace('|', "<") == descr_s))
            .ok_or_else(|| bad(&format!("unsupported dtype `{descr_s}`")))?,
    };
    let shape_s = field("shape").ok_or_else(|| bad("no shape"))?;
    let inner = shape_s
        .trim_start_matches('(')
        .split(')')
        .next()
        .unwrap_or("");
    let dims: Vec<i64> = inner
        .split(',')
        .map(|s| s.trim())
        .filter(|s| !s.is_empty())
        .map(|s| s.trim_end_matches('L').parse::<i64>())
        .collect::<std::result::Result<_, _>>()
        .map_err(|_| bad("bad shape"))?;
    let (shape, n) = onnx::tensor::checked_shape(&dims, what)?;
    let data = &bytes[start + hlen..];
    if let Some(w) = width {
        // Fixed-width UTF-32: each string is w code points, padded with zeros.
        if w.checked_mul(4).and_then(|b| b.checked_mul(n)) != Some(data.len()) {
            return Err(bad("the data does not match the shape"));
        }
        let mut v = Vec::with_capacity(n);
        for chunk in data.chunks(4 * w.max(1)).take(n) {
            let s: Option<String> = chunk
                .chunks(4)
                .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .take_while(|&c| c != 0)
                .map(char::from_u32)
                .collect();
            v.push(s.ok_or_else(|| bad("a character is not a Unicode scalar value"))?);
        }
        v.resize(n, String::new());
        let a = ndarray::ArrayD::from_shape_vec(ndarray::IxDyn(&shape), v)
            .map_err(|_| bad("bad shape"))?;
        return Ok(Tensor::from_array(a));
    }
    onnx::tensor::from_raw(dt, &shape, n, data, what)
}

/// Reads an input file: `.npy`, or an ONNX `.pb` (TensorProto, or a sequence/optional
/// proto when the input's type says so).
pub fn read_value(path: &Path, ty: &ValueType) -> Result<Value> {
    let bytes = std::fs::read(path).map_err(|e| Error::Io {
        path: path.to_path_buf(),
        source: e,
    })?;
    let what = path.display().to_string();
    if path.extension().is_some_and(|e| e == "npy") {
        Ok(Value::Tensor(from_npy(&bytes, &what)?))
    } else {
        onnx::decode_value(&bytes, ty, &what)
    }
}

/// Writes a value as `.npy` (tensors only).
pub fn write_npy(path: &Path, v: &Value) -> Result<()> {
    let t = v.as_tensor().ok_or_else(|| {
        Error::Usage(format!(
            "{}: sequence and optional outputs cannot be written as .npy",
            path.display()
        ))
    })?;
    std::fs::write(path, to_npy(t)?).map_err(|e| Error::Io {
        path: path.to_path_buf(),
        source: e,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn npy_roundtrip() {
        let t = Tensor::from_vec(&[2, 3], vec![1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0]);
        let b = to_npy(&t).unwrap();
        assert_eq!((b.len() - 6 * 4) % 64, 0);
        assert_eq!(from_npy(&b, "t").unwrap(), t);
        let s = Tensor::from_vec(&[], vec![7i64]);
        assert_eq!(from_npy(&to_npy(&s).unwrap(), "s").unwrap(), s);
    }

    #[test]
    fn npy_strings_roundtrip_as_fixed_width_unicode() {
        let t = Tensor::from_vec(&[3], vec!["a".to_string(), "日本".into(), String::new()]);
        let b = to_npy(&t).unwrap();
        assert!(String::from_utf8_lossy(&b).contains("'descr': '<U2'"));
        assert_eq!(from_npy(&b, "t").unwrap(), t);
    }

    #[test]
    fn npy_rejects_garbage() {
        assert!(from_npy(b"hello world, not numpy", "x").is_err());
        assert!(from_npy(b"\x93NUMPY\x01\x00\xff\xff", "x").is_err());
    }
}
