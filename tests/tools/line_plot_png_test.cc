// The PNG line chart of specache-run bench: a file libpng reads back at the chart's size, with a
// point of each series' color, and refusals of malformed input.
#include <png.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <vector>

#include <gtest/gtest.h>

#include "line_plot_png.h"

namespace specache {
namespace {

struct Image {
  int width = 0, height = 0;
  std::vector<uint8_t> rgb;
  bool Has(uint8_t r, uint8_t g, uint8_t b) const {
    for (size_t i = 0; i + 2 < rgb.size(); i += 3) {
      if (rgb[i] == r && rgb[i + 1] == g && rgb[i + 2] == b) return true;
    }
    return false;
  }
};

Image ReadPng(const std::string& path) {
  Image img;
  png_image png{};
  png.version = PNG_IMAGE_VERSION;
  if (!png_image_begin_read_from_file(&png, path.c_str())) return img;
  png.format = PNG_FORMAT_RGB;
  img.rgb.resize(PNG_IMAGE_SIZE(png));
  if (!png_image_finish_read(&png, nullptr, img.rgb.data(), 0, nullptr)) return img;
  img.width = static_cast<int>(png.width);
  img.height = static_cast<int>(png.height);
  return img;
}

std::string TempPath(const char* name) {
  return (std::filesystem::temp_directory_path() / (std::to_string(::getpid()) + name)).string();
}

TEST(LinePlotPngTest, WritesAReadablePngWithEverySeriesColor) {
  LinePlot plot;
  plot.title = "decode tokens/s";
  plot.x_label = "context";
  plot.y_label = "tokens/s";
  plot.x_ticks = {"2K", "8K", "32K"};
  plot.series = {{"fp16", {900, 400, 120}}, {"specache", {1500, NAN, 700}}};
  const std::string path = TempPath("-plot.png");
  ASSERT_TRUE(WriteLinePlotPng(plot, path).ok());
  const Image img = ReadPng(path);
  std::filesystem::remove(path);
  EXPECT_EQ(img.width, 1020);
  EXPECT_EQ(img.height, 600);
  EXPECT_TRUE(img.Has(31, 119, 180));  // the first series' color
  EXPECT_TRUE(img.Has(214, 39, 40));   // the second's
  EXPECT_TRUE(img.Has(0, 0, 0));       // axes and text
}

TEST(LinePlotPngTest, RefusesSeriesWithoutOneValuePerTick) {
  LinePlot plot;
  plot.x_ticks = {"2K", "8K"};
  plot.series = {{"fp16", {1.0}}};
  EXPECT_EQ(WriteLinePlotPng(plot, TempPath("-bad.png")).code(), StatusCode::kInvalidArgument);
  plot.x_ticks.clear();
  plot.series.clear();
  EXPECT_EQ(WriteLinePlotPng(plot, TempPath("-bad.png")).code(), StatusCode::kInvalidArgument);
}

TEST(LinePlotPngTest, UnwritablePathIsUnavailable) {
  LinePlot plot;
  plot.x_ticks = {"2K"};
  plot.series = {{"fp16", {1.0}}};
  EXPECT_EQ(WriteLinePlotPng(plot, "/nonexistent-dir/x.png").code(), StatusCode::kUnavailable);
}

}  // namespace
}  // namespace specache
