// What the agent is told about the model and how to keep its KV cache.
//
// Terms (docs/method.md): G = quantization group size, R = full-precision residual
// window, k = rows fetched per (sequence, layer, KV head) per decode step.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "specache/status.h"

namespace specache {

using SequenceId = uint64_t;

// Attention shapes of the model. GQA: n_q_heads / n_kv_heads query heads share one KV head.
struct ModelShape {
  int n_layers = 0;
  int n_q_heads = 0;
  int n_kv_heads = 0;
  int head_dim = 0;

  int group_size() const { return n_kv_heads > 0 ? n_q_heads / n_kv_heads : 0; }
};

// INVALID_ARGUMENT unless every dimension is positive, n_q_heads is a multiple of n_kv_heads and
// head_dim is a multiple of 8 (16-byte fp16 rows for the gather kernels).
Status ValidateModelShape(const ModelShape& shape);

enum class KvMode {
  kFull,             // no quantization: every token kept in fp16 on the device
  kKivi,             // low-bit replica only; one row per sequence per step
  kSpeCache,         // replica + speculative row picks the top-k to prefetch for the next step
  kSpeCacheNonSpec,  // replica + fetch the real row's own top-k, then recompute (Table 4 baseline)
};

// "full", "kivi", "specache", "specache-nonspec".
std::string_view KvModeName(KvMode mode);
Result<KvMode> ParseKvMode(std::string_view name);

// How the query heads of one GQA group are combined into one score per token for the top-k.
enum class GroupReduction {
  kMean,  // average of the heads' attention probabilities (the unofficial reproduction's choice)
  kMax,   // largest probability of any head in the group
};

std::string_view GroupReductionName(GroupReduction reduction);
Result<GroupReduction> ParseGroupReduction(std::string_view name);

struct KvConfig {
  KvMode mode = KvMode::kSpeCache;
  int key_bits = 1;          // 1, 2, 4 or 16 (16 = fp16 pass-through)
  int value_bits = 1;        // 1, 2, 4 or 16
  int group_size = 32;       // G: multiple of 32; divides residual_tokens and head_dim
  int residual_tokens = 64;  // R: multiple of G
  int top_k = 64;            // k: rows fetched per (sequence, layer, KV head); > 0 for specache modes
  // Rows kept on the device per (sequence, layer, KV head) for reuse: the selection plus the most
  // recently selected others (row_cache.h). 0: 2 * top_k; otherwise at least top_k.
  int cached_rows = 0;
  GroupReduction reduction = GroupReduction::kMean;

  // The bits that actually apply: kFull stores everything in 16 bits whatever key_bits say.
  int effective_key_bits() const { return mode == KvMode::kFull ? 16 : key_bits; }
  int effective_value_bits() const { return mode == KvMode::kFull ? 16 : value_bits; }
  bool fetches_rows() const { return mode == KvMode::kSpeCache || mode == KvMode::kSpeCacheNonSpec; }
  int cache_rows() const { return cached_rows > 0 ? cached_rows : 2 * top_k; }
};

// INVALID_ARGUMENT, with a message naming the parameter, when the config cannot be used with the
// shape: unsupported bit width, G not a positive multiple of 32, G not dividing R or head_dim,
// k <= 0 in a mode that fetches rows.
Status ValidateKvConfig(const KvConfig& config, const ModelShape& shape);

// One line, e.g. "specache K1/V1 G=32 R=64 k=64 mean".
std::string DescribeKvConfig(const KvConfig& config);

}  // namespace specache
