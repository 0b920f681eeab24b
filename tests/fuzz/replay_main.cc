// Runs a fuzz target without libFuzzer (the gcc build and CI): structured seeds (valid messages
// and tables, then each of them with every byte flipped and truncated at every length) and
// random inputs from a fixed seed. tests/fuzz/run-libfuzzer.sh runs the real fuzzer with clang.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "specache/attach_protocol.h"
#include "specache/remote_protocol.h"
#include "specache/shm_layout.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace {

std::vector<std::vector<uint8_t>> Seeds() {
  using namespace specache;
  std::vector<std::vector<uint8_t>> seeds;
  attach::AttachRequest req;
  req.session_id = 7;
  seeds.emplace_back(reinterpret_cast<uint8_t*>(&req), reinterpret_cast<uint8_t*>(&req) + sizeof req);
  attach::AttachReply rep;
  rep.total_fds = 3;
  rep.n_fds = 3;
  rep.table_bytes = 4096;
  rep.chunk_bytes = 1 << 20;
  seeds.emplace_back(reinterpret_cast<uint8_t*>(&rep), reinterpret_cast<uint8_t*>(&rep) + sizeof rep);
  remote::Hello hello;
  hello.session_id = 3;
  seeds.emplace_back(reinterpret_cast<uint8_t*>(&hello), reinterpret_cast<uint8_t*>(&hello) + sizeof hello);
  remote::RowsRequest rows;
  rows.n = 64;
  rows.sequence = 9;
  seeds.emplace_back(reinterpret_cast<uint8_t*>(&rows), reinterpret_cast<uint8_t*>(&rows) + sizeof rows);
  remote::Challenge challenge;
  seeds.emplace_back(reinterpret_cast<uint8_t*>(&challenge), reinterpret_cast<uint8_t*>(&challenge) + sizeof challenge);
  remote::Reply reply;
  seeds.emplace_back(reinterpret_cast<uint8_t*>(&reply), reinterpret_cast<uint8_t*>(&reply) + sizeof reply);
  // A small valid table: 2 slots, 8 refs, one live slot with 2 layers x 2 pages.
  std::vector<uint8_t> table(shm::TableBytes(2, 8));
  auto* h = reinterpret_cast<shm::TableHeader*>(table.data());
  h->magic = shm::kTableMagic;
  h->version = shm::kTableVersion;
  h->header_bytes = sizeof(shm::TableHeader);
  h->slot_bytes = sizeof(shm::SequenceSlot);
  h->slot_count = 2;
  h->ref_count = 8;
  h->total_bytes = table.size();
  h->chunk_bytes = 1 << 20;
  h->chunk_count = 1;
  auto* slot = reinterpret_cast<shm::SequenceSlot*>(table.data() + sizeof(shm::TableHeader));
  slot->state.store(shm::kSlotLive);
  slot->n_layers = 2;
  slot->n_kv_heads = 1;
  slot->head_dim = 8;
  slot->page_tokens = 4;
  slot->capacity_tokens = 8;
  slot->pages_capacity_per_layer = 2;
  slot->pages_per_layer.store(2);
  slot->page_bytes = shm::PageBytes(shm::kRowFp16, 1, 4, 8);
  seeds.push_back(table);
  slot->row_format = shm::kRowInt8;  // the same slot with int8 rows
  slot->page_bytes = shm::PageBytes(shm::kRowInt8, 1, 4, 8);
  seeds.push_back(table);
  return seeds;
}

}  // namespace

int main() {
  size_t runs = 0;
  for (const auto& seed : Seeds()) {
    LLVMFuzzerTestOneInput(seed.data(), seed.size());
    for (size_t len = 0; len < seed.size(); ++len, ++runs) LLVMFuzzerTestOneInput(seed.data(), len);
    for (size_t i = 0; i < seed.size(); ++i) {
      for (uint8_t flip : {0x01, 0x80, 0xFF}) {
        std::vector<uint8_t> m = seed;
        m[i] ^= flip;
        LLVMFuzzerTestOneInput(m.data(), m.size());
        ++runs;
      }
    }
  }
  std::mt19937_64 rng(1234);
  for (int i = 0; i < 20000; ++i, ++runs) {
    std::vector<uint8_t> m(rng() % 1024);
    for (auto& b : m) b = static_cast<uint8_t>(rng());
    LLVMFuzzerTestOneInput(m.data(), m.size());
  }
  std::printf("replayed %zu inputs without a crash\n", runs);
  return 0;
}
