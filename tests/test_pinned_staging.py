"""Pinned staging (constrained_spec/pinned.py). PinnedStaging: copies queued back to back without a host sync, each
from a buffer rewritten two copies later, all land with their own values (a buffer rewritten under
a pending copy would send the later values)."""
from __future__ import annotations

import pytest
import torch

from constrained_spec.pinned import PinnedStaging


@pytest.mark.gpu
def test_staged_copies_keep_their_values_while_the_stream_is_busy():
    staging = PinnedStaging((4, 3), torch.int64)
    dst = torch.zeros(64, 4, 3, dtype=torch.int64, device="cuda")
    busy = torch.randn(4096, 4096, device="cuda")
    for step in range(64):
        busy = busy @ busy / 64  # keep the stream behind the host, so copies stay pending
        host = staging.stage()
        host[:] = step
        staging.copy_to(dst[step, :2], rows=2)  # a prefix of rows, as the decode launch sends
        dst[step, 2:].fill_(-1)
    torch.cuda.synchronize()
    expected = torch.arange(64, device="cuda").view(64, 1, 1).expand(64, 2, 3)
    assert torch.equal(dst[:, :2], expected)
    assert bool((dst[:, 2:] == -1).all())


def _block(device):
    from constrained_spec.pinned import PinnedBlock
    import numpy as np
    return PinnedBlock({"rows": ((3,), np.int64), "mask": ((2, 3, 3), np.bool_), "bits": ((4, 5), np.int32)},
                       torch.device(device))


def test_block_fields_are_views_of_one_buffer_on_the_cpu():
    block = _block("cpu")
    block.host["rows"][:] = [7, 8, 9]
    block.host["mask"][1, 2, 0] = True
    block.host["bits"][3] = -1
    block.upload()  # nothing to do: the device twin is the host buffer
    assert block.device["rows"].tolist() == [7, 8, 9]
    assert bool(block.device["mask"][1, 2, 0]) and int(block.device["mask"].sum()) == 1
    assert block.device["bits"][3].tolist() == [-1] * 5 and int(block.device["bits"][:3].abs().sum()) == 0
    assert block.host_tensor["bits"].data_ptr() % 8 == 0  # fields start on 8-byte boundaries


@pytest.mark.gpu
def test_block_upload_of_a_prefix_leaves_the_rest():
    block = _block("cuda")
    block.host["rows"][:] = [1, 2, 3]
    block.host["bits"][:] = 5
    block.upload("bits", 2 * 5 * 4)  # everything before `bits`, and its first two rows
    torch.cuda.synchronize()
    assert block.device["rows"].tolist() == [1, 2, 3]
    assert block.device["bits"][:2].eq(5).all() and block.device["bits"][2:].eq(0).all()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_growing_staging_lands_every_copy_across_growth(device):
    """Copies of growing sizes (the buffers are replaced under pending copies) each land whole."""
    from constrained_spec.pinned import GrowingStaging
    uploads = GrowingStaging(torch.device(device), capacity=4)
    landed = []
    busy = torch.randn(2048, 2048, device=device) if device == "cuda" else None
    for step, n in enumerate([3, 4, 9, 2, 40, 17, 100]):
        if busy is not None:
            busy = busy @ busy / 2048  # keep the stream behind the host, so copies stay pending
        host = uploads.stage(n)
        host[:] = step
        landed.append(uploads.upload(n).clone())
    if device == "cuda":
        torch.cuda.synchronize()
    for step, (n, got) in enumerate(zip([3, 4, 9, 2, 40, 17, 100], landed)):
        assert got.tolist() == [step] * n


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_growing_staging_grown_in_inference_mode_uploads_outside_it(device):
    """The engine grows the buffers inside the runner's inference_mode step and uploads from the
    scheduler outside one: growth must not leave inference tensors behind (an upload into one
    failed every engine step that cached prompts, on the H100, with `RuntimeError: Inplace update
    to inference tensor outside InferenceMode`)."""
    from constrained_spec.pinned import GrowingStaging
    uploads = GrowingStaging(torch.device(device), capacity=4)
    with torch.inference_mode():
        uploads.stage(64)[:] = 1
        uploads.upload(64)
    uploads.stage(32)[:] = 7
    assert uploads.upload(32).tolist() == [7] * 32
