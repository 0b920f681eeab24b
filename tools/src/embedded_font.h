// The TrueType font built into the programs that draw text (DejaVu Sans, from Debian's
// fonts-dejavu-core, embedded at build time), so pictures come out the same wherever they run.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

namespace specache {

std::span<const uint8_t> EmbeddedFont();

}  // namespace specache
