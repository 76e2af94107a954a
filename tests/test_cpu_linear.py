"""bfloat16 projections on the CPU with prepacked weights (`models/cpu_linear.py`): oneDNN's
layout gives `F.linear`'s numbers bit for bit; the AMX kernel (native/amx_linear.h) gives the
float32 sum rounded once, row by row whatever the batch; the engine's greedy output is the same
on either."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from constrained_spec import SamplingParams
from constrained_spec.engine import Engine
from constrained_spec.kernels import cpu_native
from constrained_spec.models import cpu_linear
from constrained_spec.models.cpu_linear import PackedLinear, prepack_available

needs_onednn = pytest.mark.skipif(not prepack_available(), reason="this torch build has no oneDNN linear ops")
needs_amx = pytest.mark.skipif(not cpu_native.amx_linear_available(),
                               reason="no AMX-BF16 on this CPU/OS (or the native module lacks the kernel)")


@pytest.fixture
def onednn_only(monkeypatch):
    monkeypatch.setattr(cpu_native, "amx_linear_available", lambda: False)


def _exact(x, w, b):
    """The float32 (in fact float64) sum, rounded once to bfloat16: what the AMX kernel should give
    up to the float32 accumulation's own rounding."""
    out = x.double() @ w.double().T
    return (out if b is None else out + b.double()).to(torch.bfloat16)


@needs_onednn
@pytest.mark.parametrize("rows", [1, 8, 37])
@pytest.mark.parametrize("bias", [False, True])
def test_onednn_packed_linear_equals_f_linear(rows, bias, onednn_only):
    torch.manual_seed(rows)
    w = torch.randn(96, 64, dtype=torch.bfloat16)
    b = torch.randn(96, dtype=torch.bfloat16) if bias else None
    x = torch.randn(rows, 64, dtype=torch.bfloat16)
    packed = PackedLinear(w, b)
    assert not packed.amx
    torch.testing.assert_close(packed(x), F.linear(x, w, b), rtol=0, atol=0)
    assert packed(x.view(1, rows, 64)).shape == (1, rows, 96)


@needs_amx
@pytest.mark.parametrize("rows", [1, 8, 16, 17, 37])
@pytest.mark.parametrize("out_features", [96, 50, 1000])  # 50: a block's tail; 1000: groups of several blocks
@pytest.mark.parametrize("bias", [False, True])
def test_amx_linear_is_the_rounded_float_sum(rows, out_features, bias):
    torch.manual_seed(rows * out_features)
    w = torch.randn(out_features, 128, dtype=torch.bfloat16)
    b = torch.randn(out_features, dtype=torch.bfloat16) if bias else None
    x = torch.randn(rows, 128, dtype=torch.bfloat16)
    packed = PackedLinear(w, b)
    assert packed.amx
    out, exact = packed(x), _exact(x, w, b)
    # float32 accumulation: at most a bfloat16 ulp from the exact sum's rounding, and mostly equal
    torch.testing.assert_close(out, exact, rtol=8e-3, atol=1e-2)
    assert (out == exact).float().mean() > 0.95
    assert packed(x.view(1, rows, 128)).shape == (1, rows, out_features)


@needs_amx
def test_amx_linear_rows_do_not_depend_on_the_batch():
    torch.manual_seed(0)
    w, x = torch.randn(200, 96, dtype=torch.bfloat16), torch.randn(40, 96, dtype=torch.bfloat16)
    packed = PackedLinear(w, None)
    batched = packed(x)
    for r in (0, 15, 16, 39):
        assert torch.equal(packed(x[r:r + 1]), batched[r:r + 1])
    assert torch.equal(packed(x[10:30]), batched[10:30])


@needs_amx
@needs_onednn
def test_onednn_still_right_after_amx_calls():
    """Both use the AMX tiles on the same threads: ours must leave them so that oneDNN's next call
    (which configures its own) is right."""
    torch.manual_seed(1)
    w, x = torch.randn(256, 64, dtype=torch.bfloat16), torch.randn(8, 64, dtype=torch.bfloat16)
    ours = PackedLinear(w, None)
    onednn = torch.ops.mkldnn._reorder_linear_weight(w, None)
    for _ in range(3):
        ours(x)
        torch.testing.assert_close(torch.ops.mkldnn._linear_pointwise(x, onednn, None, "none", [], ""),
                                   F.linear(x, w), rtol=0, atol=0)


@needs_amx
def test_amx_checks_what_would_corrupt_memory():
    w = torch.randn(64, 64, dtype=torch.bfloat16)
    assert not cpu_native.amx_linear_fits(torch.randn(64, 48, dtype=torch.bfloat16))  # k not a multiple of 32
    assert not cpu_native.amx_linear_fits(w.float())
    assert not PackedLinear(torch.randn(64, 48, dtype=torch.bfloat16), None).amx or not prepack_available()
    packed = cpu_native.amx_pack(w)
    with pytest.raises(ValueError, match="does not match"):
        cpu_native.amx_linear(torch.randn(4, 32, dtype=torch.bfloat16), packed, 64)
    with pytest.raises(ValueError, match="does not match"):
        cpu_native.amx_linear(torch.randn(64, 4, dtype=torch.bfloat16).t(), packed, 64)
    with pytest.raises(ValueError, match="does not fit"):
        cpu_native.amx_pack(torch.randn(64, 48, dtype=torch.bfloat16))


@needs_amx
def test_bf16_engine_is_batch_invariant_on_amx(smollm2_dir):
    """Each AMX projection row depends on its own input only, so a bf16 CPU engine's greedy tokens
    for a prompt are the same alone and in a batch (acceptance 2 in bfloat16). On oneDNN they were
    not: 6 of 8 of benchmarks/common.py's story prompts changed within 64 tokens."""
    eng = Engine(model=smollm2_dir, device="cpu", dtype="bfloat16", kv_cache_slots=2048)
    try:
        assert all(m.amx for m in eng.runner.model.modules() if isinstance(m, PackedLinear))
        prompts = [eng.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                                     add_generation_prompt=True)
                   for text in ("Write a short story about a lighthouse keeper.", "Hi!",
                                "List three facts about the moon, then explain tides in detail to a child.",
                                "Write a short story about a robot who learns to paint.")]
        prompts = [list(p["input_ids"] if hasattr(p, "keys") else p) for p in prompts]
        params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
        batched = [o.token_ids for o in eng.generate(prompts, params)]
        alone = [eng.generate([p], params)[0].token_ids for p in prompts]
    finally:
        eng.shutdown()
    assert batched == alone


@pytest.mark.skipif(not (prepack_available() or cpu_native.amx_linear_available()),
                    reason="neither oneDNN's linear ops nor AMX here")
def test_packed_logits_as_close_to_float32_as_f_linear(smollm2_dir, monkeypatch):
    """The packed bf16 model's logits (AMX where here, else oneDNN) are as close to the float32
    model's as bf16 `F.linear`'s are: the packing costs no accuracy."""
    from constrained_spec.attention import AttentionMetadata, ForwardMode, KVCache
    from constrained_spec.attention.torch_backend import TorchAttention
    from constrained_spec.models import load_model

    ids = torch.tensor([1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411])
    T = len(ids)
    slots = torch.arange(1, T + 1)
    meta = AttentionMetadata(ForwardMode.EXTEND, slots, torch.tensor([0, T], dtype=torch.int32),
                             torch.tensor([T], dtype=torch.int32), torch.tensor([T], dtype=torch.int32),
                             slots.view(1, T), T, T)

    def logits(dtype, pack):
        loaded = load_model(smollm2_dir, dtype=dtype, device="cpu")
        if pack:
            assert cpu_linear.prepack_bf16_linears(loaded.model)
        cfg = loaded.config
        kv = KVCache(cfg.num_layers, T + 1, cfg.num_kv_heads, cfg.head_dim, dtype, "cpu")
        with torch.inference_mode():
            hidden = loaded.model(ids, torch.arange(T), kv, meta, TorchAttention())
            return loaded.model.compute_logits(hidden).float()
    ref = logits(torch.float32, False)
    err_plain = (logits(torch.bfloat16, False) - ref).abs().mean()
    err_packed = (logits(torch.bfloat16, True) - ref).abs().mean()
    print(f"mean |logit - float32 logit|: F.linear {err_plain:.6f}, packed {err_packed:.6f}")
    assert err_packed <= 1.25 * err_plain, (err_packed, err_plain)


def test_bf16_engine_runs_on_any_cpu(tiny_llama_dir):
    """An explicit dtype="bfloat16" serves on every CPU: the projections are prepacked where oneDNN's
    bfloat16 path or AMX runs here and stay on `F.linear` elsewhere (an AVX2-only CPU, where the
    oneDNN reorder raised and the server died at start)."""
    eng = Engine(model=tiny_llama_dir, device="cpu", dtype="bfloat16", kv_cache_slots=256)
    try:
        packed = [m for m in eng.runner.model.modules() if isinstance(m, PackedLinear)]
        assert bool(packed) == (prepack_available() or cpu_native.amx_linear_available())
        out = eng.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    finally:
        eng.shutdown()
    assert len(out[0].token_ids) == 8
