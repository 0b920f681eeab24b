#include "attach_server.h"

#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <spdlog/spdlog.h>

#include "specache/fd_passing.h"

namespace specache::daemon {
namespace {

using boost::asio::local::stream_protocol;
constexpr auto kRequestTimeout = std::chrono::seconds(2);

class Connection : public std::enable_shared_from_this<Connection> {
 public:
  Connection(stream_protocol::socket socket, Registry* registry)
      : socket_(std::move(socket)), timer_(socket_.get_executor()), registry_(registry) {}

  void Start() {
    ucred cred{};
    socklen_t len = sizeof cred;
    if (getsockopt(socket_.native_handle(), SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
      spdlog::warn("attach: no peer credentials; closing");
      return;
    }
    peer_ = {cred.pid, cred.uid, cred.gid};
    auto self = shared_from_this();
    timer_.expires_after(kRequestTimeout);
    timer_.async_wait([self](boost::system::error_code ec) {
      if (!ec && !self->got_request_) {
        spdlog::warn("attach: pid {} sent no request within 2 s", self->peer_.pid);
        self->socket_.close();
      }
    });
    boost::asio::async_read(socket_, boost::asio::buffer(request_),
                            [self](boost::system::error_code ec, size_t n) { self->OnRequest(ec, n); });
  }

 private:
  void Reply(const attach::AttachReply& reply, std::span<const int> fds) {
    Status s = SendWithFds(socket_.native_handle(), &reply, sizeof reply, fds);
    if (!s.ok()) spdlog::warn("attach: reply to pid {}: {}", peer_.pid, s.ToString());
  }

  void OnRequest(boost::system::error_code ec, size_t n) {
    got_request_ = true;
    timer_.cancel();
    if (ec) return;  // closed before a whole request: nothing to undo
    auto request = attach::ParseRequest(std::span<const uint8_t>(request_.data(), n));
    if (!request.ok()) {
      spdlog::warn("attach: bad request from pid {}: {}", peer_.pid, request.status().ToString());
      Reply(attach::ErrorReply(request.status()), {});
      return;
    }
    auto grant = registry_->Attach(request->session_id, request->token, peer_);
    if (!grant.ok()) {
      spdlog::warn("attach: session {} refused for pid {}: {}", request->session_id, peer_.pid,
                   grant.status().ToString());
      Reply(attach::ErrorReply(grant.status()), {});
      return;
    }
    session_ = request->session_id;
    const uint32_t total = static_cast<uint32_t>(grant->fds.size());
    for (uint32_t first = 0; first < total; first += attach::kMaxFdsPerMessage) {
      attach::AttachReply reply;
      reply.first_fd = first;
      reply.n_fds = std::min<uint32_t>(attach::kMaxFdsPerMessage, total - first);
      reply.total_fds = total;
      reply.table_bytes = grant->table_bytes;
      reply.chunk_bytes = grant->chunk_bytes;
      Reply(reply, std::span<const int>(grant->fds.data() + first, reply.n_fds));
    }
    for (int fd : grant->fds) close(fd);
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
  PeerCredentials peer_;
  std::array<uint8_t, sizeof(attach::AttachRequest)> request_{};
  std::array<uint8_t, 64> tail_{};
  bool got_request_ = false;
  uint64_t session_ = 0;
};

}  // namespace

AttachServer::AttachServer(boost::asio::io_context& io, Registry* registry, std::string path)
    : io_(io), registry_(registry), path_(std::move(path)) {}

Status AttachServer::Listen() {
  ::unlink(path_.c_str());
  boost::system::error_code ec;
  acceptor_ = std::make_unique<stream_protocol::acceptor>(io_);
  acceptor_->open(stream_protocol(), ec);
  if (!ec) acceptor_->bind(stream_protocol::endpoint(path_), ec);
  if (!ec) acceptor_->listen(64, ec);
  if (ec) return Status::Unavailable("attach socket " + path_ + ": " + ec.message());
  // Anyone may connect; the token and the peer's credentials decide.
  ::chmod(path_.c_str(), 0666);
  Accept();
  return Status::Ok();
}

void AttachServer::Stop() {
  if (acceptor_) {
    boost::system::error_code ec;
    acceptor_->close(ec);
  }
  ::unlink(path_.c_str());
}

void AttachServer::Accept() {
  acceptor_->async_accept([this](boost::system::error_code ec, stream_protocol::socket socket) {
    if (ec == boost::asio::error::operation_aborted) return;
    if (!ec) std::make_shared<Connection>(std::move(socket), registry_)->Start();
    Accept();
  });
}

}  // namespace specache::daemon
