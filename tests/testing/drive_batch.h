// An engine's calls into an agent, without a model: for tests that compare the agent's backends.
#pragma once

#include <functional>
#include <random>
#include <vector>

#include "specache/agent.h"
#include "specache/status.h"

namespace specache::testing {

// Adds one sequence per prompt (ids 10, 11, ...) to the agent: `ids` gets them, `offsets` each
// prompt's first row in the batch's concatenated rows, then the total.
inline Status AddSequences(Agent* agent, const std::vector<int32_t>& prompts, std::vector<SequenceId>* ids,
                           std::vector<int32_t>* offsets) {
  ids->clear();
  offsets->assign(1, 0);
  for (size_t s = 0; s < prompts.size(); ++s) {
    ids->push_back(static_cast<SequenceId>(10 + s));
    offsets->push_back(offsets->back() + prompts[s]);
    SPECACHE_RETURN_IF_ERROR(agent->AddSequence(ids->back()));
  }
  return Status::Ok();
}

// Drives an agent through prefill and `steps` decode steps of several sequences at once with
// given random rows (no model): what the engine would hand it. Returns every output, in order.
// `between` (optional) runs after the prefill, before the first step: another engine's business
// on the same agent, which must not change these sequences' outputs. `edit_queries` (optional)
// may change a decode step's query rows ([rows of the batch][n_q_heads][head_dim], as DecodeLayer
// takes them) after they are drawn, before the layer runs: step -1 is the pre-decode step.
inline Result<std::vector<float>> DriveBatch(Agent* agent, const std::vector<int32_t>& prompts, int steps, std::mt19937 rng,
                                             const std::function<Status()>& between = {},
                                             const std::function<void(int step, int layer, std::vector<float>* q)>&
                                                 edit_queries = {}) {
  const ModelShape& m = agent->shape();
  std::vector<SequenceId> ids;
  std::vector<int32_t> offsets;
  SPECACHE_RETURN_IF_ERROR(AddSequences(agent, prompts, &ids, &offsets));
  auto random = [&rng](size_t n, float scale) {
    std::normal_distribution<float> normal(0.0f, scale);
    std::vector<float> v(n);
    for (float& x : v) x = normal(rng);
    return v;
  };
  std::vector<float> outputs;
  const size_t total = static_cast<size_t>(offsets.back());
  for (int l = 0; l < m.n_layers; ++l) {
    const auto q = random(total * m.n_q_heads * m.head_dim, 1.0f), k = random(total * m.n_kv_heads * m.head_dim, 2.0f),
               v = random(total * m.n_kv_heads * m.head_dim, 1.0f);
    PrefillBatch batch{ids, offsets, q.data(), k.data(), v.data(), nullptr};
    SPECACHE_RETURN_IF_ERROR(agent->PrefillLayer(l, batch));
  }
  if (between) SPECACHE_RETURN_IF_ERROR(between());
  for (int step = -1; step < steps; ++step) {
    const StepKind kind = step < 0 ? StepKind::kPreDecode : StepKind::kDecode;
    const int rows = agent->RowsPerSequence(kind);
    if (rows == 0) continue;
    SPECACHE_RETURN_IF_ERROR(agent->BeginStep(kind, ids));
    const size_t n = ids.size() * rows;
    for (int l = 0; l < m.n_layers; ++l) {
      auto q = random(n * m.n_q_heads * m.head_dim, 1.0f);
      const auto k = random(n * m.n_kv_heads * m.head_dim, 2.0f), v = random(n * m.n_kv_heads * m.head_dim, 1.0f);
      if (edit_queries) edit_queries(step, l, &q);
      std::vector<float> out(n * m.n_q_heads * m.head_dim);
      SPECACHE_RETURN_IF_ERROR(agent->DecodeLayer(l, {q.data(), k.data(), v.data(), out.data()}));
      SPECACHE_RETURN_IF_ERROR(agent->StartPrefetch(l));
      outputs.insert(outputs.end(), out.begin(), out.end());
    }
    SPECACHE_RETURN_IF_ERROR(agent->EndStep());
  }
  return outputs;
}

// One decode step of the sequences with random rows (as DriveBatch's steps). The first error ends
// it: the step is then aborted (and, per agent.h, its sequences must be released by the caller).
inline Status DecodeStepWithRandomRows(Agent* agent, const std::vector<SequenceId>& ids, std::mt19937* rng) {
  const ModelShape& m = agent->shape();
  SPECACHE_RETURN_IF_ERROR(agent->BeginStep(StepKind::kDecode, ids));
  std::normal_distribution<float> normal;
  const size_t n = ids.size() * agent->RowsPerSequence(StepKind::kDecode);
  for (int l = 0; l < m.n_layers; ++l) {
    std::vector<float> q(n * m.n_q_heads * m.head_dim), k(n * m.n_kv_heads * m.head_dim), v(k.size()), out(q.size());
    for (float& x : q) x = normal(*rng);
    for (float& x : k) x = 2 * normal(*rng);
    for (float& x : v) x = normal(*rng);
    Status s = agent->DecodeLayer(l, {q.data(), k.data(), v.data(), out.data()});
    if (s.ok()) s = agent->StartPrefetch(l);
    if (!s.ok()) {
      agent->AbortStep();
      return s;
    }
  }
  return agent->EndStep();
}

}  // namespace specache::testing
