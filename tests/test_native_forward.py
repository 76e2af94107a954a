"""The bfloat16 CPU decode step in one native call (`models/native_forward.py`): hidden states and
KV cache bit for bit those of `CausalLM.forward` (the same kernels in the same order), on the real
SmolLM2 and on tiny Llama (untied head, llama3 RoPE) and Qwen2 (qkv bias) models; the engine uses
it for decode steps and its greedy tokens are the Python forward's."""
from __future__ import annotations

import pytest
import torch

from constrained_spec import SamplingParams
from constrained_spec import kernels as K
from constrained_spec.attention import AttentionMetadata, ForwardMode, KVCache
from constrained_spec.attention.torch_backend import TorchAttention
from constrained_spec.engine import Engine
from constrained_spec.kernels import cpu_native
from constrained_spec.models import load_model
from constrained_spec.models.cpu_linear import prepack_bf16_linears
from constrained_spec.models.native_forward import NativeForward
from grammar_pin import PINNED

pytestmark = pytest.mark.skipif(not cpu_native.amx_linear_available(),
                                reason="the native decode step needs AMX-BF16 (this CPU/OS lacks it)")


def _meta(mode, slots, q_lens, kv_lens, table):
    q_lens, kv_lens = torch.tensor(q_lens, dtype=torch.int32), torch.tensor(kv_lens, dtype=torch.int32)
    starts = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    starts[1:] = torch.cumsum(q_lens, 0)
    return AttentionMetadata(mode, slots, starts, q_lens, kv_lens, table, int(q_lens.max()), int(kv_lens.max()))


def _prefilled(model, cfg, prompt_lens, gen):
    """A KV cache holding prompts of these lengths (sequence b in slots b * 64 + 1 ...), and the
    decode step's metadata for one new token each."""
    B = len(prompt_lens)
    kv = KVCache(cfg.num_layers, B * 64 + 1, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16, "cpu")
    table = torch.arange(B * 64).view(B, 64) + 1
    ids = torch.randint(0, cfg.vocab_size, (sum(prompt_lens),), generator=gen)
    pos = torch.cat([torch.arange(n) for n in prompt_lens])
    slots = torch.cat([table[b, :n] for b, n in enumerate(prompt_lens)])
    with torch.inference_mode():
        model(ids, pos, kv, _meta(ForwardMode.EXTEND, slots, prompt_lens, prompt_lens, table), TorchAttention())
    new_pos = torch.tensor(prompt_lens)
    decode = _meta(ForwardMode.DECODE, table[torch.arange(B), new_pos].contiguous(), [1] * B,
                   [n + 1 for n in prompt_lens], table)
    return kv, torch.randint(0, cfg.vocab_size, (B,), generator=gen), new_pos, decode


@pytest.mark.parametrize("which", ["smollm2", "tiny_llama", "tiny_qwen2"])
def test_native_step_is_the_forward_bit_for_bit(which, request):
    path = request.getfixturevalue(f"{which}_dir")
    loaded = load_model(path, dtype=torch.bfloat16, device="cpu")
    model, cfg = loaded.model, loaded.config
    prepack_bf16_linears(model)
    step = NativeForward.build(model)
    assert step is not None
    kv, ids, pos, meta = _prefilled(model, cfg, [5, 17, 1, 40], torch.Generator().manual_seed(0))
    kv_native = KVCache(cfg.num_layers, kv.num_slots, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16, "cpu")
    kv_native.k.copy_(kv.k)
    kv_native.v.copy_(kv.v)
    with torch.inference_mode():
        ref = model(ids, pos, kv, meta, TorchAttention())
        out = step(ids, pos, kv_native, meta)
    assert torch.equal(out, ref)
    assert torch.equal(kv_native.k, kv.k) and torch.equal(kv_native.v, kv.v)


def _verify_meta(prompt_lens, n):
    """A verify step over the prefilled sequences: n draft nodes each (a tree: 1 and 2 under the
    root, 3 under 1), in the table columns after the context."""
    B = len(prompt_lens)
    table = torch.arange(B * 64).view(B, 64) + 1
    parents = [-1, 0, 0, 1][:n]
    mask = torch.zeros(B, n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            mask[:, i, j] = True
            j = parents[j]
    depth = mask.sum(-1)[0] - 1
    slots = torch.cat([table[b, p:p + n] for b, p in enumerate(prompt_lens)])
    positions = torch.cat([p + depth for p in prompt_lens])
    meta = _meta(ForwardMode.VERIFY, slots, [n] * B, [p + n for p in prompt_lens], table)
    meta.tree_mask = mask
    return positions, meta


@pytest.mark.parametrize("which", ["smollm2", "tiny_qwen2"])
def test_native_verify_step_is_the_forward_bit_for_bit(which, request):
    loaded = load_model(request.getfixturevalue(f"{which}_dir"), dtype=torch.bfloat16, device="cpu")
    model, cfg = loaded.model, loaded.config
    prepack_bf16_linears(model)
    step = NativeForward.build(model)
    prompt_lens = [5, 17, 40]
    kv, _, _, _ = _prefilled(model, cfg, prompt_lens, torch.Generator().manual_seed(2))
    positions, meta = _verify_meta(prompt_lens, 4)
    ids = torch.randint(0, cfg.vocab_size, (len(positions),), generator=torch.Generator().manual_seed(3))
    kv_native = KVCache(cfg.num_layers, kv.num_slots, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16, "cpu")
    kv_native.k.copy_(kv.k)
    kv_native.v.copy_(kv.v)
    assert step.applies(meta)
    with torch.inference_mode():
        ref = model(ids, positions, kv, meta, TorchAttention())
        out = step(ids, positions, kv_native, meta)
    assert torch.equal(out, ref)
    assert torch.equal(kv_native.k, kv.k) and torch.equal(kv_native.v, kv.v)


def test_native_step_checks_its_inputs(tiny_qwen2_dir):
    loaded = load_model(tiny_qwen2_dir, dtype=torch.bfloat16, device="cpu")
    prepack_bf16_linears(loaded.model)
    step = NativeForward.build(loaded.model)
    kv, ids, pos, meta = _prefilled(loaded.model, loaded.config, [3, 4], torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match="positions"):
        step(ids, pos.int(), kv, meta)
    meta.out_slots = torch.tensor([1, kv.num_slots + 5])
    with pytest.raises(IndexError):
        step(ids, pos, kv, meta)


def test_not_built_where_it_does_not_apply(smollm2_dir, monkeypatch):
    fp32 = load_model(smollm2_dir, dtype=torch.float32, device="cpu").model
    assert NativeForward.build(fp32) is None
    bf16 = load_model(smollm2_dir, dtype=torch.bfloat16, device="cpu").model
    assert NativeForward.build(bf16) is None  # projections not packed
    monkeypatch.setattr(cpu_native, "amx_linear_available", lambda: False)
    prepack_bf16_linears(bf16)  # oneDNN's layout
    assert NativeForward.build(bf16) is None


def test_engine_steps_natively_with_the_forwards_tokens(smollm2_dir, monkeypatch):
    calls = []
    real = NativeForward.__call__
    monkeypatch.setattr(NativeForward, "__call__", lambda self, *a: calls.append(1) or real(self, *a))
    eng = Engine(model=smollm2_dir, device="cpu", dtype="bfloat16", kv_cache_slots=1024)
    try:
        prompts = [eng.chat_prompt([{"role": "user", "content": f"Write a short story about {t}."}])
                   for t in ("the sea", "bread", "prime numbers")]
        params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
        native = [o.token_ids for o in eng.generate(prompts, params)]
        assert len(calls) == 24  # every step: the prefill and 23 decode steps
        eng.runner.native_forward = None
        python = [o.token_ids for o in eng.generate(prompts, params)]
        K.set_fused_kernels(False)  # the reference kernels: the native step must step aside
        try:
            eng.runner.native_forward = NativeForward.build(eng.runner.model)
            calls.clear()
            eng.generate(prompts[:1], SamplingParams(max_tokens=3, temperature=0))
            assert not calls
        finally:
            K.set_fused_kernels(True)
    finally:
        eng.shutdown()
    assert native == python


def test_bf16_ngram_speculation_keeps_the_plain_text(smollm2_dir):
    """Verified draft tokens get the bits decoding them would (tree attention, row-independent AMX
    projections), so n-gram speculation in bfloat16 changes no greedy token: JSON and free text,
    batched. (Before, with SDPA verifying and oneDNN projecting, 0 of 8 JSON requests matched.)"""
    from constrained_spec.grammar import GrammarSpec
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                               "skills": {"type": "array", "items": {"type": "string"}}},
              "required": ["name", "age", "skills"], "additionalProperties": False}
    topics = ("a chef", "a pilot", "a violinist", "a beekeeper")
    outputs = []
    for spec in ({}, {"speculative_algorithm": "ngram", "speculative_policy": "always", "speculative_min_accept": 0.0}):
        eng = Engine(model=smollm2_dir, device="cpu", dtype="bfloat16", kv_cache_slots=2048, grammar_backend=PINNED,
                     **spec)
        try:
            json_prompts = [eng.chat_prompt([{"role": "user", "content": f"Give a JSON profile of {t}."}])
                            for t in topics]
            story = [eng.chat_prompt([{"role": "user", "content": f"Repeat after me three times: {t} is here."}])
                     for t in topics[:2]]
            json_out = eng.generate(json_prompts, SamplingParams(max_tokens=64, temperature=0),
                                    GrammarSpec.json_schema(schema))
            story_out = eng.generate(story, SamplingParams(max_tokens=40, temperature=0))
            outputs.append([o.token_ids for o in json_out + story_out])
            if spec:
                assert eng.spec.stats.accepted_tokens > 40  # it speculated every step, and drafts were accepted
        finally:
            eng.shutdown()
    assert outputs[0] == outputs[1]
