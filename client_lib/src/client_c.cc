#include "specache/client_c.h"

#include <cxxabi.h>

#include <cstring>
#include <exception>
#include <new>

#include "specache/client.h"
#include "specache/shm_layout.h"

// The C ABI's row formats are the daemon's (shm_layout.h).
static_assert(SPECACHE_ROW_FP16 == specache::shm::kRowFp16 && SPECACHE_ROW_INT8 == specache::shm::kRowInt8);

struct specache_client {
  std::unique_ptr<specache::client::Client> impl;
};
struct specache_session {
  std::unique_ptr<specache::client::Session> impl;
};

namespace {

int Report(const specache::Status& s, char* error, size_t error_len) {
  if (error && error_len > 0) {
    const std::string text = s.ok() ? "" : s.ToString();
    std::strncpy(error, text.c_str(), error_len - 1);
    error[error_len - 1] = '\0';
  }
  return static_cast<int>(s.code());
}

int Null(const char* what, char* error, size_t error_len) {
  return Report(specache::Status::InvalidArgument(std::string(what) + " is NULL"), error, error_len);
}

// A fixed message, written without allocating (the memory may be what ran out).
int ReportFixed(specache::StatusCode code, const char* text, char* error, size_t error_len) noexcept {
  if (error && error_len > 0) {
    std::strncpy(error, text, error_len - 1);
    error[error_len - 1] = '\0';
  }
  return static_cast<int>(code);
}

// A C function's body: no C++ exception may cross into a C caller (it would unwind through frames
// that cannot be unwound, or end the process), so one that escapes `body` (std::bad_alloc, or
// another from the library or the standard library under it) becomes a status: RESOURCE_EXHAUSTED
// for memory, INTERNAL otherwise, its what() in the message where that can be copied. The one
// unwinding let through is a thread's cancellation (pthread_cancel while a call waits): glibc's
// forced unwind must go on (swallowed, it aborts the process).
template <typename Body>
int Guarded(char* error, size_t error_len, Body&& body) {
  try {
    return body();
  } catch (abi::__forced_unwind&) {
    throw;
  } catch (const std::bad_alloc&) {
    return ReportFixed(specache::StatusCode::kResourceExhausted, "RESOURCE_EXHAUSTED: out of memory", error, error_len);
  } catch (const std::exception& e) {
    try {
      return Report(specache::Status::Internal(std::string("unexpected C++ exception: ") + e.what()), error, error_len);
    } catch (...) {
      return ReportFixed(specache::StatusCode::kInternal, "INTERNAL: unexpected C++ exception", error, error_len);
    }
  } catch (...) {
    return ReportFixed(specache::StatusCode::kInternal, "INTERNAL: unexpected C++ exception", error, error_len);
  }
}

}  // namespace

extern "C" {

int specache_client_connect(const char* socket_path, int deadline_ms, specache_client** client, char* error,
                            size_t error_len) {
  return Guarded(error, error_len, [&]() -> int {
    if (!socket_path || !client) return Null("socket_path or client", error, error_len);
    auto c = specache::client::Client::Connect({socket_path, std::chrono::milliseconds(deadline_ms), "c-abi"});
    if (!c.ok()) return Report(c.status(), error, error_len);
    *client = new specache_client{std::move(c).value()};
    return Report(specache::Status::Ok(), error, error_len);
  });
}

void specache_client_free(specache_client* client) { delete client; }

int specache_client_stats(specache_client* client, specache_stats* stats, char* error, size_t error_len) {
  return Guarded(error, error_len, [&]() -> int {
    if (!client || !stats) return Null("client or stats", error, error_len);
    auto s = client->impl->Stats();
    if (!s.ok()) return Report(s.status(), error, error_len);
    *stats = specache_stats{s->pool_bytes, s->reserved_bytes, s->used_bytes, s->free_bytes, s->chunk_bytes,
                            s->sessions,   s->sequences,      s->pages,      s->requests,   s->errors};
    return Report(specache::Status::Ok(), error, error_len);
  });
}

int specache_session_open(specache_client* client, const char* tenant, uint64_t pool_bytes, specache_session** session,
                          char* error, size_t error_len) {
  return Guarded(error, error_len, [&]() -> int {
    if (!client || !tenant || !session) return Null("client, tenant or session", error, error_len);
    auto s = client->impl->OpenSession(tenant, pool_bytes);
    if (!s.ok()) return Report(s.status(), error, error_len);
    *session = new specache_session{std::move(s).value()};
    return Report(specache::Status::Ok(), error, error_len);
  });
}

void specache_session_close(specache_session* session) { delete session; }

int specache_sequence_create(specache_session* session, const specache_layout* l, uint64_t* sequence, char* error,
                             size_t error_len) {
  return specache_sequence_create_as(session, l, SPECACHE_ROW_FP16, sequence, error, error_len);
}

int specache_sequence_create_as(specache_session* session, const specache_layout* l, uint32_t row_format,
                                uint64_t* sequence, char* error, size_t error_len) {
  return Guarded(error, error_len, [&]() -> int {
    if (!session || !l || !sequence) return Null("session, layout or sequence", error, error_len);
    auto id = session->impl->CreateSequence(
        {l->n_layers, l->n_kv_heads, l->head_dim, l->page_tokens, l->capacity_tokens, row_format});
    if (!id.ok()) return Report(id.status(), error, error_len);
    *sequence = *id;
    return Report(specache::Status::Ok(), error, error_len);
  });
}

int specache_sequence_extend(specache_session* session, uint64_t sequence, uint32_t tokens, uint32_t* pages_per_layer,
                             char* error, size_t error_len) {
  return Guarded(error, error_len, [&]() -> int {
    if (!session) return Null("session", error, error_len);
    auto pages = session->impl->Extend(sequence, tokens);
    if (!pages.ok()) return Report(pages.status(), error, error_len);
    if (pages_per_layer) *pages_per_layer = *pages;
    return Report(specache::Status::Ok(), error, error_len);
  });
}

int specache_sequence_release(specache_session* session, uint64_t sequence, char* error, size_t error_len) {
  return Guarded(error, error_len, [&]() -> int {
    if (!session) return Null("session", error, error_len);
    return Report(session->impl->Release(sequence), error, error_len);
  });
}

int specache_page_data(specache_session* session, uint64_t sequence, uint32_t layer, uint32_t page, uint8_t** data,
                       char* error, size_t error_len) {
  return Guarded(error, error_len, [&]() -> int {
    if (!session || !data) return Null("session or data", error, error_len);
    auto p = session->impl->PageData(sequence, layer, page);
    if (!p.ok()) return Report(p.status(), error, error_len);
    *data = *p;
    return Report(specache::Status::Ok(), error, error_len);
  });
}

}  // extern "C"
