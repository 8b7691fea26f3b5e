//! Collectives on the CPU backend: an in-process emulation of the ranks of a group.
//!
//! The ranks share one [`CpuGroup`]: a mutex over the rounds in flight, keyed by sequence number,
//! and a condition variable. Each rank numbers its own collectives `0, 1, 2, …` as it executes
//! them (eagerly or from a graph replay); the `k`-th collective of every rank forms round `k`.
//! A rank deposits its call and its `send` bytes in the round; the last to arrive checks that all
//! calls agree, computes every rank's output and wakes the others; each rank then copies its own
//! output into `recv`. Nothing is written when the calls disagree or a rank gives up waiting.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::{bad_addr, CpuCore, CpuOp};
use crate::backend::{wrong_backend, CommImpl, CommOps, StreamImpl};
use crate::comm::{CollectiveCall, CollectiveKind, ReduceOp};
use crate::device::lock;
use crate::dtype::DType;
use crate::error::{HalError, Result};
use crate::{bf16, f16};

/// Creates the ranks of a group of `size`, each waiting at most `timeout` at a collective.
pub(crate) fn group(size: usize, timeout: Duration) -> Vec<CommImpl> {
    let group = Arc::new(CpuGroup { size, state: Mutex::new(BTreeMap::new()), wake: Condvar::new() });
    (0..size)
        .map(|rank| {
            CommImpl::Cpu(CpuComm {
                rank: Arc::new(CpuRank {
                    group: group.clone(),
                    rank,
                    next_seq: AtomicU64::new(0),
                    timeout_ns: AtomicU64::new(duration_ns(timeout)),
                }),
            })
        })
        .collect()
}

fn duration_ns(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// One rank of a CPU group.
pub(crate) struct CpuComm {
    rank: Arc<CpuRank>,
}

impl CommOps for CpuComm {
    fn collective(&self, stream: &StreamImpl, call: &CollectiveCall) -> Result<()> {
        #[allow(unreachable_patterns)]
        let stream = match stream {
            StreamImpl::Cpu(s) => s,
            _ => return Err(wrong_backend("stream")),
        };
        stream.submit(CpuOp::Collective { rank: self.rank.clone(), call: *call })
    }

    fn timeout(&self) -> Option<Duration> {
        Some(Duration::from_nanos(self.rank.timeout_ns.load(Ordering::Relaxed)))
    }

    fn set_timeout(&self, timeout: Duration) {
        self.rank.timeout_ns.store(duration_ns(timeout), Ordering::Relaxed);
    }
}

/// The per-rank state a recorded collective keeps: which group, which rank, where the rank is in
/// its sequence of collectives.
pub(crate) struct CpuRank {
    group: Arc<CpuGroup>,
    rank: usize,
    next_seq: AtomicU64,
    timeout_ns: AtomicU64,
}

struct CpuGroup {
    size: usize,
    state: Mutex<BTreeMap<u64, Round>>,
    wake: Condvar,
}

/// What makes two ranks' calls the same collective.
#[derive(Clone, Copy, PartialEq, Eq)]
struct Shape {
    kind: CollectiveKind,
    op: ReduceOp,
    dtype: DType,
    send_count: usize,
}

impl Shape {
    fn of(call: &CollectiveCall) -> Self {
        let op = if call.kind == CollectiveKind::AllGather { ReduceOp::Sum } else { call.op };
        Shape { kind: call.kind, op, dtype: call.dtype, send_count: call.send_count }
    }

    fn describe(&self) -> String {
        let (n, t) = (self.send_count, self.dtype);
        match self.kind {
            CollectiveKind::AllReduce => format!("all_reduce({}) of {n} {t} elements", self.op),
            CollectiveKind::AllGather => format!("all_gather of {n} {t} elements per rank"),
            CollectiveKind::ReduceScatter => format!("reduce_scatter({}) of {n} {t} elements", self.op),
        }
    }
}

struct Arrival {
    shape: Shape,
    send: Vec<u8>,
}

enum Outcome {
    /// Each rank's `recv` bytes, taken by the rank when it leaves.
    Done(Vec<Option<Arc<[u8]>>>),
    /// The calls disagree (the detail names who called what).
    Mismatch(String),
    /// Rank `by` gave up after `waited`, when `missing` had not arrived.
    TimedOut { by: usize, waited: Duration, missing: Vec<usize> },
}

struct Round {
    calls: Vec<Option<Arrival>>,
    outcome: Option<Outcome>,
    /// Ranks that have left the round; it is removed when all have.
    left: usize,
}

impl CpuRank {
    /// Executes `call` on this rank: reads `send` from `core`, meets the other ranks, writes
    /// `recv`. Blocks until every rank has arrived or this rank's timeout passes.
    pub(crate) fn execute(&self, core: &CpuCore, call: &CollectiveCall) -> Result<()> {
        let name = call.kind.name();
        let esize = call.dtype.size();
        let send_bytes = call.send_count * esize;
        let send = {
            let (a, off) = core
                .resolve(call.send, send_bytes)
                .map_err(|why| bad_addr(name, "send", call.send, send_bytes, why))?;
            let d = lock(&a.data);
            bytemuck::cast_slice::<u64, u8>(&d)[off..off + send_bytes].to_vec()
        };
        let seq = self.next_seq.fetch_add(1, Ordering::AcqRel);
        let out = self.meet(seq, Shape::of(call), send)?;
        let recv_bytes = call.recv_count * esize;
        if out.len() != recv_bytes {
            return Err(HalError::CollectiveAborted {
                op: name,
                rank: self.rank,
                seq,
                detail: format!("the result has {} bytes but recv holds {recv_bytes}", out.len()),
            });
        }
        let (a, off) =
            core.resolve(call.recv, recv_bytes).map_err(|why| bad_addr(name, "recv", call.recv, recv_bytes, why))?;
        let mut d = lock(&a.data);
        bytemuck::cast_slice_mut::<u64, u8>(&mut d)[off..off + recv_bytes].copy_from_slice(&out);
        Ok(())
    }

    /// The rendezvous of round `seq`: deposits `send`, waits for the outcome, returns this rank's
    /// output bytes.
    fn meet(&self, seq: u64, shape: Shape, send: Vec<u8>) -> Result<Arc<[u8]>> {
        let g = &*self.group;
        let (rank, op) = (self.rank, shape.kind.name());
        let poisoned = || HalError::CollectiveAborted {
            op,
            rank,
            seq,
            detail: "the group's shared state is poisoned: a thread panicked inside a collective".into(),
        };
        let timeout = Duration::from_nanos(self.timeout_ns.load(Ordering::Relaxed));
        let start = Instant::now();
        let mut rounds = g.state.lock().map_err(|_| poisoned())?;
        let round = rounds.entry(seq).or_insert_with(|| Round {
            calls: (0..g.size).map(|_| None).collect(),
            outcome: None,
            left: 0,
        });
        if let Some(Outcome::TimedOut { by, waited, missing }) = &round.outcome {
            // Another rank gave up on this round before this one arrived.
            let detail = format!(
                "rank {by} stopped waiting for it after {:.3} s, when rank(s) {missing:?} had not arrived",
                waited.as_secs_f64()
            );
            leave(&mut rounds, seq, g.size);
            return Err(HalError::CollectiveAborted { op, rank, seq, detail });
        }
        round.calls[rank] = Some(Arrival { shape, send });
        if round.calls.iter().all(Option::is_some) {
            round.outcome = Some(decide(&mut round.calls, g.size));
            g.wake.notify_all();
        }
        loop {
            let Some(round) = rounds.get_mut(&seq) else {
                return Err(poisoned());
            };
            match &mut round.outcome {
                Some(Outcome::Done(outputs)) => {
                    let out = outputs[rank].take();
                    leave(&mut rounds, seq, g.size);
                    return out.ok_or_else(poisoned);
                }
                Some(Outcome::Mismatch(detail)) => {
                    let detail = detail.clone();
                    leave(&mut rounds, seq, g.size);
                    return Err(HalError::CollectiveMismatch { op, rank, seq, detail });
                }
                Some(Outcome::TimedOut { missing, .. }) => {
                    let missing = missing.clone();
                    leave(&mut rounds, seq, g.size);
                    return Err(HalError::CollectiveTimeout { op, rank, seq, waited: start.elapsed(), missing });
                }
                None => {}
            }
            let waited = start.elapsed();
            if waited >= timeout {
                let missing: Vec<usize> =
                    round.calls.iter().enumerate().filter(|(_, c)| c.is_none()).map(|(r, _)| r).collect();
                for c in round.calls.iter_mut().flatten() {
                    c.send = Vec::new();
                }
                round.outcome = Some(Outcome::TimedOut { by: rank, waited, missing: missing.clone() });
                leave(&mut rounds, seq, g.size);
                g.wake.notify_all();
                return Err(HalError::CollectiveTimeout { op, rank, seq, waited, missing });
            }
            rounds = wait(&g.wake, rounds, timeout - waited).map_err(|_| poisoned())?;
        }
    }
}

fn wait<'a, T>(cv: &Condvar, guard: MutexGuard<'a, T>, dur: Duration) -> std::result::Result<MutexGuard<'a, T>, ()> {
    cv.wait_timeout(guard, dur).map(|(g, _)| g).map_err(|_| ())
}

/// Marks one rank as gone from round `seq`; the last one out removes the round.
fn leave(rounds: &mut BTreeMap<u64, Round>, seq: u64, size: usize) {
    if let Some(round) = rounds.get_mut(&seq) {
        round.left += 1;
        if round.left >= size {
            rounds.remove(&seq);
        }
    }
}

/// Run by the last rank to arrive: every call must have rank 0's shape; then every output.
fn decide(calls: &mut [Option<Arrival>], size: usize) -> Outcome {
    let arrivals: Vec<Arrival> = calls.iter_mut().filter_map(Option::take).collect();
    let shape = arrivals[0].shape;
    if arrivals.iter().any(|a| a.shape != shape) {
        // Group the ranks by what they called, in order of first appearance.
        let mut seen: Vec<(Shape, Vec<usize>)> = Vec::new();
        for (r, a) in arrivals.iter().enumerate() {
            match seen.iter_mut().find(|(s, _)| *s == a.shape) {
                Some((_, ranks)) => ranks.push(r),
                None => seen.push((a.shape, vec![r])),
            }
        }
        let parts: Vec<String> = seen
            .iter()
            .map(|(s, ranks)| {
                let who = if ranks.len() == 1 { format!("rank {}", ranks[0]) } else { format!("ranks {ranks:?}") };
                format!("{who} called {}", s.describe())
            })
            .collect();
        return Outcome::Mismatch(parts.join("; "));
    }
    let sends: Vec<&[u8]> = arrivals.iter().map(|a| a.send.as_slice()).collect();
    let esize = shape.dtype.size();
    let outputs = match shape.kind {
        CollectiveKind::AllReduce => {
            let out: Arc<[u8]> = reduce(shape.dtype, shape.op, &sends).into();
            vec![Some(out); size]
        }
        CollectiveKind::AllGather => {
            let out: Arc<[u8]> = sends.concat().into();
            vec![Some(out); size]
        }
        CollectiveKind::ReduceScatter => {
            let block = shape.send_count / size * esize;
            (0..size)
                .map(|q| {
                    let parts: Vec<&[u8]> = sends.iter().map(|s| &s[q * block..(q + 1) * block]).collect();
                    Some(reduce(shape.dtype, shape.op, &parts).into())
                })
                .collect()
        }
    };
    Outcome::Done(outputs)
}

/// Element-wise reduction of equal-length byte images of `dtype` elements: in `f32`, in the order
/// of `parts` (rank order), rounded to `dtype` once. One part is copied as is.
fn reduce(dtype: DType, op: ReduceOp, parts: &[&[u8]]) -> Vec<u8> {
    let (first, rest) = match parts {
        [] => return Vec::new(),
        [only] => return only.to_vec(),
        [first, rest @ ..] => (first, rest),
    };
    let mut acc = decode(dtype, first);
    for p in rest {
        let x = decode(dtype, p);
        match op {
            ReduceOp::Sum => acc.iter_mut().zip(&x).for_each(|(a, b)| *a += *b),
        }
    }
    encode(dtype, &acc)
}

fn decode(dtype: DType, bytes: &[u8]) -> Vec<f32> {
    match dtype {
        DType::F32 => bytes.chunks_exact(4).map(|c| f32::from_ne_bytes([c[0], c[1], c[2], c[3]])).collect(),
        DType::BF16 => bytes.chunks_exact(2).map(|c| bf16::from_ne_bytes([c[0], c[1]]).to_f32()).collect(),
        DType::F16 => bytes.chunks_exact(2).map(|c| f16::from_ne_bytes([c[0], c[1]]).to_f32()).collect(),
        // The front end admits only the float types above.
        _ => Vec::new(),
    }
}

fn encode(dtype: DType, vals: &[f32]) -> Vec<u8> {
    match dtype {
        DType::F32 => vals.iter().flat_map(|v| v.to_ne_bytes()).collect(),
        DType::BF16 => vals.iter().flat_map(|v| bf16::from_f32(*v).to_ne_bytes()).collect(),
        DType::F16 => vals.iter().flat_map(|v| f16::from_f32(*v).to_ne_bytes()).collect(),
        _ => Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_reduction_is_f32_in_rank_order_rounded_once() {
        // In bf16, 1 + 2^-8 + 2^-8 rounds to 1 if rounded after each add, but to 1 + 2^-7 once.
        let parts: Vec<Vec<u8>> =
            [1.0f32, 2f32.powi(-8), 2f32.powi(-8)].iter().map(|v| bf16::from_f32(*v).to_ne_bytes().to_vec()).collect();
        let refs: Vec<&[u8]> = parts.iter().map(Vec::as_slice).collect();
        let out = reduce(DType::BF16, ReduceOp::Sum, &refs);
        assert_eq!(bf16::from_ne_bytes([out[0], out[1]]), bf16::from_f32(1.0 + 2f32.powi(-7)));
        // f32 addition is not associative: (1e8 + 1) + -1e8 = 0 in f32, and that is the order used.
        let parts: Vec<Vec<u8>> = [1e8f32, 1.0, -1e8].iter().map(|v| v.to_ne_bytes().to_vec()).collect();
        let refs: Vec<&[u8]> = parts.iter().map(Vec::as_slice).collect();
        assert_eq!(f32::from_ne_bytes(reduce(DType::F32, ReduceOp::Sum, &refs)[..4].try_into().expect("4 bytes")), 0.0);
    }

    #[test]
    fn one_rank_copies_bits() {
        let nan = 0x7F81u16.to_ne_bytes(); // a signalling bf16 NaN: any float round trip would quiet it
        assert_eq!(reduce(DType::BF16, ReduceOp::Sum, &[&nan]), nan.to_vec());
    }
}
