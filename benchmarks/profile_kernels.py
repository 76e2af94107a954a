"""The kernels of one decode forward on CUDA: count, device time, the heaviest by total time.

Random-weight SmolLM2-135M shapes, bf16, Triton backend, context `--ctx` tokens, eager forwards
under torch.profiler (a graph replays the same kernels back to back). What a small model's decode
step costs per kernel is what bounds it at batch 1 (results/kernels_per_step_s6.log).

  python benchmarks/profile_kernels.py --batches 1 32
"""
from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from constrained_spec.attention.triton_backend import TritonAttention  # noqa: E402
from constrained_spec.kernels.bench import decode_inputs, random_model, smollm2_135m_config  # noqa: E402


def profile_forward(model, cfg, batch: int, ctx: int, forwards: int = 5) -> dict[str, tuple[int, float]]:
    """{kernel name: (launches per forward, total device us per forward)}."""
    from torch.profiler import ProfilerActivity, profile
    kv, meta, ids, pos = decode_inputs(cfg, batch, ctx, 8192, "cuda", shuffle=True)
    backend = TritonAttention()
    with torch.inference_mode():
        for _ in range(3):
            model.compute_logits(model(ids, pos, kv, meta, backend)).float()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(forwards):
                model.compute_logits(model(ids, pos, kv, meta, backend)).float()
            torch.cuda.synchronize()
    agg: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type.name == "CUDA":
            agg[e.name][0] += 1
            agg[e.name][1] += e.device_time_total
    return {k: (n / forwards, t / forwards) for k, (n, t) in agg.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--ctx", type=int, default=150)
    args = ap.parse_args()
    cfg = smollm2_135m_config()
    model = random_model(cfg, "cuda")
    for batch in args.batches:
        kernels = profile_forward(model, cfg, batch, args.ctx)
        count = sum(n for n, _ in kernels.values())
        busy = sum(t for _, t in kernels.values())
        print(f"B={batch}: {count:.0f} kernels per forward, {busy:.0f} us device busy")
        for name, (n, t) in sorted(kernels.items(), key=lambda kv: -kv[1][1])[:12]:
            print(f"  {n:5.0f} x {t / n:6.2f} us  {name[:110]}")


if __name__ == "__main__":
    main()
