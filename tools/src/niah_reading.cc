#include "niah_reading.h"

#include <cstdio>

namespace specache::run {
namespace {

std::string Count(const ModeOutcome& m) { return std::to_string(m.correct) + "/" + std::to_string(m.points); }

std::string Ratio(double r) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f", r);
  return buf;
}

}  // namespace

std::string ReadNiahTable(const std::vector<ModeOutcome>& modes) {
  const ModeOutcome* full = nullptr;
  for (const ModeOutcome& m : modes) {
    if (m.kv == "full") full = &m;
  }
  std::string out = "Reading: ";
  if (full) out += "full (the fp16 cache) found the needle in " + Count(*full) + " points";
  std::string sep = full ? "; " : "";
  for (const ModeOutcome& m : modes) {
    if (&m == full) continue;
    out += sep + m.label + " in " + Count(m) + " with " + Ratio(m.memory_ratio) + " of the fp16 KV memory";
    sep = "; ";
  }
  out += ".";
  if (full && full->correct == 0) {
    return out + " The fp16 cache itself never found the needle, so these points cannot tell whether the "
                 "compressed modes keep answers: try a shorter context or another depth.";
  }
  // What follows: SpeCache against full (kept the answers?) and against KIVI of the same bits
  // (did the fetched full-precision rows matter?).
  for (const ModeOutcome& s : modes) {
    if (s.kv != "specache") continue;
    if (full && s.correct == full->correct) {
      out += " " + s.label + " kept every answer full found, in " + Ratio(s.memory_ratio) + " of its memory.";
    } else if (full && s.correct < full->correct) {
      out += " " + s.label + " lost " + std::to_string(full->correct - s.correct) + " of full's " +
             std::to_string(full->correct) + " answers.";
    } else if (full) {
      out += " " + s.label + " found the needle at " + std::to_string(s.correct - full->correct) +
             " points where full did not.";
    }
    for (const ModeOutcome& k : modes) {
      if (k.kv != "kivi" || k.bits != s.bits) continue;
      if (s.correct > k.correct) {
        out += " The " + std::to_string(s.bits) + "-bit replica alone (" + k.label + ") found fewer: the rows " +
               s.label + " fetches in fp16 made the difference.";
      } else if (s.correct == k.correct && s.correct == 0) {
        out += " " + k.label + " missed it too.";
      } else if (s.correct == k.correct) {
        out += " " + k.label + " did as well here: this table cannot tell the fetched rows' part.";
      }
    }
  }
  return out;
}

}  // namespace specache::run
