"""One step's grammar bitmask fill, by route: the engine's native pool against xgrammar's batch matcher.

States: every token position of valid JSON answers to the benchmark schema (PERSON_SCHEMA); `rows` of
them (cycled) make one batch. For each batch size, the median wall time of one fill of the batch by
xgrammar's `BatchGrammarMatcher.batch_fill_next_token_bitmask` with 1, 2, 4, 8 and 14 threads, by a
Python loop of per-row fills, and by the engine's native pool (persistent threads,
`grammar/native_fill.py`) with a thread per 2, 4, 8 or 16 rows. CPU only (needs the tokenizer, no
model weights): the figures are the host's, whatever the accelerator.

  python benchmarks/bench_mask_fill.py [--model-dir DIR]     # writes results/mask_fill.{json,md}
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from functools import partial

import xgrammar as xgr

from common import PERSON_SCHEMA, machine, markdown_table, write_results
from constrained_spec.grammar.native_fill import NativeFill

ANSWERS = [
    '{"name": "Alice Smith", "age": 34, "email": "alice@example.com", "skills": ["python", "hiking"], '
    '"active": true}',
    '{"name": "Bob", "age": 7, "email": "bob.b@mail.org", "skills": [], "active": false}',
    '{\n  "name": "Chen Wei",\n  "age": 52,\n  "email": "cw@corp.cn",\n  "skills": ["management", "go", '
    '"rust", "sql"],\n  "active": true\n}',
]
THREADS = (1, 2, 4, 8, 14)
NATIVE_ROWS_PER_THREAD = (2, 4, 8, 16)


class _Handle:
    """An xgrammar matcher as `NativeFill.call` takes it (what RequestMatcher carries)."""

    def __init__(self, m):
        self.ffi_handle = m._handle.__chandle__()
        self._m = m

    def fill_bitmask(self, bitmask, row):
        self._m.fill_next_token_bitmask(bitmask, row)


def states(tokenizer, vocab_size: int) -> list:
    """One matcher per token position of the answers (forked at that position)."""
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(PERSON_SCHEMA))
    out = []
    for text in ANSWERS:
        m = xgr.GrammarMatcher(compiled)
        for t in tokenizer.encode(text, add_special_tokens=False):
            out.append(m.fork())
            if not m.accept_token(t):
                raise ValueError(f"the schema refuses token {t} of {text!r}")
    return out


def timed(fn, repeats: int) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 32, 64, 128])
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--name", default="mask_fill")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from constrained_spec.models import resolve_model_path
    tok = AutoTokenizer.from_pretrained(args.model_dir or resolve_model_path(None))
    vocab = 49152 if len(tok) <= 49152 else len(tok)
    pool = states(tok, vocab)
    matchers = {t: xgr.BatchGrammarMatcher(t) for t in THREADS}
    native = NativeFill.create(max(THREADS) - 1)
    rows, records = [], []
    for B in args.batches:
        batch = [pool[i % len(pool)] for i in range(B)]
        bitmask = xgr.allocate_token_bitmask(B, vocab)
        rec = {"batch": B, "ms": {}}
        for t, bm in matchers.items():
            rec["ms"][f"{t} threads"] = timed(lambda: bm.batch_fill_next_token_bitmask(batch, bitmask), args.repeats)
        rec["ms"]["python loop"] = timed(lambda: [m.fill_next_token_bitmask(bitmask, i) for i, m in enumerate(batch)],
                                         args.repeats)
        if native is not None:  # the engine's persistent pool, a thread per k rows (the caller's included)
            wrapped = [_Handle(m) for m in batch]
            for k in NATIVE_ROWS_PER_THREAD:
                fill = native.prepare(wrapped, bitmask, list(range(B)))
                rec["ms"][f"native, 1 thread/{k} rows"] = timed(partial(fill.run, native.helpers_for(B, k)), args.repeats)
        records.append(rec)
        rows.append([B] + [f"{v:.3f}" for v in rec["ms"].values()])
        print(rows[-1], flush=True)
    md = (f"# Mask fill: native pool vs xgrammar's batch matcher ({len(pool)} states of real JSON answers)\n\n"
          f"{machine().get('cpu', '')}, {machine()['cpu_count']} CPUs; ms per fill of the batch (median)\n\n"
          + markdown_table(["batch"] + list(records[0]["ms"]), rows))
    write_results(args.name, {"machine": machine(), "states": len(pool), "records": records}, md)


if __name__ == "__main__":
    main()
