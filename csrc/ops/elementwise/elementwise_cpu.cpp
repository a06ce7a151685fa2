// CPU kernels of the elementwise ops: the Vectorized maps of core/vec.h (partial-vector tails), at::parallel_for.
#include <torch/library.h>

#include "core/dispatch.h"
#include "core/vec.h"
#include "ops/elementwise/elementwise.h"

namespace opforge {
namespace {

using at::vec::Vectorized;

at::Tensor sigmoid_cpu(const at::Tensor& input) {
  const at::Tensor X = elementwise::check_unary("sigmoid", input);  // [n]
  at::Tensor Y = at::empty(X.sizes(), X.options());  // [n], contiguous as Meta (also for a zero-size view)
  OPFORGE_DISPATCH_FLOATING(X.scalar_type(), "opforge::sigmoid", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    // y = σ(x) (core/activation.h; its vectorized form in core/vec.h)
    cpu::map_unary(
        X.const_data_ptr<scalar_t>(), Y.mutable_data_ptr<scalar_t>(), X.numel(),
        [](Vectorized<opmath_t> x) { return cpu::vec_sigmoid(x); });
  });
  return Y;
}

at::Tensor sigmoid_backward_cpu(const at::Tensor& grad_output, const at::Tensor& output) {
  auto [dY, Y] = elementwise::check_unary_backward("sigmoid_backward", grad_output, output, "output");
  at::Tensor dX = at::empty(dY.sizes(), dY.options());
  OPFORGE_DISPATCH_FLOATING(dY.scalar_type(), "opforge::sigmoid_backward", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    // dx = dy · y · (1 − y)
    cpu::map_binary(
        dY.const_data_ptr<scalar_t>(), Y.const_data_ptr<scalar_t>(), dX.mutable_data_ptr<scalar_t>(), dY.numel(),
        [](Vectorized<opmath_t> dy, Vectorized<opmath_t> y) { return dy * y * (Vectorized<opmath_t>(1) - y); });
  });
  return dX;
}

at::Tensor square_cpu(const at::Tensor& input) {
  const at::Tensor X = elementwise::check_unary("square", input);
  at::Tensor Y = at::empty(X.sizes(), X.options());
  OPFORGE_DISPATCH_FLOATING(X.scalar_type(), "opforge::square", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    // y = x · x
    cpu::map_unary(
        X.const_data_ptr<scalar_t>(), Y.mutable_data_ptr<scalar_t>(), X.numel(),
        [](Vectorized<opmath_t> x) { return x * x; });
  });
  return Y;
}

at::Tensor square_backward_cpu(const at::Tensor& grad_output, const at::Tensor& input) {
  auto [dY, X] = elementwise::check_unary_backward("square_backward", grad_output, input, "input");
  at::Tensor dX = at::empty(dY.sizes(), dY.options());
  OPFORGE_DISPATCH_FLOATING(dY.scalar_type(), "opforge::square_backward", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    // dx = 2 · x · dy
    cpu::map_binary(
        dY.const_data_ptr<scalar_t>(), X.const_data_ptr<scalar_t>(), dX.mutable_data_ptr<scalar_t>(), dY.numel(),
        [](Vectorized<opmath_t> dy, Vectorized<opmath_t> x) { return Vectorized<opmath_t>(2) * x * dy; });
  });
  return dX;
}

at::Tensor square_add_cpu(const at::Tensor& input, const at::Tensor& other) {
  const auto p = elementwise::check_square_add(input, other);
  at::Tensor Y = at::empty(input.sizes(), p.X.options());
  const int64_t n = p.X.numel();
  if (n == 0) return Y;
  OPFORGE_DISPATCH_FLOATING(p.X.scalar_type(), "opforge::square_add", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    // y[i] = x[i]² + b[i mod period]
    auto vop = [](Vectorized<opmath_t> x, Vectorized<opmath_t> b) { return at::vec::fmadd(x, x, b); };
    const scalar_t* x = p.X.const_data_ptr<scalar_t>();
    const scalar_t* b = p.B.const_data_ptr<scalar_t>();
    scalar_t* y = Y.mutable_data_ptr<scalar_t>();
    if (p.period == n) {
      cpu::map_binary(x, b, y, n, vop);
    } else {
      const int64_t period = p.period;
      cpu::parallel_rows(n / period, period, [&](int64_t r, int64_t c0, int64_t c1) {
        cpu::map_binary_range(x + r * period, b, y + r * period, c0, c1, vop);
      });
    }
  });
  return Y;
}

}  // namespace

TORCH_LIBRARY_IMPL(opforge, CPU, m) {
  m.impl("sigmoid", &sigmoid_cpu);
  m.impl("sigmoid_backward", &sigmoid_backward_cpu);
  m.impl("square", &square_cpu);
  m.impl("square_backward", &square_backward_cpu);
  m.impl("square_add", &square_add_cpu);
}

}  // namespace opforge
