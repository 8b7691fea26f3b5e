//! Times one decode attention case, for profilers (Nsight Compute, Nsight Systems) and quick
//! comparisons between kernels:
//!
//! ```text
//! HOLDFAST_DEVICE=cuda:0 cargo run --release -p holdfast-attention --features cuda \
//!     --example attention_case -- KERNEL HEADS BATCH EXTRA ITERS
//! ```
//!
//! `KERNEL` is `auto`, `portable`, `mma` (the tensor-core kernel) or `warpgroup`, optionally with
//! its row split (`warpgroup/4`; plain `auto` takes the split a runner serving `BATCH` rows takes,
//! [`SparseAttention::throughput_split`], as the report's default rows do); each of the `BATCH`
//! rows attends over a window of 128 distinct slots plus `EXTRA` more (head_dim 512, the bench's
//! layout, patterned values). It
//! prints the mean time per call over `ITERS` calls after as many warm-up calls, and a hash of the
//! output (equal hashes: equal bits).

use holdfast_attention::{AttentionKernel, RaggedKv, SparseAttention};
use holdfast_hal::{bf16, Device};

const USAGE: &str = "usage: attention_case auto|portable|mma|warpgroup[/SPLIT] HEADS BATCH EXTRA ITERS";

fn main() {
    if let Err(e) = run() {
        eprintln!("attention_case: {e}\n{USAGE}");
        std::process::exit(2);
    }
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let a: Vec<String> = std::env::args().skip(1).collect();
    if a.len() != 5 {
        return Err(format!("expected 5 arguments, got {}", a.len()).into());
    }
    let (name, split) = match a[0].split_once('/') {
        Some((n, s)) => (n, Some(s.parse::<usize>().map_err(|e| format!("split `{s}`: {e}"))?)),
        None => (a[0].as_str(), None),
    };
    let kernel = match name {
        "auto" => AttentionKernel::Auto,
        "portable" => AttentionKernel::Portable,
        "mma" => AttentionKernel::TensorCore,
        "warpgroup" => AttentionKernel::Warpgroup,
        other => return Err(format!("unknown kernel `{other}`").into()),
    };
    let num = |i: usize, what: &str| a[i].parse::<usize>().map_err(|e| format!("{what} `{}`: {e}", a[i]));
    let (heads, batch, extra, iters) = (num(1, "HEADS")?, num(2, "BATCH")?, num(3, "EXTRA")?, num(4, "ITERS")?);
    let (d, window) = (512usize, 128usize);
    let dev = Device::open(&std::env::var("HOLDFAST_DEVICE").unwrap_or_else(|_| "cpu".into()))?;
    let s = dev.create_stream()?;
    let mut k = SparseAttention::with_kernel(&dev, heads, d, kernel)?;
    // `auto` without a split runs what a runner serving batches of `BATCH` rows runs (the
    // report's default rows): the throughput split for that many rows.
    let split = match (kernel, split) {
        (AttentionKernel::Auto, None) if k.uses_warpgroup() => Some(k.throughput_split(batch)),
        _ => split,
    };
    if let Some(n) = split {
        k = k.with_warpgroup_split(&dev, n)?;
    }
    let per_row = window + extra;
    let pattern = |i: usize, scale: f32| {
        bf16::from_f32((((i.wrapping_mul(2_654_435_761) >> 20) & 255) as f32 / 128.0 - 1.0) * scale)
    };
    let cache: Vec<bf16> = (0..batch * per_row * d).map(|i| pattern(i, 0.5)).collect();
    let cache = dev.alloc_from_slice("cache", &cache, true)?;
    let mi: Vec<i32> = (0..batch).flat_map(|r| (0..window).map(move |j| (r * per_row + j) as i32)).collect();
    let ei: Vec<i32> = (0..batch).flat_map(|r| (0..extra).map(move |j| (r * per_row + window + j) as i32)).collect();
    let mp: Vec<i32> = (0..=batch).map(|r| (r * window) as i32).collect();
    let ep: Vec<i32> = (0..=batch).map(|r| (r * extra) as i32).collect();
    let up = |l: &str, v: &[i32]| dev.alloc_from_slice(l, if v.is_empty() { &[0] } else { v }, true);
    let (mib, mpb, eib, epb) =
        (up("main_idx", &mi)?, up("main_indptr", &mp)?, up("extra_idx", &ei)?, up("extra_indptr", &ep)?);
    let q: Vec<bf16> = (0..batch * heads * d).map(|i| pattern(i + 7, 1.0)).collect();
    let q = dev.alloc_from_slice("q", &q, true)?;
    let out = dev.alloc_zeroed::<bf16>("out", batch * heads * d, true)?;
    let sink = dev.alloc_from_slice("sink", &vec![0.0f32; heads], true)?;
    let (cv, miv, mpv, eiv, epv) = (cache.view(), mib.view(), mpb.view(), eib.view(), epb.view());
    let (qv, sv, ov) = (q.view(), sink.view(), out.view());
    let main = RaggedKv { cache: &cv, indices: &miv, indptr: &mpv };
    let ex = RaggedKv { cache: &cv, indices: &eiv, indptr: &epv };
    let scale = 1.0 / (d as f32).sqrt();
    for _ in 0..iters {
        k.attend(&s, &qv, &main, Some(&ex), &sv, &ov, scale)?;
    }
    s.synchronize()?;
    let t = std::time::Instant::now();
    for _ in 0..iters {
        k.attend(&s, &qv, &main, Some(&ex), &sv, &ov, scale)?;
    }
    s.synchronize()?;
    let per_call = t.elapsed().as_secs_f64() * 1e6 / iters.max(1) as f64;
    let got = s.copy_to_host_sync(&ov)?;
    let hash =
        got.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, v| (h ^ u64::from(v.to_bits())).wrapping_mul(0x0100_0000_01b3));
    println!(
        "{} ({}): {} heads, batch {batch}, {per_row} entries per row: {per_call:.1} µs per call, output hash {hash:016x}",
        a[0],
        dev.info().name,
        heads
    );
    Ok(())
}
