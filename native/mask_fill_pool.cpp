#include "mask_fill_pool.h"

#include <chrono>
#include <cstring>

#ifdef __linux__
#include <pthread.h>
#endif

namespace cspec {

namespace {

// dlpack's DLTensor, as xgrammar's FFI method takes the bitmask (a CPU int32 matrix).
struct DLTensorView {
  void* data;
  int32_t device_type;  // kDLCPU = 1
  int32_t device_id;
  int32_t ndim;
  uint8_t dtype_code;   // kDLInt = 0
  uint8_t dtype_bits;
  uint16_t dtype_lanes;
  int64_t* shape;
  int64_t* strides;
  uint64_t byte_offset;
};

}  // namespace

MaskFillPool::MaskFillPool(int workers, FfiApi api) : api_(api) {
  threads_.reserve(workers);
  for (int i = 0; i < workers; ++i) threads_.emplace_back([this, i] { WorkerLoop(i); });
}

MaskFillPool::~MaskFillPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  for (auto& t : threads_) t.join();
}

bool MaskFillPool::Call(void* method, FfiAny* args, int32_t num_args, FfiAny* result) {
  result->type_index = kFfiNone;
  result->zero_padding = 0;
  result->v_int64 = 0;
  if (api_.function_call(method, args, num_args, result) != 0) {
    void* error = nullptr;
    api_.error_move_from_raised(&error);
    if (error != nullptr) api_.object_dec_ref(error);
    return false;
  }
  if (result->type_index >= kFfiStaticObjectBegin && result->v_ptr != nullptr) api_.object_dec_ref(result->v_ptr);
  return true;
}

static void SetArg(FfiAny* arg, int32_t type_index, int64_t value) {
  arg->type_index = type_index;
  arg->zero_padding = 0;
  arg->v_int64 = value;
}

static void SetPtrArg(FfiAny* arg, int32_t type_index, void* value) {
  arg->type_index = type_index;
  arg->zero_padding = 0;
  arg->v_ptr = value;
}

bool MaskFillPool::AcceptToken(int64_t i, int32_t token) {
  FfiAny args[3];
  SetPtrArg(&args[0], job_.matcher_type_index, reinterpret_cast<void*>(job_.matchers[i]));
  SetArg(&args[1], kFfiInt, token);
  SetArg(&args[2], kFfiBool, 0);  // debug_print
  FfiAny result;
  return Call(job_.accept_method, args, 3, &result) && result.type_index == kFfiBool && result.v_int64 != 0;
}

bool MaskFillPool::FillRow(void* method, int32_t type_index, uintptr_t matcher, int32_t* bitmask,
                           int64_t* shape, int64_t row) {
  DLTensorView tensor{bitmask, 1, 0, 2, 0, 32, 1, shape, nullptr, 0};
  FfiAny args[4];
  SetPtrArg(&args[0], type_index, reinterpret_cast<void*>(matcher));
  SetPtrArg(&args[1], kFfiDLTensorPtr, &tensor);
  SetArg(&args[2], kFfiInt, row);
  SetArg(&args[3], kFfiBool, 0);  // debug_print
  FfiAny result;
  return Call(method, args, 4, &result);
}

bool MaskFillPool::Rollback(int64_t i, int64_t num_tokens) {
  if (num_tokens <= 0) return true;
  FfiAny args[2];
  SetPtrArg(&args[0], job_.matcher_type_index, reinterpret_cast<void*>(job_.matchers[i]));
  SetArg(&args[1], kFfiInt, num_tokens);
  FfiAny result;
  return Call(job_.rollback_method, args, 2, &result);
}

void MaskFillPool::ZeroRow(int64_t row) {
  std::memset(job_.bitmask + row * job_.width, 0, sizeof(int32_t) * job_.width);
}

bool MaskFillPool::Walk(int64_t i) {
  // depth: tokens on the walk's path; accepted: of those, in the matcher (all of them, or those
  // before the refused one at depth `dead`, while the walk is below it)
  int64_t depth = 0, accepted = 0, dead = -1;
  bool legal = true, filled = true;
  for (int64_t k = job_.walk_offsets[i]; k < job_.walk_offsets[i + 1] && filled; ++k) {
    depth -= job_.walk_back[k];
    if (dead >= 0 && depth < dead) dead = -1;  // back above the refused token
    const int64_t keep = dead >= 0 ? dead - 1 : depth;
    if (!Rollback(i, accepted - keep)) return false;
    accepted = keep;
    const int32_t token = job_.walk_tokens[k];
    if (token != -1) {  // -1: no token; below -1: one to refuse without asking the grammar
      ++depth;
      if (dead < 0) {
        if (token >= 0 && AcceptToken(i, token)) {
          ++accepted;
        } else {
          dead = depth;
          legal = false;
        }
      }
    }
    const int64_t row = job_.walk_rows[k];
    if (row < 0) continue;
    if (dead >= 0) ZeroRow(row);
    else filled = FillRow(job_.fill_method, job_.matcher_type_index, job_.matchers[i], job_.bitmask, shape_, row);
  }
  const bool rolled_back = Rollback(i, accepted);
  job_.accepted[i] = static_cast<int8_t>(legal);
  return rolled_back && filled;
}

void MaskFillPool::Work() {
  for (int64_t i = next_.fetch_add(1, std::memory_order_relaxed); i < job_.n;
       i = next_.fetch_add(1, std::memory_order_relaxed)) {
    bool ok = true;
    if (job_.walk_offsets != nullptr) {
      ok = Walk(i);
    } else {
      // accept-and-fill jobs mark "no token" and "no row" with -1
      if (job_.accept_method != nullptr)
        job_.accepted[i] = static_cast<int8_t>(job_.tokens[i] < 0 || AcceptToken(i, job_.tokens[i]));
      if (job_.fill_method != nullptr && job_.rows[i] >= 0)
        ok = FillRow(job_.fill_method, job_.matcher_type_index, job_.matchers[i], job_.bitmask, shape_, job_.rows[i]);
    }
    if (!ok) {
      int64_t expected = -1;
      failed_.compare_exchange_strong(expected, i);
    }
  }
}

void MaskFillPool::FillQueued(uintptr_t matcher, int64_t row) {
  const auto t0 = std::chrono::steady_clock::now();
  int32_t* out = staging_.bitmask + row * staging_.shape[1];
  // A row whose fill failed allows every token: the end-of-request check still holds the output to
  // the grammar, and one broken matcher must not stop the threads.
  if (!FillRow(staging_.fill_method, staging_.type_index, matcher, staging_.bitmask, staging_.shape, row))
    std::memset(out, 0xff, sizeof(int32_t) * staging_.shape[1]);
  staging_.seconds[row] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  {
    std::lock_guard<std::mutex> lock(mu_);
    __atomic_store_n(&staging_.done[row], int8_t{1}, __ATOMIC_RELEASE);
  }
  row_done_.notify_all();
}

void MaskFillPool::WorkerLoop(int id) {
#ifdef __linux__
  pthread_setname_np(pthread_self(), "cs-mask");  // told apart from the engine's own threads in top -H
#endif
  uint64_t seen = 0;
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    wake_.wait(lock, [&] { return stop_ || generation_ != seen || !queued_.empty(); });
    if (stop_) return;
    if (generation_ != seen) {
      seen = generation_;
      // A worker that wakes after the caller closed the job (it found no rows left) stays out.
      if (open_ && id < helpers_) {
        ++inside_;
        lock.unlock();
        Work();
        lock.lock();
        if (--inside_ == 0) idle_.notify_one();
        continue;
      }
    }
    if (!queued_.empty()) {
      const auto [matcher, row] = queued_.front();
      queued_.pop_front();
      lock.unlock();
      FillQueued(matcher, row);
      lock.lock();
    }
  }
}

void MaskFillPool::SetStaging(void* fill_method, int32_t matcher_type_index, int32_t* bitmask, int64_t num_rows,
                              int64_t width, int8_t* done, double* seconds) {
  std::lock_guard<std::mutex> lock(mu_);
  staging_.fill_method = fill_method;
  staging_.type_index = matcher_type_index;
  staging_.bitmask = bitmask;
  staging_.shape[0] = num_rows;
  staging_.shape[1] = width;
  staging_.done = done;
  staging_.seconds = seconds;
}

void MaskFillPool::Submit(const uintptr_t* matchers, const int64_t* rows, int64_t n) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (int64_t i = 0; i < n; ++i) queued_.emplace_back(matchers[i], rows[i]);
  }
  if (n == 1) wake_.notify_one();
  else if (n > 1) wake_.notify_all();
}

bool MaskFillPool::WaitRows(const int64_t* rows, int64_t n, double timeout_s) {
  auto all_done = [&] {
    for (int64_t i = 0; i < n; ++i)
      if (!__atomic_load_n(&staging_.done[rows[i]], __ATOMIC_ACQUIRE)) return false;
    return true;
  };
  std::unique_lock<std::mutex> lock(mu_);
  if (timeout_s < 0) {
    row_done_.wait(lock, all_done);
    return true;
  }
  return row_done_.wait_for(lock, std::chrono::duration<double>(timeout_s), all_done);
}

void MaskFillPool::Start(const FillJob& job, int helpers) {
  pending_ = true;
  job_ = job;
  shape_[0] = job.num_rows;
  shape_[1] = job.width;
  next_.store(0, std::memory_order_relaxed);
  failed_.store(-1, std::memory_order_relaxed);
  if (helpers > workers()) helpers = workers();
  if (helpers > job.n) helpers = static_cast<int>(job.n);
  started_helpers_ = helpers > 0 ? helpers : 0;
  if (started_helpers_ > 0) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      helpers_ = started_helpers_;
      open_ = true;
      ++generation_;
    }
    wake_.notify_all();
  }
}

int64_t MaskFillPool::Finish() {
  Work();  // the rows no worker has taken yet
  if (started_helpers_ > 0) {
    std::unique_lock<std::mutex> lock(mu_);
    open_ = false;
    idle_.wait(lock, [&] { return inside_ == 0; });
  }
  started_helpers_ = 0;
  pending_ = false;
  return failed_.load(std::memory_order_relaxed);
}

int64_t MaskFillPool::Run(const FillJob& job, int helpers) {
  if (job.n <= 0) return -1;
  Start(job, helpers < job.n - 1 ? helpers : static_cast<int>(job.n - 1));
  return Finish();
}

}  // namespace cspec
