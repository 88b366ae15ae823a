// Per-device random generators: counter-based Philox4x32-10 with CUDA's state, (seed, offset).
#pragma once

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/util/intrusive_ptr.h>

#include <cstdint>
#include <mutex>
#include <optional>
#include <vector>

namespace supa {

const at::Generator& default_generator(c10::DeviceIndex device);
at::Generator new_generator(c10::DeviceIndex device);

// The Philox counters one operator call owns: its element i reads counter group offset/4 + i/4,
// lane i % 4 (extra words per element from the counter's draw word, see philox.h).
struct PhiloxRange {
  uint64_t seed;
  uint64_t offset;
};

// Reserves the counters of one call over `numel` elements from `generator` (the default generator
// of `device` when absent): its offset advances by numel rounded up to a multiple of 4, as CUDA's
// does, so a sharded call (DTensor) that starts at a shard's offset draws the same numbers.
PhiloxRange reserve_counters(const std::optional<at::Generator>& generator, c10::DeviceIndex device, uint64_t numel);

// For the random operators the fallback still runs on the CPU's kernels: a CPU generator seeded from
// counters reserved as above, so their numbers too depend only on (seed, offset).
at::Generator host_generator_for_call(const std::optional<at::Generator>& generator, c10::DeviceIndex device,
                                      uint64_t numel);

// ---- graph-safe RNG (graph.cpp) ----
// The state a generator shares with its graph-safe copies (graphsafe_get_state), as CUDA's
// CUDAGeneratorState: while a graph captures, calls take counters at an offset within the graph;
// each replay reads the generator's offset at that moment and then advances it past the graph.
struct PhiloxState : c10::intrusive_ptr_target {
  std::mutex mutex;
  uint64_t seed = 0;
  uint64_t offset = 0;
  bool capturing = false;
  uint64_t offset_intragraph = 0;
  uint64_t seed_extragraph = 0;    // what a captured call reads for its seed
  uint64_t offset_extragraph = 0;  // and for the base of its offset
  // The card's copies of those two, which captured kernels read at replay: one-element int64
  // tensors on the generator's card, outside any graph's pool, held while a graph holds the state
  // (as CUDA's generator state keeps them); each replay writes them.
  c10::DeviceIndex device = -1;
  int graphs = 0;
  at::Tensor seed_on_card, offset_on_card;
};
using PhiloxStatePtr = c10::intrusive_ptr<PhiloxState>;

PhiloxStatePtr philox_state_of(const at::Generator& generator);
// A graph holds the state from its capture until it is reset or destroyed.
void register_graph(PhiloxState& state);
void unregister_graph(PhiloxState& state);
void capture_prologue(PhiloxState& state);
uint64_t capture_epilogue(PhiloxState& state);  // the whole graph's offset increment
void replay_prologue(PhiloxState& state, uint64_t wholegraph_increment);

// A call's counters taken while capturing: replay gives the call the same place in the graph.
struct CapturedDraw {
  PhiloxStatePtr state;
  uint64_t offset_intragraph;
};
// The draws the calling thread took since the last call of this (the graph records them with the call).
std::vector<CapturedDraw> take_captured_draws();
// While alive, reserve_counters on this thread hands out `draws` in order (replay of one call).
class ReplayedDraws {
 public:
  explicit ReplayedDraws(const std::vector<CapturedDraw>& draws);
  ~ReplayedDraws();
  ReplayedDraws(const ReplayedDraws&) = delete;
  ReplayedDraws& operator=(const ReplayedDraws&) = delete;
};

}  // namespace supa
