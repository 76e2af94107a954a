"""Acceptance replay: how many tokens a drafter would get accepted, without running the verifier.

Greedy verification is lossless, so a speculative run emits exactly the plain greedy tokens. Given
those tokens, the accepted length of any draft tree is known without a forward pass: follow the
child whose token is the next true token. This script generates the plain greedy outputs of the
bench_spec workloads once (cached in benchmarks/results/replay_outputs_<device>.json), then replays
drafter configurations over them, step by step as the engine would run them at batch 1 (one shared
trie, reset at the start, requests in turn): draft, count the accepted path, observe the emitted
tokens, advance the grammar matcher.

The same data replays the engine's speculate-or-not policy (MeasuredPolicy): for every position of
every JSON output, the tokens a speculative step starting there would emit; the policy then runs over
the requests on a simulated clock with given plain, speculative and prefill step costs (the CPU's,
and the H100's from benchmarks/profile_timeline.py, with the overlap pipeline's effect on switches),
against always speculating and never.

  python benchmarks/replay_acceptance.py --device cpu           # SmolLM2 fp32 outputs, ~2 min the first time
Writes benchmarks/results/replay_acceptance.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import dataclass

from common import RESULTS, markdown_table, write_results

CONFIGS = {  # name -> (NgramConfig overrides, how requests with a grammar are drafted)
    "chain 8, forced strings as whole chains": (dict(num_draft_tokens=8, branches=1), "forced"),
    "tree 8 x3, forced strings as whole chains": (dict(num_draft_tokens=8, branches=3), "forced"),
    "chain 8, trie only": (dict(num_draft_tokens=8, branches=1), "trie"),
    "tree 8 x3, trie only": (dict(num_draft_tokens=8, branches=3), "trie"),
    "grammar-guided chain 8 (engine)": (dict(num_draft_tokens=8, branches=1), "guided"),
    "grammar-guided chain 16 (engine)": (dict(num_draft_tokens=16, branches=1), "guided"),
}


def generate_outputs(args):
    from bench_spec import WORKLOADS
    from constrained_spec import SamplingParams
    from constrained_spec.engine import Engine
    from constrained_spec.models import resolve_model_path
    engine = Engine(model=resolve_model_path(args.model), device=args.device, dtype=args.dtype)
    data = {}
    for wname, make in WORKLOADS.items():
        work = make(engine.tokenizer, args.prompts)
        t0 = time.perf_counter()
        outs = engine.generate([p for p, _ in work], SamplingParams(max_tokens=args.max_tokens, temperature=0),
                               [g for _, g in work])
        print(f"{wname}: {sum(o.completion_tokens for o in outs)} tokens in {time.perf_counter() - t0:.1f} s", flush=True)
        data["model"] = f"{engine.model_name} ({engine.runner.dtype})".replace("torch.", "")
        data[wname] = [dict(prompt=list(p), output=list(o.token_ids)) for (p, _), o in zip(work, outs)]
    engine.shutdown()
    return data


def replay(work, outputs, tokenizer, grammar_backend, drafter, mode):
    """Mean accepted length (accepted drafts + bonus per step) over the requests in turn. `mode`:
    how a request with a grammar is drafted: "guided" as the engine does (spec/grammar_draft.py),
    "trie" the drafter's tree alone (the grammar prunes it), "forced" the engine before guided
    drafting (the whole forced string's tokens as the chain, else the drafter's tree)."""
    from constrained_spec.spec.drafter import DraftBatch
    from constrained_spec.spec.grammar_draft import guided_chain, write_chain
    width = drafter.num_draft_tokens
    k = drafter.context_tokens
    steps = emitted = forced_tokens = 0
    for i, ((_, spec), rec) in enumerate(zip(work, outputs)):
        prompt, out = rec["prompt"], rec["output"]
        matcher = grammar_backend.matcher(grammar_backend.compile(spec)) if spec is not None else None
        drafter.add_request(i, prompt)
        stream = list(prompt) + out[:1]  # the first token comes from prefill: node 0 of the first step
        if matcher is not None:
            matcher.accept_token(out[0])
        drafter.observe(i, out[:1])
        pos = 1
        while pos < len(out):
            tokens, next_token, next_sibling, num_nodes = drafter.propose_arrays(DraftBatch([i]))
            tokens[:, 0] = out[pos - 1]
            if matcher is not None and mode == "guided":
                chain, forced = guided_chain(matcher, tokenizer, lambda c, n: drafter.next_tokens(i, c, n),
                                             stream[-k:], width - 1)
                write_chain(tokens, next_token, next_sibling, num_nodes, 0, chain)
                forced_tokens += forced
            elif matcher is not None and mode == "forced":
                chain = matcher.jump_forward_tokens(tokenizer)[:width - 1]
                if chain:
                    write_chain(tokens, next_token, next_sibling, num_nodes, 0, chain)
                    forced_tokens += len(chain)
            acc = accepted_length(tokens[0], next_token[0], next_sibling[0], out[pos:])
            n = min(acc + 1, len(out) - pos)
            if matcher is not None:
                for t in out[pos:pos + n]:
                    if not matcher.accept_token(t):
                        break
            drafter.observe(i, out[pos:pos + n])
            stream += out[pos:pos + n]
            pos += n
            steps += 1
            emitted += n
        drafter.finish(i)
    return dict(steps=steps, tokens=emitted, mean_accepted_len=emitted / max(steps, 1),
                forced_tokens_per_step=forced_tokens / max(steps, 1))


def emitted_per_position(work, outputs, tokenizer, grammar_backend, width=8):
    """[request][position]: tokens a guided speculative step starting at that position emits, the
    drafter having seen the prompt and every token before it."""
    from constrained_spec.spec.grammar_draft import guided_chain
    from constrained_spec.spec.ngram import NgramDrafter
    drafter = NgramDrafter(num_draft_tokens=width)
    rows = []
    for i, ((_, spec), rec) in enumerate(zip(work, outputs)):
        out = rec["output"]
        matcher = grammar_backend.matcher(grammar_backend.compile(spec))
        drafter.add_request(i, rec["prompt"])
        matcher.accept_token(out[0])
        drafter.observe(i, out[:1])
        stream, row = list(rec["prompt"]) + out[:1], [1]
        for pos in range(1, len(out)):
            chain, _ = guided_chain(matcher, tokenizer, lambda c, n: drafter.next_tokens(i, c, n),
                                    stream[-drafter.context_tokens:], width - 1)
            acc = 0
            while acc < len(chain) and pos + acc < len(out) and chain[acc] == out[pos + acc]:
                acc += 1
            row.append(min(acc + 1, len(out) - pos))
            matcher.accept_token(out[pos])
            drafter.observe(i, out[pos:pos + 1])
            stream.append(out[pos])
        drafter.finish(i)
        rows.append(row)
    return rows


@dataclass
class StepCosts:
    """Seconds per step on a simulated clock. With overlap (`launch` set) a plain step right after
    another kind of step ends once launched and the next step absorbs the rest of its device time,
    as in the engine; every request starts with a prefill step (an engine step the policy does not
    decide)."""
    plain: float
    spec: float
    prefill: float = 0.0
    launch: float | None = None


class Noise:
    """Step-time noise of a real host: each step's time times a lognormal factor (`sigma`), with
    probability `tail` times another 1.5-4 (a slow step: the H100 engine's clean step timings had a
    median of 1.0 / 1.5 ms, plain / speculative, and a 90th percentile only 10-30% above, yet
    the moving average of them ended 1.5-2.2x the median), plus a 20 ms hiccup (a garbage collection)
    with probability `hiccups`; seeded."""

    def __init__(self, sigma: float = 0.0, hiccups: float = 0.0, seed: int = 0, tail: float = 0.0):
        self.sigma, self.hiccups, self.tail, self.rng = sigma, hiccups, tail, random.Random(seed)

    def __call__(self, seconds: float) -> float:
        if self.sigma:
            seconds *= self.rng.lognormvariate(0.0, self.sigma)
        if self.tail and self.rng.random() < self.tail:
            seconds *= self.rng.uniform(1.5, 4.0)
        return seconds + (0.02 if self.hiccups and self.rng.random() < self.hiccups else 0.0)


def simulate_policy(rows, policy, costs: StepCosts, noise: Noise | None = None) -> float:
    """Seconds to emit every output at batch 1, requests in turn; policy None = always speculate."""
    noise = noise or Noise()
    now, steps, pending, plain_before = 0.0, 0, 0.0, False
    for row in rows:
        now, pending, steps, plain_before = now + costs.prefill + pending, 0.0, steps + 1, False
        pos = 1
        while pos < len(row):
            if policy is None or policy.choose(1, now, steps):
                n, now, pending, plain_before = row[pos], now + noise(costs.spec) + pending, 0.0, False
                if policy is not None:
                    policy.add_tokens(n)
            elif costs.launch is not None and not plain_before:
                n, now, pending, plain_before = 1, now + costs.launch + pending, noise(costs.plain) - costs.launch, True
            else:
                n, now = 1, now + noise(costs.plain)
            pos, steps = pos + n, steps + 1
    return now + pending


def simulate_drain(rows, policy, plain_s, spec_s, noise: Noise, batch: int = 32, waves: int = 1) -> float:
    """Seconds for `waves` batches of `batch` requests (outputs taken in turn from `rows`), each
    batch draining as its requests finish; step costs are functions of the batch size; policy None
    = always speculate, "plain" = never. Overlap is not modelled here."""
    now, steps = 0.0, 0
    for w in range(waves):
        reqs = [rows[(w * batch + i) % len(rows)] for i in range(batch)]
        pos = [1] * batch
        steps += 1  # the prefill step
        while True:
            live = [i for i in range(batch) if pos[i] < len(reqs[i])]
            if not live:
                break
            b = len(live)
            speculate = policy is None or (policy != "plain" and policy.choose(b, now, steps))
            if speculate:
                n = sum(reqs[i][pos[i]] for i in live)
                for i in live:
                    pos[i] += reqs[i][pos[i]]
                if policy is not None:
                    policy.add_tokens(n)
                now += noise(spec_s(b))
            else:
                for i in live:
                    pos[i] += 1
                now += noise(plain_s(b))
            steps += 1
    return now


def plain_seconds(rows, costs: StepCosts) -> float:
    return sum(costs.prefill + (len(row) - 1) * costs.plain for row in rows)


def accepted_length(tokens, next_token, next_sibling, truth) -> int:
    node, depth = 0, 0
    while depth < len(truth):
        child = next_token[node]
        while child >= 0 and tokens[child] != truth[depth]:
            child = next_sibling[child]
        if child < 0:
            break
        node, depth = child, depth + 1
    return depth


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompts", type=int, default=30)
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--regenerate", action="store_true")
    args = ap.parse_args()
    from bench_spec import WORKLOADS
    from constrained_spec.grammar.backend import GrammarBackend
    from constrained_spec.models import resolve_model_path
    from constrained_spec.spec.ngram import NgramDrafter

    cache = RESULTS / f"replay_outputs_{args.device}.json"
    if args.regenerate or not cache.exists():
        cache.write_text(json.dumps(generate_outputs(args)))
    outputs = json.loads(cache.read_text())
    from constrained_spec.models import load_tokenizer, read_model_config
    path = resolve_model_path(args.model)
    tokenizer = load_tokenizer(path)
    backend = GrammarBackend(tokenizer, read_model_config(path)[1].vocab_size)
    records = []
    for wname, make in WORKLOADS.items():
        work = make(tokenizer, len(outputs[wname]))
        for name, (ngram, mode) in CONFIGS.items():
            if wname != "json" and mode != "guided":
                continue  # no grammar: every mode drafts the same
            for first in (4, len(work)):  # bench_spec's batch-1 run uses the first 4 prompts
                r = replay(work[:first], outputs[wname][:first], tokenizer, backend, NgramDrafter(**ngram), mode)
                records.append(dict(workload=wname, prompts=first, config=name, **r))
                print(json.dumps(records[-1]), flush=True)
    from constrained_spec.engine.spec_policy import MeasuredPolicy
    json_work = WORKLOADS["json"](tokenizer, len(outputs["json"]))
    per_position = emitted_per_position(json_work, outputs["json"], tokenizer, backend)
    # this CPU's step costs (bench_spec --device cpu), and the H100's (profile_timeline.py: plain 0.99
    # ms, speculative 1.6 ms on one host and 2.0 ms on another, prefill 13 ms, overlap)
    regimes = {"CPU (55.5 / 93 ms, prefill 220 ms)": StepCosts(0.0555, 0.093, 0.22),
               "H100 (0.99 / 1.6 ms, prefill 13 ms, overlap)": StepCosts(0.00099, 0.0016, 0.013, 0.0003),
               "H100 (0.99 / 2.0 ms, prefill 13 ms, overlap)": StepCosts(0.00099, 0.002, 0.013, 0.0003)}
    policy_rows = []
    policies = {"always": lambda: None, "measured (engine default)": MeasuredPolicy,
                "measured, re-measuring at 3% cost": lambda: MeasuredPolicy(explore_cost=0.03),
                "measured, token smoothing 0.25": lambda: MeasuredPolicy(token_smoothing=0.25)}
    noises = {"lognormal 0.3": lambda seed: Noise(0.3, 0.003, seed),
              "slow-step tail": lambda seed: Noise(0.1, 0.003, seed, tail=0.08)}
    for regime, costs in regimes.items():
        plain_total = plain_seconds(per_position, costs)
        for nname, noise in noises.items():
            for pname, make in policies.items():
                speedups = [plain_total / simulate_policy(per_position, make(), costs, noise(seed))
                            for seed in range(5)]
                policy_rows.append([regime, nname, pname, round(sum(speedups) / len(speedups), 3)])
    # a batch of 32 draining to 1; speculation's host cost grows with the batch (H100, bench_spec's phases)
    drain_rows = []
    plain_s = lambda b: 0.00099 + 0.000007 * b
    for per_request in (0.00005, 0.0001):
        spec_s = lambda b, k=per_request: 0.0016 + k * b
        regime = f"plain 1.0-1.2 ms, speculative {1000 * spec_s(1):.1f} (b1) to {1000 * spec_s(32):.1f} ms (b32)"
        for nname, noise in (("lognormal 0.2", lambda seed: Noise(0.2, 0.0, seed)),
                             ("slow-step tail", lambda seed: Noise(0.1, 0.0, seed, tail=0.08))):
            for waves in (1, 3):
                base = [simulate_drain(per_position, "plain", plain_s, spec_s, noise(seed), waves=waves)
                        for seed in range(3)]
                for pname in ("always", "measured (engine default)"):
                    speedups = [b / simulate_drain(per_position, policies[pname](), plain_s, spec_s, noise(seed),
                                                   waves=waves) for seed, b in enumerate(base)]
                    drain_rows.append([regime, nname, waves, pname, round(sum(speedups) / len(speedups), 3)])
    rows = [[r["workload"], r["prompts"], r["config"], r["steps"], r["tokens"], round(r["mean_accepted_len"], 2),
             round(r["forced_tokens_per_step"], 2)] for r in records]
    md = ("# Acceptance replay over plain greedy outputs (batch 1, requests in turn)\n\n"
          f"Greedy outputs of {outputs.get('model', 'the default model')} on {args.device}, cached in "
          f"{cache.name}. Mean accepted len = tokens emitted per verify step (accepted drafts + bonus), exact for "
          "greedy verification, which emits the plain greedy tokens whatever the draft.\n\n"
          + markdown_table(["workload", "prompts", "drafter", "steps", "tokens", "mean accepted len",
                            "forced draft tokens per step"], rows)
          + "\n\n## The speculate-or-not policy, replayed (JSON, 30 schemas, batch 1, guided chain 8)\n\n"
          "Speedup over plain decoding on a simulated clock with the given step costs and timing noise "
          "(`Noise`): lognormal 0.3 = each step's time times a lognormal factor (sigma 0.3); slow-step tail = "
          "sigma 0.1, and 8% of the steps 1.5-4x slower; both with a 20 ms hiccup with probability 0.003. "
          "Mean of 5 seeds.\n\n"
          + markdown_table(["step costs (plain / speculative)", "noise", "policy", "speedup"], policy_rows)
          + "\n\n## The policy in a draining batch (JSON outputs, 32 requests at once, waves in turn)\n\n"
          "Step times by batch size as given, with lognormal noise (sigma 0.2) or the slow-step tail; mean "
          "of 3 seeds.\n\n"
          + markdown_table(["step costs", "noise", "waves", "policy", "speedup"], drain_rows))
    write_results("replay_acceptance", {"args": vars(args), "results": records, "policy_replay": policy_rows,
                                        "policy_drain": drain_rows}, md)


if __name__ == "__main__":
    main()
