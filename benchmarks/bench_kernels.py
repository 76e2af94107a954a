"""Decode-step timing of a random-weight SmolLM2-135M-shaped model, CUDA-graph replayed:
pre-fusion forward (legacy, from tests/test_fused_kernels.py) vs torch-reference kernels vs fused
Triton kernels, with the kernel count of each forward; then the grammar mask of the sample tail,
torch reference vs the Triton kernel. Prints its table (writes no file).

  python benchmarks/bench_kernels.py [batch ...]     # CUDA machine; default batches 1 64
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def replay_ms(graph: torch.cuda.CUDAGraph, iters: int, warmup: int = 20) -> float:
    """Device milliseconds per replay of a captured graph (CUDA events around `iters` replays)."""
    for _ in range(warmup):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def smollm2_135m_config():
    from constrained_spec.models.config import ModelConfig
    return ModelConfig(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                       num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
                       rope_scaling=None, max_position=8192, tie_word_embeddings=True, qkv_bias=False)


def random_model(cfg, dev: str = "cuda", dtype=torch.bfloat16):
    """Our model of `cfg`'s shapes with N(0, 0.02) weights, eval, no grad."""
    from constrained_spec.models.loader import build_model
    model = build_model(cfg, dtype, dev)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    return model.eval().requires_grad_(False)


def decode_inputs(cfg, B: int, ctx: int, width: int, dev: str = "cuda", dtype=torch.bfloat16,
                  shuffle: bool = False):
    """One decode step of B sequences of `ctx` tokens (the new one included) over a slot table
    `width` wide and a pool of B * width + 1 slots: (kv, meta, ids, pos). `shuffle`: each row's
    slots are scattered over the pool instead of contiguous."""
    from constrained_spec.attention import AttentionMetadata, ForwardMode, KVCache
    kv = KVCache(cfg.num_layers, B * width + 1, cfg.num_kv_heads, cfg.head_dim, dtype, dev)
    order = torch.randperm(B * width, device=dev) if shuffle else torch.arange(B * width, device=dev)
    table = (order.view(B, width) + 1)
    kv_lens = torch.full((B,), ctx, dtype=torch.int32, device=dev)
    out_slots = table[:, ctx - 1].clone()
    meta = AttentionMetadata(ForwardMode.DECODE, out_slots, torch.arange(B + 1, dtype=torch.int32, device=dev),
                             torch.ones(B, dtype=torch.int32, device=dev), kv_lens, table, 1, width)
    ids = torch.randint(0, cfg.vocab_size, (B,), device=dev)
    pos = torch.full((B,), ctx - 1, dtype=torch.int64, device=dev)
    return kv, meta, ids, pos


def capture(fn):
    """One call of `fn` captured in a CUDA graph (call `fn` eagerly first: compiles, allocates):
    (graph, the captured call's output)."""
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    return g, out


def capture_decode_forward(model, ids, pos, kv, meta, backend):
    """A whole decode forward (layers + float logits) with `backend`, warmed up and captured:
    (graph, the logits of one replay, cloned). The forward stores this step's K/V at
    meta.out_slots, the same on every replay. Call under torch.inference_mode()."""
    def fwd():
        return model.compute_logits(model(ids, pos, kv, meta, backend)).float()
    for _ in range(2):
        fwd()
    torch.cuda.synchronize()
    graph, out = capture(fwd)
    graph.replay()
    torch.cuda.synchronize()
    return graph, out.clone()


def main(batches=(1, 64), ctx=256, width=512, iters=200):
    from constrained_spec import kernels as K
    from constrained_spec.attention.triton_backend import TritonAttention
    from tests.test_fused_kernels import _legacy_forward, _legacy_tables

    cfg = smollm2_135m_config()
    dev = "cuda"
    model = random_model(cfg, dev)
    tables = _legacy_tables(model, dev)
    backend = TritonAttention()
    print(f"device: {torch.cuda.get_device_name()}  ctx={ctx} table_width={width}")
    for B in batches:
        kv, meta, ids, pos = decode_inputs(cfg, B, ctx, width, dev)
        variants = {
            "legacy (pre-fusion)": lambda: _legacy_forward(model, ids, pos, kv, meta, backend, tables),
            "torch-reference kernels": lambda: model(ids, pos, kv, meta, backend),
            "fused triton kernels": lambda: model(ids, pos, kv, meta, backend),
        }
        outs = {}
        for name, fn in variants.items():
            K.set_fused_kernels(name.startswith("fused"))
            with torch.inference_mode():
                for _ in range(3):
                    fn()
                torch.cuda.synchronize()
                try:
                    from torch.profiler import ProfilerActivity, profile
                    with profile(activities=[ProfilerActivity.CUDA]) as prof:
                        fn()
                        torch.cuda.synchronize()
                    n_kernels = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
                except Exception as ex:  # noqa: BLE001 - no CUPTI: timings still count
                    print("profiler failed:", ex)
                    n_kernels = -1
                g, out = capture(fn)
                g.replay()
                torch.cuda.synchronize()
                outs[name] = out.float().clone()
                ms = replay_ms(g, iters)
            print(f"B={B:3d} {name:24s} {ms:7.3f} ms/replay  GPU ops/forward={n_kernels:4d} "
                  f"(~{n_kernels / cfg.num_layers:.1f}/layer)")
            del g
        ref = outs["legacy (pre-fusion)"]
        for name, o in outs.items():
            print(f"   max|{name} - legacy| = {(o - ref).abs().max().item():.3e} (|legacy| max {ref.abs().max().item():.2f})")
    K.set_fused_kernels(True)
    bench_mask(batches, cfg.vocab_size, iters)


def bench_mask(batches, vocab: int, iters: int, calls: int = 20) -> None:
    from constrained_spec import kernels as K
    for B in batches:
        logits = torch.randn(B, vocab, device="cuda")
        bitmask = torch.randint(-2 ** 31, 2 ** 31 - 1, (B, (vocab + 31) // 32), dtype=torch.int32, device="cuda")
        for name, fused in (("torch-reference mask", False), ("triton mask", True)):
            K.set_fused_kernels(fused)
            K.mask_logits(logits, bitmask)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for _ in range(calls):  # a one-op graph would time the host's launch rate
                    K.mask_logits(logits, bitmask)
            print(f"B={B:3d} {name:24s} {replay_ms(g, iters) * 1e3 / calls:7.1f} us/call (graphed)")
    K.set_fused_kernels(True)


if __name__ == "__main__":
    main(tuple(int(a) for a in sys.argv[1:]) or (1, 64))
