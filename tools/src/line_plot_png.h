// A PNG line chart (libpng; text by stb_easy_font): one line per series over categorical x ticks,
// a linear y axis from 0, a legend on the right. For specache-run bench's tokens/s over context.
#pragma once

#include <string>
#include <vector>

#include "specache/status.h"

namespace specache {

struct LinePlot {
  std::string title, x_label, y_label;
  std::vector<std::string> x_ticks;  // left to right
  struct Series {
    std::string name;
    std::vector<double> y;  // one per x tick; NaN: not measured (no point, the line breaks)
  };
  std::vector<Series> series;
};

// INVALID_ARGUMENT when a series does not have one value per tick; UNAVAILABLE when the file
// cannot be written.
Status WriteLinePlotPng(const LinePlot& plot, const std::string& path);

}  // namespace specache
