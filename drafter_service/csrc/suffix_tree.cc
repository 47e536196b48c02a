// Sequences in a SuffixTree: appending (open leaves, extending each suffix
// seen before), sealing, removing, and matching patterns.
#include "suffix_tree.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace speclane {

SuffixTree::SuffixTree(int max_depth) : max_depth_(max_depth) {
  if (max_depth < 1 || max_depth >= kOpen) throw std::invalid_argument("max_depth must be between 1 and 65534");
  nodes_.push_back(Node{0, kNone, 0, 0, 0, kNone, 0});  // the root: count 0, never a leaf to grow
}

size_t SuffixTree::sequence_length(int64_t seq) const { return sequence_tokens(seq).size(); }

const std::vector<int32_t>& SuffixTree::sequence_tokens(int64_t seq) const {
  auto it = seqs_.find(seq);
  if (it == seqs_.end()) throw std::out_of_range("unknown sequence " + std::to_string(seq));
  return stores_[it->second.store].tokens;
}

void SuffixTree::add_sequence(int64_t seq) {
  if (seqs_.count(seq)) throw std::invalid_argument("sequence " + std::to_string(seq) + " already exists");
  uint32_t store = new_store({});
  stores_[store].refs = 1;  // held by the sequence itself
  seqs_.emplace(seq, Sequence{store, {kRoot}});
}

SuffixTree::Sequence& SuffixTree::sequence(int64_t seq) {
  auto it = seqs_.find(seq);
  if (it == seqs_.end()) throw std::out_of_range("unknown sequence " + std::to_string(seq));
  return it->second;
}

void SuffixTree::append(Sequence& sequence, const int32_t* tokens, size_t n) {
  if (sequence.frontier.empty() && n > 0) throw std::invalid_argument("sequence is sealed");
  for (size_t i = 0; i < n; ++i) {
    int32_t token = tokens[i];
    std::vector<int32_t>& storage = stores_[sequence.store].tokens;
    storage.push_back(token);  // every open leaf of the sequence grows by this token
    uint32_t pos = static_cast<uint32_t>(storage.size() - 1);
    // Open leaves another sequence's suffix has joined since stopped growing:
    // their suffixes move on like any other.
    if (sequence.joins_seen != joins_) {
      while (sequence.open_size() > 0 && nodes_[sequence.open.back()].length != kOpen) {
        sequence.frontier.push_back(sequence.open.back());
        sequence.open.pop_back();
      }
      sequence.joins_seen = joins_;
    }
    sequence.full = kNone;
    if (sequence.open_size() > 0 && sequence.suffixes() == static_cast<size_t>(max_depth_)) {
      sequence.full = sequence.open[sequence.open_begin];
      sequence.full_stamp = frees_;
      drop_longest(sequence);
    }
    grown_.clear();
    grown_.push_back(kRoot);
    fresh_.clear();
    for (uint32_t node : sequence.frontier) {
      Node& record = nodes_[node];
      if (record.nkids == 0 && record.count == 1) {
        // A leaf only this suffix reaches now (the others were removed): it reads from our storage from here on.
        set_label(node, sequence.store, pos - record.length);
        nodes_[node].length += 1;
        nodes_[node].depth += 1;
      } else {
        node = extend(node, sequence.store, pos, token);
      }
      const Node& result = nodes_[node];
      if (result.depth >= max_depth_) {
        sequence.full = node;
        sequence.full_stamp = frees_;
        continue;
      }
      if (result.count == 1) {
        open_leaf(node);
        fresh_.push_back(node);
      } else if (fresh_.empty()) {
        grown_.push_back(node);
      } else {
        throw std::logic_error("suffix counts must not grow with the suffix length");
      }
    }
    sequence.frontier.swap(grown_);
    sequence.open.insert(sequence.open.end(), fresh_.rbegin(), fresh_.rend());
  }
}

void SuffixTree::open_leaf(uint32_t node) {
  Node& record = nodes_[node];
  record.depth -= record.length;
  record.length = kOpen;
}

void SuffixTree::close_leaf(uint32_t node) {
  Node& record = nodes_[node];
  uint32_t length = open_length(record);
  record.length = static_cast<uint16_t>(length);
  record.depth += length;
}

void SuffixTree::drop_first_token(uint32_t node) {
  Node& record = nodes_[node];
  record.start += 1;
  if (record.length == kOpen) {
    record.depth += 1;
  } else {
    record.length -= 1;
  }
}

void SuffixTree::drop_longest(Sequence& sequence) {
  // The longest suffix reached max_depth and leaves the frontier. Its leaf
  // stays open: its length stops growing at max_depth by itself.
  sequence.open_begin += 1;
  if (sequence.open_begin * 2 > sequence.open.size()) {
    sequence.open.erase(sequence.open.begin(), sequence.open.begin() + sequence.open_begin);
    sequence.open_begin = 0;
  }
}

void SuffixTree::seal(int64_t seq) {
  auto it = seqs_.find(seq);
  if (it == seqs_.end()) throw std::out_of_range("unknown sequence " + std::to_string(seq));
  Sequence& sequence = it->second;
  for (size_t i = sequence.open_begin; i < sequence.open.size(); ++i)
    if (nodes_[sequence.open[i]].length == kOpen) close_leaf(sequence.open[i]);
  std::vector<uint32_t>().swap(sequence.frontier);
  std::vector<uint32_t>().swap(sequence.open);
  sequence.open_begin = 0;
}

void SuffixTree::remove_sequence(int64_t seq) {
  auto it = seqs_.find(seq);
  if (it == seqs_.end()) throw std::out_of_range("unknown sequence " + std::to_string(seq));
  uint32_t store = it->second.store;
  seqs_.erase(it);
  const size_t len = stores_[store].tokens.size();
  std::vector<uint32_t> path;
  for (size_t start = 0; start < len; ++start) {
    size_t end = std::min(len, start + static_cast<size_t>(max_depth_));
    uint32_t parent = kRoot;
    size_t position = start;
    path.clear();
    while (position < end) {
      uint32_t node = find_child(parent, stores_[store].tokens[position]);
      position += length_of(nodes_[node]);
      if (recount(parent, node, -1)) {
        free_chain(node);
        break;
      }
      path.push_back(node);
      parent = node;
    }
    relabel(path, store);
    merge_path(path);
  }
  unref(store);  // the sequence's own reference; relabelling moved every node off it
}

int32_t SuffixTree::count(const int32_t* pattern, size_t n) const {
  Position at;
  return match(pattern, 0, n, &at) ? nodes_[at.node].count : 0;
}

uint32_t SuffixTree::extend(uint32_t node, uint32_t store, uint32_t pos, int32_t token) {
  uint32_t child = find_child(node, token);
  if (child == kNone) {
    child = new_node(store, pos, 1, nodes_[node].depth + 1u, 1);
    attach(node, child);
    return child;
  }
  uint32_t child_length = length_of(nodes_[child]);
  if (nodes_[node].nkids == 1 && nodes_[child].count == nodes_[node].count - 1 &&
      (child_length > 1 || unpointed(child))) {
    // Only this suffix ends at `node`, all others go on into `child`:
    // move node's end one token down instead of adding a boundary.
    lower_end(node, child);
    return node;
  }
  if (child_length > 1) child = split(node, child);
  recount(node, child, +1);
  if (nodes_[child].length == kOpen) {  // another sequence's leaf, joined: it stops growing
    close_leaf(child);
    joins_ += 1;
  }
  return child;
}

uint32_t SuffixTree::split(uint32_t parent, uint32_t child) {
  Node copy = nodes_[child];
  uint32_t upper = new_node(copy.store, copy.start, 1, nodes_[parent].depth + 1u, copy.count);
  replace(parent, child, upper);
  drop_first_token(child);
  resize_kids(upper, 1);
  kids_of(upper)[0] = kid_of(child);
  return upper;
}

bool SuffixTree::unpointed(uint32_t node) const {
  // Frontiers stop short of max_depth, and below it a node nobody's suffix ends at has no pointer either.
  const Node& record = nodes_[node];
  if (depth_of(record) >= static_cast<uint32_t>(max_depth_)) return true;
  if (record.nkids == 0) return false;
  int64_t below = 0;
  for (uint32_t i = 0; i < record.nkids; ++i) below += nodes_[kid_arena_[record.kids + i].node].count;
  return below == record.count;
}

void SuffixTree::lower_end(uint32_t node, uint32_t child) {
  Node below = nodes_[child];
  set_label(node, below.store, below.start - nodes_[node].length);
  nodes_[node].length += 1;
  nodes_[node].depth += 1;
  if (length_of(below) > 1) {
    drop_first_token(child);
    kids_of(node)[0].token = first_token(child);  // child is node's only child
    return;
  }
  // A one-token child goes whole: node takes over its children.
  resize_kids(node, 0);
  if (below.nkids > kSmall) index_kids(child, false);
  nodes_[node].kids = below.kids;
  nodes_[node].nkids = below.nkids;
  nodes_[child].kids = kNone;
  nodes_[child].nkids = 0;
  if (below.nkids > kSmall) index_kids(node, true);
  free_node(child);
}

void SuffixTree::merge_path(const std::vector<uint32_t>& path) {
  // Joins each node with its only child once their counts are equal: no suffix
  // ends there, so no frontier points at it, and the child takes its place.
  uint32_t parent = kRoot;
  for (uint32_t node : path) {
    if (nodes_[node].nkids == 1) {
      uint32_t below = kids_of(node)[0].node;
      if (nodes_[below].count == nodes_[node].count) {
        replace(parent, node, below);
        Node& lower = nodes_[below];
        lower.start -= nodes_[node].length;
        if (lower.length == kOpen) {
          lower.depth -= nodes_[node].length;  // the top of an open leaf moves up
        } else {
          lower.length += nodes_[node].length;
        }
        free_node(node);
        continue;
      }
    }
    parent = node;
  }
}

void SuffixTree::relabel(const std::vector<uint32_t>& path, uint32_t store) {
  // Path nodes that read from a removed sequence read from one copy of the path instead.
  uint32_t copy = kNone;
  for (auto it = path.rbegin(); it != path.rend(); ++it) {
    const Node& record = nodes_[*it];
    if (record.store != store) continue;
    if (copy == kNone) {  // the deepest such node's root path covers its ancestors' too
      uint32_t end = record.start + record.length;
      const std::vector<int32_t>& tokens = stores_[store].tokens;
      copy = new_store(std::vector<int32_t>(tokens.begin() + (end - record.depth), tokens.begin() + end));
    }
    set_label(*it, copy, nodes_[*it].depth - nodes_[*it].length);
  }
}

bool SuffixTree::match(const int32_t* tokens, size_t start, size_t end, Position* out) const {
  uint32_t node = kRoot, offset = 0, length = 0;
  for (size_t i = start; i < end; ++i) {
    int32_t token = tokens[i];
    if (offset < length) {
      if (token_at(nodes_[node], offset) != token) return false;
      ++offset;
    } else {
      node = find_child(node, token);
      if (node == kNone) return false;
      offset = 1;
      length = length_of(nodes_[node]);
    }
  }
  *out = Position{node, offset};
  return true;
}

}  // namespace speclane
