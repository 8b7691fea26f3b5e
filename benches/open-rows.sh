#!/usr/bin/env bash
# Times the report rows still short of their targets, and the GPU suites behind them, in one call
# on a GPU host, writing each part's output under OUT as it finishes (a cut-off run keeps what
# ran):
#
#   OUT=/tmp/open benches/open-rows.sh
#
# (OUT defaults to ./open-rows-out.)
#
# 1. the attention row at 128 heads + 512 entries, batch 64 (and 256), twice: the first run
#    compiles the kernels (`attention.txt`);
# 2. the mHC chunk sweep, `benches/mhc-chunks.sh` (`chunks.txt`; the default shapes at H 4096 and
#    7168, T 4096 and 16384: unchunked, the op's chunked schedule, chunks as separate ops);
# 3. where TESTS names a folder of test binaries built with the `cuda` feature (the layout of
#    `gpu-bundle`: `attention--test-sparse_attention`, ...), the attention and mHC GPU suites
#    (`test-NAME.log`);
# 4. the report's ceilings, attention and mHC sections (`report.txt`, `report.json`);
# 5. with the time left, the mHC rows at T >= 1024 again with the two passes over chunks of
#    MHC_CHUNK (default 512) tokens (`report-chunks.txt`, `report-chunks.json`).
#
# REPORT_BIN and MHC_CASE_BIN name prebuilt `gpu-report` and `mhc_case` binaries (a host without a
# Rust toolchain); else they are built here with the `cuda` feature. BUDGET_S (default 540) bounds
# the whole run in seconds; parts that would start past it are skipped with a line saying so.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${OUT:-./open-rows-out}"
mkdir -p "$out"
budget="${BUDGET_S:-540}"
t0=$(date +%s)
elapsed() { echo $(($(date +%s) - t0)); }
left() { echo $((budget - $(elapsed))); }
export HOLDFAST_DEVICE="${HOLDFAST_DEVICE:-cuda:0}"
report="${REPORT_BIN:-}"
case_bin="${MHC_CASE_BIN:-}"
if [[ -z "$report" || -z "$case_bin" ]]; then
    cargo build --release --manifest-path "$root/Cargo.toml" -p holdfast-benches --features cuda || exit 1
    cargo build --release --manifest-path "$root/Cargo.toml" -p holdfast-mhc --features cuda --example mhc_case ||
        exit 1
    target="${CARGO_TARGET_DIR:-$root/target}/release"
    report="${report:-$target/gpu-report}"
    case_bin="${case_bin:-$target/examples/mhc_case}"
fi
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | sed 's/^/gpu: /'

echo "== attention row (128 heads + 512, batch 64 and 256)"
for limit in 90 30; do
    timeout "$limit" "$report" --device "$HOLDFAST_DEVICE" --only attention \
        --cases "h128_d512 swa128+512 B=64,h128_d512 swa128+512 B=256" --quiet >>"$out/attention.txt" 2>&1
    echo "attention run: exit $? at $(elapsed) s"
done
grep -E "h128_d512|copy" "$out/attention.txt"

echo "== mHC chunk sweep"
if [[ $(left) -gt 200 ]]; then
    MHC_CASE_BIN="$case_bin" timeout $(($(left) - 120)) bash "$root/benches/mhc-chunks.sh" 2 >"$out/chunks.txt" 2>&1
    echo "sweep: exit $? at $(elapsed) s"
    cat "$out/chunks.txt"
else
    echo "skipped: $(left) s left"
fi

if [[ -n "${TESTS:-}" ]]; then
    echo "== GPU suites"
    for t in attention--test-sparse_attention attention--test-graph mhc--test-suite; do
        if [[ $(left) -lt 90 ]]; then
            echo "$t skipped: $(left) s left"
            continue
        fi
        timeout 120 "$TESTS/$t" >"$out/test-$t.log" 2>&1
        echo "$t: exit $? at $(elapsed) s: $(grep -E '^test result' "$out/test-$t.log" | tail -1)"
    done
fi

echo "== report: ceilings, attention, mHC"
if [[ $(left) -gt 60 ]]; then
    timeout "$(left)" "$report" --device "$HOLDFAST_DEVICE" --only ceilings,attention,mhc --quiet \
        --json "$out/report.json" >"$out/report.txt" 2>&1
    echo "report: exit $? at $(elapsed) s"
else
    echo "skipped: $(left) s left"
fi

echo "== report: mHC rows at T >= 1024 over chunks of ${MHC_CHUNK:-512} tokens"
if [[ $(left) -gt 30 ]]; then
    timeout "$(left)" "$report" --device "$HOLDFAST_DEVICE" --only ceilings,mhc --cases "T=1024,T=4096,T=16384" \
        --mhc-chunk-tokens "${MHC_CHUNK:-512}" --quiet --json "$out/report-chunks.json" >"$out/report-chunks.txt" 2>&1
    echo "report: exit $? at $(elapsed) s"
    grep -E "mhc_pre|fused" "$out/report-chunks.txt"
else
    echo "skipped: $(left) s left"
fi
