// Output paths checked before a command works: a long run must not compute for minutes and then
// lose its results because the directory it writes to is missing or not writable.
#pragma once

#include <string>

#include "specache/status.h"

namespace specache {

// Makes `dir` usable for new files: creates it and any missing parents (mode 0777 less the
// umask, as mkdir -p does), then proves it writable by creating and removing a file in it.
// PERMISSION_DENIED or FAILED_PRECONDITION (not a directory, read-only file system) name the
// directory and the reason; the caller stops before doing any work.
Status PrepareOutputDir(const std::string& dir);

// Makes `path` writable as a file: its directory as PrepareOutputDir; an existing file must be a
// regular file this process may open for writing (it is not truncated or changed here).
Status PrepareOutputFile(const std::string& path);

}  // namespace specache
