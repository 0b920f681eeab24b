#include "config.h"

#include <grp.h>
#include <pwd.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <cstdlib>
#include <fstream>
#include <optional>
#include <sstream>

#include <toml++/toml.h>

#include "specache/remote_protocol.h"

namespace specache::daemon {
namespace {

Result<uint64_t> BytesOf(const toml::node& node, const std::string& key) {
  if (auto v = node.value<int64_t>()) {
    if (*v < 0) return Status::InvalidArgument(key + " must not be negative");
    return static_cast<uint64_t>(*v);
  }
  if (auto s = node.value<std::string>()) {
    auto bytes = ParseBytes(*s);
    if (!bytes.ok()) return bytes.status().WithContext(key);
    return bytes;
  }
  return Status::InvalidArgument(key + " must be a number of bytes or a string like \"8GiB\"");
}

// A users/groups entry: a number is the id itself; a name is looked up (getpwnam / getgrnam).
template <typename Lookup>
Result<uint32_t> IdOf(const toml::node& node, const char* kind, Lookup lookup) {
  if (auto v = node.value<int64_t>()) return CheckedId(*v, kind);
  if (auto s = node.value<std::string>()) {
    if (auto id = lookup(s->c_str())) return *id;
    return Status::InvalidArgument(std::string("unknown ") + kind + " '" + *s + "'");
  }
  return Status::InvalidArgument(std::string(kind) + "s entries must be names or " + (kind[0] == 'u' ? "uids" : "gids"));
}

Result<uint32_t> UserId(const toml::node& node) {
  return IdOf(node, "user", [](const char* name) -> std::optional<uint32_t> {
    const passwd* pw = getpwnam(name);
    return pw ? std::optional<uint32_t>(pw->pw_uid) : std::nullopt;
  });
}

Result<uint32_t> GroupId(const toml::node& node) {
  return IdOf(node, "group", [](const char* name) -> std::optional<uint32_t> {
    const group* gr = getgrnam(name);
    return gr ? std::optional<uint32_t>(gr->gr_gid) : std::nullopt;
  });
}

// An array of user or group entries (names or ids).
template <typename Id>
Status IdsOf(const toml::node& value, const std::string& key, Id id_of, std::vector<uint32_t>* out) {
  const toml::array* arr = value.as_array();
  if (!arr) return Status::InvalidArgument("config: " + key + " must be an array");
  for (const toml::node& e : *arr) {
    auto id = id_of(e);
    if (!id.ok()) return id.status().WithContext("config: " + key);
    out->push_back(*id);
  }
  return Status::Ok();
}

// [access]: kept apart from the rest of the parser (one block per table).
Status ParseAccess(const toml::node& node, AccessConfig* a) {
  const toml::table* t = node.as_table();
  if (!t) return Status::InvalidArgument("config: [access] must be a table");
  for (const auto& [field, value] : *t) {
    const std::string key = "access." + std::string(field.str());
    if (field.str() == "admin_users") {
      SPECACHE_RETURN_IF_ERROR(IdsOf(value, key, UserId, &a->admin_uids));
    } else if (field.str() == "admin_groups") {
      SPECACHE_RETURN_IF_ERROR(IdsOf(value, key, GroupId, &a->admin_gids));
    } else if (field.str() == "socket_group") {
      SPECACHE_ASSIGN_OR_RETURN(a->socket_gid, GroupId(value));
    } else if (field.str() == "socket_mode") {
      // "0660" (octal text) or a TOML integer (0o660).
      int64_t mode = -1;
      if (auto v = value.value<int64_t>()) mode = *v;
      if (auto v = value.value<std::string>()) {
        char* end = nullptr;
        const long parsed = std::strtol(v->c_str(), &end, 8);
        mode = (!v->empty() && *end == '\0') ? parsed : -1;
      }
      if (mode < 0 || (mode & ~0770) != 0) {
        return Status::InvalidArgument("config: " + key + " must be an octal mode within 0770 (owner and group only)");
      }
      a->socket_mode = static_cast<uint32_t>(mode);
    } else {
      return Status::InvalidArgument("config: unknown key '" + key + "'");
    }
  }
  return Status::Ok();
}

// A count limit: an integer in [1, 1000000].
Status ParseCount(const toml::node& value, const std::string& key, uint32_t* out) {
  auto v = value.value<int64_t>();
  if (!v || *v < 1 || *v > 1000000) return Status::InvalidArgument("config: " + key + " must be an integer in [1, 1000000]");
  *out = static_cast<uint32_t>(*v);
  return Status::Ok();
}

// [limits]
Status ParseLimits(const toml::node& node, LimitsConfig* l) {
  const toml::table* t = node.as_table();
  if (!t) return Status::InvalidArgument("config: [limits] must be a table");
  for (const auto& [field, value] : *t) {
    const std::string key = "limits." + std::string(field.str());
    uint32_t* out = field.str() == "attach_connections"            ? &l->attach_connections
                    : field.str() == "attach_connections_per_uid"  ? &l->attach_connections_per_uid
                    : field.str() == "control_connections"         ? &l->control_connections
                    : field.str() == "control_connections_per_uid" ? &l->control_connections_per_uid
                    : field.str() == "kept_sequences_per_tenant"   ? &l->kept_sequences_per_tenant
                                                                   : nullptr;
    if (!out) return Status::InvalidArgument("config: unknown key '" + key + "'");
    SPECACHE_RETURN_IF_ERROR(ParseCount(value, key, out));
  }
  return Status::Ok();
}

// [remote]
Status ParseRemote(const toml::node& node, RemoteConfig* r) {
  const toml::table* t = node.as_table();
  if (!t) return Status::InvalidArgument("config: [remote] must be a table");
  for (const auto& [field, value] : *t) {
    const std::string key = "remote." + std::string(field.str());
    if (field.str() == "rma") {
      auto v = value.value<bool>();
      if (!v) return Status::InvalidArgument("config: " + key + " must be true or false");
      r->rma = *v;
      continue;
    }
    if (field.str() == "control_connections" || field.str() == "control_connections_per_address") {
      SPECACHE_RETURN_IF_ERROR(ParseCount(value, key, field.str() == "control_connections" ? &r->control_connections
                                                                                           : &r->control_connections_per_address));
      continue;
    }
    if (field.str() == "idle_close_ms" || field.str() == "max_connection_ms") {
      auto v = value.value<int64_t>();
      if (!v || *v < 100 || *v > 86400000) {
        return Status::InvalidArgument("config: " + key + " must be a whole number of ms in [100, 86400000]");
      }
      (field.str() == "idle_close_ms" ? r->idle_close_ms : r->max_connection_ms) = static_cast<uint32_t>(*v);
      continue;
    }
    std::string* out = field.str() == "control_addr" ? &r->control_addr
                       : field.str() == "data_addr"  ? &r->data_addr
                       : field.str() == "tls_cert"   ? &r->tls_cert
                       : field.str() == "tls_key"    ? &r->tls_key
                       : field.str() == "client_ca"  ? &r->client_ca
                                                     : nullptr;
    if (!out) return Status::InvalidArgument("config: unknown key '" + key + "'");
    auto v = value.value<std::string>();
    if (!v) return Status::InvalidArgument("config: " + key + " must be a string");
    *out = *v;
  }
  return Status::Ok();
}

// A tenant's remote secret: a private file (ReadPrivateFile: a secret others can read is no
// secret), holding at least 16 bytes; trailing whitespace is not part of it.
Result<std::string> ReadSecretFile(const std::string& path, const std::string& key) {
  SPECACHE_ASSIGN_OR_RETURN(std::string secret, ReadPrivateFile(path, "config: " + key));
  remote::DropTrailingSpace(&secret);
  if (secret.size() < 16) return Status::InvalidArgument("config: " + key + " must hold at least 16 bytes");
  if (!remote::PrintableHeaderValue(secret)) {  // no client could send it
    return Status::InvalidArgument("config: " + key + " holds a byte outside printable ASCII (0x20-0x7e), which the "
                                   "clients' gRPC header cannot carry: make it printable (e.g. openssl rand -hex 32)");
  }
  return secret;
}

}  // namespace

Result<std::string> ReadPrivateFile(const std::string& path, const std::string& what) {
  constexpr off_t kMostBytes = off_t{1} << 20;
  const std::string named = what + " " + path;
  const int fd = ::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    const int err = errno;
    if (err == ELOOP) return Status::PermissionDenied(named + " is a symbolic link: name the file itself");
    const std::string why = named + " cannot be opened: " + std::strerror(err);
    return err == ENOENT ? Status::NotFound(why) : Status::Unavailable(why);
  }
  struct stat st {};
  Status s = ::fstat(fd, &st) == 0 ? Status::Ok() : Status::Unavailable(named + ": " + std::strerror(errno));
  if (s.ok() && !S_ISREG(st.st_mode)) s = Status::InvalidArgument(named + " is not a regular file");
  if (s.ok() && st.st_uid != 0 && st.st_uid != ::geteuid()) {
    s = Status::PermissionDenied(named + " belongs to user " + std::to_string(st.st_uid) +
                                 ", neither root nor the daemon's user (who could replace it?)");
  }
  if (s.ok() && (st.st_mode & 077) != 0) {
    s = Status::PermissionDenied(named + " must not be readable or writable by group or others (chmod 600)");
  }
  if (s.ok() && st.st_size > kMostBytes) s = Status::InvalidArgument(named + " is larger than 1 MiB");
  std::string bytes;
  while (s.ok()) {
    char buf[4096];
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) s = Status::Unavailable(named + " cannot be read: " + std::strerror(errno));
    if (n <= 0) break;
    bytes.append(buf, static_cast<size_t>(n));
    if (bytes.size() > static_cast<size_t>(kMostBytes)) s = Status::InvalidArgument(named + " is larger than 1 MiB");
  }
  ::close(fd);
  if (!s.ok()) return s;
  return bytes;
}

Result<uint32_t> CheckedId(int64_t value, const std::string& what) {
  if (value < 0 || value > int64_t{UINT32_MAX} - 1) {
    return Status::InvalidArgument(what + " id " + std::to_string(value) + " is out of range (0 .. 4294967294)");
  }
  return static_cast<uint32_t>(value);
}

Result<uint64_t> ParseBytes(const std::string& text) {
  size_t i = 0;
  while (i < text.size() && std::isspace(static_cast<unsigned char>(text[i]))) ++i;
  size_t digits = i;
  while (digits < text.size() && std::isdigit(static_cast<unsigned char>(text[digits]))) ++digits;
  if (digits == i) return Status::InvalidArgument("'" + text + "' is not a byte size");
  uint64_t value = 0;
  try {
    value = std::stoull(text.substr(i, digits - i));
  } catch (const std::exception&) {
    return Status::InvalidArgument("'" + text + "' is out of range");
  }
  std::string unit = text.substr(digits);
  unit.erase(0, unit.find_first_not_of(' '));
  unit.erase(unit.find_last_not_of(' ') + 1);
  uint64_t scale = 1;
  if (unit == "" || unit == "B") {
    scale = 1;
  } else if (unit == "KiB" || unit == "K") {
    scale = uint64_t{1} << 10;
  } else if (unit == "MiB" || unit == "M") {
    scale = uint64_t{1} << 20;
  } else if (unit == "GiB" || unit == "G") {
    scale = uint64_t{1} << 30;
  } else if (unit == "TiB" || unit == "T") {
    scale = uint64_t{1} << 40;
  } else {
    return Status::InvalidArgument("unknown unit '" + unit + "' in '" + text + "' (B, KiB, MiB, GiB, TiB)");
  }
  if (value > UINT64_MAX / scale) return Status::InvalidArgument("'" + text + "' is out of range");
  return value * scale;
}

Result<DaemonConfig> ParseConfig(const std::string& text) {
  toml::table t;
  try {
    t = toml::parse(text);
  } catch (const toml::parse_error& e) {
    std::ostringstream msg;
    msg << "config: " << e.description() << " at line " << e.source().begin.line;
    return Status::InvalidArgument(msg.str());
  }
  DaemonConfig c;
  static const char* kKnown[] = {"socket", "attach_socket", "pool_bytes", "chunk_bytes", "prefault_threads",
                                 "lock_memory", "huge_pages", "lease_ms", "max_sequences_per_session", "max_page_refs_per_session",
                                 "metrics_addr", "log_format", "log_level", "tenants", "spill", "access", "limits",
                                 "remote"};
  for (const auto& [key, node] : t) {
    bool known = false;
    for (const char* k : kKnown) known |= key.str() == k;
    if (!known) return Status::InvalidArgument("config: unknown key '" + std::string(key.str()) + "'");
  }
  auto str = [&](const char* key, std::string* out) -> Status {
    if (const toml::node* n = t.get(key)) {
      auto v = n->value<std::string>();
      if (!v) return Status::InvalidArgument(std::string("config: ") + key + " must be a string");
      *out = *v;
    }
    return Status::Ok();
  };
  auto num = [&](const char* key, auto* out, int64_t lo, int64_t hi) -> Status {
    if (const toml::node* n = t.get(key)) {
      auto v = n->value<int64_t>();
      if (!v || *v < lo || *v > hi) {
        return Status::InvalidArgument(std::string("config: ") + key + " must be an integer in [" + std::to_string(lo) +
                                       ", " + std::to_string(hi) + "]");
      }
      *out = static_cast<std::remove_pointer_t<decltype(out)>>(*v);
    }
    return Status::Ok();
  };
  SPECACHE_RETURN_IF_ERROR(str("socket", &c.socket));
  SPECACHE_RETURN_IF_ERROR(str("attach_socket", &c.attach_socket));
  SPECACHE_RETURN_IF_ERROR(str("metrics_addr", &c.metrics_addr));
  SPECACHE_RETURN_IF_ERROR(str("log_format", &c.log_format));
  SPECACHE_RETURN_IF_ERROR(str("log_level", &c.log_level));
  if (const toml::node* n = t.get("pool_bytes")) {
    SPECACHE_ASSIGN_OR_RETURN(c.pool_bytes, BytesOf(*n, "pool_bytes"));
  }
  if (const toml::node* n = t.get("chunk_bytes")) {
    SPECACHE_ASSIGN_OR_RETURN(c.chunk_bytes, BytesOf(*n, "chunk_bytes"));
  }
  SPECACHE_RETURN_IF_ERROR(num("prefault_threads", &c.prefault_threads, 1, 256));
  SPECACHE_RETURN_IF_ERROR(num("lease_ms", &c.lease_ms, 100, 600000));
  SPECACHE_RETURN_IF_ERROR(num("max_sequences_per_session", &c.max_sequences_per_session, 1, 65536));
  SPECACHE_RETURN_IF_ERROR(num("max_page_refs_per_session", &c.max_page_refs_per_session, 1, 1 << 26));
  if (const toml::node* n = t.get("lock_memory")) {
    auto v = n->value<bool>();
    if (!v) return Status::InvalidArgument("config: lock_memory must be true or false");
    c.lock_memory = *v;
  }
  if (const toml::node* n = t.get("huge_pages")) {
    auto v = n->value<bool>();
    if (!v) return Status::InvalidArgument("config: huge_pages must be true or false");
    c.huge_pages = *v;
  }
  if (const toml::node* n = t.get("spill")) {
    const toml::table* sp = n->as_table();
    if (!sp) return Status::InvalidArgument("config: [spill] must be a table");
    for (const auto& [field, value] : *sp) {
      const std::string key = "spill." + std::string(field.str());
      if (field.str() == "dir") {
        auto v = value.value<std::string>();
        if (!v) return Status::InvalidArgument("config: " + key + " must be a string");
        c.spill.dir = *v;
      } else if (field.str() == "max_bytes") {
        SPECACHE_ASSIGN_OR_RETURN(c.spill.max_bytes, BytesOf(value, key));
      } else if (field.str() == "park_bytes") {
        SPECACHE_ASSIGN_OR_RETURN(c.spill.park_bytes, BytesOf(value, key));
      } else if (field.str() == "compression" || field.str() == "write_through") {
        auto v = value.value<bool>();
        if (!v) return Status::InvalidArgument("config: " + key + " must be true or false");
        (field.str() == "compression" ? c.spill.compression : c.spill.write_through) = *v;
      } else if (field.str() == "high_watermark" || field.str() == "low_watermark") {
        auto v = value.value<double>();
        if (!v || *v <= 0 || *v > 1) return Status::InvalidArgument("config: " + key + " must be a number in (0, 1]");
        (field.str() == "high_watermark" ? c.spill.high_watermark : c.spill.low_watermark) = *v;
      } else {
        return Status::InvalidArgument("config: unknown key '" + key + "'");
      }
    }
  }
  if (const toml::node* n = t.get("tenants")) {
    const toml::table* tenants = n->as_table();
    if (!tenants) return Status::InvalidArgument("config: [tenants] must be a table of tables");
    for (const auto& [name, node] : *tenants) {
      const toml::table* tt = node.as_table();
      const std::string key = "tenants." + std::string(name.str());
      if (!tt) return Status::InvalidArgument("config: " + key + " must be a table");
      TenantConfig tc;
      tc.quota_bytes = c.pool_bytes;
      tc.quota_is_pool = true;
      for (const auto& [field, value] : *tt) {
        if (field.str() == "quota_bytes") {
          SPECACHE_ASSIGN_OR_RETURN(tc.quota_bytes, BytesOf(value, key + ".quota_bytes"));
          tc.quota_is_pool = false;
        } else if (field.str() == "users") {
          SPECACHE_RETURN_IF_ERROR(IdsOf(value, key + ".users", UserId, &tc.uids));
        } else if (field.str() == "groups") {
          SPECACHE_RETURN_IF_ERROR(IdsOf(value, key + ".groups", GroupId, &tc.gids));
        } else if (field.str() == "remote_secret_file") {
          auto v = value.value<std::string>();
          if (!v) return Status::InvalidArgument("config: " + key + ".remote_secret_file must be a string");
          SPECACHE_ASSIGN_OR_RETURN(tc.remote_secret, ReadSecretFile(*v, key + ".remote_secret_file"));
        } else {
          return Status::InvalidArgument("config: unknown key '" + key + "." + std::string(field.str()) + "'");
        }
      }
      c.tenants[std::string(name.str())] = tc;
    }
  }
  if (const toml::node* n = t.get("access")) SPECACHE_RETURN_IF_ERROR(ParseAccess(*n, &c.access));
  if (const toml::node* n = t.get("limits")) SPECACHE_RETURN_IF_ERROR(ParseLimits(*n, &c.limits));
  if (const toml::node* n = t.get("remote")) SPECACHE_RETURN_IF_ERROR(ParseRemote(*n, &c.remote));
  SPECACHE_RETURN_IF_ERROR(ValidateConfig(c));
  return c;
}

Result<DaemonConfig> LoadConfig(const std::string& path) {
  std::ifstream in(path);
  if (!in) return Status::NotFound("config file " + path + " cannot be read");
  std::stringstream s;
  s << in.rdbuf();
  auto config = ParseConfig(s.str());
  if (!config.ok()) return config.status().WithContext(path);
  return config;
}

void CompleteTenants(DaemonConfig* c) {
  if (c->tenants.empty()) c->tenants["default"].quota_is_pool = true;
  for (auto& [name, tenant] : c->tenants) {
    if (tenant.quota_is_pool) tenant.quota_bytes = c->pool_bytes;
  }
}

Status ValidateConfig(const DaemonConfig& c) {
  if (c.socket.empty()) return Status::InvalidArgument("config: socket must not be empty");
  if (c.chunk_bytes == 0 || c.chunk_bytes % 4096 != 0) return Status::InvalidArgument("config: chunk_bytes must be a multiple of 4096");
  if (c.pool_bytes < c.chunk_bytes) return Status::InvalidArgument("config: pool_bytes must hold at least one chunk");
  if (c.log_format != "text" && c.log_format != "json") return Status::InvalidArgument("config: log_format is text or json");
  // Also checked here (not only in the parser) for values from the command line.
  if (c.lease_ms < 100 || c.lease_ms > 600000) return Status::InvalidArgument("config: lease_ms must be in [100, 600000]");
  for (const auto& [name, tenant] : c.tenants) {
    const bool printable = std::all_of(name.begin(), name.end(), [](char ch) { return ch > 0x20 && ch < 0x7f; });
    if (name.empty() || name.size() > kMaxTenantName || !printable) {
      return Status::InvalidArgument("config: tenant names are 1 to " + std::to_string(kMaxTenantName) +
                                     " printable ASCII characters without spaces");
    }
  }
  if ((c.access.socket_mode & ~0770u) != 0) return Status::InvalidArgument("config: access.socket_mode must be within 0770");
  if (c.remote.enabled()) {
    if (c.remote.data_addr.empty()) return Status::InvalidArgument("config: remote.data_addr is needed with remote.control_addr");
    // Remote callers are never trusted on a plaintext port: the tenant secret would cross the wire.
    if (c.remote.tls_cert.empty() || c.remote.tls_key.empty()) {
      return Status::InvalidArgument("config: remote.tls_cert and remote.tls_key are needed with remote.control_addr");
    }
  }
  if (c.spill.low_watermark > c.spill.high_watermark) {
    return Status::InvalidArgument("config: spill.low_watermark must not exceed spill.high_watermark");
  }
  return Status::Ok();
}

}  // namespace specache::daemon
