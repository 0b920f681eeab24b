// Runs fn(item, thread) for item in [0, n) on the CPU backend's threads. OpenMP when the build has
// it (dynamic schedule: items are (sequence, head) pairs of very different lengths), else serial.
// And how many cores a thread may run on (UsableCores), which sizes such thread counts.
#pragma once

#ifdef __linux__
#include <sched.h>
#endif

#include <thread>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace specache {

// The cores the calling thread may run on (its CPU affinity, which taskset and cgroup cpusets
// narrow; a CPU quota is not seen), else std::thread::hardware_concurrency; 0 when neither is known.
inline int UsableCores() {
#ifdef __linux__
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return CPU_COUNT(&set);
#endif
  return static_cast<int>(std::thread::hardware_concurrency());
}

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
