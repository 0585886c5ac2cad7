// GenerationScheduler: many generation requests over one Engine, with
// continuous batching. Knows nothing of gRPC; GenerationService
// (generation_service.h) puts it on the network.
//
// Owns the engine; the engine's batch is the number of sequences generating
// at once (slots). One scheduler thread drives the engine; each iteration
//   1. moves waiting requests into free slots and prefills each (dense, one
//      Engine::Forward per request), sampling its first token;
//   2. drops the sequences whose consumer went away (GenerationStream::
//      Cancel), freeing their slots (Engine::Reset);
//   3. runs one Engine::DecodeBatch over every active slot and samples each
//      sequence's next token with that request's own Sampler.
// A request's tokens go to its GenerationStream as they are chosen; a
// sequence that ends (length, end token, full context, or an engine error)
// frees its slot at once, so a waiting request can take it at the next
// iteration without disturbing the others. Sampling is per request and the
// batch rows are independent, so a request gets the tokens it would get
// alone.
//
// Submit validates and queues on the caller's thread; requests wait in a
// bounded FIFO queue for a slot. Shutdown stops taking requests, lets the
// queued and active ones finish for a grace period, then ends the rest with
// Unavailable.
//
// Thread-safe: Submit, Shutdown and stats may be called from any thread.
// The engine's weights and the tokenizer must outlive the scheduler.
#ifndef INFINIGEN_GPU_WORKER_SERVING_GENERATION_SCHEDULER_H_
#define INFINIGEN_GPU_WORKER_SERVING_GENERATION_SCHEDULER_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "gpu_worker/engine.h"
#include "gpu_worker/serving/sampler.h"
#include "model/tokenizer.h"

namespace infinigen::gpu_worker {

// What to generate. Exactly one of prompt and prompt_tokens is set.
struct GenerationRequest {
  // Encoded with the tokenizer, BOS first where the model's text starts
  // with one.
  std::string prompt;
  // Used as given (no BOS added).
  std::vector<int> prompt_tokens;
  int max_new_tokens = 0;   // >= 1, at most the scheduler's limit
  float temperature = 0.0f;  // 0: greedy
  float top_p = 1.0f;        // in (0, 1]
  uint64_t seed = 0;
  // OpenAI's penalties on tokens already generated, each in [-2, 2].
  float frequency_penalty = 0.0f;
  float presence_penalty = 0.0f;
  // -1: no log-probabilities; k >= 0: each chosen token's (the end token's
  // too) with the k most likely tokens of its row, k at most kMaxTopLogprobs.
  int logprobs = -1;
  // The prompt's tokens' log-probabilities too (each but the first, with
  // the same k; needs logprobs >= 0). The prompt is then computed whole:
  // no prefix reuse.
  bool prompt_logprobs = false;
};
// The most alternatives a request may ask for per token.
inline constexpr int kMaxTopLogprobs = 20;

enum class FinishReason {
  kLength,       // max_new_tokens generated
  kEndToken,     // the model chose EOS or another control token
  kContextFull,  // the sequence filled the engine's max_seq_len
};
const char* FinishReasonName(FinishReason reason);

// How a successful generation ended.
struct GenerationSummary {
  FinishReason reason = FinishReason::kLength;
  int prompt_tokens = 0;
  // Of the prompt, tokens reused from the memory node (prefix reuse)
  // rather than computed.
  int cached_tokens = 0;
  int generated_tokens = 0;
  // Held-back bytes of an unfinished UTF-8 character, as U+FFFD; usually
  // empty.
  std::string text;
  double queue_seconds = 0;    // arrival to the start of the prefill
  double prefill_seconds = 0;  // prefill start to the first token chosen
  double decode_seconds = 0;   // first token to the last
};

// One event of a request's stream: a token, then more tokens, then exactly
// one of kFinished or kError.
struct GenerationEvent {
  enum class Kind { kToken, kFinished, kError };
  Kind kind = Kind::kToken;
  int token = -1;            // kToken
  std::string text;          // kToken: whole UTF-8 characters, maybe empty
  int cached_tokens = 0;     // kToken: prompt tokens whose KV was reused
  // With GenerationRequest::logprobs >= 0: kToken's token, or on kFinished
  // by kEndToken the end token the model chose.
  std::optional<TokenLogProb> logprob;
  // With prompt_logprobs, on the first event (kToken or kFinished): prompt
  // tokens 1, 2, ... (the first has no logits to be scored by).
  std::vector<TokenLogProb> prompt_logprobs;
  GenerationSummary summary;  // kFinished
  absl::Status status;       // kError
};

// A request's events, from the scheduler thread to one consumer.
// Thread-safe.
class GenerationStream {
 public:
  // Waits up to `timeout` for the next event. Returns false on timeout;
  // after the kFinished or kError event there are no more.
  bool Next(absl::Duration timeout, GenerationEvent* event);
  // The consumer is gone: the scheduler frees the sequence's slot at its
  // next iteration (or drops it from the queue) and sends nothing more.
  void Cancel() { cancelled_.store(true, std::memory_order_relaxed); }
  bool cancelled() const { return cancelled_.load(std::memory_order_relaxed); }

 private:
  friend class GenerationScheduler;
  void Push(GenerationEvent event);

  absl::Mutex mu_;
  std::deque<GenerationEvent> events_ ABSL_GUARDED_BY(mu_);
  std::atomic<bool> cancelled_{false};
};

// What one sequence did, as it leaves its slot (for metrics).
struct SequenceRecord {
  int prompt_tokens = 0;
  int generated_tokens = 0;
  double ttft_seconds = -1;  // arrival to the first token; -1: none came
  double tpot_seconds = -1;  // mean between later tokens; -1: fewer than 2
  int cached_tokens = 0;     // prompt tokens whose KV the node held
  FetchStats fetch;          // what its KV policy fetched over its steps
};

struct GenerationSchedulerOptions {
  // Requests waiting for a slot; Submit beyond it is ResourceExhausted.
  // At least 1.
  int max_queue = 64;
  // Largest max_new_tokens a request may ask for; 0: the engine's
  // max_seq_len.
  int max_new_tokens_limit = 0;
  // New requests prefilled between two decode steps; 0: every waiting
  // request that has a slot. A small number keeps the streams already
  // decoding from stalling behind a burst of long prompts.
  int max_prefills_per_step = 1;
  // Called on the scheduler thread once for each sequence that held a
  // slot: a finished one before its consumer sees the end (so metrics read
  // after a response include it), a failed or cancelled one as it leaves
  // its slot; must be quick and must not call the scheduler. Null: nothing.
  std::function<void(const SequenceRecord&)> on_sequence_done;
  // Tests: called on the scheduler thread before every decode step.
  std::function<void()> before_decode_step;
  // The memory node's state (serve: its heartbeats and timeouts), cheap to
  // call; null: always OK. While it is not OK the queued requests wait, at
  // most kv_down_wait from when it went down, for it to come back (a
  // restart); after that they fail at once, and Submit refuses new ones at
  // once (Unavailable, with its message), instead of each waiting out a
  // timeout on a node known to be down. Once it is OK again requests run
  // as before.
  std::function<absl::Status()> kv_health;
  absl::Duration kv_down_wait = absl::Seconds(5);
};

// Counters since the scheduler was created, and its state now.
struct SchedulerStats {
  long accepted = 0;   // Submit returned a stream
  long rejected = 0;   // Submit refused (bad request, queue full, stopping)
  long completed = 0;  // ended with a kFinished event
  long cancelled = 0;  // consumer went away first
  long failed = 0;     // ended with a kError event
  int queued = 0;      // waiting for a slot now
  int active = 0;      // in a slot now
  long kv_recoveries = 0;  // engine calls that recomputed a lost KV
  // Bytes the sequences' row caches hold now (KvOptions::row_cache).
  int64_t row_cache_bytes = 0;
  long prompt_tokens = 0;     // prompt tokens prefilled (reused ones too)
  long generated_tokens = 0;  // tokens generated, as they came
};

// UTF-8 text from a token stream: token pieces may end inside a character
// (byte tokens), and protobuf strings must be whole UTF-8.
class Utf8Assembler {
 public:
  // The whole characters of what came before plus `bytes`; a trailing
  // incomplete character is held back, invalid bytes become U+FFFD.
  std::string Add(std::string_view bytes);
  // What is held back, as U+FFFD (empty if nothing is); then starts over.
  std::string Flush();

 private:
  std::string held_;
};

class GenerationScheduler {
 public:
  // `engine` decodes engine->batch() sequences at once. InvalidArgument for
  // options out of range.
  static absl::StatusOr<std::unique_ptr<GenerationScheduler>> Create(
      std::unique_ptr<Engine> engine, const model::Tokenizer& tokenizer,
      const GenerationSchedulerOptions& options = {});
  ~GenerationScheduler();  // Shutdown(absl::ZeroDuration())

  // Starts the scheduler thread; until then requests only queue. Once.
  void Start();

  // Validates `request` and queues it. InvalidArgument (saying what is
  // wrong) for no prompt or both forms, a token outside the vocabulary, a
  // prompt of max_seq_len tokens or more, max_new_tokens < 1 or above the
  // limit, temperature < 0, top_p outside (0, 1]; ResourceExhausted when
  // max_queue requests are waiting; Unavailable after Shutdown began.
  absl::StatusOr<std::shared_ptr<GenerationStream>> Submit(
      const GenerationRequest& request);

  // Stops taking requests (Submit: Unavailable), lets queued and active
  // requests finish for up to `grace`, then ends the rest with an
  // Unavailable event and stops the thread. Blocks until then; idempotent.
  void Shutdown(absl::Duration grace);

  SchedulerStats stats() const;
  int slots() const { return engine_->batch(); }
  int max_seq_len() const { return engine_->max_seq_len(); }
  int max_new_tokens_limit() const { return max_new_tokens_limit_; }

 private:
  // One request, from Submit to its last event.
  struct Sequence {
    Sequence(Sampler s, Penalties p)
        : sampler(std::move(s)), penalties(std::move(p)) {}
    std::shared_ptr<GenerationStream> stream;
    std::vector<int> prompt;
    int max_new_tokens = 0;
    Sampler sampler;
    Penalties penalties;
    int logprobs = -1;             // GenerationRequest's
    bool prompt_logprobs = false;  // GenerationRequest's
    // Scored by the prefill; sent with the first event.
    std::vector<TokenLogProb> prompt_scores;
    int slot = -1;
    int prev = -1;       // last token of the sequence so far
    int next = -1;       // sampled, to be fed at the next decode step
    int generated = 0;
    int cached = 0;  // prompt tokens the prefill reused
    bool done = false;   // ended; its slot is free
    bool recorded = false;  // on_sequence_done has seen it
    Utf8Assembler text;
    absl::Time arrived, prefill_start, first_token, last_token;
  };

  GenerationScheduler(std::unique_ptr<Engine> engine,
                      const model::Tokenizer& tokenizer,
                      const GenerationSchedulerOptions& options);
  // The validated request, ready to queue; the errors of Submit.
  absl::StatusOr<std::unique_ptr<Sequence>> NewSequence(
      const GenerationRequest& request) const;
  absl::StatusOr<std::shared_ptr<GenerationStream>> Enqueue(
      const GenerationRequest& request);
  void Loop();
  void Prefill(Sequence& seq);
  // Copies the engine's recovery count and its row caches' bytes into
  // stats_ (after each engine call).
  void NoteEngineStats();
  // Samples from `logits` and streams the token, or ends the sequence.
  void Advance(Sequence& seq, absl::Span<const float> logits);
  void DecodeStep();
  // End a sequence (done = true); ReleaseDone frees the slots after the
  // engine's logits have been read.
  // end_logprob: the end token's log-probability, when asked for.
  void Finish(Sequence& seq, FinishReason reason,
              std::optional<TokenLogProb> end_logprob = std::nullopt);
  void Fail(Sequence& seq, const absl::Status& status);
  void Drop(Sequence& seq);  // cancelled by its consumer
  void ReleaseDone();
  void Record(Sequence& seq);  // on_sequence_done, once
  static std::string Where(const Sequence& seq);  // for logs
  // Ends every queued and active request with `status` (shutdown).
  // Where kv_health stands: OK (up), or the Unavailable a request gets
  // once the node has been down longer than kv_down_wait; *hold: down, but
  // within that wait (queued requests wait).
  absl::Status KvGate(bool* hold) ABSL_LOCKS_EXCLUDED(mu_);
  // After an engine call begun at `start` failed: if the node is down, it
  // has been since then at the latest (the call waited on it).
  void NoteKvDownSince(absl::Time start) ABSL_LOCKS_EXCLUDED(mu_);
  void AbortAll(const absl::Status& status);

  const std::unique_ptr<Engine> engine_;
  const model::Tokenizer& tokenizer_;
  const GenerationSchedulerOptions options_;
  const int max_new_tokens_limit_;

  // The scheduler thread's own: sequences in slots, free slot ids, and
  // DecodeBatch arguments.
  std::vector<std::unique_ptr<Sequence>> active_;
  std::vector<int> free_slots_;
  std::vector<int> step_slots_, step_tokens_;

  mutable absl::Mutex mu_;
  std::deque<std::unique_ptr<Sequence>> queue_ ABSL_GUARDED_BY(mu_);
  bool started_ ABSL_GUARDED_BY(mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;  // no new requests
  bool abort_ ABSL_GUARDED_BY(mu_) = false;     // grace over: end all now
  bool idle_ ABSL_GUARDED_BY(mu_) = true;       // nothing queued or active
  // When kv_health last turned from OK to failing; InfiniteFuture: OK.
  absl::Time kv_down_since_ ABSL_GUARDED_BY(mu_) = absl::InfiniteFuture();
  SchedulerStats stats_ ABSL_GUARDED_BY(mu_);
  // Counted on the scheduler thread as tokens come, outside mu_.
  std::atomic<long> prompt_tokens_{0};
  std::atomic<long> generated_tokens_{0};

  absl::Mutex shutdown_mu_;  // one Shutdown at a time; Start vs Shutdown
  std::thread thread_ ABSL_GUARDED_BY(shutdown_mu_);
};

}  // namespace infinigen::gpu_worker

#endif  // INFINIGEN_GPU_WORKER_SERVING_GENERATION_SCHEDULER_H_
