// How the daemon's heap gives memory back. glibc raises its mmap threshold each time a large
// block is freed (up to 32 MiB), so after the first parked sequence, WriteBatch or restore buffer
// is freed, the next ones come from the heap arenas (one per thread, up to 8 per core) and stay
// there as free but resident memory: a soak of 8 clients grew the daemon's anonymous memory from
// 3 to 130 MiB, none of it in use. A fixed threshold keeps large blocks in mmap (returned to the
// kernel when freed) and two arenas bound what small blocks can strand.
#pragma once

namespace specache::daemon {

// Call first thing in main(), before any thread starts.
void LimitMallocRetention();

}  // namespace specache::daemon
