#include "step_protocol.h"

#include <algorithm>
#include <set>
#include <string>

namespace specache {
namespace {
std::string Id(SequenceId id) { return std::to_string(id); }
}  // namespace

void AddFetchCounts(const FetchCounts& c, int64_t row_bytes, AgentStats* stats) {
  stats->rows_selected += c.selected;
  stats->rows_fetched += c.fetched;
  stats->rows_reused += c.reused;
  stats->bytes_fetched += c.fetched * row_bytes;
}

int32_t TopKCandidates(const KvConfig& config, bool appends, int32_t length, int32_t quantized_keys) {
  if (config.selects_for_this_step()) return quantized_keys;
  const bool flushes = appends && length - quantized_keys + 1 == config.residual_tokens;
  return quantized_keys + (flushes ? config.residual_tokens : 0);
}

Status StepProtocol::CheckRelease(SequenceId id) const {
  if (active_ && std::count(ids_.begin(), ids_.end(), id)) {
    return Status::FailedPrecondition("sequence " + Id(id) + " is part of the current step; EndStep or AbortStep first");
  }
  return Status::Ok();
}

Status StepProtocol::CheckLayer(int layer) const {
  if (layer < 0 || layer >= n_layers_) {
    return Status::OutOfRange("layer " + std::to_string(layer) + " outside [0, " + std::to_string(n_layers_) + ")");
  }
  return Status::Ok();
}

Status StepProtocol::CheckHead(int layer, int kv_head) const {
  SPECACHE_RETURN_IF_ERROR(CheckLayer(layer));
  if (kv_head < 0 || kv_head >= n_kv_heads_) {
    return Status::OutOfRange("kv head " + std::to_string(kv_head) + " outside [0, " + std::to_string(n_kv_heads_) + ")");
  }
  return Status::Ok();
}

Status StepProtocol::CheckPrefill(int layer, const PrefillBatch& batch, const LengthAt& length_at) const {
  SPECACHE_RETURN_IF_ERROR(CheckNoStep("PrefillLayer"));
  SPECACHE_RETURN_IF_ERROR(CheckLayer(layer));
  const size_t n_seq = batch.sequences.size();
  if (n_seq == 0) return Status::InvalidArgument("prefill batch has no sequences");
  if (batch.token_offsets.size() != n_seq + 1 || batch.token_offsets[0] != 0) {
    return Status::InvalidArgument("token_offsets must have sequences+1 entries starting at 0");
  }
  if (!batch.k || !batch.v) return Status::InvalidArgument("prefill batch has a null k or v");
  if (batch.out && !batch.q) return Status::InvalidArgument("prefill batch asks for attention (out) but has no q");
  if (seeds_ && !batch.q) {
    return Status::InvalidArgument("seed_rows: the prefill must give the prompt's queries (PrefillBatch::q)");
  }
  std::set<SequenceId> seen;
  for (size_t i = 0; i < n_seq; ++i) {
    const SequenceId id = batch.sequences[i];
    if (!fetch_.count(id)) return Status::NotFound("sequence " + Id(id) + " is not registered");
    if (!seen.insert(id).second) return Status::InvalidArgument("sequence " + Id(id) + " appears twice in the batch");
    if (batch.token_offsets[i + 1] <= batch.token_offsets[i]) {
      return Status::InvalidArgument("sequence " + Id(id) + " has no prompt tokens (offsets must increase)");
    }
    SPECACHE_ASSIGN_OR_RETURN(int32_t length, length_at(id, layer));
    if (length != 0) {
      return Status::FailedPrecondition("sequence " + Id(id) + " already holds tokens at layer " + std::to_string(layer) +
                                        "; prefill works on empty sequences");
    }
  }
  return Status::Ok();
}

Status StepProtocol::CheckNoStep(const char* call) const {
  if (active_) return Status::FailedPrecondition(std::string(call) + " inside a step; call EndStep first");
  return Status::Ok();
}

Status StepProtocol::Begin(StepKind kind, int rows, std::span<const SequenceId> ids, const LengthAt& length_at) {
  if (active_) return Status::FailedPrecondition("BeginStep while a step is active; call EndStep first");
  if (rows == 0) return Status::FailedPrecondition("mode " + std::string(KvModeName(mode_)) + " has no pre-decode step");
  if (ids.empty()) return Status::InvalidArgument("a step needs at least one sequence");
  std::set<SequenceId> seen;
  for (SequenceId id : ids) {
    if (!fetch_.count(id)) return Status::NotFound("sequence " + Id(id) + " is not registered");
    if (!seen.insert(id).second) return Status::InvalidArgument("sequence " + Id(id) + " appears twice in the step");
    SPECACHE_ASSIGN_OR_RETURN(int32_t length, length_at(id, 0));
    if (length == 0) return Status::FailedPrecondition("sequence " + Id(id) + " has not been prefilled");
    for (int l = 1; l < n_layers_; ++l) {
      SPECACHE_ASSIGN_OR_RETURN(int32_t at, length_at(id, l));
      if (at != length) {
        return Status::FailedPrecondition("sequence " + Id(id) + " has " + std::to_string(length) +
                                          " tokens at layer 0 but " + std::to_string(at) + " at layer " +
                                          std::to_string(l) + " (prefill every layer first)");
      }
    }
  }
  active_ = true;
  kind_ = kind;
  rows_ = rows;
  ids_.assign(ids.begin(), ids.end());
  step_fetch_.clear();
  for (SequenceId id : ids_) step_fetch_.push_back(&fetch_.at(id));
  decoded_.assign(n_layers_, 0);
  return Status::Ok();
}

Status StepProtocol::BeforeDecode(int layer) {
  if (!active_) return Status::FailedPrecondition("DecodeLayer outside a step; call BeginStep first");
  SPECACHE_RETURN_IF_ERROR(CheckLayer(layer));
  if (decoded_[layer]) return Status::FailedPrecondition("layer " + std::to_string(layer) + " was already decoded in this step");
  for (size_t i = 0; i < ids_.size(); ++i) {
    if ((*step_fetch_[i])[layer] == FetchState::kSelected) {
      return Status::FailedPrecondition("layer " + std::to_string(layer) + " of sequence " + Id(ids_[i]) +
                                        " has rows selected but StartPrefetch was never called for them");
    }
  }
  for (std::vector<FetchState>* states : step_fetch_) {
    FetchState& f = (*states)[layer];
    if (f == FetchState::kInFlight) f = FetchState::kResident;  // DecodeLayer waits for its own fetch
  }
  return Status::Ok();
}

void StepProtocol::AfterDecode(int layer) {
  decoded_[layer] = 1;
  if (mode_ == KvMode::kSpeCache) {
    for (std::vector<FetchState>* states : step_fetch_) (*states)[layer] = FetchState::kSelected;
  }
}

Result<std::vector<size_t>> StepProtocol::PrefetchList(int layer) const {
  if (!active_) return Status::FailedPrecondition("StartPrefetch outside a step");
  SPECACHE_RETURN_IF_ERROR(CheckLayer(layer));
  if (!decoded_[layer]) {
    return Status::FailedPrecondition("StartPrefetch(" + std::to_string(layer) + ") before DecodeLayer(" +
                                      std::to_string(layer) + ") in this step");
  }
  std::vector<size_t> which;
  if (mode_ != KvMode::kSpeCache) return which;
  for (size_t i = 0; i < ids_.size(); ++i) {
    if ((*step_fetch_[i])[layer] == FetchState::kSelected) which.push_back(i);
  }
  return which;
}

void StepProtocol::PrefetchStarted(int layer, const std::vector<size_t>& which) {
  for (size_t i : which) (*step_fetch_[i])[layer] = FetchState::kInFlight;
}

void StepProtocol::Wait(int layer) {
  for (auto& [id, f] : fetch_) {
    if (f[layer] == FetchState::kInFlight) f[layer] = FetchState::kResident;
  }
}

Result<bool> StepProtocol::End() {
  if (!active_) return Status::FailedPrecondition("EndStep without BeginStep");
  for (int l = 0; l < n_layers_; ++l) {
    if (!decoded_[l]) return Status::FailedPrecondition("EndStep before DecodeLayer(" + std::to_string(l) + ")");
    for (const std::vector<FetchState>* states : step_fetch_) {
      if ((*states)[l] == FetchState::kSelected) {
        return Status::FailedPrecondition("EndStep before StartPrefetch(" + std::to_string(l) + ")");
      }
    }
  }
  active_ = false;
  ids_.clear();
  step_fetch_.clear();
  return kind_ == StepKind::kDecode;
}

void StepProtocol::Abort() {
  for (std::vector<FetchState>* states : step_fetch_) {
    for (FetchState& f : *states) {
      // A selection that was never fetched is dropped; the rows resident before it stay usable.
      if (f == FetchState::kSelected) f = FetchState::kResident;
    }
  }
  active_ = false;
  ids_.clear();
  step_fetch_.clear();
}

void StepProtocol::ReleaseAllIn(FullPrecisionSource* source) const {
  for (const auto& [id, unused] : fetch_) {
    const StatusCode code = source->ReleaseSequence(id).code();
    if (code == StatusCode::kUnavailable || code == StatusCode::kDeadlineExceeded) return;
  }
}

}  // namespace specache
