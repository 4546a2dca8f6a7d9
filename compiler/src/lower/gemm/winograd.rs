//! 3x3 stride-1 convolutions by Winograd's minimal filtering F(2x2, 3x3) (Lavin and
//! Gray, "Fast Algorithms for Convolutional Neural Networks", 2016).
//!
//! The output is cut into 2x2 tiles; tile `(th, tw)` reads the 4x4 input patch at
//! `(2 th - ph, 2 tw - pw)`. With `d` the patch, `g` a 3x3 filter and
//!
//! ```text
//! B^T = [1  0 -1  0]    G = [1    0    0  ]    A^T = [1 1  1  0]
//!       [0  1  1  0]        [1/2  1/2  1/2]          [0 1 -1 -1]
//!       [0 -1  1  0]        [1/2 -1/2  1/2]
//!       [0  1  0 -1]        [0    0    1  ]
//! ```
//!
//! the tile is `Y = A^T [sum over ci of (G g G^T) . (B^T d B)] A`. The sum over input
//! channels of each of the 16 elementwise products is a matrix product, so a conv is 16
//! GEMMs `M_k[co, t] = U_k[co, ci] V_k[ci, t]` over the tiles `t`, with `U = G g G^T`
//! computed at compile time: 16 multiply-adds per tile and channel pair instead of 36
//! (2.25x fewer), plus an input transform (`V = B^T d B`, additions only) and an output
//! transform (`A^T M A`, additions only) that read and write about as much as the
//! im2col copy they replace reads and writes a third of.
//!
//! Per image: the input is copied into zero-padded planes (so that no patch needs a
//! bounds test), then the tiles run in blocks of whole tile rows whose 16 transformed
//! inputs and 16 GEMM outputs stay in L2: input transform, 16 GEMMs, output transform.
//! The blocks share out into two parts of consecutive blocks, each part with its own
//! scratch slot, so that with threads each core takes whole blocks (one job per conv;
//! the GEMMs run whole inside the tasks) instead of sharing every small GEMM and
//! transform loop; the second part ends with the tail block. The input transform reads
//! every other column (stride-2 loads) and writes 16 unit-stride rows; the output
//! transform reads 16 unit-stride rows and writes every other column of two output
//! rows, applying the bias and the fused epilogue on the way.

use super::{blocks_cost, Parts, Plane, PANEL};
use crate::kir::build::{add, int, lin, loops, sub};
use crate::kir::{BufKind, Expr, GemmAct, GemmCall, Kernel, MatView, Stmt, Ty, VarId};
use crate::ops::lowering::{Epilogue, LowerCtx, TensorRef};

/// Most bytes of one block's transformed input and GEMM output (16 matrices each, one
/// slot). Measured on a 1 MiB-L2 core (A/B, one and two threads): 768 KiB blocks were
/// 9-20% slower than 1 MiB on 64- and 256-channel layers (more blocks of fewer tiles,
/// more panel padding: a 256-channel 14x14 layer ran 21-tile blocks), 1.5 MiB within
/// noise of 1 MiB.
const BLOCK_BYTES: usize = 1024 * 1024;

/// Most bytes of the transformed weights (16 `[m][c]` matrices, 16/9 of the filter's).
/// Each block reads them all again: past L2 they stream from L3, which still pays with
/// [`MIN_TILES`] tiles or more (ResNet-18's 256-channel 14x14 convs, 4 MiB: 2.24 -> 1.45
/// ms alone).
const MAX_WEIGHT_BYTES: usize = 8 << 20;

/// Least output tiles per image, each tile a use of every transformed weight: a 512-channel
/// 7x7 conv (16 tiles, 16 MiB of transformed weights) runs no faster than through
/// im2col alone, and in a whole model its weights would not stay in L3.
const MIN_TILES: usize = 32;

/// Least multiply-adds of one of the 16 GEMMs (`m * c * tiles`): below, the calls and
/// transforms cost more than the multiply-adds saved (a 16 -> 32 channel conv on 14x14,
/// 25 K: 0.021 -> 0.030 ms; 48 -> 192 on 13x13, 451 K: unchanged; 64 -> 256, 803 K: -13%).
const MIN_GEMM_MACS: usize = 1 << 19;

/// Whether a conv runs through [`conv`]: 3x3, stride 1, no dilation, non-negative
/// pads, enough tiles and work ([`MIN_TILES`], [`MIN_GEMM_MACS`]), and transformed
/// weights within [`MAX_WEIGHT_BYTES`].
/// `ONNXC_NO_WINOGRAD` turns it off (for comparisons).
pub(super) fn fits(p2: &Plane, c: usize, m: usize) -> bool {
    let tiles = p2.oh.div_ceil(2) * p2.ow.div_ceil(2);
    p2.kh == 3
        && p2.kw == 3
        && p2.sh == 1
        && p2.sw == 1
        && p2.dh == 1
        && p2.dw == 1
        && p2.ph >= 0
        && p2.pw >= 0
        && c >= 4
        && m >= 8
        && tiles >= MIN_TILES
        && m * c * tiles >= MIN_GEMM_MACS
        && 16 * m * c * 4 <= MAX_WEIGHT_BYTES
        && std::env::var_os("ONNXC_NO_WINOGRAD").is_none()
}

/// `U_k = G g G^T` for every (co, ci), as 16 constant `[m][c]` buffers (`k = 4 i + j`),
/// computed in f64 and rounded once; `None` when the weights are not constant.
fn weights(lw: &mut LowerCtx, w: &TensorRef, m: usize, c: usize) -> Option<Vec<usize>> {
    let vals = super::const_values(w, m * c * 9)?;
    const G: [[f64; 3]; 4] = [
        [1.0, 0.0, 0.0],
        [0.5, 0.5, 0.5],
        [0.5, -0.5, 0.5],
        [0.0, 0.0, 1.0],
    ];
    let mut data: Vec<Vec<u8>> = (0..16).map(|_| Vec::with_capacity(4 * m * c)).collect();
    for f in vals.chunks_exact(9) {
        // gt = G g (4x3), then u = gt G^T (4x4).
        let mut gt = [[0.0; 3]; 4];
        for (i, row) in gt.iter_mut().enumerate() {
            for (j, x) in row.iter_mut().enumerate() {
                *x = (0..3).map(|r| G[i][r] * f[r * 3 + j]).sum();
            }
        }
        for i in 0..4 {
            for j in 0..4 {
                let u: f64 = (0..3).map(|r| gt[i][r] * G[j][r]).sum();
                data[i * 4 + j].extend_from_slice(&(u as f32).to_le_bytes());
            }
        }
    }
    Some(
        data.into_iter()
            .enumerate()
            .map(|(kk, data)| {
                lw.program.add_buffer(
                    format!("{}/wino_u{kk}", lw.name),
                    BufKind::Const { data },
                    Ty::F32,
                    (m * c) as u64,
                )
            })
            .collect(),
    )
}

/// Tile rows per block: the count whose blocks waste the fewest GEMM columns on panel
/// padding (a block also costs about a panel more: its 16 calls and loops), on one thread
/// and on two (see [`blocks_cost`]), within [`BLOCK_BYTES`] of scratch (at least one
/// row), with at least two blocks where there are two tile rows: `th` tile rows, the
/// first `whole` of them with two output rows.
fn block_rows(th: usize, whole: usize, tw: usize, c: usize, m: usize) -> usize {
    let per_tile = 16 * (c + m) * 4;
    let most = (BLOCK_BYTES / per_tile / tw).clamp(1, th.div_ceil(2));
    let pad = |t: usize| t.div_ceil(PANEL) * PANEL;
    let cost = |rb: usize| {
        let (one, two) = blocks_cost(th, whole, rb, |rows| pad(rows * tw) + PANEL);
        one + two
    };
    (1..=most)
        .min_by_key(|&rb| (cost(rb), std::cmp::Reverse(rb)))
        .unwrap_or(1)
}

/// `(a + b) + c` etc.: the transforms' sums of three.
fn add3(a: Expr, b: Expr, c: Expr) -> Expr {
    add(add(a, b), c)
}

/// The shapes every block of one conv shares.
struct Geo<'a> {
    xp: usize,
    vb: usize,
    mb: usize,
    us: &'a [usize],
    out: &'a TensorRef,
    bias: Option<&'a TensorRef>,
    ep: Option<&'a Epilogue>,
    nv: VarId,
    c: usize,
    m: usize,
    /// Padded plane size and row length.
    pl: usize,
    wp: usize,
    oh: usize,
    ow: usize,
    /// Tiles per row.
    tw: usize,
    /// Row stride of the block matrices (a slot of `vb` is `16 c ld` elements, of `mb`
    /// `16 m ld`).
    ld: usize,
}

/// Lowers the conv (see the module doc); `false` when the weights are not constant.
#[allow(clippy::too_many_arguments)]
pub(super) fn conv(
    lw: &mut LowerCtx,
    p2: &Plane,
    x: &TensorRef,
    w: &TensorRef,
    bias: Option<&TensorRef>,
    out: &TensorRef,
    ep: Option<&Epilogue>,
    (nimg, c, m): (usize, usize, usize),
) -> bool {
    let Some(us) = weights(lw, w, m, c) else {
        return false;
    };
    let (oh, ow) = (p2.oh, p2.ow);
    let (th_n, tw_n) = (oh.div_ceil(2), ow.div_ceil(2));
    let (hp, wp) = (2 * th_n + 2, 2 * tw_n + 2);
    let pl = hp * wp;
    let rb = block_rows(th_n, oh / 2, tw_n, c, m);
    let ld = (rb * tw_n).div_ceil(16) * 16;
    // Whole blocks of tile rows that all have two output rows; the rest, an odd height's
    // last tile row included, is the tail block (at most `rb` tile rows).
    let full = (oh / 2) / rb;
    let tail = th_n - full * rb;
    let plan = Parts::new(full, tail > 0, 2);
    let f32_buf = |lw: &mut LowerCtx, name: String, elems: usize| {
        lw.program
            .add_buffer(name, BufKind::Arena { offset: 0 }, Ty::F32, elems as u64)
    };
    let xp = f32_buf(lw, format!("{}/wino_padded", lw.name), c * pl);
    // Per slot, the 16 transformed-input matrices side by side, and the 16 GEMM
    // outputs: each transform is then one stream (a register) with 16 displacements,
    // not 16 streams.
    let vb = f32_buf(lw, format!("{}/wino_v", lw.name), plan.parts * 16 * c * ld);
    let mb = f32_buf(lw, format!("{}/wino_m", lw.name), plan.parts * 16 * m * ld);
    let mut k = lw.kernel("");
    let nv = k.var(Ty::I64);
    let mut body = super::pad_planes(&mut k, (x.buf, nv, c), p2, (xp, c * pl), (pl, wp));
    let geo = Geo {
        xp,
        vb,
        mb,
        us: &us,
        out,
        bias,
        ep,
        nv,
        c,
        m,
        pl,
        wp,
        oh,
        ow,
        tw: tw_n,
        ld,
    };
    let last = usize::from(oh % 2 == 1);
    body.extend(plan.emit(&mut k, rb, |k, th0, is_tail, slot| {
        if is_tail {
            geo.block(k, th0, tail - last, last, slot)
        } else {
            geo.block(k, th0, rb, 0, slot)
        }
    }));
    k.body = vec![Stmt::For {
        var: nv,
        extent: nimg as u64,
        body,
    }];
    lw.push(k);
    true
}

impl Geo<'_> {
    /// One block in slot `slot`: tile rows `th0 ..` (`rows` with two output rows, then
    /// `last` (0 or 1) with one), their input transform, 16 GEMMs and output transform.
    fn block(&self, k: &mut Kernel, th0: Expr, rows: usize, last: usize, slot: Expr) -> Vec<Stmt> {
        let n = (rows + last) * self.tw;
        // Slot 0's base is 0, not mul(0, size), in IR dumps.
        let vbase = lin(vec![(slot.clone(), 16 * self.c * self.ld)]);
        let mbase = lin(vec![(slot, 16 * self.m * self.ld)]);
        let mut st = vec![self.input_transform(k, th0.clone(), rows + last, vbase.clone())];
        for (kk, &u) in self.us.iter().enumerate() {
            // The bias enters through matrix 5 (i = j = 1): row and column 1 of A^T are
            // all ones, so each output of a tile receives it exactly once; the output
            // transform then has no per-channel value, and its rows of channels run as
            // one AVX-512 call.
            let init = match self.bias {
                Some(b) if kk == 5 => Some(MatView::strided(b.buf, Expr::Int(0), 1, 0)),
                _ => None,
            };
            st.push(Stmt::Gemm(Box::new(GemmCall {
                m: self.m as u64,
                n: n as u64,
                k: self.c as u64,
                a: MatView::strided(u, Expr::Int(0), self.c as i64, 1),
                b: MatView::strided(
                    self.vb,
                    lin(vec![(vbase.clone(), 1), (int(1), kk * self.c * self.ld)]),
                    self.ld as i64,
                    1,
                ),
                c: MatView::strided(
                    self.mb,
                    lin(vec![(mbase.clone(), 1), (int(1), kk * self.m * self.ld)]),
                    self.ld as i64,
                    1,
                ),
                alpha: 1.0,
                init,
                act: GemmAct::None,
            })));
        }
        // The last tile of a row of odd width has no second column.
        let whole = self.ow / 2;
        for (r0, nr, out_rows) in [(0, rows, 2), (rows, last, 1)] {
            if nr == 0 {
                continue;
            }
            let th = add(th0.clone(), int(r0));
            if whole > 0 {
                st.push(self.output_transform(
                    k,
                    th.clone(),
                    r0,
                    nr,
                    0..whole,
                    out_rows,
                    2,
                    &mbase,
                ));
            }
            if whole < self.tw {
                st.push(self.output_transform(k, th, r0, nr, whole..self.tw, out_rows, 1, &mbase));
            }
        }
        st
    }

    /// `V_k[ci, r tw + q] = (B^T d B)_k` (matrix `k` of the slot at `vbase`, `[16][c][ld]`)
    /// for tile rows `th0 + r`, `r < rows`, `d` the 4x4 patch of padded plane `ci` at row
    /// `2 (th0 + r)`, column `2 q`.
    // The transforms index their 4x4 arrays as the formulas do.
    #[allow(clippy::needless_range_loop)]
    fn input_transform(&self, k: &mut Kernel, th0: Expr, rows: usize, vbase: Expr) -> Stmt {
        let (rv, ci, q) = (k.var(Ty::I64), k.var(Ty::I64), k.var(Ty::I64));
        let (c, ld, tw) = (self.c, self.ld, self.tw);
        let d = |i: usize, j: usize| {
            Expr::load(
                self.xp,
                lin(vec![
                    (th0.clone(), 2 * self.wp),
                    (Expr::Var(rv), 2 * self.wp),
                    (Expr::Var(ci), self.pl),
                    (Expr::Var(q), 2),
                    (int(1), i * self.wp + j),
                ]),
            )
        };
        let mut body = Vec::new();
        // Rows first: t[i][j] = (B^T d)[i][j], each a local.
        let mut t = [[0usize; 4]; 4];
        for j in 0..4 {
            let rows = [
                sub(d(0, j), d(2, j)),
                add(d(1, j), d(2, j)),
                sub(d(2, j), d(1, j)),
                sub(d(1, j), d(3, j)),
            ];
            for (i, value) in rows.into_iter().enumerate() {
                let var = k.var(Ty::F32);
                t[i][j] = var;
                body.push(Stmt::Set { var, value });
            }
        }
        let tv = |i: usize, j: usize| Expr::Var(t[i][j]);
        for i in 0..4 {
            let cols = [
                sub(tv(i, 0), tv(i, 2)),
                add(tv(i, 1), tv(i, 2)),
                sub(tv(i, 2), tv(i, 1)),
                sub(tv(i, 1), tv(i, 3)),
            ];
            for (j, value) in cols.into_iter().enumerate() {
                body.push(Stmt::Store {
                    buf: self.vb,
                    index: lin(vec![
                        (vbase.clone(), 1),
                        (Expr::Var(rv), tw),
                        (Expr::Var(ci), ld),
                        (Expr::Var(q), 1),
                        (int(1), (i * 4 + j) * c * ld),
                    ]),
                    value,
                });
            }
        }
        loops(&[(rv, rows), (ci, c), (q, tw)], body)
            .pop()
            .expect("one nest")
    }

    /// `out[img, co, 2 th + r, 2 tw + cc] = epilogue((A^T M A)[r][cc])` (the bias is in
    /// `M`) for
    /// tile rows `th = th0 + rr` (`rr < nr`, block row `r0 + rr`), tile columns `tws`,
    /// output rows `r < out_rows` and columns `cc < cols`; `M` the slot at `mbase`.
    #[allow(clippy::needless_range_loop, clippy::too_many_arguments)]
    fn output_transform(
        &self,
        k: &mut Kernel,
        th0: Expr,
        r0: usize,
        nr: usize,
        tws: std::ops::Range<usize>,
        out_rows: usize,
        cols: usize,
        mbase: &Expr,
    ) -> Stmt {
        let (rr, co, q) = (k.var(Ty::I64), k.var(Ty::I64), k.var(Ty::I64));
        let (m, ld) = (self.m, self.ld);
        let mv = |i: usize, j: usize| {
            Expr::load(
                self.mb,
                lin(vec![
                    (mbase.clone(), 1),
                    (Expr::Var(rr), self.tw),
                    (Expr::Var(co), ld),
                    (Expr::Var(q), 1),
                    (int(1), (i * 4 + j) * m * ld + r0 * self.tw + tws.start),
                ]),
            )
        };
        let mut body = Vec::new();
        // Rows first: s[r][j] = (A^T M)[r][j], each a local.
        let mut sv = [[0usize; 4]; 2];
        for j in 0..4 {
            let sums = [
                add3(mv(0, j), mv(1, j), mv(2, j)),
                sub(sub(mv(1, j), mv(2, j)), mv(3, j)),
            ];
            for (r, value) in sums.into_iter().enumerate().take(out_rows) {
                let var = k.var(Ty::F32);
                sv[r][j] = var;
                body.push(Stmt::Set { var, value });
            }
        }
        let svv = |r: usize, j: usize| Expr::Var(sv[r][j]);
        let ol = self.oh * self.ow;
        for r in 0..out_rows {
            let ys = [
                add3(svv(r, 0), svv(r, 1), svv(r, 2)),
                sub(sub(svv(r, 1), svv(r, 2)), svv(r, 3)),
            ];
            for (cc, y) in ys.into_iter().enumerate().take(cols) {
                let oy = lin(vec![(th0.clone(), 2), (Expr::Var(rr), 2), (int(1), r)]);
                let ox = lin(vec![(Expr::Var(q), 2), (int(1), 2 * tws.start + cc)]);
                let y = match self.ep {
                    Some(ep) => ep.apply_at(
                        y,
                        Ty::F32,
                        &[Expr::Var(self.nv), Expr::Var(co), oy.clone(), ox.clone()],
                        &self.out.shape,
                    ),
                    None => y,
                };
                body.push(Stmt::Store {
                    buf: self.out.buf,
                    index: lin(vec![
                        (Expr::Var(self.nv), m * ol),
                        (Expr::Var(co), ol),
                        (oy, self.ow),
                        (ox, 1),
                    ]),
                    value: y,
                });
            }
        }
        loops(&[(rr, nr), (co, m), (q, tws.len())], body)
            .pop()
            .expect("one nest")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_rows_fill_panels_within_budget() {
        // ResNet's 64-channel 56x56 layer: 28 tiles a row, 8 KiB a tile.
        let rb = block_rows(28, 28, 28, 64, 64);
        assert!(rb * 28 * 16 * 128 * 4 <= BLOCK_BYTES);
        assert_eq!(rb, 4);
        // Rows too wide for the budget still make blocks of one row.
        assert_eq!(block_rows(10, 10, 500, 256, 256), 1);
        // A small image in two blocks, one a thread.
        assert_eq!(block_rows(4, 4, 4, 8, 8), 2);
        // SqueezeNet's 13x13 (7 tile rows, the last with one output row): 4 and 3.
        assert_eq!(block_rows(7, 6, 7, 64, 256), 4);
    }
}
