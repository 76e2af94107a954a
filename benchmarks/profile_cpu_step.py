"""One CPU decode step of SmolLM2-135M without the engine loop around it: the model forward's time
and the logits head's, and (--profile) the torch ops the forward spends it on. For before/after
figures of CPU work on the forward (fused kernels, packed projections).

Builds the real model (bfloat16 by default, projections prepacked as the engine does), a KV cache
holding `--context` tokens per sequence, and the decode metadata of `--batch` sequences; times the
forward (median of `--repeats`). `--reference` forces the torch reference kernels (A/B).

  python benchmarks/profile_cpu_step.py [--batch 8] [--dtype bfloat16] [--profile] [--reference]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def decode_meta(batch: int, context: int):
    """Sequence b holds slots b * context + 1 ... (slot 0 is padding); its new token is the last."""
    from constrained_spec.attention import AttentionMetadata, ForwardMode
    table = torch.arange(batch * context).view(batch, context) + 1
    return AttentionMetadata(ForwardMode.DECODE, table[:, -1].clone(), torch.arange(batch + 1, dtype=torch.int32),
                             torch.ones(batch, dtype=torch.int32), torch.full((batch,), context, dtype=torch.int32),
                             table, 1, context)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=64, help="tokens per sequence, the new one included")
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--profile", action="store_true", help="list the torch ops of one step")
    ap.add_argument("--reference", action="store_true", help="the torch reference kernels, not the native ones")
    args = ap.parse_args()

    from constrained_spec import kernels
    from constrained_spec.attention import KVCache
    from constrained_spec.attention.torch_backend import TorchAttention
    from constrained_spec.models import load_model
    from constrained_spec.models.cpu_linear import prepack_bf16_linears
    if args.reference:
        kernels.set_fused_kernels(False)
    loaded = load_model(args.model, dtype=getattr(torch, args.dtype), device="cpu")
    model, cfg = loaded.model, loaded.config
    prepack_bf16_linears(model)
    B, ctx = args.batch, args.context
    kv = KVCache(cfg.num_layers, B * ctx + 1, cfg.num_kv_heads, cfg.head_dim, getattr(torch, args.dtype), "cpu")
    kv.k.normal_()
    kv.v.normal_()
    ids = torch.randint(0, cfg.vocab_size, (B,))
    pos = torch.full((B,), ctx - 1, dtype=torch.int64)
    backend = TorchAttention()

    def step():
        return model(ids, pos, kv, decode_meta(B, ctx), backend)

    with torch.inference_mode():
        for _ in range(5):
            model.compute_logits(step())
        forward, head = [], []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            hidden = step()
            t1 = time.perf_counter()
            model.compute_logits(hidden)
            forward.append(1000 * (t1 - t0))
            head.append(1000 * (time.perf_counter() - t1))
        print(f"{args.dtype} batch {B} context {ctx} ({'reference' if args.reference else 'native'} kernels): "
              f"forward {statistics.median(forward):.2f} ms median, {min(forward):.2f} min over {args.repeats}; "
              f"logits head {statistics.median(head):.2f} ms median")
        if args.profile:
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(5):
                    step()
            print("(5 steps)")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))


if __name__ == "__main__":
    main()
