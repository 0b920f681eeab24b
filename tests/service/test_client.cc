// A client process for the daemon's integration tests (a separate binary: gRPC and fork() do not
// mix). Modes:
//   write-verify SOCKET SEED TOKENS   session + sequence through DaemonSource, rows written and read
//                                     back; exit 0 when every byte matches
//   hold SOCKET TENANT                session + sequence, prints "ready <session>" and sleeps until killed
//   attach-as UID SOCKET TENANT       setuid(UID) first, then tries to open and attach; prints the status
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <thread>

#include "specache/client.h"
#include "specache/daemon_source.h"

using namespace specache;

namespace {

int Fail(const char* what, const Status& s) {
  std::fprintf(stderr, "test_client: %s: %s\n", what, s.ToString().c_str());
  return 2;
}

int WriteVerify(const std::string& socket, uint32_t seed, int tokens) {
  auto client = client::Client::Connect({socket, std::chrono::milliseconds(3000), "write-verify"});
  if (!client.ok()) return Fail("connect", client.status());
  auto session = (*client)->OpenSession("default", 8 << 20);
  if (!session.ok()) return Fail("open", session.status());
  const SequenceLayout layout{4, 2, 64};
  client::DaemonSource source(session->get(), 16, 4096);
  if (Status s = source.CreateSequence(1, layout); !s.ok()) return Fail("create", s);
  std::mt19937 rng(seed);
  std::vector<Half> rows(static_cast<size_t>(tokens) * 2 * 64);
  std::vector<std::vector<Half>> written(8);
  // Written in uneven pieces per (layer, head), as prefill + decode would.
  for (int l = 0; l < 4; ++l) {
    for (int h = 0; h < 2; ++h) {
      auto& w = written[l * 2 + h];
      w.resize(rows.size());
      for (auto& x : w) x = static_cast<Half>(rng());
      int at = 0;
      while (at < tokens) {
        const int n = std::min(tokens - at, 1 + static_cast<int>(rng() % 37));
        if (Status s = source.AppendRows(1, l, h, at, w.data() + static_cast<size_t>(at) * 128, n); !s.ok()) {
          return Fail("append", s);
        }
        at += n;
      }
    }
  }
  std::vector<int32_t> all(tokens);
  for (int i = 0; i < tokens; ++i) all[i] = tokens - 1 - i;  // read in reverse order
  std::vector<Half> back(rows.size());
  for (int l = 0; l < 4; ++l) {
    for (int h = 0; h < 2; ++h) {
      if (Status s = source.ReadRows(1, l, h, all.data(), tokens, back.data()); !s.ok()) return Fail("read", s);
      const auto& w = written[l * 2 + h];
      for (int i = 0; i < tokens; ++i) {
        if (std::memcmp(back.data() + static_cast<size_t>(i) * 128, w.data() + static_cast<size_t>(all[i]) * 128, 256)) {
          std::fprintf(stderr, "test_client: mismatch at layer %d head %d token %d\n", l, h, all[i]);
          return 3;
        }
      }
    }
  }
  std::printf("ok extend_rpcs=%llu\n", static_cast<unsigned long long>(source.extend_rpcs()));
  return 0;
}

int Hold(const std::string& socket, const std::string& tenant) {
  auto client = client::Client::Connect({socket, std::chrono::milliseconds(3000), "hold"});
  if (!client.ok()) return Fail("connect", client.status());
  auto session = (*client)->OpenSession(tenant, 4 << 20);
  if (!session.ok()) return Fail("open", session.status());
  auto seq = (*session)->CreateSequence({4, 2, 64, 16, 1024});
  if (!seq.ok()) return Fail("create", seq.status());
  if (auto e = (*session)->Extend(*seq, 500); !e.ok()) return Fail("extend", e.status());
  std::printf("ready %llu\n", static_cast<unsigned long long>((*session)->id()));
  std::fflush(stdout);
  while (true) std::this_thread::sleep_for(std::chrono::seconds(1));
}

int AttachAs(uid_t uid, const std::string& socket, const std::string& tenant) {
  if (setgid(uid) != 0 || setuid(uid) != 0) return Fail("setuid", Status::PermissionDenied("cannot switch user"));
  auto client = client::Client::Connect({socket, std::chrono::milliseconds(3000), "attach-as"});
  if (!client.ok()) return Fail("connect", client.status());
  auto session = (*client)->OpenSession(tenant, 4 << 20);
  std::printf("%s\n", session.ok() ? "OK" : session.status().ToString().c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "write-verify" && argc == 5) return WriteVerify(argv[2], std::stoul(argv[3]), std::stoi(argv[4]));
  if (mode == "hold" && argc == 4) return Hold(argv[2], argv[3]);
  if (mode == "attach-as" && argc == 5) return AttachAs(static_cast<uid_t>(std::stoul(argv[2])), argv[3], argv[4]);
  std::fprintf(stderr, "usage: test_client write-verify SOCKET SEED TOKENS | hold SOCKET TENANT | attach-as UID SOCKET TENANT\n");
  return 1;
}
