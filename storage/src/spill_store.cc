#include "specache/spill_store.h"

#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>
#include <thread>

#include <rocksdb/db.h>
#include <rocksdb/options.h>
#include <rocksdb/write_batch.h>
#include <xxhash.h>

namespace specache {
namespace {

constexpr uint32_t kMetaVersion = 1;
constexpr size_t kChecksumBytes = 8;
constexpr size_t kBatchBytes = size_t{8} << 20;  // pages per write batch, by bytes
constexpr uint32_t kRestoreThreads = 4;

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
std::string PagePrefix(const std::string& tenant, uint64_t id) { return SequencePrefix('p', tenant, id); }
std::string PageKey(const std::string& tenant, uint64_t id, uint32_t layer, uint32_t page) {
  return PagePrefix(tenant, id) + Hex(layer, 8) + Hex(page, 8);
}
// The key just after every key starting with `prefix`.
std::string PrefixEnd(std::string prefix) {
  prefix.push_back('\xff');
  return prefix;
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
  Put(&out, kMetaVersion);
  Put(&out, static_cast<uint32_t>(m.tenant.size()));
  out += m.tenant;
  Put(&out, m.id);
  for (uint32_t f : {m.layout.n_layers, m.layout.n_kv_heads, m.layout.head_dim, m.layout.page_tokens,
                     m.layout.capacity_tokens, m.pages_per_layer}) {
    Put(&out, f);
  }
  Put(&out, m.fingerprint);
  Put(&out, m.spilled_unix_ms);
  return out;
}

bool DecodeMeta(std::string_view in, SpilledSequence* m) {
  uint32_t version = 0, tenant_size = 0;
  if (!Take(&in, &version) || version != kMetaVersion || !Take(&in, &tenant_size) || in.size() < tenant_size) return false;
  m->tenant.assign(in.data(), tenant_size);
  in.remove_prefix(tenant_size);
  uint32_t* fields[] = {&m->layout.n_layers, &m->layout.n_kv_heads, &m->layout.head_dim, &m->layout.page_tokens,
                        &m->layout.capacity_tokens, &m->pages_per_layer};
  if (!Take(&in, &m->id)) return false;
  for (uint32_t* f : fields) {
    if (!Take(&in, f)) return false;
  }
  return Take(&in, &m->fingerprint) && Take(&in, &m->spilled_unix_ms) && in.empty();
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

// RocksDB's own LOG file would live on the spill disk, and once that disk is full, writing it
// fails in ways this RocksDB build asserts on. Every error we act on comes back as a Status, so
// its diagnostics log is not kept.
class NoLogger final : public rocksdb::Logger {
 public:
  NoLogger() : rocksdb::Logger(rocksdb::InfoLogLevel::FATAL_LEVEL) {}
  using rocksdb::Logger::Logv;
  void Logv(const char*, va_list) override {}
};

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
  const uint32_t fields[] = {l.n_layers, l.n_kv_heads, l.head_dim, l.page_tokens, l.capacity_tokens};
  return XXH64(fields, sizeof fields, 0x5eca);
}

Result<std::unique_ptr<SpillStore>> SpillStore::Open(const SpillOptions& options) {
  if (options.dir.empty()) return Status::InvalidArgument("spill directory is empty");
  std::unique_ptr<SpillStore> store(new SpillStore(options));
  rocksdb::Options o;
  o.create_if_missing = true;
  o.compression = options.compression ? rocksdb::kLZ4Compression : rocksdb::kNoCompression;
  o.max_background_jobs = 2;
  // Pages are written once, read back whole and deleted whole: large memtables and a late L0
  // compaction keep the bytes rewritten by compactions low.
  o.write_buffer_size = uint64_t{256} << 20;
  o.level0_file_num_compaction_trigger = 8;
  o.target_file_size_base = uint64_t{256} << 20;
  o.use_direct_reads = SupportsDirectIo(options.dir);  // restores read straight from the device
  o.info_log = std::make_shared<NoLogger>();
  rocksdb::DB* db = nullptr;
  SPECACHE_RETURN_IF_ERROR(FromRocks(rocksdb::DB::Open(o, options.dir, &db), "open spill store " + options.dir));
  store->db_.reset(db);
  SPECACHE_RETURN_IF_ERROR(store->Load());
  return store;
}

SpillStore::SpillStore(const SpillOptions& options) : options_(options) {}

SpillStore::~SpillStore() {
  if (db_) db_->Close();
}

Status SpillStore::Load() {
  std::lock_guard<std::mutex> lock(mu_);
  uint64_t bytes = 0;
  std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(rocksdb::ReadOptions()));
  for (it->Seek("m"); it->Valid() && it->key().starts_with("m"); it->Next()) {
    SpilledSequence m;
    if (!DecodeMeta(std::string_view(it->value().data(), it->value().size()), &m)) {
      return Status::DataLoss("spill store: unreadable metadata record " + it->key().ToString(true));
    }
    bytes += m.bytes();
    index_[{m.tenant, m.id}] = m;
  }
  // Pages no metadata claims: a spill that did not finish. They are not data; delete them.
  std::vector<std::pair<std::string, std::string>> orphans;
  for (it->Seek("p"); it->Valid() && it->key().starts_with("p"); it->Next()) {
    const std::string key = it->key().ToString();
    const size_t zero = key.find('\0');
    if (zero == std::string::npos || key.size() < zero + 1 + 16) continue;
    const std::string tenant = key.substr(1, zero - 1);
    const uint64_t id = std::strtoull(key.substr(zero + 1, 16).c_str(), nullptr, 16);
    if (!index_.count({tenant, id})) {
      const std::string prefix = PagePrefix(tenant, id);
      orphans.push_back({prefix, PrefixEnd(prefix)});
      it->Seek(PrefixEnd(prefix));
      if (!it->Valid()) break;
      it->Prev();
    }
  }
  for (const auto& [from, to] : orphans) {
    SPECACHE_RETURN_IF_ERROR(FromRocks(db_->DeleteRange(rocksdb::WriteOptions(), db_->DefaultColumnFamily(), from, to),
                                       "spill store: deleting an unfinished spill"));
  }
  stored_bytes_ = bytes;
  return Status::Ok();
}

Status SpillStore::Put(const SpilledSequence& meta, const std::function<const uint8_t*(uint32_t, uint32_t)>& page) {
  const auto start = std::chrono::steady_clock::now();
  const uint64_t page_bytes = meta.layout.page_bytes();
  if (page_bytes == 0 || meta.layout.n_layers == 0) return Status::InvalidArgument("spill: empty page layout");
  if (Find(meta.tenant, meta.id).ok()) {
    return Status::AlreadyExists("sequence " + std::to_string(meta.id) + " of tenant " + meta.tenant + " is spilled");
  }
  if (options_.max_bytes > 0 && stored_bytes_.load() + meta.bytes() > options_.max_bytes) {
    return Status::ResourceExhausted("spill tier full: " + std::to_string(stored_bytes_.load()) + " of " +
                                     std::to_string(options_.max_bytes) + " bytes used, sequence needs " +
                                     std::to_string(meta.bytes()));
  }
  const std::string prefix = PagePrefix(meta.tenant, meta.id);
  auto undo = [&](const Status& why) {
    ++write_errors_;
    (void)db_->DeleteRange(rocksdb::WriteOptions(), db_->DefaultColumnFamily(), prefix, PrefixEnd(prefix));
    return why;
  };
  rocksdb::WriteBatch batch;
  std::string value(kChecksumBytes + page_bytes, '\0');
  for (uint32_t l = 0; l < meta.layout.n_layers; ++l) {
    for (uint32_t p = 0; p < meta.pages_per_layer; ++p) {
      const uint8_t* data = page(l, p);
      if (data == nullptr) return undo(Status::Internal("spill: page " + PageName(meta, l, p) + " has no memory"));
      const uint64_t sum = XXH64(data, page_bytes, 0);
      std::memcpy(value.data(), &sum, kChecksumBytes);
      std::memcpy(value.data() + kChecksumBytes, data, page_bytes);
      rocksdb::Status s = batch.Put(PageKey(meta.tenant, meta.id, l, p), value);
      if (s.ok() && batch.GetDataSize() >= kBatchBytes) {
        s = db_->Write(rocksdb::WriteOptions(), &batch);
        batch.Clear();
      }
      if (!s.ok()) return undo(FromRocks(s, "spill: writing " + PageName(meta, l, p)));
    }
  }
  SpilledSequence stored = meta;
  stored.fingerprint = LayoutFingerprint(meta.layout);
  stored.spilled_unix_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                               std::chrono::system_clock::now().time_since_epoch()).count();
  SPECACHE_RETURN_IF_ERROR(FromRocks(batch.Put(MetaKey(meta.tenant, meta.id), EncodeMeta(stored)), "spill: metadata"));
  rocksdb::WriteOptions durable;
  durable.sync = true;  // the WAL up to here reaches the disk: the pages and then the metadata
  const rocksdb::Status s = db_->Write(durable, &batch);
  if (!s.ok()) return undo(FromRocks(s, "spill: writing the last pages and the metadata"));
  {
    std::lock_guard<std::mutex> lock(mu_);
    index_[{meta.tenant, meta.id}] = stored;
  }
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
        ++checksum_failures_;
        if (!it->status().ok()) return FromRocks(it->status(), "restore: reading " + PageName(meta, l, p));
        return Status::DataLoss("restore: page " + PageName(meta, l, p) + " is missing from the spill store");
      }
      const std::string why = CheckPage(std::string_view(it->value().data(), it->value().size()), page_bytes);
      if (!why.empty()) {
        ++checksum_failures_;
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
  rocksdb::WriteBatch batch;
  const std::string prefix = PagePrefix(tenant, id);
  batch.Delete(MetaKey(tenant, id));  // first: without metadata the pages are never data again
  batch.DeleteRange(prefix, PrefixEnd(prefix));
  SPECACHE_RETURN_IF_ERROR(FromRocks(db_->Write(rocksdb::WriteOptions(), &batch), "spill store: delete"));
  {
    std::lock_guard<std::mutex> lock(mu_);
    index_.erase({tenant, id});
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
  return id;
}

SpillVerifyReport SpillStore::Verify() {
  SpillVerifyReport r;
  for (const SpilledSequence& m : List()) {
    ++r.sequences;
    const uint64_t page_bytes = m.layout.page_bytes();
    for (uint32_t l = 0; l < m.layout.n_layers; ++l) {
      for (uint32_t p = 0; p < m.pages_per_layer; ++p) {
        ++r.pages_checked;
        std::string value;
        const rocksdb::Status s = db_->Get(rocksdb::ReadOptions(), PageKey(m.tenant, m.id, l, p), &value);
        const std::string why = s.ok() ? CheckPage(value, page_bytes) : (s.IsNotFound() ? "missing" : s.ToString());
        if (!why.empty()) {
          ++r.pages_bad;
          r.bad.push_back(m.tenant + "/" + std::to_string(m.id) + "/" + std::to_string(l) + "/" + std::to_string(p) +
                          ": " + why);
        }
      }
    }
  }
  checksum_failures_ += r.pages_bad;
  return r;
}

SpillStats SpillStore::stats() const {
  SpillStats s;
  s.stored_bytes = stored_bytes_.load();
  {
    std::lock_guard<std::mutex> lock(mu_);
    s.sequences = index_.size();
  }
  s.spills = spills_.load();
  s.restores = restores_.load();
  s.spilled_bytes_total = spilled_total_.load();
  s.restored_bytes_total = restored_total_.load();
  s.checksum_failures = checksum_failures_.load();
  s.write_errors = write_errors_.load();
  s.spill_seconds = spill_ns_.load() * 1e-9;
  s.restore_seconds = restore_ns_.load() * 1e-9;
  return s;
}

}  // namespace specache
