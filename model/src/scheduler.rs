//! Continuous-batching scheduler with chunked prefill (host side only).
//!
//! [`Scheduler::schedule`] turns the queued and running requests into one [`Step`]: the host
//! arrays attention's `StepInput` wants (spec §3.4), unpadded. [`Scheduler::update`] feeds back
//! the sampled tokens. The two alternate: one step is in flight at a time.
//!
//! # Policies
//!
//! - **Token state.** A request's tokens are its prompt followed by what it generated so far;
//!   `computed` of them have their KV written. Each step computes the next chunk
//!   `[computed, computed + n)`; the chunk that reaches the last known token samples a new one.
//!   A *decode* is a request whose only uncomputed token is its last generated token: after the
//!   final prefill chunk samples `g0`, the next step's decode query is `g0` at position
//!   `prompt_len`.
//! - **Order and budget.** Per step at most `max_num_batched_tokens` tokens and `max_num_seqs`
//!   requests. Running decodes come first (one token each, in admission order), then prefill
//!   chunks: running partial prefills (admission order), then waiting requests admitted FCFS. A
//!   prefill chunk is `min(remaining, budget left, long_prefill_token_threshold)` tokens.
//!   Admission stops at the first waiting request that does not fit (no skipping ahead), at
//!   `max_num_seqs` running requests, and in any step that preempted.
//! - **Row order for attention.** Attention requires every row of one query token (its decode
//!   threshold, no speculative tokens) before the longer rows. A prefill chunk of exactly one token
//!   is therefore placed right after the decodes, ahead of the longer chunks; otherwise rows keep
//!   the order above. [`Step::num_decodes`] counts only the decoding requests, so attention's own
//!   decode count may be larger by those one-token chunks (they attend exactly like decodes).
//! - **Preemption and recompute.** When a running request cannot grow, the most recently admitted
//!   running request is preempted (possibly the one growing): its blocks are freed, its generated
//!   tokens kept, it goes to the front of the waiting queue and, when admitted again, recomputes
//!   its prompt and generated tokens as prefill. The last recomputed chunk samples the next token;
//!   with greedy decoding (and batch-invariant kernels) that token, and every later one, equals
//!   what an uninterrupted run produces.
//! - **No livelock.** [`Scheduler::add`] rejects a request whose longest KV footprint
//!   (`prompt + max_new_tokens − 1` tokens: the last sampled token is never written) does not fit
//!   the empty cache or a block-table row. A request alone therefore always fits, and the earliest
//!   admitted running request is never preempted for another, so every step makes progress.
//! - **Table rows.** Attention keeps every running request's block-table rows on the device,
//!   indexed by a table row in `[0, max_num_seqs)` that the request holds from admission until it
//!   finishes or is preempted (then the row is free for the next admission). A step's
//!   [`Step::table_updates`] carry only the blocks handed out since the request's previous step
//!   (its whole row on admission, and again after a preemption), and [`Step::released_rows`] the
//!   rows given back since the previous step. A fresh scheduler's first step releases every row,
//!   so whatever an earlier scheduler left in attention's tables counts as unwritten.
//! - Requests end only at `max_new_tokens` (no stop tokens yet).

use std::collections::{HashMap, VecDeque};

use holdfast_attention::{BlockTableUpdates, StepInput};

use crate::kv::{KvError, KvManager};

/// Errors of the scheduler.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ScheduleError {
    /// A construction-time size is unusable.
    #[error("scheduler config: {0}")]
    Config(String),
    /// A request refused by [`Scheduler::add`]; the message names the request and the limit.
    #[error("request {id}: {reason}")]
    BadRequest {
        /// The request.
        id: u64,
        /// What is wrong with it.
        reason: String,
    },
    /// A request that can never fit the KV cache, even alone.
    #[error("request {id} can never fit the KV cache ({tokens} tokens of KV at most): {source}")]
    NeverFits {
        /// The request.
        id: u64,
        /// Its largest KV footprint, in tokens.
        tokens: usize,
        /// The limit it breaks.
        source: KvError,
    },
    /// [`Scheduler::schedule`] called while the previous step awaits [`Scheduler::update`].
    #[error("a step is in flight: call update (or abort_step) before scheduling the next one")]
    StepInFlight,
    /// [`Scheduler::update`] given a step that is not the one in flight.
    #[error("update: {0}")]
    StaleStep(String),
    /// [`Scheduler::update`] given the wrong sampled tokens.
    #[error("update: {0}")]
    BadSamples(String),
    /// Work remains but nothing could be scheduled (a bug guard: the admission checks rule it out).
    #[error("no progress: {waiting} waiting and {running} running requests, none schedulable")]
    Stuck {
        /// Waiting requests.
        waiting: usize,
        /// Running requests.
        running: usize,
    },
    /// The block manager refused an operation the scheduler had checked.
    #[error(transparent)]
    Kv(#[from] KvError),
}

/// One generation request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Request {
    /// Caller-chosen id, unique among live (waiting or running) requests.
    pub id: u64,
    /// Prompt token ids (non-empty, each ≥ 0).
    pub prompt: Vec<i32>,
    /// Tokens to generate (≥ 1); the request finishes after exactly this many.
    pub max_new_tokens: usize,
}

/// Per-step limits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SchedulerConfig {
    /// Most requests running at once, and so per step.
    pub max_num_seqs: usize,
    /// Most tokens per step (decode and prefill tokens together).
    pub max_num_batched_tokens: usize,
    /// Longest sequence, in tokens: `prompt + max_new_tokens` may not exceed it.
    pub max_model_len: usize,
    /// Most tokens of one request's prefill chunk per step; 0 = no limit.
    pub long_prefill_token_threshold: usize,
    /// Token ids lie in `[0, vocab_size)` (`1 ..= 2^31`).
    pub vocab_size: usize,
}

/// A request that generated all its tokens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Finished {
    /// The request's id.
    pub id: u64,
    /// Generated tokens only (`max_new_tokens` of them).
    pub tokens: Vec<i32>,
    /// Times it was preempted and recomputed.
    pub preemptions: u32,
}

/// One step's host arrays, unpadded, decodes first, exactly in the shape attention's
/// [`StepInput`] wants.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Step {
    /// `[num_reqs]` request of each row.
    pub req_ids: Vec<u64>,
    /// `[num_tokens]` input token ids.
    pub token_ids: Vec<i32>,
    /// `[num_reqs + 1]` cumulative query lengths, from 0 to `num_tokens`.
    pub query_start_loc: Vec<i32>,
    /// `[num_reqs]` tokens of each request after this step (context + new).
    pub seq_lens: Vec<i32>,
    /// `[num_tokens]` absolute position of each token: `seq_len − query_len + (t − query_start)`.
    pub positions: Vec<i32>,
    /// `[num_tokens]` SWA-cache slot each token's KV is written to.
    pub slot_mapping: Vec<i32>,
    /// `[num_reqs]` table row of each request in attention's persistent block tables (held from
    /// admission to finish or preemption).
    pub table_rows: Vec<u32>,
    /// Block-table writes of this step: every block handed out since the request's previous
    /// step, appended after the columns its row already has (the whole row on admission).
    pub table_updates: BlockTableUpdates,
    /// Table rows given back since the previous step (finished or preempted requests, or every
    /// row on a fresh scheduler's first step). Release them in attention before staging this
    /// step: one may be the row of a request admitted in this very step.
    pub released_rows: Vec<u32>,
    /// `[num_reqs]`: this row's last token produces a new token (decode, or the chunk that ends
    /// the prefill or the recompute).
    pub samples: Vec<bool>,
    /// Decoding requests (query length 1, the first `num_decodes` rows).
    pub num_decodes: usize,
}

impl Step {
    /// Requests in the step.
    pub fn num_reqs(&self) -> usize {
        self.req_ids.len()
    }

    /// Tokens in the step.
    pub fn num_tokens(&self) -> usize {
        self.token_ids.len()
    }

    /// Rows that sample a token (the length [`Scheduler::update`] wants).
    pub fn num_sampling(&self) -> usize {
        self.samples.iter().filter(|&&s| s).count()
    }

    /// Query tokens of row `r`, or 0 past the end.
    pub fn query_len(&self, r: usize) -> usize {
        match (self.query_start_loc.get(r), self.query_start_loc.get(r + 1)) {
            (Some(&a), Some(&b)) => usize::try_from(i64::from(b) - i64::from(a)).unwrap_or(0),
            _ => 0,
        }
    }

    /// Every request has query length 1 (false for an empty step).
    pub fn is_uniform_decode(&self) -> bool {
        self.num_reqs() > 0 && self.num_tokens() == self.num_reqs()
    }

    /// The token index (into `token_ids`) whose logits sample, for each sampling request, in row
    /// order.
    pub fn sample_rows(&self) -> Vec<usize> {
        self.samples
            .iter()
            .enumerate()
            .filter(|(_, &s)| s)
            .filter_map(|(r, _)| self.query_start_loc.get(r + 1).and_then(|&e| usize::try_from(i64::from(e) - 1).ok()))
            .collect()
    }

    /// Borrows the step as attention's [`StepInput`], with the given padded counts.
    pub fn step_input(&self, num_reqs_padded: usize, num_tokens_padded: usize) -> StepInput<'_> {
        StepInput {
            query_start_loc: &self.query_start_loc,
            seq_lens: &self.seq_lens,
            positions: &self.positions,
            slot_mapping: &self.slot_mapping,
            table_rows: &self.table_rows,
            table_updates: &self.table_updates,
            num_reqs_padded,
            num_tokens_padded,
        }
    }
}

#[derive(Debug)]
struct Seq {
    prompt: Vec<i32>,
    output: Vec<i32>,
    max_new_tokens: usize,
    /// Tokens whose KV has been written.
    computed: usize,
    preemptions: u32,
}

impl Seq {
    fn len(&self) -> usize {
        self.prompt.len() + self.output.len()
    }
    fn token(&self, i: usize) -> i32 {
        if i < self.prompt.len() {
            self.prompt[i]
        } else {
            self.output[i - self.prompt.len()]
        }
    }
    fn pending(&self) -> usize {
        self.len() - self.computed
    }
    fn is_decode(&self) -> bool {
        !self.output.is_empty() && self.pending() == 1
    }
}

/// A running request's table row and the `(swa, kv)` columns of it already sent as updates.
#[derive(Clone, Copy, Debug)]
struct TableRow {
    row: u32,
    sent: (usize, usize),
}

/// The step in flight: what [`Scheduler::update`] checks and [`Scheduler::abort_step`] undoes.
#[derive(Debug)]
struct InFlight {
    /// `(id, query_len)` of each row.
    rows: Vec<(u64, usize)>,
    /// `(id, columns sent before the step)` of each row, to send again if the step is aborted.
    sent_before: Vec<(u64, (usize, usize))>,
    /// The rows the step released, to release again if it is aborted.
    released: Vec<u32>,
}

/// Continuous-batching scheduler over a [`KvManager`] (see the module docs for the policies).
#[derive(Debug)]
pub struct Scheduler {
    cfg: SchedulerConfig,
    kv: KvManager,
    seqs: HashMap<u64, Seq>,
    /// FCFS queue; preempted requests go to the front.
    waiting: VecDeque<u64>,
    /// Admission order (the last is the most recently admitted).
    running: Vec<u64>,
    /// Table row of each running request.
    rows: HashMap<u64, TableRow>,
    /// Free table rows; the next one handed out is the last element.
    free_rows: Vec<u32>,
    /// Rows given back since the last step was built.
    released: Vec<u32>,
    in_flight: Option<InFlight>,
    preemptions: u64,
}

impl Scheduler {
    /// A scheduler owning `kv`. Errors when a limit is 0 or a token count overflows `i32`.
    pub fn new(cfg: SchedulerConfig, kv: KvManager) -> Result<Self, ScheduleError> {
        let limits = [
            ("max_num_seqs", cfg.max_num_seqs),
            ("max_num_batched_tokens", cfg.max_num_batched_tokens),
            ("max_model_len", cfg.max_model_len),
        ];
        if let Some(name) = crate::error::first_zero(&limits) {
            return Err(ScheduleError::Config(format!("{name} must be positive, got 0")));
        }
        if let Some((name, v)) = limits[1..].iter().find(|(_, v)| *v > i32::MAX as usize) {
            return Err(ScheduleError::Config(format!(
                "{name} {v} does not fit in i32 (the device holds token counts as i32)"
            )));
        }
        if cfg.vocab_size == 0 || cfg.vocab_size > 1 << 31 {
            return Err(ScheduleError::Config(format!("vocab_size must lie in [1, 2^31], got {}", cfg.vocab_size)));
        }
        if cfg.max_num_seqs > u32::MAX as usize {
            return Err(ScheduleError::Config(format!("max_num_seqs {} does not fit in u32", cfg.max_num_seqs)));
        }
        let rows = cfg.max_num_seqs as u32;
        Ok(Scheduler {
            cfg,
            kv,
            seqs: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            rows: HashMap::new(),
            // Reverse order so that rows are handed out 0, 1, 2, ….
            free_rows: (0..rows).rev().collect(),
            // Whatever an earlier scheduler left in attention's tables counts as unwritten.
            released: (0..rows).collect(),
            in_flight: None,
            preemptions: 0,
        })
    }

    /// The construction-time limits.
    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    /// Queues a request. Errors (naming the request and the limit) if the prompt is empty,
    /// `max_new_tokens == 0`, `prompt + max_new_tokens > max_model_len`, the id is already waiting
    /// or running, a token id is negative or past the vocabulary, or its KV can never fit the cache
    /// even alone.
    pub fn add(&mut self, r: Request) -> Result<(), ScheduleError> {
        let id = r.id;
        let bad = |reason: String| Err(ScheduleError::BadRequest { id, reason });
        if self.seqs.contains_key(&id) {
            return bad("the id is already waiting or running".into());
        }
        if r.prompt.is_empty() {
            return bad("the prompt is empty".into());
        }
        if r.max_new_tokens == 0 {
            return bad("max_new_tokens is 0".into());
        }
        if let Some((i, &t)) = r.prompt.iter().enumerate().find(|(_, &t)| t < 0) {
            return bad(format!("prompt token {i} has negative id {t}"));
        }
        let vocab = self.cfg.vocab_size;
        if let Some((i, &t)) = r.prompt.iter().enumerate().find(|(_, &t)| t as usize >= vocab) {
            return bad(format!("prompt token {i} has id {t}, outside the vocabulary [0, {vocab})"));
        }
        let total = r.prompt.len().saturating_add(r.max_new_tokens);
        if total > self.cfg.max_model_len {
            return bad(format!(
                "prompt ({} tokens) + max_new_tokens ({}) = {total} exceeds max_model_len {}",
                r.prompt.len(),
                r.max_new_tokens,
                self.cfg.max_model_len
            ));
        }
        let tokens = total - 1;
        self.kv.check_fits_alone(id, tokens).map_err(|source| ScheduleError::NeverFits { id, tokens, source })?;
        self.seqs.insert(
            id,
            Seq { prompt: r.prompt, output: Vec::new(), max_new_tokens: r.max_new_tokens, computed: 0, preemptions: 0 },
        );
        self.waiting.push_back(id);
        Ok(())
    }

    /// Gives back request `id`'s blocks and table row (it finished or was preempted).
    fn retire(&mut self, id: u64) {
        self.kv.free(id);
        if let Some(r) = self.rows.remove(&id) {
            self.free_rows.push(r.row);
            self.released.push(r.row);
        }
    }

    /// Preempts the most recently admitted running request; returns its id.
    fn preempt_last(&mut self) -> Option<u64> {
        let victim = self.running.pop()?;
        self.retire(victim);
        if let Some(s) = self.seqs.get_mut(&victim) {
            s.computed = 0;
            s.preemptions += 1;
        }
        self.waiting.push_front(victim);
        self.preemptions += 1;
        Some(victim)
    }

    fn chunk(&self, pending: usize, budget: usize) -> usize {
        let mut n = pending.min(budget);
        if self.cfg.long_prefill_token_threshold > 0 {
            n = n.min(self.cfg.long_prefill_token_threshold);
        }
        n
    }

    /// Builds the next step, or `None` when nothing is waiting or running (idle).
    ///
    /// Allocates KV blocks for the step's tokens, preempting and admitting as the module docs
    /// describe. Errors with [`ScheduleError::StepInFlight`] while the previous step awaits
    /// [`Scheduler::update`].
    pub fn schedule(&mut self) -> Result<Option<Step>, ScheduleError> {
        if self.in_flight.is_some() {
            return Err(ScheduleError::StepInFlight);
        }
        if self.is_idle() {
            return Ok(None);
        }
        let mut budget = self.cfg.max_num_batched_tokens;
        // (id, query_len, is_decode) in priority order.
        let mut plan: Vec<(u64, usize, bool)> = Vec::new();
        let mut preempted = false;

        let (decodes, partials): (Vec<u64>, Vec<u64>) =
            self.running.iter().partition(|id| self.seqs.get(id).is_some_and(Seq::is_decode));
        for id in decodes.into_iter().chain(partials) {
            if budget == 0 {
                break;
            }
            // Preempted earlier in this step: it waits now.
            if !self.running.contains(&id) {
                continue;
            }
            let Some(s) = self.seqs.get(&id) else { continue };
            let decode = s.is_decode();
            let n = if decode { 1 } else { self.chunk(s.pending(), budget) };
            let target = s.computed + n;
            loop {
                if self.kv.can_fit(id, target) {
                    self.kv.ensure(id, target)?;
                    plan.push((id, n, decode));
                    budget -= n;
                    break;
                }
                preempted = true;
                match self.preempt_last() {
                    Some(v) if v == id => break,
                    Some(v) => {
                        if let Some(i) = plan.iter().position(|p| p.0 == v) {
                            budget += plan.remove(i).1;
                        }
                    }
                    None => break,
                }
            }
        }

        if !preempted {
            while budget > 0 && self.running.len() < self.cfg.max_num_seqs {
                let Some(&id) = self.waiting.front() else { break };
                let Some(s) = self.seqs.get(&id) else {
                    self.waiting.pop_front();
                    continue;
                };
                let n = self.chunk(s.pending(), budget);
                if !self.kv.can_fit(id, n) {
                    break;
                }
                // Fewer than max_num_seqs run, so a row is free.
                let Some(row) = self.free_rows.pop() else { break };
                self.kv.ensure(id, n)?;
                self.waiting.pop_front();
                self.running.push(id);
                self.rows.insert(id, TableRow { row, sent: (0, 0) });
                plan.push((id, n, false));
                budget -= n;
            }
        }

        if plan.is_empty() {
            return Err(ScheduleError::Stuck { waiting: self.waiting.len(), running: self.running.len() });
        }
        // Decodes, then one-token prefill chunks, then the longer chunks (stable within each).
        let rank = |&(_, n, d): &(u64, usize, bool)| {
            if d {
                0
            } else if n == 1 {
                1
            } else {
                2
            }
        };
        plan.sort_by_key(rank);
        let sent_before = plan.iter().filter_map(|p| self.rows.get(&p.0).map(|r| (p.0, r.sent))).collect();
        let step = match self.build_step(&plan) {
            Ok(step) => step,
            Err(e) => {
                self.rewind(sent_before, Vec::new());
                return Err(e);
            }
        };
        self.in_flight = Some(InFlight {
            rows: plan.iter().map(|&(id, n, _)| (id, n)).collect(),
            sent_before,
            released: step.released_rows.clone(),
        });
        Ok(Some(step))
    }

    /// Undoes a step's table bookkeeping: its requests' rows count as holding only the columns
    /// sent before it, and the rows it released are released again with the next step.
    fn rewind(&mut self, sent_before: Vec<(u64, (usize, usize))>, released: Vec<u32>) {
        for (id, sent) in sent_before {
            if let Some(r) = self.rows.get_mut(&id) {
                r.sent = sent;
            }
        }
        let later = std::mem::replace(&mut self.released, released);
        self.released.extend(later);
    }

    fn build_step(&mut self, plan: &[(u64, usize, bool)]) -> Result<Step, ScheduleError> {
        let num_tokens: usize = plan.iter().map(|p| p.1).sum();
        let mut st = Step {
            req_ids: Vec::with_capacity(plan.len()),
            token_ids: Vec::with_capacity(num_tokens),
            query_start_loc: Vec::with_capacity(plan.len() + 1),
            seq_lens: Vec::with_capacity(plan.len()),
            positions: Vec::with_capacity(num_tokens),
            slot_mapping: Vec::with_capacity(num_tokens),
            table_rows: Vec::with_capacity(plan.len()),
            table_updates: BlockTableUpdates::new(),
            released_rows: Vec::new(),
            samples: Vec::with_capacity(plan.len()),
            num_decodes: plan.iter().filter(|p| p.2).count(),
        };
        st.query_start_loc.push(0);
        for &(id, n, _) in plan {
            let s = self.seqs.get(&id).ok_or(KvError::UnknownRequest(id))?;
            let end = s.computed + n;
            for pos in s.computed..end {
                st.token_ids.push(s.token(pos));
                // Lengths fit in i32: end ≤ max_model_len ≤ i32::MAX.
                st.positions.push(pos as i32);
                st.slot_mapping.push(self.kv.swa_slot(id, pos)?);
            }
            st.req_ids.push(id);
            st.query_start_loc.push(st.token_ids.len() as i32);
            st.seq_lens.push(end as i32);
            st.samples.push(end == s.len());
            let row = self.rows.get_mut(&id).ok_or(KvError::UnknownRequest(id))?;
            row.sent = self.kv.push_table_updates(id, row.row as usize, row.sent, &mut st.table_updates)?;
            st.table_rows.push(row.row);
        }
        st.released_rows = std::mem::take(&mut self.released);
        Ok(st)
    }

    /// Forgets the step in flight without applying it (e.g. the forward failed): its requests keep
    /// their blocks and the next [`Scheduler::schedule`] computes the same tokens again, sending
    /// the step's table updates and releases again with it.
    pub fn abort_step(&mut self) {
        if let Some(f) = self.in_flight.take() {
            self.rewind(f.sent_before, f.released);
        }
    }

    /// Feeds back the sampled token of each row that samples (`sampled.len() ==
    /// step.num_sampling()`, in the step's row order): appends it, finishes requests that reached
    /// `max_new_tokens` (frees their blocks) and returns them in row order.
    ///
    /// All-or-nothing: errors (nothing changed) when `step` is not the step in flight or the
    /// samples are of the wrong count or negative.
    pub fn update(&mut self, step: &Step, sampled: &[i32]) -> Result<Vec<Finished>, ScheduleError> {
        let Some(InFlight { rows, .. }) = &self.in_flight else {
            return Err(ScheduleError::StaleStep("no step is in flight".into()));
        };
        let matches = rows.len() == step.num_reqs()
            && step.samples.len() == rows.len()
            && rows.iter().enumerate().all(|(r, &(id, n))| step.req_ids[r] == id && step.query_len(r) == n);
        if !matches {
            return Err(ScheduleError::StaleStep("the step given is not the one in flight".into()));
        }
        if sampled.len() != step.num_sampling() {
            return Err(ScheduleError::BadSamples(format!(
                "{} sampled tokens for {} sampling rows",
                sampled.len(),
                step.num_sampling()
            )));
        }
        if let Some((i, &t)) = sampled.iter().enumerate().find(|(_, &t)| t < 0) {
            return Err(ScheduleError::BadSamples(format!("sampled token {i} has negative id {t}")));
        }
        let Some(InFlight { rows, .. }) = self.in_flight.take() else { return Ok(Vec::new()) };
        let mut next = sampled.iter();
        let mut finished = Vec::new();
        for (r, (id, n)) in rows.into_iter().enumerate() {
            let Some(s) = self.seqs.get_mut(&id) else { continue };
            s.computed += n;
            if step.samples[r] {
                if let Some(&t) = next.next() {
                    s.output.push(t);
                }
            }
            if s.output.len() >= s.max_new_tokens {
                if let Some(s) = self.seqs.remove(&id) {
                    finished.push(Finished { id, tokens: s.output, preemptions: s.preemptions });
                }
                self.running.retain(|&x| x != id);
                self.retire(id);
            }
        }
        Ok(finished)
    }

    /// Requests queued (new or preempted).
    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Requests admitted and holding KV blocks.
    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    /// No request is waiting or running.
    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty()
    }

    /// Whether a step awaits [`Scheduler::update`].
    pub fn has_step_in_flight(&self) -> bool {
        self.in_flight.is_some()
    }

    /// Preemptions so far, over all requests.
    pub fn num_preemptions(&self) -> u64 {
        self.preemptions
    }

    /// Ids of the running requests in admission order.
    pub fn running_ids(&self) -> &[u64] {
        &self.running
    }

    /// Ids of the waiting requests in queue order.
    pub fn waiting_ids(&self) -> impl Iterator<Item = u64> + '_ {
        self.waiting.iter().copied()
    }

    /// Tokens generated so far by a waiting or running request, or `None`.
    pub fn generated(&self, id: u64) -> Option<&[i32]> {
        self.seqs.get(&id).map(|s| s.output.as_slice())
    }

    /// The block manager.
    pub fn kv(&self) -> &KvManager {
        &self.kv
    }

    /// Table row of a running request, or `None`.
    pub fn table_row(&self, id: u64) -> Option<u32> {
        self.rows.get(&id).map(|r| r.row)
    }
}
