// The PrivateUse1 hooks through which PyTorch's generic code asks the `supa` backend about
// availability, generators, pinned memory and storage resizing.
#pragma once

namespace supa {

void register_hooks();

}  // namespace supa
