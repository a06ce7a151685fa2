// CUDA kernels of linear_cross_entropy: the chunked algorithm of linear_cross_entropy.h.
//
// Per chunk of c tokens: logits [c, V] = X_c · Wᵀ by cublasGemmEx with float32 output (inputs in their storage
// dtype, float32 accumulation; float64 throughout for float64), then one row kernel (one block per token row,
// 16-byte loads where the row allows, online max/sum in fp32) computing the loss and (m, r) in forward, or the
// logit gradient in backward: in place in the fp32 chunk, plus a copy in the storage dtype for the two gradient
// GEMMs (dX_c = dZ_c · W in the storage dtype, dW += dZ_cᵀ · X_c into a float32 accumulator with beta = 1).
// A target outside [0, V) that is not ignore_index is never read: its token gets a NaN loss and NaN gradients.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cublas_v2.h>
#include <torch/library.h>

#include <climits>

#include "core/check.h"
#include "core/cuda_utils.cuh"
#include "core/dispatch.h"
#include "ops/linear_cross_entropy/linear_cross_entropy.h"

namespace opforge {
namespace {

using lce::Problem;

// Bytes of logits (fp32 chunk plus its storage-dtype gradient copy) one chunk may hold on CUDA: at V = 128256,
// 256 MiB gives 320 rows for bf16 (rounded to 320), large enough for the logits GEMM to run near peak.
constexpr int64_t kCudaChunkBudget = int64_t{256} << 20;
constexpr int kThreads = 512;

// ---- cuBLAS ------------------------------------------------------------------------------------------

cudaDataType_t cuda_type(at::ScalarType t) {
  switch (t) {
    case at::kDouble: return CUDA_R_64F;
    case at::kFloat: return CUDA_R_32F;
    case at::kHalf: return CUDA_R_16F;
    case at::kBFloat16: return CUDA_R_16BF;
    default: TORCH_INTERNAL_ASSERT(false, "opforge::linear_cross_entropy: no cuBLAS type for ", t);
  }
  return CUDA_R_32F;
}

/// C[m, n] (+)= op(A)[m, k] · op(B)[k, n], row-major contiguous: A stored [m, k] ([k, m] when trans_a), B stored
/// [k, n] ([n, k] when trans_b). A and B share a dtype; C may be float32 with float16/bfloat16 A, B (fp32
/// accumulation always; TF32 for float32 only where torch allows it). Run as the column-major Cᵀ = op(B)ᵀ op(A)ᵀ.
void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const at::Tensor& A, const at::Tensor& B,
          const at::Tensor& C, bool accumulate) {
  if (m == 0 || n == 0) return;
  if (k == 0) {
    if (!accumulate) C.zero_();
    return;
  }
  TORCH_INTERNAL_ASSERT(m <= INT_MAX && n <= INT_MAX && k <= INT_MAX);
  const int M = static_cast<int>(m), N = static_cast<int>(n), K = static_cast<int>(k);
  const bool dbl = C.scalar_type() == at::kDouble;
  cublasComputeType_t compute = dbl ? CUBLAS_COMPUTE_64F : CUBLAS_COMPUTE_32F;
  if (A.scalar_type() == at::kFloat &&
      at::globalContext().float32Precision(at::Float32Backend::CUDA, at::Float32Op::MATMUL) ==
          at::Float32Precision::TF32) {
    compute = CUBLAS_COMPUTE_32F_FAST_TF32;
  }
  const double alpha_d = 1.0, beta_d = accumulate ? 1.0 : 0.0;
  const float alpha_f = 1.0f, beta_f = accumulate ? 1.0f : 0.0f;
  const void* alpha = dbl ? static_cast<const void*>(&alpha_d) : static_cast<const void*>(&alpha_f);
  const void* beta = dbl ? static_cast<const void*>(&beta_d) : static_cast<const void*>(&beta_f);
  cublasHandle_t handle = at::cuda::getCurrentCUDABlasHandle();
  TORCH_CUDABLAS_CHECK(cublasSetStream(handle, at::cuda::getCurrentCUDAStream()));
  TORCH_CUDABLAS_CHECK(cublasSetPointerMode(handle, CUBLAS_POINTER_MODE_HOST));
  const cudaDataType_t ab = cuda_type(A.scalar_type());
  TORCH_CUDABLAS_CHECK(cublasGemmEx(handle, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, trans_a ? CUBLAS_OP_T : CUBLAS_OP_N,
                                    N, M, K, alpha,                                  //
                                    B.const_data_ptr(), ab, trans_b ? K : N,         // op(B)ᵀ
                                    A.const_data_ptr(), ab, trans_a ? M : K, beta,   // op(A)ᵀ
                                    C.data_ptr(), cuda_type(C.scalar_type()), N,     // Cᵀ
                                    compute, CUBLAS_GEMM_DEFAULT));
}

// ---- the row kernels -------------------------------------------------------------------------------------

template <typename acc_t>
struct RowArgs {
  const acc_t* bias;  // [V] or nullptr
  const acc_t* cw;    // [V] class weights or nullptr
  const acc_t* wsum;  // [1] Σ cw (device), or nullptr: V
  int64_t V, ignore_index;
  acc_t eps, z_loss, cap;  // cap 0: none
};

template <typename acc_t>
__device__ __forceinline__ acc_t dev_exp(acc_t x) { return exp(x); }
template <>
__device__ __forceinline__ float dev_exp<float>(float x) { return expf(x); }

// (m, s) ⊕ (m2, s2): the running max and Σ exp(z − m) of two parts.
template <typename acc_t>
__device__ __forceinline__ void merge(acc_t& m, acc_t& s, acc_t m2, acc_t s2) {
  if (m2 > m) {
    s = (s == acc_t(0) ? acc_t(0) : s * dev_exp(m - m2)) + s2;
    m = m2;
  } else if (s2 != acc_t(0)) {
    s += s2 * dev_exp(m2 - m);
  }
}

// one element into the running (m, s); -inf adds nothing, NaN propagates
template <typename acc_t>
__device__ __forceinline__ void online(acc_t& m, acc_t& s, acc_t z) {
  if (z > m) {
    s = s * dev_exp(m - z) + acc_t(1);
    m = z;
  } else if (z != -INFINITY) {
    s += dev_exp(z - m);
  }
}

// Block-wide reduction of (m, s, a): merged (m, s) and Σ a; result in every thread.
template <typename acc_t>
__device__ void block_reduce(acc_t& m, acc_t& s, acc_t& a) {
  __shared__ acc_t sm[32], ss[32], sa[32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int o = 16; o > 0; o /= 2) {
    const acc_t m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, s, o);
    a += __shfl_xor_sync(0xffffffffu, a, o);
    merge(m, s, m2, s2);
  }
  if (lane == 0) { sm[warp] = m; ss[warp] = s; sa[warp] = a; }
  __syncthreads();
  const int warps = blockDim.x / 32;
  m = lane < warps ? sm[lane] : acc_t(-INFINITY);
  s = lane < warps ? ss[lane] : acc_t(0);
  a = lane < warps ? sa[lane] : acc_t(0);
  for (int o = 16; o > 0; o /= 2) {
    const acc_t m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, s, o);
    a += __shfl_xor_sync(0xffffffffu, a, o);
    merge(m, s, m2, s2);
  }
}

template <typename acc_t>
__device__ __forceinline__ acc_t capped(acc_t x, int64_t j, const RowArgs<acc_t>& q) {
  if (q.bias) x += q.bias[j];
  return q.cap > acc_t(0) ? q.cap * tanh(x / q.cap) : x;
}

// Forward, one block per token row of the chunk: z = cap(l + b) (written back in place when there is a bias or
// a softcap), m = max z, r = log Σ exp(z − m), and
//   loss = (1 − ε) w_t ((m − z_t) + r) + ε/V (W (m − z_0) − Σ_j w_j (z_j − z_0) + W r) + z_loss (m + r)².
// VEC: float32 rows read 4 at a time (V % 4 == 0 and 16-byte aligned bias / class weights).
template <typename acc_t, bool VEC>
__global__ void __launch_bounds__(kThreads) lce_forward_rows(acc_t* __restrict__ logits,   // [c, V]
                                                             const int64_t* __restrict__ T,  // [c]
                                                             RowArgs<acc_t> q, acc_t* __restrict__ loss,  // [c]
                                                             acc_t* __restrict__ stats) {                  // [c, 2]
  const int64_t row = blockIdx.x;
  const int64_t t = T[row];
  const int64_t V = q.V;
  if (t == q.ignore_index) {
    if (threadIdx.x == 0) { loss[row] = acc_t(0); stats[2 * row] = acc_t(0); stats[2 * row + 1] = acc_t(0); }
    return;
  }
  acc_t* z = logits + row * V;
  const bool write_back = q.bias != nullptr || q.cap > acc_t(0);
  const bool smooth = q.eps > acc_t(0);
  const acc_t z0 = capped(z[0], 0, q);
  __syncthreads();  // every thread has read z[0] before anyone overwrites it
  acc_t m = -INFINITY, s = 0, a = 0;
  if constexpr (VEC) {
    const int64_t n4 = V / 4;
    float4* z4 = reinterpret_cast<float4*>(z);
    for (int64_t k = threadIdx.x; k < n4; k += blockDim.x) {
      float4 v = z4[k];
      float e[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int64_t j = 4 * k + u;
        e[u] = capped(e[u], j, q);
        online(m, s, e[u]);
        if (smooth) a += (q.cw ? q.cw[j] : acc_t(1)) * (e[u] - z0);
      }
      if (write_back) z4[k] = make_float4(e[0], e[1], e[2], e[3]);
    }
  } else {
    for (int64_t j = threadIdx.x; j < V; j += blockDim.x) {
      const acc_t x = capped(z[j], j, q);
      online(m, s, x);
      if (smooth) a += (q.cw ? q.cw[j] : acc_t(1)) * (x - z0);
      if (write_back) z[j] = x;
    }
  }
  block_reduce(m, s, a);  // ends past a __syncthreads: the written-back row is visible to thread 0
  if (threadIdx.x != 0) return;
  const acc_t r = log(s);
  stats[2 * row] = m;
  stats[2 * row + 1] = r;
  if (t < 0 || t >= V) {  // never read: the token is flagged
    loss[row] = acc_t(NAN);
    return;
  }
  const acc_t zt = z[t];
  const acc_t wt = q.cw ? q.cw[t] : acc_t(1);
  acc_t l = (acc_t(1) - q.eps) * wt * ((m - zt) + r);
  if (smooth) {
    const acc_t W = q.wsum ? *q.wsum : static_cast<acc_t>(V);
    l += q.eps / static_cast<acc_t>(V) * (W * (m - z0) - a + W * r);
  }
  if (q.z_loss > acc_t(0)) l += q.z_loss * (m + r) * (m + r);
  loss[row] = l;
}

// Backward, one block per token row: from the raw logits l (in place) and the saved (m, r),
//   z = cap(l + b), p = exp((z − m) − r),
//   dz_j = g ((1 − ε) w_t (p_j − [j = t]) + ε/V (W p_j − w_j) + 2 z_loss (m + r) p_j),  dl_j = dz_j (1 − (z_j/cap)²),
// written as fp32 in place and, when out_lp is given, in the storage dtype too. Ignored rows: zeros.
template <typename acc_t, typename out_t, bool VEC>
__global__ void __launch_bounds__(kThreads) lce_backward_rows(acc_t* __restrict__ logits,       // [c, V]
                                                              out_t* __restrict__ out_lp,       // [c, V] or null
                                                              const int64_t* __restrict__ T,    // [c]
                                                              RowArgs<acc_t> q,
                                                              const acc_t* __restrict__ stats,  // [c, 2]
                                                              const acc_t* __restrict__ G,      // [c] or [1]
                                                              int64_t g_stride) {
  const int64_t row = blockIdx.x;
  const int64_t t = T[row];
  const int64_t V = q.V;
  acc_t* l = logits + row * V;
  out_t* o = out_lp ? out_lp + row * V : nullptr;
  if (t == q.ignore_index || t < 0 || t >= V) {
    const acc_t fill = t == q.ignore_index ? acc_t(0) : acc_t(NAN);
    for (int64_t j = threadIdx.x; j < V; j += blockDim.x) {
      l[j] = fill;
      if (o) o[j] = static_cast<out_t>(fill);
    }
    return;
  }
  const acc_t m = stats[2 * row], r = stats[2 * row + 1], g = G[g_stride * row];
  const acc_t wt = q.cw ? q.cw[t] : acc_t(1);
  const acc_t W = q.wsum ? *q.wsum : static_cast<acc_t>(V);
  const acc_t c1 = g * ((acc_t(1) - q.eps) * wt + q.eps / static_cast<acc_t>(V) * W + acc_t(2) * q.z_loss * (m + r));
  const acc_t c2 = g * q.eps / static_cast<acc_t>(V);
  const acc_t ct = g * (acc_t(1) - q.eps) * wt;
  auto grad = [&](acc_t x, int64_t j) {
    if (q.bias) x += q.bias[j];
    acc_t gz = acc_t(1);
    if (q.cap > acc_t(0)) {
      x = q.cap * tanh(x / q.cap);
      const acc_t u = x / q.cap;
      gz = acc_t(1) - u * u;
    }
    const acc_t p = dev_exp((x - m) - r);
    acc_t d = c1 * p - c2 * (q.cw ? q.cw[j] : acc_t(1));
    if (j == t) d -= ct;
    return d * gz;
  };
  if constexpr (VEC) {
    const int64_t n4 = V / 4;
    float4* l4 = reinterpret_cast<float4*>(l);
    for (int64_t k = threadIdx.x; k < n4; k += blockDim.x) {
      const float4 v = l4[k];
      const float4 d = make_float4(grad(v.x, 4 * k), grad(v.y, 4 * k + 1), grad(v.z, 4 * k + 2), grad(v.w, 4 * k + 3));
      l4[k] = d;
      if (o) {
        o[4 * k] = static_cast<out_t>(d.x);
        o[4 * k + 1] = static_cast<out_t>(d.y);
        o[4 * k + 2] = static_cast<out_t>(d.z);
        o[4 * k + 3] = static_cast<out_t>(d.w);
      }
    }
  } else {
    for (int64_t j = threadIdx.x; j < V; j += blockDim.x) {
      const acc_t d = grad(l[j], j);
      l[j] = d;
      if (o) o[j] = static_cast<out_t>(d);
    }
  }
}

template <typename acc_t>
RowArgs<acc_t> row_args(const Problem& p, const at::Tensor& wsum) {
  RowArgs<acc_t> q;
  q.bias = p.b.defined() ? p.b.const_data_ptr<acc_t>() : nullptr;
  q.cw = p.cw.defined() ? p.cw.const_data_ptr<acc_t>() : nullptr;
  q.wsum = wsum.defined() ? wsum.const_data_ptr<acc_t>() : nullptr;
  q.V = p.V;
  q.ignore_index = p.ignore_index;
  q.eps = static_cast<acc_t>(p.label_smoothing);
  q.z_loss = static_cast<acc_t>(p.z_loss);
  q.cap = static_cast<acc_t>(p.softcap);
  return q;
}

// float4 access is possible: float32 rows of a multiple of 4 with 16-byte aligned bias and class weights (the
// chunk buffer itself comes aligned from the allocator).
template <typename acc_t>
bool row_vec(const Problem& p) {
  if (!std::is_same_v<acc_t, float> || p.V % 4 != 0) return false;
  return (!p.b.defined() || cuda::is_aligned16(p.b.const_data_ptr())) &&
         (!p.cw.defined() || cuda::is_aligned16(p.cw.const_data_ptr()));
}

void check_cuda_dims(const Problem& p, int64_t chunk) {
  TORCH_CHECK(p.V <= INT_MAX && p.H <= INT_MAX && chunk <= INT_MAX, "opforge::linear_cross_entropy: expected V and H at "
              "most ", num_str(int64_t{INT_MAX}), " (cuBLAS takes int dimensions), but got V = ", num_str(p.V),
              ", H = ", num_str(p.H));
}

std::tuple<at::Tensor, at::Tensor> lce_forward_cuda(const at::Tensor& input, const at::Tensor& linear_weight,
                                                    const at::Tensor& target,
                                                    const std::optional<at::Tensor>& linear_bias,
                                                    const std::optional<at::Tensor>& weight,
                                                    c10::string_view reduction, int64_t ignore_index,
                                                    double label_smoothing, double z_loss,
                                                    std::optional<double> softcap, std::optional<int64_t> chunk_size) {
  const auto red = lce::check_args("linear_cross_entropy", input, linear_weight, target, linear_bias, weight,
                                   reduction, label_smoothing, z_loss, softcap, chunk_size);
  c10::cuda::CUDAGuard guard(input.device());
  const Problem p = lce::make_problem(input, linear_weight, target, linear_bias, weight, red, ignore_index,
                                      label_smoothing, z_loss, softcap);
  const auto acc = lce::acc_dtype(input.scalar_type());
  at::Tensor token_loss = at::empty({p.N}, p.X.options().dtype(acc));  // [N]
  at::Tensor stats = at::empty({p.N, 2}, p.X.options().dtype(acc));    // [N, 2]
  const int64_t chunk = lce::resolve_chunk(chunk_size, p.N, p.V, kCudaChunkBudget, at::elementSize(acc));
  check_cuda_dims(p, chunk);
  if (p.N > 0) {
    const at::Tensor wsum = p.cw.defined() && p.label_smoothing > 0 ? p.cw.sum().reshape({1}) : at::Tensor();
    at::Tensor logits = at::empty({std::min(chunk, p.N), p.V}, p.X.options().dtype(acc));  // [chunk, V]
    auto stream = at::cuda::getCurrentCUDAStream();
    AT_DISPATCH_FLOATING_TYPES(acc, "opforge::linear_cross_entropy", [&] {
      using acc_t = scalar_t;
      const auto q = row_args<acc_t>(p, wsum);
      const bool vec = row_vec<acc_t>(p);
      for (int64_t s0 = 0; s0 < p.N; s0 += chunk) {
        const int64_t c = std::min(chunk, p.N - s0);
        at::Tensor L = logits.narrow(0, 0, c);
        gemm(false, true, c, p.V, p.H, p.X.narrow(0, s0, c), p.W, L, false);  // [c, V] = X_c · Wᵀ
        const int64_t* T = p.T.const_data_ptr<int64_t>() + s0;
        acc_t* lp = token_loss.mutable_data_ptr<acc_t>() + s0;
        acc_t* sp = stats.mutable_data_ptr<acc_t>() + 2 * s0;
        if (vec) {
          lce_forward_rows<acc_t, true><<<c, kThreads, 0, stream>>>(L.mutable_data_ptr<acc_t>(), T, q, lp, sp);
        } else {
          lce_forward_rows<acc_t, false><<<c, kThreads, 0, stream>>>(L.mutable_data_ptr<acc_t>(), T, q, lp, sp);
        }
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }
    });
  }
  auto ss = target.sizes().vec();
  ss.push_back(2);
  return {lce::reduce_loss(p, token_loss, target), stats.view(ss)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> lce_backward_cuda(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target,
    const at::Tensor& stats, const std::optional<at::Tensor>& linear_bias, const std::optional<at::Tensor>& weight,
    c10::string_view reduction, int64_t ignore_index, double label_smoothing, double z_loss,
    std::optional<double> softcap, std::array<bool, 3> output_mask, std::optional<int64_t> chunk_size) {
  const auto red = lce::check_backward_args(grad_output, input, linear_weight, target, stats, linear_bias, weight,
                                            reduction, label_smoothing, z_loss, softcap, chunk_size);
  c10::cuda::CUDAGuard guard(input.device());
  const Problem p = lce::make_problem(input, linear_weight, target, linear_bias, weight, red, ignore_index,
                                      label_smoothing, z_loss, softcap);
  const bool has_bias = p.b.defined();
  const bool need_dx = output_mask[0], need_dw = output_mask[1], need_db = output_mask[2] && has_bias;
  const auto dtype = input.scalar_type();
  const auto acc = lce::acc_dtype(dtype);
  const bool low = dtype != acc;  // float16 / bfloat16: the gradient GEMMs read a storage-dtype copy of dZ
  at::Tensor dX = need_dx ? at::empty({p.N, p.H}, p.X.options()) : at::Tensor();  // [N, H]
  // dW: float32 accumulator [V, H] (the gradient buffer itself for float32/float64 weights)
  at::Tensor dW = need_dw ? at::zeros({p.V, p.H}, p.X.options().dtype(acc)) : at::Tensor();
  at::Tensor db = need_db ? at::zeros({p.V}, p.X.options().dtype(acc)) : at::Tensor();  // [V]
  const int64_t chunk = lce::resolve_chunk(chunk_size, p.N, p.V, kCudaChunkBudget,
                                           at::elementSize(acc) + (low ? at::elementSize(dtype) : 0));
  check_cuda_dims(p, chunk);
  if ((need_dx || need_dw || need_db) && p.N > 0) {
    int64_t g_stride = 0;
    const at::Tensor G = lce::grad_scale(p, grad_output, g_stride);  // [N] or [1]
    const at::Tensor S = stats.reshape({p.N, 2}).contiguous();
    const at::Tensor wsum = p.cw.defined() && p.label_smoothing > 0 ? p.cw.sum().reshape({1}) : at::Tensor();
    const int64_t rows = std::min(chunk, p.N);
    at::Tensor logits = at::empty({rows, p.V}, p.X.options().dtype(acc));        // [chunk, V] fp32
    at::Tensor dlow = low ? at::empty({rows, p.V}, p.X.options()) : at::Tensor();  // [chunk, V] storage dtype
    auto stream = at::cuda::getCurrentCUDAStream();
    OPFORGE_DISPATCH_FLOATING(dtype, "opforge::linear_cross_entropy_backward", [&] {
      using acc_t = at::opmath_type<scalar_t>;
      using out_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, scalar_t>;
      const auto q = row_args<acc_t>(p, wsum);
      const bool vec = row_vec<acc_t>(p);
      for (int64_t s0 = 0; s0 < p.N; s0 += chunk) {
        const int64_t c = std::min(chunk, p.N - s0);
        const at::Tensor Xc = p.X.narrow(0, s0, c);  // [c, H]
        at::Tensor L = logits.narrow(0, 0, c);       // [c, V]
        gemm(false, true, c, p.V, p.H, Xc, p.W, L, false);
        at::Tensor D = low ? dlow.narrow(0, 0, c) : L;  // dZ_c in the storage dtype
        out_t* op = low ? reinterpret_cast<out_t*>(D.mutable_data_ptr()) : nullptr;
        const int64_t* T = p.T.const_data_ptr<int64_t>() + s0;
        const acc_t* sp = S.const_data_ptr<acc_t>() + 2 * s0;
        const acc_t* gp = G.const_data_ptr<acc_t>() + g_stride * s0;
        if (vec) {
          lce_backward_rows<acc_t, out_t, true>
              <<<c, kThreads, 0, stream>>>(L.mutable_data_ptr<acc_t>(), op, T, q, sp, gp, g_stride);
        } else {
          lce_backward_rows<acc_t, out_t, false>
              <<<c, kThreads, 0, stream>>>(L.mutable_data_ptr<acc_t>(), op, T, q, sp, gp, g_stride);
        }
        C10_CUDA_KERNEL_LAUNCH_CHECK();
        if (need_dx) gemm(false, false, c, p.H, p.V, D, p.W, dX.narrow(0, s0, c), false);  // dX_c = dZ_c · W
        if (need_dw) gemm(true, false, p.V, p.H, c, D, Xc, dW, true);                     // dW += dZ_cᵀ · X_c
        if (need_db) db.add_(L.sum(0));                                                  // db += Σ_rows dZ_c
      }
    });
  }
  at::Tensor gi = need_dx ? dX.view(input.sizes()) : at::Tensor();
  at::Tensor gw = need_dw ? dW.to(linear_weight.scalar_type()) : at::Tensor();
  at::Tensor gb = need_db ? db.to(linear_bias->scalar_type()) : at::Tensor();
  return {gi, gw, gb};
}

}  // namespace

TORCH_LIBRARY_IMPL(opforge, CUDA, m) {
  m.impl("_linear_cross_entropy_forward", &lce_forward_cuda);
  m.impl("linear_cross_entropy_backward", &lce_backward_cuda);
}

}  // namespace opforge
