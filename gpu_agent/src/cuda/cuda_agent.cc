// CUDA backend of the agent, first version. Every piece of math runs on the GPU through kernels
// that equal the CPU reference (quantization bit for bit, attention within float rounding, top-k
// exactly), with the same call protocol and fetch state machine as the CPU backend
// (cpu_agent.cc; both follow step_protocol.h).
// Not yet: the fetch overlapping later layers (it completes inside StartPrefetch, through pinned
// memory from the source), batched kernels across heads, zero-copy from registered daemon pages.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <string>

#include "specache/agent.h"
#include "specache/cuda_attention.h"
#include "specache/cuda_gather.h"
#include "specache/cuda_replica.h"
#include "specache/cuda_tensors.h"
#include "specache/cuda_topk.h"
#include "specache/device_probe.h"
#include "../step_protocol.h"

namespace specache {
namespace {

Status Cuda(cudaError_t err, const std::string& what) {
  if (err == cudaSuccess) return Status::Ok();
  cudaGetLastError();
  if (err == cudaErrorMemoryAllocation) return Status::ResourceExhausted(what + ": out of device memory");
  return Status::Unavailable(what + ": " + cudaGetErrorString(err));
}

// A device (or pinned host) array that only grows.
template <typename T, bool kPinned = false>
class Buffer {
 public:
  Buffer() = default;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  Buffer(Buffer&& o) noexcept : p_(o.p_), n_(o.n_) { o.p_ = nullptr, o.n_ = 0; }
  ~Buffer() { Free(); }
  Status Reserve(size_t n) {
    if (n <= n_) return Status::Ok();
    Free();
    void* p = nullptr;
    SPECACHE_RETURN_IF_ERROR(Cuda(kPinned ? cudaMallocHost(&p, n * sizeof(T)) : cudaMalloc(&p, n * sizeof(T)),
                                  kPinned ? "pinned buffer" : "device buffer"));
    p_ = static_cast<T*>(p);
    n_ = n;
    return Status::Ok();
  }
  T* get() const { return p_; }
  void swap(Buffer& o) { std::swap(p_, o.p_), std::swap(n_, o.n_); }

 private:
  void Free() {
    if (p_) kPinned ? cudaFreeHost(p_) : cudaFree(p_);
    p_ = nullptr;
    n_ = 0;
  }
  T* p_ = nullptr;
  size_t n_ = 0;
};

struct HeadState {
  std::unique_ptr<cuda::DeviceHeadReplica> replica;
  std::vector<int32_t> selected, resident;  // ascending
  Buffer<Half> rows, rows_next;             // [resident][2][head_dim]
  Buffer<int32_t> tokens;                   // resident tokens, on the device
};

struct SequenceState {
  std::vector<std::vector<HeadState>> heads;  // [layer][kv_head]
};

std::string Id(SequenceId id) { return std::to_string(id); }

class CudaAgent final : public Agent {
 public:
  CudaAgent(const ModelShape& shape, const KvConfig& config, FullPrecisionSource* source, const CudaAgentOptions& o)
      : shape_(shape), config_(config), source_(source), options_(o), protocol_(shape, config.mode) {
    params_ = {shape.head_dim, config.effective_key_bits(), config.effective_value_bits(), config.group_size,
               config.residual_tokens};
    scale_ = 1.0f / std::sqrt(static_cast<float>(shape.head_dim));
  }

  const ModelShape& shape() const override { return shape_; }
  const KvConfig& config() const override { return config_; }
  std::string_view backend_name() const override { return "cuda"; }

  Status AddSequence(SequenceId id) override {
    if (sequences_.count(id)) return Status::AlreadyExists("sequence " + Id(id) + " is already registered");
    SequenceState state;
    state.heads.resize(shape_.n_layers);
    for (auto& layer : state.heads) {
      layer.resize(shape_.n_kv_heads);
      for (HeadState& h : layer) {
        SPECACHE_ASSIGN_OR_RETURN(h.replica, cuda::DeviceHeadReplica::Create(params_, options_.capacity_tokens, nullptr));
      }
    }
    SPECACHE_RETURN_IF_ERROR(
        source_->CreateSequence(id, {shape_.n_layers, shape_.n_kv_heads, shape_.head_dim}).WithContext("source"));
    sequences_.emplace(id, std::move(state));
    protocol_.AddSequence(id);
    return Status::Ok();
  }

  Status ReleaseSequence(SequenceId id) override {
    if (!sequences_.count(id)) return Status::NotFound("sequence " + Id(id) + " is not registered");
    SPECACHE_RETURN_IF_ERROR(protocol_.CheckRelease(id));
    sequences_.erase(id);
    protocol_.RemoveSequence(id);
    return source_->ReleaseSequence(id).WithContext("source");
  }

  Result<int32_t> SequenceLength(SequenceId id) const override { return LengthAt(id, 0); }

  Status PrefillLayer(int layer, const PrefillBatch& batch) override;
  Status BeginStep(StepKind kind, std::span<const SequenceId> sequences) override;
  Status DecodeLayer(int layer, const DecodeRows& rows) override;
  Status StartPrefetch(int layer) override;
  Status WaitPrefetch(int layer) override;
  Status EndStep() override;
  void AbortStep() override;

  Result<std::vector<int32_t>> SelectedTokens(SequenceId id, int layer, int kv_head) const override {
    auto it = sequences_.find(id);
    if (it == sequences_.end()) return Status::NotFound("sequence " + Id(id) + " is not registered");
    SPECACHE_RETURN_IF_ERROR(protocol_.CheckHead(layer, kv_head));
    return it->second.heads[layer][kv_head].resident;
  }

  AgentStats stats() const override {
    AgentStats s = counters_;
    const int64_t row = 2 * int64_t{shape_.head_dim} * static_cast<int64_t>(sizeof(Half));
    for (const auto& [id, seq] : sequences_) {
      for (const auto& layer : seq.heads) {
        for (const HeadState& h : layer) {
          s.device_bytes += h.replica->device_bytes() + static_cast<int64_t>(h.resident.size()) * row;
          s.full_precision_bytes += int64_t{h.replica->length()} * row;
        }
      }
    }
    return s;
  }

 private:
  Status CheckLayer(int layer) const { return protocol_.CheckLayer(layer); }
  // Tokens of a sequence at a layer (the protocol's view of this backend's storage).
  Result<int32_t> LengthAt(SequenceId id, int layer) const {
    auto it = sequences_.find(id);
    if (it == sequences_.end()) return Status::NotFound("sequence " + Id(id) + " is not registered");
    return it->second.heads[layer][0].replica->length();
  }
  void AddFetchCounts(const FetchCounts& c) { specache::AddFetchCounts(c, shape_.head_dim, &counters_); }
  // Copies `rows` rows of `width` floats from a strided device tensor into a packed one (or back).
  static Status Copy2D(float* dst, size_t dst_pitch, const float* src, size_t src_pitch, size_t width, size_t rows) {
    return Cuda(cudaMemcpy2DAsync(dst, dst_pitch * sizeof(float), src, src_pitch * sizeof(float), width * sizeof(float),
                                  rows, cudaMemcpyDeviceToDevice, nullptr),
                "strided copy");
  }
  // Writes rows [n][2][d] of (layer, head) to the source at first_token, from device K/V halves.
  Status AppendToSource(SequenceId id, int layer, int h, int32_t first_token, const Half* k, const Half* v, int32_t n);
  // Makes `selected` resident: reused rows move on the device, the rest come from the source.
  Status Fetch(SequenceId id, int layer, int kv_head, HeadState* h, FetchCounts* counts);
  // The top-k of `probs` ([group][n_candidates] on the device) into h->selected.
  Status Select(int32_t n_candidates, HeadState* h);

  ModelShape shape_;
  KvConfig config_;
  FullPrecisionSource* source_;
  CudaAgentOptions options_;
  ReplicaParams params_;
  float scale_ = 1.0f;
  std::map<SequenceId, SequenceState> sequences_;
  AgentStats counters_;
  StepProtocol protocol_;

  // Scratch, grown as needed.
  Buffer<float> q_, out_, scores_, probs_, topk_scratch_;
  Buffer<Half> k_, v_, kv_rows_, fetched_;
  Buffer<int32_t> topk_tokens_;
  Buffer<uint64_t> addresses_;
  Buffer<Half, true> host_rows_;
  Buffer<int32_t, true> host_tokens_;
};

Status CudaAgent::AppendToSource(SequenceId id, int layer, int h, int32_t first_token, const Half* k, const Half* v,
                                 int32_t n) {
  const size_t count = static_cast<size_t>(n) * 2 * shape_.head_dim;
  SPECACHE_RETURN_IF_ERROR(kv_rows_.Reserve(count));
  SPECACHE_RETURN_IF_ERROR(host_rows_.Reserve(count));
  SPECACHE_RETURN_IF_ERROR(cuda::InterleaveKv(k, v, n, shape_.head_dim, kv_rows_.get(), nullptr));
  SPECACHE_RETURN_IF_ERROR(
      Cuda(cudaMemcpy(host_rows_.get(), kv_rows_.get(), count * sizeof(Half), cudaMemcpyDeviceToHost), "rows to host"));
  return source_->AppendRows(id, layer, h, first_token, host_rows_.get(), n).WithContext("source");
}

Status CudaAgent::PrefillLayer(int layer, const PrefillBatch& batch) {
  SPECACHE_RETURN_IF_ERROR(protocol_.CheckPrefill(layer, batch, [this](SequenceId id, int l) { return LengthAt(id, l); }));
  const size_t n_seq = batch.sequences.size();
  const int d = shape_.head_dim, n_kv = shape_.n_kv_heads, n_q = shape_.n_q_heads, group = shape_.group_size();
  for (size_t s = 0; s < n_seq; ++s) {
    const SequenceId id = batch.sequences[s];
    SequenceState& st = sequences_.at(id);
    const int32_t first = batch.token_offsets[s], n = batch.token_offsets[s + 1] - first;
    SPECACHE_RETURN_IF_ERROR(k_.Reserve(size_t(n) * d));
    SPECACHE_RETURN_IF_ERROR(v_.Reserve(size_t(n) * d));
    for (int h = 0; h < n_kv; ++h) {
      const size_t kv_at = (size_t(first) * n_kv + h) * d;
      SPECACHE_RETURN_IF_ERROR(cuda::FloatRowsToHalf(batch.k + kv_at, n, d, int64_t{n_kv} * d, k_.get(), nullptr));
      SPECACHE_RETURN_IF_ERROR(cuda::FloatRowsToHalf(batch.v + kv_at, n, d, int64_t{n_kv} * d, v_.get(), nullptr));
      if (batch.out) {
        const size_t q_at = (size_t(first) * n_q + size_t(h) * group) * d, width = size_t(group) * d;
        SPECACHE_RETURN_IF_ERROR(q_.Reserve(size_t(n) * width));
        SPECACHE_RETURN_IF_ERROR(out_.Reserve(size_t(n) * width));
        SPECACHE_RETURN_IF_ERROR(scores_.Reserve(static_cast<size_t>(cuda::PrefillScratchFloats(n, group))));
        SPECACHE_RETURN_IF_ERROR(Copy2D(q_.get(), width, batch.q + q_at, size_t(n_q) * d, width, n));
        SPECACHE_RETURN_IF_ERROR(
            cuda::AttendPrefill(q_.get(), k_.get(), v_.get(), n, group, d, scale_, out_.get(), scores_.get(), nullptr));
        SPECACHE_RETURN_IF_ERROR(Copy2D(batch.out + q_at, size_t(n_q) * d, out_.get(), width, width, n));
      }
      SPECACHE_RETURN_IF_ERROR(AppendToSource(id, layer, h, 0, k_.get(), v_.get(), n));
      SPECACHE_RETURN_IF_ERROR(st.heads[layer][h].replica->Append(k_.get(), v_.get(), n));
    }
  }
  return Cuda(cudaDeviceSynchronize(), "prefill");
}

Status CudaAgent::BeginStep(StepKind kind, std::span<const SequenceId> sequences) {
  return protocol_.Begin(kind, RowsPerSequence(kind), sequences,
                         [this](SequenceId id, int layer) { return LengthAt(id, layer); });
}

Status CudaAgent::Select(int32_t n_candidates, HeadState* h) {
  const int group = shape_.group_size();
  const int k = std::min<int>(config_.top_k, n_candidates);
  h->selected.assign(static_cast<size_t>(std::max(k, 0)), 0);
  if (k <= 0) return Status::Ok();
  SPECACHE_RETURN_IF_ERROR(topk_tokens_.Reserve(k));
  SPECACHE_RETURN_IF_ERROR(topk_scratch_.Reserve(n_candidates));
  SPECACHE_RETURN_IF_ERROR(cuda::SelectTopK(probs_.get(), 1, group, n_candidates, config_.top_k, config_.reduction,
                                            topk_tokens_.get(), topk_scratch_.get(), nullptr));
  return Cuda(cudaMemcpy(h->selected.data(), topk_tokens_.get(), k * sizeof(int32_t), cudaMemcpyDeviceToHost),
              "top-k tokens to host");
}

Status CudaAgent::Fetch(SequenceId id, int layer, int kv_head, HeadState* h, FetchCounts* counts) {
  const size_t row = 2 * static_cast<size_t>(shape_.head_dim);
  const size_t n = h->selected.size();
  std::vector<int32_t> missing;
  std::vector<uint64_t> sources(n);
  size_t r = 0;
  for (size_t i = 0; i < n; ++i) {  // both lists ascending
    while (r < h->resident.size() && h->resident[r] < h->selected[i]) ++r;
    if (r < h->resident.size() && h->resident[r] == h->selected[i]) {
      sources[i] = reinterpret_cast<uint64_t>(h->rows.get() + r * row);
    } else {
      sources[i] = missing.size();  // index into the fetched rows, resolved below
      missing.push_back(h->selected[i]);
      sources[i] |= uint64_t{1} << 63;
    }
  }
  if (!missing.empty()) {
    SPECACHE_RETURN_IF_ERROR(host_rows_.Reserve(missing.size() * row));
    SPECACHE_RETURN_IF_ERROR(fetched_.Reserve(missing.size() * row));
    SPECACHE_RETURN_IF_ERROR(source_->ReadRows(id, layer, kv_head, missing.data(), static_cast<int32_t>(missing.size()),
                                               host_rows_.get())
                                 .WithContext("fetching rows of sequence " + Id(id)));
    SPECACHE_RETURN_IF_ERROR(Cuda(cudaMemcpy(fetched_.get(), host_rows_.get(), missing.size() * row * sizeof(Half),
                                             cudaMemcpyHostToDevice),
                                  "fetched rows to device"));
  }
  for (uint64_t& s : sources) {
    if (s >> 63) s = reinterpret_cast<uint64_t>(fetched_.get() + (s & ~(uint64_t{1} << 63)) * row);
  }
  if (n > 0) {
    SPECACHE_RETURN_IF_ERROR(h->rows_next.Reserve(n * row));
    SPECACHE_RETURN_IF_ERROR(addresses_.Reserve(n));
    SPECACHE_RETURN_IF_ERROR(Cuda(cudaMemcpy(addresses_.get(), sources.data(), n * sizeof(uint64_t), cudaMemcpyHostToDevice),
                                  "row addresses"));
    // One gather builds the new resident set from the old one and the fetched rows.
    SPECACHE_RETURN_IF_ERROR(cuda::LaunchGatherRows(addresses_.get(), h->rows_next.get(), static_cast<int64_t>(n),
                                                    static_cast<int>(row * sizeof(Half)), 64, nullptr));
    SPECACHE_RETURN_IF_ERROR(h->tokens.Reserve(n));
    SPECACHE_RETURN_IF_ERROR(Cuda(cudaMemcpy(h->tokens.get(), h->selected.data(), n * sizeof(int32_t),
                                             cudaMemcpyHostToDevice),
                                  "resident tokens"));
    h->rows.swap(h->rows_next);
  }
  counts->selected += static_cast<int64_t>(n);
  counts->fetched += static_cast<int64_t>(missing.size());
  counts->reused += static_cast<int64_t>(n - missing.size());
  h->resident = h->selected;
  return Status::Ok();
}

Status CudaAgent::DecodeLayer(int layer, const DecodeRows& rows) {
  SPECACHE_RETURN_IF_ERROR(protocol_.BeforeDecode(layer));
  if (!rows.q || !rows.k || !rows.v || !rows.out) return Status::InvalidArgument("decode rows have a null tensor");
  const int d = shape_.head_dim, group = shape_.group_size(), n_kv = shape_.n_kv_heads, n_q = shape_.n_q_heads;
  const int n_rows = protocol_.rows();
  const bool nonspec = config_.mode == KvMode::kSpeCacheNonSpec;
  const bool selects = config_.mode == KvMode::kSpeCache || nonspec;
  const bool appends = protocol_.kind() == StepKind::kDecode;
  const int probs_row = protocol_.kind() == StepKind::kPreDecode ? 0 : (nonspec ? 0 : 1);
  const size_t width = size_t(group) * d;
  SPECACHE_RETURN_IF_ERROR(q_.Reserve(n_rows * width));
  SPECACHE_RETURN_IF_ERROR(out_.Reserve(n_rows * width));
  SPECACHE_RETURN_IF_ERROR(k_.Reserve(size_t(n_rows) * d));
  SPECACHE_RETURN_IF_ERROR(v_.Reserve(size_t(n_rows) * d));
  FetchCounts counts;
  for (size_t s = 0; s < protocol_.ids().size(); ++s) {
    const SequenceId id = protocol_.ids()[s];
    for (int h = 0; h < n_kv; ++h) {
      HeadState& head = sequences_.at(id).heads[layer][h];
      const size_t first_row = s * n_rows;
      const size_t q_at = (first_row * n_q + size_t(h) * group) * d, kv_at = (first_row * n_kv + h) * d;
      SPECACHE_RETURN_IF_ERROR(Copy2D(q_.get(), width, rows.q + q_at, size_t(n_q) * d, width, n_rows));
      SPECACHE_RETURN_IF_ERROR(cuda::FloatRowsToHalf(rows.k + kv_at, n_rows, d, int64_t{n_kv} * d, k_.get(), nullptr));
      SPECACHE_RETURN_IF_ERROR(cuda::FloatRowsToHalf(rows.v + kv_at, n_rows, d, int64_t{n_kv} * d, v_.get(), nullptr));
      const cuda::DeviceHeadReplica& rep = *head.replica;
      const int32_t n_qk = rep.quantized_keys();
      const int32_t n_candidates = TopKCandidates(config_, appends, rep.length(), n_qk);
      SPECACHE_RETURN_IF_ERROR(scores_.Reserve(size_t(n_rows) * group * (rep.length() + n_rows)));
      SPECACHE_RETURN_IF_ERROR(probs_.Reserve(size_t(group) * std::max<int32_t>(n_candidates, 1)));
      cuda::DeviceDecodeRows r;
      r.sub_tokens = head.tokens.get();
      r.sub_rows = head.rows.get();
      r.n_sub = static_cast<int32_t>(head.resident.size());
      r.q = q_.get();
      r.new_keys = k_.get();
      r.new_values = v_.get();
      r.n_rows = n_rows;
      r.n_heads = group;
      r.scale = scale_;
      r.out = out_.get();
      r.probs_row = probs_row;
      r.n_candidates = n_candidates;
      r.probs = selects ? probs_.get() : nullptr;
      r.scratch = scores_.get();
      if (nonspec) {
        cuda::DeviceDecodeRows plain = r;
        plain.n_sub = 0;
        SPECACHE_RETURN_IF_ERROR(cuda::AttendDecodeRows(rep.view(), plain, nullptr));
        SPECACHE_RETURN_IF_ERROR(Select(n_candidates, &head));
        SPECACHE_RETURN_IF_ERROR(Fetch(id, layer, h, &head, &counts));
        r.sub_tokens = head.tokens.get();
        r.sub_rows = head.rows.get();
        r.n_sub = static_cast<int32_t>(head.resident.size());
        r.probs = nullptr;
        SPECACHE_RETURN_IF_ERROR(cuda::AttendDecodeRows(rep.view(), r, nullptr));
      } else {
        SPECACHE_RETURN_IF_ERROR(cuda::AttendDecodeRows(rep.view(), r, nullptr));
        if (selects) SPECACHE_RETURN_IF_ERROR(Select(n_candidates, &head));
      }
      SPECACHE_RETURN_IF_ERROR(Copy2D(rows.out + q_at, size_t(n_q) * d, out_.get(), width, width, n_rows));
      if (appends) {
        SPECACHE_RETURN_IF_ERROR(AppendToSource(id, layer, h, rep.length(), k_.get(), v_.get(), 1));
        SPECACHE_RETURN_IF_ERROR(head.replica->Append(k_.get(), v_.get(), 1));
      }
    }
  }
  SPECACHE_RETURN_IF_ERROR(Cuda(cudaDeviceSynchronize(), "decode layer"));
  protocol_.AfterDecode(layer);
  AddFetchCounts(counts);
  return Status::Ok();
}

Status CudaAgent::StartPrefetch(int layer) {
  SPECACHE_ASSIGN_OR_RETURN(std::vector<size_t> which, protocol_.PrefetchList(layer));
  FetchCounts counts;
  for (size_t s : which) {
    const SequenceId id = protocol_.ids()[s];
    for (int h = 0; h < shape_.n_kv_heads; ++h) {
      SPECACHE_RETURN_IF_ERROR(Fetch(id, layer, h, &sequences_.at(id).heads[layer][h], &counts));
    }
  }
  AddFetchCounts(counts);
  SPECACHE_RETURN_IF_ERROR(Cuda(cudaDeviceSynchronize(), "prefetch"));
  protocol_.PrefetchStarted(layer, which);
  return Status::Ok();
}

Status CudaAgent::WaitPrefetch(int layer) {
  SPECACHE_RETURN_IF_ERROR(CheckLayer(layer));
  protocol_.Wait(layer);  // this version's fetch completed inside StartPrefetch
  return Status::Ok();
}

Status CudaAgent::EndStep() {
  SPECACHE_ASSIGN_OR_RETURN(bool decode, protocol_.End());
  if (decode) ++counters_.steps;
  return Status::Ok();
}

void CudaAgent::AbortStep() { protocol_.Abort(); }

}  // namespace

Result<std::unique_ptr<Agent>> CreateCudaAgent(const ModelShape& shape, const KvConfig& config,
                                               FullPrecisionSource* source, const CudaAgentOptions& options) {
  SPECACHE_RETURN_IF_ERROR(ValidateKvConfig(config, shape));
  if (source == nullptr) return Status::InvalidArgument("a full-precision source is required");
  if (options.capacity_tokens <= 0) return Status::InvalidArgument("capacity_tokens must be positive");
  SPECACHE_RETURN_IF_ERROR(ProbeCudaDevice().status());
  return std::unique_ptr<Agent>(new CudaAgent(shape, config, source, options));
}

}  // namespace specache
