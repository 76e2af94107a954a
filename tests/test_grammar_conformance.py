"""JSONSchemaBench dev conformance of the grammar backend (no model; real SmolLM2 tokenizer).

For each of the 400 schemas: compile with strict=True (OpenAI semantics: closed objects) or
refuse with GrammarError, and every NONSTRICT_EVERY-th one also with strict=False (plain JSON Schema
semantics); for accepted schemas, tokenize each labelled instance in two styles (compact
and json.dumps default) and feed the tokens + EOS to a matcher.

* an invalid instance accepted (all tokens legal and EOS legal at the end) FAILS the test
  (soundness), for both strict=False and strict=True compiles;
* a valid instance refused is a completeness miss: counted and reported, fails only above
  MAX_MISS_RATE;
* instances whose dataset label disagrees with `jsonschema` are skipped and counted.
Counts are printed (pytest -s); `python tests/test_grammar_conformance.py` prints the full report.
Under strict=True a valid instance with undeclared properties is refused by design, so the
completeness figure of that pass includes strict-semantics refusals.
"""
from __future__ import annotations

import collections
import json
import os
import sys
import time
import warnings

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "schemas", "jsonschemabench-dev.jsonl")
MAX_COMPILE_S = 10.0  # per schema, a 2-core machine
# strict=False compiles are ~100x slower in xgrammar 0.2.8 (every open object admits any JSON
# value); the full strict=False pass takes ~10 min on 2 busy cores, so the default test runs it
# on every NONSTRICT_EVERY-th schema (CONFORMANCE_FULL=1 runs all).
NONSTRICT_EVERY = 1 if os.environ.get("CONFORMANCE_FULL") else 16
MAX_MISS_RATE = 0.15  # completeness: valid (per jsonschema) instances refused, per style
MIN_ACCEPTED_FRACTION = 0.75


def _validator(schema):
    import jsonschema

    if not isinstance(schema, dict):
        schema = {}
    V = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return V(schema, format_checker=V.FORMAT_CHECKER)


def run_conformance(tokenizer, limit=None, nonstrict_every=None):
    from constrained_spec.grammar import GrammarBackend, GrammarError, GrammarSpec

    backend = GrammarBackend(tokenizer, vocab_size=len(tokenizer), max_threads=2, default_backend="xgrammar",
                             compile_timeout_s=MAX_COMPILE_S)
    eos = backend.tokenizer_info.stop_token_ids[0]
    rows = [json.loads(l) for l in open(DATA)]
    if limit:
        rows = rows[:limit]
    c = collections.Counter()
    refused = collections.Counter()
    refused_ids = collections.defaultdict(list)
    unsound, misses, compile_times = [], [], []
    enc_cache = {}

    def encode(s):
        ids = enc_cache.get(s)
        if ids is None:
            ids = enc_cache[s] = tokenizer.encode(s, add_special_tokens=False)
        return ids

    def accepts(m, s):
        m.reset()
        for t in encode(s):
            if not m.accept_token(t):
                return False
        return m.accept_token(eos) and m.is_terminated()

    t_start = time.time()
    nonstrict_every = nonstrict_every or NONSTRICT_EVERY
    for idx, row in enumerate(rows):
        schema = row["schema"]
        c["schemas"] += 1
        compiled = {}
        try:
            for strict in ((True, False) if idx % nonstrict_every == 0 else (True,)):
                t0 = time.perf_counter()
                compiled[strict] = backend.compile(GrammarSpec.json_schema(schema, strict=strict))
                compile_times.append((time.perf_counter() - t0, row["id"]))
        except GrammarError as e:
            if True not in compiled:
                c["refused"] += 1
                key = e.keyword or ("timeout" if "exceeded" in str(e) else "compile-error")
                refused[key] += 1
                refused_ids[key].append(f"{row['id']}: {e}")
                continue
            c["nonstrict_only_refused"] += 1  # strict compiled, nonstrict refused
        c["accepted"] += 1
        val = _validator(schema)
        matchers = {k: backend.matcher(v) for k, v in compiled.items()}
        for label in ("valid", "invalid"):
            for inst in row[label]:
                try:
                    truth = val.is_valid(inst)
                except Exception:  # noqa: BLE001
                    truth = None
                if truth is None or truth != (label == "valid"):
                    c["label_disagrees_with_jsonschema"] += 1
                    continue
                for style, s in (("compact", json.dumps(inst, separators=(",", ":"))),
                                 ("spaced", json.dumps(inst))):
                    ok = accepts(matchers[True], s)
                    if False in matchers:
                        ok_ns = accepts(matchers[False], s)
                        c[f"{label}_checked_nonstrict"] += 1
                        c[f"{label}_accepted_nonstrict"] += ok_ns
                        if label == "invalid" and ok_ns:
                            unsound.append((row["id"], "strict=False", s[:200]))
                    if label == "valid":
                        c["valid_checked"] += 1
                        if ok:
                            c["valid_accepted"] += 1
                        else:
                            c["valid_refused"] += 1
                            misses.append((row["id"], style, s[:160]))
                    else:
                        c["invalid_checked"] += 1
                        if ok:
                            unsound.append((row["id"], "strict=True", s[:200]))
                        else:
                            c["invalid_rejected"] += 1
    c_time = max(compile_times) if compile_times else (0.0, None)
    report = {
        "counts": dict(c),
        "accepted_fraction": round(c["accepted"] / max(c["schemas"], 1), 4),
        "refused_by_keyword": dict(refused.most_common()),
        "refused_examples": {k: v[:3] for k, v in refused_ids.items()},
        "completeness_miss_rate": round(c["valid_refused"] / max(c["valid_checked"], 1), 4),
        "compile_seconds_max": round(c_time[0], 3),
        "compile_seconds_max_schema": c_time[1],
        "compile_seconds_total": round(sum(t for t, _ in compile_times), 3),
        "unsound": unsound,
        "misses_sample": misses[:40],
        "wall_seconds": round(time.time() - t_start, 2),
        "backend_stats": backend.stats,
    }
    backend.close()
    return report


def test_jsonschemabench_dev_conformance(tokenizer):
    rep = run_conformance(tokenizer)
    print("\n=== grammar conformance (JSONSchemaBench dev, 400 schemas) ===")
    print(json.dumps({k: v for k, v in rep.items() if k not in ("misses_sample",)}, indent=1))
    print("completeness misses (sample):")
    for m in rep["misses_sample"][:15]:
        print("  ", m)
    assert not rep["unsound"], f"invalid instances accepted: {rep['unsound'][:10]}"
    assert rep["compile_seconds_max"] < MAX_COMPILE_S
    assert rep["completeness_miss_rate"] <= MAX_MISS_RATE
    assert rep["accepted_fraction"] >= MIN_ACCEPTED_FRACTION


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    warnings.simplefilter("ignore")
    from constrained_spec.models import load_tokenizer

    rep = run_conformance(load_tokenizer(), limit=int(sys.argv[1]) if len(sys.argv) > 1 else None)
    print(json.dumps(rep, indent=1))
