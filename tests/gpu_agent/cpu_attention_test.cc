#include "specache/cpu_attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "testing/reference.h"

namespace specache {
namespace {

using testing::RandomFloats;
using testing::RandomHalves;
using testing::RefAttention;
using testing::RelativeError;

constexpr int kDim = 64;
constexpr int kHeads = 4;  // GQA group

struct Case {
  int n;
  std::vector<Half> k, v;          // cache tokens [n][d]
  std::vector<Half> new_k, new_v;  // [2][d]
  std::vector<float> q;            // [2][heads][d]
  HeadReplica replica;

  Case(int n_tokens, int bits, uint32_t seed)
      : n(n_tokens), replica(ReplicaParams{kDim, bits, bits, 32, 64}) {
    std::mt19937 rng(seed);
    k = RandomHalves(static_cast<size_t>(n) * kDim, rng);
    v = RandomHalves(static_cast<size_t>(n) * kDim, rng);
    new_k = RandomHalves(2 * kDim, rng);
    new_v = RandomHalves(2 * kDim, rng);
    q = RandomFloats(2 * kHeads * kDim, rng, 0.6f);
    replica.Append(k.data(), v.data(), n);
  }

  // Rows [K|V] of the given tokens, as the source would return them.
  std::vector<Half> Rows(const std::vector<int32_t>& tokens) const {
    std::vector<Half> rows;
    for (int32_t t : tokens) {
      rows.insert(rows.end(), k.begin() + t * kDim, k.begin() + (t + 1) * kDim);
      rows.insert(rows.end(), v.begin() + t * kDim, v.begin() + (t + 1) * kDim);
    }
    return rows;
  }

  // float64 attention for row r over the given cache keys/values plus new tokens 0..r, with each
  // query taken as AttendDecodeRows takes it (cpu::QueryOperand).
  std::vector<double> Reference(const std::vector<double>& keys, const std::vector<double>& values, int rows,
                                std::vector<double>* probs = nullptr) const {
    std::vector<double> out(static_cast<size_t>(rows) * kHeads * kDim);
    if (probs) probs->assign(static_cast<size_t>(kHeads) * n, 0.0);
    for (int r = 0; r < rows; ++r) {
      std::vector<double> kk = keys, vv = values;
      for (int j = 0; j <= r; ++j) {
        for (int c = 0; c < kDim; ++c) {
          kk.push_back(HalfToFloat(new_k[j * kDim + c]));
          vv.push_back(HalfToFloat(new_v[j * kDim + c]));
        }
      }
      const int m = n + r + 1;
      for (int h = 0; h < kHeads; ++h) {
        std::vector<float> operand(kDim);
        cpu::QueryOperand(q.data() + (r * kHeads + h) * kDim, kDim, operand.data());
        std::vector<double> qd(operand.begin(), operand.end());
        std::vector<double> p(m);
        RefAttention(qd.data(), kk.data(), vv.data(), m, kDim, 1.0 / std::sqrt(double(kDim)),
                     out.data() + (static_cast<size_t>(r) * kHeads + h) * kDim, p.data());
        if (probs && r == rows - 1) std::copy_n(p.begin(), n, probs->begin() + static_cast<size_t>(h) * n);
      }
    }
    return out;
  }

  std::vector<double> Exact(const std::vector<Half>& x) const { return testing::ToDouble(x); }
};

std::vector<float> Attend(const Case& s, const std::vector<int32_t>& sub_tokens, int rows, std::vector<float>* probs = nullptr) {
  const std::vector<Half> sub_rows = s.Rows(sub_tokens);
  cpu::SubstitutedRows sub{sub_tokens.data(), sub_rows.data(), static_cast<int32_t>(sub_tokens.size())};
  std::vector<float> out(static_cast<size_t>(rows) * kHeads * kDim);
  if (probs) probs->assign(static_cast<size_t>(kHeads) * s.replica.quantized_keys(), 0.0f);
  cpu::AttentionWorkspace ws;
  cpu::AttendDecodeRows(s.replica, sub, s.q.data(), s.new_k.data(), s.new_v.data(), rows, kHeads,
                        1.0f / std::sqrt(float(kDim)), out.data(), rows - 1, s.replica.quantized_keys(),
                        probs ? probs->data() : nullptr, &ws);
  return out;
}

// The query operand: fp16 at the exponent that puts the largest channel in [2^13, 2^14), so every
// channel is an fp16 value times 2^-e, within 2^-11 relative of the query (normal range) or
// 2^-25 * 2^-e absolute (fp16 subnormals); zero and non-finite maxima use e = 0.
TEST(CpuAttentionTest, QueryOperandIsTheQueryInFp16AtItsOwnExponent) {
  std::mt19937 rng(3);
  for (float magnitude : {1e-30f, 1e-6f, 0.05f, 1.0f, 3e4f}) {
    std::vector<float> q = RandomFloats(kDim, rng, magnitude);
    q[5] *= 1e-9f;  // a channel far below the largest: an fp16 subnormal after scaling
    std::vector<float> got(kDim);
    cpu::QueryOperand(q.data(), kDim, got.data());
    float mx = 0.0f;
    for (float x : q) mx = std::max(mx, std::fabs(x));
    const int e = 13 - std::ilogb(mx);
    EXPECT_GE(std::fabs(std::ldexp(mx, e)), 8192.0f);
    EXPECT_LT(std::fabs(std::ldexp(mx, e)), 16384.0f);
    for (int c = 0; c < kDim; ++c) {
      const float scaled = std::ldexp(got[c], e);
      EXPECT_EQ(RoundToHalf(scaled), scaled) << "channel " << c << " is not an fp16 operand";
      EXPECT_LE(std::fabs(got[c] - q[c]), std::max(std::fabs(q[c]) * std::ldexp(1.0f, -11), std::ldexp(1.0f, -25 - e)))
          << "magnitude " << magnitude << " channel " << c;
    }
  }
  std::vector<float> zeros(kDim, 0.0f), out(kDim, 1.0f);
  cpu::QueryOperand(zeros.data(), kDim, out.data());
  EXPECT_EQ(out, zeros);
  std::vector<float> with_inf(kDim, 0.5f);
  with_inf[0] = std::numeric_limits<float>::infinity();
  cpu::QueryOperand(with_inf.data(), kDim, with_inf.data());  // in place; e = 0
  EXPECT_EQ(with_inf[1], 0.5f);
  EXPECT_TRUE(std::isinf(with_inf[0]));
}

// k >= number of quantized tokens: every quantized row is replaced, so the result is
// full-precision attention.
TEST(CpuAttentionTest, AllQuantizedRowsSubstitutedEqualsFullPrecision) {
  for (int n : {64, 200, 513}) {
    Case s(n, 1, n);
    std::vector<int32_t> all(s.replica.quantized_keys());
    std::iota(all.begin(), all.end(), 0);
    for (int rows : {1, 2}) {
      const auto out = Attend(s, all, rows);
      const auto ref = s.Reference(s.Exact(s.k), s.Exact(s.v), rows);
      EXPECT_LT(RelativeError(out, ref), 1e-3) << "n " << n << " rows " << rows;
      EXPECT_LT(RelativeError(out, ref), 1e-5) << "n " << n << " rows " << rows;  // in fact float32-close
    }
  }
}

TEST(CpuAttentionTest, SixteenBitReplicaEqualsFullPrecisionReference) {
  Case s(300, 16, 3);
  const auto out = Attend(s, {}, 2);
  EXPECT_LT(RelativeError(out, s.Reference(s.Exact(s.k), s.Exact(s.v), 2)), 1e-5);
}

// Some rows substituted: the result equals float64 attention over the replica's own dequantized
// cache with exactly those rows replaced by their fp16 values.
TEST(CpuAttentionTest, PartialSubstitutionMatchesFloat64Reference) {
  for (int bits : {1, 2, 4}) {
    Case s(400, bits, 10 + bits);
    std::mt19937 rng(bits);
    std::vector<int32_t> tokens(s.replica.quantized_keys());
    std::iota(tokens.begin(), tokens.end(), 0);
    std::shuffle(tokens.begin(), tokens.end(), rng);
    tokens.resize(37);
    std::sort(tokens.begin(), tokens.end());
    std::vector<float> kq, vq;
    s.replica.DequantizeKeys(s.n, &kq);
    s.replica.DequantizeValues(s.n, &vq);
    std::vector<double> keys(kq.begin(), kq.end()), values(vq.begin(), vq.end());
    for (int32_t t : tokens) {
      for (int c = 0; c < kDim; ++c) {
        keys[t * kDim + c] = HalfToFloat(s.k[t * kDim + c]);
        values[t * kDim + c] = HalfToFloat(s.v[t * kDim + c]);
      }
    }
    std::vector<float> probs;
    std::vector<double> ref_probs;
    const auto out = Attend(s, tokens, 2, &probs);
    EXPECT_LT(RelativeError(out, s.Reference(keys, values, 2, &ref_probs)), 1e-5) << "bits " << bits;
    // Probabilities handed to top-k: the speculative row's, over the quantized-key tokens.
    const int nq = s.replica.quantized_keys();
    for (int h = 0; h < kHeads; ++h) {
      for (int j = 0; j < nq; ++j) ASSERT_NEAR(probs[h * nq + j], ref_probs[h * s.n + j], 1e-6);
    }
    // And substitution matters: without it the output differs.
    EXPECT_GT(RelativeError(Attend(s, {}, 2), s.Reference(keys, values, 2)), 1e-4);
  }
}

// The real row (0) does not see the speculative row (1); the speculative row sees both.
TEST(CpuAttentionTest, RealRowIgnoresSpeculativeRow) {
  Case a(150, 2, 77);
  const auto both = Attend(a, {}, 2);
  const auto alone = Attend(a, {}, 1);
  Case b = a;
  for (int c = 0; c < kDim; ++c) {
    b.new_k[kDim + c] = FloatToHalf(HalfToFloat(b.new_k[kDim + c]) + 3.0f);
    b.new_v[kDim + c] = FloatToHalf(-HalfToFloat(b.new_v[kDim + c]));
  }
  const auto changed = Attend(b, {}, 2);
  for (int i = 0; i < kHeads * kDim; ++i) {
    ASSERT_EQ(both[i], alone[i]);
    ASSERT_EQ(both[i], changed[i]);
  }
  bool row1_changed = false;
  for (int i = kHeads * kDim; i < 2 * kHeads * kDim; ++i) row1_changed |= both[i] != changed[i];
  EXPECT_TRUE(row1_changed);
}

TEST(CpuAttentionTest, PrefillIsCausalFullPrecisionAttention) {
  std::mt19937 rng(5);
  const int n = 90;
  const auto k = RandomHalves(n * kDim, rng), v = RandomHalves(n * kDim, rng);
  const auto q = RandomFloats(n * kHeads * kDim, rng, 0.6f);
  std::vector<float> out(q.size());
  cpu::AttentionWorkspace ws;
  cpu::AttendPrefill(q.data(), k.data(), v.data(), n, kHeads, kDim, 1.0f / 8, out.data(), &ws);
  std::vector<double> ref(out.size());
  const auto kd = testing::ToDouble(k), vd = testing::ToDouble(v);
  for (int i = 0; i < n; ++i) {
    for (int h = 0; h < kHeads; ++h) {
      std::vector<double> qd(q.begin() + (i * kHeads + h) * kDim, q.begin() + (i * kHeads + h + 1) * kDim);
      RefAttention(qd.data(), kd.data(), vd.data(), i + 1, kDim, 1.0 / 8, ref.data() + (i * kHeads + h) * kDim, nullptr);
    }
  }
  EXPECT_LT(RelativeError(out, ref), 1e-5);
}

}  // namespace
}  // namespace specache
