//! Test helpers: a seeded generator, random mHC inputs, an f64 evaluation of spec §6, and error
//! measures. The f64 model is written from the spec's formulas, independently of the reference's
//! summation order.
#![allow(dead_code)]

use holdfast_mhc::{HcHeadParams, MhcPreParams, HC_MULT};

use half::bf16;

pub const N: usize = HC_MULT;
pub const M: usize = N * (N + 2);

/// splitmix64.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed ^ 0x9e37_79b9_7f4a_7c15)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in [-1, 1).
    pub fn unit(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    /// Roughly normal (sum of four uniforms, variance 1).
    pub fn normal(&mut self) -> f32 {
        (self.unit() + self.unit() + self.unit() + self.unit()) * (3.0f32 / 4.0).sqrt()
    }
    /// Uniform in `[-scale·√3, scale·√3)` (variance `scale²`), four values per draw.
    pub fn bf16s(&mut self, n: usize, scale: f32) -> Vec<bf16> {
        let a = scale * 3.0f32.sqrt() / 32768.0;
        let mut out = Vec::with_capacity(n + 3);
        while out.len() < n {
            let r = self.next_u64();
            for k in 0..4 {
                out.push(bf16::from_f32((((r >> (16 * k)) & 0xffff) as f32 - 32768.0) * a));
            }
        }
        out.truncate(n);
        out
    }
    pub fn f32s(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.unit() * scale).collect()
    }
}

/// Weights of one pre (or head) op: `fn [rows, n·H]`, `scale`, `base [rows]`.
#[derive(Clone, Debug)]
pub struct Weights {
    pub hc_fn: Vec<f32>,
    pub scale: Vec<f32>,
    pub base: Vec<f32>,
}

impl Weights {
    /// Random weights whose mixes are O(1) for unit-RMS inputs.
    pub fn random(rng: &mut Rng, rows: usize, hidden: usize, scales: usize) -> Self {
        let d = N * hidden;
        let amp = (3.0 / d as f32).sqrt();
        Weights {
            hc_fn: rng.f32s(rows * d, amp),
            scale: (0..scales).map(|_| 0.5 + 0.25 * (rng.unit() + 1.0)).collect(),
            base: rng.f32s(rows, 0.5),
        }
    }
}

/// Inputs of a post (or fused) op for `t` tokens.
#[derive(Clone, Debug)]
pub struct PostInputs {
    pub x: Vec<bf16>,
    pub residual: Vec<bf16>,
    pub post: Vec<f32>,
    pub comb: Vec<f32>,
}

impl PostInputs {
    pub fn random(rng: &mut Rng, t: usize, hidden: usize) -> Self {
        PostInputs {
            x: rng.bf16s(t * hidden, 1.0),
            residual: rng.bf16s(t * N * hidden, 1.0),
            post: (0..t * N).map(|_| rng.unit() + 1.0).collect(),
            comb: (0..t * N * N).map(|_| 0.25 + 0.2 * rng.unit()).collect(),
        }
    }
}

pub fn rel_l2(got: impl Iterator<Item = f64>, want: impl Iterator<Item = f64>) -> f64 {
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (g, w) in got.zip(want) {
        num += (g - w) * (g - w);
        den += w * w;
    }
    if den == 0.0 {
        num.sqrt()
    } else {
        (num / den).sqrt()
    }
}

pub fn rel_l2_bf16(got: &[bf16], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    rel_l2(got.iter().map(|v| f64::from(v.to_f32())), want.iter().copied())
}

pub fn rel_l2_f32(got: &[f32], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    rel_l2(got.iter().map(|&v| f64::from(v)), want.iter().copied())
}

pub fn to_f64_bf16(x: &[bf16]) -> Vec<f64> {
    x.iter().map(|v| f64::from(v.to_f32())).collect()
}

pub fn to_f64_f32(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&v| f64::from(v)).collect()
}

fn sigmoid(z: f64) -> f64 {
    1.0 / (1.0 + (-z).exp())
}

/// `(rms factor, mixes)` of one token's flattened row `x [n·H]` (f64).
fn mixes(x: &[f64], hc_fn: &[f32], rows: usize, eps: f32) -> Vec<f64> {
    let d = x.len();
    let ss: f64 = x.iter().map(|v| v * v).sum();
    let r = 1.0 / (ss / d as f64 + f64::from(eps)).sqrt();
    (0..rows)
        .map(|j| x.iter().zip(&hc_fn[j * d..(j + 1) * d]).map(|(a, &w)| a * f64::from(w)).sum::<f64>() * r)
        .collect()
}

/// §6.5 in f64: `[T, H]`.
pub fn hc_head_f64(residual: &[bf16], w: &Weights, hidden: usize, p: &HcHeadParams) -> Vec<f64> {
    let d = N * hidden;
    let mut out = Vec::with_capacity(residual.len() / N);
    for row in residual.chunks_exact(d) {
        let x: Vec<f64> = to_f64_bf16(row);
        let mx = mixes(&x, &w.hc_fn, N, p.rms_eps);
        let g: Vec<f64> = (0..N)
            .map(|i| sigmoid(mx[i] * f64::from(w.scale[0]) + f64::from(w.base[i])) + f64::from(p.hc_eps))
            .collect();
        for h in 0..hidden {
            out.push((0..N).map(|i| g[i] * x[i * hidden + h]).sum());
        }
    }
    out
}

/// §6.2 step 4 in f64.
pub fn sinkhorn_f64(c: &mut [f64], iters: u32, eps: f64) {
    for r in c.chunks_exact_mut(N) {
        let mx = r.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let e: Vec<f64> = r.iter().map(|v| (v - mx).exp()).collect();
        let s: f64 = e.iter().sum();
        for (v, e) in r.iter_mut().zip(e) {
            *v = e / s + eps;
        }
    }
    let cols = |c: &mut [f64]| {
        for j in 0..N {
            let s: f64 = (0..N).map(|i| c[i * N + j]).sum();
            for i in 0..N {
                c[i * N + j] /= s + eps;
            }
        }
    };
    cols(c);
    for _ in 1..iters {
        for r in c.chunks_exact_mut(N) {
            let s: f64 = r.iter().sum();
            for v in r.iter_mut() {
                *v /= s + eps;
            }
        }
        cols(c);
    }
}

/// `(post [T, n], comb [T, n, n], layer_input [T, H])` in f64.
pub type PreF64 = (Vec<f64>, Vec<f64>, Vec<f64>);

/// §6.2 in f64.
pub fn pre_f64(residual: &[bf16], w: &Weights, hidden: usize, p: &MhcPreParams) -> PreF64 {
    let d = N * hidden;
    let (mut post, mut comb, mut li) = (Vec::new(), Vec::new(), Vec::new());
    let s = |k: usize| f64::from(w.scale[k]);
    let b = |j: usize| f64::from(w.base[j]);
    for row in residual.chunks_exact(d) {
        let x = to_f64_bf16(row);
        let mx = mixes(&x, &w.hc_fn, M, p.rms_eps);
        let pre: Vec<f64> = (0..N).map(|i| sigmoid(mx[i] * s(0) + b(i)) + f64::from(p.pre_eps)).collect();
        post.extend((0..N).map(|i| sigmoid(mx[N + i] * s(1) + b(N + i)) * f64::from(p.post_mult)));
        let mut c: Vec<f64> = (0..N * N).map(|l| mx[2 * N + l] * s(2) + b(2 * N + l)).collect();
        sinkhorn_f64(&mut c, p.sinkhorn_iters, f64::from(p.sinkhorn_eps));
        comb.extend(c);
        for h in 0..hidden {
            li.push((0..N).map(|i| pre[i] * x[i * hidden + h]).sum());
        }
    }
    (post, comb, li)
}

/// §6.3 in f64: `[T, n, H]`.
pub fn post_f64(inp: &PostInputs, hidden: usize) -> Vec<f64> {
    let t = inp.x.len() / hidden.max(1);
    let mut out = Vec::with_capacity(t * N * hidden);
    for tok in 0..t {
        for j in 0..N {
            for h in 0..hidden {
                let mut o = f64::from(inp.post[tok * N + j]) * f64::from(inp.x[tok * hidden + h].to_f32());
                for i in 0..N {
                    o += f64::from(inp.comb[(tok * N + i) * N + j])
                        * f64::from(inp.residual[(tok * N + i) * hidden + h].to_f32());
                }
                out.push(o);
            }
        }
    }
    out
}

/// §6.4 in f64: the post (stored as bf16, the residual's dtype), then the pre of that.
pub fn fused_f64(inp: &PostInputs, w: &Weights, hidden: usize, p: &MhcPreParams) -> (Vec<f64>, PreF64) {
    let r = post_f64(inp, hidden);
    let stored: Vec<bf16> = r.iter().map(|&v| bf16::from_f64(v)).collect();
    (r, pre_f64(&stored, w, hidden, p))
}

/// Max |row sum - 1| and |column sum - 1| over `[T, n, n]`.
pub fn sinkhorn_defect(comb: &[f32]) -> f64 {
    let mut worst = 0.0f64;
    for m in comb.chunks_exact(N * N) {
        for k in 0..N {
            let r: f64 = (0..N).map(|j| f64::from(m[k * N + j])).sum();
            let c: f64 = (0..N).map(|i| f64::from(m[i * N + k])).sum();
            worst = worst.max((r - 1.0).abs()).max((c - 1.0).abs());
        }
    }
    worst
}
