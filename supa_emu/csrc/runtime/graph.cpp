// Graph capture for `supa`: while a graph captures, every operator call on supa tensors is
// remembered with its operands and results; replay runs the calls again on the same tensors,
// writing into the captured results, which is what a GPU graph replay does.
//
// Capture is process-wide (CUDA's "global" mode): autograd runs backward passes on its own
// device thread, and those calls belong to the graph too.
//
// Random calls are graph-safe as on CUDA: the graph holds the generators' states (the current
// device's default one and those registered with register_generator_state); a captured call keeps
// its place in the graph's counter range, and each replay starts that range at the generator's
// offset of the moment and advances the generator past it, so replays draw fresh numbers.
#include "graph.h"

#include "caching_allocator.h"
#include "devices.h"
#include "generator.h"
#include "host_alias.h"
#include "mem_pool.h"

#include <ATen/core/GraphImplInterface.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <mutex>
#include <optional>

namespace supa {
namespace {

struct RecordedCall {
  c10::OperatorHandle op;
  std::vector<c10::IValue> inputs;
  std::vector<c10::IValue> outputs;
  std::vector<CapturedDraw> draws;  // the counters a random call took, in order
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

class SupaGraph final : public at::GraphImplInterface {
 public:
  explicit SupaGraph(const at::GraphImplArgs& /*args*/) {}
  ~SupaGraph() override {
    SupaGraph* self = this;
    if (g_capturing.compare_exchange_strong(self, nullptr)) {
      set_capture_pool({0, 0});
      end_generator_capture();
    }
    if (pool_.first != 0 || pool_.second != 0) {
      // The pool's free blocks serve no one else; its live blocks return to it when freed.
      device_allocator()->emptyCache(pool_);
    }
  }

  void capture_begin(c10::MempoolId_t pool, at::GraphCaptureMode /*mode*/) override {
    TORCH_CHECK(g_capturing.load() == nullptr, "another SUPA graph is already capturing");
    TORCH_CHECK(!captured_, "This SUPAGraph instance already owns a captured graph. To capture a new graph, "
                "create a new instance or call reset() first.");
    pool_ = (pool.first != 0 || pool.second != 0) ? pool : new_graph_pool_id();
    calls_.clear();
    add_generator_state(philox_state_of(default_generator(current_device())));
    for (auto& [state, increment] : generator_states_) {
      capture_prologue(*state);
    }
    take_captured_draws();
    set_capture_pool(pool_);
    g_capturing = this;
  }
  void capture_end() override {
    TORCH_CHECK(g_capturing.load() == this, "capture_end() called on a graph that is not capturing");
    set_capture_pool({0, 0});
    g_capturing = nullptr;
    end_generator_capture();
    captured_ = true;
  }
  void instantiate() override {
    TORCH_CHECK(captured_, "instantiate() needs a captured graph");
  }
  void replay() override {
    TORCH_CHECK(captured_, "Called SUPAGraph::replay without a preceding successful capture.");
    for (auto& [state, increment] : generator_states_) {
      replay_prologue(*state, increment);
    }
    ReplayScope replaying;
    for (const auto& call : calls_) {
      std::vector<c10::IValue> stack = call.inputs;
      std::optional<ReplayedDraws> draws;
      if (!call.draws.empty()) {
        draws.emplace(call.draws);
      }
      call.op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), &stack);
      for (size_t i = 0; i < call.outputs.size() && i < stack.size(); ++i) {
        write_into(call.outputs[i], stack[i]);
      }
    }
  }
  void reset() override {
    calls_.clear();
    captured_ = false;
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
    std::lock_guard<std::mutex> lock(g_record_mutex);
    calls_.push_back({op, inputs, outputs, std::move(draws)});
  }

  // A generator whose state the graph keeps graph-safe; joining during capture starts its capture.
  void add_generator_state(const PhiloxStatePtr& state) {
    for (const auto& known : generator_states_) {
      if (known.first.get() == state.get()) {
        return;
      }
    }
    generator_states_.emplace_back(state, 0);
    if (g_capturing.load() == this) {
      capture_prologue(*state);
    }
  }

 private:
  void end_generator_capture() {
    for (auto& [state, increment] : generator_states_) {
      increment = capture_epilogue(*state);
    }
  }

  std::vector<RecordedCall> calls_;
  std::vector<std::pair<PhiloxStatePtr, uint64_t>> generator_states_;  // state, offset increment per replay
  c10::MempoolId_t pool_{0, 0};
  bool captured_ = false;
};

}  // namespace

bool is_capturing() {
  return g_capturing.load(std::memory_order_relaxed) != nullptr;
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
