#include "gpu_worker/serving/http_api.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <limits>
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

// A token of the answer with its log-probability; `prompt`: a prompt token
// (echo), the first of which has no score (logprob.token set, top empty,
// logprob NaN).
struct ScoredToken {
  TokenLogProb logprob;
  bool prompt = false;
};

// Valid UTF-8 (a byte token's lone byte becomes U+FFFD), for JSON.
std::string Utf8(std::string_view bytes) {
  Utf8Assembler a;
  std::string out = a.Add(bytes);
  return out + a.Flush();
}

json Bytes(absl::string_view piece) {
  json out = json::array();
  for (unsigned char c : piece) out.push_back(static_cast<int>(c));
  return out;
}

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
  json Build(const std::vector<ScoredToken>& scored, size_t begin,
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

 private:
  // A token's text after `prev`; the first generated token follows the
  // prompt's last.
  std::string Piece(int prev, int token) const {
    if (prev < 0 && !p_.prompt_tokens.empty() &&
        !(p_.echo && p_.logprobs >= 0)) {
      prev = p_.prompt_tokens.back();
    }
    if (tokenizer_.IsControl(token)) return "";
    return tokenizer_.DecodeToken(prev, token);
  }

  const CompletionParams& p_;
  const model::Tokenizer& tokenizer_;
  int prev_ = -1;
  size_t text_offset_ = 0;
  size_t completion_offset_ = 0;
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

  static json IdOrNull(int id) { return id < 0 ? json(nullptr) : json(id); }

  // {"prompt": text, "add_special_tokens": true} -> {"tokens", "count",
  // "max_model_len"}: add_special_tokens puts BOS first where the model's
  // text starts with one.
  void Tokenize(const httplib::Request& req, httplib::Response& res) const {
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

  // {"tokens": [ids]} -> {"prompt": their text}.
  void Detokenize(const httplib::Request& req, httplib::Response& res) const {
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
              const std::string& finish, bool delta, bool first,
              json logprobs = nullptr) const {
    json choice{{"index", 0},
                {"finish_reason",
                 finish.empty() ? json(nullptr) : json(finish)},
                {"logprobs", std::move(logprobs)}};
    if (!p.chat) {
      choice["text"] = text;
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
    explicit Progress(const CompletionParams& p) : matcher(p.stop) {
      if (p.echo && p.logprobs >= 0) {  // the prompt's first token: no score
        TokenLogProb first;
        first.token = p.prompt_tokens.front();
        first.logprob = std::numeric_limits<float>::quiet_NaN();
        scored.push_back({std::move(first), /*prompt=*/true});
      }
    }
    StopMatcher matcher;
    int completion_tokens = 0;
    int cached_tokens = 0;  // prompt tokens whose KV was reused
    std::string finish;  // set once the generation ended
    absl::Status error;  // the stream's kError
    // With logprobs: the tokens scored so far, prompt tokens first when
    // echoed (the first prompt token unscored), in order; `sent` of them
    // are in chunks already (streaming).
    std::vector<ScoredToken> scored;
    size_t sent = 0;
  };

  // Waits for the stream's next event and returns the text it frees to
  // send. Sets progress->finish when the generation is over (cancelling the
  // stream when a stop sequence ended it).
  static std::string Step(GenerationStream& stream, Progress* progress) {
    GenerationEvent ev;
    if (!stream.Next(absl::Milliseconds(100), &ev)) return "";
    for (TokenLogProb& lp : ev.prompt_logprobs) {
      progress->scored.push_back({std::move(lp), /*prompt=*/true});
    }
    if (ev.logprob.has_value()) {
      progress->scored.push_back({*std::move(ev.logprob), /*prompt=*/false});
    }
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
    request.frequency_penalty = params->frequency_penalty;
    request.presence_penalty = params->presence_penalty;
    request.logprobs = params->logprobs;
    request.prompt_logprobs = params->echo && params->logprobs >= 0;
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

  // The prompt an echo repeats: as given, or its tokens' text.
  std::string EchoText(const CompletionParams& p) const {
    return p.prompt_text.empty() ? tokenizer_->Decode(p.prompt_tokens)
                                 : p.prompt_text;
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
    Progress progress(p);
    std::string text;
    while (progress.finish.empty()) text += Step(stream, &progress);
    if (!progress.error.ok()) {
      SetError(res, FromStatus(progress.error));
      return;
    }
    json logprobs = nullptr;
    if (p.logprobs >= 0) {
      LogprobsJson builder(p, *tokenizer_);
      // A stop sequence cut the text: the tokens that begin after the
      // cut are not part of the answer.
      logprobs = builder.Build(
          progress.scored, 0, progress.scored.size(),
          progress.matcher.stopped() ? text.size() : std::string::npos);
    }
    if (p.echo) text = EchoText(p) + text;
    json out = Envelope(p, a.id, a.created, /*chunk=*/false);
    out["choices"] = json::array({Choice(p, text, progress.finish,
                                         /*delta=*/false, false,
                                         std::move(logprobs))});
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
    Progress progress(p);
    LogprobsJson builder(p, *tokenizer_);
    bool first = true;
    while (progress.finish.empty()) {
      std::string text = Step(s, &progress);
      if (!progress.error.ok()) break;
      const bool new_scores = progress.sent < progress.scored.size();
      if (text.empty() && !first && !new_scores) {
        if (!sink.is_writable()) {  // the client went away
          s.Cancel();
          return false;
        }
        continue;
      }
      if (first && p.echo) text = EchoText(p) + text;
      json logprobs = nullptr;
      if (p.logprobs >= 0) {
        logprobs = builder.Build(progress.scored, progress.sent,
                                 progress.scored.size(), std::string::npos);
        progress.sent = progress.scored.size();
      }
      json chunk = Envelope(p, a.id, a.created, /*chunk=*/true);
      chunk["choices"] = json::array(
          {Choice(p, text, "", /*delta=*/true, first, std::move(logprobs))});
      first = false;
      if (!send(chunk)) {
        s.Cancel();
        return false;
      }
    }
    if (!progress.error.ok()) {
      send(ErrorBody(FromStatus(progress.error)));
    } else {
      json logprobs = nullptr;
      if (p.logprobs >= 0 && progress.sent < progress.scored.size()) {
        // The end token's, or the last token's when it ended the stream.
        logprobs = builder.Build(progress.scored, progress.sent,
                                 progress.scored.size(), std::string::npos);
      }
      json chunk = Envelope(p, a.id, a.created, /*chunk=*/true);
      chunk["choices"] =
          json::array({Choice(p, "", progress.finish, /*delta=*/true, false,
                              std::move(logprobs))});
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
