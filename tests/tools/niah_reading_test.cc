// The one-line reading of a needle table says what the numbers support and no more.
#include <gtest/gtest.h>

#include "niah_reading.h"

namespace specache::run {
namespace {

bool Has(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

TEST(NiahReadingTest, SpeCacheKeepingFullsAnswersWhereKiviAloneMissesThem) {
  const std::string r = ReadNiahTable({{"full", "full", 16, 2, 2, 1.0},
                                       {"kivi-1bit", "kivi", 1, 0, 2, 0.14},
                                       {"specache-1bit", "specache", 1, 2, 2, 0.24}});
  EXPECT_TRUE(Has(r, "full (the fp16 cache) found the needle in 2/2 points")) << r;
  EXPECT_TRUE(Has(r, "kivi-1bit in 0/2 with 0.14 of the fp16 KV memory")) << r;
  EXPECT_TRUE(Has(r, "specache-1bit kept every answer full found, in 0.24 of its memory.")) << r;
  EXPECT_TRUE(Has(r, "the rows specache-1bit fetches in fp16 made the difference")) << r;
  EXPECT_EQ(r.find('\n'), std::string::npos);
}

TEST(NiahReadingTest, SaysWhatSpeCacheLostAndWhenKiviDidAsWell) {
  const std::string r = ReadNiahTable({{"full", "full", 16, 3, 3, 1.0},
                                       {"kivi-1bit", "kivi", 1, 2, 3, 0.14},
                                       {"specache-1bit", "specache", 1, 2, 3, 0.24}});
  EXPECT_TRUE(Has(r, "specache-1bit lost 1 of full's 3 answers.")) << r;
  EXPECT_TRUE(Has(r, "kivi-1bit did as well here")) << r;
  EXPECT_FALSE(Has(r, "kept every answer")) << r;
}

TEST(NiahReadingTest, NamesAMissThatKiviSharesWithoutCreditingEither) {
  const std::string r = ReadNiahTable({{"full", "full", 16, 1, 1, 1.0},
                                       {"kivi-1bit", "kivi", 1, 0, 1, 0.14},
                                       {"specache-1bit", "specache", 1, 0, 1, 0.24},
                                       {"specache-2bit", "specache", 2, 1, 1, 0.36}});
  EXPECT_TRUE(Has(r, "specache-1bit lost 1 of full's 1 answers. kivi-1bit missed it too.")) << r;
  EXPECT_TRUE(Has(r, "specache-2bit kept every answer full found, in 0.36 of its memory.")) << r;
}

TEST(NiahReadingTest, ConcludesNothingWhenFullNeverFoundTheNeedle) {
  const std::string r = ReadNiahTable({{"full", "full", 16, 0, 1, 1.0}, {"specache-1bit", "specache", 1, 0, 1, 0.18}});
  EXPECT_TRUE(Has(r, "cannot tell")) << r;
  EXPECT_FALSE(Has(r, "missed it too")) << r;
  EXPECT_FALSE(Has(r, "kept every answer")) << r;
}

}  // namespace
}  // namespace specache::run
