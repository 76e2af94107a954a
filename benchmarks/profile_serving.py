"""Where a served run spends its Python time: py-spy samples every process of `serve` (the engine
process, each front-end, the parent) while clients load it at a fixed concurrency, and the report
lists, per process and thread, the functions the samples were in (their own code, and everything they
called). With `--gil`, only the thread holding the GIL is sampled: what the engine process's GIL
goes to.

    python benchmarks/profile_serving.py --device cuda --workload plain --clients 64 --out /tmp/prof

Needs py-spy (`pip install py-spy`) and ptrace rights over the server's processes (root, or
kernel.yama.ptrace_scope 0). Writes, under --out: one raw py-spy file per process, profile.md and
profile.json, and the run's client-side summary.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_serving as bs  # noqa: E402
from cpu_time import process_tree  # noqa: E402


def describe(pid: int) -> str:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "?"
    text = " ".join(c.decode(errors="replace") for c in cmd if c)
    return text[:160]


def read_raw(path: Path) -> Counter:
    """py-spy's raw (collapsed) output: `frame;frame;... count` per line."""
    stacks: Counter = Counter()
    if not path.is_file():
        return stacks
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            stacks[stack] += int(count)
    return stacks


def summarize(stacks: Counter, top: int) -> dict:
    """Samples per thread, and the functions with the most samples: self (the innermost frame) and
    total (anywhere on the stack, counted once per stack)."""
    threads: Counter = Counter()
    own: Counter = Counter()
    total: Counter = Counter()
    for stack, n in stacks.items():
        frames = stack.split(";")
        threads[frames[0]] += n
        own[frames[-1]] += n
        for f in set(frames[1:]):
            total[f] += n
    samples = sum(stacks.values())
    return {"samples": samples, "threads": threads.most_common(),
            "self": own.most_common(top), "total": total.most_common(top)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--server", default="split", help="split, split-N or single (as bench_serving.py)")
    ap.add_argument("--server-args", default="")
    ap.add_argument("--workload", default="plain", help="a bench_serving.py workload")
    ap.add_argument("--stream", action="store_true")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--warmup-s", type=float, default=6.0, help="load before sampling starts")
    ap.add_argument("--seconds", type=float, default=10.0, help="sampling time")
    ap.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    ap.add_argument("--gil", action="store_true", help="sample only the thread holding the GIL")
    ap.add_argument("--idle", action="store_true",
                    help="sample idle threads too (a thread's samples then split its wall time: where the engine "
                         "loop waits for the device shows)")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--client-procs", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)

    py_spy = shutil.which("py-spy")
    if py_spy is None:
        raise SystemExit("py-spy is not installed (pip install py-spy)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from constrained_spec.models import resolve_model_path
    model = resolve_model_path(args.model)
    server = bs.Server(model, args.device, args.server_args.split() + bs.server_flags(args.server), out / "server.log")
    pool = bs.client_pool(args.client_procs)
    try:
        # the load lasts the warm-up and the sampling (the clients stop sending then), with more
        # requests than a server answers in that time (10 a second per client)
        load_s = args.warmup_s + args.seconds + 1
        n = int(args.clients * 10 * load_s)
        bodies = [j.body(args.max_tokens, args.stream) for j in bs.make_jobs(args.workload, n)]
        result: dict = {}
        until = time.time() + 0.5 + load_s  # run_clients starts them 0.5 s from now
        load = threading.Thread(target=lambda: result.update(
            bs.run_clients(pool, args.client_procs, server.url, bodies, args.stream, args.clients, None, until)))
        load.start()
        time.sleep(args.warmup_s)
        pids = process_tree(server.proc.pid)
        commands = {pid: describe(pid) for pid in pids}
        spies = []
        for pid in pids:
            cmd = [py_spy, "record", "-p", str(pid), "-d", str(int(args.seconds)), "-r", str(args.rate),
                   "-f", "raw", "-o", str(out / f"{pid}.txt"), "--threads", "--nonblocking"]
            if args.gil:
                cmd.append("--gil")
            if args.idle:
                cmd.append("--idle")
            spies.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
        errors = {pid: s.communicate()[1][-400:] for pid, s in zip(pids, spies) if s.wait() != 0}
        load.join()
    finally:
        pool.close()
        pool.join()
        server.stop()

    report = {"command": "python benchmarks/profile_serving.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "client": {k: result.get(k) for k in ("out_tok_s", "req_s", "requests", "errors", "ttft", "e2e")},
              "processes": {}, "py_spy_errors": errors}
    lines = [f"# Served-run profile", "", f"`{report['command']}`", "",
             f"Clients saw {result.get('out_tok_s', 0):,.0f} output tok/s, {result.get('errors')} errors; "
             f"py-spy at {args.rate} Hz for {args.seconds:g} s{' (GIL holder only)' if args.gil else ''}"
             f"{' (idle threads too)' if args.idle else ''}.", ""]
    for pid in pids:
        summary = summarize(read_raw(out / f"{pid}.txt"), args.top)
        summary["command"] = commands[pid]
        report["processes"][pid] = summary
        if not summary["samples"]:
            continue
        lines += [f"## pid {pid}: `{summary['command']}`", "", f"{summary['samples']} samples.", "",
                  "| thread | samples |", "|---|---|"]
        lines += [f"| {t} | {n} |" for t, n in summary["threads"]]
        lines += ["", "| self: function | samples | share |", "|---|---|---|"]
        lines += [f"| `{f}` | {n} | {n / summary['samples']:.1%} |" for f, n in summary["self"]]
        lines += ["", "| total: function | samples | share |", "|---|---|---|"]
        lines += [f"| `{f}` | {n} | {n / summary['samples']:.1%} |" for f, n in summary["total"]]
        lines.append("")
    if errors:
        lines += ["py-spy failed on: " + ", ".join(f"{p} ({e.strip()[-200:]})" for p, e in errors.items())]
    (out / "profile.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "profile.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:8]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
