#include "unicode_classes.h"

#include <algorithm>
#include <iterator>

namespace specache::text {
namespace {

struct Range {
  char32_t first, last;
};

constexpr Range kLetters[] = {
    {U'A', U'Z'},         {U'a', U'z'},         {0xAA, 0xAA},         {0xB5, 0xB5},         {0xBA, 0xBA},
    {0xC0, 0xD6},         {0xD8, 0xF6},         {0xF8, 0x2C1},        {0x2C6, 0x2D1},       {0x2E0, 0x2E4},
    {0x370, 0x374},       {0x376, 0x37D},       {0x37F, 0x37F},       {0x386, 0x386},       {0x388, 0x3FF},
    {0x400, 0x481},       {0x48A, 0x52F},       {0x531, 0x556},       {0x560, 0x588},       {0x5D0, 0x5EA},
    {0x620, 0x64A},       {0x671, 0x6D3},       {0x904, 0x939},       {0xE01, 0xE30},       {0x10A0, 0x10FF},
    {0x1100, 0x11FF},     {0x1E00, 0x1FBC},     {0x1FC2, 0x1FCC},     {0x1FD0, 0x1FDB},     {0x1FE0, 0x1FEC},
    {0x1FF2, 0x1FFC},     {0x3041, 0x3096},     {0x309D, 0x309F},     {0x30A1, 0x30FA},     {0x30FC, 0x30FF},
    {0x3400, 0x4DBF},     {0x4E00, 0x9FFF},     {0xAC00, 0xD7A3},     {0xF900, 0xFAFF},     {0xFF21, 0xFF3A},
    {0xFF41, 0xFF5A},     {0xFF66, 0xFFDC},     {0x20000, 0x2FFFF},
};

constexpr Range kNumbers[] = {
    {U'0', U'9'},     {0xB2, 0xB3},     {0xB9, 0xB9},     {0xBC, 0xBE},     {0x660, 0x669},   {0x6F0, 0x6F9},
    {0x966, 0x96F},   {0xE50, 0xE59},   {0x2070, 0x2070}, {0x2074, 0x2079}, {0x2080, 0x2089}, {0x2150, 0x2189},
    {0x2460, 0x249B}, {0x24EA, 0x24FF}, {0x2776, 0x2793}, {0x3007, 0x3007}, {0x3021, 0x3029}, {0xFF10, 0xFF19},
};

constexpr Range kSpaces[] = {
    {0x09, 0x0D}, {0x20, 0x20}, {0x85, 0x85}, {0xA0, 0xA0}, {0x1680, 0x1680}, {0x2000, 0x200A},
    {0x2028, 0x2029}, {0x202F, 0x202F}, {0x205F, 0x205F}, {0x3000, 0x3000},
};

template <size_t N>
bool InRanges(const Range (&ranges)[N], char32_t cp) {
  // Ranges are sorted and disjoint: find the first range ending at or after cp.
  const Range* it = std::lower_bound(std::begin(ranges), std::end(ranges), cp,
                                     [](const Range& r, char32_t c) { return r.last < c; });
  return it != std::end(ranges) && it->first <= cp;
}

}  // namespace

char32_t NextCodePoint(std::string_view text, size_t* pos) {
  const auto byte = [&](size_t i) { return static_cast<unsigned char>(text[i]); };
  const unsigned char b0 = byte(*pos);
  int extra = 0;
  char32_t cp = 0;
  if (b0 < 0x80) {
    ++*pos;
    return b0;
  } else if ((b0 & 0xE0) == 0xC0) {
    extra = 1, cp = b0 & 0x1F;
  } else if ((b0 & 0xF0) == 0xE0) {
    extra = 2, cp = b0 & 0x0F;
  } else if ((b0 & 0xF8) == 0xF0) {
    extra = 3, cp = b0 & 0x07;
  } else {
    ++*pos;
    return 0xFFFD;
  }
  if (*pos + extra >= text.size()) {  // truncated at the end
    ++*pos;
    return 0xFFFD;
  }
  for (int i = 1; i <= extra; ++i) {
    if ((byte(*pos + i) & 0xC0) != 0x80) {
      ++*pos;
      return 0xFFFD;
    }
    cp = (cp << 6) | (byte(*pos + i) & 0x3F);
  }
  *pos += extra + 1;
  return cp;
}

void AppendUtf8(char32_t cp, std::string* out) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

bool IsLetter(char32_t cp) { return InRanges(kLetters, cp); }
bool IsNumber(char32_t cp) { return InRanges(kNumbers, cp); }
bool IsSpace(char32_t cp) { return InRanges(kSpaces, cp); }

size_t CompleteUtf8Prefix(std::string_view bytes) {
  // Look back at most 3 bytes for the start of a character that has not ended yet.
  for (size_t back = 1; back <= 3 && back <= bytes.size(); ++back) {
    const unsigned char b = static_cast<unsigned char>(bytes[bytes.size() - back]);
    if ((b & 0xC0) == 0x80) continue;  // continuation byte: keep looking for the lead
    const size_t need = b >= 0xF0 ? 4 : b >= 0xE0 ? 3 : b >= 0xC0 ? 2 : 1;
    return need > back ? bytes.size() - back : bytes.size();
  }
  return bytes.size();
}

}  // namespace specache::text
