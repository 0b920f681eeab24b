#include "specache/chunk_pool.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "specache/chunk_mapping.h"

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
  pool->mapped_at_start_ = pool->mapping();
  return pool;
}

ChunkPool::~ChunkPool() {
  for (Chunk& c : chunks_) {
    Unmap(&c, options_.chunk_bytes);
    if (c.holder_pidfd >= 0) close(c.holder_pidfd);
  }
  for (const Retained& r : retained_) {
    close(r.probe);
    if (r.pidfd >= 0) close(r.pidfd);
  }
}

void ChunkPool::Unmap(Chunk* c, uint64_t bytes) {
  if (c->data) munmap(c->data, bytes);
  if (c->fd >= 0) close(c->fd);
  if (c->probe >= 0) close(c->probe);
  c->data = nullptr;
  c->fd = c->probe = -1;
}

namespace {

// A new open file description of the memfd behind `fd` (a reopen through /proc, unlike dup).
int Reopen(int fd) {
  const std::string path = "/proc/self/fd/" + std::to_string(fd);
  return open(path.c_str(), O_RDWR | O_CLOEXEC);
}

}  // namespace

bool ChunkPool::HeldElsewhere(int probe, bool* unknown) {
  // A memfd's own descriptor does not count as an open for writing; every reopen does. So the
  // lease on the probe is granted only when the probe is the one open file of the chunk.
  if (fcntl(probe, F_SETLEASE, F_WRLCK) == 0) {
    fcntl(probe, F_SETLEASE, F_UNLCK);
    return false;
  }
  if (errno != EAGAIN) *unknown = true;  // leases disabled (fs.leases-enable = 0) or not allowed
  return true;
}

Status ChunkPool::MakeChunk(Chunk* c, bool prefault) {
  const int fd = memfd_create("specache-chunk", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) return Errno("memfd_create");
  // The daemon's alone (a memfd is made 0777): a client's own open files come from ShareFd, and
  // one that kept only a path to the chunk (an O_PATH descriptor, which no lease probe sees)
  // cannot open it again once the chunk is scrubbed and given to the next owner.
  if (fchmod(fd, 0600) != 0) {
    Status s = Errno("fchmod chunk");
    close(fd);
    return s;
  }
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
  const int probe = Reopen(fd);
  if (probe < 0) {
    Status s = Errno("reopen chunk through /proc/self/fd");
    close(fd);
    return s;
  }
  void* p = MapChunk(fd, options_.chunk_bytes, options_.huge_pages);
  if (p == MAP_FAILED) {
    Status s = Errno("mmap chunk");
    close(fd);
    close(probe);
    return s;
  }
  c->fd = fd;
  c->probe = probe;
  c->data = static_cast<uint8_t*>(p);
  if (prefault) Prefault(c->data, options_.chunk_bytes, options_.prefault_threads);
  if (options_.lock_memory && mlock(c->data, options_.chunk_bytes) != 0) locked_ = false;
  if (!options_.lock_memory) locked_ = false;
  return Status::Ok();
}

Result<int> ChunkPool::ShareFd(uint32_t chunk) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (chunk >= chunks_.size() || chunks_[chunk].fd < 0) return Status::OutOfRange("chunk " + std::to_string(chunk));
  const int fd = Reopen(chunks_[chunk].fd);
  if (fd < 0) return Errno("reopen chunk " + std::to_string(chunk));
  chunks_[chunk].shared = true;
  return fd;
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
  for (uint32_t i : taken) {
    chunks_[i].owner = owner;
    chunks_[i].shared = false;
  }
  return taken;
}

Status ChunkPool::Return(std::span<const uint32_t> ids, uint64_t owner, uint64_t holder, int owner_pidfd) {
  // Every chunk must be the caller's, and named once: a chunk freed twice would be handed to two
  // owners, and one freed by someone else would be taken from under its owner.
  {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<bool> seen(chunks_.size(), false);
    for (uint32_t id : ids) {
      if (id >= chunks_.size()) return Status::OutOfRange("chunk " + std::to_string(id));
      if (seen[id]) return Status::FailedPrecondition("chunk " + std::to_string(id) + " is returned twice in one call");
      seen[id] = true;
      const uint64_t taken_by = chunks_[id].owner;
      if (taken_by == 0 || taken_by == kOutOfService) {
        return Status::FailedPrecondition("chunk " + std::to_string(id) + " is not taken (" +
                                          (taken_by == 0 ? "free" : "out of service") + "): nothing was returned");
      }
      if (taken_by != owner) {
        return Status::PermissionDenied("chunk " + std::to_string(id) + " belongs to owner " + std::to_string(taken_by) +
                                        ", not " + std::to_string(owner) + ": nothing was returned");
      }
    }
  }
  // A chunk nobody else holds is zeroed and free at once. A holder may be letting go just now (the
  // daemon's attach thread closing its copies of the descriptors it sent, a client's last unmap
  // racing its close request): such chunks get up to kLetGoMs, polled, before they are replaced.
  std::vector<uint32_t> held;
  auto free_unless_held = [&](uint32_t id) {
    Chunk& c = chunks_[id];  // the returning owner's alone until owner is reset
    bool unknown = false;
    bool shared = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      shared = c.shared;
    }
    if ((shared && HeldElsewhere(c.probe, &unknown)) || !Scrub(c)) return false;
    std::lock_guard<std::mutex> lock(mu_);
    c.owner = 0;
    return true;
  };
  for (uint32_t id : ids) {
    if (!free_unless_held(id)) held.push_back(id);
  }
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::milliseconds(kLetGoMs);
  while (!held.empty() && std::chrono::steady_clock::now() < give_up) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    std::erase_if(held, free_unless_held);
  }
  Status first = Status::Ok();
  for (uint32_t id : held) {
    Chunk& c = chunks_[id];
    c.holder = holder;
    c.holder_pidfd = owner_pidfd >= 0 ? fcntl(owner_pidfd, F_DUPFD_CLOEXEC, 0) : -1;
    if (Status s = Replace(&c); !s.ok()) {
      std::lock_guard<std::mutex> lock(mu_);
      c.owner = kOutOfService;  // still the pool's: Housekeep replaces it later
      if (first.ok()) first = s.WithContext("replacing chunk " + std::to_string(id) + " (out of service until retried)");
    }
  }
  return first;
}

bool ChunkPool::Scrub(const Chunk& c) const {
  // Not a memset of the same pages: a process may still reference them without any open file or
  // mapping (pages spliced into a pipe, io_uring fixed buffers, an RDMA or CUDA registration), and
  // it would read the next owner's data in them. The hole drops the pages from the file (such a
  // holder keeps its own old copy); the touch below gives the chunk fresh, zeroed ones, locked
  // like the rest of the mapping (mlock's VM_LOCKED stays on it).
  if (fallocate(c.fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, static_cast<off_t>(options_.chunk_bytes)) != 0) {
    return false;  // the caller replaces the chunk instead
  }
  Prefault(c.data, options_.chunk_bytes, 1);
  return true;
}

Status ChunkPool::Replace(Chunk* c) {
  // New memory for the pool; the old pages stay with whoever still holds them.
  Chunk fresh;
  SPECACHE_RETURN_IF_ERROR(MakeChunk(&fresh, true));
  std::lock_guard<std::mutex> lock(mu_);
  retained_.push_back({c->probe, c->holder_pidfd, c->holder});
  c->probe = -1;
  Unmap(c, options_.chunk_bytes);
  c->fd = fresh.fd;
  c->probe = fresh.probe;
  c->data = fresh.data;
  c->owner = 0;
  c->holder = 0;
  c->holder_pidfd = -1;
  ++replaced_;
  return Status::Ok();
}

void ChunkPool::Housekeep() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = retained_.begin(); it != retained_.end();) {
      bool unknown = false;
      bool held = HeldElsewhere(it->probe, &unknown);
      if (held && unknown && it->pidfd >= 0) {
        pollfd p{it->pidfd, POLLIN, 0};
        held = poll(&p, 1, 0) != 1;  // no lease to tell: held until the owner exits
      }
      if (held) {
        ++it;
        continue;
      }
      close(it->probe);
      if (it->pidfd >= 0) close(it->pidfd);
      it = retained_.erase(it);
    }
  }
  for (uint32_t id = 0; id < chunks_.size(); ++id) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (chunks_[id].owner != kOutOfService) continue;
    }
    Chunk& c = chunks_[id];  // out of service: only Housekeep touches it
    bool unknown = false;
    if (!HeldElsewhere(c.probe, &unknown) && Scrub(c)) {
      std::lock_guard<std::mutex> lock(mu_);
      if (c.holder_pidfd >= 0) close(c.holder_pidfd);
      c.holder_pidfd = -1;
      c.owner = 0;
    } else {
      (void)Replace(&c);  // still failing: tried again on the next call
    }
  }
}

uint64_t ChunkPool::retained_bytes(uint64_t holder) const {
  std::lock_guard<std::mutex> lock(mu_);
  uint64_t n = 0;
  for (const Retained& r : retained_) n += r.holder == holder;
  for (const Chunk& c : chunks_) n += c.owner == kOutOfService && c.holder == holder;
  return n * options_.chunk_bytes;
}

uint64_t ChunkPool::retained_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return retained_.size() * options_.chunk_bytes;
}

uint32_t ChunkPool::out_of_service_count() const {
  std::lock_guard<std::mutex> lock(mu_);
  uint32_t n = 0;
  for (const Chunk& c : chunks_) n += c.owner == kOutOfService;
  return n;
}

int ChunkPool::fd(uint32_t chunk) const {
  std::lock_guard<std::mutex> lock(mu_);
  return chunk < chunks_.size() ? chunks_[chunk].fd : -1;
}

uint8_t* ChunkPool::data(uint32_t chunk) const {
  std::lock_guard<std::mutex> lock(mu_);
  return chunk < chunks_.size() ? chunks_[chunk].data : nullptr;
}

HostMapping ChunkPool::mapping() const {
  std::vector<MemoryRange> ranges;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const Chunk& c : chunks_) {
      if (c.data != nullptr) ranges.push_back({c.data, options_.chunk_bytes});
    }
  }
  return MappedBytes(ranges);
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
