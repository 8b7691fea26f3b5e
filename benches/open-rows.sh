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
# 2. where `nvcc` is found, the projection-load probe `benches/probes/mhc_loads.cu` (the load
#    ceiling of the mHC projection pass's access scheme, `probe.txt`);
# 3. where TESTS names a folder of test binaries built with the `cuda` feature (the layout of
#    `gpu-bundle`: `attention--test-sparse_attention`, ...), every attention and mHC test binary
#    in it, the attention ones first (`test-NAME.log`);
# 4. the report's ceilings, attention and mHC sections (`report.txt`, `report.json`).
#
# REPORT_BIN names a prebuilt `gpu-report` binary (a host without a Rust toolchain); else it is
# built here with the `cuda` feature. BUDGET_S (default 540) bounds the whole run in seconds;
# parts that would start past it are skipped with a line saying so.
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
if [[ -z "$report" ]]; then
    cargo build --release --manifest-path "$root/Cargo.toml" -p holdfast-benches --features cuda || exit 1
    report="${CARGO_TARGET_DIR:-$root/target}/release/gpu-report"
fi
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | sed 's/^/gpu: /'

echo "== attention row (128 heads + 512, batch 64 and 256)"
for limit in 90 30; do
    timeout "$limit" "$report" --device "$HOLDFAST_DEVICE" --only attention \
        --cases "h128_d512 swa128+512 B=64,h128_d512 swa128+512 B=256" --quiet >>"$out/attention.txt" 2>&1
    echo "attention run: exit $? at $(elapsed) s"
done
grep -E "h128_d512|copy" "$out/attention.txt"

echo "== projection-load probe"
nvcc="$(readlink -f "$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)")"
if [[ $(left) -lt 150 ]]; then
    echo "probe skipped: $(left) s left"
elif [[ -x "$nvcc" ]]; then
    probe="$out/mhc_loads"
    cuda="$(dirname "$nvcc")/.."
    if "$nvcc" -O3 -std=c++17 -arch=sm_90 -o "$probe" "$root/benches/probes/mhc_loads.cu" \
        -L"$cuda/lib64/stubs" -L"$cuda/targets/x86_64-linux/lib/stubs" -lcuda >"$out/probe-build.log" 2>&1; then
        timeout 90 "$probe" >"$out/probe.txt" 2>&1
        echo "probe: exit $? at $(elapsed) s"
        cat "$out/probe.txt"
        rm -f "$probe"
    else
        echo "probe: build failed (probe-build.log)"
    fi
else
    echo "probe skipped: no nvcc"
fi

if [[ -n "${TESTS:-}" ]]; then
    echo "== GPU suites"
    for t in $(cd "$TESTS" && ls -d attention--test-* attention--lib-* mhc--test-* mhc--lib-* 2>/dev/null); do
        [[ -x "$TESTS/$t" && -f "$TESTS/$t" ]] || continue
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
