// The sources' sequence registry (client_lib/src/sequence_registry.h) under calls that race on
// one sequence, against a stand-in session whose daemon calls take a while (no daemon).
#include "sequence_registry.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>

namespace specache::client {
namespace {

// Session's calls as the registry makes them; each daemon call sleeps, as a round trip would.
struct SlowSession {
  std::atomic<int> creates{0}, releases{0}, keeps{0};
  std::atomic<uint64_t> next{100};
  Result<uint64_t> CreateSequence(const PageLayoutSpec&) {
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
    ++creates;
    return next++;
  }
  Result<uint32_t> Extend(uint64_t, uint32_t tokens) { return tokens; }
  Status Release(uint64_t) {
    ++releases;
    return Status::Ok();
  }
  Status Keep(uint64_t) {
    std::this_thread::sleep_for(std::chrono::milliseconds(60));
    ++keeps;
    return Status::Ok();
  }
};

const SequenceLayout kLayout{2, 2, 64, HostRowFormat::kFp16};

// Before, both Creates passed the registry's check, both made a daemon sequence, and the second
// replaced the first, which nothing released.
TEST(SequenceRegistryTest, TwoCreatesOfOneIdAtOnceMakeOneDaemonSequence) {
  SlowSession session;
  {
    SequenceRegistry<SlowSession> registry(&session, 64, 1024);
    Status a, b;
    std::thread first([&] { a = registry.Create(5, kLayout); });
    std::thread second([&] { b = registry.Create(5, kLayout); });
    first.join();
    second.join();
    EXPECT_NE(a.ok(), b.ok()) << a.ToString() << " / " << b.ToString();
    EXPECT_EQ((a.ok() ? b : a).code(), StatusCode::kAlreadyExists);
    EXPECT_EQ(session.creates.load(), 1);
  }
  EXPECT_EQ(session.releases.load(), 1) << "the one daemon sequence, released with the registry";
}

// An entry that says when it is freed.
struct Tracked : RegisteredSequence {
  Tracked(const SequenceLayout& l, uint32_t max_pages_per_layer) : RegisteredSequence(l, max_pages_per_layer) {}
  ~Tracked() { freed->store(true); }
  std::atomic<bool>* freed = nullptr;
};

// A Release while another thread uses the entry Find gave it (a source's read on a prefetch
// thread, say) forgets the sequence at once but frees the entry only once that use ends; before,
// Find handed out a bare pointer the Release freed under it.
TEST(SequenceRegistryTest, AReleaseFreesAnEntryOnlyOnceItsFindersAreDone) {
  SlowSession session;
  SequenceRegistry<SlowSession, Tracked> registry(&session, 64, 1024);
  ASSERT_TRUE(registry.Create(3, kLayout).ok());
  std::atomic<bool> freed{false};
  {
    auto held = registry.Find(3);
    ASSERT_TRUE(held.ok());
    (*held)->freed = &freed;
    ASSERT_TRUE(registry.Release(3).ok());
    EXPECT_EQ(registry.Find(3).status().code(), StatusCode::kNotFound);
    EXPECT_FALSE(freed.load()) << "freed while a finder held it";
    (*held)->lengths[0].store(5);  // still its memory
  }
  EXPECT_TRUE(freed.load());
}

// An entry that records the page count its registry gave it.
struct CountedPages : RegisteredSequence {
  CountedPages(const SequenceLayout& l, uint32_t max_pages_per_layer)
      : RegisteredSequence(l, max_pages_per_layer), pages(max_pages_per_layer) {}
  uint32_t pages;
};

// A sequence's page count is computed in 64 bits: capacity + page_tokens - 1 wrapped in 32 (to 0
// pages here, with a daemon that took the layout), and page_tokens 0 divided by zero; it is
// refused before the daemon is asked.
TEST(SequenceRegistryTest, PageCountsOfExtremeLayoutsNeitherWrapNorDivideByZero) {
  SlowSession session;
  SequenceRegistry<SlowSession, CountedPages> wide(&session, 0xffffffffu, 0xffffffffu);
  ASSERT_TRUE(wide.Create(1, kLayout).ok());
  auto entry = wide.Find(1);
  ASSERT_TRUE(entry.ok());
  EXPECT_EQ((*entry)->pages, 1u);
  SequenceRegistry<SlowSession, CountedPages> zero(&session, 0, 1024);
  const int before = session.creates.load();
  EXPECT_EQ(zero.Create(2, kLayout).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(session.creates.load(), before) << "asked the daemon for a layout it could not hold";
}

// Before, Release freed the entry while Keep was in its daemon call, and Keep then wrote to it
// (heap use after free), returning OK for a sequence Release had freed in the daemon.
TEST(SequenceRegistryTest, AKeepInItsCallAndAReleaseOfTheSameSequenceEndKeptOrReleased) {
  for (const int release_after_ms : {0, 20}) {
    SlowSession session;
    SequenceRegistry<SlowSession> registry(&session, 64, 1024);
    ASSERT_TRUE(registry.Create(7, kLayout).ok());
    Result<uint64_t> kept = Status::Internal("not run");
    std::thread keep([&] { kept = registry.Keep(7); });
    std::this_thread::sleep_for(std::chrono::milliseconds(release_after_ms));
    const Status released = registry.Release(7);
    keep.join();
    EXPECT_TRUE(released.ok()) << released.ToString();
    if (kept.ok()) {
      EXPECT_EQ(session.keeps.load(), 1);
      EXPECT_EQ(session.releases.load(), 0) << "kept: left in the daemon";
    } else {
      EXPECT_EQ(kept.status().code(), StatusCode::kNotFound) << kept.status().ToString();
      EXPECT_EQ(session.keeps.load(), 0);
      EXPECT_EQ(session.releases.load(), 1) << "released in the daemon";
    }
    EXPECT_FALSE(registry.Find(7).ok());
  }
}

}  // namespace
}  // namespace specache::client
