// What the agent is told about the model and how to keep its KV cache.
//
// Terms (docs/method.md): G = quantization group size, R = full-precision residual
// window, k = rows fetched per (sequence, layer, KV head) per decode step.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "specache/host_rows.h"
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
  // Diagnostic, for measuring only: like kSpeCacheNonSpec, but the real row's rows are chosen by
  // its exact full-precision scores (every row is read from the source at every step). It bounds
  // what any selection can reach with the same budget.
  kSpeCacheOracle,
};

// "full", "kivi", "specache", "specache-nonspec", "specache-oracle".
std::string_view KvModeName(KvMode mode);
Result<KvMode> ParseKvMode(std::string_view name);

// How the query heads of one GQA group are combined into one score per token for the top-k.
enum class GroupReduction {
  kMean,  // average of the heads' attention probabilities (the unofficial reproduction's choice)
  kMax,   // largest probability of any head in the group
};

std::string_view GroupReductionName(GroupReduction reduction);
Result<GroupReduction> ParseGroupReduction(std::string_view name);

// Whose scores pick the rows fetched for the next step in kSpeCache mode (docs/method.md). Both
// rows' scores are known when a layer's attention ends, so the fetch overlaps in every case.
enum class SelectFrom {
  kSpeculative,  // the speculative row's top-k (the paper)
  kReal,         // the real row's top-k: consecutive steps need many of the same rows
  kUnion,        // the speculative row's top-k plus the real row's best top_k_real others
};

// "spec", "real", "union".
std::string_view SelectFromName(SelectFrom select);
Result<SelectFrom> ParseSelectFrom(std::string_view name);

// Rounding of the full-precision rows the agent writes to its source (KvConfig::round_host_rows):
// the values of an 8- or 4-bit host copy of the KV, with the rows still stored in fp16 (a
// fidelity measure; KvConfig::host_row_format stores int8 rows for real). Each row's key half and
// value half (head_dim channels each) get one scale: the half's largest magnitude maps to the
// format's largest value (kInt8: 127, symmetric integers; kE4m3: 448, the OCP FP8 E4M3 format,
// round to nearest even; kInt4: 7, symmetric integers), the scale itself rounded to fp16, as the
// format would store it. kInt4G16: kInt4 with a scale per 16 channels instead of per half.
enum class HostRowRounding {
  kNone,  // the rows as computed (fp16)
  kInt8,
  kE4m3,
  kInt4,
  kInt4G16,
};

// "none", "int8", "e4m3", "int4", "int4-g16".
std::string_view HostRowRoundingName(HostRowRounding rounding);
Result<HostRowRounding> ParseHostRowRounding(std::string_view name);

struct KvConfig {
  KvMode mode = KvMode::kSpeCache;
  int key_bits = 1;          // 1, 2, 4 or 16 (16 = fp16 pass-through)
  int value_bits = 1;        // 1, 2, 4 or 16
  int group_size = 32;       // G: multiple of 32; divides residual_tokens and head_dim
  int residual_tokens = 64;  // R: multiple of G
  int top_k = 64;            // k: rows fetched per (sequence, layer, KV head); > 0 for specache modes
  // Rows kept on the device per (sequence, layer, KV head) for reuse: the selection plus the most
  // recently selected others (row_cache.h). 0: 2 * max_selected() (top_k, plus top_k_real for
  // kUnion; k_max with the adaptive budget); otherwise at least max_selected().
  int cached_rows = 0;
  GroupReduction reduction = GroupReduction::kMean;
  // Which row's scores select (kSpeCache; the other fetching modes select with the real row).
  SelectFrom select = SelectFrom::kSpeculative;
  int top_k_real = 0;  // kUnion: rows added from the real row's ranking; 0: top_k
  // kReal and kUnion: a token of the real row's ranking also scores its predecessor's probability
  // (per head, the larger of the two). A row the real token attends to makes the row after it a
  // candidate for the next token: what copying from the context (induction) needs next.
  bool real_next = false;
  // Attention substitutes every row of the row cache, not only the current selection: rows
  // fetched for earlier steps are on the device anyway, and cost nothing more to use.
  bool attend_resident = false;
  // Adaptive budget: when mass > 0, the top-k of a (sequence, layer, KV head) becomes the fewest
  // best-scored rows whose reduced scores reach `mass` of all candidates' (the low-bit estimate of
  // the attention mass), at least k_min and at most k_max rows; top_k is then unused. 0: fixed k.
  double mass = 0;
  int k_min = 0;
  int k_max = 0;
  // Rows a row cache starts with at prefill (kSpeCache; 0: none): the best of the prompt's
  // quantized tokens by the prompt's last token's exact attention (cpu::SeedTokens), at most
  // cache_rows(), their rows taken from the prefill's own K/V (nothing fetched: on a GPU the
  // prompt's K/V are on the device then). Needs PrefillBatch::q (INVALID_ARGUMENT without it). The
  // seeds leave the cache before any fetched row, the least attended first. Both backends, the
  // same seeds and ranks (the CUDA agent's kernels compute the CPU's scores in the CPU's order).
  int seed_rows = 0;
  // How the source stores the full-precision rows (host_rows.h): kInt8 halves the host memory a
  // sequence takes and the bytes a fetched row moves, and every row fetched back, and every row
  // a kept sequence holds, has the int8 format's values; what the attention computes at prefill
  // and in the residual window stays fp16. A sequence kept with one format is claimed only with
  // it. Both agents (the CUDA agent's kernels encode and decode with the host's arithmetic,
  // cuda_fetch.h, and match the CPU agent's outputs; there head_dim must be a multiple of 16 up
  // to 256).
  HostRowFormat host_row_format = HostRowFormat::kFp16;
  // The rows written to the source are first rounded to this 8-bit format (HostRowRounding), so
  // that every row fetched back has the values an 8-bit host copy would give, while the source
  // still stores fp16 rows: a measure of a format's fidelity before it is stored (kInt8 gives
  // exactly host_row_format kInt8's values). CPU agent only (the CUDA agent refuses it).
  HostRowRounding round_host_rows = HostRowRounding::kNone;

  // The bits that actually apply: kFull stores everything in 16 bits whatever key_bits say.
  int effective_key_bits() const { return mode == KvMode::kFull ? 16 : key_bits; }
  int effective_value_bits() const { return mode == KvMode::kFull ? 16 : value_bits; }
  bool fetches_rows() const {
    return mode == KvMode::kSpeCache || mode == KvMode::kSpeCacheNonSpec || mode == KvMode::kSpeCacheOracle;
  }
  // The modes that fetch synchronously for the step's own row (one row per step).
  bool selects_for_this_step() const { return mode == KvMode::kSpeCacheNonSpec || mode == KvMode::kSpeCacheOracle; }
  bool adaptive() const { return mass > 0; }
  // Most rows of the primary ranking (top_k, or k_max with the adaptive budget).
  int primary_rows() const { return adaptive() ? k_max : top_k; }
  // Rows added from the real row in kUnion selection (0 otherwise).
  int extra_rows() const {
    return mode == KvMode::kSpeCache && select == SelectFrom::kUnion ? (top_k_real > 0 ? top_k_real : top_k) : 0;
  }
  // Most rows one selection of a (sequence, layer, KV head) holds.
  int max_selected() const { return primary_rows() + extra_rows(); }
  int cache_rows() const { return cached_rows > 0 ? cached_rows : 2 * max_selected(); }
};

// Which row of a step's rows the primary ranking reads (selection.h): the speculative row of a
// kSpeCache decode step unless SelectFrom::kReal, else row 0.
inline int PrimaryRowOf(const KvConfig& config, bool decode_step) {
  return decode_step && config.mode == KvMode::kSpeCache && config.select != SelectFrom::kReal ? 1 : 0;
}

// INVALID_ARGUMENT, with a message naming the parameter, when the config cannot be used with the
// shape: unsupported bit width, G not a positive multiple of 32, G not dividing R or head_dim,
// k <= 0 in a mode that fetches rows, a mass outside [0, 1], k_min/k_max not 1 <= k_min <= k_max
// with a mass, cached_rows below max_selected().
Status ValidateKvConfig(const KvConfig& config, const ModelShape& shape);

// One line, e.g. "specache K1/V1 G=32 R=64 k=64 cache=128 mean" (selection options when not the
// defaults).
std::string DescribeKvConfig(const KvConfig& config);

}  // namespace specache
