// C++ API tests of opforge::swiglu: forward against float64, gradients through libtorch's autograd, errors.
#include <opforge/opforge.h>

#include "test_util.h"

using namespace opforge_test;  // devices, float_dtypes, opts, expect_close, expect_error, leaf64, ref (test_util.h)

TEST(Swiglu, ForwardAndGradients) {
  for (auto device : devices()) {
    for (auto dtype : float_dtypes()) {
      const auto o = torch::TensorOptions().dtype(dtype).device(device);
      const auto gate = (torch::randn({7, 83}, o) * 3).requires_grad_(true);
      const auto up = torch::randn({7, 83}, o).requires_grad_(true);
      const auto g = torch::randn({7, 83}, o);
      const auto y = opforge::swiglu(gate, up);
      // silu(g) · u in float64, and its gradients
      const auto g64 = leaf64(gate);
      const auto u64 = leaf64(up);
      const auto ref = opforge_test::ref::swiglu(g64, u64);
      expect_close(y, ref, dtype, "swiglu");
      y.backward(g);
      ref.backward(g.to(at::kDouble));
      expect_close(gate.grad(), g64.grad(), dtype, "grad_gate");
      expect_close(up.grad(), u64.grad(), dtype, "grad_up");
    }
  }
}

TEST(Swiglu, BadInputsRaiseOpforgeErrors) {
  expect_error([] { opforge::swiglu(torch::randn({3, 4}), torch::randn({3, 5})); }, {"opforge::swiglu", "same shape"});
  expect_error([] { opforge::swiglu(torch::ones({3}, torch::kLong), torch::randn({3})); }, {"opforge::swiglu", "floating"});
}
