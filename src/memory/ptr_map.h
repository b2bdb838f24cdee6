// An open-addressing hash map from addresses to pointers: no allocation per
// insert (unlike std::unordered_map), so the pool's hot path stays malloc-free.
// Linear probing with backward-shift deletion; key 0 means empty (the pool never
// hands out address 0). Not thread-safe: the pool's mutex guards it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace mapp::internal {

template <typename V>
class PtrMap {
 public:
  PtrMap() { slots_.resize(64); }

  std::size_t size() const { return size_; }

  V* find(std::uintptr_t key) const {
    for (std::size_t i = hash(key);; i = (i + 1) & mask()) {
      const Slot& s = slots_[i];
      if (s.key == key) return s.value;
      if (s.key == 0) return nullptr;
    }
  }

  // `key` must not be present (see insert_or_assign).
  void insert(std::uintptr_t key, V* value) {
    if (2 * (size_ + 1) > slots_.size()) grow();
    place(key, value);
    ++size_;
  }

  void insert_or_assign(std::uintptr_t key, V* value) {
    for (std::size_t i = hash(key);; i = (i + 1) & mask()) {
      Slot& s = slots_[i];
      if (s.key == key) {
        s.value = value;
        return;
      }
      if (s.key == 0) break;
    }
    insert(key, value);
  }

  bool erase(std::uintptr_t key) {
    std::size_t i = hash(key);
    for (;; i = (i + 1) & mask()) {
      if (slots_[i].key == key) break;
      if (slots_[i].key == 0) return false;
    }
    // Backward shift: move later entries of the probe run into the hole.
    std::size_t hole = i;
    for (std::size_t j = (i + 1) & mask(); slots_[j].key != 0; j = (j + 1) & mask()) {
      const std::size_t home = hash(slots_[j].key);
      const bool movable = ((j - home) & mask()) >= ((j - hole) & mask());
      if (movable) {
        slots_[hole] = slots_[j];
        hole = j;
      }
    }
    slots_[hole] = Slot{};
    --size_;
    return true;
  }

  // True when the next insert of a new key would double the table.
  bool full() const { return 2 * (size_ + 1) > slots_.size(); }

  // Keeps only the entries for which keep(key, value) is true; doubles the
  // table too when that leaves it over a quarter full (so that calling this
  // whenever full() stays amortised O(1) per insert).
  template <typename F>
  void compact_or_grow(F&& keep) {
    std::vector<Slot> old(slots_.size());
    old.swap(slots_);
    size_ = 0;
    for (const Slot& s : old) {
      if (s.key != 0 && keep(s.key, s.value)) {
        place(s.key, s.value);
        ++size_;
      }
    }
    if (4 * size_ > slots_.size()) grow();
  }

  template <typename F>
  void for_each(F&& f) const {
    for (const Slot& s : slots_)
      if (s.key != 0) f(s.key, s.value);
  }

 private:
  struct Slot {
    std::uintptr_t key = 0;
    V* value = nullptr;
  };
  std::size_t mask() const { return slots_.size() - 1; }
  std::size_t hash(std::uintptr_t key) const {
    // Addresses are 512-aligned: mix the high bits down (Fibonacci hashing).
    return static_cast<std::size_t>((key >> 9) * 0x9E3779B97F4A7C15ull >> 20) & mask();
  }
  void place(std::uintptr_t key, V* value) {
    std::size_t i = hash(key);
    while (slots_[i].key != 0) i = (i + 1) & mask();
    slots_[i] = Slot{key, value};
  }
  void grow() {
    std::vector<Slot> old(slots_.size() * 2);
    old.swap(slots_);
    for (const Slot& s : old)
      if (s.key != 0) place(s.key, s.value);
  }
  std::vector<Slot> slots_;
  std::size_t size_ = 0;
};

}  // namespace mapp::internal
