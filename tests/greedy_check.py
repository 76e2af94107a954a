"""Teacher-forced check of greedy outputs.

Exact token equality between two fast paths is a brittle test on a GPU: kernels that sum in a
different order flip near-ties, and the texts diverge from there. This check is exact where it
matters: every token the engine emitted must be the argmax of a float32 reference forward over the
same weights (torch attention, one prefill of prompt + output, TF32 off), after the grammar mask,
up to `tol` logits. A wrong KV slot, a stale input or a bad mask row shows up as a margin of whole
logits; rounding shows up as a margin near zero.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from constrained_spec.attention.base import AttentionMetadata, ForwardMode, KVCache
from constrained_spec.attention.torch_backend import TorchAttention


@dataclass
class Check:
    tokens: int
    violations: int
    worst: float  # the largest (reference max - reference logit of the emitted token)
    first_bad: tuple[int, int] | None  # (request, position) of the first token beyond tol


class Reference:
    """A float32 copy of the engine's model over its own small KV cache."""

    def __init__(self, model: torch.nn.Module, num_slots: int = 4096):
        self.model = copy.deepcopy(model).float()
        p = next(self.model.parameters())
        cfg = self.model.config
        self.device = p.device
        self.kv = KVCache(cfg.num_layers, num_slots, cfg.num_kv_heads, cfg.head_dim, torch.float32, p.device)
        self.backend = TorchAttention()

    @torch.inference_mode()
    def logits(self, ids: list[int]) -> torch.Tensor:
        """Logits [len(ids), V] of one causal prefill over `ids`."""
        n, dev = len(ids), self.device
        tf32 = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False
        try:
            meta = AttentionMetadata(
                mode=ForwardMode.EXTEND, out_slots=torch.arange(n, device=dev),
                q_starts=torch.tensor([0, n], dtype=torch.int32, device=dev),
                q_lens=torch.tensor([n], dtype=torch.int32, device=dev),
                kv_lens=torch.tensor([n], dtype=torch.int32, device=dev),
                slot_table=torch.arange(n, device=dev).unsqueeze(0), max_q_len=n, max_kv_len=n)
            hidden = self.model(torch.tensor(ids, device=dev), torch.arange(n, device=dev), self.kv, meta,
                                self.backend)
            return self.model.compute_logits(hidden).float().cpu()
        finally:
            torch.backends.cuda.matmul.allow_tf32 = tf32


def _allowed(bitmask_row: torch.Tensor, vocab: int) -> torch.Tensor:
    bits = (bitmask_row.unsqueeze(1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.flatten()[:vocab].bool()


def check_greedy(engine, ref: Reference, prompts: list[list[int]], outputs: list[list[int]], grammar=None,
                 tol: float = 1e-3) -> Check:
    compiled = engine.compile_grammar(grammar) if grammar is not None else None
    tokens = violations = 0
    worst, first_bad = 0.0, None
    for r, (prompt, out) in enumerate(zip(prompts, outputs)):
        if not out:
            continue
        logits = ref.logits(prompt + out[:-1])[len(prompt) - 1:]
        if compiled is not None:
            matcher = engine.grammar.matcher(compiled)
            bitmask = engine.grammar.allocate_bitmask(1)
        for j, tok in enumerate(out):
            row = logits[j, :engine.runner.vocab_size]
            if compiled is not None:
                engine.grammar.reset_bitmask(bitmask)
                matcher.fill_bitmask(bitmask, 0)
                row = row.masked_fill(~_allowed(bitmask[0], row.numel()), float("-inf"))
                if not matcher.accept_token(tok):
                    raise AssertionError(f"request {r} token {j}: {tok} violates the grammar")
            margin = float(row.max() - row[tok])
            tokens += 1
            worst = max(worst, margin)
            if margin > tol:
                violations += 1
                first_bad = first_bad or (r, j)
    return Check(tokens, violations, worst, first_bad)
