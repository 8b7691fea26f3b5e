//! Tensor parallelism on the CPU backend's emulated ranks (one thread per rank, the HAL's
//! in-process communicator): every rank of a group computes the same tokens and logits bit for
//! bit; the group matches the single-device model (tokens equal, logits within the reduction-order
//! tolerance); a fixed rank count gives the same bits in every graph mode; `serve_tensor_parallel`
//! checks the ranks' steps and outputs; bad splits are errors naming the field.

use std::collections::BTreeMap;

use holdfast_graph::GraphMode;
use holdfast_hal::{Communicator, Device};
use holdfast_model::scheduler::Request;
use holdfast_model::{
    serve_tensor_parallel, ModelConfig, ModelError, ModelRunner, RunnerSettings, SeededInit, Shard, Weights,
};

/// `tiny` with four query heads and four output groups, so 1, 2 and 4 ranks divide it.
fn tiny4() -> ModelConfig {
    ModelConfig { num_attention_heads: 4, o_groups: 4, ..ModelConfig::tiny() }
}

fn settings(mode: GraphMode) -> RunnerSettings {
    RunnerSettings {
        graph_mode: mode,
        max_num_seqs: 8,
        max_num_batched_tokens: 64,
        max_model_len: 512,
        capture_sizes: Some(vec![1, 2, 4, 8, 16, 32, 64]),
        seed: 7,
        ..Default::default()
    }
}

fn workload(seed: u64, n: usize, max_prompt: u64, vocab: u64) -> Vec<Request> {
    let mut s = seed | 1;
    let mut below = |m: u64| {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s % m
    };
    (0..n as u64)
        .map(|id| {
            let len = 1 + below(max_prompt) as usize;
            Request {
                id,
                prompt: (0..len).map(|_| below(vocab) as i32).collect(),
                max_new_tokens: 1 + below(10) as usize,
            }
        })
        .collect()
}

/// Per step the sampled tokens and the logits; per request the generated tokens.
#[derive(Debug, Default, PartialEq)]
struct Record {
    steps: Vec<(Vec<i32>, Vec<f32>)>,
    outputs: BTreeMap<u64, Vec<i32>>,
}

fn drive(runner: &mut ModelRunner, requests: Vec<Request>) -> Record {
    runner.capture_all(|_, _, _| {}).expect("capture");
    let mut sched = runner.scheduler().expect("scheduler");
    for r in requests {
        sched.add(r).expect("add");
    }
    let mut rec = Record::default();
    while let Some(step) = sched.schedule().expect("schedule") {
        let res = runner.execute(&step).expect("execute");
        let logits = runner.logits(res.tokens.len()).expect("logits");
        assert!(logits.iter().all(|v| v.is_finite()), "non-finite logits");
        rec.steps.push((res.tokens.clone(), logits));
        for f in sched.update(&step, &res.tokens).expect("update") {
            rec.outputs.insert(f.id, f.tokens);
        }
    }
    rec
}

/// Every rank's record, ranks on their own CPU devices and threads.
fn run_tp(cfg: &ModelConfig, s: &RunnerSettings, ranks: usize, requests: &[Request]) -> Vec<Record> {
    let devices: Vec<Device> = (0..ranks).map(|_| Device::cpu().expect("cpu")).collect();
    let comms = Communicator::group(&devices).expect("group");
    std::thread::scope(|scope| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|comm| {
                let reqs = requests.to_vec();
                scope.spawn(move || {
                    let mut runner = ModelRunner::tensor_parallel(cfg, s, comm).expect("rank runner");
                    drive(&mut runner, reqs)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("rank thread")).collect()
    })
}

fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| (f64::from(*x) - f64::from(*y)).powi(2)).sum();
    let den: f64 = b.iter().map(|y| f64::from(*y).powi(2)).sum();
    (num / den.max(1e-30)).sqrt()
}

#[test]
fn every_rank_agrees_and_the_group_matches_one_device() {
    let cfg = tiny4();
    let s = settings(GraphMode::FullAndPiecewise);
    let reqs = workload(3, 10, 200, cfg.vocab_size as u64);
    let dev = Device::cpu().expect("cpu");
    let single = drive(&mut ModelRunner::new(&dev, &cfg, &s).expect("runner"), reqs.clone());
    assert_eq!(single.outputs.len(), reqs.len());
    for ranks in [1usize, 2, 4] {
        let recs = run_tp(&cfg, &s, ranks, &reqs);
        assert_eq!(recs.len(), ranks);
        for (r, rec) in recs.iter().enumerate().skip(1) {
            assert!(rec == &recs[0], "{ranks} ranks: rank {r} differs from rank 0");
        }
        let tp = &recs[0];
        assert_eq!(tp.steps.len(), single.steps.len(), "{ranks} ranks: step count");
        // The row-parallel sums add f32 partials across ranks where one device runs one chain:
        // logits agree to rounding, and the greedy tokens are the same.
        let mut worst = 0f64;
        for (i, (a, b)) in tp.steps.iter().zip(&single.steps).enumerate() {
            assert_eq!(a.0, b.0, "{ranks} ranks: step {i} tokens");
            worst = worst.max(rel_l2(&a.1, &b.1));
        }
        assert!(worst <= 2e-2, "{ranks} ranks: logits relative L2 {worst:e}");
        assert_eq!(tp.outputs, single.outputs, "{ranks} ranks: outputs");
        eprintln!("{ranks} ranks: {} steps, worst logits relative L2 vs one device {worst:.3e}", tp.steps.len());
    }
}

#[test]
fn a_fixed_rank_count_gives_the_same_bits_in_every_graph_mode() {
    let cfg = tiny4();
    let reqs = workload(9, 8, 150, cfg.vocab_size as u64);
    let modes = [GraphMode::None, GraphMode::Piecewise, GraphMode::Full, GraphMode::FullAndPiecewise];
    let base = run_tp(&cfg, &settings(modes[0]), 2, &reqs).remove(0);
    for mode in &modes[1..] {
        let rec = run_tp(&cfg, &settings(*mode), 2, &reqs).remove(0);
        assert_eq!(rec.steps.len(), base.steps.len(), "{mode}: step count");
        for (i, (a, b)) in base.steps.iter().zip(&rec.steps).enumerate() {
            assert_eq!(a.0, b.0, "{mode}: step {i} tokens");
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert!(bits(&a.1) == bits(&b.1), "{mode}: step {i} logits differ from eager");
        }
    }
}

#[test]
fn serve_tensor_parallel_checks_the_ranks_and_reports() {
    let cfg = tiny4();
    let s = settings(GraphMode::FullAndPiecewise);
    let reqs = workload(21, 12, 100, cfg.vocab_size as u64);
    let devices: Vec<Device> = (0..2).map(|_| Device::cpu().expect("cpu")).collect();
    let rep = serve_tensor_parallel(&devices, &cfg, &s, reqs.clone()).expect("serve");
    assert_eq!((rep.ranks, rep.capture_seconds.len()), (2, 2));
    assert_eq!(rep.report.outputs.len(), reqs.len());
    assert_eq!(rep.steps.len() as u64, rep.report.steps);
    let dev = Device::cpu().expect("cpu");
    let mut runner = ModelRunner::new(&dev, &cfg, &s).expect("runner");
    runner.capture_all(|_, _, _| {}).expect("capture");
    let single = runner.serve(reqs, |_, _| {}).expect("serve");
    assert_eq!(rep.report.outputs, single.outputs);
}

#[test]
fn splits_that_do_not_divide_are_errors_naming_the_field() {
    let tiny = ModelConfig::tiny(); // two heads, two groups
    let devices: Vec<Device> = (0..4).map(|_| Device::cpu().expect("cpu")).collect();
    let e = serve_tensor_parallel(&devices, &tiny, &settings(GraphMode::None), Vec::new()).expect_err("4 ranks");
    assert!(matches!(&e, ModelError::Config { field: "num_attention_heads", .. }), "{e}");
    let e = tiny.validate_tp(0).expect_err("0 ranks");
    assert!(matches!(&e, ModelError::Config { field: "tensor_parallel_size", .. }), "{e}");
    let odd = ModelConfig { moe_intermediate_size: 130, ..tiny4() };
    let e = odd.validate_tp(4).expect_err("FFN width");
    assert!(matches!(&e, ModelError::Config { field: "moe_intermediate_size", .. }), "{e}");
    let dev = Device::cpu().expect("cpu");
    let e = Weights::load_shard(&dev, &tiny4(), &mut SeededInit { seed: 1 }, Shard { rank: 2, size: 2 })
        .expect_err("rank past the group");
    assert!(e.to_string().contains("rank 2 of a group of 2"), "{e}");
    // The shards hold exactly the whole model's split tensors.
    let whole = Weights::load(&dev, &tiny4(), &mut SeededInit { seed: 1 }).expect("whole");
    let parts: Vec<Weights> = (0..2)
        .map(|rank| Weights::load_shard(&dev, &tiny4(), &mut SeededInit { seed: 1 }, Shard { rank, size: 2 }))
        .collect::<Result<_, _>>()
        .expect("shards");
    let s = dev.create_stream().expect("stream");
    let read = |b: &holdfast_hal::Buffer<half::bf16>| s.copy_to_host_sync(&b.view()).expect("read");
    let (w, p0, p1) = (&whole.layers[0], &parts[0].layers[0], &parts[1].layers[0]);
    let mut rows = read(&p0.wq_b);
    rows.extend(read(&p1.wq_b));
    assert_eq!(rows, read(&w.wq_b), "wq_b splits by rows (heads)");
    let (full, a, b) = (read(&w.w2), read(&p0.w2), read(&p1.w2));
    let f = tiny4().moe_intermediate_size;
    for (r, row) in full.chunks(f).enumerate() {
        assert_eq!(&row[..f / 2], &a[r * f / 2..(r + 1) * f / 2], "w2 row {r}: rank 0's columns");
        assert_eq!(&row[f / 2..], &b[r * f / 2..(r + 1) * f / 2], "w2 row {r}: rank 1's columns");
    }
    assert_eq!(whole.bytes, parts[0].bytes + parts[1].bytes - replicated_bytes(&parts[0]), "shard bytes");
}

/// Bytes of the tensors every rank holds whole (the total minus the split ones).
fn replicated_bytes(w: &Weights) -> usize {
    let split: usize = w
        .layers
        .iter()
        .map(|l| l.wq_b.bytes() + l.attn_sink.bytes() + l.wo_a.bytes() + l.wo_b.bytes() + l.w13.bytes() + l.w2.bytes())
        .sum();
    w.bytes - split
}

/// One GPU as a group of one (NCCL): the all-reduces run inside the captured FULL and PIECEWISE
/// graphs of the real forward, and the tokens equal the plain model's on the same GPU.
#[cfg(feature = "cuda")]
#[test]
fn a_one_gpu_group_over_nccl_matches_the_plain_model() {
    let gpu = match Device::open("cuda:0") {
        Ok(d) => d,
        Err(e) => {
            eprintln!("skipped: cuda:0 is not usable here ({e})");
            return;
        }
    };
    if let Some(why) = holdfast_hal::cuda::nccl_unavailable_reason() {
        eprintln!("skipped: NCCL is not available ({why})");
        return;
    }
    let cfg = tiny4();
    let reqs = workload(13, 8, 150, cfg.vocab_size as u64);
    for mode in [GraphMode::None, GraphMode::FullAndPiecewise] {
        let s = settings(mode);
        let plain = drive(&mut ModelRunner::new(&gpu, &cfg, &s).expect("runner"), reqs.clone());
        let comm = Communicator::group(std::slice::from_ref(&gpu)).expect("group").remove(0);
        let tp = drive(&mut ModelRunner::tensor_parallel(&cfg, &s, comm).expect("rank runner"), reqs.clone());
        assert_eq!(tp.outputs, plain.outputs, "{mode}: outputs");
        let worst = tp.steps.iter().zip(&plain.steps).map(|(a, b)| rel_l2(&a.1, &b.1)).fold(0f64, f64::max);
        assert!(worst <= 2e-2, "{mode}: logits relative L2 {worst:e}");
        eprintln!(
            "{mode}: one-GPU NCCL group, {} steps, worst logits relative L2 vs plain {worst:.3e}",
            tp.steps.len()
        );
    }
}
