// The card's sampling operators on the Philox counters of random_kernels.h: dropout (native and
// CUDA's fused form), multinomial and randperm. Values depend only on (seed, offset, i), as in
// random_ops.cpp.
#include "random_kernels.h"

#include <numeric>

namespace supa {
namespace random_ops {
namespace {


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


}  // namespace

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("native_dropout", SUPA_RANDOM_KERNEL(native_dropout));
  m.impl("_fused_dropout", SUPA_RANDOM_KERNEL(fused_dropout));
  m.impl("multinomial", SUPA_RANDOM_KERNEL(multinomial));
  m.impl("multinomial.out", SUPA_RANDOM_KERNEL(multinomial_out));
  m.impl("randperm.generator_out", SUPA_RANDOM_KERNEL(randperm_out));
}

}  // namespace random_ops
}  // namespace supa
