// Shared helpers of the C++ tests: float64 comparison with a per-dtype tolerance, error matching, devices.
#pragma once

#include <gtest/gtest.h>
// the tensor API, autograd and the CUDA query only: <torch/torch.h> (nn, optim, data) costs each test file
// several seconds of compilation more
#include <torch/autograd.h>
#include <torch/cuda.h>
#include <torch/types.h>

#include <algorithm>
#include <functional>
#include <limits>
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

/// The tolerance class of a GEMM's result in `dtype` on `device`: float32 on CUDA may use TF32 where the caller
/// allowed it, so it is held to float16's tolerance there.
inline at::ScalarType gemm_tol(at::ScalarType dtype, const torch::Device& device) {
  return dtype == at::kFloat && device.is_cuda() ? at::kHalf : dtype;
}

/// A float64 leaf copy of `t` that requires grad: an input of a reference whose gradients come from autograd.
inline at::Tensor leaf64(const at::Tensor& t) { return t.detach().to(at::kDouble).requires_grad_(true); }

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

/// gelu(gate) · up in float64 (differentiable), gelu written out: the erf form, or the tanh approximation
/// gate/2 · (1 + tanh(√(2/π)(gate + 0.044715 · gate³))) when `tanh_form`.
inline at::Tensor geglu(const at::Tensor& gate, const at::Tensor& up, bool tanh_form) {
  const auto g = gate.to(at::kDouble);
  const auto gelu = tanh_form ? 0.5 * g * (1 + torch::tanh(0.79788456080286535588 * (g + 0.044715 * g * g * g)))
                              : 0.5 * g * (1 + torch::erf(g * 0.70710678118654752440));
  return gelu * up.to(at::kDouble);
}

/// σ(x) in float64 and its gradient dy · σ(x) · (1 − σ(x)).
inline at::Tensor sigmoid(const at::Tensor& x) { return torch::sigmoid(x.to(at::kDouble)); }
inline at::Tensor sigmoid_backward(const at::Tensor& dy, const at::Tensor& x) {
  const auto s = ref::sigmoid(x);
  return dy.to(at::kDouble) * s * (1 - s);
}

/// Rotary embedding of x (B, H, S, D) in float64 (differentiable in x): on the first R = cos.size(-1) dims
/// x·cos + rot(x)·sin with rot(x) = (−x[R/2:], x[:R/2]) (rotate-half) or, interleaved, rot(x)[2i] = −x[2i+1],
/// rot(x)[2i+1] = x[2i]; the dims past R unchanged. cos, sin: (S, R), (B or 1, S, R) or (B or 1, 1, S, R).
inline at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool interleaved) {
  auto c = cos.to(at::kDouble), s = sin.to(at::kDouble);
  if (c.dim() == 2) {  // (S, R) -> (1, S, R)
    c = c.unsqueeze(0);
    s = s.unsqueeze(0);
  }
  if (c.dim() == 3) {  // (B or 1, S, R) -> (B or 1, 1, S, R): broadcast over heads
    c = c.unsqueeze(1);
    s = s.unsqueeze(1);
  }
  const int64_t R = c.size(-1), D = x.size(-1);
  const auto x64 = x.to(at::kDouble);
  const auto xr = x64.narrow(-1, 0, R);
  const auto rot = interleaved ? torch::stack({-xr.slice(-1, 1, R, 2), xr.slice(-1, 0, R, 2)}, -1).flatten(-2)
                               : torch::cat({-xr.narrow(-1, R / 2, R / 2), xr.narrow(-1, 0, R / 2)}, -1);
  return torch::cat({xr * c + rot * s, x64.narrow(-1, R, D - R)}, -1);
}

/// (cos θ, sin θ) tables of shape (*positions.shape, R) in float64: θ_i = position · base^(−2i/R), i < R/2,
/// laid out [θ_0 … θ_{R/2−1}, θ_0 … θ_{R/2−1}] (rotate-half) or [θ_0, θ_0, θ_1, θ_1, …] (interleaved).
inline std::pair<at::Tensor, at::Tensor> rope_tables(const at::Tensor& positions, int64_t R, double base,
                                                     bool interleaved) {
  const auto i2 = torch::arange(0, R, 2, torch::TensorOptions().dtype(at::kDouble).device(positions.device()));
  const auto theta = positions.to(at::kDouble).unsqueeze(-1) * torch::pow(base, -i2 / R);  // (*, R/2)
  const auto full = interleaved ? theta.repeat_interleave(2, -1) : torch::cat({theta, theta}, -1);
  return {torch::cos(full), torch::sin(full)};
}

/// linear_cross_entropy in float64 from its formula (differentiable in input, linear_weight, linear_bias):
/// z = cap(input · linear_weightᵀ + linear_bias), cap(v) = softcap · tanh(v / softcap); per token, lse = log Σ_j e^z_j,
/// loss = (1 − ε) · w[t] · (lse − z_t) + ε / V · Σ_j w_j · (lse − z_j) + z_loss · lse² (0 where t = ignore_index;
/// w = class weights, ones when none); mean = Σ loss / Σ_valid w[t], sum = Σ loss, none = loss in target's shape.
inline at::Tensor linear_cross_entropy(const at::Tensor& input, const at::Tensor& linear_weight,
                                       const at::Tensor& target, const std::optional<at::Tensor>& linear_bias,
                                       const std::optional<at::Tensor>& weight, const std::string& reduction,
                                       int64_t ignore_index, double label_smoothing, double z_loss,
                                       std::optional<double> softcap) {
  const int64_t V = linear_weight.size(0);
  auto z = ref::linear(input, linear_weight, linear_bias).reshape({-1, V});
  if (softcap) z = *softcap * torch::tanh(z / *softcap);
  const auto t = target.reshape({-1});
  const auto w = weight ? weight->to(at::kDouble) : torch::ones({V}, z.options());
  const auto valid = (t != ignore_index).to(at::kDouble);
  const auto tc = t.clamp(0, V - 1);  // ignored tokens gather any class, then count 0
  const auto lse = torch::logsumexp(z, -1);
  const auto wt = w.index_select(0, tc);
  const auto nll = lse - z.gather(1, tc.unsqueeze(1)).squeeze(1);
  const auto smooth = ((lse.unsqueeze(1) - z) * w).sum(1) / V;
  const auto loss = ((1 - label_smoothing) * wt * nll + label_smoothing * smooth + z_loss * lse * lse) * valid;
  if (reduction == "none") return loss.reshape(target.sizes());
  if (reduction == "sum") return loss.sum();
  return loss.sum() / (wt * valid).sum();
}

/// A fake quantization in float64 from its formula, with the quantization parameters and integer codes it defines.
struct FakeQuantized {
  at::Tensor output;      // (R, K) float64: (clamp(q, qmin, qmax) − zero_point) · scale
  at::Tensor mask;        // (R, K) bool: qmin ≤ q ≤ qmax
  at::Tensor scale;       // float32, (1, 1) per tensor, (R, K / g) per group of g columns (g = K per row)
  at::Tensor zero_point;  // int32, scale's shape
};

/// Fake-quantizes x (R, K) to `bits`-bit signed integers [qmin, qmax] = [−2^(bits−1), 2^(bits−1) − 1] per tensor
/// (group_size 0), per row (−1) or per group of group_size columns: with the group's lo = min(min x, 0) and
/// hi = max(max x, 0) in float32, scale = max(max(−lo, hi) / ((qmax − qmin) / 2), eps) and zero_point 0
/// (symmetric), or scale = max((hi − lo) / (qmax − qmin), eps) and zero_point = clamp(qmin − round(lo / scale),
/// qmin, qmax); q = round(x · (1 / scale)) + zero_point, rounding half to even, the product in float32 (float64 for
/// float64 x). eps = float32's machine epsilon. The qparams and codes are these float32 operations, the output
/// their exact float64 value.
inline FakeQuantized fake_quantize(const at::Tensor& x, int64_t bits, int64_t group_size, bool symmetric) {
  const int64_t R = x.size(0), K = x.size(1), qmin = -(int64_t{1} << (bits - 1)), qmax = (int64_t{1} << (bits - 1)) - 1;
  const auto compute = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const auto groups = group_size == 0 ? x.reshape({1, -1}) : x.reshape({-1, group_size < 0 ? K : group_size});
  const auto f32 = [](const at::Tensor& t) { return t.to(at::kFloat); };
  const auto lo = torch::clamp_max(f32(groups.amin(1, /*keepdim=*/true)), 0);
  const auto hi = torch::clamp_min(f32(groups.amax(1, /*keepdim=*/true)), 0);
  const auto full = [&](double v) { return torch::full_like(lo, v); };  // tensor divisors: IEEE division everywhere
  const float eps = std::numeric_limits<float>::epsilon();
  at::Tensor scale, zp;
  if (symmetric) {
    scale = torch::clamp_min(torch::maximum(-lo, hi) / full((qmax - qmin) / 2.0), eps);
    zp = torch::zeros_like(scale);
  } else {
    scale = torch::clamp_min((hi - lo) / full(double(qmax - qmin)), eps);
    zp = torch::clamp(qmin - torch::round(lo / scale), qmin, qmax);
  }
  const auto inv_scale = full(1.0) / scale;
  const auto q = torch::round(groups.to(compute) * inv_scale.to(compute)) + zp.to(compute);
  const auto mask = (q >= qmin) & (q <= qmax);
  const auto out = (q.clamp(qmin, qmax) - zp.to(compute)).to(at::kDouble) * scale.to(at::kDouble);
  const int64_t qrows = group_size == 0 ? 1 : R, qcols = group_size == 0 ? 1 : groups.size(0) / std::max<int64_t>(R, 1);
  return {out.reshape({R, K}), mask.reshape({R, K}), scale.reshape({qrows, qcols}),
          zp.to(at::kInt).reshape({qrows, qcols})};
}

/// y[t] = input[t] · weight[index[t]]ᵀ + bias[index[t]] in float64, 0 where index[t] = −1 (differentiable).
/// input (T, K), weight (E, N, K), index (T,) int64 in [−1, E), bias (E, N) -> (T, N).
inline at::Tensor indexed_linear(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& index,
                                 const std::optional<at::Tensor>& bias) {
  const auto e = index.clamp_min(0);
  const auto w = weight.to(at::kDouble).index_select(0, e);  // (T, N, K)
  auto y = torch::matmul(w, input.to(at::kDouble).unsqueeze(-1)).squeeze(-1);
  if (bias) y = y + bias->to(at::kDouble).index_select(0, e);
  return y * (index != -1).to(at::kDouble).unsqueeze(-1);
}

}  // namespace ref

}  // namespace opforge_test
