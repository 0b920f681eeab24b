#include "specache/selection.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

namespace specache::cpu {
namespace {

// The `k` best of score[0, n) by (score descending, token ascending), in that rank order.
void RankBest(const float* score, int32_t n, int32_t k, std::vector<int32_t>* order) {
  order->resize(static_cast<size_t>(n));
  std::iota(order->begin(), order->end(), 0);
  auto better = [score](int32_t a, int32_t b) { return score[a] > score[b] || (score[a] == score[b] && a < b); };
  k = std::min(k, n);
  std::partial_sort(order->begin(), order->begin() + k, order->end(), better);
  order->resize(static_cast<size_t>(k));
}

}  // namespace

void ReduceGroupScores(const float* probs, int n_heads, int32_t n, GroupReduction reduction, std::vector<float>* score) {
  const bool use_max = reduction == GroupReduction::kMax;
  score->assign(static_cast<size_t>(n), use_max ? -std::numeric_limits<float>::infinity() : 0.0f);
  float* s = score->data();
  for (int h = 0; h < n_heads; ++h) {
    const float* ph = probs + static_cast<size_t>(h) * n;
    for (int32_t j = 0; j < n; ++j) {
      const float v = std::isnan(ph[j]) ? -std::numeric_limits<float>::infinity() : ph[j];
      s[j] = use_max ? std::max(s[j], v) : s[j] + v;
    }
  }
  if (!use_max) {
    // A mean of +inf and -inf (a head's +inf beside another's NaN or -inf) is NaN: it ranks lowest,
    // as a NaN probability does, and keeps RankBest's order a strict weak ordering.
    for (int32_t j = 0; j < n; ++j) {
      s[j] /= static_cast<float>(n_heads);
      if (std::isnan(s[j])) s[j] = -std::numeric_limits<float>::infinity();
    }
  }
}

void WithPredecessors(const float* probs, int n_heads, int32_t n, std::vector<float>* out) {
  out->resize(static_cast<size_t>(n_heads) * n);
  for (int h = 0; h < n_heads; ++h) {
    const float* p = probs + static_cast<size_t>(h) * n;
    float* o = out->data() + static_cast<size_t>(h) * n;
    for (int32_t j = 0; j < n; ++j) o[j] = j > 0 && !std::isnan(p[j]) && p[j - 1] > p[j] ? p[j - 1] : p[j];
  }
}

float CandidateMass(const float* score, int32_t n) {
  // A tree per run rather than one running sum: the CUDA top-k sums each run in one warp, the runs
  // of a segment in parallel, and this is the order it can reproduce exactly (the selection's cut
  // must not depend on the backend). Over long contexts it is also the more accurate sum.
  float total = 0.0f;
  float x[kMassRunTokens];
  for (int32_t first = 0; first < n; first += kMassRunTokens) {
    for (int32_t i = 0; i < kMassRunTokens; ++i) {
      const int32_t j = first + i;
      x[i] = j < n && score[j] > 0 ? score[j] : 0.0f;
    }
    for (int32_t h = kMassRunTokens / 2; h >= 1; h /= 2) {
      for (int32_t i = 0; i < h; ++i) x[i] += x[i + h];
    }
    total += x[0];
  }
  return total;
}

int32_t BudgetRows(const KvConfig& c, const float* score, int32_t n, std::vector<int32_t>* order) {
  if (!c.adaptive()) return std::min<int32_t>(c.top_k, n);
  const int32_t most = std::min<int32_t>(c.k_max, n);
  const float goal = static_cast<float>(c.mass) * CandidateMass(score, n);
  RankBest(score, n, most, order);
  float sum = 0.0f;
  for (int32_t i = 0; i < most; ++i) {
    if (score[(*order)[i]] > 0) sum += score[(*order)[i]];
    if (i + 1 >= c.k_min && sum >= goal) return i + 1;
  }
  return most;
}

void SelectRows(const KvConfig& c, const float* primary_probs, const float* real_probs, int n_heads, int32_t n,
                std::vector<int32_t>* tokens, SelectionScratch* scratch) {
  tokens->clear();
  if (n <= 0) return;
  if (c.real_next && c.mode == KvMode::kSpeCache && c.select == SelectFrom::kReal) {
    WithPredecessors(primary_probs, n_heads, n, &scratch->shifted);
    primary_probs = scratch->shifted.data();
  }
  ReduceGroupScores(primary_probs, n_heads, n, c.reduction, &scratch->score);
  const int32_t rows = BudgetRows(c, scratch->score.data(), n, &scratch->order);
  RankBest(scratch->score.data(), n, rows, &scratch->order);
  tokens->assign(scratch->order.begin(), scratch->order.end());
  std::sort(tokens->begin(), tokens->end());
  const int32_t extra = c.extra_rows();
  if (extra <= 0 || rows == n) return;
  if (!c.adaptive() && n <= rows + extra) {  // every candidate, whatever the real row says
    tokens->resize(static_cast<size_t>(n));
    std::iota(tokens->begin(), tokens->end(), 0);
    return;
  }
  // The real row's best `extra` with the primary rows ranked lowest (-inf), less the primary ones
  // among them: there are such only where fewer than `extra` others rank above -inf (few
  // candidates left, or a real row of -inf or NaN, whose ties go to the lower token, primary or
  // not). Those places are dropped, not filled with worse tokens, as the CUDA merge drops them.
  if (c.real_next) {
    WithPredecessors(real_probs, n_heads, n, &scratch->shifted);
    real_probs = scratch->shifted.data();
  }
  ReduceGroupScores(real_probs, n_heads, n, c.reduction, &scratch->score);
  for (int32_t t : *tokens) scratch->score[t] = -std::numeric_limits<float>::infinity();
  RankBest(scratch->score.data(), n, extra, &scratch->order);
  scratch->extra.clear();
  for (int32_t t : scratch->order) {
    if (!std::binary_search(tokens->begin(), tokens->end(), t)) scratch->extra.push_back(t);
  }
  std::sort(scratch->extra.begin(), scratch->extra.end());
  const size_t primary = tokens->size();
  tokens->insert(tokens->end(), scratch->extra.begin(), scratch->extra.end());
  std::inplace_merge(tokens->begin(), tokens->begin() + static_cast<std::ptrdiff_t>(primary), tokens->end());
}

void SeedTokens(const float* q, const Half* keys, int n_heads, int32_t n, int d, float scale, int32_t candidates,
                int count, GroupReduction reduction, std::vector<int32_t>* tokens, std::vector<int32_t>* rank) {
  tokens->clear();
  if (rank) rank->clear();
  candidates = std::min(candidates, n);
  if (count <= 0 || candidates <= 0) return;
  // Per head: the softmax over all n keys (the prompt token's real attention), kept for the
  // candidates only.
  std::vector<float> probs(static_cast<size_t>(n_heads) * candidates), logits(static_cast<size_t>(n));
  std::vector<double> weights(static_cast<size_t>(n));
  for (int h = 0; h < n_heads; ++h) {
    const float* qh = q + static_cast<size_t>(h) * d;
    float mx = -std::numeric_limits<float>::infinity();
    for (int32_t j = 0; j < n; ++j) {
      const Half* k = keys + static_cast<size_t>(j) * d;
      float dot = 0.0f;
      for (int c = 0; c < d; ++c) dot += qh[c] * HalfToFloat(k[c]);
      logits[static_cast<size_t>(j)] = dot * scale;
      mx = std::max(mx, logits[static_cast<size_t>(j)]);
    }
    double sum = 0.0;
    for (int32_t j = 0; j < n; ++j) {
      weights[static_cast<size_t>(j)] = std::exp(static_cast<double>(logits[static_cast<size_t>(j)] - mx));
      sum += weights[static_cast<size_t>(j)];
    }
    for (int32_t j = 0; j < candidates; ++j) {
      probs[static_cast<size_t>(h) * candidates + j] = static_cast<float>(weights[static_cast<size_t>(j)] / sum);
    }
  }
  std::vector<float> score;
  ReduceGroupScores(probs.data(), n_heads, candidates, reduction, &score);
  std::vector<int32_t> order;  // the seeds in rank order
  RankBest(score.data(), candidates, count, &order);
  const size_t take = order.size();
  *tokens = order;
  std::sort(tokens->begin(), tokens->end());
  if (rank) {
    rank->resize(take);
    for (size_t r = 0; r < take; ++r) {
      (*rank)[static_cast<size_t>(std::lower_bound(tokens->begin(), tokens->end(), order[r]) - tokens->begin())] =
          static_cast<int32_t>(r);
    }
  }
}

}  // namespace specache::cpu
