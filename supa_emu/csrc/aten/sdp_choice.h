// Which kernel scaled_dot_product_attention runs on a SUPA card: flash, memory-efficient or math.
#pragma once

#include <ATen/native/transformers/sdp_utils_cpp.h>

namespace supa {

// The card's choice for these inputs, under the torch.backends / sdpa_kernel switches and
// priority order: the first backend of the order whose constraints the inputs meet. When the
// switches leave none that can serve the call it warns why, backend by backend, and raises
// "No available kernel. Aborting execution.", as PyTorch's CUDA selection does.
at::SDPBackend select_sdp_backend(const sdp::sdp_params& params);

// The answers of torch.backends.cuda.can_use_*_attention for supa inputs (false for others);
// `debug` warns the reason a backend cannot serve the call.
bool can_use_flash_attention(const sdp::sdp_params& params, bool debug);
bool can_use_mem_efficient_attention(const sdp::sdp_params& params, bool debug);
bool can_use_cudnn_attention(const sdp::sdp_params& params, bool debug);

}  // namespace supa
