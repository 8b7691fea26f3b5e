//! Times one mHC op at one size, for profilers (Nsight Compute) and quick comparisons:
//!
//! ```text
//! HOLDFAST_DEVICE=cuda:0 cargo run --release -p holdfast-mhc --features cuda \
//!     --example mhc_case -- OP H T ITERS
//! ```
//!
//! `OP` is `hc_head`, `mhc_pre`, `mhc_post` or `mhc_fused_post_pre` (the names [`MhcOp::name`]
//! gives); the op runs on the default path ([`MhcProjection::Auto`]; `MHC_PASSES=one|two` forces
//! [`MhcPasses`]) over patterned inputs. It
//! prints the mean time per call over `ITERS` calls after as many warm-up calls, the bytes the op
//! moves ([`MhcOp::bytes_moved`]) and their rate, and a hash of the outputs (equal hashes: equal
//! bits).
//!
//! `MHC_GRAPH=1` times replays of one captured graph of the call instead of eager calls.

use holdfast_hal::{bf16, Buffer, Device, Element, Stream};
use holdfast_mhc::{
    HcHeadParams, HcHeadWeights, MhcConfig, MhcKernels, MhcOp, MhcOps, MhcPasses, MhcPostInputs, MhcPreOutputs,
    MhcPreParams, MhcPreWeights, MhcProjection, HC_MULT,
};

const USAGE: &str = "usage: mhc_case hc_head|mhc_pre|mhc_post|mhc_fused_post_pre H T ITERS";
const N: usize = HC_MULT;

fn main() {
    if let Err(e) = run() {
        eprintln!("mhc_case: {e}\n{USAGE}");
        std::process::exit(2);
    }
}

type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// A buffer of `len` elements from `f(i)`.
fn from_fn<T: Element>(dev: &Device, label: &str, len: usize, f: impl Fn(usize) -> T) -> Res<Buffer<T>> {
    let v: Vec<T> = (0..len.max(1)).map(f).collect();
    Ok(dev.alloc_from_slice(label, &v, true)?)
}

/// `MHC_PASSES` (`auto`, `one`, `two`; default `auto`): [`MhcPasses`].
fn passes() -> Res<MhcPasses> {
    match std::env::var("MHC_PASSES").as_deref() {
        Err(_) | Ok("auto") => Ok(MhcPasses::Auto),
        Ok("one") => Ok(MhcPasses::One),
        Ok("two") => Ok(MhcPasses::Two),
        Ok(other) => Err(format!("MHC_PASSES `{other}` (auto, one or two)").into()),
    }
}

fn run() -> Res<()> {
    let a: Vec<String> = std::env::args().skip(1).collect();
    if a.len() != 4 {
        return Err(format!("expected 4 arguments, got {}", a.len()).into());
    }
    let op = MhcOp::ALL.into_iter().find(|o| o.name() == a[0]).ok_or_else(|| format!("unknown op `{}`", a[0]))?;
    let num = |i: usize, what: &str| a[i].parse::<usize>().map_err(|e| format!("{what} `{}`: {e}", a[i]));
    let (h, t, iters) = (num(1, "H")?, num(2, "T")?, num(3, "ITERS")?);
    let (d, m) = (N * h, N * (N + 2));
    let dev = Device::open(&std::env::var("HOLDFAST_DEVICE").unwrap_or_else(|_| "cpu".into()))?;
    let graph = std::env::var("MHC_GRAPH").is_ok_and(|v| v == "1");
    let s = dev.create_stream()?;
    let kernels = MhcKernels::new(&dev)?;
    let ops = MhcOps::new(&dev, &kernels, MhcConfig { hc_mult: N, hidden: h, max_tokens: t.max(1) })?
        .with_projection(MhcProjection::Auto)
        .with_passes(passes()?);
    let pat = |i: usize, scale: f32| (((i.wrapping_mul(2_654_435_761) >> 20) & 255) as f32 / 128.0 - 1.0) * scale;
    let residual = from_fn(&dev, "residual", t * d, |i| bf16::from_f32(pat(i, 1.0)))?;
    let x = from_fn(&dev, "x", t * h, |i| bf16::from_f32(pat(i + 3, 1.0)))?;
    let post = from_fn(&dev, "post", t * N, |i| 0.5 + pat(i + 5, 0.25))?;
    let comb = from_fn(&dev, "comb", t * N * N, |i| 0.25 + pat(i + 7, 0.1))?;
    let fn_scale = 1.0 / (d as f32).sqrt();
    let head_fn = from_fn(&dev, "hc_head_fn", N * d, |i| pat(i + 11, fn_scale))?;
    let pre_fn = from_fn(&dev, "mhc_fn", m * d, |i| pat(i + 13, fn_scale))?;
    let (scale1, scale3) = (from_fn(&dev, "scale", 1, |_| 0.7f32)?, from_fn(&dev, "scale", 3, |_| 0.7f32)?);
    let (base_n, base_m) = (from_fn(&dev, "base", N, |_| 0.1f32)?, from_fn(&dev, "base", m, |_| 0.1f32)?);
    let out_row = dev.alloc_zeroed::<bf16>("out_row", (t * h).max(1), true)?;
    let out_residual = dev.alloc_zeroed::<bf16>("out_residual", (t * d).max(1), true)?;
    let post_out = dev.alloc_zeroed::<f32>("post_out", (t * N).max(1), true)?;
    let comb_out = dev.alloc_zeroed::<f32>("comb_out", (t * N * N).max(1), true)?;

    let (hf, pf, s1, s3, bn, bm) =
        (head_fn.view(), pre_fn.view(), scale1.view(), scale3.view(), base_n.view(), base_m.view());
    let pw = MhcPreWeights { hc_fn: &pf, scale: &s3, base: &bm };
    // The op over all T tokens on stream `st`.
    let call = |st: &Stream| -> Res<()> {
        let (r, row, ores) = (residual.prefix(t * d)?, out_row.prefix(t * h)?, out_residual.prefix(t * d)?);
        let (po, co) = (post_out.prefix(t * N)?, comb_out.prefix(t * N * N)?);
        let (xv, pv, cv) = (x.prefix(t * h)?, post.prefix(t * N)?, comb.prefix(t * N * N)?);
        let outs = MhcPreOutputs { post: &po, comb: &co, layer_input: &row };
        match op {
            MhcOp::HcHead => ops.hc_head(
                st,
                &r,
                &HcHeadWeights { hc_fn: &hf, scale: &s1, base: &bn },
                &HcHeadParams::default(),
                &row,
            )?,
            MhcOp::Pre => ops.pre(st, &r, &pw, &MhcPreParams::default(), &outs)?,
            MhcOp::Post => ops.post(st, &xv, &r, &pv, &cv, &ores)?,
            MhcOp::FusedPostPre => {
                let input = MhcPostInputs { x: &xv, residual: &r, post: &pv, comb: &cv };
                ops.fused_post_pre(st, &input, &pw, &MhcPreParams::default(), &ores, &outs)?
            }
        }
        Ok(())
    };
    let captured = if graph {
        s.begin_capture("mhc_case")?;
        if let Err(e) = call(&s) {
            s.abort_capture()?;
            return Err(e);
        }
        Some(s.end_capture()?)
    } else {
        None
    };
    let run_once = || -> Res<()> {
        match &captured {
            Some(g) => g.replay(&s)?,
            None => call(&s)?,
        }
        Ok(())
    };
    for _ in 0..iters {
        run_once()?;
    }
    s.synchronize()?;
    let start = std::time::Instant::now();
    for _ in 0..iters {
        run_once()?;
    }
    s.synchronize()?;
    let per_call = start.elapsed().as_secs_f64() * 1e6 / iters.max(1) as f64;
    let (row, ores) = (out_row.prefix(t * h)?, out_residual.prefix(t * d)?);
    let (po, co) = (post_out.prefix(t * N)?, comb_out.prefix(t * N * N)?);
    let mut hash = 0xcbf2_9ce4_8422_2325u64;
    let mut fold = |bits: u64| hash = (hash ^ bits).wrapping_mul(0x0100_0000_01b3);
    for v in s.copy_to_host_sync(&row)? {
        fold(u64::from(v.to_bits()));
    }
    for v in s.copy_to_host_sync(&ores)? {
        fold(u64::from(v.to_bits()));
    }
    for v in s.copy_to_host_sync(&po)?.into_iter().chain(s.copy_to_host_sync(&co)?) {
        fold(u64::from(v.to_bits()));
    }
    let bytes = op.bytes_moved(t, h);
    println!(
        "{} ({}): H {h}, T {t}, {} launch(es){}: {per_call:.1} µs per call, {bytes} bytes, {:.0} GB/s, output hash \
         {hash:016x}",
        op.name(),
        dev.info().name,
        ops.launch_configs(op, t).len(),
        if graph { " (graph replay)" } else { "" },
        bytes as f64 / per_call / 1e3,
    );
    Ok(())
}
