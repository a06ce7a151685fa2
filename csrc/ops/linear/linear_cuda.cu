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
//   small M                1 ≤ M ≤ 16 by the (M, N, K) bucket table kGemvTable (measured on the H200): a
//                          bandwidth-bound GEMV kernel of our own (linear_gemv.cuh: warp-per-rows) with bias
//                          and activation fused (see use_gemv).
//   fallback               float64, a problem cuBLASLt finds no algorithm for (alignment, shapes), or the
//                          test hook linear_lt = 0: cublasGemmEx with the bias copied in first and beta = 1,
//                          then the elementwise pass for any activation. Every path gives the same values
//                          within the dtype's rounding.
// Backward: dZ = dY · act'(Z) in one elementwise pass (fp32 math; dZ = dY for none); dX = dZ · W through
// cublasGemmEx; dW = dZᵀ · X through cuBLASLt with the BGRADB epilogue computing db = Σ_rows dZ in the
// same kernel (when bias's dtype is the GEMM's), else cublasGemmEx and ATen's fp32-accumulated sum.
//
// The GEMMs go through core/gemm.h (cuBLAS(Lt) on torch's handles, workspace and stream, cached
// cuBLASLt plans); activations and derivatives are core/activation.h's, in fp32 (fp64 for float64).
// Numerics: float16/bfloat16 multiply in tensor cores and accumulate in fp32 (CUBLAS_COMPUTE_32F);
// float32 uses TF32 only when torch allows it (torch.backends.cuda.matmul.allow_tf32); float64 in fp64.
// Split-K partial sums of 16-bit outputs are added in fp32, never in the 16-bit type (core/gemm.h).
// No host synchronization and only caching-allocator memory: capturable in CUDA graphs.
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cstdint>

#include "core/activation.h"
#include "core/activation_cuda.h"
#include "core/dispatch.h"
#include "core/gemm.h"
#include "core/knobs.h"
#include "ops/linear/linear.h"
#include "core/cuda_utils.cuh"
#include "ops/linear/linear_gemv_launch.h"

namespace opforge {
namespace {

using gemm::Epilogue;
using gemm::GemmArgs;

/// Y[M, N] = epilogue(X · Wᵀ + b) through cuBLASLt (Z[M, N] = X · Wᵀ + b too, for kGELUTanhAux).
/// Returns false, having written nothing, when cuBLASLt declines.
bool lt_linear(const linear_op::LinearProblem& p, const at::Tensor& Y, Epilogue epilogue,
               const at::Tensor* Z = nullptr) {
  GemmArgs args;
  args.trans_b = true;  // W is stored [N, K]
  args.epilogue = epilogue;
  args.bias = p.b;
  if (Z != nullptr) args.aux = *Z;
  return gemm::gemm_lt(Y, p.X, p.W, args);
}

/// Z[M, N] = X · Wᵀ + b: cuBLASLt (BIAS or DEFAULT epilogue), else cublasGemmEx with the bias copied
/// in first and beta = 1. K == 0 gives the bias broadcast (zeros without bias).
/// float32 with 8 <= M <= 16 goes straight to cublasGemmEx: cuBLASLt's heuristic picks kernels up to 2x slower
/// there (H200, GB/s of weight, docs/performance/kernel_variants.md; cuBLASLt / cublasGemmEx / F.linear: 16x4096x4096
/// 711 / 1344 / 1349, 16x14336x4096 1320 / 1947 / 1934, 8x4096x1024 394 / 820 / 818; equal at M = 8 4096x4096,
/// 1429 / 1425 / 1430); the GEMV kernel serves smaller M where it wins (kGemvTable).
void gemm_bias(const linear_op::LinearProblem& p, const at::Tensor& Z) {
  if (Z.numel() == 0) return;
  GemmArgs args;
  args.trans_b = true;
  args.bias = p.b;
  args.prefer_gemm_ex = p.X.scalar_type() == at::kFloat && p.M >= 8 && p.M <= 16;
  gemm::gemm(Z, p.X, p.W, args);
}

/// Where the GEMV kernel (linear_gemv.cuh) runs instead of cuBLAS(Lt), per (M, N, K) bucket: the first row whose
/// bounds hold wins. Each row has the H200 numbers that put it there (GB/s of weight streamed, bf16 / fp32, the
/// GEMV kernel vs cuBLAS(Lt); the whole table: docs/performance/kernel_variants.md).
struct GemvBucket {
  int64_t max_m, max_n, max_k;  // the bucket: M <= max_m, N <= max_n, K <= max_k
  bool gemv16;                  // float16/bfloat16: the GEMV kernel (false: cuBLAS(Lt))
  bool gemv32;                  // float32: the GEMV kernel (false: cuBLAS(Lt))
};
constexpr int64_t kAny = INT64_MAX;
constexpr GemvBucket kGemvTable[] = {
    {1, 1024, kAny, false, false},   // 1x4096x1024: fp32 cuBLAS 2424 vs 1803
    {2, 1024, kAny, false, true},    // 2x4096x1024: fp32 1266 vs 888
    {16, 1024, kAny, false, false},  // 16x4096x1024: fp32 cuBLAS (M 4: 848 vs 685)
    {1, 8192, 4096, true, true},     // 1x4096x4096: bf16 2907 vs 2541; fp32 3545 vs 2981
    {1, kAny, 2048, true, true},     // 1x2048x128256: bf16 4443 vs 4191; fp32 4412 vs 4177
    {1, kAny, 4096, false, true},    // 1x4096x14336: bf16 cuBLAS 3818 vs 3707; fp32 4108 vs 3793
    {1, kAny, kAny, false, false},   // 1x14336x4096: bf16 cuBLAS 3684 vs 3419; fp32 4133 vs 3899
    {2, kAny, kAny, false, true},    // M 2: fp32 GEMV everywhere measured (4096x4096 3039 vs 2535, 14336x4096 3227 vs 2865)
    {8, kAny, 2048, false, true},    // fp32 M <= 8, K 2048, N 128256: 3515 vs 2250 (M 4: 4143 vs 2991)
    {16, kAny, kAny, false, false},  // the rest of 2 <= M <= 16: cuBLAS(Lt)
};

/// True when this problem's forward runs the GEMV kernel: kGemvTable, or the test hook linear_gemv (core/knobs.h;
/// 1: every 1 <= M <= 16, 0: never). Only float32/float16/bfloat16, 1 <= M <= 16, K > 0 a multiple of the 16-byte
/// vector, X and W 16-byte aligned (contiguous from the checker).
bool use_gemv(const linear_op::LinearProblem& p) {
  const int64_t mode = knobs::get(knobs::Knob::kLinearGemv);
  const auto t = p.X.scalar_type();
  if (mode == 0 || t == at::kDouble || p.M < 1 || p.M > 16 || p.K < 1 || p.N < 1) return false;
  const int64_t vec = 16 / static_cast<int64_t>(p.X.element_size());
  if (p.K % vec != 0 || !cuda::is_aligned16(p.X.const_data_ptr()) || !cuda::is_aligned16(p.W.const_data_ptr())) {
    return false;
  }
  if (mode > 0) return true;
  for (const auto& row : kGemvTable) {
    if (p.M <= row.max_m && p.N <= row.max_n && p.K <= row.max_k) return t == at::kFloat ? row.gemv32 : row.gemv16;
  }
  return false;
}

/// Y[M, N] = act(X · Wᵀ + b) (and Z[M, N] = X · Wᵀ + b when Z is given) through the GEMV kernel (use_gemv).
void gemv_linear(const linear_op::LinearProblem& p, at::Tensor& Y, at::Tensor* Z) {
  switch (p.X.scalar_type()) {
    case at::kFloat: return linear_op::gemv_linear_typed<float>(p, Y, Z);
    case at::kHalf: return linear_op::gemv_linear_typed<c10::Half>(p, Y, Z);
    case at::kBFloat16: return linear_op::gemv_linear_typed<c10::BFloat16>(p, Y, Z);
    default: TORCH_INTERNAL_ASSERT(false, "opforge::linear: the GEMV kernel has no ", p.X.scalar_type(), " path");
  }
}

/// (Y, Z) of the forward, each [M, N]: Y = act(X · Wᵀ + b); Z = X · Wᵀ + b when keep_z (else undefined).
std::pair<at::Tensor, at::Tensor> forward(const linear_op::LinearProblem& p, bool keep_z) {
  const auto options = p.X.options();
  at::Tensor Y = at::empty({p.M, p.N}, options);  // [M, N]
  at::Tensor Z;                                   // [M, N] when keep_z
  if (keep_z) Z = at::empty({p.M, p.N}, options);
  if (Y.numel() == 0) return {Y, Z};
  // 0. small M through the GEMV kernel where it measured ahead, everything fused
  if (use_gemv(p)) {
    gemv_linear(p, Y, keep_z ? &Z : nullptr);
    return {Y, Z};
  }
  // 1. the activation in the GEMM's epilogue, where cuBLASLt has it
  if (p.K > 0 && gemm::lt_enabled(p.X.scalar_type())) {
    if (!keep_z && p.act == Activation::kReLU && lt_linear(p, Y, Epilogue::kReLU)) return {Y, Z};
    if (!keep_z && p.act == Activation::kGELUTanh && lt_linear(p, Y, Epilogue::kGELUTanh)) return {Y, Z};
    if (keep_z && p.act == Activation::kGELUTanh && p.N % 8 == 0 &&  // aux's leading dim: a multiple of 8
        lt_linear(p, Y, Epilogue::kGELUTanhAux, &Z)) {
      return {Y, Z};
    }
  }
  // 2. Z = X · Wᵀ + b (into Y itself when Z is not kept), then one elementwise pass Y = act(Z)
  at::Tensor& D = keep_z ? Z : Y;
  gemm_bias(p, D);
  if (p.act != Activation::kNone) {
    cuda::activation_forward(D, Y, p.act);
  } else if (keep_z) {
    Y.copy_(Z);
  }
  return {Y, Z};
}

at::Tensor linear_cuda(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                       c10::string_view activation) {
  const auto p = linear_op::check_linear(input, weight, bias, activation);  // before the guard: names a device mismatch
  c10::cuda::CUDAGuard guard(input.device());
  gemm::check_int_dims("linear", p.M, p.K, p.N);
  return linear_op::as_output(forward(p, /*keep_z=*/false).first, input, weight);
}

std::tuple<at::Tensor, at::Tensor> linear_forward_cuda(const at::Tensor& input, const at::Tensor& weight,
                                                       const std::optional<at::Tensor>& bias,
                                                       c10::string_view activation) {
  const auto p = linear_op::check_linear(input, weight, bias, activation);
  c10::cuda::CUDAGuard guard(input.device());
  gemm::check_int_dims("linear", p.M, p.K, p.N);
  auto [Y, Z] = forward(p, /*keep_z=*/true);
  return {linear_op::as_output(Y, input, weight), linear_op::as_output(Z, input, weight)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_backward_cuda(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight, std::array<bool, 3> output_mask,
    std::optional<at::ScalarType> bias_dtype, c10::string_view activation,
    const std::optional<at::Tensor>& pre_activation) {
  const auto p = linear_op::check_linear_backward(grad_output, input, weight, bias_dtype, activation, pre_activation);
  c10::cuda::CUDAGuard guard(input.device());
  gemm::check_int_dims("linear_backward", p.M, p.K, p.N);
  at::Tensor grad_input, grad_weight, grad_bias;
  if (!(output_mask[0] || output_mask[1] || output_mask[2])) return {grad_input, grad_weight, grad_bias};
  const auto options = p.X.options();
  at::Tensor dZ = p.dY;  // [M, N]
  if (p.act != Activation::kNone) {
    dZ = at::empty({p.M, p.N}, options);
    cuda::activation_backward(p.dY, p.Z, dZ, p.act);
  }
  if (output_mask[0]) {
    at::Tensor dX = at::empty({p.M, p.K}, options);  // [M, K] = dZ[M, N] · W[N, K]
    gemm::gemm_ex(dX, dZ, p.W);
    grad_input = dX.view(input.sizes());
  }
  const auto db_dtype = linear_op::grad_bias_dtype(input, bias_dtype);
  if (output_mask[1]) {
    // [N, K] = dZ[M, N]ᵀ · X[M, K], in the wider of input's and weight's dtypes (an fp16 input with an
    // fp32 weight accumulates and stores in fp32), rounded once to weight's dtype
    const auto dt = at::promote_types(dZ.scalar_type(), weight.scalar_type());
    const at::Tensor dZt = dZ.to(dt), Xt = p.X.to(dt);
    at::Tensor dW = at::empty({p.N, p.K}, options.dtype(dt));
    GemmArgs args;
    args.trans_a = true;  // dW = dZᵀ · X, dZ stored [M, N]
    bool done = false;
    if (output_mask[2] && db_dtype == dt) {
      // db[N] = Σ_rows dZ = the row sums of op(A) = dZᵀ, in the same cuBLASLt kernel (BGRADB)
      args.epilogue = Epilogue::kBiasGradA;
      args.bias_grad = at::empty({p.N}, options.dtype(dt));
      done = gemm::gemm_lt(dW, dZt, Xt, args);
      if (done) grad_bias = args.bias_grad;
    }
    if (!done) gemm::gemm_ex(dW, dZt, Xt, GemmArgs{/*trans_a=*/true});
    grad_weight = dW.to(weight.scalar_type());
  }
  if (output_mask[2] && !grad_bias.defined()) {
    grad_bias = linear_op::sum_rows(dZ, db_dtype);  // db = Σ_rows dZ where no epilogue computed it
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
