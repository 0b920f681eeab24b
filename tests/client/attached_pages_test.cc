// The client's checks of what a daemon maps into it at attach (attached_pages.h), against memfds
// the test makes and writes as a daemon would, or as a faulty one might: no daemon runs.
#include "attached_pages.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <vector>

#include <gtest/gtest.h>

namespace specache::client {
namespace {

constexpr uint64_t kChunkBytes = 4096;
// 2 layers x 1 KV head x head_dim 8, pages of 4 tokens, 8 tokens: 2 pages a layer of 128 bytes.
const PageLayoutSpec kLayout{2, 1, 8, 4, 8};
constexpr uint32_t kSlots = 2, kRefs = 8;

// A memfd of `bytes`, sealed against shrinking and growing unless `sealed` is false.
int MemFd(uint64_t bytes, bool sealed = true) {
  const int fd = memfd_create("attached-pages-test", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  EXPECT_GE(fd, 0);
  EXPECT_EQ(ftruncate(fd, static_cast<off_t>(bytes)), 0);
  if (sealed) {
    EXPECT_EQ(fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW), 0);
  }
  return fd;
}

// What a daemon passes at attach: the table (written through the test's own mapping, as the
// daemon keeps writing it) and one chunk, with the first reply message.
struct FakeAttach {
  int table_fd = -1, chunk_fd = -1;
  uint8_t* table = nullptr;
  attach::AttachReply reply;

  explicit FakeAttach(bool seal_table = true, uint64_t chunk_file_bytes = kChunkBytes, bool seal_chunk = true) {
    const size_t bytes = shm::TableBytes(kSlots, kRefs);
    table_fd = MemFd(bytes, seal_table);
    chunk_fd = MemFd(chunk_file_bytes, seal_chunk);
    table = static_cast<uint8_t*>(mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, table_fd, 0));
    EXPECT_NE(table, MAP_FAILED);
    auto* h = reinterpret_cast<shm::TableHeader*>(table);
    h->magic = shm::kTableMagic;
    h->version = shm::kTableVersion;
    h->header_bytes = sizeof(shm::TableHeader);
    h->slot_bytes = sizeof(shm::SequenceSlot);
    h->slot_count = kSlots;
    h->ref_count = kRefs;
    h->total_bytes = bytes;
    h->chunk_bytes = kChunkBytes;
    h->chunk_count = 1;
    // Slot 1 holds sequence 7 with one page a layer published; its refs start at 2.
    shm::SequenceSlot& s = slot(1);
    s.n_layers = kLayout.n_layers;
    s.n_kv_heads = kLayout.n_kv_heads;
    s.head_dim = kLayout.head_dim;
    s.page_tokens = kLayout.page_tokens;
    s.capacity_tokens = kLayout.capacity_tokens;
    s.pages_capacity_per_layer = 2;
    s.sequence_id = 7;
    s.page_bytes = kLayout.page_bytes();
    s.first_ref = 2;
    for (uint32_t r = 0; r < kRefs; ++r) refs()[r] = {0, 0, uint64_t{r} * kLayout.page_bytes()};
    s.pages_per_layer.store(1);
    s.state.store(shm::kSlotLive);
    reply.total_fds = reply.n_fds = 2;
    reply.table_bytes = bytes;
    reply.chunk_bytes = kChunkBytes;
  }
  ~FakeAttach() {
    munmap(table, shm::TableBytes(kSlots, kRefs));
    close(table_fd);
    close(chunk_fd);
  }
  shm::SequenceSlot& slot(uint32_t i) {
    return reinterpret_cast<shm::SequenceSlot*>(table + sizeof(shm::TableHeader))[i];
  }
  shm::PageRef* refs() {
    return reinterpret_cast<shm::PageRef*>(table + sizeof(shm::TableHeader) + kSlots * sizeof(shm::SequenceSlot));
  }
  std::vector<int> fds() const { return {table_fd, chunk_fd}; }
  Result<std::unique_ptr<AttachedPages>> Map() const { return AttachedPages::Map(reply, fds(), 1); }
};

TEST(AttachedPagesTest, APageIsTheChunkMemoryItsRefNames) {
  FakeAttach daemon;
  auto pages = daemon.Map();
  ASSERT_TRUE(pages.ok()) << pages.status().ToString();
  ASSERT_TRUE((*pages)->AddSlot(7, 1, kLayout).ok());
  EXPECT_EQ((*pages)->chunk_count(), 1u);
  EXPECT_EQ((*pages)->chunk_bytes(), kChunkBytes);
  EXPECT_EQ((*pages)->chunk(1), nullptr);

  // Layer 1's first page: ref 2 + 1 x 2 = 4, at 4 x 128 bytes into the chunk. What the engine
  // writes there is what the daemon reads from its own descriptor.
  auto page = (*pages)->PageData(7, 1, 0);
  ASSERT_TRUE(page.ok()) << page.status().ToString();
  EXPECT_EQ(*page, (*pages)->chunk(0) + 4 * kLayout.page_bytes());
  std::memset(*page, 0x5a, kLayout.page_bytes());
  std::vector<uint8_t> read(kLayout.page_bytes());
  ASSERT_EQ(pread(daemon.chunk_fd, read.data(), read.size(), 4 * kLayout.page_bytes()), ssize_t(read.size()));
  EXPECT_EQ(read, std::vector<uint8_t>(read.size(), 0x5a));

  EXPECT_EQ((*pages)->PageData(7, 0, 1).status().code(), StatusCode::kOutOfRange);  // not published yet
  EXPECT_EQ((*pages)->PageData(7, 2, 0).status().code(), StatusCode::kOutOfRange);  // no layer 2
  EXPECT_EQ((*pages)->PageData(8, 0, 0).status().code(), StatusCode::kNotFound);
  daemon.slot(1).pages_per_layer.store(2);  // the daemon extends
  auto view = (*pages)->SlotOf(7);
  ASSERT_TRUE(view.ok());
  EXPECT_EQ((*pages)->LivePages(*view), 2u);
  EXPECT_TRUE((*pages)->Recheck(*view).ok());
  EXPECT_TRUE((*pages)->PageData(7, 0, 1).ok());
  (*pages)->Forget(7);
  EXPECT_EQ((*pages)->PageData(7, 0, 0).status().code(), StatusCode::kNotFound);
}

TEST(AttachedPagesTest, DescriptorsShorterThanSaidOrUnsealedAreRefused) {
  {
    FakeAttach unsealed_table(/*seal_table=*/false);
    auto pages = unsealed_table.Map();
    EXPECT_EQ(pages.status().code(), StatusCode::kDataLoss);
    EXPECT_NE(pages.status().message().find("not sealed"), std::string::npos) << pages.status().ToString();
  }
  {
    FakeAttach unsealed_chunk(true, kChunkBytes, /*seal_chunk=*/false);
    EXPECT_EQ(unsealed_chunk.Map().status().code(), StatusCode::kDataLoss);
  }
  {
    FakeAttach short_chunk(true, kChunkBytes / 2);
    auto pages = short_chunk.Map();
    EXPECT_EQ(pages.status().code(), StatusCode::kDataLoss);
    EXPECT_NE(pages.status().message().find("smaller"), std::string::npos) << pages.status().ToString();
  }
  FakeAttach daemon;
  EXPECT_EQ(AttachedPages::Map(daemon.reply, daemon.fds(), 2).status().code(), StatusCode::kDataLoss);  // count
  attach::AttachReply longer = daemon.reply;
  longer.table_bytes += 4096;  // more than the table's file holds
  EXPECT_EQ(AttachedPages::Map(longer, daemon.fds(), 1).status().code(), StatusCode::kDataLoss);
  attach::AttachReply shorter = daemon.reply;
  shorter.table_bytes -= sizeof(shm::PageRef);  // the header's total_bytes says otherwise
  EXPECT_EQ(AttachedPages::Map(shorter, daemon.fds(), 1).status().code(), StatusCode::kDataLoss);
  attach::AttachReply other_chunks = daemon.reply;
  other_chunks.chunk_bytes = kChunkBytes / 2;  // the header says kChunkBytes
  EXPECT_EQ(AttachedPages::Map(other_chunks, daemon.fds(), 1).status().code(), StatusCode::kDataLoss);
  reinterpret_cast<shm::TableHeader*>(daemon.table)->magic = 0;
  EXPECT_EQ(daemon.Map().status().code(), StatusCode::kDataLoss);
}

TEST(AttachedPagesTest, ASlotMustDescribeTheSequenceAndLayoutAskedFor) {
  FakeAttach daemon;
  auto pages = daemon.Map();
  ASSERT_TRUE(pages.ok()) << pages.status().ToString();
  AttachedPages& p = **pages;
  EXPECT_EQ(p.AddSlot(7, kSlots, kLayout).code(), StatusCode::kDataLoss);  // no such slot
  EXPECT_EQ(p.AddSlot(7, 0, kLayout).code(), StatusCode::kNotFound);       // a free slot
  EXPECT_EQ(p.AddSlot(8, 1, kLayout).code(), StatusCode::kDataLoss);       // another sequence's
  PageLayoutSpec other = kLayout;
  other.head_dim = 16;
  EXPECT_EQ(p.AddSlot(7, 1, other).code(), StatusCode::kDataLoss);
  other = kLayout;
  other.capacity_tokens = 12;  // 3 pages a layer, the slot has 2
  EXPECT_EQ(p.AddSlot(7, 1, other).code(), StatusCode::kDataLoss);
  other = kLayout;
  other.n_layers = 1;
  EXPECT_EQ(p.AddSlot(7, 1, other).code(), StatusCode::kDataLoss);
  // A published ref past the chunk's end.
  daemon.refs()[2].offset = kChunkBytes - kLayout.page_bytes() + 1;
  EXPECT_EQ(p.AddSlot(7, 1, kLayout).code(), StatusCode::kDataLoss);
  daemon.refs()[2].offset = 0;
  // Refs outside the table's.
  daemon.slot(1).first_ref = kRefs - 1;
  EXPECT_EQ(p.AddSlot(7, 1, kLayout).code(), StatusCode::kDataLoss);
  daemon.slot(1).first_ref = 2;
  EXPECT_TRUE(p.AddSlot(7, 1, kLayout).ok());
}

TEST(AttachedPagesTest, ASlotRewrittenAfterItWasAddedCannotMoveALookupOutside) {
  FakeAttach daemon;
  auto pages = daemon.Map();
  ASSERT_TRUE(pages.ok()) << pages.status().ToString();
  AttachedPages& p = **pages;
  ASSERT_TRUE(p.AddSlot(7, 1, kLayout).ok());
  auto view = p.SlotOf(7);
  ASSERT_TRUE(view.ok());

  // Geometry rewritten in the table: the lookup keeps the one checked at AddSlot.
  daemon.slot(1).pages_capacity_per_layer = 1000;
  daemon.slot(1).first_ref = 1u << 30;
  auto page = p.PageData(7, 1, 0);
  ASSERT_TRUE(page.ok()) << page.status().ToString();
  EXPECT_EQ(*page, p.chunk(0) + 4 * kLayout.page_bytes());
  // More pages published than the slot's capacity: capped.
  daemon.slot(1).pages_per_layer.store(1000);
  EXPECT_EQ(p.LivePages(*view), 2u);
  EXPECT_EQ(p.PageData(7, 0, 2).status().code(), StatusCode::kOutOfRange);
  EXPECT_EQ(p.Recheck(*view).code(), StatusCode::kDataLoss);
  daemon.slot(1).pages_per_layer.store(1);
  // A ref moved outside the chunk after the check.
  daemon.refs()[4] = {3, 0, 0};
  EXPECT_EQ(p.PageData(7, 1, 0).status().code(), StatusCode::kDataLoss);
  daemon.refs()[4] = {0, 0, kChunkBytes};
  EXPECT_EQ(p.PageData(7, 1, 0).status().code(), StatusCode::kDataLoss);
  // The slot released, or reused for another sequence.
  daemon.slot(1).sequence_id = 9;
  EXPECT_EQ(p.PageData(7, 0, 0).status().code(), StatusCode::kNotFound);
  daemon.slot(1).sequence_id = 7;
  daemon.slot(1).state.store(shm::kSlotFree);
  EXPECT_EQ(p.PageData(7, 0, 0).status().code(), StatusCode::kNotFound);
}

// The table's header rewritten after Map (it is the daemon's memory) moves no lookup outside the
// table Map checked: a slot past the checked count is refused, and a slot whose refs lie past the
// checked ref count too. Before, AddSlot and ReadSlot read the header's counts again each time.
TEST(AttachedPagesTest, AHeaderRewrittenAfterMapCannotMoveALookupOutside) {
  FakeAttach daemon;
  auto pages = daemon.Map();
  ASSERT_TRUE(pages.ok()) << pages.status().ToString();
  AttachedPages& p = **pages;
  auto* h = reinterpret_cast<shm::TableHeader*>(daemon.table);
  h->slot_count = 1000;
  h->ref_count = 1u << 20;
  EXPECT_EQ(p.AddSlot(7, 50, kLayout).code(), StatusCode::kDataLoss);  // slot 50: past the 2 checked
  daemon.slot(1).first_ref = 1000;  // refs [1000, 1004): past the 8 checked
  EXPECT_EQ(p.AddSlot(7, 1, kLayout).code(), StatusCode::kDataLoss);
  daemon.slot(1).first_ref = 2;
  ASSERT_TRUE(p.AddSlot(7, 1, kLayout).ok());
  // The refs are where Map found them (after 2 slots), not where a grown slot count would put them.
  auto page = p.PageData(7, 1, 0);
  ASSERT_TRUE(page.ok()) << page.status().ToString();
  EXPECT_EQ(*page, p.chunk(0) + 4 * kLayout.page_bytes());
}

}  // namespace
}  // namespace specache::client
