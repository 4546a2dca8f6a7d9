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
//! bounds test), then the tiles run in blocks whose 16 transformed inputs and 16 GEMM
//! outputs stay in L2. A block is a run of tiles in row-major order, a multiple of the
//! microkernel's panel width, so it may start and end inside a tile row: the
//! transforms run one loop per tile row the block touches. The input transform reads
//! every other column (stride-2 loads) and writes 16 unit-stride rows; the output
//! transform reads 16 unit-stride rows and writes every other column of two output
//! rows, applying the bias and the fused epilogue on the way.

use super::{Plane, PANEL};
use crate::kir::build::{add, int, lin, sub};
use crate::kir::{BufKind, Expr, GemmAct, GemmCall, Kernel, MatView, Stmt, Ty, VarId};
use crate::ops::lowering::{Epilogue, LowerCtx, TensorRef};

/// Most bytes of one block's transformed input and GEMM output (16 matrices each):
/// with the transformed weights they stay in a 2 MiB L2.
const BLOCK_BYTES: usize = 768 * 1024;

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
    let vals = w.value.as_ref()?.to_f64()?;
    let vals: Vec<f64> = vals.iter().copied().collect();
    if vals.len() != m * c * 9 {
        return None;
    }
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

/// One tile row's share of a block: tile row `th`, tile columns `lo..hi`, at column
/// `col` of the block's matrices.
struct Segment {
    th: usize,
    lo: usize,
    hi: usize,
    col: usize,
}

/// The tile rows that tiles `t0..t1` (row-major, `tw` per row) touch.
fn segments(t0: usize, t1: usize, tw: usize) -> Vec<Segment> {
    (t0 / tw..=(t1 - 1) / tw)
        .map(|th| {
            let lo = t0.max(th * tw) - th * tw;
            let hi = t1.min((th + 1) * tw) - th * tw;
            Segment {
                th,
                lo,
                hi,
                col: th * tw + lo - t0,
            }
        })
        .collect()
}

/// Tiles per block: a multiple of [`PANEL`] within [`BLOCK_BYTES`], the blocks as even
/// as whole panels allow (all tiles in one block when they fit).
fn block_tiles(tiles: usize, c: usize, m: usize) -> usize {
    let per_tile = 16 * (c + m) * 4;
    let most = (BLOCK_BYTES / per_tile / PANEL * PANEL).max(PANEL);
    if tiles <= most {
        return tiles;
    }
    let nblk = tiles.div_ceil(most);
    tiles.div_ceil(nblk).div_ceil(PANEL) * PANEL
}

/// `(a + b) + c` etc.: the transforms' sums of three.
fn add3(a: Expr, b: Expr, c: Expr) -> Expr {
    add(add(a, b), c)
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
    let (il, pl, ol) = (p2.h * p2.w, hp * wp, oh * ow);
    let (ph, pw) = (p2.ph as usize, p2.pw as usize);
    let tiles = th_n * tw_n;
    let tb = block_tiles(tiles, c, m);
    let ld = tb.div_ceil(16) * 16;
    let f32_buf = |lw: &mut LowerCtx, name: String, elems: usize| {
        lw.program
            .add_buffer(name, BufKind::Arena { offset: 0 }, Ty::F32, elems as u64)
    };
    let xp = f32_buf(lw, format!("{}/wino_padded", lw.name), c * pl);
    // The 16 transformed-input matrices side by side in one buffer, and the 16 GEMM
    // outputs in another: each transform is then one stream (a register) with 16
    // displacements, not 16 streams.
    let vb = f32_buf(lw, format!("{}/wino_v", lw.name), 16 * c * ld);
    let mb = f32_buf(lw, format!("{}/wino_m", lw.name), 16 * m * ld);
    let mut k = lw.kernel("");
    let nv = k.var(Ty::I64);
    let var = |k: &mut Kernel| k.var(Ty::I64);
    // The padded planes: zero, then the input rows.
    let zv = var(&mut k);
    let mut body = vec![Stmt::For {
        var: zv,
        extent: (c * pl) as u64,
        body: vec![Stmt::Store {
            buf: xp,
            index: Expr::Var(zv),
            value: Expr::f(0.0, Ty::F32),
        }],
    }];
    let (cv, yv, xv) = (var(&mut k), var(&mut k), var(&mut k));
    let dst = lin(vec![
        (Expr::Var(cv), pl),
        (Expr::Var(yv), wp),
        (Expr::Var(xv), 1),
        (int(1), ph * wp + pw),
    ]);
    let src = lin(vec![
        (Expr::Var(nv), c * il),
        (Expr::Var(cv), il),
        (Expr::Var(yv), p2.w),
        (Expr::Var(xv), 1),
    ]);
    body.extend(crate::kir::build::loops(
        &[(cv, c), (yv, p2.h), (xv, p2.w)],
        vec![crate::kir::build::store(xp, dst, Expr::load(x.buf, src))],
    ));
    let mut t0 = 0;
    while t0 < tiles {
        let t1 = (t0 + tb).min(tiles);
        let segs = segments(t0, t1, tw_n);
        for s in &segs {
            body.push(input_transform(&mut k, s, xp, vb, (c, pl, wp, ld)));
        }
        for (kk, &u) in us.iter().enumerate() {
            body.push(Stmt::Gemm(Box::new(GemmCall {
                m: m as u64,
                n: (t1 - t0) as u64,
                k: c as u64,
                a: MatView::strided(u, Expr::Int(0), c as i64, 1),
                b: MatView::strided(vb, int(kk * c * ld), ld as i64, 1),
                c: MatView::strided(mb, int(kk * m * ld), ld as i64, 1),
                alpha: 1.0,
                init: None,
                act: GemmAct::None,
            })));
        }
        for s in &segs {
            // The last tile of a row of odd width has no second column; the last tile
            // row of an odd height no second row.
            let rows = if 2 * s.th + 1 < oh { 2 } else { 1 };
            let whole = if 2 * s.hi <= ow { s.hi } else { s.hi - 1 };
            let ot = OutTile {
                mb,
                out,
                bias,
                ep,
                ld,
                nv,
                m,
                ol,
                ow,
            };
            if whole > s.lo {
                body.push(ot.transform(&mut k, s, s.lo..whole, rows, 2));
            }
            if whole < s.hi {
                body.push(ot.transform(&mut k, s, whole..s.hi, rows, 1));
            }
        }
        t0 = t1;
    }
    k.body = vec![Stmt::For {
        var: nv,
        extent: nimg as u64,
        body,
    }];
    lw.push(k);
    true
}

/// `V_k[ci, col + q] = (B^T d B)_k` (matrix `k` of `vb`, `[16][c][ld]`) for the tiles
/// of segment `s`, `d` the 4x4 patch of padded plane `ci` at row `2 th`, column
/// `2 (lo + q)`.
// The transforms index their 4x4 arrays as the formulas do.
#[allow(clippy::needless_range_loop)]
fn input_transform(
    k: &mut Kernel,
    s: &Segment,
    xp: usize,
    vb: usize,
    (c, pl, wp, ld): (usize, usize, usize, usize),
) -> Stmt {
    let (ci, q) = (k.var(Ty::I64), k.var(Ty::I64));
    let d = |i: usize, j: usize| {
        Expr::load(
            xp,
            lin(vec![
                (Expr::Var(ci), pl),
                (Expr::Var(q), 2),
                (int(1), (2 * s.th + i) * wp + 2 * s.lo + j),
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
            let at = ((i * 4 + j) * c) * ld + s.col;
            body.push(Stmt::Store {
                buf: vb,
                index: lin(vec![(Expr::Var(ci), ld), (Expr::Var(q), 1), (int(1), at)]),
                value,
            });
        }
    }
    Stmt::For {
        var: ci,
        extent: c as u64,
        body: vec![Stmt::For {
            var: q,
            extent: (s.hi - s.lo) as u64,
            body,
        }],
    }
}

/// What the output transform of every segment shares.
struct OutTile<'a> {
    /// The GEMM outputs, `[16][m][ld]`.
    mb: usize,
    out: &'a TensorRef,
    bias: Option<&'a TensorRef>,
    ep: Option<&'a Epilogue>,
    ld: usize,
    nv: VarId,
    m: usize,
    ol: usize,
    ow: usize,
}

impl OutTile<'_> {
    /// `out[img, co, 2 th + r, 2 tw + cc] = epilogue((A^T M A)[r][cc] + bias[co])` for
    /// the tiles `tws` of segment `s`, output rows `r < rows` and columns `cc < cols`.
    #[allow(clippy::needless_range_loop)]
    fn transform(
        &self,
        k: &mut Kernel,
        s: &Segment,
        tws: std::ops::Range<usize>,
        rows: usize,
        cols: usize,
    ) -> Stmt {
        let (co, q) = (k.var(Ty::I64), k.var(Ty::I64));
        let col = s.col + tws.start - s.lo;
        let mv = |i: usize, j: usize| {
            let at = (i * 4 + j) * self.m * self.ld + col;
            Expr::load(
                self.mb,
                lin(vec![
                    (Expr::Var(co), self.ld),
                    (Expr::Var(q), 1),
                    (int(1), at),
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
            for (r, value) in sums.into_iter().enumerate().take(rows) {
                let var = k.var(Ty::F32);
                sv[r][j] = var;
                body.push(Stmt::Set { var, value });
            }
        }
        let svv = |r: usize, j: usize| Expr::Var(sv[r][j]);
        let tw = add(Expr::Var(q), int(tws.start));
        for r in 0..rows {
            let ys = [
                add3(svv(r, 0), svv(r, 1), svv(r, 2)),
                sub(sub(svv(r, 1), svv(r, 2)), svv(r, 3)),
            ];
            for (cc, y) in ys.into_iter().enumerate().take(cols) {
                let y = match self.bias {
                    Some(b) => add(y, Expr::load(b.buf, Expr::Var(co))),
                    None => y,
                };
                let oy = 2 * s.th + r;
                let ox = add(Expr::mul(tw.clone(), int(2)), int(cc));
                let y = match self.ep {
                    Some(ep) => ep.apply_at(
                        y,
                        Ty::F32,
                        &[Expr::Var(self.nv), Expr::Var(co), int(oy), ox.clone()],
                        &self.out.shape,
                    ),
                    None => y,
                };
                body.push(Stmt::Store {
                    buf: self.out.buf,
                    index: lin(vec![
                        (Expr::Var(self.nv), self.m * self.ol),
                        (Expr::Var(co), self.ol),
                        (ox, 1),
                        (int(1), oy * self.ow),
                    ]),
                    value: y,
                });
            }
        }
        Stmt::For {
            var: co,
            extent: self.m as u64,
            body: vec![Stmt::For {
                var: q,
                extent: tws.len() as u64,
                body,
            }],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segments_cover_the_block_once() {
        // Blocks of 32 tiles over rows of 7: starts and ends inside rows.
        let (tw, tiles) = (7, 75);
        let mut seen = vec![0; tiles];
        let mut t0 = 0;
        while t0 < tiles {
            let t1 = (t0 + 32).min(tiles);
            for s in segments(t0, t1, tw) {
                assert!(s.lo < s.hi && s.hi <= tw);
                for (i, q) in (s.lo..s.hi).enumerate() {
                    let t = s.th * tw + q;
                    assert_eq!(s.col + i, t - t0);
                    seen[t] += 1;
                }
            }
            t0 = t1;
        }
        assert!(seen.iter().all(|&n| n == 1));
    }

    #[test]
    fn blocks_are_whole_panels_within_budget() {
        assert_eq!(block_tiles(20, 64, 64), 20);
        // 64 + 64 channels: 8 KiB a tile, at most 96 tiles a block; 784 tiles in 9
        // blocks of 96 (the last shorter).
        assert_eq!(block_tiles(784, 64, 64), 96);
        let b = block_tiles(196, 128, 128);
        assert!(b.is_multiple_of(PANEL) && b * 16 * 256 * 4 <= BLOCK_BYTES);
    }
}
