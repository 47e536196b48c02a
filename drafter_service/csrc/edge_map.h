// Open-addressing hash map (parent node, first token) -> child node, for the
// root and other nodes with many children. Linear probing with backward-shift
// deletion: no tombstones, so the table never fills with dead slots.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace speclane {

constexpr uint32_t kNone = 0xFFFFFFFFu;

class EdgeMap {
 public:
  static uint64_t key(uint32_t parent, int32_t token) {
    return (static_cast<uint64_t>(parent) << 32) | static_cast<uint32_t>(token);
  }

  uint32_t find(uint64_t k) const {
    if (keys_.empty()) return kNone;
    for (size_t slot = home(k);; slot = (slot + 1) & mask_) {
      if (keys_[slot] == k) return values_[slot];
      if (keys_[slot] == kEmpty) return kNone;
    }
  }

  void set(uint64_t k, uint32_t value) {
    if ((size_ + 1) * 4 > keys_.size() * 3) grow();
    size_t slot = home(k);
    while (keys_[slot] != kEmpty && keys_[slot] != k) slot = (slot + 1) & mask_;
    if (keys_[slot] == kEmpty) ++size_;
    keys_[slot] = k;
    values_[slot] = value;
  }

  void erase(uint64_t k) {
    if (keys_.empty()) return;
    size_t slot = home(k);
    while (keys_[slot] != k) {
      if (keys_[slot] == kEmpty) return;
      slot = (slot + 1) & mask_;
    }
    // Shift later members of the probe run back so lookups never stop early.
    for (size_t next = (slot + 1) & mask_; keys_[next] != kEmpty; next = (next + 1) & mask_) {
      size_t want = home(keys_[next]);
      bool movable = (next > slot) ? (want <= slot || want > next) : (want <= slot && want > next);
      if (movable) {
        keys_[slot] = keys_[next];
        values_[slot] = values_[next];
        slot = next;
      }
    }
    keys_[slot] = kEmpty;
    --size_;
  }

  size_t memory_bytes() const { return keys_.capacity() * sizeof(uint64_t) + values_.capacity() * sizeof(uint32_t); }

 private:
  static constexpr uint64_t kEmpty = ~0ull;

  size_t home(uint64_t k) const {
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdull;
    k ^= k >> 33;
    return static_cast<size_t>(k) & mask_;
  }

  void grow() {
    std::vector<uint64_t> old_keys = std::move(keys_);
    std::vector<uint32_t> old_values = std::move(values_);
    size_t capacity = old_keys.empty() ? 64 : old_keys.size() * 2;
    keys_.assign(capacity, kEmpty);
    values_.assign(capacity, 0);
    mask_ = capacity - 1;
    size_ = 0;
    for (size_t i = 0; i < old_keys.size(); ++i)
      if (old_keys[i] != kEmpty) set(old_keys[i], old_values[i]);
  }

  std::vector<uint64_t> keys_;
  std::vector<uint32_t> values_;
  size_t mask_ = 0;
  size_t size_ = 0;
};

}  // namespace speclane
