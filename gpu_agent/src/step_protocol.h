// The call protocol every agent backend follows (agent.h): which call may come when, each
// (sequence, layer)'s fetch state (selected -> in flight -> resident), and the specific
// FAILED_PRECONDITION messages for calls out of order. The backends keep their storage; this
// class keeps the order.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <unordered_map>
#include <vector>

#include "specache/agent.h"

namespace specache {

enum class FetchState {
  kNone,      // nothing selected yet
  kSelected,  // DecodeLayer chose rows; StartPrefetch not called yet
  kInFlight,  // StartPrefetch called; WaitPrefetch (or the next DecodeLayer) not yet
  kResident,  // the selected rows are resident
};

// Rows fetched for one (sequence, layer, head) or a whole call, and their bookkeeping in the stats.
struct FetchCounts {
  int64_t selected = 0;
  int64_t fetched = 0;
  int64_t reused = 0;
};
// row_bytes: of a row as the source stores it (HostRowBytes), what a fetched row moves.
void AddFetchCounts(const FetchCounts& counts, int64_t row_bytes, AgentStats* stats);

// How many leading tokens compete in a head's top-k this step. The next step's candidates are the
// tokens quantized by then: if this step's append fills the key residual (`appends` and one token
// short of R), its R tokens (the real token included) are quantized right after this attention,
// so they compete too; their rows were never fetched and would otherwise be seen only in low bits
// until selected at a later step. The non-speculative mode selects for this step: quantized keys.
int32_t TopKCandidates(const KvConfig& config, bool appends, int32_t length, int32_t quantized_keys);

// A sequence's tokens at a layer (NOT_FOUND for unknown ids), as a backend stores them.
using LengthAt = std::function<Result<int32_t>(SequenceId, int)>;

class StepProtocol {
 public:
  StepProtocol(const ModelShape& shape, const KvConfig& config)
      : n_layers_(shape.n_layers), n_kv_heads_(shape.n_kv_heads), mode_(config.mode), seeds_(config.seed_rows > 0) {}

  void AddSequence(SequenceId id) { fetch_[id].assign(n_layers_, FetchState::kNone); }
  // FAILED_PRECONDITION while the sequence is part of the current step.
  Status CheckRelease(SequenceId id) const;
  void RemoveSequence(SequenceId id) { fetch_.erase(id); }

  Status CheckLayer(int layer) const;
  Status CheckHead(int layer, int kv_head) const;
  // What an agent's destructor does with the sequences it still holds (added, not yet removed;
  // the protocol's own record of them is left as it is): each released in `source`,
  // best effort (one refused stays there), until an answer says the source cannot be reached
  // (UNAVAILABLE, DEADLINE_EXCEEDED: a daemon gone or cut off): the rest are left to the source's
  // own teardown, not each waited out to its deadline.
  void ReleaseAllIn(FullPrecisionSource* source) const;
  // PrefillLayer's preconditions: no step, a valid layer, a well-formed batch of distinct, registered
  // sequences that hold no token yet at this layer, with q where the row cache is seeded
  // (KvConfig::seed_rows).
  Status CheckPrefill(int layer, const PrefillBatch& batch, const LengthAt& length_at) const;
  // FAILED_PRECONDITION naming `call` when a step is active.
  Status CheckNoStep(const char* call) const;

  // Starts a step of `rows` rows per sequence. `length_at(id, layer)` gives a sequence's tokens at a
  // layer (NOT_FOUND for unknown ids); every layer must hold the same, non-zero length.
  Status Begin(StepKind kind, int rows, std::span<const SequenceId> ids, const LengthAt& length_at);
  // Before DecodeLayer's work: the step is active, the layer valid and not yet decoded, and no
  // selection is waiting for its StartPrefetch. A fetch in flight counts as resident from here on.
  Status BeforeDecode(int layer);
  // After DecodeLayer's work: in specache mode, the layer's new selection waits for StartPrefetch.
  void AfterDecode(int layer);
  // StartPrefetch: indices (into ids()) of the sequences whose selection must be fetched now
  // (empty outside specache mode). FAILED_PRECONDITION before the layer's DecodeLayer.
  Result<std::vector<size_t>> PrefetchList(int layer) const;
  void PrefetchStarted(int layer, const std::vector<size_t>& which);
  void Wait(int layer);
  // Ends the step; true when it was a decode step (for the step count).
  Result<bool> End();
  void Abort();

  bool active() const { return active_; }
  StepKind kind() const { return kind_; }
  int rows() const { return rows_; }
  const std::vector<SequenceId>& ids() const { return ids_; }

 private:
  int n_layers_;
  int n_kv_heads_;
  KvMode mode_;
  bool seeds_;  // KvConfig::seed_rows > 0: a prefill needs the prompt's queries
  std::unordered_map<SequenceId, std::vector<FetchState>> fetch_;  // [layer] per sequence
  bool active_ = false;
  StepKind kind_ = StepKind::kDecode;
  int rows_ = 0;
  std::vector<SequenceId> ids_;
  // fetch_'s entry of each ids_[i], found once at Begin: the layer calls read and set the step's
  // states without a lookup per sequence (a sequence cannot be removed during its step).
  std::vector<std::vector<FetchState>*> step_fetch_;
  std::vector<uint8_t> decoded_;  // [layer]
};

}  // namespace specache
