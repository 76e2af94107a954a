"""Host-side cost of a speculative step, without a GPU: a tiny random model (2 layers, hidden 64,
SmolLM2 vocabulary and tokenizer) on the CPU, so the model's own time is small and measured apart.

Per speculative step it reports
  * wall ms of `SpeculativeWorker.step`, the model's share (forward + logits), the rest, and the
    part of the rest outside what a CUDA graph would replay (the host's own work on a GPU);
  * torch ops launched outside the model: on a GPU each is a kernel launch (or a copy, or a sync)
    of ~27 us host time unless it sits inside a CUDA graph. Ops inside the verify body that the
    graph captures (`VerifyIO.forward`, when present) are counted apart.
Usage: python benchmarks/spec_host_profile.py [--steps 60] [--branches 1]
"""
from __future__ import annotations

import argparse
import time
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from constrained_spec import SamplingParams
from constrained_spec.engine import Engine
from constrained_spec.grammar import GrammarSpec
from constrained_spec.models import resolve_model_path
from constrained_spec.models.config import ModelConfig

from common import random_weights

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40}, "n": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4}},
          "required": ["name", "n", "tags"], "additionalProperties": False}


def tiny_model():
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(resolve_model_path(None))
    cfg = ModelConfig(model_type="llama", vocab_size=49152, hidden_size=64, intermediate_size=128, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
                      rope_scaling=None, max_position=2048, tie_word_embeddings=True, qkv_bias=False,
                      eos_token_ids=[2])
    return random_weights(cfg, tok, torch.float32, "cpu", 0.3, "tiny-random")


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = Counter()
        self.names = Counter()  # ops outside the model and the graph bodies, by name
        self.where = "host"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[self.where] += 1
        if self.where == "host":
            self.names[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


class Probe:
    """Wraps the model (and the graph-captured verify body when there is one) to split time and ops."""

    def __init__(self, engine):
        self.model_s = 0.0  # the model's forward and logits
        self.body_s = 0.0  # everything a CUDA graph replays (the model included), when VerifyIO exists
        self.counter: OpCounter | None = None
        model = engine.runner.model
        for name in ("forward", "compute_logits"):
            self._wrap(model, name, "model", timer="model_s")
        io_cls = _verify_io_class()
        if io_cls is not None:
            for name in ("forward", "tail", "commit"):
                self._wrap(io_cls, name, "graph body", timer="body_s")

    def _wrap(self, obj, name, where, timer):
        inner = getattr(obj, name)
        probe = self

        def wrapped(*a, **k):
            c = probe.counter
            prev = c.where if c else None
            if c and prev != "model":
                c.where = where
            t0 = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                setattr(probe, timer, getattr(probe, timer) + time.perf_counter() - t0)
                if c:
                    c.where = prev
        setattr(obj, name, wrapped)


def _verify_io_class():
    try:
        from constrained_spec.engine.spec_verify import VerifyIO
        return VerifyIO
    except ImportError:
        return None


def measure(engine, probe, prompts, grammar, count_ops: bool):
    spec = engine.spec
    inner = spec.step
    times, models, bodies, ops, names = [], [], [], Counter(), Counter()

    def step(batch):
        m0, b0 = probe.model_s, probe.body_s
        counter = OpCounter() if count_ops else None
        probe.counter = counter
        t0 = time.perf_counter()
        if counter:
            with counter:
                inner(batch)
            ops.update(counter.counts)
            names.update(counter.names)
        else:
            inner(batch)
        times.append(time.perf_counter() - t0)
        models.append(probe.model_s - m0)
        bodies.append(max(probe.body_s - b0, probe.model_s - m0))
        probe.counter = None
    spec.step = step
    try:
        engine.generate(prompts, SamplingParams(max_tokens=160, temperature=0, ignore_eos=True), grammar)
    finally:
        spec.step = inner
    n = max(len(times), 1)
    return dict(steps=len(times), step_ms=1000 * sum(times) / n, model_ms=1000 * sum(models) / n,
                host_ms=1000 * (sum(times) - sum(models)) / n, outside_graph_ms=1000 * (sum(times) - sum(bodies)) / n,
                ops_per_step={k: round(v / n, 1) for k, v in ops.items()},
                host_ops={k: round(v / n, 1) for k, v in names.most_common(8)},
                mean_accepted=round(spec.stats.mean_accepted, 2))


def _phases(stats, before=None):
    """Per-step host ms of each phase since `before` (SpecStats of the new step only)."""
    now = stats.phase_seconds() | {"steps": stats.steps}
    if before is None:
        return now
    steps = max(now["steps"] - before["steps"], 1)
    return {n: round(1000 * (now[n] - before[n]) / steps, 3) for n in stats.phase_seconds()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--branches", type=int, default=1)
    ap.add_argument("--batches", default="1,8")
    args = ap.parse_args()
    torch.set_num_threads(1)
    loaded = tiny_model()
    eng = Engine(loaded=loaded, device="cpu", speculative_algorithm="ngram", speculative_num_draft_tokens=8,
                 ngram_branches=args.branches, speculative_min_accept=0.0, speculative_policy="always",
                 kv_cache_slots=1 << 15,
                 max_running_requests=16)
    probe = Probe(eng)
    doc = "The station opened in 2019 and houses 14 researchers in winter and 31 in summer. " * 3
    for bs in [int(b) for b in args.batches.split(",")]:
        for wname, grammar, text in (("json", GrammarSpec.json_schema(SCHEMA), "Give a JSON profile"),
                                     ("plain", None, f"Document: {doc} Repeat the document.")):
            prompts = [eng.chat_prompt([{"role": "user", "content": f"{text} #{i}"}]) for i in range(bs)]
            measure(eng, probe, prompts, grammar, count_ops=False)  # warm-up
            phases = _phases(eng.spec.stats)
            timing = measure(eng, probe, prompts, grammar, count_ops=False)
            phases = _phases(eng.spec.stats, phases)
            counted = measure(eng, probe, prompts, grammar, count_ops=True)
            print(f"{wname:5s} b{bs}: {timing['steps']} steps, step {timing['step_ms']:.3f} ms = model "
                  f"{timing['model_ms']:.3f} + rest {timing['host_ms']:.3f} (outside what a graph replays: "
                  f"{timing['outside_graph_ms']:.3f}); torch ops/step {counted['ops_per_step']}"
                  f"\n    host-side ops by name {counted['host_ops']}\n    phases ms/step {phases}", flush=True)
    eng.shutdown()


if __name__ == "__main__":
    main()
