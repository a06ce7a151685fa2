// Shared helpers of the C++ tests: float64 comparison with a per-dtype tolerance, error matching, devices.
#pragma once

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <string>
#include <vector>

namespace opforge_test {

inline std::vector<at::ScalarType> float_dtypes() {
  return {at::kDouble, at::kFloat, at::kHalf, at::kBFloat16};
}

/// Tensor options of one dtype on one device.
inline torch::TensorOptions opts(at::ScalarType dtype, torch::Device device) {
  return torch::TensorOptions().dtype(dtype).device(device);
}

inline std::vector<torch::Device> devices() {
  std::vector<torch::Device> out{torch::kCPU};
  if (torch::cuda::is_available()) out.emplace_back(torch::kCUDA, 0);
  return out;
}

/// Relative tolerance for a result rounded to `t` (a few units of t's epsilon).
inline double rtol(at::ScalarType t) {
  switch (t) {
    case at::kDouble: return 1e-12;
    case at::kFloat: return 1e-5;
    case at::kHalf: return 2e-3;
    case at::kBFloat16: return 1.6e-2;
    default: return 0;
  }
}

/// Expects `actual` (any dtype/device) to match the float64 `reference` within rtol(dtype of actual),
/// measured against the reference's largest magnitude (atol = rtol * max|reference|, at least rtol).
inline void expect_close(const at::Tensor& actual, const at::Tensor& reference, at::ScalarType dtype,
                         const std::string& what) {
  ASSERT_EQ(actual.sizes(), reference.sizes()) << what;
  if (actual.numel() == 0) return;
  const auto a = actual.detach().to(torch::kCPU, at::kDouble);
  const auto r = reference.detach().to(torch::kCPU, at::kDouble);
  const double scale = std::max(r.abs().max().item<double>(), 1.0);
  const double err = (a - r).abs().max().item<double>();
  EXPECT_LE(err, 4 * rtol(dtype) * scale) << what << " (dtype " << dtype << ")";
}

/// Expects `fn` to throw c10::Error whose message contains every string of `parts`.
inline void expect_error(const std::function<void()>& fn, const std::vector<std::string>& parts) {
  try {
    fn();
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    for (const auto& p : parts) EXPECT_NE(msg.find(p), std::string::npos) << "missing '" << p << "' in: " << msg;
    return;
  }
  ADD_FAILURE() << "expected c10::Error containing '" << (parts.empty() ? "" : parts[0]) << "'";
}

}  // namespace opforge_test
