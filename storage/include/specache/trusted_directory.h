// Directories whose contents the daemon trusts: its sockets' directories (daemon/unix_listener.h)
// and the spill store's (spill_store.h). Whoever may write a directory may replace what is in it
// (a socket, a lock file, a spilled page) with their own, so a directory is trusted only when no
// one but root or the daemon's user can change its entries.
#pragma once

#include <filesystem>
#include <string_view>

#include "specache/status.h"

namespace specache {

// OK when `dir` (followed through symbolic links) is a directory owned by root or by this
// process's effective user and is not writable by its group or by others, unless sticky (as
// /tmp: others may add entries but not replace this user's). `what` names the directory in the
// errors: UNAVAILABLE when it cannot be examined, FAILED_PRECONDITION when it is not a directory,
// PERMISSION_DENIED (saying who could write it) otherwise.
Status CheckTrustedDirectory(const std::filesystem::path& dir, std::string_view what);

// The directory `dir` made private to this process's user (for data of the daemon's own): created
// with its missing parents, then required to be a real directory, not a symbolic link, owned by
// the effective user, inside a trusted parent (CheckTrustedDirectory), and set to mode 0700.
// Entries already in it (a store made before its files were private, or by hand) become 0600 for
// files and 0700 for directories; symbolic links in it are left alone, never followed.
Status MakePrivateDirectory(const std::filesystem::path& dir, std::string_view what);

}  // namespace specache
