"""GPU throughput, one command, one run: the engine with its Triton attention, CUDA graphs and overlap.

SmolLM2-135M bf16 (real weights) at batch 1..128, plain vs JSON schema under each grammar backend
(`--grammar-backends`: xgrammar, llguidance), with CUDA graphs and overlap toggled on one engine; transformers.generate + xgrammar (default and static cache) as the
baseline; random-weight Llama-3-8B shapes at batch 1 against the weight-streaming floor.
Writes benchmarks/results/gpu.{json,md,png}.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from common import (PERSON_SCHEMA, RESULTS, bar_plot, chat_prompts, hf_generate, machine, markdown_table,
                    random_weights, write_results)


def measure(engine, prompts, params, grammar):
    """params: one SamplingParams for all prompts, or one per prompt."""
    st = engine.stats

    def grammar_s():  # engine-thread grammar time: accepting tokens, filling bitmasks
        return st.grammar_mask_seconds + st.grammar_accept_seconds
    steps0, mask0 = st.decode_steps + st.extend_steps, grammar_s()
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params, grammar)
    dt = time.perf_counter() - t0
    steps = st.decode_steps + st.extend_steps - steps0
    tokens = sum(o.completion_tokens for o in outs)
    return dict(tokens=tokens, seconds=dt, tok_s=tokens / dt, steps=steps, step_ms=1000 * dt / max(steps, 1),
                mask_ms_per_step=1000 * (grammar_s() - mask0) / max(steps, 1),
                finish=[o.finish_reason.value for o in outs][:4], lengths=[o.completion_tokens for o in outs])


def copy_bandwidth() -> float:
    x = torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    y.copy_(x)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    torch.cuda.synchronize()
    return 2 * x.numel() * 10 / (time.perf_counter() - t0)  # read + write bytes per second


def random_llama3_8b(tokenizer):
    from constrained_spec.models.config import ModelConfig
    cfg = ModelConfig(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                      num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
                      rope_scaling=None, max_position=8192, tie_word_embeddings=False, qkv_bias=False,
                      eos_token_ids=[tokenizer.eos_token_id])
    return random_weights(cfg, tokenizer, torch.bfloat16, "cuda", 0.02, "llama-3-8b-shapes (random)")


def run_hf(path, tok, max_new_tokens):
    """transformers.generate + xgrammar, default and static cache, batch 1 and 32."""
    import xgrammar as xgr
    from transformers import AutoModelForCausalLM
    records = []
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=hf.config.vocab_size)
    compiled = xgr.GrammarCompiler(info).compile_json_schema(PERSON_SCHEMA)
    for cache in ("dynamic", "static"):
        kw = {"cache_implementation": "static"} if cache == "static" else {}
        for bs in (1, 32):
            for kind in ("plain", "json"):
                prompts = chat_prompts(tok, bs, json_task=True)
                g = compiled if kind == "json" else None
                # warm-up twice: the static cache compiles for the exact generation settings (length,
                # min_new_tokens), so it warms up with the timed call's; an 8-token warm-up left a
                # 50 s compile in the timed batch-1 plain run (results/gpu_s7c.md)
                warm = (max_new_tokens, kind == "plain") if cache == "static" else (8, False)
                for _ in range(2):
                    hf_generate(hf, tok, prompts, warm[0], g, fixed_length=warm[1], **kw)
                n, dt = hf_generate(hf, tok, prompts, max_new_tokens, g, fixed_length=kind == "plain", **kw)
                records.append(dict(cache=cache, batch=bs, workload=kind, tokens=n, seconds=dt, tok_s=n / dt,
                                    step_ms=1000 * dt / max_new_tokens))
                print(records[-1], flush=True)
    del hf
    torch.cuda.empty_cache()
    return records


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,8,32,64,128")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--hf-tokens", type=int, default=64)
    ap.add_argument("--skip-8b", action="store_true")
    ap.add_argument("--repeats", type=int, default=3,
                    help="timed runs of the JSON and the 'plain, json lengths' workloads (graphs + overlap), "
                         "alternating; the table takes the median (a batch-128 run lasts ~0.25 s, and these "
                         "hosts' jitter moved single-run ratios by 0.1)")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the script (graph modes are then all eager)")
    ap.add_argument("--opt", action="append", default=[], metavar="KEY=VALUE",
                    help="engine option for our engine, e.g. grammar_mask_threads=1 (repeatable; A/B runs)")
    ap.add_argument("--name", default=None, help="results file name (default gpu)")
    ap.add_argument("--grammar-backends", default="xgrammar,llguidance",
                    help="backends the JSON workload runs under, one table row each (default: %(default)s)")
    args = ap.parse_args()
    opts = {k: json.loads(v) for k, v in (o.split("=", 1) for o in args.opt)}
    from constrained_spec import SamplingParams
    from constrained_spec.engine import Engine
    from constrained_spec.grammar import GrammarSpec
    from constrained_spec.models import resolve_model_path

    path = resolve_model_path(None)
    t0 = time.perf_counter()
    engine = Engine(model=path, device=args.device, **opts)
    startup = time.perf_counter() - t0
    tok = engine.tokenizer
    backends = args.grammar_backends.split(",")
    specs = {b: GrammarSpec.json_schema(PERSON_SCHEMA).with_backend(b) for b in backends}
    spec = specs[backends[0]]  # the 8B shapes' JSON runs
    graphs = engine.runner.graphs
    modes = {"graphs+overlap": (graphs, False), "graphs, no overlap": (graphs, True), "no graphs, overlap": (None, False)}
    records = []
    greedy = SamplingParams(max_tokens=args.tokens, temperature=0)
    for bs in [int(b) for b in args.batches.split(",")]:
        prompts = chat_prompts(tok, bs, json_task=True)  # same prompts: only the constraint differs
        json_lengths = {}
        # "plain, json lengths": each request unconstrained for as many tokens as its JSON answer took
        # (under that backend), so the batch drains exactly as in the JSON run and the two differ only
        # by the grammar work
        for kind in ("plain",) + tuple(f"json/{b}" for b in backends) + tuple(f"plain, json lengths/{b}" for b in backends):
            backend = kind.split("/")[1] if "/" in kind else None
            grammar = specs[backend] if kind.startswith("json") else None
            if kind.startswith("json"):
                params = greedy
            elif kind == "plain":
                params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
            else:
                params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in json_lengths[backend]]
            for mode, (g, no_overlap) in modes.items():
                if (kind.startswith("plain, json lengths") and mode != "graphs+overlap") or \
                        (kind.startswith("json") and mode == "no graphs, overlap"):
                    continue
                engine.runner.graphs, engine.config.disable_overlap = g, no_overlap
                measure(engine, prompts, SamplingParams(max_tokens=8, temperature=0), grammar)  # warm-up
                r = measure(engine, prompts, params, grammar)
                if kind.startswith("json") and backend not in json_lengths:
                    json_lengths[backend] = r["lengths"]
                records.append(dict(model="SmolLM2-135M", batch=bs, workload=kind, mode=mode, repeat=0, **r))
                print(records[-1], flush=True)
        engine.runner.graphs, engine.config.disable_overlap = graphs, False
        for rep in range(1, args.repeats):  # the ratio's two workloads again, alternating
            for backend in backends:
                for kind in (f"json/{backend}", f"plain, json lengths/{backend}"):
                    params = greedy if kind.startswith("json") else [
                        SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in json_lengths[backend]]
                    r = measure(engine, prompts, params, specs[backend] if kind.startswith("json") else None)
                    records.append(dict(model="SmolLM2-135M", batch=bs, workload=kind, mode="graphs+overlap",
                                        repeat=rep, **r))
                    print(records[-1], flush=True)
    engine.runner.graphs, engine.config.disable_overlap = graphs, False
    engine.shutdown()

    hf_records = [] if args.skip_hf else run_hf(path, tok, args.hf_tokens)

    bw = copy_bandwidth() if args.device == "cuda" else float("nan")
    big = []
    if not args.skip_8b:
        loaded = random_llama3_8b(tok)
        weight_bytes = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
        eng = Engine(loaded=loaded, device="cuda", max_running_requests=64)
        prompts = chat_prompts(tok, 32, json_task=True)
        for bs in (1, 32):
            for kind in ("plain", "json"):
                grammar = spec if kind == "json" else None
                measure(eng, prompts[:bs], SamplingParams(max_tokens=8, temperature=0), grammar)
                r = measure(eng, prompts[:bs], SamplingParams(max_tokens=64, temperature=0, ignore_eos=kind == "plain"),
                            grammar)
                floor_ms = 1000 * weight_bytes / bw
                big.append(dict(model="Llama-3-8B shapes (random)", batch=bs, workload=kind, floor_ms=floor_ms,
                                vs_floor=r["step_ms"] / floor_ms, weight_gb=weight_bytes / 1e9, **r))
                print(big[-1], flush=True)
        eng.shutdown()

    # ----- report
    def runs(bs, kind, mode):
        return [r for r in records if r["batch"] == bs and r["workload"] == kind and r["mode"] == mode]

    def find(bs, kind, mode):  # the median run by tok/s
        found = sorted(runs(bs, kind, mode), key=lambda r: r["tok_s"])
        return found[(len(found) - 1) // 2]
    rows = []
    for bs in sorted({r["batch"] for r in records}):
        p, pg = find(bs, "plain", "graphs+overlap"), find(bs, "plain", "no graphs, overlap")
        for backend in backends:
            j, jn = find(bs, f"json/{backend}", "graphs+overlap"), find(bs, f"json/{backend}", "graphs, no overlap")
            pj = find(bs, f"plain, json lengths/{backend}", "graphs+overlap")
            pairs = [a["tok_s"] / b["tok_s"] for a, b in zip(runs(bs, f"json/{backend}", "graphs+overlap"),
                                                              runs(bs, f"plain, json lengths/{backend}", "graphs+overlap"))]
            rows.append([bs, backend, round(p["tok_s"]), round(pj["tok_s"]), round(j["tok_s"]),
                         round(j["tok_s"] / pj["tok_s"], 3), f"{min(pairs):.2f}-{max(pairs):.2f}",
                         round(p["step_ms"], 3), round(j["step_ms"], 3), round(jn["step_ms"], 3),
                         round(jn["mask_ms_per_step"], 3), round(j["mask_ms_per_step"], 3), round(pg["step_ms"], 3)])
    md = ["# GPU: SmolLM2-135M bf16, greedy, CUDA graphs + overlap (default) and ablations\n",
          f"Startup (load + graph capture): {startup:.1f} s. Copy bandwidth {bw / 1e12:.2f} TB/s; "
          f"SmolLM2 floor {1000 * 269e6 / bw:.3f} ms/step.\n",
          f"plain: {args.tokens} tokens per request; plain, json lengths: each request as many tokens as its JSON answer "
          "(the batch drains as in the JSON run, so json / that = the cost of the grammar alone). json and plain "
          f"(json lengths) with graphs + overlap: the median of {args.repeats} alternating runs each (run by run: each "
          "json run over the plain run after it). Grammar CPU (no "
          "overlap): the engine thread's time accepting tokens and filling masks per step, all of it in the step's "
          "path; holding the engine thread (overlap): what of it the overlapped loop still waits for.\n\n",
          markdown_table(["batch", "grammar backend", "plain tok/s", "plain (json lengths) tok/s", "json tok/s", "json / plain (json lengths)",
                          "json / plain, run by run (min-max)",
                          "plain ms/step", "json ms/step", "json ms/step (no overlap)", "grammar CPU ms/step (no overlap)",
                          "grammar ms/step holding the engine thread (overlap)", "plain ms/step (no graphs)"], rows),
          "\n## transformers.generate + xgrammar (bf16)\n",
          markdown_table(["cache", "batch", "workload", "tok/s", "ms/step"],
                         [[r["cache"], r["batch"], r["workload"], round(r["tok_s"], 1), round(r["step_ms"], 2)] for r in hf_records])]
    if big:
        md += ["\n## Llama-3-8B shapes, random bf16 weights\n",
               markdown_table(["batch", "workload", "tok/s", "ms/step", "floor ms", "x floor"],
                              [[r["batch"], r["workload"], round(r["tok_s"], 1), round(r["step_ms"], 3),
                                round(r["floor_ms"], 3), round(r["vs_floor"], 3)] for r in big])]
    name = (args.name or "gpu") if args.device == "cuda" else f"gpu_script_smoke_{args.device}"  # never over GPU results
    write_results(name, {"machine": machine(), "engine_options": opts, "grammar_backends": backends, "startup_s": startup, "copy_bandwidth": bw, "engine": records,
                          "hf": hf_records, "llama3_8b_shapes": big}, "".join(md))
    labels = [f"b{r[0]} {r[1][:3]}" for r in rows]
    bar_plot(RESULTS / f"{name}.png", labels, {"plain": [r[2] for r in rows], "plain (json lengths)": [r[3] for r in rows],
                                          "json schema": [r[4] for r in rows]},
             "tokens/s", "constrained-spec on H100, SmolLM2-135M bf16")


if __name__ == "__main__":
    main()
