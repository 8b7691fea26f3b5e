//! The persistent block tables: requests on stable table rows whose device rows are written only
//! by each step's updates. Builders read through them exactly what the spec's full-width tables
//! give (a growing decode crossing block starts, a released row reused by a new request, padded
//! rows on the null row); every bad update, table row or unwritten column is a precise error that
//! changes nothing.

mod common;

use common::*;
use holdfast_attention::{AttentionError, CommonAttentionMetadata, CommonConfig, Ragged, TableKind};
use holdfast_hal::{Device, Stream};

fn read(s: &Stream, v: &holdfast_hal::View<i32>) -> Vec<i32> {
    s.copy_to_host_sync(v).expect("read back")
}

fn ragged_rows(s: &Stream, r: &Ragged) -> Vec<Vec<i32>> {
    let (indptr, flat) = (read(s, &r.indptr), read(s, &r.indices));
    (0..r.rows).map(|i| flat[indptr[i] as usize..indptr[i + 1] as usize].to_vec()).collect()
}

type Rig = BuilderRig;

impl BuilderRig {
    /// Stages `b` (its own table rows and updates), uploads, builds on poisoned outputs, and checks
    /// the three ragged forms against the references over `b`'s full-width rows.
    fn check(&mut self, s: &Stream, b: &Batch, rng: &mut Rng, what: &str) {
        let cfg = *self.common.config();
        let (l, topk) = self.prepare(s, b, rng, what);
        let swa = self.swa.build(s, &self.common).expect("swa").decode.expect("decode rows");
        let c128a = self.c128a.build(s, &self.common).expect("c128a").decode.expect("decode rows");
        let c4a = self.c4a.build(s, &self.common, &self.topk.view()).expect("c4a").decode.expect("decode rows");
        assert_eq!(ragged_rows(s, &swa.ragged), swa_ref(b, &cfg, &l, self.swa.window()), "{what}: swa");
        assert_eq!(ragged_rows(s, &c128a.ragged), c128a_decode_ref(b, &cfg, &l), "{what}: c128a");
        assert_eq!(ragged_rows(s, &c4a.ragged), c4a_ref(b, &cfg, &l, &topk, self.k), "{what}: c4a");
        // Padded requests sit on the null row.
        let rows = read(s, &self.common.table_rows().expect("rows"));
        let real: Vec<i32> = b.table_rows.iter().map(|&r| r as i32).collect();
        assert_eq!(&rows[..real.len()], &real[..], "{what}: table rows");
        let null = self.common.null_table_row() as i32;
        assert!(rows[real.len()..].iter().all(|&r| r == null), "{what}: padded rows → null row: {rows:?}");
    }
}

fn small() -> CommonConfig {
    // SWA blocks of 16 tokens, KV blocks of 128: a few decode steps cross block starts.
    let mut cfg = config(32, 6, 1024, 0, 16, 128);
    cfg.max_table_updates = cfg.swa_table.growth_cells(32, 6) + cfg.kv_table.growth_cells(32, 6) + 200;
    cfg
}

fn a_growing_decode_appends_blocks_only_where_a_token_starts_one(dev: &Device) {
    let s = dev.create_stream().expect("stream");
    let mut rng = Rng(0xB10C);
    let cfg = small();
    let mut rig = Rig::new(dev, cfg, 24, 16);
    // Three requests on table rows 4, 0, 2 (not their batch rows), around block starts.
    let mut seq = vec![15usize, 127, 260];
    let mut b = decode_batch(&cfg, &mut rng, &seq, &[4, 0, 2], 2);
    for r in 0..3 {
        push_used(&cfg, &mut b, r, [0, 0]);
    }
    rig.check(&s, &b, &mut rng, "first step");
    let mut appended = [0usize; 2];
    for step in 1..=40 {
        b.updates.clear();
        for (r, len) in seq.iter_mut().enumerate() {
            let had = [len.div_ceil(16), len.div_ceil(128)];
            *len += 1;
            b.seq_lens[r] = *len as i32;
            b.positions[r] = *len as i32 - 1;
            let now = [len.div_ceil(16), len.div_ceil(128)];
            appended[0] += now[0] - had[0];
            appended[1] += now[1] - had[1];
            push_used(&cfg, &mut b, r, had);
        }
        // Only requests whose new token starts a block carry an update.
        let starts = seq
            .iter()
            .map(|&s| usize::from((s - 1).is_multiple_of(16)) + usize::from((s - 1).is_multiple_of(128)))
            .sum();
        assert_eq!(b.updates.len(), starts, "step {step}: one update per block start");
        rig.check(&s, &b, &mut rng, &format!("step {step}"));
    }
    assert!(appended[0] >= 6 && appended[1] >= 1, "the steps crossed SWA and KV block starts: {appended:?}");
    for (r, &row) in [4usize, 0, 2].iter().enumerate() {
        assert_eq!(rig.common.table_row_columns(TableKind::Swa, row), Some(seq[r].div_ceil(16)));
        assert_eq!(rig.common.table_row_columns(TableKind::Kv, row), Some(seq[r].div_ceil(128)));
    }
}

fn a_released_row_is_reused_by_a_new_request(dev: &Device) {
    let s = dev.create_stream().expect("stream");
    let mut rng = Rng(0x2E05E);
    let cfg = small();
    let mut rig = Rig::new(dev, cfg, 24, 16);
    let mut a = decode_batch(&cfg, &mut rng, &[300, 40], &[1, 3], 0);
    push_used(&cfg, &mut a, 0, [0, 0]);
    push_used(&cfg, &mut a, 1, [0, 0]);
    rig.check(&s, &a, &mut rng, "two requests");
    // Request on row 1 finishes; a new request takes row 1 with other blocks and a shorter context.
    rig.common.release_table_row(1).expect("release");
    assert_eq!(rig.common.table_row_columns(TableKind::Swa, 1), Some(0));
    let mut b = decode_batch(&cfg, &mut rng, &[41, 100], &[3, 1], 1);
    b.swa_bt[..cfg.swa_table.max_blocks_per_seq].copy_from_slice(&a.swa_bt[cfg.swa_table.max_blocks_per_seq..]);
    b.kv_bt[..cfg.kv_table.max_blocks_per_seq].copy_from_slice(&a.kv_bt[cfg.kv_table.max_blocks_per_seq..]);
    // Without its updates the new request's columns were never written: refused.
    let err = rig.common.stage(&b.input()).expect_err("row 1 was released");
    assert!(
        err.to_string().contains("request 1 (table row 1)") && err.to_string().contains("only 0 were written"),
        "{err}"
    );
    // The old request on row 3 appends its next block (position 40 starts none, so nothing), the
    // new one writes its whole row.
    push_used(&cfg, &mut b, 0, [3, 1]);
    push_used(&cfg, &mut b, 1, [0, 0]);
    rig.check(&s, &b, &mut rng, "row 1 reused");
}

fn a_step_with_more_cells_than_a_captured_upload_applies_goes_through_the_bulk_path(dev: &Device) {
    let s = dev.create_stream().expect("stream");
    let mut rng = Rng(0xB01C);
    let mut cfg = small();
    cfg.max_table_updates = 6 * (cfg.swa_table.max_blocks_per_seq + cfg.kv_table.max_blocks_per_seq);
    let mut rig = Rig::new(dev, cfg, 24, 16);
    let mut b = decode_batch(&cfg, &mut rng, &[1000, 900, 999, 5], &[5, 4, 3, 2], 0);
    for r in 0..4 {
        push_used(&cfg, &mut b, r, [0, 0]);
    }
    assert!(b.updates.cells() > cfg.step_update_cells(), "a bulk step");
    let l = rig.common.stage(&b.input()).expect("stage");
    // Eager upload applies the bulk cells itself.
    assert_eq!(rig.common.upload(&s).expect("upload"), 2, "a bulk launch, then the step's");
    assert_eq!(rig.common.apply_bulk_table_updates(&s).expect("nothing left"), 0);
    let cfg = *rig.common.config();
    let swa = rig.swa.build(&s, &rig.common).expect("swa").decode.expect("rows");
    assert_eq!(ragged_rows(&s, &swa.ragged), swa_ref(&b, &cfg, &l, rig.swa.window()));
    // And it cannot be captured.
    let mut b2 = b.clone();
    b2.updates.clear();
    for r in 0..4 {
        push_used(&cfg, &mut b2, r, [0, 0]);
    }
    rig.common.stage(&b2.input()).expect("stage");
    s.begin_capture("bulk").expect("begin");
    let err = rig.common.upload(&s).expect_err("bulk cells during capture");
    assert!(matches!(err, AttentionError::Shape { .. }), "{err}");
    s.abort_capture().expect("abort");
}

fn every_bad_update_or_row_is_a_precise_error_that_changes_nothing(dev: &Device) {
    let mut rng = Rng(0xBAD);
    let cfg = small();
    let mut common = CommonAttentionMetadata::new(dev, cfg).expect("common");
    let mut good = decode_batch(&cfg, &mut rng, &[20, 130], &[0, 5], 1);
    push_used(&cfg, &mut good, 0, [0, 0]);
    push_used(&cfg, &mut good, 1, [0, 0]);
    let staged = common.stage(&good.input()).expect("good step");
    let columns = |c: &CommonAttentionMetadata| {
        (0..cfg.max_num_seqs)
            .map(|r| (c.table_row_columns(TableKind::Swa, r), c.table_row_columns(TableKind::Kv, r)))
            .collect::<Vec<_>>()
    };
    let before = columns(&common);
    assert_eq!(before[0], (Some(2), Some(1)));
    assert_eq!(before[5], (Some(9), Some(2)));
    let mut next = good.clone();
    next.updates.clear();
    let expect =
        |b: &Batch, common: &mut CommonAttentionMetadata, field: &str, has: &[&str]| match common.stage(&b.input()) {
            Err(AttentionError::InvalidInput { field: f, detail }) => {
                assert_eq!(f, field, "{detail}");
                for h in has {
                    assert!(detail.contains(h), "`{detail}` should mention `{h}`");
                }
            }
            other => panic!("expected an invalid `{field}`, got {other:?}"),
        };
    let upd = |table, row, first, blocks: &[i32]| {
        let mut b = next.clone();
        b.updates.push(table, row, first, blocks);
        b
    };
    let (ws, wk) = (cfg.swa_table.max_blocks_per_seq, cfg.kv_table.max_blocks_per_seq);
    // Rows: the null row and past it.
    expect(&upd(TableKind::Swa, 6, 0, &[1]), &mut common, "table_updates", &["update 0", "row 6", "null row"]);
    expect(&upd(TableKind::Kv, 99, 0, &[1]), &mut common, "table_updates", &["kv table", "row 99"]);
    // Columns past the width.
    expect(&upd(TableKind::Kv, 1, wk - 1, &[1, 2]), &mut common, "table_updates", &["columns 7..9", "8 columns"]);
    assert_eq!(wk, 8);
    // Block ids.
    expect(&upd(TableKind::Swa, 0, 1, &[3, -1]), &mut common, "table_updates", &["column 2", "block id -1"]);
    expect(&upd(TableKind::Kv, 0, 0, &[4096]), &mut common, "table_updates", &["block id 4096", "[0, 4096)"]);
    // A gap: row 0 has 2 SWA columns, an update may start at most at column 2.
    expect(&upd(TableKind::Swa, 0, 3, &[1]), &mut common, "table_updates", &["column 3", "past the 2 columns"]);
    // Two updates of one row of one table in a step.
    let mut b = upd(TableKind::Swa, 0, 2, &[1]);
    b.updates.push(TableKind::Swa, 0, 3, &[2]);
    expect(&b, &mut common, "table_updates", &["update 1", "row 0", "already written"]);
    // Too many cells for the staging: six whole SWA rows.
    let mut b = next.clone();
    for row in 0..6 {
        b.updates.push(TableKind::Swa, row, 0, &vec![1; ws]);
    }
    assert!(b.updates.cells() > cfg.max_table_updates);
    expect(&b, &mut common, "table_updates", &["384 cells in 6 updates", "max_table_updates = 215"]);
    // Table rows: out of range, the null row, duplicated.
    let mut b = next.clone();
    b.table_rows[1] = 6;
    expect(&b, &mut common, "table_rows", &["request 1", "table row 6", "null row"]);
    let mut b = next.clone();
    b.table_rows[1] = 0;
    expect(&b, &mut common, "table_rows", &["requests 0 and 1", "table row 0"]);
    // A used column never written: row 3 holds nothing.
    let mut b = next.clone();
    b.table_rows[1] = 3;
    expect(&b, &mut common, "table_rows", &["request 1 (table row 3)", "uses 9 columns of the swa table", "only 0"]);
    // One more token than row 0's columns cover (20 → 33 tokens needs a third SWA block).
    let mut b = next.clone();
    b.seq_lens[0] = 33;
    b.positions[0] = 32;
    expect(&b, &mut common, "table_rows", &["request 0 (table row 0)", "uses 3 columns", "only 2"]);
    // A seq len past the row width.
    let mut b = next.clone();
    b.seq_lens[0] = 1024;
    b.positions[0] = 1023;
    let mut tiny = cfg;
    tiny.swa_table.max_blocks_per_seq = 4;
    let mut narrow = CommonAttentionMetadata::new(dev, tiny).expect("narrow");
    expect(&b, &mut narrow, "seq_lens", &["needs 64 blocks of 16 in the swa table", "4 columns"]);
    // Releases.
    assert!(matches!(
        common.release_table_row(6),
        Err(AttentionError::InvalidInput { field: "release_table_row", .. })
    ));
    // Nothing above changed what is staged or recorded.
    assert_eq!(common.layout().expect("still staged"), staged);
    assert_eq!(columns(&common), before, "a rejected step records nothing");
    // A step that is fine now: the appended column of row 0 and a longer context.
    let mut b = upd(TableKind::Swa, 0, 2, &[7]);
    b.seq_lens[0] = 33;
    b.positions[0] = 32;
    common.stage(&b.input()).expect("the append makes it valid");
    assert_eq!(common.table_row_columns(TableKind::Swa, 0), Some(3));
    // Configuration.
    let mut bad = cfg;
    bad.max_table_updates = 0;
    assert!(matches!(CommonAttentionMetadata::new(dev, bad), Err(AttentionError::Config(_))));
    common.release_all_table_rows();
    assert!(columns(&common).iter().all(|&c| c == (Some(0), Some(0))));
    assert_eq!(common.table_row_columns(TableKind::Swa, 6), None);
}

/// Every rejected [`CommonConfig`]: a `Config` error whose message names the field or table at
/// fault and the bound it breaks; nothing is allocated.
fn every_rejected_common_config_names_the_field_and_the_bound(dev: &Device) {
    let base = config(32, 4, 1024, 0, 64, 256);
    let new = |f: &dyn Fn(&mut CommonConfig)| {
        let mut c = base;
        f(&mut c);
        CommonAttentionMetadata::new(dev, c).map(|_| ())
    };
    let config_error: fn(&AttentionError) -> bool = |e| matches!(e, AttentionError::Config(_));
    let big = i32::MAX as usize + 1;
    let cases: Vec<ErrorCase> = vec![
        (
            "zero tokens",
            new(&|c| c.max_num_batched_tokens = 0),
            config_error,
            words(&["sizes must be positive", "max_num_batched_tokens: 0"]),
        ),
        (
            "zero seqs",
            new(&|c| c.max_num_seqs = 0),
            config_error,
            words(&["sizes must be positive", "max_num_seqs: 0"]),
        ),
        (
            "zero model length",
            new(&|c| c.max_model_len = 0),
            config_error,
            words(&["sizes must be positive", "max_model_len: 0"]),
        ),
        (
            "speculative tokens past the batch",
            new(&|c| c.num_spec_tokens = usize::MAX),
            config_error,
            words(&["num_spec_tokens 18446744073709551615 must be below max_num_batched_tokens"]),
        ),
        (
            "no update cells",
            new(&|c| c.max_table_updates = 0),
            config_error,
            words(&["max_table_updates 0", "[1, (i32::MAX − 1) / 2]"]),
        ),
        (
            "too many update cells",
            new(&|c| c.max_table_updates = (i32::MAX as usize - 1) / 2 + 1),
            config_error,
            words(&["max_table_updates 1073741824", "[1, (i32::MAX − 1) / 2]"]),
        ),
        (
            "tokens past i32",
            new(&|c| c.max_num_batched_tokens = big),
            config_error,
            vec![format!("max_num_batched_tokens {big} must fit in i32 (at most {})", i32::MAX)],
        ),
        (
            "requests past i32",
            new(&|c| c.max_num_seqs = usize::MAX),
            config_error,
            vec![format!("max_num_seqs {} must fit in i32", usize::MAX)],
        ),
        (
            "model length past i32",
            new(&|c| c.max_model_len = big),
            config_error,
            vec![format!("max_model_len {big} must fit in i32")],
        ),
        (
            "zero SWA block size",
            new(&|c| c.swa_table.block_size = 0),
            config_error,
            words(&["swa_table: sizes must be positive", "block_size: 0"]),
        ),
        (
            "zero KV blocks",
            new(&|c| c.kv_table.num_blocks = 0),
            config_error,
            words(&["kv_table: sizes must be positive", "num_blocks: 0"]),
        ),
        (
            "zero KV row width",
            new(&|c| c.kv_table.max_blocks_per_seq = 0),
            config_error,
            words(&["kv_table: sizes must be positive", "max_blocks_per_seq: 0"]),
        ),
        (
            "SWA slots past i32",
            new(&|c| c.swa_table.block_size = 1 << 20),
            config_error,
            words(&["swa_table: 4096 blocks × 1048576 tokens overflow i32 slot ids"]),
        ),
        (
            "KV slot count overflows usize",
            new(&|c| c.kv_table.num_blocks = usize::MAX),
            config_error,
            words(&["kv_table:", "overflow i32 slot ids"]),
        ),
        (
            "KV cells past i32",
            new(&|c| c.kv_table.max_blocks_per_seq = 1 << 29),
            config_error,
            words(&["kv_table: [max_num_seqs + 1, max_blocks_per_seq] overflows i32 cell indices"]),
        ),
        (
            "both tables' cells past i32",
            new(&|c| {
                c.max_num_seqs = 1;
                c.swa_table.max_blocks_per_seq = (1 << 30) - 1;
                c.kv_table.max_blocks_per_seq = (1 << 30) - 1;
            }),
            config_error,
            words(&["the two block tables hold 4294967292 cells together", "i32 cell indices"]),
        ),
    ];
    check_errors(cases);
}

holdfast_hal::device_suite!(
    a_growing_decode_appends_blocks_only_where_a_token_starts_one,
    a_released_row_is_reused_by_a_new_request,
    a_step_with_more_cells_than_a_captured_upload_applies_goes_through_the_bulk_path,
    every_bad_update_or_row_is_a_precise_error_that_changes_nothing,
    every_rejected_common_config_names_the_field_and_the_bound,
);
