// KvMemory in the pages of a specached on another host (--daemon tcp://HOST:PORT): rows over
// UCX, control over TLS. Credentials and settings come from the environment, so the engine's
// command line stays the same as for a local daemon:
//   SPECACHE_TLS_CA, SPECACHE_TLS_CERT, SPECACHE_TLS_KEY, SPECACHE_TLS_SERVER_NAME (TLS),
//   SPECACHE_TENANT, SPECACHE_SECRET_FILE (the tenant and its remote secret),
//   SPECACHE_FETCH_METHOD (gather, the default, or gets), SPECACHE_REMOTE_DEADLINE_MS (2000).
#include <cstdlib>

#include "kv_memory.h"
#include "specache/client.h"
#include "specache/remote_session.h"
#include "specache/remote_source.h"

namespace specache::run {
namespace {

class RemoteMemory final : public KvMemory {
 public:
  ~RemoteMemory() override {
    session_.reset();
    client_.reset();
  }

  static Result<std::unique_ptr<KvMemory>> Open(const KvMemoryOptions& o) {
    auto m = std::make_unique<RemoteMemory>();
    m->options_ = o;
    client::RemoteSessionOptions so;
    if (const char* method = std::getenv("SPECACHE_FETCH_METHOD")) {
      SPECACHE_ASSIGN_OR_RETURN(so.method, client::ParseFetchMethod(method));
    }
    if (const char* ms = std::getenv("SPECACHE_REMOTE_DEADLINE_MS")) {
      const long v = std::strtol(ms, nullptr, 10);
      if (v <= 0) return Status::InvalidArgument("SPECACHE_REMOTE_DEADLINE_MS must be a positive number of ms");
      so.deadline = std::chrono::milliseconds(v);
    }
    const client::RemoteCredentials credentials = client::RemoteCredentials::FromEnvironment();
    SPECACHE_ASSIGN_OR_RETURN(m->client_, client::Client::Connect({o.socket, so.deadline, "specache-run"}, credentials));
    const std::string tenant = credentials.tenant.empty() ? o.tenant : credentials.tenant;
    SPECACHE_ASSIGN_OR_RETURN(m->session_, client::RemoteSession::Open(m->client_.get(), tenant, o.session_bytes, so));
    return std::unique_ptr<KvMemory>(std::move(m));
  }

  Result<std::unique_ptr<FullPrecisionSource>> NewSource() override {
    return std::unique_ptr<FullPrecisionSource>(
        std::make_unique<client::RemoteSource>(session_.get(), options_.page_tokens, options_.capacity_tokens));
  }

  Result<uint64_t> KeepSequence(FullPrecisionSource* source, SequenceId id) override {
    return static_cast<client::RemoteSource*>(source)->Keep(id);
  }

  nlohmann::json Figures() const override {
    const client::RemoteStats s = session_->stats();
    return {{"kv_memory", "remote daemon"},
            {"daemon", options_.socket},
            {"data_address", session_->data_address()},
            {"fetch_method", client::FetchMethodName(session_->options().method)},
            {"remote_requests", s.requests},
            {"remote_gets", s.gets},
            {"rows_read", s.rows_read},
            {"rows_written", s.rows_written},
            {"page_tokens", options_.page_tokens}};
  }

 private:
  KvMemoryOptions options_;
  std::unique_ptr<client::Client> client_;
  std::unique_ptr<client::RemoteSession> session_;
};

}  // namespace

Result<std::unique_ptr<KvMemory>> MakeRemoteMemory(const KvMemoryOptions& options) { return RemoteMemory::Open(options); }

}  // namespace specache::run
