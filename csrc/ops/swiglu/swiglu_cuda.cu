// CUDA kernels of swiglu: the math as functors, run by the shared vectorized elementwise kernels of
// core/map_cuda.cuh (16-byte loads/stores, scalar tail, fp32 opmath). Backward is one fused pass.
#include <torch/library.h>

#include "core/activation.h"
#include "core/dispatch.h"
#include "core/map_cuda.cuh"
#include "ops/swiglu/swiglu.h"

namespace opforge {
namespace {

// y = silu(g) · u
struct SwigluOp {
  template <typename T>
  __device__ T operator()(T g, T u) const { return act::value<Activation::kSiLU>(g) * u; }
};

// dg = (dy · u) · silu'(g) = dy · u · s · (1 + g · (1 − s)); du = dy · g · s, s = σ(g)
struct SwigluBackwardOp {
  template <typename T>
  __device__ void operator()(T dy, T g, T u, T& dg, T& du) const {
    dg = act::backward<Activation::kSiLU>(dy * u, g);
    du = dy * g * act::sigmoid(g);
  }
};

at::Tensor swiglu_cuda(const at::Tensor& gate, const at::Tensor& up) {
  auto [G, U] = check_swiglu("swiglu", gate, up);  // [n], [n]
  at::Tensor Y = at::empty_like(G);
  OPFORGE_DISPATCH_FLOATING(G.scalar_type(), "opforge::swiglu",
                            [&] { cuda::launch_binary<scalar_t>(G, U, G.numel(), Y, SwigluOp{}); });
  return Y;
}

std::tuple<at::Tensor, at::Tensor> swiglu_backward_cuda(const at::Tensor& grad_output, const at::Tensor& gate,
                                                        const at::Tensor& up) {
  auto [dY, G, U] = check_swiglu_backward(grad_output, gate, up);  // [n] each, gate's dtype
  at::Tensor dG = at::empty_like(G);
  at::Tensor dU = at::empty_like(G);
  OPFORGE_DISPATCH_FLOATING(G.scalar_type(), "opforge::swiglu_backward",
                            [&] { cuda::launch_map3_to2<scalar_t>(dY, G, U, dG, dU, SwigluBackwardOp{}); });
  return {dG, dU.to(up.scalar_type())};
}

}  // namespace

TORCH_LIBRARY_IMPL(opforge, CUDA, m) {
  m.impl("swiglu", &swiglu_cuda);
  m.impl("swiglu_backward", &swiglu_backward_cuda);
}

}  // namespace opforge
