#include "model/config.h"

#include "absl/strings/str_format.h"

namespace infinigen::model {

const char* ArchitectureName(Architecture arch) {
  switch (arch) {
    case Architecture::kLlama:
      return "llama";
    case Architecture::kOpt:
      return "opt";
    case Architecture::kGemma3:
      return "gemma3";
  }
  return "unknown";
}

absl::Status ModelConfig::Validate() const {
  auto positive = [](const char* name, int v) -> absl::Status {
    if (v <= 0) {
      return absl::InvalidArgumentError(
          absl::StrFormat("model config: %s must be positive, got %d", name, v));
    }
    return absl::OkStatus();
  };
  for (auto [name, v] :
       {std::pair<const char*, int>{"dim", dim}, {"hidden_dim", hidden_dim},
        {"n_layers", n_layers}, {"n_heads", n_heads},
        {"n_kv_heads", n_kv_heads}, {"head_dim", head_dim},
        {"vocab_size", vocab_size}, {"max_seq_len", max_seq_len}}) {
    absl::Status s = positive(name, v);
    if (!s.ok()) return s;
  }
  if (n_heads % n_kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "model config: n_heads (%d) is not a multiple of n_kv_heads (%d)",
        n_heads, n_kv_heads));
  }
  if (sliding_window < 0 || sliding_window_pattern < 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "model config: sliding_window %d and its pattern %d must be >= 0",
        sliding_window, sliding_window_pattern));
  }
  if (arch != Architecture::kOpt && head_dim % 2 != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "model config: rotary embedding needs an even head_dim, got %d",
        head_dim));
  }
  if (bos_id >= vocab_size || eos_id >= vocab_size) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "model config: bos %d / eos %d outside vocab of %d", bos_id, eos_id,
        vocab_size));
  }
  return absl::OkStatus();
}

std::string ModelConfig::DebugString() const {
  return absl::StrFormat(
      "%s dim=%d hidden=%d layers=%d heads=%d kv_heads=%d head_dim=%d "
      "vocab=%d ctx=%d",
      ArchitectureName(arch), dim, hidden_dim, n_layers, n_heads, n_kv_heads,
      head_dim, vocab_size, max_seq_len) +
         (sliding_window > 0
              ? absl::StrFormat(" window=%d every %d layers global",
                                sliding_window, sliding_window_pattern)
              : "");
}

}  // namespace infinigen::model
