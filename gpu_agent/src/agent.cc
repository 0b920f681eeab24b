#include "specache/agent.h"

namespace specache {

int Agent::RowsPerSequence(StepKind kind) const {
  const KvMode mode = config().mode;
  if (kind == StepKind::kPreDecode) return mode == KvMode::kSpeCache ? 1 : 0;
  return mode == KvMode::kSpeCache ? 2 : 1;
}

}  // namespace specache
