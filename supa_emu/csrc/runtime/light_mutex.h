// A mutex for the allocator's short critical sections (a card's lock, the block table's shards):
// taking and releasing it uncontended is one inline atomic instruction each, where std::mutex goes
// through pthread's out-of-line checks, about sixty instructions a round trip, six round trips per
// small operator. A thread that finds it held sleeps on the word (std::atomic wait, a futex on
// Linux) until the holder, seeing a sleeper, wakes one: the three-state mutex of Drepper's
// "Futexes Are Tricky". Meets Lockable, so std::lock_guard and std::unique_lock take it. Plain C++20
// (tests/cpp/light_mutex_test.cpp builds it alone).
#pragma once

#include <atomic>

namespace supa {

class LightMutex {
 public:
  LightMutex() = default;
  LightMutex(const LightMutex&) = delete;
  LightMutex& operator=(const LightMutex&) = delete;

  void lock() {
    int state = kFree;
    if (!state_.compare_exchange_strong(state, kHeld, std::memory_order_acquire, std::memory_order_relaxed)) {
      lock_contended(state);
    }
  }
  bool try_lock() {
    int state = kFree;
    return state_.compare_exchange_strong(state, kHeld, std::memory_order_acquire, std::memory_order_relaxed);
  }
  void unlock() {
    if (state_.exchange(kFree, std::memory_order_release) == kHeldWithSleepers) {
      state_.notify_one();
    }
  }

 private:
  static constexpr int kFree = 0;
  static constexpr int kHeld = 1;
  static constexpr int kHeldWithSleepers = 2;

  // `state`: what the failed attempt saw. From here on the lock is marked as having sleepers, so
  // that its holder wakes one when it lets go (at worst one wake-up too many).
  [[gnu::noinline]] void lock_contended(int state) {
    if (state != kHeldWithSleepers) {
      state = state_.exchange(kHeldWithSleepers, std::memory_order_acquire);
    }
    while (state != kFree) {
      state_.wait(kHeldWithSleepers, std::memory_order_relaxed);
      state = state_.exchange(kHeldWithSleepers, std::memory_order_acquire);
    }
  }

  std::atomic<int> state_{kFree};
};

}  // namespace supa
