// A client process for the daemon's integration tests (a separate binary: gRPC and fork() do not
// mix). Modes:
//   write-verify SOCKET SEED TOKENS   session + sequence through DaemonSource, rows written and read
//                                     back; exit 0 when every byte matches
//   hold SOCKET TENANT                session + sequence, prints "ready <session>" and sleeps until killed
//   attach-as UID SOCKET TENANT       setuid(UID) first, then tries to open and attach; prints the status
//   open SOCKET TENANT BYTES          open and attach through the client library; prints the status, then
//                                     "closed" after the session is closed and exits
//   call SOCKET METHOD [ID]           one raw control call (OpenSession:TENANT:BYTES, CloseSession, Spill,
//                                     SpillAll, Restore, Evict, VerifySpill, ListSessions, ListSequences, Stats); prints
//                                     "<CODE> <message>" and, for the lists and Stats, what came back
//   close-keep SOCKET TENANT BYTES DELAY_MS
//                                     open and attach by hand, map the chunks, wait DELAY_MS, CloseSession but
//                                     keep the chunk descriptors and mappings; prints "closed <code>", sleeps
//   flood PATH N                      N connections to a Unix socket, idle; after 300 ms prints
//                                     "open <connected and not closed by the daemon>", sleeps
// The hostile-user tests run these as another uid with setpriv.
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <thread>

#include <grpcpp/grpcpp.h>

#include "specache/attach_protocol.h"
#include "specache/client.h"
#include "specache/daemon_source.h"
#include "specache/fd_passing.h"
#include "specache/v1/control.grpc.pb.h"

using namespace specache;

namespace {

int Fail(const char* what, const Status& s) {
  std::fprintf(stderr, "test_client: %s: %s\n", what, s.ToString().c_str());
  return 2;
}

int WriteVerify(const std::string& socket, uint32_t seed, int tokens) {
  auto client = client::Client::Connect({socket, std::chrono::milliseconds(3000), "write-verify"});
  if (!client.ok()) return Fail("connect", client.status());
  auto session = (*client)->OpenSession("default", 8 << 20);
  if (!session.ok()) return Fail("open", session.status());
  const SequenceLayout layout{4, 2, 64};
  client::DaemonSource source(session->get(), 16, 4096);
  if (Status s = source.CreateSequence(1, layout); !s.ok()) return Fail("create", s);
  std::mt19937 rng(seed);
  std::vector<Half> rows(static_cast<size_t>(tokens) * 2 * 64);
  std::vector<std::vector<Half>> written(8);
  // Written in uneven pieces per (layer, head), as prefill + decode would.
  for (int l = 0; l < 4; ++l) {
    for (int h = 0; h < 2; ++h) {
      auto& w = written[l * 2 + h];
      w.resize(rows.size());
      for (auto& x : w) x = static_cast<Half>(rng());
      int at = 0;
      while (at < tokens) {
        const int n = std::min(tokens - at, 1 + static_cast<int>(rng() % 37));
        if (Status s = source.AppendRows(1, l, h, at, w.data() + static_cast<size_t>(at) * 128, n); !s.ok()) {
          return Fail("append", s);
        }
        at += n;
      }
    }
  }
  std::vector<int32_t> all(tokens);
  for (int i = 0; i < tokens; ++i) all[i] = tokens - 1 - i;  // read in reverse order
  std::vector<Half> back(rows.size());
  for (int l = 0; l < 4; ++l) {
    for (int h = 0; h < 2; ++h) {
      if (Status s = source.ReadRows(1, l, h, all.data(), tokens, back.data()); !s.ok()) return Fail("read", s);
      const auto& w = written[l * 2 + h];
      for (int i = 0; i < tokens; ++i) {
        if (std::memcmp(back.data() + static_cast<size_t>(i) * 128, w.data() + static_cast<size_t>(all[i]) * 128, 256)) {
          std::fprintf(stderr, "test_client: mismatch at layer %d head %d token %d\n", l, h, all[i]);
          return 3;
        }
      }
    }
  }
  std::printf("ok extend_rpcs=%llu\n", static_cast<unsigned long long>(source.extend_rpcs()));
  return 0;
}

int Hold(const std::string& socket, const std::string& tenant) {
  auto client = client::Client::Connect({socket, std::chrono::milliseconds(3000), "hold"});
  if (!client.ok()) return Fail("connect", client.status());
  auto session = (*client)->OpenSession(tenant, 4 << 20);
  if (!session.ok()) return Fail("open", session.status());
  auto seq = (*session)->CreateSequence({4, 2, 64, 16, 1024});
  if (!seq.ok()) return Fail("create", seq.status());
  if (auto e = (*session)->Extend(*seq, 500); !e.ok()) return Fail("extend", e.status());
  std::printf("ready %llu\n", static_cast<unsigned long long>((*session)->id()));
  std::fflush(stdout);
  while (true) std::this_thread::sleep_for(std::chrono::seconds(1));
}

int AttachAs(uid_t uid, const std::string& socket, const std::string& tenant) {
  if (setgid(uid) != 0 || setuid(uid) != 0) return Fail("setuid", Status::PermissionDenied("cannot switch user"));
  auto client = client::Client::Connect({socket, std::chrono::milliseconds(3000), "attach-as"});
  if (!client.ok()) return Fail("connect", client.status());
  auto session = (*client)->OpenSession(tenant, 4 << 20);
  std::printf("%s\n", session.ok() ? "OK" : session.status().ToString().c_str());
  return 0;
}

int Open(const std::string& socket, const std::string& tenant, uint64_t bytes) {
  auto client = client::Client::Connect({socket, std::chrono::milliseconds(3000), "open"});
  if (!client.ok()) return Fail("connect", client.status());
  {
    auto session = (*client)->OpenSession(tenant, bytes);
    std::printf("%s\n", session.ok() ? "OK" : session.status().ToString().c_str());
    std::fflush(stdout);
  }
  std::printf("closed\n");
  return 0;
}

std::string CodeName(grpc::StatusCode code) { return StatusCodeName(static_cast<StatusCode>(code)); }

int Call(const std::string& socket, const std::string& method, uint64_t id) {
  auto stub = v1::Control::NewStub(grpc::CreateChannel("unix:" + socket, grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(3));
  grpc::Status st;
  std::string extra;
  if (method.rfind("OpenSession:", 0) == 0) {
    const size_t colon = method.find(':', 12);
    v1::OpenSessionRequest r;
    r.set_tenant(method.substr(12, colon - 12));
    r.set_pool_bytes(std::stoull(method.substr(colon + 1)));
    r.set_client_name("call");
    v1::OpenSessionResponse resp;
    st = stub->OpenSession(&ctx, r, &resp);
  } else if (method == "CloseSession") {  // ID: the session; a token of the right length, all zeros
    v1::CloseSessionRequest r;
    r.set_session_id(id);
    r.set_token(std::string(16, '\0'));
    v1::CloseSessionResponse resp;
    st = stub->CloseSession(&ctx, r, &resp);
  } else if (method == "Spill" || method == "SpillAll") {
    v1::SpillRequest r;
    r.set_sequence_id(id);
    r.set_all(method == "SpillAll");
    v1::SpillResponse resp;
    st = stub->Spill(&ctx, r, &resp);
  } else if (method == "Restore") {
    v1::RestoreRequest r;
    r.set_sequence_id(id);
    v1::RestoreResponse resp;
    st = stub->Restore(&ctx, r, &resp);
  } else if (method == "Evict") {
    v1::EvictRequest r;
    r.set_sequence_id(id);
    v1::EvictResponse resp;
    st = stub->Evict(&ctx, r, &resp);
  } else if (method == "VerifySpill") {
    v1::VerifySpillResponse resp;
    st = stub->VerifySpill(&ctx, v1::VerifySpillRequest(), &resp);
  } else if (method == "ListSessions") {
    v1::ListSessionsResponse resp;
    st = stub->ListSessions(&ctx, v1::ListSessionsRequest(), &resp);
    extra = " sessions=" + std::to_string(resp.sessions_size());
  } else if (method == "ListSequences") {
    v1::ListSequencesResponse resp;
    st = stub->ListSequences(&ctx, v1::ListSequencesRequest(), &resp);
    extra = " sequences=" + std::to_string(resp.sequences_size());
  } else if (method == "Stats") {
    v1::StatsResponse resp;
    st = stub->Stats(&ctx, v1::StatsRequest(), &resp);
    extra = " tenants=";
    for (const auto& t : resp.tenants()) extra += t.tenant() + ",";
  } else {
    std::fprintf(stderr, "test_client: unknown method %s\n", method.c_str());
    return 1;
  }
  std::printf("%s %s%s\n", CodeName(st.error_code()).c_str(), st.error_message().c_str(), extra.c_str());
  return 0;
}

// A client that closes its session but keeps the chunks (the quota escape the daemon must charge).
int CloseKeep(const std::string& socket, const std::string& tenant, uint64_t bytes, int delay_ms) {
  auto stub = v1::Control::NewStub(grpc::CreateChannel("unix:" + socket, grpc::InsecureChannelCredentials()));
  grpc::ClientContext open_ctx;
  v1::OpenSessionRequest open;
  open.set_tenant(tenant);
  open.set_pool_bytes(bytes);
  v1::OpenSessionResponse opened;
  if (grpc::Status st = stub->OpenSession(&open_ctx, open, &opened); !st.ok()) {
    std::printf("open %s %s\n", CodeName(st.error_code()).c_str(), st.error_message().c_str());
    return 2;
  }
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::snprintf(addr.sun_path, sizeof addr.sun_path, "%s", opened.attach_path().c_str());
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) return Fail("attach", Status::Unavailable("connect"));
  attach::AttachRequest request;
  request.session_id = opened.session_id();
  std::memcpy(request.token.data(), opened.token().data(), request.token.size());
  if (write(fd, &request, sizeof request) != static_cast<ssize_t>(sizeof request)) return 2;
  std::vector<int> fds;
  for (uint32_t got = 0; got < opened.chunk_count() + 1;) {
    attach::AttachReply reply;
    std::vector<int> more;
    if (Status s = RecvWithFds(fd, &reply, sizeof reply, &more, 3000); !s.ok()) return Fail("attach reply", s);
    if (reply.code != 0) return Fail("attach", Status(static_cast<StatusCode>(reply.code), reply.message));
    fds.insert(fds.end(), more.begin(), more.end());
    got += static_cast<uint32_t>(more.size());
  }
  for (size_t i = 1; i < fds.size(); ++i) {
    void* p = mmap(nullptr, opened.chunk_bytes(), PROT_READ | PROT_WRITE, MAP_SHARED, fds[i], 0);
    if (p == MAP_FAILED) return Fail("mmap", Status::Internal("mmap"));
    std::memset(p, 0x42, opened.chunk_bytes());
  }
  std::printf("attached %llu\n", static_cast<unsigned long long>(opened.session_id()));
  std::fflush(stdout);
  std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
  grpc::ClientContext close_ctx;
  close_ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  v1::CloseSessionRequest close;
  close.set_session_id(opened.session_id());
  close.set_token(opened.token());
  v1::CloseSessionResponse closed;
  const grpc::Status st = stub->CloseSession(&close_ctx, close, &closed);
  std::printf("closed %s\n", CodeName(st.error_code()).c_str());
  std::fflush(stdout);
  while (true) std::this_thread::sleep_for(std::chrono::seconds(1));  // descriptors and mappings kept
}

int Flood(const std::string& path, int n) {
  std::vector<int> fds;
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::snprintf(addr.sun_path, sizeof addr.sun_path, "%s", path.c_str());
  for (int i = 0; i < n; ++i) {
    // Non-blocking: a full listen backlog (a daemon out of descriptors) fails fast with EAGAIN.
    const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) break;
    if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
      close(fd);
      continue;
    }
    fds.push_back(fd);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  int open = 0;
  for (int fd : fds) {
    // Closed by the daemon: end of file (a gRPC server that kept the connection may have sent
    // its settings: readable, but not at its end).
    pollfd p{fd, POLLIN, 0};
    char byte = 0;
    const bool closed = poll(&p, 1, 0) == 1 && ((p.revents & (POLLHUP | POLLERR)) != 0 ||
                                                recv(fd, &byte, 1, MSG_PEEK | MSG_DONTWAIT) == 0);
    open += closed ? 0 : 1;
  }
  std::printf("open %d\n", open);
  std::fflush(stdout);
  while (true) std::this_thread::sleep_for(std::chrono::seconds(1));
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "write-verify" && argc == 5) return WriteVerify(argv[2], std::stoul(argv[3]), std::stoi(argv[4]));
  if (mode == "hold" && argc == 4) return Hold(argv[2], argv[3]);
  if (mode == "attach-as" && argc == 5) return AttachAs(static_cast<uid_t>(std::stoul(argv[2])), argv[3], argv[4]);
  if (mode == "open" && argc == 5) return Open(argv[2], argv[3], std::stoull(argv[4]));
  if (mode == "call" && (argc == 4 || argc == 5)) return Call(argv[2], argv[3], argc == 5 ? std::stoull(argv[4]) : 0);
  if (mode == "close-keep" && argc == 6) return CloseKeep(argv[2], argv[3], std::stoull(argv[4]), std::stoi(argv[5]));
  if (mode == "flood" && argc == 4) return Flood(argv[2], std::stoi(argv[3]));
  std::fprintf(stderr,
               "usage: test_client write-verify SOCKET SEED TOKENS | hold SOCKET TENANT | attach-as UID SOCKET TENANT |\n"
               "       open SOCKET TENANT BYTES | call SOCKET METHOD [ID] | close-keep SOCKET TENANT BYTES DELAY_MS |\n"
               "       flood PATH N\n");
  return 1;
}
