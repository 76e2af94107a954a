"""Pinned staging buffers (engine/pinned.py): copies queued back to back without a host sync, each
from a buffer rewritten two copies later, all land with their own values (a buffer rewritten under
a pending copy would send the later values)."""
from __future__ import annotations

import pytest
import torch

from constrained_spec.engine.pinned import PinnedStaging


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
