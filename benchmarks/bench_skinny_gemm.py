"""Skinny GEMM (constrained_spec/kernels/skinny_gemm.py) against cuBLAS (F.linear) for the
projections of a decode step: SmolLM2-135M's qkv / o / gate_up / down and its logits, and
Llama-3-8B's, at 1-16 rows, bf16, on CUDA.

Each cell is device us per call in a CUDA graph of back-to-back calls, each on its own copy of the
weight (copies fill >= 150 MB, so weights come from HBM as in a real step, not from L2). For every
(shape, rows) the kernel is timed with a grid of launch configs; the table gives cuBLAS, the
default config, the best config found and its ratio to cuBLAS. Outputs are checked against cuBLAS.

  python benchmarks/bench_skinny_gemm.py            # writes benchmarks/results/skinny_gemm.{json,md}
"""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import machine, markdown_table, write_results  # noqa: E402

from constrained_spec.kernels.bench import capture, replay_ms  # noqa: E402
from constrained_spec.kernels.skinny_gemm import default_config, rows_bucket, skinny_gemm  # noqa: E402

SHAPES = {  # name -> (N, K)
    "smol qkv": (960, 576), "smol o": (576, 576), "smol gate_up": (3072, 576), "smol down": (576, 1536),
    "smol logits": (49152, 576),
    "8b qkv": (6144, 4096), "8b down": (4096, 14336),
}


def configs(rows: int) -> list[tuple[int, int, bool, int]]:
    out = []
    if rows <= 8:
        out += [(bn, bk, False, w) for bn, bk, w in itertools.product((8, 16, 32), (64, 128, 256), (2, 4))
                if rows * bn * bk <= 16384]
    out += [(bn, bk, True, w) for bn, bk, w in itertools.product((16, 32, 64), (64, 128), (4,))]
    return out


def time_calls(fn, copies: int, budget_ms: float = 30.0) -> float:
    """Device us per call of fn(i) for i in range(copies), graphed."""
    for i in range(min(copies, 2)):
        fn(i)
    torch.cuda.synchronize()
    graph, _ = capture(lambda: [fn(i) for i in range(copies)])
    probe = replay_ms(graph, 3, warmup=2)
    iters = int(min(200, max(5, budget_ms / max(probe, 1e-3))))
    return replay_ms(graph, iters, warmup=3) * 1e3 / copies


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES))
    ap.add_argument("--name", default="skinny_gemm")
    args = ap.parse_args()
    dev, dtype = "cuda", torch.bfloat16
    records, rows_md = [], []
    for shape in args.shapes:
        N, K = SHAPES[shape]
        copies = max(2, min(256, -(-150 * 2**20 // (N * K * 2))))
        ws = torch.randn(copies, N, K, device=dev, dtype=dtype) * 0.02
        for M in args.rows:
            x = torch.randn(M, K, device=dev, dtype=dtype)
            ref = F.linear(x, ws[0]).float()
            cublas = time_calls(lambda i: F.linear(x, ws[i]), copies)
            timings = {}
            for cfg in configs(rows_bucket(M)):
                err = (skinny_gemm(x, ws[0], config=cfg).float() - ref).abs().max().item()
                scale = ref.abs().max().item()
                assert err <= 2e-2 * scale + 1e-3, (shape, M, cfg, err, scale)
                timings[cfg] = time_calls(lambda i, c=cfg: skinny_gemm(x, ws[i], config=c), copies)
            best = min(timings, key=timings.get)
            dflt = default_config(rows_bucket(M), N, K)
            dflt_us = timings.get(dflt) or time_calls(lambda i: skinny_gemm(x, ws[i]), copies)
            records.append(dict(shape=shape, N=N, K=K, rows=M, cublas_us=cublas, default_config=list(dflt),
                                default_us=dflt_us, best_config=list(best), best_us=timings[best],
                                all_us={str(c): t for c, t in timings.items()}))
            rows_md.append([shape, M, f"{cublas:.2f}", f"{dflt_us:.2f}", f"{timings[best]:.2f}", str(best),
                            f"{dflt_us / cublas:.2f}", f"{timings[best] / cublas:.2f}"])
            print(" | ".join(map(str, rows_md[-1])), flush=True)
        del ws
        torch.cuda.empty_cache()
    md = (f"# Skinny GEMM vs cuBLAS, {machine().get('gpu', '?')}\n\n"
          "bf16, device us per call (graphed, weights from HBM). best: (BLOCK_N, BLOCK_K, USE_DOT, num_warps).\n\n"
          + markdown_table(["shape", "rows", "cuBLAS us", "default us", "best us", "best config",
                            "default / cuBLAS", "best / cuBLAS"], rows_md))
    write_results(args.name, {"machine": machine(), "results": records}, md)


if __name__ == "__main__":
    main()
