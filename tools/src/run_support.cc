#include "run_support.h"

#include <algorithm>

#include "specache/device_probe.h"
#include "specache/host_tensor_agent.h"
#include "memory_breakdown.h"
#include "unicode_classes.h"

namespace specache::run {

Result<LoadedModel> LoadModel(const std::string& path) {
  LoadedModel m;
  SPECACHE_ASSIGN_OR_RETURN(m.file, gguf::GgufFile::Open(path));
  SPECACHE_ASSIGN_OR_RETURN(m.model, LlamaModel::Load(*m.file));
  SPECACHE_ASSIGN_OR_RETURN(m.tokenizer, BpeTokenizer::FromGguf(*m.file));
  if (m.tokenizer->vocab_size() != m.model->config().vocab) {
    return Status::DataLoss("tokenizer has " + std::to_string(m.tokenizer->vocab_size()) + " tokens, the model " +
                            std::to_string(m.model->config().vocab));
  }
  auto chat = ChatTemplate::FromGguf(*m.file);
  if (chat.ok()) m.chat = *chat;
  if (m.tokenizer->eos_id() >= 0) m.stop_ids.push_back(m.tokenizer->eos_id());
  for (const char* stop : {"<|im_end|>", "<|endoftext|>"}) {
    const int32_t id = m.tokenizer->Find(stop);
    if (id >= 0 && std::find(m.stop_ids.begin(), m.stop_ids.end(), id) == m.stop_ids.end()) m.stop_ids.push_back(id);
  }
  return m;
}

namespace {

Result<int> ParseCount(const std::string& key, const std::string& text) {
  try {
    size_t used = 0;
    const int v = std::stoi(text, &used);
    if (used == text.size()) return v;
  } catch (const std::exception&) {
  }
  return Status::InvalidArgument("mode option " + key + "=" + text + ": not a whole number");
}

// One "/key[=value]" option of a mode spec.
Status ApplyModeOption(const std::string& option, KvOptions* o) {
  const size_t eq = option.find('=');
  const std::string key = option.substr(0, eq), value = eq == std::string::npos ? "" : option.substr(eq + 1);
  if (key == "resident" && value.empty()) {
    o->attend_resident = true;
  } else if (key == "no-resident" && value.empty()) {
    o->attend_resident = false;
  } else if (key == "next" && value.empty()) {
    o->real_next = true;
  } else if (key == "no-next" && value.empty()) {
    o->real_next = false;
  } else if (key == "select") {
    o->select = value;
  } else if (key == "reduction") {
    o->reduction = value;
  } else if (key == "mass") {
    try {
      size_t used = 0;
      o->mass = std::stod(value, &used);
      if (used != value.size()) throw std::invalid_argument(value);
    } catch (const std::exception&) {
      return Status::InvalidArgument("mode option mass=" + value + ": not a number");
    }
  } else if (key == "topk") {
    SPECACHE_ASSIGN_OR_RETURN(o->topk, ParseCount(key, value));
  } else if (key == "topk-real") {
    SPECACHE_ASSIGN_OR_RETURN(o->topk_real, ParseCount(key, value));
  } else if (key == "k-min") {
    SPECACHE_ASSIGN_OR_RETURN(o->k_min, ParseCount(key, value));
  } else if (key == "k-max") {
    SPECACHE_ASSIGN_OR_RETURN(o->k_max, ParseCount(key, value));
  } else if (key == "cached-rows") {
    SPECACHE_ASSIGN_OR_RETURN(o->cached_rows, ParseCount(key, value));
  } else if (key == "seed") {
    SPECACHE_ASSIGN_OR_RETURN(o->seed_rows, ParseCount(key, value));
  } else if (key == "host-rows") {
    o->host_rows = value;
  } else {
    return Status::InvalidArgument("unknown mode option '" + option +
                                   "' (select=, topk=, topk-real=, next, no-next, resident, no-resident, mass=, k-min=, k-max=, "
                                   "cached-rows=, seed=, reduction=, host-rows=)");
  }
  return Status::Ok();
}

std::string Trimmed(double v) {
  std::string s = std::to_string(v);
  while (!s.empty() && s.back() == '0') s.pop_back();
  if (!s.empty() && s.back() == '.') s.pop_back();
  return s;
}

}  // namespace

Status SetHostRows(const std::string& name, KvConfig* c) {
  // Only the modes that fetch rows read any back (full, kivi and a fidelity run's full reference
  // take the same options).
  if (name == "int8") {
    if (c->fetches_rows()) c->host_row_format = HostRowFormat::kInt8;
    return Status::Ok();
  }
  SPECACHE_ASSIGN_OR_RETURN(const HostRowRounding rounding, ParseHostRowRounding(name));
  c->round_host_rows = c->fetches_rows() ? rounding : HostRowRounding::kNone;
  return Status::Ok();
}

Result<KvConfig> ToConfig(const KvOptions& options, const std::string& mode) {
  KvOptions o = options;
  std::string name = mode.empty() ? o.kv : mode;
  for (size_t slash = name.find('/'); slash != std::string::npos; slash = name.find('/')) {
    std::string rest = name.substr(slash + 1);
    name.resize(slash);
    const size_t next = rest.find('/');
    SPECACHE_RETURN_IF_ERROR(ApplyModeOption(rest.substr(0, next), &o));
    if (next != std::string::npos) name += rest.substr(next);
  }
  int bits = o.bits, key_bits = o.key_bits, value_bits = o.value_bits;
  if (const size_t colon = name.find(':'); colon != std::string::npos) {
    try {
      bits = std::stoi(name.substr(colon + 1));
    } catch (const std::exception&) {
      return Status::InvalidArgument("mode '" + name + "': bits after ':' must be a number");
    }
    key_bits = value_bits = 0;
    name = name.substr(0, colon);
  }
  KvConfig c;
  SPECACHE_ASSIGN_OR_RETURN(c.mode, ParseKvMode(name));
  SPECACHE_ASSIGN_OR_RETURN(c.reduction, ParseGroupReduction(o.reduction));
  SPECACHE_ASSIGN_OR_RETURN(c.select, ParseSelectFrom(o.select));
  c.key_bits = key_bits ? key_bits : bits;
  c.value_bits = value_bits ? value_bits : bits;
  c.group_size = o.group;
  c.residual_tokens = o.residual;
  c.top_k = o.topk;
  c.cached_rows = o.cached_rows;
  c.top_k_real = o.topk_real;
  c.real_next = o.real_next;
  c.attend_resident = o.attend_resident;
  c.mass = o.mass;
  c.k_min = o.k_min;
  c.k_max = o.k_max;
  c.seed_rows = c.mode == KvMode::kSpeCache ? o.seed_rows : 0;  // (full, kivi and the others have no row cache to seed)
  SPECACHE_RETURN_IF_ERROR(SetHostRows(o.host_rows, &c));
  if (c.fetches_rows() && c.cached_rows == 0) c.cached_rows = std::max(kDefaultCachedRows, 2 * c.max_selected());
  return c;
}

std::string ModeLabel(const KvConfig& c) {
  std::string label(KvModeName(c.mode));
  if (c.mode == KvMode::kFull) return label;
  if (c.key_bits == c.value_bits) {
    label += "-" + std::to_string(c.key_bits) + "bit";
  } else {
    label += "-k" + std::to_string(c.key_bits) + "v" + std::to_string(c.value_bits);
  }
  if (!c.fetches_rows()) return label;
  // What differs from the command line's defaults.
  const Result<KvConfig> defaults = ToConfig(KvOptions{}, std::string(KvModeName(c.mode)));
  if (!defaults.ok()) return label;
  const KvConfig& d = *defaults;
  if (c.mode == KvMode::kSpeCache && (c.select != d.select || c.extra_rows() != d.extra_rows())) {
    label += "+" + std::string(SelectFromName(c.select));
    if (c.extra_rows() > 0) label += std::to_string(c.extra_rows());
  }
  const bool ranks_real = c.mode == KvMode::kSpeCache && c.select != SelectFrom::kSpeculative;
  if (ranks_real && c.real_next != d.real_next) label += c.real_next ? "+next" : "+no-next";
  if (c.adaptive()) {
    label += "+mass" + Trimmed(c.mass) + "k" + std::to_string(c.k_min) + "-" + std::to_string(c.k_max);
  } else if (c.top_k != d.top_k || d.adaptive()) {
    label += "+k" + std::to_string(c.top_k);
  }
  if (c.attend_resident != d.attend_resident) label += c.attend_resident ? "+resident" : "+no-resident";
  if (c.cached_rows != d.cached_rows) label += "+cache" + std::to_string(c.cache_rows());
  if (c.reduction != d.reduction) label += "+" + std::string(GroupReductionName(c.reduction));
  if (c.seed_rows != d.seed_rows) label += "+seed" + std::to_string(c.seed_rows);
  if (c.host_row_format != d.host_row_format) label += "+host-" + std::string(HostRowFormatName(c.host_row_format));
  if (c.round_host_rows != d.round_host_rows) label += "+host-" + std::string(HostRowRoundingName(c.round_host_rows));
  return label;
}

Result<std::unique_ptr<ModeRun>> MakeModeRun(const LlamaModel& model, const KvConfig& config, KvMemory* memory,
                                             const std::string& backend) {
  auto run = std::make_unique<ModeRun>();
  run->label = ModeLabel(config);
  run->config = config;
  if (memory) {
    SPECACHE_ASSIGN_OR_RETURN(run->source, memory->NewSource());
  } else {
    run->source = std::make_unique<InMemorySource>();
  }
  static const bool gpu_usable = ProbeCudaDevice().ok();  // once per process, not once per mode run
  // A source without zero-copy pages (a remote daemon's) takes the CUDA agent's staged path.
  const bool cuda = backend == "cuda" || (backend == "auto" && gpu_usable);
  if (backend != "cpu" && backend != "cuda" && backend != "auto") {
    return Status::InvalidArgument("--backend is auto, cpu or cuda, not '" + backend + "'");
  }
  if (cuda) {
    CudaAgentOptions options;
    options.capacity_tokens = model.config().context_length;
    SPECACHE_ASSIGN_OR_RETURN(auto device_agent, CreateCudaAgent(model.shape(), config, run->source.get(), options));
    SPECACHE_ASSIGN_OR_RETURN(run->agent, WrapHostTensors(std::move(device_agent)));
  } else {
    SPECACHE_ASSIGN_OR_RETURN(run->agent, CreateCpuAgent(model.shape(), config, run->source.get()));
  }
  return run;
}

Result<std::unique_ptr<KvMemory>> OpenKvMemory(const KvOptions& o, const LlamaModel& model, int sequences) {
  KvMemoryOptions m;
  m.where = o.daemon.empty() ? o.kv_memory : "daemon";
  m.socket = o.daemon;
  m.capacity_tokens = static_cast<uint32_t>(model.config().context_length);
  const LlamaConfig& c = model.config();
  const uint64_t pages = (m.capacity_tokens + m.page_tokens - 1) / m.page_tokens;
  // fp16 rows, the larger format, whatever each mode stores.
  const uint64_t page_bytes = uint64_t{static_cast<uint32_t>(c.n_kv_heads)} * m.page_tokens *
                              static_cast<uint64_t>(SequenceLayout{c.n_layers, c.n_kv_heads, c.head_dim}.row_bytes());
  // Whole pages per layer at full context, plus a chunk of slack for page placement.
  m.session_bytes = uint64_t(sequences) * c.n_layers * pages * page_bytes + (uint64_t{16} << 20);
  return KvMemory::Open(m);
}

Result<Generation> GenerateGreedy(const LoadedModel& m, Decoder* decoder, std::span<const float> first_logits,
                                  int max_tokens, const std::function<void(std::string_view)>& on_text) {
  Generation g;
  std::string pending;  // bytes not yet shown (an unfinished UTF-8 character)
  int32_t token = Argmax(first_logits);
  SPECACHE_RETURN_IF_ERROR(decoder->Start(token));
  while (true) {
    if (std::find(m.stop_ids.begin(), m.stop_ids.end(), token) != m.stop_ids.end()) break;
    g.tokens.push_back(token);
    const int32_t one[] = {token};
    pending += m.tokenizer->Decode(one);
    const size_t complete = text::CompleteUtf8Prefix(pending);
    if (complete > 0) {
      if (on_text) on_text(std::string_view(pending).substr(0, complete));
      g.text += pending.substr(0, complete);
      pending.erase(0, complete);
    }
    if (static_cast<int>(g.tokens.size()) >= max_tokens) break;
    SPECACHE_ASSIGN_OR_RETURN(std::span<const float> logits, decoder->Step(token));
    token = Argmax(logits);
  }
  if (!pending.empty()) {
    if (on_text) on_text(pending);
    g.text += pending;
  }
  g.decode_seconds = decoder->decode_seconds();
  return g;
}

nlohmann::json Figures(const ModeRun& run, double prefill_seconds, int prompt_tokens, const Decoder& decoder) {
  const AgentStats s = run.agent->stats();
  nlohmann::json j;
  j["kv"] = std::string(KvModeName(run.config.mode));
  j["backend"] = std::string(run.agent->backend_name());
  j["mode"] = run.label;
  if (run.config.mode != KvMode::kFull) {
    j["key_bits"] = run.config.key_bits;
    j["value_bits"] = run.config.value_bits;
    j["group"] = run.config.group_size;
    j["residual"] = run.config.residual_tokens;
  }
  if (run.config.fetches_rows()) {
    const KvConfig& c = run.config;
    j["topk"] = c.top_k;
    j["cached_rows"] = c.cache_rows();
    j["select"] = std::string(SelectFromName(c.select));
    j["topk_real"] = c.extra_rows();
    j["real_next"] = c.real_next;
    j["attend_resident"] = c.attend_resident;
    j["mass"] = c.mass;
    j["seed_rows"] = c.seed_rows;
    // "int8": stored int8 rows; "e4m3": fp16 rows rounded to E4M3 (the names of --host-rows).
    j["host_rows"] = c.host_row_format != HostRowFormat::kFp16 ? std::string(HostRowFormatName(c.host_row_format))
                                                                : std::string(HostRowRoundingName(c.round_host_rows));
    if (c.adaptive()) {
      j["k_min"] = c.k_min;
      j["k_max"] = c.k_max;
    }
    j["selection"] = DescribeKvConfig(c);
  }
  j["device_kv_bytes"] = s.device_bytes;
  const int64_t fp16_row_bytes = int64_t{run.agent->shape().n_layers} * run.agent->shape().n_kv_heads * 2 *
                                 run.agent->shape().head_dim * static_cast<int64_t>(sizeof(Half));
  j["device_kv"] = MemoryBreakdown(run.agent->shape(), run.config,
                                   static_cast<int>(s.full_precision_bytes / std::max<int64_t>(fp16_row_bytes, 1)), s);
  j["full_precision_bytes"] = s.full_precision_bytes;
  j["device_to_fp16_ratio"] =
      s.full_precision_bytes > 0 ? static_cast<double>(s.device_bytes) / static_cast<double>(s.full_precision_bytes) : 0.0;
  j["rows_selected"] = s.rows_selected;
  j["rows_fetched"] = s.rows_fetched;
  j["rows_reused"] = s.rows_reused;
  j["bytes_fetched"] = s.bytes_fetched;
  j["commits_failed"] = s.commits_failed;
  // The CUDA agent's copy-engine fetch: its worker thread's waits and gathers (agent.h).
  j["fetch_host_list_wait_ns"] = s.fetch_host_list_wait_ns;
  j["fetch_host_buffer_wait_ns"] = s.fetch_host_buffer_wait_ns;
  j["fetch_host_gather_ns"] = s.fetch_host_gather_ns;
  j["fetch_caller_wait_ns"] = s.fetch_caller_wait_ns;
  // The resident-row cache: bytes per decode step with it, and without it (every selected row).
  if (s.steps > 0 && s.rows_selected > 0) {
    // A row as the source stores it (K and V of one token and KV head), what a fetched row moves.
    const double row_bytes = static_cast<double>(HostRowBytes(run.config.host_row_format, run.agent->shape().head_dim));
    j["fetch_bytes_per_step"] = static_cast<double>(s.bytes_fetched) / s.steps;
    j["fetch_bytes_per_step_without_reuse"] = static_cast<double>(s.rows_selected) * row_bytes / s.steps;
    j["fetch_ratio_to_no_reuse"] = static_cast<double>(s.rows_fetched) / s.rows_selected;
    // Per (layer, KV head) and decode step (the pre-decode step's selection counts in too).
    const double head_steps = static_cast<double>(s.steps) * run.agent->shape().n_layers * run.agent->shape().n_kv_heads;
    j["rows_selected_per_head_step"] = static_cast<double>(s.rows_selected) / head_steps;
    j["rows_fetched_per_head_step"] = static_cast<double>(s.rows_fetched) / head_steps;
  }
  j["prefill_seconds"] = prefill_seconds;
  j["prefill_tokens_per_s"] = prefill_seconds > 0 ? prompt_tokens / prefill_seconds : 0.0;
  j["decode_steps"] = decoder.steps();
  j["decode_seconds"] = decoder.decode_seconds();
  j["decode_tokens_per_s"] = decoder.decode_seconds() > 0 ? decoder.steps() / decoder.decode_seconds() : 0.0;
  return j;
}

Result<uint64_t> ParseBytes(const std::string& text) {
  size_t used = 0;
  double v = 0;
  try {
    v = std::stod(text, &used);
  } catch (...) {
    return Status::InvalidArgument("not a size: '" + text + "'");
  }
  const std::string unit = text.substr(used);
  double scale = 1;
  if (unit == "GB" || unit == "G") scale = 1e9;
  else if (unit == "GiB") scale = double(uint64_t{1} << 30);
  else if (unit == "MB" || unit == "M") scale = 1e6;
  else if (unit == "MiB") scale = double(uint64_t{1} << 20);
  else if (!unit.empty() && unit != "B") return Status::InvalidArgument("unknown unit in '" + text + "' (B, MB, MiB, GB, GiB)");
  if (v <= 0) return Status::InvalidArgument("size must be positive: '" + text + "'");
  return static_cast<uint64_t>(v * scale);
}

}  // namespace specache::run
