"""Where an EAGLE speculative step's GPU time goes, by CUDA graph: an engine speculating at every
step (random weights of the model's shapes time the same) generates under torch.profiler, and each
replayed graph (draft start, draft depth, verify, ...) is reported with its kernels per replay,
their summed GPU time and the GPU span from the first kernel's start to the last one's end, plus
the kernels of the draft graphs by time.

    python benchmarks/profile_draft_kernels.py --model DIR --out /tmp/prof --batches 1,8

Needs CUDA. Writes, under --out, one chrome trace per batch (trace_b<B>.json) and prof_draft.json;
prints the tables.
"""
import argparse
import collections
import json
import os
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from constrained_spec import Engine, SamplingParams
from constrained_spec.models.eagle import HEADS_DIR

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--model", default=None, help="model (default: SmolLM2-135M-Instruct)")
ap.add_argument("--eagle-head", default=str(HEADS_DIR / "smollm2-135m-eagle"))
ap.add_argument("--batches", default="1,8")
ap.add_argument("--out", type=Path, default=Path("/tmp/profile_draft_kernels"))
args = ap.parse_args()
out, batches = str(args.out), [int(b) for b in args.batches.split(",")]
os.makedirs(out, exist_ok=True)
eng = Engine(model=args.model, device="cuda", speculative_algorithm="eagle", speculative_policy="always",
             speculative_min_accept=0.0, max_running_requests=64, eagle_head=args.eagle_head)

SEQ, ON = [], [False]  # the keys replayed while profiling, in order (the engine thread's)


class Tagged:
    """A graph that notes its key when replayed: the profiler records the engine thread's graph
    launches (CUPTI) but not its Python, so the i-th launch is matched to the i-th key."""

    def __init__(self, g, key):
        self.g, self.key = g, key

    def replay(self):
        if ON[0]:
            SEQ.append("G" + repr(self.key))
        self.g.replay()

    def __getattr__(self, n):
        return getattr(self.g, n)


graphs = eng.runner.graphs.graphs
for k, v in list(graphs.items()):
    graphs[k] = (Tagged(v[0], k),) + tuple(v[1:])

prompts = [f"Write a short story about animal number {i}." for i in range(64)]
sp = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
report = {}
for bs in batches:
    eng.generate(prompts[:bs], sp)
    eng.generate(prompts[:bs], sp)
    torch.cuda.synchronize()
    SEQ.clear()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        ON[0] = True
        t0 = time.perf_counter()
        eng.generate(prompts[:bs], sp)
        wall = time.perf_counter() - t0
        ON[0] = False
    path = f"{out}/trace_b{bs}.json"
    prof.export_chrome_trace(path)
    ev = json.load(open(path))["traceEvents"]
    launches = [e for e in ev if e.get("cat") == "cuda_runtime" and e["name"] == "cudaGraphLaunch"]
    kern = collections.defaultdict(list)
    for e in ev:
        if e.get("cat") == "kernel":
            kern[e["args"].get("correlation")].append(e)
    per = collections.defaultdict(lambda: {"replays": 0, "kernels": 0, "ktime": 0.0, "span": 0.0, "names": collections.Counter(), "ntime": collections.Counter()})
    launches = sorted(launches, key=lambda e: e["ts"])
    print(f"launches {len(launches)}, replays {len(SEQ)}")
    for key, L in zip(SEQ, launches):
        ks = kern.get(L["args"].get("correlation"), [])
        if key is None or not ks:
            continue
        p = per[key]
        p["replays"] += 1
        p["kernels"] += len(ks)
        p["ktime"] += sum(k["dur"] for k in ks)
        p["span"] += max(k["ts"] + k["dur"] for k in ks) - min(k["ts"] for k in ks)
        for k in ks:
            p["names"][k["name"][:90]] += 1
            p["ntime"][k["name"][:90]] += k["dur"]
    gcorr = {L["args"].get("correlation") for L in launches}
    eager = [e for e in ev if e.get("cat") == "kernel" and e["args"].get("correlation") not in gcorr]
    print(f"\n== batch {bs}: wall {wall*1e3:.1f} ms, eager kernels {len(eager)} ({sum(e['dur'] for e in eager):.0f} us)")
    print(f"{'graph':46s} {'replays':>7s} {'kern/rep':>8s} {'ktime us/rep':>12s} {'span us/rep':>11s}")
    rows = {}
    for key, p in sorted(per.items(), key=lambda kv: -kv[1]["span"]):
        n = p["replays"]
        print(f"{key[:46]:46s} {n:7d} {p['kernels']/n:8.1f} {p['ktime']/n:12.1f} {p['span']/n:11.1f}")
        rows[key] = {"replays": n, "kernels_per": p["kernels"] / n, "ktime_us_per": p["ktime"] / n, "span_us_per": p["span"] / n,
                     "top": [(nm, p["names"][nm] / n, p["ntime"][nm] / n) for nm, _ in p["ntime"].most_common(40)]}
    for key in rows:
        if "'draft', 'step'" in key or "'draft', 'start'" in key:
            print(f"-- {key}: kernels per replay, us per replay")
            for nm, c, t in rows[key]["top"]:
                print(f"   {c:5.1f} {t:7.1f}  {nm}")
    ecount = collections.Counter(e["name"][:90] for e in eager)
    print("-- eager kernels (count over the run):", ecount.most_common(15))
    report[bs] = {"wall_ms": wall * 1e3, "graphs": rows, "eager": ecount.most_common(40)}
json.dump(report, open(f"{out}/prof_draft.json", "w"), indent=1)
eng.shutdown()
