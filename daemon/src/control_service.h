// The gRPC Control service (specache.v1): checks who calls (the connection's peer credentials,
// access.h) before anything changes, validates requests, calls the Registry, maps Status to
// grpc::Status, counts requests, errors and refusals.
//
// Rules: OpenSession and the session calls need a caller the session's tenant admits (the token
// alone is not enough); Spill, Restore, Evict, VerifySpill and ListSessions need an admin;
// ListSequences and Stats show a non-admin only the tenants that admit it.
//
// Two instances serve it: the local one (Unix socket, callers from the PeerTable) and, with
// [remote] configured, the remote one (TCP with TLS, callers from the tenant secret in the call's
// metadata, remote_server.h), whose sessions attach over UCX.
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <optional>
#include <string>

#include "metrics.h"
#include "registry.h"
#include "specache/v1/control.grpc.pb.h"

namespace specache::daemon {

// Who sent a call; PERMISSION_DENIED when nobody the daemon knows.
using CallerLookup = std::function<Result<Caller>(const grpc::ServerContext*)>;

class ControlService final : public specache::v1::Control::Service {
 public:
  // `attach_path`: where OpenSession sends local clients; `data_address`: the UCX listener
  // remote ones attach to (empty on the local service).
  ControlService(Registry* registry, KeptSequences* kept, CallerLookup caller_of, std::string attach_path,
                 uint32_t lease_ms, std::string data_address = "");

  grpc::Status OpenSession(grpc::ServerContext*, const v1::OpenSessionRequest*, v1::OpenSessionResponse*) override;
  grpc::Status CloseSession(grpc::ServerContext*, const v1::CloseSessionRequest*, v1::CloseSessionResponse*) override;
  grpc::Status CreateSequence(grpc::ServerContext*, const v1::CreateSequenceRequest*,
                              v1::CreateSequenceResponse*) override;
  grpc::Status ExtendSequence(grpc::ServerContext*, const v1::ExtendSequenceRequest*,
                              v1::ExtendSequenceResponse*) override;
  grpc::Status ReleaseSequence(grpc::ServerContext*, const v1::ReleaseSequenceRequest*,
                               v1::ReleaseSequenceResponse*) override;
  grpc::Status Stats(grpc::ServerContext*, const v1::StatsRequest*, v1::StatsResponse*) override;
  grpc::Status ListSessions(grpc::ServerContext*, const v1::ListSessionsRequest*, v1::ListSessionsResponse*) override;
  grpc::Status ListSequences(grpc::ServerContext*, const v1::ListSequencesRequest*,
                             v1::ListSequencesResponse*) override;
  grpc::Status KeepSequence(grpc::ServerContext*, const v1::KeepSequenceRequest*, v1::KeepSequenceResponse*) override;
  grpc::Status ClaimSequence(grpc::ServerContext*, const v1::ClaimSequenceRequest*, v1::ClaimSequenceResponse*) override;
  grpc::Status Spill(grpc::ServerContext*, const v1::SpillRequest*, v1::SpillResponse*) override;
  grpc::Status Restore(grpc::ServerContext*, const v1::RestoreRequest*, v1::RestoreResponse*) override;
  grpc::Status Evict(grpc::ServerContext*, const v1::EvictRequest*, v1::EvictResponse*) override;
  grpc::Status VerifySpill(grpc::ServerContext*, const v1::VerifySpillRequest*, v1::VerifySpillResponse*) override;

  uint64_t requests() const { return requests_.load(); }
  uint64_t errors() const { return errors_.load(); }
  uint64_t denied() const { return denied_.load(); }
  // Where Stats reads the connection counters (attach server, control listener): set before serving.
  void set_connection_counts(std::function<ServiceCounts()> counts) { connection_counts_ = std::move(counts); }

 private:
  grpc::Status Finish(const Status& status);
  // Finish for CheckSession's refusal: another tenant's session is answered as one that does not
  // exist (NOT_FOUND), so that a caller learns neither which ids are live nor that tenant's name
  // and rules (the daemon's count and log of refusals still have it).
  grpc::Status FinishSessionCheck(const Status& refused, uint64_t session);
  // The caller of this call, as the kernel reported it at connect.
  Result<Caller> CallerOf(const grpc::ServerContext* ctx) const;
  // The caller may use the session's tenant (an unknown session is left to the registry's NOT_FOUND).
  Status CheckSession(const grpc::ServerContext* ctx, uint64_t session) const;
  // Every session call's first checks, in order: the token's form (alike for every session id),
  // then CheckSession. The token, or nothing with *refused set to the call's answer
  // (FinishSessionCheck's for a session the caller may not use).
  std::optional<Token> SessionToken(const grpc::ServerContext* ctx, uint64_t session, const std::string& token,
                                    grpc::Status* refused);
  Status CheckAdmin(const grpc::ServerContext* ctx, std::string_view call) const { return Admin(ctx, call).status(); }
  // The caller, when an admin (PERMISSION_DENIED otherwise): the operator calls that change what
  // is kept log who made them.
  Result<Caller> Admin(const grpc::ServerContext* ctx, std::string_view call) const;
  // NOT_FOUND from the kept sequences, for a sequence a live session holds: FAILED_PRECONDITION
  // saying so (an operator asked to move a sequence in use).
  Status InUseExplained(const Status& s, uint64_t sequence) const;

  Registry* registry_;
  KeptSequences* kept_;
  CallerLookup caller_of_;
  std::function<ServiceCounts()> connection_counts_;
  std::string attach_path_, data_address_;
  uint32_t lease_ms_;
  std::chrono::steady_clock::time_point started_ = std::chrono::steady_clock::now();
  std::atomic<uint64_t> requests_{0}, errors_{0}, denied_{0};
};

}  // namespace specache::daemon
