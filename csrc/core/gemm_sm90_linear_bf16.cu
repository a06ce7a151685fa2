// The sm90 kernel kLinearBF16 of core/gemm_sm90.h: D = A · Bᵀ + bias, bf16.
// One CUTLASS instantiation per file (core/gemm_sm90.cuh has the kernel and the reasons for its shape).
#include "core/gemm_sm90.cuh"

namespace opforge {
namespace gemm {
namespace sm90 {
namespace {
using G = detail::Sm90Gemm<cutlass::bfloat16_t, detail::BiasAdd<cutlass::bfloat16_t, cutlass::bfloat16_t>>;
}  // namespace

size_t workspace_linear_bf16(const Problem& p) { return detail::workspace<G>(p, detail::bias_args<cutlass::bfloat16_t>(p)); }

Status run_linear_bf16(const Problem& p, void* workspace, cudaStream_t stream) {
  return detail::launch<G>(p, detail::bias_args<cutlass::bfloat16_t>(p), workspace, stream);
}

}  // namespace sm90
}  // namespace gemm
}  // namespace opforge
