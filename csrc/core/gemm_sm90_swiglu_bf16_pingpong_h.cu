// The sm90 kernel kSwiGLUBF16PingPongH of core/gemm_sm90.h: H = silu(z[:, 0::2]) · z[:, 1::2] with z = A · Bᵀ + bias
// never stored (the inference form: no backward reads z), bf16, ping-pong on 128 × 128 tiles, H through shared
// memory and a TMA store (core/gemm_sm90.cuh, SwiGLUTmaStore; the kernel is built without D).
#include "core/gemm_sm90.cuh"

namespace opforge {
namespace gemm {
namespace sm90 {
namespace {
using T = cutlass::bfloat16_t;
using Config = detail::PingPongSwiGLU;
using G = detail::Sm90Gemm<T, detail::SwiGLUTmaTree<T, Config::TileShape>, Config, void>;
static_assert(G::Epilogue::DispatchPolicy::StagesD == detail::kSwiGLUPingPongStages, "the H buffer's stages must be the epilogue's");
}  // namespace

size_t workspace_swiglu_bf16_pingpong_h(const Problem& p) {
  return detail::workspace<G>(p, detail::swiglu_tma_args<T, Config::TileShape>(p));
}

Status run_swiglu_bf16_pingpong_h(const Problem& p, void* workspace, cudaStream_t stream) {
  return detail::launch<G>(p, detail::swiglu_tma_args<T, Config::TileShape>(p), workspace, stream);
}

}  // namespace sm90
}  // namespace gemm
}  // namespace opforge
