// Tests of the GEMM layer (csrc/core/gemm.h) against float64 ATen: every trans combination and dtype,
// bias and every epilogue, 16-bit products accumulated into an fp32 D over chunks (beta = 1), a column
// slice as D, batched GEMMs with a broadcast operand, empty problems, the cached plan, and the cuBLASLt and
// cublasGemmEx paths alike (the test hook linear_lt of core/knobs.h). CUDA only: skipped without a GPU.
#include <ATen/ATen.h>
#include <torch/cuda.h>

#include "core/gemm.h"
#include "core/knobs.h"
#include "test_util.h"

using opforge::gemm::Epilogue;
using opforge::gemm::GemmArgs;
using opforge_test::expect_close;
using opforge_test::opts;

namespace {

namespace knobs = opforge::knobs;

/// Runs `fn` once with cuBLASLt on and once with it off (cublasGemmEx and separate passes).
template <typename F>
void for_both_paths(F&& fn) {
  for (int64_t lt : {1, 0}) {
    const int64_t before = knobs::set(knobs::Knob::kLinearLt, lt);
    fn(lt ? "cuBLASLt" : "cublasGemmEx");
    knobs::set(knobs::Knob::kLinearLt, before);
  }
}

/// op(t) in float64.
at::Tensor op64(const at::Tensor& t, bool trans) {
  const auto t64 = t.to(at::kDouble);
  return trans ? t64.transpose(-1, -2) : t64;
}

/// The tolerance class of a product of K terms in `dtype` (fp32 may use TF32 where torch allows it).
at::ScalarType tol(at::ScalarType dtype) { return dtype == at::kFloat ? at::kHalf : dtype; }

const torch::Device kCuda(torch::kCUDA, 0);

}  // namespace

TEST(Gemm, EveryTransAndDtype) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  const int64_t m = 37, n = 72, k = 129;
  for (auto dtype : opforge_test::float_dtypes()) {
    for (bool ta : {false, true}) {
      for (bool tb : {false, true}) {
        const auto A = ta ? torch::randn({k, m}, opts(dtype, kCuda)) : torch::randn({m, k}, opts(dtype, kCuda));
        const auto B = tb ? torch::randn({n, k}, opts(dtype, kCuda)) : torch::randn({k, n}, opts(dtype, kCuda));
        const auto ref = at::matmul(op64(A, ta), op64(B, tb));
        for_both_paths([&](const std::string& path) {
          const auto D = torch::empty({m, n}, opts(dtype, kCuda));
          GemmArgs args;
          args.trans_a = ta;
          args.trans_b = tb;
          opforge::gemm::gemm(D, A, B, args);
          expect_close(D, ref, tol(dtype), path + " ta=" + std::to_string(ta) + " tb=" + std::to_string(tb));
        });
      }
    }
  }
}

TEST(Gemm, BiasAndActivationEpilogues) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  const int64_t m = 19, n = 64, k = 96;
  for (auto dtype : {at::kBFloat16, at::kHalf, at::kFloat}) {
    const auto X = torch::randn({m, k}, opts(dtype, kCuda));
    const auto W = torch::randn({n, k}, opts(dtype, kCuda)) / 8;
    const auto b = torch::randn({n}, opts(dtype, kCuda));
    const auto z64 = at::matmul(X.to(at::kDouble), W.to(at::kDouble).t()) + b.to(at::kDouble);
    for (auto e : {Epilogue::kNone, Epilogue::kReLU, Epilogue::kGELUTanh, Epilogue::kGELUTanhAux}) {
      const auto y64 = e == Epilogue::kNone ? z64 : e == Epilogue::kReLU ? at::relu(z64) : at::gelu(z64, "tanh");
      for_both_paths([&](const std::string& path) {
        const auto Y = torch::empty({m, n}, opts(dtype, kCuda));
        GemmArgs args;
        args.trans_b = true;
        args.epilogue = e;
        args.bias = b;
        if (e == Epilogue::kGELUTanhAux) args.aux = torch::empty({m, n}, opts(dtype, kCuda));
        opforge::gemm::gemm(Y, X, W, args);
        const std::string what = path + " epilogue " + std::to_string(static_cast<int>(e));
        expect_close(Y, y64, tol(dtype), what);
        if (e == Epilogue::kGELUTanhAux) expect_close(args.aux, z64, tol(dtype), what + " aux");
      });
    }
  }
}

TEST(Gemm, BiasGradientEpilogues) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  const int64_t M = 77, N = 40, K = 56;  // dW[N, K] = dZᵀ · X, db[N] = Σ_rows dZ
  for (auto dtype : {at::kBFloat16, at::kFloat, at::kDouble}) {
    const auto dZ = torch::randn({M, N}, opts(dtype, kCuda));
    const auto X = torch::randn({M, K}, opts(dtype, kCuda));
    for_both_paths([&](const std::string& path) {
      const auto dW = torch::empty({N, K}, opts(dtype, kCuda));
      GemmArgs args;
      args.trans_a = true;
      args.epilogue = Epilogue::kBiasGradA;
      args.bias_grad = torch::empty({N}, opts(dtype, kCuda));
      opforge::gemm::gemm(dW, dZ, X, args);
      expect_close(dW, at::matmul(dZ.to(at::kDouble).t(), X.to(at::kDouble)), tol(dtype), path + " dW");
      expect_close(args.bias_grad, dZ.to(at::kDouble).sum(0), dtype, path + " bias_grad of op(A)");
      // kBiasGradB: Σ_k op(B)[k, n], here the column sums of X
      const auto D2 = torch::empty({N, K}, opts(dtype, kCuda));
      GemmArgs args_b = args;
      args_b.epilogue = Epilogue::kBiasGradB;
      args_b.bias_grad = torch::empty({K}, opts(dtype, kCuda));
      opforge::gemm::gemm(D2, dZ, X, args_b);
      expect_close(args_b.bias_grad, X.to(at::kDouble).sum(0), dtype, path + " bias_grad of op(B)");
    });
  }
}

TEST(Gemm, SixteenBitChunksAccumulateIntoFp32ColumnSlice) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  // dW[:, 64:192] (fp32, row stride 256) += Σ_chunks dZ_cᵀ · X_c, bf16 operands, beta = 1
  const int64_t N = 48, K = 128, chunk = 33;
  for_both_paths([&](const std::string& path) {
    const auto big = torch::zeros({N, 256}, opts(at::kFloat, kCuda));
    const auto dW = big.narrow(1, 64, K);
    auto ref = torch::zeros({N, K}, opts(at::kDouble, kCuda));
    for (int c = 0; c < 3; ++c) {
      const auto dZ = torch::randn({chunk, N}, opts(at::kBFloat16, kCuda));
      const auto X = torch::randn({chunk, K}, opts(at::kBFloat16, kCuda));
      GemmArgs args;
      args.trans_a = true;
      args.beta = 1.0;
      opforge::gemm::gemm(dW, dZ, X, args);
      ref += at::matmul(dZ.to(at::kDouble).t(), X.to(at::kDouble));
    }
    expect_close(dW, ref, at::kFloat, path + " fp32 accumulation");
    EXPECT_EQ(big.narrow(1, 0, 64).abs().max().item<float>(), 0.f) << path << ": wrote left of the slice";
    EXPECT_EQ(big.narrow(1, 64 + K, 256 - 64 - K).abs().max().item<float>(), 0.f) << path << ": wrote right of it";
  });
}

TEST(Gemm, BatchedWithBroadcastOperand) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  for (auto dtype : {at::kBFloat16, at::kFloat, at::kDouble}) {
    const auto A = torch::randn({5, 21, 64}, opts(dtype, kCuda));
    const auto B = torch::randn({64, 40}, opts(dtype, kCuda)).unsqueeze(0).expand({5, 64, 40});  // batch stride 0
    const auto ref = at::matmul(A.to(at::kDouble), B.to(at::kDouble));
    for_both_paths([&](const std::string& path) {
      const auto D = torch::empty({5, 21, 40}, opts(dtype, kCuda));
      opforge::gemm::gemm(D, A, B);
      expect_close(D, ref, tol(dtype), path + " batched");
    });
  }
}

TEST(Gemm, EmptyProblemsAndRepeatedCalls) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  const auto b = torch::randn({8}, opts(at::kFloat, kCuda));
  // k == 0: D = bias (an empty sum)
  auto D = torch::full({3, 8}, 7.0, opts(at::kFloat, kCuda));
  GemmArgs args;
  args.bias = b;
  opforge::gemm::gemm(D, torch::empty({3, 0}, opts(at::kFloat, kCuda)), torch::empty({0, 8}, opts(at::kFloat, kCuda)),
                      args);
  expect_close(D, b.to(at::kDouble).expand({3, 8}), at::kFloat, "k == 0 gives the bias");
  // m == 0: nothing written, no error
  opforge::gemm::gemm(torch::empty({0, 8}, opts(at::kFloat, kCuda)), torch::empty({0, 4}, opts(at::kFloat, kCuda)),
                      torch::randn({4, 8}, opts(at::kFloat, kCuda)));
  // the same problem twice (the second from the cached plan) gives the same bits
  const auto A = torch::randn({64, 128}, opts(at::kBFloat16, kCuda));
  const auto B = torch::randn({128, 96}, opts(at::kBFloat16, kCuda));
  const auto D1 = torch::empty({64, 96}, opts(at::kBFloat16, kCuda));
  const auto D2 = torch::empty({64, 96}, opts(at::kBFloat16, kCuda));
  opforge::gemm::gemm(D1, A, B);
  opforge::gemm::gemm(D2, A, B);
  EXPECT_TRUE(torch::equal(D1, D2));
}

TEST(Gemm, BadOperandsRaise) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  const auto A = torch::randn({4, 8}, opts(at::kFloat, kCuda));
  const auto B = torch::randn({8, 5}, opts(at::kFloat, kCuda));
  opforge_test::expect_error([&] { opforge::gemm::gemm(torch::empty({4, 6}, opts(at::kFloat, kCuda)), A, B); },
                             {"opforge::gemm", "op(A) [m, k]"});
  opforge_test::expect_error(
      [&] { opforge::gemm::gemm(torch::empty({4, 5}, opts(at::kFloat, kCuda)), A, B.t().contiguous().t()); },
      {"opforge::gemm", "unit last stride"});
  opforge_test::expect_error(
      [&] { opforge::gemm::gemm(torch::empty({4, 5}, opts(at::kHalf, kCuda)), A, B); },
      {"opforge::gemm", "one dtype"});
}
