// CPU kernels of swiglu and swiglu_packed: at::vec::Vectorized bodies, scalar tails, at::parallel_for.
#include <torch/library.h>

#include "core/activation.h"
#include "core/dispatch.h"
#include "core/vec.h"
#include "ops/swiglu/swiglu.h"

namespace opforge {
namespace {

using at::vec::Vectorized;

// The CPU kernels read contiguous copies: a row-strided loop would end each row in the scalar tail,
// whose exp differs from Vectorized's in the last bits, so views would not match their copies bitwise.
// swiglu_packed runs the same two flat kernels on contiguous copies of its halves, so it equals swiglu on them
// bitwise.

// Y = silu(G) · U over n elements; G, U, Y contiguous [n], one dtype.
void swiglu_forward_flat(const at::Tensor& G, const at::Tensor& U, at::Tensor& Y) {
  OPFORGE_DISPATCH_FLOATING(G.scalar_type(), "opforge::swiglu", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    using V = Vectorized<opmath_t>;
    // y = silu(g) · u
    cpu::map_binary(
        G.const_data_ptr<scalar_t>(), U.const_data_ptr<scalar_t>(), Y.mutable_data_ptr<scalar_t>(), G.numel(),
        [](opmath_t g, opmath_t u) { return act::value<Activation::kSiLU>(g) * u; },
        [](V g, V u) { return cpu::vec_silu(g) * u; });
  });
}

// (dG, dU) of swiglu over n elements; dY, G, U, dG, dU contiguous [n], one dtype.
void swiglu_backward_flat(const at::Tensor& dY, const at::Tensor& G, const at::Tensor& U, at::Tensor& dG,
                          at::Tensor& dU) {
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
}

at::Tensor swiglu_cpu(const at::Tensor& gate, const at::Tensor& up) {
  auto [Gs, Us] = check_swiglu("swiglu", gate, up);
  const at::Tensor G = Gs.contiguous(), U = Us.contiguous();  // [n], [n]
  at::Tensor Y = at::empty(G.sizes(), G.options());             // [n], contiguous (a zero-size view keeps its strides through contiguous())
  swiglu_forward_flat(G, U, Y);
  return Y;
}

std::tuple<at::Tensor, at::Tensor> swiglu_backward_cpu(const at::Tensor& grad_output, const at::Tensor& gate,
                                                       const at::Tensor& up) {
  auto [dYs, Gs, Us] = check_swiglu_backward(grad_output, gate, up);
  const at::Tensor dY = dYs.contiguous(), G = Gs.contiguous(), U = Us.contiguous();  // [n] each, gate's dtype
  at::Tensor dG = at::empty(G.sizes(), G.options());  // contiguous, as Meta (not a zero-size view's strides)
  at::Tensor dU = at::empty(G.sizes(), G.options());
  swiglu_backward_flat(dY, G, U, dG, dU);
  return {dG, dU.to(up.scalar_type())};
}

// input (*, 2I) -> its halves (gate, up) as contiguous (*, I) copies
std::pair<at::Tensor, at::Tensor> packed_halves(const at::Tensor& input, int64_t I) {
  return {input.narrow(-1, 0, I).contiguous(), input.narrow(-1, I, I).contiguous()};
}

at::Tensor swiglu_packed_cpu(const at::Tensor& input) {
  const int64_t I = check_swiglu_packed("swiglu_packed", input).expect_int();
  const auto [G, U] = packed_halves(input, I);       // [*, I] each
  at::Tensor Y = at::empty(G.sizes(), G.options());  // [*, I], contiguous (G may keep a zero-size view's strides)
  swiglu_forward_flat(G, U, Y);
  return Y;
}

at::Tensor swiglu_packed_backward_cpu(const at::Tensor& grad_output, const at::Tensor& input) {
  auto [dYs, Is] = check_swiglu_packed_backward(grad_output, input);
  const int64_t I = Is.expect_int();
  const at::Tensor dY = dYs.contiguous();        // [*, I], input's dtype
  const auto [G, U] = packed_halves(input, I);   // [*, I] each
  at::Tensor dG = at::empty(G.sizes(), G.options());
  at::Tensor dU = at::empty(G.sizes(), G.options());
  swiglu_backward_flat(dY, G, U, dG, dU);
  return at::cat({dG, dU}, -1);  // [*, 2I], contiguous (the CUDA kernel writes both halves in place instead)
}

}  // namespace

TORCH_LIBRARY_IMPL(opforge, CPU, m) {
  m.impl("swiglu", &swiglu_cpu);
  m.impl("swiglu_backward", &swiglu_backward_cpu);
  m.impl("swiglu_packed", &swiglu_packed_cpu);
  m.impl("swiglu_packed_backward", &swiglu_packed_backward_cpu);
}

}  // namespace opforge
