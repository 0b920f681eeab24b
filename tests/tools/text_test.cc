// Unicode helpers, chat format and NIAH prompt layout: no model needed.

#include <gtest/gtest.h>

#include "specache/chat_template.h"
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

}  // namespace
}  // namespace specache
