#include "gpu_worker/serving/generation_service.h"

#include <algorithm>
#include <chrono>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/address.h"
#include "common/api_key.h"
#include "common/log.h"
#include "common/status.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_builder.h"
#include "grpcpp/server_context.h"

namespace infinigen::gpu_worker {
namespace {

// How often a handler waiting for its next token checks whether the client
// is still there.
constexpr absl::Duration kCancelPoll = absl::Milliseconds(50);

constexpr char kServiceName[] = "infinigen.worker.Worker";

// Same code and message; the two code enums agree numerically.
grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()),
                      std::string(status.message()));
}

GenerationRequest FromProto(const worker::GenerateRequest& r) {
  GenerationRequest out;
  out.prompt = r.prompt();
  out.prompt_tokens.assign(r.prompt_tokens().begin(), r.prompt_tokens().end());
  out.max_new_tokens = r.max_new_tokens();
  out.temperature = r.temperature();
  out.top_p = r.has_top_p() ? r.top_p() : 1.0f;
  out.seed = r.seed();
  return out;
}

worker::FinishReason ToProto(FinishReason reason) {
  switch (reason) {
    case FinishReason::kLength:
      return worker::FINISH_REASON_LENGTH;
    case FinishReason::kEndToken:
      return worker::FINISH_REASON_END_TOKEN;
    case FinishReason::kContextFull:
      return worker::FINISH_REASON_CONTEXT_FULL;
  }
  return worker::FINISH_REASON_UNSPECIFIED;
}

void ToProto(const GenerationSummary& s, worker::Finished* out) {
  out->set_reason(ToProto(s.reason));
  out->set_prompt_tokens(s.prompt_tokens);
  out->set_cached_tokens(s.cached_tokens);
  out->set_generated_tokens(s.generated_tokens);
  out->set_text(s.text);
  out->set_queue_seconds(s.queue_seconds);
  out->set_prefill_seconds(s.prefill_seconds);
  out->set_decode_seconds(s.decode_seconds);
}

}  // namespace

grpc::Status GenerationService::Generate(
    grpc::ServerContext* ctx, const worker::GenerateRequest* request,
    grpc::ServerWriter<worker::GenerateResponse>* writer) {
  if (!api_key_.empty()) {
    const auto& md = ctx->client_metadata();
    const auto it = md.find("authorization");
    absl::string_view presented;
    if (it != md.end()) presented = {it->second.data(), it->second.size()};
    const absl::Status auth = CheckApiKey(&presented, api_key_);
    if (!auth.ok()) return ToGrpcStatus(auth);
  }
  absl::StatusOr<std::shared_ptr<GenerationStream>> submitted =
      scheduler_->Submit(FromProto(*request));
  if (!submitted.ok()) return ToGrpcStatus(submitted.status());
  GenerationStream& stream = **submitted;
  // Tells the client it was accepted (queued), before its first token.
  writer->SendInitialMetadata();
  const grpc::Status gone(grpc::StatusCode::CANCELLED,
                          "the client went away");
  GenerationEvent event;
  worker::GenerateResponse response;
  while (true) {
    if (ctx->IsCancelled()) {
      stream.Cancel();
      return gone;
    }
    if (!stream.Next(kCancelPoll, &event)) continue;
    response.Clear();
    switch (event.kind) {
      case GenerationEvent::Kind::kToken: {
        worker::Token* token = response.mutable_token();
        token->set_id(event.token);
        token->set_text(std::move(event.text));
        if (!writer->Write(response)) {
          stream.Cancel();
          return gone;
        }
        break;
      }
      case GenerationEvent::Kind::kFinished:
        ToProto(event.summary, response.mutable_finished());
        if (!writer->Write(response)) return gone;
        return grpc::Status::OK;
      case GenerationEvent::Kind::kError:
        return ToGrpcStatus(event.status);
    }
  }
}

absl::StatusOr<std::unique_ptr<GenerationServer>> GenerationServer::Start(
    std::unique_ptr<GenerationScheduler> scheduler,
    const GenerationServerOptions& options) {
  const std::string& listen = options.listen;
  bool unix_socket = false;
  if (!listen.empty()) {  // empty: in-process channels only
    IG_ASSIGN_OR_RETURN(const ListenAddress parsed, ParseListenAddress(listen));
    unix_socket = parsed.is_unix();
  }
  IG_ASSIGN_OR_RETURN(std::shared_ptr<grpc::ServerCredentials> credentials,
                      GrpcServerCredentials(options.tls));
  std::unique_ptr<GenerationServer> server(new GenerationServer);
  server->scheduler_ = std::move(scheduler);
  server->service_ =
      std::make_unique<GenerationService>(server->scheduler_.get(),
                                          options.api_key);

  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  int port = 0;
  if (!listen.empty()) {
    builder.AddListeningPort(listen, credentials, &port);
  }
  builder.RegisterService(server->service_.get());
  // A second server on the same port must fail, not share it.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  server->server_ = builder.BuildAndStart();
  if (server->server_ == nullptr || (!listen.empty() && port == 0)) {
    server->server_.reset();
    const std::string why = WhyNotListening(listen);
    return absl::UnavailableError(absl::StrCat(
        "cannot listen on '", listen, "': ",
        why.empty() ? "the address is taken or not allowed" : why));
  }
  server->port_ = unix_socket ? 0 : port;
  server->dependency_health_ = options.dependency_health;
  server->health_poll_interval_ = options.health_poll_interval;
  grpc::HealthCheckServiceInterface* health =
      server->server_->GetHealthCheckService();
  health->SetServingStatus(GenerationServer::kLivenessService, true);
  {
    absl::MutexLock lock(&server->health_mu_);
    server->UpdateHealth();
  }
  if (server->dependency_health_) {
    GenerationServer* raw = server.get();
    server->health_thread_ = std::thread([raw] { raw->WatchHealth(); });
  }
  IG_LOG(INFO) << "infinigen serve: listening on "
               << (listen.empty() ? std::string("(in-process only)")
                   : unix_socket ? listen
                                 : absl::StrCat(listen.substr(
                                                    0, listen.rfind(':')),
                                                ":", port))
               << (!options.tls.enabled()  ? ""
                   : options.tls.mutual() ? " over TLS (mutual)"
                                          : " over TLS")
               << ", " << server->scheduler_->slots() << " sequence slots of "
               << server->scheduler_->max_seq_len() << " tokens";
  return server;
}

GenerationServer::~GenerationServer() {
  if (server_ == nullptr) return;
  Shutdown(absl::ZeroDuration());
  Wait();
}

bool GenerationServer::serving() const {
  absl::MutexLock lock(&health_mu_);
  return serving_;
}

void GenerationServer::UpdateHealth() {
  if (shut_down_) return;
  const absl::Status status =
      dependency_health_ ? dependency_health_() : absl::OkStatus();
  const bool serving = status.ok();
  if (published_ && serving == serving_) return;
  grpc::HealthCheckServiceInterface* health = server_->GetHealthCheckService();
  health->SetServingStatus(kServiceName, serving);
  health->SetServingStatus("", serving);
  // The first publication (at Start) is not a change worth a line unless
  // the dependency already fails.
  if (!serving) {
    IG_LOG(WARNING) << "infinigen serve: health NOT_SERVING: " << status;
  } else if (published_) {
    IG_LOG(INFO) << "infinigen serve: health SERVING again";
  }
  serving_ = serving;
  published_ = true;
}

void GenerationServer::WatchHealth() {
  absl::MutexLock lock(&health_mu_);
  while (!health_mu_.AwaitWithTimeout(absl::Condition(&shut_down_),
                                      health_poll_interval_)) {
    UpdateHealth();
  }
}

void GenerationServer::StopHealthThread() {
  {
    absl::MutexLock lock(&health_mu_);
    shut_down_ = true;
    serving_ = false;
  }
  if (health_thread_.joinable()) health_thread_.join();
}

std::shared_ptr<grpc::Channel> GenerationServer::InProcessChannel() {
  return server_->InProcessChannel(grpc::ChannelArguments());
}

void GenerationServer::Shutdown(absl::Duration grace) {
  const absl::Time deadline = absl::Now() + grace;
  StopHealthThread();
  grpc::HealthCheckServiceInterface* health =
      server_->GetHealthCheckService();
  health->SetServingStatus(false);  // every service, liveness too
  scheduler_->Shutdown(grace);
  // Every stream has its last event now; what is left of the grace (at
  // least a second) lets the handlers write it to their clients.
  server_->Shutdown(absl::ToChronoTime(
      std::max(deadline, absl::Now() + absl::Seconds(1))));
}

void GenerationServer::Wait() { server_->Wait(); }

}  // namespace infinigen::gpu_worker
