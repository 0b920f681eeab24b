// One JSON record of a specache-bench suite.
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace specache::bench {

struct BenchRow {
  std::string name;
  std::vector<std::pair<std::string, double>> values;
};

}  // namespace specache::bench
