#include "control_service.h"

#include <cstring>

#include <spdlog/spdlog.h>

#include "log_rate.h"
#include "specache/version.h"

namespace specache::daemon {
namespace {

Result<Token> TokenOf(const std::string& bytes) {
  Token t{};
  if (bytes.size() != t.size()) return Status::InvalidArgument("token must be " + std::to_string(t.size()) + " bytes");
  std::memcpy(t.data(), bytes.data(), t.size());
  return t;
}

PageLayout LayoutOf(const v1::SequenceLayout& l) {
  return {l.n_layers(), l.n_kv_heads(), l.head_dim(), l.page_tokens(), l.capacity_tokens(), l.dtype()};
}

void FillLayout(const PageLayout& l, v1::SequenceLayout* out) {
  out->set_n_layers(l.n_layers);
  out->set_n_kv_heads(l.n_kv_heads);
  out->set_head_dim(l.head_dim);
  out->set_page_tokens(l.page_tokens);
  out->set_capacity_tokens(l.capacity_tokens);
  out->set_dtype(l.row_format);
}

}  // namespace

ControlService::ControlService(Registry* registry, KeptSequences* kept, CallerLookup caller_of, std::string attach_path,
                               uint32_t lease_ms, std::string data_address)
    : registry_(registry),
      kept_(kept),
      caller_of_(std::move(caller_of)),
      attach_path_(std::move(attach_path)),
      data_address_(std::move(data_address)),
      lease_ms_(lease_ms) {}

grpc::Status ControlService::Finish(const Status& s) {
  ++requests_;
  if (s.ok()) return grpc::Status::OK;
  ++errors_;
  if (s.code() == StatusCode::kPermissionDenied) {
    const uint64_t denied = ++denied_;
    if (LoggedOccurrence(denied)) {  // a hostile loop does not flood the log
      spdlog::warn("control: refused ({} refusals so far): {}", denied, s.message());
    }
  } else {
    spdlog::debug("request failed: {}", s.ToString());
  }
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), s.message());
}

grpc::Status ControlService::FinishSessionCheck(const Status& refused, uint64_t session) {
  const grpc::Status finished = Finish(refused);  // counted and logged as what it is
  if (refused.code() != StatusCode::kPermissionDenied) return finished;
  // The registry's own answer for a session that does not exist.
  return grpc::Status(grpc::StatusCode::NOT_FOUND, "session " + std::to_string(session));
}

Result<Caller> ControlService::CallerOf(const grpc::ServerContext* ctx) const { return caller_of_(ctx); }

Status ControlService::CheckSession(const grpc::ServerContext* ctx, uint64_t session) const {
  SPECACHE_ASSIGN_OR_RETURN(Caller caller, CallerOf(ctx));
  auto tenant = registry_->SessionTenant(session);
  if (!tenant.ok()) return Status::Ok();
  return registry_->access().MayUseTenant(caller, *tenant);
}

std::optional<Token> ControlService::SessionToken(const grpc::ServerContext* ctx, uint64_t session,
                                                  const std::string& token, grpc::Status* refused) {
  auto t = TokenOf(token);  // the request's form first: alike for every session id
  if (!t.ok()) {
    *refused = Finish(t.status());
    return std::nullopt;
  }
  if (Status who = CheckSession(ctx, session); !who.ok()) {
    *refused = FinishSessionCheck(who, session);
    return std::nullopt;
  }
  return *t;
}

Result<Caller> ControlService::Admin(const grpc::ServerContext* ctx, std::string_view call) const {
  SPECACHE_ASSIGN_OR_RETURN(Caller caller, CallerOf(ctx));
  SPECACHE_RETURN_IF_ERROR(registry_->access().MayAdminister(caller, call));
  return caller;
}

grpc::Status ControlService::OpenSession(grpc::ServerContext* ctx, const v1::OpenSessionRequest* req,
                                         v1::OpenSessionResponse* resp) {
  auto caller = CallerOf(ctx);
  if (!caller.ok()) return Finish(caller.status());
  auto opened = registry_->OpenSession(req->tenant(), req->pool_bytes(), req->client_name(), *caller);
  if (!opened.ok()) return Finish(opened.status());
  resp->set_session_id(opened->id);
  resp->set_token(std::string(opened->token.begin(), opened->token.end()));
  resp->set_attach_path(caller->remote() ? std::string() : attach_path_);
  resp->set_data_address(caller->remote() ? data_address_ : std::string());
  resp->set_chunk_count(opened->chunk_count);
  resp->set_chunk_bytes(registry_->chunk_bytes());
  resp->set_lease_ms(lease_ms_);
  return Finish(Status::Ok());
}

grpc::Status ControlService::CloseSession(grpc::ServerContext* ctx, const v1::CloseSessionRequest* req,
                                          v1::CloseSessionResponse*) {
  grpc::Status refused;
  const auto token = SessionToken(ctx, req->session_id(), req->token(), &refused);
  if (!token) return refused;
  return Finish(registry_->CloseSession(req->session_id(), *token));
}

grpc::Status ControlService::CreateSequence(grpc::ServerContext* ctx, const v1::CreateSequenceRequest* req,
                                            v1::CreateSequenceResponse* resp) {
  grpc::Status refused;
  const auto token = SessionToken(ctx, req->session_id(), req->token(), &refused);
  if (!token) return refused;
  if (!req->has_layout()) return Finish(Status::InvalidArgument("sequence layout missing"));
  auto created = registry_->CreateSequence(req->session_id(), *token, LayoutOf(req->layout()));
  if (!created.ok()) return Finish(created.status());
  resp->set_sequence_id(created->first);
  resp->set_table_slot(created->second);
  return Finish(Status::Ok());
}

grpc::Status ControlService::ExtendSequence(grpc::ServerContext* ctx, const v1::ExtendSequenceRequest* req,
                                            v1::ExtendSequenceResponse* resp) {
  grpc::Status refused;
  const auto token = SessionToken(ctx, req->session_id(), req->token(), &refused);
  if (!token) return refused;
  auto extended = registry_->ExtendSequence(req->session_id(), *token, req->sequence_id(), req->tokens());
  if (!extended.ok()) return Finish(extended.status());
  resp->set_pages_per_layer(extended->first);
  resp->set_table_generation(extended->second);
  return Finish(Status::Ok());
}

grpc::Status ControlService::ReleaseSequence(grpc::ServerContext* ctx, const v1::ReleaseSequenceRequest* req,
                                             v1::ReleaseSequenceResponse*) {
  grpc::Status refused;
  const auto token = SessionToken(ctx, req->session_id(), req->token(), &refused);
  if (!token) return refused;
  return Finish(registry_->ReleaseSequence(req->session_id(), *token, req->sequence_id()));
}

grpc::Status ControlService::Stats(grpc::ServerContext* ctx, const v1::StatsRequest*, v1::StatsResponse* resp) {
  auto caller = CallerOf(ctx);
  if (!caller.ok()) return Finish(caller.status());
  const AccessPolicy& access = registry_->access();
  const bool admin = access.IsAdmin(*caller);
  RegistryStats s = registry_->Stats();
  // Other tenants' rows out, and, to a caller that is not an admin, the totals that tell of them
  // (control.proto, StatsResponse): its own tenants' sums, or nothing.
  std::erase_if(s.tenants, [&](const TenantSummary& t) { return !admin && !access.MayUseTenant(*caller, t.name).ok(); });
  if (!admin) {
    s.reserved_bytes = s.used_bytes = s.pages = 0;
    s.sessions = s.sequences = 0;
    for (const TenantSummary& t : s.tenants) {
      s.reserved_bytes += t.reserved_bytes;
      s.used_bytes += t.used_bytes;
      s.sessions += t.sessions;
      s.sequences += t.sequences;
    }
    s.kept.parked_bytes = s.kept.spilled_bytes = s.kept.parked = s.kept.spilled = 0;
    s.kept.spill.stored_bytes = s.kept.evicted = s.kept.evicted_bytes = 0;
  }
  resp->set_pool_bytes(s.pool_bytes);
  resp->set_reserved_bytes(s.reserved_bytes);
  resp->set_used_bytes(s.used_bytes);
  resp->set_free_bytes(s.free_bytes);
  resp->set_sessions(s.sessions);
  resp->set_sequences(s.sequences);
  resp->set_pages(s.pages);
  resp->set_requests(requests_.load() + 1);
  resp->set_chunk_bytes(s.chunk_bytes);
  resp->set_memory_locked(s.memory_locked);
  resp->set_pool_huge_bytes(s.pool_huge_bytes);
  resp->set_version(SPECACHE_VERSION);
  resp->set_parked_bytes(s.kept.parked_bytes);
  resp->set_spilled_bytes(s.kept.spilled_bytes);
  resp->set_parked_sequences(s.kept.parked);
  resp->set_spilled_sequences(s.kept.spilled);
  resp->set_spill_tier(s.kept.has_spill_tier);
  resp->set_spills(s.kept.spill.spills);
  resp->set_restores(s.kept.spill.restores);
  resp->set_spill_bytes_total(s.kept.spill.spilled_bytes_total);
  resp->set_restore_bytes_total(s.kept.spill.restored_bytes_total);
  resp->set_spill_seconds(s.kept.spill.spill_seconds);
  resp->set_restore_seconds(s.kept.spill.restore_seconds);
  resp->set_checksum_failures(s.kept.spill.checksum_failures);
  resp->set_spill_read_errors(s.kept.spill.read_errors);
  resp->set_spill_write_errors(s.kept.spill.write_errors);
  resp->set_kept_dropped(s.kept.dropped);
  resp->set_kept_evicted(s.kept.evicted);
  resp->set_kept_evicted_bytes(s.kept.evicted_bytes);
  resp->set_spill_disk_bytes(s.kept.spill.stored_bytes);
  const ServiceCounts n = connection_counts_ ? connection_counts_() : ServiceCounts{};
  if (connection_counts_) {
    resp->set_attach_connections(n.attach_connections);
    resp->set_refused_connections(n.refused_connections);
    resp->set_accept_errors(n.accept_errors);
    resp->set_remote_connections(n.remote_connections);
    resp->set_remote_requests(n.remote_requests);
    resp->set_remote_refused(n.remote_refused);
    resp->set_remote_dropped(n.remote_dropped);
  }
  // This service's refusals, and the attach socket's (a wrong token or a caller its tenant does
  // not admit, and so for errors: malformed, cut short or never sent), which no control call counts.
  resp->set_denied_requests(denied_.load() + n.attach_denied);
  resp->set_errors(errors_.load() + n.attach_bad);
  resp->set_chunks_out_of_service(s.chunks_out_of_service);
  resp->set_spill_failures(s.kept.spill_failures);
  resp->set_spill_backoff_ms(s.kept.spill_backoff_ms);
  resp->set_spill_unreadable_records(s.kept.spill.unreadable_records);
  resp->set_spill_damaged_sequences(s.kept.spill.damaged_sequences);
  resp->set_uptime_ms(static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - started_).count()));
  for (const TenantSummary& t : s.tenants) {
    v1::TenantStats* out = resp->add_tenants();
    out->set_tenant(t.name);
    out->set_reserved_bytes(t.reserved_bytes);
    out->set_used_bytes(t.used_bytes);
    out->set_quota_bytes(t.quota_bytes);
    out->set_sessions(t.sessions);
    out->set_sequences(t.sequences);
    out->set_retained_bytes(t.retained_bytes);
  }
  return Finish(Status::Ok());
}

grpc::Status ControlService::ListSessions(grpc::ServerContext* ctx, const v1::ListSessionsRequest*,
                                          v1::ListSessionsResponse* resp) {
  if (Status who = CheckAdmin(ctx, "ListSessions"); !who.ok()) return Finish(who);
  for (const SessionSummary& s : registry_->Sessions()) {
    v1::SessionInfo* out = resp->add_sessions();
    out->set_session_id(s.id);
    out->set_tenant(s.tenant);
    out->set_client_name(s.client_name);
    out->set_pid(s.peer.pid);
    out->set_uid(s.peer.uid);
    out->set_attached(s.attached);
    out->set_chunks(s.chunks);
    out->set_used_bytes(s.used_bytes);
    out->set_sequences(s.sequences);
    out->set_age_ms(s.age_ms);
  }
  return Finish(Status::Ok());
}

grpc::Status ControlService::ListSequences(grpc::ServerContext* ctx, const v1::ListSequencesRequest*,
                                           v1::ListSequencesResponse* resp) {
  auto caller = CallerOf(ctx);
  if (!caller.ok()) return Finish(caller.status());
  const AccessPolicy& access = registry_->access();
  const bool admin = access.IsAdmin(*caller);
  for (const SequenceSummary& s : registry_->Sequences()) {
    if (!admin && !access.MayUseTenant(*caller, s.tenant).ok()) continue;  // a tenant's sequences are its own
    v1::SequenceInfo* out = resp->add_sequences();
    out->set_sequence_id(s.id);
    out->set_session_id(s.session);
    out->set_tenant(s.tenant);
    FillLayout(s.layout, out->mutable_layout());
    out->set_pages_per_layer(s.pages_per_layer);
    out->set_bytes(s.bytes);
    out->set_state(s.state);
  }
  return Finish(Status::Ok());
}

grpc::Status ControlService::KeepSequence(grpc::ServerContext* ctx, const v1::KeepSequenceRequest* req,
                                          v1::KeepSequenceResponse*) {
  grpc::Status refused;
  const auto token = SessionToken(ctx, req->session_id(), req->token(), &refused);
  if (!token) return refused;
  return Finish(registry_->KeepSequence(req->session_id(), *token, req->sequence_id()));
}

grpc::Status ControlService::ClaimSequence(grpc::ServerContext* ctx, const v1::ClaimSequenceRequest* req,
                                           v1::ClaimSequenceResponse* resp) {
  grpc::Status refused;
  const auto token = SessionToken(ctx, req->session_id(), req->token(), &refused);
  if (!token) return refused;
  if (!req->has_layout()) return Finish(Status::InvalidArgument("sequence layout missing"));
  auto claimed = registry_->ClaimSequence(req->session_id(), *token, req->sequence_id(), LayoutOf(req->layout()));
  if (!claimed.ok()) return Finish(claimed.status());
  resp->set_sequence_id(req->sequence_id());
  resp->set_table_slot(claimed->first);
  resp->set_pages_per_layer(claimed->second);
  return Finish(Status::Ok());
}

grpc::Status ControlService::Spill(grpc::ServerContext* ctx, const v1::SpillRequest* req, v1::SpillResponse* resp) {
  const auto admin = Admin(ctx, "Spill");
  if (!admin.ok()) return Finish(admin.status());
  spdlog::info("control: spill of {} asked by {}", req->all() ? std::string("every parked sequence")
                                                              : "sequence " + std::to_string(req->sequence_id()),
               admin->Describe());
  if (req->all()) {
    auto n = kept_->SpillAll();
    if (!n.ok()) return Finish(n.status());
    resp->set_spilled(*n);
    return Finish(Status::Ok());
  }
  const Status s = kept_->Spill(req->sequence_id());
  if (s.ok()) resp->set_spilled(1);
  return Finish(InUseExplained(s, req->sequence_id()));
}

grpc::Status ControlService::Restore(grpc::ServerContext* ctx, const v1::RestoreRequest* req, v1::RestoreResponse*) {
  const auto admin = Admin(ctx, "Restore");
  if (!admin.ok()) return Finish(admin.status());
  spdlog::info("control: restore of sequence {} asked by {}", req->sequence_id(), admin->Describe());
  return Finish(InUseExplained(kept_->Restore(req->sequence_id()), req->sequence_id()));
}

grpc::Status ControlService::Evict(grpc::ServerContext* ctx, const v1::EvictRequest* req, v1::EvictResponse*) {
  const auto admin = Admin(ctx, "Evict");
  if (!admin.ok()) return Finish(admin.status());
  return Finish(InUseExplained(kept_->Evict(req->sequence_id(), admin->Describe()), req->sequence_id()));
}

Status ControlService::InUseExplained(const Status& s, uint64_t sequence) const {
  if (s.code() != StatusCode::kNotFound) return s;
  const uint64_t session = registry_->OwnerOf(sequence);
  if (session == 0) return s;
  return Status::FailedPrecondition("sequence " + std::to_string(sequence) + " is in use by session " +
                                    std::to_string(session) +
                                    ": only kept sequences whose session ended (parked) move between RAM and disk");
}

grpc::Status ControlService::VerifySpill(grpc::ServerContext* ctx, const v1::VerifySpillRequest*,
                                         v1::VerifySpillResponse* resp) {
  if (Status who = CheckAdmin(ctx, "VerifySpill"); !who.ok()) return Finish(who);
  const SpillVerifyReport r = kept_->Verify();
  resp->set_sequences(r.sequences);
  resp->set_pages_checked(r.pages_checked);
  resp->set_pages_bad(r.pages_bad);
  for (const std::string& b : r.bad) resp->add_bad(b);
  return Finish(Status::Ok());
}

}  // namespace specache::daemon
