// CUDA kernels of swiglu: the math as functors, run by the shared vectorized elementwise kernels of
// core/map_cuda.cuh (16-byte loads/stores, scalar tail, fp32 opmath). Backward is one fused pass. Inputs
// that are row-strided views (gate/up as column slices of one fused projection) are read in place.
#include <torch/library.h>

#include "core/activation.h"
#include "core/dispatch.h"
#include "core/layout.h"
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
  auto [G, U] = check_swiglu("swiglu", gate, up);  // gate's shape, gate's dtype, any layout
  at::Tensor Y = at::empty(G.sizes(), G.options());  // contiguous
  const int64_t cols = G.dim() == 0 ? 1 : G.size(-1);
  OPFORGE_DISPATCH_FLOATING(G.scalar_type(), "opforge::swiglu", [&] {
    if (G.is_contiguous() && U.is_contiguous()) {
      cuda::launch_binary<scalar_t>(G, U, G.numel(), Y, SwigluOp{});
    } else {  // e.g. gate/up as column views [..., :I], [..., I:] of one fused gate/up projection
      const auto [g, sg] = rows_or_contiguous(G);
      const auto [u, su] = rows_or_contiguous(U);
      cuda::launch_binary_rows<scalar_t>(g, sg, u, su, cols, Y, SwigluOp{});
    }
  });
  return Y;
}

std::tuple<at::Tensor, at::Tensor> swiglu_backward_cuda(const at::Tensor& grad_output, const at::Tensor& gate,
                                                        const at::Tensor& up) {
  auto [dY, G, U] = check_swiglu_backward(grad_output, gate, up);  // gate's shape and dtype, any layout
  at::Tensor dG = at::empty(G.sizes(), G.options());  // contiguous
  at::Tensor dU = at::empty(G.sizes(), G.options());
  const int64_t cols = G.dim() == 0 ? 1 : G.size(-1);
  OPFORGE_DISPATCH_FLOATING(G.scalar_type(), "opforge::swiglu_backward", [&] {
    if (dY.is_contiguous() && G.is_contiguous() && U.is_contiguous()) {
      cuda::launch_map3_to2<scalar_t>(dY, G, U, dG, dU, SwigluBackwardOp{});
    } else {
      const auto [dy, sdy] = rows_or_contiguous(dY);
      const auto [g, sg] = rows_or_contiguous(G);
      const auto [u, su] = rows_or_contiguous(U);
      cuda::launch_map3_to2_rows<scalar_t>(dy, sdy, g, sg, u, su, cols, dG, dU, SwigluBackwardOp{});
    }
  });
  return {dG, dU.to(up.scalar_type())};
}

}  // namespace

TORCH_LIBRARY_IMPL(opforge, CUDA, m) {
  m.impl("swiglu", &swiglu_cuda);
  m.impl("swiglu_backward", &swiglu_backward_cuda);
}

}  // namespace opforge
