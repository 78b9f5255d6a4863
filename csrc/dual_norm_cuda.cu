// CUDA kernels for the SiameseNorm fused ops.
//
// dual_norm forward: one thread block per row. Each thread keeps its slice of x and y in
// registers (ITERS chunks of VEC elements, loaded with 16-byte vector loads when the row is
// aligned, element by element at a predicated tail otherwise), so the row is read from HBM
// once. Statistics use two passes over the registers (mean, then centred squares) and
// block reductions (warp shuffles, then one shared-memory step read in a fixed order).
//
// dual_norm backward: a grid of blocks strides over rows; per row it recomputes the
// normalized values from the saved statistics and reduces the three norms' backward terms
// in two block reductions. Weight gradients accumulate per thread in fp32 registers over all
// rows a block visits, are written as per-block partials and summed over blocks in block
// order by a finalize kernel: deterministic.
//
// dual_residual: element-wise, vectorized when aligned; the bias gradient is a column sum.
//
// These are the "verified" generation (they passed every CUDA test on an H200, 2026-12-01)
// and the default. MEGATRON_SIAMESE_CUDA_KERNELS=tiled routes every op to the tiled kernels
// (tiled_kernels.cu) where they cover the row, and to the general kernels
// (general_kernels.cuh) elsewhere: CudaAccKernels::* at the end of this file.
//
// hybrid_dual_norm (NormWeights::channel_scale) runs the general kernels under both
// generations: the verified ones stay exactly as the GPU run verified them, and a runtime
// branch for it in the tiled backward changed the standard op's registers (ptxas: 41 of the 48
// sm_90 backward instantiations grew, by up to 28), so it waits for instantiations of its own
// (docs/kernels.md).
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <map>
#include <mutex>
#include <tuple>
#include <type_traits>

#include "dual_norm.h"
#include "general_kernels.cuh"
#include "general_launch.h"
#include "tiled_kernels.h"

namespace megatron_siamese {
namespace {

constexpr int kWarp = 32;
constexpr int kMaxThreads = 1024;
constexpr int kMaxPerThread = 32;  // elements of a row one thread holds

template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Pack {
  T v[VEC];
};

// Loads VEC consecutive elements starting at row[e] as A; elements at or past n read as 0.
template <typename T, typename A, int VEC>
__device__ __forceinline__ void load(const T* row, int64_t e, int64_t n, A* out) {
  if (VEC > 1 && e + VEC <= n) {
    Pack<T, VEC> p = *reinterpret_cast<const Pack<T, VEC>*>(row + e);
#pragma unroll
    for (int k = 0; k < VEC; ++k) out[k] = static_cast<A>(p.v[k]);
  } else {
#pragma unroll
    for (int k = 0; k < VEC; ++k) out[k] = e + k < n ? static_cast<A>(row[e + k]) : A(0);
  }
}

template <typename T, typename A, int VEC>
__device__ __forceinline__ void store(T* row, int64_t e, int64_t n, const A* in) {
  if (VEC > 1 && e + VEC <= n) {
    Pack<T, VEC> p;
#pragma unroll
    for (int k = 0; k < VEC; ++k) p.v[k] = static_cast<T>(in[k]);
    *reinterpret_cast<Pack<T, VEC>*>(row + e) = p;
  } else {
#pragma unroll
    for (int k = 0; k < VEC; ++k)
      if (e + k < n) row[e + k] = static_cast<T>(in[k]);
  }
}

// Sums K values over the block; every thread gets the totals (summed in a fixed order).
template <typename A, int K>
__device__ __forceinline__ void block_sum(A (&v)[K], A* shared /* [kWarp * K] */) {
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset /= 2)
#pragma unroll
    for (int k = 0; k < K; ++k) v[k] += __shfl_xor_sync(0xffffffff, v[k], offset);
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, warps = blockDim.x / kWarp;
  __syncthreads();  // the previous reduction's readers are done with `shared`
  if (lane == 0)
#pragma unroll
    for (int k = 0; k < K; ++k) shared[warp * K + k] = v[k];
  __syncthreads();
#pragma unroll
  for (int k = 0; k < K; ++k) {
    v[k] = A(0);
    for (int w = 0; w < warps; ++w) v[k] += shared[w * K + k];
  }
}

template <typename A>
struct Params : WeightPointers<A> {
  bool rms, input_norm, packed;
  int64_t rows, hidden;
  A eps;
};

template <typename A>
__device__ __forceinline__ A weight_at(const A* w, int64_t e, int64_t n, A fallback) {
  return w != nullptr && e < n ? w[e] : fallback;
}

// -- dual_norm forward ---------------------------------------------------------------------

template <typename T, typename A, int VEC, int ITERS>
__global__ void dual_norm_forward_kernel(const T* __restrict__ streams, Params<A> p, T* __restrict__ base,
                                         T* __restrict__ normed, A* __restrict__ stats) {
  __shared__ A shared[kWarp * 2];
  const int64_t h = p.hidden, width = p.packed ? 2 * h : h;
  for (int64_t r = blockIdx.x; r < p.rows; r += gridDim.x) {
    const T* x = streams + r * width;
    const T* y = p.packed ? x + h : x;
    A xr[ITERS][VEC], yr[ITERS][VEC];
    A sums[2] = {A(0), A(0)};
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      const int64_t e = (int64_t(it) * blockDim.x + threadIdx.x) * VEC;
      load<T, A, VEC>(x, e, h, xr[it]);
      load<T, A, VEC>(y, e, h, yr[it]);
#pragma unroll
      for (int k = 0; k < VEC; ++k) sums[0] += xr[it][k], sums[1] += yr[it][k];
    }
    A mx = A(0), my = A(0);
    if (!p.rms) {
      block_sum<A, 2>(sums, shared);
      mx = sums[0] / h, my = sums[1] / h;
    }
    A squares[2] = {A(0), A(0)};
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      const int64_t e = (int64_t(it) * blockDim.x + threadIdx.x) * VEC;
#pragma unroll
      for (int k = 0; k < VEC; ++k)
        if (e + k < h) {
          const A cx = xr[it][k] - mx, cy = yr[it][k] - my;
          squares[0] += cx * cx, squares[1] += cy * cy;
        }
    }
    block_sum<A, 2>(squares, shared);
    const A rx = A(1) / sqrt(squares[0] / h + p.eps), ry = A(1) / sqrt(squares[1] / h + p.eps);
    T* base_row = base + r * 2 * h;
    A suma[1] = {A(0)};
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      const int64_t e0 = (int64_t(it) * blockDim.x + threadIdx.x) * VEC;
      store<T, A, VEC>(base_row + h, e0, h, yr[it]);  // the identity path's base: y itself
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const int64_t e = e0 + k;
        const A u = (xr[it][k] - mx) * rx * weight_at(p.gx, e, h, A(1)) + weight_at(p.bx, e, h, A(0));
        const A yn = (yr[it][k] - my) * ry * weight_at(p.gy, e, h, A(1)) + weight_at(p.by, e, h, A(0));
        xr[it][k] = u;
        yr[it][k] = e < h ? u + yn : A(0);  // a
        suma[0] += yr[it][k];
      }
      store<T, A, VEC>(base_row, e0, h, xr[it]);
    }
    A ma = A(0), ra = A(0);
    if (p.input_norm) {
      if (!p.rms) {
        block_sum<A, 1>(suma, shared);
        ma = suma[0] / h;
      }
      A sq[1] = {A(0)};
#pragma unroll
      for (int it = 0; it < ITERS; ++it) {
        const int64_t e = (int64_t(it) * blockDim.x + threadIdx.x) * VEC;
#pragma unroll
        for (int k = 0; k < VEC; ++k)
          if (e + k < h) sq[0] += (yr[it][k] - ma) * (yr[it][k] - ma);
      }
      block_sum<A, 1>(sq, shared);
      ra = A(1) / sqrt(sq[0] / h + p.eps);
#pragma unroll
      for (int it = 0; it < ITERS; ++it) {
        const int64_t e0 = (int64_t(it) * blockDim.x + threadIdx.x) * VEC;
#pragma unroll
        for (int k = 0; k < VEC; ++k)
          yr[it][k] = (yr[it][k] - ma) * ra * weight_at(p.gi, e0 + k, h, A(1)) + weight_at(p.bi, e0 + k, h, A(0));
      }
    }
#pragma unroll
    for (int it = 0; it < ITERS; ++it)
      store<T, A, VEC>(normed + r * h, (int64_t(it) * blockDim.x + threadIdx.x) * VEC, h, yr[it]);
    if (threadIdx.x == 0) {
      A* s = stats + r * kStatsPerRow;
      s[0] = mx, s[1] = rx, s[2] = my, s[3] = ry, s[4] = ma, s[5] = ra;
    }
  }
}

// -- dual_norm backward --------------------------------------------------------------------

template <typename T, typename A, int VEC, int ITERS>
__global__ void dual_norm_backward_kernel(const T* __restrict__ grad_base, const T* __restrict__ grad_normed,
                                          const T* __restrict__ streams, const A* __restrict__ stats,
                                          Params<A> p, T* __restrict__ grad_streams,
                                          A* __restrict__ partials /* [gridDim.x, 6, h] */) {
  __shared__ A shared[kWarp * 4];
  const int64_t h = p.hidden, width = p.packed ? 2 * h : h;
  A acc[6][ITERS][VEC];
#pragma unroll
  for (int w = 0; w < 6; ++w)
#pragma unroll
    for (int it = 0; it < ITERS; ++it)
#pragma unroll
      for (int k = 0; k < VEC; ++k) acc[w][it][k] = A(0);

  for (int64_t r = blockIdx.x; r < p.rows; r += gridDim.x) {
    const A* s = stats + r * kStatsPerRow;
    const A mx = s[0], rx = s[1], my = s[2], ry = s[3], ma = s[4], ra = s[5];
    const T* x = streams + r * width;
    const T* y = p.packed ? x + h : x;
    A nx[ITERS][VEC], ny[ITERS][VEC], ga[ITERS][VEC], gu[ITERS][VEC];
    A red[2] = {A(0), A(0)};
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      const int64_t e0 = (int64_t(it) * blockDim.x + threadIdx.x) * VEC;
      load<T, A, VEC>(x, e0, h, nx[it]);
      load<T, A, VEC>(y, e0, h, ny[it]);
      load<T, A, VEC>(grad_normed + r * h, e0, h, ga[it]);
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const int64_t e = e0 + k;
        nx[it][k] = e < h ? (nx[it][k] - mx) * rx : A(0);
        ny[it][k] = e < h ? (ny[it][k] - my) * ry : A(0);
        if (p.input_norm) {
          const A u = nx[it][k] * weight_at(p.gx, e, h, A(1)) + weight_at(p.bx, e, h, A(0));
          const A yn = ny[it][k] * weight_at(p.gy, e, h, A(1)) + weight_at(p.by, e, h, A(0));
          const A na = e < h ? (u + yn - ma) * ra : A(0);
          acc[4][it][k] += ga[it][k] * na;
          acc[5][it][k] += ga[it][k];
          const A t = ga[it][k] * weight_at(p.gi, e, h, A(1));
          red[0] += t, red[1] += t * na;
          gu[it][k] = na;  // kept until the input norm's backward below
        }
      }
    }
    if (p.input_norm) {
      block_sum<A, 2>(red, shared);
      const A mean_t = p.rms ? A(0) : red[0] / h, mean_tn = red[1] / h;
#pragma unroll
      for (int it = 0; it < ITERS; ++it) {
        const int64_t e0 = (int64_t(it) * blockDim.x + threadIdx.x) * VEC;
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          const A t = ga[it][k] * weight_at(p.gi, e0 + k, h, A(1));
          // dL/da; zero past the row's end, where -ra * mean_t would leak into the reductions below
          ga[it][k] = e0 + k < h ? ra * (t - mean_t - gu[it][k] * mean_tn) : A(0);
        }
      }
    }
    // dL/du = residual-path gradient + dL/da; PreNorm(y)'s output gradient is dL/da
    A red4[4] = {A(0), A(0), A(0), A(0)};
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      const int64_t e0 = (int64_t(it) * blockDim.x + threadIdx.x) * VEC;
      load<T, A, VEC>(grad_base + r * 2 * h, e0, h, gu[it]);
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const int64_t e = e0 + k;
        gu[it][k] += ga[it][k];
        acc[0][it][k] += gu[it][k] * nx[it][k];
        acc[1][it][k] += gu[it][k];
        acc[2][it][k] += ga[it][k] * ny[it][k];
        acc[3][it][k] += ga[it][k];
        const A tx = gu[it][k] * weight_at(p.gx, e, h, A(1));
        const A ty = ga[it][k] * weight_at(p.gy, e, h, A(1));
        red4[0] += tx, red4[1] += tx * nx[it][k], red4[2] += ty, red4[3] += ty * ny[it][k];
      }
    }
    block_sum<A, 4>(red4, shared);
    const A mtx = p.rms ? A(0) : red4[0] / h, mtnx = red4[1] / h;
    const A mty = p.rms ? A(0) : red4[2] / h, mtny = red4[3] / h;
    T* out = grad_streams + r * width;
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      const int64_t e0 = (int64_t(it) * blockDim.x + threadIdx.x) * VEC;
      A gy_id[VEC], gx_in[VEC], gy_in[VEC];
      load<T, A, VEC>(grad_base + r * 2 * h + h, e0, h, gy_id);
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const int64_t e = e0 + k;
        const A tx = gu[it][k] * weight_at(p.gx, e, h, A(1));
        const A ty = ga[it][k] * weight_at(p.gy, e, h, A(1));
        gx_in[k] = rx * (tx - mtx - nx[it][k] * mtnx);
        gy_in[k] = ry * (ty - mty - ny[it][k] * mtny) + gy_id[k];
        if (!p.packed) gx_in[k] += gy_in[k];
      }
      store<T, A, VEC>(out, e0, h, gx_in);
      if (p.packed) store<T, A, VEC>(out + h, e0, h, gy_in);
    }
  }
  A* part = partials + int64_t(blockIdx.x) * 6 * h;
#pragma unroll
  for (int w = 0; w < 6; ++w)
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      const int64_t e0 = (int64_t(it) * blockDim.x + threadIdx.x) * VEC;
#pragma unroll
      for (int k = 0; k < VEC; ++k)
        if (e0 + k < h) part[w * h + e0 + k] = acc[w][it][k];
    }
}

template <typename A>
__global__ void sum_partials_kernel(const A* __restrict__ partials, int64_t blocks, int64_t columns,
                                    A* __restrict__ out) {
  const int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= columns) return;
  A total = A(0);
  for (int64_t b = 0; b < blocks; ++b) total += partials[b * columns + c];  // block order
  out[c] = total;
}

// -- dual_residual -------------------------------------------------------------------------

template <typename T, typename A>
__global__ void dual_residual_kernel(const T* __restrict__ base, const T* __restrict__ out,
                                     const A* __restrict__ bias, const bool* __restrict__ mask, A scale,
                                     A inv_c, int64_t rows, int64_t h, T* __restrict__ packed) {
  const int64_t n = rows * h;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / h, c = i % h;
    A z = static_cast<A>(out[i]) + (bias ? bias[c] : A(0));
    if (mask) z = mask[i] ? z * scale : A(0);
    const int64_t b = r * 2 * h + c;
    packed[b] = static_cast<T>(static_cast<A>(base[b]) + z * inv_c);
    packed[b + h] = static_cast<T>(static_cast<A>(base[b + h]) + z);
  }
}

template <typename T, typename A>
__global__ void dual_residual_backward_kernel(const T* __restrict__ grad, const bool* __restrict__ mask, A scale,
                                              A inv_c, int64_t rows, int64_t h, T* __restrict__ grad_out) {
  const int64_t n = rows * h;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / h, c = i % h, b = r * 2 * h + c;
    A gz = static_cast<A>(grad[b]) * inv_c + static_cast<A>(grad[b + h]);
    if (mask) gz = mask[i] ? gz * scale : A(0);
    grad_out[i] = static_cast<T>(gz);
  }
}

// -- launch helpers ------------------------------------------------------------------------

struct Launch {
  int vec, iters, threads;
};

// Calls f.template operator()<VEC, ITERS>() for the configuration `launch` names.
template <typename T, typename F>
void dispatch_plan(const Launch& launch, F&& f) {
  constexpr int V = 16 / sizeof(T);
#define SIAMESE_CASE(VEC_, ITERS_) \
  if (launch.vec == VEC_ && launch.iters == ITERS_) return f.template operator()<VEC_, ITERS_>();
  if constexpr (V == 8) { SIAMESE_CASE(8, 1) SIAMESE_CASE(8, 2) SIAMESE_CASE(8, 4) }
  if constexpr (V == 4) { SIAMESE_CASE(4, 2) SIAMESE_CASE(4, 4) SIAMESE_CASE(4, 8) }
  if constexpr (V == 2) { SIAMESE_CASE(2, 4) SIAMESE_CASE(2, 8) SIAMESE_CASE(2, 16) }
  SIAMESE_CASE(1, 8) SIAMESE_CASE(1, 16) SIAMESE_CASE(1, 32)
#undef SIAMESE_CASE
  TORCH_CHECK(false, "dual_norm (CUDA): no kernel for vec=", launch.vec, " iters=", launch.iters);
}

// The most threads a block of `kernel` may have on the current device: its register use can
// make that fewer than kMaxThreads (a larger launch fails with "too many resources requested").
template <typename Kernel>
int block_limit(Kernel* kernel) {
  static std::mutex mutex;
  static std::map<std::pair<int, const void*>, int> cache;  // driver queries, once per device and kernel
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  std::lock_guard<std::mutex> lock(mutex);
  const auto key = std::make_pair(device, reinterpret_cast<const void*>(kernel));
  if (auto found = cache.find(key); found != cache.end()) return found->second;
  cudaFuncAttributes attributes;
  C10_CUDA_CHECK(cudaFuncGetAttributes(&attributes, kernel));
  return cache[key] = std::min(kMaxThreads, attributes.maxThreadsPerBlock / kWarp * kWarp);
}

// Blocks of `kernel` resident on one multiprocessor at `threads` threads: each works on one row
// at a time, so this is how many rows an SM has in flight to hide memory latency.
template <typename Kernel>
int resident_blocks(Kernel* kernel, int threads) {
  static std::mutex mutex;
  static std::map<std::tuple<int, const void*, int>, int> cache;
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  std::lock_guard<std::mutex> lock(mutex);
  const auto key = std::make_tuple(device, reinterpret_cast<const void*>(kernel), threads);
  if (auto found = cache.find(key); found != cache.end()) return found->second;
  int blocks = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, threads, 0));
  return cache[key] = blocks;
}

// How plan() picks among the chunkings that can launch a row-wide block. Measured on an H200
// (docs/kernels.md): the forward gains from more rows in flight per SM (16384x4096 bf16:
// 1.33 -> 0.92 ms); the backward loses when that means its spilling configurations (2.19 ->
// 2.51 ms), so it takes the fewest elements per thread that launch (spilling only where
// nothing else launches: h > 4096).
enum class Choose { kMostRowsInFlight, kFewestPerThread };

// Vector width from alignment; then, among the register chunkings (8, 16 or 32 elements per
// thread) whose kernel can launch a block wide enough for the row, the one `choose` prefers
// (ties: fewer elements per thread, fewer registers). `kernel_for(vec, iters)`, given both as
// std::integral_constant, returns that configuration's kernel instantiation.
template <typename T, typename KernelFor>
Launch verified_plan(int64_t hidden, std::initializer_list<const void*> pointers, Choose choose, KernelFor&& kernel_for) {
  int vec = 16 / sizeof(T);
  bool aligned = hidden % vec == 0;
  for (const void* ptr : pointers) aligned = aligned && reinterpret_cast<uintptr_t>(ptr) % 16 == 0;
  if (!aligned) vec = 1;
  Launch best{0, 0, 0};
  int best_blocks = 0;
  for (int iters = std::max(1, 8 / vec); iters * vec <= kMaxPerThread; iters *= 2) {
    const int64_t per_thread = int64_t(iters) * vec;
    int threads = static_cast<int>((hidden + per_thread - 1) / per_thread);
    threads = std::max(kWarp, (threads + kWarp - 1) / kWarp * kWarp);
    const Launch launch{vec, iters, threads};
    int blocks = 0;
    dispatch_plan<T>(launch, [&]<int VEC, int ITERS>() {
      auto* kernel = kernel_for(std::integral_constant<int, VEC>{}, std::integral_constant<int, ITERS>{});
      if (threads <= block_limit(kernel)) blocks = resident_blocks(kernel, threads);
    });
    if (blocks > best_blocks) best = launch, best_blocks = blocks;
    if (best_blocks > 0 && choose == Choose::kFewestPerThread) break;
  }
  TORCH_CHECK(best_blocks > 0, "dual_norm (CUDA): hidden size ", hidden,
              " is larger than the verified kernels support on this device; set ", kCudaKernelsVariable,
              "=tiled (any width; not yet verified on a GPU) or use the PyTorch path (siamese_fused_ops=False)");
  return best;
}

template <typename A>
Params<A> make_params(const NormWeights& w, const StreamRows& g, double eps) {
  return Params<A>{pointers_of<A>(w), w.rms, w.has_input_norm(), g.packed, g.rows, g.hidden, static_cast<A>(eps)};
}

using general::current_device;

int grid_for_rows(int64_t rows) {
  const int sms = tiled::device_limits(current_device()).sms;  // cached per device
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(rows, int64_t(sms) * 8)));
}

// -- the tiled generation ------------------------------------------------------------------

// The tiled kernels' element type for `t`, or false for double (general kernels only).
bool tiled_type(at::ScalarType t, tiled::DType& out) {
  switch (t) {
    case at::kFloat: out = tiled::DType::kFloat; return true;
    case at::kBFloat16: out = tiled::DType::kBFloat16; return true;
    case at::kHalf: out = tiled::DType::kHalf; return true;
    default: return false;
  }
}

const float* float_or_null(const torch::Tensor& t) { return t.defined() ? t.data_ptr<float>() : nullptr; }
const bool* mask_or_null(const torch::Tensor& mask) { return mask.defined() ? mask.data_ptr<bool>() : nullptr; }

// The general residual kernels: elementwise, 256-thread blocks over the elements, on the current stream.
template <typename Kernel, typename... Args>
void launch_elementwise(Kernel kernel, int64_t elements, Args... args) {
  kernel<<<general::element_grid(elements), 256, 0, c10::cuda::getCurrentCUDAStream()>>>(args...);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

tiled::NormArgs tiled_args(const torch::Tensor& streams, const StreamRows& g, const NormWeights& w, double eps) {
  tiled::NormArgs a;
  a.streams = streams.data_ptr();
  a.rows = g.rows, a.hidden = static_cast<int>(g.hidden), a.packed = g.packed, a.rms = w.rms;
  a.eps = static_cast<float>(eps);
  a.gx = float_or_null(w.x_gamma), a.bx = float_or_null(w.x_beta), a.gy = float_or_null(w.y_gamma);
  a.by = float_or_null(w.y_beta), a.gi = float_or_null(w.in_gamma), a.bi = float_or_null(w.in_beta);
  return a;
}

bool tiled_fits(const StreamRows& g, tiled::DType t, const tiled::NormArgs& a,
                std::initializer_list<const void*> tensors) {
  if (g.hidden > (int64_t(1) << 30)) return false;
  return tiled::aligned(t, g.hidden, tensors) && tiled::aligned(t, g.hidden, {a.gx, a.bx, a.gy, a.by, a.gi, a.bi});
}

template <typename A>
general::Params<A> general_params(const NormWeights& w, const StreamRows& g, double eps) {
  const WeightPointers<A> p = pointers_of<A>(w);
  return general::Params<A>{p.gx, p.bx, p.gy, p.by, p.gi, p.bi, g.rows, g.hidden, g.packed, w.rms, w.channel_scale,
                            w.base_keeps_x(), static_cast<A>(eps)};
}

}  // namespace

namespace general {
int current_device() {
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  return device;
}

int row_grid(int64_t rows) { return static_cast<int>(std::min<int64_t>(rows, 65535 * 32)); }

int element_grid(int64_t elements) { return static_cast<int>(std::min<int64_t>((elements + 255) / 256, 65535)); }

Strips weight_grad_strips(int64_t rows, int64_t hidden) {
  const int64_t column_blocks = (hidden + kWarp - 1) / kWarp;
  const int64_t sms = tiled::device_limits(current_device()).sms;
  const int64_t wanted = std::max<int64_t>(1, sms * 8 / column_blocks);
  const int64_t max_strips = std::min<int64_t>((rows + kLanes - 1) / kLanes, 65535);
  const int64_t rows_per_strip = (rows + std::min(wanted, max_strips) - 1) / std::min(wanted, max_strips);
  return {column_blocks, (rows + rows_per_strip - 1) / rows_per_strip, rows_per_strip};
}

void sum_parts(const torch::Tensor& partials, int64_t parts, int64_t columns, torch::Tensor& out) {
  SIAMESE_DISPATCH(out.scalar_type(), "sum_parts_cuda", [&] {
    sum_parts_kernel<scalar_t><<<static_cast<int>((columns + 255) / 256), 256, 0, c10::cuda::getCurrentCUDAStream()>>>(
        partials.data_ptr<scalar_t>(), parts, columns, out.data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}
}  // namespace general

namespace {

void general_forward(const torch::Tensor& streams, const StreamRows& g, const NormWeights& w, double eps,
                     torch::Tensor& base, torch::Tensor& normed, torch::Tensor& stats) {
  SIAMESE_DISPATCH(streams.scalar_type(), "dual_norm_cuda_general", [&] {
    using A = at::opmath_type<scalar_t>;
    general::forward_kernel<scalar_t, A><<<general::row_grid(g.rows), general::kThreads, 0,
                                           c10::cuda::getCurrentCUDAStream()>>>(
        streams.data_ptr<scalar_t>(), general_params<A>(w, g, eps),
        base.defined() ? base.data_ptr<scalar_t>() : nullptr, normed.data_ptr<scalar_t>(), stats.data_ptr<A>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

void general_backward(const torch::Tensor& grad_base, const torch::Tensor& grad_normed, const torch::Tensor& streams,
                      const torch::Tensor& stats, const StreamRows& g, const NormWeights& w,
                      torch::Tensor& grad_streams, torch::Tensor& weight_grads) {
  SIAMESE_DISPATCH(streams.scalar_type(), "dual_norm_backward_cuda_general", [&] {
    using A = at::opmath_type<scalar_t>;
    const auto params = general_params<A>(w, g, 0.0);
    auto stream = c10::cuda::getCurrentCUDAStream();
    auto terms = torch::empty({g.rows, 2}, weight_grads.options());
    const scalar_t* gb = grad_base.defined() ? grad_base.data_ptr<scalar_t>() : nullptr;
    const int64_t base_width = grad_base.defined() ? grad_base.size(-1) : 0;
    general::backward_rows_kernel<scalar_t, A><<<general::row_grid(g.rows), general::kThreads, 0, stream>>>(
        gb, base_width, grad_normed.data_ptr<scalar_t>(), streams.data_ptr<scalar_t>(), stats.data_ptr<A>(), params,
        grad_streams.data_ptr<scalar_t>(), terms.data_ptr<A>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    const general::Strips strips = general::weight_grad_strips(g.rows, g.hidden);
    auto partials = torch::empty({strips.strips * general::kLanes, 6, g.hidden}, weight_grads.options());
    general::weight_grad_kernel<scalar_t, A><<<dim3(strips.column_blocks, strips.strips),
                                               dim3(general::kWarp, general::kLanes), 0, stream>>>(
        gb, base_width, grad_normed.data_ptr<scalar_t>(), streams.data_ptr<scalar_t>(), stats.data_ptr<A>(),
        terms.data_ptr<A>(), params, strips.rows_per_strip, partials.data_ptr<A>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    general::sum_parts(partials, strips.strips * general::kLanes, 6 * g.hidden, weight_grads);
  });
}

// The tiled generation's ops: tiled kernels where they cover the row, general ones elsewhere.
void tiled_dual_norm(const torch::Tensor& streams, const StreamRows& g, const NormWeights& w, double eps,
                     torch::Tensor& base, torch::Tensor& normed, torch::Tensor& stats) {
  tiled::DType t;
  if (tiled_type(streams.scalar_type(), t)) {
    const tiled::NormArgs a = tiled_args(streams, g, w, eps);
    if (tiled_fits(g, t, a, {streams.data_ptr(), base.data_ptr(), normed.data_ptr()})) {
      const int device = current_device();
      const plan::Plan p = tiled::plan_forward(t, a, device);
      if (p.tiled) {
        tiled::forward(p, t, a, base.data_ptr(), normed.data_ptr(), stats.data_ptr<float>(), device,
                       c10::cuda::getCurrentCUDAStream());
        return;
      }
    }
  }
  general_forward(streams, g, w, eps, base, normed, stats);
}

void tiled_dual_norm_backward(const torch::Tensor& grad_base, const torch::Tensor& grad_normed,
                              const torch::Tensor& streams, const torch::Tensor& stats, const StreamRows& g,
                              const NormWeights& w, torch::Tensor& grad_streams, torch::Tensor& weight_grads) {
  tiled::DType t;
  if (tiled_type(streams.scalar_type(), t)) {
    const tiled::NormArgs a = tiled_args(streams, g, w, 0.0);
    if (tiled_fits(g, t, a, {grad_base.data_ptr(), grad_normed.data_ptr(), streams.data_ptr(), grad_streams.data_ptr()})) {
      const int device = current_device();
      const plan::Plan p = tiled::plan_backward(t, a, device);
      if (p.tiled) {
        auto partials = torch::empty({tiled::backward_parts(p), tiled::backward_accumulators(a), g.hidden},
                                     weight_grads.options());
        tiled::backward(p, t, a, grad_base.data_ptr(), grad_normed.data_ptr(), stats.data_ptr<float>(),
                        grad_streams.data_ptr(), partials.data_ptr<float>(), weight_grads.data_ptr<float>(),
                        device, c10::cuda::getCurrentCUDAStream());
        return;
      }
    }
  }
  general_backward(grad_base, grad_normed, streams, stats, g, w, grad_streams, weight_grads);
}

// dual_residual's tiled kernels take aligned rows; the verified element-wise kernels are
// already general (any shape, any dtype) and serve the rest.
bool tiled_residual_fits(const torch::Tensor& t, int64_t h, tiled::DType& type,
                         std::initializer_list<const torch::Tensor*> tensors) {
  if (!tiled_type(t.scalar_type(), type) || h > (int64_t(1) << 30)) return false;
  for (const torch::Tensor* x : tensors)
    if (x->defined() && !tiled::aligned(type, h, {x->data_ptr()})) return false;
  return true;
}


}  // namespace

// -- launchers -----------------------------------------------------------------------------

void CudaAccKernels::dual_norm(const torch::Tensor& streams, const StreamRows& g, const NormWeights& w, double eps,
                            torch::Tensor& base, torch::Tensor& normed, torch::Tensor& stats) {
  const c10::cuda::CUDAGuard guard(streams.device());
  const KernelGeneration generation = cuda_kernel_generation();  // checks the setting for every op
  // the hybrid and entry ops run the general kernels under both generations (docs/kernels.md)
  if (w.channel_scale || w.base_is_streams) return general_forward(streams, g, w, eps, base, normed, stats);
  if (generation == KernelGeneration::kTiled) return tiled_dual_norm(streams, g, w, eps, base, normed, stats);
  SIAMESE_DISPATCH(streams.scalar_type(), "dual_norm_cuda", [&] {
    using A = at::opmath_type<scalar_t>;
    const Params<A> params = make_params<A>(w, g, eps);
    const Launch launch = verified_plan<scalar_t>(g.hidden, {streams.data_ptr(), base.data_ptr(), normed.data_ptr()},
                                         Choose::kMostRowsInFlight, [](auto vec, auto iters) { return dual_norm_forward_kernel<scalar_t, A, vec(), iters()>; });
    const int grid = static_cast<int>(std::min<int64_t>(g.rows, 65535 * 32));
    auto stream = c10::cuda::getCurrentCUDAStream();
    dispatch_plan<scalar_t>(launch, [&]<int VEC, int ITERS>() {
      dual_norm_forward_kernel<scalar_t, A, VEC, ITERS><<<grid, launch.threads, 0, stream>>>(
          streams.data_ptr<scalar_t>(), params, base.data_ptr<scalar_t>(), normed.data_ptr<scalar_t>(),
          stats.data_ptr<A>());
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

void CudaAccKernels::dual_norm_backward(const torch::Tensor& grad_base, const torch::Tensor& grad_normed,
                                     const torch::Tensor& streams, const torch::Tensor& stats, const StreamRows& g,
                                     const NormWeights& w, torch::Tensor& grad_streams, torch::Tensor& weight_grads) {
  const c10::cuda::CUDAGuard guard(streams.device());
  const KernelGeneration generation = cuda_kernel_generation();
  if (w.channel_scale || w.base_is_streams)
    return general_backward(grad_base, grad_normed, streams, stats, g, w, grad_streams, weight_grads);
  if (generation == KernelGeneration::kTiled)
    return tiled_dual_norm_backward(grad_base, grad_normed, streams, stats, g, w, grad_streams, weight_grads);
  SIAMESE_DISPATCH(streams.scalar_type(), "dual_norm_backward_cuda", [&] {
    using A = at::opmath_type<scalar_t>;
    const Params<A> params = make_params<A>(w, g, 0.0);
    const Launch launch = verified_plan<scalar_t>(
        g.hidden, {grad_base.data_ptr(), grad_normed.data_ptr(), streams.data_ptr(), grad_streams.data_ptr()},
        Choose::kFewestPerThread, [](auto vec, auto iters) { return dual_norm_backward_kernel<scalar_t, A, vec(), iters()>; });
    const int grid = grid_for_rows(g.rows);
    auto partials = torch::empty({grid, 6, g.hidden}, weight_grads.options());
    auto stream = c10::cuda::getCurrentCUDAStream();
    dispatch_plan<scalar_t>(launch, [&]<int VEC, int ITERS>() {
      dual_norm_backward_kernel<scalar_t, A, VEC, ITERS><<<grid, launch.threads, 0, stream>>>(
          grad_base.data_ptr<scalar_t>(), grad_normed.data_ptr<scalar_t>(), streams.data_ptr<scalar_t>(),
          stats.data_ptr<A>(), params, grad_streams.data_ptr<scalar_t>(), partials.data_ptr<A>());
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    const int64_t columns = 6 * g.hidden;
    sum_partials_kernel<A><<<static_cast<int>((columns + 255) / 256), 256, 0, stream>>>(
        partials.data_ptr<A>(), grid, columns, weight_grads.data_ptr<A>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

void CudaAccKernels::dual_residual(const torch::Tensor& base, const torch::Tensor& out, const torch::Tensor& bias,
                                const torch::Tensor& mask, double scale, double inv_c, torch::Tensor& packed) {
  const c10::cuda::CUDAGuard guard(out.device());
  const int64_t h = out.size(-1), rows = out.numel() / h;
  tiled::DType type;
  if (cuda_kernel_generation() == KernelGeneration::kTiled && tiled_residual_fits(out, h, type, {&base, &out, &bias, &mask, &packed})) {
    tiled::residual(type, base.data_ptr(), out.data_ptr(), float_or_null(bias), mask_or_null(mask),
                    static_cast<float>(scale), static_cast<float>(inv_c), rows, static_cast<int>(h),
                    packed.data_ptr(), c10::cuda::getCurrentCUDAStream());
    return;
  }
  SIAMESE_DISPATCH(out.scalar_type(), "dual_residual_cuda", [&] {
    using A = at::opmath_type<scalar_t>;
    launch_elementwise(dual_residual_kernel<scalar_t, A>, rows * h, base.data_ptr<scalar_t>(),
                       out.data_ptr<scalar_t>(), bias.defined() ? bias.data_ptr<A>() : nullptr, mask_or_null(mask),
                       static_cast<A>(scale), static_cast<A>(inv_c), rows, h, packed.data_ptr<scalar_t>());
  });
}

// Launched as dual_residual is: tiled kernels where they fit, else the general ones.
void CudaAccKernels::dual_residual_backward(const torch::Tensor& grad, const torch::Tensor& mask, double scale,
                                         double inv_c, torch::Tensor& grad_out, torch::Tensor& grad_bias) {
  const c10::cuda::CUDAGuard guard(grad.device());
  const int64_t h = grad_out.size(-1), rows = grad_out.numel() / h;
  tiled::DType type;
  if (cuda_kernel_generation() == KernelGeneration::kTiled && tiled_residual_fits(grad, h, type, {&grad, &mask, &grad_out})) {
    const int device = current_device();
    torch::Tensor partials;
    if (grad_bias.defined())
      partials = torch::empty({tiled::residual_backward_parts(rows, static_cast<int>(h), type, device), h},
                              grad_bias.options());
    tiled::residual_backward(type, grad.data_ptr(), mask_or_null(mask), static_cast<float>(scale), static_cast<float>(inv_c), rows, static_cast<int>(h),
                             grad_out.data_ptr(), partials.defined() ? partials.data_ptr<float>() : nullptr,
                             grad_bias.defined() ? grad_bias.data_ptr<float>() : nullptr, device,
                             c10::cuda::getCurrentCUDAStream());
    return;
  }
  SIAMESE_DISPATCH(grad.scalar_type(), "dual_residual_backward_cuda", [&] {
    using A = at::opmath_type<scalar_t>;
    launch_elementwise(dual_residual_backward_kernel<scalar_t, A>, rows * h, grad.data_ptr<scalar_t>(),
                       mask_or_null(mask), static_cast<A>(scale), static_cast<A>(inv_c), rows, h,
                       grad_out.data_ptr<scalar_t>());
  });
  // a column sum in the accumulation type: ATen's reduction is deterministic
  if (grad_bias.defined()) grad_bias.copy_(grad_out.view({rows, h}).to(grad_bias.scalar_type()).sum(0));
}

}  // namespace megatron_siamese
