#include "output_paths.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <system_error>

namespace specache {
namespace {

Status FromErrno(int err, const std::string& what) {
  const std::string msg = what + ": " + std::strerror(err);
  switch (err) {
    case EACCES:
    case EPERM:
      return Status::PermissionDenied(msg);
    case ENOENT:
      return Status::NotFound(msg);
    default:
      return Status::FailedPrecondition(msg);
  }
}

}  // namespace

Status PrepareOutputDir(const std::string& dir) {
  const std::string d = dir.empty() ? "." : dir;
  std::error_code ec;
  std::filesystem::create_directories(d, ec);  // no-op when it exists
  if (ec) return FromErrno(ec.value(), "cannot create output directory " + d);
  struct stat st {};
  if (stat(d.c_str(), &st) != 0) return FromErrno(errno, "cannot use output directory " + d);
  if (!S_ISDIR(st.st_mode)) return Status::FailedPrecondition("output path " + d + " is not a directory");
  // access(W_OK) says yes to root on a read-only mount and knows nothing of ACLs or quotas, so
  // the check is a real file, created exclusively and removed at once.
  std::string probe = d + "/.specache-write-check-XXXXXX";
  const int fd = mkstemp(probe.data());
  if (fd < 0) return FromErrno(errno, "cannot write in output directory " + d);
  close(fd);
  unlink(probe.c_str());
  return Status::Ok();
}

Status PrepareOutputFile(const std::string& path) {
  if (path.empty()) return Status::InvalidArgument("empty output file name");
  const std::filesystem::path p(path);
  const std::string parent = p.has_parent_path() ? p.parent_path().string() : ".";
  SPECACHE_RETURN_IF_ERROR(PrepareOutputDir(parent));
  struct stat st {};
  if (stat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return Status::Ok();  // the directory takes new files
    return FromErrno(errno, "cannot use output file " + path);
  }
  if (S_ISDIR(st.st_mode)) return Status::FailedPrecondition("output file " + path + " is a directory");
  if (S_ISREG(st.st_mode)) {
    const int fd = open(path.c_str(), O_WRONLY | O_CLOEXEC);  // no O_TRUNC: nothing changes yet
    if (fd < 0) return FromErrno(errno, "cannot write output file " + path);
    close(fd);
  }
  return Status::Ok();  // a device or a pipe (/dev/stdout): written as it is
}

}  // namespace specache
