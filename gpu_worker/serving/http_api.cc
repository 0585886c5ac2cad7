// HttpApiServer (http_api.h): the HTTP(S) server, its connection threads,
// and HttpApiHandlers' routes (http_api_internal.h): authorization, errors,
// /health, /metrics, the models and the tokenizer routes. The completions
// are http_completions.cc's.
#include "gpu_worker/serving/http_api.h"

#include <algorithm>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/address.h"
#include "common/api_key.h"
#include "common/status.h"
#include "gpu_worker/serving/http_api_internal.h"
#include "httplib.h"
#include "nlohmann/json.hpp"
#include "openssl/ssl.h"

namespace infinigen::gpu_worker {
namespace http_api_internal {

using json = nlohmann::json;
using openai::ApiError;
using openai::ErrorBody;
using openai::Utf8;

void SetError(httplib::Response& res, const ApiError& e) {
  res.status = e.status;
  res.set_content(ErrorBody(e).dump(), "application/json");
}

int64_t UnixNow() { return absl::ToUnixSeconds(absl::Now()); }

namespace {

// httplib's task queue: each connection on a thread of its own, at most
// `limit` at once (beyond that, connections wait for one to end). An idle
// or slow peer holds only its own thread, until the keep-alive or read
// timeout closes it, and never delays another client's request, as one
// thread of a fixed pool it would.
class ConnectionThreads final : public httplib::TaskQueue {
 public:
  explicit ConnectionThreads(int limit)
      : state_(std::make_shared<State>()), limit_(limit) {}

  void enqueue(std::function<void()> fn) override {
    absl::MutexLock lock(&state_->mu);
    if (state_->running >= limit_) {
      state_->waiting.push_back(std::move(fn));
      return;
    }
    ++state_->running;
    // The thread keeps the state alive: it may still be unlocking it when
    // shutdown has returned and the queue is gone.
    std::thread([state = state_, fn = std::move(fn)]() mutable {
      Run(*state, std::move(fn));
    }).detach();
  }

  // Waits for every connection to end (httplib calls it once it stopped
  // accepting).
  void shutdown() override {
    absl::MutexLock lock(&state_->mu);
    state_->mu.Await(absl::Condition(
        +[](State* s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s->mu) {
          return s->running == 0;
        },
        state_.get()));
  }

 private:
  struct State {
    absl::Mutex mu;
    int running ABSL_GUARDED_BY(mu) = 0;
    std::deque<std::function<void()>> waiting ABSL_GUARDED_BY(mu);
  };

  static void Run(State& state, std::function<void()> fn) {
    while (true) {
      fn();
      absl::MutexLock lock(&state.mu);
      if (state.waiting.empty()) {
        --state.running;
        return;
      }
      fn = std::move(state.waiting.front());
      state.waiting.pop_front();
    }
  }

  const std::shared_ptr<State> state_;
  const int limit_;
};

}  // namespace

void HttpApiHandlers::Install(httplib::Server& server) {
  server.set_payload_max_length(options_.max_body_bytes);
  server.set_pre_routing_handler(
      [this](const httplib::Request& req, httplib::Response& res) {
        return Authorize(req, res);
      });
  // Called for every response of status >= 400: fills in the body of
  // httplib's own (404 for no route, 413, ...).
  server.set_error_handler(httplib::Server::HandlerWithResponse(
      [](const httplib::Request& req, httplib::Response& res) {
        if (!res.body.empty() || res.content_provider_) {
          return httplib::Server::HandlerResponse::Unhandled;
        }
        ApiError e;
        e.status = res.status;
        if (res.status == 404) {
          e.message = absl::StrCat("no route ", req.method, " ", req.path);
          e.code = "not_found";
        } else if (res.status == 413) {
          e.message = "the request body is too large";
          e.code = "payload_too_large";
        } else {
          e.message = absl::StrCat("HTTP status ", res.status);
        }
        SetError(res, e);
        return httplib::Server::HandlerResponse::Handled;
      }));
  server.Get("/health",
             [this](const httplib::Request&, httplib::Response& res) {
               const bool ok = !options_.serving || options_.serving();
               res.status = ok ? 200 : 503;
               res.set_content(
                   json{{"status", ok ? "ok" : "unavailable"}}.dump(),
                   "application/json");
             });
  if (options_.metrics) {
    server.Get("/metrics",
               [this](const httplib::Request&, httplib::Response& res) {
                 res.set_content(options_.metrics(),
                                 "text/plain; version=0.0.4");
               });
  }
  server.Get("/v1/models",
             [this](const httplib::Request&, httplib::Response& res) {
               res.set_content(
                   json{{"object", "list"}, {"data", {ModelJson()}}}.dump(),
                   "application/json");
             });
  server.Get(R"(/v1/models/(.+))",
             [this](const httplib::Request& req, httplib::Response& res) {
               if (req.matches[1] != options_.model_id) {
                 SetError(res, openai::UnknownModel(req.matches[1], options_.model_id));
                 return;
               }
               res.set_content(ModelJson().dump(), "application/json");
             });
  // vLLM's tokenizer routes (lm-evaluation-harness's remote tokenizer).
  server.Post("/tokenize",
              [this](const httplib::Request& req, httplib::Response& res) {
                Tokenize(req, res);
              });
  server.Post("/detokenize",
              [this](const httplib::Request& req, httplib::Response& res) {
                Detokenize(req, res);
              });
  server.Get("/tokenizer_info",
             [this](const httplib::Request&, httplib::Response& res) {
               // Control tokens have no text here, so their strings are
               // null; their ids are given.
               json info{{"tokenizer_class", "infinigen"},
                         {"model_max_length", scheduler_->max_seq_len()},
                         {"vocab_size", tokenizer_->vocab_size()},
                         {"add_bos_token", tokenizer_->adds_bos()},
                         {"bos_token", nullptr},
                         {"eos_token", nullptr},
                         {"pad_token", nullptr},
                         {"bos_token_id", IdOrNull(tokenizer_->bos_id())},
                         {"eos_token_id", IdOrNull(tokenizer_->eos_id())}};
               res.set_content(info.dump(), "application/json");
             });
  server.Post("/v1/completions",
              [this](const httplib::Request& req, httplib::Response& res) {
                Complete(req, res, /*chat=*/false);
              });
  server.Post("/v1/chat/completions",
              [this](const httplib::Request& req, httplib::Response& res) {
                Complete(req, res, /*chat=*/true);
              });
}

httplib::Server::HandlerResponse HttpApiHandlers::Authorize(
    const httplib::Request& req, httplib::Response& res) {
  if (options_.api_key.empty() || req.path == "/health" ||
      (req.path == "/metrics" && options_.metrics)) {
    return httplib::Server::HandlerResponse::Unhandled;
  }
  const std::string header = req.get_header_value("Authorization");
  const absl::string_view presented(header);
  const absl::Status status = CheckApiKey(&presented, options_.api_key);
  if (status.ok()) return httplib::Server::HandlerResponse::Unhandled;
  SetError(res, ApiError{401, std::string(status.message()),
                         "authentication_error", "", "invalid_api_key"});
  return httplib::Server::HandlerResponse::Handled;
}

void HttpApiHandlers::Tokenize(const httplib::Request& req,
                               httplib::Response& res) const {
  const json body = json::parse(req.body, nullptr, false);
  if (!body.is_object()) {
    SetError(res, ApiError{400, "the request body must be a JSON object"});
    return;
  }
  auto it = body.find("prompt");
  if (it == body.end() || !it->is_string()) {
    SetError(res, openai::BadParam("prompt", "'prompt' must be a string"));
    return;
  }
  bool special = true;
  if (auto s = body.find("add_special_tokens"); s != body.end()) {
    if (!s->is_boolean()) {
      SetError(res, openai::BadParam("add_special_tokens",
                                     "'add_special_tokens' must be true or "
                                     "false"));
      return;
    }
    special = s->get<bool>();
  }
  const std::vector<int> tokens =
      tokenizer_->Encode(it->get<std::string>(), special);
  res.set_content(json{{"tokens", tokens},
                       {"count", tokens.size()},
                       {"max_model_len", scheduler_->max_seq_len()}}
                      .dump(),
                  "application/json");
}

void HttpApiHandlers::Detokenize(const httplib::Request& req,
                                 httplib::Response& res) const {
  const json body = json::parse(req.body, nullptr, false);
  auto it = body.is_object() ? body.find("tokens") : body.end();
  if (it == body.end() || !it->is_array()) {
    SetError(res, openai::BadParam("tokens",
                                   "'tokens' must be an array of token ids"));
    return;
  }
  std::vector<int> tokens;
  for (const json& t : *it) {
    if (!t.is_number_integer() || t.get<int64_t>() < 0 ||
        t.get<int64_t>() >= tokenizer_->vocab_size()) {
      SetError(res, openai::BadParam(
                        "tokens", absl::StrCat("'tokens' must hold ids in [0, ",
                                               tokenizer_->vocab_size(), ")")));
      return;
    }
    tokens.push_back(t.get<int>());
  }
  res.set_content(json{{"prompt", Utf8(tokenizer_->Decode(tokens))}}.dump(),
                  "application/json");
}

json HttpApiHandlers::ModelJson() const {
  return json{{"id", options_.model_id},
              {"object", "model"},
              {"created", created_},
              {"owned_by", "infinigen"},
              {"max_model_len", scheduler_->max_seq_len()}};
}

}  // namespace http_api_internal

using http_api_internal::ConnectionThreads;
using http_api_internal::HttpApiHandlers;

absl::StatusOr<std::unique_ptr<HttpApiServer>> HttpApiServer::Start(
    GenerationScheduler* scheduler, const model::Tokenizer* tokenizer,
    HttpApiOptions options) {
  auto address = ParseHostPort(options.listen, "HTTP listen");
  if (!address.ok()) return address.status();
  const std::string listen = options.listen;
  const std::string& host = address->host;
  int port = address->port;
  std::unique_ptr<HttpApiServer> s(new HttpApiServer());
  IG_RETURN_IF_ERROR(CheckServerTls(options.tls));
  if (options.tls.enabled()) {
    const ServerTlsPem& tls = options.tls;
    absl::Status loaded;
    auto https = std::make_unique<httplib::SSLServer>([&](SSL_CTX& ctx) {
      loaded = LoadServerTls(tls, &ctx);
      return loaded.ok();
    });
    if (!https->is_valid()) {
      return loaded.ok() ? absl::InternalError("HTTPS: no SSL context")
                         : loaded;
    }
    s->server_ = std::move(https);
  } else {
    s->server_ = std::make_unique<httplib::Server>();
  }
  const int limit = std::max(options.max_connections, 2);
  s->server_->new_task_queue = [limit] {
    return new ConnectionThreads(limit);
  };
  // Idle and slow peers are bounded: a connection waits at most this long
  // for its next request or the next piece of one.
  s->server_->set_keep_alive_timeout(5);
  s->server_->set_read_timeout(10, 0);
  auto api = std::make_shared<HttpApiHandlers>(scheduler, tokenizer,
                                               std::move(options));
  api->Install(*s->server_);
  if (port == 0) {
    port = s->server_->bind_to_any_port(host);
  } else if (!s->server_->bind_to_port(host, port)) {
    port = -1;
  }
  if (port <= 0) {
    const std::string why = WhyNotListening(listen);
    return absl::UnavailableError(absl::StrCat(
        "cannot listen for HTTP on ", listen, ": ",
        why.empty() ? "the address is taken or not allowed" : why));
  }
  s->port_ = port;
  // `api` lives as long as the handlers that captured its pointer: the
  // thread holds it until listen_after_bind returns.
  s->thread_ = std::thread([server = s->server_.get(), api] {
    server->listen_after_bind();
  });
  return s;
}

void HttpApiServer::Stop() {
  if (server_ != nullptr) server_->stop();
  if (thread_.joinable()) thread_.join();
}

HttpApiServer::~HttpApiServer() { Stop(); }

}  // namespace infinigen::gpu_worker
