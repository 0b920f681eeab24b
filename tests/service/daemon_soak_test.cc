// A long soak of specached with its spill tier: 8 clients open sessions, write, keep, claim and
// release sequences in a loop while an operator spills, verifies and reads stats, for
// SPECACHE_SOAK_SECONDS (default 3600). The daemon's anonymous memory (/proc/PID/smaps_rollup)
// is sampled every 10 s, right after a verify (which flushes the spill store's memtable, up to
// 256 MiB of spilled pages that RocksDB holds until a flush); less the bytes parked in RAM at
// that moment (kept sequences, which come and go with the load), it must grow by less than 2%
// over the second half of the run (or by less than 4 MiB: the daemon's own heap is a few MiB,
// the pool is shared memory, not anonymous; a window's median is compared, so one sample taken
// in the middle of a burst does not decide it).
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <random>
#include <sstream>
#include <thread>

#include <gtest/gtest.h>

#include "processes.h"
#include "specache/client.h"
#include "testing/temp_dir.h"

namespace specache {
namespace {

using testing::DaemonProcess;
using testing::TempDir;

const client::PageLayoutSpec kLayout{3, 2, 64, 16, 256};  // 3 layers, 8 KiB pages

// The process's anonymous memory in bytes (0 if it cannot be read).
uint64_t AnonymousBytes(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/smaps_rollup");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("Anonymous:", 0) == 0) return std::strtoull(line.c_str() + 10, nullptr, 10) * 1024;
  }
  return 0;
}

uint8_t Pattern(uint64_t seed, uint32_t layer, uint32_t page, size_t i) {
  return static_cast<uint8_t>(seed * 131 + layer * 31 + page * 7 + i * 13);
}

struct ClientCounts {
  uint64_t rounds = 0, kept = 0, claimed = 0, errors = 0;
};

// One client: each round writes two sequences in a new session, keeps one, and claims (and
// checks) the one it kept the round before.
void ClientLoop(const std::string& socket, int index, const std::atomic<bool>& done, ClientCounts* counts) {
  auto c = client::Client::Connect({socket, std::chrono::milliseconds(5000), "soak-" + std::to_string(index)});
  if (!c.ok()) {
    ++counts->errors;
    return;
  }
  std::mt19937_64 rng(index);
  uint64_t pending = 0, pending_seed = 0;
  while (!done.load()) {
    ++counts->rounds;
    auto session = (*c)->OpenSession("default", 4 << 20);
    if (!session.ok()) {  // the pool is shared by 8 clients whose old sessions are still being reaped
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      continue;
    }
    if (pending != 0) {
      Result<uint32_t> pages = Status::NotFound("not parked yet");
      for (int i = 0; i < 100 && pages.status().code() == StatusCode::kNotFound; ++i) {
        pages = (*session)->Claim(pending, kLayout);
        if (pages.status().code() == StatusCode::kNotFound) std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
      bool intact = pages.ok();
      for (uint32_t l = 0; intact && l < kLayout.n_layers; ++l) {
        for (uint32_t p = 0; intact && p < *pages; ++p) {
          auto data = (*session)->PageData(pending, l, p);
          intact = data.ok() && (*data)[100] == Pattern(pending_seed, l, p, 100);
        }
      }
      if (intact) {
        ++counts->claimed;
        (void)(*session)->Release(pending);
      } else {
        ++counts->errors;
      }
      pending = 0;
    }
    for (int s = 0; s < 2; ++s) {
      auto id = (*session)->CreateSequence(kLayout);
      if (!id.ok()) {
        ++counts->errors;
        continue;
      }
      auto pages = (*session)->Extend(*id, static_cast<uint32_t>(16 + rng() % 200));
      if (!pages.ok()) {
        ++counts->errors;
        continue;
      }
      const uint64_t seed = rng();
      for (uint32_t l = 0; l < kLayout.n_layers; ++l) {
        for (uint32_t p = 0; p < *pages; ++p) {
          auto data = (*session)->PageData(*id, l, p);
          if (data.ok()) (*data)[100] = Pattern(seed, l, p, 100);
        }
      }
      if (s == 0 && (*session)->Keep(*id).ok()) {
        pending = *id, pending_seed = seed;
        ++counts->kept;
      } else {
        (void)(*session)->Release(*id);
      }
    }
  }  // the session closes with the round: the kept sequence is parked
}

TEST(DaemonSoakTest, EightClientsForAnHourKeepAnonymousMemoryFlat) {
  const char* env = std::getenv("SPECACHE_SOAK_SECONDS");
  const int seconds = env ? std::atoi(env) : 3600;
  ASSERT_GE(seconds, 20) << "SPECACHE_SOAK_SECONDS must be at least 20";
  TempDir spill;
  DaemonProcess d;
  ASSERT_TRUE(d.Start("", {"--spill-dir", spill.path, "--park-bytes", "4MiB"}));
  std::atomic<bool> done{false};
  std::vector<ClientCounts> counts(8);
  std::vector<std::thread> clients;
  for (int i = 0; i < 8; ++i) clients.emplace_back(ClientLoop, d.socket, i, std::cref(done), &counts[i]);
  auto admin = client::Client::Connect({d.socket, std::chrono::milliseconds(5000), "soak-admin"});
  ASSERT_TRUE(admin.ok());
  struct Sample {
    double at_s;
    uint64_t anon, parked;
  };
  std::vector<Sample> samples;
  const auto start = std::chrono::steady_clock::now();
  uint64_t verify_bad = 0;
  for (int tick = 0;; ++tick) {
    const double at = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (at >= seconds) break;
    if (tick % 5 == 0) (void)(*admin)->SpillAll();
    if (tick % 10 == 0) {
      auto v = (*admin)->VerifySpill();
      if (v.ok()) verify_bad += v->pages_bad + v->bad.size();
      auto st = (*admin)->Stats();
      samples.push_back({at, AnonymousBytes(d.child->pid), st.ok() ? st->parked_bytes : 0});
    }
    std::this_thread::sleep_for(std::chrono::seconds(1));
  }
  done = true;
  for (auto& t : clients) t.join();
  ClientCounts total;
  for (const auto& c : counts) {
    total.rounds += c.rounds, total.kept += c.kept, total.claimed += c.claimed, total.errors += c.errors;
  }
  std::printf("soak %d s: %llu rounds, %llu kept, %llu claimed intact, %llu errors, %llu bad in verify\n", seconds,
              static_cast<unsigned long long>(total.rounds), static_cast<unsigned long long>(total.kept),
              static_cast<unsigned long long>(total.claimed), static_cast<unsigned long long>(total.errors),
              static_cast<unsigned long long>(verify_bad));
  ASSERT_GE(samples.size(), 2u);
  // The median over a window of samples (fractions of the run), less what was parked.
  auto median = [&](double from, double to) {
    std::vector<double> v;
    for (const Sample& s : samples) {
      if (s.at_s >= from * seconds && s.at_s <= to * seconds) v.push_back(static_cast<double>(s.anon) - s.parked);
    }
    std::sort(v.begin(), v.end());
    return v.empty() ? 0.0 : v[v.size() / 2];
  };
  for (size_t i = 0; i < samples.size(); i += std::max<size_t>(1, samples.size() / 12)) {
    std::printf("  t=%6.0f s  anonymous %8.1f MiB  parked %6.1f MiB\n", samples[i].at_s, samples[i].anon / 1048576.0,
                samples[i].parked / 1048576.0);
  }
  const double early = median(0.05, 0.2), mid = median(0.4, 0.6), end = median(0.8, 1.0);
  const double growth = (end - mid) / mid;
  std::printf("anonymous less parked (medians): %.1f MiB at 5-20%%, %.1f MiB at 40-60%%, %.1f MiB at 80-100%%: %+.2f%% over "
              "the second half\n",
              early / 1048576.0, mid / 1048576.0, end / 1048576.0, 100 * growth);
  EXPECT_EQ(total.errors, 0u);
  EXPECT_EQ(verify_bad, 0u);
  EXPECT_GT(total.claimed, 0u);
  EXPECT_TRUE(growth < 0.02 || end - mid < 4 << 20) << "anonymous memory still grows over the second half";
}

}  // namespace
}  // namespace specache
