"""Where a batch-1 JSON request's time goes: a step-by-step timeline of the engine loop.

For each engine (plain, n-gram with the measured policy, n-gram `always`, n-gram with 16 draft
tokens) it runs the JSON-schema prompts of bench_spec one after another at batch 1 and logs every
engine step: its kind (prefill, plain decode, speculative), and the wall time from the end of the
previous step to the end of this one (the real period, host and device together). The summary
splits each request's wall time into prefill, plain decode, speculative steps and the gaps between
requests, and shows what the measured policy believed (its per-arm tokens/s at batch 1).
Then, on CUDA, the device time of one replay of each captured graph (decode forward, sample tail,
verify forward and tail at width 8 and 16), from CUDA events over many replays.

  python benchmarks/profile_timeline.py                 # GPU, SmolLM2-135M-Instruct, ~1 minute
  python benchmarks/profile_timeline.py --device cpu --prompts 2 --max-tokens 24   # smoke run
Writes benchmarks/results/timeline_<device>.json.
"""
from __future__ import annotations

import argparse
import json
import time

from bench_spec import json_workload
from common import RESULTS, machine
from constrained_spec.kernels.bench import replay_ms

ENGINES = {
    "plain": {},
    "ngram": dict(speculative_algorithm="ngram"),
    "ngram always": dict(speculative_algorithm="ngram", speculative_policy="always"),
    "ngram 16": dict(speculative_algorithm="ngram", speculative_num_draft_tokens=16),
}
# the measured policy with other parameters (engine name -> MeasuredPolicy keyword arguments)
POLICY_VARIANTS = {
    "ngram explore 3%": dict(explore_cost=0.03),
    "ngram tokens 0.2": dict(token_smoothing=0.2),
}


class StepLog:
    """Wraps the engine's per-step hook: one (kind, batch size, period seconds) per step."""

    def __init__(self, engine):
        self.engine, self.rows, self.last = engine, [], None
        self._spec_steps = self._accepted = 0
        on_step = engine.stats.on_step

        def hook(batch, seconds):
            on_step(batch, seconds)
            now = time.perf_counter()
            spec = engine.spec.stats.steps if engine.spec is not None else 0
            accepted = engine.spec.stats.accepted_tokens if engine.spec is not None else 0
            kind = "prefill" if batch.mode.value != "decode" else ("spec" if spec > self._spec_steps else "decode")
            tokens = batch.size + accepted - self._accepted
            self._spec_steps, self._accepted = spec, accepted
            if self.last is not None:
                self.rows.append((kind, batch.size, now - self.last, seconds, tokens))
            self.last = now
        engine.stats.on_step = hook

    def mark(self) -> None:
        """A request is submitted: its prefill's period starts here."""
        self.last = time.perf_counter()


def run(engine, work, max_tokens, log: StepLog | None):
    from constrained_spec import SamplingParams
    sp = SamplingParams(max_tokens=max_tokens, temperature=0)
    tokens, between = 0, 0.0
    t_all = time.perf_counter()
    for prompt, grammar in work:
        t0 = time.perf_counter()
        if log is not None:
            log.mark()
        out = engine.generate([prompt], sp, [grammar])[0]
        tokens += out.completion_tokens
        between -= time.perf_counter() - t0
    seconds = time.perf_counter() - t_all
    return tokens, seconds, seconds + between  # between: time outside generate() calls


def summarize(name, log: StepLog, tokens, seconds, engine):
    kinds = {}
    for kind, size, period, host, _ in log.rows:
        k = kinds.setdefault(kind, dict(steps=0, period_s=0.0, host_s=0.0))
        k["steps"] += 1
        k["period_s"] += period
        k["host_s"] += host
    for k in kinds.values():
        k["period_ms"] = round(1000 * k["period_s"] / k["steps"], 3)
        k["host_ms"] = round(1000 * k["host_s"] / k["steps"], 3)
    rec = dict(engine=name, tokens=tokens, seconds=seconds, tok_s=tokens / seconds, kinds=kinds,
               ttft_ms=round(1000 * sum(engine.stats.ttft) / max(len(engine.stats.ttft), 1), 3))
    if engine.spec is not None:
        st = engine.spec.stats
        rec["spec_phase_ms"] = {k: round(1000 * v / max(st.steps, 1), 3) for k, v in st.phase_seconds().items()}
        rec["mean_accepted_len"] = 1 + st.accepted_tokens / max(st.verified_requests, 1)
        policy = engine.spec.policy
        if policy is not None:
            rec["policy_arms"] = {f"b{b} {'spec' if s else 'plain'}": dict(
                step_ms=round(1000 * a.step_seconds, 3), samples=a.samples, borrowed=a.borrowed)
                for (b, s), a in policy.arms.items()}
            rec["policy_acceptance"] = {f"b{b}": round(v, 2) for b, v in policy.acceptance.items()}
    # the step sequence, compact: one letter per step (p prefill, d plain decode, s speculative)
    rec["sequence"] = "".join(kind[0] for kind, *_ in log.rows)
    rec["spec_tokens"] = [t for kind, _, _, _, t in log.rows if kind == "spec"]
    return rec


def graph_times(engine, replays: int) -> dict:
    """Device ms per replay of each captured graph of interest (the graphs' inputs are whatever the
    last step left; the verify commit is not replayed: it would move table entries)."""
    graphs = engine.runner.graphs
    out = {}
    keys = [("decode", 1), ("sample", 1, True, True), ("decode", 8), ("decode", 32)]
    keys += [k for k in graphs.graphs if k[0] == "verify" and k[1] in ("forward", "tail") and k[2] in (1, 8)
             and (k[1] == "forward" or k[-1] is True)]
    for key in keys:
        if key not in graphs.graphs:
            continue
        out[" ".join(map(str, key))] = round(replay_ms(graphs.graphs[key][0], replays, warmup=10), 4)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--engines", default=",".join(ENGINES), help="of: " + ", ".join([*ENGINES, *POLICY_VARIANTS]))
    args = ap.parse_args()
    from constrained_spec.engine import Engine
    from constrained_spec.models import resolve_model_path
    common = dict(model=resolve_model_path(args.model), device=args.device, dtype="auto", speculative_max_batch=64,
                  **({"kv_cache_memory_gb": 4} if args.device != "cpu" else {}))
    records, graphs = [], {}
    from constrained_spec.engine.spec_policy import MeasuredPolicy
    for name in args.engines.split(","):
        engine = Engine(**{**common, **ENGINES.get(name, ENGINES["ngram"])})
        if name in POLICY_VARIANTS:
            engine.spec.policy = MeasuredPolicy(**POLICY_VARIANTS[name])
        work = json_workload(engine.tokenizer, args.prompts)
        run(engine, work, 16, None)  # warm-up: grammars compiled, caches filled
        if engine.spec is not None:
            engine.spec.reset_drafter()
        engine.stats.ttft.clear()
        log = StepLog(engine)
        tokens, seconds, between = run(engine, work, args.max_tokens, log)
        rec = summarize(name, log, tokens, seconds, engine)
        rec["between_requests_ms"] = round(1000 * between / len(work), 3)
        records.append(rec)
        print(json.dumps({k: v for k, v in rec.items() if k not in ("sequence", "spec_tokens")}), flush=True)
        print(name, rec["sequence"], flush=True)
        if engine.device.type == "cuda" and engine.runner.graphs is not None and name in ("ngram", "ngram 16"):
            graphs[name] = graph_times(engine, 200)
            print(json.dumps({"graph_ms": graphs[name]}), flush=True)
        engine.shutdown()
        del engine
    payload = dict(machine=machine(), args=vars(args), results=records, graph_ms=graphs)
    (RESULTS / f"timeline_{args.device}.json").write_text(json.dumps(payload, indent=1))
    print("\n| engine | tok/s | prefill ms | decode ms (n) | spec ms (n) | between ms | ttft ms |")
    for r in records:
        k = r["kinds"]
        cell = lambda kind: f"{k[kind]['period_ms']} ({k[kind]['steps']})" if kind in k else "-"
        print(f"| {r['engine']} | {r['tok_s']:.0f} | {cell('prefill')} | {cell('decode')} | {cell('spec')} "
              f"| {r['between_requests_ms']} | {r['ttft_ms']} |")
    for name, g in graphs.items():
        print(name, g)


if __name__ == "__main__":
    main()
