#include "specache/trusted_directory.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>

namespace specache {
namespace {

std::string Mode(mode_t mode) {
  char text[8];
  std::snprintf(text, sizeof text, "%04o", static_cast<unsigned>(mode & 07777));
  return text;
}

std::string Named(std::string_view what, const std::filesystem::path& dir) {
  return std::string(what) + " " + dir.string();
}

// The rule of CheckTrustedDirectory on a directory's stat.
Status CheckOwnerAndMode(const struct stat& st, std::string_view what, const std::filesystem::path& dir) {
  if (!S_ISDIR(st.st_mode)) return Status::FailedPrecondition(Named(what, dir) + " is not a directory");
  if (st.st_uid != 0 && st.st_uid != ::geteuid()) {
    return Status::PermissionDenied(Named(what, dir) + " belongs to user " + std::to_string(st.st_uid) +
                                    ", neither root nor the daemon's user " + std::to_string(::geteuid()) +
                                    ": its owner could replace what is in it; choose a directory of the daemon's");
  }
  if ((st.st_mode & (S_IWGRP | S_IWOTH)) != 0 && (st.st_mode & S_ISVTX) == 0) {
    return Status::PermissionDenied(Named(what, dir) + " (mode " + Mode(st.st_mode) +
                                    ") is writable by its group or others, who could replace what is in it; "
                                    "make it 0755 or choose another directory");
  }
  return Status::Ok();
}

}  // namespace

Status CheckTrustedDirectory(const std::filesystem::path& dir, std::string_view what) {
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0) return Status::Unavailable(Named(what, dir) + ": " + std::strerror(errno));
  return CheckOwnerAndMode(st, what, dir);
}

Status MakePrivateDirectory(const std::filesystem::path& given, std::string_view what) {
  // The directory's own name, without a trailing '/' (with it, the parent below would be the
  // directory itself, and open() would follow a link the name ends in).
  std::filesystem::path dir = given.lexically_normal();
  if (!dir.has_filename()) dir = dir.parent_path();
  if (dir.empty() || dir == dir.root_path() || dir.filename() == "." || dir.filename() == "..") {
    return Status::InvalidArgument(Named(what, given) + " does not name a directory of its own");
  }
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return Status::Unavailable(Named(what, dir) + " cannot be created: " + ec.message());
  const std::filesystem::path parent = std::filesystem::absolute(dir, ec).parent_path();
  if (ec) return Status::Unavailable(Named(what, dir) + ": " + ec.message());
  SPECACHE_RETURN_IF_ERROR(CheckTrustedDirectory(parent, std::string(what) + "'s parent"));
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ELOOP || errno == ENOTDIR) {
      struct stat link {};
      if (::lstat(dir.c_str(), &link) == 0 && S_ISLNK(link.st_mode)) {
        return Status::PermissionDenied(Named(what, dir) +
                                        " is a symbolic link: give the directory itself (its files are made private "
                                        "to the daemon, wherever the link points)");
      }
      return Status::FailedPrecondition(Named(what, dir) + " is not a directory");
    }
    return Status::Unavailable(Named(what, dir) + ": " + std::strerror(errno));
  }
  struct stat st {};
  Status s = ::fstat(fd, &st) == 0 ? Status::Ok() : Status::Unavailable(Named(what, dir) + ": " + std::strerror(errno));
  if (s.ok() && st.st_uid != ::geteuid()) {
    s = Status::PermissionDenied(Named(what, dir) + " belongs to user " + std::to_string(st.st_uid) +
                                 ", not the daemon's user " + std::to_string(::geteuid()) +
                                 ": its owner could read or replace the daemon's files; choose a directory of the "
                                 "daemon's");
  }
  if (s.ok() && ::fchmod(fd, 0700) != 0) {
    s = Status::Unavailable(Named(what, dir) + ": chmod 0700: " + std::strerror(errno));
  }
  // Its entries, through the descriptor of the directory checked above (not its path again).
  DIR* entries = s.ok() ? ::fdopendir(::dup(fd)) : nullptr;
  if (s.ok() && !entries) s = Status::Unavailable(Named(what, dir) + ": listing: " + std::strerror(errno));
  while (s.ok()) {
    errno = 0;
    const dirent* e = ::readdir(entries);
    if (!e) {
      if (errno != 0) s = Status::Unavailable(Named(what, dir) + ": listing: " + std::strerror(errno));
      break;
    }
    if (std::strcmp(e->d_name, ".") == 0 || std::strcmp(e->d_name, "..") == 0) continue;
    struct stat entry {};
    if (::fstatat(fd, e->d_name, &entry, AT_SYMLINK_NOFOLLOW) != 0) {
      if (errno == ENOENT) continue;  // gone meanwhile
      s = Status::Unavailable(Named(what, dir) + ": " + e->d_name + ": " + std::strerror(errno));
      break;
    }
    if (S_ISLNK(entry.st_mode)) continue;
    const mode_t mode = S_ISDIR(entry.st_mode) ? 0700 : 0600;
    if ((entry.st_mode & 07777) != mode && ::fchmodat(fd, e->d_name, mode, 0) != 0) {
      s = Status::Unavailable(Named(what, dir) + ": chmod " + e->d_name + ": " + std::strerror(errno));
    }
  }
  if (entries) ::closedir(entries);
  ::close(fd);
  return s;
}

}  // namespace specache
