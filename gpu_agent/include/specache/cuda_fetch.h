// The CUDA agent's data movement between the device and the source's host pages, read and
// written in place by the GPU's SMs (the pages are registered and mapped, cuda_gather.h):
//
// - FetchRows builds the next resident rows of many (sequence, layer, KV head) at once: row i is
//   the device copy of selected[i] when that token is resident already (a hit: no host traffic),
//   else its row read straight from the host page. The selection never leaves the device, so no
//   host round trip sits between the top-k and the fetch. Hits and misses are counted on the
//   device.
//   A task without pages (a source without zero-copy pages: the staged fetch, cuda/staged_fetch.h)
//   reads no host memory: the rows of its tokens that are not resident are in out_rows already,
//   left as they are and counted as fetched; the kernel copies the hits over their slots.
// - The copy-engine fetch (cuda/copy_engine_fetch.h) places no rows with FetchRows: ListMissedRows
//   tells the host which rows to gather (per slot, the selected token if the row cache lacks it,
//   else where the cache holds it, -2 - its index, written to mapped host memory); the host
//   copies the missed rows up in one copy, and the row cache's update (UpdateRowCaches) takes
//   each selected row by that rank: from the copy, or from the old cache.
// - UpdateRowCaches makes the next row cache: the selection plus the most recent old rows, and
//   tells the attention where each selected row landed (its slot): the attention substitutes the
//   selection's rows from the cache (DeviceDecodeRows::sub_slots), so no other copy is made.
//   A cache is a list (ascending tokens, each with its use mark and slot) and rows by slot: rows
//   never move; the update writes a new list and only the missed rows, into the slots of the
//   entries it evicts.
// - WriteRows appends the new tokens' K/V to the host pages (device-to-host stores).
//
// Pages follow full_precision_source.h: page p of a (sequence, layer) holds tokens
// [p * page_tokens, (p + 1) * page_tokens), laid out [kv_head][token][row], a row in the pages'
// format (host_rows.h: fp16 [K|V][head_dim], or int8 codes and scales, `page_rows`); `pages` are
// the GPU-visible page addresses. Rows on the device (resident, fetched, cached, written from) are
// fp16 [2][head_dim] whatever the pages hold: FetchRows decodes int8 rows as it reads them,
// WriteRows encodes them as it stores them, and the cache update decodes staged int8 rows, with
// the host's arithmetic (cuda/int8_rows.cuh: the same bytes and values as EncodeHostRows and
// DecodeHostRows). int8 rows need head_dim a multiple of 16 up to 256. Device pointers; streams as void*. Each call is one
// launch over all its tasks, which reach the kernel through a slot of `plan` (cuda_attention.h;
// the agent's plans here read in place, DecodePlan::SlotReads::kInPlace; one plan per thread of
// calls). A null plan is one of the call's own, which waits for the kernel before the call
// returns: for tests and one-off calls.
#pragma once

#include <cstdint>
#include <string>

#include "specache/half.h"
#include "specache/host_rows.h"
#include "specache/status.h"

namespace specache::cuda {

class DecodePlan;  // cuda_attention.h

// A selection may end in kNoToken entries (the adaptive budget's padding, cuda_topk.h): they are
// no rows, and FetchRows and UpdateRowCaches skip them.
struct FetchTask {
  const int32_t* selected = nullptr;    // [n_selected] ascending: the rows wanted next
  const int32_t* resident = nullptr;    // [n_resident] ascending: the rows on the device now
  // resident[j]'s row is resident_rows[resident_slots[j]] ([..][2][head_dim]: a row cache's rows,
  // UpdateRowCaches), or resident_rows[j] when resident_slots is null.
  const Half* resident_rows = nullptr;
  const int32_t* resident_slots = nullptr;
  Half* out_rows = nullptr;             // [n_selected][2][head_dim], not overlapping resident_rows
  const uint64_t* pages = nullptr;      // GPU-visible page addresses of the (sequence, layer), or null (staged)
  const int32_t* resident_count = nullptr;  // device memory: n_resident, when only the device knows it
  // Set by CopyEngineFetch::Stage (both or neither), for the cache update (CacheUpdateTask's
  // fields of the same names); FetchRows refuses a task with them: per slot i of [n_selected],
  // rank = staged_rank[i] (device memory) says where its row is: rank >= 0, staged_rows[rank]
  // ([..][2][head_dim], device memory); -2 - j (<= -2), the resident entry j (a hit); -1, no row
  // (padding). The ranks came from ListMissedRows' list, which searched the resident list once.
  const int32_t* staged_rank = nullptr;
  const Half* staged_rows = nullptr;  // rows as the pages store them (UpdateRowCaches' staged_rows)
  int32_t n_selected = 0;
  int32_t n_resident = 0;
  int32_t kv_head = 0;
};

// The row cache's update after a fetch (row_cache.h's rule, on the device): the new cache is the
// selection (used at `now`) plus the most recently used old entries that fit in `capacity`,
// ascending by token. Counts live on the device (the host never waits for them); the entries
// past the count hold kNoToken, so the whole cache can be handed to the attention as `capacity`
// substitutions (KvConfig::attend_resident) without the host knowing the count.
// A cache's rows stay in their slots of `rows`: an entry that stays or is selected again keeps its
// slot, and a missed row is written into a free one (an evicted entry's, or one never used). Its
// list, old and new, is [capacity] of each field: entries [0, count) live, their slots distinct,
// and the new list's slots past its count are the free slots, so that every list the update
// writes names each slot of [0, capacity) once. An old list of count 0 may hold anything (a fresh
// cache: every slot free).
// Missed row i comes from selected_rows[i] (FetchRows' output), or, with staged ranks (the
// copy-engine fetch), from selected_rows[rank]; the update counts those tasks' rows as fetched or
// reused (UpdateRowCaches' counters).
struct CacheUpdateTask {
  const int32_t* old_tokens = nullptr;  // [capacity] ascending to *old_count
  const int32_t* old_used = nullptr;    // [capacity]
  const int32_t* old_slots = nullptr;   // [capacity]
  const int32_t* old_count = nullptr;   // device
  const int32_t* selected = nullptr;    // [n_selected] ascending
  // [n_selected][2][head_dim] (FetchRows' output), or with staged_rank FetchTask::staged_rows.
  const Half* selected_rows = nullptr;
  const int32_t* staged_rank = nullptr;  // [n_selected] (FetchTask::staged_rank), or null
  Half* rows = nullptr;                 // [capacity][2][head_dim] by slot: read and written in place
  int32_t* new_tokens = nullptr;        // [capacity], none of the new list's arrays overlapping the old's
  int32_t* new_used = nullptr;          // [capacity]
  int32_t* new_slots = nullptr;         // [capacity]
  int32_t* new_count = nullptr;         // device
  // [n_selected], required: slot i receives the slot of selected[i]'s row in `rows` (-1 for the
  // adaptive budget's padding), for the attention (DeviceDecodeRows::sub_slots).
  int32_t* selected_slots = nullptr;
  int32_t n_selected = 0;
  int32_t now = 0;
  int32_t capacity = 0;                 // >= n_selected
};
// Above every token, and what cudaMemset(0x7f) writes. Attention ignores substitutions of tokens
// that are not quantized.
constexpr int32_t kNoToken = 0x7f7f7f7f;

struct WriteTask {
  const Half* keys = nullptr;    // row i at keys + i * stride
  const Half* values = nullptr;  // row i at values + i * stride
  const uint64_t* pages = nullptr;
  int64_t stride = 0;            // elements between consecutive rows of keys / values
  int32_t first_token = 0;
  int32_t n = 0;
  int32_t kv_head = 0;
};

// Counters FetchRows (or, for the copy-engine fetch, UpdateRowCaches) adds to (device memory).
struct FetchCounters {
  unsigned long long fetched;  // rows read from host pages
  unsigned long long reused;   // rows copied from the resident set
  unsigned long long selected;  // rows the adaptive budget kept (SelectTopKBatch adds them; FetchRows does not)
};

// The row formats the kernels below take: fp16, and int8 with head_dim a multiple of 16 (whole
// 16-value pieces a half) up to 256 (a row's lanes fit a warp). INVALID_ARGUMENT otherwise, and
// for a value outside the enum (CheckHostRowFormat). Pure host code: the agent checks its config
// with it before any device work.
inline Status CheckKernelRows(HostRowFormat rows, int head_dim) {
  SPECACHE_RETURN_IF_ERROR(CheckHostRowFormat(rows, head_dim));
  if (rows == HostRowFormat::kInt8 && (head_dim % 16 != 0 || head_dim > 256)) {
    return Status::InvalidArgument("int8 host rows on the GPU need head_dim a multiple of 16 up to 256; head_dim is " +
                                   std::to_string(head_dim));
  }
  return Status::Ok();
}

// max_blocks bounds the SMs the fetch takes from the layers it overlaps. head_dim: a multiple of 8;
// page_tokens: positive when a task has pages. page_rows: the pages' row format.
Status FetchRows(const FetchTask* tasks, int n_tasks, int head_dim, HostRowFormat page_rows, int page_tokens,
                 int max_blocks, FetchCounters* counters, void* stream, DecodePlan* plan = nullptr);
Status WriteRows(const WriteTask* tasks, int n_tasks, int head_dim, HostRowFormat page_rows, int page_tokens,
                 void* stream, DecodePlan* plan = nullptr);
// For each task i and slot j < n_selected: missed[i * stride + j] = selected[j] when that token
// is not in the task's resident list, else -2 - (its index in that list); padding stays
// kNoToken; slots j in [n_selected, stride) are not written. `missed` is device-visible memory
// (mapped pinned host memory for the copy-engine fetch); stride >= every task's n_selected.
Status ListMissedRows(const FetchTask* tasks, int n_tasks, int32_t stride, int32_t* missed, void* stream,
                      DecodePlan* plan = nullptr);
// One block per task; capacity at most kMaxCacheRows. counters (device memory, or null): the
// ranked tasks' rows fetched (staged) and reused (old cache) are added to it. staged_rows: the
// format of the ranked tasks' staged rows (the pages' rows as the copy engine moved them; int8
// ones are decoded into the cache); rows from FetchRows are fp16 whatever it says.
constexpr int kMaxCacheRows = 16384;
Status UpdateRowCaches(const CacheUpdateTask* tasks, int n_tasks, int head_dim, HostRowFormat staged_rows,
                       FetchCounters* counters, void* stream, DecodePlan* plan = nullptr);
// The sum of n_caches row caches' counts (counts[c] -> per_cache int32 in device memory, a
// CacheList's count: one per KV head), in one launch and three copies whatever n_caches is; for
// AgentStats, once the streams that update the caches are idle. Waits for the device; runs on the
// current device (the caches'). *sum is 0 after a failure. Scratch (device memory): `lists` holds
// at least n_caches pointers, `total` one counter; null scratch is the call's own (allocated and
// freed by it, which synchronises the device twice more).
struct CountSumScratch {
  const int32_t** lists = nullptr;
  unsigned long long* total = nullptr;
};
Status SumCacheCounts(const int32_t* const* counts, int n_caches, int per_cache, int64_t* sum,
                      CountSumScratch scratch = {});

}  // namespace specache::cuda
