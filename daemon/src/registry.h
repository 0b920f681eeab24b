// The daemon's state: sessions (tenant, token, chunks, pages, attached peer), their sequences,
// quotas and leases. All control-plane calls and the attach endpoint go through it.
//
// Session lifetime: OpenSession (for a caller the tenant admits) reserves chunks; the client must
// attach within the lease, and the session then lives as long as the attach connection (Detach on
// close). Reclaim returns the chunks to the pool: zeroed when nobody else holds them, replaced by
// fresh memory when a process still does (ChunkPool). That old memory stays charged to the
// tenant's quota until no process holds it, so closing a session while keeping its chunks mapped
// does not free quota.
//
// Thread safety: every method may be called from any thread.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "access.h"
#include "config.h"
#include "kept_sequences.h"
#include "specache/attach_protocol.h"
#include "specache/chunk_pool.h"
#include "specache/session_pages.h"

namespace specache::daemon {

using Token = std::array<uint8_t, attach::kTokenBytes>;

// Whether two tokens are equal, in time that does not depend on where they differ.
inline bool SameToken(const Token& a, const Token& b) {
  uint8_t diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= a[i] ^ b[i];
  return diff == 0;
}

struct PeerCredentials {
  int32_t pid = 0;
  uint32_t uid = 0;
  uint32_t gid = 0;
};

struct OpenedSession {
  uint64_t id = 0;
  Token token{};
  uint32_t chunk_count = 0;
};

// Descriptors to send to an attaching client (duplicates: the caller closes them).
struct AttachGrant {
  std::vector<int> fds;  // page table first, then chunks
  uint64_t table_bytes = 0;
  uint64_t chunk_bytes = 0;
};

struct SessionSummary {
  uint64_t id = 0;
  std::string tenant, client_name;
  PeerCredentials peer;
  bool attached = false;
  uint32_t chunks = 0;
  uint64_t used_bytes = 0;
  uint32_t sequences = 0;
  uint64_t age_ms = 0;
};

struct SequenceSummary {
  uint64_t id = 0, session = 0;  // session 0: kept by the tenant
  std::string tenant;
  PageLayout layout;
  uint32_t pages_per_layer = 0;
  uint64_t bytes = 0;
  std::string state = "session";  // "session", "parked" or "spilled"
};

struct TenantSummary {
  std::string name;
  uint64_t reserved_bytes = 0, used_bytes = 0, quota_bytes = 0;
  uint64_t retained_bytes = 0;  // memory of ended sessions a process still holds (in reserved_bytes)
  uint32_t sessions = 0, sequences = 0;
};

struct RegistryStats {
  uint64_t pool_bytes = 0, reserved_bytes = 0, used_bytes = 0, free_bytes = 0, chunk_bytes = 0;
  uint32_t sessions = 0, sequences = 0;
  uint64_t pages = 0;
  uint64_t sessions_reclaimed = 0, chunks_replaced = 0;
  uint32_t chunks_out_of_service = 0;  // replacement failed; retried by Reap
  bool memory_locked = false;
  int64_t pool_huge_bytes = -1;  // of the pool, in huge pages at startup (ChunkPool::mapped_at_start); -1: unknown
  std::vector<TenantSummary> tenants;
  KeptStats kept;
};

class Registry {
 public:
  // `kept` holds sequences kept past their sessions (must outlive the registry).
  Registry(const DaemonConfig& config, ChunkPool* pool, KeptSequences* kept);
  ~Registry();

  // PERMISSION_DENIED (before anything is reserved) when the tenant does not admit the caller.
  Result<OpenedSession> OpenSession(const std::string& tenant, uint64_t pool_bytes, const std::string& client_name,
                                    const Caller& caller);
  // The chunk descriptors are the client's own open files (ChunkPool::ShareFd).
  Result<AttachGrant> Attach(uint64_t session, const Token& token, const Caller& peer);
  // The attach connection closed: the session is reclaimed (by Reap, once the peer's fate is known).
  void Detach(uint64_t session);
  // Ends the session: its chunks go back to the pool before it returns. While a UCX endpoint holds
  // remote keys for them (AttachRemote with keys), it first waits (at most kReclaimWait) for the
  // endpoint to drop them (RemoteKeysUnmapped), so that no key reaches a chunk another session was
  // given, and for its releases and claims to finish their work on its pages (pins); past that the
  // chunks go back (Reap) once both are done.
  Status CloseSession(uint64_t session, const Token& token);

  Result<std::pair<uint64_t, uint32_t>> CreateSequence(uint64_t session, const Token& token, const PageLayout& layout);
  Result<std::pair<uint32_t, uint64_t>> ExtendSequence(uint64_t session, const Token& token, uint64_t sequence,
                                                       uint32_t tokens);
  // The sequence is gone at once (its id unknown to every call); its pages are zeroed (without
  // mu_: other calls go on meanwhile) and free for the session's next sequences before it returns.
  Status ReleaseSequence(uint64_t session, const Token& token, uint64_t sequence);
  // Marks a sequence of the session to be kept (parked) when the session ends.
  Status KeepSequence(uint64_t session, const Token& token, uint64_t sequence);
  // A kept sequence of the session's tenant becomes the session's again: (slot, pages per layer).
  // Its pages are copied in without mu_; meanwhile the sequence cannot be released or kept
  // (FAILED_PRECONDITION), and if the session ends it stays kept (FAILED_PRECONDITION).
  Result<std::pair<uint32_t, uint32_t>> ClaimSequence(uint64_t session, const Token& token, uint64_t sequence,
                                                      const PageLayout& layout);

  // ---- Sessions of clients on other hosts (opened by a remote caller, access.h). Their UCX
  // connection (remote_server.h) holds the lease as the attach connection does for a local one,
  // and the daemon reads and writes rows for them after the same checks: the token, a sequence
  // of this session, layer and head inside its layout, tokens inside its pages.

  // The session's chunks (pool indices, in session order). FAILED_PRECONDITION for a session
  // opened locally or already attached. `keys`: the endpoint hands out remote keys for them (`rma`),
  // which it must report dropped (RemoteKeysUnmapped) before the chunks can go back to the pool.
  Result<std::vector<uint32_t>> AttachRemote(uint64_t session, const Token& token, bool keys = false);
  // The session's endpoint unmapped its chunks (its remote keys are stale from here).
  void RemoteKeysUnmapped(uint64_t session);
  // The rows of `tokens` of (sequence, layer, kv_head), packed in list order ([n][row bytes]).
  // OUT_OF_RANGE naming the first token outside the sequence's pages (nothing is copied then).
  // RESOURCE_EXHAUSTED, before anything is copied, when they would be more than max_bytes.
  Result<std::vector<uint8_t>> ReadRows(uint64_t session, const Token& token, uint64_t sequence, uint32_t layer,
                                        uint32_t kv_head, std::span<const int32_t> tokens,
                                        uint64_t max_bytes = UINT64_MAX);
  // Writes n rows ([n][row bytes]) at first_token.. of (sequence, layer, kv_head); the pages must
  // exist (ExtendSequence). INVALID_ARGUMENT when the bytes are not n whole rows of the sequence's
  // layout.
  Status WriteRows(uint64_t session, const Token& token, uint64_t sequence, uint32_t layer, uint32_t kv_head,
                   uint32_t first_token, uint32_t n, std::span<const uint8_t> rows);
  // Where (sequence, layer)'s pages are: (index into the session's chunks, byte offset) per page.
  Result<std::vector<shm::PageRef>> PageRefs(uint64_t session, const Token& token, uint64_t sequence, uint32_t layer);
  // The daemon's mapping of pool chunk c (what the UCX server registers).
  uint8_t* chunk_data(uint32_t c) const { return pool_->data(c); }
  // True while the session exists (the UCX server drops the connection of a session that ended).
  bool SessionLive(uint64_t session) const;

  // Reclaims sessions whose lease expired before attaching, and detached sessions. Call often.
  void Reap();
  // The daemon is stopping: parks the kept sequences of every live session (their chunks stay
  // as they are; the process is going away).
  void ParkKeptSequences();

  // The tenant of a live session (NOT_FOUND when there is none).
  Result<std::string> SessionTenant(uint64_t session) const;
  const AccessPolicy& access() const { return access_; }

  // The session a live sequence belongs to (0: none).
  uint64_t OwnerOf(uint64_t sequence) const;

  // For tests: called by every ReleaseSequence and ClaimSequence once the session is pinned, before
  // their work on its pages without the registry's lock (a release's zeroing, a claim's copy), and
  // without that lock itself (a test holds the call there). Set before any such call.
  void SetBeforeUnlockedWork(std::function<void(uint64_t session)> hook) { before_unlocked_work_ = std::move(hook); }

  RegistryStats Stats() const;
  uint64_t chunk_bytes() const { return pool_->chunk_bytes(); }
  std::vector<SessionSummary> Sessions() const;
  std::vector<SequenceSummary> Sequences() const;

 private:
  struct Session {
    uint64_t id = 0;
    std::string tenant, client_name;
    Token token{};
    std::unique_ptr<SessionPages> pages;
    bool attached = false, detached = false;
    bool remote = false;  // opened by a client on another host: attaches over UCX only
    bool remote_keys = false;  // its chunks are mapped for a UCX endpoint's remote keys
    bool closing = false;      // CloseSession waits for remote_keys and pins to clear, then reclaims it
    bool closed = false;       // CloseSession gave up waiting: Reap reclaims it once they clear
    // Calls at work on its pages without mu_ (a release zeroing them, a claim copying into them): its
    // chunks must stay its own (no reclaim) until none is left.
    uint32_t pins = 0;
    PeerCredentials peer;
    int pidfd = -1;
    std::chrono::steady_clock::time_point opened, detached_at;
  };
  // The session if the token matches (PERMISSION_DENIED otherwise, NOT_FOUND if unknown).
  Result<Session*> Authorize(uint64_t session, const Token& token);
  // A kept sequence leaving with its session: where its pages are until the chunks go back.
  struct ParkJob {
    std::string tenant;
    uint64_t id = 0;
    PageLayout layout;
    uint32_t pages_per_layer = 0;
    std::vector<uint8_t*> pages;  // [layer * pages_per_layer + page]
  };
  struct ChunkReturn {
    uint64_t session = 0;
    std::string tenant;  // charged for the chunks until they are back in the pool (returning_)
    std::vector<uint32_t> chunks;
    uint64_t holder = 0;        // the tenant's tag: memory still held elsewhere is charged to it
    int pidfd = -1;             // the attached peer (owned; closed after the return)
    std::vector<ParkJob> park;  // copied out before the chunks are returned
  };
  // The park jobs of a session's kept sequences (forgetting their keep marks). Caller holds mu_.
  std::vector<ParkJob> ParkJobsLocked(const Session& s);
  void Park(uint64_t session, const std::vector<ParkJob>& jobs);
  // The daemon's address of a page of a session's sequence.
  uint8_t* PageAddress(const Session& s, const shm::PageRef& ref) const;
  static Status RequireAttached(const Session& s);
  // For the remote row calls: the session's sequence and the address of a row, checked.
  Result<const SequencePages*> RemoteSequenceLocked(uint64_t session, const Token& token, uint64_t sequence,
                                                    uint32_t layer, uint32_t kv_head, Session** out);
  uint8_t* RowAddressLocked(const Session& s, const SequencePages& p, uint32_t layer, uint32_t kv_head, uint32_t token) const;
  // ClaimSequence's place for the claimed sequence in the session: created and extended to its
  // pages' tokens (at most its capacity), owned by the session; its slot. On an error nothing is
  // left in the session. Caller holds mu_.
  Result<uint32_t> PlaceClaimedLocked(uint64_t session, const Token& token, uint64_t sequence, const PageLayout& layout,
                                      uint32_t pages_per_layer);
  // Forgets the session (under mu_); its chunks go back to the pool with ReturnChunks (without mu_).
  // Never while s.pins > 0: its callers (Reap's two cases, CloseSession) wait for it, or know
  // that no release can run (a session never attached).
  ChunkReturn ReclaimLocked(std::map<uint64_t, Session>::iterator it);
  void ReturnChunks(const std::vector<ChunkReturn>& returns);
  uint64_t TenantReservedLocked(const std::string& tenant) const;

  DaemonConfig config_;
  AccessPolicy access_;
  std::map<std::string, uint64_t> tenant_tags_;  // tenant -> holder tag in the pool (1, 2, ...)
  ChunkPool* pool_;
  mutable std::mutex mu_;
  // RemoteKeysUnmapped, or a release's or claim's end (pins): a CloseSession may wait for it
  // (kReclaimWait at most).
  std::condition_variable reclaimable_;
  static constexpr auto kReclaimWait = std::chrono::seconds(2);
  std::map<uint64_t, Session> sessions_;
  std::map<uint64_t, uint64_t> sequence_owner_;  // sequence -> session
  std::set<uint64_t> keep_on_close_;             // sequences to park when their session ends
  // [tenant] sequences of ended sessions between ParkJobsLocked (out of keep_on_close_) and their
  // Park: counted against kept_sequences_per_tenant as the marked and the kept ones are.
  std::map<std::string, uint64_t> parking_;
  // Sequences a ClaimSequence has taken out of the kept ones and not yet copied into its session
  // (or put back): nobody may mark them to keep meanwhile (KeepSequence), or a close during the
  // copy would park the half-copied pages under the id the claim puts the original back under;
  // nor release them (ReleaseSequence), whose zeroing would race the copy into their pages.
  std::set<uint64_t> claiming_;
  // [tenant] bytes of ended sessions' chunks on their way back to the pool (ReclaimLocked until
  // ReturnChunks has handed them over, which takes the let-go wait, fresh memory for chunks still
  // held and the kept sequences' copies): charged to the tenant meanwhile, as the session's were
  // before and the retained ones are after, so that a new session cannot take them twice.
  std::map<std::string, uint64_t> returning_;
  KeptSequences* kept_;
  uint64_t next_session_ = 1, next_sequence_ = 1;
  uint64_t reclaimed_ = 0;
  std::function<void(uint64_t)> before_unlocked_work_;  // SetBeforeUnlockedWork
};

}  // namespace specache::daemon
