// libspecache_client: how an engine talks to specached. No gRPC or protobuf types here.
//
//   auto client = specache::client::Client::Connect({"/run/specache/control.sock"});
//   auto session = (*client)->OpenSession("default", 1ull << 30);   // reserves + attaches
//   auto seq = (*session)->CreateSequence({layers, kv_heads, head_dim, 64, 8192});
//   (*session)->Extend(*seq, tokens);                                // one RPC per page at most
//   uint8_t* page = *(*session)->PageData(*seq, layer, page_index);  // from the shared table
//
// Every call has a deadline (ClientOptions::deadline); a daemon that is gone gives UNAVAILABLE or
// DEADLINE_EXCEEDED within it, never a hang. The session lives as long as the Session object
// (its attach connection); destroying it releases everything it held in the daemon.
//
// Thread safety: Client and Session may be used from several threads.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "specache/status.h"

#define SPECACHE_CLIENT_API __attribute__((visibility("default")))

namespace specache::client {

// A daemon on another host: "tcp://HOST:PORT" in ClientOptions::socket, reached over TLS. The
// caller proves a tenant with that tenant's remote secret (sent with every call; the daemon's
// tenants.<name>.remote_secret_file holds it). Remote sessions: specache/remote_session.h.
struct SPECACHE_CLIENT_API RemoteCredentials {
  std::string ca_file;    // PEM: the CA that signed the daemon's certificate (empty: the system's roots)
  std::string cert_file;  // PEM: this client's certificate and key, for a daemon with mutual TLS
  std::string key_file;
  std::string tenant;       // the tenant the secret is for
  std::string secret_file;  // the tenant's secret: the whole file, trailing whitespace not part of it (0600)
  std::string server_name;  // name to check the daemon's certificate against (empty: the host)

  // From SPECACHE_TLS_CA, SPECACHE_TLS_CERT, SPECACHE_TLS_KEY, SPECACHE_TENANT,
  // SPECACHE_SECRET_FILE and SPECACHE_TLS_SERVER_NAME (what specache-run and specachectl use).
  static RemoteCredentials FromEnvironment();
};

struct ClientOptions {
  std::string socket = "/run/specache/control.sock";  // or "tcp://HOST:PORT" (RemoteCredentials)
  std::chrono::milliseconds deadline{2000};
  std::string client_name;  // shown by specachectl sessions
};

struct SPECACHE_CLIENT_API PageLayoutSpec {
  uint32_t n_layers = 0;
  uint32_t n_kv_heads = 0;
  uint32_t head_dim = 0;
  uint32_t page_tokens = 64;
  uint32_t capacity_tokens = 0;  // most tokens the sequence will hold
  // How a row is stored: 0, fp16 ([K|V][head_dim]); 1, int8 codes with an fp16 scale per K and
  // per V half (the agent's specache/host_rows.h has the bytes and the conversions).
  uint32_t row_format = 0;
  uint64_t row_bytes() const;   // one token's row of one KV head, in row_format
  uint64_t page_bytes() const;  // [n_kv_heads][page_tokens] rows
};

struct TenantUsage {
  std::string tenant;
  uint64_t reserved_bytes = 0, used_bytes = 0, quota_bytes = 0;
  uint32_t sessions = 0, sequences = 0;
  uint64_t retained_bytes = 0;  // memory of closed sessions a process still holds (in reserved_bytes)
};

// Stats and ListSequences show only the tenants this user may use (admins see all).
struct DaemonStats {
  uint64_t pool_bytes = 0, reserved_bytes = 0, used_bytes = 0, free_bytes = 0, chunk_bytes = 0;
  uint32_t sessions = 0, sequences = 0;
  uint64_t pages = 0, requests = 0, errors = 0, uptime_ms = 0;
  bool memory_locked = false;
  // The pool's bytes the kernel mapped with huge pages at the daemon's startup; -1: the daemon could
  // not tell (0 from a daemon older than this field).
  int64_t pool_huge_bytes = -1;
  std::string version;  // the daemon's ("0.1.0"); empty from a daemon older than this field
  std::vector<TenantUsage> tenants;
  // Kept sequences and the spill tier.
  uint64_t parked_bytes = 0, spilled_bytes = 0, spill_disk_bytes = 0;
  uint32_t parked_sequences = 0, spilled_sequences = 0;
  bool spill_tier = false;
  uint64_t spills = 0, restores = 0, spill_bytes_total = 0, restore_bytes_total = 0;
  double spill_seconds = 0, restore_seconds = 0;
  uint64_t checksum_failures = 0, spill_read_errors = 0, spill_write_errors = 0, kept_dropped = 0;
  uint64_t kept_evicted = 0, kept_evicted_bytes = 0;  // kept sequences an operator evicted, their bytes
  // Connections and refusals.
  uint64_t attach_connections = 0, refused_connections = 0, accept_errors = 0, denied_requests = 0;
  uint32_t chunks_out_of_service = 0;
  uint64_t spill_failures = 0, spill_backoff_ms = 0, spill_unreadable_records = 0, spill_damaged_sequences = 0;
  // The remote data plane (UCX): endpoints open, messages served, refused, dropped.
  uint64_t remote_connections = 0, remote_requests = 0, remote_refused = 0, remote_dropped = 0;
};

struct SpillVerify {
  uint64_t sequences = 0, pages_checked = 0, pages_bad = 0;
  std::vector<std::string> bad;
};

struct SessionRecord {
  uint64_t id = 0;
  std::string tenant, client_name;
  int32_t pid = 0;
  uint32_t uid = 0;
  bool attached = false;
  uint32_t chunks = 0, sequences = 0;
  uint64_t used_bytes = 0, age_ms = 0;
};

struct SequenceRecord {
  uint64_t id = 0, session = 0;  // session 0: kept by the tenant
  std::string tenant;
  PageLayoutSpec layout;
  uint32_t pages_per_layer = 0;
  uint64_t bytes = 0;
  std::string state;  // "session", "parked" or "spilled"
};

class Session;

class SPECACHE_CLIENT_API Client {
 public:
  // Connects (UNAVAILABLE within the deadline when no daemon listens). A tcp:// address takes
  // its credentials from the environment (RemoteCredentials::FromEnvironment).
  static Result<std::unique_ptr<Client>> Connect(const ClientOptions& options);
  static Result<std::unique_ptr<Client>> Connect(const ClientOptions& options, const RemoteCredentials& remote);
  // True for a daemon on another host (tcp://): sessions then come from OpenRemoteSession
  // (remote_session.h), and OpenSession is FAILED_PRECONDITION.
  bool remote() const;
  ~Client();

  // Reserves pool_bytes (whole chunks) for `tenant`, then attaches: maps the page table and the
  // chunks. PERMISSION_DENIED for a tenant this user may not use, RESOURCE_EXHAUSTED over quota.
  Result<std::unique_ptr<Session>> OpenSession(const std::string& tenant, uint64_t pool_bytes);

  Result<DaemonStats> Stats();
  Result<std::vector<SessionRecord>> ListSessions();
  Result<std::vector<SequenceRecord>> ListSequences();

  // Operator calls on kept sequences: parked -> disk (one, or every parked one: returns how
  // many), disk -> RAM (checksums verified: DATA_LOSS names a bad page), forget, check the disk.
  Result<uint32_t> Spill(uint64_t sequence);
  Result<uint32_t> SpillAll();
  Status Restore(uint64_t sequence);
  Status Evict(uint64_t sequence);
  Result<SpillVerify> VerifySpill();

  struct Impl;

 private:
  friend class RemoteSession;  // its control calls go through this client's channel
  explicit Client(std::unique_ptr<Impl> impl);
  std::shared_ptr<Impl> impl_;
};

class SPECACHE_CLIENT_API Session {
 public:
  ~Session();  // closes the session: everything it held returns to the daemon
  uint64_t id() const;
  uint64_t chunk_bytes() const;
  uint32_t chunk_count() const;
  // Where chunk i (< chunk_count()) is mapped: chunk_bytes() bytes, fixed for the session's life
  // (what a GPU agent registers with the device to read pages in place).
  uint8_t* chunk_data(uint32_t i) const;

  Result<uint64_t> CreateSequence(const PageLayoutSpec& layout);
  // Makes room for tokens [0, tokens) at every layer; returns pages per layer. No RPC when the
  // pages already exist.
  Result<uint32_t> Extend(uint64_t sequence, uint32_t tokens);
  // Release and Keep refuse (FAILED_PRECONDITION) a sequence a DaemonSource of this session holds:
  // its agent reads and writes those pages, and a released page goes to the next sequence made.
  // Release or keep it through the source (DaemonSource::ReleaseSequence, DaemonSource::Keep).
  Status Release(uint64_t sequence);
  // Keep the sequence past this session: when the session ends, the daemon parks its pages for
  // the tenant (RAM, then the spill tier); a later session of the tenant takes it back with Claim.
  Status Keep(uint64_t sequence);
  // Takes a kept sequence of this session's tenant (same layout) into this session: returns its
  // pages per layer; PageData then reads its pages.
  Result<uint32_t> Claim(uint64_t sequence, const PageLayoutSpec& layout);

  // From the shared page table, without a round trip: pages per layer now mapped, and the memory
  // of one page ([kv_head][token] rows of the sequence's row format: shm_layout.h's RowBytes).
  // OUT_OF_RANGE beyond the mapped pages. The memory stays mapped until the session ends; after
  // the sequence's Release its pages may be given to another sequence of the session.
  Result<uint32_t> PagesPerLayer(uint64_t sequence) const;
  Result<uint8_t*> PageData(uint64_t sequence, uint32_t layer, uint32_t page) const;

  // False once the daemon closed the attach connection (it died or dropped the session).
  bool Alive() const;
  uint64_t extend_rpcs() const;  // ExtendSequence calls sent (for the hot-path count)

  struct Impl;

 private:
  friend class Client;
  friend class DaemonSource;  // marks the sequences it holds, and releases and keeps them
  explicit Session(std::unique_ptr<Impl> impl);
  // The holder's side of the mark above: a sequence made held, and its release (the mark gone
  // once the daemon no longer has it) and keep.
  void Hold(uint64_t sequence);
  Status ReleaseHeld(uint64_t sequence);
  Status KeepHeld(uint64_t sequence);
  std::unique_ptr<Impl> impl_;
};

}  // namespace specache::client
