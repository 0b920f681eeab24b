#include "niah_prompt.h"

#include <cmath>

namespace specache {

Result<NiahPrompt> BuildNiahPrompt(const BpeTokenizer& tokenizer, const ChatTemplate& chat, const NiahSpec& spec) {
  if (!(spec.depth >= 0.0 && spec.depth <= 1.0)) {
    return Status::InvalidArgument("depth " + std::to_string(spec.depth) + " is outside [0, 1]");
  }
  // The chat turn around the content: everything before and after a marker.
  const std::string marker = "\x01";
  const ChatMessage user[] = {{"user", marker}};
  const std::string wrapped = chat.Apply(user, /*add_generation_prompt=*/true);
  const size_t at = wrapped.find(marker);
  const std::vector<int32_t> prefix = tokenizer.Encode(wrapped.substr(0, at), /*parse_special=*/true);
  const std::vector<int32_t> suffix =
      tokenizer.Encode("\n\n" + spec.question + wrapped.substr(at + marker.size()), /*parse_special=*/true);
  const std::vector<int32_t> needle = tokenizer.Encode(" " + spec.needle + " ", /*parse_special=*/false);
  const int64_t budget = int64_t{spec.context_tokens} - static_cast<int64_t>(prefix.size() + suffix.size() + needle.size());
  if (budget < 1) {
    return Status::InvalidArgument("context of " + std::to_string(spec.context_tokens) + " tokens cannot hold the " +
                                   std::to_string(prefix.size() + suffix.size() + needle.size()) +
                                   " tokens of template, needle and question");
  }
  const std::vector<int32_t> text = tokenizer.Encode(spec.haystack, /*parse_special=*/false);
  if (text.empty()) return Status::InvalidArgument("the haystack text is empty");
  const std::vector<int32_t> separator = tokenizer.Encode("\n\n", false);
  std::vector<int32_t> hay;
  while (static_cast<int64_t>(hay.size()) < budget) {
    if (!hay.empty()) hay.insert(hay.end(), separator.begin(), separator.end());
    hay.insert(hay.end(), text.begin(), text.end());
  }
  hay.resize(budget);

  // Insert after the first sentence end at or after the depth, so the needle reads as a sentence.
  size_t cut = static_cast<size_t>(std::llround(spec.depth * static_cast<double>(budget)));
  if (cut > 0) {
    while (cut < hay.size()) {
      const int32_t one[] = {hay[cut - 1]};
      const std::string piece = tokenizer.Decode(one);
      if (!piece.empty() && (piece.back() == '.' || piece.back() == '\n')) break;
      ++cut;
    }
  }
  NiahPrompt p;
  p.haystack_tokens = static_cast<int32_t>(budget);
  p.tokens = prefix;
  p.tokens.insert(p.tokens.end(), hay.begin(), hay.begin() + cut);
  p.needle_position = static_cast<int32_t>(p.tokens.size());
  p.tokens.insert(p.tokens.end(), needle.begin(), needle.end());
  p.tokens.insert(p.tokens.end(), hay.begin() + cut, hay.end());
  p.tokens.insert(p.tokens.end(), suffix.begin(), suffix.end());
  return p;
}

}  // namespace specache
