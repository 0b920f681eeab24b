#include "specache/client.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <chrono>
#include <limits>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_set>

#include <grpcpp/grpcpp.h>

#include "attached_pages.h"
#include "client_impl.h"
#include "session_calls.h"
#include "specache/attach_protocol.h"
#include "specache/fd_passing.h"
#include "specache/v1/control.grpc.pb.h"

namespace specache::client {

struct Session::Impl {
  SessionCalls calls;
  int attach_fd = -1;
  std::unique_ptr<AttachedPages> pages;  // the table and chunks, once attached
  std::atomic<uint64_t> extend_rpcs{0};
  // The sequences a DaemonSource holds (Session::Hold): Release and Keep refuse them.
  mutable std::mutex held_mu;
  std::unordered_set<uint64_t> held;

  bool Held(uint64_t sequence) const {
    std::lock_guard<std::mutex> lock(held_mu);
    return held.count(sequence) != 0;
  }
  // Release and Keep without the mark's check (the holder's, and everyone's for the others).
  Status ReleaseUnchecked(uint64_t sequence) {
    SPECACHE_RETURN_IF_ERROR(pages->SlotOf(sequence).status());
    SPECACHE_RETURN_IF_ERROR(calls.ReleaseSequence(sequence));
    pages->Forget(sequence);
    return Status::Ok();
  }
  Status KeepUnchecked(uint64_t sequence) {
    SPECACHE_RETURN_IF_ERROR(pages->SlotOf(sequence).status());
    return calls.KeepSequence(sequence);
  }

  ~Impl() {
    // Unmapped before the close: the daemon sees the chunks are no longer held, zeroes and reuses
    // them; chunks still mapped at the close stay charged to the tenant until they are let go.
    pages.reset();
    // Best effort: if it fails, the daemon still ends the session when the attach connection
    // closes below.
    calls.Close();
    if (attach_fd >= 0) close(attach_fd);
  }

  // Within the client's deadline as a whole: the connect (a daemon whose listen backlog is full
  // does not accept it) and every reply.
  Status Attach(const std::string& path, uint32_t expected_chunks) {
    const auto budget = std::min<std::chrono::milliseconds>(calls.client()->options.deadline,
                                                            std::chrono::milliseconds(std::numeric_limits<int>::max()));
    const auto until = std::chrono::steady_clock::now() + budget;
    auto left_ms = [&] {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - std::chrono::steady_clock::now());
      return static_cast<int>(std::clamp<int64_t>(left.count(), 0, std::numeric_limits<int>::max()));
    };
    attach_fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (attach_fd < 0) return Status::ResourceExhausted("socket: " + std::string(std::strerror(errno)));
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    if (path.size() >= sizeof addr.sun_path) return Status::InvalidArgument("attach path too long: " + path);
    std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
    while (connect(attach_fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
      if (errno == EINTR) continue;
      if (errno != EAGAIN) return Status::Unavailable("attach socket " + path + ": " + std::strerror(errno));
      if (left_ms() == 0) return Status::DeadlineExceeded("attach socket " + path + ": the daemon accepts no connection");
      std::this_thread::sleep_for(std::chrono::milliseconds(5));  // a Unix socket's full backlog: try again
    }
    const int flags = fcntl(attach_fd, F_GETFL);
    if (flags < 0 || fcntl(attach_fd, F_SETFL, flags & ~O_NONBLOCK) != 0) {
      return Status::Unavailable("attach socket " + path + ": " + std::strerror(errno));
    }
    attach::AttachRequest req;
    req.session_id = calls.id();
    std::memcpy(req.token.data(), calls.token().data(), req.token.size());
    SPECACHE_RETURN_IF_ERROR(SendWithFds(attach_fd, &req, sizeof req, {}));
    std::vector<int> fds;
    uint32_t total = 0;
    attach::AttachReply first;
    do {
      attach::AttachReply raw;
      const size_t before = fds.size();
      Status s = RecvWithFds(attach_fd, &raw, sizeof raw, &fds, left_ms());
      auto reply = s.ok() ? attach::ParseReply(std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(&raw), sizeof raw))
                          : Result<attach::AttachReply>(s);
      if (reply.ok() && reply->code != 0) reply = Status(static_cast<StatusCode>(reply->code), reply->message);
      if (reply.ok() && (fds.size() - before != reply->n_fds || reply->first_fd != before ||
                         (total != 0 && reply->total_fds != total))) {
        reply = Status::DataLoss("attach reply: descriptors out of order");
      }
      if (!reply.ok()) {
        for (int fd : fds) close(fd);
        return reply.status().WithContext("attach");
      }
      if (total == 0) first = *reply;
      total = reply->total_fds;
    } while (fds.size() < total);
    auto mapped = AttachedPages::Map(first, fds, expected_chunks);
    for (int fd : fds) close(fd);
    if (!mapped.ok()) return mapped.status();
    pages = std::move(*mapped);
    return Status::Ok();
  }
};

Client::Client(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Client::~Client() = default;

Result<std::unique_ptr<Client>> Client::Connect(const ClientOptions& options) {
  return Connect(options, options.socket.rfind(kTcpScheme, 0) == 0 ? RemoteCredentials::FromEnvironment()
                                                                   : RemoteCredentials{});
}

bool Client::remote() const { return impl_->remote; }

Result<std::unique_ptr<Client>> Client::Connect(const ClientOptions& options, const RemoteCredentials& remote) {
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(16 << 20);
  if (options.socket.rfind(kTcpScheme, 0) == 0) {
    SPECACHE_RETURN_IF_ERROR(impl->ConnectRemote(options.socket.substr(kTcpScheme.size()), remote, &args));
  } else {
    impl->channel = grpc::CreateCustomChannel("unix:" + options.socket, grpc::InsecureChannelCredentials(), args);
  }
  if (!impl->channel->WaitForConnected(std::chrono::system_clock::now() + options.deadline)) {
    return Status::Unavailable("no specached at " + options.socket + " (waited " +
                               std::to_string(options.deadline.count()) + " ms" +
                               (impl->remote ? "; for tcp://, also check the TLS certificates" : "") + ")");
  }
  impl->stub = v1::Control::NewStub(impl->channel);
  return std::unique_ptr<Client>(new Client(std::move(impl)));
}

Result<std::unique_ptr<Session>> Client::OpenSession(const std::string& tenant, uint64_t pool_bytes) {
  if (impl_->remote) {
    return Status::FailedPrecondition("a daemon on another host shares no memory: open a remote session "
                                      "(specache/remote_session.h)");
  }
  v1::OpenSessionRequest req;
  req.set_tenant(tenant);
  req.set_pool_bytes(pool_bytes);
  req.set_client_name(impl_->options.client_name);
  v1::OpenSessionResponse resp;
  SPECACHE_RETURN_IF_ERROR(impl_->Call(&v1::Control::Stub::OpenSession, "OpenSession", req, &resp));
  auto s = std::make_unique<Session::Impl>();
  s->calls = SessionCalls(impl_, resp.session_id(), resp.token());
  SPECACHE_RETURN_IF_ERROR(s->Attach(resp.attach_path(), resp.chunk_count()));
  return std::unique_ptr<Session>(new Session(std::move(s)));
}

Result<DaemonStats> Client::Stats() {
  v1::StatsResponse r;
  SPECACHE_RETURN_IF_ERROR(impl_->Call(&v1::Control::Stub::Stats, "Stats", v1::StatsRequest(), &r));
  DaemonStats s;
  s.pool_bytes = r.pool_bytes();
  s.reserved_bytes = r.reserved_bytes();
  s.used_bytes = r.used_bytes();
  s.free_bytes = r.free_bytes();
  s.chunk_bytes = r.chunk_bytes();
  s.sessions = r.sessions();
  s.sequences = r.sequences();
  s.pages = r.pages();
  s.requests = r.requests();
  s.errors = r.errors();
  s.uptime_ms = r.uptime_ms();
  s.memory_locked = r.memory_locked();
  s.version = r.version();
  s.parked_bytes = r.parked_bytes();
  s.spilled_bytes = r.spilled_bytes();
  s.spill_disk_bytes = r.spill_disk_bytes();
  s.parked_sequences = r.parked_sequences();
  s.spilled_sequences = r.spilled_sequences();
  s.spill_tier = r.spill_tier();
  s.spills = r.spills();
  s.restores = r.restores();
  s.spill_bytes_total = r.spill_bytes_total();
  s.restore_bytes_total = r.restore_bytes_total();
  s.spill_seconds = r.spill_seconds();
  s.restore_seconds = r.restore_seconds();
  s.checksum_failures = r.checksum_failures();
  s.spill_read_errors = r.spill_read_errors();
  s.spill_write_errors = r.spill_write_errors();
  s.kept_dropped = r.kept_dropped();
  s.kept_evicted = r.kept_evicted();
  s.kept_evicted_bytes = r.kept_evicted_bytes();
  s.attach_connections = r.attach_connections();
  s.refused_connections = r.refused_connections();
  s.accept_errors = r.accept_errors();
  s.denied_requests = r.denied_requests();
  s.chunks_out_of_service = r.chunks_out_of_service();
  s.pool_huge_bytes = r.pool_huge_bytes();
  s.spill_failures = r.spill_failures();
  s.spill_backoff_ms = r.spill_backoff_ms();
  s.spill_unreadable_records = r.spill_unreadable_records();
  s.spill_damaged_sequences = r.spill_damaged_sequences();
  s.remote_connections = r.remote_connections();
  s.remote_requests = r.remote_requests();
  s.remote_refused = r.remote_refused();
  s.remote_dropped = r.remote_dropped();
  for (const auto& t : r.tenants()) {
    s.tenants.push_back(
        {t.tenant(), t.reserved_bytes(), t.used_bytes(), t.quota_bytes(), t.sessions(), t.sequences(), t.retained_bytes()});
  }
  return s;
}

Result<std::vector<SessionRecord>> Client::ListSessions() {
  v1::ListSessionsResponse r;
  SPECACHE_RETURN_IF_ERROR(
      impl_->Call(&v1::Control::Stub::ListSessions, "ListSessions", v1::ListSessionsRequest(), &r));
  std::vector<SessionRecord> out;
  for (const auto& s : r.sessions()) {
    out.push_back({s.session_id(), s.tenant(), s.client_name(), s.pid(), s.uid(), s.attached(), s.chunks(),
                   s.sequences(), s.used_bytes(), s.age_ms()});
  }
  return out;
}

Result<std::vector<SequenceRecord>> Client::ListSequences() {
  v1::ListSequencesResponse r;
  SPECACHE_RETURN_IF_ERROR(
      impl_->Call(&v1::Control::Stub::ListSequences, "ListSequences", v1::ListSequencesRequest(), &r));
  std::vector<SequenceRecord> out;
  for (const auto& s : r.sequences()) {
    const auto& l = s.layout();
    out.push_back({s.sequence_id(), s.session_id(), s.tenant(),
                   {l.n_layers(), l.n_kv_heads(), l.head_dim(), l.page_tokens(), l.capacity_tokens(), l.dtype()},
                   s.pages_per_layer(), s.bytes(), s.state()});
  }
  return out;
}

Result<uint32_t> Client::Spill(uint64_t sequence) {
  v1::SpillRequest req;
  req.set_sequence_id(sequence);
  v1::SpillResponse r;
  SPECACHE_RETURN_IF_ERROR(impl_->Call(&v1::Control::Stub::Spill, "Spill", req, &r));
  return r.spilled();
}

Result<uint32_t> Client::SpillAll() {
  v1::SpillRequest req;
  req.set_all(true);
  v1::SpillResponse r;
  SPECACHE_RETURN_IF_ERROR(impl_->Call(&v1::Control::Stub::Spill, "Spill", req, &r));
  return r.spilled();
}

Status Client::Restore(uint64_t sequence) {
  v1::RestoreRequest req;
  req.set_sequence_id(sequence);
  v1::RestoreResponse r;
  return impl_->Call(&v1::Control::Stub::Restore, "Restore", req, &r);
}

Status Client::Evict(uint64_t sequence) {
  v1::EvictRequest req;
  req.set_sequence_id(sequence);
  v1::EvictResponse r;
  return impl_->Call(&v1::Control::Stub::Evict, "Evict", req, &r);
}

Result<SpillVerify> Client::VerifySpill() {
  v1::VerifySpillResponse r;
  SPECACHE_RETURN_IF_ERROR(impl_->Call(&v1::Control::Stub::VerifySpill, "VerifySpill", v1::VerifySpillRequest(), &r));
  SpillVerify v{r.sequences(), r.pages_checked(), r.pages_bad(), {r.bad().begin(), r.bad().end()}};
  return v;
}

Session::Session(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Session::~Session() = default;
uint64_t Session::id() const { return impl_->calls.id(); }
uint64_t Session::chunk_bytes() const { return impl_->pages->chunk_bytes(); }
uint32_t Session::chunk_count() const { return impl_->pages->chunk_count(); }
uint8_t* Session::chunk_data(uint32_t i) const { return impl_->pages->chunk(i); }
uint64_t Session::extend_rpcs() const { return impl_->extend_rpcs.load(); }

Result<uint64_t> Session::CreateSequence(const PageLayoutSpec& l) {
  SPECACHE_ASSIGN_OR_RETURN(v1::CreateSequenceResponse resp, impl_->calls.CreateSequence(l));
  if (Status added = impl_->pages->AddSlot(resp.sequence_id(), resp.table_slot(), l); !added.ok()) {
    // Not usable here (the table disagrees with the answer): given back, not left for the session's end.
    static_cast<void>(impl_->calls.ReleaseSequence(resp.sequence_id()));
    return added;
  }
  return resp.sequence_id();
}

Result<uint32_t> Session::Extend(uint64_t sequence, uint32_t tokens) {
  SPECACHE_ASSIGN_OR_RETURN(const AttachedPages::SlotView v, impl_->pages->SlotOf(sequence));
  const uint32_t have = impl_->pages->LivePages(v);
  if (uint64_t{have} * v.page_tokens >= tokens) return have;
  ++impl_->extend_rpcs;
  SPECACHE_ASSIGN_OR_RETURN(uint32_t pages, impl_->calls.ExtendSequence(sequence, tokens));
  SPECACHE_RETURN_IF_ERROR(impl_->pages->Recheck(v));
  return std::min(pages, v.capacity);
}

namespace {

Status HeldBySource(uint64_t sequence, const char* what) {
  return Status::FailedPrecondition("sequence " + std::to_string(sequence) + " is held by a DaemonSource, whose agent " +
                                    "uses its pages: " + what + " it through the source");
}

}  // namespace

Status Session::Release(uint64_t sequence) {
  if (impl_->Held(sequence)) return HeldBySource(sequence, "release");
  return impl_->ReleaseUnchecked(sequence);
}

Status Session::Keep(uint64_t sequence) {
  if (impl_->Held(sequence)) return HeldBySource(sequence, "keep");
  return impl_->KeepUnchecked(sequence);
}

void Session::Hold(uint64_t sequence) {
  std::lock_guard<std::mutex> lock(impl_->held_mu);
  impl_->held.insert(sequence);
}

Status Session::ReleaseHeld(uint64_t sequence) {
  const Status released = impl_->ReleaseUnchecked(sequence);
  if (released.ok() || released.code() == StatusCode::kNotFound) {  // the daemon no longer has it
    std::lock_guard<std::mutex> lock(impl_->held_mu);
    impl_->held.erase(sequence);
  }
  return released;
}

Status Session::KeepHeld(uint64_t sequence) { return impl_->KeepUnchecked(sequence); }

Result<uint32_t> Session::Claim(uint64_t sequence, const PageLayoutSpec& l) {
  SPECACHE_ASSIGN_OR_RETURN(v1::ClaimSequenceResponse resp, impl_->calls.ClaimSequence(sequence, l));
  if (Status added = impl_->pages->AddSlot(sequence, resp.table_slot(), l); !added.ok()) {
    // Not usable here: marked to keep again, so that the session's end parks it rather than drops
    // the claimed data.
    static_cast<void>(impl_->calls.KeepSequence(sequence));
    return added;
  }
  return resp.pages_per_layer();
}

Result<uint32_t> Session::PagesPerLayer(uint64_t sequence) const {
  SPECACHE_ASSIGN_OR_RETURN(const AttachedPages::SlotView v, impl_->pages->SlotOf(sequence));
  return impl_->pages->LivePages(v);
}

Result<uint8_t*> Session::PageData(uint64_t sequence, uint32_t layer, uint32_t page) const {
  return impl_->pages->PageData(sequence, layer, page);
}

bool Session::Alive() const {
  pollfd p{impl_->attach_fd, POLLIN | POLLRDHUP, 0};
  if (poll(&p, 1, 0) <= 0) return true;
  return !(p.revents & (POLLHUP | POLLRDHUP | POLLERR | POLLIN));
}

}  // namespace specache::client
