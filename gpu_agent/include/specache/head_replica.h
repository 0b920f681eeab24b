// The low-bit replica C' of one (sequence, layer, KV head), kept by the CPU backend.
//
// Streaming rules (docs/method.md):
//   keys:   tokens enter a full-precision residual; the moment it holds R tokens they are quantized
//           (R/G groups of G tokens, per channel) and the residual empties. So after n tokens,
//           floor(n/R)*R keys are quantized and n mod R sit in the residual.
//   values: the R newest tokens stay in full precision (the window); when a token arrives and the
//           window would exceed R, its oldest token is quantized (per token, G channels a group).
//           So after n tokens, max(0, n-R) values are quantized.
// A prefill of n tokens is by definition the same as appending them one at a time: Append(n) and
// n x Append(1) leave identical state. Every token outside the quantized keys (the residual) is
// also inside the value window, so "quantized" for top-k purposes means "key quantized".
//
// Token positions are 0-based and never move: token j's quantized key lives in group j / G.
//
// Thread safety: none; the agent gives each replica to one thread at a time.
#pragma once

#include <cstdint>
#include <vector>

#include "specache/half.h"
#include "specache/status.h"

namespace specache {

struct ReplicaParams {
  int head_dim = 0;
  int key_bits = 1;  // 1, 2, 4 or 16
  int value_bits = 1;
  int group_size = 32;       // G
  int residual_tokens = 64;  // R, multiple of G
};

class HeadReplica {
 public:
  explicit HeadReplica(const ReplicaParams& params);

  const ReplicaParams& params() const { return params_; }

  // Appends n tokens' keys and values, each [n][head_dim] fp16.
  void Append(const Half* keys, const Half* values, int n);

  int32_t length() const { return length_; }
  int32_t quantized_keys() const { return key_groups_ * params_.group_size; }
  int32_t residual_keys() const { return length_ - quantized_keys(); }
  int32_t quantized_values() const { return quantized_values_; }
  int32_t window_values() const { return length_ - quantized_values_; }

  // --- quantized keys, group g (tokens [g*G, (g+1)*G)) ---
  // Packed bits: codes [head_dim][G*B/32], scale/zero [head_dim]. 16 bits: KeyGroupHalf().
  const uint32_t* KeyGroupCodes(int g) const;
  const Half* KeyGroupScale(int g) const;
  const Half* KeyGroupZero(int g) const;
  // 16-bit pass-through: [G][head_dim] fp16.
  const Half* KeyGroupHalf(int g) const;

  // Residual keys, [residual_keys()][head_dim], token quantized_keys() + i at row i.
  const Half* ResidualKeys() const { return key_residual_.data(); }

  // --- quantized values, token j < quantized_values() ---
  // Packed bits: codes [head_dim/G][G*B/32], scale/zero [head_dim/G]. 16 bits: ValueHalf().
  const uint32_t* ValueCodes(int32_t j) const;
  const Half* ValueScale(int32_t j) const;
  const Half* ValueZero(int32_t j) const;
  const Half* ValueHalf(int32_t j) const;  // [head_dim]

  // Window values, [window_values()][head_dim], token quantized_values() + i at row i.
  const Half* WindowValues() const { return value_window_.data() + window_begin_ * params_.head_dim; }

  // Dequantized copies (floats) for references and tests: keys / values of tokens [0, n).
  void DequantizeKeys(int32_t n, std::vector<float>* out) const;    // [n][head_dim]
  void DequantizeValues(int32_t n, std::vector<float>* out) const;  // [n][head_dim]

  // Bytes this replica occupies on the device: codes, (s, z), residual and window, as stored.
  int64_t device_bytes() const;

 private:
  void FlushKeyResidual();
  void QuantizeOldestWindowValue();

  ReplicaParams params_;
  int key_words_per_channel_ = 0;   // G*B/32, packed key bits only
  int value_words_per_group_ = 0;   // G*B/32, packed value bits only
  int value_groups_ = 0;            // head_dim / G

  int32_t length_ = 0;
  int32_t key_groups_ = 0;
  int32_t quantized_values_ = 0;

  std::vector<uint32_t> key_codes_;  // [key_groups][head_dim][words]
  std::vector<Half> key_scale_;      // [key_groups][head_dim]
  std::vector<Half> key_zero_;       // [key_groups][head_dim]
  std::vector<Half> key_half_;       // 16-bit: [key_groups * G][head_dim]
  std::vector<Half> key_residual_;   // [residual][head_dim]

  std::vector<uint32_t> value_codes_;  // [quantized_values][value_groups][words]
  std::vector<Half> value_scale_;      // [quantized_values][value_groups]
  std::vector<Half> value_zero_;       // [quantized_values][value_groups]
  std::vector<Half> value_half_;       // 16-bit: [quantized_values][head_dim]
  std::vector<Half> value_window_;     // rows [window_begin_, ...) are live
  int32_t window_begin_ = 0;
};

}  // namespace specache
