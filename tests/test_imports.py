"""Each entry point imports on its own, first, in a fresh interpreter (the engine and speculative
packages import each other: a module-level import in the wrong place is a circular import that
tests importing the engine first never see; bench_spec.py imports speculative.worker first)."""
from __future__ import annotations

import subprocess
import sys

import pytest

MODULES = ["constrained_spec.speculative.worker", "constrained_spec.speculative.verify_step",
           "constrained_spec.speculative.eagle", "constrained_spec.pinned", "constrained_spec.models.eagle",
           "constrained_spec.engine"]


@pytest.mark.parametrize("module", MODULES)
def test_module_imports_first(module):
    done = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
