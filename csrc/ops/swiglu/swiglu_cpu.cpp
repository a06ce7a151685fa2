// CPU kernels of swiglu: at::vec::Vectorized bodies, scalar tails, at::parallel_for.
#include <torch/library.h>

#include "core/dispatch.h"
#include "core/vec.h"
#include "ops/swiglu/swiglu.h"

namespace opforge {
namespace {

using at::vec::Vectorized;

at::Tensor swiglu_cpu(const at::Tensor& gate, const at::Tensor& up) {
  auto [G, U] = check_swiglu("swiglu", gate, up);  // [n], [n]
  at::Tensor Y = at::empty_like(G);                          // [n]
  OPFORGE_DISPATCH_FLOATING(G.scalar_type(), "opforge::swiglu", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    using V = Vectorized<opmath_t>;
    // y = g / (1 + exp(-g)) · u
    cpu::map_binary(
        G.const_data_ptr<scalar_t>(), U.const_data_ptr<scalar_t>(), Y.mutable_data_ptr<scalar_t>(), G.numel(),
        [](opmath_t g, opmath_t u) { return g / (opmath_t(1) + std::exp(-g)) * u; },
        [](V g, V u) { return g / (V(1) + g.neg().exp()) * u; });
  });
  return Y;
}

std::tuple<at::Tensor, at::Tensor> swiglu_backward_cpu(const at::Tensor& grad_output, const at::Tensor& gate,
                                                       const at::Tensor& up) {
  auto [dY, G, U] = check_swiglu_backward(grad_output, gate, up);  // [n] each, gate's dtype
  at::Tensor dG = at::empty_like(G);
  at::Tensor dU = at::empty_like(G);
  OPFORGE_DISPATCH_FLOATING(G.scalar_type(), "opforge::swiglu_backward", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    using V = Vectorized<opmath_t>;
    // s = σ(g); dg = dy · u · s · (1 + g · (1 − s)); du = dy · g · s
    cpu::map3_to2(
        dY.const_data_ptr<scalar_t>(), G.const_data_ptr<scalar_t>(), U.const_data_ptr<scalar_t>(),
        dG.mutable_data_ptr<scalar_t>(), dU.mutable_data_ptr<scalar_t>(), G.numel(),
        [](opmath_t dy, opmath_t g, opmath_t u, opmath_t& dg, opmath_t& du) {
          const opmath_t s = opmath_t(1) / (opmath_t(1) + std::exp(-g));
          dg = dy * u * s * (opmath_t(1) + g * (opmath_t(1) - s));
          du = dy * g * s;
        },
        [](V dy, V g, V u, V& dg, V& du) {
          const V s = (V(1) + g.neg().exp()).reciprocal();
          dg = dy * u * s * (V(1) + g * (V(1) - s));
          du = dy * g * s;
        });
  });
  return {dG, dU.to(up.scalar_type())};
}

}  // namespace

TORCH_LIBRARY_IMPL(opforge, CPU, m) {
  m.impl("swiglu", &swiglu_cpu);
  m.impl("swiglu_backward", &swiglu_backward_cpu);
}

}  // namespace opforge
