// Graph capture for `supa`: while a graph captures, every operator call on supa tensors is
// remembered with its operands and results; replay runs the calls again on the same tensors,
// writing into the captured results, which is what a GPU graph replay does.
//
// A call is captured when it runs on the capturing stream: the current stream of its thread on the
// capture's device. Autograd's device thread runs a backward pass on the streams its forward ran
// on, so a captured forward's backward is captured too; work of other streams runs as usual.
//
// Random calls are graph-safe as on CUDA: the graph holds the generators' states (the current
// device's default one and those registered with register_generator_state); a captured call keeps
// its place in the graph's counter range, and each replay starts that range at the generator's
// offset of the moment and advances the generator past it, so replays draw fresh numbers.
#include "graph.h"

#include "caching_allocator.h"
#include "capture_order.h"
#include "device_guard.h"
#include "devices.h"
#include "freed_blocks.h"
#include "generator.h"
#include "host_alias.h"
#include "host_routing_allocator.h"
#include "mem_pool.h"
#include "replay_queue.h"
#include "stream_timeline.h"

#include <ATen/core/GraphImplInterface.h>
#include <c10/core/StreamGuard.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <optional>
#include <unordered_map>

namespace supa {
namespace {

// One launch of the graph: an operator call, or (op empty) time queued on the stream by `_sleep`.
struct RecordedCall {
  std::optional<c10::OperatorHandle> op;
  std::vector<c10::IValue> inputs;
  std::vector<c10::IValue> outputs;
  std::vector<CapturedDraw> draws;  // the counters a random call took, in order
  int64_t stream_work_ns = 0;
};

class SupaGraph;
std::atomic<SupaGraph*> g_capturing{nullptr};
std::mutex g_record_mutex;
thread_local bool t_replaying = false;

// Marks this thread as replaying while the scope lives.
class ReplayScope {
 public:
  ReplayScope() : previous_(t_replaying) {
    t_replaying = true;
  }
  ~ReplayScope() {
    t_replaying = previous_;
  }
  ReplayScope(const ReplayScope&) = delete;
  ReplayScope& operator=(const ReplayScope&) = delete;

 private:
  bool previous_;
};

void write_into(const c10::IValue& captured, const c10::IValue& fresh) {
  if (captured.isTensor() && fresh.isTensor()) {
    const at::Tensor& dst = captured.toTensor();
    const at::Tensor& src = fresh.toTensor();
    if (dst.defined() && src.defined() && !dst.is_same(src)) {
      // Through host views: a replay must not bump the captured tensors' version counters.
      host_view(dst).copy_(host_view(src));
    }
  } else if (captured.isTensorList() && fresh.isTensorList()) {
    auto dst = captured.toTensorList();
    auto src = fresh.toTensorList();
    for (size_t i = 0; i < dst.size() && i < src.size(); ++i) {
      write_into(c10::IValue(dst.get(i)), c10::IValue(src.get(i)));
    }
  }
}

// What a graph holds of the tensors it captured: the memory of those in its own pool by address
// only, as a card's graph does (a tensor freed after capture gives its block back to the pool, and
// a later capture into the pool may reuse it); others by reference, which keeps their memory alive
// (on a card a graph reading freed memory reads garbage; here it could read memory the host took
// back). The graph's pool keeps its segments while the graph lives (pool_in_use).
class CapturedOperands {
 public:
  explicit CapturedOperands(c10::MempoolId_t pool) : pool_(pool) {}

  std::vector<c10::IValue> hold(const std::vector<c10::IValue>& values) {
    std::vector<c10::IValue> held;
    held.reserve(values.size());
    for (const c10::IValue& value : values) {
      held.push_back(hold(value));
    }
    return held;
  }

 private:
  c10::IValue hold(const c10::IValue& value) {
    if (value.isTensor()) {
      return c10::IValue(hold(value.toTensor()));
    }
    if (value.isTensorList()) {
      c10::List<at::Tensor> list = value.toTensorList().copy();
      for (size_t i = 0; i < list.size(); ++i) {
        list.set(i, hold(list.get(i)));
      }
      return c10::IValue(list);
    }
    if (value.isList()) {
      c10::List<c10::IValue> list = value.toList().copy();
      for (size_t i = 0; i < list.size(); ++i) {
        list.set(i, hold(list.get(i)));
      }
      return c10::IValue(list);
    }
    return value;
  }

  at::Tensor hold(const at::Tensor& t) {
    if (!t.defined() || t.device().type() != kSupa || t.layout() != c10::kStrided || !t.has_storage() ||
        t.storage().data() == nullptr || block_pool(t.storage().data()) != std::optional<c10::MempoolId_t>(pool_)) {
      return t;
    }
    c10::StorageImpl* key = t.storage().unsafeGetStorageImpl();
    auto it = by_address_.find(key);
    if (it == by_address_.end()) {
      const c10::Storage& storage = t.storage();
      c10::DataPtr address(const_cast<void*>(storage.data()), t.device());  // no owner: nothing frees it
      it = by_address_
               .emplace(key, c10::Storage(c10::make_intrusive<c10::StorageImpl>(
                                 c10::StorageImpl::use_byte_size_t(), storage.nbytes(), std::move(address),
                                 /*allocator=*/nullptr, /*resizable=*/false)))
               .first;
    }
    return tensor_over(it->second, t.key_set(), t);
  }

  c10::MempoolId_t pool_;
  std::unordered_map<const c10::StorageImpl*, c10::Storage> by_address_;
};

class SupaGraph final : public at::GraphImplInterface {
 public:
  explicit SupaGraph(const at::GraphImplArgs& args) : keep_graph_(args.keep_graph) {}
  ~SupaGraph() override {
    run_queued_replays_in_destructor();  // none may still read this graph's calls
    SupaGraph* self = this;
    if (g_capturing.compare_exchange_strong(self, nullptr)) {
      notify_capture_ended(device_);
      end_generator_capture();
    }
    give_up_pool();
    release_generator_states();
  }

  void capture_begin(c10::MempoolId_t pool, at::GraphCaptureMode /*mode*/) override {
    TORCH_CHECK(g_capturing.load() == nullptr, "another SUPA graph is already capturing");
    TORCH_CHECK(!captured_, "This SUPAGraph instance already owns a captured graph. To capture a new graph, "
                "create a new instance or call reset() first.");
    TORCH_CHECK(current_stream_id(current_device()) != 0,
                "SUPA graphs must be captured on a non-default stream. (However, after capture, it's ok to "
                "replay them on the default stream.)");
    run_queued_replays();  // a capture starts after the launched work (it may reuse its pool's blocks)
    give_up_pool();
    pool_ = (pool.first != 0 || pool.second != 0) ? pool : new_graph_pool_id();
    retain_pool(pool_);  // its segments stay while a graph may replay into them
    holds_pool_ = true;
    device_ = current_device();
    notify_capture_begin(device_, current_stream_id(device_));  // the capture's stream order starts
    calls_.clear();
    invalidated_ = false;
    add_generator_state(philox_state_of(default_generator(current_device())));
    for (auto& [state, increment] : generator_states_) {
      capture_prologue(*state);
    }
    take_captured_draws();
    g_capturing.store(this, std::memory_order_release);
  }
  void capture_end() override {
    TORCH_CHECK(g_capturing.load() == this, "capture_end() called on a graph that is not capturing");
    g_capturing = nullptr;
    notify_capture_ended(device_);
    end_generator_capture();
    if (invalidated_) {
      calls_.clear();
      TORCH_CHECK(false, "SUPA error: operation failed due to a previous error during capture");
    }
    captured_ = true;
    draws_ = std::any_of(calls_.begin(), calls_.end(), [](const RecordedCall& call) { return !call.draws.empty(); });
    if (calls_.empty()) {
      TORCH_WARN("The SUPA Graph is empty. This usually means that the graph was attempted to be captured on "
                 "wrong device or stream.");
    }
    if (!keep_graph_) {
      instantiate();
    }
  }
  void instantiate() override {
    TORCH_CHECK(captured_, "capture_end() must have been called before calling instantiate");
    TORCH_CHECK(!instantiated_ || keep_graph_,
                "instantiate() is intended to be called by the user only when keep_graph=true");
    instantiated_ = true;
  }
  void replay() override {
    TORCH_CHECK(captured_, "Called SUPAGraph::replay without a preceding successful capture.");
    if (!instantiated_) {
      instantiate();  // keep_graph=True and not instantiated yet: the first replay does it, as on CUDA
    }
    const c10::StreamId stream = current_stream_id(device_);
    const bool queued = g_capturing.load() == nullptr && !draws_ &&
                        (replays_pending() || stream_ready_ns(device_, stream) > now_ns());
    if (!queued) {
      run_queued_replays();  // launched before this one
    }
    {
      // The launch itself observes nothing: the generator offsets it writes are read by random
      // kernels only, whose graphs run at launch.
      RunningReplaysScope launching;
      for (auto& [state, increment] : generator_states_) {
        replay_prologue(*state, increment);
      }
      // A replay launches on the current stream (the stream replay() is called on), as on a card:
      // its `_sleep`s queue their time there now.
      for (const auto& call : calls_) {
        if (!call.op) {
          queue_stream_work(device_, stream, call.stream_work_ns);
        }
      }
    }
    if (queued) {
      queue_replay(device_, stream, queued_replay(stream));  // runs alongside the other streams' replays
      return;
    }
    RunningReplaysScope no_draining;  // this replay's own kernels run the queued ones no earlier
    ReplayScope replaying;
    // One replay at a time: the recorded stacks are shared, and a card runs a graph's launches in order.
    std::lock_guard<std::mutex> lock(replay_mutex_);
    for (size_t i = 0; i < calls_.size(); ++i) {
      run_launch(i);
    }
  }
  // Runs launch `i` of the graph if it is a kernel (a `_sleep` queued its time at launch).
  void run_launch(size_t i) {
    const RecordedCall& call = calls_[i];
    if (!call.op) {
      return;
    }
    std::vector<c10::IValue> stack = with_own_lists(call.inputs);
    std::optional<ReplayedDraws> draws;
    if (!call.draws.empty()) {
      draws.emplace(call.draws);
    }
    call.op->redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), &stack);
    for (size_t j = 0; j < call.outputs.size() && j < stack.size(); ++j) {
      write_into(call.outputs[j], stack[j]);
    }
  }
  c10::DeviceIndex device() const {
    return device_;
  }
  size_t launches() const {
    return calls_.size();
  }
  std::mutex& replay_mutex() {
    return replay_mutex_;
  }
  void reset() override {
    run_queued_replays();  // none may still read the calls
    calls_.clear();
    captured_ = false;
    instantiated_ = false;
    give_up_pool();
    release_generator_states();
  }
  c10::MempoolId_t pool() const override {
    return pool_;
  }
  void enable_debug_mode() override {}
  void debug_dump(const std::string& /*path*/) override {
    TORCH_WARN("supa_emu: debug_dump has nothing to write; the emulated graph has ", calls_.size(),
               " recorded operator calls");
  }

  void record(const c10::OperatorHandle& op, const std::vector<c10::IValue>& inputs,
              const std::vector<c10::IValue>& outputs) {
    std::vector<CapturedDraw> draws = take_captured_draws();
    CapturedOperands held(pool_);
    std::vector<c10::IValue> held_inputs = held.hold(inputs);
    std::vector<c10::IValue> held_outputs = held.hold(outputs);
    std::lock_guard<std::mutex> lock(g_record_mutex);
    calls_.push_back({op, std::move(held_inputs), std::move(held_outputs), std::move(draws)});
  }
  void record_stream_work(int64_t ns) {
    std::lock_guard<std::mutex> lock(g_record_mutex);
    calls_.push_back({std::nullopt, {}, {}, {}, ns});
  }

  bool captures_current_stream() const {
    return captures(device_, current_stream_id(device_));
  }
  bool captures(c10::DeviceIndex device, c10::StreamId stream) const {
    return device == device_ && capture_order_joined(device, stream);
  }

  void invalidate() {
    invalidated_ = true;
  }

  // A generator whose state the graph keeps graph-safe; joining during capture starts its capture.
  void add_generator_state(const PhiloxStatePtr& state) {
    for (const auto& known : generator_states_) {
      if (known.first.get() == state.get()) {
        return;
      }
    }
    generator_states_.emplace_back(state, 0);
    register_graph(*state);
    if (g_capturing.load() == this) {
      capture_prologue(*state);
    }
  }

 private:
  std::unique_ptr<QueuedReplay> queued_replay(c10::StreamId stream);

  static void run_queued_replays_in_destructor() noexcept {
    try {
      run_queued_replays();
    } catch (const std::exception& e) {
      TORCH_WARN("a queued SUPA graph replay failed: ", e.what());
    }
  }

  void release_generator_states() {
    for (auto& [state, increment] : generator_states_) {
      unregister_graph(*state);
    }
    generator_states_.clear();
  }

  void give_up_pool() {
    if (holds_pool_) {
      holds_pool_ = false;
      if (release_pool(pool_) == 0) {
        // No graph replays into the pool any more: its free blocks serve no one else; its live
        // blocks return to it when freed, and empty_cache() then gives them back.
        device_allocator()->emptyCache(pool_);
      }
    }
  }

  void end_generator_capture() {
    for (auto& [state, increment] : generator_states_) {
      increment = capture_epilogue(*state);
    }
  }

  std::vector<RecordedCall> calls_;
  std::vector<std::pair<PhiloxStatePtr, uint64_t>> generator_states_;  // state, offset increment per replay
  c10::MempoolId_t pool_{0, 0};
  c10::DeviceIndex device_ = 0;  // the capture's; its streams are capture_order.h's
  bool keep_graph_;
  bool holds_pool_ = false;
  bool captured_ = false;
  bool instantiated_ = false;
  bool draws_ = false;  // a call draws random numbers: replays run at launch, when their offsets are set
  std::atomic<bool> invalidated_{false};
  std::mutex replay_mutex_;
};

// A replay queued on a busy stream: runs the graph's kernels one per call.
class GraphReplay final : public QueuedReplay {
 public:
  GraphReplay(SupaGraph* graph, c10::StreamId stream) : graph_(graph), stream_(stream) {}
  bool run_next() override {
    if (next_ >= graph_->launches()) {
      return false;
    }
    ReplayScope replaying;
    // On the stream it was launched on, whichever thread runs it,
    c10::StreamGuard on_stream(c10::Stream(c10::Stream::UNSAFE, c10::Device(kSupa, graph_->device()), stream_));
    DeviceOutputScope top_level(-1);  // from within whichever kernel observed first
    std::lock_guard<std::mutex> lock(graph_->replay_mutex());
    graph_->run_launch(next_++);
    return true;
  }

 private:
  SupaGraph* graph_;  // lives until its queued replays ran: its reset and deletion run them first
  c10::StreamId stream_;
  size_t next_ = 0;
};

std::unique_ptr<QueuedReplay> SupaGraph::queued_replay(c10::StreamId stream) {
  return std::make_unique<GraphReplay>(this, stream);
}

}  // namespace

std::vector<c10::IValue> with_own_lists(c10::ArrayRef<c10::IValue> arguments) {
  std::vector<c10::IValue> copy;
  copy.reserve(arguments.size());
  for (const c10::IValue& value : arguments) {
    if (value.isTensorList()) {
      copy.emplace_back(value.toTensorList().copy());
    } else if (value.isList()) {
      copy.emplace_back(value.toList().copy());
    } else {
      copy.push_back(value);
    }
  }
  return copy;
}

bool is_capturing() {
  const SupaGraph* graph = g_capturing.load(std::memory_order_acquire);
  return graph != nullptr && graph->captures_current_stream();
}

bool is_stream_captured(c10::DeviceIndex device, c10::StreamId stream) {
  const SupaGraph* graph = g_capturing.load(std::memory_order_acquire);
  return graph != nullptr && graph->captures(device, stream);
}

c10::MempoolId_t capture_pool() {
  const SupaGraph* graph = g_capturing.load(std::memory_order_acquire);
  return graph != nullptr && graph->captures_current_stream() ? graph->pool() : c10::MempoolId_t{0, 0};
}

bool is_replaying() {
  return t_replaying;
}

void record_call(const c10::OperatorHandle& op, const std::vector<c10::IValue>& inputs,
                 const std::vector<c10::IValue>& outputs) {
  if (SupaGraph* graph = g_capturing.load()) {
    graph->record(op, inputs, outputs);
  }
}

void queue_sleep(c10::DeviceIndex device, c10::StreamId stream, int64_t ns) {
  SupaGraph* graph = g_capturing.load();
  if (graph != nullptr && graph->captures(device, stream)) {
    graph->record_stream_work(ns);
  } else {
    queue_stream_work(device, stream, ns);
  }
}

void refuse_during_capture(const std::string& what) {
  if (SupaGraph* graph = g_capturing.load()) {
    graph->invalidate();
  }
  TORCH_CHECK(false, "SUPA error: operation not permitted when stream is capturing (", what,
              "). Capture records the stream's work without running it, so the host cannot wait for it or read "
              "its results.");
}

void register_generator_with_capture(const at::Generator& generator) {
  SupaGraph* graph = g_capturing.load();
  TORCH_CHECK(graph != nullptr, "register_generator_with_capture: no SUPA graph is capturing");
  graph->add_generator_state(philox_state_of(generator));
}

void register_graph_impl() {
  // The registry is keyed by the device type's name, which is "SUPA" once PrivateUse1 is renamed.
  const std::string key = c10::DeviceTypeName(kSupa, /*lower_case=*/false);
  if (!at::GraphImplRegistry()->Has(key)) {
    at::GraphImplRegistry()->Register(
        key, [](at::GraphImplArgs args) -> std::unique_ptr<at::GraphImplInterface> {
          return std::make_unique<SupaGraph>(args);
        });
  }
}

}  // namespace supa
