#!/bin/bash
# The GPU tests and benchmarks, by stage, on a CUDA machine with the project installed
# (`pip install -e ".[dev]"` with a CUDA build of torch). The default model (SmolLM2-135M-Instruct)
# is fetched on first use and cached, as for `constrained-spec serve`.
#
#   bash benchmarks/run_gpu.sh STAGE [STAGE ...]
#
# Stages (each writes benchmarks/results/ as its script says; the figures of docs/performance.md):
#   tests      the GPU test suite (pytest -m gpu) but the served stress runs (~4 min on an H100 with
#              the model; the whole suite takes longer than a 10-minute command)
#   stress     the GPU stress runs alone (tests/test_stress_cpu.py::test_stress_gpu, twelve configurations, ~12 min:
#              in two commands, STRESS_K="not eagle" then STRESS_K=eagle, a pytest -k expression)
#   gpu        bench_gpu.py: plain vs JSON at batch 1-128, HF baseline, 8B shapes -> gpu.*
#   spec       bench_spec.py, JSON then RAG-like workload -> spec_cuda_json.*, spec_cuda_rag.*
#   serving    bench_serving.py: the HTTP server (split and single-process) vs the engine -> bench_serving.*
#   prefix     bench_serving.py, prefix cache on / off (3 interleaved rounds of 40 requests a client, ~8 s
#              a run: shorter runs move a round's ratio by several percent): short JSON prompts, prompts
#              that share nothing, a 1,500-token shared system prompt, multi-turn -> bench_serving_prefix.*
#   prefix_engine  prefix_cache_ab.py: the cache on / off in the engine alone (JSON, or WORKLOAD=distinct;
#              answers of 64-128 tokens), with the engine thread's time in the cache's functions and its
#              wait for the device a step -> prefix_cache_ab.* (prefix_cache_ab_distinct.*)
#   prefix_profile  profile_serving.py --gil, prefix cache on then off, the json workload streamed at 64
#              clients: where each arm's engine process spends its GIL (needs py-spy: pip install py-spy)
#              -> $OUT/prefix_profile_{on,off}/profile.md
#   attention  bench_attention.py: Triton vs torch attention, one layer -> attention.*
#   kernels    bench_kernels.py: decode forward by kernel set, mask kernel (prints only)
#   mask       bench_mask_latency.py on CUDA -> mask_latency_cuda.*; bench_mask_fill.py -> mask_fill.*
#   eagle      train-eagle for the default model into $OUT/smollm2-135m-eagle (~6 min on an H100), then
#              eagle_bench with that head (~3 min)
#   eagle_bench  bench_spec.py: plain, n-gram chain, EAGLE tree (depth 1 masked, and depths 1-2) and chain
#              (fused, naive EAGLE; measured policy), EAGLE tree and chain (fused and drafted apart)
#              speculating at every step; JSON at batch 1/8/32/64, chat at batch 1 ->
#              $OUT/spec_<device>_eagle_json.*, $OUT/spec_<device>_eagle_chat.*, each with EAGLE's host
#              ms per step by phase (EAGLE_HEAD: the head folder; default the shipped one)
#   eagle_masked  bench_spec.py: plain and EAGLE speculating at every step with the widest tree, every
#              depth masked (64 draft tokens, top-8, depth 8: ~4 tokens a step), JSON at batch 1 and 8,
#              with EAGLE's host ms per step by phase; the draft rows walked on forks of 4 paths (the
#              default), of 1 path, and on the engine thread alone -> $OUT/spec_<device>_eagle_masked.*
#   policy     bench_spec.py: the measured policy with n-gram and EAGLE (tree, fused chain) at batch 32 and
#              64, JSON, 4 rounds, its speculative steps by batch bucket -> $OUT/spec_<device>_policy.*
#   all        tests stress gpu spec attention
#
# PYTHON selects the interpreter (default: python3); OUT, where the eagle and prefix_profile stages write (default
# benchmarks/results/eagle); DEVICE=cpu with MODEL, TRAIN_ARGS and BENCH_ARGS runs the
# eagle stages at toy sizes on a CPU (tests/test_run_gpu.py). MODEL (a folder or GGUF) also
# serves the prefix stages; random weights answer to max_tokens, so give them
# BENCH_ARGS="--max-tokens-spread 0.5" there (answers that all end together come back in waves).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

stage_tests() { "$PYTHON" -m pytest -q -m gpu tests -k "not test_stress_gpu"; }
stage_stress() { "$PYTHON" -m pytest -q -m gpu tests/test_stress_cpu.py -k "test_stress_gpu${STRESS_K:+ and ($STRESS_K)}"; }
stage_gpu() { "$PYTHON" benchmarks/bench_gpu.py; }
stage_spec() {
  "$PYTHON" benchmarks/bench_spec.py --workloads json
  "$PYTHON" benchmarks/bench_spec.py --workloads rag
}
stage_serving() { "$PYTHON" benchmarks/bench_serving.py --device cuda --workloads plain,json,schemas; }
stage_prefix() {
  "$PYTHON" benchmarks/bench_serving.py "${MODEL_ARGS[@]}" --device cuda --workloads json,distinct,shared-prefix,multi-turn \
    --clients 64 --stream yes --rates "" --no-engine --max-tokens 128 --rounds 40 --servers split,split+nocache \
    --interleave 3 --name bench_serving_prefix ${BENCH_ARGS:-}
}
stage_prefix_engine() {
  local w=${WORKLOAD:-json}
  "$PYTHON" benchmarks/prefix_cache_ab.py "${MODEL_ARGS[@]}" --workload "$w" --max-tokens-spread 0.5 \
    --name "prefix_cache_ab$([ "$w" = json ] || echo "_$w")"
}
stage_prefix_profile() {
  local arm
  for arm in on off; do
    "$PYTHON" benchmarks/profile_serving.py "${MODEL_ARGS[@]}" --device cuda --workload json --stream --clients 64 \
      --max-tokens 128 --gil --out "$OUT/prefix_profile_$arm" \
      --server-args="$([ $arm = off ] && echo --disable-prefix-cache)"
  done
}
stage_attention() { "$PYTHON" benchmarks/bench_attention.py; }
stage_kernels() { "$PYTHON" benchmarks/bench_kernels.py 1 8 32 64 128; }
stage_mask() {
  "$PYTHON" benchmarks/bench_mask_latency.py
  "$PYTHON" benchmarks/bench_mask_fill.py
}
OUT=${OUT:-benchmarks/results/eagle}
DEVICE=${DEVICE:-cuda}
MODEL_ARGS=(${MODEL:+--model "$MODEL"})  # empty: the default model ($SMOLLM2_GGUF where set)
stage_eagle() {
  mkdir -p "$OUT"
  # ~1.5 min of generation (~1M answer tokens at batch 128) + 2.5 min of training + a short acceptance run
  "$PYTHON" -m constrained_spec.cli train-eagle "${MODEL_ARGS[@]}" --device "$DEVICE" --out "$OUT/smollm2-135m-eagle" \
    --gen-minutes 1.5 --train-minutes 2.5 --eval-prompts 16 ${TRAIN_ARGS:-}
  EAGLE_HEAD="$OUT/smollm2-135m-eagle" stage_eagle_bench
}
stage_eagle_bench() {
  mkdir -p "$OUT"
  local head=(${EAGLE_HEAD:+--eagle-head "$EAGLE_HEAD"}) engines="plain,ngram chain,eagle,eagle mask2,eagle chain,eagle always,eagle chain always,eagle chain apart always"
  local common=(--device "$DEVICE" "${MODEL_ARGS[@]}" "${head[@]}" --engines "$engines" --max-tokens 128
                --min-prompts 16 --repeats 2)
  BENCH_RESULTS="$OUT" "$PYTHON" benchmarks/bench_spec.py "${common[@]}" --workloads json \
    --grammar-backends xgrammar --batches 1,8,32,64 --name "spec_${DEVICE}_eagle_json" ${BENCH_ARGS:-}
  BENCH_RESULTS="$OUT" "$PYTHON" benchmarks/bench_spec.py "${common[@]}" --workloads chat --batches 1 \
    --name "spec_${DEVICE}_eagle_chat" ${BENCH_ARGS:-}
}
stage_eagle_masked() {
  mkdir -p "$OUT"
  BENCH_RESULTS="$OUT" "$PYTHON" benchmarks/bench_spec.py --device "$DEVICE" "${MODEL_ARGS[@]}" \
    ${EAGLE_HEAD:+--eagle-head "$EAGLE_HEAD"} --engines "plain,eagle always,eagle always walk1,eagle always serial" --workloads json \
    --grammar-backends xgrammar --batches 1,8 --max-tokens 128 --min-prompts 8 --repeats 2 --draft-tokens 64 \
    --opt eagle_topk=8 --opt eagle_depth=8 --opt eagle_masked_depths=8 --name "spec_${DEVICE}_eagle_masked" \
    ${BENCH_ARGS:-}
}
stage_policy() {
  mkdir -p "$OUT"
  BENCH_RESULTS="$OUT" "$PYTHON" benchmarks/bench_spec.py --device "$DEVICE" "${MODEL_ARGS[@]}" \
    ${EAGLE_HEAD:+--eagle-head "$EAGLE_HEAD"} --engines "plain,ngram chain,eagle,eagle chain" --workloads json \
    --grammar-backends xgrammar --batches 32,64 --max-tokens 128 --min-prompts 16 --repeats 4 \
    --name "spec_${DEVICE}_policy" ${BENCH_ARGS:-}
}
stage_all() { stage_tests; stage_stress; stage_gpu; stage_spec; stage_attention; }

if [ $# -eq 0 ]; then
  sed -n '2,47p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
fi
[ "$DEVICE" = cpu ] || "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device visible to torch')"
for stage in "$@"; do
  if ! declare -F "stage_$stage" > /dev/null; then
    echo "unknown stage: $stage (see bash benchmarks/run_gpu.sh)" >&2
    exit 2
  fi
  echo "== $stage"
  "stage_$stage"
done
