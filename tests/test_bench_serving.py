"""benchmarks/bench_serving.py at a tiny size on the CPU (a random 2-layer model): the split server
with two front-ends, the single-process one and the in-process engine run every workload, streamed
and not, at a concurrency and a request rate, without errors, and the results are written."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow


def test_bench_serving_cpu_smoke(tiny_llama_dir, tmp_path):
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_serving.py"), "--model", tiny_llama_dir, "--device", "cpu",
           "--workloads", "plain,json,schemas", "--clients", "2", "--rates", "4", "--rate-seconds", "1",
           "--max-tokens", "4", "--servers", "split-2", "--rounds", "1", "--client-procs", "1", "--results-dir", str(tmp_path),
           "--server-args", "--dtype float32 --grammar-cache-dir none"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    data = json.loads((tmp_path / "bench_serving.json").read_text())
    runs = data["runs"]
    # (one server: a second one's start is ~10 s of the suite; the single-process server is benched
    # beside another in test_interleaved_rounds_pair_the_arms)
    assert len(runs) == 3 * 2 + 1  # workloads x streamed/not + the rate
    for run in runs + data["engine"]:
        assert run["errors"] == 0 and run.get("invalid", 0) == 0 and run["ok"] == run["requests"] >= 8, run
        assert run["out_tok_s"] > 0 and run["ttft"]["p99"] is not None
    for run in [r for r in runs if r["mode"] == "clients"] + data["engine"]:  # the engine's counters, read per run
        side = run["engine_side"]
        assert side["busy_decode_steps_s"] > 0 and side["busy_extend_steps_s"] > 0, side
        assert 0 < side["mean_decode_batch"] <= 2 and 0 <= side["idle_share"] < 1, side
        assert 0 <= side["device_wait_share"] < 0.5, side  # the CPU's steps return their results
        # the engine's part of TTFT, split at admission; it fits in the clients' own TTFT
        assert side["queue_ms"] >= 0 and side["prefill_ms"] > 0, side
        assert side["queue_ms"] + side["prefill_ms"] <= run["ttft"]["p99"] * 1e3 * 1.05 + 1, (side, run["ttft"])
    assert {run["server"] for run in runs} == {"split-2"}
    assert any(run["stream"] and run["itl"]["p50"] is not None for run in runs)
    assert len(data["engine"]) == 3
    md = (tmp_path / "bench_serving.md").read_text()
    assert "split-2 / engine" in md and "Streamed / non-streamed" in md and "| split-2 | 4 |" in md
    assert "The engine's side of each run" in md and "split-2 prefills/s" in md and "split-2 prefill ms" in md
    if sys.platform == "linux":  # the CPU by role: the server's threads are named
        for run in [r for r in runs if r["mode"] == "clients"]:
            busy = run["cores_busy"]
            assert busy["engine loop"] > 0 and busy["clients"] > 0 and busy["host"] > 0, busy
            assert busy["front-ends"] > 0, busy
        assert "## CPU cores busy" in md


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_cpu_time_attributes_named_threads():
    """A thread named as the native mask pool names its workers counts as mask threads."""
    import threading
    import time

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import cpu_time

    from constrained_spec.cpus import name_os_thread

    burnt, done = threading.Event(), threading.Event()

    def burn():
        name_os_thread("cs-mask")
        end = time.thread_time() + 0.3
        while time.thread_time() < end:
            pass
        burnt.set()
        done.wait()  # alive until read: an ended thread's time leaves /proc/<pid>/task

    import os
    before = cpu_time.snapshot(os.getpid())
    t = threading.Thread(target=burn)
    t.start()
    burnt.wait()
    busy = cpu_time.cores_busy(before, cpu_time.snapshot(os.getpid()), client_cpu_s=0.0)
    done.set()
    t.join()
    assert busy["mask threads"] > 0.1 and busy["host"] >= busy["mask threads"] * 0.5, busy


def test_prefix_cache_workloads_and_arms():
    """The shared-prefix and multi-turn workloads share what they should; `+nocache` servers turn
    the prefix cache off; the report compares each server with its +nocache arm."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_serving as b
    jobs = b.make_jobs("shared-prefix", 6)
    assert len({j.messages[0]["content"] for j in jobs}) == 1 and len(jobs[0].messages[0]["content"]) > 4000
    assert len({j.content for j in jobs}) == 6
    assert {j.content for j in b.make_jobs("shared-prefix", 6, first=100)}.isdisjoint({j.content for j in jobs})
    turns = b.make_jobs("multi-turn", 8)
    assert [len(j.messages) for j in turns] == [2, 2, 4, 4, 6, 6, 8, 8]
    for earlier, later in zip(turns, turns[2:]):  # a turn's prompt starts with the conversation's last one
        assert later.messages[:len(earlier.messages)] == earlier.messages
    distinct = [j.messages[0]["content"] for j in b.make_jobs("distinct", 12) + b.make_jobs("distinct", 4, first=12)]
    assert len(set(distinct)) == 16 and min(map(len, distinct)) > 1000
    for x, y in zip(distinct, distinct[1:]):  # nothing shared past a leading digit
        assert os.path.commonprefix([x, y]) in ("", "1")
    assert b.server_flags("split+nocache") == ["--disable-prefix-cache"]
    assert b.server_flags("split-2+nocache") == ["--frontends", "2", "--disable-prefix-cache"]
    run = lambda server, ttft, tok: {"server": server, "workload": "shared-prefix", "stream": True, "mode": "clients",
                                     "value": 4, "out_tok_s": tok, "errors": 0, "invalid": 0, "cached_share": 0.9,
                                     **{k: {"p50": ttft, "p99": ttft} for k in ("ttft", "tpot", "itl", "e2e")}}
    md = b.report({"runs": [run("split", 0.02, 300.0), run("split+nocache", 0.1, 200.0)], "engine": [],
                   "servers": ["split", "split+nocache"], "model_name": "m", "device": "cpu", "machine": {},
                   "max_tokens": 8, "rounds": 1, "command": "x", "workloads": ["shared-prefix"], "streams": [True],
                   "clients": [4], "rates": []})
    assert "| split | shared-prefix | yes | 4 | 20.0 | 100 | 5.00 | 300 | 200 | 1.50 | 0.90 |" in md


def test_interleaved_rounds_pair_the_arms(tiny_llama_dir, tmp_path):
    """`--interleave 2`: both servers up at once, each configuration run twice with the servers in
    turn (the second round's order reversed), every round on requests of its own (distinct prompts
    never found cached from an earlier round), and the cache table gives the median of the paired
    ratios."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_serving.py"), "--model", tiny_llama_dir, "--device", "cpu",
           "--workloads", "distinct", "--clients", "2", "--stream", "no", "--rates", "", "--max-tokens", "4",
           "--servers", "single,single+nocache", "--rounds", "1", "--client-procs", "1", "--no-engine",
           "--interleave", "2", "--max-tokens-spread", "0.5", "--results-dir", str(tmp_path),
           "--server-args", "--dtype float32 --grammar-cache-dir none"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    data = json.loads((tmp_path / "bench_serving.json").read_text())
    runs = data["runs"]
    assert [(x["server"], x["repeat"]) for x in runs] == [
        ("single", 0), ("single+nocache", 0), ("single+nocache", 1), ("single", 1)]
    assert all(x["errors"] == 0 and x["invalid"] == 0 for x in runs)
    assert all(x["cached_share"] < 0.5 for x in runs if x["server"] == "single")  # no round reuses another's prompts
    md = (tmp_path / "bench_serving.md").read_text()
    assert "(rounds: " in md
    assert data["max_tokens_spread"] == 0.5 and "drawn from the top 50%" in md
    assert all(x["out_tokens"] <= 4 * x["requests"] for x in runs)


def test_answer_limits_vary_alike_for_every_arm():
    """`--max-tokens-spread`: limits drawn from the top of max_tokens, the same for a given first
    request number (every server and the engine), others for another round's numbers."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_serving as b
    assert b.answer_limits(5, 0, 128, 0.0) == [128] * 5
    limits = b.answer_limits(400, 7, 128, 0.5)
    assert limits == b.answer_limits(400, 7, 128, 0.5) != b.answer_limits(400, 8, 128, 0.5)
    assert min(limits) >= 64 and max(limits) <= 128 and len(set(limits)) > 40


def test_report_takes_the_median_of_paired_rounds():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_serving as b
    run = lambda server, rep, tok: {"server": server, "workload": "distinct", "stream": False, "mode": "clients",
                                    "value": 4, "repeat": rep, "out_tok_s": tok, "errors": 0, "invalid": 0,
                                    **{k: {"p50": 0.1, "p99": 0.1} for k in ("ttft", "tpot", "itl", "e2e")}}
    runs = [run("split", 0, 90.0), run("split+nocache", 0, 100.0), run("split", 1, 120.0),
            run("split+nocache", 1, 100.0), run("split", 2, 50.0), run("split+nocache", 2, 50.0)]
    md = b.report({"runs": runs, "engine": [], "servers": ["split", "split+nocache"], "model_name": "m", "device": "cpu",
                   "machine": {}, "max_tokens": 8, "rounds": 1, "command": "x", "workloads": ["distinct"],
                   "streams": [False], "clients": [4], "rates": []})
    # median runs: 90 on, 100 off; paired ratios 0.90, 1.20, 1.00 -> 1.00
    assert "| 90 | 100 | 1.00 (rounds: 0.90, 1.20, 1.00) | - | - | - | - | - |" in md
    # the loop's CPU per step: 0.8 CPU s/s over (400 + 100) busy steps/s, busy 80% of the time -> 2,000 us
    side = {"busy_decode_steps_s": 400.0, "busy_extend_steps_s": 100.0, "idle_share": 0.2, "mean_decode_batch": 1.0}
    assert b._loop_cpu_per_step({"engine_side": side, "cores_busy": {"engine loop": 0.8}}) == pytest.approx(2e-3)
    assert b._loop_cpu_per_step({"engine_side": side}) is None


def test_plot_without_rates(tmp_path):
    """A run of max-concurrency modes only (no --rates) draws its runs: lines against the clients
    (non-streamed runs there), and bars per workload for one number of clients, streamed only (the
    prefix cache's A/B: its plot was once empty)."""
    pytest.importorskip("matplotlib")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_serving as b
    payload = json.loads((ROOT / "benchmarks" / "results" / "bench_serving.json").read_text())
    payload["rates"] = []
    assert b.plot(payload, tmp_path / "plot.png") > 0
    ab = json.loads((ROOT / "benchmarks" / "results" / "bench_serving_prefix.json").read_text())
    assert len(ab["clients"]) == 1 and all(r["stream"] for r in ab["runs"])
    assert b.plot(ab, tmp_path / "ab.png") == len(ab["workloads"]) * len(ab["servers"])


def test_answers_are_validated_against_their_schema():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_serving

    schema = {"type": "object", "properties": {"a": {"type": "integer", "maximum": 3}}, "required": ["a"]}
    assert bench_serving.answer_is_valid(schema, '{"a": 2}', "stop")
    assert not bench_serving.answer_is_valid(schema, '{"a": 5}', "stop")
    assert not bench_serving.answer_is_valid(schema, '{"b": 1}', "stop")
    assert not bench_serving.answer_is_valid(schema, '{"a": ', "stop")
    assert bench_serving.answer_is_valid(schema, '{"a": ', "length")  # cut by max_tokens: not judged
    assert bench_serving.answer_is_valid(None, "anything", "stop")


def test_prefix_cache_ab_cpu_smoke(tiny_llama_dir, tmp_path):
    """benchmarks/prefix_cache_ab.py: both arms run every round without errors, and the host-time
    table has the cache's calls in the cache-on arm only (each arm really ran as named)."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "prefix_cache_ab.py"), "--model", tiny_llama_dir, "--device", "cpu",
           "--requests", "16", "--rounds", "2", "--clients", "4", "--max-tokens", "6", "--max-tokens-spread", "0.5"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "BENCH_RESULTS": str(tmp_path)})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    data = json.loads((tmp_path / "prefix_cache_ab.json").read_text())
    assert len(data["ratios"]) == 2 and all(x > 0 for x in data["ratios"])
    for arm in ("on", "off"):
        assert all(rnd["errors"] == 0 and rnd["tok_s"] > 0 for rnd in data["rounds"][arm])
        # every round's 16 first tokens timed: the TTFT p50 and its split are there
        assert all(rnd["ttft_ms_p50"] > 0 and rnd["prefill_ms"] > 0 for rnd in data["rounds"][arm])
        assert data["host"][arm]["Scheduler.remove"]["calls"] == 16  # one release per finished request
        assert all(0 <= rnd["device_wait_us"] < 1e4 for rnd in data["rounds"][arm])
    assert data["host"]["on"]["PrefixCache.admit"]["calls"] == 16
    assert data["host"]["off"]["PrefixCache.admit"]["calls"] == 0
    assert (tmp_path / "prefix_cache_ab.md").read_text().count("| Scheduler.remove |") == 1
