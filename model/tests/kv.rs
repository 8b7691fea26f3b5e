//! Block pool and KV manager: accounting, all-or-nothing growth, tables and slots.

use std::collections::{BTreeMap, HashSet};

use holdfast_attention::BlockTableUpdates;
use holdfast_hal::testing::{check_errors, words, ErrorCase};
use holdfast_model::kv::{BlockPool, KvConfig, KvError, KvManager};
use proptest::prelude::*;

fn cfg(swa_num_blocks: usize, kv_num_blocks: usize) -> KvConfig {
    KvConfig {
        swa_block_size: 4,
        swa_num_blocks,
        kv_block_size: 16,
        kv_num_blocks,
        max_blocks_per_seq_swa: 16,
        max_blocks_per_seq_kv: 4,
    }
}

fn manager(swa: usize, kv: usize) -> KvManager {
    KvManager::new(cfg(swa, kv)).expect("valid config")
}

#[test]
fn pool_rejects_unusable_sizes() {
    assert!(matches!(BlockPool::new("p", 1, 4), Err(KvError::Config(m)) if m.contains("no usable block")));
    assert!(matches!(BlockPool::new("p", 8, 0), Err(KvError::Config(m)) if m.contains("block_size")));
    assert!(matches!(BlockPool::new("p", 1 << 20, 1 << 12), Err(KvError::Config(m)) if m.contains("overflow i32")));
}

#[test]
fn pool_never_hands_out_the_null_block_and_hands_out_ids_in_order() {
    let mut p = BlockPool::new("p", 5, 4).expect("pool");
    assert_eq!(p.capacity(), 4);
    assert_eq!(p.allocate(4).expect("4 free"), vec![1, 2, 3, 4]);
    assert_eq!(p.num_free(), 0);
    assert!(!p.is_allocated(0));
}

#[test]
fn a_failed_allocation_changes_nothing() {
    let mut p = BlockPool::new("p", 5, 4).expect("pool");
    let a = p.allocate(3).expect("3 free");
    let err = p.allocate(2).expect_err("only 1 free");
    assert_eq!(err, KvError::Exhausted { pool: "p", id: 0, need: 2, free: 1 });
    assert_eq!(p.num_free(), 1);
    p.release(&a).expect("held");
    assert_eq!(p.num_free(), 4);
}

#[test]
fn a_rejected_release_releases_nothing() {
    let mut p = BlockPool::new("p", 6, 4).expect("pool");
    let a = p.allocate(3).expect("free");
    for (bad, why) in [(vec![a[0], 0], "null"), (vec![a[0], 9], "out of range"), (vec![a[0], a[0]], "twice")] {
        let err = p.release(&bad).expect_err("bad release");
        assert!(err.to_string().contains(why), "{err}");
        assert_eq!(p.num_free(), 2);
    }
    p.release(&a[..1]).expect("held");
    assert!(p.release(&a[..1]).expect_err("already free").to_string().contains("free"));
    // Released ids come back first.
    assert_eq!(p.allocate(1).expect("free"), vec![a[0]]);
}

#[test]
fn ensure_is_all_or_nothing_across_both_pools() {
    // SWA: 10 usable blocks of 4 tokens; main: 2 usable blocks of 16.
    let mut kv = manager(11, 3);
    kv.ensure(1, 20).expect("fits");
    let before = kv.stats();
    // 33 tokens: 9 SWA blocks (4 more, 5 free: fits) and 3 main blocks (1 more, none free).
    let err = kv.ensure(1, 33).expect_err("main cache full");
    assert_eq!(err, KvError::Exhausted { pool: "kv", id: 1, need: 1, free: 0 });
    assert!(err.to_string().contains("kv pool exhausted: request 1"), "{err}");
    assert_eq!(kv.stats(), before);
    assert_eq!(kv.held_len(1), Some(20));
    assert!(!kv.can_fit(1, 33));
    assert!(kv.can_fit(1, 32));
    // A new request that only the SWA pool could hold.
    let err = kv.ensure(2, 17).expect_err("main cache full");
    assert_eq!(err, KvError::Exhausted { pool: "kv", id: 2, need: 2, free: 0 });
    assert!(!kv.holds(2));
    assert_eq!(kv.stats(), before);
}

#[test]
fn ensure_rejects_a_request_longer_than_its_table_row() {
    let mut kv = manager(64, 64);
    // 65 tokens need 17 SWA blocks of 4 (16 columns) and 5 main blocks of 16 (4 columns); the SWA
    // table is checked first.
    let err = kv.ensure(3, 65).expect_err("too long");
    assert_eq!(err, KvError::TooLong { pool: "swa", id: 3, len: 65, need: 17, block_size: 4, max_blocks_per_seq: 16 });
    assert!(err.to_string().contains("request 3"), "{err}");
    assert_eq!(kv.stats().swa_used, 0);
    assert!(kv.check_fits_alone(3, 64).is_ok());
    assert!(matches!(
        manager(8, 64).check_fits_alone(3, 64),
        Err(KvError::ExceedsCapacity { pool: "swa", need: 16, capacity: 7, .. })
    ));
}

#[test]
fn ensure_never_shrinks_and_grows_by_whole_blocks() {
    let mut kv = manager(32, 8);
    kv.ensure(7, 5).expect("fits");
    assert_eq!(kv.swa_blocks(7).map(<[i32]>::len), Some(2));
    kv.ensure(7, 3).expect("no-op");
    assert_eq!(kv.held_len(7), Some(5));
    kv.ensure(7, 8).expect("same blocks");
    assert_eq!(kv.swa_blocks(7).map(<[i32]>::len), Some(2));
    kv.ensure(7, 9).expect("one more");
    assert_eq!(kv.swa_blocks(7).map(<[i32]>::len), Some(3));
    assert_eq!(kv.kv_blocks(7).map(<[i32]>::len), Some(1));
}

#[test]
fn slots_and_rows_agree_with_the_block_lists() {
    let mut kv = manager(32, 8);
    kv.ensure(1, 6).expect("fits");
    kv.ensure(2, 10).expect("fits");
    kv.ensure(1, 19).expect("fits");
    for id in [1, 2] {
        let len = kv.held_len(id).expect("held");
        let swa = kv.swa_blocks(id).expect("held").to_vec();
        let main = kv.kv_blocks(id).expect("held").to_vec();
        let mut row = vec![-7; 16];
        kv.write_swa_row(id, &mut row).expect("width 16");
        assert_eq!(&row[..swa.len()], &swa[..]);
        assert!(row[swa.len()..].iter().all(|&b| b == 0));
        let mut krow = vec![-7; 4];
        kv.write_kv_row(id, &mut krow).expect("width 4");
        assert_eq!(&krow[..main.len()], &main[..]);
        assert!(krow[main.len()..].iter().all(|&b| b == 0));
        for pos in 0..len {
            let slot = kv.swa_slot(id, pos).expect("held");
            assert_eq!(slot, row[pos / 4] * 4 + (pos % 4) as i32);
            assert_eq!(kv.kv_slot(id, pos).expect("held"), krow[pos / 16] * 16 + (pos % 16) as i32);
        }
        assert_eq!(kv.swa_slot(id, len), Err(KvError::PositionOutOfRange { id, pos: len, len }));
    }
}

#[test]
fn bad_ids_and_row_widths_are_errors() {
    let mut kv = manager(32, 8);
    kv.ensure(1, 4).expect("fits");
    assert_eq!(kv.swa_slot(9, 0), Err(KvError::UnknownRequest(9)));
    let mut row = vec![0; 3];
    assert_eq!(kv.write_swa_row(1, &mut row), Err(KvError::RowWidth { pool: "swa", got: 3, want: 16 }));
    assert_eq!(kv.write_kv_row(1, &mut row), Err(KvError::RowWidth { pool: "kv", got: 3, want: 4 }));
    let mut row = vec![0; 16];
    assert_eq!(kv.write_swa_row(9, &mut row), Err(KvError::UnknownRequest(9)));
    kv.free(9); // unknown: no-op
    kv.free(1);
    assert_eq!(kv.stats().swa_used, 0);
    assert_eq!(kv.swa_slot(1, 0), Err(KvError::UnknownRequest(1)));
}

/// Checks every accounting invariant of `kv` against the lengths the test expects it to hold.
/// Every unusable manager size names the field or pool and the rule it breaks, and table columns
/// said written past the blocks a request holds name the request, the pool and both counts.
#[test]
fn bad_sizes_and_table_columns_name_the_field_and_the_bound() {
    let new = |c: KvConfig| KvManager::new(c).map(drop);
    let config: fn(&KvError) -> bool = |e| matches!(e, KvError::Config(_));
    let mut kv = manager(32, 8);
    kv.ensure(1, 5).expect("fits"); // 2 SWA blocks of 4, 1 main block of 16
    let mut out = BlockTableUpdates::new();
    let cases: Vec<ErrorCase<KvError>> = vec![
        (
            "SWA rows without columns",
            new(KvConfig { max_blocks_per_seq_swa: 0, ..cfg(8, 8) }),
            config,
            words(&["kv config: max_blocks_per_seq_swa must be positive, got 0"]),
        ),
        (
            "main rows without columns",
            new(KvConfig { max_blocks_per_seq_kv: 0, ..cfg(8, 8) }),
            config,
            words(&["kv config: max_blocks_per_seq_kv must be positive, got 0"]),
        ),
        (
            "empty SWA blocks",
            new(KvConfig { swa_block_size: 0, ..cfg(8, 8) }),
            config,
            words(&["kv config: swa: block_size must be positive"]),
        ),
        (
            "main pool of the null block alone",
            new(cfg(8, 1)),
            config,
            words(&["kv config: kv: num_blocks 1 leaves no usable block (block 0 is the null block)"]),
        ),
        (
            "SWA slot ids past i32",
            new(KvConfig { swa_block_size: 1 << 12, ..cfg(1 << 20, 8) }),
            config,
            words(&["kv config: swa: 1048576 blocks × 4096 tokens overflow i32 slot ids"]),
        ),
        (
            "SWA columns past the held blocks",
            kv.push_table_updates(1, 0, (3, 0), &mut out).map(drop),
            |e| matches!(e, KvError::ColumnsPastHeld { id: 1, pool: "swa", sent: 3, held: 2 }),
            words(&["request 1: 3 columns of its swa table row said written, it holds 2 blocks"]),
        ),
        (
            "main columns past the held blocks",
            kv.push_table_updates(1, 0, (2, 2), &mut out).map(drop),
            |e| matches!(e, KvError::ColumnsPastHeld { id: 1, pool: "kv", sent: 2, held: 1 }),
            words(&["request 1: 2 columns of its kv table row said written, it holds 1 blocks"]),
        ),
        (
            "updates of a request holding nothing",
            kv.push_table_updates(9, 0, (0, 0), &mut out).map(drop),
            |e| matches!(e, KvError::UnknownRequest(9)),
            words(&["request 9 holds no KV blocks"]),
        ),
    ];
    check_errors(cases);
    assert_eq!(out, BlockTableUpdates::new(), "a refused call appends no update");
}

fn check_invariants(kv: &KvManager, expect: &BTreeMap<u64, usize>) {
    let s = kv.stats();
    assert_eq!(s.swa_used + s.swa_free, s.swa_capacity);
    assert_eq!(s.kv_used + s.kv_free, s.kv_capacity);
    assert_eq!(s.requests, expect.len());
    let (mut seen_swa, mut seen_kv) = (HashSet::new(), HashSet::new());
    for (&id, &len) in expect {
        assert_eq!(kv.held_len(id), Some(len), "request {id}");
        let (swa, main) = (kv.swa_blocks(id).expect("held"), kv.kv_blocks(id).expect("held"));
        assert_eq!((swa.len(), main.len()), kv.blocks_for(len), "request {id} holds exactly its blocks");
        for &b in swa {
            assert!(b >= 1 && (b as usize) < kv.config().swa_num_blocks, "swa id {b}");
            assert!(kv.swa_pool().is_allocated(b));
            assert!(seen_swa.insert(b), "swa block {b} held twice");
        }
        for &b in main {
            assert!(b >= 1 && (b as usize) < kv.config().kv_num_blocks, "kv id {b}");
            assert!(kv.kv_pool().is_allocated(b));
            assert!(seen_kv.insert(b), "kv block {b} held twice");
        }
        let mut row = vec![0; kv.config().max_blocks_per_seq_swa];
        kv.write_swa_row(id, &mut row).expect("held");
        assert_eq!(&row[..swa.len()], swa);
    }
    assert_eq!(seen_swa.len(), s.swa_used);
    assert_eq!(seen_kv.len(), s.kv_used);
}

#[derive(Clone, Debug)]
enum Op {
    Ensure(u64, usize),
    Free(u64),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0u64..6, 0usize..70).prop_map(|(id, len)| Op::Ensure(id, len)),
        1 => (0u64..6).prop_map(Op::Free),
    ]
}

proptest! {
    #[test]
    fn random_admit_grow_free_sequences_keep_the_accounting(
        swa in 2usize..40, main in 2usize..10, ops in prop::collection::vec(op(), 1..120),
    ) {
        let mut kv = manager(swa, main);
        let mut expect: BTreeMap<u64, usize> = BTreeMap::new();
        for op in ops {
            match op {
                Op::Ensure(id, len) => {
                    let before = kv.stats();
                    let could = kv.can_fit(id, len);
                    match kv.ensure(id, len) {
                        Ok(()) => {
                            prop_assert!(could);
                            let e = expect.entry(id).or_insert(0);
                            *e = (*e).max(len);
                        }
                        Err(KvError::Exhausted { .. } | KvError::TooLong { .. }) => {
                            prop_assert!(!could);
                            prop_assert_eq!(kv.stats(), before, "a failed ensure changed nothing");
                        }
                        Err(e) => prop_assert!(false, "unexpected {e}"),
                    }
                }
                Op::Free(id) => {
                    kv.free(id);
                    expect.remove(&id);
                }
            }
            check_invariants(&kv, &expect);
        }
        for id in expect.keys().copied().collect::<Vec<_>>() {
            kv.free(id);
        }
        let s = kv.stats();
        prop_assert_eq!((s.swa_used, s.kv_used, s.requests), (0, 0, 0));
        prop_assert_eq!((s.swa_free, s.kv_free), (swa - 1, main - 1));
    }
}
