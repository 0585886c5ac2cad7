#include "gpu_worker/serving/http_api.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <thread>
#include <optional>
#include <random>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/api_key.h"
#include "common/address.h"
#include "common/status.h"
#include "gpu_worker/serving/openai_request.h"
#include "httplib.h"
#include "openssl/ssl.h"
#include "nlohmann/json.hpp"

namespace infinigen::gpu_worker {

using json = nlohmann::json;
using openai::ApiError;
using openai::CompletionParams;
using openai::ErrorBody;
using openai::FromStatus;

namespace {

void SetError(httplib::Response& res, const ApiError& e) {
  res.status = e.status;
  res.set_content(ErrorBody(e).dump(), "application/json");
}

std::string RandomId(absl::string_view prefix) {
  static std::atomic<uint64_t> counter{0};
  static const uint64_t base = std::random_device{}();
  return absl::StrCat(prefix, absl::Hex(base, absl::kZeroPad8),
                      absl::Hex(counter.fetch_add(1), absl::kZeroPad8));
}

int64_t UnixNow() { return absl::ToUnixSeconds(absl::Now()); }

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

// Sends a generation's text minus its stop sequences: text that could be the
// start of a stop sequence is held back until it cannot.
class StopMatcher {
 public:
  explicit StopMatcher(const std::vector<std::string>& stop) : stop_(stop) {}

  // The text now safe to send after `piece`; sets stopped() when a stop
  // sequence appeared (the returned text then ends just before it).
  std::string Add(absl::string_view piece) {
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
  // What was held back (the generation ended without a stop sequence).
  std::string Flush() { return std::exchange(pending_, ""); }
  bool stopped() const { return stopped_; }

 private:
  const std::vector<std::string> stop_;
  std::string pending_;
  bool stopped_ = false;
};

class Api {
 public:
  Api(GenerationScheduler* scheduler, const model::Tokenizer* tokenizer,
      HttpApiOptions options)
      : scheduler_(scheduler),
        tokenizer_(tokenizer),
        options_(std::move(options)),
        created_(UnixNow()) {}

  void Install(httplib::Server& server) {
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
    server.Post("/v1/completions",
                [this](const httplib::Request& req, httplib::Response& res) {
                  Complete(req, res, /*chat=*/false);
                });
    server.Post("/v1/chat/completions",
                [this](const httplib::Request& req, httplib::Response& res) {
                  Complete(req, res, /*chat=*/true);
                });
  }

 private:
  httplib::Server::HandlerResponse Authorize(const httplib::Request& req,
                                             httplib::Response& res) {
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

  json ModelJson() const {
    return json{{"id", options_.model_id},
                {"object", "model"},
                {"created", created_},
                {"owned_by", "infinigen"},
                {"max_model_len", scheduler_->max_seq_len()}};
  }

  // One completion's chunk or whole answer. `text` and `finish` (may be
  // empty: null) fill the one choice.
  json Choice(const CompletionParams& p, const std::string& text,
              const std::string& finish, bool delta, bool first) const {
    json choice{{"index", 0},
                {"finish_reason",
                 finish.empty() ? json(nullptr) : json(finish)}};
    if (!p.chat) {
      choice["text"] = text;
      choice["logprobs"] = nullptr;
    } else if (!delta) {
      choice["message"] = {{"role", "assistant"}, {"content", text}};
    } else {
      json d = json::object();
      if (first) d["role"] = "assistant";
      if (!text.empty() || first) d["content"] = text;
      choice["delta"] = d;
    }
    return choice;
  }

  json Envelope(const CompletionParams& p, const std::string& id,
                int64_t created, bool chunk) const {
    return json{{"id", id},
                {"object", p.chat ? (chunk ? "chat.completion.chunk"
                                           : "chat.completion")
                                  : "text_completion"},
                {"created", created},
                {"model", options_.model_id}};
  }

  static json Usage(int prompt, int completion, int cached) {
    return json{{"prompt_tokens", prompt},
                {"completion_tokens", completion},
                {"total_tokens", prompt + completion},
                {"prompt_tokens_details", {{"cached_tokens", cached}}}};
  }

  // The generation's progress as the handlers see it.
  struct Progress {
    explicit Progress(const std::vector<std::string>& stop) : matcher(stop) {}
    StopMatcher matcher;
    int completion_tokens = 0;
    int cached_tokens = 0;  // prompt tokens whose KV was reused
    std::string finish;  // set once the generation ended
    absl::Status error;  // the stream's kError
  };

  // Waits for the stream's next event and returns the text it frees to
  // send. Sets progress->finish when the generation is over (cancelling the
  // stream when a stop sequence ended it).
  static std::string Step(GenerationStream& stream, Progress* progress) {
    GenerationEvent ev;
    if (!stream.Next(absl::Milliseconds(100), &ev)) return "";
    switch (ev.kind) {
      case GenerationEvent::Kind::kToken: {
        ++progress->completion_tokens;
        progress->cached_tokens = ev.cached_tokens;
        std::string out = progress->matcher.Add(ev.text);
        if (progress->matcher.stopped()) {
          stream.Cancel();
          progress->finish = "stop";
        }
        return out;
      }
      case GenerationEvent::Kind::kFinished: {
        progress->cached_tokens = ev.summary.cached_tokens;
        std::string out = progress->matcher.Add(ev.summary.text);
        if (progress->matcher.stopped()) {
          progress->finish = "stop";
          return out;
        }
        out += progress->matcher.Flush();
        progress->finish =
            ev.summary.reason == FinishReason::kEndToken ? "stop" : "length";
        return out;
      }
      case GenerationEvent::Kind::kError:
        progress->error = ev.status;
        progress->finish = "error";
        return progress->matcher.Flush();
    }
    return "";
  }

  void Complete(const httplib::Request& req, httplib::Response& res,
                bool chat) {
    json body = json::parse(req.body, nullptr, /*allow_exceptions=*/false);
    if (body.is_discarded()) {
      SetError(res, ApiError{400, "the request body is not valid JSON"});
      return;
    }
    auto params = std::make_shared<CompletionParams>();
    const openai::RequestContext context{
        options_.model_id, &options_.chat_template, tokenizer_,
        scheduler_->max_new_tokens_limit()};
    if (auto e = openai::ParseCompletionRequest(body, chat, context,
                                                params.get())) {
      SetError(res, *e);
      return;
    }
    GenerationRequest request;
    request.prompt_tokens = params->prompt_tokens;
    request.max_new_tokens = params->max_tokens;
    request.temperature = params->temperature;
    request.top_p = params->top_p;
    request.seed = params->seed;
    auto stream = scheduler_->Submit(request);
    if (!stream.ok()) {
      SetError(res, FromStatus(stream.status()));
      return;
    }
    Answer answer{params, RandomId(chat ? "chatcmpl-" : "cmpl-"), UnixNow()};
    if (!params->stream) {
      AnswerWhole(**stream, answer, res);
      return;
    }
    std::shared_ptr<GenerationStream> s = *stream;
    res.set_header("Cache-Control", "no-cache");
    res.set_chunked_content_provider(
        "text/event-stream",
        [this, s, answer](size_t, httplib::DataSink& sink) {
          return WriteEvents(*s, answer, sink);
        },
        [s](bool success) {
          if (!success) s->Cancel();
        });
  }

  // What every part of one answer carries.
  struct Answer {
    std::shared_ptr<const CompletionParams> params;
    std::string id;
    int64_t created = 0;
    int prompt_tokens() const {
      return static_cast<int>(params->prompt_tokens.size());
    }
  };

  // A non-streaming answer: the whole completion in one JSON body.
  void AnswerWhole(GenerationStream& stream, const Answer& a,
                   httplib::Response& res) {
    const CompletionParams& p = *a.params;
    Progress progress(p.stop);
    std::string text;
    while (progress.finish.empty()) text += Step(stream, &progress);
    if (!progress.error.ok()) {
      SetError(res, FromStatus(progress.error));
      return;
    }
    json out = Envelope(p, a.id, a.created, /*chunk=*/false);
    out["choices"] = json::array(
        {Choice(p, text, progress.finish, /*delta=*/false, false)});
    out["usage"] = Usage(a.prompt_tokens(), progress.completion_tokens,
                         progress.cached_tokens);
    res.set_content(out.dump(), "application/json");
  }

  // A streaming answer as server-sent events: a chunk per piece of text,
  // the finish reason, usage when asked, then [DONE]. False (the stream
  // cancelled) when the client goes away.
  bool WriteEvents(GenerationStream& s, const Answer& a,
                   httplib::DataSink& sink) {
    const CompletionParams& p = *a.params;
    auto send = [&sink](const json& j) {
      const std::string event = absl::StrCat("data: ", j.dump(), "\n\n");
      return sink.write(event.data(), event.size());
    };
    Progress progress(p.stop);
    bool first = true;
    while (progress.finish.empty()) {
      const std::string text = Step(s, &progress);
      if (!progress.error.ok()) break;
      if (text.empty() && !first) {
        if (!sink.is_writable()) {  // the client went away
          s.Cancel();
          return false;
        }
        continue;
      }
      json chunk = Envelope(p, a.id, a.created, /*chunk=*/true);
      chunk["choices"] =
          json::array({Choice(p, text, "", /*delta=*/true, first)});
      first = false;
      if (!send(chunk)) {
        s.Cancel();
        return false;
      }
    }
    if (!progress.error.ok()) {
      send(ErrorBody(FromStatus(progress.error)));
    } else {
      json chunk = Envelope(p, a.id, a.created, /*chunk=*/true);
      chunk["choices"] = json::array(
          {Choice(p, "", progress.finish, /*delta=*/true, false)});
      send(chunk);
      if (p.include_usage) {
        json usage = Envelope(p, a.id, a.created, /*chunk=*/true);
        usage["choices"] = json::array();
        usage["usage"] = Usage(a.prompt_tokens(), progress.completion_tokens,
                               progress.cached_tokens);
        send(usage);
      }
    }
    constexpr absl::string_view kDone = "data: [DONE]\n\n";
    sink.write(kDone.data(), kDone.size());
    sink.done();
    return true;
  }

  GenerationScheduler* const scheduler_;
  const model::Tokenizer* const tokenizer_;
  const HttpApiOptions options_;
  const int64_t created_;
};

}  // namespace

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
  auto api = std::make_shared<Api>(scheduler, tokenizer, std::move(options));
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
