// C++ API tests of opforge::linear and opforge::linear_backward.
#include <opforge/opforge.h>

#include "test_util.h"

using namespace opforge_test;  // devices, float_dtypes, opts, gemm_tol, expect_close, expect_error, ref (test_util.h)

TEST(Linear, ForwardMatchesFloat64Reference) {
  for (auto device : devices()) {
    for (auto dtype : float_dtypes()) {
      const auto x = torch::randn({7, 3, 83}, opts(dtype, device));
      const auto w = torch::randn({769, 83}, opts(dtype, device)) / 9;
      const auto b = torch::randn({769}, opts(dtype, device));
      const auto y = opforge::linear(x, w, b);
      EXPECT_EQ(y.sizes(), (std::vector<int64_t>{7, 3, 769}));
      EXPECT_EQ(y.scalar_type(), dtype);
      expect_close(y, ref::linear(x, w, b), gemm_tol(dtype, device), "linear");
      expect_close(opforge::linear(x, w), ref::linear(x, w, std::nullopt), gemm_tol(dtype, device),
                   "linear without bias");
    }
  }
}

TEST(Linear, TransposedViews) {
  for (auto device : devices()) {
    for (auto dtype : {at::kFloat, at::kBFloat16}) {
      const auto W = torch::randn({512, 256}, opts(dtype, device)).t();        // (256, 512), strides (1, 256)
      const auto x = torch::randn({7, 3, 512}, opts(dtype, device)).transpose(0, 1);  // (3, 7, 512)
      const auto y = opforge::linear(x, W);
      EXPECT_EQ(y.sizes(), (std::vector<int64_t>{3, 7, 256}));
      expect_close(y, torch::linear(x.contiguous(), W.contiguous()).to(at::kDouble),
                   dtype == at::kFloat ? at::kHalf : dtype, "linear of transposed views");
    }
  }
}

TEST(Linear, ZeroSize) {
  for (auto device : devices()) {
    const auto x = torch::randn({0, 2100}, opts(at::kFloat, device)).requires_grad_(true);
    const auto w = torch::randn({2100, 2100}, opts(at::kFloat, device)).requires_grad_(true);
    const auto b = torch::randn({2100}, opts(at::kFloat, device)).requires_grad_(true);
    const auto y = opforge::linear(x, w, b);
    EXPECT_EQ(y.sizes(), (std::vector<int64_t>{0, 2100}));
    y.sum().backward();
    EXPECT_TRUE(torch::equal(w.grad(), torch::zeros_like(w)));
    EXPECT_TRUE(torch::equal(b.grad(), torch::zeros_like(b)));

    // in_features = 0: the output is the bias broadcast.
    const auto x0 = torch::randn({5, 0}, opts(at::kFloat, device));
    const auto w0 = torch::randn({3, 0}, opts(at::kFloat, device));
    const auto b0 = torch::randn({3}, opts(at::kFloat, device));
    EXPECT_TRUE(torch::equal(opforge::linear(x0, w0, b0), b0.expand({5, 3})));
  }
}

TEST(Linear, BackwardEveryRequiresGradCombination) {
  for (auto device : devices()) {
    for (auto dtype : float_dtypes()) {
      for (int with_bias = 0; with_bias < 2; ++with_bias) {
        for (int mask = 0; mask < (with_bias ? 8 : 4); ++mask) {
          const bool rx = mask & 1, rw = mask & 2, rb = mask & 4;
          if (!rx && !rw && !rb) continue;
          const auto x = torch::randn({5, 4, 37}, opts(dtype, device)).requires_grad_(rx);
          const auto w = (torch::randn({11, 37}, opts(dtype, device)) / 6).requires_grad_(rw);
          const auto b = torch::randn({11}, opts(dtype, device)).requires_grad_(rb);
          const auto g = torch::randn({5, 4, 11}, opts(dtype, device));
          const auto y = with_bias ? opforge::linear(x, w, b) : opforge::linear(x, w);
          y.backward(g);
          const auto g64 = g.to(at::kDouble).reshape({-1, 11});
          const auto x64 = x.detach().to(at::kDouble).reshape({-1, 37});
          const auto tol = gemm_tol(dtype, device);
          EXPECT_EQ(x.grad().defined(), rx);
          EXPECT_EQ(w.grad().defined(), rw);
          EXPECT_EQ(b.grad().defined(), bool(with_bias && rb));
          if (rx) expect_close(x.grad(), torch::matmul(g64, w.detach().to(at::kDouble)).reshape({5, 4, 37}), tol, "dX");
          if (rw) expect_close(w.grad(), torch::matmul(g64.t(), x64), tol, "dW");
          if (with_bias && rb) expect_close(b.grad(), g64.sum(0), tol, "db");
        }
      }
    }
  }
}

TEST(Linear, MixedDtypeFollowsInput) {
  const auto x = torch::randn({6, 16}, at::kHalf).requires_grad_(true);
  const auto w = torch::randn({4, 16}, at::kFloat).requires_grad_(true);
  const auto b = torch::randn({4}, at::kFloat).requires_grad_(true);
  const auto y = opforge::linear(x, w, b);
  EXPECT_EQ(y.scalar_type(), at::kHalf);
  y.sum().backward();
  EXPECT_EQ(x.grad().scalar_type(), at::kHalf);
  EXPECT_EQ(w.grad().scalar_type(), at::kFloat);
  EXPECT_EQ(b.grad().scalar_type(), at::kFloat);
  expect_close(b.grad(), torch::full({4}, 6.0, at::kDouble), at::kHalf, "db");
}

TEST(Linear, BackwardOpHonoursTheMask) {
  const auto x = torch::randn({3, 5}), w = torch::randn({2, 5}), g = torch::randn({3, 2});
  auto [dx, dw, db] = opforge::linear_backward(g, x, w, {false, true, false});
  EXPECT_FALSE(dx.defined());
  EXPECT_FALSE(db.defined());
  expect_close(dw, torch::matmul(g.t().to(at::kDouble), x.to(at::kDouble)), at::kFloat, "dW");
}

TEST(Linear, BadInputsRaiseOpforgeErrors) {
  const auto x = torch::randn({4, 8});
  expect_error([&] { opforge::linear(x, torch::randn({8})); }, {"opforge::linear", "weight"});
  expect_error([&] { opforge::linear(x, torch::randn({3, 7})); }, {"opforge::linear", "expected"});
  expect_error([&] { opforge::linear(x, torch::randn({3, 8}), torch::randn({4})); }, {"opforge::linear", "bias"});
  expect_error([&] { opforge::linear(x.to(at::kInt), torch::randn({3, 8})); }, {"opforge::linear", "floating dtype"});
  expect_error([&] { opforge::linear(x, torch::randn({3, 8}, at::kComplexFloat)); }, {"opforge::linear", "floating dtype"});
  expect_error([&] { opforge::linear(torch::randn({}), torch::randn({3, 8})); }, {"opforge::linear"});
}

TEST(Linear, ActivationForwardAndBackward) {
  for (auto device : devices()) {
    for (auto dtype : float_dtypes()) {
      for (const char* act : {"relu", "gelu", "gelu_tanh", "silu"}) {
        const auto x = torch::randn({5, 4, 37}, opts(dtype, device)).requires_grad_(true);
        const auto w = (torch::randn({11, 37}, opts(dtype, device)) / 6).requires_grad_(true);
        const auto b = torch::randn({11}, opts(dtype, device)).requires_grad_(true);
        const auto g = torch::randn({5, 4, 11}, opts(dtype, device));
        const auto y = opforge::linear(x, w, b, act);
        EXPECT_EQ(y.scalar_type(), dtype);
        // float64 reference: z, y = act(z), dz = dy · act'(z) through ATen's own activation functions
        const auto z64 = ref::linear(x.detach(), w.detach(), b.detach()).reshape({-1, 11});
        const std::string a = act;
        const auto [y64, dz64] = ref::activation(a, z64, g.reshape({-1, 11}));
        const auto tol = gemm_tol(dtype, device);
        expect_close(y, y64.reshape({5, 4, 11}), tol, a + " output");
        y.backward(g);
        const auto x64 = x.detach().to(at::kDouble).reshape({-1, 37});
        expect_close(x.grad(), torch::matmul(dz64, w.detach().to(at::kDouble)).reshape({5, 4, 37}), tol, a + " dX");
        expect_close(w.grad(), torch::matmul(dz64.t(), x64), tol, a + " dW");
        expect_close(b.grad(), dz64.sum(0), tol, a + " db");
      }
    }
  }
  const auto x = torch::randn({4, 8}), w = torch::randn({3, 8});
  expect_error([&] { opforge::linear(x, w, std::nullopt, "tanh"); },
               {"opforge::linear: expected activation to be one of", "\"gelu_tanh\"", "but got \"tanh\""});
}
