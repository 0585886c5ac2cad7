#include "gpu_worker/serving/generation_scheduler.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/log.h"
#include "common/status.h"
#include "common/utf8.h"

namespace infinigen::gpu_worker {
namespace {

// The engine's (or memory node's) error, same code, saying where.
absl::Status EngineError(const char* stage, const absl::Status& status) {
  return absl::Status(status.code(), absl::StrCat("generation failed in the ",
                                                  stage, ": ",
                                                  status.message()));
}

double Seconds(absl::Time from, absl::Time to) {
  return from == absl::InfinitePast() || to < from
             ? 0.0
             : absl::ToDoubleSeconds(to - from);
}

}  // namespace

const char* FinishReasonName(FinishReason reason) {
  switch (reason) {
    case FinishReason::kLength:
      return "length";
    case FinishReason::kEndToken:
      return "end_token";
    case FinishReason::kContextFull:
      return "context_full";
  }
  return "unknown";
}

std::string Utf8Assembler::Add(std::string_view bytes) {
  held_.append(bytes.data(), bytes.size());
  const auto* s = reinterpret_cast<const unsigned char*>(held_.data());
  const size_t n = held_.size();
  std::string out;
  size_t i = 0;
  while (i < n) {
    const int len = utf8::SequenceLength(s[i]);
    if (len > 0 && i + len > n) {
      // An unfinished character: keep it for the next piece unless what
      // is there already cannot continue it.
      bool can_continue = true;
      for (size_t j = i + 1; j < n; ++j) {
        can_continue &= utf8::IsContinuation(s[j]);
      }
      if (can_continue) break;
    }
    if (len > 0 && i + len <= n && utf8::WellFormed(held_, i, len)) {
      out.append(held_, i, len);
      i += len;
    } else {
      out += utf8::kReplacement;
      ++i;
    }
  }
  held_.erase(0, i);
  return out;
}

std::string Utf8Assembler::Flush() {
  std::string out = held_.empty() ? "" : utf8::kReplacement;
  held_.clear();
  return out;
}

bool GenerationStream::Next(absl::Duration timeout, GenerationEvent* event) {
  absl::MutexLock lock(&mu_);
  auto ready = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    return !events_.empty();
  };
  if (!mu_.AwaitWithTimeout(absl::Condition(&ready), timeout)) return false;
  *event = std::move(events_.front());
  events_.pop_front();
  return true;
}

void GenerationStream::Push(GenerationEvent event) {
  absl::MutexLock lock(&mu_);
  events_.push_back(std::move(event));
}

absl::StatusOr<std::unique_ptr<GenerationScheduler>> GenerationScheduler::Create(
    std::unique_ptr<Engine> engine, const model::Tokenizer& tokenizer,
    const GenerationSchedulerOptions& options) {
  if (engine == nullptr) {
    return absl::InvalidArgumentError("generation scheduler: no engine");
  }
  if (options.max_prefills_per_step < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "generation scheduler: max_prefills_per_step must be >= 0, got ",
        options.max_prefills_per_step));
  }
  if (options.max_queue < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "generation scheduler: max_queue must be at least 1, got ",
        options.max_queue));
  }
  if (options.max_new_tokens_limit < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "generation scheduler: max_new_tokens_limit must not be negative, "
        "got ",
        options.max_new_tokens_limit));
  }
  if (tokenizer.vocab_size() > engine->config().vocab_size) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "generation scheduler: the tokenizer's %d tokens exceed the model's "
        "vocabulary of %d",
        tokenizer.vocab_size(), engine->config().vocab_size));
  }
  return std::unique_ptr<GenerationScheduler>(
      new GenerationScheduler(std::move(engine), tokenizer, options));
}

GenerationScheduler::GenerationScheduler(
    std::unique_ptr<Engine> engine, const model::Tokenizer& tokenizer,
    const GenerationSchedulerOptions& options)
    : engine_(std::move(engine)),
      tokenizer_(tokenizer),
      options_(options),
      max_new_tokens_limit_(options.max_new_tokens_limit > 0
                                ? options.max_new_tokens_limit
                                : engine_->max_seq_len()) {
  // Lowest slot first.
  for (int slot = engine_->batch() - 1; slot >= 0; --slot) {
    free_slots_.push_back(slot);
  }
  step_slots_.reserve(engine_->batch());
  step_tokens_.reserve(engine_->batch());
}

GenerationScheduler::~GenerationScheduler() {
  Shutdown(absl::ZeroDuration());
}

void GenerationScheduler::Start() {
  absl::MutexLock shutdown_lock(&shutdown_mu_);
  {
    absl::MutexLock lock(&mu_);
    if (started_ || stopping_) return;
    started_ = true;
  }
  thread_ = std::thread([this] { Loop(); });
}

absl::StatusOr<std::unique_ptr<GenerationScheduler::Sequence>>
GenerationScheduler::NewSequence(const GenerationRequest& r) const {
  const int vocab = engine_->config().vocab_size;
  const int context = engine_->max_seq_len();
  if (!r.prompt.empty() && !r.prompt_tokens.empty()) {
    return absl::InvalidArgumentError(
        "give either prompt or prompt_tokens, not both");
  }
  if (r.prompt.empty() && r.prompt_tokens.empty()) {
    return absl::InvalidArgumentError(
        "empty prompt: set prompt (text) or prompt_tokens");
  }
  if (r.max_new_tokens < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_new_tokens must be at least 1, got ", r.max_new_tokens));
  }
  if (r.max_new_tokens > max_new_tokens_limit_) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_new_tokens ", r.max_new_tokens,
                     " exceeds this server's limit of ", max_new_tokens_limit_));
  }
  if (!(r.temperature >= 0.0f)) {  // NaN too
    return absl::InvalidArgumentError(
        absl::StrCat("temperature must be >= 0, got ", r.temperature));
  }
  if (!(r.top_p > 0.0f && r.top_p <= 1.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("top_p must be in (0, 1], got ", r.top_p));
  }
  for (const auto& [name, value] :
       {std::pair{"frequency_penalty", r.frequency_penalty},
        std::pair{"presence_penalty", r.presence_penalty}}) {
    if (!(value >= -2.0f && value <= 2.0f)) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, " must be in [-2, 2], got ", value));
    }
  }
  if (r.logprobs < -1 || r.logprobs > kMaxTopLogprobs) {
    return absl::InvalidArgumentError(
        absl::StrCat("top logprobs must be in [0, ", kMaxTopLogprobs,
                     "], got ", r.logprobs));
  }
  if (r.prompt_logprobs && r.logprobs < 0) {
    return absl::InvalidArgumentError(
        "prompt log-probabilities need logprobs >= 0");
  }
  std::vector<int> prompt;
  if (!r.prompt.empty()) {
    prompt = tokenizer_.Encode(r.prompt, /*add_bos=*/true);
    if (prompt.empty()) {
      return absl::InvalidArgumentError(
          "the prompt encodes to no tokens and the model has no BOS");
    }
  } else {
    for (size_t i = 0; i < r.prompt_tokens.size(); ++i) {
      const int t = r.prompt_tokens[i];
      if (t < 0 || t >= vocab) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "prompt_tokens[%d] = %d is outside the vocabulary [0, %d)", i, t,
            vocab));
      }
    }
    prompt = r.prompt_tokens;
  }
  if (static_cast<int>(prompt.size()) >= context) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "the prompt has %d tokens; the context holds %d, which must leave "
        "room for at least one generated token",
        prompt.size(), context));
  }
  IG_ASSIGN_OR_RETURN(Sampler sampler,
                      Sampler::Create({r.temperature, r.top_p, r.seed}));
  auto seq = std::make_unique<Sequence>(
      std::move(sampler), Penalties(r.frequency_penalty, r.presence_penalty));
  seq->logprobs = r.logprobs;
  seq->prompt_logprobs = r.prompt_logprobs;
  seq->stream = std::make_shared<GenerationStream>();
  seq->prompt = std::move(prompt);
  seq->prev = seq->prompt.back();
  seq->max_new_tokens = r.max_new_tokens;
  seq->arrived = absl::Now();
  seq->prefill_start = seq->first_token = seq->last_token =
      absl::InfinitePast();
  return seq;
}

absl::StatusOr<std::shared_ptr<GenerationStream>> GenerationScheduler::Submit(
    const GenerationRequest& request) {
  absl::StatusOr<std::shared_ptr<GenerationStream>> stream = Enqueue(request);
  absl::MutexLock lock(&mu_);
  ++(stream.ok() ? stats_.accepted : stats_.rejected);
  return stream;
}

absl::StatusOr<std::shared_ptr<GenerationStream>> GenerationScheduler::Enqueue(
    const GenerationRequest& request) {
  const absl::Status stopping =
      absl::UnavailableError("server shutting down: not taking requests");
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return stopping;
  }
  bool hold = false;
  IG_RETURN_IF_ERROR(KvGate(&hold));
  IG_ASSIGN_OR_RETURN(std::unique_ptr<Sequence> seq, NewSequence(request));
  absl::MutexLock lock(&mu_);
  if (stopping_) return stopping;
  if (static_cast<int>(queue_.size()) >= options_.max_queue) {
    // Requests whose clients left still hold a place; drop them first.
    const size_t before = queue_.size();
    queue_.erase(std::remove_if(queue_.begin(), queue_.end(),
                                [](const std::unique_ptr<Sequence>& s) {
                                  return s->stream->cancelled();
                                }),
                 queue_.end());
    stats_.cancelled += static_cast<long>(before - queue_.size());
  }
  if (static_cast<int>(queue_.size()) >= options_.max_queue) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "queue full: %d requests are already waiting for one of %d sequence "
        "slots; retry later",
        queue_.size(), engine_->batch()));
  }
  std::shared_ptr<GenerationStream> stream = seq->stream;
  queue_.push_back(std::move(seq));
  idle_ = false;
  return stream;
}

void GenerationScheduler::Shutdown(absl::Duration grace) {
  absl::MutexLock shutdown_lock(&shutdown_mu_);
  bool started;
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    started = started_;
    if (started) {
      mu_.AwaitWithTimeout(absl::Condition(&idle_), grace);
      abort_ = true;
    }
  }
  if (!started) {
    AbortAll(absl::UnavailableError(
        "server shutting down before the request was served"));
    return;
  }
  if (thread_.joinable()) thread_.join();
}

void GenerationScheduler::NoteEngineStats() {
  const long recoveries = static_cast<long>(engine_->kv_recoveries());
  int64_t row_cache_bytes = 0;
  for (int slot = 0; slot < engine_->batch(); ++slot) {
    row_cache_bytes += engine_->fetch_stats(slot).row_cache_bytes;
  }
  absl::MutexLock lock(&mu_);
  stats_.kv_recoveries = recoveries;
  stats_.row_cache_bytes = row_cache_bytes;
}

SchedulerStats GenerationScheduler::stats() const {
  absl::MutexLock lock(&mu_);
  SchedulerStats s = stats_;
  s.queued = static_cast<int>(queue_.size());
  s.prompt_tokens = prompt_tokens_.load(std::memory_order_relaxed);
  s.generated_tokens = generated_tokens_.load(std::memory_order_relaxed);
  return s;
}

void GenerationScheduler::NoteKvDownSince(absl::Time start) {
  if (!options_.kv_health || options_.kv_health().ok()) return;
  // The call that failed on the node already waited for it since `start`.
  absl::MutexLock lock(&mu_);
  kv_down_since_ = std::min(kv_down_since_, start);
}

absl::Status GenerationScheduler::KvGate(bool* hold) {
  *hold = false;
  if (!options_.kv_health) return absl::OkStatus();
  const absl::Status health = options_.kv_health();
  const absl::Time now = absl::Now();
  absl::MutexLock lock(&mu_);
  if (health.ok()) {
    kv_down_since_ = absl::InfiniteFuture();
    return health;
  }
  if (kv_down_since_ == absl::InfiniteFuture()) kv_down_since_ = now;
  if (now - kv_down_since_ < options_.kv_down_wait) {
    *hold = true;
    return absl::OkStatus();
  }
  return absl::UnavailableError(absl::StrCat(
      "not taking requests: ", health.message(), " (down for ",
      absl::FormatDuration(absl::Trunc(now - kv_down_since_,
                                       absl::Milliseconds(100))),
      ")"));
}

void GenerationScheduler::Loop() {
  std::vector<std::unique_ptr<Sequence>> admitted;
  while (true) {
    admitted.clear();
    // A node known to be down: the waiting requests wait for it a while
    // (hold), then fail together, not one timeout after another.
    bool hold = false;
    if (absl::Status down = KvGate(&hold); !down.ok()) {
      std::deque<std::unique_ptr<Sequence>> queued;
      {
        absl::MutexLock lock(&mu_);
        queued.swap(queue_);
      }
      if (!queued.empty()) {
        IG_LOG(WARNING) << "failing " << queued.size()
                        << " queued generations: " << down;
      }
      for (std::unique_ptr<Sequence>& seq : queued) {
        if (seq->stream->cancelled()) {
          Drop(*seq);
        } else {
          Fail(*seq, down);
        }
      }
    }
    {
      absl::MutexLock lock(&mu_);
      if (active_.empty()) {
        idle_ = queue_.empty();
        auto work = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
          return !queue_.empty() || abort_;
        };
        mu_.Await(absl::Condition(&work));
      }
      if (abort_) break;
      if (hold && active_.empty()) {
        // Nothing to step: look at the node again shortly.
        mu_.AwaitWithTimeout(absl::Condition(&abort_), absl::Milliseconds(20));
        if (abort_) break;
        continue;
      }
      const int limit = hold ? 0 : options_.max_prefills_per_step;
      while (!hold && !free_slots_.empty() && !queue_.empty() &&
             (limit == 0 || static_cast<int>(admitted.size()) < limit)) {
        std::unique_ptr<Sequence> seq = std::move(queue_.front());
        queue_.pop_front();
        if (seq->stream->cancelled()) {
          ++stats_.cancelled;
          continue;
        }
        seq->slot = free_slots_.back();
        free_slots_.pop_back();
        ++stats_.active;
        admitted.push_back(std::move(seq));
      }
      idle_ = false;
    }
    for (std::unique_ptr<Sequence>& seq : admitted) {
      active_.push_back(std::move(seq));
      Prefill(*active_.back());
    }
    for (std::unique_ptr<Sequence>& seq : active_) {
      if (!seq->done && seq->stream->cancelled()) Drop(*seq);
    }
    ReleaseDone();
    if (!active_.empty()) {
      DecodeStep();
      ReleaseDone();
    }
  }
  AbortAll(absl::UnavailableError(
      "server shutting down: generation cut short at the drain deadline"));
}

void GenerationScheduler::Prefill(Sequence& seq) {
  if (seq.stream->cancelled()) {
    Drop(seq);
    return;
  }
  seq.prefill_start = absl::Now();
  absl::StatusOr<absl::Span<const float>> logits;
  if (seq.prompt_logprobs) {
    // Row i scores prompt token i + 1; the last row is the first new
    // token's, scored by Advance.
    const int n = static_cast<int>(seq.prompt.size());
    seq.prompt_scores.clear();
    seq.prompt_scores.reserve(n - 1);
    logits = engine_->ForwardEachRow(
        seq.slot, seq.prompt, [&seq, n](int i, absl::Span<const float> row) {
          if (i + 1 < n) {
            seq.prompt_scores.push_back(
                ScoreToken(row, seq.prompt[i + 1], seq.logprobs));
          }
        });
  } else {
    logits = engine_->Forward(seq.slot, seq.prompt, /*all_logits=*/false);
  }
  NoteEngineStats();
  if (!logits.ok()) {
    NoteKvDownSince(seq.prefill_start);
    const absl::Status error = EngineError("prefill", logits.status());
    IG_LOG(WARNING) << "generation " << Where(seq) << ": " << error;
    Fail(seq, error);
    return;
  }
  seq.cached = engine_->cached_tokens(seq.slot);
  prompt_tokens_.fetch_add(static_cast<long>(seq.prompt.size()),
                           std::memory_order_relaxed);
  Advance(seq, *logits);
}

void GenerationScheduler::DecodeStep() {
  if (options_.before_decode_step) options_.before_decode_step();
  step_slots_.clear();
  step_tokens_.clear();
  for (const std::unique_ptr<Sequence>& seq : active_) {
    step_slots_.push_back(seq->slot);
    step_tokens_.push_back(seq->next);
  }
  const absl::Time step_start = absl::Now();
  absl::StatusOr<absl::Span<const float>> logits =
      engine_->DecodeBatch(step_slots_, step_tokens_);
  NoteEngineStats();
  if (!logits.ok()) {
    NoteKvDownSince(step_start);
    const absl::Status error = EngineError("decode step", logits.status());
    IG_LOG(WARNING) << active_.size() << " generations: " << error;
    for (std::unique_ptr<Sequence>& seq : active_) Fail(*seq, error);
    return;
  }
  const size_t vocab = engine_->config().vocab_size;
  for (size_t i = 0; i < active_.size(); ++i) {
    Advance(*active_[i], logits->subspan(i * vocab, vocab));
  }
}

void GenerationScheduler::Advance(Sequence& seq,
                                  absl::Span<const float> logits) {
  const int next = seq.sampler.Sample(seq.penalties.Apply(logits));
  seq.penalties.Add(next);
  seq.last_token = absl::Now();
  if (seq.first_token == absl::InfinitePast()) seq.first_token = seq.last_token;
  std::optional<TokenLogProb> scored;
  if (seq.logprobs >= 0) scored = ScoreToken(logits, next, seq.logprobs);
  if (next == engine_->config().eos_id || tokenizer_.IsControl(next)) {
    Finish(seq, FinishReason::kEndToken, std::move(scored));
    return;
  }
  GenerationEvent event;
  event.kind = GenerationEvent::Kind::kToken;
  event.token = next;
  event.text = seq.text.Add(tokenizer_.DecodeToken(seq.prev, next));
  event.cached_tokens = seq.cached;
  event.logprob = std::move(scored);
  event.prompt_logprobs = std::move(seq.prompt_scores);
  seq.prompt_scores.clear();
  seq.stream->Push(std::move(event));
  seq.prev = next;
  ++seq.generated;
  generated_tokens_.fetch_add(1, std::memory_order_relaxed);
  if (seq.generated >= seq.max_new_tokens) {
    Finish(seq, FinishReason::kLength);
  } else if (engine_->position(seq.slot) >= engine_->max_seq_len()) {
    Finish(seq, FinishReason::kContextFull);
  } else {
    seq.next = next;
  }
}

std::string GenerationScheduler::Where(const Sequence& seq) {
  return seq.slot < 0 ? "(queued)" : absl::StrCat("in slot ", seq.slot);
}

void GenerationScheduler::Finish(Sequence& seq, FinishReason reason,
                                 std::optional<TokenLogProb> end_logprob) {
  GenerationEvent event;
  event.kind = GenerationEvent::Kind::kFinished;
  event.logprob = std::move(end_logprob);
  event.prompt_logprobs = std::move(seq.prompt_scores);
  seq.prompt_scores.clear();
  GenerationSummary& s = event.summary;
  s.reason = reason;
  s.prompt_tokens = static_cast<int>(seq.prompt.size());
  s.cached_tokens = seq.cached;
  s.generated_tokens = seq.generated;
  s.text = seq.text.Flush();
  s.queue_seconds = Seconds(seq.arrived, seq.prefill_start);
  s.prefill_seconds = Seconds(seq.prefill_start, seq.first_token);
  s.decode_seconds = Seconds(seq.first_token, seq.last_token);
  IG_LOG(DEBUG) << "generation " << Where(seq) << ": "
                << s.prompt_tokens << " prompt tokens, " << s.generated_tokens
                << " generated, " << FinishReasonName(reason);
  seq.done = true;
  {
    // Counted before the consumer can see the end.
    absl::MutexLock lock(&mu_);
    ++stats_.completed;
  }
  Record(seq);
  seq.stream->Push(std::move(event));
}

void GenerationScheduler::Fail(Sequence& seq, const absl::Status& status) {
  GenerationEvent event;
  event.kind = GenerationEvent::Kind::kError;
  event.status = status;
  seq.done = true;
  {
    absl::MutexLock lock(&mu_);
    ++stats_.failed;
  }
  seq.stream->Push(std::move(event));
}

void GenerationScheduler::Drop(Sequence& seq) {
  IG_LOG(DEBUG) << "generation " << Where(seq) << " cancelled after "
                << seq.generated << " tokens";
  seq.done = true;
  absl::MutexLock lock(&mu_);
  ++stats_.cancelled;
}

void GenerationScheduler::Record(Sequence& seq) {
  if (seq.recorded || !options_.on_sequence_done) return;
  seq.recorded = true;
  SequenceRecord r;
  r.prompt_tokens = static_cast<int>(seq.prompt.size());
  r.generated_tokens = seq.generated;
  r.cached_tokens = seq.cached;
  if (seq.generated >= 1) r.ttft_seconds = Seconds(seq.arrived, seq.first_token);
  if (seq.generated >= 2) {
    r.tpot_seconds =
        Seconds(seq.first_token, seq.last_token) / (seq.generated - 1);
  }
  r.fetch = engine_->fetch_stats(seq.slot);
  options_.on_sequence_done(r);
}

void GenerationScheduler::ReleaseDone() {
  for (const std::unique_ptr<Sequence>& seq : active_) {
    if (!seq->done) continue;
    Record(*seq);
    // Reset forgets the sequence before it closes it on the memory node,
    // so the slot is reusable even when closing fails.
    if (absl::Status s = engine_->Reset(seq->slot); !s.ok()) {
      IG_LOG(WARNING) << "resetting slot " << seq->slot << ": " << s;
    }
    free_slots_.push_back(seq->slot);
  }
  const size_t before = active_.size();
  active_.erase(std::remove_if(active_.begin(), active_.end(),
                               [](const std::unique_ptr<Sequence>& s) {
                                 return s->done;
                               }),
                active_.end());
  if (active_.size() != before) {
    absl::MutexLock lock(&mu_);
    stats_.active -= static_cast<int>(before - active_.size());
  }
}

void GenerationScheduler::AbortAll(const absl::Status& status) {
  std::deque<std::unique_ptr<Sequence>> queued;
  {
    absl::MutexLock lock(&mu_);
    queued.swap(queue_);
  }
  if (!queued.empty() || !active_.empty()) {
    IG_LOG(WARNING) << "ending " << active_.size() << " active and "
                    << queued.size() << " queued generations: " << status;
  }
  for (std::unique_ptr<Sequence>& seq : queued) {
    if (seq->stream->cancelled()) {
      Drop(*seq);
    } else {
      Fail(*seq, status);
    }
  }
  for (std::unique_ptr<Sequence>& seq : active_) {
    if (!seq->done) Fail(*seq, status);
  }
  ReleaseDone();
  absl::MutexLock lock(&mu_);
  idle_ = true;
}

}  // namespace infinigen::gpu_worker
