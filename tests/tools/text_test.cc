// Unicode helpers, chat format and NIAH prompt layout: no model needed.

#include <unistd.h>

#include <limits>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "specache/bpe_tokenizer.h"
#include "specache/chat_template.h"
#include "specache/gguf.h"
#include "specache/reference_engine.h"
#include "testing/gguf_writer.h"
#include "unicode_classes.h"

namespace specache {
namespace {

TEST(Utf8Test, DecodesAndEncodesRoundTripAndConsumesBadBytesOneByOne) {
  const std::string s = "a\xC3\xA9\xE2\x82\xAC\xF0\x9F\x98\x80";  // a é € 😀
  size_t pos = 0;
  std::vector<char32_t> cps;
  while (pos < s.size()) cps.push_back(text::NextCodePoint(s, &pos));
  EXPECT_EQ(cps, (std::vector<char32_t>{U'a', 0xE9, 0x20AC, 0x1F600}));
  std::string back;
  for (char32_t c : cps) text::AppendUtf8(c, &back);
  EXPECT_EQ(back, s);

  const std::string bad = "\xFF\xC3(\xE2\x82";  // invalid lead, bad continuation, truncated
  pos = 0;
  int n = 0;
  while (pos < bad.size()) {
    const size_t before = pos;
    text::NextCodePoint(bad, &pos);
    EXPECT_GT(pos, before);
    ++n;
  }
  EXPECT_EQ(n, 5);
}

TEST(Utf8Test, CompletePrefixHoldsBackAnUnfinishedCharacter) {
  EXPECT_EQ(text::CompleteUtf8Prefix("abc"), 3u);
  EXPECT_EQ(text::CompleteUtf8Prefix("ab\xE2\x82"), 2u);
  EXPECT_EQ(text::CompleteUtf8Prefix("ab\xE2\x82\xAC"), 5u);
  EXPECT_EQ(text::CompleteUtf8Prefix("\xF0\x9F\x98"), 0u);
  EXPECT_EQ(text::CompleteUtf8Prefix(""), 0u);
}

TEST(UnicodeClassesTest, ClassifiesTheCharactersThePreTokenizerSplitsOn) {
  EXPECT_TRUE(text::IsLetter(U'q'));
  EXPECT_TRUE(text::IsLetter(0xE9));      // é
  EXPECT_TRUE(text::IsLetter(0x65E5));    // 日
  EXPECT_FALSE(text::IsLetter(U'7'));
  EXPECT_FALSE(text::IsLetter(0x2014));   // em dash
  EXPECT_TRUE(text::IsNumber(U'7'));
  EXPECT_TRUE(text::IsNumber(0xBD));      // ½
  EXPECT_TRUE(text::IsSpace(U'\n'));
  EXPECT_TRUE(text::IsSpace(0x3000));
  EXPECT_FALSE(text::IsSpace(U'x'));
}

TEST(ChatTemplateTest, ChatMlWithDefaultSystemMessage) {
  const ChatTemplate chat = ChatTemplate::ChatMl("Be brief.");
  const ChatMessage user[] = {{"user", "Hi"}};
  EXPECT_EQ(chat.Apply(user, true),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
  const ChatMessage with_system[] = {{"system", "S"}, {"user", "Hi"}};
  EXPECT_EQ(chat.Apply(with_system, false), "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n");
}

// A GGUF file of tokenizer metadata only (the reader's format: tools/include/specache/gguf.h).
class TokenizerFile {
 public:
  TokenizerFile(const std::vector<std::string>& tokens, const std::vector<int32_t>& types, const std::string& chat) {
    testing::GgufWriter w;
    w.Header(0, chat.empty() ? 4 : 5);
    w.Str("tokenizer.ggml.model"), w.Put<uint32_t>(8), w.Str("gpt2");
    w.Str("tokenizer.ggml.tokens"), w.Put<uint32_t>(9), w.Put<uint32_t>(8), w.Put<uint64_t>(tokens.size());
    for (const std::string& t : tokens) w.Str(t);
    w.Str("tokenizer.ggml.token_type"), w.Put<uint32_t>(9), w.Put<uint32_t>(5), w.Put<uint64_t>(types.size());
    for (int32_t t : types) w.Put<int32_t>(t);
    w.Str("tokenizer.ggml.merges"), w.Put<uint32_t>(9), w.Put<uint32_t>(8), w.Put<uint64_t>(0);
    if (!chat.empty()) w.Str("tokenizer.chat_template"), w.Put<uint32_t>(8), w.Str(chat);
    w.Pad(32);  // the (empty) tensor data starts aligned
    char name[] = "/tmp/specache-tokenizer-XXXXXX";
    const int fd = mkstemp(name);
    EXPECT_GE(fd, 0);
    EXPECT_EQ(write(fd, w.bytes().data(), w.bytes().size()), static_cast<ssize_t>(w.bytes().size()));
    close(fd);
    path_ = name;
  }
  ~TokenizerFile() { unlink(path_.c_str()); }
  std::unique_ptr<gguf::GgufFile> Open() const {
    auto f = gguf::GgufFile::Open(path_);
    EXPECT_TRUE(f.ok()) << f.status().ToString();
    return f.ok() ? std::move(*f) : nullptr;
  }

 private:
  std::string path_;
};

// An empty control token matched everywhere without consuming anything: Encode of any text with
// special tokens parsed never ended (and filled memory with that token's id).
TEST(TokenizerTest, AnEmptyControlTokenIsRefusedAtLoad) {
  const TokenizerFile file({"a", "", "<|im_end|>"}, {1, 3, 3}, "");
  auto f = file.Open();
  ASSERT_TRUE(f);
  auto t = BpeTokenizer::FromGguf(*f);
  EXPECT_EQ(t.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(t.status().message().find("tokens[1] is an empty control token"), std::string::npos) << t.status().ToString();
  const TokenizerFile fine({"a", "<|im_end|>"}, {1, 3}, "");
  auto g = fine.Open();
  ASSERT_TRUE(g);
  auto u = BpeTokenizer::FromGguf(*g);
  ASSERT_TRUE(u.ok()) << u.status().ToString();
  EXPECT_EQ((*u)->Encode("a<|im_end|>a", true), (std::vector<int32_t>{0, 1, 0}));
}

// The template's literal system turn becomes the default system message only when it is plain
// text; escapes are undone in one pass.
TEST(ChatTemplateTest, ADefaultSystemMessageIsTakenOnlyAsPlainText) {
  const std::string plain =
      "{% if messages[0]['role'] != 'system' %}<|im_start|>system\\nBe brief.<|im_end|>\\n{% endif %}";
  const TokenizerFile a({"a"}, {1}, plain);
  const auto file_a = a.Open();
  ASSERT_TRUE(file_a);
  auto chat = ChatTemplate::FromGguf(*file_a);
  ASSERT_TRUE(chat.ok()) << chat.status().ToString();
  const ChatMessage user[] = {{"user", "Hi"}};
  EXPECT_EQ(chat->Apply(user, false), "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n");
  const std::string code =
      "{% if messages[0]['role'] != 'system' %}<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>{% endif %}";
  const TokenizerFile b({"a"}, {1}, code);
  const auto file_b = b.Open();
  ASSERT_TRUE(file_b);
  chat = ChatTemplate::FromGguf(*file_b);
  ASSERT_TRUE(chat.ok()) << chat.status().ToString();
  EXPECT_EQ(chat->Apply(user, false), "<|im_start|>user\nHi<|im_end|>\n") << "no system turn made of template code";
}

// NaN is never the maximum (std::max_element answered 0 whenever the first logit was NaN), and the
// CPU answers as the GPU engine's argmax kernel does.
TEST(ArgmaxTest, TheFirstMaximumAndNeverNaN) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(Argmax(std::vector<float>{nan, 1.0f, 3.0f, 3.0f, 2.0f}), 2);
  EXPECT_EQ(Argmax(std::vector<float>{-1.0f, nan, -0.5f}), 2);
  EXPECT_EQ(Argmax(std::vector<float>{nan, nan}), 0);
  EXPECT_EQ(Argmax(std::vector<float>{-std::numeric_limits<float>::infinity(), 0.0f}), 1);
}

}  // namespace
}  // namespace specache
