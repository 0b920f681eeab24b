// specache-run on the GPU: the model's weights dequantized once to fp16 on the device (GpuLlama),
// a CUDA agent on the model's stream holding the KV cache, and the GpuEngine loop (prefill, then
// batched greedy decode); only tokens cross to the host. Used when --backend is cuda, or auto on a
// machine with a usable GPU, in a build with CUDA. Builds without CUDA answer UNAVAILABLE.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "run_support.h"

namespace specache::run {

// True when this build has the GPU model and `backend` picks it ("cuda", or "auto" with a usable
// device).
bool UseGpuModel(const std::string& backend);

struct GpuGeneration {
  std::vector<Generation> outputs;  // one per prompt
  double prefill_seconds = 0;
  double decode_seconds = 0;
  int64_t decode_steps = 0;
  nlohmann::json figures;           // mode, backend, device and full-precision KV bytes, speeds
};

// Greedy answers to `prompts` (token ids), decoded together as one ragged batch; `on_text` gets
// prompt 0's text as it grows. The full-precision KV lives in `memory` (or process memory).
Result<GpuGeneration> GenerateOnGpu(const LoadedModel& m, const KvConfig& config, KvMemory* memory,
                                    const std::vector<std::vector<int32_t>>& prompts, int max_tokens,
                                    const std::function<void(std::string_view)>& on_text = {});

}  // namespace specache::run
