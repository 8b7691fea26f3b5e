//! The graph runner against the synthetic forward: every test is written once against `&Device`
//! and instantiated per backend by the HAL's `device_suite!` (always on `cpu`; on `cuda:0` when
//! built with the feature, printing a `skipped:` line when no CUDA device is usable).

mod common;

use common::{dispatcher, Bug, Rng, Synthetic};
use holdfast_graph::{
    BatchDescriptor, Dispatcher, GraphError, GraphMode, GraphRunner, ModeSet, PersistentArena, RunnerConfig,
    RuntimeMode, StepKind,
};
use holdfast_hal::{Device, HalError, Stream};

const MAX_SEQS: u32 = 16;
const MAX_TOKENS: u32 = 48;

fn setup(dev: &Device, mode: GraphMode, bug: Bug, config: RunnerConfig) -> (GraphRunner<Synthetic>, Dispatcher) {
    let fwd = Synthetic::new(dev, MAX_TOKENS as usize, bug).expect("synthetic forward");
    let d = dispatcher(mode, MAX_SEQS, MAX_TOKENS).expect("dispatcher");
    let arena = fwd.arena.clone();
    let r = GraphRunner::new(fwd, arena, &d, config).expect("runner");
    (r, d)
}

/// Runs one step of `n` tokens as dispatched, then the same inputs eagerly; returns the mode and
/// both outputs (first `n` rows).
fn step_and_reference(
    r: &mut GraphRunner<Synthetic>,
    d: &mut Dispatcher,
    s: &Stream,
    n: u32,
    uniform: bool,
    x: Vec<f32>,
    step: u32,
) -> Result<(RuntimeMode, Vec<f32>, Vec<f32>), GraphError> {
    let (mode, desc) = d.dispatch(n, uniform, false, 0, ModeSet::ALL, ModeSet::EMPTY)?;
    r.forward_mut().set_step(x, step);
    r.execute(s, mode, &desc)?;
    let got = r.forward().read_out(s, n as usize)?;
    r.execute(s, RuntimeMode::None, &BatchDescriptor::unpadded(n))?;
    let want = r.forward().read_out(s, n as usize)?;
    Ok((mode, got, want))
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn every_mode_replays_bit_identical_to_eager(dev: &Device) {
    let s = dev.create_stream().expect("stream");
    for mode in
        [GraphMode::None, GraphMode::Piecewise, GraphMode::Full, GraphMode::FullDecodeOnly, GraphMode::FullAndPiecewise]
    {
        let (mut r, mut d) = setup(dev, mode, Bug::None, RunnerConfig::default());
        r.capture_all(&s, |_, _, _| {}).expect("capture");
        let mut rng = Rng(0x5eed ^ mode.as_str().len() as u64);
        let mut seen = [0u64; 3];
        for step in 0..40 {
            let n = rng.range(1, MAX_TOKENS);
            let uniform = n <= MAX_SEQS && rng.next().is_multiple_of(2);
            let x = rng.values(n as usize);
            let (m, got, want) = step_and_reference(&mut r, &mut d, &s, n, uniform, x, step).expect("step");
            assert_eq!(bits(&got), bits(&want), "{mode}: step {step} ({n} tokens, {m}) differs from eager");
            seen[m as usize] += 1;
        }
        let st = r.stats();
        assert_eq!(st.recaptures, 0, "{mode}: no recapture after start-up");
        assert_eq!(st.replays(RuntimeMode::Full), seen[RuntimeMode::Full as usize]);
        assert_eq!(st.replays(RuntimeMode::Piecewise), seen[RuntimeMode::Piecewise as usize]);
        // One eager reference step per step, plus the eager steps dispatch chose.
        assert_eq!(st.eager_steps(), 40 + seen[RuntimeMode::None as usize]);
        if mode.has_full() {
            assert!(seen[RuntimeMode::Full as usize] > 0, "{mode}: some step replayed a FULL graph");
        }
        if mode.has_piecewise() {
            assert!(seen[RuntimeMode::Piecewise as usize] > 0, "{mode}: some step replayed pieces");
        }
        if mode == GraphMode::None {
            assert_eq!(st.graphs, 0);
        }
    }
}

fn capture_runs_piecewise_before_full_largest_first(dev: &Device) {
    let s = dev.create_stream().expect("stream");
    let (mut r, _d) = setup(dev, GraphMode::FullAndPiecewise, Bug::None, RunnerConfig::default());
    let order: Vec<_> = r.capture_order().to_vec();
    let mut progress = Vec::new();
    r.capture_all(&s, |done, total, desc| progress.push((done, total, *desc))).expect("capture");

    let total = order.len();
    assert_eq!(progress.len(), total);
    for (i, (done, t, desc)) in progress.iter().enumerate() {
        assert_eq!((*done, *t, *desc), (i + 1, total, order[i].1), "progress reports each graph in order");
    }
    let first_full = order.iter().position(|(m, _)| *m == RuntimeMode::Full).expect("full keys");
    assert!(first_full > 0, "piecewise keys come first");
    assert!(order[..first_full].iter().all(|(m, _)| *m == RuntimeMode::Piecewise));
    assert!(order[first_full..].iter().all(|(m, _)| *m == RuntimeMode::Full));
    for part in [&order[..first_full], &order[first_full..]] {
        assert!(part.windows(2).all(|w| w[0].1.num_tokens > w[1].1.num_tokens), "largest first: {part:?}");
    }
    // Per key: `warmups` warm-up prepares, then exactly one capture prepare, for that key.
    let log: Vec<_> = r.forward().log.clone();
    assert_eq!(log.len(), 2 * total);
    for (i, (_, desc)) in order.iter().enumerate() {
        assert_eq!(log[2 * i], (StepKind::WarmUp, *desc));
        assert_eq!(log[2 * i + 1], (StepKind::Capture, *desc));
    }
}

fn stats_count_graphs_memory_and_replays(dev: &Device) {
    let s = dev.create_stream().expect("stream");
    let (mut r, mut d) =
        setup(dev, GraphMode::FullAndPiecewise, Bug::None, RunnerConfig { warmups: 2, ..Default::default() });
    r.capture_all(&s, |_, _, _| {}).expect("capture");
    let st = r.stats();
    let pw = d.key_count(RuntimeMode::Piecewise);
    let full = d.key_count(RuntimeMode::Full);
    assert_eq!((st.piecewise_keys, st.full_graphs), (pw, full));
    assert_eq!(st.graphs, full + 3 * pw, "three pieces per piecewise key");
    assert_eq!(st.warmup_runs, 2 * (pw + full) as u64);
    assert!(st.capture_seconds > 0.0);
    let arena = r.arena().total_bytes() as u64;
    assert_eq!(st.graph_bytes, arena, "all graphs together use the arena once, whatever the number of sizes: {st:?}");
    assert!(st.largest_graph_bytes <= st.graph_bytes, "no graph uses more than all graphs together: {st:?}");
    assert!(st.graph_retained_bytes_sum > 2 * st.graph_bytes, "per-graph accounting would count the arena per graph");
    assert_eq!(r.forward().launches, 101, "the synthetic forward launches ~100 kernels (101 with the plan)");

    // 3 decode steps of 3 tokens: FULL (4 tokens); 2 mixed steps of 20 tokens: PIECEWISE (24).
    let mut rng = Rng(7);
    for i in 0..3 {
        let (m, ..) = step_and_reference(&mut r, &mut d, &s, 3, true, rng.values(3), i).expect("decode");
        assert_eq!(m, RuntimeMode::Full);
    }
    for i in 0..2 {
        let (m, ..) = step_and_reference(&mut r, &mut d, &s, 20, false, rng.values(20), i).expect("mixed");
        assert_eq!(m, RuntimeMode::Piecewise);
    }
    let st = r.stats();
    assert_eq!((st.replays(RuntimeMode::Full), st.replays(RuntimeMode::Piecewise), st.eager_steps()), (3, 2, 5));
    assert_eq!((st.piece_replays, st.splitting_op_runs), (6, 4));
    assert_eq!(st.recaptures, 0);
    let g = r.full_graph(&BatchDescriptor { num_reqs: Some(4), uniform: true, ..BatchDescriptor::unpadded(4) });
    assert_eq!(g.expect("full graph of 4").replays(), 3);

    // Capturing again at run time is counted, never hidden.
    r.capture(&s, RuntimeMode::Piecewise, &BatchDescriptor::unpadded(24)).expect("recapture");
    assert_eq!(r.stats().recaptures, 1);
}

fn lazy_capture_captures_on_first_use_only(dev: &Device) {
    let s = dev.create_stream().expect("stream");
    let cfg = RunnerConfig { lazy_capture: true, ..Default::default() };
    let (mut r, mut d) = setup(dev, GraphMode::FullAndPiecewise, Bug::None, cfg);
    let mut rng = Rng(11);
    for step in 0..12 {
        let n = [3, 20, 3, 20][step as usize % 4];
        let (_, got, want) =
            step_and_reference(&mut r, &mut d, &s, n, n == 3, rng.values(n as usize), step).expect("step");
        assert_eq!(bits(&got), bits(&want));
    }
    let st = r.stats();
    assert_eq!((st.lazy_captures, st.recaptures, st.full_graphs, st.piecewise_keys), (2, 0, 1, 1));
}

fn a_step_must_name_a_captured_key_exactly(dev: &Device) {
    let s = dev.create_stream().expect("stream");
    let (mut r, _d) = setup(dev, GraphMode::FullAndPiecewise, Bug::None, RunnerConfig::default());
    let full4 = BatchDescriptor { num_reqs: Some(4), uniform: true, ..BatchDescriptor::unpadded(4) };
    r.forward_mut().set_step(vec![0.0; 4], 0);
    assert_eq!(
        r.execute(&s, RuntimeMode::Full, &full4).err(),
        Some(GraphError::GraphNotCaptured { mode: RuntimeMode::Full, desc: full4 })
    );
    r.capture_all(&s, |_, _, _| {}).expect("capture");
    let off_key = BatchDescriptor { num_reqs: Some(3), ..full4 };
    assert_eq!(
        r.execute(&s, RuntimeMode::Full, &off_key).err(),
        Some(GraphError::UnknownGraphKey { mode: RuntimeMode::Full, desc: off_key })
    );
    let unpadded = BatchDescriptor::unpadded(5);
    assert!(matches!(r.execute(&s, RuntimeMode::Piecewise, &unpadded), Err(GraphError::UnknownGraphKey { .. })));
    r.execute(&s, RuntimeMode::Full, &full4).expect("the exact key replays");
}

/// Every key or arena the runner refuses, through each entry point: the variant, and the words its
/// message must contain (the mode, the descriptor and what to do instead).
fn every_rejected_key_or_arena_names_it(dev: &Device) {
    let s = dev.create_stream().expect("stream");
    let (mut r, _d) = setup(dev, GraphMode::FullAndPiecewise, Bug::None, RunnerConfig::default());
    let full4 = BatchDescriptor { num_reqs: Some(4), uniform: true, ..BatchDescriptor::unpadded(4) };
    let off_key = BatchDescriptor { num_reqs: Some(3), ..full4 };
    let unpadded = BatchDescriptor::unpadded(5);
    let fwd = Synthetic::new(dev, 8, Bug::None).expect("forward");
    let d = dispatcher(GraphMode::Full, 4, 8).expect("dispatcher");
    let unlocked = std::sync::Arc::new(PersistentArena::new(dev));
    type Case = holdfast_hal::testing::ErrorCase<GraphError, &'static [&'static str]>;
    let cases: Vec<Case> = vec![
        (
            "capture of a descriptor that is no key",
            r.capture(&s, RuntimeMode::Full, &off_key),
            |e| matches!(e, GraphError::UnknownGraphKey { mode: RuntimeMode::Full, .. }),
            &["no FULL graph key equals", "num_reqs=3", "one of its keys exactly"],
        ),
        (
            "capture in NONE",
            r.capture(&s, RuntimeMode::None, &unpadded),
            |e| matches!(e, GraphError::UnknownGraphKey { mode: RuntimeMode::None, .. }),
            &["no NONE graph key equals", "num_tokens=5"],
        ),
        (
            "replay of a key not captured",
            r.execute(&s, RuntimeMode::Full, &full4),
            |e| matches!(e, GraphError::GraphNotCaptured { mode: RuntimeMode::Full, .. }),
            &["FULL graph for", "num_tokens=4", "has not been captured", "capture_all", "lazy capture"],
        ),
        (
            "replay of a descriptor that is no key",
            r.execute(&s, RuntimeMode::Piecewise, &unpadded),
            |e| matches!(e, GraphError::UnknownGraphKey { mode: RuntimeMode::Piecewise, .. }),
            &["no PIECEWISE graph key equals", "num_tokens=5"],
        ),
        (
            "runner over an unlocked arena",
            GraphRunner::new(fwd, unlocked, &d, RunnerConfig::default()).map(|_| ()),
            |e| matches!(e, GraphError::ArenaNotLocked),
            &["persistent arena must be locked"],
        ),
    ];
    holdfast_hal::testing::check_errors(cases);
    assert_eq!(r.stats().graphs, 0, "no rejected call captured anything");
}

fn the_runner_needs_a_locked_arena(dev: &Device) {
    let fwd = Synthetic::new(dev, 8, Bug::None).expect("forward");
    let d = dispatcher(GraphMode::Full, 4, 8).expect("dispatcher");
    let unlocked = std::sync::Arc::new(PersistentArena::new(dev));
    assert_eq!(GraphRunner::new(fwd, unlocked, &d, RunnerConfig::default()).err(), Some(GraphError::ArenaNotLocked));
}

fn a_fresh_buffer_per_step_in_a_capture_is_not_graph_stable(dev: &Device) {
    let s = dev.create_stream().expect("stream");
    for mode in [GraphMode::Full, GraphMode::Piecewise] {
        let (mut r, mut d) = setup(dev, mode, Bug::FreshBufferPerStep, RunnerConfig::default());
        // Eagerly the forward is fine ...
        step_and_reference(&mut r, &mut d, &s, MAX_TOKENS, false, vec![0.5; MAX_TOKENS as usize], 0)
            .expect("eager step");
        // ... but no graph can bake in a buffer that is replaced every step.
        let err = r.capture_all(&s, |_, _, _| {}).expect_err("capture must fail");
        assert!(matches!(err, GraphError::CaptureFailed { .. }), "{err}");
        match err.hal() {
            Some(HalError::NotGraphStable { buffer, .. }) => assert_eq!(buffer, "fresh per-step scratch"),
            other => panic!("{mode}: expected NotGraphStable, got {other:?} ({err})"),
        }
        assert!(!s.is_capturing(), "a failed capture leaves the stream idle");
        assert_eq!(r.stats().graphs, 0, "a failed capture stores nothing");
    }
}

fn a_data_dependent_view_length_is_an_input_view_mismatch(dev: &Device) {
    let s = dev.create_stream().expect("stream");
    for mode in [GraphMode::Full, GraphMode::Piecewise] {
        let (mut r, mut d) = setup(dev, mode, Bug::DataDependentView, RunnerConfig::default());
        r.capture_all(&s, |_, _, _| {}).expect("capture (dummy inputs have the padded length)");
        // 4 tokens is a capture size: the view happens to match.
        step_and_reference(&mut r, &mut d, &s, 4, true, vec![0.25; 4], 0).expect("exact size");
        // 3 tokens pad to 4: the view the forward hands over has 3 rows, the graph recorded 4.
        let err = step_and_reference(&mut r, &mut d, &s, 3, true, vec![0.25; 3], 1).expect_err("mismatch");
        match err.hal() {
            Some(HalError::InputViewMismatch { input, .. }) => assert_eq!(input, "x"),
            other => panic!("{mode}: expected InputViewMismatch, got {other:?} ({err})"),
        }
    }
}

fn a_splitting_op_writing_a_fresh_buffer_is_an_error(dev: &Device) {
    let s = dev.create_stream().expect("stream");
    let (mut r, mut d) = setup(dev, GraphMode::Piecewise, Bug::SplittingOpFreshOutput, RunnerConfig::default());
    let err = r.capture_all(&s, |_, _, _| {}).expect_err("capture must fail");
    assert_eq!(
        err.root(),
        &GraphError::SplittingOpOutputNotPersistent { op: "attn0".into(), buffer: "fresh attention output".into() }
    );
    assert!(!s.is_capturing());
    // Caught eagerly too, so the bug shows before any graph exists.
    r.forward_mut().set_step(vec![1.0; 5], 0);
    let (m, desc) = d.dispatch(50, false, false, 0, ModeSet::ALL, ModeSet::EMPTY).expect("dispatch");
    assert_eq!(m, RuntimeMode::None);
    let err = r.execute(&s, RuntimeMode::None, &BatchDescriptor::unpadded(5)).expect_err("eager");
    assert!(matches!(err, GraphError::SplittingOpOutputNotPersistent { .. }), "{err} ({desc})");
}

/// The sanitizer counts host writes per buffer, so the first replay of the 8-token graph may still
/// consume the dummy upload of a later (smaller) key's capture; from the next replay on, a step
/// that forgot its upload is caught.
fn a_replay_with_inputs_not_rewritten_is_stale(dev: &Device) {
    let s = dev.create_stream().expect("stream");
    let (mut r, mut d) = setup(dev, GraphMode::Full, Bug::ForgetsInput, RunnerConfig::default());
    r.capture_all(&s, |_, _, _| {}).expect("capture");
    let _ = step_and_reference(&mut r, &mut d, &s, 8, false, vec![0.5; 8], 0);
    let err = step_and_reference(&mut r, &mut d, &s, 8, false, vec![0.5; 8], 1).expect_err("stale input");
    match err.hal() {
        Some(HalError::StaleHostInput { buffer, .. }) => assert_eq!(buffer, "x"),
        other => panic!("expected StaleHostInput, got {other:?} ({err})"),
    }
}

fn a_piecewise_step_must_run_the_captured_pieces(dev: &Device) {
    let s = dev.create_stream().expect("stream");
    let (mut r, mut d) = setup(dev, GraphMode::Piecewise, Bug::SkipsLastPieceInSteps, RunnerConfig::default());
    r.capture_all(&s, |_, _, _| {}).expect("capture runs all three pieces");
    let err = step_and_reference(&mut r, &mut d, &s, 8, false, vec![0.5; 8], 0).expect_err("piece count");
    assert!(
        matches!(&err, GraphError::PieceMismatch { desc, detail } if desc.num_tokens == 8 && detail.contains("ran 2 pieces, but 3")),
        "{err}"
    );
}

/// The #42444 bug: the plan is built lazily on first use. Without fresh state between warm-up
/// and capture, warm-up builds it (from dummy metadata), the capture takes the "already planned"
/// branch, and every replay reuses the warm-up's stale plan. With the hook, the capture records
/// the planning kernel and replays are exact.
fn lazy_state_must_be_initialised_inside_the_capture(dev: &Device) {
    let s = dev.create_stream().expect("stream");
    for mode in [GraphMode::FullDecodeOnly, GraphMode::Piecewise] {
        for fresh in [false, true] {
            let cfg = RunnerConfig { fresh_state_before_capture: fresh, ..Default::default() };
            let (mut r, mut d) = setup(dev, mode, Bug::None, cfg);
            r.capture_all(&s, |_, _, _| {}).expect("capture");
            let mut rng = Rng(3);
            let mut wrong = 0;
            for step in 0..6 {
                let x = rng.values(8);
                let (m, got, want) = step_and_reference(&mut r, &mut d, &s, 8, true, x, step).expect("step");
                assert_ne!(m, RuntimeMode::None);
                wrong += usize::from(bits(&got) != bits(&want));
            }
            if fresh {
                assert_eq!(wrong, 0, "{mode}: with fresh state the capture records the plan");
            } else {
                assert_eq!(wrong, 6, "{mode}: without fresh state every replay uses the warm-up's stale plan");
            }
        }
    }
}

fn views_for_smaller_sizes_are_prefixes_at_the_same_address(dev: &Device) {
    let fwd = Synthetic::new(dev, 32, Bug::None).expect("forward");
    let a = &fwd.arena;
    for name in ["x", "h", "out"] {
        let base = a.get::<f32>(name).expect("buffer").addr();
        for n in [1, 4, 32] {
            assert_eq!(a.view::<f32>(name, n).expect("view").addr(), base);
        }
    }
    assert!(a.is_locked(), "the forward's arena is locked before any graph is captured");
    assert_eq!(a.bytes("workspace").expect("workspace"), 3 * 32 * 4, "one workspace shared by every size");
}

holdfast_hal::device_suite!(
    every_mode_replays_bit_identical_to_eager,
    capture_runs_piecewise_before_full_largest_first,
    stats_count_graphs_memory_and_replays,
    lazy_capture_captures_on_first_use_only,
    a_step_must_name_a_captured_key_exactly,
    every_rejected_key_or_arena_names_it,
    the_runner_needs_a_locked_arena,
    a_fresh_buffer_per_step_in_a_capture_is_not_graph_stable,
    a_data_dependent_view_length_is_an_input_view_mismatch,
    a_splitting_op_writing_a_fresh_buffer_is_an_error,
    lazy_state_must_be_initialised_inside_the_capture,
    a_replay_with_inputs_not_rewritten_is_stale,
    a_piecewise_step_must_run_the_captured_pieces,
    views_for_smaller_sizes_are_prefixes_at_the_same_address,
);
