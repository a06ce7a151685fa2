// C++ API tests of opforge::linear_cat: forward against float64 linear(cat(inputs, -1)), gradients through
// libtorch's autograd, errors.
#include <opforge/opforge.h>

#include "test_util.h"

using namespace opforge_test;  // devices, float_dtypes, opts, expect_close, expect_error, leaf64, ref (test_util.h)

TEST(LinearCat, ForwardAndGradientsMatchFloat64Reference) {
  for (auto device : devices()) {
    for (auto dtype : float_dtypes()) {
      for (bool with_bias : {false, true}) {
        // three pieces (3, 5, K_i), K = 13 + 0 + 24: a contiguous one, an empty one, and a column slice of a wider
        // tensor (row stride 40, not 24)
        const int64_t N = 29;
        const std::vector<at::Tensor> inputs = {
            torch::randn({3, 5, 13}, opts(dtype, device)).requires_grad_(true),
            torch::randn({3, 5, 0}, opts(dtype, device)).requires_grad_(true),
            torch::randn({3, 5, 40}, opts(dtype, device)).narrow(-1, 9, 24).detach().requires_grad_(true),
        };
        const auto w = (torch::randn({N, 37}, opts(dtype, device)) / 4).requires_grad_(true);
        const auto b = torch::randn({N}, opts(dtype, device)).requires_grad_(true);
        const std::string what = with_bias ? "linear_cat with bias" : "linear_cat";

        const auto y = opforge::linear_cat(inputs, w, with_bias ? std::optional<at::Tensor>(b) : std::nullopt);
        EXPECT_EQ(y.sizes(), (std::vector<int64_t>{3, 5, N}));
        EXPECT_EQ(y.scalar_type(), dtype);
        std::vector<at::Tensor> inputs64;
        for (const auto& x : inputs) inputs64.push_back(leaf64(x));
        const auto w64 = leaf64(w), b64 = leaf64(b);
        const auto y_ref =
            ref::linear(torch::cat(inputs64, -1), w64, with_bias ? std::optional<at::Tensor>(b64) : std::nullopt);
        const auto tol = gemm_tol(dtype, device);
        expect_close(y, y_ref, tol, what);

        const auto g = torch::randn_like(y);
        y.backward(g);
        y_ref.backward(g.to(at::kDouble));
        for (size_t i = 0; i < inputs.size(); ++i)
          expect_close(inputs[i].grad(), inputs64[i].grad(), tol, what + " grad_inputs[" + std::to_string(i) + "]");
        expect_close(w.grad(), w64.grad(), tol, what + " grad_weight");
        EXPECT_EQ(b.grad().defined(), with_bias);
        if (with_bias) expect_close(b.grad(), b64.grad(), tol, what + " grad_bias");
      }
    }
  }
}

TEST(LinearCat, BadInputsRaiseOpforgeErrors) {
  const auto w = torch::randn({4, 9});
  expect_error([&] { opforge::linear_cat({torch::randn({2, 5}), torch::randn({3, 4})}, w); },
               {"opforge::linear_cat: expected every input to have inputs[0]'s leading dims [2], but got inputs[1] of "
                "shape [3, 4]"});
  expect_error([&] { opforge::linear_cat({torch::randn({2, 5}), torch::randn({2, 3})}, w); },
               {"opforge::linear_cat: expected the inputs' last dims to sum to weight's in_features 9, but got 8"});
}
