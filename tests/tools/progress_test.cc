// The progress line: drawn in place on a terminal with done/total, elapsed and time left; nothing
// at all when stderr is not a terminal.
#include <pty.h>
#include <unistd.h>

#include <cstdio>
#include <string>

#include <gtest/gtest.h>

#include "progress.h"

namespace specache {
namespace {

std::string Contents(FILE* f) {
  std::fflush(f);
  std::rewind(f);
  std::string out;
  char buf[512];
  for (size_t n; (n = std::fread(buf, 1, sizeof buf, f)) > 0;) out.append(buf, n);
  return out;
}

TEST(ProgressTest, LineShowsDoneTotalElapsedAndTimeLeftOnceWorkIsDone) {
  FILE* f = std::tmpfile();
  ASSERT_NE(f, nullptr);
  {
    Progress p("niah-grid:", 4, "points", f, /*enabled=*/true);
    EXPECT_EQ(p.Line(), "niah-grid: 0/4 points, 0s elapsed");  // no estimate before any work
    p.SetTotalWork(1000);
    p.Advance(1, 100);
    EXPECT_NE(p.Line().find("niah-grid: 1/4 points, "), std::string::npos) << p.Line();
    EXPECT_NE(p.Line().find(" elapsed, about "), std::string::npos) << p.Line();
    EXPECT_NE(p.Line().find(" left"), std::string::npos) << p.Line();
    p.Note("niah-grid: full 1024 tokens depth 0.50 ok");
  }
  const std::string out = Contents(f);
  std::fclose(f);
  // Redrawn in place (carriage return, erase to end of line); the note on a line of its own; the
  // line cleared at the end.
  EXPECT_NE(out.find("\rniah-grid: 0/4 points"), std::string::npos);
  EXPECT_NE(out.find("\r\033[Kniah-grid: full 1024 tokens depth 0.50 ok\n"), std::string::npos);
  EXPECT_EQ(out.substr(out.size() - 4), "\r\033[K");
}

TEST(ProgressTest, WritesNothingButNotesWhenDisabled) {
  FILE* f = std::tmpfile();
  ASSERT_NE(f, nullptr);
  {
    Progress p("fidelity:", 3, "positions", f, /*enabled=*/false);
    p.Advance();
    p.Note("a result");
    p.Advance(2);
  }
  EXPECT_EQ(Contents(f), "a result\n");
  std::fclose(f);
}

TEST(ProgressTest, LinesStyleWritesWholeLinesForCommandsThatPrintAsTheyGo) {
  FILE* f = std::tmpfile();
  ASSERT_NE(f, nullptr);
  {
    Progress p("specache-bench all:", 3, "suites", f, /*enabled=*/true, Progress::Style::kLines);
    p.Advance();
  }
  const std::string out = Contents(f);
  std::fclose(f);
  EXPECT_EQ(out.find('\r'), std::string::npos);
  EXPECT_EQ(out.rfind("specache-bench all: 1/3 suites, ", 0), 0u) << out;
  EXPECT_EQ(out.back(), '\n');
}

// The default constructor asks whether stderr is a terminal: a pseudo-terminal gets the line, a
// pipe gets nothing.
TEST(ProgressTest, DrawsOnlyWhenStderrIsATerminal) {
  const int saved = dup(STDERR_FILENO);
  int master = -1, slave = -1;
  ASSERT_EQ(openpty(&master, &slave, nullptr, nullptr, nullptr), 0);
  std::fflush(stderr);
  dup2(slave, STDERR_FILENO);
  bool on_terminal = false;
  {
    Progress p("x:", 2, "items");
    on_terminal = p.enabled();
  }
  int pipefd[2];
  ASSERT_EQ(pipe(pipefd), 0);
  dup2(pipefd[1], STDERR_FILENO);
  bool on_pipe = true;
  {
    Progress p("x:", 2, "items");
    on_pipe = p.enabled();
    p.Advance();
  }
  std::fflush(stderr);
  dup2(saved, STDERR_FILENO);
  close(pipefd[1]);
  char buf[64];
  const ssize_t n = read(pipefd[0], buf, sizeof buf);
  close(pipefd[0]);
  close(master);
  close(slave);
  close(saved);
  EXPECT_TRUE(on_terminal);
  EXPECT_FALSE(on_pipe);
  EXPECT_EQ(n, 0) << "wrote to a pipe";
}

TEST(FormatDurationTest, SecondsMinutesHours) {
  EXPECT_EQ(FormatDuration(42.4), "42s");
  EXPECT_EQ(FormatDuration(185), "3m05s");
  EXPECT_EQ(FormatDuration(3720), "1h02m");
}

}  // namespace
}  // namespace specache
