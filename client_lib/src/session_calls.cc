#include "session_calls.h"

namespace specache::client {
namespace {

void FillLayout(const PageLayoutSpec& l, v1::SequenceLayout* out) {
  out->set_n_layers(l.n_layers);
  out->set_n_kv_heads(l.n_kv_heads);
  out->set_head_dim(l.head_dim);
  out->set_page_tokens(l.page_tokens);
  out->set_capacity_tokens(l.capacity_tokens);
  out->set_dtype(l.row_format);
}

}  // namespace

Result<v1::CreateSequenceResponse> SessionCalls::CreateSequence(const PageLayoutSpec& layout) const {
  v1::CreateSequenceRequest req;
  FillLayout(layout, req.mutable_layout());
  v1::CreateSequenceResponse resp;
  SPECACHE_RETURN_IF_ERROR(Call(&v1::Control::Stub::CreateSequence, "CreateSequence", &req, &resp));
  return resp;
}

Result<v1::ClaimSequenceResponse> SessionCalls::ClaimSequence(uint64_t sequence, const PageLayoutSpec& layout) const {
  v1::ClaimSequenceRequest req;
  FillLayout(layout, req.mutable_layout());
  v1::ClaimSequenceResponse resp;
  SPECACHE_RETURN_IF_ERROR(CallOn(sequence, &v1::Control::Stub::ClaimSequence, "ClaimSequence", &req, &resp));
  return resp;
}

Result<uint32_t> SessionCalls::ExtendSequence(uint64_t sequence, uint32_t tokens) const {
  v1::ExtendSequenceRequest req;
  req.set_tokens(tokens);
  v1::ExtendSequenceResponse resp;
  SPECACHE_RETURN_IF_ERROR(CallOn(sequence, &v1::Control::Stub::ExtendSequence, "ExtendSequence", &req, &resp));
  return resp.pages_per_layer();
}

Status SessionCalls::ReleaseSequence(uint64_t sequence) const {
  v1::ReleaseSequenceRequest req;
  v1::ReleaseSequenceResponse resp;
  return CallOn(sequence, &v1::Control::Stub::ReleaseSequence, "ReleaseSequence", &req, &resp);
}

Status SessionCalls::KeepSequence(uint64_t sequence) const {
  v1::KeepSequenceRequest req;
  v1::KeepSequenceResponse resp;
  return CallOn(sequence, &v1::Control::Stub::KeepSequence, "KeepSequence", &req, &resp);
}

void SessionCalls::Close() const {
  if (!client_ || id_ == 0) return;
  v1::CloseSessionRequest req;
  v1::CloseSessionResponse resp;
  static_cast<void>(Call(&v1::Control::Stub::CloseSession, "CloseSession", &req, &resp));
}

}  // namespace specache::client
