// Client::Impl, shared by client.cc and the remote session (remote_session.cc): the gRPC channel
// and the one way every call is made (deadline, and for a remote daemon the tenant's secret).
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <string_view>

#include <grpcpp/grpcpp.h>

#include "specache/client.h"
#include "specache/v1/control.grpc.pb.h"

namespace specache::client {

inline constexpr std::string_view kTcpScheme = "tcp://";

inline Status FromGrpc(const grpc::Status& s, const char* call) {
  if (s.ok()) return Status::Ok();
  return Status(static_cast<StatusCode>(s.error_code()), std::string(call) + ": " + s.error_message());
}

struct Client::Impl {
  ClientOptions options;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::Control::Stub> stub;
  // A daemon on another host: where it is (host:port of its control plane), and the tenant and
  // secret every call carries.
  bool remote = false;
  std::string remote_address, tenant, secret;

  // The TLS channel to "host:port" (client_remote.cc).
  Status ConnectRemote(const std::string& host_port, const RemoteCredentials& credentials, grpc::ChannelArguments* args);

  template <typename Req, typename Resp, typename Method>
  Status Call(Method method, const char* name, const Req& req, Resp* resp) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + options.deadline);
    if (remote) {
      ctx.AddMetadata("x-specache-tenant", tenant);
      ctx.AddMetadata("x-specache-secret", secret);
    }
    return FromGrpc((stub.get()->*method)(&ctx, req, resp), name);
  }
};

}  // namespace specache::client
