// How a batch of `count` items whose launches take at most `max_per_launch` each splits into
// launches of equal size: 792 top-k segments at 640 per launch run as 396 + 396, not 640 + 152,
// whose small second launch would fill the GPU poorly.
#pragma once

namespace specache::cuda {

// Items per launch (the last launch takes what is left); 0 when count is 0.
inline int EqualLaunchSize(int count, int max_per_launch) {
  const int launches = (count + max_per_launch - 1) / max_per_launch;
  return launches > 0 ? (count + launches - 1) / launches : 0;
}

}  // namespace specache::cuda
