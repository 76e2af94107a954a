"""CPU, one run: this engine vs transformers.generate (+ xgrammar's logits processor) on SmolLM2,
batch 1 and 8, plain and JSON-schema, with the weights in float32 and in bfloat16 (both engines). Greedy; plain runs a fixed number of tokens, JSON runs
until the grammar ends. The engine runs twice: decoding plainly, and with n-gram speculation
(default settings: the measured policy decodes plainly where speculation does not pay); greedy
verification is lossless, so both emit the same tokens (the table checks it). Each of the three
runs alone in the process (see `run_dtype`).
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
    ap.add_argument("--dtypes", default="float32,bfloat16",
                    help="weight dtypes, each run by both engines (bfloat16 uses the CPU's AMX / AVX512-BF16 units)")
    ap.add_argument("--plain-tokens", type=int, default=64)
    ap.add_argument("--json-tokens", type=int, default=128)
    args = ap.parse_args()

    from constrained_spec.models import resolve_model_path
    path = resolve_model_path(args.model)
    rows, records = [], []
    hf_fp32: dict[tuple, float] = {}  # (batch, workload) -> HF float32 tok/s, HF's default dtype on CPU
    for dtype in args.dtypes.split(","):
        for rec in run_dtype(path, dtype, [int(b) for b in args.batches.split(",")], args):
            if dtype == "float32":
                hf_fp32[rec["batch"], rec["workload"]] = rec["hf_tok_s"]
            base = hf_fp32.get((rec["batch"], rec["workload"]))
            rec["speedup_vs_hf_float32"] = rec["ours_tok_s"] / base if base else None
            rec["spec_speedup_vs_hf_float32"] = rec["spec_tok_s"] / base if base else None
            records.append(rec)
            rows.append([dtype, rec["batch"], rec["workload"], rec["ours_tokens"], round(rec["ours_tok_s"], 1),
                         round(rec["spec_tok_s"], 1), round(rec["hf_tok_s"], 1), round(rec["speedup"], 2),
                         round(rec["spec_speedup"], 2), _ratio(rec["speedup_vs_hf_float32"]),
                         _ratio(rec["spec_speedup_vs_hf_float32"]), f"{rec['spec_identical_outputs']}/{rec['batch']}"])
            print(rows[-1], flush=True)
    md = ("# CPU: constrained-spec vs transformers.generate + xgrammar (SmolLM2-135M, greedy)\n\n"
          + _machine_line() + "\n\n"
          "Each dtype row runs both engines with the weights in that dtype (HF: `from_pretrained(dtype=...)`). "
          "ours: plain decoding; + n-gram: the same engine with `--speculative-algorithm ngram` (identical = "
          "requests whose tokens equal the plain engine's); speedup: against HF in the same dtype; "
          "vs HF fp32: against HF's default CPU dtype (float32), the same batch and workload. The plain engine, "
          "the n-gram engine and HF each run alone in the process (one torch OpenMP pool at a time).\n\n"
          + markdown_table(["dtype", "batch", "workload", "ours tokens", "ours tok/s", "ours + n-gram tok/s",
                            "HF tok/s", "speedup", "speedup + n-gram", "ours vs HF fp32", "+ n-gram vs HF fp32",
                            "identical"], rows))
    write_results("cpu_vs_hf", {"machine": machine(), "results": records}, md)
    labels = [f"{r['dtype'][:4]} b{r['batch']} {r['workload']}" for r in records]
    bar_plot(RESULTS / "cpu_vs_hf.png", labels, {"constrained-spec": [r["ours_tok_s"] for r in records],
                                                 "constrained-spec + n-gram": [r["spec_tok_s"] for r in records],
                                                 "HF + xgrammar": [r["hf_tok_s"] for r in records]},
             "tokens/s", "SmolLM2-135M on CPU")


def _machine_line() -> str:
    m = machine()
    return (f"{m.get('cpu', 'CPU')}, {m['cpu_count']} cores, torch {m['torch']} ({m['torch_threads']} threads), "
            f"bf16 units: {', '.join(m.get('cpu_bf16_units') or ['none'])}")


def _ratio(x):
    return "-" if x is None else round(x, 2)


def run_dtype(path, dtype: str, batches: list[int], args) -> list[dict]:
    """Every (batch, workload) row with the weights of both engines in `dtype`.

    Each system runs alone in the process: the plain engine, then the n-gram engine (each shut down
    after its runs), then transformers on a short-lived thread. torch's OpenMP keeps a worker pool
    per thread that has run a parallel op, and with more pool threads than cores every pool stops
    spinning between parallel regions (`constrained_spec/engine/omp_pool.py`): on 2 cores a live
    engine beside transformers slowed both by ~1.5x."""
    from constrained_spec.engine.omp_pool import on_fresh_thread

    workloads = [(bs, kind) for bs in batches for kind in ("plain", "json")]
    ours, tok = _engine_runs(path, dtype, workloads, args, speculative=False)
    spec, _ = _engine_runs(path, dtype, workloads, args, speculative=True)
    hf = on_fresh_thread(lambda: _hf_runs(path, dtype, tok, workloads, args))
    records = []
    for (bs, kind), (ours_n, ours_dt, ours_outs), (spec_n, spec_dt, spec_outs, accepted_len), (hf_n, hf_dt) in zip(
            workloads, ours, spec, hf):
        same = sum(a.token_ids == b.token_ids for a, b in zip(ours_outs, spec_outs))
        ours_tps, spec_tps, hf_tps = ours_n / ours_dt, spec_n / spec_dt, hf_n / hf_dt
        records.append(dict(dtype=dtype, batch=bs, workload=kind, ours_tokens=ours_n, ours_seconds=ours_dt,
                            ours_tok_s=ours_tps, spec_tokens=spec_n, spec_seconds=spec_dt, spec_tok_s=spec_tps,
                            spec_mean_accepted_len=accepted_len, spec_identical_outputs=same,
                            hf_tokens=hf_n, hf_seconds=hf_dt, hf_tok_s=hf_tps,
                            speedup=ours_tps / hf_tps, spec_speedup=spec_tps / hf_tps))
    return records


def _workload(tok, bs: int, kind: str, args):
    """(prompts, max tokens, fixed length) of one row."""
    fixed = kind == "plain"
    return chat_prompts(tok, bs, json_task=not fixed), args.plain_tokens if fixed else args.json_tokens, fixed


def _engine_runs(path, dtype: str, workloads, args, speculative: bool):
    """One engine's runs of every workload: (tokens, seconds, outputs[, mean accepted length]) each,
    and the tokenizer."""
    from constrained_spec.engine import Engine
    from constrained_spec.grammar import GrammarSpec

    engine = Engine(model=path, device="cpu", dtype=dtype, **({"speculative_algorithm": "ngram"} if speculative else {}))
    spec = GrammarSpec.json_schema(PERSON_SCHEMA)
    runs = []
    for bs, kind in workloads:
        prompts, n_tok, fixed = _workload(engine.tokenizer, bs, kind, args)
        grammar = spec if kind == "json" else None
        run_engine(engine, prompts, 4, grammar, False)  # warm-up at the batch size (first-call costs)
        if not speculative:
            runs.append(run_engine(engine, prompts, n_tok, grammar, fixed))
            continue
        engine.spec.reset_drafter()  # no drafting from the warm-up's output
        st = engine.spec.stats
        before = (st.verified_requests, st.accepted_tokens)
        n, dt, outs = run_engine(engine, prompts, n_tok, grammar, fixed)
        accepted_len = 1 + (st.accepted_tokens - before[1]) / max(st.verified_requests - before[0], 1)
        runs.append((n, dt, outs, accepted_len))
    engine.shutdown()
    return runs, engine.tokenizer


def _hf_runs(path, dtype: str, tok, workloads, args):
    """transformers.generate (+ xgrammar for JSON) on every workload: (tokens, seconds) each."""
    import xgrammar as xgr
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=hf.config.vocab_size)
    compiled = xgr.GrammarCompiler(info).compile_json_schema(PERSON_SCHEMA)
    runs = []
    for bs, kind in workloads:
        prompts, n_tok, fixed = _workload(tok, bs, kind, args)
        grammar = compiled if kind == "json" else None
        # warm-up at the batch size: HF's first batch-8 JSON call once ran at 19 tok/s, the next at 140
        hf_generate(hf, tok, prompts, 4, grammar)
        runs.append(hf_generate(hf, tok, prompts, n_tok, grammar, fixed_length=fixed))
    return runs


if __name__ == "__main__":
    main()
