// gRPC's own log lines in the project's form. gRPC logs a failed bind or a
// failed handshake as a multi-line dump of nested statuses; routed here,
// each is one line ("grpc: ..." as a warning for its errors, debug output
// for the rest), and while a server starts (whose failure its caller
// reports in a line of its own) all of them are debug output.
#ifndef INFINIGEN_COMMON_GRPC_LOG_H_
#define INFINIGEN_COMMON_GRPC_LOG_H_

namespace infinigen {

// Installs the routing; `starting` as for SetGrpcLogStarting.
void RouteGrpcLogs(bool starting);
// While true, every gRPC line is debug output.
void SetGrpcLogStarting(bool starting);

}  // namespace infinigen

#endif  // INFINIGEN_COMMON_GRPC_LOG_H_
