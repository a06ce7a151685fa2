// CPU kernels of swiglu: at::vec::Vectorized bodies, scalar tails, at::parallel_for.
#include <torch/library.h>

#include "core/activation.h"
#include "core/dispatch.h"
#include "core/vec.h"
#include "ops/swiglu/swiglu.h"

namespace opforge {
namespace {

using at::vec::Vectorized;

at::Tensor swiglu_cpu(const at::Tensor& gate, const at::Tensor& up) {
  // The CPU kernels read contiguous copies: a row-strided loop would end each row in the scalar tail,
  // whose exp differs from Vectorized's in the last bits, so views would not match their copies bitwise.
  auto [Gs, Us] = check_swiglu("swiglu", gate, up);
  const at::Tensor G = Gs.contiguous(), U = Us.contiguous();  // [n], [n]
  at::Tensor Y = at::empty_like(G);                             // [n]
  OPFORGE_DISPATCH_FLOATING(G.scalar_type(), "opforge::swiglu", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    using V = Vectorized<opmath_t>;
    // y = silu(g) · u
    cpu::map_binary(
        G.const_data_ptr<scalar_t>(), U.const_data_ptr<scalar_t>(), Y.mutable_data_ptr<scalar_t>(), G.numel(),
        [](opmath_t g, opmath_t u) { return act::value<Activation::kSiLU>(g) * u; },
        [](V g, V u) { return cpu::vec_silu(g) * u; });
  });
  return Y;
}

std::tuple<at::Tensor, at::Tensor> swiglu_backward_cpu(const at::Tensor& grad_output, const at::Tensor& gate,
                                                       const at::Tensor& up) {
  auto [dYs, Gs, Us] = check_swiglu_backward(grad_output, gate, up);
  const at::Tensor dY = dYs.contiguous(), G = Gs.contiguous(), U = Us.contiguous();  // [n] each, gate's dtype
  at::Tensor dG = at::empty_like(G);
  at::Tensor dU = at::empty_like(G);
  OPFORGE_DISPATCH_FLOATING(G.scalar_type(), "opforge::swiglu_backward", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    using V = Vectorized<opmath_t>;
    // dg = (dy · u) · silu'(g) = dy · u · s · (1 + g · (1 − s)); du = dy · g · s, s = σ(g)
    cpu::map3_to2(
        dY.const_data_ptr<scalar_t>(), G.const_data_ptr<scalar_t>(), U.const_data_ptr<scalar_t>(),
        dG.mutable_data_ptr<scalar_t>(), dU.mutable_data_ptr<scalar_t>(), G.numel(),
        [](opmath_t dy, opmath_t g, opmath_t u, opmath_t& dg, opmath_t& du) {
          dg = act::backward<Activation::kSiLU>(dy * u, g);
          du = dy * g * act::sigmoid(g);
        },
        [](V dy, V g, V u, V& dg, V& du) {
          const V s = cpu::vec_sigmoid(g);
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
