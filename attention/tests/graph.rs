//! One decode step's metadata (upload, SWA, c128a, c4a) plus a consumer captured as one graph and
//! replayed over fresh random batches staged into the same pinned memory, and over a growing decode
//! whose steps carry only block-table updates (appends at block starts, a row reused by a new
//! request, one long admission applied eagerly before its replay): every replay equals the eager
//! build and the reference. A builder that hands out a non-persistent ragged buffer is
//! rejected at capture.

mod common;

use common::*;
use holdfast_attention::{
    C128aBuilder, C4aBuilder, CommonAttentionMetadata, CommonConfig, Ragged, StepLayout, SwaBuilder,
};
use holdfast_hal::{
    Buffer, CpuLaunch, Device, HalError, Kernel, KernelEntry, KernelSource, LaunchConfig, Param, ScalarKind, Stream,
};

const CONSUMER: &str = r#"
// sums[r] = sum of indices[indptr[r] .. indptr[r + 1]] (wrapping), one block per row.
HF_KERNEL void ragged_row_sum(const int32_t* indptr, const int32_t* indices, int32_t* sums, uint32_t rows) {
    for (uint32_t r = blockIdx.x; r < rows; r += gridDim.x) {
        if (threadIdx.x == 0) {
            int32_t acc = 0;
            for (int32_t k = indptr[r]; k < indptr[r + 1]; ++k) acc += indices[k];
            sums[r] = acc;
        }
    }
}
"#;

fn row_sum(l: &CpuLaunch<'_>) -> holdfast_hal::Result<()> {
    let (indptr, indices, sums, rows) = (l.ptr::<i32>(0)?, l.ptr::<i32>(1)?, l.ptr::<i32>(2)?, l.count(3)?);
    for r in 0..rows {
        let (a, b) = (indptr.get(r)?, indptr.get(r + 1)?);
        let mut acc = 0i32;
        for k in a..b {
            acc = acc.wrapping_add(indices.get_signed(i64::from(k))?);
        }
        sums.set(r, acc)?;
    }
    Ok(())
}

fn consumer_source() -> KernelSource {
    KernelSource {
        name: "attention_test_consumer",
        code: CONSUMER,
        entries: vec![KernelEntry {
            name: "ragged_row_sum",
            params: vec![
                Param::input::<i32>("indptr"),
                Param::input::<i32>("indices"),
                Param::output::<i32>("sums"),
                Param::scalar("rows", ScalarKind::U32),
            ],
            cpu: row_sum,
        }],
    }
}

fn consume(s: &Stream, k: &Kernel, r: &Ragged, sums: &Buffer<i32>, slot: usize) {
    let out = sums.slice(slot * r.rows, r.rows).expect("sums view");
    s.launch(
        k,
        LaunchConfig::blocks(r.rows.max(1) as u32, 32),
        &[(&r.indptr).into(), (&r.indices).into(), (&out).into(), (r.rows as u32).into()],
    )
    .expect("consumer");
}

fn wrapping_sums(rows: &[Vec<i32>]) -> Vec<i32> {
    rows.iter().map(|r| r.iter().fold(0i32, |a, &v| a.wrapping_add(v))).collect()
}

struct Step {
    common: CommonAttentionMetadata,
    swa: SwaBuilder,
    c128a: C128aBuilder,
    c4a: C4aBuilder,
    topk_staging: holdfast_hal::PinnedBuffer<i32>,
    topk: Buffer<i32>,
    consumer: Kernel,
    sums: Buffer<i32>,
    k: usize,
    /// Branches for the c128a and c4a builds (and their consumers) while capturing, if set.
    side: Option<[Stream; 2]>,
}

impl Step {
    /// The builders for `cfg` (SWA window `window`, c4a top-k `k`) and `rows` poisoned sums.
    fn new(dev: &Device, cfg: CommonConfig, rows: usize, window: usize, k: usize) -> Step {
        Step {
            common: CommonAttentionMetadata::new(dev, cfg).expect("common"),
            swa: SwaBuilder::new(dev, &cfg, window).expect("swa"),
            c128a: C128aBuilder::new(dev, &cfg).expect("c128a"),
            c4a: C4aBuilder::new(dev, &cfg, k).expect("c4a"),
            topk_staging: dev.alloc_pinned::<i32>(cfg.max_num_batched_tokens * k).expect("pinned"),
            topk: dev.alloc_persistent::<i32>("indexer.topk", cfg.max_num_batched_tokens * k).expect("topk"),
            consumer: dev.compile(&consumer_source()).expect("consumer").kernel("ragged_row_sum").expect("k"),
            sums: dev.alloc_from_slice("sums", &vec![POISON; 3 * rows], true).expect("sums"),
            k,
            side: None,
        }
    }

    /// The same, capturing the c128a and c4a builds on branches forked after the upload.
    fn forked(mut self, dev: &Device) -> Step {
        self.side = Some([dev.create_stream().expect("side"), dev.create_stream().expect("side")]);
        self
    }

    /// Replays `graph` (the staged step) and checks its sums against `want`; then poisons every
    /// output, runs the same step eagerly and checks it gives the replay's sums.
    fn replay_then_eager(
        &self,
        dev: &Device,
        s: &Stream,
        graph: &holdfast_hal::Graph,
        rows: usize,
        want: &[i32],
        i: usize,
    ) {
        graph.replay(s).expect("replay");
        let replayed = s.copy_to_host_sync(&self.sums.view()).expect("read");
        assert_eq!(replayed, want, "step {i}: replay vs reference");
        self.swa.fill_outputs(s, POISON).expect("poison");
        self.c128a.fill_outputs(s, POISON).expect("poison");
        self.c4a.fill_outputs(s, POISON).expect("poison");
        dev.write_sync(&self.sums, &vec![POISON; 3 * rows]).expect("poison sums");
        self.run(s, rows);
        let eager = s.copy_to_host_sync(&self.sums.view()).expect("read");
        assert_eq!(eager, replayed, "step {i}: eager vs replay");
    }

    /// Upload + three builds + three consumers: what a FULL decode graph holds. With side
    /// streams and `s` capturing, the c128a and c4a builds and their consumers are branches.
    fn run(&self, s: &Stream, rows: usize) -> StepLayout {
        self.common.upload(s).expect("upload");
        s.copy_from_pinned(&self.topk_staging, 0, &self.topk.prefix(rows * self.k).expect("topk view")).expect("topk");
        let side = self.side.as_ref().filter(|_| s.is_capturing());
        let (a, b) = match side {
            Some([a, b]) => {
                s.fork_capture(a).expect("fork");
                s.fork_capture(b).expect("fork");
                (a, b)
            }
            None => (s, s),
        };
        let c128a = self.c128a.build(a, &self.common).expect("c128a");
        consume(a, &self.consumer, &c128a.decode.expect("c128a decode").ragged, &self.sums, 1);
        let c4a = self.c4a.build(b, &self.common, &self.topk.prefix(rows * self.k).expect("topk")).expect("c4a");
        consume(b, &self.consumer, &c4a.decode.expect("c4a decode").ragged, &self.sums, 2);
        let swa = self.swa.build(s, &self.common).expect("swa");
        consume(s, &self.consumer, &swa.decode.expect("swa decode").ragged, &self.sums, 0);
        if let Some([a, b]) = side {
            s.join_capture(a).expect("join");
            s.join_capture(b).expect("join");
        }
        swa.layout
    }
}

fn decode_step_replays_equal_eager_over_fresh_batches(dev: &Device) {
    replays_equal_eager_over_fresh_batches(dev, false);
}

fn builds_on_forked_branches_replay_equal_eager(dev: &Device) {
    replays_equal_eager_over_fresh_batches(dev, true);
}

/// 50 fresh random batches through one captured step (its c128a and c4a builds on forked
/// branches if `forked`), each replay checked against the reference and against eager.
fn replays_equal_eager_over_fresh_batches(dev: &Device, forked: bool) {
    let s = dev.create_stream().expect("stream");
    let (rows, window, k) = (8usize, 128usize, 64usize);
    let cfg: CommonConfig = config(64, 16, 8192, 0, 64, 256);
    let step = Step::new(dev, cfg, rows, window, k);
    let step = if forked { step.forked(dev) } else { step };
    let mut rng = Rng(0xC0FFEE);
    let mut step = step;
    let stage = |step: &mut Step, rng: &mut Rng| {
        let real = rng.range(1, rows as i64) as usize;
        let mut b = random_batch(rng, &cfg, real, 0, 0, 0);
        b.reqs_padded = rows;
        b.tokens_padded = rows;
        let l = step.common.stage(&b.input()).expect("stage");
        assert_eq!(l.num_decode_tokens, rows);
        let topk = random_topk(rng, &b, rows, k);
        step.topk_staging.write(0, &topk).expect("stage topk");
        (b, topk, l)
    };

    // Warm-up step (eager), then capture at the same padded size.
    let _ = stage(&mut step, &mut rng);
    step.run(&s, rows);
    s.synchronize().expect("sync");
    let syncs = dev.stats().host_syncs;
    s.begin_capture("dsv4 decode metadata").expect("begin");
    step.run(&s, rows);
    let graph = s.end_capture().expect("end capture");
    assert_eq!(dev.stats().host_syncs, syncs, "capture made no host sync");

    for i in 0..50 {
        let (b, topk, l) = stage(&mut step, &mut rng);
        let want: Vec<i32> = [
            wrapping_sums(&swa_ref(&b, &cfg, &l, window)),
            wrapping_sums(&c128a_decode_ref(&b, &cfg, &l)),
            wrapping_sums(&c4a_ref(&b, &cfg, &l, &topk, k)),
        ]
        .concat();
        // Whole random rows each step: more cells than a captured upload applies.
        step.common.apply_bulk_table_updates(&s).expect("bulk updates");
        step.replay_then_eager(dev, &s, &graph, rows, &want, i);
    }
    assert_eq!(graph.replays(), 50);
}

fn incremental_block_table_updates_replay_across_steps(dev: &Device) {
    let s = dev.create_stream().expect("stream");
    let (rows, window, k) = (8usize, 128usize, 64usize);
    let mut cfg: CommonConfig = config(64, 16, 8192, 0, 64, 256);
    // Room for decode growth only: every step but the long admission rides in the captured upload.
    cfg.max_table_updates = 128;
    let growth = cfg.swa_table.growth_cells(64, 16) + cfg.kv_table.growth_cells(64, 16);
    assert_eq!(cfg.step_update_cells(), growth);
    let mut step = Step::new(dev, cfg, rows, window, k);
    let mut rng = Rng(0x1AC4);
    // Six decodes on scattered table rows, two padded rows; contexts next to block starts.
    let mut seq = vec![60usize, 63, 255, 256, 1, 700];
    let mut b = decode_batch(&cfg, &mut rng, &seq, &[15, 10, 12, 11, 14, 13], rows - seq.len());
    for r in 0..seq.len() {
        push_used(&cfg, &mut b, r, [0, 0]);
    }
    step.common.stage(&b.input()).expect("first step");
    step.run(&s, rows);
    s.synchronize().expect("sync");
    s.begin_capture("decode metadata, persistent block tables").expect("begin");
    step.run(&s, rows);
    let graph = s.end_capture().expect("end capture");

    let (ws, wk) = (cfg.swa_table.max_blocks_per_seq, cfg.kv_table.max_blocks_per_seq);
    let (mut updates, mut bulk_steps) = (0, 0);
    for i in 0..48 {
        b.updates.clear();
        for (r, len) in seq.iter_mut().enumerate() {
            let fresh = match (i, r) {
                (20, 1) => Some(300),  // finishes; a new request takes its table row
                (36, 4) => Some(5000), // a long context arrives: more cells than the captured upload
                _ => None,
            };
            let had = match fresh {
                Some(fresh) => {
                    step.common.release_table_row(b.table_rows[r] as usize).expect("release");
                    *len = fresh;
                    for j in 0..ws {
                        b.swa_bt[r * ws + j] = 1 + rng.below(4095) as i32;
                    }
                    for j in 0..wk {
                        b.kv_bt[r * wk + j] = 1 + rng.below(4095) as i32;
                    }
                    [0, 0]
                }
                None => {
                    let had = [len.div_ceil(64), len.div_ceil(256)];
                    *len += 1;
                    had
                }
            };
            b.seq_lens[r] = *len as i32;
            b.positions[r] = *len as i32 - 1;
            push_used(&cfg, &mut b, r, had);
        }
        updates += b.updates.len();
        let l = step.common.stage(&b.input()).expect("stage");
        let topk = random_topk(&mut rng, &b, rows, k);
        step.topk_staging.write(0, &topk).expect("stage topk");
        let want: Vec<i32> = [
            wrapping_sums(&swa_ref(&b, &cfg, &l, window)),
            wrapping_sums(&c128a_decode_ref(&b, &cfg, &l)),
            wrapping_sums(&c4a_ref(&b, &cfg, &l, &topk, k)),
        ]
        .concat();
        // The graph applies the step's updates itself; a bulk step's go first, eagerly.
        bulk_steps += usize::from(step.common.apply_bulk_table_updates(&s).expect("bulk") > 0);
        step.replay_then_eager(dev, &s, &graph, rows, &want, i);
    }
    assert_eq!(bulk_steps, 1, "only the long admission exceeds the captured upload");
    assert!((8..=30).contains(&updates), "decode steps append only at block starts: {updates} updates");
    assert_eq!(graph.replays(), 48);
}

fn a_builder_with_a_fresh_ragged_buffer_is_rejected_at_capture(dev: &Device) {
    let s = dev.create_stream().expect("stream");
    let cfg = config(16, 4, 1024, 0, 64, 256);
    let mut common = CommonAttentionMetadata::new(dev, cfg).expect("common");
    // The planted bug: ragged outputs in transient (non-persistent) memory, as vLLM's fresh
    // `build_ragged_indices_from_dense` tensors are.
    let transient = |dev: &Device, label: &str, len: usize| {
        if label.contains("ragged") {
            dev.alloc::<i32>(label, len)
        } else {
            dev.alloc_persistent::<i32>(label, len)
        }
    };
    let swa = SwaBuilder::new_with_alloc(dev, &cfg, 128, &transient).expect("swa");
    let mut rng = Rng(5);
    let mut b = random_batch(&mut rng, &cfg, 3, 0, 0, 0);
    b.reqs_padded = 4;
    b.tokens_padded = 4;
    common.stage(&b.input()).expect("stage");
    common.upload(&s).expect("eager upload");
    swa.build(&s, &common).expect("eager builds are fine");
    s.begin_capture("planted").expect("begin");
    common.upload(&s).expect("captured upload");
    let err = swa.build(&s, &common).expect_err("a non-persistent ragged buffer cannot be captured");
    // The builder's one decode launch writes the ragged outputs itself.
    match err {
        holdfast_attention::AttentionError::Hal(HalError::NotGraphStable { ref buffer, .. }) => {
            assert!(buffer.starts_with("attn.swa.ragged"), "{err}")
        }
        other => panic!("expected NotGraphStable, got {other:?}"),
    }
    s.abort_capture().expect("abort");

    // The correct builder captures.
    let good = SwaBuilder::new(dev, &cfg, 128).expect("swa");
    s.begin_capture("good").expect("begin");
    common.upload(&s).expect("upload");
    good.build(&s, &common).expect("persistent buffers capture");
    s.end_capture().expect("end");
}

holdfast_hal::device_suite!(
    decode_step_replays_equal_eager_over_fresh_batches,
    builds_on_forked_branches_replay_equal_eager,
    incremental_block_table_updates_replay_across_steps,
    a_builder_with_a_fresh_ragged_buffer_is_rejected_at_capture
);

#[cfg(feature = "cuda")]
#[test]
fn attention_kernels_compile_for_sm_90_with_nvrtc() {
    use holdfast_hal::cuda;
    if let Some(reason) = cuda::nvrtc_unavailable_reason() {
        assert!(std::env::var_os("HOLDFAST_REQUIRE_NVRTC").is_none(), "NVRTC is required here: {reason}");
        eprintln!("skipped: NVRTC is not available ({reason})");
        return;
    }
    let (cubin, _) = cuda::compile(holdfast_attention::source::source(), "sm_90", 32).expect("compiles");
    assert!(!cubin.is_empty());
    let (cubin, _) = cuda::compile(&consumer_source(), "sm_90", 32).expect("consumer compiles");
    assert!(!cubin.is_empty());
}

#[cfg(feature = "rocm")]
#[test]
fn attention_kernels_compile_for_gfx90a_with_hiprtc() {
    holdfast_hal::testing::assert_compiles_for_gfx90a(holdfast_attention::source::source());
    holdfast_hal::testing::assert_compiles_for_gfx90a(&consumer_source());
}
