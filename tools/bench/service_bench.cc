// specache-service-bench: control-plane figures of specached, against a daemon embedded in this
// process (same code as specached; gRPC over a Unix socket) or a running one (--socket).
//   latency: p50/p99 of CreateSequence, ExtendSequence (one new page per call) and
//            ReleaseSequence with 1 and 16 concurrent clients
//   attach:  OpenSession (reserve + attach: descriptors passed, chunks mapped) time per GiB
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <thread>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "bench_stats.h"
#include "daemon.h"
#include "specache/client.h"
#include "specache/version.h"

namespace {

using Clock = std::chrono::steady_clock;
using specache::bench::Percentile;
using specache::client::Client;

double Ms(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double, std::milli>(b - a).count(); }

struct Latencies {
  std::vector<double> create, extend, release;
  int failed = 0;           // calls that failed: not timed, and the run fails
  std::string first_error;

  void Fail(const specache::Status& s) {
    if (failed++ == 0) first_error = s.ToString();
  }
};

// One client's loop: create a sequence, extend it page by page, release it.
Latencies ClientLoop(const std::string& socket, int rounds, int pages) {
  Latencies l;
  auto client = Client::Connect({socket, std::chrono::milliseconds(5000), "bench"});
  if (!client.ok()) {
    l.Fail(client.status());
    return l;
  }
  auto session = (*client)->OpenSession("default", 16 << 20);
  if (!session.ok()) {
    l.Fail(session.status());
    return l;
  }
  for (int r = 0; r < rounds; ++r) {
    auto t0 = Clock::now();
    auto seq = (*session)->CreateSequence({32, 8, 128, 16, static_cast<uint32_t>(16 * pages)});
    auto t1 = Clock::now();
    if (!seq.ok()) {
      l.Fail(seq.status());
      continue;
    }
    l.create.push_back(Ms(t0, t1));
    for (int p = 1; p <= pages; ++p) {
      t0 = Clock::now();
      const auto extended = (*session)->Extend(*seq, static_cast<uint32_t>(16 * p));
      if (extended.ok()) {
        l.extend.push_back(Ms(t0, Clock::now()));
      } else {
        l.Fail(extended.status());
      }
    }
    t0 = Clock::now();
    if (const specache::Status s = (*session)->Release(*seq); s.ok()) {
      l.release.push_back(Ms(t0, Clock::now()));
    } else {
      l.Fail(s);
    }
  }
  return l;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"specache-service-bench: control-plane latency and attach cost of specached"};
  std::string socket, json_path;
  int rounds = 200;
  app.add_option("--socket", socket, "a running specached (default: one embedded here)");
  app.add_option("--rounds", rounds, "create/extend/release rounds per client")->capture_default_str();
  app.add_option("--json", json_path, "also write the figures here");
  app.set_version_flag("--version", "specache-service-bench " SPECACHE_VERSION);
  CLI11_PARSE(app, argc, argv);

  std::unique_ptr<specache::daemon::Daemon> embedded;
  std::string dir;
  if (socket.empty()) {
    char tmpl[] = "/tmp/specache-bench-XXXXXX";
    dir = mkdtemp(tmpl);
    specache::daemon::DaemonConfig c;
    c.socket = dir + "/control.sock";
    c.pool_bytes = uint64_t{2} << 30;
    c.chunk_bytes = uint64_t{16} << 20;
    c.metrics_addr = "";
    c.lock_memory = false;
    specache::daemon::AddDefaultTenant(&c);
    spdlog::set_level(spdlog::level::warn);
    embedded = std::make_unique<specache::daemon::Daemon>();
    if (auto s = embedded->Start(c); !s.ok()) {
      std::fprintf(stderr, "%s\n", s.ToString().c_str());
      return 1;
    }
    socket = c.socket;
  }
  nlohmann::json out;
  int failed = 0;
  std::printf("%-8s %-8s %10s %10s %10s\n", "clients", "call", "p50 ms", "p99 ms", "calls");
  for (int clients : {1, 16}) {
    std::vector<std::thread> threads;
    std::vector<Latencies> results(clients);
    for (int i = 0; i < clients; ++i) {
      threads.emplace_back([&, i] { results[i] = ClientLoop(socket, rounds / (clients == 1 ? 1 : 4), 8); });
    }
    for (auto& t : threads) t.join();
    Latencies all;
    for (auto& r : results) {
      all.create.insert(all.create.end(), r.create.begin(), r.create.end());
      all.extend.insert(all.extend.end(), r.extend.begin(), r.extend.end());
      all.release.insert(all.release.end(), r.release.begin(), r.release.end());
      if (r.failed) std::printf("%d calls of a client failed, the first: %s\n", r.failed, r.first_error.c_str());
      failed += r.failed;
    }
    for (auto [name, v] : {std::pair{"create", &all.create}, {"extend", &all.extend}, {"release", &all.release}}) {
      const double p50 = Percentile(*v, 0.5), p99 = Percentile(*v, 0.99);
      std::printf("%-8d %-8s %10.3f %10.3f %10zu\n", clients, name, p50, p99, v->size());
      out["latency"][std::to_string(clients)][name] = {{"p50_ms", p50}, {"p99_ms", p99}, {"calls", v->size()}};
    }
  }
  auto client = Client::Connect({socket, std::chrono::milliseconds(5000), "bench"});
  if (!client.ok()) {
    std::fprintf(stderr, "%s\n", client.status().ToString().c_str());
    return 1;
  }
  std::printf("\n%-12s %12s %12s\n", "session", "open+attach", "ms per GiB");
  for (uint64_t mib : {256, 1024}) {
    const auto t0 = Clock::now();
    auto session = (*client)->OpenSession("default", mib << 20);
    const double ms = Ms(t0, Clock::now());
    if (!session.ok()) {
      std::printf("%-12s %s\n", (std::to_string(mib) + " MiB").c_str(), session.status().ToString().c_str());
      ++failed;
      continue;
    }
    std::printf("%-12s %10.2f ms %12.2f\n", (std::to_string(mib) + " MiB").c_str(), ms, ms * 1024 / mib);
    out["attach"][std::to_string(mib) + "MiB"] = {{"ms", ms}, {"ms_per_gib", ms * 1024 / mib}};
  }
  if (!json_path.empty()) std::ofstream(json_path) << out.dump(1) << "\n";
  client->reset();
  if (embedded) embedded->Stop();
  if (!dir.empty()) std::filesystem::remove_all(dir);
  if (failed) std::fprintf(stderr, "specache-service-bench: %d calls failed (not timed)\n", failed);
  return failed ? 1 : 0;
}
