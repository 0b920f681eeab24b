#include "line_plot_png.h"

#include <png.h>
#include <stb_easy_font.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>

namespace specache {
namespace {

constexpr int kWidth = 1020, kHeight = 600;
constexpr int kLeft = 90, kRight = 290, kTop = 60, kBottom = 70;  // margins around the plot area
constexpr int kTextScale = 2;                                     // screen pixels per font pixel

struct Rgb {
  uint8_t r, g, b;
};
constexpr Rgb kBlack{0, 0, 0}, kGrid{225, 225, 225};
constexpr Rgb kPalette[] = {{31, 119, 180}, {214, 39, 40},  {44, 160, 44},  {255, 127, 14},
                            {148, 103, 189}, {140, 86, 75}, {227, 119, 194}, {127, 127, 127}};

class Canvas {
 public:
  Canvas() : px_(size_t(kWidth) * kHeight, Rgb{255, 255, 255}) {}
  void Set(int x, int y, Rgb c) {
    if (x >= 0 && x < kWidth && y >= 0 && y < kHeight) px_[size_t(y) * kWidth + x] = c;
  }
  void Fill(int x0, int y0, int x1, int y1, Rgb c) {
    for (int y = y0; y < y1; ++y)
      for (int x = x0; x < x1; ++x) Set(x, y, c);
  }
  // A line `width` pixels thick (a square brush stepped along the longer axis).
  void Line(double x0, double y0, double x1, double y1, Rgb c, int width) {
    const int steps = static_cast<int>(std::max(std::abs(x1 - x0), std::abs(y1 - y0))) + 1;
    for (int i = 0; i <= steps; ++i) {
      const double t = static_cast<double>(i) / steps;
      const int x = static_cast<int>(std::lround(x0 + t * (x1 - x0))), y = static_cast<int>(std::lround(y0 + t * (y1 - y0)));
      Fill(x - width / 2, y - width / 2, x - width / 2 + width, y - width / 2 + width, c);
    }
  }
  // Text with its top-left corner at (x, y); returns its width in pixels.
  int Text(int x, int y, const std::string& text, Rgb c) {
    // stb_easy_font emits quads (4 vertices of x, y, z, rgba; 16 bytes each) in font pixels.
    static char buffer[64 * 1024];
    const int quads = stb_easy_font_print(0, 0, const_cast<char*>(text.c_str()), nullptr, buffer, sizeof buffer);
    const float* v = reinterpret_cast<const float*>(buffer);
    for (int q = 0; q < quads; ++q) {
      const float* quad = v + q * 16;  // 4 vertices x 4 floats
      float qx0 = quad[0], qy0 = quad[1], qx1 = quad[0], qy1 = quad[1];
      for (int k = 1; k < 4; ++k) {
        qx0 = std::min(qx0, quad[k * 4]);
        qx1 = std::max(qx1, quad[k * 4]);
        qy0 = std::min(qy0, quad[k * 4 + 1]);
        qy1 = std::max(qy1, quad[k * 4 + 1]);
      }
      Fill(x + static_cast<int>(qx0 * kTextScale), y + static_cast<int>(qy0 * kTextScale),
           x + static_cast<int>(qx1 * kTextScale), y + static_cast<int>(qy1 * kTextScale), c);
    }
    return stb_easy_font_width(const_cast<char*>(text.c_str())) * kTextScale;
  }
  int TextWidth(const std::string& text) const { return stb_easy_font_width(const_cast<char*>(text.c_str())) * kTextScale; }

  Status WritePng(const std::string& path) const {
    std::unique_ptr<FILE, int (*)(FILE*)> f(std::fopen(path.c_str(), "wb"), &std::fclose);
    if (!f) return Status::Unavailable("cannot write " + path);
    png_structp png = png_create_write_struct(PNG_LIBPNG_VER_STRING, nullptr, nullptr, nullptr);
    png_infop info = png ? png_create_info_struct(png) : nullptr;
    if (!png || !info) {
      png_destroy_write_struct(&png, &info);
      return Status::Internal("libpng could not start");
    }
    if (setjmp(png_jmpbuf(png))) {  // libpng reports errors by longjmp
      png_destroy_write_struct(&png, &info);
      return Status::Unavailable("libpng failed writing " + path);
    }
    png_init_io(png, f.get());
    png_set_IHDR(png, info, kWidth, kHeight, 8, PNG_COLOR_TYPE_RGB, PNG_INTERLACE_NONE, PNG_COMPRESSION_TYPE_DEFAULT,
                 PNG_FILTER_TYPE_DEFAULT);
    png_write_info(png, info);
    for (int y = 0; y < kHeight; ++y) {
      png_write_row(png, reinterpret_cast<png_const_bytep>(px_.data() + size_t(y) * kWidth));
    }
    png_write_end(png, nullptr);
    png_destroy_write_struct(&png, &info);
    return Status::Ok();
  }

 private:
  std::vector<Rgb> px_;
};
static_assert(sizeof(Rgb) == 3, "rows are written as packed RGB");

std::string Tick(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, v >= 100 || v == 0 ? "%.0f" : "%.3g", v);
  return buf;
}

// A round step giving about `n` intervals up to `max`.
double NiceStep(double max, int n) {
  const double raw = max / n, mag = std::pow(10.0, std::floor(std::log10(raw)));
  for (double m : {1.0, 2.0, 2.5, 5.0, 10.0}) {
    if (raw <= m * mag) return m * mag;
  }
  return 10 * mag;
}

}  // namespace

Status WriteLinePlotPng(const LinePlot& plot, const std::string& path) {
  const size_t n = plot.x_ticks.size();
  if (n == 0) return Status::InvalidArgument("a line plot needs x ticks");
  double max = 0;
  for (const LinePlot::Series& s : plot.series) {
    if (s.y.size() != n) return Status::InvalidArgument("series " + s.name + " does not have one value per x tick");
    for (double v : s.y) {
      if (std::isfinite(v)) max = std::max(max, v);
    }
  }
  if (max <= 0) max = 1;
  const double step = NiceStep(max, 5), top = std::ceil(max / step) * step;
  Canvas c;
  const int x0 = kLeft, x1 = kWidth - kRight, y0 = kTop, y1 = kHeight - kBottom;
  auto px = [&](size_t i) { return n == 1 ? (x0 + x1) / 2.0 : x0 + 30 + (x1 - x0 - 60) * double(i) / double(n - 1); };
  auto py = [&](double v) { return y1 - (y1 - y0) * v / top; };
  c.Text((kWidth - c.TextWidth(plot.title)) / 2, 18, plot.title, kBlack);
  for (double v = 0; v <= top + step / 2; v += step) {  // horizontal grid and y labels
    const int y = static_cast<int>(std::lround(py(v)));
    c.Fill(x0, y, x1, y + 1, kGrid);
    const std::string label = Tick(v);
    c.Text(x0 - 8 - c.TextWidth(label), y - 6, label, kBlack);
  }
  for (size_t i = 0; i < n; ++i) {
    const int x = static_cast<int>(std::lround(px(i)));
    c.Fill(x, y1, x + 1, y1 + 6, kBlack);
    c.Text(x - c.TextWidth(plot.x_ticks[i]) / 2, y1 + 12, plot.x_ticks[i], kBlack);
  }
  c.Fill(x0, y0, x0 + 1, y1 + 1, kBlack);
  c.Fill(x0, y1, x1, y1 + 1, kBlack);
  c.Text((x0 + x1 - c.TextWidth(plot.x_label)) / 2, kHeight - 30, plot.x_label, kBlack);
  c.Text(8, y0 - 30, plot.y_label, kBlack);
  for (size_t s = 0; s < plot.series.size(); ++s) {
    const Rgb color = kPalette[s % std::size(kPalette)];
    const std::vector<double>& y = plot.series[s].y;
    for (size_t i = 0; i < n; ++i) {
      if (!std::isfinite(y[i])) continue;
      if (i + 1 < n && std::isfinite(y[i + 1])) c.Line(px(i), py(y[i]), px(i + 1), py(y[i + 1]), color, 3);
      const int x = static_cast<int>(std::lround(px(i))), yy = static_cast<int>(std::lround(py(y[i])));
      c.Fill(x - 4, yy - 4, x + 5, yy + 5, color);
    }
    const int ly = y0 + 10 + static_cast<int>(s) * 26;
    c.Fill(x1 + 20, ly + 4, x1 + 44, ly + 10, color);
    c.Text(x1 + 52, ly, plot.series[s].name, kBlack);
  }
  return c.WritePng(path);
}

}  // namespace specache
