// The row engine of opforge's CUDA reductions: kernels that map each row of an [M, N] problem to a group
// of threads (a warp for short rows, a block for long rows) and reduce over the row.
//
//   warp_sum(v)             the sum over the 32 lanes of a warp, in every lane (the one warp reduction of
//                           opforge: rms_norm's rows, the GEMV's outputs).
//   RowSum<T>               the sum over a row's threadIdx.x group (a warp or the block), one barrier per
//                           call, double-buffered shared memory.
//   choose_row_mapping(...) threads per row so that each thread keeps at most a few vectors of the row in
//                           registers between passes.
//   num_sms(), resident_blocks<kernel, kMaxThreads>(threads)
//                           grid sizing: SMs of the current device and blocks of `kernel` resident per SM
//                           (CUDA's occupancy calculator), cached per device, kernel and block size.
#pragma once

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAMacros.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace opforge {
namespace cuda {

/// The sum of v over the 32 lanes of the warp (all lanes active), returned in every lane.
template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

/// Sum of v over the threadIdx.x group of one row (the warp when blockDim.x == 32, else the block,
/// whose blockDim.y is then 1). Every thread of the group gets the sum. One barrier per call: the
/// 2 x 32 shared values are double-buffered by call parity, so a warp that runs ahead to the next row
/// writes the other half, and it cannot come back to this half before every warp has passed the next
/// call's barrier (by then all have read this one).
template <typename T>
struct RowSum {
  T (*smem)[32];  // [2][32] in shared memory
  int parity = 0;
  __device__ __forceinline__ T operator()(T v) {
    v = warp_sum(v);
    if (blockDim.x == 32) return v;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    T* buf = smem[parity];
    parity ^= 1;
    if (lane == 0) buf[warp] = v;
    __syncthreads();
    T total = T(0);
    for (int i = 0; i < nwarps; ++i) total += buf[i];
    return total;
  }
};

/// Threads per row (tpr, a multiple of 32) and whether the row fits in registers (cached).
struct RowMapping {
  int tpr;
  bool cached;
};

/// Threads per row for nvec vectors per row: enough that each thread owns at most max_vecs_per_thread
/// vectors, a multiple of 32, at most max_tpr; cached == false (tpr = max_tpr) when even max_tpr
/// threads cannot: the kernel then streams the row.
inline RowMapping choose_row_mapping(int64_t nvec, int max_vecs_per_thread, int max_tpr) {
  const int64_t want = (nvec + max_vecs_per_thread - 1) / max_vecs_per_thread;
  if (want > max_tpr) return {max_tpr, false};
  return {static_cast<int>(std::max<int64_t>(32, (want + 31) / 32 * 32)), true};
}

/// Streaming multiprocessors of the current device.
inline int64_t num_sms() { return at::cuda::getCurrentDeviceProperties()->multiProcessorCount; }

/// Blocks of `threads` threads (a multiple of 32, at most kMaxThreads) of `kernel` resident per SM of the
/// current device (CUDA occupancy calculator, no dynamic shared memory), cached per device, kernel and
/// block size: grid-stride grids sized with it fill the GPU exactly once.
template <auto kernel, int kMaxThreads>
int64_t resident_blocks(int threads) {
  static std::atomic<int> cache[C10_COMPILE_TIME_MAX_GPUS][kMaxThreads / 32 + 1];
  std::atomic<int>& slot = cache[c10::cuda::current_device()][threads / 32];
  int n = slot.load(std::memory_order_relaxed);
  if (n == 0) {
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, 0));
    n = std::max(n, 1);
    slot.store(n, std::memory_order_relaxed);
  }
  return n;
}

}  // namespace cuda
}  // namespace opforge
