// "cuda" device strings mean "supa": the native half of transfer_to_supa.
#pragma once

namespace supa {

// While enabled, device strings parsed from Python that start with "cuda" mean "supa".
void set_cuda_means_supa(bool enabled);
bool cuda_means_supa();

}  // namespace supa
