// pybind11 bindings: constrained_spec._native.NgramTrie, MaskFillPool and the cpu_kernels submodule.
// Token inputs accept lists or numpy arrays (converted to int32); outputs are numpy int32 arrays.
// The CPU kernels take tensors as data_ptr() integers with their sizes (checked by the Python
// caller, constrained_spec/kernels/cpu_native.py). The GIL is released around trie work, mask
// fills and the kernels.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <optional>

#include "amx_linear.h"
#include "cpu_kernels.h"
#include "forward_step.h"
#include "mask_fill_pool.h"
#include "ngram_trie.h"

namespace py = pybind11;
using cspec::MaskFillPool;
using cspec::NgramConfig;
using cspec::NgramTrie;
using IntArr = py::array_t<int32_t, py::array::c_style | py::array::forcecast>;
using I64Arr = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

static py::dict config_dict(const NgramConfig& c) {
  py::dict d;
  d["max_ngram"] = c.max_ngram;
  d["min_ngram"] = c.min_ngram;
  d["num_draft_tokens"] = c.num_draft_tokens;
  d["branches"] = c.branches;
  d["capacity"] = c.capacity;
  d["request_capacity"] = c.request_capacity;
  d["window"] = c.effective_window();
  return d;
}

// The job of `fill_start`: matchers[i] fills bitmask row rows[i]; with `accept_method`, it first accepts
// tokens[i] (none where -1) and may then have no row (-1). No conversion of the arrays: they are read
// after fill_start returns, so they must be the caller's own (which it keeps until fill_finish).
static cspec::FillJob fill_job(uintptr_t method, int32_t type_index, const py::array& matchers, const py::array& rows,
                               uintptr_t bitmask, int64_t num_rows, int64_t width, uintptr_t accept_method,
                               const std::optional<py::array>& tokens, const std::optional<py::array>& accepted) {
  auto exact = [](const py::array& a, const py::dtype& dtype, const char* what) {
    if (!a.dtype().is(dtype) || !(a.flags() & py::array::c_style) || a.ndim() != 1)
      throw py::value_error(std::string(what));
  };
  exact(matchers, py::dtype::of<int64_t>(), "matchers must be a contiguous 1-d int64 array");
  exact(rows, py::dtype::of<int64_t>(), "rows must be a contiguous 1-d int64 array");
  const int64_t n = matchers.size();
  if (rows.size() != n) throw py::value_error("matchers and rows differ in length");
  if (!bitmask) throw py::value_error("bitmask is a null pointer");
  cspec::FillJob job;
  if (accept_method) {
    if (!tokens || !accepted) throw py::value_error("an accepting fill needs tokens and accepted");
    exact(*tokens, py::dtype::of<int32_t>(), "tokens must be a contiguous 1-d int32 array");
    exact(*accepted, py::dtype::of<int8_t>(), "accepted must be a contiguous 1-d int8 array");
    if (tokens->size() != n || accepted->size() != n) throw py::value_error("tokens and accepted differ in length from matchers");
    if (!accepted->writeable()) throw py::value_error("accepted must be writeable");
    job.accept_method = reinterpret_cast<void*>(accept_method);
    job.tokens = static_cast<const int32_t*>(tokens->data());
    job.accepted = static_cast<int8_t*>(const_cast<void*>(accepted->data()));
  }
  const auto* r = static_cast<const int64_t*>(rows.data());
  const int64_t lowest = accept_method ? -1 : 0;
  for (int64_t i = 0; i < n; ++i)
    if (r[i] < lowest || r[i] >= num_rows) throw py::index_error("bitmask row out of range");
  job.fill_method = reinterpret_cast<void*>(method);
  job.matcher_type_index = type_index;
  job.matchers = static_cast<const uintptr_t*>(matchers.data());
  job.n = n;
  job.rows = r;
  job.bitmask = reinterpret_cast<int32_t*>(bitmask);
  job.num_rows = num_rows;
  job.width = width;
  return job;
}

template <typename T>
static T* pointer(uintptr_t address, const char* name) {
  if (!address) throw py::value_error(std::string(name) + " is a null pointer");
  return reinterpret_cast<T*>(address);
}

static int sum_lanes(int lanes) {
  if (lanes != 4 && lanes != 8 && lanes != 16) throw py::value_error("sum_lanes must be 4, 8 or 16");
  return lanes;
}

static void bind_cpu_kernels(py::module_& parent) {
  auto m = parent.def_submodule("cpu_kernels", "Fused bfloat16 CPU kernels (native/cpu_kernels.h): tensors as "
                                               "data_ptr() integers, bfloat16 as uint16 bits; no checks of "
                                               "shapes or strides here");
  m.def(
      "rms_norm_bf16",
      [](uintptr_t x, uintptr_t weight, uintptr_t out, int64_t rows, int64_t width, double eps, int lanes) {
        lanes = sum_lanes(lanes);
        auto* xp = pointer<const uint16_t>(x, "x");
        auto* wp = pointer<const uint16_t>(weight, "weight");
        auto* op = pointer<uint16_t>(out, "out");
        py::gil_scoped_release nogil;
        cspec::rms_norm_bf16(xp, wp, op, rows, width, static_cast<float>(eps), lanes);
      },
      py::arg("x"), py::arg("weight"), py::arg("out"), py::arg("rows"), py::arg("width"), py::arg("eps"),
      py::arg("sum_lanes"), "out = rms_norm(x) * weight over rows of `width`.");
  m.def(
      "add_rms_norm_bf16",
      [](uintptr_t x, uintptr_t residual, uintptr_t weight, int64_t rows, int64_t width, double eps, int lanes) {
        lanes = sum_lanes(lanes);
        auto* xp = pointer<uint16_t>(x, "x");
        auto* rp = pointer<uint16_t>(residual, "residual");
        auto* wp = pointer<const uint16_t>(weight, "weight");
        py::gil_scoped_release nogil;
        cspec::add_rms_norm_bf16(xp, rp, wp, rows, width, static_cast<float>(eps), lanes);
      },
      py::arg("x"), py::arg("residual"), py::arg("weight"), py::arg("rows"), py::arg("width"), py::arg("eps"),
      py::arg("sum_lanes"),
      "In place: residual += x, then x = rms_norm(residual) * weight.");
  m.def(
      "rope_bf16",
      [](int64_t tokens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, uintptr_t q, int64_t q_row_stride,
         uintptr_t k, int64_t k_row_stride, uintptr_t v, int64_t v_row_stride, uintptr_t positions,
         uintptr_t cos_sin_cache, int64_t max_position, uintptr_t k_cache, uintptr_t v_cache, uintptr_t slots,
         int64_t num_slots) {
        cspec::RopeArgs a;
        a.tokens = tokens;
        a.num_heads = num_heads;
        a.num_kv_heads = num_kv_heads;
        a.head_dim = head_dim;
        a.q = pointer<uint16_t>(q, "q");
        a.q_row_stride = q_row_stride;
        a.k = pointer<uint16_t>(k, "k");
        a.k_row_stride = k_row_stride;
        a.positions = pointer<const int64_t>(positions, "positions");
        a.cos_sin_cache = pointer<const float>(cos_sin_cache, "cos_sin_cache");
        a.max_position = max_position;
        if (k_cache) {
          a.v = pointer<const uint16_t>(v, "v");
          a.v_row_stride = v_row_stride;
          a.k_cache = pointer<uint16_t>(k_cache, "k_cache");
          a.v_cache = pointer<uint16_t>(v_cache, "v_cache");
          a.slots = pointer<const int64_t>(slots, "slots");
          a.num_slots = num_slots;
        }
        py::gil_scoped_release nogil;
        cspec::rope_bf16(a);
      },
      py::arg("tokens"), py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("q"),
      py::arg("q_row_stride"), py::arg("k"), py::arg("k_row_stride"), py::arg("v") = 0, py::arg("v_row_stride") = 0,
      py::arg("positions") = 0, py::arg("cos_sin_cache") = 0, py::arg("max_position") = 0, py::arg("k_cache") = 0,
      py::arg("v_cache") = 0, py::arg("slots") = 0, py::arg("num_slots") = 0,
      "RoPE on q in place; with k_cache, rotated k and v stored at rows `slots` of the caches, else k "
      "rotated in place. Raises IndexError for a position or slot out of range, before writing.");
  m.def(
      "decode_attention_bf16",
      [](int64_t batch, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, uintptr_t q, int64_t q_row_stride,
         uintptr_t k_cache, uintptr_t v_cache, int64_t num_slots, uintptr_t slot_table, int64_t table_width,
         int64_t table_row_stride, uintptr_t kv_lens, double scale, uintptr_t out) {
        cspec::DecodeAttentionArgs a;
        a.batch = batch;
        a.num_heads = num_heads;
        a.num_kv_heads = num_kv_heads;
        a.head_dim = head_dim;
        a.q = pointer<const uint16_t>(q, "q");
        a.q_row_stride = q_row_stride;
        a.k_cache = pointer<const uint16_t>(k_cache, "k_cache");
        a.v_cache = pointer<const uint16_t>(v_cache, "v_cache");
        a.num_slots = num_slots;
        a.slot_table = pointer<const int64_t>(slot_table, "slot_table");
        a.table_width = table_width;
        a.table_row_stride = table_row_stride;
        a.kv_lens = pointer<const int32_t>(kv_lens, "kv_lens");
        a.scale = static_cast<float>(scale);
        a.out = pointer<uint16_t>(out, "out");
        py::gil_scoped_release nogil;
        cspec::decode_attention_bf16(a);
      },
      py::arg("batch"), py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("q"),
      py::arg("q_row_stride"), py::arg("k_cache"), py::arg("v_cache"), py::arg("num_slots"), py::arg("slot_table"),
      py::arg("table_width"), py::arg("table_row_stride"), py::arg("kv_lens"), py::arg("scale"), py::arg("out"),
      "Attention of one query token per sequence over its slots in the KV cache (native/cpu_kernels.h). "
      "Raises IndexError for a length or slot out of range, before writing.");
  m.def(
      "tree_attention_bf16",
      [](int64_t batch, int64_t tokens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, uintptr_t q,
         int64_t q_row_stride, uintptr_t k_cache, uintptr_t v_cache, int64_t num_slots, uintptr_t slot_table,
         int64_t table_width, int64_t table_row_stride, uintptr_t q_starts, uintptr_t q_lens, uintptr_t kv_lens,
         uintptr_t tree_mask, int64_t mask_width, double scale, uintptr_t out) {
        cspec::TreeAttentionArgs a;
        a.batch = batch, a.tokens = tokens, a.num_heads = num_heads, a.num_kv_heads = num_kv_heads;
        a.head_dim = head_dim, a.q = pointer<const uint16_t>(q, "q"), a.q_row_stride = q_row_stride;
        a.k_cache = pointer<const uint16_t>(k_cache, "k_cache");
        a.v_cache = pointer<const uint16_t>(v_cache, "v_cache");
        a.num_slots = num_slots, a.slot_table = pointer<const int64_t>(slot_table, "slot_table");
        a.table_width = table_width, a.table_row_stride = table_row_stride;
        a.q_starts = pointer<const int32_t>(q_starts, "q_starts");
        a.q_lens = pointer<const int32_t>(q_lens, "q_lens");
        a.kv_lens = pointer<const int32_t>(kv_lens, "kv_lens");
        a.tree_mask = reinterpret_cast<const uint8_t*>(tree_mask);  // 0: causal
        a.mask_width = mask_width, a.scale = static_cast<float>(scale), a.out = pointer<uint16_t>(out, "out");
        py::gil_scoped_release nogil;
        cspec::tree_attention_bf16(a);
      },
      "Attention of several new tokens per sequence (a draft tree, or causal) over the KV cache "
      "(native/cpu_kernels.h). Raises IndexError for a length or slot out of range, before writing.");
  m.def(
      "silu_and_mul_bf16",
      [](uintptr_t gate_up, uintptr_t out, int64_t rows, int64_t inter) {
        auto* gp = pointer<const uint16_t>(gate_up, "gate_up");
        auto* op = pointer<uint16_t>(out, "out");
        py::gil_scoped_release nogil;
        cspec::silu_and_mul_bf16(gp, op, rows, inter);
      },
      py::arg("gate_up"), py::arg("out"), py::arg("rows"), py::arg("inter"), "out[r] = silu(gate_up[r, :inter]) * gate_up[r, inter:].");
  m.def(
      "forward_step_bf16",
      [](py::dict model, py::dict batch, py::dict buffers) {
        auto addr = [](py::dict d, const char* key) { return d[key].cast<uintptr_t>(); };
        auto i64 = [](py::dict d, const char* key) { return d[key].cast<int64_t>(); };
        cspec::ForwardModel m;
        m.layers = i64(model, "layers"), m.hidden = i64(model, "hidden"), m.heads = i64(model, "heads");
        m.kv_heads = i64(model, "kv_heads"), m.head_dim = i64(model, "head_dim");
        m.intermediate = i64(model, "intermediate");
        m.eps = model["eps"].cast<float>(), m.sum_lanes = sum_lanes(model["sum_lanes"].cast<int>());
        m.layer_table = pointer<const int64_t>(addr(model, "layer_table"), "layer_table");
        m.final_norm = pointer<const uint16_t>(addr(model, "final_norm"), "final_norm");
        m.cos_sin_cache = pointer<const float>(addr(model, "cos_sin_cache"), "cos_sin_cache");
        m.max_position = i64(model, "max_position");
        cspec::ForwardBatch b;
        b.batch = i64(batch, "batch"), b.tokens = i64(batch, "tokens");
        b.positions = pointer<const int64_t>(addr(batch, "positions"), "positions");
        b.out_slots = pointer<const int64_t>(addr(batch, "out_slots"), "out_slots");
        b.slot_table = pointer<const int64_t>(addr(batch, "slot_table"), "slot_table");
        b.table_width = i64(batch, "table_width"), b.table_row_stride = i64(batch, "table_row_stride");
        b.kv_lens = pointer<const int32_t>(addr(batch, "kv_lens"), "kv_lens");
        b.k_cache = pointer<uint16_t>(addr(batch, "k_cache"), "k_cache");
        b.v_cache = pointer<uint16_t>(addr(batch, "v_cache"), "v_cache");
        b.num_slots = i64(batch, "num_slots"), b.scale = batch["scale"].cast<float>();
        if (batch.contains("q_lens")) {  // several tokens per sequence
          b.q_starts = pointer<const int32_t>(addr(batch, "q_starts"), "q_starts");
          b.q_lens = pointer<const int32_t>(addr(batch, "q_lens"), "q_lens");
          b.tree_mask = reinterpret_cast<const uint8_t*>(addr(batch, "tree_mask"));  // 0: causal
          b.mask_width = i64(batch, "mask_width");
        }
        cspec::ForwardBuffers buf;
        buf.x = pointer<uint16_t>(addr(buffers, "x"), "x");
        buf.residual = pointer<uint16_t>(addr(buffers, "residual"), "residual");
        buf.qkv = pointer<uint16_t>(addr(buffers, "qkv"), "qkv");
        buf.attn = pointer<uint16_t>(addr(buffers, "attn"), "attn");
        buf.gate_up = pointer<uint16_t>(addr(buffers, "gate_up"), "gate_up");
        buf.act = pointer<uint16_t>(addr(buffers, "act"), "act");
        py::gil_scoped_release nogil;
        cspec::forward_step_bf16(m, b, buf);
      },
      py::arg("model"), py::arg("batch"), py::arg("buffers"),
      "All layers of a bfloat16 decode step (native/forward_step.h); dicts of sizes and data_ptr() addresses. "
      "Raises IndexError for a slot or position out of range.");
  m.def("amx_linear_supported", &cspec::amx_linear_supported,
        "True where the CPU and OS run AMX-BF16, the instructions of amx_linear_bf16 (native/amx_linear.h).");
  m.def("amx_packed_size", &cspec::amx_packed_size, py::arg("n"), py::arg("k"),
        "uint16 elements of amx_pack_weight_bf16's output for an [n, k] weight.");
  m.def(
      "amx_pack_weight_bf16",
      [](uintptr_t weight, int64_t n, int64_t k, uintptr_t packed) {
        auto* wp = pointer<const uint16_t>(weight, "weight");
        auto* pp = pointer<uint16_t>(packed, "packed");
        py::gil_scoped_release nogil;
        cspec::amx_pack_weight_bf16(wp, n, k, pp);
      },
      py::arg("weight"), py::arg("n"), py::arg("k"), py::arg("packed"),
      "Packs a row-major [n, k] bfloat16 weight for amx_linear_bf16 (amx_packed_size elements).");
  m.def(
      "amx_linear_bf16",
      [](uintptr_t x, int64_t rows, int64_t k, int64_t x_stride, uintptr_t packed, int64_t n, uintptr_t bias,
         uintptr_t out, int64_t out_stride, bool out_float32) {
        auto* xp = pointer<const uint16_t>(x, "x");
        auto* pp = pointer<const uint16_t>(packed, "packed");
        auto* op = pointer<void>(out, "out");
        const auto* bp = reinterpret_cast<const uint16_t*>(bias);  // 0: no bias
        py::gil_scoped_release nogil;
        cspec::amx_linear_bf16(xp, rows, k, x_stride, pp, n, bp, op, out_stride, out_float32);
      },
      "out[m, :n] = x[m, :k] @ weight.T + bias for m < rows (native/amx_linear.h); bias 0 for none; "
      "out bfloat16, or float32 with out_float32.");
}

PYBIND11_MODULE(_native, m) {
  m.doc() = "constrained-spec native parts: the n-gram lookahead trie (native/ngram_trie.h), the "
            "grammar mask fill pool (native/mask_fill_pool.h) and fused bfloat16 CPU kernels "
            "(native/cpu_kernels.h)";
  bind_cpu_kernels(m);

  py::class_<MaskFillPool>(m, "MaskFillPool", R"doc(
Persistent threads that fill grammar bitmask rows through xgrammar's FFI method (no GIL).

MaskFillPool(workers, function_call, error_move_from_raised, object_dec_ref)
  The last three: addresses of TVMFFIFunctionCall, TVMFFIErrorMoveFromRaised and
  TVMFFIObjectDecRef in the loaded libtvm_ffi (constrained_spec/grammar/native_fill.py finds them).
)doc")
      .def(py::init([](int workers, uintptr_t call, uintptr_t error_move, uintptr_t dec_ref) {
             if (workers < 0) throw py::value_error("workers must be >= 0");
             if (!call || !error_move || !dec_ref) throw py::value_error("null TVM FFI entry point");
             cspec::FfiApi api;
             api.function_call = reinterpret_cast<decltype(api.function_call)>(call);
             api.error_move_from_raised = reinterpret_cast<decltype(api.error_move_from_raised)>(error_move);
             api.object_dec_ref = reinterpret_cast<decltype(api.object_dec_ref)>(dec_ref);
             return new MaskFillPool(workers, api);
           }),
           py::arg("workers"), py::arg("function_call"), py::arg("error_move_from_raised"),
           py::arg("object_dec_ref"))
      .def_property_readonly("workers", &MaskFillPool::workers)
      .def(
          "fill_start",
          [](MaskFillPool& pool, uintptr_t method, int32_t type_index, py::array matchers, py::array rows,
             uintptr_t bitmask, int64_t num_rows, int64_t width, int helpers, uintptr_t accept_method,
             std::optional<py::array> tokens, std::optional<py::array> accepted) {
            if (pool.pending()) throw std::runtime_error("fill_start before the last fill_finish");
            pool.Start(fill_job(method, type_index, matchers, rows, bitmask, num_rows, width, accept_method, tokens,
                                accepted),
                       helpers);
          },
          py::arg("method"), py::arg("type_index"), py::arg("matchers"), py::arg("rows"), py::arg("bitmask"),
          py::arg("num_rows"), py::arg("width"), py::arg("helpers"), py::arg("accept_method") = 0,
          py::arg("tokens") = py::none(), py::arg("accepted") = py::none(),
          "Starts filling bitmask[rows[i]] from matchers[i] (FFI object handles): wakes up to `helpers` pool "
          "threads on the rows and returns at once; the arrays must stay alive until fill_finish. With "
          "accept_method (the overlapped decode step), matchers[i] first accepts tokens[i] (int32; none where -1; "
          "accepted[i], int8: 1, or 0 where refused), and rows[i] may be -1 (no row).")
      .def("fill_finish", &MaskFillPool::Finish, py::call_guard<py::gil_scoped_release>(),
           "Fills the rows no pool thread has taken and waits for the threads; returns -1, or the position of a "
           "row whose fill failed.")
      .def(
          "set_staging",
          [](MaskFillPool& pool, uintptr_t fill_method, int32_t type_index, uintptr_t bitmask, int64_t num_rows,
             int64_t width, py::array_t<int8_t, py::array::c_style> done,
             py::array_t<double, py::array::c_style> seconds) {
            if (!fill_method || !bitmask) throw py::value_error("null fill method or bitmask");
            if (done.size() != num_rows || seconds.size() != num_rows)
              throw py::value_error("done and seconds need one entry per staging row");
            if (!done.writeable() || !seconds.writeable()) throw py::value_error("done and seconds must be writeable");
            pool.SetStaging(reinterpret_cast<void*>(fill_method), type_index, reinterpret_cast<int32_t*>(bitmask),
                            num_rows, width, done.mutable_data(), seconds.mutable_data());
          },
          py::arg("fill_method"), py::arg("type_index"), py::arg("bitmask"), py::arg("num_rows"), py::arg("width"),
          py::arg("done"), py::arg("seconds"),
          "The staging bitmask of queued rows, and its done flags and fill times (one per row); the caller keeps "
          "all three alive as long as the pool.")
      .def(
          "submit",
          [](MaskFillPool& pool, I64Arr matchers, I64Arr rows, int64_t num_rows) {
            const int64_t n = matchers.size();
            if (rows.size() != n) throw py::value_error("matchers and rows differ in length");
            const int64_t* r = rows.data();
            for (int64_t i = 0; i < n; ++i)
              if (r[i] < 0 || r[i] >= num_rows) throw py::index_error("staging row out of range");
            pool.Submit(reinterpret_cast<const uintptr_t*>(matchers.data()), r, n);
          },
          py::arg("matchers"), py::arg("rows"), py::arg("num_rows"),
          "Queues the fill of staging row rows[i] from matchers[i] (FFI object handles), in this order; the caller "
          "clears done[rows[i]] first and keeps the matchers alive until it is set.")
      .def(
          "wait_rows",
          [](MaskFillPool& pool, I64Arr rows, double timeout_s) {
            py::gil_scoped_release nogil;
            return pool.WaitRows(rows.data(), rows.size(), timeout_s);
          },
          py::arg("rows"), py::arg("timeout_s"),
          "Waits (without the GIL) until every staging row in `rows` is done, or timeout_s has passed (< 0: no "
          "limit); returns whether all are done.")
      .def(
          "accept",
          [](MaskFillPool& pool, uintptr_t method, int32_t type_index, I64Arr matchers, IntArr tokens,
             py::array_t<int8_t, py::array::c_style> accepted, int helpers) {
            const int64_t n = matchers.size();
            if (tokens.size() != n || accepted.size() != n)
              throw py::value_error("matchers, tokens and accepted differ in length");
            if (!accepted.writeable()) throw py::value_error("accepted must be writeable");
            if (pool.pending()) throw std::runtime_error("accept while a started fill is pending");
            cspec::FillJob job;
            job.accept_method = reinterpret_cast<void*>(method);
            job.matcher_type_index = type_index;
            job.matchers = reinterpret_cast<const uintptr_t*>(matchers.data());
            job.n = n;
            job.tokens = tokens.data();
            job.accepted = accepted.mutable_data();
            py::gil_scoped_release nogil;
            pool.Run(job, helpers);
          },
          py::arg("method"), py::arg("type_index"), py::arg("matchers"), py::arg("tokens"), py::arg("accepted"),
          py::arg("helpers"),
          "matchers[i] accepts tokens[i], with up to `helpers` pool threads beside the caller; accepted[i] "
          "(int8): 1, or 0 where the grammar refused it (that matcher is unchanged).")
      .def(
          "walk",
          [](MaskFillPool& pool, uintptr_t fill_method, uintptr_t accept_method, uintptr_t rollback_method,
             int32_t type_index, I64Arr matchers, I64Arr offsets, IntArr back, IntArr tokens, I64Arr rows,
             uintptr_t bitmask, int64_t num_rows, int64_t width, py::array_t<int8_t, py::array::c_style> ok,
             int helpers) {
            const int64_t n = matchers.size(), steps = tokens.size();
            if (offsets.size() != n + 1 || ok.size() != n || back.size() != steps || rows.size() != steps)
              throw py::value_error("walk arrays differ in length");
            if (!ok.writeable()) throw py::value_error("ok must be writeable");
            const int64_t* off = offsets.data();
            const int32_t* bk = back.data();
            const int32_t* tk = tokens.data();
            const int64_t* r = rows.data();
            if (n > 0 && (off[0] != 0 || off[n] != steps)) throw py::value_error("bad walk offsets");
            for (int64_t i = 0; i < n; ++i) {
              if (off[i + 1] < off[i]) throw py::value_error("bad walk offsets");
              int64_t depth = 0;  // a walk never rolls back more than its path holds
              for (int64_t k = off[i]; k < off[i + 1]; ++k) {
                depth -= bk[k];
                if (bk[k] < 0 || depth < 0) throw py::value_error("a walk step rolls back past its start");
                depth += tk[k] != -1;
                if (r[k] >= num_rows) throw py::index_error("bitmask row out of range");
              }
            }
            if (pool.pending()) throw std::runtime_error("walk while a started fill is pending");
            cspec::FillJob job;
            job.fill_method = reinterpret_cast<void*>(fill_method);
            job.accept_method = reinterpret_cast<void*>(accept_method);
            job.rollback_method = reinterpret_cast<void*>(rollback_method);
            job.matcher_type_index = type_index;
            job.matchers = reinterpret_cast<const uintptr_t*>(matchers.data());
            job.n = n;
            job.walk_offsets = off;
            job.walk_back = bk;
            job.walk_tokens = tk;
            job.walk_rows = r;
            job.accepted = ok.mutable_data();
            job.bitmask = reinterpret_cast<int32_t*>(bitmask);
            job.num_rows = num_rows;
            job.width = width;
            py::gil_scoped_release nogil;
            return pool.Run(job, helpers);
          },
          py::arg("fill_method"), py::arg("accept_method"), py::arg("rollback_method"), py::arg("type_index"),
          py::arg("matchers"), py::arg("offsets"), py::arg("back"), py::arg("tokens"), py::arg("rows"),
          py::arg("bitmask"), py::arg("num_rows"), py::arg("width"), py::arg("ok"), py::arg("helpers"),
          "Walks through token trees (native/mask_fill_pool.h, FillJob): walk i is steps offsets[i] .. "
          "offsets[i+1] of (back, tokens, rows); ok[i] = 0 where a token was refused. Returns -1, or a "
          "walk whose fill failed.");

  py::class_<NgramTrie>(m, "NgramTrie", R"doc(
Shared n-gram trie with per-request tries; drafts trees in xgrammar's layout.

NgramTrie(max_ngram=8, min_ngram=1, num_draft_tokens=8, branches=1, capacity=2**19,
          request_capacity=2**16, window=0)
  num_draft_tokens counts the root (node 0 = the last context token); window=0 means
  max_ngram + num_draft_tokens - 1 tokens are stored per position. Eviction: LRU leaves.
)doc")
      .def(py::init([](int max_ngram, int min_ngram, int num_draft_tokens, int branches,
                       int64_t capacity, int64_t request_capacity, int window) {
             NgramConfig c;
             c.max_ngram = max_ngram;
             c.min_ngram = min_ngram;
             c.num_draft_tokens = num_draft_tokens;
             c.branches = branches;
             c.capacity = capacity;
             c.request_capacity = request_capacity;
             c.window = window;
             return new NgramTrie(c);  // validates (raises ValueError)
           }),
           py::arg("max_ngram") = 8, py::arg("min_ngram") = 1, py::arg("num_draft_tokens") = 8,
           py::arg("branches") = 1, py::arg("capacity") = int64_t(1) << 19,
           py::arg("request_capacity") = int64_t(1) << 16, py::arg("window") = 0)
      .def_property_readonly("config", [](const NgramTrie& t) { return config_dict(t.config()); })
      .def(
          "insert",
          [](NgramTrie& t, int64_t request_id, IntArr tokens) {
            const int32_t* p = tokens.data();
            const int64_t n = tokens.size();
            py::gil_scoped_release nogil;
            t.insert(request_id, p, n);
          },
          py::arg("request_id"), py::arg("tokens"),
          "Append tokens to the request's stream (request_id < 0: standalone corpus, shared only).")
      .def(
          "insert_batch",
          [](NgramTrie& t, I64Arr request_ids, std::vector<IntArr> token_lists) {
            if ((size_t)request_ids.size() != token_lists.size())
              throw py::value_error("insert_batch: request_ids and token_lists differ in length");
            const int64_t* ids = request_ids.data();
            py::gil_scoped_release nogil;
            for (size_t b = 0; b < token_lists.size(); ++b)
              t.insert(ids[b], token_lists[b].data(), token_lists[b].size());
          },
          py::arg("request_ids"), py::arg("token_lists"))
      .def(
          "propose",
          [](NgramTrie& t, int64_t request_id, std::optional<IntArr> context, int num_draft_tokens,
             int branches, int max_ngram, int min_ngram) {
            const int n = num_draft_tokens > 0 ? num_draft_tokens : t.config().num_draft_tokens;
            std::vector<int32_t> tok(n), nxt(n), sib(n);
            const int32_t* ctx = context ? context->data() : nullptr;
            const int64_t len = context ? context->size() : 0;
            int count;
            {
              py::gil_scoped_release nogil;
              count = t.propose(request_id, ctx, len, tok.data(), nxt.data(), sib.data(), n,
                                branches, max_ngram, min_ngram);
            }
            auto mk = [count](const std::vector<int32_t>& v) {
              IntArr a(count);
              std::copy(v.begin(), v.begin() + count, a.mutable_data());
              return a;
            };
            return py::make_tuple(mk(tok), mk(nxt), mk(sib));
          },
          py::arg("request_id"), py::arg("context") = py::none(), py::arg("num_draft_tokens") = 0,
          py::arg("branches") = 0, py::arg("max_ngram") = 0, py::arg("min_ngram") = 0,
          R"doc(Draft tree for one request -> (draft_tokens, retrieve_next_token,
retrieve_next_sibling), int32 arrays of the tree's node count (0 if the context is empty).
context=None uses the request's stored stream; overrides <= 0 use the config.)doc")
      .def(
          "next_tokens",
          [](NgramTrie& t, int64_t request_id, const std::vector<int32_t>& context, int k) {
            // a tree of k + 1 nodes with k branches holds the root's k best children
            std::vector<int32_t> tok(k + 1), nxt(k + 1), sib(k + 1);
            std::vector<int32_t> out;
            if (k <= 0 || context.empty()) return out;
            t.propose(request_id, context.data(), context.size(), tok.data(), nxt.data(), sib.data(), k + 1, k, 0, 0);
            for (int32_t c = nxt[0]; c >= 0; c = sib[c]) out.push_back(tok[c]);
            return out;
          },
          py::arg("request_id"), py::arg("context"), py::arg("k"),
          R"doc(The k best next tokens after `context` (a list whose last token is the draft root),
best first, as ranked for draft trees: the request's own continuations, then the shared trie's.)doc")
      .def(
          "propose_batch",
          [](NgramTrie& t, I64Arr request_ids, std::optional<std::vector<std::optional<IntArr>>> contexts,
             int num_draft_tokens, int branches, int max_ngram, int min_ngram) {
            const int64_t B = request_ids.size();
            const int n = num_draft_tokens > 0 ? num_draft_tokens : t.config().num_draft_tokens;
            std::vector<const int32_t*> ptrs;
            std::vector<int64_t> lens;
            if (contexts) {
              if ((int64_t)contexts->size() != B)
                throw py::value_error("propose_batch: contexts and request_ids differ in length");
              for (auto& c : *contexts) {
                ptrs.push_back(c ? c->data() : nullptr);
                lens.push_back(c ? c->size() : 0);
              }
            }
            IntArr tok({B, (int64_t)n}), nxt({B, (int64_t)n}), sib({B, (int64_t)n}), counts(B);
            int32_t *pt = tok.mutable_data(), *pn = nxt.mutable_data(), *ps = sib.mutable_data(),
                    *pc = counts.mutable_data();
            const int64_t* ids = request_ids.data();
            {
              py::gil_scoped_release nogil;
              t.propose_batch(ids, B, contexts ? ptrs.data() : nullptr,
                              contexts ? lens.data() : nullptr, pt, pn, ps, pc, n, branches,
                              max_ngram, min_ngram);
            }
            return py::make_tuple(tok, nxt, sib, counts);
          },
          py::arg("request_ids"), py::arg("contexts") = py::none(), py::arg("num_draft_tokens") = 0,
          py::arg("branches") = 0, py::arg("max_ngram") = 0, py::arg("min_ngram") = 0,
          R"doc(Draft trees for a batch -> (draft_tokens [B, N], retrieve_next_token [B, N],
retrieve_next_sibling [B, N], counts [B]), int32; N = num_draft_tokens; padding: token 0, links -1.
contexts: None (stored streams) or a list whose items are token lists/arrays or None.)doc")
      .def("remove_request", &NgramTrie::remove_request, py::arg("request_id"),
           py::call_guard<py::gil_scoped_release>())
      .def("has_request", &NgramTrie::has_request, py::arg("request_id"))
      .def("num_nodes", &NgramTrie::num_nodes, "Nodes in the shared trie (root excluded).")
      .def("request_num_nodes", &NgramTrie::request_num_nodes, py::arg("request_id"),
           "Nodes in the request's own trie, -1 if the request is unknown.")
      .def("num_requests", &NgramTrie::num_requests)
      .def(
          "frequency",
          [](const NgramTrie& t, IntArr ngram, int64_t request_id) {
            return t.frequency(request_id, ngram.data(), (int)ngram.size());
          },
          py::arg("ngram"), py::arg("request_id") = -1,
          "Occurrences of an n-gram in the shared trie (request_id < 0) or the request's own trie.")
      .def(
          "request_history",
          [](const NgramTrie& t, int64_t request_id) {
            auto h = t.request_history(request_id);
            IntArr a((int64_t)h.size());
            std::copy(h.begin(), h.end(), a.mutable_data());
            return a;
          },
          py::arg("request_id"), "The stored tail of the request's token stream.")
      .def("clear", &NgramTrie::clear, py::call_guard<py::gil_scoped_release>());
}
