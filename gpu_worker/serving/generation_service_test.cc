// The Worker gRPC service end to end: the real stories260K model behind a
// GenerationScheduler on an in-process gRPC server, called through the
// generated StubInterface.
#include "gpu_worker/serving/generation_service.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gpu_worker/backend/cpu/cpu_backend.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "gtest/gtest.h"
#include "gpu_worker/backend/backend.h"
#include "gpu_worker/engine.h"
#include "gpu_worker/serving/generation_scheduler.h"
#include "kv_memory_service/client/kv_client.h"
#include "model/llama2c.h"
#include "proto/health.grpc.pb.h"
#include "proto/worker.grpc.pb.h"

namespace infinigen::gpu_worker {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

constexpr char kModel[] = "models/stories260K/stories260K.bin";
constexpr char kTokenizer[] = "models/stories260K/tok512.bin";

// stories260K's greedy (temperature 0) continuation of the prompt, a fact
// of the model.
constexpr char kPrompt[] = "Once upon a time";
constexpr char kOnceUponATime[] =
    "Once upon a time, there was a little girl named Lily. She loved to play "
    "outside in the park. One day, she saw a big, red ball. She wanted to "
    "play with it, but it was too high.";

// A bound on every call, so that a bug fails the test instead of hanging it.
constexpr auto kCallDeadline = std::chrono::seconds(120);

// What a client saw of one Generate call.
struct Generation {
  grpc::Status status;
  std::vector<int> tokens;
  std::string text;  // the pieces concatenated, then Finished.text
  bool finished = false;
  worker::Finished summary;
};

// Reads a stream to its end, or (stop_after >= 0) cancels it after that
// many tokens.
Generation ReadAll(grpc::ClientContext& ctx,
                   grpc::ClientReaderInterface<worker::GenerateResponse>& reader,
                   int stop_after = -1) {
  Generation g;
  worker::GenerateResponse response;
  while (reader.Read(&response)) {
    if (response.has_token()) {
      EXPECT_FALSE(g.finished) << "a token after the last message";
      g.tokens.push_back(response.token().id());
      g.text += response.token().text();
      if (static_cast<int>(g.tokens.size()) == stop_after) ctx.TryCancel();
    } else {
      EXPECT_TRUE(response.has_finished());
      EXPECT_FALSE(g.finished) << "two last messages";
      g.finished = true;
      g.summary = response.finished();
      g.text += response.finished().text();
    }
  }
  g.status = reader.Finish();
  return g;
}

Generation Generate(worker::Worker::StubInterface& stub,
                    const worker::GenerateRequest& request,
                    int stop_after = -1) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + kCallDeadline);
  std::unique_ptr<grpc::ClientReaderInterface<worker::GenerateResponse>>
      reader = stub.Generate(&ctx, request);
  return ReadAll(ctx, *reader, stop_after);
}

worker::GenerateRequest Request(const std::string& prompt, int max_new_tokens,
                                float temperature = 0.0f, uint64_t seed = 0) {
  worker::GenerateRequest r;
  r.set_prompt(prompt);
  r.set_max_new_tokens(max_new_tokens);
  r.set_temperature(temperature);
  if (temperature > 0) r.set_top_p(0.9f);
  r.set_seed(seed);
  return r;
}

// Eight different requests: greedy and sampled, different lengths.
std::vector<worker::GenerateRequest> MixedRequests() {
  const char* prompts[] = {"Once upon a time", "The cat sat",
                           "Tom and Sue went to", "One day, a big dog",
                           "Lily was sad because", "The sun was hot and",
                           "A little bird", "Max found a red box"};
  std::vector<worker::GenerateRequest> requests;
  for (int i = 0; i < 8; ++i) {
    requests.push_back(Request(prompts[i], 30 + 10 * i,
                               i % 2 == 0 ? 0.0f : 0.8f, 1000 + i));
  }
  return requests;
}

class GenerationServiceTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto w = model::LoadLlama2cWeights(kModel);
    ASSERT_TRUE(w.ok()) << w.status();
    weights_ = new model::Weights(std::move(*w));
    auto tok = model::Llama2cTokenizer::Load(kTokenizer,
                                             weights_->config.vocab_size);
    ASSERT_TRUE(tok.ok()) << tok.status();
    tokenizer_ = tok->release();
  }

  // A scheduler over `batch` slots of the model.
  std::unique_ptr<GenerationScheduler> NewScheduler(
      int batch, const GenerationSchedulerOptions& options = {},
      const std::string& policy = "ideal") {
    EngineOptions engine_options;
    engine_options.batch = batch;
    EXPECT_TRUE(ChoosePolicy(policy, engine_options.kv).ok());
    if (engine_options.kv.policy) {
      auto client = kv_memory_service::ConnectKvClient("inproc:");
      EXPECT_TRUE(client.ok()) << client.status();
      if (!client.ok()) return nullptr;
      kv_client_ = std::move(*client);
      engine_options.kv.kv_client = kv_client_.get();
    }
    auto engine = Engine::Create(*weights_, NewCpuBackend(), engine_options);
    EXPECT_TRUE(engine.ok()) << engine.status();
    if (!engine.ok()) return nullptr;
    auto scheduler =
        GenerationScheduler::Create(std::move(*engine), *tokenizer_, options);
    EXPECT_TRUE(scheduler.ok()) << scheduler.status();
    return scheduler.ok() ? std::move(*scheduler) : nullptr;
  }

  // Serves a scheduler of `batch` slots and connects stub_: in-process, or
  // over a unix socket with `unix_socket` (the shutdown tests: the
  // in-process transport may close before a call's status reaches the
  // client).
  void StartServer(int batch, const GenerationSchedulerOptions& options = {},
                   const std::string& policy = "ideal",
                   bool start_scheduler = true, bool unix_socket = false) {
    std::unique_ptr<GenerationScheduler> scheduler =
        NewScheduler(batch, options, policy);
    ASSERT_NE(scheduler, nullptr);
    if (start_scheduler) scheduler->Start();
    GenerationServerOptions server_options;
    server_options.dependency_health = dependency_health_;
    server_options.api_key = api_key_;
    server_options.health_poll_interval = absl::Milliseconds(20);
    if (unix_socket) {
      socket_path_ = absl::StrCat("/tmp/generation_service_test_", getpid(),
                                  ".sock");
      unlink(socket_path_.c_str());
      server_options.listen = "unix:" + socket_path_;
    }
    auto server = GenerationServer::Start(std::move(scheduler), server_options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
    channel_ = unix_socket ? grpc::CreateChannel(server_options.listen,
                                                 grpc::InsecureChannelCredentials())
                           : server_->InProcessChannel();
    stub_ = worker::Worker::NewStub(channel_);
  }

  // Passed to GenerationServerOptions::dependency_health by StartServer.
  std::function<absl::Status()> dependency_health_;
  // Passed to GenerationServerOptions::api_key by StartServer.
  std::string api_key_;

  void TearDown() override {
    stub_.reset();
    channel_.reset();
    server_.reset();
    if (!socket_path_.empty()) unlink(socket_path_.c_str());
  }

  // Each request alone, one after another.
  std::vector<Generation> Alone(
      const std::vector<worker::GenerateRequest>& requests) {
    std::vector<Generation> out;
    for (const auto& r : requests) out.push_back(Generate(*stub_, r));
    return out;
  }

  // All requests at once, each from its own client thread.
  std::vector<Generation> Together(
      const std::vector<worker::GenerateRequest>& requests) {
    std::vector<Generation> out(requests.size());
    std::vector<std::thread> clients;
    for (size_t i = 0; i < requests.size(); ++i) {
      clients.emplace_back(
          [&, i] { out[i] = Generate(*stub_, requests[i]); });
    }
    for (std::thread& t : clients) t.join();
    return out;
  }

  // Waits (bounded) until the scheduler's counters satisfy `done`.
  template <typename Pred>
  SchedulerStats WaitForStats(Pred done) {
    const auto end = std::chrono::steady_clock::now() + kCallDeadline;
    SchedulerStats s = server_->scheduler().stats();
    while (!done(s) && std::chrono::steady_clock::now() < end) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
      s = server_->scheduler().stats();
    }
    return s;
  }

  void ExpectSameAsAlone(const std::vector<Generation>& alone,
                         const std::vector<Generation>& together) {
    ASSERT_EQ(alone.size(), together.size());
    for (size_t i = 0; i < alone.size(); ++i) {
      ASSERT_TRUE(alone[i].status.ok()) << alone[i].status.error_message();
      ASSERT_TRUE(together[i].status.ok())
          << i << ": " << together[i].status.error_message();
      EXPECT_EQ(together[i].tokens, alone[i].tokens) << "request " << i;
      EXPECT_EQ(together[i].text, alone[i].text) << "request " << i;
      EXPECT_EQ(together[i].summary.reason(), alone[i].summary.reason());
      EXPECT_FALSE(alone[i].tokens.empty());
    }
  }

  static model::Weights* weights_;
  static model::Tokenizer* tokenizer_;
  // Declared before the server, so that it outlives the engine using it.
  std::unique_ptr<kv_memory_service::KvClient> kv_client_;
  std::unique_ptr<GenerationServer> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<worker::Worker::StubInterface> stub_;
  std::string socket_path_;
};

model::Weights* GenerationServiceTest::weights_ = nullptr;
model::Tokenizer* GenerationServiceTest::tokenizer_ = nullptr;

TEST_F(GenerationServiceTest, GreedyStreamsTheKnownContinuation) {
  StartServer(/*batch=*/2);
  const Generation g = Generate(*stub_, Request(kPrompt, 60));
  ASSERT_TRUE(g.status.ok()) << g.status.error_message();
  EXPECT_THAT(g.text, StartsWith(", there was a little girl named Lily."));
  const std::string expected = kOnceUponATime;
  EXPECT_EQ((kPrompt + g.text).substr(0, expected.size()), expected)
      << kPrompt << g.text;
  ASSERT_TRUE(g.finished);
  EXPECT_EQ(g.summary.reason(), worker::FINISH_REASON_LENGTH);
  EXPECT_EQ(g.summary.generated_tokens(), 60);
  EXPECT_EQ(g.tokens.size(), 60u);
  EXPECT_EQ(g.summary.prompt_tokens(),
            static_cast<int>(tokenizer_->Encode(kPrompt, true).size()));
  EXPECT_GE(g.summary.prefill_seconds(), 0.0);
  EXPECT_GE(g.summary.decode_seconds(), 0.0);

  // The same prompt as token ids gives the same tokens.
  worker::GenerateRequest by_ids;
  for (int t : tokenizer_->Encode(kPrompt, true)) by_ids.add_prompt_tokens(t);
  by_ids.set_max_new_tokens(60);
  const Generation g2 = Generate(*stub_, by_ids);
  ASSERT_TRUE(g2.status.ok()) << g2.status.error_message();
  EXPECT_EQ(g2.tokens, g.tokens);
}

TEST_F(GenerationServiceTest, AnApiKeyIsRequiredInTheMetadata) {
  api_key_ = "sk-grpc";
  StartServer(/*batch=*/1);
  for (const char* presented : {"", "Bearer sk-wrong", "Bearer sk-grpc2",
                                "sk-grpc"}) {
    grpc::ClientContext ctx;
    if (*presented != '\0') ctx.AddMetadata("authorization", presented);
    auto reader = stub_->Generate(&ctx, Request(kPrompt, 3));
    const Generation g = ReadAll(ctx, *reader);
    EXPECT_EQ(g.status.error_code(), grpc::StatusCode::UNAUTHENTICATED)
        << presented;
    EXPECT_TRUE(g.tokens.empty());
  }
  grpc::ClientContext ctx;
  ctx.AddMetadata("authorization", "Bearer sk-grpc");
  auto reader = stub_->Generate(&ctx, Request(kPrompt, 3));
  const Generation g = ReadAll(ctx, *reader);
  ASSERT_TRUE(g.status.ok()) << g.status.error_message();
  EXPECT_EQ(g.tokens.size(), 3u);
}

TEST_F(GenerationServiceTest, ConcurrentClientsGetWhatALoneRequestGets) {
  StartServer(/*batch=*/8);
  const std::vector<worker::GenerateRequest> requests = MixedRequests();
  const std::vector<Generation> alone = Alone(requests);
  ExpectSameAsAlone(alone, Together(requests));
  const SchedulerStats s = server_->scheduler().stats();
  EXPECT_EQ(s.completed, 16);
  EXPECT_EQ(s.failed + s.cancelled + s.rejected, 0);
}

// Fewer slots than clients: requests queue and take the slots others free.
TEST_F(GenerationServiceTest, QueuedRequestsTakeFreedSlots) {
  StartServer(/*batch=*/3);
  const std::vector<worker::GenerateRequest> requests = MixedRequests();
  const std::vector<Generation> alone = Alone(requests);
  ExpectSameAsAlone(alone, Together(requests));
}

// A burst of requests joins the running batch one prefill per decode step
// (max_prefills_per_step = 1, the default), and gets the same tokens.
TEST_F(GenerationServiceTest, BurstJoinsOnePrefillPerStep) {
  GenerationSchedulerOptions options;
  absl::Mutex mu;
  std::vector<int> active;  // in slots at each decode step
  options.before_decode_step = [&] {
    const int a = server_->scheduler().stats().active;
    absl::MutexLock lock(&mu);
    active.push_back(a);
  };
  StartServer(/*batch=*/8, options);
  const std::vector<worker::GenerateRequest> requests = MixedRequests();
  const std::vector<Generation> alone = Alone(requests);
  {
    absl::MutexLock lock(&mu);
    active.clear();
  }
  ExpectSameAsAlone(alone, Together(requests));
  absl::MutexLock lock(&mu);
  ASSERT_FALSE(active.empty());
  EXPECT_EQ(active.front(), 1);
  for (size_t i = 1; i < active.size(); ++i) {
    EXPECT_LE(active[i], active[i - 1] + 1) << "step " << i;
  }
  EXPECT_GT(*std::max_element(active.begin(), active.end()), 1);
}

TEST_F(GenerationServiceTest, CancelledClientDoesNotDisturbTheOthers) {
  GenerationSchedulerOptions options;
  // Slow decoding down so the cancel lands mid-generation.
  options.before_decode_step = [] {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  };
  StartServer(/*batch=*/3, options);
  std::vector<worker::GenerateRequest> others = MixedRequests();
  others.resize(4);
  const std::vector<Generation> alone = Alone(others);

  std::vector<Generation> together(others.size());
  std::vector<std::thread> clients;
  Generation cancelled;
  clients.emplace_back([&] {
    cancelled = Generate(*stub_, Request(kPrompt, 450), /*stop_after=*/5);
  });
  for (size_t i = 0; i < others.size(); ++i) {
    clients.emplace_back(
        [&, i] { together[i] = Generate(*stub_, others[i]); });
  }
  for (std::thread& t : clients) t.join();

  EXPECT_EQ(cancelled.status.error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_FALSE(cancelled.finished);
  ExpectSameAsAlone(alone, together);
  // The cancelled sequence left its slot (without finishing its 450).
  const SchedulerStats s = WaitForStats(
      [](const SchedulerStats& s) { return s.cancelled == 1 && s.active == 0; });
  EXPECT_EQ(s.cancelled, 1);
  EXPECT_EQ(s.active, 0);
  EXPECT_EQ(s.failed, 0);
  // All three slots serve again.
  std::vector<worker::GenerateRequest> again(others.begin(),
                                             others.begin() + 3);
  ExpectSameAsAlone(std::vector<Generation>(alone.begin(), alone.begin() + 3),
                    Together(again));
}

TEST_F(GenerationServiceTest, BadRequestsGetTheirStatusAndServingGoesOn) {
  StartServer(/*batch=*/2);
  struct Case {
    const char* name;
    worker::GenerateRequest request;
    grpc::StatusCode code;
    const char* message;
  };
  std::vector<Case> cases;
  auto add = [&](const char* name, worker::GenerateRequest r,
                 const char* message,
                 grpc::StatusCode code = grpc::StatusCode::INVALID_ARGUMENT) {
    cases.push_back({name, std::move(r), code, message});
  };
  add("no prompt", Request("", 10), "empty prompt");
  {
    worker::GenerateRequest r = Request(kPrompt, 10);
    r.add_prompt_tokens(1);
    add("both prompt forms", r, "not both");
  }
  add("zero max_new_tokens", Request(kPrompt, 0), "max_new_tokens");
  add("negative max_new_tokens", Request(kPrompt, -3), "max_new_tokens");
  add("max_new_tokens over the limit", Request(kPrompt, 100000),
      "exceeds this server's limit of 512");
  add("negative temperature", Request(kPrompt, 10, -0.5f), "temperature");
  {
    worker::GenerateRequest r = Request(kPrompt, 10);
    r.set_temperature(std::nanf(""));
    add("NaN temperature", r, "temperature");
  }
  for (float top_p : {0.0f, -0.1f, 1.5f}) {
    worker::GenerateRequest r = Request(kPrompt, 10, 0.8f);
    r.set_top_p(top_p);
    add("top_p out of range", r, "top_p must be in (0, 1]");
  }
  for (int bad : {512, -1, 100000}) {
    worker::GenerateRequest r;
    r.add_prompt_tokens(1);
    r.add_prompt_tokens(bad);
    r.set_max_new_tokens(5);
    add("token outside the vocabulary", r, "outside the vocabulary");
  }
  {
    worker::GenerateRequest r;
    for (int i = 0; i < 512; ++i) r.add_prompt_tokens(1 + i % 400);
    r.set_max_new_tokens(5);
    add("prompt fills the context", r, "the context holds 512");
  }
  for (const Case& c : cases) {
    const Generation g = Generate(*stub_, c.request);
    EXPECT_EQ(g.status.error_code(), c.code) << c.name;
    EXPECT_THAT(g.status.error_message(), HasSubstr(c.message)) << c.name;
    EXPECT_TRUE(g.tokens.empty()) << c.name;
  }
  EXPECT_EQ(server_->scheduler().stats().rejected,
            static_cast<long>(cases.size()));
  // Still serving, with the same answer as ever.
  const Generation g = Generate(*stub_, Request(kPrompt, 60));
  ASSERT_TRUE(g.status.ok()) << g.status.error_message();
  EXPECT_THAT(g.text, StartsWith(", there was a little girl named Lily."));
  // A prompt of 511 tokens fits: the first generated token takes the last
  // position, the second fills the context.
  worker::GenerateRequest longest;
  for (int i = 0; i < 511; ++i) longest.add_prompt_tokens(1 + i % 400);
  longest.set_max_new_tokens(10);
  const Generation full = Generate(*stub_, longest);
  ASSERT_TRUE(full.status.ok()) << full.status.error_message();
  EXPECT_LE(full.tokens.size(), 2u);
  if (full.tokens.size() == 2) {
    EXPECT_EQ(full.summary.reason(), worker::FINISH_REASON_CONTEXT_FULL);
  }
}

TEST_F(GenerationServiceTest, FullQueueIsResourceExhausted) {
  GenerationSchedulerOptions options;
  options.max_queue = 2;
  // The scheduler starts later, so the first two requests stay queued.
  StartServer(/*batch=*/1, options, "ideal",
              /*start_scheduler=*/false);
  grpc::ClientContext ctx[3];
  std::unique_ptr<grpc::ClientReaderInterface<worker::GenerateResponse>>
      readers[3];
  for (int i = 0; i < 3; ++i) {
    ctx[i].set_deadline(std::chrono::system_clock::now() + kCallDeadline);
    readers[i] = stub_->Generate(&ctx[i], Request(kPrompt, 60));
    // The server sends initial metadata once it has queued the request.
    if (i < 2) readers[i]->WaitForInitialMetadata();
  }
  const Generation third = ReadAll(ctx[2], *readers[2]);
  EXPECT_EQ(third.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(third.status.error_message(), HasSubstr("queue full"));

  server_->scheduler().Start();
  for (int i = 0; i < 2; ++i) {
    const Generation g = ReadAll(ctx[i], *readers[i]);
    ASSERT_TRUE(g.status.ok()) << g.status.error_message();
    EXPECT_THAT(g.text, StartsWith(", there was a little girl named Lily."));
    EXPECT_GE(g.summary.queue_seconds(), 0.0);
  }
}

TEST_F(GenerationServiceTest, ShutdownFinishesStreamsInFlightThenRefuses) {
  StartServer(/*batch=*/2, {}, "ideal", /*start_scheduler=*/true,
              /*unix_socket=*/true);
  const std::vector<worker::GenerateRequest> requests = {
      Request(kPrompt, 60), Request("The cat sat", 50, 0.8f, 7),
      Request("A little bird", 40)};
  const std::vector<Generation> alone = Alone(requests);
  grpc::ClientContext ctx[3];
  std::unique_ptr<grpc::ClientReaderInterface<worker::GenerateResponse>>
      readers[3];
  for (int i = 0; i < 3; ++i) {
    ctx[i].set_deadline(std::chrono::system_clock::now() + kCallDeadline);
    readers[i] = stub_->Generate(&ctx[i], requests[i]);
    readers[i]->WaitForInitialMetadata();
  }
  std::vector<Generation> drained(3);
  std::vector<std::thread> clients;
  for (int i = 0; i < 3; ++i) {
    clients.emplace_back(
        [&, i] { drained[i] = ReadAll(ctx[i], *readers[i]); });
  }
  server_->Shutdown(absl::Seconds(100));
  for (std::thread& t : clients) t.join();
  ExpectSameAsAlone(alone, drained);

  absl::StatusOr<std::shared_ptr<GenerationStream>> late =
      server_->scheduler().Submit({kPrompt, {}, 10});
  EXPECT_EQ(late.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(late.status().message()), HasSubstr("shutting down"));
}

TEST_F(GenerationServiceTest, DrainDeadlineEndsStreamsWithUnavailable) {
  GenerationSchedulerOptions options;
  options.before_decode_step = [] {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  };
  StartServer(/*batch=*/1, options, "ideal",
              /*start_scheduler=*/true, /*unix_socket=*/true);
  grpc::ClientContext ctx[2];
  std::unique_ptr<grpc::ClientReaderInterface<worker::GenerateResponse>>
      readers[2];
  for (int i = 0; i < 2; ++i) {
    ctx[i].set_deadline(std::chrono::system_clock::now() + kCallDeadline);
    readers[i] = stub_->Generate(&ctx[i], Request(kPrompt, 450));
    readers[i]->WaitForInitialMetadata();
  }
  std::vector<Generation> cut(2);
  std::vector<std::thread> clients;
  for (int i = 0; i < 2; ++i) {
    clients.emplace_back([&, i] { cut[i] = ReadAll(ctx[i], *readers[i]); });
  }
  // One is generating (450 steps of at least 2 ms), one is queued.
  server_->Shutdown(absl::ZeroDuration());
  for (std::thread& t : clients) t.join();
  for (int i = 0; i < 2; ++i) {
    const Generation& g = cut[i];
    EXPECT_EQ(g.status.error_code(), grpc::StatusCode::UNAVAILABLE) << i;
    EXPECT_THAT(g.status.error_message(), HasSubstr("shutting down")) << i;
    EXPECT_FALSE(g.finished);
  }
}

// The grpc.health.v1 status of `service`, or UNKNOWN when the call fails.
grpc::health::v1::HealthCheckResponse::ServingStatus HealthOf(
    grpc::health::v1::Health::StubInterface& health,
    const std::string& service) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + kCallDeadline);
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(service);
  grpc::health::v1::HealthCheckResponse response;
  if (!health.Check(&ctx, request, &response).ok()) {
    return grpc::health::v1::HealthCheckResponse::UNKNOWN;
  }
  return response.status();
}

TEST_F(GenerationServiceTest, HealthFollowsTheKvNodesHealth) {
  using grpc::health::v1::HealthCheckResponse;
  std::atomic<bool> kv_answers{true};
  dependency_health_ = [&kv_answers] {
    return kv_answers.load() ? absl::OkStatus()
                             : absl::UnavailableError("heartbeat: no answer");
  };
  StartServer(/*batch=*/1);
  auto health = grpc::health::v1::Health::NewStub(channel_);
  const std::string worker = "infinigen.worker.Worker";
  const std::string liveness = GenerationServer::kLivenessService;
  EXPECT_EQ(HealthOf(*health, ""), HealthCheckResponse::SERVING);
  EXPECT_EQ(HealthOf(*health, worker), HealthCheckResponse::SERVING);

  // The memory node stops answering: out of rotation, but alive.
  kv_answers = false;
  const absl::Time down = absl::Now();
  while (HealthOf(*health, "") == HealthCheckResponse::SERVING &&
         absl::Now() - down < absl::Seconds(10)) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_LT(absl::Now() - down, absl::Seconds(1));
  EXPECT_EQ(HealthOf(*health, ""), HealthCheckResponse::NOT_SERVING);
  EXPECT_EQ(HealthOf(*health, worker), HealthCheckResponse::NOT_SERVING);
  EXPECT_EQ(HealthOf(*health, liveness), HealthCheckResponse::SERVING);
  EXPECT_FALSE(server_->serving());

  // It answers again: back in rotation.
  kv_answers = true;
  const absl::Time up = absl::Now();
  while (HealthOf(*health, "") != HealthCheckResponse::SERVING &&
         absl::Now() - up < absl::Seconds(10)) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_LT(absl::Now() - up, absl::Seconds(1));
  EXPECT_EQ(HealthOf(*health, worker), HealthCheckResponse::SERVING);
  EXPECT_TRUE(server_->serving());
  // Generation works again.
  const Generation g = Generate(*stub_, Request(kPrompt, 5));
  EXPECT_TRUE(g.status.ok()) << g.status.error_message();

  // Shutdown wins over a healthy dependency.
  server_->Shutdown(absl::ZeroDuration());
  absl::SleepFor(absl::Milliseconds(100));  // several polls
  EXPECT_FALSE(server_->serving());
}

TEST_F(GenerationServiceTest, ADependencyDownAtStartIsNotServingFromTheStart) {
  using grpc::health::v1::HealthCheckResponse;
  dependency_health_ = [] { return absl::UnavailableError("down"); };
  StartServer(/*batch=*/1);
  auto health = grpc::health::v1::Health::NewStub(channel_);
  EXPECT_EQ(HealthOf(*health, ""), HealthCheckResponse::NOT_SERVING);
  EXPECT_EQ(HealthOf(*health, "infinigen.worker.Worker"),
            HealthCheckResponse::NOT_SERVING);
  EXPECT_EQ(HealthOf(*health, GenerationServer::kLivenessService),
            HealthCheckResponse::SERVING);
}

TEST_F(GenerationServiceTest, HealthServiceReportsServing) {
  StartServer(/*batch=*/1);
  auto health = grpc::health::v1::Health::NewStub(channel_);
  for (const char* service : {"", "infinigen.worker.Worker",
                              GenerationServer::kLivenessService}) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + kCallDeadline);
    grpc::health::v1::HealthCheckRequest request;
    request.set_service(service);
    grpc::health::v1::HealthCheckResponse response;
    const grpc::Status s = health->Check(&ctx, request, &response);
    ASSERT_TRUE(s.ok()) << service << ": " << s.error_message();
    EXPECT_EQ(response.status(),
              grpc::health::v1::HealthCheckResponse::SERVING)
        << service;
  }
}

// The offloaded path: K and V go to an in-process memory node and every
// decode step fetches them back (fp16), per slot.
TEST_F(GenerationServiceTest, FullPolicyOverInprocKvNode) {
  StartServer(/*batch=*/4, {}, "full");
  const Generation g = Generate(*stub_, Request(kPrompt, 60));
  ASSERT_TRUE(g.status.ok()) << g.status.error_message();
  EXPECT_THAT(g.text, StartsWith(", there was a little girl named Lily."));
  std::vector<worker::GenerateRequest> requests = MixedRequests();
  requests.resize(6);
  ExpectSameAsAlone(Alone(requests), Together(requests));
}

// Metrics read right after a response must include it: a finished
// sequence reaches on_sequence_done before its consumer sees the end, and
// only once.
TEST_F(GenerationServiceTest, AFinishedSequenceIsRecordedBeforeItsEnd) {
  absl::Mutex mu;
  std::vector<SequenceRecord> records;
  GenerationSchedulerOptions options;
  options.on_sequence_done = [&](const SequenceRecord& r) {
    absl::MutexLock lock(&mu);
    records.push_back(r);
  };
  std::unique_ptr<GenerationScheduler> scheduler = NewScheduler(1, options);
  ASSERT_NE(scheduler, nullptr);
  scheduler->Start();
  for (int round = 1; round <= 2; ++round) {
    auto stream = scheduler->Submit({kPrompt, {}, 5});
    ASSERT_TRUE(stream.ok()) << stream.status();
    GenerationEvent event;
    int tokens = 0;
    do {
      ASSERT_TRUE((*stream)->Next(absl::Seconds(60), &event));
      if (event.kind == GenerationEvent::Kind::kToken) ++tokens;
    } while (event.kind == GenerationEvent::Kind::kToken);
    ASSERT_EQ(event.kind, GenerationEvent::Kind::kFinished);
    absl::MutexLock lock(&mu);
    ASSERT_EQ(records.size(), static_cast<size_t>(round));
    EXPECT_EQ(records.back().generated_tokens, tokens);
    EXPECT_EQ(records.back().prompt_tokens, event.summary.prompt_tokens);
    EXPECT_GT(records.back().ttft_seconds, 0);
  }
  scheduler->Shutdown(absl::Seconds(10));
  absl::MutexLock lock(&mu);
  EXPECT_EQ(records.size(), 2u);  // leaving the slot records nothing more
}

// Log-probabilities are the same whatever the policy: the prompt's come
// from the dense prefill (every row computed), the generated tokens' from
// the logits the sampler saw; bad logprob and penalty settings are refused.
TEST_F(GenerationServiceTest, LogprobsOfThePromptAndEachToken) {
  auto run = [](GenerationScheduler& scheduler, const GenerationRequest& r) {
    std::vector<GenerationEvent> events;
    auto stream = scheduler.Submit(r);
    EXPECT_TRUE(stream.ok()) << stream.status();
    if (!stream.ok()) return events;
    GenerationEvent event;
    do {
      EXPECT_TRUE((*stream)->Next(absl::Seconds(60), &event));
      events.push_back(event);
    } while (event.kind == GenerationEvent::Kind::kToken);
    return events;
  };
  GenerationRequest r{kPrompt, {}, 6};
  r.logprobs = 2;
  r.prompt_logprobs = true;
  std::vector<std::vector<GenerationEvent>> runs;
  for (const char* policy : {"ideal", "full", "h2o"}) {
    std::unique_ptr<GenerationScheduler> scheduler = NewScheduler(2, {}, policy);
    ASSERT_NE(scheduler, nullptr) << policy;
    scheduler->Start();
    runs.push_back(run(*scheduler, r));
    if (std::string(policy) == "ideal") {
      GenerationRequest bad = r;
      bad.logprobs = kMaxTopLogprobs + 1;
      EXPECT_EQ(scheduler->Submit(bad).status().code(),
                absl::StatusCode::kInvalidArgument);
      bad = r;
      bad.logprobs = -1;
      EXPECT_EQ(scheduler->Submit(bad).status().code(),
                absl::StatusCode::kInvalidArgument);
      bad = r;
      bad.presence_penalty = 2.5f;
      EXPECT_EQ(scheduler->Submit(bad).status().code(),
                absl::StatusCode::kInvalidArgument);
    }
    scheduler->Shutdown(absl::Seconds(10));
  }
  const std::vector<GenerationEvent>& ideal = runs[0];
  ASSERT_GE(ideal.size(), 2u);
  ASSERT_EQ(ideal[0].kind, GenerationEvent::Kind::kToken);
  const std::vector<int> prompt = tokenizer_->Encode(kPrompt, true);
  ASSERT_EQ(ideal[0].prompt_logprobs.size(), prompt.size() - 1);
  for (size_t i = 0; i + 1 < prompt.size(); ++i) {
    const TokenLogProb& p = ideal[0].prompt_logprobs[i];
    EXPECT_EQ(p.token, prompt[i + 1]);
    EXPECT_LE(p.logprob, 0.0f);
    ASSERT_EQ(p.top.size(), 2u);
    EXPECT_GE(p.top[0].second, p.logprob);
  }
  for (const GenerationEvent& e : ideal) {
    if (e.kind != GenerationEvent::Kind::kToken) continue;
    ASSERT_TRUE(e.logprob.has_value());
    EXPECT_EQ(e.logprob->token, e.token);
    // Greedy: the chosen token is the row's most likely.
    EXPECT_EQ(e.logprob->top[0].first, e.token);
  }
  EXPECT_TRUE(ideal[1].prompt_logprobs.empty());  // only on the first event
  for (size_t run = 1; run < runs.size(); ++run) {
    ASSERT_FALSE(runs[run].empty());
    const auto& a = ideal[0].prompt_logprobs;
    const auto& b = runs[run][0].prompt_logprobs;
    ASSERT_EQ(a.size(), b.size()) << run;
    for (size_t i = 0; i < a.size(); ++i) {
      EXPECT_NEAR(a[i].logprob, b[i].logprob, 1e-4) << run << " " << i;
    }
    ASSERT_TRUE(runs[run][0].logprob.has_value());
    EXPECT_NEAR(runs[run][0].logprob->logprob, ideal[0].logprob->logprob,
                1e-4);
  }
}

// A memory node known to be down: once it has been down longer than
// kv_down_wait, queued requests fail at once and new ones are refused at
// once (Unavailable, naming it), not one timeout after another; once it is
// up again, requests run without a restart.
TEST_F(GenerationServiceTest, ANodeKnownDownFailsTheQueueAtOnceUntilItIsBack) {
  absl::Mutex mu;
  absl::Status node = absl::OkStatus();
  bool release = false;
  GenerationSchedulerOptions options;
  options.kv_down_wait = absl::ZeroDuration();
  options.kv_health = [&] {
    absl::MutexLock lock(&mu);
    return node;
  };
  // Holds the running request inside its decode steps until released.
  options.before_decode_step = [&] {
    absl::MutexLock lock(&mu);
    mu.Await(absl::Condition(&release));
  };
  std::unique_ptr<GenerationScheduler> scheduler = NewScheduler(1, options);
  ASSERT_NE(scheduler, nullptr);
  scheduler->Start();
  auto running = scheduler->Submit({kPrompt, {}, 3});
  ASSERT_TRUE(running.ok()) << running.status();
  std::vector<std::shared_ptr<GenerationStream>> queued;
  for (int i = 0; i < 3; ++i) {
    auto q = scheduler->Submit({kPrompt, {}, 3});
    ASSERT_TRUE(q.ok()) << q.status();
    queued.push_back(*q);
  }
  {
    absl::MutexLock lock(&mu);
    node = absl::UnavailableError("memory node tcp://n:1: not answering");
    release = true;  // the loop comes round and sees the node down
  }
  const absl::Time start = absl::Now();
  for (auto& q : queued) {
    GenerationEvent event;
    do {
      ASSERT_TRUE(q->Next(absl::Seconds(30), &event));
    } while (event.kind == GenerationEvent::Kind::kToken);
    ASSERT_EQ(event.kind, GenerationEvent::Kind::kError);
    EXPECT_EQ(event.status.code(), absl::StatusCode::kUnavailable);
    EXPECT_THAT(std::string(event.status.message()),
                HasSubstr("not taking requests: memory node tcp://n:1: not "
                          "answering"));
  }
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  auto refused = scheduler->Submit({kPrompt, {}, 3});
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(refused.status().message()),
              HasSubstr("memory node tcp://n:1"));
  {
    absl::MutexLock lock(&mu);
    node = absl::OkStatus();
  }
  auto again = scheduler->Submit({kPrompt, {}, 3});
  ASSERT_TRUE(again.ok()) << again.status();
  GenerationEvent event;
  do {
    ASSERT_TRUE((*again)->Next(absl::Seconds(60), &event));
  } while (event.kind == GenerationEvent::Kind::kToken);
  EXPECT_EQ(event.kind, GenerationEvent::Kind::kFinished);
  scheduler->Shutdown(absl::Seconds(10));
}

// Within kv_down_wait the queued requests wait for the node (a restart)
// and run once it is back; none fails.
TEST_F(GenerationServiceTest, QueuedRequestsWaitForANodeThatComesBack) {
  absl::Mutex mu;
  absl::Status node = absl::UnavailableError("memory node tcp://n:1: down");
  GenerationSchedulerOptions options;
  options.kv_down_wait = absl::Seconds(30);
  options.kv_health = [&] {
    absl::MutexLock lock(&mu);
    return node;
  };
  std::unique_ptr<GenerationScheduler> scheduler = NewScheduler(2, options);
  ASSERT_NE(scheduler, nullptr);
  scheduler->Start();
  std::vector<std::shared_ptr<GenerationStream>> streams;
  for (int i = 0; i < 3; ++i) {
    auto q = scheduler->Submit({kPrompt, {}, 3});
    ASSERT_TRUE(q.ok()) << q.status();  // down, but within the wait
    streams.push_back(*q);
  }
  GenerationEvent event;
  EXPECT_FALSE(streams[0]->Next(absl::Milliseconds(200), &event));  // held
  {
    absl::MutexLock lock(&mu);
    node = absl::OkStatus();
  }
  for (auto& q : streams) {
    do {
      ASSERT_TRUE(q->Next(absl::Seconds(60), &event));
    } while (event.kind == GenerationEvent::Kind::kToken);
    EXPECT_EQ(event.kind, GenerationEvent::Kind::kFinished);
  }
  scheduler->Shutdown(absl::Seconds(10));
}

TEST(Utf8Assembler, HoldsBackSplitCharactersAndReplacesBadBytes) {
  Utf8Assembler a;
  EXPECT_EQ(a.Add("ab"), "ab");
  EXPECT_EQ(a.Add("\xC3"), "");  // first byte of é
  EXPECT_EQ(a.Add("\xA9 x"), "\xC3\xA9 x");
  EXPECT_EQ(a.Add("\xE2\x82"), "");  // two of the three bytes of €
  EXPECT_EQ(a.Add("\xAC"), "\xE2\x82\xAC");
  EXPECT_EQ(a.Add("\xFF" "a"), "\xEF\xBF\xBD" "a");
  EXPECT_EQ(a.Add("\xC3" "b"), "\xEF\xBF\xBD" "b");  // cut short
  EXPECT_EQ(a.Add("\xC0\xAF"), "\xEF\xBF\xBD\xEF\xBF\xBD");  // overlong
  EXPECT_EQ(a.Add("\xED\xA0\x80"),  // a surrogate
            "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD");
  EXPECT_EQ(a.Add("\xF0\x9F"), "");
  EXPECT_EQ(a.Flush(), "\xEF\xBF\xBD");
  EXPECT_EQ(a.Flush(), "");
  EXPECT_EQ(a.Add("\xF0\x9F\x98\x80"), "\xF0\x9F\x98\x80");
}

TEST(GenerationScheduler, RejectsBadOptions) {
  auto w = model::LoadLlama2cWeights(kModel);
  ASSERT_TRUE(w.ok()) << w.status();
  auto tok = model::Llama2cTokenizer::Load(kTokenizer, w->config.vocab_size);
  ASSERT_TRUE(tok.ok()) << tok.status();
  auto engine = Engine::Create(*w, NewCpuBackend());
  ASSERT_TRUE(engine.ok()) << engine.status();
  GenerationSchedulerOptions options;
  options.max_queue = 0;
  auto s = GenerationScheduler::Create(std::move(*engine), **tok, options);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(GenerationScheduler::Create(nullptr, **tok).status().code(),
            absl::StatusCode::kInvalidArgument);
  auto engine2 = Engine::Create(*w, NewCpuBackend());
  ASSERT_TRUE(engine2.ok()) << engine2.status();
  GenerationSchedulerOptions negative;
  negative.max_prefills_per_step = -1;
  EXPECT_EQ(GenerationScheduler::Create(std::move(*engine2), **tok, negative)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace infinigen::gpu_worker
