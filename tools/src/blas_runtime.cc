#include "blas_runtime.h"

#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <string>

extern "C" char* openblas_get_corename(void);

namespace specache {

void ConfigureBlasRuntime(char** argv) {
  if (std::getenv("SPECACHE_BLAS_CONFIGURED")) return;
  setenv("SPECACHE_BLAS_CONFIGURED", "1", 1);
  bool changed = false;
  if (!std::getenv("OMP_WAIT_POLICY")) {
    setenv("OMP_WAIT_POLICY", "passive", 1);
    changed = true;
  }
  if (!std::getenv("OPENBLAS_CORETYPE")) {
    const std::string core = openblas_get_corename();
    const bool generic = core == "Prescott" || core == "Core2" || core == "Penryn" || core == "Dunnington" ||
                         core == "Nehalem" || core == "Sandybridge";
    __builtin_cpu_init();
    const char* better = nullptr;
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")) {
      better = "SkylakeX";
    } else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
      better = "Haswell";
    }
    if (generic && better) {
      setenv("OPENBLAS_CORETYPE", better, 1);
      changed = true;
    }
  }
  if (changed) execv("/proc/self/exe", argv);  // on failure, run on with the defaults
}

}  // namespace specache
