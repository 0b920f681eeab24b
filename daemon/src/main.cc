// specached: the KV-memory daemon. Startup is a list of named steps, each returning Status; the
// first failure is logged and ends the process with exit code 1. READY is sent to systemd only
// when the pool is reserved and both sockets listen; WATCHDOG pings follow while it serves.
#include <signal.h>
#include <systemd/sd-daemon.h>

#include <algorithm>
#include <cstring>
#include <optional>

#include <CLI/CLI.hpp>
#include <spdlog/spdlog.h>

#include "command_line.h"
#include "config.h"
#include "daemon.h"
#include "malloc_tuning.h"
#include "specache/version.h"

namespace specache::daemon {
namespace {

struct Overrides {
  std::string config_path, socket, pool_bytes, chunk_bytes, metrics_addr, log_format, log_level, spill_dir, park_bytes;
  std::optional<int64_t> lease_ms;  // range-checked here: a negative value is an error, not "unset"
  bool no_lock = false;
};

Status LoadConfiguration(const Overrides& o, DaemonConfig* c) {
  if (!o.config_path.empty()) {
    SPECACHE_ASSIGN_OR_RETURN(*c, LoadConfig(o.config_path));
  }
  if (!o.socket.empty()) c->socket = o.socket;
  if (!o.pool_bytes.empty()) {
    SPECACHE_ASSIGN_OR_RETURN(c->pool_bytes, ParseBytes(o.pool_bytes));
  }
  if (!o.chunk_bytes.empty()) {
    SPECACHE_ASSIGN_OR_RETURN(c->chunk_bytes, ParseBytes(o.chunk_bytes));
  }
  if (!o.metrics_addr.empty()) c->metrics_addr = o.metrics_addr == "off" ? "" : o.metrics_addr;
  if (!o.log_format.empty()) c->log_format = o.log_format;
  if (!o.log_level.empty()) c->log_level = o.log_level;
  if (o.lease_ms) {
    if (*o.lease_ms < 100 || *o.lease_ms > 600000) {
      return Status::InvalidArgument("--lease-ms " + std::to_string(*o.lease_ms) + " is out of range [100, 600000]");
    }
    c->lease_ms = static_cast<uint32_t>(*o.lease_ms);
  }
  if (o.no_lock) c->lock_memory = false;
  if (!o.spill_dir.empty()) c->spill.dir = o.spill_dir;
  if (!o.park_bytes.empty()) {
    SPECACHE_ASSIGN_OR_RETURN(c->spill.park_bytes, ParseBytes(o.park_bytes));
  }
  CompleteTenants(c);
  return ValidateConfig(*c);
}

int Run(const Overrides& o) {
  // Signals go to the main thread's sigtimedwait only (threads inherit the mask).
  sigset_t signals;
  sigemptyset(&signals);
  // SIGTERM, SIGINT and SIGQUIT stop it gracefully (parked sequences spilled, sessions ended);
  // SIGHUP, SIGUSR1 and SIGUSR2, whose default is to end the process at once, are logged and
  // ignored (there is no reload: restart the daemon to apply a changed configuration).
  for (const int sig : {SIGTERM, SIGINT, SIGQUIT, SIGHUP, SIGUSR1, SIGUSR2}) sigaddset(&signals, sig);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  signal(SIGPIPE, SIG_IGN);

  DaemonConfig config;
  // Errors before the configuration is read go to stderr as well (spdlog's default is stdout).
  (void)ConfigureLogging(config);
  Status s = LoadConfiguration(o, &config);
  if (s.ok()) s = ConfigureLogging(config);
  if (!s.ok()) {
    spdlog::critical("startup failed at 'load configuration': {}", s.ToString());
    return 1;
  }
  Daemon daemon;
  s = daemon.Start(config);
  if (!s.ok()) {
    spdlog::critical("{}", s.ToString());
    sd_notifyf(0, "STATUS=%s", s.ToString().c_str());
    return 1;
  }
  sd_notify(0, "READY=1\nSTATUS=serving");
  spdlog::info("specached ready: control unix:{}, attach {}, metrics {}", config.socket, config.AttachSocket(),
               config.metrics_addr.empty() ? "off" : config.metrics_addr);

  uint64_t watchdog_usec = 0;
  const bool watchdog = sd_watchdog_enabled(0, &watchdog_usec) > 0;
  const timespec wait{0, watchdog ? static_cast<long>(std::min<uint64_t>(watchdog_usec / 2, 500000) * 1000) : 500000000L};
  while (true) {
    const int sig = sigtimedwait(&signals, nullptr, &wait);
    if (sig == SIGTERM || sig == SIGINT || sig == SIGQUIT) break;
    if (sig == SIGHUP) {
      spdlog::warn("SIGHUP ignored: specached does not reload its configuration; restart it to apply changes");
    } else if (sig > 0) {
      spdlog::warn("signal {} ({}) ignored", sig, strsignal(sig));
    }
    if (watchdog) sd_notify(0, "WATCHDOG=1");
  }
  spdlog::info("shutting down");
  sd_notify(0, "STOPPING=1");
  daemon.Stop();
  return 0;
}

}  // namespace
}  // namespace specache::daemon

int main(int argc, char** argv) {
  specache::daemon::LimitMallocRetention();  // before any thread: see malloc_tuning.h
  specache::daemon::Overrides o;
  CLI::App app{"specached: full-precision KV pages in pinned RAM, shared by inference processes", "specached"};
  app.add_option("--config", o.config_path, "TOML configuration file");
  app.add_option("--socket", o.socket, "control socket path (gRPC)");
  app.add_option("--pool-bytes", o.pool_bytes, "memory pool, e.g. 8GiB");
  app.add_option("--chunk-bytes", o.chunk_bytes, "chunk size, e.g. 64MiB");
  app.add_option("--metrics-addr", o.metrics_addr, "Prometheus endpoint HOST:PORT, or 'off'");
  app.add_option("--log-format", o.log_format, "text or json");
  app.add_option("--log-level", o.log_level, "trace, debug, info, warn, error");
  app.add_option("--lease-ms", o.lease_ms, "attach deadline after OpenSession");
  app.add_flag("--no-lock", o.no_lock, "do not mlock the pool");
  app.add_option("--spill-dir", o.spill_dir, "directory of the NVMe spill tier (RocksDB) for kept sequences");
  app.add_option("--park-bytes", o.park_bytes, "RAM for kept sequences before they spill, e.g. 2GiB");
  app.set_version_flag("--version", "specached " SPECACHE_VERSION);
  if (const int code = specache::ParseCommandLine(app, argc, argv); code >= 0) return code;
  return specache::daemon::Run(o);
}
