/* C ABI of libspecache_client, for engines written in other languages (FFI).
 *
 * Every function returns 0 on success or a status code (gRPC numbering, as specache::StatusCode)
 * and, when `error` is not NULL, writes a NUL-terminated message of at most error_len bytes.
 * No C++ exception leaves the functions that return a status: one raised under them comes back
 * as 8 (RESOURCE_EXHAUSTED, memory) or 13 (INTERNAL), with what it said where it fits (a thread
 * cancelled while it waits in one unwinds as cancelled threads do). Handles are opaque; free them
 * with the matching *_free / *_close (which return nothing and raise nothing). Thread safety as
 * the C++ API.
 */
#ifndef SPECACHE_CLIENT_C_H_
#define SPECACHE_CLIENT_C_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define SPECACHE_C_API __attribute__((visibility("default")))

typedef struct specache_client specache_client;
typedef struct specache_session specache_session;

typedef struct specache_layout {
  uint32_t n_layers;
  uint32_t n_kv_heads;
  uint32_t head_dim;
  uint32_t page_tokens;
  uint32_t capacity_tokens;
} specache_layout;

typedef struct specache_stats {
  uint64_t pool_bytes, reserved_bytes, used_bytes, free_bytes, chunk_bytes;
  uint32_t sessions, sequences;
  uint64_t pages, requests, errors;
} specache_stats;

SPECACHE_C_API int specache_client_connect(const char* socket_path, int deadline_ms, specache_client** client,
                                           char* error, size_t error_len);
SPECACHE_C_API void specache_client_free(specache_client* client);
SPECACHE_C_API int specache_client_stats(specache_client* client, specache_stats* stats, char* error, size_t error_len);

SPECACHE_C_API int specache_session_open(specache_client* client, const char* tenant, uint64_t pool_bytes,
                                         specache_session** session, char* error, size_t error_len);
/* Releases everything the session holds in the daemon. */
SPECACHE_C_API void specache_session_close(specache_session* session);

/* How a sequence's pages store a row (one token of one KV head), for specache_sequence_create_as:
 * SPECACHE_ROW_FP16: [K|V][head_dim] fp16, 4 x head_dim bytes;
 * SPECACHE_ROW_INT8: [K codes][V codes] int8 (head_dim each), then the K and V halves' scales as
 *   fp16 (value = code x scale; a NaN scale: the half held a non-finite value), then 12 zero bytes:
 *   2 x head_dim + 16 bytes. (Any layout's head_dim is a multiple of 8 in [8, 1024].) */
#define SPECACHE_ROW_FP16 0u
#define SPECACHE_ROW_INT8 1u

/* A sequence whose rows are fp16 (specache_sequence_create_as with SPECACHE_ROW_FP16). */
SPECACHE_C_API int specache_sequence_create(specache_session* session, const specache_layout* layout,
                                            uint64_t* sequence, char* error, size_t error_len);
/* A sequence whose rows are stored in `row_format` (SPECACHE_ROW_*); another value is refused (3,
 * INVALID_ARGUMENT) before anything is made. */
SPECACHE_C_API int specache_sequence_create_as(specache_session* session, const specache_layout* layout,
                                               uint32_t row_format, uint64_t* sequence, char* error,
                                               size_t error_len);
SPECACHE_C_API int specache_sequence_extend(specache_session* session, uint64_t sequence, uint32_t tokens,
                                            uint32_t* pages_per_layer, char* error, size_t error_len);
SPECACHE_C_API int specache_sequence_release(specache_session* session, uint64_t sequence, char* error,
                                             size_t error_len);
/* The memory of one page: [kv_head][token] rows of the sequence's row format, page_tokens tokens.
 * It stays mapped until specache_session_close, which unmaps it; after specache_sequence_release
 * the page may be given to another sequence of the session: do not use the pointer past either. */
SPECACHE_C_API int specache_page_data(specache_session* session, uint64_t sequence, uint32_t layer, uint32_t page,
                                      uint8_t** data, char* error, size_t error_len);

#ifdef __cplusplus
}
#endif

#endif /* SPECACHE_CLIENT_C_H_ */
