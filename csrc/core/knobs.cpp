// The knobs of core/knobs.h and the private op that sets them.
#include "core/knobs.h"

#include <c10/util/Exception.h>
#include <torch/library.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>

namespace opforge {
namespace knobs {
namespace {

struct Entry {
  const char* name;  // the environment variable
  int64_t unset;     // the value when it is not set
  bool integer;      // true: the variable's value is read as an integer (a variant number)
};
constexpr Entry kEntries[] = {{"OPFORGE_LINEAR_LT", 1, false},   {"OPFORGE_LINEAR_GEMV", -1, false},
                              {"OPFORGE_LCE_GRAD_IN_FORWARD", 1, false}, {"OPFORGE_GEMV_VARIANT", -1, true},
                              {"OPFORGE_RMS_FWD", -1, true},     {"OPFORGE_RMS_BWD", -1, true},
                              {"OPFORGE_ROPE_KERNEL", -1, true}, {"OPFORGE_LCE_DW_GROUP", 1, true},
                              {"OPFORGE_LCE_DW_ACCUM", 0, true}};
constexpr int kCount = sizeof(kEntries) / sizeof(kEntries[0]);

int64_t from_env(const Entry& e) {
  const char* env = std::getenv(e.name);
  if (env == nullptr) return e.unset;
  if (e.integer) {  // a variant number; anything that is not one is the default
    char* end = nullptr;
    const long long v = std::strtoll(env, &end, 10);
    return (end != env && *end == '\0') ? static_cast<int64_t>(v) : e.unset;
  }
  if (e.unset == 1) return std::strcmp(env, "0") == 0 ? 0 : 1;  // OPFORGE_LINEAR_LT, _LCE_GRAD_IN_FORWARD: "0" or not
  return std::strcmp(env, "1") == 0 ? 1 : 0;                     // OPFORGE_LINEAR_GEMV: "1" or not
}

std::atomic<int64_t>& slot(Knob k) {
  static std::atomic<int64_t> slots[kCount] = {from_env(kEntries[0]), from_env(kEntries[1]), from_env(kEntries[2]),
                                               from_env(kEntries[3]), from_env(kEntries[4]), from_env(kEntries[5]),
                                               from_env(kEntries[6]), from_env(kEntries[7]), from_env(kEntries[8])};
  return slots[static_cast<int>(k)];
}

int64_t set_knob_op(c10::string_view name, int64_t value) {
  for (int i = 0; i < kCount; ++i) {
    if (name == kEntries[i].name) return set(static_cast<Knob>(i), value);
  }
  TORCH_CHECK_VALUE(false, "opforge::_set_knob: expected OPFORGE_LINEAR_LT, OPFORGE_LINEAR_GEMV, "
                    "OPFORGE_LCE_GRAD_IN_FORWARD, OPFORGE_GEMV_VARIANT, OPFORGE_RMS_FWD, OPFORGE_RMS_BWD, "
                    "OPFORGE_ROPE_KERNEL, OPFORGE_LCE_DW_GROUP or OPFORGE_LCE_DW_ACCUM, but got ",
                    std::string(name));
  return 0;
}

}  // namespace

int64_t get(Knob k) { return slot(k).load(std::memory_order_relaxed); }

int64_t set(Knob k, int64_t value) { return slot(k).exchange(value); }

}  // namespace knobs

// Private: a test's or benchmark's switch (no tensors, so a catch-all kernel).
TORCH_LIBRARY_FRAGMENT(opforge, m) {
  m.def("_set_knob(str name, int value) -> int", &knobs::set_knob_op);
}

}  // namespace opforge
