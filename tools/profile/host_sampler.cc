// A sampling profiler of one host thread's stacks, by wall clock, for the GPU machine (which has
// no perf): loaded with LD_PRELOAD into a program that calls cudaProfilerStart (specache-run
// bench --profile-step, specache-bench step --profile-step). From that call on, the calling
// thread is interrupted every SPECACHE_SAMPLE_US microseconds (default 200) of wall time, waits
// included (a thread blocked in a CUDA synchronisation is sampled inside it), and its return
// addresses are kept; with SPECACHE_SAMPLE_STOP=1 cudaProfilerStop ends the sampling (one profiled
// step), otherwise it runs to the exit (the profiled step and the measured steps after it). At
// exit it writes SPECACHE_SAMPLE_OUT (default host_samples.txt): the process's memory map, then
// a line per sample: the thread's CPU time and the wall time at the sample (c<ns> w<ns>), then its
// return addresses; the CPU time tells a thread that ran from one blocked in a lock or a wait.
// tools/profile/host_profile.py turns that into the functions
// where the thread spent its time, with the unstripped binaries of the build.
//
// The program's own cudaProfilerStart/Stop are replaced (nothing else profiles in such a run).
#include <execinfo.h>
#include <signal.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace {

constexpr int kDepth = 48;
constexpr int kMaxSamples = 400000;  // 80 s at 200 us
struct Sample {
  int64_t cpu_ns;   // the sampled thread's CPU time (the handler runs on that thread)
  int64_t wall_ns;  // CLOCK_MONOTONIC
  int depth;
  void* pc[kDepth];
};
Sample* samples = nullptr;
std::atomic<int> taken{0};
timer_t timer;
bool timer_made = false;

void OnTick(int, siginfo_t*, void*) {
  const int i = taken.load(std::memory_order_relaxed);
  if (i >= kMaxSamples) return;
  timespec cpu{}, wall{};  // clock_gettime is async-signal-safe
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &cpu);
  clock_gettime(CLOCK_MONOTONIC, &wall);
  samples[i].cpu_ns = int64_t{cpu.tv_sec} * 1000000000 + cpu.tv_nsec;
  samples[i].wall_ns = int64_t{wall.tv_sec} * 1000000000 + wall.tv_nsec;
  samples[i].depth = backtrace(samples[i].pc, kDepth);
  taken.store(i + 1, std::memory_order_release);
}

void Stop() {
  if (!timer_made) return;
  timer_delete(timer);
  timer_made = false;
}

__attribute__((constructor)) void Init() {
  samples = static_cast<Sample*>(std::calloc(kMaxSamples, sizeof(Sample)));
  void* warm[4];
  backtrace(warm, 4);  // loads the unwinder now, not inside the signal handler
  struct sigaction sa;
  std::memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = OnTick;
  sa.sa_flags = SA_SIGINFO | SA_RESTART;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGPROF, &sa, nullptr);
}

__attribute__((destructor)) void Write() {
  Stop();
  const int n = taken.load(std::memory_order_acquire);
  if (n == 0) return;  // never started: a process that only inherited LD_PRELOAD (a wrapper) writes nothing
  const char* path = std::getenv("SPECACHE_SAMPLE_OUT");
  FILE* out = std::fopen(path ? path : "host_samples.txt", "w");
  if (!out) return;
  if (FILE* maps = std::fopen("/proc/self/maps", "r")) {
    char line[4096];
    while (std::fgets(line, sizeof line, maps)) std::fprintf(out, "map %s", line);
    std::fclose(maps);
  }
  for (int i = 0; i < n; ++i) {
    std::fprintf(out, "s c%lld w%lld", static_cast<long long>(samples[i].cpu_ns),
                 static_cast<long long>(samples[i].wall_ns));
    // Frame 0 is the handler, frame 1 the signal trampoline.
    for (int f = 2; f < samples[i].depth; ++f) std::fprintf(out, " %p", samples[i].pc[f]);
    std::fprintf(out, "\n");
  }
  std::fclose(out);
  std::fprintf(stderr, "host_sampler: %d samples to %s\n", n, path ? path : "host_samples.txt");
}

}  // namespace

extern "C" int cudaProfilerStart() {
  if (timer_made) return 0;
  const char* us_env = std::getenv("SPECACHE_SAMPLE_US");
  const long us = us_env ? std::atol(us_env) : 200;
  struct sigevent sev;
  std::memset(&sev, 0, sizeof sev);
  sev.sigev_notify = SIGEV_THREAD_ID;
  sev.sigev_signo = SIGPROF;
  sev._sigev_un._tid = static_cast<pid_t>(syscall(SYS_gettid));
  if (timer_create(CLOCK_MONOTONIC, &sev, &timer) != 0) return 0;
  timer_made = true;
  struct itimerspec spec;
  spec.it_interval.tv_sec = us / 1000000;
  spec.it_interval.tv_nsec = (us % 1000000) * 1000;
  spec.it_value = spec.it_interval;
  timer_settime(timer, 0, &spec, nullptr);
  return 0;
}

extern "C" int cudaProfilerStop() {
  const char* stop = std::getenv("SPECACHE_SAMPLE_STOP");
  if (stop && std::strcmp(stop, "1") == 0) Stop();
  return 0;
}
