// specache-run: the reference engine on a Llama-family GGUF model, with its KV cache held by the
// gpu_agent in the chosen mode. Commands: generate, niah, niah-grid, fidelity, logits, and bench
// (decode throughput of the whole model on the GPU at a fixed memory budget, random weights).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>

#include <CLI/CLI.hpp>

#include "blas_runtime.h"
#include "command_line.h"
#include "gpu_run.h"
#include "heatmap_png.h"
#include "line_plot_png.h"
#include "memory_breakdown.h"
#include "niah_prompt.h"
#include "niah_reading.h"
#include "output_paths.h"
#include "progress.h"
#include "run_support.h"
#include "specache/version.h"
#include "throughput_bench.h"

namespace specache::run {
namespace {

constexpr SequenceId kSequence = 1;

Result<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::NotFound("cannot read " + path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

void AddModelOption(CLI::App* app, std::string* model) {
  app->add_option("--model", *model, "GGUF model file (Llama architecture)")->required();
}

// How the rows to fetch are chosen (docs/method.md, "Choosing the rows").
void AddSelectionOptions(CLI::App* app, KvOptions* o) {
  app->add_option("--select", o->select,
                  "whose scores pick the rows fetched for the next step (specache): spec (the speculative row), real "
                  "(the real row), union (spec's top-k plus the real row's best --topk-real others)")
      ->capture_default_str();
  app->add_option("--topk-real", o->topk_real, "rows union adds from the real row (0: --topk)")->capture_default_str();
  app->add_flag("--real-next,!--no-real-next", o->real_next,
                "select real or union: the real row's ranking also credits the row after each row it attends to "
                "(what copying from the context reads next)")
      ->capture_default_str();
  app->add_flag("--attend-resident,!--no-attend-resident", o->attend_resident,
                "attend with every full-precision row resident in the row cache, not only the selection")
      ->capture_default_str();
  app->add_option("--mass", o->mass,
                  "adaptive budget: per KV head, the fewest rows whose low-bit attention mass reaches this fraction of "
                  "the candidates' (between --k-min and --k-max); 0: a fixed --topk")
      ->capture_default_str();
  app->add_option("--k-min", o->k_min, "fewest rows of the adaptive budget")->capture_default_str();
  app->add_option("--k-max", o->k_max, "most rows of the adaptive budget")->capture_default_str();
  app->add_option("--seed-rows", o->seed_rows,
                  "rows the row cache starts with at prefill: the quantized tokens the prompt's last token attends "
                  "most, from the prompt's own K/V, nothing fetched (0: none)")
      ->capture_default_str();
}

void AddKvOptions(CLI::App* app, KvOptions* o) {
  app->add_option("--kv", o->kv,
                  "KV mode: full, kivi, specache, specache-nonspec, specache-oracle (exact selection, for measuring)")
      ->capture_default_str();
  app->add_option("--bits", o->bits, "bits of the low-bit replica, keys and values (1, 2, 4)")->capture_default_str();
  app->add_option("--key-bits", o->key_bits, "key bits (default: --bits)");
  app->add_option("--value-bits", o->value_bits, "value bits (default: --bits)");
  app->add_option("--group", o->group, "quantization group G (tokens per key group, channels per value group)")
      ->capture_default_str();
  app->add_option("--residual", o->residual, "full-precision residual window R (tokens)")->capture_default_str();
  app->add_option("--topk", o->topk, "rows fetched per KV head and layer (specache)")->capture_default_str();
  app->add_option("--cached-rows", o->cached_rows,
                  "rows kept on the device per KV head and layer for reuse (0: the larger of 1024 and twice the "
                  "rows selected; at least the rows selected)")
      ->capture_default_str();
  app->add_option("--reduction", o->reduction, "GQA reduction of scores for top-k: mean or max")->capture_default_str();
  app->add_option("--host-rows", o->host_rows,
                  "the full-precision rows in host memory: none (fp16), int8 (stored as int8 codes with two fp16 "
                  "scales: half the host RAM and fetched bytes), e4m3 (fp16 rows rounded to E4M3's values: a "
                  "fidelity measure, the CPU backend only), int4 (rounded to 4-bit codes' values, the same; int4-g16: a scale per 16 channels)")
      ->capture_default_str();
  AddSelectionOptions(app, o);
  app->add_option("--kv-memory", o->kv_memory,
                  "where the full-precision KV lives: embedded (a specached inside this process), daemon, process")
      ->capture_default_str();
  app->add_option("--daemon", o->daemon, "control socket of a running specached (implies --kv-memory daemon)");
  app->add_option("--backend", o->backend, "agent backend: auto (cuda when a GPU is usable), cpu, cuda")
      ->capture_default_str();
}

std::vector<int32_t> ChatPrompt(const LoadedModel& m, const std::string& text, bool raw) {
  if (raw) return m.tokenizer->Encode(text, /*parse_special=*/true);
  const ChatMessage user[] = {{"user", text}};
  return m.tokenizer->Encode(m.chat.Apply(user, /*add_generation_prompt=*/true), /*parse_special=*/true);
}

// ---- generate ----
struct GenerateArgs {
  std::string model, prompt, prompt_file, selection_trace, batch_prompts;
  int max_tokens = 256;
  bool raw = false, json = false, keep_sequence = false;
  KvOptions kv;
};

// generate with the whole model on the GPU: one prompt, or the lines of --batch-prompts decoded
// together as one ragged batch.
Status GenerateGpu(const GenerateArgs& a, const LoadedModel& m, const KvConfig& config) {
  std::vector<std::vector<int32_t>> prompts{ChatPrompt(m, a.prompt, a.raw)};
  if (!a.batch_prompts.empty()) {
    std::ifstream in(a.batch_prompts);
    if (!in) return Status::NotFound("cannot read " + a.batch_prompts);
    std::string line;
    while (std::getline(in, line)) {
      if (!line.empty()) prompts.push_back(ChatPrompt(m, line, a.raw));
    }
  }
  SPECACHE_ASSIGN_OR_RETURN(auto memory, OpenKvMemory(a.kv, *m.model, static_cast<int>(prompts.size())));
  auto stream = [&](std::string_view text) {
    if (a.json) return;
    std::fwrite(text.data(), 1, text.size(), stdout);
    std::fflush(stdout);
  };
  SPECACHE_ASSIGN_OR_RETURN(GpuGeneration g, GenerateOnGpu(m, config, memory.get(), prompts, a.max_tokens, stream));
  nlohmann::json j = g.figures;
  size_t prompt_tokens = 0;
  for (const auto& p : prompts) prompt_tokens += p.size();
  j["prompt_tokens"] = prompt_tokens;
  j["kv_memory"] = memory->Figures();
  if (a.json) {
    j["output"] = g.outputs[0].text;
    nlohmann::json outputs = nlohmann::json::array();
    for (const Generation& o : g.outputs) outputs.push_back(o.text);
    j["outputs"] = outputs;
    std::cout << j.dump() << "\n";
    return Status::Ok();
  }
  std::printf("\n");
  for (size_t i = 1; i < g.outputs.size(); ++i) std::printf("[%zu] %s\n", i, g.outputs[i].text.c_str());
  std::fprintf(stderr,
               "[%s] model on the GPU (%.0f MB fp16), batch %zu, prompts %zu tokens, prefill %.3f s; %lld steps at "
               "%.1f tok/s (all sequences); device KV %.2f MiB, full precision %.2f MiB\n",
               j["mode"].get<std::string>().c_str(), j["model_weight_bytes_on_gpu"].get<double>() / 1e6,
               g.outputs.size(), prompt_tokens, g.prefill_seconds, static_cast<long long>(g.decode_steps),
               j["decode_tokens_per_s"].get<double>(), j["device_kv_bytes"].get<double>() / (1 << 20),
               j["full_precision_bytes"].get<double>() / (1 << 20));
  std::fprintf(stderr, "[%s] full-precision KV in: %s\n", j["mode"].get<std::string>().c_str(),
               j["kv_memory"].dump().c_str());
  return Status::Ok();
}

Status Generate(GenerateArgs a) {
  if (!a.prompt_file.empty()) {
    std::ifstream in(a.prompt_file);
    if (!in) return Status::NotFound("cannot read " + a.prompt_file);
    a.prompt.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  } else if (a.prompt.empty()) {
    return Status::InvalidArgument("give --prompt or --prompt-file");
  }
  if (a.keep_sequence && a.kv.daemon.empty()) {
    return Status::InvalidArgument("--keep-sequence needs --daemon SOCKET (a specached that outlives this run)");
  }
  if (!a.selection_trace.empty()) SPECACHE_RETURN_IF_ERROR(PrepareOutputFile(a.selection_trace));
  SPECACHE_ASSIGN_OR_RETURN(LoadedModel m, LoadModel(a.model));
  SPECACHE_ASSIGN_OR_RETURN(KvConfig config, ToConfig(a.kv));
  // The whole model on the GPU, unless an option needs the host-model path (which keeps the
  // sequence in the daemon or traces selections).
  const bool gpu_model = UseGpuModel(a.kv.backend) && !a.keep_sequence && a.selection_trace.empty();
  if (!a.batch_prompts.empty() && !gpu_model) {
    return Status::InvalidArgument("--batch-prompts runs on the GPU model (--backend cuda or auto with a GPU)");
  }
  if (gpu_model) return GenerateGpu(a, m, config);
  SPECACHE_ASSIGN_OR_RETURN(auto memory, OpenKvMemory(a.kv, *m.model, 1));
  SPECACHE_ASSIGN_OR_RETURN(auto run, MakeModeRun(*m.model, config, memory.get(), a.kv.backend));
  const std::vector<int32_t> prompt = ChatPrompt(m, a.prompt, a.raw);
  Agent* agents[] = {run->agent.get()};
  SPECACHE_ASSIGN_OR_RETURN(PrefillResult pre, Prefill(*m.model, agents, kSequence, prompt));
  Decoder decoder(*m.model, run->agent.get(), kSequence, static_cast<int32_t>(prompt.size()));
  std::ofstream trace;
  if (!a.selection_trace.empty()) {
    trace.open(a.selection_trace);
    if (!trace) return Status::InvalidArgument("cannot write " + a.selection_trace);
    decoder.RecordSelections(&trace);
  }
  auto stream = [&](std::string_view text) {
    if (a.json) return;
    std::fwrite(text.data(), 1, text.size(), stdout);
    std::fflush(stdout);
  };
  SPECACHE_ASSIGN_OR_RETURN(Generation g, GenerateGreedy(m, &decoder, pre.logits, a.max_tokens, stream));
  nlohmann::json j = Figures(*run, pre.seconds, static_cast<int>(prompt.size()), decoder);
  if (a.keep_sequence) {
    SPECACHE_ASSIGN_OR_RETURN(uint64_t kept, memory->KeepSequence(run->source.get(), kSequence));
    j["kept_sequence"] = kept;
    if (!a.json) {
      std::fprintf(stderr, "[%s] kept daemon sequence %llu (specachectl sequences shows it)\n", run->label.c_str(),
                   static_cast<unsigned long long>(kept));
    }
  }
  j["prompt_tokens"] = prompt.size();
  j["generated_tokens"] = g.tokens.size();
  j["kv_memory"] = memory->Figures();
  if (a.json) {
    j["output"] = g.text;
    std::cout << j.dump() << "\n";
  } else {
    std::printf("\n");
    std::fflush(stdout);  // the answer's last line before the figures on stderr
    std::fprintf(stderr, "[%s] prompt %zu tokens, prefill %.1f tok/s; %zu tokens at %.2f tok/s\n%s", run->label.c_str(),
                 prompt.size(), j["prefill_tokens_per_s"].get<double>(), g.tokens.size(),
                 j["decode_tokens_per_s"].get<double>(), MemoryLines(j["device_kv"], "[" + run->label + "] ").c_str());
    std::fprintf(stderr, "[%s] full-precision KV in: %s\n", run->label.c_str(), j["kv_memory"].dump().c_str());
  }
  return Status::Ok();
}

// ---- niah / niah-grid ----
struct NiahArgs {
  std::string model, haystack_file, needle, question, answer;
  std::vector<int> lengths{4096};
  std::vector<double> depths{0.5};
  std::vector<std::string> modes;  // empty: the --kv options
  int max_tokens = 32;
  std::string out_dir = ".";
  bool json = false;
  KvOptions kv;
};

bool Contains(std::string hay, std::string needle) {
  for (auto* s : {&hay, &needle}) {
    for (char& ch : *s) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  }
  return hay.find(needle) != std::string::npos;
}

// Runs every mode on one (length, depth) point; one prefill shared by all modes.
Result<std::vector<nlohmann::json>> NiahPoint(const LoadedModel& m, const NiahArgs& a, const std::string& haystack,
                                              const std::vector<KvConfig>& configs, int length, double depth,
                                              KvMemory* memory) {
  NiahSpec spec{haystack, a.needle, a.question, length, depth};
  SPECACHE_ASSIGN_OR_RETURN(NiahPrompt prompt, BuildNiahPrompt(*m.tokenizer, m.chat, spec));
  std::vector<std::unique_ptr<ModeRun>> runs;
  std::vector<Agent*> agents;
  for (const KvConfig& c : configs) {
    SPECACHE_ASSIGN_OR_RETURN(auto r, MakeModeRun(*m.model, c, memory, a.kv.backend));
    agents.push_back(r->agent.get());
    runs.push_back(std::move(r));
  }
  SPECACHE_ASSIGN_OR_RETURN(PrefillResult pre, Prefill(*m.model, agents, kSequence, prompt.tokens));
  std::vector<nlohmann::json> results;
  for (auto& r : runs) {
    Decoder decoder(*m.model, r->agent.get(), kSequence, static_cast<int32_t>(prompt.tokens.size()));
    SPECACHE_ASSIGN_OR_RETURN(Generation g, GenerateGreedy(m, &decoder, pre.logits, a.max_tokens));
    nlohmann::json j = Figures(*r, pre.seconds, static_cast<int>(prompt.tokens.size()), decoder);
    j["correct"] = Contains(g.text, a.answer);
    j["output"] = g.text;
    j["context_tokens"] = prompt.tokens.size();
    j["haystack_tokens"] = prompt.haystack_tokens;
    j["needle_position"] = prompt.needle_position;
    j["depth"] = depth;
    j["answer"] = a.answer;
    j["prefill_shared_by_modes"] = runs.size();
    j["kv_memory"] = memory->Figures();
    results.push_back(std::move(j));
  }
  return results;
}

// One config per --modes entry, or the --kv options alone when there is none.
Result<std::vector<KvConfig>> Configs(const KvOptions& kv, const std::vector<std::string>& modes) {
  std::vector<KvConfig> configs;
  for (const std::string& mode : modes.empty() ? std::vector<std::string>{""} : modes) {
    SPECACHE_ASSIGN_OR_RETURN(KvConfig c, ToConfig(kv, mode));
    configs.push_back(c);
  }
  return configs;
}

Status Niah(const NiahArgs& a) {
  SPECACHE_ASSIGN_OR_RETURN(LoadedModel m, LoadModel(a.model));
  SPECACHE_ASSIGN_OR_RETURN(std::string haystack, ReadFile(a.haystack_file));
  SPECACHE_ASSIGN_OR_RETURN(std::vector<KvConfig> configs, Configs(a.kv, a.modes));
  SPECACHE_ASSIGN_OR_RETURN(auto memory, OpenKvMemory(a.kv, *m.model, static_cast<int>(configs.size())));
  SPECACHE_ASSIGN_OR_RETURN(auto results, NiahPoint(m, a, haystack, configs, a.lengths[0], a.depths[0], memory.get()));
  for (const auto& j : results) {
    if (a.json) {
      std::cout << j.dump() << "\n";
    } else {
      std::printf("[%s] context %d depth %.2f: %s\n  output: %s\n%s", j["mode"].get<std::string>().c_str(),
                  j["context_tokens"].get<int>(), a.depths[0], j["correct"].get<bool>() ? "CORRECT" : "wrong",
                  j["output"].get<std::string>().c_str(), MemoryLines(j["device_kv"], "  ").c_str());
    }
  }
  return Status::Ok();
}

std::string Fixed(double v, int digits) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.*f", digits, v);
  return buf;
}

Status NiahGrid(const NiahArgs& a) {
  SPECACHE_ASSIGN_OR_RETURN(std::vector<KvConfig> configs, Configs(a.kv, a.modes));
  // Every file this run writes is checked (its directory created) before the first point.
  const std::string json_path = a.out_dir + "/niah_grid.json";
  SPECACHE_RETURN_IF_ERROR(PrepareOutputFile(json_path));
  for (const KvConfig& c : configs) SPECACHE_RETURN_IF_ERROR(PrepareOutputFile(a.out_dir + "/niah_" + ModeLabel(c) + ".png"));
  SPECACHE_ASSIGN_OR_RETURN(LoadedModel m, LoadModel(a.model));
  SPECACHE_ASSIGN_OR_RETURN(std::string haystack, ReadFile(a.haystack_file));
  SPECACHE_ASSIGN_OR_RETURN(auto memory, OpenKvMemory(a.kv, *m.model, static_cast<int>(configs.size())));
  const size_t n_modes = configs.size(), n_len = a.lengths.size(), n_depth = a.depths.size();
  // correct[mode][depth][length]
  std::vector<std::vector<std::vector<double>>> correct(
      n_modes, std::vector<std::vector<double>>(n_depth, std::vector<double>(n_len, NAN)));
  nlohmann::json all = nlohmann::json::array();
  // A point's time grows with its length: the time left is estimated per token of context.
  Progress progress("niah-grid:", static_cast<int64_t>(n_len * n_depth), "points");
  double total_tokens = 0;
  for (int len : a.lengths) total_tokens += static_cast<double>(len) * n_depth;
  progress.SetTotalWork(total_tokens);
  for (size_t li = 0; li < n_len; ++li) {
    for (size_t di = 0; di < n_depth; ++di) {
      SPECACHE_ASSIGN_OR_RETURN(auto results,
                                NiahPoint(m, a, haystack, configs, a.lengths[li], a.depths[di], memory.get()));
      for (size_t mi = 0; mi < n_modes; ++mi) {
        correct[mi][di][li] = results[mi]["correct"].get<bool>() ? 1.0 : 0.0;
        std::string answer = results[mi]["output"].get<std::string>().substr(0, 60);
        std::replace(answer.begin(), answer.end(), '\n', ' ');  // one line per result
        char line[256];
        std::snprintf(line, sizeof line, "niah-grid: %-14s %5d tokens depth %.2f %s  (%s)",
                      results[mi]["mode"].get<std::string>().c_str(), a.lengths[li], a.depths[di],
                      results[mi]["correct"].get<bool>() ? "ok   " : "MISS ", answer.c_str());
        progress.Note(line);
        all.push_back(results[mi]);
      }
      progress.Advance(1, a.lengths[li]);
    }
  }
  progress.Finish();
  // Table: one row per mode, accuracy per length (over depths), and overall.
  std::printf("%-16s", "mode");
  for (int len : a.lengths) std::printf(" %8d", len);
  std::printf(" %8s\n", "all");
  nlohmann::json summary = nlohmann::json::array();
  std::vector<HeatMap> maps;
  for (size_t mi = 0; mi < n_modes; ++mi) {
    const std::string label = ModeLabel(configs[mi]);
    std::printf("%-16s", label.c_str());
    double total = 0;
    nlohmann::json per_length = nlohmann::json::object();
    for (size_t li = 0; li < n_len; ++li) {
      double acc = 0;
      for (size_t di = 0; di < n_depth; ++di) acc += correct[mi][di][li];
      acc /= static_cast<double>(n_depth);
      total += acc;
      per_length[std::to_string(a.lengths[li])] = acc;
      std::printf(" %8.2f", acc);
    }
    std::printf(" %8.2f\n", total / static_cast<double>(n_len));
    summary.push_back({{"mode", label}, {"accuracy", total / static_cast<double>(n_len)}, {"by_length", per_length}});

    HeatMap map;
    map.title = "Needle in a haystack, " + label + ": " + Fixed(100 * total / static_cast<double>(n_len), 0) + "% correct";
    for (double d : a.depths) map.row_labels.push_back(Fixed(d, 2));
    for (int len : a.lengths) map.column_labels.push_back(std::to_string(len));
    map.values = correct[mi];
    maps.push_back(std::move(map));
  }
  // Device memory of each mode at the last point (the longest context when --lengths ascend).
  std::printf("\ndevice KV at %d tokens (low-bit replica, fixed parts and row cache, against the fp16 KV):\n",
              all.back()["context_tokens"].get<int>());
  std::vector<ModeOutcome> outcomes;
  for (size_t mi = 0; mi < n_modes; ++mi) {
    const nlohmann::json& last = all[all.size() - n_modes + mi];
    std::printf("%s", MemoryLines(last["device_kv"], "  " + last["mode"].get<std::string>() + ": ").c_str());
    ModeOutcome o{ModeLabel(configs[mi]), std::string(KvModeName(configs[mi].mode)),
                  configs[mi].mode == KvMode::kFull ? 16 : configs[mi].key_bits};
    for (const auto& row : correct[mi]) {
      for (double v : row) o.correct += v > 0.5, ++o.points;
    }
    o.memory_ratio = last["device_kv"]["ratio"].get<double>();
    outcomes.push_back(o);
  }
  std::printf("\n%s\n", ReadNiahTable(outcomes).c_str());
  // The results first, then the pictures: a picture that fails loses nothing measured.
  {
    std::ofstream out(json_path);
    out << nlohmann::json{{"summary", summary}, {"runs", all}}.dump(1) << "\n";
    if (!out.flush()) return Status::DataLoss("could not write " + json_path);
  }
  for (size_t mi = 0; mi < n_modes; ++mi) {
    SPECACHE_RETURN_IF_ERROR(WriteHeatMapPng(maps[mi], a.out_dir + "/niah_" + ModeLabel(configs[mi]) + ".png"));
  }
  std::printf("wrote %s and niah_<mode>.png in %s\n", json_path.c_str(), a.out_dir.c_str());
  return Status::Ok();
}

// ---- fidelity ----
struct FidelityArgs {
  std::string model, text_file;
  int context_tokens = 2048, eval_tokens = 256;
  std::vector<std::string> modes;  // empty: the --kv options
  bool json = false;
  KvOptions kv;
};

// KL(p || q) of the softmax distributions of two logit vectors, in nats.
double KlDivergence(std::span<const float> p_logits, std::span<const float> q_logits) {
  auto log_softmax = [](std::span<const float> x) {
    const float m = *std::max_element(x.begin(), x.end());
    double sum = 0;
    for (float v : x) sum += std::exp(double{v} - m);
    std::vector<double> out(x.size());
    const double log_sum = std::log(sum) + m;
    for (size_t i = 0; i < x.size(); ++i) out[i] = x[i] - log_sum;
    return out;
  };
  const std::vector<double> lp = log_softmax(p_logits), lq = log_softmax(q_logits);
  double kl = 0;
  for (size_t i = 0; i < lp.size(); ++i) kl += std::exp(lp[i]) * (lp[i] - lq[i]);
  return std::max(kl, 0.0);
}

Status Fidelity(const FidelityArgs& a) {
  SPECACHE_ASSIGN_OR_RETURN(LoadedModel m, LoadModel(a.model));
  SPECACHE_ASSIGN_OR_RETURN(std::string text, ReadFile(a.text_file));
  if (a.context_tokens < 1 || a.eval_tokens < 1) return Status::InvalidArgument("--context-tokens and --eval-tokens must be >= 1");
  const std::vector<int32_t> tokens = m.tokenizer->Encode(text, /*parse_special=*/false);
  const size_t needed = static_cast<size_t>(a.context_tokens) + a.eval_tokens;
  if (tokens.size() < needed) {
    return Status::InvalidArgument(a.text_file + " has " + std::to_string(tokens.size()) + " tokens; " +
                                   std::to_string(needed) + " needed (context + eval)");
  }
  KvOptions full_options = a.kv;
  full_options.kv = "full";
  SPECACHE_ASSIGN_OR_RETURN(KvConfig full_config, ToConfig(full_options));
  SPECACHE_ASSIGN_OR_RETURN(std::vector<KvConfig> configs, Configs(a.kv, a.modes));
  // One full-precision reference and one run per mode, all from one shared prefill.
  SPECACHE_ASSIGN_OR_RETURN(auto memory, OpenKvMemory(a.kv, *m.model, static_cast<int>(configs.size()) + 1));
  SPECACHE_ASSIGN_OR_RETURN(auto full, MakeModeRun(*m.model, full_config, memory.get(), a.kv.backend));
  std::vector<Agent*> agents = {full->agent.get()};
  struct Tally {
    std::unique_ptr<ModeRun> run;
    std::unique_ptr<Decoder> decoder;
    int agree = 0, text_hits = 0, spec_hits = 0;
    double kl_sum = 0, kl_max = 0;
  };
  std::vector<Tally> tallies(configs.size());
  for (size_t i = 0; i < configs.size(); ++i) {
    SPECACHE_ASSIGN_OR_RETURN(tallies[i].run, MakeModeRun(*m.model, configs[i], memory.get(), a.kv.backend));
    agents.push_back(tallies[i].run->agent.get());
  }
  const std::span<const int32_t> context(tokens.data(), a.context_tokens);
  SPECACHE_ASSIGN_OR_RETURN(PrefillResult pre, Prefill(*m.model, agents, kSequence, context));
  Decoder reference(*m.model, full->agent.get(), kSequence, a.context_tokens);
  // Teacher forcing: every decoder is fed the text; the speculative row (specache) follows its
  // own predictions, as in generation.
  SPECACHE_RETURN_IF_ERROR(reference.Start(tokens[a.context_tokens]));
  for (Tally& t : tallies) {
    t.decoder = std::make_unique<Decoder>(*m.model, t.run->agent.get(), kSequence, a.context_tokens);
    SPECACHE_RETURN_IF_ERROR(t.decoder->Start(tokens[a.context_tokens]));
  }
  int text_hits_full = 0;
  std::vector<float> ref_logits;
  Progress progress("fidelity:", a.eval_tokens, "positions");
  for (int step = 0; step < a.eval_tokens; ++step) {
    const int32_t token = tokens[a.context_tokens + step];
    const int32_t next = tokens[a.context_tokens + step + 1 < static_cast<int>(tokens.size()) ? a.context_tokens + step + 1
                                                                                                : a.context_tokens + step];
    SPECACHE_ASSIGN_OR_RETURN(std::span<const float> r, reference.Step(token));
    ref_logits.assign(r.begin(), r.end());
    const int32_t top_ref = Argmax(ref_logits);
    text_hits_full += top_ref == next;
    for (Tally& t : tallies) {
      // This step's speculative row runs on a guess of the token after `token`.
      if (t.decoder->speculative_token() == next) ++t.spec_hits;
      SPECACHE_ASSIGN_OR_RETURN(std::span<const float> q, t.decoder->Step(token));
      const int32_t top = Argmax(q);
      t.agree += top_ref == top;
      t.text_hits += top == next;
      const double kl = KlDivergence(ref_logits, q);
      t.kl_sum += kl;
      t.kl_max = std::max(t.kl_max, kl);
    }
    progress.Advance();
  }
  progress.Finish();
  for (Tally& t : tallies) {
    nlohmann::json j = Figures(*t.run, pre.seconds, a.context_tokens, *t.decoder);
    j["positions"] = a.eval_tokens;
    j["context_tokens"] = a.context_tokens;
    j["top1_agreement"] = static_cast<double>(t.agree) / a.eval_tokens;
    j["mean_kl"] = t.kl_sum / a.eval_tokens;
    j["max_kl"] = t.kl_max;
    j["next_token_accuracy_full"] = static_cast<double>(text_hits_full) / a.eval_tokens;
    j["next_token_accuracy_mode"] = static_cast<double>(t.text_hits) / a.eval_tokens;
    if (t.run->config.mode == KvMode::kSpeCache) {
      j["speculative_token_hits"] = static_cast<double>(t.spec_hits) / a.eval_tokens;
    }
    j["full_decode_tokens_per_s"] = reference.steps() / reference.decode_seconds();
    j["kv_memory"] = memory->Figures();
    if (a.json) {
      std::cout << j.dump() << "\n";
      continue;
    }
    std::printf("[%s] %d positions after %d tokens: top-1 agreement %.4f, mean KL %.5f (max %.4f); decode %.2f tok/s "
                "(full %.2f)\n%s",
                t.run->label.c_str(), a.eval_tokens, a.context_tokens, j["top1_agreement"].get<double>(),
                j["mean_kl"].get<double>(), t.kl_max, j["decode_tokens_per_s"].get<double>(),
                j["full_decode_tokens_per_s"].get<double>(), MemoryLines(j["device_kv"], "  ").c_str());
  }
  return Status::Ok();
}

// ---- logits (for comparisons with other implementations) ----
struct LogitsArgs {
  std::string model, prompt, out;
  bool raw = false, no_special = false;
};

Status Logits(const LogitsArgs& a) {
  const bool to_file = !a.out.empty() && a.out != "-";
  if (to_file) SPECACHE_RETURN_IF_ERROR(PrepareOutputFile(a.out));
  SPECACHE_ASSIGN_OR_RETURN(LoadedModel m, LoadModel(a.model));
  SPECACHE_ASSIGN_OR_RETURN(auto run, MakeModeRun(*m.model, KvConfig{KvMode::kFull}));
  const std::vector<int32_t> prompt =
      a.no_special ? m.tokenizer->Encode(a.prompt, /*parse_special=*/false) : ChatPrompt(m, a.prompt, a.raw);
  Agent* agents[] = {run->agent.get()};
  SPECACHE_ASSIGN_OR_RETURN(PrefillResult pre, Prefill(*m.model, agents, kSequence, prompt));
  nlohmann::json j{{"tokens", prompt}, {"logits", pre.logits}, {"argmax", Argmax(pre.logits)}};
  if (!to_file) {
    std::cout << j.dump() << "\n";
  } else {
    std::ofstream out(a.out);
    out << j.dump() << "\n";
    if (!out.flush()) return Status::DataLoss("could not write " + a.out);
  }
  return Status::Ok();
}

// ---- bench (GPU throughput at a fixed memory budget) ----
struct BenchArgs {
  ThroughputOptions options;
  std::string budget = "48GB", json_out, plot;
  std::vector<std::string> modes, merge;
  bool json = false, plot_only = false;
};

Status Bench(BenchArgs a) {
  SPECACHE_ASSIGN_OR_RETURN(a.options.gpu_budget_bytes, ParseBytes(a.budget));
  if (!a.modes.empty()) a.options.modes = a.modes;
  std::vector<nlohmann::json> rows;
  if (!a.plot_only) {
    SPECACHE_ASSIGN_OR_RETURN(rows, RunThroughputBench(a.options));
  }
  if (a.json) {
    for (const auto& r : rows) std::cout << r.dump() << "\n";
  }
  if (!a.json_out.empty()) std::ofstream(a.json_out) << nlohmann::json(rows).dump(1) << "\n";
  for (const std::string& file : a.merge) {  // rows of earlier runs (--json-out), for the plot
    SPECACHE_ASSIGN_OR_RETURN(std::string text, ReadFile(file));
    const nlohmann::json earlier = nlohmann::json::parse(text, nullptr, false);
    if (!earlier.is_array()) return Status::InvalidArgument(file + " is not a JSON array of bench rows");
    for (const auto& r : earlier) rows.push_back(r);
  }
  if (!a.plot.empty()) {
    std::vector<int> contexts;
    for (const auto& r : rows) {
      if (r.contains("context")) contexts.push_back(r["context"].get<int>());  // (not the prefill row)
    }
    std::sort(contexts.begin(), contexts.end());
    contexts.erase(std::unique(contexts.begin(), contexts.end()), contexts.end());
    LinePlot plot;
    const std::string shape = rows.empty() ? a.options.shape : rows[0].value("shape", a.options.shape);
    plot.title = "decode tokens/s at " + a.budget + " GPU memory, " + shape + " (random weights)";
    plot.x_label = "context (tokens)";
    plot.y_label = "tokens/s";
    for (int c : contexts) plot.x_ticks.push_back(c % 1024 == 0 ? std::to_string(c / 1024) + "K" : std::to_string(c));
    for (const std::string& mode : a.options.modes) {
      LinePlot::Series s{mode, std::vector<double>(contexts.size(), NAN)};
      LinePlot::Series sdpa{"fp16 SDPA (PyTorch)", std::vector<double>(contexts.size(), NAN)};
      for (const auto& r : rows) {
        if (!r.contains("context") || r["mode"] != mode || !r.contains("tokens_per_s")) continue;
        const size_t i = std::find(contexts.begin(), contexts.end(), r["context"].get<int>()) - contexts.begin();
        s.y[i] = r["tokens_per_s"].get<double>();
        if (r.contains("sdpa") && r["sdpa"].contains("tokens_per_s")) sdpa.y[i] = r["sdpa"]["tokens_per_s"].get<double>();
      }
      if (std::any_of(s.y.begin(), s.y.end(), [](double v) { return std::isfinite(v); })) plot.series.push_back(s);
      if (std::any_of(sdpa.y.begin(), sdpa.y.end(), [](double v) { return std::isfinite(v); })) plot.series.push_back(sdpa);
    }
    SPECACHE_RETURN_IF_ERROR(WriteLinePlotPng(plot, a.plot));
    std::fprintf(stderr, "bench: wrote %s\n", a.plot.c_str());
  }
  return Status::Ok();
}

int Report(const Status& s) {
  if (s.ok()) return 0;
  std::fprintf(stderr, "specache-run: %s\n", s.ToString().c_str());
  return 1;
}

}  // namespace
}  // namespace specache::run

int main(int argc, char** argv) {
  using namespace specache::run;
  specache::ConfigureBlasRuntime(argv);
  CLI::App app{"specache-run: reference engine for Llama-family GGUF models with the SpeCache KV agent", "specache-run"};
  app.require_subcommand(1);

  GenerateArgs gen;
  CLI::App* generate = app.add_subcommand("generate", "greedy answer to a prompt, streamed");
  AddModelOption(generate, &gen.model);
  auto* prompt_text = generate->add_option("--prompt", gen.prompt, "user message (chat template applied)");
  auto* prompt_file = generate->add_option("--prompt-file", gen.prompt_file, "read the user message from a file");
  prompt_text->excludes(prompt_file);
  generate->add_option("--max-tokens", gen.max_tokens, "most tokens to generate")->capture_default_str();
  generate->add_flag("--raw-prompt", gen.raw, "use the prompt as is, without the chat template");
  generate->add_flag("--json", gen.json, "print one JSON object instead of streaming");
  generate->add_flag("--keep-sequence", gen.keep_sequence,
                     "leave the sequence in the daemon after exiting (kept for the tenant; needs --daemon)");
  generate->add_option("--selection-trace", gen.selection_trace,
                       "write the rows selected at every step (for specache-bench reuse)");
  generate->add_option("--batch-prompts", gen.batch_prompts,
                       "more prompts, one per line, decoded with --prompt as one ragged batch (GPU model)");
  AddKvOptions(generate, &gen.kv);

  NiahArgs niah_args, grid_args;
  auto add_niah = [](CLI::App* cmd, NiahArgs* a, bool grid) {
    AddModelOption(cmd, &a->model);
    cmd->add_option("--haystack", a->haystack_file, "text file the needle hides in")->required();
    cmd->add_option("--needle", a->needle, "sentence inserted into the text")->required();
    cmd->add_option("--question", a->question, "question asked after the text")->required();
    cmd->add_option("--answer", a->answer, "counted correct when the output contains it (any case)")->required();
    cmd->add_option("--max-tokens", a->max_tokens, "most tokens of the answer")->capture_default_str();
    AddKvOptions(cmd, &a->kv);
    if (grid) {
      cmd->add_option("--lengths", a->lengths, "context lengths in tokens (whole prompt)")->delimiter(',')->capture_default_str();
      cmd->add_option("--depths", a->depths, "needle depths in [0, 1]")->delimiter(',')->capture_default_str();
      cmd->add_option("--modes", a->modes,
                      "KV modes as MODE[:BITS][/OPTION...], e.g. full,kivi:1,specache:1,specache:1/select=union/resident "
                      "(options: select=, topk=, topk-real=, next, no-next, resident, no-resident, mass=, k-min=, k-max=, "
                      "cached-rows=, seed=, reduction=; "
                      "default: --kv)")
          ->delimiter(',');
      cmd->add_option("--out-dir", a->out_dir, "where niah_grid.json and the PNG heat maps go (created if missing; checked before the first point)")->capture_default_str();
    } else {
      a->lengths.resize(1);
      a->depths.resize(1);
      cmd->add_option("--context-tokens", a->lengths[0], "prompt length in tokens (template included)")->required();
      cmd->add_option("--depth", a->depths[0], "needle depth in [0, 1]")->required();
      cmd->add_flag("--json", a->json, "print one JSON object per mode");
    }
  };
  CLI::App* niah = app.add_subcommand("niah", "one needle-in-a-haystack trial");
  add_niah(niah, &niah_args, false);
  CLI::App* grid = app.add_subcommand("niah-grid", "needle-in-a-haystack over lengths x depths x modes");
  add_niah(grid, &grid_args, true);

  FidelityArgs fid;
  CLI::App* fidelity = app.add_subcommand("fidelity", "next-token distributions vs full, teacher-forced on a text");
  AddModelOption(fidelity, &fid.model);
  fidelity->add_option("--text", fid.text_file, "text file")->required();
  fidelity->add_option("--context-tokens", fid.context_tokens, "tokens prefilled")->capture_default_str();
  fidelity->add_option("--eval-tokens", fid.eval_tokens, "positions decoded and compared")->capture_default_str();
  fidelity->add_option("--modes", fid.modes,
                       "several KV modes as MODE[:BITS][/OPTION...] (as niah-grid's) sharing one prefill and one full "
                       "reference")
      ->delimiter(',');
  fidelity->add_flag("--json", fid.json, "print one JSON object per mode");
  AddKvOptions(fidelity, &fid.kv);

  LogitsArgs logit_args;
  CLI::App* logits = app.add_subcommand("logits", "prompt tokens and next-token logits (full mode) as JSON");
  AddModelOption(logits, &logit_args.model);
  logits->add_option("--prompt", logit_args.prompt, "prompt text")->required();
  logits->add_flag("--raw-prompt", logit_args.raw, "no chat template (special tokens in the text are parsed)");
  logits->add_flag("--no-special", logit_args.no_special, "with --raw-prompt: special tokens in the text stay text");
  logits->add_option("--out", logit_args.out, "output file (default stdout)");

  BenchArgs bench_args;
  CLI::App* bench = app.add_subcommand("bench", "decode throughput of the whole model on the GPU at a fixed GPU memory "
                                                "budget, per KV mode (random weights)");
  ThroughputOptions& bo = bench_args.options;
  bench->add_option("--shape", bo.shape, "model shape: llama3-8b or smollm2 (random weights)")->capture_default_str();
  bench->add_option("--context", bo.contexts, "tokens per sequence (repeatable, or comma-separated)")
      ->delimiter(',')
      ->capture_default_str();
  bench->add_option("--gpu-mem-budget", bench_args.budget, "GPU memory for weights + KV + workspace (48GB, 40GiB, bytes)")
      ->capture_default_str();
  bench->add_option("--kv", bench_args.modes,
                    "mode (repeatable, run in this order): fp16, kivi, specache, specache-nonspec, full-offload (default: all, "
                    "specache first); "
                    "specache and specache-nonspec run the paper's rule (k rows, only they attended), or, with "
                    "options after '/' (e.g. specache/select=union, as --modes elsewhere), specache-run's "
                    "generation defaults with those options; host-rows=int8 alone keeps the mode's own rule and stores "
                    "the host's rows as int8")
      ->delimiter(',');
  bench->add_option("--bits", bo.bits, "bits of the low-bit replica")->capture_default_str();
  bench->add_option("--group", bo.group, "quantization group G")->capture_default_str();
  bench->add_option("--residual", bo.residual, "full-precision residual window R")->capture_default_str();
  bench->add_option("--topk", bo.topk, "rows fetched per KV head and layer")->capture_default_str();
  bench->add_option("--steps", bo.steps, "timed decode steps per mode")->capture_default_str();
  bench->add_option("--max-batch", bo.max_batch, "largest batch tried")->capture_default_str();
  bench->add_option("--host-ram-fraction", bo.host_ram_fraction,
                    "share of MemAvailable the full-precision KV may take")->capture_default_str();
  bench->add_option("--sdpa-script", bo.sdpa_script,
                    "tools/bench/fp16_baseline.py: runs PyTorch SDPA at the fp16 batch next to the fp16 row");
  bench->add_option("--python", bo.python, "Python with PyTorch, for --sdpa-script")->capture_default_str();
  bench->add_option("--fetch-overlap", bo.fetch_overlap,
                    "when the CUDA agent queues each layer's speculative fetch: from-selection, beside-next-attention, "
                    "within-next-attention (agent.h, FetchOverlap)")
      ->capture_default_str()
      ->check(CLI::IsMember(specache::FetchOverlapNames()));
  bench->add_option("--fetch-via", bo.fetch_via,
                    "how the CUDA agent moves the speculative fetch's rows: sm-loads (the fetch kernel reads the mapped "
                    "pages) or copy-engine (host threads gather them, one copy per layer; agent.h, FetchVia)")
      ->capture_default_str()
      ->check(CLI::IsMember(specache::FetchViaNames()));
  bench->add_option("--fetch-threads", bo.fetch_threads, "host threads of the copy-engine fetch (0: the agent's default)")
      ->check(CLI::NonNegativeNumber);
  bench->add_flag("--host-huge-pages,!--no-host-huge-pages", bo.host_huge_pages,
                  "ask for transparent huge pages for the full-precision rows' host memory (default on): the fetch's "
                  "random row reads then miss the TLB far less (GatherPageRows over 8 GiB of pages: 1.5-2x on a 2-core x86 machine; 0.95x on a 16-core H200 host)")
      ->capture_default_str();
  bench->add_option("--fetch-copy-piece-kb", bo.fetch_copy_piece_kb,
                    "the copy-engine fetch's rows go up in copies of at most this many KiB (0: one copy a layer; "
                    "default: the agent's, 2048)")
      ->check(CLI::Range(0, 1 << 20));
  bench->add_option("--fetch-sm-share", bo.fetch_sm_share,
                    "the share of each layer's fetched sequences whose rows the copy-engine fetch leaves to SM loads, "
                    "beside its host threads' gather (agent.h, CudaAgentOptions::fetch_sm_share; default: the agent's, 0; "
                    "0.3 measured +18-23% tok/s at 8K, 48 GB, where the step waited for the gather, and -5% at 32K)")
      ->check(CLI::Range(0.0, 1.0));
  bench->add_option("--fetch-gather-stores", bo.fetch_gather_stores,
                    "how the copy-engine fetch's host gather writes its pinned buffer: cached (plain stores, left in "
                    "the CPU's caches for the copy engine; the agent's default) or streaming (non-temporal stores; "
                    "CudaAgentOptions::fetch_streaming_stores)")
      ->check(CLI::IsMember({"streaming", "cached"}));
  bench->add_option("--fetch-gather-spin-us", bo.fetch_gather_spin_us,
                    "the copy-engine fetch's host gather on threads of the agent's own that spin this many "
                    "microseconds between layers before they sleep (CudaAgentOptions::fetch_gather_spin_us; 0, the "
                    "default: OpenMP's threads, which this program runs with OMP_WAIT_POLICY=passive unless set)")
      ->check(CLI::NonNegativeNumber);
  bench->add_option("--selection-stream", bo.selection_stream,
                    "where each layer's top-k runs: own (a stream of its own, beside the model's kernels after the "
                    "attention; the agent's default) or compute (in order on the model's stream; "
                    "CudaAgentOptions::selection_on_own_stream)")
      ->check(CLI::IsMember({"own", "compute"}));
  bench->add_option("--plan-threads", bo.plan_threads,
                    "host threads that build a decode layer's attention items (0: the agent's default, 1)")
      ->check(CLI::Range(0, 64));
  bench->add_option("--fetch-blocks", bo.fetch_blocks,
                    "most blocks of the fetch kernel, and the CTA slots the attention leaves them (0: the agent's "
                    "default)")
      ->check(CLI::NonNegativeNumber);
  bench->add_option("--replica-layout", bo.replica_layout,
                    "mma: 1-bit replicas in the decode attention's mma layout (its lean path; agent.h, "
                    "CudaAgentOptions::mma_codes); natural: the previous layout and kernel, for comparison")
      ->capture_default_str()
      ->check(CLI::IsMember({"mma", "natural"}));
  bench->add_flag("--profile-step", bo.profile_step,
                  "one more untimed decode step of each measured run, between cudaProfilerStart and cudaProfilerStop "
                  "(for ncu --profile-from-start off); with --prefill, the prefill too");
  bench->add_option("--host-delay-us", bo.host_delay_us,
                    "a probe: the host busy-waits this long before each layer's attention of every decode step; if the "
                    "step grows by layers x this, the host's pace sets the step's (0: none)")
      ->check(CLI::NonNegativeNumber);
  bench->add_flag("--host-delay-before-projections", bo.host_delay_before_projections,
                  "--host-delay-us before each layer's first products instead of its attention");
  bench->add_flag("--step-ahead,!--no-step-ahead", bo.step_ahead,
                  "queue each timed decode step while the GPU runs the one before, fed its greedy tokens on the device "
                  "(GpuEngine::QueueGreedyStep), as serving engines do (the default), or with --no-step-ahead wait for "
                  "each step's tokens before queueing the next; the phase split stays one step at a time");
  bench->add_flag("!--no-model-graphs", bo.model_graphs,
                  "launch the model's products and small kernels one by one in every decode step instead of replaying "
                  "them from CUDA graphs");
  bench->add_option_function<std::string>(
           "--gemm", [&bo](const std::string& g) { bo.timed_gemms = g == "timed"; },
           "the model's matrix products: default (cuBLAS's default kernel for every shape) or timed (each shape's "
           "fastest of that default and cuBLASLt's heuristic candidates, timed at its first call outside a "
           "capture; a prefill's shapes stay the default's; tools/src/gpu/model_gemm.h)")
      ->check(CLI::IsMember({"default", "timed"}));
  bench->add_option("--prefill", bo.prefill,
                    "BxT, e.g. 8x8192: also time the whole model's prefill of B prompts of T tokens in each specache "
                    "mode of --kv (plain specache when none), the first next to PyTorch's fp16 prefill with --sdpa-script");
  bench->add_flag("--json", bench_args.json, "print one JSON object per row on stdout");
  bench->add_option("--json-out", bench_args.json_out, "also write all rows to this file (a JSON array)");
  bench->add_option("--plot", bench_args.plot, "write tokens/s over context per mode as a PNG");
  bench->add_option("--merge", bench_args.merge, "rows of earlier runs (--json-out files) to plot with these");
  bench->add_flag("--plot-only", bench_args.plot_only, "measure nothing: plot the --merge rows");

  app.set_version_flag("--version", "specache-run " SPECACHE_VERSION);
  if (const int code = specache::ParseCommandLine(app, argc, argv); code >= 0) return code;
  if (generate->parsed()) return Report(Generate(gen));
  if (niah->parsed()) return Report(Niah(niah_args));
  if (grid->parsed()) return Report(NiahGrid(grid_args));
  if (fidelity->parsed()) return Report(Fidelity(fid));
  if (logits->parsed()) return Report(Logits(logit_args));
  if (bench->parsed()) return Report(Bench(bench_args));
  return 1;
}
