// KvMemory in specached pages: an existing daemon (--daemon SOCKET) or one embedded here.
#include <unistd.h>

#include <filesystem>


#include "daemon.h"
#include "kv_memory.h"
#include "specache/client.h"
#include "specache/daemon_source.h"

namespace specache::run {

std::unique_ptr<KvMemory> MakeProcessMemory();
Result<std::unique_ptr<KvMemory>> MakeRemoteMemory(const KvMemoryOptions& options);  // kv_memory_remote.cc

namespace {

class DaemonMemory final : public KvMemory {
 public:
  ~DaemonMemory() override {
    session_.reset();  // release everything before the embedded daemon stops
    client_.reset();
    if (embedded_) embedded_->Stop();
    if (!dir_.empty()) std::filesystem::remove_all(dir_);
  }

  static Result<std::unique_ptr<KvMemory>> Open(const KvMemoryOptions& o) {
    auto m = std::make_unique<DaemonMemory>();
    m->options_ = o;
    std::string socket = o.socket;
    if (o.where == "embedded") {
      char tmpl[] = "/tmp/specache-run-XXXXXX";
      if (!mkdtemp(tmpl)) return Status::Internal("mkdtemp failed");
      m->dir_ = tmpl;
      daemon::DaemonConfig c;
      c.socket = m->dir_ + "/control.sock";
      c.chunk_bytes = uint64_t{16} << 20;
      c.pool_bytes = (o.session_bytes + c.chunk_bytes - 1) / c.chunk_bytes * c.chunk_bytes;
      c.metrics_addr = "";
      c.lock_memory = false;  // a user's shell rarely has a large RLIMIT_MEMLOCK
      c.prefault_threads = 2;
      c.tenants["default"] = daemon::TenantConfig{c.pool_bytes, {}, {}, {}};
      daemon::LogEmbeddedDaemonToStderr();
      m->embedded_ = std::make_unique<daemon::Daemon>();
      SPECACHE_RETURN_IF_ERROR(m->embedded_->Start(c).WithContext("embedded specached"));
      socket = c.socket;
    }
    m->socket_ = socket;
    SPECACHE_ASSIGN_OR_RETURN(m->client_,
                              client::Client::Connect({socket, std::chrono::milliseconds(5000), "specache-run"}));
    SPECACHE_ASSIGN_OR_RETURN(m->session_, m->client_->OpenSession(o.tenant, o.session_bytes));
    return std::unique_ptr<KvMemory>(std::move(m));
  }

  Result<std::unique_ptr<FullPrecisionSource>> NewSource() override {
    return std::unique_ptr<FullPrecisionSource>(
        std::make_unique<client::DaemonSource>(session_.get(), options_.page_tokens, options_.capacity_tokens));
  }

  Result<uint64_t> KeepSequence(FullPrecisionSource* source, SequenceId id) override {
    if (embedded_) {
      return Status::FailedPrecondition("--keep-sequence needs a running specached (--daemon SOCKET): the embedded one "
                                        "ends with this process");
    }
    return static_cast<client::DaemonSource*>(source)->Keep(id);
  }

  nlohmann::json Figures() const override {
    nlohmann::json j{{"kv_memory", embedded_ ? "embedded daemon" : "daemon"},
                     {"socket", socket_},
                     {"extend_rpcs", session_->extend_rpcs()},
                     {"page_tokens", options_.page_tokens}};
    if (auto s = client_->Stats(); s.ok()) {
      j["daemon_pool_bytes"] = s->pool_bytes;
      j["daemon_used_bytes"] = s->used_bytes;
      j["daemon_requests"] = s->requests;
    }
    return j;
  }

 private:
  KvMemoryOptions options_;
  std::string dir_, socket_;
  std::unique_ptr<daemon::Daemon> embedded_;
  std::unique_ptr<client::Client> client_;
  std::unique_ptr<client::Session> session_;
};

}  // namespace

Result<std::unique_ptr<KvMemory>> KvMemory::Open(const KvMemoryOptions& o) {
  if (o.where == "process") return MakeProcessMemory();
  if (o.where == "daemon" && o.socket.empty()) return Status::InvalidArgument("--daemon needs a socket path");
  if (o.where == "daemon" && o.socket.rfind("tcp://", 0) == 0) return MakeRemoteMemory(o);
  if (o.where != "daemon" && o.where != "embedded") {
    return Status::InvalidArgument("--kv-memory is embedded, daemon or process, not '" + o.where + "'");
  }
  return DaemonMemory::Open(o);
}

}  // namespace specache::run
