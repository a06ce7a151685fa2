// C++ API tests of opforge::indexed_linear: forward against float64, gradients through libtorch's autograd
// (an expert without tokens and rows with index −1 included), errors.
#include <opforge/opforge.h>

#include "test_util.h"

using namespace opforge_test;  // devices, float_dtypes, opts, expect_close, expect_error, leaf64, ref (test_util.h)

TEST(IndexedLinear, ForwardAndGradientsMatchFloat64Reference) {
  for (auto device : devices()) {
    for (auto dtype : float_dtypes()) {
      for (bool with_bias : {false, true}) {
        // T = 29 tokens over E = 5 experts; expert 2 gets no token, some rows get −1 (no weight)
        const int64_t T = 29, K = 37, N = 19, E = 5;
        const auto choices = torch::tensor({-1, 0, 1, 3, 4}, opts(at::kLong, device));
        const auto index = choices.index_select(0, torch::randint(0, 5, {T}, opts(at::kLong, device)));
        const auto x = torch::randn({K, T}, opts(dtype, device)).t().requires_grad_(true);  // strides (1, T)
        const auto w = (torch::randn({E, N, K}, opts(dtype, device)) / 4).requires_grad_(true);
        const auto b = torch::randn({E, N}, opts(dtype, device)).requires_grad_(true);
        const std::string what = with_bias ? "indexed_linear with bias" : "indexed_linear";

        const auto y = opforge::indexed_linear(x, w, index, with_bias ? std::optional<at::Tensor>(b) : std::nullopt);
        EXPECT_EQ(y.sizes(), (std::vector<int64_t>{T, N}));
        EXPECT_EQ(y.scalar_type(), dtype);
        const auto x64 = leaf64(x), w64 = leaf64(w), b64 = leaf64(b);
        const auto y_ref =
            ref::indexed_linear(x64, w64, index, with_bias ? std::optional<at::Tensor>(b64) : std::nullopt);
        const auto tol = gemm_tol(dtype, device);
        expect_close(y, y_ref, tol, what);

        const auto g = torch::randn_like(y);
        y.backward(g);
        y_ref.backward(g.to(at::kDouble));
        expect_close(x.grad(), x64.grad(), tol, what + " grad_input");
        expect_close(w.grad(), w64.grad(), tol, what + " grad_weight");
        EXPECT_TRUE(torch::equal(w.grad()[2], torch::zeros_like(w[2]))) << what << ": an expert without tokens";
        EXPECT_EQ(b.grad().defined(), with_bias);
        if (with_bias) expect_close(b.grad(), b64.grad(), tol, what + " grad_bias");
      }
    }
  }
}

TEST(IndexedLinear, BadInputsRaiseOpforgeErrors) {
  const auto x = torch::randn({4, 8}), w = torch::randn({3, 5, 8});
  expect_error([&] { opforge::indexed_linear(x, w, torch::zeros({4}, at::kInt)); },
               {"opforge::indexed_linear: expected index to have dtype int64, but got Int"});
  expect_error([&] { opforge::indexed_linear(x, w, torch::tensor({0, 1, 3, -1}, at::kLong)); },
               {"opforge::indexed_linear: expected every index in [-1, 3)", "but got 3 at position 2"});
}
