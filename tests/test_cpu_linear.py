"""bfloat16 projections on the CPU with oneDNN's prepacked weights (`models/cpu_linear.py`): the
same numbers as `F.linear`, and the engine's greedy output unchanged by the packing."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from constrained_spec import SamplingParams
from constrained_spec.engine import Engine
from constrained_spec.models import cpu_linear
from constrained_spec.models.cpu_linear import PackedLinear, prepack_available

pytestmark = pytest.mark.skipif(not prepack_available(), reason="this torch build has no oneDNN linear ops")


@pytest.mark.parametrize("rows", [1, 8, 37])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_f_linear(rows, bias):
    torch.manual_seed(rows)
    w = torch.randn(96, 64, dtype=torch.bfloat16)
    b = torch.randn(96, dtype=torch.bfloat16) if bias else None
    x = torch.randn(rows, 64, dtype=torch.bfloat16)
    packed = PackedLinear(w, b)
    ref = F.linear(x, w, b)
    torch.testing.assert_close(packed(x), ref, rtol=1.6e-2, atol=1e-2)  # bf16 rounding at most
    assert packed(x.view(1, rows, 64)).shape == (1, rows, 96)


def test_engine_output_unchanged_by_packing(tiny_qwen2_dir, monkeypatch):
    """Greedy tokens of a bf16 CPU engine (tiny Qwen2: qkv bias, tied head) with and without the
    prepacked weights."""
    prompts = [[1, 17, 230, 4005, 88 + i, 9] for i in range(4)]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)

    def run():
        eng = Engine(model=tiny_qwen2_dir, device="cpu", dtype="bfloat16", kv_cache_slots=512)
        try:
            return eng, [o.token_ids for o in eng.generate(prompts, params)]
        finally:
            eng.shutdown()
    eng, packed = run()
    assert eng.runner.model.packed_head is not None
    assert any(isinstance(m, PackedLinear) for m in eng.runner.model.modules())
    monkeypatch.setattr(cpu_linear, "prepack_available", lambda: False)
    eng, plain = run()
    assert eng.runner.model.packed_head is None
    assert packed == plain
