#include "specache/head_replica.h"

#include <algorithm>

#include "specache/quantizer.h"

namespace specache {

HeadReplica::HeadReplica(const ReplicaParams& params) : params_(params) {
  if (IsPackedBitWidth(params_.key_bits)) {
    key_words_per_channel_ = WordsPerGroup(params_.group_size, params_.key_bits);
  }
  if (IsPackedBitWidth(params_.value_bits)) {
    value_words_per_group_ = WordsPerGroup(params_.group_size, params_.value_bits);
  }
  value_groups_ = params_.head_dim / params_.group_size;
  key_residual_.reserve(static_cast<size_t>(params_.residual_tokens) * params_.head_dim);
}

void HeadReplica::Append(const Half* keys, const Half* values, int n) {
  const int d = params_.head_dim;
  for (int t = 0; t < n; ++t) {
    key_residual_.insert(key_residual_.end(), keys + static_cast<size_t>(t) * d, keys + static_cast<size_t>(t + 1) * d);
    value_window_.insert(value_window_.end(), values + static_cast<size_t>(t) * d,
                         values + static_cast<size_t>(t + 1) * d);
    ++length_;
    if (static_cast<int>(key_residual_.size()) == params_.residual_tokens * d) FlushKeyResidual();
    if (window_values() > params_.residual_tokens) QuantizeOldestWindowValue();
  }
  // Drop the quantized prefix of the window buffer once it dominates, so it stays O(R) in size.
  if (window_begin_ > params_.residual_tokens) {
    value_window_.erase(value_window_.begin(), value_window_.begin() + static_cast<size_t>(window_begin_) * d);
    window_begin_ = 0;
  }
}

void HeadReplica::FlushKeyResidual() {
  const int d = params_.head_dim;
  const int g_size = params_.group_size;
  const int groups = params_.residual_tokens / g_size;
  if (!IsPackedBitWidth(params_.key_bits)) {
    key_half_.insert(key_half_.end(), key_residual_.begin(), key_residual_.end());
  } else {
    const size_t words = static_cast<size_t>(d) * key_words_per_channel_;
    for (int g = 0; g < groups; ++g) {
      key_codes_.resize(key_codes_.size() + words);
      key_scale_.resize(key_scale_.size() + d);
      key_zero_.resize(key_zero_.size() + d);
      QuantizeKeyGroup(key_residual_.data() + static_cast<size_t>(g) * g_size * d, g_size, d, params_.key_bits,
                       key_codes_.data() + key_codes_.size() - words, key_scale_.data() + key_scale_.size() - d,
                       key_zero_.data() + key_zero_.size() - d);
    }
  }
  key_groups_ += groups;
  key_residual_.clear();
}

void HeadReplica::QuantizeOldestWindowValue() {
  const int d = params_.head_dim;
  const Half* oldest = value_window_.data() + static_cast<size_t>(window_begin_) * d;
  if (!IsPackedBitWidth(params_.value_bits)) {
    value_half_.insert(value_half_.end(), oldest, oldest + d);
  } else {
    const size_t words = static_cast<size_t>(value_groups_) * value_words_per_group_;
    value_codes_.resize(value_codes_.size() + words);
    value_scale_.resize(value_scale_.size() + value_groups_);
    value_zero_.resize(value_zero_.size() + value_groups_);
    QuantizeValueToken(oldest, d, params_.group_size, params_.value_bits, value_codes_.data() + value_codes_.size() - words,
                       value_scale_.data() + value_scale_.size() - value_groups_,
                       value_zero_.data() + value_zero_.size() - value_groups_);
  }
  ++window_begin_;
  ++quantized_values_;
}

const uint32_t* HeadReplica::KeyGroupCodes(int g) const {
  return key_codes_.data() + static_cast<size_t>(g) * params_.head_dim * key_words_per_channel_;
}
const Half* HeadReplica::KeyGroupScale(int g) const { return key_scale_.data() + static_cast<size_t>(g) * params_.head_dim; }
const Half* HeadReplica::KeyGroupZero(int g) const { return key_zero_.data() + static_cast<size_t>(g) * params_.head_dim; }
const Half* HeadReplica::KeyGroupHalf(int g) const {
  return key_half_.data() + static_cast<size_t>(g) * params_.group_size * params_.head_dim;
}

const uint32_t* HeadReplica::ValueCodes(int32_t j) const {
  return value_codes_.data() + static_cast<size_t>(j) * value_groups_ * value_words_per_group_;
}
const Half* HeadReplica::ValueScale(int32_t j) const { return value_scale_.data() + static_cast<size_t>(j) * value_groups_; }
const Half* HeadReplica::ValueZero(int32_t j) const { return value_zero_.data() + static_cast<size_t>(j) * value_groups_; }
const Half* HeadReplica::ValueHalf(int32_t j) const { return value_half_.data() + static_cast<size_t>(j) * params_.head_dim; }

void HeadReplica::DequantizeKeys(int32_t n, std::vector<float>* out) const {
  const int d = params_.head_dim;
  const int g_size = params_.group_size;
  out->assign(static_cast<size_t>(n) * d, 0.0f);
  std::vector<float> group(static_cast<size_t>(g_size) * d);
  for (int32_t g = 0; g * g_size < std::min(n, quantized_keys()); ++g) {
    if (IsPackedBitWidth(params_.key_bits)) {
      DequantizeKeyGroup(KeyGroupCodes(g), KeyGroupScale(g), KeyGroupZero(g), g_size, d, params_.key_bits, group.data());
    } else {
      for (size_t i = 0; i < group.size(); ++i) group[i] = HalfToFloat(KeyGroupHalf(g)[i]);
    }
    const int32_t rows = std::min(g_size, n - g * g_size);
    std::copy(group.begin(), group.begin() + static_cast<size_t>(rows) * d, out->begin() + static_cast<size_t>(g) * g_size * d);
  }
  for (int32_t t = quantized_keys(); t < n; ++t) {
    for (int c = 0; c < d; ++c) {
      (*out)[static_cast<size_t>(t) * d + c] = HalfToFloat(key_residual_[static_cast<size_t>(t - quantized_keys()) * d + c]);
    }
  }
}

void HeadReplica::DequantizeValues(int32_t n, std::vector<float>* out) const {
  const int d = params_.head_dim;
  out->assign(static_cast<size_t>(n) * d, 0.0f);
  for (int32_t t = 0; t < n; ++t) {
    float* row = out->data() + static_cast<size_t>(t) * d;
    if (t < quantized_values_) {
      if (IsPackedBitWidth(params_.value_bits)) {
        DequantizeValueToken(ValueCodes(t), ValueScale(t), ValueZero(t), d, params_.group_size, params_.value_bits, row);
      } else {
        for (int c = 0; c < d; ++c) row[c] = HalfToFloat(ValueHalf(t)[c]);
      }
    } else {
      const Half* src = WindowValues() + static_cast<size_t>(t - quantized_values_) * d;
      for (int c = 0; c < d; ++c) row[c] = HalfToFloat(src[c]);
    }
  }
}

int64_t HeadReplica::device_bytes() const {
  const int64_t halves = static_cast<int64_t>(key_scale_.size() + key_zero_.size() + key_half_.size() +
                                              key_residual_.size() + value_scale_.size() + value_zero_.size() +
                                              value_half_.size()) +
                         static_cast<int64_t>(window_values()) * params_.head_dim;
  return halves * 2 + static_cast<int64_t>(key_codes_.size() + value_codes_.size()) * 4;
}

}  // namespace specache
