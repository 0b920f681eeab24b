#include "device_fetch.h"

#include <cuda_runtime.h>

#include <cstring>

namespace specache::bench {
namespace {

Status CudaError(const char* what, cudaError_t err) {
  return err == cudaSuccess ? Status::Ok() : Status::Unavailable(std::string(what) + ": " + cudaGetErrorString(err));
}

}  // namespace

DeviceFetch::~DeviceFetch() {
  // Frees on the device that was current at Create; failures leave nothing to undo.
  cudaFree(d_tokens_);
  cudaFree(d_pages_);
  cudaFree(d_rows_);
}

Status DeviceFetch::Create(const TopKRows& rows) {
  if (rows.batch <= 0 || rows.page_tables.size() != static_cast<size_t>(rows.batch) ||
      rows.tokens.size() != static_cast<size_t>(rows.batch) * kHeads) {
    return Status::InvalidArgument("device fetch: the selection does not match its batch");
  }
  const size_t pages_per_seq = rows.page_tables[0].size();
  std::vector<uint64_t> pages;
  for (const auto& table : rows.page_tables) pages.insert(pages.end(), table.begin(), table.end());
  std::vector<int32_t> tokens;
  for (const auto& selected : rows.tokens) {
    if (selected.size() != static_cast<size_t>(kTopK)) return Status::InvalidArgument("device fetch: k rows per head");
    tokens.insert(tokens.end(), selected.begin(), selected.end());
  }
  const size_t row_halves = kRowBytes / sizeof(Half);
  SPECACHE_RETURN_IF_ERROR(CudaError("cudaMalloc", cudaMalloc(&d_tokens_, tokens.size() * sizeof(int32_t))));
  SPECACHE_RETURN_IF_ERROR(CudaError("cudaMalloc", cudaMalloc(&d_pages_, pages.size() * sizeof(uint64_t))));
  SPECACHE_RETURN_IF_ERROR(CudaError("cudaMalloc", cudaMalloc(&d_rows_, tokens.size() * kRowBytes)));
  SPECACHE_RETURN_IF_ERROR(CudaError(
      "upload", cudaMemcpy(d_tokens_, tokens.data(), tokens.size() * sizeof(int32_t), cudaMemcpyHostToDevice)));
  SPECACHE_RETURN_IF_ERROR(
      CudaError("upload", cudaMemcpy(d_pages_, pages.data(), pages.size() * sizeof(uint64_t), cudaMemcpyHostToDevice)));
  tasks_.clear();
  for (int s = 0; s < rows.batch; ++s) {
    for (int h = 0; h < kHeads; ++h) {
      const size_t item = static_cast<size_t>(s) * kHeads + h;
      cuda::FetchTask t;
      t.selected = d_tokens_ + item * kTopK;
      t.n_selected = kTopK;
      t.out_rows = d_rows_ + item * kTopK * row_halves;
      t.pages = d_pages_ + static_cast<size_t>(s) * pages_per_seq;
      t.kv_head = h;
      tasks_.push_back(t);  // no resident rows: every row comes from the host pages
    }
  }
  return Status::Ok();
}

Status DeviceFetch::Launch(int max_blocks, void* stream) const {
  return cuda::FetchRows(tasks_.data(), static_cast<int>(tasks_.size()), kHeadDim, HostRowFormat::kFp16, kPageTokens, max_blocks, nullptr,
                         stream, &plan_);
}

Status DeviceFetch::ClearRows() const { return CudaError("cudaMemset", cudaMemset(d_rows_, 0, bytes())); }

Result<int64_t> DeviceFetch::WrongRows(const TopKRows& rows) const {
  if (rows.host_rows.size() != this->rows()) return Status::InvalidArgument("device fetch: another selection");
  std::vector<uint8_t> back(bytes());
  SPECACHE_RETURN_IF_ERROR(CudaError("download", cudaMemcpy(back.data(), d_rows_, back.size(), cudaMemcpyDeviceToHost)));
  int64_t wrong = 0;
  for (size_t i = 0; i < rows.host_rows.size(); ++i) {
    wrong += std::memcmp(back.data() + i * kRowBytes, rows.host_rows[i], kRowBytes) != 0;
  }
  return wrong;
}

}  // namespace specache::bench
