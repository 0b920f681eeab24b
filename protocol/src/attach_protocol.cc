#include "specache/attach_protocol.h"

#include <cstring>

namespace specache::attach {

Result<AttachRequest> ParseRequest(std::span<const uint8_t> bytes) {
  if (bytes.size() != sizeof(AttachRequest)) {
    return Status::InvalidArgument("attach request of " + std::to_string(bytes.size()) + " bytes, expected " +
                                   std::to_string(sizeof(AttachRequest)));
  }
  AttachRequest r;
  std::memcpy(&r, bytes.data(), sizeof r);
  if (r.magic != kRequestMagic) return Status::InvalidArgument("attach request: bad magic");
  if (r.version != kVersion) {
    return Status::FailedPrecondition("attach request: version " + std::to_string(r.version) + ", daemon speaks " +
                                      std::to_string(kVersion));
  }
  if (r.flags != 0) return Status::InvalidArgument("attach request: unknown flags");
  if (r.session_id == 0) return Status::InvalidArgument("attach request: session id 0");
  return r;
}

Result<AttachReply> ParseReply(std::span<const uint8_t> bytes) {
  if (bytes.size() != sizeof(AttachReply)) {
    return Status::DataLoss("attach reply of " + std::to_string(bytes.size()) + " bytes, expected " +
                            std::to_string(sizeof(AttachReply)));
  }
  AttachReply r;
  std::memcpy(&r, bytes.data(), sizeof r);
  if (r.magic != kReplyMagic) return Status::DataLoss("attach reply: bad magic");
  if (r.version != kVersion) return Status::FailedPrecondition("attach reply: version " + std::to_string(r.version));
  r.message[sizeof r.message - 1] = '\0';
  if (r.code != 0) return r;  // an error reply: the caller turns it into a Status
  if (r.total_fds == 0 || r.n_fds > static_cast<uint32_t>(kMaxFdsPerMessage) || r.first_fd >= r.total_fds ||
      r.total_fds - r.first_fd < r.n_fds) {
    return Status::DataLoss("attach reply: descriptor counts inconsistent");
  }
  if (r.table_bytes == 0 || r.chunk_bytes == 0) return Status::DataLoss("attach reply: zero sizes");
  return r;
}

AttachReply ErrorReply(const Status& status) {
  AttachReply r;
  r.code = static_cast<int32_t>(status.code());
  std::strncpy(r.message, status.message().c_str(), sizeof r.message - 1);
  return r;
}

}  // namespace specache::attach
