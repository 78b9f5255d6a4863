// The tiled CUDA kernels for the SiameseNorm fused ops (interface: tiled_kernels.h; the
// math: megatron_siamese/reference/functional.py; the plan: launch_plan.h).
//
// A row is held by a group of G threads (blockDim.x, a multiple of 32), each with CH chunks
// of VEC elements per stream in registers (16-byte accesses); a CTA holds blockDim.y rows
// and a persistent grid strides over the row tiles, so a kernel keeps several rows in flight
// per SM instead of one (the verified kernels' one row per block was latency-bound).
//
// Reductions over a row: warp shuffles, then, when a row spans several warps, one exchange
// through shared memory read in warp order; exchanges alternate between two buffers, so each
// costs one barrier. LayerNorm statistics are each warp's own two-pass moments merged across
// warps by Chan's formula, so x and y share one exchange and the input norm takes a second.
//
// Backward: per-thread accumulators for the weights that exist (registers; in shared memory
// for rows too wide for them), one partial per row group, and a finalize that sums the
// partials of each column in a fixed order: deterministic. dual_residual: 16-byte accesses,
// the bias gradient as per-strip partials summed by the same finalize.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <map>
#include <mutex>
#include <stdexcept>
#include <tuple>
#include <string>
#include <utility>

#include "tiled_kernels.h"

namespace megatron_siamese {
namespace tiled {
namespace {

constexpr int kWarp = plan::kWarp;
using plan::kBackwardSharedPerWarp;
using plan::kForwardSharedPerWarp;

template <typename T>
struct Convert;
template <>
struct Convert<float> {
  static __device__ __forceinline__ float in(float v) { return v; }
  static __device__ __forceinline__ float out(float v) { return v; }
};
template <>
struct Convert<__nv_bfloat16> {
  static __device__ __forceinline__ float in(__nv_bfloat16 v) { return __bfloat162float(v); }
  static __device__ __forceinline__ __nv_bfloat16 out(float v) { return __float2bfloat16_rn(v); }
};
template <>
struct Convert<__half> {
  static __device__ __forceinline__ float in(__half v) { return __half2float(v); }
  static __device__ __forceinline__ __half out(float v) { return __float2half_rn(v); }
};

template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Pack {
  T v[VEC];
};

template <typename T, int VEC>
__device__ __forceinline__ void load(const T* p, float (&out)[VEC]) {
  const Pack<T, VEC> pack = *reinterpret_cast<const Pack<T, VEC>*>(p);
#pragma unroll
  for (int k = 0; k < VEC; ++k) out[k] = Convert<T>::in(pack.v[k]);
}

template <typename T, int VEC>
__device__ __forceinline__ void store(T* p, const float (&in)[VEC]) {
  Pack<T, VEC> pack;
#pragma unroll
  for (int k = 0; k < VEC; ++k) pack.v[k] = Convert<T>::out(in[k]);
  *reinterpret_cast<Pack<T, VEC>*>(p) = pack;
}

// VEC weights from column e (16-byte loads through the read-only cache), or `fallback`.
template <int VEC>
__device__ __forceinline__ void load_weight(const float* w, int e, float fallback, float (&out)[VEC]) {
  static_assert(VEC % 4 == 0, "weights are read as float4");
  if (w == nullptr) {
#pragma unroll
    for (int k = 0; k < VEC; ++k) out[k] = fallback;
    return;
  }
#pragma unroll
  for (int k = 0; k < VEC; k += 4) {
    const float4 q = __ldg(reinterpret_cast<const float4*>(w + e + k));
    out[k] = q.x, out[k + 1] = q.y, out[k + 2] = q.z, out[k + 3] = q.w;
  }
}

template <int K>
__device__ __forceinline__ void warp_sum(float (&v)[K]) {
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset /= 2)
#pragma unroll
    for (int k = 0; k < K; ++k) v[k] += __shfl_xor_sync(0xffffffffu, v[k], offset);
}

// Sums K values over the threads of this thread's row (blockDim.x threads); every thread of
// the row gets the totals, added in warp order. `buffer`: one of the two exchange buffers.
template <int K>
__device__ __forceinline__ void row_sum(float (&v)[K], float* buffer) {
  warp_sum(v);
  const int warps = blockDim.x / kWarp;
  if (warps == 1) return;
  float* row = buffer + threadIdx.y * warps * K;
  if (threadIdx.x % kWarp == 0)
#pragma unroll
    for (int k = 0; k < K; ++k) row[(threadIdx.x / kWarp) * K + k] = v[k];
  __syncthreads();
#pragma unroll
  for (int k = 0; k < K; ++k) {
    v[k] = 0.f;
    for (int w = 0; w < warps; ++w) v[k] += row[w * K + k];
  }
}

// Mean and rstd of K streams of a row (this thread's values in v, chunks flagged valid;
// invalid chunks hold zeros). RMSNorm: the mean square. LayerNorm: each warp's centred
// moments (its own mean, then its centred squares), merged across warps in warp order by
// Chan's formula: one exchange for all K streams.
template <int K, int CH, int VEC>
__device__ __forceinline__ void row_moments(const float (&v)[K][CH][VEC], const bool (&valid)[CH], int hidden,
                                            bool rms, float eps, float* buffer, float (&mean)[K],
                                            float (&rstd)[K]) {
  const int warps = blockDim.x / kWarp, lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  float* row = buffer + threadIdx.y * warps * (2 * K + 1);
  if (rms) {
    float q[K];
#pragma unroll
    for (int k = 0; k < K; ++k) {
      q[k] = 0.f;
#pragma unroll
      for (int j = 0; j < CH; ++j)
#pragma unroll
        for (int i = 0; i < VEC; ++i) q[k] += v[k][j][i] * v[k][j][i];
    }
    row_sum(q, buffer);
#pragma unroll
    for (int k = 0; k < K; ++k) mean[k] = 0.f, rstd[k] = 1.f / sqrtf(q[k] / hidden + eps);
    return;
  }
  float s[K + 1];
#pragma unroll
  for (int k = 0; k <= K; ++k) s[k] = 0.f;
#pragma unroll
  for (int j = 0; j < CH; ++j) {
    if (valid[j]) s[K] += VEC;
#pragma unroll
    for (int k = 0; k < K; ++k)
#pragma unroll
      for (int i = 0; i < VEC; ++i) s[k] += v[k][j][i];
  }
  warp_sum(s);
  const float n_warp = s[K];
  float m_warp[K], q[K];
#pragma unroll
  for (int k = 0; k < K; ++k) {
    m_warp[k] = n_warp > 0.f ? s[k] / n_warp : 0.f;
    q[k] = 0.f;
#pragma unroll
    for (int j = 0; j < CH; ++j)
      if (valid[j])
#pragma unroll
        for (int i = 0; i < VEC; ++i) q[k] += (v[k][j][i] - m_warp[k]) * (v[k][j][i] - m_warp[k]);
  }
  warp_sum(q);
  float m2[K];
  if (warps == 1) {
#pragma unroll
    for (int k = 0; k < K; ++k) mean[k] = m_warp[k], m2[k] = q[k];
  } else {
    if (lane == 0) {
      float* mine = row + warp * (2 * K + 1);
      mine[0] = n_warp;
#pragma unroll
      for (int k = 0; k < K; ++k) mine[1 + 2 * k] = m_warp[k], mine[2 + 2 * k] = q[k];
    }
    __syncthreads();
    float n = 0.f;
#pragma unroll
    for (int k = 0; k < K; ++k) mean[k] = 0.f, m2[k] = 0.f;
    for (int w = 0; w < warps; ++w) {
      const float* theirs = row + w * (2 * K + 1);
      const float nb = theirs[0];
      if (nb == 0.f) continue;
      const float total = n + nb;
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const float delta = theirs[1 + 2 * k] - mean[k];
        mean[k] += delta * (nb / total);
        m2[k] += theirs[2 + 2 * k] + delta * delta * (n * nb / total);
      }
      n = total;
    }
  }
#pragma unroll
  for (int k = 0; k < K; ++k) rstd[k] = 1.f / sqrtf(m2[k] / hidden + eps);
}

struct Params {
  const float *gx, *bx, *gy, *by, *gi, *bi;
  int64_t rows;
  int hidden;
  bool packed, rms;
  float eps;
};

Params params_of(const NormArgs& a) {
  return Params{a.gx, a.bx, a.gy, a.by, a.gi, a.bi, a.rows, a.hidden, a.packed, a.rms, a.eps};
}

// The X and Y norms' gammas and betas at element e (1 and 0 where a norm has none).
template <int VEC>
__device__ __forceinline__ void load_stream_weights(const Params& p, int e, float (&gx)[VEC], float (&bx)[VEC],
                                                    float (&gy)[VEC], float (&by)[VEC]) {
  load_weight<VEC>(p.gx, e, 1.f, gx);
  load_weight<VEC>(p.bx, e, 0.f, bx);
  load_weight<VEC>(p.gy, e, 1.f, gy);
  load_weight<VEC>(p.by, e, 0.f, by);
}

// -- dual_norm forward ---------------------------------------------------------------------

template <typename T, int VEC, int CH>
__global__ void forward_kernel(const T* __restrict__ streams, Params p, T* __restrict__ base,
                               T* __restrict__ normed, float* __restrict__ stats) {
  extern __shared__ float shared[];
  const int warps = blockDim.x / kWarp;
  // two exchange buffers, used in turn (a buffer is rewritten only after a further barrier)
  const int exchange_floats = blockDim.y * warps * (kForwardSharedPerWarp / 2);
  int turn = 0;
  const int h = p.hidden;
  const int64_t width = p.packed ? 2 * int64_t(h) : h;
  const int64_t tiles = (p.rows + blockDim.y - 1) / blockDim.y;
  for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const int64_t r = tile * blockDim.y + threadIdx.y;
    const bool row_ok = r < p.rows;
    const int64_t row = row_ok ? r : 0;
    const T* x = streams + row * width;
    const T* y = p.packed ? x + h : x;
    bool valid[CH];
    float v[2][CH][VEC];  // x and y; then u and a
#pragma unroll
    for (int j = 0; j < CH; ++j) {
      const int e = (j * blockDim.x + threadIdx.x) * VEC;
      valid[j] = row_ok && e < h;
      if (valid[j]) {
        load<T, VEC>(x + e, v[0][j]);
        load<T, VEC>(y + e, v[1][j]);
      } else {
#pragma unroll
        for (int i = 0; i < VEC; ++i) v[0][j][i] = v[1][j][i] = 0.f;
      }
    }
    float mean[2], rstd[2];
    row_moments<2, CH, VEC>(v, valid, h, p.rms, p.eps, shared + turn * exchange_floats, mean, rstd);
    turn ^= 1;
    T* base_row = base + row * 2 * int64_t(h);
#pragma unroll
    for (int j = 0; j < CH; ++j) {
      if (!valid[j]) continue;
      const int e = (j * blockDim.x + threadIdx.x) * VEC;
      store<T, VEC>(base_row + h + e, v[1][j]);  // the identity path's base: y itself
      float gx[VEC], bx[VEC], gy[VEC], by[VEC];
      load_stream_weights<VEC>(p, e, gx, bx, gy, by);
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        const float u = (v[0][j][i] - mean[0]) * rstd[0] * gx[i] + bx[i];
        const float yn = (v[1][j][i] - mean[1]) * rstd[1] * gy[i] + by[i];
        v[0][j][i] = u;
        v[1][j][i] = u + yn;
      }
      store<T, VEC>(base_row + e, v[0][j]);
    }
    float mean_a[1] = {0.f}, rstd_a[1] = {0.f};
    if (p.gi != nullptr) {
      const float(&a)[1][CH][VEC] = *reinterpret_cast<const float(*)[1][CH][VEC]>(&v[1]);
      row_moments<1, CH, VEC>(a, valid, h, p.rms, p.eps, shared + turn * exchange_floats, mean_a, rstd_a);
      turn ^= 1;
#pragma unroll
      for (int j = 0; j < CH; ++j) {
        if (!valid[j]) continue;
        const int e = (j * blockDim.x + threadIdx.x) * VEC;
        float gi[VEC], bi[VEC];
        load_weight<VEC>(p.gi, e, 1.f, gi);
        load_weight<VEC>(p.bi, e, 0.f, bi);
#pragma unroll
        for (int i = 0; i < VEC; ++i) v[1][j][i] = (v[1][j][i] - mean_a[0]) * rstd_a[0] * gi[i] + bi[i];
      }
    }
    T* normed_row = normed + row * h;
#pragma unroll
    for (int j = 0; j < CH; ++j)
      if (valid[j]) store<T, VEC>(normed_row + (j * blockDim.x + threadIdx.x) * VEC, v[1][j]);
    if (row_ok && threadIdx.x == 0) {
      float* s = stats + r * 6;
      s[0] = mean[0], s[1] = rstd[0], s[2] = mean[1], s[3] = rstd[1], s[4] = mean_a[0], s[5] = rstd_a[0];
    }
  }
}

// -- dual_norm backward --------------------------------------------------------------------

// Weight-gradient accumulators: gammas first (x, y, input), then the biases.
template <bool BIAS, bool INPUT>
struct Accumulated {
  static constexpr int kGammas = INPUT ? 3 : 2;
  static constexpr int kCount = BIAS ? 2 * kGammas : kGammas;
};

// In registers: one per weight and element this thread holds.
template <bool SHARED, int NW, int CH, int VEC>
struct Accumulators {
  float v[NW][CH][VEC];
  __device__ __forceinline__ void init(float*, int) {
#pragma unroll
    for (int w = 0; w < NW; ++w)
#pragma unroll
      for (int j = 0; j < CH; ++j)
#pragma unroll
        for (int i = 0; i < VEC; ++i) v[w][j][i] = 0.f;
  }
  __device__ __forceinline__ void add(int w, int j, int i, int /*column*/, float x) { v[w][j][i] += x; }
  __device__ __forceinline__ float get(int w, int j, int i, int /*column*/) const { return v[w][j][i]; }
};

// In shared memory ([NW, h] for the CTA's one row group): each thread touches only its own
// columns, so no barrier guards them.
template <int NW, int CH, int VEC>
struct Accumulators<true, NW, CH, VEC> {
  float* s;
  int h;
  __device__ __forceinline__ void init(float* shared, int hidden) {
    s = shared, h = hidden;
#pragma unroll
    for (int j = 0; j < CH; ++j) {
      const int e = (j * blockDim.x + threadIdx.x) * VEC;
      if (e < h)
#pragma unroll
        for (int w = 0; w < NW; ++w)
#pragma unroll
          for (int i = 0; i < VEC; ++i) s[w * h + e + i] = 0.f;
    }
  }
  __device__ __forceinline__ void add(int w, int, int, int column, float x) { s[w * h + column] += x; }
  __device__ __forceinline__ float get(int w, int, int, int column) const { return s[w * h + column]; }
};

// With normalized value n and gamma-scaled gradient t = dL/dnorm_out * gamma:
//   dL/dinput = rstd * (t - mean(t) - n * mean(t * n))   (RMSNorm: without mean(t)).
template <typename T, int VEC, int CH, bool BIAS, bool INPUT, bool SHARED>
__global__ void backward_kernel(const T* __restrict__ grad_base, const T* __restrict__ grad_normed,
                                const T* __restrict__ streams, const float* __restrict__ stats, Params p,
                                T* __restrict__ grad_streams, float* __restrict__ partials) {
  using Acc = Accumulated<BIAS, INPUT>;
  constexpr int G = Acc::kGammas, NW = Acc::kCount;
  extern __shared__ float shared[];
  const int warps = blockDim.x / kWarp;
  const int exchange_floats = blockDim.y * warps * (kBackwardSharedPerWarp / 2);  // two, used in turn
  int turn = 0;
  const int h = p.hidden;
  const int64_t width = p.packed ? 2 * int64_t(h) : h;
  Accumulators<SHARED, NW, CH, VEC> acc;
  acc.init(shared + 2 * exchange_floats, h);
  const int64_t tiles = (p.rows + blockDim.y - 1) / blockDim.y;
  for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const int64_t r = tile * blockDim.y + threadIdx.y;
    const bool row_ok = r < p.rows;
    const int64_t row = row_ok ? r : 0;
    const float* s = stats + row * 6;
    const float mx = s[0], rx = s[1], my = s[2], ry = s[3], ma = s[4], ra = s[5];
    const T* x = streams + row * width;
    const T* y = p.packed ? x + h : x;
    const T* gb = grad_base + row * 2 * int64_t(h);
    bool valid[CH];
    float nx[CH][VEC], ny[CH][VEC], ga[CH][VEC], gu[CH][VEC];
#pragma unroll
    for (int j = 0; j < CH; ++j) {
      const int e = (j * blockDim.x + threadIdx.x) * VEC;
      valid[j] = row_ok && e < h;
#pragma unroll
      for (int i = 0; i < VEC; ++i) nx[j][i] = ny[j][i] = ga[j][i] = gu[j][i] = 0.f;
      if (valid[j]) {
        load<T, VEC>(x + e, nx[j]);
        load<T, VEC>(y + e, ny[j]);
        load<T, VEC>(grad_normed + row * h + e, ga[j]);
#pragma unroll
        for (int i = 0; i < VEC; ++i) nx[j][i] = (nx[j][i] - mx) * rx, ny[j][i] = (ny[j][i] - my) * ry;
      }
    }
    if constexpr (INPUT) {  // the input norm's backward: ga becomes dL/da
      float sums[2] = {0.f, 0.f};
#pragma unroll
      for (int j = 0; j < CH; ++j) {
        if (!valid[j]) continue;
        const int e = (j * blockDim.x + threadIdx.x) * VEC;
        float gx[VEC], bx[VEC], gy[VEC], by[VEC], gi[VEC];
        load_stream_weights<VEC>(p, e, gx, bx, gy, by);
        load_weight<VEC>(p.gi, e, 1.f, gi);
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          const float na = (nx[j][i] * gx[i] + bx[i] + ny[j][i] * gy[i] + by[i] - ma) * ra;
          acc.add(2, j, i, e + i, ga[j][i] * na);
          if constexpr (BIAS) acc.add(G + 2, j, i, e + i, ga[j][i]);
          const float t = ga[j][i] * gi[i];
          sums[0] += t, sums[1] += t * na;
          gu[j][i] = na;  // kept for the step below
        }
      }
      row_sum(sums, shared + turn * exchange_floats);
      turn ^= 1;
      const float mean_t = p.rms ? 0.f : sums[0] / h, mean_tn = sums[1] / h;
#pragma unroll
      for (int j = 0; j < CH; ++j) {
        if (!valid[j]) continue;
        float gi[VEC];
        load_weight<VEC>(p.gi, (j * blockDim.x + threadIdx.x) * VEC, 1.f, gi);
#pragma unroll
        for (int i = 0; i < VEC; ++i) ga[j][i] = ra * (ga[j][i] * gi[i] - mean_t - gu[j][i] * mean_tn);
      }
    }
    // dL/du = residual-path gradient + dL/da; PreNorm(y)'s output gradient is dL/da
    float sums[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int j = 0; j < CH; ++j) {
      if (!valid[j]) continue;
      const int e = (j * blockDim.x + threadIdx.x) * VEC;
      float g_residual[VEC], gx[VEC], gy[VEC];
      load<T, VEC>(gb + e, g_residual);
      load_weight<VEC>(p.gx, e, 1.f, gx);
      load_weight<VEC>(p.gy, e, 1.f, gy);
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        gu[j][i] = g_residual[i] + ga[j][i];
        acc.add(0, j, i, e + i, gu[j][i] * nx[j][i]);
        acc.add(1, j, i, e + i, ga[j][i] * ny[j][i]);
        if constexpr (BIAS) acc.add(G, j, i, e + i, gu[j][i]), acc.add(G + 1, j, i, e + i, ga[j][i]);
        const float tx = gu[j][i] * gx[i], ty = ga[j][i] * gy[i];
        sums[0] += tx, sums[1] += tx * nx[j][i], sums[2] += ty, sums[3] += ty * ny[j][i];
      }
    }
    row_sum(sums, shared + turn * exchange_floats);
    turn ^= 1;
    const float mtx = p.rms ? 0.f : sums[0] / h, mtnx = sums[1] / h;
    const float mty = p.rms ? 0.f : sums[2] / h, mtny = sums[3] / h;
    T* out = grad_streams + row * width;
#pragma unroll
    for (int j = 0; j < CH; ++j) {
      if (!valid[j]) continue;
      const int e = (j * blockDim.x + threadIdx.x) * VEC;
      float g_identity[VEC], gx[VEC], gy[VEC], dx[VEC], dy[VEC];
      load<T, VEC>(gb + h + e, g_identity);
      load_weight<VEC>(p.gx, e, 1.f, gx);
      load_weight<VEC>(p.gy, e, 1.f, gy);
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        dx[i] = rx * (gu[j][i] * gx[i] - mtx - nx[j][i] * mtnx);
        dy[i] = ry * (ga[j][i] * gy[i] - mty - ny[j][i] * mtny) + g_identity[i];
        if (!p.packed) dx[i] += dy[i];
      }
      store<T, VEC>(out + e, dx);
      if (p.packed) store<T, VEC>(out + h + e, dy);
    }
  }
  float* part = partials + (int64_t(blockIdx.x) * blockDim.y + threadIdx.y) * NW * h;
#pragma unroll
  for (int j = 0; j < CH; ++j) {
    const int e = (j * blockDim.x + threadIdx.x) * VEC;
    if (e >= h) continue;
#pragma unroll
    for (int w = 0; w < NW; ++w) {
      float values[VEC];
#pragma unroll
      for (int i = 0; i < VEC; ++i) values[i] = acc.get(w, j, i, e + i);
      store<float, VEC>(part + w * h + e, values);
    }
  }
}

// out[row(w), c] = the sum over parts p of partials[p, w, c], in a fixed order: lane l of a
// column sums parts l, l + 8, ... in order, then the 8 lane sums are added in lane order.
// row(w): gammas (w < gammas) go to rows 0, 2, 4, biases to rows 1, 3, 5 (the op's order).
__global__ void finalize_kernel(const float* __restrict__ partials, int parts, int accumulators, int gammas,
                                int h, float* __restrict__ out) {
  __shared__ float lanes[8][33];
  const int c = blockIdx.x * kWarp + threadIdx.x, w = blockIdx.y;
  float total = 0.f;
  if (c < h)
    for (int part = threadIdx.y; part < parts; part += 8)
      total += partials[(int64_t(part) * accumulators + w) * h + c];
  lanes[threadIdx.y][threadIdx.x] = total;
  __syncthreads();
  if (threadIdx.y == 0 && c < h) {
    total = 0.f;
    for (int l = 0; l < 8; ++l) total += lanes[l][threadIdx.x];
    const int row = w < gammas ? 2 * w : 2 * (w - gammas) + 1;
    out[int64_t(row) * h + c] = total;
  }
}

// -- dual_residual -------------------------------------------------------------------------

template <int VEC>
__device__ __forceinline__ void load_mask(const bool* p, float scale, float (&keep)[VEC]) {
  const Pack<bool, VEC> pack = *reinterpret_cast<const Pack<bool, VEC>*>(p);
#pragma unroll
  for (int i = 0; i < VEC; ++i) keep[i] = pack.v[i] ? scale : 0.f;
}

// Columns e.. of both halves of the packed row r ([x | y], 2h wide).
template <typename T, int VEC>
__device__ __forceinline__ void load_halves(const T* packed, int64_t r, int h, int e, float (&x)[VEC],
                                            float (&y)[VEC]) {
  load<T, VEC>(packed + r * 2 * h + e, x);
  load<T, VEC>(packed + r * 2 * h + h + e, y);
}

template <typename T, int VEC>
__device__ __forceinline__ void store_halves(T* packed, int64_t r, int h, int e, const float (&x)[VEC],
                                             const float (&y)[VEC]) {
  store<T, VEC>(packed + r * 2 * h + e, x);
  store<T, VEC>(packed + r * 2 * h + h + e, y);
}

// One thread: VEC columns of a row; x over a row's vectors, y over rows. The backward below walks
// rows alike: forward and backward are kept apart so each keeps its registers (no runtime branch).
template <typename T, int VEC>
__global__ void residual_kernel(const T* __restrict__ base, const T* __restrict__ out,
                                const float* __restrict__ bias, const bool* __restrict__ mask, float scale,
                                float inv_c, int64_t rows, int h, T* __restrict__ packed) {
  const int e = (blockIdx.x * blockDim.x + threadIdx.x) * VEC;
  if (e >= h) return;
  float b[VEC];
  if (bias != nullptr) {
#pragma unroll
    for (int i = 0; i < VEC; i += 4) {
      const float4 q = __ldg(reinterpret_cast<const float4*>(bias + e + i));
      b[i] = q.x, b[i + 1] = q.y, b[i + 2] = q.z, b[i + 3] = q.w;
    }
  } else {
#pragma unroll
    for (int i = 0; i < VEC; ++i) b[i] = 0.f;
  }
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    float z[VEC], u[VEC], y[VEC], keep[VEC];
    load<T, VEC>(out + r * h + e, z);
    load_halves<T, VEC>(base, r, h, e, u, y);
    if (mask != nullptr) load_mask<VEC>(mask + r * h + e, scale, keep);
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      z[i] += b[i];
      if (mask != nullptr) z[i] *= keep[i];
      u[i] += z[i] * inv_c;
      y[i] += z[i];
    }
    store_halves<T, VEC>(packed, r, h, e, u, y);
  }
}

constexpr int kStripLanes = 8;  // blockDim.y of the residual backward

// x over a row's vectors, y over the rows of this CTA's strip (blockIdx.y); the bias
// gradient of each (strip, lane) is one partial row.
template <typename T, int VEC>
__global__ void residual_backward_kernel(const T* __restrict__ grad, const bool* __restrict__ mask, float scale,
                                         float inv_c, int64_t rows, int h, int64_t rows_per_strip,
                                         T* __restrict__ grad_out, float* __restrict__ partials) {
  const int e = (blockIdx.x * blockDim.x + threadIdx.x) * VEC;
  if (e >= h) return;
  float sum[VEC];
#pragma unroll
  for (int i = 0; i < VEC; ++i) sum[i] = 0.f;
  const int64_t first = int64_t(blockIdx.y) * rows_per_strip;
  const int64_t last = first + rows_per_strip < rows ? first + rows_per_strip : rows;
  for (int64_t r = first + threadIdx.y; r < last; r += blockDim.y) {
    float gu[VEC], gy[VEC], keep[VEC];
    load_halves<T, VEC>(grad, r, h, e, gu, gy);
    if (mask != nullptr) load_mask<VEC>(mask + r * h + e, scale, keep);
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      gu[i] = gu[i] * inv_c + gy[i];  // dL/dz
      if (mask != nullptr) gu[i] *= keep[i];
      sum[i] += gu[i];
    }
    store<T, VEC>(grad_out + r * h + e, gu);
  }
  if (partials != nullptr)
    store<float, VEC>(partials + (int64_t(blockIdx.y) * blockDim.y + threadIdx.y) * h + e, sum);
}

// -- instantiations, their resources, and the launches ---------------------------------------

// Calls f.template operator()<T>() for the element type `t`.
template <typename F>
void with_type(DType t, F&& f) {
  switch (t) {
    case DType::kFloat: return f.template operator()<float>();
    case DType::kBFloat16: return f.template operator()<__nv_bfloat16>();
    case DType::kHalf: return f.template operator()<__half>();
  }
}

// The instantiations: 8, 16 and 32 elements per thread forward; backward 8 and 16 with the
// accumulators in registers, 16 and 32 with them in shared memory.
constexpr bool forward_chunking(int elements) { return elements == 8 || elements == 16 || elements == 32; }
constexpr bool backward_chunking(bool shared, int elements) {
  return shared ? (elements == 16 || elements == 32) : (elements == 8 || elements == 16);
}
constexpr int kChunkCounts[] = {1, 2, 4, 8};

void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess)
    throw std::runtime_error(std::string("dual_norm (CUDA, tiled): ") + what + ": " + cudaGetErrorString(status));
}

// cudaFuncGetAttributes, asked once per device and instantiation.
plan::Resources resources_of(const void* kernel, int chunks, int shared_per_column, int device) {
  static std::mutex mutex;
  static std::map<std::pair<int, const void*>, cudaFuncAttributes> cache;
  std::lock_guard<std::mutex> lock(mutex);
  auto found = cache.find({device, kernel});
  if (found == cache.end()) {
    cudaFuncAttributes attributes;
    check(cudaFuncGetAttributes(&attributes, kernel), "cudaFuncGetAttributes");
    found = cache.emplace(std::make_pair(device, kernel), attributes).first;
  }
  const cudaFuncAttributes& a = found->second;
  return plan::Resources{chunks, shared_per_column, a.numRegs, static_cast<int>(a.localSizeBytes),
                         static_cast<int>(a.sharedSizeBytes)};
}

#define SIAMESE_CHUNK_CASE(N_)                      \
  if (chunks == N_) return f.template operator()<N_>();
template <typename F>
void with_chunk_count(int chunks, F&& f) {
  SIAMESE_CHUNK_CASE(1) SIAMESE_CHUNK_CASE(2) SIAMESE_CHUNK_CASE(4) SIAMESE_CHUNK_CASE(8)
  throw std::runtime_error("dual_norm (CUDA, tiled): no instantiation with " + std::to_string(chunks) + " chunks");
}
#undef SIAMESE_CHUNK_CASE

template <typename F>
void with_kind(bool bias, bool input, F&& f) {
  if (bias && input) return f.template operator()<true, true>();
  if (bias) return f.template operator()<true, false>();
  if (input) return f.template operator()<false, true>();
  return f.template operator()<false, false>();
}

// Before a launch, once per device, kernel and configuration: opts in to more than 48 KB of
// dynamic shared memory, and asks the driver whether the plan's CTAs are resident. A plan the
// driver disagrees with is an error that names both counts, never a silent slower launch.
void prepare_launch(const void* kernel, const plan::Plan& p, int device) {
  static std::mutex mutex;
  static std::map<std::tuple<int, const void*, int, int>, bool> prepared;
  std::lock_guard<std::mutex> lock(mutex);
  const auto key = std::make_tuple(device, kernel, p.threads(), p.dynamic_shared);
  if (prepared.count(key)) return;
  if (p.dynamic_shared > 48 * 1024)
    check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, p.dynamic_shared),
          "cudaFuncSetAttribute(MaxDynamicSharedMemorySize)");
  int resident = 0;
  check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident, kernel, p.threads(), p.dynamic_shared),
        "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
  if (resident != p.ctas_per_sm)
    throw std::runtime_error("dual_norm (CUDA, tiled): the launch plan counts " + std::to_string(p.ctas_per_sm) +
                             " resident CTAs of " + std::to_string(p.threads()) + " threads, the driver " +
                             std::to_string(resident) + "; unset MEGATRON_SIAMESE_CUDA_KERNELS to use the "
                             "verified kernels, and report this");
  prepared[key] = true;
}

}  // namespace

plan::Device device_limits(int device) {
  static std::mutex mutex;
  static std::map<int, plan::Device> cache;
  std::lock_guard<std::mutex> lock(mutex);
  auto found = cache.find(device);
  if (found != cache.end()) return found->second;
  auto attribute = [device](cudaDeviceAttr which) {
    int value = 0;
    check(cudaDeviceGetAttribute(&value, which, device), "cudaDeviceGetAttribute");
    return value;
  };
  plan::Device d;
  d.sms = attribute(cudaDevAttrMultiProcessorCount);
  d.registers_per_sm = attribute(cudaDevAttrMaxRegistersPerMultiprocessor);
  d.threads_per_sm = attribute(cudaDevAttrMaxThreadsPerMultiProcessor);
  d.ctas_per_sm = attribute(cudaDevAttrMaxBlocksPerMultiprocessor);
  d.shared_per_sm = attribute(cudaDevAttrMaxSharedMemoryPerMultiprocessor);
  d.shared_per_cta = attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin);
  d.reserved_shared_per_cta = attribute(cudaDevAttrReservedSharedMemoryPerBlock);
  cache.emplace(device, d);
  return d;
}

namespace {
// Plans are cached per (device, dtype, direction, weight kind, width, rows): a training run
// asks for the same few again and again, and the plan needs the resources of every candidate.
template <typename Make>
plan::Plan cached_plan(DType t, const NormArgs& a, int device, int direction, Make&& make) {
  using Key = std::tuple<int, int, int, bool, bool, int, int64_t>;
  static std::mutex mutex;
  static std::map<Key, plan::Plan> cache;
  const Key key{device, static_cast<int>(t), direction, a.biased(), a.input_norm(), a.hidden, a.rows};
  {
    std::lock_guard<std::mutex> lock(mutex);
    if (auto found = cache.find(key); found != cache.end()) return found->second;
  }
  const plan::Plan p = make();
  std::lock_guard<std::mutex> lock(mutex);
  return cache.emplace(key, p).first->second;
}
}  // namespace

plan::Plan plan_forward(DType t, const NormArgs& a, int device) {
  return cached_plan(t, a, device, 0, [&] {
    std::vector<plan::Resources> candidates;
    with_type(t, [&]<typename T>() {
      for (int chunks : kChunkCounts)
        with_chunk_count(chunks, [&]<int CH>() {
          if constexpr (forward_chunking(CH * (16 / sizeof(T))))
            candidates.push_back(resources_of(reinterpret_cast<const void*>(forward_kernel<T, 16 / sizeof(T), CH>),
                                              CH, 0, device));
        });
    });
    return plan::plan_forward_rows(a.hidden, vector_width(t), a.rows, device_limits(device), candidates);
  });
}

int backward_accumulators(const NormArgs& a) {
  const int gammas = a.input_norm() ? 3 : 2;
  return a.biased() ? 2 * gammas : gammas;
}

namespace {
template <bool SHARED>
std::vector<plan::Resources> backward_candidates(DType t, const NormArgs& a, int device) {
  std::vector<plan::Resources> candidates;
  with_type(t, [&]<typename T>() {
    for (int chunks : kChunkCounts)
      with_chunk_count(chunks, [&]<int CH>() {
        if constexpr (backward_chunking(SHARED, CH * (16 / sizeof(T))))
          with_kind(a.biased(), a.input_norm(), [&]<bool BIAS, bool INPUT>() {
            auto* kernel = backward_kernel<T, 16 / sizeof(T), CH, BIAS, INPUT, SHARED>;
            candidates.push_back(resources_of(reinterpret_cast<const void*>(kernel), CH,
                                              SHARED ? backward_accumulators(a) : 0, device));
          });
      });
  });
  return candidates;
}
}  // namespace

plan::Plan plan_backward(DType t, const NormArgs& a, int device) {
  return cached_plan(t, a, device, 1, [&] {
    return plan::plan_backward_rows(a.hidden, vector_width(t), a.rows, device_limits(device),
                                    backward_candidates<false>(t, a, device), backward_candidates<true>(t, a, device));
  });
}

int backward_parts(const plan::Plan& p) { return p.grid * p.rows_per_cta; }

void forward(const plan::Plan& p, DType t, const NormArgs& a, void* base, void* normed, float* stats, int device,
             cudaStream_t stream) {
  const dim3 block(p.threads_per_row, p.rows_per_cta);
  with_type(t, [&]<typename T>() {
    with_chunk_count(p.chunks, [&]<int CH>() {
      constexpr int VEC = 16 / sizeof(T);
      if constexpr (forward_chunking(CH * VEC)) {
        prepare_launch(reinterpret_cast<const void*>(forward_kernel<T, VEC, CH>), p, device);
        forward_kernel<T, VEC, CH><<<p.grid, block, p.dynamic_shared, stream>>>(
            static_cast<const T*>(a.streams), params_of(a), static_cast<T*>(base), static_cast<T*>(normed), stats);
      } else {
        throw std::runtime_error("dual_norm (CUDA, tiled): a forward plan names no instantiation");
      }
    });
  });
  check(cudaGetLastError(), "forward launch");
}

namespace {
template <bool SHARED>
void launch_backward(const plan::Plan& p, DType t, const NormArgs& a, const void* grad_base,
                     const void* grad_normed, const float* stats, void* grad_streams, float* partials,
                     int device, cudaStream_t stream) {
  const dim3 block(p.threads_per_row, p.rows_per_cta);
  with_type(t, [&]<typename T>() {
    constexpr int VEC = 16 / sizeof(T);
    with_chunk_count(p.chunks, [&]<int CH>() {
      if constexpr (backward_chunking(SHARED, CH * VEC)) {
        with_kind(a.biased(), a.input_norm(), [&]<bool BIAS, bool INPUT>() {
          auto* kernel = backward_kernel<T, VEC, CH, BIAS, INPUT, SHARED>;
          prepare_launch(reinterpret_cast<const void*>(kernel), p, device);
          kernel<<<p.grid, block, p.dynamic_shared, stream>>>(
              static_cast<const T*>(grad_base), static_cast<const T*>(grad_normed), static_cast<const T*>(a.streams),
              stats, params_of(a), static_cast<T*>(grad_streams), partials);
        });
      } else {
        throw std::runtime_error("dual_norm (CUDA, tiled): a backward plan names no instantiation");
      }
    });
  });
}
}  // namespace

void backward(const plan::Plan& p, DType t, const NormArgs& a, const void* grad_base, const void* grad_normed,
              const float* stats, void* grad_streams, float* partials, float* weight_grads, int device,
              cudaStream_t stream) {
  if (p.shared_accumulators)
    launch_backward<true>(p, t, a, grad_base, grad_normed, stats, grad_streams, partials, device, stream);
  else
    launch_backward<false>(p, t, a, grad_base, grad_normed, stats, grad_streams, partials, device, stream);
  check(cudaGetLastError(), "backward launch");
  const int accumulators = backward_accumulators(a), gammas = a.input_norm() ? 3 : 2;
  finalize_kernel<<<dim3((a.hidden + kWarp - 1) / kWarp, accumulators), dim3(kWarp, 8), 0, stream>>>(
      partials, backward_parts(p), accumulators, gammas, a.hidden, weight_grads);
  check(cudaGetLastError(), "finalize launch");
}

void residual(DType t, const void* base, const void* out, const float* bias, const bool* mask, float scale,
              float inv_c, int64_t rows, int hidden, void* packed, cudaStream_t stream) {
  const int vectors = hidden / vector_width(t);
  const int threads = std::min(256, (vectors + kWarp - 1) / kWarp * kWarp);
  const dim3 grid((vectors + threads - 1) / threads, static_cast<unsigned>(std::min<int64_t>(rows, 65535)));
  with_type(t, [&]<typename T>() {
    residual_kernel<T, 16 / sizeof(T)><<<grid, threads, 0, stream>>>(
        static_cast<const T*>(base), static_cast<const T*>(out), bias, mask, scale, inv_c, rows, hidden,
        static_cast<T*>(packed));
  });
  check(cudaGetLastError(), "residual launch");
}

namespace {
// The residual backward's grid: 32 vectors x 8 rows a CTA, and enough row strips for about
// 8 CTAs per SM (rows_per_strip rows each).
std::pair<dim3, int64_t> residual_backward_grid(int64_t rows, int hidden, DType t, int device) {
  const int column_blocks = (hidden / vector_width(t) + kWarp - 1) / kWarp;
  const int64_t wanted = std::max<int64_t>(1, int64_t(device_limits(device).sms) * 8 / column_blocks);
  const int64_t strips = std::max<int64_t>(1, std::min<int64_t>({wanted, (rows + kStripLanes - 1) / kStripLanes, 65535}));
  const int64_t rows_per_strip = (rows + strips - 1) / strips;
  return {dim3(column_blocks, static_cast<unsigned>((rows + rows_per_strip - 1) / rows_per_strip)), rows_per_strip};
}
}  // namespace

int residual_backward_parts(int64_t rows, int hidden, DType t, int device) {
  return static_cast<int>(residual_backward_grid(rows, hidden, t, device).first.y) * kStripLanes;
}

void residual_backward(DType t, const void* grad, const bool* mask, float scale, float inv_c, int64_t rows,
                       int hidden, void* grad_out, float* partials, float* grad_bias, int device,
                       cudaStream_t stream) {
  const auto [grid, rows_per_strip] = residual_backward_grid(rows, hidden, t, device);
  with_type(t, [&]<typename T>() {
    residual_backward_kernel<T, 16 / sizeof(T)><<<grid, dim3(kWarp, kStripLanes), 0, stream>>>(
        static_cast<const T*>(grad), mask, scale, inv_c, rows, hidden, rows_per_strip, static_cast<T*>(grad_out),
        partials);
  });
  check(cudaGetLastError(), "residual backward launch");
  if (partials != nullptr) {
    finalize_kernel<<<dim3((hidden + kWarp - 1) / kWarp, 1), dim3(kWarp, 8), 0, stream>>>(
        partials, static_cast<int>(grid.y) * kStripLanes, 1, 1, hidden, grad_bias);
    check(cudaGetLastError(), "residual bias finalize launch");
  }
}

}  // namespace tiled
}  // namespace megatron_siamese
