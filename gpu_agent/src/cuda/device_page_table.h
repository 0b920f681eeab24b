// The CUDA agent's view of the source's pages from the device (cuda_fetch.h reads and writes them
// in place): which host regions of the source are registered with CUDA, and, per sequence, a
// device table of the GPU-visible address of each page of each layer.
//
// - The source's host regions are registered (pinned and mapped) once each; a region the source
//   adds later is registered the first time one of its pages is mapped. All are unregistered when
//   the table is destroyed.
// - A sequence's table has room for capacity_tokens tokens per layer ([layer][max_pages]); its
//   entries are written once, in order, as the sequence grows (Map), by copies queued on the
//   stream given at construction. Work queued after Map on that stream sees them.
//
// A source without zero-copy pages (page_tokens() == 0, the agent's staged path) has nothing to
// register or map: Map succeeds without doing anything and Layer returns null.
//
// Not thread-safe (the agent is used from one thread).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <memory>
#include <unordered_map>

#include "device_buffer.h"
#include "specache/full_precision_source.h"
#include "specache/status.h"

namespace specache::cuda {

class DevicePageTable {
 public:
  // `source` must outlive the table; `stream` is where the table copies are queued. row_format:
  // how the source's pages store the rows (KvConfig::host_row_format; the agent creates its
  // sequences with it), what the kernels that read and write them in place are told.
  DevicePageTable(FullPrecisionSource* source, int n_layers, int32_t capacity_tokens, HostRowFormat row_format,
                  cudaStream_t stream);
  ~DevicePageTable();
  DevicePageTable(const DevicePageTable&) = delete;
  DevicePageTable& operator=(const DevicePageTable&) = delete;

  // Registers the source's regions not registered yet.
  Status RegisterNewRegions();

  // A table for a new sequence, with no page mapped (RESOURCE_EXHAUSTED, nothing added, when
  // memory runs out).
  Status AddSequence(SequenceId id);
  // Forgets the sequence's table: no queued work may still read it.
  void RemoveSequence(SequenceId id);
  // Makes the pages holding tokens [0, tokens) of a registered sequence visible to the device, at
  // every layer: OUT_OF_RANGE past capacity_tokens, errors of the source passed through, INTERNAL
  // for a page outside every region of the source.
  Status Map(SequenceId id, int32_t tokens);
  // Layer `layer`'s page addresses of a registered sequence (device memory, [max_pages]); null
  // for a source without pages.
  const uint64_t* Layer(SequenceId id, int layer) const;
  // The same pages' host addresses (host memory, [max_pages], entries below the mapped count
  // valid): what the copy-engine fetch's threads read rows from. Entries are written once, when
  // mapped, and the array stays where it is until RemoveSequence, so another thread may read the
  // entries of pages mapped before it was handed the pointer. Null for a source without pages.
  const uint8_t* const* HostLayer(SequenceId id, int layer) const;

  int32_t page_tokens() const { return page_tokens_; }
  HostRowFormat row_format() const { return row_format_; }
  // Device memory of all the sequences' tables.
  int64_t device_bytes() const;

 private:
  struct Region {
    size_t bytes;
    uint64_t device;
  };
  struct Table {
    Buffer<uint64_t> pages;             // [layer][max_pages] GPU-visible page addresses
    Buffer<uint64_t, true> pages_host;  // the same, staged (entries are written once)
    std::unique_ptr<const uint8_t*[]> host_addresses;  // [layer][max_pages] the pages' host addresses
    int32_t mapped_pages = 0;           // entries filled per layer
  };
  Result<uint64_t> DeviceAddress(const uint8_t* host) const;

  FullPrecisionSource* source_;
  int n_layers_;
  int32_t capacity_tokens_;
  HostRowFormat row_format_;
  cudaStream_t stream_;
  int32_t page_tokens_ = 0, max_pages_ = 0;
  std::map<const uint8_t*, Region> regions_;  // registered by this table, by host base
  std::unordered_map<SequenceId, Table> tables_;  // hashed: looked up per (sequence, layer) in the decode loop
};

}  // namespace specache::cuda
