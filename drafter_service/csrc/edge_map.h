// Open-addressing hash map from a 64-bit key to a uint32 value: (parent node,
// first token) -> child node for the root and other nodes with many children,
// and n-gram hash -> start for the n-gram index. Linear probing with
// backward-shift deletion: no tombstones, so the table never fills with dead
// slots. Key and value share a slot, so a lookup touches one cache line.
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
    if (slots_.empty()) return kNone;
    for (size_t slot = home(k);; slot = (slot + 1) & mask_) {
      if (slots_[slot].key == k) return slots_[slot].value;
      if (slots_[slot].key == kEmpty) return kNone;
    }
  }

  void set(uint64_t k, uint32_t value) {
    if ((size_ + 1) * 4 > slots_.size() * 3) grow();
    size_t slot = home(k);
    while (slots_[slot].key != kEmpty && slots_[slot].key != k) slot = (slot + 1) & mask_;
    if (slots_[slot].key == kEmpty) ++size_;
    slots_[slot] = Slot{k, value};
  }

  void erase(uint64_t k) {
    if (slots_.empty()) return;
    size_t slot = home(k);
    while (slots_[slot].key != k) {
      if (slots_[slot].key == kEmpty) return;
      slot = (slot + 1) & mask_;
    }
    // Shift later members of the probe run back so lookups never stop early.
    for (size_t next = (slot + 1) & mask_; slots_[next].key != kEmpty; next = (next + 1) & mask_) {
      size_t want = home(slots_[next].key);
      bool movable = (next > slot) ? (want <= slot || want > next) : (want <= slot && want > next);
      if (movable) {
        slots_[slot] = slots_[next];
        slot = next;
      }
    }
    slots_[slot].key = kEmpty;
    --size_;
  }

  size_t memory_bytes() const { return slots_.capacity() * sizeof(Slot); }

 private:
  static constexpr uint64_t kEmpty = ~0ull;
  struct Slot {
    uint64_t key;
    uint32_t value;
  };

  size_t home(uint64_t k) const {
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdull;
    k ^= k >> 33;
    return static_cast<size_t>(k) & mask_;
  }

  void grow() {
    std::vector<Slot> old = std::move(slots_);
    size_t capacity = old.empty() ? 64 : old.size() * 2;
    slots_.assign(capacity, Slot{kEmpty, 0});
    mask_ = capacity - 1;
    size_ = 0;
    for (const Slot& slot : old)
      if (slot.key != kEmpty) set(slot.key, slot.value);
  }

  std::vector<Slot> slots_;
  size_t mask_ = 0;
  size_t size_ = 0;
};

}  // namespace speclane
