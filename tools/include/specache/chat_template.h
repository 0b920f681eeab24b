// The chat prompt format of a GGUF model (tokenizer.chat_template). Jinja templates are not
// interpreted; the ChatML family ("<|im_start|>role\ncontent<|im_end|>\n") is recognised, including
// a default system message that the template inserts when the conversation has none.
#pragma once

#include <memory>
#include <span>
#include <string>

#include "specache/gguf.h"
#include "specache/status.h"

namespace specache {

struct ChatMessage {
  std::string role;  // "system", "user", "assistant"
  std::string content;
};

class ChatTemplate {
 public:
  // UNIMPLEMENTED (naming the template's start) for formats other than ChatML; NOT_FOUND when the
  // file has no template.
  static Result<ChatTemplate> FromGguf(const gguf::GgufFile& file);
  static ChatTemplate ChatMl(std::string default_system);

  // The prompt text; with `add_generation_prompt` it ends where the assistant's answer starts.
  std::string Apply(std::span<const ChatMessage> messages, bool add_generation_prompt) const;
  // The text that ends an assistant turn (a stop string for generation).
  const std::string& end_of_turn() const { return end_of_turn_; }
  const std::string& default_system() const { return default_system_; }

 private:
  std::string default_system_;  // empty: none
  std::string end_of_turn_ = "<|im_end|>";
};

}  // namespace specache
