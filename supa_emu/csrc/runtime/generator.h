// Per-device random generators, each backed by a CPU generator that holds its state.
#pragma once

#include <ATen/core/Generator.h>
#include <c10/core/Device.h>

namespace supa {

const at::Generator& default_generator(c10::DeviceIndex device);
at::Generator new_generator(c10::DeviceIndex device);
// The CPU generator that backs a supa generator; CPU kernels draw from it.
at::Generator host_generator_of(const at::Generator& supa_generator);

}  // namespace supa
