"""Triton attention backend vs the torch reference.

* GPU tests (`-m gpu`, need CUDA + triton): many shapes in fp16/bf16, larger sizes, GQA ratios,
  padding rows, and a CUDA-graph capture + replay of decode (and verify) with changing contents.
* CPU tests: run the same comparisons under the Triton interpreter (`TRITON_INTERPRET=1`, which must
  be set before `triton` is imported, hence a subprocess running this file). Skipped when triton is
  not installed.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from constrained_spec.attention.base import AttentionMetadata, ForwardMode, KVCache

REPO = Path(__file__).resolve().parents[1]
HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_CUDA = torch.cuda.is_available()


# ----------------------------------------------------------------------------------------------
# Case construction (shared by the GPU tests and the interpreter subprocess)
# ----------------------------------------------------------------------------------------------

def random_tree_mask(n: int, gen: torch.Generator) -> torch.Tensor:
    """[n, n] bool: mask[i, j] = j is i or an ancestor of i, for a random tree rooted at node 0."""
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        mask[i, i] = True
        if i > 0:
            parent = int(torch.randint(0, i, (1,), generator=gen))
            mask[i] |= mask[parent]
    return mask


def make_case(mode: ForwardMode, prefix_lens, q_lens, H: int, KVH: int, D: int, dtype, device,
              seed: int = 0, num_layers: int = 2, layer: int = 1, table_width: int | None = None,
              zero_rows=()):
    """Builds (q, k, v, kv, meta, layer, scale). `zero_rows`: decode rows with kv_len 0 (padding)."""
    gen = torch.Generator().manual_seed(seed)
    B = len(q_lens)
    q_lens = list(q_lens)
    kv_lens = [p + ql for p, ql in zip(prefix_lens, q_lens)]
    for b in zero_rows:
        kv_lens[b] = 0
    T = sum(q_lens)
    total = sum(kv_lens)
    num_slots = total + 8 + int(torch.randint(0, 16, (1,), generator=gen))
    perm = (torch.randperm(num_slots - 1, generator=gen) + 1)  # slot 0 is a dummy for padding rows
    W = table_width or max(1, max(kv_lens))
    slot_table = torch.zeros(B, W, dtype=torch.int64)
    out_slots = []
    off = 0
    for b in range(B):
        L = kv_lens[b]
        slot_table[b, :L] = perm[off:off + L]
        off += L
        if L == 0:
            out_slots += [0] * q_lens[b]
        else:
            out_slots += slot_table[b, L - q_lens[b]:L].tolist()
    torch.manual_seed(seed)
    kv = KVCache(num_layers, num_slots, KVH, D, dtype, device)
    kv.k.normal_()
    kv.v.normal_()
    q = torch.randn(T, H, D, device=device).to(dtype)
    k = torch.randn(T, KVH, D, device=device).to(dtype)
    v = torch.randn(T, KVH, D, device=device).to(dtype)
    q_starts = torch.zeros(B + 1, dtype=torch.int32)
    q_starts[1:] = torch.cumsum(torch.tensor(q_lens, dtype=torch.int32), 0)
    max_q = max(q_lens) if q_lens else 0
    tree = None
    if mode is ForwardMode.VERIFY:
        tree = torch.rand(B, max_q, max_q, generator=gen) < 0.5  # garbage in the padding
        for b in range(B):
            tree[b, :q_lens[b], :q_lens[b]] = random_tree_mask(q_lens[b], gen)
    meta = AttentionMetadata(
        mode=mode, out_slots=torch.tensor(out_slots, dtype=torch.int64), q_starts=q_starts,
        q_lens=torch.tensor(q_lens, dtype=torch.int32), kv_lens=torch.tensor(kv_lens, dtype=torch.int32),
        slot_table=slot_table, max_q_len=max_q, max_kv_len=max(kv_lens) if kv_lens else 0, tree_mask=tree)
    for name in ("out_slots", "q_starts", "q_lens", "kv_lens", "slot_table", "tree_mask"):
        t = getattr(meta, name)
        if t is not None:
            setattr(meta, name, t.to(device))
    return q.to(device), k.to(device), v.to(device), kv, meta, layer, D ** -0.5


def clone_kv(kv: KVCache) -> KVCache:
    new = KVCache.__new__(KVCache)
    new.k, new.v, new.num_slots = kv.k.clone(), kv.v.clone(), kv.num_slots
    return new


def decode_rope_inputs(meta: AttentionMetadata, D: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions, cos_sin_cache) for a decode case: each new token sits at its context's end.
    The positions are a strided view, as the engine's CUDA graphs pass them."""
    from constrained_spec.kernels import build_cos_sin_cache
    from constrained_spec.models.rope import inverse_frequencies
    cs = build_cos_sin_cache(inverse_frequencies(D, 10000.0, None), 4096).to(meta.kv_lens.device)
    positions = (meta.kv_lens.long() - 1).clamp(min=0)
    return torch.stack([positions, positions], 1)[:, 1], cs


def compare(case, atol: float, rtol: float = 0.0, rope: bool = False, **triton_kwargs) -> float:
    """Runs both backends on the case; checks the outputs and the stored KV. Returns max abs err.
    `rope` (decode): the Triton backend gets unrotated q/k and fuses RoPE + the KV store into the
    decode kernel; the reference gets them rotated by the standalone RoPE kernel.
    `triton_kwargs` go to TritonAttention (target_programs, ...)."""
    from constrained_spec.attention.torch_backend import TorchAttention
    from constrained_spec.attention.triton_backend import TritonAttention

    q, k, v, kv, meta, layer, scale = case
    kv_ref, kv_tri = clone_kv(kv), clone_kv(kv)
    valid = meta.kv_lens > 0
    tok_valid = torch.repeat_interleave(valid, meta.q_lens.long(), output_size=q.shape[0])
    rope_args = None
    q_tri = q
    if rope:
        from constrained_spec.kernels import triton_ops
        rope_args = decode_rope_inputs(meta, q.shape[-1])
        meta = dataclasses.replace(meta, out_slots=torch.stack([meta.out_slots] * 3, 1)[:, 2])  # strided
        q_tri, k_tri = q.clone(), k.clone()
        q, k = triton_ops.apply_rope(q.clone(), k.clone(), *rope_args)
    # Reference in fp32 (the kernels accumulate in fp32).
    kv_ref32 = KVCache.__new__(KVCache)
    kv_ref32.k, kv_ref32.v, kv_ref32.num_slots = kv_ref.k.float(), kv_ref.v.float(), kv_ref.num_slots
    ref = TorchAttention().forward(q.float(), k.float(), v.float(), layer, kv_ref32, meta, scale)
    if rope:
        out = TritonAttention(**triton_kwargs).forward(q_tri, k_tri, v, layer, kv_tri, meta, scale, rope=rope_args)
    else:
        out = TritonAttention(**triton_kwargs).forward(q, k, v, layer, kv_tri, meta, scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert torch.isfinite(out.float()).all(), "non-finite output"
    kv_ref.store(layer, meta.out_slots, k, v)
    if rope:  # slot 0 is the padding rows' dummy, which fused decode leaves alone when kv_len == 0
        ulp = 1e-6 if k.dtype == torch.float32 else 2.0 ** -7
        for mine, theirs in ((kv_tri.k, kv_ref.k), (kv_tri.v, kv_ref.v)):
            assert torch.allclose(mine[:, 1:].float(), theirs[:, 1:].float(), rtol=ulp, atol=1e-6), "KV store differs"
    else:
        assert torch.equal(kv_tri.k, kv_ref.k) and torch.equal(kv_tri.v, kv_ref.v), "KV store differs"
    err = (out.float()[tok_valid] - ref[tok_valid]).abs()
    tol = atol + rtol * ref[tok_valid].abs()
    assert (err <= tol).all(), f"max err {err.max().item():.3e}"
    if (~tok_valid).any():  # kv_len == 0 padding rows: zeros, not NaN
        assert (out[~tok_valid] == 0).all()
    return err.max().item() if err.numel() else 0.0


def interpreter_cases():
    """Tiny shapes for the CPU interpreter."""
    D, E, V = ForwardMode.DECODE, ForwardMode.EXTEND, ForwardMode.VERIFY
    f16, f32 = torch.float16, torch.float32
    cases = [
        # mode, prefix_lens, q_lens, H, KVH, D, dtype, extra
        (D, [0, 5, 70, 130], [1, 1, 1, 1], 4, 2, 16, f32, {}),
        (D, [3, 0, 40], [1, 1, 1], 3, 1, 32, f16, {"zero_rows": (1,)}),
        (D, [200, 9], [1, 1], 6, 2, 64, f16, {"table_width": 256}),
        (D, [17], [1], 2, 2, 24, f32, {}),  # MHA, non-power-of-2 head dim
        (E, [0, 3], [5, 9], 4, 2, 16, f32, {}),
        (E, [70, 0, 12], [3, 20, 1], 3, 1, 32, f16, {}),
        (E, [0], [40], 6, 2, 64, f16, {}),
        (V, [10, 0, 33], [7, 4, 1], 4, 1, 16, f32, {}),
        (V, [65, 5], [12, 20], 6, 2, 32, f16, {}),
        (E, [5, 130], [30, 50], 8, 2, 16, f32, {}),  # several row blocks per sequence
        (V, [3, 80], [64, 33], 4, 2, 16, f32, {}),  # 64-node tree
        (D, [50, 1], [1, 1], 4, 1, 32, torch.bfloat16, {}),
        (E, [9], [6], 4, 2, 32, torch.bfloat16, {}),
    ]
    for i, (mode, pre, ql, H, KVH, Dh, dt, extra) in enumerate(cases):
        yield (mode, pre, ql, H, KVH, Dh, dt, extra, i)


def run_interpreter_checks() -> None:
    for mode, pre, ql, H, KVH, Dh, dt, extra, i in interpreter_cases():
        case = make_case(mode, pre, ql, H, KVH, Dh, dt, "cpu", seed=i, **extra)
        low = dt in (torch.float16, torch.bfloat16)
        atol = (2e-2 if dt == torch.bfloat16 else 2e-3) if low else 1e-4
        err = compare(case, atol=atol, rtol=1e-2 if low else 1e-4)
        print(f"ok {mode.value:7s} pre={pre} q={ql} H={H} KVH={KVH} D={Dh} {dt} err={err:.2e}", flush=True)
        if mode is ForwardMode.DECODE and Dh % 2 == 0:
            err = compare(case, atol=atol, rtol=1e-2 if low else 1e-4, rope=True)
            print(f"ok decode + rope pre={pre} H={H} KVH={KVH} D={Dh} {dt} err={err:.2e}", flush=True)
    # Fused RoPE with several splits: only the split that owns the new token stores and adds it.
    for tp, pre in ((512, [200, 9, 0, 63]), (8, [64, 127, 1, 300])):
        case = make_case(ForwardMode.DECODE, pre, [1] * 4, 6, 2, 32, torch.float32, "cpu", seed=tp,
                         table_width=320, zero_rows=(2,) if tp == 512 else ())
        err = compare(case, atol=1e-4, rtol=1e-4, rope=True, target_programs=tp)
        print(f"ok decode + rope splits target_programs={tp} pre={pre} err={err:.2e}", flush=True)
    # The split count through the backend's target_programs: 4 splits (the table's 4 blocks) at 512,
    # 2 at 8, 1 at 4 (B * KVH = 4 programs per split).
    from constrained_spec.attention.triton_kernels.decode import default_num_splits
    assert [default_num_splits(2, 2, 256, target_programs=t) for t in (512, 8, 4)] == [4, 2, 1]
    for tp in (512, 8, 4):
        case = make_case(ForwardMode.DECODE, [200, 9], [1, 1], 6, 2, 64, torch.float16, "cpu", seed=97,
                         table_width=256)
        err = compare(case, atol=2e-3, rtol=1e-2, target_programs=tp)
        print(f"ok decode target_programs={tp} err={err:.2e}", flush=True)
    # A fixed split count larger than the context (empty splits) must still be exact.
    from constrained_spec.attention.triton_kernels import decode_attention
    q, k, v, kv, meta, layer, scale = make_case(ForwardMode.DECODE, [2, 0], [1, 1], 2, 1, 16,
                                                torch.float32, "cpu", seed=99, zero_rows=(1,))
    kv.store(layer, meta.out_slots, k, v)
    o8 = decode_attention(q, kv.k[layer], kv.v[layer], meta.slot_table, meta.kv_lens, scale, num_splits=8)
    o1 = decode_attention(q, kv.k[layer], kv.v[layer], meta.slot_table, meta.kv_lens, scale, num_splits=1)
    assert torch.allclose(o8, o1, atol=1e-5) and (o8[1] == 0).all()
    print("ok empty splits", flush=True)
    # Several non-empty splits (and empty ones at 8), a split count that is no power of 2, repeated calls.
    q, k, v, kv, meta, layer, scale = make_case(ForwardMode.DECODE, [300, 0, 64, 129], [1] * 4, 6, 2, 16,
                                                torch.float32, "cpu", seed=98, zero_rows=(1,))
    kv.store(layer, meta.out_slots, k, v)
    args = (q, kv.k[layer], kv.v[layer], meta.slot_table, meta.kv_lens, scale)
    o1 = decode_attention(*args, num_splits=1)
    for splits in (5, 8, 3, 5):
        o = decode_attention(*args, num_splits=splits)
        assert torch.allclose(o, o1, atol=1e-5) and (o[1] == 0).all(), splits
    print("ok split merge", flush=True)
    # Split-prefix extend / verify (what short trees over long contexts use on the GPU).
    from constrained_spec.attention.torch_backend import TorchAttention
    from constrained_spec.attention.triton_kernels import extend_attention
    for i, (mode, pre, ql, splits) in enumerate([
            (ForwardMode.VERIFY, [130, 0, 7], [9, 5, 1], 3), (ForwardMode.EXTEND, [200, 33], [4, 17], 5),
            (ForwardMode.VERIFY, [64], [64], 2), (ForwardMode.EXTEND, [3], [20], 8)]):
        q, k, v, kv, meta, layer, scale = make_case(mode, pre, ql, 6, 2, 16, torch.float32, "cpu", seed=50 + i)
        ref = TorchAttention().forward(q, k, v, layer, clone_kv(kv), meta, scale)
        kv.store(layer, meta.out_slots, k, v)
        out = extend_attention(q, kv.k[layer], kv.v[layer], meta.slot_table, meta.kv_lens, meta.q_starts,
                               meta.q_lens, scale, tree_mask=meta.tree_mask, num_splits=splits,
                               block_m=16, block_n=16)
        err = (out - ref).abs().max().item()
        assert err < 1e-4, (mode, pre, ql, splits, err)
        print(f"ok split {mode.value} pre={pre} q={ql} splits={splits} err={err:.1e}", flush=True)
    # A graphed prefill's padding: sequences with no new tokens and rows past sum(q_lens) (grid
    # sized by the padded T and B); the real rows must equal the unpadded launch's.
    for splits in (1, 3):
        q, k, v, kv, meta, layer, scale = make_case(ForwardMode.EXTEND, [40, 0, 7], [9, 3, 20], 6, 2, 16,
                                                    torch.float32, "cpu", seed=77)
        kv.store(layer, meta.out_slots, k, v)
        args = (kv.k[layer], kv.v[layer])
        want = extend_attention(q, *args, meta.slot_table, meta.kv_lens, meta.q_starts, meta.q_lens, scale,
                                num_splits=splits, block_m=16, block_n=16)
        n, pad_rows, pad_seqs = q.shape[0], 13, 2
        q_pad = torch.cat([q, torch.randn(pad_rows, *q.shape[1:])])
        table = torch.cat([meta.slot_table, torch.zeros(pad_seqs, meta.slot_table.shape[1], dtype=torch.int64)])
        zeros = torch.zeros(pad_seqs, dtype=torch.int32)
        got = extend_attention(q_pad, *args, table, torch.cat([meta.kv_lens, zeros]),
                               torch.cat([meta.q_starts, torch.full((pad_seqs,), n, dtype=torch.int32)]),
                               torch.cat([meta.q_lens, zeros]), scale, num_splits=splits, block_m=16, block_n=16)
        assert torch.equal(got[:n], want), splits
        print(f"ok padded extend splits={splits}", flush=True)
    print("ALL OK")


# ----------------------------------------------------------------------------------------------
# CPU: Triton interpreter (subprocess, so TRITON_INTERPRET=1 is set before triton is imported)
# ----------------------------------------------------------------------------------------------

@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (the interpreter tests need it)")
def test_triton_interpreter_matches_torch():
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, __file__, "--interpret"], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "ALL OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]


# ----------------------------------------------------------------------------------------------
# GPU
# ----------------------------------------------------------------------------------------------

gpu = pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON), reason="needs CUDA and triton")

GPU_SHAPES = [(9, 3, 64), (32, 8, 128), (8, 8, 64), (16, 2, 128), (4, 1, 64)]


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_default_num_splits_target_programs():
    from constrained_spec.attention.triton_kernels.decode import default_num_splits
    # SmolLM2 (3 kv heads) over the engine's 8192-wide slot table.
    got = {(B, t): default_num_splits(B, 3, 8192, target_programs=t) for B in (1, 32, 128) for t in (128, 256, 512)}
    assert got == {(1, 128): 32, (1, 256): 32, (1, 512): 32, (32, 128): 2, (32, 256): 3, (32, 512): 6,
                   (128, 128): 1, (128, 256): 1, (128, 512): 2}
    assert default_num_splits(1, 3, 100) == 2  # no more splits than table blocks


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("rope", [False, True], ids=["plain", "fused_rope"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("H,KVH,D", GPU_SHAPES)
def test_gpu_decode(dtype, H, KVH, D, rope):
    gen = torch.Generator().manual_seed(H * 131 + D)
    for B in (1, 3, 17, 64):
        pre = torch.randint(0, 3000, (B,), generator=gen).tolist()
        pre[0] = 0
        zero = (B - 1,) if B > 2 else ()
        case = make_case(ForwardMode.DECODE, pre, [1] * B, H, KVH, D, dtype, "cuda", seed=B, zero_rows=zero)
        compare(case, atol=2e-2 if dtype == torch.bfloat16 else 4e-3, rtol=2e-2, rope=rope)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("H,KVH,D", [(9, 3, 64), (32, 8, 128)])
def test_gpu_decode_split_merge(H, KVH, D):
    """Fixed split counts, many programs in flight (B * KVH * splits up to 16k), repeated launches:
    all splits are merged."""
    from constrained_spec.attention.triton_kernels import decode_attention
    for B in (1, 5, 64):
        pre = torch.randint(0, 4000, (B,), generator=torch.Generator().manual_seed(B)).tolist()
        zero = (B - 1,) if B > 1 else ()
        q, k, v, kv, meta, layer, scale = make_case(ForwardMode.DECODE, pre, [1] * B, H, KVH, D, torch.bfloat16,
                                                    "cuda", seed=B, zero_rows=zero, table_width=4096)
        kv.store(layer, meta.out_slots, k, v)
        args = (q, kv.k[layer], kv.v[layer], meta.slot_table, meta.kv_lens, scale)
        ref = decode_attention(*args, num_splits=1).float()
        for splits in (2, 3, 7, 32):
            for _ in range(3):
                out = decode_attention(*args, num_splits=splits)
                torch.testing.assert_close(out.float(), ref, atol=1e-2, rtol=1e-2)
                if zero:
                    assert (out[B - 1] == 0).all()


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("H,KVH,D", GPU_SHAPES)
def test_gpu_extend(dtype, H, KVH, D):
    gen = torch.Generator().manual_seed(H * 7 + D)
    for B in (1, 4, 9):
        pre = torch.randint(0, 1500, (B,), generator=gen).tolist()
        ql = torch.randint(1, 600, (B,), generator=gen).tolist()
        pre[0] = 0
        case = make_case(ForwardMode.EXTEND, pre, ql, H, KVH, D, dtype, "cuda", seed=B)
        compare(case, atol=2e-2 if dtype == torch.bfloat16 else 4e-3, rtol=2e-2)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("H,KVH,D", GPU_SHAPES)
def test_gpu_verify(dtype, H, KVH, D):
    gen = torch.Generator().manual_seed(H * 11 + D)
    for B in (1, 5, 32):
        pre = torch.randint(1, 2000, (B,), generator=gen).tolist()
        ql = torch.randint(1, 65, (B,), generator=gen).tolist()
        case = make_case(ForwardMode.VERIFY, pre, ql, H, KVH, D, dtype, "cuda", seed=B)
        compare(case, atol=2e-2 if dtype == torch.bfloat16 else 4e-3, rtol=2e-2)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("target_programs", [512, 128])
@pytest.mark.parametrize("H,KVH,D", [(9, 3, 64), (32, 8, 128)])
def test_gpu_decode_cuda_graph_replay(H, KVH, D, target_programs):
    """Capture decode once; replay with new kv_lens / slot_table / q contents (incl. kv_len 0, 1)."""
    from constrained_spec.attention.torch_backend import TorchAttention
    from constrained_spec.attention.triton_backend import TritonAttention

    B, W, num_slots, dtype = 8, 2048, 20000, torch.bfloat16
    dev = "cuda"
    kv = KVCache(1, num_slots, KVH, D, dtype, dev)
    kv.k.normal_()
    kv.v.normal_()
    s_q = torch.randn(B, H, D, device=dev, dtype=dtype)
    s_k = torch.randn(B, KVH, D, device=dev, dtype=dtype)
    s_v = torch.randn(B, KVH, D, device=dev, dtype=dtype)
    s_out_slots = torch.zeros(B, dtype=torch.int64, device=dev)
    s_kv_lens = torch.ones(B, dtype=torch.int32, device=dev)
    s_table = torch.zeros(B, W, dtype=torch.int64, device=dev)
    ones = torch.ones(B, dtype=torch.int32, device=dev)
    meta = AttentionMetadata(ForwardMode.DECODE, s_out_slots, torch.arange(B + 1, dtype=torch.int32, device=dev),
                             ones, s_kv_lens, s_table, max_q_len=1, max_kv_len=W)
    backend = TritonAttention(target_programs=target_programs)
    scale = D ** -0.5
    backend.forward(s_q, s_k, s_v, 0, kv, meta, scale)  # warm-up / compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        s_o = backend.forward(s_q, s_k, s_v, 0, kv, meta, scale)

    for step in range(4):
        lens = torch.randint(1, W + 1, (B,)).tolist()
        lens[0] = 1
        lens[1] = 0 if step % 2 == 0 else 3
        perm = torch.randperm(num_slots - 1)[: sum(lens)] + 1
        table = torch.zeros(B, W, dtype=torch.int64)
        off = 0
        outs = []
        for b, L in enumerate(lens):
            table[b, :L] = perm[off:off + L]
            off += L
            outs.append(int(table[b, L - 1]) if L > 0 else 0)
        s_table.copy_(table)
        s_kv_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        s_out_slots.copy_(torch.tensor(outs))
        s_q.normal_()
        s_k.normal_()
        s_v.normal_()
        graph.replay()
        torch.cuda.synchronize()
        kv_ref = clone_kv(kv)
        ref_meta = AttentionMetadata(ForwardMode.DECODE, s_out_slots.clone(), meta.q_starts, ones,
                                     s_kv_lens.clone(), s_table.clone(), 1, W)
        ref = TorchAttention().forward(s_q.float(), s_k.float(), s_v.float(), 0,
                                       _float_kv(kv_ref), ref_meta, scale)
        valid = s_kv_lens > 0
        assert torch.isfinite(s_o.float()).all()
        assert (s_o[~valid] == 0).all()
        torch.testing.assert_close(s_o.float()[valid], ref[valid], atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@gpu
def test_gpu_verify_cuda_graph_replay():
    from constrained_spec.attention.triton_backend import TritonAttention

    H, KVH, D, B, Q, dtype = 9, 3, 64, 4, 16, torch.bfloat16
    case = make_case(ForwardMode.VERIFY, [300, 7, 400, 100], [Q] * B, H, KVH, D, dtype, "cuda", seed=5,
                     table_width=512)
    q, k, v, kv, meta, layer, scale = case
    backend = TritonAttention()
    backend.forward(q, k, v, layer, kv, meta, scale)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(q, k, v, layer, kv, meta, scale)
    case2 = make_case(ForwardMode.VERIFY, [400, 50, 3, 0], [Q] * B, H, KVH, D, dtype, "cuda", seed=6,
                      table_width=512)
    q2, k2, v2, kv2, meta2, _, _ = case2
    assert kv2.num_slots <= kv.num_slots
    kv.k[:, :kv2.num_slots].copy_(kv2.k)
    kv.v[:, :kv2.num_slots].copy_(kv2.v)
    for dst, src in ((q, q2), (k, k2), (v, v2), (meta.kv_lens, meta2.kv_lens), (meta.slot_table, meta2.slot_table),
                     (meta.out_slots, meta2.out_slots), (meta.tree_mask, meta2.tree_mask)):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    from constrained_spec.attention.torch_backend import TorchAttention
    ref = TorchAttention().forward(q2.float(), k2.float(), v2.float(), layer, _float_kv(kv2), meta2, scale)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


def _float_kv(kv: KVCache) -> KVCache:
    new = KVCache.__new__(KVCache)
    new.k, new.v, new.num_slots = kv.k.float(), kv.v.float(), kv.num_slots
    return new


if __name__ == "__main__":
    if "--interpret" in sys.argv:
        run_interpreter_checks()
