// A small PNG heat map writer (no plotting library on the GPU machine or in CI): a grid of cells
// colored from red (0) to green (1), with the row and column labels and a title drawn in a
// built-in 5x7 pixel font.
#pragma once

#include <string>
#include <vector>

#include "specache/status.h"

namespace specache {

struct HeatMap {
  std::string title;
  std::vector<std::string> row_labels;     // top to bottom (y axis)
  std::vector<std::string> column_labels;  // left to right (x axis)
  std::vector<std::vector<double>> values;  // [row][column] in [0, 1]; NaN: not measured (grey)
};

Status WriteHeatMapPng(const HeatMap& map, const std::string& path);

}  // namespace specache
