// The byte-level BPE tokenizer stored in a GGUF file's metadata (tokenizer.ggml.model "gpt2":
// tokens, merges, token types, special token ids), with the pre-tokenizer the file names.
//
// Encoding: control tokens written literally in the text (e.g. "<|im_start|>") become those tokens
// when parse_special is set; the rest is split by the pre-tokenizer (digits one by one, then the
// GPT-2 pattern: contractions, ` ?letters`, ` ?numbers`, ` ?other`, white space), each piece's bytes
// are mapped to the GPT-2 byte alphabet and merged by rank.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "specache/gguf.h"
#include "specache/status.h"

namespace specache {

class BpeTokenizer {
 public:
  // UNIMPLEMENTED for tokenizer models other than "gpt2" or unknown pre-tokenizers; DATA_LOSS for
  // inconsistent arrays (the message names the key).
  static Result<std::unique_ptr<BpeTokenizer>> FromGguf(const gguf::GgufFile& file);

  std::vector<int32_t> Encode(std::string_view text, bool parse_special) const;
  // The bytes the tokens stand for; control tokens are rendered as their text when
  // `render_control` is set and skipped otherwise.
  std::string Decode(std::span<const int32_t> tokens, bool render_control = false) const;

  int32_t vocab_size() const { return static_cast<int32_t>(tokens_.size()); }
  int32_t bos_id() const { return bos_id_; }
  int32_t eos_id() const { return eos_id_; }
  bool IsControl(int32_t id) const;
  // The id of a token written exactly as in the vocabulary (e.g. "<|im_end|>"), or -1.
  int32_t Find(std::string_view token) const;

 private:
  BpeTokenizer() = default;
  // Appends the tokens of one pre-tokenized piece (raw bytes).
  void EncodePiece(std::string_view piece, std::vector<int32_t>* out) const;
  void EncodeOrdinary(std::string_view text, std::vector<int32_t>* out) const;

  std::vector<std::string> tokens_;  // in the GPT-2 byte alphabet (UTF-8)
  std::vector<int32_t> types_;       // 1 normal, 3 control, ...
  std::unordered_map<std::string, int32_t> ids_;
  std::unordered_map<std::string, int32_t> merge_ranks_;  // "left right" -> rank
  std::vector<std::pair<std::string, int32_t>> specials_;  // control tokens, longest first
  bool split_digits_ = false;
  int32_t bos_id_ = -1, eos_id_ = -1;
  std::string byte_symbol_[256];                 // byte -> its symbol (UTF-8)
  std::unordered_map<char32_t, uint8_t> symbol_byte_;  // inverse
};

}  // namespace specache
