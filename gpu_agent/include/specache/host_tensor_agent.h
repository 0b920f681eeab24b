// Lets an engine whose tensors live in host memory (the CPU reference engine) use the CUDA agent:
// the wrapper copies each call's q/k/v to device memory and the attention output back. An engine
// with its tensors on the GPU calls the CUDA agent directly. Buffers grow once and are reused.
#pragma once

#include <memory>

#include "specache/agent.h"

namespace specache {

// UNAVAILABLE in a build without CUDA.
Result<std::unique_ptr<Agent>> WrapHostTensors(std::unique_ptr<Agent> device_agent);

}  // namespace specache
