// Real processes for the service tests: a specached daemon in a temporary directory and client
// processes (test_client), with their stdout readable line by line.
#pragma once

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

namespace specache::testing {

struct Child {
  pid_t pid = -1;  // -1: not started (Spawn failed) or already reaped
  int out = -1;    // the child's stdout
  int exit_code = -1;  // once reaped

  // A line of stdout, or "" after timeout / EOF.
  std::string ReadLine(int timeout_ms) {
    std::string line;
    const auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
    while (std::chrono::steady_clock::now() < end) {
      pollfd p{out, POLLIN, 50};
      if (poll(&p, 1, 50) <= 0) continue;
      char c;
      if (read(out, &c, 1) != 1) return line;
      if (c == '\n') return line;
      line.push_back(c);
    }
    return line;
  }
  // Exit code (128 + signal when killed), or -1 if still running after timeout_ms or never
  // started. Once reaped, the same code again (waitpid(-1) would reap any other child).
  int Wait(int timeout_ms) {
    if (pid <= 0) return exit_code;
    const auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
    do {
      int status = 0;
      if (waitpid(pid, &status, WNOHANG) == pid) {
        pid = -1;
        exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
        return exit_code;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    } while (std::chrono::steady_clock::now() < end);
    return -1;
  }
  void Kill(int sig = SIGKILL) {
    if (pid > 0) kill(pid, sig);
  }
  ~Child() {
    if (pid > 0) {
      kill(pid, SIGKILL);
      waitpid(pid, nullptr, 0);
    }
    if (out >= 0) close(out);
  }
};

// `stderr_path`: the child's stderr goes to that file (created or truncated); else it is ours.
// `env`: "NAME=value" entries the child gets besides ours (made before the fork: the child only
// calls async-signal-safe functions until it execs). Never null: when the pipe or the fork fails,
// the test fails and the Child is one that never started (no output, Wait -1).
inline std::unique_ptr<Child> Spawn(const std::vector<std::string>& argv, const std::string& stderr_path = "",
                                    const std::vector<std::string>& env = {}) {
  auto c = std::make_unique<Child>();
  int pipefd[2];
  if (pipe2(pipefd, O_CLOEXEC) != 0) {
    ADD_FAILURE() << "Spawn " << (argv.empty() ? "" : argv[0]) << ": pipe2: " << std::strerror(errno);
    return c;
  }
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  std::vector<char*> envp;
  for (char** e = environ; *e != nullptr; ++e) envp.push_back(*e);
  for (const auto& e : env) envp.push_back(const_cast<char*>(e.c_str()));
  envp.push_back(nullptr);
  c->pid = fork();
  const int fork_errno = errno;
  if (c->pid == 0) {
    dup2(pipefd[1], 1);
    if (!stderr_path.empty()) {
      const int err = open(stderr_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
      if (err >= 0) dup2(err, 2);
    }
    execve(args[0], args.data(), envp.data());
    _exit(127);
  }
  close(pipefd[1]);
  if (c->pid < 0) {
    ADD_FAILURE() << "Spawn " << argv[0] << ": fork: " << std::strerror(fork_errno);
    close(pipefd[0]);
    return c;
  }
  c->out = pipefd[0];
  return c;
}

// argv run as another user (setpriv; the caller must be root): uid and gid, and the supplementary
// groups (none: cleared).
inline std::vector<std::string> AsUser(uint32_t uid, uint32_t gid, const std::vector<uint32_t>& groups,
                                       const std::vector<std::string>& argv) {
  std::vector<std::string> out = {"/usr/bin/setpriv", "--reuid", std::to_string(uid), "--regid", std::to_string(gid)};
  if (groups.empty()) {
    out.push_back("--clear-groups");
  } else {
    std::string list;
    for (uint32_t g : groups) list += (list.empty() ? "" : ",") + std::to_string(g);
    out.insert(out.end(), {"--groups", list});
  }
  out.insert(out.end(), argv.begin(), argv.end());
  return out;
}

// Runs a shell command line; returns its stdout and sets *code to its exit status (-1 when it did
// not exit normally).
inline std::string RunCommand(const std::string& command, int* code) {
  FILE* p = popen(command.c_str(), "r");
  if (p == nullptr) {
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

// True when this process may act as other users (root, with setpriv at hand).
inline bool CanSwitchUsers() { return geteuid() == 0 && access("/usr/bin/setpriv", X_OK) == 0; }

// specached on a fresh socket in a temporary directory.
struct DaemonProcess {
  std::string dir, socket;
  std::unique_ptr<Child> child;
  // Set before Start: the daemon's log level, whether its stderr goes to log_path(), and a
  // command the daemon runs under (e.g. {"/usr/bin/prlimit", "--nofile=96", "--"}).
  std::string log_level = "warn";
  bool capture_log = false;
  std::vector<std::string> prefix;
  int exit_code = -1;  // when Start returned false because the daemon exited

  std::string log_path() const { return dir + "/specached.log"; }
  std::string Log() const {
    std::ifstream in(log_path());
    return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }

  // Returns false if the daemon did not come up within 10 s. Up means serving: it told a notify
  // socket of ours READY=1, as it tells systemd, after both sockets got their mode and listen.
  // (Their files exist from bind(), before the chmod: waiting for the files let a test see the
  // mode bind() left.)
  bool Start(const std::string& config_toml = "", std::vector<std::string> extra = {}) {
    char tmpl[] = "/tmp/specached-test-XXXXXX";
    dir = mkdtemp(tmpl);
    std::filesystem::permissions(dir, std::filesystem::perms(0755));  // other users' clients reach the sockets
    socket = dir + "/control.sock";
    // SPECACHE_TEST_SPECACHED: another specached (a bundled copy on the GPU machine).
    const char* binary = std::getenv("SPECACHE_TEST_SPECACHED");
    std::vector<std::string> argv = prefix;
    argv.insert(argv.end(), {binary ? binary : SPECACHED_PATH, "--socket", socket, "--pool-bytes", "64MiB", "--chunk-bytes",
                             "4MiB", "--lease-ms", "1000", "--log-level", log_level});
    if (std::find(extra.begin(), extra.end(), "--metrics-addr") == extra.end()) {
      argv.insert(argv.end(), {"--metrics-addr", "off"});
    }
    if (!config_toml.empty()) {
      std::ofstream(dir + "/specached.toml") << config_toml;
      argv.push_back("--config");
      argv.push_back(dir + "/specached.toml");
    }
    argv.insert(argv.end(), extra.begin(), extra.end());
    const std::string notify_path = dir + "/notify.sock";
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    if (notify_path.size() >= sizeof(addr.sun_path)) return false;
    const int notify = ::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (notify < 0) return false;
    std::copy(notify_path.begin(), notify_path.end(), addr.sun_path);
    if (::bind(notify, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) != 0) {
      close(notify);
      return false;
    }
    child = Spawn(argv, capture_log ? log_path() : "", {"NOTIFY_SOCKET=" + notify_path});
    bool ready = false;
    const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (!ready && std::chrono::steady_clock::now() < end) {
      pollfd p{notify, POLLIN, 0};
      if (poll(&p, 1, 10) > 0) {
        char message[4096];
        const ssize_t n = recv(notify, message, sizeof message, 0);
        ready = n > 0 && std::string(message, static_cast<size_t>(n)).find("READY=1") != std::string::npos;
      } else if ((exit_code = child->Wait(0)) >= 0) {
        break;
      }
    }
    close(notify);
    return ready;
  }
  ~DaemonProcess() {
    child.reset();
    if (!dir.empty()) std::filesystem::remove_all(dir);
  }
};

}  // namespace specache::testing
