// CUDA kernels of the gated activations (core/gated.h), templates over the activation A that the op families'
// *_cuda.cu instantiate: the math as functors over core/activation.h, run by the shared vectorized elementwise
// kernels of core/map_cuda.cuh (16-byte loads/stores, scalar tail, fp32 opmath). Backward is one fused pass.
// Inputs that are row-strided views (gate/up as column slices of one fused projection) are read in place; the
// packed backward writes its two gradient halves into one (*, 2I) buffer through the output row strides.
#pragma once

#include <ATen/ATen.h>

#include <tuple>
#include <vector>

#include "core/activation.h"
#include "core/amax_cuda.cuh"
#include "core/dispatch.h"
#include "core/gated.h"
#include "core/layout.h"
#include "core/map_cuda.cuh"

namespace opforge {
namespace cuda {

/// y = act(g) · u
template <Activation A>
struct GatedOp {
  template <typename T>
  __device__ T operator()(T g, T u) const { return act::value<A>(g) * u; }
};

/// dg = (dy · u) · act'(g); du = dy · act(g) (silu: dy · g · σ(g)). act and act' share their transcendental
/// (σ, erf or tanh of the same argument), which the compiler evaluates once.
template <Activation A>
struct GatedBackwardOp {
  template <typename T>
  __device__ void operator()(T dy, T g, T u, T& dg, T& du) const {
    dg = act::backward<A>(dy * u, g);
    if constexpr (A == Activation::kSiLU) {
      du = dy * g * act::sigmoid(g);
    } else {
      du = dy * act::value<A>(g);
    }
  }
};

/// y = act(gate) · up: gate's shape and dtype, contiguous. `op`: the op's name ("swiglu") in errors.
template <Activation A>
at::Tensor gated_forward(const char* op, const at::Tensor& gate, const at::Tensor& up) {
  auto [G, U] = check_gated(op, gate, up);           // gate's shape, gate's dtype, any layout
  at::Tensor Y = at::empty(G.sizes(), G.options());  // contiguous
  const int64_t cols = G.dim() == 0 ? 1 : G.size(-1);
  OPFORGE_DISPATCH_FLOATING(G.scalar_type(), "opforge::gated", [&] {
    if (G.is_contiguous() && U.is_contiguous()) {
      launch_binary<scalar_t>(G, U, G.numel(), Y, GatedOp<A>{});
    } else {  // e.g. gate/up as column views [..., :I], [..., I:] of one fused gate/up projection
      const auto [g, sg] = rows_or_contiguous(G);
      const auto [u, su] = rows_or_contiguous(U);
      launch_binary_rows<scalar_t>(g, sg, u, su, cols, Y, GatedOp<A>{});
    }
  });
  return Y;
}

/// (grad_gate, grad_up), contiguous, grad_up in up's dtype. `op`: the backward op's name ("swiglu_backward").
template <Activation A>
std::tuple<at::Tensor, at::Tensor> gated_backward(const char* op, const at::Tensor& grad_output,
                                                  const at::Tensor& gate, const at::Tensor& up) {
  auto [dY, G, U] = check_gated_backward(op, grad_output, gate, up);  // gate's shape and dtype, any layout
  at::Tensor dG = at::empty(G.sizes(), G.options());                  // contiguous
  at::Tensor dU = at::empty(G.sizes(), G.options());
  const int64_t cols = G.dim() == 0 ? 1 : G.size(-1);
  OPFORGE_DISPATCH_FLOATING(G.scalar_type(), "opforge::gated_backward", [&] {
    if (dY.is_contiguous() && G.is_contiguous() && U.is_contiguous()) {
      launch_map3_to2<scalar_t>(dY, G, U, dG, dU, GatedBackwardOp<A>{});
    } else {
      const auto [dy, sdy] = rows_or_contiguous(dY);
      const auto [g, sg] = rows_or_contiguous(G);
      const auto [u, su] = rows_or_contiguous(U);
      launch_map3_to2_rows<scalar_t>(dy, sdy, g, sg, u, su, cols, dG, dU, GatedBackwardOp<A>{});
    }
  });
  return {dG, dU.to(up.scalar_type())};
}

/// The packed form: the same functors over the halves input[..., :I], input[..., I:] of one (*, 2I) tensor, read
/// in place as row-strided views (another layout: one contiguous copy of input); (*, I) contiguous.
template <Activation A>
at::Tensor gated_packed_forward(const char* op, const at::Tensor& input) {
  const int64_t I = check_gated_packed(op, input).expect_int();
  std::vector<int64_t> shape = input.sizes().vec();
  shape.back() = I;
  at::Tensor Y = at::empty(shape, input.options());  // [*, I], contiguous
  const auto [X, sx] = rows_or_contiguous(input);     // [rows, 2I] by sx
  OPFORGE_DISPATCH_FLOATING(X.scalar_type(), "opforge::gated_packed", [&] {
    launch_binary_rows<scalar_t>(X.narrow(-1, 0, I), sx, X.narrow(-1, I, I), sx, I, Y, GatedOp<A>{});
  });
  return Y;
}

/// out[i] = op(a[r * sa + col], b[r * sb + col]) as map_binary_rows_kernel (its walk and binary_lanes, so the same
/// bits), and the max |out| over the values the block stores atomicMax'ed into *amax (core/amax_cuda.cuh; zeroed
/// beforehand).
/// A 1-D block of kMapThreads threads, all of which reach the reduction (grid-stride loop, no early exit).
template <int VEC, typename scalar_t, typename Op>
__global__ void __launch_bounds__(kMapThreads)
    map_binary_rows_amax_kernel(const scalar_t* __restrict__ a, int64_t sa,  // [n / cols, cols] by sa
                                const scalar_t* __restrict__ b, int64_t sb,  // [n / cols, cols] by sb
                                scalar_t* __restrict__ out,                  // [n]
                                int64_t n, int64_t cols, Op op,
                                typename AmaxBits<scalar_t>::bits_t* __restrict__ amax) {  // [1]
  using bits_t = typename AmaxBits<scalar_t>::bits_t;
  __shared__ bits_t smem[32];
  bits_t m = 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * VEC; i < n; i += stride * VEC) {
    const int64_t r = i / cols, col = i - r * cols;
    const Vec<scalar_t, VEC> y = binary_lanes<VEC>(a + r * sa + col, b + r * sb + col, out + i, op);
#pragma unroll
    for (int k = 0; k < VEC; ++k) amax_fold(m, y.val[k]);
  }
  block_amax_atomic(m, amax, smem);
}

/// gated_packed_forward plus amax = max |y| over its output as stored ([1] float32, float64 for float64; NaN if any y
/// is NaN, else inf if any is inf; 0 when empty), reduced in the same kernel as the output is written (one atomicMax
/// per block into a memset-zeroed word): (output, amax). The output's bits are gated_packed_forward's.
template <Activation A>
std::tuple<at::Tensor, at::Tensor> gated_packed_forward_amax(const char* op, const at::Tensor& input) {
  const int64_t I = check_gated_packed(op, input).expect_int();
  std::vector<int64_t> shape = input.sizes().vec();
  shape.back() = I;
  at::Tensor Y = at::empty(shape, input.options());  // [*, I], contiguous
  c10::cuda::CUDAGuard guard(input.device());
  at::Tensor amax = zeroed_amax_tensor(Y);
  const auto [X, sx] = rows_or_contiguous(input);  // [rows, 2I] by sx
  OPFORGE_DISPATCH_FLOATING(X.scalar_type(), "opforge::gated_packed_amax", [&] {
    using bits_t = typename AmaxBits<scalar_t>::bits_t;
    const int64_t n = Y.numel();
    const scalar_t* g = X.const_data_ptr<scalar_t>();
    const scalar_t* u = g + I;
    scalar_t* y = Y.mutable_data_ptr<scalar_t>();
    bits_t* word = reinterpret_cast<bits_t*>(amax.mutable_data_ptr());
    constexpr int VEC = vec_size<scalar_t>();
    const bool vectorize = rows_vectorizable<VEC>(g, I, sx) && rows_vectorizable<VEC>(u, I, sx) &&
                           rows_vectorizable<VEC>(y, I, I);
    launch_vec_or_scalar<VEC>(X.device(), n, vectorize, [&](auto w, int64_t blocks, cudaStream_t stream) {
      map_binary_rows_amax_kernel<decltype(w)::value>
          <<<blocks, kMapThreads, 0, stream>>>(g, sx, u, sx, y, n, I, GatedOp<A>{}, word);
    });
  });
  return {Y, amax};
}

/// grad_input (*, 2I) of the packed form, contiguous in input's dtype, both halves written by one pass.
template <Activation A>
at::Tensor gated_packed_backward(const char* op, const at::Tensor& grad_output, const at::Tensor& input) {
  auto [dYs, Is] = check_gated_packed_backward(op, grad_output, input);  // grad_output in input's dtype, any layout
  const int64_t I = Is.expect_int();
  at::Tensor dX = at::empty(input.sizes(), input.options());      // [*, 2I], contiguous
  const auto [dy, sdy] = rows_or_contiguous(dYs);                  // [rows, I] by sdy
  const auto [X, sx] = rows_or_contiguous(input);                  // [rows, 2I] by sx
  at::Tensor dG = dX.narrow(-1, 0, I), dU = dX.narrow(-1, I, I);  // the halves of dX: [rows, I] by 2I
  OPFORGE_DISPATCH_FLOATING(X.scalar_type(), "opforge::gated_packed_backward", [&] {
    launch_map3_to2_rows<scalar_t>(dy, sdy, X.narrow(-1, 0, I), sx, X.narrow(-1, I, I), sx, I, dG, 2 * I, dU, 2 * I,
                                   GatedBackwardOp<A>{});
  });
  return dX;
}

}  // namespace cuda
}  // namespace opforge
