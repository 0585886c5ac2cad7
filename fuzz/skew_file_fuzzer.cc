// libFuzzer target: a skew file (speculator::SkewMatrices::Load) with its
// optional head profile from untrusted bytes, then what the worker does
// with a loaded one: the shape check and the head budgets allocated from
// each of the profile's two error tables. Any crash, sanitizer report or
// hang is a bug; errors are the expected answer to most inputs.
#include <cstddef>
#include <cstdint>

#include "fuzz/memfd_file.h"
#include "speculator/speculator.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  infinigen::fuzz::MemfdFile file(data, size);
  if (!file.ok()) return 0;
  auto skew = infinigen::speculator::SkewMatrices::Load(file.path());
  if (!skew.ok()) return 0;
  (void)skew->CheckShape(skew->n_layers, skew->n_kv_heads, skew->head_dim);
  const infinigen::speculator::HeadProfile& p = skew->profile;
  if (p.empty()) return 0;
  for (float budget : {0.0f, 0.05f, 0.5f, 1.0f}) {
    (void)infinigen::speculator::AllocateBudgets(p, p.error, budget, 2,
                                                 0.75f * budget);
    (void)infinigen::speculator::AllocateBudgets(p, p.speculated_error,
                                                 budget, 0, 0.0f);
  }
  return 0;
}
