// The general CUDA kernels for the fused ops: any width, any alignment, float64 too. They
// serve what the tiled kernels (tiled_kernels.cu) do not cover, under the tiled generation:
// rows wider than an instantiation holds in registers, unaligned rows, double; and the ops no
// other kernel implements yet (hybrid_dual_norm, the entry ops, residual_dual_norm).
//
// One block per row (grid-striding over rows), threads striding over the row, every pass
// re-reading its inputs from global memory (L2 for all but the widest rows) instead of
// holding the row: no width limit, and the same math, in the same accumulation type, as the
// other kernels (u and a are recomputed per pass, never rounded to the streams' dtype).
//
// A row's x and y come from a source: the streams (StreamSource), or for residual_dual_norm
// the updated streams x' = PostNorm_prev(x) + z / c, y' = y + z computed per column from the
// layer's streams and the sublayer's output (BoundarySource), so one norm row serves both.
//
// Backward: a row kernel writes the streams' gradient and per-row reduction terms; a column
// kernel accumulates the weight gradients of a strip of rows per (column, lane) and a
// fixed-order finalize sums the strips: deterministic.
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
  bool base_keeps_x;   // the hybrid and entry ops: base's x half is x, its gradient reaches x directly
  A eps;
};

template <typename A>
__device__ __forceinline__ A weight(const A* w, int64_t c, A fallback) {
  return w != nullptr ? w[c] : fallback;
}

// x and y of a row read from the streams.
template <typename T, typename A>
struct StreamSource {
  const T *x, *y;
  __device__ __forceinline__ A xv(int64_t c) const { return static_cast<A>(x[c]); }
  __device__ __forceinline__ A yv(int64_t c) const { return static_cast<A>(y[c]); }
};

// residual_dual_norm's updated streams of a row: u = PostNorm_prev(x) (x without it),
// z = (out + bias) * keep, x' = u + z / c, y' = y + z, per column in the accumulation type.
template <typename T, typename A>
struct BoundarySource {
  const T *x, *y, *out;
  const A *bias, *gp, *bp;
  const bool* mask;
  A scale, inv_c, pm, pr;
  bool has_prev;
  __device__ __forceinline__ A nxp(int64_t c) const { return (static_cast<A>(x[c]) - pm) * pr; }
  __device__ __forceinline__ A u(int64_t c) const {
    return has_prev ? nxp(c) * weight(gp, c, A(1)) + weight(bp, c, A(0)) : static_cast<A>(x[c]);
  }
  __device__ __forceinline__ A keep(int64_t c) const { return mask == nullptr ? A(1) : (mask[c] ? scale : A(0)); }
  __device__ __forceinline__ A z(int64_t c) const {
    return (static_cast<A>(out[c]) + weight(bias, c, A(0))) * keep(c);
  }
  __device__ __forceinline__ A xv(int64_t c) const { return u(c) + z(c) * inv_c; }
  __device__ __forceinline__ A yv(int64_t c) const { return static_cast<A>(y[c]) + z(c); }
};

// The row's normalized x and y at column c, and u, a there.
template <typename Src, typename A>
struct Row {
  Src src;
  A mx, rx, my, ry;
  __device__ __forceinline__ A nx(int64_t c) const { return (src.xv(c) - mx) * rx; }
  __device__ __forceinline__ A ny(int64_t c) const { return (src.yv(c) - my) * ry; }
  __device__ __forceinline__ A u(const Params<A>& p, int64_t c) const {
    return nx(c) * weight(p.gx, c, A(1)) + weight(p.bx, c, A(0));
  }
  __device__ __forceinline__ A a(const Params<A>& p, int64_t c) const {
    return u(p, c) + ny(c) * weight(p.gy, c, A(1)) + weight(p.by, c, A(0));
  }
};

// Mean and rstd of `v(c)` over the row (two passes); RMSNorm: mean 0.
template <typename A, typename F>
__device__ __forceinline__ void row_moments(F&& v, int64_t h, bool rms, A eps, A* shared, A& mean, A& rstd) {
  A m[1] = {A(0)};
  if (!rms) {
    for (int64_t c = threadIdx.x; c < h; c += blockDim.x) m[0] += v(c);
    block_sum(m, shared);
    m[0] /= h;
  }
  A q[1] = {A(0)};
  for (int64_t c = threadIdx.x; c < h; c += blockDim.x) {
    const A d = v(c) - m[0];
    q[0] += d * d;
  }
  block_sum(q, shared);
  mean = m[0], rstd = A(1) / sqrt(q[0] / h + eps);
}

// dual_norm's forward on one row from `src`: stats (6), base = [u | y] ([x | y] for a channel
// scale; not written when null), normed.
template <typename T, typename A, typename Src>
__device__ __forceinline__ void norm_row_forward(const Src& src, const Params<A>& p, A* shared, T* base_row,
                                                 T* normed_row, A* stats_row) {
  const int64_t h = p.hidden;
  Row<Src, A> row{src, 0, 0, 0, 0};
  A m[2] = {A(0), A(0)};
  if (!p.rms) {
    for (int64_t c = threadIdx.x; c < h; c += blockDim.x) m[0] += src.xv(c), m[1] += src.yv(c);
    block_sum(m, shared);
    m[0] /= h, m[1] /= h;
  }
  A q[2] = {A(0), A(0)};
  for (int64_t c = threadIdx.x; c < h; c += blockDim.x) {
    const A cx = src.xv(c) - m[0], cy = src.yv(c) - m[1];
    q[0] += cx * cx, q[1] += cy * cy;
  }
  block_sum(q, shared);
  row.mx = m[0], row.my = m[1];
  row.rx = A(1) / sqrt(q[0] / h + p.eps), row.ry = A(1) / sqrt(q[1] / h + p.eps);
  if (p.channel_scale) row.mx = A(0), row.rx = A(1);  // hybrid: x is not normalized (u = c1 * x)
  A sa[1] = {A(0)};
  for (int64_t c = threadIdx.x; c < h; c += blockDim.x) {
    if (base_row != nullptr) {
      base_row[c] = static_cast<T>(p.channel_scale ? src.xv(c) : row.u(p, c));
      base_row[h + c] = static_cast<T>(src.yv(c));
    }
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
    normed_row[c] =
        static_cast<T>(p.gi != nullptr ? (a - ma) * ra * weight(p.gi, c, A(1)) + weight(p.bi, c, A(0)) : a);
  }
  if (threadIdx.x == 0) {
    stats_row[0] = row.mx, stats_row[1] = row.rx, stats_row[2] = row.my, stats_row[3] = row.ry;
    stats_row[4] = ma, stats_row[5] = ra;
  }
}

template <typename T, typename A>
__device__ __forceinline__ StreamSource<T, A> stream_row(const T* streams, const Params<A>& p, int64_t r) {
  const int64_t h = p.hidden, width = p.packed ? 2 * h : h;
  const T* x = streams + r * width;
  return {x, p.packed ? x + h : x};
}

// base: null for the entry ops (their base is the streams themselves).
template <typename T, typename A>
__global__ void forward_kernel(const T* __restrict__ streams, Params<A> p, T* __restrict__ base,
                               T* __restrict__ normed, A* __restrict__ stats) {
  __shared__ A shared[kThreads / kWarp * 2];
  const int64_t h = p.hidden;
  for (int64_t r = blockIdx.x; r < p.rows; r += gridDim.x)
    norm_row_forward<T, A>(stream_row(streams, p, r), p, shared, base == nullptr ? nullptr : base + r * 2 * h,
                           normed + r * h, stats + r * 6);
}

// dL/da at column c of a row (the input norm's backward, or grad_normed itself without one).
template <typename Src, typename T, typename A>
__device__ __forceinline__ A grad_a(const Params<A>& p, const Row<Src, A>& row, const T* gn, A ma, A ra, A mean_t,
                                    A mean_tn, int64_t c) {
  const A g = static_cast<A>(gn[c]);
  if (p.gi == nullptr) return g;
  const A na = (row.a(p, c) - ma) * ra;
  return ra * (g * p.gi[c] - mean_t - na * mean_tn);
}

// The gradient reaching base's halves at column c (gb: a row of grad_base, null for none; its
// y half exists when gb_y is set).
template <typename T, typename A>
struct BaseGrad {
  const T* gb;
  bool has_y;
  __device__ __forceinline__ A x(int64_t c) const { return gb == nullptr ? A(0) : static_cast<A>(gb[c]); }
  __device__ __forceinline__ A y(int64_t c, int64_t h) const {
    return gb == nullptr || !has_y ? A(0) : static_cast<A>(gb[h + c]);
  }
};

// dL/du at column c: the residual-path gradient plus dL/da, or dL/da alone where base keeps x
// (its residual-path gradient goes to x directly).
template <typename T, typename A>
__device__ __forceinline__ A grad_u(const Params<A>& p, const BaseGrad<T, A>& gb, A ga, int64_t c) {
  return p.base_keeps_x ? ga : gb.x(c) + ga;
}

// The input norm's row terms (mean(t), mean(t * n)) of dual_norm's backward on one row.
template <typename Src, typename T, typename A>
__device__ __forceinline__ void input_norm_terms(const Params<A>& p, const Row<Src, A>& row, const T* gn, A ma, A ra,
                                                 A* shared, A& mean_t, A& mean_tn) {
  mean_t = A(0), mean_tn = A(0);
  if (p.gi == nullptr) return;
  A t[2] = {A(0), A(0)};
  for (int64_t c = threadIdx.x; c < p.hidden; c += blockDim.x) {
    const A tc = static_cast<A>(gn[c]) * p.gi[c];
    t[0] += tc, t[1] += tc * (row.a(p, c) - ma) * ra;
  }
  block_sum(t, shared);
  mean_t = p.rms ? A(0) : t[0] / p.hidden, mean_tn = t[1] / p.hidden;
}

// The x and y norms' row terms of dual_norm's backward: mean(tx), mean(tx * nx), mean(ty), mean(ty * ny).
template <typename Src, typename T, typename A>
__device__ __forceinline__ void stream_norm_terms(const Params<A>& p, const Row<Src, A>& row, const T* gn,
                                                  const BaseGrad<T, A>& gb, A ma, A ra, A mean_t, A mean_tn,
                                                  A* shared, A (&terms)[4]) {
  A sums[4] = {A(0), A(0), A(0), A(0)};
  for (int64_t c = threadIdx.x; c < p.hidden; c += blockDim.x) {
    const A ga = grad_a(p, row, gn, ma, ra, mean_t, mean_tn, c);
    const A gu = grad_u(p, gb, ga, c);
    const A tx = gu * weight(p.gx, c, A(1)), ty = ga * weight(p.gy, c, A(1));
    sums[0] += tx, sums[1] += tx * row.nx(c), sums[2] += ty, sums[3] += ty * row.ny(c);
  }
  block_sum(sums, shared);
  const int64_t h = p.hidden;
  // the hybrid's x is not normalized: no x-norm terms
  terms[0] = p.rms || p.channel_scale ? A(0) : sums[0] / h, terms[1] = p.channel_scale ? A(0) : sums[1] / h;
  terms[2] = p.rms ? A(0) : sums[2] / h, terms[3] = sums[3] / h;
}

// dL/dx (before any direct gradient) and dL/dy (with y's identity-path gradient) at column c.
template <typename Src, typename T, typename A>
__device__ __forceinline__ void stream_grads(const Params<A>& p, const Row<Src, A>& row, const T* gn,
                                             const BaseGrad<T, A>& gb, A ma, A ra, A mean_t, A mean_tn,
                                             const A (&terms)[4], int64_t c, A& dx, A& dy) {
  const A ga = grad_a(p, row, gn, ma, ra, mean_t, mean_tn, c);
  const A gu = grad_u(p, gb, ga, c);
  dx = row.rx * (gu * weight(p.gx, c, A(1)) - terms[0] - row.nx(c) * terms[1]);
  dy = row.ry * (ga * weight(p.gy, c, A(1)) - terms[2] - row.ny(c) * terms[3]) + gb.y(c, p.hidden);
}

// The streams' gradient, and per row the input norm's terms (mean(t), mean(t * n)) that the
// weight-gradient kernel needs. grad_base: [rows, base_width] (2h; for the entry ops the
// streams' width), or null.
template <typename T, typename A>
__global__ void backward_rows_kernel(const T* __restrict__ grad_base, int64_t base_width,
                                     const T* __restrict__ grad_normed, const T* __restrict__ streams,
                                     const A* __restrict__ stats, Params<A> p, T* __restrict__ grad_streams,
                                     A* __restrict__ terms /* [rows, 2] */) {
  __shared__ A shared[kThreads / kWarp * 4];
  const int64_t h = p.hidden, width = p.packed ? 2 * h : h;
  for (int64_t r = blockIdx.x; r < p.rows; r += gridDim.x) {
    const A* s = stats + r * 6;
    const Row<StreamSource<T, A>, A> row{stream_row(streams, p, r), s[0], s[1], s[2], s[3]};
    const A ma = s[4], ra = s[5];
    const T* gn = grad_normed + r * h;
    const BaseGrad<T, A> gb{grad_base == nullptr ? nullptr : grad_base + r * base_width, base_width == 2 * h};
    A mean_t, mean_tn;
    input_norm_terms(p, row, gn, ma, ra, shared, mean_t, mean_tn);
    if (threadIdx.x == 0) terms[2 * r] = mean_t, terms[2 * r + 1] = mean_tn;
    A norm_terms[4];
    stream_norm_terms(p, row, gn, gb, ma, ra, mean_t, mean_tn, shared, norm_terms);
    T* out = grad_streams + r * width;
    for (int64_t c = threadIdx.x; c < h; c += blockDim.x) {
      A dx, dy;
      stream_grads(p, row, gn, gb, ma, ra, mean_t, mean_tn, norm_terms, c, dx, dy);
      if (p.base_keeps_x) dx += gb.x(c);
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
__global__ void weight_grad_kernel(const T* __restrict__ grad_base, int64_t base_width,
                                   const T* __restrict__ grad_normed, const T* __restrict__ streams,
                                   const A* __restrict__ stats, const A* __restrict__ terms, Params<A> p,
                                   int64_t rows_per_strip, A* __restrict__ partials) {
  const int64_t h = p.hidden;
  const int64_t c = int64_t(blockIdx.x) * kWarp + threadIdx.x;
  if (c >= h) return;
  A acc[6] = {A(0), A(0), A(0), A(0), A(0), A(0)};  // x_weight, x_bias, y_weight, y_bias, in_weight, in_bias
  const int64_t first = int64_t(blockIdx.y) * rows_per_strip;
  const int64_t last = first + rows_per_strip < p.rows ? first + rows_per_strip : p.rows;
  for (int64_t r = first + threadIdx.y; r < last; r += kLanes) {
    const A* s = stats + r * 6;
    const Row<StreamSource<T, A>, A> row{stream_row(streams, p, r), s[0], s[1], s[2], s[3]};
    const A ma = s[4], ra = s[5];
    const T* gn = grad_normed + r * h;
    const BaseGrad<T, A> gb{grad_base == nullptr ? nullptr : grad_base + r * base_width, base_width == 2 * h};
    const A ga = grad_a(p, row, gn, ma, ra, terms[2 * r], terms[2 * r + 1], c);
    const A gu = grad_u(p, gb, ga, c);
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

// -- residual_dual_norm --------------------------------------------------------------------

// What the boundary kernels read besides the norm weights (Params: the next sublayer's norms).
template <typename T, typename A>
struct Boundary {
  const T* out;
  const A *bias, *gp, *bp;  // the sublayer's bias, PostNorm_prev's gamma and beta (null: absent)
  const bool* mask;
  A scale, inv_c;
};

template <typename T, typename A>
__device__ __forceinline__ BoundarySource<T, A> boundary_row(const T* streams, const Params<A>& p,
                                                             const Boundary<T, A>& b, int64_t r, A pm, A pr) {
  const StreamSource<T, A> s = stream_row(streams, p, r);
  return {s.x, s.y, b.out + r * p.hidden, b.bias, b.gp, b.bp, b.mask == nullptr ? nullptr : b.mask + r * p.hidden,
          b.scale, b.inv_c, pm, pr, b.gp != nullptr};
}

// stats [rows, 8]: PostNorm_prev's mean and rstd (0 and 1 without it), then dual_norm's six.
template <typename T, typename A>
__global__ void boundary_forward_kernel(const T* __restrict__ streams, Params<A> p, Boundary<T, A> b,
                                        T* __restrict__ base, T* __restrict__ normed, A* __restrict__ stats) {
  __shared__ A shared[kThreads / kWarp * 2];
  const int64_t h = p.hidden;
  for (int64_t r = blockIdx.x; r < p.rows; r += gridDim.x) {
    const StreamSource<T, A> s = stream_row(streams, p, r);
    A pm = A(0), pr = A(1);
    if (b.gp != nullptr) row_moments([&](int64_t c) { return s.xv(c); }, h, p.rms, p.eps, shared, pm, pr);
    A* row_stats = stats + r * 8;
    norm_row_forward<T, A>(boundary_row(streams, p, b, r, pm, pr), p, shared, base + r * 2 * h, normed + r * h,
                           row_stats + 2);
    if (threadIdx.x == 0) row_stats[0] = pm, row_stats[1] = pr;
  }
}

// The row kernel of residual_dual_norm's backward: dL/dout, the streams' gradient, and per row
// terms [rows, 8]: the input norm's two, the x' and y' norms' four, PostNorm_prev's two.
template <typename T, typename A>
__global__ void boundary_backward_rows_kernel(const T* __restrict__ grad_base, const T* __restrict__ grad_normed,
                                              const T* __restrict__ streams, const A* __restrict__ stats,
                                              Params<A> p, Boundary<T, A> b, T* __restrict__ grad_streams,
                                              T* __restrict__ grad_out, A* __restrict__ terms) {
  __shared__ A shared[kThreads / kWarp * 4];
  const int64_t h = p.hidden, width = p.packed ? 2 * h : h;
  for (int64_t r = blockIdx.x; r < p.rows; r += gridDim.x) {
    const A* s = stats + r * 8;
    const A pm = s[0], pr = s[1];
    const BoundarySource<T, A> src = boundary_row(streams, p, b, r, pm, pr);
    const Row<BoundarySource<T, A>, A> row{src, s[2], s[3], s[4], s[5]};
    const A ma = s[6], ra = s[7];
    const T* gn = grad_normed + r * h;
    const BaseGrad<T, A> gb{grad_base == nullptr ? nullptr : grad_base + r * 2 * h, true};
    A mean_t, mean_tn, norm_terms[4];
    input_norm_terms(p, row, gn, ma, ra, shared, mean_t, mean_tn);
    stream_norm_terms(p, row, gn, gb, ma, ra, mean_t, mean_tn, shared, norm_terms);
    // dL/dout and PostNorm_prev's terms (its output gradient is dL/dx')
    A prev[2] = {A(0), A(0)};
    for (int64_t c = threadIdx.x; c < h; c += blockDim.x) {
      A gx2, gy2;
      stream_grads(p, row, gn, gb, ma, ra, mean_t, mean_tn, norm_terms, c, gx2, gy2);
      grad_out[r * h + c] = static_cast<T>((gx2 * b.inv_c + gy2) * src.keep(c));
      if (src.has_prev) {
        const A t = gx2 * weight(b.gp, c, A(1));
        prev[0] += t, prev[1] += t * src.nxp(c);
      }
    }
    A mean_tp = A(0), mean_tnp = A(0);
    if (src.has_prev) {
      block_sum(prev, shared);
      mean_tp = p.rms ? A(0) : prev[0] / h, mean_tnp = prev[1] / h;
    }
    T* out = grad_streams + r * width;
    for (int64_t c = threadIdx.x; c < h; c += blockDim.x) {
      A gx2, gy2;
      stream_grads(p, row, gn, gb, ma, ra, mean_t, mean_tn, norm_terms, c, gx2, gy2);
      const A dx = src.has_prev ? pr * (gx2 * weight(b.gp, c, A(1)) - mean_tp - src.nxp(c) * mean_tnp) : gx2;
      if (p.packed) {
        out[c] = static_cast<T>(dx);
        out[h + c] = static_cast<T>(gy2);
      } else {
        out[c] = static_cast<T>(dx + gy2);
      }
    }
    if (threadIdx.x == 0) {
      A* t = terms + r * 6;
      t[0] = mean_t, t[1] = mean_tn, t[2] = norm_terms[0], t[3] = norm_terms[1], t[4] = norm_terms[2];
      t[5] = norm_terms[3];
    }
  }
}

// partials [strips * kLanes, 9, h]: PostNorm_prev's gamma and beta, dual_norm's six, the bias.
template <typename T, typename A>
__global__ void boundary_weight_grad_kernel(const T* __restrict__ grad_base, const T* __restrict__ grad_normed,
                                            const T* __restrict__ streams, const A* __restrict__ stats,
                                            const A* __restrict__ terms, Params<A> p, Boundary<T, A> b,
                                            int64_t rows_per_strip, A* __restrict__ partials) {
  const int64_t h = p.hidden;
  const int64_t c = int64_t(blockIdx.x) * kWarp + threadIdx.x;
  if (c >= h) return;
  A acc[9] = {A(0), A(0), A(0), A(0), A(0), A(0), A(0), A(0), A(0)};
  const int64_t first = int64_t(blockIdx.y) * rows_per_strip;
  const int64_t last = first + rows_per_strip < p.rows ? first + rows_per_strip : p.rows;
  for (int64_t r = first + threadIdx.y; r < last; r += kLanes) {
    const A* s = stats + r * 8;
    const BoundarySource<T, A> src = boundary_row(streams, p, b, r, s[0], s[1]);
    const Row<BoundarySource<T, A>, A> row{src, s[2], s[3], s[4], s[5]};
    const A ma = s[6], ra = s[7];
    const T* gn = grad_normed + r * h;
    const BaseGrad<T, A> gb{grad_base == nullptr ? nullptr : grad_base + r * 2 * h, true};
    const A* t = terms + r * 6;
    const A norm_terms[4] = {t[2], t[3], t[4], t[5]};
    const A ga = grad_a(p, row, gn, ma, ra, t[0], t[1], c);
    const A gu = grad_u(p, gb, ga, c);
    A gx2, gy2;
    stream_grads(p, row, gn, gb, ma, ra, t[0], t[1], norm_terms, c, gx2, gy2);
    if (src.has_prev) acc[0] += gx2 * src.nxp(c), acc[1] += gx2;
    acc[2] += gu * row.nx(c), acc[3] += gu, acc[4] += ga * row.ny(c), acc[5] += ga;
    if (p.gi != nullptr) {
      const A g = static_cast<A>(gn[c]);
      acc[6] += g * (row.a(p, c) - ma) * ra, acc[7] += g;
    }
    acc[8] += (gx2 * b.inv_c + gy2) * src.keep(c);
  }
  if (b.bp == nullptr) acc[1] = A(0);  // rows of absent weights stay zero
  if (p.bx == nullptr) acc[3] = A(0);
  if (p.by == nullptr) acc[5] = A(0);
  if (p.bi == nullptr) acc[7] = A(0);
  A* part = partials + (int64_t(blockIdx.y) * kLanes + threadIdx.y) * 9 * h;
#pragma unroll
  for (int w = 0; w < 9; ++w) part[w * h + c] = acc[w];
}

}  // namespace general
}  // namespace megatron_siamese
