#!/bin/bash
# The GPU machine's work for one session, in stages that each fit one `run` (10 minutes).
# Prepared here, sent as (carry .device/bin .device/wheels, plus the model half named):
#
#   1. carry .device/model/smol.part00 and .device/tok (config + tokenizer, ~3.5 MB):  source .device/bin/setup.sh; bash benchmarks/device_session.sh profile
#      (random weights: host phases of the decode step; no real weights needed)
#   2. carry .device/model/smol.part01, at once:  source .device/bin/setup.sh; bash benchmarks/device_session.sh tests
#   3. at once (the model stays in /tmp while the machine is held):  ... device_session.sh gpu
#   4. at once:  ... device_session.sh spec_json
#   5. at once:  ... device_session.sh spec_rag
#   (A/Bs as needed: `mask_ab` (mask-fill threads at batch 32/64), `timeline` (batch-1 JSON step timeline))
# (the machine is given back ~30 s after a call: send each call as soon as the last returns)
#
# Every stage copies what it wrote to $OUT (results/, logs) and prints a short summary last.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT/results"
cd "$(dirname "$0")/.."

stage_profile() {
  (cd benchmarks && python3 profile_decode_host.py --model-dir ../.device/tok --batches 1,8,32,64,128) \
    > "$OUT/profile.log" 2>&1
  tail -n 30 "$OUT/profile.log"
}

stage_tests() {
  timeout 560 python3 -m pytest -q -m gpu tests --durations=15 > "$OUT/pytest_gpu.log" 2>&1
  tail -n 15 "$OUT/pytest_gpu.log"
}

stage_gpu() {
  (cd benchmarks && timeout 560 python3 bench_gpu.py) > "$OUT/bench_gpu.log" 2>&1
  tail -n 40 "$OUT/bench_gpu.log"
}

stage_spec() {  # both workloads in one call: may not fit 10 minutes with 30 JSON prompts
  (cd benchmarks && timeout 560 python3 bench_spec.py) > "$OUT/bench_spec.log" 2>&1
  tail -n 50 "$OUT/bench_spec.log"
}

stage_mask_ab() {  # grammar-mask threads: 1 against the default (one per 8 rows), same machine, one run
  for threads in 1 default; do
    opt=$([ "$threads" = default ] || echo "--opt grammar_mask_threads=$threads")
    (cd benchmarks && timeout 250 python3 bench_gpu.py --skip-hf --skip-8b --batches 32,64,128 $opt \
      --name gpu_mask_threads_$threads) > "$OUT/mask_ab_$threads.log" 2>&1
    grep "^| [0-9]" "$OUT/mask_ab_$threads.log"
  done
}

stage_timeline() {
  (cd benchmarks && timeout 400 python3 profile_timeline.py) > "$OUT/timeline.log" 2>&1
  tail -n 12 "$OUT/timeline.log"
}

stage_spec_json() {  # ~6 minutes with 3 timed runs per row
  (cd benchmarks && timeout 560 python3 bench_spec.py --workloads json --name spec_cuda_json) > "$OUT/bench_spec_json.log" 2>&1
  tail -n 25 "$OUT/bench_spec_json.log"
}

stage_spec_rag() {
  (cd benchmarks && timeout 560 python3 bench_spec.py --workloads rag --name spec_cuda_rag) > "$OUT/bench_spec_rag.log" 2>&1
  tail -n 25 "$OUT/bench_spec_rag.log"
}

stage_spec_ab() {  # speculative chain masks on 1 thread vs the default (the fill pool), JSON batch 32, same machine
  for threads in 1 default; do
    opt=$([ "$threads" = default ] || echo "--opt grammar_mask_threads=$threads")
    (cd benchmarks && timeout 200 python3 bench_spec.py --workloads json --batches 32 --engines "ngram chain always" $opt \
      --name spec_ab_threads_$threads) > "$OUT/spec_ab_$threads.log" 2>&1
    grep "^| json" "$OUT/spec_ab_$threads.log"; grep -o '"phase_ms": {[^}]*}' "$OUT/spec_ab_$threads.log"
  done
}

stage_host() {  # random weights: host phases of a decode step, batch 1-128, plain vs JSON
  (cd benchmarks && timeout 200 python3 profile_decode_host.py --model-dir ../.device/tok --batches 1,32,64,128 \
    --tokens 96 --name ${HOST_NAME:-host_final}) > "$OUT/host.log" 2>&1
  tail -n 8 "$OUT/host.log"
}

stage_accept_ab() {  # the overlapped step's accepts in the fill's job (default) vs a pool call of their own before it
  for how in in_fill before; do
    opt=$([ "$how" = before ] && echo "--accepts-before-fill")
    (cd benchmarks && timeout 200 python3 bench_gpu.py --skip-hf --skip-8b $opt --name gpu_accepts_$how) \
      > "$OUT/bench_gpu_accepts_$how.log" 2>&1
    echo "-- $how"; grep "^| [0-9b]" "$OUT/bench_gpu_accepts_$how.log" | cut -d'|' -f2-7
  done
}

stage_host_real() {  # real weights: host phases of a decode step, JSON at its own lengths vs plain at the same lengths
  (cd benchmarks && timeout 300 python3 profile_decode_host.py --real-weights --detail --batches 32,64,128 \
    --tokens 128 --name ${HOST_NAME:-host_real}) > "$OUT/host_real.log" 2>&1
  python3 - <<'PY'
import json, os
for r in json.load(open(f"benchmarks/results/{os.environ.get('HOST_NAME', 'host_real')}.json")):
    print(r["batch"], r["workload"], r["steps"], r["step_ms"], {k[:34]: v for k, v in r["phase_ms"].items() if v >= 0.02})
PY
}

stage_engine_tests() {  # the engine's GPU tests (real weights): backends, graphs, prefill graphs, speculation
  timeout 240 python3 -m pytest -q -m gpu tests/test_engine_gpu.py > "$OUT/pytest_engine_gpu.log" 2>&1
  tail -n 4 "$OUT/pytest_engine_gpu.log"
}

stage_gpu_quick() {  # bench_gpu without the HF baselines and the 8B shapes (those change with neither)
  (cd benchmarks && timeout 240 python3 bench_gpu.py --skip-hf --skip-8b --name gpu_final) > "$OUT/bench_gpu.log" 2>&1
  grep "^| [0-9]" "$OUT/bench_gpu.log"
}

stage_fused_rope() {  # Triton attention + fused-kernel GPU tests, then the fused-RoPE decode A/B (random weights)
  timeout 300 python3 -m pytest -q -m gpu tests/test_triton_attention.py tests/test_fused_kernels.py \
    > "$OUT/pytest_attention_gpu.log" 2>&1
  tail -n 3 "$OUT/pytest_attention_gpu.log"
  (cd benchmarks && timeout 240 python3 bench_fused_rope.py) > "$OUT/fused_rope.log" 2>&1
  grep "^| [0-9]" "$OUT/fused_rope.log"
}

stage_fill_micro() {  # mask fill microbench: xgrammar's batch matcher by threads vs the native pool (tokenizer only)
  (cd benchmarks && timeout 120 python3 bench_fill_threads.py --model-dir ../.device/tok --name fill_threads_native) \
    > "$OUT/fill_threads.log" 2>&1
  grep "^| [0-9b]" "$OUT/fill_threads.log"
}

stage_native_ab() {  # grammar work on the native pool (on its threads / one call beside the step thread) vs xgrammar's batch matcher
  for fill in native beside xgrammar; do
    opt=$(case $fill in native) ;; beside) echo "--fill-beside-step-thread";; *) echo "--xgrammar-fill";; esac)
    (cd benchmarks && timeout 220 python3 bench_gpu.py --skip-hf --skip-8b $opt --name gpu_fill_$fill) \
      > "$OUT/bench_gpu_$fill.log" 2>&1
    echo "-- $fill"; grep "^| [0-9b]" "$OUT/bench_gpu_$fill.log"
  done
}

touch "$OUT/.start"  # only what this call wrote goes back ($OUT holds a limited number of files)
for stage in "$@"; do
  echo "== $stage"
  "stage_$stage"
  find benchmarks/results -type f -newer "$OUT/.start" -exec cp {} "$OUT/results/" \;
done
