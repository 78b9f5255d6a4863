// The CPU kernels' row arithmetic, shared by the norm ops (dual_norm_cpu.cpp) and the boundary
// op (residual_norm_cpu.cpp): 16-bit rows to and from the accumulation type, vector loops with
// masked tails, and one row of dual_norm forward and backward, on rows read either from the
// streams (their dtype T) or from accumulation-type scratch (A).
//
// All math runs in the accumulation type A: float for float/bfloat16/half inputs, double for
// double (used by the fp64 gradcheck).
#pragma once

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <deque>
#include <vector>
#include <type_traits>
#include <utility>

#include "dual_norm.h"

namespace megatron_siamese {
namespace cpu {

// A row from one floating type to another. 16-bit rows to and from fp32 take vector conversions:
// at::vec::convert has vectorized float -> bfloat16/half paths but converts bfloat16/half ->
// float one scalar at a time, which made the 16-bit kernels compute-bound.
template <typename From, typename To>
inline void convert_row(To* dst, const From* src, int64_t n) {
  constexpr bool widen = at::vec::is_reduced_floating_point_v<From> && std::is_same_v<To, float>;
  constexpr bool narrow = at::vec::is_reduced_floating_point_v<To> && std::is_same_v<From, float>;
  if constexpr (widen || narrow) {
    using Vec16 = at::vec::Vectorized<std::conditional_t<widen, From, To>>;
    using VecF = at::vec::Vectorized<float>;
    int64_t i = 0;
    for (; i + Vec16::size() <= n; i += Vec16::size()) {
      if constexpr (widen) {
        auto [lo, hi] = at::vec::convert_to_float<From>(Vec16::loadu(src + i));
        lo.store(dst + i);
        hi.store(dst + i + VecF::size());
      } else {
        at::vec::convert_from_float<To>(VecF::loadu(src + i), VecF::loadu(src + i + VecF::size())).store(dst + i);
      }
    }
    for (; i < n; ++i) dst[i] = static_cast<To>(src[i]);
  } else {
    at::vec::convert(src, dst, n);
  }
}

// A row as A values: the row itself when T is A (no copy), else converted into `scratch`;
// null stays null.
template <typename T, typename A>
inline const A* as_acc(const T* row, A* scratch, int64_t n) {
  if (row == nullptr) return nullptr;
  if constexpr (std::is_same_v<T, A>) {
    return row;
  } else {
    convert_row(scratch, row, n);
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
  if constexpr (!std::is_same_v<T, A>) convert_row(row, computed, n);
  else if (row != computed) std::copy(computed, computed + n, row);
}

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

// A vector of A lanes from a row of S (T or A): 16-bit rows convert in registers, so a
// forward needs no fp32 copy of its inputs.
template <typename A, typename S>
inline at::vec::Vectorized<A> load_acc(const S* p, int64_t i, int64_t count) {
  using Vec = at::vec::Vectorized<A>;
  if constexpr (std::is_same_v<S, A>) {
    return ld(p, i, count);
  } else {
    static_assert(at::vec::is_reduced_floating_point_v<S> && std::is_same_v<A, float>);
    if (count == Vec::size()) {
      Vec out;
      at::vec::load_to_float<S>(p + i, out);
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

// Rows are split into fixed blocks, each summing weight gradients into its own partial, and
// the partials are added in block order: deterministic for a given thread count.
inline std::pair<int64_t, int64_t> row_blocks(int64_t rows) {
  const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>(rows, at::get_num_threads()));
  return {blocks, (rows + blocks - 1) / blocks};
}

// keep[i] = mask[i] ? scale : 0 (the dropout factor), as a row of A
template <typename A>
inline void dropout_factors(A* keep, const bool* mask, A scale, int64_t h) {
  for (int64_t i = 0; i < h; ++i) keep[i] = mask[i] ? scale : A(0);
}

// Mean and rstd of one row (two passes, so large offsets keep their accuracy; RMSNorm: mean 0
// and the root mean square).
template <typename A, typename S>
inline std::pair<A, A> moments(const S* v, int64_t h, bool rms, A eps) {
  using Vec = at::vec::Vectorized<A>;
  A mean = 0;
  if (!rms) {
    Vec s(A(0));
    vec_loop<A>(h, [&](int64_t i, int64_t c) { s += load_acc<A>(v, i, c); });
    mean = reduce(s) / h;
  }
  Vec q(A(0));
  const Vec vm(mean);
  vec_loop<A>(h, [&](int64_t i, int64_t c) {
    const Vec d = valid(load_acc<A>(v, i, c) - vm, c);
    q = at::vec::fmadd(d, d, q);
  });
  return {mean, rstd_of(reduce(q), h, eps)};
}

// What a norm row computes besides its weights: the input norm is there, RMSNorm or LayerNorm,
// and whether the X side is the hybrid variant's channel scale (x not normalized: its
// statistics are the identity's, mean 0 and rstd 1, so u = c1 * x falls out of the formulas).
struct NormKind {
  bool input_norm, rms, channel_scale;
};

// Statistics of one row as dual_norm stores them: x, y, a (mean, rstd each).
template <typename A>
struct RowStats {
  A mx, rx, my, ry, ma, ra;
};

// dual_norm's forward on one row, x and y read as S (the streams' T, or A scratch):
// u = PostNorm(x) (c1 * x) into u_out (an A row, or null), and InputNorm(a) (a itself without
// an input norm), a = u + PreNorm(y), into a_out (an A row).
template <typename A, typename S>
inline RowStats<A> norm_row(const S* x, const S* y, int64_t h, const WeightPointers<A>& w, NormKind k, A eps,
                            A* u_out, A* a_out) {
  using Vec = at::vec::Vectorized<A>;
  RowStats<A> s{};
  // means, then centred squares (of x and y together: one read of each per pass)
  if (!k.rms) {
    Vec sx(A(0)), sy(A(0));
    vec_loop<A>(h, [&](int64_t i, int64_t c) { sx += load_acc<A>(x, i, c), sy += load_acc<A>(y, i, c); });
    s.mx = k.channel_scale ? A(0) : reduce(sx) / h, s.my = reduce(sy) / h;
  }
  Vec qx(A(0)), qy(A(0));
  const Vec vmx(s.mx), vmy(s.my);
  vec_loop<A>(h, [&](int64_t i, int64_t c) {
    const Vec cx = valid(load_acc<A>(x, i, c) - vmx, c), cy = valid(load_acc<A>(y, i, c) - vmy, c);
    qx = at::vec::fmadd(cx, cx, qx), qy = at::vec::fmadd(cy, cy, qy);
  });
  s.rx = k.channel_scale ? A(1) : rstd_of(reduce(qx), h, eps), s.ry = rstd_of(reduce(qy), h, eps);
  // u, a = u + PreNorm(y), and a's sum
  const Vec vrx(s.rx), vry(s.ry);
  Vec sa(A(0));
  vec_loop<A>(h, [&](int64_t i, int64_t c) {
    const Vec u = at::vec::fmadd((load_acc<A>(x, i, c) - vmx) * vrx, ld_or(w.gx, A(1), i, c), ld_or(w.bx, A(0), i, c));
    const Vec yn = at::vec::fmadd((load_acc<A>(y, i, c) - vmy) * vry, ld_or(w.gy, A(1), i, c), ld_or(w.by, A(0), i, c));
    const Vec av = valid(u + yn, c);
    if (u_out) st(u, u_out, i, c);
    st(av, a_out, i, c);
    sa += av;
  });
  if (k.input_norm) {
    s.ma = k.rms ? A(0) : reduce(sa) / h;
    const Vec vma(s.ma);
    Vec qa(A(0));
    vec_loop<A>(h, [&](int64_t i, int64_t c) {
      const Vec ca = valid(ld(a_out, i, c) - vma, c);
      qa = at::vec::fmadd(ca, ca, qa);
    });
    s.ra = rstd_of(reduce(qa), h, eps);
    const Vec vra(s.ra);
    vec_loop<A>(h, [&](int64_t i, int64_t c) {
      st(at::vec::fmadd((ld(a_out, i, c) - vma) * vra, ld_or(w.gi, A(1), i, c), ld_or(w.bi, A(0), i, c)), a_out, i, c);
    });
  }
  return s;
}

template <typename A>
inline void store_stats(A* out, const RowStats<A>& s) {
  out[0] = s.mx, out[1] = s.rx, out[2] = s.my, out[3] = s.ry, out[4] = s.ma, out[5] = s.ra;
}

template <typename A>
inline RowStats<A> load_stats(const A* in) {
  return {in[0], in[1], in[2], in[3], in[4], in[5]};
}

// Weight-gradient rows of a partial, in dual_norm's order (x_weight, x_bias, y_weight, y_bias,
// in_weight, in_bias), each h wide.
template <typename A>
struct NormGrads {
  A *dgx, *dbx, *dgy, *dby, *dgi, *dbi;
  static NormGrads at(A* part, int64_t h) {
    return {part, part + h, part + 2 * h, part + 3 * h, part + 4 * h, part + 5 * h};
  }
};

// dual_norm's backward on one row. x, y: the row (as S); ga: dL/dnormed; gbx, gby: the gradient
// reaching base's halves (A rows, or null for none). With base_keeps_x (the hybrid variant, whose
// base is [x | y], and a layer's entry, whose streams pass through) gbx is a gradient of x
// itself, added after the norm's backward; otherwise it is dL/du, added before it. gby is y's
// identity-path gradient. Adds the weight gradients to `d`; writes dL/dx and dL/dy (A rows gx, gy).
// scratch: 5h of A.
//
// With normalized value n, gamma-scaled gradient t = dL/dnorm_out * gamma:
//   dL/dinput = rstd * (t - mean(t) - n * mean(t * n))   (RMSNorm: without mean(t)).
template <typename A, typename S>
inline void norm_backward_row(const S* x, const S* y, int64_t h, const RowStats<A>& st_, const A* ga, const A* gbx,
                              const A* gby, bool base_keeps_x, const WeightPointers<A>& w, NormKind k,
                              const NormGrads<A>& d, A* scratch, A* gx, A* gy) {
  using Vec = at::vec::Vectorized<A>;
  A *nx = scratch, *ny = nx + h, *t = ny + h, *na = t + h, *ty = na + h;
  const Vec mx(st_.mx), rx(st_.rx), my(st_.my), ry(st_.ry), ma(st_.ma), ra(st_.ra);
  // pass 1: normalized x and y; the input norm's weight gradients and reduction terms
  Vec s_t(A(0)), s_tn(A(0));
  vec_loop<A>(h, [&](int64_t i, int64_t c) {
    const Vec vnx = (load_acc<A>(x, i, c) - mx) * rx, vny = (load_acc<A>(y, i, c) - my) * ry;
    st(vnx, nx, i, c);
    st(vny, ny, i, c);
    if (k.input_norm) {
      const Vec u = at::vec::fmadd(vnx, ld_or(w.gx, A(1), i, c), ld_or(w.bx, A(0), i, c));
      const Vec yn = at::vec::fmadd(vny, ld_or(w.gy, A(1), i, c), ld_or(w.by, A(0), i, c));
      const Vec vna = valid((u + yn - ma) * ra, c), vga = ld(ga, i, c);
      st(at::vec::fmadd(vga, vna, ld(d.dgi, i, c)), d.dgi, i, c);
      if (w.bi) st(ld(d.dbi, i, c) + vga, d.dbi, i, c);
      const Vec vt = vga * ld_or(w.gi, A(1), i, c);
      st(vt, t, i, c);
      st(vna, na, i, c);
      s_t += vt, s_tn = at::vec::fmadd(vt, vna, s_tn);
    }
  });
  // pass 2: dL/da; dL/du = residual gradient (unless base keeps x) + dL/da; PreNorm(y)'s output
  // gradient is dL/da
  const Vec mean_t(k.rms ? A(0) : reduce(s_t) / h), mean_tn(reduce(s_tn) / h);
  Vec s_tx(A(0)), s_txn(A(0)), s_ty(A(0)), s_tyn(A(0));
  const bool residual_through_u = gbx != nullptr && !base_keeps_x;
  vec_loop<A>(h, [&](int64_t i, int64_t c) {
    const Vec vga = k.input_norm ? ra * (ld(t, i, c) - mean_t - ld(na, i, c) * mean_tn) : ld(ga, i, c);
    const Vec vgu = residual_through_u ? ld(gbx, i, c) + vga : vga, vnx = ld(nx, i, c), vny = ld(ny, i, c);
    st(at::vec::fmadd(vgu, vnx, ld(d.dgx, i, c)), d.dgx, i, c);
    if (w.bx) st(ld(d.dbx, i, c) + vgu, d.dbx, i, c);
    st(at::vec::fmadd(vga, vny, ld(d.dgy, i, c)), d.dgy, i, c);
    if (w.by) st(ld(d.dby, i, c) + vga, d.dby, i, c);
    const Vec vtx = vgu * ld_or(w.gx, A(1), i, c), vty = vga * ld_or(w.gy, A(1), i, c);
    st(vtx, t, i, c);
    st(vty, ty, i, c);
    s_tx += vtx, s_txn = at::vec::fmadd(vtx, vnx, s_txn);
    s_ty += vty, s_tyn = at::vec::fmadd(vty, vny, s_tyn);
  });
  // pass 3: gradients of x and y (plus the gradients that reach them directly)
  // a channel-scaled x is not normalized: no x-norm terms
  const Vec mtx(k.rms || k.channel_scale ? A(0) : reduce(s_tx) / h);
  const Vec mtnx(k.channel_scale ? A(0) : reduce(s_txn) / h);
  const Vec mty(k.rms ? A(0) : reduce(s_ty) / h), mtny(reduce(s_tyn) / h);
  const bool direct_x = gbx != nullptr && base_keeps_x;
  vec_loop<A>(h, [&](int64_t i, int64_t c) {
    Vec gx_in = rx * (ld(t, i, c) - mtx - ld(nx, i, c) * mtnx);
    if (direct_x) gx_in += ld(gbx, i, c);
    Vec gy_in = ry * (ld(ty, i, c) - mty - ld(ny, i, c) * mtny);
    if (gby) gy_in += ld(gby, i, c);
    st(gx_in, gx, i, c);
    st(gy_in, gy, i, c);
  });
}

// One norm's backward on a row x (as S) with its statistics: adds gamma's and beta's gradients
// (dgamma, dbeta; dbeta may be null) and writes dL/dx into gx (may alias g). g: dL/dout (A).
template <typename A, typename S>
inline void single_norm_backward_row(const S* x, int64_t h, A mean, A rstd, const A* gamma, bool rms, const A* g,
                                     A* dgamma, A* dbeta, A* n_scratch, A* gx) {
  using Vec = at::vec::Vectorized<A>;
  const Vec vm(mean), vr(rstd);
  Vec s_t(A(0)), s_tn(A(0));
  vec_loop<A>(h, [&](int64_t i, int64_t c) {
    const Vec n = (load_acc<A>(x, i, c) - vm) * vr, vg = ld(g, i, c);
    st(n, n_scratch, i, c);
    st(at::vec::fmadd(vg, n, ld(dgamma, i, c)), dgamma, i, c);
    if (dbeta) st(ld(dbeta, i, c) + vg, dbeta, i, c);
    const Vec t = valid(vg * ld_or(gamma, A(1), i, c), c);
    s_t += t, s_tn = at::vec::fmadd(t, n, s_tn);
  });
  const Vec mean_t(rms ? A(0) : reduce(s_t) / h), mean_tn(reduce(s_tn) / h);
  vec_loop<A>(h, [&](int64_t i, int64_t c) {
    const Vec t = ld(g, i, c) * ld_or(gamma, A(1), i, c);
    st(vr * (t - mean_t - ld(n_scratch, i, c) * mean_tn), gx, i, c);
  });
}

// A row of A values written into ``dest`` (n elements) in dest's own dtype.
template <typename A>
inline void store_row(const A* row, int64_t n, torch::Tensor& dest) {
  SIAMESE_DISPATCH(dest.scalar_type(), "store_row", [&] { convert_row(dest.data_ptr<scalar_t>(), row, n); });
}

// Sums per-block partials [blocks, slots * h] in block order (deterministic for a given thread
// count) and writes slot i's sum into dests[i] in its dtype (skipped where undefined).
template <typename A>
inline void write_sums(const std::vector<A>& partials, int64_t blocks, int64_t h,
                       const std::vector<torch::Tensor>& dests) {
  const int64_t slots = static_cast<int64_t>(dests.size());
  std::vector<A> sum(h);
  for (int64_t slot = 0; slot < slots; ++slot) {
    if (!dests[slot].defined()) continue;
    std::fill(sum.begin(), sum.end(), A(0));
    for (int64_t block = 0; block < blocks; ++block) {
      const A* part = partials.data() + block * slots * h + slot * h;
      for (int64_t i = 0; i < h; ++i) sum[i] += part[i];
    }
    torch::Tensor dest = dests[slot];
    store_row(sum.data(), h, dest);
  }
}

// Weight vectors as rows of A, read from each tensor's own dtype: an A tensor (not a zero-centred
// gamma) in place, any other widened once per call into rows this object holds (a zero-centred
// gamma as 1 + w). No tensor is made and no operator dispatched.
template <typename A>
class AccRows {
 public:
  explicit AccRows(int64_t h) : h_(h) {}

  const A* row(const torch::Tensor& t, bool plus_one = false) {
    if (!t.defined()) return nullptr;
    if (t.scalar_type() == c10::CppTypeToScalarType<A>::value && !plus_one) return t.data_ptr<A>();
    rows_.emplace_back(h_);
    A* out = rows_.back().data();
    SIAMESE_DISPATCH(t.scalar_type(), "widen_row", [&] { convert_row(out, t.data_ptr<scalar_t>(), h_); });
    if (plus_one)
      for (int64_t i = 0; i < h_; ++i) out[i] += A(1);
    return out;
  }

  // NormWeights' six norm weights (the gammas, not c1, as 1 + w when zero-centred)
  WeightPointers<A> norms(const NormWeights& w) {
    const bool zc = w.zero_centered;
    return {row(w.x_gamma, zc && !w.channel_scale), row(w.x_beta), row(w.y_gamma, zc), row(w.y_beta),
            row(w.in_gamma, zc), row(w.in_beta)};
  }

 private:
  int64_t h_;
  std::deque<std::vector<A>> rows_;  // stable addresses
};

}  // namespace cpu
}  // namespace megatron_siamese
