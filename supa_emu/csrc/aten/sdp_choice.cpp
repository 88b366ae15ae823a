// The card's scaled_dot_product_attention backend choice (`_fused_sdp_choice` for supa).
//
// A SUPA card has flash and memory-efficient attention and no cuDNN (the real torch_supa answers
// _is_flash_attention_available, _can_use_flash_attention and _can_use_mem_efficient_attention).
// The constraints are those PyTorch's CUDA selection applies on an sm80-or-newer GPU, checked in
// its order, under the same switches (torch.backends.cuda.enable_*_sdp, sdpa_kernel, and the
// priority order sdpa_kernel(..., set_priority=True) sets), with the same debug warnings.
//
// What each choice runs on supa is what it runs on a card: flash_attention ->
// aten::_scaled_dot_product_flash_attention (called by supa's scaled_dot_product_attention kernel,
// scaled_dot_product_attention.cpp, since PyTorch's composite calls it for CUDA only),
// efficient_attention -> aten::_scaled_dot_product_efficient_attention, both given card kernels in
// fused_attention.cpp. Two differences from CUDA, both where no supa kernel could serve the call as
// CUDA's does:
// - dropout > 0 is not flash's: flash's values come from PyTorch's CPU flash kernel, which has no
//   dropout; memory-efficient attention (whose host path draws the mask again from the seed and
//   offset it hands its backward) serves it, with the same memory.
// - nested tensors take the math path: no fused supa kernel takes them.
#include "sdp_choice.h"

#include "../runtime/devices.h"

#include <ATen/Context.h>
#include <ATen/native/transformers/attention.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <array>

namespace supa {
namespace sdp_constraints {

using sdp::sdp_params;
using Constraint = bool (*)(const sdp_params&, bool);

bool all_on_supa(const sdp_params& params, bool debug) {
  const bool on_supa = params.query.device().type() == kSupa && params.key.device().type() == kSupa &&
                       params.value.device().type() == kSupa;
  if (!on_supa && debug) {
    TORCH_WARN("All tensors need to be on supa device. Got query on device: ", params.query.device(),
               ", key on device: ", params.key.device(), ", value on device: ", params.value.device());
  }
  return on_supa;
}

bool dense_inputs(const sdp_params& params, bool debug) {
  if (!sdp::has_only_dense_inputs(params)) {
    if (debug) {
      TORCH_WARN("The fused attention kernels of supa do not take nested tensor inputs.");
    }
    return false;
  }
  return true;
}

bool head_dim_flash(const sdp_params& params, bool debug) {
  const auto q = params.query.sym_size(-1);
  const auto k = params.key.sym_size(-1);
  const auto v = params.value.sym_size(-1);
  if (!(q == k && q == v && q <= 256)) {
    if (debug) {
      TORCH_WARN("Flash attention requires q,k,v to have the same last dimension and to be less than or equal to 256.",
                 " Got Query.size(-1): ", q, ", Key.size(-1): ", k, ", Value.size(-1): ", v, " instead.");
    }
    return false;
  }
  return true;
}

bool is_half(const sdp_params& params) {
  return params.query.scalar_type() == at::kHalf || params.query.scalar_type() == at::kBFloat16;
}

// The smallest matrix-product alignment of the card's kernels, in elements (sm80 rule: 128-bit loads).
int64_t gemm_alignment(const sdp_params& params) {
  return is_half(params) ? 8 : 4;
}

bool head_dim_mem_efficient(const sdp_params& params, bool debug) {
  const auto q = params.query.sym_size(-1);
  const auto v = params.value.sym_size(-1);
  const int64_t alignment = gemm_alignment(params);
  if (!(q == params.key.sym_size(-1) && q % alignment == 0 && q > 0 && v % alignment == 0 && v > 0)) {
    if (debug) {
      TORCH_WARN("Mem efficient attention requires last dimension of inputs to be divisible by ", alignment, ". ",
                 "Got Query.size(-1): ", q, ", Key.size(-1): ", params.key.sym_size(-1), ", Value.size(-1): ", v,
                 " instead.");
    }
    return false;
  }
  return true;
}

bool data_alignment_mem_efficient(const sdp_params& params, bool debug) {
  // Card allocations are aligned far beyond the kernel's need: only the storage offsets matter.
  const int64_t alignment_bytes = gemm_alignment(params) * params.query.element_size();
  const auto aligned = [&](const at::Tensor& t) {
    const auto offset_bytes = t.sym_storage_offset() * t.element_size();
    return TORCH_GUARD_OR_FALSE(t.sym_numel().sym_eq(0)) ||
           TORCH_GUARD_OR_TRUE((offset_bytes % alignment_bytes).sym_eq(0));
  };
  if (!aligned(params.query) || !aligned(params.key) || !aligned(params.value)) {
    if (debug) {
      TORCH_WARN("Mem efficient attention on sm80 or newer requires q, k, and v storage offsets * element_size to be ",
                 "aligned to ", alignment_bytes, " bytes.");
    }
    return false;
  }
  return true;
}

bool causal_square_seqlens(const sdp_params& params, bool debug) {
  if (params.is_causal && params.query.sym_size(-2) != params.key.sym_size(-2)) {
    if (debug) {
      TORCH_WARN("Flash attention does not support the is_causal flag when seqlen_q != seqlen_k. ",
                 "Got seqlen_q: ", params.query.sym_size(-2), " seqlen_k: ", params.key.sym_size(-2),
                 ". If you would like to use causal attention with non-square masks, please see CausalAttnMask.");
    }
    return false;
  }
  return true;
}

bool dtypes_flash(const sdp_params& params, bool debug) {
  constexpr std::array<at::ScalarType, 2> allowed{at::kHalf, at::kBFloat16};
  return sdp::check_tensor_dtype(params, allowed, debug);
}

bool dtypes_mem_efficient(const sdp_params& params, bool debug) {
  constexpr std::array<at::ScalarType, 3> allowed{at::kHalf, at::kFloat, at::kBFloat16};
  return sdp::check_tensor_dtype(params, allowed, debug);
}

bool no_dropout_flash(const sdp_params& params, bool debug) {
  if (params.dropout > 0.0) {
    if (debug) {
      TORCH_WARN("Flash attention on supa does not take dropout > 0 (its values come from PyTorch's CPU flash ",
                 "kernel, which has none); memory-efficient attention serves it.");
    }
    return false;
  }
  return true;
}

template <size_t N>
bool all_hold(const std::array<Constraint, N>& constraints, const sdp_params& params, bool debug) {
  for (Constraint constraint : constraints) {
    if (!constraint(params, debug)) {
      return false;
    }
  }
  return true;
}

}  // namespace sdp_constraints

bool can_use_flash_attention(const sdp::sdp_params& params, bool debug) {
  using namespace sdp_constraints;
  constexpr std::array<Constraint, 10> general{
      sdp::check_runtime_disabled_flash,
      all_on_supa,
      sdp::check_tensor_shapes,
      dense_inputs,
      sdp::check_for_attn_mask,
      head_dim_flash,
      causal_square_seqlens,
      dtypes_flash,
      no_dropout_flash,
      sdp::check_nonzero_sequence_lengths_dense,
  };
  constexpr std::array<Constraint, 2> dense{
      sdp::check_batch_size_and_num_heads_dense<true /*supports_gqa*/>,
      sdp::check_last_dim_stride_equals_1_dense<true /*ignore_singleton_dim*/>,
  };
  return all_hold(general, params, debug) && all_hold(dense, params, debug);
}

bool can_use_mem_efficient_attention(const sdp::sdp_params& params, bool debug) {
  using namespace sdp_constraints;
  constexpr std::array<Constraint, 6> general{
      sdp::check_runtime_disabled_mem_efficient,
      all_on_supa,
      sdp::check_tensor_shapes,
      dense_inputs,
      head_dim_mem_efficient,
      data_alignment_mem_efficient,
  };
  constexpr std::array<Constraint, 4> dense{
      sdp::check_nonzero_sequence_lengths_dense,
      sdp::check_last_dim_stride_equals_1_dense<false /*ignore_singleton_dim*/>,
      sdp::check_batch_size_and_num_heads_dense<false /*supports_gqa*/>,
      dtypes_mem_efficient,
  };
  return all_hold(general, params, debug) && all_hold(dense, params, debug);
}

bool can_use_cudnn_attention(const sdp::sdp_params& /*params*/, bool debug) {
  if (debug) {
    TORCH_WARN("Torch was not compiled with cuDNN attention.");
  }
  return false;
}

at::SDPBackend select_sdp_backend(const sdp::sdp_params& params) {
  auto& ctx = at::globalContext();
  if (!ctx.userEnabledMathSDP() && !ctx.userEnabledFlashSDP() && !ctx.userEnabledMemEfficientSDP() &&
      !ctx.userEnabledCuDNNSDP()) {
    return at::SDPBackend::error;
  }
  for (at::SDPBackend backend : ctx.sDPPriorityOrder()) {
    switch (backend) {
      case at::SDPBackend::flash_attention:
        if (can_use_flash_attention(params, false)) {
          return backend;
        }
        break;
      case at::SDPBackend::efficient_attention:
        if (can_use_mem_efficient_attention(params, false)) {
          return backend;
        }
        break;
      case at::SDPBackend::math:
        if (ctx.userEnabledMathSDP()) {
          return backend;
        }
        break;
      default:  // cuDNN: not on a SUPA card; overrideable: not used by supa
        break;
    }
  }
  TORCH_WARN("Memory efficient kernel not used because:");
  can_use_mem_efficient_attention(params, true);
  TORCH_WARN("Flash attention kernel not used because:");
  can_use_flash_attention(params, true);
  TORCH_WARN("cuDNN attention kernel not used because:");
  can_use_cudnn_attention(params, true);
  TORCH_CHECK(false, "No available kernel. Aborting execution.");
  return at::SDPBackend::error;
}

namespace sdp_entry {

sdp::sdp_params params_of(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                          const std::optional<at::Tensor>& attn_mask, double dropout_p, bool is_causal,
                          bool enable_gqa) {
  return sdp::sdp_params{query, key, value, attn_mask, dropout_p, is_causal, enable_gqa};
}

int64_t fused_sdp_choice(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                         const std::optional<at::Tensor>& attn_mask, double dropout_p, bool is_causal,
                         std::optional<double> /*scale*/, bool enable_gqa) {
  return static_cast<int64_t>(
      select_sdp_backend(params_of(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)));
}

}  // namespace sdp_entry

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("_fused_sdp_choice", sdp_entry::fused_sdp_choice);
}

}  // namespace supa

// F.scaled_dot_product_attention asks the stub (torch._fused_sdp_choice asks the operator above).
namespace at::native {
REGISTER_PRIVATEUSE1_DISPATCH(_fused_sdp_choice_stub, &supa::sdp_entry::fused_sdp_choice)
}  // namespace at::native
