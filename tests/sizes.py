"""Two sizes of the slow tests. `make test` (CI: 2 cores, the suite under 20 minutes) runs the quick
size: the same checks over fewer schemas, prompts or clients. CONSTRAINED_SPEC_FULL_TESTS=1 runs the
acceptance size (the GPU machine, and before closing an issue), and the tests only that size makes
sense for."""
from __future__ import annotations

import os

import pytest

FULL = os.environ.get("CONSTRAINED_SPEC_FULL_TESTS", "") not in ("", "0")


def size(quick, full):
    """`full` under CONSTRAINED_SPEC_FULL_TESTS=1, else `quick`."""
    return full if FULL else quick


full_only = pytest.mark.skipif(not FULL, reason="acceptance size only: set CONSTRAINED_SPEC_FULL_TESTS=1")
