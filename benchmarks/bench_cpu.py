"""CPU, one run: this engine vs transformers.generate (+ xgrammar's logits processor) on SmolLM2,
batch 1 and 8, plain and JSON-schema. Greedy; plain runs a fixed number of tokens, JSON runs
until the grammar ends. The engine runs twice: decoding plainly, and with n-gram speculation
(default settings: the measured policy decodes plainly where speculation does not pay); greedy
verification is lossless, so both emit the same tokens (the table checks it).
Writes benchmarks/results/cpu_vs_hf.{json,md,png}."""
from __future__ import annotations

import argparse
import time

import torch

from common import PERSON_SCHEMA, RESULTS, bar_plot, chat_prompts, hf_generate, machine, markdown_table, write_results


def run_engine(engine, prompts, max_tokens, grammar, fixed_length):
    from constrained_spec import SamplingParams
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=fixed_length)
    t0 = time.perf_counter()
    outs = engine.generate(prompts, sp, grammar)
    dt = time.perf_counter() - t0
    return sum(o.completion_tokens for o in outs), dt, outs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--plain-tokens", type=int, default=64)
    ap.add_argument("--json-tokens", type=int, default=128)
    args = ap.parse_args()

    import xgrammar as xgr
    from transformers import AutoModelForCausalLM
    from constrained_spec.engine import Engine
    from constrained_spec.grammar import GrammarSpec
    from constrained_spec.models import resolve_model_path

    path = resolve_model_path(args.model)
    engine = Engine(model=path, device="cpu")
    spec_engine = Engine(model=path, device="cpu", speculative_algorithm="ngram")
    tok = engine.tokenizer
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=hf.config.vocab_size)
    compiled = xgr.GrammarCompiler(info).compile_json_schema(PERSON_SCHEMA)
    spec = GrammarSpec.json_schema(PERSON_SCHEMA)

    rows, records = [], []
    for bs in [int(b) for b in args.batches.split(",")]:
        for kind in ("plain", "json"):
            prompts = chat_prompts(tok, bs, json_task=kind == "json")
            fixed = kind == "plain"
            n_tok = args.plain_tokens if fixed else args.json_tokens
            grammar = spec if kind == "json" else None
            run_engine(engine, prompts[:1], 4, grammar, False)  # warm-up
            ours_n, ours_dt, ours_outs = run_engine(engine, prompts, n_tok, grammar, fixed)
            run_engine(spec_engine, prompts[:1], 4, grammar, False)
            spec_engine.spec.reset_drafter()  # no drafting from the warm-up's output
            st = spec_engine.spec.stats
            before = (st.verified_requests, st.accepted_tokens)
            spec_n, spec_dt, spec_outs = run_engine(spec_engine, prompts, n_tok, grammar, fixed)
            accepted_len = 1 + (st.accepted_tokens - before[1]) / max(st.verified_requests - before[0], 1)
            same = sum(a.token_ids == b.token_ids for a, b in zip(ours_outs, spec_outs))
            hf_generate(hf, tok, prompts[:1], 4, compiled if kind == "json" else None)  # warm-up
            hf_n, hf_dt = hf_generate(hf, tok, prompts, n_tok, compiled if kind == "json" else None, fixed_length=fixed)
            ours_tps, spec_tps, hf_tps = ours_n / ours_dt, spec_n / spec_dt, hf_n / hf_dt
            rows.append([bs, kind, ours_n, round(ours_tps, 1), round(spec_tps, 1), hf_n, round(hf_tps, 1),
                         round(ours_tps / hf_tps, 2), round(spec_tps / hf_tps, 2), f"{same}/{len(prompts)}"])
            records.append(dict(batch=bs, workload=kind, ours_tokens=ours_n, ours_seconds=ours_dt, ours_tok_s=ours_tps,
                                spec_tokens=spec_n, spec_seconds=spec_dt, spec_tok_s=spec_tps,
                                spec_mean_accepted_len=accepted_len,
                                spec_identical_outputs=same, hf_tokens=hf_n, hf_seconds=hf_dt, hf_tok_s=hf_tps,
                                speedup=ours_tps / hf_tps, spec_speedup=spec_tps / hf_tps))
            print(rows[-1], flush=True)
    engine.shutdown()
    spec_engine.shutdown()
    md = ("# CPU: constrained-spec vs transformers.generate + xgrammar (SmolLM2-135M, fp32, greedy)\n\n"
          "ours: plain decoding; + n-gram: the same engine with `--speculative-algorithm ngram` (identical = "
          "requests whose tokens equal the plain engine's).\n\n"
          + markdown_table(["batch", "workload", "ours tokens", "ours tok/s", "ours + n-gram tok/s", "HF tokens",
                            "HF tok/s", "speedup", "speedup + n-gram", "identical"], rows))
    write_results("cpu_vs_hf", {"machine": machine(), "results": records}, md)
    labels = [f"b{r['batch']} {r['workload']}" for r in records]
    bar_plot(RESULTS / "cpu_vs_hf.png", labels, {"constrained-spec": [r["ours_tok_s"] for r in records],
                                                 "constrained-spec + n-gram": [r["spec_tok_s"] for r in records],
                                                 "HF + xgrammar": [r["hf_tok_s"] for r in records]},
             "tokens/s", "SmolLM2-135M on CPU (2 cores)")


if __name__ == "__main__":
    main()
