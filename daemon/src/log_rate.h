// How the daemon logs an event that may repeat without bound (a refused connection, a hostile
// client's requests, an accept storm): every occurrence is counted, and only some are logged.
#pragma once

#include <cstdint>

namespace specache::daemon {

// Whether the occurrence numbered `count` (from 1: this one included) is logged: the 1st, 2nd,
// 4th, 8th... so that a flood does not flood the log and its growth still shows.
inline bool LoggedOccurrence(uint64_t count) { return (count & (count - 1)) == 0; }

}  // namespace specache::daemon
