#include "specache/agent.h"

namespace specache {

int Agent::RowsPerSequence(StepKind kind) const {
  const KvMode mode = config().mode;
  if (kind == StepKind::kPreDecode) return mode == KvMode::kSpeCache ? 1 : 0;
  return mode == KvMode::kSpeCache ? 2 : 1;
}

std::string_view FetchOverlapName(FetchOverlap overlap) {
  switch (overlap) {
    case FetchOverlap::kFromSelection: return "from-selection";
    case FetchOverlap::kBesideNextAttention: return "beside-next-attention";
    case FetchOverlap::kWithinNextAttention: return "within-next-attention";
  }
  return "?";
}

Result<FetchOverlap> ParseFetchOverlap(std::string_view name) {
  for (FetchOverlap o :
       {FetchOverlap::kFromSelection, FetchOverlap::kBesideNextAttention, FetchOverlap::kWithinNextAttention}) {
    if (FetchOverlapName(o) == name) return o;
  }
  return Status::InvalidArgument("unknown fetch overlap '" + std::string(name) +
                                 "' (expected from-selection, beside-next-attention or within-next-attention)");
}

}  // namespace specache
