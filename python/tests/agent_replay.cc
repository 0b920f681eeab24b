// specache-agent-replay: runs the CPU agent in C++ on inputs read from stdin and writes what it
// computed to stdout, so the Python tests can check that specache.Agent (the same agent through
// the bindings) gives the same bytes for the same inputs.
//
//   specache-agent-replay N_LAYERS N_Q_HEADS N_KV_HEADS HEAD_DIM MODE KEY_BITS VALUE_BITS G R K
//                         CACHED_ROWS REDUCTION STEPS PROMPT_LEN...
//
// Sequences are 100, 101, ... (one per prompt length). stdin, float32, in this order:
//   prefill, per layer: q [T][n_q][d], k [T][n_kv][d], v [T][n_kv][d]  (T = sum of prompt lengths)
//   pre-decode (specache mode), per layer: q, k, v of one row per sequence
//   each decode step, per layer: q, k, v of rows_per_sequence rows per sequence
// stdout: the attention output of every call above, in the same order (float32); after each
// decode step, when the mode fetches rows, for every (sequence, layer, kv head): int32 count then
// the int32 selected tokens; at the end the agent's stats (8 int64, AgentStats order) and every
// sequence's length (int32).
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "specache/agent.h"
#include "specache/in_memory_source.h"

namespace {

using specache::Status;

bool ReadFloats(std::vector<float>* v, size_t n) {
  v->resize(n);
  return std::fread(v->data(), sizeof(float), n, stdin) == n;
}

template <typename T>
void Write(const T* data, size_t n) {
  std::fwrite(data, sizeof(T), n, stdout);
}

int Fail(const std::string& what) {
  std::fprintf(stderr, "specache-agent-replay: %s\n", what.c_str());
  return 1;
}

int Run(int argc, char** argv) {
  if (argc < 15) return Fail("usage: see the top of agent_replay.cc");
  specache::ModelShape shape{std::atoi(argv[1]), std::atoi(argv[2]), std::atoi(argv[3]), std::atoi(argv[4])};
  specache::KvConfig kv;
  auto mode = specache::ParseKvMode(argv[5]);
  auto reduction = specache::ParseGroupReduction(argv[12]);
  if (!mode.ok()) return Fail(mode.status().ToString());
  if (!reduction.ok()) return Fail(reduction.status().ToString());
  kv.mode = *mode;
  kv.key_bits = std::atoi(argv[6]);
  kv.value_bits = std::atoi(argv[7]);
  kv.group_size = std::atoi(argv[8]);
  kv.residual_tokens = std::atoi(argv[9]);
  kv.top_k = std::atoi(argv[10]);
  kv.cached_rows = std::atoi(argv[11]);
  kv.reduction = *reduction;
  const int steps = std::atoi(argv[13]);
  std::vector<specache::SequenceId> ids;
  std::vector<int32_t> offsets{0};
  for (int i = 14; i < argc; ++i) {
    ids.push_back(100 + ids.size());
    offsets.push_back(offsets.back() + std::atoi(argv[i]));
  }

  specache::InMemorySource source;
  auto created = specache::CreateCpuAgent(shape, kv, &source);
  if (!created.ok()) return Fail(created.status().ToString());
  specache::Agent& agent = **created;
  for (auto id : ids) {
    if (Status s = agent.AddSequence(id); !s.ok()) return Fail(s.ToString());
  }

  const size_t qw = static_cast<size_t>(shape.n_q_heads) * shape.head_dim;
  const size_t kw = static_cast<size_t>(shape.n_kv_heads) * shape.head_dim;
  std::vector<float> q, k, v, out;
  const size_t tokens = static_cast<size_t>(offsets.back());
  for (int l = 0; l < shape.n_layers; ++l) {
    if (!ReadFloats(&q, tokens * qw) || !ReadFloats(&k, tokens * kw) || !ReadFloats(&v, tokens * kw)) {
      return Fail("short input (prefill)");
    }
    out.assign(tokens * qw, 0.0f);
    Status s = agent.PrefillLayer(l, {ids, offsets, q.data(), k.data(), v.data(), out.data()});
    if (!s.ok()) return Fail(s.ToString());
    Write(out.data(), out.size());
  }

  auto run_step = [&](specache::StepKind kind) -> Status {
    const size_t rows = ids.size() * agent.RowsPerSequence(kind);
    SPECACHE_RETURN_IF_ERROR(agent.BeginStep(kind, ids));
    for (int l = 0; l < shape.n_layers; ++l) {
      if (!ReadFloats(&q, rows * qw) || !ReadFloats(&k, rows * kw) || !ReadFloats(&v, rows * kw)) {
        return Status::InvalidArgument("short input (step)");
      }
      out.assign(rows * qw, 0.0f);
      SPECACHE_RETURN_IF_ERROR(agent.WaitPrefetch(l));
      SPECACHE_RETURN_IF_ERROR(agent.DecodeLayer(l, {q.data(), k.data(), v.data(), out.data()}));
      SPECACHE_RETURN_IF_ERROR(agent.StartPrefetch(l));
      Write(out.data(), out.size());
    }
    return agent.EndStep();
  };

  if (agent.RowsPerSequence(specache::StepKind::kPreDecode) > 0) {
    if (Status s = run_step(specache::StepKind::kPreDecode); !s.ok()) return Fail(s.ToString());
  }
  for (int step = 0; step < steps; ++step) {
    if (Status s = run_step(specache::StepKind::kDecode); !s.ok()) return Fail(s.ToString());
    if (!kv.fetches_rows()) continue;
    for (auto id : ids) {
      for (int l = 0; l < shape.n_layers; ++l) {
        for (int h = 0; h < shape.n_kv_heads; ++h) {
          auto selected = agent.SelectedTokens(id, l, h);
          if (!selected.ok()) return Fail(selected.status().ToString());
          const int32_t n = static_cast<int32_t>(selected->size());
          Write(&n, 1);
          Write(selected->data(), selected->size());
        }
      }
    }
  }

  const specache::AgentStats st = agent.stats();
  const int64_t stats[] = {st.device_bytes,  st.device_bytes_reserved, st.full_precision_bytes, st.rows_selected,
                           st.rows_fetched,  st.rows_reused,           st.bytes_fetched,        st.steps};
  Write(stats, 8);
  for (auto id : ids) {
    auto length = agent.SequenceLength(id);
    if (!length.ok()) return Fail(length.status().ToString());
    Write(&*length, 1);
  }
  return std::fflush(stdout) == 0 ? 0 : Fail("cannot write the output");
}

}  // namespace

int main(int argc, char** argv) { return Run(argc, argv); }
