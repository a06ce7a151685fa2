// The dtype list every opforge kernel is instantiated for.
#pragma once

#include <ATen/Dispatch.h>

/// NAME must be a string literal (it becomes a compile-time constant).
/// Runs the lambda with `scalar_t` bound to one of float64, float32, float16, bfloat16.
/// Other dtypes never reach a kernel: each op's checker rejects them with a clear message first.
#define OPFORGE_DISPATCH_FLOATING(TYPE, NAME, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::Half, at::ScalarType::BFloat16, TYPE, NAME, __VA_ARGS__)

#include <ATen/core/dispatch/Dispatcher.h>

namespace opforge {

/// The typed dispatcher handle of the op `name` ("opforge::sigmoid"); `Sig` is its C++ signature.
/// Callers keep it in a function-local static: the lookup happens once.
template <typename Sig>
c10::TypedOperatorHandle<Sig> typed_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

}  // namespace opforge
