"""Same-machine A/B of Triton decode attention's split-count target (`target_programs` 128/256/512;
512 is the default). (Until 6998b66 it also A/B'd merging the splits inside the split launch against
the separate merge launch: results/decode_ab.md; the in-launch merge was slower and is removed.)

1. One layer's `decode_attention` call, SmolLM2-135M shapes (9 q / 3 kv heads, D=64, bf16), slot table
   8192 wide as in the engine, each sequence's `ctx` slots scattered at random over a pool of
   max(300k, B * ctx) slots, for B in 1, 8, 32, 64, 128 and ctx in 300, 1000, 4000. Per variant one CUDA
   graph holds `--calls` back-to-back calls, each on its own layer's K/V (as the 30 layers of a decode
   step read 30 caches; `--calls 1` captures a single call); device us per call = CUDA-event time over
   the replays / calls.
2. A whole SmolLM2-shaped random-weight decode forward (30 layers + logits, as the engine's decode
   graph) per variant, B = 1 and 32, slot table 8192 wide: device ms per graph replay.

Variants are measured in `--rounds` interleaved rounds (the order rotating) and each figure is the
median over rounds, so clock drift hits all of them alike. Outputs of the variants are checked
against each other.

  python benchmarks/bench_decode_ab.py                  # on a CUDA machine; writes
                                                        # benchmarks/results/decode_splits.{json,md}
  python benchmarks/bench_decode_ab.py --quick          # fewer shapes, a quick look
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import machine, markdown_table, write_results  # noqa: E402

from constrained_spec.kernels.bench import (capture, capture_decode_forward, decode_inputs, random_model, replay_ms,  # noqa: E402
                                            smollm2_135m_config)

H, KVH, D = 9, 3, 64
WIDTH = 8192
DEV = "cuda"


def vname(target: int) -> str:
    return f"target {target}"


def timed(graph: torch.cuda.CUDAGraph, budget_ms: float) -> float:
    """ms per replay, with as many replays as fit in about `budget_ms` (10 to 2000)."""
    probe = replay_ms(graph, 5, warmup=3)
    iters = int(min(2000, max(10, budget_ms / max(probe, 1e-4))))
    return replay_ms(graph, iters, warmup=5)


def measure(graphs: dict, rounds: int, budget_ms: float) -> dict:
    """{variant: [ms per replay per round]}: variants interleaved, the order rotating per round."""
    keys = list(graphs)
    times = {k: [] for k in keys}
    for r in range(rounds):
        order = keys[r % len(keys):] + keys[:r % len(keys)]
        for k in order:
            times[k].append(timed(graphs[k], budget_ms))
    return times


def bench_attention(batches, contexts, targets, calls: int, rounds: int, budget_ms: float) -> list[dict]:
    from constrained_spec.attention.triton_kernels import decode_attention

    dev, dtype = DEV, torch.bfloat16
    pool = max(300_000, max(batches) * max(contexts)) + 1
    k_cache = torch.randn(calls, pool, KVH, D, device=dev, dtype=dtype)
    v_cache = torch.randn(calls, pool, KVH, D, device=dev, dtype=dtype)
    print(f"attention: K/V pool {pool} slots x {calls} layers "
          f"({2 * k_cache.numel() * k_cache.element_size() / 2**30:.1f} GiB)", flush=True)
    records = []
    for B in batches:
        for ctx in contexts:
            gen = torch.Generator(device=dev).manual_seed(B * 10007 + ctx)
            table = torch.zeros(B, WIDTH, dtype=torch.int64, device=dev)
            table[:, :ctx] = (torch.randperm(pool - 1, device=dev, generator=gen)[:B * ctx] + 1).view(B, ctx)
            kv_lens = torch.full((B,), ctx, dtype=torch.int32, device=dev)
            q = torch.randn(B, H, D, device=dev, dtype=dtype)

            def step(target):
                return [decode_attention(q, k_cache[i], v_cache[i], table, kv_lens, D ** -0.5,
                                         target_programs=target) for i in range(calls)]

            graphs, outs = {}, {}
            for v in targets:
                step(v)  # compile
                torch.cuda.synchronize()
                graphs[v], out = capture(lambda v=v: step(v))
                graphs[v].replay()
                torch.cuda.synchronize()
                outs[v] = torch.stack(out).float()
            ref = outs[targets[0]]
            times = measure(graphs, rounds, budget_ms)
            row = {"B": B, "ctx": ctx, "variants": {}}
            for v in graphs:
                us = [t * 1e3 / calls for t in times[v]]
                row["variants"][vname(v)] = {
                    "target_programs": v, "num_splits": default_splits(B, v),
                    "us_per_call": statistics.median(us), "us_per_call_rounds": us,
                    "max_abs_diff_vs_first": (outs[v] - ref).abs().max().item()}
            records.append(row)
            print(_attention_line(row), flush=True)
            del graphs, outs
    return records


def _attention_line(row) -> str:
    cells = "  ".join(f"{k}:{x['us_per_call']:6.1f}us(s={x['num_splits']})" for k, x in row["variants"].items())
    return f"B={row['B']:3d} ctx={row['ctx']:4d}  {cells}"


def bench_model(batches, contexts, targets, rounds: int, budget_ms: float) -> list[dict]:
    from constrained_spec.attention.triton_backend import TritonAttention

    cfg = smollm2_135m_config()
    model = random_model(cfg, DEV)
    records = []
    for B in batches:
        for ctx in contexts:
            torch.manual_seed(B * 131 + ctx)
            kv, meta, ids, pos = decode_inputs(cfg, B, ctx, WIDTH, DEV, shuffle=True)
            kv.k.normal_()
            kv.v.normal_()
            graphs, outs = {}, {}
            with torch.inference_mode():
                for v in targets:
                    graphs[v], outs[v] = capture_decode_forward(model, ids, pos, kv, meta,
                                                                TritonAttention(target_programs=v))
                ref = outs[targets[0]]
                times = measure(graphs, rounds, budget_ms)
            row = {"B": B, "ctx": ctx, "variants": {}}
            for v in graphs:
                row["variants"][vname(v)] = {
                    "target_programs": v, "num_splits": default_splits(B, v),
                    "ms_per_forward": statistics.median(times[v]), "ms_per_forward_rounds": times[v],
                    "max_abs_diff_vs_first": (outs[v] - ref).abs().max().item()}
            records.append(row)
            cells = "  ".join(f"{k}:{x['ms_per_forward']:.3f}ms" for k, x in row["variants"].items())
            print(f"model B={B:3d} ctx={ctx:4d}  {cells}", flush=True)
            del graphs, outs
            torch.cuda.empty_cache()
    return records


def default_splits(B: int, target: int) -> int:
    from constrained_spec.attention.triton_kernels.decode import default_num_splits
    return default_num_splits(B, KVH, WIDTH, 32, target)


def tables(att, mdl, targets, calls: int, rounds: int) -> str:
    names = [vname(v) for v in targets]
    parts = [f"# Decode attention A/B: target_programs, {machine().get('gpu', '?')}\n",
             f"SmolLM2-135M shapes (H={H}, KVH={KVH}, D={D}), bf16, slot table {WIDTH} wide. Cells: median over "
             f"{rounds} interleaved rounds (s = splits).\n"]
    def variant_table(records, key: str, fmt: str) -> str:
        rows = []
        for r in records:
            x = r["variants"]
            best = min(x, key=lambda k: x[k][key])
            rows.append([r["B"], r["ctx"]] + [f"{x[n][key]:{fmt}} (s={x[n]['num_splits']})" for n in names]
                        + [best])
        return markdown_table(["B", "ctx"] + names + ["fastest"], rows)

    if att:
        parts.append(f"\n## One decode_attention call (device us; graph of {calls} calls over distinct layers)\n\n")
        parts.append(variant_table(att, "us_per_call", ".1f"))
    if mdl:
        parts.append("\n## Whole decode forward (30 layers + logits, random weights; device ms per graph replay)\n\n")
        parts.append(variant_table(mdl, "ms_per_forward", ".3f"))
    return "".join(parts)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64, 128])
    ap.add_argument("--contexts", type=int, nargs="+", default=[300, 1000, 4000])
    ap.add_argument("--targets", type=int, nargs="+", default=[128, 256, 512], help="target_programs values")
    ap.add_argument("--calls", type=int, default=10, help="decode_attention calls (layers) per captured graph")
    ap.add_argument("--model-batches", type=int, nargs="*", default=[1, 32])
    ap.add_argument("--model-contexts", type=int, nargs="*", default=[300, 1000, 4000])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--budget-ms", type=float, default=40.0, help="replay time per measurement")
    ap.add_argument("--quick", action="store_true", help="B 1/32/128, ctx 300/4000, model ctx 1000, 2 rounds")
    ap.add_argument("--name", default="decode_splits", help="results file stem under benchmarks/results")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_decode_ab.py times CUDA graphs of the Triton decode kernels and needs a CUDA GPU: "
                 "torch.cuda.is_available() is False here. (CPU correctness: pytest tests/test_triton_attention.py)")
    try:
        import triton  # noqa: F401
    except ImportError:
        sys.exit("bench_decode_ab.py needs triton (the decode kernels are Triton kernels)")
    if args.quick:
        args.batches, args.contexts, args.model_contexts, args.rounds = [1, 32, 128], [300, 4000], [1000], 2
    t0 = time.perf_counter()
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}", flush=True)
    att = bench_attention(args.batches, args.contexts, args.targets, args.calls, args.rounds, args.budget_ms)
    torch.cuda.empty_cache()  # the attention K/V pools are gone with bench_attention's frame
    mdl = (bench_model(args.model_batches, args.model_contexts, args.targets, args.rounds, args.budget_ms)
           if args.model_batches and args.model_contexts else [])
    md = tables(att, mdl, args.targets, args.calls, args.rounds)
    md += f"\n{time.perf_counter() - t0:.0f} s in all.\n"
    payload = {"machine": machine(), "triton": triton.__version__, "H": H, "KVH": KVH, "D": D, "table_width": WIDTH,
               "calls_per_graph": args.calls, "rounds": args.rounds, "budget_ms": args.budget_ms,
               "attention": att, "model": mdl}
    write_results(args.name, payload, md)


if __name__ == "__main__":
    main()
