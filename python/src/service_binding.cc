#include "service_binding.h"

#ifdef SPECACHE_PY_SERVICE

#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <chrono>
#include <filesystem>
#include <memory>
#include <string>
#include <utility>

#include <nanobind/stl/string.h>
#include <nanobind/stl/unique_ptr.h>

#include "daemon.h"
#include "specache/client.h"
#include "specache/daemon_source.h"
#include "specache/host_rows.h"
#include "status_error.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace specache::python {
namespace {

using client::Client;
using client::DaemonSource;
using client::Session;

// Every call below may wait on the daemon (an RPC, an attach, a page-table map): without the GIL.
template <typename F>
auto Released(F&& call) {
  nb::gil_scoped_release release;
  return call();
}

nb::dict LayoutDict(const client::PageLayoutSpec& l) {
  nb::dict d;
  d["n_layers"] = l.n_layers;
  d["n_kv_heads"] = l.n_kv_heads;
  d["head_dim"] = l.head_dim;
  d["page_tokens"] = l.page_tokens;
  d["capacity_tokens"] = l.capacity_tokens;
  d["row_format"] = HostRowFormatNameOrNumber(l.row_format);
  return d;
}

nb::dict StatsDict(const client::DaemonStats& s) {
  nb::dict d;
#define SPECACHE_FIELD(name) d[#name] = s.name
  SPECACHE_FIELD(pool_bytes); SPECACHE_FIELD(reserved_bytes); SPECACHE_FIELD(used_bytes);
  SPECACHE_FIELD(free_bytes); SPECACHE_FIELD(chunk_bytes); SPECACHE_FIELD(sessions); SPECACHE_FIELD(sequences);
  SPECACHE_FIELD(pages); SPECACHE_FIELD(requests); SPECACHE_FIELD(errors); SPECACHE_FIELD(uptime_ms);
  SPECACHE_FIELD(memory_locked); SPECACHE_FIELD(pool_huge_bytes); SPECACHE_FIELD(version); SPECACHE_FIELD(parked_bytes);
  SPECACHE_FIELD(spilled_bytes); SPECACHE_FIELD(spill_disk_bytes); SPECACHE_FIELD(parked_sequences);
  SPECACHE_FIELD(spilled_sequences); SPECACHE_FIELD(spill_tier); SPECACHE_FIELD(spills); SPECACHE_FIELD(restores);
  SPECACHE_FIELD(spill_bytes_total); SPECACHE_FIELD(restore_bytes_total); SPECACHE_FIELD(spill_seconds);
  SPECACHE_FIELD(restore_seconds); SPECACHE_FIELD(checksum_failures); SPECACHE_FIELD(spill_read_errors);
  SPECACHE_FIELD(spill_write_errors);
  SPECACHE_FIELD(kept_dropped); SPECACHE_FIELD(attach_connections); SPECACHE_FIELD(refused_connections);
  SPECACHE_FIELD(accept_errors); SPECACHE_FIELD(denied_requests); SPECACHE_FIELD(chunks_out_of_service);
  SPECACHE_FIELD(spill_failures); SPECACHE_FIELD(spill_backoff_ms); SPECACHE_FIELD(spill_unreadable_records);
  SPECACHE_FIELD(spill_damaged_sequences); SPECACHE_FIELD(kept_evicted); SPECACHE_FIELD(kept_evicted_bytes);
#undef SPECACHE_FIELD
  nb::list tenants;
  for (const client::TenantUsage& t : s.tenants) {
    nb::dict u;
    u["tenant"] = t.tenant;
    u["reserved_bytes"] = t.reserved_bytes;
    u["used_bytes"] = t.used_bytes;
    u["quota_bytes"] = t.quota_bytes;
    u["sessions"] = t.sessions;
    u["sequences"] = t.sequences;
    u["retained_bytes"] = t.retained_bytes;
    tenants.append(u);
  }
  d["tenants"] = tenants;
  return d;
}

// A specached inside this process: its own temporary directory and socket, no metrics endpoint,
// memory not locked (a user's shell rarely has the RLIMIT_MEMLOCK for it), one tenant "default".
class EmbeddedDaemon {
 public:
  EmbeddedDaemon(uint64_t pool_bytes, uint64_t chunk_bytes) {
    if (chunk_bytes == 0 || pool_bytes == 0) {  // the daemon's own checks come after the rounding below
      ThrowIfError(Status::InvalidArgument("EmbeddedDaemon: pool_bytes and chunk_bytes must be positive"));
    }
    if (pool_bytes > ~uint64_t{0} - (chunk_bytes - 1)) {  // the rounding up to whole chunks would wrap
      ThrowIfError(Status::InvalidArgument("EmbeddedDaemon: pool_bytes " + std::to_string(pool_bytes) +
                                           " cannot be rounded up to whole chunks"));
    }
    char tmpl[] = "/tmp/specache-py-XXXXXX";
    if (!mkdtemp(tmpl)) ThrowIfError(Status::Internal("mkdtemp failed: " + std::string(strerror(errno))));
    dir_ = tmpl;
    daemon::DaemonConfig c;
    c.socket = dir_ + "/control.sock";
    c.chunk_bytes = chunk_bytes;
    c.pool_bytes = (pool_bytes + chunk_bytes - 1) / chunk_bytes * chunk_bytes;
    c.metrics_addr = "";
    c.lock_memory = false;
    c.prefault_threads = 2;
    daemon::TenantConfig tenant;  // anyone in this process may use it; no remote access
    tenant.quota_bytes = c.pool_bytes;
    c.tenants["default"] = tenant;
    daemon::LogEmbeddedDaemonToStderr();
    daemon_ = std::make_unique<daemon::Daemon>();
    Status started = Released([&] { return daemon_->Start(c); });
    if (!started.ok()) {
      daemon_.reset();
      std::filesystem::remove_all(dir_);
      ThrowIfError(started.WithContext("embedded specached"));
    }
    socket_ = c.socket;
  }
  ~EmbeddedDaemon() { Stop(); }

  const std::string& socket() const { return socket_; }
  bool running() const { return daemon_ != nullptr; }
  void Stop() {
    // Taken out while the GIL is held: a stop() of another thread meanwhile finds nothing to stop
    // (it used to stop and free the same daemon as this one).
    std::unique_ptr<daemon::Daemon> daemon = std::move(daemon_);
    const std::string dir = std::exchange(dir_, std::string());
    if (daemon) {
      nb::gil_scoped_release release;
      daemon->Stop();
      daemon.reset();
    }
    if (!dir.empty()) {
      std::error_code ignored;  // best effort: a leftover empty temporary directory harms nobody
      std::filesystem::remove_all(dir, ignored);
    }
  }

 private:
  std::string dir_, socket_;
  std::unique_ptr<daemon::Daemon> daemon_;
};

}  // namespace

bool BindService(nb::module_& m) {
  nb::class_<Session>(m, "Session",
                      "A session of specached (Client.open_session): reserved chunks, mapped in this process. "
                      "Everything it holds returns to the daemon when the object is collected.")
      .def_prop_ro("id", &Session::id)
      .def_prop_ro("chunk_bytes", &Session::chunk_bytes)
      .def_prop_ro("chunk_count", &Session::chunk_count)
      .def_prop_ro("alive", &Session::Alive, "False once the daemon closed the attach connection.")
      .def_prop_ro("extend_rpcs", &Session::extend_rpcs)
      .def(
          "create_sequence",
          [](Session& s, uint32_t n_layers, uint32_t n_kv_heads, uint32_t head_dim, uint32_t page_tokens,
             uint32_t capacity_tokens, const std::string& row_format) {
            const HostRowFormat format = ValueOrThrow(ParseHostRowFormat(row_format));
            client::PageLayoutSpec l{n_layers, n_kv_heads, head_dim, page_tokens, capacity_tokens,
                                     static_cast<uint32_t>(format)};
            return ValueOrThrow(Released([&] { return s.CreateSequence(l); }));
          },
          "n_layers"_a, "n_kv_heads"_a, "head_dim"_a, "page_tokens"_a = 64, "capacity_tokens"_a, "row_format"_a = "fp16",
          "Creates a daemon sequence; returns its id. row_format: fp16, or int8 (rows of int8 codes with two fp16 "
          "scales, specache/host_rows.h: the page bytes are the caller's to fill).")
      .def(
          "extend", [](Session& s, uint64_t seq, uint32_t tokens) { return ValueOrThrow(Released([&] { return s.Extend(seq, tokens); })); },
          "sequence"_a, "tokens"_a, "Makes room for tokens [0, tokens); returns pages per layer.")
      .def(
          "release", [](Session& s, uint64_t seq) { ThrowIfError(Released([&] { return s.Release(seq); })); },
          "sequence"_a,
          "Releases a sequence made here (create_sequence, claim); one a DaemonSource holds is refused "
          "(FAILED_PRECONDITION): release it through the source.")
      .def(
          "keep", [](Session& s, uint64_t seq) { ThrowIfError(Released([&] { return s.Keep(seq); })); },
          "sequence"_a,
          "Keeps the sequence in the daemon past this session (for its tenant); claim takes it back. One a "
          "DaemonSource holds is refused (FAILED_PRECONDITION): keep it through the source.")
      .def(
          "claim",
          [](Session& s, uint64_t seq, uint32_t n_layers, uint32_t n_kv_heads, uint32_t head_dim, uint32_t page_tokens,
             uint32_t capacity_tokens, const std::string& row_format) {
            const HostRowFormat format = ValueOrThrow(ParseHostRowFormat(row_format));
            client::PageLayoutSpec l{n_layers, n_kv_heads, head_dim, page_tokens, capacity_tokens,
                                     static_cast<uint32_t>(format)};
            return ValueOrThrow(Released([&] { return s.Claim(seq, l); }));
          },
          "sequence"_a, "n_layers"_a, "n_kv_heads"_a, "head_dim"_a, "page_tokens"_a = 64, "capacity_tokens"_a,
          "row_format"_a = "fp16",
          "Takes a kept sequence of this session's tenant, kept with this layout, into this session (its id "
          "unchanged); returns its pages per layer.")
      .def(
          "pages_per_layer", [](const Session& s, uint64_t seq) { return ValueOrThrow(s.PagesPerLayer(seq)); },
          "sequence"_a);

  nb::class_<Client>(m, "Client", "A connection to specached's control socket (libspecache_client).")
      .def_static(
          "connect",
          [](const std::string& socket, int deadline_ms, const std::string& client_name) {
            client::ClientOptions o{socket, std::chrono::milliseconds(deadline_ms), client_name};
            return ValueOrThrow(Released([&] { return Client::Connect(o); }));
          },
          "socket"_a, "deadline_ms"_a = 2000, "client_name"_a = "python",
          "Connects; StatusError(UNAVAILABLE) within the deadline when no daemon listens.")
      .def(
          "open_session",
          [](Client& c, const std::string& tenant, uint64_t pool_bytes) {
            return ValueOrThrow(Released([&] { return c.OpenSession(tenant, pool_bytes); }));
          },
          "tenant"_a, "pool_bytes"_a, nb::keep_alive<0, 1>(),
          "Reserves pool_bytes (whole chunks) for the tenant and attaches.")
      .def("stats", [](Client& c) { return StatsDict(ValueOrThrow(Released([&] { return c.Stats(); }))); },
           "The daemon's stats as a dict (tenants as a list of dicts).")
      .def("list_sessions",
           [](Client& c) {
             nb::list out;
             for (const client::SessionRecord& r : ValueOrThrow(Released([&] { return c.ListSessions(); }))) {
               nb::dict d;
               d["id"] = r.id;
               d["tenant"] = r.tenant;
               d["client_name"] = r.client_name;
               d["pid"] = r.pid;
               d["uid"] = r.uid;
               d["attached"] = r.attached;
               d["chunks"] = r.chunks;
               d["sequences"] = r.sequences;
               d["used_bytes"] = r.used_bytes;
               d["age_ms"] = r.age_ms;
               out.append(d);
             }
             return out;
           })
      .def("list_sequences", [](Client& c) {
        nb::list out;
        for (const client::SequenceRecord& r : ValueOrThrow(Released([&] { return c.ListSequences(); }))) {
          nb::dict d;
          d["id"] = r.id;
          d["session"] = r.session;
          d["tenant"] = r.tenant;
          d["layout"] = LayoutDict(r.layout);
          d["pages_per_layer"] = r.pages_per_layer;
          d["bytes"] = r.bytes;
          d["state"] = r.state;
          out.append(d);
        }
        return out;
      });

  nb::class_<DaemonSource, FullPrecisionSource>(
      m, "DaemonSource",
      "The agent's full-precision rows in the session's daemon pages (read and written in place).")
      .def(nb::init<Session*, uint32_t, uint32_t>(), "session"_a, "page_tokens"_a = 64, "capacity_tokens"_a = 32768,
           nb::keep_alive<1, 2>())
      .def_prop_ro("extend_rpcs", &DaemonSource::extend_rpcs)
      .def(
          "daemon_sequence", [](const DaemonSource& s, SequenceId id) { return ValueOrThrow(s.DaemonSequence(id)); },
          "id"_a, "The daemon's sequence id behind an agent sequence.")
      .def(
          "keep", [](DaemonSource& s, SequenceId id) { return ValueOrThrow(Released([&] { return s.Keep(id); })); },
          "id"_a, "Keeps the sequence in the daemon past this session; returns the daemon's id.");

  nb::class_<EmbeddedDaemon>(m, "EmbeddedDaemon",
                             "A specached inside this process on a temporary socket (tenant 'default'); "
                             "stop() or collection stops it.")
      .def(nb::init<uint64_t, uint64_t>(), "pool_bytes"_a = uint64_t{256} << 20, "chunk_bytes"_a = uint64_t{16} << 20)
      .def_prop_ro("socket", &EmbeddedDaemon::socket)
      .def_prop_ro("running", &EmbeddedDaemon::running)
      .def("stop", &EmbeddedDaemon::Stop);
  return true;
}

}  // namespace specache::python

#else  // no service half in this build

namespace specache::python {
bool BindService(nanobind::module_&) { return false; }
}  // namespace specache::python

#endif
