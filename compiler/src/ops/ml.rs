//! ai.onnx.ml ops: encoders, scalers, linear models and tree ensembles.

use super::util::{arr, f64s, input, ints, out, outs};
use super::{OpCtx, Registry, Traits, ONNX_ML};
use crate::ir::{DType, OpError, OpResult, Tensor, Value};
use crate::{bail, ensure};
use ndarray::{ArrayD, IxDyn};
use std::collections::{HashMap, HashSet};

pub fn register(r: &mut Registry) {
    let t = Traits::default;
    r.add_with(ONNX_ML, "LabelEncoder", label_encoder, t());
    r.add_with(ONNX_ML, "TreeEnsemble", tree_ensemble, t());
    r.add_with(ONNX_ML, "TreeEnsembleRegressor", tree_regressor, t());
    r.add_with(ONNX_ML, "TreeEnsembleClassifier", tree_classifier, t());
    r.add_with(ONNX_ML, "Binarizer", binarizer, t());
    r.add_with(
        ONNX_ML,
        "ArrayFeatureExtractor",
        array_feature_extractor,
        t(),
    );
    r.add_with(ONNX_ML, "Scaler", scaler, t());
    r.add_with(ONNX_ML, "Normalizer", normalizer, t());
    r.add_with(ONNX_ML, "Imputer", imputer, t());
    r.add_with(ONNX_ML, "OneHotEncoder", one_hot_encoder, t());
    r.add_with(ONNX_ML, "LinearClassifier", linear_classifier, t());
    r.add_with(ONNX_ML, "LinearRegressor", linear_regressor, t());
    r.add_with(ONNX_ML, "FeatureVectorizer", feature_vectorizer, t());
    r.add_with(ONNX_ML, "CategoryMapper", category_mapper, t());
    r.add_with(ONNX_ML, "SVMRegressor", svm_regressor, t());
    lower::register(r);
}

fn shaped<T>(shape: &[usize], v: Vec<T>) -> OpResult<ArrayD<T>> {
    ArrayD::from_shape_vec(IxDyn(shape), v).map_err(|e| OpError::new(e.to_string()))
}

/// A float list attribute given either as `name` (floats) or `name_as_tensor`.
fn floats_attr(ctx: &OpCtx, name: &str) -> OpResult<Option<Vec<f64>>> {
    if let Some(t) = ctx.attrs.get_tensor(&format!("{name}_as_tensor"))? {
        return Ok(Some(f64s(&t)?.iter().copied().collect()));
    }
    Ok(ctx
        .attrs
        .get_floats(name)?
        .map(|v| v.into_iter().map(|x| x as f64).collect()))
}

fn get<T: Copy>(v: &[T], i: usize, what: &str) -> OpResult<T> {
    v.get(i)
        .copied()
        .ok_or_else(|| OpError::new(format!("index {i} is out of range for `{what}`")))
}

/// The feature matrix of a model input: [N, C] (a 1-D input is one row).
fn matrix(x: &Tensor) -> OpResult<(usize, usize, Vec<f64>)> {
    let a = f64s(x)?;
    let a = a.as_standard_layout();
    let (n, c) = match x.shape() {
        [c] => (1, *c),
        [n, c] => (*n, *c),
        [n, rest @ ..] => (*n, rest.iter().product()),
        [] => (1, 1),
    };
    Ok((n, c, a.iter().copied().collect()))
}

// ---------------------------------------------------------------- LabelEncoder

#[derive(Clone, PartialEq, Eq, Hash)]
enum Key {
    I(i64),
    F(u64),
    S(String),
}

fn fkey(x: f64) -> Key {
    // -0.0 and 0.0 are the same key; NaN matches NaN.
    if x == 0.0 {
        Key::F(0)
    } else if x.is_nan() {
        Key::F(f64::NAN.to_bits())
    } else {
        Key::F(x.to_bits())
    }
}

/// Keys (or values) of a tensor as hashable keys.
fn keys_of(t: &Tensor) -> OpResult<Vec<Key>> {
    Ok(if t.dtype() == DType::Str {
        arr::<String>(t)?.iter().cloned().map(Key::S).collect()
    } else if t.dtype().is_float() {
        f64s(t)?.iter().map(|&x| fkey(x)).collect()
    } else {
        ints(t)?.into_iter().map(Key::I).collect()
    })
}

/// What a LabelEncoder node maps: its keys, its values (1-D, of the output dtype) and
/// the default (a scalar of the same dtype), for an input of dtype `x`. Where keys
/// repeat, the first wins.
fn label_encoder_tables(ctx: &OpCtx, x: DType) -> OpResult<(Vec<Key>, Tensor, Tensor)> {
    let a = &ctx.attrs;
    if ctx.opset < 2 {
        // Opset 1: classes_strings maps strings to their index and back.
        let classes = a.strings("classes_strings", vec![])?;
        let n = classes.len();
        if x == DType::Str {
            // A repeated class maps to its last index: listed from the end.
            let keys = classes.iter().rev().cloned().map(Key::S).collect();
            let values: Vec<i64> = (0..n as i64).rev().collect();
            return Ok((
                keys,
                Tensor::from_vec(&[n], values),
                Tensor::scalar(a.int("default_int64", -1)?),
            ));
        }
        let keys = (0..n as i64).map(Key::I).collect();
        return Ok((
            keys,
            Tensor::from_vec(&[n], classes),
            Tensor::scalar(a.string("default_string", "_Unused".into())?),
        ));
    }
    // Keys.
    let keys: Vec<Key> = if let Some(v) = a.get_ints("keys_int64s")? {
        v.into_iter().map(Key::I).collect()
    } else if let Some(v) = a.get_floats("keys_floats")? {
        v.into_iter().map(|f| fkey(f as f64)).collect()
    } else if let Some(v) = a.get_strings("keys_strings")? {
        v.into_iter().map(Key::S).collect()
    } else if let Some(t) = a.get_tensor("keys_tensor")? {
        keys_of(&t)?
    } else {
        bail!("LabelEncoder: no keys attribute")
    };
    // Values as a tensor of the output dtype, plus the default.
    let (values, default): (Tensor, Tensor) = if let Some(v) = a.get_ints("values_int64s")? {
        let n = v.len();
        (
            Tensor::from_vec(&[n], v),
            Tensor::scalar(a.int("default_int64", -1)?),
        )
    } else if let Some(v) = a.get_floats("values_floats")? {
        let n = v.len();
        (
            Tensor::from_vec(&[n], v),
            Tensor::scalar(a.float("default_float", -0.0)?),
        )
    } else if let Some(v) = a.get_strings("values_strings")? {
        let n = v.len();
        (
            Tensor::from_vec(&[n], v),
            Tensor::scalar(a.string("default_string", "_Unused".into())?),
        )
    } else if let Some(t) = a.get_tensor("values_tensor")? {
        let def = match a.get_tensor("default_tensor")? {
            Some(d) => {
                ensure!(
                    d.dtype() == t.dtype() && d.len() == 1,
                    "LabelEncoder: default_tensor must be one value of the values' dtype"
                );
                d.reshape(&[])
                    .ok_or_else(|| OpError::new("LabelEncoder: default"))?
            }
            None => {
                let dt = t.dtype();
                if dt == DType::Str {
                    Tensor::scalar("_Unused".to_string())
                } else if dt.is_float() {
                    Tensor::from_f64(dt, ArrayD::from_elem(IxDyn(&[]), -0.0), false)
                } else {
                    Tensor::from_i128(dt, ArrayD::from_elem(IxDyn(&[]), -1))
                }
            }
        };
        (
            t.reshape(&[t.len()])
                .ok_or_else(|| OpError::new("LabelEncoder: values"))?,
            def,
        )
    } else {
        bail!("LabelEncoder: no values attribute")
    };
    ensure!(
        keys.len() == values.len(),
        "LabelEncoder: {} keys but {} values",
        keys.len(),
        values.len()
    );
    Ok((keys, values, default))
}

/// `values` picked at `idx` (an index past the end picks `default`), as a 1-D tensor.
fn pick<T: crate::ir::Elem>(
    values: &ArrayD<T>,
    default: &Tensor,
    idx: &[usize],
) -> OpResult<ArrayD<T>> {
    let d = default
        .array::<T>()
        .and_then(|a| a.iter().next().cloned())
        .ok_or_else(|| OpError::new("LabelEncoder: the default is not of the values' dtype"))?;
    let flat: Vec<T> = values.iter().cloned().collect();
    let v = idx
        .iter()
        .map(|&i| flat.get(i).cloned().unwrap_or_else(|| d.clone()))
        .collect();
    shaped(&[idx.len()], v)
}

fn label_encoder(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    let x = input(ins, 0)?;
    let (keys, values, default) = label_encoder_tables(ctx, x.dtype())?;
    let mut map: HashMap<Key, usize> = HashMap::new();
    for (i, k) in keys.into_iter().enumerate() {
        map.entry(k).or_insert(i);
    }
    // Index into [values..., default].
    let xk = keys_of(x)?;
    let nv = values.len();
    let idx: Vec<usize> = xk
        .iter()
        .map(|k| map.get(k).copied().unwrap_or(nv))
        .collect();
    let y = crate::try_map_data!(values, a => pick(a, &default, &idx));
    let y = y
        .reshape(x.shape())
        .ok_or_else(|| OpError::new("LabelEncoder: output shape"))?;
    out(y)
}

// ---------------------------------------------------------------- post transforms

fn erf_inv(x: f64) -> f64 {
    let sgn = if x < 0.0 { -1.0 } else { 1.0 };
    let x = (1.0 - x) * (1.0 + x);
    if x == 0.0 {
        return 0.0;
    }
    let log = x.ln();
    let v = 2.0 / (std::f64::consts::PI * 0.147) + 0.5 * log;
    let v2 = 1.0 / 0.147 * log;
    let v3 = -v + (v * v - v2).sqrt();
    sgn * v3.sqrt()
}

fn logistic(v: f64) -> f64 {
    let e = 1.0 / (1.0 + (-v.abs()).exp());
    if v < 0.0 {
        1.0 - e
    } else {
        e
    }
}

/// Applies a post transform (by name) to one row of scores.
fn post_transform(row: &mut [f64], kind: &str) -> OpResult<()> {
    match kind {
        "NONE" => {}
        "LOGISTIC" => row.iter_mut().for_each(|v| *v = logistic(*v)),
        "SOFTMAX" => {
            let m = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let mut s = 0.0;
            for v in row.iter_mut() {
                *v = (*v - m).exp();
                s += *v;
            }
            row.iter_mut().for_each(|v| *v /= s);
        }
        "SOFTMAX_ZERO" => {
            let m = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let e = (-m).exp();
            let mut s = 0.0;
            for v in row.iter_mut() {
                if *v > 1e-7 || *v < -1e-7 {
                    *v = (*v - m).exp();
                } else {
                    *v *= e;
                }
                s += *v;
            }
            if s == 0.0 {
                row.iter_mut().for_each(|v| *v = 0.5);
            } else {
                row.iter_mut().for_each(|v| *v /= s);
            }
        }
        // The reference (and onnxruntime) use this truncated sqrt(2).
        #[allow(clippy::approx_constant)]
        "PROBIT" => row
            .iter_mut()
            .for_each(|v| *v = 1.41421356 * erf_inv(*v * 2.0 - 1.0)),
        k => bail!("unknown post_transform {k:?}"),
    }
    Ok(())
}

fn post_name(code: i64) -> OpResult<&'static str> {
    Ok(match code {
        0 => "NONE",
        1 => "SOFTMAX",
        2 => "LOGISTIC",
        3 => "SOFTMAX_ZERO",
        4 => "PROBIT",
        c => bail!("unknown post_transform {c}"),
    })
}

// ---------------------------------------------------------------- TreeEnsemble (v5)

enum Cmp {
    Leq,
    Lt,
    Gte,
    Gt,
    Eq,
    Neq,
    Member(HashSet<u64>),
}

fn tree_ensemble(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    let x = input(ins, 0)?;
    ensure!(
        x.dtype().is_float(),
        "TreeEnsemble: X must be a float tensor"
    );
    let a = &ctx.attrs;
    let tensor_vals = |name: &str| -> OpResult<Vec<f64>> {
        match a.get_tensor(name)? {
            Some(t) => Ok(f64s(&t)?.iter().copied().collect()),
            None => bail!("TreeEnsemble: attribute `{name}` is required"),
        }
    };
    let splits = tensor_vals("nodes_splits")?;
    let modes: Vec<i64> = match a.get_tensor("nodes_modes")? {
        Some(t) => ints(&t)?,
        None => bail!("TreeEnsemble: attribute `nodes_modes` is required"),
    };
    let feats = a.req_ints("nodes_featureids")?;
    let tids = a.req_ints("nodes_truenodeids")?;
    let fids = a.req_ints("nodes_falsenodeids")?;
    let tleaf = a.req_ints("nodes_trueleafs")?;
    let fleaf = a.req_ints("nodes_falseleafs")?;
    let leaf_targets = a.req_ints("leaf_targetids")?;
    let leaf_weights = tensor_vals("leaf_weights")?;
    let roots = a.req_ints("tree_roots")?;
    let post = post_name(a.int("post_transform", 0)?)?;
    let agg = a.int("aggregate_function", 1)?;
    let missing = a.ints("nodes_missing_value_tracks_true", &[])?;
    let n_targets = a.req_int("n_targets")?;
    let n_targets = super::util::dims(&[n_targets])?[0];
    let nn = modes.len();
    ensure!(
        [
            splits.len(),
            feats.len(),
            tids.len(),
            fids.len(),
            tleaf.len(),
            fleaf.len()
        ]
        .iter()
        .all(|&l| l == nn),
        "TreeEnsemble: node attributes differ in length"
    );
    ensure!(
        leaf_targets.len() == leaf_weights.len(),
        "TreeEnsemble: leaf attributes differ in length"
    );
    // Membership sets, one per MEMBER node in node order, separated by NaN.
    let members: Vec<f64> = match a.get_tensor("membership_values")? {
        Some(t) => f64s(&t)?.iter().copied().collect(),
        None => vec![],
    };
    let mut sets = members.split(|v| v.is_nan());
    let mut cmps = Vec::with_capacity(nn);
    for &m in &modes {
        cmps.push(match m {
            0 => Cmp::Leq,
            1 => Cmp::Lt,
            2 => Cmp::Gte,
            3 => Cmp::Gt,
            4 => Cmp::Eq,
            5 => Cmp::Neq,
            6 => {
                let s = sets.next().ok_or_else(|| {
                    OpError::new("TreeEnsemble: a set membership node has no set members")
                })?;
                Cmp::Member(s.iter().map(|v| v.to_bits()).collect())
            }
            m => bail!("TreeEnsemble: unknown node mode {m}"),
        });
    }
    let (n, c, xv) = matrix(x)?;
    let n_trees = roots.len();
    // Returns the leaf index reached from `root`.
    let walk = |row: &[f64], root: usize| -> OpResult<usize> {
        let (mut i, mut is_leaf) = (root, false);
        if get(&tleaf, i, "nodes_trueleafs")? != 0
            && get(&fleaf, i, "nodes_falseleafs")? != 0
            && get(&tids, i, "nodes_truenodeids")? == get(&fids, i, "nodes_falsenodeids")?
        {
            is_leaf = true;
        }
        let mut steps = 0usize;
        while !is_leaf {
            steps += 1;
            ensure!(steps <= nn + 1, "TreeEnsemble: the tree has a cycle");
            let f = get(&feats, i, "nodes_featureids")?;
            let v = usize::try_from(f)
                .ok()
                .and_then(|f| row.get(f).copied())
                .ok_or_else(|| OpError::new(format!("TreeEnsemble: feature {f} out of range")))?;
            let th = splits[i];
            let r = match &cmps[i] {
                Cmp::Leq => v <= th,
                Cmp::Lt => v < th,
                Cmp::Gte => v >= th,
                Cmp::Gt => v > th,
                Cmp::Eq => v == th,
                Cmp::Neq => v != th,
                Cmp::Member(s) => s.contains(&(if v == 0.0 { 0.0f64 } else { v }).to_bits()),
            } || (v.is_nan() && missing.get(i).copied().unwrap_or(0) != 0);
            let (next, leaf) = if r {
                (tids[i], tleaf[i])
            } else {
                (fids[i], fleaf[i])
            };
            ensure!(next >= 0, "TreeEnsemble: negative node id");
            i = next as usize;
            is_leaf = leaf != 0;
            if !is_leaf {
                ensure!(i < nn, "TreeEnsemble: node id {i} out of range");
            }
        }
        ensure!(
            i < leaf_weights.len(),
            "TreeEnsemble: leaf id {i} out of range"
        );
        Ok(i)
    };
    // MIN and MAX start from the extremes of X's dtype, like the reference.
    let big = match x.dtype() {
        DType::F64 => f64::MAX,
        DType::F16 => 65504.0,
        DType::BF16 => 3.3895313892515355e38,
        _ => f32::MAX as f64,
    };
    let init = match agg {
        0 | 1 => 0.0,
        2 => big,
        3 => -big,
        a => bail!("TreeEnsemble: unknown aggregate_function {a}"),
    };
    let mut res = vec![init; n * n_targets];
    for r in 0..n {
        let row = &xv[r * c..(r + 1) * c];
        let out_row = &mut res[r * n_targets..(r + 1) * n_targets];
        for &root in &roots {
            ensure!(root >= 0, "TreeEnsemble: negative tree root");
            let l = walk(row, root as usize)?;
            let w = leaf_weights[l];
            let t = leaf_targets[l];
            let slot = usize::try_from(t)
                .ok()
                .and_then(|t| out_row.get_mut(t))
                .ok_or_else(|| OpError::new(format!("TreeEnsemble: target {t} out of range")))?;
            match agg {
                0 => *slot += w / n_trees as f64,
                1 => *slot += w,
                2 => *slot = slot.min(w),
                _ => *slot = slot.max(w),
            }
        }
        post_transform(out_row, post)?;
    }
    out(Tensor::from_f64(
        x.dtype(),
        shaped(&[n, n_targets], res)?,
        false,
    ))
}

// ---------------------------------------------------------------- TreeEnsemble{Regressor,Classifier}

/// The legacy tree layout shared by the regressor and the classifier.
struct Trees {
    /// (tree id, index of its root) in tree-id order.
    roots: Vec<(i64, usize)>,
    index: HashMap<(i64, i64), usize>,
    treeids: Vec<i64>,
    nodeids: Vec<i64>,
    feats: Vec<i64>,
    modes: Vec<String>,
    values: Vec<f64>,
    tids: Vec<i64>,
    fids: Vec<i64>,
    missing: Vec<i64>,
}

impl Trees {
    fn new(ctx: &OpCtx) -> OpResult<Trees> {
        let a = &ctx.attrs;
        let treeids = a.req_ints("nodes_treeids")?;
        let nodeids = a.req_ints("nodes_nodeids")?;
        let feats = a.req_ints("nodes_featureids")?;
        let modes = a.strings("nodes_modes", vec![])?;
        let values = floats_attr(ctx, "nodes_values")?.unwrap_or_default();
        let tids = a.req_ints("nodes_truenodeids")?;
        let fids = a.req_ints("nodes_falsenodeids")?;
        let missing = a.ints("nodes_missing_value_tracks_true", &[])?;
        let nn = treeids.len();
        ensure!(
            [
                nodeids.len(),
                feats.len(),
                modes.len(),
                values.len(),
                tids.len(),
                fids.len()
            ]
            .iter()
            .all(|&l| l == nn),
            "{}: node attributes differ in length",
            ctx.op_type
        );
        let mut roots: Vec<(i64, usize)> = Vec::new();
        let mut index = HashMap::new();
        for (i, (&t, &nid)) in treeids.iter().zip(&nodeids).enumerate() {
            index.insert((t, nid), i);
            if !roots.iter().any(|&(r, _)| r == t) {
                roots.push((t, i));
            }
        }
        roots.sort();
        Ok(Trees {
            roots,
            index,
            treeids,
            nodeids,
            feats,
            modes,
            values,
            tids,
            fids,
            missing,
        })
    }

    /// The (tree id, node id) of the leaf each tree reaches.
    fn leaves(&self, row: &[f64]) -> OpResult<Vec<(i64, i64)>> {
        let mut res = Vec::with_capacity(self.roots.len());
        for &(tree, root) in &self.roots {
            let mut i = root;
            let mut steps = 0;
            while self.modes[i] != "LEAF" {
                steps += 1;
                ensure!(steps <= self.modes.len() + 1, "tree {tree} has a cycle");
                let f = self.feats[i];
                let x = usize::try_from(f)
                    .ok()
                    .and_then(|f| row.get(f).copied())
                    .ok_or_else(|| OpError::new(format!("feature {f} out of range")))?;
                let th = self.values[i];
                let r = if x.is_nan() {
                    self.missing.get(i).copied().unwrap_or(0) >= 1
                } else {
                    match self.modes[i].as_str() {
                        "BRANCH_LEQ" => x <= th,
                        "BRANCH_LT" => x < th,
                        "BRANCH_GTE" => x >= th,
                        "BRANCH_GT" => x > th,
                        "BRANCH_EQ" => x == th,
                        "BRANCH_NEQ" => x != th,
                        m => bail!("unknown node mode {m:?}"),
                    }
                };
                let nid = if r { self.tids[i] } else { self.fids[i] };
                i = *self
                    .index
                    .get(&(tree, nid))
                    .ok_or_else(|| OpError::new(format!("tree {tree} has no node {nid}")))?;
            }
            res.push((self.treeids[i], self.nodeids[i]));
        }
        Ok(res)
    }
}

/// (tree id, node id) -> indices into the target/class lists.
fn target_index(trees: &[i64], nodes: &[i64]) -> HashMap<(i64, i64), Vec<usize>> {
    let mut m: HashMap<(i64, i64), Vec<usize>> = HashMap::new();
    for (i, (&t, &n)) in trees.iter().zip(nodes).enumerate() {
        m.entry((t, n)).or_default().push(i);
    }
    m
}

fn tree_regressor(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    let x = input(ins, 0)?;
    let a = &ctx.attrs;
    let tr = Trees::new(ctx)?;
    let n_targets = super::util::dims(&[a.int("n_targets", 1)?])?[0];
    let agg = a.string("aggregate_function", "SUM".into())?;
    let post = a.string("post_transform", "NONE".into())?;
    let t_ids = a.ints("target_ids", &[])?;
    let t_trees = a.ints("target_treeids", &[])?;
    let t_nodes = a.ints("target_nodeids", &[])?;
    let t_w = floats_attr(ctx, "target_weights")?.unwrap_or_default();
    ensure!(
        t_ids.len() == t_trees.len() && t_ids.len() == t_nodes.len() && t_ids.len() == t_w.len(),
        "TreeEnsembleRegressor: target attributes differ in length"
    );
    let base = floats_attr(ctx, "base_values")?;
    let idx = target_index(&t_trees, &t_nodes);
    let (n, c, xv) = matrix(x)?;
    let mut res = vec![0.0; n * n_targets];
    for r in 0..n {
        let row = &mut res[r * n_targets..(r + 1) * n_targets];
        match agg.as_str() {
            "SUM" | "AVERAGE" => {}
            "MIN" => row.iter_mut().for_each(|v| *v = f32::MAX as f64),
            "MAX" => row.iter_mut().for_each(|v| *v = f32::MIN as f64),
            a => bail!("TreeEnsembleRegressor: unknown aggregate_function {a:?}"),
        }
        let mut seen = vec![false; n_targets];
        for leaf in tr.leaves(&xv[r * c..(r + 1) * c])? {
            for &it in idx.get(&leaf).map(Vec::as_slice).unwrap_or(&[]) {
                let t = t_ids[it];
                let slot = usize::try_from(t)
                    .ok()
                    .filter(|&t| t < n_targets)
                    .ok_or_else(|| OpError::new(format!("target {t} out of range")))?;
                let w = t_w[it];
                seen[slot] = true;
                match agg.as_str() {
                    "MIN" => row[slot] = row[slot].min(w),
                    "MAX" => row[slot] = row[slot].max(w),
                    _ => row[slot] += w,
                }
            }
        }
        if agg == "AVERAGE" {
            let nt = tr.roots.len().max(1) as f64;
            row.iter_mut().for_each(|v| *v /= nt);
        }
        for (j, v) in row.iter_mut().enumerate() {
            // A target no leaf contributed to scores 0 (as onnxruntime does).
            if !seen[j] {
                *v = 0.0;
            }
            if let Some(b) = &base {
                *v += b.get(j).copied().unwrap_or(0.0);
            }
        }
        post_transform(row, &post)?;
    }
    out(Tensor::from_f64(
        DType::F32,
        shaped(&[n, n_targets], res)?,
        false,
    ))
}

/// Class labels: int64 or strings.
enum Labels {
    I(Vec<i64>),
    S(Vec<String>),
}

impl Labels {
    fn from_attrs(ctx: &OpCtx, ints_name: &str) -> OpResult<Labels> {
        if let Some(v) = ctx.attrs.get_strings("classlabels_strings")? {
            if !v.is_empty() {
                return Ok(Labels::S(v));
            }
        }
        Ok(Labels::I(ctx.attrs.ints(ints_name, &[])?))
    }
    fn len(&self) -> usize {
        match self {
            Labels::I(v) => v.len(),
            Labels::S(v) => v.len(),
        }
    }
    fn tensor(&self, picks: &[Option<usize>], n: usize, fallback_int: i64) -> OpResult<Tensor> {
        Ok(match self {
            Labels::I(v) => Tensor::from_array(shaped(
                &[n],
                picks
                    .iter()
                    .map(|p| p.and_then(|i| v.get(i).copied()).unwrap_or(fallback_int))
                    .collect(),
            )?),
            Labels::S(v) => Tensor::from_array(shaped(
                &[n],
                picks
                    .iter()
                    .map(|p| p.and_then(|i| v.get(i).cloned()).unwrap_or_default())
                    .collect(),
            )?),
        })
    }
}

fn argmax(row: &[f64]) -> usize {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best
}

fn tree_classifier(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    let x = input(ins, 0)?;
    let a = &ctx.attrs;
    let tr = Trees::new(ctx)?;
    let labels = Labels::from_attrs(ctx, "classlabels_int64s")?;
    let post = a.string("post_transform", "NONE".into())?;
    let c_ids = a.ints("class_ids", &[])?;
    let c_trees = a.ints("class_treeids", &[])?;
    let c_nodes = a.ints("class_nodeids", &[])?;
    let c_w = floats_attr(ctx, "class_weights")?.unwrap_or_default();
    ensure!(
        c_ids.len() == c_trees.len() && c_ids.len() == c_nodes.len() && c_ids.len() == c_w.len(),
        "TreeEnsembleClassifier: class attributes differ in length"
    );
    let base = floats_attr(ctx, "base_values")?;
    let idx = target_index(&c_trees, &c_nodes);
    let nc = labels.len();
    ensure!(nc > 0, "TreeEnsembleClassifier: no class labels");
    let binary = c_ids.iter().collect::<HashSet<_>>().len() == 1;
    let width = if binary && nc == 1 { 2 } else { nc };
    let (n, c, xv) = matrix(x)?;
    let mut res = vec![0.0; n * width];
    let mut picks = Vec::with_capacity(n);
    for r in 0..n {
        let mut row = vec![0.0; nc];
        if let Some(b) = &base {
            for (j, v) in row.iter_mut().enumerate() {
                *v = b.get(j).copied().unwrap_or(0.0);
            }
        }
        for leaf in tr.leaves(&xv[r * c..(r + 1) * c])? {
            for &it in idx.get(&leaf).map(Vec::as_slice).unwrap_or(&[]) {
                let k = c_ids[it];
                let slot = usize::try_from(k)
                    .ok()
                    .filter(|&k| k < nc)
                    .ok_or_else(|| OpError::new(format!("class id {k} out of range")))?;
                row[slot] += c_w[it];
            }
        }
        if binary {
            if nc == 1 {
                row = vec![0.0, row[0]];
            } else {
                row[1] = row[0];
            }
            row[0] = if matches!(post.as_str(), "NONE" | "PROBIT") {
                1.0 - row[1]
            } else {
                -row[1]
            };
        }
        post_transform(&mut row, &post)?;
        let best = argmax(&row);
        picks.push(if nc == 1 {
            // A single int label: index 1 means that label, else 0.
            if best == 1 {
                Some(0)
            } else {
                None
            }
        } else {
            Some(best)
        });
        res[r * width..(r + 1) * width].copy_from_slice(&row);
    }
    outs(vec![
        labels.tensor(&picks, n, 0)?,
        Tensor::from_f64(DType::F32, shaped(&[n, width], res)?, false),
    ])
}

// ---------------------------------------------------------------- simple transforms

fn binarizer(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    let x = input(ins, 0)?;
    let th = ctx.attrs.float("threshold", 0.0)? as f64;
    let v = f64s(x)?.mapv(|v| if v > th { 1.0 } else { 0.0 });
    out(Tensor::from_f64(x.dtype(), v, false))
}

fn array_feature_extractor(_ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    let x = input(ins, 0)?;
    let idx = ints(input(ins, 1)?)?;
    let shape = x.shape().to_vec();
    ensure!(
        !shape.is_empty(),
        "ArrayFeatureExtractor: X must have rank >= 1"
    );
    let last = shape[shape.len() - 1];
    let mut cols = Vec::with_capacity(idx.len());
    for &i in &idx {
        ensure!(
            i >= 0 && (i as usize) < last,
            "ArrayFeatureExtractor: index {i} out of range for {last} features"
        );
        cols.push(i as usize);
    }
    let oshape: Vec<usize> = if shape.len() == 1 {
        vec![1, cols.len()]
    } else {
        let mut s = shape[..shape.len() - 1].to_vec();
        s.push(cols.len());
        s
    };
    let ax = ndarray::Axis(shape.len() - 1);
    let t = crate::try_map_data!(x, a => {
        a.select(ax, &cols)
            .as_standard_layout()
            .into_owned()
            .into_shape_with_order(IxDyn(&oshape))
            .map_err(|e| OpError::new(e.to_string()))
    });
    out(t)
}

fn scaler(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    let x = input(ins, 0)?;
    let offset = ctx.attrs.floats("offset", vec![])?;
    let scale = ctx.attrs.floats("scale", vec![])?;
    let shape = x.shape().to_vec();
    let c = shape.last().copied().unwrap_or(1);
    let pick = |v: &[f32], j: usize, d: f64| -> OpResult<f64> {
        match v.len() {
            0 => Ok(d),
            1 => Ok(v[0] as f64),
            l if l == c => Ok(v[j] as f64),
            l => bail!("Scaler: {l} coefficients for {c} features"),
        }
    };
    let a = f64s(x)?;
    let a = a.as_standard_layout();
    let mut res = Vec::with_capacity(a.len());
    for (i, &v) in a.iter().enumerate() {
        let j = if c == 0 { 0 } else { i % c };
        res.push((v - pick(&offset, j, 0.0)?) * pick(&scale, j, 1.0)?);
    }
    out(Tensor::from_f64(DType::F32, shaped(&shape, res)?, false))
}

fn normalizer(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    let x = input(ins, 0)?;
    let norm = ctx.attrs.string("norm", "MAX".into())?;
    let (n, c, mut v) = matrix(x)?;
    for r in 0..n {
        let row = &mut v[r * c..(r + 1) * c];
        let d = match norm.as_str() {
            "MAX" => row.iter().fold(0.0f64, |m, &q| m.max(q.abs())),
            "L1" => row.iter().map(|q| q.abs()).sum(),
            "L2" => row.iter().map(|q| q * q).sum::<f64>().sqrt(),
            k => bail!("Normalizer: unknown norm {k:?}"),
        };
        let d = d.max(1e-30);
        row.iter_mut().for_each(|q| *q /= d);
    }
    out(Tensor::from_f64(DType::F32, shaped(x.shape(), v)?, false))
}

fn imputer(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    let x = input(ins, 0)?;
    let a = &ctx.attrs;
    let fl = a.floats("imputed_value_floats", vec![])?;
    let (values, replace): (Vec<f64>, f64) = if !fl.is_empty() {
        (
            fl.iter().map(|&v| v as f64).collect(),
            a.float("replaced_value_float", 0.0)? as f64,
        )
    } else {
        let iv = a.ints("imputed_value_int64s", &[])?;
        ensure!(!iv.is_empty(), "Imputer: no imputed values");
        (
            iv.iter().map(|&v| v as f64).collect(),
            a.int("replaced_value_int64", 0)? as f64,
        )
    };
    let c = x.shape().last().copied().unwrap_or(1);
    ensure!(
        values.len() == 1 || values.len() == c,
        "Imputer: {} imputed values for {c} features",
        values.len()
    );
    let arr_ = f64s(x)?;
    let arr_ = arr_.as_standard_layout();
    let res: Vec<f64> = arr_
        .iter()
        .enumerate()
        .map(|(i, &v)| {
            let hit = if replace.is_nan() {
                v.is_nan()
            } else {
                v == replace
            };
            if hit {
                values[if values.len() == 1 { 0 } else { i % c.max(1) }]
            } else {
                v
            }
        })
        .collect();
    out(Tensor::from_f64(x.dtype(), shaped(x.shape(), res)?, false))
}

fn one_hot_encoder(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    let x = input(ins, 0)?;
    let a = &ctx.attrs;
    let cats_i = a.ints("cats_int64s", &[])?;
    let cats: Vec<Key> = if !cats_i.is_empty() {
        cats_i.into_iter().map(Key::I).collect()
    } else {
        a.strings("cats_strings", vec![])?
            .into_iter()
            .map(Key::S)
            .collect()
    };
    ensure!(!cats.is_empty(), "OneHotEncoder: no categories");
    let zeros = a.int("zeros", 1)? != 0;
    let map: HashMap<&Key, usize> = cats.iter().enumerate().map(|(i, k)| (k, i)).collect();
    let xk: Vec<Key> = if x.dtype() == DType::Str {
        arr::<String>(x)?.iter().cloned().map(Key::S).collect()
    } else {
        f64s(x)?.iter().map(|&v| Key::I(v as i64)).collect()
    };
    let k = cats.len();
    let mut res = vec![0.0; xk.len() * k];
    for (i, key) in xk.iter().enumerate() {
        match map.get(key) {
            Some(&j) => res[i * k + j] = 1.0,
            None => ensure!(zeros, "OneHotEncoder: a value has no category"),
        }
    }
    let mut shape = x.shape().to_vec();
    shape.push(k);
    out(Tensor::from_f64(DType::F32, shaped(&shape, res)?, false))
}

fn linear_classifier(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    let x = input(ins, 0)?;
    let a = &ctx.attrs;
    let coef = a.floats("coefficients", vec![])?;
    let icpt = a.floats("intercepts", vec![])?;
    let post = a.string("post_transform", "NONE".into())?;
    let labels = Labels::from_attrs(ctx, "classlabels_ints")?;
    let (n, c, xv) = matrix(x)?;
    ensure!(
        c > 0 && !coef.is_empty() && coef.len() % c == 0,
        "LinearClassifier: {} coefficients for {c} features",
        coef.len()
    );
    let k = coef.len() / c;
    ensure!(
        icpt.is_empty() || icpt.len() == k,
        "LinearClassifier: {} intercepts for {k} classes",
        icpt.len()
    );
    let nl = labels.len();
    let width = if k == 1 && nl == 2 { 2 } else { k };
    let mut scores = Vec::with_capacity(n * width);
    let mut picks = Vec::with_capacity(n);
    for r in 0..n {
        let row = &xv[r * c..(r + 1) * c];
        let mut s: Vec<f64> = (0..k)
            .map(|j| {
                let d: f64 = row
                    .iter()
                    .zip(&coef[j * c..(j + 1) * c])
                    .map(|(&p, &q)| p * q as f64)
                    .sum();
                d + icpt.get(j).map_or(0.0, |&b| b as f64)
            })
            .collect();
        if width == 2 && k == 1 {
            s = vec![-s[0], s[0]];
        }
        post_transform(&mut s, &post)?;
        if s.len() > 1 {
            picks.push(Some(argmax(&s)));
        } else {
            let th = if post == "NONE" { 0.0 } else { 0.5 };
            picks.push(if s[0] >= th { Some(0) } else { None });
        }
        scores.extend(s);
    }
    let y = if nl == 0 {
        Tensor::from_array(shaped(
            &[n],
            picks.iter().map(|p| p.map_or(0, |i| i as i64)).collect(),
        )?)
    } else {
        labels.tensor(&picks, n, 0)?
    };
    outs(vec![
        y,
        Tensor::from_f64(DType::F32, shaped(&[n, width], scores)?, false),
    ])
}

fn linear_regressor(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    let x = input(ins, 0)?;
    let a = &ctx.attrs;
    let coef = a.floats("coefficients", vec![])?;
    let icpt = a.floats("intercepts", vec![])?;
    let post = a.string("post_transform", "NONE".into())?;
    let targets = super::util::dims(&[a.int("targets", 1)?])?[0];
    let (n, c, xv) = matrix(x)?;
    ensure!(
        coef.len() == targets * c,
        "LinearRegressor: {} coefficients for {targets} targets of {c} features",
        coef.len()
    );
    ensure!(
        icpt.is_empty() || icpt.len() == targets,
        "LinearRegressor: {} intercepts for {targets} targets",
        icpt.len()
    );
    let mut res = Vec::with_capacity(n * targets);
    for r in 0..n {
        let row = &xv[r * c..(r + 1) * c];
        let mut s: Vec<f64> = (0..targets)
            .map(|j| {
                row.iter()
                    .zip(&coef[j * c..(j + 1) * c])
                    .map(|(&p, &q)| p * q as f64)
                    .sum::<f64>()
                    + icpt.get(j).map_or(0.0, |&b| b as f64)
            })
            .collect();
        post_transform(&mut s, &post)?;
        res.extend(s);
    }
    out(Tensor::from_f64(
        DType::F32,
        shaped(&[n, targets], res)?,
        false,
    ))
}

fn feature_vectorizer(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    let dims_ = ctx.attrs.ints("inputdimensions", &[])?;
    let mut parts = Vec::new();
    let mut n_rows: Option<usize> = None;
    for (i, &d) in dims_.iter().enumerate() {
        let t = input(ins, i)?;
        let (n, c, v) = match t.shape() {
            [c] => (*c, 1, f64s(t)?.iter().copied().collect::<Vec<_>>()),
            _ => matrix(t)?,
        };
        if let Some(m) = n_rows {
            ensure!(
                m == n,
                "FeatureVectorizer: inputs have different row counts"
            );
        }
        n_rows = Some(n);
        ensure!(d >= 0, "FeatureVectorizer: negative input dimension");
        parts.push((c, d as usize, v));
    }
    let n = n_rows.unwrap_or(0);
    let total: usize = parts.iter().map(|p| p.1).sum();
    let mut res = Vec::with_capacity(n * total);
    for r in 0..n {
        for (c, d, v) in &parts {
            for j in 0..*d {
                res.push(if j < *c { v[r * c + j] } else { 0.0 });
            }
        }
    }
    out(Tensor::from_f64(
        DType::F32,
        shaped(&[n, total], res)?,
        false,
    ))
}

fn category_mapper(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    let x = input(ins, 0)?;
    let a = &ctx.attrs;
    let ci = a.ints("cats_int64s", &[])?;
    let cs = a.strings("cats_strings", vec![])?;
    ensure!(
        ci.len() == cs.len(),
        "CategoryMapper: cats_int64s and cats_strings differ in length"
    );
    if x.dtype() == DType::Str {
        let def = a.int("default_int64", -1)?;
        let m: HashMap<&str, i64> = cs
            .iter()
            .map(String::as_str)
            .zip(ci.iter().copied())
            .collect();
        let y = arr::<String>(x)?.map(|s| m.get(s.as_str()).copied().unwrap_or(def));
        out(Tensor::from_array(y))
    } else {
        let def = a.string("default_string", "_Unused".into())?;
        let m: HashMap<i64, &String> = ci.iter().copied().zip(cs.iter()).collect();
        let y: Vec<String> = ints(x)?
            .into_iter()
            .map(|i| m.get(&i).map_or_else(|| def.clone(), |s| (*s).clone()))
            .collect();
        out(Tensor::from_array(shaped(x.shape(), y)?))
    }
}

fn svm_regressor(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    let x = input(ins, 0)?;
    let a = &ctx.attrs;
    let coef: Vec<f64> = a
        .floats("coefficients", vec![])?
        .iter()
        .map(|&v| v as f64)
        .collect();
    let kp = a.floats("kernel_params", vec![])?;
    let (gamma, coef0, degree) = match kp.as_slice() {
        [g, c, d, ..] => (*g as f64, *c as f64, *d as i32),
        _ => (0.0, 0.0, 0),
    };
    let n_sup = a.int("n_supports", 0)?;
    let one_class = a.int("one_class", 0)? != 0;
    let post = a.string("post_transform", "NONE".into())?;
    let rho = a.floats("rho", vec![])?.first().map_or(0.0, |&r| r as f64);
    let sv: Vec<f64> = a
        .floats("support_vectors", vec![])?
        .iter()
        .map(|&v| v as f64)
        .collect();
    let (n, c, xv) = matrix(x)?;
    let kernel = if n_sup > 0 {
        a.string("kernel_type", "LINEAR".into())?.to_lowercase()
    } else {
        "linear".into()
    };
    let kdot = |p: &[f64], q: &[f64]| -> OpResult<f64> {
        let dot = || p.iter().zip(q).map(|(a, b)| a * b).sum::<f64>();
        Ok(match kernel.as_str() {
            "poly" => (dot() * gamma + coef0).powi(degree),
            "sigmoid" => (dot() * gamma + coef0).tanh(),
            "rbf" => (-gamma * p.iter().zip(q).map(|(a, b)| (a - b) * (a - b)).sum::<f64>()).exp(),
            "linear" => dot(),
            k => bail!("SVMRegressor: unknown kernel_type {k:?}"),
        })
    };
    let mut res = Vec::with_capacity(n);
    for r in 0..n {
        let row = &xv[r * c..(r + 1) * c];
        let mut s = if n_sup > 0 {
            let ns = n_sup as usize;
            ensure!(
                sv.len() == ns * c && coef.len() >= ns,
                "SVMRegressor: support_vectors/coefficients do not match n_supports {ns}"
            );
            let mut s = 0.0;
            for j in 0..ns {
                s += coef[j] * kdot(row, &sv[j * c..(j + 1) * c])?;
            }
            s
        } else {
            ensure!(
                coef.len() == c,
                "SVMRegressor: {} coefficients for {c} features",
                coef.len()
            );
            kdot(row, &coef)?
        } + rho;
        if one_class {
            s = if s > 0.0 { 1.0 } else { -1.0 };
        }
        let mut one = [s];
        post_transform(&mut one, &post)?;
        res.push(one[0]);
    }
    out(Tensor::from_f64(DType::F32, shaped(&[n, 1], res)?, false))
}

mod lower {
    use crate::ensure;
    use crate::ir::{DType, OpResult, Tensor};
    use crate::kir::{BinOp, BufId, CmpOp, Expr, Stmt, Ty, VarId};
    use crate::ops::lowering::{elementwise, lit, str_diff, LowerCtx};
    use crate::ops::{Lowering, Registry, ONNX_ML};
    use std::collections::HashSet;

    fn binarizer(lw: &mut LowerCtx) -> OpResult<()> {
        let t = lw.input(0)?.ty().compute();
        let th = lw.op.attrs.float("threshold", 0.0)? as f64;
        elementwise(lw, 0, |_, a| {
            // Compare in f64 like the reference.
            let x = if t == Ty::F64 {
                a[0].clone()
            } else {
                Expr::cast(Ty::F64, a[0].clone())
            };
            Ok(Expr::select(
                Expr::cmp(CmpOp::Gt, x, Expr::Float(th, Ty::F64)),
                lit(1.0, t),
                lit(0.0, t),
            ))
        })
    }

    fn array_feature_extractor(lw: &mut LowerCtx) -> OpResult<()> {
        let x = lw.input(0)?.clone();
        let idx = lw.input(1)?.clone();
        let out = lw.outputs[0].clone();
        ensure!(
            !x.shape.is_empty(),
            "ArrayFeatureExtractor: X must have rank >= 1"
        );
        let last = *x.shape.last().expect("rank >= 1") as i64;
        let n = idx.len() as i64;
        if out.is_empty() {
            return Ok(());
        }
        let mut k = lw.kernel("");
        let p = k.var(Ty::I64);
        let outer = Expr::bin(BinOp::Div, Expr::Var(p), Expr::Int(n));
        let j = Expr::bin(BinOp::Rem, Expr::Var(p), Expr::Int(n));
        let col = Expr::cast(Ty::I64, Expr::load(idx.buf, j));
        // Out-of-range indices read column 0 (the reference rejects them).
        let ok = Expr::bin(
            BinOp::And,
            Expr::cmp(CmpOp::Ge, col.clone(), Expr::Int(0)),
            Expr::cmp(CmpOp::Lt, col.clone(), Expr::Int(last)),
        );
        let col = Expr::select(ok, col, Expr::Int(0));
        k.body = vec![Stmt::For {
            var: p,
            extent: out.len() as u64,
            body: vec![Stmt::Store {
                buf: out.buf,
                index: Expr::Var(p),
                value: Expr::load(x.buf, Expr::add(Expr::mul(outer, Expr::Int(last)), col)),
            }],
        }];
        lw.push(k);
        Ok(())
    }

    /// LabelEncoder: the distinct keys sorted at compile time, a binary search per
    /// element (string keys compared byte by byte, floats as f64 with NaN matching NaN),
    /// and the value at the found key, or the default, read from a table of the values
    /// in key order with the default last.
    fn label_encoder(lw: &mut LowerCtx) -> OpResult<()> {
        use super::Key;
        let x = lw.input(0)?.clone();
        let out = lw.outputs[0].clone();
        let (keys, values, default) = super::label_encoder_tables(lw.op, x.dtype)?;
        // The first of equal keys wins; keys of another kind than the input never match.
        let kind = |k: &Key| match k {
            Key::S(_) => 0,
            Key::F(_) => 1,
            Key::I(_) => 2,
        };
        let xkind = if x.dtype == DType::Str {
            0
        } else if x.dtype.is_float() {
            1
        } else {
            2
        };
        let mut seen = HashSet::new();
        let mut entries: Vec<(Key, usize)> = Vec::new();
        let mut nan: Option<usize> = None;
        for (i, k) in keys.into_iter().enumerate() {
            if kind(&k) != xkind || !seen.insert(k.clone()) {
                continue;
            }
            match &k {
                Key::F(b) if f64::from_bits(*b).is_nan() => nan = Some(i),
                _ => entries.push((k, i)),
            }
        }
        entries.sort_by(|(a, _), (b, _)| match (a, b) {
            (Key::S(a), Key::S(b)) => a.as_bytes().cmp(b.as_bytes()),
            (Key::I(a), Key::I(b)) => a.cmp(b),
            (Key::F(a), Key::F(b)) => f64::from_bits(*a).total_cmp(&f64::from_bits(*b)),
            _ => std::cmp::Ordering::Equal,
        });
        let nk = entries.len();
        // Values in key order, then (at index nk) the default, then the NaN key's value.
        let mut order: Vec<usize> = entries.iter().map(|(_, i)| *i).collect();
        order.push(usize::MAX);
        order.extend(nan);
        let table = crate::try_map_data!(values, a => super::pick(a, &default, &order));
        if out.is_empty() {
            return Ok(());
        }
        let table = lw.constant("values", &table)?;
        let key_table = match xkind {
            _ if nk == 0 => None,
            0 => {
                let v: Vec<String> = entries
                    .iter()
                    .map(|(k, _)| match k {
                        Key::S(s) => s.clone(),
                        _ => String::new(),
                    })
                    .collect();
                Some(lw.constant("keys", &Tensor::from_vec(&[nk], v))?)
            }
            1 => {
                let v: Vec<f64> = entries
                    .iter()
                    .map(|(k, _)| match k {
                        Key::F(b) => f64::from_bits(*b),
                        _ => 0.0,
                    })
                    .collect();
                Some(lw.constant("keys", &Tensor::from_vec(&[nk], v))?)
            }
            _ => {
                let v: Vec<i64> = entries
                    .iter()
                    .map(|(k, _)| match k {
                        Key::I(i) => *i,
                        _ => 0,
                    })
                    .collect();
                Some(lw.constant("keys", &Tensor::from_vec(&[nk], v))?)
            }
        };
        let mut k = lw.kernel("");
        let i = k.var(Ty::I64);
        let (lo, hi, mid, r, step) = (
            k.var(Ty::I64),
            k.var(Ty::I64),
            k.var(Ty::I64),
            k.var(Ty::I64),
            k.var(Ty::I64),
        );
        let v = |x| Expr::Var(x);
        let set = |var, value| Stmt::Set { var, value };
        // The input element as a number (i64 or f64), for numeric keys.
        let xv = match xkind {
            1 => Expr::cast(Ty::F64, Expr::load(x.buf, v(i))),
            _ => Expr::cast(Ty::I64, Expr::load(x.buf, v(i))),
        };
        // (statements, key at `at` < x, key at `at` == x).
        let compare = |k: &mut crate::kir::Kernel, keys: BufId, at: VarId| {
            if xkind == 0 {
                let (s, kb, xb) = str_diff(k, (keys, v(at)), (x.buf, v(i)));
                (
                    s,
                    Expr::cmp(CmpOp::Lt, kb.clone(), xb.clone()),
                    Expr::cmp(CmpOp::Eq, kb, xb),
                )
            } else {
                let key = Expr::load(keys, v(at));
                (
                    vec![],
                    Expr::cmp(CmpOp::Lt, key.clone(), xv.clone()),
                    Expr::cmp(CmpOp::Eq, key, xv.clone()),
                )
            }
        };
        let mut body = vec![set(r, Expr::Int(nk as i64))];
        if let Some(keys) = key_table {
            // Lower bound: the first key not below x, in as many halvings as nk has bits.
            let steps = (usize::BITS - nk.leading_zeros()) as u64;
            let (mut probe, less, _) = compare(&mut k, keys, mid);
            probe.push(Stmt::If {
                cond: less,
                then: vec![set(lo, Expr::add(v(mid), Expr::Int(1)))],
                els: vec![set(hi, v(mid))],
            });
            let mut halve = vec![set(
                mid,
                Expr::bin(BinOp::Div, Expr::add(v(lo), v(hi)), Expr::Int(2)),
            )];
            halve.extend(probe);
            body.extend([
                set(lo, Expr::Int(0)),
                set(hi, Expr::Int(nk as i64)),
                Stmt::For {
                    var: step,
                    extent: steps,
                    body: vec![Stmt::If {
                        cond: Expr::cmp(CmpOp::Lt, v(lo), v(hi)),
                        then: halve,
                        els: vec![],
                    }],
                },
            ]);
            let (mut found, _, eq) = compare(&mut k, keys, lo);
            found.push(Stmt::If {
                cond: eq,
                then: vec![set(r, v(lo))],
                els: vec![],
            });
            body.push(Stmt::If {
                cond: Expr::cmp(CmpOp::Lt, v(lo), Expr::Int(nk as i64)),
                then: found,
                els: vec![],
            });
        }
        if nan.is_some() {
            body.push(Stmt::If {
                cond: Expr::cmp(CmpOp::Ne, xv.clone(), xv.clone()),
                then: vec![set(r, Expr::Int(nk as i64 + 1))],
                els: vec![],
            });
        }
        body.push(Stmt::Store {
            buf: out.buf,
            index: v(i),
            value: Expr::load(table, v(r)),
        });
        k.body = vec![Stmt::For {
            var: i,
            extent: out.len() as u64,
            body,
        }];
        lw.push(k);
        Ok(())
    }

    /// Registers an ai.onnx.ml lowering.
    fn ml(r: &mut Registry, op: &str, l: Lowering) {
        r.lower_in(ONNX_ML, op, l);
    }

    mod tree {
        use crate::ir::{OpError, OpResult};
        use crate::kir::{BinOp, CmpOp, Expr, Stmt, Ty, VarId};
        use crate::ops::lowering::LowerCtx;
        use crate::ops::util::{f64s, ints};
        use crate::ops::{Lowering, Registry, ONNX_ML};
        use crate::{bail, ensure};

        struct T {
            splits: Vec<f64>,
            modes: Vec<i64>,
            sets: Vec<Vec<f64>>,
            feats: Vec<i64>,
            tids: Vec<i64>,
            fids: Vec<i64>,
            tleaf: Vec<i64>,
            fleaf: Vec<i64>,
            missing: Vec<i64>,
            leaf_targets: Vec<i64>,
            leaf_weights: Vec<f64>,
        }

        fn f(x: f64) -> Expr {
            Expr::Float(x, Ty::F64)
        }

        /// The statements that add leaf `l` into the accumulators.
        fn leaf(t: &T, l: i64, acc: &[VarId], agg: i64, n_trees: usize) -> OpResult<Vec<Stmt>> {
            let l = usize::try_from(l)
                .ok()
                .filter(|&l| l < t.leaf_weights.len());
            let Some(l) = l else {
                bail!("TreeEnsemble: leaf out of range")
            };
            let w = t.leaf_weights[l];
            let tg = usize::try_from(t.leaf_targets[l])
                .ok()
                .filter(|&x| x < acc.len());
            let Some(tg) = tg else {
                bail!("TreeEnsemble: target out of range")
            };
            let a = Expr::Var(acc[tg]);
            let value = match agg {
                0 => Expr::add(a, f(w / n_trees as f64)),
                1 => Expr::add(a, f(w)),
                2 => Expr::select(Expr::cmp(CmpOp::Lt, f(w), a.clone()), f(w), a),
                _ => Expr::select(Expr::cmp(CmpOp::Gt, f(w), a.clone()), f(w), a),
            };
            Ok(vec![Stmt::Set {
                var: acc[tg],
                value,
            }])
        }

        #[allow(clippy::too_many_arguments)]
        fn node(
            t: &T,
            i: usize,
            depth: usize,
            row: &Expr,
            c: usize,
            x: usize,
            acc: &[VarId],
            agg: i64,
            n_trees: usize,
        ) -> OpResult<Vec<Stmt>> {
            ensure!(
                depth <= t.modes.len() + 1 && i < t.modes.len(),
                "TreeEnsemble: bad tree"
            );
            let fe = usize::try_from(t.feats[i]).ok().filter(|&v| v < c);
            let Some(fe) = fe else {
                bail!("TreeEnsemble: feature out of range")
            };
            let v = Expr::cast(
                Ty::F64,
                Expr::load(x, Expr::add(row.clone(), Expr::Int(fe as i64))),
            );
            let th = f(t.splits[i]);
            let mut cond = match t.modes[i] {
                0 => Expr::cmp(CmpOp::Le, v.clone(), th),
                1 => Expr::cmp(CmpOp::Lt, v.clone(), th),
                2 => Expr::cmp(CmpOp::Ge, v.clone(), th),
                3 => Expr::cmp(CmpOp::Gt, v.clone(), th),
                4 => Expr::cmp(CmpOp::Eq, v.clone(), th),
                5 => Expr::cmp(CmpOp::Ne, v.clone(), th),
                _ => {
                    let mut e = Expr::Cast(Ty::U8, Box::new(Expr::Int(0)));
                    for &m in &t.sets[i] {
                        e = Expr::bin(BinOp::Or, e, Expr::cmp(CmpOp::Eq, v.clone(), f(m)));
                    }
                    e
                }
            };
            if t.missing.get(i).copied().unwrap_or(0) != 0 {
                cond = Expr::bin(BinOp::Or, cond, Expr::cmp(CmpOp::Ne, v.clone(), v));
            }
            let branch = |next: i64, is_leaf: i64| -> OpResult<Vec<Stmt>> {
                if is_leaf != 0 {
                    leaf(t, next, acc, agg, n_trees)
                } else {
                    let n = usize::try_from(next).map_err(|_| OpError::new("negative node id"))?;
                    node(t, n, depth + 1, row, c, x, acc, agg, n_trees)
                }
            };
            Ok(vec![Stmt::If {
                cond,
                then: branch(t.tids[i], t.tleaf[i])?,
                els: branch(t.fids[i], t.fleaf[i])?,
            }])
        }

        fn tree_ensemble(lw: &mut LowerCtx) -> OpResult<()> {
            let a = &lw.op.attrs;
            let tv = |name: &str| -> OpResult<Vec<f64>> {
                match a.get_tensor(name)? {
                    Some(t) => Ok(f64s(&t)?.iter().copied().collect()),
                    None => bail!("TreeEnsemble: attribute `{name}` is required"),
                }
            };
            let post = a.int("post_transform", 0)?;
            if post != 0 {
                return Err(OpError::unsupported("TreeEnsemble with a post transform"));
            }
            let agg = a.int("aggregate_function", 1)?;
            ensure!((0..=3).contains(&agg), "TreeEnsemble: aggregate_function");
            let modes: Vec<i64> = match a.get_tensor("nodes_modes")? {
                Some(t) => ints(&t)?,
                None => bail!("TreeEnsemble: nodes_modes is required"),
            };
            let members: Vec<f64> = match a.get_tensor("membership_values")? {
                Some(t) => f64s(&t)?.iter().copied().collect(),
                None => vec![],
            };
            let mut it = members.split(|v| v.is_nan());
            let sets = modes
                .iter()
                .map(|&m| {
                    if m == 6 {
                        it.next().map(|s| s.to_vec()).unwrap_or_default()
                    } else {
                        vec![]
                    }
                })
                .collect();
            let t = T {
                splits: tv("nodes_splits")?,
                sets,
                feats: a.req_ints("nodes_featureids")?,
                tids: a.req_ints("nodes_truenodeids")?,
                fids: a.req_ints("nodes_falsenodeids")?,
                tleaf: a.req_ints("nodes_trueleafs")?,
                fleaf: a.req_ints("nodes_falseleafs")?,
                missing: a.ints("nodes_missing_value_tracks_true", &[])?,
                leaf_targets: a.req_ints("leaf_targetids")?,
                leaf_weights: tv("leaf_weights")?,
                modes,
            };
            let nn = t.modes.len();
            ensure!(
                [
                    t.splits.len(),
                    t.feats.len(),
                    t.tids.len(),
                    t.fids.len(),
                    t.tleaf.len(),
                    t.fleaf.len()
                ]
                .iter()
                .all(|&l| l == nn),
                "TreeEnsemble: node attributes differ in length"
            );
            let roots = a.req_ints("tree_roots")?;
            let n_targets = a.req_int("n_targets")? as usize;
            if n_targets > 64 {
                return Err(OpError::unsupported(
                    "TreeEnsemble with more than 64 targets",
                ));
            }
            let x = lw.input(0)?.clone();
            let out = lw.outputs[0].clone();
            let (n, c) = match x.shape.as_slice() {
                [c] => (1, *c),
                [n, rest @ ..] => (*n, rest.iter().product()),
                [] => (1, 1),
            };
            let big = match x.ty() {
                Ty::F64 => f64::MAX,
                Ty::F16 => 65504.0,
                Ty::BF16 => 3.3895313892515355e38,
                _ => f32::MAX as f64,
            };
            let init = match agg {
                0 | 1 => 0.0,
                2 => big,
                _ => -big,
            };
            let mut k = lw.kernel("");
            let r = k.var(Ty::I64);
            let acc: Vec<VarId> = (0..n_targets).map(|_| k.var(Ty::F64)).collect();
            let row = Expr::mul(Expr::Var(r), Expr::Int(c as i64));
            let mut body: Vec<Stmt> = acc
                .iter()
                .map(|&v| Stmt::Set {
                    var: v,
                    value: f(init),
                })
                .collect();
            for &root in &roots {
                let root = usize::try_from(root).map_err(|_| OpError::new("negative root"))?;
                ensure!(root < nn, "TreeEnsemble: root out of range");
                if t.tleaf[root] != 0 && t.fleaf[root] != 0 && t.tids[root] == t.fids[root] {
                    body.extend(leaf(&t, t.tids[root], &acc, agg, roots.len())?);
                } else {
                    body.extend(node(&t, root, 0, &row, c, x.buf, &acc, agg, roots.len())?);
                }
            }
            let ot = out.ty().compute();
            for (j, &v) in acc.iter().enumerate() {
                let val = if ot == Ty::F64 {
                    Expr::Var(v)
                } else {
                    Expr::cast(ot, Expr::Var(v))
                };
                body.push(Stmt::Store {
                    buf: out.buf,
                    index: Expr::add(
                        Expr::mul(Expr::Var(r), Expr::Int(n_targets as i64)),
                        Expr::Int(j as i64),
                    ),
                    value: val,
                });
            }
            k.body = vec![Stmt::For {
                var: r,
                extent: n as u64,
                body,
            }];
            lw.push(k);
            Ok(())
        }

        pub fn register(r: &mut Registry) {
            r.lower_in(ONNX_ML, "TreeEnsemble", Lowering::Custom(tree_ensemble));
        }
    }

    pub fn register(r: &mut Registry) {
        tree::register(r);
        ml(r, "LabelEncoder", Lowering::Custom(label_encoder));
        ml(r, "Binarizer", Lowering::Custom(binarizer));
        ml(
            r,
            "ArrayFeatureExtractor",
            Lowering::Custom(array_feature_extractor),
        );
    }
}
