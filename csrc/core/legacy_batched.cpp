#include "core/legacy_batched.h"

#include <ATen/ATen.h>
#include <ATen/LegacyBatchedTensorImpl.h>
#include <ATen/LegacyVmapTransforms.h>
#include <c10/util/irange.h>

#include <algorithm>
#include <vector>

namespace opforge {

namespace {

// `v` with f applied to every tensor it holds: a Tensor, or the elements of a Tensor[] or Tensor?[] (None kept).
template <typename F>
c10::IValue map_tensors(const c10::IValue& v, F&& f) {
  if (v.isTensor()) return f(v.toTensor());
  if (v.isTensorList()) {
    c10::List<at::Tensor> out;
    for (const auto& e : v.toListRef()) out.push_back(f(e.toTensor()));
    return out;
  }
  if (v.isOptionalTensorList()) {
    c10::List<std::optional<at::Tensor>> out;
    for (const auto& e : v.toListRef())
      out.push_back(e.isTensor() ? std::optional<at::Tensor>(f(e.toTensor())) : std::nullopt);
    return out;
  }
  return v;
}

// The samples' results of one Tensor return as a BatchedTensor: stacked along a new dim 0, that dim unflattened to
// the batch sizes, wrapped at `levels`. Undefined where the op left it undefined.
at::Tensor batch_results(const std::vector<at::Tensor>& per_sample, at::IntArrayRef batch_sizes, int64_t B,
                         const at::VmapPhysicalToLogicalMap& to_logical, const char* op) {
  const at::Tensor& first = per_sample.front();
  for (const auto& t : per_sample)
    TORCH_INTERNAL_ASSERT(t.defined() == first.defined(), "opforge::", op,
                          ": a return is defined for some samples and undefined for others");
  if (!first.defined()) return at::Tensor();
  std::vector<int64_t> shape(batch_sizes.begin(), batch_sizes.end());
  shape.insert(shape.end(), first.sizes().begin(), first.sizes().end());
  at::Tensor physical = B == 0 ? at::empty(shape, first.options()) : at::stack(per_sample).view(shape);
  return to_logical.apply(physical);
}

}  // namespace

void legacy_batched_loop_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet /*ks*/,
                                torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const std::string name = schema.name().substr(schema.name().find("::") + 2);
  const auto args = torch::jit::pop(*stack, schema.arguments().size());

  // The BatchedTensors among the arguments, in argument order, with their batch dims aligned at the front.
  std::vector<at::Tensor> batched;
  for (const auto& a : args)
    map_tensors(a, [&](const at::Tensor& t) {
      if (t.defined() && at::isBatchedTensor(t)) batched.push_back(t);
      return t;
    });
  TORCH_INTERNAL_ASSERT(!batched.empty(), "opforge::", name, ": Batched kernel called without a BatchedTensor");
  const auto views = at::MultiBatchVmapTransform::logicalToPhysical(at::TensorList(batched));
  const auto to_logical = views.front().getPhysicalToLogicalMap();
  const int64_t nb = views.front().numBatchDims();
  const at::IntArrayRef batch_sizes = views.front().tensor().sizes().slice(0, nb);
  int64_t B = 1;
  for (const int64_t s : batch_sizes) B *= s;

  // One call per sample (one on zeros for an empty batch), its returns kept.
  std::vector<torch::jit::Stack> results;
  results.reserve(std::max<int64_t>(B, 1));
  std::vector<int64_t> index(nb);
  for (int64_t b = 0; b < std::max<int64_t>(B, 1); ++b) {
    for (int64_t d = nb - 1, rest = b; d >= 0; --d) {  // b as a multi-index over the batch dims, row-major
      index[d] = B == 0 ? 0 : rest % batch_sizes[d];
      rest = B == 0 ? 0 : rest / batch_sizes[d];
    }
    size_t k = 0;  // the next BatchedTensor, in the order `batched` was collected
    torch::jit::Stack sample;
    sample.reserve(args.size());
    for (const auto& a : args)
      sample.push_back(map_tensors(a, [&](const at::Tensor& t) {
        if (!t.defined() || !at::isBatchedTensor(t)) return t;
        const at::Tensor& physical = views[k++].tensor();
        if (B == 0) return at::zeros(physical.sizes().slice(nb), physical.options());
        at::Tensor s = physical;
        for (const int64_t i : index) s = s.select(0, i);
        return s;
      }));
    op.callBoxed(sample);
    results.push_back(std::move(sample));
  }

  // Each return: the samples' results batched (a Tensor[] element by element).
  for (const auto r : c10::irange(schema.returns().size())) {
    const c10::IValue& first = results.front()[r];
    if (first.isNone() || first.isTensor()) {
      std::vector<at::Tensor> per;
      for (const auto& s : results) per.push_back(s[r].isNone() ? at::Tensor() : s[r].toTensor());
      torch::jit::push(*stack, batch_results(per, batch_sizes, B, to_logical, name.c_str()));
    } else if (first.isTensorList()) {
      const size_t n = first.toListRef().size();
      c10::List<at::Tensor> out;
      for (const auto i : c10::irange(n)) {
        std::vector<at::Tensor> per;
        for (const auto& s : results) {
          const auto list = s[r].toListRef();
          TORCH_INTERNAL_ASSERT(list.size() == n, "opforge::", name,
                                ": a Tensor[] return has a different length for different samples");
          per.push_back(list[i].toTensor());
        }
        out.push_back(batch_results(per, batch_sizes, B, to_logical, name.c_str()));
      }
      torch::jit::push(*stack, std::move(out));
    } else {
      TORCH_CHECK_NOT_IMPLEMENTED(false, "opforge::", name, ": the legacy batching loop (is_grads_batched) handles "
                                  "Tensor and Tensor[] returns, but return ", r, " is a ", first.tagKind());
    }
  }
}

}  // namespace opforge
