// Per-call host time of opforge::linear against at::linear from C++ (docs/performance/overhead.md).
//
// On tiny CPU tensors (input 4x8, weight 8x8, bias 8) the GEMM costs next to nothing, so the time of a call is
// its overhead: the dispatcher (Autograd key, then CPU), the checks, the output allocation. Each variant runs
// `calls` calls in a timed loop; loops repeat `repeats` times round-robin over the variants (drift hits all
// alike) and the median per-call time is printed, with the ratio to the matching ATen call.
//
//   cpp_overhead [calls=20000] [repeats=25] [--csv]
//
// With --csv, prints `impl,pass,time_us,ratio` lines (benchmarks/bench_overhead.py --cpp reads them).
#include <opforge/opforge.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace {

/// Mean time of one fn() over `calls` back-to-back calls, in microseconds.
double per_call_us(const std::function<at::Tensor()>& fn, int calls) {
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < calls; ++i) {
    at::Tensor y = fn();
    (void)y;
  }
  const auto t1 = std::chrono::steady_clock::now();
  return std::chrono::duration<double, std::micro>(t1 - t0).count() / calls;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

}  // namespace

int main(int argc, char** argv) {
  int calls = 20000, repeats = 25;
  bool csv = false;
  std::vector<int> nums;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--csv") == 0) {
      csv = true;
    } else {
      nums.push_back(std::atoi(argv[i]));
    }
  }
  if (nums.size() > 0 && nums[0] > 0) calls = nums[0];
  if (nums.size() > 1 && nums[1] > 0) repeats = nums[1];
  at::set_num_threads(1);  // no thread-pool wake-ups: the GEMM of 4x8x8 is one task anyway

  for (const bool requires_grad : {false, true}) {
    const auto x = at::randn({4, 8}).set_requires_grad(requires_grad);
    const auto w = at::randn({8, 8}).set_requires_grad(requires_grad);
    const auto b = at::randn({8}).set_requires_grad(requires_grad);
    // (name, baseline name, fn)
    std::vector<std::tuple<std::string, std::string, std::function<at::Tensor()>>> variants = {
        {"at::linear", "at::linear", [&] { return at::linear(x, w, b); }},
        {"opforge::linear", "at::linear", [&] { return opforge::linear(x, w, b); }},
        {"at::gelu(at::linear)", "at::gelu(at::linear)", [&] { return at::gelu(at::linear(x, w, b)); }},
        {"opforge::linear gelu", "at::gelu(at::linear)", [&] { return opforge::linear(x, w, b, "gelu"); }},
    };
    std::vector<std::vector<double>> times(variants.size());
    for (auto& v : variants) per_call_us(std::get<2>(v), std::max(1, calls / 4));  // warm-up
    for (int r = 0; r < repeats; ++r) {
      for (size_t k = 0; k < variants.size(); ++k) times[k].push_back(per_call_us(std::get<2>(variants[k]), calls));
    }
    std::vector<double> med(variants.size());
    for (size_t k = 0; k < variants.size(); ++k) med[k] = median(times[k]);
    const char* mode = requires_grad ? "requires_grad" : "no_grad";
    if (!csv) std::printf("%-24s %-14s %10s %8s\n", "impl", "pass", "time_us", "ratio");
    for (size_t k = 0; k < variants.size(); ++k) {
      double base = med[k];
      for (size_t j = 0; j < variants.size(); ++j)
        if (std::get<0>(variants[j]) == std::get<1>(variants[k])) base = med[j];
      if (csv) {
        std::printf("%s,%s,%.4f,%.4f\n", std::get<0>(variants[k]).c_str(), mode, med[k], med[k] / base);
      } else {
        std::printf("%-24s %-14s %10.3f %8.3f\n", std::get<0>(variants[k]).c_str(), mode, med[k], med[k] / base);
      }
    }
  }
  return 0;
}
