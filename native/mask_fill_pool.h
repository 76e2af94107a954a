// Grammar bitmask rows filled on persistent threads: the one parallel fill of the engine.
//
// Two kinds of work share the threads:
// * jobs (Run, or Start ... Finish): a step's accepts, bitmask rows or draft chains; the caller
//   wakes the helpers it wants, works beside them, and returns once every row is written;
// * queued rows (Submit, WaitRows): the budgeted fill's rows, each written to its own row of a
//   staging bitmask and flagged done there. Idle threads take them one at a time, so a slow row
//   holds one thread and no one waits for it unless they choose to.
// Threads persist because xgrammar's BatchGrammarMatcher starts and joins its threads inside every
// call (40-75 us each on the H100 host), which made the decode step's mask fill the last thing to
// end on the host from batch 32 up.
//
// The rows are filled by xgrammar itself: its GrammarMatcher.fill_next_token_bitmask method,
// called through the TVM FFI C ABI (stable, plain C, no GIL). The caller hands over the method's
// function handle and the ABI's entry points (resolved from the loaded libtvm_ffi), so this file
// needs no xgrammar or tvm-ffi headers at build time.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

namespace cspec {

// The few pieces of the TVM FFI C ABI (tvm/ffi/c_api.h, 0.1.x) a method call needs.
struct FfiAny {
  int32_t type_index;
  uint32_t zero_padding;
  union {
    int64_t v_int64;
    void* v_ptr;
  };
};
static_assert(sizeof(FfiAny) == 16, "TVMFFIAny is 16 bytes");

enum : int32_t { kFfiNone = 0, kFfiInt = 1, kFfiBool = 2, kFfiDLTensorPtr = 7, kFfiStaticObjectBegin = 64 };

struct FfiApi {
  int (*function_call)(void* func, FfiAny* args, int32_t num_args, FfiAny* result);
  void (*error_move_from_raised)(void** result);
  int (*object_dec_ref)(void* obj);
};

// One job over n matchers, one of four kinds:
// * accept: matchers[i] accepts tokens[i]; accepted[i] says whether it did (1, or 0 and the matcher
//   is as it was);
// * fill: matchers[i] fills row rows[i] of an int32 bitmask [num_rows, width];
// * accept and fill (the overlapped decode step: the last step's tokens, then the next step's rows):
//   matchers[i] accepts tokens[i] unless it is -1, then fills row rows[i] unless it is -1 (a matcher
//   that refused its token fills from where it was);
// * walks (a speculative step's draft trees and chains, an EAGLE frontier): matchers[i] walks the
//   steps walk_offsets[i] .. walk_offsets[i + 1] of a depth-first path through a token tree; a step
//   rolls back walk_back tokens of the path, accepts walk_tokens (none where -1; below -1, a token
//   refused without asking the grammar) and fills row
//   walk_rows (none where -1) for the path so far. A refused token and every step below it (until a
//   step rolls back above it) fill nothing: their rows are zeroed (no token follows an illegal
//   path), and accepted[i] = 0. The matcher ends where it started.
struct FillJob {
  void* accept_method = nullptr;    // GrammarMatcher.accept_token (an FFI function), or none
  void* fill_method = nullptr;      // GrammarMatcher.fill_next_token_bitmask (an FFI function), or none
  void* rollback_method = nullptr;  // GrammarMatcher.rollback (an FFI function): walks
  const int64_t* walk_offsets = nullptr;  // [n + 1]: walks
  const int32_t* walk_back = nullptr;     // walks: tokens rolled back before the step
  const int32_t* walk_tokens = nullptr;   // walks: the token accepted, -1 (none) or -2 (refused)
  const int64_t* walk_rows = nullptr;     // walks: the row filled after it, or -1
  int32_t matcher_type_index = 0;   // the FFI type index of the matchers
  const uintptr_t* matchers = nullptr;
  int64_t n = 0;
  const int32_t* tokens = nullptr;  // with accept_method
  int8_t* accepted = nullptr;       // with accept_method
  const int64_t* rows = nullptr;    // with fill_method
  int32_t* bitmask = nullptr;
  int64_t num_rows = 0;
  int64_t width = 0;
};

class MaskFillPool {
 public:
  MaskFillPool(int workers, FfiApi api);
  ~MaskFillPool();
  MaskFillPool(const MaskFillPool&) = delete;
  MaskFillPool& operator=(const MaskFillPool&) = delete;

  int workers() const { return static_cast<int>(threads_.size()); }
  bool pending() const { return pending_; }

  // Runs the job with up to `helpers` pool threads beside the caller. Returns -1, or the position
  // i of a row whose fill failed (its error is dropped; the caller may redo that row through
  // xgrammar's Python API to raise it). A failed accept reads as refused. Not reentrant: one call
  // at a time.
  int64_t Run(const FillJob& job, int helpers);

  // The staging bitmask of queued rows: row r is written by the fill of a row queued for r, which
  // then stores its time in seconds[r] and 1 in done[r] (release order: the row is whole by then).
  // done[r] = 0 is the caller's to set before it queues r. Set once, before the first Submit.
  void SetStaging(void* fill_method, int32_t matcher_type_index, int32_t* bitmask, int64_t num_rows,
                  int64_t width, int8_t* done, double* seconds);
  // Queues fills: matchers[i] fills staging row rows[i], in this order. Copies the arguments.
  void Submit(const uintptr_t* matchers, const int64_t* rows, int64_t n);
  // Waits until done[rows[i]] is set for every i, or `timeout_s` has passed (forever if < 0).
  // Returns whether all are done.
  bool WaitRows(const int64_t* rows, int64_t n, double timeout_s);

  // Run in two halves, for a caller with other work meanwhile: Start wakes up to `helpers` pool
  // threads on the job and returns; Finish fills the rows none of them has taken yet, waits for
  // them and returns what Run would. The job's arrays must live until Finish; one job at a time.
  void Start(const FillJob& job, int helpers);
  int64_t Finish();

 private:
  void WorkerLoop(int id);
  void Work();
  bool Call(void* method, FfiAny* args, int32_t num_args, FfiAny* result);
  bool AcceptToken(int64_t i, int32_t token);
  bool FillRow(void* method, int32_t type_index, uintptr_t matcher, int32_t* bitmask, int64_t* shape,
               int64_t row);
  bool Rollback(int64_t i, int64_t num_tokens);
  bool Walk(int64_t i);
  void ZeroRow(int64_t row);
  void FillQueued(uintptr_t matcher, int64_t row);  // mu_ not held

  FfiApi api_;
  std::vector<std::thread> threads_;
  std::mutex mu_;
  std::condition_variable wake_;   // workers wait for a new job
  std::condition_variable idle_;   // the caller waits for the workers inside a job
  std::condition_variable row_done_;  // WaitRows waits for queued rows
  uint64_t generation_ = 0;        // bumped per job (guarded by mu_)
  int helpers_ = 0;                // workers with id < helpers_ join the current job
  bool open_ = false;              // rows may still be claimed (guarded by mu_)
  int inside_ = 0;                 // workers working on the current job (guarded by mu_)
  bool stop_ = false;
  int started_helpers_ = 0;        // helpers woken for the job in flight (the caller's thread only)
  bool pending_ = false;           // Start called, Finish not yet (the caller's thread only)

  std::deque<std::pair<uintptr_t, int64_t>> queued_;  // (matcher, staging row) (guarded by mu_)
  struct Staging {
    void* fill_method = nullptr;
    int32_t type_index = 0;
    int32_t* bitmask = nullptr;
    int64_t shape[2] = {0, 0};
    int8_t* done = nullptr;
    double* seconds = nullptr;
  } staging_;

  FillJob job_;
  int64_t shape_[2] = {0, 0};
  std::atomic<int64_t> next_{0};
  std::atomic<int64_t> failed_{-1};
};

}  // namespace cspec
