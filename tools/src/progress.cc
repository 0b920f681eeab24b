#include "progress.h"

#include <unistd.h>

#include <cmath>

namespace specache {

std::string FormatDuration(double seconds) {
  const long s = std::lround(std::max(seconds, 0.0));
  char buf[32];
  if (s < 60) {
    std::snprintf(buf, sizeof buf, "%lds", s);
  } else if (s < 3600) {
    std::snprintf(buf, sizeof buf, "%ldm%02lds", s / 60, s % 60);
  } else {
    std::snprintf(buf, sizeof buf, "%ldh%02ldm", s / 3600, (s % 3600) / 60);
  }
  return buf;
}

Progress::Progress(std::string label, int64_t total, std::string unit, Style style)
    : Progress(std::move(label), total, std::move(unit), stderr, isatty(STDERR_FILENO) == 1, style) {}

Progress::Progress(std::string label, int64_t total, std::string unit, FILE* out, bool enabled, Style style)
    : label_(std::move(label)),
      unit_(std::move(unit)),
      total_(total),
      total_work_(static_cast<double>(total)),
      out_(out),
      enabled_(enabled),
      style_(style) {
  if (style_ == Style::kInPlace) Draw();
}

Progress::~Progress() { Finish(); }

void Progress::SetTotalWork(double work) {
  total_work_ = work;
  Draw();
}

void Progress::Advance(int64_t items, double work) {
  done_ += items;
  done_work_ += work < 0 ? static_cast<double>(items) : work;
  Draw();
}

std::string Progress::Line() const {
  const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  std::string line = label_ + " " + std::to_string(done_) + "/" + std::to_string(total_) + " " + unit_ + ", " +
                     FormatDuration(elapsed) + " elapsed";
  if (done_work_ > 0 && done_ < total_) {
    // Time per unit of work so far, times the work left: each point's cost is known up to a
    // factor, so the estimate settles after the first items.
    const double left = elapsed / done_work_ * std::max(total_work_ - done_work_, 0.0);
    line += ", about " + FormatDuration(left) + " left";
  }
  return line;
}

void Progress::Draw() {
  if (!enabled_) return;
  if (style_ == Style::kLines) {
    std::fprintf(out_, "%s\n", Line().c_str());
  } else {
    // Carriage return, the line, then erase to the end of the line (a shorter line leaves no tail).
    std::fprintf(out_, "\r%s\033[K", Line().c_str());
  }
  std::fflush(out_);
}

void Progress::Note(const std::string& line) {
  if (enabled_ && style_ == Style::kInPlace) std::fprintf(out_, "\r\033[K");
  std::fprintf(out_, "%s\n", line.c_str());
  if (style_ == Style::kInPlace) Draw();
}

void Progress::Finish() {
  if (!enabled_) return;
  if (style_ == Style::kInPlace) std::fprintf(out_, "\r\033[K");
  std::fflush(out_);
  enabled_ = false;
}

}  // namespace specache
