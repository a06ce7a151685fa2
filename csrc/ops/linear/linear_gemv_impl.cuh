// Definition of linear_op::gemv_linear_typed (linear_gemv_launch.h), included by the per-dtype translation units
// linear_gemv_fp32.cu, linear_gemv_fp16.cu and linear_gemv_bf16.cu, each instantiating it for one type.
#pragma once

#include "core/activation.h"
#include "core/activation_cuda.h"
#include "ops/linear/linear_gemv.cuh"
#include "ops/linear/linear_gemv_launch.h"

namespace opforge {
namespace linear_op {

template <typename scalar_t>
void gemv_linear_typed(const LinearProblem& p, at::Tensor& Y, at::Tensor* Z) {
  const scalar_t* b = p.b.defined() ? p.b.const_data_ptr<scalar_t>() : nullptr;
  scalar_t* z = Z != nullptr ? Z->mutable_data_ptr<scalar_t>() : nullptr;
  const scalar_t* x = p.X.const_data_ptr<scalar_t>();
  const scalar_t* w = p.W.const_data_ptr<scalar_t>();
  scalar_t* y = Y.mutable_data_ptr<scalar_t>();
  const int M = static_cast<int>(p.M);
  with_activation(p.act, [&](auto a) {
    cuda::launch_gemv<scalar_t>(x, w, b, y, z, M, p.K, p.N, act::Value<decltype(a)::value>{});
  });
}

}  // namespace linear_op
}  // namespace opforge
