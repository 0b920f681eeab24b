#include "heatmap_png.h"

#include <ft2build.h>
#include FT_FREETYPE_H
#include <png.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>

#include "embedded_font.h"

namespace specache {
namespace {

constexpr int kCellWidth = 96, kCellHeight = 44, kGap = 2;
constexpr int kTitlePx = 20, kLabelPx = 15;  // font sizes (pixels per em)
constexpr int kMargin = 16;
constexpr Rgb8 kInk{25, 25, 25}, kWhite{255, 255, 255};

// FreeType's library and the embedded face; one per picture (a picture takes milliseconds).
class Font {
 public:
  static Result<std::unique_ptr<Font>> Open() {
    auto f = std::unique_ptr<Font>(new Font);
    if (FT_Init_FreeType(&f->library_) != 0) return Status::Internal("FreeType did not initialize");
    const std::span<const uint8_t> ttf = EmbeddedFont();
    if (FT_New_Memory_Face(f->library_, ttf.data(), static_cast<FT_Long>(ttf.size()), 0, &f->face_) != 0) {
      return Status::Internal("FreeType could not read the embedded font");
    }
    return f;
  }
  ~Font() {
    if (face_) FT_Done_Face(face_);
    if (library_) FT_Done_FreeType(library_);
  }
  FT_Face face(int pixels) {
    FT_Set_Pixel_Sizes(face_, 0, static_cast<FT_UInt>(pixels));
    return face_;
  }

 private:
  Font() = default;
  FT_Library library_ = nullptr;
  FT_Face face_ = nullptr;
};

// Width in pixels of `text` at `pixels` per em (advances only; the font is not kerned here).
int TextWidth(Font* font, const std::string& text, int pixels) {
  FT_Face face = font->face(pixels);
  long width = 0;
  for (unsigned char ch : text) {
    if (FT_Load_Char(face, ch, FT_LOAD_DEFAULT) == 0) width += face->glyph->advance.x;
  }
  return static_cast<int>(width >> 6);
}

class Canvas {
 public:
  Canvas(int w, int h) : w_(w), h_(h), px_(static_cast<size_t>(w) * h * 3, 255) {}
  void Fill(int x0, int y0, int w, int h, Rgb8 c) {
    for (int y = std::max(0, y0); y < std::min(h_, y0 + h); ++y) {
      for (int x = std::max(0, x0); x < std::min(w_, x0 + w); ++x) Set(x, y, c);
    }
  }
  // Text with its baseline at y, anti-aliased over what is there.
  void Text(Font* font, int x, int baseline, const std::string& text, int pixels, Rgb8 ink) {
    FT_Face face = font->face(pixels);
    for (unsigned char ch : text) {
      if (FT_Load_Char(face, ch, FT_LOAD_RENDER) != 0) continue;
      const FT_GlyphSlot g = face->glyph;
      const FT_Bitmap& b = g->bitmap;
      for (unsigned row = 0; row < b.rows; ++row) {
        for (unsigned col = 0; col < b.width; ++col) {
          const int px = x + g->bitmap_left + static_cast<int>(col), py = baseline - g->bitmap_top + static_cast<int>(row);
          if (px < 0 || py < 0 || px >= w_ || py >= h_) continue;
          const double a = b.buffer[row * b.pitch + col] / 255.0;
          uint8_t* p = &px_[(static_cast<size_t>(py) * w_ + px) * 3];
          p[0] = static_cast<uint8_t>(std::lround(p[0] * (1 - a) + ink.r * a));
          p[1] = static_cast<uint8_t>(std::lround(p[1] * (1 - a) + ink.g * a));
          p[2] = static_cast<uint8_t>(std::lround(p[2] * (1 - a) + ink.b * a));
        }
      }
      x += static_cast<int>(g->advance.x >> 6);
    }
  }
  Status WritePng(const std::string& path) const {
    png_image image{};
    image.version = PNG_IMAGE_VERSION;
    image.width = static_cast<png_uint_32>(w_);
    image.height = static_cast<png_uint_32>(h_);
    image.format = PNG_FORMAT_RGB;
    if (!png_image_write_to_file(&image, path.c_str(), 0, px_.data(), 0, nullptr)) {
      return Status::FailedPrecondition("cannot write " + path + ": " + image.message);
    }
    return Status::Ok();
  }

 private:
  void Set(int x, int y, Rgb8 c) {
    uint8_t* p = &px_[(static_cast<size_t>(y) * w_ + x) * 3];
    p[0] = c.r;
    p[1] = c.g;
    p[2] = c.b;
  }
  int w_, h_;
  std::vector<uint8_t> px_;
};

std::string Percent(double v) {
  if (std::isnan(v)) return "not run";
  char text[16];
  std::snprintf(text, sizeof text, "%.0f%%", v * 100);
  return text;
}

// The layout, given text widths (the font measures them).
Result<HeatMapGeometry> Layout(const HeatMap& map, Font* font) {
  const int rows = static_cast<int>(map.row_labels.size()), cols = static_cast<int>(map.column_labels.size());
  if (rows == 0 || cols == 0 || static_cast<int>(map.values.size()) != rows) {
    return Status::InvalidArgument("heat map needs labels and a value per cell");
  }
  for (const auto& r : map.values) {
    if (static_cast<int>(r.size()) != cols) return Status::InvalidArgument("heat map rows differ in length");
  }
  int label_width = TextWidth(font, map.row_axis, kLabelPx);
  for (const auto& l : map.row_labels) label_width = std::max(label_width, TextWidth(font, l, kLabelPx));
  int cell_width = kCellWidth;
  for (const auto& l : map.column_labels) cell_width = std::max(cell_width, TextWidth(font, l, kLabelPx) + 12);
  HeatMapGeometry g;
  g.cell_width = cell_width;
  g.cell_height = kCellHeight;
  g.grid_left = kMargin + label_width + 12;
  g.grid_top = kMargin + kTitlePx + 12 + kLabelPx + 10;  // title, then the row axis name
  const int grid_bottom = g.grid_top + rows * kCellHeight;
  // Below the grid: column labels, the column axis name, then the legend bar with its ticks.
  g.legend_left = g.grid_left;
  g.legend_top = grid_bottom + 2 * (kLabelPx + 10) + kLabelPx + 16;  // and the legend's name
  g.legend_width = std::max(200, std::min(cols * cell_width, 320));
  g.legend_height = 14;
  const int not_run_width = 20 + 6 + TextWidth(font, "not run", kLabelPx);
  g.width = std::max({g.grid_left + cols * cell_width + kMargin, kMargin + TextWidth(font, map.title, kTitlePx) + kMargin,
                      g.legend_left + g.legend_width + 24 + not_run_width + kMargin,
                      g.grid_left + TextWidth(font, map.column_axis, kLabelPx) + kMargin});
  g.height = g.legend_top + g.legend_height + 8 + kLabelPx + kMargin;
  return g;
}

}  // namespace

Rgb8 HeatMapColor(double v) {
  if (std::isnan(v)) return {200, 200, 200};
  v = std::clamp(v, 0.0, 1.0);
  // red (0) -> yellow (0.5) -> green (1)
  const double r = v < 0.5 ? 230 : 230 - (v - 0.5) * 2 * 170;
  const double g = v < 0.5 ? 60 + v * 2 * 160 : 220 - (v - 0.5) * 2 * 40;
  return {static_cast<uint8_t>(r), static_cast<uint8_t>(g), 70};
}

Result<HeatMapGeometry> LayoutHeatMap(const HeatMap& map) {
  SPECACHE_ASSIGN_OR_RETURN(auto font, Font::Open());
  return Layout(map, font.get());
}

Status WriteHeatMapPng(const HeatMap& map, const std::string& path) {
  SPECACHE_ASSIGN_OR_RETURN(auto font_owner, Font::Open());
  Font* font = font_owner.get();
  SPECACHE_ASSIGN_OR_RETURN(HeatMapGeometry g, Layout(map, font));
  const int rows = static_cast<int>(map.row_labels.size()), cols = static_cast<int>(map.column_labels.size());
  Canvas c(g.width, g.height);
  c.Text(font, kMargin, kMargin + kTitlePx, map.title, kTitlePx, kInk);
  c.Text(font, kMargin, g.grid_top - 10, map.row_axis, kLabelPx, kInk);
  // Baseline that centers a label of kLabelPx in a box of height h starting at y.
  auto centered = [](int y, int h) { return y + (h + kLabelPx * 7 / 10) / 2; };
  for (int r = 0; r < rows; ++r) {
    const int y = g.grid_top + r * g.cell_height;
    const std::string& label = map.row_labels[r];
    c.Text(font, g.grid_left - 12 - TextWidth(font, label, kLabelPx), centered(y, g.cell_height - kGap), label,
           kLabelPx, kInk);
    for (int col = 0; col < cols; ++col) {
      const int x = g.grid_left + col * g.cell_width;
      const double v = map.values[r][col];
      c.Fill(x, y, g.cell_width - kGap, g.cell_height - kGap, HeatMapColor(v));
      const std::string text = Percent(v);
      c.Text(font, x + (g.cell_width - kGap - TextWidth(font, text, kLabelPx)) / 2, centered(y, g.cell_height - kGap),
             text, kLabelPx, kInk);
    }
  }
  const int axis_baseline = g.grid_top + rows * g.cell_height + kLabelPx + 6;
  for (int col = 0; col < cols; ++col) {
    const std::string& label = map.column_labels[col];
    c.Text(font, g.grid_left + col * g.cell_width + (g.cell_width - kGap - TextWidth(font, label, kLabelPx)) / 2,
           axis_baseline, label, kLabelPx, kInk);
  }
  c.Text(font, g.grid_left, axis_baseline + kLabelPx + 10, map.column_axis, kLabelPx, kInk);

  // Legend: the color scale from 0% to 100% with three ticks, then the grey of "not run".
  for (int i = 0; i < g.legend_width; ++i) {
    c.Fill(g.legend_left + i, g.legend_top, 1, g.legend_height, HeatMapColor(static_cast<double>(i) / (g.legend_width - 1)));
  }
  const int tick_baseline = g.legend_top + g.legend_height + 6 + kLabelPx;
  for (double v : {0.0, 0.5, 1.0}) {
    const std::string text = Percent(v);
    const int x = g.legend_left + static_cast<int>(v * (g.legend_width - 1)) - TextWidth(font, text, kLabelPx) / 2;
    c.Text(font, std::max(x, 0), tick_baseline, text, kLabelPx, kInk);
  }
  const int grey_left = g.legend_left + g.legend_width + 24;
  c.Fill(grey_left, g.legend_top, 20, g.legend_height, HeatMapColor(NAN));
  c.Text(font, grey_left + 26, g.legend_top + g.legend_height - 2, "not run", kLabelPx, kInk);
  c.Text(font, g.legend_left, g.legend_top - 6, "correct answers", kLabelPx, kInk);
  return c.WritePng(path);
}

}  // namespace specache
