#include "specache/spill_store.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <mutex>
#include <shared_mutex>
#include <thread>

#include <spdlog/spdlog.h>
#include <rocksdb/db.h>
#include <rocksdb/env.h>
#include <rocksdb/file_system.h>
#include <rocksdb/options.h>
#include <rocksdb/table.h>
#include <rocksdb/write_batch.h>
#include <xxhash.h>

#include "specache/trusted_directory.h"

namespace specache {
namespace {

// A sequence's record: version 1 has no row format (fp16 rows); version 2 adds it after the
// layout's fields. fp16 sequences are still written as version 1, so a daemon from before row
// formats reads them.
constexpr uint32_t kMetaVersion = 2;
constexpr uint32_t kMetaVersionFp16Only = 1;
constexpr size_t kChecksumBytes = 8;
constexpr size_t kBatchBytes = size_t{8} << 20;  // pages per write batch, by bytes
constexpr uint32_t kRestoreThreads = 4;
constexpr char kCatalogName[] = "specache-catalog";

std::string Hex(uint64_t v, int digits) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%0*" PRIx64, digits, v);
  return buf;
}

std::string SequencePrefix(char kind, const std::string& tenant, uint64_t id) {
  std::string k(1, kind);
  k += tenant;
  k.push_back('\0');
  k += Hex(id, 16);
  return k;
}
std::string MetaKey(const std::string& tenant, uint64_t id) { return SequencePrefix('m', tenant, id); }
std::string IntentKey(const std::string& tenant, uint64_t id) { return SequencePrefix('i', tenant, id); }
std::string DamagedKey(const std::string& tenant, uint64_t id) { return SequencePrefix('d', tenant, id); }
std::string PagePrefix(const std::string& tenant, uint64_t id) { return SequencePrefix('p', tenant, id); }
std::string PageKey(const std::string& tenant, uint64_t id, uint32_t layer, uint32_t page) {
  return PagePrefix(tenant, id) + Hex(layer, 8) + Hex(page, 8);
}
// The key just after every key starting with `prefix`.
std::string PrefixEnd(std::string prefix) {
  prefix.push_back('\xff');
  return prefix;
}

// (tenant, id) of any record's key; false for a key of no known shape.
bool ParseKey(std::string_view key, std::string* tenant, uint64_t* id) {
  const size_t zero = key.find('\0');
  if (key.empty() || zero == std::string_view::npos || key.size() < zero + 1 + 16) return false;
  tenant->assign(key.substr(1, zero - 1));
  const std::string hex(key.substr(zero + 1, 16));
  char* end = nullptr;
  *id = std::strtoull(hex.c_str(), &end, 16);
  return end == hex.c_str() + 16;
}

// A key for messages: printable bytes as they are, the rest escaped.
std::string Printable(std::string_view key) {
  std::string out;
  for (char c : key) {
    if (c >= 0x20 && c < 0x7f) {
      out.push_back(c);
    } else {
      char buf[5];
      std::snprintf(buf, sizeof buf, "\\x%02x", static_cast<unsigned char>(c));
      out += buf;
    }
  }
  return out;
}

template <typename T>
void Put(std::string* out, T v) {
  out->append(reinterpret_cast<const char*>(&v), sizeof v);
}
template <typename T>
bool Take(std::string_view* in, T* v) {
  if (in->size() < sizeof *v) return false;
  std::memcpy(v, in->data(), sizeof *v);
  in->remove_prefix(sizeof *v);
  return true;
}

std::string EncodeMeta(const SpilledSequence& m) {
  std::string out;
  const bool fp16 = m.layout.row_format == shm::kRowFp16;
  Put(&out, fp16 ? kMetaVersionFp16Only : kMetaVersion);
  Put(&out, static_cast<uint32_t>(m.tenant.size()));
  out += m.tenant;
  Put(&out, m.id);
  for (uint32_t f : {m.layout.n_layers, m.layout.n_kv_heads, m.layout.head_dim, m.layout.page_tokens,
                     m.layout.capacity_tokens, m.pages_per_layer}) {
    Put(&out, f);
  }
  if (!fp16) Put(&out, m.layout.row_format);
  Put(&out, m.fingerprint);
  Put(&out, m.spilled_unix_ms);
  return out;
}

bool DecodeMeta(std::string_view in, SpilledSequence* m) {
  uint32_t version = 0, tenant_size = 0;
  if (!Take(&in, &version) || (version != kMetaVersion && version != kMetaVersionFp16Only) || !Take(&in, &tenant_size) ||
      in.size() < tenant_size) {
    return false;
  }
  m->tenant.assign(in.data(), tenant_size);
  in.remove_prefix(tenant_size);
  uint32_t* fields[] = {&m->layout.n_layers, &m->layout.n_kv_heads, &m->layout.head_dim, &m->layout.page_tokens,
                        &m->layout.capacity_tokens, &m->pages_per_layer};
  if (!Take(&in, &m->id)) return false;
  for (uint32_t* f : fields) {
    if (!Take(&in, f)) return false;
  }
  m->layout.row_format = shm::kRowFp16;
  if (version == kMetaVersion && !Take(&in, &m->layout.row_format)) return false;
  if (!Take(&in, &m->fingerprint) || !Take(&in, &m->spilled_unix_ms) || !in.empty()) return false;
  // What a restore and a claim index by must be what a client could have asked for: a layout
  // within the limits, its fingerprint, and no more pages a layer than its capacity holds (a
  // damaged or edited record is reported, never claimed: the claim copies pages_per_layer pages
  // a layer into a sequence extended to at most its capacity).
  return ValidatePageLayout(m->layout, UINT64_MAX).ok() && m->fingerprint == LayoutFingerprint(m->layout) &&
         m->pages_per_layer <= m->layout.pages_capacity_per_layer();
}

Status FromRocks(const rocksdb::Status& s, const std::string& what) {
  if (s.ok()) return Status::Ok();
  if (s.IsNotFound()) return Status::NotFound(what + ": " + s.ToString());
  if (s.IsNoSpace()) return Status::ResourceExhausted(what + ": no space left: " + s.ToString());
  return Status::Unavailable(what + ": " + s.ToString());
}

std::string PageName(const SpilledSequence& m, uint32_t layer, uint32_t page) {
  return m.tenant + "/" + std::to_string(m.id) + "/layer " + std::to_string(layer) + "/page " + std::to_string(page);
}

// Why a stored page value is not the page (empty when it is).
std::string CheckPage(std::string_view value, uint64_t page_bytes) {
  if (value.size() != kChecksumBytes + page_bytes) {
    return "size " + std::to_string(value.size()) + ", expected " + std::to_string(kChecksumBytes + page_bytes);
  }
  uint64_t stored;
  std::memcpy(&stored, value.data(), kChecksumBytes);
  if (XXH64(value.data() + kChecksumBytes, page_bytes, 0) != stored) return "checksum mismatch";
  return "";
}

// Reads that check what they read (RocksDB's block checksums too) and leave no copy behind.
rocksdb::ReadOptions CheckedReads() {
  rocksdb::ReadOptions ro;
  ro.verify_checksums = true;
  ro.fill_cache = false;
  return ro;
}

// RocksDB's own LOG file would live on the spill disk, and once that disk is full, writing it
// fails in ways this RocksDB build asserts on. Every error we act on comes back as a Status, so
// its diagnostics log is not kept.
class NoLogger final : public rocksdb::Logger {
 public:
  NoLogger() : rocksdb::Logger(rocksdb::InfoLogLevel::FATAL_LEVEL) {}
  using rocksdb::Logger::Logv;
  void Logv(const char*, va_list) override {}
};

// RocksDB creates its files with the process umask (0644 by default): page data of every tenant
// would be readable by any local user. This file system makes every file it creates 0600 and
// every directory 0700. The file is created first and narrowed right after; the store's
// directory is already 0700 by then, so nobody else can open it in between.
class PrivateFileSystem final : public rocksdb::FileSystemWrapper {
 public:
  using rocksdb::FileSystemWrapper::FileSystemWrapper;
  const char* Name() const override { return "SpecachePrivateFileSystem"; }

  rocksdb::IOStatus NewWritableFile(const std::string& f, const rocksdb::FileOptions& o,
                                    std::unique_ptr<rocksdb::FSWritableFile>* r, rocksdb::IODebugContext* dbg) override {
    return Narrow(f, target()->NewWritableFile(f, o, r, dbg), 0600);
  }
  rocksdb::IOStatus ReopenWritableFile(const std::string& f, const rocksdb::FileOptions& o,
                                       std::unique_ptr<rocksdb::FSWritableFile>* r,
                                       rocksdb::IODebugContext* dbg) override {
    return Narrow(f, target()->ReopenWritableFile(f, o, r, dbg), 0600);
  }
  rocksdb::IOStatus ReuseWritableFile(const std::string& f, const std::string& old, const rocksdb::FileOptions& o,
                                      std::unique_ptr<rocksdb::FSWritableFile>* r,
                                      rocksdb::IODebugContext* dbg) override {
    return Narrow(f, target()->ReuseWritableFile(f, old, o, r, dbg), 0600);
  }
  rocksdb::IOStatus NewRandomRWFile(const std::string& f, const rocksdb::FileOptions& o,
                                    std::unique_ptr<rocksdb::FSRandomRWFile>* r, rocksdb::IODebugContext* dbg) override {
    return Narrow(f, target()->NewRandomRWFile(f, o, r, dbg), 0600);
  }
  rocksdb::IOStatus LockFile(const std::string& f, const rocksdb::IOOptions& o, rocksdb::FileLock** l,
                             rocksdb::IODebugContext* dbg) override {
    return Narrow(f, target()->LockFile(f, o, l, dbg), 0600);
  }
  rocksdb::IOStatus CreateDir(const std::string& d, const rocksdb::IOOptions& o, rocksdb::IODebugContext* dbg) override {
    return Narrow(d, target()->CreateDir(d, o, dbg), 0700);
  }
  rocksdb::IOStatus CreateDirIfMissing(const std::string& d, const rocksdb::IOOptions& o,
                                       rocksdb::IODebugContext* dbg) override {
    return Narrow(d, target()->CreateDirIfMissing(d, o, dbg), 0700);
  }

 private:
  static rocksdb::IOStatus Narrow(const std::string& path, rocksdb::IOStatus s, mode_t mode) {
    if (s.ok() && chmod(path.c_str(), mode) != 0) return rocksdb::IOStatus::IOError("chmod " + path, std::strerror(errno));
    return s;
  }
};

// Copies the WAL files of `dir` into a new folder of it before a recovery that skips corrupted
// records replays (and then deletes) them: the evidence stays for inspection.
std::string KeepCorruptedWal(const std::string& dir) {
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                      std::chrono::system_clock::now().time_since_epoch()).count();
  const std::filesystem::path to = std::filesystem::path(dir) / ("wal-corrupted-" + std::to_string(ms));
  std::error_code ec;
  std::filesystem::create_directory(to, ec);
  if (ec) return "not copied: " + ec.message();
  chmod(to.c_str(), 0700);
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    if (entry.path().extension() != ".log" || !entry.is_regular_file(ec)) continue;
    std::filesystem::copy_file(entry.path(), to / entry.path().filename(), ec);
    if (ec) return "not copied: " + ec.message();
    chmod((to / entry.path().filename()).c_str(), 0600);
  }
  return "copied to " + to.string();
}

// Whether files in `dir` can be opened with O_DIRECT (not on tmpfs, for one).
bool SupportsDirectIo(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  const std::string probe = dir + "/.direct-io-probe";
  const int fd = open(probe.c_str(), O_RDWR | O_CREAT | O_DIRECT, 0600);
  if (fd >= 0) close(fd);
  unlink(probe.c_str());
  return fd >= 0;
}

}  // namespace

uint64_t LayoutFingerprint(const PageLayout& l) {
  const uint32_t fields[] = {l.n_layers, l.n_kv_heads, l.head_dim, l.page_tokens, l.capacity_tokens, l.row_format};
  // fp16 rows hash as before there were row formats, so records written then keep their fingerprint.
  const size_t bytes = l.row_format == shm::kRowFp16 ? sizeof fields - sizeof fields[0] : sizeof fields;
  return XXH64(fields, bytes, 0x5eca);
}

Result<std::unique_ptr<SpillStore>> SpillStore::Open(const SpillOptions& options) {
  if (options.dir.empty()) return Status::InvalidArgument("spill directory is empty");
  SPECACHE_RETURN_IF_ERROR(MakePrivateDirectory(options.dir, "spill directory"));
  std::unique_ptr<SpillStore> store(new SpillStore(options));
  store->env_ = rocksdb::NewCompositeEnv(
      std::make_shared<PrivateFileSystem>(options.file_system ? options.file_system : rocksdb::FileSystem::Default()));
  SPECACHE_RETURN_IF_ERROR(store->OpenDb(/*after_write_error=*/false));
  return store;
}

rocksdb::Options SpillStore::DbOptions(bool after_write_error) const {
  rocksdb::Options o;
  o.env = env_.get();
  o.create_if_missing = true;
  o.compression = options_.compression ? rocksdb::kLZ4Compression : rocksdb::kNoCompression;
  o.max_background_jobs = 2;
  // Pages are written once, read back whole and deleted whole: large memtables and a late L0
  // compaction keep the bytes rewritten by compactions low.
  o.write_buffer_size = uint64_t{256} << 20;
  o.level0_file_num_compaction_trigger = 8;
  o.target_file_size_base = uint64_t{256} << 20;
  o.use_direct_reads = SupportsDirectIo(options_.dir);  // restores read straight from the device
  o.info_log = std::make_shared<NoLogger>();
  // Every page is read once (restore) or to check it (verify): a block cache would only keep
  // bytes that are about to be deleted, and would let verify check its own copy instead of the
  // disk. Without one, every read comes from the SST file.
  rocksdb::BlockBasedTableOptions table;
  table.no_block_cache = true;
  o.table_factory.reset(rocksdb::NewBlockBasedTableFactory(table));
  // A file that does not check out stops the store (open fails, writes stop) rather than being
  // used or silently compacted away.
  o.paranoid_checks = true;
  // The default, point-in-time recovery, stops replaying the WAL at its first corrupted record
  // and drops everything after it without a word: one flipped byte erased every sequence spilled
  // since the last flush. Absolute consistency makes any WAL damage an error we see; we then
  // salvage every record that can still be read (below) and report what was lost. Reopening
  // after our own failed write, a torn last record is expected (that write was never
  // acknowledged) and tolerated.
  o.wal_recovery_mode = after_write_error ? rocksdb::WALRecoveryMode::kTolerateCorruptedTailRecords
                                          : rocksdb::WALRecoveryMode::kAbsoluteConsistency;
  return o;
}

Status SpillStore::OpenDb(bool after_write_error) {
  rocksdb::Options o = DbOptions(after_write_error);
  rocksdb::DB* db = nullptr;
  rocksdb::Status opened = rocksdb::DB::Open(o, options_.dir, &db);
  bool salvaged = false;
  if (opened.IsCorruption()) {
    const std::string why = opened.ToString();
    const std::string kept = KeepCorruptedWal(options_.dir);
    o.wal_recovery_mode = rocksdb::WALRecoveryMode::kSkipAnyCorruptedRecords;
    opened = rocksdb::DB::Open(o, options_.dir, &db);
    if (opened.ok()) {
      salvaged = true;
      AddProblem("the WAL was damaged (" + why + "); every readable record was recovered; its files were " + kept);
    } else {
      opened = rocksdb::Status::Corruption(why, "and recovering what can be read failed too: " + opened.ToString());
    }
  }
  SPECACHE_RETURN_IF_ERROR(FromRocks(opened, "open spill store " + options_.dir));
  db_.reset(db);
  return Load(salvaged);
}

SpillStore::SpillStore(const SpillOptions& options) : options_(options) {}

SpillStore::~SpillStore() {
  if (db_) db_->Close();
  if (catalog_fd_ >= 0) close(catalog_fd_);
}

namespace {

std::string ToHex(std::string_view bytes) {
  std::string out;
  for (unsigned char c : bytes) out += Hex(c, 2);
  return out;
}

bool FromHex(std::string_view hex, std::string* out) {
  if (hex.size() % 2) return false;
  out->clear();
  for (size_t i = 0; i < hex.size(); i += 2) {
    char* end = nullptr;
    const std::string two(hex.substr(i, 2));
    out->push_back(static_cast<char>(std::strtoul(two.c_str(), &end, 16)));
    if (end != two.c_str() + 2) return false;
  }
  return true;
}

// "op tenant(hex) id(16 hex) xxh64(16 hex)\n"
std::string CatalogLine(const char* op, const std::string& tenant, uint64_t id) {
  const std::string body = std::string(op) + " " + ToHex(tenant) + " " + Hex(id, 16);
  return body + " " + Hex(XXH64(body.data(), body.size(), 0), 16) + "\n";
}

bool WriteAll(int fd, const std::string& s) {
  size_t done = 0;
  while (done < s.size()) {
    const ssize_t n = write(fd, s.data() + done, s.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    done += static_cast<size_t>(n);
  }
  return true;
}

}  // namespace

std::map<std::pair<std::string, uint64_t>, bool> SpillStore::ReadCatalog() {
  std::map<std::pair<std::string, uint64_t>, bool> listed;
  std::ifstream in(options_.dir + "/" + kCatalogName);
  std::string line;
  for (int n = 1; std::getline(in, line); ++n) {
    const size_t sum_at = line.rfind(' ');
    std::string op, tenant_hex, tenant, id_hex;
    std::istringstream fields(line.substr(0, sum_at == std::string::npos ? 0 : sum_at));
    fields >> op >> tenant_hex >> id_hex;
    const std::string body = sum_at == std::string::npos ? "" : line.substr(0, sum_at);
    const bool sum_ok = sum_at != std::string::npos && line.substr(sum_at + 1) == Hex(XXH64(body.data(), body.size(), 0), 16);
    if (!sum_ok || (op != "put" && op != "del") || !FromHex(tenant_hex, &tenant) || id_hex.size() != 16) {
      AddProblem("catalog line " + std::to_string(n) + " does not check out: '" + Printable(line) + "'");
      continue;
    }
    const uint64_t id = std::strtoull(id_hex.c_str(), nullptr, 16);
    if (op == "put") listed[{tenant, id}] = true;
    else listed.erase({tenant, id});
  }
  return listed;
}

Status SpillStore::RewriteCatalog() {
  std::string text;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [key, m] : index_) text += CatalogLine("put", key.first, key.second);
    for (const auto& [key, why] : damaged_) text += CatalogLine("put", key.first, key.second);  // until evicted
  }
  const std::string path = options_.dir + "/" + kCatalogName, tmp = path + ".new";
  const int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return Status::Unavailable("spill store: creating " + tmp + ": " + std::strerror(errno));
  const bool ok = WriteAll(fd, text) && fdatasync(fd) == 0;
  close(fd);
  if (!ok || rename(tmp.c_str(), path.c_str()) != 0) {
    return Status::Unavailable("spill store: writing " + path + ": " + std::strerror(errno));
  }
  if (const int dir = open(options_.dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC); dir >= 0) {
    fsync(dir);
    close(dir);
  }
  std::lock_guard<std::mutex> lock(catalog_mu_);
  if (catalog_fd_ >= 0) close(catalog_fd_);
  catalog_fd_ = open(path.c_str(), O_WRONLY | O_APPEND | O_CLOEXEC);
  if (catalog_fd_ < 0) return Status::Unavailable("spill store: opening " + path + ": " + std::strerror(errno));
  return Status::Ok();
}

void SpillStore::AppendCatalog(const char* op, const std::string& tenant, uint64_t id) {
  // A line that cannot be written is not an error of the store: a "put" missing from the catalog
  // is added back from RocksDB's metadata at the next start, and a missing "del" reports the
  // deleted sequence as damaged (a false alarm, never a silent loss).
  std::lock_guard<std::mutex> lock(catalog_mu_);
  if (catalog_fd_ < 0) return;
  if (!WriteAll(catalog_fd_, CatalogLine(op, tenant, id)) || fdatasync(catalog_fd_) != 0) {
    const uint64_t n = ++write_errors_;
    if ((n & (n - 1)) == 0) {  // 1st, 2nd, 4th...: a failing disk does not flood the log
      spdlog::warn("spill store: the catalog line '{} {}' was not written ({} so far): {}", op, id, n, std::strerror(errno));
    }
  }
}

bool SpillStore::AddProblem(std::string what) {
  std::lock_guard<std::mutex> lock(mu_);
  // A reopen (or another Verify) finds it again.
  if (std::find(unreadable_.begin(), unreadable_.end(), what) != unreadable_.end()) return false;
  ++unreadable_records_;
  unreadable_.push_back(std::move(what));
  return true;
}

Status SpillStore::Load(bool wal_salvaged) {
  std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(CheckedReads()));
  // Every scan ends either at the end of its records or at a read error, which is reported and
  // makes the index incomplete: nothing is deleted then.
  bool complete = true;
  auto scan_ended = [&](const char* records, const std::string& last_key) {
    if (it->status().ok()) return;
    complete = false;
    AddProblem(std::string(records) + " records after '" + Printable(last_key) + "' could not be read: " +
               it->status().ToString());
  };
  std::map<std::pair<std::string, uint64_t>, SpilledSequence> index;
  std::map<std::pair<std::string, uint64_t>, std::string> damaged;
  std::string last;
  for (it->Seek("d"); it->Valid() && it->key().starts_with("d"); it->Next()) {
    last = it->key().ToString();
    std::string tenant;
    uint64_t id = 0;
    if (ParseKey(last, &tenant, &id)) damaged[{tenant, id}] = it->value().ToString();
  }
  scan_ended("damaged-sequence", last);
  last.clear();
  for (it->Seek("m"); it->Valid() && it->key().starts_with("m"); it->Next()) {
    last = it->key().ToString();
    SpilledSequence m;
    std::string tenant;
    uint64_t id = 0;
    if (DecodeMeta(std::string_view(it->value().data(), it->value().size()), &m) && ParseKey(last, &tenant, &id) &&
        tenant == m.tenant && id == m.id) {
      index[{m.tenant, m.id}] = m;
    } else if (ParseKey(last, &tenant, &id)) {
      damaged.emplace(std::make_pair(tenant, id), "its metadata record does not decode");
    } else {
      AddProblem("metadata record '" + Printable(last) + "' does not decode");
    }
  }
  scan_ended("metadata", last);
  // Sequences with records but no metadata: intents and pages of spills that did not finish, or,
  // after a damaged recovery, of sequences whose metadata was lost. Value: pages found.
  std::map<std::pair<std::string, uint64_t>, uint64_t> unexplained;
  std::set<std::pair<std::string, uint64_t>> intents;  // spills begun and not finished
  last.clear();
  for (it->Seek("i"); it->Valid() && it->key().starts_with("i"); it->Next()) {
    last = it->key().ToString();
    std::string tenant;
    uint64_t id = 0;
    if (ParseKey(last, &tenant, &id) && !index.count({tenant, id})) {
      unexplained.emplace(std::make_pair(tenant, id), 0);
      intents.emplace(tenant, id);
    }
  }
  scan_ended("intent", last);
  last.clear();
  it->Seek("p");
  while (it->Valid() && it->key().starts_with("p")) {
    last = it->key().ToString();
    std::string tenant;
    uint64_t id = 0;
    if (!ParseKey(last, &tenant, &id)) {
      AddProblem("page record '" + Printable(last) + "' has no sequence in its key");
      it->Next();
    } else if (index.count({tenant, id})) {
      it->Seek(PrefixEnd(PagePrefix(tenant, id)));  // pages of stored sequences are read by Verify
    } else {
      ++unexplained[{tenant, id}];
      it->Next();
    }
  }
  scan_ended("page", last);
  // Sequences the catalog lists that RocksDB no longer has: their records were lost or cannot
  // be read. Their pages are counted where they can be.
  for (const auto& [key, listed] : ReadCatalog()) {
    if (index.count(key) || damaged.count(key) || unexplained.count(key)) continue;
    uint64_t pages = 0;
    const std::string prefix = PagePrefix(key.first, key.second);
    for (it->Seek(prefix); it->Valid() && it->key().starts_with(prefix); it->Next()) ++pages;
    unexplained[key] = pages;
    complete = complete && it->status().ok();
    if (!wal_salvaged && complete) {
      damaged[key] = "its metadata is gone from the store (" + std::to_string(pages) + " pages left on disk)";
    }
  }
  uint64_t bytes = 0;
  for (const auto& [key, m] : index) bytes += m.bytes();
  for (const auto& [key, pages] : unexplained) {
    if (damaged.count(key)) continue;
    const auto& [tenant, id] = key;
    const std::string prefix = PagePrefix(tenant, id);
    rocksdb::WriteBatch batch;
    // A spill that did not finish (its intent is there, its metadata never was): not data, delete
    // it. Pages with neither an intent nor metadata cannot come from an unfinished spill (the
    // intent is written first, and goes only with the metadata's arrival or the pages' removal):
    // their metadata was lost, and they are reported, never deleted.
    if (complete && !wal_salvaged && intents.count(key)) {
      batch.Delete(IntentKey(tenant, id));
      batch.DeleteRange(prefix, PrefixEnd(prefix));
    } else {
      const std::string why = std::string(wal_salvaged ? "its records were lost to a damaged WAL"
                                          : !complete  ? "its metadata could not be read"
                                                       : "its metadata is gone from the store") +
                              " (" + std::to_string(pages) + " pages left on disk)";
      damaged[key] = why;
      batch.Put(DamagedKey(tenant, id), why);  // reported on every later start too
      batch.Delete(IntentKey(tenant, id));
    }
    const rocksdb::Status w = db_->Write(rocksdb::WriteOptions(), &batch);
    if (!w.ok()) {  // nothing more is written until the store is reopened (see RecoverWrites)
      AddProblem("recording sequence " + tenant + "/" + std::to_string(id) + ": " + w.ToString());
      write_failed_ = true;
      break;
    }
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    index_ = std::move(index);
    damaged_ = std::move(damaged);
    stored_bytes_ = bytes;
  }
  // A catalog that cannot be rewritten (a full or read-only disk) does not stop the store: the
  // sequences are in RocksDB; only the cross-check is weaker until it can be written again.
  if (const Status s = RewriteCatalog(); !s.ok()) AddProblem("the catalog was not rewritten: " + s.ToString());
  return Status::Ok();
}

Status SpillStore::RecoverWrites() {
  if (!write_failed_.load()) return Status::Ok();
  // After a failed write RocksDB refuses writes until resumed, and in this RocksDB build a
  // resumed DB aborts the process on its next WAL append (an assertion on the failed file
  // writer). Reopening the DB gives it a fresh WAL; Load then drops the failed spill's records
  // (an intent without metadata) and rebuilds the index. Nobody else uses the DB meanwhile; a
  // Verify under way lets go of it between reads, and goes on with the reopened one.
  std::unique_lock<std::shared_mutex> lock(db_mu_);
  if (!write_failed_.load()) return Status::Ok();
  if (db_) db_->Close();
  db_.reset();
  write_failed_ = false;  // Load may set it again
  if (const Status s = OpenDb(/*after_write_error=*/true); !s.ok()) {
    write_failed_ = true;
    if (!db_) {
      // What is stored stays readable (restores, claims, verify) while writes cannot reopen it
      // (a full disk: the reopen writes files too); the next Put or Delete tries again.
      rocksdb::DB* db = nullptr;
      if (rocksdb::DB::OpenForReadOnly(DbOptions(/*after_write_error=*/true), options_.dir, &db).ok()) db_.reset(db);
    }
    return s.WithContext("spill store: reopening after a write error");
  }
  ++resumes_;
  return write_failed_ ? Status::Unavailable("spill store: writes fail again after reopening") : Status::Ok();
}

Status SpillStore::Put(const SpilledSequence& meta, const std::function<const uint8_t*(uint32_t, uint32_t)>& page) {
  const auto start = std::chrono::steady_clock::now();
  const uint64_t page_bytes = meta.layout.page_bytes();
  if (page_bytes == 0 || meta.layout.n_layers == 0) return Status::InvalidArgument("spill: empty page layout");
  if (Find(meta.tenant, meta.id).ok()) {
    return Status::AlreadyExists("sequence " + std::to_string(meta.id) + " of tenant " + meta.tenant + " is spilled");
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (damaged_.count({meta.tenant, meta.id})) {
      return Status::AlreadyExists("sequence " + std::to_string(meta.id) + " of tenant " + meta.tenant +
                                   " is a damaged spill: evict it first");
    }
  }
  if (options_.max_bytes > 0 && stored_bytes_.load() + meta.bytes() > options_.max_bytes) {
    return Status::ResourceExhausted("spill tier full: " + std::to_string(stored_bytes_.load()) + " of " +
                                     std::to_string(options_.max_bytes) + " bytes used, sequence needs " +
                                     std::to_string(meta.bytes()));
  }
  SPECACHE_RETURN_IF_ERROR(RecoverWrites());
  std::shared_lock<std::shared_mutex> db_lock(db_mu_);
  if (!db_) return Status::Unavailable("spill store " + options_.dir + " is closed after a write error");
  auto undo = [&](const Status& why) {
    // Nothing more is written after a failed write (see RecoverWrites): the intent marks what was
    // written as an unfinished spill, which the reopen deletes.
    ++write_errors_;
    write_failed_ = true;
    return why;
  };
  // The intent first, in a record of its own: if the WAL loses the pages or the metadata, the
  // intent still names the sequence.
  if (const rocksdb::Status s = db_->Put(rocksdb::WriteOptions(), IntentKey(meta.tenant, meta.id), EncodeMeta(meta));
      !s.ok()) {
    return undo(FromRocks(s, "spill: writing the intent record"));
  }
  rocksdb::WriteBatch batch;
  std::string value(kChecksumBytes + page_bytes, '\0');
  for (uint32_t l = 0; l < meta.layout.n_layers; ++l) {
    for (uint32_t p = 0; p < meta.pages_per_layer; ++p) {
      const uint8_t* data = page(l, p);
      if (data == nullptr) return undo(Status::Internal("spill: page " + PageName(meta, l, p) + " has no memory"));
      // The copy first, then its checksum: the page may be in memory a client still maps (a kept
      // sequence written through), and a checksum of the page taken before the copy could be of
      // other bytes than those stored.
      std::memcpy(value.data() + kChecksumBytes, data, page_bytes);
      const uint64_t sum = XXH64(value.data() + kChecksumBytes, page_bytes, 0);
      std::memcpy(value.data(), &sum, kChecksumBytes);
      rocksdb::Status s = batch.Put(PageKey(meta.tenant, meta.id, l, p), value);
      if (s.ok() && batch.GetDataSize() >= kBatchBytes) {
        s = db_->Write(rocksdb::WriteOptions(), &batch);
        batch.Clear();
      }
      if (!s.ok()) {
        return undo(FromRocks(s, "spill: writing " + PageName(meta, l, p)));
      }
    }
  }
  SpilledSequence stored = meta;
  stored.fingerprint = LayoutFingerprint(meta.layout);
  stored.spilled_unix_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                               std::chrono::system_clock::now().time_since_epoch()).count();
  SPECACHE_RETURN_IF_ERROR(FromRocks(batch.Put(MetaKey(meta.tenant, meta.id), EncodeMeta(stored)), "spill: metadata"));
  SPECACHE_RETURN_IF_ERROR(FromRocks(batch.Delete(IntentKey(meta.tenant, meta.id)), "spill: metadata"));
  rocksdb::WriteOptions durable;
  durable.sync = true;  // the WAL up to here reaches the disk: the pages and then the metadata
  const rocksdb::Status s = db_->Write(durable, &batch);
  if (!s.ok()) {
    return undo(FromRocks(s, "spill: writing the last pages and the metadata"));
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    index_[{meta.tenant, meta.id}] = stored;
  }
  AppendCatalog("put", meta.tenant, meta.id);
  stored_bytes_ += stored.bytes();
  ++spills_;
  spilled_total_ += stored.bytes();
  spill_ns_ += std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count();
  return Status::Ok();
}

Status SpillStore::ReadLayers(const SpilledSequence& meta, uint32_t first_layer, uint32_t end_layer,
                              const std::function<uint8_t*(uint32_t, uint32_t)>& out) {
  const uint64_t page_bytes = meta.layout.page_bytes();
  rocksdb::ReadOptions ro;
  ro.verify_checksums = false;  // every page carries its own xxh64, checked below
  ro.fill_cache = false;
  ro.readahead_size = size_t{8} << 20;
  const std::string end = end_layer < meta.layout.n_layers ? PageKey(meta.tenant, meta.id, end_layer, 0)
                                                            : PrefixEnd(PagePrefix(meta.tenant, meta.id));
  rocksdb::Slice upper(end);
  ro.iterate_upper_bound = &upper;
  std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(ro));
  it->Seek(PageKey(meta.tenant, meta.id, first_layer, 0));
  for (uint32_t l = first_layer; l < end_layer; ++l) {
    for (uint32_t p = 0; p < meta.pages_per_layer; ++p, it->Next()) {  // keys sort by (layer, page)
      if (!it->Valid() || it->key() != rocksdb::Slice(PageKey(meta.tenant, meta.id, l, p))) {
        CountBadPage(it->status());
        if (!it->status().ok()) return FromRocks(it->status(), "restore: reading " + PageName(meta, l, p));
        return Status::DataLoss("restore: page " + PageName(meta, l, p) + " is missing from the spill store");
      }
      const std::string why = CheckPage(std::string_view(it->value().data(), it->value().size()), page_bytes);
      if (!why.empty()) {
        CountBadPage(rocksdb::Status::OK());
        return Status::DataLoss("restore: page " + PageName(meta, l, p) + ": " + why);
      }
      uint8_t* dst = out(l, p);
      if (dst == nullptr) return Status::Internal("restore: no memory for page " + PageName(meta, l, p));
      std::memcpy(dst, it->value().data() + kChecksumBytes, page_bytes);
    }
  }
  return Status::Ok();
}

Status SpillStore::Get(const std::string& tenant, uint64_t id, const std::function<uint8_t*(uint32_t, uint32_t)>& out) {
  const auto start = std::chrono::steady_clock::now();
  std::shared_lock<std::shared_mutex> db_lock(db_mu_);
  if (!db_) return Status::Unavailable("spill store " + options_.dir + " is closed after a write error");
  SPECACHE_ASSIGN_OR_RETURN(SpilledSequence meta, Find(tenant, id));
  // Layers are read by a few threads at once: each one a sequential run of keys, together a
  // deeper queue for the device and more cores for the copies and checksums.
  const uint32_t layers = meta.layout.n_layers;
  const uint32_t threads = std::min<uint32_t>(layers, kRestoreThreads);
  std::vector<Status> results(threads, Status::Ok());
  std::vector<std::thread> workers;
  for (uint32_t t = 0; t < threads; ++t) {
    const uint32_t first = layers * t / threads, end = layers * (t + 1) / threads;
    workers.emplace_back([&, t, first, end] { results[t] = ReadLayers(meta, first, end, out); });
  }
  for (auto& w : workers) w.join();
  for (const Status& s : results) SPECACHE_RETURN_IF_ERROR(s);
  ++restores_;
  restored_total_ += meta.bytes();
  restore_ns_ += std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count();
  return Status::Ok();
}

Status SpillStore::Delete(const std::string& tenant, uint64_t id) {
  SPECACHE_ASSIGN_OR_RETURN(SpilledSequence meta, Find(tenant, id));
  SPECACHE_RETURN_IF_ERROR(RecoverWrites());
  std::shared_lock<std::shared_mutex> db_lock(db_mu_);
  if (!db_) return Status::Unavailable("spill store " + options_.dir + " is closed after a write error");
  AppendCatalog("del", tenant, id);  // first: a crash in between leaves a stored sequence unlisted, not a false loss
  rocksdb::WriteBatch batch;
  const std::string prefix = PagePrefix(tenant, id);
  batch.Delete(MetaKey(tenant, id));  // first: without metadata the pages are never data again
  batch.DeleteRange(prefix, PrefixEnd(prefix));
  {  // Out of the index before its records go: a Verify that finds a page missing then sees the
     // sequence gone too, and does not report a claimed sequence as lost.
    std::lock_guard<std::mutex> lock(mu_);
    index_.erase({tenant, id});
  }
  // Synced: a delete lost with the WAL's tail (a power loss) would bring a claimed or evicted
  // sequence back at the next start, to be claimed a second time or counted against its tenant.
  rocksdb::WriteOptions durable;
  durable.sync = true;
  if (const rocksdb::Status s = db_->Write(durable, &batch); !s.ok()) {
    write_failed_ = true;  // nothing more is written until the store is reopened (see RecoverWrites)
    std::lock_guard<std::mutex> lock(mu_);
    index_[{tenant, id}] = meta;
    return FromRocks(s, "spill store: delete");
  }
  stored_bytes_ -= meta.bytes();
  return Status::Ok();
}

Result<SpilledSequence> SpillStore::Find(const std::string& tenant, uint64_t id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = index_.find({tenant, id});
  if (it == index_.end()) {
    return Status::NotFound("sequence " + std::to_string(id) + " of tenant " + tenant + " is not spilled");
  }
  return it->second;
}

std::vector<SpilledSequence> SpillStore::List(const std::string& tenant) const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<SpilledSequence> out;
  for (const auto& [key, m] : index_) {
    if (tenant.empty() || key.first == tenant) out.push_back(m);
  }
  return out;
}

uint64_t SpillStore::max_id() const {
  uint64_t id = 0;
  for (const SpilledSequence& m : List()) id = std::max(id, m.id);
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [key, why] : damaged_) id = std::max(id, key.second);  // never reused either
  return id;
}

void SpillStore::CountBadPage(const rocksdb::Status& read) {
  // A page RocksDB finds corrupted (its block checksum) is a checksum failure as much as one whose
  // own xxh64 does not match; any other error (I/O) says nothing about the bytes on disk.
  const bool read_failed = !read.ok() && !read.IsNotFound() && !read.IsCorruption();
  ++(read_failed ? read_errors_ : checksum_failures_);
}

SpillVerifyReport SpillStore::Verify() {
  SpillVerifyReport r;
  if (!VerifyMetadata(&r)) {
    r.bad.push_back("spill store: closed after a write error, nothing could be read");
    return r;
  }
  for (const SpilledSequence& m : List()) {
    ++r.sequences;
    if (!VerifyPages(m, &r)) {
      r.bad.push_back("spill store: closed after a write error during the check: " + m.tenant + "/" +
                      std::to_string(m.id) + " and the sequences after it were not checked");
      break;
    }
  }
  for (const std::string& p : problems()) r.bad.push_back(p);
  return r;
}

bool SpillStore::VerifyMetadata(SpillVerifyReport* r) {
  std::shared_lock<std::shared_mutex> db_lock(db_mu_);
  if (!db_) return false;
  // Pages spilled since the last flush are only in the memtable (and the WAL): flushed first,
  // every page is then read from an SST file, and with no block cache, from the file itself.
  rocksdb::FlushOptions flush;
  flush.wait = true;
  if (const rocksdb::Status s = db_->Flush(flush); !s.ok()) {
    r->bad.push_back("spill store: flushing before the check failed, recent pages were checked in memory: " +
                     s.ToString());
  }
  // The metadata records as they are on disk now.
  std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(CheckedReads()));
  std::string last;
  for (it->Seek("m"); it->Valid() && it->key().starts_with("m"); it->Next()) last = it->key().ToString();
  if (!it->status().ok()) {
    // Reported by problems() from now on (and so in `bad`); logged once, as it is first found.
    const std::string what =
        "metadata records after '" + Printable(last) + "' could not be read: " + it->status().ToString();
    if (AddProblem(what)) spdlog::error("spill store {}: {}", options_.dir, what);
  }
  return true;
}

bool SpillStore::VerifyPages(const SpilledSequence& m, SpillVerifyReport* r) {
  const rocksdb::ReadOptions ro = CheckedReads();
  const uint64_t page_bytes = m.layout.page_bytes();
  for (uint32_t l = 0; l < m.layout.n_layers; ++l) {
    for (uint32_t p = 0; p < m.pages_per_layer; ++p) {
      std::string value;
      rocksdb::Status s;
      {  // one read: a reopen after a write error waits for this page only (see Verify)
        std::shared_lock<std::shared_mutex> db_lock(db_mu_);
        if (!db_) return false;
        s = db_->Get(ro, PageKey(m.tenant, m.id, l, p), &value);
      }
      ++r->pages_checked;
      const std::string why = s.ok() ? CheckPage(value, page_bytes) : (s.IsNotFound() ? "missing" : s.ToString());
      if (why.empty()) continue;
      if (!Find(m.tenant, m.id).ok()) return true;  // claimed or evicted while being checked: not a loss
      ++r->pages_bad;
      CountBadPage(s);
      r->bad.push_back(m.tenant + "/" + std::to_string(m.id) + "/" + std::to_string(l) + "/" + std::to_string(p) +
                       ": " + why);
    }
  }
  return true;
}

std::vector<std::string> SpillStore::problems() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::string> out;
  for (const auto& [key, why] : damaged_) out.push_back(key.first + "/" + std::to_string(key.second) + ": " + why);
  for (const std::string& why : unreadable_) out.push_back("spill store: " + why);
  return out;
}

Status SpillStore::DeleteDamaged(uint64_t id) {
  std::vector<std::string> tenants;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [key, why] : damaged_) {
      if (key.second == id) tenants.push_back(key.first);
    }
  }
  if (tenants.empty()) return Status::NotFound("sequence " + std::to_string(id) + " is not damaged");
  SPECACHE_RETURN_IF_ERROR(RecoverWrites());
  std::shared_lock<std::shared_mutex> db_lock(db_mu_);
  if (!db_) return Status::Unavailable("spill store " + options_.dir + " is closed after a write error");
  rocksdb::WriteBatch batch;
  for (const std::string& tenant : tenants) {
    const std::string prefix = PagePrefix(tenant, id);
    batch.Delete(DamagedKey(tenant, id));
    batch.Delete(MetaKey(tenant, id));
    batch.Delete(IntentKey(tenant, id));
    batch.DeleteRange(prefix, PrefixEnd(prefix));
  }
  for (const std::string& tenant : tenants) AppendCatalog("del", tenant, id);
  rocksdb::WriteOptions durable;  // synced, as Delete's
  durable.sync = true;
  if (const rocksdb::Status s = db_->Write(durable, &batch); !s.ok()) {
    write_failed_ = true;
    return FromRocks(s, "spill store: delete");
  }
  std::lock_guard<std::mutex> lock(mu_);
  for (const std::string& tenant : tenants) damaged_.erase({tenant, id});
  return Status::Ok();
}

SpillStats SpillStore::stats() const {
  SpillStats s;
  s.stored_bytes = stored_bytes_.load();
  {
    std::lock_guard<std::mutex> lock(mu_);
    s.sequences = index_.size();
    s.damaged_sequences = damaged_.size();
  }
  s.unreadable_records = unreadable_records_.load();
  s.resumes = resumes_.load();
  s.spills = spills_.load();
  s.restores = restores_.load();
  s.spilled_bytes_total = spilled_total_.load();
  s.restored_bytes_total = restored_total_.load();
  s.checksum_failures = checksum_failures_.load();
  s.read_errors = read_errors_.load();
  s.write_errors = write_errors_.load();
  s.spill_seconds = spill_ns_.load() * 1e-9;
  s.restore_seconds = restore_ns_.load() * 1e-9;
  return s;
}

}  // namespace specache
