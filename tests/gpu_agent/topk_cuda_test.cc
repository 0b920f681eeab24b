// Label `gpu`: the CUDA top-k equals cpu::SelectTopK exactly (ties towards the lower index, NaN
// lowest, mean and max reductions, k below, at and above n), and with the adaptive budget the
// rows and counts of cpu::SelectRows.
#include "specache/cuda_topk.h"

#include <algorithm>
#include <cmath>
#include <iterator>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "specache/cpu_attention.h"
#include "specache/cuda_fetch.h"
#include "specache/device_probe.h"
#include "specache/selection.h"
#include "testing/cuda_device.h"

#ifdef SPECACHE_TEST_HAVE_CUDA
#include <cuda_runtime.h>

#include "specache/cuda_attention.h"
#include "testing/device_buffers.h"
#include "device_info.h"  // gpu_agent/src/cuda: the SMs
#include "topk_parts.h"   // the cut into parts
#endif

namespace specache {
namespace {

TEST(CudaTopKTest, EqualsTheCpuSelectionExactly) {
  SPECACHE_REQUIRE_CUDA_DEVICE();
#ifdef SPECACHE_TEST_HAVE_CUDA
  std::mt19937 rng(29);
  const int segments = 6;
  for (int heads : {1, 2, 3, 4, 8})  // the group sizes phase one reads with compiled loops, and another
  for (int32_t n : {1, 63, 64, 65, 1000, 8192}) {
    for (int k : {1, 64, 128, 100000}) {
      for (GroupReduction red : {GroupReduction::kMean, GroupReduction::kMax}) {
        // Probabilities with many exact ties (a few distinct values), some NaN, some zeros, a few
        // infinite (a mean of +inf and a NaN or -inf head is NaN: ranked lowest, as NaN).
        std::vector<float> probs(size_t(segments) * heads * n);
        for (auto& p : probs) {
          const uint32_t r = rng() % 100;
          constexpr float kInf = std::numeric_limits<float>::infinity();
          p = r < 3    ? std::numeric_limits<float>::quiet_NaN()
              : r < 5  ? (r == 3 ? kInf : -kInf)
              : r < 40 ? static_cast<float>(rng() % 4) * 0.125f
                       : static_cast<float>(rng() % 100000) / 1e5f;
        }
        const int out_k = std::min(k, n);
        float* d_probs = nullptr;
        float* d_scratch = nullptr;
        int32_t* d_tokens = nullptr;
        ASSERT_EQ(cudaMalloc(&d_probs, probs.size() * 4), cudaSuccess);
        ASSERT_EQ(cudaMalloc(&d_scratch, size_t(segments) * n * 4), cudaSuccess);
        ASSERT_EQ(cudaMalloc(&d_tokens, size_t(segments) * out_k * 4), cudaSuccess);
        ASSERT_EQ(cudaMemcpy(d_probs, probs.data(), probs.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
        ASSERT_TRUE(cuda::SelectTopK(d_probs, segments, heads, n, k, red, d_tokens, d_scratch, nullptr).ok());
        std::vector<int32_t> got(size_t(segments) * out_k);
        ASSERT_EQ(cudaMemcpy(got.data(), d_tokens, got.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
        for (int s = 0; s < segments; ++s) {
          std::vector<int32_t> want;
          std::vector<float> scratch;
          cpu::SelectTopK(probs.data() + size_t(s) * heads * n, heads, n, k, red, &want, &scratch);
          const std::vector<int32_t> mine(got.begin() + size_t(s) * out_k, got.begin() + size_t(s + 1) * out_k);
          ASSERT_EQ(mine, want) << "heads=" << heads << " n=" << n << " k=" << k
                                << " reduction=" << static_cast<int>(red) << " segment " << s;
        }
        cudaFree(d_probs);
        cudaFree(d_scratch);
        cudaFree(d_tokens);
      }
    }
  }
#endif
}

// The radix select's two ways through its later passes (topk.cu): over the listed keys of the
// first digit's bin (scores spread over many octaves; ties at the threshold inside the list) and
// over every key (more than the list holds in that bin: scores within half an octave, 1500 keys
// in the top bin, 6144 exact ties at the threshold). 200 segments of 8K tokens, so that the parts
// are long enough (over 2K tokens) for the second. Each segment equals the CPU's selection, one
// head's probabilities repeated over the group.
TEST(CudaTopKTest, ListedAndUnlistedRadixPassesEqualTheCpuSelection) {
  SPECACHE_REQUIRE_CUDA_DEVICE();
#ifdef SPECACHE_TEST_HAVE_CUDA
  std::mt19937 rng(41);
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  const int heads = 4, k = 64, shapes = 5;
  const int32_t n = 8192;
  testing::DeviceBuffers buf;
  std::vector<cuda::TopKSegment> segments;
  std::vector<std::vector<float>> probs;
  for (int i = 0; i < 200; ++i) {
    const int shape = i % shapes;
    std::vector<float> one(n);
    for (int32_t j = 0; j < n; ++j) {
      switch (shape) {
        case 0: one[j] = std::exp(-30.0f * unit(rng)); break;               // spread: a short list
        case 1: one[j] = 0.9f + 0.0999f * unit(rng); break;                  // flat: every key in one bin
        case 2: one[j] = j % 16 == 0 ? 0.5f : j % 97 == 0 ? 0.75f : 0.01f * unit(rng); break;  // ties at the threshold
        case 3: one[j] = j < 1500 ? 0.6f + 0.01f * unit(rng) : 0.001f * unit(rng); break;  // 1500 in the top bin
        default: one[j] = j % 4 != 0 ? 0.5f : j % 256 == 4 ? 0.7f : 0.4f * unit(rng); break;  // 6144 tied at the threshold
      }
    }
    std::vector<float> p;
    for (int h = 0; h < heads; ++h) p.insert(p.end(), one.begin(), one.end());
    segments.push_back({buf.Copy(p), buf.Allocate<int32_t>(k), buf.Allocate<float>(n), n});
    probs.push_back(std::move(p));
  }
  for (GroupReduction red : {GroupReduction::kMean, GroupReduction::kMax}) {
    ASSERT_TRUE(cuda::SelectTopKBatch(segments.data(), static_cast<int>(segments.size()), heads, k, red, nullptr).ok());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    for (size_t i = 0; i < segments.size(); ++i) {
      std::vector<int32_t> want;
      std::vector<float> scratch;
      cpu::SelectTopK(probs[i].data(), heads, n, k, red, &want, &scratch);
      ASSERT_EQ(testing::Download(segments[i].tokens, k), want) << "segment " << i << ", shape " << i % shapes << ", reduction " << static_cast<int>(red);
    }
  }
#endif
}

// Segments of different lengths in one batched call (1500: more than a by-value batch held): each
// equals the CPU's selection of its own probabilities.
TEST(CudaTopKTest, RaggedBatchEqualsTheCpuSelection) {
  SPECACHE_REQUIRE_CUDA_DEVICE();
#ifdef SPECACHE_TEST_HAVE_CUDA
  std::mt19937 rng(31);
  const int heads = 4, k = 64, count = 1500;
  std::vector<std::vector<float>> probs(count);
  testing::DeviceBuffers buf;
  std::vector<cuda::TopKSegment> segments(count);
  for (int i = 0; i < count; ++i) {
    const int32_t n = static_cast<int32_t>(rng() % (i % 5 == 0 ? 9000 : 300));
    probs[i].resize(size_t(heads) * n);
    for (auto& p : probs[i]) p = rng() % 7 == 0 ? 0.25f : static_cast<float>(rng() % 100000) / 1e5f;
    segments[i] = {buf.Copy(probs[i]), buf.Allocate<int32_t>(k), buf.Allocate<float>(n), n};
    ASSERT_TRUE(segments[i].probs && segments[i].tokens && segments[i].scratch);
  }
  ASSERT_TRUE(cuda::SelectTopKBatch(segments.data(), count, heads, k, GroupReduction::kMean, nullptr).ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  for (int i = 0; i < count; ++i) {
    const int32_t n = segments[i].n;
    std::vector<int32_t> want;
    std::vector<float> scratch;
    if (n > 0) cpu::SelectTopK(probs[i].data(), heads, n, k, GroupReduction::kMean, &want, &scratch);
    ASSERT_EQ(testing::Download(segments[i].tokens, std::min<int32_t>(k, n)), want) << "segment " << i << " n=" << n;
  }
#endif
}

// More segments than one set of launches takes (kMaxTopKSegments, the grid's rows): split into two
// sets, each segment still the CPU's selection. Short segments in three shared buffers.
TEST(CudaTopKTest, MoreSegmentsThanOneSetAreSplit) {
  SPECACHE_REQUIRE_CUDA_DEVICE();
#ifdef SPECACHE_TEST_HAVE_CUDA
  std::mt19937 rng(37);
  const int heads = 2, k = 4, count = cuda::kMaxTopKSegments + 9;
  std::vector<int32_t> n(count);
  std::vector<size_t> at(count + 1, 0);
  for (int i = 0; i < count; ++i) n[i] = static_cast<int32_t>(i % 37), at[i + 1] = at[i] + static_cast<size_t>(n[i]);
  std::vector<float> probs(at[count] * heads);
  for (auto& p : probs) p = static_cast<float>(rng() % 1000) / 1e3f;
  testing::DeviceBuffers buf;
  const float* d_probs = buf.Copy(probs);
  int32_t* d_tokens = buf.Allocate<int32_t>(size_t(count) * k);
  float* d_scratch = buf.Allocate<float>(at[count]);
  ASSERT_TRUE(d_probs && d_tokens && d_scratch);
  std::vector<cuda::TopKSegment> segments(count);
  for (int i = 0; i < count; ++i) {
    segments[i] = {d_probs + at[i] * heads, d_tokens + size_t(i) * k, d_scratch + at[i], n[i]};
  }
  ASSERT_TRUE(cuda::SelectTopKBatch(segments.data(), count, heads, k, GroupReduction::kMean, nullptr).ok());
  const std::vector<int32_t> got = testing::Download(d_tokens, size_t(count) * k);
  for (int i = 0; i < count; ++i) {
    std::vector<int32_t> want;
    std::vector<float> scratch;
    if (n[i] > 0) cpu::SelectTopK(probs.data() + at[i] * heads, heads, n[i], k, GroupReduction::kMean, &want, &scratch);
    const std::vector<int32_t> mine(got.begin() + size_t(i) * k, got.begin() + size_t(i) * k + want.size());
    ASSERT_EQ(mine, want) << "segment " << i << " n=" << n[i];
  }
#endif
}

#ifdef SPECACHE_TEST_HAVE_CUDA
// A segment of n raw scores per head (from `normal`) with its heads' softmax statistics (max, sum),
// as the attention leaves them; its probabilities exp(score - max) / sum, which the CPU selects
// from, appended to `probs`.
cuda::TopKSegment SegmentWithStatistics(int heads, int32_t n, int k, std::mt19937& rng,
                                        std::normal_distribution<float>& normal, testing::DeviceBuffers& buf,
                                        std::vector<std::vector<float>>* probs) {
  std::vector<float> raw(size_t(heads) * n), stats(size_t(heads) * 2), p(raw.size());
  for (auto& x : raw) x = normal(rng);
  for (int h = 0; h < heads; ++h) {
    const float* row = raw.data() + size_t(h) * n;
    const float m = *std::max_element(row, row + n);
    float sum = 0.0f;
    for (int32_t j = 0; j < n; ++j) sum += std::exp(row[j] - m);
    stats[2 * h] = m;
    stats[2 * h + 1] = sum;
    for (int32_t j = 0; j < n; ++j) p[size_t(h) * n + j] = std::exp(row[j] - m) / sum;
  }
  probs->push_back(std::move(p));
  return {buf.Copy(raw), buf.Allocate<int32_t>(k), buf.Allocate<float>(n), n, buf.Copy(stats)};
}

// Selects k rows of each segment (GQA groups of `heads`, their mean) and expects each segment's
// rows to be the CPU's selection from its probabilities.
void ExpectTheCpuSelection(const std::vector<cuda::TopKSegment>& segments, const std::vector<std::vector<float>>& probs,
                           int heads, int k) {
  ASSERT_TRUE(cuda::SelectTopKBatch(segments.data(), static_cast<int>(segments.size()), heads, k,
                                    GroupReduction::kMean, nullptr).ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  for (size_t i = 0; i < segments.size(); ++i) {
    std::vector<int32_t> want;
    std::vector<float> scratch;
    cpu::SelectTopK(probs[i].data(), heads, segments[i].n, k, GroupReduction::kMean, &want, &scratch);
    ASSERT_EQ(testing::Download(segments[i].tokens, k), want) << "segment " << i;
  }
}
#endif

// Long segments (cut into many parts and merged) given as raw scores plus per-head softmax
// statistics: each equals the CPU's selection of the probabilities exp(score - max) / sum.
TEST(CudaTopKTest, LongSegmentsWithStatisticsEqualTheCpuSelection) {
  SPECACHE_REQUIRE_CUDA_DEVICE();
#ifdef SPECACHE_TEST_HAVE_CUDA
  std::mt19937 rng(37);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  const int k = 64;
  for (int heads : {4, 3, 8, 16})  // compiled; scales from shared memory; scales per token
  for (GroupReduction red : {GroupReduction::kMean, GroupReduction::kMax}) {
    testing::DeviceBuffers buf;
    std::vector<cuda::TopKSegment> segments;
    std::vector<std::vector<float>> probs;
    for (int32_t n : {32768, 100000, 5000, 700}) {
      segments.push_back(SegmentWithStatistics(heads, n, k, rng, normal, buf, &probs));
    }
    ASSERT_TRUE(cuda::SelectTopKBatch(segments.data(), static_cast<int>(segments.size()), heads, k, red, nullptr).ok());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    for (size_t i = 0; i < segments.size(); ++i) {
      std::vector<int32_t> want;
      std::vector<float> scratch;
      cpu::SelectTopK(probs[i].data(), heads, segments[i].n, k, red, &want, &scratch);
      ASSERT_EQ(testing::Download(segments[i].tokens, k), want) << "heads=" << heads << " n=" << segments[i].n;
    }
  }
#endif
}

// Segments long enough for the cut's longest ranked parts (topk_parts.h): one 32640-token segment
// per SM (as 33 x 32K sequences' KV heads on an H200) is cut into 4 parts of 8192 tokens, whose
// 4 x 64 candidates a segment's last part ranks; the selection is the CPU's.
TEST(CudaTopKTest, LongRankedPartsEqualTheCpuSelection) {
  SPECACHE_REQUIRE_CUDA_DEVICE();
#ifdef SPECACHE_TEST_HAVE_CUDA
  std::mt19937 rng(53);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  const int k = 64, heads = 4, count = cuda::MultiprocessorCount();
  const int32_t n = 32768 - 128;
  std::vector<cuda::TopKSegment> cut_of(static_cast<size_t>(count));
  for (auto& seg : cut_of) seg.n = n;
  for (const int blocks_per_sm : {4, 5}) {  // the phase-one occupancy: 4 (5 before its loads in flight doubled)
    cuda::TopKParts cut;
    ASSERT_TRUE(cuda::ChooseTopKParts(cut_of.data(), count, k, count, blocks_per_sm, &cut).ok());
    ASSERT_EQ(cut.part_tokens, cuda::kMaxPartTokens) << "blocks per SM " << blocks_per_sm;
    ASSERT_EQ(cut.max_parts, 4);
  }
  testing::DeviceBuffers buf;
  std::vector<cuda::TopKSegment> segments;
  std::vector<std::vector<float>> probs;
  for (int i = 0; i < count; ++i) {
    segments.push_back(SegmentWithStatistics(heads, n, k, rng, normal, buf, &probs));
  }
  ExpectTheCpuSelection(segments, probs, heads, k);
#endif
}

// Every forced cut (DecodePlan::force_topk_part_tokens, the benchmarks' sweep of part sizes) gives
// the CPU's selection: one part a segment, parts whose merge ranks its candidates, and parts merged
// by a radix select of their own; a part the kernel cannot hold is refused.
TEST(CudaTopKTest, ForcedCutsEqualTheCpuSelection) {
  SPECACHE_REQUIRE_CUDA_DEVICE();
#ifdef SPECACHE_TEST_HAVE_CUDA
  std::mt19937 rng(61);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  const int k = 64, heads = 4;
  testing::DeviceBuffers buf;
  std::vector<cuda::TopKSegment> segments;
  std::vector<std::vector<float>> probs;
  for (int32_t n : {8192, 8000, 32768, 700}) segments.push_back(SegmentWithStatistics(heads, n, k, rng, normal, buf, &probs));
  const int count = static_cast<int>(segments.size());
  for (int part : {512, 1024, 2048, 4096, 8192}) {
    cuda::DecodePlan plan;
    plan.force_topk_part_tokens(part);
    ASSERT_TRUE(cuda::SelectTopKBatch(segments.data(), count, heads, k, GroupReduction::kMean, nullptr, nullptr, &plan).ok())
        << part;
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    for (int i = 0; i < count; ++i) {
      std::vector<int32_t> want;
      std::vector<float> scratch;
      cpu::SelectTopK(probs[i].data(), heads, segments[i].n, k, GroupReduction::kMean, &want, &scratch);
      ASSERT_EQ(testing::Download(segments[i].tokens, std::min<int32_t>(k, segments[i].n)), want)
          << "parts of " << part << ", segment of " << segments[i].n;
    }
  }
  cuda::DecodePlan bad;
  bad.force_topk_part_tokens(1000);
  EXPECT_EQ(cuda::SelectTopKBatch(segments.data(), count, heads, k, GroupReduction::kMean, nullptr, nullptr, &bad).code(),
            StatusCode::kInvalidArgument);
#endif
}

#ifdef SPECACHE_TEST_HAVE_CUDA
// The name of a plan's kind of slot reads, for the tests' messages.
const char* ReadsName(cuda::DecodePlan::SlotReads reads) {
  switch (reads) {
    case cuda::DecodePlan::SlotReads::kDeviceCopy: return "side-stream copy";
    case cuda::DecodePlan::SlotReads::kStreamCopy: return "stream copy";
    case cuda::DecodePlan::SlotReads::kInPlace: return "read in place";
  }
  return "?";
}
constexpr cuda::DecodePlan::SlotReads kEveryReads[] = {cuda::DecodePlan::SlotReads::kDeviceCopy,
                                                       cuda::DecodePlan::SlotReads::kStreamCopy,
                                                       cuda::DecodePlan::SlotReads::kInPlace};

// Sets of segments with their statistics (SegmentWithStatistics), one per list of lengths, and the
// CPU's selection of each segment: want[set][segment].
void SegmentSets(const std::vector<std::vector<int32_t>>& lengths, int heads, int k, std::mt19937& rng,
                 testing::DeviceBuffers& buf, std::vector<std::vector<cuda::TopKSegment>>* sets,
                 std::vector<std::vector<std::vector<int32_t>>>* want) {
  std::normal_distribution<float> normal(0.0f, 2.0f);
  for (const std::vector<int32_t>& set_lengths : lengths) {
    std::vector<std::vector<float>> probs;
    sets->emplace_back();
    want->emplace_back();
    for (int32_t n : set_lengths) {
      sets->back().push_back(SegmentWithStatistics(heads, n, k, rng, normal, buf, &probs));
      std::vector<float> scratch;
      want->back().emplace_back();
      cpu::SelectTopK(probs.back().data(), heads, n, k, GroupReduction::kMean, &want->back().back(), &scratch);
    }
  }
}

// On a plan of each kind (a forced cut of `part_tokens` when positive), `calls` top-k calls in a
// row on one stream, call c over sets[c % sets.size()], each call's selection kept apart and
// allocated before the calls (so that nothing slows the host between them: the ring's slots come
// round while kernels still run); then each call's rows equal the CPU's.
void ExpectManyCallsSelectAsTheCpu(const std::vector<std::vector<cuda::TopKSegment>>& sets,
                                   const std::vector<std::vector<std::vector<int32_t>>>& want, int heads, int k,
                                   int calls, int part_tokens, testing::DeviceBuffers& buf) {
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  for (auto reads : kEveryReads) {
    cuda::DecodePlan plan(reads);
    if (part_tokens > 0) plan.force_topk_part_tokens(part_tokens);
    std::vector<int32_t*> outputs;  // [call]: its segments' rows, k apart
    for (int call = 0; call < calls; ++call) {
      outputs.push_back(buf.Allocate<int32_t>(sets[call % sets.size()].size() * k));
      ASSERT_TRUE(outputs.back());
    }
    for (int call = 0; call < calls; ++call) {
      std::vector<cuda::TopKSegment> segments = sets[call % sets.size()];
      for (size_t i = 0; i < segments.size(); ++i) segments[i].tokens = outputs[call] + i * k;
      ASSERT_TRUE(cuda::SelectTopKBatch(segments.data(), static_cast<int>(segments.size()), heads, k,
                                        GroupReduction::kMean, stream, nullptr, &plan)
                      .ok())
          << "call " << call << ", " << ReadsName(reads);
    }
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    for (int call = 0; call < calls; ++call) {
      const std::vector<std::vector<int32_t>>& expected = want[call % want.size()];
      const std::vector<int32_t> got = testing::Download(outputs[call], expected.size() * k);
      for (size_t i = 0; i < expected.size(); ++i) {
        ASSERT_EQ(std::vector<int32_t>(got.begin() + i * k, got.begin() + i * k + expected[i].size()), expected[i])
            << "call " << call << ", segment " << i << ", " << ReadsName(reads);
      }
    }
  }
  cudaStreamDestroy(stream);
}
#endif

// A plan whose segments are read in place (DecodePlan::SlotReads::kInPlace, the agent's selection
// stream) or copied in the call's own stream selects what the CPU does over more calls in a row
// than its ring has slots (each slot, and its zeroed counters of the segments' parts, taken again
// only after its release), as a side-stream copy's plan does.
TEST(CudaTopKTest, PlansOfEveryKindSelectAsTheCpuOverManyCalls) {
  SPECACHE_REQUIRE_CUDA_DEVICE();
#ifdef SPECACHE_TEST_HAVE_CUDA
  std::mt19937 rng(71);
  const int k = 64, heads = 4, kCalls = 150;  // > DecodePlan's ring of 64 slots
  testing::DeviceBuffers buf;
  std::vector<std::vector<cuda::TopKSegment>> sets;
  std::vector<std::vector<std::vector<int32_t>>> want;
  SegmentSets({{8192, 700, 32768}, {8292, 700, 32768}, {8392, 700, 32768}}, heads, k, rng, buf, &sets, &want);
  ASSERT_NO_FATAL_FAILURE(ExpectManyCallsSelectAsTheCpu(sets, want, heads, k, kCalls, 0, buf));
#endif
}

// The parts' counters live in each slot's zeroed device bytes, which the kernels leave zero: on
// every kind of plan, calls of segments cut into several parts (counters asked for), of 1500 such
// segments (more counters than a slot's first buffer holds: it grows partway through the ring) and
// of one-part segments (none asked for) take the ring's slots in turn over more calls than it
// has, and every call selects what the CPU does.
TEST(CudaTopKTest, PartCountersGrowAndComeBackZeroOnEveryKindOfPlan) {
  SPECACHE_REQUIRE_CUDA_DEVICE();
#ifdef SPECACHE_TEST_HAVE_CUDA
  std::mt19937 rng(83);
  const int k = 16, heads = 2, kCalls = 130;  // > DecodePlan's ring of 64 slots; 64 % 3 != 0
  testing::DeviceBuffers buf;
  std::vector<std::vector<cuda::TopKSegment>> sets;
  std::vector<std::vector<std::vector<int32_t>>> want;
  // Three kinds of call (parts of 1024 tokens): 3 segments of 4 parts, 1500 of 2 parts, 3 of one part.
  SegmentSets({{4096, 4000, 3900}, std::vector<int32_t>(1500, 2048), {700, 1000, 300}}, heads, k, rng, buf, &sets,
              &want);
  ASSERT_NO_FATAL_FAILURE(ExpectManyCallsSelectAsTheCpu(sets, want, heads, k, kCalls, 1024, buf));
#endif
}

// The selection captured in a CUDA graph and replayed over new scores: segments of several parts
// (whose last part to finish merges, counted in the plan slot's zeroed bytes) give the CPU's
// selection on every replay, not only the first (the captured zeroing and the kernels' own reset
// start the counters from zero each time), ties across parts included.
TEST(CudaTopKTest, ACapturedGraphReplaysTheSelectionOverNewScores) {
  SPECACHE_REQUIRE_CUDA_DEVICE();
#ifdef SPECACHE_TEST_HAVE_CUDA
  std::mt19937 rng(47);
  const int heads = 4, k = 64;
  const std::vector<int32_t> lengths = {32768, 20000, 8000, 700, 65536};
  testing::DeviceBuffers buf;
  std::vector<cuda::TopKSegment> segments;
  for (int32_t n : lengths) {
    segments.push_back({buf.Allocate<float>(size_t(heads) * n), buf.Allocate<int32_t>(k), buf.Allocate<float>(n), n});
    ASSERT_TRUE(segments.back().probs && segments.back().tokens && segments.back().scratch);
  }
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  for (auto reads : kEveryReads) {
    SCOPED_TRACE(ReadsName(reads));
    cuda::DecodePlan plan(reads);
    cudaGraph_t graph = nullptr;
    ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeRelaxed), cudaSuccess);
    const Status captured = cuda::SelectTopKBatch(segments.data(), static_cast<int>(segments.size()), heads, k,
                                                  GroupReduction::kMean, stream, nullptr, &plan);
    ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
    ASSERT_TRUE(captured.ok()) << captured.ToString();
    cudaGraphExec_t exec = nullptr;
    ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
    for (int replay = 0; replay < 3; ++replay) {
      std::vector<std::vector<float>> probs;
      for (const cuda::TopKSegment& seg : segments) {
        std::vector<float> p(size_t(heads) * seg.n);
        // The second replay's scores take 8 values: ties everywhere, across the parts too.
        for (auto& x : p) {
          x = replay == 1 ? static_cast<float>(rng() % 8) / 8.0f : static_cast<float>(rng() % 1000000) / 1e6f;
        }
        ASSERT_EQ(cudaMemcpy(const_cast<float*>(seg.probs), p.data(), p.size() * sizeof(float), cudaMemcpyHostToDevice),
                  cudaSuccess);
        ASSERT_EQ(cudaMemset(seg.tokens, 0xff, k * sizeof(int32_t)), cudaSuccess);
        probs.push_back(std::move(p));
      }
      // cudaMemcpy from pageable memory may return before its copy lands, and cudaMemset is
      // asynchronous; both go to the legacy stream, which `stream` (non-blocking) does not wait for.
      // Without this the graph read some of the last segment's scores before they were written
      // (one replay failed once on the H200).
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
      ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
      for (size_t i = 0; i < segments.size(); ++i) {
        std::vector<int32_t> want;
        std::vector<float> scratch;
        cpu::SelectTopK(probs[i].data(), heads, segments[i].n, k, GroupReduction::kMean, &want, &scratch);
        ASSERT_EQ(testing::Download(segments[i].tokens, want.size()), want)
            << "replay " << replay << " n=" << segments[i].n;
      }
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
  }
  cudaStreamDestroy(stream);
#endif
}

// A large k over long segments, many at once (so that phase one's parts are 8K tokens long on an
// H200): three parts of k = 2048 candidates each fill the merge's shared memory (48 KiB of scores
// and tokens, past what a launch gets unasked once the merge's static arrays count). Each segment
// equals the CPU's selection.
TEST(CudaTopKTest, MergeOfTheMostCandidatesEqualsTheCpuSelection) {
  SPECACHE_REQUIRE_CUDA_DEVICE();
#ifdef SPECACHE_TEST_HAVE_CUDA
  std::mt19937 rng(43);
  const int heads = 2, k = 2048, count = 300;
  const int32_t n = 24576;
  testing::DeviceBuffers buf;
  std::vector<cuda::TopKSegment> segments;
  std::vector<std::vector<float>> probs;
  for (int i = 0; i < count; ++i) {
    std::vector<float> p(size_t(heads) * n);
    for (auto& x : p) x = rng() % 5 == 0 ? 0.125f : static_cast<float>(rng() % 1000000) / 1e6f;
    segments.push_back({buf.Copy(p), buf.Allocate<int32_t>(k), buf.Allocate<float>(n), n});
    ASSERT_TRUE(segments.back().probs && segments.back().tokens && segments.back().scratch);
    probs.push_back(std::move(p));
  }
  ExpectTheCpuSelection(segments, probs, heads, k);
#endif
}

// The adaptive budget on random segments in one batch (ragged n, none a multiple of 256 but one,
// long ones cut into parts, peaked and flat scores, exact ties, NaN): for several masses and
// bounds, each segment's count and kept rows equal cpu::SelectRows's, the rest of its k_max slots
// are kNoToken, and the device total is the sum of the counts.
TEST(CudaTopKTest, AdaptiveBudgetEqualsTheCpuRule) {
  SPECACHE_REQUIRE_CUDA_DEVICE();
#ifdef SPECACHE_TEST_HAVE_CUDA
  std::mt19937 rng(41);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int heads = 3;
  const std::vector<int32_t> lengths{1, 7, 63, 255, 256, 257, 999, 3001, 12345, 40003};
  struct Bounds {
    int k_min, k_max;
  };
  int combination = 0;
  for (double mass : {0.05, 0.5, 0.9, 0.99, 1.0}) {
    for (Bounds b : {Bounds{1, 64}, Bounds{8, 64}, Bounds{16, 16}, Bounds{5, 333}, Bounds{1, 1000}}) {
      for (GroupReduction red : {GroupReduction::kMean, GroupReduction::kMax}) {
        // Each kind of plan in turn (the budget kernel reads its segment from the slot too).
        const cuda::DecodePlan::SlotReads reads = kEveryReads[combination++ % std::size(kEveryReads)];
        cuda::DecodePlan plan(reads);
        testing::DeviceBuffers buf;
        std::vector<cuda::TopKSegment> segments;
        std::vector<std::vector<float>> probs;
        for (size_t i = 0; i < 2 * lengths.size(); ++i) {
          const int32_t n = lengths[i % lengths.size()];
          std::vector<float> p(size_t(heads) * n);
          // Half the segments peaked (softmax of sharp scores), half with few distinct values.
          const bool peaked = i < lengths.size();
          for (int h = 0; h < heads; ++h) {
            float* row = p.data() + size_t(h) * n;
            float sum = 0.0f;
            for (int32_t j = 0; j < n; ++j) {
              const uint32_t r = rng() % 100;
              row[j] = peaked ? std::exp(4.0f * normal(rng)) : r < 50 ? static_cast<float>(rng() % 4) * 0.125f : 0.0f;
              sum += row[j];
            }
            for (int32_t j = 0; j < n; ++j) {
              row[j] = sum > 0 ? row[j] / sum : 0.0f;
              if (rng() % 97 == 0) row[j] = std::numeric_limits<float>::quiet_NaN();
            }
          }
          cuda::TopKSegment seg{buf.Copy(p), buf.Allocate<int32_t>(size_t(b.k_max)),
                                buf.Allocate<float>(size_t(cuda::TopKScratchFloats(n, true))), n};
          seg.count = buf.Allocate<int32_t>(1);
          segments.push_back(seg);
          probs.push_back(std::move(p));
        }
        auto* rows = buf.Zeros<unsigned long long>(1);
        const cuda::TopKBudget budget{static_cast<float>(mass), b.k_min, rows};
        ASSERT_TRUE(cuda::SelectTopKBatch(segments.data(), static_cast<int>(segments.size()), heads, b.k_max, red,
                                          nullptr, &budget, &plan)
                        .ok())
            << ReadsName(reads);
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        KvConfig c;
        c.mass = mass;
        c.k_min = b.k_min;
        c.k_max = b.k_max;
        c.reduction = red;
        unsigned long long total = 0;
        for (size_t i = 0; i < segments.size(); ++i) {
          const int32_t n = segments[i].n;
          std::vector<int32_t> want;
          cpu::SelectionScratch scratch;
          cpu::SelectRows(c, probs[i].data(), probs[i].data(), heads, n, &want, &scratch);
          const std::string where = "mass " + std::to_string(mass) + " k " + std::to_string(b.k_min) + ".." +
                                    std::to_string(b.k_max) + " reduction " + std::to_string(static_cast<int>(red)) +
                                    " n " + std::to_string(n) + (i < lengths.size() ? " peaked" : " flat") +
                                    ", " + ReadsName(reads);
          const int32_t count = testing::Download(segments[i].count, 1)[0];
          ASSERT_EQ(count, static_cast<int32_t>(want.size())) << where;
          std::vector<int32_t> got = testing::Download(segments[i].tokens, std::min<int32_t>(b.k_max, n));
          for (size_t j = static_cast<size_t>(count); j < got.size(); ++j) ASSERT_EQ(got[j], cuda::kNoToken) << where;
          got.resize(static_cast<size_t>(count));
          ASSERT_EQ(got, want) << where;
          total += static_cast<unsigned long long>(count);
        }
        EXPECT_EQ(testing::Download(rows, 1)[0], total);
      }
    }
  }
#endif
}

// The budget's arguments are checked before anything runs.
TEST(CudaTopKTest, AdaptiveBudgetRefusesBadArguments) {
  SPECACHE_REQUIRE_CUDA_DEVICE();
#ifdef SPECACHE_TEST_HAVE_CUDA
  cuda::TopKSegment none;
  const cuda::TopKBudget no_mass{0.0f, 1, nullptr}, no_k_min{0.5f, 0, nullptr}, fine{0.5f, 1, nullptr};
  EXPECT_EQ(cuda::SelectTopKBatch(&none, 1, 1, 8, GroupReduction::kMean, nullptr, &no_mass).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(cuda::SelectTopKBatch(&none, 1, 1, 8, GroupReduction::kMean, nullptr, &no_k_min).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(cuda::SelectTopKBatch(&none, 1, 1, cuda::kMaxBudgetRows + 1, GroupReduction::kMean, nullptr, &fine).code(),
            StatusCode::kInvalidArgument);
#endif
}

}  // namespace
}  // namespace specache
