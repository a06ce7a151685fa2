// amax = max |y| of a CPU kernel's output, folded in as the kernel writes y (the CPU side of the producers' *_amax
// ops; core/amax_cuda.cuh is the CUDA side and states the rule). Each task reduces the values it has just stored
// (still in cache) as the bit patterns of |float(y)| (|double(y)| for float64): unsigned order is numeric order for
// non-negative IEEE values and NaN patterns sort above inf's, so NaN wins, then inf. Tasks combine their maxima into
// one atomic word, so the result is independent of the thread count and of how rows are split.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/bit_cast.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "core/amax.h"

namespace opforge {
namespace cpu {

/// The amax of outputs of scalar_t: bits_t (uint32_t, uint64_t for double) and the dtype of the result.
template <typename scalar_t>
struct AmaxBits {
  static constexpr bool kDouble = std::is_same_v<scalar_t, double>;
  using acc_t = std::conditional_t<kDouble, double, float>;
  using bits_t = std::conditional_t<kDouble, uint64_t, uint32_t>;

  /// max over i < n of the bits of |acc_t(y[i])|, starting from m.
  static bits_t fold(const scalar_t* y, int64_t n, bits_t m = 0) {
    for (int64_t i = 0; i < n; ++i) {
      const bits_t b = c10::bit_cast<bits_t>(std::fabs(static_cast<acc_t>(y[i])));
      m = b > m ? b : m;
    }
    return m;
  }
};

/// One atomic amax word shared by the tasks of a parallel loop: combine(m) raises it to m; tensor() is the [1] amax
/// tensor (float32, float64 for double output) holding it.
template <typename scalar_t>
class AmaxWord {
 public:
  using bits_t = typename AmaxBits<scalar_t>::bits_t;
  void combine(bits_t m) {
    bits_t cur = word_.load(std::memory_order_relaxed);
    while (m > cur && !word_.compare_exchange_weak(cur, m, std::memory_order_relaxed)) {
    }
  }
  /// Writes the word into `out` ([1], amax's dtype, CPU).
  void store(at::Tensor& out) const {
    const bits_t b = word_.load(std::memory_order_relaxed);
    std::memcpy(out.mutable_data_ptr(), &b, sizeof(bits_t));
  }

 private:
  std::atomic<bits_t> word_{0};
};

/// The [1] amax tensor of an output of `dtype` on the CPU, zero (the value of an empty output).
inline at::Tensor zeroed_amax_tensor(const at::Tensor& like) {
  return empty_amax(like).zero_();
}

}  // namespace cpu
}  // namespace opforge
