#include "gpu_worker/serving/openai_request.h"

#include <algorithm>
#include <random>
#include <utility>

#include "absl/strings/str_cat.h"
#include "gpu_worker/serving/generation_scheduler.h"

namespace infinigen::gpu_worker::openai {

using json = nlohmann::json;

json ErrorBody(const ApiError& e) {
  return json{{"error",
               {{"message", e.message},
                {"type", e.type},
                {"param", e.param.empty() ? json(nullptr) : json(e.param)},
                {"code", e.code.empty() ? json(nullptr) : json(e.code)}}}};
}

ApiError BadParam(std::string param, std::string message) {
  return ApiError{400, std::move(message), "invalid_request_error",
                  std::move(param), ""};
}

// The scheduler's refusals as HTTP.
ApiError FromStatus(const absl::Status& s) {
  ApiError e;
  e.message = std::string(s.message());
  switch (s.code()) {
    case absl::StatusCode::kInvalidArgument:
      e.status = 400;
      break;
    case absl::StatusCode::kResourceExhausted:
      e.status = 429;
      e.type = "rate_limit_error";
      e.code = "queue_full";
      break;
    case absl::StatusCode::kUnavailable:
      e.status = 503;
      e.type = "server_error";
      e.code = "unavailable";
      break;
    default:
      e.status = 500;
      e.type = "server_error";
      break;
  }
  return e;
}

ApiError UnknownModel(const std::string& model, const std::string& model_id) {
  return ApiError{404,
                  absl::StrCat("the model '", model,
                               "' does not exist; this server serves '",
                               model_id, "'"),
                  "invalid_request_error", "model", "model_not_found"};
}

namespace {

// Reads an optional number field; its absence leaves *out alone.
std::optional<ApiError> GetNumber(const json& body, const char* name,
                                  double* out) {
  auto it = body.find(name);
  if (it == body.end() || it->is_null()) return std::nullopt;
  if (!it->is_number()) {
    return BadParam(name, absl::StrCat("'", name, "' must be a number"));
  }
  *out = it->get<double>();
  return std::nullopt;
}

std::optional<ApiError> GetInt(const json& body, const char* name,
                               int64_t* out) {
  auto it = body.find(name);
  if (it == body.end() || it->is_null()) return std::nullopt;
  if (!it->is_number_integer()) {
    return BadParam(name, absl::StrCat("'", name, "' must be an integer"));
  }
  *out = it->get<int64_t>();
  return std::nullopt;
}

std::optional<ApiError> GetBool(const json& body, const char* name,
                                bool* out) {
  auto it = body.find(name);
  if (it == body.end() || it->is_null()) return std::nullopt;
  if (!it->is_boolean()) {
    return BadParam(name, absl::StrCat("'", name, "' must be true or false"));
  }
  *out = it->get<bool>();
  return std::nullopt;
}

// OpenAI fields this server does not implement: absent, null or their
// "off" value (false, 0, empty) are accepted; anything else is a 400 that
// names the field, so that no client believes it got what it asked for.
constexpr const char* kUnsupported[] = {
    "logit_bias", "best_of",       "suffix",          "tools",
    "tool_choice", "functions",    "function_call",   "response_format"};

bool IsOff(const json& v) {
  if (v.is_null()) return true;
  if (v.is_boolean()) return !v.get<bool>();
  if (v.is_number()) return v.get<double>() == 0;
  if (v.is_string()) return v.get<std::string>().empty();
  if (v.is_array() || v.is_object()) return v.empty();
  return false;
}

std::optional<ApiError> RejectUnsupported(const json& body) {
  for (const char* name : kUnsupported) {
    auto it = body.find(name);
    if (it == body.end() || IsOff(*it)) continue;
    // best_of: 1 is the default (one candidate).
    if (std::string(name) == "best_of" && it->is_number_integer() &&
        it->get<int64_t>() == 1) {
      continue;
    }
    if (std::string(name) == "tool_choice" && it->is_string() &&
        it->get<std::string>() == "none") {
      continue;
    }
    return BadParam(name, absl::StrCat("'", name,
                                       "' is not supported by this server"));
  }
  return std::nullopt;
}

// One request's parsing against the server's context.
class RequestParser {
 public:
  explicit RequestParser(const RequestContext& context) : context_(context) {}

  // The request's parameters, or the error to answer with.
  std::optional<ApiError> Parse(const json& body, bool chat,
                                CompletionParams* p) const {
    if (!body.is_object()) {
      return ApiError{400, "the request body must be a JSON object"};
    }
    p->chat = chat;
    if (auto it = body.find("model"); it != body.end() && !it->is_null()) {
      if (!it->is_string()) return BadParam("model", "'model' must be a string");
      if (it->get<std::string>() != context_.model_id) {
        return UnknownModel(it->get<std::string>(), context_.model_id);
      }
    }
    int64_t n = 1;
    if (auto e = GetInt(body, "n", &n)) return e;
    if (n != 1) {
      return BadParam("n",
                      "'n' must be 1: this server returns one choice per "
                      "request (send n requests, with different seeds, for "
                      "n samples)");
    }
    if (auto e = RejectUnsupported(body)) return e;

    if (auto e = chat ? ParseChatPrompt(body, p)
                      : ParseCompletionPrompt(body, p)) {
      return e;
    }
    if (auto e = ParseMaxTokens(body, chat, p)) return e;
    if (auto e = ParseSampling(body, p)) return e;
    if (auto e = ParseLogprobs(body, chat, p)) return e;
    return ParseStopAndStream(body, p);
  }

  // logprobs and top_logprobs (chat), logprobs and echo (completions).
  static std::optional<ApiError> ParseLogprobs(const json& body, bool chat,
                                               CompletionParams* p) {
    const int max_top = kMaxTopLogprobs;
    if (chat) {
      bool logprobs = false;
      if (auto e = GetBool(body, "logprobs", &logprobs)) return e;
      int64_t top = 0;
      if (auto e = GetInt(body, "top_logprobs", &top)) return e;
      if (top != 0 && !logprobs) {
        return BadParam("top_logprobs",
                        "'top_logprobs' needs 'logprobs': true");
      }
      if (top < 0 || top > max_top) {
        return BadParam("top_logprobs",
                        absl::StrCat("'top_logprobs' must be in [0, ",
                                     max_top, "]"));
      }
      if (logprobs) p->logprobs = static_cast<int>(top);
      if (body.contains("echo") && !IsOff(body["echo"])) {
        return BadParam("echo", "'echo' is a completions field, not chat's");
      }
      return std::nullopt;
    }
    if (auto it = body.find("logprobs"); it != body.end() && !it->is_null()) {
      if (!it->is_number_integer() || it->get<int64_t>() < 0 ||
          it->get<int64_t>() > max_top) {
        return BadParam("logprobs",
                        absl::StrCat("'logprobs' must be an integer in [0, ",
                                     max_top,
                                     "]: how many likely tokens to list with "
                                     "each token's log-probability"));
      }
      p->logprobs = it->get<int>();
    }
    if (body.contains("top_logprobs") && !IsOff(body["top_logprobs"])) {
      return BadParam("top_logprobs",
                      "'top_logprobs' is chat's; completions take "
                      "'logprobs': k");
    }
    return GetBool(body, "echo", &p->echo);
  }

  // A chat request's messages in the model's chat template, tokenized.
  std::optional<ApiError> ParseChatPrompt(const json& body,
                                          CompletionParams* p) const {
    if (!context_.chat_template->ok()) {
      return ApiError{400,
                      absl::StrCat("chat is not available: ",
                                   context_.chat_template->status().message())};
    }
    auto it = body.find("messages");
    if (it == body.end() || !it->is_array() || it->empty()) {
      return BadParam("messages",
                      "'messages' must be a non-empty array of messages");
    }
    std::vector<ChatMessage> messages;
    for (size_t i = 0; i < it->size(); ++i) {
      const json& m = (*it)[i];
      const std::string where = absl::StrCat("messages[", i, "]");
      if (!m.is_object() || !m.contains("role") || !m["role"].is_string()) {
        return BadParam(where, absl::StrCat("'", where,
                                            "' must be an object with a "
                                            "string 'role'"));
      }
      ChatMessage message{m["role"].get<std::string>(), ""};
      const json content = m.value("content", json(nullptr));
      if (content.is_string()) {
        message.content = content.get<std::string>();
      } else if (content.is_array()) {
        // [{"type": "text", "text": ...}, ...]: the text parts.
        for (const json& part : content) {
          if (!part.is_object() || part.value("type", "") != "text" ||
              !part.contains("text") || !part["text"].is_string()) {
            return BadParam(where, absl::StrCat("'", where,
                                                ".content' may hold only "
                                                "text parts"));
          }
          message.content += part["text"].get<std::string>();
        }
      } else if (!content.is_null()) {
        return BadParam(where, absl::StrCat("'", where,
                                            ".content' must be a string"));
      }
      messages.push_back(std::move(message));
    }
    auto text = ApplyChatTemplate(**context_.chat_template, messages);
    if (!text.ok()) {
      return BadParam("messages", std::string(text.status().message()));
    }
    p->prompt_tokens = context_.tokenizer->Encode(*text, /*add_bos=*/true);
    return std::nullopt;
  }

  // A completion request's prompt: one string or one array of token ids.
  std::optional<ApiError> ParseCompletionPrompt(const json& body,
                                                CompletionParams* p) const {
    auto it = body.find("prompt");
    if (it == body.end() || it->is_null()) {
      return BadParam("prompt", "'prompt' is required");
    }
    const json* one = &*it;
    if (it->is_array() && it->size() == 1 &&
        ((*it)[0].is_string() || (*it)[0].is_array())) {
      one = &(*it)[0];  // ["text"] or [[token ids]]: a batch of one
    }
    if (one->is_string()) {
      p->prompt_text = one->get<std::string>();
      p->prompt_tokens =
          context_.tokenizer->Encode(p->prompt_text, /*add_bos=*/true);
    } else if (one->is_array() && !one->empty() &&
               std::all_of(one->begin(), one->end(),
                           [](const json& t) {
                             return t.is_number_integer();
                           })) {
      for (const json& t : *one) p->prompt_tokens.push_back(t.get<int>());
    } else {
      return BadParam("prompt",
                      "'prompt' must be a string or an array of token ids "
                      "(one prompt: n and batches of prompts are not "
                      "supported)");
    }
    if (p->prompt_tokens.empty()) {
      return BadParam("prompt", "the prompt is empty");
    }
    return std::nullopt;
  }

  // max_tokens (or chat's max_completion_tokens) within the server's limit,
  // with OpenAI's defaults.
  std::optional<ApiError> ParseMaxTokens(const json& body, bool chat,
                                         CompletionParams* p) const {
    int64_t max_tokens = 0;
    const char* max_name = "max_tokens";
    if (auto e = GetInt(body, "max_tokens", &max_tokens)) return e;
    if (chat && body.contains("max_completion_tokens")) {
      max_name = "max_completion_tokens";
      if (auto e = GetInt(body, max_name, &max_tokens)) return e;
    }
    const bool max_given = max_tokens != 0 || (body.contains(max_name) &&
                                               !body[max_name].is_null());
    const int limit = context_.max_new_tokens_limit;
    if (max_given && (max_tokens < 1 || max_tokens > limit)) {
      return BadParam(max_name, absl::StrCat("'", max_name,
                                             "' must be in [1, ", limit,
                                             "], not ", max_tokens));
    }
    // OpenAI's default for completions is 16; chat runs to the end of the
    // context.
    p->max_tokens = max_given ? static_cast<int>(max_tokens)
                              : (chat ? limit : std::min(16, limit));
    return std::nullopt;
  }

  // temperature, top_p and seed.
  static std::optional<ApiError> ParseSampling(const json& body,
                                               CompletionParams* p) {
    double temperature = 1.0, top_p = 1.0;
    if (auto e = GetNumber(body, "temperature", &temperature)) return e;
    if (temperature < 0 || temperature > 2) {
      return BadParam("temperature", "'temperature' must be in [0, 2]");
    }
    if (auto e = GetNumber(body, "top_p", &top_p)) return e;
    if (!(top_p > 0 && top_p <= 1)) {
      return BadParam("top_p", "'top_p' must be in (0, 1]");
    }
    p->temperature = static_cast<float>(temperature);
    p->top_p = static_cast<float>(top_p);
    for (const char* name : {"frequency_penalty", "presence_penalty"}) {
      double penalty = 0.0;
      if (auto e = GetNumber(body, name, &penalty)) return e;
      if (!(penalty >= -2 && penalty <= 2)) {
        return BadParam(name, absl::StrCat("'", name, "' must be in [-2, 2]"));
      }
      (std::string(name) == "frequency_penalty" ? p->frequency_penalty
                                                : p->presence_penalty) =
          static_cast<float>(penalty);
    }
    int64_t seed = 0;
    if (body.contains("seed") && !body["seed"].is_null()) {
      if (auto e = GetInt(body, "seed", &seed)) return e;
      p->seed = static_cast<uint64_t>(seed);
    } else {
      p->seed = std::random_device{}();
    }
    return std::nullopt;
  }

  // stop sequences, stream and stream_options.
  static std::optional<ApiError> ParseStopAndStream(const json& body,
                                                    CompletionParams* p) {
    if (auto it = body.find("stop"); it != body.end() && !it->is_null()) {
      if (it->is_string()) {
        p->stop.push_back(it->get<std::string>());
      } else if (it->is_array() && it->size() <= 4 &&
                 std::all_of(it->begin(), it->end(),
                             [](const json& s) { return s.is_string(); })) {
        for (const json& s : *it) p->stop.push_back(s.get<std::string>());
      } else {
        return BadParam("stop",
                        "'stop' must be a string or an array of at most 4 "
                        "strings");
      }
      for (const std::string& s : p->stop) {
        if (s.empty()) {
          return BadParam("stop", "stop sequences must not be empty");
        }
      }
    }
    if (auto e = GetBool(body, "stream", &p->stream)) return e;
    if (auto it = body.find("stream_options");
        it != body.end() && !it->is_null()) {
      if (!it->is_object()) {
        return BadParam("stream_options", "'stream_options' must be an object");
      }
      if (auto e = GetBool(*it, "include_usage", &p->include_usage)) return e;
    }
    return std::nullopt;
  }

 private:
  const RequestContext& context_;
};

}  // namespace

std::optional<ApiError> ParseCompletionRequest(const json& body, bool chat,
                                               const RequestContext& context,
                                               CompletionParams* p) {
  return RequestParser(context).Parse(body, chat, p);
}

}  // namespace infinigen::gpu_worker::openai
