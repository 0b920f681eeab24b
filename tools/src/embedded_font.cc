#include "embedded_font.h"

// The font file's bytes go into .rodata with the assembler's .incbin; SPECACHE_FONT_FILE is the
// absolute path CMake found (tools/CMakeLists.txt). No copy of the font lives in the tree.
#ifndef SPECACHE_FONT_FILE
#error "SPECACHE_FONT_FILE must name the TrueType file to embed"
#endif

asm(".section .rodata\n"
    ".balign 16\n"
    ".global specache_embedded_font_begin\n"
    ".hidden specache_embedded_font_begin\n"
    "specache_embedded_font_begin:\n"
    ".incbin \"" SPECACHE_FONT_FILE "\"\n"
    ".global specache_embedded_font_end\n"
    ".hidden specache_embedded_font_end\n"
    "specache_embedded_font_end:\n"
    ".previous\n");

extern "C" const uint8_t specache_embedded_font_begin[];
extern "C" const uint8_t specache_embedded_font_end[];

namespace specache {

std::span<const uint8_t> EmbeddedFont() {
  return {specache_embedded_font_begin, static_cast<size_t>(specache_embedded_font_end - specache_embedded_font_begin)};
}

}  // namespace specache
