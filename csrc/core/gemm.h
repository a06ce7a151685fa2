// opforge's GEMM layer (CUDA): opforge's own sm90 kernels (CUTLASS, core/gemm_sm90.h) where they are built and
// measured ahead, cuBLASLt with fused epilogues, cublasGemmEx where cuBLASLt declines, on torch's cuBLAS(Lt)
// handles, torch's cuBLASLt workspace and the current stream. Every op that multiplies
// matrices on CUDA (linear, and the ops built on it) calls this; none talks to cuBLAS itself.
//
// ---- The problem, in row-major (torch) terms -------------------------------------------------------
//
//   D[m, n] = epilogue(alpha · op(A)[m, k] · op(B)[k, n] + beta · D[m, n] + bias[n])
//
//   op(A) = A, or Aᵀ when trans_a (A stored [k, m]); op(B) likewise with trans_b (B stored [n, k]).
//   Operands are 2-D tensors with a unit last stride and any row stride ≥ their width (the leading
//   dimension): a column slice of a larger matrix (dW[:, k0:k1]) is a valid D; transposed views are not
//   (pass the stored tensor and a trans flag). 3-D tensors [batch, rows, cols] make a strided-batched GEMM
//   (A or B may have batch stride 0, an expand); batched calls take no epilogue and no bias.
//
//   Dtypes: A and B share one dtype; D is that dtype, or float32 when A and B are float16/bfloat16 (a
//   16-bit product accumulated into an fp32 D: linear_cross_entropy's dW over chunks with beta = 1,
//   linear_cat's fp32 sum of pieces). bias, aux and bias_grad take D's dtype. Products accumulate in fp32
//   (CUBLAS_COMPUTE_32F) for 16-bit and float32 inputs (TF32 only where torch allows it:
//   torch.backends.cuda.matmul.allow_tf32 / fp32_precision), in fp64 for float64. Split-K partial sums
//   of a 16-bit D are added in fp32, never in the 16-bit type.
//
//   beta ≠ 0 reads D before writing it (D is C too): accumulate with beta = 1.
//
// ---- Epilogues (GemmArgs::epilogue) --------------------------------------------------------------
//
//   kNone          D = alpha·op(A)·op(B) + beta·D (+ bias[n] broadcast over the rows, when given)
//   kReLU          D = relu(... + bias)
//   kGELUTanh      D = gelu_tanh(... + bias)         (cuBLASLt's GELU is the tanh approximation)
//   kGELUTanhAux   D = gelu_tanh(Z), aux[m, n] = Z = ... + bias   (cuBLASLt wants aux's row stride % 8 == 0)
//   kBiasGradA     D as kNone; bias_grad[m] = Σ_k op(A)[m, k]     (cuBLASLt BGRADB; e.g. db of linear's
//                                                                  dW = dZᵀ · X: op(A) = dZᵀ)
//   kBiasGradB     D as kNone; bias_grad[n] = Σ_k op(B)[k, n]     (cuBLASLt BGRADA)
//   (bias_grad sums the operand itself, without alpha.)
//
// ---- Entry points ---------------------------------------------------------------------------------
//
//   gemm(D, A, B, args)     Always computes the result: cuBLASLt with the epilogue fused when it takes
//                           the problem, else cublasGemmEx and the epilogue as separate passes (the bias
//                           copied into D first, the activation by activation.h's functions in fp32, the
//                           bias gradient by an fp32-accumulated sum). Empty problems: k == 0 gives
//                           beta·D (+ bias, activation), bias_grad zeros; m == 0 or n == 0 writes nothing
//                           but bias_grad. Every path gives the same values within the dtype's rounding.
//   gemm_lt(D, A, B, args)  The fused-epilogue engines: opforge's sm90 kernel where sm90_choice picks it (see
//                           "The sm90 engine" below), else cuBLASLt. Returns false, having written nothing, when
//                           cuBLASLt declines
//                           (no algorithm for the alignment/shape, float64, an empty problem, or cuBLASLt
//                           switched off); the caller then picks its own fallback (linear does, to keep
//                           its one-pass activation kernels).
//   gemm_swiglu(Z, H, A, B, bias)  Z = A · Bᵀ + bias and H = silu(Z[:, 0::2]) · Z[:, 1::2] in one sm90 kernel
//                           (Z undefined: H alone, z never stored); false, having written nothing, where it cannot
//                           run or where the measured table kSwiGLUTable (gemm_cuda.cu) found two passes faster (the
//                           caller falls back to gemm and an elementwise pass).
//   gemm_ex(D, A, B, args)  cublasGemmEx / cublasGemmStridedBatchedEx only (any dtype incl. float64);
//                           args.epilogue must be kNone and args.bias undefined.
//   gemm_fp8(D, A, B, scale_a, scale_b, fast_accum)
//                           D = scale_a · scale_b · (A · Bᵀ), A and B float8, tensorwise scales read on the device,
//                           through cuBLASLt with the cached plan of its signature; false, having written nothing,
//                           where cuBLASLt declines (the caller falls back to at::_scaled_mm).
//   lt_enabled(dtype)       Whether gemm_lt may take this dtype (not float64; not switched off).
//   check_int_dims(op, ...) The user-facing error when a dimension exceeds cuBLAS's int arguments.
//
// Callers hold the CUDA device guard of D's device (gemm_* take the current stream of the current device).
// Shape, dtype and layout preconditions are checked (TORCH_CHECK, "opforge::gemm: ..." messages): they
// are programming errors of the calling op, not user errors; validate user input in the op's checker.
//
// ---- The sm90 engine ---------------------------------------------------------------------------------
//
// Built when CMake finds CUTLASS (OPFORGE_CUTLASS, core/gemm_sm90.h); runs on compute capability 9.0 only. It
// takes 2-D float16/bfloat16 problems with trans_a = false, trans_b = true (linear's X · Wᵀ), D of A's dtype,
// alpha = 1, beta = 0, epilogue kNone with or without bias, every pointer 16-byte aligned and K, N and the
// leading dimensions multiples of 8. Among those, sm90_choice (gemm_cuda.cu) picks it per (M, N, K) from a
// table measured against cuBLASLt on the H200; the test hook gemm_sm90 (core/knobs.h) overrides the table.
//
// ---- Caching ----------------------------------------------------------------------------------------
//
// cuBLASLt's matmul descriptor, matrix layouts and heuristic result are built once per problem
// signature (device, dtypes, compute type, trans flags, m, n, k, leading dimensions, batch, epilogue,
// bias presence, operand alignments, workspace size) and reused: a hot loop runs only cublasLtMatmul.
// The cache is per thread (no lock on the hot path; thread-safe by construction; a thread rebuilds an
// entry at most once) and bounded (cleared when it reaches kLtCacheCapacity entries). A signature that
// cuBLASLt declines is cached too, so a declined problem costs one lookup.
//
// ---- Switches -----------------------------------------------------------------------------------
//
// The test hook linear_lt (core/knobs.h): torch.ops.opforge._set_knob("linear_lt", 0) sends every GEMM to
// cublasGemmEx, the path of whatever cuBLASLt declines.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace opforge {
namespace gemm {

/// What the GEMM fuses after the product (see the table at the top of this file).
enum class Epilogue : uint8_t { kNone, kReLU, kGELUTanh, kGELUTanhAux, kBiasGradA, kBiasGradB };

/// Everything of a GEMM call but its three operands.
struct GemmArgs {
  bool trans_a = false;               // op(A) = Aᵀ (A stored [k, m])
  bool trans_b = false;               // op(B) = Bᵀ (B stored [n, k])
  double alpha = 1.0;                 // scales the product
  double beta = 0.0;                  // scales D's old value (D is C): 0 overwrites, 1 accumulates
  Epilogue epilogue = Epilogue::kNone;
  at::Tensor bias;                    // [n], D's dtype, or undefined
  at::Tensor aux;                     // [m, n] (row stride may exceed n), D's dtype: kGELUTanhAux's Z
  at::Tensor bias_grad;               // [m] (kBiasGradA) or [n] (kBiasGradB), contiguous, D's dtype: written
  bool prefer_gemm_ex = false;        // gemm(): straight to the cublasGemmEx path (a caller's measured choice)
};

/// D = epilogue(alpha · op(A) · op(B) + beta · D + bias): cuBLASLt if it takes the problem (and
/// args.prefer_gemm_ex is not set), else cublasGemmEx with the epilogue as separate passes. Never fails for a
/// valid problem.
void gemm(const at::Tensor& D, const at::Tensor& A, const at::Tensor& B, const GemmArgs& args = {});

/// The same through cuBLASLt only. Returns false, having written nothing, when cuBLASLt declines.
bool gemm_lt(const at::Tensor& D, const at::Tensor& A, const at::Tensor& B, const GemmArgs& args = {});

/// Z[m, n] = A · Bᵀ + bias (B stored [n, k]) and H[m, j] = silu(Z[m, 2j]) · Z[m, 2j + 1], in one sm90 kernel.
/// Z [m, n] or undefined (then only H is written: the inference form), H [m, n / 2], bias [n] or undefined, all of
/// A's dtype. Returns false, having written nothing, when no fused kernel can take the problem (no CUTLASS in the
/// build, another GPU, dtype, alignment; core/gemm_sm90.h) or when kSwiGLUTable (gemm_cuda.cu, measured on the
/// H200) picks the two-pass path for this shape; the test hook gemm_sm90 overrides the table (core/knobs.h).
bool gemm_swiglu(const at::Tensor& Z, const at::Tensor& H, const at::Tensor& A, const at::Tensor& B,
                 const at::Tensor& bias);

/// D = alpha · op(A) · op(B) + beta · D through cublasGemmEx (batched: cublasGemmStridedBatchedEx); no
/// epilogue, no bias. Any supported dtype, float64 included. k == 0 gives beta · D.
void gemm_ex(const at::Tensor& D, const at::Tensor& A, const at::Tensor& B, const GemmArgs& args = {});

/// D[m, n] = scale_a · scale_b · (A · Bᵀ) through cuBLASLt: A [m, k] and B [n, k] float8 (float8_e4m3fn or
/// float8_e5m2, not both float8_e5m2), 2-D with unit last strides; D [m, n] bfloat16, float16 or float32 with a unit
/// last stride; scale_a and scale_b one-element float32 tensors on D's device, the dequantization multipliers (the
/// reciprocals of the quantization scales), read by the kernel (no host synchronization). fp32 accumulation;
/// fast_accum false promotes the FP8 tensor cores' partial sums to fp32 at cuBLASLt's interval, true never
/// (CUBLASLT_MATMUL_DESC_FAST_ACCUM). cuBLASLt's FP8 kernels want k and the leading dimensions of A and B multiples
/// of 16 and 16-byte aligned pointers. The plan (descriptor, layouts, heuristic's algorithm) is cached per signature
/// as gemm_lt's; the scale pointers are set per call. Returns false, having written nothing, where cuBLASLt declines
/// (or the test hook linear_lt switched cuBLASLt off, or the problem is empty); the caller then runs
/// at::_scaled_mm. Shape, dtype and device mismatches raise (programming errors of the calling op).
bool gemm_fp8(const at::Tensor& D, const at::Tensor& A, const at::Tensor& B, const at::Tensor& scale_a,
              const at::Tensor& scale_b, bool fast_accum);

/// True when gemm_lt may run GEMMs whose A and B have dtype `t`: not float64 (cuBLASLt's fp64 epilogue
/// support is narrow; gemm_ex serves it) and cuBLASLt not switched off (test hook linear_lt).
bool lt_enabled(at::ScalarType t);

/// Raises unless every dimension fits cuBLAS's int arguments:
/// RuntimeError "opforge::<op>: expected M (rows of input: ...), K (in_features) and N (out_features) each
/// at most 2147483647 (cuBLAS takes int dimensions), but got ...".
void check_int_dims(const char* op, int64_t M, int64_t K, int64_t N);

/// Entries of the per-thread cuBLASLt plan cache before it is cleared.
constexpr size_t kLtCacheCapacity = 512;

}  // namespace gemm
}  // namespace opforge
