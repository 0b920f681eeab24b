#include "specache/remote_protocol.h"

#include <netdb.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

namespace specache::remote {
namespace {

template <typename T>
Result<T> Exact(std::span<const uint8_t> bytes, const char* what) {
  if (bytes.size() != sizeof(T)) {
    return Status::InvalidArgument(std::string(what) + " header of " + std::to_string(bytes.size()) + " bytes, expected " +
                                   std::to_string(sizeof(T)));
  }
  T t;
  std::memcpy(&t, bytes.data(), sizeof t);
  if (t.magic != kMagic) return Status::InvalidArgument(std::string(what) + ": bad magic");
  return t;
}

}  // namespace

Result<Hello> ParseHello(std::span<const uint8_t> header) {
  SPECACHE_ASSIGN_OR_RETURN(Hello h, Exact<Hello>(header, "hello"));
  if (h.version != kVersion) {
    return Status::FailedPrecondition("hello: version " + std::to_string(h.version) + ", daemon speaks " +
                                      std::to_string(kVersion));
  }
  if (h.flags != 0) return Status::InvalidArgument("hello: unknown flags");
  if (h.session_id == 0) return Status::InvalidArgument("hello: session id 0");
  return h;
}

Result<Challenge> ParseChallenge(std::span<const uint8_t> header) {
  SPECACHE_ASSIGN_OR_RETURN(Challenge c, Exact<Challenge>(header, "challenge"));
  if (c.version != kVersion) {
    return Status::FailedPrecondition("challenge: the daemon speaks version " + std::to_string(c.version) +
                                      ", this client " + std::to_string(kVersion));
  }
  if (c.reserved != 0) return Status::InvalidArgument("challenge: reserved field set");
  return c;
}

Result<RowsRequest> ParseRowsRequest(std::span<const uint8_t> header) {
  SPECACHE_ASSIGN_OR_RETURN(RowsRequest r, Exact<RowsRequest>(header, "rows request"));
  if (r.n > kMaxRowsPerRequest) {
    return Status::InvalidArgument("rows request of " + std::to_string(r.n) + " rows; at most " +
                                   std::to_string(kMaxRowsPerRequest));
  }
  if (r.reserved != 0) return Status::InvalidArgument("rows request: reserved field set");
  return r;
}

Result<Reply> ParseReply(std::span<const uint8_t> header) {
  auto r = Exact<Reply>(header, "reply");
  if (!r.ok()) return Status::DataLoss(r.status().message());
  return r;
}

Result<std::pair<std::string, uint16_t>> SplitHostPort(const std::string& text) {
  const size_t colon = text.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == text.size()) {
    return Status::InvalidArgument("address '" + text + "' is not host:port");
  }
  std::string host = text.substr(0, colon);
  if (host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  const std::string port_text = text.substr(colon + 1);
  if (port_text.size() > 5 || port_text.find_first_not_of("0123456789") != std::string::npos ||
      std::stoul(port_text) > 65535) {
    return Status::InvalidArgument("address '" + text + "': port must be 0..65535");
  }
  return std::make_pair(host, static_cast<uint16_t>(std::stoul(port_text)));
}

Result<std::vector<SocketAddress>> ResolveAddresses(const std::string& text) {
  SPECACHE_ASSIGN_OR_RETURN(auto host_port, SplitHostPort(text));
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const std::string port = std::to_string(host_port.second);
  if (const int e = getaddrinfo(host_port.first.c_str(), port.c_str(), &hints, &found); e != 0 || !found) {
    return Status::Unavailable("address '" + text + "': " + gai_strerror(e));
  }
  std::vector<SocketAddress> all;
  for (const addrinfo* i = found; i; i = i->ai_next) {
    if ((i->ai_family != AF_INET && i->ai_family != AF_INET6) || i->ai_addrlen > sizeof(sockaddr_storage)) continue;
    SocketAddress a;
    std::memcpy(&a.storage, i->ai_addr, i->ai_addrlen);
    a.length = i->ai_addrlen;
    const bool seen = std::any_of(all.begin(), all.end(), [&](const SocketAddress& b) {
      return b.length == a.length && std::memcmp(&b.storage, &a.storage, a.length) == 0;
    });
    if (!seen) all.push_back(a);
  }
  freeaddrinfo(found);
  if (all.empty()) return Status::Unavailable("address '" + text + "': no IPv4 or IPv6 address");
  return all;
}

Result<SocketAddress> ResolveAddress(const std::string& text) {
  SPECACHE_ASSIGN_OR_RETURN(std::vector<SocketAddress> all, ResolveAddresses(text));
  return all.front();
}

}  // namespace specache::remote
