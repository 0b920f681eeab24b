// KvMemory without the service: process memory only (builds without gRPC and friends).
#include "kv_memory.h"

#include "specache/in_memory_source.h"

namespace specache::run {
namespace {

class ProcessMemory final : public KvMemory {
 public:
  Result<std::unique_ptr<FullPrecisionSource>> NewSource() override {
    return std::unique_ptr<FullPrecisionSource>(std::make_unique<InMemorySource>());
  }
  nlohmann::json Figures() const override { return {{"kv_memory", "process"}}; }
  Result<uint64_t> KeepSequence(FullPrecisionSource*, SequenceId) override {
    return Status::FailedPrecondition("--keep-sequence needs a running specached (--daemon SOCKET)");
  }
};

}  // namespace

std::unique_ptr<KvMemory> MakeProcessMemory() { return std::make_unique<ProcessMemory>(); }

#ifndef SPECACHE_WITH_SERVICE
Result<std::unique_ptr<KvMemory>> KvMemory::Open(const KvMemoryOptions& o) {
  if (o.where != "process") {
    return Status::Unimplemented("this specache-run was built without the daemon client; use --kv-memory process");
  }
  return MakeProcessMemory();
}
#endif

}  // namespace specache::run
