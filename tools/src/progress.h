// A progress line for long commands on a terminal: "LABEL 3/12 UNIT, 1m05s elapsed, about 4m20s
// left", redrawn in place on stderr. When stderr is not a terminal (a log, a pipe, CI) it writes
// nothing, so logs and JSON output stay as they were.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>

namespace specache {

class Progress {
 public:
  // kInPlace redraws one line (for commands whose other output waits until the end, or goes
  // through Note); kLines writes a new line at every Advance (for commands that print tables to
  // the same terminal as they go).
  enum class Style { kInPlace, kLines };

  // `total` items of `unit` (e.g. "points"). The time left is estimated from the work done so
  // far; items default to one unit of work each (see Advance). Draws on `out` only when
  // `enabled`; the first constructor enables it when stderr is a terminal.
  Progress(std::string label, int64_t total, std::string unit, Style style = Style::kInPlace);
  Progress(std::string label, int64_t total, std::string unit, FILE* out, bool enabled,
           Style style = Style::kInPlace);
  ~Progress();  // ends the line (Finish)
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

  // Total work, in any unit, when items cost unequal time (e.g. tokens of each point).
  void SetTotalWork(double work);
  // `items` more are done, which took `work` of the total work (default: one per item).
  void Advance(int64_t items = 1, double work = -1);
  // A line of its own (e.g. one result) above the progress line, which is then drawn again.
  // Written whether or not the progress line is enabled.
  void Note(const std::string& line);
  // Clears the progress line for good; later calls draw nothing.
  void Finish();

  bool enabled() const { return enabled_; }
  // The text of the line as drawn now (no terminal controls); for tests.
  std::string Line() const;

 private:
  void Draw();

  std::string label_, unit_;
  int64_t total_, done_ = 0;
  double total_work_, done_work_ = 0;
  FILE* out_;
  bool enabled_;
  Style style_;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
};

// "42s", "3m05s", "1h02m".
std::string FormatDuration(double seconds);

}  // namespace specache
