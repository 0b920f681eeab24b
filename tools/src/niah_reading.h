// One sentence that reads a needle-in-a-haystack table for a person: how often the fp16 cache
// (full) found the needle, how often each compressed mode did and at what fraction of the fp16
// memory, and what follows (did SpeCache keep the answers; did its fetched rows matter against
// the low-bit replica alone).
#pragma once

#include <string>
#include <vector>

namespace specache::run {

struct ModeOutcome {
  std::string label;     // "full", "kivi-1bit", "specache-1bit", ...
  std::string kv;        // KvModeName: "full", "kivi", "specache", "specache-nonspec"
  int bits = 16;         // key bits (16 for full)
  int correct = 0, points = 0;
  double memory_ratio = 1;  // device KV / fp16 KV (at the longest context)
};

std::string ReadNiahTable(const std::vector<ModeOutcome>& modes);

}  // namespace specache::run
