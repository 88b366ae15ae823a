// The per-channel statistics operators behind nn.SyncBatchNorm. PyTorch has GPU kernels for them
// only (a CPU model never syncs its batch norm), so the fallback has no CPU kernel to run; here
// they get host kernels with the GPU kernels' semantics: statistics in float for reduced-precision
// inputs, running statistics updated with the unbiased variance of the whole group, undefined
// results for the gradients backward was not asked for.
#include "fallback.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <tuple>
#include <vector>

namespace supa {
namespace {

using at::Tensor;

// Every dimension but the channel dimension (1): the dimensions the statistics reduce over.
std::vector<int64_t> reduced_dims(const Tensor& input, const char* op) {
  TORCH_CHECK(input.dim() >= 2, op, ": expected an input of at least 2 dimensions (N, C, ...), got ",
              input.dim());
  std::vector<int64_t> dims{0};
  for (int64_t d = 2; d < input.dim(); ++d) {
    dims.push_back(d);
  }
  return dims;
}

// A (C,) per-channel tensor shaped to broadcast against the input.
Tensor per_channel(const Tensor& values, const Tensor& input) {
  std::vector<int64_t> shape(input.dim(), 1);
  shape[1] = input.size(1);
  return values.reshape(shape);
}

c10::ScalarType accumulate_type(const Tensor& input) {
  return at::isReducedFloatingType(input.scalar_type()) ? at::kFloat : input.scalar_type();
}

// batch_norm_stats(input, eps) -> (mean, invstd)
void channel_stats(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  auto args = torch::jit::last(*stack, 2);
  const Tensor input = args[0].toTensor();
  const double eps = args[1].toDouble();
  const auto dims = reduced_dims(input, "batch_norm_stats");
  const Tensor wide = input.to(accumulate_type(input));
  const Tensor mean = wide.mean(dims);
  const Tensor var = wide.var(dims, /*correction=*/0);
  push_results(stack, 2, {mean, var.add(eps).rsqrt()});
}

// batch_norm_elemt(input, weight, bias, mean, invstd, eps) -> output
void normalize(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  auto args = torch::jit::last(*stack, 6);
  const Tensor input = args[0].toTensor();
  const Tensor weight = optional_tensor(args[1]);
  const Tensor bias = optional_tensor(args[2]);
  const Tensor mean = args[3].toTensor();
  const Tensor invstd = args[4].toTensor();
  Tensor scale = invstd;
  Tensor shift = mean.neg().mul(invstd);
  if (weight.defined()) {
    scale = scale.mul(weight);
    shift = shift.mul(weight);
  }
  if (bias.defined()) {
    shift = shift.add(bias);
  }
  Tensor output = at::addcmul(per_channel(shift, input), input, per_channel(scale, input));
  push_results(stack, 6, {output.to(input.scalar_type()).contiguous(input.suggest_memory_format())});
}

// The ranks' (world, C) statistics combined, weighted by their element counts (world,); ranks that
// counted nothing do not contribute. Updates the running statistics; pushes (mean, invstd).
void combine_stats(torch::jit::Stack* stack, size_t num_args, const char* op, const Tensor& counts_given) {
  auto args = torch::jit::last(*stack, num_args);
  const Tensor means = args[1].toTensor();
  const Tensor invstds = args[2].toTensor();
  Tensor running_mean = optional_tensor(args[3]);
  Tensor running_var = optional_tensor(args[4]);
  const double momentum = args[5].toDouble();
  const double eps = args[6].toDouble();
  TORCH_CHECK(means.dim() == 2 && invstds.sizes() == means.sizes() && counts_given.dim() == 1 &&
                  counts_given.size(0) == means.size(0),
              op, ": expected (world, C) means and invstds and (world,) counts, got ", means.sizes(), ", ",
              invstds.sizes(), " and ", counts_given.sizes());
  const Tensor counts = counts_given.to(means.scalar_type()).reshape({-1, 1});
  const Tensor present = counts.gt(0);
  const Tensor weights = counts.where(present, 0);
  const Tensor total = weights.sum();
  const Tensor mean = means.mul(weights).sum(0).div(total);
  const Tensor variances = invstds.pow(-2).sub(eps);
  const Tensor spread = variances.add(means.sub(mean).pow(2)).mul(weights).where(present, 0).sum(0);
  const Tensor var = spread.div(total);
  if (running_mean.defined()) {
    running_mean.mul_(1 - momentum).add_(mean.to(running_mean.scalar_type()), momentum);
  }
  if (running_var.defined()) {
    const Tensor unbiased = spread.div(total.sub(1));
    running_var.mul_(1 - momentum).add_(unbiased.to(running_var.scalar_type()), momentum);
  }
  push_results(stack, num_args, {mean, var.add(eps).rsqrt()});
}

// batch_norm_gather_stats_with_counts(input, mean, invstd, running_mean, running_var, momentum,
// eps, counts) -> (mean, invstd)
void gather_stats_with_counts(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  const Tensor counts = torch::jit::peek(*stack, 7, 8).toTensor();
  combine_stats(stack, 8, "batch_norm_gather_stats_with_counts", counts);
}

// batch_norm_gather_stats(input, mean, invstd, running_mean, running_var, momentum, eps, count)
//   -> (mean, invstd): every rank counted `count` elements per channel.
void gather_stats(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  const Tensor means = torch::jit::peek(*stack, 1, 8).toTensor();
  const int64_t count = torch::jit::peek(*stack, 7, 8).toInt();
  TORCH_CHECK(means.dim() >= 1, "batch_norm_gather_stats: expected (world, C) means, got ", means.sizes());
  combine_stats(stack, 8, "batch_norm_gather_stats", at::full({means.size(0)}, count, means.options()));
}

// The leading arguments both backward operators share: (grad_out, input, mean, invstd, weight).
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> backward_operands(c10::ArrayRef<c10::IValue> args) {
  return {args[0].toTensor(), args[1].toTensor(), args[2].toTensor(), args[3].toTensor(), optional_tensor(args[4])};
}

// batch_norm_backward_reduce(grad_out, input, mean, invstd, weight, input_g, weight_g, bias_g)
//   -> (sum_dy, sum_dy_xmu, grad_weight, grad_bias)
void backward_reduce(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  auto args = torch::jit::last(*stack, 8);
  const auto [grad_out, input, mean, invstd, weight] = backward_operands(args);
  const bool input_g = args[5].toBool();
  const bool weight_g = args[6].toBool();
  const bool bias_g = args[7].toBool();
  const auto dims = reduced_dims(input, "batch_norm_backward_reduce");
  const c10::ScalarType acc = accumulate_type(input);
  const Tensor dy = grad_out.to(acc);
  const Tensor sum_dy = dy.sum(dims);
  const Tensor sum_dy_xmu = dy.mul(input.to(acc).sub(per_channel(mean, input))).sum(dims);
  const c10::ScalarType param_type = weight.defined() ? weight.scalar_type() : input.scalar_type();
  push_results(stack, 8, {
      input_g ? sum_dy : Tensor(),
      input_g ? sum_dy_xmu : Tensor(),
      weight_g ? sum_dy_xmu.mul(invstd).to(param_type) : Tensor(),
      bias_g ? sum_dy.to(param_type) : Tensor(),
  });
}

// batch_norm_backward_elemt(grad_out, input, mean, invstd, weight, sum_dy, sum_dy_xmu, count)
//   -> grad_input, with sum_dy and sum_dy_xmu summed over the group and count its ranks' counts.
void backward_elemt(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  auto args = torch::jit::last(*stack, 8);
  const auto [grad_out, input, mean, invstd, weight] = backward_operands(args);
  const Tensor sum_dy = args[5].toTensor();
  const Tensor sum_dy_xmu = args[6].toTensor();
  const Tensor total = args[7].toTensor().sum().to(sum_dy.scalar_type());
  const c10::ScalarType acc = accumulate_type(input);
  const Tensor mean_dy = per_channel(sum_dy.div(total), input);
  const Tensor projection = per_channel(sum_dy_xmu.div(total).mul(invstd.pow(2)), input);
  Tensor scale = invstd;
  if (weight.defined()) {
    scale = scale.mul(weight);
  }
  const Tensor xmu = input.to(acc).sub(per_channel(mean, input));
  Tensor grad_input = grad_out.to(acc).sub(mean_dy).sub(xmu.mul(projection)).mul(per_channel(scale, input));
  push_results(stack, 8, {grad_input.to(input.scalar_type()).contiguous(input.suggest_memory_format())});
}

}  // namespace

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("batch_norm_stats", torch::CppFunction::makeFromBoxedFunction<&on_host_views<&channel_stats>>());
  m.impl("batch_norm_elemt", torch::CppFunction::makeFromBoxedFunction<&on_host_views<&normalize>>());
  m.impl("batch_norm_gather_stats", torch::CppFunction::makeFromBoxedFunction<&on_host_views<&gather_stats>>());
  m.impl("batch_norm_gather_stats_with_counts",
         torch::CppFunction::makeFromBoxedFunction<&on_host_views<&gather_stats_with_counts>>());
  m.impl("batch_norm_backward_reduce", torch::CppFunction::makeFromBoxedFunction<&on_host_views<&backward_reduce>>());
  m.impl("batch_norm_backward_elemt", torch::CppFunction::makeFromBoxedFunction<&on_host_views<&backward_elemt>>());
}

}  // namespace supa
