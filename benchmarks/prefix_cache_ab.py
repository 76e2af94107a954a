"""The prefix cache's cost where it cannot help, the engine alone (no HTTP): bench_serving's
`distinct` requests (JSON, each with its own ~250-token system prompt, 128 tokens) through
`Engine.generate` with the cache off and on, in turn, for a few rounds, on one fixed-size KV pool,
small enough by default that the cache fills it and evicts (as it does in a server after its first
seconds of such traffic).
`--workload json`: bench_serving's short JSON prompts instead, which share the chat template's start.
`--closed` sends them as `--clients` threads with one request each at a time (the served arrival
pattern) instead of all at once.

    python benchmarks/prefix_cache_ab.py --model DIR --requests 768 --rounds 3 [--closed]

Prints tok/s and the engine's step counts per arm.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_serving as bs  # noqa: E402
from common import PERSON_SCHEMA  # noqa: E402

from constrained_spec import Engine, SamplingParams  # noqa: E402
from constrained_spec.grammar import GrammarSpec  # noqa: E402


def prompts(tok, first: int, n: int, workload: str = "distinct") -> list[list[int]]:
    out = []
    for job in bs.make_jobs(workload, n, first):
        ids = tok.apply_chat_template(list(job.history) + [{"role": "user", "content": job.content}],
                                      add_generation_prompt=True, tokenize=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--requests", type=int, default=768)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--clients", type=int, default=64, help="running requests (and threads with --closed)")
    ap.add_argument("--kv-slots", type=int, default=100_000)
    ap.add_argument("--closed", action="store_true")
    ap.add_argument("--workload", default="distinct", choices=["distinct", "json"],
                    help="json: bench_serving's short JSON prompts (97%% of their tokens the chat template's cached start)")
    args = ap.parse_args()
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    grammar = GrammarSpec.json_schema(json.dumps(PERSON_SCHEMA))
    for rnd in range(args.rounds):
        for arm, disable in (("off", True), ("on", False)):
            eng = Engine(model=args.model, device=args.device, max_running_requests=args.clients,
                         kv_cache_slots=args.kv_slots, disable_prefix_cache=disable)
            try:
                tok = eng.tokenizer
                eng.generate(prompts(tok, 100_000, min(64, args.requests), args.workload), sp, grammar)  # warm-up
                work = prompts(tok, 1000 * rnd, args.requests, args.workload)
                steps0, decode0 = eng.stats.steps, eng.stats.decode_steps
                t0 = time.perf_counter()
                if args.closed:
                    def client(c: int) -> int:
                        return sum(len(o.token_ids) for p in work[c::args.clients] for o in eng.generate([p], sp, grammar))
                    with ThreadPoolExecutor(args.clients) as ex:
                        tokens = sum(ex.map(client, range(args.clients)))
                else:
                    tokens = sum(len(o.token_ids) for o in eng.generate(work, sp, grammar))
                dt = time.perf_counter() - t0
                print(f"round {rnd} cache {arm:3s} {tokens / dt:9.0f} tok/s  {dt:6.2f} s  steps "
                      f"{eng.stats.steps - steps0} (decode {eng.stats.decode_steps - decode0})", flush=True)
            finally:
                eng.shutdown()


if __name__ == "__main__":
    main()
