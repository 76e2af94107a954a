"""The productivity check (`GrammarBackend._refuse_if_unproductive`: does the grammar accept a finite
string?) over every schema under schemas/, as the backend runs it, gates included: what it refuses
(it should refuse none of them), how many have dead branches (alternatives the root reaches that
derive no finite string: served without them), and what it costs on the xgrammar path (after the
normalizer, which that path runs anyway) and on llguidance's (normalizing first, as a schema's first
request does). With --compile, each schema it checks on the xgrammar path is also compiled (without
its dead branches where it has some, as served), for comparison.
SmolLM2's tokenizer, CPU; long-lived objects frozen as in the engine process (`long_lived.py`).

    python benchmarks/bench_productivity_check.py [--compile]
"""
from __future__ import annotations

import argparse
import gc
import json
import time

from common import SCHEMAS

from constrained_spec.grammar import GrammarBackend, GrammarError, GrammarSpec
from constrained_spec.grammar.backend import _recursive_schema
from constrained_spec.models import load_tokenizer

FILES = ["jsonschemabench-dev.jsonl", "handwritten/handwritten.jsonl", "conformance/cases.jsonl",
         "conformance/draft2020-12.jsonl"]


def summary(ts: list) -> str:
    if not ts:
        return "none"
    ts = sorted(ts)
    return (f"n={len(ts)} median {1e3 * ts[len(ts) // 2]:.2f} ms, p90 {1e3 * ts[int(0.9 * len(ts))]:.2f} ms, "
            f"max {1e3 * ts[-1]:.1f} ms, total {1e3 * sum(ts):.0f} ms")


def timed(call) -> tuple:
    """(seconds, the GrammarError it raised or None)."""
    t = time.perf_counter()
    try:
        call()
    except GrammarError as e:
        return time.perf_counter() - t, e
    return time.perf_counter() - t, None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--compile", action="store_true", help="also compile what the xgrammar path checks")
    args = ap.parse_args()
    b = GrammarBackend(load_tokenizer(), 49152, default_backend="xgrammar", max_whitespace_cnt=16)
    gc.collect()
    gc.freeze()
    b.compile(GrammarSpec.json_schema({"type": "object", "properties": {"a": {"$ref": "#"}}}))  # warm up
    try:
        for name in FILES:
            rows = [json.loads(line) for line in (SCHEMAS / name).read_text().splitlines() if line.strip()]
            xgr_path, llg_path, compiles, refused, pruned = [], [], [], [], []
            for row in rows:
                try:
                    spec = GrammarSpec.json_schema(row["schema"])
                except GrammarError:
                    continue
                label = row.get("id") or row.get("name") or row.get("description")
                try:
                    _, prepared = b._normalize(spec, count=False)
                except GrammarError:
                    prepared = None
                # xgrammar's path: the gate of `_build_xgrammar_checked`, then the check
                if prepared is not None and ('"pattern' in prepared or _recursive_schema(spec)):
                    out = []
                    seconds, error = timed(lambda: out.append(b._refuse_if_unproductive(spec, prepared)))
                    xgr_path.append(seconds)
                    if error is not None:
                        refused.append((label, "xgrammar", str(error)))
                    elif out[0] is not None:
                        pruned.append(label)
                    if args.compile:
                        compiles.append(timed(lambda: b.xgrammar.compile(spec, prepared, out and out[0]))[0])
                # llguidance's path: a recursive schema, normalized first
                if _recursive_schema(spec):
                    b._front = type(b._front)(b._front.max_count, b._front.max_bytes, b._front._size_of)
                    seconds, error = timed(lambda: b._refuse_if_unproductive(spec))
                    llg_path.append(seconds)
                    if error is not None:
                        refused.append((label, "llguidance", str(error)))
            print(f"{name}: {len(rows)} schemas, {len(refused)} refusals by the check {refused[:5]}, "
                  f"{len(pruned)} with dead branches {pruned[:5]}")
            print(f"  xgrammar path, checked: {summary(xgr_path)}")
            if args.compile:
                print(f"    their xgrammar compiles: {summary(compiles)}")
            print(f"  llguidance path, checked (recursive): {summary(llg_path)}")
    finally:
        b.close()


if __name__ == "__main__":
    main()
