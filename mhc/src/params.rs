//! Scalar parameters of the ops, with their domain checks, and the ops' traffic model.

use crate::error::{MhcError, Result};
use crate::HC_MULT;

/// Scalars of `hc_head` (§6.5).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct HcHeadParams {
    /// Added to `mean(x²)` before the reciprocal square root (config `rms_norm_eps`, 1e-6).
    pub rms_eps: f32,
    /// Added to every sigmoid gate (config `hc_eps`, 1e-6).
    pub hc_eps: f32,
}

impl Default for HcHeadParams {
    fn default() -> Self {
        HcHeadParams { rms_eps: 1e-6, hc_eps: 1e-6 }
    }
}

/// Scalars of `mhc_pre` (§6.2); DeepSeek-V4 uses the defaults.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MhcPreParams {
    /// Added to `Σx²/D` before the reciprocal square root (config `rms_norm_eps`, 1e-6).
    pub rms_eps: f32,
    /// Added to the `pre` gates (config `hc_eps`, 1e-6).
    pub pre_eps: f32,
    /// Sinkhorn epsilon: added after the softmax and to every row/column sum (config `hc_eps`).
    pub sinkhorn_eps: f32,
    /// Multiplier of the `post` gates (`hc_post_alpha`, 2.0).
    pub post_mult: f32,
    /// Column normalisations of the Sinkhorn loop (`hc_sinkhorn_iters`, 20); at least 1.
    pub sinkhorn_iters: u32,
}

impl Default for MhcPreParams {
    fn default() -> Self {
        MhcPreParams { rms_eps: 1e-6, pre_eps: 1e-6, sinkhorn_eps: 1e-6, post_mult: 2.0, sinkhorn_iters: 20 }
    }
}

fn eps(op: &'static str, name: &'static str, v: f32) -> Result<()> {
    if v.is_finite() && v >= 0.0 {
        Ok(())
    } else {
        Err(MhcError::InvalidParam { op, name, value: v.to_string(), why: "must be finite and >= 0" })
    }
}

impl HcHeadParams {
    /// Checks both epsilons are finite and non-negative.
    pub fn validate(&self, op: &'static str) -> Result<()> {
        eps(op, "rms_eps", self.rms_eps)?;
        eps(op, "hc_eps", self.hc_eps)
    }
}

impl MhcPreParams {
    /// Checks the epsilons (finite, >= 0), `post_mult` (finite) and `sinkhorn_iters` (>= 1).
    pub fn validate(&self, op: &'static str) -> Result<()> {
        eps(op, "rms_eps", self.rms_eps)?;
        eps(op, "pre_eps", self.pre_eps)?;
        eps(op, "sinkhorn_eps", self.sinkhorn_eps)?;
        if !self.post_mult.is_finite() {
            return Err(MhcError::InvalidParam {
                op,
                name: "post_mult",
                value: self.post_mult.to_string(),
                why: "must be finite",
            });
        }
        if self.sinkhorn_iters == 0 {
            return Err(MhcError::InvalidParam {
                op,
                name: "sinkhorn_iters",
                value: "0".into(),
                why: "must be >= 1 (the first column normalisation follows the softmax)",
            });
        }
        Ok(())
    }
}

/// The four ops, for launch shapes and traffic accounting.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MhcOp {
    /// `hc_head`: `[T, n, H]` → `[T, H]`.
    HcHead,
    /// `mhc_pre`: `[T, n, H]` → post `[T, n]`, comb `[T, n, n]`, layer input `[T, H]`.
    Pre,
    /// `mhc_post`: `x [T, H]`, residual `[T, n, H]` → `[T, n, H]`.
    Post,
    /// `mhc_fused_post_pre`: post then pre in one launch.
    FusedPostPre,
}

impl MhcOp {
    /// All ops, in a fixed order.
    pub const ALL: [MhcOp; 4] = [MhcOp::HcHead, MhcOp::Pre, MhcOp::Post, MhcOp::FusedPostPre];

    /// The op's name as used in errors and bench ids.
    pub fn name(self) -> &'static str {
        match self {
            MhcOp::HcHead => "hc_head",
            MhcOp::Pre => "mhc_pre",
            MhcOp::Post => "mhc_post",
            MhcOp::FusedPostPre => "mhc_fused_post_pre",
        }
    }

    /// Bytes the op must move through device memory for `tokens` tokens of `hidden` (each input
    /// read once, each output written once, weights read once; the split-reduction workspace and
    /// cache re-reads not counted). Divide by the time and by the copy bandwidth for the fraction
    /// of copy bandwidth reached. With `n = 4`, `T = tokens`, `H = hidden`:
    /// - `hc_head`: `2·T·n·H + 2·T·H + 4·n·n·H + 4·(n + 1)`
    /// - `mhc_pre`: `2·T·n·H + 2·T·H + 4·T·(n + n²) + 4·m·n·H + 4·(3 + m)` with `m = n(n+2)`
    /// - `mhc_post`: `2·T·H + 2·2·T·n·H + 4·T·(n + n²)`
    /// - `mhc_fused_post_pre`: the post's reads and writes plus the pre's, less the residual
    ///   the pre reads back (it never leaves the chip).
    pub fn bytes_moved(self, tokens: usize, hidden: usize) -> u64 {
        let (t, h, n) = (tokens as u64, hidden as u64, HC_MULT as u64);
        let m = n * (n + 2);
        let bf = 2;
        let residual = bf * t * n * h;
        let row = bf * t * h;
        let gates = 4 * t * (n + n * n);
        match self {
            MhcOp::HcHead => residual + row + 4 * n * n * h + 4 * (n + 1),
            MhcOp::Pre => residual + row + gates + 4 * m * n * h + 4 * (3 + m),
            MhcOp::Post => row + 2 * residual + gates,
            MhcOp::FusedPostPre => (row + 2 * residual + gates) + (row + gates + 4 * m * n * h + 4 * (3 + m)),
        }
    }
}
