//! Host references: the definition of what every mHC kernel computes (DESIGN.md 3.3).
//!
//! The math is §6 of the spec; the *order* of every f32 operation is the device kernels' (see the
//! head of `kernels.cu`), so a GPU result differs from these only where `expf` does (a few ulp in
//! the gates). The CPU backend runs exactly these functions in place of the kernels.
//!
//! Per token, with `x` the `[n, H]` residual row in f32:
//! - **Projection.** `h` is cut into quads of [`QUAD`] (4); split `s` owns quads
//!   `[64 s, 64 s + 64)`, so there are [`splits`]`(H) = ceil(H / 256)` splits. With `L` lanes per
//!   split ([`HEAD_LANES`] = 32 for `hc_head`, [`PRE_LANES`] = 8 for `mhc_pre`), lane `k`
//!   accumulates, for quad `64 s + k + L r` (`r = 0 .. 64 / L`), then stream `i = 0..n`, then
//!   element `e = 0..4`, `ss = fma(x, x, ss)` and `dot_j = fma(x, fn[j][i·H + h], dot_j)`, from 0.
//!   The `L` lanes are summed with the xor tree (lane `l` + lane `l + m` for `m = L/2, …, 2, 1`),
//!   and the splits in order. All of this depends on `H` only, never on `T`: the results are
//!   batch-invariant.
//! - **Gates.** `r = 1 / sqrt(ss / D + rms_eps)` (correctly rounded, no `rsqrtf`), `mix_j = dot_j · r`,
//!   `z = fma(mix_j, scale, base_j)`, `sigmoid(z) = 1 / (1 + exp(-z))`.
//! - **Weighted sums.** `out[h] = fma(g_{n-1}, x_{n-1}[h], … fma(g_0, x_0[h], 0))`, rounded to bf16
//!   (round to nearest even).
//! - **Post.** `out_j[h] = x[h] · post_j`, then `fma(comb[i][j], R_i[h], ·)` for `i = 0..n`, bf16.

use half::bf16;
use rayon::prelude::*;

use crate::error::{MhcError, Result};
use crate::params::{HcHeadParams, MhcPreParams};
use crate::HC_MULT;

/// Elements of `h` per quad, the projection's unit (an 8-byte bf16 and a 16-byte f32 load).
pub const QUAD: usize = 4;
/// Quads per split.
pub const SPLIT_QUADS: usize = 64;
/// `h` per split.
pub const SPLIT_H: usize = QUAD * SPLIT_QUADS;
/// Lanes per split of `hc_head`'s projection (2 quads each).
pub const HEAD_LANES: usize = 32;
/// Lanes per split of `mhc_pre`'s projection (8 quads each).
pub const PRE_LANES: usize = 8;
/// Mixing logits of `mhc_pre` per token: `n (n + 2)` = 24.
pub const PRE_ROWS: usize = HC_MULT * (HC_MULT + 2);

/// Number of splits of the projection for hidden size `hidden`: `ceil(hidden / 256)`.
pub fn splits(hidden: usize) -> usize {
    hidden.div_ceil(SPLIT_H)
}

/// The three outputs of `mhc_pre` for `T` tokens.
#[derive(Clone, Debug, PartialEq)]
pub struct PreOutput {
    /// `[T, n]` f32: `sigmoid(·) · post_mult`.
    pub post: Vec<f32>,
    /// `[T, n, n]` f32: the Sinkhorn-normalised mixing matrix (`comb[i][j]`: input stream `i` to
    /// output stream `j`).
    pub comb: Vec<f32>,
    /// `[T, H]` bf16: `Σ_i pre_i · residual_i`.
    pub layer_input: Vec<bf16>,
}

fn check(
    op: &'static str,
    arg: &'static str,
    got: usize,
    expected: usize,
    shape: impl FnOnce() -> String,
) -> Result<()> {
    if got == expected {
        Ok(())
    } else {
        Err(MhcError::Shape { op, arg, expected, got, shape: shape() })
    }
}

/// Tokens in a residual of `len` elements: `len / (n · hidden)`, which must divide exactly.
pub fn tokens_of(op: &'static str, len: usize, hidden: usize) -> Result<usize> {
    if hidden == 0 {
        return Err(MhcError::Unsupported(format!("{op}: hidden size 0")));
    }
    let row = HC_MULT * hidden;
    if (len / row) * row != len {
        return Err(MhcError::PartialToken {
            op,
            arg: "residual",
            got: len,
            row,
            shape: format!("[n={HC_MULT}, H={hidden}]"),
        });
    }
    Ok(len / row)
}

/// `fn [rows, n·H]` transposed to `[n·H, rows]`, so one element's weights are contiguous.
fn transpose(hc_fn: &[f32], rows: usize, d: usize) -> Vec<f32> {
    let mut t = vec![0.0f32; rows * d];
    for (j, row) in hc_fn.chunks_exact(d).enumerate() {
        for (k, &w) in row.iter().enumerate() {
            t[k * rows + j] = w;
        }
    }
    t
}

/// The projection of one token: `out[0] = Σ x²`, `out[1 + j] = Σ x · fn[j]` for `j < V - 1`, in
/// the kernels' order with `sub` lanes per split (see the module doc). `x` is the token's `[n, H]`
/// row in f32, `fnt` the transposed weights `[n·H, V - 1]`. (Index loops over fixed-size arrays:
/// this is also the CPU backend's kernel and runs in unoptimised test builds.)
#[allow(clippy::needless_range_loop)] // index loops: faster than iterator chains unoptimised
pub(crate) fn project<const V: usize>(x: &[f32], fnt: &[f32], hidden: usize, sub: usize, out: &mut [f32; V]) {
    for s in 0..splits(hidden) {
        let part = project_split::<V>(x, fnt, hidden, sub, s);
        if s == 0 {
            *out = part;
        } else {
            for k in 0..V {
                out[k] += part[k];
            }
        }
    }
}

/// Split `s`'s part of [`project`] (what one split's projection item writes to the partials;
/// [`project`] sums the splits' parts in split order).
#[allow(clippy::needless_range_loop)]
pub(crate) fn project_split<const V: usize>(x: &[f32], fnt: &[f32], hidden: usize, sub: usize, s: usize) -> [f32; V] {
    let rows = V - 1;
    let quads = hidden.div_ceil(QUAD);
    let rounds = SPLIT_QUADS / sub;
    let mut lanes = [[0.0f32; V]; SPLIT_QUADS];
    for k in 0..sub {
        let acc = &mut lanes[k];
        for r in 0..rounds {
            let q = s * SPLIT_QUADS + k + sub * r;
            if q >= quads {
                break;
            }
            let (h0, h1) = (q * QUAD, ((q + 1) * QUAD).min(hidden));
            for i in 0..HC_MULT {
                for e in i * hidden + h0..i * hidden + h1 {
                    let xv = x[e];
                    let w = &fnt[e * rows..(e + 1) * rows];
                    acc[0] = xv.mul_add(xv, acc[0]);
                    for j in 0..rows {
                        acc[1 + j] = xv.mul_add(w[j], acc[1 + j]);
                    }
                }
            }
        }
    }
    let mut m = sub / 2;
    while m >= 1 {
        for l in 0..m {
            for k in 0..V {
                lanes[l][k] += lanes[l + m][k];
            }
        }
        m /= 2;
    }
    lanes[0]
}

/// The split partials of `mhc_pre`'s projection for each token of `x` (`[T, n, H]` in f32):
/// `[T, S, 1 + n(n+2)]`, token `t`'s split `s` being [`project_split`] (what the streamed
/// projection pass writes and the finish pass sums in split order).
pub(crate) fn pre_partials(x: &[f32], hc_fn: &[f32], hidden: usize) -> Vec<f32> {
    let d = HC_MULT * hidden;
    let (s, v) = (splits(hidden), PRE_ROWS + 1);
    let fnt = transpose(hc_fn, PRE_ROWS, d);
    let mut out = vec![0.0f32; x.len() / d.max(1) * s * v];
    out.par_chunks_mut(s * v).zip(x.par_chunks(d.max(1))).for_each(|(row, x)| {
        for (split, part) in row.chunks_exact_mut(v).enumerate() {
            part.copy_from_slice(&project_split::<{ PRE_ROWS + 1 }>(x, &fnt, hidden, PRE_LANES, split));
        }
    });
    out
}

/// `1 / sqrt(ss / D + eps)`.
pub(crate) fn rms_factor(ss: f32, d: usize, eps: f32) -> f32 {
    1.0 / (ss / d as f32 + eps).sqrt()
}

/// `1 / (1 + exp(-z))`.
pub(crate) fn sigmoid(z: f32) -> f32 {
    1.0 / (1.0 + (-z).exp())
}

/// `Σ_i g_i · rows_i[h]` as a chain of fmas from 0, into `out` (bf16).
#[allow(clippy::needless_range_loop)]
fn weighted_sum(gates: &[f32], x: &[f32], hidden: usize, out: &mut [bf16]) {
    for h in 0..out.len() {
        let mut acc = 0.0f32;
        for i in 0..gates.len() {
            acc = gates[i].mul_add(x[i * hidden + h], acc);
        }
        out[h] = bf16::from_f32(acc);
    }
}

/// Sum of four in the kernels' tree order: `(a0 + a1) + (a2 + a3)`.
fn sum4(a0: f32, a1: f32, a2: f32, a3: f32) -> f32 {
    (a0 + a1) + (a2 + a3)
}

/// Sinkhorn normalisation of one `[4, 4]` matrix (§6.2 step 4), in place: softmax over each row
/// plus `eps`, then a column normalisation `c / (Σ_i c + eps)`; then `iters - 1` times a row
/// normalisation `c / (Σ_j c + eps)` followed by a column normalisation. `iters = 0` behaves as 1.
pub fn sinkhorn(c: &mut [f32; 16], iters: u32, eps: f32) {
    let n = HC_MULT;
    let rows = |c: &mut [f32; 16]| {
        for r in c.chunks_exact_mut(n) {
            let s = sum4(r[0], r[1], r[2], r[3]);
            for v in r.iter_mut() {
                *v /= s + eps;
            }
        }
    };
    let cols = |c: &mut [f32; 16]| {
        for j in 0..n {
            let s = sum4(c[j], c[n + j], c[2 * n + j], c[3 * n + j]);
            for i in 0..n {
                c[i * n + j] /= s + eps;
            }
        }
    };
    for r in c.chunks_exact_mut(n) {
        let mx = r[0].max(r[1]).max(r[2].max(r[3]));
        let e = [(r[0] - mx).exp(), (r[1] - mx).exp(), (r[2] - mx).exp(), (r[3] - mx).exp()];
        let s = sum4(e[0], e[1], e[2], e[3]);
        for (v, e) in r.iter_mut().zip(e) {
            *v = e / s + eps;
        }
    }
    cols(c);
    for _ in 1..iters {
        rows(c);
        cols(c);
    }
}

/// Exact bf16 → f32 (the upper half of the f32's bits).
#[allow(clippy::needless_range_loop)]
pub(crate) fn to_f32(x: &[bf16]) -> Vec<f32> {
    let mut out = vec![0.0f32; x.len()];
    for k in 0..x.len() {
        out[k] = f32::from_bits(u32::from(x[k].to_bits()) << 16);
    }
    out
}

/// `hc_head` (§6.5) into `out [T, H]`: `g_i = sigmoid(mix_i · scale + base_i) + hc_eps`,
/// `out = Σ_i g_i · residual_i`. Shapes: residual `[T, n, H]`, `hc_fn [n, n·H]`, `scale [1]`,
/// `base [n]`.
pub fn hc_head_into(
    residual: &[bf16],
    hc_fn: &[f32],
    scale: &[f32],
    base: &[f32],
    hidden: usize,
    params: &HcHeadParams,
    out: &mut [bf16],
) -> Result<()> {
    let op = "hc_head";
    let n = HC_MULT;
    let d = n * hidden;
    let t = tokens_of(op, residual.len(), hidden)?;
    check(op, "hc_fn", hc_fn.len(), n * d, || format!("[{n}, {d}]"))?;
    check(op, "scale", scale.len(), 1, || "[1]".into())?;
    check(op, "base", base.len(), n, || format!("[{n}]"))?;
    check(op, "out", out.len(), t * hidden, || format!("[T={t}, H={hidden}]"))?;
    if t == 0 {
        return Ok(());
    }
    let fnt = transpose(hc_fn, n, d);
    out.par_chunks_mut(hidden).zip(residual.par_chunks(d)).for_each(|(o, r)| {
        let x = to_f32(r);
        let mut sums = [0.0f32; HC_MULT + 1];
        project(&x, &fnt, hidden, HEAD_LANES, &mut sums);
        let rf = rms_factor(sums[0], d, params.rms_eps);
        let mut gates = [0.0f32; HC_MULT];
        for (i, g) in gates.iter_mut().enumerate() {
            *g = sigmoid((sums[1 + i] * rf).mul_add(scale[0], base[i])) + params.hc_eps;
        }
        weighted_sum(&gates, &x, hidden, o);
    });
    Ok(())
}

/// `hc_head` (§6.5): see [`hc_head_into`]; returns `[T, H]` bf16.
pub fn hc_head(
    residual: &[bf16],
    hc_fn: &[f32],
    scale: &[f32],
    base: &[f32],
    hidden: usize,
    params: &HcHeadParams,
) -> Result<Vec<bf16>> {
    let t = tokens_of("hc_head", residual.len(), hidden)?;
    let mut out = vec![bf16::ZERO; t * hidden];
    hc_head_into(residual, hc_fn, scale, base, hidden, params, &mut out)?;
    Ok(out)
}

/// Output slices of [`pre_into`]: post `[T, n]`, comb `[T, n, n]`, layer input `[T, H]`.
pub struct PreOutputSlices<'a> {
    /// `[T, n]`.
    pub post: &'a mut [f32],
    /// `[T, n, n]`.
    pub comb: &'a mut [f32],
    /// `[T, H]`.
    pub layer_input: &'a mut [bf16],
}

/// `mhc_pre` (§6.2) of the residual rows `x` (already in f32, `[T, n, H]`), into `out`.
fn pre_rows(
    x: &[f32],
    hc_fn: &[f32],
    scale: &[f32],
    base: &[f32],
    hidden: usize,
    params: &MhcPreParams,
    out: PreOutputSlices<'_>,
) {
    let n = HC_MULT;
    let d = n * hidden;
    let fnt = transpose(hc_fn, PRE_ROWS, d);
    out.layer_input
        .par_chunks_mut(hidden)
        .zip(out.post.par_chunks_mut(n))
        .zip(out.comb.par_chunks_mut(n * n))
        .zip(x.par_chunks(d))
        .for_each(|(((li, post), comb), x)| {
            let mut sums = [0.0f32; PRE_ROWS + 1];
            project(x, &fnt, hidden, PRE_LANES, &mut sums);
            pre_finish_row(&sums, x, scale, base, hidden, params, PreRow { post, comb, layer_input: li });
        });
}

/// The projection sums of `mhc_pre` for each token of `residual [T, n, H]`, `[T, 1 + n(n+2)]`:
/// `Σx²`, then `x · fn[j]` for each of the `n(n+2)` rows of `hc_fn [n(n+2), n·H]`, in the portable
/// kernels' order (what their finish items sum the split partials to).
pub fn pre_sums(residual: &[bf16], hc_fn: &[f32], hidden: usize) -> Result<Vec<f32>> {
    let t = tokens_of("pre_sums", residual.len(), hidden)?;
    let d = HC_MULT * hidden;
    check("pre_sums", "hc_fn", hc_fn.len(), PRE_ROWS * d, || format!("[{PRE_ROWS}, {d}]"))?;
    let fnt = transpose(hc_fn, PRE_ROWS, d);
    let x = to_f32(residual);
    let mut out = vec![0.0f32; t * (PRE_ROWS + 1)];
    for (row, x) in out.chunks_exact_mut(PRE_ROWS + 1).zip(x.chunks_exact(d.max(1))) {
        let mut sums = [0.0f32; PRE_ROWS + 1];
        project(x, &fnt, hidden, PRE_LANES, &mut sums);
        row.copy_from_slice(&sums);
    }
    Ok(out)
}

/// One token's outputs of [`pre_finish_row`]: `post [n]`, `comb [n·n]`, `layer_input [H]`.
pub(crate) struct PreRow<'a> {
    pub post: &'a mut [f32],
    pub comb: &'a mut [f32],
    pub layer_input: &'a mut [bf16],
}

/// The rest of `mhc_pre` for one token from its projection sums (`sums[0] = Σx²`, `sums[1 + j] =
/// x · fn[j]`, `[1 + n(n+2)]`) and its residual row `x` (`[n, H]` in f32): the gates, Sinkhorn and
/// the weighted sum (the finish items' arithmetic).
#[allow(clippy::needless_range_loop)]
pub(crate) fn pre_finish_row(
    sums: &[f32; PRE_ROWS + 1],
    x: &[f32],
    scale: &[f32],
    base: &[f32],
    hidden: usize,
    params: &MhcPreParams,
    out: PreRow<'_>,
) {
    let n = HC_MULT;
    let rf = rms_factor(sums[0], n * hidden, params.rms_eps);
    let mix = |j: usize, s: f32| (sums[1 + j] * rf).mul_add(s, base[j]);
    let mut pre = [0.0f32; HC_MULT];
    for i in 0..n {
        pre[i] = sigmoid(mix(i, scale[0])) + params.pre_eps;
        out.post[i] = sigmoid(mix(n + i, scale[1])) * params.post_mult;
    }
    let mut c = [0.0f32; 16];
    for (l, c) in c.iter_mut().enumerate() {
        *c = mix(2 * n + l, scale[2]);
    }
    sinkhorn(&mut c, params.sinkhorn_iters, params.sinkhorn_eps);
    out.comb.copy_from_slice(&c);
    weighted_sum(&pre, x, hidden, out.layer_input);
}

#[allow(clippy::too_many_arguments)]
fn check_pre(
    op: &'static str,
    t: usize,
    hidden: usize,
    hc_fn: &[f32],
    scale: &[f32],
    base: &[f32],
    out: &PreOutputSlices<'_>,
) -> Result<()> {
    let n = HC_MULT;
    let d = n * hidden;
    check(op, "hc_fn", hc_fn.len(), PRE_ROWS * d, || format!("[{PRE_ROWS}, {d}]"))?;
    check(op, "scale", scale.len(), 3, || "[3]".into())?;
    check(op, "base", base.len(), PRE_ROWS, || format!("[{PRE_ROWS}]"))?;
    check(op, "post", out.post.len(), t * n, || format!("[T={t}, n={n}]"))?;
    check(op, "comb", out.comb.len(), t * n * n, || format!("[T={t}, n={n}, n={n}]"))?;
    check(op, "layer_input", out.layer_input.len(), t * hidden, || format!("[T={t}, H={hidden}]"))
}

/// `mhc_pre` (§6.2) into `out`. Shapes: residual `[T, n, H]`, `hc_fn [n(n+2), n·H]`,
/// `scale [3]`, `base [n(n+2)]`.
pub fn pre_into(
    residual: &[bf16],
    hc_fn: &[f32],
    scale: &[f32],
    base: &[f32],
    hidden: usize,
    params: &MhcPreParams,
    out: PreOutputSlices<'_>,
) -> Result<()> {
    let op = "mhc_pre";
    let t = tokens_of(op, residual.len(), hidden)?;
    check_pre(op, t, hidden, hc_fn, scale, base, &out)?;
    if t > 0 {
        pre_rows(&to_f32(residual), hc_fn, scale, base, hidden, params, out);
    }
    Ok(())
}

fn pre_output(t: usize, hidden: usize) -> PreOutput {
    PreOutput {
        post: vec![0.0; t * HC_MULT],
        comb: vec![0.0; t * HC_MULT * HC_MULT],
        layer_input: vec![bf16::ZERO; t * hidden],
    }
}

/// `mhc_pre` (§6.2): see [`pre_into`].
pub fn pre(
    residual: &[bf16],
    hc_fn: &[f32],
    scale: &[f32],
    base: &[f32],
    hidden: usize,
    params: &MhcPreParams,
) -> Result<PreOutput> {
    let t = tokens_of("mhc_pre", residual.len(), hidden)?;
    let mut o = pre_output(t, hidden);
    let slices = PreOutputSlices { post: &mut o.post, comb: &mut o.comb, layer_input: &mut o.layer_input };
    pre_into(residual, hc_fn, scale, base, hidden, params, slices)?;
    Ok(o)
}

/// `mhc_post` (§6.3) into `out [T, n, H]`: `out[t, j] = post[t, j] · x[t] + Σ_i comb[t, i, j] ·
/// residual[t, i]`. Shapes: `x [T, H]`, residual `[T, n, H]`, post `[T, n]`, comb `[T, n, n]`.
pub fn post_into(
    x: &[bf16],
    residual: &[bf16],
    post: &[f32],
    comb: &[f32],
    hidden: usize,
    out: &mut [bf16],
) -> Result<()> {
    let op = "mhc_post";
    let n = HC_MULT;
    let t = tokens_of(op, residual.len(), hidden)?;
    check(op, "x", x.len(), t * hidden, || format!("[T={t}, H={hidden}]"))?;
    check(op, "post", post.len(), t * n, || format!("[T={t}, n={n}]"))?;
    check(op, "comb", comb.len(), t * n * n, || format!("[T={t}, n={n}, n={n}]"))?;
    check(op, "out", out.len(), t * n * hidden, || format!("[T={t}, n={n}, H={hidden}]"))?;
    let d = n * hidden;
    out.par_chunks_mut(d.max(1)).enumerate().for_each(|(t, o)| {
        post_row(
            &x[t * hidden..(t + 1) * hidden],
            &residual[t * d..(t + 1) * d],
            &post[t * n..(t + 1) * n],
            &comb[t * n * n..(t + 1) * n * n],
            o,
        );
    });
    Ok(())
}

/// One token of `mhc_post`: `x [H]`, `r [n, H]`, `post [n]`, `comb [n, n]` → `out [n, H]`.
#[allow(clippy::needless_range_loop)]
fn post_row(x: &[bf16], r: &[bf16], post: &[f32], comb: &[f32], out: &mut [bf16]) {
    let (n, hidden) = (HC_MULT, x.len());
    let f = |v: bf16| f32::from_bits(u32::from(v.to_bits()) << 16);
    for h in 0..hidden {
        let xv = f(x[h]);
        let mut rv = [0.0f32; HC_MULT];
        for i in 0..n {
            rv[i] = f(r[i * hidden + h]);
        }
        for j in 0..n {
            let mut o = xv * post[j];
            for i in 0..n {
                o = comb[i * n + j].mul_add(rv[i], o);
            }
            out[j * hidden + h] = bf16::from_f32(o);
        }
    }
}

/// `mhc_post` (§6.3): see [`post_into`]; returns `[T, n, H]` bf16.
pub fn post(x: &[bf16], residual: &[bf16], post: &[f32], comb: &[f32], hidden: usize) -> Result<Vec<bf16>> {
    let mut out = vec![bf16::ZERO; residual.len()];
    post_into(x, residual, post, comb, hidden, &mut out)?;
    Ok(out)
}

/// `mhc_fused_post_pre` (§6.4) into `residual_out` and `out`: `residual_out = mhc_post(x,
/// residual, post, comb)`, then `mhc_pre(residual_out, hc_fn, scale, base)`. Bit-identical to the
/// two ops in sequence.
#[allow(clippy::too_many_arguments)]
pub fn fused_post_pre_into(
    x: &[bf16],
    residual: &[bf16],
    post: &[f32],
    comb: &[f32],
    hc_fn: &[f32],
    scale: &[f32],
    base: &[f32],
    hidden: usize,
    params: &MhcPreParams,
    residual_out: &mut [bf16],
    out: PreOutputSlices<'_>,
) -> Result<()> {
    let op = "mhc_fused_post_pre";
    let t = tokens_of(op, residual.len(), hidden)?;
    check_pre(op, t, hidden, hc_fn, scale, base, &out)?;
    post_into(x, residual, post, comb, hidden, residual_out)?;
    if t > 0 {
        pre_rows(&to_f32(residual_out), hc_fn, scale, base, hidden, params, out);
    }
    Ok(())
}

/// `mhc_fused_post_pre` (§6.4): see [`fused_post_pre_into`]; returns `(residual_out [T, n, H],
/// pre outputs)`.
#[allow(clippy::too_many_arguments)]
pub fn fused_post_pre(
    x: &[bf16],
    residual: &[bf16],
    post: &[f32],
    comb: &[f32],
    hc_fn: &[f32],
    scale: &[f32],
    base: &[f32],
    hidden: usize,
    params: &MhcPreParams,
) -> Result<(Vec<bf16>, PreOutput)> {
    let t = tokens_of("mhc_fused_post_pre", residual.len(), hidden)?;
    let mut r = vec![bf16::ZERO; residual.len()];
    let mut o = pre_output(t, hidden);
    let slices = PreOutputSlices { post: &mut o.post, comb: &mut o.comb, layer_input: &mut o.layer_input };
    fused_post_pre_into(x, residual, post, comb, hc_fn, scale, base, hidden, params, &mut r, slices)?;
    Ok((r, o))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The streamed projection's split partials (what the CPU backend's projection pass writes),
    /// summed in split order as the finish pass sums them, give [`pre_sums`] bit for bit, at
    /// hidden sizes with a short last split.
    #[test]
    fn split_partials_sum_to_the_projection_sums() {
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
        };
        for hidden in [1, 255, 300, 1000] {
            let (t, d, v) = (5, HC_MULT * hidden, PRE_ROWS + 1);
            let residual: Vec<bf16> = (0..t * d).map(|_| bf16::from_f32(next() * 1.5)).collect();
            let hc_fn: Vec<f32> = (0..PRE_ROWS * d).map(|_| next() * 0.05).collect();
            let want = pre_sums(&residual, &hc_fn, hidden).expect("sums");
            let parts = pre_partials(&to_f32(&residual), &hc_fn, hidden);
            let s = splits(hidden);
            assert_eq!(parts.len(), t * s * v);
            for k in 0..t {
                for j in 0..v {
                    let sum = (1..s).fold(parts[k * s * v + j], |a, split| a + parts[(k * s + split) * v + j]);
                    assert_eq!(sum.to_bits(), want[k * v + j].to_bits(), "H {hidden} token {k} sum {j}");
                }
            }
        }
    }
}
