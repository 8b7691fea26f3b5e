#!/usr/bin/env bash
# Times `mhc_pre` and the fused op unchunked (eager and as one graph) beside the same call over
# chunks of T (`mhc/examples/mhc_case.rs`: `MHC_PIPE`, the op's own chunked schedule; `MHC_CHUNKS`,
# `MHC_LANES`, chunks as separate ops), one process per case, and
# prints one line per case (mean µs per call, bytes, rate, output hash: equal hashes, equal bits).
#
#   benches/mhc-chunks.sh [REPS]          (default 2 repetitions)
#
# MHC_CASE_BIN names a prebuilt `mhc_case` (a GPU host without a Rust toolchain); else it is built
# here with the `cuda` feature. The device is $HOLDFAST_DEVICE (default cuda:0). SHAPES and
# VARIANTS override the lists below (variants: eager, graph, pC = the op's chunked schedule with
# chunks of C (`MhcOps::with_chunk_tokens`), gpC = the same as one graph, C = chunks of C as ops of
# their own on two streams, tC = the same with two passes forced, lC = chunks of C on one stream).
set -euo pipefail
reps="${1:-2}"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bin="${MHC_CASE_BIN:-}"
if [[ -z "$bin" ]]; then
    cargo build --release --manifest-path "$root/Cargo.toml" -p holdfast-mhc --features cuda --example mhc_case
    bin="${CARGO_TARGET_DIR:-$root/target}/release/examples/mhc_case"
fi
export HOLDFAST_DEVICE="${HOLDFAST_DEVICE:-cuda:0}"
shapes="${SHAPES:-mhc_pre:4096:16384 mhc_fused_post_pre:4096:16384 mhc_pre:4096:4096 mhc_pre:7168:16384 mhc_fused_post_pre:7168:4096}"
variants="${VARIANTS:-eager graph p256 p512 p1024 gp512 512 2048 t512 l2048}"

# The kernels compile once (NVRTC, cached on disk) before anything is timed.
"$bin" mhc_pre 4096 64 1 >/dev/null

for rep in $(seq 1 "$reps"); do
    for shape in $shapes; do
        IFS=: read -r op h t <<<"$shape"
        iters=$((t >= 4096 ? 30 : 150))
        for v in $variants; do
            case "$v" in
                eager) env=() ;;
                graph) env=(MHC_GRAPH=1) ;;
                p*) env=("MHC_PIPE=${v#p}") ;;
                gp*) env=(MHC_GRAPH=1 "MHC_PIPE=${v#gp}") ;;
                t*) env=(MHC_PASSES=two "MHC_CHUNKS=${v#t}") ;;
                l*) env=(MHC_LANES=1 "MHC_CHUNKS=${v#l}") ;;
                *) env=("MHC_CHUNKS=$v") ;;
            esac
            if line=$(env "${env[@]}" "$bin" "$op" "$h" "$t" "$iters" 2>&1); then
                echo "$rep $v | $line"
            else
                echo "$rep $v | failed: $line"
            fi
        done
    done
done
