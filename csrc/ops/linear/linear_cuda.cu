// CUDA kernels of linear: cuBLAS GEMMs (cublasGemmEx) on torch's cuBLAS handle and the current stream.
//
// Numerics: float16/bfloat16 multiply in tensor cores and accumulate in fp32 (CUBLAS_COMPUTE_32F);
// float32 uses TF32 only when torch allows it (torch.backends.cuda.matmul.allow_tf32); float64 in fp64.
// grad_bias is a row reduction accumulated in fp32 (ATen's sum with an fp32 result, rounded once).
// No host synchronization and only caching-allocator memory: capturable in CUDA graphs.
#include <ATen/Context.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/Exceptions.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <climits>

#include "core/check.h"
#include "ops/linear/linear.h"

namespace opforge {
namespace {

struct GemmTypes {
  cudaDataType_t data;          // A, B and C storage type
  cublasComputeType_t compute;  // accumulation
  bool double_scalars;          // alpha/beta are double (COMPUTE_64F) rather than float
};

GemmTypes gemm_types(at::ScalarType t) {
  switch (t) {
    case at::kDouble:
      return {CUDA_R_64F, CUBLAS_COMPUTE_64F, true};
    case at::kFloat: {
      // TF32 only where torch allows it for CUDA matmuls (torch.backends.cuda.matmul.allow_tf32 /
      // fp32_precision), read the way ATen's own cuBLAS(Lt) GEMMs read it
      const bool tf32 = at::globalContext().float32Precision(at::Float32Backend::CUDA, at::Float32Op::MATMUL) ==
                        at::Float32Precision::TF32;
      return {CUDA_R_32F, tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F, false};
    }
    case at::kHalf:
      return {CUDA_R_16F, CUBLAS_COMPUTE_32F, false};
    case at::kBFloat16:
      return {CUDA_R_16BF, CUBLAS_COMPUTE_32F, false};
    default:
      TORCH_INTERNAL_ASSERT(false, "opforge::linear: no cuBLAS type for ", t, " (the checker admits floating only)");
  }
  return {};
}

/// Raises unless the problem's dims fit cuBLAS's int arguments.
void check_int_dims(const char* op, int64_t M, int64_t K, int64_t N) {
  constexpr int64_t kMax = INT_MAX;
  TORCH_CHECK(M <= kMax && K <= kMax && N <= kMax, "opforge::", op,
              ": expected M (rows of input: the product of its leading dims), K (in_features) and N (out_features) "
              "each at most ",
              num_str(kMax), " (cuBLAS takes int dimensions), but got M = ", num_str(M), ", K = ", num_str(K), ", N = ", num_str(N),
              "; split the input's rows into smaller calls");
}

/// C[m, n] = op(A)[m, k] · op(B)[k, n] (+ C when accumulate), all row-major and contiguous:
/// A is stored [m, k] ([k, m] when trans_a), B is stored [k, n] ([n, k] when trans_b), C is [m, n].
/// cuBLAS is column-major, where a row-major [r, c] matrix reads as its [c, r] transpose, so this runs
/// Cᵀ[n, m] = op(B)ᵀ · op(A)ᵀ. Empty outputs launch nothing; k == 0 (an empty sum) zero-fills C
/// unless accumulating (cuBLAS rejects zero dims, so they never reach it).
void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const at::Tensor& A,  // see above
          const at::Tensor& B, at::Tensor& C, bool accumulate) {
  TORCH_INTERNAL_ASSERT(A.is_contiguous() && B.is_contiguous() && C.is_contiguous());
  TORCH_INTERNAL_ASSERT(A.scalar_type() == C.scalar_type() && B.scalar_type() == C.scalar_type());
  if (m == 0 || n == 0) return;
  if (k == 0) {
    if (!accumulate) C.zero_();
    return;
  }
  TORCH_INTERNAL_ASSERT(m <= INT_MAX && n <= INT_MAX && k <= INT_MAX);  // check_int_dims ran first
  const int M = static_cast<int>(m), N = static_cast<int>(n), K = static_cast<int>(k);
  const GemmTypes types = gemm_types(C.scalar_type());
  const double alpha_d = 1.0, beta_d = accumulate ? 1.0 : 0.0;
  const float alpha_f = 1.0f, beta_f = accumulate ? 1.0f : 0.0f;
  const void* alpha = types.double_scalars ? static_cast<const void*>(&alpha_d) : static_cast<const void*>(&alpha_f);
  const void* beta = types.double_scalars ? static_cast<const void*>(&beta_d) : static_cast<const void*>(&beta_f);

  c10::cuda::CUDAGuard guard(C.device());
  cublasHandle_t handle = at::cuda::getCurrentCUDABlasHandle();  // torch's handle: workspace + math mode set
  TORCH_CUDABLAS_CHECK(cublasSetStream(handle, at::cuda::getCurrentCUDAStream()));
  TORCH_CUDABLAS_CHECK(cublasSetPointerMode(handle, CUBLAS_POINTER_MODE_HOST));
  TORCH_CUDABLAS_CHECK(cublasGemmEx(handle, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, trans_a ? CUBLAS_OP_T : CUBLAS_OP_N,
                                    N, M, K, alpha,                                         //
                                    B.const_data_ptr(), types.data, trans_b ? K : N,        // op(B)ᵀ
                                    A.const_data_ptr(), types.data, trans_a ? M : K, beta,  // op(A)ᵀ
                                    C.mutable_data_ptr(), types.data, N,                    // Cᵀ
                                    types.compute, CUBLAS_GEMM_DEFAULT));
}

at::ScalarType opmath_dtype(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

at::Tensor linear_cuda(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  linear_op::check_linear_args("linear", input, weight, bias);  // before the guard: names a device mismatch
  c10::cuda::CUDAGuard guard(input.device());
  const auto p = linear_op::check_linear(input, weight, bias);
  check_int_dims("linear", p.M, p.K, p.N);
  std::vector<int64_t> out_sizes = input.sizes().vec();  // (*, N)
  out_sizes.back() = p.N;
  at::Tensor Y = at::empty({p.M, p.N}, p.X.options());  // [M, N]
  if (Y.numel() == 0) return Y.view(out_sizes);
  // Y = b (broadcast over rows), then Y += X · Wᵀ with beta = 1; without bias Y = X · Wᵀ.
  const bool has_bias = p.b.defined();
  if (has_bias) Y.copy_(p.b.expand({p.M, p.N}));
  gemm(/*trans_a=*/false, /*trans_b=*/true, p.M, p.N, p.K, p.X, p.W, Y, /*accumulate=*/has_bias);
  return Y.view(out_sizes);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_backward_cuda(const at::Tensor& grad_output,
                                                                    const at::Tensor& input, const at::Tensor& weight,
                                                                    std::array<bool, 3> output_mask,
                                                                    std::optional<at::ScalarType> bias_dtype) {
  linear_op::check_linear_backward_args(grad_output, input, weight, bias_dtype);
  c10::cuda::CUDAGuard guard(input.device());
  const auto p = linear_op::check_linear_backward(grad_output, input, weight, bias_dtype);
  check_int_dims("linear_backward", p.M, p.K, p.N);
  const auto options = p.X.options();
  at::Tensor grad_input, grad_weight, grad_bias;
  if (output_mask[0]) {
    at::Tensor dX = at::empty({p.M, p.K}, options);  // [M, K] = dY[M, N] · W[N, K]
    gemm(/*trans_a=*/false, /*trans_b=*/false, p.M, p.K, p.N, p.dY, p.W, dX, false);
    grad_input = dX.view(input.sizes());
  }
  if (output_mask[1]) {
    // [N, K] = dY[M, N]ᵀ · X[M, K], in the wider of input's and weight's dtypes (an fp16 input with an
    // fp32 weight accumulates and stores in fp32), rounded once to weight's dtype
    const auto dt = at::promote_types(p.dY.scalar_type(), weight.scalar_type());
    at::Tensor dW = at::empty({p.N, p.K}, options.dtype(dt));
    gemm(/*trans_a=*/true, /*trans_b=*/false, p.N, p.K, p.M, p.dY.to(dt), p.X.to(dt), dW, false);
    grad_weight = dW.to(weight.scalar_type());
  }
  if (output_mask[2]) {
    // db[N] = Σ_rows dY, accumulated in fp32 (fp64 for fp64), rounded once; zeros when M == 0
    grad_bias = at::sum(p.dY, {0}, /*keepdim=*/false, opmath_dtype(p.dY.scalar_type()))
                    .to(linear_op::grad_bias_dtype(input, bias_dtype));
  }
  return {grad_input, grad_weight, grad_bias};
}

}  // namespace

TORCH_LIBRARY_IMPL(opforge, CUDA, m) {
  m.impl("linear", &linear_cuda);
  m.impl("linear_backward", &linear_backward_cuda);
}

}  // namespace opforge
