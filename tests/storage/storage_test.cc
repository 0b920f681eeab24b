#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <random>
#include <set>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "specache/chunk_pool.h"
#include "specache/extent_allocator.h"
#include "specache/session_pages.h"

namespace specache {
namespace {

TEST(ExtentAllocatorTest, FirstFitMergesOnFreeAndRejectsDoubleFrees) {
  ExtentAllocator a(100);
  EXPECT_EQ(a.Allocate(30), 0u);
  EXPECT_EQ(a.Allocate(30), 30u);
  EXPECT_EQ(a.Allocate(30), 60u);
  EXPECT_FALSE(a.Allocate(30).has_value());
  EXPECT_TRUE(a.Free(30, 30));
  EXPECT_FALSE(a.Free(30, 30));  // double free
  EXPECT_FALSE(a.Free(95, 10));  // outside
  EXPECT_TRUE(a.Free(0, 30));
  EXPECT_EQ(a.Allocate(60), 0u);  // the two freed extents merged
  EXPECT_EQ(a.free_units(), 10u);

  // Random allocate/free never hands out overlapping extents.
  std::mt19937 rng(3);
  ExtentAllocator b(1000);
  std::vector<std::pair<uint64_t, uint64_t>> live;
  std::vector<int> owner(1000, 0);
  for (int i = 0; i < 2000; ++i) {
    if (!live.empty() && rng() % 2) {
      const size_t k = rng() % live.size();
      ASSERT_TRUE(b.Free(live[k].first, live[k].second));
      for (uint64_t u = 0; u < live[k].second; ++u) owner[live[k].first + u] = 0;
      live.erase(live.begin() + k);
    } else {
      const uint64_t len = 1 + rng() % 40;
      if (auto at = b.Allocate(len)) {
        for (uint64_t u = 0; u < len; ++u) ASSERT_EQ(owner[*at + u]++, 0) << "overlap at " << *at + u;
        live.emplace_back(*at, len);
      }
    }
  }
}

ChunkPoolOptions SmallPool() {
  ChunkPoolOptions o;
  o.pool_bytes = 4 << 20;
  o.chunk_bytes = 1 << 20;
  o.prefault_threads = 2;
  return o;
}

// A pool of SmallPool() with one chunk taken by owner 7 and shared with a client (ShareFd): its
// open file in `fd`, as an attach hands it over.
struct OneSharedChunk {
  std::unique_ptr<ChunkPool> pool;
  uint32_t chunk = 0;
  int fd = -1;
};
::testing::AssertionResult ShareOneChunk(OneSharedChunk* s) {
  auto pool = ChunkPool::Create(SmallPool());
  if (!pool.ok()) return ::testing::AssertionFailure() << pool.status().ToString();
  s->pool = std::move(pool).value();
  auto taken = s->pool->Take(1, 7);
  if (!taken.ok()) return ::testing::AssertionFailure() << taken.status().ToString();
  s->chunk = (*taken)[0];
  auto fd = s->pool->ShareFd(s->chunk);
  if (!fd.ok()) return ::testing::AssertionFailure() << fd.status().ToString();
  s->fd = *fd;
  return ::testing::AssertionSuccess();
}
// The client lets go of its open file and the chunk comes back: nobody holds an open file of it,
// so it is scrubbed in place, not replaced, and the next owner (8) takes the same chunk.
::testing::AssertionResult ReturnUnheldAndTakeAgain(OneSharedChunk* s) {
  close(s->fd);
  s->fd = -1;
  if (Status r = s->pool->Return(std::span<const uint32_t>(&s->chunk, 1), 7); !r.ok()) {
    return ::testing::AssertionFailure() << "return: " << r.ToString();
  }
  if (s->pool->replaced_chunks() != 0) return ::testing::AssertionFailure() << "replaced, not scrubbed";
  auto taken = s->pool->Take(1, 8);
  if (!taken.ok()) return ::testing::AssertionFailure() << "take: " << taken.status().ToString();
  if ((*taken)[0] != s->chunk) return ::testing::AssertionFailure() << "another chunk: " << (*taken)[0];
  return ::testing::AssertionSuccess();
}

// A chunk returned twice (or that was never taken) would be free twice, then handed to two owners:
// Return refuses such a call before it changes anything.
TEST(ChunkPoolTest, AChunkNotTakenOrNamedTwiceIsRefusedBeforeAnyReturn) {
  auto pool = ChunkPool::Create(SmallPool());
  ASSERT_TRUE(pool.ok()) << pool.status().ToString();
  ChunkPool& p = **pool;
  auto a = p.Take(2, 7);
  ASSERT_TRUE(a.ok());
  const std::vector<uint32_t> twice{(*a)[0], (*a)[1], (*a)[0]};
  EXPECT_EQ(p.Return(twice, 7).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(p.free_count(), 2u) << "nothing was returned";
  ASSERT_TRUE(p.Return(*a, 7).ok());
  EXPECT_EQ(p.free_count(), 4u);
  const Status again = p.Return(*a, 7);
  EXPECT_EQ(again.code(), StatusCode::kFailedPrecondition) << again.ToString();
  EXPECT_NE(again.message().find("is not taken (free)"), std::string::npos) << again.ToString();
  auto b = p.Take(2, 8);
  auto c = p.Take(2, 9);
  ASSERT_TRUE(b.ok() && c.ok());
  for (uint32_t id : *b) EXPECT_EQ(std::count(c->begin(), c->end(), id), 0) << "chunk " << id << " given twice";
}

// The pool reports how the kernel maps its chunks: pre-faulted, every byte is resident; of them,
// the huge-page bytes (whole 2 MiB pages, none with huge_pages off and 1 MiB chunks too small for
// one) never exceed it.
TEST(ChunkPoolTest, ReportsItsChunksResidentAndTheirHugePages) {
  auto pool = ChunkPool::Create(SmallPool());
  ASSERT_TRUE(pool.ok()) << pool.status().ToString();
  const HostMapping m = (*pool)->mapping();
  EXPECT_EQ(m.resident, int64_t{4} << 20) << "pre-faulted chunks are resident";
  EXPECT_EQ(m.huge, 0) << "1 MiB chunks hold no 2 MiB page";
  ChunkPoolOptions big = SmallPool();
  big.pool_bytes = 16 << 20;
  big.chunk_bytes = 4 << 20;
  auto huge = ChunkPool::Create(big);
  ASSERT_TRUE(huge.ok()) << huge.status().ToString();
  const HostMapping h = (*huge)->mapping();
  EXPECT_EQ(h.resident, int64_t{16} << 20);
  EXPECT_GE(h.huge, 0);
  EXPECT_LE(h.huge, h.resident);
  EXPECT_EQ(h.huge % (int64_t{2} << 20), 0) << "huge pages come whole";
}

// One owner cannot free another's chunks: a Return naming any chunk of another owner changes
// nothing, and the owner's own Return still works.
TEST(ChunkPoolTest, AnotherOwnersChunksAreRefusedBeforeAnyReturn) {
  auto pool = ChunkPool::Create(SmallPool());
  ASSERT_TRUE(pool.ok()) << pool.status().ToString();
  ChunkPool& p = **pool;
  auto mine = p.Take(1, 7);
  auto theirs = p.Take(2, 8);
  ASSERT_TRUE(mine.ok() && theirs.ok());
  const std::vector<uint32_t> mixed{(*mine)[0], (*theirs)[1]};
  const Status refused = p.Return(mixed, 7);
  EXPECT_EQ(refused.code(), StatusCode::kPermissionDenied) << refused.ToString();
  EXPECT_NE(refused.message().find("belongs to owner 8"), std::string::npos) << refused.ToString();
  EXPECT_EQ(p.Return(*theirs, 7).code(), StatusCode::kPermissionDenied);
  EXPECT_EQ(p.free_count(), 1u) << "nothing was returned";
  std::memset(p.data((*theirs)[0]), 0x5A, p.chunk_bytes());
  ASSERT_TRUE(p.Return(*mine, 7).ok());
  EXPECT_EQ(p.data((*theirs)[0])[0], 0x5A) << "the other owner's memory was not touched";
  ASSERT_TRUE(p.Return(*theirs, 8).ok());
  EXPECT_EQ(p.free_count(), 4u);
}

TEST(ChunkPoolTest, TakesWholeChunksAndZeroesThemOnReturn) {
  auto pool = ChunkPool::Create(SmallPool());
  ASSERT_TRUE(pool.ok()) << pool.status().ToString();
  ChunkPool& p = **pool;
  EXPECT_EQ(p.chunk_count(), 4u);
  auto a = p.Take(3, 7);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(p.free_count(), 1u);
  EXPECT_EQ(p.Take(2, 8).status().code(), StatusCode::kResourceExhausted);
  std::memset(p.data((*a)[0]), 0xAB, p.chunk_bytes());
  ASSERT_TRUE(p.Return(*a, 7).ok());
  EXPECT_EQ(p.free_count(), 4u);
  EXPECT_EQ(p.replaced_chunks(), 0u) << "nobody else held them: zeroed, not replaced";
  auto b = p.Take(4, 9);
  ASSERT_TRUE(b.ok());
  for (uint32_t c : *b) {
    const uint8_t* d = p.data(c);
    for (uint64_t i = 0; i < p.chunk_bytes(); i += 4093) ASSERT_EQ(d[i], 0) << "chunk " << c << " byte " << i;
  }
  EXPECT_EQ(ChunkPool::Create({1 << 20, 1000, 1, true}).status().code(), StatusCode::kInvalidArgument);
}

// A chunk never handed to a client (a remote session's, a session that never attached) can only
// be held by the daemon itself: it comes back free at once, without the lease probe, which
// where leases do not work (fs.leases-enable = 0, some sandboxes) counts every chunk as held and,
// with no pidfd of its holder, retained it for good. Here the daemon's own extra open file of it
// (opened through /proc/self/fd, as no client can) stands in for what the probe would report.
TEST(ChunkPoolTest, AChunkNeverSharedComesBackWithoutTheProbe) {
  auto pool = ChunkPool::Create(SmallPool());
  ASSERT_TRUE(pool.ok()) << pool.status().ToString();
  ChunkPool& p = **pool;
  auto taken = p.Take(1, 7);
  ASSERT_TRUE(taken.ok());
  const uint32_t chunk = (*taken)[0];
  const int own = open(("/proc/self/fd/" + std::to_string(p.fd(chunk))).c_str(), O_RDWR | O_CLOEXEC);
  ASSERT_GE(own, 0);
  const auto start = std::chrono::steady_clock::now();
  ASSERT_TRUE(p.Return(*taken, 7).ok());
  EXPECT_EQ(p.replaced_chunks(), 0u) << "never shared: scrubbed and free, not probed and replaced";
  EXPECT_EQ(p.free_count(), p.chunk_count());
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(ChunkPool::kLetGoMs))
      << "no wait for a holder to let go";
  close(own);
  // Shared once, the probe decides again: an open file outside makes the chunk replaced.
  taken = p.Take(1, 8);
  ASSERT_TRUE(taken.ok());
  auto shared = p.ShareFd((*taken)[0]);
  ASSERT_TRUE(shared.ok());
  ASSERT_TRUE(p.Return(*taken, 8).ok());
  EXPECT_EQ(p.replaced_chunks(), 1u);
  close(*shared);
}

// A client that keeps only a path to its chunk (an O_PATH descriptor: no open file, so the lease
// probe does not see it) lets the chunk come back scrubbed, and the next owner gets the same file.
// The file is the daemon user's alone (mode 0600), so for any other user that path opens nothing;
// at 0777, the memfd's own mode, it opened the next tenant's pages for reading and writing.
TEST(ChunkPoolTest, APathKeptToAReturnedChunkOpensNothingForAnotherUser) {
  OneSharedChunk s;
  ASSERT_TRUE(ShareOneChunk(&s));
  struct stat st {};
  ASSERT_EQ(fstat(s.fd, &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0600u);
  EXPECT_EQ(st.st_uid, geteuid());
  const int path = open(("/proc/self/fd/" + std::to_string(s.fd)).c_str(), O_PATH | O_CLOEXEC);
  ASSERT_GE(path, 0);
  ASSERT_TRUE(ReturnUnheldAndTakeAgain(&s)) << "a path is no open file";
  if (geteuid() == 0) {  // as root, another user is a child that drops root (else the mode is the check)
    const std::string link = "/proc/self/fd/" + std::to_string(path);
    const pid_t child = fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
      if (setresgid(65534, 65534, 65534) != 0 || setresuid(65534, 65534, 65534) != 0) _exit(2);
      const int fd = open(link.c_str(), O_RDONLY | O_CLOEXEC);
      _exit(fd < 0 && errno == EACCES ? 0 : 1);
    }
    int status = 0;
    ASSERT_EQ(waitpid(child, &status, 0), child);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
        << "the other user's open of the kept path: exit " << WEXITSTATUS(status) << " (1: it opened)";
  }
  close(path);
  ASSERT_TRUE(s.pool->Return(std::span<const uint32_t>(&s.chunk, 1), 8).ok());
}

// A process can keep a chunk's pages without any open file or mapping of it: spliced into a pipe
// (vmsplice), registered as io_uring or RDMA buffers. Zeroing the same pages on return handed them
// to the next owner with that process still reading (and, for some registrations, writing) them;
// a returned chunk now gets fresh pages, and such a holder keeps only its own old data.
TEST(ChunkPoolTest, PagesSplicedAwayBeforeAReturnNeverSeeTheNextOwnersData) {
  // The first owner maps the chunk (its own open file, as a client does), writes and splices the
  // first page into a pipe, then lets go of the file and the mapping: nothing tells the pool.
  OneSharedChunk s;
  ASSERT_TRUE(ShareOneChunk(&s));
  ChunkPool& p = *s.pool;
  const uint32_t chunk = s.chunk;
  auto* mine = static_cast<uint8_t*>(mmap(nullptr, p.chunk_bytes(), PROT_READ | PROT_WRITE, MAP_SHARED, s.fd, 0));
  ASSERT_NE(mine, MAP_FAILED);
  std::memset(mine, 0x11, 4096);
  int pipe_fds[2];
  ASSERT_EQ(pipe(pipe_fds), 0);
  iovec page{mine, 4096};
  ASSERT_EQ(vmsplice(pipe_fds[1], &page, 1, 0), 4096);
  munmap(mine, p.chunk_bytes());
  ASSERT_TRUE(ReturnUnheldAndTakeAgain(&s));
  // The next owner gets zeroed memory and writes its data there.
  for (uint64_t i = 0; i < p.chunk_bytes(); i += 4093) ASSERT_EQ(p.data(chunk)[i], 0) << i;
  std::memset(p.data(chunk), 0x22, 4096);
  std::vector<uint8_t> spliced(4096);
  ASSERT_EQ(read(pipe_fds[0], spliced.data(), spliced.size()), 4096);
  close(pipe_fds[0]);
  close(pipe_fds[1]);
  EXPECT_EQ(spliced, std::vector<uint8_t>(4096, 0x11)) << "the pipe's page is the first owner's old one";
}

// A holder letting go while the chunk comes back (the attach thread closing its copy of a
// descriptor it sent, racing the client's close request) is waited for, within kLetGoMs: the
// chunk is zeroed and reused, not replaced and charged.
// With huge_pages, chunks of 2 MiB or more start on 2 MiB boundaries (so the kernel can back them
// by huge pages where its shmem setting allows), a replaced chunk too, and still read and write as
// before; smaller chunks and huge_pages = false keep the page alignment.
TEST(ChunkPoolTest, HugePageChunksStartOnTwoMiBBoundaries) {
  constexpr uint64_t kHuge = uint64_t{2} << 20;
  for (const bool huge : {true, false}) {
    auto pool = ChunkPool::Create({3 * (uint64_t{4} << 20), uint64_t{4} << 20, 2, false, huge});
    ASSERT_TRUE(pool.ok()) << pool.status().ToString();
    ChunkPool& p = **pool;
    auto a = p.Take(3, 7);
    ASSERT_TRUE(a.ok());
    for (uint32_t c : *a) {
      if (huge) {
        EXPECT_EQ(reinterpret_cast<uintptr_t>(p.data(c)) % kHuge, 0u) << "chunk " << c;
      }
      std::memset(p.data(c), 0x5A, p.chunk_bytes());
    }
    auto held = p.ShareFd((*a)[0]);  // held elsewhere: its return makes a new chunk
    ASSERT_TRUE(held.ok());
    void* mapped = mmap(nullptr, p.chunk_bytes(), PROT_READ, MAP_SHARED, *held, 0);
    ASSERT_NE(mapped, MAP_FAILED);
    ASSERT_TRUE(p.Return(*a, 7).ok());
    EXPECT_EQ(p.replaced_chunks(), 1u);
    auto b = p.Take(3, 8);
    ASSERT_TRUE(b.ok());
    for (uint32_t c : *b) {
      if (huge) {
        EXPECT_EQ(reinterpret_cast<uintptr_t>(p.data(c)) % kHuge, 0u) << "chunk " << c << " after the return";
      }
      for (uint64_t i = 0; i < p.chunk_bytes(); i += 4093) ASSERT_EQ(p.data(c)[i], 0) << "chunk " << c << " byte " << i;
    }
    EXPECT_EQ(static_cast<const uint8_t*>(mapped)[123], 0x5A) << "the holder's memory is its own";
    munmap(mapped, p.chunk_bytes());
    close(*held);
  }
  auto small = ChunkPool::Create({uint64_t{1} << 20, uint64_t{256} << 10, 1, false, true});
  ASSERT_TRUE(small.ok());
  EXPECT_EQ(reinterpret_cast<uintptr_t>((*small)->data(0)) % 4096, 0u);
}

TEST(ChunkPoolTest, AHolderLettingGoDuringTheReturnIsWaitedFor) {
  auto pool = ChunkPool::Create(SmallPool());
  ASSERT_TRUE(pool.ok());
  ChunkPool& p = **pool;
  auto a = p.Take(2, 7);
  ASSERT_TRUE(a.ok());
  auto shared = p.ShareFd((*a)[1]);
  ASSERT_TRUE(shared.ok()) << shared.status().ToString();
  std::thread closer([fd = *shared] {
    std::this_thread::sleep_for(std::chrono::milliseconds(ChunkPool::kLetGoMs / 5));
    close(fd);
  });
  const Status returned = p.Return(*a, 7, /*holder=*/3);
  closer.join();
  ASSERT_TRUE(returned.ok()) << returned.ToString();
  EXPECT_EQ(p.replaced_chunks(), 0u);
  EXPECT_EQ(p.retained_bytes(3), 0u);
  EXPECT_EQ(p.free_count(), p.chunk_count());
}

TEST(ChunkPoolTest, AChunkStillMappedElsewhereGetsNewMemoryAndStaysChargedUntilReleased) {
  auto pool = ChunkPool::Create(SmallPool());
  ASSERT_TRUE(pool.ok());
  ChunkPool& p = **pool;
  auto a = p.Take(1, 7);
  ASSERT_TRUE(a.ok());
  // The "client" maps its own open file of the chunk, closes the descriptor and keeps the mapping.
  auto shared = p.ShareFd((*a)[0]);
  ASSERT_TRUE(shared.ok()) << shared.status().ToString();
  void* client = mmap(nullptr, p.chunk_bytes(), PROT_READ | PROT_WRITE, MAP_SHARED, *shared, 0);
  ASSERT_NE(client, MAP_FAILED);
  close(*shared);
  std::memset(client, 0x5A, p.chunk_bytes());
  ASSERT_TRUE(p.Return(*a, 7, /*holder=*/3).ok());
  EXPECT_EQ(p.replaced_chunks(), 1u);
  EXPECT_EQ(p.retained_bytes(3), p.chunk_bytes()) << "the old memory is charged to its holder";
  EXPECT_EQ(p.retained_bytes(4), 0u);
  auto b = p.Take(4, 8);
  ASSERT_TRUE(b.ok());
  // The next owner sees zeros, and writes of the old mapping do not reach it.
  std::memset(client, 0x77, p.chunk_bytes());
  for (uint32_t c : *b) EXPECT_EQ(p.data(c)[12345], 0);
  p.Housekeep();
  EXPECT_EQ(p.retained_bytes(3), p.chunk_bytes()) << "still mapped";
  munmap(client, p.chunk_bytes());
  p.Housekeep();
  EXPECT_EQ(p.retained_bytes(3), 0u) << "released once nobody maps it";
  EXPECT_EQ(p.retained_bytes(), 0u);
}

TEST(SessionPagesTest, PublishesPagesInTheSharedTableAndKeepsThemInsideTheChunks) {
  auto pool = ChunkPool::Create(SmallPool());
  ASSERT_TRUE(pool.ok());
  auto chunks = (*pool)->Take(2, 1);
  ASSERT_TRUE(chunks.ok());
  auto pages = SessionPages::Create(1, pool->get(), *chunks, {8, 4096});
  ASSERT_TRUE(pages.ok()) << pages.status().ToString();
  SessionPages& s = **pages;
  const PageLayout layout{4, 2, 64, 16, 200};  // 8 KiB pages, 13 pages per layer at capacity
  auto seq = s.CreateSequence(42, layout);
  ASSERT_TRUE(seq.ok()) << seq.status().ToString();
  EXPECT_EQ(*s.Extend(42, 40), 3u);   // published in two steps: the second writes only pages 3..6
  EXPECT_EQ(*s.Extend(42, 100), 7u);
  EXPECT_EQ(*s.Extend(42, 50), 7u);  // never shrinks
  EXPECT_EQ(s.page_count(), 28u);
  EXPECT_EQ(s.Extend(42, 201).status().code(), StatusCode::kOutOfRange);

  // A reader of the shared table sees the same pages, and they are distinct and inside chunks.
  void* table = mmap(nullptr, s.table_bytes(), PROT_READ, MAP_SHARED, s.table_fd(), 0);
  ASSERT_NE(table, MAP_FAILED);
  const auto counts = shm::ReadTable(table, s.table_bytes());
  ASSERT_TRUE(counts.ok()) << counts.status().ToString();
  const uint32_t slot = (*seq)->slot;
  ASSERT_TRUE(shm::ValidateSlot(table, *counts, slot, true).ok());
  const shm::SequenceSlot& sl = shm::Slots(table)[slot];
  EXPECT_EQ(sl.pages_per_layer.load(), 7u);
  // The copy a reader uses (each field read once, then checked): the slot's own values.
  auto fields = shm::ReadSlot(table, *counts, slot, true);
  ASSERT_TRUE(fields.ok()) << fields.status().ToString();
  EXPECT_EQ(fields->sequence_id, 42u);
  EXPECT_EQ(fields->n_layers, 4u);
  EXPECT_EQ(fields->n_kv_heads, 2u);
  EXPECT_EQ(fields->head_dim, 64u);
  EXPECT_EQ(fields->page_tokens, 16u);
  EXPECT_EQ(fields->capacity_tokens, 200u);
  EXPECT_EQ(fields->pages_capacity_per_layer, 13u);
  EXPECT_EQ(fields->pages_per_layer, 7u);
  EXPECT_EQ(fields->first_ref, sl.first_ref);
  EXPECT_EQ(fields->page_bytes, 8192u);
  std::set<std::pair<uint32_t, uint64_t>> seen;
  for (uint32_t l = 0; l < 4; ++l) {
    for (uint32_t p = 0; p < 7; ++p) {
      const shm::PageRef& r = shm::Refs(table, counts->slot_count)[sl.first_ref + l * sl.pages_capacity_per_layer + p];
      EXPECT_TRUE(seen.insert({r.chunk, r.offset}).second);
      EXPECT_EQ(r.chunk, s.sequences().at(42).pages[l][p].chunk);
      EXPECT_EQ(r.offset, s.sequences().at(42).pages[l][p].offset);
    }
  }
  // A writable mapping of the table is refused (F_SEAL_FUTURE_WRITE, Linux >= 5.1).
  void* w = mmap(nullptr, s.table_bytes(), PROT_READ | PROT_WRITE, MAP_SHARED, s.table_fd(), 0);
  EXPECT_EQ(w, MAP_FAILED);
  if (w != MAP_FAILED) munmap(w, s.table_bytes());

  // Memory runs out: all or nothing.
  const uint64_t before = s.page_count();
  ASSERT_TRUE(s.CreateSequence(43, {4, 2, 64, 64, 1 << 14}).ok());
  EXPECT_EQ(s.Extend(43, 1 << 14).status().code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(s.page_count(), before);
  ASSERT_TRUE(s.Release(42).ok());
  EXPECT_EQ(shm::ValidateSlot(table, *counts, slot, true).code(), StatusCode::kNotFound);
  EXPECT_EQ(shm::ReadSlot(table, *counts, slot, true).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(s.Release(42).code(), StatusCode::kNotFound);
  EXPECT_EQ(s.page_count(), 0u);
  EXPECT_EQ(s.CreateSequence(44, {0, 2, 64, 16, 100}).status().code(), StatusCode::kInvalidArgument);
  munmap(table, s.table_bytes());
}

// A release in steps: a retired sequence is gone from the table and its slot is free at once,
// while its pages stay held (no other sequence gets them, they still count) until zeroed and freed.
TEST(SessionPagesTest, RetiredPagesStayHeldUntilZeroedAndFreed) {
  auto pool = ChunkPool::Create(SmallPool());
  ASSERT_TRUE(pool.ok());
  auto chunks = (*pool)->Take(1, 1);
  ASSERT_TRUE(chunks.ok());
  auto pages = SessionPages::Create(1, pool->get(), *chunks, {2, 4096});
  ASSERT_TRUE(pages.ok()) << pages.status().ToString();
  SessionPages& s = **pages;
  const PageLayout layout{2, 1, 64, 16, 64};  // 4 KiB pages (K and V rows of 16 tokens), 4 per layer
  const uint64_t chunk_bytes = (*pool)->chunk_bytes();
  // The whole chunk in one sequence: nothing is left for it until the retired pages are freed.
  const PageLayout whole{1, 1, 64, 16, static_cast<uint32_t>(chunk_bytes / 4096 * 16)};
  ASSERT_TRUE(s.CreateSequence(1, layout).ok());
  ASSERT_EQ(*s.Extend(1, 64), 4u);
  const uint32_t old_slot = s.Find(1)->slot;
  std::vector<uint8_t*> written;
  for (const auto& layer : s.Find(1)->pages) {
    for (const shm::PageRef& r : layer) written.push_back((*pool)->data((*chunks)[r.chunk]) + r.offset);
  }
  for (uint8_t* page : written) std::memset(page, 0x5a, layout.page_bytes());
  const uint64_t used = s.used_bytes();

  auto retired = s.Retire(1);
  ASSERT_TRUE(retired.ok()) << retired.status().ToString();
  EXPECT_EQ(retired->page_bytes, layout.page_bytes());
  ASSERT_EQ(retired->refs.size(), 8u);
  EXPECT_EQ(retired->data, written) << "the pages in layer-major order, at the daemon's own addresses";
  EXPECT_EQ(s.Find(1), nullptr);
  EXPECT_EQ(s.Retire(1).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(s.Release(1).code(), StatusCode::kNotFound);
  EXPECT_EQ(s.used_bytes(), used) << "held until freed";
  EXPECT_EQ(s.page_count(), 8u);
  auto next = s.CreateSequence(2, whole);  // the slot is free again; the pages are not
  ASSERT_TRUE(next.ok()) << next.status().ToString();
  EXPECT_EQ((*next)->slot, old_slot);
  const auto full = s.Extend(2, whole.capacity_tokens);
  EXPECT_EQ(full.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(full.status().message().find("32768 bytes of released sequences are still being zeroed"), std::string::npos)
      << full.status().ToString();
  EXPECT_EQ(written.front()[0], 0x5a) << "Retire zeroes nothing";

  retired->Zero();
  for (const uint8_t* page : written) {
    for (uint64_t b = 0; b < layout.page_bytes(); ++b) ASSERT_EQ(page[b], 0) << "byte " << b << " of a retired page";
  }
  EXPECT_EQ(s.page_count(), 8u) << "still held until freed";
  s.Free(*retired);
  EXPECT_EQ(s.page_count(), 0u);
  EXPECT_EQ(s.used_bytes(), 0u);
  EXPECT_EQ(*s.Extend(2, whole.capacity_tokens), chunk_bytes / 4096) << "the whole chunk is free again";
}

}  // namespace
}  // namespace specache
