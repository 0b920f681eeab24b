// The registry in process (no daemon, no sockets). Claims between tenants: a claim of another
// tenant's sequence is refused before anything of the registry changes, and as an unknown id. A
// claimed sequence's disk copy that its claim failed to delete gives way to the copy kept under the
// same id later (KeptSequences over a real spill store). At a stop, what is parked in RAM only is
// dropped and counted. Releases: their pages are zeroed without the registry's lock, and a session
// closed meanwhile keeps its chunks until that is done.
#include <unistd.h>

#include <gtest/gtest.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <future>
#include <memory>
#include <thread>

#include "kept_sequences.h"
#include "registry.h"
#include "testing/temp_dir.h"

namespace specache::daemon {
namespace {

// A session whose CloseSession is waiting: the close has marked it ended (not attached), under the
// lock, in the same hold as its wait begins.
bool Closing(Registry& registry, uint64_t session) {
  for (const SessionSummary& s : registry.Sessions()) {
    if (s.id == session) return !s.attached;
  }
  return false;
}

class RegistryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    spdlog::set_level(spdlog::level::off);
    Make(8u << 20, 2u << 20);
  }
  void TearDown() override { spdlog::set_level(spdlog::level::info); }

  // A registry over a pool of pool_bytes in chunks of chunk_bytes, half of it for each tenant.
  void Make(uint64_t pool_bytes, uint64_t chunk_bytes) {
    registry_.reset();
    config_.pool_bytes = pool_bytes;
    config_.chunk_bytes = chunk_bytes;
    config_.lock_memory = false;
    config_.huge_pages = false;
    config_.prefault_threads = 1;
    config_.tenants["a"].quota_bytes = pool_bytes / 2;
    config_.tenants["a"].uids = {1000};
    config_.tenants["b"].quota_bytes = pool_bytes / 2;
    config_.tenants["b"].uids = {2000};
    auto pool = ChunkPool::Create({config_.pool_bytes, config_.chunk_bytes, 1, false, false});
    ASSERT_TRUE(pool.ok()) << pool.status().ToString();
    pool_ = std::move(*pool);
    kept_ = std::make_unique<KeptSequences>(KeptOptions{1u << 20}, nullptr);
    registry_ = std::make_unique<Registry>(config_, pool_.get(), kept_.get());
  }

  OpenedSession Open(const std::string& tenant, const Caller& caller, uint64_t bytes = 2u << 20) {
    auto s = registry_->OpenSession(tenant, bytes, tenant, caller);
    EXPECT_TRUE(s.ok()) << s.status().ToString();
    auto grant = registry_->Attach(s->id, s->token, caller);
    EXPECT_TRUE(grant.ok()) << grant.status().ToString();
    if (grant.ok()) {
      for (int fd : grant->fds) close(fd);
    }
    return *s;
  }

  // A sequence of tenant a's (16 tokens of layout_), kept by its session's close; 0 on a failure.
  uint64_t KeptByA() {
    const OpenedSession sa = Open("a", a_);
    auto created = registry_->CreateSequence(sa.id, sa.token, layout_);
    EXPECT_TRUE(created.ok()) << created.status().ToString();
    if (!created.ok()) return 0;
    const uint64_t x = created->first;
    EXPECT_TRUE(registry_->ExtendSequence(sa.id, sa.token, x, 16).ok());
    EXPECT_TRUE(registry_->KeepSequence(sa.id, sa.token, x).ok());
    EXPECT_TRUE(registry_->CloseSession(sa.id, sa.token).ok());
    registry_->ParkKeptSequences();
    EXPECT_TRUE(kept_->Find(x).ok()) << "kept once its session closed";
    return kept_->Find(x).ok() ? x : 0;
  }

  // Closes the session on a thread of its own (the caller joins it) and waits, 10 s at most, until
  // the close is seen waiting (*waiting: whether it was).
  std::thread CloseAndSeeItWait(const OpenedSession& s, Status* closed, bool* waiting) {
    std::thread closer([this, s, closed] { *closed = registry_->CloseSession(s.id, s.token); });
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (!(*waiting = Closing(*registry_, s.id)) && std::chrono::steady_clock::now() < until) std::this_thread::yield();
    return closer;
  }

  const PageLayout layout_{1, 1, 8, 16, 64, 0};
  const Caller a_{getpid(), 1000, 1000, {}, {}}, b_{getpid(), 2000, 2000, {}, {}};
  DaemonConfig config_;
  std::unique_ptr<ChunkPool> pool_;
  std::unique_ptr<KeptSequences> kept_;
  std::unique_ptr<Registry> registry_;
};

// Before, a claim marked the id as being claimed before the kept sequences checked its tenant: a
// tenant claiming another's id in a loop (ids are sequential) made the owner's own KeepSequence
// and ClaimSequence of it fail with "is being claimed" about half of the time.
TEST_F(RegistryTest, AnotherTenantsClaimsOfASequenceLeaveItsOwnersCallsAlone) {
  const OpenedSession sa = Open("a", a_), sb = Open("b", b_);
  auto created = registry_->CreateSequence(sa.id, sa.token, layout_);
  ASSERT_TRUE(created.ok()) << created.status().ToString();
  const uint64_t x = created->first;
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> claims{0}, not_found{0};
  std::thread other([&] {
    while (!stop) {
      const auto claimed = registry_->ClaimSequence(sb.id, sb.token, x, layout_);
      ++claims;
      if (claimed.status().code() == StatusCode::kNotFound) ++not_found;
    }
  });
  // The owner's keeps while the other's claims run (at least 2000 of them, within 20 s).
  int refused = 0;
  std::string why;
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  for (int i = 0; (i < 20000 || claims < 2000) && std::chrono::steady_clock::now() < until; ++i) {
    const Status s = registry_->KeepSequence(sa.id, sa.token, x);
    if (!s.ok()) ++refused, why = s.ToString();
  }
  stop = true;
  other.join();
  EXPECT_EQ(refused, 0) << why;
  EXPECT_GE(claims.load(), 2000u);
  EXPECT_EQ(not_found.load(), claims.load()) << "every claim of a live sequence of another tenant: NOT_FOUND";
}

// A kept sequence of tenant a: tenant b's claim gets the answer an unknown id gets, and leaves it
// kept for a, whose claim then takes it.
TEST_F(RegistryTest, AnotherTenantsKeptSequenceAnswersAsAnUnknownId) {
  const uint64_t x = KeptByA();
  ASSERT_NE(x, 0u);
  const OpenedSession sb = Open("b", b_);
  const auto theirs = registry_->ClaimSequence(sb.id, sb.token, x, layout_);
  const auto unknown = registry_->ClaimSequence(sb.id, sb.token, x + 1000, layout_);
  ASSERT_FALSE(theirs.ok());
  ASSERT_FALSE(unknown.ok());
  EXPECT_EQ(theirs.status().code(), StatusCode::kNotFound) << theirs.status().ToString();
  EXPECT_EQ(theirs.status().code(), unknown.status().code());
  EXPECT_EQ(theirs.status().message().find("tenant"), std::string::npos) << theirs.status().ToString();
  ASSERT_TRUE(kept_->Find(x).ok()) << "still kept for its tenant";
  const OpenedSession sa = Open("a", a_);
  const auto mine = registry_->ClaimSequence(sa.id, sa.token, x, layout_);
  EXPECT_TRUE(mine.ok()) << mine.status().ToString();
  EXPECT_FALSE(kept_->Find(x).ok()) << "claimed: no longer kept";
}

// A claim copies the kept pages into its session without the registry's lock (before, in batches
// under it, and a waiting call got the lock only after the last batch: std::mutex is not fair).
// Held at that point: another thread's calls run, and the sequence can be neither released (its
// pages are being written) nor kept until the claim returns; then both work.
TEST_F(RegistryTest, DuringAClaimsCopyOtherCallsRunAndTheSequenceCannotBeReleasedOrKept) {
  const uint64_t x = KeptByA();
  ASSERT_NE(x, 0u);
  const OpenedSession sa = Open("a", a_);
  int held = 0;
  registry_->SetBeforeUnlockedWork([&](uint64_t session) {
    if (held++ > 0) return;  // the claim only
    EXPECT_EQ(session, sa.id);
    // Another thread's call (left to finish on its own if it waits: the hold ends when this returns).
    auto sessions = std::make_shared<std::promise<uint32_t>>();
    auto answered = sessions->get_future();
    std::thread([registry = registry_.get(), sessions] { sessions->set_value(registry->Stats().sessions); }).detach();
    ASSERT_EQ(answered.wait_for(std::chrono::seconds(10)), std::future_status::ready) << "another thread's call waits";
    EXPECT_EQ(answered.get(), 1u);
    const Status released = registry_->ReleaseSequence(sa.id, sa.token, x);
    EXPECT_EQ(released.code(), StatusCode::kFailedPrecondition) << released.ToString();
    EXPECT_NE(released.message().find("is being claimed"), std::string::npos) << released.ToString();
    EXPECT_EQ(registry_->KeepSequence(sa.id, sa.token, x).code(), StatusCode::kFailedPrecondition);
  });
  const auto claimed = registry_->ClaimSequence(sa.id, sa.token, x, layout_);
  ASSERT_TRUE(claimed.ok()) << claimed.status().ToString();
  EXPECT_EQ(held, 1);
  EXPECT_FALSE(kept_->Find(x).ok()) << "claimed";
  EXPECT_TRUE(registry_->KeepSequence(sa.id, sa.token, x).ok());
  EXPECT_TRUE(registry_->ReleaseSequence(sa.id, sa.token, x).ok());
}

// A session closed during a claim's copy: the close waits for the copy (the chunks stay the
// session's while it writes them), the sequence leaves the session and stays kept, and the claim
// says so.
TEST_F(RegistryTest, ASessionClosedDuringAClaimsCopyLeavesTheSequenceKept) {
  const uint64_t x = KeptByA();
  ASSERT_NE(x, 0u);
  const uint64_t pool_bytes = registry_->Stats().pool_bytes;
  const OpenedSession sa = Open("a", a_);
  Status closed = Status::Internal("not closed");
  std::thread closer;
  bool waiting = false;
  registry_->SetBeforeUnlockedWork([&](uint64_t) { closer = CloseAndSeeItWait(sa, &closed, &waiting); });
  const auto claimed = registry_->ClaimSequence(sa.id, sa.token, x, layout_);
  closer.join();
  EXPECT_TRUE(waiting) << "the close was never seen waiting";
  EXPECT_EQ(claimed.status().code(), StatusCode::kFailedPrecondition) << claimed.status().ToString();
  EXPECT_NE(claimed.status().message().find("it stays kept"), std::string::npos) << claimed.status().ToString();
  EXPECT_TRUE(closed.ok()) << closed.ToString();
  EXPECT_TRUE(kept_->Find(x).ok()) << "put back";
  const RegistryStats st = registry_->Stats();
  EXPECT_EQ(st.sessions, 0u);
  EXPECT_EQ(st.free_bytes, pool_bytes);
  EXPECT_EQ(st.kept.parked, 1u);
}

// A claim takes a spilled sequence and its Finish deletes the disk copy; when that delete fails (a
// full disk, the store read-only after a write error) the copy stays while the id lives on in the
// claiming session, which may keep it again. Before, every write of the new copy then failed
// (ALREADY_EXISTS: no write-through, no spill, the watermarks stuck behind it) and a restart listed
// the old bytes under the id. The failed delete is played by dropping the taken sequence unfinished.
TEST(KeptSequencesTest, AnOldDiskCopyLeftByAFailedDeleteGivesWayToTheCopyKeptNow) {
  spdlog::set_level(spdlog::level::off);
  testing::TempDir dir;
  const PageLayout layout{2, 1, 8, 16, 32, 0};
  const uint32_t pages = 2;
  std::vector<uint8_t> bytes(uint64_t{layout.n_layers} * pages * layout.page_bytes());
  const auto fill = [&](uint8_t v) {
    std::fill(bytes.begin(), bytes.end(), v);
    return [&](uint32_t l, uint32_t p) { return bytes.data() + (uint64_t{l} * pages + p) * layout.page_bytes(); };
  };
  {
    auto store = SpillStore::Open({dir.path + "/spill"});
    ASSERT_TRUE(store.ok()) << store.status().ToString();
    KeptSequences kept({1u << 20, 0.9, 0.7, /*write_through=*/true}, std::move(*store));
    ASSERT_TRUE(kept.Park("a", 7, layout, pages, fill('A')).ok());
    ASSERT_TRUE(kept.Find(7)->also_on_disk || kept.Find(7)->state == KeptState::kSpilled);
    {
      auto taken = kept.Take("a", 7, layout);
      ASSERT_TRUE(taken.ok()) << taken.status().ToString();
    }  // not finished: its disk copy stays, as after a failed delete
    ASSERT_FALSE(kept.Find(7).ok());
    // Kept again under its id: written through (the old copy deleted first), then spilled.
    ASSERT_TRUE(kept.Park("a", 7, layout, pages, fill('B')).ok());
    EXPECT_TRUE(kept.Find(7)->also_on_disk) << "written through";
    EXPECT_EQ(kept.stats().write_through_failures, 0u);
    ASSERT_TRUE(kept.SpillAll().ok());
  }
  // A restart finds the copy kept now, not the claimed one.
  auto store = SpillStore::Open({dir.path + "/spill"});
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  std::vector<uint8_t> got(bytes.size(), 0);
  ASSERT_TRUE((*store)->Get("a", 7, [&](uint32_t l, uint32_t p) { return got.data() + (uint64_t{l} * pages + p) * layout.page_bytes(); }).ok());
  EXPECT_EQ(got, std::vector<uint8_t>(bytes.size(), 'B'));
  spdlog::set_level(spdlog::level::info);
}

// A claim takes a kept sequence out of the kept ones for its copy, and puts it back if the claim
// fails. Meanwhile it still counts for its tenant: before, a KeepSequence in that window passed
// kept_sequences_per_tenant, and a failed claim (then: its sequence released mid-copy; now: its
// session ended mid-copy) left the tenant over its limit, as often as the trick was repeated.
TEST(KeptSequencesTest, ASequenceInAClaimsCopyStillCountsForItsTenant) {
  KeptSequences kept({1u << 20}, nullptr);
  const PageLayout layout{1, 1, 8, 16, 32, 0};
  std::vector<uint8_t> page(layout.page_bytes(), 1);
  const auto pages = [&](uint32_t, uint32_t) { return page.data(); };
  ASSERT_TRUE(kept.Park("a", 3, layout, 2, pages).ok());
  EXPECT_EQ(kept.CountOf("a"), 1u);
  auto taken = kept.Take("a", 3, layout);
  ASSERT_TRUE(taken.ok()) << taken.status().ToString();
  EXPECT_EQ(kept.CountOf("a"), 1u) << "in the claim's copy";
  EXPECT_EQ(kept.CountOf("b"), 0u);
  kept.PutBack(std::move(*taken));
  EXPECT_EQ(kept.CountOf("a"), 1u) << "put back";
  auto again = kept.Take("a", 3, layout);
  ASSERT_TRUE(again.ok());
  kept.Finish(std::move(*again));
  EXPECT_EQ(kept.CountOf("a"), 0u) << "claimed";
}

// At the daemon's stop, parked sequences without a disk copy die with the process: they used to
// go uncounted. Each is now forgotten and counted as dropped; spilled ones, and parked ones written
// through, stay (their disk copy is the kept one).
TEST(KeptSequencesTest, AStopDropsAndCountsWhatIsParkedInRamOnly) {
  spdlog::set_level(spdlog::level::off);
  testing::TempDir dir;
  const PageLayout layout{1, 1, 8, 16, 32, 0};
  std::vector<uint8_t> page(layout.page_bytes(), 1);
  const auto pages = [&](uint32_t, uint32_t) { return page.data(); };
  {
    KeptSequences kept({1u << 20}, nullptr);
    ASSERT_TRUE(kept.Park("a", 1, layout, 2, pages).ok());
    ASSERT_TRUE(kept.Park("b", 2, layout, 2, pages).ok());
    EXPECT_EQ(kept.DropRamOnly(), 2u);
    EXPECT_EQ(kept.stats().dropped, 2u);
    EXPECT_TRUE(kept.List().empty());
  }
  auto store = SpillStore::Open({dir.path + "/spill"});
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  KeptSequences kept({1u << 20, 0.9, 0.7, /*write_through=*/true}, std::move(*store));
  ASSERT_TRUE(kept.Park("a", 3, layout, 2, pages).ok());
  ASSERT_TRUE(kept.Park("a", 4, layout, 2, pages).ok());
  ASSERT_TRUE(kept.Spill(4).ok());
  EXPECT_EQ(kept.DropRamOnly(), 0u);
  EXPECT_EQ(kept.stats().dropped, 0u);
  EXPECT_EQ(kept.List().size(), 2u);
  spdlog::set_level(spdlog::level::info);
}

// A session's entry in Sessions() caught between a release's first step and its last: the
// sequence gone from the session, its pages still held (being zeroed, without the registry's lock).
bool MidRelease(Registry& registry, uint64_t session) {
  for (const SessionSummary& s : registry.Sessions()) {
    if (s.id == session) return s.sequences == 0 && s.used_bytes > 0;
  }
  return false;
}

// 48 MiB of pages (256 KiB each) in a session of 64 MiB, in a pool of 128 MiB with chunks of 8 MiB.
class RegistryReleaseTest : public RegistryTest {
 protected:
  void SetUp() override {
    RegistryTest::SetUp();
    Make(128u << 20, 8u << 20);
  }
  uint64_t CreateFull(const OpenedSession& s) {
    auto created = registry_->CreateSequence(s.id, s.token, layout_);
    EXPECT_TRUE(created.ok()) << created.status().ToString();
    if (!created.ok()) return 0;
    auto extended = registry_->ExtendSequence(s.id, s.token, created->first, layout_.capacity_tokens);
    EXPECT_TRUE(extended.ok()) << extended.status().ToString();
    return created->first;
  }
  const PageLayout layout_{4, 8, 128, 64, 3072, 0};
};

// Before, a release zeroed its pages under the registry's lock: every session's calls waited for
// the memset (a second for the 4 GiB of a 32K-token Llama-3-8B sequence). Now another thread's
// calls see the release half done: the sequence gone, its pages not yet freed.
TEST_F(RegistryReleaseTest, OtherCallsGoOnWhileAReleaseZeroesItsPages) {
  const OpenedSession sa = Open("a", a_, 64u << 20);
  std::atomic<bool> seen{false}, stop{false};
  std::thread watcher([&] {
    while (!stop && !seen) seen = MidRelease(*registry_, sa.id);
  });
  int releases = 0;
  Status failed;
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (!seen && failed.ok() && std::chrono::steady_clock::now() < until) {
    const uint64_t x = CreateFull(sa);
    failed = x == 0 ? Status::Internal("no sequence") : registry_->ReleaseSequence(sa.id, sa.token, x);
    ++releases;
  }
  stop = true;
  watcher.join();
  ASSERT_TRUE(failed.ok()) << failed.ToString();
  EXPECT_TRUE(seen) << "no call ran while any of " << releases << " releases zeroed 48 MiB";
  EXPECT_FALSE(MidRelease(*registry_, sa.id));
  EXPECT_EQ(registry_->Stats().used_bytes, 0u) << "every page freed once its release returned";
}

// A session closed while a release zeroes its pages keeps its chunks until the release is done
// (back in the pool they would go to the next session under the memset), then gives them back
// before its close returns, as any close does; both calls succeed. The release is held before its
// zeroing until the close is seen waiting.
TEST_F(RegistryReleaseTest, ACloseWaitsForAReleaseThatZeroesItsPagesThenGivesTheChunksBack) {
  const uint64_t pool_bytes = registry_->Stats().pool_bytes;
  const OpenedSession sa = Open("a", a_, 64u << 20);
  const uint64_t x = CreateFull(sa);
  ASSERT_NE(x, 0u);
  Status closed = Status::Internal("not closed");
  std::thread closer;
  bool waiting = false;
  registry_->SetBeforeUnlockedWork([&](uint64_t session) {
    EXPECT_EQ(session, sa.id);
    closer = CloseAndSeeItWait(sa, &closed, &waiting);
    EXPECT_EQ(registry_->Stats().sessions, 1u) << "not reclaimed while the release runs";
  });
  const Status released = registry_->ReleaseSequence(sa.id, sa.token, x);
  closer.join();
  EXPECT_TRUE(waiting) << "the close was never seen waiting";
  EXPECT_TRUE(released.ok()) << released.ToString();
  EXPECT_TRUE(closed.ok()) << closed.ToString();
  const RegistryStats st = registry_->Stats();
  EXPECT_EQ(st.sessions, 0u);
  EXPECT_EQ(st.free_bytes, pool_bytes) << "the chunks are back when the close returns";
}

// A release that outlasts the close's wait (kReclaimWait, 2 s): the close returns, the session stays
// with its chunks while the release runs (Reap leaves it too), and the first Reap after the release
// gives them back.
TEST_F(RegistryReleaseTest, AReleaseOutlastingTheClosesWaitLeavesTheChunksToReap) {
  const uint64_t pool_bytes = registry_->Stats().pool_bytes;
  const OpenedSession sa = Open("a", a_, 64u << 20);
  const uint64_t x = CreateFull(sa);
  ASSERT_NE(x, 0u);
  Status closed = Status::Internal("not closed");
  registry_->SetBeforeUnlockedWork([&](uint64_t) {
    std::thread closer([&] { closed = registry_->CloseSession(sa.id, sa.token); });
    closer.join();  // past its wait
    registry_->Reap();
    EXPECT_EQ(registry_->Stats().sessions, 1u) << "neither the close nor Reap reclaims it while the release runs";
    EXPECT_LT(registry_->Stats().free_bytes, pool_bytes);
  });
  const Status released = registry_->ReleaseSequence(sa.id, sa.token, x);
  EXPECT_TRUE(released.ok()) << released.ToString();
  EXPECT_TRUE(closed.ok()) << closed.ToString();
  EXPECT_EQ(registry_->Stats().sessions, 1u) << "left to Reap";
  registry_->Reap();
  const RegistryStats st = registry_->Stats();
  EXPECT_EQ(st.sessions, 0u);
  EXPECT_EQ(st.free_bytes, pool_bytes);
}

}  // namespace
}  // namespace specache::daemon
