// Path-compressed suffix trie truncated at max_depth (SuffixDecoding), the
// compiled twin of drafter_service/suffix_tree.py: same invariants, same node
// boundaries, same drafts. See that file for the algorithm.
//
// Layout: nodes are 24-byte records in one pool addressed by uint32 index
// (freed records are reused). An edge is `length` tokens of a token store
// (a sequence's tokens, or a private copy of a path of an evicted one).
//
// Open leaves (Ukkonen's "once a leaf, always a leaf"): a leaf only one
// suffix of a running sequence reaches reads from that sequence's tokens up to
// their end, so it grows with every appended token without being touched; its
// length is computed from the sequence's length, capped at max_depth. Append
// only visits the suffixes whose pattern occurred before, not all max_depth.
// Children of a non-root node sit in a contiguous array from a pooled arena
// sorted by (count desc, first token asc), so the top child is kids[0]; each
// entry carries the child's first token, so choosing a child reads no edge.
// The root and nodes with many children are also indexed by an EdgeMap.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <unordered_map>
#include <vector>

#include "draft.h"
#include "edge_map.h"

namespace speclane {

struct Node {
  int32_t count;
  uint32_t store;   // token store the edge reads from
  uint32_t start;   // edge = store[start, start + length); store[start + length - depth, ...) is the root path
  uint16_t length;  // kOpen: an open leaf
  uint16_t depth;   // pattern length at the end of the edge; at its top for an open leaf
  uint32_t kids;    // offset of the children array in the kid arena, kNone when a leaf
  uint32_t nkids;
};
static_assert(sizeof(Node) == 24, "node records stay compact");

constexpr uint16_t kOpen = 0xFFFF;
constexpr uint32_t kRoot = 0;
constexpr uint32_t kSmall = 8;  // children beyond this many are also found through the EdgeMap, not a scan

struct Kid {
  int32_t token;  // the child's first token
  uint32_t node;
};

struct SpecParams {
  int max_spec_tokens = 16;
  double max_spec_factor = 1.0;
  double max_spec_offset = 0.0;
  double min_token_prob = 0.1;
  bool use_tree = false;
  bool reanchor = true;  // path drafts go on past max_depth by re-matching the last max_depth/2 tokens
  // A path draft that stops at its budget goes on along the same path for up to this many tokens: the
  // likely next token, then the next step's draft within its own budget (Draft.step_len marks the cut).
  // With it, a path draft also offers detours: the drafts after the step's likeliest other outcomes.
  int lookahead = 0;
};

class SuffixTree {
 public:
  // Where the suffixes shorter than max_depth of a running sequence end: the
  // shorter ones, whose patterns occurred before, at closed nodes
  // (frontier[length], root first); the longer ones, each seen once, at open
  // leaves (open[open_begin..], longest first). Counts only fall as suffixes
  // get longer, so the two parts never interleave.
  struct Sequence {
    uint32_t store;
    std::vector<uint32_t> frontier;
    std::vector<uint32_t> open;
    uint32_t open_begin = 0;
    // Where the suffix of exactly max_depth tokens ended after the last
    // append, while no node has been freed since (`full_stamp` = frees_).
    uint32_t full = kNone;
    uint64_t full_stamp = 0;
    uint64_t joins_seen = 0;  // joins_ when open leaves were last checked for joins
    size_t open_size() const { return open.size() - open_begin; }
    size_t suffixes() const { return frontier.size() + open_size(); }
    // The node where the suffix of `length` (< suffixes()) ends.
    uint32_t node_of(size_t length) const {
      return length < frontier.size() ? frontier[length] : open[open.size() - 1 - (length - frontier.size())];
    }
  };

  explicit SuffixTree(int max_depth);  // 1..65534

  int max_depth() const { return max_depth_; }
  bool contains(int64_t seq) const { return seqs_.count(seq) != 0; }
  size_t sequence_length(int64_t seq) const;
  const std::vector<int32_t>& sequence_tokens(int64_t seq) const;
  void add_sequence(int64_t seq);
  // A sequence's handle, valid until the sequence is removed.
  Sequence& sequence(int64_t seq);
  void append(int64_t seq, const int32_t* tokens, size_t n) { append(sequence(seq), tokens, n); }
  void append(Sequence& sequence, const int32_t* tokens, size_t n);
  // No more appends to `seq`: frees its frontier (drafts are unaffected).
  void seal(int64_t seq);
  void remove_sequence(int64_t seq);
  int32_t count(const int32_t* pattern, size_t n) const;
  // Where the context ends like sequence `along` (as a running request's does),
  // that sequence's frontier gives the position of every match length up to
  // max_depth, so they are not re-matched from the root; the draft is the same.
  Draft speculate(const int32_t* context, size_t n, const SpecParams& params, const Sequence* along = nullptr) const;
  size_t num_nodes() const { return nodes_.size() - 1 - free_nodes_.size(); }
  size_t memory_bytes() const;

 private:
  struct Store {
    std::vector<int32_t> tokens;
    uint32_t refs = 0;
  };
  struct Position {
    uint32_t node;
    uint32_t offset;
  };

  int32_t token_at(const Node& n, uint32_t i) const { return stores_[n.store].tokens[n.start + i]; }
  uint32_t open_length(const Node& n) const {
    size_t end = std::min(stores_[n.store].tokens.size(), static_cast<size_t>(n.start - n.depth) + max_depth_);
    return static_cast<uint32_t>(end - n.start);
  }
  uint32_t length_of(const Node& n) const { return n.length == kOpen ? open_length(n) : n.length; }
  uint32_t depth_of(const Node& n) const { return n.length == kOpen ? n.depth + open_length(n) : n.depth; }
  void open_leaf(uint32_t node);
  void close_leaf(uint32_t node);
  void drop_first_token(uint32_t node);
  void drop_longest(Sequence& sequence);
  uint32_t full_node(const Sequence& sequence) const {
    return sequence.full_stamp == frees_ ? sequence.full : kNone;
  }
  int32_t first_token(uint32_t node) const { return token_at(nodes_[node], 0); }
  bool before(const Kid& a, const Kid& b) const;
  Kid kid_of(uint32_t node) const { return Kid{first_token(node), node}; }
  Kid* kids_of(uint32_t node) { return &kid_arena_[nodes_[node].kids]; }
  const Kid* kids_of(uint32_t node) const { return &kid_arena_[nodes_[node].kids]; }
  bool indexed(uint32_t node) const;

  uint32_t new_node(uint32_t store, uint32_t start, uint32_t length, uint32_t depth, int32_t count);
  void free_node(uint32_t node);
  void free_chain(uint32_t node);
  void set_label(uint32_t node, uint32_t store, uint32_t start);
  uint32_t new_store(std::vector<int32_t> tokens);
  void unref(uint32_t store);

  uint32_t alloc_kids(uint32_t capacity);
  void free_kids(uint32_t offset, uint32_t capacity);
  void resize_kids(uint32_t node, uint32_t new_size);
  uint32_t kid_index(uint32_t parent, uint32_t child) const;

  uint32_t find_child(uint32_t parent, int32_t token) const;
  void attach(uint32_t parent, uint32_t child);
  void detach(uint32_t parent, uint32_t child);
  void replace(uint32_t parent, uint32_t old_child, uint32_t new_child);
  bool recount(uint32_t parent, uint32_t child, int delta);
  void index_kids(uint32_t node, bool add);

  uint32_t extend(uint32_t node, uint32_t store, uint32_t pos, int32_t token);
  uint32_t split(uint32_t parent, uint32_t child);
  bool unpointed(uint32_t node) const;
  void lower_end(uint32_t node, uint32_t child);
  void merge_path(const std::vector<uint32_t>& path);
  void relabel(const std::vector<uint32_t>& path, uint32_t store);

  bool match(const int32_t* tokens, size_t start, size_t end, Position* out) const;
  // `visited`, when given, gets the position each token was read from, then the position after the last.
  Draft draft_path(Position at, int budget, const SpecParams& params, const int32_t* pattern, size_t m,
                   std::vector<Position>* visited = nullptr) const;
  std::vector<Detour> detours(const Draft& draft, int step_len, const std::vector<Position>& visited,
                              const SpecParams& params, const int32_t* pattern, size_t m) const;
  Draft draft_tree(Position at, int budget, double min_token_prob) const;

  int max_depth_;
  std::vector<Node> nodes_;
  std::vector<uint32_t> free_nodes_;
  std::vector<Kid> kid_arena_;
  std::vector<std::vector<uint32_t>> free_kids_;  // by log2 capacity
  EdgeMap edges_;
  std::vector<Store> stores_;
  std::vector<uint32_t> free_stores_;
  std::unordered_map<int64_t, Sequence> seqs_;
  std::vector<uint32_t> grown_, fresh_;  // append's scratch
  uint64_t joins_ = 0;  // open leaves joined (and so closed) by another suffix so far
  uint64_t frees_ = 0;                   // nodes freed so far: a node id kept across calls is valid while unchanged
};

}  // namespace speclane
