// HttpApiHandlers' completions (http_api_internal.h): a request submitted
// to the scheduler, then answered whole or as server-sent events, with its
// stop sequences, log-probabilities and usage.
#include "gpu_worker/serving/http_api_internal.h"

#include <atomic>
#include <cstdint>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"

namespace infinigen::gpu_worker::http_api_internal {

using json = nlohmann::json;
using openai::ApiError;
using openai::CompletionParams;
using openai::ErrorBody;
using openai::FromStatus;
using openai::LogprobsJson;

namespace {

std::string RandomId(absl::string_view prefix) {
  static std::atomic<uint64_t> counter{0};
  static const uint64_t base = std::random_device{}();
  return absl::StrCat(prefix, absl::Hex(base, absl::kZeroPad8),
                      absl::Hex(counter.fetch_add(1), absl::kZeroPad8));
}

}  // namespace

json HttpApiHandlers::Choice(const CompletionParams& p,
                             const std::string& text,
                             const std::string& finish, bool delta,
                             bool first, json logprobs) const {
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

json HttpApiHandlers::Envelope(const CompletionParams& p,
                               const std::string& id, int64_t created,
                               bool chunk) const {
  return json{{"id", id},
              {"object", p.chat ? (chunk ? "chat.completion.chunk"
                                         : "chat.completion")
                                : "text_completion"},
              {"created", created},
              {"model", options_.model_id}};
}

json HttpApiHandlers::Usage(int prompt, int completion, int cached) {
  return json{{"prompt_tokens", prompt},
              {"completion_tokens", completion},
              {"total_tokens", prompt + completion},
              {"prompt_tokens_details", {{"cached_tokens", cached}}}};
}

HttpApiHandlers::Progress::Progress(const CompletionParams& p)
    : matcher(p.stop) {
  if (p.echo && p.logprobs >= 0) {  // the prompt's first token: no score
    TokenLogProb first;
    first.token = p.prompt_tokens.front();
    first.logprob = std::numeric_limits<float>::quiet_NaN();
    scored.push_back({std::move(first), /*prompt=*/true});
  }
}

std::string HttpApiHandlers::Step(GenerationStream& stream,
                                  Progress* progress) {
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

void HttpApiHandlers::Complete(const httplib::Request& req,
                               httplib::Response& res, bool chat) {
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

std::string HttpApiHandlers::EchoText(const CompletionParams& p) const {
  return p.prompt_text.empty() ? tokenizer_->Decode(p.prompt_tokens)
                               : p.prompt_text;
}

void HttpApiHandlers::AnswerWhole(GenerationStream& stream, const Answer& a,
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

bool HttpApiHandlers::WriteEvents(GenerationStream& s, const Answer& a,
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

}  // namespace infinigen::gpu_worker::http_api_internal
