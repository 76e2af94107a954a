"""Same-engine A/B of the mask fill's thread count on real weights: the engine's rule (one thread
per 8 rows, up to all cores but two) against fixed thread counts (`--fixed`). SmolLM2-135M bf16,
CUDA graphs + overlap, greedy JSON (PERSON_SCHEMA) at each batch size, and plain decoding for as
many tokens per request as its JSON answer (the batch drains alike, so json / plain is the
grammar's cost). The rules alternate over `--rounds` rounds; medians.

  python benchmarks/bench_fill_policy.py      # CUDA machine; writes results/fill_policy_ab.{json,md}
"""
from __future__ import annotations

import argparse
import os
import statistics

from bench_gpu import measure
from common import PERSON_SCHEMA, chat_prompts, machine, markdown_table, write_results


def per_eight_rows(max_threads: int):
    """The engine's rule (`MaskFiller._batch_matcher`): one thread per 8 rows, up to `max_threads`."""
    return lambda rows: max(1, min(max_threads, rows // 8))


def fixed(threads: int):
    return lambda rows: threads


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[32, 64, 128])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--fixed", type=int, nargs="*", default=[1, 4, 14], help="fixed thread counts")
    ap.add_argument("--name", default="fill_policy_ab")
    args = ap.parse_args()
    from constrained_spec import SamplingParams
    from constrained_spec.engine import Engine
    from constrained_spec.grammar import GrammarSpec

    engine = Engine(device="cuda")
    import xgrammar as xgr
    matchers: dict[int, xgr.BatchGrammarMatcher] = {}

    def use(rule):  # the engine's batch fills on rule(rows) threads
        def batch_matcher(rows: int) -> xgr.BatchGrammarMatcher:
            n = rule(rows)
            if n not in matchers:
                matchers[n] = xgr.BatchGrammarMatcher(max_threads=n)
            return matchers[n]
        engine.masks._batch_matcher = batch_matcher
    max_threads = engine.config.grammar_mask_threads
    policies = {"per 8 rows (engine)": per_eight_rows(max_threads)}
    policies.update({f"{t} threads": fixed(t) for t in args.fixed})
    spec = GrammarSpec.json_schema(PERSON_SCHEMA)
    greedy = SamplingParams(max_tokens=128, temperature=0)
    records, rows = [], []
    for B in args.batches:
        prompts = chat_prompts(engine.tokenizer, B, json_task=True)
        measure(engine, prompts, SamplingParams(max_tokens=8, temperature=0), spec)  # warm-up
        lengths = measure(engine, prompts, greedy, spec)["lengths"]
        plain_params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths]
        tok_s = {name: [] for name in policies}
        tok_s["plain (json lengths)"] = []
        names = list(policies)
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                use(policies[name])
                tok_s[name].append(measure(engine, prompts, greedy, spec)["tok_s"])
            tok_s["plain (json lengths)"].append(measure(engine, prompts, plain_params, None)["tok_s"])
        use(policies["per 8 rows (engine)"])
        med = {k: statistics.median(v) for k, v in tok_s.items()}
        plain = med["plain (json lengths)"]
        rec = {"batch": B, "tok_s": tok_s, "median_tok_s": med, "threads": {n: p(B) for n, p in policies.items()}}
        records.append(rec)
        rows.append([B, round(plain)] + [f"{round(med[n])} ({med[n] / plain:.2f}; {policies[n](B)} threads)" for n in names])
        print(rows[-1], flush=True)
    engine.shutdown()
    md = ("# Mask-fill threads, A/B on one engine (SmolLM2-135M bf16, real weights, greedy JSON)\n\n"
          f"{machine().get('gpu', '')}, {os.cpu_count()} CPUs; tokens/s, median of {args.rounds} alternating rounds\n\n"
          + "JSON tokens/s per thread rule (ratio to plain at the JSON lengths)\n\n"
          + markdown_table(["batch", "plain (json lengths)"] + [f"json, {n}" for n in policies], rows))
    write_results(args.name, {"machine": machine(), "records": records}, md)


if __name__ == "__main__":
    main()
