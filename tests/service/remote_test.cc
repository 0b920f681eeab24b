// Remote clients: a specached with [remote] on loopback (TLS control plane, UCX data plane), and
// clients in this process. What a remote client may do, what it is refused (with which status),
// rows identical to what was written by both fetch methods, and a daemon killed under a session.
// The two-host version (network namespaces, the real engine) is remote_netns_test.sh.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstring>
#include <fstream>
#include <functional>
#include <optional>
#include <random>
#include <thread>

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <openssl/ssl.h>
#include <ucp/api/ucp.h>

#include "processes.h"
#include "remote_daemon.h"
#include "specache/client.h"
#include "specache/remote_protocol.h"
#include "specache/remote_session.h"
#include "specache/remote_source.h"
#include "specache/v1/control.grpc.pb.h"
#include "ucx_endpoint.h"

namespace specache {
namespace {

using client::Client;
using client::FetchMethod;
using client::RemoteCredentials;
using client::RemoteSession;
using testing::DaemonProcess;
using testing::FreePort;
using testing::Pki;
using testing::RemoteDaemonToml;
using testing::RunCommand;
using testing::WriteSecret;

constexpr client::PageLayoutSpec kLayout{2, 2, 128, 16, 256};  // 512-byte rows
constexpr size_t kRow = 512;

class RemoteTest : public ::testing::Test {
 protected:
  // One set of certificates for the suite (each daemon gets fresh ports and secrets).
  static void SetUpTestSuite() { pki_ = new Pki; }
  static void TearDownTestSuite() {
    delete pki_;
    pki_ = nullptr;
  }

  // The daemon's configuration (its ports chosen here, the tenants' secret files written).
  std::string DaemonToml(bool mutual_tls, bool rma, uint16_t control_port = 0, uint16_t data_port = 0) {
    control_port_ = control_port ? control_port : FreePort();
    data_port_ = data_port ? data_port : FreePort();
    secret_a_ = WriteSecret(pki_->dir, "a", "tenant-a-secret-0123456789");
    secret_b_ = WriteSecret(pki_->dir, "b", "tenant-b-secret-9876543210");
    std::string toml = RemoteDaemonToml(*pki_, secret_a_, secret_b_, control_port_, data_port_, mutual_tls, rma) + extra_toml_;
    // The daemon's certificate alone instead of its chain.
    if (leaf_certificate_) ReplacePath(&toml, pki_->path("server-chain.pem"), pki_->path("server.pem"));
    return toml;
  }
  static void ReplacePath(std::string* toml, const std::string& from, const std::string& to) {
    toml->replace(toml->find(from), from.size(), to);
  }

  void StartDaemon(bool mutual_tls, bool rma, uint16_t control_port = 0, uint16_t data_port = 0) {
    ASSERT_TRUE(pki_->ok) << "openssl could not make the test certificates";
    const std::string toml = DaemonToml(mutual_tls, rma, control_port, data_port);
    daemon_ = std::make_unique<DaemonProcess>();
    daemon_->capture_log = true;
    daemon_->log_level = "info";
    ASSERT_TRUE(daemon_->Start(toml)) << daemon_->Log();
  }

  // The log of a daemon whose configuration names `to` where it named the file `from` (`what` it
  // then holds, for the failure message): its startup must fail.
  std::string RefusedStartupLog(const std::string& from, const std::string& to, const std::string& what) {
    std::string toml = DaemonToml(false, false);
    ReplacePath(&toml, from, to);
    DaemonProcess d;
    d.capture_log = true;
    EXPECT_FALSE(d.Start(toml)) << "the daemon started with " << what << "\n" << d.Log();
    return d.Log();
  }

  RemoteCredentials Credentials(const std::string& tenant, bool client_cert = false) const {
    RemoteCredentials c;
    c.ca_file = pki_->path("ca.pem");
    c.tenant = tenant;
    c.secret_file = tenant == "a" ? secret_a_ : secret_b_;
    if (client_cert) {
      c.cert_file = pki_->path("client.pem");
      c.key_file = pki_->path("client.key");
    }
    return c;
  }

  std::string Target() const { return "tcp://127.0.0.1:" + std::to_string(control_port_); }

  Result<std::unique_ptr<Client>> Connect(const RemoteCredentials& c, int deadline_ms = 3000) const {
    return Client::Connect({Target(), std::chrono::milliseconds(deadline_ms), "remote-test"}, c);
  }

  // A session of tenant `tenant` with one sequence whose first `tokens` rows are written
  // (row t of head h at layer l: every byte (l * 31 + h * 7 + t) & 0xff).
  struct Fixture {
    std::unique_ptr<Client> client;
    std::unique_ptr<RemoteSession> session;
    uint64_t sequence = 0;
  };
  Fixture Open(const std::string& tenant, FetchMethod method, uint32_t tokens, int deadline_ms = 2000) {
    Fixture f;
    auto c = Connect(Credentials(tenant));
    EXPECT_TRUE(c.ok()) << c.status().ToString();
    if (!c.ok()) return f;
    f.client = std::move(*c);
    auto s = RemoteSession::Open(f.client.get(), tenant, 8 << 20, {method, std::chrono::milliseconds(deadline_ms)});
    EXPECT_TRUE(s.ok()) << s.status().ToString() << "\n" << daemon_->Log();
    if (!s.ok()) return f;
    f.session = std::move(*s);
    auto seq = f.session->CreateSequence(kLayout);
    EXPECT_TRUE(seq.ok()) << seq.status().ToString();
    f.sequence = *seq;
    EXPECT_TRUE(f.session->Extend(f.sequence, tokens).ok());
    for (uint32_t l = 0; l < kLayout.n_layers; ++l) {
      for (uint32_t h = 0; h < kLayout.n_kv_heads; ++h) {
        std::vector<uint8_t> rows(tokens * kRow);
        for (uint32_t t = 0; t < tokens; ++t) std::memset(rows.data() + t * kRow, (l * 31 + h * 7 + t) & 0xff, kRow);
        Status w = f.session->WriteRows(f.sequence, l, h, 0, rows.data(), rows.size());
        EXPECT_TRUE(w.ok()) << w.ToString();
      }
    }
    return f;
  }

  static void ExpectRows(const std::vector<int32_t>& tokens, const std::vector<uint8_t>& out, uint32_t l, uint32_t h) {
    for (size_t i = 0; i < tokens.size(); ++i) {
      const uint8_t want = (l * 31 + h * 7 + tokens[i]) & 0xff;
      for (size_t b = 0; b < kRow; ++b) {
        ASSERT_EQ(out[i * kRow + b], want) << "row " << tokens[i] << " byte " << b;
      }
    }
  }

  static inline Pki* pki_ = nullptr;
  std::string extra_toml_;  // appended to the daemon's configuration by StartDaemon
  bool leaf_certificate_ = false;  // StartDaemon: tls_cert the certificate alone, not its chain
  std::string secret_a_, secret_b_;
  uint16_t control_port_ = 0, data_port_ = 0;
  std::unique_ptr<DaemonProcess> daemon_;
};

TEST_F(RemoteTest, ServerGatherReturnsTheRowsWrittenInListOrder) {
  StartDaemon(false, false);
  Fixture f = Open("a", FetchMethod::kServerGather, 100);
  ASSERT_TRUE(f.session);
  std::mt19937 rng(7);
  for (uint32_t l = 0; l < kLayout.n_layers; ++l) {
    for (uint32_t h = 0; h < kLayout.n_kv_heads; ++h) {
      std::vector<int32_t> tokens(64);
      for (auto& t : tokens) t = static_cast<int32_t>(rng() % 100);
      std::vector<uint8_t> out(tokens.size() * kRow);
      ASSERT_TRUE(f.session->ReadRows(f.sequence, l, h, tokens, out.data()).ok());
      ExpectRows(tokens, out, l, h);
    }
  }
  // Started and waited on separately (how an engine overlaps the fetch with its layers).
  std::vector<int32_t> tokens = {99, 0, 50};
  std::vector<uint8_t> out(tokens.size() * kRow);
  auto read = f.session->StartRead(f.sequence, 1, 1, tokens, out.data());
  ASSERT_TRUE(read.ok()) << read.status().ToString();
  ASSERT_TRUE(f.session->WaitRead(*read).ok());
  ExpectRows(tokens, out, 1, 1);
  EXPECT_GT(f.session->stats().requests, 4u);
}

TEST_F(RemoteTest, ClientGetsReturnTheSameRowsAsTheGather) {
  StartDaemon(false, /*rma=*/true);
  Fixture f = Open("a", FetchMethod::kClientGets, 100);
  ASSERT_TRUE(f.session);
  const std::vector<int32_t> tokens = {5, 6, 7, 8, 40, 15, 16, 17, 99, 0};  // runs across a page edge (16)
  std::vector<uint8_t> gets(tokens.size() * kRow), gather(tokens.size() * kRow);
  Status g = f.session->ReadRows(f.sequence, 1, 0, tokens, gets.data(), FetchMethod::kClientGets);
  ASSERT_TRUE(g.ok()) << g.ToString();
  ASSERT_TRUE(f.session->ReadRows(f.sequence, 1, 0, tokens, gather.data(), FetchMethod::kServerGather).ok());
  ExpectRows(tokens, gets, 1, 0);
  EXPECT_EQ(gets, gather);
  // 10 rows in 6 runs: 5-8, 15, 16-17 (new page), 40, 99, 0.
  EXPECT_EQ(f.session->stats().gets, 6u);
  // A head or layer outside the layout is refused as the gather refuses it, not read from the
  // page's neighbour.
  Status head = f.session->ReadRows(f.sequence, 0, kLayout.n_kv_heads, std::vector<int32_t>{0}, gets.data(),
                                    FetchMethod::kClientGets);
  EXPECT_EQ(head.code(), StatusCode::kOutOfRange) << head.ToString();
  Status layer = f.session->ReadRows(f.sequence, kLayout.n_layers, 0, std::vector<int32_t>{0}, gets.data(),
                                     FetchMethod::kClientGets);
  EXPECT_EQ(layer.code(), StatusCode::kOutOfRange) << layer.ToString();
}

TEST_F(RemoteTest, GetsWithoutRemoteKeysAreRefusedClearly) {
  StartDaemon(false, /*rma=*/false);
  Fixture f = Open("a", FetchMethod::kServerGather, 16);
  ASSERT_TRUE(f.session);
  std::vector<int32_t> tokens = {1};
  std::vector<uint8_t> out(kRow);
  Status s = f.session->ReadRows(f.sequence, 0, 0, tokens, out.data(), FetchMethod::kClientGets);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.ToString();
}

TEST_F(RemoteTest, RemoteSourceServesTheAgentsCalls) {
  StartDaemon(false, false);
  auto c = Connect(Credentials("a"));
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  auto s = RemoteSession::Open(c->get(), "a", 8 << 20);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  client::RemoteSource source(s->get(), 16, 256);
  ASSERT_TRUE(source.CreateSequence(1, {2, 2, 128}).ok());
  std::vector<Half> rows(40 * 256);
  for (size_t i = 0; i < rows.size(); ++i) rows[i] = FloatToHalf(static_cast<float>(i % 1000) / 8);
  ASSERT_TRUE(source.AppendRows(1, 1, 1, 0, rows.data(), 39).ok());
  ASSERT_TRUE(source.AppendRows(1, 1, 1, 39, rows.data() + 39 * 256, 1).ok());
  EXPECT_EQ(*source.Length(1, 1, 1), 40);
  const int32_t tokens[] = {39, 3, 17};
  std::vector<Half> out(3 * 256);
  ASSERT_TRUE(source.ReadRows(1, 1, 1, tokens, 3, out.data()).ok());
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(std::memcmp(out.data() + i * 256, rows.data() + tokens[i] * 256, kRow), 0) << "row " << tokens[i];
  }
  EXPECT_EQ(source.ReadRows(1, 1, 1, std::array<int32_t, 1>{40}.data(), 1, out.data()).code(), StatusCode::kOutOfRange);
}

// int8 rows over the network: what goes over UCX is the encoded rows (half the bytes at head_dim
// 128), read back decoded by every read path: ReadRows by the session's method (the server's
// gather, the client's gets), and StartReadRows / FinishReadRows (the server's gather either way).
TEST_F(RemoteTest, RemoteSourceMovesInt8RowsAndDecodesThemOnEveryReadPath) {
  StartDaemon(false, /*rma=*/true);  // the client's gets need the chunks exposed
  auto c = Connect(Credentials("a"));
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  constexpr int kHeadDim = 128, kTokens = 40;
  std::vector<Half> rows(size_t(kTokens) * 2 * kHeadDim);
  std::mt19937 rng(8);
  std::normal_distribution<float> normal(0.0f, 1.5f);
  for (Half& h : rows) h = FloatToHalf(normal(rng));
  const int32_t tokens[] = {39, 3, 17, 16};
  std::vector<Half> want(4 * 2 * kHeadDim);
  for (int i = 0; i < 4; ++i) {
    std::vector<uint8_t> one(HostRowBytes(HostRowFormat::kInt8, kHeadDim));
    EncodeHostRows(HostRowFormat::kInt8, rows.data() + size_t(tokens[i]) * 2 * kHeadDim, 1, kHeadDim, one.data());
    DecodeHostRows(HostRowFormat::kInt8, one.data(), 1, kHeadDim, want.data() + size_t(i) * 2 * kHeadDim);
  }
  for (FetchMethod method : {FetchMethod::kServerGather, FetchMethod::kClientGets}) {
    auto s = RemoteSession::Open(c->get(), "a", 8 << 20, {method});
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    client::RemoteSource source(s->get(), 16, 256);
    ASSERT_TRUE(source.CreateSequence(1, {1, 2, kHeadDim, HostRowFormat::kInt8}).ok());
    ASSERT_TRUE(source.AppendRows(1, 0, 1, 0, rows.data(), kTokens).ok());
    EXPECT_EQ(source.stored_bytes(), kTokens * HostRowBytes(HostRowFormat::kInt8, kHeadDim));
    std::vector<Half> out(want.size());
    ASSERT_TRUE(source.ReadRows(1, 0, 1, tokens, 4, out.data()).ok());
    EXPECT_EQ(out, want) << "ReadRows, method " << static_cast<int>(method);
    std::fill(out.begin(), out.end(), Half{0});
    auto read = source.StartReadRows(1, 0, 1, tokens, 4, out.data());
    ASSERT_TRUE(read.ok()) << read.status().ToString();
    ASSERT_TRUE(source.FinishReadRows(*read).ok());
    EXPECT_EQ(out, want) << "StartReadRows, method " << static_cast<int>(method);
    const client::RemoteStats stats = (*s)->stats();
    EXPECT_EQ(stats.rows_written, uint64_t{kTokens});
  }
}

// A prefill of more rows than one request may carry (kMaxRowsPerRequest) goes in several; the
// session's own WriteRows refuses such a write clearly instead of sending it (the daemon could not
// parse its header, and the session would end waiting for an answer).
TEST_F(RemoteTest, ALongPrefillGoesInSeveralRequests) {
  StartDaemon(false, false);
  auto c = Connect(Credentials("a"));
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  auto s = RemoteSession::Open(c->get(), "a", 8 << 20);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  constexpr int32_t kTokens = static_cast<int32_t>(remote::kMaxRowsPerRequest) + 1000;
  constexpr int kHeadDim = 8;  // 32-byte rows: 2 MiB of pages
  client::RemoteSource source(s->get(), 1024, kTokens);
  ASSERT_TRUE(source.CreateSequence(1, {1, 1, kHeadDim}).ok());
  std::vector<Half> rows(size_t(kTokens) * 2 * kHeadDim);
  for (size_t i = 0; i < rows.size(); ++i) rows[i] = FloatToHalf(static_cast<float>(i % 2000) / 16);
  const Status appended = source.AppendRows(1, 0, 0, 0, rows.data(), kTokens);
  ASSERT_TRUE(appended.ok()) << appended.ToString();
  const int32_t tokens[] = {0, static_cast<int32_t>(remote::kMaxRowsPerRequest) - 1,
                            static_cast<int32_t>(remote::kMaxRowsPerRequest), kTokens - 1};
  std::vector<Half> out(4 * 2 * kHeadDim);
  ASSERT_TRUE(source.ReadRows(1, 0, 0, tokens, 4, out.data()).ok());
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(std::memcmp(out.data() + i * 2 * kHeadDim, rows.data() + size_t(tokens[i]) * 2 * kHeadDim, 2 * kHeadDim * 2),
              0)
        << "row " << tokens[i];
  }
  auto daemon_id = source.DaemonSequence(1);
  ASSERT_TRUE(daemon_id.ok());
  const Status one = (*s)->WriteRows(*daemon_id, 0, 0, 0, rows.data(), rows.size() * sizeof(Half));
  EXPECT_EQ(one.code(), StatusCode::kInvalidArgument) << one.ToString();
  EXPECT_TRUE((*s)->Alive());
}

// A secret or tenant with a byte a gRPC header cannot carry is refused by the client before it
// connects; before, gRPC aborted the client's process at its first call (a secret of random
// bytes, which the daemon's config accepted too).
TEST_F(RemoteTest, AnUnsendableSecretOrTenantIsRefusedNotAnAbort) {
  StartDaemon(false, false);
  RemoteCredentials binary = Credentials("a");
  binary.secret_file = WriteSecret(pki_->dir, "binary", std::string("sixteen-bytes\x01\x02\xff-or-more"));
  auto c = Connect(binary);
  EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument) << c.status().ToString();
  EXPECT_NE(c.status().message().find("printable ASCII"), std::string::npos) << c.status().ToString();
  RemoteCredentials tenant = Credentials("a");
  tenant.tenant = "a\tb";
  auto t = Connect(tenant);
  EXPECT_EQ(t.status().code(), StatusCode::kInvalidArgument) << t.status().ToString();
  // Trailing whitespace of any kind is not part of the secret, on either side.
  RemoteCredentials spaced = Credentials("a");
  std::ifstream in(spaced.secret_file);
  const std::string real((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  spaced.secret_file = WriteSecret(pki_->dir, "spaced", real + "\t \n");
  auto ok = Connect(spaced);
  ASSERT_TRUE(ok.ok()) << ok.status().ToString();
  auto stats = (*ok)->Stats();
  EXPECT_TRUE(stats.ok()) << stats.status().ToString();
}

TEST_F(RemoteTest, WrongSecretAndOtherTenantAreRefusedBeforeAnythingIsReserved) {
  StartDaemon(false, false);
  RemoteCredentials wrong = Credentials("a");
  wrong.secret_file = WriteSecret(pki_->dir, "wrong", "not-the-secret-of-tenant-a");
  auto c = Connect(wrong);
  ASSERT_TRUE(c.ok()) << c.status().ToString();  // TLS is fine; the calls are refused
  auto s = RemoteSession::Open(c->get(), "a", 4 << 20);
  EXPECT_EQ(s.status().code(), StatusCode::kPermissionDenied) << s.status().ToString();
  EXPECT_NE(s.status().message().find("wrong tenant secret"), std::string::npos) << s.status().ToString();

  auto a = Connect(Credentials("a"));
  ASSERT_TRUE(a.ok());
  auto other = RemoteSession::Open(a->get(), "b", 4 << 20);  // a's secret, b's tenant
  EXPECT_EQ(other.status().code(), StatusCode::kPermissionDenied) << other.status().ToString();
  EXPECT_NE(other.status().message().find("not the tenant this remote client authenticated for"), std::string::npos)
      << other.status().ToString();
  // Administration stays on the host.
  auto sessions = (*a)->ListSessions();
  EXPECT_EQ(sessions.status().code(), StatusCode::kPermissionDenied);
  // Stats show the caller's tenant only.
  auto stats = (*a)->Stats();
  ASSERT_TRUE(stats.ok()) << stats.status().ToString();
  ASSERT_EQ(stats->tenants.size(), 1u);
  EXPECT_EQ(stats->tenants[0].tenant, "a");
  EXPECT_EQ(stats->reserved_bytes, 0u) << "a refused OpenSession reserved memory";
}

// A plain UCX client of its own (no client library, no hello), as a hostile peer would use one:
// its endpoints to the daemon's data port, which it force-closes at its end. It keeps the last
// challenge and the replies' headers the daemon sent it (their payloads dropped).
struct PlainUcxClient {
  ucp_context_h context = nullptr;
  ucp_worker_h worker = nullptr;
  std::vector<ucp_ep_h> endpoints;
  std::optional<remote::Challenge> challenge;
  std::vector<remote::Reply> replies;

  PlainUcxClient(const PlainUcxClient&) = delete;  // the handlers hold `this`
  PlainUcxClient& operator=(const PlainUcxClient&) = delete;
  PlainUcxClient() {
    ucp_config_t* config = nullptr;
    if (ucp_config_read(nullptr, nullptr, &config) != UCS_OK) return;
    ucp_params_t p{};
    p.field_mask = UCP_PARAM_FIELD_FEATURES;
    p.features = UCP_FEATURE_AM;
    const ucs_status_t made = ucp_init(&p, config, &context);
    ucp_config_release(config);
    ucp_worker_params_t wp{};
    if (made != UCS_OK || ucp_worker_create(context, &wp, &worker) != UCS_OK) return;
    ucp_am_handler_param_t h{};
    h.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG;
    h.arg = this;
    h.id = remote::kReply;
    h.cb = [](void* arg, const void* header, size_t length, void*, size_t, const ucp_am_recv_param_t*) {
      if (auto r = remote::ParseReply({static_cast<const uint8_t*>(header), length}); r.ok()) {
        static_cast<PlainUcxClient*>(arg)->replies.push_back(*r);
      }
      return UCS_OK;
    };
    ucp_am_handler_param_t c = h;
    c.id = remote::kChallenge;
    c.cb = [](void* arg, const void* header, size_t length, void*, size_t, const ucp_am_recv_param_t*) {
      if (auto ch = remote::ParseChallenge({static_cast<const uint8_t*>(header), length}); ch.ok()) {
        static_cast<PlainUcxClient*>(arg)->challenge = *ch;
      }
      return UCS_OK;
    };
    if (ucp_worker_set_am_recv_handler(worker, &h) != UCS_OK || ucp_worker_set_am_recv_handler(worker, &c) != UCS_OK) {
      ucp_worker_destroy(worker);
      worker = nullptr;
    }
  }
  ~PlainUcxClient() {
    for (ucp_ep_h h : endpoints) {
      ucp_request_param_t close{};
      close.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
      close.flags = UCP_EP_CLOSE_FLAG_FORCE;
      Finish(ucp_ep_close_nbx(h, &close));
    }
    if (worker) ucp_worker_destroy(worker);
    if (context) ucp_cleanup(context);
  }
  bool ok() const { return worker != nullptr; }

  // An endpoint to 127.0.0.1:port (errors on it, the daemon closing it say, are expected), or null.
  ucp_ep_h Connect(uint16_t port) {
    auto addr = remote::ResolveAddress("127.0.0.1:" + std::to_string(port));
    if (!addr.ok()) return nullptr;
    ucp_ep_params_t ep{};
    ep.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                    UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep.err_handler.cb = [](void*, ucp_ep_h, ucs_status_t) {};
    ep.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
    ep.sockaddr.addr = addr->get();
    ep.sockaddr.addrlen = addr->length;
    ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    ucp_ep_h h = nullptr;
    if (ucp_ep_create(worker, &ep, &h) != UCS_OK) return nullptr;
    endpoints.push_back(h);
    return h;
  }
  // Progresses until `done` or for at most `how_long`; whether it is done.
  bool ProgressUntil(const std::function<bool()>& done, std::chrono::milliseconds how_long) {
    const auto until = std::chrono::steady_clock::now() + how_long;
    while (!done() && std::chrono::steady_clock::now() < until) ucp_worker_progress(worker);
    return done();
  }
  // Progresses the worker for `how_long`.
  void Progress(std::chrono::milliseconds how_long) {
    ProgressUntil([] { return false; }, how_long);
  }
  // Progresses until a request UCX returned is done, then frees it (nothing to do for one done at once).
  void Finish(ucs_status_ptr_t request) {
    if (!UCS_PTR_IS_PTR(request)) return;
    while (ucp_request_check_status(request) == UCS_INPROGRESS) ucp_worker_progress(worker);
    ucp_request_free(request);
  }
  // Sends an active message on `ep` asking for a reply on it, eagerly (its footer, with the
  // endpoint id the daemon reads, is packed at the call), and waits until UCX is done with it.
  void SendNow(ucp_ep_h ep, uint16_t id, const void* header, size_t header_bytes, const void* payload = nullptr,
               size_t payload_bytes = 0) {
    ucp_request_param_t send{};
    send.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    send.flags = UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_EAGER;
    Finish(ucp_am_send_nbx(ep, id, header, header_bytes, payload, payload_bytes, &send));
  }
};

// The endpoint id that `ep`'s messages carry for the daemon to name their endpoint by, as a hostile
// peer's modified libucp would write any: UCX tells the daemon which endpoint a message came from
// by an id the *sender* writes into each active message's footer (ucp_am_handler_reply:
// UCP_WORKER_GET_VALID_EP_BY_ID(..., ftr->ep_id, ...)); with UCP_ERR_HANDLING_MODE_PEER those ids
// are sequential (3, 5, 7, ...). Found by patching this process's own ucp_ep (UCX 1.13.1 layout:
// ucp_ep_ext_gen_t at ep + 128 KiB, its control_ext pointer at +48, remote_ep_id at +16 of that),
// once the connection is up; null (and a test failure) where the layout is not UCX 1.13's.
uint64_t* ForgeableRemoteId(PlainUcxClient& ucx, ucp_ep_h ep) {
  auto* ext_gen = reinterpret_cast<uint8_t*>(ep) + 128 * 1024;
  uint8_t* control_ext = nullptr;
  std::memcpy(&control_ext, ext_gen + 48, sizeof control_ext);
  EXPECT_NE(control_ext, nullptr);
  if (!control_ext) return nullptr;
  auto* remote_id = reinterpret_cast<uint64_t*>(control_ext + 16);
  ucx.ProgressUntil([&] { return *remote_id != 0; }, std::chrono::seconds(1));
  ucx.Progress(std::chrono::milliseconds(300));  // the wireup's last messages
  const uint64_t own = *remote_id;
  const bool layout_known = own != 0 && (own & 1) && own < (1u << 20);
  EXPECT_TRUE(layout_known) << "not UCX 1.13's layout: remote id " << own;
  return layout_known ? remote_id : nullptr;
}

// A hostile peer that names other clients' endpoints: its messages go out as from every endpoint
// id the daemon gave out before its own.
struct Forger {
  PlainUcxClient ucx;
  ucp_ep_h ep = nullptr;
  uint64_t* remote_id = nullptr;
  uint64_t own = 0;
  explicit Forger(uint16_t data_port) {
    if (ucx.ok()) ep = ucx.Connect(data_port);
    if (ep) remote_id = ForgeableRemoteId(ucx, ep);
    if (remote_id) own = *remote_id;
  }
  bool ok() const { return remote_id != nullptr; }
  // `send`, its messages carrying endpoint id `id`.
  void As(uint64_t id, const std::function<void()>& send) {
    *remote_id = id;
    send();
    *remote_id = own;
  }
  // `send` once per endpoint id before its own, then time for the daemon to take them.
  void ToEveryEarlierEndpoint(const std::function<void()>& send) {
    for (uint64_t id = 3; id < own; id += 2) As(id, send);
    ucx.Progress(std::chrono::milliseconds(300));
  }
  void Send(uint16_t id, const void* header, size_t header_bytes, const void* payload = nullptr, size_t payload_bytes = 0) {
    ucx.SendNow(ep, id, header, header_bytes, payload, payload_bytes);
  }
};

// A UCX listener that accepts connections and never says anything on them: a daemon older than
// the challenge, as a client sees one. Its worker is progressed by a thread of its own.
struct SilentListener {
  PlainUcxClient ucx;
  ucp_listener_h listener = nullptr;
  uint16_t port = 0;
  std::atomic<bool> stop{false};
  std::atomic<int> accepted{0};
  std::thread thread;

  SilentListener() {
    auto addr = remote::ResolveAddress("127.0.0.1:0");
    if (!ucx.ok() || !addr.ok()) return;
    ucp_listener_params_t lp{};
    lp.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
    lp.sockaddr.addr = addr->get();
    lp.sockaddr.addrlen = addr->length;
    lp.conn_handler.arg = this;
    lp.conn_handler.cb = [](ucp_conn_request_h request, void* arg) {
      auto* self = static_cast<SilentListener*>(arg);
      ucp_ep_params_t p{};
      p.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
      p.conn_request = request;
      p.err_mode = UCP_ERR_HANDLING_MODE_PEER;
      p.err_handler.cb = [](void*, ucp_ep_h, ucs_status_t) {};
      ucp_ep_h ep = nullptr;
      if (ucp_ep_create(self->ucx.worker, &p, &ep) != UCS_OK) return;
      self->ucx.endpoints.push_back(ep);  // closed by ucx's destructor, after the thread stopped
      ++self->accepted;
    };
    if (ucp_listener_create(ucx.worker, &lp, &listener) != UCS_OK) return;
    ucp_listener_attr_t attr{};
    attr.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
    if (ucp_listener_query(listener, &attr) != UCS_OK) return;
    port = ntohs(reinterpret_cast<const sockaddr_in*>(&attr.sockaddr)->sin_port);
    thread = std::thread([this] {
      while (!stop.load()) ucp_worker_progress(ucx.worker);
    });
  }
  ~SilentListener() {
    stop = true;
    if (thread.joinable()) thread.join();
    if (listener) ucp_listener_destroy(listener);
  }
};

// A raw data-plane endpoint, as a hostile client would use it. Its requests carry the session id
// and token of its last hello (none before one).
struct RawEndpoint {
  std::unique_ptr<client::UcxEndpoint> ep;
  uint64_t session = 0;
  std::array<uint8_t, attach::kTokenBytes> token{};
  Status Hello(uint64_t id, const std::string& hello_token) {
    remote::Hello h;
    h.session_id = id;
    std::memcpy(h.token.data(), hello_token.data(), std::min(hello_token.size(), h.token.size()));
    session = h.session_id;
    token = h.token;
    return ep->Call(remote::kHello, &h, sizeof h, nullptr, 0, nullptr, 1 << 20,
                    std::chrono::steady_clock::now() + std::chrono::seconds(3));
  }
  remote::RowsRequest Request(uint64_t sequence, uint32_t n) const {
    remote::RowsRequest r;
    r.session_id = session;
    r.token = token;
    r.sequence = sequence;
    r.n = n;
    return r;
  }
  Status Gather(uint64_t sequence, std::vector<int32_t> tokens) {
    remote::RowsRequest r = Request(sequence, static_cast<uint32_t>(tokens.size()));
    std::vector<uint8_t> out;
    return ep->Call(remote::kGather, &r, sizeof r, tokens.data(), tokens.size() * 4, &out, tokens.size() * kRow,
                    std::chrono::steady_clock::now() + std::chrono::seconds(3));
  }
};

// A session opened with raw calls, as a hostile client would (and as the data-plane tests need
// its token).
struct RawSession {
  uint64_t id = 0;
  std::string token;
  std::string tenant, secret;
  std::unique_ptr<v1::Control::Stub> stub;
  void Authenticate(grpc::ClientContext* ctx) const {
    ctx->AddMetadata("x-specache-tenant", tenant);
    ctx->AddMetadata("x-specache-secret", secret);
  }
  // A sequence of kLayout with `tokens` tokens of pages.
  uint64_t Sequence(uint32_t tokens) const {
    grpc::ClientContext ctx, ctx2;
    Authenticate(&ctx);
    Authenticate(&ctx2);
    v1::CreateSequenceRequest req;
    req.set_session_id(id);
    req.set_token(token);
    v1::SequenceLayout* l = req.mutable_layout();
    l->set_n_layers(kLayout.n_layers);
    l->set_n_kv_heads(kLayout.n_kv_heads);
    l->set_head_dim(kLayout.head_dim);
    l->set_page_tokens(kLayout.page_tokens);
    l->set_capacity_tokens(kLayout.capacity_tokens);
    v1::CreateSequenceResponse created;
    EXPECT_TRUE(stub->CreateSequence(&ctx, req, &created).ok());
    v1::ExtendSequenceRequest ext;
    ext.set_session_id(id);
    ext.set_token(token);
    ext.set_sequence_id(created.sequence_id());
    ext.set_tokens(tokens);
    v1::ExtendSequenceResponse extended;
    EXPECT_TRUE(stub->ExtendSequence(&ctx2, ext, &extended).ok());
    return created.sequence_id();
  }
  Status Close() const {
    grpc::ClientContext ctx;
    Authenticate(&ctx);
    v1::CloseSessionRequest req;
    req.set_session_id(id);
    req.set_token(token);
    v1::CloseSessionResponse resp;
    const grpc::Status s = stub->CloseSession(&ctx, req, &resp);
    return s.ok() ? Status::Ok() : Status::Unavailable(s.error_message());
  }
};

// A gRPC channel to the daemon's TLS control port that trusts the test CA (no tenant secret: the
// caller adds it per call, or leaves it out).
std::shared_ptr<grpc::Channel> TlsControlChannel(const Pki& pki, uint16_t control_port) {
  grpc::SslCredentialsOptions tls;
  std::ifstream ca(pki.path("ca.pem"));
  tls.pem_root_certs.assign(std::istreambuf_iterator<char>(ca), std::istreambuf_iterator<char>());
  return grpc::CreateChannel("127.0.0.1:" + std::to_string(control_port), grpc::SslCredentials(tls));
}

RawSession OpenRawSession(const Pki& pki, uint16_t control_port, const std::string& tenant = "a",
                          const std::string& secret = "tenant-a-secret-0123456789") {
  RawSession r;
  r.tenant = tenant;
  r.secret = secret;
  r.stub = v1::Control::NewStub(TlsControlChannel(pki, control_port));
  grpc::ClientContext ctx;
  r.Authenticate(&ctx);
  v1::OpenSessionRequest req;
  req.set_tenant(tenant);
  req.set_pool_bytes(4 << 20);
  v1::OpenSessionResponse resp;
  EXPECT_TRUE(r.stub->OpenSession(&ctx, req, &resp).ok());
  r.id = resp.session_id();
  r.token = resp.token();
  return r;
}

// A raw endpoint to the data port at `data_port` that said its hello for `session` (its ep null
// when the connection or the hello failed).
RawEndpoint HelloedEndpoint(uint16_t data_port, const RawSession& session) {
  RawEndpoint e;
  auto raw = client::UcxEndpoint::Connect("127.0.0.1:" + std::to_string(data_port), false);
  if (!raw.ok()) return e;
  e.ep = std::move(*raw);
  if (!e.Hello(session.id, session.token).ok()) e.ep.reset();
  return e;
}

TEST_F(RemoteTest, DataPlaneRefusesForgedTokensStaleSessionsOtherTenantsAndBadRowsAndKeepsServing) {
  StartDaemon(false, false);
  Fixture a = Open("a", FetchMethod::kServerGather, 32);
  Fixture b = Open("b", FetchMethod::kServerGather, 32);
  ASSERT_TRUE(a.session && b.session);
  const std::string addr = "127.0.0.1:" + std::to_string(data_port_);

  // A request before the hello: dropped unanswered (its sender may be another peer naming the
  // endpoint); the endpoint, with no hello, is closed at the lease (1 s, before the 3 s deadline).
  auto raw = client::UcxEndpoint::Connect(addr, false);
  ASSERT_TRUE(raw.ok());
  RawEndpoint early{std::move(*raw)};
  Status before = early.Gather(a.sequence, {1});
  EXPECT_TRUE(before.code() == StatusCode::kUnavailable || before.code() == StatusCode::kDeadlineExceeded)
      << before.ToString() << "\n" << daemon_->Log();
  EXPECT_NE(daemon_->Log().find("message 2 on an endpoint before its hello, not a hello of version 3 with the endpoint's "
                                "challenge, dropped"),
            std::string::npos)
      << daemon_->Log();
  EXPECT_NE(daemon_->Log().find("closed: no hello within the lease"), std::string::npos) << daemon_->Log();

  // A forged token for b's session.
  raw = client::UcxEndpoint::Connect(addr, false);
  ASSERT_TRUE(raw.ok());
  RawEndpoint forged{std::move(*raw)};
  Status f = forged.Hello(b.session->id(), std::string(16, 'x'));
  EXPECT_EQ(f.code(), StatusCode::kPermissionDenied) << f.ToString();
  EXPECT_NE(f.message().find("wrong token"), std::string::npos) << f.ToString();

  // A session that ended: its id and token are stale.
  const uint64_t ended = a.session->id();
  a.session.reset();
  raw = client::UcxEndpoint::Connect(addr, false);
  ASSERT_TRUE(raw.ok());
  RawEndpoint stale{std::move(*raw)};
  Status st = stale.Hello(ended, std::string(16, '\0'));
  EXPECT_EQ(st.code(), StatusCode::kNotFound) << st.ToString();

  // A session of its own (opened with raw calls, as a hostile client would) asking for b's
  // sequence: the daemon's NOT_FOUND, not the client library's.
  {
    RawSession mine = OpenRawSession(*pki_, control_port_, "b", "tenant-b-secret-9876543210");
    ASSERT_NE(mine.id, 0u);
    raw = client::UcxEndpoint::Connect(addr, false);
    ASSERT_TRUE(raw.ok());
    RawEndpoint other{std::move(*raw)};
    ASSERT_TRUE(other.Hello(mine.id, mine.token).ok());
    Status theirs = other.Gather(b.sequence, {1});
    EXPECT_EQ(theirs.code(), StatusCode::kNotFound) << "another session's sequence: " << theirs.ToString();
    EXPECT_NE(theirs.message().find("is not in session"), std::string::npos) << theirs.ToString();
  }

  // b's own endpoint: rows beyond the pages, negative rows, a layer outside the layout.
  std::vector<uint8_t> out(4 * kRow);
  const std::vector<int32_t> beyond = {1, 32};
  Status r = b.session->ReadRows(b.sequence, 0, 0, beyond, out.data());
  EXPECT_EQ(r.code(), StatusCode::kOutOfRange) << r.ToString();
  EXPECT_NE(r.message().find("row 32 (entry 1)"), std::string::npos) << r.ToString();
  r = b.session->ReadRows(b.sequence, 0, 0, std::vector<int32_t>{-1}, out.data());
  EXPECT_EQ(r.code(), StatusCode::kOutOfRange) << r.ToString();
  r = b.session->ReadRows(b.sequence, 2, 0, std::vector<int32_t>{1}, out.data());
  EXPECT_EQ(r.code(), StatusCode::kOutOfRange) << r.ToString();
  Status w = b.session->WriteRows(b.sequence, 0, 0, 30, out.data(), 4 * kRow);
  EXPECT_EQ(w.code(), StatusCode::kOutOfRange) << "write past the pages: " << w.ToString();

  // b still works, and the refusals were logged.
  const std::vector<int32_t> fine = {0, 31};
  ASSERT_TRUE(b.session->ReadRows(b.sequence, 1, 1, fine, out.data()).ok());
  ExpectRows(fine, std::vector<uint8_t>(out.begin(), out.begin() + 2 * kRow), 1, 1);
  EXPECT_TRUE(b.session->Alive());
  EXPECT_NE(daemon_->Log().find("remote data plane: refused"), std::string::npos);
  auto stats = b.client->Stats();  // counted too: 7 refusals above
  ASSERT_TRUE(stats.ok()) << stats.status().ToString();
  EXPECT_GE(stats->remote_refused, 7u) << daemon_->Log();
  EXPECT_GE(stats->remote_connections, 1u);
}

// Payloads are checked against their headers before the daemon receives them, and the refusal
// reaches the request that made it (its id), not a deadline: a write larger than its rows can be,
// a write whose bytes are not its header's rows, and a hello with a payload.
// Peers that connect to the data plane and never say hello (no secret, no token needed) cannot
// hold every slot: when the data plane is full, the endpoint that has waited longest for its hello
// makes room for a new connection. Before, they held the slots until the lease (2 s) and could
// take them again as fast, so every legitimate session was rejected at the listener. And a
// message whose header is larger than any of the protocol's is dropped uncopied.
TEST_F(RemoteTest, EndpointsThatNeverSayHelloCannotHoldEverySlot) {
  extra_toml_ = "[limits]\nattach_connections = 4\n";
  StartDaemon(false, false);
  // A plain UCX client: six endpoints to the data port, progressed until connected, then silent.
  PlainUcxClient ucx;
  ASSERT_TRUE(ucx.ok());
  for (int i = 0; i < 6; ++i) {
    ASSERT_NE(ucx.Connect(data_port_), nullptr);
    ucx.Progress(std::chrono::milliseconds(100));
  }
  // Within the lease: a legitimate session gets a slot and is served.
  Fixture f = Open("a", FetchMethod::kServerGather, 20);
  ASSERT_TRUE(f.session) << daemon_->Log();
  std::vector<int32_t> tokens = {3, 1, 4};
  std::vector<uint8_t> out(tokens.size() * kRow);
  ASSERT_TRUE(f.session->ReadRows(f.sequence, 0, 0, tokens, out.data()).ok());
  ExpectRows(tokens, out, 0, 0);
  EXPECT_NE(daemon_->Log().find("no hello yet when the data plane was full"), std::string::npos) << daemon_->Log();
  // A header larger than any of the protocol's (fixed structs) is dropped uncopied (before the
  // hello, as any message but the hello with the endpoint's challenge).
  const std::vector<uint8_t> huge_header(4096, 0);
  ucp_request_param_t send{};
  send.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  send.flags = UCP_AM_SEND_FLAG_REPLY;
  ucs_status_ptr_t sent = ucp_am_send_nbx(ucx.endpoints.back(), remote::kGather, huge_header.data(), huge_header.size(),
                                          nullptr, 0, &send);
  const std::string dropped = "message 2 on an endpoint before its hello";
  EXPECT_TRUE(ucx.ProgressUntil([&] { return daemon_->Log().find(dropped) != std::string::npos; }, std::chrono::seconds(2)))
      << daemon_->Log();
  if (UCS_PTR_IS_PTR(sent)) {
    ucx.ProgressUntil([&] { return ucp_request_check_status(sent) != UCS_INPROGRESS; }, std::chrono::seconds(1));
    ucp_request_free(sent);
  }
}

TEST_F(RemoteTest, OversizedAndMismatchedPayloadsAreRefusedToTheirRequest) {
  StartDaemon(false, false);
  const std::string addr = "127.0.0.1:" + std::to_string(data_port_);
  RawSession raw = OpenRawSession(*pki_, control_port_);
  auto ep = client::UcxEndpoint::Connect(addr, false);
  ASSERT_TRUE(ep.ok());
  RawEndpoint mine{std::move(*ep)};
  ASSERT_TRUE(mine.Hello(raw.id, raw.token).ok()) << daemon_->Log();
  const uint64_t sequence = raw.Sequence(32);  // once attached
  auto write = [&](uint32_t n, size_t bytes) {
    remote::RowsRequest r = mine.Request(sequence, n);
    std::vector<uint8_t> rows(bytes, 0x5a);
    return mine.ep->Call(remote::kWrite, &r, sizeof r, rows.data(), rows.size(), nullptr, 0,
                         std::chrono::steady_clock::now() + std::chrono::seconds(3));
  };
  // 2 rows can be at most 2 x 4 KiB; 1 MiB is refused (sent by rendezvous: never fetched).
  Status big = write(2, 1 << 20);
  EXPECT_EQ(big.code(), StatusCode::kInvalidArgument) << big.ToString();
  EXPECT_NE(big.message().find("more than its rows can be"), std::string::npos) << big.ToString();
  // The endpoint lives on: 3 rows' header with 2 rows' bytes, then a right one.
  Status mismatched = write(3, 2 * kRow);
  EXPECT_EQ(mismatched.code(), StatusCode::kInvalidArgument) << mismatched.ToString();
  EXPECT_NE(mismatched.message().find("a write of 3 rows of 512 bytes came with 1024 bytes"), std::string::npos)
      << mismatched.ToString();
  Status right = write(2, 2 * kRow);
  EXPECT_TRUE(right.ok()) << right.ToString();
  // A hello with a payload is refused.
  ep = client::UcxEndpoint::Connect(addr, false);
  ASSERT_TRUE(ep.ok());
  remote::Hello h;
  h.session_id = raw.id;
  std::string payload(64, 'p');
  Status hello = (*ep)->Call(remote::kHello, &h, sizeof h, payload.data(), payload.size(), nullptr, 1 << 20,
                             std::chrono::steady_clock::now() + std::chrono::seconds(3));
  EXPECT_EQ(hello.code(), StatusCode::kInvalidArgument) << hello.ToString();
  EXPECT_NE(hello.message().find("carries no payload"), std::string::npos) << hello.ToString();
}

// With `rma`, a closed session's chunks go back to the pool only after its endpoint dropped the
// remote keys that reach them: the daemon logs the endpoint's close before the session's reclaim
// (before, CloseSession returned the chunks at once and the keys lived until the next sweep).
// CloseSession still returns with the chunks back: it waits for the endpoint's close.
TEST_F(RemoteTest, AClosedSessionsRemoteKeysAreDroppedBeforeItsChunksGoBack) {
  StartDaemon(false, /*rma=*/true);
  RawSession raw = OpenRawSession(*pki_, control_port_);
  auto ep = client::UcxEndpoint::Connect("127.0.0.1:" + std::to_string(data_port_), false);
  ASSERT_TRUE(ep.ok());
  RawEndpoint keys{std::move(*ep)};
  ASSERT_TRUE(keys.Hello(raw.id, raw.token).ok()) << daemon_->Log();
  ASSERT_TRUE(raw.Close().ok());
  const std::string reclaimed = "session " + std::to_string(raw.id) + " reclaimed";
  const std::string closed = "endpoint of session " + std::to_string(raw.id) + " closed";
  std::string log;
  for (int i = 0; i < 300 && log.find(reclaimed) == std::string::npos; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    log = daemon_->Log();
  }
  ASSERT_NE(log.find(reclaimed), std::string::npos) << "the closed session's chunks went back\n" << log;
  ASSERT_NE(log.find(closed), std::string::npos) << log;
  EXPECT_LT(log.find(closed), log.find(reclaimed)) << log;
}

// A TCP connection to the control port that never starts its TLS handshake (anyone who reaches
// the port can open one, before any secret is checked) is closed by the daemon after 10 s, not
// kept for gRPC's default 120 s towards the descriptor limit the local sockets share.
TEST_F(RemoteTest, AControlConnectionThatNeverHandshakesIsClosed) {
  StartDaemon(false, false);
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(control_port_);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(connect(fd, reinterpret_cast<const sockaddr*>(&a), sizeof a), 0);
  timeval wait{25, 0};
  ASSERT_EQ(setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &wait, sizeof wait), 0);
  const auto start = std::chrono::steady_clock::now();
  char byte = 0;
  const ssize_t n = recv(fd, &byte, 1, 0);  // 0 (or an error) once the daemon closed it
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LE(n, 0);
  EXPECT_LT(waited, 20.0) << "the connection was still open after " << waited << " s";
  ::close(fd);
}

// A TCP connection to the control port from `source` (a loopback address), not yet handshaken.
int RawControlConnection(uint16_t port, const char* source) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  sockaddr_in from{};
  from.sin_family = AF_INET;
  inet_pton(AF_INET, source, &from.sin_addr);
  sockaddr_in to{};
  to.sin_family = AF_INET;
  to.sin_port = htons(port);
  to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (bind(fd, reinterpret_cast<const sockaddr*>(&from), sizeof from) != 0 ||
      connect(fd, reinterpret_cast<const sockaddr*>(&to), sizeof to) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// Whether the daemon closed the connection within `ms` (an end of stream or a reset; a connection
// it keeps waits for its TLS handshake, 10 s).
bool ClosedWithin(int fd, int ms) {
  timeval wait{ms / 1000, (ms % 1000) * 1000};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &wait, sizeof wait);
  char byte = 0;
  const ssize_t n = recv(fd, &byte, 1, 0);
  return n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK);
}

// Whether gRPC serves the connection: a TLS handshake on it completes (ALPN h2, as gRPC's clients
// offer; the daemon's certificate is not checked here) within 5 s.
bool HandshakeCompletes(int fd) {
  signal(SIGPIPE, SIG_IGN);  // a connection the daemon closed fails the write instead of ending the test
  timeval wait{5, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &wait, sizeof wait);
  std::unique_ptr<SSL_CTX, decltype(&SSL_CTX_free)> ctx(SSL_CTX_new(TLS_client_method()), SSL_CTX_free);
  if (!ctx) return false;
  static const unsigned char kH2[] = {2, 'h', '2'};
  SSL_CTX_set_alpn_protos(ctx.get(), kH2, sizeof kH2);
  std::unique_ptr<SSL, decltype(&SSL_free)> ssl(SSL_new(ctx.get()), SSL_free);
  return ssl && SSL_set_fd(ssl.get(), fd) == 1 && SSL_connect(ssl.get()) == 1;
}

// Anyone who reaches the control port can open connections before any secret is checked: past
// [remote] control_connections_per_address from one address, or control_connections in all, the
// daemon closes a new one at once (logged, counted in refused_connections); one that ends gives
// its place back.
TEST_F(RemoteTest, ControlConnectionsPastTheCapsAreClosedAtAccept) {
  extra_toml_ = "control_connections = 3\ncontrol_connections_per_address = 2\n";  // into [remote], the last table
  StartDaemon(false, false);
  // Connections within the caps are handed to gRPC, which serves them (a TLS handshake completes).
  std::vector<int> held;
  for (int i = 0; i < 2; ++i) {
    held.push_back(RawControlConnection(control_port_, "127.0.0.1"));
    ASSERT_GE(held.back(), 0) << strerror(errno);
    EXPECT_TRUE(HandshakeCompletes(held.back())) << "connection " << i << " of 127.0.0.1, within the caps";
  }
  const int third_of_one = RawControlConnection(control_port_, "127.0.0.1");
  ASSERT_GE(third_of_one, 0) << strerror(errno);
  EXPECT_TRUE(ClosedWithin(third_of_one, 5000)) << "a third connection of 127.0.0.1 (2 per address) was kept";
  ::close(third_of_one);
  held.push_back(RawControlConnection(control_port_, "127.0.0.2"));
  ASSERT_GE(held.back(), 0) << strerror(errno);
  EXPECT_TRUE(HandshakeCompletes(held.back())) << "the first connection of 127.0.0.2, within the caps";
  const int fourth_in_all = RawControlConnection(control_port_, "127.0.0.2");
  ASSERT_GE(fourth_in_all, 0) << strerror(errno);
  EXPECT_TRUE(ClosedWithin(fourth_in_all, 5000)) << "a fourth connection (3 in all) was kept";
  ::close(fourth_in_all);

  // A connection that ends gives its place back once gRPC has closed its side: well within the
  // 10 s in which the handshake timeout would have freed places anyway (the held ones are handshaken).
  ::close(held.front());
  held.erase(held.begin());
  bool admitted = false;
  const auto ended = std::chrono::steady_clock::now();
  while (!admitted && std::chrono::steady_clock::now() - ended < std::chrono::seconds(3)) {
    const int fd = RawControlConnection(control_port_, "127.0.0.1");
    ASSERT_GE(fd, 0) << strerror(errno);
    admitted = HandshakeCompletes(fd);
    if (admitted) held.push_back(fd); else ::close(fd);
  }
  EXPECT_TRUE(admitted) << "no place came back within 3 s after a connection of 127.0.0.1 ended\n" << daemon_->Log();
  for (int fd : held) ::close(fd);

  // Clients with the secret are served once places are free, and the refusals were counted and
  // logged with the cap that refused them.
  Result<client::DaemonStats> stats = Status::Unavailable("not asked");
  for (int attempt = 0; attempt < 50 && !stats.ok(); ++attempt) {
    auto c = Connect(Credentials("a"));
    if (c.ok()) stats = (*c)->Stats();
    if (!stats.ok()) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  ASSERT_TRUE(stats.ok()) << stats.status().ToString() << "\n" << daemon_->Log();
  EXPECT_GE(stats->refused_connections, 2u);
  const std::string log = daemon_->Log();
  EXPECT_NE(log.find("remote: control connection from 127.0.0.1 closed: 2 control connections open (2 from address 127.0.0.1), "
                     "limits 3 and 2 per address ([remote] in the config)"),
            std::string::npos)
      << log;
  EXPECT_NE(log.find("remote: control connection from 127.0.0.2 closed: 3 control connections open (1 from address "
                     "127.0.0.2)"),
            std::string::npos)
      << log;
}

// Credentials a TLS server cannot use stop the startup, naming the file: the daemon accepts the
// port's connections itself, and gRPC would take them and never answer.
TEST_F(RemoteTest, AKeyThatDoesNotMatchTheCertificateStopsTheStartup) {
  ASSERT_TRUE(pki_->ok) << "openssl could not make the test certificates";
  const std::string key = pki_->path("server.key"), other = pki_->path("client.key");
  const std::string mismatched = RefusedStartupLog(key, other, "another certificate's key");
  EXPECT_NE(mismatched.find("remote.tls_key " + other + " does not match the certificate of remote.tls_cert"),
            std::string::npos)
      << mismatched;
  // The right key, encrypted: gRPC has no passphrase for it, and the daemon asks for none (it would
  // otherwise read one from the terminal or stdin).
  const std::string encrypted = pki_->path("server-encrypted.key");
  int code = -1;
  RunCommand("openssl pkey -in " + key + " -aes256 -passout pass:x -out " + encrypted + " 2>&1", &code);
  ASSERT_EQ(code, 0) << "openssl could not encrypt the key";
  ASSERT_EQ(chmod(encrypted.c_str(), 0600), 0);
  const std::string locked = RefusedStartupLog(key, encrypted, "an encrypted key");
  EXPECT_NE(locked.find("remote.tls_key " + encrypted + " is not a usable private key"), std::string::npos) << locked;
}

// A certificate chain whose issuer's certificate is damaged stops the startup, as OpenSSL's own
// loading of a chain file would (gRPC alone starts with it).
TEST_F(RemoteTest, ADamagedCertificateChainStopsTheStartup) {
  ASSERT_TRUE(pki_->ok) << "openssl could not make the test certificates";
  const std::string damaged = pki_->path("server-damaged-chain.pem");
  std::ofstream(damaged) << std::ifstream(pki_->path("server.pem")).rdbuf()
                         << "-----BEGIN CERTIFICATE-----\nbm90IGEgY2VydGlmaWNhdGU=\n-----END CERTIFICATE-----\n";
  const std::string log = RefusedStartupLog(pki_->path("server-chain.pem"), damaged, "a damaged certificate chain");
  EXPECT_NE(log.find("remote.tls_cert " + damaged + " is not a usable certificate chain"), std::string::npos) << log;
}

// A handshaken control connection with no call in progress is closed after [remote]
// idle_close_ms: a caller without the secret cannot hold it open, and a client that paused
// reconnects at its next call.
TEST_F(RemoteTest, AnIdleControlConnectionIsClosedAndItsClientReconnects) {
  extra_toml_ = "idle_close_ms = 1000\n";  // [remote] is the configuration's last table: the key goes there
  StartDaemon(false, false);
  auto channel = TlsControlChannel(*pki_, control_port_);
  auto stub = v1::Control::NewStub(channel);
  {  // one call without the tenant's secret: answered (refused), the connection stays up
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(3));
    v1::StatsResponse resp;
    const grpc::Status st = stub->Stats(&ctx, v1::StatsRequest(), &resp);
    EXPECT_NE(st.error_code(), grpc::StatusCode::UNAVAILABLE) << st.error_message();
  }
  ASSERT_EQ(channel->GetState(false), GRPC_CHANNEL_READY);
  const auto start = std::chrono::steady_clock::now();
  EXPECT_TRUE(channel->WaitForStateChange(GRPC_CHANNEL_READY, std::chrono::system_clock::now() + std::chrono::seconds(10)))
      << "the idle connection was still open after 10 s";
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(6));
  // A client that paused longer than that works on.
  auto c = Connect(Credentials("a"));
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  ASSERT_TRUE((*c)->Stats().ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  auto again = (*c)->Stats();
  EXPECT_TRUE(again.ok()) << again.status().ToString();
}

// A connection kept busy with refused calls is never idle, but it grows old: at
// max_connection_ms the daemon tells it to go away (the channel leaves READY between two calls),
// and the next call reconnects.
TEST_F(RemoteTest, ABusyControlConnectionIsClosedWhenItGrowsOld) {
  extra_toml_ = "idle_close_ms = 60000\nmax_connection_ms = 500\n";  // into [remote], the last table
  StartDaemon(false, false);
  auto channel = TlsControlChannel(*pki_, control_port_);
  auto stub = v1::Control::NewStub(channel);
  bool left_ready = false;
  int calls = 0;
  const auto start = std::chrono::steady_clock::now();
  while (!left_ready && std::chrono::steady_clock::now() - start < std::chrono::seconds(8)) {
    if (calls > 0 && channel->GetState(false) != GRPC_CHANNEL_READY) left_ready = true;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(3));
    v1::StatsResponse resp;
    const grpc::Status st = stub->Stats(&ctx, v1::StatsRequest(), &resp);  // no secret: refused
    EXPECT_NE(st.error_code(), grpc::StatusCode::UNAVAILABLE) << st.error_message();
    ++calls;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_TRUE(left_ready) << "a connection kept busy for 8 s (" << calls << " calls) was never told to go away";
}

TEST_F(RemoteTest, PlaintextToTheTlsPortFailsCleanly) {
  StartDaemon(false, false);
  auto channel = grpc::CreateChannel("127.0.0.1:" + std::to_string(control_port_), grpc::InsecureChannelCredentials());
  auto stub = v1::Control::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
  v1::StatsResponse resp;
  const auto start = std::chrono::steady_clock::now();
  grpc::Status s = stub->Stats(&ctx, v1::StatsRequest(), &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(3));
  // The daemon serves TLS clients after that.
  auto c = Connect(Credentials("a"));
  ASSERT_TRUE(c.ok());
  EXPECT_TRUE((*c)->Stats().ok());
}

TEST_F(RemoteTest, MutualTlsRefusesClientsWithoutTheRightCertificate) {
  leaf_certificate_ = true;  // the other tests' daemons serve the chain
  StartDaemon(/*mutual_tls=*/true, false);
  auto none = Connect(Credentials("a"), 1500);
  EXPECT_EQ(none.status().code(), StatusCode::kUnavailable) << "no client certificate: " << none.status().ToString();
  RemoteCredentials stranger = Credentials("a");
  stranger.cert_file = pki_->path("stranger.pem");
  stranger.key_file = pki_->path("stranger.key");
  auto wrong = Connect(stranger, 1500);
  EXPECT_EQ(wrong.status().code(), StatusCode::kUnavailable) << "other CA: " << wrong.status().ToString();
  // A generous deadline: what is tested is that it is served, and on a loaded 2-core CI machine the
  // handshake after the two refusals once took over the default 3 s.
  auto right = Connect(Credentials("a", /*client_cert=*/true), 10000);
  ASSERT_TRUE(right.ok()) << right.status().ToString();
  auto s = RemoteSession::Open(right->get(), "a", 4 << 20);
  EXPECT_TRUE(s.ok()) << s.status().ToString();
}

TEST_F(RemoteTest, KilledDaemonGivesAnErrorWithinTheDeadlineAndANewSessionWorksAfterARestart) {
  StartDaemon(false, false);
  const int deadline_ms = 1500;
  Fixture f = Open("a", FetchMethod::kServerGather, 64, deadline_ms);
  ASSERT_TRUE(f.session);
  std::vector<int32_t> tokens = {1, 2, 3};
  std::vector<uint8_t> out(3 * kRow);
  ASSERT_TRUE(f.session->ReadRows(f.sequence, 0, 0, tokens, out.data()).ok());

  daemon_->child->Kill(SIGKILL);
  ASSERT_EQ(daemon_->child->Wait(5000), 128 + SIGKILL);
  const auto start = std::chrono::steady_clock::now();
  Status s = f.session->ReadRows(f.sequence, 0, 0, tokens, out.data());
  const auto took = std::chrono::steady_clock::now() - start;
  EXPECT_TRUE(s.code() == StatusCode::kUnavailable || s.code() == StatusCode::kDeadlineExceeded) << s.ToString();
  EXPECT_LT(took, std::chrono::milliseconds(deadline_ms + 500)) << s.ToString();
  EXPECT_FALSE(f.session->Alive());
  // Later calls fail at once, and tearing the session down does not hang.
  EXPECT_FALSE(f.session->ReadRows(f.sequence, 0, 0, tokens, out.data()).ok());
  const auto teardown = std::chrono::steady_clock::now();
  f.session.reset();
  f.client.reset();
  EXPECT_LT(std::chrono::steady_clock::now() - teardown, std::chrono::milliseconds(deadline_ms * 3));

  // The daemon again, on the same ports: a new client and session work.
  const uint16_t control = control_port_, data = data_port_;
  daemon_.reset();
  StartDaemon(false, false, control, data);
  Fixture again = Open("a", FetchMethod::kServerGather, 16, deadline_ms);
  ASSERT_TRUE(again.session) << daemon_->Log();
  ASSERT_TRUE(again.session->ReadRows(again.sequence, 1, 1, tokens, out.data()).ok());
  ExpectRows(tokens, out, 1, 1);
}


// Stats to a tenant's client (never an admin remotely) count that tenant's sessions, sequences
// and memory alone: tenant b does not see tenant a's session and sequence appear and go.
TEST_F(RemoteTest, StatsOfATenantDoNotCountAnotherTenantsSessions) {
  StartDaemon(false, false);
  Fixture a = Open("a", FetchMethod::kServerGather, 32);
  ASSERT_TRUE(a.session);
  auto b = Connect(Credentials("b"));
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  auto stats = (*b)->Stats();
  ASSERT_TRUE(stats.ok()) << stats.status().ToString();
  for (const auto& t : stats->tenants) EXPECT_EQ(t.tenant, "b");
  EXPECT_EQ(stats->sessions, 0u) << "tenant b is shown tenant a's sessions";
  EXPECT_EQ(stats->sequences, 0u) << "tenant b is shown tenant a's sequences";
  EXPECT_EQ(stats->used_bytes, 0u) << "tenant b is shown tenant a's used bytes";
  EXPECT_EQ(stats->pages, 0u);
  // Its own are counted.
  Fixture mine = Open("b", FetchMethod::kServerGather, 16);
  ASSERT_TRUE(mine.session);
  auto after = (*b)->Stats();
  ASSERT_TRUE(after.ok()) << after.status().ToString();
  EXPECT_EQ(after->sessions, 1u);
  EXPECT_EQ(after->sequences, 1u);
  EXPECT_GT(after->used_bytes, 0u);
}

// A request on a session's own endpoint that carries another session's id (or a wrong token) is
// dropped, counted and logged: never served, never answered, and the endpoint keeps serving its
// own requests (a message without the right credentials changes nothing of the endpoint it names).
TEST_F(RemoteTest, RequestsWithoutTheirEndpointsSessionAndTokenAreDroppedNotServed) {
  StartDaemon(false, false);
  Fixture a = Open("a", FetchMethod::kServerGather, 32);  // the victim: rows hold (l*31+h*7+t)
  ASSERT_TRUE(a.session);
  RawSession mine = OpenRawSession(*pki_, control_port_, "b", "tenant-b-secret-9876543210");
  ASSERT_NE(mine.id, 0u);
  RawEndpoint b = HelloedEndpoint(data_port_, mine);
  ASSERT_TRUE(b.ep) << daemon_->Log();
  const uint64_t own = mine.Sequence(32);
  std::vector<uint8_t> row(kRow, 0xEE);
  auto start_write = [&](remote::RowsRequest r) {
    r.first_token = 5;
    return b.ep->Start(remote::kWrite, &r, sizeof r, row.data(), row.size(), nullptr, 0);
  };
  remote::RowsRequest as_a = b.Request(a.sequence, 1);
  as_a.session_id = a.session->id();  // a's session, b's token
  auto forged = start_write(as_a);
  ASSERT_TRUE(forged.ok()) << forged.status().ToString();
  remote::RowsRequest wrong_token = b.Request(own, 1);
  wrong_token.token[0] ^= 1;
  auto unproven = start_write(wrong_token);
  ASSERT_TRUE(unproven.ok()) << unproven.status().ToString();
  // b's own request after them is served: its endpoint was neither refused nor closed for them.
  auto mine_write = start_write(b.Request(own, 1));
  ASSERT_TRUE(mine_write.ok()) << mine_write.status().ToString();
  Status served = b.ep->Wait(*mine_write, std::chrono::steady_clock::now() + std::chrono::seconds(3));
  EXPECT_TRUE(served.ok()) << served.ToString() << "\n" << daemon_->Log();
  // a's row 5 is still a's.
  std::vector<int32_t> tokens = {5};
  std::vector<uint8_t> out(kRow);
  ASSERT_TRUE(a.session->ReadRows(a.sequence, 0, 0, tokens, out.data()).ok());
  ExpectRows(tokens, out, 0, 0);
  // The two were never answered (the client gives up at the deadline and closes its endpoint).
  Status never = b.ep->Wait(*forged, std::chrono::steady_clock::now() + std::chrono::milliseconds(300));
  EXPECT_EQ(never.code(), StatusCode::kDeadlineExceeded) << "answered: " << never.ToString();
  EXPECT_NE(daemon_->Log().find("without that session's id and token dropped (2 such so far)"), std::string::npos)
      << daemon_->Log();
}

// An active message of an id the daemon does not serve (0, a reply's, an unused one, the highest)
// is dropped, counted and logged at the 1st, 2nd, 4th...: UCX warned on its own once per such
// message (an id without a handler), uncounted, so any peer could flood the daemon's log. The
// endpoint that sent them is still served.
TEST_F(RemoteTest, MessagesOfAnIdTheDaemonDoesNotServeAreDroppedCountedAndLoggedAFewTimes) {
  StartDaemon(false, false);
  RawSession mine = OpenRawSession(*pki_, control_port_, "b", "tenant-b-secret-9876543210");
  ASSERT_NE(mine.id, 0u);
  RawEndpoint b = HelloedEndpoint(data_port_, mine);
  ASSERT_TRUE(b.ep) << daemon_->Log();
  const uint64_t own = mine.Sequence(32);
  for (uint16_t id : {uint16_t{0}, uint16_t{remote::kReply}, uint16_t{77}, uint16_t{0xFFFF}}) {
    const remote::RowsRequest header = b.Request(own, 1);  // a well-formed header: only the id is foreign
    auto sent = b.ep->Start(static_cast<remote::AmId>(id), &header, sizeof header, nullptr, 0, nullptr, 0);
    ASSERT_TRUE(sent.ok()) << id << ": " << sent.status().ToString();
  }
  std::vector<uint8_t> row(kRow, 0xEE);
  remote::RowsRequest write = b.Request(own, 1);
  write.first_token = 5;
  auto served = b.ep->Start(remote::kWrite, &write, sizeof write, row.data(), row.size(), nullptr, 0);
  ASSERT_TRUE(served.ok()) << served.status().ToString();
  Status done = b.ep->Wait(*served, std::chrono::steady_clock::now() + std::chrono::seconds(3));
  EXPECT_TRUE(done.ok()) << done.ToString() << "\n" << daemon_->Log();
  const std::string log = daemon_->Log();
  EXPECT_NE(log.find("an id the daemon does not serve dropped (1 such so far)"), std::string::npos) << log;
  EXPECT_NE(log.find("an id the daemon does not serve dropped (4 such so far)"), std::string::npos) << log;
  EXPECT_EQ(log.find("does not serve dropped (3 such so far)"), std::string::npos) << log;
  EXPECT_EQ(log.find("no registered callback"), std::string::npos) << log;  // UCX's own line, once a message
}

// A peer that reaches the data port, with no secret, no session and no hello, sends a kWrite whose
// footer names tenant a's endpoint (ForgeableRemoteId), without a's session id and token: the
// daemon must drop it (before it checked requests only against the endpoint they named, and
// wrote the row).
TEST_F(RemoteTest, AForgedEndpointIdCannotWriteIntoAnotherTenantsSession) {
  StartDaemon(false, false);
  Fixture a = Open("a", FetchMethod::kServerGather, 32);  // the victim: rows hold (l*31+h*7+t)
  ASSERT_TRUE(a.session);

  Forger forger(data_port_);
  ASSERT_TRUE(forger.ok());

  // One forged one-row write per endpoint id the daemon gave out before ours.
  remote::RowsRequest r;
  r.n = 1;
  r.request_id = 777;
  r.sequence = a.sequence;
  r.layer = 0;
  r.kv_head = 0;
  r.first_token = 5;
  std::vector<uint8_t> row(kRow, 0xEE);
  forger.ToEveryEarlierEndpoint([&] { forger.Send(remote::kWrite, &r, sizeof r, row.data(), row.size()); });

  // Tenant a reads its own row 5 of layer 0, head 0: it must still be what a wrote.
  std::vector<int32_t> tokens = {5};
  std::vector<uint8_t> out(kRow);
  Status read = a.session->ReadRows(a.sequence, 0, 0, tokens, out.data());
  ASSERT_TRUE(read.ok()) << read.ToString();
  EXPECT_EQ(out[0], 5) << "tenant a's row 5 was overwritten by a peer with no credentials (0xEE = the forged write)\n"
                       << daemon_->Log();
  EXPECT_NE(daemon_->Log().find("without that session's id and token dropped"), std::string::npos) << daemon_->Log();
}

// Before its hello an endpoint takes only a hello that carries the challenge the daemon sent it. A
// peer naming an endpoint that has not said its hello yet (ForgeableRemoteId), with its own
// session's hello (with no challenge, or with its own endpoint's) or with a request, changes
// nothing of it: without the challenge the forged hello bound the victim's endpoint to the
// attacker's session (its reply, code 0 for request 0, reached the victim as if for its own
// hello), and the forged request's refusal went to the victim.
TEST_F(RemoteTest, AForgedEndpointIdCannotSpeakForAnEndpointBeforeItsHello) {
  StartDaemon(false, false);
  RawSession attacker_session = OpenRawSession(*pki_, control_port_, "b", "tenant-b-secret-9876543210");
  ASSERT_NE(attacker_session.id, 0u);
  // The forger first, its own challenge received: the victim's endpoint is the next id after its own.
  Forger forger(data_port_);
  ASSERT_TRUE(forger.ok());
  ASSERT_TRUE(forger.ucx.ProgressUntil([&] { return forger.ucx.challenge.has_value(); }, std::chrono::seconds(1)));
  auto logged = [&](const std::string& text) {  // progressing the forger while the daemon logs
    return forger.ucx.ProgressUntil([&] { return daemon_->Log().find(text) != std::string::npos; },
                                    std::chrono::seconds(2));
  };

  // The victim (within the test daemon's 1 s lease from here): its session, its endpoint
  // connected, its challenge received, its hello not said yet.
  RawSession victim_session = OpenRawSession(*pki_, control_port_, "a", "tenant-a-secret-0123456789");
  ASSERT_NE(victim_session.id, 0u);
  PlainUcxClient victim;
  ASSERT_TRUE(victim.ok());
  ucp_ep_h victim_ep = victim.Connect(data_port_);
  ASSERT_NE(victim_ep, nullptr);
  ASSERT_TRUE(victim.ProgressUntil([&] { return victim.challenge.has_value(); }, std::chrono::seconds(1)))
      << daemon_->Log();
  const uint64_t victim_id = forger.own + 2;

  // Four messages named for the victim's endpoint: hellos of the forger's session without a
  // challenge and with its own endpoint's, a gather, and the first again (the fourth is logged).
  remote::Hello forged;
  forged.session_id = attacker_session.id;
  std::memcpy(forged.token.data(), attacker_session.token.data(), forged.token.size());
  remote::Hello forged_own = forged;
  forged_own.challenge = forger.ucx.challenge->challenge;
  remote::RowsRequest gather;
  gather.n = 1;
  gather.request_id = 9;
  gather.session_id = attacker_session.id;
  std::memcpy(gather.token.data(), attacker_session.token.data(), gather.token.size());
  const int32_t token = 0;
  forger.As(victim_id, [&] {
    forger.Send(remote::kHello, &forged, sizeof forged);
    forger.Send(remote::kHello, &forged_own, sizeof forged_own);
    forger.Send(remote::kGather, &gather, sizeof gather, &token, sizeof token);
    forger.Send(remote::kHello, &forged, sizeof forged);
  });
  EXPECT_TRUE(logged("not a hello of version 3 with the endpoint's challenge, dropped (4 such so far)")) << daemon_->Log();

  // The victim's own hello is accepted, and nothing else reached it.
  remote::Hello hello;
  hello.session_id = victim_session.id;
  std::memcpy(hello.token.data(), victim_session.token.data(), hello.token.size());
  hello.challenge = victim.challenge->challenge;
  victim.SendNow(victim_ep, remote::kHello, &hello, sizeof hello);
  ASSERT_TRUE(victim.ProgressUntil([&] { return !victim.replies.empty(); }, std::chrono::seconds(2))) << daemon_->Log();
  EXPECT_EQ(victim.replies.front().request_id, 0u) << "the victim's endpoint answered a forged request\n" << daemon_->Log();
  EXPECT_EQ(victim.replies.front().code, 0) << daemon_->Log();
  victim.Progress(std::chrono::milliseconds(100));
  EXPECT_EQ(victim.replies.size(), 1u) << daemon_->Log();

  // The forgery does name the victim's endpoint: a request for it now is dropped as one without
  // the victim's session's id and token.
  forger.As(victim_id, [&] { forger.Send(remote::kGather, &gather, sizeof gather, &token, sizeof token); });
  EXPECT_TRUE(logged("naming the endpoint of session " + std::to_string(victim_session.id) +
                     " without that session's id and token dropped"))
      << daemon_->Log();
}

// A client's hello waits for the daemon's challenge: from a daemon that sends none (older than
// protocol version 3, or not there) it fails at its deadline, naming that cause.
TEST(RemoteClientTest, AHelloWithoutAChallengeFailsAtItsDeadlineNamingTheCause) {
  SilentListener daemon;
  ASSERT_NE(daemon.port, 0);
  auto ep = client::UcxEndpoint::Connect("127.0.0.1:" + std::to_string(daemon.port), false);
  ASSERT_TRUE(ep.ok()) << ep.status().ToString();
  remote::Hello h;
  h.session_id = 1;
  const auto start = std::chrono::steady_clock::now();
  Status said = (*ep)->Call(remote::kHello, &h, sizeof h, nullptr, 0, nullptr, 1 << 20, start + std::chrono::milliseconds(500));
  EXPECT_EQ(said.code(), StatusCode::kDeadlineExceeded) << said.ToString();
  EXPECT_NE(said.message().find("no challenge came"), std::string::npos) << said.ToString();
  EXPECT_GE(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(500));
  EXPECT_EQ(daemon.accepted.load(), 1) << "the connection was accepted";
}

}  // namespace
}  // namespace specache
