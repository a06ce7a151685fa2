// CUDA kernels of swiglu_linear.
//
// Forward: one of two paths, chosen per shape by the measured table kSwiGLUTable (core/gemm_cuda.cu, swiglu_choice;
// the test hook gemm_sm90 overrides it):
//   fused     bfloat16 on an sm90 GPU with opforge's CUTLASS kernels built: ONE kernel, the GEMM whose epilogue
//             writes y = silu(z[:, 2j]) · z[:, 2j + 1] and, where backward needs it, z = x · Wᵀ + b (core/gemm.h
//             gemm_swiglu; core/gemm_sm90.cuh). The public op (swiglu_linear, run by autograd when no input needs a
//             gradient) asks for y alone, so the kernel may skip z's store entirely; _swiglu_linear_forward (the
//             forward autograd runs when a gradient is needed) asks for both.
//   two-pass  everywhere else (float16, float32, float64, another GPU, a shape or alignment the kernels do not take,
//             or a shape where the table found the fused kernel slower): the GEMM of core/gemm.h (cuBLASLt with the
//             bias epilogue), then swiglu_interleaved_kernel over z (one read of z with 16-byte loads, its (gate, up)
//             pairs adjacent; the strided gate/up views through opforge.swiglu would be copied first).
// Backward: swiglu_linear_op::backward (opforge's swiglu_backward, then linear_backward's cuBLAS(Lt) GEMMs).
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "core/activation.h"
#include "core/dispatch.h"
#include "core/gemm.h"
#include "core/map_cuda.cuh"
#include "ops/swiglu_linear/swiglu_linear.h"

namespace opforge {
namespace {

/// y[j] = silu(z[2j]) · z[2j + 1] for j < n, z contiguous [2n] (swiglu_linear's interleaved (gate, up) pairs), in
/// opmath. W = 2: 16-byte loads of z (P = vec_size / 2 pairs) and P-wide stores of y; W = 1: element by element.
template <int W, typename scalar_t>
__global__ void swiglu_interleaved_kernel(const scalar_t* __restrict__ z, scalar_t* __restrict__ y, int64_t n) {
  using opmath_t = at::opmath_type<scalar_t>;
  constexpr int P = W == 1 ? 1 : cuda::vec_size<scalar_t>() / 2;
  const auto pair = [](opmath_t g, opmath_t u) { return static_cast<scalar_t>(act::value<Activation::kSiLU>(g) * u); };
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t nvec = W == 1 ? 0 : n / P;
  for (int64_t v = first; v < nvec; v += stride) {
    const cuda::Vec<scalar_t, 2 * P> in = reinterpret_cast<const cuda::Vec<scalar_t, 2 * P>*>(z)[v];
    cuda::Vec<scalar_t, P> out;
    cuda::each_lane<P>([&](int k) {
      out.val[k] = pair(static_cast<opmath_t>(in.val[2 * k]), static_cast<opmath_t>(in.val[2 * k + 1]));
    });
    reinterpret_cast<cuda::Vec<scalar_t, P>*>(y)[v] = out;
  }
  for (int64_t j = nvec * P + first; j < n; j += stride) {
    y[j] = pair(static_cast<opmath_t>(z[2 * j]), static_cast<opmath_t>(z[2 * j + 1]));
  }
}

/// y = swiglu over the interleaved columns of Z [M, 2I] (contiguous): [M, I], contiguous. One pass, reading z once
/// with 16-byte loads (the strided (gate, up) views of swiglu_of_interleaved would be copied first).
at::Tensor swiglu_of_interleaved_cuda(const at::Tensor& Z) {
  at::Tensor Y = at::empty({Z.size(0), Z.size(1) / 2}, Z.options());
  const int64_t n = Y.numel();
  OPFORGE_DISPATCH_FLOATING(Z.scalar_type(), "opforge::swiglu_linear", [&] {
    const scalar_t* z = Z.const_data_ptr<scalar_t>();
    scalar_t* y = Y.mutable_data_ptr<scalar_t>();
    constexpr int P = cuda::vec_size<scalar_t>() / 2;
    const bool vectorize = cuda::is_aligned16(z) && reinterpret_cast<uintptr_t>(y) % (sizeof(scalar_t) * P) == 0;
    cuda::launch_vec_or_scalar<P>(Z.device(), n, vectorize, [&](auto w, int64_t blocks, cudaStream_t stream) {
      swiglu_interleaved_kernel<decltype(w)::value == 1 ? 1 : 2, scalar_t>
          <<<blocks, cuda::kMapThreads, 0, stream>>>(z, y, n);
    });
  });
  return Y;
}

/// y and z (z undefined where !want_z and the fused kernel ran: nothing reads it).
std::tuple<at::Tensor, at::Tensor> forward_impl(const at::Tensor& input, const at::Tensor& weight,
                                                const std::optional<at::Tensor>& bias, bool want_z) {
  const auto p = swiglu_linear_op::check("swiglu_linear", input, weight, bias);
  c10::cuda::CUDAGuard guard(input.device());
  gemm::check_int_dims("swiglu_linear", p.M, p.K, p.N);
  const auto lead = input.sizes().slice(0, input.dim() - 1);
  std::vector<int64_t> y_shape(lead.begin(), lead.end()), z_shape(lead.begin(), lead.end());
  y_shape.push_back(p.N / 2);
  z_shape.push_back(p.N);
  at::Tensor Y = at::empty({p.M, p.N / 2}, p.X.options());
  if (p.M == 0 || p.N == 0) return {Y.view(y_shape), at::empty({p.M, p.N}, p.X.options()).view(z_shape)};
  if (p.K > 0 && !want_z && gemm::gemm_swiglu(at::Tensor(), Y, p.X, p.W, p.b)) return {Y.view(y_shape), at::Tensor()};
  at::Tensor Z = at::empty({p.M, p.N}, p.X.options());
  if (p.K > 0 && want_z && gemm::gemm_swiglu(Z, Y, p.X, p.W, p.b)) return {Y.view(y_shape), Z.view(z_shape)};
  gemm::GemmArgs args;
  args.trans_b = true;
  args.bias = p.b;
  gemm::gemm(Z, p.X, p.W, args);
  Y = swiglu_of_interleaved_cuda(Z);
  return {Y.view(y_shape), Z.view(z_shape)};
}

std::tuple<at::Tensor, at::Tensor> forward_cuda(const at::Tensor& input, const at::Tensor& weight,
                                                const std::optional<at::Tensor>& bias) {
  return forward_impl(input, weight, bias, /*want_z=*/true);
}

at::Tensor swiglu_linear_cuda(const at::Tensor& input, const at::Tensor& weight,
                              const std::optional<at::Tensor>& bias) {
  return std::get<0>(forward_impl(input, weight, bias, /*want_z=*/false));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> swiglu_linear_backward_cuda(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight, const at::Tensor& pre_activation,
    std::array<bool, 3> output_mask, std::optional<at::ScalarType> bias_dtype) {
  c10::cuda::CUDAGuard guard(input.device());
  return swiglu_linear_op::backward(grad_output, input, weight, pre_activation, output_mask, bias_dtype);
}

}  // namespace

TORCH_LIBRARY_IMPL(opforge, CUDA, m) {
  m.impl("swiglu_linear", &swiglu_linear_cuda);
  m.impl("_swiglu_linear_forward", &forward_cuda);
  m.impl("swiglu_linear_backward", &swiglu_linear_backward_cuda);
}

}  // namespace opforge
