// The card's random kernels' shared parts: Philox counters of a call, the per-group fill, the
// value transforms and the boxed entry point (random_ops.cpp and random_sampling.cpp use them; see
// random_ops.cpp for the scheme). In an anonymous namespace behind #pragma once, so it is defined
// once whether the files compile apart or together in one translation unit.
#pragma once

#include "../runtime/devices.h"
#include "../runtime/generator.h"
#include "../runtime/philox.h"
#include "fallback.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/TensorIterator.h>
#include <ATen/native/DistributionTemplates.h>
#include <ATen/native/TensorFactories.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <type_traits>
#include <vector>

namespace supa {
namespace random_ops {
namespace {


using at::Tensor;
using philox::Words;

constexpr double kPi = 3.141592653589793;
constexpr double kTwoPi = 2 * kPi;
constexpr int64_t kGroupsPerTask = 4096;  // parallel_for grain: 16K elements

PhiloxRange reserve(const std::optional<at::Generator>& generator, int64_t numel) {
  return reserve_counters(generator, current_device(), static_cast<uint64_t>(numel));
}

// Writes out[i] for every element i (row-major order) from the words of its group:
// `group_values(first, words, values)` fills the four values of the group whose first element is
// `first`, from words[d] = Philox(group, draw d).
template <class scalar_t, int kDraws, class GroupValues>
void fill_groups(const Tensor& out, const PhiloxRange& range, GroupValues group_values) {
  const int64_t n = out.numel();
  if (n == 0) {
    return;
  }
  const bool direct = out.is_contiguous();
  Tensor dst = direct ? out : at::empty(out.sizes(), out.options());
  scalar_t* data = dst.data_ptr<scalar_t>();
  const uint64_t first_group = range.offset / 4;
  at::parallel_for(0, (n + 3) / 4, kGroupsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      Words words[kDraws];
      for (int d = 0; d < kDraws; ++d) {
        words[d] = philox::philox4x32_10(first_group + static_cast<uint64_t>(g), static_cast<uint32_t>(d), range.seed);
      }
      const int64_t first = g * 4;
      scalar_t values[4];
      group_values(first, words, values);
      const int64_t count = std::min<int64_t>(4, n - first);
      for (int64_t lane = 0; lane < count; ++lane) {
        data[first + lane] = values[lane];
      }
    }
  });
  if (!direct) {
    out.copy_(dst);
  }
}

// The uniform of lane l in [0, 1), or in (0, 1) with `open`: 24 bits for single and reduced
// precision, 53 for double.
template <class acc_t>
acc_t unit(const Words* w, int lane, bool open = false) {
  if constexpr (std::is_same_v<acc_t, double>) {
    return philox::unit_double(w[0].w[lane], w[1].w[lane], open);
  } else {
    return philox::unit_float(w[0].w[lane], open);
  }
}
uint64_t bits64(const Words* w, int lane) {
  return (static_cast<uint64_t>(w[0].w[lane]) << 32) | w[1].w[lane];
}

template <class scalar_t>
using acc_type = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
template <class scalar_t>
constexpr int draws_for() {
  return std::is_same_v<scalar_t, double> ? 2 : 1;
}

// Four standard normals per group, Box-Muller on lanes (0, 1) and (2, 3).
template <class acc_t>
void standard_normals(const Words* w, acc_t z[4]) {
  for (int pair = 0; pair < 2; ++pair) {
    const acc_t radius = std::sqrt(acc_t(-2) * std::log(unit<acc_t>(w, 2 * pair, true)));
    const acc_t angle = acc_t(kTwoPi) * unit<acc_t>(w, 2 * pair + 1);
    z[2 * pair] = radius * std::cos(angle);
    z[2 * pair + 1] = radius * std::sin(angle);
  }
}

// Element-wise distributions of one uniform in (0, 1) per element, floating dtypes.
template <class Transform>
void fill_open_uniform_transform(const Tensor& out, const std::optional<at::Generator>& gen, Transform transform) {
  const PhiloxRange range = reserve(gen, out.numel());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "random_transform", [&] {
    using acc_t = acc_type<scalar_t>;
    fill_groups<scalar_t, draws_for<scalar_t>()>(out, range, [&](int64_t, const Words* w, scalar_t* v) {
      for (int lane = 0; lane < 4; ++lane) {
        v[lane] = static_cast<scalar_t>(transform(unit<acc_t>(w, lane, true)));
      }
    });
  });
}

// ---- kernels in the shape PyTorch's distribution templates call them ----

template <typename RNG>
struct UniformKernel {
  void operator()(at::TensorIteratorBase& iter, double from, double to, std::optional<at::Generator> gen) {
    const Tensor& out = iter.tensor(0);
    const PhiloxRange range = reserve(gen, out.numel());
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "uniform_", [&] {
      using acc_t = acc_type<scalar_t>;
      const acc_t low = static_cast<acc_t>(from), span = static_cast<acc_t>(to - from);
      const scalar_t high = static_cast<scalar_t>(to);
      fill_groups<scalar_t, draws_for<scalar_t>()>(out, range, [&](int64_t, const Words* w, scalar_t* v) {
        for (int lane = 0; lane < 4; ++lane) {
          const scalar_t value = static_cast<scalar_t>(low + unit<acc_t>(w, lane) * span);
          v[lane] = value == high ? static_cast<scalar_t>(from) : value;  // rounding must not reach `to`
        }
      });
    });
  }
};

// Normal values mean + std * z (z standard normal), passed through `transform`.
template <class Transform>
void fill_normals(const Tensor& out, const std::optional<at::Generator>& gen, double mean, double std,
                  Transform transform) {
  const PhiloxRange range = reserve(gen, out.numel());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "normal", [&] {
    using acc_t = acc_type<scalar_t>;
    const acc_t m = static_cast<acc_t>(mean), s = static_cast<acc_t>(std);
    fill_groups<scalar_t, draws_for<scalar_t>()>(out, range, [&](int64_t, const Words* w, scalar_t* v) {
      acc_t z[4];
      standard_normals<acc_t>(w, z);
      for (int lane = 0; lane < 4; ++lane) {
        v[lane] = static_cast<scalar_t>(transform(m + s * z[lane]));
      }
    });
  });
}

template <typename RNG>
struct NormalKernel {
  void operator()(Tensor& self, double mean, double std, std::optional<at::Generator> gen) {
    fill_normals(self, gen, mean, std, [](auto x) { return x; });
  }
};

template <typename RNG>
struct LogNormalKernel {
  void operator()(at::TensorIteratorBase& iter, double mean, double std, std::optional<at::Generator> gen) {
    fill_normals(iter.tensor(0), gen, mean, std, [](auto x) { return std::exp(x); });
  }
};

template <typename RNG>
struct ExponentialKernel {
  void operator()(at::TensorIteratorBase& iter, double lambda, std::optional<at::Generator> gen) {
    // u in (0, 1): never 0 nor infinity, as CUDA's exponential_ guarantees.
    fill_open_uniform_transform(iter.tensor(0), gen, [lambda](auto u) { return -std::log(u) / static_cast<decltype(u)>(lambda); });
  }
};

template <typename RNG>
struct CauchyKernel {
  void operator()(at::TensorIteratorBase& iter, double median, double sigma, std::optional<at::Generator> gen) {
    fill_open_uniform_transform(iter.tensor(0), gen, [median, sigma](auto u) {
      using acc_t = decltype(u);
      return static_cast<acc_t>(median) + static_cast<acc_t>(sigma) * std::tan(acc_t(kPi) * (u - acc_t(0.5)));
    });
  }
};

template <typename RNG>
struct GeometricKernel {
  void operator()(at::TensorIteratorBase& iter, double p, std::optional<at::Generator> gen) {
    const Tensor& out = iter.tensor(0);
    const PhiloxRange range = reserve(gen, out.numel());
    const double log_failure = std::log1p(-p);
    AT_DISPATCH_ALL_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "geometric_", [&] {
      fill_groups<scalar_t, 2>(out, range, [&](int64_t, const Words* w, scalar_t* v) {
        for (int lane = 0; lane < 4; ++lane) {
          v[lane] = static_cast<scalar_t>(std::ceil(std::log(unit<double>(w, lane, true)) / log_failure));
        }
      });
    });
  }
};

// Integers in [base, base + span): from one 32-bit word when the span allows, else from 64 bits.
template <class scalar_t, int kDraws>
void fill_integers_from(const Tensor& out, const PhiloxRange& range, uint64_t span, int64_t base) {
  fill_groups<scalar_t, kDraws>(out, range, [&](int64_t, const Words* w, scalar_t* v) {
    for (int lane = 0; lane < 4; ++lane) {
      const uint64_t bits = kDraws == 1 ? w[0].w[lane] % static_cast<uint32_t>(span) : bits64(w, lane) % span;
      v[lane] = static_cast<scalar_t>(static_cast<int64_t>(static_cast<uint64_t>(base) + bits));
    }
  });
}
template <class scalar_t>
void fill_integers(const Tensor& out, const PhiloxRange& range, uint64_t span, int64_t base) {
  if (span < (uint64_t{1} << 32)) {
    fill_integers_from<scalar_t, 1>(out, range, span, base);
  } else {
    fill_integers_from<scalar_t, 2>(out, range, span, base);
  }
}

#define SUPA_DISPATCH_RANDOM_TYPES(type, name, ...) \
  AT_DISPATCH_V2(type, name, AT_WRAP(__VA_ARGS__), AT_EXPAND(AT_ALL_TYPES), at::kBool, at::kHalf, at::kBFloat16)

template <typename RNG>
struct RandomFromToKernel {
  void operator()(at::TensorIteratorBase& iter, uint64_t span, int64_t base, std::optional<at::Generator> gen) {
    const Tensor& out = iter.tensor(0);
    const PhiloxRange range = reserve(gen, out.numel());
    SUPA_DISPATCH_RANDOM_TYPES(out.scalar_type(), "random_from_to", [&] {
      fill_integers<scalar_t>(out, range, span, base);
    });
  }
  // [int64 min, int64 max]: all 64 bits.
  void operator()(at::TensorIteratorBase& iter, std::optional<at::Generator> gen) {
    const Tensor& out = iter.tensor(0);
    const PhiloxRange range = reserve(gen, out.numel());
    SUPA_DISPATCH_RANDOM_TYPES(out.scalar_type(), "random_full_64_bits_range", [&] {
      fill_groups<scalar_t, 2>(out, range, [&](int64_t, const Words* w, scalar_t* v) {
        for (int lane = 0; lane < 4; ++lane) {
          v[lane] = static_cast<scalar_t>(static_cast<int64_t>(bits64(w, lane)));
        }
      });
    });
  }
};

// random_() without bounds: [0, 2^mantissa] for floating dtypes, [0, max] for integral ones.
template <typename RNG>
struct RandomKernel {
  void operator()(at::TensorIteratorBase& iter, std::optional<at::Generator> gen) {
    const Tensor& out = iter.tensor(0);
    const PhiloxRange range = reserve(gen, out.numel());
    SUPA_DISPATCH_RANDOM_TYPES(out.scalar_type(), "random_", [&] {
      uint64_t span = 0;
      if constexpr (std::is_same_v<scalar_t, bool>) {
        span = 2;
      } else if constexpr (std::is_floating_point_v<scalar_t> || std::is_same_v<scalar_t, at::Half> ||
                           std::is_same_v<scalar_t, at::BFloat16>) {
        span = (uint64_t{1} << std::numeric_limits<scalar_t>::digits) + 1;
      } else {
        span = static_cast<uint64_t>(std::numeric_limits<scalar_t>::max()) + 1;
      }
      fill_integers<scalar_t>(out, range, span, 0);
    });
  }
};

template <class scalar_t, class Probability>
void fill_bernoulli(const Tensor& self, const PhiloxRange& range, Probability probability) {
  fill_groups<scalar_t, 1>(self, range, [&](int64_t first, const Words* w, scalar_t* v) {
    for (int lane = 0; lane < 4; ++lane) {
      const double u = static_cast<double>(w[0].w[lane]) * (1.0 / 4294967296.0);
      v[lane] = static_cast<scalar_t>(u < probability(first + lane) ? 1 : 0);
    }
  });
}

template <typename RNG>
struct BernoulliScalarKernel {
  void operator()(Tensor& self, double p, std::optional<at::Generator> gen) {
    const PhiloxRange range = reserve(gen, self.numel());
    SUPA_DISPATCH_RANDOM_TYPES(self.scalar_type(), "bernoulli_scalar", [&] {
      fill_bernoulli<scalar_t>(self, range, [p](int64_t) { return p; });
    });
  }
};

template <typename RNG>
struct BernoulliTensorKernel {
  void operator()(Tensor& self, const Tensor& p_, std::optional<at::Generator> gen) {
    const Tensor p = p_.expand(self.sizes()).to(at::kDouble).contiguous();
    const double* probabilities = p.const_data_ptr<double>();
    const int64_t n = self.numel();
    const PhiloxRange range = reserve(gen, n);
    SUPA_DISPATCH_RANDOM_TYPES(self.scalar_type(), "bernoulli_tensor", [&] {
      fill_bernoulli<scalar_t>(self, range, [=](int64_t i) { return i < n ? probabilities[i] : 0.0; });
    });
  }
};

struct NoRNG {};  // the templates' RNG parameter: the kernels above find their generator themselves
namespace templates = at::native::templates;


// Boxed entry points: the fallback's call machinery around an unboxed host function.
template <class FuncPtr>  // TORCH_FN_TYPE(f)
void host_call(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  static const c10::KernelFunction kernel = c10::KernelFunction::makeFromUnboxedFunction(FuncPtr());
  kernel.callBoxed(op, c10::DispatchKeySet(c10::DispatchKey::CPU), stack);
}
template <class FuncPtr>
void supa_call(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  run_host_kernel(op, stack, &host_call<FuncPtr>);
}
#define SUPA_RANDOM_KERNEL(f) torch::CppFunction::makeFromBoxedFunction<&supa_call<TORCH_FN_TYPE(f)>>()

}  // namespace
}  // namespace random_ops
}  // namespace supa
