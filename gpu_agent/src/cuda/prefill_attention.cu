// Causal prefill attention on the tensor cores (flash-attention style): the semantics of
// cpu::AttendPrefill for each KV head, to ~2e-4 relative (the probabilities' fp16 rounding; the
// model rounds the output to fp16 for its next GEMM anyway).
//
// Every KV head of the prompt in one launch: a CTA serves one KV head h. Its rows are (token, head)
// pairs of h's GQA group, r = token * n_heads + head (query head h * n_heads + head of the model's
// rows), so a CTA's 64 rows are 64 / n_heads consecutive tokens of every head of the group, and
// they share each tile of keys and values. A CTA walks the key tiles (32 tokens) up to its last
// row's token, with an online softmax per row; rows whose token is below a key are masked. Per
// warp (16 rows), with mma.m16n8k16:
//   S = Q K^T: A = the scaled query as fp16 hi + lo parts (~22 bits: the scores stay exact to
//              ~1e-6, which the softmax's exponent would amplify), B = the keys (fp16, exact);
//   O += P V:  A = the probabilities times 2^14 in fp16, as flash-attention keeps them, straight
//              from S's C registers (a C fragment of two 8-key n-tiles is the A fragment of one
//              16-key k-step), B = the values (ldmatrix.trans of the row-major tile); each tile's
//              products go through fresh accumulators added in fp32 (the tensor cores truncate
//              as they add). P's lo part as well halves the error at 1.2x the attention's time.
// The next tile's keys and values land by cp.async while a tile is computed on (two stages).
// Register layouts of mma.m16n8k16 (g = lane / 4, t = lane % 4): mma_fp16.cuh.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

#include "cp_async.cuh"
#include "mma_fp16.cuh"
#include "prefill_attention.h"
#include "shared_memory_opt_in.cuh"

namespace specache::cuda {
namespace {

constexpr int kWarps = 4;
constexpr int kRows = 16 * kWarps;  // (token, head) rows per CTA
constexpr int kKeys = 32;           // keys per tile
constexpr int kKeyTiles = kKeys / 8;  // S's n-tiles per tile
constexpr int kKeySteps = kKeys / 16; // P V's k-steps per tile
constexpr float kPScale = 16384.0f;  // p in [0, 1] scaled into fp16's normal range
constexpr unsigned kAll = 0xffffffffu;

// Shared memory of one CTA, in 32-bit words: the warps' query operands [warp][k-step][hi, lo]
// [lane][4], then two stages (the tile computed on and the next, landing by cp.async) of the key
// and value tiles, each [kKeys][D + 8 halves] row-major (the pad puts the 8 rows of an ldmatrix
// in distinct banks).
template <int D>
struct Layout {
  static constexpr int kRowHalves = D + 8;             // halves per key or value row
  static constexpr int kQueryWords = kWarps * (D / 16) * 32 * 8;
  static constexpr int kTileWords = kKeys * kRowHalves / 2;  // one key or value tile
  static constexpr int kWords = kQueryWords + 2 * 2 * kTileWords;
};

using mma::LdMatrixX4;
using mma::Mma;
using mma::Split;

// Stage `stage`'s key (kv = 0) or value (kv = 1) tile.
template <int D>
__device__ __forceinline__ __half* Tile(uint32_t* smem, int stage, int kv) {
  return reinterpret_cast<__half*>(smem + Layout<D>::kQueryWords + (2 * stage + kv) * Layout<D>::kTileWords);
}

// Starts copying keys and values [k0, k0 + kKeys) into `stage` (zeros past n), as one cp.async group.
template <int D>
__device__ __forceinline__ void LoadTile(uint32_t* smem, int stage, const __half* keys, const __half* values, int32_t k0,
                                         int32_t n) {
  __half* key_tile = Tile<D>(smem, stage, 0);
  __half* value_tile = Tile<D>(smem, stage, 1);
#pragma unroll
  for (int piece = threadIdx.x; piece < kKeys * D / 8; piece += kWarps * 32) {
    const int j = piece / (D / 8), c = piece % (D / 8) * 8;
    const bool inside = k0 + j < n;
    const int64_t at = static_cast<int64_t>(inside ? k0 + j : 0) * D + c;
    CpAsync16OrZeros(key_tile + j * Layout<D>::kRowHalves + c, keys + at, inside);
    CpAsync16OrZeros(value_tile + j * Layout<D>::kRowHalves + c, values + at, inside);
  }
  CpAsyncCommit();
}

// Three CTAs per SM on sm_90 (168 registers, 12 bytes of spills at D = 128; 3 x 68 KB of shared
// memory): at two, ncu found 2 warps per scheduler stalled on fixed-latency dependencies. H200,
// one layer at 8 x 8K (specache-bench prefill): 158 -> 181 TFLOPS; 64-key tiles at two CTAs: 168.
// sm_80's 164 KB of shared memory per SM hold two, so the register cap would only add spills.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
constexpr int kPrefillCtasPerSm = 2;
#else
constexpr int kPrefillCtasPerSm = 3;
#endif
template <int D>
__global__ void __launch_bounds__(kWarps * 32, kPrefillCtasPerSm) TensorPrefillKernel(const float* q, const __half* keys,
                                                                   const __half* values, int32_t n, int n_kv,
                                                                   int n_heads, float scale, float* out) {
  using L = Layout<D>;
  constexpr int KS = D / 16;  // k-steps of S
  constexpr int NT = D / 8;   // n-tiles of O
  extern __shared__ __align__(16) uint32_t smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  uint32_t* q_ops = smem + warp * KS * 32 * 8;  // this warp's [ks][hi, lo][lane][4]
  const int64_t rows = int64_t{n} * n_heads;  // of this KV head
  // The last rows have the most keys: their CTAs start first (blocks in reverse), every KV head's
  // in turn.
  const int64_t ctas = (rows + kRows - 1) / kRows;
  const int h = static_cast<int>(blockIdx.x % n_kv);
  const int64_t r0 = (ctas - 1 - blockIdx.x / n_kv) * kRows;
  keys += int64_t{h} * n * D;
  values += int64_t{h} * n * D;
  const int64_t wr = r0 + 16 * warp;  // this warp's first row
  // This lane's two rows (g, g + 8), their tokens (a padding row takes the last token: its query
  // is 0 and its output is not written).
  const int64_t row[2] = {wr + g, wr + g + 8};
  int32_t token[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) token[i] = static_cast<int32_t>((row[i] < rows ? row[i] : rows - 1) / n_heads);
  // The rows' places in q and out: query head h * n_heads + head of token's [n_kv * n_heads] rows.
  int64_t at[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) at[i] = ((int64_t{token[i]} * n_kv + h) * n_heads + (row[i] - int64_t{token[i]} * n_heads)) * D;

  // The query operands, scaled, as hi + lo parts: a0 (row g, channels 16 ks + 2t, +1), a1 (row
  // g + 8, same), a2 (row g, + 8), a3 (row g + 8, + 8).
#pragma unroll
  for (int ks = 0; ks < KS; ++ks) {
    uint32_t hi[4], lo[4];
#pragma unroll
    for (int part = 0; part < 4; ++part) {
      const int i = part & 1, c = 16 * ks + 2 * t + 8 * (part >> 1);
      float2 x = make_float2(0.0f, 0.0f);
      if (row[i] < rows) x = *reinterpret_cast<const float2*>(q + at[i] + c);
      Split(x.x * scale, x.y * scale, hi[part], lo[part]);
    }
    *reinterpret_cast<uint4*>(q_ops + ((2 * ks) * 32 + lane) * 4) = make_uint4(hi[0], hi[1], hi[2], hi[3]);
    *reinterpret_cast<uint4*>(q_ops + ((2 * ks + 1) * 32 + lane) * 4) = make_uint4(lo[0], lo[1], lo[2], lo[3]);
  }

  float o[NT][4];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.0f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};

  const int64_t last_row = (r0 + kRows < rows ? r0 + kRows : rows) - 1;
  const int32_t tiles = static_cast<int32_t>(last_row / n_heads) / kKeys + 1;
  LoadTile<D>(smem, 0, keys, values, 0, n);
  // ldmatrix rows of this lane: matrix lane / 8, row lane % 8.
  const int mat = lane >> 3, mrow = lane & 7;
  for (int32_t tile = 0; tile < tiles; ++tile) {
    const int32_t k0 = tile * kKeys;
    CpAsyncWaitAll();
    __syncthreads();  // the tile landed for every thread, and the other stage is no longer read
    if (tile + 1 < tiles) LoadTile<D>(smem, (tile + 1) & 1, keys, values, k0 + kKeys, n);
    const __half* key_tile = Tile<D>(smem, tile & 1, 0);
    const __half* value_tile = Tile<D>(smem, tile & 1, 1);

    // ---- S = Q K^T for the tile's keys: s[nt] is C of keys 8 nt + .. (rows g, g + 8), one chain
    // of 2 KS mma (the lo part first): the tensor cores' truncation costs up to ~2e-6, far below
    // P's fp16 rounding.
    float s[kKeyTiles][4];
#pragma unroll
    for (int nt = 0; nt < kKeyTiles; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
      const uint4 ah = *reinterpret_cast<const uint4*>(q_ops + ((2 * ks) * 32 + lane) * 4);
      const uint4 al = *reinterpret_cast<const uint4*>(q_ops + ((2 * ks + 1) * 32 + lane) * 4);
#pragma unroll
      for (int np = 0; np < kKeyTiles / 2; ++np) {
        // B of n-tiles 2 np and 2 np + 1: b0 = (channels 16 ks + 2t, +1; key 8 nt + g), b1 =
        // channels + 8. Matrices: (n-tile 2 np + mat / 2, channels 16 ks + 8 (mat % 2)).
        uint32_t b[4];
        LdMatrixX4(b, key_tile + (8 * (2 * np + (mat >> 1)) + mrow) * L::kRowHalves + 16 * ks + 8 * (mat & 1));
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          Mma(s[2 * np + h], al.x, al.y, al.z, al.w, b[2 * h], b[2 * h + 1]);
          Mma(s[2 * np + h], ah.x, ah.y, ah.z, ah.w, b[2 * h], b[2 * h + 1]);
        }
      }
    }
    // Causal mask: key k0 + 8 nt + 2t + (e & 1) against row (e >> 1)'s token (keys past n are
    // past every token); only tiles that reach past a row's token have any.
    if (k0 + kKeys - 1 > min(token[0], token[1])) {
#pragma unroll
      for (int nt = 0; nt < kKeyTiles; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          if (k0 + 8 * nt + 2 * t + (e & 1) > token[e >> 1]) s[nt][e] = -INFINITY;
        }
    }
    // ---- Online softmax per row: the tile's max over the quad, the rescaling of what came before.
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      float mx = -INFINITY;
#pragma unroll
      for (int nt = 0; nt < kKeyTiles; ++nt) mx = fmaxf(mx, fmaxf(s[nt][2 * i], s[nt][2 * i + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(kAll, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(kAll, mx, 2));
      const float mn = fmaxf(m[i], mx);
      const float alpha = mn == -INFINITY || m[i] == mn ? 1.0f : __expf(m[i] - mn);
      m[i] = mn;
      l[i] *= alpha;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) o[nt][2 * i] *= alpha, o[nt][2 * i + 1] *= alpha;
#pragma unroll
      for (int nt = 0; nt < kKeyTiles; ++nt)
#pragma unroll
        for (int e = 2 * i; e < 2 * i + 2; ++e) {
          const float p = mn == -INFINITY ? 0.0f : __expf(s[nt][e] - mn);
          l[i] += p;
          s[nt][e] = p * kPScale;
        }
    }
    // ---- O += P V. P's A operand of k-step ks2 (keys 16 ks2 ..): S's n-tiles 2 ks2 and 2 ks2 + 1.
    uint32_t ph[kKeySteps][4];
#pragma unroll
    for (int ks2 = 0; ks2 < kKeySteps; ++ks2) {
      ph[ks2][0] = mma::AsU32(__floats2half2_rn(s[2 * ks2][0], s[2 * ks2][1]));
      ph[ks2][1] = mma::AsU32(__floats2half2_rn(s[2 * ks2][2], s[2 * ks2][3]));
      ph[ks2][2] = mma::AsU32(__floats2half2_rn(s[2 * ks2 + 1][0], s[2 * ks2 + 1][1]));
      ph[ks2][3] = mma::AsU32(__floats2half2_rn(s[2 * ks2 + 1][2], s[2 * ks2 + 1][3]));
    }
#pragma unroll
    for (int cp = 0; cp < NT / 2; ++cp) {
      float fresh[2][4] = {};
#pragma unroll
      for (int ks2 = 0; ks2 < kKeySteps; ++ks2) {
        // B of n-tiles 2 cp and 2 cp + 1: b0 = (keys 16 ks2 + 2t, +1; channel 8 nt + g), b1 = keys
        // + 8, transposed out of the row-major values. Matrices: (keys 16 ks2 + 8 (mat % 2),
        // channels 8 (2 cp + mat / 2)).
        uint32_t b[4];
        LdMatrixX4<true>(b, value_tile + (16 * ks2 + 8 * (mat & 1) + mrow) * L::kRowHalves + 8 * (2 * cp + (mat >> 1)));
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          Mma(fresh[h], ph[ks2][0], ph[ks2][1], ph[ks2][2], ph[ks2][3], b[2 * h], b[2 * h + 1]);
        }
      }
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[2 * cp + h][e] += fresh[h][e] * (1.0f / kPScale);
    }
  }
  // ---- The rows' sums over the quad, then out = O / l.
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    l[i] += __shfl_xor_sync(kAll, l[i], 1);
    l[i] += __shfl_xor_sync(kAll, l[i], 2);
    if (row[i] >= rows) continue;
    const float inv = 1.0f / l[i];
    float* dst = out + at[i];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      *reinterpret_cast<float2*>(dst + 8 * nt + 2 * t) = make_float2(o[nt][2 * i] * inv, o[nt][2 * i + 1] * inv);
    }
  }
}

// Whether the current device has mma.m16n8k16 with fp16 operands (sm_80+).
bool HasMma() {
  int device = 0, major = 0;
  return cudaGetDevice(&device) == cudaSuccess &&
         cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess && major >= 8;
}

template <int D>
cudaError_t Launch(const float* q, const Half* keys, const Half* values, int32_t n, int n_kv, int n_heads, float scale,
                   float* out, cudaStream_t stream) {
  constexpr size_t kBytes = size_t{Layout<D>::kWords} * sizeof(uint32_t);  // over 48 KiB at D = 128
  static std::atomic<bool> allowed[kMaxOptInDevices] = {};
  if (const cudaError_t err = AllowDynamicSharedMemory(TensorPrefillKernel<D>, kBytes, allowed); err != cudaSuccess) {
    return err;
  }
  const int64_t ctas = (int64_t{n} * n_heads + kRows - 1) / kRows;
  TensorPrefillKernel<D><<<static_cast<unsigned>(ctas * n_kv), kWarps * 32, kBytes, stream>>>(
      q, reinterpret_cast<const __half*>(keys), reinterpret_cast<const __half*>(values), n, n_kv, n_heads, scale, out);
  return cudaGetLastError();
}

}  // namespace

bool TensorPrefillServes(const float* q, const Half* keys, const Half* values, const float* out, int head_dim) {
  const auto misaligned = [](const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes != 0; };
  if (misaligned(keys, 16) || misaligned(values, 16) || misaligned(q, 8) || misaligned(out, 8)) return false;
  return (head_dim == 64 || head_dim == 128) && HasMma();
}

cudaError_t LaunchTensorPrefill(const float* q, const Half* keys, const Half* values, int32_t n, int n_kv, int n_heads,
                                int head_dim, float scale, float* out, cudaStream_t stream) {
  if ((int64_t{n} * n_heads + kRows - 1) / kRows * n_kv > 0x7fffffff) return cudaErrorInvalidValue;
  return head_dim == 64 ? Launch<64>(q, keys, values, n, n_kv, n_heads, scale, out, stream)
                        : Launch<128>(q, keys, values, n, n_kv, n_heads, scale, out, stream);
}

}  // namespace specache::cuda
