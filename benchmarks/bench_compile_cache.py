"""Disk cache of compiled grammars: a cold compile against a warm restart (a new GrammarBackend on
the same cache folder), per schema, for a few development schemas (the slowest compiles of
schemas/jsonschemabench-dev.jsonl on the dev VM and a few typical ones). SmolLM2's tokenizer, CPU.

    python benchmarks/bench_compile_cache.py            # the default selection
    python benchmarks/bench_compile_cache.py --ids Github_easy---o9896 Glaiveai2K---calculate_gpa_98fdff57

The cache folder is a temporary one. Each backend uses the engine's options (max_whitespace 16).
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time

from common import SCHEMAS

from constrained_spec.grammar import GrammarBackend, GrammarSpec
from constrained_spec.models import load_tokenizer

DEFAULT_IDS = ["Github_easy---o9896", "Github_medium---o5028", "Github_medium---o65677", "Github_easy---o9858",
               "Github_hard---o21424", "Github_hard---o9843",
               "Glaiveai2K---calculate_gpa_98fdff57"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ids", nargs="*", default=DEFAULT_IDS)
    args = ap.parse_args()
    rows = {json.loads(line)["id"]: json.loads(line)["schema"]
            for line in (SCHEMAS / "jsonschemabench-dev.jsonl").read_text().splitlines()}
    specs = [(i, GrammarSpec.json_schema(rows[i])) for i in args.ids]
    tok = load_tokenizer()
    with tempfile.TemporaryDirectory() as d:
        times = {}
        for phase in ("cold", "warm"):
            b = GrammarBackend(tok, 49152, max_whitespace_cnt=16, cache_dir=d, default_backend="xgrammar")
            for i, s in specs:
                t0 = time.perf_counter()
                c = b.compile(s, timeout_s=600)
                times.setdefault(i, {})[phase] = (time.perf_counter() - t0, c.from_disk)
                time.sleep(0.05)
                while b.stats["disk_saving"]:  # one at a time: saving runs after the result
                    time.sleep(0.02)
            st = b.stats
            print(f"{phase}: compiles {st['compile_count']}, disk hits {st['disk_hits']}, "
                  f"disk writes {st['disk_writes']}, {b.compile_workers} workers")
            b.close()
    print(f"{'schema':40s} {'cold s':>8s} {'warm s':>8s}  warm from disk")
    for i, t in times.items():
        print(f"{i:40s} {t['cold'][0]:8.3f} {t['warm'][0]:8.3f}  {t['warm'][1]}")


if __name__ == "__main__":
    main()
