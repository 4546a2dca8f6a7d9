//! TensorProto <-> Tensor, including packed sub-byte types and external data.

use super::external::ExternalData;
use super::proto::{self, TensorProto};
use crate::error::{Error, Result};
use crate::ir::{DType, Data, Tensor};
use half::{bf16, f16};
use ndarray::{ArrayD, IxDyn};

/// The most elements a single tensor may declare (2^40); more is treated as hostile.
pub const MAX_ELEMS: u128 = 1 << 40;

/// Validates dims and returns (shape, element count).
pub fn checked_shape(dims: &[i64], what: &str) -> Result<(Vec<usize>, usize)> {
    let mut n: u128 = 1;
    let mut shape = Vec::with_capacity(dims.len());
    for &d in dims {
        if d < 0 {
            return Err(Error::model(format!("{what}: dimension {d} is negative")));
        }
        n = n.saturating_mul(d as u128);
        shape.push(d as usize);
    }
    if n > MAX_ELEMS {
        return Err(Error::model(format!(
            "{what}: shape {dims:?} has {n} elements, more than onnxc accepts (2^40)"
        )));
    }
    Ok((shape, n as usize))
}

/// Decodes a TensorProto. `ext` resolves external data; `what` names the tensor in errors.
pub fn from_proto(t: &TensorProto, ext: Option<&ExternalData>, what: &str) -> Result<Tensor> {
    let code = t.data_type.unwrap_or(0);
    let dt = DType::from_onnx(code)
        .ok_or_else(|| Error::model(format!("{what}: unknown data type code {code}")))?;
    if dt.storage().is_none() {
        return Err(Error::model(format!(
            "{what}: {dt} tensors are not supported"
        )));
    }
    let (shape, n) = checked_shape(&t.dims, what)?;
    if t.data_location == Some(proto::tensor_proto::DataLocation::External as i32) {
        let ext = ext.ok_or_else(|| {
            Error::model(format!(
                "{what}: uses external data, but the model was not loaded from a file, so there is no folder to find it in"
            ))
        })?;
        let bytes = ext.read(t, dt, n, what)?;
        return from_raw(dt, &shape, n, &bytes, what);
    }
    if let Some(raw) = &t.raw_data {
        if dt != DType::Str {
            return from_raw(dt, &shape, n, raw, what);
        }
    }
    let bad_len = |have: usize| {
        Error::model(format!(
            "{what}: shape {shape:?} needs {n} elements but the tensor holds {have}"
        ))
    };
    let data = match dt {
        DType::F32 => {
            check(t.float_data.len(), n).map_err(bad_len)?;
            Data::F32(mk(&shape, t.float_data.clone()))
        }
        DType::F64 => {
            check(t.double_data.len(), n).map_err(bad_len)?;
            Data::F64(mk(&shape, t.double_data.clone()))
        }
        DType::I64 => {
            check(t.int64_data.len(), n).map_err(bad_len)?;
            Data::I64(mk(&shape, t.int64_data.clone()))
        }
        DType::U32 | DType::U64 => {
            check(t.uint64_data.len(), n).map_err(bad_len)?;
            if dt == DType::U32 {
                Data::U32(mk(
                    &shape,
                    t.uint64_data.iter().map(|&x| x as u32).collect(),
                ))
            } else {
                Data::U64(mk(&shape, t.uint64_data.clone()))
            }
        }
        DType::Str => {
            check(t.string_data.len(), n).map_err(bad_len)?;
            Data::Str(mk(
                &shape,
                t.string_data
                    .iter()
                    .map(|s| String::from_utf8_lossy(s).into_owned())
                    .collect(),
            ))
        }
        DType::U4 | DType::I4 | DType::F4E2M1 | DType::U2 | DType::I2 => {
            // Packed like raw_data, one packed byte per int32.
            let bytes: Vec<u8> = t.int32_data.iter().map(|&x| x as u8).collect();
            return from_raw(dt, &shape, n, &bytes, what);
        }
        _ => {
            let v = &t.int32_data;
            check(v.len(), n).map_err(bad_len)?;
            match dt {
                DType::I32 => Data::I32(mk(&shape, v.clone())),
                DType::I16 => Data::I16(mk(&shape, v.iter().map(|&x| x as i16).collect())),
                DType::I8 => Data::I8(mk(&shape, v.iter().map(|&x| x as i8).collect())),
                DType::U16 => Data::U16(mk(&shape, v.iter().map(|&x| x as u16).collect())),
                DType::U8 => Data::U8(mk(&shape, v.iter().map(|&x| x as u8).collect())),
                DType::Bool => Data::Bool(mk(&shape, v.iter().map(|&x| x != 0).collect())),
                DType::F16 => Data::F16(mk(
                    &shape,
                    v.iter().map(|&x| f16::from_bits(x as u16)).collect(),
                )),
                DType::BF16 => Data::BF16(mk(
                    &shape,
                    v.iter().map(|&x| bf16::from_bits(x as u16)).collect(),
                )),
                _ => Data::U8(mk(&shape, v.iter().map(|&x| x as u8).collect())),
            }
        }
    };
    Ok(Tensor::from_data(dt, data))
}

fn mk<T>(shape: &[usize], v: Vec<T>) -> ArrayD<T> {
    ArrayD::from_shape_vec(IxDyn(shape), v).expect("count checked")
}

fn check(have: usize, want: usize) -> std::result::Result<(), usize> {
    if have == want {
        Ok(())
    } else {
        Err(have)
    }
}

/// Decodes little-endian raw bytes.
pub fn from_raw(dt: DType, shape: &[usize], n: usize, raw: &[u8], what: &str) -> Result<Tensor> {
    let bits = dt.bits();
    let need = (n * bits).div_ceil(8);
    if raw.len() != need {
        return Err(Error::model(format!(
            "{what}: shape {shape:?} of {dt} needs {need} bytes of raw data but has {}",
            raw.len()
        )));
    }
    macro_rules! le {
        ($t:ty, $w:expr) => {
            raw.chunks_exact($w)
                .map(|c| <$t>::from_le_bytes(c.try_into().expect("width")))
                .collect::<Vec<$t>>()
        };
    }
    let data = match dt {
        DType::F32 => Data::F32(mk(shape, le!(f32, 4))),
        DType::F64 => Data::F64(mk(shape, le!(f64, 8))),
        DType::F16 => Data::F16(mk(
            shape,
            le!(u16, 2).into_iter().map(f16::from_bits).collect(),
        )),
        DType::BF16 => Data::BF16(mk(
            shape,
            le!(u16, 2).into_iter().map(bf16::from_bits).collect(),
        )),
        DType::I8 => Data::I8(mk(shape, raw.iter().map(|&x| x as i8).collect())),
        DType::I16 => Data::I16(mk(shape, le!(i16, 2))),
        DType::I32 => Data::I32(mk(shape, le!(i32, 4))),
        DType::I64 => Data::I64(mk(shape, le!(i64, 8))),
        DType::U16 => Data::U16(mk(shape, le!(u16, 2))),
        DType::U32 => Data::U32(mk(shape, le!(u32, 4))),
        DType::U64 => Data::U64(mk(shape, le!(u64, 8))),
        DType::Bool => Data::Bool(mk(shape, raw.iter().map(|&x| x != 0).collect())),
        DType::U8
        | DType::F8E4M3FN
        | DType::F8E4M3FNUZ
        | DType::F8E5M2
        | DType::F8E5M2FNUZ
        | DType::F8E8M0 => Data::U8(mk(shape, raw.to_vec())),
        DType::U4 | DType::F4E2M1 | DType::U2 => Data::U8(mk(shape, unpack(raw, n, bits))),
        DType::I4 | DType::I2 => {
            let sh = 8 - bits as u32;
            Data::I8(mk(
                shape,
                unpack(raw, n, bits)
                    .into_iter()
                    .map(|x| ((x << sh) as i8) >> sh)
                    .collect(),
            ))
        }
        DType::Str | DType::C64 | DType::C128 => {
            return Err(Error::model(format!(
                "{what}: {dt} cannot be stored as raw data"
            )))
        }
    };
    Ok(Tensor::from_data(dt, data))
}

fn unpack(raw: &[u8], n: usize, bits: usize) -> Vec<u8> {
    let per = 8 / bits;
    let mask = ((1u16 << bits) - 1) as u8;
    (0..n)
        .map(|i| (raw[i / per] >> ((i % per) * bits)) & mask)
        .collect()
}

/// Encodes a tensor as a TensorProto (raw little-endian data; strings in string_data).
pub fn to_proto(t: &Tensor, name: &str) -> TensorProto {
    let dt = t.dtype();
    let mut p = TensorProto {
        dims: t.shape().iter().map(|&d| d as i64).collect(),
        data_type: Some(dt.onnx_code()),
        name: Some(name.to_string()),
        ..Default::default()
    };
    let t = t.standard();
    let mut raw = Vec::new();
    match t.data() {
        Data::F32(a) => a
            .iter()
            .for_each(|x| raw.extend_from_slice(&x.to_le_bytes())),
        Data::F64(a) => a
            .iter()
            .for_each(|x| raw.extend_from_slice(&x.to_le_bytes())),
        Data::F16(a) => a
            .iter()
            .for_each(|x| raw.extend_from_slice(&x.to_bits().to_le_bytes())),
        Data::BF16(a) => a
            .iter()
            .for_each(|x| raw.extend_from_slice(&x.to_bits().to_le_bytes())),
        Data::I16(a) => a
            .iter()
            .for_each(|x| raw.extend_from_slice(&x.to_le_bytes())),
        Data::I32(a) => a
            .iter()
            .for_each(|x| raw.extend_from_slice(&x.to_le_bytes())),
        Data::I64(a) => a
            .iter()
            .for_each(|x| raw.extend_from_slice(&x.to_le_bytes())),
        Data::U16(a) => a
            .iter()
            .for_each(|x| raw.extend_from_slice(&x.to_le_bytes())),
        Data::U32(a) => a
            .iter()
            .for_each(|x| raw.extend_from_slice(&x.to_le_bytes())),
        Data::U64(a) => a
            .iter()
            .for_each(|x| raw.extend_from_slice(&x.to_le_bytes())),
        Data::Bool(a) => raw.extend(a.iter().map(|&x| x as u8)),
        Data::I8(a) if dt.bits() == 8 => raw.extend(a.iter().map(|&x| x as u8)),
        Data::U8(a) if dt.bits() == 8 => raw.extend(a.iter().copied()),
        Data::I8(a) => raw = pack(a.iter().map(|&x| x as u8), dt.bits()),
        Data::U8(a) => raw = pack(a.iter().copied(), dt.bits()),
        Data::Str(a) => {
            p.string_data = a.iter().map(|s| s.as_bytes().to_vec()).collect();
            return p;
        }
    }
    p.raw_data = Some(raw);
    p
}

fn pack(it: impl Iterator<Item = u8>, bits: usize) -> Vec<u8> {
    let per = 8 / bits;
    let mask = ((1u16 << bits) - 1) as u8;
    let mut out = Vec::new();
    for (i, x) in it.enumerate() {
        if i % per == 0 {
            out.push(0);
        }
        *out.last_mut().expect("pushed") |= (x & mask) << ((i % per) * bits);
    }
    out
}
