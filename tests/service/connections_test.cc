// How the daemon counts and caps the connections it hands to gRPC, without a daemon: the source a
// TCP peer is counted under (SourceOf), the remote control port's listening socket (ListenTcp),
// and the table of open connections (PeerTable) over real sockets.
#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "accept_loop.h"
#include "access.h"

namespace specache::daemon {
namespace {

// A peer's address from its text: IPv6 when it holds a colon, else IPv4.
sockaddr_storage Peer(const char* text) {
  sockaddr_storage s{};
  if (std::strchr(text, ':')) {
    auto* a = reinterpret_cast<sockaddr_in6*>(&s);
    a->sin6_family = AF_INET6;
    EXPECT_EQ(inet_pton(AF_INET6, text, &a->sin6_addr), 1) << text;
  } else {
    auto* a = reinterpret_cast<sockaddr_in*>(&s);
    a->sin_family = AF_INET;
    EXPECT_EQ(inet_pton(AF_INET, text, &a->sin_addr), 1) << text;
  }
  return s;
}

TEST(ConnectionSourceTest, IPv4ByAddressMappedIPv4AsItselfIPv6ByItsSlash64) {
  EXPECT_EQ(SourceOf(Peer("10.1.2.3")), "10.1.2.3");
  EXPECT_EQ(SourceOf(Peer("::ffff:10.1.2.3")), "10.1.2.3");  // an IPv4 client of a dual-stack socket
  EXPECT_EQ(SourceOf(Peer("2001:db8:1:2:aaaa:bbbb:cccc:dddd")), "2001:db8:1:2::/64");
  // One host's /64 is one source, whatever address it draws in it; the next /64 is another.
  EXPECT_EQ(SourceOf(Peer("2001:db8:1:2::1")), SourceOf(Peer("2001:db8:1:2:ffff:ffff:ffff:ffff")));
  EXPECT_NE(SourceOf(Peer("2001:db8:1:2::1")), SourceOf(Peer("2001:db8:1:3::1")));
  EXPECT_EQ(SourceOf(Peer("::1")), "::/64");
  sockaddr_storage unix_peer{};
  unix_peer.ss_family = AF_UNIX;
  EXPECT_EQ(SourceOf(unix_peer), "");
}

// A TCP connection to 127.0.0.1 or ::1 at `port`; -1 when it cannot be made.
int ConnectTo(int family, uint16_t port) {
  const int fd = socket(family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  int rc = -1;
  if (family == AF_INET) {
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    rc = connect(fd, reinterpret_cast<const sockaddr*>(&a), sizeof a);
  } else {
    sockaddr_in6 a{};
    a.sin6_family = AF_INET6;
    a.sin6_port = htons(port);
    a.sin6_addr = in6addr_loopback;
    rc = connect(fd, reinterpret_cast<const sockaddr*>(&a), sizeof a);
  }
  if (rc != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// Whether this host can listen on ::1 (containers often run without IPv6).
bool HasIPv6Loopback() {
  const int fd = socket(AF_INET6, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  sockaddr_in6 a{};
  a.sin6_family = AF_INET6;
  a.sin6_addr = in6addr_loopback;
  const bool ok = bind(fd, reinterpret_cast<const sockaddr*>(&a), sizeof a) == 0;
  ::close(fd);
  return ok;
}

// The source a connection accepted on `listening` is counted under.
std::string AcceptedSource(int listening) {
  const int fd = accept4(listening, nullptr, nullptr, SOCK_CLOEXEC);
  if (fd < 0) return "accept failed";
  std::string source = SourceOf(fd);
  ::close(fd);
  return source;
}

// A wildcard address takes IPv4 and IPv6 clients alike, as gRPC's own listener did (IPv4 alone on
// a host without IPv6), each counted as itself.
TEST(ListenTcpTest, AWildcardAddressTakesIPv4AndIPv6Clients) {
  for (const char* wildcard : {"0.0.0.0:0", "[::]:0"}) {
    auto listening = ListenTcp(wildcard, "test port");
    ASSERT_TRUE(listening.ok()) << wildcard << ": " << listening.status().ToString();
    ASSERT_EQ(listening->fds.size(), 1u) << wildcard;
    EXPECT_NE(listening->port, 0) << wildcard;
    const int v4 = ConnectTo(AF_INET, listening->port);
    ASSERT_GE(v4, 0) << wildcard << ": an IPv4 client was refused";
    EXPECT_EQ(AcceptedSource(listening->fds[0]), "127.0.0.1") << wildcard;
    ::close(v4);
    if (HasIPv6Loopback()) {
      EXPECT_TRUE(listening->dual_stack) << wildcard;
      const int v6 = ConnectTo(AF_INET6, listening->port);
      ASSERT_GE(v6, 0) << wildcard << ": an IPv6 client was refused";
      EXPECT_EQ(AcceptedSource(listening->fds[0]), "::/64") << wildcard;
      ::close(v6);
    }
    ::close(listening->fds[0]);
  }
}

TEST(ListenTcpTest, ANumericAddressListensThereAndATakenPortIsRefusedByName) {
  auto listening = ListenTcp("127.0.0.1:0", "test port");
  ASSERT_TRUE(listening.ok()) << listening.status().ToString();
  ASSERT_EQ(listening->fds.size(), 1u);
  EXPECT_FALSE(listening->dual_stack);
  const int fd = ConnectTo(AF_INET, listening->port);
  ASSERT_GE(fd, 0);
  ::close(fd);
  const std::string taken = "127.0.0.1:" + std::to_string(listening->port);
  auto again = ListenTcp(taken, "remote.control_addr");
  EXPECT_EQ(again.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(again.status().message().find("cannot listen on remote.control_addr " + taken), std::string::npos)
      << again.status().ToString();
  EXPECT_FALSE(ListenTcp("127.0.0.1", "test port").ok());  // no port
  ::close(listening->fds[0]);
}

// A name listens on every address it resolves to that the host has (as gRPC's listener did), on
// one port: with "localhost" 127.0.0.1 and ::1 where both are configured, so clients of either
// family connect.
TEST(ListenTcpTest, ANameListensOnEveryAddressItResolvesTo) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  ASSERT_EQ(getaddrinfo("localhost", "0", &hints, &found), 0);
  bool v4 = false, v6 = false;
  for (const addrinfo* i = found; i; i = i->ai_next) {
    v4 = v4 || i->ai_family == AF_INET;
    v6 = v6 || i->ai_family == AF_INET6;
  }
  freeaddrinfo(found);
  v6 = v6 && HasIPv6Loopback();  // ::1 resolved but not configured here: skipped, as gRPC did
  auto listening = ListenTcp("localhost:0", "test port");
  ASSERT_TRUE(listening.ok()) << listening.status().ToString();
  EXPECT_EQ(listening->fds.size(), size_t{v4} + size_t{v6});
  EXPECT_FALSE(listening->dual_stack);
  if (v4) {
    const int fd = ConnectTo(AF_INET, listening->port);
    EXPECT_GE(fd, 0) << "an IPv4 client of localhost was refused";
    if (fd >= 0) ::close(fd);
  }
  if (v6) {
    const int fd = ConnectTo(AF_INET6, listening->port);
    EXPECT_GE(fd, 0) << "an IPv6 client of localhost was refused";
    if (fd >= 0) ::close(fd);
  }
  for (int fd : listening->fds) ::close(fd);
}

// Connected stream sockets whose far ends the test holds (the near ends are what gRPC would own).
struct Pair {
  int near = -1, far = -1;
  Pair() {
    int fds[2];
    EXPECT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds), 0);
    near = fds[0];
    far = fds[1];
  }
  void Close() {
    if (near >= 0) ::close(near);
    if (far >= 0) ::close(far);
    near = far = -1;
  }
};

TEST(PeerTableTest, CapsPerSourceAndInAllAndGivesClosedPlacesBack) {
  PeerTable table;
  const ConnectionLimits limits{3, 2, "address", "[remote]"};
  std::vector<Pair> pairs(6);
  EXPECT_TRUE(table.Admit(pairs[0].near, Caller{}, "10.0.0.1", limits).ok());
  EXPECT_TRUE(table.Admit(pairs[1].near, Caller{}, "10.0.0.1", limits).ok());
  const Status per_source = table.Admit(pairs[2].near, Caller{}, "10.0.0.1", limits);
  EXPECT_EQ(per_source.code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(per_source.message(),
            "2 control connections open (2 from address 10.0.0.1), limits 3 and 2 per address ([remote] in the config)");
  EXPECT_TRUE(table.Admit(pairs[3].near, Caller{}, "10.0.0.2", limits).ok());
  const Status in_all = table.Admit(pairs[4].near, Caller{}, "10.0.0.3", limits);
  EXPECT_EQ(in_all.code(), StatusCode::kResourceExhausted) << in_all.ToString();
  EXPECT_NE(in_all.message().find("3 control connections open (0 from address 10.0.0.3)"), std::string::npos)
      << in_all.ToString();

  // gRPC closes a connection without telling anyone: its place comes back once a cap would refuse
  // (at most one look a tenth of a second, so the look above must be that old).
  pairs[0].Close();
  std::this_thread::sleep_for(std::chrono::milliseconds(150));
  EXPECT_TRUE(table.Admit(pairs[4].near, Caller{}, "10.0.0.3", limits).ok());
  EXPECT_FALSE(table.Admit(pairs[5].near, Caller{}, "10.0.0.1", limits).ok());  // 3 in all again
  // A closed number that accept hands out again is the new connection's, not the old one's.
  const int old_number = pairs[3].near;  // 10.0.0.2's
  pairs[3].Close();
  std::vector<Pair> fillers;  // until the closed number comes back (the lowest free number is taken first)
  int number = -1;
  while (number < 0 && fillers.size() < 64) {
    fillers.emplace_back();
    if (fillers.back().near == old_number || fillers.back().far == old_number) number = old_number;
  }
  ASSERT_EQ(number, old_number);
  EXPECT_TRUE(table.Admit(number, Caller{}, "10.0.0.1", limits).ok()) << "the number's old entry (10.0.0.2) was kept";
  Caller local;
  local.uid = 1000;
  EXPECT_TRUE(table.Admit(pairs[5].far, local, "1000", {8, 8, "uid", "[limits]"}).ok());
  auto found = table.Find("fd:" + std::to_string(pairs[5].far));
  ASSERT_TRUE(found.ok()) << found.status().ToString();
  EXPECT_EQ(found->uid, 1000u);
  EXPECT_EQ(table.Find("fd:999999").status().code(), StatusCode::kPermissionDenied);
  for (Pair& p : fillers) p.Close();
  for (Pair& p : pairs) p.Close();
}

}  // namespace
}  // namespace specache::daemon
