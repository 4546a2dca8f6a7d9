//! The memory plan: every arena buffer gets a byte offset from its live range over the
//! kernel schedule (greedy by size: the largest buffers are placed first, each at the
//! lowest offset that does not overlap a buffer live at the same time). The lower bound
//! is the peak of bytes live at once (each buffer rounded up to the 64-byte alignment).

use crate::kir::{BufId, BufKind, Expr, Program, Stmt};
use serde::Serialize;

/// Arena buffers are placed at multiples of this.
pub const ALIGN: u64 = 64;

#[derive(Clone, Debug, Default, Serialize)]
pub struct PlanReport {
    pub arena_bytes: u64,
    /// Peak bytes live at once (each buffer rounded up to [`ALIGN`]): no plan can use less.
    pub lower_bound: u64,
    /// (buffer name, offset, bytes, first kernel, last kernel)
    pub placements: Vec<(String, u64, u64, usize, usize)>,
}

fn touched(body: &[Stmt], out: &mut Vec<BufId>) {
    fn e(x: &Expr, out: &mut Vec<BufId>) {
        match x {
            Expr::Load(b, i) => {
                out.push(*b);
                e(i, out);
            }
            Expr::Un(_, a) | Expr::Cast(_, a) => e(a, out),
            Expr::Bin(_, a, b) | Expr::Cmp(_, a, b) => {
                e(a, out);
                e(b, out);
            }
            Expr::Select(c, a, b) => {
                e(c, out);
                e(a, out);
                e(b, out);
            }
            Expr::Call(_, args) => args.iter().for_each(|a| e(a, out)),
            Expr::StrByte(b, i, j) => {
                out.push(*b);
                e(i, out);
                e(j, out);
            }
            Expr::Var(_) | Expr::Int(_) | Expr::Float(..) => {}
        }
    }
    for s in body {
        match s {
            Stmt::For { body, .. } => touched(body, out),
            Stmt::Store { buf, index, value } => {
                out.push(*buf);
                e(index, out);
                e(value, out);
            }
            Stmt::Set { value, .. } => e(value, out),
            Stmt::If { cond, then, els } => {
                e(cond, out);
                touched(then, out);
                touched(els, out);
            }
            Stmt::While { cond, body } => {
                e(cond, out);
                touched(body, out);
            }
            Stmt::Gemm(g) => g.views().into_iter().for_each(|v| {
                out.push(v.buf);
                e(&v.offset, out);
            }),
        }
    }
}

/// A placed buffer: (buffer, start offset, end offset).
type Placed = (BufId, u64, u64);

/// Assigns arena offsets in place and returns the report.
pub fn plan(p: &mut Program) -> PlanReport {
    let nb = p.buffers.len();
    let mut first = vec![usize::MAX; nb];
    let mut last = vec![0usize; nb];
    for (i, k) in p.kernels.iter().enumerate() {
        let mut t = Vec::new();
        touched(&k.body, &mut t);
        for b in t {
            first[b] = first[b].min(i);
            last[b] = last[b].max(i);
        }
    }
    let items: Vec<BufId> = (0..nb)
        .filter(|&b| matches!(p.buffers[b].kind, BufKind::Arena { .. }) && first[b] != usize::MAX)
        .collect();
    // Greedy placement in a few orders (largest first, earliest first, largest
    // size x lifetime first, longest-lived first), each with best and first fit; the
    // smallest arena wins. Ties keep the first order, so plans are
    // deterministic.
    let sizes: Vec<u64> = p
        .buffers
        .iter()
        .map(|b| b.bytes().div_ceil(ALIGN) * ALIGN)
        .collect();
    let size = |b: BufId| sizes[b];
    let mut orders: Vec<Vec<BufId>> = Vec::new();
    let mut o = items.clone();
    o.sort_by(|&a, &b| {
        size(b)
            .cmp(&size(a))
            .then(first[a].cmp(&first[b]))
            .then(a.cmp(&b))
    });
    orders.push(o);
    let mut o = items.clone();
    o.sort_by(|&a, &b| {
        first[a]
            .cmp(&first[b])
            .then(size(b).cmp(&size(a)))
            .then(a.cmp(&b))
    });
    orders.push(o);
    let mut o = items.clone();
    o.sort_by(|&a, &b| {
        let (la, lb) = (
            (last[a] - first[a] + 1) as u64 * size(a),
            (last[b] - first[b] + 1) as u64 * size(b),
        );
        lb.cmp(&la).then(a.cmp(&b))
    });
    orders.push(o);
    // Longest-lived first (small long-lived buffers, such as masks read by every layer,
    // otherwise land above the peak).
    let mut o = items.clone();
    o.sort_by(|&a, &b| {
        (last[b] - first[b])
            .cmp(&(last[a] - first[a]))
            .then(size(b).cmp(&size(a)))
            .then(a.cmp(&b))
    });
    orders.push(o);
    let mut best: Option<(u64, Vec<Placed>)> = None;
    // Each order with best fit (the smallest gap that holds the buffer) and with first
    // fit (the lowest such gap).
    for (order, first_fit) in orders.iter().flat_map(|o| [(o, false), (o, true)]) {
        let mut placed: Vec<Placed> = Vec::new();
        let mut arena = 0u64;
        for &b in order {
            let sz = size(b);
            let mut conflicts: Vec<(u64, u64)> = placed
                .iter()
                .filter(|(o, _, _)| !(last[*o] < first[b] || last[b] < first[*o]))
                .map(|&(_, s, e)| (s, e))
                .collect();
            conflicts.sort();
            // The chosen gap that holds the buffer, else the end.
            let mut cursor = 0u64;
            let mut best_gap: Option<(u64, u64)> = None; // (gap size, offset)
            for (s, e) in &conflicts {
                if *s >= cursor + sz {
                    let gap = s - cursor;
                    if best_gap.is_none_or(|(g, _)| gap < g && !first_fit) {
                        best_gap = Some((gap, cursor));
                    }
                }
                cursor = cursor.max(*e);
            }
            let off = best_gap.map(|(_, o)| o).unwrap_or(cursor);
            placed.push((b, off, off + sz));
            arena = arena.max(off + sz);
        }
        if best.as_ref().is_none_or(|(a, _)| arena < *a) {
            best = Some((arena, placed));
        }
    }
    let (arena, placed) = best.unwrap_or((0, Vec::new()));
    for &(b, off, _) in &placed {
        p.buffers[b].kind = BufKind::Arena { offset: off };
    }
    // Arena buffers no kernel touches (unused optional outputs) hold nothing.
    for (buf, &f) in p.buffers.iter_mut().zip(&first) {
        if matches!(buf.kind, BufKind::Arena { .. }) && f == usize::MAX {
            buf.kind = BufKind::Arena { offset: 0 };
            buf.len = 0;
        }
    }
    let mut lower_bound = 0u64;
    for i in 0..p.kernels.len() {
        let live: u64 = items
            .iter()
            .filter(|&&b| first[b] <= i && i <= last[b])
            .map(|&b| size(b))
            .sum();
        lower_bound = lower_bound.max(live);
    }
    p.arena_bytes = arena;
    let placements = placed
        .iter()
        .map(|&(b, s, _)| {
            (
                p.buffers[b].name.clone(),
                s,
                p.buffers[b].bytes(),
                first[b],
                last[b],
            )
        })
        .collect();
    PlanReport {
        arena_bytes: arena,
        lower_bound,
        placements,
    }
}
