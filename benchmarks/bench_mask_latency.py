"""Bounded mask latency: decode step times with one pathological JSON schema in a batch of normal
ones, grammar-mask budget off vs on, and without the pathological request for reference.

The pathological schema is a real one from schemas/jsonschemabench-dev.jsonl (default
Github_medium---o6198: keys with `pattern: ^[0-9a-zA-Z_-]{1,255}$`, whose masks xgrammar computes
at run time: 5-14 ms a fill on a 2-core CPU against ~0.02 ms for the normal schema). `--scan`
measures every schema of the file along its first valid instance and lists the slowest fills.

    python benchmarks/bench_mask_latency.py --device cpu     # SmolLM2, 7 + 1 requests
    python benchmarks/bench_mask_latency.py                  # CUDA: SmolLM2, 31 + 1 requests

Step time is the wall time between consecutive decode steps while the pathological request and at
least one normal request share the batch. Writes benchmarks/results/mask_latency_{cpu,cuda}.*.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from common import PERSON_SCHEMA, RESULTS, SCHEMAS, bar_plot, chat_prompts, machine, markdown_table, write_results

SLOW_PROMPT = "Describe an IoT device as JSON with name, tags (key/value pairs) and attributes."


def load_schema(schema_id: str) -> dict:
    for line in (SCHEMAS / "jsonschemabench-dev.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row["id"] == schema_id:
            return row
    raise SystemExit(f"no schema {schema_id!r} in jsonschemabench-dev.jsonl")


# -- the scan: which real schema has the slowest mask fills ------------------------------------------
def fill_times(grammar, tokenizer, row: dict, max_tokens: int = 200) -> list[float] | None:
    """Seconds per bitmask fill along the tokens of the schema's first valid instance."""
    import torch
    from constrained_spec.grammar import GrammarError, GrammarSpec
    try:
        matcher = grammar.matcher(grammar.compile(GrammarSpec.json_schema(row["schema"])))
    except GrammarError:
        return None  # refused or failed: not a schema we serve
    bitmask = torch.full((1, grammar.bitmask_width), -1, dtype=torch.int32)
    times = []
    for tok in tokenizer.encode(json.dumps(row["valid"][0]), add_special_tokens=False)[:max_tokens]:
        t0 = time.perf_counter()
        matcher.fill_bitmask(bitmask, 0)
        times.append(time.perf_counter() - t0)
        if not matcher.accept_token(tok):
            break
    return times


def scan(engine, top: int = 10) -> list[dict]:
    rows = []
    for line in (SCHEMAS / "jsonschemabench-dev.jsonl").read_text().splitlines():
        row = json.loads(line)
        times = fill_times(engine.grammar, engine.tokenizer, row) if row["valid"] else None
        if times:
            ms = sorted(1e3 * t for t in times)
            rows.append(dict(id=row["id"], fills=len(ms), mean_ms=statistics.mean(ms),
                             p90_ms=ms[int(0.9 * (len(ms) - 1))], max_ms=ms[-1]))
    rows.sort(key=lambda r: -r["mean_ms"])
    print(f"scanned {len(rows)} accepted schemas; slowest mean fill:")
    for r in rows[:top]:
        print(f"  {r['id']:40s} mean {r['mean_ms']:.3f} ms  p90 {r['p90_ms']:.3f}  max {r['max_ms']:.3f}")
    return rows[:top]


# -- one run ---------------------------------------------------------------------------------------
class StepLog:
    """Per step, from the engine thread: end time, mode, batch, grammar seconds and late rows so far."""

    def __init__(self, engine):
        self.rows: list[tuple] = []
        stats = engine.stats
        on_step = stats.on_step

        def record(batch, seconds):
            on_step(batch, seconds)
            self.rows.append((time.perf_counter(), batch.mode.value, {r.request_id for r in batch.requests},
                              stats.grammar_mask_seconds, stats.grammar_late_rows))
        stats.on_step = record


def slow_prompt(engine) -> list[int]:
    return engine.chat_prompt([{"role": "user", "content": SLOW_PROMPT}])


def run(engine, log: StepLog, prompts, grammars, max_tokens: int, slow_index: int | None) -> dict:
    from constrained_spec import SamplingParams
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    done_at: dict[str, float] = {}
    first = len(log.rows)
    t0 = time.perf_counter()
    reqs = []

    def on_output(out):
        if out.finished:
            done_at[out.request_id] = time.perf_counter()
    for p, g in zip(prompts, grammars):
        reqs.append(engine.add_request(p, params, g, on_output))
    while len(done_at) < len(reqs):
        time.sleep(0.005)
    wall = time.perf_counter() - t0
    steps = log.rows[first:]
    slow_id = reqs[slow_index].request_id if slow_index is not None else None
    normal = [r for i, r in enumerate(reqs) if i != slow_index]
    normal_ids = {r.request_id for r in normal}
    gaps, grammar_ms, late = [], [], 0
    for prev, cur in zip(steps, steps[1:]):
        ids = cur[2]
        mixed = (slow_id is None or slow_id in ids) and bool(ids & normal_ids)
        if cur[1] == "decode" and mixed:
            gaps.append(1e3 * (cur[0] - prev[0]))
            grammar_ms.append(1e3 * (cur[3] - prev[3]))
        late += cur[4] - prev[4]
    if not gaps:  # say what the steps were rather than fail on an empty percentile
        seen = [(mode, slow_id in ids, len(ids & normal_ids)) for _, mode, ids, *_ in steps]
        raise SystemExit(f"no decode step held the slow request beside a normal one; steps (mode, slow, normals): "
                         f"{seen[:40]}")
    normal_tokens = sum(len(r.output_ids) for r in normal)
    normal_wall = max(done_at[r.request_id] for r in normal) - t0
    return dict(
        steps=len(gaps), step_p50_ms=float(np.percentile(gaps, 50)), step_p99_ms=float(np.percentile(gaps, 99)),
        step_max_ms=max(gaps), grammar_ms_per_step=statistics.mean(grammar_ms), late_rows=late,
        tokens=sum(len(r.output_ids) for r in reqs), tok_s=sum(len(r.output_ids) for r in reqs) / wall,
        normal_tok_s=normal_tokens / normal_wall, wall_s=wall,
        slow_done_s=None if slow_id is None else done_at[slow_id] - t0,
        outputs=[list(r.output_ids) for r in reqs])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    ap.add_argument("--normal", type=int, default=None, help="normal requests (default: 31 on CUDA, 7 on CPU)")
    ap.add_argument("--max-tokens", type=int, default=None, help="default: 256 on CUDA, 96 on CPU")
    ap.add_argument("--budget-ms", type=float, default=None, help="default: 1 on CUDA, 2 on CPU")
    ap.add_argument("--schema-id", default="Github_medium---o6198")
    ap.add_argument("--scan", action="store_true", help="first measure the fills of every schema in the file")
    args = ap.parse_args()

    import torch
    from constrained_spec.engine import Engine
    from constrained_spec.grammar import GrammarSpec
    from constrained_spec.models import resolve_model_path

    t_start = time.perf_counter()
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = "cuda" if cuda else "cpu"
    n_normal = args.normal if args.normal is not None else (31 if cuda else 7)
    max_tokens = args.max_tokens or (256 if cuda else 96)
    budget_ms = args.budget_ms if args.budget_ms is not None else (1.0 if cuda else 2.0)
    model = resolve_model_path(args.model)
    slow_row = load_schema(args.schema_id)
    normal_spec, slow_spec = GrammarSpec.json_schema(PERSON_SCHEMA), GrammarSpec.json_schema(slow_row["schema"])

    def start_engine(budget: float | None):
        """An engine with the budget set at construction (the budgeted fill has its own pool), its grammars
        compiled outside the timed runs (the slow schema takes seconds) and warmed up."""
        engine = Engine(model=model, device=device, grammar_mask_budget_ms=budget)
        for spec in (normal_spec, slow_spec):
            engine.compile_grammar(spec)
        log = StepLog(engine)
        prompts = chat_prompts(engine.tokenizer, 2, json_task=True) + [slow_prompt(engine)]
        run(engine, log, prompts, [normal_spec] * 2 + [slow_spec], 8, 2)
        return engine, log

    engine, log = start_engine(None)
    scanned = scan(engine) if args.scan else None
    slow_fills = fill_times(engine.grammar, engine.tokenizer, slow_row)
    normal_fills = fill_times(engine.grammar, engine.tokenizer,
                              {"schema": PERSON_SCHEMA, "valid": [{"name": "Ann Lee", "age": 41, "email": "a@b.org",
                                                                   "skills": ["chess"], "active": True}]})
    normal_prompts = chat_prompts(engine.tokenizer, n_normal, json_task=True)
    prompts, grammars = normal_prompts + [slow_prompt(engine)], [normal_spec] * n_normal + [slow_spec]
    results = {}
    # the budgeted fill does not overlap the device's step as the unbudgeted one does: "normal only"
    # with the budget is what that costs traffic with no pathological schema
    configs = [("normal only", None, normal_prompts, [normal_spec] * n_normal, None),
               ("+ pathological, no budget", None, prompts, grammars, n_normal),
               (f"+ pathological, budget {budget_ms:g} ms", budget_ms, prompts, grammars, n_normal),
               (f"normal only, budget {budget_ms:g} ms", budget_ms, normal_prompts, [normal_spec] * n_normal, None)]
    for name, budget, ps, gs, slow_index in configs:
        if budget is not None and engine.masks.budget_s is None:
            engine.shutdown()
            engine, log = start_engine(budget)
        results[name] = run(engine, log, ps, gs, max_tokens, slow_index)
        r = results[name]
        print(f"{name}: {r['steps']} steps, p50 {r['step_p50_ms']:.2f} ms, p99 {r['step_p99_ms']:.2f} ms, "
              f"max {r['step_max_ms']:.2f} ms, grammar {r['grammar_ms_per_step']:.3f} ms/step, "
              f"late rows {r['late_rows']}, {r['tok_s']:.0f} tok/s", flush=True)
    engine.shutdown()

    off, on = results[configs[1][0]], results[configs[2][0]]
    same = sum(a == b for a, b in zip(off["outputs"], on["outputs"]))
    ms = lambda ts: sorted(1e3 * t for t in ts)
    fills = {"pathological": ms(slow_fills), "normal": ms(normal_fills)}
    payload = dict(machine=machine(), device=device, model=engine.model_name, normal_requests=n_normal,
                   max_tokens=max_tokens, budget_ms=budget_ms, schema_id=args.schema_id,
                   fill_ms={k: dict(mean=statistics.mean(v), p90=v[int(0.9 * (len(v) - 1))], max=v[-1])
                            for k, v in fills.items()},
                   outputs_identical_budget_on_off=f"{same}/{len(on['outputs'])}",
                   runs={k: {f: v for f, v in r.items() if f != "outputs"} for k, r in results.items()},
                   scan_slowest=scanned, seconds=time.perf_counter() - t_start)
    rows = [[name, r["steps"], r["step_p50_ms"], r["step_p99_ms"], r["step_max_ms"], r["grammar_ms_per_step"],
             r["late_rows"], r["tok_s"], r["normal_tok_s"]] for name, r in results.items()]
    f = payload["fill_ms"]
    md = (f"# Bounded mask latency ({device}, {engine.model_name}, {n_normal} person-schema requests + 1 "
          f"`{args.schema_id}`, greedy, max {max_tokens} tokens)\n\n"
          f"Mask fill along a valid instance: pathological mean {f['pathological']['mean']:.2f} ms, "
          f"max {f['pathological']['max']:.2f} ms; normal mean {f['normal']['mean']:.3f} ms. "
          f"Step times: decode steps while the pathological request shares the batch.\n\n"
          + markdown_table(["run", "steps", "p50 ms", "p99 ms", "max ms", "grammar ms/step", "late rows",
                            "tok/s", "normal tok/s"], rows)
          + f"\nOutputs identical with the budget on and off: {same}/{len(on['outputs'])}. "
            f"Benchmark wall time {payload['seconds']:.0f} s.\n")
    name = f"mask_latency_{device}"
    write_results(name, payload, md)
    bar_plot(RESULTS / f"{name}.png", ["p50", "p99", "max"],
             {k: [r["step_p50_ms"], r["step_p99_ms"], r["step_max_ms"]] for k, r in results.items()},
             "decode step time (ms)", f"Step time with a pathological schema in the batch ({device})")


if __name__ == "__main__":
    main()
