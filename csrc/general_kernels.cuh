// The general CUDA kernels for the fused ops: any width, any alignment, float64 too. They
// serve what the tiled kernels (tiled_kernels.cu) do not cover, under the tiled generation:
// rows wider than an instantiation holds in registers, unaligned rows, double.
//
// One block per row (grid-striding over rows), threads striding over the row, every pass
// re-reading its inputs from global memory (L2 for all but the widest rows) instead of
// holding the row: no width limit, and the same math, in the same accumulation type, as the
// other kernels (u and a are recomputed per pass, never rounded to the streams' dtype).
//
// Backward: a row kernel writes the streams' gradient and the input norm's two row terms
// (mean(t), mean(t * n)); a column kernel accumulates the weight gradients of a strip of rows
// per (column, lane) and a fixed-order finalize sums the strips: deterministic.
#pragma once

#include <ATen/OpMathType.h>

namespace megatron_siamese {
namespace general {

constexpr int kThreads = 256;
constexpr int kWarp = 32;

// Sums K values over the block (every thread gets the totals, added in warp order).
template <typename A, int K>
__device__ __forceinline__ void block_sum(A (&v)[K], A* shared /* [kThreads / kWarp * K] */) {
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset /= 2)
#pragma unroll
    for (int k = 0; k < K; ++k) v[k] += __shfl_xor_sync(0xffffffffu, v[k], offset);
  __syncthreads();  // the previous reduction's readers are done with `shared`
  if (threadIdx.x % kWarp == 0)
#pragma unroll
    for (int k = 0; k < K; ++k) shared[(threadIdx.x / kWarp) * K + k] = v[k];
  __syncthreads();
#pragma unroll
  for (int k = 0; k < K; ++k) {
    v[k] = A(0);
    for (int w = 0; w < int(blockDim.x) / kWarp; ++w) v[k] += shared[w * K + k];
  }
}

template <typename A>
struct Params {
  const A *gx, *bx, *gy, *by, *gi, *bi;
  int64_t rows, hidden;
  bool packed, rms;
  bool channel_scale;  // hybrid_dual_norm: x's statistics are the identity's, base keeps x (NormWeights)
  A eps;
};

template <typename A>
__device__ __forceinline__ A weight(const A* w, int64_t c, A fallback) {
  return w != nullptr ? w[c] : fallback;
}

// The row's normalized x and y at column c, and u, a there.
template <typename T, typename A>
struct Row {
  const T *x, *y;
  A mx, rx, my, ry;
  __device__ __forceinline__ A nx(int64_t c) const { return (static_cast<A>(x[c]) - mx) * rx; }
  __device__ __forceinline__ A ny(int64_t c) const { return (static_cast<A>(y[c]) - my) * ry; }
  __device__ __forceinline__ A u(const Params<A>& p, int64_t c) const {
    return nx(c) * weight(p.gx, c, A(1)) + weight(p.bx, c, A(0));
  }
  __device__ __forceinline__ A a(const Params<A>& p, int64_t c) const {
    return u(p, c) + ny(c) * weight(p.gy, c, A(1)) + weight(p.by, c, A(0));
  }
};

template <typename T, typename A>
__global__ void forward_kernel(const T* __restrict__ streams, Params<A> p, T* __restrict__ base,
                               T* __restrict__ normed, A* __restrict__ stats) {
  __shared__ A shared[kThreads / kWarp * 2];
  const int64_t h = p.hidden, width = p.packed ? 2 * h : h;
  for (int64_t r = blockIdx.x; r < p.rows; r += gridDim.x) {
    Row<T, A> row{streams + r * width, (p.packed ? streams + r * width + h : streams + r * width), 0, 0, 0, 0};
    A m[2] = {A(0), A(0)};
    if (!p.rms) {
      for (int64_t c = threadIdx.x; c < h; c += blockDim.x)
        m[0] += static_cast<A>(row.x[c]), m[1] += static_cast<A>(row.y[c]);
      block_sum(m, shared);
      m[0] /= h, m[1] /= h;
    }
    A q[2] = {A(0), A(0)};
    for (int64_t c = threadIdx.x; c < h; c += blockDim.x) {
      const A cx = static_cast<A>(row.x[c]) - m[0], cy = static_cast<A>(row.y[c]) - m[1];
      q[0] += cx * cx, q[1] += cy * cy;
    }
    block_sum(q, shared);
    row.mx = m[0], row.my = m[1];
    row.rx = A(1) / sqrt(q[0] / h + p.eps), row.ry = A(1) / sqrt(q[1] / h + p.eps);
    if (p.channel_scale) row.mx = A(0), row.rx = A(1);  // hybrid: x is not normalized (u = c1 * x)
    T* base_row = base + r * 2 * h;
    A sa[1] = {A(0)};
    for (int64_t c = threadIdx.x; c < h; c += blockDim.x) {
      base_row[c] = p.channel_scale ? row.x[c] : static_cast<T>(row.u(p, c));
      base_row[h + c] = row.y[c];
      sa[0] += row.a(p, c);
    }
    A ma = A(0), ra = A(0);
    if (p.gi != nullptr) {
      if (!p.rms) {
        block_sum(sa, shared);
        ma = sa[0] / h;
      }
      A qa[1] = {A(0)};
      for (int64_t c = threadIdx.x; c < h; c += blockDim.x) {
        const A ca = row.a(p, c) - ma;
        qa[0] += ca * ca;
      }
      block_sum(qa, shared);
      ra = A(1) / sqrt(qa[0] / h + p.eps);
    }
    for (int64_t c = threadIdx.x; c < h; c += blockDim.x) {
      const A a = row.a(p, c);
      normed[r * h + c] =
          static_cast<T>(p.gi != nullptr ? (a - ma) * ra * weight(p.gi, c, A(1)) + weight(p.bi, c, A(0)) : a);
    }
    if (threadIdx.x == 0) {
      A* s = stats + r * 6;
      s[0] = row.mx, s[1] = row.rx, s[2] = row.my, s[3] = row.ry, s[4] = ma, s[5] = ra;
    }
  }
}

// dL/da at column c of a row (the input norm's backward, or grad_normed itself without one).
template <typename T, typename A>
__device__ __forceinline__ A grad_a(const Params<A>& p, const Row<T, A>& row, const T* gn, A ma, A ra, A mean_t,
                                    A mean_tn, int64_t c) {
  const A g = static_cast<A>(gn[c]);
  if (p.gi == nullptr) return g;
  const A na = (row.a(p, c) - ma) * ra;
  return ra * (g * p.gi[c] - mean_t - na * mean_tn);
}

// dL/du at column c: the residual-path gradient plus dL/da, or dL/da alone in the hybrid,
// whose base keeps x (its residual-path gradient goes to x directly).
template <typename T, typename A>
__device__ __forceinline__ A grad_u(const Params<A>& p, const T* gb, A ga, int64_t c) {
  return p.channel_scale ? ga : static_cast<A>(gb[c]) + ga;
}

// The streams' gradient, and per row the input norm's terms (mean(t), mean(t * n)) that the
// weight-gradient kernel needs.
template <typename T, typename A>
__global__ void backward_rows_kernel(const T* __restrict__ grad_base, const T* __restrict__ grad_normed,
                                     const T* __restrict__ streams, const A* __restrict__ stats, Params<A> p,
                                     T* __restrict__ grad_streams, A* __restrict__ terms /* [rows, 2] */) {
  __shared__ A shared[kThreads / kWarp * 4];
  const int64_t h = p.hidden, width = p.packed ? 2 * h : h;
  for (int64_t r = blockIdx.x; r < p.rows; r += gridDim.x) {
    const A* s = stats + r * 6;
    const Row<T, A> row{streams + r * width, (p.packed ? streams + r * width + h : streams + r * width),
                        s[0], s[1], s[2], s[3]};
    const A ma = s[4], ra = s[5];
    const T* gn = grad_normed + r * h;
    const T* gb = grad_base + r * 2 * h;
    A mean_t = A(0), mean_tn = A(0);
    if (p.gi != nullptr) {
      A t[2] = {A(0), A(0)};
      for (int64_t c = threadIdx.x; c < h; c += blockDim.x) {
        const A tc = static_cast<A>(gn[c]) * p.gi[c];
        t[0] += tc, t[1] += tc * (row.a(p, c) - ma) * ra;
      }
      block_sum(t, shared);
      mean_t = p.rms ? A(0) : t[0] / h, mean_tn = t[1] / h;
    }
    if (threadIdx.x == 0) terms[2 * r] = mean_t, terms[2 * r + 1] = mean_tn;
    A sums[4] = {A(0), A(0), A(0), A(0)};
    for (int64_t c = threadIdx.x; c < h; c += blockDim.x) {
      const A ga = grad_a(p, row, gn, ma, ra, mean_t, mean_tn, c);
      const A gu = grad_u(p, gb, ga, c);
      const A tx = gu * weight(p.gx, c, A(1)), ty = ga * weight(p.gy, c, A(1));
      sums[0] += tx, sums[1] += tx * row.nx(c), sums[2] += ty, sums[3] += ty * row.ny(c);
    }
    block_sum(sums, shared);
    // the hybrid's x is not normalized: no x-norm terms, and its residual gradient joins dL/dx
    const A mtx = p.rms || p.channel_scale ? A(0) : sums[0] / h, mtnx = p.channel_scale ? A(0) : sums[1] / h;
    const A mty = p.rms ? A(0) : sums[2] / h, mtny = sums[3] / h;
    T* out = grad_streams + r * width;
    for (int64_t c = threadIdx.x; c < h; c += blockDim.x) {
      const A ga = grad_a(p, row, gn, ma, ra, mean_t, mean_tn, c);
      const A gu = grad_u(p, gb, ga, c);
      const A dx = row.rx * (gu * weight(p.gx, c, A(1)) - mtx - row.nx(c) * mtnx) +
                   (p.channel_scale ? static_cast<A>(gb[c]) : A(0));
      const A dy = row.ry * (ga * weight(p.gy, c, A(1)) - mty - row.ny(c) * mtny) + static_cast<A>(gb[h + c]);
      if (p.packed) {
        out[c] = static_cast<T>(dx);
        out[h + c] = static_cast<T>(dy);
      } else {
        out[c] = static_cast<T>(dx + dy);
      }
    }
  }
}

constexpr int kLanes = 8;  // rows a column's threads split between them

// partials [strips * kLanes, 6, h]: the weight gradients of the rows of strip blockIdx.y that
// lane threadIdx.y visits, for columns blockIdx.x * 32 + threadIdx.x.
template <typename T, typename A>
__global__ void weight_grad_kernel(const T* __restrict__ grad_base, const T* __restrict__ grad_normed,
                                   const T* __restrict__ streams, const A* __restrict__ stats,
                                   const A* __restrict__ terms, Params<A> p, int64_t rows_per_strip,
                                   A* __restrict__ partials) {
  const int64_t h = p.hidden, width = p.packed ? 2 * h : h;
  const int64_t c = int64_t(blockIdx.x) * kWarp + threadIdx.x;
  if (c >= h) return;
  A acc[6] = {A(0), A(0), A(0), A(0), A(0), A(0)};  // x_weight, x_bias, y_weight, y_bias, in_weight, in_bias
  const int64_t first = int64_t(blockIdx.y) * rows_per_strip;
  const int64_t last = first + rows_per_strip < p.rows ? first + rows_per_strip : p.rows;
  for (int64_t r = first + threadIdx.y; r < last; r += kLanes) {
    const A* s = stats + r * 6;
    const Row<T, A> row{streams + r * width, (p.packed ? streams + r * width + h : streams + r * width),
                        s[0], s[1], s[2], s[3]};
    const A ma = s[4], ra = s[5];
    const T* gn = grad_normed + r * h;
    const A ga = grad_a(p, row, gn, ma, ra, terms[2 * r], terms[2 * r + 1], c);
    const A gu = grad_u(p, grad_base + r * 2 * h, ga, c);
    acc[0] += gu * row.nx(c), acc[1] += gu, acc[2] += ga * row.ny(c), acc[3] += ga;
    if (p.gi != nullptr) {
      const A g = static_cast<A>(gn[c]);
      acc[4] += g * (row.a(p, c) - ma) * ra, acc[5] += g;
    }
  }
  if (p.bx == nullptr) acc[1] = A(0);  // rows of absent weights stay zero
  if (p.by == nullptr) acc[3] = A(0);
  if (p.bi == nullptr) acc[5] = A(0);
  A* part = partials + (int64_t(blockIdx.y) * kLanes + threadIdx.y) * 6 * h;
#pragma unroll
  for (int w = 0; w < 6; ++w) part[w * h + c] = acc[w];
}

// out[w, c] = the sum over parts of partials[part, w, c], parts in order (one thread a column).
template <typename A>
__global__ void sum_parts_kernel(const A* __restrict__ partials, int64_t parts, int64_t columns, A* __restrict__ out) {
  const int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= columns) return;
  A total = A(0);
  for (int64_t part = 0; part < parts; ++part) total += partials[part * columns + c];
  out[c] = total;
}

}  // namespace general
}  // namespace megatron_siamese
