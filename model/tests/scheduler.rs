//! Scheduler: request validation, step order, chunked prefill, preemption with recompute, and a
//! serving simulation against a fake model that reads its context back through the block tables.

use std::collections::BTreeMap;

use holdfast_attention::{CommonAttentionMetadata, CommonConfig};
use holdfast_hal::testing::{check_errors, words, ErrorCase};
use holdfast_hal::Device;
use holdfast_model::kv::{KvConfig, KvManager};
use holdfast_model::scheduler::{Finished, Request, ScheduleError, Scheduler, SchedulerConfig, Step};
use proptest::prelude::*;

const SWA_BS: usize = 4;
/// Vocabulary of the schedulers here.
const VOCAB: usize = 50_000;
const KV_BS: usize = 8;

fn kv_cfg(swa_num_blocks: usize, kv_num_blocks: usize) -> KvConfig {
    KvConfig {
        swa_block_size: SWA_BS,
        swa_num_blocks,
        kv_block_size: KV_BS,
        kv_num_blocks,
        max_blocks_per_seq_swa: 64,
        max_blocks_per_seq_kv: 32,
    }
}

fn cfg(max_num_seqs: usize, max_num_batched_tokens: usize, long_prefill_token_threshold: usize) -> SchedulerConfig {
    SchedulerConfig {
        max_num_seqs,
        max_num_batched_tokens,
        max_model_len: 256,
        long_prefill_token_threshold,
        vocab_size: VOCAB,
    }
}

fn scheduler(c: SchedulerConfig, swa_num_blocks: usize, kv_num_blocks: usize) -> Scheduler {
    let kv = KvManager::new(kv_cfg(swa_num_blocks, kv_num_blocks)).expect("kv config");
    Scheduler::new(c, kv).expect("scheduler config")
}

fn prompt(id: u64, len: usize) -> Vec<i32> {
    (0..len).map(|i| ((id as usize * 31 + i * 7) % 97) as i32).collect()
}

fn req(id: u64, len: usize, max_new_tokens: usize) -> Request {
    Request { id, prompt: prompt(id, len), max_new_tokens }
}

/// The fake sampler: a hash of the request id and its whole context, so a token depends only on
/// the request's own history.
fn sample(id: u64, ctx: &[i32]) -> i32 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325 ^ id.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    for &t in ctx {
        h = (h ^ t as u64).wrapping_mul(0x0100_0000_01b3);
    }
    (h % 1000) as i32
}

/// What request `r` generates when it runs alone, uninterrupted.
fn alone(r: &Request) -> Vec<i32> {
    let mut ctx = r.prompt.clone();
    for _ in 0..r.max_new_tokens {
        ctx.push(sample(r.id, &ctx));
    }
    ctx.split_off(r.prompt.len())
}

/// A model that keeps its own copy of the persistent block tables (by table row, built only from
/// the steps' releases and updates), writes each token into paged caches at the step's slots and,
/// for each sampling row, reads the whole context back through both tables before hashing it.
struct FakeModel {
    swa: Vec<i32>,
    main: Vec<i32>,
    /// `[table row] → block ids written` of the SWA and the main table.
    tables: [Vec<Vec<i32>>; 2],
}

impl FakeModel {
    fn new(kv: KvConfig) -> Self {
        FakeModel {
            swa: vec![-1; kv.swa_num_blocks * SWA_BS],
            main: vec![-1; kv.kv_num_blocks * KV_BS],
            tables: [vec![Vec::new(); 64], vec![Vec::new(); 64]],
        }
    }

    /// Applies the step's releases and updates; checks that the updates only append the blocks
    /// handed out since the request's previous step, and that each row then equals what the
    /// request holds.
    fn apply_tables(&mut self, s: &Scheduler, step: &Step) {
        for &row in &step.released_rows {
            for t in &mut self.tables {
                t[row as usize].clear();
            }
        }
        for u in step.table_updates.iter() {
            let row = &mut self.tables[u.table as usize][u.row];
            assert_eq!(u.first_col, row.len(), "row {}: an update appends after the columns it has", u.row);
            row.extend_from_slice(u.blocks);
        }
        for (r, &id) in step.req_ids.iter().enumerate() {
            let row = step.table_rows[r] as usize;
            assert_eq!(s.table_row(id), Some(step.table_rows[r]), "request {id}: its table row");
            assert_eq!(&self.tables[0][row][..], s.kv().swa_blocks(id).expect("held"), "request {id}: SWA row");
            assert_eq!(&self.tables[1][row][..], s.kv().kv_blocks(id).expect("held"), "request {id}: main row");
        }
    }

    fn run(&mut self, s: &Scheduler, step: &Step) -> Vec<i32> {
        self.apply_tables(s, step);
        for r in 0..step.num_reqs() {
            let kv_row = &self.tables[1][step.table_rows[r] as usize];
            for t in step.query_start_loc[r] as usize..step.query_start_loc[r + 1] as usize {
                let pos = step.positions[t] as usize;
                self.swa[step.slot_mapping[t] as usize] = step.token_ids[t];
                self.main[kv_row[pos / KV_BS] as usize * KV_BS + pos % KV_BS] = step.token_ids[t];
            }
        }
        let mut out = Vec::new();
        for r in (0..step.num_reqs()).filter(|&r| step.samples[r]) {
            let swa_row = &self.tables[0][step.table_rows[r] as usize];
            let kv_row = &self.tables[1][step.table_rows[r] as usize];
            let len = step.seq_lens[r] as usize;
            let ctx: Vec<i32> =
                (0..len).map(|p| self.swa[swa_row[p / SWA_BS] as usize * SWA_BS + p % SWA_BS]).collect();
            let ctx_main: Vec<i32> =
                (0..len).map(|p| self.main[kv_row[p / KV_BS] as usize * KV_BS + p % KV_BS]).collect();
            assert_eq!(ctx, ctx_main, "request {}: the two caches disagree", step.req_ids[r]);
            out.push(sample(step.req_ids[r], &ctx));
        }
        out
    }
}

/// Checks a step against the limits, attention's contract and the block manager.
fn check_step(s: &Scheduler, step: &Step, common: &mut CommonAttentionMetadata) {
    let c = *s.config();
    let kc = *s.kv().config();
    let (nr, nt) = (step.num_reqs(), step.num_tokens());
    assert!(nr >= 1 && nr <= c.max_num_seqs, "{nr} requests");
    assert!(nt >= 1 && nt <= c.max_num_batched_tokens, "{nt} tokens");
    assert_eq!(step.query_start_loc.len(), nr + 1);
    assert_eq!(step.query_start_loc[0], 0);
    assert_eq!(step.query_start_loc[nr] as usize, nt);
    assert_eq!((step.positions.len(), step.slot_mapping.len(), step.table_rows.len()), (nt, nt, nr));
    let mut rows = step.table_rows.clone();
    rows.sort_unstable();
    rows.dedup();
    assert_eq!(rows.len(), nr, "distinct table rows");
    assert!(rows.iter().all(|&r| (r as usize) < c.max_num_seqs), "table rows in range: {rows:?}");
    let mut seen_long = false;
    for r in 0..nr {
        let q = step.query_len(r);
        assert!(q >= 1, "row {r} is empty");
        if r < step.num_decodes {
            assert_eq!(q, 1, "decode row {r}");
        }
        if q > 1 {
            seen_long = true;
            if c.long_prefill_token_threshold > 0 {
                assert!(q <= c.long_prefill_token_threshold, "row {r}: chunk {q}");
            }
        } else {
            assert!(!seen_long, "row {r}: a one-token row after a longer one");
        }
        let id = step.req_ids[r];
        let seq = step.seq_lens[r] as usize;
        assert!(seq <= c.max_model_len);
        assert_eq!(s.kv().held_len(id), Some(seq), "request {id} holds exactly its tokens");
        let swa_row = s.kv().swa_blocks(id).expect("held");
        let (need_swa, need_kv) = s.kv().blocks_for(seq);
        assert_eq!((swa_row.len(), s.kv().kv_blocks(id).map(<[i32]>::len)), (need_swa, Some(need_kv)));
        assert!(swa_row.len() <= kc.max_blocks_per_seq_swa && swa_row.iter().all(|&b| b >= 1));
        for j in 0..q {
            let t = step.query_start_loc[r] as usize + j;
            let pos = step.positions[t] as usize;
            assert_eq!(pos, seq - q + j, "token {t}: positions contract");
            assert_eq!(step.slot_mapping[t], swa_row[pos / SWA_BS] * SWA_BS as i32 + (pos % SWA_BS) as i32);
        }
    }
    let st = s.kv().stats();
    assert_eq!(st.swa_used + st.swa_free, st.swa_capacity);
    assert_eq!(st.kv_used + st.kv_free, st.kv_capacity);
    for &row in &step.released_rows {
        common.release_table_row(row as usize).expect("a released row is in range");
    }
    let layout = common.stage(&step.step_input(nr, nt)).expect("attention accepts the step");
    assert!(layout.num_decodes >= step.num_decodes || step.is_uniform_decode());
    assert_eq!(step.sample_rows().len(), step.num_sampling());
}

fn common_for(s: &Scheduler) -> CommonAttentionMetadata {
    let c = s.config();
    let kc = s.kv().config();
    let cc = CommonConfig {
        max_num_batched_tokens: c.max_num_batched_tokens,
        max_num_seqs: c.max_num_seqs,
        max_model_len: c.max_model_len,
        num_spec_tokens: 0,
        swa_table: kc.swa_table(),
        kv_table: kc.kv_table(),
        max_table_updates: kc.swa_table().growth_cells(c.max_num_batched_tokens, c.max_num_seqs)
            + kc.kv_table().growth_cells(c.max_num_batched_tokens, c.max_num_seqs),
    };
    CommonAttentionMetadata::new(&Device::cpu().expect("cpu device"), cc).expect("common metadata")
}

/// Runs `s` to idle with the fake model, adding `arrivals[i]` before step `i`; returns every
/// finished request by id, and the steps taken.
fn run_to_idle(s: &mut Scheduler, mut arrivals: Vec<Vec<Request>>) -> (BTreeMap<u64, Finished>, usize) {
    let mut common = common_for(s);
    let mut model = FakeModel::new(*s.kv().config());
    let mut done = BTreeMap::new();
    arrivals.reverse();
    let mut steps = 0;
    loop {
        if let Some(batch) = arrivals.pop() {
            for r in batch {
                s.add(r).expect("valid request");
            }
        }
        let Some(step) = s.schedule().expect("schedule") else {
            if arrivals.is_empty() {
                break;
            }
            continue;
        };
        steps += 1;
        assert!(steps < 100_000, "no progress");
        check_step(s, &step, &mut common);
        let sampled = model.run(s, &step);
        for f in s.update(&step, &sampled).expect("update") {
            assert!(done.insert(f.id, f).is_none(), "finished twice");
        }
    }
    let st = s.kv().stats();
    assert_eq!((st.swa_used, st.kv_used, st.requests), (0, 0, 0), "all blocks back");
    assert!(s.is_idle());
    (done, steps)
}

fn apply(s: &mut Scheduler, step: &Step, model: &mut FakeModel) -> Vec<Finished> {
    let sampled = model.run(s, step);
    s.update(step, &sampled).expect("update")
}

#[test]
fn bad_requests_are_refused_with_precise_messages() {
    let mut s = scheduler(cfg(4, 64, 0), 128, 64);
    let msg = |s: &mut Scheduler, r: Request| s.add(r).expect_err("refused").to_string();
    assert_eq!(msg(&mut s, Request { id: 5, prompt: vec![], max_new_tokens: 3 }), "request 5: the prompt is empty");
    assert_eq!(msg(&mut s, Request { id: 5, prompt: vec![1], max_new_tokens: 0 }), "request 5: max_new_tokens is 0");
    assert_eq!(
        msg(&mut s, Request { id: 5, prompt: vec![1, -3], max_new_tokens: 1 }),
        "request 5: prompt token 1 has negative id -3"
    );
    assert_eq!(
        msg(&mut s, Request { id: 5, prompt: vec![1, 49_999, 50_000], max_new_tokens: 1 }),
        "request 5: prompt token 2 has id 50000, outside the vocabulary [0, 50000)"
    );
    assert_eq!(
        msg(&mut s, req(5, 200, 57)),
        "request 5: prompt (200 tokens) + max_new_tokens (57) = 257 exceeds max_model_len 256"
    );
    s.add(req(5, 200, 56)).expect("exactly max_model_len");
    assert_eq!(msg(&mut s, req(5, 1, 1)), "request 5: the id is already waiting or running");
    assert_eq!(s.num_waiting(), 1);
}

#[test]
fn a_request_that_can_never_fit_is_refused_not_livelocked() {
    // 8 usable SWA blocks of 4 tokens: 32 tokens of KV at most.
    let mut s = scheduler(cfg(4, 64, 0), 9, 64);
    s.add(req(1, 30, 3)).expect("32 tokens of KV fit");
    let err = s.add(req(2, 30, 4)).expect_err("33 tokens of KV");
    assert!(matches!(err, ScheduleError::NeverFits { id: 2, tokens: 33, .. }), "{err}");
    assert_eq!(
        err.to_string(),
        "request 2 can never fit the KV cache (33 tokens of KV at most): \
         request 2: 33 tokens need 9 blocks of 4 tokens in the swa cache, which has 8 usable blocks"
    );
    // A table row too narrow is the same kind of error.
    let kv = KvManager::new(KvConfig { max_blocks_per_seq_kv: 2, ..kv_cfg(128, 64) }).expect("kv");
    let mut s2 = Scheduler::new(cfg(4, 64, 0), kv).expect("scheduler");
    let err = s2.add(req(3, 17, 1)).expect_err("17 tokens need 3 main blocks");
    assert!(err.to_string().contains("block-table row has 2 columns"), "{err}");
    assert!(s2.is_idle());
    // The one that fits runs alone to the end.
    let (done, _) = run_to_idle(&mut s, vec![]);
    assert_eq!(done[&1].tokens, alone(&req(1, 30, 3)));
}

/// Every unusable limit is a config error naming the limit (the config's fields are listed, the
/// offending one with its value) and the rule it breaks; nothing is allocated.
#[test]
fn bad_limits_are_config_errors() {
    let new = |c: SchedulerConfig| Scheduler::new(c, KvManager::new(kv_cfg(8, 8)).expect("kv")).map(drop);
    let config: fn(&ScheduleError) -> bool = |e| matches!(e, ScheduleError::Config(_));
    let past_i32 = i32::MAX as usize + 1;
    let cases: Vec<ErrorCase<ScheduleError>> = vec![
        ("no requests", new(cfg(0, 8, 0)), config, words(&["scheduler config: max_num_seqs must be positive, got 0"])),
        (
            "no tokens",
            new(cfg(1, 0, 0)),
            config,
            words(&["scheduler config: max_num_batched_tokens must be positive, got 0"]),
        ),
        (
            "no model length",
            new(SchedulerConfig { max_model_len: 0, ..cfg(1, 8, 0) }),
            config,
            words(&["scheduler config: max_model_len must be positive, got 0"]),
        ),
        (
            "model length past i32",
            new(SchedulerConfig { max_model_len: past_i32, ..cfg(1, 8, 0) }),
            config,
            words(&["max_model_len 2147483648 does not fit in i32"]),
        ),
        (
            "token budget past i32",
            new(cfg(1, past_i32, 0)),
            config,
            words(&["max_num_batched_tokens 2147483648 does not fit in i32"]),
        ),
        (
            "empty vocabulary",
            new(SchedulerConfig { vocab_size: 0, ..cfg(1, 8, 0) }),
            config,
            words(&["vocab_size must lie in [1, 2^31], got 0"]),
        ),
        (
            "vocabulary past 2^31",
            new(SchedulerConfig { vocab_size: (1 << 31) + 1, ..cfg(1, 8, 0) }),
            config,
            words(&["vocab_size must lie in [1, 2^31], got 2147483649"]),
        ),
        (
            "table rows past u32",
            new(cfg(1 << 32, 8, 0)),
            config,
            words(&["max_num_seqs 4294967296 does not fit in u32"]),
        ),
    ];
    check_errors(cases);
}

#[test]
fn an_idle_scheduler_schedules_nothing() {
    let mut s = scheduler(cfg(4, 64, 0), 64, 64);
    assert!(s.is_idle());
    assert_eq!(s.schedule().expect("idle"), None);
}

#[test]
fn decodes_come_first_then_partial_prefills_then_new_requests() {
    let mut s = scheduler(cfg(8, 8, 0), 64, 64);
    let mut common = common_for(&s);
    let mut model = FakeModel::new(*s.kv().config());
    s.add(req(10, 3, 5)).expect("ok");
    s.add(req(11, 10, 5)).expect("ok");
    s.add(req(12, 6, 5)).expect("ok");
    let st = s.schedule().expect("ok").expect("work");
    check_step(&s, &st, &mut common);
    assert_eq!(st.req_ids, vec![10, 11]);
    assert_eq!(st.query_start_loc, vec![0, 3, 8]);
    assert_eq!(st.samples, vec![true, false]);
    assert_eq!(st.num_decodes, 0);
    assert_eq!(st.sample_rows(), vec![2]);
    let g0 = model.run(&s, &st);
    s.update(&st, &g0).expect("update");

    let st = s.schedule().expect("ok").expect("work");
    check_step(&s, &st, &mut common);
    // Decode of 10 (its first generated token at position prompt_len), the rest of 11, then 12.
    assert_eq!(st.req_ids, vec![10, 11, 12]);
    assert_eq!(st.query_start_loc, vec![0, 1, 6, 8]);
    assert_eq!(st.num_decodes, 1);
    assert_eq!((st.token_ids[0], st.positions[0], st.seq_lens[0]), (g0[0], 3, 4));
    assert_eq!(st.positions[1..6], [5, 6, 7, 8, 9]);
    assert_eq!(st.samples, vec![true, true, false]);
    assert_eq!(st.sample_rows(), vec![0, 5]);
    assert!(!st.is_uniform_decode());
    apply(&mut s, &st, &mut model);

    let st = s.schedule().expect("ok").expect("work");
    check_step(&s, &st, &mut common);
    assert_eq!(st.req_ids, vec![10, 11, 12]);
    assert_eq!(st.query_start_loc, vec![0, 1, 2, 6]);
    assert_eq!(st.num_decodes, 2);
}

#[test]
fn chunked_prefill_splits_under_the_budget_and_the_threshold() {
    let mut s = scheduler(cfg(8, 10, 4), 64, 64);
    let mut common = common_for(&s);
    let mut model = FakeModel::new(*s.kv().config());
    s.add(req(1, 11, 2)).expect("ok");
    s.add(req(2, 9, 2)).expect("ok");
    s.add(req(3, 3, 2)).expect("ok");
    let mut shapes = Vec::new();
    for _ in 0..3 {
        let st = s.schedule().expect("ok").expect("work");
        check_step(&s, &st, &mut common);
        let q: Vec<usize> = (0..st.num_reqs()).map(|r| st.query_len(r)).collect();
        shapes.push((st.req_ids.clone(), q, st.samples.clone()));
        apply(&mut s, &st, &mut model);
    }
    assert_eq!(
        shapes,
        vec![
            // Threshold 4 per request, budget 10 in all: 4 + 4 + 2.
            (vec![1, 2, 3], vec![4, 4, 2], vec![false, false, false]),
            // 3's last prompt token is a one-token chunk: it goes before the longer chunks.
            (vec![3, 1, 2], vec![1, 4, 4], vec![true, false, false]),
            // 3 decodes; 2's one-token chunk comes before 1's three tokens.
            (vec![3, 2, 1], vec![1, 1, 3], vec![true, true, true]),
        ]
    );
}

#[test]
fn a_one_token_chunk_goes_before_longer_rows() {
    let mut s = scheduler(cfg(8, 5, 0), 64, 64);
    let mut common = common_for(&s);
    let mut model = FakeModel::new(*s.kv().config());
    s.add(req(1, 9, 1)).expect("ok");
    let st = s.schedule().expect("ok").expect("work");
    check_step(&s, &st, &mut common);
    assert_eq!(st.query_start_loc, vec![0, 5]);
    apply(&mut s, &st, &mut model);
    s.add(req(2, 6, 1)).expect("ok");
    // 1 has 4 tokens left; the budget leaves 2 one token.
    let st = s.schedule().expect("ok").expect("work");
    check_step(&s, &st, &mut common);
    assert_eq!(st.req_ids, vec![2, 1]);
    assert_eq!(st.query_start_loc, vec![0, 1, 5]);
    assert_eq!(st.num_decodes, 0);
    assert_eq!(st.samples, vec![false, true]);
    assert_eq!(st.sample_rows(), vec![4]);
}

#[test]
fn a_uniform_decode_step_has_one_token_per_request() {
    let mut s = scheduler(cfg(8, 64, 0), 64, 64);
    let mut model = FakeModel::new(*s.kv().config());
    for id in 0..3 {
        s.add(req(id, 5, 4)).expect("ok");
    }
    let st = s.schedule().expect("ok").expect("work");
    apply(&mut s, &st, &mut model);
    let st = s.schedule().expect("ok").expect("work");
    assert!(st.is_uniform_decode());
    assert_eq!((st.num_decodes, st.num_tokens(), st.num_sampling()), (3, 3, 3));
    assert_eq!(st.sample_rows(), vec![0, 1, 2]);
    assert_eq!(st.positions, vec![5, 5, 5]);
}

#[test]
fn table_rows_live_from_admission_to_finish_and_steps_carry_only_new_blocks() {
    use holdfast_attention::TableKind;
    let mut s = scheduler(cfg(2, 64, 0), 64, 64);
    let mut common = common_for(&s);
    let mut model = FakeModel::new(*s.kv().config());
    // A: 6 prompt tokens, 6 new; B: 3 and 2; C waits for a row.
    for r in [req(1, 6, 6), req(2, 3, 2), req(3, 5, 3)] {
        s.add(r).expect("ok");
    }
    let st = s.schedule().expect("ok").expect("work");
    check_step(&s, &st, &mut common);
    assert_eq!(st.req_ids, vec![1, 2]);
    assert_eq!(st.table_rows, vec![0, 1]);
    assert_eq!(st.released_rows, vec![0, 1], "a fresh scheduler's first step releases every row");
    let ups: Vec<_> = st.table_updates.iter().map(|u| (u.table, u.row, u.first_col, u.blocks.len())).collect();
    // Whole rows on admission: A holds 2 SWA blocks (4 tokens each) and 1 main block (8 tokens).
    assert_eq!(
        ups,
        vec![(TableKind::Swa, 0, 0, 2), (TableKind::Kv, 0, 0, 1), (TableKind::Swa, 1, 0, 1), (TableKind::Kv, 1, 0, 1)]
    );
    apply(&mut s, &st, &mut model);
    let mut c_row = None;
    while let Some(st) = s.schedule().expect("ok") {
        check_step(&s, &st, &mut common);
        for (r, &id) in st.req_ids.iter().enumerate() {
            if id == 1 {
                assert_eq!(st.table_rows[r], 0, "A keeps its row");
            }
            if id == 3 {
                c_row = Some(st.table_rows[r]);
            }
        }
        for u in st.table_updates.iter() {
            let id = st.req_ids[st.table_rows.iter().position(|&r| r as usize == u.row).expect("a row of the step")];
            let held = match u.table {
                TableKind::Swa => s.kv().swa_blocks(id),
                TableKind::Kv => s.kv().kv_blocks(id),
            };
            // An update holds exactly the blocks past what the row had: the newest ones.
            assert_eq!(Some(u.blocks), held.map(|h| &h[u.first_col..]), "request {id}");
            if id == 1 {
                assert!(u.first_col > 0, "A's row is never written again from the start");
            }
        }
        let decodes_only = st.is_uniform_decode() && !st.req_ids.contains(&3);
        if decodes_only {
            let grew = st.seq_lens.iter().any(|&l| (l - 1) % 4 == 0 || (l - 1) % 8 == 0);
            assert_eq!(st.table_updates.is_empty(), !grew, "decodes write a table only at a block start");
        }
        apply(&mut s, &st, &mut model);
    }
    assert_eq!(c_row, Some(1), "C is admitted on the row B gave back");
}

#[test]
fn decodes_beyond_the_token_budget_wait_their_turn() {
    let mut s = scheduler(cfg(4, 4, 0), 64, 64);
    let mut model = FakeModel::new(*s.kv().config());
    for id in 0..4 {
        s.add(req(id, 1, 3)).expect("ok");
    }
    let st = s.schedule().expect("ok").expect("work");
    assert_eq!(st.num_tokens(), 4);
    apply(&mut s, &st, &mut model);
    s.add(req(9, 2, 1)).expect("ok");
    let st = s.schedule().expect("ok").expect("work");
    // Four decodes use the whole budget; 9 is not admitted (max_num_seqs 4 anyway).
    assert_eq!(st.req_ids, vec![0, 1, 2, 3]);
    assert_eq!(s.num_waiting(), 1);
}

#[test]
fn the_most_recently_admitted_request_is_preempted_and_recomputes_later() {
    // 6 usable SWA blocks of 4 tokens; each request needs 4 blocks at its longest (15 tokens).
    let mut s = scheduler(cfg(4, 64, 0), 7, 64);
    let mut common = common_for(&s);
    let mut model = FakeModel::new(*s.kv().config());
    let (a, b) = (req(1, 8, 8), req(2, 8, 8));
    s.add(a.clone()).expect("ok");
    s.add(b.clone()).expect("ok");
    let mut done = BTreeMap::new();
    let mut steps = Vec::new();
    while let Some(st) = s.schedule().expect("schedule") {
        check_step(&s, &st, &mut common);
        steps.push(st.clone());
        let preempted_before = s.num_preemptions();
        for f in apply(&mut s, &st, &mut model) {
            done.insert(f.id, f);
        }
        assert_eq!(s.num_preemptions(), preempted_before, "update never preempts");
    }
    // Steps: both prefill (8 tokens each, 2 blocks each), then decodes at positions 8..11 use the
    // third blocks; at position 12 request 1 needs a fourth block and none is free: 2 goes.
    let rows = |st: &Step| st.req_ids.clone();
    assert_eq!(rows(&steps[0]), vec![1, 2]);
    for st in &steps[1..5] {
        assert_eq!(rows(st), vec![1, 2]);
        assert!(st.is_uniform_decode());
    }
    assert_eq!(rows(&steps[5]), vec![1]);
    assert_eq!(steps[5].positions, vec![12]);
    // 1 runs to the end (positions 12..14); then 2 recomputes prompt + its 5 generated tokens.
    let recompute = steps.iter().position(|st| st.req_ids == [2] && st.num_tokens() > 1).expect("recompute");
    let st = &steps[recompute];
    assert_eq!(st.positions, (0..13).collect::<Vec<i32>>());
    let mut expect_tokens = b.prompt.clone();
    expect_tokens.extend(&alone(&b)[..5]);
    assert_eq!(st.token_ids, expect_tokens);
    assert_eq!(st.samples, vec![true]);
    assert!(steps[..recompute].iter().all(|st| !st.req_ids.contains(&2) || st.positions[0] < 12));
    assert_eq!(done[&1].tokens, alone(&a));
    assert_eq!(done[&1].preemptions, 0);
    assert_eq!(done[&2].tokens, alone(&b));
    assert_eq!(done[&2].preemptions, 1);
    assert_eq!(s.num_preemptions(), 1);
}

#[test]
fn a_preempted_request_goes_to_the_front_of_the_queue_and_blocks_admission_that_step() {
    let mut s = scheduler(cfg(4, 64, 0), 7, 64);
    let mut model = FakeModel::new(*s.kv().config());
    s.add(req(1, 8, 8)).expect("ok");
    s.add(req(2, 8, 8)).expect("ok");
    for _ in 0..5 {
        let st = s.schedule().expect("ok").expect("work");
        apply(&mut s, &st, &mut model);
    }
    s.add(req(3, 1, 1)).expect("ok");
    let st = s.schedule().expect("ok").expect("work");
    // 2 was preempted in this step: nothing is admitted even though 3 would fit.
    assert_eq!(st.req_ids, vec![1]);
    assert_eq!(s.waiting_ids().collect::<Vec<_>>(), vec![2, 3]);
    assert_eq!(s.running_ids(), &[1]);
    assert_eq!(s.generated(2).map(<[i32]>::len), Some(5), "generated tokens are kept");
    assert!(!s.kv().holds(2));
}

#[test]
fn a_request_already_in_the_step_is_taken_out_when_preempted() {
    // 5 usable SWA blocks of 4. P (admitted first) prefills 16 tokens in chunks of 4; D decodes.
    let mut s = scheduler(cfg(4, 8, 4), 6, 64);
    let mut common = common_for(&s);
    let mut model = FakeModel::new(*s.kv().config());
    let (p, d) = (req(1, 16, 1), req(2, 2, 6));
    s.add(p.clone()).expect("ok");
    s.add(d.clone()).expect("ok");
    let mut all = Vec::new();
    let mut done = BTreeMap::new();
    while let Some(st) = s.schedule().expect("ok") {
        check_step(&s, &st, &mut common);
        all.push(st.clone());
        for f in apply(&mut s, &st, &mut model) {
            done.insert(f.id, f);
        }
    }
    let rows: Vec<(Vec<u64>, Vec<i32>)> =
        all.iter().map(|st| (st.req_ids.clone(), st.query_start_loc.clone())).collect();
    assert_eq!(rows[0], (vec![1, 2], vec![0, 4, 6]));
    assert_eq!(rows[1], (vec![2, 1], vec![0, 1, 5]));
    assert_eq!(rows[2], (vec![2, 1], vec![0, 1, 5]));
    // D's decode at position 4 took the fifth block; P's last chunk needs another: D (admitted
    // last, already in the step) is preempted and taken out, P runs alone.
    assert_eq!(rows[3], (vec![1], vec![0, 4]));
    assert_eq!(done[&1].tokens, alone(&p));
    assert_eq!(done[&2].tokens, alone(&d));
    assert_eq!(done[&2].preemptions, 1);
}

#[test]
fn update_checks_the_step_and_the_samples_and_changes_nothing_on_error() {
    let mut s = scheduler(cfg(4, 64, 0), 64, 64);
    let mut model = FakeModel::new(*s.kv().config());
    s.add(req(1, 4, 2)).expect("ok");
    s.add(req(2, 4, 2)).expect("ok");
    assert_eq!(
        s.update(&Step::default(), &[]).expect_err("none in flight").to_string(),
        "update: no step is in flight"
    );
    let st = s.schedule().expect("ok").expect("work");
    assert_eq!(s.schedule(), Err(ScheduleError::StepInFlight));
    assert_eq!(s.update(&st, &[1]).expect_err("one short").to_string(), "update: 1 sampled tokens for 2 sampling rows");
    assert_eq!(
        s.update(&st, &[1, -2]).expect_err("negative").to_string(),
        "update: sampled token 1 has negative id -2"
    );
    let mut other = st.clone();
    other.req_ids.swap(0, 1);
    assert_eq!(
        s.update(&other, &[1, 2]).expect_err("rows swapped").to_string(),
        "update: the step given is not the one in flight"
    );
    assert!(s.has_step_in_flight());
    // Abort: the same tokens are scheduled again.
    s.abort_step();
    let again = s.schedule().expect("ok").expect("work");
    assert_eq!(again, st);
    let sampled = model.run(&s, &again);
    s.update(&again, &sampled).expect("update");
    assert_eq!(
        s.update(&again, &sampled),
        Err(ScheduleError::StaleStep("no step is in flight".into())),
        "applied twice"
    );
    assert_eq!(s.generated(1).map(<[i32]>::len), Some(1));
}

/// A small deterministic generator (splitmix64).
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + (self.next() % (hi - lo) as u64) as usize
    }
}

#[test]
fn two_hundred_random_requests_each_get_what_they_get_alone() {
    let mut rng = Rng(42);
    let c = SchedulerConfig {
        max_num_seqs: 16,
        max_num_batched_tokens: 64,
        max_model_len: 128,
        long_prefill_token_threshold: 24,
        vocab_size: VOCAB,
    };
    // 100 usable SWA blocks = 400 tokens for up to 16 requests of up to 127: preemption happens.
    let mut s = scheduler(c, 101, 60);
    let mut requests = Vec::new();
    let mut arrivals: Vec<Vec<Request>> = Vec::new();
    let mut id = 1000;
    while requests.len() < 200 {
        let mut batch = Vec::new();
        for _ in 0..rng.range(0, 4) {
            let len = rng.range(1, 90);
            let r = req(id, len, rng.range(1, (128 - len).min(40) + 1));
            id += 1;
            requests.push(r.clone());
            batch.push(r);
        }
        arrivals.push(batch);
    }
    let (done, steps) = run_to_idle(&mut s, arrivals);
    assert_eq!(done.len(), requests.len());
    for r in &requests {
        let f = &done[&r.id];
        assert_eq!(f.tokens.len(), r.max_new_tokens, "request {}", r.id);
        assert_eq!(f.tokens, alone(r), "request {} ({} preemptions)", r.id, f.preemptions);
    }
    assert!(s.num_preemptions() > 0, "the pool is small enough to preempt");
    assert!(steps > 200);
    // The same request alone, through the scheduler, gives the same tokens.
    for r in requests.iter().step_by(40) {
        let mut solo = scheduler(c, 101, 60);
        let (d, _) = run_to_idle(&mut solo, vec![vec![r.clone()]]);
        assert_eq!(d[&r.id].tokens, done[&r.id].tokens);
        assert_eq!(d[&r.id].preemptions, 0);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]
    #[test]
    fn random_workloads_finish_with_every_block_back(
        max_num_seqs in 1usize..6,
        budget in 1usize..40,
        threshold in 0usize..12,
        swa_blocks in 17usize..40,
        reqs in prop::collection::vec((1usize..40, 1usize..20, 0usize..4), 1..25),
    ) {
        let c = SchedulerConfig {
            max_num_seqs,
            max_num_batched_tokens: budget,
            max_model_len: 64,
            long_prefill_token_threshold: threshold,
            vocab_size: VOCAB,
        };
        let mut s = scheduler(c, swa_blocks, 64);
        let mut arrivals: Vec<Vec<Request>> = Vec::new();
        let mut all = Vec::new();
        for (i, &(len, new, gap)) in reqs.iter().enumerate() {
            let r = req(i as u64, len, new);
            all.push(r.clone());
            arrivals.push(vec![r]);
            arrivals.extend(std::iter::repeat_n(Vec::new(), gap));
        }
        let (done, _) = run_to_idle(&mut s, arrivals);
        prop_assert_eq!(done.len(), all.len());
        for r in &all {
            prop_assert_eq!(&done[&r.id].tokens, &alone(r));
        }
    }
}
