// The HTTP API's request handlers (http_api.h), private to
// //gpu_worker:http_api: HttpApiHandlers installs the routes, checks the
// bearer key and answers the model and tokenizer routes (http_api.cc) and
// the completions, whole or streamed (http_completions.cc).
#ifndef INFINIGEN_GPU_WORKER_SERVING_HTTP_API_INTERNAL_H_
#define INFINIGEN_GPU_WORKER_SERVING_HTTP_API_INTERNAL_H_

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "gpu_worker/serving/generation_scheduler.h"
#include "gpu_worker/serving/http_api_options.h"
#include "gpu_worker/serving/openai_request.h"
#include "gpu_worker/serving/openai_response.h"
#include "httplib.h"
#include "model/tokenizer.h"
#include "nlohmann/json.hpp"

namespace infinigen::gpu_worker::http_api_internal {

// Answers with OpenAI's error object.
void SetError(httplib::Response& res, const openai::ApiError& e);

int64_t UnixNow();

// Thread-safe: each request is handled on its connection's thread.
class HttpApiHandlers {
 public:
  using json = nlohmann::json;

  HttpApiHandlers(GenerationScheduler* scheduler,
                  const model::Tokenizer* tokenizer, HttpApiOptions options)
      : scheduler_(scheduler),
        tokenizer_(tokenizer),
        options_(std::move(options)),
        created_(UnixNow()) {}

  void Install(httplib::Server& server);

 private:
  httplib::Server::HandlerResponse Authorize(const httplib::Request& req,
                                             httplib::Response& res);

  static json IdOrNull(int id) { return id < 0 ? json(nullptr) : json(id); }

  // {"prompt": text, "add_special_tokens": true} -> {"tokens", "count",
  // "max_model_len"}: add_special_tokens puts BOS first where the model's
  // text starts with one.
  void Tokenize(const httplib::Request& req, httplib::Response& res) const;

  // {"tokens": [ids]} -> {"prompt": their text}.
  void Detokenize(const httplib::Request& req, httplib::Response& res) const;

  json ModelJson() const;

  // One completion's chunk or whole answer. `text` and `finish` (may be
  // empty: null) fill the one choice.
  json Choice(const openai::CompletionParams& p, const std::string& text,
              const std::string& finish, bool delta, bool first,
              json logprobs = nullptr) const;

  json Envelope(const openai::CompletionParams& p, const std::string& id,
                int64_t created, bool chunk) const;

  static json Usage(int prompt, int completion, int cached);

  // The generation's progress as the handlers see it.
  struct Progress {
    explicit Progress(const openai::CompletionParams& p);
    openai::StopMatcher matcher;
    int completion_tokens = 0;
    int cached_tokens = 0;  // prompt tokens whose KV was reused
    std::string finish;  // set once the generation ended
    absl::Status error;  // the stream's kError
    // With logprobs: the tokens scored so far, prompt tokens first when
    // echoed (the first prompt token unscored), in order; `sent` of them
    // are in chunks already (streaming).
    std::vector<openai::ScoredToken> scored;
    size_t sent = 0;
  };

  // Waits for the stream's next event and returns the text it frees to
  // send. Sets progress->finish when the generation is over (cancelling the
  // stream when a stop sequence ended it).
  static std::string Step(GenerationStream& stream, Progress* progress);

  void Complete(const httplib::Request& req, httplib::Response& res,
                bool chat);

  // The prompt an echo repeats: as given, or its tokens' text.
  std::string EchoText(const openai::CompletionParams& p) const;

  // What every part of one answer carries.
  struct Answer {
    std::shared_ptr<const openai::CompletionParams> params;
    std::string id;
    int64_t created = 0;
    int prompt_tokens() const {
      return static_cast<int>(params->prompt_tokens.size());
    }
  };

  // A non-streaming answer: the whole completion in one JSON body.
  void AnswerWhole(GenerationStream& stream, const Answer& a,
                   httplib::Response& res);

  // A streaming answer as server-sent events: a chunk per piece of text,
  // the finish reason, usage when asked, then [DONE]. False (the stream
  // cancelled) when the client goes away.
  bool WriteEvents(GenerationStream& s, const Answer& a,
                   httplib::DataSink& sink);

  GenerationScheduler* const scheduler_;
  const model::Tokenizer* const tokenizer_;
  const HttpApiOptions options_;
  const int64_t created_;
};

}  // namespace infinigen::gpu_worker::http_api_internal

#endif  // INFINIGEN_GPU_WORKER_SERVING_HTTP_API_INTERNAL_H_
