// The sm90 kernel kSwiGLUBF16PingPong of core/gemm_sm90.h: D = z = A · Bᵀ + bias and H = silu(z[:, 0::2]) · z[:, 1::2],
// bf16, in the ping-pong schedule on 128 × 128 tiles, both outputs through shared memory and TMA stores
// (core/gemm_sm90.cuh, SwiGLUTmaStore and Note [SwiGLU through shared memory]).
#include "core/gemm_sm90.cuh"

namespace opforge {
namespace gemm {
namespace sm90 {
namespace {
using T = cutlass::bfloat16_t;
using Config = detail::PingPongSwiGLU;
using G = detail::Sm90Gemm<T, detail::SwiGLUTmaTree<T, Config::TileShape>, Config>;
static_assert(G::Epilogue::DispatchPolicy::StagesD == detail::kSwiGLUPingPongStages, "the H buffer's stages must be the epilogue's");
}  // namespace

size_t workspace_swiglu_bf16_pingpong(const Problem& p) {
  return detail::workspace<G>(p, detail::swiglu_tma_args<T, Config::TileShape>(p));
}

Status run_swiglu_bf16_pingpong(const Problem& p, void* workspace, cudaStream_t stream) {
  return detail::launch<G>(p, detail::swiglu_tma_args<T, Config::TileShape>(p), workspace, stream);
}

}  // namespace sm90
}  // namespace gemm
}  // namespace opforge
