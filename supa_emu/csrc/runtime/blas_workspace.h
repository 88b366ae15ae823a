// The card's BLAS library state: handles and the workspaces it keeps per (handle, stream).
#pragma once

#include <c10/core/Device.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace supa {

// Bytes of one workspace (0: none), and of the extra workspace of the bias-epilogue path (Lt).
void set_blas_workspace_sizes(size_t workspace, size_t lt_workspace);
// This thread's BLAS handle on `device`: one per (thread, device) from a pool that threads give
// back when they end; backward (autograd's device thread on a card) has one of its own per device.
uintptr_t current_blas_handle(c10::DeviceIndex device);
// What a BLAS call on `device` does first: the current (handle, stream) gets its workspace (and,
// for the bias-epilogue path, its Lt workspace) from the caching allocator, once, kept until cleared.
void ensure_blas_workspace(c10::DeviceIndex device, bool lt);
// Frees every workspace (torch.supa's _supa_clearSublasWorkspaces).
void clear_blas_workspaces();
// Live workspaces, for snapshots: start address, kind ("workspace" or "lt_workspace"), handle, stream.
struct BlasWorkspaceInfo {
  const void* ptr;
  std::string kind;
  uintptr_t handle;
  int64_t stream;
};
std::vector<BlasWorkspaceInfo> blas_workspaces();

}  // namespace supa
