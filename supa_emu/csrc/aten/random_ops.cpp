// The card's random operators: every value comes from the device's Philox generator, element i of
// a call from counter group offset/4 + i/4, lane i % 4 (extra words per element from the counter's
// draw word), and a call advances the offset by its element count rounded up to 4. A value thus
// depends only on (seed, offset, i): a shard whose offset DTensor moves to its first element draws
// exactly the numbers of the unsharded tensor. Numbers differ from the CPU's, as a card's do.
//
// The kernels run through the fallback's machinery (placement checks, host views, results in card
// memory, graph recording) on host views of the operands. Argument checks and the composite
// forms (normal with tensor means, complex views) are PyTorch's own distribution templates, so
// errors read as on CPU and CUDA; the sampling is ours. Random operators without a kernel here
// (poisson, binomial, _standard_gamma, _sample_dirichlet, rrelu_with_noise) stay with the
// fallback, which seeds their CPU kernel from this generator's counters.
#include "random_kernels.h"

namespace supa {
namespace random_ops {
namespace {

// ---- the operators (host views in, as run_host_kernel hands them) ----

Tensor& uniform_(Tensor& self, double from, double to, std::optional<at::Generator> gen) {
  return templates::uniform_impl_<UniformKernel, NoRNG>(self, from, to, gen);
}
Tensor& normal_(Tensor& self, double mean, double std, std::optional<at::Generator> gen) {
  return templates::normal_impl_<NormalKernel, NoRNG>(self, mean, std, gen);
}
Tensor normal_tensor_float(const Tensor& mean, double std, std::optional<at::Generator> gen) {
  return templates::normal_impl<NormalKernel, NoRNG>(mean, std, gen);
}
Tensor& normal_tensor_float_out(const Tensor& mean, double std, std::optional<at::Generator> gen, Tensor& out) {
  return templates::normal_out_impl<NormalKernel, NoRNG>(out, mean, std, gen);
}
Tensor normal_float_tensor(double mean, const Tensor& std, std::optional<at::Generator> gen) {
  return templates::normal_impl<NormalKernel, NoRNG>(mean, std, gen);
}
Tensor& normal_float_tensor_out(double mean, const Tensor& std, std::optional<at::Generator> gen, Tensor& out) {
  return templates::normal_out_impl<NormalKernel, NoRNG>(out, mean, std, gen);
}
Tensor normal_tensor_tensor(const Tensor& mean, const Tensor& std, std::optional<at::Generator> gen) {
  return templates::normal_impl<NormalKernel, NoRNG>(mean, std, gen);
}
Tensor& normal_tensor_tensor_out(const Tensor& mean, const Tensor& std, std::optional<at::Generator> gen,
                                 Tensor& out) {
  return templates::normal_out_impl<NormalKernel, NoRNG>(out, mean, std, gen);
}
Tensor& log_normal_(Tensor& self, double mean, double std, std::optional<at::Generator> gen) {
  return templates::log_normal_impl_<LogNormalKernel, NoRNG>(self, mean, std, gen);
}
Tensor& exponential_(Tensor& self, double lambda, std::optional<at::Generator> gen) {
  return templates::exponential_impl_<ExponentialKernel, NoRNG>(self, lambda, gen);
}
Tensor& cauchy_(Tensor& self, double median, double sigma, std::optional<at::Generator> gen) {
  return templates::cauchy_impl_<CauchyKernel, NoRNG>(self, median, sigma, gen);
}
Tensor& geometric_(Tensor& self, double p, std::optional<at::Generator> gen) {
  return templates::geometric_impl_<GeometricKernel, NoRNG>(self, p, gen);
}
Tensor& random_(Tensor& self, std::optional<at::Generator> gen) {
  return templates::random_impl<RandomKernel, NoRNG>(self, gen);
}
Tensor& random_to(Tensor& self, int64_t to, std::optional<at::Generator> gen) {
  return templates::random_from_to_impl<RandomFromToKernel, NoRNG>(self, 0, to, gen);
}
Tensor& random_from(Tensor& self, int64_t from, std::optional<int64_t> to, std::optional<at::Generator> gen) {
  return templates::random_from_to_impl<RandomFromToKernel, NoRNG>(self, from, to, gen);
}
Tensor& bernoulli_tensor_(Tensor& self, const Tensor& p, std::optional<at::Generator> gen) {
  return templates::bernoulli_impl_<BernoulliTensorKernel, NoRNG>(self, p, gen);
}
Tensor& bernoulli_float_(Tensor& self, double p, std::optional<at::Generator> gen) {
  return templates::bernoulli_impl_<BernoulliScalarKernel, NoRNG>(self, p, gen);
}
Tensor& bernoulli_out(const Tensor& self, std::optional<at::Generator> gen, Tensor& out) {
  return templates::bernoulli_out_impl<BernoulliTensorKernel, NoRNG>(out, self, gen);
}

}  // namespace

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("uniform_", SUPA_RANDOM_KERNEL(uniform_));
  m.impl("normal_", SUPA_RANDOM_KERNEL(normal_));
  m.impl("normal.Tensor_float", SUPA_RANDOM_KERNEL(normal_tensor_float));
  m.impl("normal.Tensor_float_out", SUPA_RANDOM_KERNEL(normal_tensor_float_out));
  m.impl("normal.float_Tensor", SUPA_RANDOM_KERNEL(normal_float_tensor));
  m.impl("normal.float_Tensor_out", SUPA_RANDOM_KERNEL(normal_float_tensor_out));
  m.impl("normal.Tensor_Tensor", SUPA_RANDOM_KERNEL(normal_tensor_tensor));
  m.impl("normal.Tensor_Tensor_out", SUPA_RANDOM_KERNEL(normal_tensor_tensor_out));
  m.impl("log_normal_", SUPA_RANDOM_KERNEL(log_normal_));
  m.impl("exponential_", SUPA_RANDOM_KERNEL(exponential_));
  m.impl("cauchy_", SUPA_RANDOM_KERNEL(cauchy_));
  m.impl("geometric_", SUPA_RANDOM_KERNEL(geometric_));
  m.impl("random_", SUPA_RANDOM_KERNEL(random_));
  m.impl("random_.to", SUPA_RANDOM_KERNEL(random_to));
  m.impl("random_.from", SUPA_RANDOM_KERNEL(random_from));
  m.impl("bernoulli_.Tensor", SUPA_RANDOM_KERNEL(bernoulli_tensor_));
  m.impl("bernoulli_.float", SUPA_RANDOM_KERNEL(bernoulli_float_));
  m.impl("bernoulli.out", SUPA_RANDOM_KERNEL(bernoulli_out));
}


}  // namespace random_ops
}  // namespace supa
