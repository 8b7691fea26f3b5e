//! `hc_head` (§6.5): collapse the `n` residual streams into one before the final norm.

use holdfast_hal::{bf16, Stream, View};

use crate::error::Result;
use crate::ops::{disjoint, len, HcHeadWeights, MhcOps};
use crate::params::HcHeadParams;
use crate::params::MhcOp;
use crate::plan::{self, Reduce};
use crate::HC_MULT;

impl MhcOps {
    /// `out [T, H] bf16 = Σ_i g_i · residual[:, i, :]` with
    /// `g = sigmoid((x̂ · fnᵀ) · scale + base) + hc_eps` and `x̂ = x · rsqrt(mean(x²) + rms_eps)` over
    /// each token's flattened `[n·H]` row; `residual [T, n, H]` bf16, `T` = its length / (n·H).
    /// One launch (none for `T = 0`). `out` must not overlap any input.
    pub fn hc_head(
        &self,
        stream: &Stream,
        residual: &View<bf16>,
        weights: &HcHeadWeights<'_>,
        params: &HcHeadParams,
        out: &View<bf16>,
    ) -> Result<()> {
        let op = "hc_head";
        let (n, h) = (HC_MULT, self.config.hidden);
        let t = self.tokens(op, residual)?;
        len(op, "hc_fn", weights.hc_fn.len(), n * n * h, || format!("[{n}, {}]", n * h))?;
        len(op, "scale", weights.scale.len(), 1, || "[1]".into())?;
        len(op, "base", weights.base.len(), n, || format!("[{n}]"))?;
        len(op, "out", out.len(), t * h, || format!("[T={t}, H={h}]"))?;
        params.validate(op)?;
        let inputs = [
            ("residual", residual.raw()),
            ("hc_fn", weights.hc_fn.raw()),
            ("scale", weights.scale.raw()),
            ("base", weights.base.raw()),
        ];
        disjoint(op, &[("out", out.raw())], &inputs, None)?;
        if t == 0 {
            return Ok(());
        }
        if self.uses_clusters(MhcOp::HcHead) {
            stream.launch_cluster_dependent(
                &self.kernels.hc_head_cluster,
                plan::cluster_head(t, h, self.head_cluster_slots),
                plan::cluster_blocks(h) as u32,
                &[
                    residual.into(),
                    weights.hc_fn.into(),
                    weights.scale.into(),
                    weights.base.into(),
                    out.into(),
                    (t as u32).into(),
                    (h as u32).into(),
                    params.rms_eps.into(),
                    params.hc_eps.into(),
                ],
            )?;
            return Ok(());
        }
        let p = self.reduce_plan(Reduce::Head, t);
        stream.launch_dependent(
            &self.kernels.hc_head,
            p.config,
            &[
                residual.into(),
                weights.hc_fn.into(),
                weights.scale.into(),
                weights.base.into(),
                out.into(),
                (&self.partials).into(),
                (&self.sync).into(),
                (t as u32).into(),
                (h as u32).into(),
                params.rms_eps.into(),
                params.hc_eps.into(),
                (p.tile_tokens as u32).into(),
                (p.finish_tokens as u32).into(),
                p.flags().into(),
            ],
        )?;
        Ok(())
    }
}
