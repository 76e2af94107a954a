"""Acceptance: our forward (torch attention backend over the slot KV cache) matches `transformers`
on the same weights — logits within fp32 rounding, and greedy continuations token for token.

Measured on CPU fp32 (2 cores): SmolLM2-135M max |Δlogit| ≈ 2e-5..1e-4 (logits span ~±30);
tiny random Llama/Qwen2 ≈ 1e-6. Tolerances below leave ~10x headroom.
"""
from __future__ import annotations

import pytest
import torch

from constrained_spec.attention.base import AttentionMetadata, ForwardMode, KVCache
from constrained_spec.attention.torch_backend import TorchAttention

LOGIT_TOL = {"smollm2": 1e-3, "tiny_llama": 1e-4, "tiny_qwen2": 1e-4}
PROMPT = [{"role": "user", "content": "Write a short story about a robot who learns to paint."}]


# -- a minimal hand-built runner over the KV cache --------------------------------------------------

def make_meta(mode: ForwardMode, contexts: list[list[int]], q_lens: list[int], device) -> AttentionMetadata:
    """contexts[b]: KV slots of sequence b's whole context (its last q_lens[b] are the new tokens)."""
    B, K = len(contexts), max(len(c) for c in contexts)
    table = torch.zeros(B, K, dtype=torch.int64)
    for b, c in enumerate(contexts):
        table[b, :len(c)] = torch.tensor(c)
    out = torch.tensor([s for c, q in zip(contexts, q_lens) for s in c[len(c) - q:]], dtype=torch.int64)
    ql = torch.tensor(q_lens, dtype=torch.int32)
    starts = torch.zeros(B + 1, dtype=torch.int32)
    starts[1:] = torch.cumsum(ql, 0)
    return AttentionMetadata(mode=mode, out_slots=out.to(device), q_starts=starts.to(device), q_lens=ql.to(device),
                             kv_lens=torch.tensor([len(c) for c in contexts], dtype=torch.int32, device=device),
                             slot_table=table.to(device), max_q_len=max(q_lens), max_kv_len=K)


class Runner:
    def __init__(self, model, num_slots: int = 512):
        p = next(model.parameters())
        cfg = model.config
        self.model, self.device = model, p.device
        self.kv = KVCache(cfg.num_layers, num_slots, cfg.num_kv_heads, cfg.head_dim, p.dtype, p.device)
        self.backend = TorchAttention()

    @torch.inference_mode()
    def step(self, seqs: list[tuple[list[int], int, list[int]]], mode=ForwardMode.EXTEND) -> torch.Tensor:
        """seqs: (new token ids, position of the first one, slots of the whole context). Returns logits [T, V]."""
        ids = torch.tensor([t for toks, _, _ in seqs for t in toks], device=self.device)
        pos = torch.tensor([p + i for toks, p, _ in seqs for i in range(len(toks))], device=self.device)
        meta = make_meta(mode, [c for _, _, c in seqs], [len(t) for t, _, _ in seqs], self.device)
        hidden = self.model(ids, pos, self.kv, meta, self.backend)
        return self.model.compute_logits(hidden).float()

    def prefill(self, ids: list[int], start_slot: int = 0) -> torch.Tensor:
        return self.step([(ids, 0, list(range(start_slot, start_slot + len(ids))))])

    def greedy(self, ids: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
        logits = self.prefill(ids)[-1]
        out, steps = [], [logits]
        for i in range(n):
            tok = int(logits.argmax())
            out.append(tok)
            if i == n - 1:
                break
            ctx = list(range(len(ids) + len(out)))
            logits = self.step([([tok], len(ctx) - 1, ctx)], ForwardMode.DECODE)[-1]
            steps.append(logits)
        return out, steps


# -- fixtures ---------------------------------------------------------------------------------------

def _hf_model(path, dtype=torch.float32, device="cpu"):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager").to(device).eval()


@pytest.fixture(scope="module")
def pair(request, smollm2, tiny_llama_dir, tiny_qwen2_dir):
    """(our model, transformers model, prompt ids, eos ids) for one of the three test models."""
    from constrained_spec.models import load_model
    cache = request.node.__dict__.setdefault("_pairs", {})

    def get(name):
        if name not in cache:
            if name == "smollm2":
                ours = smollm2
            else:
                ours = load_model(tiny_llama_dir if name == "tiny_llama" else tiny_qwen2_dir, dtype=torch.float32)
            hf = _hf_model(ours.path)
            ids = ours.tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=True)
            ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
            cache[name] = (ours, hf, ids)
        return cache[name]
    return get


MODELS = ["smollm2", "tiny_llama", "tiny_qwen2"]


# -- tests ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", MODELS)
def test_prefill_logits_match_transformers(pair, name):
    ours, hf, ids = pair(name)
    mine = Runner(ours.model).prefill(ids)
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0].float()
    diff = (mine - ref).abs().max().item()
    print(f"{name}: prefill of {len(ids)} tokens, max |dlogit| = {diff:.2e} (logit range ±{ref.abs().max():.1f})")
    assert diff < LOGIT_TOL[name]
    assert torch.equal(mine.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("name", MODELS)
def test_greedy_64_tokens_match_generate(pair, name):
    ours, hf, ids = pair(name)
    mine, step_logits = Runner(ours.model).greedy(ids, 64)
    with torch.inference_mode():
        out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          do_sample=False, max_new_tokens=64, output_logits=True, return_dict_in_generate=True)
    ref = out.sequences[0, len(ids):].tolist()
    # transformers stops at EOS; we don't: its output must be a prefix of ours, ending at an EOS.
    if len(ref) < 64:
        assert ref[-1] in ours.eos_token_ids, ref
    assert mine[:len(ref)] == ref, f"diverged at {next(i for i, (a, b) in enumerate(zip(mine, ref)) if a != b)}"
    assert len(ref) >= 32, "prompt ended too early to test 64 decode steps"
    diff = max((a - b.float()[0]).abs().max().item() for a, b in zip(step_logits, out.logits))
    print(f"{name}: {len(ref)} greedy tokens identical; max |dlogit| over decode steps = {diff:.2e}")
    assert diff < LOGIT_TOL[name]


@pytest.mark.parametrize("name", ["smollm2", "tiny_qwen2"])
def test_batched_prefill_equals_single(pair, name):
    ours, _, ids = pair(name)
    a, b = ids, ids[3:20]
    single_a = Runner(ours.model).prefill(a)
    single_b = Runner(ours.model).prefill(b)
    # one batch, two sequences of different lengths, non-contiguous slot ranges
    slots_a, slots_b = list(range(100, 100 + len(a))), list(range(7, 7 + len(b)))
    both = Runner(ours.model).step([(a, 0, slots_a), (b, 0, slots_b)])
    da = (both[:len(a)] - single_a).abs().max().item()
    db = (both[len(a):] - single_b).abs().max().item()
    print(f"{name}: batched vs single max |dlogit| = {da:.2e}, {db:.2e}")
    assert da < 1e-4 and db < 1e-4


@pytest.mark.parametrize("name", ["smollm2", "tiny_llama"])
def test_chunked_prefill_equals_one_prefill(pair, name):
    ours, _, ids = pair(name)
    whole = Runner(ours.model).prefill(ids)
    r = Runner(ours.model)
    cut = len(ids) // 2 + 1
    first = r.step([(ids[:cut], 0, list(range(cut)))])
    second = r.step([(ids[cut:], cut, list(range(len(ids))))])  # extend over the cached prefix
    chunked = torch.cat([first, second])
    diff = (chunked - whole).abs().max().item()
    print(f"{name}: chunked vs one prefill max |dlogit| = {diff:.2e}")
    assert diff < 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["smollm2", "tiny_qwen2"])
def test_cuda_bf16_matches_transformers(smollm2_dir, tiny_qwen2_dir, name):
    from constrained_spec.models import load_model
    path = smollm2_dir if name == "smollm2" else tiny_qwen2_dir
    ours = load_model(path, dtype="auto", device="cuda")
    assert next(ours.model.parameters()).dtype == torch.bfloat16
    hf = _hf_model(path, torch.bfloat16, "cuda")
    ref32 = _hf_model(path, torch.float32, "cuda")
    ids = ours.tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    mine = Runner(ours.model).prefill(ids)
    with torch.inference_mode():
        ref = hf(torch.tensor([ids], device="cuda")).logits[0].float()
        exact = ref32(torch.tensor([ids], device="cuda")).logits[0].float()
    ours_err = (mine - exact).abs().max().item()
    hf_err = (ref - exact).abs().max().item()
    diff = (mine - ref).abs().max().item()
    top1 = exact.argmax(-1)
    ours_agree = (mine.argmax(-1) == top1).float().mean().item()
    hf_agree = (ref.argmax(-1) == top1).float().mean().item()
    # bf16 has 8 mantissa bits: our error against fp32 must be of the order of transformers' own
    assert ours_err < 2 * hf_err + 0.1
    assert ours_agree >= hf_agree - 0.15
    # decode over the bf16 KV cache agrees with a bf16 re-prefill of the same context
    toks, steps = Runner(ours.model).greedy(ids, 16)
    again = Runner(ours.model).prefill(ids + toks[:-1])[len(ids) - 1:]
    cache_err = (torch.stack(steps) - again).abs().max().item()
    print(f"{name} bf16: max |ours-hf| {diff:.3f}; vs fp32: ours {ours_err:.3f}, hf {hf_err:.3f}; "
          f"top-1 vs fp32: ours {ours_agree:.2f}, hf {hf_agree:.2f}; decode vs re-prefill {cache_err:.3f}")
    assert cache_err < 2 * hf_err + 0.1
    # fp32 on CUDA: as tight as on CPU
    ours32 = load_model(path, dtype=torch.float32, device="cuda")
    err32 = (Runner(ours32.model).prefill(ids) - exact).abs().max().item()
    print(f"{name} fp32 cuda: max |ours-hf| {err32:.2e}")
    assert err32 < LOGIT_TOL[name]
