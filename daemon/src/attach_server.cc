#include "attach_server.h"

#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <spdlog/spdlog.h>

#include "log_rate.h"
#include "specache/fd_passing.h"

namespace specache::daemon {
namespace {

using boost::asio::local::stream_protocol;
constexpr auto kRequestTimeout = std::chrono::seconds(2);

class Connection : public std::enable_shared_from_this<Connection> {
 public:
  Connection(stream_protocol::socket socket, Registry* registry, Caller peer, std::shared_ptr<AttachServer::Counts> counts)
      : socket_(std::move(socket)), timer_(socket_.get_executor()), registry_(registry), peer_(std::move(peer)),
        counts_(std::move(counts)) {}
  ~Connection() {
    --counts_->open;
    if (--counts_->per_uid[peer_.uid] == 0) counts_->per_uid.erase(peer_.uid);
  }

  void Start() {
    auto self = shared_from_this();
    timer_.expires_after(kRequestTimeout);
    timer_.async_wait([self](boost::system::error_code ec) {
      if (!ec && !self->got_request_) {
        self->timed_out_ = true;
        const uint64_t bad = ++self->counts_->bad;
        if (LoggedOccurrence(bad)) {
          spdlog::warn("attach: pid {} sent no request within 2 s; {} bad requests so far", self->peer_.pid, bad);
        }
        self->socket_.close();
      }
    });
    boost::asio::async_read(socket_, boost::asio::buffer(request_),
                            [self](boost::system::error_code ec, size_t n) { self->OnRequest(ec, n); });
  }

 private:
  // False when the reply did not go out. One that carried a session's descriptors is counted and
  // logged (at the 1st, 2nd, 4th...); an error reply's client has left, and nothing is lost.
  bool Reply(const attach::AttachReply& reply, std::span<const int> fds) {
    Status s = SendWithFds(socket_.native_handle(), &reply, sizeof reply, fds);
    if (s.ok()) return true;
    if (fds.empty()) {
      spdlog::debug("attach: error reply to pid {} not delivered: {}", peer_.pid, s.ToString());
      return false;
    }
    const uint64_t failed = ++counts_->replies_failed;
    if (LoggedOccurrence(failed)) {
      spdlog::warn("attach: reply to pid {} with session {}'s descriptors not delivered: {}; {} such so far", peer_.pid,
                   session_, s.ToString(), failed);
    }
    return false;
  }

  void OnRequest(boost::system::error_code ec, size_t n) {
    got_request_ = true;
    timer_.cancel();
    if (ec) {  // closed before a whole request (nothing to undo), or by the deadline (counted there)
      if (timed_out_) return;
      const uint64_t bad = ++counts_->bad;
      if (LoggedOccurrence(bad)) {
        spdlog::warn("attach: pid {} closed after {} of a request's {} bytes ({}); {} bad requests so far", peer_.pid,
                     n, request_.size(), ec.message(), bad);
      }
      return;
    }
    auto request = attach::ParseRequest(std::span<const uint8_t>(request_.data(), n));
    if (!request.ok()) {
      const uint64_t bad = ++counts_->bad;
      if (LoggedOccurrence(bad)) {
        spdlog::warn("attach: bad request from pid {}: {}; {} bad requests so far", peer_.pid,
                     request.status().ToString(), bad);
      }
      Reply(attach::ErrorReply(request.status()), {});
      return;
    }
    auto grant = registry_->Attach(request->session_id, request->token, peer_);
    if (!grant.ok()) {
      const uint64_t denied = ++counts_->denied;
      if (LoggedOccurrence(denied)) {
        spdlog::warn("attach: session {} refused for pid {} uid {}: {}; {} refused so far", request->session_id,
                     peer_.pid, peer_.uid, grant.status().ToString(), denied);
      }
      Reply(attach::ErrorReply(grant.status()), {});
      return;
    }
    session_ = request->session_id;
    const uint32_t total = static_cast<uint32_t>(grant->fds.size());
    bool delivered = true;
    for (uint32_t first = 0; first < total && delivered; first += attach::kMaxFdsPerMessage) {
      attach::AttachReply reply;
      reply.first_fd = first;
      reply.n_fds = std::min<uint32_t>(attach::kMaxFdsPerMessage, total - first);
      reply.total_fds = total;
      reply.table_bytes = grant->table_bytes;
      reply.chunk_bytes = grant->chunk_bytes;
      delivered = Reply(reply, std::span<const int>(grant->fds.data() + first, reply.n_fds));
    }
    for (int fd : grant->fds) close(fd);
    if (!delivered) {  // the client holds not all of its session's memory: the attach is undone
      registry_->Detach(session_);
      socket_.close();
      return;
    }
    // From now on the connection is the session's lease: wait for it to end.
    auto self = shared_from_this();
    socket_.async_read_some(boost::asio::buffer(tail_), [self](boost::system::error_code, size_t bytes) {
      if (bytes > 0) spdlog::warn("attach: session {} sent bytes after attaching; detaching", self->session_);
      self->registry_->Detach(self->session_);
    });
  }

  stream_protocol::socket socket_;
  boost::asio::steady_timer timer_;
  Registry* registry_;
  Caller peer_;
  std::shared_ptr<AttachServer::Counts> counts_;
  std::array<uint8_t, sizeof(attach::AttachRequest)> request_{};
  std::array<uint8_t, 64> tail_{};
  bool got_request_ = false;
  bool timed_out_ = false;  // closed by the 2 s deadline (counted there, not again in OnRequest)
  uint64_t session_ = 0;
};

}  // namespace

AttachServer::AttachServer(boost::asio::io_context& io, Registry* registry, SocketFile file, LimitsConfig limits)
    : io_(io), registry_(registry), file_(std::move(file)), limits_(limits), listener_(io, "attach") {}

Status AttachServer::Listen() {
  SPECACHE_RETURN_IF_ERROR(listener_.Listen(file_, 64));
  listener_.Start([this](int fd) { OnAccept(fd); });
  return Status::Ok();
}

void AttachServer::Stop() { listener_.Stop(); }

AttachStats AttachServer::stats() const {
  return {counts_->open.load(), counts_->refused.load(), listener_.accept_errors(), counts_->denied.load(),
          counts_->bad.load(), counts_->replies_failed.load()};
}

void AttachServer::OnAccept(int fd) {
  auto peer = PeerOf(fd);
  if (!peer.ok()) {
    ::close(fd);
    ++counts_->refused;
    spdlog::warn("attach: connection without peer credentials closed: {}", peer.status().ToString());
    return;
  }
  // Caps before anything else: an idle connection costs a descriptor until its 2 s deadline.
  const uint32_t of_uid = counts_->per_uid.count(peer->uid) ? counts_->per_uid[peer->uid] : 0;
  if (counts_->open.load() >= limits_.attach_connections || of_uid >= limits_.attach_connections_per_uid) {
    ::close(fd);
    const uint64_t refused = ++counts_->refused;
    if (LoggedOccurrence(refused)) {
      spdlog::warn("attach: connection of pid {} uid {} refused: {} open ({} of that uid), limits {} and {} per uid "
                   "([limits] in the config); {} refused so far",
                   peer->pid, peer->uid, counts_->open.load(), of_uid, limits_.attach_connections,
                   limits_.attach_connections_per_uid, refused);
    }
    return;
  }
  ++counts_->open;
  ++counts_->per_uid[peer->uid];
  boost::system::error_code ec;
  stream_protocol::socket socket(io_);
  socket.assign(stream_protocol(), fd, ec);
  if (ec) {
    ::close(fd);
    --counts_->open;
    if (--counts_->per_uid[peer->uid] == 0) counts_->per_uid.erase(peer->uid);
    spdlog::warn("attach: {}", ec.message());
    return;
  }
  std::make_shared<Connection>(std::move(socket), registry_, std::move(*peer), counts_)->Start();
}

}  // namespace specache::daemon
