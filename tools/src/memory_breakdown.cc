#include "memory_breakdown.h"

#include <cstdio>
#include <vector>

#include "specache/head_replica.h"

namespace specache::run {
namespace {

std::string Mib(double bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f MiB", bytes / (1 << 20));
  return buf;
}

}  // namespace

nlohmann::json MemoryBreakdown(const ModelShape& shape, const KvConfig& config, int tokens, const AgentStats& stats) {
  const int64_t heads = int64_t{shape.n_layers} * shape.n_kv_heads;
  const int64_t row_bytes = int64_t{2} * shape.head_dim * static_cast<int64_t>(sizeof(Half));  // K and V
  nlohmann::json j;
  j["tokens"] = tokens;
  j["device_bytes"] = stats.device_bytes;
  j["fp16_bytes"] = stats.full_precision_bytes;
  j["ratio"] = stats.full_precision_bytes > 0
                   ? static_cast<double>(stats.device_bytes) / static_cast<double>(stats.full_precision_bytes)
                   : 0.0;
  // The host's copy of those rows, in the row format the source stores (int8: about half).
  j["host_row_format"] = std::string(HostRowFormatName(config.host_row_format));
  j["host_bytes"] = stats.full_precision_bytes / HostRowBytes(HostRowFormat::kFp16, shape.head_dim) *
                    HostRowBytes(config.host_row_format, shape.head_dim);
  if (config.mode == KvMode::kFull || tokens <= 0) return j;
  // One real replica of this length: its bytes are the codes, scales and fp16 window exactly as
  // the agent stores them (the values do not change the size).
  HeadReplica replica({shape.head_dim, config.key_bits, config.value_bits, config.group_size, config.residual_tokens});
  const std::vector<Half> zeros(static_cast<size_t>(tokens) * shape.head_dim);
  replica.Append(zeros.data(), zeros.data(), tokens);
  const int64_t window_tokens = replica.residual_keys() + replica.window_values();  // keys and values in fp16
  const int64_t window = heads * window_tokens * shape.head_dim * static_cast<int64_t>(sizeof(Half));
  const int64_t replicas = heads * replica.device_bytes();
  j["residual_tokens"] = config.residual_tokens;
  j["residual_window_bytes"] = window;
  j["codes_bytes"] = replicas - window;
  j["row_cache_bytes"] = std::max<int64_t>(stats.device_bytes - replicas, 0);
  j["row_cache_rows_per_head"] = stats.device_bytes > replicas ? (stats.device_bytes - replicas) / heads / row_bytes : 0;
  return j;
}

std::string MemoryLines(const nlohmann::json& b, const std::string& prefix) {
  char line[256];
  std::snprintf(line, sizeof line, "%sdevice KV %s = %.3f of the %s fp16 KV of %d tokens\n", prefix.c_str(),
                Mib(b["device_bytes"].get<double>()).c_str(), b["ratio"].get<double>(),
                Mib(b["fp16_bytes"].get<double>()).c_str(), b["tokens"].get<int>());
  std::string out = line;
  if (b.value("host_row_format", "fp16") != "fp16") {
    std::snprintf(line, sizeof line, "%shost rows %s (%s)\n", prefix.c_str(), Mib(b["host_bytes"].get<double>()).c_str(),
                  b["host_row_format"].get<std::string>().c_str());
    out += line;
  }
  if (!b.contains("codes_bytes")) return out;
  std::snprintf(line, sizeof line,
                "%sof which fixed: fp16 residual window (R = %d) %s, row cache %s; low-bit codes and scales %s\n",
                prefix.c_str(), b["residual_tokens"].get<int>(), Mib(b["residual_window_bytes"].get<double>()).c_str(),
                Mib(b["row_cache_bytes"].get<double>()).c_str(), Mib(b["codes_bytes"].get<double>()).c_str());
  return out + line;
}

}  // namespace specache::run
