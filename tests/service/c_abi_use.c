/* Uses the C ABI from C (this file is compiled as C99: the header must be valid C). */
#include <stdio.h>
#include <string.h>

#include "specache/client_c.h"

int specache_c_abi_roundtrip(const char* socket_path, char* report, size_t report_len) {
  char err[256];
  specache_client* client = NULL;
  specache_session* session = NULL;
  int rc = specache_client_connect(socket_path, 2000, &client, err, sizeof err);
  if (rc) return snprintf(report, report_len, "connect: %s", err), rc;
  rc = specache_session_open(client, "default", 4u << 20, &session, err, sizeof err);
  if (rc) return snprintf(report, report_len, "open: %s", err), specache_client_free(client), rc;
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
