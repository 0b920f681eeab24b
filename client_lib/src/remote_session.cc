#include "specache/remote_session.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>
#include <numeric>

#include "client_impl.h"
#include "session_calls.h"
#include "specache/remote_protocol.h"
#include "specache/shm_layout.h"
#include "ucx_endpoint.h"

namespace specache::client {
namespace {

using Clock = std::chrono::steady_clock;

// The daemon names its listener by the address it bound; a wildcard host means "the host you
// reached me on".
Result<std::string> DataAddress(const std::string& advertised, const std::string& control_address) {
  SPECACHE_ASSIGN_OR_RETURN(auto data, remote::SplitHostPort(advertised));
  std::string host = data.first;
  if (host.empty() || host == "0.0.0.0" || host == "::") {
    SPECACHE_ASSIGN_OR_RETURN(auto control, remote::SplitHostPort(control_address));
    host = control.first;
  }
  if (host.find(':') != std::string::npos) host = "[" + host + "]";
  return host + ":" + std::to_string(data.second);
}

}  // namespace

const char* FetchMethodName(FetchMethod method) { return method == FetchMethod::kServerGather ? "gather" : "gets"; }

Result<FetchMethod> ParseFetchMethod(const std::string& name) {
  if (name == "gather") return FetchMethod::kServerGather;
  if (name == "gets") return FetchMethod::kClientGets;
  return Status::InvalidArgument("fetch method is gather or gets, not '" + name + "'");
}

struct RemoteSession::Impl {
  SessionCalls calls;
  RemoteSessionOptions options;
  std::string data_address;
  std::unique_ptr<UcxEndpoint> endpoint;
  mutable std::mutex mu;
  std::map<uint64_t, PageLayoutSpec> layouts;
  // kClientGets: where each (sequence, layer)'s pages are, and the staging buffer, both under
  // gets_mu (one gets fetch at a time: they share the staging buffer).
  std::mutex gets_mu;
  std::map<std::pair<uint64_t, uint32_t>, std::vector<shm::PageRef>> page_refs;
  std::vector<uint8_t> staging;
  std::atomic<uint64_t> requests{0}, rows_read{0}, rows_written{0};

  ~Impl() {
    // Best effort: when it fails, the daemon ends the session as the endpoint closes below.
    calls.Close();
    endpoint.reset();
  }

  Deadline NextDeadline() const { return Clock::now() + options.deadline; }

  Result<PageLayoutSpec> LayoutOf(uint64_t sequence) const {
    std::lock_guard<std::mutex> lock(mu);
    auto it = layouts.find(sequence);
    if (it == layouts.end()) return Status::NotFound("sequence " + std::to_string(sequence) + " is not in this session");
    return it->second;
  }

  // A request's header, with the session's id and token as its hello had them (the daemon serves
  // no request without them).
  remote::RowsRequest Header(uint64_t sequence, uint32_t layer, uint32_t kv_head, uint32_t n) const {
    remote::RowsRequest r;
    r.session_id = calls.id();
    std::memcpy(r.token.data(), calls.token().data(), r.token.size());  // its size checked at OpenSession
    r.sequence = sequence;
    r.layer = layer;
    r.kv_head = kv_head;
    r.n = n;
    return r;
  }

  Status Gather(uint64_t sequence, uint32_t layer, uint32_t kv_head, std::span<const int32_t> tokens, void* out,
                uint64_t row_bytes) {
    SPECACHE_ASSIGN_OR_RETURN(uint64_t read, StartGather(sequence, layer, kv_head, tokens, out, row_bytes));
    return endpoint->Wait(read, NextDeadline());
  }

  Result<uint64_t> StartGather(uint64_t sequence, uint32_t layer, uint32_t kv_head, std::span<const int32_t> tokens,
                               void* out, uint64_t row_bytes) {
    if (tokens.size() > remote::kMaxRowsPerRequest) return Status::InvalidArgument("too many rows in one read");
    const remote::RowsRequest h = Header(sequence, layer, kv_head, static_cast<uint32_t>(tokens.size()));
    ++requests;
    rows_read += tokens.size();
    return endpoint->Start(remote::kGather, &h, sizeof h, tokens.data(), tokens.size_bytes(), out,
                           tokens.size() * row_bytes);
  }

  Result<const std::vector<shm::PageRef>*> PagesOf(uint64_t sequence, uint32_t layer, uint32_t pages_needed) {
    auto& refs = page_refs[{sequence, layer}];
    if (refs.size() >= pages_needed) return &refs;
    const remote::RowsRequest h = Header(sequence, layer, 0, 0);
    std::vector<uint8_t> reply;
    ++requests;
    SPECACHE_RETURN_IF_ERROR(endpoint->Call(remote::kPages, &h, sizeof h, nullptr, 0, &reply,
                                            size_t{1 << 20} * sizeof(shm::PageRef), NextDeadline()));
    if (reply.size() % sizeof(shm::PageRef) != 0) return Status::DataLoss("page list of a bad size");
    refs.resize(reply.size() / sizeof(shm::PageRef));
    std::memcpy(refs.data(), reply.data(), reply.size());
    if (refs.size() < pages_needed) return Status::OutOfRange("rows beyond the sequence's pages");
    return &refs;
  }

  // Client-side gets: consecutive rows of one page are one get.
  Status Gets(uint64_t sequence, uint32_t layer, uint32_t kv_head, std::span<const int32_t> tokens, void* out,
              const PageLayoutSpec& l) {
    const uint64_t row_bytes = l.row_bytes();
    if (layer >= l.n_layers || kv_head >= l.n_kv_heads) {  // as the daemon's gather refuses them
      return Status::OutOfRange("layer " + std::to_string(layer) + " / KV head " + std::to_string(kv_head) +
                                " outside the sequence's layout (" + std::to_string(l.n_layers) + " layers, " +
                                std::to_string(l.n_kv_heads) + " KV heads)");
    }
    std::lock_guard<std::mutex> lock(gets_mu);
    if (endpoint->remote_chunks() == 0) {
      return Status::FailedPrecondition("client-side gets need remote keys: the daemon hands them out only with "
                                        "[remote] rma = true, and the session must be opened with method gets");
    }
    std::vector<uint32_t> order(tokens.size());
    std::iota(order.begin(), order.end(), 0u);
    std::sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) { return tokens[a] < tokens[b]; });
    if (tokens.empty()) return Status::Ok();
    if (tokens[order.front()] < 0) return Status::OutOfRange("row " + std::to_string(tokens[order.front()]));
    const uint32_t max_page = static_cast<uint32_t>(tokens[order.back()]) / l.page_tokens;
    SPECACHE_ASSIGN_OR_RETURN(const std::vector<shm::PageRef>* refs, PagesOf(sequence, layer, max_page + 1));
    if (staging.size() < tokens.size() * row_bytes) {
      staging.resize(tokens.size() * row_bytes);
      SPECACHE_RETURN_IF_ERROR(endpoint->RegisterStaging(staging.data(), staging.size()));
    }
    ++requests;
    for (size_t i = 0; i < order.size();) {
      const int32_t first = tokens[order[i]];
      const uint32_t page = static_cast<uint32_t>(first) / l.page_tokens;
      size_t j = i + 1;  // the run: the next sorted tokens, consecutive and in the same page
      while (j < order.size() && tokens[order[j]] == first + static_cast<int32_t>(j - i) &&
             static_cast<uint32_t>(tokens[order[j]]) / l.page_tokens == page) {
        ++j;
      }
      const shm::PageRef& ref = (*refs)[page];
      const uint32_t in_page = static_cast<uint32_t>(first) % l.page_tokens;
      const uint64_t offset = ref.offset + shm::RowOffsetInPage(l.row_format, kv_head, in_page, l.page_tokens, l.head_dim);
      const Status got = endpoint->Get(ref.chunk, offset, staging.data() + i * row_bytes, (j - i) * row_bytes);
      if (!got.ok()) {
        // The gets already issued write into staging: done with before it may be reused or grown.
        (void)endpoint->WaitGets(NextDeadline());
        return got;
      }
      i = j;
    }
    SPECACHE_RETURN_IF_ERROR(endpoint->WaitGets(NextDeadline()));
    for (size_t i = 0; i < order.size(); ++i) {
      std::memcpy(static_cast<uint8_t*>(out) + order[i] * row_bytes, staging.data() + i * row_bytes, row_bytes);
    }
    rows_read += tokens.size();
    return Status::Ok();
  }
};

RemoteSession::RemoteSession(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
RemoteSession::~RemoteSession() = default;

Result<std::unique_ptr<RemoteSession>> RemoteSession::Open(Client* client, const std::string& tenant,
                                                           uint64_t pool_bytes, const RemoteSessionOptions& options) {
  if (!client->remote()) return Status::FailedPrecondition("a remote session needs a client connected to tcp://HOST:PORT");
  auto s = std::make_unique<Impl>();
  s->options = options;
  v1::OpenSessionRequest req;
  req.set_tenant(tenant);
  req.set_pool_bytes(pool_bytes);
  req.set_client_name(client->impl_->options.client_name);
  v1::OpenSessionResponse resp;
  SPECACHE_RETURN_IF_ERROR(client->impl_->Call(&v1::Control::Stub::OpenSession, "OpenSession", req, &resp));
  s->calls = SessionCalls(client->impl_, resp.session_id(), resp.token());
  if (resp.data_address().empty() || s->calls.token().size() != attach::kTokenBytes) {
    return Status::DataLoss("OpenSession on the remote port gave no data-plane address or a bad token");
  }
  SPECACHE_ASSIGN_OR_RETURN(s->data_address, DataAddress(resp.data_address(), client->impl_->remote_address));
  const bool gets = options.method == FetchMethod::kClientGets;
  SPECACHE_ASSIGN_OR_RETURN(s->endpoint, UcxEndpoint::Connect(s->data_address, gets));
  remote::Hello hello;
  hello.session_id = s->calls.id();
  std::memcpy(hello.token.data(), s->calls.token().data(), hello.token.size());
  std::vector<uint8_t> keys;
  Status said = s->endpoint->Call(remote::kHello, &hello, sizeof hello, nullptr, 0, &keys, size_t{16} << 20,
                                  s->NextDeadline());
  if (!said.ok()) return said.WithContext("attaching over UCX to " + s->data_address);
  if (gets) SPECACHE_RETURN_IF_ERROR(s->endpoint->SetRemoteChunks(keys));
  return std::unique_ptr<RemoteSession>(new RemoteSession(std::move(s)));
}

uint64_t RemoteSession::id() const { return impl_->calls.id(); }
const RemoteSessionOptions& RemoteSession::options() const { return impl_->options; }
std::string RemoteSession::data_address() const { return impl_->data_address; }
bool RemoteSession::Alive() const { return !impl_->endpoint->failed(); }

RemoteStats RemoteSession::stats() const {
  return {impl_->requests.load(), impl_->endpoint->gets_issued(), impl_->rows_read.load(), impl_->rows_written.load()};
}

Result<uint64_t> RemoteSession::CreateSequence(const PageLayoutSpec& l) {
  SPECACHE_ASSIGN_OR_RETURN(v1::CreateSequenceResponse resp, impl_->calls.CreateSequence(l));
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->layouts[resp.sequence_id()] = l;
  return resp.sequence_id();
}

Result<uint32_t> RemoteSession::Extend(uint64_t sequence, uint32_t tokens) {
  SPECACHE_RETURN_IF_ERROR(impl_->LayoutOf(sequence).status());
  return impl_->calls.ExtendSequence(sequence, tokens);
}

Status RemoteSession::Release(uint64_t sequence) {
  SPECACHE_RETURN_IF_ERROR(impl_->LayoutOf(sequence).status());
  SPECACHE_RETURN_IF_ERROR(impl_->calls.ReleaseSequence(sequence));
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->layouts.erase(sequence);
  }
  std::lock_guard<std::mutex> lock(impl_->gets_mu);  // page_refs' lock (a gets fetch may be reading it)
  for (auto it = impl_->page_refs.begin(); it != impl_->page_refs.end();) {
    it = it->first.first == sequence ? impl_->page_refs.erase(it) : std::next(it);
  }
  return Status::Ok();
}

Status RemoteSession::Keep(uint64_t sequence) {
  SPECACHE_RETURN_IF_ERROR(impl_->LayoutOf(sequence).status());
  return impl_->calls.KeepSequence(sequence);
}

Status RemoteSession::WriteRows(uint64_t sequence, uint32_t layer, uint32_t kv_head, uint32_t first_token,
                                const void* rows, size_t bytes) {
  SPECACHE_ASSIGN_OR_RETURN(PageLayoutSpec l, impl_->LayoutOf(sequence));
  const uint64_t row_bytes = l.row_bytes();
  if (bytes % row_bytes != 0) return Status::InvalidArgument("rows must be whole rows of " + std::to_string(row_bytes) + " bytes");
  if (bytes / row_bytes > remote::kMaxRowsPerRequest) {
    return Status::InvalidArgument("a write of " + std::to_string(bytes / row_bytes) + " rows: at most " +
                                   std::to_string(remote::kMaxRowsPerRequest) + " in one request");
  }
  remote::RowsRequest h = impl_->Header(sequence, layer, kv_head, static_cast<uint32_t>(bytes / row_bytes));
  h.first_token = first_token;
  ++impl_->requests;
  impl_->rows_written += bytes / row_bytes;
  return impl_->endpoint->Call(remote::kWrite, &h, sizeof h, rows, bytes, nullptr, 0, impl_->NextDeadline());
}

Status RemoteSession::ReadRows(uint64_t sequence, uint32_t layer, uint32_t kv_head, std::span<const int32_t> tokens,
                               void* out) {
  return ReadRows(sequence, layer, kv_head, tokens, out, impl_->options.method);
}

Status RemoteSession::ReadRows(uint64_t sequence, uint32_t layer, uint32_t kv_head, std::span<const int32_t> tokens,
                               void* out, FetchMethod method) {
  SPECACHE_ASSIGN_OR_RETURN(PageLayoutSpec l, impl_->LayoutOf(sequence));
  if (method == FetchMethod::kClientGets) return impl_->Gets(sequence, layer, kv_head, tokens, out, l);
  return impl_->Gather(sequence, layer, kv_head, tokens, out, l.row_bytes());
}

Result<uint64_t> RemoteSession::StartRead(uint64_t sequence, uint32_t layer, uint32_t kv_head,
                                          std::span<const int32_t> tokens, void* out) {
  SPECACHE_ASSIGN_OR_RETURN(PageLayoutSpec l, impl_->LayoutOf(sequence));
  return impl_->StartGather(sequence, layer, kv_head, tokens, out, l.row_bytes());
}

Status RemoteSession::WaitRead(uint64_t read) { return impl_->endpoint->Wait(read, impl_->NextDeadline()); }

}  // namespace specache::client
