//! 3x3 and 5x5 stride-1 convolutions by Winograd's minimal filtering F(2x2, 3x3),
//! F(4x4, 3x3) and F(2x2, 5x5) (Lavin and Gray, "Fast Algorithms for Convolutional
//! Neural Networks", 2016).
//!
//! The output is cut into `r x r` tiles (`r` 2 or 4); tile `(th, tw)` reads the `a x a`
//! input patch at `(r th - ph, r tw - pw)`, `a = r + k - 1` for a `k x k` filter. With
//! `d` the patch, `g` the filter and, for F(2x2, 3x3),
//!
//! ```text
//! B^T = [1  0 -1  0]    G = [1    0    0  ]    A^T = [1 1  1  0]
//!       [0  1  1  0]        [1/2  1/2  1/2]          [0 1 -1 -1]
//!       [0 -1  1  0]        [1/2 -1/2  1/2]
//!       [0  1  0 -1]        [0    0    1  ]
//! ```
//!
//! or, for F(4x4, 3x3),
//!
//! ```text
//! B^T = [4  0 -5  0  1  0]    G = [ 1/4     0     0 ]    A^T = [1 1  1 1  1 0]
//!       [0 -4 -4  1  1  0]        [-1/6  -1/6  -1/6 ]          [0 1 -1 2 -2 0]
//!       [0  4 -4 -1  1  0]        [-1/6   1/6  -1/6 ]          [0 1  1 4  4 0]
//!       [0 -2 -1  2  1  0]        [1/24  1/12   1/6 ]          [0 1 -1 8 -8 1]
//!       [0  2 -1 -2  1  0]        [1/24 -1/12   1/6 ]
//!       [0  4  0 -5  0  1]        [   0     0     1 ]
//! ```
//!
//! or, for F(2x2, 5x5), on the same six points (0, 1, -1, 2, -2 and infinity) and so
//! with the same `B^T`,
//!
//! ```text
//! G = [ 1/4     0     0     0     0 ]    A^T = [1 1  1 1  1 0]
//!     [-1/6  -1/6  -1/6  -1/6  -1/6 ]          [0 1 -1 2 -2 1]
//!     [-1/6   1/6  -1/6   1/6  -1/6 ]
//!     [1/24  1/12   1/6   1/3   2/3 ]
//!     [1/24 -1/12   1/6  -1/3   2/3 ]
//!     [   0     0     0     0     1 ]
//! ```
//!
//! the tile is `Y = A^T [sum over ci of (G g G^T) . (B^T d B)] A`. The sum over input
//! channels of each of the `a^2` elementwise products is a matrix product, so a conv is
//! `a^2` GEMMs `M_k[co, t] = U_k[co, ci] V_k[ci, t]` over the tiles `t`, with
//! `U = G g G^T` computed at compile time: F(2x2) does 16 multiply-adds per tile and
//! channel pair for 4 outputs instead of 36 (2.25x fewer), F(4x4) 36 for 16 outputs
//! instead of 144 (4x fewer), F(2x2, 5x5) 36 for 4 instead of 100 (2.8x fewer), plus
//! an input transform (`V = B^T d B`) and an output transform (`A^T M A`) of additions
//! and multiplications by small constants. The six-point algorithms' larger constants
//! cost accuracy (a relative error of a few 1e-6 against 1e-7), still far inside the
//! 1e-4 the models are held to.
//!
//! Per image: the input is copied into zero-padded planes, one plane at a time (so that
//! no patch needs a bounds test; a parallel job of its own where it is large enough),
//! then the tiles run in blocks of whole tile rows whose `a^2` transformed inputs and
//! GEMM outputs stay in L2: input transform, `a^2` GEMMs, output transform. The tile
//! rows share out into two halves ([`Split`]), each in blocks and with its own scratch
//! slot, so that with threads each core takes one half (one job per conv; the GEMMs run
//! whole inside the tasks) instead of sharing every small GEMM and transform loop; the
//! second half ends with the short tile row, if any. The input transform reads
//! every `r`-th column (on AVX-512: permutes of whole vectors) and writes `a^2`
//! unit-stride rows; the output transform reads `a^2` unit-stride rows and writes every
//! `r`-th column of `r` output rows, applying the bias and the fused epilogue on the way.
//! A conv fused with a 2x2 max pool of stride 2 (`LowerCtx::max_pool_2x2`, even output
//! sides, no narrow last tile) stores instead each 2x2 block's largest value, once, at
//! unit stride: a tile is whole pool windows, so the conv's output is never written.

use super::{Plane, PANEL};
use crate::kir::build::{add, int, lin, loops, mul, sub};
use crate::kir::{
    BinOp, BufKind, CmpOp, Expr, GemmAct, GemmCall, Kernel, MatView, Stmt, Ty, VarId,
};
use crate::ops::lowering::{Epilogue, LowerCtx, TensorRef};

/// Most bytes of one block's transformed input and GEMM output (`a^2` matrices each, one
/// slot). Measured on a 1 MiB-L2 core (A/B, one and two threads): 768 KiB blocks were
/// 9-20% slower than 1 MiB on 64- and 256-channel layers (more blocks of fewer tiles,
/// more panel padding: a 256-channel 14x14 layer ran 21-tile blocks), 1.5 MiB within
/// noise of 1 MiB.
const BLOCK_BYTES: usize = 1024 * 1024;

/// Most bytes of the transformed weights (`a^2` `[m][c]` matrices, `a^2 / 9` times the
/// filter's). Each block reads them all again: past L2 they stream from L3, which still
/// pays with [`MIN_TILES`] tiles or more (ResNet-18's 256-channel 14x14 convs, 4 MiB
/// in F(2x2): 2.24 -> 1.45 ms alone).
const MAX_WEIGHT_BYTES: usize = 8 << 20;

/// Least output tiles per image, each tile a use of every transformed weight: a 512-channel
/// 7x7 conv (16 tiles, 16 MiB of transformed weights) runs no faster than through
/// im2col alone, and in a whole model its weights would not stay in L3; in F(4x4), a
/// 256-channel 14x14 conv (16 tiles) took 1.58 ms against F(2x2)'s 1.31 (49 tiles), a
/// 64 -> 256 13x13 0.47 against 0.37. Above it both win however few the channels (A/B
/// against im2col, one thread): F(4x4) 8 -> 8 on 32x32 0.021 -> 0.012 ms, 16 -> 32 on
/// 28x28 0.090 -> 0.046, 16 -> 64 on 55x55 0.373 (F(2x2)) -> 0.303; F(2x2) 16 -> 32 on
/// 14x14 0.020 -> 0.017, 48 -> 192 on 13x13 0.268 -> 0.214. (Before the matrices were
/// [`SKEW`]ed apart, F(2x2) lost below about 512 K multiply-adds per GEMM.)
const MIN_TILES: usize = 32;

/// Most tile rows (an odd count) for which the two parts split the output channels
/// instead of the tile rows (see [`Split`]).
const CHANNEL_SPLIT_ROWS: usize = 7;

/// Which Winograd algorithm a conv runs: output tiles of `r x r` for a `k x k` filter,
/// F(2x2, 3x3), F(4x4, 3x3) or F(2x2, 5x5).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Wino {
    r: usize,
    k: usize,
}

impl Wino {
    const F2: Wino = Wino { r: 2, k: 3 };
    const F4: Wino = Wino { r: 4, k: 3 };
    const F2K5: Wino = Wino { r: 2, k: 5 };

    /// Input patch side: `r + k - 1`.
    fn a(self) -> usize {
        self.r + self.k - 1
    }

    /// The output tiles of an `oh x ow` plane.
    fn tiles(self, oh: usize, ow: usize) -> usize {
        oh.div_ceil(self.r) * ow.div_ceil(self.r)
    }

    /// `G`, `a x k`, row by row.
    fn g(self) -> Vec<Vec<f64>> {
        const G2: [[f64; 3]; 4] = [
            [1.0, 0.0, 0.0],
            [0.5, 0.5, 0.5],
            [0.5, -0.5, 0.5],
            [0.0, 0.0, 1.0],
        ];
        const G4: [[f64; 3]; 6] = [
            [0.25, 0.0, 0.0],
            [-1.0 / 6.0, -1.0 / 6.0, -1.0 / 6.0],
            [-1.0 / 6.0, 1.0 / 6.0, -1.0 / 6.0],
            [1.0 / 24.0, 1.0 / 12.0, 1.0 / 6.0],
            [1.0 / 24.0, -1.0 / 12.0, 1.0 / 6.0],
            [0.0, 0.0, 1.0],
        ];
        // F(2x2, 5x5) on F(4x4)'s points (0, 1, -1, 2, -2, infinity): row `j` is
        // `p_j^i / prod over l != j of (p_j - p_l)`, the last picks the filter's last tap.
        const G25: [[f64; 5]; 6] = [
            [0.25, 0.0, 0.0, 0.0, 0.0],
            [-1.0 / 6.0, -1.0 / 6.0, -1.0 / 6.0, -1.0 / 6.0, -1.0 / 6.0],
            [-1.0 / 6.0, 1.0 / 6.0, -1.0 / 6.0, 1.0 / 6.0, -1.0 / 6.0],
            [1.0 / 24.0, 1.0 / 12.0, 1.0 / 6.0, 1.0 / 3.0, 2.0 / 3.0],
            [1.0 / 24.0, -1.0 / 12.0, 1.0 / 6.0, -1.0 / 3.0, 2.0 / 3.0],
            [0.0, 0.0, 0.0, 0.0, 1.0],
        ];
        match (self.r, self.k) {
            (2, 3) => G2.iter().map(|r| r.to_vec()).collect(),
            (4, 3) => G4.iter().map(|r| r.to_vec()).collect(),
            _ => G25.iter().map(|r| r.to_vec()).collect(),
        }
    }

    /// `B^T d` for a column `d` of `a` values, factored so that products share sums.
    /// `B^T` depends only on the points, so F(4x4, 3x3) and F(2x2, 5x5) share theirs.
    fn bt(self, d: &[Expr]) -> Vec<Expr> {
        let d = |i: usize| d[i].clone();
        let k = |x: f64| Expr::f(x, Ty::F32);
        if self.a() == 4 {
            return vec![
                sub(d(0), d(2)),
                add(d(1), d(2)),
                sub(d(2), d(1)),
                sub(d(1), d(3)),
            ];
        }
        let (s12, d12) = (add(d(1), d(2)), sub(d(1), d(2)));
        let (d42, d31) = (sub(d(4), d(2)), sub(d(3), d(1)));
        vec![
            add(sub(d(4), mul(d(2), k(5.0))), mul(d(0), k(4.0))),
            sub(add(d(3), d(4)), mul(s12, k(4.0))),
            add(sub(d(4), d(3)), mul(d12, k(4.0))),
            add(d42.clone(), mul(d31.clone(), k(2.0))),
            sub(d42, mul(d31, k(2.0))),
            add(sub(d(5), mul(d(3), k(5.0))), mul(d(1), k(4.0))),
        ]
    }

    /// In how many parts the input transform makes its rows: a 6 x 6 patch's 36 values
    /// do not fit in 32 registers at once.
    fn in_halves(self) -> usize {
        if self.a() == 6 {
            2
        } else {
            1
        }
    }

    /// In how many parts the output transform makes its rows: F(4x4)'s 4 x 6 column
    /// values and 16 outputs in two; F(2x2, 5x5)'s 2 x 6 in one.
    fn out_halves(self) -> usize {
        if self.r == 4 {
            2
        } else {
            1
        }
    }

    /// `A^T m` for a column `m` of `a` values: `r` values.
    fn at(self, m: &[Expr]) -> Vec<Expr> {
        let m = |i: usize| m[i].clone();
        let k = |x: f64| Expr::f(x, Ty::F32);
        if self.a() == 4 {
            return vec![add(add(m(0), m(1)), m(2)), sub(sub(m(1), m(2)), m(3))];
        }
        let (s12, d12) = (add(m(1), m(2)), sub(m(1), m(2)));
        let (s34, d34) = (add(m(3), m(4)), sub(m(3), m(4)));
        if self.r == 2 {
            // F(2x2, 5x5): rows 0 and 1 of F(4x4)'s A^T with the last column as row 1's.
            return vec![
                add(add(m(0), s12), s34),
                add(add(d12, mul(d34, k(2.0))), m(5)),
            ];
        }
        vec![
            add(add(m(0), s12.clone()), s34.clone()),
            add(d12.clone(), mul(d34.clone(), k(2.0))),
            add(s12, mul(s34, k(4.0))),
            add(add(d12, mul(d34, k(8.0))), m(5)),
        ]
    }
}

/// `e / 2` for an even `e` (an output row: a sum of terms whose constants are multiples
/// of the tile size), as the same sum of halved terms (an index expression the
/// vectorisers and the parallel-loop analysis read as affine), or as a division where a
/// term is not of that form.
fn halve(e: &Expr) -> Expr {
    fn go(e: &Expr) -> Option<Expr> {
        match e {
            Expr::Int(x) if x % 2 == 0 => Some(Expr::Int(x / 2)),
            Expr::Bin(BinOp::Add, a, b) => Some(add(go(a)?, go(b)?)),
            Expr::Bin(BinOp::Mul, a, b) => match (&**a, &**b) {
                (x, Expr::Int(c)) | (Expr::Int(c), x) if c % 2 == 0 => Some(if *c == 2 {
                    x.clone()
                } else {
                    mul(x.clone(), Expr::Int(c / 2))
                }),
                _ => None,
            },
            _ => None,
        }
    }
    go(e).unwrap_or_else(|| Expr::bin(BinOp::Div, e.clone(), int(2)))
}

/// Whether a conv runs through [`conv`], and by which algorithm: 3x3 or 5x5, stride 1,
/// no dilation, non-negative pads, enough tiles ([`MIN_TILES`]) and transformed weights
/// within [`MAX_WEIGHT_BYTES`]; a 3x3 in F(4x4) where it qualifies, else F(2x2); a 5x5
/// in F(2x2, 5x5). `ONNXC_NO_WINOGRAD` turns all off, `ONNXC_NO_WINOGRAD4` F(4x4, 3x3)
/// (for comparisons).
pub(super) fn fits(p2: &Plane, c: usize, m: usize) -> Option<Wino> {
    let k = p2.kh;
    let shape = (k == 3 || k == 5)
        && p2.kw == k
        && p2.sh == 1
        && p2.sw == 1
        && p2.dh == 1
        && p2.dw == 1
        && p2.ph >= 0
        && p2.pw >= 0
        && c >= 4
        && m >= 8
        && std::env::var_os("ONNXC_NO_WINOGRAD").is_none();
    if !shape {
        return None;
    }
    let qualifies = |w: Wino| {
        let tiles = w.tiles(p2.oh, p2.ow);
        tiles >= MIN_TILES && w.a() * w.a() * m * c * 4 <= MAX_WEIGHT_BYTES
    };
    if k == 5 {
        return Some(Wino::F2K5).filter(|&w| qualifies(w));
    }
    if qualifies(Wino::F4) && std::env::var_os("ONNXC_NO_WINOGRAD4").is_none() {
        return Some(Wino::F4);
    }
    Some(Wino::F2).filter(|&w| qualifies(w))
}

/// `U_k = G g G^T` for every (co, ci), as `a^2` constant `[m][c]` buffers
/// (`k = a i + j`), computed in f64 and rounded once; `None` when the weights are not
/// constant.
fn weights(lw: &mut LowerCtx, w: &TensorRef, wino: Wino, m: usize, c: usize) -> Option<Vec<usize>> {
    let kw = wino.k;
    let vals = super::const_values(w, m * c * kw * kw)?;
    let (g, a) = (wino.g(), wino.a());
    let mut data: Vec<Vec<u8>> = (0..a * a).map(|_| Vec::with_capacity(4 * m * c)).collect();
    for f in vals.chunks_exact(kw * kw) {
        // gt = G f (a x k), then u = gt G^T (a x a).
        let gt: Vec<Vec<f64>> = g
            .iter()
            .map(|gi| {
                (0..kw)
                    .map(|j| (0..kw).map(|r| gi[r] * f[r * kw + j]).sum())
                    .collect()
            })
            .collect();
        for (i, gti) in gt.iter().enumerate() {
            for (j, gj) in g.iter().enumerate() {
                let u: f64 = (0..kw).map(|r| gti[r] * gj[r]).sum();
                data[i * a + j].extend_from_slice(&(u as f32).to_le_bytes());
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

/// How a conv's tile rows share out: two parts (one where there is one tile row), tile
/// rows `0..s` and `s..th` with `s` half of them rounded up, so that on two threads each
/// core takes one part; the short last tile row (where `oh % r != 0`) ends the second.
/// Each part runs in blocks of nearly equal height, as few as fill the fewest GEMM
/// panels within [`BLOCK_BYTES`].
///
/// Whole blocks used to share out instead, the first part taking the most: SqueezeNet's
/// 55x55 (14 tile rows, blocks of 4) ran as 8 tile rows against 6, the second core idle
/// a third of the conv (199 -> 179 us on two threads, one thread within noise). Splitting
/// an odd count in the middle of a tile row (13x13 in F(2x2) as output rows 7 and 6) did
/// not help: the transforms cost by tile row, not by output row (docs/decisions.md).
///
/// Where an odd count of tile rows would split unevenly (7 as 4 and 3), F(2x2) convs
/// with at least four times as many output channels as input channels also have a split
/// of the output channels ([`Split::channels`]), each part running every tile row with
/// half the GEMM rows and output transforms and the whole input transform. The kernel
/// picks it at run time when a `parallel_for` hook is present ([`Kernel::threaded`]);
/// on one thread the input transform would run twice. SqueezeNet's 13x13 expand3x3
/// layers (48 -> 192, 64 -> 256) on two threads: 128-205 -> 105-180 us each, the model
/// -4%; on one thread within noise. ResNet-shaped convs (as many input channels as
/// output) were 6-13% slower split by channels on two threads, F(4x4)'s 32 -> 128 on
/// 27x27 even.
struct Split {
    r: usize,
    s: usize,
    /// Per part: tile rows, blocks.
    parts: Vec<(usize, usize)>,
    /// The output rows of the short last tile row (0: none).
    short: usize,
    /// Output channels per part: all `m`, or `m / 2` where the two parts split the
    /// channels instead ([`Split::channels`]).
    chans: usize,
    /// Whether the parts split the channels: each then runs every tile row, in the
    /// blocks of the tile rows' parts one after the other.
    by_channels: bool,
}

impl Split {
    /// Two parts of tile rows (one where there is one tile row).
    fn new(wino: Wino, (oh, tw): (usize, usize), (c, m): (usize, usize)) -> Split {
        let th = oh.div_ceil(wino.r);
        let blocks = Split::blocks(wino, tw, c + m);
        let s = th.div_ceil(2);
        let mut parts = vec![(s, blocks(s))];
        if th > s {
            parts.push((th - s, blocks(th - s)));
        }
        Split {
            r: wino.r,
            s,
            parts,
            short: oh % wino.r,
            chans: m,
            by_channels: false,
        }
    }

    /// Two parts of half the output channels each, every tile row in both (in the same
    /// blocks as [`Split::new`]'s, so that every output is computed as there, bit for
    /// bit), where the tile rows would split unevenly and the channels evenly: F(2x2)
    /// with an odd count of at most [`CHANNEL_SPLIT_ROWS`] tile rows, `m` even and at
    /// least 4 `c` (each part transforms the whole input, `c` channels).
    fn channels(wino: Wino, (oh, tw): (usize, usize), (c, m): (usize, usize)) -> Option<Split> {
        let th = oh.div_ceil(wino.r);
        let fits = wino == Wino::F2 && th % 2 == 1 && th <= CHANNEL_SPLIT_ROWS;
        if !fits || m % 2 != 0 || 4 * c > m {
            return None;
        }
        Some(Split {
            chans: m / 2,
            by_channels: true,
            ..Split::new(wino, (oh, tw), (c, m))
        })
    }

    /// The blocks for `n` tile rows of `tw` tiles, `rows` input and output channels: the
    /// fewest GEMM columns (panel padding, a panel more a block) within [`BLOCK_BYTES`],
    /// then the fewest blocks.
    fn blocks(wino: Wino, tw: usize, rows: usize) -> impl Fn(usize) -> usize {
        let per_tile = wino.a() * wino.a() * rows * 4;
        let most = (BLOCK_BYTES / per_tile / tw).max(1);
        let pad = |t: usize| t.div_ceil(PANEL) * PANEL;
        move |n: usize| {
            (n.div_ceil(most)..=n)
                .min_by_key(|&b| {
                    let (q, rem) = (n / b, n % b);
                    rem * pad((q + 1) * tw) + (b - rem) * pad(q * tw) + b * PANEL
                })
                .unwrap_or(1)
        }
    }

    /// The most tile rows of a block.
    fn most_rows(&self) -> usize {
        self.parts
            .iter()
            .map(|&(n, b)| n.div_ceil(b))
            .max()
            .unwrap_or(1)
    }

    /// `for p in 0..parts { part p's blocks }`, `block(k, first output row, rows, short,
    /// slot, first output channel)` making each block (`rows` tile rows of `r` output
    /// rows, then one of `short` rows where `short > 0`). Rows address through `p` (part
    /// `p` starts at tile row `p s`) so that the parallel-loop analysis sees every access
    /// as `p` times one stride plus less; split by channels, part `p` runs every tile-row
    /// part's blocks for channels from `p chans`, its slot (and so its channels' stores,
    /// see [`Geo::block`]) addressed through `p`.
    fn emit(
        &self,
        k: &mut Kernel,
        mut block: impl FnMut(&mut Kernel, Expr, usize, usize, Expr, usize) -> Vec<Stmt>,
    ) -> Vec<Stmt> {
        let pv = k.var(Ty::I64);
        let np = self.parts.len();
        let slot = if np == 1 && !self.by_channels {
            int(0)
        } else {
            Expr::Var(pv)
        };
        let mut bodies = Vec::new();
        if self.by_channels {
            // Each half of the channels (its first a constant: the weights' offset) runs
            // the tile rows' parts from their constant first rows.
            for half in 0..2 {
                let mut st = Vec::new();
                for p in 0..np {
                    let first = int(p * self.s * self.r);
                    let ch0 = half * self.chans;
                    st.extend(self.part(k, &mut block, p, first, &slot, ch0));
                }
                bodies.push(st);
            }
        } else {
            let first = lin(vec![(slot.clone(), self.s * self.r)]);
            for p in 0..np {
                bodies.push(self.part(k, &mut block, p, first.clone(), &slot, 0));
            }
        }
        if bodies.len() == 1 {
            return bodies.pop().unwrap_or_default();
        }
        let rest = bodies.pop().unwrap_or_default();
        let first = bodies.pop().unwrap_or_default();
        loops(
            &[(pv, 2)],
            vec![Stmt::If {
                cond: Expr::cmp(CmpOp::Lt, Expr::Var(pv), int(1)),
                then: first,
                els: rest,
            }],
        )
    }

    /// The blocks of tile-row part `p`, whose first output row is `first`, in `slot`,
    /// for the output channels from `ch0` (see [`Split::emit`]).
    fn part(
        &self,
        k: &mut Kernel,
        block: &mut impl FnMut(&mut Kernel, Expr, usize, usize, Expr, usize) -> Vec<Stmt>,
        p: usize,
        first: Expr,
        slot: &Expr,
        ch0: usize,
    ) -> Vec<Stmt> {
        let r = self.r;
        let (n, b) = self.parts[p];
        let short = if p == self.parts.len() - 1 {
            self.short
        } else {
            0
        };
        let (q, rem) = (n / b, n % b);
        let mut st = Vec::new();
        // `count` blocks of `h` whole tile rows from tile row `at` of the part.
        let mut run = |k: &mut Kernel, st: &mut Vec<Stmt>, at: usize, count: usize, h: usize| {
            if count == 0 {
                return;
            }
            let g = k.var(Ty::I64);
            let gi = if count == 1 { int(0) } else { Expr::Var(g) };
            let row0 = lin(vec![(first.clone(), 1), (gi, h * r), (int(1), at * r)]);
            let inner = block(k, row0, h, 0, slot.clone(), ch0);
            if count == 1 {
                st.extend(inner);
            } else {
                st.extend(loops(&[(g, count)], inner));
            }
        };
        run(k, &mut st, 0, rem, q + 1);
        let plain = b - rem - usize::from(short > 0);
        run(k, &mut st, rem * (q + 1), plain, q);
        if short > 0 {
            let row0 = lin(vec![(first, 1), (int(1), (n - q) * r)]);
            st.extend(block(k, row0, q - 1, short, slot.clone(), ch0));
        }
        st
    }
}

/// The shapes every block of one conv shares.
struct Geo<'a> {
    wino: Wino,
    xp: usize,
    vb: usize,
    mb: usize,
    us: &'a [usize],
    out: &'a TensorRef,
    /// The output is the 2x2 max pool of stride 2 of the conv's (after the epilogue):
    /// each 2x2 block of a tile stores its largest value ([`Geo::output_transform`]).
    pool: bool,
    bias: Option<&'a TensorRef>,
    ep: Option<&'a Epilogue>,
    nv: VarId,
    c: usize,
    m: usize,
    /// Output channels per part ([`Split::chans`]).
    chans: usize,
    /// Output channels per GEMM: half of them in both splits where the conv can split
    /// the channels, so that the two splits read the same packed weights (the object
    /// holds each half once, not the whole matrix beside them).
    gemm_rows: usize,
    /// Padded plane size and row length.
    pl: usize,
    wp: usize,
    /// F(4x4): the length of each of a padded row's four column phases (see
    /// [`pad_phases`]); 0 for F(2x2)'s plain rows.
    seg: usize,
    oh: usize,
    ow: usize,
    /// Tiles per row.
    tw: usize,
    /// Row stride of the block matrices (a slot of `vb` is `a^2` matrices of `c` rows,
    /// each [`Geo::vk`] elements from the next; of `mb`, `m` rows, [`Geo::mk`]).
    ld: usize,
    /// Where the output width is not a multiple of `r` (see [`Geo::output_transform`]).
    narrow: Option<Narrow>,
}

/// The narrow last tile of a row: its columns (`ow % r`), and the buffer where the
/// output transform writes columns `x >= ow % r` of every tile first, `slot` elements
/// per slot (per tile row of a block, channel, output row and such column, one value
/// per tile).
#[derive(Clone, Copy)]
struct Narrow {
    cols: usize,
    buf: usize,
    slot: usize,
}

/// Elements between consecutive transform matrices past their rows: one cache line.
/// Without it the `a^2` vectors a transform reads or writes for one tile lie a multiple
/// of 4 KiB apart (whole 64-row matrices of 64 elements) in one set of an 8-way L1:
/// F(4x4)'s 36 evicted each other. A 64-channel 56x56 conv (F(4x4)): 1.03 -> 0.80 ms,
/// its transforms and padding copy 0.46 -> 0.22 ms; a 256-channel 14x14 (F(2x2)):
/// 1.34 -> 1.29 ms.
const SKEW: usize = 16;

/// Lowers the conv (see the module doc); `false` when the weights are not constant.
#[allow(clippy::too_many_arguments)]
pub(super) fn conv(
    lw: &mut LowerCtx,
    wino: Wino,
    p2: &Plane,
    x: &TensorRef,
    w: &TensorRef,
    bias: Option<&TensorRef>,
    (out, pool): (&TensorRef, bool),
    ep: Option<&Epilogue>,
    (nimg, c, m): (usize, usize, usize),
) -> bool {
    let (r, mats) = (wino.r, wino.a() * wino.a());
    let (oh, ow) = (p2.oh, p2.ow);
    // Pooling takes whole 2x2 blocks of whole tiles: even sides, no narrow last tile (a
    // short last tile row is even then: `oh % r` of 0 or 2).
    if pool && (oh % 2 != 0 || ow % r != 0 || out.shape[..] != [nimg, m, oh / 2, ow / 2]) {
        return false;
    }
    let Some(us) = weights(lw, w, wino, m, c) else {
        return false;
    };
    let (th_n, tw_n) = (oh.div_ceil(r), ow.div_ceil(r));
    // The tile rows in two parts; where they split unevenly and a run has threads, the
    // channels instead (chosen at run time: on one thread the rows' split is faster, the
    // input transform running once).
    let rows_split = Split::new(wino, (oh, tw_n), (c, m));
    let chan_split = Split::channels(wino, (oh, tw_n), (c, m));
    let splits: Vec<&Split> = std::iter::once(&rows_split).chain(&chan_split).collect();
    // F(4x4) reads its patches from padded rows split into column phases, F(2x2) from
    // plain padded rows.
    let seg = if r == 4 { tw_n + 1 } else { 0 };
    let halo = wino.k - 1;
    let (hp, wp) = (
        r * th_n + halo,
        if seg > 0 { 4 * seg } else { r * tw_n + halo },
    );
    let pl = hp * wp;
    let ld = |s: &Split| (s.most_rows() * tw_n).div_ceil(16) * 16;
    // The narrow columns' slot (see [`Narrow`]).
    let cols = ow % r;
    let narrow_slot = |s: &Split| s.most_rows() * s.chans * r * (r - cols) * tw_n;
    let most = |f: &dyn Fn(&Split) -> usize| splits.iter().map(|s| f(s)).max().unwrap_or(0);
    let f32_buf = |lw: &mut LowerCtx, name: String, elems: usize| {
        lw.program
            .add_buffer(name, BufKind::Arena { offset: 0 }, Ty::F32, elems as u64)
    };
    let xp = f32_buf(lw, format!("{}/wino_padded", lw.name), c * pl);
    // Per slot, the transformed-input matrices side by side, and the GEMM outputs: each
    // transform is then one stream (a register) with `a^2` displacements, not `a^2`
    // streams.
    let vb = f32_buf(
        lw,
        format!("{}/wino_v", lw.name),
        most(&|s| s.parts.len() * mats * (c * ld(s) + SKEW)),
    );
    let mb = f32_buf(
        lw,
        format!("{}/wino_m", lw.name),
        most(&|s| s.parts.len() * mats * (s.chans * ld(s) + SKEW)),
    );
    let narrow_buf = (cols != 0).then(|| {
        let name = format!("{}/wino_narrow", lw.name);
        f32_buf(lw, name, most(&|s| s.parts.len() * narrow_slot(s)))
    });
    let mut k = lw.kernel("");
    let nv = k.var(Ty::I64);
    let mut body = if seg > 0 {
        pad_phases(&mut k, (x.buf, nv, c), p2, xp, (pl, wp, seg))
    } else {
        super::pad_planes(&mut k, (x.buf, nv, c), p2, (xp, c * pl), (pl, wp))
    };
    let geo = |s: &Split| Geo {
        wino,
        xp,
        vb,
        mb,
        us: &us,
        out,
        pool,
        bias,
        ep,
        nv,
        c,
        m,
        chans: s.chans,
        gemm_rows: chan_split.as_ref().map_or(m, |cs| cs.chans),
        pl,
        wp,
        seg,
        oh,
        ow,
        tw: tw_n,
        ld: ld(s),
        narrow: narrow_buf.map(|buf| Narrow {
            cols,
            buf,
            slot: narrow_slot(s),
        }),
    };
    let emit = |k: &mut Kernel, s: &Split| {
        let g = geo(s);
        s.emit(k, |k, row0, rows, short, slot, ch0| {
            g.block(k, row0, rows, short, slot, ch0)
        })
    };
    let by_rows = emit(&mut k, &rows_split);
    match &chan_split {
        Some(cs) => {
            let by_chans = emit(&mut k, cs);
            let threaded = k.threaded();
            body.push(Stmt::If {
                cond: Expr::Var(threaded),
                then: by_chans,
                els: by_rows,
            });
        }
        None => body.extend(by_rows),
    }
    k.body = vec![Stmt::For {
        var: nv,
        extent: nimg as u64,
        body,
    }];
    lw.push(k);
    true
}

/// The column pass of a transform: for every column `j < a` of the values `at(i, j)`,
/// rows `rows` of `f(column)` (`B^T d` or `A^T M`), each set as a local in `body`; the
/// locals by row and column (rows outside `rows` hold 0).
#[allow(clippy::needless_range_loop)]
fn columns(
    k: &mut Kernel,
    body: &mut Vec<Stmt>,
    a: usize,
    rows: std::ops::Range<usize>,
    at: impl Fn(usize, usize) -> Expr,
    f: impl Fn(&[Expr]) -> Vec<Expr>,
) -> Vec<Vec<Expr>> {
    let mut t = vec![vec![Expr::Int(0); a]; rows.end];
    for j in 0..a {
        let col: Vec<Expr> = (0..a).map(|i| at(i, j)).collect();
        for (i, value) in f(&col).into_iter().enumerate() {
            if rows.contains(&i) {
                let var = k.var(Ty::F32);
                t[i][j] = Expr::Var(var);
                body.push(Stmt::Set { var, value });
            }
        }
    }
    t
}

/// [`super::pad_planes`] for F(4x4): image `img` of `x` (`c` planes) copied into
/// zero-padded planes (`c` of them from `xp`, `pl` elements apart, each zeroed and then
/// copied into, one loop over the planes) whose rows of `wp` elements are four column
/// phases of `seg` each: padded column `4 u + p` at `p seg + u`. The input transform's
/// loads are then unit-stride (tile `q` reads `q`, `q + 1` of a phase) instead of every
/// fourth element; this copy reads every fourth element once.
fn pad_phases(
    k: &mut Kernel,
    (x, img, c): (usize, VarId, usize),
    p2: &Plane,
    xp: usize,
    (pl, wp, seg): (usize, usize, usize),
) -> Vec<Stmt> {
    let il = p2.h * p2.w;
    let (ph, pw) = (p2.ph as usize, p2.pw as usize);
    let cv = k.var(Ty::I64);
    let mut plane = super::zero_range(k, xp, lin(vec![(Expr::Var(cv), pl)]), pl);
    for p in 0..4 {
        // Input columns x = 4 u + p - pw for u in u0..u1.
        let u0 = pw.saturating_sub(p).div_ceil(4);
        let u1 = (p2.w + pw).saturating_sub(p).div_ceil(4);
        if u1 <= u0 {
            continue;
        }
        let (yv, uv) = (k.var(Ty::I64), k.var(Ty::I64));
        let dst = lin(vec![
            (Expr::Var(cv), pl),
            (Expr::Var(yv), wp),
            (Expr::Var(uv), 1),
            (int(1), ph * wp + p * seg + u0),
        ]);
        let src = lin(vec![
            (Expr::Var(img), c * il),
            (Expr::Var(cv), il),
            (Expr::Var(yv), p2.w),
            (Expr::Var(uv), 4),
            (int(1), 4 * u0 + p - pw),
        ]);
        plane.extend(loops(
            &[(yv, p2.h), (uv, u1 - u0)],
            vec![Stmt::Store {
                buf: xp,
                index: dst,
                value: Expr::load(x, src),
            }],
        ));
    }
    loops(&[(cv, c)], plane)
}

impl Geo<'_> {
    /// Elements from one transformed-input matrix to the next.
    fn vk(&self) -> usize {
        self.c * self.ld + SKEW
    }

    /// Elements from one GEMM output matrix to the next.
    fn mk(&self) -> usize {
        self.chans * self.ld + SKEW
    }

    /// One block in slot `slot`: the tile rows from output row `row0` (`rows` with `r`
    /// output rows, then one with `short` where `short > 0`), their input transform, `a^2`
    /// GEMMs and output transform, for output channels `ch0..ch0 + chans` (where the
    /// parts split the channels, `ch0` is the slot times `chans`: written through the
    /// slot, so that each part's stores are affine in it).
    fn block(
        &self,
        k: &mut Kernel,
        row0: Expr,
        rows: usize,
        short: usize,
        slot: Expr,
        ch0: usize,
    ) -> Vec<Stmt> {
        let last = usize::from(short > 0);
        let (r, a) = (self.wino.r, self.wino.a());
        let n = (rows + last) * self.tw;
        // Slot 0's base is 0, not mul(0, size), in IR dumps.
        let vbase = lin(vec![(slot.clone(), a * a * self.vk())]);
        let mbase = lin(vec![(slot.clone(), a * a * self.mk())]);
        let nbase = lin(vec![(slot.clone(), self.narrow.map_or(0, |n| n.slot))]);
        let cbase = if self.chans < self.m {
            lin(vec![(slot, self.chans)])
        } else {
            int(0)
        };
        let mut st = vec![self.input_transform(k, row0.clone(), rows + last, vbase.clone())];
        // One GEMM per matrix and group of `gemm_rows` channels.
        let groups = (0..self.chans).step_by(self.gemm_rows);
        for (kk, g0) in (0..self.us.len()).flat_map(|kk| groups.clone().map(move |g| (kk, g))) {
            let co = ch0 + g0;
            // The bias enters through matrix (1, 1): row and column 1 of A^T are all
            // ones, so each output of a tile receives it exactly once; the output
            // transform then has no per-channel value, and its rows of channels run as
            // one AVX-512 call.
            let init = match self.bias {
                Some(b) if kk == a + 1 => Some(MatView::strided(b.buf, int(co), 1, 0)),
                _ => None,
            };
            st.push(Stmt::Gemm(Box::new(GemmCall {
                m: self.gemm_rows as u64,
                n: n as u64,
                k: self.c as u64,
                a: MatView::strided(self.us[kk], int(co * self.c), self.c as i64, 1),
                b: MatView::strided(
                    self.vb,
                    lin(vec![(vbase.clone(), 1), (int(1), kk * self.vk())]),
                    self.ld as i64,
                    1,
                ),
                c: MatView::strided(
                    self.mb,
                    lin(vec![
                        (mbase.clone(), 1),
                        (int(1), kk * self.mk() + g0 * self.ld),
                    ]),
                    self.ld as i64,
                    1,
                ),
                alpha: 1.0,
                init,
                add: None,
                act: GemmAct::None,
                int8: false,
            })));
        }
        for (r0, nr, out_rows) in [(0, rows, r), (rows, last, short)] {
            if nr == 0 {
                continue;
            }
            let row = add(row0.clone(), int(r0 * r));
            let bases = (&mbase, &nbase, &cbase);
            st.extend(self.output_transform(k, row, r0, nr, out_rows, bases));
        }
        st
    }

    /// `V_k[ci, rv tw + q] = (B^T d B)_k` (matrix `k` of the slot at `vbase`,
    /// `[a^2][c][ld]`) for the tile rows from output row `row0`, `rv < rows`, `d` the
    /// `a x a` patch of padded plane `ci` at row `row0 + r rv`, column `r q`. Tile rows
    /// inside channels (one call per channel), so that each call's stores fill `V`'s
    /// lines in order, as the output transform's loads read `M`'s.
    // The transforms index their arrays as the formulas do.
    #[allow(clippy::needless_range_loop)]
    fn input_transform(&self, k: &mut Kernel, row0: Expr, rows: usize, vbase: Expr) -> Stmt {
        let (rv, ci, q) = (k.var(Ty::I64), k.var(Ty::I64), k.var(Ty::I64));
        let (c, ld, tw) = (self.c, self.ld, self.tw);
        let (r, a) = (self.wino.r, self.wino.a());
        // Column j of tile q: element r q + j of a plain row, or element q + j / 4 of
        // phase j % 4 (unit stride in q).
        let qs = if self.seg > 0 { 1 } else { r };
        let d = |i: usize, j: usize| {
            let col = if self.seg > 0 {
                (j % 4) * self.seg + j / 4
            } else {
                j
            };
            Expr::load(
                self.xp,
                lin(vec![
                    (row0.clone(), self.wp),
                    (Expr::Var(rv), r * self.wp),
                    (Expr::Var(ci), self.pl),
                    (Expr::Var(q), qs),
                    (int(1), i * self.wp + col),
                ]),
            )
        };
        let vat = |i: usize, j: usize| {
            lin(vec![
                (vbase.clone(), 1),
                (Expr::Var(rv), tw),
                (Expr::Var(ci), ld),
                (Expr::Var(q), 1),
                (int(1), (i * a + j) * self.vk()),
            ])
        };
        let mut body = Vec::new();
        // Columns first: t[i][j] = (B^T d)[i][j], each a local, then V row by row. A 6 x 6
        // patch's 36 would not fit in 32 registers: its rows of t are made in two halves,
        // each half from the columns' loads it needs (d rows 0..5 and 1..6).
        let halves = self.wino.in_halves();
        for h in 0..halves {
            let is = h * a / halves..(h + 1) * a / halves;
            let t = columns(k, &mut body, a, is.clone(), d, |col| self.wino.bt(col));
            for i in is {
                for (j, value) in self.wino.bt(&t[i]).into_iter().enumerate() {
                    body.push(Stmt::Store {
                        buf: self.vb,
                        index: vat(i, j),
                        value,
                    });
                }
            }
        }
        loops(&[(ci, c), (rv, rows), (q, tw)], body)
            .pop()
            .expect("one nest")
    }

    /// `out[img, co, row0 + r rr + y, r tw + x] = epilogue((A^T M A)[y][x])` (the bias is
    /// in `M`) for the tile rows from output row `row0` (`rr < nr`, block row `r0 + rr`),
    /// every tile column and output rows `y < out_rows`; `M` the slot at `mbase`. One loop
    /// over a row's tiles (the AVX-512 lanes), inside the tile rows, inside channels (one
    /// call per channel): a channel's rows of `M` lie side by side (`rr tw + q`), so each
    /// cache line of the 16 matrices is read once. With channels inside tile rows, each
    /// call read a row's few tiles from every channel's lines and the next call the same
    /// lines again from L2 (the small CNN's 16 -> 32 on 14x14: 7 of every 32 floats per
    /// line and call; its transforms 7.7 -> 5.4 us).
    ///
    /// Where the last tile of a row is narrower (`ow % r` columns), columns `x >= ow %
    /// r` of every tile go to the slot of the narrow columns' buffer at `nbase` instead
    /// (unit stride, every tile), and a second loop over all tiles but the last moves
    /// them to the output through the epilogue. Before, the narrow tile had a loop of its
    /// own, one iteration long, which kept its nest scalar: 15% of a 16 -> 64 conv on
    /// 55x55 (F(4x4), 13 whole tiles and one of 3 columns per row).
    #[allow(clippy::needless_range_loop, clippy::too_many_arguments)]
    fn output_transform(
        &self,
        k: &mut Kernel,
        row0: Expr,
        r0: usize,
        nr: usize,
        out_rows: usize,
        (mbase, nbase, cbase): (&Expr, &Expr, &Expr),
    ) -> Vec<Stmt> {
        let (rr, co, q) = (k.var(Ty::I64), k.var(Ty::I64), k.var(Ty::I64));
        let (m, ld, tw) = (self.m, self.ld, self.tw);
        // The output channel.
        let oc = lin(vec![(Expr::Var(co), 1), (cbase.clone(), 1)]);
        let (r, a) = (self.wino.r, self.wino.a());
        let cols = self.narrow.map_or(r, |n| n.cols);
        let mv = |i: usize, j: usize| {
            Expr::load(
                self.mb,
                lin(vec![
                    (mbase.clone(), 1),
                    (Expr::Var(rr), tw),
                    (Expr::Var(co), ld),
                    (Expr::Var(q), 1),
                    (int(1), (i * a + j) * self.mk() + r0 * tw),
                ]),
            )
        };
        // Narrow column `x` of output row `y` of tile `q`, channel `co`, tile row `rr`.
        let nidx = |y: usize, x: usize| {
            lin(vec![
                (nbase.clone(), 1),
                (Expr::Var(rr), self.chans * r * (r - cols) * tw),
                (Expr::Var(co), r * (r - cols) * tw),
                (Expr::Var(q), 1),
                (int(1), (y * (r - cols) + x - cols) * tw),
            ])
        };
        // Output row y, column x of the tile: the conv's (before the pool) coordinates.
        let oyx = |y: usize, x: usize| {
            (
                lin(vec![(row0.clone(), 1), (Expr::Var(rr), r), (int(1), y)]),
                lin(vec![(Expr::Var(q), r), (int(1), x)]),
            )
        };
        let full_shape = [self.out.shape[0], m, self.oh, self.ow];
        let epilogue = |y: usize, x: usize, v: Expr| {
            let (oy, ox) = oyx(y, x);
            match self.ep {
                Some(ep) => {
                    let at = [Expr::Var(self.nv), oc.clone(), oy, ox];
                    ep.apply_at(v, Ty::F32, &at, &full_shape)
                }
                None => v,
            }
        };
        // The stored tensor's row length and plane, its first row, and a tile's rows and
        // columns in it.
        let (sw, sl, srow0, sr) = match self.pool {
            true => (self.ow / 2, self.oh * self.ow / 4, halve(&row0), r / 2),
            false => (self.ow, self.oh * self.ow, row0.clone(), r),
        };
        // Stores row y, column x of the tile (pooled: of the tile's 2x2 blocks).
        let store = |y: usize, x: usize, v: Expr| Stmt::Store {
            buf: self.out.buf,
            index: lin(vec![
                (Expr::Var(self.nv), m * sl),
                (Expr::Var(co), sl),
                (cbase.clone(), sl),
                (srow0.clone(), sw),
                (Expr::Var(rr), sr * sw),
                (int(1), y * sw),
                (Expr::Var(q), sr),
                (int(1), x),
            ]),
            value: v,
        };
        let store_out = |y: usize, x: usize, v: Expr| store(y, x, epilogue(y, x, v));
        let mut body = Vec::new();
        // Columns first: s[y][j] = (A^T M)[y][j], each a local, then the output row by
        // row; F(4x4)'s in two halves of output rows (as the input transform's).
        let halves = self.wino.out_halves();
        for h in 0..halves {
            let ys = (h * r / halves).min(out_rows)..((h + 1) * r / halves).min(out_rows);
            let sv = columns(k, &mut body, a, ys.clone(), mv, |col| self.wino.at(col));
            if self.pool {
                // Each 2x2 block's largest value after the epilogue (as MaxPool takes
                // it), stored once: the conv's output is never written.
                let vals: Vec<Vec<Expr>> = ys.clone().map(|y| self.wino.at(&sv[y])).collect();
                for y in ys.clone().step_by(2) {
                    for x in (0..r).step_by(2) {
                        let taps = [(y, x), (y, x + 1), (y + 1, x), (y + 1, x + 1)]
                            .map(|(ty, tx)| epilogue(ty, tx, vals[ty - ys.start][tx].clone()));
                        let v = crate::ops::pool::max_of(k, &mut body, taps.to_vec());
                        body.push(store(y / 2, x / 2, v));
                    }
                }
                continue;
            }
            for y in ys {
                for (x, v) in self.wino.at(&sv[y]).into_iter().enumerate() {
                    body.push(match self.narrow {
                        Some(n) if x >= cols => Stmt::Store {
                            buf: n.buf,
                            index: nidx(y, x),
                            value: v,
                        },
                        _ => store_out(y, x, v),
                    });
                }
            }
        }
        let mut st = loops(&[(co, self.chans), (rr, nr), (q, tw)], body);
        if let Some(n) = self.narrow.filter(|_| tw > 1) {
            let mut moves = Vec::new();
            for y in 0..out_rows {
                for x in cols..r {
                    moves.push(store_out(y, x, Expr::load(n.buf, nidx(y, x))));
                }
            }
            st.extend(loops(&[(rr, nr), (co, self.chans), (q, tw - 1)], moves));
        }
        st
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_halves_the_tile_rows_in_blocks_within_budget() {
        let (f2, f4) = (Wino::F2, Wino::F4);
        let per_tile = |w: Wino, (c, m): (usize, usize)| w.a() * w.a() * (c + m) * 4;
        // SqueezeNet's 16 -> 64 on 55x55 in F(4x4): 14 tile rows of 14, the last of 3
        // output rows: 7 and 7, each in blocks of 4 and 3 (most 6 in the budget).
        let s = Split::new(f4, (55, 14), (16, 64));
        assert_eq!(
            (s.s, s.parts.clone(), s.short),
            (7, vec![(7, 2), (7, 2)], 3)
        );
        assert_eq!(s.most_rows(), 4);
        // ResNet's 64-channel 56x56: 7 and 7 tile rows, blocks of at most 4 tile rows.
        let s = Split::new(f4, (56, 14), (64, 64));
        assert_eq!(
            (s.s, s.parts.clone(), s.short),
            (7, vec![(7, 2), (7, 2)], 0)
        );
        assert!(s.most_rows() * 14 * per_tile(f4, (64, 64)) <= BLOCK_BYTES);
        // SqueezeNet's 13x13 in F(2x2): 4 tile rows and 3, the last of one output row.
        let s = Split::new(f2, (13, 7), (64, 256));
        assert_eq!(
            (s.s, s.parts.clone(), s.short),
            (4, vec![(4, 1), (3, 1)], 1)
        );
        // On threads, its channels instead: two halves of 128, each every tile row in
        // the same blocks.
        let s = Split::channels(f2, (13, 7), (64, 256)).expect("channel split");
        assert_eq!(
            (s.s, s.parts.clone(), s.short, s.chans, s.by_channels),
            (4, vec![(4, 1), (3, 1)], 1, 128, true)
        );
        // Not: an even count of tile rows, F(4x4), fewer than 4 c output channels, or an
        // odd count.
        assert!(Split::channels(f2, (16, 8), (64, 256)).is_none());
        assert!(Split::channels(f4, (27, 7), (32, 128)).is_none());
        assert!(Split::channels(f2, (13, 7), (256, 256)).is_none());
        assert!(Split::channels(f2, (13, 7), (16, 65)).is_none());
        // Rows too wide for the budget make blocks of one tile row.
        let s = Split::new(f2, (20, 500), (256, 256));
        assert_eq!((s.parts.clone(), s.most_rows()), (vec![(5, 5), (5, 5)], 1));
        // One tile row: one part.
        let s = Split::new(f4, (3, 40), (8, 8));
        assert_eq!((s.s, s.parts.clone(), s.short), (1, vec![(1, 1)], 3));
    }
}
