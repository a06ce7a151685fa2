// CUDA helpers shared by every opforge kernel: 16-byte vector types, alignment tests, launch
// configuration. Row reductions (warp and block sums) are core/row_cuda.cuh's.
#pragma once

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>

namespace opforge {
namespace cuda {

/// N elements of T loaded or stored as one aligned access (N * sizeof(T) == 16 for a 16-byte access).
template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T val[N];
};

/// Elements of T per 16-byte access: 2 for float64, 4 for float32, 8 for float16/bfloat16.
template <typename T>
constexpr int vec_size() {
  return 16 / static_cast<int>(sizeof(T));
}

/// True when `p` may be read or written through a 16-byte vector access.
inline bool is_aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

/// t itself when its data is 16-byte aligned, else a fresh contiguous (hence aligned) copy: for the vendor calls
/// (cuBLASLt's bias epilogue, at::_grouped_mm) that reject an unaligned operand, which a valid view at an odd
/// storage offset is. The copy costs one pass over t, and only for such views.
inline at::Tensor aligned16_or_copy(const at::Tensor& t) {
  return is_aligned16(t.const_data_ptr()) ? t : t.clone(at::MemoryFormat::Contiguous);
}

/// Blocks for a grid-stride loop over `n` work items with `threads` per block: enough to fill the
/// device several times over, never more than the work needs.
inline int64_t grid_for(int64_t n, int threads) {
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t want = (n + threads - 1) / threads;
  return std::max<int64_t>(1, std::min<int64_t>(want, sms * 16));
}

}  // namespace cuda
}  // namespace opforge
