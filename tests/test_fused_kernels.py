"""Fused elementwise kernels (`constrained_spec.kernels`) vs their torch references.

* CPU: the model with the kernels is bit-for-bit the pre-fusion forward (an inline copy of the old
  code below), for Llama and Qwen2 (qkv bias); the references match the old math exactly.
* CPU, Triton interpreter (`TRITON_INTERPRET=1` must be set before triton is imported, hence a
  subprocess running this file): each Triton kernel vs its reference on small shapes, including
  non-power-of-2 widths (576, 1536), fp32 and bf16. Skipped when triton is not installed.
* GPU (`-m gpu`): the same at real sizes, plus CUDA-graph capture + replay of a SmolLM2-shaped
  model (Llama and Qwen2) at decode batch 1, 8, 16 and 17, against the torch-reference forward.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_CUDA = torch.cuda.is_available()

# (rows, width) for the norms / silu, (T, H, KVH, D) for RoPE, (rows, vocab, words) for the grammar mask
NORM_SHAPES = [(1, 576), (5, 576), (3, 64), (2, 1000), (4, 1536)]
ROPE_SHAPES = [(1, 9, 3, 64), (5, 9, 3, 64), (3, 4, 4, 32), (2, 14, 2, 128)]
MASK_SHAPES = [(4, 64, 2), (2, 50, 4), (5, 1000, 32), (3, 33, 2), (4, 31, 1), (3, 100, 2), (1, 4099, 129)]
# (rows, vocab, k) for the top-k log-probabilities (the EAGLE draft tail)
TOPK_SHAPES = [(4, 64, 4), (5, 1000, 4), (6, 5000, 2), (7, 4099, 8), (3, 33, 1)]


# ----------------------------------------------------------------------------------------------
# Shared comparison code (used by the interpreter subprocess and the GPU tests)
# ----------------------------------------------------------------------------------------------

def _tol(dtype):
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)


def check_kernels(device: str, dtype: torch.dtype, norm_shapes=NORM_SHAPES, rope_shapes=ROPE_SHAPES,
                  mask_shapes=MASK_SHAPES, topk_shapes=TOPK_SHAPES) -> None:
    from constrained_spec.kernels import reference as R
    from constrained_spec.kernels import triton_ops as T
    gen = torch.Generator().manual_seed(0)
    rnd = lambda *s: torch.randn(*s, generator=gen).to(device=device, dtype=dtype)  # noqa: E731
    tol = _tol(dtype)
    for rows, n in norm_shapes:
        x, res = rnd(rows, n), rnd(rows, n)
        w = (1 + 0.1 * torch.randn(n, generator=gen)).to(device=device, dtype=dtype)
        # rms_norm
        out = T.rms_norm(x, w, 1e-6)
        assert out.dtype == dtype and out.shape == x.shape
        torch.testing.assert_close(out.float(), R.rms_norm_ref(x, w, 1e-6).float(), **tol)
        # add_rms_norm: in place (x <- normed, res <- x + res)
        ref_out, ref_res = R.add_rms_norm_ref(x, res, w, 1e-6)
        xi, ri = x.clone(), res.clone()
        out, new_res = T.add_rms_norm(xi, ri, w, 1e-6)
        assert out.data_ptr() == xi.data_ptr() and new_res.data_ptr() == ri.data_ptr()
        if dtype == torch.float32 or device != "cpu":
            assert torch.equal(new_res, ref_res), "residual sum differs"
        else:  # the interpreter casts fp32 -> bf16 by truncation (GPU Triton rounds to nearest even)
            torch.testing.assert_close(new_res.float(), ref_res.float(), **tol)
        torch.testing.assert_close(out.float(), ref_out.float(), **tol)
        # silu_and_mul: [rows, 2n] -> [rows, n]
        gu = rnd(rows, 2 * n)
        out = T.silu_and_mul(gu)
        assert out.shape == (rows, n) and out.dtype == dtype
        torch.testing.assert_close(out.float(), R.silu_and_mul_ref(gu).float(), **tol)
    # fp32 weight with low-precision activations promotes like the reference
    if dtype != torch.float32:
        x, w = rnd(3, 576), torch.ones(576, device=device)
        torch.testing.assert_close(T.rms_norm(x, w, 1e-6), R.rms_norm_ref(x, w, 1e-6), atol=2e-2, rtol=2e-2)

    from constrained_spec.models.rope import inverse_frequencies
    for t, h, kvh, d in rope_shapes:
        cache = R.build_cos_sin_cache(inverse_frequencies(d, 10000.0, None), 256).to(device)
        # q/k as strided views of one fused qkv row, like the model's
        qkv = rnd(t, (h + 2 * kvh) * d)
        qkv_orig = qkv.clone()
        # positions as a strided column of a [T, 4] block, like the decode graph's metadata
        meta = torch.randint(0, 256, (t, 4), generator=gen).to(device)
        pos = meta[:, 1]
        q_ref, k_ref = [z.clone() for z in _split_qkv(qkv, h, kvh, d)[:2]]
        R.apply_rope_ref(q_ref, k_ref, pos, cache)
        q, k, v = _split_qkv(qkv, h, kvh, d)
        v_before = v.clone()
        q2, k2 = T.apply_rope(q, k, pos, cache)
        assert q2.data_ptr() == q.data_ptr() and k2.data_ptr() == k.data_ptr()
        torch.testing.assert_close(q.float(), q_ref.float(), **tol)
        torch.testing.assert_close(k.float(), k_ref.float(), **tol)
        assert torch.equal(v, v_before), "rope touched v"
        # fused with the KV store: rotated k and v land in their cache slots, q rotates in place
        q, k, v = _split_qkv(qkv_orig, h, kvh, d)
        k_cache, v_cache = torch.zeros(3 * t + 5, kvh, d, device=device, dtype=dtype), torch.zeros(
            3 * t + 5, kvh, d, device=device, dtype=dtype)
        slots = torch.randperm(3 * t + 5, generator=gen)[:t].to(device)
        T.apply_rope_and_store(q, k, v, pos, cache, k_cache, v_cache, slots)
        torch.testing.assert_close(q.float(), q_ref.float(), **tol)
        torch.testing.assert_close(k_cache[slots].float(), k_ref.float(), **tol)
        assert torch.equal(v_cache[slots], v), "v must be copied exactly"
        untouched = torch.ones(3 * t + 5, dtype=torch.bool, device=device)
        untouched[slots] = False
        assert not k_cache[untouched].any() and not v_cache[untouched].any(), "wrote outside the slots"

    for rows, vocab, words in mask_shapes:
        # logits as a row-strided view, like a slice of a padded buffer
        logits = rnd(rows, vocab + 3)[:, :vocab]
        bitmask = random_bitmask(rows, words, gen).to(device)
        out = T.mask_logits(logits, bitmask)
        assert out.dtype == dtype and out.shape == logits.shape
        assert torch.equal(out, R.mask_logits_ref(logits, bitmask)), (rows, vocab, words)
        assert torch.equal(out, expected_mask(logits, bitmask))
    check_topk(device, dtype, topk_shapes, gen)
    check_frontier(device, dtype, gen)
    check_place_frontier(device)


def check_frontier(device: str, dtype: torch.dtype, gen: torch.Generator) -> None:
    """speculative.frontier's kernel against its torch reference: recorded children and choices,
    the next frontier's tokens, scores, parents' outputs and ancestor rows (scores without ties,
    whose order the two may break differently; -inf children, as past a request's allowed tokens,
    included)."""
    from constrained_spec.speculative import frontier as F_
    for B, K, H, D, C in ((1, 4, 576, 6, 3), (5, 4, 64, 6, 8), (3, 2, 100, 3, 4), (2, 1, 32, 4, 2)):
        KK = K * K
        child_s = torch.randperm(B * KK, generator=gen).float().view(B, KK) - B * KK
        child_s[0, KK // 2:] = -torch.inf
        child_t = torch.randint(0, 50000, (B, KK), generator=gen)
        hidden = torch.randn(B * K, H, generator=gen).to(dtype)
        t = torch.tensor([1 + (B % (D - 1))])
        state = [torch.randint(0, 10 ** 6, (C * K, D), generator=gen),  # anc
                 torch.zeros(C, D, KK, dtype=torch.int64), torch.full((C, D, KK), -torch.inf),
                 torch.zeros(C, D, K, dtype=torch.int64),  # out_tok, out_score, out_best
                 torch.zeros(C * K, dtype=torch.int64), torch.zeros(C * K), torch.zeros(C * K, H, dtype=dtype)]
        ref = [x.clone() for x in state]
        F_.advance_frontier_ref(K, child_s, child_t, hidden, t, *ref)
        got = [x.to(device) for x in state]
        if device == "cpu":  # the interpreter: call the kernel itself
            F_._advance_kernel[(B,)](child_s, child_t, hidden, t, *got, hidden.stride(0), got[6].stride(0),
                                     got[0].stride(0), got[1].stride(0), got[1].stride(1), got[3].stride(0),
                                     got[3].stride(1), H, D, K=K, KK=KK, HBLOCK=triton_next_pow2(H),
                                     DBLOCK=triton_next_pow2(D))
        else:
            F_.advance_frontier(K, child_s.to(device), child_t.to(device), hidden.to(device), t.to(device), *got)
        for name, a, b in zip(("anc", "out_tok", "out_score", "out_best", "front_tok", "front_score", "parent_hidden"),
                              got, ref):
            assert torch.equal(a.cpu(), b), (name, B, K)


def check_place_frontier(device: str) -> None:
    """speculative.frontier's place kernel against its torch reference, rows near the table's end
    (columns clamped) included."""
    from constrained_spec.speculative import frontier as F_
    gen = torch.Generator().manual_seed(5)
    for N, K, D, M in ((4, 4, 6, 40), (8, 2, 3, 20), (1, 1, 4, 9)):
        t = torch.tensor([1 + N % D])
        own_base = 1000 + torch.arange(N) * 7
        n_rep = torch.randint(1, M, (N,), generator=gen)
        n_rep[0] = M - 2  # the last columns collapse on the row's end
        state = [torch.randint(0, 999, (N, D), generator=gen), torch.randint(0, 999, (N, M), generator=gen),
                 torch.zeros(N, dtype=torch.int64), torch.zeros(N, dtype=torch.int32), torch.zeros(N, dtype=torch.int64)]
        ref = [x.clone() for x in state]
        F_.place_frontier_ref(t, K, own_base, n_rep, *ref)
        got = [x.to(device) for x in state]
        if device == "cpu":  # the interpreter: call the kernel itself
            F_._place_kernel[(N,)](t, own_base, n_rep, *got, got[0].stride(0), got[1].stride(0), M, D, K=K,
                                   DBLOCK=triton_next_pow2(D))
        else:
            F_.place_frontier(t.to(device), K, own_base.to(device), n_rep.to(device), *got)
        for name, a, b in zip(("anc", "draft_table", "own", "kv_lens", "positions"), got, ref):
            assert torch.equal(a.cpu(), b), (name, N, K, D)


def triton_next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def check_topk(device: str, dtype: torch.dtype, shapes, gen: torch.Generator) -> None:
    """topk_logprobs against the reference: the same scores, and tokens that score them (ties may
    come in another order: bfloat16 logits tie often), distinct and allowed; -inf past a row's
    allowed tokens. Masks cycle through all allowed, none allowed and random bits, and one row
    allows two tokens only."""
    from constrained_spec.kernels import reference as R
    from constrained_spec.kernels import triton_ops as T
    for rows, vocab, k in shapes:
        logits = (3 * torch.randn(rows, vocab + 5, generator=gen)).to(device=device, dtype=dtype)[:, :vocab]
        words = (vocab + 31) // 32
        bitmask = random_bitmask(rows, words, gen).to(device)
        if rows > 3:
            bitmask[3] = 0
            bitmask[3, 0] = 0b101
        base = torch.randn(rows, generator=gen).to(device)
        for mask, b in ((bitmask, base), (None, None), (bitmask, None)):
            score, tok = T.topk_logprobs(logits, k, mask, b)
            ref_score, _ = R.topk_logprobs_ref(logits, k, mask, b)
            assert score.shape == (rows, k) and tok.dtype == torch.int64
            full = torch.log_softmax((logits if mask is None else R.mask_logits_ref(logits, mask)).float(), -1)
            full = torch.where(full.isnan(), -torch.inf, full) + (0 if b is None else b[:, None])
            finite = ref_score.isfinite()
            assert torch.equal(score.isfinite(), finite), (rows, vocab, k)
            torch.testing.assert_close(score[finite], ref_score[finite], atol=1e-4, rtol=1e-5)
            torch.testing.assert_close(full.gather(1, tok)[finite], ref_score[finite], atol=1e-4, rtol=1e-5)
            for r in range(rows):
                picked = tok[r][finite[r]].tolist()
                assert len(set(picked)) == len(picked) and all(0 <= t < vocab for t in tok[r].tolist())


def random_bitmask(rows: int, words: int, gen: torch.Generator) -> torch.Tensor:
    """Rows cycling through all allowed, none allowed, and random bits (the sign bit included)."""
    bm = torch.randint(-2 ** 31, 2 ** 31, (rows, words), generator=gen, dtype=torch.int64).to(torch.int32)
    bm[0::3] = -1
    bm[1::3] = 0
    return bm


def expected_mask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """The mask by definition: bit j of word i allows token 32 * i + j; tokens past the words are masked."""
    bits = (bitmask.cpu().long().unsqueeze(-1) >> torch.arange(32)) & 1  # [rows, words, 32]
    allowed = torch.zeros(logits.shape, dtype=torch.bool)
    n = min(logits.shape[1], bits[0].numel())
    allowed[:, :n] = bits.flatten(1)[:, :n].bool()
    return torch.where(allowed.to(logits.device), logits, torch.full_like(logits, float("-inf")))


def _split_qkv(qkv, h, kvh, d):
    t = qkv.shape[0]
    q, k, v = qkv.split([h * d, kvh * d, kvh * d], dim=-1)
    return q.view(t, h, d), k.view(t, kvh, d), v.view(t, kvh, d)


# ----------------------------------------------------------------------------------------------
# CPU: the model forward is unchanged
# ----------------------------------------------------------------------------------------------

def _cfg(model_type="llama", **kw):
    from constrained_spec.models.config import ModelConfig
    base = dict(model_type=model_type, vocab_size=512, hidden_size=576, intermediate_size=1536, num_layers=3,
                num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None,
                max_position=256, tie_word_embeddings=True, qkv_bias=model_type == "qwen2")
    base.update(kw)
    return ModelConfig(**base)


def _random_model(cfg, dtype=torch.float32, device="cpu", seed=0):
    from constrained_spec.models.loader import build_model
    model = build_model(cfg, dtype, device)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0, 0.02)
    return model.eval().requires_grad_(False)


def _prefill_meta(seq_lens, device="cpu"):
    from constrained_spec.attention import AttentionMetadata, ForwardMode
    B, K = len(seq_lens), max(seq_lens)
    table = torch.zeros(B, K, dtype=torch.int64)
    out, off = [], 1
    for b, L in enumerate(seq_lens):
        table[b, :L] = torch.arange(off, off + L)
        out += list(range(off, off + L))
        off += L
    ql = torch.tensor(seq_lens, dtype=torch.int32)
    starts = torch.zeros(B + 1, dtype=torch.int32)
    starts[1:] = torch.cumsum(ql, 0)
    return AttentionMetadata(mode=ForwardMode.EXTEND, out_slots=torch.tensor(out, device=device),
                             q_starts=starts.to(device), q_lens=ql.to(device), kv_lens=ql.to(device),
                             slot_table=table.to(device), max_q_len=K, max_kv_len=K)


def _legacy_tables(model, device):
    from constrained_spec.models.rope import inverse_frequencies
    cfg = model.config
    inv = inverse_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    freqs = torch.outer(torch.arange(cfg.max_position, dtype=torch.float32), inv)
    return (torch.cat([freqs.cos(), freqs.cos()], -1).to(device), torch.cat([freqs.sin(), freqs.sin()], -1).to(device))


def _legacy_forward(model, input_ids, positions, kv, meta, backend, tables=None):
    """The pre-fusion forward, verbatim math: separate RMSNorm ops, rope via cos/sin tables and
    rotate_half, F.silu(gate) * up, residual adds in the layer. Pass `tables` (from
    `_legacy_tables`) to make it CUDA-graph capturable."""
    def norm(mod, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + mod.eps)
        return mod.weight * x.to(dtype)

    cos_t, sin_t = tables if tables is not None else _legacy_tables(model, input_ids.device)

    def rot(x):
        half = x.shape[-1] // 2
        return torch.cat([-x[..., half:], x[..., :half]], -1)

    x = model.embed_tokens(input_ids)
    T = x.shape[0]
    for layer in model.layers:
        a = layer.self_attn
        h = norm(layer.input_layernorm, x)
        q, k, v = a.qkv_proj(h).split([a.q_size, a.kv_size, a.kv_size], dim=-1)
        q, k, v = q.view(T, a.num_heads, a.head_dim), k.view(T, a.num_kv_heads, a.head_dim), v.view(T, a.num_kv_heads, a.head_dim)
        cos = cos_t[positions].unsqueeze(1).to(q.dtype)
        sin = sin_t[positions].unsqueeze(1).to(q.dtype)
        q, k = q * cos + rot(q) * sin, k * cos + rot(k) * sin
        o = backend.forward(q, k, v, a.layer, kv, meta, a.scale)
        x = x + a.o_proj(o.reshape(T, a.q_size))
        gate, up = layer.mlp.gate_up_proj(norm(layer.post_attention_layernorm, x)).chunk(2, dim=-1)
        x = x + layer.mlp.down_proj(F.silu(gate) * up)
    return norm(model.norm, x)


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_cpu_forward_is_bit_identical_to_prefusion(model_type):
    from constrained_spec.attention import KVCache
    from constrained_spec.attention.torch_backend import TorchAttention
    cfg = _cfg(model_type)
    model = _random_model(cfg)
    seq_lens = [5, 3]
    ids = torch.randint(0, cfg.vocab_size, (sum(seq_lens),))
    pos = torch.cat([torch.arange(n) for n in seq_lens]) + 7
    outs = []
    for fwd in (model.forward, lambda *a: _legacy_forward(model, *a)):
        kv = KVCache(cfg.num_layers, 64, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
        with torch.inference_mode():
            outs.append((fwd(ids, pos, kv, _prefill_meta(seq_lens), TorchAttention()), kv.k.clone(), kv.v.clone()))
    (new, k1, v1), (old, k2, v2) = outs
    assert torch.equal(new, old), f"max diff {(new - old).abs().max().item():.3e}"
    assert torch.equal(k1, k2) and torch.equal(v1, v2)


def test_cpu_dispatch_uses_reference():
    """CPU tensors never go to Triton: the dispatchers equal the references exactly (bf16 too)."""
    from constrained_spec import kernels as K
    from constrained_spec.kernels import reference as R
    for dtype in (torch.float32, torch.bfloat16):
        x, r, w = torch.randn(4, 576).to(dtype), torch.randn(4, 576).to(dtype), torch.randn(576).to(dtype)
        assert torch.equal(K.rms_norm(x, w, 1e-6), R.rms_norm_ref(x, w, 1e-6))
        a, b = K.add_rms_norm(x.clone(), r.clone(), w, 1e-6)
        ra, rb = R.add_rms_norm_ref(x, r, w, 1e-6)
        assert torch.equal(a, ra) and torch.equal(b, rb) and torch.equal(b, x + r)
        gu = torch.randn(3, 2 * 1536).to(dtype)
        assert torch.equal(K.silu_and_mul(gu), F.silu(gu[:, :1536]) * gu[:, 1536:])
        logits, bm = torch.randn(6, 100).to(dtype), random_bitmask(6, 4, torch.Generator().manual_seed(1))
        assert torch.equal(K.mask_logits(logits, bm), expected_mask(logits, bm))


def test_rope_reference_matches_prefusion_tables():
    from constrained_spec.kernels import apply_rope
    from constrained_spec.models.rope import RotaryEmbedding, inverse_frequencies
    for scaling in (None, {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 64}):
        rope = RotaryEmbedding(64, 128, 10000.0, scaling)
        inv = inverse_frequencies(64, 10000.0, scaling)
        freqs = torch.outer(torch.arange(128, dtype=torch.float32), inv)
        assert torch.equal(rope.cos_sin_cache, torch.cat([freqs.cos(), freqs.sin()], -1))
        assert rope.cos_sin_cache.dtype == torch.float32
        q, k = torch.randn(6, 9, 64), torch.randn(6, 3, 64)
        pos = torch.tensor([0, 1, 5, 17, 64, 127])
        cos = torch.cat([freqs.cos(), freqs.cos()], -1)[pos].unsqueeze(1)
        sin = torch.cat([freqs.sin(), freqs.sin()], -1)[pos].unsqueeze(1)
        rot = lambda x: torch.cat([-x[..., 32:], x[..., :32]], -1)  # noqa: E731
        eq, ek = q * cos + rot(q) * sin, k * cos + rot(k) * sin
        q2, k2 = apply_rope(q, k, pos, rope.cos_sin_cache)
        assert q2 is q and torch.equal(q, eq) and torch.equal(k, ek)


# ----------------------------------------------------------------------------------------------
# CPU: Triton interpreter (subprocess, so TRITON_INTERPRET=1 is set before triton is imported)
# ----------------------------------------------------------------------------------------------

@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (the interpreter tests need it)")
def test_triton_interpreter_matches_reference():
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, __file__, "--interpret"], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "interpreter: ok" in proc.stdout


# ----------------------------------------------------------------------------------------------
# GPU
# ----------------------------------------------------------------------------------------------

gpu = pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON), reason="needs CUDA and triton")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gpu_kernels_match_reference(dtype):
    check_kernels("cuda", dtype,
                  norm_shapes=NORM_SHAPES + [(64, 576), (256, 1536), (300, 4096), (7, 8192)],
                  rope_shapes=ROPE_SHAPES + [(64, 9, 3, 64), (300, 32, 8, 128), (17, 28, 4, 128)],
                  mask_shapes=MASK_SHAPES + [(1, 49152, 1536), (128, 49152, 1536), (7, 151936, 4748), (3, 32001, 1001)])


@pytest.mark.gpu
@gpu
def test_gpu_mask_logits_cuda_graph_replay():
    """The graphed sample tail's shape: masks of fresh bitmask contents on every replay."""
    from constrained_spec import kernels as K
    from constrained_spec.kernels import reference as R
    gen = torch.Generator().manual_seed(3)
    B, V = 16, 49152
    logits = torch.randn(B, V, device="cuda")
    bitmask = torch.zeros(B, (V + 31) // 32, dtype=torch.int32, device="cuda")
    K.mask_logits(logits, bitmask)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = K.mask_logits(logits, bitmask)
    for _ in range(3):
        logits.normal_()
        bitmask.copy_(random_bitmask(B, bitmask.shape[1], gen))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, R.mask_logits_ref(logits, bitmask))


@pytest.mark.gpu
@gpu
def test_gpu_dispatch_and_model_close_to_reference():
    """The fused model on CUDA stays close to the torch-reference path, eager and graph-replayed."""
    from constrained_spec import kernels as K
    from constrained_spec.attention import KVCache
    from constrained_spec.attention.triton_backend import TritonAttention
    cfg = _cfg("qwen2", vocab_size=1024)
    model = _random_model(cfg, torch.bfloat16, "cuda")
    seq_lens = [9, 4]
    ids = torch.randint(0, cfg.vocab_size, (sum(seq_lens),), device="cuda")
    pos = torch.cat([torch.arange(n) for n in seq_lens]).cuda()
    outs = []
    for enabled in (False, True):
        K.set_fused_kernels(enabled)
        try:
            kv = KVCache(cfg.num_layers, 64, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16, "cuda")
            with torch.inference_mode():
                outs.append(model(ids, pos, kv, _prefill_meta(seq_lens, "cuda"), TritonAttention()).float())
        finally:
            K.set_fused_kernels(True)
    ref, new = outs
    err = (new - ref).abs().max().item()
    assert err < 0.05 * ref.abs().max().item() + 0.05, err


def _decode_meta(B: int, ctx: int, width: int, device="cuda"):
    """Decode metadata for B sequences of `ctx` tokens (the last one new), sequence b in slots
    b * width + 1 ...; slot 0 unused."""
    from constrained_spec.attention import AttentionMetadata, ForwardMode
    table = torch.arange(B * width, device=device).view(B, width) + 1
    return AttentionMetadata(ForwardMode.DECODE, table[:, ctx - 1].clone(),
                             torch.arange(B + 1, dtype=torch.int32, device=device),
                             torch.ones(B, dtype=torch.int32, device=device),
                             torch.full((B,), ctx, dtype=torch.int32, device=device), table, 1, width)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
@pytest.mark.parametrize("B", [1, 8, 16, 17])
def test_gpu_decode_cuda_graph_replay(model_type, B):
    """A SmolLM2-shaped model's decode step captured as a CUDA graph and replayed with new inputs:
    equal to the eager fused forward, and within bf16 tolerance of the torch-reference forward."""
    from constrained_spec import kernels as K
    from constrained_spec.attention import KVCache
    from constrained_spec.attention.triton_backend import TritonAttention
    cfg = _cfg(model_type, vocab_size=1024, num_layers=2)
    model = _random_model(cfg, torch.bfloat16, "cuda")
    ctx, W = 37, 64
    kv = KVCache(cfg.num_layers, B * W + 1, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16, "cuda")
    kv.k.normal_()
    kv.v.normal_()
    meta = _decode_meta(B, ctx, W)
    ids = torch.zeros(B, dtype=torch.int64, device="cuda")
    pos = torch.full((B,), ctx - 1, dtype=torch.int64, device="cuda")
    backend = TritonAttention()
    with torch.inference_mode():
        for _ in range(2):
            model(ids, pos, kv, meta, backend)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = model(ids, pos, kv, meta, backend)
        for step in range(3):
            ids.copy_(torch.randint(0, cfg.vocab_size, (B,), device="cuda"))
            pos.fill_(ctx - 1 + step)
            graph.replay()
            torch.cuda.synchronize()
            expect = model(ids, pos, kv, meta, backend)
            torch.testing.assert_close(out.float(), expect.float(), atol=2e-2, rtol=2e-2)
            K.set_fused_kernels(False)
            try:
                ref = model(ids, pos, kv, meta, backend).float()
            finally:
                K.set_fused_kernels(True)
            err = (out.float() - ref).abs().max().item()
            assert err < 0.05 * ref.abs().max().item() + 0.05, err


if __name__ == "__main__" and "--interpret" in sys.argv:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    for dt in (torch.float32, torch.bfloat16):
        check_kernels("cpu", dt)
    print("interpreter: ok")
