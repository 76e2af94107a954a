"""The prefix cache's cost where it cannot help, the engine alone (no HTTP), and where that cost goes.

Two engines in this process, cache on and cache off, run the same requests of a bench_serving
workload in turn for `--rounds` paired rounds, sent as bench_serving's clients send them
(`engine_closed_loop`: `--clients` in flight, a new one as one ends). Answers run to `--max-tokens`,
or with `--max-tokens-spread F` to a length drawn from [max_tokens * (1 - F), max_tokens] (random
weights answer to the limit, and answers that all end together come back in lockstep waves).
Each round reports the engine's TTFT (p50, and its mean split into queued and admission-to-first-token
time). A last round per arm times the engine thread's calls into the scheduler's and the cache's
functions (wall time per call): what the cache costs per finished request, admitted request and step.

    python benchmarks/prefix_cache_ab.py --model DIR --workload json --max-tokens-spread 0.5

Writes benchmarks/results/prefix_cache_ab.{json,md,png}.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_serving as bs  # noqa: E402
from common import RESULTS, bar_plot, machine, markdown_table, timed_calls, write_results  # noqa: E402

from constrained_spec import Engine  # noqa: E402
from constrained_spec.engine.model_runner import ModelRunner  # noqa: E402
from constrained_spec.engine.prefix_cache import PrefixCache  # noqa: E402
from constrained_spec.engine.scheduler import Scheduler  # noqa: E402

# (class, method, what one call is): the engine thread's work the cache adds to or changes
TIMED = [(Scheduler, "remove", "finished request (its KV released: the tree insert with the cache)"),
         (PrefixCache, "admit", "admitted request (match and lock)"),
         (PrefixCache, "take_writes", "step (the table entries of its admitted prefixes and repointed rows)"),
         (PrefixCache, "upload", "upload of its own (entries a prefill graph does not carry, eager steps)"),
         (PrefixCache, "cache_prompts", "step (prompts filed after their prefill, for admissions to cache)"),
         (Scheduler, "schedule", "step (scheduling)"),
         (ModelRunner, "plan", "step (inputs and KV slots)")]



def run_round(engine: Engine, args, first: int) -> dict:
    jobs = bs.make_jobs(args.workload, args.requests, first)
    limits = bs.answer_limits(args.requests, first, args.max_tokens, args.max_tokens_spread)
    st = engine.stats
    decode0, firsts0, queue0, prefill0 = st.decode_steps, st.first_tokens, st.queue_seconds, st.prefill_seconds
    steps0, wait0 = st.steps, st.device_wait_seconds
    t0 = time.perf_counter()
    res = bs.engine_closed_loop(engine, jobs, limits, args.clients)
    seconds = time.perf_counter() - t0
    firsts = st.first_tokens - firsts0
    ttft = list(st.ttft)[-firsts:] if firsts else []
    return {"tok_s": res["out_tok_s"], "decode_steps_s": (st.decode_steps - decode0) / seconds,
            "errors": res["errors"], "seconds": seconds,
            # the engine's time to first token (arrival in the engine to the first sampled token)
            "ttft_ms_p50": 1e3 * statistics.median(ttft) if ttft else None,
            "queue_ms": 1e3 * (st.queue_seconds - queue0) / max(firsts, 1),
            "prefill_ms": 1e3 * (st.prefill_seconds - prefill0) / max(firsts, 1),
            # the engine loop's wait for steps' results from the device, a step (~0: the host paces them)
            "device_wait_us": 1e6 * (st.device_wait_seconds - wait0) / max(st.steps - steps0, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model folder or GGUF (default: the default model)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--workload", default="json", help="a bench_serving workload (json, distinct, shared-prefix, ...)")
    ap.add_argument("--requests", type=int, default=1024, help="requests per round")
    ap.add_argument("--rounds", type=int, default=4, help="paired rounds (arms alternate which goes first)")
    ap.add_argument("--clients", type=int, default=64, help="requests in flight")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-tokens-spread", type=float, default=0.0, metavar="F")
    ap.add_argument("--kv-cache-memory-gb", type=float, default=None,
                    help="each engine's KV pool (default: 12 GiB on CUDA, 40,000 slots elsewhere)")
    ap.add_argument("--name", default="prefix_cache_ab")
    args = ap.parse_args()
    pool = ({"kv_cache_memory_gb": args.kv_cache_memory_gb or 12} if args.device == "cuda" or args.kv_cache_memory_gb
            else {"kv_cache_slots": 40_000})
    engines = {arm: Engine(model=args.model, device=args.device, disable_prefix_cache=arm == "off", **pool)
               for arm in ("on", "off")}
    try:
        for engine in engines.values():  # warm-up: compiles, graphs, a filled tree
            run_round(engine, args, 10**6)
        rounds: dict[str, list[dict]] = {"on": [], "off": []}
        for r in range(args.rounds):
            for arm in (("on", "off") if r % 2 == 0 else ("off", "on")):
                rounds[arm].append(run_round(engines[arm], args, 1000 * (r + 1)))
                print(f"round {r} cache {arm:3s}: {rounds[arm][-1]['tok_s']:9.0f} tok/s", flush=True)
        host = {}
        for arm, engine in engines.items():
            with timed_calls([(cls, name) for cls, name, _ in TIMED]) as totals:
                res = run_round(engine, args, 10**5)
            host[arm] = {k: {"us_per_call": s / c * 1e6 if c else None, "calls": c,
                             "ms_per_s": s / res["seconds"] * 1e3} for k, (s, c) in totals.items()}
    finally:
        for engine in engines.values():
            engine.shutdown()
    report(args, rounds, host)


def report(args, rounds: dict, host: dict) -> None:
    ratios = [on["tok_s"] / off["tok_s"] for on, off in zip(rounds["on"], rounds["off"])]
    def ttft(r):
        return f"{r['ttft_ms_p50']:.1f} ({r['queue_ms']:.1f} + {r['prefill_ms']:.1f})" if r.get("ttft_ms_p50") else "-"
    rows = [[i, f"{on['tok_s']:,.0f}", f"{off['tok_s']:,.0f}", f"{x:.3f}",
             f"{on['decode_steps_s']:.0f} / {off['decode_steps_s']:.0f}", ttft(on), ttft(off),
             f"{on['device_wait_us']:.0f} / {off['device_wait_us']:.0f}"]
            for i, (on, off, x) in enumerate(zip(rounds["on"], rounds["off"], ratios))]
    host_rows = []
    for cls, name, what in TIMED:
        key = f"{cls.__name__}.{name}"
        on, off = host["on"].get(key, {}), host["off"].get(key, {})

        def cell(h):
            return f"{h['us_per_call']:.0f} us x {h['calls']} ({h['ms_per_s']:.1f} ms/s)" if h.get("calls") else "-"
        host_rows.append([key, what, cell(on), cell(off)])
    command = "python benchmarks/prefix_cache_ab.py " + " ".join(sys.argv[1:])
    md = (f"# Prefix cache on / off, the engine alone\n\n{machine().get('gpu', 'cpu')}; workload {args.workload}, "
          f"{args.clients} in flight, {args.requests} requests a round, max_tokens {args.max_tokens} "
          f"(spread {args.max_tokens_spread}); command: `{command}`.\n\n"
          f"tok/s on / off: median **{statistics.median(ratios):.3f}** over {len(ratios)} paired rounds.\n\n"
          + "TTFT is the engine's (arrival in the engine to the first token), p50 ms, with the mean queued and "
          "admission-to-first-token ms. Device wait: the engine loop's wait for steps' results from the device, "
          "per step (near 0: the host's work paces the steps, and what the cache adds to it slows them).\n\n"
          + markdown_table(["round", "tok/s on", "tok/s off", "on / off", "decode steps/s on / off",
                            "TTFT on (queue + prefill)", "TTFT off (queue + prefill)",
                            "device wait us/step on / off"], rows)
          + "\n## The engine thread's time in the scheduler and the cache (one more round per arm)\n\n"
          + markdown_table(["function", "one call is a", "cache on", "cache off"], host_rows))
    write_results(args.name, {"machine": machine(), "command": command, "args": vars(args), "rounds": rounds,
                              "ratios": ratios, "host": host}, md)
    bar_plot(RESULTS / f"{args.name}.png", [str(i) for i in range(len(ratios))],
             {"cache on": [r["tok_s"] for r in rounds["on"]], "cache off": [r["tok_s"] for r in rounds["off"]]},
             "output tok/s", f"prefix cache on / off, engine alone ({args.workload})")


if __name__ == "__main__":
    main()
