// Needle-in-a-haystack prompts: real text cut or repeated to a token budget, a needle sentence
// inserted at a depth (snapped to the next sentence end), then the question, in the chat format.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "specache/bpe_tokenizer.h"
#include "specache/chat_template.h"
#include "specache/status.h"

namespace specache {

struct NiahSpec {
  std::string haystack;  // the text (any length; repeated when too short)
  std::string needle;    // a sentence, e.g. "The secret code of the blue door is 4817."
  std::string question;  // e.g. "What is the secret code of the blue door?"
  int32_t context_tokens = 0;  // length of the whole prompt in tokens (template included)
  double depth = 0.5;          // where the needle goes, as a fraction of the haystack
};

struct NiahPrompt {
  std::vector<int32_t> tokens;   // exactly context_tokens long
  int32_t haystack_tokens = 0;   // tokens of haystack text in the prompt
  int32_t needle_position = 0;   // index of the needle's first token in `tokens`
};

// INVALID_ARGUMENT when the budget cannot hold the template, needle and question, or the depth is
// outside [0, 1].
Result<NiahPrompt> BuildNiahPrompt(const BpeTokenizer& tokenizer, const ChatTemplate& chat, const NiahSpec& spec);

}  // namespace specache
