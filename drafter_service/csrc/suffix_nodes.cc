// The node pool, token stores and child arrays of a SuffixTree: allocation
// and reuse, and children kept in (count desc, first token asc) order with a
// hash index on the root and on wide nodes.
#include <algorithm>
#include <cstring>

#include "suffix_tree.h"

namespace speclane {
namespace {

uint32_t capacity_of(uint32_t size) {
  uint32_t capacity = 1;
  while (capacity < size) capacity <<= 1;
  return capacity;
}

uint32_t log2_of(uint32_t capacity) {
  uint32_t log = 0;
  while ((1u << log) < capacity) ++log;
  return log;
}


}  // namespace

bool SuffixTree::before(const Kid& a, const Kid& b) const {
  int32_t x = nodes_[a.node].count, y = nodes_[b.node].count;
  if (x != y) return x > y;
  return a.token < b.token;
}

bool SuffixTree::indexed(uint32_t node) const { return node == kRoot || nodes_[node].nkids > kSmall; }

uint32_t SuffixTree::new_node(uint32_t store, uint32_t start, uint32_t length, uint32_t depth, int32_t count) {
  stores_[store].refs += 1;
  Node record{count, store, start, static_cast<uint16_t>(length), static_cast<uint16_t>(depth), kNone, 0};
  if (!free_nodes_.empty()) {
    uint32_t node = free_nodes_.back();
    free_nodes_.pop_back();
    nodes_[node] = record;
    return node;
  }
  nodes_.push_back(record);
  return static_cast<uint32_t>(nodes_.size() - 1);
}

void SuffixTree::free_node(uint32_t node) {
  Node& record = nodes_[node];
  if (record.kids != kNone) free_kids(record.kids, capacity_of(record.nkids));
  unref(record.store);
  record = Node{0, kNone, 0, 0, 0, kNone, 0};
  free_nodes_.push_back(node);
  frees_ += 1;
}

void SuffixTree::free_chain(uint32_t node) {
  // A dropped node had count 1, so below it hangs a single chain.
  while (node != kNone) {
    uint32_t next = nodes_[node].nkids ? kids_of(node)[0].node : kNone;
    free_node(node);
    node = next;
  }
}

void SuffixTree::set_label(uint32_t node, uint32_t store, uint32_t start) {
  Node& record = nodes_[node];
  if (record.store != store) {
    stores_[store].refs += 1;
    unref(record.store);
    record.store = store;
  }
  record.start = start;
}

uint32_t SuffixTree::new_store(std::vector<int32_t> tokens) {
  if (!free_stores_.empty()) {
    uint32_t store = free_stores_.back();
    free_stores_.pop_back();
    stores_[store].tokens = std::move(tokens);
    stores_[store].refs = 0;
    return store;
  }
  stores_.push_back(Store{std::move(tokens), 0});
  return static_cast<uint32_t>(stores_.size() - 1);
}

void SuffixTree::unref(uint32_t store) {
  if (--stores_[store].refs == 0) {
    std::vector<int32_t>().swap(stores_[store].tokens);
    free_stores_.push_back(store);
  }
}

uint32_t SuffixTree::alloc_kids(uint32_t capacity) {
  uint32_t log = log2_of(capacity);
  if (log < free_kids_.size() && !free_kids_[log].empty()) {
    uint32_t offset = free_kids_[log].back();
    free_kids_[log].pop_back();
    return offset;
  }
  uint32_t offset = static_cast<uint32_t>(kid_arena_.size());
  kid_arena_.resize(kid_arena_.size() + capacity);
  return offset;
}

void SuffixTree::free_kids(uint32_t offset, uint32_t capacity) {
  uint32_t log = log2_of(capacity);
  if (free_kids_.size() <= log) free_kids_.resize(log + 1);
  free_kids_[log].push_back(offset);
}

void SuffixTree::resize_kids(uint32_t node, uint32_t new_size) {
  Node& record = nodes_[node];
  uint32_t old_capacity = record.nkids ? capacity_of(record.nkids) : 0;
  uint32_t new_capacity = new_size ? capacity_of(new_size) : 0;
  if (old_capacity != new_capacity) {
    uint32_t offset = new_capacity ? alloc_kids(new_capacity) : kNone;
    if (offset != kNone && record.kids != kNone)
      std::memmove(&kid_arena_[offset], &kid_arena_[record.kids], std::min(record.nkids, new_size) * sizeof(Kid));
    if (record.kids != kNone) free_kids(record.kids, old_capacity);
    record.kids = offset;
  }
  record.nkids = new_size;
}

uint32_t SuffixTree::kid_index(uint32_t parent, uint32_t child) const {
  const Kid* kids = kids_of(parent);
  const uint32_t size = nodes_[parent].nkids;
  if (size <= kSmall) {  // a scan reads the array alone; a binary search reads the children's counts
    for (uint32_t i = 0; i < size; ++i)
      if (kids[i].node == child) return i;
  }
  const Kid* hit = std::lower_bound(kids, kids + size, kid_of(child),
                                    [this](const Kid& a, const Kid& b) { return before(a, b); });
  return static_cast<uint32_t>(hit - kids);
}

uint32_t SuffixTree::find_child(uint32_t parent, int32_t token) const {
  if (indexed(parent)) return edges_.find(EdgeMap::key(parent, token));
  const Kid* kids = kids_of(parent);
  for (uint32_t i = 0, n = nodes_[parent].nkids; i < n; ++i)
    if (kids[i].token == token) return kids[i].node;
  return kNone;
}

void SuffixTree::index_kids(uint32_t node, bool add) {
  const Kid* kids = kids_of(node);
  for (uint32_t i = 0, n = nodes_[node].nkids; i < n; ++i) {
    if (add) {
      edges_.set(EdgeMap::key(node, kids[i].token), kids[i].node);
    } else {
      edges_.erase(EdgeMap::key(node, kids[i].token));
    }
  }
}

void SuffixTree::attach(uint32_t parent, uint32_t child) {
  if (parent == kRoot) {  // the root keeps no order: speculation never starts there
    edges_.set(EdgeMap::key(kRoot, first_token(child)), child);
    nodes_[kRoot].nkids += 1;
    return;
  }
  uint32_t size = nodes_[parent].nkids;
  resize_kids(parent, size + 1);
  Kid* kids = kids_of(parent);
  Kid entry = kid_of(child);
  uint32_t at = static_cast<uint32_t>(
      std::lower_bound(kids, kids + size, entry, [this](const Kid& a, const Kid& b) { return before(a, b); }) - kids);
  std::memmove(kids + at + 1, kids + at, (size - at) * sizeof(Kid));
  kids[at] = entry;
  if (size + 1 == kSmall + 1) {
    index_kids(parent, true);
  } else if (size + 1 > kSmall) {
    edges_.set(EdgeMap::key(parent, entry.token), child);
  }
}

void SuffixTree::replace(uint32_t parent, uint32_t old_child, uint32_t new_child) {
  // Same count and first token: the same place in the order.
  if (indexed(parent)) edges_.set(EdgeMap::key(parent, first_token(old_child)), new_child);
  if (parent != kRoot) kids_of(parent)[kid_index(parent, old_child)].node = new_child;
}

bool SuffixTree::recount(uint32_t parent, uint32_t child, int delta) {
  if (parent == kRoot) {
    nodes_[child].count += delta;
    if (nodes_[child].count > 0) return false;
    edges_.erase(EdgeMap::key(kRoot, first_token(child)));
    nodes_[kRoot].nkids -= 1;
    return true;
  }
  uint32_t size = nodes_[parent].nkids;
  uint32_t at = kid_index(parent, child);
  Kid* kids = kids_of(parent);
  Kid entry = kids[at];
  if (size <= kSmall && nodes_[child].count + delta > 0) {
    // A count changes by one: the child moves a few places at most.
    nodes_[child].count += delta;
    while (at > 0 && before(entry, kids[at - 1])) kids[at] = kids[at - 1], --at;
    while (at + 1 < size && before(kids[at + 1], entry)) kids[at] = kids[at + 1], ++at;
    kids[at] = entry;
    return false;
  }
  std::memmove(kids + at, kids + at + 1, (size - at - 1) * sizeof(Kid));
  nodes_[child].count += delta;
  if (nodes_[child].count == 0) {
    if (size > kSmall) {
      edges_.erase(EdgeMap::key(parent, first_token(child)));
      nodes_[parent].nkids = size - 1;
      if (size - 1 == kSmall) index_kids(parent, false);
    }
    nodes_[parent].nkids = size;
    resize_kids(parent, size - 1);
    return true;
  }
  uint32_t to = static_cast<uint32_t>(
      std::lower_bound(kids, kids + size - 1, entry, [this](const Kid& a, const Kid& b) { return before(a, b); }) - kids);
  std::memmove(kids + to + 1, kids + to, (size - 1 - to) * sizeof(Kid));
  kids[to] = entry;
  return false;
}


size_t SuffixTree::memory_bytes() const {
  size_t bytes = sizeof(*this) + nodes_.capacity() * sizeof(Node) + free_nodes_.capacity() * sizeof(uint32_t) +
                 kid_arena_.capacity() * sizeof(Kid) + edges_.memory_bytes() +
                 stores_.capacity() * sizeof(Store) + free_stores_.capacity() * sizeof(uint32_t);
  for (const auto& free_list : free_kids_) bytes += sizeof(free_list) + free_list.capacity() * sizeof(uint32_t);
  for (const Store& store : stores_) bytes += store.tokens.capacity() * sizeof(int32_t);
  // unordered_map: a heap node per entry plus the bucket array.
  bytes += seqs_.bucket_count() * sizeof(void*);
  for (const auto& entry : seqs_)
    bytes += sizeof(entry) + 2 * sizeof(void*) +
             (entry.second.frontier.capacity() + entry.second.open.capacity()) * sizeof(uint32_t);
  bytes += (grown_.capacity() + fresh_.capacity()) * sizeof(uint32_t);
  return bytes;
}


}  // namespace speclane
