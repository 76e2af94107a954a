"""Same-machine A/B: RoPE + KV store fused into Triton decode attention (the default) against the
separate RoPE + store kernel before it, on a whole random-weight SmolLM2-135M-shaped decode forward
(30 layers + logits, bf16, slot table 8192 wide, contexts scattered over the pool), CUDA-graph
replayed. Device ms per replay; the variants alternate over `--rounds` rounds (order rotating) and
each figure is the median, so clock drift hits both alike. The logits of the two are compared.

  python benchmarks/bench_fused_rope.py     # CUDA machine; writes benchmarks/results/fused_rope_ab.{json,md}
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import machine, markdown_table, write_results  # noqa: E402

from constrained_spec.kernels.bench import (capture_decode_forward, decode_inputs, random_model, replay_ms,  # noqa: E402
                                            smollm2_135m_config)

WIDTH = 8192
VARIANTS = {"separate": False, "fused": True}


def measure(batch: int, ctx: int, model, cfg, rounds: int, iters: int) -> dict:
    from constrained_spec.attention.triton_backend import TritonAttention
    torch.manual_seed(batch * 131 + ctx)
    kv, meta, ids, pos = decode_inputs(cfg, batch, ctx, WIDTH, "cuda", shuffle=True)
    kv.k.normal_()
    kv.v.normal_()
    graphs, outs = {}, {}
    with torch.inference_mode():
        for name, fuse in VARIANTS.items():
            graphs[name], outs[name] = capture_decode_forward(model, ids, pos, kv, meta, TritonAttention(fuse_rope=fuse))
        times = {name: [] for name in graphs}
        names = list(graphs)
        for r in range(rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                times[name].append(replay_ms(graphs[name], iters))
    diff = (outs["fused"] - outs["separate"]).abs().max().item()
    same_argmax = bool((outs["fused"].argmax(-1) == outs["separate"].argmax(-1)).all())
    return {"B": batch, "ctx": ctx, "ms": {n: statistics.median(t) for n, t in times.items()},
            "ms_rounds": times, "max_abs_logit_diff": diff, "same_argmax": same_argmax}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64, 128])
    ap.add_argument("--contexts", type=int, nargs="+", default=[150, 1000])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--name", default="fused_rope_ab")
    args = ap.parse_args()
    cfg = smollm2_135m_config()
    model = random_model(cfg, "cuda")
    records, rows = [], []
    for B in args.batches:
        for ctx in args.contexts:
            rec = measure(B, ctx, model, cfg, args.rounds, args.iters)
            records.append(rec)
            sep, fus = rec["ms"]["separate"], rec["ms"]["fused"]
            rows.append([B, ctx, f"{sep:.3f}", f"{fus:.3f}", f"{sep / fus:.3f}", f"{rec['max_abs_logit_diff']:.2e}",
                         "yes" if rec["same_argmax"] else "no"])
            print(rows[-1], flush=True)
            torch.cuda.empty_cache()
    md = ("# RoPE + KV store fused into decode attention: A/B (whole decode forward)\n\n"
          f"{machine().get('gpu', 'no GPU')}, torch {torch.__version__}\n\nRandom-weight SmolLM2-135M shapes, bf16, CUDA graph, slot table {WIDTH} wide; "
          f"device ms per replay, median of {args.rounds} alternating rounds.\n\n"
          + markdown_table(["batch", "context", "separate ms", "fused ms", "speedup", "max abs logit diff",
                            "same argmax"], rows))
    write_results(args.name, {"machine": machine(), "records": records}, md)


if __name__ == "__main__":
    main()
