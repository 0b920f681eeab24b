#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "specache/cuda_quantize.h"
#include "specache/cuda_replica.h"
#include "specache/cuda_tensors.h"
#include "specache/quantizer.h"
#include "cuda_status.h"
#include "mma_codes.h"

namespace specache::cuda {
namespace {

// Block-table entries written on the device in one launch for many replicas (kernel parameters).
constexpr int kTableWrites = 128;
struct TableWrites {
  uint8_t** slot[kTableWrites];
  uint8_t* block[kTableWrites];
  int n = 0;
};

__global__ void WriteTableKernel(TableWrites w) {
  if (static_cast<int>(threadIdx.x) < w.n) *w.slot[threadIdx.x] = w.block[threadIdx.x];
}

Status WriteTables(const std::vector<std::pair<uint8_t**, uint8_t*>>& writes, cudaStream_t stream) {
  for (size_t first = 0; first < writes.size(); first += kTableWrites) {
    TableWrites w;
    w.n = static_cast<int>(std::min<size_t>(kTableWrites, writes.size() - first));
    for (int i = 0; i < w.n; ++i) w.slot[i] = writes[first + i].first, w.block[i] = writes[first + i].second;
    WriteTableKernel<<<1, kTableWrites, 0, stream>>>(w);
  }
  return CudaStatus(cudaGetLastError(), "block table");
}

}  // namespace

// The fixed device arrays of one replica: the key residual, the value window and the block table,
// in one allocation.
DeviceHeadReplica::Buffers::~Buffers() {
  if (memory) cudaFree(memory);
}

Result<std::unique_ptr<DeviceHeadReplica>> DeviceHeadReplica::Create(const ReplicaParams& p, int32_t capacity,
                                                                     void* stream, DeviceBlockPool* pool,
                                                                     bool mma_codes, DecodePlan* tasks) {
  const bool packed_k = IsPackedBitWidth(p.key_bits), packed_v = IsPackedBitWidth(p.value_bits);
  if ((!packed_k && p.key_bits != 16) || (!packed_v && p.value_bits != 16)) {
    return Status::InvalidArgument("bits must be 1, 2, 4 or 16");
  }
  if (p.group_size <= 0 || p.group_size % 32 || p.group_size > 128 || p.residual_tokens % p.group_size ||
      p.head_dim % p.group_size || p.head_dim % 32) {
    return Status::InvalidArgument("group_size must be 32..128 (x32), divide head_dim and R; head_dim a multiple of 32");
  }
  if (capacity <= 0) return Status::InvalidArgument("capacity must be positive");
  if (mma_codes && !MmaCodesEligible(p)) {
    return Status::InvalidArgument("mma codes need 1-bit keys and values, G = 32 and head_dim 64 or 128");
  }
  std::unique_ptr<DeviceHeadReplica> r(new DeviceHeadReplica());
  r->mma_codes_ = mma_codes;
  r->params_ = p;
  r->capacity_ = capacity;
  r->stream_ = stream;
  r->tasks_ = tasks;
  // Replicas with mma codes keep each group's parts together (the lean path copies a group as one
  // piece); the pool's blocks have the same size either way.
  const ReplicaBlockLayout layout = MakeReplicaBlockLayout(p, mma_codes);
  r->layout_ = layout;
  r->max_blocks_ = (capacity + layout.block_tokens - 1) / layout.block_tokens;
  if (pool == nullptr) {  // a pool of its own, for its whole capacity
    SPECACHE_ASSIGN_OR_RETURN(r->own_pool_, DeviceBlockPool::Create(p, int64_t{r->max_blocks_} * layout.bytes));
    pool = r->own_pool_.get();
  } else if (layout.bytes != pool->layout().bytes || layout.block_tokens != pool->layout().block_tokens) {
    return Status::InvalidArgument("the device pool was made for other replica parameters");
  }
  r->pool_ = pool;
  r->blocks_.reserve(r->max_blocks_);
  Buffers& b = r->b_;
  const size_t row = size_t(p.head_dim) * sizeof(Half), R = p.residual_tokens;
  const size_t window_at = R * row, table_at = (4 * R * row + 255) / 256 * 256;
  const size_t bound_at = table_at + size_t(r->max_blocks_) * sizeof(uint8_t*);
  b.bytes = static_cast<int64_t>(bound_at + sizeof(float));
  SPECACHE_RETURN_IF_ERROR(CudaStatus(cudaMalloc(&b.memory, static_cast<size_t>(b.bytes)), "replica buffers"));
  auto* base = static_cast<uint8_t*>(b.memory);
  b.key_residual = reinterpret_cast<Half*>(base);
  b.window = reinterpret_cast<Half*>(base + window_at);
  b.table = reinterpret_cast<uint8_t**>(base + table_at);
  b.key_scale_bound = reinterpret_cast<float*>(base + bound_at);
  if (mma_codes) {  // read only through the view of a replica with mma codes
    SPECACHE_RETURN_IF_ERROR(CudaStatus(
        cudaMemsetAsync(b.key_scale_bound, 0, sizeof(float), static_cast<cudaStream_t>(stream)), "key scale bound"));
  }
  return Result<std::unique_ptr<DeviceHeadReplica>>(std::move(r));
}

DeviceHeadReplica::~DeviceHeadReplica() {
  for (uint8_t* block : blocks_) pool_->Give(block);
}

int32_t DeviceHeadReplica::BlocksFor(int32_t tokens) const {
  const int32_t T = pool_->layout().block_tokens;
  return (tokens + T - 1) / T;
}

Status DeviceHeadReplica::Reserve(const std::vector<DeviceHeadReplica*>& replicas, int32_t extra_tokens) {
  if (replicas.empty()) return Status::Ok();
  if (extra_tokens < 0) return Status::InvalidArgument("negative token count");
  // Capacity first, then every block from the pool at once: all or nothing.
  int64_t need = 0;
  for (const DeviceHeadReplica* r : replicas) {
    if (extra_tokens > r->capacity_ - r->length_) {
      return Status::ResourceExhausted("replica capacity of " + std::to_string(r->capacity_) + " tokens reached");
    }
    if (r->pool_ != replicas[0]->pool_ || r->stream_ != replicas[0]->stream_) {
      return Status::InvalidArgument("replicas reserved together must share their pool and stream");
    }
    need += std::max<int64_t>(0, r->BlocksFor(r->length_ + extra_tokens) - static_cast<int64_t>(r->blocks_.size()));
  }
  if (need == 0) return Status::Ok();
  if (need > (int64_t{1} << 30)) return Status::ResourceExhausted("too many replica blocks asked at once");
  std::vector<uint8_t*> taken;
  SPECACHE_RETURN_IF_ERROR(replicas[0]->pool_->Take(static_cast<int>(need), &taken));
  std::vector<std::pair<uint8_t**, uint8_t*>> writes;
  writes.reserve(taken.size());
  size_t next = 0;
  for (DeviceHeadReplica* r : replicas) {
    for (int32_t i = static_cast<int32_t>(r->blocks_.size()); i < r->BlocksFor(r->length_ + extra_tokens); ++i) {
      r->blocks_.push_back(taken[next]);
      writes.emplace_back(r->b_.table + i, taken[next]);
      ++next;
    }
  }
  return WriteTables(writes, static_cast<cudaStream_t>(replicas[0]->stream_));
}

int32_t DeviceHeadReplica::reserved_tokens() const {
  return std::min<int32_t>(capacity_, static_cast<int32_t>(blocks_.size()) * layout_.block_tokens);
}

void DeviceHeadReplica::ReleaseUnused() {
  const int32_t keep = BlocksFor(length_);
  while (static_cast<int32_t>(blocks_.size()) > keep) {
    pool_->Give(blocks_.back());
    blocks_.pop_back();
  }
}

uint8_t* DeviceHeadReplica::BlockAt(int32_t token) const { return blocks_[token / pool_->layout().block_tokens]; }

uint32_t* DeviceHeadReplica::KeyCodesAt(int32_t group) const {
  const ReplicaBlockLayout& l = layout_;
  const int32_t token = group * params_.group_size, in = (token % l.block_tokens) / params_.group_size;
  return reinterpret_cast<uint32_t*>(
      BlockAt(token) + KeyPartOffset(l, l.key_codes, in, int64_t{params_.head_dim} * WordsPerGroup(params_.group_size, params_.key_bits) * 4));
}
Half* DeviceHeadReplica::KeyScaleAt(int32_t group, int32_t part_offset) const {
  const ReplicaBlockLayout& l = layout_;
  const int32_t token = group * params_.group_size, in = (token % l.block_tokens) / params_.group_size;
  return reinterpret_cast<Half*>(BlockAt(token) + KeyPartOffset(l, part_offset, in, int64_t{params_.head_dim} * 2));
}
Half* DeviceHeadReplica::KeyHalfAt(int32_t token) const {
  const ReplicaBlockLayout& l = layout_;
  return reinterpret_cast<Half*>(BlockAt(token) + l.key_half) + size_t(token % l.block_tokens) * params_.head_dim;
}
ValueTokenTask DeviceHeadReplica::ValueSlot(int32_t token, const Half* value) const {
  const ReplicaBlockLayout& l = layout_;
  const int vg = params_.head_dim / params_.group_size;
  const int32_t in = token % l.block_tokens;
  uint8_t* block = BlockAt(token);
  return {value,
          reinterpret_cast<uint32_t*>(block + ValuePartOffset(l, l.value_codes, in, int64_t{vg} * WordsPerGroup(params_.group_size, params_.value_bits) * 4)),
          reinterpret_cast<Half*>(block + ValuePartOffset(l, l.value_scale, in, int64_t{vg} * 2)),
          reinterpret_cast<Half*>(block + ValuePartOffset(l, l.value_zero, in, int64_t{vg} * 2))};
}
Half* DeviceHeadReplica::ValueHalfAt(int32_t token) const {
  const ReplicaBlockLayout& l = layout_;
  return reinterpret_cast<Half*>(BlockAt(token) + l.value_half) + size_t(token % l.block_tokens) * params_.head_dim;
}

Status DeviceHeadReplica::Append(const Half* keys, const Half* values, int32_t n) {
  if (n < 0) return Status::InvalidArgument("negative token count");
  SPECACHE_RETURN_IF_ERROR(Reserve({this}, n));
  const ReplicaParams& p = params_;
  const int d = p.head_dim, R = p.residual_tokens, G = p.group_size;
  const cudaStream_t s = static_cast<cudaStream_t>(stream_);
  Buffers& b = b_;
  const size_t row = static_cast<size_t>(d) * sizeof(Half);
  // The final state of HeadReplica's token-by-token rule, with a few launches per replica block
  // instead of several per R tokens (a prompt of 8K tokens was ~640 launches per head and layer):
  // each key group and each value token is quantized from its own elements only, so only where
  // the rule draws its boundaries matters, not when.
  //
  // Keys: the rule flushes the residual whenever it holds R tokens, so groups cover [jR, (j+1)R).
  // The residual is topped up first; whole R-token runs of the input after it are stored
  // straight from the input; what is left (< R) stays in the residual.
  int32_t k_done = 0;
  if (residual_ > 0) {
    k_done = std::min<int32_t>(n, R - residual_);
    SPECACHE_RETURN_IF_ERROR(CudaStatus(cudaMemcpyAsync(b.key_residual + static_cast<size_t>(residual_) * d, keys,
                                                  k_done * row, cudaMemcpyDeviceToDevice, s), "key residual copy"));
    residual_ += k_done;
    if (residual_ == R) SPECACHE_RETURN_IF_ERROR(FlushKeyGroups());
  }
  const int32_t whole = (n - k_done) / R * R;
  if (whole > 0) {
    SPECACHE_RETURN_IF_ERROR(StoreKeyGroups(keys + static_cast<size_t>(k_done) * d, whole / G));
    k_done += whole;
  }
  if (k_done < n) {  // then residual_ is 0 (flushed, or never topped up)
    SPECACHE_RETURN_IF_ERROR(CudaStatus(cudaMemcpyAsync(b.key_residual + static_cast<size_t>(residual_) * d,
                                                  keys + static_cast<size_t>(k_done) * d, (n - k_done) * row,
                                                  cudaMemcpyDeviceToDevice, s), "key residual copy"));
    residual_ += n - k_done;
  }
  // Values: the rule keeps the newest min(count, R) in the window and quantizes the rest in token
  // order: the window's oldest first, then the input's oldest, straight from the input.
  const int32_t keep = std::min<int32_t>(window_count_ + n, R);
  const int32_t retire = window_count_ + n - keep;
  const int32_t retire_window = std::min(window_count_, retire), retire_input = retire - retire_window;
  if (retire_window > 0) SPECACHE_RETURN_IF_ERROR(RetireOldestValues(retire_window));
  if (window_count_ == 0) window_begin_ = 0;  // nothing to keep: no compaction needed
  if (retire_input > 0) SPECACHE_RETURN_IF_ERROR(StoreValues(values, retire_input));
  // The window now holds at most R - (n - retire_input) rows from window_begin_ <= 2R: the rest of
  // the input fits in its 3R rows.
  const int32_t add = n - retire_input;
  if (add > 0) {
    SPECACHE_RETURN_IF_ERROR(CudaStatus(cudaMemcpyAsync(b.window + static_cast<size_t>(window_begin_ + window_count_) * d,
                                                  values + static_cast<size_t>(retire_input) * d, add * row,
                                                  cudaMemcpyDeviceToDevice, s), "value window copy"));
    window_count_ += add;
  }
  if (window_begin_ > R) SPECACHE_RETURN_IF_ERROR(CompactWindow());
  length_ += n;
  return PackWholeGroups();
}

void DeviceHeadReplica::TakeWholeGroups(std::vector<MmaGroupTask>* tasks) {
  if (!mma_codes_) return;
  const int32_t whole = std::min(quantized_keys(), quantized_values_) / 32;
  const ReplicaBlockLayout& l = layout_;
  for (; packed_groups_ < whole; ++packed_groups_) {
    const ValueTokenTask v = ValueSlot(packed_groups_ * 32, nullptr);
    tasks->push_back({KeyCodesAt(packed_groups_), KeyScaleAt(packed_groups_, l.key_scale),
                      KeyScaleAt(packed_groups_, l.key_zero), v.codes, v.scale, v.zero, b_.key_scale_bound});
  }
}

Status DeviceHeadReplica::PackWholeGroups() {
  std::vector<MmaGroupTask> tasks;
  TakeWholeGroups(&tasks);
  return tasks.empty() ? Status::Ok()
                       : PackMmaGroups(tasks.data(), static_cast<int>(tasks.size()), params_.head_dim, stream_, tasks_);
}

Status DeviceHeadReplica::FlushKeyGroups() {  // the full residual becomes R/G key groups, in one block
  SPECACHE_RETURN_IF_ERROR(StoreKeyGroups(b_.key_residual, params_.residual_tokens / params_.group_size));
  residual_ = 0;
  return Status::Ok();
}

Status DeviceHeadReplica::StoreKeyGroups(const Half* keys, int32_t groups) {
  std::vector<KeyGroupRun> runs;  // one launch for them all
  SPECACHE_RETURN_IF_ERROR(AddKeyGroupRuns(keys, groups, &runs));
  if (runs.empty()) return Status::Ok();  // fp16 keys, copied
  const ReplicaParams& p = params_;
  return QuantizeKeyGroupRuns(runs.data(), static_cast<int>(runs.size()), p.group_size, p.head_dim, p.key_bits, stream_);
}

Status DeviceHeadReplica::AddKeyGroupRuns(const Half* keys, int32_t groups, std::vector<KeyGroupRun>* runs) {
  const ReplicaParams& p = params_;
  const int d = p.head_dim, G = p.group_size;
  const ReplicaBlockLayout& l = layout_;
  // Groups in a run are contiguous: a block's (block_tokens = lcm(R, 128), a multiple of R), or
  // one group when the block's parts are interleaved by group.
  const int32_t per_run = l.group_bytes ? 1 : l.block_tokens / G;
  while (groups > 0) {
    const int32_t g = std::min<int32_t>(groups, per_run - key_groups_ % per_run);
    if (IsPackedBitWidth(p.key_bits)) {
      runs->push_back({keys, KeyCodesAt(key_groups_), KeyScaleAt(key_groups_, l.key_scale),
                       KeyScaleAt(key_groups_, l.key_zero), g});
    } else {
      SPECACHE_RETURN_IF_ERROR(CudaStatus(cudaMemcpyAsync(KeyHalfAt(key_groups_ * G), keys,
                                                    static_cast<size_t>(g) * G * d * sizeof(Half),
                                                    cudaMemcpyDeviceToDevice, static_cast<cudaStream_t>(stream_)),
                                    "fp16 key groups"));
    }
    keys += static_cast<size_t>(g) * G * d;
    key_groups_ += g;
    groups -= g;
  }
  return Status::Ok();
}

Status DeviceHeadReplica::StoreValues(const Half* values, int32_t m) {
  const ReplicaParams& p = params_;
  const int d = p.head_dim;
  // Slots in a run are contiguous: a block's, or a 32-token group's when the block's parts are
  // interleaved by group.
  const int32_t T = layout_.group_bytes ? 32 : layout_.block_tokens;
  std::vector<ValueTokenRun> runs;  // one launch for them all
  while (m > 0) {
    const int32_t n = std::min<int32_t>(m, T - quantized_values_ % T);
    if (IsPackedBitWidth(p.value_bits)) {
      const ValueTokenTask t = ValueSlot(quantized_values_, values);
      runs.push_back({values, t.codes, t.scale, t.zero, n});
    } else {
      SPECACHE_RETURN_IF_ERROR(CudaStatus(cudaMemcpyAsync(ValueHalfAt(quantized_values_), values, n * d * sizeof(Half),
                                                    cudaMemcpyDeviceToDevice, static_cast<cudaStream_t>(stream_)),
                                    "fp16 value copy"));
    }
    values += static_cast<size_t>(n) * d;
    quantized_values_ += n;
    m -= n;
  }
  if (runs.empty()) return Status::Ok();  // fp16 values, copied above
  return QuantizeValueTokenRuns(runs.data(), static_cast<int>(runs.size()), d, p.group_size, p.value_bits, stream_);
}

Status DeviceHeadReplica::RetireOldestValues(int32_t m) {  // the oldest m values leave the window
  SPECACHE_RETURN_IF_ERROR(StoreValues(b_.window + static_cast<size_t>(window_begin_) * params_.head_dim, m));
  window_begin_ += m;
  window_count_ -= m;
  return Status::Ok();
}

Status DeviceHeadReplica::CompactWindow() {  // [begin, begin + count) -> [0, count), no overlap as count <= R < begin
  RowCopy span;
  const int32_t rows = TakeWindowCompaction(&span);
  return CudaStatus(cudaMemcpyAsync(span.dst, span.src, static_cast<size_t>(rows) * params_.head_dim * sizeof(Half),
                              cudaMemcpyDeviceToDevice, static_cast<cudaStream_t>(stream_)),
              "value window compaction");
}

int32_t DeviceHeadReplica::TakeWindowCompaction(RowCopy* span) {
  const int d = params_.head_dim;
  *span = {b_.window + static_cast<size_t>(window_begin_) * d, b_.window};
  window_begin_ = 0;
  return window_count_;
}

Status DeviceHeadReplica::AppendTokens(const std::vector<DeviceHeadReplica*>& replicas,
                                       const std::vector<const Half*>& keys, const std::vector<const Half*>& values) {
  if (keys.size() != replicas.size() || values.size() != replicas.size()) {
    return Status::InvalidArgument("one key and one value row per replica");
  }
  if (replicas.empty()) return Status::Ok();
  const ReplicaParams& p = replicas[0]->params_;
  void* stream = replicas[0]->stream_;
  DecodePlan* plan = replicas[0]->tasks_;
  const int d = p.head_dim, R = p.residual_tokens;
  // Two passes over the replicas (at 99 x 8K a layer appends to 792 of them, each its own object):
  // the checks and the rows' copies, then the counters and the work that follows the copies.
  bool reserve = false;
  std::vector<RowCopy> copies;
  copies.reserve(2 * replicas.size());
  constexpr size_t kAhead = 8;  // replicas prefetched ahead
  for (size_t i = 0; i < std::min(kAhead, replicas.size()); ++i) replicas[i]->Prefetch();
  for (size_t i = 0; i < replicas.size(); ++i) {  // residual_ < R and window_count_ <= R: both rows have room
    if (i + kAhead < replicas.size()) replicas[i + kAhead]->Prefetch();
    const DeviceHeadReplica* r = replicas[i];
    const ReplicaParams& q = r->params_;
    if (q.head_dim != p.head_dim || q.key_bits != p.key_bits || q.value_bits != p.value_bits ||
        q.group_size != p.group_size || q.residual_tokens != p.residual_tokens || r->stream_ != stream ||
        std::memcmp(&r->layout_, &replicas[0]->layout_, sizeof(ReplicaBlockLayout)) != 0) {
      return Status::InvalidArgument("replicas of one batched append must share parameters, block layout and stream");
    }
    reserve = reserve || r->length_ >= r->reserved_tokens();
    copies.push_back({keys[i], r->b_.key_residual + static_cast<size_t>(r->residual_) * d});
    copies.push_back({values[i], r->b_.window + static_cast<size_t>(r->window_begin_ + r->window_count_) * d});
  }
  // Usually not needed: the engine's step reserved the blocks (the agent's BeginStep).
  if (reserve) SPECACHE_RETURN_IF_ERROR(Reserve(replicas, 1));
  // fp16 keys: a full residual's groups are copied into the blocks as the loop below finds them
  // (AddKeyGroupRuns), so the rows go first, in a launch of their own.
  const bool rows_first = !IsPackedBitWidth(p.key_bits);
  if (rows_first) {
    SPECACHE_RETURN_IF_ERROR(
        CopyRows(copies.data(), static_cast<int>(copies.size()), d * static_cast<int>(sizeof(Half)), stream, plan));
    copies.clear();
  }
  // The window's oldest value leaves it (steady state: one per token), for all replicas at once,
  // quantized in the rows' copies' launch (it reads the window's row R back from the one a copy
  // writes: R > 0, ValidateKvConfig); the groups made whole are packed after that, on the same
  // stream.
  const bool packed_values = IsPackedBitWidth(p.value_bits);
  std::vector<ValueRetireTask> retire;
  std::vector<RowCopy> retire_half;
  std::vector<DeviceHeadReplica*> compact;
  std::vector<MmaGroupTask> whole;
  std::vector<KeyGroupRun> key_runs;  // the full residuals' key groups, quantized together
  retire.reserve(replicas.size());
  for (DeviceHeadReplica* r : replicas) {
    ++r->residual_;
    ++r->window_count_;
    ++r->length_;
    if (r->residual_ == R) {  // FlushKeyGroups, its launch shared
      SPECACHE_RETURN_IF_ERROR(r->AddKeyGroupRuns(r->b_.key_residual, R / p.group_size, &key_runs));
      r->residual_ = 0;
    }
    if (r->window_count_ > R) {
      const Half* oldest = r->b_.window + static_cast<size_t>(r->window_begin_) * d;
      if (packed_values) {
        retire.push_back({oldest, r->b_.table, r->quantized_values_});  // its block found on the device
      } else {
        retire_half.push_back({oldest, r->ValueHalfAt(r->quantized_values_)});
      }
      ++r->quantized_values_;
      ++r->window_begin_;
      --r->window_count_;
      if (r->window_begin_ > R) compact.push_back(r);
    }
    r->TakeWholeGroups(&whole);
  }
  SPECACHE_RETURN_IF_ERROR(CopyRowsAndQuantizeValueTokensInBlocks(
      copies.data(), static_cast<int>(copies.size()), d * static_cast<int>(sizeof(Half)), retire.data(),
      static_cast<int>(retire.size()), replicas[0]->view(), stream, plan));
  // After the copies (a full residual's keys), before the groups made whole are packed
  // (PackMmaGroups reads the quantized keys).
  if (!key_runs.empty()) {
    SPECACHE_RETURN_IF_ERROR(QuantizeKeyGroupTasks(key_runs.data(), static_cast<int>(key_runs.size()), p.group_size, d,
                                                   p.key_bits, stream, plan));
  }
  if (!retire_half.empty()) {
    SPECACHE_RETURN_IF_ERROR(
        CopyRows(retire_half.data(), static_cast<int>(retire_half.size()), d * static_cast<int>(sizeof(Half)), stream,
                 plan));
  }
  // The windows' compactions after the retired values were read, copied together (a copy each
  // was a launch of its own per replica). A compaction follows a retire, which leaves R values in
  // the window: every span is R rows.
  if (!compact.empty()) {
    std::vector<RowCopy> spans(compact.size());
    for (size_t i = 0; i < compact.size(); ++i) {
      const int32_t rows = compact[i]->TakeWindowCompaction(&spans[i]);
      if (rows != R) return Status::Internal("a window compaction of " + std::to_string(rows) + " rows, not R");
    }
    SPECACHE_RETURN_IF_ERROR(
        CopyRows(spans.data(), static_cast<int>(spans.size()), R * d * static_cast<int>(sizeof(Half)), stream, plan));
  }
  if (whole.empty()) return Status::Ok();
  return PackMmaGroups(whole.data(), static_cast<int>(whole.size()), p.head_dim, stream, plan);
}

void DeviceHeadReplica::Prefetch() const {
  constexpr uintptr_t kLine = 64;
  const uintptr_t first = reinterpret_cast<uintptr_t>(this) & ~(kLine - 1);
  const uintptr_t end = reinterpret_cast<uintptr_t>(this) + sizeof(DeviceHeadReplica);
  for (uintptr_t line = first; line < end; line += kLine) __builtin_prefetch(reinterpret_cast<const void*>(line));
}

DeviceReplicaView DeviceHeadReplica::view() const {
  DeviceReplicaView v;
  v.head_dim = params_.head_dim;
  v.group_size = params_.group_size;
  v.key_bits = params_.key_bits;
  v.value_bits = params_.value_bits;
  v.length = length_;
  v.quantized_keys = quantized_keys();
  v.quantized_values = quantized_values_;
  v.layout = layout_;
  v.blocks = b_.table;
  v.residual_keys = b_.key_residual;
  v.window_values = b_.window + static_cast<size_t>(window_begin_) * params_.head_dim;
  v.mma_codes = mma_codes_ ? 1 : 0;
  v.key_scale_bound = mma_codes_ ? b_.key_scale_bound : nullptr;
  return v;
}

int64_t DeviceHeadReplica::device_bytes() const {
  const ReplicaParams& p = params_;
  const int64_t d = p.head_dim, G = p.group_size;
  int64_t bytes = int64_t{residual_} * d * 2 + int64_t{window_count_} * d * 2;
  bytes += IsPackedBitWidth(p.key_bits) ? int64_t{key_groups_} * d * (WordsPerGroup(G, p.key_bits) * 4 + 4)
                                        : int64_t{key_groups_} * G * d * 2;
  bytes += IsPackedBitWidth(p.value_bits) ? int64_t{quantized_values_} * (d / G) * (WordsPerGroup(G, p.value_bits) * 4 + 4)
                                          : int64_t{quantized_values_} * d * 2;
  return bytes;
}

int64_t DeviceHeadReplica::fixed_bytes() const { return b_.bytes; }

int64_t DeviceHeadReplica::reserved_bytes() const {
  return b_.bytes + static_cast<int64_t>(blocks_.size()) * pool_->layout().bytes;
}

}  // namespace specache::cuda
