//! Benches for graph mode selection: `Dispatcher::dispatch` and `PaddingTable::pad`.
//!
//! Both are host-only, so plain `iter` timing is right (nothing to synchronise). Inputs cycle
//! through a fixed pseudo-random batch mix so the branch predictor sees a realistic spread.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion};
use holdfast_graph::{CaptureSizeConfig, CaptureSizes, Dispatcher, DispatcherConfig, GraphMode, LoraConfig, ModeSet};

/// 1024 token counts in `1..=600` (some above the 512 maximum), uniform every other step.
fn batches() -> Vec<(u32, bool)> {
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    (0..1024)
        .map(|i| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (1 + (x % 600) as u32, i % 2 == 0)
        })
        .collect()
}

fn dsv4_dispatcher() -> Dispatcher {
    let cfg = CaptureSizeConfig::new(GraphMode::FullAndPiecewise, 256, 8192);
    let sizes = match CaptureSizes::build(&cfg) {
        Ok(s) => s,
        Err(e) => panic!("sizes: {e}"),
    };
    let config = DispatcherConfig {
        capture_sizes: sizes,
        max_num_seqs: 256,
        lora: LoraConfig::Disabled,
        attention_is_splitting_op: true,
    };
    let mut d = match Dispatcher::new(config) {
        Ok(d) => d,
        Err(e) => panic!("dispatcher: {e}"),
    };
    if let Err(e) = d.initialize_keys(GraphMode::FullAndPiecewise, 1) {
        panic!("keys: {e}");
    }
    d
}

fn bench(c: &mut Criterion) {
    let inputs = batches();
    let mut d = dsv4_dispatcher();
    let mut i = 0usize;
    c.bench_function("dispatch/full_and_piecewise_512", |b| {
        b.iter(|| {
            let (n, uniform) = inputs[i & 1023];
            i = i.wrapping_add(1);
            black_box(d.dispatch(black_box(n), black_box(uniform), false, 0, ModeSet::ALL, ModeSet::EMPTY))
        })
    });

    let table = d.padding_table().clone();
    let mut j = 0usize;
    c.bench_function("padding_table/pad_512", |b| {
        b.iter(|| {
            let (n, _) = inputs[j & 1023];
            j = j.wrapping_add(1);
            black_box(table.pad(black_box(n)))
        })
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);
