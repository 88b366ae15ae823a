// The card's BLAS library state, kept as PyTorch keeps cuBLAS's on a GPU: each thread takes a
// handle per device from a pool (given back when the thread ends, so a later thread reuses it),
// and the first BLAS call on a (handle, stream) allocates that pair's workspace through the
// caching allocator, where it stays until the workspaces are cleared. The bias-epilogue path
// (addmm with a bias vector, cuBLASLt on a GPU) keeps a second, smaller workspace per pair.
//
// Backward runs on autograd's device thread on a card, so its BLAS calls use that thread's
// handle; here backward may run on the calling thread (supa/_autograd_threads.py), so any call
// made while autograd executes a graph task uses the device's autograd handle instead. Either way
// a training step holds two workspaces, as on the card.
//
// During a graph replay no workspace is taken: the captured kernels already have theirs.
#include "blas_workspace.h"

#include "caching_allocator.h"
#include "device_guard.h"
#include "devices.h"
#include "graph.h"


#include <map>
#include <mutex>
#include <tuple>
#include <unordered_map>
#include <utility>

namespace torch::autograd {
int get_current_graph_task_id();  // -1 outside a backward (torch/csrc/autograd/graph_task.h)
}  // namespace torch::autograd

namespace supa {
namespace {

constexpr uintptr_t kHandleBase = 0x5B1A0000;  // opaque values, non-zero like a library's pointers
constexpr uintptr_t kHandleStride = 0x100;

// (handle, stream id, Lt?) -> the workspace block.
using WorkspaceKey = std::tuple<uintptr_t, int64_t, bool>;
struct Workspace {
  void* ptr;
  c10::DeviceIndex device;
};

struct BlasState {
  std::mutex mutex;
  size_t workspace_size = 0;
  size_t lt_workspace_size = 0;
  uintptr_t handles_made = 0;
  std::unordered_map<c10::DeviceIndex, std::vector<uintptr_t>> free_handles;
  std::unordered_map<c10::DeviceIndex, uintptr_t> autograd_handles;
  std::map<WorkspaceKey, Workspace> workspaces;
};

// Never destroyed: threads give their handles back while the process exits.
BlasState& state() {
  static auto* s = new BlasState();
  return *s;
}

uintptr_t take_handle(BlasState& s, c10::DeviceIndex device) {
  auto& free = s.free_handles[device];
  if (!free.empty()) {
    const uintptr_t handle = free.back();
    free.pop_back();
    return handle;
  }
  return kHandleBase + ++s.handles_made * kHandleStride;
}

// The handles a thread holds, one per device, returned to the pool when the thread ends.
struct HandleWindow {
  std::unordered_map<c10::DeviceIndex, uintptr_t> handles;
  ~HandleWindow() {
    BlasState& s = state();
    std::lock_guard<std::mutex> lock(s.mutex);
    for (const auto& [device, handle] : handles) {
      s.free_handles[device].push_back(handle);
    }
  }
};
thread_local HandleWindow t_window;

uintptr_t handle_locked(BlasState& s, c10::DeviceIndex device) {
  if (torch::autograd::get_current_graph_task_id() != -1) {
    auto it = s.autograd_handles.find(device);
    if (it == s.autograd_handles.end()) {
      it = s.autograd_handles.emplace(device, take_handle(s, device)).first;
    }
    return it->second;
  }
  auto it = t_window.handles.find(device);
  if (it == t_window.handles.end()) {
    it = t_window.handles.emplace(device, take_handle(s, device)).first;
  }
  return it->second;
}

// Makes sure (handle, stream, lt) has its block; allocated without the lock held, since the
// allocator may gather a Python stack for the memory history.
void ensure(c10::DeviceIndex device, int64_t stream, bool lt) {
  BlasState& s = state();
  WorkspaceKey key;
  size_t size = 0;
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    size = lt ? s.lt_workspace_size : s.workspace_size;
    if (size == 0) {
      return;
    }
    key = WorkspaceKey{handle_locked(s, device), stream, lt};
    if (s.workspaces.count(key) != 0) {
      return;
    }
  }
  void* ptr = allocate_block(size, device);
  bool kept = false;
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    kept = s.workspaces.emplace(key, Workspace{ptr, device}).second;
  }
  if (!kept) {  // another call on this handle and stream got there first
    free_block(ptr);
  }
}

}  // namespace

void set_blas_workspace_sizes(size_t workspace, size_t lt_workspace) {
  BlasState& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  s.workspace_size = workspace;
  s.lt_workspace_size = lt_workspace;
}

uintptr_t current_blas_handle(c10::DeviceIndex device) {
  check_device_index(device);
  BlasState& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  return handle_locked(s, device);
}

void ensure_blas_workspace(c10::DeviceIndex device, bool lt) {
  if (is_replaying()) {
    return;
  }
  const int64_t stream = current_stream_id(device);
  ensure(device, stream, false);
  if (lt) {
    ensure(device, stream, true);
  }
}

void clear_blas_workspaces() {
  BlasState& s = state();
  std::map<WorkspaceKey, Workspace> cleared;
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    cleared.swap(s.workspaces);
  }
  for (const auto& [key, workspace] : cleared) {
    free_block(workspace.ptr);
  }
}

std::vector<BlasWorkspaceInfo> blas_workspaces() {
  BlasState& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  std::vector<BlasWorkspaceInfo> out;
  for (const auto& [key, workspace] : s.workspaces) {
    out.push_back({workspace.ptr, std::get<2>(key) ? "lt_workspace" : "workspace", std::get<0>(key),
                   std::get<1>(key)});
  }
  return out;
}

}  // namespace supa
