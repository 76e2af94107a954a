"""Speculative decoding, one run: plain vs n-gram lookahead (chain, and a tree of 3 branches; EAGLE when
asked for with --engines) on the JSON-schema workload (schemas/handwritten; under each grammar backend,
`--grammar-backends`), a repeated-context (RAG-like) workload and general chat, at batch 1, 8 and 32, greedy, so every
configuration should emit the same tokens (the table says how many did).

Per (workload, batch, engine): tokens/s, speedup over plain, mean accepted length (tokens emitted
per request per verify step), the share of decode steps that speculated (the engine falls back to
plain steps where they measure faster), and the host milliseconds per speculative step spent
drafting + grammar-masking the trees ("CPU draft+mask") and in the other phases; and the acceptance
histogram (verified request-steps by drafts accepted).

Each row is preceded by a short warm-up of every engine on the same prompts (grammar compilation,
CUDA/Triton caches); then `--repeats` rounds time every engine once each, in turn, so that a host
whose speed drifts weighs on all engines alike, and each speedup is a ratio of runs of the same
round. The n-gram drafter is reset before every run, so no run drafts from another's outputs. The
speculate-or-not policy is reset before the first round only: that round is a cold start ("cold"
columns, the policy still measuring what each batch size costs); the later rounds keep what it
measured, as a long-running server's policy does, and give the row's tok/s (median run) and
speedup (median of the rounds' ratios). Batch 1 runs its prompts one after another.

  python benchmarks/bench_spec.py                      # GPU, SmolLM2-135M-Instruct, a few minutes on an H100
  python benchmarks/bench_spec.py --device cpu --batches 1 --min-prompts 4   # CPU, ~3 minutes
  python benchmarks/bench_spec.py --device cpu --quick # end-to-end smoke run on a CPU
  python benchmarks/bench_spec.py --workloads json    # one workload: writes spec_<device>_json.*
Writes benchmarks/results/spec_<device>[_<workload>][_quick].{json,md,png} (the workload named when
`--workloads` picks one).
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from common import RESULTS, SCHEMAS, bar_plot, machine, markdown_table, write_results
from constrained_spec.speculative.worker import SPEC_PHASES

DOC = ("The Aurora-7 research station sits 3,200 metres above sea level on the Kaskawulsh plateau. It was opened "
       "in 2019, houses 14 researchers in winter and 31 in summer, and runs on a 420 kW solar array with two backup "
       "diesel generators. Its main instruments are a 2.4 metre optical telescope, a cosmic-ray muon detector and a "
       "weather mast that reports every 10 minutes to the national meteorological service. Supplies arrive by "
       "helicopter every 12 days; the station director is Dr. Ingrid Solberg.")
# general chat (no grammar): questions of kinds train-eagle's instruction templates do not write
CHAT_PROMPTS = [
    "How do I keep basil alive on a windowsill?", "What should I pack for a three-day hiking trip?",
    "Can you explain how a refrigerator keeps food cold?", "Suggest a name for a small bakery and say why.",
    "My laptop is slow. What can I check first?", "How does compound interest work? Use an example.",
    "Write a short thank-you note to a neighbour who fed my cat.", "What is the difference between weather and climate?",
    "Give me a simple dinner recipe with rice and eggs.", "How can I get better at public speaking?",
    "Why is the sky blue?", "Plan a one-day visit to a city museum for two children.",
    "What are good habits for learning to play the guitar?", "Explain what a database index is.",
    "How do I politely decline a meeting invitation?", "What causes the seasons on Earth?",
]
RAG_TASKS = ["Quote the document's sentence about supplies.", "Repeat the first two sentences of the document exactly.",
             "List every number in the document with what it measures.", "Summarize the document, reusing its wording."]
ENGINES = {  # name -> engine options on top of the common ones
    "plain": {},
    "ngram chain": dict(speculative_algorithm="ngram"),
    "ngram tree": dict(speculative_algorithm="ngram", ngram_branches=3),
    # every step speculates (no measured fallback): what speculation alone does at each batch size
    "ngram chain always": dict(speculative_algorithm="ngram", speculative_policy="always"),
    "ngram tree always": dict(speculative_algorithm="ngram", ngram_branches=3, speculative_policy="always"),
    # 16 draft tokens (the default policy): on the CPU 1.86x vs 1.71x at batch 1 (JSON); the GPU decides the default
    "ngram chain 16": dict(speculative_algorithm="ngram", speculative_num_draft_tokens=16),
    # EAGLE head (--eagle-head, default: the shipped one): EAGLE-2 tree, a top-1 chain, and the tree at every step
    "eagle": dict(speculative_algorithm="eagle"),
    "eagle chain": dict(speculative_algorithm="eagle", eagle_topk=1, eagle_depth=7),  # fused: naive EAGLE
    "eagle chain always": dict(speculative_algorithm="eagle", eagle_topk=1, eagle_depth=7, speculative_policy="always"),
    # shorter fused chains: at batch 1 on the H200 a chain of 7 accepted 3+ drafts in 7% of steps, and
    # each depth costs a head step
    "eagle chain 3 always": dict(speculative_algorithm="eagle", eagle_topk=1, eagle_depth=3, speculative_policy="always"),
    "eagle chain 2 always": dict(speculative_algorithm="eagle", eagle_topk=1, eagle_depth=2, speculative_policy="always"),
    # A/B of naive EAGLE: the chain drafted apart from the verify, as trees are (two reads a step)
    "eagle chain apart": dict(speculative_algorithm="eagle", eagle_topk=1, eagle_depth=7, eagle_fused_chain=False),
    "eagle chain apart always": dict(speculative_algorithm="eagle", eagle_topk=1, eagle_depth=7,
                                     eagle_fused_chain=False, speculative_policy="always"),
    "eagle always": dict(speculative_algorithm="eagle", speculative_policy="always"),
    # A/B of the draft rows' walks (`MaskFiller.fill_paths`): one path a fork of the matcher (as many
    # threads as a frontier has nodes), and every row walked on the engine thread
    "eagle always walk1": dict(speculative_algorithm="eagle", speculative_policy="always", grammar_paths_per_walk=1),
    "eagle always serial": dict(speculative_algorithm="eagle", speculative_policy="always", grammar_mask_threads=1),
    # A/B of grammar masking while drafting: depths 1-2 masked (one more host sync a step), and every depth
    "eagle mask2": dict(speculative_algorithm="eagle", eagle_masked_depths=2),
    "eagle mask all": dict(speculative_algorithm="eagle", eagle_masked_depths=6),
}
DEFAULT_ENGINES = [e for e in ENGINES if not e.startswith("eagle")]  # EAGLE needs a head: asked for by name


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", default=None, help="model folder or GGUF (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--draft-tokens", type=int, default=8, help="tree width N, root included")
    ap.add_argument("--min-prompts", type=int, default=30,
                    help="prompts per measurement at least (batch 1: in turn); 30 = every hand-written schema once")
    ap.add_argument("--repeats", type=int, default=None,
                    help="timed rounds per row: a cold start, then warm rounds whose median is reported (default 4, "
                         "--quick 1; an H100 run at batch 32 lasts ~0.3 s, and the same row measured 0.75x-1.01x "
                         "over four single runs)")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, for a CPU smoke run")
    ap.add_argument("--engines", default=",".join(DEFAULT_ENGINES),
                    help="comma-separated subset of: " + ", ".join(ENGINES) + " (default: the n-gram ones)")
    ap.add_argument("--eagle-head", default=None, metavar="DIR",
                    help="EAGLE head folder for the eagle engines (default: the one shipped for the default model)")
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated subset of: " + ", ".join(WORKLOADS))
    ap.add_argument("--name", default=None, help="results file name (default spec_<device>[_<workload>][_quick])")
    ap.add_argument("--grammar-backends", default="xgrammar,llguidance",
                    help="grammar backends the json workload runs under, a row each (default: %(default)s)")
    ap.add_argument("--opt", action="append", default=[], metavar="KEY=VALUE",
                    help="engine option for every engine, e.g. grammar_mask_threads=1 (repeatable; A/B runs)")
    args = ap.parse_args()
    if args.quick:
        args.batches, args.max_tokens, args.min_prompts = "1,4", 24, 2
    if args.repeats is None:
        args.repeats = 1 if args.quick else 4
    return args


# -- workloads ------------------------------------------------------------------------------------
def chat(tokenizer, text):
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True, add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def json_workload(tokenizer, n, backend=None):
    from constrained_spec.grammar import GrammarSpec
    rows = [json.loads(line) for line in (SCHEMAS / "handwritten" / "handwritten.jsonl").read_text().splitlines()
            if line.strip()]
    out = []
    for i in range(n):
        row = rows[i % len(rows)]
        text = (f"{row.get('prompt', 'Produce an example.')} Answer with JSON matching this schema: "
                f"{json.dumps(row['schema'])}" + (f" (request {i})" if i >= len(rows) else ""))
        out.append((chat(tokenizer, text), GrammarSpec.json_schema(row["schema"]).with_backend(backend)))
    return out


def rag_workload(tokenizer, n, backend=None):
    return [(chat(tokenizer, f"Document:\n{DOC}\n\nTask: {RAG_TASKS[i % len(RAG_TASKS)]} (request {i})"), None)
            for i in range(n)]


def chat_workload(tokenizer, n, backend=None):
    return [(chat(tokenizer, CHAT_PROMPTS[i % len(CHAT_PROMPTS)] + (f" (request {i})" if i >= len(CHAT_PROMPTS) else "")),
             None) for i in range(n)]


WORKLOADS = {"json": json_workload, "rag": rag_workload, "chat": chat_workload}


# -- measuring ------------------------------------------------------------------------------------
def generate(engine, work, batch, max_tokens):
    """Runs the prompts `batch` at a time; returns (outputs, seconds)."""
    from constrained_spec import SamplingParams
    sp = SamplingParams(max_tokens=max_tokens, temperature=0)
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    outs = []
    t0 = time.perf_counter()
    for i in range(0, len(work), batch):
        wave = work[i:i + batch]
        outs += engine.generate([p for p, _ in wave], sp, [g for _, g in wave])
    return outs, time.perf_counter() - t0


def counters(engine):
    st = engine.spec.stats if engine.spec else None
    spec = dict(steps=st.steps, verified=st.verified_requests, accepted=st.accepted_tokens,
                **{f"{k}_s": v for k, v in st.phase_seconds().items()},
                **{f"hist_{n}": c for n, c in enumerate(st.histogram)}) if st else {}
    profile = getattr(engine.spec.drafter, "profile", None) if engine.spec else None
    if profile is not None:  # the EAGLE drafter's host phases (`eagle.DraftProfile`)
        spec.update(draft_calls=profile.calls, draft_syncs=profile.syncs, draft_eager=profile.eager,
                    **{f"eagle_{k}_s": v for k, v in profile.seconds.items()})
    return dict(decode_steps=engine.stats.decode_steps, **spec)


def measure_row(engines: dict, work, batch, max_tokens, repeats: int) -> list[tuple[list, dict]]:
    """One (workload, batch) row for every engine: a warm-up each, then `repeats` rounds, each
    timing every engine once in turn (round-robin, so that a host that slows down or speeds up
    over the minute weighs on all engines alike), each run from a fresh drafter. Round 0 starts
    from a fresh policy too (a cold start: "cold"); later rounds keep what the policy measured,
    as a server's does after its first requests ("warm"). Per engine: tok/s = the median warm run
    (the cold one with one round); speedup = the median over warm rounds of the ratio to plain's
    run in the same round. Returns (first run's outputs, record) per engine, in `engines` order."""
    for engine in engines.values():
        generate(engine, work, batch, min(16, max_tokens))  # warm-up on the same prompts
    runs: dict[str, list] = {name: [] for name in engines}
    for i in range(repeats):
        for name, engine in engines.items():
            if engine.spec is not None:
                engine.spec.reset_drafter(policy=i == 0)
            runs[name].append(timed_run(engine, work, batch, max_tokens))
    plain = [rec["tok_s"] for _, rec in runs["plain"]]
    out = []
    for name in engines:
        tok_s = [rec["tok_s"] for _, rec in runs[name]]
        warm = list(range(1, repeats)) or [0]
        median_run = sorted(warm, key=lambda i: tok_s[i])[len(warm) // 2]
        rec = dict(runs[name][median_run][1])
        rec["cold_tok_s"] = tok_s[0]
        if name != "plain":
            rec["speedup"] = _median([tok_s[i] / plain[i] for i in warm])
            rec["cold_speedup"] = tok_s[0] / plain[0]
        if repeats > 1:
            rec["tok_s_runs"] = [round(t, 1) for t in tok_s]
        out.append((runs[name][0][0], rec))
    return out


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def timed_run(engine, work, batch, max_tokens) -> tuple[list, dict]:
    before, decided = counters(engine), policy_decisions(engine)
    outs, seconds = generate(engine, work, batch, max_tokens)
    after = counters(engine)
    d = {k: after[k] - before[k] for k in after}
    tokens = sum(o.completion_tokens for o in outs)
    rec = dict(tokens=tokens, seconds=seconds, tok_s=tokens / seconds)
    if engine.spec is not None:
        steps = max(d["steps"], 1)
        rec.update(spec_steps=d["steps"], spec_share=d["steps"] / max(d["decode_steps"], 1),
                   mean_accepted_len=1 + d["accepted"] / max(d["verified"], 1),
                   cpu_draft_mask_ms=1000 * (d["draft_s"] + d["mask_s"]) / steps,
                   phase_ms={k: round(1000 * d[f"{k}_s"] / steps, 3) for k in SPEC_PHASES},
                   accepted_histogram=_histogram(d))
        run = {k: n - decided.get(k, 0) for k, n in policy_decisions(engine).items()}
        if run:  # the measured policy: where it speculated, by batch bucket (speculative / all steps)
            buckets = sorted({b for (b, _), n in run.items() if n}, reverse=True)
            rec["spec_steps_by_bucket"] = {
                b: f"{run.get((b, True), 0)}/{run.get((b, True), 0) + run.get((b, False), 0)}" for b in buckets}
        if "draft_calls" in d:  # EAGLE: where the draft phase goes, per speculative step
            rec.update(draft_syncs_per_step=d["draft_syncs"] / steps, draft_eager_share=d["draft_eager"] / steps,
                       draft_phase_ms={k[6:-2]: round(1000 * v / steps, 3) for k, v in d.items()
                                       if k.startswith("eagle_")})
    return outs, rec


def _histogram(d: dict) -> list[int]:
    """Request-steps of a run by drafts accepted (0, 1, ...; the bonus token not counted), up to
    the largest count seen."""
    counts = [d[f"hist_{n}"] for n in range(sum(k.startswith("hist_") for k in d))]
    last = max((n for n, c in enumerate(counts) if c), default=0)
    return counts[:last + 1]


def policy_decisions(engine) -> dict:
    """The measured policy's steps decided so far per (batch bucket, speculative); {} without one."""
    policy = engine.spec.policy if engine.spec is not None else None
    return dict(policy.decided) if policy is not None else {}


# -- report ---------------------------------------------------------------------------------------
def table(records, title):
    def opt(r, key, digits=2):
        return round(r[key], digits) if key in r else "-"
    rows = [[r["workload"], r["batch"], r["engine"], round(r["tok_s"], 1), opt(r, "speedup"),
             round(r["cold_tok_s"], 1), opt(r, "cold_speedup"), opt(r, "mean_accepted_len"),
             opt(r, "spec_share"), opt(r, "cpu_draft_mask_ms", 3),
             f"{r['identical_to_plain']}/{r['requests']}" if "identical_to_plain" in r else "-",
             " / ".join(str(round(t)) for t in r.get("tok_s_runs", []))] for r in records]
    return (f"# {title}\n\n"
            "Every engine runs once per round, in turn. tok/s: the median warm run (the policy keeps what it "
            "measured in the rounds before; every run's tok/s in the last column, the cold start first); speedup: "
            "the median over warm rounds of the ratio to plain's run of the same round; the other columns are the "
            "median warm run's. cold: the first round, the policy starting from nothing. mean accepted len = tokens emitted per request per verify step (accepted drafts + bonus); spec share = "
            "decode steps that speculated (the engine decodes plainly where that measures faster); CPU draft+mask = "
            "host ms per speculative step drafting the trees and filling their grammar masks (on CUDA the mask part "
            "overlaps the verify forward). Identical to plain = outputs equal to the plain engine's token for "
            "token: in fp32 on the CPU all of them; in bf16 on a GPU a verify forward sums in another order than "
            "a decode step and near-ties flip, after which the texts diverge (losslessness on the GPU is checked "
            "by tests/test_engine_gpu.py against an fp32 reference, token by token).\n\n"
            + markdown_table(["workload", "batch", "engine", "tok/s", "speedup", "cold tok/s", "cold speedup",
                              "mean accepted len", "spec share",
                              "CPU draft+mask ms/step", "identical to plain", "tok/s of each run"], rows)
            + policy_table(records) + histogram_table(records) + eagle_table(records))


def policy_table(records) -> str:
    """Where the measured policy speculated in the median warm run, by batch bucket (a run's batch
    shrinks through the buckets as its requests finish; each is measured on its own)."""
    rows = [[r["workload"], r["batch"], r["engine"],
             ", ".join(f"{b}: {n}" for b, n in r["spec_steps_by_bucket"].items())]
            for r in records if r.get("spec_steps_by_bucket")]
    if not rows:
        return ""
    return ("\n\nThe measured policy's speculative steps / all decode steps by batch bucket, the median warm run:\n\n"
            + markdown_table(["workload", "batch", "engine", "speculative / all steps by bucket"], rows))


def histogram_table(records) -> str:
    """The acceptance histogram of the median warm run: the share of verified request-steps that
    accepted 0, 1, 2, ... drafts (the bonus token not counted)."""
    hists = [r for r in records if sum(r.get("accepted_histogram", ())) > 0]
    if not hists:
        return ""
    width = max(len(r["accepted_histogram"]) for r in hists)
    rows = [[r["workload"], r["batch"], r["engine"], sum(r["accepted_histogram"]),
             *(f"{c / sum(r['accepted_histogram']):.2f}" for c in r["accepted_histogram"] + [0] * (width - len(r["accepted_histogram"])))]
            for r in hists]
    return ("\n\nDrafts accepted per verified request-step (the median warm run; the share of request-steps "
            "that accepted 0, 1, 2, ... drafts, the bonus token not counted):\n\n"
            + markdown_table(["workload", "batch", "engine", "request-steps", *(str(n) for n in range(width))], rows))


def eagle_table(records) -> str:
    """Where an EAGLE engine's drafting goes: host ms per speculative step by phase
    (`eagle.DraftProfile`; on CUDA "read" holds the wait for the device's draft work), the
    host-device syncs per step, and the share of steps that ran eagerly instead of from graphs."""
    eagle = [r for r in records if "draft_phase_ms" in r]
    if not eagle:
        return ""
    phases, steps = list(eagle[0]["draft_phase_ms"]), list(eagle[0]["phase_ms"])
    rows = [[r["workload"], r["batch"], r["engine"], *(r["phase_ms"][p] for p in steps),
             *(r["draft_phase_ms"][p] for p in phases), round(r["draft_syncs_per_step"], 2),
             round(r["draft_eager_share"], 2)] for r in eagle]
    return ("\n\nEAGLE, host ms per speculative step (the median warm run): the step's phases (`worker.SPEC_PHASES`: "
            "draft holds the drafting below; wait, the device's verify work and, for a fused chain, the next "
            "draft), then the drafting's own phases (on CUDA `read` includes waiting for the draft graphs; a "
            "fused chain drafts apart only for requests that arrive), drafting syncs per step, share of steps "
            "drafted eagerly:\n\n"
            + markdown_table(["workload", "batch", "engine", *(f"step {p}" for p in steps), *phases, "syncs/step",
                              "eager share"], rows))


def plot(records, path, title):
    labels = []
    for r in records:
        label = f"{r['workload']} b{r['batch']}"
        if label not in labels:
            labels.append(label)
    series = {name: [next((r["tok_s"] for r in records if f"{r['workload']} b{r['batch']}" == label
                           and r["engine"] == name), 0.0) for label in labels] for name in dict.fromkeys(r["engine"] for r in records)}
    bar_plot(path, labels, series, "tokens/s", title)


def main():
    args = parse_args()
    from constrained_spec.engine import Engine
    from constrained_spec.models import resolve_model_path
    t_start = time.perf_counter()
    common = dict(model=resolve_model_path(args.model), device=args.device, dtype=args.dtype,
                  speculative_num_draft_tokens=args.draft_tokens, speculative_max_batch=64,
                  **({"kv_cache_memory_gb": 4} if args.device != "cpu" else {}),
                  **{k: json.loads(v) for k, v in (o.split("=", 1) for o in args.opt)})
    chosen = ["plain"] + [e for e in args.engines.split(",") if e and e != "plain"]  # plain first: the reference
    unknown = [e for e in chosen if e not in ENGINES] + [w for w in args.workloads.split(",") if w not in WORKLOADS]
    if unknown:
        raise SystemExit(f"unknown engine or workload: {unknown}")
    head = {"eagle_head": args.eagle_head} if args.eagle_head else {}
    engines = {name: Engine(**{**common, **ENGINES[name], **(head if name.startswith("eagle") else {})})
               for name in chosen}
    tokenizer = engines["plain"].tokenizer
    print(f"engines ready in {time.perf_counter() - t_start:.1f} s", flush=True)
    records = []
    runs = [(w, b) for w in args.workloads.split(",") for b in (args.grammar_backends.split(",") if w == "json" else [None])]
    for wname, backend in runs:
        make = WORKLOADS[wname]
        label = wname if backend is None else f"{wname} ({backend})"
        for batch in [int(b) for b in args.batches.split(",")]:
            work = make(tokenizer, max(batch, args.min_prompts), backend)
            measured = measure_row(engines, work, batch, args.max_tokens, args.repeats)
            plain_outs = measured[0][0]
            for name, (outs, rec) in zip(engines, measured):
                rec = dict(workload=label, batch=batch, engine=name, requests=len(work), grammar_backend=backend, **rec)
                if name != "plain":
                    rec["identical_to_plain"] = sum(a.token_ids == b.token_ids for a, b in zip(outs, plain_outs))
                records.append(rec)
                print(json.dumps(rec), flush=True)
    for engine in engines.values():
        engine.shutdown()
    picked = [w for w in args.workloads.split(",") if w]
    only = "" if set(picked) == set(WORKLOADS) else "_" + "_".join(picked)
    name = args.name or f"spec_{args.device}{only}" + ("_quick" if args.quick else "")
    title = f"Speculative decoding: plain vs {', '.join(chosen[1:])} ({engines['plain'].model_name}, greedy, {args.device})"
    payload = {"machine": machine(), "args": vars(args), "seconds": time.perf_counter() - t_start, "results": records}
    write_results(name, payload, table(records, title))
    plot(records, RESULTS / f"{name}.png", f"speculative decoding ({args.device})")
    print(f"total {time.perf_counter() - t_start:.1f} s")


if __name__ == "__main__":
    main()
