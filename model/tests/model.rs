//! End-to-end tests of the `tiny` model: configuration errors, bit-identical steps across the five
//! graph modes, batch invariance across concurrency and prefill chunking, and the runner's input
//! checks. On the CPU backend always; the CPU-vs-cuda logits comparison runs with `--features cuda`.

use std::collections::BTreeMap;

use half::bf16;
use holdfast_attention::BlockTableConfig;
use holdfast_graph::{BatchDescriptor, Forward, GraphMode, RuntimeMode, StepKind};
use holdfast_hal::testing::{check_errors, words, ErrorCase};
use holdfast_hal::Device;
use holdfast_model::scheduler::{Request, Step};
use holdfast_model::weights::Init;
use holdfast_model::{
    ForwardLimits, ModelConfig, ModelError, ModelForward, ModelRunner, RunnerSettings, SeededInit, Shard, WeightSource,
    Weights,
};

fn settings(mode: GraphMode) -> RunnerSettings {
    RunnerSettings {
        graph_mode: mode,
        max_num_seqs: 8,
        max_num_batched_tokens: 64,
        max_model_len: 512,
        capture_sizes: Some(vec![1, 2, 4, 8, 16, 32, 48, 64]),
        seed: 7,
        ..Default::default()
    }
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// Requests with prompts from 1 to `max_prompt` tokens (some past the 128-token c128a window).
fn workload(seed: u64, n: usize, max_prompt: u64, vocab: u64) -> Vec<Request> {
    let mut rng = Rng(seed | 1);
    (0..n as u64)
        .map(|id| {
            let len = 1 + rng.below(max_prompt) as usize;
            Request {
                id,
                prompt: (0..len).map(|_| rng.below(vocab) as i32).collect(),
                max_new_tokens: 1 + rng.below(12) as usize,
            }
        })
        .collect()
}

/// One run's record: per step the sampled tokens, the logits' bits and the mode; per request
/// the generated tokens.
#[derive(Debug, Default)]
struct Record {
    steps: Vec<(Vec<i32>, Vec<u32>)>,
    modes: [u64; 3],
    outputs: BTreeMap<u64, Vec<i32>>,
}

fn run(dev: &Device, cfg: &ModelConfig, s: &RunnerSettings, requests: Vec<Request>, keep_logits: bool) -> Record {
    let mut runner = ModelRunner::new(dev, cfg, s).expect("runner");
    runner.capture_all(|_, _, _| {}).expect("capture");
    let mut sched = runner.scheduler().expect("scheduler");
    for r in requests {
        sched.add(r).expect("add");
    }
    let mut rec = Record::default();
    while let Some(step) = sched.schedule().expect("schedule") {
        let res = runner.execute(&step).expect("execute");
        rec.modes[res.mode as usize] += 1;
        let logits = if keep_logits {
            runner.logits(res.tokens.len()).expect("logits").iter().map(|v| v.to_bits()).collect()
        } else {
            Vec::new()
        };
        assert!(logits.iter().all(|&b| f32::from_bits(b).is_finite()), "non-finite logits");
        rec.steps.push((res.tokens.clone(), logits));
        for f in sched.update(&step, &res.tokens).expect("update") {
            assert_eq!(f.tokens.len(), f.tokens.capacity().min(f.tokens.len()));
            rec.outputs.insert(f.id, f.tokens);
        }
    }
    rec
}

const MODES: [GraphMode; 5] =
    [GraphMode::None, GraphMode::Piecewise, GraphMode::Full, GraphMode::FullDecodeOnly, GraphMode::FullAndPiecewise];

fn every_mode_gives_the_same_bits(dev: &Device) {
    let cfg = ModelConfig::tiny();
    let reqs = workload(11, 12, 300, cfg.vocab_size as u64);
    let runs: Vec<(GraphMode, Record)> =
        MODES.iter().map(|&m| (m, run(dev, &cfg, &settings(m), reqs.clone(), true))).collect();
    let (_, base) = &runs[0];
    assert_eq!(base.outputs.len(), 12);
    for (r, req) in reqs.iter().enumerate() {
        assert_eq!(base.outputs[&(r as u64)].len(), req.max_new_tokens);
    }
    // The sampled tokens are not degenerate: several distinct values.
    let distinct: std::collections::BTreeSet<i32> = base.outputs.values().flatten().copied().collect();
    assert!(distinct.len() > 10, "only {} distinct tokens", distinct.len());
    for (mode, rec) in &runs[1..] {
        assert_eq!(rec.steps.len(), base.steps.len(), "{mode}: step count");
        for (i, (a, b)) in base.steps.iter().zip(&rec.steps).enumerate() {
            assert_eq!(a.0, b.0, "{mode}: step {i} tokens");
            assert!(a.1 == b.1, "{mode}: step {i} logits differ from eager");
        }
        assert_eq!(rec.outputs, base.outputs, "{mode}: outputs");
    }
    // Each mode ran the way it should.
    let by_mode: BTreeMap<String, [u64; 3]> = runs.iter().map(|(m, r)| (m.to_string(), r.modes)).collect();
    let (none, pw, full) = (RuntimeMode::None as usize, RuntimeMode::Piecewise as usize, RuntimeMode::Full as usize);
    let get = |m: GraphMode| by_mode[&m.to_string()];
    assert_eq!(get(GraphMode::None)[pw] + get(GraphMode::None)[full], 0);
    assert_eq!(get(GraphMode::Piecewise)[none] + get(GraphMode::Piecewise)[full], 0, "{by_mode:?}");
    assert_eq!(get(GraphMode::Full)[none] + get(GraphMode::Full)[pw], 0, "{by_mode:?}");
    assert!(get(GraphMode::FullDecodeOnly)[full] > 0 && get(GraphMode::FullDecodeOnly)[none] > 0, "{by_mode:?}");
    assert_eq!(get(GraphMode::FullDecodeOnly)[pw], 0);
    let fp = get(GraphMode::FullAndPiecewise);
    assert!(fp[full] > 0 && fp[pw] > 0 && fp[none] == 0, "{by_mode:?}");
}

fn tokens_do_not_depend_on_concurrency(dev: &Device) {
    let cfg = ModelConfig::tiny();
    let mut s = settings(GraphMode::FullAndPiecewise);
    s.max_num_seqs = 16;
    let others = workload(23, 64, 200, cfg.vocab_size as u64);
    let probes = [
        Request { id: 1000, prompt: (0..150).map(|i: i32| i * 31 % 256).collect(), max_new_tokens: 10 },
        Request { id: 1001, prompt: vec![5], max_new_tokens: 6 },
    ];
    for probe in probes {
        let alone = run(dev, &cfg, &s, vec![probe.clone()], false).outputs[&probe.id].clone();
        assert_eq!(alone.len(), probe.max_new_tokens);
        for n in [8, 64] {
            let mut reqs: Vec<Request> = others[..n].to_vec();
            reqs.insert(n / 2, probe.clone());
            let rec = run(dev, &cfg, &s, reqs, false);
            assert_eq!(rec.outputs[&probe.id], alone, "request {} among {n} others", probe.id);
        }
    }
}

fn tokens_do_not_depend_on_prefill_chunking(dev: &Device) {
    let cfg = ModelConfig::tiny();
    let reqs = workload(5, 4, 400, cfg.vocab_size as u64);
    let whole = run(dev, &cfg, &settings(GraphMode::FullAndPiecewise), reqs.clone(), false);
    let mut s = settings(GraphMode::FullAndPiecewise);
    s.long_prefill_token_threshold = 7;
    let chunked = run(dev, &cfg, &s, reqs, false);
    assert!(chunked.steps.len() > whole.steps.len());
    assert_eq!(chunked.outputs, whole.outputs);
}

fn bad_inputs_are_errors(dev: &Device) {
    let cfg = ModelConfig::tiny();
    let mut s = settings(GraphMode::Full);
    s.capture_sizes = Some(vec![1, 128]);
    let e = ModelRunner::new(dev, &cfg, &s).expect_err("capture size above the token budget");
    assert!(e.to_string().contains("128"), "{e}");
    let mut s = settings(GraphMode::Full);
    s.max_num_seqs = 0;
    let e = ModelRunner::new(dev, &cfg, &s).expect_err("max_num_seqs 0");
    assert!(matches!(e, ModelError::Setting { setting: "max_num_seqs", .. }), "{e}");
    let mut s = settings(GraphMode::Full);
    s.max_model_len = cfg.max_position_embeddings + 1;
    assert!(matches!(ModelRunner::new(dev, &cfg, &s), Err(ModelError::Setting { setting: "max_model_len", .. })));
    // The device-free check refuses exactly what building refuses, with the same error.
    for bad in [
        RunnerSettings { capture_sizes: Some(vec![1, 128]), ..settings(GraphMode::Full) },
        RunnerSettings { max_num_seqs: 0, ..settings(GraphMode::Full) },
        RunnerSettings { capture_sizes: Some(vec![0]), ..settings(GraphMode::Piecewise) },
        RunnerSettings { max_capture_size: Some(0), ..settings(GraphMode::FullAndPiecewise) },
        RunnerSettings { attention_row_split: Some(3), ..settings(GraphMode::Full) },
    ] {
        let checked = ModelRunner::check(&cfg, &bad).expect_err("refused by the check").to_string();
        let built = ModelRunner::new(dev, &cfg, &bad).map(|_| ()).expect_err("refused by building").to_string();
        assert_eq!(checked, built);
    }
    for mode in [GraphMode::None, GraphMode::Piecewise, GraphMode::Full, GraphMode::FullDecodeOnly] {
        ModelRunner::check(&cfg, &settings(mode)).expect("the test settings are valid");
    }
    // A row split is for the warpgroup attention kernel only (tiny's 2 heads of 64 never run it):
    // building says which kernel runs instead.
    let split = RunnerSettings { attention_row_split: Some(2), ..settings(GraphMode::Full) };
    ModelRunner::check(&cfg, &split).expect("a supported split passes the device-free check");
    let e = ModelRunner::new(dev, &cfg, &split).map(|_| ()).expect_err("no warpgroup kernel here");
    assert!(matches!(e, ModelError::Setting { setting: "attention_row_split", .. }), "{e}");
    assert!(e.to_string().contains("warpgroup kernel") && e.to_string().contains("2 heads of 64"), "{e}");

    // A step larger than the runner was built for is refused before anything runs.
    let mut runner = ModelRunner::new(dev, &cfg, &settings(GraphMode::None)).expect("runner");
    let mut big = RunnerSettings { max_num_batched_tokens: 128, max_num_seqs: 8, ..settings(GraphMode::None) };
    big.capture_sizes = None;
    let other = ModelRunner::new(dev, &cfg, &big).expect("bigger runner");
    let mut sched = other.scheduler().expect("scheduler");
    sched.add(Request { id: 1, prompt: vec![1; 100], max_new_tokens: 1 }).expect("add");
    let step = sched.schedule().expect("schedule").expect("a step");
    let e = runner.execute(&step).expect_err("100 tokens into a 64-token runner");
    assert!(e.to_string().contains("100 tokens"), "{e}");
    // A hand-made step whose sample flags or request ids do not match its requests is refused
    // (it would have sampled a row that has no request).
    let mut sched = runner.scheduler().expect("scheduler");
    sched.add(Request { id: 2, prompt: vec![1; 5], max_new_tokens: 1 }).expect("add");
    let good = sched.schedule().expect("schedule").expect("a step");
    let mut bad = good.clone();
    bad.samples.push(true);
    let e = runner.execute(&bad).expect_err("two sample flags for one request");
    assert!(
        e.to_string().contains("a step of 1 requests (query_start_loc) has 1 request ids and 2 sample flags"),
        "{e}"
    );
    let mut bad = good.clone();
    bad.req_ids.push(9);
    let e = runner.execute(&bad).expect_err("two request ids for one request");
    assert!(e.to_string().contains("has 2 request ids and 1 sample flags"), "{e}");
    runner.execute(&good).expect("the well-formed step still runs");

    // A capture's warm-up after a step was staged (lazy capture) is refused, not run on padding.
    let mut sched = other.scheduler().expect("scheduler");
    sched.add(Request { id: 3, prompt: vec![1; 5], max_new_tokens: 1 }).expect("add");
    let step = sched.schedule().expect("schedule").expect("a step");
    let kv = other.kv_config();
    let limits = ForwardLimits { max_num_batched_tokens: 128, max_num_seqs: 8, max_model_len: 512 };
    let weights = Weights::load(dev, &cfg, &mut SeededInit { seed: 7 }).expect("weights");
    let mut fwd = ModelForward::new(dev, &cfg, weights, limits, kv.swa_table(), kv.kv_table()).expect("forward");
    let s = dev.create_stream().expect("stream");
    let desc = BatchDescriptor::unpadded(8);
    fwd.stage_step(&step, 8).expect("stage");
    let e = Forward::prepare(&mut fwd, &s, &desc, StepKind::WarmUp).expect_err("a warm-up over a staged step");
    assert!(e.to_string().contains("overwrite the step staged for 8"), "{e}");
    Forward::prepare(&mut fwd, &s, &desc, StepKind::Step).expect("the staged step is intact and runs");
    // A run whose rows the forward does not take, or that does not match what was staged, names
    // both; so does a step staged into fewer rows than it has tokens.
    let prepare = |fwd: &mut ModelForward, t: u32| {
        Forward::prepare(fwd, &s, &BatchDescriptor::unpadded(t), StepKind::Step).map_err(ModelError::from)
    };
    let graph: fn(&ModelError) -> bool = |e| matches!(e, ModelError::Graph(_));
    let cases: Vec<ErrorCase<ModelError>> = vec![
        (
            "a run with nothing staged",
            prepare(&mut fwd, 8),
            graph,
            words(&["prepare: step input: no step was staged before running the forward"]),
        ),
        (
            "a run of no rows",
            prepare(&mut fwd, 0),
            graph,
            words(&["prepare: step input: a step of 0 token rows; this model runs 1 to 128 (max_num_batched_tokens)"]),
        ),
        (
            "a run past the token limit",
            prepare(&mut fwd, 129),
            graph,
            words(&[
                "prepare: step input: a step of 129 token rows; this model runs 1 to 128 (max_num_batched_tokens)",
            ]),
        ),
        (
            "a run of more rows than staged",
            fwd.stage_step(&step, 8).and_then(|()| prepare(&mut fwd, 16)),
            graph,
            words(&["prepare: step input: the step was staged for 8 token rows but runs with 16"]),
        ),
        (
            "a step staged into fewer rows than its tokens",
            fwd.stage_step(&step, 4),
            |e| matches!(e, ModelError::Step(_)),
            words(&["step input: a step of 5 tokens / 1 requests does not fit 4 rows (4 requests)"]),
        ),
    ];
    check_errors(cases);

    // Token ids outside the vocabulary: the runner's scheduler refuses them (naming the request),
    // serving included, and staging a hand-made step that carries one fails (never embedded as
    // zeros).
    let mut sched = runner.scheduler().expect("scheduler");
    assert!(sched.add(Request { id: 2, prompt: vec![-3], max_new_tokens: 1 }).is_err());
    let vocab = cfg.vocab_size as i32;
    let e = runner.serve(vec![Request { id: 4, prompt: vec![1, vocab, 2], max_new_tokens: 1 }], |_, _| {});
    let e = e.expect_err("an id past the vocabulary");
    assert!(e.to_string().contains("request 4") && e.to_string().contains(&format!("id {vocab}")), "{e}");
    let mut sched = runner.scheduler().expect("scheduler");
    sched.add(Request { id: 5, prompt: vec![1, 2], max_new_tokens: 1 }).expect("add");
    let mut step = sched.schedule().expect("schedule").expect("a step");
    step.token_ids[1] = i32::MAX;
    let e = runner.execute(&step).expect_err("staging an id past the vocabulary");
    assert!(e.to_string().contains("outside the vocabulary"), "{e}");
    // Steps of no tokens or of more requests than the runner takes, and logits of more rows than
    // any step holds (whatever the product), are errors naming the sizes.
    let nine = Step { req_ids: (0..9).collect(), token_ids: vec![1; 9], ..Step::default() };
    let step_error: fn(&ModelError) -> bool = |e| matches!(e, ModelError::Step(_));
    let cases: Vec<ErrorCase<ModelError>> = vec![
        (
            "an empty step",
            runner.execute(&Step::default()).map(drop),
            step_error,
            words(&[
                "step input: a step of 0 tokens / 0 requests; this runner takes 1 to 64 tokens and at most 8 requests",
            ]),
        ),
        (
            "a step of more requests than the runner takes",
            runner.execute(&nine).map(drop),
            step_error,
            words(&[
                "step input: a step of 9 tokens / 9 requests; this runner takes 1 to 64 tokens and at most 8 requests",
            ]),
        ),
        (
            "logits whose element count overflows",
            runner.logits(usize::MAX / 2).map(drop),
            step_error,
            vec![format!("step input: logits of {} rows of {} overflow", usize::MAX / 2, cfg.vocab_size)],
        ),
        (
            "logits past the buffer",
            runner.logits(1 << 40).map(drop),
            |e| matches!(e, ModelError::Graph(_)),
            vec![format!(
                "view [0, 0+{}) is out of range for buffer `logits` of {} elements",
                (1usize << 40) * cfg.vocab_size,
                8 * cfg.vocab_size
            )],
        ),
    ];
    check_errors(cases);

    // Ragged attention lists whose offsets would pass 32 bits are refused before anything loads.
    let wide = RunnerSettings { max_num_batched_tokens: 100_000_000, max_num_seqs: 1, ..settings(GraphMode::None) };
    let e = ModelRunner::check(&cfg, &RunnerSettings { capture_sizes: None, ..wide }).expect_err("i32 offsets");
    assert!(matches!(e, ModelError::Setting { setting: "max_num_batched_tokens", .. }), "{e}");
    assert!(e.to_string().contains("32-bit offsets"), "{e}");
}

holdfast_hal::device_suite!(
    every_mode_gives_the_same_bits,
    tokens_do_not_depend_on_concurrency,
    tokens_do_not_depend_on_prefill_chunking,
    bad_inputs_are_errors
);

/// Every runner setting the device-free check refuses is an error naming the setting, the bound it
/// breaks and the value given.
#[test]
fn every_rejected_runner_setting_names_the_setting_and_the_bound() {
    let cfg = ModelConfig::tiny();
    let check = |f: &dyn Fn(&mut RunnerSettings)| {
        let mut s = settings(GraphMode::Full);
        f(&mut s);
        ModelRunner::check(&cfg, &s)
    };
    let setting: fn(&ModelError) -> bool = |e| matches!(e, ModelError::Setting { .. });
    let mpe = cfg.max_position_embeddings;
    let cases: Vec<ErrorCase<ModelError>> = vec![
        (
            "no requests",
            check(&|s| s.max_num_seqs = 0),
            setting,
            words(&["runner setting `max_num_seqs`: must lie in [1, max_num_batched_tokens 64], got 0"]),
        ),
        (
            "more requests than tokens",
            check(&|s| s.max_num_seqs = 65),
            setting,
            words(&["runner setting `max_num_seqs`: must lie in [1, max_num_batched_tokens 64], got 65"]),
        ),
        (
            "tokens past 31 bits",
            check(&|s| {
                s.max_num_batched_tokens = 1 << 31;
                s.capture_sizes = None;
            }),
            setting,
            words(&["runner setting `max_num_batched_tokens`: must fit in 31 bits"]),
        ),
        (
            "no model length",
            check(&|s| s.max_model_len = 0),
            setting,
            vec![format!("runner setting `max_model_len`: must lie in [1, max_position_embeddings {mpe}], got 0")],
        ),
        (
            "model length past the positions",
            check(&|s| s.max_model_len = mpe + 1),
            setting,
            vec![format!("runner setting `max_model_len`: must lie in [1, max_position_embeddings {mpe}], got {}", mpe + 1)],
        ),
        (
            "unsupported row split",
            check(&|s| s.attention_row_split = Some(3)),
            setting,
            vec![format!("runner setting `attention_row_split`: must be one of {:?}, got 3", holdfast_attention::WG_SPLITS)],
        ),
        (
            "only the null block",
            check(&|s| s.kv_num_blocks = Some(1)),
            setting,
            words(&["runner setting `kv_num_blocks`: needs 2 to 536870911 blocks (one is the null block; block ids are 32-bit), got 1"]),
        ),
        (
            "block ids past 32 bits",
            check(&|s| s.kv_num_blocks = Some(usize::MAX)),
            setting,
            vec![format!("runner setting `kv_num_blocks`: needs 2 to 536870911 blocks (one is the null block; block ids are 32-bit), got {}", usize::MAX)],
        ),
        (
            "capture size past the tokens",
            check(&|s| s.capture_sizes = Some(vec![1, 128])),
            setting,
            words(&["runner setting `capture_sizes`: size 128 exceeds max_num_batched_tokens 64"]),
        ),
    ];
    check_errors(cases);
}

/// Building a forward refuses limits, lengths and weight shards it cannot serve, and loading refuses
/// a weight that is not finite; each error names the setting or the weight.
#[test]
fn forward_and_weight_errors_name_the_setting_or_the_weight() {
    let dev = Device::cpu().expect("cpu");
    let cfg = ModelConfig::tiny();
    let limits = ForwardLimits { max_num_batched_tokens: 64, max_num_seqs: 8, max_model_len: 512 };
    let swa = BlockTableConfig { block_size: 64, max_blocks_per_seq: 8, num_blocks: 65 };
    let kv = BlockTableConfig { block_size: 256, max_blocks_per_seq: 2, num_blocks: 17 };
    let seeded = || Weights::load(&dev, &cfg, &mut SeededInit { seed: 7 }).expect("weights");
    let build = |w: Weights, l: ForwardLimits| ModelForward::new(&dev, &cfg, w, l, swa, kv).map(drop);
    let setting: fn(&ModelError) -> bool = |e| matches!(e, ModelError::Setting { .. });
    let shard =
        Weights::load_shard(&dev, &cfg, &mut SeededInit { seed: 7 }, Shard { rank: 1, size: 2 }).expect("shard");
    let load = |name: &'static str| {
        Weights::load(&dev, &cfg, &mut NotFinite { name, inner: SeededInit { seed: 7 } }).map(drop)
    };
    let cases: Vec<ErrorCase<ModelError>> = vec![
        (
            "no tokens",
            build(seeded(), ForwardLimits { max_num_batched_tokens: 0, ..limits }),
            setting,
            words(&["runner setting `limits`: max_num_batched_tokens must be positive, got 0"]),
        ),
        (
            "no requests",
            build(seeded(), ForwardLimits { max_num_seqs: 0, ..limits }),
            setting,
            words(&["runner setting `limits`: max_num_seqs must be positive, got 0"]),
        ),
        (
            "no model length",
            build(seeded(), ForwardLimits { max_model_len: 0, ..limits }),
            setting,
            words(&["runner setting `limits`: max_model_len must be positive, got 0"]),
        ),
        (
            "model length past the positions",
            build(seeded(), ForwardLimits { max_model_len: cfg.max_position_embeddings + 1, ..limits }),
            setting,
            vec![format!(
                "runner setting `max_model_len`: {} exceeds max_position_embeddings {}",
                cfg.max_position_embeddings + 1,
                cfg.max_position_embeddings
            )],
        ),
        (
            "a shard without its group",
            build(shard, limits),
            setting,
            words(&[
                "runner setting `tensor_parallel`: the weights are shard 1 of 2 but the communicator is rank 0 of 1",
            ]),
        ),
        (
            "a bf16 weight that is not finite",
            load("layers.0.attn.wq_a"),
            |e| matches!(e, ModelError::Weights(_)),
            words(&["weight layers.0.attn.wq_a: element 3 is not finite"]),
        ),
        (
            "an f32 weight that is not finite",
            load("hc_head.fn"),
            |e| matches!(e, ModelError::Weights(_)),
            words(&["weight hc_head.fn: element 3 is not finite"]),
        ),
    ];
    check_errors(cases);
}

/// A weight source that writes NaN into element 3 of the tensor `name` (and `inner`'s values
/// everywhere else).
struct NotFinite {
    name: &'static str,
    inner: SeededInit,
}

impl WeightSource for NotFinite {
    fn fill_bf16(&mut self, name: &str, shape: &[usize], init: Init, out: &mut [bf16]) -> holdfast_model::Result<()> {
        self.inner.fill_bf16(name, shape, init, out)?;
        if name == self.name {
            out[3] = bf16::NAN;
        }
        Ok(())
    }
    fn fill_f32(&mut self, name: &str, shape: &[usize], init: Init, out: &mut [f32]) -> holdfast_model::Result<()> {
        self.inner.fill_f32(name, shape, init, out)?;
        if name == self.name {
            out[3] = f32::NAN;
        }
        Ok(())
    }
}

#[test]
fn config_errors_name_the_field() {
    let tiny = ModelConfig::tiny();
    assert_eq!(ModelConfig::from_json(&tiny.to_json()).expect("round trip"), tiny);
    let edit = |f: &dyn Fn(&mut serde_json::Value)| {
        let mut v: serde_json::Value = serde_json::from_str(&tiny.to_json()).expect("json");
        f(&mut v);
        ModelConfig::from_json(&v.to_string()).expect_err("must be rejected").to_string()
    };
    let e = edit(&|v| v["compress_ratios"] = serde_json::json!([0, 4]));
    assert!(e.contains("compress_ratios") && e.contains("num_hidden_layers (4)"), "{e}");
    let e = edit(&|v| v["compress_ratios"] = serde_json::json!([0, 8, 128, 0]));
    assert!(e.contains("layer 1: ratio 8") && e.contains("allowed"), "{e}");
    let e = edit(&|v| v["hc_mult"] = serde_json::json!(0));
    assert!(e.contains("hc_mult"), "{e}");
    let e = edit(&|v| v["sliding_window"] = serde_json::json!(0));
    assert!(e.contains("sliding_window"), "{e}");
    let e = edit(&|v| v["head_dim"] = serde_json::json!(100));
    assert!(e.contains("head_dim"), "{e}");
    let e = edit(&|v| v["o_groups"] = serde_json::json!(3));
    assert!(e.contains("o_groups"), "{e}");
    let e = edit(&|v| {
        v.as_object_mut().expect("object").remove("vocab_size");
    });
    assert!(e.contains("vocab_size"), "{e}");
    let e = ModelConfig::from_json("{ not json").expect_err("malformed").to_string();
    assert!(e.contains("config.json"), "{e}");
    assert!(ModelConfig::preset("huge").expect_err("unknown").to_string().contains("tiny, flash-slice, pro-slice"));
    // The published configs' extra fields are accepted.
    let mut v: serde_json::Value = serde_json::from_str(&tiny.to_json()).expect("json");
    v["n_routed_experts"] = serde_json::json!(256);
    v["rope_scaling"] = serde_json::json!({"type": "yarn", "factor": 16});
    assert_eq!(ModelConfig::from_json(&v.to_string()).expect("extra fields"), tiny);
}

#[cfg(feature = "cuda")]
#[test]
fn cpu_and_cuda_logits_agree_on_the_first_step() {
    let gpu = match Device::open("cuda:0") {
        Ok(d) => d,
        Err(e) => {
            eprintln!("skipped: cuda:0 is not usable here ({e})");
            return;
        }
    };
    let cpu = Device::cpu().expect("cpu");
    let cfg = ModelConfig::tiny();
    // Short prompts, so the first step finishes every prefill and samples every request.
    let reqs = workload(3, 6, 10, cfg.vocab_size as u64);
    let first = |dev: &Device| {
        let mut runner = ModelRunner::new(dev, &cfg, &settings(GraphMode::None)).expect("runner");
        let mut sched = runner.scheduler().expect("scheduler");
        for r in reqs.clone() {
            sched.add(r).expect("add");
        }
        let step = sched.schedule().expect("schedule").expect("step");
        let res = runner.execute(&step).expect("execute");
        runner.logits(res.tokens.len()).expect("logits")
    };
    let (a, b) = (first(&cpu), first(&gpu));
    assert_eq!(a.len(), b.len());
    assert_eq!(a.len(), 6 * cfg.vocab_size, "every request samples on the first step");
    let num: f64 = a.iter().zip(&b).map(|(x, y)| f64::from(x - y).powi(2)).sum();
    let den: f64 = a.iter().map(|x| f64::from(*x).powi(2)).sum();
    let rel = (num / den).sqrt();
    println!("first-step logits, cpu vs cuda: relative L2 {rel:.3e} over {} values", a.len());
    assert!(rel <= 2e-2, "relative L2 {rel}");
}

/// With the warpgroup attention kernel (sm_90a), a runner whose attention rows are spread over 8
/// blocks still gives the same bits in every graph mode, and the same tokens as the default split
/// up to the last place of the attention sums (checked loosely: most tokens agree).
#[cfg(feature = "cuda")]
#[test]
fn an_attention_row_split_keeps_every_mode_identical() {
    let mut cfg = ModelConfig::flash_slice();
    cfg.num_hidden_layers = 2;
    cfg.compress_ratios = vec![4, 128, 0]; // a c4a and a c128a layer: both extra lists
    let split = |mode: GraphMode, split: Option<usize>| RunnerSettings { attention_row_split: split, ..settings(mode) };
    ModelRunner::check(&cfg, &split(GraphMode::FullAndPiecewise, Some(8))).expect("valid settings");
    let gpu = match Device::open("cuda:0") {
        Ok(d) => d,
        Err(e) => {
            eprintln!("skipped: cuda:0 is not usable here ({e})");
            return;
        }
    };
    if !gpu.info().has_wgmma() {
        eprintln!("skipped: {} has no warpgroup MMA (the row split is for that kernel)", gpu.info().name);
        return;
    }
    let reqs = workload(5, 6, 150, cfg.vocab_size as u64);
    let with = |mode: GraphMode, s: Option<usize>| run(&gpu, &cfg, &split(mode, s), reqs.clone(), true);
    let base = with(GraphMode::None, Some(8));
    for mode in [GraphMode::Full, GraphMode::FullAndPiecewise] {
        let rec = with(mode, Some(8));
        assert_eq!(rec.steps.len(), base.steps.len(), "{mode}: step count");
        for (i, (a, b)) in base.steps.iter().zip(&rec.steps).enumerate() {
            assert_eq!(a.0, b.0, "{mode}: step {i} tokens");
            assert!(a.1 == b.1, "{mode}: step {i} logits differ from eager");
        }
    }
    let default = with(GraphMode::None, None);
    let (same, all) = base.outputs.iter().fold((0usize, 0usize), |(s, n), (id, toks)| {
        let d = &default.outputs[id];
        (s + toks.iter().zip(d).filter(|(a, b)| a == b).count(), n + toks.len())
    });
    println!("split 8 against the default split: {same} of {all} tokens equal");
    assert!(all > 0 && same * 2 > all, "split 8 changed most tokens ({same} of {all} equal)");
}
