//! `onnxc check`: runs a model through the reference evaluator and compiled, on the same
//! inputs (random ones by default), and reports the largest relative error per output.
//! Also the random inputs and the error measure the benchmark's correctness check uses.

use crate::error::{Error, Result};
use crate::ir::{DType, Graph, Tensor, Value};
use ndarray::{ArrayD, IxDyn};

/// A small deterministic generator (SplitMix64): the same seed gives the same inputs on
/// every machine.
pub struct SplitMix(u64);

impl SplitMix {
    pub fn new(seed: u64) -> SplitMix {
        SplitMix(seed)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Random values for every graph input (static shapes needed): floats uniform in
/// [-1, 1), integers in [0, 4) (valid token ids, indices and masks for the models we
/// meet), booleans half true, strings such an integer spelled as a float (`"2.0"`).
pub fn random_inputs(g: &Graph, seed: u64) -> Result<Vec<Value>> {
    let mut rng = SplitMix::new(seed);
    let mut vals = Vec::new();
    for &id in &g.inputs {
        let info = g.value(id);
        let (Some(dt), Some(shape)) = (info.ty.dtype(), info.ty.static_shape()) else {
            return Err(Error::Shape(format!(
                "input `{}` ({}) needs a static tensor shape for random inputs; bind it with --shape",
                info.name, info.ty
            )));
        };
        let n: usize = shape.iter().product();
        let data: Vec<f64> = (0..n)
            .map(|_| {
                if dt.is_float() {
                    rng.unit() * 2.0 - 1.0
                } else if dt == DType::Bool {
                    (rng.unit() < 0.5) as u8 as f64
                } else {
                    (rng.next_u64() % 4) as f64
                }
            })
            .collect();
        let arr = ArrayD::from_shape_vec(IxDyn(&shape), data)
            .map_err(|e| Error::Shape(format!("input `{}`: {e}", info.name)))?;
        vals.push(Value::Tensor(Tensor::from_f64(dt, arr, true)));
    }
    Ok(vals)
}

/// Largest absolute difference over the largest magnitude of the expected tensor (the
/// measure every whole-model test uses). Shapes must agree; NaNs must match; strings
/// must be equal (0).
pub fn rel_err(got: &Tensor, want: &Tensor) -> std::result::Result<f64, String> {
    if got.shape() != want.shape() {
        return Err(format!(
            "shape {:?}, expected {:?}",
            got.shape(),
            want.shape()
        ));
    }
    if got.dtype() == DType::Str || want.dtype() == DType::Str {
        // Strings: equal or not (0 or an error naming the first difference).
        let (Some(a), Some(b)) = (got.array::<String>(), want.array::<String>()) else {
            return Err(format!("{} compared with {}", got.dtype(), want.dtype()));
        };
        return match a.iter().zip(b.iter()).position(|(x, y)| x != y) {
            None => Ok(0.0),
            Some(i) => Err(format!(
                "strings differ at flat index {i}: {:?}, expected {:?}",
                a.iter().nth(i).expect("index"),
                b.iter().nth(i).expect("index")
            )),
        };
    }
    let (Some(a), Some(b)) = (got.to_f64_vec(), want.to_f64_vec()) else {
        return Err(format!(
            "{} values cannot be compared numerically",
            got.dtype()
        ));
    };
    let mut diff: f64 = 0.0;
    for (x, y) in a.iter().zip(&b) {
        if x.is_nan() != y.is_nan() {
            return Err("NaN where the reference has none (or the other way)".into());
        }
        if x != y {
            diff = diff.max((x - y).abs());
        }
    }
    let scale = b
        .iter()
        .filter(|y| y.is_finite())
        .fold(0.0f64, |m, y| m.max(y.abs()));
    Ok(if diff == 0.0 {
        0.0
    } else {
        diff / scale.max(1e-30)
    })
}
