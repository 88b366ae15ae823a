// Per-device random generators, counter-based as a card's are: the state is a Philox key (the
// seed) and a counter offset, laid out as CUDA's (get_state is 8 bytes of seed and 8 of offset).
// Random operators reserve counters with reserve_counters and compute their numbers from
// (seed, offset) alone (aten/random_ops.cpp), so saving the state, forking it or moving the
// offset (DTensor's RNG tracker does) reproduces exactly what a call draws.
#include "generator.h"

#include "devices.h"
#include "graph.h"
#include "host_alias.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/EmptyTensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <cstring>
#include <deque>

namespace supa {
namespace {

constexpr size_t kSeedBytes = sizeof(uint64_t);
constexpr size_t kOffsetBytes = sizeof(int64_t);

class SupaGenerator final : public c10::GeneratorImpl {
 public:
  SupaGenerator(c10::DeviceIndex device, PhiloxStatePtr state)
      : c10::GeneratorImpl(c10::Device(kSupa, device), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1)),
        state_(std::move(state)) {}

  static c10::DeviceType device_type() {
    return kSupa;
  }
  const PhiloxStatePtr& state() const {
    return state_;
  }

  void set_current_seed(uint64_t seed) override {
    std::lock_guard<std::mutex> lock(state_->mutex);
    if (is_capturing()) {
      TORCH_CHECK(state_->seed == seed, "SUPAGeneratorImpl::set_current_seed can be called during stream capture "
                  "only if new seed is the same as the original seed.");
      return;
    }
    state_->seed = seed;
    state_->offset = 0;
  }
  uint64_t current_seed() const override {
    std::lock_guard<std::mutex> lock(state_->mutex);
    return state_->seed;
  }
  uint64_t seed() override {
    const uint64_t random = c10::detail::getNonDeterministicRandom(/*is_cuda=*/true);
    set_current_seed(random);
    return random;
  }
  // While the generator's state is captured, the offset is the graph's own (its counter range):
  // saving and restoring it there (activation checkpointing's preserve_rng_state) replays the
  // same numbers, as CUDA's generator does.
  void set_offset(uint64_t offset) override {
    TORCH_CHECK(offset % 4 == 0, "offset must be a multiple of 4");
    std::lock_guard<std::mutex> lock(state_->mutex);
    (state_->capturing ? state_->offset_intragraph : state_->offset) = offset;
  }
  uint64_t get_offset() const override {
    std::lock_guard<std::mutex> lock(state_->mutex);
    return state_->capturing ? state_->offset_intragraph : state_->offset;
  }

  void set_state(const c10::TensorImpl& new_state) override {
    at::detail::check_rng_state(new_state);
    const auto size = static_cast<size_t>(new_state.numel());
    // A state of only a seed is accepted too, as CUDA's generator does (its offset becomes 0).
    const bool has_offset = size != kSeedBytes;
    TORCH_CHECK(!has_offset || size == kSeedBytes + kOffsetBytes, "RNG state is wrong size");
    const auto* bytes = new_state.data_dtype_initialized<uint8_t>();
    uint64_t seed = 0;
    int64_t offset = 0;
    std::memcpy(&seed, bytes, kSeedBytes);
    if (has_offset) {
      std::memcpy(&offset, bytes + kSeedBytes, kOffsetBytes);
    }
    set_current_seed(seed);
    set_offset(static_cast<uint64_t>(offset));
  }
  c10::intrusive_ptr<c10::TensorImpl> get_state() const override {
    auto state = at::detail::empty_cpu({static_cast<int64_t>(kSeedBytes + kOffsetBytes)}, c10::ScalarType::Byte,
                                       std::nullopt, std::nullopt, std::nullopt, std::nullopt);
    uint64_t seed = 0;
    int64_t offset = 0;
    {
      std::lock_guard<std::mutex> lock(state_->mutex);
      seed = state_->seed;
      offset = static_cast<int64_t>(state_->capturing ? state_->offset_intragraph : state_->offset);
    }
    auto* bytes = state.data_ptr<uint8_t>();
    std::memcpy(bytes, &seed, kSeedBytes);
    std::memcpy(bytes + kSeedBytes, &offset, kOffsetBytes);
    return state.getIntrusivePtr();
  }

  void graphsafe_set_state(const c10::intrusive_ptr<c10::GeneratorImpl>& new_state) override {
    auto* other = dynamic_cast<SupaGenerator*>(new_state.get());
    TORCH_CHECK(other != nullptr, "Expected a SUPA Generator");
    state_ = other->state_;
  }
  c10::intrusive_ptr<c10::GeneratorImpl> graphsafe_get_state() const override {
    return c10::make_intrusive<SupaGenerator>(device().index(), state_);
  }

 private:
  SupaGenerator* clone_impl() const override {
    auto copy = c10::make_intrusive<PhiloxState>();
    std::lock_guard<std::mutex> lock(state_->mutex);
    copy->seed = state_->seed;
    copy->offset = state_->offset;
    copy->offset_intragraph = state_->offset_intragraph;
    copy->device = state_->device;
    return new SupaGenerator(device().index(), std::move(copy));
  }

  PhiloxStatePtr state_;
};

SupaGenerator* supa_generator(const at::Generator& generator) {
  auto* impl = dynamic_cast<SupaGenerator*>(generator.unsafeGetGeneratorImpl());
  TORCH_CHECK(impl != nullptr, "Expected a '", kSupa, "' device type for generator but found '",
              generator.device().type(), "'");
  return impl;
}

std::mutex g_generators_mutex;
std::deque<at::Generator> g_default_generators;  // deque: references stay valid as it grows

// Draws of the current capture not yet handed to the graph, and the draws a replayed call reads.
thread_local std::vector<CapturedDraw> t_captured_draws;
thread_local const std::vector<CapturedDraw>* t_replayed_draws = nullptr;
thread_local size_t t_next_replayed_draw = 0;

uint64_t mix64(uint64_t x) {  // splitmix64's finaliser
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

}  // namespace

at::Generator new_generator(c10::DeviceIndex device) {
  auto state = c10::make_intrusive<PhiloxState>();
  state->seed = c10::default_rng_seed_val;
  state->device = device;
  return at::make_generator<SupaGenerator>(device, std::move(state));
}

const at::Generator& default_generator(c10::DeviceIndex device) {
  if (device < 0) {
    device = current_device();
  }
  check_device_index(device);
  std::lock_guard<std::mutex> lock(g_generators_mutex);
  while (g_default_generators.size() <= static_cast<size_t>(device)) {
    auto gen = new_generator(static_cast<c10::DeviceIndex>(g_default_generators.size()));
    gen.seed();  // as CUDA's default generators: a fresh seed per process until seeded
    g_default_generators.push_back(std::move(gen));
  }
  return g_default_generators[device];
}

PhiloxStatePtr philox_state_of(const at::Generator& generator) {
  return supa_generator(generator)->state();
}

PhiloxRange reserve_counters(const std::optional<at::Generator>& generator, c10::DeviceIndex device,
                             uint64_t numel) {
  const uint64_t increment = (numel + 3) / 4 * 4;
  if (t_replayed_draws != nullptr) {
    TORCH_INTERNAL_ASSERT(t_next_replayed_draw < t_replayed_draws->size(),
                          "a replayed call draws more often than when it was captured");
    const CapturedDraw& draw = (*t_replayed_draws)[t_next_replayed_draw++];
    std::lock_guard<std::mutex> lock(draw.state->mutex);
    return {draw.state->seed_extragraph, draw.state->offset_extragraph + draw.offset_intragraph};
  }
  PhiloxStatePtr state =
      philox_state_of(generator.has_value() && generator->defined() ? *generator : default_generator(device));
  std::lock_guard<std::mutex> lock(state->mutex);
  if (is_capturing()) {
    TORCH_CHECK(state->capturing, "Attempt to increase offset for a SUPA generator not in capture mode.");
    const uint64_t within = state->offset_intragraph;
    state->offset_intragraph += increment;
    t_captured_draws.push_back({state, within});
    return {state->seed_extragraph, state->offset_extragraph + within};
  }
  TORCH_CHECK(!state->capturing, "Offset increment outside graph capture encountered unexpectedly.");
  const PhiloxRange range{state->seed, state->offset};
  state->offset += increment;
  return range;
}

at::Generator host_generator_for_call(const std::optional<at::Generator>& generator, c10::DeviceIndex device,
                                      uint64_t numel) {
  // The CPU kernel may draw any number of values per element: its own stream per (seed, offset).
  const PhiloxRange range = reserve_counters(generator, device, numel);
  return at::make_generator<at::CPUGeneratorImpl>(mix64(range.seed ^ mix64(range.offset)));
}

namespace {

// Writes the captured kernels' seed and offset into the card's copies (under the state's mutex).
void write_extragraph(PhiloxState& state) {
  if (!state.seed_on_card.defined()) {
    return;
  }
  // Through host views: the runtime's own bookkeeping, not an operator of the program's streams.
  host_view(state.seed_on_card).fill_(static_cast<int64_t>(state.seed_extragraph));
  host_view(state.offset_on_card).fill_(static_cast<int64_t>(state.offset_extragraph));
}

}  // namespace

void register_graph(PhiloxState& state) {
  std::lock_guard<std::mutex> lock(state.mutex);
  if (state.graphs++ == 0) {
    const auto options = at::TensorOptions().dtype(at::kLong).device(kSupa, state.device);
    state.seed_on_card = at::empty({1}, options);
    state.offset_on_card = at::empty({1}, options);
  }
}

void unregister_graph(PhiloxState& state) {
  std::lock_guard<std::mutex> lock(state.mutex);
  if (--state.graphs == 0) {
    state.seed_on_card = at::Tensor();
    state.offset_on_card = at::Tensor();
  }
}

void capture_prologue(PhiloxState& state) {
  std::lock_guard<std::mutex> lock(state.mutex);
  state.capturing = true;
  state.offset_intragraph = 0;
  state.seed_extragraph = state.seed;
  state.offset_extragraph = 0;
}

uint64_t capture_epilogue(PhiloxState& state) {
  std::lock_guard<std::mutex> lock(state.mutex);
  state.capturing = false;
  return state.offset_intragraph;
}

void replay_prologue(PhiloxState& state, uint64_t wholegraph_increment) {
  std::lock_guard<std::mutex> lock(state.mutex);
  state.seed_extragraph = state.seed;
  state.offset_extragraph = state.offset;
  state.offset += wholegraph_increment;
  write_extragraph(state);
}

std::vector<CapturedDraw> take_captured_draws() {
  return std::exchange(t_captured_draws, {});
}

ReplayedDraws::ReplayedDraws(const std::vector<CapturedDraw>& draws) {
  t_replayed_draws = &draws;
  t_next_replayed_draw = 0;
}

ReplayedDraws::~ReplayedDraws() {
  t_replayed_draws = nullptr;
  t_next_replayed_draw = 0;
}

}  // namespace supa
