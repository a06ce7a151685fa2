// C++ API tests of opforge::rope and opforge::rope_from_positions: forward against float64, gradients through
// libtorch's autograd, errors.
#include <opforge/opforge.h>

#include "test_util.h"

using namespace opforge_test;  // devices, float_dtypes, opts, expect_close, expect_error, leaf64, ref (test_util.h)

namespace {

// q (B, Hq, S, D) and k (B, Hk, S, D) with odd heads and seq, a partial rotary_dim R < D, as views of
// (B, S, H, D) tensors (the layout a projection produces): strides not those of a contiguous tensor.
constexpr int64_t B = 2, Hq = 3, Hk = 1, S = 7, D = 18, R = 10;

at::Tensor heads(int64_t H, at::ScalarType dtype, torch::Device device) {
  return torch::randn({B, S, H, D}, opts(dtype, device)).transpose(1, 2);
}

/// Expects (q_out, k_out), computed by opforge from the leaves q and k, to match ref::rope with the float64
/// tables (cos, sin), and the gradients of q and k for random output gradients to match the reference's
/// float64 autograd; each within q's dtype's tolerance.
void expect_matches_reference(const at::Tensor& q, const at::Tensor& k, const at::Tensor& q_out,
                              const at::Tensor& k_out, const at::Tensor& cos, const at::Tensor& sin, bool interleaved,
                              const std::string& what) {
  const auto dtype = q.scalar_type();
  const auto q64 = leaf64(q), k64 = leaf64(k);
  const auto q_ref = ref::rope(q64, cos, sin, interleaved), k_ref = ref::rope(k64, cos, sin, interleaved);
  expect_close(q_out, q_ref, dtype, what + " q_out");
  expect_close(k_out, k_ref, dtype, what + " k_out");

  const auto gq = torch::randn_like(q_out), gk = torch::randn_like(k_out);
  torch::autograd::backward({q_out, k_out}, {gq, gk});
  torch::autograd::backward({q_ref, k_ref}, {gq.to(at::kDouble), gk.to(at::kDouble)});
  expect_close(q.grad(), q64.grad(), dtype, what + " grad_q");
  expect_close(k.grad(), k64.grad(), dtype, what + " grad_k");
}

}  // namespace

TEST(Rope, ForwardAndGradientsMatchFloat64Reference) {
  for (auto device : devices()) {
    for (auto dtype : float_dtypes()) {
      for (bool interleaved : {false, true}) {
        const auto q = heads(Hq, dtype, device).requires_grad_(true);
        const auto k = heads(Hk, dtype, device).requires_grad_(true);
        // a per-batch table (B, S, R) from random positions, in float32 (used as float32 with 16-bit q)
        const auto pos = torch::randint(0, 4096, {B, S}, opts(at::kLong, device));
        auto [cos64, sin64] = ref::rope_tables(pos, R, 10000.0, interleaved);
        const auto cos = cos64.to(at::kFloat), sin = sin64.to(at::kFloat);
        const std::string what = std::string(interleaved ? "interleaved" : "rotate-half") + " rope";

        auto [q_out, k_out] = opforge::rope(q, k, cos, sin, interleaved);
        EXPECT_EQ(q_out.scalar_type(), dtype);
        EXPECT_EQ(q_out.strides(), q.strides()) << "q_out keeps q's layout";
        expect_matches_reference(q, k, q_out, k_out, cos, sin, interleaved, what);
      }
    }
  }
}

TEST(Rope, FromPositionsForwardAndGradientsMatchFloat64Reference) {
  for (auto device : devices()) {
    for (auto dtype : float_dtypes()) {
      for (bool interleaved : {false, true}) {
        const auto q = heads(Hq, dtype, device).requires_grad_(true);
        const auto k = heads(Hk, dtype, device).requires_grad_(true);
        const auto pos = torch::randint(0, 4096, {B, S}, opts(at::kInt, device));  // any integer dtype
        const double base = 500000.0;
        const std::string what = std::string(interleaved ? "interleaved" : "rotate-half") + " rope_from_positions";

        auto [q_out, k_out] = opforge::rope_from_positions(q, k, pos, base, interleaved, R);
        EXPECT_EQ(k_out.scalar_type(), dtype);
        // θ_i = position · base^(−2i/R) in float64, then the rotation of the table form
        auto [cos, sin] = ref::rope_tables(pos, R, base, interleaved);
        expect_matches_reference(q, k, q_out, k_out, cos, sin, interleaved, what);
      }
    }
  }
}

TEST(Rope, BadInputsRaiseOpforgeErrors) {
  const auto q = torch::randn({B, Hq, S, D}), k = torch::randn({B, Hk, S, D});
  const auto cos = torch::randn({S, R}), sin = torch::randn({S, R});
  expect_error([&] { opforge::rope(q[0], k, cos, sin); },
               {"opforge::rope: expected q of shape (batch, heads, seq, head_dim), but got shape [3, 7, 18]"});
  expect_error([&] { opforge::rope_from_positions(q, k, torch::zeros({S})); },
               {"opforge::rope_from_positions: expected position_ids of an integer dtype, but got Float"});
}
