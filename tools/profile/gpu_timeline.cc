// The GPU's timeline of one profiled span, for the GPU machine (where Nsight Systems does not run):
// loaded with LD_PRELOAD into a program that calls cudaProfilerStart and cudaProfilerStop
// (specache-run bench --profile-step, specache-bench step --profile-step). Between the two, CUPTI
// records every kernel, copy and memset with its device start and end, stream and name (its
// activity API: the kernels keep running concurrently, as they would unprofiled). At exit it writes
// SPECACHE_TIMELINE_OUT (default gpu_timeline.csv): one line per record,
//   kind,stream,start_ns,end_ns,name
// tools/profile/gpu_timeline.py turns it into what the ncu sum cannot show: how long the GPU ran
// nothing (the span less the union of every record), each stream's busy time, and the longest gaps
// in which no kernel ran on any stream, with the records around them.
//
// The program's own cudaProfilerStart/Stop are replaced (nothing else profiles in such a run).
// Only the first start-stop span is recorded; with SPECACHE_TIMELINE_STOP=0 the span runs from the
// start to the exit instead (a profiled step and the measured steps after it, queued as they run
// unprofiled: the steady state, which a step profiled from an idle device does not show). Errors
// go to stderr; the program runs on regardless.
#include <cupti.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

namespace {

struct Record {
  char kind;  // K kernel, C copy, S memset
  uint32_t stream;
  uint64_t start, end;
  std::string name;
};

std::mutex mu;
std::vector<Record> records;
bool started = false, stopped = false;
size_t dropped = 0;

constexpr size_t kBufferBytes = 8 << 20;

void CUPTIAPI Requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBufferBytes));
  *size = *buffer ? kBufferBytes : 0;
  *max_records = 0;
}

const char* CopyName(uint8_t copy_kind) {
  switch (copy_kind) {
    case CUPTI_ACTIVITY_MEMCPY_KIND_HTOD: return "copy HtoD";
    case CUPTI_ACTIVITY_MEMCPY_KIND_DTOH: return "copy DtoH";
    case CUPTI_ACTIVITY_MEMCPY_KIND_DTOD: return "copy DtoD";
    default: return "copy other";
  }
}

void CUPTIAPI Completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  CUpti_Activity* a = nullptr;
  std::vector<Record> got;
  while (cuptiActivityGetNextRecord(buffer, valid, &a) == CUPTI_SUCCESS) {
    switch (a->kind) {
      case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL:
      case CUPTI_ACTIVITY_KIND_KERNEL: {
        const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(a);
        got.push_back({'K', k->streamId, k->start, k->end, k->name ? k->name : "?"});
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMCPY: {
        const auto* c = reinterpret_cast<const CUpti_ActivityMemcpy6*>(a);
        got.push_back({'C', c->streamId, c->start, c->end,
                       std::string(CopyName(c->copyKind)) + " " + std::to_string(c->bytes)});
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMSET: {
        const auto* m = reinterpret_cast<const CUpti_ActivityMemset4*>(a);
        got.push_back({'S', m->streamId, m->start, m->end, "memset " + std::to_string(m->bytes)});
        break;
      }
      default: break;
    }
  }
  size_t lost = 0;
  cuptiActivityGetNumDroppedRecords(nullptr, 0, &lost);
  std::free(buffer);
  std::lock_guard<std::mutex> lock(mu);
  dropped += lost;
  records.insert(records.end(), got.begin(), got.end());
}

bool Check(CUptiResult r, const char* what) {
  if (r == CUPTI_SUCCESS) return true;
  const char* text = nullptr;
  cuptiGetResultString(r, &text);
  std::fprintf(stderr, "gpu_timeline: %s: %s\n", what, text ? text : "?");
  return false;
}

// Names with commas or quotes would break the CSV's last field only if it were parsed naively:
// the reader splits on the first four commas.
void Write() {
  std::lock_guard<std::mutex> lock(mu);
  if (!started) return;  // never started: a process that only inherited LD_PRELOAD writes nothing
  const char* path = std::getenv("SPECACHE_TIMELINE_OUT");
  FILE* out = std::fopen(path ? path : "gpu_timeline.csv", "w");
  if (!out) {
    std::fprintf(stderr, "gpu_timeline: cannot write %s\n", path ? path : "gpu_timeline.csv");
    return;
  }
  std::fprintf(out, "kind,stream,start_ns,end_ns,name\n");
  for (const Record& r : records) {
    std::fprintf(out, "%c,%u,%llu,%llu,%s\n", r.kind, r.stream, static_cast<unsigned long long>(r.start),
                 static_cast<unsigned long long>(r.end), r.name.c_str());
  }
  std::fclose(out);
  std::fprintf(stderr, "gpu_timeline: %zu records to %s (%zu dropped by CUPTI)\n", records.size(),
               path ? path : "gpu_timeline.csv", dropped);
}

__attribute__((destructor)) void AtExit() {
  if (started && !stopped) cuptiActivityFlushAll(1);
  Write();
}

}  // namespace

extern "C" int cudaProfilerStart() {
  if (started) return 0;
  started = true;
  if (!Check(cuptiActivityRegisterCallbacks(Requested, Completed), "register callbacks")) return 0;
  Check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL), "enable kernels");
  Check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY), "enable copies");
  Check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMSET), "enable memsets");
  return 0;
}

extern "C" int cudaProfilerStop() {
  if (!started || stopped) return 0;
  const char* stop_env = std::getenv("SPECACHE_TIMELINE_STOP");
  if (stop_env != nullptr && std::strcmp(stop_env, "0") == 0) return 0;  // recorded to the exit
  stopped = true;
  Check(cuptiActivityFlushAll(1), "flush");
  cuptiActivityDisable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
  cuptiActivityDisable(CUPTI_ACTIVITY_KIND_MEMCPY);
  cuptiActivityDisable(CUPTI_ACTIVITY_KIND_MEMSET);
  return 0;
}
