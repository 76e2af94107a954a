// N-gram lookahead trie; see ngram_trie.h for the design.
#include "ngram_trie.h"

#include <algorithm>
#include <queue>
#include <stdexcept>
#include <string>

namespace cspec {

void NgramConfig::validate() const {
  auto fail = [](const std::string& m) { throw std::invalid_argument("NgramConfig: " + m); };
  if (max_ngram < 1) fail("max_ngram must be >= 1");
  if (min_ngram < 1) fail("min_ngram must be >= 1");
  if (min_ngram > max_ngram) fail("min_ngram must be <= max_ngram");
  if (num_draft_tokens < 1) fail("num_draft_tokens must be >= 1 (the root counts)");
  if (branches < 1) fail("branches must be >= 1");
  if (capacity < 0 || capacity > (int64_t(1) << 30)) fail("capacity must be in [0, 2^30]");
  if (request_capacity < 0 || request_capacity > (int64_t(1) << 30))
    fail("request_capacity must be in [0, 2^30]");
  if (window < 0) fail("window must be >= 0");
}

// ---------------------------------------------------------------------------------------------
// Trie

Trie::Trie(int64_t capacity) : capacity_(capacity) { clear(); }

void Trie::clear() {
  nodes_.clear();
  nodes_.emplace_back();
  nodes_[0].alive = true;
  free_.clear();
  edges_.clear();
  size_ = 0;
}

int32_t Trie::walk(const int32_t* tokens, int n) const {
  int32_t cur = 0;
  for (int i = 0; i < n && cur >= 0; ++i) cur = child(cur, tokens[i]);
  return cur;
}

void EdgeMap::insert(uint64_t k, int32_t v) {
  if ((size_ + 1) * 2 > slots_.size()) {  // keep the load factor <= 1/2
    std::vector<Slot> old;
    old.swap(slots_);
    reset(old.size() * 2);
    for (const Slot& s : old)
      if (s.key != kEmpty) insert(s.key, s.val);
  }
  size_t i = slot(k);
  while (slots_[i].key != kEmpty) i = (i + 1) & mask_;
  slots_[i] = {k, v};
  size_++;
}

void EdgeMap::erase(uint64_t k) {
  size_t i = slot(k);
  while (slots_[i].key != k) {
    if (slots_[i].key == kEmpty) return;
    i = (i + 1) & mask_;
  }
  // backward-shift deletion: pull later entries of the probe run into the hole
  for (size_t j = (i + 1) & mask_; slots_[j].key != kEmpty; j = (j + 1) & mask_) {
    const size_t h = slot(slots_[j].key);
    if (((j - h) & mask_) >= ((j - i) & mask_)) {
      slots_[i] = slots_[j];
      i = j;
    }
  }
  slots_[i] = {kEmpty, -1};
  size_--;
}

int32_t Trie::add_child(int32_t node, int32_t token, uint64_t tick) {
  const uint64_t k = key(node, token);
  int32_t id = edges_.find(k);
  if (id < 0) {
    if (!free_.empty()) {
      id = free_.back();
      free_.pop_back();
    } else {
      id = (int32_t)nodes_.size();
      nodes_.emplace_back();
    }
    Node& c = nodes_[id];
    Node& p = nodes_[node];
    c.token = token;
    c.parent = node;
    c.first_child = -1;
    c.prev_sib = -1;
    c.next_sib = p.first_child;
    if (p.first_child >= 0) nodes_[p.first_child].prev_sib = id;
    p.first_child = id;
    p.num_children++;
    c.depth = p.depth + 1;
    c.num_children = 0;
    c.freq = 0;
    c.tick = 0;
    c.alive = true;
    edges_.insert(k, id);
    size_++;
  }
  nodes_[id].freq++;
  touch(id, tick);
  return id;
}

void Trie::remove_leaf(int32_t id) {
  Node& n = nodes_[id];
  Node& p = nodes_[n.parent];
  if (n.prev_sib >= 0)
    nodes_[n.prev_sib].next_sib = n.next_sib;
  else
    p.first_child = n.next_sib;
  if (n.next_sib >= 0) nodes_[n.next_sib].prev_sib = n.prev_sib;
  p.num_children--;
  edges_.erase(key(n.parent, n.token));
  n.alive = false;
  n.gen++;
  n.parent = n.first_child = n.next_sib = n.prev_sib = -1;
  n.freq = 0;
  free_.push_back(id);
  size_--;
}

int64_t Trie::maybe_evict() {
  if (size_ <= capacity_) return 0;
  const int64_t target = capacity_ - capacity_ / 8;
  const int64_t m = size_ - target;
  struct Key {
    uint64_t tick;
    int32_t depth;
    int32_t id;
    bool operator<(const Key& o) const {  // oldest first, deeper first, then id
      if (tick != o.tick) return tick < o.tick;
      if (depth != o.depth) return depth > o.depth;
      return id < o.id;
    }
  };
  // last use of a node = newest tick in its subtree: propagate bottom-up (counting sort by depth)
  const int32_t n = (int32_t)nodes_.size();
  int32_t max_depth = 0;
  for (int32_t i = 1; i < n; ++i)
    if (nodes_[i].alive) max_depth = std::max(max_depth, nodes_[i].depth);
  std::vector<int32_t> start(max_depth + 2, 0);
  for (int32_t i = 1; i < n; ++i)
    if (nodes_[i].alive) start[nodes_[i].depth + 1]++;
  for (int32_t d = 0; d <= max_depth; ++d) start[d + 1] += start[d];
  std::vector<int32_t> by_depth(start[max_depth + 1]);
  for (int32_t i = 1; i < n; ++i)
    if (nodes_[i].alive) by_depth[start[nodes_[i].depth]++] = i;  // ascending depth
  std::vector<uint64_t> last(n, 0);
  for (int32_t i = 0; i < n; ++i) last[i] = nodes_[i].tick;
  for (auto it = by_depth.rbegin(); it != by_depth.rend(); ++it) {
    const int32_t p = nodes_[*it].parent;
    if (last[p] < last[*it]) last[p] = last[*it];
  }
  std::vector<Key> keys;
  keys.reserve(by_depth.size());
  for (int32_t i : by_depth) keys.push_back({last[i], nodes_[i].depth, i});
  // Select the m oldest keys. Large tries: a threshold from a strided sample of the keys
  // (O(n), no full selection); the selected set may be a little smaller or larger than m but
  // must bring the count back to the capacity, else fall back to the exact selection.
  std::vector<char> selected(n, 0);
  int64_t num_selected = 0;
  const int64_t total = (int64_t)keys.size();
  const int64_t need = size_ - capacity_;
  if (total > 65536) {
    const int64_t S = 4096;
    std::vector<Key> sample;
    sample.reserve(S);
    for (int64_t s = 0; s < S; ++s) sample.push_back(keys[(s * total) / S]);
    std::sort(sample.begin(), sample.end());
    const Key thr = sample[std::min<int64_t>(S - 1, (m * S) / total)];
    for (const Key& k : keys)
      if (k < thr) selected[k.id] = 1, num_selected++;
    if (num_selected < need) {
      std::fill(selected.begin(), selected.end(), 0);
      num_selected = 0;
    }
  }
  if (num_selected == 0 && m > 0) {
    if (m < total) std::nth_element(keys.begin(), keys.begin() + m, keys.end());
    for (int64_t i = 0; i < std::min<int64_t>(m, total); ++i) selected[keys[i].id] = 1;
  }
  // The selected set is closed under descendants (a child's key is always smaller than its
  // parent's), so removing deepest first removes only leaves.
  int64_t removed = 0;
  for (auto it = by_depth.rbegin(); it != by_depth.rend(); ++it) {
    if (selected[*it] && nodes_[*it].alive && nodes_[*it].first_child < 0) {
      remove_leaf(*it);
      removed++;
    }
  }
  return removed;
}

// ---------------------------------------------------------------------------------------------
// NgramTrie

NgramTrie::NgramTrie(const NgramConfig& cfg) : cfg_(cfg), shared_(cfg.capacity) {
  cfg_.validate();
  window_ = cfg_.effective_window();
}

void NgramTrie::append(Trie& trie, std::vector<Handle>& open, int32_t token, uint64_t tick) {
  size_t w = 0;
  for (size_t i = 0; i < open.size(); ++i) {
    const Handle h = open[i];
    if (!trie.valid(h.node, h.gen)) continue;  // evicted: this window is dropped
    const int32_t id = trie.add_child(h.node, token, tick);
    if (h.depth + 1 < window_) open[w++] = {id, trie.node(id).gen, h.depth + 1};
  }
  open.resize(w);
  const int32_t id = trie.add_child(0, token, tick);
  if (1 < window_) open.push_back({id, trie.node(id).gen, 1});
  trie.maybe_evict();
}

void NgramTrie::insert(int64_t request_id, const int32_t* tokens, int64_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t tick = ++tick_;
  if (request_id < 0) {
    std::vector<Handle> open;
    for (int64_t i = 0; i < n; ++i) append(shared_, open, tokens[i], tick);
    return;
  }
  Request& r = requests_[request_id];
  if (!r.own) r.own = std::make_unique<Trie>(cfg_.request_capacity);
  for (int64_t i = 0; i < n; ++i) {
    append(shared_, r.shared_open, tokens[i], tick);
    append(*r.own, r.own_open, tokens[i], tick);
  }
  r.history.insert(r.history.end(), tokens, tokens + n);
  const size_t keep = (size_t)std::max(window_, cfg_.max_ngram);
  if (r.history.size() > 2 * keep + 256)
    r.history.erase(r.history.begin(), r.history.end() - keep);
}

void NgramTrie::remove_request(int64_t request_id) {
  std::lock_guard<std::mutex> lock(mu_);
  requests_.erase(request_id);
}

bool NgramTrie::has_request(int64_t request_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  return requests_.count(request_id) > 0;
}

int NgramTrie::match(const Trie& trie, const int32_t* ctx, int64_t len, int max_ngram,
                     int min_ngram) const {
  int64_t k = std::min<int64_t>({(int64_t)max_ngram, len, (int64_t)window_});
  for (; k >= std::max(min_ngram, 1); --k) {
    const int32_t id = trie.walk(ctx + len - k, (int)k);
    if (id > 0 && trie.node(id).first_child >= 0) return id;
  }
  return -1;
}

namespace {
struct Child {
  int32_t token, own, shared;
  int64_t own_f, shared_f;
  double q;
};
struct Entry {
  double score;
  uint64_t seq;
  int32_t parent;
  int32_t rank;
  bool operator<(const Entry& o) const {  // max-heap: highest score, then earliest
    if (score != o.score) return score < o.score;
    return seq > o.seq;
  }
};
}  // namespace

int NgramTrie::propose_locked(Request* req, const int32_t* ctx, int64_t len, int32_t* tokens,
                              int32_t* next_token, int32_t* next_sibling, int n, int branches,
                              int max_ngram, int min_ngram) {
  if (len <= 0 || n <= 0) return 0;
  tokens[0] = ctx[len - 1];
  next_token[0] = -1;
  next_sibling[0] = -1;
  if (n == 1) return 1;
  Trie* own = (req && req->own) ? req->own.get() : nullptr;
  const int32_t own_m = own ? match(*own, ctx, len, max_ngram, min_ngram) : -1;
  const int32_t sh_m = match(shared_, ctx, len, max_ngram, min_ngram);
  if (own_m < 0 && sh_m < 0) return 1;
  const uint64_t tick = ++tick_;
  if (own_m >= 0) own->touch(own_m, tick);
  if (sh_m >= 0) shared_.touch(sh_m, tick);

  std::vector<std::vector<Child>> lists(n);
  std::vector<int32_t> last_child(n, -1);
  std::vector<double> path(n, 0.0);

  auto expand = [&](int32_t out, int32_t own_id, int32_t sh_id) {
    std::vector<Child>& kids = lists[out];
    int64_t O = 0, S = 0;
    if (own_id >= 0) {
      for (int32_t c = own->node(own_id).first_child; c >= 0; c = own->node(c).next_sib) {
        const Trie::Node& cn = own->node(c);
        const int32_t s = sh_id >= 0 ? shared_.child(sh_id, cn.token) : -1;
        kids.push_back({cn.token, c, s, cn.freq, s >= 0 ? shared_.node(s).freq : 0, 0.0});
        O += cn.freq;
      }
    }
    if (sh_id >= 0) {
      for (int32_t c = shared_.node(sh_id).first_child; c >= 0; c = shared_.node(c).next_sib) {
        const Trie::Node& cn = shared_.node(c);
        S += cn.freq;
        if (own_id >= 0 && own->child(own_id, cn.token) >= 0) continue;  // already listed
        kids.push_back({cn.token, -1, c, 0, cn.freq, 0.0});
      }
    }
    auto better = [](const Child& a, const Child& b) {
      if (a.own_f != b.own_f) return a.own_f > b.own_f;
      if (a.shared_f != b.shared_f) return a.shared_f > b.shared_f;
      return a.token < b.token;
    };
    const size_t k = std::min<size_t>(branches, kids.size());
    std::partial_sort(kids.begin(), kids.begin() + k, kids.end(), better);
    kids.resize(k);
    for (Child& c : kids) {
      if (O > 0 && S > 0)
        c.q = 0.5 * double(c.own_f) / double(O) + 0.5 * double(c.shared_f) / double(S);
      else if (O > 0)
        c.q = double(c.own_f) / double(O);
      else
        c.q = double(c.shared_f) / double(S);
    }
  };

  std::priority_queue<Entry> pq;
  uint64_t seq = 0;
  int count = 1;
  path[0] = 1.0;
  expand(0, own_m, sh_m);
  if (!lists[0].empty()) pq.push({lists[0][0].q, seq++, 0, 0});
  while (count < n && !pq.empty()) {
    const Entry e = pq.top();
    pq.pop();
    const Child c = lists[e.parent][e.rank];
    const int32_t j = count++;
    tokens[j] = c.token;
    next_token[j] = -1;
    next_sibling[j] = -1;
    if (e.rank == 0)
      next_token[e.parent] = j;
    else
      next_sibling[last_child[e.parent]] = j;
    last_child[e.parent] = j;
    path[j] = e.score;
    if (c.own >= 0) own->touch(c.own, tick);
    if (c.shared >= 0) shared_.touch(c.shared, tick);
    if (e.rank + 1 < (int32_t)lists[e.parent].size())
      pq.push({path[e.parent] * lists[e.parent][e.rank + 1].q, seq++, e.parent, e.rank + 1});
    if (count < n) {
      expand(j, c.own, c.shared);
      if (!lists[j].empty()) pq.push({e.score * lists[j][0].q, seq++, j, 0});
    }
  }
  return count;
}

static inline int pick(int v, int dflt) { return v > 0 ? v : dflt; }

int NgramTrie::propose(int64_t request_id, const int32_t* context, int64_t context_len,
                       int32_t* tokens, int32_t* next_token, int32_t* next_sibling,
                       int num_draft_tokens, int branches, int max_ngram, int min_ngram) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = requests_.find(request_id);
  Request* req = it == requests_.end() ? nullptr : &it->second;
  if (!context) {
    if (!req) return 0;
    context = req->history.data();
    context_len = (int64_t)req->history.size();
  }
  return propose_locked(req, context, context_len, tokens, next_token, next_sibling,
                        pick(num_draft_tokens, cfg_.num_draft_tokens), pick(branches, cfg_.branches),
                        pick(max_ngram, cfg_.max_ngram), pick(min_ngram, cfg_.min_ngram));
}

void NgramTrie::propose_batch(const int64_t* request_ids, int64_t batch,
                              const int32_t* const* contexts, const int64_t* context_lens,
                              int32_t* tokens, int32_t* next_token, int32_t* next_sibling,
                              int32_t* counts, int num_draft_tokens, int branches, int max_ngram,
                              int min_ngram) {
  const int n = pick(num_draft_tokens, cfg_.num_draft_tokens);
  branches = pick(branches, cfg_.branches);
  max_ngram = pick(max_ngram, cfg_.max_ngram);
  min_ngram = pick(min_ngram, cfg_.min_ngram);
  std::fill(tokens, tokens + batch * n, 0);
  std::fill(next_token, next_token + batch * n, -1);
  std::fill(next_sibling, next_sibling + batch * n, -1);
  std::lock_guard<std::mutex> lock(mu_);
  for (int64_t b = 0; b < batch; ++b) {
    auto it = requests_.find(request_ids[b]);
    Request* req = it == requests_.end() ? nullptr : &it->second;
    const int32_t* ctx = contexts ? contexts[b] : nullptr;
    int64_t len = contexts ? context_lens[b] : 0;
    if (!ctx) {
      if (req) {
        ctx = req->history.data();
        len = (int64_t)req->history.size();
      } else {
        len = 0;
      }
    }
    counts[b] = propose_locked(req, ctx, len, tokens + b * n, next_token + b * n,
                               next_sibling + b * n, n, branches, max_ngram, min_ngram);
  }
}

int64_t NgramTrie::num_nodes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return shared_.size();
}

int64_t NgramTrie::request_num_nodes(int64_t request_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = requests_.find(request_id);
  return it == requests_.end() ? -1 : it->second.own->size();
}

int64_t NgramTrie::num_requests() const {
  std::lock_guard<std::mutex> lock(mu_);
  return (int64_t)requests_.size();
}

int64_t NgramTrie::frequency(int64_t request_id, const int32_t* tokens, int n) const {
  std::lock_guard<std::mutex> lock(mu_);
  const Trie* t = &shared_;
  if (request_id >= 0) {
    auto it = requests_.find(request_id);
    if (it == requests_.end()) return 0;
    t = it->second.own.get();
  }
  if (n <= 0) return 0;
  const int32_t id = t->walk(tokens, n);
  return id > 0 ? t->node(id).freq : 0;
}

std::vector<int32_t> NgramTrie::request_history(int64_t request_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = requests_.find(request_id);
  if (it == requests_.end()) return {};
  return it->second.history;
}

void NgramTrie::clear() {
  std::lock_guard<std::mutex> lock(mu_);
  requests_.clear();
  shared_.clear();
}

}  // namespace cspec
