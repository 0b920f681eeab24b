#include "ucx_server.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/random.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include <spdlog/spdlog.h>
#include <ucp/api/ucp.h>

#include "log_rate.h"
#include "specache/remote_protocol.h"

namespace specache::daemon {
namespace {

using Clock = std::chrono::steady_clock;

std::string UcsError(const char* what, ucs_status_t s) { return std::string(what) + ": " + ucs_status_string(s); }

// The request id of a rows request's header, even one that does not parse (too many rows, say),
// so that its refusal reaches the request that made it; 0 when the header is not one.
uint64_t RequestIdOf(const std::vector<uint8_t>& header) {
  uint64_t id = 0;
  if (header.size() == sizeof(remote::RowsRequest)) {
    std::memcpy(&id, header.data() + offsetof(remote::RowsRequest, request_id), sizeof id);
  }
  return id;
}

}  // namespace

struct UcxServer::Impl {
  // One endpoint from the listener.
  struct Connection {
    ucp_ep_h ep = nullptr;
    Clock::time_point accepted;
    bool failed = false;  // UCX reported an error: closed by the loop
    Clock::time_point close_at{};  // refused at the hello: closed once the refusal had time to leave
    uint64_t session = 0;  // 0 until the hello
    Token token{};
    // Sent to the endpoint's peer at once (kChallenge); before the hello the endpoint takes only a
    // hello that carries it back (Challenged).
    Token challenge{};
    std::vector<ucp_mem_h> memh;  // the session's chunks, with `rma`
    // Which connection this is: UCX may give a new connection the address of a closed one's
    // endpoint, so what outlives a connection (a reply in flight) names it by ep and serial.
    uint64_t serial = 0;
    std::string misbehaved;  // why it is closed by the loop (Misbehaved)
    // Request payloads taken off the wire and not yet served, and reply payloads not yet sent
    // (at most options.max_endpoint_bytes: a client that floods requests or never takes its
    // replies is refused or closed, not given the daemon's memory); and how many of each.
    uint64_t bytes_held = 0;
    uint32_t jobs_queued = 0, replies_in_flight = 0;
    // While replies are in flight: when the last one was sent or taken (a client that takes none
    // for kReplyDeadline is closed: its replies hold the data plane's memory).
    Clock::time_point replies_moved{};
  };
  // A reply (or a challenge) in flight: it lives until UCX is done with its buffers.
  struct Outgoing {
    Impl* impl = nullptr;
    ucp_ep_h ep = nullptr;
    uint64_t serial = 0;  // its connection's
    uint16_t id = remote::kReply;  // or kChallenge (header unused, no payload)
    remote::Reply header;
    remote::Challenge challenge;
    std::vector<uint8_t> payload;
    std::function<void()> then;  // after the send completed (or failed)
  };
  // A request taken off the wire, answered by the loop (not inside UCX's callback, which must
  // not send or progress).
  struct Job {
    uint16_t id = 0;
    ucp_ep_h ep = nullptr;  // null once its endpoint is closed (nobody to answer)
    uint64_t serial = 0;    // its connection's
    Clock::time_point arrived;
    Clock::time_point due{};  // a rendezvous payload not received by then closes its endpoint
    std::vector<uint8_t> header, payload;
    remote::RowsRequest request;  // a rows request's header, as Admit parsed it
    bool ready = false;  // payload complete (a rendezvous payload arrives later)
    bool failed = false;  // its payload did not arrive
    Status refusal;       // refused on arrival (Admit): answered with this, its payload never received
    uint64_t held = 0;    // its payload's bytes in its endpoint's bytes_held
  };
  struct HandlerArg {
    Impl* impl;
    uint16_t id;  // a served id (remote_protocol.h), or kUnservedId: any other
  };
  // The handler argument of every active message id the daemon does not serve.
  static constexpr uint16_t kUnservedId = 0;
  static_assert(remote::kHello != kUnservedId && remote::kGather != kUnservedId && remote::kWrite != kUnservedId &&
                    remote::kPages != kUnservedId,
                "a served active message id must differ from kUnservedId");
  static_assert(remote::kChallengeBytes == attach::kTokenBytes, "a challenge is compared as a token (SameToken)");
  // A protocol version 2 hello's size (this one's without the challenge): named in the log when one
  // is dropped.
  static constexpr size_t kVersion2HelloBytes = sizeof(remote::Hello) - remote::kChallengeBytes;

  Registry* registry = nullptr;
  UcxServerOptions options;
  ucp_context_h context = nullptr;
  ucp_worker_h worker = nullptr;
  ucp_listener_h listener = nullptr;
  uint16_t port = 0;
  std::string transports;
  int efd = -1;
  std::map<ucp_ep_h, Connection> connections;
  // Endpoints accepted whose challenge the loop has not sent yet (ep, serial): UCX's callbacks
  // must not send.
  std::vector<std::pair<ucp_ep_h, uint64_t>> unchallenged;
  std::deque<std::unique_ptr<Job>> jobs;
  std::vector<HandlerArg> handler_args;
  std::thread thread;
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> open{0}, requests{0}, refused{0}, dropped{0};
  uint64_t next_serial = 1;
  uint64_t total_held = 0;  // bytes_held of every connection (at most options.max_held_bytes)
  uint64_t misbehaving = 0;
  uint64_t dropped_unanswerable = 0;  // messages with no endpoint to answer on (logged 1st, 2nd, 4th...)
  uint64_t dropped_unauthentic = 0;  // messages naming a session's endpoint without its id and token (likewise)
  uint64_t dropped_unserved = 0;  // messages of an id the daemon does not serve (likewise)
  uint64_t dropped_closing = 0;  // messages on an endpoint being closed for misbehaving (likewise)
  uint64_t dropped_unchallenged = 0;  // messages before an endpoint's hello without its challenge (likewise)
  uint64_t challenges_undelivered = 0;  // challenges UCX did not send or deliver (likewise; not `dropped`)
  // A connection's most queued requests and replies in flight: past either it is closed.
  static constexpr uint32_t kMostQueued = 1024;
  // A rendezvous payload not received within kPayloadDeadline, plus the time everything held at its
  // arrival takes at kSlowLinkBytesPerSecond (a slow link shared by many writers is not a stall),
  // closes its endpoint: it holds up its endpoint's later requests, and its buffer.
  static constexpr auto kPayloadDeadline = std::chrono::seconds(10);
  static constexpr uint64_t kSlowLinkBytesPerSecond = uint64_t{25} << 20;
  // Replies in flight of which none was taken for this long close their endpoint.
  static constexpr auto kReplyDeadline = std::chrono::seconds(30);

  ~Impl() {
    stop = true;
    if (worker) ucp_worker_signal(worker);
    if (thread.joinable()) thread.join();
    for (auto& [ep, c] : connections) CloseConnection(&c, /*detach=*/false);
    if (worker) Drain(std::chrono::milliseconds(200));
    if (listener) ucp_listener_destroy(listener);
    if (worker) ucp_worker_destroy(worker);
    if (context) ucp_cleanup(context);
  }

  void Drain(std::chrono::milliseconds for_at_most) {
    const auto until = Clock::now() + for_at_most;
    while (Clock::now() < until) {
      if (ucp_worker_progress(worker) == 0) std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }

  // Every refusal: counted, answered with its status, logged at 1, 2, 4, 8... (a hostile loop
  // does not flood the log).
  void Refused(const Status& why) {
    const uint64_t n = ++refused;
    if (LoggedOccurrence(n)) spdlog::warn("remote data plane: refused ({} so far): {}", n, why.ToString());
  }

  Status Init() {
    // The one setting made here, unless the environment says otherwise: a restarted daemon must
    // get its port back while the old connections sit in TIME_WAIT (UCX's default refuses). The
    // connection managers read their settings from the environment only (ucp_config_modify does
    // not reach them in UCX 1.13), so it goes there, before any UCX object exists.
    setenv("UCX_TCP_CM_REUSEADDR", "y", /*overwrite=*/0);
    setenv("UCX_RDMA_CM_REUSEADDR", "y", /*overwrite=*/0);
    ucp_config_t* config = nullptr;
    // Otherwise UCX's own configuration (UCX_TLS, UCX_NET_DEVICES, ucx.conf): nothing is forced.
    if (ucs_status_t s = ucp_config_read(nullptr, nullptr, &config); s != UCS_OK) {
      return Status::Unavailable(UcsError("ucp_config_read", s));
    }
    ucp_params_t p{};
    p.field_mask = UCP_PARAM_FIELD_FEATURES;
    p.features = UCP_FEATURE_AM | UCP_FEATURE_WAKEUP | (options.rma ? UCP_FEATURE_RMA : 0);
    ucs_status_t s = ucp_init(&p, config, &context);
    ucp_config_release(config);
    if (s != UCS_OK) return Status::Unavailable(UcsError("ucp_init", s));
    const char* tls = std::getenv("UCX_TLS");
    transports = tls ? std::string("UCX_TLS=") + tls : "UCX's default selection (UCX_TLS unset)";
    ucp_worker_params_t wp{};
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wp.thread_mode = UCS_THREAD_MODE_SINGLE;  // only the loop thread touches it
    if ((s = ucp_worker_create(context, &wp, &worker)) != UCS_OK) return Status::Unavailable(UcsError("ucp_worker_create", s));
    if ((s = ucp_worker_get_efd(worker, &efd)) != UCS_OK) return Status::Unavailable(UcsError("ucp_worker_get_efd", s));
    // Every id has a handler: UCX itself warns on each message of an id without one (a line per
    // message, uncounted: any peer could flood the log), so the ids the daemon does not serve go
    // to OnMessage too, which counts them and logs a few. Registered from the highest id down, so
    // that UCX sizes its handler table once (64 Ki entries).
    for (uint16_t id : {remote::kHello, remote::kGather, remote::kWrite, remote::kPages}) handler_args.push_back({this, id});
    handler_args.push_back({this, kUnservedId});  // last: no served id is kUnservedId (static_assert above)
    for (uint32_t id = 0xFFFF;; --id) {
      HandlerArg* arg = &handler_args.back();
      for (HandlerArg& a : handler_args) {
        if (a.id == id && a.id != kUnservedId) arg = &a;
      }
      ucp_am_handler_param_t h{};
      h.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG |
                     UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
      h.id = static_cast<uint16_t>(id);
      h.cb = &Impl::OnMessage;
      h.arg = arg;
      h.flags = UCP_AM_FLAG_WHOLE_MSG;
      if ((s = ucp_worker_set_am_recv_handler(worker, &h)) != UCS_OK) {
        return Status::Unavailable(UcsError("ucp_worker_set_am_recv_handler", s));
      }
      if (id == 0) break;
    }
    SPECACHE_ASSIGN_OR_RETURN(remote::SocketAddress addr, remote::ResolveAddress(options.listen_addr));
    ucp_listener_params_t lp{};
    lp.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
    lp.sockaddr.addr = addr.get();
    lp.sockaddr.addrlen = addr.length;
    lp.conn_handler.cb = &Impl::OnConnection;
    lp.conn_handler.arg = this;
    if ((s = ucp_listener_create(worker, &lp, &listener)) != UCS_OK) {
      return Status::Unavailable(UcsError(("UCX listener on " + options.listen_addr).c_str(), s));
    }
    ucp_listener_attr_t attr{};
    attr.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
    if ((s = ucp_listener_query(listener, &attr)) != UCS_OK) return Status::Unavailable(UcsError("ucp_listener_query", s));
    const auto* sa = reinterpret_cast<const sockaddr*>(&attr.sockaddr);
    port = ntohs(sa->sa_family == AF_INET6 ? reinterpret_cast<const sockaddr_in6*>(sa)->sin6_port
                                           : reinterpret_cast<const sockaddr_in*>(sa)->sin_port);
    return Status::Ok();
  }

  static void OnConnection(ucp_conn_request_h request, void* arg) {
    auto* self = static_cast<Impl*>(arg);
    // Full: the endpoint that has waited longest for its hello makes room (the next sweep closes
    // it), so that peers that connect and never say hello cannot hold every slot: each is closed
    // at the lease, but they can connect again as fast. Endpoints with a session keep theirs.
    // Endpoints being closed do not count; at most twice the limit are open at once.
    const size_t counted = self->CountedConnections();
    if (self->connections.size() >= 2 * size_t{self->options.max_connections} ||
        (counted >= self->options.max_connections && !self->EvictOldestWithoutHello())) {
      ucp_listener_reject(self->listener, request);
      self->Refused(Status::ResourceExhausted("remote connection rejected: " + std::to_string(counted) +
                                              " open, the limit, each with a session"));
      return;
    }
    Token challenge{};
    // Never blocking the loop (GRND_NONBLOCK: before the kernel's pool is ready, a connection is
    // rejected rather than the data plane stalled).
    if (getrandom(challenge.data(), challenge.size(), GRND_NONBLOCK) != static_cast<ssize_t>(challenge.size())) {
      ucp_listener_reject(self->listener, request);
      self->Refused(Status::Unavailable("remote connection rejected: no random bytes for its challenge yet (getrandom)"));
      return;
    }
    ucp_ep_params_t p{};
    p.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST | UCP_EP_PARAM_FIELD_ERR_HANDLER | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
    p.conn_request = request;
    p.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    p.err_handler.cb = &Impl::OnEndpointError;
    p.err_handler.arg = self;
    ucp_ep_h ep = nullptr;
    if (ucs_status_t s = ucp_ep_create(self->worker, &p, &ep); s != UCS_OK) {
      spdlog::warn("remote data plane: cannot accept a connection: {}", ucs_status_string(s));
      ++self->dropped;
      return;
    }
    Connection& c = self->connections[ep];
    c.ep = ep;
    c.serial = self->next_serial++;
    c.accepted = Clock::now();
    c.challenge = challenge;
    self->unchallenged.emplace_back(ep, c.serial);
    ++self->open;
  }

  static void OnEndpointError(void* arg, ucp_ep_h ep, ucs_status_t status) {
    auto* self = static_cast<Impl*>(arg);
    auto it = self->connections.find(ep);
    if (it == self->connections.end()) return;
    spdlog::info("remote data plane: endpoint of session {} failed: {}", it->second.session, ucs_status_string(status));
    it->second.failed = true;
  }

  // Whether a message to endpoint c, which said its hello, carries that hello's session id and
  // token (a hello's or a rows request's header of the exact size; any other message: no).
  static bool Authentic(const Connection& c, uint16_t id, const void* header, size_t header_length) {
    uint64_t session = 0;
    Token token{};
    if (id == remote::kHello && header_length == sizeof(remote::Hello)) {
      remote::Hello h;
      std::memcpy(&h, header, sizeof h);
      session = h.session_id;
      std::memcpy(token.data(), h.token.data(), token.size());
    } else if ((id == remote::kGather || id == remote::kWrite || id == remote::kPages) &&
               header_length == sizeof(remote::RowsRequest)) {
      remote::RowsRequest r;
      std::memcpy(&r, header, sizeof r);
      session = r.session_id;
      std::memcpy(token.data(), r.token.data(), token.size());
    } else {
      return false;
    }
    return session == c.session && SameToken(token, c.token);
  }

  // Whether a message to endpoint c, before its hello, is a hello of this protocol's version that
  // carries c's challenge (which only c's own peer was sent).
  static bool Challenged(const Connection& c, uint16_t id, const void* header, size_t header_length) {
    if (id != remote::kHello || header_length != sizeof(remote::Hello)) return false;
    remote::Hello h;
    std::memcpy(&h, header, sizeof h);
    Token challenge{};
    std::memcpy(challenge.data(), h.challenge.data(), challenge.size());
    return h.magic == remote::kMagic && h.version == remote::kVersion && SameToken(challenge, c.challenge);
  }

  static ucs_status_t OnMessage(void* arg, const void* header, size_t header_length, void* data, size_t length,
                                const ucp_am_recv_param_t* param) {
    auto* a = static_cast<HandlerArg*>(arg);
    Impl* self = a->impl;
    if (a->id == kUnservedId) {
      // Not this protocol's (a newer client's, or a probe's): nothing is taken from it and no
      // endpoint is judged by it (the endpoint UCX names may be another peer's). Counted, and
      // logged at the 1st, 2nd, 4th...
      if (self->DroppedAndLogged(&self->dropped_unserved)) {
        spdlog::warn("remote data plane: message of an id the daemon does not serve dropped ({} such so far)",
                     self->dropped_unserved);
      }
      return UCS_OK;
    }
    if (!(param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) || !self->connections.count(param->reply_ep)) {
      // No endpoint to answer on: nothing can be refused to anyone. Counted, and logged at the
      // 1st, 2nd, 4th... (a peer sending without UCP_AM_SEND_FLAG_REPLY does not flood the log).
      if (self->DroppedAndLogged(&self->dropped_unanswerable)) {
        spdlog::warn("remote data plane: message {} without a known endpoint dropped ({} such so far)", a->id,
                     self->dropped_unanswerable);
      }
      return UCS_OK;
    }
    Connection& c = self->connections.at(param->reply_ep);
    if (!c.misbehaved.empty()) {  // being closed: nothing more is taken from it
      if (self->DroppedAndLogged(&self->dropped_closing)) {
        spdlog::warn("remote data plane: message {} on an endpoint being closed ({}) dropped ({} such so far)", a->id,
                     c.misbehaved, self->dropped_closing);
      }
      return UCS_OK;
    }
    if (c.session == 0 && !Challenged(c, a->id, header, header_length)) {
      // Before its hello an endpoint takes only a hello with its challenge: any other message may
      // be another peer's (UCX names the endpoint from an id the sender wrote, as below), or a
      // client's older than the challenge. It changes nothing of the endpoint it names (no
      // refusal, no close: a refusal of a hello would reach that endpoint's own pending hello):
      // counted, and logged at the 1st, 2nd, 4th...
      if (self->DroppedAndLogged(&self->dropped_unchallenged)) {
        const bool old_hello = a->id == remote::kHello && header_length == kVersion2HelloBytes;
        spdlog::warn("remote data plane: message {} on an endpoint before its hello, not a hello of version {} with the "
                     "endpoint's challenge, dropped ({} such so far){}",
                     a->id, remote::kVersion, self->dropped_unchallenged,
                     old_hello ? "; this one is a hello of a client older than protocol version 3" : "");
      }
      return UCS_OK;
    }
    if (c.session != 0 && !Authentic(c, a->id, header, header_length)) {
      // UCX names the endpoint from an id the sender wrote: this message may be another peer's.
      // It changes nothing of the endpoint it names (no refusal, no close): counted, and logged at
      // the 1st, 2nd, 4th...
      if (self->DroppedAndLogged(&self->dropped_unauthentic)) {
        spdlog::warn("remote data plane: message {} naming the endpoint of session {} without that session's id and "
                     "token dropped ({} such so far)",
                     a->id, c.session, self->dropped_unauthentic);
      }
      return UCS_OK;
    }
    if (c.jobs_queued >= kMostQueued) {
      self->Misbehaved(&c, std::to_string(c.jobs_queued) + " requests queued unserved");
      ++self->dropped;
      return UCS_OK;
    }
    auto job = std::make_unique<Job>();
    job->id = a->id;
    job->ep = param->reply_ep;
    job->serial = c.serial;
    job->arrived = Clock::now();
    // The header is a hello's or a rows request's of the exact size (Challenged, Authentic): no
    // larger header is ever copied.
    const auto* h = static_cast<const uint8_t*>(header);
    job->header.assign(h, h + header_length);
    ++c.jobs_queued;
    job->refusal = self->Admit(&c, a->id, job->header, length, &job->request);
    if (!job->refusal.ok()) {  // answered by the loop; the payload is never received
      job->ready = true;
      self->jobs.push_back(std::move(job));
      return UCS_OK;
    }
    self->Hold(&c, length);
    job->held = length;
    job->due = job->arrived + kPayloadDeadline +
               std::chrono::milliseconds(self->total_held * 1000 / kSlowLinkBytesPerSecond);
    if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) {
      // A large payload (a prefill's rows): fetched into the job's buffer, then answered.
      job->payload.resize(length);
      ucp_request_param_t rp{};
      rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
      rp.cb.recv_am = &Impl::OnPayload;
      rp.user_data = job.get();
      ucs_status_ptr_t st = ucp_am_recv_data_nbx(self->worker, data, job->payload.data(), length, &rp);
      if (st == nullptr) {
        job->ready = true;
      } else if (UCS_PTR_IS_ERR(st)) {
        job->ready = job->failed = true;
      }
    } else {
      const auto* d = static_cast<const uint8_t*>(data);
      job->payload.assign(d, d + length);
      job->ready = true;
    }
    self->jobs.push_back(std::move(job));
    return UCS_OK;
  }

  // Whether a message's payload may be taken off the wire, from its header and length alone: the
  // hello carries none; a request (on an endpoint whose hello was accepted: OnMessage drops every
  // other message before it, and the client waits for its answer before any request) carries one
  // no larger than its header's rows make it (a gather's n tokens, a write's n rows of at most
  // kMaxRowBytes), within the endpoint's and the data plane's limits of bytes held. A rows
  // request's parsed header goes to *request.
  Status Admit(Connection* c, uint16_t id, const std::vector<uint8_t>& header, size_t length,
               remote::RowsRequest* request) {
    if (id == remote::kHello) {
      if (length != 0) return Status::InvalidArgument("a hello carries no payload (" + std::to_string(length) + " bytes came)");
      return Status::Ok();
    }
    SPECACHE_ASSIGN_OR_RETURN(*request, remote::ParseRowsRequest(header));
    const remote::RowsRequest& req = *request;
    const uint64_t most = id == remote::kGather  ? uint64_t{req.n} * sizeof(int32_t)
                          : id == remote::kWrite ? uint64_t{req.n} * remote::kMaxRowBytes
                                                 : 0;
    if (length > most) {
      return Status::InvalidArgument("a request of " + std::to_string(req.n) + " rows came with " + std::to_string(length) +
                                     " bytes of payload, more than its rows can be (" + std::to_string(most) + ")");
    }
    return Room(*c, length);
  }

  // The most bytes the endpoint may still hold within both limits.
  uint64_t RoomLeft(const Connection& c) const {
    return std::min(options.max_endpoint_bytes - std::min(options.max_endpoint_bytes, c.bytes_held),
                    options.max_held_bytes - std::min(options.max_held_bytes, total_held));
  }

  // Whether `bytes` more fit the endpoint's and the data plane's limits of bytes held.
  Status Room(const Connection& c, uint64_t bytes) const {
    if (c.bytes_held + bytes > options.max_endpoint_bytes) {
      return Status::ResourceExhausted("the endpoint holds " + std::to_string(c.bytes_held) +
                                       " bytes of requests not yet served and replies not yet taken; " +
                                       std::to_string(bytes) + " more would pass its limit of " +
                                       std::to_string(options.max_endpoint_bytes));
    }
    if (total_held + bytes > options.max_held_bytes) {
      return Status::ResourceExhausted("the data plane holds " + std::to_string(total_held) + " bytes for its " +
                                       std::to_string(connections.size()) + " endpoints; " + std::to_string(bytes) +
                                       " more would pass its limit of " + std::to_string(options.max_held_bytes));
    }
    return Status::Ok();
  }

  void Hold(Connection* c, uint64_t bytes) {
    c->bytes_held += bytes;
    total_held += bytes;
  }

  // The connection of (ep, serial), if it is still open.
  Connection* Find(ucp_ep_h ep, uint64_t serial) {
    auto it = ep ? connections.find(ep) : connections.end();
    return it != connections.end() && it->second.serial == serial ? &it->second : nullptr;
  }

  // Gives back what a job or a reply held (from the data plane's limit always; from its
  // endpoint's while it is open).
  void Release(ucp_ep_h ep, uint64_t serial, uint64_t bytes) {
    total_held -= std::min(bytes, total_held);
    if (Connection* c = Find(ep, serial)) c->bytes_held -= std::min(bytes, c->bytes_held);
  }

  // Endpoints that hold a slot: all but those being closed (Misbehaved; the sweep closes them).
  size_t CountedConnections() const {
    size_t n = 0;
    for (const auto& [ep, c] : connections) n += c.misbehaved.empty() ? 1 : 0;
    return n;
  }

  // Marks the endpoint that has waited longest for its hello to be closed; false when every
  // endpoint has a session (or its hello's answer is on its way).
  bool EvictOldestWithoutHello() {
    Connection* oldest = nullptr;
    for (auto& [ep, c] : connections) {
      const bool waiting = c.session == 0 && c.misbehaved.empty() && c.close_at == Clock::time_point();
      if (waiting && (!oldest || c.accepted < oldest->accepted)) oldest = &c;
    }
    if (!oldest) return false;
    Misbehaved(oldest, "no hello yet when the data plane was full: closed for a new connection");
    return true;
  }

  // A client that breaks the rules refusals cannot answer (too many requests queued or replies
  // not taken, a payload that never arrives): its endpoint is closed by the next sweep, logged
  // (1st, 2nd, 4th...) and counted as refused.
  // A message dropped for a reason counted in `kind` (one of the dropped_* counters): counted there
  // and in `dropped`; true at the kind's 1st, 2nd, 4th... (the caller logs it then, with *kind).
  bool DroppedAndLogged(uint64_t* kind) {
    ++dropped;
    return LoggedOccurrence(++*kind);
  }

  void Misbehaved(Connection* c, const std::string& why) {
    if (!c->misbehaved.empty()) return;
    c->misbehaved = why;
    c->failed = true;
    ++refused;
    const uint64_t n = ++misbehaving;
    if (LoggedOccurrence(n)) {
      spdlog::warn("remote data plane: endpoint of session {} closed: {} ({} such so far)", c->session, why, n);
    }
  }

  static void OnReplySent(void* request, ucs_status_t status, void* user_data) {
    auto* out = static_cast<Outgoing*>(user_data);
    Impl* self = out->impl;
    if (status != UCS_OK) self->Undelivered(*out, "delivered", status);
    if (Connection* c = self->Find(out->ep, out->serial)) {
      c->replies_in_flight -= c->replies_in_flight > 0 ? 1 : 0;
      c->replies_moved = Clock::now();
    }
    self->Release(out->ep, out->serial, out->payload.size());
    if (out->then) out->then();
    delete out;
    ucp_request_free(request);
  }

  static void OnPayload(void* request, ucs_status_t status, size_t, void* user_data) {
    auto* job = static_cast<Job*>(user_data);
    job->failed = status != UCS_OK;
    job->ready = true;
    ucp_request_free(request);
  }

  void Send(ucp_ep_h ep, uint64_t request_id, const Status& status, std::vector<uint8_t> payload,
            std::function<void()> then = nullptr) {
    auto it = connections.find(ep);
    if (it == connections.end()) return;  // closed meanwhile
    Connection* c = &it->second;
    if (c->replies_in_flight >= kMostQueued) {
      ++dropped;  // the reply to a request of a client that takes none
      return Misbehaved(c, std::to_string(c->replies_in_flight) + " replies not taken");
    }
    auto* out = new Outgoing;
    out->impl = this;
    out->ep = ep;
    out->serial = c->serial;
    out->then = std::move(then);
    out->header.request_id = request_id;
    out->header.code = static_cast<int32_t>(status.code());
    if (!status.ok()) {
      const std::string& m = status.message();
      out->payload.assign(m.begin(), m.end());
    } else {
      out->payload = std::move(payload);
    }
    Post(c, out);
  }

  // A reply that UCX did not send or deliver: counted in `dropped` and logged. A challenge (its
  // peer gone at once, as a port scanner's is) is counted apart and logged at the 1st, 2nd, 4th...
  void Undelivered(const Outgoing& out, const char* what, ucs_status_t status) {
    if (out.id == remote::kChallenge) {
      if (LoggedOccurrence(++challenges_undelivered)) {
        spdlog::info("remote data plane: the challenge to a new endpoint not {}: {} ({} such so far)", what,
                     ucs_status_string(status), challenges_undelivered);
      }
      return;
    }
    ++dropped;
    spdlog::warn("remote data plane: reply to request {} not {}: {}", out.header.request_id, what, ucs_status_string(status));
  }

  // Sends `out` on its endpoint c (its header by its id, then its payload); it is deleted once UCX
  // is done with it, and counts against c's limits while in flight.
  void Post(Connection* c, Outgoing* out) {
    ucp_request_param_t rp{};
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    rp.cb.send = &OnReplySent;
    rp.user_data = out;
    const bool challenge = out->id == remote::kChallenge;
    const void* header = challenge ? static_cast<const void*>(&out->challenge) : &out->header;
    const size_t header_bytes = challenge ? sizeof out->challenge : sizeof out->header;
    ucs_status_ptr_t st = ucp_am_send_nbx(c->ep, out->id, header, header_bytes, out->payload.data(), out->payload.size(), &rp);
    if (st == nullptr) {
      if (out->then) out->then();
      delete out;
    } else if (UCS_PTR_IS_ERR(st)) {
      Undelivered(*out, "sent", UCS_PTR_STATUS(st));
      if (out->then) out->then();
      delete out;
    } else {  // in flight until OnReplySent: it counts against the endpoint's limits
      Hold(c, out->payload.size());
      if (c->replies_in_flight++ == 0) c->replies_moved = Clock::now();
    }
  }

  // The challenges of the endpoints accepted since the last pass, each its endpoint's first message.
  void SendChallenges() {
    for (const auto& [ep, serial] : unchallenged) {
      Connection* c = Find(ep, serial);
      if (!c || c->failed) continue;  // closed, failed or being closed meanwhile (Misbehaved sets failed)
      auto* out = new Outgoing;
      out->impl = this;
      out->ep = ep;
      out->serial = serial;
      out->id = remote::kChallenge;
      std::memcpy(out->challenge.challenge.data(), c->challenge.data(), c->challenge.size());
      Post(c, out);
    }
    unchallenged.clear();
  }

  // The hello: binds the endpoint to its session.
  void Hello(Connection* c, const Job& job) {
    auto hello = remote::ParseHello(job.header);
    if (!hello.ok()) return RefuseAndClose(c, 0, hello.status());
    if (c->session != 0) return RefuseAndClose(c, 0, Status::FailedPrecondition("this endpoint already said hello"));
    Token token{};
    std::memcpy(token.data(), hello->token.data(), token.size());
    auto chunks = registry->AttachRemote(hello->session_id, token, options.rma);
    if (!chunks.ok()) return RefuseAndClose(c, 0, chunks.status());
    c->session = hello->session_id;
    c->token = token;
    std::vector<uint8_t> payload;
    if (options.rma) {
      auto keys = MapChunks(c, *chunks);
      if (!keys.ok()) {
        registry->Detach(c->session);
        return RefuseAndClose(c, 0, keys.status());
      }
      payload = std::move(*keys);
    }
    Send(c->ep, 0, Status::Ok(), std::move(payload));
  }

  // ucp_mem_map of the session's chunks; the reply payload: RemoteChunk[] then the packed keys.
  Result<std::vector<uint8_t>> MapChunks(Connection* c, const std::vector<uint32_t>& chunks) {
    std::vector<remote::RemoteChunk> table;
    std::vector<uint8_t> keys;
    for (uint32_t chunk : chunks) {
      ucp_mem_map_params_t mp{};
      mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
      mp.address = registry->chunk_data(chunk);
      mp.length = registry->chunk_bytes();
      ucp_mem_h memh = nullptr;
      if (ucs_status_t s = ucp_mem_map(context, &mp, &memh); s != UCS_OK) return Status::Unavailable(UcsError("ucp_mem_map", s));
      c->memh.push_back(memh);
      void* packed = nullptr;
      size_t packed_bytes = 0;
      if (ucs_status_t s = ucp_rkey_pack(context, memh, &packed, &packed_bytes); s != UCS_OK) {
        return Status::Unavailable(UcsError("ucp_rkey_pack", s));
      }
      table.push_back({reinterpret_cast<uint64_t>(mp.address), registry->chunk_bytes(), static_cast<uint32_t>(packed_bytes), 0});
      keys.insert(keys.end(), static_cast<uint8_t*>(packed), static_cast<uint8_t*>(packed) + packed_bytes);
      ucp_rkey_buffer_release(packed);
    }
    std::vector<uint8_t> out(table.size() * sizeof(remote::RemoteChunk));
    std::memcpy(out.data(), table.data(), out.size());
    out.insert(out.end(), keys.begin(), keys.end());
    return out;
  }

  void RefuseAndClose(Connection* c, uint64_t request_id, const Status& why) {
    Refused(why);
    if (c->session != 0) return Send(c->ep, request_id, why, {});
    // An endpoint that failed its hello is not kept. It is closed by the sweep once the refusal
    // has left (a forced close now would drop it), or after the lease if the send never completes.
    if (c->close_at == Clock::time_point()) c->close_at = Clock::now() + std::chrono::milliseconds(options.lease_ms);
    ucp_ep_h ep = c->ep;
    const uint64_t serial = c->serial;
    Send(ep, request_id, why, {}, [this, ep, serial] {
      if (Connection* mine = Find(ep, serial)) mine->close_at = Clock::now() + std::chrono::milliseconds(50);
    });
  }

  void Serve(Job* job) {
    auto it = connections.find(job->ep);
    if (it == connections.end()) return;  // closed meanwhile
    Connection* c = &it->second;
    ++requests;
    const uint64_t request_id = job->id == remote::kHello ? 0 : RequestIdOf(job->header);
    if (!job->refusal.ok() || job->failed) {  // answered to the request's id when its header has one
      return RefuseAndClose(c, request_id, job->failed ? Status::Unavailable("the request's payload did not arrive")
                                                       : job->refusal);
    }
    if (job->id == remote::kHello) return Hello(c, *job);
    // Admitted: its header parsed, its endpoint's hello accepted (sessions are never unset).
    const remote::RowsRequest* req = &job->request;
    Status done;
    std::vector<uint8_t> payload;
    if (job->id == remote::kGather) {
      if (job->payload.size() != size_t{req->n} * sizeof(int32_t)) {
        done = Status::InvalidArgument("gather of " + std::to_string(req->n) + " rows with " +
                                       std::to_string(job->payload.size()) + " bytes of row list");
      } else {
        std::vector<int32_t> tokens(req->n);
        std::memcpy(tokens.data(), job->payload.data(), job->payload.size());
        // The reply's room is checked before its rows are copied (as the request's bytes were).
        auto rows = registry->ReadRows(c->session, c->token, req->sequence, req->layer, req->kv_head, tokens, RoomLeft(*c));
        done = rows.status();
        if (rows.ok()) payload = std::move(*rows);
      }
    } else if (job->id == remote::kWrite) {
      done = registry->WriteRows(c->session, c->token, req->sequence, req->layer, req->kv_head, req->first_token, req->n,
                                 job->payload);
    } else {  // kPages
      auto refs = registry->PageRefs(c->session, c->token, req->sequence, req->layer);
      done = refs.status();
      // Within the endpoint's and the data plane's room, as a gather's rows are (a layer's page
      // list reaches 16 MiB at a session's most page references).
      const uint64_t bytes = refs.ok() ? refs->size() * sizeof(shm::PageRef) : 0;
      if (done.ok() && bytes > RoomLeft(*c)) {
        done = Status::ResourceExhausted("a page list of " + std::to_string(bytes) + " bytes: the endpoint may hold " +
                                         std::to_string(RoomLeft(*c)) + " more bytes now (take the replies in flight first)");
      }
      if (done.ok()) {
        payload.resize(bytes);
        std::memcpy(payload.data(), refs->data(), payload.size());
      }
    }
    if (!done.ok()) Refused(done);
    Send(c->ep, req->request_id, done, std::move(payload));
  }

  void CloseConnection(Connection* c, bool detach) {
    // The endpoint first (software RMA serves gets through it), then the registrations: the
    // session's keys are stale from here, and its chunks may go back.
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = UCP_EP_CLOSE_FLAG_FORCE;
    ucs_status_ptr_t st = ucp_ep_close_nbx(c->ep, &p);
    if (st != nullptr && !UCS_PTR_IS_ERR(st)) ucp_request_free(st);  // completes in later progress
    for (ucp_mem_h m : c->memh) ucp_mem_unmap(context, m);
    c->memh.clear();
    if (c->session != 0) registry->RemoteKeysUnmapped(c->session);
    if (detach && c->session != 0) registry->Detach(c->session);
  }

  // Endpoints that failed, were refused at the hello (after their reply had time to leave), sent
  // no hello within the lease, or whose session ended elsewhere.
  void Sweep() {
    const auto now = Clock::now();
    for (auto it = connections.begin(); it != connections.end();) {
      Connection& c = it->second;
      std::string why;
      if (c.misbehaved.empty() && c.replies_in_flight > 0 && now - c.replies_moved > kReplyDeadline) {
        Misbehaved(&c, std::to_string(c.replies_in_flight) + " replies not taken for 30 s");
      }
      if (!c.misbehaved.empty()) {
        why = c.misbehaved;
      } else if (c.failed) {
        why = "the endpoint failed";
      } else if (c.close_at != Clock::time_point() && now >= c.close_at) {
        why = "refused at the hello";
      } else if (c.session == 0 && now - c.accepted > std::chrono::milliseconds(options.lease_ms)) {
        why = "no hello within the lease";
      } else if (c.session != 0 && !registry->SessionLive(c.session)) {
        why = "its session ended";
      }
      if (why.empty()) {
        ++it;
        continue;
      }
      uint64_t unanswered = 0;
      for (auto& job : jobs) {  // nobody is left to answer
        if (job->ep != c.ep) continue;
        job->ep = nullptr;
        ++unanswered;
      }
      if (unanswered > 0) {
        dropped += unanswered;
        spdlog::warn("remote data plane: endpoint of session {} closed ({}) with {} requests unserved: dropped", c.session,
                     why, unanswered);
      } else {
        spdlog::info("remote data plane: endpoint of session {} closed: {}", c.session, why);
      }
      CloseConnection(&c, /*detach=*/true);
      it = connections.erase(it);
      --open;
    }
  }

  // Serves every job whose payload arrived, in order per endpoint: a job waits only for the
  // earlier jobs of its own endpoint (a rendezvous payload still on its way holds no other
  // client's requests). True when it served any.
  bool ServeReady() {
    bool served = false;
    const auto now = Clock::now();
    std::set<ucp_ep_h> waiting;  // endpoints with an earlier job whose payload is on its way
    for (auto it = jobs.begin(); it != jobs.end();) {
      Job* job = it->get();
      // A job of a closed endpoint (ep null) waits for nothing and holds up nothing: it goes once
      // its payload is done with (UCX fails the receive when the endpoint closes).
      if (!job->ready || (job->ep && waiting.count(job->ep))) {
        if (!job->ready && job->ep && now > job->due) {
          if (Connection* c = Find(job->ep, job->serial)) Misbehaved(c, "a request's payload did not arrive in time");
        }
        if (job->ep) waiting.insert(job->ep);
        ++it;
        continue;
      }
      std::unique_ptr<Job> taken = std::move(*it);
      it = jobs.erase(it);
      if (Connection* c = Find(taken->ep, taken->serial)) {
        --c->jobs_queued;
        Serve(taken.get());
      }
      Release(taken->ep, taken->serial, taken->held);
      served = true;
    }
    return served;
  }

  void Run() {
    auto last_sweep = Clock::now(), last_work = Clock::now();
    while (!stop.load()) {
      // A bounded number of progress calls a pass: a flood of messages does not keep the loop from
      // serving (each message queues at most a job).
      for (int i = 0; i < 256 && ucp_worker_progress(worker) != 0; ++i) last_work = Clock::now();
      SendChallenges();
      if (ServeReady()) last_work = Clock::now();
      if (Clock::now() - last_sweep > std::chrono::milliseconds(20)) {
        Sweep();
        last_sweep = Clock::now();
      }
      // Busy for 50 us after the last message: the next request of a decode step is usually on
      // its way. Then sleep until UCX signals, at most 1 ms while traffic is recent (not every
      // transport signals the event fd: shared memory does not) and 20 ms when idle for a second
      // (for the sweep and the stop flag).
      const auto quiet = Clock::now() - last_work;
      if (quiet < std::chrono::microseconds(50)) continue;
      if (ucp_worker_arm(worker) == UCS_OK) {
        pollfd p{efd, POLLIN, 0};
        // A payload on its way (jobs queued) counts as recent traffic.
        poll(&p, 1, quiet < std::chrono::seconds(1) || !jobs.empty() ? 1 : 20);
      }
    }
  }
};

UcxServer::UcxServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
UcxServer::~UcxServer() = default;

Result<std::unique_ptr<UcxServer>> UcxServer::Start(Registry* registry, const UcxServerOptions& options) {
  auto impl = std::make_unique<Impl>();
  impl->registry = registry;
  impl->options = options;
  SPECACHE_RETURN_IF_ERROR(impl->Init());
  Impl* raw = impl.get();
  raw->thread = std::thread([raw] { raw->Run(); });
  return std::unique_ptr<UcxServer>(new UcxServer(std::move(impl)));
}

uint16_t UcxServer::port() const { return impl_->port; }
const std::string& UcxServer::transports() const { return impl_->transports; }

UcxServerStats UcxServer::stats() const {
  return {impl_->open.load(), impl_->requests.load(), impl_->refused.load(), impl_->dropped.load()};
}

}  // namespace specache::daemon
