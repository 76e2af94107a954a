// A bfloat16 forward step (decode, prefill chunk, speculative verify) of a Llama-family decoder
// (Llama 2/3, SmolLM2, Qwen2's qkv bias) on the CPU, all layers in one call: the CPU counterpart
// of replaying a step's CUDA graph.
//
// The Python forward (constrained_spec/models/llama.py) calls the same native kernels, one call
// per op: ~10 a layer, each wrapped in argument checks and module dispatch, ~68 us a layer of
// Python on the 2-core dev VM, 2 ms of a ~17 ms SmolLM2 step at batch 8. This runs that sequence
// of kernels from C++ over buffers the caller allocated once per step, so its output is the Python
// forward's bit for bit (tests/test_native_forward.py). Every projection must be AMX-packed
// (amx_linear.h); the caller checks shapes, the kernels check slots and positions.
#pragma once

#include <cstdint>

namespace cspec {

// The addresses of one layer's weights, in the order of ForwardModel::layer_table's rows.
enum LayerWeight : int64_t { kInputNorm, kQkv, kQkvBias, kOut, kPostNorm, kGateUp, kDown, kLayerWeights };

struct ForwardModel {
  int64_t layers = 0, hidden = 0, heads = 0, kv_heads = 0, head_dim = 0, intermediate = 0;
  float eps = 0.0f;
  int sum_lanes = 8;                     // cpu_kernels.h's rms_norm
  const int64_t* layer_table = nullptr;  // [layers, kLayerWeights] addresses (kQkvBias 0: none)
  const uint16_t* final_norm = nullptr;
  const float* cos_sin_cache = nullptr;  // [max_position, head_dim] float32
  int64_t max_position = 0;
};

// A decode step has one new token per sequence (tokens == batch, q_lens null); a prefill chunk or
// a verify step several (tree attention, cpu_kernels.h: causal, or the draft tree's mask).
struct ForwardBatch {
  int64_t batch = 0, tokens = 0;
  const int64_t* positions = nullptr;  // [tokens]
  const int64_t* out_slots = nullptr;  // [tokens]: where each new token's k and v go
  const int64_t* slot_table = nullptr;  // [batch, table_width], rows table_row_stride apart
  int64_t table_width = 0, table_row_stride = 0;
  const int32_t* kv_lens = nullptr;  // [batch], the new tokens included
  const int32_t* q_starts = nullptr;  // [batch + 1]; null for a decode step
  const int32_t* q_lens = nullptr;    // [batch]; null for a decode step
  const uint8_t* tree_mask = nullptr;  // [batch, mask_width, mask_width]; null: causal
  int64_t mask_width = 0;
  uint16_t* k_cache = nullptr;       // [layers, num_slots, kv_heads, head_dim]
  uint16_t* v_cache = nullptr;
  int64_t num_slots = 0;
  float scale = 1.0f;
};

// Buffers of `tokens` rows: x (in: the embeddings; out: the final norm's output), residual
// [hidden], qkv [(heads + 2 kv_heads) head_dim], attn [heads head_dim], gate_up [2 intermediate],
// act [intermediate].
struct ForwardBuffers {
  uint16_t *x = nullptr, *residual = nullptr, *qkv = nullptr, *attn = nullptr, *gate_up = nullptr,
           *act = nullptr;
};

void forward_step_bf16(const ForwardModel& model, const ForwardBatch& batch, const ForwardBuffers& buf);

}  // namespace cspec
