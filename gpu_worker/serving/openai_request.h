// The OpenAI completion and chat requests the HTTP API accepts
// (http_api.h): a request body parsed and checked into CompletionParams, or
// the ApiError to answer with (OpenAI's error object). No state: the HTTP
// API calls ParseCompletionRequest for each request.
#ifndef INFINIGEN_GPU_WORKER_SERVING_OPENAI_REQUEST_H_
#define INFINIGEN_GPU_WORKER_SERVING_OPENAI_REQUEST_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gpu_worker/serving/chat_template.h"
#include "model/tokenizer.h"
#include "nlohmann/json.hpp"

namespace infinigen::gpu_worker::openai {

// A request's parameters after validation.
struct CompletionParams {
  bool chat = false;
  std::vector<int> prompt_tokens;
  int max_tokens = 0;  // 0: up to the scheduler's limit
  float temperature = 1.0f;
  float top_p = 1.0f;
  uint64_t seed = 0;
  std::vector<std::string> stop;
  bool stream = false;
  bool include_usage = false;
  float frequency_penalty = 0.0f;
  float presence_penalty = 0.0f;
  // -1: no logprobs; k >= 0: each token's log-probability with its row's k
  // most likely tokens (completions: logprobs = k; chat: logprobs = true,
  // top_logprobs = k).
  int logprobs = -1;
  // Completions: the answer's text starts with the prompt, and with
  // logprobs the prompt's tokens are scored too.
  bool echo = false;
  // Completions: the prompt as given, when it was a string (echo).
  std::string prompt_text;
};

// An HTTP status and OpenAI's error fields.
struct ApiError {
  int status = 400;
  std::string message;
  std::string type = "invalid_request_error";
  std::string param;  // empty: null
  std::string code;   // empty: null
};

// {"error": {...}}: the body of an error answer.
nlohmann::json ErrorBody(const ApiError& e);
// A 400 naming the request field at fault.
ApiError BadParam(std::string param, std::string message);
// The scheduler's refusals as HTTP: 400 invalid, 429 queue full, 503
// unavailable, else 500.
ApiError FromStatus(const absl::Status& s);
// A 404 for a model this server does not serve.
ApiError UnknownModel(const std::string& model, const std::string& model_id);

// What a request is checked against: the server's model and limits.
struct RequestContext {
  std::string model_id;
  // The model's chat template, or why chat is not available.
  const absl::StatusOr<ChatTemplate>* chat_template = nullptr;
  const model::Tokenizer* tokenizer = nullptr;
  int max_new_tokens_limit = 0;  // the scheduler's
};

// A /v1/completions (chat false) or /v1/chat/completions body into *p, or
// the error to answer with (p is then partly filled).
std::optional<ApiError> ParseCompletionRequest(const nlohmann::json& body,
                                               bool chat,
                                               const RequestContext& context,
                                               CompletionParams* p);

}  // namespace infinigen::gpu_worker::openai

#endif  // INFINIGEN_GPU_WORKER_SERVING_OPENAI_REQUEST_H_
