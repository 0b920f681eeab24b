// Unicode helpers, chat format, NIAH prompt layout and the PNG writer: no model needed.
#include <cmath>
#include <fstream>
#include <iterator>

#include <gtest/gtest.h>

#include "heatmap_png.h"
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

TEST(HeatMapTest, WritesAPngOfTheExpectedSizeAndRejectsRaggedValues) {
  HeatMap map{"NIAH full", {"0.00", "0.50", "1.00"}, {"1024", "2048"}, {{1, 0}, {0.5, NAN}, {1, 1}}};
  const std::string path = ::testing::TempDir() + "/heat.png";
  ASSERT_TRUE(WriteHeatMapPng(map, path).ok());
  std::ifstream in(path, std::ios::binary);
  const std::string png((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ASSERT_GT(png.size(), 33u);
  EXPECT_EQ(png.substr(0, 8), "\x89PNG\r\n\x1a\n");
  EXPECT_EQ(png.substr(12, 4), "IHDR");
  auto be32 = [&](size_t at) {
    return (uint32_t(uint8_t(png[at])) << 24) | (uint32_t(uint8_t(png[at + 1])) << 16) |
           (uint32_t(uint8_t(png[at + 2])) << 8) | uint32_t(uint8_t(png[at + 3]));
  };
  EXPECT_GT(be32(16), 2u * 72);  // width holds two cells
  EXPECT_GT(be32(20), 3u * 40);  // height holds three rows
  EXPECT_EQ(png.substr(png.size() - 8, 4), "IEND");

  map.values[1].pop_back();
  EXPECT_EQ(WriteHeatMapPng(map, path).code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace specache
