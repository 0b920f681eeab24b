#include "offload_agent.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "cuda_call.h"
#include "specache/cuda_attention.h"
#include "specache/cuda_tensors.h"

namespace specache::gpu {
namespace {

std::string Id(SequenceId id) { return std::to_string(id); }

// A device buffer that grows (contents are not kept).
template <typename T>
class DeviceBuffer {
 public:
  ~DeviceBuffer() { cudaFree(p_); }
  Status Reserve(size_t n) {
    if (n <= n_) return Status::Ok();
    cudaFree(p_);
    p_ = nullptr;
    n_ = 0;
    SPECACHE_RETURN_IF_ERROR(Cuda(cudaMalloc(&p_, n * sizeof(T)), "device buffer"));
    n_ = n;
    return Status::Ok();
  }
  T* get() const { return p_; }
  size_t bytes() const { return n_ * sizeof(T); }

 private:
  T* p_ = nullptr;
  size_t n_ = 0;
};

class OffloadAgent final : public Agent {
 public:
  OffloadAgent(const ModelShape& shape, const OffloadOptions& options) : shape_(shape), options_(options) {
    config_.mode = KvMode::kFull;
    config_.key_bits = config_.value_bits = 16;
    compute_ = static_cast<cudaStream_t>(options.stream);
  }
  ~OffloadAgent() override {
    cudaStreamSynchronize(compute_);
    if (copy_) {
      cudaStreamSynchronize(copy_);
      cudaStreamDestroy(copy_);
    }
    for (cudaEvent_t e : {copied_[0], copied_[1], free_[0], free_[1]}) if (e) cudaEventDestroy(e);
    for (auto& [id, s] : sequences_) cudaFreeHost(s.host);
    if (pending_) cudaFreeHost(pending_);
  }

  Status Init() {
    SPECACHE_RETURN_IF_ERROR(ValidateModelShape(shape_));
    if (options_.capacity_tokens <= 0) return Status::InvalidArgument("capacity_tokens must be positive");
    SPECACHE_RETURN_IF_ERROR(Cuda(cudaStreamCreateWithFlags(&copy_, cudaStreamNonBlocking), "copy stream"));
    for (int i = 0; i < 2; ++i) {
      SPECACHE_RETURN_IF_ERROR(Cuda(cudaEventCreateWithFlags(&copied_[i], cudaEventDisableTiming), "event"));
      SPECACHE_RETURN_IF_ERROR(Cuda(cudaEventCreateWithFlags(&free_[i], cudaEventDisableTiming), "event"));
    }
    return Status::Ok();
  }

  const ModelShape& shape() const override { return shape_; }
  const KvConfig& config() const override { return config_; }
  std::string_view backend_name() const override { return "cuda-offload"; }

  Status AddSequence(SequenceId id) override {
    if (sequences_.count(id)) return Status::AlreadyExists("sequence " + Id(id) + " is already registered");
    Sequence s;
    void* p = nullptr;
    SPECACHE_RETURN_IF_ERROR(Cuda(cudaHostAlloc(&p, SequenceBytes(), cudaHostAllocDefault), "pinned host KV"));
    s.host = static_cast<Half*>(p);
    s.lengths.assign(shape_.n_layers, 0);
    sequences_.emplace(id, std::move(s));
    return Status::Ok();
  }

  Status ReleaseSequence(SequenceId id) override {
    auto it = sequences_.find(id);
    if (it == sequences_.end()) return Status::NotFound("sequence " + Id(id) + " is not registered");
    if (in_step_ && std::find(step_ids_.begin(), step_ids_.end(), id) != step_ids_.end()) {
      return Status::FailedPrecondition("sequence " + Id(id) + " is in the current step");
    }
    SPECACHE_RETURN_IF_ERROR(FlushAppends());
    cudaFreeHost(it->second.host);
    sequences_.erase(it);
    return Status::Ok();
  }

  Result<int32_t> SequenceLength(SequenceId id) const override {
    auto it = sequences_.find(id);
    if (it == sequences_.end()) return Status::NotFound("sequence " + Id(id) + " is not registered");
    const bool pending = std::find(pending_ids_.begin(), pending_ids_.end(), id) != pending_ids_.end();
    return it->second.lengths[0] + (pending ? 1 : 0);
  }

  Status PrefillLayer(int layer, const PrefillBatch& batch) override {
    if (in_step_) return Status::FailedPrecondition("PrefillLayer inside a step");
    if (layer < 0 || layer >= shape_.n_layers) return Status::OutOfRange("layer " + std::to_string(layer));
    if (batch.out) return Status::Unimplemented("the offload agent only stores a prompt (PrefillBatch::out must be null)");
    if (batch.token_offsets.size() != batch.sequences.size() + 1) return Status::InvalidArgument("token_offsets size");
    SPECACHE_RETURN_IF_ERROR(FlushAppends());
    const int d = shape_.head_dim, n_kv = shape_.n_kv_heads;
    for (size_t i = 0; i < batch.sequences.size(); ++i) {
      auto it = sequences_.find(batch.sequences[i]);
      if (it == sequences_.end()) return Status::NotFound("sequence " + Id(batch.sequences[i]) + " is not registered");
      Sequence& s = it->second;
      const int32_t first = batch.token_offsets[i], n = batch.token_offsets[i + 1] - first;
      if (s.lengths[layer] != 0) return Status::FailedPrecondition("layer " + std::to_string(layer) + " is already filled");
      if (n <= 0 || n > options_.capacity_tokens) return Status::InvalidArgument("prompt length out of range");
      SPECACHE_RETURN_IF_ERROR(staging_.Reserve(size_t(n) * d));
      for (int h = 0; h < n_kv; ++h) {
        for (int part = 0; part < 2; ++part) {
          const float* src = (part == 0 ? batch.k : batch.v) + (size_t(first) * n_kv + h) * d;
          SPECACHE_RETURN_IF_ERROR(cuda::FloatRowsToHalf(src, n, d, int64_t{n_kv} * d, staging_.get(), compute_));
          SPECACHE_RETURN_IF_ERROR(Cuda(cudaMemcpyAsync(HostRows(s, layer, h, part), staging_.get(), size_t(n) * d * 2,
                                                        cudaMemcpyDeviceToHost, compute_), "prompt rows"));
        }
      }
      s.lengths[layer] = n;
    }
    return Cuda(cudaStreamSynchronize(compute_), "prefill");  // staging_ is reused
  }

  Status BeginStep(StepKind kind, std::span<const SequenceId> sequences) override {
    if (in_step_) return Status::FailedPrecondition("BeginStep inside a step (EndStep or AbortStep first)");
    if (kind != StepKind::kDecode) return Status::InvalidArgument("the offload agent has no pre-decode step");
    if (sequences.empty()) return Status::InvalidArgument("a step needs sequences");
    SPECACHE_RETURN_IF_ERROR(FlushAppends());
    max_length_ = 0;
    for (SequenceId id : sequences) {
      auto it = sequences_.find(id);
      if (it == sequences_.end()) return Status::NotFound("sequence " + Id(id) + " is not registered");
      const std::vector<int32_t>& l = it->second.lengths;
      if (std::any_of(l.begin(), l.end(), [&](int32_t x) { return x != l[0]; }) || l[0] == 0) {
        return Status::FailedPrecondition("sequence " + Id(id) + " is not prefilled at every layer");
      }
      if (l[0] + 1 > options_.capacity_tokens) return Status::OutOfRange("sequence " + Id(id) + " would exceed capacity_tokens");
      max_length_ = std::max(max_length_, l[0]);
    }
    step_ids_.assign(sequences.begin(), sequences.end());
    const size_t b = step_ids_.size(), d = shape_.head_dim, n_kv = shape_.n_kv_heads;
    for (auto& slot : slots_) SPECACHE_RETURN_IF_ERROR(slot.Reserve(b * n_kv * 2 * size_t(max_length_) * d));
    SPECACHE_RETURN_IF_ERROR(new_k_.Reserve(b * n_kv * d));
    SPECACHE_RETURN_IF_ERROR(new_v_.Reserve(b * n_kv * d));
    const int64_t per_item = cuda::DecodeScratchFloats(max_length_, 1, shape_.group_size(), shape_.head_dim);
    SPECACHE_RETURN_IF_ERROR(scratch_.Reserve(b * n_kv * size_t(per_item)));
    if (pending_capacity_ < b) {
      if (pending_) cudaFreeHost(pending_);
      pending_ = nullptr;
      void* p = nullptr;
      SPECACHE_RETURN_IF_ERROR(
          Cuda(cudaHostAlloc(&p, size_t(shape_.n_layers) * b * n_kv * 2 * d * sizeof(Half), cudaHostAllocDefault),
               "pinned new rows"));
      pending_ = static_cast<Half*>(p);
      pending_capacity_ = b;
    }
    decoded_.assign(shape_.n_layers, false);
    in_step_ = true;
    // The copies may start once the compute stream is past everything queued so far. A failure
    // leaves no step begun (a copy already queued only reads the pages into a slot).
    Status started = Status::Ok();
    for (int slot = 0; slot < 2 && started.ok(); ++slot) started = Cuda(cudaEventRecord(free_[slot], compute_), "event");
    for (int l = 0; l < std::min(2, shape_.n_layers) && started.ok(); ++l) started = CopyLayer(l);
    if (!started.ok()) in_step_ = false;
    return started;
  }

  Status WaitPrefetch(int layer) override {
    if (!in_step_ || layer < 0 || layer >= shape_.n_layers) return Status::Ok();
    return Cuda(cudaStreamWaitEvent(compute_, copied_[layer % 2], 0), "wait for the layer's rows");
  }

  Status DecodeLayer(int layer, const DecodeRows& rows) override {
    if (!in_step_) return Status::FailedPrecondition("DecodeLayer outside a step (BeginStep first)");
    if (layer < 0 || layer >= shape_.n_layers) return Status::OutOfRange("layer " + std::to_string(layer));
    if (decoded_[layer]) return Status::FailedPrecondition("layer " + std::to_string(layer) + " decoded twice in a step");
    const int d = shape_.head_dim, n_kv = shape_.n_kv_heads, n_q = shape_.n_q_heads, group = shape_.group_size();
    const int32_t b = static_cast<int32_t>(step_ids_.size());
    SPECACHE_RETURN_IF_ERROR(WaitPrefetch(layer));
    SPECACHE_RETURN_IF_ERROR(
        cuda::FloatKeyValueRowsToHalf(rows.k, rows.v, b * n_kv, d, d, new_k_.get(), new_v_.get(), compute_));
    const Half* slot = slots_[layer % 2].get();
    const int64_t per_item = cuda::DecodeScratchFloats(max_length_, 1, group, d);
    items_.clear();
    for (int32_t s = 0; s < b; ++s) {
      const int32_t length = sequences_.at(step_ids_[s]).lengths[layer];
      for (int h = 0; h < n_kv; ++h) {
        cuda::DeviceDecodeItem it;
        cuda::DeviceReplicaView& v = it.replica;
        v.head_dim = d;
        v.group_size = 32;
        v.key_bits = v.value_bits = 16;
        v.length = length;
        v.residual_keys = slot + ((size_t(s) * n_kv + h) * 2 + 0) * max_length_ * d;
        v.window_values = slot + ((size_t(s) * n_kv + h) * 2 + 1) * max_length_ * d;
        cuda::DeviceDecodeRows& r = it.rows;
        r.q = rows.q + (size_t(s) * n_q + size_t(h) * group) * d;
        r.out = rows.out + (size_t(s) * n_q + size_t(h) * group) * d;
        r.q_stride = int64_t{n_q} * d;
        r.new_keys = new_k_.get() + (size_t(s) * n_kv + h) * d;
        r.new_values = new_v_.get() + (size_t(s) * n_kv + h) * d;
        r.n_rows = 1;
        r.n_heads = group;
        r.scale = 1.0f / std::sqrt(static_cast<float>(d));
        r.scratch = scratch_.get() + (size_t(s) * n_kv + h) * per_item;
        items_.push_back(it);
      }
    }
    SPECACHE_RETURN_IF_ERROR(cuda::AttendDecodeBatch(items_.data(), static_cast<int>(items_.size()), compute_, &plan_));
    SPECACHE_RETURN_IF_ERROR(Cuda(cudaEventRecord(free_[layer % 2], compute_), "event"));
    if (layer + 2 < shape_.n_layers) SPECACHE_RETURN_IF_ERROR(CopyLayer(layer + 2));
    // The new rows go to the host after the step ([layer][sequence][head][K|V][d]).
    Half* pending = pending_ + size_t(layer) * b * n_kv * 2 * d;
    for (int part = 0; part < 2; ++part) {
      SPECACHE_RETURN_IF_ERROR(Cuda(cudaMemcpy2DAsync(pending + part * d, 2 * d * sizeof(Half),
                                                      (part == 0 ? new_k_ : new_v_).get(), d * sizeof(Half),
                                                      d * sizeof(Half), size_t(b) * n_kv, cudaMemcpyDeviceToHost,
                                                      compute_), "new rows"));
    }
    decoded_[layer] = true;
    return Status::Ok();
  }

  Status StartPrefetch(int layer) override {
    if (!in_step_ || layer < 0 || layer >= shape_.n_layers || !decoded_[layer]) {
      return Status::FailedPrecondition("StartPrefetch before DecodeLayer(" + std::to_string(layer) + ")");
    }
    return Status::Ok();  // the copies are queued by BeginStep and DecodeLayer
  }

  Status EndStep() override {
    if (!in_step_) return Status::FailedPrecondition("EndStep outside a step");
    if (std::find(decoded_.begin(), decoded_.end(), false) != decoded_.end()) {
      return Status::FailedPrecondition("EndStep before every layer was decoded");
    }
    pending_ids_ = step_ids_;  // appended to the host cache once the step's copies land
    in_step_ = false;
    ++stats_.steps;
    return Status::Ok();
  }

  void AbortStep() override {
    cudaStreamSynchronize(compute_);
    cudaStreamSynchronize(copy_);
    in_step_ = false;
  }

  Result<std::vector<int32_t>> SelectedTokens(SequenceId, int, int) const override {
    return Status::Unimplemented("full offload selects no rows: every row is fetched");
  }

  AgentStats stats() const override {
    AgentStats s = stats_;
    s.device_bytes = s.device_bytes_reserved =
        static_cast<int64_t>(slots_[0].bytes() + slots_[1].bytes() + new_k_.bytes() + new_v_.bytes() + scratch_.bytes());
    for (const auto& [id, seq] : sequences_) {
      s.full_precision_bytes += int64_t{seq.lengths[0]} * shape_.n_layers * shape_.n_kv_heads * 2 * shape_.head_dim * 2;
    }
    return s;
  }

 private:
  struct Sequence {
    Half* host = nullptr;          // [layer][kv_head][K|V][capacity][head_dim], pinned
    std::vector<int32_t> lengths;  // per layer
  };

  size_t SequenceBytes() const {
    return size_t(shape_.n_layers) * shape_.n_kv_heads * 2 * size_t(options_.capacity_tokens) * shape_.head_dim *
           sizeof(Half);
  }
  Half* HostRows(const Sequence& s, int layer, int h, int part) const {
    return s.host + ((size_t(layer) * shape_.n_kv_heads + h) * 2 + part) * size_t(options_.capacity_tokens) * shape_.head_dim;
  }

  // Queues the copy of `layer`'s rows of the step's sequences into slot layer % 2.
  Status CopyLayer(int layer) {
    const int slot = layer % 2;
    const size_t d = shape_.head_dim, n_kv = shape_.n_kv_heads, row = d * sizeof(Half);
    SPECACHE_RETURN_IF_ERROR(Cuda(cudaStreamWaitEvent(copy_, free_[slot], 0), "slot reuse"));
    for (size_t s = 0; s < step_ids_.size(); ++s) {
      const Sequence& seq = sequences_.at(step_ids_[s]);
      const int32_t length = seq.lengths[layer];
      Half* dst = slots_[slot].get() + s * n_kv * 2 * size_t(max_length_) * d;
      SPECACHE_RETURN_IF_ERROR(Cuda(cudaMemcpy2DAsync(dst, max_length_ * row, HostRows(seq, layer, 0, 0),
                                                      size_t(options_.capacity_tokens) * row, length * row, n_kv * 2,
                                                      cudaMemcpyHostToDevice, copy_), "layer rows"));
      stats_.rows_selected += int64_t{length} * int64_t(n_kv);
      stats_.rows_fetched += int64_t{length} * int64_t(n_kv);
      stats_.bytes_fetched += int64_t{length} * int64_t(n_kv) * 2 * int64_t(row);
    }
    return Cuda(cudaEventRecord(copied_[slot], copy_), "event");
  }

  // Appends the last step's new rows (landed in pending_) to the host cache.
  Status FlushAppends() {
    if (pending_ids_.empty()) return Status::Ok();
    SPECACHE_RETURN_IF_ERROR(Cuda(cudaStreamSynchronize(compute_), "new rows"));
    const size_t d = shape_.head_dim, n_kv = shape_.n_kv_heads, b = pending_ids_.size();
    for (size_t s = 0; s < b; ++s) {
      auto it = sequences_.find(pending_ids_[s]);
      if (it == sequences_.end()) continue;  // released meanwhile
      Sequence& seq = it->second;
      for (int l = 0; l < shape_.n_layers; ++l) {
        const Half* src = pending_ + ((size_t(l) * b + s) * n_kv) * 2 * d;
        for (size_t h = 0; h < n_kv; ++h) {
          for (int part = 0; part < 2; ++part) {
            std::memcpy(HostRows(seq, l, static_cast<int>(h), part) + size_t(seq.lengths[l]) * d, src + (h * 2 + part) * d,
                        d * sizeof(Half));
          }
        }
        ++seq.lengths[l];
      }
    }
    pending_ids_.clear();
    return Status::Ok();
  }

  ModelShape shape_;
  KvConfig config_;
  OffloadOptions options_;
  cudaStream_t compute_ = nullptr, copy_ = nullptr;
  cudaEvent_t copied_[2] = {nullptr, nullptr}, free_[2] = {nullptr, nullptr};
  std::map<SequenceId, Sequence> sequences_;
  bool in_step_ = false;
  std::vector<SequenceId> step_ids_, pending_ids_;
  std::vector<bool> decoded_;
  int32_t max_length_ = 0;
  DeviceBuffer<Half> slots_[2], new_k_, new_v_, staging_;
  DeviceBuffer<float> scratch_;
  Half* pending_ = nullptr;  // pinned
  size_t pending_capacity_ = 0;
  std::vector<cuda::DeviceDecodeItem> items_;
  cuda::DecodePlan plan_;  // the attention's launch plans
  AgentStats stats_;
};

}  // namespace

Result<std::unique_ptr<Agent>> CreateOffloadAgent(const ModelShape& shape, const OffloadOptions& options) {
  auto agent = std::make_unique<OffloadAgent>(shape, options);
  SPECACHE_RETURN_IF_ERROR(agent->Init());
  return std::unique_ptr<Agent>(std::move(agent));
}

}  // namespace specache::gpu
