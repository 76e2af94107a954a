"""What bounds a CPU decode step: SmolLM2-135M's projection GEMMs alone, per step.

Every decode step multiplies each layer's fused q/k/v, o, fused gate/up and down projections and the
logits head by as many rows as the batch has requests (plus draft tokens when speculating). This
times exactly those matmuls (`F.linear`, as both our forward and `transformers` call them; random
weights of the real shapes, 30 layers streamed from memory as in a real step, not one layer cached)
at 1, 8 and 16 rows, in float32 and bfloat16, MKL's packed float32 GEMM for comparison, and the
engine's bfloat16 paths (`models/cpu_linear.py`: our AMX kernel, or oneDNN's prepacked weights). The
ceiling on tokens/s at batch B is B / (GEMM time of a B-row step); results/cpu_vs_hf.json gives
what both engines reach.

  python benchmarks/bench_cpu_gemm.py        # writes results/cpu_gemm_floor.{json,md}
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from common import RESULTS, machine, markdown_table, write_results

HIDDEN, INTER, KV, VOCAB, LAYERS = 576, 1536, 192, 49152, 30


def shapes() -> list[tuple[int, int]]:
    per_layer = [(HIDDEN + 2 * KV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER)]
    return per_layer * LAYERS + [(VOCAB, HIDDEN)]


def step_ms(dtype: torch.dtype, rows: int, packed: str | None, repeats: int) -> float:
    torch.manual_seed(0)
    weights = [torch.randn(o, i, dtype=dtype) * 0.02 for o, i in shapes()]
    inputs = {i: torch.randn(rows, i, dtype=dtype) for i in (HIDDEN, INTER)}
    if packed in ("amx", "onednn"):  # what the engine runs (models/cpu_linear.py)
        from constrained_spec.kernels import cpu_native
        from constrained_spec.models.cpu_linear import PackedLinear
        if packed == "amx" and not cpu_native.amx_linear_available():
            raise RuntimeError("no AMX-BF16 here")
        layers = [PackedLinear(w, None, amx=packed == "amx") for w in weights]

        def step():
            for w, layer in zip(weights, layers):
                layer(inputs[w.shape[1]])
    elif packed == "mkl":
        packs = [torch.ops.mkl._mkl_reorder_linear_weight(w, rows) for w in weights]

        def step():
            for w, p in zip(weights, packs):
                torch.ops.mkl._mkl_linear(inputs[w.shape[1]], p, w, None, rows)
    else:
        def step():
            for w in weights:
                torch.nn.functional.linear(inputs[w.shape[1]], w)
    step()
    step()
    t0 = time.perf_counter()
    for _ in range(repeats):
        step()
    return 1000 * (time.perf_counter() - t0) / repeats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,8,16")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    hf = {}
    try:
        for r in json.loads((RESULTS / "cpu_vs_hf.json").read_text())["results"]:
            hf[r["dtype"], r["batch"], r["workload"]] = r["hf_tok_s"]
    except (OSError, KeyError, ValueError):
        pass
    hf_fp32_plain = hf.get(("float32", 8, "plain"))
    records, rows_md = [], []
    for dtype_name, dtype, packed in (("float32", torch.float32, None), ("float32, MKL packed", torch.float32, "mkl"),
                                      ("bfloat16", torch.bfloat16, None),
                                      ("bfloat16, oneDNN prepacked", torch.bfloat16, "onednn"),
                                      ("bfloat16, AMX kernel (the engine's where AMX is)", torch.bfloat16, "amx")):
        for rows in [int(r) for r in args.rows.split(",")]:
            try:
                ms = step_ms(dtype, rows, packed, args.repeats)
            except (RuntimeError, AttributeError) as e:  # no MKL in this torch build
                print(dtype_name, rows, "unavailable:", e)
                continue
            ceiling = 1000 * rows / ms
            rec = dict(dtype=dtype_name, rows=rows, gemm_ms_per_step=ms, ceiling_tok_s=ceiling,
                       ceiling_vs_hf_fp32_b8_plain=ceiling / hf_fp32_plain if hf_fp32_plain and rows == 8 else None)
            records.append(rec)
            rows_md.append([dtype_name, rows, f"{ms:.1f}", f"{ceiling:.0f}",
                            "-" if rec["ceiling_vs_hf_fp32_b8_plain"] is None else f"{rec['ceiling_vs_hf_fp32_b8_plain']:.2f}"])
            print(rows_md[-1], flush=True)
    m = machine()
    md = ("# CPU decode step: the projection GEMMs alone (SmolLM2-135M shapes)\n\n"
          f"{m.get('cpu', '')}, {m['cpu_count']} CPUs, torch {torch.__version__} ({torch.get_num_threads()} threads). "
          "ms per step for the 121 matmuls of one decode step at that many rows; ceiling = rows / that time "
          f"(no attention, norms or sampling); vs HF: against transformers' float32 batch-8 plain rate "
          f"({hf_fp32_plain} tok/s, results/cpu_vs_hf.md).\n\n"
          + markdown_table(["weights", "rows", "GEMM ms/step", "ceiling tok/s", "ceiling / HF fp32 b8"], rows_md))
    write_results("cpu_gemm_floor", {"machine": m, "records": records}, md)


if __name__ == "__main__":
    main()
