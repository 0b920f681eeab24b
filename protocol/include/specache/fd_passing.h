// Sending and receiving file descriptors with a message over a Unix stream socket (SCM_RIGHTS).
#pragma once

#include <cstddef>
#include <span>
#include <vector>

#include "specache/status.h"

namespace specache {

// Sends all n bytes; the descriptors ride on the first byte. Blocks; on a non-blocking socket
// (the daemon's, under Boost.Asio) waits for room, DEADLINE_EXCEEDED when the peer has read
// nothing for kSendWaitMs.
inline constexpr int kSendWaitMs = 5000;
Status SendWithFds(int socket, const void* data, size_t n, std::span<const int> fds);

// Receives exactly n bytes (waiting at most timeout_ms in total; -1: forever) and any descriptors
// that came with them (appended to *fds, owned by the caller; extra control data is closed).
// UNAVAILABLE when the peer closed, DEADLINE_EXCEEDED on timeout.
Status RecvWithFds(int socket, void* data, size_t n, std::vector<int>* fds, int timeout_ms);

}  // namespace specache
