// The command-line conventions every specache program shares (CLI11): `--help` on the program and
// on each subcommand, `--version`, and one form for usage errors (an unknown flag, a missing
// value, a wrong subcommand):
//
//   PROGRAM: <what is wrong>            e.g. "unknown argument --jsno"
//   PROGRAM: see 'PROGRAM [SUBCOMMAND] --help'
//
// on stderr, with exit status 2 (the usage-error status of the shell's utilities).
#pragma once

#include <cstdio>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

namespace specache {

inline constexpr int kUsageExitCode = 2;

// Parses argv into `app`. Returns -1 when the program should go on; otherwise the exit status:
// 0 after --help or --version (printed), kUsageExitCode after a usage error (printed as above).
inline int ParseCommandLine(CLI::App& app, int argc, char** argv) {
  try {
    app.parse(argc, argv);
    return -1;
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    // Words nobody took are named first, whatever else is wrong: CLI11 would report a missing
    // required option before an unknown one, so a typo in a flag would read as a different error
    // depending on the program.
    const std::vector<std::string> unknown = app.remaining(/*recurse=*/true);
    std::string what = e.what();
    if (!unknown.empty()) {
      what = unknown.size() == 1 ? "unknown argument" : "unknown arguments";
      for (const std::string& word : unknown) what += " " + word;
    }
    // The help hint names the deepest subcommand the words reached, whose --help lists the
    // options that apply there.
    std::string where = app.get_name();
    for (const CLI::App* at = &app;;) {
      const auto parsed = at->get_subcommands();
      if (parsed.empty()) break;
      at = parsed.front();
      where += " " + at->get_name();
    }
    std::fprintf(stderr, "%s: %s\n%s: see '%s --help'\n", app.get_name().c_str(), what.c_str(), app.get_name().c_str(),
                 where.c_str());
    return kUsageExitCode;
  }
}

}  // namespace specache
