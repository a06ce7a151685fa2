// C++ API tests of the elementwise ops: opforge::sigmoid, opforge::square, opforge::square_add.
#include <opforge/opforge.h>

#include "test_util.h"

using namespace opforge_test;  // devices, float_dtypes, opts, expect_close, expect_error, ref (test_util.h)

TEST(Elementwise, ForwardMatchesFloat64Reference) {
  for (auto device : devices()) {
    for (auto dtype : float_dtypes()) {
      const auto x = torch::randn({83, 769}, opts(dtype, device)) * 4;
      const auto b = torch::randn({769}, opts(dtype, device));
      const auto x64 = x.to(at::kDouble), b64 = b.to(at::kDouble);
      expect_close(opforge::sigmoid(x), opforge_test::ref::sigmoid(x), dtype, "sigmoid");
      expect_close(opforge::square(x), x64 * x64, dtype, "square");
      expect_close(opforge::square_add(x, b), x64 * x64 + b64, dtype, "square_add");
      EXPECT_EQ(opforge::sigmoid(x).scalar_type(), dtype);
      EXPECT_EQ(opforge::square_add(x, b).device(), x.device());
    }
  }
}

TEST(Elementwise, NonContiguousAndZeroSize) {
  for (auto device : devices()) {
    const auto h = torch::randn({8, 2304}, opts(at::kHalf, device));
    const auto h0 = h.clone();
    for (const auto& view : {h.chunk(2, -1)[1], h.index({torch::indexing::Slice(), torch::indexing::Slice(0, torch::indexing::None, 2)}), h.t()}) {
      EXPECT_TRUE(torch::equal(opforge::sigmoid(view), opforge::sigmoid(view.contiguous())));
      const auto b = torch::randn({view.size(-1)}, opts(at::kHalf, device));
      EXPECT_TRUE(torch::equal(opforge::square_add(view, b), opforge::square_add(view.contiguous(), b)));
    }
    EXPECT_TRUE(torch::equal(h, h0)) << "input modified";
    const auto empty = torch::empty({0, 5}, opts(at::kFloat, device));
    EXPECT_EQ(opforge::sigmoid(empty).sizes(), empty.sizes());
    EXPECT_EQ(opforge::square_add(empty, torch::ones({5}, opts(at::kFloat, device))).sizes(), empty.sizes());
  }
}

TEST(Elementwise, SigmoidSaturatesWithoutNaN) {
  const auto x = torch::tensor({-1662.7f, 3212.5f, -89.f, 89.f, -7.85f, 7.33f, 0.f, -0.5f,
                                -std::numeric_limits<float>::infinity(), std::numeric_limits<float>::infinity()});
  const auto y = opforge::sigmoid(x);
  EXPECT_FALSE(y.isnan().any().item<bool>());
  EXPECT_EQ(y[0].item<float>(), 0.f);
  EXPECT_EQ(y[1].item<float>(), 1.f);
  EXPECT_EQ(y[8].item<float>(), 0.f);
  EXPECT_EQ(y[9].item<float>(), 1.f);
  const auto xh = torch::tensor({-7.8477f, 7.332f, -7.8008f, 6.6016f}).to(at::kHalf);
  EXPECT_TRUE(torch::equal(opforge::sigmoid(xh), torch::sigmoid(xh.to(at::kFloat)).to(at::kHalf)));
}

TEST(Elementwise, BackwardThroughAutograd) {
  for (auto device : devices()) {
    for (auto dtype : float_dtypes()) {
      const auto x = (torch::randn({7, 83}, opts(dtype, device)) * 3).requires_grad_(true);
      const auto b = torch::randn({83}, opts(dtype, device)).requires_grad_(true);
      const auto g = torch::randn({7, 83}, opts(dtype, device));
      const auto x64 = x.detach().to(at::kDouble), g64 = g.to(at::kDouble);

      opforge::sigmoid(x).backward(g);
      expect_close(x.grad(), opforge_test::ref::sigmoid_backward(g, x64), dtype, "sigmoid grad");
      x.mutable_grad() = at::Tensor();

      opforge::square(x).backward(g);
      expect_close(x.grad(), 2 * x64 * g64, dtype, "square grad");
      x.mutable_grad() = at::Tensor();

      opforge::square_add(x, b).backward(g);
      expect_close(x.grad(), 2 * x64 * g64, dtype, "square_add grad input");
      expect_close(b.grad(), g64.sum(0), dtype, "square_add grad other");
      EXPECT_EQ(b.grad().scalar_type(), dtype);
    }
  }
}

TEST(Elementwise, MixedDtypeOtherGetsGradInItsOwnDtype) {
  const auto x = torch::randn({5, 6}, at::kHalf).requires_grad_(true);
  const auto b = torch::randn({6}, at::kFloat).requires_grad_(true);
  const auto y = opforge::square_add(x, b);
  EXPECT_EQ(y.scalar_type(), at::kHalf);
  y.sum().backward();
  EXPECT_EQ(b.grad().scalar_type(), at::kFloat);
  expect_close(b.grad(), torch::full({6}, 5.0, at::kDouble), at::kHalf, "grad other");
}

TEST(Elementwise, BackwardOpsHonourTheMask) {
  const auto x = torch::randn({4, 3});
  const auto b = torch::randn({3});
  const auto g = torch::ones({4, 3});
  auto [gx, gb] = opforge::square_add_backward(g, x, b, {true, false});
  EXPECT_TRUE(gx.defined());
  EXPECT_FALSE(gb.defined());
  std::tie(gx, gb) = opforge::square_add_backward(g, x, b, {false, true});
  EXPECT_FALSE(gx.defined());
  expect_close(gb, torch::full({3}, 4.0, at::kDouble), at::kFloat, "grad other");
}

TEST(Elementwise, BadInputsRaiseOpforgeErrors) {
  expect_error([] { opforge::sigmoid(torch::arange(5)); }, {"opforge::sigmoid", "floating dtype"});
  expect_error([] { opforge::square(torch::ones({2}, at::kComplexFloat)); }, {"opforge::square", "floating dtype"});
  expect_error([] { opforge::square_add(torch::ones({2, 3}), torch::ones({4})); },
               {"opforge::square_add", "broadcastable"});
  expect_error([] { opforge::square_add(torch::ones({2, 3}), torch::ones({3}, at::kInt)); },
               {"opforge::square_add", "other"});
  expect_error([] { opforge::sigmoid_backward(torch::ones({2, 3}), torch::ones({3, 2})); },
               {"opforge::sigmoid_backward", "same shape"});
}
