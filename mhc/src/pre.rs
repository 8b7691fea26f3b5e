//! `mhc_pre` (§6.2): gates, Sinkhorn-normalised stream mixing, and the sublayer's input.

use holdfast_hal::{bf16, Stream, View};

use crate::error::Result;
use crate::ops::{disjoint, MhcOps, MhcPreOutputs, MhcPreWeights};
use crate::params::MhcPreParams;
use crate::plan::Reduce;

impl MhcOps {
    /// From `residual [T, n, H]` bf16: `mixes = rsqrt(Σx²/D + rms_eps) · (x · fnᵀ)` over each
    /// token's flattened row (`D = n·H`), then `post [T, n] = sigmoid(mixes[n..2n]·s1 + b) ·
    /// post_mult`, `comb [T, n, n] = sinkhorn(mixes[2n..]·s2 + b)` and `layer_input [T, H] =
    /// Σ_i pre_i · residual_i` with `pre = sigmoid(mixes[..n]·s0 + b) + pre_eps`. One launch (none
    /// for `T = 0`; two where [`crate::MhcPasses`] takes two). Outputs must not overlap inputs or
    /// each other.
    pub fn pre(
        &self,
        stream: &Stream,
        residual: &View<bf16>,
        weights: &MhcPreWeights<'_>,
        params: &MhcPreParams,
        out: &MhcPreOutputs<'_>,
    ) -> Result<()> {
        let op = "mhc_pre";
        let t = self.tokens(op, residual)?;
        self.check_pre_weights(op, weights)?;
        self.check_pre_outputs(op, t, out)?;
        params.validate(op)?;
        let inputs = [
            ("residual", residual.raw()),
            ("hc_fn", weights.hc_fn.raw()),
            ("scale", weights.scale.raw()),
            ("base", weights.base.raw()),
        ];
        let outputs = [("post", out.post.raw()), ("comb", out.comb.raw()), ("layer_input", out.layer_input.raw())];
        disjoint(op, &outputs, &inputs, None)?;
        if t == 0 {
            return Ok(());
        }
        let p = self.reduce_plan(Reduce::Pre, t);
        stream.launch_dependent(
            &self.kernels.pre,
            p.config,
            &[
                residual.into(),
                weights.hc_fn.into(),
                weights.scale.into(),
                weights.base.into(),
                out.post.into(),
                out.comb.into(),
                out.layer_input.into(),
                (&self.partials).into(),
                (&self.sync).into(),
                (t as u32).into(),
                (self.config.hidden as u32).into(),
                params.rms_eps.into(),
                params.pre_eps.into(),
                params.sinkhorn_eps.into(),
                params.post_mult.into(),
                params.sinkhorn_iters.into(),
                (p.tile_tokens as u32).into(),
                (p.finish_tokens as u32).into(),
                p.flags().into(),
            ],
        )?;
        self.launch_finish(stream, &p, residual, weights, params, out)
    }
}
