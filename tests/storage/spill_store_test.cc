// The RocksDB spill tier: round trips byte for byte, survives reopening, detects a corrupted or
// missing page (never returns it as data), cleans up unfinished spills, and fails cleanly when
// full (its own limit, or a disk that fills up) without storing half a sequence.
#include "specache/spill_store.h"

#include <sys/mount.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <random>
#include <vector>

#include <gtest/gtest.h>
#include <rocksdb/db.h>

#include "testing/temp_dir.h"

namespace specache {
namespace {

using testing::TempDir;

// A sequence's pages in memory: [layer][page] -> bytes.
struct Pages {
  SpilledSequence meta;
  std::vector<std::vector<std::vector<uint8_t>>> data;
  Pages(const std::string& tenant, uint64_t id, uint32_t layers, uint32_t pages, uint32_t seed) {
    meta.tenant = tenant;
    meta.id = id;
    meta.layout = {layers, 2, 64, 16, 1024};
    meta.pages_per_layer = pages;
    std::mt19937 rng(seed);
    data.assign(layers, std::vector<std::vector<uint8_t>>(pages, std::vector<uint8_t>(meta.layout.page_bytes())));
    for (auto& layer : data) {
      for (auto& page : layer) {
        for (auto& b : page) b = static_cast<uint8_t>(rng());
      }
    }
  }
  auto Reader() const {
    return [this](uint32_t l, uint32_t p) { return data[l][p].data(); };
  }
};

// Reads a stored sequence back into fresh pages of the same shape.
Status ReadBack(SpillStore& store, const Pages& like, std::vector<std::vector<std::vector<uint8_t>>>* out) {
  *out = like.data;
  for (auto& layer : *out) {
    for (auto& page : layer) std::fill(page.begin(), page.end(), 0);
  }
  return store.Get(like.meta.tenant, like.meta.id, [out](uint32_t l, uint32_t p) { return (*out)[l][p].data(); });
}

TEST(SpillStoreTest, RoundTripsAndSurvivesReopening) {
  TempDir dir;
  const Pages a1("alpha", 7, 3, 4, 1), a2("alpha", 9, 2, 1, 2), b1("beta", 7, 1, 5, 3);
  {
    auto store = SpillStore::Open({dir.path});
    ASSERT_TRUE(store.ok()) << store.status().ToString();
    for (const Pages* p : {&a1, &a2, &b1}) ASSERT_TRUE((*store)->Put(p->meta, p->Reader()).ok());
    EXPECT_EQ((*store)->Put(a1.meta, a1.Reader()).code(), StatusCode::kAlreadyExists);
    std::vector<std::vector<std::vector<uint8_t>>> back;
    ASSERT_TRUE(ReadBack(**store, a1, &back).ok());
    EXPECT_EQ(back, a1.data);
    EXPECT_EQ((*store)->List("alpha").size(), 2u);
    EXPECT_EQ((*store)->List().size(), 3u);
    const SpillStats s = (*store)->stats();
    EXPECT_EQ(s.stored_bytes, a1.meta.bytes() + a2.meta.bytes() + b1.meta.bytes());
    EXPECT_EQ(s.spills, 3u);
    EXPECT_EQ(s.restores, 1u);
  }
  auto store = SpillStore::Open({dir.path});  // a restarted daemon
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  ASSERT_EQ((*store)->List().size(), 3u);
  EXPECT_EQ((*store)->max_id(), 9u);
  auto found = (*store)->Find("beta", 7);
  ASSERT_TRUE(found.ok());
  EXPECT_EQ(found->fingerprint, LayoutFingerprint(b1.meta.layout));
  EXPECT_EQ(found->pages_per_layer, 5u);
  for (const Pages* p : {&a1, &a2, &b1}) {
    std::vector<std::vector<std::vector<uint8_t>>> back;
    ASSERT_TRUE(ReadBack(**store, *p, &back).ok());
    EXPECT_EQ(back, p->data) << p->meta.tenant << "/" << p->meta.id;
  }
  const SpillVerifyReport v = (*store)->Verify();
  EXPECT_EQ(v.pages_checked, 3u * 4 + 2 + 5);
  EXPECT_EQ(v.pages_bad, 0u);
  ASSERT_TRUE((*store)->Delete("alpha", 7).ok());
  EXPECT_EQ((*store)->Find("alpha", 7).status().code(), StatusCode::kNotFound);
  EXPECT_EQ((*store)->stats().stored_bytes, a2.meta.bytes() + b1.meta.bytes());
}

TEST(SpillStoreTest, ACorruptedPageIsReportedAndNeverServed) {
  TempDir dir;
  const Pages a("alpha", 3, 2, 3, 4);
  {
    auto store = SpillStore::Open({dir.path});
    ASSERT_TRUE(store.ok());
    ASSERT_TRUE((*store)->Put(a.meta, a.Reader()).ok());
  }
  {  // flip one byte of layer 1, page 2 behind the store's back
    rocksdb::DB* db = nullptr;
    ASSERT_TRUE(rocksdb::DB::Open(rocksdb::Options(), dir.path, &db).ok());
    std::unique_ptr<rocksdb::DB> owned(db);
    std::string key = std::string("palpha") + '\0' + "0000000000000003" + "00000001" + "00000002", value;
    ASSERT_TRUE(db->Get(rocksdb::ReadOptions(), key, &value).ok());
    value[100] ^= 0x40;
    ASSERT_TRUE(db->Put(rocksdb::WriteOptions(), key, value).ok());
    ASSERT_TRUE(db->Close().ok());
  }
  auto store = SpillStore::Open({dir.path});
  ASSERT_TRUE(store.ok());
  std::vector<std::vector<std::vector<uint8_t>>> back;
  const Status s = ReadBack(**store, a, &back);
  EXPECT_EQ(s.code(), StatusCode::kDataLoss);
  EXPECT_NE(s.message().find("alpha/3/layer 1/page 2"), std::string::npos) << s.ToString();
  EXPECT_NE(back[1][2], a.data[1][2]);  // the bad page was not copied out
  const SpillVerifyReport v = (*store)->Verify();
  EXPECT_EQ(v.pages_checked, 6u);
  EXPECT_EQ(v.pages_bad, 1u);
  ASSERT_EQ(v.bad.size(), 1u);
  EXPECT_NE(v.bad[0].find("alpha/3/1/2"), std::string::npos) << v.bad[0];
  EXPECT_GE((*store)->stats().checksum_failures, 2u);
}

TEST(SpillStoreTest, UnfinishedSpillsAreCleanedAndLimitsRefuseWholeSequences) {
  TempDir dir;
  {  // a page whose spill never wrote its metadata (a crash between the two)
    rocksdb::Options o;
    o.create_if_missing = true;
    rocksdb::DB* db = nullptr;
    ASSERT_TRUE(rocksdb::DB::Open(o, dir.path, &db).ok());
    std::unique_ptr<rocksdb::DB> owned(db);
    ASSERT_TRUE(db->Put(rocksdb::WriteOptions(), std::string("pghost") + '\0' + "0000000000000001" + "0000000000000000",
                        std::string(100, 'x'))
                    .ok());
    ASSERT_TRUE(db->Close().ok());
  }
  const Pages a("alpha", 1, 4, 4, 5);  // 16 pages of 4 KiB
  auto store = SpillStore::Open({dir.path, a.meta.bytes() + 4096});
  ASSERT_TRUE(store.ok());
  EXPECT_TRUE((*store)->List().empty());
  ASSERT_TRUE((*store)->Put(a.meta, a.Reader()).ok());
  const Pages b("alpha", 2, 1, 2, 6);
  EXPECT_EQ((*store)->Put(b.meta, b.Reader()).code(), StatusCode::kResourceExhausted);
  EXPECT_EQ((*store)->Find("alpha", 2).status().code(), StatusCode::kNotFound);
  store->reset();
  rocksdb::DB* db = nullptr;
  ASSERT_TRUE(rocksdb::DB::OpenForReadOnly(rocksdb::Options(), dir.path, &db).ok());
  std::unique_ptr<rocksdb::DB> owned(db);
  std::string value;
  EXPECT_TRUE(db->Get(rocksdb::ReadOptions(), std::string("pghost") + '\0' + "0000000000000001" + "0000000000000000",
                      &value)
                  .IsNotFound());
}

// A disk that fills up mid-spill (a 3 MiB tmpfs): a clear error, no partial sequence, and the
// store keeps working for what fits. Needs root to mount; skipped otherwise.
TEST(SpillStoreTest, ADiskThatFillsUpGivesAClearErrorAndStoresNothingPartial) {
  TempDir dir;
  if (geteuid() != 0 || mount("tmpfs", dir.path.c_str(), "tmpfs", 0, "size=3m") != 0) {
    GTEST_SKIP() << "cannot mount a small tmpfs here (needs root)";
  }
  struct Unmount {
    std::string path;
    ~Unmount() { umount2(path.c_str(), MNT_DETACH); }
  } unmount{dir.path};
  auto store = SpillStore::Open({dir.path + "/db"});
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  const Pages big("alpha", 1, 8, 64, 7);  // 8 x 64 x 4 KiB = 2 MiB, twice with the WAL and flushes
  const Pages big2("alpha", 2, 8, 64, 8);
  Status s = (*store)->Put(big.meta, big.Reader());
  if (s.ok()) s = (*store)->Put(big2.meta, big2.Reader());
  ASSERT_FALSE(s.ok()) << "3 MiB took 4 MiB of pages";
  std::printf("disk full: %s\n", s.ToString().c_str());
  EXPECT_TRUE(s.code() == StatusCode::kResourceExhausted || s.code() == StatusCode::kUnavailable) << s.ToString();
  EXPECT_NE(s.message().find("spill"), std::string::npos) << s.ToString();
  for (const SpilledSequence& m : (*store)->List()) {  // whatever is listed is complete
    std::vector<std::vector<std::vector<uint8_t>>> back;
    const Pages& p = m.id == 1 ? big : big2;
    ASSERT_TRUE(ReadBack(**store, p, &back).ok());
    EXPECT_EQ(back, p.data);
  }
  EXPECT_GE((*store)->stats().write_errors, 1u);
}

}  // namespace
}  // namespace specache
