// specachectl: the operator's view of a specached: stats, sessions, sequences, watch, and the
// kept sequences' tier: spill, restore, evict, verify.
#include <unistd.h>

#include <cstdio>
#include <iostream>
#include <thread>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "command_line.h"
#include "specache/client.h"
#include "specache/host_rows.h"
#include "specache/version.h"

namespace {

using specache::client::Client;
using specache::client::DaemonStats;

std::string Mib(uint64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f MiB", static_cast<double>(bytes) / (1 << 20));
  return buf;
}

nlohmann::json StatsJson(const DaemonStats& s) {
  nlohmann::json tenants = nlohmann::json::array();
  for (const auto& t : s.tenants) {
    tenants.push_back({{"tenant", t.tenant}, {"reserved_bytes", t.reserved_bytes}, {"used_bytes", t.used_bytes},
                       {"quota_bytes", t.quota_bytes}, {"retained_bytes", t.retained_bytes}, {"sessions", t.sessions},
                       {"sequences", t.sequences}});
  }
  return {{"version", s.version},           {"pool_bytes", s.pool_bytes}, {"reserved_bytes", s.reserved_bytes}, {"used_bytes", s.used_bytes},
          {"free_bytes", s.free_bytes},  {"chunk_bytes", s.chunk_bytes},       {"sessions", s.sessions},
          {"sequences", s.sequences},    {"pages", s.pages},                   {"requests", s.requests},
          {"errors", s.errors},          {"uptime_ms", s.uptime_ms},           {"memory_locked", s.memory_locked},
          {"pool_huge_bytes", s.pool_huge_bytes},
          {"tenants", tenants},
          {"parked_bytes", s.parked_bytes}, {"spilled_bytes", s.spilled_bytes},
          {"spill_disk_bytes", s.spill_disk_bytes}, {"parked_sequences", s.parked_sequences},
          {"spilled_sequences", s.spilled_sequences}, {"spill_tier", s.spill_tier}, {"spills", s.spills},
          {"restores", s.restores}, {"spill_bytes_total", s.spill_bytes_total},
          {"restore_bytes_total", s.restore_bytes_total}, {"spill_seconds", s.spill_seconds},
          {"restore_seconds", s.restore_seconds}, {"checksum_failures", s.checksum_failures},
          {"spill_read_errors", s.spill_read_errors},
          {"spill_write_errors", s.spill_write_errors}, {"kept_dropped", s.kept_dropped},
          {"attach_connections", s.attach_connections}, {"refused_connections", s.refused_connections},
          {"accept_errors", s.accept_errors}, {"denied_requests", s.denied_requests},
          {"chunks_out_of_service", s.chunks_out_of_service},
          {"spill_failures", s.spill_failures}, {"spill_backoff_ms", s.spill_backoff_ms},
          {"spill_unreadable_records", s.spill_unreadable_records},
          {"spill_damaged_sequences", s.spill_damaged_sequences},
          {"kept_evicted", s.kept_evicted}, {"kept_evicted_bytes", s.kept_evicted_bytes}};
}

void PrintStats(const DaemonStats& s) {
  std::printf("daemon    specached %s\n", s.version.empty() ? "(version not reported)" : s.version.c_str());
  const std::string huge = s.pool_huge_bytes < 0 ? "huge pages unknown" : Mib(uint64_t(s.pool_huge_bytes)) + " in huge pages at start";
  std::printf("pool      %s total, %s reserved by sessions, %s used by pages, %s free (chunks of %s, %s, %s)\n",
              Mib(s.pool_bytes).c_str(), Mib(s.reserved_bytes).c_str(), Mib(s.used_bytes).c_str(),
              Mib(s.free_bytes).c_str(), Mib(s.chunk_bytes).c_str(), s.memory_locked ? "locked" : "NOT locked",
              huge.c_str());
  std::printf("objects   %u sessions, %u sequences, %llu pages\n", s.sessions, s.sequences,
              static_cast<unsigned long long>(s.pages));
  std::printf("requests  %llu (%llu errors, %llu refused by the access rules), up %.1f s\n",
              static_cast<unsigned long long>(s.requests), static_cast<unsigned long long>(s.errors),
              static_cast<unsigned long long>(s.denied_requests), s.uptime_ms / 1000.0);
  std::printf("attach    %llu connections, %llu refused at accept, %llu accept errors, %u chunks out of service\n",
              static_cast<unsigned long long>(s.attach_connections),
              static_cast<unsigned long long>(s.refused_connections),
              static_cast<unsigned long long>(s.accept_errors), s.chunks_out_of_service);
  std::printf("kept      %u parked (%s in RAM), %u spilled (%s on disk only, %s in the store)%s; %llu evicted (%s)\n",
              s.parked_sequences, Mib(s.parked_bytes).c_str(), s.spilled_sequences, Mib(s.spilled_bytes).c_str(),
              Mib(s.spill_disk_bytes).c_str(), s.spill_tier ? "" : "; no spill tier",
              static_cast<unsigned long long>(s.kept_evicted), Mib(s.kept_evicted_bytes).c_str());
  if (s.spill_tier) {
    std::printf("spill     %llu spills (%s, %.2f s), %llu restores (%s, %.2f s), %llu checksum failures, %llu read "
                "errors, %llu write errors, %llu kept sequences lost\n",
                static_cast<unsigned long long>(s.spills), Mib(s.spill_bytes_total).c_str(), s.spill_seconds,
                static_cast<unsigned long long>(s.restores), Mib(s.restore_bytes_total).c_str(), s.restore_seconds,
                static_cast<unsigned long long>(s.checksum_failures), static_cast<unsigned long long>(s.spill_read_errors),
                static_cast<unsigned long long>(s.spill_write_errors), static_cast<unsigned long long>(s.kept_dropped));
    std::printf("spill     %llu failed spills%s, %llu unreadable records, %llu damaged sequences (see verify)\n",
                static_cast<unsigned long long>(s.spill_failures),
                s.spill_backoff_ms ? (", paused for " + std::to_string(s.spill_backoff_ms) + " ms").c_str() : "",
                static_cast<unsigned long long>(s.spill_unreadable_records),
                static_cast<unsigned long long>(s.spill_damaged_sequences));
  }
  std::printf("%-16s %14s %14s %14s %14s %9s %10s\n", "tenant", "reserved", "retained", "used", "quota", "sessions",
              "sequences");
  for (const auto& t : s.tenants) {
    std::printf("%-16s %14s %14s %14s %14s %9u %10u\n", t.tenant.c_str(), Mib(t.reserved_bytes).c_str(),
                Mib(t.retained_bytes).c_str(), Mib(t.used_bytes).c_str(), Mib(t.quota_bytes).c_str(), t.sessions,
                t.sequences);
  }
}

// A client-chosen name for the terminal: control bytes and every byte outside ASCII shown as '?'
// (no escape sequences, C1 controls such as U+009B, or bidirectional overrides such as U+202E).
std::string Printable(std::string name) {
  for (char& ch : name) {
    if (static_cast<unsigned char>(ch) < 0x20 || static_cast<unsigned char>(ch) >= 0x7f) ch = '?';
  }
  return name;
}

// Exit status 1 for errors, 4 when the daemon refused the caller (the message names the rule).
int Fail(const specache::Status& s) {
  std::fprintf(stderr, "specachectl: %s\n", s.ToString().c_str());
  if (s.code() == specache::StatusCode::kPermissionDenied) {
    std::fprintf(stderr, "specachectl: refused by the daemon's access rules ([access] and [tenants] in its config)\n");
    return 4;
  }
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"specachectl: inspect a specached", "specachectl"};
  std::string socket = "/run/specache/control.sock";
  int deadline_ms = 2000;
  // spill, restore and verify read or write every page they touch (a verify of a large store takes
  // minutes): their calls wait this long unless --deadline-ms is given.
  constexpr int kStoreCallDeadlineMs = 30 * 60 * 1000;
  bool json = false;
  double interval = 1.0;
  app.add_option("--socket", socket, "daemon control socket")->capture_default_str();
  auto* deadline = app.add_option("--deadline-ms", deadline_ms,
                                  "deadline of each call (spill, restore and verify: 1800000 unless given)")
                       ->check(CLI::Range(1, 24 * 3600 * 1000))
                       ->capture_default_str();
  app.require_subcommand(1);
  app.fallthrough();  // --socket and --deadline-ms also after the subcommand
  auto* stats = app.add_subcommand("stats", "pool, tenants, sessions, sequences, request counts");
  stats->add_flag("--json", json, "one JSON object");
  auto* sessions = app.add_subcommand("sessions", "open sessions");
  sessions->add_flag("--json", json, "JSON array");
  auto* sequences = app.add_subcommand("sequences", "sequences of all sessions, and kept ones");
  sequences->add_flag("--json", json, "JSON array");
  auto* watch = app.add_subcommand("watch", "stats, refreshed");
  watch->add_option("--interval", interval, "seconds between refreshes")
      ->check(CLI::Range(0.1, 3600.0))
      ->capture_default_str();
  uint64_t sequence = 0;
  bool all = false;
  auto* spill = app.add_subcommand("spill", "move kept (parked) sequences from RAM to the spill tier");
  auto* spill_one = spill->add_option("--sequence", sequence, "one sequence");
  auto* spill_all = spill->add_flag("--all", all, "every parked sequence");
  spill_one->excludes(spill_all);
  auto* restore = app.add_subcommand("restore", "bring a spilled sequence back to RAM (checksums verified)");
  restore->add_option("--sequence", sequence, "the sequence")->required();
  auto* evict = app.add_subcommand("evict", "forget a kept sequence (RAM and disk)");
  evict->add_option("--sequence", sequence, "the sequence")->required();
  auto* verify = app.add_subcommand("verify", "check every page in the spill tier");
  verify->add_flag("--json", json, "one JSON object");
  app.set_version_flag("--version", "specachectl " SPECACHE_VERSION);
  if (const int code = specache::ParseCommandLine(app, argc, argv); code >= 0) return code;

  auto client = Client::Connect({socket, std::chrono::milliseconds(deadline_ms), "specachectl"});
  if (!client.ok()) return Fail(client.status());
  if ((spill->parsed() || restore->parsed() || verify->parsed()) && deadline->count() == 0) {
    // Reached within the short deadline above (a daemon that is not there fails fast); the store's
    // call then gets the long one.
    client = Client::Connect({socket, std::chrono::milliseconds(kStoreCallDeadlineMs), "specachectl"});
    if (!client.ok()) return Fail(client.status());
  }
  Client& c = **client;

  if (stats->parsed()) {
    auto s = c.Stats();
    if (!s.ok()) return Fail(s.status());
    if (json) {
      std::cout << StatsJson(*s).dump() << "\n";
    } else {
      PrintStats(*s);
    }
  } else if (sessions->parsed()) {
    auto list = c.ListSessions();
    if (!list.ok()) return Fail(list.status());
    nlohmann::json out = nlohmann::json::array();
    if (!json) std::printf("%8s %-12s %-20s %8s %6s %9s %7s %10s %12s\n", "session", "tenant", "client", "pid", "uid",
                           "attached", "chunks", "sequences", "used");
    for (const auto& s : *list) {
      out.push_back({{"session_id", s.id}, {"tenant", s.tenant}, {"client_name", s.client_name}, {"pid", s.pid},
                     {"uid", s.uid}, {"attached", s.attached}, {"chunks", s.chunks}, {"sequences", s.sequences},
                     {"used_bytes", s.used_bytes}, {"age_ms", s.age_ms}});
      if (!json) {
        std::printf("%8llu %-12s %-20s %8d %6u %9s %7u %10u %12s\n", static_cast<unsigned long long>(s.id),
                    s.tenant.c_str(), Printable(s.client_name).c_str(), s.pid, s.uid, s.attached ? "yes" : "no", s.chunks,
                    s.sequences, Mib(s.used_bytes).c_str());
      }
    }
    if (json) std::cout << out.dump() << "\n";
  } else if (sequences->parsed()) {
    auto list = c.ListSequences();
    if (!list.ok()) return Fail(list.status());
    nlohmann::json out = nlohmann::json::array();
    if (!json) std::printf("%9s %8s %-8s %-12s %28s %6s %12s\n", "sequence", "session", "state", "tenant",
                           "layout (L x H x d, page/cap)", "pages", "bytes");
    for (const auto& s : *list) {
      const auto& l = s.layout;
      out.push_back({{"sequence_id", s.id}, {"session_id", s.session}, {"tenant", s.tenant},
                     {"layout", {{"n_layers", l.n_layers}, {"n_kv_heads", l.n_kv_heads}, {"head_dim", l.head_dim},
                                 {"page_tokens", l.page_tokens}, {"capacity_tokens", l.capacity_tokens},
                                 {"row_format", specache::HostRowFormatNameOrNumber(l.row_format)}}},
                     {"pages_per_layer", s.pages_per_layer}, {"bytes", s.bytes}, {"state", s.state}});
      if (!json) {
        char shape[64];
        const std::string rows = l.row_format == 0 ? "" : " " + specache::HostRowFormatNameOrNumber(l.row_format);  // fp16 unsaid
        std::snprintf(shape, sizeof shape, "%u x %u x %u, %u/%u%s", l.n_layers, l.n_kv_heads, l.head_dim, l.page_tokens,
                      l.capacity_tokens, rows.c_str());
        std::printf("%9llu %8llu %-8s %-12s %28s %6u %12s\n", static_cast<unsigned long long>(s.id),
                    static_cast<unsigned long long>(s.session), s.state.c_str(), s.tenant.c_str(), shape,
                    s.pages_per_layer, Mib(s.bytes).c_str());
      }
    }
    if (json) std::cout << out.dump() << "\n";
  } else if (spill->parsed()) {
    if (!all && spill_one->count() == 0) return Fail(specache::Status::InvalidArgument("spill: give --sequence ID or --all"));
    auto n = all ? c.SpillAll() : c.Spill(sequence);
    if (!n.ok()) return Fail(n.status());
    std::printf("spilled %u sequence%s\n", *n, *n == 1 ? "" : "s");
  } else if (restore->parsed()) {
    if (auto s = c.Restore(sequence); !s.ok()) return Fail(s);
    std::printf("sequence %llu restored\n", static_cast<unsigned long long>(sequence));
  } else if (evict->parsed()) {
    if (auto s = c.Evict(sequence); !s.ok()) return Fail(s);
    std::printf("sequence %llu evicted\n", static_cast<unsigned long long>(sequence));
  } else if (verify->parsed()) {
    auto v = c.VerifySpill();
    if (!v.ok()) return Fail(v.status());
    if (json) {
      std::cout << nlohmann::json{{"sequences", v->sequences}, {"pages_checked", v->pages_checked},
                                  {"pages_bad", v->pages_bad}, {"bad", v->bad}}.dump()
                << "\n";
    } else {
      std::printf("%llu sequences, %llu pages checked, %llu bad\n", static_cast<unsigned long long>(v->sequences),
                  static_cast<unsigned long long>(v->pages_checked), static_cast<unsigned long long>(v->pages_bad));
      for (const auto& b : v->bad) std::printf("  bad: %s\n", b.c_str());
    }
    return v->pages_bad == 0 && v->bad.empty() ? 0 : 3;  // bad also names damaged sequences
  } else if (watch->parsed()) {
    while (true) {
      auto s = c.Stats();
      std::printf("\033[H\033[2J");
      if (s.ok()) {
        PrintStats(*s);
      } else {
        std::printf("specachectl: %s\n", s.status().ToString().c_str());
      }
      std::fflush(stdout);
      std::this_thread::sleep_for(std::chrono::milliseconds(static_cast<int>(interval * 1000)));
    }
  }
  return 0;
}
