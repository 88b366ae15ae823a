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
namespace random_ops {  // named: the runtime unit compiles every file into one translation unit
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

// Dropout keeps element i when its uniform is below 1 - p and scales it by 1 / (1 - p); the mask
// says which were kept (bool for native_dropout, uint8 for CUDA's _fused_dropout).
std::tuple<Tensor, Tensor> dropout_with_mask(const Tensor& input, double keep, c10::ScalarType mask_type,
                                             const std::optional<at::Generator>& gen) {
  const Tensor x = input.contiguous();
  Tensor output = at::empty_like(x);
  Tensor mask = at::empty_like(x, x.options().dtype(mask_type));
  const PhiloxRange range = reserve(gen, x.numel());
  AT_DISPATCH_V2(mask_type, "dropout_mask", AT_WRAP([&] {
    fill_bernoulli<scalar_t>(mask, range, [keep](int64_t) { return keep; });
  }), at::kBool, at::kByte);
  const auto* kept = static_cast<const uint8_t*>(mask.const_data_ptr());  // bool and uint8: one byte, 0 or 1
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "native_dropout", [&] {
    using acc_t = acc_type<scalar_t>;
    const acc_t scale = keep == 0 ? acc_t(0) : static_cast<acc_t>(1.0 / keep);
    const scalar_t* in = x.const_data_ptr<scalar_t>();
    scalar_t* out = output.data_ptr<scalar_t>();
    at::parallel_for(0, x.numel(), kGroupsPerTask * 4, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        out[i] = kept[i] ? static_cast<scalar_t>(static_cast<acc_t>(in[i]) * scale) : static_cast<scalar_t>(0);
      }
    });
  });
  return {output, mask};
}

std::tuple<Tensor, Tensor> native_dropout(const Tensor& input, double p, std::optional<bool> train) {
  if (input.numel() == 0) {
    return {input.clone(), at::empty_like(input, input.options().dtype(at::kBool))};
  }
  if (train.has_value() && !*train) {
    return {input.clone(), at::ones_like(input, input.options().dtype(at::kBool))};
  }
  return dropout_with_mask(input, 1.0 - p, at::kBool, std::nullopt);
}

// CUDA's fused dropout (apex and older code call it); `p` is the probability to keep.
std::tuple<Tensor, Tensor> fused_dropout(const Tensor& self, double p, std::optional<at::Generator> gen) {
  TORCH_CHECK(0 <= p && p <= 1, "fused_dropout expects p to be in [0, 1], but got p=", p);
  if (self.numel() == 0) {
    return {self.clone(), at::empty_like(self, self.options().dtype(at::kByte))};
  }
  return dropout_with_mask(self, p, at::kByte, gen);
}

// multinomial: without replacement (or one sample) the top keys p / E with E ~ Exp(1) per
// category; with replacement an inverse-CDF search per sample. Checks and messages as CPU's.
Tensor& multinomial_out(const Tensor& self, int64_t n_sample, bool with_replacement,
                        std::optional<at::Generator> gen, Tensor& result) {
  TORCH_CHECK(self.dim() > 0 && self.dim() <= 2, "prob_dist must be 1 or 2 dim");
  TORCH_CHECK(at::isFloatingType(self.scalar_type()), "multinomial only supports floating-point dtypes for input, got: ",
              self.scalar_type());
  TORCH_CHECK(result.scalar_type() == at::kLong, "multinomial expects Long tensor out, got: ", result.scalar_type());
  TORCH_CHECK(n_sample > 0, "cannot sample n_sample <= 0 samples");
  const int64_t n_categories = self.size(-1);
  TORCH_CHECK(with_replacement || n_sample <= n_categories,
              "cannot sample n_sample > prob_dist.size(-1) samples without replacement");
  TORCH_CHECK(n_categories <= (int64_t{1} << 24), "number of categories cannot exceed 2^24");
  const int64_t n_dist = self.dim() == 1 ? 1 : self.size(0);
  if (self.dim() == 1) {
    result.resize_({n_sample});
  } else {
    result.resize_({n_dist, n_sample});
  }
  if (result.numel() == 0) {
    return result;
  }
  const Tensor probs = self.to(at::kDouble).contiguous().view({n_dist, n_categories});
  const double* p = probs.const_data_ptr<double>();
  for (int64_t i = 0; i < probs.numel(); ++i) {
    TORCH_CHECK(std::isfinite(p[i]) && p[i] >= 0, "probability tensor contains either `inf`, `nan` or element < 0");
  }
  std::vector<double> totals(n_dist);
  for (int64_t row = 0; row < n_dist; ++row) {
    totals[row] = std::accumulate(p + row * n_categories, p + (row + 1) * n_categories, 0.0);
    TORCH_CHECK(totals[row] > 0, "invalid multinomial distribution (sum of probabilities <= 0)");
  }
  Tensor samples = result.is_contiguous() ? result : at::empty(result.sizes(), result.options());
  int64_t* out = samples.data_ptr<int64_t>();
  if (!with_replacement || n_sample == 1) {
    Tensor keys = at::empty({n_dist, n_categories}, probs.options());
    const PhiloxRange range = reserve(gen, keys.numel());
    fill_groups<double, 2>(keys, range, [&](int64_t first, const Words* w, double* v) {
      for (int lane = 0; lane < 4; ++lane) {
        const int64_t i = std::min(first + lane, keys.numel() - 1);
        v[lane] = p[i] / -std::log(unit<double>(w, lane, true));
      }
    });
    const double* key = keys.const_data_ptr<double>();
    at::parallel_for(0, n_dist, 1, [&](int64_t begin, int64_t end) {
      std::vector<int64_t> order(n_categories);
      for (int64_t row = begin; row < end; ++row) {
        const double* row_keys = key + row * n_categories;
        std::iota(order.begin(), order.end(), 0);
        std::partial_sort(order.begin(), order.begin() + n_sample, order.end(), [&](int64_t a, int64_t b) {
          return row_keys[a] > row_keys[b] || (row_keys[a] == row_keys[b] && a < b);
        });
        std::copy(order.begin(), order.begin() + n_sample, out + row * n_sample);
      }
    });
  } else {
    Tensor uniforms = at::empty({n_dist, n_sample}, probs.options());
    const PhiloxRange range = reserve(gen, uniforms.numel());
    fill_groups<double, 2>(uniforms, range, [&](int64_t, const Words* w, double* v) {
      for (int lane = 0; lane < 4; ++lane) {
        v[lane] = unit<double>(w, lane);
      }
    });
    const double* u = uniforms.const_data_ptr<double>();
    at::parallel_for(0, n_dist, 1, [&](int64_t begin, int64_t end) {
      std::vector<double> cdf(n_categories);
      for (int64_t row = begin; row < end; ++row) {
        std::partial_sum(p + row * n_categories, p + (row + 1) * n_categories, cdf.begin());
        // The last category a sample may land on: the last one with a nonzero probability.
        int64_t last = n_categories - 1;
        while (last > 0 && p[row * n_categories + last] == 0) {
          --last;
        }
        for (int64_t j = 0; j < n_sample; ++j) {
          const double target = u[row * n_sample + j] * cdf[last];
          const int64_t index = std::upper_bound(cdf.begin(), cdf.begin() + last, target) - cdf.begin();
          out[row * n_sample + j] = index;
        }
      }
    });
  }
  if (!samples.is_same(result)) {
    result.copy_(samples);
  }
  return result;
}

Tensor multinomial(const Tensor& self, int64_t n_sample, bool with_replacement, std::optional<at::Generator> gen) {
  Tensor result = at::empty({0}, self.options().dtype(at::kLong));
  multinomial_out(self, n_sample, with_replacement, gen, result);
  return result;
}

// randperm: Fisher-Yates, the swap partner of position i drawn from element i's 64 random bits.
Tensor& randperm_out(int64_t n, std::optional<at::Generator> gen, Tensor& result) {
  TORCH_CHECK(n >= 0, "n must be non-negative, got", n);
  at::native::check_supported_max_int_with_precision(n, result);
  result.resize_({n});
  const PhiloxRange range = reserve(gen, n);
  Tensor perm = result.is_contiguous() ? result : at::empty({n}, result.options());
  AT_DISPATCH_ALL_TYPES_AND2(at::kHalf, at::kBFloat16, result.scalar_type(), "randperm", [&] {
    scalar_t* data = perm.data_ptr<scalar_t>();
    std::vector<int64_t> order(n);
    std::iota(order.begin(), order.end(), 0);
    uint64_t group = std::numeric_limits<uint64_t>::max();
    Words words[2];
    for (int64_t i = n - 1; i > 0; --i) {
      if (static_cast<uint64_t>(i / 4) != group) {
        group = static_cast<uint64_t>(i / 4);
        for (uint32_t d = 0; d < 2; ++d) {
          words[d] = philox::philox4x32_10(range.offset / 4 + group, d, range.seed);
        }
      }
      const int64_t j = static_cast<int64_t>(bits64(words, static_cast<int>(i % 4)) % static_cast<uint64_t>(i + 1));
      std::swap(order[i], order[j]);
    }
    for (int64_t i = 0; i < n; ++i) {
      data[i] = static_cast<scalar_t>(order[i]);
    }
  });
  if (!perm.is_same(result)) {
    result.copy_(perm);
  }
  return result;
}

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
  m.impl("native_dropout", SUPA_RANDOM_KERNEL(native_dropout));
  m.impl("_fused_dropout", SUPA_RANDOM_KERNEL(fused_dropout));
  m.impl("multinomial", SUPA_RANDOM_KERNEL(multinomial));
  m.impl("multinomial.out", SUPA_RANDOM_KERNEL(multinomial_out));
  m.impl("randperm.generator_out", SUPA_RANDOM_KERNEL(randperm_out));
}

}  // namespace random_ops
}  // namespace supa
