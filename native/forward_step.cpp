#include "forward_step.h"

#include <cstring>

#include "amx_linear.h"
#include "cpu_kernels.h"

namespace cspec {

namespace {

template <typename T>
const T* weight(const int64_t* row, LayerWeight w) {
  return reinterpret_cast<const T*>(row[w]);
}

}  // namespace

void forward_step_bf16(const ForwardModel& m, const ForwardBatch& b, const ForwardBuffers& buf) {
  const int64_t B = b.tokens, H = m.hidden, D = m.head_dim, q_size = m.heads * D, kv_size = m.kv_heads * D;
  const int64_t qkv_width = q_size + 2 * kv_size, layer_slots = b.num_slots * kv_size;
  // The Python forward's first layer norms the embeddings out of place and keeps them as the
  // residual; every later norm adds the layer's output into the residual first, in place.
  std::memcpy(buf.residual, buf.x, sizeof(uint16_t) * B * H);
  for (int64_t l = 0; l < m.layers; ++l) {
    const int64_t* w = m.layer_table + l * kLayerWeights;
    if (l == 0)
      rms_norm_bf16(buf.residual, weight<uint16_t>(w, kInputNorm), buf.x, B, H, m.eps, m.sum_lanes);
    else
      add_rms_norm_bf16(buf.x, buf.residual, weight<uint16_t>(w, kInputNorm), B, H, m.eps, m.sum_lanes);
    amx_linear_bf16(buf.x, B, H, H, weight<uint16_t>(w, kQkv), qkv_width, weight<uint16_t>(w, kQkvBias), buf.qkv,
                    qkv_width);

    RopeArgs rope;
    rope.tokens = B, rope.num_heads = m.heads, rope.num_kv_heads = m.kv_heads, rope.head_dim = D;
    rope.q = buf.qkv, rope.q_row_stride = qkv_width;
    rope.k = buf.qkv + q_size, rope.k_row_stride = qkv_width;
    rope.v = buf.qkv + q_size + kv_size, rope.v_row_stride = qkv_width;
    rope.positions = b.positions, rope.cos_sin_cache = m.cos_sin_cache, rope.max_position = m.max_position;
    rope.k_cache = b.k_cache + l * layer_slots, rope.v_cache = b.v_cache + l * layer_slots;
    rope.slots = b.out_slots, rope.num_slots = b.num_slots;
    rope_bf16(rope);

    CacheAttentionArgs cache;
    cache.batch = b.batch, cache.num_heads = m.heads, cache.num_kv_heads = m.kv_heads, cache.head_dim = D;
    cache.q = buf.qkv, cache.q_row_stride = qkv_width;
    cache.k_cache = rope.k_cache, cache.v_cache = rope.v_cache, cache.num_slots = b.num_slots;
    cache.slot_table = b.slot_table, cache.table_width = b.table_width, cache.table_row_stride = b.table_row_stride;
    cache.kv_lens = b.kv_lens, cache.scale = b.scale, cache.out = buf.attn;
    if (b.q_lens) {
      TreeAttentionArgs attn;
      static_cast<CacheAttentionArgs&>(attn) = cache;
      attn.tokens = B, attn.q_starts = b.q_starts, attn.q_lens = b.q_lens;
      attn.tree_mask = b.tree_mask, attn.mask_width = b.mask_width;
      tree_attention_bf16(attn);
    } else {
      DecodeAttentionArgs attn;
      static_cast<CacheAttentionArgs&>(attn) = cache;
      decode_attention_bf16(attn);
    }

    amx_linear_bf16(buf.attn, B, q_size, q_size, weight<uint16_t>(w, kOut), H, nullptr, buf.x, H);
    add_rms_norm_bf16(buf.x, buf.residual, weight<uint16_t>(w, kPostNorm), B, H, m.eps, m.sum_lanes);
    amx_linear_bf16(buf.x, B, H, H, weight<uint16_t>(w, kGateUp), 2 * m.intermediate, nullptr, buf.gate_up,
                    2 * m.intermediate);
    silu_and_mul_bf16(buf.gate_up, buf.act, B, m.intermediate);
    amx_linear_bf16(buf.act, B, m.intermediate, m.intermediate, weight<uint16_t>(w, kDown), H, nullptr, buf.x, H);
  }
  add_rms_norm_bf16(buf.x, buf.residual, m.final_norm, B, H, m.eps, m.sum_lanes);
}

}  // namespace cspec
