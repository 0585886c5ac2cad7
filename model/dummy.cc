#include "model/dummy.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/status.h"

namespace infinigen::model {
namespace {

struct Preset {
  const char* name;
  const char* config_json;  // the model's config.json, as published
};

// Hugging Face's config.json of each model (meta-llama/Llama-2-7b-hf,
// meta-llama/Meta-Llama-3-8B, facebook/opt-13b), the Llama ones with
// max_position_embeddings raised to 131072.
constexpr Preset kPresets[] = {
    {"llama-2-7b",
     R"({"model_type": "llama", "hidden_size": 4096,
         "intermediate_size": 11008, "num_hidden_layers": 32,
         "num_attention_heads": 32, "num_key_value_heads": 32,
         "vocab_size": 32000, "max_position_embeddings": 131072,
         "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "bos_token_id": 1,
         "eos_token_id": 2, "hidden_act": "silu",
         "tie_word_embeddings": false})"},
    {"llama-3-8b",
     R"({"model_type": "llama", "hidden_size": 4096,
         "intermediate_size": 14336, "num_hidden_layers": 32,
         "num_attention_heads": 32, "num_key_value_heads": 8,
         "vocab_size": 128256, "max_position_embeddings": 131072,
         "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
         "bos_token_id": 128000, "eos_token_id": 128001,
         "hidden_act": "silu", "tie_word_embeddings": false})"},
    {"opt-13b",
     R"({"model_type": "opt", "hidden_size": 5120, "ffn_dim": 20480,
         "num_hidden_layers": 40, "num_attention_heads": 40,
         "vocab_size": 50272, "max_position_embeddings": 2048,
         "bos_token_id": 2, "eos_token_id": 2, "activation_function": "relu",
         "do_layer_norm_before": true, "word_embed_proj_dim": 5120,
         "tie_word_embeddings": true})"},
};

// splitmix64: a well-mixed 64-bit hash of its input.
uint64_t Mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// A random tensor to fill: `count` values of tensor number `tensor`.
struct RandomTensor {
  std::vector<float>* out;
  size_t count;
  uint64_t tensor;
};

// Runs body(i) for i in [0, n) on every hardware thread, each taking the
// next i as it finishes one.
template <typename Body>
void ParallelFor(size_t n, const Body& body) {
  const size_t threads = std::min<size_t>(
      std::max(1u, std::thread::hardware_concurrency()), n);
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t i = next++; i < n; i = next++) body(i);
  };
  std::vector<std::thread> pool;
  for (size_t t = 1; t < threads; ++t) pool.emplace_back(work);
  work();
  for (std::thread& th : pool) th.join();
}

// Fills every tensor uniform in [-r, r] (standard deviation 0.02), value i
// of tensor t from hash(seed, t, i). All tensors at once: first each is
// allocated (and zeroed by the allocation) on its own thread, then the
// values are written in chunks on every thread, so that a 7B model's 27 GB
// are touched in parallel rather than one tensor after another.
void FillUniform(const std::vector<RandomTensor>& tensors, uint64_t seed) {
  ParallelFor(tensors.size(),
              [&](size_t t) { tensors[t].out->resize(tensors[t].count); });
  constexpr size_t kChunk = size_t{1} << 22;
  struct Chunk {
    const RandomTensor* tensor;
    size_t begin, end;
  };
  std::vector<Chunk> chunks;
  for (const RandomTensor& t : tensors) {
    for (size_t b = 0; b < t.count; b += kChunk) {
      chunks.push_back({&t, b, std::min(t.count, b + kChunk)});
    }
  }
  const float r = 0.02f * std::sqrt(3.0f);
  ParallelFor(chunks.size(), [&](size_t i) {
    const Chunk& c = chunks[i];
    const uint64_t base = Mix(seed ^ Mix(c.tensor->tensor));
    float* out = c.tensor->out->data();
    for (size_t j = c.begin; j < c.end; ++j) {
      // The top 24 bits as a float in [0, 1).
      const float u = static_cast<float>(Mix(base + j) >> 40) * 0x1p-24f;
      out[j] = (2.0f * u - 1.0f) * r;
    }
  });
}

}  // namespace

std::vector<std::string> DummyModelPresets() {
  std::vector<std::string> names;
  for (const Preset& p : kPresets) names.push_back(p.name);
  return names;
}

absl::StatusOr<HfModelConfig> DummyModelConfig(const std::string& name_or_path) {
  for (const Preset& p : kPresets) {
    if (name_or_path == p.name) return ParseHfConfig(p.config_json, p.name);
  }
  std::error_code error;
  const std::string path =
      std::filesystem::is_directory(name_or_path, error)
          ? name_or_path + "/config.json"
          : name_or_path;
  std::ifstream in(path);
  if (!in.good()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--model_config: '%s' is neither a known model (%s) nor a "
        "config.json",
        name_or_path, absl::StrJoin(DummyModelPresets(), ", ")));
  }
  std::stringstream text;
  text << in.rdbuf();
  return ParseHfConfig(text.str(), path);
}

Weights DummyWeights(const HfModelConfig& hf, uint64_t seed) {
  const ModelConfig& c = hf.config;
  Weights w;
  w.config = c;
  // Numbered in this order; filled together at the end.
  std::vector<RandomTensor> tensors;
  auto random = [&](std::vector<float>& v, size_t count) {
    tensors.push_back({&v, count, tensors.size()});
  };
  auto ones = [](std::vector<float>& v, size_t count) { v.assign(count, 1.0f); };
  auto zeros = [](std::vector<float>& v, size_t count) {
    v.assign(count, 0.0f);
  };
  const size_t dim = c.dim, hidden = c.hidden_dim, q = c.q_dim(),
               kv = c.kv_dim();
  const bool opt = c.arch == Architecture::kOpt;
  random(w.token_embedding, static_cast<size_t>(c.vocab_size) * dim);
  if (opt) {
    random(w.position_embedding,
           (c.max_seq_len + ModelConfig::kOptPositionOffset) * dim);
  }
  w.layers.resize(c.n_layers);
  for (LayerWeights& l : w.layers) {
    ones(l.attn_norm, dim);
    random(l.wq, q * dim);
    random(l.wk, kv * dim);
    random(l.wv, kv * dim);
    random(l.wo, dim * q);
    ones(l.ffn_norm, dim);
    random(l.w1, hidden * dim);
    random(l.w2, dim * hidden);
    if (opt) {
      zeros(l.attn_norm_bias, dim);
      zeros(l.bq, q);
      zeros(l.bk, kv);
      zeros(l.bv, kv);
      zeros(l.bo, dim);
      zeros(l.ffn_norm_bias, dim);
      zeros(l.b1, hidden);
      zeros(l.b2, dim);
    } else {
      random(l.w3, hidden * dim);
    }
  }
  ones(w.final_norm, dim);
  if (opt) zeros(w.final_norm_bias, dim);
  if (!hf.tie_word_embeddings) {
    random(w.lm_head, static_cast<size_t>(c.vocab_size) * dim);
  }
  FillUniform(tensors, seed);
  return w;
}

}  // namespace infinigen::model
