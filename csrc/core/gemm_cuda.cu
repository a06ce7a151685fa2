// opforge's GEMM layer: see core/gemm.h for the API, the row-major problem and the caching.
//
// cuBLAS is column-major, where a row-major [r, c] matrix with row stride ld reads as its [c, r]
// transpose with leading dimension ld. So D[m, n] = op(A) · op(B) runs as Dᵀ[n, m] = op(B)ᵀ · op(A)ᵀ:
// cuBLAS's "A" is our B (op'd by trans_b), its "B" is our A (op'd by trans_a), its (m, n, k) is our
// (n, m, k). A bias along our rows' n entries runs along cuBLAS's D rows (BIAS epilogue); a sum of op(A)
// over k is a sum of cuBLAS's op(B) (BGRADB), of op(B) over k one of cuBLAS's op(A) (BGRADA).
#include "core/gemm.h"

#include <ATen/Context.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/Exceptions.h>
#include <cublasLt.h>

#include <array>
#include <atomic>
#include <climits>
#include <memory>
#include <type_traits>
#include <unordered_map>

#include "core/activation_cuda.h"
#include "core/check.h"
#include "core/cuda_utils.cuh"
#include "core/gemm_sm90.h"
#include "core/knobs.h"

namespace opforge {
namespace gemm {
namespace {

// ---- cuBLAS types -------------------------------------------------------------------------------

cudaDataType_t cuda_type(at::ScalarType t) {
  switch (t) {
    case at::kDouble: return CUDA_R_64F;
    case at::kFloat: return CUDA_R_32F;
    case at::kHalf: return CUDA_R_16F;
    case at::kBFloat16: return CUDA_R_16BF;
    case at::kFloat8_e4m3fn: return CUDA_R_8F_E4M3;
    case at::kFloat8_e5m2: return CUDA_R_8F_E5M2;
    default: TORCH_CHECK(false, "opforge::gemm: no cuBLAS type for ", t, " (floating dtypes only)");
  }
  return CUDA_R_32F;
}

/// The accumulation type for A and B of dtype `t`: fp64 for float64; for float32, TF32 only where torch
/// allows it for CUDA matmuls (read the way ATen's own cuBLAS(Lt) GEMMs read it); fp32 otherwise.
cublasComputeType_t compute_type(at::ScalarType t) {
  if (t == at::kDouble) return CUBLAS_COMPUTE_64F;
  if (t == at::kFloat &&
      at::globalContext().float32Precision(at::Float32Backend::CUDA, at::Float32Op::MATMUL) ==
          at::Float32Precision::TF32) {
    return CUBLAS_COMPUTE_32F_FAST_TF32;
  }
  return CUBLAS_COMPUTE_32F;
}

bool is_16bit(at::ScalarType t) { return t == at::kHalf || t == at::kBFloat16; }

bool is_fp8(at::ScalarType t) { return t == at::kFloat8_e4m3fn || t == at::kFloat8_e5m2; }

// ---- the problem ------------------------------------------------------------------------------------

/// A row-major operand: [batch,] rows × cols, unit column stride, row stride ld, batch stride.
struct Mat {
  int64_t rows, cols, ld, batch_stride;
  const void* ptr;
};

Mat mat_of(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 || t.dim() == 3, "opforge::gemm: expected ", name, " to be 2-D or 3-D, but got ",
              num_str(t.dim()), "-D");
  const int64_t rows = t.size(-2), cols = t.size(-1);
  // an empty operand (zero rows or columns, e.g. an expanded zero-size view with strides [0, 0]) is never read
  if (t.numel() == 0) return {rows, cols, std::max<int64_t>(cols, 1), 0, t.const_data_ptr()};
  TORCH_CHECK(cols <= 1 || t.stride(-1) == 1, "opforge::gemm: expected ", name,
              " to have a unit last stride (pass a transposed operand as its stored tensor with a trans flag), "
              "but got strides ",
              shape_str(c10::fromIntArrayRefSlow(t.strides())));
  const int64_t ld = rows <= 1 ? std::max<int64_t>(cols, 1) : t.stride(-2);
  TORCH_CHECK(ld >= std::max<int64_t>(cols, 1), "opforge::gemm: expected ", name,
              "'s row stride to be at least its width ", num_str(cols), ", but got ", num_str(ld));
  const int64_t batch_stride = t.dim() == 3 && t.size(0) > 1 ? t.stride(0) : 0;
  return {rows, cols, ld, batch_stride, t.const_data_ptr()};
}

struct Problem {
  int64_t m, n, k, batch;
  Mat a, b, d;
};

/// The problem D = op(A) · op(B) after its checks. `fp8`: gemm_fp8's dtypes (A and B float8, not both e5m2; D
/// 16-bit or float32), else A and B of one dtype and D of it (or float32 for 16-bit A and B).
Problem problem_of(const at::Tensor& D, const at::Tensor& A, const at::Tensor& B, const GemmArgs& args,
                   bool fp8 = false) {
  TORCH_CHECK(A.dim() == D.dim() && B.dim() == D.dim(), "opforge::gemm: expected A, B and D of one rank, but got ",
              num_str(A.dim()), ", ", num_str(B.dim()), " and ", num_str(D.dim()));
  const at::ScalarType ab = A.scalar_type(), dt = D.scalar_type();
  if (fp8) {
    TORCH_CHECK(is_fp8(ab) && is_fp8(B.scalar_type()) &&
                    !(ab == at::kFloat8_e5m2 && B.scalar_type() == at::kFloat8_e5m2) &&
                    (is_16bit(dt) || dt == at::kFloat),
                "opforge::gemm: expected float8 A and B (not both float8_e5m2) and a bfloat16, float16 or float32 "
                "D, but got ", ab, ", ", B.scalar_type(), " and ", dt);
  } else {
    TORCH_CHECK(B.scalar_type() == ab && (dt == ab || (dt == at::kFloat && is_16bit(ab))),
                "opforge::gemm: expected A and B of one dtype and D of that dtype (or float32 for 16-bit A and B), "
                "but got ", ab, ", ", B.scalar_type(), " and ", dt);
  }
  TORCH_CHECK(D.is_cuda() && A.device() == D.device() && B.device() == D.device(),
              "opforge::gemm: expected A, B and D on one CUDA device, but got ", A.device(), ", ", B.device(),
              " and ", D.device());
  Problem p{};
  p.a = mat_of(A, "A");
  p.b = mat_of(B, "B");
  p.d = mat_of(D, "D");
  p.m = p.d.rows;
  p.n = p.d.cols;
  p.k = args.trans_a ? p.a.rows : p.a.cols;
  const int64_t am = args.trans_a ? p.a.cols : p.a.rows;
  const int64_t bk = args.trans_b ? p.b.cols : p.b.rows, bn = args.trans_b ? p.b.rows : p.b.cols;
  TORCH_CHECK(am == p.m && bk == p.k && bn == p.n, "opforge::gemm: expected op(A) [m, k], op(B) [k, n] and D [m, n], "
              "but got op(A) [", num_str(am), ", ", num_str(p.k), "], op(B) [", num_str(bk), ", ", num_str(bn),
              "], D [", num_str(p.m), ", ", num_str(p.n), "]");
  p.batch = D.dim() == 3 ? D.size(0) : 1;
  if (D.dim() == 3) {
    TORCH_CHECK(A.size(0) == p.batch && B.size(0) == p.batch, "opforge::gemm: expected A, B and D of one batch, "
                "but got ", num_str(A.size(0)), ", ", num_str(B.size(0)), " and ", num_str(p.batch));
    TORCH_CHECK(args.epilogue == Epilogue::kNone && !args.bias.defined(),
                "opforge::gemm: a batched GEMM takes no epilogue and no bias");
  }
  if (args.bias.defined()) {
    TORCH_CHECK(args.bias.dim() == 1 && args.bias.size(0) == p.n && args.bias.scalar_type() == dt &&
                    args.bias.device() == D.device(),
                "opforge::gemm: expected bias of shape [n] = [", num_str(p.n), "] and D's dtype ", dt, ", but got ",
                shape_str(args.bias.sym_sizes()), " ", args.bias.scalar_type());
    TORCH_CHECK(args.epilogue != Epilogue::kBiasGradA && args.epilogue != Epilogue::kBiasGradB,
                "opforge::gemm: a bias-gradient epilogue takes no bias");
  }
  if (args.epilogue == Epilogue::kGELUTanhAux) {
    TORCH_CHECK(args.aux.defined() && args.aux.dim() == 2 && args.aux.size(0) == p.m && args.aux.size(1) == p.n &&
                    args.aux.scalar_type() == dt && args.aux.device() == D.device(),
                "opforge::gemm: expected aux of shape [m, n] = [", num_str(p.m), ", ", num_str(p.n),
                "] and D's dtype for kGELUTanhAux");
    mat_of(args.aux, "aux");
  }
  if (args.epilogue == Epilogue::kBiasGradA || args.epilogue == Epilogue::kBiasGradB) {
    const int64_t len = args.epilogue == Epilogue::kBiasGradA ? p.m : p.n;
    TORCH_CHECK(args.bias_grad.defined() && args.bias_grad.dim() == 1 && args.bias_grad.size(0) == len &&
                    args.bias_grad.is_contiguous() && args.bias_grad.scalar_type() == dt &&
                    args.bias_grad.device() == D.device(),
                "opforge::gemm: expected a contiguous bias_grad of shape [", num_str(len), "] and D's dtype ", dt);
  }
  return p;
}

bool is_empty(const Problem& p) { return p.m == 0 || p.n == 0 || p.k == 0 || p.batch == 0; }

void check_int(const Problem& p) {
  constexpr int64_t kMax = INT_MAX;
  TORCH_CHECK(p.m <= kMax && p.n <= kMax && p.k <= kMax && p.batch <= kMax && p.a.ld <= kMax && p.b.ld <= kMax &&
                  p.d.ld <= kMax,
              "opforge::gemm: a dimension or leading dimension exceeds cuBLAS's int arguments (m = ", num_str(p.m),
              ", n = ", num_str(p.n), ", k = ", num_str(p.k), ")");
}

// ---- cuBLASLt plans and their cache -------------------------------------------------------------------

/// The largest power of two up to 16 that divides the address: cuBLASLt's alignment preferences.
uint32_t alignment_of(const void* p) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  uint32_t al = 16;
  while (al > 1 && a % al != 0) al /= 2;
  return al;
}

template <typename T>
void set_desc(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t attr, const T& value) {
  TORCH_CUDABLAS_CHECK(cublasLtMatmulDescSetAttribute(d, attr, &value, sizeof(value)));
}
template <typename T>
void set_pref(cublasLtMatmulPreference_t d, cublasLtMatmulPreferenceAttributes_t attr, const T& value) {
  TORCH_CUDABLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(d, attr, &value, sizeof(value)));
}
template <typename T>
void set_layout(cublasLtMatrixLayout_t d, cublasLtMatrixLayoutAttribute_t attr, const T& value) {
  TORCH_CUDABLAS_CHECK(cublasLtMatrixLayoutSetAttribute(d, attr, &value, sizeof(value)));
}

/// Everything cuBLASLt needs for one problem signature but the pointers: descriptor, layouts, algorithm.
/// `ok` false: cuBLASLt declined this signature (kept so that a declined problem is not asked again).
struct LtPlan {
  bool ok = false;
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;  // cuBLAS's A (our B), B (our A), C = D
  cublasLtMatmulAlgo_t algo{};
  LtPlan() = default;
  LtPlan(const LtPlan&) = delete;
  LtPlan& operator=(const LtPlan&) = delete;
  ~LtPlan() {  // destroy never fails on a valid descriptor
    if (op) cublasLtMatmulDescDestroy(op);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (d) cublasLtMatrixLayoutDestroy(d);
  }
};

cublasLtEpilogue_t lt_epilogue(Epilogue e, bool has_bias) {
  switch (e) {
    case Epilogue::kNone: return has_bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT;
    case Epilogue::kReLU: return has_bias ? CUBLASLT_EPILOGUE_RELU_BIAS : CUBLASLT_EPILOGUE_RELU;
    case Epilogue::kGELUTanh: return has_bias ? CUBLASLT_EPILOGUE_GELU_BIAS : CUBLASLT_EPILOGUE_GELU;
    case Epilogue::kGELUTanhAux: return has_bias ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_AUX;
    case Epilogue::kBiasGradA: return CUBLASLT_EPILOGUE_BGRADB;
    case Epilogue::kBiasGradB: return CUBLASLT_EPILOGUE_BGRADA;
  }
  return CUBLASLT_EPILOGUE_DEFAULT;
}

/// The signature of a cuBLASLt call: every value its plan depends on.
using LtKey = std::array<int64_t, 28>;

struct LtKeyHash {
  size_t operator()(const LtKey& k) const noexcept {
    uint64_t h = 1469598103934665603ull;  // FNV-1a over the 64-bit words
    for (int64_t v : k) h = (h ^ static_cast<uint64_t>(v)) * 1099511628211ull;
    return static_cast<size_t>(h);
  }
};

/// The FP8 parts of a call (gemm_fp8): the dequantization multipliers, device pointers to one float each, and the
/// accumulation mode.
struct LtScales {
  const void* a;    // our A's: cuBLAS's B_SCALE_POINTER
  const void* b;    // our B's: cuBLAS's A_SCALE_POINTER
  bool fast_accum;  // CUBLASLT_MATMUL_DESC_FAST_ACCUM
};

/// The pointers of this call that live in the descriptor: the epilogue's, and the FP8 scales.
struct LtPointers {
  const void* bias;                // the bias, or bias_grad for a BGRAD epilogue (cuBLASLt's one BIAS_POINTER)
  void* aux;
  const LtScales* fp8 = nullptr;  // FP8 operands only
};

void set_pointers(cublasLtMatmulDesc_t op, const LtPointers& ptrs) {
  set_desc(op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, ptrs.bias);
  set_desc(op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, ptrs.aux);
  if (ptrs.fp8 != nullptr) {
    set_desc(op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, ptrs.fp8->b);
    set_desc(op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, ptrs.fp8->a);
  }
}

/// Builds the plan of one signature (cuBLAS's column-major view, see the top of this file). `a_type`, `b_type`: our
/// A's and B's dtypes.
std::unique_ptr<LtPlan> make_plan(const Problem& p, const GemmArgs& args, at::ScalarType a_type,
                                  at::ScalarType b_type, at::ScalarType dt, cublasComputeType_t compute,
                                  cublasLtEpilogue_t epilogue, const LtPointers& ptrs, size_t workspace_size) {
  auto plan = std::make_unique<LtPlan>();
  TORCH_CUDABLAS_CHECK(cublasLtMatmulDescCreate(&plan->op, compute, CUDA_R_32F));
  set_desc(plan->op, CUBLASLT_MATMUL_DESC_TRANSA, args.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N);
  set_desc(plan->op, CUBLASLT_MATMUL_DESC_TRANSB, args.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N);
  set_desc(plan->op, CUBLASLT_MATMUL_DESC_EPILOGUE, epilogue);
  if (ptrs.fp8 != nullptr) {
    set_desc(plan->op, CUBLASLT_MATMUL_DESC_FAST_ACCUM, static_cast<int8_t>(ptrs.fp8->fast_accum));
  }
  if (args.epilogue == Epilogue::kGELUTanhAux) {
    set_desc(plan->op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, mat_of(args.aux, "aux").ld);
  }
  set_pointers(plan->op, ptrs);  // the heuristic sees this call's pointers (their alignments are in the key)

  const cudaDataType_t td = cuda_type(dt);
  // cuBLAS's A = our B: stored column-major [n, k] ([k, n] when trans_b), i.e. our B's [cols, rows]
  TORCH_CUDABLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->a, cuda_type(b_type), p.b.cols, p.b.rows, p.b.ld));
  TORCH_CUDABLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->b, cuda_type(a_type), p.a.cols, p.a.rows, p.a.ld));
  TORCH_CUDABLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->d, td, p.n, p.m, p.d.ld));
  if (p.batch > 1) {
    const int32_t count = static_cast<int32_t>(p.batch);
    const std::pair<cublasLtMatrixLayout_t, int64_t> layouts[] = {
        {plan->a, p.b.batch_stride}, {plan->b, p.a.batch_stride}, {plan->d, p.d.batch_stride}};
    for (const auto& [layout, stride] : layouts) {
      set_layout(layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, count);
      set_layout(layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, stride);
    }
  }

  cublasLtMatmulPreference_t pref = nullptr;
  TORCH_CUDABLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  std::unique_ptr<std::remove_pointer_t<cublasLtMatmulPreference_t>, cublasStatus_t (*)(cublasLtMatmulPreference_t)>
      pref_owner(pref, &cublasLtMatmulPreferenceDestroy);
  set_pref(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, static_cast<uint64_t>(workspace_size));
  set_pref(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, alignment_of(p.b.ptr));
  set_pref(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, alignment_of(p.a.ptr));
  set_pref(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, alignment_of(p.d.ptr));
  set_pref(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, alignment_of(p.d.ptr));
  // Split-K partial sums are added in fp32 (or not split), never in a 16-bit output type: on the H200 an
  // algorithm reducing in bf16 gave 8x F.linear's error (M=8, K=5120, N=7), although torch's
  // allow_bf16_reduced_precision_reduction permits it. fp32 and fp64 outputs reduce in their own type.
  if (is_16bit(dt)) {
    set_pref(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
             static_cast<uint32_t>(CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE | CUBLASLT_REDUCTION_SCHEME_NONE));
  }
  cublasLtMatmulHeuristicResult_t heuristic{};
  int found = 0;
  const cublasStatus_t hs = cublasLtMatmulAlgoGetHeuristic(at::cuda::getCurrentCUDABlasLtHandle(), plan->op, plan->a,
                                                           plan->b, plan->d, plan->d, pref, 1, &heuristic, &found);
  if (hs == CUBLAS_STATUS_NOT_SUPPORTED || (hs == CUBLAS_STATUS_SUCCESS && found == 0)) return plan;  // declined
  TORCH_CUDABLAS_CHECK(hs);
  plan->algo = heuristic.algo;
  plan->ok = true;
  return plan;
}

/// This thread's plan for the signature, built on first use.
LtPlan& plan_for(const LtKey& key, const Problem& p, const GemmArgs& args, at::ScalarType a_type,
                 at::ScalarType b_type, at::ScalarType dt, cublasComputeType_t compute, cublasLtEpilogue_t epilogue,
                 const LtPointers& ptrs, size_t workspace_size) {
  thread_local std::unordered_map<LtKey, std::unique_ptr<LtPlan>, LtKeyHash> cache;
  auto it = cache.find(key);
  if (it != cache.end()) return *it->second;
  if (cache.size() >= kLtCacheCapacity) cache.clear();
  auto plan = make_plan(p, args, a_type, b_type, dt, compute, epilogue, ptrs, workspace_size);
  return *cache.emplace(key, std::move(plan)).first->second;
}

void epilogue_pass(const at::Tensor& D, const at::Tensor& A, const at::Tensor& B, const GemmArgs& args);

// ---- the sm90 engine (core/gemm_sm90.h) ---------------------------------------------------------------

/// True when `device` is compute capability 9.0 (H100/H200: the sm_90a kernels run there only); cached per device.
bool device_is_sm90(int device) {
  constexpr int kMaxDevices = 64;
  static std::array<std::atomic<int8_t>, kMaxDevices> state{};  // 0 unknown, 1 yes, 2 no
  if (device < 0 || device >= kMaxDevices) return false;
  int8_t v = state[device].load(std::memory_order_relaxed);
  if (v == 0) {
    const cudaDeviceProp* prop = at::cuda::getDeviceProperties(device);
    v = prop->major == 9 && prop->minor == 0 ? 1 : 2;
    state[device].store(v, std::memory_order_relaxed);
  }
  return v == 1;
}

/// Where the sm90 kernel runs instead of cuBLASLt, per (M, N, K) bucket: the first row whose bounds hold wins
/// (16-bit linear problems the kernel can take; see sm90_takes).
struct Sm90Bucket {
  int64_t min_m, min_n, min_k;  // the bucket: M >= min_m, N >= min_n, K >= min_k
  bool sm90;                    // true: the sm90 kernel; false: cuBLASLt
};
constexpr Sm90Bucket kSm90Table[] = {
    {1, 1, 1, false},  // not yet measured against cuBLASLt: cuBLASLt everywhere
};

bool sm90_choice(int64_t M, int64_t N, int64_t K) {
  for (const auto& row : kSm90Table) {
    if (M >= row.min_m && N >= row.min_n && K >= row.min_k) return row.sm90;
  }
  return false;
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

/// What swiglu_linear's forward runs per (M, N, K) bucket: the first row whose bounds hold wins. kTwoPass: the GEMM
/// (gemm_lt) then the swiglu kernel over z; kPingPong: kSwiGLUBF16PingPong (z and h; kSwiGLUBF16PingPongH when z is
/// not wanted). `train` is the choice where z is wanted (backward reads it), `infer` where only h is. Measured by
/// benchmarks/bench_gemm.py's swiglu_linear rows on the H200 (docs/performance/gemm.md); a fused row falls back to two
/// passes where its kernel cannot run.
enum class SwiGLUPath : uint8_t { kTwoPass, kPingPong };
struct SwiGLUBucket {
  int64_t min_m, min_n, min_k;  // the bucket: M >= min_m, N >= min_n, K >= min_k (N counts z's columns, 2 I)
  SwiGLUPath train, infer;
};
constexpr SwiGLUBucket kSwiGLUTable[] = {
    // H200, bf16, 8192x2048x{3072,16384} (K 2048, N = 2 I), µs: ping-pong with z and h 144.3 / 786.6 against two
    // passes 156.2 / 820.1, h alone 141.0 / 740.0 against 156.6 / 819.8.
    // Smaller M is not measured: two passes there.
    {4096, 1, 1, SwiGLUPath::kPingPong, SwiGLUPath::kPingPong},
    {1, 1, 1, SwiGLUPath::kTwoPass, SwiGLUPath::kTwoPass},
};

SwiGLUPath swiglu_choice(int64_t M, int64_t N, int64_t K, bool want_z) {
  for (const auto& row : kSwiGLUTable) {
    if (M >= row.min_m && N >= row.min_n && K >= row.min_k) return want_z ? row.train : row.infer;
  }
  return SwiGLUPath::kTwoPass;
}

/// Why the sm90 kernel cannot take this problem (nullptr: it can). D = op(A) · op(B) (+ bias).
const char* sm90_refusal(const Problem& p, const at::Tensor& D, const at::Tensor& A, const GemmArgs& args) {
  if (!sm90::available()) return "this build has no CUTLASS sm90 kernels (OPFORGE_CUTLASS)";
  if (!device_is_sm90(D.get_device())) return "the GPU is not compute capability 9.0";
  const at::ScalarType t = A.scalar_type();
  if (!is_16bit(t) || D.scalar_type() != t) return "A, B and D must share one 16-bit dtype";
  if (p.batch != 1 || args.trans_a || !args.trans_b) return "only 2-D A · Bᵀ (B stored [n, k])";
  if (args.alpha != 1.0 || args.beta != 0.0 || args.epilogue != Epilogue::kNone) return "alpha 1, beta 0, no activation";
  if (p.k % 8 != 0 || p.n % 8 != 0 || p.a.ld % 8 != 0 || p.b.ld % 8 != 0 || p.d.ld % 8 != 0) {
    return "K, N and the leading dimensions must be multiples of 8";
  }
  if (!aligned16(p.a.ptr) || !aligned16(p.b.ptr) || !aligned16(p.d.ptr)) return "A, B and D must be 16-byte aligned";
  return nullptr;
}

sm90::Problem sm90_problem(const Problem& p, const at::Tensor& D) {
  sm90::Problem q;
  q.M = static_cast<int>(p.m);
  q.N = static_cast<int>(p.n);
  q.K = static_cast<int>(p.k);
  q.A = p.a.ptr;
  q.lda = p.a.ld;
  q.B = p.b.ptr;
  q.ldb = p.b.ld;
  q.D = D.mutable_data_ptr();
  q.ldd = p.d.ld;
  q.device = D.get_device();
  q.sm_count = at::cuda::getDeviceProperties(q.device)->multiProcessorCount;
  return q;
}

/// Runs the sm90 kernel; false when it declined at run time (nothing written).
bool sm90_run(sm90::Kernel kernel, const sm90::Problem& q, const at::Tensor& like) {
  const size_t ws_size = sm90::workspace_size(kernel, q);
  at::Tensor ws;
  if (ws_size > 0) ws = at::empty({static_cast<int64_t>(ws_size)}, like.options().dtype(at::kByte));
  const sm90::Status st = sm90::run(kernel, q, ws_size > 0 ? ws.mutable_data_ptr() : nullptr,
                                    at::cuda::getCurrentCUDAStream());
  if (st == sm90::Status::kOk) {
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return true;
  }
  TORCH_CHECK(st == sm90::Status::kCannotImplement, "opforge::gemm: the sm90 kernel failed to launch");
  return false;
}

/// D = A · Bᵀ (+ bias) through the sm90 kernel where the chooser (or the test hook gemm_sm90) sends it.
bool try_sm90(const Problem& p, const at::Tensor& D, const at::Tensor& A, const GemmArgs& args, const at::Tensor& bias) {
  const int64_t mode = knobs::get(knobs::Knob::kGemmSm90);
  if (mode == 0) return false;
  const char* refusal = sm90_refusal(p, D, A, args);
  if (refusal == nullptr && bias.defined() && !aligned16(bias.const_data_ptr())) refusal = "bias must be 16-byte aligned";
  TORCH_CHECK(mode < 2 || refusal == nullptr, "opforge::gemm: the sm90 kernel cannot take this problem (test hook "
              "gemm_sm90 >= 2): ", refusal ? refusal : "");
  if (refusal != nullptr || (mode < 0 && !sm90_choice(p.m, p.n, p.k))) return false;
  sm90::Problem q = sm90_problem(p, D);
  q.bias = bias.defined() ? bias.const_data_ptr() : nullptr;
  sm90::Kernel kernel = A.scalar_type() == at::kBFloat16 ? sm90::Kernel::kLinearBF16 : sm90::Kernel::kLinearFP16;
  if (mode == 3 && kernel == sm90::Kernel::kLinearBF16) kernel = sm90::Kernel::kLinearBF16PingPong;
  const bool ran = sm90_run(kernel, q, D);
  TORCH_CHECK(ran || mode < 2, "opforge::gemm: the sm90 kernel declined the problem (test hook gemm_sm90 >= 2)");
  return ran;
}

}  // namespace

namespace sm90 {

#ifdef OPFORGE_WITH_CUTLASS
bool available() { return true; }

size_t workspace_size(Kernel kernel, const Problem& p) {
  switch (kernel) {
    case Kernel::kLinearBF16: return workspace_linear_bf16(p);
    case Kernel::kLinearFP16: return workspace_linear_fp16(p);
    case Kernel::kLinearBF16PingPong: return workspace_linear_bf16_pingpong(p);
    case Kernel::kSwiGLUBF16PingPong: return workspace_swiglu_bf16_pingpong(p);
    case Kernel::kSwiGLUBF16PingPongH: return workspace_swiglu_bf16_pingpong_h(p);
  }
  return 0;
}

Status run(Kernel kernel, const Problem& p, void* workspace, cudaStream_t stream) {
  switch (kernel) {
    case Kernel::kLinearBF16: return run_linear_bf16(p, workspace, stream);
    case Kernel::kLinearFP16: return run_linear_fp16(p, workspace, stream);
    case Kernel::kLinearBF16PingPong: return run_linear_bf16_pingpong(p, workspace, stream);
    case Kernel::kSwiGLUBF16PingPong: return run_swiglu_bf16_pingpong(p, workspace, stream);
    case Kernel::kSwiGLUBF16PingPongH: return run_swiglu_bf16_pingpong_h(p, workspace, stream);
  }
  return Status::kCannotImplement;
}
#else
bool available() { return false; }
size_t workspace_size(Kernel, const Problem&) { return 0; }
Status run(Kernel, const Problem&, void*, cudaStream_t) { return Status::kCannotImplement; }
#endif

}  // namespace sm90

bool lt_enabled(at::ScalarType t) { return t != at::kDouble && knobs::get(knobs::Knob::kLinearLt) != 0; }

void check_int_dims(const char* op, int64_t M, int64_t K, int64_t N) {
  constexpr int64_t kMax = INT_MAX;
  TORCH_CHECK(M <= kMax && K <= kMax && N <= kMax, "opforge::", op,
              ": expected M (rows of input: the product of its leading dims), K (in_features) and N (out_features) "
              "each at most ",
              num_str(kMax), " (cuBLAS takes int dimensions), but got M = ", num_str(M), ", K = ", num_str(K),
              ", N = ", num_str(N), "; split the input's rows into smaller calls");
}

namespace {

/// Runs the checked, non-empty problem through cuBLASLt with the cached plan of its signature; false, having written
/// nothing, where cuBLASLt declines. `bias`: args.bias made 16-byte aligned (or undefined). `fp8`: gemm_fp8's scales
/// (A and B float8), else nullptr.
bool lt_run(const Problem& p, const at::Tensor& D, const at::Tensor& A, const at::Tensor& B, const GemmArgs& args,
            const at::Tensor& bias, const LtScales* fp8) {
  const at::ScalarType a_type = A.scalar_type(), b_type = B.scalar_type(), dt = D.scalar_type();
  const void* bias_ptr = bias.defined() ? bias.const_data_ptr() : nullptr;
  void* aux_ptr = args.epilogue == Epilogue::kGELUTanhAux ? args.aux.mutable_data_ptr() : nullptr;
  void* bias_grad_ptr = args.epilogue == Epilogue::kBiasGradA || args.epilogue == Epilogue::kBiasGradB
                            ? args.bias_grad.mutable_data_ptr()
                            : nullptr;
  // FP8 products accumulate in fp32 (cuBLASLt's only compute type for them)
  const cublasComputeType_t compute = fp8 != nullptr ? CUBLAS_COMPUTE_32F : compute_type(a_type);
  const cublasLtEpilogue_t epilogue = lt_epilogue(args.epilogue, bias.defined());
  const size_t workspace_size = at::cuda::getCUDABlasLtWorkspaceSize();
  const uint32_t align_bias = bias_ptr ? alignment_of(bias_ptr) : 0, align_aux = aux_ptr ? alignment_of(aux_ptr) : 0,
                 align_bias_grad = bias_grad_ptr ? alignment_of(bias_grad_ptr) : 0;
  const LtKey key{D.get_device(),
                  static_cast<int64_t>(a_type),
                  static_cast<int64_t>(dt),
                  static_cast<int64_t>(compute),
                  args.trans_a,
                  args.trans_b,
                  p.m,
                  p.n,
                  p.k,
                  p.batch,
                  p.a.ld,
                  p.b.ld,
                  p.d.ld,
                  p.a.batch_stride,
                  p.b.batch_stride,
                  p.d.batch_stride,
                  static_cast<int64_t>(epilogue),
                  aux_ptr ? mat_of(args.aux, "aux").ld : 0,
                  alignment_of(p.a.ptr),
                  alignment_of(p.b.ptr),
                  alignment_of(p.d.ptr),
                  align_bias,
                  align_aux,
                  align_bias_grad,
                  static_cast<int64_t>(workspace_size),
                  static_cast<int64_t>(b_type),
                  fp8 != nullptr ? 1 + static_cast<int64_t>(fp8->fast_accum) : 0,
                  0};
  const LtPointers ptrs{bias_grad_ptr != nullptr ? bias_grad_ptr : bias_ptr, aux_ptr, fp8};
  LtPlan& plan = plan_for(key, p, args, a_type, b_type, dt, compute, epilogue, ptrs, workspace_size);
  if (!plan.ok) return false;
  set_pointers(plan.op, ptrs);  // this call's (the plan is this thread's: no other thread touches it)
  const float alpha = static_cast<float>(args.alpha), beta = static_cast<float>(args.beta);
  const cublasStatus_t st =
      cublasLtMatmul(at::cuda::getCurrentCUDABlasLtHandle(), plan.op, &alpha, p.b.ptr, plan.a, p.a.ptr, plan.b, &beta,
                     p.d.ptr, plan.d, D.mutable_data_ptr(), plan.d, &plan.algo, at::cuda::getCUDABlasLtWorkspace(),
                     workspace_size, at::cuda::getCurrentCUDAStream());
  if (st == CUBLAS_STATUS_NOT_SUPPORTED) {
    plan.ok = false;  // declined at run time: ask no more
    return false;
  }
  TORCH_CUDABLAS_CHECK(st);
  return true;
}

}  // namespace

bool gemm_lt(const at::Tensor& D, const at::Tensor& A, const at::Tensor& B, const GemmArgs& args) {
  const Problem p = problem_of(D, A, B, args);
  if (is_empty(p) || !lt_enabled(A.scalar_type())) return false;
  check_int(p);
  at::Tensor bias = args.bias;
  if (bias.defined()) bias = cuda::aligned16_or_copy(bias);  // the bias epilogue wants 16-byte alignment
  if (try_sm90(p, D, A, args, bias)) return true;
  return lt_run(p, D, A, B, args, bias, nullptr);
}

bool gemm_fp8(const at::Tensor& D, const at::Tensor& A, const at::Tensor& B, const at::Tensor& scale_a,
              const at::Tensor& scale_b, bool fast_accum) {
  GemmArgs args;
  args.trans_b = true;  // D = A · Bᵀ: both operands K-major, cuBLASLt's "TN", the one layout of its FP8 kernels
  TORCH_CHECK(A.dim() == 2, "opforge::gemm: gemm_fp8 takes 2-D operands, but got ", num_str(A.dim()), "-D");
  const Problem p = problem_of(D, A, B, args, /*fp8=*/true);
  for (const at::Tensor* s : {&scale_a, &scale_b}) {
    TORCH_CHECK(s->scalar_type() == at::kFloat && s->numel() == 1 && s->device() == D.device(),
                "opforge::gemm: expected one-element float32 scales on D's device, but got ", s->scalar_type(),
                " of ", num_str(s->numel()), " elements on ", s->device());
  }
  if (is_empty(p) || knobs::get(knobs::Knob::kLinearLt) == 0) return false;
  check_int(p);
  const LtScales scales{scale_a.const_data_ptr(), scale_b.const_data_ptr(), fast_accum};
  return lt_run(p, D, A, B, args, at::Tensor(), &scales);
}

bool gemm_swiglu(const at::Tensor& Z, const at::Tensor& H, const at::Tensor& A, const at::Tensor& B,
                 const at::Tensor& bias) {
  const bool want_z = Z.defined();
  TORCH_CHECK(H.dim() == 2 && A.dim() == 2 && B.dim() == 2 && H.size(0) == A.size(0) && 2 * H.size(1) == B.size(0),
              "opforge::gemm: expected H of shape [m, n / 2] for A [m, k] and B [n, k]");
  TORCH_CHECK(H.scalar_type() == A.scalar_type() && H.device() == A.device() &&
                  (H.size(0) <= 1 || H.stride(0) >= H.size(1)) && (H.size(1) <= 1 || H.stride(1) == 1),
              "opforge::gemm: expected H of shape [m, n / 2] with a unit last stride and A's dtype");
  GemmArgs args;
  args.trans_b = true;
  args.bias = bias;
  // Z's problem; without Z, the same sizes with a contiguous z that is never stored (H stands in for D's dtype and
  // device in the checks)
  Problem p{};
  if (want_z) {
    p = problem_of(Z, A, B, args);
  } else {
    TORCH_CHECK(B.scalar_type() == A.scalar_type() && A.device() == B.device() && B.size(1) == A.size(1),
                "opforge::gemm: expected A [m, k] and B [n, k] of one dtype and device");
    p.a = mat_of(A, "A");
    p.b = mat_of(B, "B");
    p.m = A.size(0);
    p.n = B.size(0);
    p.k = A.size(1);
    p.batch = 1;
    p.d = {p.m, p.n, std::max<int64_t>(p.n, 1), 0, nullptr};
  }
  const int64_t mode = knobs::get(knobs::Knob::kGemmSm90);
  if (is_empty(p) || mode == 0) return false;
  // Which path: the table (mode -1), else the test hook: the ping-pong kernel (1: where it takes the problem, else
  // two passes; 2 and 3: it or raise).
  const SwiGLUPath path = mode < 0 ? swiglu_choice(p.m, p.n, p.k, want_z) : SwiGLUPath::kPingPong;
  if (path == SwiGLUPath::kTwoPass) return false;
  const char* refusal = sm90_refusal(p, want_z ? Z : H, A, args);
  if (refusal == nullptr && A.scalar_type() != at::kBFloat16) refusal = "the SwiGLU kernels are built for bfloat16 only";
  const int64_t ldh = H.size(0) <= 1 ? H.size(1) : H.stride(0);
  if (refusal == nullptr && (ldh % 8 != 0 || !aligned16(H.const_data_ptr()))) {
    refusal = "the SwiGLU kernels store H by TMA: H's row stride (n / 2 when contiguous) must be a multiple of 8 and "
              "its base 16-byte aligned";
  }
  TORCH_CHECK(mode < 2 || refusal == nullptr, "opforge::gemm: the sm90 kernel cannot take this problem (test hook "
              "gemm_sm90 >= 2): ", refusal ? refusal : "");
  if (refusal != nullptr) return false;
  check_int(p);
  at::Tensor b = bias;
  if (b.defined()) b = cuda::aligned16_or_copy(b);
  sm90::Problem q = sm90_problem(p, want_z ? Z : H);
  if (!want_z) q.D = nullptr;  // the kernel without D
  q.ldd = want_z ? p.d.ld : p.n;
  q.bias = b.defined() ? b.const_data_ptr() : nullptr;
  q.H = H.mutable_data_ptr();
  q.ldh = ldh;
  const sm90::Kernel kernel = want_z ? sm90::Kernel::kSwiGLUBF16PingPong : sm90::Kernel::kSwiGLUBF16PingPongH;
  const bool ran = sm90_run(kernel, q, H);
  TORCH_CHECK(ran || mode < 2, "opforge::gemm: the sm90 kernel declined the problem (test hook gemm_sm90 >= 2)");
  return ran;
}

void gemm_ex(const at::Tensor& D, const at::Tensor& A, const at::Tensor& B, const GemmArgs& args) {
  TORCH_CHECK(args.epilogue == Epilogue::kNone && !args.bias.defined(),
              "opforge::gemm: gemm_ex takes no epilogue and no bias (gemm runs them as separate passes)");
  const Problem p = problem_of(D, A, B, args);
  if (p.m == 0 || p.n == 0 || p.batch == 0) return;
  if (p.k == 0) {  // an empty sum: cuBLAS rejects zero dims, so they never reach it
    if (args.beta == 0.0) {
      D.zero_();
    } else if (args.beta != 1.0) {
      D.mul_(args.beta);
    }
    return;
  }
  check_int(p);
  const at::ScalarType ab = A.scalar_type(), dt = D.scalar_type();
  const cudaDataType_t tab = cuda_type(ab), td = cuda_type(dt);
  const cublasComputeType_t compute = compute_type(ab);
  const bool double_scalars = compute == CUBLAS_COMPUTE_64F;
  const double alpha_d = args.alpha, beta_d = args.beta;
  const float alpha_f = static_cast<float>(args.alpha), beta_f = static_cast<float>(args.beta);
  const void* alpha = double_scalars ? static_cast<const void*>(&alpha_d) : static_cast<const void*>(&alpha_f);
  const void* beta = double_scalars ? static_cast<const void*>(&beta_d) : static_cast<const void*>(&beta_f);
  const int M = static_cast<int>(p.m), N = static_cast<int>(p.n), K = static_cast<int>(p.k);
  const cublasOperation_t op_b = args.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, op_a = args.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;

  cublasHandle_t handle = at::cuda::getCurrentCUDABlasHandle();  // torch's handle: workspace + math mode set
  TORCH_CUDABLAS_CHECK(cublasSetStream(handle, at::cuda::getCurrentCUDAStream()));
  TORCH_CUDABLAS_CHECK(cublasSetPointerMode(handle, CUBLAS_POINTER_MODE_HOST));
  if (p.batch == 1) {
    TORCH_CUDABLAS_CHECK(cublasGemmEx(handle, op_b, op_a, N, M, K, alpha,            //
                                      p.b.ptr, tab, static_cast<int>(p.b.ld),        // op(B)ᵀ
                                      p.a.ptr, tab, static_cast<int>(p.a.ld), beta,  // op(A)ᵀ
                                      D.mutable_data_ptr(), td, static_cast<int>(p.d.ld),  // Dᵀ
                                      compute, CUBLAS_GEMM_DEFAULT));
  } else {
    TORCH_CUDABLAS_CHECK(cublasGemmStridedBatchedEx(
        handle, op_b, op_a, N, M, K, alpha,                                         //
        p.b.ptr, tab, static_cast<int>(p.b.ld), p.b.batch_stride,                   // op(B)ᵀ
        p.a.ptr, tab, static_cast<int>(p.a.ld), p.a.batch_stride, beta,             // op(A)ᵀ
        D.mutable_data_ptr(), td, static_cast<int>(p.d.ld), p.d.batch_stride,       // Dᵀ
        static_cast<int>(p.batch), compute, CUBLAS_GEMM_DEFAULT));
  }
}

void gemm(const at::Tensor& D, const at::Tensor& A, const at::Tensor& B, const GemmArgs& args) {
  if (!args.prefer_gemm_ex && gemm_lt(D, A, B, args)) return;
  // The fallback: the bias into D first (then accumulate with beta = 1), cublasGemmEx, the epilogue.
  GemmArgs ex;
  ex.trans_a = args.trans_a;
  ex.trans_b = args.trans_b;
  ex.alpha = args.alpha;
  ex.beta = args.beta;
  const Problem p = problem_of(D, A, B, args);
  if (args.bias.defined() && p.m > 0 && p.n > 0) {
    const at::Tensor bias = args.bias.expand({p.m, p.n});
    if (args.beta == 0.0) {
      D.copy_(bias);
    } else {
      if (args.beta != 1.0) D.mul_(args.beta);
      D.add_(bias);
    }
    ex.beta = 1.0;
  }
  gemm_ex(D, A, B, ex);
  epilogue_pass(D, A, B, args);
}

namespace {

/// The epilogue after gemm_ex: the activation in place on D (aux = D first), or the bias gradient.
void epilogue_pass(const at::Tensor& D, const at::Tensor& A, const at::Tensor& B, const GemmArgs& args) {
  const at::ScalarType acc = at::toOpMathType(D.scalar_type());
  switch (args.epilogue) {
    case Epilogue::kNone: return;
    case Epilogue::kBiasGradA:  // bias_grad[m] = Σ_k op(A)[m, k]
      args.bias_grad.copy_(at::sum(A, {args.trans_a ? 0 : 1}, /*keepdim=*/false, acc));
      return;
    case Epilogue::kBiasGradB:  // bias_grad[n] = Σ_k op(B)[k, n]
      args.bias_grad.copy_(at::sum(B, {args.trans_b ? 1 : 0}, /*keepdim=*/false, acc));
      return;
    case Epilogue::kReLU:
    case Epilogue::kGELUTanh:
    case Epilogue::kGELUTanhAux: {
      if (args.epilogue == Epilogue::kGELUTanhAux) args.aux.copy_(D);
      const Activation act = args.epilogue == Epilogue::kReLU ? Activation::kReLU : Activation::kGELUTanh;
      if (D.is_contiguous()) {
        cuda::activation_forward(D, D, act);
      } else {
        const at::Tensor Dc = D.contiguous();
        cuda::activation_forward(Dc, Dc, act);
        D.copy_(Dc);
      }
      return;
    }
  }
}

}  // namespace

}  // namespace gemm
}  // namespace opforge
