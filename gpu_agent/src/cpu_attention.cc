#include "specache/cpu_attention.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>

#include "specache/quantizer.h"
#include "specache/selection.h"

namespace specache::cpu {
namespace {

// Vectorised reduction (-fopenmp-simd): the summation order is fixed by the vector width, so the
// result is deterministic for a given build.
float Dot(const float* a, const float* b, int n) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

void HalfRowToFloat(const Half* src, int n, float* dst) {
  for (int i = 0; i < n; ++i) dst[i] = HalfToFloat(src[i]);
}

void Axpy(float a, const float* x, int n, float* y) {
  for (int i = 0; i < n; ++i) y[i] += a * x[i];
}

// In place: scores -> softmax probabilities (max-subtracted, float32).
void Softmax(float* scores, int32_t n) {
  float m = -std::numeric_limits<float>::infinity();
  for (int32_t i = 0; i < n; ++i) m = std::max(m, scores[i]);
  float sum = 0.0f;
  for (int32_t i = 0; i < n; ++i) {
    scores[i] = std::exp(scores[i] - m);
    sum += scores[i];
  }
  const float inv = 1.0f / sum;
  for (int32_t i = 0; i < n; ++i) scores[i] *= inv;
}

}  // namespace

void QueryOperand(const float* q, int d, float* out) {
  float mx = 0.0f;
  for (int c = 0; c < d; ++c) mx = std::max(mx, std::fabs(q[c]));
  int e = 0;
  if (mx > 0.0f && std::isfinite(mx)) {
    uint32_t bits;
    std::memcpy(&bits, &mx, sizeof(bits));
    const int exponent = static_cast<int>((bits >> 23) & 0xffu) - 127;  // floor(log2), -127 for denormals
    e = std::min(std::max(13 - exponent, -126), 126);
  }
  const float up = std::ldexp(1.0f, e), down = std::ldexp(1.0f, -e);
  for (int c = 0; c < d; ++c) out[c] = RoundToHalf(q[c] * up) * down;
}

void AttendDecodeRows(const HeadReplica& replica, const SubstitutedRows& sub, const float* q, const Half* new_keys,
                      const Half* new_values, int n_rows, int n_heads, float scale, float* out, int probs_row,
                      int32_t n_candidates, float* probs, AttentionWorkspace* ws, float* row0_probs) {
  const ReplicaParams& p = replica.params();
  const int d = p.head_dim;
  const int g_size = p.group_size;
  const int32_t length = replica.length();
  const int32_t n_qk = replica.quantized_keys();
  const int32_t n_qv = replica.quantized_values();
  const int32_t width = length + n_rows;  // cache tokens, then the step's new tokens
  const int queries = n_rows * n_heads;

  ws->scores.assign(static_cast<size_t>(queries) * width, -std::numeric_limits<float>::infinity());
  ws->tile.resize(static_cast<size_t>(std::max(g_size, 1)) * d + static_cast<size_t>(queries) * d);
  float* tile = ws->tile.data();                                // [G][d] decoded keys of one group
  float* qs = ws->tile.data() + static_cast<size_t>(g_size) * d;  // [queries][d] scaled queries
  for (int query = 0; query < queries; ++query) {
    float* row = qs + static_cast<size_t>(query) * d;
    QueryOperand(q + static_cast<size_t>(query) * d, d, row);
    for (int c = 0; c < d; ++c) row[c] *= scale;
  }

  ws->substitute_of.assign(static_cast<size_t>(n_qk), -1);
  for (int32_t i = 0; i < sub.n; ++i) {
    if (sub.tokens[i] >= 0 && sub.tokens[i] < n_qk) ws->substitute_of[sub.tokens[i]] = i;
  }
  auto substitute_row = [&](int32_t token) -> const Half* {
    const int32_t i = token < n_qk ? ws->substitute_of[token] : -1;
    return i < 0 ? nullptr : sub.rows + static_cast<size_t>(i) * 2 * d;
  };
  auto score_row = [&](int query, int32_t token) -> float& {
    return ws->scores[static_cast<size_t>(query) * width + token];
  };

  // Scores over the quantized keys, one group of G tokens at a time, substituted rows in fp16.
  for (int32_t g = 0; g * g_size < n_qk; ++g) {
    if (IsPackedBitWidth(p.key_bits)) {
      DequantizeKeyGroup(replica.KeyGroupCodes(g), replica.KeyGroupScale(g), replica.KeyGroupZero(g), g_size, d,
                         p.key_bits, tile);
    } else {
      HalfRowToFloat(replica.KeyGroupHalf(g), g_size * d, tile);
    }
    for (int t = 0; t < g_size; ++t) {
      const int32_t token = g * g_size + t;
      if (const Half* row = substitute_row(token)) HalfRowToFloat(row, d, tile + static_cast<size_t>(t) * d);
      for (int query = 0; query < queries; ++query) {
        score_row(query, token) = Dot(qs + static_cast<size_t>(query) * d, tile + static_cast<size_t>(t) * d, d);
      }
    }
  }
  // Residual keys, then the new tokens (row r sees new tokens 0..r).
  for (int32_t token = n_qk; token < width; ++token) {
    const Half* key = token < length ? replica.ResidualKeys() + static_cast<size_t>(token - n_qk) * d
                                     : new_keys + static_cast<size_t>(token - length) * d;
    HalfRowToFloat(key, d, tile);
    for (int query = 0; query < queries; ++query) {
      if (token >= length && token - length > query / n_heads) continue;  // causal among new rows
      score_row(query, token) = Dot(qs + static_cast<size_t>(query) * d, tile, d);
    }
  }
  for (int query = 0; query < queries; ++query) Softmax(&score_row(query, 0), width);

  if (probs != nullptr) {
    for (int h = 0; h < n_heads; ++h) {
      std::copy_n(&score_row(probs_row * n_heads + h, 0), n_candidates, probs + static_cast<size_t>(h) * n_candidates);
    }
  }
  if (row0_probs != nullptr) {
    for (int h = 0; h < n_heads; ++h) {
      std::copy_n(&score_row(h, 0), n_candidates, row0_probs + static_cast<size_t>(h) * n_candidates);
    }
  }

  // Output: every token's value row (decoded, substituted, window or new) times its probability.
  std::fill(out, out + static_cast<size_t>(queries) * d, 0.0f);
  float* value = tile;
  for (int32_t token = 0; token < width; ++token) {
    if (const Half* row = substitute_row(token)) {
      HalfRowToFloat(row + d, d, value);
    } else if (token < n_qv) {
      if (IsPackedBitWidth(p.value_bits)) {
        DequantizeValueToken(replica.ValueCodes(token), replica.ValueScale(token), replica.ValueZero(token), d, g_size,
                             p.value_bits, value);
      } else {
        HalfRowToFloat(replica.ValueHalf(token), d, value);
      }
    } else if (token < length) {
      HalfRowToFloat(replica.WindowValues() + static_cast<size_t>(token - n_qv) * d, d, value);
    } else {
      HalfRowToFloat(new_values + static_cast<size_t>(token - length) * d, d, value);
    }
    for (int query = 0; query < queries; ++query) {
      const float w = score_row(query, token);
      if (w != 0.0f) Axpy(w, value, d, out + static_cast<size_t>(query) * d);
    }
  }
}

void AttendPrefill(const float* q, const Half* keys, const Half* values, int32_t n, int n_heads, int head_dim,
                   float scale, float* out, AttentionWorkspace* ws) {
  const int d = head_dim;
  ws->tile.resize(static_cast<size_t>(n) * d * 2 + d);
  float* k = ws->tile.data();
  float* v = k + static_cast<size_t>(n) * d;
  float* qs = v + static_cast<size_t>(n) * d;
  HalfRowToFloat(keys, n * d, k);
  HalfRowToFloat(values, n * d, v);
  ws->scores.resize(static_cast<size_t>(n));
  float* s = ws->scores.data();
  for (int32_t i = 0; i < n; ++i) {
    for (int h = 0; h < n_heads; ++h) {
      const float* qi = q + (static_cast<size_t>(i) * n_heads + h) * d;
      for (int c = 0; c < d; ++c) qs[c] = qi[c] * scale;
      for (int32_t j = 0; j <= i; ++j) s[j] = Dot(qs, k + static_cast<size_t>(j) * d, d);
      Softmax(s, i + 1);
      float* o = out + (static_cast<size_t>(i) * n_heads + h) * d;
      std::fill(o, o + d, 0.0f);
      for (int32_t j = 0; j <= i; ++j) Axpy(s[j], v + static_cast<size_t>(j) * d, d, o);
    }
  }
}

void SelectTopK(const float* probs, int n_heads, int32_t n, int k, GroupReduction reduction,
                std::vector<int32_t>* tokens, std::vector<float>* scratch) {
  if (k <= 0 || n <= 0) {
    tokens->clear();
    return;
  }
  tokens->resize(static_cast<size_t>(n));
  std::iota(tokens->begin(), tokens->end(), 0);
  if (k >= n) return;
  ReduceGroupScores(probs, n_heads, n, reduction, scratch);
  const float* score = scratch->data();
  auto better = [score](int32_t a, int32_t b) { return score[a] > score[b] || (score[a] == score[b] && a < b); };
  std::nth_element(tokens->begin(), tokens->begin() + k, tokens->end(), better);
  tokens->resize(static_cast<size_t>(k));
  std::sort(tokens->begin(), tokens->end());
}

}  // namespace specache::cpu
