#include "specache/fd_passing.h"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <string>

namespace specache {

Status SendWithFds(int socket, const void* data, size_t n, std::span<const int> fds) {
  const auto* bytes = static_cast<const char*>(data);
  size_t sent = 0;
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::milliseconds(kSendWaitMs);
  std::vector<char> control(CMSG_SPACE(sizeof(int) * fds.size()));
  while (sent < n) {
    iovec iov{const_cast<char*>(bytes + sent), n - sent};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    if (sent == 0 && !fds.empty()) {
      msg.msg_control = control.data();
      msg.msg_controllen = control.size();
      cmsghdr* c = CMSG_FIRSTHDR(&msg);
      c->cmsg_level = SOL_SOCKET;
      c->cmsg_type = SCM_RIGHTS;
      c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
      std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * fds.size());
    }
    const ssize_t r = sendmsg(socket, &msg, MSG_NOSIGNAL);
    if (r < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {  // a non-blocking socket whose buffer is full
        const auto left =
            std::chrono::duration_cast<std::chrono::milliseconds>(give_up - std::chrono::steady_clock::now()).count();
        pollfd p{socket, POLLOUT, 0};
        if (left > 0 && (poll(&p, 1, static_cast<int>(left)) >= 0 || errno == EINTR)) continue;
        return Status::DeadlineExceeded("send on attach socket: the peer read nothing for " +
                                        std::to_string(kSendWaitMs) + " ms");
      }
      return Status::Unavailable(std::string("send on attach socket: ") + std::strerror(errno));
    }
    sent += static_cast<size_t>(r);
  }
  return Status::Ok();
}

Status RecvWithFds(int socket, void* data, size_t n, std::vector<int>* fds, int timeout_ms) {
  auto* bytes = static_cast<char*>(data);
  size_t got = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  std::vector<char> control(CMSG_SPACE(sizeof(int) * 253));
  while (got < n) {
    if (timeout_ms >= 0) {
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()).count();
      pollfd p{socket, POLLIN, 0};
      const int ready = left > 0 ? poll(&p, 1, static_cast<int>(left)) : 0;
      if (ready < 0 && errno == EINTR) continue;
      if (ready <= 0) return Status::DeadlineExceeded("no reply on the attach socket within " + std::to_string(timeout_ms) + " ms");
    }
    iovec iov{bytes + got, n - got};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.data();
    msg.msg_controllen = control.size();
    const ssize_t r = recvmsg(socket, &msg, MSG_CMSG_CLOEXEC);
    if (r < 0) {
      if (errno == EINTR) continue;
      return Status::Unavailable(std::string("receive on attach socket: ") + std::strerror(errno));
    }
    for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
      if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
        const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (size_t i = 0; i < count; ++i) {
          int fd;
          std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof fd);
          fds->push_back(fd);
        }
      }
    }
    if (msg.msg_flags & MSG_CTRUNC) return Status::DataLoss("attach socket: descriptors truncated");
    if (r == 0) return Status::Unavailable("attach socket closed by the peer");
    got += static_cast<size_t>(r);
  }
  return Status::Ok();
}

}  // namespace specache
