// specache-remote-bench: remote row fetches (TLS control plane, UCX data plane) for the decode
// pattern, by each fetch method, next to ucx_perftest at the message sizes each method sends,
// over the same transport (UCX_TLS, inherited by ucx_perftest), in the same run.
//
// Pattern per step: B sequences x kv_heads KV heads x top-k rows of 2 x head_dim fp16 (512 B at
// head_dim 128), random tokens of a random layer, from sequences spread over --layers x --tokens
// of pages each. The gather starts all B x kv_heads fetches of a step, then waits for them (as an
// engine starts its fetch and waits per layer); the gets method reads one (sequence, head) at a
// time, each as one get per run of consecutive rows.
//
// The daemon is a specached embedded in this process on loopback (rma = true, certificates made
// with openssl in a temporary directory), or a running one (--daemon tcp://HOST:PORT, with the
// SPECACHE_* credentials of specache/client.h; ucx_perftest then needs --perftest-server).
#include <unistd.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <map>
#include <sstream>
#include <thread>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "command_line.h"
#include "daemon.h"
#include "specache/client.h"
#include "specache/remote_session.h"
#include "specache/version.h"

namespace {

using Clock = std::chrono::steady_clock;
using specache::Result;
using specache::Status;
using specache::client::FetchMethod;
using specache::client::RemoteSession;

struct Options {
  std::string daemon;  // empty: embedded
  std::string tenant = "default";
  int batch = 8, kv_heads = 8, topk = 64, head_dim = 128, layers = 2;
  uint32_t tokens = 8192;  // per sequence
  int steps = 20;
  std::string methods = "gather,gets";
  std::string perftest = "ucx_perftest";  // "" or "off": skip
  std::string perftest_server;            // host running `ucx_perftest -p PORT` (a remote daemon's host)
  int perftest_port = 13441;
  bool json = false;
};

std::string Run(const std::string& command, int* code) {
  FILE* p = popen(command.c_str(), "r");
  if (!p) {
    *code = -1;
    return "";
  }
  std::string out;
  char buf[4096];
  for (size_t n; (n = fread(buf, 1, sizeof buf, p)) > 0;) out.append(buf, n);
  const int status = pclose(p);
  *code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return out;
}

// An embedded specached with [remote] on loopback: certificates, a tenant secret, ports picked by
// the kernel.
struct Embedded {
  std::string dir;
  specache::daemon::Daemon daemon;
  std::string target, ca, secret;

  Status Start(uint64_t pool_bytes) {
    char tmpl[] = "/tmp/specache-remote-bench-XXXXXX";
    if (!mkdtemp(tmpl)) return Status::Internal("mkdtemp failed");
    dir = tmpl;
    std::ofstream(dir + "/san.ext") << "subjectAltName=IP:127.0.0.1\n";
    int code = 0;
    Run("cd " + dir + " && openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -subj /CN=bench-ca -days 1 -out ca.pem "
        "2>/dev/null && openssl req -newkey rsa:2048 -nodes -keyout server.key -subj /CN=bench -out server.csr 2>/dev/null && "
        "openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 1 -out server.pem -extfile san.ext "
        "2>/dev/null",
        &code);
    if (code != 0) return Status::Unavailable("openssl could not make the bench's certificates");
    secret = dir + "/default.secret";
    std::ofstream(secret) << "remote-bench-secret-0123456789\n";
    chmod(secret.c_str(), 0600);
    ca = dir + "/ca.pem";
    specache::daemon::DaemonConfig c;
    c.socket = dir + "/control.sock";
    c.chunk_bytes = uint64_t{64} << 20;
    c.pool_bytes = (pool_bytes + c.chunk_bytes - 1) / c.chunk_bytes * c.chunk_bytes;
    c.metrics_addr = "";
    c.lock_memory = false;
    c.prefault_threads = 2;
    c.tenants["default"] = specache::daemon::TenantConfig{c.pool_bytes, {}, {}, "remote-bench-secret-0123456789"};
    c.remote = {"127.0.0.1:0", "127.0.0.1:0", dir + "/server.pem", dir + "/server.key", "", /*rma=*/true};
    specache::daemon::LogEmbeddedDaemonToStderr();  // stdout is the --json output
    SPECACHE_RETURN_IF_ERROR(daemon.Start(c));
    target = "tcp://127.0.0.1:" + std::to_string(daemon.remote_ports().first);
    return Status::Ok();
  }
  ~Embedded() {
    daemon.Stop();
    if (!dir.empty()) std::filesystem::remove_all(dir);
  }
};

struct Figures {
  std::string method;
  double seconds = 0;
  uint64_t rows = 0, requests = 0, gets = 0;
  double rows_per_s() const { return rows / seconds; }
  double gb_per_s(int row_bytes) const { return rows * double(row_bytes) / seconds / 1e9; }
};

Result<Figures> Measure(RemoteSession* s, FetchMethod method, const Options& o, const std::vector<uint64_t>& sequences) {
  const int row_bytes = 4 * o.head_dim;
  std::mt19937 rng(42);
  std::vector<std::vector<int32_t>> tokens(size_t(o.batch) * o.kv_heads, std::vector<int32_t>(o.topk));
  std::vector<std::vector<uint8_t>> out(tokens.size(), std::vector<uint8_t>(size_t(o.topk) * row_bytes));
  const specache::client::RemoteStats before = s->stats();
  Figures f;
  f.method = specache::client::FetchMethodName(method);
  auto step = [&]() -> Status {
    const uint32_t layer = rng() % o.layers;
    for (auto& list : tokens) {
      for (auto& t : list) t = static_cast<int32_t>(rng() % o.tokens);
    }
    if (method == FetchMethod::kServerGather) {
      std::vector<uint64_t> reads;
      for (int b = 0; b < o.batch; ++b) {
        for (int h = 0; h < o.kv_heads; ++h) {
          const size_t i = size_t(b) * o.kv_heads + h;
          SPECACHE_ASSIGN_OR_RETURN(uint64_t r, s->StartRead(sequences[b], layer, h, tokens[i], out[i].data()));
          reads.push_back(r);
        }
      }
      for (uint64_t r : reads) SPECACHE_RETURN_IF_ERROR(s->WaitRead(r));
      return Status::Ok();
    }
    for (int b = 0; b < o.batch; ++b) {
      for (int h = 0; h < o.kv_heads; ++h) {
        const size_t i = size_t(b) * o.kv_heads + h;
        SPECACHE_RETURN_IF_ERROR(s->ReadRows(sequences[b], layer, h, tokens[i], out[i].data(), method));
      }
    }
    return Status::Ok();
  };
  SPECACHE_RETURN_IF_ERROR(step());  // warm-up: connections, page lists, staging buffer
  const specache::client::RemoteStats warm = s->stats();
  const auto start = Clock::now();
  for (int i = 0; i < o.steps; ++i) SPECACHE_RETURN_IF_ERROR(step());
  f.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  const specache::client::RemoteStats after = s->stats();
  f.rows = after.rows_read - warm.rows_read;
  f.requests = after.requests - warm.requests;
  f.gets = after.gets - warm.gets;
  (void)before;
  return f;
}

// ucx_perftest `test` at `bytes`: server and client on this host (or the client against
// --perftest-server). Bandwidth in GB/s (1e9) and messages/s from its final line.
struct Perftest {
  std::string test;
  size_t bytes = 0;
  double gb_per_s = 0, msg_per_s = 0;
  std::string error;
};

Perftest RunPerftest(const Options& o, const std::string& test, size_t bytes, int iterations, int port) {
  Perftest p{test, bytes, 0, 0, ""};
  pid_t server = -1;
  std::string host = o.perftest_server;
  if (host.empty()) {
    host = "127.0.0.1";
    server = fork();
    if (server == 0) {
      const std::string port_text = std::to_string(port);
      freopen("/dev/null", "w", stdout);
      execlp(o.perftest.c_str(), o.perftest.c_str(), "-p", port_text.c_str(), static_cast<char*>(nullptr));
      _exit(127);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
  }
  int code = 0;
  const std::string out =
      Run("timeout 120 " + o.perftest + " " + host + " -p " + std::to_string(port) + " -t " + test + " -s " +
              std::to_string(bytes) + " -n " + std::to_string(iterations) + " -w " + std::to_string(iterations / 10) +
              " -O 16 -f 2>&1",
          &code);
  if (server > 0) {
    kill(server, SIGTERM);
    waitpid(server, nullptr, 0);
  }
  // The final line: iterations, 3 latencies, bandwidth average and overall (MB/s = 2^20 B/s),
  // message rate average and overall.
  std::istringstream lines(out);
  std::string line, last;
  while (std::getline(lines, line)) {
    if (!line.empty() && line.find_first_not_of(" 0123456789.") == std::string::npos) last = line;
  }
  std::istringstream fields(last);
  std::vector<double> v;
  for (double x; fields >> x;) v.push_back(x);
  if (code != 0 || v.size() < 8) {
    p.error = "ucx_perftest failed (exit " + std::to_string(code) + "): " + out.substr(0, 300);
    return p;
  }
  p.gb_per_s = v[5] * 1048576.0 / 1e9;
  p.msg_per_s = v[7];
  return p;
}

int Main(const Options& o) {
  const int row_bytes = 4 * o.head_dim;
  const uint64_t seq_bytes = uint64_t(o.layers) * o.kv_heads * o.tokens * row_bytes;
  const uint64_t need = seq_bytes * o.batch + (uint64_t{64} << 20);
  std::unique_ptr<Embedded> embedded;
  std::string target = o.daemon;
  specache::client::RemoteCredentials credentials = specache::client::RemoteCredentials::FromEnvironment();
  if (target.empty()) {
    embedded = std::make_unique<Embedded>();
    if (Status s = embedded->Start(need + (uint64_t{128} << 20)); !s.ok()) {
      std::fprintf(stderr, "embedded specached: %s\n", s.ToString().c_str());
      return 1;
    }
    target = embedded->target;
    credentials = {embedded->ca, "", "", "default", embedded->secret, ""};
  }
  auto client = specache::client::Client::Connect({target, std::chrono::milliseconds(5000), "remote-bench"}, credentials);
  if (!client.ok()) {
    std::fprintf(stderr, "%s\n", client.status().ToString().c_str());
    return 1;
  }
  nlohmann::json j;
  j["pattern"] = {{"batch", o.batch},   {"kv_heads", o.kv_heads}, {"topk", o.topk},           {"row_bytes", row_bytes},
                  {"layers", o.layers}, {"tokens", o.tokens},     {"pages_bytes", seq_bytes * o.batch}, {"steps", o.steps}};
  const char* tls = std::getenv("UCX_TLS");
  j["ucx_tls"] = tls ? tls : "(unset: UCX's choice)";
  std::vector<Figures> results;
  std::map<std::string, double> mean_message;
  std::stringstream methods(o.methods);
  for (std::string name; std::getline(methods, name, ',');) {
    auto method = specache::client::ParseFetchMethod(name);
    if (!method.ok()) {
      std::fprintf(stderr, "%s\n", method.status().ToString().c_str());
      return 2;
    }
    // One session per method (the gets need remote keys at the hello), filled with the sequences.
    const uint64_t session_bytes = need;
    auto session = RemoteSession::Open(client->get(), credentials.tenant.empty() ? o.tenant : credentials.tenant,
                                       session_bytes, {*method, std::chrono::milliseconds(10000)});
    if (!session.ok()) {
      std::fprintf(stderr, "%s: %s\n", name.c_str(), session.status().ToString().c_str());
      return 1;
    }
    std::vector<uint64_t> sequences;
    std::vector<uint8_t> rows(size_t{4096} * row_bytes, 0x3c);
    for (int b = 0; b < o.batch; ++b) {
      auto seq = (*session)->CreateSequence({uint32_t(o.layers), uint32_t(o.kv_heads), uint32_t(o.head_dim), 64, o.tokens});
      if (!seq.ok() || !(*session)->Extend(*seq, o.tokens).ok()) {
        std::fprintf(stderr, "sequence: %s\n", seq.status().ToString().c_str());
        return 1;
      }
      for (int l = 0; l < o.layers; ++l) {
        for (int h = 0; h < o.kv_heads; ++h) {
          for (uint32_t t = 0; t < o.tokens; t += 4096) {
            const uint32_t n = std::min<uint32_t>(4096, o.tokens - t);
            Status w = (*session)->WriteRows(*seq, l, h, t, rows.data(), size_t(n) * row_bytes);
            if (!w.ok()) {
              std::fprintf(stderr, "write: %s\n", w.ToString().c_str());
              return 1;
            }
          }
        }
      }
      sequences.push_back(*seq);
    }
    auto f = Measure(session->get(), *method, o, sequences);
    if (!f.ok()) {
      std::fprintf(stderr, "%s: %s\n", name.c_str(), f.status().ToString().c_str());
      return 1;
    }
    // What goes over the wire per message: the gather's reply holds top-k rows; a get holds a
    // run of consecutive rows.
    mean_message[f->method] = *method == FetchMethod::kServerGather ? double(o.topk) * row_bytes
                                                                     : double(f->rows) * row_bytes / std::max<uint64_t>(f->gets, 1);
    results.push_back(*f);
  }
  for (const Figures& f : results) {
    nlohmann::json m = {{"method", f.method},           {"rows_per_s", f.rows_per_s()}, {"gb_per_s", f.gb_per_s(row_bytes)},
                        {"requests", f.requests},       {"gets", f.gets},              {"seconds", f.seconds},
                        {"message_bytes", mean_message[f.method]}};
    if (o.perftest != "" && o.perftest != "off") {
      // The same message size over the same transport: AM bandwidth for the gather's replies,
      // get bandwidth for the gets (sizes rounded to whole rows).
      const size_t bytes = std::max<size_t>(row_bytes, size_t(mean_message[f.method] / row_bytes + 0.5) * row_bytes);
      const std::string test = f.method == "gather" ? "ucp_am_bw" : "ucp_get";
      const int iterations = std::max<int>(5000, int(f.requests ? f.requests : f.gets));
      // Locally a fresh server per test (its own port); a remote server is restarted by its loop
      // (`while ucx_perftest -p PORT; do :; done` on the daemon's host).
      const int port = o.perftest_server.empty() ? o.perftest_port + (f.method == "gather" ? 0 : 1) : o.perftest_port;
      Perftest p = RunPerftest(o, test, bytes, std::min(iterations, 20000), port);
      m["ucx_perftest"] = {{"test", p.test}, {"bytes", p.bytes}, {"gb_per_s", p.gb_per_s}, {"msg_per_s", p.msg_per_s}};
      if (!p.error.empty()) m["ucx_perftest"]["error"] = p.error;
      if (p.gb_per_s > 0) m["fraction_of_perftest"] = f.gb_per_s(row_bytes) / p.gb_per_s;
    }
    j["methods"].push_back(m);
  }
  if (results.size() == 2 && results[1].rows_per_s() > 0) {
    j["gather_over_gets"] = results[0].method == "gather" ? results[0].rows_per_s() / results[1].rows_per_s()
                                                          : results[1].rows_per_s() / results[0].rows_per_s();
  }
  if (o.json) {
    std::printf("%s\n", j.dump(2).c_str());
    return 0;
  }
  std::printf("remote fetch: B=%d x %d KV heads x top-%d rows of %d B, %d layers x %u tokens per sequence (%.2f GiB of "
              "pages), UCX %s\n",
              o.batch, o.kv_heads, o.topk, row_bytes, o.layers, o.tokens, double(seq_bytes * o.batch) / (1 << 30),
              j["ucx_tls"].get<std::string>().c_str());
  for (const auto& m : j["methods"]) {
    std::printf("  %-6s %10.0f rows/s %7.3f GB/s  (%.0f B per message)", m["method"].get<std::string>().c_str(),
                m["rows_per_s"].get<double>(), m["gb_per_s"].get<double>(), m["message_bytes"].get<double>());
    if (m.contains("ucx_perftest")) {
      const auto& p = m["ucx_perftest"];
      std::printf("   ucx_perftest %s %zu B: %.3f GB/s", p["test"].get<std::string>().c_str(), p["bytes"].get<size_t>(),
                  p["gb_per_s"].get<double>());
      if (m.contains("fraction_of_perftest")) std::printf(" -> %.2f of it", m["fraction_of_perftest"].get<double>());
      if (p.contains("error")) std::printf(" (%s)", p["error"].get<std::string>().c_str());
    }
    std::printf("\n");
  }
  if (j.contains("gather_over_gets")) std::printf("  gather / gets: %.1fx rows/s\n", j["gather_over_gets"].get<double>());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"specache-remote-bench: remote row fetches by each method, next to ucx_perftest",
               "specache-remote-bench"};
  app.add_option("--daemon", o.daemon, "tcp://HOST:PORT of a running specached (default: one embedded on loopback)");
  app.add_option("--batch", o.batch, "sequences (B)")->capture_default_str();
  app.add_option("--kv-heads", o.kv_heads, "KV heads per sequence")->capture_default_str();
  app.add_option("--topk", o.topk, "rows fetched per (sequence, head)")->capture_default_str();
  app.add_option("--head-dim", o.head_dim, "head_dim (a row is 4 x head_dim bytes)")->capture_default_str();
  app.add_option("--layers", o.layers, "layers per sequence")->capture_default_str();
  app.add_option("--tokens", o.tokens, "tokens per sequence")->capture_default_str();
  app.add_option("--steps", o.steps, "measured decode steps (B x heads fetches each)")->capture_default_str();
  app.add_option("--methods", o.methods, "gather, gets, or both")->capture_default_str();
  app.add_option("--perftest", o.perftest, "ucx_perftest binary, or off")->capture_default_str();
  app.add_option("--perftest-server", o.perftest_server, "host already running `ucx_perftest -p PORT` (remote daemons)");
  app.add_option("--perftest-port", o.perftest_port, "first port for ucx_perftest")->capture_default_str();
  app.add_flag("--json", o.json, "JSON output");
  app.set_version_flag("--version", "specache-remote-bench " SPECACHE_VERSION);
  if (const int code = specache::ParseCommandLine(app, argc, argv); code >= 0) return code;
  return Main(o);
}
