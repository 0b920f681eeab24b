/* Uses the C ABI from C (this file is compiled as C99: the header must be valid C). */
#include <stdio.h>
#include <string.h>

#include "specache/client_c.h"

/* A client of the daemon at socket_path and a session of 4 MiB as tenant "default"; on failure the
 * report says which step failed and nothing stays open. */
static int OpenSession(const char* socket_path, specache_client** client, specache_session** session, char* report,
                       size_t report_len) {
  char err[256];
  int rc = specache_client_connect(socket_path, 2000, client, err, sizeof err);
  if (rc) return snprintf(report, report_len, "connect: %s", err), rc;
  rc = specache_session_open(*client, "default", 4u << 20, session, err, sizeof err);
  if (rc) return snprintf(report, report_len, "open: %s", err), specache_client_free(*client), rc;
  return 0;
}

int specache_c_abi_roundtrip(const char* socket_path, char* report, size_t report_len) {
  char err[256];
  specache_client* client = NULL;
  specache_session* session = NULL;
  int rc = OpenSession(socket_path, &client, &session, report, report_len);
  if (rc) return rc;
  specache_layout layout = {2, 2, 64, 16, 256};
  uint64_t seq = 0;
  uint32_t pages = 0;
  uint8_t* page = NULL;
  rc = specache_sequence_create(session, &layout, &seq, err, sizeof err);
  if (!rc) rc = specache_sequence_extend(session, seq, 40, &pages, err, sizeof err);
  if (!rc) rc = specache_page_data(session, seq, 1, 2, &page, err, sizeof err);
  if (!rc) memset(page, 0x3C, (size_t)2 * 16 * 2 * 64 * 2); /* the whole page is writable */
  int beyond = rc ? 0 : specache_page_data(session, seq, 1, 3, &page, err, sizeof err);
  specache_stats stats;
  if (!rc) rc = specache_client_stats(client, &stats, err, sizeof err);
  if (!rc) rc = specache_sequence_release(session, seq, err, sizeof err);
  if (rc) snprintf(report, report_len, "sequence: %s", err);
  else snprintf(report, report_len, "pages=%u beyond=%d sessions=%u sequences=%u", pages, beyond, stats.sessions, stats.sequences);
  int null_rc = specache_sequence_create(session, NULL, &seq, err, sizeof err);
  specache_session_close(session);
  specache_client_free(client);
  return rc ? rc : (null_rc == 3 ? 0 : 100 + null_rc);
}

/* An int8 sequence: its pages hold rows of 2 x head_dim + 16 bytes (the whole page is writable, and
 * the daemon counts it in its 4 KiB units: 5 for 18432 bytes, where fp16 rows would take 8); an
 * unknown row format and a head_dim that is not a multiple of 8 are refused. */
int specache_c_abi_int8(const char* socket_path, char* report, size_t report_len) {
  char err[256];
  specache_client* client = NULL;
  specache_session* session = NULL;
  int rc = OpenSession(socket_path, &client, &session, report, report_len);
  if (rc) return rc;
  specache_layout layout = {2, 2, 64, 64, 256};
  uint64_t seq = 0, other = 0;
  uint32_t pages = 0;
  uint8_t* page0 = NULL;
  rc = specache_sequence_create_as(session, &layout, SPECACHE_ROW_INT8, &seq, err, sizeof err);
  if (!rc) rc = specache_sequence_extend(session, seq, 20, &pages, err, sizeof err);
  if (!rc) rc = specache_page_data(session, seq, 0, 0, &page0, err, sizeof err);
  const size_t page_bytes = (size_t)2 * 64 * (2 * 64 + 16); /* [kv_head][token] rows: 18432 bytes */
  if (!rc) memset(page0, 0x7F, page_bytes);
  specache_stats stats;
  memset(&stats, 0, sizeof stats);
  if (!rc) rc = specache_client_stats(client, &stats, err, sizeof err);
  int unknown = specache_sequence_create_as(session, &layout, 7u, &other, err, sizeof err);
  specache_layout odd_layout = {2, 2, 60, 16, 256};
  int odd = specache_sequence_create_as(session, &odd_layout, SPECACHE_ROW_INT8, &other, err, sizeof err);
  if (!rc) rc = specache_sequence_release(session, seq, err, sizeof err);
  if (rc) snprintf(report, report_len, "sequence: %s", err);
  else snprintf(report, report_len, "pages=%u used=%llu unknown=%d odd=%d", pages, (unsigned long long)stats.used_bytes,
                unknown, odd);
  specache_session_close(session);
  specache_client_free(client);
  return rc;
}
