// float64 references for the tests: the method's rules and attention written the plain way,
// independent of the agent's code paths (only fp16 conversion is shared).
#pragma once

#include <cstdint>
#include <random>
#include <vector>

#include "specache/half.h"

namespace specache::testing {

// n fp16 values drawn from N(mean, stddev^2), rounded to fp16.
std::vector<Half> RandomHalves(size_t n, std::mt19937& rng, float stddev = 1.0f, float mean = 0.0f);
std::vector<float> RandomFloats(size_t n, std::mt19937& rng, float stddev = 1.0f);
std::vector<double> ToDouble(const std::vector<Half>& h);

// The method's quantize-then-decode of one group, in double, with s and z rounded to fp16 as
// stored: what each element should decode to.
std::vector<double> RefQuantizeDequantize(const std::vector<double>& x, int bits);

// Softmax attention of one query over m keys/values ([m][d] row-major); probs may be null.
void RefAttention(const double* q, const double* keys, const double* values, int m, int d, double scale, double* out,
                  double* probs);

// ||a - b|| / ||b|| over the whole vectors.
double RelativeError(const std::vector<float>& a, const std::vector<double>& b);

}  // namespace specache::testing
