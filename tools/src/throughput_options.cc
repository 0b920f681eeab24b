// specache-run bench's option checks, host-only: a build without CUDA reports a malformed option
// as a build with one does, before saying the bench needs a GPU.
#include <sstream>
#include <string>

#include "run_support.h"
#include "throughput_bench.h"

namespace specache::run {

std::string BaseMode(const std::string& mode) { return mode.substr(0, mode.find('/')); }

Result<KvConfig> OptionedModeConfig(const ThroughputOptions& o, const std::string& mode) {
  KvOptions kv;
  kv.bits = o.bits;
  kv.group = o.group;
  kv.residual = o.residual;
  kv.topk = o.topk;
  return ToConfig(kv, mode);
}

Result<PrefillShape> CheckThroughputOptions(const ThroughputOptions& o) {
  PrefillShape prefill;
  if (!o.prefill.empty()) {
    char x = 0;
    std::istringstream spec(o.prefill);
    if (!(spec >> prefill.batch >> x >> prefill.tokens) || x != 'x' || prefill.batch < 1 || prefill.tokens < 1 ||
        !spec.eof()) {
      return Status::InvalidArgument("--prefill is BxT, e.g. 8x8192, not '" + o.prefill + "'");
    }
  }
  for (const std::string& m : o.modes) {
    const std::string base = BaseMode(m);
    if (base != "fp16" && base != "kivi" && base != "specache" && base != "specache-nonspec" && base != "full-offload") {
      return Status::InvalidArgument("--kv is fp16, kivi, specache, specache-nonspec or full-offload, not '" + m + "'");
    }
    if (base != m) {
      if (base != "specache" && base != "specache-nonspec") {
        return Status::InvalidArgument("--kv '" + m + "': selection options apply to specache and specache-nonspec");
      }
      SPECACHE_RETURN_IF_ERROR(OptionedModeConfig(o, m).status().WithContext("--kv '" + m + "'"));
    }
  }
  if (o.shape != "llama3-8b" && o.shape != "smollm2") {
    return Status::InvalidArgument("--shape is llama3-8b or smollm2, not '" + o.shape + "'");
  }
  return prefill;
}

}  // namespace specache::run
