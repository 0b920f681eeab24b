// specache-service-bench: control-plane figures of specached, against a daemon embedded in this
// process (same code as specached; gRPC over a Unix socket) or a running one (--socket).
//   latency: p50/p99 of CreateSequence, ExtendSequence (one new page per call) and
//            ReleaseSequence with 1 and 16 concurrent clients
//   attach:  OpenSession (reserve + attach: descriptors passed, chunks mapped) time per GiB
//   --verify-loop: ExtendSequence p50/p99 of one client, idle and then while an operator runs
//            VerifySpill in a loop over --spill-mib of spilled sequences (and a monitor reads
//            Stats every 50 ms, as the metrics endpoint does): long admin calls must not stall
//            the engines' calls (the embedded daemon only)
//   --release-stall MIB: ExtendSequence p50/p99/max of one client, idle and then while another
//            session releases a MIB MiB sequence in a loop, and while it claims one back (keep,
//            close, claim) in a loop: the daemon zeroes and copies those pages without the lock
//            the engines' calls take, so one session's big release or claim must not stall the
//            others' calls (the embedded daemon only)
//   --park-cost DIR: time to park a 32 MiB sequence (the copy a closing session's kept
//            sequence takes) without and with write-through to a spill store in DIR
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <atomic>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "bench_stats.h"
#include "command_line.h"
#include "daemon.h"
#include "kept_sequences.h"
#include "output_paths.h"
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
  // Another loop's calls added to these (the first error kept: this one's, else the other's).
  void Add(const Latencies& o) {
    create.insert(create.end(), o.create.begin(), o.create.end());
    extend.insert(extend.end(), o.extend.begin(), o.extend.end());
    release.insert(release.end(), o.release.begin(), o.release.end());
    if (failed == 0 && o.failed) first_error = o.first_error;
    failed += o.failed;
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

// Keeps `mib` MiB of sequences (32 MiB each) and spills them.
bool SpillSequences(const std::string& socket, uint64_t mib) {
  auto client = Client::Connect({socket, std::chrono::milliseconds(5000), "bench-spill"});
  if (!client.ok()) return false;
  const uint64_t count = std::max<uint64_t>(1, mib / 32);
  {
    auto session = (*client)->OpenSession("default", (count * 32 + 16) << 20);
    if (!session.ok()) return std::fprintf(stderr, "%s\n", session.status().ToString().c_str()), false;
    for (uint64_t i = 0; i < count; ++i) {  // 32 layers x 16 pages of 64 KiB
      auto seq = (*session)->CreateSequence({32, 8, 128, 16, 256});
      if (!seq.ok() || !(*session)->Extend(*seq, 256).ok() || !(*session)->Keep(*seq).ok()) return false;
    }
  }  // closed: the sequences are parked
  for (int i = 0; i < 500; ++i) {
    auto st = (*client)->Stats();
    if (st.ok() && st->parked_sequences + st->spilled_sequences >= count) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  auto spilled = (*client)->SpillAll();
  auto st = (*client)->Stats();
  return spilled.ok() && st.ok() && st->spilled_sequences == count;
}

// The big session's work for ReleaseStall, until `done`: sequences of `mib` MiB (8 tokens a MiB:
// 32 layers x 8 KV heads x 128 dims of fp16 K and V, 64-token pages) made and released in one session; or
// (claim) made in a session, kept, the session closed, and claimed back into a new one (then
// released with it). The timed part (the release, the claim) goes to `ms`.
specache::Status BigOps(Client& client, bool claim, uint64_t mib, const std::atomic<bool>& done,
                        std::vector<double>* ms, std::atomic<int>* count) {
  const auto tokens = static_cast<uint32_t>(mib * 8);
  const specache::client::PageLayoutSpec layout{32, 8, 128, 64, tokens};
  const uint64_t pool = (mib + 64) << 20;
  auto session = client.OpenSession("default", pool);
  if (!session.ok()) return session.status();
  while (!done.load()) {
    auto seq = (*session)->CreateSequence(layout);
    if (!seq.ok()) return seq.status();
    if (auto extended = (*session)->Extend(*seq, tokens); !extended.ok()) return extended.status();
    if (!claim) {
      const auto t0 = Clock::now();
      SPECACHE_RETURN_IF_ERROR((*session)->Release(*seq));
      ms->push_back(Ms(t0, Clock::now()));
      ++*count;
      continue;
    }
    SPECACHE_RETURN_IF_ERROR((*session)->Keep(*seq));
    session->reset();  // closed: the sequence is parked before the close returns
    session = client.OpenSession("default", pool);
    if (!session.ok()) return session.status();
    const auto t0 = Clock::now();
    auto claimed = (*session)->Claim(*seq, layout);
    if (!claimed.ok()) return claimed.status();
    ms->push_back(Ms(t0, Clock::now()));
    ++*count;
    SPECACHE_RETURN_IF_ERROR((*session)->Release(*seq));
  }
  return specache::Status::Ok();
}

// Extend p50/p99/max idle, then while another session releases, then claims, big sequences: the
// client's rounds of create/extend/release repeat until the big session has done kLeastBigOps (a
// minute at most), so that the client's calls overlap several of them.
constexpr int kLeastBigOps = 3;
int ReleaseStall(const std::string& socket, int rounds, uint64_t mib, nlohmann::json* out) {
  std::printf("%-22s %10s %10s %10s %8s %10s %14s\n", "extend", "p50 ms", "p99 ms", "max ms", "calls", "big ops",
              "big op p50 ms");
  double idle_p99 = 0;
  int failed = 0;
  for (const char* phase : {"idle", "during releases", "during claims"}) {
    const bool loaded = std::strcmp(phase, "idle") != 0, claim = std::strcmp(phase, "during claims") == 0;
    std::atomic<bool> done{false};
    std::atomic<int> big_count{0};
    std::vector<double> big_ms;
    specache::Status big_status;
    std::thread big;
    if (loaded) {
      big = std::thread([&] {
        auto c = Client::Connect({socket, std::chrono::milliseconds(60000), "bench-big"});
        if (!c.ok()) big_status = c.status();
        if (c.ok()) big_status = BigOps(**c, claim, mib, done, &big_ms, &big_count);
      });
      std::this_thread::sleep_for(std::chrono::milliseconds(200));  // the first big sequence is under way
    }
    Latencies l;
    const auto until = Clock::now() + std::chrono::minutes(1);
    do {
      l.Add(ClientLoop(socket, rounds, 8));
    } while (loaded && big_count.load() < kLeastBigOps && Clock::now() < until);
    done = true;
    if (big.joinable()) big.join();
    if (!big_status.ok()) {
      std::printf("%s: the big session failed: %s\n", phase, big_status.ToString().c_str());
      ++failed;
    }
    if (l.failed) std::printf("%s: %d calls failed, the first: %s\n", phase, l.failed, l.first_error.c_str());
    failed += l.failed;
    const double p50 = Percentile(l.extend, 0.5), p99 = Percentile(l.extend, 0.99);
    const double max = l.extend.empty() ? 0 : *std::max_element(l.extend.begin(), l.extend.end());
    const double big_p50 = Percentile(big_ms, 0.5);
    if (!loaded) idle_p99 = p99;
    std::printf("%-22s %10.3f %10.3f %10.3f %8zu %10zu %14.2f\n", phase, p50, p99, max, l.extend.size(), big_ms.size(),
                big_p50);
    (*out)["release_stall"][phase] = {{"extend_p50_ms", p50},         {"extend_p99_ms", p99},
                                      {"extend_max_ms", max},         {"calls", l.extend.size()},
                                      {"big_ops", big_ms.size()},     {"big_op_p50_ms", big_p50}};
    if (loaded) {
      // A call that waited for a whole big op would take about its time: max / big op near 1.
      const double max_over_op = big_p50 > 0 ? max / big_p50 : 0;
      std::printf("  p99 / idle p99 %.2fx, max extend / big op p50 %.3f\n", p99 / idle_p99, max_over_op);
      (*out)["release_stall"][phase]["p99_ratio"] = p99 / idle_p99;
      (*out)["release_stall"][phase]["max_over_big_op"] = max_over_op;
    }
  }
  return failed ? 1 : 0;
}

// Extend p50/p99 idle, then with a verify loop and a stats loop running.
int VerifyLoop(const std::string& socket, int rounds, nlohmann::json* out) {
  std::printf("%-22s %10s %10s %10s %8s\n", "extend", "p50 ms", "p99 ms", "calls", "verifies");
  double idle_p99 = 0;
  for (bool loaded : {false, true}) {
    std::atomic<bool> done{false};
    std::atomic<int> verifies{0};
    std::vector<std::thread> admin;
    if (loaded) {
      admin.emplace_back([&] {
        auto c = Client::Connect({socket, std::chrono::milliseconds(60000), "bench-verify"});
        while (c.ok() && !done.load()) {
          if ((*c)->VerifySpill().ok()) ++verifies;
        }
      });
      admin.emplace_back([&] {
        auto c = Client::Connect({socket, std::chrono::milliseconds(60000), "bench-stats"});
        while (c.ok() && !done.load()) {
          (void)(*c)->Stats();
          std::this_thread::sleep_for(std::chrono::milliseconds(50));
        }
      });
      std::this_thread::sleep_for(std::chrono::milliseconds(200));  // the first verify is under way
    }
    Latencies l = ClientLoop(socket, rounds, 8);
    done = true;
    for (auto& t : admin) t.join();
    const double p50 = Percentile(l.extend, 0.5), p99 = Percentile(l.extend, 0.99);
    if (!loaded) idle_p99 = p99;
    const char* name = loaded ? "during a verify loop" : "idle";
    std::printf("%-22s %10.3f %10.3f %10zu %8d\n", name, p50, p99, l.extend.size(), verifies.load());
    (*out)["verify_loop"][loaded ? "loaded" : "idle"] = {
        {"extend_p50_ms", p50}, {"extend_p99_ms", p99}, {"calls", l.extend.size()}, {"verifies", verifies.load()}};
  }
  const double ratio = (*out)["verify_loop"]["loaded"]["extend_p99_ms"].get<double>() / idle_p99;
  std::printf("extend p99 during verify / idle: %.2fx\n", ratio);
  (*out)["verify_loop"]["p99_ratio"] = ratio;
  return 0;
}

// Parks `count` 32 MiB sequences into KeptSequences over a spill store in `dir`, without and
// with write-through; prints the time per park.
int ParkCost(const std::string& dir, int count, nlohmann::json* out) {
  const specache::PageLayout layout{32, 8, 128, 16, 256};  // 64 KiB pages
  const uint32_t pages = 16;                              // 32 layers x 16 pages: 32 MiB
  std::vector<uint8_t> data(uint64_t{layout.n_layers} * pages * layout.page_bytes());
  std::mt19937_64 rng(1);
  for (size_t i = 0; i + 8 <= data.size(); i += 8) {
    const uint64_t v = rng();
    std::memcpy(&data[i], &v, 8);
  }
  auto page = [&](uint32_t l, uint32_t p) { return data.data() + (uint64_t{l} * pages + p) * layout.page_bytes(); };
  std::printf("%-16s %10s %10s %10s\n", "park 32 MiB", "p50 ms", "max ms", "MiB/s");
  for (bool through : {false, true}) {
    const std::string store_dir = dir + (through ? "/write-through" : "/ram-only");
    auto store = specache::SpillStore::Open({store_dir});
    if (!store.ok()) return std::fprintf(stderr, "%s\n", store.status().ToString().c_str()), 1;
    specache::daemon::KeptOptions o;
    o.park_bytes = uint64_t(count + 1) * data.size();
    o.high_watermark = o.low_watermark = 1.0;  // no watermark spills: only the park itself
    o.write_through = through;
    specache::daemon::KeptSequences kept(o, std::move(store).value());
    std::vector<double> ms;
    for (int i = 0; i < count; ++i) {
      const auto t0 = Clock::now();
      if (!kept.Park("bench", static_cast<uint64_t>(i + 1), layout, pages, page).ok()) return 1;
      ms.push_back(Ms(t0, Clock::now()));
    }
    const double p50 = Percentile(ms, 0.5), max = *std::max_element(ms.begin(), ms.end());
    const char* name = through ? "write-through" : "RAM only";
    std::printf("%-16s %10.2f %10.2f %10.0f\n", name, p50, max, 32 / (p50 / 1000));
    (*out)["park_cost"][through ? "write_through" : "ram_only"] = {{"p50_ms", p50}, {"max_ms", max}, {"parks", count}};
    std::filesystem::remove_all(store_dir);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"specache-service-bench: control-plane latency and attach cost of specached", "specache-service-bench"};
  std::string socket, json_path;
  int rounds = 200;
  bool verify_loop = false;
  uint64_t spill_mib = 256, stall_mib = 0;
  std::string park_cost_dir;
  app.add_option("--socket", socket, "a running specached (default: one embedded here)");
  app.add_option("--rounds", rounds, "create/extend/release rounds per client")->capture_default_str();
  app.add_option("--json", json_path, "also write the figures here");
  app.set_version_flag("--version", "specache-service-bench " SPECACHE_VERSION);
  app.add_option("--park-cost", park_cost_dir, "time parking with and without write-through (a spill store in DIR)");
  app.add_flag("--verify-loop", verify_loop, "Extend latency idle and during a VerifySpill loop (embedded daemon)");
  app.add_option("--spill-mib", spill_mib, "spilled MiB that each verify reads (--verify-loop)")->capture_default_str();
  app.add_option("--release-stall", stall_mib,
                 "Extend latency idle and while another session releases, then claims, sequences of this many MiB "
                 "(embedded daemon)")
      ->check(CLI::Range(uint64_t{16}, uint64_t{4096}));
  if (const int code = specache::ParseCommandLine(app, argc, argv); code >= 0) return code;
  // Output paths are checked (or created) before any measurement.
  for (const specache::Status& s :
       {park_cost_dir.empty() ? specache::Status::Ok() : specache::PrepareOutputDir(park_cost_dir),
        json_path.empty() ? specache::Status::Ok() : specache::PrepareOutputFile(json_path)}) {
    if (!s.ok()) {
      std::fprintf(stderr, "specache-service-bench: %s\n", s.ToString().c_str());
      return 1;
    }
  }

  if (!park_cost_dir.empty()) {
    specache::daemon::LogEmbeddedDaemonToStderr();
    nlohmann::json out;
    const int rc = ParkCost(park_cost_dir, std::max(rounds / 20, 4), &out);
    if (!json_path.empty()) std::ofstream(json_path) << out.dump(1) << "\n";
    return rc;
  }
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
    if (stall_mib) {  // the big session (twice, while a claim's new session and the parked copy overlap)
      c.pool_bytes = std::max<uint64_t>(c.pool_bytes, (2 * stall_mib + 256) << 20);
      c.spill.park_bytes = (stall_mib + 64) << 20;
    }
    if (verify_loop) {
      c.spill.dir = dir + "/spill";
      c.spill.park_bytes = (spill_mib + 64) << 20;
      c.pool_bytes = std::max<uint64_t>(c.pool_bytes, (spill_mib + 128) << 20);
    }
    specache::daemon::CompleteTenants(&c);
    specache::daemon::LogEmbeddedDaemonToStderr();
    embedded = std::make_unique<specache::daemon::Daemon>();
    if (auto s = embedded->Start(c); !s.ok()) {
      std::fprintf(stderr, "%s\n", s.ToString().c_str());
      return 1;
    }
    socket = c.socket;
  }
  nlohmann::json out;
  int failed = 0;
  // The way out once the figures are in: the JSON written, the embedded daemon stopped and its
  // directory removed.
  const auto finish = [&](int rc) {
    if (!json_path.empty()) std::ofstream(json_path) << out.dump(1) << "\n";
    if (embedded) embedded->Stop();
    if (!dir.empty()) std::filesystem::remove_all(dir);
    return rc;
  };
  if (stall_mib) {
    if (!embedded) return std::fprintf(stderr, "--release-stall needs the embedded daemon (no --socket)\n"), 2;
    return finish(ReleaseStall(socket, rounds, stall_mib, &out));
  }
  if (verify_loop) {
    if (!embedded) return std::fprintf(stderr, "--verify-loop needs the embedded daemon (no --socket)\n"), 2;
    if (!SpillSequences(socket, spill_mib)) return std::fprintf(stderr, "could not spill the sequences\n"), 1;
    return finish(VerifyLoop(socket, rounds, &out));
  }
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
      all.Add(r);
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
  client->reset();
  if (failed) std::fprintf(stderr, "specache-service-bench: %d calls failed (not timed)\n", failed);
  return finish(failed ? 1 : 0);
}
