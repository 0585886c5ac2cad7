// The parts of an OpenAI answer the HTTP API (http_api.h) builds from a
// generation: its text minus the stop sequences (StopMatcher) and the
// logprobs objects (LogprobsJson) of its scored tokens. Each object serves
// one answer; not thread-safe.
#ifndef INFINIGEN_GPU_WORKER_SERVING_OPENAI_RESPONSE_H_
#define INFINIGEN_GPU_WORKER_SERVING_OPENAI_RESPONSE_H_

#include <cstddef>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/strings/string_view.h"
#include "gpu_worker/serving/openai_request.h"
#include "gpu_worker/serving/sampler.h"
#include "model/tokenizer.h"
#include "nlohmann/json.hpp"

namespace infinigen::gpu_worker::openai {

// Sends a generation's text minus its stop sequences: text that could be the
// start of a stop sequence is held back until it cannot.
class StopMatcher {
 public:
  explicit StopMatcher(const std::vector<std::string>& stop) : stop_(stop) {}

  // The text now safe to send after `piece`; sets stopped() when a stop
  // sequence appeared (the returned text then ends just before it).
  std::string Add(absl::string_view piece);
  // What was held back (the generation ended without a stop sequence).
  std::string Flush() { return std::exchange(pending_, ""); }
  bool stopped() const { return stopped_; }

 private:
  const std::vector<std::string> stop_;
  std::string pending_;
  bool stopped_ = false;
};

// A token of the answer with its log-probability; `prompt`: a prompt token
// (echo), the first of which has no score (logprob.token set, top empty,
// logprob NaN).
struct ScoredToken {
  TokenLogProb logprob;
  bool prompt = false;
};

// Valid UTF-8 (a byte token's lone byte becomes U+FFFD), for JSON.
std::string Utf8(std::string_view bytes);

// OpenAI's logprobs objects from scored tokens: completions' {tokens,
// token_logprobs, top_logprobs, text_offset}, chat's {content: [{token,
// logprob, bytes, top_logprobs}]}. Keeps the text offsets of the tokens it
// has seen, so a stream's chunks continue them.
class LogprobsJson {
 public:
  LogprobsJson(const CompletionParams& p, const model::Tokenizer& tokenizer)
      : p_(p), tokenizer_(tokenizer) {}

  // The object for scored[begin, end). completion_bytes: the answer's
  // generated text, after a stop sequence cut it (npos: not cut); tokens
  // that begin at or after it are left out.
  nlohmann::json Build(const std::vector<ScoredToken>& scored, size_t begin,
                       size_t end, size_t completion_bytes);

 private:
  // A token's text after `prev`; the first generated token follows the
  // prompt's last.
  std::string Piece(int prev, int token) const;

  const CompletionParams& p_;
  const model::Tokenizer& tokenizer_;
  int prev_ = -1;
  size_t text_offset_ = 0;
  size_t completion_offset_ = 0;
};

}  // namespace infinigen::gpu_worker::openai

#endif  // INFINIGEN_GPU_WORKER_SERVING_OPENAI_RESPONSE_H_
