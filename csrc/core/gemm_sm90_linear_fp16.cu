// The sm90 kernel kLinearFP16 of core/gemm_sm90.h: D = A · Bᵀ + bias, fp16.
// One CUTLASS instantiation per file (core/gemm_sm90.cuh has the kernel and the reasons for its shape).
#include "core/gemm_sm90.cuh"

namespace opforge {
namespace gemm {
namespace sm90 {
namespace {
using G = detail::Sm90Gemm<cutlass::half_t, detail::BiasAdd<cutlass::half_t, cutlass::half_t>>;
}  // namespace

size_t workspace_linear_fp16(const Problem& p) { return detail::workspace<G>(p, detail::bias_args<cutlass::half_t>(p)); }

Status run_linear_fp16(const Problem& p, void* workspace, cudaStream_t stream) {
  return detail::launch<G>(p, detail::bias_args<cutlass::half_t>(p), workspace, stream);
}

}  // namespace sm90
}  // namespace gemm
}  // namespace opforge
