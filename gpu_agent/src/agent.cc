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

namespace {
constexpr FetchOverlap kFetchOverlaps[] = {FetchOverlap::kFromSelection, FetchOverlap::kBesideNextAttention,
                                           FetchOverlap::kWithinNextAttention};
}  // namespace

std::vector<std::string> FetchOverlapNames() {
  std::vector<std::string> names;
  for (FetchOverlap o : kFetchOverlaps) names.emplace_back(FetchOverlapName(o));
  return names;
}

Result<FetchOverlap> ParseFetchOverlap(std::string_view name) {
  for (FetchOverlap o : kFetchOverlaps) {
    if (FetchOverlapName(o) == name) return o;
  }
  return Status::InvalidArgument("unknown fetch overlap '" + std::string(name) +
                                 "' (expected from-selection, beside-next-attention or within-next-attention)");
}

}  // namespace specache
