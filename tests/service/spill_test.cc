// Kept sequences and the spill tier with a real specached: a sequence written by a client and
// kept past its session is parked, spilled, survives a SIGKILL of the daemon, is listed after the
// restart, restored and claimed by a new session of its tenant with every page identical; the
// watermark policy spills least recently parked sequences when parking is small; a page corrupted
// on disk is reported by verify and restore and never served. Failures of the tier: one failed
// spill does not stop the others (SpillAll, a graceful stop); failing spills back off and parking
// never grows past its limit (the keeper is told); with write-through a kept sequence survives a
// SIGKILL; verify on a running daemon reads the disk; a damaged WAL is reported, not erased; a
// keep and close during a claim never keep a half-copied sequence; a stop names and counts the
// parked sequences it loses.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <thread>

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <rocksdb/db.h>

#include "hand_attach.h"
#include "processes.h"
#include "specache/client.h"
#include "specache/v1/control.grpc.pb.h"
#include "testing/temp_dir.h"

namespace specache {
namespace {

using testing::DaemonProcess;
using testing::RunCommand;
using testing::TempDir;

const client::PageLayoutSpec kLayout{3, 2, 64, 16, 256};  // 3 layers, 8 KiB pages

std::unique_ptr<client::Client> Connect(const DaemonProcess& d) {
  auto c = client::Client::Connect({d.socket, std::chrono::milliseconds(5000), "spill-test"});
  EXPECT_TRUE(c.ok()) << c.status().ToString();
  return c.ok() ? std::move(c).value() : nullptr;
}

// The pattern every page of a sequence holds (different per sequence, layer, page and byte).
uint8_t Pattern(uint64_t seed, uint32_t layer, uint32_t page, size_t i) {
  return static_cast<uint8_t>((seed * 131 + layer * 31 + page * 7 + i * 13) ^ (i >> 8));
}

// Writes the sequence's pattern into its first `pages` pages at every layer.
Status FillPattern(client::Session* session, uint64_t id, uint32_t pages, uint64_t seed,
                   const client::PageLayoutSpec& layout = kLayout) {
  for (uint32_t l = 0; l < layout.n_layers; ++l) {
    for (uint32_t p = 0; p < pages; ++p) {
      SPECACHE_ASSIGN_OR_RETURN(uint8_t * page, session->PageData(id, l, p));
      for (size_t i = 0; i < layout.page_bytes(); ++i) page[i] = Pattern(seed, l, p, i);
    }
  }
  return Status::Ok();
}

// Creates a sequence of `tokens` tokens filled with its pattern, keeps it, closes the session.
Result<uint64_t> WriteAndKeep(client::Client* c, uint64_t seed, uint32_t tokens,
                              const client::PageLayoutSpec& layout = kLayout) {
  SPECACHE_ASSIGN_OR_RETURN(auto session, c->OpenSession("default", 8 << 20));
  SPECACHE_ASSIGN_OR_RETURN(uint64_t id, session->CreateSequence(layout));
  SPECACHE_ASSIGN_OR_RETURN(uint32_t pages, session->Extend(id, tokens));
  SPECACHE_RETURN_IF_ERROR(FillPattern(session.get(), id, pages, seed, layout));
  SPECACHE_RETURN_IF_ERROR(session->Keep(id));
  return id;  // the session closes here: the sequence is parked
}

// Claims a kept sequence into a new session and checks every page; returns the pages checked.
Result<uint32_t> ClaimAndCheck(client::Client* c, uint64_t id, uint64_t seed,
                               const client::PageLayoutSpec& layout = kLayout, uint64_t session_bytes = 8 << 20) {
  SPECACHE_ASSIGN_OR_RETURN(auto session, c->OpenSession("default", session_bytes));
  SPECACHE_ASSIGN_OR_RETURN(uint32_t pages, session->Claim(id, layout));
  for (uint32_t l = 0; l < layout.n_layers; ++l) {
    for (uint32_t p = 0; p < pages; ++p) {
      SPECACHE_ASSIGN_OR_RETURN(uint8_t * page, session->PageData(id, l, p));
      for (size_t i = 0; i < layout.page_bytes(); ++i) {
        if (page[i] != Pattern(seed, l, p, i)) {
          return Status::DataLoss("sequence " + std::to_string(id) + " layer " + std::to_string(l) + " page " +
                                  std::to_string(p) + " byte " + std::to_string(i) + " differs");
        }
      }
    }
  }
  return pages * layout.n_layers;
}

// Waits until the daemon has parked `n` sequences (parking happens when the session is reaped).
bool WaitForKept(client::Client* c, uint32_t n) {
  for (int i = 0; i < 300; ++i) {
    auto s = c->Stats();
    if (s.ok() && s->parked_sequences + s->spilled_sequences >= n) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return false;
}

TEST(SpillTest, KeptSequencesSurviveSpillDaemonKillRestartAndClaim) {
  TempDir spill;
  uint64_t a = 0, b = 0;
  {
    DaemonProcess d;
    ASSERT_TRUE(d.Start("", {"--spill-dir", spill.path}));
    auto c = Connect(d);
    ASSERT_TRUE(c);
    auto ka = WriteAndKeep(c.get(), 1, 100);
    auto kb = WriteAndKeep(c.get(), 2, 40);
    ASSERT_TRUE(ka.ok() && kb.ok()) << ka.status().ToString() << " " << kb.status().ToString();
    a = *ka, b = *kb;
    ASSERT_TRUE(WaitForKept(c.get(), 2));
    auto stats = c->Stats();
    ASSERT_TRUE(stats.ok());
    EXPECT_EQ(stats->parked_sequences, 2u);
    EXPECT_TRUE(stats->spill_tier);
    EXPECT_EQ(stats->spilled_bytes, 0u);
    auto spilled = c->SpillAll();
    ASSERT_TRUE(spilled.ok()) << spilled.status().ToString();
    EXPECT_EQ(*spilled, 2u);
    stats = c->Stats();
    EXPECT_EQ(stats->parked_bytes, 0u);
    EXPECT_EQ(stats->spilled_bytes, 3ull * (7 + 3) * kLayout.page_bytes());  // 100 tokens: 7 pages, 40: 3
    auto list = c->ListSequences();
    ASSERT_TRUE(list.ok());
    ASSERT_EQ(list->size(), 2u);
    EXPECT_EQ((*list)[0].state, "spilled");
    EXPECT_EQ((*list)[0].session, 0u);
    d.child->Kill(SIGKILL);
    d.child->Wait(5000);
  }
  DaemonProcess d;  // a new daemon over the same spill directory
  ASSERT_TRUE(d.Start("", {"--spill-dir", spill.path}));
  auto c = Connect(d);
  ASSERT_TRUE(c);
  auto list = c->ListSequences();
  ASSERT_TRUE(list.ok());
  ASSERT_EQ(list->size(), 2u) << "the spilled sequences are listed after the restart";
  auto v = c->VerifySpill();
  ASSERT_TRUE(v.ok());
  EXPECT_EQ(v->pages_checked, 3u * (7 + 3));
  EXPECT_EQ(v->pages_bad, 0u);
  ASSERT_TRUE(c->Restore(a).ok());  // disk -> RAM, then claimed from RAM
  EXPECT_EQ(c->Stats()->parked_sequences, 1u);
  auto pages_a = ClaimAndCheck(c.get(), a, 1);
  ASSERT_TRUE(pages_a.ok()) << pages_a.status().ToString();
  EXPECT_EQ(*pages_a, 3u * 7);
  auto pages_b = ClaimAndCheck(c.get(), b, 2);  // straight from disk
  ASSERT_TRUE(pages_b.ok()) << pages_b.status().ToString();
  EXPECT_EQ(*pages_b, 3u * 3);
  // A new sequence never reuses a kept id.
  auto session = c->OpenSession("default", 4 << 20);
  ASSERT_TRUE(session.ok());
  auto fresh = (*session)->CreateSequence(kLayout);
  ASSERT_TRUE(fresh.ok());
  EXPECT_GT(*fresh, std::max(a, b));
  // A wrong layout or an unknown id is refused.
  EXPECT_EQ((*session)->Claim(a, kLayout).status().code(), StatusCode::kNotFound);
}

TEST(SpillTest, WatermarksSpillTheLeastRecentlyParkedWhenParkingIsSmall) {
  TempDir spill;
  DaemonProcess d;
  // 10 pages x 3 layers x 8 KiB = 240 KiB per sequence; parking holds 1 MiB: high 0.9, low 0.5.
  // The fourth pushes parking to 960 KiB (over 943): the first two go to disk (down to 480).
  ASSERT_TRUE(d.Start("[spill]\nhigh_watermark = 0.9\nlow_watermark = 0.5\n",
                      {"--spill-dir", spill.path, "--park-bytes", "1MiB"}));
  auto c = Connect(d);
  ASSERT_TRUE(c);
  std::vector<uint64_t> ids;
  for (uint64_t seed = 1; seed <= 5; ++seed) {
    auto id = WriteAndKeep(c.get(), seed, 160);
    ASSERT_TRUE(id.ok()) << id.status().ToString();
    ids.push_back(*id);
    ASSERT_TRUE(WaitForKept(c.get(), static_cast<uint32_t>(seed)));
  }
  auto stats = c->Stats();
  ASSERT_TRUE(stats.ok());
  EXPECT_LE(stats->parked_bytes, (1u << 20) * 9 / 10) << "parked bytes stay under the high watermark";
  EXPECT_EQ(stats->spilled_sequences, 2u);
  EXPECT_EQ(stats->parked_sequences, 3u);
  auto list = c->ListSequences();
  ASSERT_TRUE(list.ok());
  for (const auto& s : *list) {
    if (s.id == ids.back()) {
      EXPECT_EQ(s.state, "parked") << "the most recent stays in RAM";
    }
    if (s.id == ids.front()) {
      EXPECT_EQ(s.state, "spilled") << "the least recent went first";
    }
  }
  for (size_t i = 0; i < ids.size(); ++i) {  // every one comes back intact, parked or spilled
    auto pages = ClaimAndCheck(c.get(), ids[i], i + 1);
    ASSERT_TRUE(pages.ok()) << pages.status().ToString();
  }
}

TEST(SpillTest, ACorruptedPageOnDiskIsReportedAndNeverServed) {
  TempDir spill;
  uint64_t id = 0;
  {
    DaemonProcess d;
    ASSERT_TRUE(d.Start("", {"--spill-dir", spill.path}));
    auto c = Connect(d);
    ASSERT_TRUE(c);
    auto kept = WriteAndKeep(c.get(), 9, 64);
    ASSERT_TRUE(kept.ok());
    id = *kept;
    ASSERT_TRUE(WaitForKept(c.get(), 1));
    ASSERT_TRUE(c->Spill(id).ok());
    d.child->Kill(SIGTERM);
    d.child->Wait(5000);
  }
  {  // flip a byte of one stored page
    rocksdb::DB* db = nullptr;
    ASSERT_TRUE(rocksdb::DB::Open(rocksdb::Options(), spill.path, &db).ok());
    std::unique_ptr<rocksdb::DB> owned(db);
    std::unique_ptr<rocksdb::Iterator> it(db->NewIterator(rocksdb::ReadOptions()));
    it->Seek("p");
    ASSERT_TRUE(it->Valid() && it->key().starts_with("p"));
    const std::string key = it->key().ToString();
    std::string value = it->value().ToString();
    it.reset();
    value[value.size() / 2] ^= 1;
    ASSERT_TRUE(db->Put(rocksdb::WriteOptions(), key, value).ok());
    ASSERT_TRUE(db->Close().ok());
  }
  DaemonProcess d;
  ASSERT_TRUE(d.Start("", {"--spill-dir", spill.path}));
  auto c = Connect(d);
  ASSERT_TRUE(c);
  auto v = c->VerifySpill();
  ASSERT_TRUE(v.ok());
  EXPECT_EQ(v->pages_bad, 1u);
  ASSERT_EQ(v->bad.size(), 1u);
  const Status restored = c->Restore(id);
  EXPECT_EQ(restored.code(), StatusCode::kDataLoss);
  EXPECT_NE(restored.message().find("layer 0/page 0"), std::string::npos) << restored.ToString();
  auto session = c->OpenSession("default", 4 << 20);
  ASSERT_TRUE(session.ok());
  EXPECT_EQ((*session)->Claim(id, kLayout).status().code(), StatusCode::kDataLoss) << "never served as data";
  EXPECT_GE(c->Stats()->checksum_failures, 2u);
}

// A daemon stopped (SIGTERM, or SIGQUIT) while a client still holds its session: the sequence the
// client kept is parked and spilled on the way down, and the next daemon lists and serves it
// intact. SIGHUP, SIGUSR1 and SIGUSR2 on the way are logged and ignored (by default each would
// have ended the process at once, losing what was parked in RAM only).
TEST(SpillTest, AGracefulStopKeepsWhatLiveClientsKept) {
  for (const int stop : {SIGTERM, SIGQUIT}) {
    SCOPED_TRACE(strsignal(stop));
    TempDir spill;
    uint64_t id = 0;
    {
      DaemonProcess d;
      ASSERT_TRUE(d.Start("", {"--spill-dir", spill.path}));
      auto c = Connect(d);
      ASSERT_TRUE(c);
      auto session = c->OpenSession("default", 8 << 20);
      ASSERT_TRUE(session.ok());
      auto created = (*session)->CreateSequence(kLayout);
      ASSERT_TRUE(created.ok());
      id = *created;
      auto pages = (*session)->Extend(id, 70);
      ASSERT_TRUE(pages.ok());
      ASSERT_TRUE(FillPattern(session->get(), id, *pages, 4).ok());
      ASSERT_TRUE((*session)->Keep(id).ok());
      for (const int ignored : {SIGHUP, SIGUSR1, SIGUSR2}) d.child->Kill(ignored);
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      ASSERT_EQ(d.child->Wait(0), -1) << "the daemon ended on a signal it should ignore";
      ASSERT_TRUE(c->Stats().ok());
      d.child->Kill(stop);  // the session is still open
      EXPECT_EQ(d.child->Wait(10000), 0);
    }
    DaemonProcess d;
    ASSERT_TRUE(d.Start("", {"--spill-dir", spill.path}));
    auto c = Connect(d);
    ASSERT_TRUE(c);
    auto list = c->ListSequences();
    ASSERT_TRUE(list.ok());
    ASSERT_EQ(list->size(), 1u);
    EXPECT_EQ((*list)[0].state, "spilled");
    auto checked = ClaimAndCheck(c.get(), id, 4);
    ASSERT_TRUE(checked.ok()) << checked.status().ToString();
    EXPECT_EQ(*checked, 3u * 5);
  }
}

// An operator's evict forgets a kept sequence, parked or spilled, for good: counted with its bytes
// (and logged with its tenant and the caller), never claimable again.
TEST(SpillTest, AnEvictedSequenceIsCountedAndGone) {
  TempDir spill;
  DaemonProcess d;
  ASSERT_TRUE(d.Start("", {"--spill-dir", spill.path}));
  auto c = Connect(d);
  ASSERT_TRUE(c);
  auto parked = WriteAndKeep(c.get(), 3, 70);
  ASSERT_TRUE(parked.ok());
  auto spilled = WriteAndKeep(c.get(), 4, 70);
  ASSERT_TRUE(spilled.ok());
  ASSERT_TRUE(WaitForKept(c.get(), 2));
  ASSERT_TRUE(c->Spill(*spilled).ok());
  auto before = c->Stats();
  ASSERT_TRUE(before.ok());
  const uint64_t kept_bytes = before->parked_bytes + before->spilled_bytes;
  ASSERT_GT(kept_bytes, 0u);
  EXPECT_EQ(before->kept_evicted, 0u);
  ASSERT_TRUE(c->Evict(*parked).ok());
  ASSERT_TRUE(c->Evict(*spilled).ok());
  auto after = c->Stats();
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(after->kept_evicted, 2u);
  EXPECT_EQ(after->kept_evicted_bytes, kept_bytes);
  EXPECT_EQ(after->parked_sequences + after->spilled_sequences, 0u);
  EXPECT_EQ(c->Evict(*parked).code(), StatusCode::kNotFound);
  auto session = c->OpenSession("default", 4 << 20);
  ASSERT_TRUE(session.ok());
  EXPECT_EQ((*session)->Claim(*spilled, kLayout).status().code(), StatusCode::kNotFound);
}

// A spill the tier cannot take (over its max_bytes) fails with a clear error and leaves the
// sequence parked in RAM, intact and claimable.
TEST(SpillTest, ASpillThatDoesNotFitKeepsTheRamCopy) {
  TempDir spill;
  DaemonProcess d;
  ASSERT_TRUE(d.Start("[spill]\nmax_bytes = \"64KiB\"\n", {"--spill-dir", spill.path}));
  auto c = Connect(d);
  ASSERT_TRUE(c);
  auto id = WriteAndKeep(c.get(), 5, 100);  // 7 pages x 3 layers x 8 KiB = 168 KiB
  ASSERT_TRUE(id.ok());
  ASSERT_TRUE(WaitForKept(c.get(), 1));
  auto spilled = c->Spill(*id);
  EXPECT_EQ(spilled.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(spilled.status().message().find("spill tier full"), std::string::npos) << spilled.status().ToString();
  auto stats = c->Stats();
  EXPECT_EQ(stats->parked_sequences, 1u);
  EXPECT_EQ(stats->spill_disk_bytes, 0u);
  auto pages = ClaimAndCheck(c.get(), *id, 5);
  ASSERT_TRUE(pages.ok()) << pages.status().ToString();
}

// capacity_tokens need not be a multiple of page_tokens: a sequence whose last page is partial
// is claimed whole, from RAM and from disk. A claim with another layout is refused before anything
// is restored: the spilled sequence stays on disk, and the right layout still claims it.
TEST(SpillTest, AClaimTakesAPartialLastPageAndRefusesAnotherLayoutFirst) {
  TempDir spill;
  DaemonProcess d;
  ASSERT_TRUE(d.Start("", {"--spill-dir", spill.path}));
  auto c = Connect(d);
  ASSERT_TRUE(c);
  const client::PageLayoutSpec partial{3, 2, 64, 64, 100};  // 100 tokens: 2 pages of 64
  auto parked = WriteAndKeep(c.get(), 7, 100, partial);
  auto spilled = WriteAndKeep(c.get(), 8, 70, partial);
  ASSERT_TRUE(parked.ok() && spilled.ok()) << parked.status().ToString() << " " << spilled.status().ToString();
  ASSERT_TRUE(WaitForKept(c.get(), 2));
  ASSERT_TRUE(c->Spill(*spilled).ok());
  const uint64_t spilled_bytes = c->Stats()->spilled_bytes;
  EXPECT_EQ(spilled_bytes, 3ull * 2 * partial.page_bytes());

  auto session = c->OpenSession("default", 8 << 20);
  ASSERT_TRUE(session.ok());
  const client::PageLayoutSpec other{3, 2, 64, 64, 128};
  auto refused = (*session)->Claim(*spilled, other);
  EXPECT_EQ(refused.status().code(), StatusCode::kFailedPrecondition) << refused.status().ToString();
  auto stats = c->Stats();
  EXPECT_EQ(stats->spilled_bytes, spilled_bytes) << "a refused claim restores nothing";
  EXPECT_EQ(stats->parked_sequences, 1u);
  EXPECT_FALSE((*session)->PageData(*spilled, 0, 0).ok()) << "a refused claim creates no sequence";

  auto from_ram = ClaimAndCheck(c.get(), *parked, 7, partial);
  ASSERT_TRUE(from_ram.ok()) << from_ram.status().ToString();
  EXPECT_EQ(*from_ram, 3u * 2);
  auto from_disk = ClaimAndCheck(c.get(), *spilled, 8, partial);
  ASSERT_TRUE(from_disk.ok()) << from_disk.status().ToString();
  EXPECT_EQ(*from_disk, 3u * 2);
}

// A sequence's row format is part of its layout: int8 rows (row_format 1) take their own page size
// (2 x head_dim + 16 bytes a row), and a kept sequence of int8 rows is claimed only as int8 rows,
// from RAM and from disk; a claim as fp16 rows of the same dimensions is refused first.
TEST(SpillTest, ASequenceOfInt8RowsIsClaimedOnlyWithItsRowFormat) {
  TempDir spill;
  DaemonProcess d;
  ASSERT_TRUE(d.Start("", {"--spill-dir", spill.path}));
  auto c = Connect(d);
  ASSERT_TRUE(c);
  client::PageLayoutSpec int8_rows = kLayout;
  int8_rows.row_format = 1;
  ASSERT_EQ(int8_rows.page_bytes(), 2u * 16 * (2 * 64 + 16));
  auto parked = WriteAndKeep(c.get(), 3, 40, int8_rows);
  auto spilled = WriteAndKeep(c.get(), 4, 40, int8_rows);
  ASSERT_TRUE(parked.ok() && spilled.ok()) << parked.status().ToString() << " " << spilled.status().ToString();
  ASSERT_TRUE(WaitForKept(c.get(), 2));
  ASSERT_TRUE(c->Spill(*spilled).ok());
  auto listed = c->ListSequences();
  ASSERT_TRUE(listed.ok());
  for (const auto& s : *listed) EXPECT_EQ(s.layout.row_format, 1u) << s.id;

  auto session = c->OpenSession("default", 8 << 20);
  ASSERT_TRUE(session.ok());
  for (uint64_t id : {*parked, *spilled}) {
    auto refused = (*session)->Claim(id, kLayout);  // the same dimensions, fp16 rows
    EXPECT_EQ(refused.status().code(), StatusCode::kFailedPrecondition) << refused.status().ToString();
  }
  auto from_ram = ClaimAndCheck(c.get(), *parked, 3, int8_rows);
  ASSERT_TRUE(from_ram.ok()) << from_ram.status().ToString();
  EXPECT_EQ(*from_ram, 3u * 3);
  auto from_disk = ClaimAndCheck(c.get(), *spilled, 4, int8_rows);
  ASSERT_TRUE(from_disk.ok()) << from_disk.status().ToString();
  EXPECT_EQ(*from_disk, 3u * 3);
  // A format the daemon does not know is refused at creation.
  client::PageLayoutSpec unknown = kLayout;
  unknown.row_format = 2;
  EXPECT_EQ((*session)->CreateSequence(unknown).status().code(), StatusCode::kInvalidArgument);
}

// A tenant keeps at most [limits] kept_sequences_per_tenant sequences, those marked to keep by its
// live sessions included; claiming one makes room again. Another tenant's count is its own.
TEST(SpillTest, ATenantKeepsAtMostItsLimitOfSequences) {
  DaemonProcess d;
  ASSERT_TRUE(d.Start("[limits]\nkept_sequences_per_tenant = 3\n[tenants.default]\n[tenants.other]\n"));
  auto c = Connect(d);
  ASSERT_TRUE(c);
  auto first = WriteAndKeep(c.get(), 1, 20);
  auto second = WriteAndKeep(c.get(), 2, 20);
  ASSERT_TRUE(first.ok() && second.ok());
  ASSERT_TRUE(WaitForKept(c.get(), 2));
  auto session = c->OpenSession("default", 8 << 20);
  ASSERT_TRUE(session.ok());
  auto third = (*session)->CreateSequence(kLayout);
  auto fourth = (*session)->CreateSequence(kLayout);
  ASSERT_TRUE(third.ok() && fourth.ok());
  ASSERT_TRUE((*session)->Keep(*third).ok()) << "2 kept + 1 marked: the limit";
  EXPECT_TRUE((*session)->Keep(*third).ok()) << "marking it again counts it once";
  const Status refused = (*session)->Keep(*fourth);
  EXPECT_EQ(refused.code(), StatusCode::kResourceExhausted) << refused.ToString();
  EXPECT_NE(refused.message().find("kept_sequences_per_tenant"), std::string::npos) << refused.ToString();
  // Another tenant is not held to this one's count.
  auto other = c->OpenSession("other", 8 << 20);
  ASSERT_TRUE(other.ok()) << other.status().ToString();
  auto theirs = (*other)->CreateSequence(kLayout);
  ASSERT_TRUE(theirs.ok());
  EXPECT_TRUE((*other)->Keep(*theirs).ok());
  // A claim makes room.
  auto claimed = ClaimAndCheck(c.get(), *first, 1);
  ASSERT_TRUE(claimed.ok()) << claimed.status().ToString();
  EXPECT_TRUE((*session)->Keep(*fourth).ok());
}

// Clients keep writing, keeping and claiming sequences while an operator spills everything in a
// loop: every claimed sequence is intact, and nothing a client is using is ever spilled.
TEST(SpillTest, ConcurrentClientsWhileSpilling) {
  TempDir spill;
  DaemonProcess d;
  ASSERT_TRUE(d.Start("", {"--spill-dir", spill.path}));
  std::atomic<bool> done{false};
  std::atomic<int> spill_calls{0};
  std::thread spiller([&] {
    auto c = Connect(d);
    while (!done.load()) {
      if (c && c->SpillAll().ok()) ++spill_calls;
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  });
  std::vector<std::thread> clients;
  std::atomic<int> failures{0}, claimed{0};
  for (int t = 0; t < 4; ++t) {
    clients.emplace_back([&, t] {
      auto c = Connect(d);
      if (!c) return ++failures, void();
      for (int round = 0; round < 6; ++round) {
        const uint64_t seed = 100 * t + round;
        auto id = WriteAndKeep(c.get(), seed, 50 + 20 * round);
        if (!id.ok()) {
          ADD_FAILURE() << id.status().ToString();
          ++failures;
          continue;
        }
        Result<uint32_t> pages = Status::NotFound("not parked yet");
        for (int i = 0; i < 300 && !pages.ok(); ++i) {  // parking happens when the session is reaped
          pages = ClaimAndCheck(c.get(), *id, seed);
          if (pages.status().code() != StatusCode::kNotFound) break;
          std::this_thread::sleep_for(std::chrono::milliseconds(10));
        }
        if (pages.ok()) {
          ++claimed;
        } else {
          ADD_FAILURE() << pages.status().ToString();
          ++failures;
        }
      }
    });
  }
  for (auto& th : clients) th.join();
  done = true;
  spiller.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(claimed.load(), 24);
  EXPECT_GT(spill_calls.load(), 0);
  auto c = Connect(d);
  auto stats = c->Stats();
  ASSERT_TRUE(stats.ok());
  EXPECT_GT(stats->spills, 0u) << "some sequences were on disk when claimed";
  EXPECT_EQ(stats->parked_sequences + stats->spilled_sequences, 0u);
  EXPECT_EQ(stats->checksum_failures, 0u);
}

// Flips one bit of the first copy of `needle` in a file of `dir` ending in `extension`, in place.
bool FlipBytesOf(const std::string& dir, const std::string& extension, const std::string& needle, size_t skip) {
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    if (e.path().extension() != extension) continue;
    std::ifstream in(e.path(), std::ios::binary);
    std::stringstream ss;
    ss << in.rdbuf();
    const size_t at = ss.str().find(needle);
    if (at == std::string::npos) continue;
    const int fd = open(e.path().c_str(), O_RDWR);
    if (fd < 0) return false;
    char c = 0;
    const off_t where = static_cast<off_t>(at + skip);
    const bool ok = pread(fd, &c, 1, where) == 1 && (c ^= 0x10, pwrite(fd, &c, 1, where) == 1);
    close(fd);
    return ok;
  }
  return false;
}

// The first bytes of page `page` of layer `layer` of the pattern with `seed` (512: fewer can
// also be found inside another page of the same pattern).
std::string PatternBytes(uint64_t seed, uint32_t layer, uint32_t page, size_t n = 512) {
  std::string out(n, '\0');
  for (size_t i = 0; i < n; ++i) out[i] = static_cast<char>(Pattern(seed, layer, page, i));
  return out;
}

bool Mentions(const std::vector<std::string>& lines, const std::string& what) {
  for (const std::string& l : lines) {
    if (l.find(what) != std::string::npos) return true;
  }
  return false;
}

// One sequence the tier cannot take (over its max_bytes) among others: SpillAll used to stop at
// it, and a graceful stop then lost every parked sequence after it.
TEST(SpillTest, OneFailedSpillDoesNotStopSpillAllOrAGracefulStop) {
  TempDir spill;
  std::vector<uint64_t> ids;
  {
    DaemonProcess d;  // 3 layers x 8 KiB pages: 40 tokens = 72 KiB, 160 tokens = 240 KiB
    ASSERT_TRUE(d.Start("[spill]\nmax_bytes = \"220KiB\"\n", {"--spill-dir", spill.path}));
    auto c = Connect(d);
    ASSERT_TRUE(c);
    for (auto [seed, tokens] : {std::pair{1, 40}, {2, 160}, {3, 40}}) {
      auto id = WriteAndKeep(c.get(), seed, tokens);
      ASSERT_TRUE(id.ok()) << id.status().ToString();
      ids.push_back(*id);
      ASSERT_TRUE(WaitForKept(c.get(), static_cast<uint32_t>(ids.size())));
    }
    auto spilled = c->SpillAll();
    ASSERT_FALSE(spilled.ok());
    EXPECT_EQ(spilled.status().code(), StatusCode::kResourceExhausted);
    EXPECT_NE(spilled.status().message().find("spilled 2; 1 could not be spilled: " + std::to_string(ids[1])),
              std::string::npos)
        << spilled.status().ToString();
    auto stats = c->Stats();
    ASSERT_TRUE(stats.ok());
    EXPECT_EQ(stats->spilled_sequences, 2u);
    EXPECT_EQ(stats->parked_sequences, 1u);
    auto fourth = WriteAndKeep(c.get(), 4, 40);  // parked only; the stop must spill it past the big one
    ASSERT_TRUE(fourth.ok());
    ids.push_back(*fourth);
    ASSERT_TRUE(WaitForKept(c.get(), 4));
    d.child->Kill(SIGTERM);
    EXPECT_EQ(d.child->Wait(10000), 0);
  }
  DaemonProcess d;
  ASSERT_TRUE(d.Start("", {"--spill-dir", spill.path}));
  auto c = Connect(d);
  ASSERT_TRUE(c);
  auto list = c->ListSequences();
  ASSERT_TRUE(list.ok());
  std::vector<uint64_t> listed;
  for (const auto& s : *list) listed.push_back(s.id);
  EXPECT_EQ(listed, (std::vector<uint64_t>{ids[0], ids[2], ids[3]})) << "all but the one that did not fit";
  auto checked = ClaimAndCheck(c.get(), ids[3], 4);
  ASSERT_TRUE(checked.ok()) << checked.status().ToString();
}

// A stop spills what is parked; what it cannot spill dies with the process. Without a spill tier,
// every parked sequence used to go without a log line or a count. Now each is named and counted.
TEST(SpillTest, AStopNamesAndCountsTheParkedSequencesItLoses) {
  DaemonProcess d;
  d.capture_log = true;
  ASSERT_TRUE(d.Start());  // no spill tier: parking only
  auto c = Connect(d);
  ASSERT_TRUE(c);
  auto id = WriteAndKeep(c.get(), 5, 40);
  ASSERT_TRUE(id.ok()) << id.status().ToString();
  ASSERT_TRUE(WaitForKept(c.get(), 1));
  d.child->Kill(SIGTERM);
  EXPECT_EQ(d.child->Wait(10000), 0);
  const std::string log = d.Log();
  EXPECT_NE(log.find("sequence " + std::to_string(*id) + " of tenant default (73728 bytes) was parked in RAM only: "
                     "lost with the process"),
            std::string::npos)
      << log;
  EXPECT_NE(log.find("1 parked sequences lost with the process (1 kept sequences lost in all)"), std::string::npos)
      << log;
}

// Every spill fails (the tier's limit is below any sequence): spills used to be retried every
// 50 ms and parking grew past park_bytes. Now failed spills back off, parked RAM stays within
// park_bytes, and the client that asks to keep one more is told why it cannot.
TEST(SpillTest, FailingSpillsBackOffAndParkingNeverExceedsItsLimit) {
  TempDir spill;
  DaemonProcess d;
  // 240 KiB per sequence; parking holds 1 MiB (high 0.9 = 943 KiB, low 0.5).
  ASSERT_TRUE(d.Start("[spill]\nmax_bytes = \"16KiB\"\nhigh_watermark = 0.9\nlow_watermark = 0.5\n",
                      {"--spill-dir", spill.path, "--park-bytes", "1MiB"}));
  auto c = Connect(d);
  ASSERT_TRUE(c);
  for (uint64_t seed = 1; seed <= 4; ++seed) {  // 960 KiB: over the high watermark, the spill fails
    auto id = WriteAndKeep(c.get(), seed, 160);
    ASSERT_TRUE(id.ok()) << id.status().ToString();
    ASSERT_TRUE(WaitForKept(c.get(), static_cast<uint32_t>(seed)));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));  // 30 watermark checks
  auto stats = c->Stats();
  ASSERT_TRUE(stats.ok());
  EXPECT_GE(stats->spill_failures, 1u);
  EXPECT_LE(stats->spill_failures, 8u) << "backing off, not retrying every 50 ms";
  EXPECT_LE(stats->spill_backoff_ms, 30000u);
  // A fifth does not fit: the keeper hears it at Keep.
  auto session = c->OpenSession("default", 8 << 20);
  ASSERT_TRUE(session.ok());
  auto id = (*session)->CreateSequence(kLayout);
  ASSERT_TRUE(id.ok());
  ASSERT_TRUE((*session)->Extend(*id, 160).ok());
  const Status kept = (*session)->Keep(*id);
  EXPECT_EQ(kept.code(), StatusCode::kResourceExhausted) << kept.ToString();
  EXPECT_NE(kept.message().find("spill tier is failing"), std::string::npos) << kept.ToString();
  session->reset();
  stats = c->Stats();
  ASSERT_TRUE(stats.ok());
  EXPECT_LE(stats->parked_bytes, 1u << 20);
  EXPECT_EQ(stats->parked_sequences, 4u);
}

// write_through: a kept sequence is on disk as soon as it is parked, so a SIGKILL of the daemon
// does not take it (without it, a sequence parked only in RAM vanished without a trace).
TEST(SpillTest, WriteThroughKeptSequencesSurviveSigkill) {
  TempDir spill;
  uint64_t id = 0;
  {
    DaemonProcess d;
    ASSERT_TRUE(d.Start("[spill]\nwrite_through = true\n", {"--spill-dir", spill.path}));
    auto c = Connect(d);
    ASSERT_TRUE(c);
    auto kept = WriteAndKeep(c.get(), 6, 100);
    ASSERT_TRUE(kept.ok());
    id = *kept;
    ASSERT_TRUE(WaitForKept(c.get(), 1));
    auto stats = c->Stats();
    EXPECT_EQ(stats->parked_sequences, 1u) << "still parked in RAM";
    EXPECT_EQ(stats->spill_disk_bytes, 3ull * 7 * kLayout.page_bytes()) << "and on disk";
    d.child->Kill(SIGKILL);
    d.child->Wait(5000);
  }
  DaemonProcess d;
  ASSERT_TRUE(d.Start("", {"--spill-dir", spill.path}));
  auto c = Connect(d);
  ASSERT_TRUE(c);
  auto checked = ClaimAndCheck(c.get(), id, 6);
  ASSERT_TRUE(checked.ok()) << checked.status().ToString();
  EXPECT_EQ(*checked, 3u * 7);
}

// verify on a running daemon used to read RocksDB's block cache (and the memtable): a page
// corrupted on disk was missed until a restart.
TEST(SpillTest, VerifyOnARunningDaemonReadsTheDisk) {
  TempDir spill;
  DaemonProcess d;
  ASSERT_TRUE(d.Start("", {"--spill-dir", spill.path}));
  auto c = Connect(d);
  ASSERT_TRUE(c);
  auto id = WriteAndKeep(c.get(), 8, 64);
  ASSERT_TRUE(id.ok());
  ASSERT_TRUE(WaitForKept(c.get(), 1));
  ASSERT_TRUE(c->Spill(*id).ok());
  auto v = c->VerifySpill();
  ASSERT_TRUE(v.ok());
  EXPECT_EQ(v->pages_bad, 0u);
  ASSERT_TRUE(FlipBytesOf(spill.path, ".sst", PatternBytes(8, 2, 1), 200)) << "the page is in an SST file";
  v = c->VerifySpill();
  ASSERT_TRUE(v.ok());
  EXPECT_EQ(v->pages_bad, 1u);
  EXPECT_TRUE(Mentions(v->bad, "default/" + std::to_string(*id) + "/2/1:"));
}

// A flipped byte in the WAL of a killed daemon used to erase the sequence at the restart, with
// verify reporting nothing. Now verify names it, and the counters show it.
TEST(SpillTest, ADamagedWalIsReportedByVerifyNotErased) {
  TempDir spill;
  uint64_t id = 0;
  {
    DaemonProcess d;
    ASSERT_TRUE(d.Start("", {"--spill-dir", spill.path}));
    auto c = Connect(d);
    ASSERT_TRUE(c);
    auto kept = WriteAndKeep(c.get(), 7, 64);
    ASSERT_TRUE(kept.ok());
    id = *kept;
    ASSERT_TRUE(WaitForKept(c.get(), 1));
    ASSERT_TRUE(c->Spill(id).ok());
    d.child->Kill(SIGKILL);  // the pages are in the WAL only
    d.child->Wait(5000);
  }
  ASSERT_TRUE(FlipBytesOf(spill.path, ".log", PatternBytes(7, 1, 1), 30));
  DaemonProcess d;
  ASSERT_TRUE(d.Start("", {"--spill-dir", spill.path}));
  auto c = Connect(d);
  ASSERT_TRUE(c);
  auto v = c->VerifySpill();
  ASSERT_TRUE(v.ok());
  EXPECT_TRUE(Mentions(v->bad, "default/" + std::to_string(id) + ": its records were lost to a damaged WAL"))
      << (v->bad.empty() ? "verify reported nothing" : v->bad[0]);
  auto stats = c->Stats();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->spill_damaged_sequences, 1u);
  EXPECT_GE(stats->spill_unreadable_records, 1u);
  EXPECT_TRUE(c->Evict(id).ok()) << "an operator clears it once seen";
  EXPECT_EQ(c->Stats()->kept_evicted, 1u);
  v = c->VerifySpill();
  ASSERT_TRUE(v.ok());
  EXPECT_FALSE(Mentions(v->bad, "default/" + std::to_string(id) + ":"));
}

// An operator's verify loop (with a monitor reading Stats, as the metrics endpoint does) used to
// stall every ExtendSequence for most of each verify: Stats waited under the registry lock for
// the kept sequences' lock, which verify held while reading every page.
TEST(SpillTest, AVerifyLoopDoesNotStallExtend) {
  TempDir spill;
  DaemonProcess d;
  ASSERT_TRUE(d.Start("", {"--spill-dir", spill.path}));
  auto c = Connect(d);
  ASSERT_TRUE(c);
  const client::PageLayoutSpec big{32, 8, 128, 16, 256};  // 64 KiB pages: 32 MiB per sequence
  for (int i = 0; i < 2; ++i) {
    auto session = c->OpenSession("default", 36 << 20);
    ASSERT_TRUE(session.ok()) << session.status().ToString();
    auto id = (*session)->CreateSequence(big);
    ASSERT_TRUE(id.ok());
    ASSERT_TRUE((*session)->Extend(*id, 256).ok());
    ASSERT_TRUE((*session)->Keep(*id).ok());
    session->reset();
    ASSERT_TRUE(WaitForKept(c.get(), i + 1));
  }
  (void)c->SpillAll();
  ASSERT_EQ(c->Stats()->spilled_sequences, 2u);
  std::atomic<bool> done{false};
  std::vector<double> verify_ms;
  std::thread verifier([&] {
    auto v = Connect(d);
    while (v && !done.load()) {
      const auto t0 = std::chrono::steady_clock::now();
      if (!v->VerifySpill().ok()) break;
      verify_ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
  });
  std::thread monitor([&] {
    auto m = Connect(d);
    while (m && !done.load()) {
      (void)m->Stats();
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  });
  auto session = c->OpenSession("default", 8 << 20);
  ASSERT_TRUE(session.ok());
  std::vector<double> extend_ms;
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(3);
  while (std::chrono::steady_clock::now() < end) {
    auto id = (*session)->CreateSequence(kLayout);
    ASSERT_TRUE(id.ok());
    for (uint32_t tokens = 16; tokens <= 256; tokens += 16) {
      const auto t0 = std::chrono::steady_clock::now();
      ASSERT_TRUE((*session)->Extend(*id, tokens).ok());
      extend_ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
    ASSERT_TRUE((*session)->Release(*id).ok());
  }
  done = true;
  verifier.join();
  monitor.join();
  ASSERT_GE(verify_ms.size(), 2u);
  std::sort(verify_ms.begin(), verify_ms.end());
  std::sort(extend_ms.begin(), extend_ms.end());
  const double verify_median = verify_ms[verify_ms.size() / 2];
  const double extend_p99 = extend_ms[extend_ms.size() * 99 / 100];
  std::printf("%zu verifies of 64 MiB (median %.0f ms); %zu extends: p99 %.2f ms, max %.2f ms\n", verify_ms.size(),
              verify_median, extend_ms.size(), extend_p99, extend_ms.back());
  EXPECT_LT(extend_p99, verify_median / 4) << "Extend waits for verify";
}

// A claim that fails once the sequence was taken from the kept ones (here: the claiming session's
// memory cannot hold it) puts it back: it stays kept, whether it was parked or spilled, and a
// session that can hold it claims it intact.
TEST(SpillTest, AClaimThatFailsLeavesTheSequenceKept) {
  TempDir spill;
  DaemonProcess d;
  ASSERT_TRUE(d.Start("", {"--spill-dir", spill.path}));
  auto c = Connect(d);
  ASSERT_TRUE(c);
  auto parked = WriteAndKeep(c.get(), 21, 256);  // 16 pages x 3 layers x 8 KiB = 384 KiB
  auto spilled = WriteAndKeep(c.get(), 22, 200);
  ASSERT_TRUE(parked.ok() && spilled.ok());
  ASSERT_TRUE(WaitForKept(c.get(), 2));
  ASSERT_TRUE(c->Spill(*spilled).ok());
  {
    auto full = c->OpenSession("default", 4 << 20);  // one 4 MiB chunk...
    ASSERT_TRUE(full.ok()) << full.status().ToString();
    auto filler = (*full)->CreateSequence({3, 2, 64, 16, 4096});
    ASSERT_TRUE(filler.ok());
    ASSERT_TRUE((*full)->Extend(*filler, 2560).ok());  // ...3.75 MiB of it taken: 256 KiB left
    for (uint64_t id : {*parked, *spilled}) {
      auto refused = (*full)->Claim(id, kLayout);
      EXPECT_EQ(refused.status().code(), StatusCode::kResourceExhausted) << refused.status().ToString();
    }
  }
  auto stats = c->Stats();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->parked_sequences + stats->spilled_sequences, 2u) << "both still kept";
  auto list = c->ListSequences();
  ASSERT_TRUE(list.ok());
  EXPECT_EQ(list->size(), 2u);
  auto a = ClaimAndCheck(c.get(), *parked, 21);
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  EXPECT_EQ(*a, 3u * 16);
  auto b = ClaimAndCheck(c.get(), *spilled, 22);
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  EXPECT_EQ(*b, 3u * 13);
  EXPECT_EQ(c->ListSequences()->size(), 0u);
}

// A claim copies a large kept sequence into its session (without the registry's lock). Meanwhile
// the same session (raw calls: the client library knows the sequence only once the claim returns)
// marks it to keep and closes. Before, the close parked the half-copied pages under the sequence's id, and
// the claim, finding its session gone, could not put the original back: the id stayed kept with
// the wrong pages, and the original was freed without a word. Now a sequence being claimed cannot
// be marked to keep until its claim returns: whichever way the calls interleave, what is kept at
// the end is the sequence as it was written.
TEST(SpillTest, AKeepAndCloseDuringAClaimNeverKeepAHalfCopiedSequence) {
  DaemonProcess d;
  ASSERT_TRUE(d.Start("[spill]\npark_bytes = \"64MiB\"\n"));
  auto c = Connect(d);
  ASSERT_TRUE(c);
  const client::PageLayoutSpec big{12, 8, 128, 16, 1024};  // 64 KiB pages, 48 MiB
  for (int round = 0; round < 8; ++round) {  // the race is timing's: several rounds
    const uint64_t seed = 40 + round;
    uint64_t id = 0;
    {
      auto session = c->OpenSession("default", 52 << 20);
      ASSERT_TRUE(session.ok()) << session.status().ToString();
      auto created = (*session)->CreateSequence(big);
      ASSERT_TRUE(created.ok());
      id = *created;
      auto pages = (*session)->Extend(id, 1024);
      ASSERT_TRUE(pages.ok());
      ASSERT_TRUE(FillPattern(session->get(), id, *pages, seed, big).ok());
      ASSERT_TRUE((*session)->Keep(id).ok());
    }
    ASSERT_TRUE(WaitForKept(c.get(), 1));
    // The claiming session, opened and attached by hand so that its token can be used directly.
    auto stub = v1::Control::NewStub(grpc::CreateChannel("unix:" + d.socket, grpc::InsecureChannelCredentials()));
    v1::OpenSessionResponse opened;
    ASSERT_TRUE(testing::OpenSessionByHand(*stub, "default", 52 << 20, &opened).ok());
    const int fd = testing::AttachByHand(opened.attach_path(), opened.session_id(), opened.token());
    ASSERT_GE(fd, 0);
    std::atomic<bool> claimed{false};
    grpc::Status claim_status;
    std::thread claim([&] {
      v1::ClaimSequenceRequest req;
      req.set_session_id(opened.session_id());
      req.set_token(opened.token());
      req.set_sequence_id(id);
      v1::SequenceLayout* l = req.mutable_layout();
      l->set_n_layers(big.n_layers), l->set_n_kv_heads(big.n_kv_heads), l->set_head_dim(big.head_dim);
      l->set_page_tokens(big.page_tokens), l->set_capacity_tokens(big.capacity_tokens);
      v1::ClaimSequenceResponse resp;
      grpc::ClientContext ctx;
      claim_status = stub->ClaimSequence(&ctx, req, &resp);
      claimed = true;
    });
    // Keep it as soon as the session has it (during the claim's copy, or after), then close.
    bool kept = false;
    for (int i = 0; i < 20000 && !kept; ++i) {
      const bool after_claim = claimed;  // read before the attempt: the last one comes after the claim
      v1::KeepSequenceRequest keep;
      keep.set_session_id(opened.session_id());
      keep.set_token(opened.token());
      keep.set_sequence_id(id);
      v1::KeepSequenceResponse none;
      grpc::ClientContext ctx;
      const grpc::Status s = stub->KeepSequence(&ctx, keep, &none);
      kept = s.ok();
      if (!kept && after_claim) break;  // the claim failed: nothing to keep
    }
    v1::CloseSessionRequest close_req;
    close_req.set_session_id(opened.session_id());
    close_req.set_token(opened.token());
    v1::CloseSessionResponse closed;
    {
      grpc::ClientContext ctx;
      (void)stub->CloseSession(&ctx, close_req, &closed);
    }
    claim.join();
    ::close(fd);
    // Kept again (by the close, or put back by a claim that lost its session): as written.
    ASSERT_TRUE(WaitForKept(c.get(), 1)) << "round " << round << ": kept by the close " << kept << ", the claim "
                                         << claim_status.error_message();
    auto checked = ClaimAndCheck(c.get(), id, seed, big, 52 << 20);
    ASSERT_TRUE(checked.ok()) << "round " << round << " (kept by the close: " << kept << "): " << checked.status().ToString();
  }
  auto stats = c->Stats();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->kept_dropped, 0u);
}

#ifdef SPECACHECTL_PATH
// Runs specachectl against the daemon; returns its stdout and sets *code to its exit status.
std::string Ctl(const DaemonProcess& d, const std::string& args, int* code) {
  return RunCommand(std::string(SPECACHECTL_PATH) + " --socket " + d.socket + " " + args + " 2>&1", code);
}

// The operator's commands, as other tools call them.
TEST(SpillTest, SpecachectlSpillRestoreEvictVerify) {
  TempDir spill;
  DaemonProcess d;
  ASSERT_TRUE(d.Start("", {"--spill-dir", spill.path}));
  auto c = Connect(d);
  ASSERT_TRUE(c);
  auto id = WriteAndKeep(c.get(), 3, 64);
  ASSERT_TRUE(id.ok());
  ASSERT_TRUE(WaitForKept(c.get(), 1));
  const std::string seq = std::to_string(*id);
  int code = -1;
  EXPECT_NE(Ctl(d, "spill --all", &code).find("spilled 1 sequence"), std::string::npos);
  EXPECT_EQ(code, 0);
  const std::string stats = Ctl(d, "stats --json", &code);
  EXPECT_NE(stats.find("\"spilled_bytes\":" + std::to_string(3 * 4 * kLayout.page_bytes())), std::string::npos) << stats;
  const std::string verify = Ctl(d, "verify --json", &code);
  EXPECT_EQ(code, 0);
  EXPECT_NE(verify.find("\"pages_checked\":12"), std::string::npos) << verify;
  EXPECT_NE(verify.find("\"pages_bad\":0"), std::string::npos) << verify;
  EXPECT_NE(Ctl(d, "sequences", &code).find("spilled"), std::string::npos);
  EXPECT_NE(Ctl(d, "restore --sequence " + seq, &code).find("restored"), std::string::npos);
  EXPECT_NE(Ctl(d, "sequences", &code).find("parked"), std::string::npos);
  EXPECT_NE(Ctl(d, "evict --sequence " + seq, &code).find("evicted"), std::string::npos);
  EXPECT_EQ(c->Stats()->parked_sequences + c->Stats()->spilled_sequences, 0u);
  EXPECT_NE(Ctl(d, "restore --sequence " + seq, &code).find("NOT_FOUND"), std::string::npos);
  EXPECT_EQ(code, 1);
  EXPECT_NE(Ctl(d, "spill", &code).find("--sequence ID or --all"), std::string::npos);
  // A sequence a client is using is never moved: the operator is told why.
  auto session = c->OpenSession("default", 4 << 20);
  ASSERT_TRUE(session.ok());
  auto live = (*session)->CreateSequence(kLayout);
  ASSERT_TRUE(live.ok());
  const std::string refused = Ctl(d, "spill --sequence " + std::to_string(*live), &code);
  EXPECT_NE(refused.find("FAILED_PRECONDITION"), std::string::npos) << refused;
  EXPECT_NE(refused.find("in use by session"), std::string::npos) << refused;
}
#endif

}  // namespace
}  // namespace specache
