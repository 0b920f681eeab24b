// Prometheus text endpoint (prometheus-cpp): pool and session gauges, request and error counts,
// refreshed by the daemon's housekeeping loop.
#pragma once

#include <memory>
#include <string>

#include "registry.h"
#include "specache/status.h"

namespace specache::daemon {

class Metrics {
 public:
  // Listens on "HOST:PORT" (loopback by default in the config).
  static Result<std::unique_ptr<Metrics>> Start(const std::string& address);
  ~Metrics();
  void Update(const RegistryStats& stats, uint64_t requests, uint64_t errors);

 private:
  Metrics();
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace specache::daemon
