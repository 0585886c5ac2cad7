// The OpenAI-compatible HTTP API of `infinigen serve` (--http_listen), beside
// the gRPC Worker service and over the same GenerationScheduler, so HTTP and
// gRPC requests share its queue and its continuous batches.
//
//   POST /v1/completions        prompt -> text
//   POST /v1/chat/completions   messages -> the model's chat template -> text
//   GET  /v1/models, /v1/models/{id}, /health, /metrics (when given)
//   POST /tokenize, /detokenize, GET /tokenizer_info (vLLM's routes: text
//        <-> token ids with the model's tokenizer)
//
// Both completion routes take model, max_tokens (chat: or
// max_completion_tokens), temperature, top_p, seed, stop (a string or up to
// 4), n (only 1), stream and stream_options.include_usage,
// frequency_penalty and presence_penalty, and log-probabilities: chat's
// logprobs and top_logprobs, completions' logprobs (k) and echo (the
// prompt's text first; with logprobs, its tokens scored too, the first
// null, as lm-evaluation-harness's local-completions reads them). A
// log-probability is the model's (log softmax of its logits, before
// temperature, top_p and penalties); an end token the model chose is
// scored as the last token. A completions prompt is a string, token ids,
// or a batch of one of either. Other OpenAI fields are a 400 naming the
// field unless off (absent, null, false, 0). A
// non-streaming answer carries usage (prompt and completion tokens) and
// finish_reason "stop" (end token or a stop sequence) or "length"
// (max_tokens, or the context is full). A streaming answer is server-sent
// events, one chunk per piece of text, then one with finish_reason, then
// `data: [DONE]`. A stop sequence is never sent: text that may begin one is
// held back until it cannot.
//
// Errors are OpenAI's shape, {"error": {"message", "type", "param", "code"}}:
// 400 malformed body or parameter, 401 missing or wrong bearer key (when
// api_key is set; /health needs none), 404 unknown model or route, 413 body
// over max_body_bytes, 429 scheduler queue full, 503 draining. A streaming
// client that disconnects cancels its GenerationStream, which frees its
// slot.
//
// Thread-safe; each connection is served on a thread of its own (at most
// max_connections), a request blocking on one GenerationStream.
#ifndef INFINIGEN_GPU_WORKER_SERVING_HTTP_API_H_
#define INFINIGEN_GPU_WORKER_SERVING_HTTP_API_H_

#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/server_tls.h"
#include "gpu_worker/serving/http_api_options.h"
#include "gpu_worker/serving/generation_scheduler.h"
#include "model/tokenizer.h"

namespace httplib {
class Server;
}

namespace infinigen::gpu_worker {

class HttpApiServer {
 public:
  // Listens on options.listen and serves from a background thread.
  // `scheduler` and `tokenizer` are not owned and must outlive the server.
  // InvalidArgument for a malformed address or TLS PEMs OpenSSL does not
  // take; Unavailable when it cannot be bound.
  static absl::StatusOr<std::unique_ptr<HttpApiServer>> Start(
      GenerationScheduler* scheduler, const model::Tokenizer* tokenizer,
      HttpApiOptions options);
  ~HttpApiServer();  // Stop()

  int port() const { return port_; }
  // Stops listening and waits for the requests being served to end (the
  // scheduler's Shutdown ends their streams). Idempotent.
  void Stop();

 private:
  HttpApiServer() = default;

  std::unique_ptr<httplib::Server> server_;
  std::thread thread_;
  int port_ = 0;
};

}  // namespace infinigen::gpu_worker

#endif  // INFINIGEN_GPU_WORKER_SERVING_HTTP_API_H_
