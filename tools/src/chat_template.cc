#include "specache/chat_template.h"

namespace specache {
namespace {

// Replaces the escape "\n" (backslash, n) by a newline, as a Jinja string literal would (one
// pass: a replace per escape was quadratic in a long template).
std::string Unescape(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '\\' && i + 1 < s.size() && s[i + 1] == 'n') {
      out += '\n';
      ++i;
    } else {
      out += s[i];
    }
  }
  return out;
}

// A default system message taken from the template is plain text: not template code of another
// branch (quotes, braces) and no special tokens of its own.
bool PlainText(const std::string& s) { return s.find_first_of("'\"{}") == std::string::npos && s.find("<|") == std::string::npos; }

}  // namespace

ChatTemplate ChatTemplate::ChatMl(std::string default_system) {
  ChatTemplate t;
  t.default_system_ = std::move(default_system);
  return t;
}

Result<ChatTemplate> ChatTemplate::FromGguf(const gguf::GgufFile& file) {
  auto source = file.GetString("tokenizer.chat_template");
  if (!source.ok()) return Status::NotFound("the model file has no tokenizer.chat_template");
  const std::string tpl = Unescape(*source);
  if (tpl.find("<|im_start|>") == std::string::npos) {
    return Status::Unimplemented("chat template is not ChatML (starts with '" + tpl.substr(0, 60) +
                                 "'); use --raw-prompt");
  }
  // A literal system turn inside the template is the default system message.
  std::string system;
  const std::string open = "<|im_start|>system\n";
  const size_t at = tpl.find(open);
  if (at != std::string::npos && tpl.find("!= 'system'") != std::string::npos) {
    const size_t end = tpl.find("<|im_end|>", at);
    if (end != std::string::npos) system = tpl.substr(at + open.size(), end - at - open.size());
    if (!PlainText(system)) system.clear();
  }
  return ChatMl(std::move(system));
}

std::string ChatTemplate::Apply(std::span<const ChatMessage> messages, bool add_generation_prompt) const {
  std::string out;
  if (!default_system_.empty() && (messages.empty() || messages[0].role != "system")) {
    out += "<|im_start|>system\n" + default_system_ + "<|im_end|>\n";
  }
  for (const ChatMessage& m : messages) out += "<|im_start|>" + m.role + "\n" + m.content + "<|im_end|>\n";
  if (add_generation_prompt) out += "<|im_start|>assistant\n";
  return out;
}

}  // namespace specache
