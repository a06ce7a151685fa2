// Shared helpers of the C++ tests: float64 comparison with a per-dtype tolerance, error matching, devices.
#pragma once

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <optional>
#include <string>
#include <utility>
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

// ---- float64 references (the one C++ copy; python/opforge/testing.py holds Python's) ---------------
namespace ref {

/// x · wᵀ + b in float64 (b optional).
inline at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b) {
  auto y = torch::matmul(x.to(at::kDouble), w.to(at::kDouble).t());
  return b ? y + b->to(at::kDouble) : y;
}

/// (y, dz) = (act(z), dy · act'(z)) in float64 through ATen's own activation functions, for linear's
/// activation names relu, gelu, gelu_tanh, silu.
inline std::pair<at::Tensor, at::Tensor> activation(const std::string& act, const at::Tensor& z, const at::Tensor& dy) {
  const auto z64 = z.to(at::kDouble), g64 = dy.to(at::kDouble);
  if (act == "relu") return {torch::relu(z64), at::threshold_backward(g64, z64, 0)};
  if (act == "silu") return {torch::silu(z64), at::silu_backward(g64, z64)};
  const char* approximate = act == "gelu" ? "none" : "tanh";
  return {at::gelu(z64, approximate), at::gelu_backward(g64, z64, approximate)};
}

/// x / sqrt(mean(x², last dim) + eps) · w in float64 (differentiable: keeps x's and w's graph).
inline at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  const auto x64 = x.to(at::kDouble);
  return x64 * torch::rsqrt(x64.pow(2).mean(-1, /*keepdim=*/true) + eps) * w.to(at::kDouble);
}

/// silu(gate) · up = gate · σ(gate) · up in float64 (differentiable).
inline at::Tensor swiglu(const at::Tensor& gate, const at::Tensor& up) {
  const auto g64 = gate.to(at::kDouble);
  return g64 * torch::sigmoid(g64) * up.to(at::kDouble);
}

/// σ(x) in float64 and its gradient dy · σ(x) · (1 − σ(x)).
inline at::Tensor sigmoid(const at::Tensor& x) { return torch::sigmoid(x.to(at::kDouble)); }
inline at::Tensor sigmoid_backward(const at::Tensor& dy, const at::Tensor& x) {
  const auto s = ref::sigmoid(x);
  return dy.to(at::kDouble) * s * (1 - s);
}

}  // namespace ref

}  // namespace opforge_test
