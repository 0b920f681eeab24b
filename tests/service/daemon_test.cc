// specached with real client processes: concurrent writers, clients killed mid-work, the daemon
// killed under its clients, tenant isolation and a table of malformed requests.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/un.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <random>
#include <set>
#include <thread>
#include <vector>

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include "kill_rounds.h"
#include "free_port.h"
#include "hand_attach.h"
#include "processes.h"
#include "specache/attach_protocol.h"
#include "specache/client.h"
#include "specache/client_c.h"
#include "specache/daemon_source.h"
#include "specache/v1/control.grpc.pb.h"

namespace specache {
namespace {

using testing::DaemonProcess;
using testing::Spawn;
using Clock = std::chrono::steady_clock;

std::unique_ptr<client::Client> Connect(const DaemonProcess& d, int deadline_ms = 2000) {
  auto c = client::Client::Connect({d.socket, std::chrono::milliseconds(deadline_ms), "test"});
  EXPECT_TRUE(c.ok()) << c.status().ToString();
  return c.ok() ? std::move(c).value() : nullptr;
}

// Waits until the daemon reports no session and every chunk free; returns the time it took.
Result<double> WaitForEmptyPool(client::Client* c, int timeout_ms) {
  const auto start = Clock::now();
  while (Clock::now() - start < std::chrono::milliseconds(timeout_ms)) {
    auto s = c->Stats();
    if (s.ok() && s->sessions == 0 && s->free_bytes == s->pool_bytes) {
      return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return Status::DeadlineExceeded("pool not empty");
}

TEST(DaemonTest, FourClientProcessesWriteAndReadTheirPagesConcurrently) {
  DaemonProcess d;
  ASSERT_TRUE(d.Start());
  std::vector<std::unique_ptr<testing::Child>> clients;
  for (int i = 0; i < 6; ++i) {
    clients.push_back(Spawn({TEST_CLIENT_PATH, "write-verify", d.socket, std::to_string(100 + i), std::to_string(700 + i * 37)}));
  }
  for (auto& c : clients) {
    const std::string line = c->ReadLine(30000);
    EXPECT_EQ(line.rfind("ok", 0), 0u) << "client said: " << line;
    // 700+ tokens in pages of 16: each client extends at most once per page.
    const auto rpcs = std::stoul(line.substr(line.find('=') + 1));
    EXPECT_LE(rpcs, (700u + 5 * 37) / 16 + 1);
    EXPECT_EQ(c->Wait(10000), 0);
  }
  auto admin = Connect(d);
  ASSERT_TRUE(admin);
  EXPECT_TRUE(WaitForEmptyPool(admin.get(), 3000).ok());
}

TEST(DaemonTest, AClientKilledMidWorkGivesEverythingBackWithinTheLease) {
  testing::KillClientRounds(20);
}

TEST(DaemonTest, WhenTheDaemonDiesEveryCallFailsWithinItsDeadline) {
  DaemonProcess d;
  ASSERT_TRUE(d.Start());
  auto c = Connect(d, 500);
  ASSERT_TRUE(c);
  auto session = c->OpenSession("default", 4 << 20);
  ASSERT_TRUE(session.ok()) << session.status().ToString();
  auto seq = (*session)->CreateSequence({2, 2, 64, 16, 256});
  ASSERT_TRUE(seq.ok());
  d.child->Kill(SIGKILL);
  d.child->Wait(5000);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_FALSE((*session)->Alive());
  const auto start = Clock::now();
  EXPECT_FALSE(c->Stats().ok());
  EXPECT_FALSE((*session)->Extend(*seq, 200).ok());
  EXPECT_FALSE((*session)->CreateSequence({2, 2, 64, 16, 256}).ok());
  const double ms = std::chrono::duration<double, std::milli>(Clock::now() - start).count();
  EXPECT_LT(ms, 3 * 500 + 500) << "three calls with 500 ms deadlines";
  auto again = client::Client::Connect({d.socket, std::chrono::milliseconds(300), "late"});
  EXPECT_EQ(again.status().code(), StatusCode::kUnavailable);
}

TEST(DaemonTest, TenantsAreIsolated) {
  DaemonProcess d;
  ASSERT_TRUE(d.Start(R"(
[access]
socket_group = 65534
[tenants.alpha]
quota_bytes = "16MiB"
[tenants.rootonly]
quota_bytes = "8MiB"
users = [0]
)"));
  auto c = Connect(d);
  ASSERT_TRUE(c);
  // Unknown tenant, quota.
  EXPECT_EQ(c->OpenSession("nobody-knows", 4 << 20).status().code(), StatusCode::kPermissionDenied);
  auto a = c->OpenSession("alpha", 12 << 20);
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  auto over = c->OpenSession("alpha", 8 << 20);
  EXPECT_EQ(over.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(over.status().message().find("quota"), std::string::npos) << over.status().ToString();
  // Another user (who may connect: the sockets' group is theirs) may not open a session of a
  // tenant that lists only root (when this test can switch users).
  if (geteuid() == 0) {
    auto other = Spawn({TEST_CLIENT_PATH, "attach-as", "65534", d.socket, "rootonly"});
    const std::string line = other->ReadLine(10000);
    EXPECT_NE(line.find("PERMISSION_DENIED"), std::string::npos) << line;
    EXPECT_EQ(other->Wait(5000), 0);
  } else {
    GTEST_LOG_(INFO) << "not root: the other-user case is skipped";
  }
  // The session of alpha is untouched by all this.
  auto seq = (*a)->CreateSequence({2, 2, 64, 16, 256});
  EXPECT_TRUE(seq.ok()) << seq.status().ToString();
}

// Raw gRPC requests: each malformed or hostile one gets its own error; the daemon serves on.
TEST(DaemonTest, MalformedAndHostileRequestsGetSpecificErrors) {
  DaemonProcess d;
  ASSERT_TRUE(d.Start());
  auto c = Connect(d);
  ASSERT_TRUE(c);
  auto session = c->OpenSession("default", 8 << 20);
  ASSERT_TRUE(session.ok());
  // A second session opened by hand, to use its token in bad ways.
  auto channel = grpc::CreateChannel("unix:" + d.socket, grpc::InsecureChannelCredentials());
  auto stub = v1::Control::NewStub(channel);
  auto call = [&](auto method, const auto& req, auto* resp) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
    return ((*stub).*method)(&ctx, req, resp).error_code();
  };
  v1::OpenSessionRequest open;
  open.set_tenant("default");
  open.set_pool_bytes(4 << 20);
  v1::OpenSessionResponse opened;
  ASSERT_EQ(call(&v1::Control::Stub::OpenSession, open, &opened), grpc::OK);
  const uint64_t sid = opened.session_id();
  const std::string token = opened.token();
  // Attach by hand so the session stays alive for the table below.
  const int fd = testing::AttachByHand(opened.attach_path(), sid, token);
  ASSERT_GE(fd, 0);

  auto layout = [](uint32_t layers, uint32_t heads, uint32_t dim, uint32_t page, uint32_t cap) {
    v1::SequenceLayout l;
    l.set_n_layers(layers);
    l.set_n_kv_heads(heads);
    l.set_head_dim(dim);
    l.set_page_tokens(page);
    l.set_capacity_tokens(cap);
    return l;
  };
  auto create = [&](uint64_t session, const std::string& tok, const v1::SequenceLayout* l, uint32_t dtype = 0) {
    v1::CreateSequenceRequest r;
    r.set_session_id(session);
    r.set_token(tok);
    if (l) {
      *r.mutable_layout() = *l;
      r.mutable_layout()->set_dtype(dtype);
    }
    v1::CreateSequenceResponse resp;
    return call(&v1::Control::Stub::CreateSequence, r, &resp);
  };
  auto extend = [&](uint64_t session, const std::string& tok, uint64_t seq, uint32_t tokens) {
    v1::ExtendSequenceRequest r;
    r.set_session_id(session);
    r.set_token(tok);
    r.set_sequence_id(seq);
    r.set_tokens(tokens);
    v1::ExtendSequenceResponse resp;
    return call(&v1::Control::Stub::ExtendSequence, r, &resp);
  };
  auto release = [&](uint64_t session, const std::string& tok, uint64_t seq) {
    v1::ReleaseSequenceRequest r;
    r.set_session_id(session);
    r.set_token(tok);
    r.set_sequence_id(seq);
    v1::ReleaseSequenceResponse resp;
    return call(&v1::Control::Stub::ReleaseSequence, r, &resp);
  };
  const auto good = layout(4, 2, 64, 16, 1024);
  v1::CreateSequenceRequest ok_req;
  ok_req.set_session_id(sid);
  ok_req.set_token(token);
  *ok_req.mutable_layout() = good;
  v1::CreateSequenceResponse ok_resp;
  ASSERT_EQ(call(&v1::Control::Stub::CreateSequence, ok_req, &ok_resp), grpc::OK);
  const uint64_t seq = ok_resp.sequence_id();
  ASSERT_EQ(call(&v1::Control::Stub::CreateSequence, ok_req, &ok_resp), grpc::OK);
  const uint64_t released = ok_resp.sequence_id();
  ASSERT_EQ(release(sid, token, released), grpc::OK);
  const auto big_layout = layout(4, 8, 128, 64, 65536);  // 256 KiB pages, 1 GiB at capacity
  *ok_req.mutable_layout() = big_layout;
  ASSERT_EQ(call(&v1::Control::Stub::CreateSequence, ok_req, &ok_resp), grpc::OK);
  const uint64_t big = ok_resp.sequence_id();
  std::string wrong = token;
  wrong[0] ^= 1;
  const auto zero_layers = layout(0, 2, 64, 16, 64), zero_heads = layout(4, 0, 64, 16, 64),
             odd_dim = layout(4, 2, 63, 16, 64), zero_page = layout(4, 2, 64, 0, 64),
             zero_cap = layout(4, 2, 64, 16, 0), huge_layers = layout(100000, 2, 64, 16, 64),
             huge_page = layout(4, 1024, 1024, 65536, 65536), huge_cap = layout(4, 2, 64, 16, 1u << 30),
             too_many_refs = layout(1024, 2, 64, 1, 1u << 20);
  v1::OpenSessionRequest huge_pool, zero_pool, big_name, no_tenant;
  huge_pool.set_tenant("default");
  huge_pool.set_pool_bytes(UINT64_MAX);
  zero_pool.set_tenant("default");
  big_name.set_tenant("default");
  big_name.set_pool_bytes(4 << 20);
  big_name.set_client_name(std::string(1000, 'x'));
  no_tenant.set_tenant("");
  no_tenant.set_pool_bytes(4 << 20);
  v1::OpenSessionRequest oversized;  // beyond the daemon's 64 KiB message limit
  oversized.set_tenant("default");
  oversized.set_client_name(std::string(100 << 10, 'y'));
  v1::OpenSessionResponse dummy;
  v1::OpenSessionResponse unattached;
  ASSERT_EQ(call(&v1::Control::Stub::OpenSession, open, &unattached), grpc::OK);

  struct Case {
    const char* name;
    grpc::StatusCode got, want;
  } cases[] = {
      {"zero layers", create(sid, token, &zero_layers), grpc::INVALID_ARGUMENT},
      {"zero heads", create(sid, token, &zero_heads), grpc::INVALID_ARGUMENT},
      {"head_dim 63", create(sid, token, &odd_dim), grpc::INVALID_ARGUMENT},
      {"zero page_tokens", create(sid, token, &zero_page), grpc::INVALID_ARGUMENT},
      {"zero capacity", create(sid, token, &zero_cap), grpc::INVALID_ARGUMENT},
      {"100000 layers", create(sid, token, &huge_layers), grpc::INVALID_ARGUMENT},
      {"page larger than a chunk", create(sid, token, &huge_page), grpc::INVALID_ARGUMENT},
      {"capacity 1G tokens", create(sid, token, &huge_cap), grpc::INVALID_ARGUMENT},
      {"page table overflow", create(sid, token, &too_many_refs), grpc::RESOURCE_EXHAUSTED},
      {"no layout", create(sid, token, nullptr), grpc::INVALID_ARGUMENT},
      {"dtype 7", create(sid, token, &good, 7), grpc::INVALID_ARGUMENT},
      {"wrong token", create(sid, wrong, &good), grpc::PERMISSION_DENIED},
      {"short token", create(sid, "abc", &good), grpc::INVALID_ARGUMENT},
      {"unknown session", create(sid + 1000, token, &good), grpc::NOT_FOUND},
      {"session not attached yet", create(unattached.session_id(), unattached.token(), &good),
       grpc::FAILED_PRECONDITION},
      {"other session's token", create(sid, std::string(16, '\0'), &good), grpc::PERMISSION_DENIED},
      {"extend unknown sequence", extend(sid, token, 999999, 16), grpc::NOT_FOUND},
      {"extend released sequence", extend(sid, token, released, 16), grpc::NOT_FOUND},
      {"extend beyond capacity", extend(sid, token, seq, 5000), grpc::OUT_OF_RANGE},
      {"extend to capacity", extend(sid, token, seq, 1024), grpc::OK},
      {"extend beyond the session's memory", extend(sid, token, big, 65536), grpc::RESOURCE_EXHAUSTED},
      {"release twice", release(sid, token, released), grpc::NOT_FOUND},
      {"release with wrong token", release(sid, wrong, seq), grpc::PERMISSION_DENIED},
      {"pool of 2^64 bytes", call(&v1::Control::Stub::OpenSession, huge_pool, &dummy), grpc::INVALID_ARGUMENT},
      {"pool of 0 bytes", call(&v1::Control::Stub::OpenSession, zero_pool, &dummy), grpc::INVALID_ARGUMENT},
      {"client name of 1000 bytes", call(&v1::Control::Stub::OpenSession, big_name, &dummy), grpc::INVALID_ARGUMENT},
      {"empty tenant", call(&v1::Control::Stub::OpenSession, no_tenant, &dummy), grpc::PERMISSION_DENIED},
      {"message over 64 KiB", call(&v1::Control::Stub::OpenSession, oversized, &dummy), grpc::RESOURCE_EXHAUSTED},
  };
  for (const Case& c : cases) EXPECT_EQ(c.got, c.want) << c.name;

  // Garbage on the attach socket: an error reply or a closed connection, never a crash.
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strcpy(addr.sun_path, opened.attach_path().c_str());
  for (const std::string& junk : {std::string("hello"), std::string(32, '\xff'), std::string(4096, 'A')}) {
    int g = socket(AF_UNIX, SOCK_STREAM, 0);
    ASSERT_EQ(connect(g, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
    ASSERT_EQ(write(g, junk.data(), junk.size()), static_cast<ssize_t>(junk.size()));
    if (junk.size() < sizeof(attach::AttachRequest)) shutdown(g, SHUT_WR);
    attach::AttachReply r{};
    const ssize_t n = read(g, &r, sizeof r);
    EXPECT_TRUE(n == 0 || (n == static_cast<ssize_t>(sizeof r) && r.code != 0)) << junk.size() << " bytes of junk";
    close(g);
  }
  // The daemon still serves, and the good session still works.
  auto stats = c->Stats();
  ASSERT_TRUE(stats.ok());
  EXPECT_GE(stats->errors, 20u);
  EXPECT_TRUE((*session)->CreateSequence({2, 2, 64, 16, 256}).ok());
  close(fd);
}

}  // namespace
}  // namespace specache

extern "C" int specache_c_abi_roundtrip(const char* socket_path, char* report, size_t report_len);
extern "C" int specache_c_abi_int8(const char* socket_path, char* report, size_t report_len);

namespace specache {
namespace {

// A running daemon with one open session, for the DaemonSource tests.
struct DaemonWithSession {
  DaemonProcess daemon;
  std::unique_ptr<client::Client> client;
  std::unique_ptr<client::Session> session;
};

std::unique_ptr<DaemonWithSession> StartWithSession() {
  auto d = std::make_unique<DaemonWithSession>();
  if (!d->daemon.Start()) {
    ADD_FAILURE() << "specached did not start";
    return nullptr;
  }
  d->client = Connect(d->daemon);
  if (!d->client) {
    ADD_FAILURE() << "no connection to specached";
    return nullptr;
  }
  auto session = d->client->OpenSession("default", 64ull << 20);
  if (!session.ok()) {
    ADD_FAILURE() << session.status().ToString();
    return nullptr;
  }
  d->session = std::move(*session);
  return d;
}

// DaemonSource's zero-copy pages: inside the session's mapped chunks, fixed as the sequence
// grows, one Extend per page; rows written in place and committed read back through ReadRows.
TEST(DaemonSourceTest, PagesLieInTheSessionChunksAndAreWrittenInPlace) {
  auto d = StartWithSession();
  ASSERT_TRUE(d);
  const int page_tokens = 16, n_kv = 2, head_dim = 8;
  client::DaemonSource source(d->session.get(), page_tokens, 256);
  EXPECT_EQ(source.page_tokens(), page_tokens);
  ASSERT_TRUE(source.CreateSequence(5, {3, n_kv, head_dim}).ok());
  const auto regions = source.host_regions();
  ASSERT_EQ(regions.size(), d->session->chunk_count());
  const auto inside = [&regions](const uint8_t* p) {
    for (const HostRegion& r : regions) {
      if (p >= static_cast<uint8_t*>(r.base) && p + 1 <= static_cast<uint8_t*>(r.base) + r.bytes) return true;
    }
    return false;
  };
  std::vector<uint8_t*> pages, grown;
  ASSERT_TRUE(source.HostPages(5, 2, 20, &pages).ok());
  ASSERT_EQ(pages.size(), 2u);
  EXPECT_TRUE(inside(pages[0]) && inside(pages[1]));
  const uint64_t rpcs = source.extend_rpcs();
  ASSERT_TRUE(source.HostPages(5, 1, 32, &grown).ok());  // still two pages: no RPC
  EXPECT_EQ(source.extend_rpcs(), rpcs);
  ASSERT_TRUE(source.HostPages(5, 2, 40, &grown).ok());
  ASSERT_EQ(grown.size(), 3u);
  EXPECT_EQ(grown[0], pages[0]);
  EXPECT_EQ(grown[1], pages[1]);
  // Token 17 of head 1 at layer 2: page 1, row (1 * page_tokens + 1).
  const size_t row_bytes = 2 * head_dim * sizeof(Half);
  std::vector<Half> rows(18 * 2 * head_dim);
  for (size_t i = 0; i < rows.size(); ++i) rows[i] = static_cast<Half>(i * 7);
  for (int32_t t = 0; t < 18; ++t) {
    std::memcpy(grown[t / page_tokens] + (1 * page_tokens + t % page_tokens) * row_bytes, &rows[t * 2 * head_dim], row_bytes);
  }
  EXPECT_EQ(source.CommitRows(5, 2, 1, 1, 17).code(), StatusCode::kFailedPrecondition);
  ASSERT_TRUE(source.CommitRows(5, 2, 1, 0, 18).ok());
  EXPECT_EQ(source.CommitRows(5, 2, 1, 18, 100).code(), StatusCode::kFailedPrecondition);  // beyond the pages
  EXPECT_EQ(source.CommitRows(5, 3, 0, 0, 1).code(), StatusCode::kOutOfRange);
  std::vector<int32_t> tokens(18);
  for (int32_t t = 0; t < 18; ++t) tokens[t] = t;
  std::vector<Half> back(rows.size());
  ASSERT_TRUE(source.ReadRows(5, 2, 1, tokens.data(), 18, back.data()).ok());
  EXPECT_EQ(back, rows);
  EXPECT_EQ(*source.Length(5, 2, 1), 18);
  // A layer's commit of every head: all or nothing, with CommitRows' rules (the layout has 2 heads).
  ASSERT_TRUE(source.CommitLayerRows(5, 1, 2, 0, 20).ok());
  EXPECT_EQ(*source.Length(5, 1, 0), 20);
  EXPECT_EQ(*source.Length(5, 1, 1), 20);
  EXPECT_EQ(source.CommitLayerRows(5, 2, 2, 0, 18).code(), StatusCode::kFailedPrecondition);  // head 1 is at 18
  EXPECT_EQ(*source.Length(5, 2, 0), 0);
  EXPECT_EQ(source.CommitLayerRows(5, 1, 2, 20, 100).code(), StatusCode::kFailedPrecondition);  // beyond the pages
  EXPECT_EQ(source.CommitLayerRows(5, 1, 1, 20, 1).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(source.CommitLayerRows(5, 9, 2, 20, 1).code(), StatusCode::kOutOfRange);
  EXPECT_EQ(source.CommitLayerRows(6, 1, 2, 0, 1).code(), StatusCode::kNotFound);
  EXPECT_EQ(*source.Length(5, 1, 0), 20);
}

// capacity_tokens bounds a sequence's length even where the last page has room past it: the
// 41st token of a 40-token sequence is refused although its page (tokens 32..47) is made.
TEST(DaemonSourceTest, AppendsStopAtTheCapacityEvenInsideTheLastPage) {
  auto d = StartWithSession();
  ASSERT_TRUE(d);
  const int page_tokens = 16, head_dim = 8;
  client::DaemonSource source(d->session.get(), page_tokens, 40);
  ASSERT_TRUE(source.CreateSequence(1, {1, 1, head_dim}).ok());
  std::vector<Half> rows(41 * 2 * head_dim, Half{1});
  ASSERT_TRUE(source.AppendRows(1, 0, 0, 0, rows.data(), 40).ok());
  EXPECT_EQ(source.AppendRows(1, 0, 0, 40, rows.data(), 1).code(), StatusCode::kOutOfRange);
  std::vector<uint8_t*> pages;
  EXPECT_EQ(source.HostPages(1, 0, 41, &pages).code(), StatusCode::kOutOfRange);
  EXPECT_EQ(*source.Length(1, 0, 0), 40);
  EXPECT_EQ(source.stored_bytes(), 40 * 2 * head_dim * static_cast<int64_t>(sizeof(Half)));
}

// A sequence a DaemonSource holds cannot be released or kept through the session behind its back
// (Python exposes the daemon's id): before, Session::Release freed its pages while the source
// (and its agent) kept writing them, and the next sequence made got those pages, so one
// sequence's rows overwrote another's. The source's own release and keep work, and after its
// release the session knows the sequence no more.
TEST(DaemonSourceTest, ItsSequencesAreNotReleasedOrKeptThroughTheSessionBehindItsBack) {
  auto d = StartWithSession();
  ASSERT_TRUE(d);
  const int head_dim = 8;
  client::DaemonSource source(d->session.get(), 16, 64);
  ASSERT_TRUE(source.CreateSequence(1, {1, 1, head_dim}).ok());
  const uint64_t id = *source.DaemonSequence(1);
  std::vector<Half> rows(4 * 2 * head_dim, Half{1});
  ASSERT_TRUE(source.AppendRows(1, 0, 0, 0, rows.data(), 4).ok());
  const Status released = d->session->Release(id);
  EXPECT_EQ(released.code(), StatusCode::kFailedPrecondition) << released.ToString();
  EXPECT_NE(released.message().find("held by a DaemonSource"), std::string::npos) << released.ToString();
  EXPECT_EQ(d->session->Keep(id).code(), StatusCode::kFailedPrecondition);
  // Still the source's: a sequence the session makes now gets other pages, and the rows stay.
  auto other = d->session->CreateSequence({1, 1, head_dim, 16, 64, 0});
  ASSERT_TRUE(other.ok()) << other.status().ToString();
  ASSERT_TRUE(d->session->Extend(*other, 16).ok());
  auto other_page = d->session->PageData(*other, 0, 0), held_page = d->session->PageData(id, 0, 0);
  ASSERT_TRUE(other_page.ok() && held_page.ok());
  EXPECT_NE(*other_page, *held_page);
  EXPECT_TRUE(d->session->Release(*other).ok());  // the session's own sequence: released as before
  std::vector<int32_t> token = {3};
  std::vector<Half> back(2 * head_dim);
  ASSERT_TRUE(source.ReadRows(1, 0, 0, token.data(), 1, back.data()).ok());
  EXPECT_EQ(back, std::vector<Half>(2 * head_dim, Half{1}));
  // Through the source: kept, released (left in the daemon); a second sequence released for good.
  EXPECT_EQ(*source.Keep(1), id);
  EXPECT_TRUE(source.ReleaseSequence(1).ok());
  ASSERT_TRUE(source.CreateSequence(2, {1, 1, head_dim}).ok());
  const uint64_t second = *source.DaemonSequence(2);
  EXPECT_TRUE(source.ReleaseSequence(2).ok());
  EXPECT_EQ(d->session->Release(second).code(), StatusCode::kNotFound);  // gone, no longer held
}

// A released sequence's pages reach the session's next sequence zeroed (the daemon zeroes them
// without its registry's lock, then frees them): 8 MiB of pages written through the client's
// mapping, released, and found again, all zeros, under the next sequence.
TEST(SessionTest, AReleasedSequencesPagesComeZeroedToTheNextSequence) {
  auto d = StartWithSession();
  ASSERT_TRUE(d);
  const uint32_t layers = 4, n_kv = 2, head_dim = 64, page_tokens = 64, tokens = 4096;
  const client::PageLayoutSpec spec{layers, n_kv, head_dim, page_tokens, tokens, 0};
  const uint64_t page_bytes = spec.page_bytes();
  const uint32_t pages = tokens / page_tokens;
  std::set<const uint8_t*> written;
  auto first = d->session->CreateSequence(spec);
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  ASSERT_TRUE(d->session->Extend(*first, tokens).ok());
  for (uint32_t l = 0; l < layers; ++l) {
    for (uint32_t p = 0; p < pages; ++p) {
      auto page = d->session->PageData(*first, l, p);
      ASSERT_TRUE(page.ok()) << page.status().ToString();
      std::memset(*page, 0x5a, page_bytes);
      written.insert(*page);
    }
  }
  ASSERT_TRUE(d->session->Release(*first).ok());
  auto next = d->session->CreateSequence(spec);
  ASSERT_TRUE(next.ok()) << next.status().ToString();
  ASSERT_TRUE(d->session->Extend(*next, tokens).ok());
  size_t reused = 0;
  for (uint32_t l = 0; l < layers; ++l) {
    for (uint32_t p = 0; p < pages; ++p) {
      auto page = d->session->PageData(*next, l, p);
      ASSERT_TRUE(page.ok()) << page.status().ToString();
      reused += written.count(*page);
      const uint8_t* nonzero = std::find_if(*page, *page + page_bytes, [](uint8_t b) { return b != 0; });
      ASSERT_EQ(nonzero, *page + page_bytes) << "layer " << l << " page " << p << " byte " << nonzero - *page;
    }
  }
  EXPECT_EQ(reused, written.size()) << "the next sequence got the released pages";
}

// int8 rows (SequenceLayout::row_format): the daemon's pages hold the encoded rows (host_rows.h)
// at the int8 geometry, ReadRows decodes them, and the source counts their stored bytes.
TEST(DaemonSourceTest, Int8RowsAreStoredEncodedInThePagesAndReadBackDecoded) {
  auto d = StartWithSession();
  ASSERT_TRUE(d);
  const int page_tokens = 16, n_kv = 2, head_dim = 64, n = 37;
  const int64_t row_bytes = HostRowBytes(HostRowFormat::kInt8, head_dim);
  client::DaemonSource source(d->session.get(), page_tokens, 256);
  ASSERT_TRUE(source.CreateSequence(9, {2, n_kv, head_dim, HostRowFormat::kInt8}).ok());
  std::mt19937 rng(4);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  std::vector<Half> rows(size_t(n) * 2 * head_dim);
  for (Half& h : rows) h = FloatToHalf(normal(rng));
  ASSERT_TRUE(source.AppendRows(9, 1, 1, 0, rows.data(), 30).ok());
  ASSERT_TRUE(source.AppendRows(9, 1, 1, 30, rows.data() + 30 * 2 * head_dim, n - 30).ok());
  std::vector<uint8_t> encoded(size_t(n) * row_bytes);
  EncodeHostRows(HostRowFormat::kInt8, rows.data(), n, head_dim, encoded.data());
  std::vector<uint8_t*> pages;
  ASSERT_TRUE(source.HostPages(9, 1, n, &pages).ok());
  for (int t = 0; t < n; ++t) {
    const uint8_t* in_page = pages[t / page_tokens] + PageRowOffset(1, t % page_tokens, page_tokens, row_bytes);
    ASSERT_EQ(std::memcmp(in_page, encoded.data() + size_t(t) * row_bytes, size_t(row_bytes)), 0) << "token " << t;
  }
  std::vector<int32_t> tokens = {36, 0, 17, 16, 5};
  std::vector<Half> back(tokens.size() * 2 * head_dim), want(back.size());
  ASSERT_TRUE(source.ReadRows(9, 1, 1, tokens.data(), static_cast<int32_t>(tokens.size()), back.data()).ok());
  for (size_t i = 0; i < tokens.size(); ++i) {
    DecodeHostRows(HostRowFormat::kInt8, encoded.data() + size_t(tokens[i]) * row_bytes, 1, head_dim,
                   want.data() + i * 2 * head_dim);
  }
  EXPECT_EQ(back, want);
  EXPECT_EQ(source.stored_bytes(), int64_t{n} * row_bytes);
  // The daemon lists the sequence with its row format and the int8 page size.
  auto listed = d->client->ListSequences();
  ASSERT_TRUE(listed.ok());
  ASSERT_EQ(listed->size(), 1u);
  EXPECT_EQ((*listed)[0].layout.row_format, 1u);
  EXPECT_EQ((*listed)[0].layout.page_bytes(), uint64_t(n_kv) * page_tokens * row_bytes);
}

TEST(ClientCAbiTest, AWholeSessionThroughTheCFunctions) {
  DaemonProcess d;
  ASSERT_TRUE(d.Start());
  char report[512] = {};
  EXPECT_EQ(specache_c_abi_roundtrip(d.socket.c_str(), report, sizeof report), 0) << report;
  // 40 tokens in pages of 16: 3 pages; page 3 is out of range (11); one session, one sequence.
  EXPECT_STREQ(report, "pages=3 beyond=11 sessions=1 sequences=1");
  // An int8 sequence: 20 tokens in pages of 64, a page a layer, 18432 bytes placed in 5 units of
  // 4 KiB (fp16 rows: 32768 bytes, 8 units), two layers; a format 7 and head_dim 60 are invalid (3).
  EXPECT_EQ(specache_c_abi_int8(d.socket.c_str(), report, sizeof report), 0) << report;
  EXPECT_STREQ(report, "pages=1 used=40960 unknown=3 odd=3");
  char err[128];
  specache_client* none = nullptr;
  EXPECT_EQ(specache_client_connect((d.dir + "/nothing.sock").c_str(), 200, &none, err, sizeof err),
            static_cast<int>(StatusCode::kUnavailable));
  EXPECT_NE(std::string(err).find("no specached"), std::string::npos) << err;
}

}  // namespace
}  // namespace specache

namespace specache {
namespace {

std::string HttpGet(int port, const std::string& path) {
  int s = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::string body;
  if (connect(s, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0) {
    const std::string req = "GET " + path + " HTTP/1.0\r\nHost: localhost\r\n\r\n";
    if (write(s, req.data(), req.size()) == static_cast<ssize_t>(req.size())) {
      char buf[4096];
      for (ssize_t n; (n = read(s, buf, sizeof buf)) > 0;) body.append(buf, static_cast<size_t>(n));
    }
  }
  close(s);
  return body;
}

TEST(DaemonTest, MetricsEndpointReportsThePoolAndSessions) {
  const int port = testing::FreePort();
  DaemonProcess d;
  ASSERT_TRUE(d.Start("", {"--metrics-addr", "127.0.0.1:" + std::to_string(port), "--log-format", "json"}));
  auto c = Connect(d);
  ASSERT_TRUE(c);
  auto session = c->OpenSession("default", 8 << 20);
  ASSERT_TRUE(session.ok());
  std::string page;
  const auto start = Clock::now();
  while (Clock::now() - start < std::chrono::seconds(5)) {
    page = HttpGet(port, "/metrics");
    if (page.find("specache_objects{kind=\"sessions\"} 1") != std::string::npos) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_NE(page.find("specache_pool_bytes{state=\"total\"} 67108864"), std::string::npos) << page;
  // The pool's bytes in huge pages: whatever the host's shmem THP gave, a gauge of its own.
  EXPECT_NE(page.find("specache_pool_bytes{state=\"huge_pages\"} "), std::string::npos) << page;
  auto stats = c->Stats();
  ASSERT_TRUE(stats.ok()) << stats.status().ToString();
  EXPECT_GE(stats->pool_huge_bytes, 0);
  EXPECT_LE(stats->pool_huge_bytes, int64_t{64} << 20);
  EXPECT_NE(page.find("specache_objects{kind=\"sessions\"} 1"), std::string::npos) << page;
  EXPECT_NE(page.find("specache_tenant_bytes{state=\"reserved\",tenant=\"default\"} 8388608"), std::string::npos) << page;
  // The kept sequences' gauges are there (no spill tier here: all zero).
  EXPECT_NE(page.find("specache_kept_bytes{state=\"parked\"} 0"), std::string::npos) << page;
  EXPECT_NE(page.find("specache_spill{kind=\"checksum_failures\"} 0"), std::string::npos) << page;
}

// A daemon (its log captured) with one session of "default" opened by hand, not attached: its
// client, the session, the daemon's stats before anything else, and the attach socket's address.
struct SessionByHand {
  DaemonProcess d;
  std::unique_ptr<client::Client> c;
  v1::OpenSessionResponse opened;
  client::DaemonStats before;
  sockaddr_un attach{};
};
::testing::AssertionResult StartWithSessionByHand(SessionByHand* s) {
  s->d.capture_log = true;
  if (!s->d.Start()) return ::testing::AssertionFailure() << "the daemon did not start";
  s->c = Connect(s->d);
  if (!s->c) return ::testing::AssertionFailure() << "no client";
  auto stub = v1::Control::NewStub(grpc::CreateChannel("unix:" + s->d.socket, grpc::InsecureChannelCredentials()));
  if (grpc::Status st = testing::OpenSessionByHand(*stub, "default", 4 << 20, &s->opened); !st.ok()) {
    return ::testing::AssertionFailure() << "OpenSession: " << st.error_message();
  }
  auto before = s->c->Stats();
  if (!before.ok()) return ::testing::AssertionFailure() << before.status().ToString();
  s->before = *before;
  s->attach.sun_family = AF_UNIX;
  std::strncpy(s->attach.sun_path, s->opened.attach_path().c_str(), sizeof s->attach.sun_path - 1);
  return ::testing::AssertionSuccess();
}

// An attach reply the client cannot receive (its socket shut for reading: the daemon's send fails)
// is counted in errors and logged, and the attach is undone: the session is detached, then
// reclaimed. Before, it was logged only, and the session stayed attached with its client holding
// none of its memory.
TEST(DaemonTest, AnAttachReplyNotDeliveredIsCountedAndUndoesTheAttach) {
  SessionByHand s;
  ASSERT_TRUE(StartWithSessionByHand(&s));
  ASSERT_EQ(s.before.sessions, 1u);
  attach::AttachRequest request;
  request.session_id = s.opened.session_id();
  std::memcpy(request.token.data(), s.opened.token().data(), std::min(s.opened.token().size(), request.token.size()));
  const int g = socket(AF_UNIX, SOCK_STREAM, 0);
  ASSERT_EQ(connect(g, reinterpret_cast<sockaddr*>(&s.attach), sizeof s.attach), 0);
  ASSERT_EQ(shutdown(g, SHUT_RD), 0);
  ASSERT_EQ(write(g, &request, sizeof request), static_cast<ssize_t>(sizeof request));
  uint64_t errors = 0;
  uint32_t sessions = 1;
  for (int i = 0; i < 200 && (errors == 0 || sessions != 0); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(25));
    auto now = s.c->Stats();
    ASSERT_TRUE(now.ok());
    errors = now->errors - s.before.errors;
    sessions = now->sessions;
  }
  close(g);
  EXPECT_EQ(errors, 1u) << "the reply not delivered";
  EXPECT_EQ(sessions, 0u) << "the session is reclaimed, not left attached";
  EXPECT_NE(s.d.Log().find("not delivered"), std::string::npos) << s.d.Log();
}

// Requests on the attach socket that get no session are counted (a wrong token in denied_requests;
// malformed, cut short in errors) and their log lines throttled: any member of the socket's group
// can send them in a loop. Before, each gave a warning and no counter, and one cut short neither.
TEST(DaemonTest, RefusedAndBadAttachRequestsAreCountedAndTheirLinesThrottled) {
  SessionByHand s;
  ASSERT_TRUE(StartWithSessionByHand(&s));
  DaemonProcess& d = s.d;
  auto& c = s.c;
  const v1::OpenSessionResponse& opened = s.opened;
  const client::DaemonStats* before = &s.before;
  sockaddr_un& addr = s.attach;
  // Sends `bytes`; `whole`: waits for the reply (an error), else closes after them.
  auto send = [&](const void* bytes, size_t n, bool whole) {
    const int g = socket(AF_UNIX, SOCK_STREAM, 0);
    ASSERT_EQ(connect(g, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
    ASSERT_EQ(write(g, bytes, n), static_cast<ssize_t>(n));
    if (whole) {
      attach::AttachReply r{};
      ASSERT_EQ(read(g, &r, sizeof r), static_cast<ssize_t>(sizeof r));
      EXPECT_NE(r.code, 0);
    }
    close(g);
  };
  constexpr int kEach = 40;
  attach::AttachRequest wrong_token;
  wrong_token.session_id = opened.session_id();
  wrong_token.token.fill(0x5a);
  const std::string junk(sizeof(attach::AttachRequest), '\xff');
  for (int i = 0; i < kEach; ++i) {
    send(&wrong_token, sizeof wrong_token, true);
    send(junk.data(), junk.size(), true);
    send(&wrong_token, 10, false);  // cut short
  }
  // The cut-short ones are counted as the daemon reads their end: wait for them.
  uint64_t denied = 0, errors = 0;
  for (int i = 0; i < 100; ++i) {
    auto now = c->Stats();
    ASSERT_TRUE(now.ok());
    denied = now->denied_requests - before->denied_requests;
    errors = now->errors - before->errors;
    if (errors >= 2 * kEach) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_EQ(denied, static_cast<uint64_t>(kEach)) << "the wrong tokens";
  EXPECT_EQ(errors, static_cast<uint64_t>(2 * kEach)) << "the malformed and the cut-short requests";
  // A line for the 1st, 2nd, 4th, ... of each kind: 6 of 40, not 40.
  const std::string log = d.Log();
  auto lines = [&](const std::string& what) {
    size_t count = 0;
    for (size_t at = log.find(what); at != std::string::npos; at = log.find(what, at + 1)) ++count;
    return count;
  };
  EXPECT_GE(lines("refused for pid"), 1u) << log;
  EXPECT_LE(lines("refused for pid"), 6u) << log;
  EXPECT_GE(lines("bad requests so far"), 1u) << log;
  EXPECT_LE(lines("bad requests so far"), 7u) << log;
  // The attach socket still serves: a session through the client library (which attaches it).
  auto session = c->OpenSession("default", 4 << 20);
  EXPECT_TRUE(session.ok()) << session.status().ToString();
}

}  // namespace
}  // namespace specache
