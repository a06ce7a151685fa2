// Elementwise activation passes on CUDA: one instantiation of core/map_cuda.cuh's kernels per
// (dtype, activation), selected by with_activation.
#include "core/activation_cuda.h"

#include "core/dispatch.h"
#include "core/map_cuda.cuh"

namespace opforge {
namespace cuda {

void activation_forward(const at::Tensor& Z, const at::Tensor& Y, Activation act) {
  at::Tensor out = Y;  // a handle: the launchers take a non-const reference
  OPFORGE_DISPATCH_FLOATING(Z.scalar_type(), "opforge::activation_forward", [&] {
    with_activation(act, [&](auto a) { launch_unary<scalar_t>(Z, out, act::Value<decltype(a)::value>{}); });
  });
}

void activation_backward(const at::Tensor& dY, const at::Tensor& Z, const at::Tensor& dZ, Activation act) {
  at::Tensor out = dZ;
  OPFORGE_DISPATCH_FLOATING(dY.scalar_type(), "opforge::activation_backward", [&] {
    with_activation(act, [&](auto a) {
      launch_binary<scalar_t>(dY, Z, dY.numel(), out, act::Backward<decltype(a)::value>{});
    });
  });
}

}  // namespace cuda
}  // namespace opforge
