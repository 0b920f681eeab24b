// Label `gpu`: the CUDA decode attention against cpu::AttendDecodeRows on random replicas (bits
// 1/2/4/16, head_dim 64/128, GQA 1-4, one and two rows, substituted rows, probabilities), one
// item at a time and as ragged batches.
#include "specache/cuda_attention.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>

#include "specache/cpu_attention.h"
#include "specache/device_probe.h"
#include "specache/quantizer.h"
#include "testing/cuda_device.h"
#include "testing/reference.h"

#ifdef SPECACHE_TEST_HAVE_CUDA
#include <cuda_runtime.h>

#include "specache/cuda_replica.h"
#include "lowbit_decode.h"
#include "mma_codes.h"
#include "testing/device_buffers.h"
#endif

namespace specache {
namespace {

#ifdef SPECACHE_TEST_HAVE_CUDA
using testing::DeviceBuffers;
#endif

#ifdef SPECACHE_TEST_HAVE_CUDA
// One random item and what the CPU reference makes of it.
struct DecodeCase {
  cuda::DeviceDecodeItem item;
  std::vector<float> want, want_probs;
  std::vector<float> want_real;  // two rows: row 0's probabilities of the candidates (real_probs)
  std::string name;
};

// The CPU replica's quantized tokens in device blocks of the agent's layout (interleaved by
// group, as replicas with mma codes keep them, with `interleave`), written through the kernels'
// own accessors (on the host images), the blocks in reverse order in memory: the kernels must
// follow the table, not assume one array. Returns the table's host copy.
std::vector<const uint8_t*> UploadBlocks(const HeadReplica& replica, const ReplicaParams& p, cuda::DeviceReplicaView& v,
                                         DeviceBuffers& buf, bool interleave = false) {
  v.layout = cuda::MakeReplicaBlockLayout(p, interleave);
  const int32_t n_qk = replica.quantized_keys(), n_qv = replica.quantized_values(), T = v.layout.block_tokens;
  const int32_t n_blocks = (std::max(n_qk, n_qv) + T - 1) / T;
  if (n_blocks == 0) return {};
  const size_t bytes = static_cast<size_t>(v.layout.bytes);
  std::vector<uint8_t> image(n_blocks * bytes);
  std::vector<const uint8_t*> host(n_blocks);
  for (int32_t b = 0; b < n_blocks; ++b) host[b] = image.data() + (n_blocks - 1 - b) * bytes;
  cuda::DeviceReplicaView hv = v;
  hv.blocks = host.data();
  auto put = [](const void* at, const void* from, size_t n) { std::memcpy(const_cast<void*>(at), from, n); };
  const int d = p.head_dim, G = p.group_size;
  for (int32_t g = 0; g < n_qk / G; ++g) {
    if (p.key_bits == 16) {
      put(cuda::KeyHalf(hv, g * G), replica.KeyGroupHalf(g), size_t(G) * d * sizeof(Half));
    } else {
      put(cuda::KeyCodes(hv, g), replica.KeyGroupCodes(g), size_t(d) * WordsPerGroup(G, p.key_bits) * 4);
      put(cuda::KeyScales(hv, g), replica.KeyGroupScale(g), size_t(d) * sizeof(Half));
      put(cuda::KeyZeros(hv, g), replica.KeyGroupZero(g), size_t(d) * sizeof(Half));
    }
  }
  for (int32_t t = 0; t < n_qv; ++t) {
    if (p.value_bits == 16) {
      put(cuda::ValueHalf(hv, t), replica.ValueHalf(t), size_t(d) * sizeof(Half));
    } else {
      put(cuda::ValueCodes(hv, t), replica.ValueCodes(t), size_t(d / G) * WordsPerGroup(G, p.value_bits) * 4);
      put(cuda::ValueScales(hv, t), replica.ValueScale(t), size_t(d / G) * sizeof(Half));
      put(cuda::ValueZeros(hv, t), replica.ValueZero(t), size_t(d / G) * sizeof(Half));
    }
  }
  const uint8_t* device = buf.Copy(image);
  std::vector<const uint8_t*> table(n_blocks);
  for (int32_t b = 0; b < n_blocks; ++b) table[b] = device + (n_blocks - 1 - b) * bytes;
  v.blocks = buf.Copy(table);
  return table;
}

// Rewrites the whole groups of an uploaded 1-bit replica in the mma layout, as a replica made with
// mma codes keeps them (the lean path then reads them).
void PackWholeGroups(cuda::DeviceReplicaView& v, const std::vector<const uint8_t*>& table, DeviceBuffers& buf) {
  cuda::DeviceReplicaView dv = v;
  dv.blocks = table.data();  // the device addresses, on the host
  float* bound = buf.Zeros<float>(1);
  std::vector<cuda::MmaGroupTask> tasks;
  for (int32_t g = 0; g < std::min(v.quantized_keys, v.quantized_values) / 32; ++g) {
    tasks.push_back({const_cast<uint32_t*>(cuda::KeyCodes(dv, g)), const_cast<Half*>(cuda::KeyScales(dv, g)),
                     const_cast<Half*>(cuda::KeyZeros(dv, g)), const_cast<uint32_t*>(cuda::ValueCodes(dv, g * 32)),
                     const_cast<Half*>(cuda::ValueScales(dv, g * 32)), const_cast<Half*>(cuda::ValueZeros(dv, g * 32)),
                     bound});
  }
  EXPECT_TRUE(cuda::PackMmaGroups(tasks.data(), static_cast<int>(tasks.size()), v.head_dim, nullptr).ok());
  v.mma_codes = 1;
  v.key_scale_bound = bound;
}

// mma: the replica's whole groups in the mma layout (1-bit, at most 8 queries): the lean path.
// sub_one_in: each quantized key is substituted with probability 1 / sub_one_in.
DecodeCase MakeDecodeCase(int d, int bits, int n_rows, int32_t length, int heads, std::mt19937& rng, DeviceBuffers& buf,
                          bool mma = false, int sub_one_in = 3,
                          const std::function<bool(int32_t)>& substituted = nullptr) {
  DecodeCase c;
  c.name = "d=" + std::to_string(d) + " bits=" + std::to_string(bits) + " rows=" + std::to_string(n_rows) +
           " length=" + std::to_string(length) + (mma ? " mma" : "") + " sub 1/" + std::to_string(sub_one_in);
  ReplicaParams p{d, bits, bits, 32, 64};
  HeadReplica replica(p);
  const auto keys = testing::RandomHalves(size_t(length) * d, rng), values = testing::RandomHalves(size_t(length) * d, rng);
  replica.Append(keys.data(), values.data(), length);
  const int32_t n_qk = replica.quantized_keys(), n_qv = replica.quantized_values();
  // Substitute a random share of the quantized keys (a third by default), or those `substituted`
  // picks, with other full-precision rows.
  std::vector<int32_t> sub_tokens;
  for (int32_t t = 0; t < n_qk; ++t) {
    if (substituted ? substituted(t) : rng() % sub_one_in == 0) sub_tokens.push_back(t);
  }
  const auto sub_rows = testing::RandomHalves(sub_tokens.size() * 2 * d, rng);
  const auto q = testing::RandomFloats(size_t(n_rows) * heads * d, rng, 0.5f);
  const auto new_k = testing::RandomHalves(size_t(n_rows) * d, rng), new_v = testing::RandomHalves(size_t(n_rows) * d, rng);
  const int probs_row = n_rows - 1;
  const int32_t n_candidates = n_qk + (n_rows == 2 ? 1 : 0);
  c.want.resize(size_t(n_rows) * heads * d);
  c.want_probs.resize(size_t(heads) * n_candidates);
  if (n_rows == 2) c.want_real.resize(c.want_probs.size());
  cpu::AttentionWorkspace ws;
  cpu::AttendDecodeRows(replica, {sub_tokens.data(), sub_rows.data(), static_cast<int32_t>(sub_tokens.size())},
                        q.data(), new_k.data(), new_v.data(), n_rows, heads, 1.0f / std::sqrt(float(d)), c.want.data(),
                        probs_row, n_candidates, c.want_probs.data(), &ws, n_rows == 2 ? c.want_real.data() : nullptr);

  cuda::DeviceReplicaView& v = c.item.replica;
  v.head_dim = d;
  v.group_size = 32;
  v.key_bits = v.value_bits = bits;
  v.length = length;
  v.quantized_keys = n_qk;
  v.quantized_values = n_qv;
  const std::vector<const uint8_t*> table = UploadBlocks(replica, p, v, buf, mma);
  if (mma) PackWholeGroups(v, table, buf);
  v.residual_keys = buf.Copy(replica.ResidualKeys(), size_t(length - n_qk) * d);
  v.window_values = buf.Copy(replica.WindowValues(), size_t(length - n_qv) * d);
  cuda::DeviceDecodeRows& r = c.item.rows;
  r.sub_tokens = buf.Copy(sub_tokens.data(), sub_tokens.size());
  r.n_sub = static_cast<int32_t>(sub_tokens.size());
  if (rng() % 2) {
    // As the agent hands them over: the rows in a row cache, in another order and among other
    // rows, each found through its slot.
    c.name += " slots";
    const size_t row = 2 * size_t(d), n_cache = sub_tokens.size() + 1 + rng() % 7;
    std::vector<int32_t> order(n_cache);
    for (size_t i = 0; i < n_cache; ++i) order[i] = static_cast<int32_t>(i);
    std::shuffle(order.begin(), order.end(), rng);
    std::vector<int32_t> slots(order.begin(), order.begin() + sub_tokens.size());
    auto cache = testing::RandomHalves(n_cache * row, rng);
    for (size_t i = 0; i < slots.size(); ++i) std::copy_n(&sub_rows[i * row], row, &cache[slots[i] * row]);
    r.sub_rows = buf.Copy(cache.data(), cache.size());
    r.sub_slots = buf.Copy(slots.data(), slots.size());
  } else {
    r.sub_rows = buf.Copy(sub_rows.data(), sub_rows.size());
  }
  r.q = buf.Copy(q.data(), q.size());
  r.new_keys = buf.Copy(new_k.data(), new_k.size());
  r.new_values = buf.Copy(new_v.data(), new_v.size());
  r.n_rows = n_rows;
  r.n_heads = heads;
  r.scale = 1.0f / std::sqrt(float(d));
  r.out = buf.Zeros<float>(c.want.size());
  r.probs_row = probs_row;
  r.n_candidates = n_candidates;
  r.probs = buf.Zeros<float>(c.want_probs.size());
  if (n_rows == 2) {  // row 0's raw scores and statistics from the same pass
    r.real_probs = buf.Zeros<float>(c.want_real.size());
    r.real_probs_stats = buf.Zeros<float>(size_t(heads) * 2);
  }
  r.scratch = buf.Zeros<float>(static_cast<size_t>(cuda::DecodeScratchFloats(length, n_rows, heads, d)));
  return c;
}

// The same query operands (cpu::QueryOperand) and ~22-bit probabilities, float32 sums in another
// order: relative error of the outputs and probabilities <= 1e-5 (measured ~1e-7).
// The lean path (mma codes) rounds its values' operands p * scale to fp16: outputs within 1e-3
// (measured up to 4.5e-4 on these random rows), probabilities as above.
void ExpectMatches(const DecodeCase& c, double output_tolerance = 1e-5) {
  if (c.item.replica.mma_codes) output_tolerance = std::max(output_tolerance, 1e-3);
  const std::vector<float> got = testing::Download(c.item.rows.out, c.want.size()),
                           got_probs = testing::Download(c.item.rows.probs, c.want_probs.size());
  const double output_error = testing::RelativeError(got, std::vector<double>(c.want.begin(), c.want.end()));
  EXPECT_LT(output_error, output_tolerance) << c.name;
  if (output_tolerance > 1e-5) std::printf("%s: outputs' relative error %.3g\n", c.name.c_str(), output_error);
  if (!c.want_probs.empty()) {  // (no quantized token yet: no candidates)
    EXPECT_LT(testing::RelativeError(got_probs, std::vector<double>(c.want_probs.begin(), c.want_probs.end())), 1e-5)
        << "probabilities, " << c.name;
  }
  if (!c.want_real.empty() && c.item.rows.n_candidates > 0) {  // raw scores: p = exp(score - max) / sum
    std::vector<float> real = testing::Download(c.item.rows.real_probs, c.want_real.size());
    const std::vector<float> stats = testing::Download(c.item.rows.real_probs_stats, size_t(c.item.rows.n_heads) * 2);
    for (size_t i = 0; i < real.size(); ++i) {
      const size_t h = i / c.item.rows.n_candidates;
      real[i] = std::exp(real[i] - stats[2 * h]) / stats[2 * h + 1];
    }
    EXPECT_LT(testing::RelativeError(real, std::vector<double>(c.want_real.begin(), c.want_real.end())), 1e-5)
        << "the real row's probabilities, " << c.name;
  }
}
#endif

TEST(CudaAttentionTest, DecodeRowsMatchTheCpuReference) {
  SPECACHE_REQUIRE_CUDA_DEVICE();
#ifdef SPECACHE_TEST_HAVE_CUDA
  std::mt19937 rng(23);
  for (int d : {64, 128}) {
    for (int bits : {1, 2, 4, 16}) {
      for (int n_rows : {1, 2}) {
        for (int32_t length : {40, 700}) {
          for (const bool mma : {false, true}) {
            if (mma && bits != 1) continue;
            DeviceBuffers buf;
            const DecodeCase c = MakeDecodeCase(d, bits, n_rows, length, 4, rng, buf, mma);
            ASSERT_TRUE(cuda::AttendDecodeRows(c.item.replica, c.item.rows, nullptr).ok());
            ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
            ExpectMatches(c);
          }
        }
      }
    }
  }
#endif
}

// Blocks of 32 tokens with more substituted rows than one group of the kernels' sixteen (every
// token, every other), as when the agent attends a row cache of recent rows: the kernels score
// them and add their values sixteen rows at a time.
TEST(CudaAttentionTest, DenselySubstitutedBlocksMatchTheCpuReference) {
  SPECACHE_REQUIRE_CUDA_DEVICE();
#ifdef SPECACHE_TEST_HAVE_CUDA
  std::mt19937 rng(41);
  for (int d : {64, 128}) {
    for (int n_rows : {1, 2}) {
      for (int sub_one_in : {1, 2}) {
        // 1 and 2 bits, GQA 4 and 8 (8 with both rows: the two-query-tile kernels), the lean path
        // where it applies (1 bit, at most 8 queries).
        for (const auto& [bits, heads, mma] : {std::tuple{1, 4, false}, std::tuple{1, 4, true}, std::tuple{2, 4, false},
                                               std::tuple{2, 8, false}}) {
          DeviceBuffers buf;
          const DecodeCase c = MakeDecodeCase(d, bits, n_rows, 700, heads, rng, buf, mma, sub_one_in);
          ASSERT_TRUE(cuda::AttendDecodeRows(c.item.replica, c.item.rows, nullptr).ok());
          ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
          ExpectMatches(c);
        }
      }
    }
  }
#endif
}

// GQA groups of 5 and 8 with both rows: 10 and 16 queries, the tensor-core kernels' two query
// tiles (at head_dim 128 over 48 KB of shared memory per CTA, which the launch must opt into).
TEST(CudaAttentionTest, WideGroupsMatchTheCpuReference) {
  SPECACHE_REQUIRE_CUDA_DEVICE();
#ifdef SPECACHE_TEST_HAVE_CUDA
  std::mt19937 rng(41);
  for (int d : {64, 128}) {
    for (int bits : {1, 2}) {
      for (int group : {5, 8}) {
        for (int32_t length : {40, 700}) {
          DeviceBuffers buf;
          const DecodeCase c = MakeDecodeCase(d, bits, 2, length, group, rng, buf);
          ASSERT_TRUE(cuda::AttendDecodeRows(c.item.replica, c.item.rows, nullptr).ok()) << c.name << " group=" << group;
          ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess) << c.name << " group=" << group;
          ExpectMatches(c);
        }
      }
    }
  }
#endif
}

// A ragged batch (lengths, bits, rows and GQA groups differ per item): 300 items in one call,
// planned in device memory (one launch per class of items, any number of items), and the same
// plan used again for a second call while the first may still run: every item as the reference
// has it, both times.
TEST(CudaAttentionTest, RaggedBatchMatchesTheCpuReference) {
  SPECACHE_REQUIRE_CUDA_DEVICE();
#ifdef SPECACHE_TEST_HAVE_CUDA
  std::mt19937 rng(29);
  cuda::DecodePlan plan;
  for (int d : {64, 128}) {
    DeviceBuffers buf;
    std::vector<DecodeCase> cases;
    std::vector<cuda::DeviceDecodeItem> items;
    const int bit_widths[] = {1, 2, 4, 16};
    for (int i = 0; i < 300; ++i) {
      const int32_t length = 1 + static_cast<int32_t>(rng() % (i % 9 == 0 ? 3000 : 400));
      // Every other 1-bit item in the mma layout (the lean path's classes beside the others).
      cases.push_back(MakeDecodeCase(d, bit_widths[i % 4], 1 + i % 2, length, 1 + i % 4, rng, buf, i % 8 == 4));
      items.push_back(cases.back().item);
    }
    for (int i = 0; i < 24; ++i) {  // 1-bit items in the mma layout of 1..8 queries
      const int32_t length = 1 + static_cast<int32_t>(rng() % 3000);
      cases.push_back(MakeDecodeCase(d, 1, 1 + i % 2, length, 1 + (i / 2) % 4, rng, buf, true));
      items.push_back(cases.back().item);
    }
    ASSERT_TRUE(cuda::AttendDecodeBatch(items.data(), static_cast<int>(items.size()), nullptr, &plan).ok());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    for (const DecodeCase& c : cases) ExpectMatches(c);
    for (const DecodeCase& c : cases) {
      ASSERT_EQ(cudaMemset(c.item.rows.out, 0, c.want.size() * sizeof(float)), cudaSuccess);
    }
    ASSERT_TRUE(cuda::AttendDecodeBatch(items.data(), static_cast<int>(items.size()), nullptr, &plan).ok());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    for (const DecodeCase& c : cases) ExpectMatches(c);
  }
#endif
}

// The two orders of the tensor-core attention's warps (lowbit_decode.h): the tail units sharing
// the wave with the bulk units, or first, the bulk units then filling the wave. The planner puts
// the tails first for two long items on a one-CTA wave (every other slot left free) and not on
// the whole GPU; both orders give the reference's outputs and probabilities.
TEST(CudaAttentionTest, TailsFirstOrderMatchesTheCpuReference) {
  SPECACHE_REQUIRE_CUDA_DEVICE();
#ifdef SPECACHE_TEST_HAVE_CUDA
  std::mt19937 rng(37);
  for (int d : {64, 128}) {
    for (int bits : {1, 2}) {
      DeviceBuffers buf;
      std::vector<DecodeCase> cases;
      std::vector<cuda::DeviceDecodeItem> items;
      for (int i = 0; i < 2; ++i) {  // ~90 blocks each: one-CTA wave, bulk units of ~45 after the tails
        cases.push_back(MakeDecodeCase(d, bits, 2, 2900 + 37 * i, 4, rng, buf));
        items.push_back(cases.back().item);
      }
      // A short item (tail units only), so that the tails need not fill whole CTAs: the bulk
      // units then start at the next CTA, after padding warps that do nothing.
      cases.push_back(MakeDecodeCase(d, bits, 2, 50, 4, rng, buf));
      items.push_back(cases.back().item);
      for (const int free_slots : {0, 1 << 20}) {
        std::vector<cuda::LowBitSet> sets;
        ASSERT_TRUE(cuda::PlanLowBitDecode(items, {.free_slots = free_slots}, &sets).ok());
        ASSERT_EQ(sets.size(), 1u);
        EXPECT_EQ(sets[0].tail_order, free_slots != 0 ? cuda::kTailsFirst : cuda::kTailsShared)
            << "d=" << d << " bits=" << bits;
        cuda::DecodePlan plan;
        plan.set_free_slots(free_slots);
        for (const DecodeCase& c : cases) {
          ASSERT_EQ(cudaMemset(c.item.rows.out, 0, c.want.size() * sizeof(float)), cudaSuccess);
        }
        ASSERT_TRUE(cuda::AttendDecodeBatch(items.data(), static_cast<int>(items.size()), nullptr, &plan).ok());
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        SCOPED_TRACE(free_slots ? "tails first" : "tails in the wave");
        // A unit of ~45 blocks sums its outputs in another order than the CPU: 2-bit outputs
        // measured 1.5e-5 (the probabilities stay within 1e-5).
        for (const DecodeCase& c : cases) ExpectMatches(c, free_slots ? 3e-5 : 1e-5);
      }
    }
  }
#endif
}

// The lean path attends a unit's substituted rows after its blocks, up to 32 at a time (a block
// only masks their tokens out of its softmax): patterns random densities rarely make, under
// forced splits of 2, 3 and 16 blocks a unit. Whole blocks substituted at a unit's start and in its
// middle; exactly 32 and 64 rows ending at a unit's end (full windows); 40 rows across a unit
// boundary; rows in the tail only (none in the bulk); dense rows (several chunks a unit). Outputs
// and probabilities are NaN-filled first, so a score left unwritten fails.
TEST(CudaAttentionTest, PatternedSubstitutionsOnTheLeanPathMatchTheCpuReference) {
  SPECACHE_REQUIRE_CUDA_DEVICE();
#ifdef SPECACHE_TEST_HAVE_CUDA
  std::mt19937 rng(43);
  const int32_t length = 1100;
  const std::pair<const char*, std::function<bool(int32_t)>> patterns[] = {
      {"whole first and middle blocks", [](int32_t t) { return t < 32 || (t >= 128 && t < 160) || t % 7 == 0; }},
      {"full windows ending at a unit's end", [](int32_t t) { return (t >= 64 && t < 128) || (t >= 256 && t < 288); }},
      {"40 rows across a unit boundary", [](int32_t t) { return t >= 20 && t < 60; }},
      {"tail only", [](int32_t t) { return t >= 1024; }},
      {"dense", [](int32_t t) { return t % 3 != 0; }},
  };
  using Order = cuda::DecodePlan::UnitOrder;
  for (const int d : {64, 128}) {
    for (const int n_rows : {1, 2}) {
      for (const auto& [name, pattern] : patterns) {
        DeviceBuffers buf;
        const DecodeCase c = MakeDecodeCase(d, 1, n_rows, length, 4, rng, buf, true, 3, pattern);
        ASSERT_TRUE(cuda::LowBitDecodeEligible(c.item, cuda::LowBitDecodeAvailable())) << c.name;
        // The bulk (blocks whose keys and values are both quantized) ends at token 1024: the
        // tail-only pattern's rows lie past it, in the tail units' tokens.
        const cuda::DeviceReplicaView& v = c.item.replica;
        ASSERT_EQ(std::min(v.quantized_keys, v.quantized_values) / 32 * 32, 1024) << c.name;
        ASSERT_GT(v.quantized_keys, 1024) << c.name;
        for (const int chunk : {2, 3, 16}) {
          cuda::DecodePlan plan;
          plan.force_units(chunk, Order::kChosen);
          ASSERT_EQ(cudaMemset(c.item.rows.out, 0xff, c.want.size() * sizeof(float)), cudaSuccess);
          ASSERT_EQ(cudaMemset(c.item.rows.probs, 0xff, c.want_probs.size() * sizeof(float)), cudaSuccess);
          if (c.item.rows.real_probs) {
            ASSERT_EQ(cudaMemset(c.item.rows.real_probs, 0xff, c.want_real.size() * sizeof(float)), cudaSuccess);
          }
          ASSERT_TRUE(cuda::AttendDecodeBatch(&c.item, 1, nullptr, &plan).ok());
          ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
          SCOPED_TRACE(std::string(name) + ", chunk " + std::to_string(chunk));
          ExpectMatches(c, 3e-5);
        }
      }
    }
  }
#endif
}

#ifdef SPECACHE_TEST_HAVE_CUDA
// NaN everywhere the kernels write the cases' results (outputs, probabilities): nothing stale passes.
void FillOutputsWithNaN(const std::vector<DecodeCase>& cases) {
  for (const DecodeCase& c : cases) {
    ASSERT_EQ(cudaMemset(c.item.rows.out, 0xff, c.want.size() * sizeof(float)), cudaSuccess);
    if (!c.want_probs.empty()) {
      ASSERT_EQ(cudaMemset(c.item.rows.probs, 0xff, c.want_probs.size() * sizeof(float)), cudaSuccess);
    }
  }
}
#endif

// Every forced split and order of the tensor-core attention (DecodePlan::force_units), on the
// lean path's items (mma layout, 1-bit) and the natural layout's, ragged lengths with short items
// of tail units only: the reference's outputs and probabilities whichever warp runs which unit.
TEST(CudaAttentionTest, EveryForcedUnitOrderMatchesTheCpuReference) {
  SPECACHE_REQUIRE_CUDA_DEVICE();
#ifdef SPECACHE_TEST_HAVE_CUDA
  std::mt19937 rng(41);
  for (const bool mma : {true, false}) {
    DeviceBuffers buf;
    std::vector<DecodeCase> cases;
    std::vector<cuda::DeviceDecodeItem> items;
    for (int i = 0; i < 21; ++i) {
      const int32_t length = i % 7 == 3 ? 20 + i : 200 + static_cast<int32_t>(rng() % 2600);
      cases.push_back(MakeDecodeCase(i % 2 ? 64 : 128, 1, 2, length, 4, rng, buf, mma));
      items.push_back(cases.back().item);
    }
    ASSERT_TRUE(std::all_of(items.begin(), items.end(), [](const cuda::DeviceDecodeItem& it) {
      return cuda::LowBitDecodeEligible(it, cuda::LowBitDecodeAvailable());
    })) << "every item on the tensor-core path";
    using Order = cuda::DecodePlan::UnitOrder;
    for (const int chunk : {2, 16, 0}) {
      std::vector<std::vector<float>> first_outputs;  // the shared order's, per case
      for (const Order order : {Order::kTailsShared, Order::kTailsFirst, Order::kTailsLast}) {
        cuda::DecodePlan plan;
        plan.force_units(chunk, order);
        ASSERT_NO_FATAL_FAILURE(FillOutputsWithNaN(cases));
        ASSERT_TRUE(cuda::AttendDecodeBatch(items.data(), static_cast<int>(items.size()), nullptr, &plan).ok());
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        SCOPED_TRACE(std::string(mma ? "lean" : "natural") + " order " + std::to_string(static_cast<int>(order)) +
                     " chunk " + std::to_string(chunk));
        for (size_t i = 0; i < cases.size(); ++i) {
          const DecodeCase& c = cases[i];
          ExpectMatches(c, 3e-5);
          // The merge sums an item's units in unit order, whichever warp ran which: bit-equal.
          const std::vector<float> out = testing::Download(c.item.rows.out, c.want.size());
          if (order == Order::kTailsShared) {
            first_outputs.push_back(out);
          } else {
            EXPECT_EQ(std::memcmp(out.data(), first_outputs[i].data(), out.size() * sizeof(float)), 0) << c.name;
          }
        }
      }
    }
  }
#endif
}

// The lean path's two L2 policies (DecodePlan::force_codes_l2: the code groups' copies and the
// score stores with or without their L2 cache hints) over ragged items: each matches the CPU
// reference, and the two give the same outputs and scores bit for bit (a hint moves no value).
TEST(CudaAttentionTest, BothL2PoliciesOfTheLeanPathGiveTheSameResults) {
  SPECACHE_REQUIRE_CUDA_DEVICE();
#ifdef SPECACHE_TEST_HAVE_CUDA
  std::mt19937 rng(43);
  DeviceBuffers buf;
  std::vector<DecodeCase> cases;
  std::vector<cuda::DeviceDecodeItem> items;
  for (int i = 0; i < 24; ++i) {
    const int32_t length = i % 5 == 2 ? 33 + i : 300 + static_cast<int32_t>(rng() % 3000);
    cases.push_back(MakeDecodeCase(i % 3 ? 128 : 64, 1, 2, length, 4, rng, buf, /*mma=*/true));
    items.push_back(cases.back().item);
  }
  ASSERT_TRUE(std::all_of(items.begin(), items.end(), [](const cuda::DeviceDecodeItem& it) {
    return cuda::LowBitDecodeEligible(it, cuda::LowBitDecodeAvailable());
  })) << "every item on the lean path";
  using L2 = cuda::DecodePlan::CodesL2;
  std::vector<std::vector<float>> normal_out, normal_probs;  // per case
  for (const L2 policy : {L2::kNormal, L2::kEvictFirst}) {
    cuda::DecodePlan plan;
    plan.force_codes_l2(policy);
    ASSERT_NO_FATAL_FAILURE(FillOutputsWithNaN(cases));
    ASSERT_TRUE(cuda::AttendDecodeBatch(items.data(), static_cast<int>(items.size()), nullptr, &plan).ok());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    SCOPED_TRACE(policy == L2::kNormal ? "normal" : "evict-first");
    for (size_t i = 0; i < cases.size(); ++i) {
      const DecodeCase& c = cases[i];
      ExpectMatches(c, 3e-5);
      const std::vector<float> out = testing::Download(c.item.rows.out, c.want.size());
      const std::vector<float> probs =
          c.want_probs.empty() ? std::vector<float>{} : testing::Download(c.item.rows.probs, c.want_probs.size());
      if (policy == L2::kNormal) {
        normal_out.push_back(out);
        normal_probs.push_back(probs);
      } else {
        EXPECT_EQ(std::memcmp(out.data(), normal_out[i].data(), out.size() * sizeof(float)), 0) << c.name;
        EXPECT_EQ(std::memcmp(probs.data(), normal_probs[i].data(), probs.size() * sizeof(float)), 0) << c.name;
      }
    }
  }
#endif
}

// The decode attention captured in a CUDA graph (relaxed capture: the plan may allocate) and
// replayed, after the plan's ring was reused by other calls: the replay gives the same outputs,
// bit for bit, as the direct call. A call without a plan is refused on the capturing stream.
TEST(CudaAttentionTest, ACapturedGraphReplaysTheSameAttention) {
  SPECACHE_REQUIRE_CUDA_DEVICE();
#ifdef SPECACHE_TEST_HAVE_CUDA
  std::mt19937 rng(31);
  DeviceBuffers buf;
  std::vector<DecodeCase> cases;
  std::vector<cuda::DeviceDecodeItem> items;
  for (int i = 0; i < 40; ++i) {
    cases.push_back(MakeDecodeCase(128, 1 + i % 2, 2, 300 + 97 * i, 4, rng, buf));
    items.push_back(cases.back().item);
  }
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  cuda::DecodePlan plan;
  ASSERT_TRUE(cuda::AttendDecodeBatch(items.data(), static_cast<int>(items.size()), stream, &plan).ok());
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  std::vector<std::vector<float>> direct;
  for (const DecodeCase& c : cases) direct.push_back(testing::Download(c.item.rows.out, c.want.size()));

  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeRelaxed), cudaSuccess);
  const Status captured = cuda::AttendDecodeBatch(items.data(), static_cast<int>(items.size()), stream, &plan);
  // Without a plan the call's own would free its slot on return, while the graph still reads it.
  const Status planless = cuda::AttendDecodeBatch(items.data(), static_cast<int>(items.size()), stream);
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  ASSERT_TRUE(captured.ok()) << captured.ToString();
  EXPECT_EQ(planless.code(), StatusCode::kInvalidArgument) << planless.ToString();
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  // Other calls go through the ring meanwhile (with other items): the graph's plan stays its own.
  std::vector<cuda::DeviceDecodeItem> others(items.rbegin(), items.rend() - 10);
  for (int i = 0; i < 40; ++i) {
    ASSERT_TRUE(cuda::AttendDecodeBatch(others.data(), static_cast<int>(others.size()), stream, &plan).ok());
  }
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  for (const DecodeCase& c : cases) ASSERT_EQ(cudaMemset(c.item.rows.out, 0, c.want.size() * sizeof(float)), cudaSuccess);
  // cudaMemset is asynchronous, on the legacy stream, which `stream` (non-blocking) does not wait for.
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  for (size_t i = 0; i < cases.size(); ++i) {
    EXPECT_EQ(testing::Download(cases[i].item.rows.out, cases[i].want.size()), direct[i]) << cases[i].name;
    ExpectMatches(cases[i]);
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
#endif
}

}  // namespace
}  // namespace specache

namespace specache {
namespace {

TEST(CudaAttentionTest, PrefillMatchesTheCpuReference) {
  SPECACHE_REQUIRE_CUDA_DEVICE();
#ifdef SPECACHE_TEST_HAVE_CUDA
  std::mt19937 rng(37);
  // The tensor-core kernel at head_dim 64 and 128 (sm_80+), the CUDA-core one at 96; GQA groups
  // of 4 (Llama-3-8B) and 3 (SmolLM2: rows that do not tile a CTA's 64 evenly); one KV head and
  // several in one call (the model's interleaved query rows).
  struct Shape {
    int d, group, n_kv;
  };
  const Shape shapes[] = {{64, 4, 1}, {128, 4, 2}, {64, 3, 3}, {128, 3, 1}, {96, 4, 2}};
  for (const auto& [d, group, n_kv] : shapes) {
    for (int32_t n : {1, 37, 300, 1100}) {
      const size_t q_row = size_t(n_kv) * group * d, head_rows = size_t(n) * d;
      const auto q = testing::RandomFloats(size_t(n) * q_row, rng, 0.5f);  // [n][n_kv][group][d]
      const auto k = testing::RandomHalves(n_kv * head_rows, rng);         // [n_kv][n][d]
      const auto v = testing::RandomHalves(n_kv * head_rows, rng);
      // Each KV head on the CPU: its group's queries gathered to [n][group][d], the result scattered.
      std::vector<float> want(q.size());
      for (int h = 0; h < n_kv; ++h) {
        std::vector<float> qh(size_t(n) * group * d), oh(qh.size());
        for (int32_t i = 0; i < n; ++i) {
          std::copy_n(q.begin() + i * q_row + size_t(h) * group * d, size_t(group) * d, qh.begin() + size_t(i) * group * d);
        }
        cpu::AttentionWorkspace ws;
        cpu::AttendPrefill(qh.data(), k.data() + h * head_rows, v.data() + h * head_rows, n, group, d,
                           1.0f / std::sqrt(float(d)), oh.data(), &ws);
        for (int32_t i = 0; i < n; ++i) {
          std::copy_n(oh.begin() + size_t(i) * group * d, size_t(group) * d, want.begin() + i * q_row + size_t(h) * group * d);
        }
      }
      DeviceBuffers buf;
      float* out = buf.Zeros<float>(want.size());
      float* scratch = buf.Zeros<float>(static_cast<size_t>(cuda::PrefillScratchFloats(n, group)));
      ASSERT_TRUE(cuda::AttendPrefill(buf.Copy(q.data(), q.size()), buf.Copy(k.data(), k.size()),
                                      buf.Copy(v.data(), v.size()), n, n_kv, group, d, 1.0f / std::sqrt(float(d)), out,
                                      scratch, nullptr)
                      .ok());
      const std::vector<float> got = testing::Download(out, want.size());
      // The tensor-core kernel rounds the probabilities to fp16 (~1.3e-4-1.7e-4 measured on an
      // H200, below the fp16 rounding of the model's next GEMM input); the CUDA-core one is fp32.
      const double tolerance = d == 64 || d == 128 ? 5e-4 : 1e-5;
      EXPECT_LT(testing::RelativeError(got, std::vector<double>(want.begin(), want.end())), tolerance)
          << "d=" << d << " group=" << group << " n_kv=" << n_kv << " n=" << n;
    }
  }
#endif
}

}  // namespace
}  // namespace specache
