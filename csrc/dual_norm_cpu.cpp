// CPU kernels for the SiameseNorm fused ops.
//
// Rows are processed independently with at::parallel_for; all math runs in the accumulation
// type (fp32; fp64 for double inputs) with at::vec::Vectorized. The forward reads 16-bit rows
// straight into fp32 vectors; the backward converts each row once into fp32 scratch. Weight
// gradients are summed per fixed block of rows into fp32 partials and the partials are added
// in block order, so results are deterministic for a given thread count (and do not depend on
// which thread ran which block).
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <vector>

#include "dual_norm.h"

namespace megatron_siamese {
namespace {

// All math runs in the accumulation type A: float for float/bfloat16/half inputs, double
// for double (used by the fp64 gradcheck).

// 16-bit rows to and from fp32 with vector conversions: at::vec::convert has vectorized
// float -> bfloat16/half paths but converts bfloat16/half -> float one scalar at a time,
// which made the 16-bit kernels compute-bound.
template <typename T, typename A>
inline void load_row(A* dst, const T* src, int64_t n) {
  if constexpr (at::vec::is_reduced_floating_point_v<T> && std::is_same_v<A, float>) {
    using VecT = at::vec::Vectorized<T>;
    using VecA = at::vec::Vectorized<A>;
    int64_t i = 0;
    for (; i + VecT::size() <= n; i += VecT::size()) {
      auto [lo, hi] = at::vec::convert_to_float<T>(VecT::loadu(src + i));
      lo.store(dst + i);
      hi.store(dst + i + VecA::size());
    }
    for (; i < n; ++i) dst[i] = static_cast<A>(src[i]);
  } else {
    at::vec::convert(src, dst, n);
  }
}

template <typename T, typename A>
inline void store_row(T* dst, const A* src, int64_t n) {
  if constexpr (at::vec::is_reduced_floating_point_v<T> && std::is_same_v<A, float>) {
    using VecT = at::vec::Vectorized<T>;
    using VecA = at::vec::Vectorized<A>;
    int64_t i = 0;
    for (; i + VecT::size() <= n; i += VecT::size()) {
      at::vec::convert_from_float<T>(VecA::loadu(src + i), VecA::loadu(src + i + VecA::size()))
          .store(dst + i);
    }
    for (; i < n; ++i) dst[i] = static_cast<T>(src[i]);
  } else {
    at::vec::convert(src, dst, n);
  }
}

// A row as A values: the row itself when T is A (no copy), else converted into `scratch`.
template <typename T, typename A>
inline const A* as_acc(const T* row, A* scratch, int64_t n) {
  if constexpr (std::is_same_v<T, A>) {
    return row;
  } else {
    load_row(scratch, row, n);
    return scratch;
  }
}

// Where to compute an output row: in place when T is A, else in `scratch` (then finish_row).
template <typename T, typename A>
inline A* out_acc(T* row, A* scratch) {
  if constexpr (std::is_same_v<T, A>) return row;
  else return scratch;
}

template <typename T, typename A>
inline void finish_row(T* row, const A* computed, int64_t n) {
  if constexpr (!std::is_same_v<T, A>) store_row(row, computed, n);
}

// -- fused per-row loops -------------------------------------------------------------------

// Calls f(i, count) for consecutive vector chunks of [0, n); count < Vec::size() only at the
// tail, where loads zero-fill the missing lanes.
template <typename A, typename F>
inline void vec_loop(int64_t n, F&& f) {
  using Vec = at::vec::Vectorized<A>;
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) f(i, Vec::size());
  if (i < n) f(i, n - i);
}

template <typename A>
inline at::vec::Vectorized<A> ld(const A* p, int64_t i, int64_t count) {
  using Vec = at::vec::Vectorized<A>;
  return count == Vec::size() ? Vec::loadu(p + i) : Vec::loadu(p + i, count);
}

// A vector of A lanes from a row of T: 16-bit rows convert in registers, so the forward needs
// no fp32 copy of its inputs.
template <typename A, typename T>
inline at::vec::Vectorized<A> load_acc(const T* p, int64_t i, int64_t count) {
  using Vec = at::vec::Vectorized<A>;
  if constexpr (std::is_same_v<T, A>) {
    return ld(p, i, count);
  } else {
    static_assert(at::vec::is_reduced_floating_point_v<T> && std::is_same_v<A, float>);
    if (count == Vec::size()) {
      Vec out;
      at::vec::load_to_float<T>(p + i, out);
      return out;
    }
    A lanes[Vec::size()] = {};  // the tail: missing lanes zero, as ld's
    for (int64_t j = 0; j < count; ++j) lanes[j] = static_cast<A>(p[i + j]);
    return Vec::loadu(lanes);
  }
}

template <typename A>
inline at::vec::Vectorized<A> ld_or(const A* p, A fallback, int64_t i, int64_t count) {
  return p ? ld(p, i, count) : at::vec::Vectorized<A>(fallback);
}

template <typename A>
inline void st(const at::vec::Vectorized<A>& v, A* p, int64_t i, int64_t count) {
  if (count == at::vec::Vectorized<A>::size()) v.store(p + i);
  else v.store(p + i, count);
}

// Zeroes the lanes past `count` (tail chunks), so they do not enter sums.
template <typename A>
inline at::vec::Vectorized<A> valid(const at::vec::Vectorized<A>& v, int64_t count) {
  using Vec = at::vec::Vectorized<A>;
  return count == Vec::size() ? v : Vec::set(Vec(A(0)), v, count);
}

template <typename A>
inline A reduce(const at::vec::Vectorized<A>& v) {
  return at::vec::vec_reduce_all<A>(std::plus<at::vec::Vectorized<A>>(), v);
}

// rstd from a sum of squares of centred values
template <typename A>
inline A rstd_of(A centred_squares, int64_t n, A eps) {
  return A(1) / std::sqrt(centred_squares / n + eps);
}

// -- dual_norm forward ---------------------------------------------------------------------

template <typename T, typename A>
void forward_rows(const T* streams, const StreamRows& g, const WeightPointers<A>& w, bool has_input_norm,
                  bool rms, bool channel_scale, A eps, T* base, T* normed, A* stats) {
  using Vec = at::vec::Vectorized<A>;
  const int64_t h = g.hidden, width = g.width();
  at::parallel_for(0, g.rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<A> scratch(2 * h);  // u and a in A; x and y are read in place
    for (int64_t r = begin; r < end; ++r) {
      const T* x = streams + r * width;
      const T* y = g.packed ? x + h : x;
      T* base_row = base + r * 2 * h;
      T* normed_row = normed + r * h;
      // u in place of its base half, or in scratch for the hybrid, whose base half is x
      A* u_out = channel_scale ? scratch.data() : out_acc(base_row, scratch.data());
      A* a = out_acc(normed_row, scratch.data() + h);
      // pass 1: means (two-pass statistics stay accurate under large offsets). The hybrid's x
      // is not normalized: its statistics are the identity's (mean 0, rstd 1), so u = c1 * x.
      A mx = 0, my = 0;
      if (!rms) {
        Vec sx(A(0)), sy(A(0));
        vec_loop<A>(h, [&](int64_t i, int64_t c) { sx += load_acc<A>(x, i, c), sy += load_acc<A>(y, i, c); });
        mx = channel_scale ? A(0) : reduce(sx) / h, my = reduce(sy) / h;
      }
      // pass 2: centred squares
      Vec qx(A(0)), qy(A(0));
      const Vec vmx(mx), vmy(my);
      vec_loop<A>(h, [&](int64_t i, int64_t c) {
        const Vec cx = valid(load_acc<A>(x, i, c) - vmx, c), cy = valid(load_acc<A>(y, i, c) - vmy, c);
        qx = at::vec::fmadd(cx, cx, qx), qy = at::vec::fmadd(cy, cy, qy);
      });
      const A rx = channel_scale ? A(1) : rstd_of(reduce(qx), h, eps), ry = rstd_of(reduce(qy), h, eps);
      // pass 3: u = PostNorm(x), a = u + PreNorm(y), and a's sum
      const Vec vrx(rx), vry(ry);
      Vec sa(A(0));
      vec_loop<A>(h, [&](int64_t i, int64_t c) {
        const Vec u = at::vec::fmadd((load_acc<A>(x, i, c) - vmx) * vrx, ld_or(w.gx, A(1), i, c), ld_or(w.bx, A(0), i, c));
        const Vec yn = at::vec::fmadd((load_acc<A>(y, i, c) - vmy) * vry, ld_or(w.gy, A(1), i, c), ld_or(w.by, A(0), i, c));
        const Vec av = valid(u + yn, c);
        st(u, u_out, i, c);
        st(av, a, i, c);
        sa += av;
      });
      if (channel_scale) std::copy(x, x + h, base_row);  // hybrid: the X stream continues from x
      else finish_row(base_row, u_out, h);
      std::copy(y, y + h, base_row + h);
      A ma = 0, ra = 0;
      if (has_input_norm) {
        ma = rms ? A(0) : reduce(sa) / h;
        const Vec vma(ma);
        Vec qa(A(0));
        vec_loop<A>(h, [&](int64_t i, int64_t c) {
          const Vec ca = valid(ld(a, i, c) - vma, c);
          qa = at::vec::fmadd(ca, ca, qa);
        });
        ra = rstd_of(reduce(qa), h, eps);
        const Vec vra(ra);
        vec_loop<A>(h, [&](int64_t i, int64_t c) {
          st(at::vec::fmadd((ld(a, i, c) - vma) * vra, ld_or(w.gi, A(1), i, c), ld_or(w.bi, A(0), i, c)), a, i, c);
        });
      }
      finish_row(normed_row, a, h);
      A* s = stats + r * kStatsPerRow;
      s[0] = mx, s[1] = rx, s[2] = my, s[3] = ry, s[4] = ma, s[5] = ra;
    }
  });
}

// -- dual_norm backward --------------------------------------------------------------------

// Rows are split into fixed blocks, each summing weight gradients into its own partial, and
// the partials are added in block order: deterministic for a given thread count.
inline std::pair<int64_t, int64_t> row_blocks(int64_t rows) {
  const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>(rows, at::get_num_threads()));
  return {blocks, (rows + blocks - 1) / blocks};
}

// With normalized value n, gamma-scaled gradient t = dL/dnorm_out * gamma:
//   dL/dinput = rstd * (t - mean(t) - n * mean(t * n))   (RMSNorm: without mean(t)).
//
// Hybrid (channel_scale): x's statistics are the identity's, u = c1 * x, and base's first half
// is x itself, so dL/du is dL/da alone and dL/dx = dL/dbase_x + c1 * dL/da.
template <typename T, typename A>
void backward_rows(const T* grad_base, const T* grad_normed, const T* streams, const A* stats,
                   const StreamRows& g, const WeightPointers<A>& w, bool has_input_norm, bool rms,
                   bool channel_scale, T* grad_streams, A* weight_grads) {
  using Vec = at::vec::Vectorized<A>;
  const int64_t h = g.hidden, width = g.width(), rows = g.rows;
  const auto [blocks, rows_per_block] = row_blocks(rows);
  std::vector<A> partials(blocks * 6 * h, A(0));
  at::parallel_for(0, blocks, 1, [&](int64_t block_begin, int64_t block_end) {
    std::vector<A> scratch(10 * h);
    A *nx = scratch.data(), *ny = nx + h, *t = ny + h, *na = t + h, *ty = na + h, *convert = ty + h;
    for (int64_t block = block_begin; block < block_end; ++block) {
      A* part = partials.data() + block * 6 * h;
      A *dgx = part, *dbx = part + h, *dgy = part + 2 * h, *dby = part + 3 * h, *dgi = part + 4 * h,
        *dbi = part + 5 * h;
      const int64_t end = std::min(rows, (block + 1) * rows_per_block);
      for (int64_t r = block * rows_per_block; r < end; ++r) {
        const A* s = stats + r * kStatsPerRow;
        const Vec mx(s[0]), rx(s[1]), my(s[2]), ry(s[3]), ma(s[4]), ra(s[5]);
        const T* x = streams + r * width;
        const A* xs = as_acc(x, convert, h);
        const A* ys = as_acc(g.packed ? x + h : x, convert + h, h);
        const A* ga = as_acc(grad_normed + r * h, convert + 2 * h, h);
        const A* gu = as_acc(grad_base + r * 2 * h, convert + 3 * h, h);
        const A* gyid = as_acc(grad_base + r * 2 * h + h, convert + 4 * h, h);
        // pass 1: normalized x and y; the input norm's weight gradients and reduction terms
        Vec s_t(A(0)), s_tn(A(0));
        vec_loop<A>(h, [&](int64_t i, int64_t c) {
          const Vec vnx = (ld(xs, i, c) - mx) * rx, vny = (ld(ys, i, c) - my) * ry;
          st(vnx, nx, i, c);
          st(vny, ny, i, c);
          if (has_input_norm) {
            const Vec u = at::vec::fmadd(vnx, ld_or(w.gx, A(1), i, c), ld_or(w.bx, A(0), i, c));
            const Vec yn = at::vec::fmadd(vny, ld_or(w.gy, A(1), i, c), ld_or(w.by, A(0), i, c));
            const Vec vna = valid((u + yn - ma) * ra, c), vga = ld(ga, i, c);
            st(at::vec::fmadd(vga, vna, ld(dgi, i, c)), dgi, i, c);
            if (w.bi) st(ld(dbi, i, c) + vga, dbi, i, c);
            const Vec vt = vga * ld_or(w.gi, A(1), i, c);
            st(vt, t, i, c);
            st(vna, na, i, c);
            s_t += vt, s_tn = at::vec::fmadd(vt, vna, s_tn);
          }
        });
        // pass 2: dL/da; dL/du = residual gradient (none in the hybrid) + dL/da; PreNorm(y)'s
        // output gradient is dL/da
        const Vec mean_t(rms ? A(0) : reduce(s_t) / h), mean_tn(reduce(s_tn) / h);
        Vec s_tx(A(0)), s_txn(A(0)), s_ty(A(0)), s_tyn(A(0));
        vec_loop<A>(h, [&](int64_t i, int64_t c) {
          const Vec vga = has_input_norm ? ra * (ld(t, i, c) - mean_t - ld(na, i, c) * mean_tn) : ld(ga, i, c);
          const Vec vgu = channel_scale ? vga : ld(gu, i, c) + vga, vnx = ld(nx, i, c), vny = ld(ny, i, c);
          st(at::vec::fmadd(vgu, vnx, ld(dgx, i, c)), dgx, i, c);
          if (w.bx) st(ld(dbx, i, c) + vgu, dbx, i, c);
          st(at::vec::fmadd(vga, vny, ld(dgy, i, c)), dgy, i, c);
          if (w.by) st(ld(dby, i, c) + vga, dby, i, c);
          const Vec vtx = vgu * ld_or(w.gx, A(1), i, c), vty = vga * ld_or(w.gy, A(1), i, c);
          st(vtx, t, i, c);
          st(vty, ty, i, c);
          s_tx += vtx, s_txn = at::vec::fmadd(vtx, vnx, s_txn);
          s_ty += vty, s_tyn = at::vec::fmadd(vty, vny, s_tyn);
        });
        // pass 3: gradients of x and y (plus y's identity-path gradient)
        // the hybrid's x is not normalized: no x-norm terms, and its residual gradient joins dL/dx
        const Vec mtx(rms || channel_scale ? A(0) : reduce(s_tx) / h);
        const Vec mtnx(channel_scale ? A(0) : reduce(s_txn) / h);
        const Vec mty(rms ? A(0) : reduce(s_ty) / h), mtny(reduce(s_tyn) / h);
        T* out = grad_streams + r * width;
        // nx / ny are not read again after their element: outputs may overwrite them
        A* gx_out = out_acc(out, nx);
        A* gy_out = g.packed ? out_acc(out + h, ny) : ny;
        vec_loop<A>(h, [&](int64_t i, int64_t c) {
          const Vec vnx = ld(nx, i, c), vny = ld(ny, i, c);
          Vec gx_in = rx * (ld(t, i, c) - mtx - vnx * mtnx);
          if (channel_scale) gx_in += ld(gu, i, c);
          const Vec gy_in = ry * (ld(ty, i, c) - mty - vny * mtny) + ld(gyid, i, c);
          st(g.packed ? gx_in : gx_in + gy_in, gx_out, i, c);
          st(gy_in, gy_out, i, c);
        });
        finish_row(out, gx_out, h);
        if (g.packed) finish_row(out + h, gy_out, h);
      }
    }
  });
  for (int64_t block = 0; block < blocks; ++block) {
    const A* part = partials.data() + block * 6 * h;
    for (int64_t i = 0; i < 6 * h; ++i) weight_grads[i] += part[i];
  }
}

// -- dual_residual -------------------------------------------------------------------------

// keep[i] = mask[i] ? scale : 0 (the dropout factor), as a row of A
template <typename A>
inline void dropout_factors(A* keep, const bool* mask, A scale, int64_t h) {
  for (int64_t i = 0; i < h; ++i) keep[i] = mask[i] ? scale : A(0);
}

template <typename T, typename A>
void residual_rows(const T* base, const T* out, const A* bias, const bool* mask, A scale, A inv_c,
                   int64_t rows, int64_t h, T* packed) {
  using Vec = at::vec::Vectorized<A>;
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<A> scratch(4 * h);
    A *z = scratch.data(), *bx = z + h, *by = bx + h, *keep = by + h;
    const Vec c(inv_c);
    for (int64_t r = begin; r < end; ++r) {
      load_row(z, out + r * h, h);
      load_row(bx, base + r * 2 * h, h);
      load_row(by, base + r * 2 * h + h, h);
      if (mask) dropout_factors(keep, mask + r * h, scale, h);
      vec_loop<A>(h, [&](int64_t i, int64_t cnt) {
        Vec vz = ld(z, i, cnt) + ld_or(bias, A(0), i, cnt);
        if (mask) vz = vz * ld(keep, i, cnt);
        st(at::vec::fmadd(vz, c, ld(bx, i, cnt)), bx, i, cnt);
        st(ld(by, i, cnt) + vz, by, i, cnt);
      });
      store_row(packed + r * 2 * h, bx, h);
      store_row(packed + r * 2 * h + h, by, h);
    }
  });
}

template <typename T, typename A>
void residual_backward_rows(const T* grad, const bool* mask, A scale, A inv_c, int64_t rows, int64_t h,
                            T* grad_out, A* grad_bias) {
  using Vec = at::vec::Vectorized<A>;
  const auto [blocks, rows_per_block] = row_blocks(rows);
  std::vector<A> partials(grad_bias ? blocks * h : 0, A(0));
  at::parallel_for(0, blocks, 1, [&](int64_t block_begin, int64_t block_end) {
    std::vector<A> scratch(3 * h);
    A *gz = scratch.data(), *gy = gz + h, *keep = gy + h;
    const Vec c(inv_c);
    for (int64_t block = block_begin; block < block_end; ++block) {
      A* part = grad_bias ? partials.data() + block * h : nullptr;
      const int64_t end = std::min(rows, (block + 1) * rows_per_block);
      for (int64_t r = block * rows_per_block; r < end; ++r) {
        load_row(gz, grad + r * 2 * h, h);
        load_row(gy, grad + r * 2 * h + h, h);
        if (mask) dropout_factors(keep, mask + r * h, scale, h);
        vec_loop<A>(h, [&](int64_t i, int64_t cnt) {
          Vec g = at::vec::fmadd(ld(gz, i, cnt), c, ld(gy, i, cnt));  // dL/dz
          if (mask) g = g * ld(keep, i, cnt);
          if (part) st(ld(part, i, cnt) + g, part, i, cnt);
          st(g, gz, i, cnt);
        });
        store_row(grad_out + r * h, gz, h);
      }
    }
  });
  if (grad_bias)
    for (int64_t block = 0; block < blocks; ++block)
      for (int64_t i = 0; i < h; ++i) grad_bias[i] += partials[block * h + i];
}

// -- launchers -----------------------------------------------------------------------------


template <typename A>
const A* data_or_null(const torch::Tensor& t) {
  return t.defined() ? t.data_ptr<A>() : nullptr;
}

}  // namespace

void CpuKernels::dual_norm(const torch::Tensor& streams, const StreamRows& g, const NormWeights& w, double eps,
                           torch::Tensor& base, torch::Tensor& normed, torch::Tensor& stats) {
  SIAMESE_DISPATCH(streams.scalar_type(), "dual_norm_cpu", [&] {
    using A = at::opmath_type<scalar_t>;
    forward_rows<scalar_t, A>(streams.data_ptr<scalar_t>(), g, pointers_of<A>(w), w.has_input_norm(), w.rms,
                              w.channel_scale, static_cast<A>(eps), base.data_ptr<scalar_t>(),
                              normed.data_ptr<scalar_t>(), stats.data_ptr<A>());
  });
}

void CpuKernels::dual_norm_backward(const torch::Tensor& grad_base, const torch::Tensor& grad_normed,
                                    const torch::Tensor& streams, const torch::Tensor& stats, const StreamRows& g,
                                    const NormWeights& w, torch::Tensor& grad_streams, torch::Tensor& weight_grads) {
  SIAMESE_DISPATCH(streams.scalar_type(), "dual_norm_backward_cpu", [&] {
    using A = at::opmath_type<scalar_t>;
    backward_rows<scalar_t, A>(grad_base.data_ptr<scalar_t>(), grad_normed.data_ptr<scalar_t>(),
                               streams.data_ptr<scalar_t>(), stats.data_ptr<A>(), g, pointers_of<A>(w),
                               w.has_input_norm(), w.rms, w.channel_scale, grad_streams.data_ptr<scalar_t>(),
                               weight_grads.data_ptr<A>());
  });
}

void CpuKernels::dual_residual(const torch::Tensor& base, const torch::Tensor& out, const torch::Tensor& bias,
                               const torch::Tensor& mask, double scale, double inv_c, torch::Tensor& packed) {
  SIAMESE_DISPATCH(out.scalar_type(), "dual_residual_cpu", [&] {
    using A = at::opmath_type<scalar_t>;
    residual_rows<scalar_t, A>(base.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), data_or_null<A>(bias),
                               mask.defined() ? mask.data_ptr<bool>() : nullptr, static_cast<A>(scale),
                               static_cast<A>(inv_c), out.size(0), out.size(1), packed.data_ptr<scalar_t>());
  });
}

void CpuKernels::dual_residual_backward(const torch::Tensor& grad, const torch::Tensor& mask, double scale,
                                        double inv_c, torch::Tensor& grad_out, torch::Tensor& grad_bias) {
  SIAMESE_DISPATCH(grad.scalar_type(), "dual_residual_backward_cpu", [&] {
    using A = at::opmath_type<scalar_t>;
    residual_backward_rows<scalar_t, A>(grad.data_ptr<scalar_t>(), mask.defined() ? mask.data_ptr<bool>() : nullptr,
                                        static_cast<A>(scale), static_cast<A>(inv_c), grad_out.size(0),
                                        grad_out.size(1), grad_out.data_ptr<scalar_t>(),
                                        grad_bias.defined() ? grad_bias.data_ptr<A>() : nullptr);
  });
}

}  // namespace megatron_siamese
