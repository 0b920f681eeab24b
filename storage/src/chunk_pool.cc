#include "specache/chunk_pool.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <thread>

namespace specache {
namespace {

constexpr uint64_t kPageSize = 4096;

Status Errno(const std::string& what) {
  const int e = errno;
  const std::string msg = what + ": " + std::strerror(e);
  if (e == ENOMEM || e == EMFILE || e == ENFILE) return Status::ResourceExhausted(msg);
  if (e == EPERM || e == EACCES) return Status::PermissionDenied(msg);
  return Status::Internal(msg);
}

// Touches every page of [data, data + bytes) with several threads, so the memory is resident
// before a client needs it.
void Prefault(uint8_t* data, uint64_t bytes, int threads) {
  threads = std::max(1, threads);
  const uint64_t pages = bytes / kPageSize;
  std::vector<std::thread> workers;
  for (int t = 0; t < threads; ++t) {
    workers.emplace_back([=] {
      for (uint64_t p = pages * t / threads; p < pages * (t + 1) / threads; ++p) {
        *reinterpret_cast<volatile uint8_t*>(data + p * kPageSize) = 0;
      }
    });
  }
  for (auto& w : workers) w.join();
}

}  // namespace

Result<std::unique_ptr<ChunkPool>> ChunkPool::Create(const ChunkPoolOptions& o) {
  if (o.chunk_bytes == 0 || o.chunk_bytes % kPageSize != 0) {
    return Status::InvalidArgument("chunk_bytes must be a positive multiple of 4096");
  }
  if (o.pool_bytes < o.chunk_bytes) return Status::InvalidArgument("pool_bytes must hold at least one chunk");
  std::unique_ptr<ChunkPool> pool(new ChunkPool(o));
  const uint64_t n = o.pool_bytes / o.chunk_bytes;
  pool->chunks_.resize(n);
  // Chunks are created one after another, each pre-faulted by all threads.
  for (Chunk& c : pool->chunks_) SPECACHE_RETURN_IF_ERROR(pool->MakeChunk(&c, true));
  return pool;
}

ChunkPool::~ChunkPool() {
  for (Chunk& c : chunks_) Unmap(&c, options_.chunk_bytes);
}

void ChunkPool::Unmap(Chunk* c, uint64_t bytes) {
  if (c->data) munmap(c->data, bytes);
  if (c->fd >= 0) close(c->fd);
  c->data = nullptr;
  c->fd = -1;
}

Status ChunkPool::MakeChunk(Chunk* c, bool prefault) {
  const int fd = memfd_create("specache-chunk", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) return Errno("memfd_create");
  if (ftruncate(fd, static_cast<off_t>(options_.chunk_bytes)) != 0) {
    Status s = Errno("ftruncate chunk");
    close(fd);
    return s;
  }
  // Clients map chunks; none may resize them under the daemon (SIGBUS on its side).
  if (fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    Status s = Errno("seal chunk");
    close(fd);
    return s;
  }
  void* p = mmap(nullptr, options_.chunk_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    Status s = Errno("mmap chunk");
    close(fd);
    return s;
  }
  c->fd = fd;
  c->data = static_cast<uint8_t*>(p);
  if (prefault) Prefault(c->data, options_.chunk_bytes, options_.prefault_threads);
  if (options_.lock_memory && mlock(c->data, options_.chunk_bytes) != 0) locked_ = false;
  if (!options_.lock_memory) locked_ = false;
  return Status::Ok();
}

Result<std::vector<uint32_t>> ChunkPool::Take(uint32_t n, uint64_t owner) {
  if (owner == 0) return Status::InvalidArgument("owner 0 is reserved");
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<uint32_t> taken;
  for (uint32_t i = 0; i < chunks_.size() && taken.size() < n; ++i) {
    if (chunks_[i].owner == 0 && chunks_[i].data) taken.push_back(i);
  }
  if (taken.size() < n) {
    return Status::ResourceExhausted("pool has " + std::to_string(taken.size()) + " free chunks of " +
                                     std::to_string(options_.chunk_bytes >> 20) + " MiB, " + std::to_string(n) +
                                     " requested");
  }
  for (uint32_t i : taken) chunks_[i].owner = owner;
  return taken;
}

Status ChunkPool::Return(std::span<const uint32_t> ids, bool owner_may_still_map) {
  Status first = Status::Ok();
  for (uint32_t id : ids) {
    if (id >= chunks_.size()) return Status::OutOfRange("chunk " + std::to_string(id));
    Chunk& c = chunks_[id];
    if (owner_may_still_map) {
      // New memory for the pool; the old pages stay with whoever still maps them.
      Chunk fresh;
      Status s = MakeChunk(&fresh, true);
      std::lock_guard<std::mutex> lock(mu_);
      Unmap(&c, options_.chunk_bytes);
      if (s.ok()) {
        c.fd = fresh.fd;
        c.data = fresh.data;
        ++replaced_;
      } else if (first.ok()) {
        first = s.WithContext("replacing chunk " + std::to_string(id) + " (it leaves the pool)");
      }
      c.owner = 0;
    } else {
      std::memset(c.data, 0, options_.chunk_bytes);
      std::lock_guard<std::mutex> lock(mu_);
      c.owner = 0;
    }
  }
  return first;
}

int ChunkPool::fd(uint32_t chunk) const {
  std::lock_guard<std::mutex> lock(mu_);
  return chunk < chunks_.size() ? chunks_[chunk].fd : -1;
}

uint8_t* ChunkPool::data(uint32_t chunk) const {
  std::lock_guard<std::mutex> lock(mu_);
  return chunk < chunks_.size() ? chunks_[chunk].data : nullptr;
}

uint32_t ChunkPool::free_count() const {
  std::lock_guard<std::mutex> lock(mu_);
  uint32_t n = 0;
  for (const Chunk& c : chunks_) n += c.owner == 0 && c.data != nullptr;
  return n;
}

uint64_t ChunkPool::replaced_chunks() const {
  std::lock_guard<std::mutex> lock(mu_);
  return replaced_;
}

}  // namespace specache
