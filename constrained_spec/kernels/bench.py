"""Decode-step timing of a random-weight SmolLM2-135M-shaped model, CUDA-graph replayed:
pre-fusion forward (legacy, from tests/test_fused_kernels.py) vs torch-reference kernels vs fused
Triton kernels; then the grammar mask of the sample tail, torch reference vs the Triton kernel.
"fused triton kernels" includes the small-M fused linears (norm / SiLU-and-mul fused into the next
GEMV, at most 16 rows); "fused, no fused GEMV" is the same without them (cuBLAS GEMMs). Last, those
linears alone per shape (SmolLM2-135M and Llama-3-8B), against the unfused pair, with a block-size sweep.
`python -m constrained_spec.kernels.bench [batch ...]` on a CUDA machine."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


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


def main(batches=(1, 64), ctx=256, width=512, iters=200):
    from constrained_spec import kernels as K
    from constrained_spec.attention.triton_backend import TritonAttention
    from tests.test_fused_kernels import _legacy_forward, _legacy_tables
    linear_default = K.fused_linear_enabled()

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
            "fused, no fused GEMV": lambda: model(ids, pos, kv, meta, backend),
            "fused triton kernels": lambda: model(ids, pos, kv, meta, backend),
        }
        outs = {}
        for name, fn in variants.items():
            K.set_fused_kernels(name.startswith("fused"))
            K.set_fused_linear(name != "fused, no fused GEMV")
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
    K.set_fused_linear(linear_default)
    bench_mask(batches, cfg.vocab_size, iters)
    bench_small_m_linears()


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


# (N, K, prologue) of the linears a norm or SiLU-and-mul precedes
SMALL_M_LINEAR_SHAPES = {
    "SmolLM2-135M qkv": (960, 576, "norm"), "SmolLM2-135M gate_up": (3072, 576, "norm"),
    "SmolLM2-135M down": (576, 1536, "silu"),
    "Llama-3-8B qkv": (6144, 4096, "norm"), "Llama-3-8B 4096x4096": (4096, 4096, "norm"),
    "Llama-3-8B gate_up": (28672, 4096, "norm"), "Llama-3-8B down": (4096, 14336, "silu"),
}
# (BLOCK_N, BLOCK_K, num_warps, num_stages) tried besides the default of triton_ops.small_m_linear_config
SMALL_M_LINEAR_SWEEP = [(16, 64, 4, 3), (16, 128, 4, 3), (16, 128, 2, 3), (16, 128, 8, 3), (16, 128, 4, 4),
                        (16, 256, 4, 3), (32, 128, 4, 3), (32, 256, 4, 3), (64, 128, 4, 3), (64, 256, 4, 3)]


def bench_small_m_linears(rows=(1, 8, 16), iters: int = 50, dtype=torch.bfloat16, cold_bytes: int = 256 << 20) -> None:
    """Per shape and row count, us per call (graphed): today's unfused pair (Triton add_rms_norm /
    silu_and_mul, then cuBLAS) vs the fused kernel with its default blocks and with the best of a
    sweep. Calls cycle through enough weight copies (>= `cold_bytes`, well over the 50 MB L2) that
    each reads its weight from HBM, as in a real forward. '*' marks what the model uses now."""
    from constrained_spec import kernels as K
    from constrained_spec.kernels import triton_ops as T
    print(f"small-M fused linears, {dtype}: us/call; '*' = the model's current choice for that shape")
    for name, (N, Kd, kind) in SMALL_M_LINEAR_SHAPES.items():
        copies = max(1, min(64, -(-cold_bytes // (N * Kd * dtype.itemsize))))
        weights = [torch.randn(N, Kd, device="cuda", dtype=dtype) * Kd ** -0.5 for _ in range(copies)]
        calls = max(copies, 16)
        for M in rows:
            x, res = torch.randn(M, Kd, device="cuda", dtype=dtype), torch.randn(M, Kd, device="cuda", dtype=dtype)
            norm_w = torch.ones(Kd, device="cuda", dtype=dtype)
            gate_up = torch.randn(M, 2 * Kd, device="cuda", dtype=dtype)

            def unfused(w):  # the model's path without the fused kernel (add_rms_norm writes in place: fine here)
                if kind == "norm":
                    return K.add_rms_norm_linear(x, res, norm_w, 1e-5, w)[0]
                return K.silu_mul_linear(gate_up, w)

            def fused(w, cfg):
                if kind == "norm":
                    return T.add_rms_norm_linear(x, res, norm_w, 1e-5, w, config=cfg)[0]
                return T.silu_mul_linear(gate_up, w, config=cfg)

            def time_us(fn) -> float:
                for w in weights[:2]:
                    fn(w)  # compile, allocate
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    for i in range(calls):  # a one-op graph would time the host's launch rate
                        fn(weights[i % copies])
                us = replay_ms(g, iters, warmup=5) * 1e3 / calls
                del g
                return us

            K.set_fused_linear(False)
            t_unfused = time_us(unfused)
            K.set_fused_linear(True)
            default_cfg = T.small_m_linear_config(M, N, Kd, dtype)
            t_default = time_us(lambda w: fused(w, default_cfg))
            sweep = {cfg: time_us(lambda w, cfg=cfg: fused(w, cfg)) for cfg in SMALL_M_LINEAR_SWEEP if cfg != default_cfg}
            best_cfg, t_best = min(sweep.items(), key=lambda kv: kv[1], default=(default_cfg, t_default))
            used = K.use_fused_linear(x, weights[0])
            print(f"  {name:22s} M={M:2d}: unfused {t_unfused:6.1f}{' ' if used else '*'}  fused {t_default:6.1f}"
                  f"{'*' if used else ' '} {default_cfg}  best sweep {t_best:6.1f} {best_cfg}"
                  f"  (HBM floor {N * Kd * dtype.itemsize / 3.35e6:.1f})")
        weights.clear()  # free them before the next shape
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(tuple(int(a) for a in sys.argv[1:]) or (1, 64))
