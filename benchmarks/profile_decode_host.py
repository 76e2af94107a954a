"""Where a decode step's host time goes, plain vs JSON schema, on the real engine loop.

Times each phase of the engine thread's loop (schedule, forward launch and the KV plan in it,
processing the previous step's tokens, the wait for the device, the grammar-mask fill, sample
launch) by wrapping those methods, and with --cprofile lists the engine thread's top functions.
In the overlapped loop the fill starts inside the processing and runs on the grammar pool's threads
while the engine thread appends the step's tokens ("appends beside the mask fill"); "mask fill wait
after the appends" is what it still holds the engine thread up. On CUDA
with overlap, a step is host-bound when `wait` is near zero: the device finished before the host
asked. `--overlap` runs the overlapped loop on the CPU too.

Runs on random weights of a model folder's shapes (config.json + tokenizer; the weights are not
read), so the GPU machine needs no real weights:
  python benchmarks/profile_decode_host.py --model-dir DIR --batches 1,32 [--cprofile]
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import json
import pstats
import sys
import time
from collections import defaultdict

import torch

from common import PERSON_SCHEMA, RESULTS, chat_prompts, random_weights


def random_model(folder: str, device: str):
    from constrained_spec.models.loader import collect_eos_ids, load_folder_tokenizer, read_model_config
    _, cfg = read_model_config(folder)
    tok = load_folder_tokenizer(folder)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    return random_weights(cfg, tok, dtype, device, 0.02, "random " + cfg.model_type, collect_eos_ids(folder, cfg, tok))


class PhaseTimer:
    """Accumulates wall time per wrapped method (on the engine thread, or on the step thread while
    the engine thread is in a GIL-free call: one thread at a time)."""

    def __init__(self):
        self.seconds = defaultdict(float)

    def wrap(self, obj, name: str, phase: str) -> None:
        inner = getattr(obj, name)
        acc = self.seconds

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                acc[phase] += time.perf_counter() - t0
        setattr(obj, name, timed)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", default=None, help="HF folder (default: SmolLM2-135M-Instruct's)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--cprofile", action="store_true")
    ap.add_argument("--opt", action="append", default=[], metavar="KEY=VALUE",
                    help="engine option, e.g. grammar_mask_threads=15 (repeatable)")
    ap.add_argument("--batch-matcher-threads", type=int, default=None,
                    help="threads of xgrammar's BatchGrammarMatcher in the unbudgeted fill, whatever the rows (A/B; "
                         "the engine uses one per 8 rows up to grammar_mask_threads)")
    ap.add_argument("--real-weights", action="store_true",
                    help="the real model (resolve_model_path) instead of random weights: JSON answers end where the "
                         "model ends them, and plain runs each request for as many tokens as its JSON answer took "
                         "(the batch drains as in the JSON run: bench_gpu.py's 'plain, json lengths')")
    ap.add_argument("--name", default=None, help="results file name (default decode_host_<device>)")
    ap.add_argument("--gc-freeze", action="store_true", help="gc.freeze() after start-up (A/B)")
    ap.add_argument("--detail", action="store_true",
                    help="also time the decode graph launch, every graph replay and every event synchronize")
    ap.add_argument("--overlap", action="store_true",
                    help="run the overlapped loop on the CPU too (the next step is launched before the last one's "
                         "tokens are processed, and its mask fill runs beside that processing)")
    args = ap.parse_args()
    from constrained_spec import SamplingParams
    from constrained_spec.engine import Engine
    from constrained_spec.engine import engine as engine_mod
    from constrained_spec.engine.model_runner import StepResult
    from constrained_spec.grammar import GrammarSpec
    from constrained_spec.models import resolve_model_path

    profile = cProfile.Profile() if args.cprofile else None
    if profile is not None:
        loop = engine_mod.Engine._loop

        def profiled(self):
            profile.enable()
            try:
                loop(self)
            finally:
                profile.disable()
        engine_mod.Engine._loop = profiled
    timer = PhaseTimer()
    timer.wrap(StepResult, "wait", "wait")
    opts = {k: json.loads(v) for k, v in (o.split("=", 1) for o in args.opt)}
    source = (dict(model=resolve_model_path(None)) if args.real_weights
              else dict(loaded=random_model(args.model_dir or resolve_model_path(None), args.device)))
    eng = Engine(**source, device=args.device, max_running_requests=max(int(b) for b in args.batches.split(",")), **opts)
    if args.batch_matcher_threads is not None:  # every batch fill on this many threads
        import xgrammar as xgr
        fixed = xgr.BatchGrammarMatcher(max_threads=args.batch_matcher_threads)
        eng.masks._batch_matcher = lambda rows: fixed
        opts["batch_matcher_threads"] = args.batch_matcher_threads
    timer.wrap(eng.scheduler, "schedule", "schedule")
    timer.wrap(eng.runner, "forward", "forward launch")
    timer.wrap(eng.runner, "plan", "plan (in forward launch)")
    timer.wrap(eng.runner, "sample", "sample launch")
    timer.wrap(eng, "_process", "process (incl. wait)")
    timer.wrap(eng, "_fill_bitmask", "mask fill")
    if hasattr(eng, "_fill_beside"):  # (older engines fill after the processing)
        timer.wrap(eng.masks, "start", "mask fill prepare + start (in process)")
        timer.wrap(eng, "_fill_beside", "appends beside the mask fill, incl. its wait (in process)")
    if hasattr(eng, "_finish_fill"):  # what the fill still holds the engine thread after the appends
        timer.wrap(eng, "_finish_fill", "mask fill wait after the appends (in process)")
    timer.wrap(eng.masks, "accept", "grammar accept (in process)")
    if args.detail and getattr(eng.masks, "_native", None) is not None:  # the pieces of a started fill's start
        from constrained_spec.engine import mask_filler
        from constrained_spec.grammar.native_fill import PoolFill
        timer.wrap(mask_filler, "_allow_all", "start: rows allowed all (in mask fill start)")
        timer.wrap(eng.masks._native, "prepare", "start: prepare (in mask fill start)")
        timer.wrap(PoolFill, "start", "start: pool wake-up call (in mask fill start)")
        timer.wrap(eng.masks, "settle", "start: settle (in mask fill start)")
    if hasattr(eng, "_append_accepted"):  # the step's per-request Python (beside a fill)
        timer.wrap(eng, "_append_accepted", "append tokens, per-request python (in process)")
    if args.detail:  # a graphed decode launch, piece by piece (the same calls as ModelRunner.forward)
        runner, plain_forward = eng.runner, eng.runner.forward
        acc = timer.seconds

        def forward_pieces(batch):
            from constrained_spec.attention import ForwardMode
            if batch.mode is not ForwardMode.DECODE or runner.graphs is None:
                return plain_forward(batch)
            t0 = time.perf_counter()
            with torch.inference_mode():
                t1 = time.perf_counter()
                p = runner.plan(batch)
                t2 = time.perf_counter()
                out = runner.graphs.launch_decode(p.rows, p.positions, p.out_slots, p.kv_lens)
                t3 = time.perf_counter()
            t4 = time.perf_counter()
            for name, dt in (("enter", t1 - t0), ("plan", t2 - t1), ("launch_decode", t3 - t2), ("exit", t4 - t3)):
                acc[f"decode forward: {name}"] += dt
            return out
        eng.runner.forward = forward_pieces
        timer.wrap(eng.runner, "forward", "forward launch (around the pieces)")
    if args.detail:  # the device calls inside the launches (class-level wraps: every graph, every event)
        if eng.runner.graphs is not None:
            timer.wrap(eng.runner.graphs, "launch_decode", "graph decode launch (in forward launch)")
        timer.wrap(torch.cuda.CUDAGraph, "replay", "graph replays (forward + sample)")
        timer.wrap(torch.cuda.Event, "synchronize", "event synchronize (in forward launch and wait)")
    if args.detail:  # garbage collections, any thread: time and count per generation
        gc_start = [0.0]

        def on_gc(phase, info):
            if phase == "start":
                gc_start[0] = time.perf_counter()
            else:
                timer.seconds[f"gc gen {info['generation']}"] += time.perf_counter() - gc_start[0]
                timer.seconds[f"gc gen {info['generation']} count x1000"] += 0.001  # shown per step below
        gc.callbacks.append(on_gc)
    if args.gc_freeze:
        gc.collect()
        gc.freeze()  # what the engine holds after start-up is never scanned again
        opts["gc_freeze"] = True
    if args.overlap:
        eng._overlapped = lambda: True
        opts["overlap"] = True
    records = []
    for bs in [int(b) for b in args.batches.split(",")]:
        prompts = chat_prompts(eng.tokenizer, bs, json_task=True)
        lengths = None  # the JSON answers' lengths (real weights: plain runs them)
        for kind, grammar in (("json", GrammarSpec.json_schema(PERSON_SCHEMA)), ("plain", None)):
            if args.real_weights and kind == "json":
                sp = SamplingParams(max_tokens=args.tokens, temperature=0)
            elif args.real_weights:
                sp = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths]
            else:
                sp = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
            eng.generate(prompts, sp, grammar)  # warm-up
            timer.seconds.clear()
            steps0 = eng.stats.decode_steps
            t0 = time.perf_counter()
            outs = eng.generate(prompts, sp, grammar)
            wall = time.perf_counter() - t0
            lengths = lengths or [o.completion_tokens for o in outs]
            steps = eng.stats.decode_steps - steps0
            ms = {k: round(1000 * v / steps, 3) for k, v in sorted(timer.seconds.items())}
            rec = dict(opts=opts, batch=bs, workload=kind, steps=steps, step_ms=round(1000 * wall / steps, 3),
                       tokens=sum(o.completion_tokens for o in outs), phase_ms=ms)
            records.append(rec)
            print(json.dumps(rec), flush=True)
    eng.shutdown()
    (RESULTS / f"{args.name or 'decode_host_' + args.device}.json").write_text(json.dumps(records, indent=1))
    if profile is not None:
        stats = pstats.Stats(profile, stream=sys.stdout).sort_stats("tottime")
        stats.print_stats(25)
        stats.print_callees("model_runner.py.*\\(forward\\)")  # where a step's launch goes


if __name__ == "__main__":
    main()
