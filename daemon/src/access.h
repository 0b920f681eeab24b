// Who is calling, and what they may do.
//
// A caller is who the kernel says connected (SO_PEERCRED and SO_PEERGROUPS on the Unix socket,
// taken at connect time), never anything a request claims. The rules:
//   - a tenant admits root, the users in its `users`, and callers whose primary or supplementary
//     groups meet its `groups`; a tenant with neither admits every local user;
//   - admins are root, the daemon's own user, [access] admin_users, and members (primary or
//     supplementary) of [access] admin_groups. Only admins call Spill, Restore, Evict,
//     VerifySpill and ListSessions, and only they see every tenant in ListSequences and Stats.
// Refusals are PERMISSION_DENIED with the rule that refused, so an operator can fix the config.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "config.h"
#include "specache/status.h"

namespace specache::daemon {

// uid/gid of a caller the kernel did not name (a client on another host).
inline constexpr uint32_t kNoId = UINT32_MAX;

struct Caller {
  int32_t pid = 0;
  uint32_t uid = 0, gid = 0;
  std::vector<uint32_t> groups;  // supplementary groups of the peer when it connected
  // Set for a client on another host (remote_server.h): it presented this tenant's secret over
  // TLS and may use that tenant only; it is never an admin. uid and gid are then kNoId.
  std::string remote_tenant;
  bool remote() const { return !remote_tenant.empty(); }

  bool InGroup(uint32_t g) const;
  std::string Describe() const;  // "uid 65534 gid 65534 groups [4242]"
};

// The peer of a connected Unix socket. UNAVAILABLE when the kernel does not say.
Result<Caller> PeerOf(int fd);

class AccessPolicy {
 public:
  // `daemon_uid`: the daemon's own user, an admin too.
  AccessPolicy(const DaemonConfig& config, uint32_t daemon_uid);

  // OK when the caller may open sessions of `tenant`, attach to them and see its sequences.
  Status MayUseTenant(const Caller& caller, const std::string& tenant) const;
  // OK when the caller is an admin; `call` names what was asked, for the refusal.
  Status MayAdminister(const Caller& caller, std::string_view call) const;
  bool IsAdmin(const Caller& caller) const;
  // A caller on another host that presented `secret` for `tenant`: the tenant must have a
  // remote_secret and it must match (compared in constant time). PERMISSION_DENIED otherwise,
  // the same message for an unknown tenant and a wrong secret (no probing for tenant names).
  Result<Caller> AuthenticateRemote(const std::string& tenant, std::string_view secret) const;

 private:
  std::map<std::string, TenantConfig> tenants_;
  AccessConfig access_;
  uint32_t daemon_uid_;
};

// Caps on the connections a listener hands to gRPC: in all, and per source (a uid on the local
// control socket, an address on the remote control port). `per` and `config` name them in a
// refusal ("uid", "[limits]").
struct ConnectionLimits {
  uint32_t most = 0, most_per_source = 0;
  const char* per = "";
  const char* config = "";
};

// The connections a listener accepted and handed to gRPC, with the caller seen at accept (the
// local socket's; a remote connection's callers are authenticated per call). gRPC names such a
// connection "fd:<n>" (ServerContext::peer(), local socket) and closes the descriptor without
// telling anyone, so an entry is known by its socket's identity (device, inode): an entry whose
// descriptor no longer names that socket (closed, or the number reused) is forgotten when an
// admission would pass a cap (at most once a kPruneEvery; a place freed just before is then seen
// up to that much later) or when accept reuses its number. A number is reused only after gRPC
// closed the descriptor, and gRPC closes it only once every call of that connection has
// finished, so a running call always finds its own connection's entry.
class PeerTable {
 public:
  // Records a new connection from `source` (its caller: `caller`), within `limits` (connections
  // whose descriptor gRPC closed since are not counted). RESOURCE_EXHAUSTED, naming the counts and
  // the limits, when the connection would pass one (nothing recorded).
  Status Admit(int fd, Caller caller, std::string source, const ConnectionLimits& limits);
  // PERMISSION_DENIED for a connection the table does not know (never accepted by the daemon).
  Result<Caller> Find(const std::string& peer) const;

 private:
  struct Entry {
    Caller caller;
    std::string source;
    uint64_t dev = 0, ino = 0;  // the connection's socket: the descriptor still names it while open
  };
  static constexpr std::chrono::milliseconds kPruneEvery{100};
  // Forgets the connections whose descriptor no longer names their socket.
  void PruneLocked();
  void EraseLocked(std::map<int, Entry>::iterator it);
  mutable std::mutex mu_;
  std::map<int, Entry> by_fd_;
  std::map<std::string, uint32_t> per_source_;  // entries of by_fd_ per source
  std::chrono::steady_clock::time_point last_prune_{};
};

// `text` made safe to echo into a log line or an error: control bytes, quotes, backslashes and
// non-ASCII bytes escaped (\xNN), and cut after `max_bytes` of input with the full length noted.
std::string Printable(std::string_view text, size_t max_bytes = 64);

}  // namespace specache::daemon
