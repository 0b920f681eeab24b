// specache-spill-bench: throughput of the spill tier (SpillStore on RocksDB) against plain
// sequential I/O of the same bytes in the same directory, measured in the same run.
//
//   specache-spill-bench --dir DIR [--gib G] [--json FILE]
//
// Pages are Llama-3-8B-shaped (8 KV heads x 64 tokens x [K|V] x 128 fp16 = 256 KiB), filled
// with fp16 values drawn like activations (normal), so compression sees realistic data.
// - raw write: one file, sequential 4 MiB writes, fsync at the end; raw read: the file back.
// - spill: SpillStore::Put of G GiB in 1 GiB sequences (durable when it returns); restore:
//   SpillStore::Get of all of them, every checksum verified.
// - The page cache is dropped for the files (posix_fadvise DONTNEED after fsync) before each read,
//   so reads come from the device for both.
// - The same spill with LZ4 on: bytes on disk over bytes spilled (the compression ratio).
// Goal: restore >= 0.5 of the raw read.
#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "command_line.h"
#include "output_paths.h"
#include "specache/spill_store.h"
#include "specache/version.h"

namespace {

using Clock = std::chrono::steady_clock;
namespace fs = std::filesystem;

double Seconds(Clock::time_point since) { return std::chrono::duration<double>(Clock::now() - since).count(); }

// fp16 bits of normal(0, 1) values.
uint16_t HalfOf(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const int exp = static_cast<int>((x >> 23) & 0xff) - 127 + 15;
  if (exp <= 0) return static_cast<uint16_t>(sign);
  if (exp >= 31) return static_cast<uint16_t>(sign | 0x7c00u);
  return static_cast<uint16_t>(sign | (exp << 10) | ((x >> 13) & 0x3ffu));
}

// Evicts a directory's (or a file's) clean pages from the page cache.
void DropCache(const fs::path& p) {
  auto drop = [](const fs::path& f) {
    const int fd = open(f.c_str(), O_RDONLY);
    if (fd < 0) return;
    fdatasync(fd);
    posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    close(fd);
  };
  if (fs::is_directory(p)) {
    for (const auto& e : fs::recursive_directory_iterator(p)) {
      if (e.is_regular_file()) drop(e.path());
    }
  } else {
    drop(p);
  }
}

uint64_t DirBytes(const fs::path& p) {
  uint64_t n = 0;
  for (const auto& e : fs::recursive_directory_iterator(p)) {
    if (e.is_regular_file()) n += e.file_size();
  }
  return n;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"specache-spill-bench: spill tier vs plain sequential I/O", "specache-spill-bench"};
  std::string dir, json_path;
  int gib = 2;
  app.add_option("--dir", dir, "directory on the disk to measure (the spill tier's disk)")->required();
  app.add_option("--gib", gib, "GiB to write and read")->capture_default_str();
  app.add_option("--json", json_path, "also write the figures here");
  app.set_version_flag("--version", "specache-spill-bench " SPECACHE_VERSION);
  if (const int code = specache::ParseCommandLine(app, argc, argv); code >= 0) return code;
  // The measured directory and the JSON file are checked (or created) before gigabytes are written.
  for (const specache::Status& s : {specache::PrepareOutputDir(dir),
                                    json_path.empty() ? specache::Status::Ok() : specache::PrepareOutputFile(json_path)}) {
    if (!s.ok()) {
      std::fprintf(stderr, "specache-spill-bench: %s\n", s.ToString().c_str());
      return 1;
    }
  }

  specache::PageLayout layout{32, 8, 128, 64, 8192};  // 256 KiB pages
  const uint64_t page_bytes = layout.page_bytes();
  const uint32_t pages_per_layer = static_cast<uint32_t>((uint64_t{1} << 30) / (page_bytes * layout.n_layers));
  const uint64_t seq_bytes = uint64_t{layout.n_layers} * pages_per_layer * page_bytes;  // 1 GiB
  const int sequences = std::max(1, gib);
  const uint64_t total = seq_bytes * sequences;

  // One sequence's worth of fp16 normal values, reused for every sequence (varied per sequence
  // by an xor, so no two sequences are byte-identical).
  std::vector<uint8_t> data(seq_bytes);
  {
    std::mt19937 rng(1);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    auto* h = reinterpret_cast<uint16_t*>(data.data());
    for (size_t i = 0; i < data.size() / 2; ++i) h[i] = HalfOf(normal(rng));
  }
  const fs::path root(dir);
  fs::create_directories(root);
  const fs::path raw = root / "raw.bin", db = root / "spill-db", db_lz4 = root / "spill-db-lz4";
  fs::remove_all(raw), fs::remove_all(db), fs::remove_all(db_lz4);

  // Plain sequential I/O.
  auto start = Clock::now();
  {
    const int fd = open(raw.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    if (fd < 0) return std::perror("raw write"), 1;
    for (int s = 0; s < sequences; ++s) {
      for (uint64_t at = 0; at < seq_bytes; at += 4 << 20) {
        const size_t n = std::min<uint64_t>(4 << 20, seq_bytes - at);
        if (write(fd, data.data() + at, n) != static_cast<ssize_t>(n)) return std::perror("raw write"), 1;
      }
    }
    fsync(fd);
    close(fd);
  }
  const double raw_write = Seconds(start);
  DropCache(raw);
  std::vector<uint8_t> back(4 << 20);
  start = Clock::now();
  {
    const int fd = open(raw.c_str(), O_RDONLY);
    uint64_t got = 0;
    for (ssize_t n; (n = read(fd, back.data(), back.size())) > 0;) got += static_cast<uint64_t>(n);
    close(fd);
    if (got != total) return std::fprintf(stderr, "raw read: short\n"), 1;
  }
  const double raw_read = Seconds(start);
  fs::remove(raw);

  // The spill tier, without and with compression.
  double spill = 0, restore = 0, lz4_ratio = 0;
  for (bool compression : {false, true}) {
    const fs::path path = compression ? db_lz4 : db;
    auto store = specache::SpillStore::Open({path.string(), 0, compression});
    if (!store.ok()) return std::fprintf(stderr, "%s\n", store.status().ToString().c_str()), 1;
    start = Clock::now();
    for (int s = 0; s < sequences; ++s) {
      specache::SpilledSequence m;
      m.tenant = "bench";
      m.id = static_cast<uint64_t>(s + 1);
      m.layout = layout;
      m.pages_per_layer = pages_per_layer;
      data[s] ^= 0xff;  // a different first byte per sequence
      const specache::Status st = (*store)->Put(m, [&](uint32_t l, uint32_t p) {
        return data.data() + (uint64_t{l} * pages_per_layer + p) * page_bytes;
      });
      if (!st.ok()) return std::fprintf(stderr, "%s\n", st.ToString().c_str()), 1;
    }
    const double put_s = Seconds(start);
    if (compression) {
      store->reset();  // flushed and closed: what is on disk
      lz4_ratio = static_cast<double>(DirBytes(path)) / static_cast<double>(total);
      continue;
    }
    spill = put_s;
    DropCache(path);
    std::vector<uint8_t> out(seq_bytes);
    start = Clock::now();
    for (int s = 0; s < sequences; ++s) {
      const specache::Status st = (*store)->Get("bench", static_cast<uint64_t>(s + 1), [&](uint32_t l, uint32_t p) {
        return out.data() + (uint64_t{l} * pages_per_layer + p) * page_bytes;
      });
      if (!st.ok()) return std::fprintf(stderr, "%s\n", st.ToString().c_str()), 1;
    }
    restore = Seconds(start);
  }
  fs::remove_all(db), fs::remove_all(db_lz4);

  const double gb = static_cast<double>(total) / 1e9;
  std::printf("== spill tier vs plain sequential I/O, %.2f GB in %d sequences of 256 KiB pages, %s ==\n", gb, sequences,
              dir.c_str());
  std::printf("%-10s %10s %10s %10s\n", "", "GB/s", "raw GB/s", "ratio");
  std::printf("%-10s %10.2f %10.2f %10.3f\n", "spill", gb / spill, gb / raw_write, raw_write / spill);
  std::printf("%-10s %10.2f %10.2f %10.3f\n", "restore", gb / restore, gb / raw_read, raw_read / restore);
  std::printf("LZ4 on fp16 normal values: %.3f of the bytes on disk (1.0 = no gain)\n", lz4_ratio);
  std::printf("goal: restore >= 0.5 of the raw read\n");
  if (!json_path.empty()) {
    std::ofstream(json_path) << nlohmann::json{{"bytes", total},
                                               {"raw_write_gbps", gb / raw_write},
                                               {"raw_read_gbps", gb / raw_read},
                                               {"spill_gbps", gb / spill},
                                               {"restore_gbps", gb / restore},
                                               {"spill_ratio_to_raw_write", raw_write / spill},
                                               {"restore_ratio_to_raw_read", raw_read / restore},
                                               {"lz4_bytes_ratio", lz4_ratio}}
                                    .dump(1)
                             << "\n";
  }
  return 0;
}
