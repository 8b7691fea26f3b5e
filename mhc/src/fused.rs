//! `mhc_fused_post_pre` (§6.4): one sublayer's post and the next sublayer's pre in one launch (two
//! where [`crate::MhcPasses`] takes two).

use holdfast_hal::{bf16, Stream, View};

use crate::error::Result;
use crate::ops::{disjoint, len, MhcOps, MhcPreOutputs, MhcPreWeights};
use crate::params::MhcPreParams;
use crate::plan::Reduce;
use crate::HC_MULT;

/// The inputs of the post half of `mhc_fused_post_pre`.
#[derive(Clone, Copy, Debug)]
pub struct MhcPostInputs<'a> {
    /// The sublayer's output `x [T, H]` bf16.
    pub x: &'a View<bf16>,
    /// The residual streams `[T, n, H]` bf16 before the update.
    pub residual: &'a View<bf16>,
    /// `post [T, n]` f32 from the previous pre.
    pub post: &'a View<f32>,
    /// `comb [T, n, n]` f32 from the previous pre.
    pub comb: &'a View<f32>,
}

impl MhcOps {
    /// `residual_out = post(x, residual, post, comb)` (see [`MhcOps::post`]) and then
    /// [`MhcOps::pre`] of `residual_out` with the next sublayer's weights, in one launch (two
    /// where [`crate::MhcPasses`] takes two); bit-identical to the two ops run in sequence.
    /// `residual_out` may be exactly `input.residual` (in place); no other overlap is allowed. No
    /// launch for `T = 0`.
    pub fn fused_post_pre(
        &self,
        stream: &Stream,
        input: &MhcPostInputs<'_>,
        weights: &MhcPreWeights<'_>,
        params: &MhcPreParams,
        residual_out: &View<bf16>,
        out: &MhcPreOutputs<'_>,
    ) -> Result<()> {
        let op = "mhc_fused_post_pre";
        let (n, h) = (HC_MULT, self.config.hidden);
        let t = self.tokens(op, input.residual)?;
        len(op, "x", input.x.len(), t * h, || format!("[T={t}, H={h}]"))?;
        len(op, "post_in", input.post.len(), t * n, || format!("[T={t}, n={n}]"))?;
        len(op, "comb_in", input.comb.len(), t * n * n, || format!("[T={t}, n={n}, n={n}]"))?;
        len(op, "residual_out", residual_out.len(), t * n * h, || format!("[T={t}, n={n}, H={h}]"))?;
        self.check_pre_weights(op, weights)?;
        self.check_pre_outputs(op, t, out)?;
        params.validate(op)?;
        let inputs = [
            ("x", input.x.raw()),
            ("residual", input.residual.raw()),
            ("post_in", input.post.raw()),
            ("comb_in", input.comb.raw()),
            ("hc_fn", weights.hc_fn.raw()),
            ("scale", weights.scale.raw()),
            ("base", weights.base.raw()),
        ];
        let outputs = [
            ("residual_out", residual_out.raw()),
            ("post", out.post.raw()),
            ("comb", out.comb.raw()),
            ("layer_input", out.layer_input.raw()),
        ];
        disjoint(op, &outputs, &inputs, Some(("residual_out", "residual")))?;
        if t == 0 {
            return Ok(());
        }
        let p = self.reduce_plan(Reduce::Fused, t);
        stream.launch_dependent(
            &self.kernels.fused_post_pre,
            p.config,
            &[
                input.x.into(),
                input.residual.into(),
                input.post.into(),
                input.comb.into(),
                weights.hc_fn.into(),
                weights.scale.into(),
                weights.base.into(),
                residual_out.into(),
                out.post.into(),
                out.comb.into(),
                out.layer_input.into(),
                (&self.partials).into(),
                (&self.sync).into(),
                (t as u32).into(),
                (h as u32).into(),
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
        self.launch_finish(stream, &p, residual_out, weights, params, out)
    }
}
