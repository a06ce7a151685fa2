// The knobs of core/knobs.h and the private op that sets them.
#include "core/knobs.h"

#include <c10/util/Exception.h>
#include <torch/library.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>

namespace opforge {
namespace knobs {
namespace {

// How a user-facing mode's environment variable is read.
enum class Read {
  kUnlessZero,  // "0": 0, any other text: 1
  kInteger,     // an integer; anything else: the default
  kPositive,    // empty: the default; a positive integer; anything else: an error at get()
  kNone,        // a test hook: no environment variable
};

struct Entry {
  const char* name;  // _set_knob's name: the environment variable of a user-facing mode, the hook's name otherwise
  int64_t unset;     // the value when the variable is not set (a hook's default)
  Read read;
  const char* op;    // the op that reads it (its name starts a kPositive variable's error)
};
// In the order of Knob.
constexpr Entry kEntries[] = {
    {"OPFORGE_LCE_GRAD_IN_FORWARD", 1, Read::kUnlessZero, "linear_cross_entropy"},
    {"OPFORGE_LCE_DW_ACCUM", 0, Read::kInteger, "linear_cross_entropy"},
    {"OPFORGE_LCE_CHUNK_SIZE", 0, Read::kPositive, "linear_cross_entropy"},
    {"OPFORGE_LCE_LEAN", 1, Read::kUnlessZero, "linear_cross_entropy"},
    {"OPFORGE_FP8_FAST_ACCUM", 0, Read::kInteger, "fp8_linear"},
    {"linear_lt", 1, Read::kNone, "linear"},
    {"gemm_sm90", -1, Read::kNone, "linear"},
    {"linear_gemv", -1, Read::kNone, "linear"},
    {"rms_norm_forward", -1, Read::kNone, "rms_norm"},
    {"rms_norm_backward", -1, Read::kNone, "rms_norm_backward"},
    {"rope_rows_kernel", 0, Read::kNone, "rope"},
    {"indexed_linear_path", 0, Read::kNone, "indexed_linear"},
    {"fp8_gemm", -1, Read::kNone, "fp8_linear"},
    {"fp8_transpose", -1, Read::kNone, "fp8_linear"},
};
constexpr int kCount = sizeof(kEntries) / sizeof(kEntries[0]);
static_assert(kCount == static_cast<int>(Knob::kFp8Transpose) + 1, "one entry per Knob");

// The value of a kPositive variable whose text is not a positive integer (get() raises the error).
constexpr int64_t kInvalid = std::numeric_limits<int64_t>::min();

// Every knob's value, each environment variable read once, when the first knob is used.
struct State {
  std::atomic<int64_t> value[kCount];
  std::string text[kCount];  // the variable's text, kept for the error of a kInvalid value

  State() {
    for (int i = 0; i < kCount; ++i) value[i].store(from_env(i), std::memory_order_relaxed);
  }

  int64_t from_env(int i) {
    const Entry& e = kEntries[i];
    const char* env = e.read == Read::kNone ? nullptr : std::getenv(e.name);
    if (env == nullptr) return e.unset;
    text[i] = env;
    if (e.read == Read::kUnlessZero) return std::strcmp(env, "0") == 0 ? 0 : 1;
    if (e.read == Read::kPositive && *env == '\0') return e.unset;
    char* end = nullptr;
    const long long v = std::strtoll(env, &end, 10);
    const bool number = end != env && *end == '\0';
    if (e.read == Read::kInteger) return number ? static_cast<int64_t>(v) : e.unset;
    return number && v >= 1 ? static_cast<int64_t>(v) : kInvalid;
  }
};

State& state() {
  static State s;
  return s;
}

int64_t set_knob_op(c10::string_view name, int64_t value) {
  std::string names;
  for (int i = 0; i < kCount; ++i) {
    if (name == kEntries[i].name) return set(static_cast<Knob>(i), value);
    names += (i == 0 ? "" : i + 1 == kCount ? " or " : ", ") + std::string(kEntries[i].name);
  }
  TORCH_CHECK_VALUE(false, "opforge::_set_knob: expected ", names, ", but got ", std::string(name));
  return 0;
}

}  // namespace

int64_t get(Knob k) {
  State& s = state();
  const int i = static_cast<int>(k);
  const int64_t v = s.value[i].load(std::memory_order_relaxed);
  TORCH_CHECK_VALUE(v != kInvalid, "opforge::", kEntries[i].op, ": expected ", kEntries[i].name,
                    " to be a positive integer, but got \"", s.text[i], "\"");
  return v;
}

int64_t set(Knob k, int64_t value) { return state().value[static_cast<int>(k)].exchange(value); }

}  // namespace knobs

// Private: the switch of a test, a benchmark or a user-facing mode (no tensors, so a catch-all kernel).
TORCH_LIBRARY_FRAGMENT(opforge, m) {
  m.def("_set_knob(str name, int value) -> int", &knobs::set_knob_op);
  // Private: whether this build has opforge's CUTLASS sm90 GEMM kernels (core/gemm_sm90.h), for doctor and tests.
  m.def("_has_cutlass() -> bool", []() -> bool {
#ifdef OPFORGE_WITH_CUTLASS
    return true;
#else
    return false;
#endif
  });
}

}  // namespace opforge
