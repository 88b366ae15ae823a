// The operators that run in the card's BLAS library (matrix products), with its workspaces.
#pragma once

namespace supa {

// Gives every overload of the BLAS operators its supa kernel; before route_composite_ops_to_cpu_kernels.
void register_blas_ops();

}  // namespace supa
