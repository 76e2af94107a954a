"""The prefix cache's host cost where it cannot help, without the model: the engine thread's
scheduling, step planning and KV release replayed for prompts that share only their first tokens
(as bench_serving's `distinct` workload), with the cache on and off in turn; or, with
`--workload multi-turn`, where it helps the device (conversations growing turn by turn), what it
costs the host.

No forward runs: each step is scheduled (`Scheduler.schedule`), planned (`ModelRunner.plan`: KV
slots, inputs) and its requests given a token; a request that reaches its answer length is removed
(`Scheduler.remove`: with the cache, its context goes into the tree) and a new one queued, so
`--clients` requests are always in flight. A graphed prefill carries the cache's table writes on a
GPU, so they are taken and dropped here (their upload is the device's). Times are wall time a step
on this thread, the median of `--rounds` runs per arm, and the cache's calls a step (cache on).

    python benchmarks/prefix_cache_host.py --model DIR

The model folder only sizes the runner (any of the engine's models; nothing is computed with it).
Prints a Markdown table.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import timed_calls  # noqa: E402
from constrained_spec.attention.base import ForwardMode  # noqa: E402
from constrained_spec.engine.config import EngineConfig  # noqa: E402
from constrained_spec.engine.model_runner import ModelRunner  # noqa: E402
from constrained_spec.engine.prefix_cache import PrefixCache  # noqa: E402
from constrained_spec.engine.radix_cache import RadixCache  # noqa: E402
from constrained_spec.engine.request import FinishReason, Request  # noqa: E402
from constrained_spec.engine.scheduler import Scheduler  # noqa: E402
from constrained_spec.models import load_model  # noqa: E402
from constrained_spec.sampling_params import SamplingParams  # noqa: E402

TURNS, TURN_ANSWER, TURN_ASK = 4, 60, 12  # multi-turn: turns a conversation, tokens a turn adds

# (class, method): the cache's own calls, timed in the cache-on arm
TIMED = [(PrefixCache, "admit"), (PrefixCache, "release"), (PrefixCache, "cache_prompts"),
         (PrefixCache, "take_writes"), (PrefixCache, "place_prefix"), (RadixCache, "evict")]


def replay(loaded, cache: bool, args, seed: int = 0) -> tuple[float, int, float]:
    """us a step over `args.requests` finished requests, the number of steps, and the share of
    prompt tokens the cache served (0 without it)."""
    config = EngineConfig(device="cpu", kv_cache_slots=args.pool, max_running_requests=args.clients,
                          max_prefill_tokens=8192, disable_prefix_cache=not cache)
    runner = ModelRunner(loaded, config, torch.device("cpu"), torch.float32)
    sched = Scheduler(runner, config)
    rng = np.random.default_rng(seed)
    vocab = loaded.config.vocab_size
    shared = rng.integers(1, vocab, args.shared).tolist()
    limits: dict[int, int] = {}
    conversation: dict[int, tuple[list[int], int]] = {}  # multi-turn: id(req) -> (its prompt, its turn)
    tokens = lambda n: rng.integers(1, vocab, n).tolist()

    def queue_one(before: tuple[list[int], int] | None = None) -> None:
        if args.workload == "distinct" or before is None or before[1] + 1 == TURNS:
            prompt, turn = shared + tokens(args.prompt - args.shared), 0
        else:  # the next turn: the prompt so far, an answer (not the one decoded: as bench_serving's), a question
            prompt, turn = before[0] + tokens(TURN_ANSWER) + tokens(TURN_ASK), before[1] + 1
        req = Request(prompt, SamplingParams(max_tokens=args.max_tokens), lambda out: None)
        limits[id(req)] = int(rng.integers(args.max_tokens // 2, args.max_tokens + 1))
        conversation[id(req)] = (prompt, turn)
        sched.add(req)

    for _ in range(args.clients):
        queue_one()
    done = steps = 0
    token = 1
    t0 = time.perf_counter()
    while done < args.requests:
        batch = sched.schedule(can_retract=True)
        runner.plan(batch)
        if batch.mode is ForwardMode.EXTEND and runner.prefix_cache is not None:
            runner.prefix_cache.take_writes()
        steps += 1
        ended = []
        for req in batch.requests:
            if req.needs_extend:  # a prompt chunk: no token yet
                continue
            token = token % (vocab - 1) + 1
            req.output_ids.append(token)
            if len(req.output_ids) >= limits[id(req)]:
                ended.append(req)
        for req in ended:
            req.finish_reason = FinishReason.LENGTH  # finished, not retracted (`PrefixCache.release`)
            sched.remove(req)
            del limits[id(req)]
            done += 1
            queue_one(conversation.pop(id(req)))
    pc = runner.prefix_cache
    share = pc.hit_tokens / pc.lookup_tokens if pc is not None and pc.lookup_tokens else 0.0
    return 1e6 * (time.perf_counter() - t0) / steps, steps, share



def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a model folder (sizes the runner only)")
    ap.add_argument("--requests", type=int, default=3000, help="finished requests a run")
    ap.add_argument("--rounds", type=int, default=3, help="runs per arm, in turn")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--workload", choices=["distinct", "multi-turn"], default="distinct",
                    help="distinct: prompts sharing only their first tokens; multi-turn: conversations of "
                         f"{TURNS} turns, each turn's prompt the last one's, an answer and a question")
    ap.add_argument("--prompt", type=int, default=258, help="prompt tokens (multi-turn: a conversation's first)")
    ap.add_argument("--shared", type=int, default=8, help="leading prompt tokens every request shares")
    ap.add_argument("--max-tokens", type=int, default=128, help="answers of max_tokens/2 to max_tokens")
    ap.add_argument("--pool", type=int, default=200_000, help="KV slots (the tree fills it, then evicts)")
    args = ap.parse_args()
    loaded = load_model(args.model, dtype=torch.float32, device="cpu")
    us = {True: [], False: []}
    for r in range(args.rounds):
        for cache in (True, False) if r % 2 == 0 else (False, True):
            us[cache].append(replay(loaded, cache, args, seed=r)[0])
    with timed_calls(TIMED) as totals:
        _, steps, share = replay(loaded, True, args, seed=args.rounds)
    on, off = statistics.median(us[True]), statistics.median(us[False])
    print(f"host us a step (median of {args.rounds}): cache on {on:.1f}, off {off:.1f}, "
          f"the cache's {on - off:.1f} ({', '.join(f'{a:.1f}/{b:.1f}' for a, b in zip(us[True], us[False]))}); "
          f"{args.workload}, {share:.2f} of prompt tokens cached")
    print("\n| cache call | us a call | calls a step | us a step |\n|---|---|---|---|")
    for name, (seconds, calls) in sorted(totals.items(), key=lambda kv: -kv[1][0]):
        if calls:
            print(f"| {name} | {1e6 * seconds / calls:.1f} | {calls / steps:.2f} | {1e6 * seconds / steps:.1f} |")


if __name__ == "__main__":
    main()
