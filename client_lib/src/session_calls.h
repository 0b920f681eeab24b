// The control calls made in one session's name, shared by the session on this host (Session,
// client.cc) and the session with a daemon on another host (RemoteSession, remote_session.cc):
// every request carries the session's id and token and goes out through Client::Impl::Call, so
// both kinds of session get the same deadline, credentials and error text.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "client_impl.h"

namespace specache::client {

class SessionCalls {
 public:
  SessionCalls() = default;  // no session yet: Close() does nothing
  SessionCalls(std::shared_ptr<Client::Impl> client, uint64_t id, std::string token)
      : client_(std::move(client)), id_(id), token_(std::move(token)) {}

  const std::shared_ptr<Client::Impl>& client() const { return client_; }
  uint64_t id() const { return id_; }
  const std::string& token() const { return token_; }

  // The daemon's reply; the caller takes what it needs from it (the sequence id, the table slot).
  Result<v1::CreateSequenceResponse> CreateSequence(const PageLayoutSpec& layout) const;
  Result<v1::ClaimSequenceResponse> ClaimSequence(uint64_t sequence, const PageLayoutSpec& layout) const;
  // The sequence's pages per layer after the call.
  Result<uint32_t> ExtendSequence(uint64_t sequence, uint32_t tokens) const;
  Status ReleaseSequence(uint64_t sequence) const;
  Status KeepSequence(uint64_t sequence) const;
  // Ends the session in the daemon, best effort: a session's owner calls it as it goes away, and
  // if it fails the daemon still ends the session when the session's connection closes.
  void Close() const;

 private:
  template <typename Req, typename Resp, typename Method>
  Status Call(Method method, const char* name, Req* req, Resp* resp) const {
    req->set_session_id(id_);
    req->set_token(token_);
    return client_->Call(method, name, *req, resp);
  }
  template <typename Req, typename Resp, typename Method>
  Status CallOn(uint64_t sequence, Method method, const char* name, Req* req, Resp* resp) const {
    req->set_sequence_id(sequence);
    return Call(method, name, req, resp);
  }

  std::shared_ptr<Client::Impl> client_;
  uint64_t id_ = 0;
  std::string token_;
};

}  // namespace specache::client
