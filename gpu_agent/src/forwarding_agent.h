// An Agent that passes every call to another one, for wrappers that change a few of them: derive,
// override those, and call ForwardingAgent's for the rest. Does not own the inner agent.
#pragma once

#include <span>
#include <string_view>
#include <vector>

#include "specache/agent.h"

namespace specache {

class ForwardingAgent : public Agent {
 public:
  explicit ForwardingAgent(Agent* inner) : inner_(inner) {}

  const ModelShape& shape() const override { return inner_->shape(); }
  const KvConfig& config() const override { return inner_->config(); }
  std::string_view backend_name() const override { return inner_->backend_name(); }
  Status AddSequence(SequenceId id) override { return inner_->AddSequence(id); }
  Status ReleaseSequence(SequenceId id) override { return inner_->ReleaseSequence(id); }
  Result<int32_t> SequenceLength(SequenceId id) const override { return inner_->SequenceLength(id); }
  Status PrefillLayer(int layer, const PrefillBatch& batch) override { return inner_->PrefillLayer(layer, batch); }
  Status BeginStep(StepKind kind, std::span<const SequenceId> sequences) override {
    return inner_->BeginStep(kind, sequences);
  }
  Status DecodeLayer(int layer, const DecodeRows& rows) override { return inner_->DecodeLayer(layer, rows); }
  Status StartPrefetch(int layer) override { return inner_->StartPrefetch(layer); }
  Status WaitPrefetch(int layer) override { return inner_->WaitPrefetch(layer); }
  Status EndStep() override { return inner_->EndStep(); }
  void AbortStep() override { inner_->AbortStep(); }
  Result<std::vector<int32_t>> SelectedTokens(SequenceId id, int layer, int kv_head) const override {
    return inner_->SelectedTokens(id, layer, kv_head);
  }
  AgentStats stats() const override { return inner_->stats(); }

 private:
  Agent* inner_;
};

}  // namespace specache
