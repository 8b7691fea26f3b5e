//! The mHC kernel source (`kernels.cu`), its entry points' signatures, and the CPU references the
//! CPU backend runs in their place.
//!
//! The split-reduction kernels take two workspace pointers the references never touch: `partials`
//! (`[T, S, values]` f32) and `sync` (`[1 + 2·tiles]` u32 counters, zero between launches). The
//! references do check that both are large enough for the launch, as the device would need.

use std::sync::OnceLock;

use holdfast_hal::{bf16, CpuLaunch, Device, Kernel, KernelEntry, KernelSource, Module, Param, ScalarKind};

use crate::error::Result;
use crate::params::{HcHeadParams, MhcPreParams};
use crate::reference::{self, PreOutputSlices, PRE_ROWS};
use crate::HC_MULT;

const CODE: &str = include_str!("kernels.cu");

/// Entry point names.
pub(crate) const HC_HEAD: &str = "mhc_hc_head_n4";
pub(crate) const HC_HEAD_CLUSTER: &str = "mhc_hc_head_cluster_n4";
pub(crate) const PRE: &str = "mhc_pre_n4";
pub(crate) const FUSED_POST_PRE: &str = "mhc_fused_post_pre_n4";
pub(crate) const POST: &str = "mhc_post_n4";
pub(crate) const PRE_FINISH: &str = "mhc_pre_finish_n4";

type HalResult<T> = holdfast_hal::Result<T>;

fn fail(l: &CpuLaunch<'_>, e: crate::MhcError) -> holdfast_hal::HalError {
    l.fail(e.to_string())
}

/// Checks a view holds at least `need` elements (the device would read or write that many).
fn at_least(l: &CpuLaunch<'_>, arg: &str, len: usize, need: usize) -> HalResult<()> {
    if len < need {
        return Err(l.fail(format!("`{arg}` has {len} elements, the launch needs {need}")));
    }
    Ok(())
}

/// Scalars shared by the split-reduction kernels, checked against the workspace views: `floats(T,
/// S)` is the partials length the kernel needs for `T` tokens in `S` splits.
fn check_workspace(
    l: &CpuLaunch<'_>,
    tokens: usize,
    hidden: usize,
    floats: fn(usize, usize) -> usize,
    partials: usize,
    sync: usize,
    tile_at: usize,
) -> HalResult<()> {
    let (tile, finish) = (l.count(tile_at)?, l.count(tile_at + 1)?);
    if tokens == 0 {
        return Ok(());
    }
    if tile == 0 || finish == 0 || finish > crate::plan::FINISH_MAX {
        return Err(l.fail(format!("tile_tokens {tile} / finish_tokens {finish} out of range")));
    }
    at_least(l, "partials", partials, floats(tokens, reference::splits(hidden)))?;
    at_least(l, "sync", sync, 1 + 2 * tokens.div_ceil(tile))
}

/// Whether a `mhc_pre` / fused launch is the streamed projection pass (`finish_tokens` at
/// `finish_at` 0 and `resident` after it with bit 2, `MHC_STREAM`): on GPUs a tensor-core pass;
/// here the reference's split partials (the same bits as the one-launch path once the finish pass
/// sums them in split order).
fn streamed(l: &CpuLaunch<'_>, finish_at: usize) -> HalResult<bool> {
    Ok(l.count(finish_at)? == 0 && l.u32(finish_at + 1)? & 4 != 0)
}

/// The streamed projection's output: the split partials `[T, S, 25]` of the rows `x` (`[T, n,
/// H]` in f32) into `partials`.
fn write_partials(
    l: &CpuLaunch<'_>,
    partials: &holdfast_hal::CpuPtr<'_, f32>,
    x: &[f32],
    hc_fn: &[f32],
    hidden: usize,
) -> HalResult<()> {
    let p = reference::pre_partials(x, hc_fn, hidden);
    at_least(l, "partials", partials.len(), p.len())?;
    partials.write(0, &p)
}

/// `hc_head` by the reference from the kernels' leading arguments (`residual, fn, scale, base,
/// out`) for `t` tokens of hidden size `h`.
fn hc_head_by_reference(l: &CpuLaunch<'_>, t: usize, h: usize, params: &HcHeadParams) -> HalResult<()> {
    let (residual, hc_fn, scale, base, out) =
        (l.ptr::<bf16>(0)?, l.ptr::<f32>(1)?, l.ptr::<f32>(2)?, l.ptr::<f32>(3)?, l.ptr::<bf16>(4)?);
    let (n, d) = (HC_MULT, HC_MULT * h);
    at_least(l, "residual", residual.len(), t * d)?;
    at_least(l, "out", out.len(), t * h)?;
    let r = residual.read(0, t * d)?;
    let mut o = vec![bf16::ZERO; t * h];
    reference::hc_head_into(&r, &hc_fn.read(0, n * d)?, &scale.read(0, 1)?, &base.read(0, n)?, h, params, &mut o)
        .map_err(|e| fail(l, e))?;
    out.write(0, &o)
}

fn hc_head_cpu(l: &CpuLaunch<'_>) -> HalResult<()> {
    let (partials, sync) = (l.ptr::<f32>(5)?, l.ptr::<u32>(6)?);
    let (t, h) = (l.count(7)?, l.count(8)?);
    let params = HcHeadParams { rms_eps: l.f32(9)?, hc_eps: l.f32(10)? };
    check_workspace(l, t, h, |t, s| t * s * (HC_MULT + 1), partials.len(), sync.len(), 11)?;
    hc_head_by_reference(l, t, h, &params)
}

/// `mhc_hc_head_cluster_n4`: `hc_head` without workspace; the device launch needs clusters of
/// [`crate::plan::cluster_blocks`]`(H)` blocks.
fn hc_head_cluster_cpu(l: &CpuLaunch<'_>) -> HalResult<()> {
    let (t, h) = (l.count(5)?, l.count(6)?);
    let params = HcHeadParams { rms_eps: l.f32(7)?, hc_eps: l.f32(8)? };
    let nb = crate::plan::cluster_blocks(h);
    if t > 0 && l.cluster_blocks() as usize != nb {
        return Err(l.fail(format!(
            "launched with clusters of {} blocks; the kernel needs {nb} at H = {h}",
            l.cluster_blocks()
        )));
    }
    hc_head_by_reference(l, t, h, &params)
}

fn pre_params(l: &CpuLaunch<'_>, at: usize) -> HalResult<MhcPreParams> {
    Ok(MhcPreParams {
        rms_eps: l.f32(at)?,
        pre_eps: l.f32(at + 1)?,
        sinkhorn_eps: l.f32(at + 2)?,
        post_mult: l.f32(at + 3)?,
        sinkhorn_iters: l.u32(at + 4)?,
    })
}

fn pre_cpu(l: &CpuLaunch<'_>) -> HalResult<()> {
    let (residual, hc_fn, scale, base) = (l.ptr::<bf16>(0)?, l.ptr::<f32>(1)?, l.ptr::<f32>(2)?, l.ptr::<f32>(3)?);
    let (post, comb, layer) = (l.ptr::<f32>(4)?, l.ptr::<f32>(5)?, l.ptr::<bf16>(6)?);
    let (partials, sync) = (l.ptr::<f32>(7)?, l.ptr::<u32>(8)?);
    let (t, h) = (l.count(9)?, l.count(10)?);
    let params = pre_params(l, 11)?;
    if streamed(l, 17)? {
        let d = HC_MULT * h;
        at_least(l, "residual", residual.len(), t * d)?;
        let r = reference::to_f32(&residual.read(0, t * d)?);
        return write_partials(l, &partials, &r, &hc_fn.read(0, PRE_ROWS * d)?, h);
    }
    check_workspace(l, t, h, crate::plan::workspace_floats, partials.len(), sync.len(), 16)?;
    let (n, d) = (HC_MULT, HC_MULT * h);
    at_least(l, "residual", residual.len(), t * d)?;
    at_least(l, "post", post.len(), t * n)?;
    at_least(l, "comb", comb.len(), t * n * n)?;
    at_least(l, "layer_input", layer.len(), t * h)?;
    let r = residual.read(0, t * d)?;
    let (mut po, mut co, mut li) = (vec![0.0f32; t * n], vec![0.0f32; t * n * n], vec![bf16::ZERO; t * h]);
    let slices = PreOutputSlices { post: &mut po, comb: &mut co, layer_input: &mut li };
    reference::pre_into(
        &r,
        &hc_fn.read(0, PRE_ROWS * d)?,
        &scale.read(0, 3)?,
        &base.read(0, PRE_ROWS)?,
        h,
        &params,
        slices,
    )
    .map_err(|e| fail(l, e))?;
    post.write(0, &po)?;
    comb.write(0, &co)?;
    layer.write(0, &li)
}

/// `mhc_pre_finish_n4`: the second pass after a streamed projection, from the partials `[T, S, 25]`
/// (summed in split order, as the kernel does) and the residual: after the CPU backend's
/// streamed projection (the reference's split partials), or on partials put there by whoever
/// fills them.
fn pre_finish_cpu(l: &CpuLaunch<'_>) -> HalResult<()> {
    let (residual, scale, base) = (l.ptr::<bf16>(0)?, l.ptr::<f32>(1)?, l.ptr::<f32>(2)?);
    let (post, comb, layer, partials) = (l.ptr::<f32>(3)?, l.ptr::<f32>(4)?, l.ptr::<bf16>(5)?, l.ptr::<f32>(6)?);
    let (t, h) = (l.count(7)?, l.count(8)?);
    let params = pre_params(l, 9)?;
    if t == 0 {
        return Ok(());
    }
    let (n, d, s, v) = (HC_MULT, HC_MULT * h, reference::splits(h), PRE_ROWS + 1);
    at_least(l, "residual", residual.len(), t * d)?;
    at_least(l, "post", post.len(), t * n)?;
    at_least(l, "comb", comb.len(), t * n * n)?;
    at_least(l, "layer_input", layer.len(), t * h)?;
    at_least(l, "partials", partials.len(), t * s * v)?;
    let (scale, base) = (scale.read(0, 3)?, base.read(0, PRE_ROWS)?);
    let (r, p) = (reference::to_f32(&residual.read(0, t * d)?), partials.read(0, t * s * v)?);
    let (mut po, mut co, mut li) = (vec![0.0f32; t * n], vec![0.0f32; t * n * n], vec![bf16::ZERO; t * h]);
    for k in 0..t {
        let mut sums = [0.0f32; PRE_ROWS + 1];
        for (j, sum) in sums.iter_mut().enumerate() {
            *sum = (1..s).fold(p[k * s * v + j], |a, split| a + p[(k * s + split) * v + j]);
        }
        let out = reference::PreRow {
            post: &mut po[k * n..(k + 1) * n],
            comb: &mut co[k * n * n..(k + 1) * n * n],
            layer_input: &mut li[k * h..(k + 1) * h],
        };
        reference::pre_finish_row(&sums, &r[k * d..(k + 1) * d], &scale, &base, h, &params, out);
    }
    post.write(0, &po)?;
    comb.write(0, &co)?;
    layer.write(0, &li)
}

fn fused_post_pre_cpu(l: &CpuLaunch<'_>) -> HalResult<()> {
    let (x, residual, post_in, comb_in) = (l.ptr::<bf16>(0)?, l.ptr::<bf16>(1)?, l.ptr::<f32>(2)?, l.ptr::<f32>(3)?);
    let (hc_fn, scale, base) = (l.ptr::<f32>(4)?, l.ptr::<f32>(5)?, l.ptr::<f32>(6)?);
    let (residual_out, post, comb, layer) = (l.ptr::<bf16>(7)?, l.ptr::<f32>(8)?, l.ptr::<f32>(9)?, l.ptr::<bf16>(10)?);
    let (partials, sync) = (l.ptr::<f32>(11)?, l.ptr::<u32>(12)?);
    let (t, h) = (l.count(13)?, l.count(14)?);
    let params = pre_params(l, 15)?;
    let stream = streamed(l, 21)?;
    if !stream {
        check_workspace(l, t, h, crate::plan::workspace_floats, partials.len(), sync.len(), 20)?;
    }
    let (n, d) = (HC_MULT, HC_MULT * h);
    at_least(l, "x", x.len(), t * h)?;
    at_least(l, "residual", residual.len(), t * d)?;
    at_least(l, "post_in", post_in.len(), t * n)?;
    at_least(l, "comb_in", comb_in.len(), t * n * n)?;
    at_least(l, "residual_out", residual_out.len(), t * d)?;
    at_least(l, "post", post.len(), t * n)?;
    at_least(l, "comb", comb.len(), t * n * n)?;
    at_least(l, "layer_input", layer.len(), t * h)?;
    // Every input is copied out before any output is written, so residual_out may alias residual.
    let (xs, rs) = (x.read(0, t * h)?, residual.read(0, t * d)?);
    let (pi, ci) = (post_in.read(0, t * n)?, comb_in.read(0, t * n * n)?);
    let mut ro = vec![bf16::ZERO; t * d];
    if stream {
        reference::post_into(&xs, &rs, &pi, &ci, h, &mut ro).map_err(|e| fail(l, e))?;
        write_partials(l, &partials, &reference::to_f32(&ro), &hc_fn.read(0, PRE_ROWS * d)?, h)?;
        return residual_out.write(0, &ro);
    }
    let (mut po, mut co, mut li) = (vec![0.0f32; t * n], vec![0.0f32; t * n * n], vec![bf16::ZERO; t * h]);
    let slices = PreOutputSlices { post: &mut po, comb: &mut co, layer_input: &mut li };
    reference::fused_post_pre_into(
        &xs,
        &rs,
        &pi,
        &ci,
        &hc_fn.read(0, PRE_ROWS * d)?,
        &scale.read(0, 3)?,
        &base.read(0, PRE_ROWS)?,
        h,
        &params,
        &mut ro,
        slices,
    )
    .map_err(|e| fail(l, e))?;
    residual_out.write(0, &ro)?;
    post.write(0, &po)?;
    comb.write(0, &co)?;
    layer.write(0, &li)
}

fn post_cpu(l: &CpuLaunch<'_>) -> HalResult<()> {
    let (x, residual, post, comb, out) =
        (l.ptr::<bf16>(0)?, l.ptr::<bf16>(1)?, l.ptr::<f32>(2)?, l.ptr::<f32>(3)?, l.ptr::<bf16>(4)?);
    let (t, h, per_block) = (l.count(5)?, l.count(6)?, l.count(7)?);
    if t > 0 && per_block == 0 {
        return Err(l.fail("tokens_per_block is 0"));
    }
    let (n, d) = (HC_MULT, HC_MULT * h);
    at_least(l, "x", x.len(), t * h)?;
    at_least(l, "residual", residual.len(), t * d)?;
    at_least(l, "post", post.len(), t * n)?;
    at_least(l, "comb", comb.len(), t * n * n)?;
    at_least(l, "out", out.len(), t * d)?;
    // Inputs are copied out first: out may alias residual (in place).
    let (xs, rs, ps, cs) =
        (x.read(0, t * h)?, residual.read(0, t * d)?, post.read(0, t * n)?, comb.read(0, t * n * n)?);
    let mut o = vec![bf16::ZERO; t * d];
    reference::post_into(&xs, &rs, &ps, &cs, h, &mut o).map_err(|e| fail(l, e))?;
    out.write(0, &o)
}

/// The mHC kernel source: CUDA C (valid HIP) for `hc_mult = 4`, with its CPU references.
///
/// Entry points (shapes with `n = 4`, `S = ceil(H / 256)`):
/// - `mhc_hc_head_n4(residual [T,n,H] bf16, fn [n, nH] f32, scale [1], base [n], out [T,H] bf16,
///   partials [T,S,n+1] f32, sync u32, T, H, rms_eps, hc_eps, tile_tokens, finish_tokens, resident)`
/// - `mhc_pre_n4(residual, fn [m, nH], scale [3], base [m], post [T,n], comb [T,n,n],
///   layer_input [T,H] bf16, partials [T,S,m+1], sync, T, H, rms_eps, pre_eps, sinkhorn_eps,
///   post_mult, sinkhorn_iters, tile_tokens, finish_tokens, resident)` with `m = n(n+2)`
/// - `mhc_fused_post_pre_n4(x [T,H], residual, post_in, comb_in, fn, scale, base, residual_out,
///   post, comb, layer_input, partials, sync, T, H, …as mhc_pre)`
/// - `mhc_post_n4(x [T,H], residual [T,n,H], post [T,n], comb [T,n,n], out [T,n,H], T, H,
///   tokens_per_block)`
/// - `mhc_pre_finish_n4(residual [T,n,H], scale [3], base [m], post [T,n], comb [T,n,n],
///   layer_input [T,H], partials [T,S,m+1], T, H, rms_eps, pre_eps, sinkhorn_eps, post_mult,
///   sinkhorn_iters)`: the second launch after a streamed projection (grid `(ceil(T / 16), parts)`)
///
/// `resident` bit 2 (with `finish_tokens = 0`, `mhc_pre` and the fused op, tensor cores only on
/// GPUs; the CPU backend writes the reference's split partials) makes the launch the streamed
/// projection pass: partials only (and the fused op's `residual_out`), grid `S · per`, block `b`
/// taking split `b / per` and the `(b % per)`-th equal run of the `ceil(T / 16)` m-tiles, dynamic
/// shared memory of 3 stages (the fused op: 4); `mhc_pre_finish_n4` on the (post-mixed) residual
/// then writes the outputs.
///
/// `finish_tokens = 0` selects the resident tensor-core items (sm_80+ only; grid `tiles · S`,
/// dynamic shared memory per `tile_tokens`); `1..=16` the portable projection and finish items
/// (grid `tiles · (S + ceil(tile_tokens / finish_tokens))`). The CPU references accept only the
/// latter, which is all the CPU backend is given. `resident` holds flags: bit 0 tells the kernel
/// that the whole grid is resident at once (the plan's `resident_grid`), so blocks take their
/// index as ticket; bit 1 (`hc_head` only, tiles of at most 16 tokens; the plan gives one tile
/// with bit 0 set) makes the grid `tiles · S` projection items that each write their own 256 h of
/// the outputs (no finish items).
pub fn source() -> &'static KernelSource {
    static SRC: OnceLock<KernelSource> = OnceLock::new();
    SRC.get_or_init(|| {
        let u = |name| Param::scalar(name, ScalarKind::U32);
        let f = |name| Param::scalar(name, ScalarKind::F32);
        let pre_scalars = || {
            vec![
                u("T"),
                u("H"),
                f("rms_eps"),
                f("pre_eps"),
                f("sinkhorn_eps"),
                f("post_mult"),
                u("iters"),
                u("tile_tokens"),
                u("finish_tokens"),
                u("resident"),
            ]
        };
        let workspace = || vec![Param::inout::<f32>("partials"), Param::inout::<u32>("sync")];
        let mut head = vec![
            Param::input::<bf16>("residual"),
            Param::input::<f32>("fn"),
            Param::input::<f32>("scale"),
            Param::input::<f32>("base"),
            Param::output::<bf16>("out"),
        ];
        let mut head_cluster = head.clone();
        head_cluster.extend([u("T"), u("H"), f("rms_eps"), f("hc_eps")]);
        head.extend(workspace());
        head.extend([u("T"), u("H"), f("rms_eps"), f("hc_eps"), u("tile_tokens"), u("finish_tokens"), u("resident")]);
        let mut pre = vec![
            Param::input::<bf16>("residual"),
            Param::input::<f32>("fn"),
            Param::input::<f32>("scale"),
            Param::input::<f32>("base"),
            Param::output::<f32>("post_out"),
            Param::output::<f32>("comb_out"),
            Param::output::<bf16>("layer_input"),
        ];
        pre.extend(workspace());
        pre.extend(pre_scalars());
        let mut fused = vec![
            Param::input::<bf16>("x_in"),
            Param::input::<bf16>("residual"),
            Param::input::<f32>("post_in"),
            Param::input::<f32>("comb_in"),
            Param::input::<f32>("fn"),
            Param::input::<f32>("scale"),
            Param::input::<f32>("base"),
            Param::output::<bf16>("residual_out"),
            Param::output::<f32>("post_out"),
            Param::output::<f32>("comb_out"),
            Param::output::<bf16>("layer_input"),
        ];
        fused.extend(workspace());
        fused.extend(pre_scalars());
        let mut finish = vec![
            Param::input::<bf16>("residual"),
            Param::input::<f32>("scale"),
            Param::input::<f32>("base"),
            Param::output::<f32>("post_out"),
            Param::output::<f32>("comb_out"),
            Param::output::<bf16>("layer_input"),
            Param::input::<f32>("partials"),
            u("T"),
            u("H"),
        ];
        finish.extend([f("rms_eps"), f("pre_eps"), f("sinkhorn_eps"), f("post_mult"), u("iters")]);
        let post = vec![
            Param::input::<bf16>("x"),
            Param::input::<bf16>("residual"),
            Param::input::<f32>("post"),
            Param::input::<f32>("comb"),
            Param::output::<bf16>("out"),
            u("T"),
            u("H"),
            u("tokens_per_block"),
        ];
        KernelSource {
            name: "holdfast_mhc",
            code: CODE,
            entries: vec![
                KernelEntry { name: HC_HEAD, params: head, cpu: hc_head_cpu },
                KernelEntry { name: HC_HEAD_CLUSTER, params: head_cluster, cpu: hc_head_cluster_cpu },
                KernelEntry { name: PRE, params: pre, cpu: pre_cpu },
                KernelEntry { name: FUSED_POST_PRE, params: fused, cpu: fused_post_pre_cpu },
                KernelEntry { name: POST, params: post, cpu: post_cpu },
                KernelEntry { name: PRE_FINISH, params: finish, cpu: pre_finish_cpu },
            ],
        }
    })
}

/// The mHC module compiled for one device, with its kernels looked up once. Build it once
/// per device (compilation is cached by the HAL anyway) and before any capture.
#[derive(Clone, Debug)]
pub struct MhcKernels {
    pub(crate) module: Module,
    pub(crate) hc_head: Kernel,
    pub(crate) hc_head_cluster: Kernel,
    pub(crate) pre: Kernel,
    pub(crate) fused_post_pre: Kernel,
    pub(crate) post: Kernel,
    pub(crate) pre_finish: Kernel,
}

impl MhcKernels {
    /// Compiles (or fetches from the device's cache) the mHC module for `device`. Fails with the
    /// HAL's compile error, or `IllegalDuringCapture` if a stream is capturing and the module is
    /// not cached yet.
    pub fn new(device: &Device) -> Result<Self> {
        let module = device.compile(source())?;
        Ok(MhcKernels {
            hc_head: module.kernel(HC_HEAD)?,
            hc_head_cluster: module.kernel(HC_HEAD_CLUSTER)?,
            pre: module.kernel(PRE)?,
            fused_post_pre: module.kernel(FUSED_POST_PRE)?,
            post: module.kernel(POST)?,
            pre_finish: module.kernel(PRE_FINISH)?,
            module,
        })
    }

    /// The compiled module.
    pub fn module(&self) -> &Module {
        &self.module
    }
}
