// How a full-precision source stores a row in host memory (KvConfig::host_row_format,
// SequenceLayout::row_format): the format, the bytes of a stored row, and the conversion between
// the rows the agent computes ([2][head_dim] fp16, key then value) and the stored ones.
//
// A source takes and returns rows as fp16 (AppendRows, ReadRows) and converts with EncodeHostRows
// and DecodeHostRows; a reader of its pages in place (zero-copy, full_precision_source.h) reads
// stored rows, whose bytes are:
//
//   kFp16: [K: head_dim fp16][V: head_dim fp16]                          4 x head_dim bytes
//   kInt8: [K codes: head_dim int8][V codes: head_dim int8]
//          [K scale: fp16][V scale: fp16][12 zero bytes]                 2 x head_dim + 16 bytes
//
// kInt8 (head_dim 128: 272 bytes instead of 512) is symmetric per half: a half's scale is its
// largest magnitude over 127, rounded to fp16, and each code is value / scale rounded half away
// from zero and clamped to [-127, 127]; a value reads back as code x scale in fp16 (clamped to
// fp16's largest finite value, +-65504). A half of zeros, or whose scale rounds to 0, stores scale
// 0 and reads back zeros. A half with any non-finite value (a model already broken) stores scale
// NaN and reads back all NaN: an int8 code has no place for it, and a row that reads back
// plausible numbers would hide the fault. The 16-byte tail keeps every stored row a whole number
// of 16-byte vectors, so rows stay 16-byte aligned in a page.
//
// Stored int8 rows halve the host memory a sequence takes and the bytes a fetched row moves over
// the host link; docs/method.md has what they cost in fidelity.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "specache/half.h"
#include "specache/status.h"

namespace specache {

enum class HostRowFormat : uint32_t {
  kFp16 = 0,  // the rows as computed
  kInt8 = 1,  // 8-bit codes with an fp16 scale per key half and per value half
};

// "fp16", "int8".
std::string_view HostRowFormatName(HostRowFormat format);
// A format's number as a daemon stores it (shm_layout.h RowFormat) by its name, or the number
// itself when this build knows no such format (a listing from a newer daemon).
std::string HostRowFormatNameOrNumber(uint32_t value);
Result<HostRowFormat> ParseHostRowFormat(std::string_view name);
// INVALID_ARGUMENT for a value outside the enum, or kInt8 with head_dim not a positive multiple of
// 8 (its rows would not be whole 16-byte vectors). Sources check a layout's format with it.
Status CheckHostRowFormat(HostRowFormat format, int head_dim);

// Bytes of one stored row at head_dim (a multiple of 8 for kInt8's alignment).
constexpr int64_t HostRowBytes(HostRowFormat format, int head_dim) {
  return format == HostRowFormat::kInt8 ? int64_t{2} * head_dim + 16 : int64_t{4} * head_dim;
}

// n rows [n][2][head_dim] fp16 -> [n][HostRowBytes] stored bytes.
void EncodeHostRows(HostRowFormat format, const Half* rows, int64_t n, int head_dim, uint8_t* stored);

// n stored rows -> [n][2][head_dim] fp16. `rows` may be `stored` itself (a read that landed the
// stored bytes at the front of the fp16 rows' buffer): rows are decoded last to first, each
// through a copy, so no stored byte is overwritten before it is read. Any other overlap goes
// through a copy of all n stored rows.
void DecodeHostRows(HostRowFormat format, const uint8_t* stored, int64_t n, int head_dim, Half* rows);

// One half of a row ([n] fp16 values) encoded as kInt8 and decoded again, in place: the
// values an int8 host row reads back (KvConfig::round_host_rows uses it for its kInt8).
void RoundTripInt8Half(Half* values, int n);

}  // namespace specache
