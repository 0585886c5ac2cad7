// Dummy weights at a real model's shape, as vLLM's --load-format dummy
// makes them: deterministic pseudo-random values from the configuration
// alone, so that a benchmark at a 7B or 13B shape needs no model file to
// download or carry. The text they generate is noise; their speed is the
// real model's.
#ifndef INFINIGEN_MODEL_DUMMY_H_
#define INFINIGEN_MODEL_DUMMY_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "model/safetensors.h"
#include "model/weights.h"

namespace infinigen::model {

// The names DummyModelConfig knows: llama-2-7b, llama-3-8b, opt-13b.
std::vector<std::string> DummyModelPresets();

// A preset's configuration (the model's Hugging Face config.json; the Llama
// presets take contexts up to 131072 tokens, as dummy weights were trained
// on none), or the config.json at `name_or_path` (a file, or a directory
// holding one). InvalidArgument naming the presets for an unknown name that
// is no file; the config parser's errors otherwise.
absl::StatusOr<HfModelConfig> DummyModelConfig(const std::string& name_or_path);

// Every tensor of `config` filled from `seed`: matrices and embeddings
// uniform with standard deviation 0.02 (Hugging Face's initializer_range),
// norm gains 1 and biases 0; the same values on every machine whatever the
// thread count (each value is a hash of the seed, its tensor and its
// index). Passes Weights::Validate. Host memory: 4 bytes a parameter.
Weights DummyWeights(const HfModelConfig& config, uint64_t seed = 0);

}  // namespace infinigen::model

#endif  // INFINIGEN_MODEL_DUMMY_H_
