// Prometheus text endpoint (prometheus-cpp): pool and session gauges, request and error counts,
// refreshed by the daemon's housekeeping loop.
#pragma once

#include <memory>
#include <string>

#include "registry.h"
#include "specache/status.h"

namespace specache::daemon {

// The service's own counters, next to the registry's state.
struct ServiceCounts {
  uint64_t requests = 0, errors = 0;  // control calls (errors: with an error), and attach requests malformed,
                                      // cut short or not sent in time (in errors alone)
  uint64_t denied = 0;               // control calls refused by the access rules, attach requests refused
  uint64_t attach_connections = 0;   // open now
  uint64_t attach_denied = 0, attach_bad = 0;  // the attach socket's parts of denied and errors
  uint64_t refused_connections = 0;  // closed at accept: over a cap ([limits], [remote]), or no peer credentials
  uint64_t accept_errors = 0;        // accept() failures (EMFILE...), each followed by a backoff
  // The remote data plane (ucx_server.h); 0 without [remote].
  uint64_t remote_connections = 0;   // UCX endpoints open now
  uint64_t remote_requests = 0, remote_refused = 0, remote_dropped = 0;
};

class Metrics {
 public:
  // Listens on "HOST:PORT" (loopback by default in the config).
  static Result<std::unique_ptr<Metrics>> Start(const std::string& address);
  ~Metrics();
  void Update(const RegistryStats& stats, const ServiceCounts& counts);

 private:
  Metrics();
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace specache::daemon
