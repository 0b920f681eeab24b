// The heat map as a reader of the file sees it: decoded with libpng, its size is the layout's,
// its cells and legend have the scale's colors, and its labels are drawn (dark pixels where the
// title and the axis labels go).
#include <png.h>

#include <cmath>
#include <vector>

#include <gtest/gtest.h>

#include "heatmap_png.h"
#include "testing/temp_dir.h"

namespace specache {
namespace {

struct Image {
  int width = 0, height = 0;
  std::vector<uint8_t> rgb;
  Rgb8 At(int x, int y) const {
    const uint8_t* p = &rgb[(static_cast<size_t>(y) * width + x) * 3];
    return {p[0], p[1], p[2]};
  }
};

Image Decode(const std::string& path) {
  png_image image{};
  image.version = PNG_IMAGE_VERSION;
  EXPECT_TRUE(png_image_begin_read_from_file(&image, path.c_str())) << image.message;
  image.format = PNG_FORMAT_RGB;
  Image out;
  out.width = static_cast<int>(image.width);
  out.height = static_cast<int>(image.height);
  out.rgb.resize(PNG_IMAGE_SIZE(image));
  EXPECT_TRUE(png_image_finish_read(&image, nullptr, out.rgb.data(), 0, nullptr)) << image.message;
  return out;
}

bool Same(Rgb8 a, Rgb8 b) { return a.r == b.r && a.g == b.g && a.b == b.b; }

// Pixels darker than mid-grey in a band of rows: text drawn there.
int DarkPixels(const Image& img, int y0, int y1, int x0, int x1) {
  int n = 0;
  for (int y = y0; y < y1; ++y) {
    for (int x = x0; x < x1; ++x) {
      const Rgb8 p = img.At(x, y);
      n += p.r + p.g + p.b < 3 * 100;
    }
  }
  return n;
}

TEST(HeatMapPngTest, DecodesToTheLayoutsSizeWithCellColorsLegendAndDrawnLabels) {
  testing::TempDir dir;
  const HeatMap map{"Needle in a haystack, specache-1bit", {"0.00", "0.50", "1.00"}, {"1024", "2048"},
                    {{1, 0}, {0.5, NAN}, {1, 1}}};
  const std::string path = dir.path + "/heat.png";
  ASSERT_TRUE(WriteHeatMapPng(map, path).ok());
  auto layout = LayoutHeatMap(map);
  ASSERT_TRUE(layout.ok());
  const HeatMapGeometry& g = *layout;
  const Image img = Decode(path);
  EXPECT_EQ(img.width, g.width);
  EXPECT_EQ(img.height, g.height);
  ASSERT_GE(img.width, g.grid_left + 2 * g.cell_width);
  ASSERT_GE(img.height, g.grid_top + 3 * g.cell_height);

  // A cell's corner (clear of its centered text) has the value's color; the gap between cells is
  // the background.
  auto corner = [&](int row, int col) { return img.At(g.grid_left + col * g.cell_width + 3, g.grid_top + row * g.cell_height + 3); };
  EXPECT_TRUE(Same(corner(0, 0), HeatMapColor(1.0)));
  EXPECT_TRUE(Same(corner(0, 1), HeatMapColor(0.0)));
  EXPECT_TRUE(Same(corner(1, 0), HeatMapColor(0.5)));
  EXPECT_TRUE(Same(corner(1, 1), HeatMapColor(NAN)));
  EXPECT_GT(corner(0, 0).g, corner(0, 0).r);  // green for all correct
  EXPECT_GT(corner(0, 1).r, corner(0, 1).g);  // red for none
  EXPECT_TRUE(Same(img.At(g.grid_left + g.cell_width - 1, g.grid_top + 3), Rgb8{255, 255, 255}));

  // The legend bar runs from the color of 0 to the color of 1.
  const int legend_y = g.legend_top + g.legend_height / 2;
  EXPECT_TRUE(Same(img.At(g.legend_left, legend_y), HeatMapColor(0.0)));
  EXPECT_TRUE(Same(img.At(g.legend_left + g.legend_width - 1, legend_y), HeatMapColor(1.0)));

  // Text: the title above the grid, the row labels left of it, the values inside the cells.
  EXPECT_GT(DarkPixels(img, 0, g.grid_top - 20, 0, img.width), 200);
  EXPECT_GT(DarkPixels(img, g.grid_top, g.grid_top + g.cell_height, 0, g.grid_left), 20);
  EXPECT_GT(DarkPixels(img, g.grid_top, g.grid_top + g.cell_height, g.grid_left, g.grid_left + g.cell_width), 20);
  EXPECT_GT(DarkPixels(img, g.legend_top + g.legend_height, img.height, 0, img.width), 50);  // tick labels
}

TEST(HeatMapPngTest, RejectsRaggedValuesAndNamesAPathItCannotWrite) {
  testing::TempDir dir;
  HeatMap map{"t", {"0.00", "0.50"}, {"1024"}, {{1}, {0}}};
  EXPECT_TRUE(WriteHeatMapPng(map, dir.path + "/ok.png").ok());
  const Status missing = WriteHeatMapPng(map, dir.path + "/no/such/dir/x.png");
  EXPECT_FALSE(missing.ok());
  EXPECT_NE(missing.message().find(dir.path + "/no/such/dir/x.png"), std::string::npos) << missing.ToString();
  map.values[1].push_back(1);
  EXPECT_EQ(WriteHeatMapPng(map, dir.path + "/bad.png").code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace specache
