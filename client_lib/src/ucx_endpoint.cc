#include "ucx_endpoint.h"

#include <poll.h>

#include <array>
#include <atomic>
#include <cstring>
#include <map>
#include <mutex>

#include <ucp/api/ucp.h>

namespace specache::client {
namespace {

using Clock = std::chrono::steady_clock;

std::string UcsError(const std::string& what, ucs_status_t s) { return what + ": " + ucs_status_string(s); }

}  // namespace

struct UcxEndpoint::Impl {
  // A request until its caller collected it (Wait) and UCX is done with it: UCX holds a pointer
  // to it while its send, or its reply's rendezvous receive, is in flight (send_pending,
  // data_pending), so an entry its caller gave up on stays, abandoned, until the callback that
  // ends the last of them removes it (or the worker is destroyed).
  struct Pending {
    Impl* impl = nullptr;
    uint64_t id = 0;
    remote::RowsRequest rows;  // the header as sent (UCX may read it until the send completes)
    remote::Hello hello;
    // A hello waits for the daemon's challenge (written into it then) before it is sent; its
    // payload (the caller's, valid until its Wait returns) is sent with it.
    bool awaiting_challenge = false;
    const void* hello_payload = nullptr;
    size_t hello_payload_bytes = 0;
    void* out = nullptr;
    size_t capacity = 0, received = 0;
    bool replied = false, sent = false;
    bool send_pending = false, data_pending = false, abandoned = false;
    Status status;
  };
  // The caller is done with the entry: removed now, or once UCX is done with it too.
  void ForgetLocked(std::map<uint64_t, Pending>::iterator it) {
    Pending& p = it->second;
    if (!p.send_pending && !p.data_pending) {
      pending.erase(it);
      return;
    }
    p.abandoned = true;
  }
  // After the endpoint was closed: progress until UCX released what it held for requests and gets
  // (a forced close purges them in later progress), so that nothing lands in a caller's buffer
  // after its call returned. Bounded: past kReleaseWait, the holds are abandoned.
  static constexpr auto kReleaseWait = std::chrono::seconds(5);
  bool HeldLocked(uint64_t request) const {
    auto it = pending.find(request);
    return (it != pending.end() && (it->second.send_pending || it->second.data_pending)) || gets_outstanding > 0;
  }
  void DrainLocked(uint64_t request) {
    const auto until = Clock::now() + kReleaseWait;
    while (HeldLocked(request) && Clock::now() < until) ucp_worker_progress(worker);
  }
  // From a callback that ended one of UCX's holds on the entry.
  static void ReleaseHold(Pending* p) {
    if (p->abandoned && !p->send_pending && !p->data_pending) p->impl->pending.erase(p->id);
  }

  ucp_context_h context = nullptr;
  ucp_worker_h worker = nullptr;
  ucp_ep_h ep = nullptr;
  int efd = -1;
  std::string address;
  mutable std::mutex mu;
  std::map<uint64_t, Pending> pending;
  uint64_t next_id = 1;
  // The challenge the daemon sent this endpoint (kChallenge), which its hello carries back.
  bool challenged = false;
  std::array<uint8_t, remote::kChallengeBytes> challenge{};
  bool failed = false;
  std::string failure;
  uint64_t late_replies = 0;
  // Client-side gets.
  struct Chunk {
    uint64_t address = 0, bytes = 0;
    ucp_rkey_h rkey = nullptr;
  };
  std::vector<Chunk> chunks;
  ucp_mem_h staging = nullptr;
  uint8_t* staging_base = nullptr;
  size_t staging_bytes = 0;
  uint64_t gets_outstanding = 0, gets = 0;
  Status get_status;

  ~Impl() {
    std::lock_guard<std::mutex> lock(mu);
    // UCX wants a remote key destroyed after the operations that use it and before the endpoint
    // it was unpacked on: with no get in flight they go first. Gets still in flight (never waited
    // for) use the keys and the staging registration, so then the forced close comes first and
    // the keys go once its purge released the gets, as after a failure closed the endpoint.
    if (ep && gets_outstanding == 0) DestroyKeysLocked();
    if (ep) CloseLocked();
    DrainLocked(0);
    DestroyKeysLocked();
    if (staging) ucp_mem_unmap(context, staging);
    if (worker) ucp_worker_destroy(worker);
    if (context) ucp_cleanup(context);
  }

  void DestroyKeysLocked() {
    for (Chunk& c : chunks) {
      if (c.rkey) ucp_rkey_destroy(c.rkey);
      c.rkey = nullptr;
    }
  }

  // Closes the endpoint (forced: the daemon may be gone); every request still pending fails. What
  // UCX holds for them is purged in later progress (DrainLocked), not here.
  void CloseLocked() {
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = UCP_EP_CLOSE_FLAG_FORCE;
    ucs_status_ptr_t st = ucp_ep_close_nbx(ep, &p);
    ep = nullptr;
    if (st != nullptr && !UCS_PTR_IS_ERR(st)) {
      const auto until = Clock::now() + std::chrono::milliseconds(100);
      while (ucp_request_check_status(st) == UCS_INPROGRESS && Clock::now() < until) ucp_worker_progress(worker);
      ucp_request_free(st);
    }
    FailAllLocked(failure.empty() ? "endpoint closed" : failure);
  }

  void FailAllLocked(const std::string& why) {
    if (!failed) {
      failed = true;
      failure = why;
    }
    for (auto& [id, p] : pending) {
      if (!p.replied) p.status = Status::Unavailable("remote daemon at " + address + ": " + failure);
      // What UCX still holds completes (with an error) in later progress; its callback says so.
      if (!p.data_pending) p.replied = true;
      if (!p.send_pending) p.sent = true;
    }
    if (gets_outstanding > 0 && get_status.ok()) get_status = Status::Unavailable("remote daemon at " + address + ": " + failure);
  }

  static void OnError(void* arg, ucp_ep_h, ucs_status_t status) {
    auto* self = static_cast<Impl*>(arg);  // called from progress, under mu
    self->FailAllLocked(std::string("connection lost (") + ucs_status_string(status) + ")");
  }

  static void OnSent(void* request, ucs_status_t status, void* user_data) {
    auto* p = static_cast<Pending*>(user_data);
    p->sent = true;
    p->send_pending = false;
    if (status != UCS_OK && p->status.ok()) p->status = Status::Unavailable(UcsError("send", status));
    ucp_request_free(request);
    ReleaseHold(p);
  }

  static void OnReplyData(void* request, ucs_status_t status, size_t length, void* user_data) {
    auto* p = static_cast<Pending*>(user_data);
    p->replied = true;
    p->data_pending = false;
    p->received = length;
    if (status != UCS_OK && p->status.ok()) p->status = Status::Unavailable(UcsError("reply data", status));
    ucp_request_free(request);
    ReleaseHold(p);
  }

  static ucs_status_t OnReply(void* arg, const void* header, size_t header_length, void* data, size_t length,
                              const ucp_am_recv_param_t* param) {
    auto* self = static_cast<Impl*>(arg);
    auto reply = remote::ParseReply({static_cast<const uint8_t*>(header), header_length});
    if (!reply.ok()) {
      self->FailAllLocked("malformed reply from the daemon: " + reply.status().message());
      return UCS_OK;
    }
    auto it = self->pending.find(reply->request_id);
    if (it == self->pending.end() || it->second.replied || it->second.abandoned || it->second.data_pending) {
      ++self->late_replies;  // a request given up meanwhile
      return UCS_OK;
    }
    Pending& p = it->second;
    const bool rndv = param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV;
    if (reply->code != 0) {
      std::string message = rndv ? "(message not received)" : std::string(static_cast<const char*>(data), length);
      p.status = Status(static_cast<StatusCode>(reply->code), "remote daemon: " + message);
      p.replied = true;
      return UCS_OK;
    }
    if (length > p.capacity) {
      p.status = Status::DataLoss("reply of " + std::to_string(length) + " bytes, expected at most " +
                                  std::to_string(p.capacity));
      p.replied = true;
      return UCS_OK;
    }
    if (!rndv) {
      if (length > 0) std::memcpy(p.out, data, length);
      p.received = length;
      p.replied = true;
      return UCS_OK;
    }
    ucp_request_param_t rp{};
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    rp.cb.recv_am = &Impl::OnReplyData;
    rp.user_data = &p;
    ucs_status_ptr_t st = ucp_am_recv_data_nbx(self->worker, data, p.out, length, &rp);
    if (st == nullptr) {
      p.received = length;
      p.replied = true;
    } else if (UCS_PTR_IS_ERR(st)) {
      p.status = Status::Unavailable(UcsError("reply data", UCS_PTR_STATUS(st)));
      p.replied = true;
    } else {
      p.data_pending = true;  // until OnReplyData
    }
    return UCS_OK;
  }

  static ucs_status_t OnChallenge(void* arg, const void* header, size_t header_length, void*, size_t,
                                  const ucp_am_recv_param_t*) {
    auto* self = static_cast<Impl*>(arg);  // called from progress, under mu
    auto c = remote::ParseChallenge({static_cast<const uint8_t*>(header), header_length});
    if (!c.ok()) {
      self->FailAllLocked("the daemon's challenge: " + c.status().message());
      return UCS_OK;
    }
    if (!self->challenged) {  // a daemon sends one; a later one changes nothing
      self->challenge = c->challenge;
      self->challenged = true;
    }
    return UCS_OK;
  }

  // Sends request p (AM id, the header as p holds it, a payload): UCX holds p until OnSent.
  Status PostLocked(Pending& p, remote::AmId id, const void* header, size_t header_bytes, const void* payload,
                    size_t payload_bytes) {
    ucp_request_param_t rp{};
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
    rp.cb.send = &Impl::OnSent;
    rp.user_data = &p;
    rp.flags = UCP_AM_SEND_FLAG_REPLY;  // the daemon answers on the endpoint the message came from
    ucs_status_ptr_t st = ucp_am_send_nbx(ep, id, header, header_bytes, payload, payload_bytes, &rp);
    if (st == nullptr) {
      p.sent = true;
    } else if (UCS_PTR_IS_ERR(st)) {
      return Status::Unavailable(UcsError("send to " + address, UCS_PTR_STATUS(st)));
    } else {
      p.send_pending = true;  // until OnSent
    }
    return Status::Ok();
  }

  // The hello (request 0), once the daemon's challenge came: the challenge written into it, sent.
  // A send that fails ends it with that status.
  void SendHelloLocked() {
    auto it = pending.find(0);
    if (!challenged || failed || it == pending.end() || !it->second.awaiting_challenge) return;
    Pending& p = it->second;
    p.awaiting_challenge = false;
    p.hello.challenge = challenge;
    Status s = PostLocked(p, remote::kHello, &p.hello, sizeof p.hello, p.hello_payload, p.hello_payload_bytes);
    if (!s.ok()) p.status = s, p.sent = p.replied = true;
  }

  static void OnGet(void* request, ucs_status_t status, void* user_data) {
    auto* self = static_cast<Impl*>(user_data);
    --self->gets_outstanding;
    if (status != UCS_OK && self->get_status.ok()) self->get_status = Status::Unavailable(UcsError("get", status));
    ucp_request_free(request);
  }

  Status Init(bool rma) {
    ucp_config_t* config = nullptr;
    if (ucs_status_t s = ucp_config_read(nullptr, nullptr, &config); s != UCS_OK) {
      return Status::Unavailable(UcsError("ucp_config_read", s));
    }
    ucp_params_t p{};
    p.field_mask = UCP_PARAM_FIELD_FEATURES;
    p.features = UCP_FEATURE_AM | UCP_FEATURE_WAKEUP | (rma ? UCP_FEATURE_RMA : 0);
    ucs_status_t s = ucp_init(&p, config, &context);
    ucp_config_release(config);
    if (s != UCS_OK) return Status::Unavailable(UcsError("ucp_init", s));
    ucp_worker_params_t wp{};
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wp.thread_mode = UCS_THREAD_MODE_SINGLE;  // serialised by mu
    if ((s = ucp_worker_create(context, &wp, &worker)) != UCS_OK) return Status::Unavailable(UcsError("ucp_worker_create", s));
    if ((s = ucp_worker_get_efd(worker, &efd)) != UCS_OK) return Status::Unavailable(UcsError("ucp_worker_get_efd", s));
    ucp_am_handler_param_t h{};
    h.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG |
                   UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
    h.id = remote::kReply;
    h.cb = &Impl::OnReply;
    h.arg = this;
    h.flags = UCP_AM_FLAG_WHOLE_MSG;
    if ((s = ucp_worker_set_am_recv_handler(worker, &h)) != UCS_OK) return Status::Unavailable(UcsError("am handler", s));
    h.id = remote::kChallenge;
    h.cb = &Impl::OnChallenge;
    if ((s = ucp_worker_set_am_recv_handler(worker, &h)) != UCS_OK) return Status::Unavailable(UcsError("am handler", s));
    SPECACHE_ASSIGN_OR_RETURN(remote::SocketAddress addr, remote::ResolveAddress(address));
    ucp_ep_params_t ep_params{};
    ep_params.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR | UCP_EP_PARAM_FIELD_ERR_HANDLER |
                           UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
    ep_params.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
    ep_params.sockaddr.addr = addr.get();
    ep_params.sockaddr.addrlen = addr.length;
    ep_params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    ep_params.err_handler.cb = &Impl::OnError;
    ep_params.err_handler.arg = this;
    if ((s = ucp_ep_create(worker, &ep_params, &ep)) != UCS_OK) {
      return Status::Unavailable(UcsError("UCX connect to " + address, s));
    }
    return Status::Ok();
  }

  // One turn of progress; when nothing happened for 100 us, a sleep of at most 1 ms on the
  // worker's event fd (with the lock released, so another waiter may progress meanwhile; not
  // every transport signals the fd, hence the bound).
  void ProgressOrSleep(std::unique_lock<std::mutex>* lock, Clock::time_point* last_event) {
    if (ucp_worker_progress(worker) != 0) {
      *last_event = Clock::now();
      return;
    }
    if (Clock::now() - *last_event < std::chrono::microseconds(100)) return;
    if (ucp_worker_arm(worker) != UCS_OK) return;
    lock->unlock();
    pollfd p{efd, POLLIN, 0};
    poll(&p, 1, 1);
    lock->lock();
  }

  // A request that missed its deadline: the daemon may still be working on it and nothing says
  // when UCX is done with the caller's buffers, so the endpoint is closed (every other request
  // fails too) and this remote session is over.
  Status GiveUpLocked(const char* what) {
    if (!failed) failure = std::string(what) + " missed its deadline; the endpoint was closed";
    if (ep) CloseLocked();
    return Status::DeadlineExceeded("remote daemon at " + address + ": no answer within the deadline (" + what +
                                    "); the remote session is over, open a new one");
  }
};

UcxEndpoint::UcxEndpoint(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
UcxEndpoint::~UcxEndpoint() = default;

Result<std::unique_ptr<UcxEndpoint>> UcxEndpoint::Connect(const std::string& address, bool rma) {
  auto impl = std::make_unique<Impl>();
  impl->address = address;
  SPECACHE_RETURN_IF_ERROR(impl->Init(rma));
  return std::unique_ptr<UcxEndpoint>(new UcxEndpoint(std::move(impl)));
}

bool UcxEndpoint::failed() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->failed;
}

uint64_t UcxEndpoint::gets_issued() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->gets;
}

Result<uint64_t> UcxEndpoint::Start(remote::AmId id, const void* header, size_t header_bytes, const void* payload,
                                    size_t payload_bytes, void* out, size_t out_capacity) {
  Impl* m = impl_.get();
  std::lock_guard<std::mutex> lock(m->mu);
  if (m->failed) return Status::Unavailable("remote daemon at " + m->address + ": " + m->failure);
  const bool hello = id == remote::kHello;
  if (header_bytes != (hello ? sizeof(remote::Hello) : sizeof(remote::RowsRequest))) {
    return Status::InvalidArgument(hello ? "hello header size" : "rows header size");
  }
  const uint64_t request = hello ? 0 : m->next_id++;
  if (m->pending.count(request)) return Status::FailedPrecondition("a hello is already in flight");
  Impl::Pending& p = m->pending[request];
  p.impl = m;
  p.id = request;
  p.out = out;
  p.capacity = out_capacity;
  if (hello) {  // sent once the daemon's challenge came (SendHelloLocked: now, or in Wait's progress)
    std::memcpy(&p.hello, header, sizeof p.hello);
    p.awaiting_challenge = true;
    p.hello_payload = payload;
    p.hello_payload_bytes = payload_bytes;
    m->SendHelloLocked();
    if (p.replied && !p.status.ok()) {
      Status s = p.status;
      m->pending.erase(request);
      return s;
    }
    return request;
  }
  std::memcpy(&p.rows, header, sizeof p.rows);
  p.rows.request_id = request;
  if (Status s = m->PostLocked(p, id, &p.rows, sizeof p.rows, payload, payload_bytes); !s.ok()) {
    m->pending.erase(request);
    return s;
  }
  return request;
}

Status UcxEndpoint::Wait(uint64_t request, Deadline deadline, size_t* out_bytes) {
  Impl* m = impl_.get();
  std::unique_lock<std::mutex> lock(m->mu);
  Clock::time_point idle = Clock::now();
  while (true) {
    auto it = m->pending.find(request);
    if (it == m->pending.end()) return Status::InvalidArgument("request " + std::to_string(request) + " is not pending");
    if (it->second.abandoned) return Status::InvalidArgument("request " + std::to_string(request) + " is not pending");
    if (it->second.replied && it->second.sent) {
      Status s = it->second.status;
      if (out_bytes) *out_bytes = it->second.received;
      m->pending.erase(it);
      return s;
    }
    if (Clock::now() >= deadline) {
      const char* what = it->second.awaiting_challenge
                             ? "the hello, for which no challenge came: the daemon is unreachable, or older than this client"
                             : "request";
      Status s = m->GiveUpLocked(what);
      m->DrainLocked(request);
      it = m->pending.find(request);
      if (it != m->pending.end()) m->ForgetLocked(it);
      return s;
    }
    m->ProgressOrSleep(&lock, &idle);
    m->SendHelloLocked();
  }
}

Status UcxEndpoint::Call(remote::AmId id, const void* header, size_t header_bytes, const void* payload,
                         size_t payload_bytes, std::vector<uint8_t>* out, size_t out_capacity, Deadline deadline) {
  std::vector<uint8_t> scratch;
  std::vector<uint8_t>* buffer = out ? out : &scratch;
  buffer->resize(out_capacity);
  SPECACHE_ASSIGN_OR_RETURN(uint64_t request,
                            Start(id, header, header_bytes, payload, payload_bytes, buffer->data(), out_capacity));
  size_t received = 0;
  Status s = Wait(request, deadline, &received);
  buffer->resize(s.ok() ? received : 0);
  return s;
}

Status UcxEndpoint::SetRemoteChunks(const std::vector<uint8_t>& payload) {
  Impl* m = impl_.get();
  std::lock_guard<std::mutex> lock(m->mu);
  // RemoteChunk[n] then n packed keys: n is the largest count whose table and keys fit exactly.
  size_t n = 0;
  std::vector<remote::RemoteChunk> table;
  size_t offset = 0;
  while (offset + sizeof(remote::RemoteChunk) <= payload.size()) {
    remote::RemoteChunk c;
    std::memcpy(&c, payload.data() + offset, sizeof c);
    table.push_back(c);
    offset += sizeof c;
    size_t keys = 0;
    for (const auto& t : table) keys += t.rkey_bytes;
    if (offset + keys == payload.size()) {
      n = table.size();
      break;
    }
  }
  if (n == 0) return Status::DataLoss("hello reply carries no chunk table (is rma on at the daemon?)");
  const uint8_t* key = payload.data() + n * sizeof(remote::RemoteChunk);
  for (size_t i = 0; i < n; ++i) {
    Impl::Chunk c{table[i].address, table[i].bytes, nullptr};
    if (ucs_status_t s = ucp_ep_rkey_unpack(m->ep, key, &c.rkey); s != UCS_OK) {
      return Status::DataLoss(UcsError("remote key of chunk " + std::to_string(i), s));
    }
    key += table[i].rkey_bytes;
    m->chunks.push_back(c);
  }
  return Status::Ok();
}

size_t UcxEndpoint::remote_chunks() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->chunks.size();
}

Status UcxEndpoint::RegisterStaging(void* base, size_t bytes) {
  Impl* m = impl_.get();
  std::lock_guard<std::mutex> lock(m->mu);
  if (m->staging) ucp_mem_unmap(m->context, m->staging);
  m->staging = nullptr;
  ucp_mem_map_params_t mp{};
  mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
  mp.address = base;
  mp.length = bytes;
  if (ucs_status_t s = ucp_mem_map(m->context, &mp, &m->staging); s != UCS_OK) {
    return Status::Unavailable(UcsError("ucp_mem_map of the staging buffer", s));
  }
  m->staging_base = static_cast<uint8_t*>(base);
  m->staging_bytes = bytes;
  return Status::Ok();
}

Status UcxEndpoint::Get(uint32_t chunk, uint64_t offset, void* local, size_t bytes) {
  Impl* m = impl_.get();
  std::lock_guard<std::mutex> lock(m->mu);
  if (m->failed) return Status::Unavailable("remote daemon at " + m->address + ": " + m->failure);
  if (chunk >= m->chunks.size() || offset > m->chunks[chunk].bytes || m->chunks[chunk].bytes - offset < bytes) {
    return Status::OutOfRange("get outside remote chunk " + std::to_string(chunk));
  }
  ucp_request_param_t rp{};
  rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  const auto* l = static_cast<uint8_t*>(local);
  if (m->staging && l >= m->staging_base && l + bytes <= m->staging_base + m->staging_bytes) {
    rp.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
    rp.memh = m->staging;
  }
  rp.cb.send = &Impl::OnGet;
  rp.user_data = m;
  ucs_status_ptr_t st = ucp_get_nbx(m->ep, local, bytes, m->chunks[chunk].address + offset, m->chunks[chunk].rkey, &rp);
  ++m->gets;
  if (st == nullptr) return Status::Ok();
  if (UCS_PTR_IS_ERR(st)) return Status::Unavailable(UcsError("get", UCS_PTR_STATUS(st)));
  ++m->gets_outstanding;
  return Status::Ok();
}

Status UcxEndpoint::WaitGets(Deadline deadline) {
  Impl* m = impl_.get();
  std::unique_lock<std::mutex> lock(m->mu);
  Clock::time_point idle = Clock::now();
  while (m->gets_outstanding > 0 && !m->failed) {
    if (Clock::now() >= deadline) {
      Status s = m->GiveUpLocked("gets");
      m->DrainLocked(0);  // the gets still write into the staging buffer until UCX lets them go
      return s;
    }
    m->ProgressOrSleep(&lock, &idle);
  }
  if (m->failed) m->DrainLocked(0);
  Status s = m->get_status;
  m->get_status = Status::Ok();
  if (m->failed && s.ok()) s = Status::Unavailable("remote daemon at " + m->address + ": " + m->failure);
  return s;
}

}  // namespace specache::client
