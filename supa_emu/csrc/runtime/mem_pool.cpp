// Memory-pool identities and the pool each allocation goes to.
//
// One counter per kind of pool, as PyTorch numbers them: graph pools are (n, 0), user pools
// (MemPool) are (0, n), (0, 0) is a device's general pool. Allocations made inside
// `use_mem_pool` (a per-thread stack) or on a stream that a graph captures (graph.h) carry the
// pool id, and the caching allocator reuses a freed block only
// for a request of the same pool. The core also owns each user pool's use count and the
// thread's active pool (MemPoolContext), so Python holds no copy of either.
#include "mem_pool.h"

#include "devices.h"
#include "graph.h"

#include <atomic>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

namespace supa {
namespace {

std::atomic<c10::CaptureId_t> g_next_graph_pool{1};
std::atomic<c10::CaptureId_t> g_next_user_pool{1};

// The pools this thread's allocations go to, innermost last (kept until the thread exits), read
// through a plain pointer that is null while there are none, so that every allocation's check
// costs no thread-local initialisation.
using PoolStack = std::vector<std::pair<c10::DeviceIndex, c10::MempoolId_t>>;
thread_local PoolStack t_pool_stack_kept;
thread_local PoolStack* t_pool_stack = nullptr;

std::mutex g_use_mutex;
std::map<c10::MempoolId_t, int64_t> g_use_counts;  // live pools -> holders
struct PoolRules {
  bool use_on_oom = false;
  bool no_split = false;
};
std::map<c10::MempoolId_t, PoolRules> g_rules;  // under g_use_mutex; only pools with a rule set
// How many pools have a rule (g_rules' size, stored under g_use_mutex): a card asks about every
// block it splits, and without rules the answer needs no lock.
std::atomic<size_t> g_ruled_pools{0};
thread_local c10::MempoolId_t t_active_pool{0, 0};

}  // namespace

void retain_pool(c10::MempoolId_t pool) {
  std::lock_guard<std::mutex> lock(g_use_mutex);
  ++g_use_counts[pool];
}

int64_t release_pool(c10::MempoolId_t pool) {
  std::lock_guard<std::mutex> lock(g_use_mutex);
  auto it = g_use_counts.find(pool);
  TORCH_CHECK(it != g_use_counts.end(), "supa_emu: pool (", pool.first, ", ", pool.second, ") has no holders");
  const int64_t left = --it->second;
  if (left == 0) {
    g_use_counts.erase(it);
    g_rules.erase(pool);
    g_ruled_pools.store(g_rules.size());
  }
  return left;
}

int64_t pool_use_count(c10::MempoolId_t pool) {
  std::lock_guard<std::mutex> lock(g_use_mutex);
  auto it = g_use_counts.find(pool);
  return it == g_use_counts.end() ? 0 : it->second;
}

void set_pool_rules(c10::MempoolId_t pool, bool use_on_oom, bool no_split) {
  std::lock_guard<std::mutex> lock(g_use_mutex);
  if (use_on_oom || no_split) {
    g_rules[pool] = {use_on_oom, no_split};
  } else {
    g_rules.erase(pool);
  }
  g_ruled_pools.store(g_rules.size());
}

bool pool_use_on_oom(c10::MempoolId_t pool) {
  std::lock_guard<std::mutex> lock(g_use_mutex);
  auto it = g_rules.find(pool);
  return it != g_rules.end() && it->second.use_on_oom;
}

bool pool_no_split(c10::MempoolId_t pool) {
  if (g_ruled_pools.load(std::memory_order_acquire) == 0) {
    return false;
  }
  std::lock_guard<std::mutex> lock(g_use_mutex);
  auto it = g_rules.find(pool);
  return it != g_rules.end() && it->second.no_split;
}

c10::MempoolId_t active_pool() {
  return t_active_pool;
}

c10::MempoolId_t exchange_active_pool(c10::MempoolId_t pool) {
  const c10::MempoolId_t previous = t_active_pool;
  t_active_pool = pool;
  return previous;
}

c10::MempoolId_t new_graph_pool_id() {
  return {g_next_graph_pool++, 0};
}

c10::MempoolId_t new_user_pool_id() {
  return {0, g_next_user_pool++};
}

void begin_allocate_to_pool(c10::DeviceIndex device, c10::MempoolId_t pool) {
  check_device_index(device);
  PoolStack& stack = t_pool_stack_kept;
  stack.emplace_back(device, pool);
  t_pool_stack = &stack;
}

void end_allocate_to_pool(c10::DeviceIndex device, c10::MempoolId_t pool) {
  if (auto* stack = t_pool_stack) {
    for (auto it = stack->rbegin(); it != stack->rend(); ++it) {
      if (it->first == device && it->second == pool) {
        stack->erase(std::next(it).base());
        if (stack->empty()) {
          t_pool_stack = nullptr;
        }
        return;
      }
    }
  }
  TORCH_CHECK(false, "supa_emu: pool (", pool.first, ", ", pool.second,
              ") is not receiving allocations on device ", static_cast<int>(device));
}

c10::MempoolId_t allocation_pool(c10::DeviceIndex device) {
  if (const auto* stack = t_pool_stack) {
    for (auto it = stack->rbegin(); it != stack->rend(); ++it) {
      if (it->first == device) {
        return it->second;
      }
    }
  }
  return capture_pool();
}

}  // namespace supa
