// specached's configuration: a TOML file (--config) with command-line overrides.
//
//   socket = "/run/specache/control.sock"   # gRPC control plane (Unix socket)
//   attach_socket = ""                      # default: <socket>.attach
//   pool_bytes = "8GiB"                     # memory reserved at startup (number or "<n>KiB|MiB|GiB")
//   chunk_bytes = "64MiB"
//   prefault_threads = 4
//   lock_memory = true                      # mlock the pool (needs LimitMEMLOCK=infinity)
//   huge_pages = true                       # ask for transparent huge pages (ChunkPoolOptions)
//   lease_ms = 2000                         # attach within this, or the session is reclaimed
//   max_sequences_per_session = 256
//   max_page_refs_per_session = 1048576
//   metrics_addr = "127.0.0.1:9464"         # Prometheus text endpoint; "" disables it
//   log_format = "text"                     # or "json"
//   log_level = "info"
//   [spill]                                 # the NVMe tier for kept sequences (RocksDB)
//   dir = ""                                # empty: no spill tier (--spill-dir)
//   max_bytes = "0"                         # page bytes on disk; 0: no limit but the disk's
//   compression = false                     # LZ4 (fp16 KV compresses poorly)
//   park_bytes = ""                         # RAM for kept sequences; default: pool_bytes / 4
//   high_watermark = 0.9                    # parked bytes above high x park_bytes are spilled...
//   low_watermark = 0.7                     # ...least recently parked first, down to low
//   write_through = false                   # also spill each kept sequence as it is parked
//   [tenants.default]
//   quota_bytes = "8GiB"
//   users = ["alice", 1001]                 # allowed Unix users (names or uids)
//   groups = ["specache"]                   # allowed Unix groups (names or gids)
//   # no users and no groups: any local user (single-user machines, tests)
//   [access]                                # who administers, and the sockets' files
//   admin_users = []                        # besides root and the daemon's own user
//   admin_groups = ["specache-admin"]       # may Spill/Restore/Evict/Verify, list sessions, see every tenant
//   socket_mode = "0660"                    # both sockets; no bits for others beyond 0770's
//   socket_group = "specache"               # default: "specache" if that group exists, else the daemon's
//   [limits]
//   attach_connections = 1024               # open attach connections in all
//   attach_connections_per_uid = 64         # ...and per connecting uid
//   control_connections = 1024              # open control (gRPC) connections in all
//   control_connections_per_uid = 64        # ...and per connecting uid
//   kept_sequences_per_tenant = 4096        # kept past their sessions (parked, spilled, marked)
//   [remote]                                # clients on other hosts (remote_server.h); off when absent
//   control_addr = "0.0.0.0:7700"           # gRPC with TLS: the same Control service, callers by tenant secret
//   data_addr = "0.0.0.0:7701"              # UCX listener for the rows (transports: UCX_TLS, ucx.conf)
//   tls_cert = "/etc/specache/server.pem"   # PEM chain and key of the daemon
//   tls_key = "/etc/specache/server.key"
//   client_ca = ""                          # set: mutual TLS, clients need a certificate this CA signed
//   rma = false                             # hand out remote keys for client-side gets (trusted
//                                           # fabrics only: UCX's software RMA on TCP/shm checks no key)
//   control_connections = 1024              # open TLS control connections in all
//   control_connections_per_address = 64    # ...and per source address (IPv6: per /64)
//   idle_close_ms = 60000                   # a control connection without a call this long is closed
//   max_connection_ms = 600000              # ...and any this old (told to go away first)
//   [tenants.default]
//   remote_secret_file = "/etc/specache/default.secret"  # 0600/0400; a remote caller presents it
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "specache/status.h"

namespace specache::daemon {

// Tenant names: 1 to kMaxTenantName printable ASCII characters, no spaces.
inline constexpr size_t kMaxTenantName = 64;

struct TenantConfig {
  uint64_t quota_bytes = 0;
  std::vector<uint32_t> uids;
  std::vector<uint32_t> gids;
  // The secret a remote client presents for this tenant (read from remote_secret_file at load;
  // empty: no remote access to the tenant).
  std::string remote_secret;
  bool quota_is_pool = false;  // no quota_bytes given: the whole pool, as finally sized (CompleteTenants)
  bool AllowsAnyone() const { return uids.empty() && gids.empty(); }
};

struct SpillConfig {
  std::string dir;
  uint64_t max_bytes = 0;
  bool compression = false;
  uint64_t park_bytes = 0;  // 0: pool_bytes / 4
  double high_watermark = 0.9;
  double low_watermark = 0.7;
  bool write_through = false;  // kept sequences reach the disk when parked (survive SIGKILL)
};

// ---- [access]: administrators and socket files (see access.h for the rules). ----
struct AccessConfig {
  std::vector<uint32_t> admin_uids;  // root and the daemon's own uid are admins anyway
  std::vector<uint32_t> admin_gids;
  uint32_t socket_mode = 0660;
  std::optional<uint32_t> socket_gid;  // unset: group "specache" if it exists, else the daemon's group
};

// ---- [limits]: connections. ----
struct LimitsConfig {
  uint32_t attach_connections = 1024;
  uint32_t attach_connections_per_uid = 64;
  uint32_t control_connections = 1024;
  uint32_t control_connections_per_uid = 64;
  // Sequences a tenant may keep past their sessions (parked, spilled, or marked to keep by a live
  // session): the daemon's catalog and every listing stay bounded.
  uint32_t kept_sequences_per_tenant = 4096;
};

// ---- [remote]: clients on other hosts. ----
struct RemoteConfig {
  std::string control_addr;  // empty: no remote access at all
  std::string data_addr;
  std::string tls_cert, tls_key, client_ca;
  bool rma = false;
  // Anyone who reaches the control port can hold connections open before any secret is checked:
  // the daemon accepts them itself and closes one at once that would pass control_connections
  // open in all or control_connections_per_address from its source (an IPv4 address, or an IPv6
  // /64 prefix: accept_loop.h, SourceOf). A connection with no call in progress for
  // idle_close_ms is closed, and every connection once it is max_connection_ms old (told to go
  // away then, cut 5 s later if calls still hold it): its client reconnects at its
  // next call. Refused calls in a loop, or a call that never sends its request, keep a connection
  // from being idle, not from growing old.
  uint32_t control_connections = 1024;
  uint32_t control_connections_per_address = 64;
  uint32_t idle_close_ms = 60000;
  uint32_t max_connection_ms = 600000;
  bool enabled() const { return !control_addr.empty(); }
};

struct DaemonConfig {
  std::string socket = "/run/specache/control.sock";
  std::string attach_socket;  // empty: socket + ".attach"
  uint64_t pool_bytes = uint64_t{1} << 30;
  uint64_t chunk_bytes = uint64_t{64} << 20;
  int prefault_threads = 4;
  bool lock_memory = true;
  bool huge_pages = true;
  uint32_t lease_ms = 2000;
  uint32_t max_sequences_per_session = 256;
  uint32_t max_page_refs_per_session = 1 << 20;
  std::string metrics_addr = "127.0.0.1:9464";
  std::string log_format = "text";
  std::string log_level = "info";
  std::map<std::string, TenantConfig> tenants;
  SpillConfig spill;
  AccessConfig access;
  LimitsConfig limits;
  RemoteConfig remote;

  uint64_t ParkBytes() const { return spill.park_bytes ? spill.park_bytes : pool_bytes / 4; }

  std::string AttachSocket() const { return attach_socket.empty() ? socket + ".attach" : attach_socket; }
};

// "1073741824", "1GiB", "512 MiB", "64KiB" -> bytes. INVALID_ARGUMENT otherwise.
Result<uint64_t> ParseBytes(const std::string& text);

// A uid or gid from a config or command line: 0 .. 2^32 - 2 ((uid_t) -1 means "no id").
Result<uint32_t> CheckedId(int64_t value, const std::string& what);

// A file of secrets (a tenant's remote secret, the TLS key): a regular file, not a symbolic link,
// owned by root or the daemon's user and readable by its owner only, at most 1 MiB; `what` names
// it in the errors (NOT_FOUND or UNAVAILABLE when it cannot be opened or read, saying why;
// PERMISSION_DENIED when others could read or replace it).
Result<std::string> ReadPrivateFile(const std::string& path, const std::string& what);

// Parses TOML text (errors name the key or the line). Unknown keys are errors.
Result<DaemonConfig> ParseConfig(const std::string& toml_text);
Result<DaemonConfig> LoadConfig(const std::string& path);
Status ValidateConfig(const DaemonConfig& config);
// After the command line's overrides: without [tenants], one tenant "default", open to every
// local user; every tenant without a quota_bytes of its own gets the whole pool as its quota.
void CompleteTenants(DaemonConfig* config);

}  // namespace specache::daemon
