#include "heatmap_png.h"

#include <zlib.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>

namespace specache {
namespace {

// 5x7 glyphs, one byte per row (top first), bit 4 = leftmost pixel.
struct Glyph {
  char c;
  uint8_t rows[7];
};
constexpr Glyph kFont[] = {
    {'0', {0x0E, 0x11, 0x13, 0x15, 0x19, 0x11, 0x0E}}, {'1', {0x04, 0x0C, 0x04, 0x04, 0x04, 0x04, 0x0E}},
    {'2', {0x0E, 0x11, 0x01, 0x02, 0x04, 0x08, 0x1F}}, {'3', {0x1F, 0x02, 0x04, 0x02, 0x01, 0x11, 0x0E}},
    {'4', {0x02, 0x06, 0x0A, 0x12, 0x1F, 0x02, 0x02}}, {'5', {0x1F, 0x10, 0x1E, 0x01, 0x01, 0x11, 0x0E}},
    {'6', {0x06, 0x08, 0x10, 0x1E, 0x11, 0x11, 0x0E}}, {'7', {0x1F, 0x01, 0x02, 0x04, 0x08, 0x08, 0x08}},
    {'8', {0x0E, 0x11, 0x11, 0x0E, 0x11, 0x11, 0x0E}}, {'9', {0x0E, 0x11, 0x11, 0x0F, 0x01, 0x02, 0x0C}},
    {'A', {0x0E, 0x11, 0x11, 0x1F, 0x11, 0x11, 0x11}}, {'B', {0x1E, 0x11, 0x11, 0x1E, 0x11, 0x11, 0x1E}},
    {'C', {0x0E, 0x11, 0x10, 0x10, 0x10, 0x11, 0x0E}}, {'D', {0x1C, 0x12, 0x11, 0x11, 0x11, 0x12, 0x1C}},
    {'E', {0x1F, 0x10, 0x10, 0x1E, 0x10, 0x10, 0x1F}}, {'F', {0x1F, 0x10, 0x10, 0x1E, 0x10, 0x10, 0x10}},
    {'G', {0x0E, 0x11, 0x10, 0x17, 0x11, 0x11, 0x0F}}, {'H', {0x11, 0x11, 0x11, 0x1F, 0x11, 0x11, 0x11}},
    {'I', {0x0E, 0x04, 0x04, 0x04, 0x04, 0x04, 0x0E}}, {'J', {0x07, 0x02, 0x02, 0x02, 0x02, 0x12, 0x0C}},
    {'K', {0x11, 0x12, 0x14, 0x18, 0x14, 0x12, 0x11}}, {'L', {0x10, 0x10, 0x10, 0x10, 0x10, 0x10, 0x1F}},
    {'M', {0x11, 0x1B, 0x15, 0x15, 0x11, 0x11, 0x11}}, {'N', {0x11, 0x11, 0x19, 0x15, 0x13, 0x11, 0x11}},
    {'O', {0x0E, 0x11, 0x11, 0x11, 0x11, 0x11, 0x0E}}, {'P', {0x1E, 0x11, 0x11, 0x1E, 0x10, 0x10, 0x10}},
    {'Q', {0x0E, 0x11, 0x11, 0x11, 0x15, 0x12, 0x0D}}, {'R', {0x1E, 0x11, 0x11, 0x1E, 0x14, 0x12, 0x11}},
    {'S', {0x0F, 0x10, 0x10, 0x0E, 0x01, 0x01, 0x1E}}, {'T', {0x1F, 0x04, 0x04, 0x04, 0x04, 0x04, 0x04}},
    {'U', {0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x0E}}, {'V', {0x11, 0x11, 0x11, 0x11, 0x11, 0x0A, 0x04}},
    {'W', {0x11, 0x11, 0x11, 0x15, 0x15, 0x15, 0x0A}}, {'X', {0x11, 0x11, 0x0A, 0x04, 0x0A, 0x11, 0x11}},
    {'Y', {0x11, 0x11, 0x11, 0x0A, 0x04, 0x04, 0x04}}, {'Z', {0x1F, 0x01, 0x02, 0x04, 0x08, 0x10, 0x1F}},
    {'.', {0x00, 0x00, 0x00, 0x00, 0x00, 0x0C, 0x0C}}, {':', {0x00, 0x0C, 0x0C, 0x00, 0x0C, 0x0C, 0x00}},
    {'-', {0x00, 0x00, 0x00, 0x1F, 0x00, 0x00, 0x00}}, {'=', {0x00, 0x00, 0x1F, 0x00, 0x1F, 0x00, 0x00}},
    {'(', {0x02, 0x04, 0x08, 0x08, 0x08, 0x04, 0x02}}, {')', {0x08, 0x04, 0x02, 0x02, 0x02, 0x04, 0x08}},
    {',', {0x00, 0x00, 0x00, 0x00, 0x0C, 0x04, 0x08}}, {'/', {0x00, 0x01, 0x02, 0x04, 0x08, 0x10, 0x00}},
    {'%', {0x18, 0x19, 0x02, 0x04, 0x08, 0x13, 0x03}}, {'_', {0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x1F}},
    {' ', {0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00}}, {'?', {0x0E, 0x11, 0x01, 0x02, 0x04, 0x00, 0x04}},
};

constexpr int kScale = 2;                       // font pixels per glyph pixel
constexpr int kAdvance = 6 * kScale;             // glyph width plus one column of space
constexpr int kTextHeight = 7 * kScale;
constexpr int kCellWidth = 72, kCellHeight = 40;

struct Rgb {
  uint8_t r, g, b;
};

class Canvas {
 public:
  Canvas(int w, int h) : w_(w), h_(h), px_(static_cast<size_t>(w) * h, Rgb{255, 255, 255}) {}
  int width() const { return w_; }
  int height() const { return h_; }
  void Fill(int x0, int y0, int w, int h, Rgb c) {
    for (int y = std::max(0, y0); y < std::min(h_, y0 + h); ++y) {
      for (int x = std::max(0, x0); x < std::min(w_, x0 + w); ++x) px_[static_cast<size_t>(y) * w_ + x] = c;
    }
  }
  void Text(int x, int y, const std::string& s, Rgb c) {
    for (char ch : s) {
      const char up = static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
      const Glyph* g = std::find_if(std::begin(kFont), std::end(kFont), [&](const Glyph& f) { return f.c == up; });
      if (g == std::end(kFont)) g = std::end(kFont) - 1;  // '?'
      for (int row = 0; row < 7; ++row) {
        for (int col = 0; col < 5; ++col) {
          if (g->rows[row] & (0x10 >> col)) Fill(x + col * kScale, y + row * kScale, kScale, kScale, c);
        }
      }
      x += kAdvance;
    }
  }
  const Rgb* row(int y) const { return px_.data() + static_cast<size_t>(y) * w_; }

 private:
  int w_, h_;
  std::vector<Rgb> px_;
};

int TextWidth(const std::string& s) { return static_cast<int>(s.size()) * kAdvance; }

void PutU32(std::string* out, uint32_t v) {
  for (int shift = 24; shift >= 0; shift -= 8) out->push_back(static_cast<char>((v >> shift) & 0xFF));
}

void PutChunk(std::string* png, const char* type, const std::string& data) {
  PutU32(png, static_cast<uint32_t>(data.size()));
  std::string body = std::string(type, 4) + data;
  png->append(body);
  PutU32(png, static_cast<uint32_t>(crc32(0, reinterpret_cast<const Bytef*>(body.data()), body.size())));
}

Result<std::string> EncodePng(const Canvas& canvas) {
  std::string raw;
  raw.reserve(static_cast<size_t>(canvas.height()) * (1 + 3 * canvas.width()));
  for (int y = 0; y < canvas.height(); ++y) {
    raw.push_back(0);  // filter: none
    raw.append(reinterpret_cast<const char*>(canvas.row(y)), static_cast<size_t>(canvas.width()) * 3);
  }
  uLongf packed_size = compressBound(raw.size());
  std::string packed(packed_size, '\0');
  if (compress2(reinterpret_cast<Bytef*>(packed.data()), &packed_size, reinterpret_cast<const Bytef*>(raw.data()),
                raw.size(), 9) != Z_OK) {
    return Status::Internal("zlib could not compress the image");
  }
  packed.resize(packed_size);
  std::string png = "\x89PNG\r\n\x1a\n";
  std::string header;
  PutU32(&header, static_cast<uint32_t>(canvas.width()));
  PutU32(&header, static_cast<uint32_t>(canvas.height()));
  header += std::string("\x08\x02\x00\x00\x00", 5);  // 8-bit RGB, deflate, no interlace
  PutChunk(&png, "IHDR", header);
  PutChunk(&png, "IDAT", packed);
  PutChunk(&png, "IEND", "");
  return png;
}

Rgb ValueColor(double v) {
  if (std::isnan(v)) return {200, 200, 200};
  v = std::clamp(v, 0.0, 1.0);
  // red (0) -> yellow (0.5) -> green (1)
  const double r = v < 0.5 ? 230 : 230 - (v - 0.5) * 2 * 170;
  const double g = v < 0.5 ? 60 + v * 2 * 160 : 220 - (v - 0.5) * 2 * 40;
  return {static_cast<uint8_t>(r), static_cast<uint8_t>(g), 70};
}

}  // namespace

Status WriteHeatMapPng(const HeatMap& map, const std::string& path) {
  const int rows = static_cast<int>(map.row_labels.size()), cols = static_cast<int>(map.column_labels.size());
  if (rows == 0 || cols == 0 || static_cast<int>(map.values.size()) != rows) {
    return Status::InvalidArgument("heat map needs labels and a value per cell");
  }
  for (const auto& r : map.values) {
    if (static_cast<int>(r.size()) != cols) return Status::InvalidArgument("heat map rows differ in length");
  }
  int label_width = TextWidth("DEPTH");
  for (const auto& l : map.row_labels) label_width = std::max(label_width, TextWidth(l));
  const int left = label_width + 24, top = kTextHeight * 2 + 24;
  const int width = std::max(left + cols * kCellWidth + 16, TextWidth(map.title) + 32);
  const int height = top + rows * kCellHeight + kTextHeight * 3 + 24;
  Canvas c(width, height);
  const Rgb ink{20, 20, 20};
  c.Text(16, 12, map.title, ink);
  c.Text(16, top - kTextHeight - 6, "DEPTH", ink);
  for (int r = 0; r < rows; ++r) {
    const int y = top + r * kCellHeight;
    c.Text(left - 12 - TextWidth(map.row_labels[r]), y + (kCellHeight - kTextHeight) / 2, map.row_labels[r], ink);
    for (int col = 0; col < cols; ++col) {
      const int x = left + col * kCellWidth;
      const double v = map.values[r][col];
      c.Fill(x, y, kCellWidth - 2, kCellHeight - 2, ValueColor(v));
      char text[16];
      if (std::isnan(v)) {
        std::snprintf(text, sizeof text, "-");
      } else {
        std::snprintf(text, sizeof text, "%.0f%%", v * 100);
      }
      c.Text(x + (kCellWidth - 2 - TextWidth(text)) / 2, y + (kCellHeight - 2 - kTextHeight) / 2, text, ink);
    }
  }
  const int axis_y = top + rows * kCellHeight + 8;
  for (int col = 0; col < cols; ++col) {
    const int x = left + col * kCellWidth + (kCellWidth - 2 - TextWidth(map.column_labels[col])) / 2;
    c.Text(x, axis_y, map.column_labels[col], ink);
  }
  c.Text(left, axis_y + kTextHeight + 10, "CONTEXT TOKENS", ink);

  SPECACHE_ASSIGN_OR_RETURN(std::string png, EncodePng(c));
  std::unique_ptr<FILE, int (*)(FILE*)> f(std::fopen(path.c_str(), "wb"), std::fclose);
  if (!f) return Status::NotFound("cannot write " + path);
  if (std::fwrite(png.data(), 1, png.size(), f.get()) != png.size()) return Status::DataLoss("short write to " + path);
  return Status::Ok();
}

}  // namespace specache
