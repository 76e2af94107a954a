"""Attention backends side by side: triton vs torch (reference) for paged decode and tree verify.

Decode: B in (1, 8, 32, 64), context 512 and 4096, SmolLM2-135M shapes (9 q / 3 kv heads, D=64) and
Llama-3-8B shapes (32 / 8, D=128), bf16. Each figure is one layer's attention call (KV store included):
eager (one Python call, launch overhead included) and, for triton, replayed from a CUDA graph that holds
`GRAPH_CALLS` calls (per-call time, i.e. what a captured decode step pays per layer). Also reports the
effective K/V read bandwidth of the graphed triton call.

Writes benchmarks/results/attention.json and attention.md.
  python benchmarks/bench_attention.py            # GPU
  TRITON_INTERPRET=1 python benchmarks/bench_attention.py --smoke   # CPU smoke run, tiny shapes
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import machine, markdown_table, write_results  # noqa: E402

from constrained_spec.attention.base import AttentionMetadata, ForwardMode, KVCache  # noqa: E402
from constrained_spec.attention.torch_backend import TorchAttention  # noqa: E402
from constrained_spec.attention.triton_backend import TritonAttention  # noqa: E402

SHAPES = {"smollm2-135m": (9, 3, 64), "llama3-8b": (32, 8, 128)}
GRAPH_CALLS = 20


def build(mode, B, ctx, q_len, H, KVH, D, dtype, device):
    """Contexts of exactly `ctx` tokens (new ones included), slots scattered over the pool."""
    T = B * q_len
    num_slots = B * ctx + 16
    kv = KVCache(1, num_slots, KVH, D, dtype, device)
    kv.k.normal_()
    kv.v.normal_()
    slot_table = (torch.randperm(num_slots - 1, device=device)[: B * ctx] + 1).view(B, ctx)
    out_slots = slot_table[:, ctx - q_len:].reshape(-1).contiguous()
    q_lens = torch.full((B,), q_len, dtype=torch.int32, device=device)
    q_starts = torch.arange(B + 1, dtype=torch.int32, device=device) * q_len
    kv_lens = torch.full((B,), ctx, dtype=torch.int32, device=device)
    tree = None
    if mode is ForwardMode.VERIFY:  # a random tree per sequence
        parents = [0] + [int(torch.randint(0, i, (1,))) for i in range(1, q_len)]
        m = torch.zeros(q_len, q_len, dtype=torch.bool)
        for i in range(q_len):
            m[i, i] = True
            if i:
                m[i] |= m[parents[i]]
        tree = m.to(device).expand(B, q_len, q_len).contiguous()
    meta = AttentionMetadata(mode, out_slots, q_starts, q_lens, kv_lens, slot_table, q_len, ctx, tree)
    q = torch.randn(T, H, D, device=device, dtype=dtype)
    k = torch.randn(T, KVH, D, device=device, dtype=dtype)
    v = torch.randn(T, KVH, D, device=device, dtype=dtype)
    return q, k, v, kv, meta


def time_eager(fn, iters: int, cuda: bool) -> float:
    fn()
    if cuda:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) * 1e3 / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) * 1e6 / iters


def time_graph(fn, iters: int) -> float | None:
    try:
        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(GRAPH_CALLS):
                fn()
        graph.replay()
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001
        print(f"  (graph capture failed: {type(e).__name__}: {str(e)[:120]})")
        return None
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (iters * GRAPH_CALLS)


def check(a, b, tol):
    err = (a.float() - b.float()).abs().max().item()
    assert err < tol, f"triton differs from torch by {err}"
    return err


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU under TRITON_INTERPRET=1")
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.smoke
    device = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float16
    if args.smoke:
        batches, ctxs, shapes, iters, trees = (1, 2), (32,), {"tiny": (4, 2, 16)}, 1, (4,)
    else:
        batches, ctxs, shapes, iters, trees = (1, 8, 32, 64), (512, 4096), SHAPES, args.iters, (16, 64)
    torch.manual_seed(0)
    tri, ref = TritonAttention(), TorchAttention()
    rows, records = [], []
    torch_graph_ok = True
    for sname, (H, KVH, D) in shapes.items():
        scale = D ** -0.5
        for ctx in ctxs:
            for B in batches:
                q, k, v, kv, meta = build(ForwardMode.DECODE, B, ctx, 1, H, KVH, D, dtype, device)
                o_t = tri.forward(q, k, v, 0, kv, meta, scale)
                o_r = ref.forward(q, k, v, 0, kv, meta, scale)
                err = check(o_t, o_r, 5e-2)
                t_tri = time_eager(lambda: tri.forward(q, k, v, 0, kv, meta, scale), iters, cuda)
                t_ref = time_eager(lambda: ref.forward(q, k, v, 0, kv, meta, scale), max(1, iters // 2), cuda)
                g_tri = time_graph(lambda: tri.forward(q, k, v, 0, kv, meta, scale), iters) if cuda else None
                g_ref = None
                if cuda and torch_graph_ok:
                    g_ref = time_graph(lambda: ref.forward(q, k, v, 0, kv, meta, scale), iters)
                    torch_graph_ok = g_ref is not None
                kv_bytes = B * ctx * KVH * D * 2 * kv.k.element_size()
                gbps = kv_bytes / (g_tri * 1e-6) / 1e9 if g_tri else None
                rec = dict(mode="decode", shape=sname, H=H, KVH=KVH, D=D, B=B, ctx=ctx, q_len=1,
                           torch_eager_us=t_ref, triton_eager_us=t_tri, torch_graph_us=g_ref,
                           triton_graph_us=g_tri, triton_graph_kv_GBps=gbps, max_abs_err=err)
                records.append(rec)
                rows.append(_row(rec))
                print(rows[-1], flush=True)
                del q, k, v, kv, meta
        for ctx in ctxs:
            for q_len in trees:
                for B in batches[:3]:
                    q, k, v, kv, meta = build(ForwardMode.VERIFY, B, ctx, q_len, H, KVH, D, dtype, device)
                    err = check(tri.forward(q, k, v, 0, kv, meta, scale), ref.forward(q, k, v, 0, kv, meta, scale), 5e-2)
                    t_tri = time_eager(lambda: tri.forward(q, k, v, 0, kv, meta, scale), iters, cuda)
                    t_ref = time_eager(lambda: ref.forward(q, k, v, 0, kv, meta, scale), max(1, iters // 2), cuda)
                    g_tri = time_graph(lambda: tri.forward(q, k, v, 0, kv, meta, scale), iters) if cuda else None
                    rec = dict(mode="verify", shape=sname, H=H, KVH=KVH, D=D, B=B, ctx=ctx, q_len=q_len,
                               torch_eager_us=t_ref, triton_eager_us=t_tri, torch_graph_us=None,
                               triton_graph_us=g_tri, triton_graph_kv_GBps=None, max_abs_err=err)
                    records.append(rec)
                    rows.append(_row(rec))
                    print(rows[-1], flush=True)
                    del q, k, v, kv, meta
    headers = ["mode", "shape", "B", "ctx", "q/seq", "torch eager us", "triton eager us", "torch graph us",
               "triton graph us", "speedup (graph, torch/triton)", "triton KV GB/s"]
    md = (f"# Attention backends: one layer, {str(dtype).replace('torch.', '')}, " + (machine().get("gpu", "cpu")) + "\n\n"
          + f"Graph figures are per call, {GRAPH_CALLS} calls per captured graph. KV store included.\n\n"
          + markdown_table(headers, rows))
    name = "attention_smoke" if args.smoke else "attention"
    write_results(name, {"machine": machine(), "dtype": str(dtype), "graph_calls": GRAPH_CALLS,
                         "results": records}, md)


def _row(r):
    def f(x):
        return round(x, 1) if isinstance(x, float) else ("-" if x is None else x)
    sp = (r["torch_graph_us"] or r["torch_eager_us"]) / r["triton_graph_us"] if r["triton_graph_us"] else None
    return [r["mode"], r["shape"], r["B"], r["ctx"], r["q_len"], f(r["torch_eager_us"]), f(r["triton_eager_us"]),
            f(r["torch_graph_us"]), f(r["triton_graph_us"]), f(sp), f(r["triton_graph_kv_GBps"])]


if __name__ == "__main__":
    main()
