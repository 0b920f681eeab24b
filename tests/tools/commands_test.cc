// The programs as a person meets them: every one answers --help (and each subcommand does), an
// unknown flag gets the same two-line error and exit status 2 everywhere, and every command that
// writes files creates a missing output directory or stops at once, naming it, when it may not
// write there (run as uid 65534 into root's directory), before any model is loaded or any
// measurement starts.
#include <stdio.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "specache/version.h"
#include "testing/model_file.h"
#include "testing/temp_dir.h"

namespace specache {
namespace {

struct Program {
  std::string name, path;
  std::vector<std::string> subcommands;
};

std::vector<Program> Programs() {
  std::vector<Program> p = {
      {"specache-bench", SPECACHE_BENCH_PATH,
       {"memory", "quantize", "attention", "all", "gather", "contend", "step", "attend", "layers", "prefill",
        "reuse"}},
      {"specache-run", SPECACHE_RUN_PATH, {"generate", "niah", "niah-grid", "fidelity", "logits", "bench"}},
  };
#ifdef SPECACHECTL_PATH
  p.push_back({"specached", SPECACHED_PATH, {}});
  p.push_back({"specachectl", SPECACHECTL_PATH,
               {"stats", "sessions", "sequences", "watch", "spill", "restore", "evict", "verify"}});
  p.push_back({"specache-spill-bench", SPILL_BENCH_PATH, {}});
  p.push_back({"specache-service-bench", SERVICE_BENCH_PATH, {}});
  p.push_back({"specache-remote-bench", REMOTE_BENCH_PATH, {}});
#endif
  return p;
}

struct Outcome {
  std::string output;  // stdout and stderr
  int code = -1;       // exit status; -1 when it did not exit normally
  double seconds = 0;
};

Outcome Shell(const std::string& command) {
  Outcome r;
  const auto start = std::chrono::steady_clock::now();
  FILE* p = popen((command + " 2>&1").c_str(), "r");
  if (p == nullptr) return r;
  char buf[4096];
  for (size_t n; (n = fread(buf, 1, sizeof buf, p)) > 0;) r.output.append(buf, n);
  const int status = pclose(p);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return r;
}

bool CanSwitchUsers() { return geteuid() == 0 && access("/usr/bin/setpriv", X_OK) == 0; }

std::string AsNobody(const std::string& command) { return "/usr/bin/setpriv --reuid 65534 --regid 65534 --clear-groups " + command; }

TEST(CommandLineTest, EveryProgramAndSubcommandAnswersHelp) {
  for (const Program& p : Programs()) {
    const Outcome top = Shell(p.path + " --help");
    EXPECT_EQ(top.code, 0) << p.name << ": " << top.output;
    EXPECT_NE(top.output.find("--help"), std::string::npos) << p.name;
    const Outcome version = Shell(p.path + " --version");
    EXPECT_EQ(version.code, 0) << p.name << ": " << version.output;
    EXPECT_EQ(version.output.rfind(p.name + " " + SPECACHE_VERSION, 0), 0u) << p.name << ": " << version.output;
    for (const std::string& sub : p.subcommands) {
      const Outcome r = Shell(p.path + " " + sub + " --help");
      EXPECT_EQ(r.code, 0) << p.name << " " << sub << ": " << r.output;
      EXPECT_NE(r.output.find(sub), std::string::npos) << p.name << " " << sub << ": " << r.output;
    }
  }
}

TEST(CommandLineTest, AnUnknownFlagGetsTheSameErrorEverywhere) {
  for (const Program& p : Programs()) {
    const Outcome top = Shell(p.path + " --no-such-flag");
    EXPECT_EQ(top.code, 2) << p.name << ": " << top.output;
    EXPECT_EQ(top.output, p.name + ": unknown argument --no-such-flag\n" + p.name +
                              ": see '" + p.name + " --help'\n")
        << p.name;
    if (p.subcommands.empty()) continue;
    const std::string sub = p.subcommands.front();
    const Outcome r = Shell(p.path + " " + sub + " --no-such-flag");
    EXPECT_EQ(r.code, 2) << p.name << ": " << r.output;
    EXPECT_EQ(r.output, p.name + ": unknown argument --no-such-flag\n" + p.name + ": see '" +
                            p.name + " " + sub + " --help'\n")
        << p.name;
  }
}

TEST(CommandLineTest, AnUnknownSubcommandIsAUsageError) {
  for (const Program& p : Programs()) {
    if (p.subcommands.empty()) continue;
    const Outcome r = Shell(p.path + " no-such-command");
    EXPECT_EQ(r.code, 2) << p.name << ": " << r.output;
    EXPECT_EQ(r.output.rfind(p.name + ": ", 0), 0u) << r.output;
  }
}

// A malformed --prefill stops specache-run bench before anything is probed or measured (so also
// on a machine without a GPU).
TEST(CommandLineTest, AMalformedPrefillShapeStopsTheBenchAtOnce) {
  for (const std::string shape : {"8y8192", "8x", "x8192", "0x8192", "8x8192x"}) {
    const Outcome r = Shell(std::string(SPECACHE_RUN_PATH) + " bench --kv kivi --prefill " + shape);
    EXPECT_EQ(r.code, 1) << shape << ": " << r.output;
    EXPECT_NE(r.output.find("--prefill is BxT, e.g. 8x8192, not '" + shape + "'"), std::string::npos)
        << shape << ": " << r.output;
  }
}

// A mode the bench does not know, or selection options it cannot apply, stop it the same way;
// the message names the mode as given.
TEST(CommandLineTest, ABadBenchModeStopsTheBenchAtOnce) {
  const struct {
    std::string kv, message;
  } cases[] = {
      {"spec", "--kv is fp16, kivi, specache, specache-nonspec or full-offload, not 'spec'"},
      {"kivi/resident", "--kv 'kivi/resident': selection options apply to specache and specache-nonspec"},
      {"specache/select=bogus", "--kv 'specache/select=bogus': unknown selection 'bogus'"},
      {"specache/no-such-option", "--kv 'specache/no-such-option'"},
  };
  for (const auto& c : cases) {
    const Outcome r = Shell(std::string(SPECACHE_RUN_PATH) + " bench --kv " + c.kv);
    EXPECT_EQ(r.code, 1) << c.kv << ": " << r.output;
    EXPECT_NE(r.output.find(c.message), std::string::npos) << c.kv << ": " << r.output;
  }
}

// Output checks -------------------------------------------------------------------------------

class OutputPathsCommandTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::filesystem::permissions(dir_.path, std::filesystem::perms(0755));  // others may enter, not write
    locked_ = dir_.path + "/locked";
    std::filesystem::create_directory(locked_);
    std::filesystem::permissions(locked_, std::filesystem::perms(0755));
  }
  // `command` as uid 65534 with its output going into root's directory: it must fail at once
  // (no model load, no measurement) with a message naming the path and the reason.
  void ExpectRefusedAtOnce(const std::string& command, const std::string& path) {
    if (!CanSwitchUsers()) GTEST_SKIP() << "needs root and /usr/bin/setpriv to act as uid 65534";
    const Outcome r = Shell(AsNobody(command));
    EXPECT_EQ(r.code, 1) << command << "\n" << r.output;
    EXPECT_NE(r.output.find(path), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("Permission denied"), std::string::npos) << r.output;
    EXPECT_LT(r.seconds, 5.0) << command;
  }
  testing::TempDir dir_;
  std::string locked_;
};

TEST_F(OutputPathsCommandTest, BenchJsonIntoAMissingDirectoryIsWritten) {
  const std::string json = dir_.path + "/new/dir/quantize.json";
  const Outcome r = Shell(std::string(SPECACHE_BENCH_PATH) + " quantize --repeats 1 --json " + json);
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_GT(std::filesystem::file_size(json), 0u);
}

TEST_F(OutputPathsCommandTest, BenchJsonIntoAnotherUsersDirectoryStopsBeforeRunning) {
  const std::string json = locked_ + "/memory.json";
  ExpectRefusedAtOnce(std::string(SPECACHE_BENCH_PATH) + " all --json " + json, locked_);
}

// specache-run checks its outputs before it loads the model: with a model file that does not
// exist, a missing directory is created and the error that follows is the model's.
TEST_F(OutputPathsCommandTest, RunCreatesMissingOutputDirectoriesBeforeLoadingTheModel) {
  const std::string run = SPECACHE_RUN_PATH, model = dir_.path + "/no-model.gguf";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {run + " niah-grid --model " + model + " --haystack x --needle n --question q --answer a --out-dir " +
           dir_.path + "/grid/out",
       dir_.path + "/grid/out"},
      {run + " generate --model " + model + " --prompt hi --selection-trace " + dir_.path + "/trace/t.txt",
       dir_.path + "/trace"},
      {run + " logits --model " + model + " --prompt hi --out " + dir_.path + "/logits/l.json", dir_.path + "/logits"},
  };
  for (const auto& [command, created] : cases) {
    const Outcome r = Shell(command);
    EXPECT_EQ(r.code, 1) << r.output;
    EXPECT_TRUE(std::filesystem::is_directory(created)) << command;
    EXPECT_NE(r.output.find(model), std::string::npos) << r.output;  // then the model's error
  }
}

TEST_F(OutputPathsCommandTest, RunStopsAtOnceWhenItMayNotWriteItsOutputs) {
  // The real model's path when it is there: the refusal must come before loading it.
  const std::string run = SPECACHE_RUN_PATH, model = testing::ModelPath();
  ExpectRefusedAtOnce(run + " niah-grid --model " + model + " --haystack x --needle n --question q --answer a " +
                          "--out-dir " + locked_,
                      locked_);
  ExpectRefusedAtOnce(run + " niah-grid --model " + model + " --haystack x --needle n --question q --answer a " +
                          "--out-dir " + locked_ + "/sub",
                      locked_ + "/sub");
  ExpectRefusedAtOnce(run + " generate --model " + model + " --prompt hi --selection-trace " + locked_ + "/t.txt",
                      locked_);
  ExpectRefusedAtOnce(run + " logits --model " + model + " --prompt hi --out " + locked_ + "/l.json", locked_);
}

#ifdef SPECACHECTL_PATH
// Numbers out of range are usage errors (a zero interval polled the daemon in a busy loop), and
// the store-wide calls' long deadline does not make a missing daemon a long wait.
TEST(CommandLineTest, SpecachectlRefusesOutOfRangeNumbersAndFindsNoDaemonFast) {
  const std::string ctl = SPECACHECTL_PATH;
  for (const std::string args : {"watch --interval 0", "watch --interval -1", "watch --interval 1e12",
                                 "stats --deadline-ms 0", "stats --deadline-ms -5"}) {
    const Outcome r = Shell(ctl + " " + args);
    EXPECT_EQ(r.code, 2) << args << ": " << r.output;
    EXPECT_EQ(r.output.rfind("specachectl: ", 0), 0u) << args << ": " << r.output;
  }
  testing::TempDir dir;
  for (const std::string sub : {"verify", "spill --all", "restore --sequence 1"}) {
    const Outcome r = Shell(ctl + " " + sub + " --socket " + dir.path + "/none.sock --deadline-ms 300");
    EXPECT_EQ(r.code, 1) << sub << ": " << r.output;
    EXPECT_NE(r.output.find("UNAVAILABLE"), std::string::npos) << sub << ": " << r.output;
    EXPECT_LT(r.seconds, 10) << sub;
    const Outcome d = Shell(ctl + " " + sub + " --socket " + dir.path + "/none.sock");  // default deadlines
    EXPECT_EQ(d.code, 1) << sub << ": " << d.output;
    EXPECT_LT(d.seconds, 10) << sub << ": the daemon is looked for within the short deadline";
  }
}

// The park-cost run is a few seconds (specache-spill-bench writes at least 1 GiB, so only its
// refusal is tested).
TEST_F(OutputPathsCommandTest, ServiceBenchIntoMissingDirectoriesWritesThere) {
  const std::string park = dir_.path + "/new/park", json = dir_.path + "/other/park.json";
  const Outcome r = Shell(std::string(SERVICE_BENCH_PATH) + " --park-cost " + park + " --rounds 80 --json " + json);
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_TRUE(std::filesystem::is_directory(park));
  EXPECT_GT(std::filesystem::file_size(json), 0u);
}

TEST_F(OutputPathsCommandTest, ServiceBenchmarksStopAtOnceWhenTheyMayNotWrite) {
  ExpectRefusedAtOnce(std::string(SPILL_BENCH_PATH) + " --dir " + locked_ + "/spill", locked_ + "/spill");
  ExpectRefusedAtOnce(std::string(SPILL_BENCH_PATH) + " --dir /tmp --json " + locked_ + "/s.json",
                      locked_);
  ExpectRefusedAtOnce(std::string(SERVICE_BENCH_PATH) + " --json " + locked_ + "/s.json", locked_);
  ExpectRefusedAtOnce(std::string(SERVICE_BENCH_PATH) + " --park-cost " + locked_ + "/park", locked_ + "/park");
}
#endif

// With the real model: a grid into a directory that does not exist yet runs and writes its
// results there.
TEST_F(OutputPathsCommandTest, NiahGridIntoAMissingDirectoryWritesItsResults) {
  SPECACHE_REQUIRE_MODEL_FILE();
  const std::string out = dir_.path + "/demo/out";
  const Outcome r = Shell(std::string(SPECACHE_RUN_PATH) + " niah-grid --model " + testing::ModelPath() +
                      " --haystack " + testing::SourcePath("tools/data/gpl-3.0.txt") +
                      " --needle 'The secret password for the blue door is PINEAPPLE.'" +
                      " --question 'What is the secret password for the blue door?' --answer pineapple" +
                      " --lengths 256 --depths 0.5 --modes full,specache:1 --max-tokens 8 --out-dir " + out);
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_GT(std::filesystem::file_size(out + "/niah_grid.json"), 0u);
  EXPECT_GT(std::filesystem::file_size(out + "/niah_full.png"), 0u);
  EXPECT_GT(std::filesystem::file_size(out + "/niah_specache-1bit.png"), 0u);
  EXPECT_NE(r.output.find("Reading: "), std::string::npos) << r.output;
}

#ifdef SPECACHE_NULL_CUDA_PATH
// The GPU path's host side on a machine without a GPU: under the null CUDA runtime
// (tools/profile/null_cuda.cc) every CUDA call succeeds and does nothing, so the CUDA agent's and
// the GPU engine's host code (the step's plans and task lists, the fetch's lists and its worker,
// the commits, every mode's own parts) runs the throughput bench's modes and the step and attend
// benches to their end. Device figures mean nothing here; a host-side error or crash fails it.
TEST(NullCudaTest, TheGpuPathsHostSideRunsEveryBenchModeWithoutAGpu) {
  const std::string preload = std::string("LD_PRELOAD=") + SPECACHE_NULL_CUDA_PATH + " ";
  const std::vector<std::string> modes = {"specache",          "specache/host-rows=int8", "specache/select=union",
                                          "specache-nonspec", "kivi",                    "full-offload",
                                          "fp16"};
  std::string kv;
  for (const std::string& m : modes) kv += " --kv " + m;
  const Outcome bench = Shell("SPECACHE_NULL_CUDA_COUNTS=1 " + preload + SPECACHE_RUN_PATH +
                              " bench --shape smollm2 --context 512 --gpu-mem-budget 2GB --max-batch 8 --steps 4"
                              " --host-ram-fraction 100" + kv);
  ASSERT_EQ(bench.code, 0) << bench.output;
  EXPECT_NE(bench.output.find("null device"), std::string::npos) << bench.output;
  for (const std::string& m : modes) {
    // Each mode's row at the batch asked for, and its host line.
    EXPECT_NE(bench.output.find(" 512 " + m + " "), std::string::npos) << m << ": " << bench.output;
  }
  size_t host_lines = 0;
  for (size_t at = 0; (at = bench.output.find("ms to enqueue a step", at)) != std::string::npos; ++at) ++host_lines;
  EXPECT_EQ(host_lines, modes.size()) << bench.output;
  EXPECT_NE(bench.output.find("kernel launches"), std::string::npos) << "the counts at exit: " << bench.output;
  // Every mode above with its timed steps queued a step ahead (the default); here one at a time,
  // in a mode with the speculative row, one without and the anchor whose BeginStep waits for its stream.
  EXPECT_NE(bench.output.find("4 timed steps (queued a step ahead)"), std::string::npos) << bench.output;
  const Outcome one_at_a_time = Shell(preload + SPECACHE_RUN_PATH +
                                      " bench --shape smollm2 --context 512 --gpu-mem-budget 2GB --max-batch 8 --steps 4"
                                      " --host-ram-fraction 100 --no-step-ahead --kv specache --kv fp16 --kv full-offload --json");
  ASSERT_EQ(one_at_a_time.code, 0) << one_at_a_time.output;
  EXPECT_NE(one_at_a_time.output.find("4 timed steps, "), std::string::npos) << one_at_a_time.output;
  for (const std::string m : {"specache", "fp16", "full-offload"}) {
    EXPECT_NE(one_at_a_time.output.find(" 512 " + m + " "), std::string::npos) << m << ": " << one_at_a_time.output;
  }
  EXPECT_NE(one_at_a_time.output.find("\"step_ahead\":false"), std::string::npos) << one_at_a_time.output;
  const Outcome step = Shell(preload + SPECACHE_BENCH_PATH +
                             " step --tokens 512 --batches 2,4 --kv specache-1bit,specache-1bit-int8,specache-2bit");
  EXPECT_EQ(step.code, 0) << step.output;
  // The top-k in order on the model's stream (CudaAgentOptions::selection_on_own_stream false).
  const Outcome ordered = Shell(preload + SPECACHE_BENCH_PATH + " step --tokens 512 --batches 2 --selection-stream compute");
  EXPECT_EQ(ordered.code, 0) << ordered.output;
  EXPECT_NE(ordered.output.find("specache-1bit_copy-engine_ordered_topk"), std::string::npos) << ordered.output;
  const Outcome attend = Shell(preload + SPECACHE_BENCH_PATH + " attend --tokens 512 --batches 4 --random-rows");
  EXPECT_EQ(attend.code, 0) << attend.output;
}
#endif

}  // namespace
}  // namespace specache
