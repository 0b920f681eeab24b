// Unicode helpers, chat format and NIAH prompt layout: no model needed.

#include <unistd.h>

#include <algorithm>
#include <limits>
#include <random>
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
  TokenizerFile(const std::vector<std::string>& tokens, const std::vector<int32_t>& types, const std::string& chat,
                const std::vector<std::string>& merges = {}) {
    testing::GgufWriter w;
    w.Header(0, chat.empty() ? 4 : 5);
    w.Str("tokenizer.ggml.model"), w.Put<uint32_t>(8), w.Str("gpt2");
    w.Str("tokenizer.ggml.tokens"), w.Put<uint32_t>(9), w.Put<uint32_t>(8), w.Put<uint64_t>(tokens.size());
    for (const std::string& t : tokens) w.Str(t);
    w.Str("tokenizer.ggml.token_type"), w.Put<uint32_t>(9), w.Put<uint32_t>(5), w.Put<uint64_t>(types.size());
    for (int32_t t : types) w.Put<int32_t>(t);
    w.Str("tokenizer.ggml.merges"), w.Put<uint32_t>(9), w.Put<uint32_t>(8), w.Put<uint64_t>(merges.size());
    for (const std::string& m : merges) w.Str(m);
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

// Merging by rank: the tokenizer merges the lowest-ranked pair of neighbours first (leftmost
// among equals), as llama.cpp and Hugging Face's tokenizers do, in O(n log n). The reference here is
// the rule it replaced, every occurrence of the best pair merged in one pass over the symbols:
// the same tokens whenever a merge's parts come from merges of lower rank, as in a list BPE
// training writes, which is what this test builds (random merges of neighbours in a random
// corpus over three letters). Texts of runs of letters are one piece each.
TEST(TokenizerTest, MergesByRankAsAPassPerBestPairDoes) {
  std::mt19937 rng(17);
  std::vector<std::string> tokens{"a", "b", "c"};
  std::vector<std::string> merges;
  std::vector<std::vector<std::string>> corpus(40);
  for (auto& word : corpus) {
    for (int i = 0; i < 30; ++i) word.push_back(tokens[rng() % 3]);
  }
  for (int m = 0; m < 60; ++m) {  // "training": merge a random pair of neighbours everywhere
    auto& word = corpus[rng() % corpus.size()];
    if (word.size() < 2) continue;
    const size_t at = rng() % (word.size() - 1);
    const std::string left = word[at], right = word[at + 1];
    if (std::find(merges.begin(), merges.end(), left + " " + right) != merges.end()) continue;
    merges.push_back(left + " " + right);
    if (std::find(tokens.begin(), tokens.end(), left + right) == tokens.end()) tokens.push_back(left + right);
    for (auto& w : corpus) {
      std::vector<std::string> merged;
      for (size_t i = 0; i < w.size(); ++i) {
        if (i + 1 < w.size() && w[i] == left && w[i + 1] == right) merged.push_back(left + right), ++i;
        else merged.push_back(w[i]);
      }
      w.swap(merged);
    }
  }
  ASSERT_GT(merges.size(), 30u);
  const TokenizerFile file(tokens, std::vector<int32_t>(tokens.size(), 1), "", merges);
  auto f = file.Open();
  ASSERT_TRUE(f);
  auto t = BpeTokenizer::FromGguf(*f);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  auto reference = [&](const std::string& text) {
    std::vector<std::string> symbols;
    for (char ch : text) symbols.push_back(std::string(1, ch));
    while (symbols.size() > 1) {
      size_t best = merges.size();
      for (size_t i = 0; i + 1 < symbols.size(); ++i) {
        const size_t r = std::find(merges.begin(), merges.end(), symbols[i] + " " + symbols[i + 1]) - merges.begin();
        best = std::min(best, r);
      }
      if (best == merges.size()) break;
      const std::string pair = merges[best];
      const std::string left = pair.substr(0, pair.find(' ')), right = pair.substr(pair.find(' ') + 1);
      std::vector<std::string> merged;
      for (size_t i = 0; i < symbols.size(); ++i) {
        if (i + 1 < symbols.size() && symbols[i] == left && symbols[i + 1] == right) merged.push_back(left + right), ++i;
        else merged.push_back(symbols[i]);
      }
      symbols.swap(merged);
    }
    std::vector<int32_t> ids;
    for (const std::string& sym : symbols) ids.push_back(static_cast<int32_t>(std::find(tokens.begin(), tokens.end(), sym) - tokens.begin()));
    return ids;
  };
  for (int i = 0; i < 300; ++i) {
    std::string text;
    const int n = 1 + static_cast<int>(rng() % 120);
    for (int j = 0; j < n; ++j) text.push_back("abc"[rng() % 3]);
    ASSERT_EQ((*t)->Encode(text, false), reference(text)) << text;
    ASSERT_EQ((*t)->Decode((*t)->Encode(text, false)), text);
  }
  // A long run of letters is one piece; it encodes and decodes back.
  std::string text;
  for (int j = 0; j < 200000; ++j) text.push_back("abc"[rng() % 3]);
  EXPECT_EQ((*t)->Decode((*t)->Encode(text, false)), text);
}

// Control tokens in the text: each found once where it occurs, however many there are, and the
// longest of two that start at the same place.
TEST(TokenizerTest, ControlTokensInTheTextAreFoundWhereTheyStart) {
  const TokenizerFile file({"a", "<|x|>", "<|x|>y", "y", "b"}, {1, 3, 3, 1, 1}, "");
  auto f = file.Open();
  ASSERT_TRUE(f);
  auto t = BpeTokenizer::FromGguf(*f);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ((*t)->Encode("a<|x|>y<|x|>b<|x|>", true), (std::vector<int32_t>{0, 2, 1, 4, 1}));
  std::string many;
  std::vector<int32_t> want;
  for (int i = 0; i < 50000; ++i) many += i % 2 ? "<|x|>" : "a", want.push_back(i % 2 ? 1 : 0);
  EXPECT_EQ((*t)->Encode(many, true), want);
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
