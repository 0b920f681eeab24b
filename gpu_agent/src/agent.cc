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

std::string_view FetchViaName(FetchVia via) {
  switch (via) {
    case FetchVia::kSmLoads: return "sm-loads";
    case FetchVia::kCopyEngine: return "copy-engine";
  }
  return "?";
}

std::vector<std::string> FetchViaNames() {
  return {std::string(FetchViaName(FetchVia::kSmLoads)), std::string(FetchViaName(FetchVia::kCopyEngine))};
}

Result<FetchVia> ParseFetchVia(std::string_view name) {
  for (FetchVia v : {FetchVia::kSmLoads, FetchVia::kCopyEngine}) {
    if (FetchViaName(v) == name) return v;
  }
  return Status::InvalidArgument("unknown fetch route '" + std::string(name) + "' (expected sm-loads or copy-engine)");
}

}  // namespace specache
