// Attaching a session by hand: the attach protocol without the client library, for tests that
// drive a session with raw control calls (its token in hand) and need it to stay alive meanwhile.
#pragma once

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include "specache/attach_protocol.h"
#include "specache/v1/control.grpc.pb.h"

namespace specache::testing {

// Opens a session of `tenant` with a raw control call, its id, token and attach path in `opened`
// (attach it with AttachByHand, or it ends at the daemon's lease): the call's status.
inline grpc::Status OpenSessionByHand(v1::Control::Stub& stub, const std::string& tenant, uint64_t pool_bytes,
                                      v1::OpenSessionResponse* opened) {
  v1::OpenSessionRequest open;
  open.set_tenant(tenant);
  open.set_pool_bytes(pool_bytes);
  grpc::ClientContext ctx;
  return stub.OpenSession(&ctx, open, opened);
}

// Connects to `attach_path`, attaches session `session_id` with its 16-byte `token` and checks
// the daemon's answer: the connected socket (the caller closes it), or -1 after a failed EXPECT.
// The descriptors the reply carries are not received (the session needs none to stay alive).
inline int AttachByHand(const std::string& attach_path, uint64_t session_id, const std::string& token) {
  const int fd = socket(AF_UNIX, SOCK_STREAM, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  EXPECT_LT(attach_path.size(), sizeof addr.sun_path);
  std::strncpy(addr.sun_path, attach_path.c_str(), sizeof addr.sun_path - 1);
  attach::AttachRequest request;
  request.session_id = session_id;
  std::memcpy(request.token.data(), token.data(), std::min(token.size(), request.token.size()));
  attach::AttachReply reply;
  const bool attached = fd >= 0 && connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0 &&
                        write(fd, &request, sizeof request) == static_cast<ssize_t>(sizeof request) &&
                        read(fd, &reply, sizeof reply) == static_cast<ssize_t>(sizeof reply) && reply.code == 0;
  EXPECT_TRUE(attached) << "attaching session " << session_id << " by hand at " << attach_path;
  if (attached) return fd;
  if (fd >= 0) close(fd);
  return -1;
}

}  // namespace specache::testing
