// The facts behind the memory checker (`SUPA_EMU_SANITIZE=memory`, supa_emu/supa/_memcheck.py):
// whether an operand lies inside its storage's live allocation, and which bytes of the blocks
// handed out uninitialised (torch.empty and friends, the new tail of a grown storage) an
// operator or copy has written since.
//
// Bounds come from the caching allocator, which knows every live block and the bytes it was asked
// for; a storage whose memory is not one of its blocks (a shared memfd mapping, a host alias) is
// bounded by its own byte size. Written ranges are kept per tracked block as disjoint intervals,
// dropped when the block is freed (the allocator tells us) or once it is fully written.
#include "memcheck.h"

#include "caching_allocator.h"
#include "devices.h"

#include <torch/csrc/profiler/combined_traceback.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <mutex>
#include <unordered_map>

namespace supa {
namespace {

struct Tracked {
  size_t nbytes;
  std::map<size_t, size_t> written;  // start -> end of the written byte ranges, disjoint
  std::shared_ptr<torch::CapturedTraceback> site;
};

std::atomic<bool> g_enabled{false};
std::atomic<size_t> g_tracked_count{0};
std::mutex g_tracked_mutex;
std::unordered_map<const void*, Tracked> g_tracked;

// [lo, hi) in bytes from the storage's start that a strided tensor can touch.
std::pair<int64_t, int64_t> extent_of(const at::Tensor& t) {
  const int64_t item = static_cast<int64_t>(t.dtype().itemsize());
  int64_t lo = t.storage_offset(), hi = t.storage_offset();
  const auto sizes = t.sizes();
  const auto strides = t.strides();
  for (size_t d = 0; d < sizes.size(); ++d) {
    const int64_t reach = (sizes[d] - 1) * strides[d];
    (reach < 0 ? lo : hi) += reach;
  }
  return {lo * item, (hi + 1) * item};
}

bool checkable(const at::Tensor& t) {
  // A ZeroTensor (autograd's efficient zeros) has no memory and reads none.
  return t.defined() && t.layout() == c10::kStrided && t.device().type() == kSupa && t.has_storage() &&
         t.numel() > 0 && !t._is_zerotensor();
}

void add_written(Tracked& tracked, size_t lo, size_t hi) {
  hi = std::min(hi, tracked.nbytes);
  if (lo >= hi) {
    return;
  }
  auto& w = tracked.written;
  auto it = w.upper_bound(lo);
  if (it != w.begin() && std::prev(it)->second >= lo) {
    --it;
    lo = std::min(lo, it->first);
  }
  while (it != w.end() && it->first <= hi) {
    hi = std::max(hi, it->second);
    it = w.erase(it);
  }
  w.emplace(lo, hi);
}

// The first byte of [lo, hi) that no write covered, or -1.
int64_t first_unwritten(const Tracked& tracked, size_t lo, size_t hi) {
  const auto& w = tracked.written;
  auto it = w.upper_bound(lo);
  if (it == w.begin() || std::prev(it)->second <= lo) {
    return static_cast<int64_t>(lo);
  }
  --it;
  while (it->second < hi) {
    auto next = std::next(it);
    if (next == w.end() || next->first > it->second) {
      return static_cast<int64_t>(it->second);
    }
    it = next;
  }
  return -1;
}

// As first_unwritten, element by element: a strided read whose hull has gaps it never touches.
int64_t first_unwritten_element(const Tracked& tracked, const at::Tensor& t) {
  const int64_t item = static_cast<int64_t>(t.dtype().itemsize());
  const auto sizes = t.sizes();
  const auto strides = t.strides();
  std::vector<int64_t> index(sizes.size(), 0);
  int64_t offset = t.storage_offset();
  while (true) {
    const int64_t found = first_unwritten(tracked, offset * item, (offset + 1) * item);
    if (found >= 0) {
      return found;
    }
    size_t d = sizes.size();
    while (true) {  // the next index, last dimension fastest
      if (d == 0) {
        return -1;
      }
      --d;
      if (++index[d] < sizes[d]) {
        offset += strides[d];
        break;
      }
      offset -= (sizes[d] - 1) * strides[d];
      index[d] = 0;
    }
  }
}

// The tracked block `t` lives in, or g_tracked.end() (the caller holds g_tracked_mutex).
std::unordered_map<const void*, Tracked>::iterator tracked_of(const at::Tensor& t) {
  return checkable(t) ? g_tracked.find(t.storage().unsafeGetStorageImpl()->data()) : g_tracked.end();
}

}  // namespace

void memcheck_set_enabled(bool enabled) {
  g_enabled = enabled;
  if (!enabled) {
    std::lock_guard<std::mutex> lock(g_tracked_mutex);
    g_tracked.clear();
    g_tracked_count = 0;
  }
}

MemcheckFault memcheck_operands(const std::vector<at::Tensor>& reads, const std::vector<at::Tensor>& writes) {
  MemcheckFault fault;
  const size_t total = reads.size() + writes.size();
  for (size_t i = 0; i < total; ++i) {
    const at::Tensor& t = i < reads.size() ? reads[i] : writes[i - reads.size()];
    if (!checkable(t)) {
      continue;
    }
    const auto [lo, hi] = extent_of(t);
    const c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
    const void* base = storage->data();
    int64_t live = static_cast<int64_t>(storage->nbytes());
    bool freed = base == nullptr;
    if (base != nullptr) {
      if (const auto block = live_block(base)) {
        freed = !block->allocated;
        live = freed ? 0 : std::min(live, static_cast<int64_t>(block->requested));
      }
    }
    if (freed || lo < 0 || hi > live) {
      fault.kind = freed ? MemcheckFault::kFreed : MemcheckFault::kOutOfBounds;
      fault.operand = static_cast<int64_t>(i);
      fault.lo = lo;
      fault.hi = hi;
      fault.live = freed ? 0 : live;
      fault.base = reinterpret_cast<uintptr_t>(base);
      return fault;
    }
  }
  if (g_tracked_count.load(std::memory_order_relaxed) == 0) {
    return fault;
  }
  std::lock_guard<std::mutex> lock(g_tracked_mutex);
  for (size_t i = 0; i < reads.size(); ++i) {
    const at::Tensor& t = reads[i];
    const auto it = tracked_of(t);
    if (it == g_tracked.end()) {
      continue;
    }
    const auto [lo, hi] = extent_of(t);
    if (first_unwritten(it->second, lo, hi) < 0) {
      continue;
    }
    const int64_t gap = first_unwritten_element(it->second, t);
    if (gap >= 0) {
      fault.kind = MemcheckFault::kUninitialized;
      fault.operand = static_cast<int64_t>(i);
      fault.lo = lo;
      fault.hi = hi;
      fault.live = static_cast<int64_t>(it->second.nbytes);
      fault.base = reinterpret_cast<uintptr_t>(it->first);
      fault.first_unwritten = gap;
      fault.site = it->second.site;
      return fault;
    }
  }
  return fault;
}

void memcheck_written(const std::vector<at::Tensor>& tensors) {
  if (g_tracked_count.load(std::memory_order_relaxed) == 0) {
    return;
  }
  std::lock_guard<std::mutex> lock(g_tracked_mutex);
  for (const at::Tensor& t : tensors) {
    const auto it = tracked_of(t);
    if (it == g_tracked.end()) {
      continue;
    }
    const auto [lo, hi] = extent_of(t);
    add_written(it->second, static_cast<size_t>(std::max<int64_t>(lo, 0)), static_cast<size_t>(hi));
    const auto& w = it->second.written;
    if (w.size() == 1 && w.begin()->first == 0 && w.begin()->second >= it->second.nbytes) {
      g_tracked.erase(it);  // fully written: nothing left to check
      g_tracked_count = g_tracked.size();
    }
  }
}

void memcheck_uninitialized(const at::Tensor& t) {
  if (!g_enabled.load() || !t.defined() || t.device().type() != kSupa || !t.has_storage()) {
    return;
  }
  const c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
  if (storage->data() == nullptr || storage->nbytes() == 0) {
    return;
  }
  auto site = torch::CapturedTraceback::gather(/*python=*/true, /*script=*/false, /*cpp=*/false);
  std::lock_guard<std::mutex> lock(g_tracked_mutex);
  g_tracked[storage->data()] = Tracked{storage->nbytes(), {}, std::move(site)};
  g_tracked_count = g_tracked.size();
}

void memcheck_resized(const void* old_ptr, const void* new_ptr, size_t keep, size_t nbytes) {
  if (!g_enabled.load() || new_ptr == nullptr || keep >= nbytes) {
    return;  // a shrink keeps only bytes the old block had: what was known of them still holds
  }
  auto site = torch::CapturedTraceback::gather(/*python=*/true, /*script=*/false, /*cpp=*/false);
  std::lock_guard<std::mutex> lock(g_tracked_mutex);
  Tracked grown{nbytes, {}, std::move(site)};
  const auto old = old_ptr == nullptr ? g_tracked.end() : g_tracked.find(old_ptr);
  if (old == g_tracked.end()) {
    add_written(grown, 0, keep);  // the kept prefix is as written as the old block was: fully
  } else {
    for (const auto& [lo, hi] : old->second.written) {
      add_written(grown, lo, std::min(hi, keep));
    }
  }
  g_tracked[new_ptr] = std::move(grown);
  g_tracked_count = g_tracked.size();
}

void memcheck_block_freed(const void* ptr) {
  if (g_tracked_count.load(std::memory_order_relaxed) == 0) {
    return;
  }
  std::lock_guard<std::mutex> lock(g_tracked_mutex);
  g_tracked.erase(ptr);
  g_tracked_count = g_tracked.size();
}

size_t memcheck_tracked_blocks() {
  return g_tracked_count.load();
}

}  // namespace supa
