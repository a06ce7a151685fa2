// linear's GEMV path for float inputs (linear_gemv_launch.h: one translation unit per dtype, compiled in parallel).
#include "ops/linear/linear_gemv_impl.cuh"

namespace opforge {
namespace linear_op {

template void gemv_linear_typed<float>(const LinearProblem& p, at::Tensor& Y, at::Tensor* Z);

}  // namespace linear_op
}  // namespace opforge
