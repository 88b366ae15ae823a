// DDP's run-time statistics for models on supa: the reducer asks c10d's timer registry for a
// timer of its device type, and without one it logs that time stats are collected only for CPU
// and CUDA and leaves forward/backward/communication times at zero (DDP logging data,
// `_get_ddp_logging_data()`). An emulated card runs every operation synchronously on the host,
// so the host clock at the moment an event is recorded is the moment the card reached it: the
// timer records host timestamps, as the CPU timer does.
#include <torch/csrc/distributed/c10d/reducer_timer.hpp>

namespace supa::bccl {
namespace {

class HostClockTimer : public c10d::Timer {
 public:
  explicit HostClockTimer(c10::Device /*device*/) {}

  std::optional<int64_t> measureDifference(Event start, Event end) override {
    const int64_t started = getTimeRef(start);
    const int64_t ended = getTimeRef(end);
    // An event of this iteration not (yet) recorded, e.g. backward without a sync: no figure.
    if (started == c10d::kUnsetTime || ended == c10d::kUnsetTime || ended < started) {
      return std::nullopt;
    }
    return ended - started;
  }
};

}  // namespace
}  // namespace supa::bccl

namespace c10d {
C10_REGISTER_TYPED_CLASS(TimerRegistry, c10::kPrivateUse1, supa::bccl::HostClockTimer);
}  // namespace c10d
