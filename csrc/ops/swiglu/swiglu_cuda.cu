// CUDA kernels of swiglu and swiglu_packed: the math as functors, run by the shared vectorized elementwise kernels of
// core/map_cuda.cuh (16-byte loads/stores, scalar tail, fp32 opmath). Backward is one fused pass. Inputs
// that are row-strided views (gate/up as column slices of one fused projection) are read in place; swiglu_packed's
// backward writes its two gradient halves into one (*, 2I) buffer through the output row strides.
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

// swiglu_packed: the same functors over the halves input[..., :I], input[..., I:] of one (*, 2I) tensor, read in
// place as row-strided views (another layout: one contiguous copy of input).
at::Tensor swiglu_packed_cuda(const at::Tensor& input) {
  const int64_t I = check_swiglu_packed("swiglu_packed", input).expect_int();
  std::vector<int64_t> shape = input.sizes().vec();
  shape.back() = I;
  at::Tensor Y = at::empty(shape, input.options());  // [*, I], contiguous
  const auto [X, sx] = rows_or_contiguous(input);     // [rows, 2I] by sx
  OPFORGE_DISPATCH_FLOATING(X.scalar_type(), "opforge::swiglu_packed", [&] {
    cuda::launch_binary_rows<scalar_t>(X.narrow(-1, 0, I), sx, X.narrow(-1, I, I), sx, I, Y, SwigluOp{});
  });
  return Y;
}

at::Tensor swiglu_packed_backward_cuda(const at::Tensor& grad_output, const at::Tensor& input) {
  auto [dYs, Is] = check_swiglu_packed_backward(grad_output, input);  // grad_output in input's dtype, any layout
  const int64_t I = Is.expect_int();
  at::Tensor dX = at::empty(input.sizes(), input.options());  // [*, 2I], contiguous
  const auto [dy, sdy] = rows_or_contiguous(dYs);              // [rows, I] by sdy
  const auto [X, sx] = rows_or_contiguous(input);              // [rows, 2I] by sx
  at::Tensor dG = dX.narrow(-1, 0, I), dU = dX.narrow(-1, I, I);  // the halves of dX: [rows, I] by 2I
  OPFORGE_DISPATCH_FLOATING(X.scalar_type(), "opforge::swiglu_packed_backward", [&] {
    cuda::launch_map3_to2_rows<scalar_t>(dy, sdy, X.narrow(-1, 0, I), sx, X.narrow(-1, I, I), sx, I, dG, 2 * I, dU,
                                         2 * I, SwigluBackwardOp{});
  });
  return dX;
}

}  // namespace

TORCH_LIBRARY_IMPL(opforge, CUDA, m) {
  m.impl("swiglu", &swiglu_cuda);
  m.impl("swiglu_backward", &swiglu_backward_cuda);
  m.impl("swiglu_packed", &swiglu_packed_cuda);
  m.impl("swiglu_packed_backward", &swiglu_packed_backward_cuda);
}

}  // namespace opforge
