// The sm90 kernel kLinearBF16PingPong of core/gemm_sm90.h: D = A · Bᵀ + bias, bf16, in the ping-pong schedule on
// 128 × 128 tiles (core/gemm_sm90.cuh, PingPong): measured against kLinearBF16's cooperative 128 × 256 tiles.
#include "core/gemm_sm90.cuh"

namespace opforge {
namespace gemm {
namespace sm90 {
namespace {
using Tile = detail::PingPong::TileShape;
using G = detail::Sm90Gemm<cutlass::bfloat16_t, detail::BiasAdd<cutlass::bfloat16_t, cutlass::bfloat16_t, Tile>,
                           detail::PingPong>;
}  // namespace

size_t workspace_linear_bf16_pingpong(const Problem& p) {
  return detail::workspace<G>(p, detail::bias_args<cutlass::bfloat16_t, Tile>(p));
}

Status run_linear_bf16_pingpong(const Problem& p, void* workspace, cudaStream_t stream) {
  return detail::launch<G>(p, detail::bias_args<cutlass::bfloat16_t, Tile>(p), workspace, stream);
}

}  // namespace sm90
}  // namespace gemm
}  // namespace opforge
