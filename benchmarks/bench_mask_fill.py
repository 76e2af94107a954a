"""How fast can one step's grammar bitmask rows be filled on this machine's CPU, and by which route?

B matchers of a JSON schema (compiled as the engine does: bounded whitespace) are walked to random
legal states (uniformly random allowed tokens, or the lowest allowed id: whitespace and punctuation,
where a weak model tends to wander), then one step's rows are filled repeatedly by: a loop on this thread, xgrammar's
BatchGrammarMatcher at several thread counts, and a Python thread pool (xgrammar's fill releases
the GIL). Prints ms per step for each route and batch size.
  python benchmarks/bench_mask_fill.py --model-dir DIR [--batches 8,32,64]
"""
from __future__ import annotations

import argparse
import json
import random
import time
from concurrent.futures import ThreadPoolExecutor

import torch
import xgrammar as xgr

from common import PERSON_SCHEMA


def walk(matchers, bitmask, vocab, rng, steps, lowest: bool):
    for i, m in enumerate(matchers):
        for _ in range(rng.randint(1, steps)):
            m.fill_next_token_bitmask(bitmask, i)
            bits = (bitmask[i].view(-1, 1) >> torch.arange(32, dtype=torch.int32)) & 1
            allowed = bits.flatten()[:vocab].nonzero().flatten().tolist()
            if not allowed:
                break
            tok = allowed[0] if lowest else rng.choice(allowed)
            if not m.accept_token(tok) or m.is_terminated():
                break


def timed(fn, reps=30) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return 1000 * (time.perf_counter() - t0) / reps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--batches", default="1,8,32,64")
    args = ap.parse_args()
    from constrained_spec.models import resolve_model_path
    from constrained_spec.models.loader import load_folder_tokenizer
    tok = load_folder_tokenizer(args.model_dir or resolve_model_path(None))
    from constrained_spec.engine import EngineConfig
    from constrained_spec.grammar import GrammarBackend, GrammarSpec
    backend = GrammarBackend(tok, len(tok), max_whitespace_cnt=EngineConfig().grammar_max_whitespace)
    compiled = backend.compile(GrammarSpec.json_schema(PERSON_SCHEMA)).xgr_compiled
    vocab = backend.vocab_size
    rng = random.Random(0)
    results = []
    for bs, lowest in [(int(b), lowest) for b in args.batches.split(",") for lowest in (False, True)]:
        matchers = [xgr.GrammarMatcher(compiled) for _ in range(bs)]
        bitmask = xgr.allocate_token_bitmask(bs, vocab)
        walk(matchers, bitmask, vocab, rng, 40, lowest)
        rows = list(range(bs))
        rec = {"batch": bs, "walk": "lowest id" if lowest else "random", "loop": timed(lambda: [m.fill_next_token_bitmask(bitmask, i) for i, m in enumerate(matchers)])}
        for threads in (1, 2, 4, 8, 15):
            batch = xgr.BatchGrammarMatcher(max_threads=threads)
            rec[f"batch_t{threads}"] = timed(lambda: batch.batch_fill_next_token_bitmask(matchers, bitmask, rows))
        for threads in (4, 8):
            with ThreadPoolExecutor(threads) as pool:
                rec[f"pool_t{threads}"] = timed(lambda: list(pool.map(
                    lambda i: matchers[i].fill_next_token_bitmask(bitmask, i), rows)))
        results.append({k: round(v, 3) if isinstance(v, float) else v for k, v in rec.items()})
        print(json.dumps(results[-1]), flush=True)


if __name__ == "__main__":
    main()
