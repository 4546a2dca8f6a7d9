//! ONNX Runtime's quantized operators (domain `com.microsoft`), which its quantizer writes
//! in the operator format (`QuantFormat.QOperator`) and the ONNX model zoo's int8 models
//! use, imported as function bodies of standard ops: each is what ONNX Runtime's operator
//! documentation defines it as, dequantize -> the float op -> quantize (QGemm: the integer
//! product, its int32 bias, then the scales). The importer inlines a body where the node
//! stood, as it inlines a model-local function, so the reference evaluator, the passes
//! (which turn DequantizeLinear -> op -> QuantizeLinear chains into 8-bit kernels where
//! they can) and the back ends see only standard ops.
//!
//! ONNX Runtime's own kernels compute some of these differently (QLinearAdd scales by
//! the ratios A_scale / C_scale and B_scale / C_scale, QLinearSigmoid looks up a table):
//! where the exact quotient lies near a rounding boundary, its result and this one's may
//! differ by one step of the output's quantization.

use super::proto::{attribute_proto::AttributeType, tensor_proto::DataType};
use super::proto::{AttributeProto, NodeProto, TensorProto};

/// The domain of ONNX Runtime's contributed operators.
pub const DOMAIN: &str = "com.microsoft";

/// The default-domain opset the bodies are written against (ReduceMean takes its axes
/// as an input from opset 18, which channels-last QLinearGlobalAveragePool uses; the
/// other ops mean the same at every opset from 13).
pub const OPSET: i64 = 18;

/// The operators whose bodies [`body`] writes.
pub const OPS: [&str; 12] = [
    "QLinearAdd",
    "QLinearMul",
    "QLinearLeakyRelu",
    "QLinearSigmoid",
    "QLinearGlobalAveragePool",
    "QLinearAveragePool",
    "QLinearConcat",
    "QLinearSoftmax",
    "QLinearWhere",
    "QGemm",
    "QuantizeLinear",
    "DequantizeLinear",
];

/// Builds a body's nodes: inputs by the node's own names, intermediate values under a
/// prefix unique to the node.
struct Body<'a> {
    n: &'a NodeProto,
    prefix: String,
    nodes: Vec<NodeProto>,
}

impl Body<'_> {
    /// The name of input `i`, or "" when it is absent (an optional input left out).
    fn input(&self, i: usize) -> String {
        self.n.input.get(i).cloned().unwrap_or_default()
    }

    /// The name of input `i`, which the op requires.
    fn required(&self, i: usize, what: &str) -> Result<String, String> {
        match self.input(i) {
            s if s.is_empty() => Err(format!("input {i} ({what}) is required")),
            s => Ok(s),
        }
    }

    fn output(&self) -> Result<String, String> {
        match self.n.output.first() {
            Some(o) if !o.is_empty() => Ok(o.clone()),
            _ => Err("the node has no output".into()),
        }
    }

    fn attr(&self, name: &str) -> Option<&AttributeProto> {
        self.n.attribute.iter().find(|a| a.name() == name)
    }

    fn int(&self, name: &str, default: i64) -> i64 {
        self.attr(name).and_then(|a| a.i).unwrap_or(default)
    }

    fn float(&self, name: &str, default: f32) -> f32 {
        self.attr(name).and_then(|a| a.f).unwrap_or(default)
    }

    /// Adds `op` writing `out` (a fresh name when None); returns the output's name.
    fn op_to(
        &mut self,
        op: &str,
        inputs: &[&str],
        attrs: Vec<AttributeProto>,
        out: Option<String>,
    ) -> String {
        let k = self.nodes.len();
        let out = out.unwrap_or_else(|| format!("{}{op}_{k}", self.prefix));
        self.nodes.push(NodeProto {
            op_type: Some(op.into()),
            name: Some(format!("{}{op}_{k}", self.prefix)),
            input: inputs.iter().map(|s| s.to_string()).collect(),
            output: vec![out.clone()],
            attribute: attrs,
            ..Default::default()
        });
        out
    }

    fn op(&mut self, op: &str, inputs: &[&str], attrs: Vec<AttributeProto>) -> String {
        self.op_to(op, inputs, attrs, None)
    }

    fn constant(&mut self, t: TensorProto) -> String {
        self.op(
            "Constant",
            &[],
            vec![AttributeProto {
                name: Some("value".into()),
                r#type: Some(AttributeType::Tensor as i32),
                t: Some(t),
                ..Default::default()
            }],
        )
    }

    fn f32_scalar(&mut self, v: f32) -> String {
        self.constant(TensorProto {
            data_type: Some(DataType::Float as i32),
            float_data: vec![v],
            ..Default::default()
        })
    }

    fn i64_scalar(&mut self, v: i64) -> String {
        self.constant(TensorProto {
            data_type: Some(DataType::Int64 as i32),
            int64_data: vec![v],
            ..Default::default()
        })
    }

    fn dequantize(&mut self, x: usize, scale: usize, zero: usize) -> Result<String, String> {
        let (x, s, z) = (
            self.required(x, "quantized data")?,
            self.required(scale, "scale")?,
            self.input(zero),
        );
        Ok(self.op("DequantizeLinear", &[&x, &s, &z], vec![]))
    }

    /// Quantizes `y` to the node's output; without a zero point the output has the type
    /// of input `like` (the ops' type constraint ties them), not QuantizeLinear's uint8.
    fn quantize(&mut self, y: &str, scale: usize, zero: usize, like: usize) -> Result<(), String> {
        let s = self.required(scale, "output scale")?;
        let z = match self.input(zero) {
            z if !z.is_empty() => z,
            _ => {
                let zero = self.f32_scalar(0.0);
                let like = self.required(like, "quantized data")?;
                self.op("CastLike", &[&zero, &like], vec![])
            }
        };
        let out = self.output()?;
        self.op_to("QuantizeLinear", &[y, &s, &z], vec![], Some(out));
        Ok(())
    }

    /// The node's attributes but those named in `drop`.
    fn attrs_but(&self, drop: &[&str]) -> Vec<AttributeProto> {
        self.n
            .attribute
            .iter()
            .filter(|a| !drop.contains(&a.name()))
            .cloned()
            .collect()
    }
}

fn int_attr(name: &str, v: i64) -> AttributeProto {
    AttributeProto {
        name: Some(name.into()),
        r#type: Some(AttributeType::Int as i32),
        i: Some(v),
        ..Default::default()
    }
}

fn ints_attr(name: &str, v: &[i64]) -> AttributeProto {
    AttributeProto {
        name: Some(name.into()),
        r#type: Some(AttributeType::Ints as i32),
        ints: v.to_vec(),
        ..Default::default()
    }
}

/// The body of `n` (a `com.microsoft` node of one of the [`OPS`]) as standard nodes of
/// opset [`body_opset`], with intermediate values named under `prefix`; an error when
/// the node is malformed (missing inputs, a bad attribute).
pub fn body(n: &NodeProto, prefix: &str) -> Result<Vec<NodeProto>, String> {
    let mut b = Body {
        n,
        prefix: prefix.to_string(),
        nodes: Vec::new(),
    };
    write(&mut b).map(|()| b.nodes)
}

fn write(b: &mut Body) -> Result<(), String> {
    let op = b.n.op_type().to_string();
    match op.as_str() {
        // [A, A_scale, A_zp?, B, B_scale, B_zp?, C_scale, C_zp?]
        "QLinearAdd" | "QLinearMul" => {
            let a = b.dequantize(0, 1, 2)?;
            let c = b.dequantize(3, 4, 5)?;
            let y = b.op(&op["QLinear".len()..], &[&a, &c], vec![]);
            b.quantize(&y, 6, 7, 0)
        }
        // [X, X_scale, X_zp?, Y_scale, Y_zp?]
        "QLinearLeakyRelu" | "QLinearSigmoid" => {
            let x = b.dequantize(0, 1, 2)?;
            let attrs = if op == "QLinearLeakyRelu" {
                vec![AttributeProto {
                    name: Some("alpha".into()),
                    r#type: Some(AttributeType::Float as i32),
                    f: Some(b.float("alpha", 0.01)),
                    ..Default::default()
                }]
            } else {
                vec![]
            };
            let y = b.op(&op["QLinear".len()..], &[&x], attrs);
            b.quantize(&y, 3, 4, 0)
        }
        "QLinearGlobalAveragePool" => {
            let x = b.dequantize(0, 1, 2)?;
            let y = match b.int("channels_last", 0) {
                0 => b.op("GlobalAveragePool", &[&x], vec![]),
                _ => {
                    // N x D1 x ... x Dn x C: the mean over axes 1 ..= rank - 2.
                    let shape = b.op("Shape", &[&x], vec![]);
                    let rank = b.op("Size", &[&shape], vec![]);
                    let one = b.i64_scalar(1);
                    let last = b.op("Sub", &[&rank, &one], vec![]);
                    let axes = b.op("Range", &[&one, &last, &one], vec![]);
                    // (Without spatial axes the range is empty: no reduction, not a
                    // reduction over every axis.)
                    b.op(
                        "ReduceMean",
                        &[&x, &axes],
                        vec![int_attr("keepdims", 1), int_attr("noop_with_empty_axes", 1)],
                    )
                }
            };
            b.quantize(&y, 3, 4, 0)
        }
        "QLinearAveragePool" => {
            let x = b.dequantize(0, 1, 2)?;
            let attrs = b.attrs_but(&["channels_last"]);
            let y = match b.int("channels_last", 0) {
                0 => b.op("AveragePool", &[&x], attrs),
                _ => {
                    let spatial =
                        b.attr("kernel_shape")
                            .map(|a| a.ints.len())
                            .filter(|&k| k > 0)
                            .ok_or("kernel_shape is required")? as i64;
                    let rank = spatial + 2;
                    let mut to_first = vec![0, rank - 1];
                    to_first.extend(1..rank - 1);
                    let mut to_last = vec![0];
                    to_last.extend(2..rank);
                    to_last.push(1);
                    let t = b.op("Transpose", &[&x], vec![ints_attr("perm", &to_first)]);
                    let p = b.op("AveragePool", &[&t], attrs);
                    b.op("Transpose", &[&p], vec![ints_attr("perm", &to_last)])
                }
            };
            b.quantize(&y, 3, 4, 0)
        }
        // [Y_scale, Y_zp, (X, X_scale, X_zp)...]
        "QLinearConcat" => {
            let n = b.n.input.len();
            if n < 5 || !(n - 2).is_multiple_of(3) {
                return Err(format!(
                    "takes Y_scale, Y_zero_point and then (tensor, scale, zero point) triples, has {n} inputs"
                ));
            }
            let parts = (2..n)
                .step_by(3)
                .map(|i| b.dequantize(i, i + 1, i + 2))
                .collect::<Result<Vec<_>, _>>()?;
            let refs: Vec<&str> = parts.iter().map(|s| s.as_str()).collect();
            let axis = b
                .attr("axis")
                .and_then(|a| a.i)
                .ok_or("attribute `axis` is required")?;
            let y = b.op("Concat", &refs, vec![int_attr("axis", axis)]);
            b.quantize(&y, 0, 1, 2)
        }
        "QLinearSoftmax" => {
            let x = b.dequantize(0, 1, 2)?;
            let opset = b
                .attr("opset")
                .and_then(|a| a.i)
                .ok_or("attribute `opset` is required")?;
            let y = if opset >= 13 {
                b.op("Softmax", &[&x], vec![int_attr("axis", b.int("axis", -1))])
            } else {
                // Softmax before opset 13: over the input coerced to 2-D at `axis`.
                let flat = b.op("Flatten", &[&x], vec![int_attr("axis", b.int("axis", 1))]);
                let s = b.op("Softmax", &[&flat], vec![int_attr("axis", 1)]);
                let shape = b.op("Shape", &[&x], vec![]);
                b.op("Reshape", &[&s, &shape], vec![])
            };
            b.quantize(&y, 3, 4, 0)
        }
        // [condition, X, x_scale, x_zp, Y, y_scale, y_zp, z_scale, z_zp]
        "QLinearWhere" => {
            let c = b.required(0, "condition")?;
            let x = b.dequantize(1, 2, 3)?;
            let y = b.dequantize(4, 5, 6)?;
            let z = b.op("Where", &[&c, &x, &y], vec![]);
            b.quantize(&z, 7, 8, 1)
        }
        // [A, a_scale, a_zp, B, b_scale, b_zp?, C?, y_scale?, y_zp?]
        "QGemm" => {
            let mut a = b.required(0, "A")?;
            let a_scale = b.required(1, "a_scale")?;
            let a_zero = b.required(2, "a_zero_point")?;
            let mut bm = b.required(3, "B")?;
            let b_scale = b.required(4, "b_scale")?;
            let b_zero = b.input(5);
            let c = b.input(6);
            if b.int("transA", 0) != 0 {
                a = b.op("Transpose", &[&a], vec![ints_attr("perm", &[1, 0])]);
            }
            if b.int("transB", 0) != 0 {
                bm = b.op("Transpose", &[&bm], vec![ints_attr("perm", &[1, 0])]);
            }
            let mut acc = b.op("MatMulInteger", &[&a, &bm, &a_zero, &b_zero], vec![]);
            if !c.is_empty() {
                // C is int32 with scale alpha * a_scale * b_scale: it joins the sum.
                acc = b.op("Add", &[&acc, &c], vec![]);
            }
            let f = b.op(
                "Cast",
                &[&acc],
                vec![int_attr("to", DataType::Float as i64)],
            );
            let mut scale = b.op("Mul", &[&a_scale, &b_scale], vec![]);
            let alpha = b.float("alpha", 1.0);
            if alpha != 1.0 {
                let al = b.f32_scalar(alpha);
                scale = b.op("Mul", &[&scale, &al], vec![]);
            }
            let y_scale = b.input(7);
            if y_scale.is_empty() {
                let out = b.output()?;
                b.op_to("Mul", &[&f, &scale], vec![], Some(out));
                Ok(())
            } else {
                let y = b.op("Mul", &[&f, &scale], vec![]);
                let (z, out) = (b.input(8), b.output()?);
                b.op_to("QuantizeLinear", &[&y, &y_scale, &z], vec![], Some(out));
                Ok(())
            }
        }
        // ONNX Runtime's versions of the standard ops (int16/uint16 and 4-bit types
        // before the standard had them): the standard op of opset 21 where they agree.
        _ => {
            let ins: Vec<String> = (0..b.n.input.len()).map(|i| b.input(i)).collect();
            let refs: Vec<&str> = ins.iter().map(|s| s.as_str()).collect();
            let out = b.output()?;
            let attrs = b.attrs_but(&[]);
            b.op_to(&op, &refs, attrs, Some(out));
            Ok(())
        }
    }
}

/// Whether `op` of [`DOMAIN`] is written at the default domain's opset 21 (the
/// pass-through of QuantizeLinear / DequantizeLinear) rather than at [`OPSET`].
pub fn body_opset(op: &str) -> i64 {
    match op {
        "QuantizeLinear" | "DequantizeLinear" => 21,
        _ => OPSET,
    }
}
