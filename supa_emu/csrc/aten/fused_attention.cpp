// The card's fused attention kernels: what scaled_dot_product_attention runs on supa when the
// card's choice (sdp_choice.cpp) is flash or memory-efficient attention, under the operator names
// a card's SDPA calls (scaled_dot_product_attention.cpp).
//
// Values come from PyTorch's CPU flash attention kernel (blockwise host math where it does not
// apply: host_attention.h). Memory is the card kernel's, not the CPU kernel's: the CPU kernel
// runs with its scratch in host memory (not card memory), and the card holds what a GPU's fused
// kernel holds, as measured on an H200 (tests/data/fidelity, docs/operator_memory.md):
// - forward: the output and the log-sum-exp (float32 per query row) it keeps for backward, plus
//   the dropout state, int64/uint64 tensors on the card (flash: rng_state and `unused`, returned
//   with or without dropout; memory-efficient: seed and offset); nothing of size L x S;
// - backward: the gradients, and for the kernel's duration a dense copy of the output gradient
//   when it is not dense in the output's layout, a float32 accumulator of the query gradient and
//   the float32 row sums of dO * O; with grouped-query attention (fewer key/value heads than
//   query heads) also the key and value gradients of every query head, which the card's kernel
//   sums over each group at the end (H200, tests/data/fidelity/h200_gqa_attention.json).
// Shapes and strides of every result are those of PyTorch's meta functions for these ops, which
// compiled graphs check. In the planner's shapes mode the kernels allocate all of it and compute
// nothing. The host computation is hidden from the profiler: a card's profile shows the card
// operator, not the CPU kernels that stand in for it.
#include "fallback.h"
#include "host_attention.h"
#include "shape_only.h"

#include "../runtime/devices.h"
#include "../runtime/generator.h"
#include "../runtime/host_alias.h"
#include "../runtime/host_routing_allocator.h"

#include <ATen/ATen.h>
#include <ATen/native/transformers/sdp_utils_cpp.h>
#include <ATen/record_function.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cmath>
#include <optional>
#include <utility>
#include <vector>

namespace supa::fused_attention {

// A tensor on the current card, as a card kernel allocates it; written through its host view.
struct CardTensor {
  at::Tensor card;
  at::Tensor host;
};

CardTensor on_card(c10::IntArrayRef sizes, c10::IntArrayRef permutation, at::ScalarType dtype) {
  const auto options = at::TensorOptions().dtype(dtype).device(c10::Device(kSupa, current_device()));
  at::Tensor card = permutation.empty() ? at::empty(sizes, options) : at::empty_permuted(sizes, permutation, options);
  return {card, host_view(card)};
}

// Host kernels run inside the fallback, which routes host allocations to the card: this scope
// sends the CPU kernels' scratch back to host memory, where a card kernel has none of it, and
// keeps the CPU operators they call out of the profiler.
class HostScratch {
 public:
  HostScratch() : scope_(-1) {}

 private:
  DeviceOutputScope scope_;
  at::DisableRecordFunctionGuard unrecorded_;
};

double softmax_scale(const at::Tensor& query, const c10::IValue& scale) {
  return scale.isNone() ? 1.0 / std::sqrt(static_cast<double>(query.size(-1))) : scale.toDouble();
}

// The card's transient buffers of a backward pass (see the file comment); freed when it returns.
// The kernel reads the output gradient in the output's layout: any other needs a dense copy.
std::vector<at::Tensor> backward_scratch(const at::Tensor& grad_out, const at::Tensor& out, const at::Tensor& query,
                                         const at::Tensor& key, const at::Tensor& value) {
  std::vector<at::Tensor> scratch;
  const auto options = at::TensorOptions().device(c10::Device(kSupa, current_device()));
  if (!grad_out.is_non_overlapping_and_dense() || grad_out.strides() != out.strides()) {
    scratch.push_back(at::empty(grad_out.sizes(), options.dtype(grad_out.scalar_type())));
  }
  scratch.push_back(at::empty(query.sizes(), options.dtype(at::kFloat)));
  scratch.push_back(at::empty({query.size(0), query.size(1), query.size(2)}, options.dtype(at::kFloat)));
  if (key.size(1) != query.size(1)) {
    scratch.push_back(at::empty({key.size(0), query.size(1), key.size(2), key.size(3)}, options.dtype(key.scalar_type())));
    scratch.push_back(at::empty({value.size(0), query.size(1), value.size(2), value.size(3)},
                                options.dtype(value.scalar_type())));
  }
  return scratch;
}

// The dropout seed and offset of memory-efficient attention: the Philox counters of one number per
// attention weight, reserved from the card's default generator as CUDA's kernel reserves them
// (its offset advances by batch x heads x L x S), so dropout follows torch.supa.manual_seed.
// Without dropout CUDA's kernel returns them as host scalars (the H200 keeps nothing beyond the
// log-sum-exp); here every result of a card operator is on the card, so they hold 2 x 512 B more.
std::pair<at::Tensor, at::Tensor> draw_philox_state(double dropout_p, uint64_t weights) {
  const auto options = at::TensorOptions().dtype(at::kLong).device(c10::Device(kSupa, current_device()));
  if (dropout_p == 0.0) {
    return {at::zeros({}, options), at::zeros({}, options)};
  }
  const PhiloxRange counters = reserve_counters(std::nullopt, current_device(), weights);
  return {at::full({}, static_cast<int64_t>(counters.seed), options),
          at::full({}, static_cast<int64_t>(counters.offset), options)};
}

std::optional<at::Tensor> present(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}

uint64_t read_long(const at::Tensor& t) {
  const at::Tensor host = t.device().type() == kSupa ? host_view(t) : t;
  return static_cast<uint64_t>(host.item<int64_t>());
}

std::optional<double> optional_double(const c10::IValue& value) {
  return value.isNone() ? std::nullopt : std::optional<double>(value.toDouble());
}

// aten::_scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal,
//   return_debug_mask, *, scale) -> (output, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
//   rng_state, unused, debug_attn_mask): what a GPU's flash kernel returns for dense inputs, with
// no cumulative sequence lengths, its dropout state as uint64 tensors on the card (zeros: supa's
// flash takes no dropout, sdp_choice.cpp) and an empty debug mask.
void flash_forward(const c10::OperatorHandle& /*op*/, torch::jit::Stack* stack) {
  auto args = torch::jit::last(*stack, 7);
  const at::Tensor q = args[0].toTensor(), k = args[1].toTensor(), v = args[2].toTensor();
  const double dropout_p = args[3].toDouble();
  const bool is_causal = args[4].toBool();
  const std::optional<double> scale = optional_double(args[6]);
  TORCH_CHECK(dropout_p == 0.0, "flash attention on supa takes no dropout (its values come from PyTorch's CPU flash ",
              "kernel, which has none); scaled_dot_product_attention serves dropout > 0 with memory-efficient attention");
  TORCH_CHECK(!args[5].toBool(), "flash attention on supa returns no debug attention mask");
  const auto options = at::TensorOptions().device(c10::Device(kSupa, current_device()));
  at::Tensor out_card = at::empty_like(q, q.options().device(options.device()));
  CardTensor out{out_card, host_view(out_card)};
  CardTensor lse = on_card({q.size(0), q.size(1), q.size(2)}, {}, at::kFloat);
  const at::Tensor rng_state = at::zeros({2}, options.dtype(at::kUInt64));
  const at::Tensor unused = at::zeros({}, options.dtype(at::kUInt64));
  const at::Tensor debug_attn_mask = at::empty({0}, options.dtype(q.scalar_type()));
  if (!shapes_mode()) {  // shapes mode: the card's memory only
    HostScratch scratch;
    auto [o, l] = at::_scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, std::nullopt, scale);
    out.host.copy_(o);
    lse.host.copy_(l);
  }
  torch::jit::drop(*stack, 7);
  for (c10::IValue result : {c10::IValue(out.card), c10::IValue(lse.card), c10::IValue(at::Tensor()),
                             c10::IValue(at::Tensor()), c10::IValue(c10::SymInt(q.size(2))),
                             c10::IValue(c10::SymInt(k.size(2))), c10::IValue(rng_state), c10::IValue(unused),
                             c10::IValue(debug_attn_mask)}) {
    stack->push_back(std::move(result));
  }
}

// The CPU kernel's log-sum-exp layout, (B, L, H) in memory, on the host.
at::Tensor cpu_logsumexp(const at::Tensor& row_lse) {
  at::Tensor cpu_lse = at::empty({row_lse.size(0), row_lse.size(2), row_lse.size(1)}, row_lse.options()).transpose(1, 2);
  return cpu_lse.copy_(row_lse);
}

// aten::_scaled_dot_product_flash_attention_backward(grad_out, query, key, value, out, logsumexp,
//   cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, philox_seed, philox_offset, *, scale)
//   -> (grad_query, grad_key, grad_value), each in its input's layout
void flash_backward(const c10::OperatorHandle& /*op*/, torch::jit::Stack* stack) {
  auto args = torch::jit::last(*stack, 15);
  const at::Tensor grad_out = args[0].toTensor();
  const at::Tensor q = args[1].toTensor(), k = args[2].toTensor(), v = args[3].toTensor();
  const at::Tensor out = args[4].toTensor(), lse = args[5].toTensor();
  const double dropout_p = args[10].toDouble();
  const bool is_causal = args[11].toBool();
  const std::optional<double> scale = optional_double(args[14]);
  TORCH_CHECK(dropout_p == 0.0, "flash attention on supa takes no dropout");
  const auto on_this_card = [](const at::Tensor& like) {
    const at::Tensor card = at::empty_like(like, like.options().device(c10::Device(kSupa, current_device())));
    return CardTensor{card, host_view(card)};
  };
  CardTensor dq = on_this_card(q);
  CardTensor dk = on_this_card(k);
  CardTensor dv = on_this_card(v);
  {
    const std::vector<at::Tensor> card_scratch = backward_scratch(grad_out, out, q, k, v);
    if (!shapes_mode()) {  // shapes mode: the card's memory only
      HostScratch scratch;
      auto [gq, gk, gv] = at::_scaled_dot_product_flash_attention_for_cpu_backward(
          grad_out, q, k, v, out, cpu_logsumexp(lse), 0.0, is_causal, std::nullopt, scale);
      dq.host.copy_(gq);
      dk.host.copy_(gk);
      dv.host.copy_(gv);
    }
  }
  push_results(stack, 15, {dq.card, dk.card, dv.card});
}

// PyTorch's CPU flash kernel serves the call: no dropout, one head size, a mask it accepts.
bool cpu_flash_serves(const at::Tensor& q, const at::Tensor& v, const at::Tensor& bias, double dropout_p) {
  return dropout_p == 0.0 && q.size(-1) == v.size(-1) && (!bias.defined() || bias.dim() == 2 || bias.dim() == 4);
}

// aten::_scaled_dot_product_efficient_attention(query, key, value, attn_bias, compute_log_sumexp,
//   dropout_p, is_causal, *, scale) -> (output, log_sumexp, philox_seed, philox_offset)
void efficient_forward(const c10::OperatorHandle& /*op*/, torch::jit::Stack* stack) {
  auto args = torch::jit::last(*stack, 8);
  const at::Tensor q = args[0].toTensor(), k = args[1].toTensor(), v = args[2].toTensor();
  const at::Tensor bias = optional_tensor(args[3]);
  const bool compute_log_sumexp = args[4].toBool();
  const double dropout_p = args[5].toDouble();
  const bool is_causal = args[6].toBool();
  const double scale = softmax_scale(q, args[7]);
  const int64_t batch = q.size(0), heads = q.size(1), rows = q.size(2);
  const int64_t bhle[] = {0, 2, 1, 3};
  CardTensor out = on_card({batch, heads, rows, v.size(3)}, bhle, q.scalar_type());
  const int64_t lse_rows = compute_log_sumexp ? (rows + 31) / 32 * 32 : 0;
  CardTensor lse = on_card({batch, heads, lse_rows}, {}, at::kFloat);
  auto [seed, offset] = draw_philox_state(dropout_p, static_cast<uint64_t>(batch * heads * rows * k.size(2)));
  if (!shapes_mode()) {  // shapes mode: the card's memory only
    HostScratch scratch;
    at::Tensor o, l;
    if (cpu_flash_serves(q, v, bias, dropout_p)) {
      std::tie(o, l) = at::_scaled_dot_product_flash_attention_for_cpu(
          q, k, v, 0.0, is_causal, present(bias), scale);
    } else {
      std::tie(o, l) = host_attention::forward({q, k, v, bias, is_causal, scale, dropout_p, read_long(seed),
                                                read_long(offset)});
    }
    out.host.copy_(o);
    if (compute_log_sumexp) {
      lse.host.narrow(2, 0, rows).copy_(l);
      lse.host.narrow(2, rows, lse_rows - rows).fill_(0);
    }
  }
  push_results(stack, 8, {out.card, lse.card, seed, offset});
}

// aten::_scaled_dot_product_efficient_attention_backward(grad_out_, query, key, value, attn_bias,
//   out, logsumexp, philox_seed, philox_offset, dropout_p, grad_input_mask, is_causal, *, scale)
//   -> (grad_query, grad_key, grad_value, grad_attn_bias)
void efficient_backward(const c10::OperatorHandle& /*op*/, torch::jit::Stack* stack) {
  auto args = torch::jit::last(*stack, 13);
  const at::Tensor grad_out = args[0].toTensor();
  const at::Tensor q = args[1].toTensor(), k = args[2].toTensor(), v = args[3].toTensor();
  const at::Tensor bias = optional_tensor(args[4]);
  const at::Tensor out = args[5].toTensor(), lse = args[6].toTensor();
  const uint64_t seed = read_long(args[7].toTensor()), offset = read_long(args[8].toTensor());
  const double dropout_p = args[9].toDouble();
  const auto grad_input_mask = args[10].toBoolList();
  const bool is_causal = args[11].toBool();
  const double scale = softmax_scale(q, args[12]);
  const int64_t rows = q.size(2);
  const int64_t bhle[] = {0, 2, 1, 3};
  CardTensor dq = on_card(q.sizes(), bhle, q.scalar_type());
  CardTensor dk = on_card(k.sizes(), bhle, k.scalar_type());
  CardTensor dv = on_card(v.sizes(), bhle, v.scalar_type());
  const bool bias_grad = bias.defined() && grad_input_mask.get(3);
  at::Tensor dbias_card;
  if (bias_grad) {
    // As the card kernel: the last dimension padded to a multiple of 16, and viewed back.
    std::vector<int64_t> padded = bias.sizes().vec();
    padded.back() = (padded.back() + 15) / 16 * 16;
    dbias_card = on_card(padded, {}, bias.scalar_type()).card.narrow(-1, 0, bias.size(-1));
  }
  {
    const std::vector<at::Tensor> card_scratch = backward_scratch(grad_out, out, q, k, v);
    if (!shapes_mode()) {  // shapes mode: the card's memory only
      HostScratch scratch;
      at::Tensor gq, gk, gv, gbias;
      const host_attention::Call call{q, k, v, bias, is_causal, scale, dropout_p, seed, offset};
      // Forward skips the log-sum-exp when no input of its own needs a gradient (the mask may).
      const at::Tensor row_lse =
          lse.size(2) >= rows ? lse.narrow(2, 0, rows) : std::get<1>(host_attention::forward(call));
      if (cpu_flash_serves(q, v, bias, dropout_p) && !bias_grad) {
        std::tie(gq, gk, gv) = at::_scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k, v, out, cpu_logsumexp(row_lse), 0.0, is_causal, present(bias), scale);
      } else {
        std::tie(gq, gk, gv, gbias) = host_attention::backward(call, grad_out, out, row_lse, bias_grad);
      }
      dq.host.copy_(gq);
      dk.host.copy_(gk);
      dv.host.copy_(gv);
      if (bias_grad) {
        host_view(dbias_card).copy_(gbias.sum_to_size(bias.sizes()));
      }
    }
  }
  push_results(stack, 13, {dq.card, dk.card, dv.card, dbias_card});
}

template <HostKernel kernel>
void card_kernel(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  run_card_kernel(op, stack, kernel);
}

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("_scaled_dot_product_flash_attention",
         torch::CppFunction::makeFromBoxedFunction<&card_kernel<&flash_forward>>());
  m.impl("_scaled_dot_product_flash_attention_backward",
         torch::CppFunction::makeFromBoxedFunction<&card_kernel<&flash_backward>>());
  m.impl("_scaled_dot_product_efficient_attention",
         torch::CppFunction::makeFromBoxedFunction<&card_kernel<&efficient_forward>>());
  m.impl("_scaled_dot_product_efficient_attention_backward",
         torch::CppFunction::makeFromBoxedFunction<&card_kernel<&efficient_backward>>());
}

}  // namespace supa::fused_attention
