// Unicode helpers for the byte-level BPE pre-tokenizer: UTF-8 decoding and the character classes
// its split pattern uses (\p{L} letters, \p{N} numbers, \s white space).
//
// The classes are exact for ASCII and Latin-1 and cover the common scripts (Latin, Greek,
// Cyrillic, Armenian, Hebrew, Arabic, Devanagari, Thai, CJK, kana, Hangul) by block; other code
// points count as "other" (punctuation/symbols). This is an approximation of the Unicode tables
// that only matters for rare scripts; tests compare whole tokenizations with llama.cpp's.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace specache::text {

// Decodes the code point at text[*pos] and advances *pos. Invalid or truncated sequences decode
// as one byte (returned as 0xFFFD) so that every byte is consumed exactly once.
char32_t NextCodePoint(std::string_view text, size_t* pos);

void AppendUtf8(char32_t cp, std::string* out);

bool IsLetter(char32_t cp);
bool IsNumber(char32_t cp);
bool IsSpace(char32_t cp);

// Bytes that form complete UTF-8 characters at the start of `bytes` (a streaming printer holds
// back the rest until the next token completes it).
size_t CompleteUtf8Prefix(std::string_view bytes);

}  // namespace specache::text
