"""Quick GPU check without real weights: a random-weight SmolLM2-shaped model through the engine,
CUDA graphs + overlap against eager, plain / JSON / sampled / speculative, with step times.
Usage: python benchmarks/gpu_graph_check.py TOKENIZER_DIR"""
from __future__ import annotations

import sys
import time

import torch

from constrained_spec import SamplingParams
from constrained_spec.engine import Engine
from constrained_spec.grammar import GrammarSpec
from constrained_spec.models.config import ModelConfig
from transformers import AutoTokenizer

from common import random_weights

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "n": {"type": "integer"}},
          "required": ["name", "n"], "additionalProperties": False}


def random_smollm2(tok):
    cfg = ModelConfig(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                      num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
                      rope_scaling=None, max_position=8192, tie_word_embeddings=True, qkv_bias=False,
                      eos_token_ids=[2])
    return random_weights(cfg, tok, torch.bfloat16, "cuda", 0.05, "random-smollm2")


def timed(engine, prompts, sp, grammar):
    s0 = engine.stats.steps
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = engine.generate(prompts, sp, grammar)
    dt = time.perf_counter() - t0
    return outs, 1000 * dt / max(engine.stats.steps - s0, 1), sum(o.completion_tokens for o in outs) / dt


def main():
    tok = AutoTokenizer.from_pretrained(sys.argv[1])
    loaded = random_smollm2(tok)
    prompts = None
    if "--spec-only" in sys.argv:
        return check_spec(loaded)
    eng = Engine(loaded=loaded, device="cuda", kv_cache_memory_gb=2, speculative_algorithm=None)
    prompts = [eng.chat_prompt([{"role": "user", "content": f"Say something {i}"}]) for i in range(64)]
    g = GrammarSpec.json_schema(SCHEMA)
    graphs = eng.runner.graphs
    print("| case | batch | graphs+overlap ms/step | tok/s | eager ms/step | identical |")
    for bs in (1, 8, 64):
        for name, sp, gr in (("greedy plain", SamplingParams(max_tokens=96, temperature=0, ignore_eos=True), None),
                             ("greedy json", SamplingParams(max_tokens=96, temperature=0), g),
                             ("sampled json", SamplingParams(max_tokens=96, temperature=0.8, seed=1), g)):
            timed(eng, prompts[:bs], sp, gr)
            a, ms_a, tps = timed(eng, prompts[:bs], sp, gr)
            eng.runner.graphs, eng.config.disable_overlap = None, True
            b, ms_b, _ = timed(eng, prompts[:bs], sp, gr)
            eng.runner.graphs, eng.config.disable_overlap = graphs, False
            same = sum(x.token_ids == y.token_ids for x, y in zip(a, b))
            print(f"| {name} | {bs} | {ms_a:.3f} | {tps:.0f} | {ms_b:.3f} | {same}/{bs} |", flush=True)
    eng.shutdown()
    check_spec(loaded)


def check_spec(loaded):
    g = GrammarSpec.json_schema(SCHEMA)
    spec = Engine(loaded=loaded, device="cuda", kv_cache_memory_gb=2, speculative_algorithm="ngram")
    plain = Engine(loaded=loaded, device="cuda", kv_cache_memory_gb=2)
    prompts = [plain.chat_prompt([{"role": "user", "content": f"Say something {i}"}]) for i in range(64)]
    for bs in (1, 8):
        sp = SamplingParams(max_tokens=96, temperature=0)
        a, ms_a, tps_a = timed(spec, prompts[:bs], sp, g)
        b, ms_b, tps_b = timed(plain, prompts[:bs], sp, g)
        print(f"spec b{bs}: identical {sum(x.token_ids == y.token_ids for x, y in zip(a, b))}/{bs}, "
              f"spec {tps_a:.0f} tok/s vs plain {tps_b:.0f}, mean accepted {spec.spec.stats.mean_accepted:.2f}")
    pool = spec.runner.pool
    print("pool full again:", pool.num_free == pool.capacity)


if __name__ == "__main__":
    main()
