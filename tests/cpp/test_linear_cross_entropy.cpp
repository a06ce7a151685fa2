// C++ API tests of opforge::linear_cross_entropy: the loss and its gradients (both autograd paths: gradient in
// forward for "mean" / "sum", recompute for "none") against float64, errors.
#include <opforge/opforge.h>

#include "test_util.h"

using namespace opforge_test;  // devices, float_dtypes, opts, expect_close, expect_error, leaf64, ref (test_util.h)

namespace {

/// One configuration of the loss's options.
struct Options {
  std::string reduction;
  bool bias, class_weights;
  double label_smoothing, z_loss;
  std::optional<double> softcap;
};

// each option away from its default at least once, in every reduction
const std::vector<Options> kOptions = {
    {"mean", false, false, 0.0, 0.0, std::nullopt},
    {"mean", true, true, 0.1, 1e-3, 20.0},
    {"sum", true, false, 0.0, 1e-2, std::nullopt},
    {"none", false, true, 0.2, 0.0, 5.0},
};

constexpr int64_t kIgnore = -100;

}  // namespace

TEST(LinearCrossEntropy, LossAndGradientsMatchFloat64Reference) {
  for (auto device : devices()) {
    for (auto dtype : float_dtypes()) {
      for (const auto& o : kOptions) {
        // input (3, 7, H) as a transposed view of (7, 3, H); V and H odd; chunks of 8 rows over 21 tokens
        const int64_t H = 37, V = 101;
        const auto input = torch::randn({7, 3, H}, opts(dtype, device)).transpose(0, 1).requires_grad_(true);
        const auto lw = (torch::randn({V, H}, opts(dtype, device)) / 3).requires_grad_(true);
        const auto lb = torch::randn({V}, opts(dtype, device)).requires_grad_(true);
        const auto cw = torch::rand({V}, opts(dtype, device)) + 0.5;
        auto target = torch::randint(0, V, {3, 7}, opts(at::kLong, device));
        target.index_put_({0, 2}, kIgnore);
        target.index_put_({2, 5}, kIgnore);
        const auto bias = o.bias ? std::optional<at::Tensor>(lb) : std::nullopt;
        const auto weight = o.class_weights ? std::optional<at::Tensor>(cw) : std::nullopt;
        const std::string what = "reduction " + o.reduction + (o.bias ? ", bias" : "") +
                                 (o.class_weights ? ", class weights" : "") + (o.softcap ? ", softcap" : "");

        const auto loss = opforge::linear_cross_entropy(input, lw, target, bias, weight, o.reduction, kIgnore,
                                                        o.label_smoothing, o.z_loss, o.softcap, /*chunk_size=*/8);
        EXPECT_EQ(loss.scalar_type(), dtype == at::kDouble ? at::kDouble : at::kFloat) << what;
        const auto x64 = leaf64(input), w64 = leaf64(lw), b64 = leaf64(lb);
        const auto ref_loss =
            ref::linear_cross_entropy(x64, w64, target, o.bias ? std::optional<at::Tensor>(b64) : std::nullopt,
                                      weight, o.reduction, kIgnore, o.label_smoothing, o.z_loss, o.softcap);
        // the logits of 16-bit inputs are exact products accumulated in float32: the loss is float32-accurate
        expect_close(loss, ref_loss, gemm_tol(loss.scalar_type(), device), what + " loss");

        const auto g = o.reduction == "none" ? torch::randn(target.sizes(), opts(loss.scalar_type(), device))
                                             : torch::full({}, 0.75, opts(loss.scalar_type(), device));
        loss.backward(g);
        ref_loss.backward(g.to(at::kDouble));
        const auto tol = gemm_tol(dtype, device);
        expect_close(input.grad(), x64.grad(), tol, what + " grad_input");
        expect_close(lw.grad(), w64.grad(), tol, what + " grad_linear_weight");
        EXPECT_EQ(lb.grad().defined(), o.bias) << what;
        if (o.bias) expect_close(lb.grad(), b64.grad(), tol, what + " grad_linear_bias");
      }
    }
  }
}

TEST(LinearCrossEntropy, BadInputsRaiseOpforgeErrors) {
  const auto x = torch::randn({5, 8}), w = torch::randn({11, 8});
  expect_error([&] { opforge::linear_cross_entropy(x, w, torch::zeros({5}, at::kInt)); },
               {"opforge::linear_cross_entropy: expected target of dtype int64 (class indices), but got Int"});
  expect_error([&] { opforge::linear_cross_entropy(x, w, torch::zeros({5}, at::kLong), std::nullopt, std::nullopt, "avg"); },
               {"opforge::linear_cross_entropy: expected reduction to be one of \"none\", \"mean\", \"sum\", but got \"avg\""});
}
