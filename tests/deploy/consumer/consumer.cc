// A program outside the tree that uses an installed specache the way an engine does: it asks a
// running specached for its stats, opens a session, and lets a CPU agent store a prompt's K/V in
// the daemon's pages through DaemonSource. Built twice by tests/deploy/install-test.sh, once
// with find_package(specache) and once with pkg-config.
//
//   consumer SOCKET   exit 0 when everything worked, 1 with the failing step on stderr
#include <cstdio>
#include <string>
#include <vector>

#include "specache/agent.h"
#include "specache/client.h"
#include "specache/daemon_source.h"
#include "specache/version.h"

namespace {

int Fail(const char* step, const specache::Status& s) {
  std::fprintf(stderr, "consumer: %s: %s\n", step, s.ToString().c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace specache;
  if (argc != 2) {
    std::fprintf(stderr, "usage: consumer SOCKET\n");
    return 2;
  }
  client::ClientOptions options;
  options.socket = argv[1];
  options.client_name = "install-test consumer";
  auto daemon = client::Client::Connect(options);
  if (!daemon.ok()) return Fail("connect", daemon.status());
  auto stats = (*daemon)->Stats();
  if (!stats.ok()) return Fail("stats", stats.status());
  // The daemon installed with these headers reports the headers' version.
  if (stats->version != SPECACHE_VERSION) {
    std::fprintf(stderr, "consumer: specached reports version '%s', headers say %s\n", stats->version.c_str(),
                 SPECACHE_VERSION);
    return 1;
  }

  auto session = (*daemon)->OpenSession("default", stats->chunk_bytes);
  if (!session.ok()) return Fail("open session", session.status());
  constexpr int kTokens = 8, kHeadDim = 64;
  client::DaemonSource source(session->get(), 64, 256);
  const ModelShape shape{1, 2, 1, kHeadDim};
  auto agent = CreateCpuAgent(shape, KvConfig{}, &source);
  if (!agent.ok()) return Fail("create agent", agent.status());
  const SequenceId id = 1;
  if (Status s = (*agent)->AddSequence(id); !s.ok()) return Fail("add sequence", s);
  std::vector<float> k(kTokens * kHeadDim), v(kTokens * kHeadDim);
  for (size_t i = 0; i < k.size(); ++i) {
    k[i] = static_cast<float>(i % 7) * 0.25f;
    v[i] = static_cast<float>(i % 5) * 0.5f;
  }
  const std::vector<int32_t> offsets{0, kTokens};
  PrefillBatch batch;
  batch.sequences = std::span<const SequenceId>(&id, 1);
  batch.token_offsets = offsets;
  batch.k = k.data();
  batch.v = v.data();  // store only: no q, no out
  if (Status s = (*agent)->PrefillLayer(0, batch); !s.ok()) return Fail("prefill", s);
  auto length = source.Length(id, 0, 0);
  if (!length.ok()) return Fail("length", length.status());
  std::vector<Half> row(2 * kHeadDim);
  const int32_t token = kTokens - 1;
  if (Status s = source.ReadRows(id, 0, 0, &token, 1, row.data()); !s.ok()) return Fail("read back", s);
  if (*length != kTokens || HalfToFloat(row[kHeadDim + 1]) != v[static_cast<size_t>(token) * kHeadDim + 1]) {
    std::fprintf(stderr, "consumer: the daemon's pages do not hold the prompt (length %d)\n", *length);
    return 1;
  }
  std::printf("consumer: specached %s, client %s, agent %s: %d tokens in the daemon's pages\n",
              stats->version.c_str(), kVersion, std::string((*agent)->backend_name()).c_str(), *length);
  return 0;
}
