// What the device copy of the KV cache is made of, for a person reading a run's figures: the
// low-bit codes and their scales (which grow with the context at a fraction of fp16), and the
// fixed parts that do not shrink with it: the full-precision residual window (R newest tokens of
// every head) and the row cache (fetched full-precision rows kept for reuse). On a short prompt
// the fixed parts dominate and the replica can be larger than the fp16 cache it stands for.
#pragma once

#include <string>

#include <nlohmann/json.hpp>

#include "specache/agent.h"

namespace specache::run {

// The split of `stats.device_bytes` for one sequence of `tokens` tokens in `config`: a real
// replica of that length (HeadReplica, the layout the agent uses) gives the codes and the window;
// the row cache is what the agent holds beyond the replicas. JSON: tokens, device_bytes,
// fp16_bytes, ratio, host_row_format, host_bytes (the host's copy of the rows, as stored),
// codes_bytes, residual_window_bytes, row_cache_bytes. Full mode: the device copy is the fp16
// cache (no split).
nlohmann::json MemoryBreakdown(const ModelShape& shape, const KvConfig& config, int tokens, const AgentStats& stats);

// Two lines for a terminal (three with host rows other than fp16), each starting with `prefix`:
//   device KV 11.3 MiB = 0.071 of the 160.0 MiB fp16 KV of 8192 tokens
//   host rows 85.0 MiB (int8)
//   of which fixed: fp16 residual window (R = 64) 2.0 MiB, row cache 0.5 MiB; low-bit codes 8.8 MiB
std::string MemoryLines(const nlohmann::json& breakdown, const std::string& prefix);

}  // namespace specache::run
