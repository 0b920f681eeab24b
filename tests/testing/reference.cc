#include "reference.h"

#include <algorithm>
#include <cmath>

namespace specache::testing {

std::vector<Half> RandomHalves(size_t n, std::mt19937& rng, float stddev, float mean) {
  std::normal_distribution<float> dist(mean, stddev);
  std::vector<Half> out(n);
  for (auto& h : out) h = FloatToHalf(dist(rng));
  return out;
}

std::vector<float> RandomFloats(size_t n, std::mt19937& rng, float stddev) {
  std::normal_distribution<float> dist(0.0f, stddev);
  std::vector<float> out(n);
  for (auto& f : out) f = dist(rng);
  return out;
}

std::vector<double> ToDouble(const std::vector<Half>& h) {
  std::vector<double> out(h.size());
  for (size_t i = 0; i < h.size(); ++i) out[i] = HalfToFloat(h[i]);
  return out;
}

std::vector<double> RefQuantizeDequantize(const std::vector<double>& x, int bits) {
  const double lo = *std::min_element(x.begin(), x.end());
  const double hi = *std::max_element(x.begin(), x.end());
  double s, z;
  if (bits == 1) {
    z = (3 * lo + hi) / 4;
    s = (hi - lo) / 2;
  } else {
    z = lo;
    s = (hi - lo) / ((1 << bits) - 1);
  }
  s = RoundToHalf(static_cast<float>(s));
  z = RoundToHalf(static_cast<float>(z));
  std::vector<double> out(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    double code = s > 0 ? std::floor((x[i] - z) / s + 0.5) : 0;
    code = std::clamp(code, 0.0, static_cast<double>((1 << bits) - 1));
    out[i] = code * s + z;
  }
  return out;
}

void RefAttention(const double* q, const double* keys, const double* values, int m, int d, double scale, double* out,
                  double* probs) {
  std::vector<double> s(m);
  double mx = -1e300;
  for (int j = 0; j < m; ++j) {
    double dot = 0;
    for (int c = 0; c < d; ++c) dot += q[c] * keys[static_cast<size_t>(j) * d + c];
    s[j] = dot * scale;
    mx = std::max(mx, s[j]);
  }
  double sum = 0;
  for (int j = 0; j < m; ++j) sum += (s[j] = std::exp(s[j] - mx));
  for (int c = 0; c < d; ++c) out[c] = 0;
  for (int j = 0; j < m; ++j) {
    s[j] /= sum;
    if (probs) probs[j] = s[j];
    for (int c = 0; c < d; ++c) out[c] += s[j] * values[static_cast<size_t>(j) * d + c];
  }
}

double RelativeError(const std::vector<float>& a, const std::vector<double>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < b.size(); ++i) {
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  return std::sqrt(num / den);
}

}  // namespace specache::testing
