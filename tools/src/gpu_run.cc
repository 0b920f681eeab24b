#include "gpu_run.h"

#include <algorithm>
#include <chrono>

#include "specache/device_probe.h"
#include "specache/gpu_engine.h"
#include "specache/gpu_llama.h"
#include "unicode_classes.h"

namespace specache::run {
namespace {

double Since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

}  // namespace

bool UseGpuModel(const std::string& backend) {
  static const bool gpu_usable = ProbeCudaDevice().ok();  // once per process
  return backend == "cuda" || (backend == "auto" && gpu_usable);
}

Result<GpuGeneration> GenerateOnGpu(const LoadedModel& m, const KvConfig& config, KvMemory* memory,
                                    const std::vector<std::vector<int32_t>>& prompts, int max_tokens,
                                    const std::function<void(std::string_view)>& on_text) {
  if (prompts.empty()) return Status::InvalidArgument("no prompt");
  const LlamaModel& cpu = *m.model;
  std::unique_ptr<FullPrecisionSource> source;
  if (memory) {
    SPECACHE_ASSIGN_OR_RETURN(source, memory->NewSource());
  } else {
    source = std::make_unique<InMemorySource>();
  }
  SPECACHE_ASSIGN_OR_RETURN(auto model, gpu::GpuLlama::FromModel(cpu));
  CudaAgentOptions options;
  options.capacity_tokens = cpu.config().context_length;
  options.stream = model->stream();
  SPECACHE_ASSIGN_OR_RETURN(auto agent, CreateCudaAgent(cpu.shape(), config, source.get(), options));
  gpu::GpuEngine engine(model.get(), agent.get());

  GpuGeneration g;
  const size_t n = prompts.size();
  std::vector<SequenceId> ids;
  std::vector<int32_t> lengths;
  for (size_t i = 0; i < n; ++i) {
    ids.push_back(static_cast<SequenceId>(i + 1));
    lengths.push_back(static_cast<int32_t>(prompts[i].size()));
  }
  auto start = std::chrono::steady_clock::now();
  SPECACHE_ASSIGN_OR_RETURN(std::vector<int32_t> tokens, engine.Prefill(ids, prompts));
  g.prefill_seconds = Since(start);
  start = std::chrono::steady_clock::now();
  SPECACHE_RETURN_IF_ERROR(engine.Start(ids, lengths, tokens));
  g.outputs.resize(n);
  std::vector<bool> done(n, false);
  std::string pending;  // prompt 0's bytes not yet shown (an unfinished UTF-8 character)
  auto is_stop = [&](int32_t t) { return std::find(m.stop_ids.begin(), m.stop_ids.end(), t) != m.stop_ids.end(); };
  while (true) {
    for (size_t i = 0; i < n; ++i) {  // a finished sequence keeps its row in the batch; its tokens are dropped
      if (done[i]) continue;
      if (is_stop(tokens[i])) {
        done[i] = true;
        continue;
      }
      g.outputs[i].tokens.push_back(tokens[i]);
      const int32_t one[] = {tokens[i]};
      const std::string piece = m.tokenizer->Decode(one);
      if (i == 0) {
        pending += piece;
        const size_t complete = text::CompleteUtf8Prefix(pending);
        if (complete > 0) {
          if (on_text) on_text(std::string_view(pending).substr(0, complete));
          g.outputs[0].text += pending.substr(0, complete);
          pending.erase(0, complete);
        }
      } else {
        g.outputs[i].text += piece;
      }
      if (static_cast<int>(g.outputs[i].tokens.size()) >= max_tokens) done[i] = true;
    }
    if (std::all_of(done.begin(), done.end(), [](bool d) { return d; })) break;
    SPECACHE_ASSIGN_OR_RETURN(tokens, engine.Step(tokens));
  }
  if (!pending.empty()) {
    if (on_text) on_text(pending);
    g.outputs[0].text += pending;
  }
  g.decode_seconds = Since(start);
  g.decode_steps = engine.steps();
  const AgentStats s = agent->stats();
  g.figures = {{"kv", std::string(KvModeName(config.mode))},
               {"mode", ModeLabel(config)},
               {"backend", "cuda (model on the GPU)"},
               {"batch", n},
               {"model_weight_bytes_on_gpu", model->weight_bytes()},
               {"device_kv_bytes", s.device_bytes},
               {"full_precision_bytes", s.full_precision_bytes},
               {"bytes_fetched", s.bytes_fetched},
               {"prefill_seconds", g.prefill_seconds},
               {"decode_steps", g.decode_steps},
               {"decode_seconds", g.decode_seconds},
               {"decode_tokens_per_s", g.decode_seconds > 0 ? double(g.decode_steps * n) / g.decode_seconds : 0.0}};
  for (auto& o : g.outputs) o.decode_seconds = g.decode_seconds;
  return g;
}

}  // namespace specache::run
