#include "daemon.h"

#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <functional>

#include <grpcpp/grpcpp.h>
#include <spdlog/pattern_formatter.h>
#include <spdlog/sinks/stdout_sinks.h>
#include <spdlog/spdlog.h>

#include "attach_server.h"
#include "control_service.h"
#include "metrics.h"
#include "specache/spill_store.h"

namespace specache::daemon {

struct Daemon::State {
  DaemonConfig config;
  std::unique_ptr<ChunkPool> pool;
  std::unique_ptr<KeptSequences> kept;
  std::unique_ptr<Registry> registry;
  std::unique_ptr<ControlService> service;
  std::unique_ptr<grpc::Server> server;
  boost::asio::io_context io;
  std::unique_ptr<AttachServer> attach;
  std::thread io_thread, housekeeping;
  std::unique_ptr<Metrics> metrics;
  std::atomic<bool> stopping{false};
};

namespace {

using State = Daemon::State;
Status ReservePool(State* d) {
  ChunkPoolOptions o{d->config.pool_bytes, d->config.chunk_bytes, d->config.prefault_threads, d->config.lock_memory};
  const auto start = std::chrono::steady_clock::now();
  SPECACHE_ASSIGN_OR_RETURN(d->pool, ChunkPool::Create(o));
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  spdlog::info("pool: {} chunks of {} MiB reserved in {:.0f} ms ({})", d->pool->chunk_count(),
               d->pool->chunk_bytes() >> 20, ms, d->pool->locked() ? "locked in RAM" : "NOT locked: raise LimitMEMLOCK");
  return Status::Ok();
}

Status OpenSpillTier(State* d) {
  std::unique_ptr<SpillStore> store;
  const SpillConfig& c = d->config.spill;
  if (!c.dir.empty()) {
    SPECACHE_ASSIGN_OR_RETURN(store, SpillStore::Open({c.dir, c.max_bytes, c.compression}));
    spdlog::info("spill tier: {} ({} sequences on disk, limit {})", c.dir, store->List().size(),
                 c.max_bytes ? std::to_string(c.max_bytes >> 20) + " MiB" : std::string("the disk"));
  }
  d->kept = std::make_unique<KeptSequences>(
      KeptOptions{d->config.ParkBytes(), c.high_watermark, c.low_watermark, c.write_through}, std::move(store));
  d->registry = std::make_unique<Registry>(d->config, d->pool.get(), d->kept.get());
  return Status::Ok();
}

Status ListenControl(State* d) {
  std::filesystem::create_directories(std::filesystem::path(d->config.socket).parent_path());
  ::unlink(d->config.socket.c_str());
  d->service = std::make_unique<ControlService>(d->registry.get(), d->kept.get(), d->config.AttachSocket(),
                                               d->config.lease_ms);
  grpc::ServerBuilder builder;
  builder.AddListeningPort("unix:" + d->config.socket, grpc::InsecureServerCredentials());
  builder.RegisterService(d->service.get());
  builder.SetMaxReceiveMessageSize(64 << 10);  // every request is small; refuse anything larger
  d->server = builder.BuildAndStart();
  if (!d->server) return Status::Unavailable("cannot listen on unix:" + d->config.socket);
  ::chmod(d->config.socket.c_str(), 0666);
  return Status::Ok();
}

Status ListenAttach(State* d) {
  d->attach = std::make_unique<AttachServer>(d->io, d->registry.get(), d->config.AttachSocket());
  SPECACHE_RETURN_IF_ERROR(d->attach->Listen());
  d->io_thread = std::thread([d] {
    auto guard = boost::asio::make_work_guard(d->io);
    d->io.run();
  });
  return Status::Ok();
}

Status StartMetrics(State* d) {
  if (d->config.metrics_addr.empty()) return Status::Ok();
  SPECACHE_ASSIGN_OR_RETURN(d->metrics, Metrics::Start(d->config.metrics_addr));
  return Status::Ok();
}

void StartHousekeeping(State* d) {
  d->housekeeping = std::thread([d] {
    int tick = 0;
    while (!d->stopping.load()) {
      d->registry->Reap();
      if (d->metrics && ++tick % 10 == 0) {
        d->metrics->Update(d->registry->Stats(), d->service->requests(), d->service->errors());
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  });
}

}  // namespace

namespace {

// %j: the message as the inside of a JSON string (quotes, backslashes, control bytes escaped).
class JsonMessageFlag final : public spdlog::custom_flag_formatter {
 public:
  void format(const spdlog::details::log_msg& msg, const std::tm&, spdlog::memory_buf_t& dest) override {
    for (char ch : std::string_view(msg.payload.data(), msg.payload.size())) {
      const auto c = static_cast<unsigned char>(ch);
      if (ch == '"' || ch == '\\') {
        dest.push_back('\\');
        dest.push_back(ch);
      } else if (c < 0x20) {
        static const char kHex[] = "0123456789abcdef";
        for (char e : {'\\', 'u', '0', '0', kHex[c >> 4], kHex[c & 15]}) dest.push_back(e);
      } else {
        dest.push_back(ch);
      }
    }
  }
  std::unique_ptr<custom_flag_formatter> clone() const override { return std::make_unique<JsonMessageFlag>(); }
};

}  // namespace

Status ConfigureLogging(const DaemonConfig& c) {
  if (!spdlog::get("specached")) spdlog::set_default_logger(spdlog::stderr_logger_mt("specached"));
  if (c.log_format == "json") {
    auto formatter = std::make_unique<spdlog::pattern_formatter>();
    formatter->add_flag<JsonMessageFlag>('j').set_pattern(
        R"({"time":"%Y-%m-%dT%H:%M:%S.%e%z","level":"%l","pid":%P,"msg":"%j"})");
    spdlog::set_formatter(std::move(formatter));
  } else {
    spdlog::set_pattern("%Y-%m-%d %H:%M:%S.%e %^%l%$ %v");
  }
  const auto level = spdlog::level::from_str(c.log_level);
  if (level == spdlog::level::off && c.log_level != "off") return Status::InvalidArgument("unknown log_level " + c.log_level);
  spdlog::set_level(level);
  return Status::Ok();
}

Daemon::Daemon() : s_(std::make_unique<State>()) {}
Daemon::~Daemon() { Stop(); }

const DaemonConfig& Daemon::config() const { return s_->config; }

Status Daemon::Start(const DaemonConfig& config) {
  State* d = s_.get();
  d->config = config;
  const std::vector<std::pair<const char*, std::function<Status()>>> steps = {
      {"reserve memory pool", [&] { return ReservePool(d); }},
      {"open the spill tier", [&] { return OpenSpillTier(d); }},
      {"listen on the control socket", [&] { return ListenControl(d); }},
      {"listen on the attach socket", [&] { return ListenAttach(d); }},
      {"start the metrics endpoint", [&] { return StartMetrics(d); }},
  };
  for (const auto& [name, step] : steps) {
    Status s = step();
    if (!s.ok()) {
      Stop();
      return s.WithContext(std::string("startup failed at '") + name + "'");
    }
    spdlog::debug("startup: {} done", name);
  }
  StartHousekeeping(d);
  return Status::Ok();
}

void Daemon::Stop() {
  State* d = s_.get();
  if (d->stopping.exchange(true)) return;
  if (d->housekeeping.joinable()) d->housekeeping.join();
  if (d->server) d->server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  if (d->attach) d->attach->Stop();
  d->io.stop();
  if (d->io_thread.joinable()) d->io_thread.join();
  if (d->server) ::unlink(d->config.socket.c_str());
  // Sessions end with the daemon: their kept sequences are parked, then everything parked is
  // spilled (it would die with the process).
  if (d->registry) d->registry->ParkKeptSequences();
  if (d->kept && d->kept->has_spill_tier()) {
    auto spilled = d->kept->SpillAll();
    if (spilled.ok()) {
      if (*spilled > 0) spdlog::info("stop: {} parked sequences spilled", *spilled);
    } else {
      // Each sequence that could not be spilled was logged by name; they die with the process.
      spdlog::error("stop: parked sequences lost with the process: {}", spilled.status().ToString());
    }
  }
}

}  // namespace specache::daemon
