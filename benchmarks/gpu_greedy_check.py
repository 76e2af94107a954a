"""Correctness of every GPU fast path, teacher-forced (see tests/greedy_check.py): greedy tokens of
each engine configuration against a float32 reference forward of the same weights.

Usage: python benchmarks/gpu_greedy_check.py [TOKENIZER_DIR]   (random SmolLM2-shaped weights)
       python benchmarks/gpu_greedy_check.py --real           (SmolLM2-135M-Instruct)
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from greedy_check import Reference, check_greedy  # noqa: E402

from constrained_spec import SamplingParams  # noqa: E402
from constrained_spec.engine import Engine  # noqa: E402
from constrained_spec.grammar import GrammarSpec  # noqa: E402

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
          "required": ["name", "age", "tags"], "additionalProperties": False}
CONFIGS = {
    "triton graphs+overlap": dict(),
    "triton graphs, no overlap": dict(disable_overlap=True),
    "triton eager+overlap": dict(disable_cuda_graph=True),
    "triton eager, no overlap": dict(disable_cuda_graph=True, disable_overlap=True),
    "torch eager": dict(attention_backend="torch"),
    "ngram spec chain": dict(speculative_algorithm="ngram", ngram_branches=1),
    "ngram spec tree": dict(speculative_algorithm="ngram", ngram_branches=3),
}


def load(real: bool, dtype: torch.dtype, tok_dir: str | None):
    from constrained_spec.models import load_model, resolve_model_path
    if real:
        return load_model(resolve_model_path(None), dtype=dtype, device="cuda")
    from transformers import AutoTokenizer
    from gpu_graph_check import random_smollm2
    loaded = random_smollm2(AutoTokenizer.from_pretrained(tok_dir))
    loaded.model.to(dtype)
    return loaded


def main():
    real = "--real" in sys.argv
    tok_dir = next((a for a in sys.argv[1:] if not a.startswith("--")), ".device/tok")
    rows = []
    for dtype, names, tol in ((torch.float32, list(CONFIGS), 1e-3),
                              (torch.bfloat16, ["triton graphs+overlap", "torch eager"], 0.5)):
        loaded = load(real, dtype, tok_dir)
        ref = Reference(loaded.model)
        prompts = None
        for name in names:
            eng = Engine(loaded=loaded, device="cuda", kv_cache_memory_gb=1, max_running_requests=32, **CONFIGS[name])
            prompts = prompts or [eng.chat_prompt([{"role": "user", "content": f"Describe person number {i} briefly."}])
                                  for i in range(16)]
            for kind, grammar in (("plain", None), ("json", GrammarSpec.json_schema(SCHEMA))):
                outs = eng.generate(prompts, SamplingParams(max_tokens=48, temperature=0), grammar)
                c = check_greedy(eng, ref, prompts, [o.token_ids for o in outs], grammar, tol=tol)
                rows.append((str(dtype).split(".")[-1], name, kind, c.tokens, c.violations, round(c.worst, 5),
                             c.first_bad))
                print("| " + " | ".join(map(str, rows[-1])) + " |", flush=True)
            eng.shutdown()
        del ref, loaded
        torch.cuda.empty_cache()
    print("\n| dtype | config | workload | tokens | beyond tol | worst margin | first bad (req, pos) |")
    for r in rows:
        print("| " + " | ".join(map(str, r)) + " |")


if __name__ == "__main__":
    main()
