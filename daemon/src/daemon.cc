#include "daemon.h"

#include <fcntl.h>
#include <grp.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>

#include <grpcpp/grpcpp.h>
#include <grpcpp/server_posix.h>
#include <spdlog/pattern_formatter.h>
#include <spdlog/sinks/stdout_sinks.h>
#include <spdlog/spdlog.h>

#include "access.h"
#include "attach_server.h"
#include "control_service.h"
#include "log_rate.h"
#include "metrics.h"
#include "remote_server.h"
#include "specache/host_mapping.h"
#include "specache/spill_store.h"

namespace specache::daemon {

struct Daemon::State {
  DaemonConfig config;
  std::unique_ptr<PathLock> socket_lock, attach_lock;
  PeerTable peers;
  std::unique_ptr<ChunkPool> pool;
  std::unique_ptr<KeptSequences> kept;
  std::unique_ptr<Registry> registry;
  std::unique_ptr<ControlService> service;
  std::unique_ptr<grpc::Server> server;
  boost::asio::io_context io;
  std::unique_ptr<UnixListener> control;
  std::atomic<uint64_t> control_refused{0};
  std::unique_ptr<AttachServer> attach;
  std::thread io_thread, housekeeping;
  std::unique_ptr<Metrics> metrics;
  std::unique_ptr<RemoteServer> remote;
  // What Stats calls read (the local service's run on gRPC threads while `remote` is set at
  // startup and reset at stop).
  std::atomic<RemoteServer*> remote_view{nullptr};
  std::atomic<bool> stopping{false};
};

namespace {

using State = Daemon::State;

// A "Key:   <n> kB" line of /proc/meminfo, in bytes (0 when missing).
uint64_t MemInfoBytes(const std::string& key) {
  std::ifstream in("/proc/meminfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(key + ":", 0) == 0) return std::stoull(line.substr(key.size() + 1)) * 1024;
  }
  return 0;
}

// The memory limit of the daemon's cgroup (v2 memory.max), or 0 when there is none.
uint64_t CgroupMemoryMax() {
  std::ifstream cgroup("/proc/self/cgroup");
  std::string line;
  while (std::getline(cgroup, line)) {
    if (line.rfind("0::", 0) != 0) continue;
    std::ifstream max("/sys/fs/cgroup" + line.substr(3) + "/memory.max");
    std::string value;
    if (max >> value && value != "max") return std::stoull(value);
  }
  return 0;
}

// CAP_IPC_LOCK in the effective set: mlock is then not bounded by RLIMIT_MEMLOCK.
bool CanLockWithoutLimit() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("CapEff:", 0) == 0) return (std::stoull(line.substr(7), nullptr, 16) >> 14) & 1;  // CAP_IPC_LOCK
  }
  return false;
}

std::string MiB(uint64_t bytes) { return std::to_string(bytes >> 20) + " MiB"; }

// Before reserving anything: a pool the machine cannot hold would be OOM-killed minutes later (a
// restart loop under systemd), and one RLIMIT_MEMLOCK cannot lock would run unlocked.
Status CheckMemory(State* d) {
  const DaemonConfig& c = d->config;
  const uint64_t available = MemInfoBytes("MemAvailable");
  if (available > 0 && c.pool_bytes > available) {
    return Status::ResourceExhausted("pool_bytes " + MiB(c.pool_bytes) + " is more than the RAM available (" +
                                     MiB(available) + " MemAvailable of " + MiB(MemInfoBytes("MemTotal")) +
                                     " in /proc/meminfo): lower pool_bytes");
  }
  if (const uint64_t limit = CgroupMemoryMax(); limit > 0 && c.pool_bytes > limit) {
    return Status::ResourceExhausted("pool_bytes " + MiB(c.pool_bytes) + " is more than the cgroup's memory.max (" +
                                     MiB(limit) + "): lower pool_bytes or raise MemoryMax");
  }
  if (c.lock_memory && !CanLockWithoutLimit()) {
    rlimit r{};
    if (getrlimit(RLIMIT_MEMLOCK, &r) == 0 && r.rlim_cur != RLIM_INFINITY && r.rlim_cur < c.pool_bytes) {
      return Status::ResourceExhausted("pool_bytes " + MiB(c.pool_bytes) + " cannot be locked in RAM: RLIMIT_MEMLOCK is " +
                                       std::to_string(r.rlim_cur >> 10) +
                                       " KiB (set LimitMEMLOCK=infinity in the unit, or lock_memory = false)");
    }
  }
  return Status::Ok();
}

// One daemon per socket path: a second one must not delete the first one's sockets.
Status LockSockets(State* d) {
  SPECACHE_RETURN_IF_ERROR(EnsureSocketDirectory(d->config.socket));
  SPECACHE_ASSIGN_OR_RETURN(d->socket_lock, PathLock::Acquire(d->config.socket));
  if (!d->config.attach_socket.empty()) {
    SPECACHE_RETURN_IF_ERROR(EnsureSocketDirectory(d->config.attach_socket));
    SPECACHE_ASSIGN_OR_RETURN(d->attach_lock, PathLock::Acquire(d->config.attach_socket));
  }
  return Status::Ok();
}

// The socket files' mode and group: [access] socket_group, else "specache" when that group exists.
SocketFile SocketFileOf(const DaemonConfig& c, const std::string& path) {
  SocketFile f{path, c.access.socket_mode, c.access.socket_gid, c.access.socket_gid.has_value()};
  if (!f.gid) {
    if (const group* g = getgrnam("specache")) f.gid = g->gr_gid;
  }
  return f;
}

Status ReservePool(State* d) {
  ChunkPoolOptions o{d->config.pool_bytes, d->config.chunk_bytes, d->config.prefault_threads, d->config.lock_memory,
                     d->config.huge_pages};
  const auto start = std::chrono::steady_clock::now();
  SPECACHE_ASSIGN_OR_RETURN(d->pool, ChunkPool::Create(o));
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  spdlog::info("pool: {} chunks of {} MiB reserved in {:.0f} ms ({})", d->pool->chunk_count(),
               d->pool->chunk_bytes() >> 20, ms, d->pool->locked() ? "locked in RAM" : "NOT locked: raise LimitMEMLOCK");
  if (d->config.huge_pages) {
    // The fetch reads random rows across the pool: base pages make each a TLB miss. Shared memory
    // gets huge pages only where the kernel's shmem_enabled allows (docs/operations.md).
    const HostMapping& mapped = d->pool->mapped_at_start();
    const std::string shmem = SettingInForce(TransparentHugePageSetting("shmem_enabled"));
    if (mapped.huge < 0) {
      spdlog::info("pool: huge pages asked for; how many were given is unknown (/proc/self/smaps unreadable)");
    } else {
      const bool off = mapped.huge == 0 && (shmem == "never" || shmem == "deny");
      spdlog::info("pool: {} of {} MiB in huge pages (transparent_hugepage/shmem_enabled: {}{})", mapped.huge >> 20,
                   mapped.resident >> 20, shmem, off ? "; 'advise' would give them: docs/operations.md" : "");
    }
  }
  return Status::Ok();
}

Status OpenSpillTier(State* d) {
  std::unique_ptr<SpillStore> store;
  const SpillConfig& c = d->config.spill;
  if (!c.dir.empty()) {
    SPECACHE_ASSIGN_OR_RETURN(store, SpillStore::Open({c.dir, c.max_bytes, c.compression}));
    spdlog::info("spill tier: {} ({} sequences on disk, limit {})", c.dir, store->List().size(),
                 c.max_bytes ? std::to_string(c.max_bytes >> 20) + " MiB" : std::string("the disk"));
  }
  d->kept = std::make_unique<KeptSequences>(
      KeptOptions{d->config.ParkBytes(), c.high_watermark, c.low_watermark, c.write_through}, std::move(store));
  d->registry = std::make_unique<Registry>(d->config, d->pool.get(), d->kept.get());
  return Status::Ok();
}

// The daemon accepts control connections itself (gRPC has no hook for the peer of a Unix socket),
// records each peer's credentials, and hands the descriptor to gRPC; calls find their caller by
// the connection's name (PeerTable).
Status ListenControl(State* d) {
  d->service = std::make_unique<ControlService>(
      d->registry.get(), d->kept.get(), [d](const grpc::ServerContext* ctx) { return d->peers.Find(ctx->peer()); },
      d->config.AttachSocket(), d->config.lease_ms);
  grpc::ServerBuilder builder;
  builder.RegisterService(d->service.get());
  builder.SetMaxReceiveMessageSize(64 << 10);  // every request is small; refuse anything larger
  d->server = builder.BuildAndStart();
  if (!d->server) return Status::Unavailable("cannot start the gRPC server");
  d->control = std::make_unique<UnixListener>(d->io, "control");
  SPECACHE_RETURN_IF_ERROR(d->control->Listen(SocketFileOf(d->config, d->config.socket), 128));
  d->control->Start([d](int fd) {
    auto caller = PeerOf(fd);
    const int flags = fcntl(fd, F_GETFL);
    if (!caller.ok() || flags < 0 || fcntl(fd, F_SETFL, flags | O_NONBLOCK) != 0) {
      ::close(fd);
      ++d->control_refused;
      spdlog::warn("control: connection closed: {}", caller.ok() ? "cannot make it non-blocking" : caller.status().ToString());
      return;
    }
    const uint32_t uid = caller->uid;
    const Status admitted =
        d->peers.Admit(fd, std::move(*caller), std::to_string(uid),
                       {d->config.limits.control_connections, d->config.limits.control_connections_per_uid, "uid", "[limits]"});
    if (!admitted.ok()) {
      ::close(fd);
      const uint64_t refused = ++d->control_refused;
      if (LoggedOccurrence(refused)) {
        spdlog::warn("control: connection of uid {} refused: {}; {} refused so far", uid, admitted.message(), refused);
      }
      return;
    }
    grpc::AddInsecureChannelFromFd(d->server.get(), fd);
  });
  return Status::Ok();
}

ServiceCounts Counts(State* d) {
  const AttachStats a = d->attach->stats();
  ServiceCounts n;
  // Both control services: the local socket's and the remote port's.
  const RemoteServer* remote = d->remote_view.load();
  n.requests = d->service->requests() + (remote ? remote->service().requests() : 0);
  n.errors = d->service->errors() + (remote ? remote->service().errors() : 0) + a.bad + a.replies_failed;
  n.denied = d->service->denied() + (remote ? remote->service().denied() : 0) + a.denied;
  n.attach_connections = a.open;
  n.attach_denied = a.denied;
  n.attach_bad = a.bad + a.replies_failed;
  n.refused_connections = a.refused + d->control_refused.load();
  n.accept_errors = a.accept_errors + d->control->accept_errors();
  if (remote) {
    n.refused_connections += remote->control_refused();
    n.accept_errors += remote->accept_errors();
    const UcxServerStats r = remote->data_stats();
    n.remote_connections = r.connections;
    n.remote_requests = r.requests;
    n.remote_refused = r.refused;
    n.remote_dropped = r.dropped;
  }
  return n;
}

Status ListenAttach(State* d) {
  d->attach = std::make_unique<AttachServer>(d->io, d->registry.get(), SocketFileOf(d->config, d->config.AttachSocket()),
                                             d->config.limits);
  SPECACHE_RETURN_IF_ERROR(d->attach->Listen());
  // Before the io thread runs: no control connection is accepted, so no Stats call races this.
  d->service->set_connection_counts([d] { return Counts(d); });
  d->io_thread = std::thread([d] {
    auto guard = boost::asio::make_work_guard(d->io);
    d->io.run();
  });
  return Status::Ok();
}

// Clients on other hosts ([remote]): the TLS control plane and the UCX data plane.
Status ListenRemote(State* d) {
  if (!d->config.remote.enabled()) return Status::Ok();
  SPECACHE_ASSIGN_OR_RETURN(d->remote, RemoteServer::Start(d->config, d->registry.get(), d->kept.get(), d->io));
  d->remote->set_connection_counts([d] { return Counts(d); });
  d->remote_view.store(d->remote.get());
  return Status::Ok();
}

// Whether HOST:PORT names this host's loopback only ("127.x.y.z", "[::1]", "localhost").
bool IsLoopback(const std::string& addr) {
  const std::string host = addr.substr(0, addr.rfind(':'));
  return host.rfind("127.", 0) == 0 || host == "[::1]" || host == "::1" || host == "localhost";
}

Status StartMetrics(State* d) {
  if (d->config.metrics_addr.empty()) return Status::Ok();
  SPECACHE_ASSIGN_OR_RETURN(d->metrics, Metrics::Start(d->config.metrics_addr));
  // The endpoint has no authentication: whoever reaches it reads every tenant's name and use.
  if (!IsLoopback(d->config.metrics_addr)) {
    spdlog::warn("metrics endpoint {} is reachable from other hosts, without authentication: anyone who reaches it "
                 "reads every tenant's name and memory use; keep it on loopback (127.0.0.1) or behind a firewall",
                 d->config.metrics_addr);
  }
  return Status::Ok();
}

void StartHousekeeping(State* d) {
  d->housekeeping = std::thread([d] {
    int tick = 0;
    while (!d->stopping.load()) {
      d->registry->Reap();
      if (d->metrics && ++tick % 10 == 0) {
        d->metrics->Update(d->registry->Stats(), Counts(d));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  });
}

}  // namespace

namespace {

// %j: the message as the inside of a JSON string (quotes, backslashes, control bytes escaped).
class JsonMessageFlag final : public spdlog::custom_flag_formatter {
 public:
  void format(const spdlog::details::log_msg& msg, const std::tm&, spdlog::memory_buf_t& dest) override {
    for (char ch : std::string_view(msg.payload.data(), msg.payload.size())) {
      const auto c = static_cast<unsigned char>(ch);
      if (ch == '"' || ch == '\\') {
        dest.push_back('\\');
        dest.push_back(ch);
      } else if (c < 0x20) {
        static const char kHex[] = "0123456789abcdef";
        for (char e : {'\\', 'u', '0', '0', kHex[c >> 4], kHex[c & 15]}) dest.push_back(e);
      } else {
        dest.push_back(ch);
      }
    }
  }
  std::unique_ptr<custom_flag_formatter> clone() const override { return std::make_unique<JsonMessageFlag>(); }
};

}  // namespace

void LogEmbeddedDaemonToStderr() {
  if (!spdlog::get("specached")) spdlog::set_default_logger(spdlog::stderr_logger_mt("specached"));
  spdlog::set_level(spdlog::level::warn);
}

Status ConfigureLogging(const DaemonConfig& c) {
  if (!spdlog::get("specached")) spdlog::set_default_logger(spdlog::stderr_logger_mt("specached"));
  if (c.log_format == "json") {
    auto formatter = std::make_unique<spdlog::pattern_formatter>();
    formatter->add_flag<JsonMessageFlag>('j').set_pattern(
        R"({"time":"%Y-%m-%dT%H:%M:%S.%e%z","level":"%l","pid":%P,"msg":"%j"})");
    spdlog::set_formatter(std::move(formatter));
  } else {
    spdlog::set_pattern("%Y-%m-%d %H:%M:%S.%e %^%l%$ %v");
  }
  const auto level = spdlog::level::from_str(c.log_level);
  if (level == spdlog::level::off && c.log_level != "off") return Status::InvalidArgument("unknown log_level " + c.log_level);
  spdlog::set_level(level);
  return Status::Ok();
}

Daemon::Daemon() : s_(std::make_unique<State>()) {}
Daemon::~Daemon() { Stop(); }

const DaemonConfig& Daemon::config() const { return s_->config; }

std::pair<uint16_t, uint16_t> Daemon::remote_ports() const {
  if (!s_->remote) return {0, 0};
  return {s_->remote->control_port(), s_->remote->data_port()};
}

Status Daemon::Start(const DaemonConfig& config) {
  State* d = s_.get();
  d->config = config;
  const std::vector<std::pair<const char*, std::function<Status()>>> steps = {
      {"check the memory", [&] { return CheckMemory(d); }},
      {"lock the socket path", [&] { return LockSockets(d); }},
      {"reserve memory pool", [&] { return ReservePool(d); }},
      {"open the spill tier", [&] { return OpenSpillTier(d); }},
      {"listen on the control socket", [&] { return ListenControl(d); }},
      {"listen on the attach socket", [&] { return ListenAttach(d); }},
      {"listen for remote clients", [&] { return ListenRemote(d); }},
      {"start the metrics endpoint", [&] { return StartMetrics(d); }},
  };
  for (const auto& [name, step] : steps) {
    Status s = step();
    if (!s.ok()) {
      Stop();
      return s.WithContext(std::string("startup failed at '") + name + "'");
    }
    spdlog::debug("startup: {} done", name);
  }
  StartHousekeeping(d);
  return Status::Ok();
}

void Daemon::Stop() {
  State* d = s_.get();
  if (d->stopping.exchange(true)) return;
  if (d->housekeeping.joinable()) d->housekeeping.join();
  d->io.stop();
  if (d->io_thread.joinable()) d->io_thread.join();
  // The listeners close and remove their files with the io thread stopped (and only when this
  // daemon created them: a daemon refused at the lock never gets that far); no new connection
  // reaches gRPC while it shuts down.
  if (d->control) d->control->Stop();
  if (d->attach) d->attach->Stop();
  if (d->server) d->server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  // After the local control plane (its Stats calls read the remote server); the remote server's
  // own control plane shuts down first inside, then its endpoints close and remote sessions end.
  d->remote_view.store(nullptr);
  d->remote.reset();
  // Sessions end with the daemon: their kept sequences are parked, then everything parked is
  // spilled; what is still in RAM only dies with the process, each sequence named and counted.
  if (d->registry) d->registry->ParkKeptSequences();
  if (d->kept && d->kept->has_spill_tier()) {
    auto spilled = d->kept->SpillAll();
    if (spilled.ok()) {
      if (*spilled > 0) spdlog::info("stop: {} parked sequences spilled", *spilled);
    } else {
      spdlog::error("stop: spilling the parked sequences: {}", spilled.status().ToString());
    }
  }
  if (d->kept) {
    if (const uint32_t lost = d->kept->DropRamOnly(); lost > 0) {
      spdlog::error("stop: {} parked sequences lost with the process ({} kept sequences lost in all)", lost,
                    d->kept->stats().dropped);
    }
  }
  d->attach_lock.reset();
  d->socket_lock.reset();
}

}  // namespace specache::daemon
