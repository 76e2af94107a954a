"""benchmarks/bench_serving.py at a tiny size on the CPU (a random 2-layer model): the split server
with two front-ends, the single-process one and the in-process engine run every workload, streamed
and not, at a concurrency and a request rate, without errors, and the results are written."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow


def test_bench_serving_cpu_smoke(tiny_llama_dir, tmp_path):
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_serving.py"), "--model", tiny_llama_dir, "--device", "cpu",
           "--workloads", "plain,json,schemas", "--clients", "2", "--rates", "4", "--rate-seconds", "1",
           "--max-tokens", "4", "--servers", "split-2,single", "--rounds", "1", "--client-procs", "1", "--results-dir", str(tmp_path),
           "--server-args", "--dtype float32 --grammar-cache-dir none"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    data = json.loads((tmp_path / "bench_serving.json").read_text())
    runs = data["runs"]
    assert len(runs) == 2 * (3 * 2 + 1)  # servers x (workloads x streamed/not + the rate)
    for run in runs + data["engine"]:
        assert run["errors"] == 0 and run.get("invalid", 0) == 0 and run["ok"] == run["requests"] >= 8, run
        assert run["out_tok_s"] > 0 and run["ttft"]["p99"] is not None
    assert {run["server"] for run in runs} == {"split-2", "single"}
    assert any(run["stream"] and run["itl"]["p50"] is not None for run in runs)
    assert len(data["engine"]) == 3
    md = (tmp_path / "bench_serving.md").read_text()
    assert "split-2 / engine" in md and "Streamed / non-streamed" in md and "| single | 4 |" in md
