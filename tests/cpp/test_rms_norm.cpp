// C++ API tests of opforge::rms_norm and opforge::fused_add_rms_norm: forward against float64,
// gradients through libtorch's autograd, errors.
#include <opforge/opforge.h>

#include "test_util.h"

using namespace opforge_test;  // devices, float_dtypes, opts, expect_close, expect_error, leaf64, ref (test_util.h)

TEST(RmsNorm, ForwardMatchesFloat64Reference) {
  for (auto device : devices()) {
    for (auto dtype : float_dtypes()) {
      const auto x = torch::randn({7, 769}, opts(dtype, device)) * 3;
      const auto r = torch::randn({7, 769}, opts(dtype, device));
      const auto w = torch::randn({769}, opts(dtype, device));
      expect_close(opforge::rms_norm(x, {769}, w, 1e-6), ref::rms_norm(x, w, 1e-6), dtype, "rms_norm");
      auto [y, z] = opforge::fused_add_rms_norm(x, r, {769}, w, 1e-6);
      expect_close(z, x.to(at::kDouble) + r.to(at::kDouble), dtype, "residual_out");
      expect_close(y, ref::rms_norm(z, w, 1e-6), dtype, "fused_add_rms_norm");
    }
  }
}

TEST(RmsNorm, GradientsThroughAutograd) {
  for (auto device : devices()) {
    const auto x = torch::randn({5, 83}, opts(at::kDouble, device)).requires_grad_(true);
    const auto w = torch::randn({83}, opts(at::kDouble, device)).requires_grad_(true);
    const auto g = torch::randn({5, 83}, opts(at::kDouble, device));
    opforge::rms_norm(x, {83}, w, 1e-5).backward(g);
    const auto x2 = leaf64(x);
    const auto w2 = leaf64(w);
    ref::rms_norm(x2, w2, 1e-5).backward(g);
    expect_close(x.grad(), x2.grad(), at::kDouble, "grad_input");
    expect_close(w.grad(), w2.grad(), at::kDouble, "grad_weight");
  }
}

TEST(RmsNorm, BadInputsRaiseOpforgeErrors) {
  const auto x = torch::randn({4, 8});
  expect_error([&] { opforge::rms_norm(x, {7}); }, {"opforge::rms_norm", "normalized_shape"});
  expect_error([&] { opforge::rms_norm(x, {8}, torch::randn({7})); }, {"opforge::rms_norm", "weight"});
  expect_error([&] { opforge::rms_norm(x.to(at::kInt), {8}); }, {"opforge::rms_norm", "floating"});
  expect_error([&] { opforge::fused_add_rms_norm(x, torch::randn({3, 8}), {8}); },
               {"opforge::fused_add_rms_norm", "residual"});
}
