//! `mhc_post` (§6.3): write a sublayer's output back into the residual streams.

use holdfast_hal::{bf16, Stream, View};

use crate::error::Result;
use crate::ops::{disjoint, len, MhcOps};
use crate::plan;
use crate::HC_MULT;

impl MhcOps {
    /// `out[t, j, :] = post[t, j] · x[t, :] + Σ_i comb[t, i, j] · residual[t, i, :]` (f32, stored
    /// bf16): `x [T, H]` bf16, `residual [T, n, H]` bf16, `post [T, n]` f32, `comb [T, n, n]` f32
    /// (`comb[i][j]` routes input stream `i` to output stream `j`), `out [T, n, H]` bf16. `out` may
    /// be exactly `residual` (in place); no other overlap is allowed. One launch (none for `T = 0`).
    pub fn post(
        &self,
        stream: &Stream,
        x: &View<bf16>,
        residual: &View<bf16>,
        post: &View<f32>,
        comb: &View<f32>,
        out: &View<bf16>,
    ) -> Result<()> {
        let op = "mhc_post";
        let (n, h) = (HC_MULT, self.config.hidden);
        let t = self.tokens(op, residual)?;
        len(op, "x", x.len(), t * h, || format!("[T={t}, H={h}]"))?;
        len(op, "post", post.len(), t * n, || format!("[T={t}, n={n}]"))?;
        len(op, "comb", comb.len(), t * n * n, || format!("[T={t}, n={n}, n={n}]"))?;
        len(op, "out", out.len(), t * n * h, || format!("[T={t}, n={n}, H={h}]"))?;
        let inputs = [("x", x.raw()), ("residual", residual.raw()), ("post", post.raw()), ("comb", comb.raw())];
        disjoint(op, &[("out", out.raw())], &inputs, Some(("out", "residual")))?;
        if t == 0 {
            return Ok(());
        }
        let (cfg, per_block) = plan::post(t, h);
        stream.launch_dependent(
            &self.kernels.post,
            cfg,
            &[
                x.into(),
                residual.into(),
                post.into(),
                comb.into(),
                out.into(),
                (t as u32).into(),
                (h as u32).into(),
                (per_block as u32).into(),
            ],
        )?;
        Ok(())
    }
}
