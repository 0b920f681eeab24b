// How a batch of `count` items whose launches take at most `max_per_launch` each splits into
// launches of equal size, so that no small last launch fills the GPU poorly: the top-k's sets of
// segments (at most kMaxTopKSegments, the grid's rows), 65544 segments as 32772 + 32772.
#pragma once

namespace specache::cuda {

// Items per launch (the last launch takes what is left); 0 when count is 0.
inline int EqualLaunchSize(int count, int max_per_launch) {
  const int launches = (count + max_per_launch - 1) / max_per_launch;
  return launches > 0 ? (count + launches - 1) / launches : 0;
}

}  // namespace specache::cuda
