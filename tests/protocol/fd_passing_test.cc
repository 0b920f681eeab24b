// Descriptors over a Unix socket pair (fd_passing.h).
#include "specache/fd_passing.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

namespace specache {
namespace {

// The daemon sends on its Boost.Asio socket, which Asio makes non-blocking: a full send buffer
// (a client slow to read, many chunks' messages) gave "send on attach socket: EAGAIN" and the
// client a partial set of descriptors. The send now waits for room.
TEST(FdPassingTest, ANonBlockingSocketWithAFullBufferWaitsForThePeer) {
  int pair[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair), 0);
  ASSERT_EQ(fcntl(pair[0], F_SETFL, fcntl(pair[0], F_GETFL) | O_NONBLOCK), 0);
  const std::vector<char> chunk(64 << 10, 'x');
  size_t filled = 0;
  while (true) {  // fill the buffer
    const ssize_t r = send(pair[0], chunk.data(), chunk.size(), MSG_NOSIGNAL);
    if (r < 0) break;
    filled += static_cast<size_t>(r);
  }
  ASSERT_GT(filled, 0u);
  std::thread reader([&] {  // reads everything after a while
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    std::vector<char> sink(filled);
    size_t got = 0;
    while (got < filled) {
      const ssize_t r = read(pair[1], sink.data() + got, filled - got);
      if (r <= 0) break;
      got += static_cast<size_t>(r);
    }
  });
  const std::string message = "with a descriptor";
  const Status s = SendWithFds(pair[0], message.data(), message.size(), std::vector<int>{pair[0]});
  reader.join();
  ASSERT_TRUE(s.ok()) << s.ToString();
  std::string got(message.size(), '\0');
  std::vector<int> fds;
  ASSERT_TRUE(RecvWithFds(pair[1], got.data(), got.size(), &fds, 2000).ok());
  EXPECT_EQ(got, message);
  ASSERT_EQ(fds.size(), 1u);
  for (int fd : fds) close(fd);
  close(pair[0]);
  close(pair[1]);
}

}  // namespace
}  // namespace specache
