//! `onnxc check`: runs a model through the reference evaluator and compiled, on the same
//! inputs (random ones by default), and reports the largest relative error per output.
//! Also the random inputs and the error measure the benchmark's correctness check uses.

use crate::error::{Error, Result};
use crate::ir::{DType, Graph, Tensor, Value, ValueId};
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

/// The relative error two engines' outputs of type `dt` may show: 1e-4, or for types
/// with fewer than 14 significand bits one unit in their last place at the largest
/// magnitude (the engines may round a sum to neighbouring values): 1e-3 for f16, 8e-3
/// for bf16, more for the 8-bit floats.
pub fn tolerance(dt: Option<DType>) -> f64 {
    let bits = match dt {
        Some(DType::F16) => 11,
        Some(DType::BF16) => 8,
        Some(DType::F8E4M3FN | DType::F8E4M3FNUZ) => 4,
        Some(DType::F8E5M2 | DType::F8E5M2FNUZ) => 3,
        _ => return 1e-4,
    };
    // The unit in the last place relative to a magnitude just above a power of two,
    // rounded up to one significant digit.
    let ulp = 2f64.powi(1 - bits);
    let digit = 10f64.powf(ulp.log10().floor());
    (ulp / digit).ceil() * digit
}

/// For an 8- or 16-bit integer output `want` (a quantized tensor), the relative error of
/// one unit (at least 1e-4): engines may requantize a product to neighbouring values
/// (ONNX Runtime's QLinearMatMul rounds in f32, the reference in f64). `None` for other
/// dtypes.
pub fn quantized_tolerance(want: &Tensor) -> Option<f64> {
    if !matches!(
        want.dtype(),
        DType::U8 | DType::I8 | DType::U16 | DType::I16
    ) {
        return None;
    }
    let top = largest_magnitude(&want.to_f64_vec()?);
    Some(if top > 0.0 {
        (1.0 / top).max(1e-4)
    } else {
        1e-4
    })
}

/// Why a model's outputs may be further than a quantization step from ONNX Runtime's
/// although they are the reference evaluator's: QLinearConv and QLinearMatMul
/// requantize in f64 in ONNX's reference implementation (and in onnxc), in f32 in ONNX
/// Runtime, so a sum whose scaled value lies at a rounding boundary becomes neighbouring
/// steps in the two, and the layers after carry the difference. `None` for a graph
/// without them.
pub fn requantization_note(g: &Graph) -> Option<&'static str> {
    let requantizes = g.nodes.node_weights().any(|n| {
        n.domain.is_empty() && matches!(n.op_type.as_str(), "QLinearConv" | "QLinearMatMul")
    });
    requantizes.then_some(
        "the model requantizes in QLinearConv or QLinearMatMul, which onnxc computes in \
         f64 as ONNX's reference implementation does and ONNX Runtime in f32: a value at a \
         rounding boundary becomes neighbouring steps in the two, and later layers carry \
         the difference (`onnxc check` compares with the reference evaluator)",
    )
}

/// Why outputs may be further from another engine's than the float tolerance although
/// every kernel is right: a DynamicQuantizeLinear rounds its input to 255 levels at run
/// time, so a difference of an ulp before it can move a value a whole level, and the
/// moves compound (docs/decisions.md). `None` for a graph without one.
pub fn run_time_quantization_note(g: &Graph) -> Option<&'static str> {
    let dynamic = g
        .nodes
        .node_weights()
        .any(|n| n.op_type == "DynamicQuantizeLinear" && n.domain.is_empty());
    dynamic.then_some(
        "the model quantizes activations at run time (DynamicQuantizeLinear): a float \
         difference of one ulp before one can move a value a whole quantization level, so \
         such models differ by about 5e-3 between engines (ONNX Runtime from its own \
         unoptimized run as well)",
    )
}

/// For a float output `v` of `g` that a DequantizeLinear with one constant scale makes
/// (a QDQ model's last step), the relative error of one quantization step (a little
/// over `|scale|` over the largest magnitude of `want`): a product or sum rounded in another order
/// upstream moves a value across a rounding boundary of the QuantizeLinear before it.
/// `None` otherwise.
pub fn dequantized_tolerance(g: &Graph, v: ValueId, want: &Tensor) -> Option<f64> {
    let crate::ir::Source::Node(n) = g.value(v).source else {
        return None;
    };
    let node = &g.nodes[n];
    if node.op_type != "DequantizeLinear" || !node.domain.is_empty() {
        return None;
    }
    let scale = g.const_of(node.inputs.get(1).copied().flatten()?)?;
    let s = match scale.to_f64()?.iter().copied().collect::<Vec<f64>>()[..] {
        [s] if s.is_finite() => s.abs(),
        _ => return None,
    };
    let top = largest_magnitude(&want.to_f64_vec()?);
    // A little over one step: each engine's f32 `(q - zp) * scale` is rounded.
    (top > 0.0).then(|| (1.001 * s / top).max(1e-4))
}

/// The largest finite `|v|` (0 for none): the scale relative errors are measured
/// against.
fn largest_magnitude(v: &[f64]) -> f64 {
    v.iter()
        .filter(|y| y.is_finite())
        .fold(0.0f64, |m, y| m.max(y.abs()))
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
    let scale = largest_magnitude(&b);
    Ok(if diff == 0.0 {
        0.0
    } else {
        diff / scale.max(1e-30)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tolerance_is_a_unit_in_the_last_place_of_narrow_floats() {
        let close = |a: f64, b: f64| (a - b).abs() < 1e-12;
        assert!(close(tolerance(Some(DType::F32)), 1e-4));
        assert!(close(tolerance(None), 1e-4));
        assert!(close(tolerance(Some(DType::F16)), 1e-3));
        assert!(close(tolerance(Some(DType::BF16)), 8e-3));
        assert!(close(tolerance(Some(DType::F8E4M3FN)), 0.2));
    }

    #[test]
    fn quantized_outputs_may_differ_by_one_unit() {
        let q = Tensor::from_vec(&[3], vec![0u8, 200, 17]);
        let t = quantized_tolerance(&q).unwrap();
        assert!((t - 1.0 / 200.0).abs() < 1e-15);
        let one_off = Tensor::from_vec(&[3], vec![1u8, 200, 17]);
        let two_off = Tensor::from_vec(&[3], vec![2u8, 200, 17]);
        assert!(rel_err(&one_off, &q).unwrap() <= t);
        assert!(rel_err(&two_off, &q).unwrap() > t);
        assert_eq!(
            quantized_tolerance(&Tensor::from_vec(&[1], vec![1.0f32])),
            None
        );
        assert_eq!(
            quantized_tolerance(&Tensor::from_vec(&[1], vec![0i8])),
            Some(1e-4)
        );
    }

    #[test]
    fn dequantized_outputs_may_differ_by_one_step() {
        use crate::passes::testutil::Builder;
        let mut b = Builder::new();
        let q = b.input_typed("q", DType::U8, &[2]);
        let s = b.konst("s", &[], vec![0.5]);
        let z = b.konst_t("z", Tensor::scalar(3u8));
        let y = b.node_typed("DequantizeLinear", &[q, s, z], DType::F32, &[2]);
        let r = b.node("Relu", &[y], &[2]);
        let g = b.finish(&[y, r]);
        let want = Tensor::from_vec(&[2], vec![-1.5f32, 4.0]);
        let t = dequantized_tolerance(&g, y, &want).unwrap();
        assert!(t > 0.5 / 4.0 && t < 1.01 * 0.5 / 4.0, "{t}");
        // Not made by a DequantizeLinear.
        assert_eq!(dequantized_tolerance(&g, r, &want), None);
        let zeros = Tensor::from_vec(&[2], vec![0.0f32, 0.0]);
        assert_eq!(dequantized_tolerance(&g, y, &zeros), None);
        assert_eq!(run_time_quantization_note(&g), None);
    }

    #[test]
    fn run_time_quantization_is_named_as_a_cause() {
        use crate::passes::testutil::Builder;
        let mut b = Builder::new();
        let x = b.input("x", &[4]);
        // (Its first output only: the note looks at the op.)
        let y = b.node_typed("DynamicQuantizeLinear", &[x], DType::U8, &[4]);
        let g = b.finish(&[y]);
        let note = run_time_quantization_note(&g).expect("a note");
        assert!(note.contains("DynamicQuantizeLinear"), "{note}");
        assert_eq!(requantization_note(&g), None);
        let mut b = Builder::new();
        let a = b.konst_t("a", Tensor::from_vec(&[1, 2], vec![1u8, 2]));
        let w = b.konst_t("w", Tensor::from_vec(&[2, 1], vec![3u8, 4]));
        let s = b.konst_t("s", Tensor::scalar(0.5f32));
        let z = b.konst_t("z", Tensor::scalar(1u8));
        let y = b.node_typed(
            "QLinearMatMul",
            &[a, s, z, w, s, z, s, z],
            DType::U8,
            &[1, 1],
        );
        let g = b.finish(&[y]);
        assert!(requantization_note(&g).expect("a note").contains("f64"));
    }
}
