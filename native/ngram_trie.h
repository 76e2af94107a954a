// N-gram lookahead trie: the drafter store of the n-gram speculative decoder.
//
// What is stored
//   Every token stream (a request's prompt followed by its outputs, or a standalone corpus) is cut
//   into windows: the `window` tokens starting at every position. Each window is inserted as a path
//   from the root, so a node is an n-gram and its `freq` counts how many times that n-gram occurred
//   (every occurrence starts a window that passes through the node). Streams are appended
//   incrementally: a request keeps its open windows (node id + generation) and extends each one by
//   the new token, so appending costs O(window) edge look-ups per token.
//
// Two levels
//   * one SHARED trie over all requests (capacity-bounded, LRU eviction, see below);
//   * one small trie PER REQUEST over that request's own stream (its own capacity, same eviction),
//     dropped by remove_request(). `insert(request_id, tokens)` appends to both.
//   propose() matches the context in both and merges the continuations: children that occur in the
//   request's own trie rank first (by own frequency), then the others (by shared frequency).
//
// Eviction (both levels): least-recently-used leaves. Every operation (an insert call, a propose
//   call) takes a new tick and stamps the nodes it touches. When the node count exceeds the
//   capacity, each node's last use is taken as the newest tick in its subtree (one bottom-up pass),
//   and the nodes with the oldest (last use, deepest first) are removed until the count is back to
//   capacity - capacity/8 (amortizes the O(n) pass; above 64k nodes the cut is found from a
//   sample of 4096 keys, so it is approximate); in that order every removed node is a leaf
//   when it is removed. The node count never exceeds the capacity after an insert returns.
//
// Draft trees use xgrammar's layout: flattened nodes, node 0 = the last context token (the last
//   verified token), `next_token[i]` = first child of i or -1, `next_sibling[i]` = next sibling or
//   -1. Parents come before children and siblings are in rank order (best first). A tree has at most
//   `num_draft_tokens` nodes INCLUDING the root (the verify width, SGLang's convention). Nodes are
//   chosen best-first by an estimated path probability (product of the children's relative
//   frequencies), each node keeping at most `branches` children; branches=1 gives a chain.
//
// Thread safety: every public method takes the object's mutex; the Python bindings release the GIL
//   around the work.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace cspec {

struct NgramConfig {
  int max_ngram = 8;                 // longest context suffix matched
  int min_ngram = 1;                 // shortest context suffix accepted as a match
  int num_draft_tokens = 8;          // nodes per draft tree, root included
  int branches = 1;                  // max children per draft node (1 = chain)
  int64_t capacity = 1 << 19;        // shared trie: max nodes (root excluded)
  int64_t request_capacity = 1 << 16;  // per-request trie: max nodes (root excluded)
  int window = 0;  // tokens per stored window; 0 = max_ngram + num_draft_tokens - 1

  int effective_window() const {
    int w = window > 0 ? window : max_ngram + num_draft_tokens - 1;
    return w < 1 ? 1 : w;
  }
  void validate() const;  // throws std::invalid_argument
};

// Open-addressing hash map uint64 -> int32 (linear probing, backward-shift deletion): the trie's
// edge table, keyed by (parent id, token).
class EdgeMap {
 public:
  EdgeMap() { reset(1024); }
  int32_t find(uint64_t k) const {
    for (size_t i = slot(k);; i = (i + 1) & mask_) {
      if (slots_[i].key == k) return slots_[i].val;
      if (slots_[i].key == kEmpty) return -1;
    }
  }
  void insert(uint64_t k, int32_t v);  // k must be absent
  void erase(uint64_t k);
  void clear() { reset(1024); }
  size_t size() const { return size_; }

 private:
  static constexpr uint64_t kEmpty = ~uint64_t(0);
  struct Slot {
    uint64_t key;
    int32_t val;
  };
  size_t slot(uint64_t k) const {
    k ^= k >> 29;
    k *= 0x9E3779B97F4A7C15ull;
    return size_t(k >> 17) & mask_;
  }
  void reset(size_t cap) {
    slots_.assign(cap, Slot{kEmpty, -1});
    mask_ = cap - 1;
    size_ = 0;
  }
  std::vector<Slot> slots_;
  size_t mask_ = 0, size_ = 0;
};

// A capacity-bounded frequency trie with LRU-leaf eviction. Node 0 is the root.
class Trie {
 public:
  struct Node {
    int32_t token = -1;
    int32_t parent = -1;
    int32_t first_child = -1;
    int32_t next_sib = -1;  // intrusive doubly-linked list of a node's children
    int32_t prev_sib = -1;
    int32_t depth = 0;
    uint32_t gen = 0;  // bumped when the slot is freed: (id, gen) handles detect eviction
    uint32_t num_children = 0;
    int64_t freq = 0;
    uint64_t tick = 0;
    bool alive = false;
  };

  explicit Trie(int64_t capacity);

  int32_t child(int32_t node, int32_t token) const {
    return node < 0 ? -1 : edges_.find(key(node, token));
  }
  // Finds or creates the child, increments its frequency, touches it.
  int32_t add_child(int32_t node, int32_t token, uint64_t tick);
  // Follows tokens from the root; -1 when the path does not exist.
  int32_t walk(const int32_t* tokens, int n) const;
  void touch(int32_t node, uint64_t tick) {
    if (nodes_[node].tick < tick) nodes_[node].tick = tick;
  }
  bool valid(int32_t node, uint32_t gen) const {
    return node >= 0 && node < (int32_t)nodes_.size() && nodes_[node].alive && nodes_[node].gen == gen;
  }
  // Evicts LRU leaves when over capacity. Returns the number of evicted nodes.
  int64_t maybe_evict();
  void clear();

  const Node& node(int32_t i) const { return nodes_[i]; }
  int64_t size() const { return size_; }  // nodes, root excluded
  int64_t capacity() const { return capacity_; }

 private:
  void remove_leaf(int32_t id);
  static uint64_t key(int32_t node, int32_t token) {
    return (uint64_t(uint32_t(node)) << 32) | uint64_t(uint32_t(token));
  }

  int64_t capacity_;
  int64_t size_ = 0;
  std::vector<Node> nodes_;
  std::vector<int32_t> free_;
  EdgeMap edges_;
};

// Output of one draft tree (flattened, xgrammar layout).
struct DraftTree {
  std::vector<int32_t> tokens, next_token, next_sibling;
};

class NgramTrie {
 public:
  explicit NgramTrie(const NgramConfig& cfg);

  // Appends `tokens` to the stream of `request_id` (creating it on first use: the first call is
  // normally the prompt, later calls the accepted outputs) and inserts the new windows into the
  // shared and the request's own trie. request_id < 0: a standalone stream, shared trie only.
  void insert(int64_t request_id, const int32_t* tokens, int64_t n);
  void remove_request(int64_t request_id);
  bool has_request(int64_t request_id) const;

  // Draft tree for one request. `context` = the token context whose last token is node 0; when
  // null, the request's stored stream is used. Overrides <= 0 use the config values.
  // Writes at most `num_draft_tokens` nodes into the three output arrays and returns the count
  // (0 only when the context is empty).
  int propose(int64_t request_id, const int32_t* context, int64_t context_len, int32_t* tokens,
              int32_t* next_token, int32_t* next_sibling, int num_draft_tokens, int branches,
              int max_ngram, int min_ngram);

  // Batch: outputs are [B, N] row-major (N = num_draft_tokens after override), padded with
  // token 0 / -1 links; counts [B]. contexts[b] may be null (stored stream).
  void propose_batch(const int64_t* request_ids, int64_t batch, const int32_t* const* contexts,
                     const int64_t* context_lens, int32_t* tokens, int32_t* next_token,
                     int32_t* next_sibling, int32_t* counts, int num_draft_tokens, int branches,
                     int max_ngram, int min_ngram);

  int64_t num_nodes() const;
  int64_t request_num_nodes(int64_t request_id) const;  // -1 when unknown
  int64_t num_requests() const;
  // Frequency of an n-gram in the shared trie (request_id < 0) or a request's own trie; 0 if absent.
  int64_t frequency(int64_t request_id, const int32_t* tokens, int n) const;
  std::vector<int32_t> request_history(int64_t request_id) const;
  void clear();
  const NgramConfig& config() const { return cfg_; }

 private:
  struct Handle {
    int32_t node;
    uint32_t gen;
    int32_t depth;
  };
  struct Request {
    std::unique_ptr<Trie> own;
    std::vector<int32_t> history;  // the last tokens of the stream (>= max(window, max_ngram))
    std::vector<Handle> shared_open, own_open;
  };

  void append(Trie& trie, std::vector<Handle>& open, int32_t token, uint64_t tick);
  int match(const Trie& trie, const int32_t* ctx, int64_t len, int max_ngram, int min_ngram) const;
  int propose_locked(Request* req, const int32_t* ctx, int64_t len, int32_t* tokens,
                     int32_t* next_token, int32_t* next_sibling, int n, int branches, int max_ngram,
                     int min_ngram);

  NgramConfig cfg_;
  int window_;
  mutable std::mutex mu_;
  uint64_t tick_ = 0;
  Trie shared_;
  std::unordered_map<int64_t, Request> requests_;
};

}  // namespace cspec
