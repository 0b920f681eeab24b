#include "malloc_tuning.h"

#include <malloc.h>

namespace specache::daemon {

void LimitMallocRetention() {
  // Blocks of 128 KiB and more (pages of parked sequences are 8 KiB to 1 MiB each, whole
  // sequences far more) are mmapped and unmapped on free, whatever was freed before.
  mallopt(M_MMAP_THRESHOLD, 128 * 1024);
  // The control plane's threads allocate small, short-lived blocks: two arenas are enough for
  // them, and bound how much free memory the arenas keep.
  mallopt(M_ARENA_MAX, 2);
}

}  // namespace specache::daemon
