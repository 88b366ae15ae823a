// Memory-pool identities and the pool each allocation goes to.
#pragma once

#include <c10/core/Allocator.h>
#include <c10/core/Device.h>

#include <cstdint>

namespace supa {

c10::MempoolId_t new_graph_pool_id();  // (n, 0)
c10::MempoolId_t new_user_pool_id();   // (0, n)
// MemPool(use_on_oom=, no_split=): a pool whose cached blocks a request that would otherwise run out
// of memory may take back, and a pool whose blocks are never split (each keeps its whole segment).
void set_pool_rules(c10::MempoolId_t pool, bool use_on_oom, bool no_split);
bool pool_use_on_oom(c10::MempoolId_t pool);
bool pool_no_split(c10::MempoolId_t pool);
// use_mem_pool: this thread's allocations on `device` go to `pool` until the matching end.
void begin_allocate_to_pool(c10::DeviceIndex device, c10::MempoolId_t pool);
void end_allocate_to_pool(c10::DeviceIndex device, c10::MempoolId_t pool);
// The pool an allocation on `device` made now by this thread belongs to ({0, 0}: general).
c10::MempoolId_t allocation_pool(c10::DeviceIndex device);
// Holders of a user pool (the MemPool object, each active use_mem_pool); release returns what is left.
void retain_pool(c10::MempoolId_t pool);
int64_t release_pool(c10::MempoolId_t pool);
int64_t pool_use_count(c10::MempoolId_t pool);
// This thread's active pool (MemPoolContext); returns the previous one ({0, 0}: none).
c10::MempoolId_t exchange_active_pool(c10::MempoolId_t pool);
c10::MempoolId_t active_pool();

}  // namespace supa
