// A loopback TCP port for a daemon a test starts next (its metrics or remote listeners).
#pragma once

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <random>
#include <set>

namespace specache::testing {

// A TCP port nobody listens on now, for a daemon started next. Drawn below the kernel's
// ephemeral range (/proc/sys/net/ipv4/ip_local_port_range, 32768 by default): a port the kernel
// picked and released was, under parallel tests, sometimes taken by another process's outgoing
// connection before the daemon bound it ("Address already in use"). Drawn at random, per process,
// from the ~10K ports below that range (never one this process was given before), and checked
// free by binding it; the kernel's pick when no drawn port binds or the range starts too low.
inline uint16_t FreePort() {
  auto binds = [](uint16_t port) {  // the bound port, or 0 where it does not bind
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) return uint16_t{0};
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(port);
    socklen_t len = sizeof a;
    const bool ok = bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 &&
                    getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0;
    close(fd);
    return ok ? ntohs(a.sin_port) : uint16_t{0};
  };
  int low = 32768;
  if (std::ifstream range("/proc/sys/net/ipv4/ip_local_port_range"); range) range >> low;
  if (low <= 2048) return binds(0);  // no room below the range
  const int top = low - 1, bottom = std::max(top - 10000, 1024);
  static std::mt19937 draw(std::random_device{}() ^ static_cast<uint32_t>(getpid()));
  static std::set<uint16_t> given;  // this process's: two calls in a row never get the same port
  for (int tries = 0; tries < 64; ++tries) {
    const auto port = static_cast<uint16_t>(bottom + static_cast<int>(draw() % uint32_t(top - bottom + 1)));
    if (!given.count(port) && binds(port) != 0) {
      given.insert(port);
      return port;
    }
  }
  return binds(0);
}

}  // namespace specache::testing
