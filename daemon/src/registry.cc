#include "registry.h"

#include <poll.h>
#include <signal.h>
#include <sys/random.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <mutex>

#include <spdlog/spdlog.h>

namespace specache::daemon {
namespace {

constexpr auto kExitGrace = std::chrono::milliseconds(200);  // wait for a dying peer to be gone

int OpenPidfd(int32_t pid) {
#ifdef SYS_pidfd_open
  return static_cast<int>(syscall(SYS_pidfd_open, pid, 0));
#else
  return -1;
#endif
}

// True when the process behind the pidfd has exited (or cannot be watched and is gone).
bool PeerExited(int pidfd, int32_t pid) {
  if (pidfd >= 0) {
    pollfd p{pidfd, POLLIN, 0};
    return poll(&p, 1, 0) == 1;
  }
  return pid > 0 && kill(pid, 0) != 0 && errno == ESRCH;
}

}  // namespace

Registry::Registry(const DaemonConfig& config, ChunkPool* pool, KeptSequences* kept)
    : config_(config), access_(config, geteuid()), pool_(pool), kept_(kept), next_sequence_(kept->max_id() + 1) {
  for (const auto& [name, t] : config_.tenants) tenant_tags_[name] = tenant_tags_.size() + 1;
}

uint8_t* Registry::PageAddress(const Session& s, const shm::PageRef& ref) const {
  return pool_->data(s.pages->chunks()[ref.chunk]) + ref.offset;
}

Registry::~Registry() {
  for (auto& [id, s] : sessions_) {
    if (s.pidfd >= 0) close(s.pidfd);
  }
}

uint64_t Registry::TenantReservedLocked(const std::string& tenant) const {
  // Memory of ended sessions that a process still holds counts as long as it is held.
  uint64_t bytes = pool_->retained_bytes(tenant_tags_.at(tenant));
  if (auto it = returning_.find(tenant); it != returning_.end()) bytes += it->second;
  for (const auto& [id, s] : sessions_) {
    if (s.tenant == tenant) bytes += s.pages->chunks().size() * pool_->chunk_bytes();
  }
  return bytes;
}

Result<OpenedSession> Registry::OpenSession(const std::string& tenant, uint64_t pool_bytes,
                                            const std::string& client_name, const Caller& caller) {
  // Who asks comes first: a caller the tenant does not admit reserves nothing.
  SPECACHE_RETURN_IF_ERROR(access_.MayUseTenant(caller, tenant));
  auto t = config_.tenants.find(tenant);
  if (pool_bytes == 0) return Status::InvalidArgument("pool_bytes must be positive");
  if (client_name.size() > 256) return Status::InvalidArgument("client_name longer than 256 bytes");
  const uint64_t chunk = pool_->chunk_bytes();
  if (pool_bytes > UINT64_MAX - chunk) return Status::InvalidArgument("pool_bytes out of range");
  const uint64_t n = (pool_bytes + chunk - 1) / chunk;
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t reserved = TenantReservedLocked(tenant);
  if (n * chunk > t->second.quota_bytes || reserved > t->second.quota_bytes - n * chunk) {
    return Status::ResourceExhausted("tenant '" + tenant + "' quota: " + std::to_string(reserved >> 20) + " MiB of " +
                                     std::to_string(t->second.quota_bytes >> 20) + " MiB reserved, " +
                                     std::to_string((n * chunk) >> 20) + " MiB more requested");
  }
  if (n > pool_->chunk_count()) {
    return Status::ResourceExhausted("session of " + std::to_string(n) + " chunks exceeds the pool's " +
                                     std::to_string(pool_->chunk_count()));
  }
  SPECACHE_ASSIGN_OR_RETURN(std::vector<uint32_t> chunks, pool_->Take(static_cast<uint32_t>(n), next_session_));
  Session s;
  s.id = next_session_++;
  s.tenant = tenant;
  s.client_name = client_name;
  s.remote = caller.remote();
  // On a failure below the chunks go back untouched by any client (never attached).
  auto give_back = [&] {
    if (Status r = pool_->Return(chunks, s.id); !r.ok()) spdlog::error("session {}: {}", s.id, r.ToString());
  };
  if (getrandom(s.token.data(), s.token.size(), 0) != static_cast<ssize_t>(s.token.size())) {
    give_back();
    return Status::Internal("getrandom failed");
  }
  auto pages = SessionPages::Create(s.id, pool_, chunks,
                                    {config_.max_sequences_per_session, config_.max_page_refs_per_session});
  if (!pages.ok()) {
    give_back();
    return pages.status();
  }
  s.pages = std::move(pages).value();
  if (!s.pages->write_sealed()) {
    static std::once_flag said;  // the kernel's answer is the same for every session
    std::call_once(said, [] {
      spdlog::warn("page tables are not sealed against writes (the kernel refused F_SEAL_FUTURE_WRITE, before "
                   "Linux 5.1): a session's client can write its own table; the daemon does not read it back");
    });
  }
  s.opened = std::chrono::steady_clock::now();
  OpenedSession out{s.id, s.token, static_cast<uint32_t>(n)};
  spdlog::info("session {} opened: tenant {}, client '{}', pid {} uid {}, {} chunks", s.id, tenant,
               Printable(client_name, 256), caller.pid, caller.uid, n);
  sessions_.emplace(s.id, std::move(s));
  return out;
}

Result<Registry::Session*> Registry::Authorize(uint64_t session, const Token& token) {
  auto it = sessions_.find(session);
  if (it == sessions_.end() || it->second.detached) return Status::NotFound("session " + std::to_string(session));
  if (!SameToken(it->second.token, token)) return Status::PermissionDenied("wrong token for session " + std::to_string(session));
  return &it->second;
}

Status Registry::RequireAttached(const Session& s) {
  // Pages are only for a session whose lease (the attach connection) is held.
  if (!s.attached) return Status::FailedPrecondition("session " + std::to_string(s.id) + " is not attached yet");
  return Status::Ok();
}

Result<AttachGrant> Registry::Attach(uint64_t session, const Token& token, const Caller& peer) {
  std::lock_guard<std::mutex> lock(mu_);
  SPECACHE_ASSIGN_OR_RETURN(Session * s, Authorize(session, token));
  if (s->attached) return Status::FailedPrecondition("session " + std::to_string(session) + " is already attached");
  if (s->remote) {
    return Status::FailedPrecondition("session " + std::to_string(session) +
                                      " was opened by a remote client: it attaches over UCX, not here");
  }
  SPECACHE_RETURN_IF_ERROR(access_.MayUseTenant(peer, s->tenant));
  AttachGrant g;
  g.table_bytes = s->pages->table_bytes();
  g.chunk_bytes = pool_->chunk_bytes();
  auto give_up = [&g](Status why) {
    for (int f : g.fds) close(f);
    return why;
  };
  const int table = dup(s->pages->table_fd());
  if (table < 0) return Status::ResourceExhausted("out of file descriptors");
  g.fds.push_back(table);
  // Each chunk as the client's own open file: the pool can then tell when the client lets go.
  for (uint32_t c : s->pages->chunks()) {
    auto fd = pool_->ShareFd(c);
    if (!fd.ok()) return give_up(fd.status());
    g.fds.push_back(*fd);
  }
  s->attached = true;
  s->peer = {peer.pid, peer.uid, peer.gid};
  s->pidfd = OpenPidfd(peer.pid);
  spdlog::info("session {} attached by pid {} uid {}", session, peer.pid, peer.uid);
  return g;
}

Result<std::vector<uint32_t>> Registry::AttachRemote(uint64_t session, const Token& token, bool keys) {
  std::lock_guard<std::mutex> lock(mu_);
  SPECACHE_ASSIGN_OR_RETURN(Session * s, Authorize(session, token));
  if (!s->remote) {
    return Status::FailedPrecondition("session " + std::to_string(session) + " was opened locally: it attaches on the attach socket");
  }
  if (s->attached) return Status::FailedPrecondition("session " + std::to_string(session) + " is already attached");
  s->attached = true;
  s->remote_keys = keys;
  spdlog::info("session {} attached by a remote client of tenant {}", session, s->tenant);
  return s->pages->chunks();
}

void Registry::RemoteKeysUnmapped(uint64_t session) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = sessions_.find(session);
    if (it == sessions_.end() || !it->second.remote_keys) return;
    it->second.remote_keys = false;
  }
  reclaimable_.notify_all();  // a CloseSession may wait for it
}

bool Registry::SessionLive(uint64_t session) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = sessions_.find(session);
  return it != sessions_.end() && !it->second.detached;
}

Result<const SequencePages*> Registry::RemoteSequenceLocked(uint64_t session, const Token& token, uint64_t sequence,
                                                            uint32_t layer, uint32_t kv_head, Session** out) {
  SPECACHE_ASSIGN_OR_RETURN(Session * s, Authorize(session, token));
  SPECACHE_RETURN_IF_ERROR(RequireAttached(*s));
  if (s->detached) return Status::FailedPrecondition("session " + std::to_string(session) + " has ended");
  const SequencePages* p = s->pages->Find(sequence);
  if (!p) return Status::NotFound("sequence " + std::to_string(sequence) + " is not in session " + std::to_string(session));
  if (layer >= p->layout.n_layers || kv_head >= p->layout.n_kv_heads) {
    return Status::OutOfRange("layer " + std::to_string(layer) + " / KV head " + std::to_string(kv_head) +
                              " outside the sequence's layout (" + std::to_string(p->layout.n_layers) + " layers, " +
                              std::to_string(p->layout.n_kv_heads) + " KV heads)");
  }
  *out = s;
  return p;
}

uint8_t* Registry::RowAddressLocked(const Session& s, const SequencePages& p, uint32_t layer, uint32_t kv_head,
                                    uint32_t token) const {
  const uint32_t page = token / p.layout.page_tokens, in_page = token % p.layout.page_tokens;
  return PageAddress(s, p.pages[layer][page]) + shm::RowOffsetInPage(p.layout.row_format, kv_head, in_page, p.layout.page_tokens, p.layout.head_dim);
}

Result<std::vector<uint8_t>> Registry::ReadRows(uint64_t session, const Token& token, uint64_t sequence,
                                                uint32_t layer, uint32_t kv_head, std::span<const int32_t> tokens,
                                                uint64_t max_bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  Session* s = nullptr;
  SPECACHE_ASSIGN_OR_RETURN(const SequencePages* p, RemoteSequenceLocked(session, token, sequence, layer, kv_head, &s));
  const uint64_t limit = uint64_t{p->pages_per_layer} * p->layout.page_tokens;
  const uint64_t row_bytes = p->layout.row_bytes();
  if (tokens.size() * row_bytes > max_bytes) {
    return Status::ResourceExhausted("a reply of " + std::to_string(tokens.size() * row_bytes) + " bytes (" +
                                     std::to_string(tokens.size()) + " rows) does not fit the " + std::to_string(max_bytes) +
                                     " bytes its endpoint may still hold: take the replies in flight first");
  }
  for (size_t i = 0; i < tokens.size(); ++i) {  // every token first: nothing is copied for a bad list
    if (tokens[i] < 0 || static_cast<uint64_t>(tokens[i]) >= limit) {
      return Status::OutOfRange("row " + std::to_string(tokens[i]) + " (entry " + std::to_string(i) +
                                ") is outside the sequence's " + std::to_string(limit) + " tokens of pages");
    }
  }
  std::vector<uint8_t> out(tokens.size() * row_bytes);
  for (size_t i = 0; i < tokens.size(); ++i) {
    std::memcpy(out.data() + i * row_bytes, RowAddressLocked(*s, *p, layer, kv_head, static_cast<uint32_t>(tokens[i])),
                row_bytes);
  }
  return out;
}

Status Registry::WriteRows(uint64_t session, const Token& token, uint64_t sequence, uint32_t layer, uint32_t kv_head,
                           uint32_t first_token, uint32_t n, std::span<const uint8_t> rows) {
  std::lock_guard<std::mutex> lock(mu_);
  Session* s = nullptr;
  SPECACHE_ASSIGN_OR_RETURN(const SequencePages* p, RemoteSequenceLocked(session, token, sequence, layer, kv_head, &s));
  const uint64_t limit = uint64_t{p->pages_per_layer} * p->layout.page_tokens;
  const uint64_t row_bytes = p->layout.row_bytes();
  if (rows.size() != n * row_bytes) {
    return Status::InvalidArgument("a write of " + std::to_string(n) + " rows of " + std::to_string(row_bytes) +
                                   " bytes came with " + std::to_string(rows.size()) + " bytes");
  }
  if (uint64_t{first_token} + n > limit) {
    return Status::OutOfRange("rows " + std::to_string(first_token) + ".." + std::to_string(uint64_t{first_token} + n) +
                              " beyond the sequence's " + std::to_string(limit) + " tokens of pages (extend first)");
  }
  for (uint64_t i = 0; i < n; ++i) {
    std::memcpy(RowAddressLocked(*s, *p, layer, kv_head, first_token + static_cast<uint32_t>(i)), rows.data() + i * row_bytes,
                row_bytes);
  }
  return Status::Ok();
}

Result<std::vector<shm::PageRef>> Registry::PageRefs(uint64_t session, const Token& token, uint64_t sequence,
                                                     uint32_t layer) {
  std::lock_guard<std::mutex> lock(mu_);
  Session* s = nullptr;
  SPECACHE_ASSIGN_OR_RETURN(const SequencePages* p, RemoteSequenceLocked(session, token, sequence, layer, 0, &s));
  return std::vector<shm::PageRef>(p->pages[layer].begin(), p->pages[layer].begin() + p->pages_per_layer);
}

void Registry::Detach(uint64_t session) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = sessions_.find(session);
  if (it == sessions_.end() || it->second.detached) return;
  it->second.detached = true;
  it->second.detached_at = std::chrono::steady_clock::now();
}

Status Registry::CloseSession(uint64_t session, const Token& token) {
  std::unique_lock<std::mutex> lock(mu_);
  SPECACHE_ASSIGN_OR_RETURN(Session * s, Authorize(session, token));
  if (s->remote_keys || s->pins > 0) {
    // Remote keys still reach its chunks (the UCX server closes the endpoint, the session being no
    // longer live (detached), drops the keys and says so: RemoteKeysUnmapped), or a release or a
    // claim works on its pages (pins): the chunks go back after that, here (as for any session,
    // before CloseSession returns) or, if that takes longer than kReclaimWait, by Reap.
    s->detached = true;
    s->detached_at = std::chrono::steady_clock::now();
    s->closing = true;
    const uint64_t id = s->id;
    const bool ready = reclaimable_.wait_for(lock, kReclaimWait, [&] {
      auto it = sessions_.find(id);
      return it == sessions_.end() || (!it->second.remote_keys && it->second.pins == 0);
    });
    auto it = sessions_.find(id);
    if (it == sessions_.end()) return Status::Ok();
    it->second.closing = false;
    if (!ready) {
      it->second.closed = true;  // Reap reclaims it once they are done
      const bool keys = it->second.remote_keys, pinned = it->second.pins > 0;
      spdlog::warn("session {} closed while {}{}{}: its chunks go back once {}", id,
                   keys ? "its UCX endpoint still holds remote keys" : "", keys && pinned ? " and " : "",
                   pinned ? "a release or claim works on its pages" : "",
                   keys && pinned ? "both are done" : "that is done");
      return Status::Ok();
    }
    s = &it->second;
  }
  // The caller lives on; the pool replaces whatever chunks it still holds.
  const ChunkReturn r = ReclaimLocked(sessions_.find(s->id));
  lock.unlock();
  ReturnChunks({r});
  return Status::Ok();
}

Registry::ChunkReturn Registry::ReclaimLocked(std::map<uint64_t, Session>::iterator it) {
  Session& s = it->second;
  ChunkReturn r{s.id, s.tenant, s.pages->chunks(), tenant_tags_.at(s.tenant), s.pidfd, ParkJobsLocked(s)};
  returning_[s.tenant] += r.chunks.size() * pool_->chunk_bytes();
  for (const auto& [seq, pages] : s.pages->sequences()) sequence_owner_.erase(seq);
  s.pages.reset();
  ++reclaimed_;
  sessions_.erase(it);
  return r;
}

std::vector<Registry::ParkJob> Registry::ParkJobsLocked(const Session& s) {
  std::vector<ParkJob> jobs;
  for (const auto& [seq, pages] : s.pages->sequences()) {
    if (keep_on_close_.erase(seq) == 0) continue;
    ++parking_[s.tenant];  // no longer marked, not yet kept: counted until Park has run
    ParkJob job{s.tenant, seq, pages.layout, pages.pages_per_layer, {}};
    for (const auto& layer : pages.pages) {
      for (const shm::PageRef& ref : layer) job.pages.push_back(PageAddress(s, ref));
    }
    jobs.push_back(std::move(job));
  }
  return jobs;
}

void Registry::Park(uint64_t session, const std::vector<ParkJob>& jobs) {
  for (const ParkJob& job : jobs) {
    const Status parked = kept_->Park(job.tenant, job.id, job.layout, job.pages_per_layer,
                                      [&job](uint32_t l, uint32_t p) { return job.pages[l * job.pages_per_layer + p]; });
    if (!parked.ok()) spdlog::error("session {}: kept sequence {} is lost: {}", session, job.id, parked.ToString());
    std::lock_guard<std::mutex> lock(mu_);
    auto it = parking_.find(job.tenant);
    if (it != parking_.end() && --it->second == 0) parking_.erase(it);
  }
}

void Registry::ReturnChunks(const std::vector<ChunkReturn>& returns) {
  // Outside the lock: zeroing or replacing chunk memory takes milliseconds per chunk. The chunks
  // still have their old owner in the pool until Return, so nobody else gets them meanwhile.
  for (const ChunkReturn& r : returns) {
    Park(r.session, r.park);  // kept sequences leave the chunks first
    const uint64_t replaced = pool_->replaced_chunks();
    Status s = pool_->Return(r.chunks, r.session, r.holder, r.pidfd);
    {
      // Back in the pool, or retained and charged there: no longer on their way.
      std::lock_guard<std::mutex> lock(mu_);
      uint64_t& returning = returning_[r.tenant];
      returning -= std::min<uint64_t>(returning, r.chunks.size() * pool_->chunk_bytes());
    }
    if (r.pidfd >= 0) close(r.pidfd);
    if (!s.ok()) spdlog::error("session {}: {}", r.session, s.ToString());
    spdlog::info("session {} reclaimed ({} chunks, {} replaced: still held by a process)", r.session, r.chunks.size(),
                 pool_->replaced_chunks() - replaced);
  }
}

void Registry::Reap() {
  std::vector<ChunkReturn> returns;
  std::unique_lock<std::mutex> lock(mu_);
  const auto now = std::chrono::steady_clock::now();
  for (auto it = sessions_.begin(); it != sessions_.end();) {
    auto next = std::next(it);
    Session& s = it->second;
    if (!s.attached && now - s.opened > std::chrono::milliseconds(config_.lease_ms)) {
      spdlog::warn("session {} not attached within {} ms: reclaimed", s.id, config_.lease_ms);
      returns.push_back(ReclaimLocked(it));  // no descriptor left the daemon
    } else if (s.detached && !s.remote_keys && !s.closing && s.pins == 0) {  // never while a remote key
      // may reach its chunks, or a release or claim works on its pages
      const bool exited = s.closed || PeerExited(s.pidfd, s.peer.pid);
      if (exited || now - s.detached_at > kExitGrace) returns.push_back(ReclaimLocked(it));
    }
    it = next;
  }
  lock.unlock();
  ReturnChunks(returns);
  pool_->Housekeep();  // releases retained memory nobody holds, retries failed replacements
  kept_->EnforceWatermarks();
}

void Registry::ParkKeptSequences() {
  std::vector<std::pair<uint64_t, std::vector<ParkJob>>> all;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [id, s] : sessions_) all.emplace_back(id, ParkJobsLocked(s));
  }
  for (const auto& [session, jobs] : all) Park(session, jobs);
}

Result<std::pair<uint64_t, uint32_t>> Registry::CreateSequence(uint64_t session, const Token& token,
                                                               const PageLayout& layout) {
  std::lock_guard<std::mutex> lock(mu_);
  SPECACHE_ASSIGN_OR_RETURN(Session * s, Authorize(session, token));
  SPECACHE_RETURN_IF_ERROR(RequireAttached(*s));
  const uint64_t id = next_sequence_++;
  SPECACHE_ASSIGN_OR_RETURN(const SequencePages* seq, s->pages->CreateSequence(id, layout));
  sequence_owner_[id] = session;
  return std::make_pair(id, seq->slot);
}

Result<std::pair<uint32_t, uint64_t>> Registry::ExtendSequence(uint64_t session, const Token& token,
                                                               uint64_t sequence, uint32_t tokens) {
  std::lock_guard<std::mutex> lock(mu_);
  SPECACHE_ASSIGN_OR_RETURN(Session * s, Authorize(session, token));
  SPECACHE_RETURN_IF_ERROR(RequireAttached(*s));
  if (!s->pages->Find(sequence)) return Status::NotFound("sequence " + std::to_string(sequence) + " in this session");
  // Pages live inside the session's chunks, which the tenant's quota already counted.
  SPECACHE_ASSIGN_OR_RETURN(uint32_t pages, s->pages->Extend(sequence, tokens));
  return std::make_pair(pages, s->pages->generation());
}

Status Registry::ReleaseSequence(uint64_t session, const Token& token, uint64_t sequence) {
  SessionPages::RetiredPages retired;
  {
    std::lock_guard<std::mutex> lock(mu_);
    SPECACHE_ASSIGN_OR_RETURN(Session * s, Authorize(session, token));
    SPECACHE_RETURN_IF_ERROR(RequireAttached(*s));
    if (!s->pages->Find(sequence)) return Status::NotFound("sequence " + std::to_string(sequence) + " in this session");
    if (claiming_.count(sequence)) {  // its claim is copying into its pages
      return Status::FailedPrecondition("sequence " + std::to_string(sequence) +
                                        " is being claimed: release it once its claim has returned");
    }
    sequence_owner_.erase(sequence);
    keep_on_close_.erase(sequence);
    SPECACHE_ASSIGN_OR_RETURN(retired, s->pages->Retire(sequence));
    ++s->pins;  // its chunks stay its own until the pages are zeroed (Reap, CloseSession wait)
  }
  if (before_unlocked_work_) before_unlocked_work_(session);
  // Without the lock: GiBs at long contexts take a second, which every session's calls would wait.
  retired.Zero();
  {
    std::lock_guard<std::mutex> lock(mu_);
    Session& s = sessions_.at(session);  // not reclaimed while pinned
    s.pages->Free(retired);
    --s.pins;
  }
  reclaimable_.notify_all();
  return Status::Ok();
}

Status Registry::KeepSequence(uint64_t session, const Token& token, uint64_t sequence) {
  uint64_t bytes = 0;
  std::string tenant;
  {
    std::lock_guard<std::mutex> lock(mu_);
    SPECACHE_ASSIGN_OR_RETURN(Session * s, Authorize(session, token));
    SPECACHE_RETURN_IF_ERROR(RequireAttached(*s));
    const SequencePages* p = s->pages->Find(sequence);
    if (!p) return Status::NotFound("sequence " + std::to_string(sequence) + " in this session");
    bytes = uint64_t{p->layout.n_layers} * p->pages_per_layer * p->layout.page_bytes();  // as it is now
    tenant = s->tenant;
  }
  // Outside the registry's lock: KeptSequences' lock is held by spills for their disk I/O.
  SPECACHE_RETURN_IF_ERROR(kept_->CanKeep(bytes));
  const uint64_t kept = kept_->CountOf(tenant);
  std::lock_guard<std::mutex> lock(mu_);
  SPECACHE_ASSIGN_OR_RETURN(Session * s, Authorize(session, token));
  if (!s->pages->Find(sequence)) return Status::NotFound("sequence " + std::to_string(sequence) + " in this session");
  if (claiming_.count(sequence)) {
    return Status::FailedPrecondition("sequence " + std::to_string(sequence) +
                                      " is being claimed: keep it once its claim has returned");
  }
  if (!keep_on_close_.count(sequence)) {
    uint64_t marked = 0;  // the tenant's sequences live sessions will keep, or ended ones are parking
    for (uint64_t other : keep_on_close_) {
      auto owner = sequence_owner_.find(other);
      auto it = owner == sequence_owner_.end() ? sessions_.end() : sessions_.find(owner->second);
      marked += it != sessions_.end() && it->second.tenant == tenant ? 1 : 0;
    }
    if (auto parking = parking_.find(tenant); parking != parking_.end()) marked += parking->second;
    const uint32_t most = config_.limits.kept_sequences_per_tenant;
    if (kept + marked >= most) {
      return Status::ResourceExhausted("tenant " + tenant + " keeps " + std::to_string(kept) + " sequences and " +
                                       std::to_string(marked) + " more are marked to keep, the most [limits] "
                                       "kept_sequences_per_tenant allows (" + std::to_string(most) +
                                       "); claim or evict some first");
    }
  }
  keep_on_close_.insert(sequence);
  return Status::Ok();
}

Result<uint32_t> Registry::PlaceClaimedLocked(uint64_t session, const Token& token, uint64_t sequence,
                                              const PageLayout& layout, uint32_t pages_per_layer) {
  SPECACHE_ASSIGN_OR_RETURN(Session * s, Authorize(session, token));
  SPECACHE_RETURN_IF_ERROR(RequireAttached(*s));
  SPECACHE_ASSIGN_OR_RETURN(const SequencePages* created, s->pages->CreateSequence(sequence, layout));
  const uint32_t slot = created->slot;
  // Its pages' tokens, at most the capacity (the last page may be partial: capacity_tokens need
  // not be a multiple of page_tokens).
  const uint64_t tokens = std::min<uint64_t>(uint64_t{pages_per_layer} * layout.page_tokens, layout.capacity_tokens);
  auto extended = s->pages->Extend(sequence, static_cast<uint32_t>(tokens));
  if (!extended.ok()) {
    (void)s->pages->Release(sequence);
    return extended.status();
  }
  // The session's from here (ClaimSequence keeps releases and keeps of it away until it returns,
  // and takes it out again if the session ends during its copy).
  sequence_owner_[sequence] = session;
  return slot;
}

Result<std::pair<uint32_t, uint32_t>> Registry::ClaimSequence(uint64_t session, const Token& token, uint64_t sequence,
                                                              const PageLayout& layout) {
  std::string tenant;
  {
    std::lock_guard<std::mutex> lock(mu_);
    SPECACHE_ASSIGN_OR_RETURN(Session * s, Authorize(session, token));
    SPECACHE_RETURN_IF_ERROR(RequireAttached(*s));
    tenant = s->tenant;
  }
  // Its RAM copy, taken from the kept sequences without the registry's lock (a spill may hold
  // theirs for its disk I/O; a spilled sequence is restored here, once Take checked its tenant
  // and layout: a claim with another layout changes nothing): from now on no other claim finds
  // it, and every way out below either claims it or puts it back, without the registry's lock
  // (PutBack takes the kept sequences' lock, which their spills hold for their disk I/O).
  // Nothing of the registry changes before Take has checked the tenant: a refused claim of
  // another tenant's sequence (its ids are sequential) leaves that sequence's own calls alone.
  SPECACHE_ASSIGN_OR_RETURN(KeptSequences::Taken taken, kept_->Take(tenant, sequence, layout));
  // Marked as being claimed from the moment it is placed in the session (where a KeepSequence or a
  // ReleaseSequence could first find it) until the claim is finished or the sequence put back: no
  // keep or release of it meanwhile. Before Take no session held it (a kept sequence is in none),
  // and Take gave it to this call alone. Every way out (an exception too) goes through the guard:
  // unless finished, the id leaves claiming_ and then the sequence goes back to the kept ones (in
  // that order: a claim that takes it next marks it again, and nothing of this claim unmarks it).
  struct Claim {
    Registry* r;
    uint64_t sequence;
    KeptSequences::Taken* taken;
    bool finished = false;
    ~Claim() {
      {
        std::lock_guard<std::mutex> lock(r->mu_);
        r->claiming_.erase(sequence);
      }
      if (!finished) r->kept_->PutBack(std::move(*taken));  // outside mu_, as every put-back
    }
  } claim{this, sequence, &taken};
  std::vector<uint8_t*> targets;  // the placed sequence's pages, [layer * pages_per_layer + page]
  targets.reserve(size_t{layout.n_layers} * taken.kept.pages_per_layer);  // nothing allocated under the lock
  const Result<uint32_t> placed = [&]() -> Result<uint32_t> {
    std::lock_guard<std::mutex> lock(mu_);
    claiming_.insert(sequence);
    SPECACHE_ASSIGN_OR_RETURN(const uint32_t slot,
                              PlaceClaimedLocked(session, token, sequence, layout, taken.kept.pages_per_layer));
    Session& s = sessions_.at(session);
    for (const auto& layer : s.pages->Find(sequence)->pages) {
      for (const shm::PageRef& ref : layer) targets.push_back(PageAddress(s, ref));
    }
    ++s.pins;
    return slot;
  }();
  if (!placed.ok()) return placed.status();  // put back by the guard
  const uint32_t slot = *placed;
  if (before_unlocked_work_) before_unlocked_work_(session);
  // The copy, without the registry's lock (GiBs at long contexts, which every session's calls
  // would wait for): the session keeps its chunks meanwhile (pins: Reap and CloseSession wait),
  // and nobody releases or keeps the sequence (claiming_).
  const uint64_t page_bytes = layout.page_bytes();
  for (size_t i = 0; i < targets.size(); ++i) {
    const auto l = static_cast<uint32_t>(i / taken.kept.pages_per_layer);
    const auto page = static_cast<uint32_t>(i % taken.kept.pages_per_layer);
    std::memcpy(targets[i], taken.kept.page(l, page), page_bytes);
  }
  bool ended = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    Session& s = sessions_.at(session);  // not reclaimed while pinned
    --s.pins;
    // Closed, or its attach connection gone, during the copy: the sequence leaves it (its pages go
    // back with the chunks) and stays kept.
    ended = s.detached;
    if (ended) {
      sequence_owner_.erase(sequence);
      keep_on_close_.erase(sequence);
      (void)s.pages->Retire(sequence);
    }
  }
  reclaimable_.notify_all();
  if (ended) {
    spdlog::info("session {} ended while sequence {} was being claimed: it stays kept", session, sequence);
    return Status::FailedPrecondition("session " + std::to_string(session) + " ended while sequence " +
                                      std::to_string(sequence) + " was being claimed: it stays kept");
  }
  const uint32_t pages_per_layer = taken.kept.pages_per_layer;
  kept_->Finish(std::move(taken));
  claim.finished = true;
  return std::make_pair(slot, pages_per_layer);
}

Result<std::string> Registry::SessionTenant(uint64_t session) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = sessions_.find(session);
  if (it == sessions_.end() || it->second.detached) return Status::NotFound("session " + std::to_string(session));
  return it->second.tenant;
}

uint64_t Registry::OwnerOf(uint64_t sequence) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = sequence_owner_.find(sequence);
  return it == sequence_owner_.end() ? 0 : it->second;
}

RegistryStats Registry::Stats() const {
  // The kept sequences' figures first, without the registry's lock: KeptSequences takes its own
  // lock, which a spill or restore holds for the length of its disk I/O.
  KeptStats kept = kept_->stats();
  std::lock_guard<std::mutex> lock(mu_);
  RegistryStats st;
  // As measured at startup: a fresh measurement walks every page of the pool (ChunkPool::mapping),
  // too slow for the metrics' refresh and for any caller of Stats.
  st.pool_huge_bytes = pool_->mapped_at_start().huge;
  st.chunk_bytes = pool_->chunk_bytes();
  st.pool_bytes = uint64_t{pool_->chunk_count()} * st.chunk_bytes;
  st.free_bytes = uint64_t{pool_->free_count()} * st.chunk_bytes;
  st.reserved_bytes = st.pool_bytes - st.free_bytes;
  st.memory_locked = pool_->locked();
  st.sessions_reclaimed = reclaimed_;
  st.chunks_replaced = pool_->replaced_chunks();
  st.chunks_out_of_service = pool_->out_of_service_count();
  std::map<std::string, TenantSummary> tenants;
  for (const auto& [name, t] : config_.tenants) {
    const uint64_t retained = pool_->retained_bytes(tenant_tags_.at(name));
    tenants[name] = TenantSummary{name, retained, 0, t.quota_bytes, retained, 0, 0};
  }
  for (const auto& [id, s] : sessions_) {
    TenantSummary& t = tenants[s.tenant];
    t.reserved_bytes += s.pages->chunks().size() * st.chunk_bytes;
    t.used_bytes += s.pages->used_bytes();
    t.sessions += 1;
    t.sequences += static_cast<uint32_t>(s.pages->sequences().size());
    st.used_bytes += s.pages->used_bytes();
    st.pages += s.pages->page_count();
    st.sequences += static_cast<uint32_t>(s.pages->sequences().size());
    st.sessions += 1;
  }
  for (auto& [name, t] : tenants) st.tenants.push_back(t);
  st.kept = std::move(kept);
  return st;
}

std::vector<SessionSummary> Registry::Sessions() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<SessionSummary> out;
  const auto now = std::chrono::steady_clock::now();
  for (const auto& [id, s] : sessions_) {
    out.push_back({id, s.tenant, s.client_name, s.peer, s.attached && !s.detached,
                   static_cast<uint32_t>(s.pages->chunks().size()), s.pages->used_bytes(),
                   static_cast<uint32_t>(s.pages->sequences().size()),
                   static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::milliseconds>(now - s.opened).count())});
  }
  return out;
}

std::vector<SequenceSummary> Registry::Sequences() const {
  const std::vector<KeptSummary> kept = kept_->List();  // without the registry's lock, as in Stats
  std::vector<SequenceSummary> out;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [id, s] : sessions_) {
      for (const auto& [seq, p] : s.pages->sequences()) {
        out.push_back({seq, id, s.tenant, p.layout, p.pages_per_layer,
                       uint64_t{p.pages_per_layer} * p.layout.n_layers * p.layout.page_bytes(), "session"});
      }
    }
  }
  for (const KeptSummary& k : kept) {
    out.push_back({k.id, 0, k.tenant, k.layout, k.pages_per_layer, k.bytes,
                   k.state == KeptState::kParked ? "parked" : "spilled"});
  }
  return out;
}

}  // namespace specache::daemon
