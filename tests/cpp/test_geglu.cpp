// C++ API tests of opforge::geglu and opforge::geglu_packed: forward against float64 for both forms of gelu,
// gradients through libtorch's autograd, the packed form equal to geglu on the halves, errors.
#include <opforge/opforge.h>

#include "test_util.h"

using namespace opforge_test;  // devices, float_dtypes, opts, expect_close, expect_error, leaf64, ref (test_util.h)

TEST(Geglu, ForwardAndGradients) {
  for (auto device : devices()) {
    for (auto dtype : float_dtypes()) {
      for (const char* approximate : {"none", "tanh"}) {
        const bool tanh_form = std::string(approximate) == "tanh";
        const auto o = torch::TensorOptions().dtype(dtype).device(device);
        const auto gate = (torch::randn({7, 83}, o) * 3).requires_grad_(true);
        const auto up = torch::randn({7, 83}, o).requires_grad_(true);
        const auto g = torch::randn({7, 83}, o);
        const auto y = opforge::geglu(gate, up, approximate);
        const auto g64 = leaf64(gate);
        const auto u64 = leaf64(up);
        const auto ref = ref::geglu(g64, u64, tanh_form);
        expect_close(y, ref, dtype, "geglu");
        y.backward(g);
        ref.backward(g.to(at::kDouble));
        expect_close(gate.grad(), g64.grad(), dtype, "grad_gate");
        expect_close(up.grad(), u64.grad(), dtype, "grad_up");
      }
    }
  }
}

TEST(Geglu, DefaultIsTheErfForm) {
  const auto gate = torch::linspace(-4, 4, 65, torch::kDouble);
  const auto up = torch::ones({65}, torch::kDouble);
  EXPECT_TRUE(torch::allclose(opforge::geglu(gate, up), ref::geglu(gate, up, false), 1e-14, 1e-14));
  EXPECT_FALSE(torch::allclose(opforge::geglu(gate, up, "tanh"), ref::geglu(gate, up, false), 1e-6, 1e-6));
}

TEST(Geglu, PackedEqualsGegluOnTheHalves) {
  for (auto device : devices()) {
    for (const char* approximate : {"none", "tanh"}) {
      const auto o = torch::TensorOptions().dtype(torch::kFloat).device(device);
      const auto x = (torch::randn({5, 2 * 83}, o) * 3).requires_grad_(true);
      const auto y = opforge::geglu_packed(x, approximate);
      const auto halves = opforge::geglu(x.narrow(-1, 0, 83), x.narrow(-1, 83, 83), approximate);
      EXPECT_TRUE(torch::equal(y, halves)) << approximate;
      const auto dy = torch::randn({5, 83}, o);
      y.backward(dy);
      const auto [dg, du] = opforge::geglu_backward(dy, x.narrow(-1, 0, 83).detach(), x.narrow(-1, 83, 83).detach(),
                                                    approximate);
      EXPECT_TRUE(torch::equal(x.grad(), torch::cat({dg, du}, -1))) << approximate;
      EXPECT_TRUE(torch::equal(opforge::geglu_packed_backward(dy, x.detach(), approximate), x.grad())) << approximate;
    }
  }
}

TEST(Geglu, BadInputsRaiseOpforgeErrors) {
  expect_error([] { opforge::geglu(torch::randn({3, 4}), torch::randn({3, 5})); }, {"opforge::geglu", "same shape"});
  expect_error([] { opforge::geglu(torch::ones({3}, torch::kLong), torch::randn({3})); }, {"opforge::geglu", "floating"});
  expect_error([] { opforge::geglu(torch::randn({3}), torch::randn({3}), "erf"); },
               {"opforge::geglu", "approximate", "\"erf\""});
  expect_error([] { opforge::geglu_packed(torch::randn({3, 5}), "tanh"); }, {"opforge::geglu_packed", "even"});
  expect_error([] { opforge::geglu_packed(torch::randn({3, 4}), "gelu_tanh"); },
               {"opforge::geglu_packed", "approximate"});
}
