"""The GPU script's EAGLE stages on the CPU at toy sizes (tiny random model, matplotlib hidden as on
the GPU machine): the flags, files and hand-offs of `run_gpu.sh eagle` (train a head into $OUT,
then bench_spec with it on JSON and chat) are the ones the lead's H100 run uses, so a wrong flag
or a missing file fails here and not on the device."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from sizes import size

ROOT = Path(__file__).resolve().parent.parent
BATCHES = size("1", "1,8")


def test_eagle_stage_trains_a_head_and_benches_it(tiny_llama_dir, tmp_path):
    out = tmp_path / "out"
    no_mpl = tmp_path / "no_matplotlib"
    (no_mpl / "matplotlib").mkdir(parents=True)
    (no_mpl / "matplotlib" / "__init__.py").write_text("raise ImportError('matplotlib hidden: as on the GPU machine')\n")
    env = {**os.environ, "PYTHON": sys.executable, "DEVICE": "cpu", "MODEL": tiny_llama_dir, "OUT": str(out),
           "PYTHONPATH": os.pathsep.join([str(no_mpl), os.environ.get("PYTHONPATH", "")]),
           "TRAIN_ARGS": "--dtype float32 --prompts 6 --max-tokens 12 --gen-batch 6 --max-steps 3 "
                         "--batch-tokens 256 --eval-prompts 2 --log-level warning",
           "BENCH_ARGS": f"--dtype float32 --max-tokens 6 --min-prompts 2 --repeats 1 --batches {BATCHES} "
                         "--opt kv_cache_memory_gb=0.125"}  # eight engines at once: 1 GiB each by default on the CPU
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "run_gpu.sh"), "eagle"], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    head = out / "smollm2-135m-eagle"
    assert (head / "model.safetensors").is_file() and (head / "train_log.json").is_file()
    assert not (head / "train_curves.png").exists()  # matplotlib absent: skipped, not failed
    info = json.loads((head / "config.json").read_text())["info"]
    assert info["steps"] == 3 and info["heldout_acceptance"]["spec_steps"] > 0
    batches = [int(b) for b in BATCHES.split(",")]
    for workload in ("json", "chat"):  # BENCH_ARGS' batches (the stage's: 1-64 / 1)
        results = json.loads((out / f"spec_cpu_eagle_{workload}.json").read_text())["results"]
        assert sorted({r["batch"] for r in results}) == batches
        engines = {r["engine"] for r in results}
        assert engines == {"plain", "ngram chain", "eagle", "eagle mask2", "eagle chain", "eagle always",
                           "eagle chain always", "eagle chain apart always"}
        for r in results:  # EAGLE's host phases per step, for the H100 run to show where drafting goes
            if r["engine"].startswith("eagle") and r.get("spec_steps"):
                assert set(r["draft_phase_ms"]) >= {"inputs", "steps", "read"} and set(r["phase_ms"]) >= {"wait"}
                if r["engine"] in ("eagle chain", "eagle chain always"):  # fused: drafted apart for arrivals only
                    assert r["draft_syncs_per_step"] < 1.0
                else:
                    syncs = 2.0 if r["engine"] == "eagle mask2" and workload == "json" else 1.0
                    assert r["draft_syncs_per_step"] == syncs
        for r in results:
            if r["engine"] != "plain":  # float32 on the CPU: speculation is lossless
                assert r["identical_to_plain"] == r["requests"], r
            hist = r.get("accepted_histogram", [])  # request-steps by drafts accepted: the mean's own counts
            if r.get("spec_steps"):
                assert 1 + sum(n * c for n, c in enumerate(hist)) / sum(hist) == pytest.approx(r["mean_accepted_len"])
            # the measured policy's decisions by batch bucket (speculative / all), the "always" ones have none
            measured = r["engine"] != "plain" and "always" not in r["engine"]
            assert ("spec_steps_by_bucket" in r) == measured, r
            if measured:
                steps = [tuple(map(int, v.split("/"))) for v in r["spec_steps_by_bucket"].values()]
                assert all(s <= n for s, n in steps) and sum(s for s, _ in steps) == r["spec_steps"], r
        assert "Drafts accepted per verified request-step" in (out / f"spec_cpu_eagle_{workload}.md").read_text()


def test_eagle_masked_stage_benches_the_widest_masked_tree(tiny_llama_dir, tiny_head_dir, tmp_path):
    """`run_gpu.sh eagle_masked`: plain and EAGLE with every depth masked, its host phases per step
    (a masked depth past the first is a sync each), its draft rows walked three ways, lossless in
    float32."""
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable, "DEVICE": "cpu", "MODEL": tiny_llama_dir, "OUT": str(out),
           "EAGLE_HEAD": tiny_head_dir,
           "BENCH_ARGS": "--dtype float32 --max-tokens 6 --min-prompts 2 --repeats 1 --batches 1 "
                         "--draft-tokens 16 --opt eagle_topk=3 --opt eagle_depth=4 --opt eagle_masked_depths=4"}
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "run_gpu.sh"), "eagle_masked"], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((out / "spec_cpu_eagle_masked.json").read_text())["results"]
    assert {r["engine"] for r in results} == {"plain", "eagle always", "eagle always walk1", "eagle always serial"}
    for r in results:
        if r["engine"] != "plain":
            assert r["identical_to_plain"] == r["requests"], r
            if r.get("spec_steps"):
                assert r["draft_syncs_per_step"] == 4.0  # three masked depths past the first, then the one read
