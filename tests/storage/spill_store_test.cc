// The RocksDB spill tier: round trips byte for byte, survives reopening, detects a corrupted or
// missing page (never returns it as data), cleans up unfinished spills, and fails cleanly when
// full (its own limit, or a disk that fills up) without storing half a sequence. A flipped byte
// in the WAL or in an SST's metadata block is reported by name, never erases a sequence
// silently; verify reads the files, not a cache; files are private whatever the umask; writes
// resume once a full disk has room again, and a reopen after a write error does not wait for a
// whole verify. An I/O error is counted as a read error, not a checksum failure; a record verify
// cannot read is logged and kept among the problems.
#include "specache/spill_store.h"

#include <fcntl.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <thread>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>
#include <rocksdb/db.h>
#include <rocksdb/file_system.h>
#include <spdlog/sinks/ostream_sink.h>
#include <spdlog/spdlog.h>

#include "testing/temp_dir.h"

namespace specache {
namespace {

using testing::TempDir;

// A sequence's pages in memory: [layer][page] -> bytes.
struct Pages {
  SpilledSequence meta;
  std::vector<std::vector<std::vector<uint8_t>>> data;
  Pages(const std::string& tenant, uint64_t id, uint32_t layers, uint32_t pages, uint32_t seed,
        uint32_t row_format = shm::kRowFp16) {
    meta.tenant = tenant;
    meta.id = id;
    meta.layout = {layers, 2, 64, 16, 1024, row_format};
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

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Flips one bit of the byte at `offset` of `path`, in place (the file is not replaced).
void FlipByte(const std::string& path, size_t offset) {
  const int fd = open(path.c_str(), O_RDWR);
  ASSERT_GE(fd, 0) << path;
  char c = 0;
  ASSERT_EQ(pread(fd, &c, 1, static_cast<off_t>(offset)), 1);
  c ^= 0x10;
  ASSERT_EQ(pwrite(fd, &c, 1, static_cast<off_t>(offset)), 1);
  close(fd);
}

// The file in `dir` ending in `extension` that contains `needle`, and where: ("", npos) if none.
std::pair<std::string, size_t> FindBytes(const std::string& dir, const std::string& extension, const std::string& needle) {
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    if (e.path().extension() != extension) continue;
    const std::string bytes = ReadFile(e.path());
    const size_t at = bytes.find(needle);
    if (at != std::string::npos) return {e.path().string(), at};
  }
  return {"", std::string::npos};
}

std::string PageBytes(const Pages& p, uint32_t layer, uint32_t page, size_t n = 64) {
  return std::string(reinterpret_cast<const char*>(p.data[layer][page].data()), n);
}

bool Mentions(const std::vector<std::string>& lines, const std::string& what) {
  for (const std::string& l : lines) {
    if (l.find(what) != std::string::npos) return true;
  }
  return false;
}

std::string Joined(const std::vector<std::string>& lines) {
  std::string out;
  for (const std::string& l : lines) out += l + "\n";
  return out;
}

// Spills `pages` in a child process that then exits without closing the store: what it wrote is
// only in the WAL, as after a crash (or SIGKILL) of the daemon.
void SpillAndCrash(const std::string& dir, const std::vector<const Pages*>& pages) {
  const pid_t pid = fork();
  if (pid == 0) {
    auto store = SpillStore::Open({dir});
    if (!store.ok()) _exit(2);
    for (const Pages* p : pages) {
      if (!(*store)->Put(p->meta, p->Reader()).ok()) _exit(3);
    }
    _exit(0);
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
}

// Spills two small sequences, alpha/1 and beta/2, into a store at `dir`, and closes it.
void SpillAlphaAndBeta(const std::string& dir) {
  const Pages a("alpha", 1, 2, 2, 21), b("beta", 2, 1, 3, 22);
  auto store = SpillStore::Open({dir});
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  for (const Pages* p : {&a, &b}) ASSERT_TRUE((*store)->Put(p->meta, p->Reader()).ok());
}

// Flips a byte of alpha/1's metadata record (SpillAlphaAndBeta's) in its SST file: the block of
// the metadata records no longer checks out.
void FlipAlphasMetadata(const std::string& dir) {
  std::string needle(1, '\x05');  // the metadata value of alpha/1: ..., tenant size 5, "alpha", id 1
  needle += std::string(3, '\0') + "alpha" + '\x01';
  const auto [sst, at] = FindBytes(dir, ".sst", needle);
  ASSERT_NE(at, std::string::npos) << "alpha's metadata is in an SST file";
  FlipByte(sst, at + 5);
}

// The local file system, with the disk's failures on demand: SST reads that fail or are slow,
// WAL appends that fail.
class FaultyFileSystem final : public rocksdb::FileSystemWrapper {
 public:
  FaultyFileSystem() : rocksdb::FileSystemWrapper(rocksdb::FileSystem::Default()) {}
  const char* Name() const override { return "FaultyFileSystem"; }

  std::atomic<bool> fail_reads{false}, fail_writes{false};
  std::atomic<std::chrono::microseconds::rep> read_delay_us{0};  // before every SST read
  std::atomic<uint64_t> reads{0};                                // SST reads so far

  rocksdb::IOStatus NewRandomAccessFile(const std::string& f, const rocksdb::FileOptions& o,
                                        std::unique_ptr<rocksdb::FSRandomAccessFile>* r,
                                        rocksdb::IODebugContext* dbg) override {
    rocksdb::IOStatus s = target()->NewRandomAccessFile(f, o, r, dbg);
    if (s.ok() && f.ends_with(".sst")) *r = std::make_unique<Sst>(std::move(*r), this);
    return s;
  }
  rocksdb::IOStatus NewWritableFile(const std::string& f, const rocksdb::FileOptions& o,
                                    std::unique_ptr<rocksdb::FSWritableFile>* r, rocksdb::IODebugContext* dbg) override {
    rocksdb::IOStatus s = target()->NewWritableFile(f, o, r, dbg);
    if (s.ok() && f.ends_with(".log")) *r = std::make_unique<Wal>(std::move(*r), this);
    return s;
  }

 private:
  struct Sst final : rocksdb::FSRandomAccessFileOwnerWrapper {
    Sst(std::unique_ptr<rocksdb::FSRandomAccessFile> f, FaultyFileSystem* fs)
        : rocksdb::FSRandomAccessFileOwnerWrapper(std::move(f)), fs(fs) {}
    rocksdb::IOStatus Read(uint64_t offset, size_t n, const rocksdb::IOOptions& o, rocksdb::Slice* result,
                           char* scratch, rocksdb::IODebugContext* dbg) const override {
      ++fs->reads;
      std::this_thread::sleep_for(std::chrono::microseconds(fs->read_delay_us.load()));
      if (fs->fail_reads) return rocksdb::IOStatus::IOError("injected read error");
      return target()->Read(offset, n, o, result, scratch, dbg);
    }
    FaultyFileSystem* fs;
  };
  struct Wal final : rocksdb::FSWritableFileOwnerWrapper {
    Wal(std::unique_ptr<rocksdb::FSWritableFile> f, FaultyFileSystem* fs)
        : rocksdb::FSWritableFileOwnerWrapper(std::move(f)), fs(fs) {}
    rocksdb::IOStatus Append(const rocksdb::Slice& data, const rocksdb::IOOptions& o,
                             rocksdb::IODebugContext* dbg) override {
      if (fs->fail_writes) return rocksdb::IOStatus::IOError("injected write error");
      return target()->Append(data, o, dbg);
    }
    rocksdb::IOStatus Append(const rocksdb::Slice& data, const rocksdb::IOOptions& o,
                             const rocksdb::DataVerificationInfo& info, rocksdb::IODebugContext* dbg) override {
      if (fs->fail_writes) return rocksdb::IOStatus::IOError("injected write error");
      return target()->Append(data, o, info, dbg);
    }
    FaultyFileSystem* fs;
  };
};

// Spills `p` through `fs` and reopens the store: its pages are then in an SST file, and every
// read of them goes through `fs`.
Result<std::unique_ptr<SpillStore>> OpenWithPagesOnDisk(const std::string& dir, const std::shared_ptr<FaultyFileSystem>& fs,
                                                        const Pages& p) {
  {
    SPECACHE_ASSIGN_OR_RETURN(auto store, SpillStore::Open({dir, 0, false, fs}));
    SPECACHE_RETURN_IF_ERROR(store->Put(p.meta, p.Reader()));
  }
  return SpillStore::Open({dir, 0, false, fs});
}

// What the default logger writes while it lives.
struct CapturedLog {
  std::ostringstream text;
  std::shared_ptr<spdlog::logger> before = spdlog::default_logger();
  CapturedLog() {
    spdlog::set_default_logger(
        std::make_shared<spdlog::logger>("captured", std::make_shared<spdlog::sinks::ostream_sink_mt>(text)));
  }
  ~CapturedLog() { spdlog::set_default_logger(before); }
};

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

// A sequence's row format is part of its record and of its fingerprint (a claim matches it). fp16
// sequences are written as before there were row formats (version 1, no such field, the same
// fingerprint), so either daemon reads them; int8 ones as version 2 with the field.
TEST(SpillStoreTest, RowFormatsAreKeptAndFp16RecordsStayAsBeforeThem) {
  TempDir dir;
  const Pages int8_rows("alpha", 1, 2, 3, 1, shm::kRowInt8), fp16_rows("alpha", 2, 2, 3, 2);
  ASSERT_EQ(int8_rows.meta.layout.page_bytes(), 2u * 16 * (2 * 64 + 16));
  EXPECT_NE(LayoutFingerprint(int8_rows.meta.layout), LayoutFingerprint(fp16_rows.meta.layout));
  {
    auto store = SpillStore::Open({dir.path});
    ASSERT_TRUE(store.ok());
    ASSERT_TRUE((*store)->Put(int8_rows.meta, int8_rows.Reader()).ok());
    ASSERT_TRUE((*store)->Put(fp16_rows.meta, fp16_rows.Reader()).ok());
  }
  {  // the records as written: version, tenant size, "alpha", id, six fields, [row format], fingerprint, time
    rocksdb::DB* db = nullptr;
    ASSERT_TRUE(rocksdb::DB::Open(rocksdb::Options(), dir.path, &db).ok());
    std::unique_ptr<rocksdb::DB> owned(db);
    const size_t fields_end = 4 + 4 + 5 + 8 + 4 * 6;
    for (const auto& [id, version, size] : {std::tuple{1, 2u, fields_end + 4 + 16}, std::tuple{2, 1u, fields_end + 16}}) {
      std::string meta;
      ASSERT_TRUE(db->Get(rocksdb::ReadOptions(), std::string("malpha") + '\0' + "000000000000000" + char('0' + id), &meta).ok());
      uint32_t got = 0;
      std::memcpy(&got, meta.data(), 4);
      EXPECT_EQ(got, version) << "alpha/" << id;
      EXPECT_EQ(meta.size(), size) << "alpha/" << id;
    }
    ASSERT_TRUE(db->Close().ok());
  }
  auto store = SpillStore::Open({dir.path});
  ASSERT_TRUE(store.ok());
  EXPECT_TRUE((*store)->problems().empty()) << Joined((*store)->problems());
  auto found = (*store)->Find("alpha", 1);
  ASSERT_TRUE(found.ok()) << found.status().ToString();
  EXPECT_EQ(found->layout.row_format, uint32_t{shm::kRowInt8});
  EXPECT_EQ(found->fingerprint, LayoutFingerprint(int8_rows.meta.layout));
  found = (*store)->Find("alpha", 2);
  ASSERT_TRUE(found.ok()) << found.status().ToString();
  EXPECT_EQ(found->layout.row_format, uint32_t{shm::kRowFp16});
  EXPECT_EQ(found->fingerprint, LayoutFingerprint(fp16_rows.meta.layout));
  for (const Pages* p : {&int8_rows, &fp16_rows}) {
    std::vector<std::vector<std::vector<uint8_t>>> back;
    ASSERT_TRUE(ReadBack(**store, *p, &back).ok());
    EXPECT_EQ(back, p->data) << p->meta.id;
  }
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

// A metadata record is indexed only when it says what a client could have asked for: a record
// naming more pages a layer than its layout's capacity holds (a claim copies that many pages a
// layer into a sequence extended to at most its capacity: past the end of its page list), or a
// layout out of the limits, is reported damaged and never listed.
TEST(SpillStoreTest, MetadataBeyondItsLayoutIsReportedNotListed) {
  TempDir dir;
  const Pages a("alpha", 3, 2, 3, 4);  // capacity 1024 tokens of 16 a page: 64 pages a layer at most
  const Pages b("alpha", 4, 2, 3, 5);
  {
    auto store = SpillStore::Open({dir.path});
    ASSERT_TRUE(store.ok());
    ASSERT_TRUE((*store)->Put(a.meta, a.Reader()).ok());
    ASSERT_TRUE((*store)->Put(b.meta, b.Reader()).ok());
  }
  {  // behind the store's back: alpha/3 claims 65 pages a layer, alpha/4 a head_dim of 0
    rocksdb::DB* db = nullptr;
    ASSERT_TRUE(rocksdb::DB::Open(rocksdb::Options(), dir.path, &db).ok());
    std::unique_ptr<rocksdb::DB> owned(db);
    // version, tenant size, "alpha", id, then n_layers, n_kv_heads, head_dim, page_tokens,
    // capacity_tokens, pages_per_layer, row_format (uint32 each)
    const size_t fields = 4 + 4 + 5 + 8;
    for (const auto& [id, field, value] : {std::tuple{3, 5, 65u}, std::tuple{4, 2, 0u}}) {
      std::string key = std::string("malpha") + '\0' + (id == 3 ? "0000000000000003" : "0000000000000004"), meta;
      ASSERT_TRUE(db->Get(rocksdb::ReadOptions(), key, &meta).ok());
      std::memcpy(meta.data() + fields + 4 * field, &value, 4);
      ASSERT_TRUE(db->Put(rocksdb::WriteOptions(), key, meta).ok());
    }
    ASSERT_TRUE(db->Close().ok());
  }
  auto store = SpillStore::Open({dir.path});
  ASSERT_TRUE(store.ok());
  EXPECT_TRUE((*store)->List().empty());
  EXPECT_EQ((*store)->Find("alpha", 3).status().code(), StatusCode::kNotFound);
  const std::vector<std::string> problems = (*store)->problems();
  EXPECT_TRUE(Mentions(problems, "alpha/3")) << Joined(problems);
  EXPECT_TRUE(Mentions(problems, "alpha/4")) << Joined(problems);
}

TEST(SpillStoreTest, UnfinishedSpillsAreCleanedAndLimitsRefuseWholeSequences) {
  TempDir dir;
  const std::string unfinished_page = std::string("pghost") + '\0' + "0000000000000001" + "0000000000000000";
  const std::string orphan_page = std::string("plost") + '\0' + "0000000000000002" + "0000000000000000";
  {
    rocksdb::Options o;
    o.create_if_missing = true;
    rocksdb::DB* db = nullptr;
    ASSERT_TRUE(rocksdb::DB::Open(o, dir.path, &db).ok());
    std::unique_ptr<rocksdb::DB> owned(db);
    // A spill that never wrote its metadata (a crash between the two): its intent and a page.
    ASSERT_TRUE(db->Put(rocksdb::WriteOptions(), std::string("ighost") + '\0' + "0000000000000001", "").ok());
    ASSERT_TRUE(db->Put(rocksdb::WriteOptions(), unfinished_page, std::string(100, 'x')).ok());
    // A page with neither metadata nor an intent: no unfinished spill leaves that, its metadata
    // was lost. It is reported, never deleted as if it were an unfinished spill.
    ASSERT_TRUE(db->Put(rocksdb::WriteOptions(), orphan_page, std::string(100, 'y')).ok());
    ASSERT_TRUE(db->Close().ok());
  }
  const Pages a("alpha", 1, 4, 4, 5);  // 16 pages of 4 KiB
  auto store = SpillStore::Open({dir.path, a.meta.bytes() + 4096});
  ASSERT_TRUE(store.ok());
  EXPECT_TRUE((*store)->List().empty());
  const SpillVerifyReport report = (*store)->Verify();
  EXPECT_TRUE(Mentions(report.bad, "lost/2: its metadata is gone from the store (1 pages left on disk)"))
      << Joined(report.bad);
  EXPECT_FALSE(Mentions(report.bad, "ghost/1")) << Joined(report.bad);
  ASSERT_TRUE((*store)->Put(a.meta, a.Reader()).ok());
  const Pages b("alpha", 2, 1, 2, 6);
  EXPECT_EQ((*store)->Put(b.meta, b.Reader()).code(), StatusCode::kResourceExhausted);
  EXPECT_EQ((*store)->Find("alpha", 2).status().code(), StatusCode::kNotFound);
  store->reset();
  rocksdb::DB* db = nullptr;
  ASSERT_TRUE(rocksdb::DB::OpenForReadOnly(rocksdb::Options(), dir.path, &db).ok());
  std::unique_ptr<rocksdb::DB> owned(db);
  std::string value;
  EXPECT_TRUE(db->Get(rocksdb::ReadOptions(), unfinished_page, &value).IsNotFound());
  EXPECT_TRUE(db->Get(rocksdb::ReadOptions(), orphan_page, &value).ok());
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

// One flipped byte in the WAL used to stop recovery at that record and drop everything after it;
// the pages left without metadata were then deleted as unfinished spills, and verify said all
// was well. Now every sequence is either intact or named (problems, verify, and again on every
// later start until evicted), and the WAL is kept for inspection.
TEST(SpillStoreTest, AFlippedByteInTheWalIsReportedNeverSilent) {
  TempDir dir;
  const Pages a("alpha", 1, 2, 3, 11), b("alpha", 2, 2, 3, 12), c("alpha", 3, 4, 8, 13);
  SpillAndCrash(dir.path, {&a, &b, &c});
  const auto [wal, at] = FindBytes(dir.path, ".log", PageBytes(a, 1, 1));
  ASSERT_NE(at, std::string::npos) << "sequence 1's pages are in the WAL";
  FlipByte(wal, at + 10);
  {
    auto store = SpillStore::Open({dir.path});
    ASSERT_TRUE(store.ok()) << store.status().ToString();
    const std::vector<std::string> problems = (*store)->problems();
    EXPECT_TRUE(Mentions(problems, "alpha/1: its records were lost to a damaged WAL")) << Joined(problems);
    EXPECT_TRUE(Mentions(problems, "the WAL was damaged")) << Joined(problems);
    const SpillVerifyReport v = (*store)->Verify();
    EXPECT_TRUE(Mentions(v.bad, "alpha/1:")) << Joined(v.bad);
    EXPECT_GE((*store)->stats().unreadable_records, 1u);
    EXPECT_GE((*store)->stats().damaged_sequences, 1u);
    int intact = 0;
    for (const Pages* p : {&b, &c}) {  // the others: intact, or named
      std::vector<std::vector<std::vector<uint8_t>>> back;
      const Status read = ReadBack(**store, *p, &back);
      if (read.ok() && back == p->data) {
        ++intact;
      } else {
        EXPECT_TRUE(Mentions(v.bad, "alpha/" + std::to_string(p->meta.id) + ":")) << read.ToString() << "\n" << Joined(v.bad);
      }
    }
    std::printf("after the flipped byte: %d of 2 later sequences intact, %llu named damaged\n", intact,
                static_cast<unsigned long long>((*store)->stats().damaged_sequences));
    EXPECT_GE((*store)->max_id(), 3u);
  }
  bool kept = false;
  for (const auto& e : std::filesystem::directory_iterator(dir.path)) {
    kept |= e.path().filename().string().rfind("wal-corrupted-", 0) == 0 && !std::filesystem::is_empty(e.path());
  }
  EXPECT_TRUE(kept) << "the damaged WAL is kept";
  auto store = SpillStore::Open({dir.path});  // still reported after another restart
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  EXPECT_TRUE(Mentions((*store)->Verify().bad, "alpha/1:"));
  ASSERT_TRUE((*store)->DeleteDamaged(1).ok());
  EXPECT_FALSE(Mentions((*store)->problems(), "alpha/1:"));
  EXPECT_EQ((*store)->DeleteDamaged(1).code(), StatusCode::kNotFound);
}

// The metadata records sit together in one SST block: a flipped byte there made the index scan
// end early without an error, and every page was then deleted as unclaimed. Now the read error
// is reported, nothing is deleted, and every sequence with pages on disk is named.
TEST(SpillStoreTest, AnUnreadableMetadataBlockIsReportedAndDeletesNothing) {
  TempDir dir;
  ASSERT_NO_FATAL_FAILURE(SpillAlphaAndBeta(dir.path));
  ASSERT_TRUE(SpillStore::Open({dir.path}).ok());  // a reopen replays the WAL into an SST file
  ASSERT_NO_FATAL_FAILURE(FlipAlphasMetadata(dir.path));
  auto store = SpillStore::Open({dir.path});
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  const SpillVerifyReport v = (*store)->Verify();
  EXPECT_TRUE(Mentions(v.bad, "metadata records after")) << Joined(v.bad);
  EXPECT_TRUE(Mentions(v.bad, "alpha/1: its metadata could not be read")) << Joined(v.bad);
  EXPECT_TRUE(Mentions(v.bad, "beta/2: its metadata could not be read")) << Joined(v.bad);
  EXPECT_GE((*store)->stats().unreadable_records, 1u);
}

// verify used to read through RocksDB's block cache (and the memtable): a page corrupted on disk
// while the store was open went unnoticed until a restart.
TEST(SpillStoreTest, VerifyReadsTheFilesNotACache) {
  TempDir dir;
  const Pages a("alpha", 4, 2, 3, 31);
  {
    auto store = SpillStore::Open({dir.path});
    ASSERT_TRUE(store.ok());
    ASSERT_TRUE((*store)->Put(a.meta, a.Reader()).ok());
  }
  auto store = SpillStore::Open({dir.path});  // a restarted daemon: the pages are in an SST file
  ASSERT_TRUE(store.ok());
  EXPECT_EQ((*store)->Verify().pages_bad, 0u);  // reads every page once (a cache would keep them)
  const auto [sst, at] = FindBytes(dir.path, ".sst", PageBytes(a, 1, 2));
  ASSERT_NE(at, std::string::npos) << "the page is in an SST file";
  FlipByte(sst, at + 100);
  const SpillVerifyReport v = (*store)->Verify();
  EXPECT_EQ(v.pages_bad, 1u) << Joined(v.bad);
  EXPECT_TRUE(Mentions(v.bad, "alpha/4/1/2:")) << Joined(v.bad);
  std::vector<std::vector<std::vector<uint8_t>>> back;
  EXPECT_EQ(ReadBack(**store, a, &back).code(), StatusCode::kDataLoss);
}

// Spill files used to be created with the process umask (0644): any local user could read the
// tenants' pages from the WAL.
TEST(SpillStoreTest, FilesArePrivateWhateverTheUmask) {
  TempDir dir;
  const mode_t old = umask(022);
  const std::string path = dir.path + "/spill";
  {
    auto store = SpillStore::Open({path});
    ASSERT_TRUE(store.ok());
    const Pages a("alpha", 1, 1, 2, 41);
    ASSERT_TRUE((*store)->Put(a.meta, a.Reader()).ok());
    (*store)->Verify();  // flushes: an SST file too
  }
  umask(old);
  struct stat st;
  ASSERT_EQ(stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0700u);
  int files = 0;
  for (const auto& e : std::filesystem::recursive_directory_iterator(path)) {
    ASSERT_EQ(stat(e.path().c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 077, 0u) << e.path() << " is mode " << std::oct << (st.st_mode & 0777);
    ++files;
  }
  EXPECT_GT(files, 3);
}

mode_t ModeOf(const std::string& path) {
  struct stat st {};
  EXPECT_EQ(::lstat(path.c_str(), &st), 0) << path;
  return st.st_mode & 07777;
}

// dir/link, a link to dir/target, which holds a file of mode 0644 (someone else's): its path.
std::string LinkToAFileOfSomeoneElse(const TempDir& dir) {
  const std::string target = dir.path + "/target", kept = target + "/someone-elses-file";
  std::filesystem::create_directory(target);
  std::ofstream(kept) << "x";
  std::filesystem::permissions(kept, std::filesystem::perms(0644));
  std::filesystem::create_directory_symlink(target, dir.path + "/link");
  return kept;
}

// dir/open, mode 0777: its path.
std::string DirectoryOthersMayWrite(const TempDir& dir) {
  const std::string open = dir.path + "/open";
  std::filesystem::create_directory(open);
  std::filesystem::permissions(open, std::filesystem::perms(0777));
  return open;
}

// Whoever may write the store's directory, or its parent, could read or replace spilled pages
// (their checksums have no key); a link in its place would have the daemon chmod whatever it
// points at. Each is refused before anything is changed.
TEST(SpillStoreTest, ALinkAnotherUsersDirectoryOrAnOpenParentIsRefusedBeforeAnyChange) {
  TempDir dir;
  const std::string kept = LinkToAFileOfSomeoneElse(dir);
  auto linked = SpillStore::Open({dir.path + "/link"});
  EXPECT_EQ(linked.status().code(), StatusCode::kPermissionDenied) << linked.status().ToString();
  EXPECT_NE(linked.status().message().find("symbolic link"), std::string::npos) << linked.status().ToString();
  EXPECT_EQ(ModeOf(kept), 0644u);

  // Another user's directory (as root: one given to nobody; otherwise /, which root owns).
  std::string theirs = "/";
  if (::geteuid() == 0) {
    theirs = dir.path + "/theirs";
    std::filesystem::create_directory(theirs);
    std::filesystem::permissions(theirs, std::filesystem::perms(0755));
    ASSERT_EQ(::chown(theirs.c_str(), 65534, 65534), 0);
  }
  auto other = SpillStore::Open({theirs});
  EXPECT_EQ(other.status().code(), StatusCode::kPermissionDenied) << other.status().ToString();
  EXPECT_NE(other.status().message().find("belongs to user"), std::string::npos) << other.status().ToString();
  if (theirs != "/") {
    EXPECT_EQ(ModeOf(theirs), 0755u);
  }

  // A parent its group or others may write: they could rename the store and put theirs there.
  const std::string open = DirectoryOthersMayWrite(dir);
  auto in_open = SpillStore::Open({open + "/spill"});
  EXPECT_EQ(in_open.status().code(), StatusCode::kPermissionDenied) << in_open.status().ToString();
  EXPECT_NE(in_open.status().message().find("parent"), std::string::npos) << in_open.status().ToString();
  std::filesystem::permissions(open, std::filesystem::perms(01777));  // sticky, as /tmp: fine
  EXPECT_TRUE(SpillStore::Open({open + "/spill"}).ok());
}

// The same checks for a directory written with a trailing slash ("[spill] dir = \"/srv/x/spill/\"",
// a common way to write one): the link is refused, not followed (its target left as it was), and a
// store in a parent others may write is refused. Before, the "parent" checked was the store itself
// and open() followed a link whose name ended in '/'.
TEST(SpillStoreTest, ATrailingSlashDoesNotBypassTheLinkAndParentChecks) {
  TempDir dir;
  const std::string kept = LinkToAFileOfSomeoneElse(dir);
  auto linked = SpillStore::Open({dir.path + "/link/"});
  EXPECT_EQ(linked.status().code(), StatusCode::kPermissionDenied) << linked.status().ToString();
  EXPECT_EQ(ModeOf(kept), 0644u) << "the link's target was made private to the daemon; Open said: " << linked.status().ToString();

  const std::string open = DirectoryOthersMayWrite(dir);
  auto in_open = SpillStore::Open({open + "/spill/"});
  EXPECT_EQ(in_open.status().code(), StatusCode::kPermissionDenied) << in_open.status().ToString();
  // Slashes at the end name the directory itself. (A path that names no directory of its own, "/"
  // or ".", is refused; not tried here: a regression would make the test's machine private.)
  EXPECT_TRUE(SpillStore::Open({dir.path + "/mine//"}).ok());
}

TEST(SpillStoreTest, ALinkInsideTheStoreIsNeverFollowed) {
  TempDir dir;
  const std::string store = dir.path + "/spill", outside = dir.path + "/outside";
  std::filesystem::create_directory(store);
  std::ofstream(outside) << "x";
  std::filesystem::permissions(outside, std::filesystem::perms(0644));
  std::filesystem::create_symlink(outside, store + "/link");
  std::ofstream(store + "/by-hand") << "x";
  std::filesystem::permissions(store + "/by-hand", std::filesystem::perms(0664));
  ASSERT_TRUE(SpillStore::Open({store}).ok());
  EXPECT_EQ(ModeOf(outside), 0644u);
  EXPECT_EQ(ModeOf(store + "/by-hand"), 0600u);
  EXPECT_EQ(ModeOf(store), 0700u);
}

// After a write error RocksDB stops taking writes; every later spill used to fail until the
// daemon restarted. Once the disk has room again, the next spill succeeds.
TEST(SpillStoreTest, WritesResumeOnceAFullDiskHasRoomAgain) {
  TempDir dir;
  if (geteuid() != 0 || mount("tmpfs", dir.path.c_str(), "tmpfs", 0, "size=4m") != 0) {
    GTEST_SKIP() << "cannot mount a small tmpfs here (needs root)";
  }
  struct Unmount {
    std::string path;
    ~Unmount() { umount2(path.c_str(), MNT_DETACH); }
  } unmount{dir.path};
  auto store = SpillStore::Open({dir.path + "/db"});
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  const Pages kept("beta", 3, 1, 2, 53);  // stored before the disk fills
  ASSERT_TRUE((*store)->Put(kept.meta, kept.Reader()).ok());
  {  // ballast: the disk is all but full
    std::ofstream ballast(dir.path + "/ballast", std::ios::binary);
    const std::string mib(1 << 20, 'x');
    for (int i = 0; i < 8 && ballast.write(mib.data(), mib.size()); ++i) {
    }
  }
  const Pages a("alpha", 1, 4, 16, 51);  // 64 pages of 4 KiB: 256 KiB
  const Status full = (*store)->Put(a.meta, a.Reader());
  ASSERT_FALSE(full.ok());
  EXPECT_GE((*store)->stats().write_errors, 1u);
  const Pages b("alpha", 2, 1, 2, 52);
  EXPECT_FALSE((*store)->Put(b.meta, b.Reader()).ok()) << "still full";
  // What was stored before stays readable while the store cannot be reopened for writing.
  std::vector<std::vector<std::vector<uint8_t>>> kept_back;
  const Status read_while_full = ReadBack(**store, kept, &kept_back);
  ASSERT_TRUE(read_while_full.ok()) << read_while_full.ToString();
  EXPECT_EQ(kept_back, kept.data);
  std::filesystem::remove(dir.path + "/ballast");
  const Status again = (*store)->Put(a.meta, a.Reader());
  ASSERT_TRUE(again.ok()) << again.ToString();
  std::vector<std::vector<std::vector<uint8_t>>> back;
  ASSERT_TRUE(ReadBack(**store, a, &back).ok());
  EXPECT_EQ(back, a.data);
  EXPECT_GE((*store)->stats().resumes, 1u);
}

// Verify used to hold the store's DB handle for its whole run. After a write error, the next
// write reopens the store and so waited for the whole check, and with it every later write (in the
// daemon: every tenant's spill, park and claim, made under the kept sequences' lock). Now the
// reopen waits for one read, and the check goes on with the reopened store.
TEST(SpillStoreTest, AReopenAfterAWriteErrorDoesNotWaitForAWholeVerify) {
  TempDir dir;
  auto fs = std::make_shared<FaultyFileSystem>();
  const Pages a("alpha", 1, 4, 64, 61);  // 256 pages: at 5 ms a read, verify takes seconds
  auto store = OpenWithPagesOnDisk(dir.path, fs, a);
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  fs->read_delay_us = 5000;
  std::atomic<bool> verified{false};
  SpillVerifyReport report;
  std::thread verify([&] {
    report = (*store)->Verify();
    verified = true;
  });
  while (fs->reads < 8 && !verified) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  fs->fail_writes = true;
  const Pages b("beta", 2, 1, 2, 62), c("gamma", 3, 1, 2, 63);
  const Status failed = (*store)->Put(b.meta, b.Reader());
  fs->fail_writes = false;
  const Status after = (*store)->Put(c.meta, c.Reader());  // reopens the store first
  const bool verify_still_running = !verified;
  verify.join();
  EXPECT_EQ(failed.code(), StatusCode::kUnavailable) << failed.ToString();
  ASSERT_TRUE(after.ok()) << after.ToString();
  EXPECT_TRUE(verify_still_running) << "the reopen waited for the whole verify";
  EXPECT_GE((*store)->stats().resumes, 1u);
  EXPECT_EQ(report.pages_checked, 256u);
  EXPECT_EQ(report.pages_bad, 0u) << Joined(report.bad);
  fs->read_delay_us = 0;
  for (const Pages* p : {&a, &c}) {
    std::vector<std::vector<std::vector<uint8_t>>> back;
    ASSERT_TRUE(ReadBack(**store, *p, &back).ok()) << p->meta.tenant;
    EXPECT_EQ(back, p->data) << p->meta.tenant;
  }
  EXPECT_EQ((*store)->Find("beta", 2).status().code(), StatusCode::kNotFound) << "the failed spill left nothing";
}

// A page that could not be read (an I/O error: nothing is known of its bytes) used to be counted
// as a checksum failure, so a failing disk looked like corrupted data. Restore and verify now count
// it as a read error.
TEST(SpillStoreTest, AnIoErrorIsCountedAsAReadErrorNotAChecksumFailure) {
  TempDir dir;
  auto fs = std::make_shared<FaultyFileSystem>();
  const Pages a("alpha", 5, 2, 3, 71);
  auto store = OpenWithPagesOnDisk(dir.path, fs, a);
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  fs->fail_reads = true;
  std::vector<std::vector<std::vector<uint8_t>>> back;
  const Status restore = ReadBack(**store, a, &back);
  EXPECT_EQ(restore.code(), StatusCode::kUnavailable) << restore.ToString();
  EXPECT_NE(restore.message().find("alpha/5/layer"), std::string::npos) << restore.ToString();
  const uint64_t after_restore = (*store)->stats().read_errors;
  EXPECT_GE(after_restore, 1u);
  const SpillVerifyReport v = (*store)->Verify();
  EXPECT_EQ(v.pages_bad, 6u) << Joined(v.bad);
  EXPECT_EQ((*store)->stats().read_errors, after_restore + 6);
  EXPECT_EQ((*store)->stats().checksum_failures, 0u);
  fs->fail_reads = false;
  ASSERT_TRUE(ReadBack(**store, a, &back).ok());
  EXPECT_EQ(back, a.data);
}

// A metadata block that verify found unreadable was counted (again at every verify) with no log
// line and nothing in problems(): once verify's reply was gone, nothing said which records. Now it
// is logged when first found, counted once, and reported by problems() and every later verify.
TEST(SpillStoreTest, AnUnreadableRecordFoundByVerifyIsLoggedAndKeptAmongTheProblems) {
  TempDir dir;
  ASSERT_NO_FATAL_FAILURE(SpillAlphaAndBeta(dir.path));
  auto store = SpillStore::Open({dir.path});  // replays the WAL into an SST file, reads it whole
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  ASSERT_TRUE((*store)->problems().empty()) << Joined((*store)->problems());
  ASSERT_NO_FATAL_FAILURE(FlipAlphasMetadata(dir.path));
  CapturedLog log;
  const SpillVerifyReport v = (*store)->Verify();
  EXPECT_TRUE(Mentions(v.bad, "metadata records after")) << Joined(v.bad);
  EXPECT_TRUE(Mentions((*store)->problems(), "metadata records after")) << Joined((*store)->problems());
  EXPECT_NE(log.text.str().find("metadata records after"), std::string::npos) << log.text.str();
  EXPECT_NE(log.text.str().find(dir.path), std::string::npos) << log.text.str();
  EXPECT_EQ((*store)->stats().unreadable_records, 1u);
  EXPECT_TRUE(Mentions((*store)->Verify().bad, "metadata records after"));
  EXPECT_EQ((*store)->stats().unreadable_records, 1u) << "the same record, found again";
}

}  // namespace
}  // namespace specache
