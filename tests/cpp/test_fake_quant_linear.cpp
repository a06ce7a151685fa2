// C++ API tests of opforge::fake_quant_linear and opforge::fake_quantize_weight: the quantization grid, the
// output and the straight-through gradients against float64, errors.
#include <opforge/opforge.h>

#include "test_util.h"

using namespace opforge_test;  // devices, float_dtypes, opts, expect_close, expect_error, leaf64, ref (test_util.h)

namespace {

/// One quantization configuration.
struct Quant {
  int64_t bits, group_size;
  bool symmetric, act_quant;
};

// per channel, per tensor and per group of 7 columns (K = 35), symmetric and asymmetric, with and without act_quant
const std::vector<Quant> kQuants = {
    {4, -1, true, false},
    {8, 0, false, false},
    {3, 7, false, true},
    {2, -1, true, true},
};

std::string describe(const Quant& c) {
  return std::to_string(c.bits) + " bits, group_size " + std::to_string(c.group_size) +
         (c.symmetric ? ", symmetric" : ", asymmetric") + (c.act_quant ? ", act_quant" : "");
}

/// x_ste = fq + mask ⊙ (x − x.detach()): the value fq (float64), the gradient mask ⊙ grad (straight-through).
at::Tensor straight_through(const at::Tensor& x64, const at::Tensor& fq, const at::Tensor& mask) {
  return fq + mask.to(at::kDouble) * (x64 - x64.detach());
}

}  // namespace

TEST(FakeQuantLinear, FakeQuantizeWeightMatchesTheFormula) {
  for (auto device : devices()) {
    for (auto dtype : float_dtypes()) {
      for (const auto& c : kQuants) {
        const auto w = torch::randn({19, 35}, opts(dtype, device));
        auto [out, mask, scale, zero_point] = opforge::fake_quantize_weight(w, c.bits, c.group_size, c.symmetric);
        const auto expected = ref::fake_quantize(w, c.bits, c.group_size, c.symmetric);
        const std::string what = describe(c);
        EXPECT_EQ(out.scalar_type(), dtype) << what;
        EXPECT_TRUE(torch::equal(scale, expected.scale)) << what << ": scale";
        EXPECT_TRUE(torch::equal(zero_point, expected.zero_point)) << what << ": zero_point";
        EXPECT_TRUE(torch::equal(mask, expected.mask)) << what << ": mask";
        expect_close(out, expected.output, dtype, what + " output");
      }
    }
  }
}

TEST(FakeQuantLinear, ForwardAndStraightThroughGradientsMatchFloat64Reference) {
  for (auto device : devices()) {
    for (auto dtype : float_dtypes()) {
      for (const auto& c : kQuants) {
        // input (3, 5, K) as a transposed view, weight (N, K) as the transpose of a (K, N) tensor
        const int64_t K = 35, N = 19;
        const auto x = (torch::randn({5, 3, K}, opts(dtype, device)) * 2).transpose(0, 1).requires_grad_(true);
        const auto w = torch::randn({K, N}, opts(dtype, device)).t().requires_grad_(true);
        const auto b = torch::randn({N}, opts(dtype, device)).requires_grad_(true);
        const std::string what = describe(c);

        const auto y = opforge::fake_quant_linear(x, w, b, c.bits, c.group_size, c.symmetric, c.act_quant);
        EXPECT_EQ(y.sizes(), (std::vector<int64_t>{3, 5, N})) << what;
        EXPECT_EQ(y.scalar_type(), dtype) << what;
        // fq_w (in weight's dtype, as the GEMM sees it), fq_a per token (int8, asymmetric), then a float64 linear
        const auto wq = ref::fake_quantize(w.detach(), c.bits, c.group_size, c.symmetric);
        const auto x64 = leaf64(x), w64 = leaf64(w), b64 = leaf64(b);
        const auto w_ste = straight_through(w64, wq.output.to(dtype).to(at::kDouble), wq.mask);
        at::Tensor x_ste = x64;
        if (c.act_quant) {
          const auto xq = ref::fake_quantize(x.detach().reshape({-1, K}), 8, -1, false);
          x_ste = straight_through(x64, xq.output.to(dtype).to(at::kDouble).view(x.sizes()), xq.mask.view(x.sizes()));
        }
        const auto y_ref = ref::linear(x_ste, w_ste, b64);
        const auto tol = gemm_tol(dtype, device);
        expect_close(y, y_ref, tol, what + " output");

        const auto g = torch::randn_like(y);
        y.backward(g);
        y_ref.backward(g.to(at::kDouble));
        expect_close(x.grad(), x64.grad(), tol, what + " grad_input");
        expect_close(w.grad(), w64.grad(), tol, what + " grad_weight");
        expect_close(b.grad(), b64.grad(), tol, what + " grad_bias");
      }
    }
  }
}

TEST(FakeQuantLinear, BadInputsRaiseOpforgeErrors) {
  const auto x = torch::randn({4, 12}), w = torch::randn({3, 12});
  expect_error([&] { opforge::fake_quant_linear(x, w, std::nullopt, /*weight_bits=*/9); },
               {"opforge::fake_quant_linear: expected weight_bits in [2, 8], but got 9"});
  expect_error([&] { opforge::fake_quantize_weight(w, 4, /*group_size=*/5); },
               {"opforge::fake_quantize_weight: expected group_size to divide in_features 12", "but got 5"});
}
