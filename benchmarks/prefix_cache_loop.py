"""The prefix cache's cost to the whole engine loop where it cannot help, on the CPU, without the
model's work: two engines in this process, cache on and off, run bench_serving's `distinct`
requests in turn, with the forward returning zeros and sampling a fixed token, so that a step costs
the engine thread its host work alone (scheduling, planning, the step's tensors, processing and
releasing requests). `prefix_cache_host.py` replays only the scheduler's and the runner's share,
in a tight loop; the loop here also runs what the cache changes elsewhere (on the CPU, an eager
prefill's upload of its prefixes' table entries) and runs the cache's code between the rest of a
step's work, as a server does.

`--clients` requests in flight; a client sends its next one `--delay-ms` after its answer (a
served client's round trip), so a prefill holds one or two requests, as in a server under load.
Reported: the engine thread's CPU time a step (its own clock: other threads' work on the same
cores is not counted), per paired round (the arms alternate which goes first) and their medians.

    python benchmarks/prefix_cache_loop.py --model DIR

Any of the engine's models will do (only its shapes are used). Greedy, no grammar, answers of
max_tokens/2 to max_tokens tokens (`ignore_eos`).
"""
from __future__ import annotations

import argparse
import contextlib
import queue
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_serving as bs  # noqa: E402

from constrained_spec import Engine, SamplingParams  # noqa: E402
from constrained_spec.engine import model_runner  # noqa: E402

TOKEN = 100  # every sampled token (any id but a stop token)


@contextlib.contextmanager
def model_work_stubbed(engines: list[Engine], max_requests: int):
    """While inside, the forward and the sampling of these engines return constants."""
    mcfg = engines[0].runner.mcfg
    hidden = torch.zeros(1 << 14, mcfg.hidden_size)
    logits = torch.zeros(max_requests, mcfg.vocab_size)
    tokens = torch.full((max_requests,), TOKEN, dtype=torch.int64)
    saved = model_runner.ModelRunner.run_model, model_runner.sample
    model_runner.ModelRunner.run_model = lambda self, ids, positions, meta: hidden[:ids.shape[0]]
    model_runner.sample = lambda lg, sb: tokens[:lg.shape[0]]
    for engine in engines:
        engine.runner.model.compute_logits = lambda h: logits[:h.shape[0]]
    try:
        yield
    finally:
        model_runner.ModelRunner.run_model, model_runner.sample = saved


def engine_cpu_seconds(engine: Engine) -> float:
    return time.clock_gettime(time.pthread_getcpuclockid(engine._thread.ident))


def run_round(engine: Engine, args, first: int) -> float:
    """The engine thread's CPU us a step over one round of `args.requests` requests."""
    jobs = bs.make_jobs("distinct", args.requests, first)
    limits = bs.answer_limits(args.requests, first, args.max_tokens, 0.5)
    prompts = [engine.chat_prompt(job.messages) for job in jobs]
    ended: queue.SimpleQueue = queue.SimpleQueue()

    def submit(i: int) -> None:
        engine.add_request(prompts[i], SamplingParams(max_tokens=limits[i], temperature=0, ignore_eos=True),
                           on_output=lambda out: out.finished and ended.put(time.perf_counter()),
                           detokenize=False, each_step=False)

    steps0, cpu0 = engine.stats.steps, engine_cpu_seconds(engine)
    sent = min(args.clients, len(prompts))
    for i in range(sent):
        submit(i)
    for _ in range(len(prompts)):
        at = ended.get() + args.delay_ms / 1e3
        if sent < len(prompts):
            time.sleep(max(0.0, at - time.perf_counter()))
            submit(sent)
            sent += 1
    return 1e6 * (engine_cpu_seconds(engine) - cpu0) / (engine.stats.steps - steps0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a model folder (its shapes only)")
    ap.add_argument("--requests", type=int, default=512, help="requests a round")
    ap.add_argument("--rounds", type=int, default=8, help="paired rounds")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--delay-ms", type=float, default=2.0, help="a client's pause between an answer and its next request")
    ap.add_argument("--max-tokens", type=int, default=128, help="answers of max_tokens/2 to max_tokens")
    ap.add_argument("--pool", type=int, default=200_000, help="KV slots (the tree fills them, then evicts)")
    args = ap.parse_args()
    arms = ("on", "off")
    engines = {arm: Engine(model=args.model, device="cpu", disable_prefix_cache=arm == "off", kv_cache_slots=args.pool,
                           max_running_requests=args.clients) for arm in arms}
    us = {arm: [] for arm in arms}
    try:
        with model_work_stubbed(list(engines.values()), args.clients):
            for arm in arms:  # warm-up: a filled tree
                run_round(engines[arm], args, 10**6)
            for r in range(args.rounds):
                for arm in arms if r % 2 == 0 else arms[::-1]:
                    us[arm].append(run_round(engines[arm], args, 1000 * (r + 1)))
                print(f"round {r}: cache on {us['on'][-1]:.0f}, off {us['off'][-1]:.0f} us a step", flush=True)
    finally:
        for engine in engines.values():
            engine.shutdown()
    on, off = statistics.median(us["on"]), statistics.median(us["off"])
    ratios = [a / b for a, b in zip(us["on"], us["off"])]
    print(f"engine thread CPU us a step (median of {args.rounds}): cache on {on:.0f}, off {off:.0f}, the cache's "
          f"{on - off:.0f}; on / off {statistics.median(ratios):.3f} "
          f"({', '.join(f'{x:.2f}' for x in ratios)}); distinct, {args.clients} clients")


if __name__ == "__main__":
    main()
