#include "specache/host_tensor_agent.h"

#include <cuda_runtime.h>

#include <string>

#include "../forwarding_agent.h"

namespace specache {
namespace {

class HostTensorAgent final : public ForwardingAgent {
 public:
  // The base is given the agent before inner_ takes it (bases are initialised first).
  explicit HostTensorAgent(std::unique_ptr<Agent> inner) : ForwardingAgent(inner.get()), inner_(std::move(inner)) {}
  ~HostTensorAgent() override {
    for (Slot* s : {&q_, &k_, &v_, &out_}) cudaFree(s->p);
  }

  Status PrefillLayer(int layer, const PrefillBatch& b) override {
    if (b.token_offsets.empty()) return inner_->PrefillLayer(layer, b);
    const size_t n = static_cast<size_t>(b.token_offsets.back());
    const size_t qn = n * shape().n_q_heads * shape().head_dim, kn = n * shape().n_kv_heads * shape().head_dim;
    PrefillBatch d = b;
    SPECACHE_ASSIGN_OR_RETURN(d.k, Up(&k_, b.k, kn));
    SPECACHE_ASSIGN_OR_RETURN(d.v, Up(&v_, b.v, kn));
    d.q = nullptr;
    d.out = nullptr;
    if (b.q) {
      SPECACHE_ASSIGN_OR_RETURN(d.q, Up(&q_, b.q, qn));
    }
    if (b.out) {
      SPECACHE_ASSIGN_OR_RETURN(d.out, Reserve(&out_, qn));
    }
    SPECACHE_RETURN_IF_ERROR(inner_->PrefillLayer(layer, d));
    return b.out ? Down(b.out, d.out, qn) : Status::Ok();
  }
  Status BeginStep(StepKind kind, std::span<const SequenceId> ids) override {
    SPECACHE_RETURN_IF_ERROR(inner_->BeginStep(kind, ids));
    step_rows_ = ids.size() * static_cast<size_t>(RowsPerSequence(kind));
    return Status::Ok();
  }
  Status DecodeLayer(int layer, const DecodeRows& r) override {
    const size_t qn = step_rows_ * shape().n_q_heads * shape().head_dim;
    const size_t kn = step_rows_ * shape().n_kv_heads * shape().head_dim;
    DecodeRows d;
    SPECACHE_ASSIGN_OR_RETURN(d.q, Up(&q_, r.q, qn));
    SPECACHE_ASSIGN_OR_RETURN(d.k, Up(&k_, r.k, kn));
    SPECACHE_ASSIGN_OR_RETURN(d.v, Up(&v_, r.v, kn));
    SPECACHE_ASSIGN_OR_RETURN(d.out, Reserve(&out_, qn));
    SPECACHE_RETURN_IF_ERROR(inner_->DecodeLayer(layer, d));
    return Down(r.out, d.out, qn);
  }

 private:
  struct Slot {
    float* p = nullptr;
    size_t n = 0;
  };
  static Result<float*> Reserve(Slot* s, size_t n) {
    if (n > s->n) {
      cudaFree(s->p);
      s->p = nullptr;
      s->n = 0;
      if (cudaMalloc(&s->p, n * sizeof(float)) != cudaSuccess) {
        cudaGetLastError();
        return Status::ResourceExhausted("device buffer of " + std::to_string(n * 4) + " bytes");
      }
      s->n = n;
    }
    return s->p;
  }
  static Result<const float*> Up(Slot* s, const float* host, size_t n) {
    if (!host) return Status::InvalidArgument("null tensor");
    SPECACHE_ASSIGN_OR_RETURN(float* d, Reserve(s, n));
    if (cudaMemcpy(d, host, n * sizeof(float), cudaMemcpyHostToDevice) != cudaSuccess) {
      cudaGetLastError();
      return Status::Unavailable("copy to device failed");
    }
    return static_cast<const float*>(d);
  }
  static Status Down(float* host, const float* device, size_t n) {
    if (!host) return Status::InvalidArgument("null output");
    if (cudaMemcpy(host, device, n * sizeof(float), cudaMemcpyDeviceToHost) != cudaSuccess) {
      cudaGetLastError();
      return Status::Unavailable("copy to host failed");
    }
    return Status::Ok();
  }

  std::unique_ptr<Agent> inner_;  // owned; the base forwards to it
  Slot q_, k_, v_, out_;
  size_t step_rows_ = 0;
};

}  // namespace

Result<std::unique_ptr<Agent>> WrapHostTensors(std::unique_ptr<Agent> device_agent) {
  if (!device_agent) return Status::InvalidArgument("no agent to wrap");
  return std::unique_ptr<Agent>(new HostTensorAgent(std::move(device_agent)));
}

}  // namespace specache
