// specached's server: memory pool, registry, gRPC control socket, attach socket, metrics and the
// housekeeping loop (lease reaping, metrics refresh). Used by the specached binary and embedded
// in other processes (specache-run without --daemon, tests) with the same code.
#pragma once

#include <atomic>
#include <memory>
#include <thread>
#include <utility>

#include "config.h"
#include "specache/status.h"

namespace specache::daemon {

class Daemon {
 public:
  Daemon();
  ~Daemon();  // Stop()
  // Startup as ordered steps (reserve memory pool, listen on the control socket, listen on the
  // attach socket, start metrics); the error names the failed step.
  Status Start(const DaemonConfig& config);
  void Stop();
  const DaemonConfig& config() const;
  // The ports [remote] listens on (control, data): what port 0 in the config became. {0, 0}
  // without [remote].
  std::pair<uint16_t, uint16_t> remote_ports() const;

  struct State;  // defined in daemon.cc

 private:
  std::unique_ptr<State> s_;
};

// Logging to stderr in the config's format and level.
Status ConfigureLogging(const DaemonConfig& config);

// For a program that runs a daemon inside itself (specache-run's embedded daemon, the benches, the
// Python binding): the daemon's warnings and errors go to stderr, so that the program's stdout
// (its tables, its --json) stays its own.
void LogEmbeddedDaemonToStderr();

}  // namespace specache::daemon
