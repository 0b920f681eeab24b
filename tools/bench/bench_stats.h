// Order statistics of benchmark samples.
#pragma once

#include <algorithm>
#include <utility>
#include <vector>

namespace specache::bench {

// The sample at fraction p (0..1) of the sorted samples; 0 when there are none.
inline double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(p * static_cast<double>(v.size())))];
}

inline double Median(std::vector<double> v) { return Percentile(std::move(v), 0.5); }

}  // namespace specache::bench
