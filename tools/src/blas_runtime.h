// Runtime settings that decide the CPU engine's speed, applied before any thread starts:
// - OMP_WAIT_POLICY=passive: the agent's OpenMP workers otherwise spin between calls and fight
//   OpenBLAS's own threads for the cores (measured 5x slower decode on 2 cores).
// - OPENBLAS_CORETYPE: OpenBLAS's dynamic dispatch does not recognise some virtual CPUs and falls
//   back to its SSE3 (Prescott) kernels; when the CPU has AVX2+FMA (or AVX-512), name the kernel.
// Both are read when the libraries load, so the process re-executes itself once when it changes
// them. A value the user already set is never overridden.
#pragma once

namespace specache {

void ConfigureBlasRuntime(char** argv);

}  // namespace specache
