// PNG heat maps of accuracy grids (niah-grid): one cell per (row, column) colored from red (0)
// through yellow to green (1), its value printed in it, row and column labels, axis names, a
// title and a legend (the color scale and the "not run" grey). Text is drawn with FreeType from
// the DejaVu Sans font built into the program (no font files needed where it runs); the PNG is
// written by libpng.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "specache/status.h"

namespace specache {

struct HeatMap {
  std::string title;
  std::vector<std::string> row_labels;     // top to bottom (y axis)
  std::vector<std::string> column_labels;  // left to right (x axis)
  std::vector<std::vector<double>> values;  // [row][column] in [0, 1]; NaN: not measured (grey)
  std::string row_axis = "needle depth";       // name of the y axis
  std::string column_axis = "context tokens";  // name of the x axis
};

// Where things are in the written image (pixels), so tests can find the cells.
struct HeatMapGeometry {
  int width = 0, height = 0;
  int grid_left = 0, grid_top = 0;  // top-left corner of cell (0, 0)
  int cell_width = 0, cell_height = 0;  // cell pitch; each cell is filled but for a 2-pixel gap
  int legend_left = 0, legend_top = 0, legend_width = 0, legend_height = 0;  // the color bar, 0 to 1
};

struct Rgb8 {
  uint8_t r, g, b;
};

// The color of a cell value (NaN: grey).
Rgb8 HeatMapColor(double value);

// INVALID_ARGUMENT when labels are missing or a row of values has the wrong length.
Result<HeatMapGeometry> LayoutHeatMap(const HeatMap& map);

Status WriteHeatMapPng(const HeatMap& map, const std::string& path);

}  // namespace specache
