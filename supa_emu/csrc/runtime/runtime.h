// The emulated SUPA runtime: devices, memory, generators and graph capture, shared by the
// PyTorch glue (device guard, hooks, operator registrations) and the Python bindings.
#pragma once

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/Device.h>
#include <c10/core/impl/GPUTrace.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <utility>
#include <vector>
#include <vector>

namespace torch {
struct CapturedTraceback;
}

namespace supa {

constexpr c10::DeviceType kSupa = c10::DeviceType::PrivateUse1;
// The dispatch keys of a supa tensor and of a host (CPU) tensor.
constexpr c10::DispatchKeySet kSupaKeys{c10::DispatchKey::PrivateUse1};
constexpr c10::DispatchKeySet kCpuKeys{c10::DispatchKey::CPU};

// ---- devices (devices.cpp) --------------------------------------------------------------
void init_devices(int count, const std::vector<int64_t>& capacities, bool dtype_demotion);
int device_count() noexcept;
bool dtype_demotion_enabled();
c10::DeviceIndex current_device();
// Checked: raises the runtime's invalid-device error for an index outside [0, count).
void set_device(c10::DeviceIndex index);
void check_device_index(c10::DeviceIndex index);
// Makes `index` current and returns the previous device; a negative index changes nothing
// and returns -1 (the convention of torch.cuda._exchange_device).
c10::DeviceIndex exchange_device(c10::DeviceIndex index);
void register_hooks();  // hooks.cpp

// ---- PyTorch's GPU trace --------------------------------------------------------------------
// Once a tool turns the trace on (the stream sanitizer, or a callback registered for what only the
// native runtime sees), the device guard and the allocator report to `torch.supa._gpu_trace`, as
// CUDA's do; until then this is one load of a flag.
inline const c10::impl::PyInterpreter* gpu_trace() {
  return c10::impl::GPUTrace::get_trace();
}
// Held around a report: a Python error pending on this thread (an operator's error being raised
// while its temporaries are freed) survives the callbacks instead of becoming a SystemError.
// Defined with the bindings (module.cpp), the one file that includes Python.
class PendingPythonErrorKept {
 public:
  PendingPythonErrorKept();
  ~PendingPythonErrorKept();
  PendingPythonErrorKept(const PendingPythonErrorKept&) = delete;
  PendingPythonErrorKept& operator=(const PendingPythonErrorKept&) = delete;

 private:
  bool held_ = false;
  int gil_state_ = 0;
  void* error_[3] = {nullptr, nullptr, nullptr};
};
// Runs `report(trace)` when the trace is on, keeping a pending Python error: every report to the
// GPU trace goes through here.
template <typename Report>
void report_to_gpu_trace(Report&& report) {
  if (const auto* trace = gpu_trace()) {
    PendingPythonErrorKept keep;
    report(*trace);
  }
}

// ---- streams (device_guard.cpp) -----------------------------------------------------------
// A stream's priority is encoded in its id (as CUDA encodes it), so no table is kept.
int stream_priority(c10::StreamId id);

// ---- memory (caching_allocator.cpp) -------------------------------------------------------
constexpr size_t kMemoryAlignment = 64;  // of device blocks and pinned host memory
void init_memory(const std::vector<int64_t>& capacities);
c10::DeviceAllocator* device_allocator();
// A block of `device`'s pool (counted as allocated) and the deleter that gives it back.
void* allocate_block(size_t nbytes, c10::DeviceIndex device);
void free_block(void* ptr);
void delete_device_ptr(void* ptr);  // free_block, accepting nullptr
// From now on block hand-outs and returns reach the GPU trace (when it is on).
void report_blocks_to_gpu_trace();
// Device of a pointer handed out by the device allocator, or -1.
c10::DeviceIndex device_of_ptr(const void* ptr);
// A block of the caching allocator, looked up by its start (see memcheck.cpp).
struct LiveBlock {
  bool allocated;
  size_t requested;  // the bytes asked for, what an operand may reach
};
std::optional<LiveBlock> live_block(const void* ptr);
void set_memory_fraction(double fraction, c10::DeviceIndex device);
double get_memory_fraction(c10::DeviceIndex device);
// roundup_power2_divisions has one entry per power-of-two interval from 1 MiB (the last is open).
constexpr size_t kRoundUpIntervals = 16;
// The allocator settings that change accounting; max_split_size < 0 means unlimited.
void set_allocator_knobs(int64_t max_split_size, double gc_threshold, const std::vector<int64_t>& divisions);
int64_t capacity(c10::DeviceIndex device);
std::vector<std::vector<std::pair<std::string, int64_t>>> segment_snapshot(c10::DeviceIndex device);
void* raw_alloc(size_t nbytes, c10::DeviceIndex device);
void raw_delete(void* ptr);
// Grow or shrink a supa storage in place (keeps the common prefix of the bytes).
void resize_storage_bytes(c10::StorageImpl* storage, size_t nbytes);

// ---- pinned host memory (pinned_host_allocator.cpp) ------------------------------------------
c10::Allocator* host_allocator();
bool is_pinned_ptr(const void* ptr);

// ---- host allocations routed to a device pool (host_routing_allocator.cpp) ------------------
// While alive on a thread, host (CPU) allocations of that thread come from the given
// device's pool. The operator fallback uses it so that the outputs CPU kernels allocate
// already live in device memory and can be handed back without a copy.
class DeviceOutputScope {
 public:
  explicit DeviceOutputScope(c10::DeviceIndex device);
  ~DeviceOutputScope();
  DeviceOutputScope(const DeviceOutputScope&) = delete;
  DeviceOutputScope& operator=(const DeviceOutputScope&) = delete;

 private:
  c10::DeviceIndex previous_;
};
// Makes `device` current for the kernel and restores the previous one; does nothing when it is
// current already (the common case), which saves the guard-registry lookups of c10::DeviceGuard.
class CurrentDeviceScope {
 public:
  explicit CurrentDeviceScope(c10::DeviceIndex device) : previous_(current_device()) {
    if (device != previous_) {
      set_device(device);
    } else {
      previous_ = -1;
    }
  }
  ~CurrentDeviceScope() {
    if (previous_ >= 0) {
      set_device(previous_);
    }
  }
  CurrentDeviceScope(const CurrentDeviceScope&) = delete;
  CurrentDeviceScope& operator=(const CurrentDeviceScope&) = delete;

 private:
  c10::DeviceIndex previous_;
};
void install_host_routing_allocator();
// Moves the memory of a host storage into a device DataPtr when that memory came from
// `device`'s pool; returns an empty DataPtr (and leaves the storage alone) otherwise.
c10::DataPtr take_device_block(c10::StorageImpl* host_storage, c10::DeviceIndex device);

// ---- memory shared with other processes (ipc_memory.cpp) -----------------------------------
struct SharedBlock {
  int fd;         // names the block to a receiver; owned by the storage (-1 for an empty one)
  size_t nbytes;
};
// Moves the storage's memory into a shared block (the first time) and counts one more
// pending reference, which the receiver takes over (or releases when it maps the block already).
SharedBlock export_storage(const c10::Storage& storage);
// Maps the block behind `fd` (not taken over) as a non-resizable storage on `device`.
c10::Storage import_storage(int fd, size_t nbytes, c10::DeviceIndex device);
void release_pending_reference(const c10::Storage& storage);
bool is_shared_storage(const c10::Storage& storage);
// Frees the blocks whose sender storage and receivers are all gone; returns how many.
size_t collect_shared_blocks();
// ---- memory pools (mem_pool.cpp) ---------------------------------------------------------
c10::MempoolId_t new_graph_pool_id();  // (n, 0)
c10::MempoolId_t new_user_pool_id();   // (0, n)
// use_mem_pool: this thread's allocations on `device` go to `pool` until the matching end.
void begin_allocate_to_pool(c10::DeviceIndex device, c10::MempoolId_t pool);
void end_allocate_to_pool(c10::DeviceIndex device, c10::MempoolId_t pool);
// While a graph captures, every allocation goes to its pool; {0, 0} when capture ends.
void set_capture_pool(c10::MempoolId_t pool);
// The pool an allocation on `device` made now by this thread belongs to ({0, 0}: general).
c10::MempoolId_t allocation_pool(c10::DeviceIndex device);
// Holders of a user pool (the MemPool object, each active use_mem_pool); release returns what is left.
void retain_pool(c10::MempoolId_t pool);
int64_t release_pool(c10::MempoolId_t pool);
int64_t pool_use_count(c10::MempoolId_t pool);
// This thread's active pool (MemPoolContext); returns the previous one ({0, 0}: none).
c10::MempoolId_t exchange_active_pool(c10::MempoolId_t pool);
c10::MempoolId_t active_pool();

// ---- allocation history (memory_history.cpp) ----------------------------------------------
struct MemoryEvent {
  std::string action;  // alloc, free_requested, free_completed, segment_alloc, segment_free, oom
  c10::DeviceIndex device;
  int64_t addr;
  int64_t size;
  int64_t time_us;
  std::shared_ptr<torch::CapturedTraceback> stack;  // null when stacks are not recorded
};
void set_memory_history(bool trace, bool stacks, bool cpp_stacks, size_t max_entries);
// The caller's stack when stacks are recorded, else null. Call without allocator locks held.
std::shared_ptr<torch::CapturedTraceback> memory_event_stack();
void record_memory_event(const char* action, c10::DeviceIndex device, const void* ptr, size_t size,
                         const std::shared_ptr<torch::CapturedTraceback>& stack);
std::vector<MemoryEvent> memory_events();
// The stack recorded when the live block at `ptr` was allocated, or null.
std::shared_ptr<torch::CapturedTraceback> block_stack(const void* ptr);

// ---- tensors living on both sides (host_alias.cpp) ----------------------------------------
// A CPU tensor over a supa tensor's memory: same sizes, strides and offset, no copy.
at::Tensor host_view(const at::Tensor& device_tensor);
// ---- bccl's hot collectives (collective_operands.cpp) --------------------------------------
// Flat CPU views when the operands are dense contiguous supa tensors that fit the collective;
// nothing otherwise.
std::optional<at::Tensor> all_reduce_operand(const at::Tensor& tensor);
// A flat CPU tensor over `numel` elements of contiguous `t`, from element `offset` (t's memory if
// t is a CPU tensor, its host alias if a supa tensor). Built directly: narrow() and view() go
// through the dispatcher and autograd's view tracking, which cost more than the rest of a
// collective's launch.
at::Tensor flat_host_slice(const at::Tensor& t, int64_t offset, int64_t numel);
// Fills contiguous CPU `into` with copies of contiguous CPU `source`, one after another (memcpy).
void copy_rows(at::Tensor& into, const at::Tensor& source);
std::optional<std::pair<at::Tensor, at::Tensor>> pair_operands(const at::Tensor& output, const at::Tensor& input,
                                                               int64_t group_size, bool gather);

// A supa tensor over `device_storage` with the geometry of `like`.
at::Tensor device_tensor_on(const c10::Storage& device_storage, const at::Tensor& like);
// Turns a CPU result into a supa tensor: takes over its memory when it came from the
// device pool (DeviceOutputScope), copies it otherwise.
// `holders` is how many references to its storage the caller knows of (the storage can be
// taken over only when nothing else holds it).
at::Tensor adopt_host_result(const at::Tensor& cpu, c10::DeviceIndex device, size_t holders = 1);
// A CPU storage over a supa storage's memory (zero copy). While it is alive it keeps the
// supa storage alive. It is resizable: a CPU kernel that grows it gets fresh memory, which
// the operator fallback then moves back into the supa storage.
c10::Storage host_alias_storage(const c10::Storage& device_storage);
at::Tensor tensor_over(const c10::Storage& storage, c10::DispatchKeySet keys, const at::Tensor& like);
// The same with its own geometry (dtype, conjugation and negation still `like`'s).
at::Tensor tensor_over(const c10::Storage& storage, c10::DispatchKeySet keys, const at::Tensor& like,
                       c10::IntArrayRef sizes, c10::IntArrayRef strides, int64_t storage_offset);
// A sparse (COO or compressed) tensor like `sparse` on `device` (CPU or supa), whose index
// and value tensors are `convert` applied to those of `sparse`: how sparse operands and
// results cross between the two sides without copies.
at::Tensor sparse_over(const at::Tensor& sparse, c10::Device device,
                       const std::function<at::Tensor(const at::Tensor&)>& convert);

// ---- generators (generator.cpp) -----------------------------------------------------------
const at::Generator& default_generator(c10::DeviceIndex device);
at::Generator new_generator(c10::DeviceIndex device);
// The CPU generator that backs a supa generator; CPU kernels draw from it.
at::Generator host_generator_of(const at::Generator& supa_generator);

// ---- graph capture (graph.cpp) ------------------------------------------------------------
bool is_capturing();
// Called by kernels while capturing: remembers the call so that replay can run it again.
void record_call(const c10::OperatorHandle& op, const std::vector<c10::IValue>& inputs,
                 const std::vector<c10::IValue>& outputs);
void register_graph_impl();

// ---- device strings (device_strings.cpp) --------------------------------------------------
// While enabled, device strings parsed from Python that start with "cuda" mean "supa".
void set_cuda_means_supa(bool enabled);
bool cuda_means_supa();

// ---- operators (fallback.cpp) -------------------------------------------------------------
void route_composite_ops_to_cpu_kernels();
// The boxed fallback: runs the op's CPU kernel on CPU views of its supa operands (zero
// copy) and hands the results back as supa tensors. Usable as any op's supa kernel.
void run_cpu_kernel(const c10::OperatorHandle& op, torch::jit::Stack* stack);
// The same call machinery (placement checks, host views, results into device memory), but
// `kernel` runs on the host operands instead of the op's CPU kernel: for ops that have no
// CPU kernel because PyTorch only calls them for GPUs.
using HostKernel = void (*)(const c10::OperatorHandle& op, torch::jit::Stack* stack);
void run_host_kernel(const c10::OperatorHandle& op, torch::jit::Stack* stack, HostKernel kernel);
// For host kernels: an optional tensor argument (undefined when None), and the step that
// replaces the `num_args` arguments on the stack with the kernel's results.
inline at::Tensor optional_tensor(const c10::IValue& value) {
  return value.isNone() ? at::Tensor() : value.toTensor();
}
inline void push_results(torch::jit::Stack* stack, size_t num_args, std::initializer_list<at::Tensor> results) {
  torch::jit::drop(*stack, num_args);
  for (const at::Tensor& t : results) {
    stack->emplace_back(t);
  }
}

// The memory checker (memcheck.cpp). A fault names the operand (index into reads, then writes).
struct MemcheckFault {
  enum Kind { kNone = 0, kOutOfBounds, kFreed, kUninitialized };
  Kind kind = kNone;
  int64_t operand = -1;
  int64_t lo = 0, hi = 0;  // the operand's byte extent from its storage's start
  int64_t live = 0;        // bytes of the live allocation
  uintptr_t base = 0;
  int64_t first_unwritten = -1;
  std::shared_ptr<torch::CapturedTraceback> site;  // where an uninitialised block was allocated
};
void memcheck_set_enabled(bool enabled);
MemcheckFault memcheck_operands(const std::vector<at::Tensor>& reads, const std::vector<at::Tensor>& writes);
void memcheck_written(const std::vector<at::Tensor>& tensors);
void memcheck_uninitialized(const at::Tensor& t);
void memcheck_resized(const void* old_ptr, const void* new_ptr, size_t keep, size_t nbytes);
void memcheck_block_freed(const void* ptr);
size_t memcheck_tracked_blocks();

}  // namespace supa
