// specached against a hostile local user: uid 65534, run through setpriv (the tests run as
// root), sometimes in the tenants' group. Who may open sessions of a tenant (before anything is
// reserved), who may administer kept sequences, what each caller sees, how the sockets' files are
// set up, and what the log and the errors show of names a client chose.
#include <sys/stat.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include "processes.h"
#include "specache/client.h"
#include "specache/v1/control.grpc.pb.h"
#include "testing/temp_dir.h"

namespace specache {
namespace {

using testing::AsUser;
using testing::DaemonProcess;
using testing::RunCommand;
using testing::Spawn;

constexpr uint32_t kNobody = 65534;
constexpr uint32_t kTenantGroup = 4242;  // engines of tenant beta; the sockets' group
constexpr uint32_t kAdminGroup = 4343;

#define SKIP_UNLESS_ROOT() \
  if (!testing::CanSwitchUsers()) GTEST_SKIP() << "needs root and /usr/bin/setpriv to act as uid 65534"

// test_client as uid 65534 with these supplementary groups; its first line of output.
std::string AsNobody(const std::vector<uint32_t>& groups, const std::vector<std::string>& args) {
  std::vector<std::string> argv = {TEST_CLIENT_PATH};
  argv.insert(argv.end(), args.begin(), args.end());
  auto child = Spawn(AsUser(kNobody, kNobody, groups, argv));
  const std::string line = child->ReadLine(10000);
  child->Wait(5000);
  return line;
}

#ifndef SPECACHECTL_PATH
#define SPECACHECTL_PATH "/bin/false"  // specachectl not built: its checks fail, they do not pass
#endif

// specachectl as uid 65534 with these groups; its output, and its exit status in *code.
std::string CtlAsNobody(const std::vector<uint32_t>& groups, const DaemonProcess& d, const std::string& args, int* code) {
  std::string cmd;
  for (const std::string& a : AsUser(kNobody, kNobody, groups, {SPECACHECTL_PATH})) cmd += a + " ";
  cmd += "--socket " + d.socket + " " + args + " 2>&1";
  return RunCommand(cmd, code);
}

std::unique_ptr<client::Client> Connect(const DaemonProcess& d) {
  auto c = client::Client::Connect({d.socket, std::chrono::milliseconds(3000), "access-test"});
  EXPECT_TRUE(c.ok()) << c.status().ToString();
  return c.ok() ? std::move(c).value() : nullptr;
}

// A kept sequence of `tenant`, written by root and parked when its session closed.
Result<uint64_t> KeepOne(client::Client* c, const std::string& tenant) {
  uint64_t id = 0;
  {
    SPECACHE_ASSIGN_OR_RETURN(auto session, c->OpenSession(tenant, 4 << 20));
    SPECACHE_ASSIGN_OR_RETURN(id, session->CreateSequence({2, 2, 64, 16, 256}));
    SPECACHE_RETURN_IF_ERROR(session->Extend(id, 40).status());
    SPECACHE_RETURN_IF_ERROR(session->Keep(id));
  }
  for (int i = 0; i < 300; ++i) {
    auto s = c->Stats();
    if (s.ok() && s->parked_sequences == 1) return id;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return Status::DeadlineExceeded("the kept sequence was not parked");
}

const std::string kTwoTenants = R"(
[access]
socket_group = 4242
admin_groups = [4343]
[tenants.alpha]
users = [0]
[tenants.beta]
groups = [4242]
)";

// A user of another tenant (in the sockets' group, so it can connect) can neither move nor see
// alpha's kept sequence; a member of the admin group (a supplementary group) can.
TEST(AccessTest, OnlyAdminsMoveKeptSequencesAndATenantSeesOnlyItsOwn) {
  SKIP_UNLESS_ROOT();
  testing::TempDir spill;
  DaemonProcess d;
  ASSERT_TRUE(d.Start(kTwoTenants, {"--spill-dir", spill.path}));
  auto c = Connect(d);
  ASSERT_TRUE(c);
  auto id = KeepOne(c.get(), "alpha");
  ASSERT_TRUE(id.ok()) << id.status().ToString();
  const std::string seq = std::to_string(*id);
  const std::vector<uint32_t> beta = {kTenantGroup};
  for (const std::vector<std::string>& call : std::vector<std::vector<std::string>>{
           {"Spill", seq}, {"SpillAll"}, {"Restore", seq}, {"Evict", seq}, {"VerifySpill"}, {"ListSessions"}}) {
    std::vector<std::string> args = {"call", d.socket};
    args.insert(args.end(), call.begin(), call.end());
    const std::string got = AsNobody(beta, args);
    EXPECT_EQ(got.rfind("PERMISSION_DENIED", 0), 0u) << call[0] << ": " << got;
    EXPECT_NE(got.find("admin_groups [4343]"), std::string::npos) << "the refusal names the rule: " << got;
  }
  EXPECT_EQ(AsNobody(beta, {"call", d.socket, "ListSequences"}), "OK  sequences=0");
  EXPECT_EQ(AsNobody(beta, {"call", d.socket, "Stats"}), "OK  tenants=beta,");
  int code = -1;
  const std::string refused = CtlAsNobody(beta, d, "evict --sequence " + seq, &code);
  EXPECT_EQ(code, 4) << refused;
  EXPECT_NE(refused.find("PERMISSION_DENIED"), std::string::npos) << refused;
  EXPECT_NE(refused.find("Evict is for admins"), std::string::npos) << refused;
  // Nothing happened to the sequence; root sees it.
  auto list = c->ListSequences();
  ASSERT_TRUE(list.ok());
  ASSERT_EQ(list->size(), 1u);
  EXPECT_EQ((*list)[0].state, "parked");
  EXPECT_GE(c->Stats()->denied_requests, 7u);
  // An admin through a supplementary group.
  const std::vector<uint32_t> admin = {kTenantGroup, kAdminGroup};
  EXPECT_EQ(AsNobody(admin, {"call", d.socket, "ListSequences"}), "OK  sequences=1");
  const std::string verified = CtlAsNobody(admin, d, "verify", &code);
  EXPECT_EQ(code, 0) << verified;
  EXPECT_NE(CtlAsNobody(admin, d, "evict --sequence " + seq, &code).find("evicted"), std::string::npos);
  EXPECT_EQ(c->ListSequences()->size(), 0u);
}

// Another tenant's live session is answered as one that does not exist: a caller learns neither
// which session ids are live nor that tenant's name and rules (the refusal said both). The daemon
// still counts it as a refusal.
TEST(AccessTest, AnotherTenantsSessionLooksLikeNoSession) {
  SKIP_UNLESS_ROOT();
  DaemonProcess d;
  ASSERT_TRUE(d.Start(kTwoTenants));
  auto c = Connect(d);
  ASSERT_TRUE(c);
  auto alpha = c->OpenSession("alpha", 4 << 20);
  ASSERT_TRUE(alpha.ok()) << alpha.status().ToString();
  const uint64_t live = (*alpha)->id(), none = live + 1000;
  const uint64_t denied_before = c->Stats()->denied_requests;
  const std::vector<uint32_t> beta = {kTenantGroup};
  const std::string other = AsNobody(beta, {"call", d.socket, "CloseSession", std::to_string(live)});
  const std::string missing = AsNobody(beta, {"call", d.socket, "CloseSession", std::to_string(none)});
  EXPECT_EQ(other, "NOT_FOUND session " + std::to_string(live));
  EXPECT_EQ(missing, "NOT_FOUND session " + std::to_string(none));
  EXPECT_EQ(c->Stats()->denied_requests, denied_before + 1) << "the other tenant's session: a refusal";
  EXPECT_EQ(c->Stats()->sessions, 1u) << "alpha's session is untouched";
}

// A caller the tenant does not admit is refused at OpenSession, before any memory is reserved:
// the tenant's own user gets its whole quota at once.
TEST(AccessTest, ACallerTheTenantRefusesReservesNothing) {
  SKIP_UNLESS_ROOT();
  DaemonProcess d;
  ASSERT_TRUE(d.Start(kTwoTenants + "quota_bytes = \"16MiB\"\n"));  // beta's quota; alpha: the pool
  auto c = Connect(d);
  ASSERT_TRUE(c);
  const std::string squat = AsNobody({kTenantGroup}, {"call", d.socket, "OpenSession:alpha:67108864"});
  EXPECT_EQ(squat.rfind("PERMISSION_DENIED", 0), 0u) << squat;
  EXPECT_NE(squat.find("tenant 'alpha' admits users [0] and groups []"), std::string::npos) << squat;
  auto stats = c->Stats();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->reserved_bytes, 0u);
  auto whole = c->OpenSession("alpha", 64 << 20);
  EXPECT_TRUE(whole.ok()) << whole.status().ToString();
}

// Tenants and admins see the caller's supplementary groups, not only its primary group.
TEST(AccessTest, SupplementaryGroupsAdmitToATenant) {
  SKIP_UNLESS_ROOT();
  DaemonProcess d;
  ASSERT_TRUE(d.Start(R"(
[access]
socket_group = 65534
[tenants.beta]
groups = [4242]
)"));
  EXPECT_EQ(AsNobody({kTenantGroup}, {"open", d.socket, "beta", "4194304"}), "OK");
  const std::string outsider = AsNobody({}, {"open", d.socket, "beta", "4194304"});
  EXPECT_NE(outsider.find("PERMISSION_DENIED"), std::string::npos) << outsider;
}

// Both sockets get the configured mode (default 0660), never 0666: a user outside the sockets'
// group cannot even connect. A mode with bits for others is refused.
TEST(AccessTest, SocketsAreNotWorldWritable) {
  DaemonProcess d;
  ASSERT_TRUE(d.Start());
  for (const std::string& path : {d.socket, d.socket + ".attach"}) {
    struct stat st {};
    ASSERT_EQ(stat(path.c_str(), &st), 0) << path;
    EXPECT_EQ(st.st_mode & 0777, 0660u) << path;
  }
  if (testing::CanSwitchUsers()) {
    const std::string got = AsNobody({}, {"call", d.socket, "Stats"});
    EXPECT_EQ(got.rfind("UNAVAILABLE", 0), 0u) << got;
  }
  DaemonProcess open;
  EXPECT_FALSE(open.Start("[access]\nsocket_mode = \"0666\"\n"));
  EXPECT_EQ(open.exit_code, 1);
}

// A client name cannot forge log lines (control characters are escaped), and a long tenant name
// is not echoed whole into the error.
TEST(AccessTest, ClientAndTenantNamesAreEscapedAndBounded) {
  DaemonProcess d;
  d.capture_log = true;
  d.log_level = "info";
  ASSERT_TRUE(d.Start());
  auto stub = v1::Control::NewStub(grpc::CreateChannel("unix:" + d.socket, grpc::InsecureChannelCredentials()));
  const std::string forged = "2026-01-01 00:00:00.000 critical FORGED by a client";
  {
    grpc::ClientContext ctx;
    v1::OpenSessionRequest r;
    r.set_tenant("default");
    r.set_pool_bytes(4 << 20);
    r.set_client_name("engine\n" + forged);
    v1::OpenSessionResponse resp;
    ASSERT_TRUE(stub->OpenSession(&ctx, r, &resp).ok());
  }
  grpc::ClientContext ctx;
  v1::OpenSessionRequest r;
  r.set_tenant(std::string(10000, 'T') + "\n" + forged);
  r.set_pool_bytes(4 << 20);
  v1::OpenSessionResponse resp;
  const grpc::Status refused = stub->OpenSession(&ctx, r, &resp);
  EXPECT_EQ(refused.error_code(), grpc::PERMISSION_DENIED);
  EXPECT_LT(refused.error_message().size(), 200u) << refused.error_message().size() << " bytes";
  EXPECT_NE(refused.error_message().find("(" + std::to_string(r.tenant().size()) + " bytes)"), std::string::npos)
      << refused.error_message();
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  const std::string log = d.Log();
  EXPECT_NE(log.find("client 'engine\\x0a2026-01-01"), std::string::npos) << log;
  std::istringstream lines(log);
  for (std::string line; std::getline(lines, line);) {
    EXPECT_NE(line.rfind("2026-01-01 00:00:00.000 critical", 0), 0u) << "forged line in the log: " << line;
    EXPECT_LT(line.size(), 1000u) << "unbounded line in the log";
  }
}

}  // namespace
}  // namespace specache
