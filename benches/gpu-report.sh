#!/usr/bin/env bash
# Runs the whole GPU report in one command: builds gpu-report (CUDA), writes the case plan, runs
# the plain-PyTorch equivalents if python3 has torch with CUDA, then the Rust report with the
# torch columns. Everything goes under OUT_DIR (first argument, else $OUT, else ./gpu-report-out).
#
#   benches/gpu-report.sh [OUT_DIR] [gpu-report options…]     e.g.  benches/gpu-report.sh /tmp/r --only mhc,dense
#
# The device is $HOLDFAST_DEVICE (default cuda:0); GPU_REPORT_BIN skips the build and runs that
# binary instead. Files: plan.json, torch.json (if torch ran),
# report.json, report.txt (the table as printed).
set -euo pipefail

out="${OUT:-gpu-report-out}"
if [[ $# -gt 0 && "$1" != -* ]]; then
    out="$1"
    shift
fi
mkdir -p "$out"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
device="${HOLDFAST_DEVICE:-cuda:0}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$root/target}"

# GPU_REPORT_BIN names a prebuilt binary (a GPU host without a Rust toolchain); else build here.
bin="${GPU_REPORT_BIN:-}"
if [[ -z "$bin" ]]; then
    cargo build --release --manifest-path "$root/Cargo.toml" -p holdfast-benches --features cuda
    bin="$CARGO_TARGET_DIR/release/gpu-report"
fi

quick=()
only=""
cases=""
prev=""
for a in "$@"; do
    [[ "$a" == "--quick" ]] && quick=(--quick)
    [[ "$prev" == "--only" ]] && only="$a"
    [[ "$a" == --only=* ]] && only="${a#--only=}"
    [[ "$prev" == "--cases" ]] && cases="$a"
    [[ "$a" == --cases=* ]] && cases="${a#--cases=}"
    prev="$a"
done
"$bin" ${quick[@]+"${quick[@]}"} --emit-plan "$out/plan.json"

torch_args=()
if python3 -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    if python3 "$root/benches/torch_report.py" --plan "$out/plan.json" --out "$out/torch.json" \
        --device "$device" --only "$only" --cases "$cases"; then
        torch_args=(--torch "$out/torch.json")
    else
        echo "torch: torch_report.py failed; the report has no torch columns" >&2
    fi
else
    echo "torch: python3 with PyTorch and a CUDA GPU is not available; the report has no torch columns" >&2
fi

"$bin" --device "$device" --json "$out/report.json" ${torch_args[@]+"${torch_args[@]}"} "$@" | tee "$out/report.txt"
exit "${PIPESTATUS[0]}"
