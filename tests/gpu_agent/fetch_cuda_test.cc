// Label `gpu`: the agent's in-place page kernels against a CPU reference on random data.
// FetchRows: every output row is the resident copy when the token is resident, else the host
// row, byte for byte, and the hit/miss counters add up over 300 tasks in one launch; by the
// copy-engine route the row cache's update holds the same rows at the slots it reports. The
// cache update against the CPU rule (row_cache.h), fp16 rows and, at the bench's shape, int8
// staged rows.
// WriteRows: rows stored from the device read back through the source identically.
// SumCacheCounts: many caches' counts summed on the device equal the host's sum.
#include "specache/cuda_fetch.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <set>
#include <vector>

#include <gtest/gtest.h>

#include "specache/cuda_gather.h"
#include "specache/device_probe.h"
#include "specache/in_memory_source.h"
#include "specache/row_cache.h"
#include "testing/cuda_device.h"
#include "testing/reference.h"

#ifdef SPECACHE_TEST_HAVE_CUDA
#include <cuda_runtime.h>

#include "copy_engine_fetch.h"
#include "testing/device_buffers.h"
#endif

namespace specache {
namespace {

#ifdef SPECACHE_TEST_HAVE_CUDA
using testing::DeviceBuffers;

// A sorted random subset of [0, n) of about `size` tokens.
std::vector<int32_t> RandomTokens(int32_t n, int size, std::mt19937& rng) {
  std::set<int32_t> s;
  while (static_cast<int>(s.size()) < std::min(size, n)) s.insert(static_cast<int32_t>(rng() % n));
  return {s.begin(), s.end()};
}

// The source's pages of (sequence 1, layer 0), registered, as a device page table.
struct MappedPages {
  DeviceBuffers buffers;
  std::vector<void*> registered;
  uint64_t* table = nullptr;
  MappedPages(InMemorySource& source, int32_t tokens) {
    std::vector<uint8_t*> pages;
    EXPECT_TRUE(source.HostPages(1, 0, tokens, &pages).ok());
    std::vector<uint64_t> device(pages.size());
    for (const HostRegion& r : source.host_regions()) {
      auto base = cuda::RegisterHostMemory(r.base, r.bytes);
      EXPECT_TRUE(base.ok()) << base.status().ToString();
      registered.push_back(r.base);
      for (size_t p = 0; p < pages.size(); ++p) {
        const auto* b = static_cast<const uint8_t*>(r.base);
        if (pages[p] >= b && pages[p] < b + r.bytes) device[p] = *base + (pages[p] - b);
      }
    }
    table = buffers.Copy(device);
  }
  ~MappedPages() {
    for (void* r : registered) (void)cuda::UnregisterHostMemory(r);
  }
};
#endif

TEST(CudaFetchTest, FetchedRowsAreResidentCopiesOrHostRows) {
  SPECACHE_REQUIRE_CUDA_DEVICE();
#ifdef SPECACHE_TEST_HAVE_CUDA
  std::mt19937 rng(41);
  for (int d : {32, 64, 96, 128, 256}) {  // rows of 8 to 64 pieces: within a lane step, across steps, wider than a warp
    const int n_kv = 4, page_tokens = 64;
    const int32_t length = 1000;
    const size_t row = 2 * size_t(d);
    InMemorySource source(page_tokens);
    ASSERT_TRUE(source.CreateSequence(1, {1, n_kv, d}).ok());
    std::vector<std::vector<Half>> host_rows(n_kv);
    for (int h = 0; h < n_kv; ++h) {
      host_rows[h] = testing::RandomHalves(size_t(length) * row, rng);
      ASSERT_TRUE(source.AppendRows(1, 0, h, 0, host_rows[h].data(), length).ok());
    }
    MappedPages mapped(source, length);
    DeviceBuffers buf;
    std::vector<cuda::FetchTask> tasks;
    std::vector<std::vector<Half>> want;
    std::vector<int32_t*> cache_slots;          // [task] the row cache's slots (device)
    std::vector<std::vector<Half>> caches;      // [task] the row cache's rows as they start
    uint64_t want_fetched = 0, want_reused = 0;
    const int n_tasks = 300;  // more than a launch took when the tasks were its parameters (256)
    for (int i = 0; i < n_tasks; ++i) {
      const int h = static_cast<int>(rng() % n_kv);
      const auto selected = RandomTokens(length, i % 7 == 0 ? 0 : 1 + static_cast<int>(rng() % 64), rng);
      auto resident = RandomTokens(length, static_cast<int>(rng() % 64), rng);
      // About half the selection was resident: merge some selected tokens into the resident set.
      for (int32_t t : selected) if (rng() % 2) resident.push_back(t);
      std::sort(resident.begin(), resident.end());
      resident.erase(std::unique(resident.begin(), resident.end()), resident.end());
      // Resident copies differ from the host rows, so the test sees which one was used.
      std::vector<Half> resident_rows(resident.size() * row);
      for (size_t r = 0; r < resident.size(); ++r) {
        for (size_t c = 0; c < row; ++c) resident_rows[r * row + c] = static_cast<Half>(host_rows[h][resident[r] * row + c] ^ 0x5a5a);
      }
      std::vector<Half> expect(selected.size() * row);
      for (size_t s = 0; s < selected.size(); ++s) {
        const auto at = std::lower_bound(resident.begin(), resident.end(), selected[s]);
        const bool hit = at != resident.end() && *at == selected[s];
        const Half* src = hit ? &resident_rows[(at - resident.begin()) * row] : &host_rows[h][selected[s] * row];
        std::copy(src, src + row, &expect[s * row]);
        (hit ? want_reused : want_fetched) += 1;
      }
      // Every third selection ends in the adaptive budget's padding, which is no row: not read,
      // not counted.
      std::vector<int32_t> padded = selected;
      if (i % 3 == 1) padded.resize(selected.size() + 1 + rng() % 9, cuda::kNoToken);
      // The resident rows lie in a row cache with room for them and the selection, at the slots
      // of a permutation of its rows (shuffled for even i, the identity for odd i, whose fetch
      // task every other time names no slots); the free rows hold garbage.
      const int32_t capacity = static_cast<int32_t>(resident.size() + padded.size());
      std::vector<int32_t> slots(capacity);
      for (int32_t r = 0; r < capacity; ++r) slots[r] = r;
      if (i % 2 == 0) std::shuffle(slots.begin(), slots.end(), rng);
      std::vector<Half> cache_rows = testing::RandomHalves(size_t(capacity) * row, rng);
      for (size_t r = 0; r < resident.size(); ++r) {
        std::copy_n(&resident_rows[r * row], row, &cache_rows[size_t(slots[r]) * row]);
      }
      cuda::FetchTask t;
      t.selected = buf.Copy(padded);
      t.n_selected = static_cast<int32_t>(padded.size());
      t.resident = buf.Copy(resident);
      t.resident_rows = buf.Copy(cache_rows);
      t.resident_slots = i % 4 == 1 ? nullptr : buf.Copy(slots);
      t.n_resident = static_cast<int32_t>(resident.size());
      t.out_rows = buf.Zeros<Half>(padded.size() * row);
      t.pages = mapped.table;
      t.kv_head = h;
      tasks.push_back(t);
      want.push_back(std::move(expect));
      cache_slots.push_back(buf.Copy(slots));
      caches.push_back(std::move(cache_rows));
    }
    auto* counters = buf.Copy(std::vector<cuda::FetchCounters>{{0, 0, 0}});
    ASSERT_TRUE(cuda::FetchRows(tasks.data(), n_tasks, d, HostRowFormat::kFp16, page_tokens, 7, counters, nullptr).ok());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    for (int i = 0; i < n_tasks; ++i) {
      ASSERT_EQ(testing::Download(tasks[i].out_rows, want[i].size()), want[i]) << "d=" << d << " task " << i;
    }
    const cuda::FetchCounters got_counters = testing::Download(counters, 1)[0];
    EXPECT_EQ(got_counters.fetched, want_fetched);
    EXPECT_EQ(got_counters.reused, want_reused);

    // The copy-engine route (copy_engine_fetch.h) on the same tasks, three times (its two
    // buffers, then the first again): the missed rows listed by the device, gathered from the
    // pages' host addresses by three threads, copied up, and taken by the row cache's update by
    // their ranks (the hits from the old cache): the new cache holds the same rows at the slots
    // it reports, and the update counts the same hits and misses.
    std::vector<uint8_t*> host_pages;
    ASSERT_TRUE(source.HostPages(1, 0, length, &host_pages).ok());
    const std::vector<const uint8_t* const*> tables(tasks.size(), host_pages.data());
    cudaStream_t stream = nullptr;
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
    cudaEvent_t ready = nullptr;  // the tasks were written before the test began
    ASSERT_EQ(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming), cudaSuccess);
    ASSERT_EQ(cudaEventRecord(ready, stream), cudaSuccess);
    cuda::CopyEngineFetch route(d, HostRowFormat::kFp16, page_tokens, 3);
    // The same route with the gather's streaming stores (CudaAgentOptions::fetch_streaming_stores).
    cuda::CopyEngineFetch route_streaming(d, HostRowFormat::kFp16, page_tokens, 3,
                                          cuda::CopyEngineFetch::kCopyPieceBytes, /*streaming_stores=*/true);
    cuda::CopyEngineFetch* active = &route;
    // Each task's old cache is its resident list (read through resident_count when set, as
    // RowFetcher does) over the row cache above, with room for all of it and the selection:
    // nothing is evicted, and the misses go into the free rows. Each pass starts from the rows as
    // they were (`pristine`), so a pass that wrote no row would not pass on an earlier one's.
    std::vector<cuda::CacheUpdateTask> updates(tasks.size());
    std::vector<const Half*> pristine(tasks.size());
    for (size_t i = 0; i < tasks.size(); ++i) {
      const cuda::FetchTask& t = tasks[i];
      cuda::CacheUpdateTask& u = updates[i];
      u.capacity = t.n_resident + t.n_selected;
      std::vector<int32_t> resident = testing::Download(t.resident, t.n_resident);
      resident.resize(u.capacity, cuda::kNoToken);  // the list's entries past its count
      u.old_tokens = buf.Copy(resident);
      u.old_used = buf.Zeros<int32_t>(u.capacity);
      u.old_slots = cache_slots[i];
      u.old_count = buf.Copy(std::vector<int32_t>{t.n_resident});
      u.selected = t.selected;
      u.n_selected = t.n_selected;
      u.rows = const_cast<Half*>(t.resident_rows);
      pristine[i] = buf.Copy(caches[i]);
      u.new_tokens = buf.Zeros<int32_t>(u.capacity);
      u.new_used = buf.Zeros<int32_t>(u.capacity);
      u.new_slots = buf.Zeros<int32_t>(u.capacity);
      u.new_count = buf.Zeros<int32_t>(1);
      u.selected_slots = buf.Zeros<int32_t>(std::max(1, t.n_selected));
      u.now = 1;
    }
    // Stage, the update by ranks, and the check of every task's cache and the counters.
    auto fetch_by_copy_engine = [&](const std::vector<cuda::FetchTask>& staged_tasks, bool after_stream,
                                    const std::string& what) {
      auto routed = active->Stage(staged_tasks, tables, std::span(&ready, 1), stream, after_stream);
      ASSERT_TRUE(routed.ok()) << routed.status().ToString();
      // Ranked tasks are the cache update's: FetchRows refuses them before queueing anything.
      EXPECT_EQ(cuda::FetchRows(routed->data(), n_tasks, d, HostRowFormat::kFp16, page_tokens, 7, counters, stream).code(),
                StatusCode::kInvalidArgument);
      std::vector<cuda::CacheUpdateTask> ranked = updates;
      for (size_t i = 0; i < ranked.size(); ++i) {
        ranked[i].old_count = staged_tasks[i].resident_count ? staged_tasks[i].resident_count : updates[i].old_count;
        ranked[i].staged_rank = (*routed)[i].staged_rank;
        ranked[i].selected_rows = (*routed)[i].staged_rows;
        ASSERT_EQ(cudaMemcpyAsync(ranked[i].rows, pristine[i], ranked[i].capacity * row * sizeof(Half),
                                  cudaMemcpyDeviceToDevice, stream),
                  cudaSuccess);
      }
      ASSERT_EQ(cudaMemsetAsync(counters, 0, sizeof(cuda::FetchCounters), stream), cudaSuccess);
      ASSERT_TRUE(cuda::UpdateRowCaches(ranked.data(), n_tasks, d, HostRowFormat::kFp16, counters, stream).ok());
      ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
      for (int i = 0; i < n_tasks; ++i) {
        const std::vector<int32_t> selected = testing::Download(tasks[i].selected, tasks[i].n_selected);
        const std::vector<int32_t> slots = testing::Download(ranked[i].selected_slots, tasks[i].n_selected);
        const std::vector<int32_t> cached = testing::Download(ranked[i].new_tokens, ranked[i].capacity);
        const std::vector<int32_t> cache_slot = testing::Download(ranked[i].new_slots, ranked[i].capacity);
        const std::vector<Half> rows = testing::Download(ranked[i].rows, ranked[i].capacity * row);
        std::vector<int32_t> at_slot(ranked[i].capacity, cuda::kNoToken);  // the token each slot's row is
        for (int32_t e = 0; e < ranked[i].capacity; ++e) {
          ASSERT_TRUE(cache_slot[e] >= 0 && cache_slot[e] < ranked[i].capacity) << what << " task " << i;
          ASSERT_EQ(at_slot[cache_slot[e]], cuda::kNoToken) << what << " task " << i << ": slot named twice";
          at_slot[cache_slot[e]] = cached[e];
        }
        for (int j = 0; j < tasks[i].n_selected; ++j) {
          if (selected[j] == cuda::kNoToken) {
            EXPECT_EQ(slots[j], -1) << what << ", d=" << d << " task " << i << " padding slot " << j;
            continue;
          }
          ASSERT_TRUE(slots[j] >= 0 && slots[j] < ranked[i].capacity) << what << " task " << i << " slot " << j;
          EXPECT_EQ(at_slot[slots[j]], selected[j]) << what << ", d=" << d << " task " << i << " slot " << j;
          ASSERT_TRUE(std::equal(want[i].begin() + j * row, want[i].begin() + (j + 1) * row, rows.begin() + slots[j] * row))
              << what << ", d=" << d << " task " << i << " slot " << j;
        }
      }
      const cuda::FetchCounters got = testing::Download(counters, 1)[0];
      EXPECT_EQ(got.fetched, want_fetched) << what;
      EXPECT_EQ(got.reused, want_reused) << what;
    };
    for (int pass = 0; pass < 3; ++pass) fetch_by_copy_engine(tasks, false, "copy engine pass " + std::to_string(pass));
    EXPECT_EQ(route.times().rows_gathered, 3 * static_cast<int64_t>(want_fetched));
    active = &route_streaming;
    fetch_by_copy_engine(tasks, false, "copy engine, streaming stores");
    EXPECT_EQ(route_streaming.times().rows_gathered, static_cast<int64_t>(want_fetched));
    active = &route;

    // A row cache's first fetch (RowFetcher's fills): the resident counts are written on `stream`
    // just before Stage, behind ~1 GB of device copies, and read through resident_count. With
    // after_stream the list waits for them; one that read the counts before they landed (0 here:
    // nothing resident) would gather the hits from the pages, which differ from their resident
    // copies in this test.
    std::vector<int32_t> counts(tasks.size());
    for (size_t i = 0; i < tasks.size(); ++i) counts[i] = tasks[i].n_resident;
    int32_t* device_counts = buf.Zeros<int32_t>(tasks.size());
    std::vector<cuda::FetchTask> counted = tasks;
    for (size_t i = 0; i < counted.size(); ++i) counted[i].resident_count = device_counts + i;
    const size_t delay_bytes = size_t{256} << 20;
    uint8_t* delay_from = buf.Zeros<uint8_t>(delay_bytes);
    uint8_t* delay_to = buf.Zeros<uint8_t>(delay_bytes);
    for (int i = 0; i < 4; ++i) {
      ASSERT_EQ(cudaMemcpyAsync(delay_to, delay_from, delay_bytes, cudaMemcpyDeviceToDevice, stream), cudaSuccess);
    }
    ASSERT_EQ(cudaMemcpyAsync(device_counts, counts.data(), counts.size() * sizeof(int32_t), cudaMemcpyHostToDevice,
                              stream),
              cudaSuccess);
    fetch_by_copy_engine(counted, true, "first fetch");
    cudaEventDestroy(ready);
    cudaStreamDestroy(stream);
  }
#endif
}

// Tasks without pages (the staged fetch put the missed rows into out_rows already): a miss keeps
// what out_rows holds, a hit becomes the resident copy, and both are counted; a task with pages
// still needs page_tokens.
TEST(CudaFetchTest, TasksWithoutPagesKeepTheStagedRowsAndCopyTheResidentOnes) {
  SPECACHE_REQUIRE_CUDA_DEVICE();
#ifdef SPECACHE_TEST_HAVE_CUDA
  std::mt19937 rng(43);
  const int d = 64;
  const size_t row = 2 * size_t(d);
  const int32_t length = 500;
  DeviceBuffers buf;
  std::vector<cuda::FetchTask> tasks;
  std::vector<std::vector<Half>> want;
  uint64_t want_fetched = 0, want_reused = 0;
  for (int i = 0; i < 40; ++i) {
    const auto selected = RandomTokens(length, 1 + static_cast<int>(rng() % 48), rng);
    std::vector<int32_t> resident;
    for (int32_t t : selected) if (rng() % 2) resident.push_back(t);
    std::vector<Half> resident_rows = testing::RandomHalves(resident.size() * row, rng);
    std::vector<Half> staged = testing::RandomHalves(selected.size() * row, rng);  // hits' slots stale
    std::vector<Half> expect = staged;
    for (size_t s = 0; s < selected.size(); ++s) {
      const auto at = std::lower_bound(resident.begin(), resident.end(), selected[s]);
      const bool hit = at != resident.end() && *at == selected[s];
      if (hit) std::copy_n(&resident_rows[(at - resident.begin()) * row], row, &expect[s * row]);
      (hit ? want_reused : want_fetched) += 1;
    }
    std::vector<int32_t> padded = selected;
    if (i % 3 == 1) padded.resize(selected.size() + 1 + rng() % 5, cuda::kNoToken);
    staged.resize(padded.size() * row);
    expect.resize(padded.size() * row);
    std::copy(staged.begin() + selected.size() * row, staged.end(), expect.begin() + selected.size() * row);
    cuda::FetchTask t;
    t.selected = buf.Copy(padded);
    t.n_selected = static_cast<int32_t>(padded.size());
    t.resident = resident.empty() ? nullptr : buf.Copy(resident);
    t.resident_rows = resident.empty() ? nullptr : buf.Copy(resident_rows);
    t.n_resident = static_cast<int32_t>(resident.size());
    t.out_rows = buf.Copy(staged);
    t.kv_head = i % 4;
    tasks.push_back(t);
    want.push_back(std::move(expect));
  }
  auto* counters = buf.Copy(std::vector<cuda::FetchCounters>{{0, 0, 0}});
  ASSERT_TRUE(cuda::FetchRows(tasks.data(), static_cast<int>(tasks.size()), d, HostRowFormat::kFp16, 0, 7, counters, nullptr).ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  for (size_t i = 0; i < tasks.size(); ++i) {
    ASSERT_EQ(testing::Download(tasks[i].out_rows, want[i].size()), want[i]) << "task " << i;
  }
  const cuda::FetchCounters got = testing::Download(counters, 1)[0];
  EXPECT_EQ(got.fetched, want_fetched);
  EXPECT_EQ(got.reused, want_reused);
  tasks[0].pages = buf.Copy(std::vector<uint64_t>{0});
  EXPECT_EQ(cuda::FetchRows(tasks.data(), 1, d, HostRowFormat::kFp16, 0, 7, counters, nullptr).code(), StatusCode::kInvalidArgument);
#endif
}

TEST(CudaFetchTest, WrittenRowsReadBackThroughTheSource) {
  SPECACHE_REQUIRE_CUDA_DEVICE();
#ifdef SPECACHE_TEST_HAVE_CUDA
  std::mt19937 rng(43);
  for (int d : {64, 128}) {
    const int n_kv = 3, page_tokens = 64;
    const int32_t before = 100, n = 150;  // appends cross page boundaries
    const size_t row = 2 * size_t(d);
    InMemorySource source(page_tokens);
    ASSERT_TRUE(source.CreateSequence(1, {1, n_kv, d}).ok());
    for (int h = 0; h < n_kv; ++h) {
      const auto rows = testing::RandomHalves(size_t(before) * row, rng);
      ASSERT_TRUE(source.AppendRows(1, 0, h, 0, rows.data(), before).ok());
    }
    MappedPages mapped(source, before + n);
    // The engine's layout: [n][n_kv][d] keys and values.
    const auto keys = testing::RandomHalves(size_t(n) * n_kv * d, rng), values = testing::RandomHalves(size_t(n) * n_kv * d, rng);
    DeviceBuffers buf;
    const Half* dk = buf.Copy(keys);
    const Half* dv = buf.Copy(values);
    std::vector<cuda::WriteTask> tasks;
    for (int h = 0; h < n_kv; ++h) tasks.push_back({dk + h * d, dv + h * d, mapped.table, int64_t{n_kv} * d, before, n, h});
    ASSERT_TRUE(cuda::WriteRows(tasks.data(), n_kv, d, HostRowFormat::kFp16, page_tokens, nullptr).ok());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    for (int h = 0; h < n_kv; ++h) {
      ASSERT_TRUE(source.CommitRows(1, 0, h, before, n).ok());
      std::vector<int32_t> tokens(n);
      for (int32_t i = 0; i < n; ++i) tokens[i] = before + i;
      std::vector<Half> got(size_t(n) * row);
      ASSERT_TRUE(source.ReadRows(1, 0, h, tokens.data(), n, got.data()).ok());
      for (int32_t i = 0; i < n; ++i) {
        for (int c = 0; c < d; ++c) {
          ASSERT_EQ(got[i * row + c], keys[(size_t(i) * n_kv + h) * d + c]) << "key, token " << before + i;
          ASSERT_EQ(got[i * row + d + c], values[(size_t(i) * n_kv + h) * d + c]) << "value, token " << before + i;
        }
      }
    }
  }
#endif
}

#ifdef SPECACHE_TEST_HAVE_CUDA
// A cache update's task over an old cache (`old`: its list; entry j's row at rows[slots[j]]) of
// `capacity` rows, its outputs filled with markers; the caller sets the selection, its slots,
// its rows and `now`.
cuda::CacheUpdateTask OldCacheTask(DeviceBuffers& buf, const RowCacheEntries& old, const std::vector<int32_t>& slots,
                                   const std::vector<Half>& rows, int32_t capacity) {
  std::vector<int32_t> tokens32 = old.tokens, used32(old.used.begin(), old.used.end());
  tokens32.resize(capacity, cuda::kNoToken);
  used32.resize(capacity, -3);
  cuda::CacheUpdateTask t;
  t.old_tokens = buf.Copy(tokens32);
  t.old_used = buf.Copy(used32);
  t.old_slots = buf.Copy(slots);
  t.old_count = buf.Copy(std::vector<int32_t>{static_cast<int32_t>(old.tokens.size())});
  t.rows = buf.Copy(rows);
  t.new_tokens = buf.Copy(std::vector<int32_t>(capacity, -1));
  t.new_used = buf.Copy(std::vector<int32_t>(capacity, -1));
  t.new_slots = buf.Copy(std::vector<int32_t>(capacity, -1));
  t.new_count = buf.Copy(std::vector<int32_t>{-1});
  t.capacity = capacity;
  return t;
}

// All of `tasks` updated in one launch, its staged rows as `rows`, and the misses and hits it
// counted (of the tasks with staged ranks) as wanted.
void UpdateAndExpectCounts(DeviceBuffers& buf, const std::vector<cuda::CacheUpdateTask>& tasks, int d, HostRowFormat rows,
                           uint64_t want_fetched, uint64_t want_reused) {
  auto* counters = buf.Copy(std::vector<cuda::FetchCounters>{{0, 0, 0}});
  ASSERT_TRUE(cuda::UpdateRowCaches(tasks.data(), static_cast<int>(tasks.size()), d, rows, counters, nullptr).ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const cuda::FetchCounters got = testing::Download(counters, 1)[0];
  EXPECT_EQ(got.fetched, want_fetched);
  EXPECT_EQ(got.reused, want_reused);
}

// What an update must leave (the CPU rule's): the new list, each entry's row, and the slot each
// entry kept from the old cache (-1: a miss, any free slot).
struct WantedCache {
  RowCacheEntries cache;
  std::vector<Half> rows;         // [entry][row]
  std::vector<int32_t> old_slot;  // [entry]
};

// Checks task t after its update against `want`, `selection` being the task's selection with its
// padding: the list and use marks, the kNoToken past the count, every slot named once, each entry's
// row at its slot (a kept entry's slot as it was), each selected token's slot its entry's, the
// padding's -1.
void ExpectUpdated(const cuda::CacheUpdateTask& t, const WantedCache& want, const std::vector<int32_t>& selection,
                   size_t row, int task) {
  const int32_t capacity = t.capacity;
  const int32_t count = testing::Download(t.new_count, 1)[0];
  ASSERT_EQ(count, static_cast<int32_t>(want.cache.tokens.size())) << "task " << task;
  const std::vector<int32_t> all = testing::Download(t.new_tokens, capacity), used = testing::Download(t.new_used, count);
  EXPECT_EQ(std::vector<int32_t>(all.begin(), all.begin() + count), want.cache.tokens) << "task " << task;
  EXPECT_EQ(std::vector<int64_t>(used.begin(), used.end()), want.cache.used) << "task " << task;
  // The rest is marked empty, so the attention can take the whole cache (attend_resident).
  for (int32_t j = count; j < capacity; ++j) EXPECT_EQ(all[j], cuda::kNoToken) << "task " << task;
  const std::vector<int32_t> new_slots = testing::Download(t.new_slots, capacity);
  const std::vector<Half> rows = testing::Download(t.rows, size_t(capacity) * row);
  std::vector<bool> named(capacity, false);
  for (int32_t e = 0; e < capacity; ++e) {
    ASSERT_TRUE(new_slots[e] >= 0 && new_slots[e] < capacity) << "task " << task << " entry " << e;
    ASSERT_FALSE(named[new_slots[e]]) << "task " << task << ": slot " << new_slots[e] << " named twice";
    named[new_slots[e]] = true;
  }
  for (int32_t e = 0; e < count; ++e) {
    if (want.old_slot[e] >= 0) {
      EXPECT_EQ(new_slots[e], want.old_slot[e]) << "task " << task << " entry " << e;
    }
    ASSERT_TRUE(std::equal(want.rows.begin() + e * row, want.rows.begin() + (e + 1) * row,
                           rows.begin() + size_t(new_slots[e]) * row))
        << "task " << task << " entry " << e;
  }
  const std::vector<int32_t> slots = testing::Download(t.selected_slots, t.n_selected);
  for (int32_t j = 0; j < t.n_selected; ++j) {
    if (selection[j] == cuda::kNoToken) {
      EXPECT_EQ(slots[j], -1) << "task " << task << " slot " << j;
      continue;
    }
    const auto e = std::lower_bound(all.begin(), all.begin() + count, selection[j]) - all.begin();
    ASSERT_TRUE(e < count && all[e] == selection[j]) << "task " << task << " slot " << j;
    EXPECT_EQ(slots[j], new_slots[e]) << "task " << task << " slot " << j;
  }
}
#endif

// The device's cache update equals row_cache.h's rule on random caches and selections (tokens,
// use marks, rows and counts), for capacities k, 2k, 3k, 700 (more entries than the kernel's
// threads), 9700 (under 48 KB of dynamic shared memory, over it with the static part) and
// kMaxCacheRows, over two launches' worth of tasks. Use marks repeat (ties go to the
// higher token) or, every fifth task, spread over all of int32 (every byte of the ranking's key).
// The rows stay in place: the old cache's rows lie at a shuffled permutation of slots, every entry
// that stays or is selected again keeps its slot and row (hits take the old cache's row, not the
// fetched one), the misses' rows land in free slots, and each new list names every slot once.
// An empty old cache's slots are garbage (all free). Every selected token's slot names its row.
// Every third task takes its rows by staged ranks (the copy-engine fetch: misses from a shuffled
// staged array), and the update counts those tasks' misses and hits.
TEST(CudaFetchTest, CacheUpdateEqualsTheCpuRule) {
  SPECACHE_REQUIRE_CUDA_DEVICE();
#ifdef SPECACHE_TEST_HAVE_CUDA
  std::mt19937 rng(47);
  const int d = 64, k = 16;
  const size_t row = 2 * size_t(d);
  DeviceBuffers buf;
  std::vector<cuda::CacheUpdateTask> tasks;
  std::vector<WantedCache> want;
  std::vector<std::vector<int32_t>> slot_want;  // [task] the selection, padding included
  uint64_t want_fetched = 0, want_reused = 0;   // of the ranked tasks
  const int n_tasks = 284;  // more than a launch took when the tasks were its parameters (264)
  for (int i = 0; i < n_tasks; ++i) {
    // Task 1 at kMaxCacheRows, nearly full: the shared memory over 48 KB and the int16 positions.
    // Task 3 at 9700 rows: dynamic shared memory under 48 KB, but not with the kernel's static part.
    const int capacity = i == 1 ? cuda::kMaxCacheRows : i == 3 ? 9700 : i % 11 == 0 ? 700 : k * (1 + i % 3);
    RowCacheEntries old;
    old.tokens = i == 1 ? RandomTokens(40000, capacity - 3, rng)
                        : RandomTokens(5000, static_cast<int>(rng() % (capacity + 1)), rng);
    for (size_t j = 0; j < old.tokens.size(); ++j) {
      old.used.push_back(i % 5 == 4 ? int64_t{static_cast<int32_t>(rng())} : static_cast<int64_t>(rng() % 6));
    }
    auto selected = RandomTokens(5000, 1 + static_cast<int>(rng() % k), rng);  // later padded to k, for odd i
    for (int32_t t : old.tokens) if (rng() % 3 == 0 && selected.size() < size_t(k)) selected.push_back(t);
    std::sort(selected.begin(), selected.end());
    selected.erase(std::unique(selected.begin(), selected.end()), selected.end());
    // The old cache: entry j's row at rows[slots[j]]; the slots past the count are the free ones
    // (garbage when the cache is empty).
    std::vector<int32_t> slots(capacity);
    for (int32_t r = 0; r < capacity; ++r) slots[r] = r;
    std::shuffle(slots.begin(), slots.end(), rng);
    if (old.tokens.empty()) {
      for (int32_t& s : slots) s = -5 - static_cast<int32_t>(rng() % 1000);
    }
    const auto rows = testing::RandomHalves(size_t(capacity) * row, rng);
    // Random rows for the hits too: the update must keep the old cache's, not take these.
    auto sel_rows = testing::RandomHalves(selected.size() * row, rng);
    WantedCache w{old, {}, {}};
    std::vector<bool> hit;
    const auto sources = UpdateRowCache(&w.cache, selected, 7, static_cast<size_t>(capacity), &hit);
    auto old_index = [&](int32_t token) {
      return std::lower_bound(old.tokens.begin(), old.tokens.end(), token) - old.tokens.begin();
    };
    for (int64_t src : sources) {
      const int64_t from_old = src < 0 ? -1 - src : hit[src] ? old_index(selected[src]) : -1;
      const Half* from = from_old >= 0 ? &rows[size_t(slots[from_old]) * row] : &sel_rows[src * row];
      w.rows.insert(w.rows.end(), from, from + row);
      w.old_slot.push_back(from_old >= 0 ? slots[from_old] : -1);
    }
    const bool ranked = i % 3 == 2;
    if (ranked) {
      for (bool h : hit) (h ? want_reused : want_fetched) += 1;
    }
    want.push_back(std::move(w));
    cuda::CacheUpdateTask t = OldCacheTask(buf, old, slots, rows, capacity);
    // Odd tasks end their selection in the adaptive budget's padding: the cache holds what it
    // would without it.
    const size_t n_real = selected.size();
    if (i % 2 == 1) {
      selected.resize(size_t(k), cuda::kNoToken);
      sel_rows.resize(selected.size() * row);
    }
    if (ranked) {  // the misses' rows in a shuffled staged array, behind another task's rows
      std::vector<int32_t> ranks(selected.size(), -1), order;
      for (size_t j = 0; j < n_real; ++j) {
        if (hit[j]) ranks[j] = -2 - static_cast<int32_t>(old_index(selected[j]));
        else order.push_back(static_cast<int32_t>(j));
      }
      std::shuffle(order.begin(), order.end(), rng);
      const size_t before = rng() % 5;
      std::vector<Half> staged = testing::RandomHalves((before + order.size()) * row, rng);
      for (size_t r = 0; r < order.size(); ++r) {
        ranks[order[r]] = static_cast<int32_t>(before + r);
        std::copy_n(&sel_rows[order[r] * row], row, &staged[(before + r) * row]);
      }
      t.staged_rank = buf.Copy(ranks);
      t.selected_rows = buf.Copy(staged);
    } else {
      t.selected_rows = buf.Copy(sel_rows);
    }
    slot_want.push_back(selected);
    t.selected = buf.Copy(selected);
    t.n_selected = static_cast<int32_t>(selected.size());
    t.selected_slots = buf.Copy(std::vector<int32_t>(selected.size(), -7));
    t.now = 7;
    tasks.push_back(t);
  }
  // Task 3 alone first, before any launch of a larger cache made the kernel opt in (the update
  // gives the same result run twice: the old list is not written, the misses land in the same slots).
  ASSERT_TRUE(cuda::UpdateRowCaches(&tasks[3], 1, d, HostRowFormat::kFp16, nullptr, nullptr).ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  ASSERT_NO_FATAL_FAILURE(UpdateAndExpectCounts(buf, tasks, d, HostRowFormat::kFp16, want_fetched, want_reused));
  for (int i = 0; i < n_tasks; ++i) ExpectUpdated(tasks[i], want[i], slot_want[i], row, i);
  // The slots the attention reads through are required.
  std::vector<cuda::CacheUpdateTask> without = {tasks[0]};
  without[0].selected_slots = nullptr;
  EXPECT_EQ(cuda::UpdateRowCaches(without.data(), 1, d, HostRowFormat::kFp16, nullptr, nullptr).code(), StatusCode::kInvalidArgument);
#endif
}

#ifdef SPECACHE_TEST_HAVE_CUDA
// Random fp16 values whose halves (of head_dim) differ in scale by up to ~1000x; every 7th half
// zero, every 11th with a non-finite value (inf, -inf or NaN: its int8 half reads back NaN), every
// 13th with fp16's largest magnitude (the scale rounds up: codes saturate). And halves made for
// the format's corners: every 17th subnormal up to 1079 x 2^-24 (its scale, 8 x 2^-24, rounds
// down so far that a quotient passes 127 and clamps); every 19th at most 63 x 2^-24 (its scale
// rounds to 0: zeros back); every 23rd with largest magnitude 127 (scale exactly 1) and values
// +-0.5, +-1.5, +-2.5, ... (quotients on .5: rounded away from zero, not to even).
std::vector<Half> ScaledHalves(size_t halves, int d, std::mt19937& rng) {
  std::vector<Half> out(halves * d);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> log_scale(-3.0f, 3.0f);
  const auto sign = [&rng](Half h) { return static_cast<Half>(h | (rng() % 2 ? 0x8000 : 0)); };
  for (size_t h = 0; h < halves; ++h) {
    Half* v = &out[h * d];
    if (h % 17 == 8) {
      for (int i = 0; i < d; ++i) v[i] = sign(static_cast<Half>(rng() % 0x0438));
      v[rng() % d] = sign(0x0437);
      continue;
    }
    if (h % 19 == 9) {
      for (int i = 0; i < d; ++i) v[i] = sign(static_cast<Half>(rng() % 64));
      continue;
    }
    if (h % 23 == 10) {
      for (int i = 0; i < d; ++i) v[i] = FloatToHalf((rng() % 2 ? 1.0f : -1.0f) * (0.5f + static_cast<float>(rng() % 126)));
      v[rng() % d] = FloatToHalf(127.0f);
      continue;
    }
    const float scale = h % 7 == 3 ? 0.0f : std::pow(10.0f, log_scale(rng));
    for (int i = 0; i < d; ++i) v[i] = FloatToHalf(scale * normal(rng));
    if (h % 11 == 5) v[rng() % d] = h % 3 == 0 ? Half{0x7C00} : h % 3 == 1 ? Half{0xFC00} : Half{0x7E00};
    if (h % 13 == 6) v[rng() % d] = FloatToHalf(-65504.0f);
  }
  return out;
}
#endif

// int8 pages (host_rows.h) on the device, against the host's EncodeHostRows / DecodeHostRows:
// WriteRows stores exactly the host's bytes (codes, scales, zero tail) for rows that cross pages;
// FetchRows gives exactly the host's decoded rows for misses and the resident fp16 rows for hits;
// the cache update decodes staged int8 rows exactly as the host does. head_dim 96 has lane groups
// wider than its pieces; 256 fills a warp.
TEST(CudaFetchTest, Int8PagesHoldAndGiveTheHostFormatsBytesAndValues) {
  SPECACHE_REQUIRE_CUDA_DEVICE();
#ifdef SPECACHE_TEST_HAVE_CUDA
  std::mt19937 rng(47);
  for (int d : {32, 64, 96, 128, 256}) {
    const int n_kv = 3, page_tokens = 64;
    const int32_t before = 100, n = 150, length = before + n;
    const size_t row = 2 * size_t(d);
    const int64_t stored_bytes = HostRowBytes(HostRowFormat::kInt8, d);
    InMemorySource source(page_tokens);
    ASSERT_TRUE(source.CreateSequence(1, {1, n_kv, d, HostRowFormat::kInt8}).ok());
    std::vector<std::vector<Half>> all(n_kv);  // [head] every row, [length][2][d]
    for (int h = 0; h < n_kv; ++h) {
      all[h] = ScaledHalves(size_t(length) * 2, d, rng);
      ASSERT_TRUE(source.AppendRows(1, 0, h, 0, all[h].data(), before).ok());
    }
    MappedPages mapped(source, length);
    // WriteRows: the engine's layout, [n][n_kv][d] keys and values.
    std::vector<Half> keys(size_t(n) * n_kv * d), values(keys.size());
    for (int32_t i = 0; i < n; ++i) {
      for (int h = 0; h < n_kv; ++h) {
        std::copy_n(&all[h][size_t(before + i) * row], d, &keys[(size_t(i) * n_kv + h) * d]);
        std::copy_n(&all[h][size_t(before + i) * row + d], d, &values[(size_t(i) * n_kv + h) * d]);
      }
    }
    DeviceBuffers buf;
    const Half* dk = buf.Copy(keys);
    const Half* dv = buf.Copy(values);
    std::vector<cuda::WriteTask> writes;
    for (int h = 0; h < n_kv; ++h) writes.push_back({dk + h * d, dv + h * d, mapped.table, int64_t{n_kv} * d, before, n, h});
    ASSERT_TRUE(cuda::WriteRows(writes.data(), n_kv, d, HostRowFormat::kInt8, page_tokens, nullptr).ok());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    std::vector<uint8_t*> pages;
    ASSERT_TRUE(source.HostPages(1, 0, length, &pages).ok());
    for (int h = 0; h < n_kv; ++h) {
      ASSERT_TRUE(source.CommitRows(1, 0, h, before, n).ok());
      std::vector<uint8_t> want(size_t(length) * stored_bytes);
      EncodeHostRows(HostRowFormat::kInt8, all[h].data(), length, d, want.data());
      for (int32_t t = 0; t < length; ++t) {  // the host's rows and the device's, byte for byte
        const uint8_t* got = pages[t / page_tokens] + PageRowOffset(h, t % page_tokens, page_tokens, stored_bytes);
        ASSERT_EQ(std::memcmp(got, &want[size_t(t) * stored_bytes], size_t(stored_bytes)), 0)
            << "d " << d << " head " << h << " token " << t;
      }
    }
    // FetchRows: random selections, about half resident (resident rows differ from the decoded
    // ones), at shuffled slots of a row cache for even tasks; every third ends in the adaptive
    // budget's padding; every fifth has no pages (the staged fetch: its misses' fp16 rows are in
    // out_rows already, counted as fetched, left as they are).
    std::vector<cuda::FetchTask> tasks;
    std::vector<std::vector<Half>> expect;
    uint64_t want_fetched = 0, want_reused = 0;
    for (int i = 0; i < 40; ++i) {
      const int h = i % n_kv;
      const bool staged = i % 5 == 4;
      const auto selected = RandomTokens(length, 1 + static_cast<int>(rng() % 64), rng);
      std::vector<int32_t> resident;
      for (int32_t t : selected) if (rng() % 2) resident.push_back(t);
      const std::vector<Half> resident_rows = testing::RandomHalves(resident.size() * row, rng);
      std::vector<int32_t> padded = selected;
      if (i % 3 == 1) padded.resize(selected.size() + 1 + rng() % 5, cuda::kNoToken);
      std::vector<Half> e(padded.size() * row, Half{0x1234}), start(e.size(), Half{0x1234});
      for (size_t j = 0; j < selected.size(); ++j) {
        const auto at = std::lower_bound(resident.begin(), resident.end(), selected[j]);
        if (at != resident.end() && *at == selected[j]) {
          std::copy_n(&resident_rows[(at - resident.begin()) * row], row, &e[j * row]);
          ++want_reused;
        } else {
          const int32_t t = selected[j];
          DecodeHostRows(HostRowFormat::kInt8, pages[t / page_tokens] + PageRowOffset(h, t % page_tokens, page_tokens, stored_bytes),
                         1, d, &e[j * row]);
          if (staged) std::copy_n(&e[j * row], row, &start[j * row]);  // what the staged read put there
          ++want_fetched;
        }
      }
      // Even tasks: the resident rows at shuffled slots of a cache with room for one more row.
      std::vector<int32_t> slots(resident.size() + 1);
      for (size_t r = 0; r < slots.size(); ++r) slots[r] = static_cast<int32_t>(r);
      std::shuffle(slots.begin(), slots.end(), rng);
      std::vector<Half> cache = testing::RandomHalves(slots.size() * row, rng);
      for (size_t r = 0; r < resident.size(); ++r) std::copy_n(&resident_rows[r * row], row, &cache[size_t(slots[r]) * row]);
      cuda::FetchTask t;
      t.selected = buf.Copy(padded);
      t.n_selected = static_cast<int32_t>(padded.size());
      t.resident = buf.Copy(resident);
      t.n_resident = static_cast<int32_t>(resident.size());
      t.resident_rows = i % 2 == 0 ? buf.Copy(cache) : buf.Copy(resident_rows);
      t.resident_slots = i % 2 == 0 ? buf.Copy(slots) : nullptr;
      t.out_rows = buf.Copy(start);
      t.pages = staged ? nullptr : mapped.table;
      t.kv_head = h;
      tasks.push_back(t);
      expect.push_back(std::move(e));
    }
    auto* counters = buf.Copy(std::vector<cuda::FetchCounters>{{0, 0, 0}});
    ASSERT_TRUE(cuda::FetchRows(tasks.data(), static_cast<int>(tasks.size()), d, HostRowFormat::kInt8, page_tokens, 7,
                                counters, nullptr).ok());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    for (size_t i = 0; i < tasks.size(); ++i) {
      ASSERT_EQ(testing::Download(tasks[i].out_rows, expect[i].size()), expect[i]) << "d " << d << " task " << i;
    }
    const cuda::FetchCounters got = testing::Download(counters, 1)[0];
    EXPECT_EQ(got.fetched, want_fetched);
    EXPECT_EQ(got.reused, want_reused);
    // The cache update: a fresh cache whose selection's rows are all staged int8 rows, in a
    // shuffled order behind two other rows.
    const int32_t k = 37;
    const auto selected = RandomTokens(length, k, rng);
    std::vector<int32_t> order(selected.size());
    for (size_t j = 0; j < order.size(); ++j) order[j] = static_cast<int32_t>(j);
    std::shuffle(order.begin(), order.end(), rng);
    std::vector<int32_t> ranks(selected.size());
    std::vector<uint8_t> staged(size_t(2 + selected.size()) * stored_bytes, 0xCD);
    for (size_t r = 0; r < order.size(); ++r) {
      ranks[order[r]] = static_cast<int32_t>(2 + r);
      const int32_t t = selected[order[r]];
      std::memcpy(&staged[(2 + r) * stored_bytes], pages[t / page_tokens] + PageRowOffset(0, t % page_tokens, page_tokens, stored_bytes),
                  size_t(stored_bytes));
    }
    const int32_t capacity = static_cast<int32_t>(selected.size());
    cuda::CacheUpdateTask u;
    u.old_tokens = buf.Copy(std::vector<int32_t>(capacity, cuda::kNoToken));
    u.old_used = buf.Copy(std::vector<int32_t>(capacity, 0));
    u.old_slots = buf.Copy(std::vector<int32_t>(capacity, 0));
    u.old_count = buf.Copy(std::vector<int32_t>{0});
    u.selected = buf.Copy(selected);
    u.n_selected = capacity;
    u.staged_rank = buf.Copy(ranks);
    u.selected_rows = reinterpret_cast<const Half*>(buf.Copy(staged));
    u.rows = buf.Zeros<Half>(size_t(capacity) * row);
    u.new_tokens = buf.Zeros<int32_t>(capacity);
    u.new_used = buf.Zeros<int32_t>(capacity);
    u.new_slots = buf.Zeros<int32_t>(capacity);
    u.new_count = buf.Zeros<int32_t>(1);
    u.selected_slots = buf.Zeros<int32_t>(capacity);
    u.now = 1;
    u.capacity = capacity;
    ASSERT_TRUE(cuda::UpdateRowCaches(&u, 1, d, HostRowFormat::kInt8, nullptr, nullptr).ok());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const std::vector<int32_t> slots = testing::Download(u.selected_slots, capacity);
    const std::vector<Half> cache = testing::Download(u.rows, size_t(capacity) * row);
    for (int32_t j = 0; j < capacity; ++j) {
      std::vector<Half> want(row);
      DecodeHostRows(HostRowFormat::kInt8, &staged[size_t(ranks[j]) * stored_bytes], 1, d, want.data());
      ASSERT_TRUE(slots[j] >= 0 && slots[j] < capacity);
      ASSERT_TRUE(std::equal(want.begin(), want.end(), cache.begin() + size_t(slots[j]) * row)) << "d " << d << " row " << j;
    }
  }
  // head_dim the int8 kernels cannot take: refused before any launch.
  cuda::WriteTask none{};
  EXPECT_EQ(cuda::WriteRows(&none, 1, 40, HostRowFormat::kInt8, 64, nullptr).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(cuda::WriteRows(&none, 1, 512, HostRowFormat::kInt8, 64, nullptr).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(cuda::WriteRows(&none, 1, 64, static_cast<HostRowFormat>(7), 64, nullptr).code(), StatusCode::kInvalidArgument);
#endif
}

// The cache update at the bench's shape (KvOptions' 1024-row caches, head_dim 128, 64 or 160
// rows selected, the copy engine's int8 staged rows), which the other tests reach only in part:
// full old lists whose recency keys differ in few bytes (use marks a few fetches apart) or in
// more (tokens past 65535, marks around zero), so that the keep threshold's radix select skips
// different bytes; a third of each selection hits; the misses' int8 rows decoded beside the hits'
// rows kept where they were. Besides them: a 128-row cache (two selections), a fresh one, one
// whose selection fills it (keep 0), and padded selections. Against the CPU rule, as above.
TEST(CudaFetchTest, FullCacheUpdatesWithInt8StagedRowsEqualTheCpuRule) {
  SPECACHE_REQUIRE_CUDA_DEVICE();
#ifdef SPECACHE_TEST_HAVE_CUDA
  std::mt19937 rng(53);
  const int d = 128;
  const size_t row = 2 * size_t(d);
  const int64_t stored_bytes = HostRowBytes(HostRowFormat::kInt8, d);
  DeviceBuffers buf;
  std::vector<cuda::CacheUpdateTask> tasks;
  std::vector<WantedCache> want;
  std::vector<std::vector<int32_t>> padded_selections;
  uint64_t want_fetched = 0, want_reused = 0;
  const int n_tasks = 48;
  for (int i = 0; i < n_tasks; ++i) {
    const int capacity = i == 5 ? 160 : i % 8 == 3 ? 128 : 1024;
    const int k = i % 2 == 0 || capacity == 128 ? 64 : 160;
    const int32_t universe = i % 3 == 0 ? 70000 : 8192;
    const bool around_zero = i % 5 == 4;  // use marks from -16: their keys differ in every high byte
    const int64_t now = around_zero ? 3 : 1000;
    RowCacheEntries old;
    old.tokens = i == 7 ? std::vector<int32_t>{} : RandomTokens(universe, capacity, rng);
    for (size_t j = 0; j < old.tokens.size(); ++j) {
      old.used.push_back(around_zero ? static_cast<int64_t>(rng() % 19) - 16
                                     : now - 1 - static_cast<int64_t>(rng() % 16));
    }
    std::set<int32_t> chosen;
    const int wanted = std::min(i == 5 ? capacity : k, capacity);
    while (static_cast<int>(chosen.size()) < wanted / 3 && !old.tokens.empty()) {
      chosen.insert(old.tokens[rng() % old.tokens.size()]);
    }
    while (static_cast<int>(chosen.size()) < wanted) chosen.insert(static_cast<int32_t>(rng() % universe));
    const std::vector<int32_t> selected(chosen.begin(), chosen.end());
    std::vector<int32_t> slots(capacity);
    for (int32_t r = 0; r < capacity; ++r) slots[r] = r;
    std::shuffle(slots.begin(), slots.end(), rng);
    const auto rows = testing::RandomHalves(size_t(capacity) * row, rng);
    // The misses' rows: stored int8 rows of random values, in a shuffled order behind others.
    const std::vector<Half> values = ScaledHalves(selected.size() * 2, d, rng);
    std::vector<uint8_t> stored(selected.size() * stored_bytes);
    EncodeHostRows(HostRowFormat::kInt8, values.data(), static_cast<int64_t>(selected.size()), d, stored.data());
    RowCacheEntries cache = old;
    std::vector<bool> hit;
    const auto sources = UpdateRowCache(&cache, selected, now, static_cast<size_t>(capacity), &hit);
    auto old_index = [&](int32_t token) {
      return std::lower_bound(old.tokens.begin(), old.tokens.end(), token) - old.tokens.begin();
    };
    std::vector<int32_t> ranks(selected.size()), order;
    for (size_t j = 0; j < selected.size(); ++j) {
      if (hit[j]) ranks[j] = -2 - static_cast<int32_t>(old_index(selected[j]));
      else order.push_back(static_cast<int32_t>(j));
      (hit[j] ? want_reused : want_fetched) += 1;
    }
    std::shuffle(order.begin(), order.end(), rng);
    const size_t before = 1 + rng() % 3;
    std::vector<uint8_t> staged((before + order.size()) * stored_bytes, 0xCD);
    for (size_t r = 0; r < order.size(); ++r) {
      ranks[order[r]] = static_cast<int32_t>(before + r);
      std::memcpy(&staged[(before + r) * stored_bytes], &stored[order[r] * stored_bytes], size_t(stored_bytes));
    }
    WantedCache w{std::move(cache), {}, {}};
    for (int64_t src : sources) {
      const int64_t from_old = src < 0 ? -1 - src : hit[src] ? old_index(selected[src]) : -1;
      std::vector<Half> r(row);
      if (from_old >= 0) {
        std::copy_n(&rows[size_t(slots[from_old]) * row], row, r.begin());
      } else {
        DecodeHostRows(HostRowFormat::kInt8, &stored[size_t(src) * stored_bytes], 1, d, r.data());
      }
      w.rows.insert(w.rows.end(), r.begin(), r.end());
      w.old_slot.push_back(from_old >= 0 ? slots[from_old] : -1);
    }
    want.push_back(std::move(w));
    std::vector<int32_t> padded = selected;
    if (i % 4 == 1 && padded.size() + 8 <= size_t(capacity)) padded.resize(padded.size() + 8, cuda::kNoToken);
    ranks.resize(padded.size(), -1);
    cuda::CacheUpdateTask t = OldCacheTask(buf, old, slots, rows, capacity);
    t.selected = buf.Copy(padded);
    t.n_selected = static_cast<int32_t>(padded.size());
    t.staged_rank = buf.Copy(ranks);
    t.selected_rows = reinterpret_cast<const Half*>(buf.Copy(staged));
    t.selected_slots = buf.Copy(std::vector<int32_t>(padded.size(), -7));
    t.now = static_cast<int32_t>(now);
    tasks.push_back(t);
    padded_selections.push_back(std::move(padded));
  }
  ASSERT_NO_FATAL_FAILURE(UpdateAndExpectCounts(buf, tasks, d, HostRowFormat::kInt8, want_fetched, want_reused));
  for (int i = 0; i < n_tasks; ++i) ExpectUpdated(tasks[i], want[i], padded_selections[i], row, i);
#endif
}

// SumCacheCounts (AgentStats' row cache sizes): many caches' counts summed in one launch equal the
// host's sum, for one cache, several thousand (the 176 x 32 layers of the step bench), more counts
// than the launch's threads (40000 x 8: the grid strides), none; with the call's own scratch and
// with the caller's (reused across calls, as the RowFetcher does).
TEST(CudaFetchTest, CacheCountsSumLikeTheHost) {
  SPECACHE_REQUIRE_CUDA_DEVICE();
#ifdef SPECACHE_TEST_HAVE_CUDA
  std::mt19937 rng(61);
  DeviceBuffers scratch_buf;
  constexpr int kMostCaches = 40000;
  const cuda::CountSumScratch scratch{scratch_buf.Allocate<const int32_t*>(kMostCaches),
                                      scratch_buf.Allocate<unsigned long long>(1)};
  for (const int n_caches : {1, 7, 5632, kMostCaches}) {
    for (const int per_cache : {1, 8}) {
      // Every cache's counts in one upload; each cache points at its part of it.
      std::vector<int32_t> host(static_cast<size_t>(n_caches) * per_cache);
      int64_t want = 0;
      for (int32_t& v : host) want += v = static_cast<int32_t>(rng() % (cuda::kMaxCacheRows + 1));
      DeviceBuffers buf;
      const int32_t* all = buf.Copy(host);
      ASSERT_NE(all, nullptr);
      std::vector<const int32_t*> counts;
      for (int c = 0; c < n_caches; ++c) counts.push_back(all + int64_t{c} * per_cache);
      int64_t got = -1;
      ASSERT_TRUE(cuda::SumCacheCounts(counts.data(), n_caches, per_cache, &got).ok());
      EXPECT_EQ(got, want) << n_caches << " caches of " << per_cache;
      got = -1;
      ASSERT_TRUE(cuda::SumCacheCounts(counts.data(), n_caches, per_cache, &got, scratch).ok());
      EXPECT_EQ(got, want) << n_caches << " caches of " << per_cache << ", the caller's scratch";
    }
  }
  int64_t none = -1;
  ASSERT_TRUE(cuda::SumCacheCounts(nullptr, 0, 8, &none).ok());
  EXPECT_EQ(none, 0);
  EXPECT_FALSE(cuda::SumCacheCounts(nullptr, -1, 8, &none).ok());
  const int32_t* one = scratch_buf.Allocate<int32_t>(1);
  EXPECT_FALSE(cuda::SumCacheCounts(&one, 1, 1, &none, {scratch.lists, nullptr}).ok()) << "half a scratch";
#endif
}

}  // namespace
}  // namespace specache
