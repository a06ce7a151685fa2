// CUDA kernels of linear: cuBLASLt GEMMs with fused epilogues, cublasGemmEx where cuBLASLt declines,
// and one elementwise pass for what no epilogue computes. All on torch's cuBLAS(Lt) handles, torch's
// cuBLASLt workspace and the current stream.
//
// Forward, y = act(x · Wᵀ + b):
//   none, relu, gelu_tanh  cuBLASLt epilogue DEFAULT/BIAS, RELU(_BIAS), GELU(_BIAS): one kernel. cuBLASLt's
//                          GELU is the tanh approximation, so it serves gelu_tanh only. When autograd needs
//                          z (the pre-activation), gelu_tanh takes GELU_AUX(_BIAS), which writes z as well
//                          (its leading dimension N must be a multiple of 8); relu needs no z (its output
//                          decides relu').
//   gelu, silu             cuBLASLt BIAS (or DEFAULT), then one elementwise pass y = act(z) (fp32 math).
//   small M                M == 1 (OPFORGE_LINEAR_GEMV=1: 1 ≤ M ≤ 16; =0: never): a bandwidth-bound GEMV
//                          kernel of our own (linear_gemv.cuh) with bias and activation fused; measured
//                          faster than cuBLAS at M = 1 only (see gemv_eligible).
//   fallback               float64, a problem cuBLASLt finds no algorithm for (alignment, shapes), or
//                          OPFORGE_LINEAR_LT=0: cublasGemmEx with the bias copied in first and beta = 1,
//                          then the elementwise pass for any activation. Every path gives the same values
//                          within the dtype's rounding.
// Backward: dZ = dY · act'(Z) in one elementwise pass (fp32 math; dZ = dY for none); dX = dZ · W through
// cublasGemmEx; dW = dZᵀ · X through cuBLASLt with the BGRADB epilogue computing db = Σ_rows dZ in the
// same kernel (when bias's dtype is the GEMM's), else cublasGemmEx and ATen's fp32-accumulated sum.
//
// Numerics: float16/bfloat16 multiply in tensor cores and accumulate in fp32 (CUBLAS_COMPUTE_32F);
// float32 uses TF32 only when torch allows it (torch.backends.cuda.matmul.allow_tf32); float64 in fp64.
// Split-K partial sums of 16-bit outputs are added in fp32, never in the 16-bit type (see lt_linear). No host synchronization and only caching-allocator memory: capturable in CUDA graphs.
#include <ATen/Context.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/Exceptions.h>
#include <c10/cuda/CUDAGuard.h>
#include <cublasLt.h>
#include <torch/library.h>

#include <climits>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "core/check.h"
#include "core/dispatch.h"
#include "core/map_cuda.cuh"
#include "ops/linear/linear.h"
#include "ops/linear/linear_gemv.cuh"

namespace opforge {
namespace {

using linear_op::Activation;

// ---- activations and their derivatives, in opmath (fp32 for fp16/bf16) -----------------------------

constexpr double kSqrt1_2 = 0.70710678118654752440;     // 1/√2
constexpr double kInvSqrt2Pi = 0.39894228040143267794;  // 1/√(2π)
constexpr double kSqrt2OverPi = 0.79788456080286535588;  // √(2/π)
constexpr double kGeluTanhKappa = 0.044715;

// y = z
struct IdentityOp {
  template <typename T>
  __device__ T operator()(T z) const { return z; }
};
// y = max(z, 0) (NaN stays NaN)
struct ReLUOp {
  template <typename T>
  __device__ T operator()(T z) const { return z < T(0) ? T(0) : z; }
};
// y = z/2 · (1 + erf(z/√2))
struct GELUOp {
  template <typename T>
  __device__ T operator()(T z) const { return T(0.5) * z * (T(1) + erf(z * T(kSqrt1_2))); }
};
// y = z/2 · (1 + tanh(√(2/π) · (z + 0.044715 z³)))
struct GELUTanhOp {
  template <typename T>
  __device__ T operator()(T z) const {
    return T(0.5) * z * (T(1) + tanh(T(kSqrt2OverPi) * (z + T(kGeluTanhKappa) * z * z * z)));
  }
};
// y = z / (1 + exp(−z))
struct SiLUOp {
  template <typename T>
  __device__ T operator()(T z) const { return z / (T(1) + exp(-z)); }
};

// dz = dy · [z > 0] (z may be relu's output: the same sign test)
struct ReLUBackwardOp {
  template <typename T>
  __device__ T operator()(T dy, T z) const { return z <= T(0) ? T(0) : dy; }
};
// dz = dy · (Φ(z) + z · φ(z)), Φ(z) = (1 + erf(z/√2))/2, φ(z) = exp(−z²/2)/√(2π)
struct GELUBackwardOp {
  template <typename T>
  __device__ T operator()(T dy, T z) const {
    const T cdf = T(0.5) * (T(1) + erf(z * T(kSqrt1_2)));
    const T pdf = T(kInvSqrt2Pi) * exp(T(-0.5) * z * z);
    return dy * (cdf + z * pdf);
  }
};
// u = √(2/π)(z + κz³), t = tanh(u): dz = dy · (½(1 + t) + ½z(1 − t²) · √(2/π)(1 + 3κz²))
struct GELUTanhBackwardOp {
  template <typename T>
  __device__ T operator()(T dy, T z) const {
    const T z2 = z * z;
    const T t = tanh(T(kSqrt2OverPi) * (z + T(kGeluTanhKappa) * z2 * z));
    const T du = T(kSqrt2OverPi) * (T(1) + T(3 * kGeluTanhKappa) * z2);
    return dy * (T(0.5) * (T(1) + t) + T(0.5) * z * (T(1) - t * t) * du);
  }
};
// s = σ(z): dz = dy · s · (1 + z · (1 − s))
struct SiLUBackwardOp {
  template <typename T>
  __device__ T operator()(T dy, T z) const {
    const T s = T(1) / (T(1) + exp(-z));
    return dy * s * (T(1) + z * (T(1) - s));
  }
};

/// Y[M, N] = act(Z[M, N]), elementwise (Y may be Z: in place). act != none.
void apply_activation(const at::Tensor& Z, at::Tensor& Y, Activation act) {
  OPFORGE_DISPATCH_FLOATING(Z.scalar_type(), "opforge::linear", [&] {
    switch (act) {
      case Activation::kReLU: cuda::launch_unary<scalar_t>(Z, Y, ReLUOp{}); break;
      case Activation::kGELU: cuda::launch_unary<scalar_t>(Z, Y, GELUOp{}); break;
      case Activation::kGELUTanh: cuda::launch_unary<scalar_t>(Z, Y, GELUTanhOp{}); break;
      case Activation::kSiLU: cuda::launch_unary<scalar_t>(Z, Y, SiLUOp{}); break;
      case Activation::kNone: TORCH_INTERNAL_ASSERT(false, "opforge::linear: no activation to apply");
    }
  });
}

/// dZ[M, N] = dY[M, N] · act'(Z[M, N]), elementwise. act != none.
void apply_activation_backward(const at::Tensor& dY, const at::Tensor& Z, at::Tensor& dZ, Activation act) {
  const int64_t n = dY.numel();
  OPFORGE_DISPATCH_FLOATING(dY.scalar_type(), "opforge::linear_backward", [&] {
    switch (act) {
      case Activation::kReLU: cuda::launch_binary<scalar_t>(dY, Z, n, dZ, ReLUBackwardOp{}); break;
      case Activation::kGELU: cuda::launch_binary<scalar_t>(dY, Z, n, dZ, GELUBackwardOp{}); break;
      case Activation::kGELUTanh: cuda::launch_binary<scalar_t>(dY, Z, n, dZ, GELUTanhBackwardOp{}); break;
      case Activation::kSiLU: cuda::launch_binary<scalar_t>(dY, Z, n, dZ, SiLUBackwardOp{}); break;
      case Activation::kNone: TORCH_INTERNAL_ASSERT(false, "opforge::linear_backward: no activation");
    }
  });
}

// ---- cuBLAS types --------------------------------------------------------------------------------

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

/// C[m, n] = op(A)[m, k] · op(B)[k, n] (+ C when accumulate), all row-major and contiguous, through
/// cublasGemmEx: A is stored [m, k] ([k, m] when trans_a), B is stored [k, n] ([n, k] when trans_b), C
/// is [m, n]. cuBLAS is column-major, where a row-major [r, c] matrix reads as its [c, r] transpose, so
/// this runs Cᵀ[n, m] = op(B)ᵀ · op(A)ᵀ. Empty outputs launch nothing; k == 0 (an empty sum) zero-fills
/// C unless accumulating (cuBLAS rejects zero dims, so they never reach it).
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

// ---- cuBLASLt ------------------------------------------------------------------------------------

/// True when cuBLASLt may run GEMMs of this dtype: not float64 (its fp64 epilogue support is narrow; the
/// cublasGemmEx path serves it), and not disabled by OPFORGE_LINEAR_LT=0 (read on every call, so a test
/// can run the fallback path in the same process).
bool lt_enabled(at::ScalarType t) {
  if (t == at::kDouble) return false;
  const char* env = std::getenv("OPFORGE_LINEAR_LT");
  return env == nullptr || std::strcmp(env, "0") != 0;
}

/// The largest power of two up to 16 that divides the address: cuBLASLt's alignment preferences.
uint32_t alignment_of(const void* p) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  uint32_t al = 16;
  while (al > 1 && a % al != 0) al /= 2;
  return al;
}

// RAII owners of cuBLASLt descriptors (destroy never fails on a valid descriptor).
struct LtMatmulDesc {
  cublasLtMatmulDesc_t d = nullptr;
  ~LtMatmulDesc() { if (d) cublasLtMatmulDescDestroy(d); }
};
struct LtLayout {
  cublasLtMatrixLayout_t d = nullptr;
  ~LtLayout() { if (d) cublasLtMatrixLayoutDestroy(d); }
};
struct LtPreference {
  cublasLtMatmulPreference_t d = nullptr;
  ~LtPreference() { if (d) cublasLtMatmulPreferenceDestroy(d); }
};

template <typename T>
void set_desc(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t attr, const T& value) {
  TORCH_CUDABLAS_CHECK(cublasLtMatmulDescSetAttribute(d, attr, &value, sizeof(value)));
}
template <typename T>
void set_pref(cublasLtMatmulPreference_t d, cublasLtMatmulPreferenceAttributes_t attr, const T& value) {
  TORCH_CUDABLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(d, attr, &value, sizeof(value)));
}

/// One cuBLASLt matmul in cuBLAS's column-major terms: D[m, n] = epilogue(op(A)[m, k] · op(B)[k, n]).
/// A is stored [m, k] column-major with leading dimension lda ([k, m] when trans_a), B [k, n] ([n, k]
/// when trans_b), D [m, n] with ldd; all of one dtype. Epilogue operands: `bias` [m] for BIAS epilogues
/// (read), or [n] for BGRADB (written: Σ over k of op(B)); `aux` [m, n] with ld_aux for *_AUX epilogues
/// (written: the value before the activation).
struct LtGemm {
  bool trans_a, trans_b;
  int64_t m, n, k;
  const void* A;
  int64_t lda;
  const void* B;
  int64_t ldb;
  void* D;
  int64_t ldd;
  cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_DEFAULT;
  const void* bias = nullptr;
  void* aux = nullptr;
  int64_t ld_aux = 0;
};

/// Runs `g` with cuBLASLt on torch's cuBLASLt handle, workspace and the current stream. Returns false,
/// having written nothing, when cuBLASLt has no algorithm for it (a heuristic with no result, or
/// CUBLAS_STATUS_NOT_SUPPORTED); raises on any other cuBLAS error. m, n, k > 0.
bool lt_gemm(const LtGemm& g, at::ScalarType dtype) {
  TORCH_INTERNAL_ASSERT(g.m > 0 && g.n > 0 && g.k > 0);
  const GemmTypes types = gemm_types(dtype);
  TORCH_INTERNAL_ASSERT(!types.double_scalars, "opforge::linear: float64 takes the cublasGemmEx path");
  cublasLtHandle_t handle = at::cuda::getCurrentCUDABlasLtHandle();

  LtMatmulDesc op;
  TORCH_CUDABLAS_CHECK(cublasLtMatmulDescCreate(&op.d, types.compute, CUDA_R_32F));
  set_desc(op.d, CUBLASLT_MATMUL_DESC_TRANSA, g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N);
  set_desc(op.d, CUBLASLT_MATMUL_DESC_TRANSB, g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N);
  set_desc(op.d, CUBLASLT_MATMUL_DESC_EPILOGUE, g.epilogue);
  if (g.bias != nullptr) set_desc(op.d, CUBLASLT_MATMUL_DESC_BIAS_POINTER, g.bias);
  if (g.aux != nullptr) {
    set_desc(op.d, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, g.aux);
    set_desc(op.d, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, g.ld_aux);
  }

  LtLayout a, b, d;
  TORCH_CUDABLAS_CHECK(cublasLtMatrixLayoutCreate(&a.d, types.data, g.trans_a ? g.k : g.m, g.trans_a ? g.m : g.k, g.lda));
  TORCH_CUDABLAS_CHECK(cublasLtMatrixLayoutCreate(&b.d, types.data, g.trans_b ? g.n : g.k, g.trans_b ? g.k : g.n, g.ldb));
  TORCH_CUDABLAS_CHECK(cublasLtMatrixLayoutCreate(&d.d, types.data, g.m, g.n, g.ldd));

  const size_t workspace_size = at::cuda::getCUDABlasLtWorkspaceSize();
  void* workspace = at::cuda::getCUDABlasLtWorkspace();  // torch's, for this handle and stream
  LtPreference pref;
  TORCH_CUDABLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref.d));
  set_pref(pref.d, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, static_cast<uint64_t>(workspace_size));
  set_pref(pref.d, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, alignment_of(g.A));
  set_pref(pref.d, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, alignment_of(g.B));
  set_pref(pref.d, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, alignment_of(g.D));
  set_pref(pref.d, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, alignment_of(g.D));
  // Split-K partial sums are added in fp32 (or not split), never in the output's 16-bit type: on the
  // H200 an algorithm reducing in bf16 gave 8x F.linear's error (M=8, K=5120, N=7), although torch's
  // allow_bf16_reduced_precision_reduction permits it. fp32 and fp64 outputs reduce in their own type.
  if (dtype == at::kHalf || dtype == at::kBFloat16) {
    set_pref(pref.d, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
             static_cast<uint32_t>(CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE | CUBLASLT_REDUCTION_SCHEME_NONE));
  }

  cublasLtMatmulHeuristicResult_t heuristic{};
  int found = 0;
  const cublasStatus_t hs =
      cublasLtMatmulAlgoGetHeuristic(handle, op.d, a.d, b.d, d.d, d.d, pref.d, 1, &heuristic, &found);
  if (hs == CUBLAS_STATUS_NOT_SUPPORTED || (hs == CUBLAS_STATUS_SUCCESS && found == 0)) return false;
  TORCH_CUDABLAS_CHECK(hs);

  const float alpha = 1.0f, beta = 0.0f;
  const cublasStatus_t st = cublasLtMatmul(handle, op.d, &alpha, g.A, a.d, g.B, b.d, &beta, g.D, d.d, g.D, d.d,
                                           &heuristic.algo, workspace, workspace_size,
                                           at::cuda::getCurrentCUDAStream());
  if (st == CUBLAS_STATUS_NOT_SUPPORTED) return false;
  TORCH_CUDABLAS_CHECK(st);
  return true;
}

/// The cuBLASLt epilogue computing `act` (DEFAULT, RELU or GELU, optionally *_AUX) with the bias added first.
cublasLtEpilogue_t with_bias(cublasLtEpilogue_t e, bool has_bias) {
  if (!has_bias) return e;
  switch (e) {
    case CUBLASLT_EPILOGUE_DEFAULT: return CUBLASLT_EPILOGUE_BIAS;
    case CUBLASLT_EPILOGUE_RELU: return CUBLASLT_EPILOGUE_RELU_BIAS;
    case CUBLASLT_EPILOGUE_GELU: return CUBLASLT_EPILOGUE_GELU_BIAS;
    case CUBLASLT_EPILOGUE_GELU_AUX: return CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
    default: TORCH_INTERNAL_ASSERT(false, "opforge::linear: no bias form of epilogue ", static_cast<int>(e));
  }
  return e;
}

/// Y[M, N] = epilogue(X · Wᵀ + b) through cuBLASLt (Z[M, N] = X · Wᵀ + b too, for a *_AUX epilogue).
/// Returns false, having written nothing, when cuBLASLt declines. M, K, N > 0.
bool lt_linear(const linear_op::LinearProblem& p, at::Tensor& Y, cublasLtEpilogue_t epilogue,
               at::Tensor* Z = nullptr) {
  // cuBLAS column-major: Yᵀ[N, M] = W[N, K] · Xᵀ[K, M], W read as the transpose of its stored
  // column-major [K, N], X as its stored column-major [K, M]; the bias runs along Yᵀ's rows (N).
  at::Tensor b = p.b;
  if (b.defined() && !cuda::is_aligned16(b.const_data_ptr())) b = b.clone();  // a fresh, aligned copy
  LtGemm g{/*trans_a=*/true, /*trans_b=*/false, p.N, p.M, p.K,
           p.W.const_data_ptr(), p.K, p.X.const_data_ptr(), p.K, Y.mutable_data_ptr(), p.N,
           with_bias(epilogue, b.defined())};
  if (b.defined()) g.bias = b.const_data_ptr();
  if (Z != nullptr) {
    g.aux = Z->mutable_data_ptr();
    g.ld_aux = p.N;
  }
  return lt_gemm(g, p.X.scalar_type());
}

/// Z[M, N] = X · Wᵀ + b: cuBLASLt (BIAS or DEFAULT epilogue), else cublasGemmEx with the bias copied
/// in first and beta = 1. K == 0 gives the bias broadcast (zeros without bias).
void gemm_bias(const linear_op::LinearProblem& p, at::Tensor& Z) {
  if (Z.numel() == 0) return;
  if (p.K > 0 && lt_enabled(p.X.scalar_type()) && lt_linear(p, Z, CUBLASLT_EPILOGUE_DEFAULT)) return;
  const bool has_bias = p.b.defined();
  if (has_bias) Z.copy_(p.b.expand({p.M, p.N}));
  gemm(/*trans_a=*/false, /*trans_b=*/true, p.M, p.N, p.K, p.X, p.W, Z, /*accumulate=*/has_bias);
}

/// True when the small-M GEMV kernel takes this problem. OPFORGE_LINEAR_GEMV (read on every call):
/// unset: M == 1 only, where the H200 measured it faster than cuBLAS(Lt) (2026-11-30, 1x4096x4096: bf16
/// 2852 vs 2438 GB/s, fp16 2842 vs 2424, fp32 3551 vs 2892); at M = 8 it was 2.7x slower, so larger M
/// stays on cuBLAS(Lt). "1": every 1 ≤ M ≤ 16 (tests, benchmarks); "0": never. Always float32/float16/
/// bfloat16, K > 0 a multiple of the 16-byte vector, X and W 16-byte aligned (contiguous from the checker).
bool gemv_eligible(const linear_op::LinearProblem& p) {
  const char* env = std::getenv("OPFORGE_LINEAR_GEMV");
  const int64_t max_m = env == nullptr ? 1 : std::strcmp(env, "1") == 0 ? 16 : 0;
  const auto t = p.X.scalar_type();
  if (t == at::kDouble || p.M < 1 || p.M > max_m || p.K < 1 || p.N < 1) return false;
  const int64_t vec = 16 / static_cast<int64_t>(p.X.element_size());
  return p.K % vec == 0 && cuda::is_aligned16(p.X.const_data_ptr()) && cuda::is_aligned16(p.W.const_data_ptr());
}

/// Y[M, N] = act(X · Wᵀ + b) (and Z[M, N] = X · Wᵀ + b when Z is given) through the GEMV kernel.
void gemv_linear(const linear_op::LinearProblem& p, at::Tensor& Y, at::Tensor* Z) {
  OPFORGE_DISPATCH_FLOATING(p.X.scalar_type(), "opforge::linear", [&] {
    if constexpr (std::is_same_v<scalar_t, double>) {
      TORCH_INTERNAL_ASSERT(false, "opforge::linear: the GEMV kernel has no float64 path");
    } else {
      const scalar_t* b = p.b.defined() ? p.b.const_data_ptr<scalar_t>() : nullptr;
      scalar_t* z = Z != nullptr ? Z->mutable_data_ptr<scalar_t>() : nullptr;
      auto run = [&](auto act) {
        cuda::launch_gemv<scalar_t>(p.X.const_data_ptr<scalar_t>(), p.W.const_data_ptr<scalar_t>(), b,
                                    Y.mutable_data_ptr<scalar_t>(), z, static_cast<int>(p.M), p.K, p.N, act);
      };
      switch (p.act) {
        case Activation::kNone: run(IdentityOp{}); break;
        case Activation::kReLU: run(ReLUOp{}); break;
        case Activation::kGELU: run(GELUOp{}); break;
        case Activation::kGELUTanh: run(GELUTanhOp{}); break;
        case Activation::kSiLU: run(SiLUOp{}); break;
      }
    }
  });
}

/// (Y, Z) of the forward, each [M, N]: Y = act(X · Wᵀ + b); Z = X · Wᵀ + b when keep_z (else undefined).
std::pair<at::Tensor, at::Tensor> forward(const linear_op::LinearProblem& p, bool keep_z) {
  const auto options = p.X.options();
  at::Tensor Y = at::empty({p.M, p.N}, options);  // [M, N]
  at::Tensor Z;                                   // [M, N] when keep_z
  if (keep_z) Z = at::empty({p.M, p.N}, options);
  if (Y.numel() == 0) return {Y, Z};
  // 0. opt-in: small M through the GEMV kernel, everything fused
  if (gemv_eligible(p)) {
    gemv_linear(p, Y, keep_z ? &Z : nullptr);
    return {Y, Z};
  }
  // 1. the activation in the GEMM's epilogue, where cuBLASLt has it
  if (p.K > 0 && lt_enabled(p.X.scalar_type())) {
    if (!keep_z && p.act == Activation::kReLU && lt_linear(p, Y, CUBLASLT_EPILOGUE_RELU)) return {Y, Z};
    if (!keep_z && p.act == Activation::kGELUTanh && lt_linear(p, Y, CUBLASLT_EPILOGUE_GELU)) return {Y, Z};
    if (keep_z && p.act == Activation::kGELUTanh && p.N % 8 == 0 &&  // aux's leading dim: a multiple of 8
        lt_linear(p, Y, CUBLASLT_EPILOGUE_GELU_AUX, &Z)) {
      return {Y, Z};
    }
  }
  // 2. Z = X · Wᵀ + b (into Y itself when Z is not kept), then one elementwise pass Y = act(Z)
  at::Tensor& D = keep_z ? Z : Y;
  gemm_bias(p, D);
  if (p.act != Activation::kNone) {
    apply_activation(D, Y, p.act);
  } else if (keep_z) {
    Y.copy_(Z);
  }
  return {Y, Z};
}

std::vector<int64_t> output_sizes(const at::Tensor& input, int64_t N) {
  std::vector<int64_t> out = input.sizes().vec();  // (*, N)
  out.back() = N;
  return out;
}

at::Tensor linear_cuda(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                       c10::string_view activation) {
  linear_op::check_linear_args("linear", input, weight, bias);  // before the guard: names a device mismatch
  c10::cuda::CUDAGuard guard(input.device());
  const auto p = linear_op::check_linear(input, weight, bias, activation);
  check_int_dims("linear", p.M, p.K, p.N);
  return forward(p, /*keep_z=*/false).first.view(output_sizes(input, p.N));
}

std::tuple<at::Tensor, at::Tensor> linear_forward_cuda(const at::Tensor& input, const at::Tensor& weight,
                                                       const std::optional<at::Tensor>& bias,
                                                       c10::string_view activation) {
  linear_op::check_linear_args("linear", input, weight, bias);
  c10::cuda::CUDAGuard guard(input.device());
  const auto p = linear_op::check_linear(input, weight, bias, activation);
  check_int_dims("linear", p.M, p.K, p.N);
  auto [Y, Z] = forward(p, /*keep_z=*/true);
  const auto sizes = output_sizes(input, p.N);
  return {Y.view(sizes), Z.view(sizes)};
}

at::ScalarType opmath_dtype(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_backward_cuda(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight, std::array<bool, 3> output_mask,
    std::optional<at::ScalarType> bias_dtype, c10::string_view activation,
    const std::optional<at::Tensor>& pre_activation) {
  linear_op::check_linear_backward_args(grad_output, input, weight, bias_dtype, activation, pre_activation);
  c10::cuda::CUDAGuard guard(input.device());
  const auto p = linear_op::check_linear_backward(grad_output, input, weight, bias_dtype, activation, pre_activation);
  check_int_dims("linear_backward", p.M, p.K, p.N);
  at::Tensor grad_input, grad_weight, grad_bias;
  if (!(output_mask[0] || output_mask[1] || output_mask[2])) return {grad_input, grad_weight, grad_bias};
  const auto options = p.X.options();
  at::Tensor dZ = p.dY;  // [M, N]
  if (p.act != Activation::kNone) {
    dZ = at::empty({p.M, p.N}, options);
    apply_activation_backward(p.dY, p.Z, dZ, p.act);
  }
  if (output_mask[0]) {
    at::Tensor dX = at::empty({p.M, p.K}, options);  // [M, K] = dZ[M, N] · W[N, K]
    gemm(/*trans_a=*/false, /*trans_b=*/false, p.M, p.K, p.N, dZ, p.W, dX, false);
    grad_input = dX.view(input.sizes());
  }
  const auto db_dtype = linear_op::grad_bias_dtype(input, bias_dtype);
  if (output_mask[1]) {
    // [N, K] = dZ[M, N]ᵀ · X[M, K], in the wider of input's and weight's dtypes (an fp16 input with an
    // fp32 weight accumulates and stores in fp32), rounded once to weight's dtype
    const auto dt = at::promote_types(dZ.scalar_type(), weight.scalar_type());
    const at::Tensor dZt = dZ.to(dt), Xt = p.X.to(dt);
    at::Tensor dW = at::empty({p.N, p.K}, options.dtype(dt));
    bool done = false;
    if (output_mask[2] && db_dtype == dt && p.M > 0 && p.N > 0 && p.K > 0 && lt_enabled(dt)) {
      // cuBLAS column-major: dWᵀ[K, N] = Xᵀ[K, M] · dZ[M, N], X read as its stored column-major [K, M],
      // dZ as the transpose of its stored column-major [N, M]; BGRADB sums op(B) = dZ over k = M rows
      // into db[N] in the same kernel
      at::Tensor db = at::empty({p.N}, options.dtype(dt));
      LtGemm g{/*trans_a=*/false, /*trans_b=*/true, p.K, p.N, p.M,
               Xt.const_data_ptr(), p.K, dZt.const_data_ptr(), p.N, dW.mutable_data_ptr(), p.K,
               CUBLASLT_EPILOGUE_BGRADB};
      g.bias = db.mutable_data_ptr();
      done = lt_gemm(g, dt);
      if (done) grad_bias = db;
    }
    if (!done) gemm(/*trans_a=*/true, /*trans_b=*/false, p.N, p.K, p.M, dZt, Xt, dW, false);
    grad_weight = dW.to(weight.scalar_type());
  }
  if (output_mask[2] && !grad_bias.defined()) {
    // db[N] = Σ_rows dZ, accumulated in fp32 (fp64 for fp64), rounded once; zeros when M == 0
    grad_bias = at::sum(dZ, {0}, /*keepdim=*/false, opmath_dtype(dZ.scalar_type())).to(db_dtype);
  }
  return {grad_input, grad_weight, grad_bias};
}

}  // namespace

TORCH_LIBRARY_IMPL(opforge, CUDA, m) {
  m.impl("_linear_forward", &linear_forward_cuda);
  m.impl("linear", &linear_cuda);
  m.impl("linear_backward", &linear_backward_cuda);
}

}  // namespace opforge
