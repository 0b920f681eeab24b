// The daemon's memory: a fixed pool of memfd chunks, created at startup, pre-faulted by several
// threads and locked in RAM (mlock; when RLIMIT_MEMLOCK forbids it the pool still works and
// locked() says so). A chunk belongs to one owner (session) at a time and is handed out whole.
//
// Clients get their own open file of a chunk (ShareFd: a reopen, never the pool's descriptor), so
// the pool can tell whether anyone outside still holds a chunk: a write lease (F_SETLEASE) on the
// pool's probe file is granted only when no other open file of the chunk exists, and a mapping
// or a descriptor passed on to another process keeps its open file alive. A path kept without an
// open file (O_PATH, which the probe does not see) opens nothing: a chunk's file is mode 0600, the
// daemon's user's.
//
// Isolation when a chunk comes back: a chunk nobody else holds gets fresh zeroed pages (its old ones
// punched out of the memfd, so a process still referencing them without a file, e.g. spliced into
// a pipe, keeps only its own old data) and is reused; a chunk
// still held elsewhere (its owner closed its session but kept a mapping or a descriptor) gets a
// fresh memfd, so no physical page ever passes from one tenant to another, and its old memory is
// "retained": charged to the holder tag given at Return until no process holds it any more (or,
// where leases do not work, until the owner process exits). A replacement that fails (EMFILE,
// ENOMEM) leaves the chunk out of service, not out of the pool: Housekeep retries it. Chunks are
// sealed against resizing, so a client cannot shrink one under the daemon.
//
// Thread safety: all methods may be called from any thread.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <vector>

#include "specache/host_mapping.h"
#include "specache/status.h"

namespace specache {

struct ChunkPoolOptions {
  uint64_t pool_bytes = uint64_t{1} << 30;
  uint64_t chunk_bytes = uint64_t{64} << 20;  // multiple of the page size (4 KiB)
  int prefault_threads = 4;
  bool lock_memory = true;
  // Chunks of 2 MiB or more mapped at 2 MiB boundaries and asked for transparent huge pages
  // (MADV_HUGEPAGE; shmem THP needs the host's /sys/kernel/mm/transparent_hugepage/shmem_enabled
  // at "advise" or "always", else base pages): a fetch reads random rows over the whole pool, and
  // each base page it touches is a TLB miss for the host's gather threads.
  bool huge_pages = true;
};

class ChunkPool {
 public:
  // INVALID_ARGUMENT for sizes that are zero or not page multiples, RESOURCE_EXHAUSTED when the
  // memory cannot be created.
  static Result<std::unique_ptr<ChunkPool>> Create(const ChunkPoolOptions& options);
  ~ChunkPool();

  // Takes n free chunks for `owner` (ids ascending). RESOURCE_EXHAUSTED if fewer are free.
  Result<std::vector<uint32_t>> Take(uint32_t n, uint64_t owner);
  // Gives `owner`'s chunks back: zeroed when nobody else holds them, replaced (and the old memory
  // charged to `holder`, with `owner_pidfd` (may be -1; duplicated) as the fallback release)
  // otherwise. A chunk still held is polled for up to kLetGoMs first (a holder letting go just
  // now), so a Return with held chunks takes that long. An error names the chunks whose
  // replacement failed; they come back through Housekeep. Before anything changes:
  // PERMISSION_DENIED for a chunk another owner took (one owner can never free another's memory),
  // FAILED_PRECONDITION for a chunk that is not taken (free, or out of service) or named twice.
  static constexpr int kLetGoMs = 100;
  Status Return(std::span<const uint32_t> chunks, uint64_t owner, uint64_t holder = 0, int owner_pidfd = -1);

  // A new open file of the chunk (O_RDWR, CLOEXEC) for a client; the caller owns it.
  Result<int> ShareFd(uint32_t chunk) const;
  // Drops retained memory nobody holds any more and retries failed replacements. Call often.
  void Housekeep();
  // Bytes of replaced chunks still held outside the daemon, for one holder tag and in total.
  uint64_t retained_bytes(uint64_t holder) const;
  uint64_t retained_bytes() const;
  uint32_t out_of_service_count() const;  // chunks whose replacement failed, awaiting Housekeep

  int fd(uint32_t chunk) const;           // memfd (owned by the pool; never hand it out: ShareFd)
  uint8_t* data(uint32_t chunk) const;    // the daemon's own mapping
  uint64_t chunk_bytes() const { return options_.chunk_bytes; }
  uint32_t chunk_count() const { return static_cast<uint32_t>(chunks_.size()); }
  uint32_t free_count() const;
  bool locked() const { return locked_; }
  // How the kernel maps the chunks in service now (the daemon's own mappings): resident bytes and,
  // of them, those in huge pages (what huge_pages was granted; see ChunkPoolOptions). Reads the
  // process's /proc/self/smaps, which makes the kernel walk every page of the pool (~10 ms per
  // GiB of base pages): not for a loop. mapped_at_start() is the same, measured once by Create.
  HostMapping mapping() const;
  const HostMapping& mapped_at_start() const { return mapped_at_start_; }
  uint64_t replaced_chunks() const;  // memfds replaced on return (owner still alive)

 private:
  struct Chunk {
    int fd = -1;
    int probe = -1;  // an open file of the memfd (the lease probe; the only one the pool opens)
    uint8_t* data = nullptr;
    uint64_t owner = 0;  // 0: free; kOutOfService: awaiting replacement
    // ShareFd handed out an open file of it since it was taken (Take clears it). One never
    // handed out cannot be held outside the daemon: it comes back without the lease probe (which,
    // where leases do not work, would keep it retained until a pidfd nobody has says its holder
    // exited). Set by ShareFd, which is const; under mu_.
    mutable bool shared = false;
    uint64_t holder = 0;
    int holder_pidfd = -1;
  };
  // Old memory of a replaced chunk, held by someone outside.
  struct Retained {
    int probe = -1, pidfd = -1;
    uint64_t holder = 0;
  };
  static constexpr uint64_t kOutOfService = ~uint64_t{0};
  explicit ChunkPool(const ChunkPoolOptions& options) : options_(options) {}
  Status MakeChunk(Chunk* chunk, bool prefault);
  // Replaces c's memory; on success the old memory is retained (caller holds mu_ for the swap).
  Status Replace(Chunk* c);
  static void Unmap(Chunk* chunk, uint64_t bytes);
  // True when an open file of the chunk other than `probe` exists (or when that cannot be told).
  static bool HeldElsewhere(int probe, bool* unknown);
  // Gives a chunk nobody holds fresh zeroed pages (false when the kernel refuses the hole: the
  // caller replaces it).
  bool Scrub(const Chunk& c) const;

  ChunkPoolOptions options_;
  std::vector<Chunk> chunks_;
  mutable std::mutex mu_;
  bool locked_ = true;
  HostMapping mapped_at_start_;  // Create's, after the pre-fault
  uint64_t replaced_ = 0;
  std::vector<Retained> retained_;
  bool leases_work_ = true;
};

}  // namespace specache
