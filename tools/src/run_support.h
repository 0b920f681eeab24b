// Shared pieces of specache-run's commands: the loaded model, KV options, one agent per KV mode,
// greedy generation and the figures every command reports.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "specache/agent.h"
#include "specache/bpe_tokenizer.h"
#include "specache/chat_template.h"
#include "specache/gguf.h"
#include "specache/in_memory_source.h"
#include "specache/llama_model.h"
#include "specache/reference_engine.h"
#include "kv_memory.h"

namespace specache::run {

struct LoadedModel {
  std::unique_ptr<gguf::GgufFile> file;
  std::unique_ptr<LlamaModel> model;
  std::unique_ptr<BpeTokenizer> tokenizer;
  ChatTemplate chat = ChatTemplate::ChatMl("");
  std::vector<int32_t> stop_ids;  // end of turn / end of text
};
Result<LoadedModel> LoadModel(const std::string& path);

// specache-run's row cache, per (layer, KV head), unless --cached-rows says otherwise: with the
// union rule below, 1024 rows found full precision's needles and raised teacher-forced top-1 at
// 4096 tokens from 0.805 to 0.871 against twice the rows selected (256), with fewer bytes fetched
// (docs/method.md, "Choosing the rows").
constexpr int kDefaultCachedRows = 1024;

// The KV options of the command line (--kv, --bits, --key-bits, --value-bits, --group,
// --residual, --topk, --reduction).
struct KvOptions {
  std::string kv = "specache";
  int bits = 1;
  int key_bits = 0;    // 0: --bits
  int value_bits = 0;  // 0: --bits
  int group = 32;
  int residual = 64;
  int topk = 64;
  // Rows kept on the device per KV head and layer for reuse; 0: the default, the larger of
  // kDefaultCachedRows and twice the rows selected (chosen with the selection rule below).
  int cached_rows = 0;
  std::string reduction = "mean";
  // Row selection (kv_config.h, selection.h). The defaults were chosen with
  // tools/bench/selection_grid.sh (docs/method.md, "Choosing the rows"); the library's KvConfig
  // keeps the paper's rule.
  std::string select = "union";  // spec, real, union
  int topk_real = 96;            // union: rows added from the real row; 0: topk
  bool real_next = true;         // real, union: the real row's ranking also credits each row's successor
  bool attend_resident = true;   // attend with every row of the row cache
  double mass = 0;               // adaptive budget: attention mass to reach; 0: fixed topk
  int k_min = 16, k_max = 128;   // the adaptive budget's bounds
  // specache: rows the row cache starts with at prefill (KvConfig::seed_rows; 0: none). 1024 by
  // the grid (docs/method.md): with the rules above, full precision's needles at 0.37x the paper
  // rule's fetched bytes. The library's KvConfig seeds nothing unless asked (it needs the prompt's q).
  int seed_rows = 1024;
  // The full-precision rows in host memory: none (fp16), int8 (stored as int8 codes and scales,
  // KvConfig::host_row_format: half the host RAM and fetched bytes), e4m3 (fp16 rows rounded to
  // E4M3's values, KvConfig::round_host_rows: a fidelity measure; the CPU backend only), int4 (fp16
  // rows rounded to 4-bit symmetric codes' values, the same kind of measure; int4-g16: a scale per
  // 16 channels).
  std::string host_rows = "none";
  std::string kv_memory = "embedded";  // where the full-precision KV lives (see kv_memory.h)
  std::string daemon;                  // --daemon SOCKET (implies kv_memory "daemon")
  std::string backend = "auto";        // agent backend: auto (cuda when a GPU is usable), cpu, cuda
};
// KvOptions::host_rows by name into `c` (its mode set): int8 stores the rows as int8
// (host_row_format); the other names round fp16 rows (round_host_rows: e4m3 and int4 the CPU
// agent's only). Modes that fetch no rows keep fp16 rows. INVALID_ARGUMENT for an unknown name.
Status SetHostRows(const std::string& name, KvConfig* c);

// `mode` overrides options.kv and, written "MODE:BITS" (e.g. "kivi:2"), the bits too. Selection
// options may follow, each after a '/', overriding the command line's for this mode:
// select=spec|real|union, topk=K, topk-real=K, next, no-next, resident, no-resident, mass=P,
// k-min=K, k-max=K, cached-rows=N, seed=N, reduction=mean|max, host-rows=none|int8|e4m3|int4|int4-g16;
// e.g. "specache:1/select=union/resident".
Result<KvConfig> ToConfig(const KvOptions& options, const std::string& mode = "");
// "full", "kivi-1bit", "specache-2bit", ...; a selection other than the defaults' is appended,
// e.g. "specache-1bit+union64+resident" (safe in file names).
std::string ModeLabel(const KvConfig& config);

// One KV mode: its config, its own full-precision source and agent.
struct ModeRun {
  std::string label;
  KvConfig config;
  std::unique_ptr<FullPrecisionSource> source;  // outlives the agent (declared first)
  std::unique_ptr<Agent> agent;
};
// The source comes from `memory` (daemon pages), or is process memory when it is null.
// `backend` is "cpu", "cuda" or "auto" (cuda when a GPU is usable); the CUDA agent gets the
// engine's host tensors through WrapHostTensors.
Result<std::unique_ptr<ModeRun>> MakeModeRun(const LlamaModel& model, const KvConfig& config,
                                             KvMemory* memory = nullptr, const std::string& backend = "cpu");

// Opens the KV memory the options ask for, sized for `sequences` sequences of the model's context.
Result<std::unique_ptr<KvMemory>> OpenKvMemory(const KvOptions& options, const LlamaModel& model, int sequences);

struct Generation {
  std::vector<int32_t> tokens;
  std::string text;
  double decode_seconds = 0;
};
// Greedy decoding from the prefill's logits until a stop token or max_tokens; `on_text` gets the
// answer's text as it grows (complete UTF-8 characters only).
Result<Generation> GenerateGreedy(const LoadedModel& m, Decoder* decoder, std::span<const float> first_logits,
                                  int max_tokens, const std::function<void(std::string_view)>& on_text = {});

// Memory and fetch figures of an agent, plus the run's speed.
nlohmann::json Figures(const ModeRun& run, double prefill_seconds, int prompt_tokens, const Decoder& decoder);

// Parses a byte count: "48GB", "48GiB", "512MiB", "48e9", "51539607552".
Result<uint64_t> ParseBytes(const std::string& text);

}  // namespace specache::run
