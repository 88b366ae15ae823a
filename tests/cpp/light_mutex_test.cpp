// The allocator's light mutex (supa_emu/csrc/runtime/light_mutex.h), built alone: it excludes,
// hands over to sleeping threads and meets Lockable. Prints "ok NAME" or "FAIL NAME: why" per case.
#include "light_mutex.h"

#include <chrono>
#include <cstdio>
#include <mutex>
#include <thread>
#include <vector>

namespace {

bool g_failed = false;

void report(const char* name, bool ok, const char* why) {
  std::printf(ok ? "ok %s\n" : "FAIL %s: %s\n", name, why);
  g_failed = g_failed || !ok;
}

// Threads add to a plain counter under the lock, each some holding it across a sleep so that the
// others find it held and sleep on it: every increment lands, and every sleeper wakes.
void excludes_and_wakes_sleepers() {
  supa::LightMutex mutex;
  long counter = 0;
  int inside = 0, overlaps = 0;
  constexpr int kThreads = 6, kRounds = 20000;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kRounds; ++i) {
        std::lock_guard<supa::LightMutex> lock(mutex);
        overlaps += inside++ != 0;
        counter = counter + 1;
        if (i % 4000 == t) {
          std::this_thread::sleep_for(std::chrono::milliseconds(2));
        }
        --inside;
      }
    });
  }
  for (auto& thread : threads) {
    thread.join();
  }
  report("excludes_and_wakes_sleepers", counter == long{kThreads} * kRounds && overlaps == 0,
         "increments lost or two holders at once");
}

// try_lock fails while another thread holds it and succeeds once it is let go; unique_lock takes it.
void try_lock_and_unique_lock() {
  supa::LightMutex mutex;
  std::unique_lock<supa::LightMutex> held(mutex);
  bool taken_while_held = true;
  std::thread([&] { taken_while_held = mutex.try_lock(); }).join();
  held.unlock();
  bool taken_after = false;
  std::thread([&] {
    taken_after = mutex.try_lock();
    if (taken_after) {
      mutex.unlock();
    }
  }).join();
  report("try_lock_and_unique_lock", !taken_while_held && taken_after, "try_lock ignored the holder or the release");
}

}  // namespace

int main() {
  excludes_and_wakes_sleepers();
  try_lock_and_unique_lock();
  return g_failed ? 1 : 0;
}
