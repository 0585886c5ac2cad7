// StopMatcher and LogprobsJson (openai_response.h): holding back what may
// begin a stop sequence, and each scored token's text, log-probability and
// alternatives in completions' and chat's logprobs objects.
#include "gpu_worker/serving/openai_response.h"

#include <algorithm>

#include "gpu_worker/serving/generation_scheduler.h"

namespace infinigen::gpu_worker::openai {
namespace {

using json = nlohmann::json;

json Bytes(absl::string_view piece) {
  json out = json::array();
  for (unsigned char c : piece) out.push_back(static_cast<int>(c));
  return out;
}

}  // namespace

std::string StopMatcher::Add(absl::string_view piece) {
  pending_.append(piece.data(), piece.size());
  size_t first = std::string::npos;
  for (const std::string& s : stop_) {
    first = std::min(first, pending_.find(s));
  }
  if (first != std::string::npos) {
    stopped_ = true;
    std::string out = pending_.substr(0, first);
    pending_.clear();
    return out;
  }
  size_t hold = 0;  // the longest suffix that begins a stop sequence
  for (const std::string& s : stop_) {
    for (size_t n = std::min(s.size() - 1, pending_.size()); n > hold; --n) {
      if (pending_.compare(pending_.size() - n, n, s, 0, n) == 0) {
        hold = n;
        break;
      }
    }
  }
  std::string out = pending_.substr(0, pending_.size() - hold);
  pending_.erase(0, pending_.size() - hold);
  return out;
}

std::string Utf8(std::string_view bytes) {
  Utf8Assembler a;
  std::string out = a.Add(bytes);
  return out + a.Flush();
}

json LogprobsJson::Build(const std::vector<ScoredToken>& scored, size_t begin,
                         size_t end, size_t completion_bytes) {
  json tokens = json::array(), token_logprobs = json::array(),
       top_logprobs = json::array(), offsets = json::array(),
       content = json::array();
  for (size_t i = begin; i < end; ++i) {
    const ScoredToken& t = scored[i];
    const int token = t.logprob.token;
    const std::string piece = Piece(prev_, token);
    if (!t.prompt && completion_bytes != std::string::npos &&
        completion_offset_ >= completion_bytes) {
      break;
    }
    const bool unscored = t.prompt && prev_ < 0;
    if (p_.chat) {
      json entry{{"token", Utf8(piece)},
                 {"logprob", t.logprob.logprob},
                 {"bytes", Bytes(piece)}};
      json top = json::array();
      for (const auto& [id, lp] : t.logprob.top) {
        const std::string alt = Piece(prev_, id);
        top.push_back(
            json{{"token", Utf8(alt)}, {"logprob", lp}, {"bytes", Bytes(alt)}});
      }
      entry["top_logprobs"] = std::move(top);
      content.push_back(std::move(entry));
    } else {
      tokens.push_back(Utf8(piece));
      offsets.push_back(text_offset_);
      if (unscored) {
        token_logprobs.push_back(nullptr);
        top_logprobs.push_back(nullptr);
      } else {
        token_logprobs.push_back(t.logprob.logprob);
        // The chosen token is listed beside the k most likely, as
        // OpenAI's and vLLM's servers do.
        json top = json::object();
        for (const auto& [id, lp] : t.logprob.top) {
          top[Utf8(Piece(prev_, id))] = lp;
        }
        top[Utf8(piece)] = t.logprob.logprob;
        top_logprobs.push_back(std::move(top));
      }
    }
    text_offset_ += piece.size();
    if (!t.prompt) completion_offset_ += piece.size();
    prev_ = token;
  }
  if (p_.chat) return json{{"content", std::move(content)}, {"refusal", nullptr}};
  return json{{"tokens", std::move(tokens)},
              {"token_logprobs", std::move(token_logprobs)},
              {"top_logprobs", std::move(top_logprobs)},
              {"text_offset", std::move(offsets)}};
}

std::string LogprobsJson::Piece(int prev, int token) const {
  if (prev < 0 && !p_.prompt_tokens.empty() &&
      !(p_.echo && p_.logprobs >= 0)) {
    prev = p_.prompt_tokens.back();
  }
  if (tokenizer_.IsControl(token)) return "";
  return tokenizer_.DecodeToken(prev, token);
}

}  // namespace infinigen::gpu_worker::openai
