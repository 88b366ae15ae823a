// The operands and the copies of torch.supa.bccl's single-process collectives.
//
// Checking and viewing every card's tensor from Python cost about 8 microseconds a card, and
// each copy between cards a dispatcher round of its own; with 8 cards that was most of a
// 64 KiB all_reduce. The reductions themselves stay on PyTorch's CPU kernels (in Python).
#include "card_operands.h"

#include "../runtime/devices.h"
#include "../runtime/host_alias.h"

#include <cstring>
#include <set>

namespace supa::bccl {
namespace {

bool plain(const at::Tensor& t, c10::ScalarType dtype) {
  return t.defined() && t.device().type() == kSupa && t.layout() == c10::kStrided && t.scalar_type() == dtype &&
         t.is_contiguous();
}

}  // namespace

std::optional<std::pair<std::vector<at::Tensor>, std::vector<at::Tensor>>> card_operands(
    const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& outputs, int64_t input_multiplier,
    int64_t output_multiplier) {
  if (inputs.empty() || !inputs[0].defined() || (!outputs.empty() && outputs.size() != inputs.size()) ||
      output_multiplier <= 0) {
    return std::nullopt;
  }
  const c10::ScalarType dtype = inputs[0].scalar_type();
  const int64_t numel = inputs[0].numel();
  std::set<c10::DeviceIndex> cards;
  std::vector<at::Tensor> input_views, output_views;
  input_views.reserve(inputs.size());
  output_views.reserve(outputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    const at::Tensor& input = inputs[i];
    if (!plain(input, dtype) || input.numel() != numel || !cards.insert(input.device().index()).second) {
      return std::nullopt;
    }
    input_views.push_back(flat_host_slice(input, 0, numel));
    if (!outputs.empty()) {
      const at::Tensor& output = outputs[i];
      if (!plain(output, dtype) || output.device() != input.device() ||
          output.numel() * output_multiplier != numel * input_multiplier) {
        return std::nullopt;
      }
      output_views.push_back(flat_host_slice(output, 0, output.numel()));
    }
  }
  return std::make_pair(std::move(input_views), std::move(output_views));
}

void copy_into_each(const at::Tensor& source, const std::vector<at::Tensor>& targets) {
  TORCH_CHECK(source.device().is_cpu() && source.is_contiguous(), "copy_into_each: source must be contiguous CPU");
  const size_t nbytes = source.nbytes();
  for (const at::Tensor& target : targets) {
    TORCH_CHECK(target.device().is_cpu() && target.is_contiguous() && target.nbytes() == nbytes,
                "copy_into_each: every target must be a contiguous CPU tensor of the source's byte size");
    if (nbytes != 0 && target.data_ptr() != source.data_ptr()) {
      std::memcpy(target.data_ptr(), source.data_ptr(), nbytes);
    }
  }
}

}  // namespace supa::bccl
