#include "access.h"

#include <sys/socket.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace specache::daemon {
namespace {

bool Contains(const std::vector<uint32_t>& ids, uint32_t id) { return std::find(ids.begin(), ids.end(), id) != ids.end(); }

std::string List(const std::vector<uint32_t>& ids) {
  std::string out = "[";
  for (size_t i = 0; i < ids.size(); ++i) out += (i ? ", " : "") + std::to_string(ids[i]);
  return out + "]";
}

}  // namespace

bool Caller::InGroup(uint32_t g) const { return gid == g || Contains(groups, g); }

std::string Caller::Describe() const {
  if (remote()) return "a remote client of tenant '" + remote_tenant + "'";
  return "uid " + std::to_string(uid) + " gid " + std::to_string(gid) + " groups " + List(groups);
}

Result<Caller> PeerOf(int fd) {
  ucred cred{};
  socklen_t len = sizeof cred;
  if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
    return Status::Unavailable(std::string("SO_PEERCRED: ") + std::strerror(errno));
  }
  Caller c{cred.pid, cred.uid, cred.gid, {}, {}};
  // SO_PEERGROUPS (Linux 4.13+): ERANGE tells how much room the list needs.
  std::vector<gid_t> groups(16);
  while (true) {
    len = static_cast<socklen_t>(groups.size() * sizeof(gid_t));
    if (getsockopt(fd, SOL_SOCKET, SO_PEERGROUPS, groups.data(), &len) == 0) break;
    if (errno != ERANGE || len <= groups.size() * sizeof(gid_t)) {
      return Status::Unavailable(std::string("SO_PEERGROUPS: ") + std::strerror(errno));
    }
    groups.resize(len / sizeof(gid_t));
  }
  c.groups.assign(groups.begin(), groups.begin() + len / sizeof(gid_t));
  return c;
}

AccessPolicy::AccessPolicy(const DaemonConfig& config, uint32_t daemon_uid)
    : tenants_(config.tenants), access_(config.access), daemon_uid_(daemon_uid) {}

Status AccessPolicy::MayUseTenant(const Caller& caller, const std::string& tenant) const {
  auto t = tenants_.find(tenant);
  if (t == tenants_.end()) return Status::PermissionDenied("unknown tenant '" + Printable(tenant) + "'");
  const TenantConfig& c = t->second;
  // A remote caller proved one tenant's secret: that tenant, nothing else (its kNoId ids match
  // no users or groups, and "any local user" does not include it).
  if (caller.remote()) {
    if (caller.remote_tenant == tenant) return Status::Ok();
    return Status::PermissionDenied("tenant '" + Printable(tenant) + "' is not the tenant this remote client authenticated for ('" +
                                    caller.remote_tenant + "')");
  }
  if (c.AllowsAnyone() || caller.uid == 0 || Contains(c.uids, caller.uid)) return Status::Ok();
  for (uint32_t g : c.gids) {
    if (caller.InGroup(g)) return Status::Ok();
  }
  return Status::PermissionDenied("tenant '" + tenant + "' admits users " + List(c.uids) + " and groups " +
                                  List(c.gids) + " (tenants." + tenant + " in the config); the caller, " +
                                  caller.Describe() + ", is none of them");
}

bool AccessPolicy::IsAdmin(const Caller& caller) const {
  if (caller.remote()) return false;  // administration stays on the host
  if (caller.uid == 0 || caller.uid == daemon_uid_ || Contains(access_.admin_uids, caller.uid)) return true;
  for (uint32_t g : access_.admin_gids) {
    if (caller.InGroup(g)) return true;
  }
  return false;
}

Status AccessPolicy::MayAdminister(const Caller& caller, std::string_view call) const {
  if (IsAdmin(caller)) return Status::Ok();
  return Status::PermissionDenied(std::string(call) + " is for admins: root, the daemon's user (uid " +
                                  std::to_string(daemon_uid_) + "), access.admin_users " + List(access_.admin_uids) +
                                  " and members of access.admin_groups " + List(access_.admin_gids) +
                                  "; the caller, " + caller.Describe() + ", is none of them");
}

Result<Caller> AccessPolicy::AuthenticateRemote(const std::string& tenant, std::string_view secret) const {
  auto t = tenants_.find(tenant);
  const std::string& expected = t == tenants_.end() ? std::string() : t->second.remote_secret;
  // Constant time in the secret's bytes: the comparison runs over the whole presented secret.
  unsigned char diff = expected.empty() || expected.size() != secret.size() ? 1 : 0;
  for (size_t i = 0; i < secret.size(); ++i) {
    diff |= static_cast<unsigned char>(secret[i]) ^ static_cast<unsigned char>(expected.empty() ? 0 : expected[i % expected.size()]);
  }
  if (diff != 0) {
    return Status::PermissionDenied("remote client: no tenant '" + Printable(tenant) +
                                    "' with remote access, or a wrong tenant secret");
  }
  Caller c;
  c.uid = c.gid = kNoId;
  c.remote_tenant = tenant;
  return c;
}

namespace {

std::pair<uint64_t, uint64_t> FileOf(int fd) {
  struct stat st {};
  if (fstat(fd, &st) != 0) return {0, 0};
  return {static_cast<uint64_t>(st.st_dev), static_cast<uint64_t>(st.st_ino)};
}

}  // namespace

void PeerTable::EraseLocked(std::map<int, Entry>::iterator it) {
  auto count = per_source_.find(it->second.source);
  if (count != per_source_.end() && --count->second == 0) per_source_.erase(count);
  by_fd_.erase(it);
}

void PeerTable::PruneLocked() {
  last_prune_ = std::chrono::steady_clock::now();
  for (auto it = by_fd_.begin(); it != by_fd_.end();) {
    const auto [dev, ino] = FileOf(it->first);
    const bool open = ino != 0 && dev == it->second.dev && ino == it->second.ino;
    if (open) {
      ++it;
    } else {
      auto gone = it++;
      EraseLocked(gone);
    }
  }
}

Status PeerTable::Admit(int fd, Caller caller, std::string source, const ConnectionLimits& limits) {
  const auto [dev, ino] = FileOf(fd);
  std::lock_guard<std::mutex> lock(mu_);
  if (auto reused = by_fd_.find(fd); reused != by_fd_.end()) EraseLocked(reused);  // a number gRPC closed and accept reused
  auto of = [&] {
    auto it = per_source_.find(source);
    return it == per_source_.end() ? uint32_t{0} : it->second;
  };
  auto over = [&] { return by_fd_.size() >= limits.most || of() >= limits.most_per_source; };
  // The connections gRPC closed are found only when a cap would refuse, and then at most once a
  // kPruneEvery: under a flood at the caps each refusal costs a lookup, not a stat per connection.
  if (over() && std::chrono::steady_clock::now() - last_prune_ >= kPruneEvery) PruneLocked();
  const uint32_t of_source = of();
  if (over()) {
    return Status::ResourceExhausted(std::to_string(by_fd_.size()) + " control connections open (" +
                                     std::to_string(of_source) + " from " + limits.per + " " + source + "), limits " +
                                     std::to_string(limits.most) + " and " + std::to_string(limits.most_per_source) +
                                     " per " + limits.per + " (" + limits.config + " in the config)");
  }
  ++per_source_[source];
  by_fd_[fd] = {std::move(caller), std::move(source), dev, ino};
  return Status::Ok();
}

Result<Caller> PeerTable::Find(const std::string& peer) const {
  constexpr std::string_view kPrefix = "fd:";
  if (peer.compare(0, kPrefix.size(), kPrefix) == 0) {
    const int fd = std::atoi(peer.c_str() + kPrefix.size());
    std::lock_guard<std::mutex> lock(mu_);
    auto it = by_fd_.find(fd);
    if (it != by_fd_.end()) return it->second.caller;
  }
  return Status::PermissionDenied("connection " + Printable(peer) + " has no known peer credentials");
}

std::string Printable(std::string_view text, size_t max_bytes) {
  static const char kHex[] = "0123456789abcdef";
  std::string out;
  const size_t n = std::min(text.size(), max_bytes);
  for (size_t i = 0; i < n; ++i) {
    const auto c = static_cast<unsigned char>(text[i]);
    if (c < 0x20 || c >= 0x7f || c == '\\' || c == '\'' || c == '"') {
      out += {'\\', 'x', kHex[c >> 4], kHex[c & 15]};
    } else {
      out.push_back(static_cast<char>(c));
    }
  }
  if (text.size() > max_bytes) out += "...(" + std::to_string(text.size()) + " bytes)";
  return out;
}

}  // namespace specache::daemon
