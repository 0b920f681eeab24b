// Runs fn(item, thread) for item in [0, n) on the CPU backend's threads. OpenMP when the build has
// it (dynamic schedule: items are (sequence, head) pairs of very different lengths), else serial.
#pragma once

#ifdef _OPENMP
#include <omp.h>
#endif

namespace specache {

template <typename Fn>
void ParallelFor(int n, Fn&& fn) {
#ifdef _OPENMP
#pragma omp parallel for schedule(dynamic, 1) if (n > 1)
  for (int i = 0; i < n; ++i) fn(i, omp_get_thread_num());
#else
  for (int i = 0; i < n; ++i) fn(i, 0);
#endif
}

// The same on at most `threads` threads (a thread count the caller chose: the CUDA agent's
// copy-engine gather, beside the engine's own threads).
template <typename Fn>
void ParallelFor(int n, int threads, Fn&& fn) {
#ifdef _OPENMP
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (n > 1 && threads > 1)
  for (int i = 0; i < n; ++i) fn(i, omp_get_thread_num());
#else
  (void)threads;
  for (int i = 0; i < n; ++i) fn(i, 0);
#endif
}

}  // namespace specache
