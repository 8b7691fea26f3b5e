#!/usr/bin/env python3
"""Plain-PyTorch equivalents of the gpu-report cases, eager and under torch.cuda.CUDAGraph.

The cases (shapes, inputs and keys) come from the Rust report itself:

    gpu-report --emit-plan plan.json            # or --quick --emit-plan for small shapes
    python3 benches/torch_report.py --plan plan.json --out torch.json
    gpu-report --device cuda:0 --torch torch.json

Each case is written the way a PyTorch user would write it (no custom kernels, no
torch.compile), on inputs filled like the Rust side fills them. Timing: torch.cuda.Event pairs
around `reps` back-to-back calls, median of many samples after warm-up; `reps` is picked so a
sample lasts about 200 us. "graph" captures `reps` calls into one torch.cuda.CUDAGraph and
replays it per sample, the same way the Rust report times its graph column.

Only PyTorch is needed (and a CUDA GPU). The JSON is
{"device", "torch", "cuda", "date", "cases": {key: {"eager_us", "graph_us"}}, "skipped": {key: why}}.
"""

import argparse
import datetime
import json
import math
import sys

try:
    import torch
except ImportError:  # pragma: no cover - reported to the caller
    torch = None

SAMPLE_US = 200.0
CASE_US = 250_000.0
MAX_REPS = 64
MIN_SAMPLES = 15
MAX_SAMPLES = 200
WARMUP = 3


def median(v):
    v = sorted(v)
    n = len(v)
    if n == 0:
        return float("nan")
    return v[n // 2] if n % 2 else 0.5 * (v[n // 2 - 1] + v[n // 2])


def sample(fn, reps):
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / reps


def plan_reps(fn):
    for _ in range(WARMUP):
        fn()
    torch.cuda.synchronize()
    t = max(sample(fn, 1), 0.05)
    reps = max(1, min(MAX_REPS, math.ceil(SAMPLE_US / t)))
    samples = max(MIN_SAMPLES, min(MAX_SAMPLES, int(CASE_US / (t * reps))))
    return reps, samples


def time_eager(fn):
    reps, samples = plan_reps(fn)
    return median([sample(fn, reps) for _ in range(samples)])


def time_graph(fn):
    reps, samples = plan_reps(fn)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(WARMUP):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    for _ in range(WARMUP):
        graph.replay()
    torch.cuda.synchronize()
    v = [sample(graph.replay, 1) / reps for _ in range(samples)]
    del graph
    return median(v)


def bf16_fill(shape, dev):
    # 0x3c3c as bf16 (about 0.0115), the Rust side's memset byte 0x3c.
    return torch.full(shape, 0.0115, dtype=torch.bfloat16, device=dev)


def pattern_weights(rows, d, dev):
    # The Rust side's ((i % 97) - 48) / (48 * sqrt(d)) f32 weights.
    i = torch.arange(rows * d, device=dev, dtype=torch.int64)
    return (((i % 97).float() - 48.0) / (48.0 * math.sqrt(d))).view(rows, d)


def case_copy(c, dev):
    n = c["bytes"] // 4
    src = torch.full((n,), 0x3C3C3C3C, dtype=torch.int32, device=dev)
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def case_gemm(c, dev):
    t, n, k, g = c["t"], c["n"], c["k"], c["groups"]
    f32 = c["out"] == "f32"
    if g == 1:
        x = bf16_fill((t, k), dev)
        w = bf16_fill((n, k), dev)
        if f32:
            return lambda: torch.matmul(x, w.t()).float()
        y = torch.empty((t, n), dtype=torch.bfloat16, device=dev)
        return lambda: torch.matmul(x, w.t(), out=y)
    # Grouped: x [t, g, k] · w[g] [n, k]ᵀ → [t, g, n], as a batched matmul over the groups.
    x = bf16_fill((t, g, k), dev)
    w = bf16_fill((g, n, k), dev)
    y = torch.empty((g, t, n), dtype=torch.bfloat16, device=dev)
    return lambda: torch.bmm(x.transpose(0, 1), w.transpose(1, 2), out=y)


def case_rms_norm(c, dev):
    rows, dim, eps = c["rows"], c["dim"], c["eps"]
    x = bf16_fill((rows, dim), dev)
    w = torch.full((dim,), 1.0, dtype=torch.bfloat16, device=dev)

    def f():
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(torch.bfloat16)

    return f


def mhc_inputs(c, dev):
    t, h, n = c["t"], c["hidden"], c["hc_mult"]
    r = bf16_fill((t, n, h), dev)
    return t, h, n, r


def hc_head(r, fn, scale, base, rms_eps=1e-6, hc_eps=1e-6):
    t, n, h = r.shape
    x = r.reshape(t, n * h).float()
    rs = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + rms_eps)
    g = torch.sigmoid((x @ fn.t()) * rs * scale + base) + hc_eps
    return (g.unsqueeze(-1) * r.float()).sum(1).to(torch.bfloat16)


def mhc_pre(r, fn, scale, base, iters, rms_eps=1e-6, eps=1e-6, post_mult=2.0):
    t, n, h = r.shape
    x = r.reshape(t, n * h).float()
    mixes = (x @ fn.t()) * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) / (n * h) + rms_eps)
    pre = torch.sigmoid(mixes[:, :n] * scale[0] + base[:n]) + eps
    post = torch.sigmoid(mixes[:, n : 2 * n] * scale[1] + base[n : 2 * n]) * post_mult
    comb = mixes[:, 2 * n :].reshape(t, n, n) * scale[2] + base[2 * n :].reshape(n, n)
    comb = torch.softmax(comb, -1) + eps
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    layer_input = (pre.unsqueeze(-1) * r.float()).sum(1).to(torch.bfloat16)
    return post, comb, layer_input


def mhc_post(x, r, post, comb):
    out = post.unsqueeze(-1) * x.float().unsqueeze(1) + torch.einsum("tij,tih->tjh", comb, r.float())
    return out.to(torch.bfloat16)


def case_hc_head(c, dev):
    t, h, n, r = mhc_inputs(c, dev)
    fn = pattern_weights(n, n * h, dev)
    scale = torch.full((1,), 0.7, device=dev)
    base = torch.full((n,), 0.1, device=dev)
    return lambda: hc_head(r, fn, scale, base)


def pre_weights(n, h, dev):
    m = n * (n + 2)
    return pattern_weights(m, n * h, dev), torch.full((3,), 0.7, device=dev), torch.full((m,), 0.1, device=dev)


def case_mhc_pre(c, dev):
    t, h, n, r = mhc_inputs(c, dev)
    fn, scale, base = pre_weights(n, h, dev)
    return lambda: mhc_pre(r, fn, scale, base, c["sinkhorn_iters"])


def post_inputs(t, h, n, dev):
    x = torch.full((t, h), 0.0117, dtype=torch.bfloat16, device=dev)
    post = torch.full((t, n), 0.75, device=dev)
    comb = torch.full((t, n, n), 0.25, device=dev)
    return x, post, comb


def case_mhc_post(c, dev):
    t, h, n, r = mhc_inputs(c, dev)
    x, post, comb = post_inputs(t, h, n, dev)
    return lambda: mhc_post(x, r, post, comb)


def case_mhc_fused_post_pre(c, dev):
    t, h, n, r = mhc_inputs(c, dev)
    x, post, comb = post_inputs(t, h, n, dev)
    fn, scale, base = pre_weights(n, h, dev)

    def f():
        r2 = mhc_post(x, r, post, comb)
        return r2, mhc_pre(r2, fn, scale, base, c["sinkhorn_iters"])

    return f


def case_attention(c, dev):
    """Ragged sparse attention with a per-head sink, as gather + softmax. Every row here has the
    same number of entries (window + extra), so the ragged lists are a dense [B, E] index."""
    b, hq, d, win, extra, scale = c["batch"], c["heads"], c["head_dim"], c["window"], c["extra"], c["scale"]
    e = win + extra
    i = torch.arange(max(b * e, 1) * d, device=dev, dtype=torch.int64)
    cache = (((i % 97).float() - 48.0) / 64.0).to(torch.bfloat16).view(-1, d)
    idx = torch.arange(b * e, device=dev, dtype=torch.int64).view(b, e)
    q = torch.full((b, hq, d), 0.01, dtype=torch.bfloat16, device=dev)
    sink = torch.zeros((hq,), device=dev)

    def f():
        k = cache[idx]  # [B, E, d]: the gather (V = K, MQA latent)
        logits = torch.bmm(q, k.transpose(1, 2)).float() * scale  # [B, h, E]
        logits = torch.cat([logits, sink.view(1, hq, 1).expand(b, hq, 1)], -1)
        p = torch.softmax(logits, -1)[..., :e]
        return torch.bmm(p.to(torch.bfloat16), k)  # [B, h, d]

    return f


CASES = {
    "copy": case_copy,
    "gemm": case_gemm,
    "rms_norm": case_rms_norm,
    "hc_head": case_hc_head,
    "mhc_pre": case_mhc_pre,
    "mhc_post": case_mhc_post,
    "mhc_fused_post_pre": case_mhc_fused_post_pre,
    "attention": case_attention,
}


def selected(key, only, cases):
    """Whether the case `key` ("section/case") runs: its section is in `only` (or `only` is empty)
    and its case contains one of `cases` (or `cases` is empty; the copy ceiling always runs), as
    `gpu-report --only ... --cases ...` selects its rows.

    >>> selected("attention/h128_d512 swa128+512 B=64", ["attention"], ["B=64"])
    True
    >>> selected("attention/h128_d512 swa128+512 B=8", [], ["B=64"])
    False
    >>> selected("ceilings/copy 1024 MiB d2d", ["attention"], ["B=64"])
    False
    >>> selected("ceilings/copy 1024 MiB d2d", [], ["B=64"])
    True
    """
    section, _, case = key.partition("/")
    if only and section not in only:
        return False
    return not cases or section == "ceilings" or any(p in case for p in cases)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--plan", required=True, help="the JSON written by `gpu-report --emit-plan PATH`")
    ap.add_argument("--out", default="torch-report.json", help="where to write the timings")
    ap.add_argument("--device", default="cuda:0", help="the CUDA device (default cuda:0)")
    ap.add_argument("--only", default="", help="comma-separated sections (key prefixes) to run")
    ap.add_argument("--cases", default="", help="comma-separated pieces of case names: only the cases containing one run")
    args = ap.parse_args()
    if torch is None:
        print("error: PyTorch is not installed", file=sys.stderr)
        return 3
    if not torch.cuda.is_available():
        print("error: PyTorch sees no CUDA GPU", file=sys.stderr)
        return 3
    dev = torch.device(args.device)
    torch.cuda.set_device(dev)
    try:
        with open(args.plan) as f:
            plan = json.load(f)
    except (OSError, ValueError) as e:
        print(f"error: --plan {args.plan}: {e}", file=sys.stderr)
        return 2
    only = [s for s in args.only.split(",") if s]
    cases = [s for s in args.cases.split(",") if s.strip()]
    out = {
        "device": torch.cuda.get_device_name(dev),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "cases": {},
        "skipped": {},
    }
    for c in plan.get("cases", []):
        key = c["key"]
        if not selected(key, only, cases):
            continue
        make = CASES.get(c["op"])
        if make is None:
            out["skipped"][key] = f"no PyTorch equivalent for op {c['op']!r}"
            continue
        try:
            fn = make(c, dev)
            eager = time_eager(fn)
            try:
                graph = time_graph(fn)
            except Exception as e:  # noqa: BLE001 - a capture failure is a skipped column
                graph = None
                out["skipped"][key + " (graph)"] = f"{type(e).__name__}: {e}"
            out["cases"][key] = {"eager_us": eager, "graph_us": graph}
            g = f"{graph:.3f}" if graph is not None else "-"
            print(f"torch: {key}: eager {eager:.3f} us, graph {g} us", file=sys.stderr)
        except Exception as e:  # noqa: BLE001 - e.g. out of memory: skip the case, keep going
            out["skipped"][key] = f"{type(e).__name__}: {e}"
            print(f"torch: {key}: skipped ({type(e).__name__}: {e})", file=sys.stderr)
        finally:
            fn = None
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"torch: {len(out['cases'])} cases, {len(out['skipped'])} skipped -> {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
