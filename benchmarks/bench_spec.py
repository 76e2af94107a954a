"""Speculative decoding, one run: plain vs n-gram lookahead (chain and tree) on JSON-schema
workloads from schemas/handwritten and on a repeated-context (RAG-like) workload, at batch 1, 8, 32.
Greedy, so every configuration emits the same tokens. Writes benchmarks/results/spec.{json,md,png}.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from common import RESULTS, SCHEMAS, bar_plot, machine, markdown_table, write_results

DOC = ("The Aurora-7 research station sits 3,200 metres above sea level on the Kaskawulsh plateau. It was opened "
       "in 2019, houses 14 researchers in winter and 31 in summer, and runs on a 420 kW solar array with two backup "
       "diesel generators. Its main instruments are a 2.4 metre optical telescope, a cosmic-ray muon detector and a "
       "weather mast that reports every 10 minutes to the national meteorological service. Supplies arrive by "
       "helicopter every 12 days; the station director is Dr. Ingrid Solberg.")


def json_workload(tokenizer, n):
    lines = (SCHEMAS / "handwritten" / "handwritten.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines if line.strip()]
    from constrained_spec.grammar import GrammarSpec
    out = []
    for i in range(n):
        row = rows[i % len(rows)]
        text = f"{row.get('prompt', 'Produce an example.')} Answer with JSON matching this schema: {json.dumps(row['schema'])}"
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True, add_generation_prompt=True)
        out.append((list(ids["input_ids"] if hasattr(ids, "keys") else ids), GrammarSpec.json_schema(row["schema"])))
    return out


def rag_workload(tokenizer, n):
    qs = ["Quote the document's sentence about supplies.", "Repeat the first two sentences of the document exactly.",
          "List every number in the document with what it measures.", "Summarize the document, reusing its wording."]
    out = []
    for i in range(n):
        text = f"Document:\n{DOC}\n\nTask: {qs[i % len(qs)]}"
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True, add_generation_prompt=True)
        out.append((list(ids["input_ids"] if hasattr(ids, "keys") else ids), None))
    return out


def run(engine, work, max_tokens):
    from constrained_spec import SamplingParams
    sp = SamplingParams(max_tokens=max_tokens, temperature=0)
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = engine.generate([p for p, _ in work], sp, [g for _, g in work])
    dt = time.perf_counter() - t0
    return outs, dt


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--draft-tokens", type=int, default=8)
    args = ap.parse_args()
    from constrained_spec.engine import Engine
    from constrained_spec.models import resolve_model_path
    path = resolve_model_path(None)
    common = dict(model=path, device=args.device, kv_cache_memory_gb=4, speculative_max_batch=64)
    engines = {
        "plain": Engine(**common),
        "ngram chain": Engine(**common, speculative_algorithm="ngram", speculative_num_draft_tokens=args.draft_tokens),
        "ngram tree": Engine(**common, speculative_algorithm="ngram", speculative_num_draft_tokens=args.draft_tokens,
                             ngram_branches=3),
    }
    tok = engines["plain"].tokenizer
    records = []
    for wname, make in (("json", json_workload), ("rag", rag_workload)):
        for bs in [int(b) for b in args.batches.split(",")]:
            work = make(tok, bs)
            base = None
            for name, eng in engines.items():
                run(eng, work[:1], 8)  # warm-up
                st = eng.spec.stats if eng.spec else None
                before = (st.verified_requests, st.accepted_tokens, st.cpu_draft_seconds, st.steps) if st else None
                outs, dt = run(eng, work, args.max_tokens)
                tokens = sum(o.completion_tokens for o in outs)
                rec = dict(workload=wname, batch=bs, engine=name, tokens=tokens, seconds=dt, tok_s=tokens / dt)
                if base is None:
                    base = (outs, rec)
                else:
                    rec["speedup"] = rec["tok_s"] / base[1]["tok_s"]
                    rec["identical_to_plain"] = all(a.token_ids == b.token_ids for a, b in zip(outs, base[0]))
                if st:
                    n = st.verified_requests - before[0]
                    rec["mean_accepted_len"] = 1 + (st.accepted_tokens - before[1]) / max(n, 1)
                    rec["cpu_draft_ms_per_step"] = 1000 * (st.cpu_draft_seconds - before[2]) / max(st.steps - before[3], 1)
                    rec["spec_steps"] = st.steps - before[3]
                records.append(rec)
                print(rec, flush=True)
    for eng in engines.values():
        eng.shutdown()
    rows = [[r["workload"], r["batch"], r["engine"], round(r["tok_s"], 1), round(r.get("speedup", 1.0), 2),
             round(r.get("mean_accepted_len", 1.0), 2), round(r.get("cpu_draft_ms_per_step", 0.0), 3),
             r.get("identical_to_plain", "-")] for r in records]
    md = (f"# Speculative decoding: plain vs n-gram lookahead (SmolLM2-135M, greedy, {args.device})\n\n"
          "mean accepted len = tokens emitted per request per verify step (accepted drafts + bonus).\n\n"
          + markdown_table(["workload", "batch", "engine", "tok/s", "speedup", "mean accepted len",
                            "CPU draft+mask ms/step", "identical to plain"], rows))
    write_results(f"spec_{args.device}", {"machine": machine(), "results": records}, md)
    labels = sorted({f"{r['workload']} b{r['batch']}" for r in records}, key=lambda s: (s.split()[0], int(s.split()[1][1:])))
    series = {name: [next(r["tok_s"] for r in records if f"{r['workload']} b{r['batch']}" == l and r["engine"] == name)
                     for l in labels] for name in engines}
    bar_plot(RESULTS / f"spec_{args.device}.png", labels, series, "tokens/s", f"n-gram speculation ({args.device})")


if __name__ == "__main__":
    main()
