// CUDA kernels of linear_cat: cublasGemmEx piece by piece on torch's cuBLAS handle and current stream.
//
// Forward, Y[M, N] = Σ_i X_i · W_iᵀ + b with W_i = W[:, k_i : k_i + K_i] read in place (leading dimension K):
//   one piece        (or one of non-zero width, any dtype) as below: C = Y directly, cuBLAS rounds once.
//   float32/float64  Y starts as the bias (or the first GEMM writes it with beta = 0); every further piece
//                    accumulates into Y with beta = 1 (Y is already the opmath type).
//   float16/bfloat16 the pieces accumulate into a float32 buffer C (cublasGemmEx with 16-bit A, B and a float32
//                    C, CUBLAS_COMPUTE_32F, beta = 1), which starts as the bias; one pass rounds C to Y. The
//                    buffer covers at most kAccRows(N) rows at a time (≤ 2²⁴ floats, 64 MiB), so its size is
//                    bounded whatever M is; rows are done block by block.
// Backward: dX_i = dY · W_i (one GEMM per piece, W_i read in place); dW[:, k_i : k_i + K_i] = dYᵀ · X_i written
// straight into the column slice of one dW (ldc = K); db = Σ_rows dY through ATen's fp32-accumulated sum.
// No host synchronisation, only caching-allocator memory.
#include <ATen/Context.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/Exceptions.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <climits>

#include "core/check.h"
#include "ops/linear_cat/linear_cat.h"

namespace opforge {
namespace {

cudaDataType_t cuda_type(at::ScalarType t) {
  switch (t) {
    case at::kDouble: return CUDA_R_64F;
    case at::kFloat: return CUDA_R_32F;
    case at::kHalf: return CUDA_R_16F;
    case at::kBFloat16: return CUDA_R_16BF;
    default: TORCH_INTERNAL_ASSERT(false, "opforge::linear_cat: no cuBLAS type for ", t);
  }
  return CUDA_R_32F;
}

cublasComputeType_t compute_type(at::ScalarType t) {
  if (t == at::kDouble) return CUBLAS_COMPUTE_64F;
  if (t == at::kFloat) {
    const bool tf32 = at::globalContext().float32Precision(at::Float32Backend::CUDA, at::Float32Op::MATMUL) ==
                      at::Float32Precision::TF32;
    return tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  }
  return CUBLAS_COMPUTE_32F;
}

void check_int(const char* what, int64_t v) {
  TORCH_CHECK(v <= INT_MAX, "opforge::linear_cat: expected ", what, " at most ", num_str(int64_t{INT_MAX}),
              " (cuBLAS takes int dimensions), but got ", num_str(v), "; split the rows into smaller calls");
}

/// Row-major C[m, n] (leading dimension ldc) = op(A)[m, k] · op(B)[k, n] + beta · C. A is stored [m, k] ([k, m]
/// when trans_a) with leading dimension lda, B stored [k, n] ([n, k] when trans_b) with ldb; A and B of type
/// `ab`, C of type `c` (float32 C with 16-bit A, B is cuBLAS's mixed GEMM). Runs the column-major
/// Cᵀ = op(B)ᵀ · op(A)ᵀ. m, n, k > 0 (callers skip empty problems).
void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const void* A, int64_t lda, const void* B,
          int64_t ldb, at::ScalarType ab, void* C, int64_t ldc, at::ScalarType c, bool accumulate) {
  check_int("M", m);
  check_int("N", n);
  check_int("K", k);
  check_int("a leading dimension", std::max({lda, ldb, ldc}));
  const double alpha_d = 1.0, beta_d = accumulate ? 1.0 : 0.0;
  const float alpha_f = 1.0f, beta_f = accumulate ? 1.0f : 0.0f;
  const bool dbl = ab == at::kDouble;
  const void* alpha = dbl ? static_cast<const void*>(&alpha_d) : static_cast<const void*>(&alpha_f);
  const void* beta = dbl ? static_cast<const void*>(&beta_d) : static_cast<const void*>(&beta_f);
  cublasHandle_t handle = at::cuda::getCurrentCUDABlasHandle();
  TORCH_CUDABLAS_CHECK(cublasSetStream(handle, at::cuda::getCurrentCUDAStream()));
  TORCH_CUDABLAS_CHECK(cublasSetPointerMode(handle, CUBLAS_POINTER_MODE_HOST));
  TORCH_CUDABLAS_CHECK(cublasGemmEx(handle, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, trans_a ? CUBLAS_OP_T : CUBLAS_OP_N,
                                    static_cast<int>(n), static_cast<int>(m), static_cast<int>(k), alpha,  //
                                    B, cuda_type(ab), static_cast<int>(ldb),                              // op(B)ᵀ
                                    A, cuda_type(ab), static_cast<int>(lda), beta,                        // op(A)ᵀ
                                    C, cuda_type(c), static_cast<int>(ldc),                               // Cᵀ
                                    compute_type(ab), CUBLAS_GEMM_DEFAULT));
}

/// Leading dimension of a BLAS-ready 2-D [r, c] tensor (row stride, at least max(1, c)).
int64_t ld(const at::Tensor& t) { return std::max<int64_t>({t.stride(0), t.size(1), 1}); }

/// Rows of the float32 accumulation buffer per block: ≤ 2²⁴ floats.
int64_t acc_rows(int64_t M, int64_t N) {
  constexpr int64_t kMaxFloats = int64_t{1} << 24;
  return std::max<int64_t>(1, std::min<int64_t>(M, kMaxFloats / std::max<int64_t>(N, 1)));
}

/// C[rows, N] (+)= Σ_i X_i[r0 : r0 + rows] · W_iᵀ. C starts as the bias when there is one (accumulate from the
/// first piece), else the first non-empty piece writes it; C is zero-filled when no piece contributes.
void accumulate_pieces(const linear_cat_op::LinearCatProblem& p, int64_t r0, int64_t rows, at::Tensor& C) {
  const auto ab = p.W.scalar_type();
  bool written = p.b.defined();
  if (written) C.copy_(p.b.to(C.scalar_type()).expand({rows, p.N}));
  const int64_t esz = p.W.element_size();
  for (size_t i = 0; i < p.X.size(); ++i) {
    if (p.Ki[i] == 0) continue;
    const auto* A = static_cast<const char*>(p.X[i].const_data_ptr()) + r0 * p.X[i].stride(0) * esz;
    const auto* B = static_cast<const char*>(p.W.const_data_ptr()) + p.k0[i] * esz;
    gemm(false, true, rows, p.N, p.Ki[i], A, ld(p.X[i]), B, ld(p.W), ab, C.mutable_data_ptr(), p.N,
         C.scalar_type(), written);
    written = true;
  }
  if (!written) C.zero_();
}

at::Tensor linear_cat_cuda(at::TensorList inputs, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  const auto p = linear_cat_op::check_linear_cat(inputs, weight, bias, /*contiguous=*/true);
  c10::cuda::CUDAGuard guard(inputs[0].device());
  const auto dtype = inputs[0].scalar_type();
  std::vector<int64_t> out_sizes(inputs[0].sizes().begin(), inputs[0].sizes().end() - 1);
  out_sizes.push_back(p.N);
  at::Tensor Y = at::empty({p.M, p.N}, inputs[0].options());
  if (p.M == 0 || p.N == 0) return Y.view(out_sizes);
  int64_t nonempty = 0;
  for (const int64_t k : p.Ki) nonempty += k > 0 ? 1 : 0;
  if (dtype == at::kFloat || dtype == at::kDouble || nonempty <= 1) {
    // opmath output, or a single product: cuBLAS's fp32 alpha·A·B + beta·C (C = the bias) rounds once
    accumulate_pieces(p, 0, p.M, Y);
  } else {
    const int64_t R = acc_rows(p.M, p.N);
    at::Tensor C = at::empty({R, p.N}, inputs[0].options().dtype(at::kFloat));
    for (int64_t r0 = 0; r0 < p.M; r0 += R) {
      const int64_t rows = std::min(R, p.M - r0);
      at::Tensor Cr = C.narrow(0, 0, rows);
      accumulate_pieces(p, r0, rows, Cr);
      Y.narrow(0, r0, rows).copy_(Cr);  // the one rounding to the output dtype
    }
  }
  return Y.view(out_sizes);
}

std::tuple<std::vector<at::Tensor>, at::Tensor, at::Tensor> linear_cat_backward_cuda(
    const at::Tensor& grad_output, at::TensorList inputs, const at::Tensor& weight, std::array<bool, 3> output_mask,
    std::optional<at::ScalarType> bias_dtype) {
  linear_cat_op::check_linear_cat_backward_args(grad_output, inputs, weight, bias_dtype);
  const auto p = linear_cat_op::check_linear_cat(inputs, weight, std::nullopt, /*contiguous=*/true);
  c10::cuda::CUDAGuard guard(inputs[0].device());
  const auto dtype = inputs[0].scalar_type();
  const at::Tensor dY = linear_cat_op::grad_output_2d(grad_output, p, /*contiguous=*/true);  // [M, N]
  const int64_t esz = p.W.element_size();
  std::vector<at::Tensor> grad_inputs;
  at::Tensor grad_weight, grad_bias;
  if (output_mask[0]) {
    for (size_t i = 0; i < p.X.size(); ++i) {
      at::Tensor dX = at::empty({p.M, p.Ki[i]}, inputs[i].options());  // dX_i = dY · W_i
      if (p.M > 0 && p.Ki[i] > 0) {
        if (p.N == 0) {
          dX.zero_();
        } else {
          const auto* B = static_cast<const char*>(p.W.const_data_ptr()) + p.k0[i] * esz;
          gemm(false, false, p.M, p.Ki[i], p.N, dY.const_data_ptr(), ld(dY), B, ld(p.W), dtype, dX.mutable_data_ptr(),
               p.Ki[i], dtype, false);
        }
      }
      grad_inputs.push_back(dX.view(inputs[i].sizes()));
    }
  }
  if (output_mask[1]) {
    // dW[:, k_i : k_i + K_i] = dYᵀ · X_i, written in place (ldc = K). A float32 weight with 16-bit inputs gets
    // cuBLAS's float32 output directly; other mixed dtypes go through one buffer in the inputs' dtype.
    const auto wt = weight.scalar_type();
    const bool direct = wt == dtype || (wt == at::kFloat && dtype != at::kDouble);
    at::Tensor dW = at::empty({p.N, p.K}, weight.options().dtype(direct ? wt : dtype));
    if (p.N > 0 && p.K > 0) {
      if (p.M == 0) {
        dW.zero_();
      } else {
        for (size_t i = 0; i < p.X.size(); ++i) {
          if (p.Ki[i] == 0) continue;
          auto* C = static_cast<char*>(dW.mutable_data_ptr()) + p.k0[i] * dW.element_size();
          gemm(true, false, p.N, p.Ki[i], p.M, dY.const_data_ptr(), ld(dY), p.X[i].const_data_ptr(), ld(p.X[i]),
               dtype, C, p.K, dW.scalar_type(), false);
        }
      }
    }
    grad_weight = direct ? dW : dW.to(wt);
  }
  if (output_mask[2]) {
    const auto acc = dtype == at::kDouble ? at::kDouble : at::kFloat;
    grad_bias = at::sum(dY, {0}, /*keepdim=*/false, acc).to(bias_dtype.value_or(dtype));
  }
  return {grad_inputs, grad_weight, grad_bias};
}

}  // namespace

TORCH_LIBRARY_IMPL(opforge, CUDA, m) {
  m.impl("linear_cat", &linear_cat_cuda);
  m.impl("linear_cat_backward", &linear_cat_backward_cuda);
}

}  // namespace opforge
