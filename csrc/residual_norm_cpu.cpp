// CPU kernels for residual_dual_norm, the boundary between two sublayers of a layer: the first
// sublayer's residual update and the second sublayer's norms in one pass over each row.
//
// Per row (reference: megatron_siamese/reference/functional.py, residual_dual_norm):
//   u  = PostNorm_prev(x)  (x itself without it: the hybrid variant's attention side), its
//        statistics computed here from x: nothing of the previous op is read but the streams
//   z  = (out + bias) * keep;  x' = u + z / c;  y' = y + z       (in the accumulation type)
//   base = [PostNorm(x') | y'],  normed = InputNorm(PostNorm(x') + PreNorm(y'))
// The backward recomputes u, x' and y' from the same inputs, so nothing h wide is saved but
// the sublayer's output `out` (the streams are the layer's input, alive anyway).
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>

#include <vector>

#include "cpu_rows.h"
#include "dual_norm.h"

namespace megatron_siamese {
namespace {

using namespace cpu;

// The residual update in the accumulation type: x2 = u + z * inv_c, y2 = y + z (and z itself
// when asked), u = PostNorm_prev(x) with the given statistics or x.
template <typename A, typename T>
inline void residual_row(const T* x, const T* y, const T* out, const A* bias, const A* keep, const A* gp,
                         const A* bp, bool has_prev, A pm, A pr, A inv_c, int64_t h, A* x2, A* y2) {
  using Vec = at::vec::Vectorized<A>;
  const Vec vm(pm), vr(pr), c(inv_c);
  vec_loop<A>(h, [&](int64_t i, int64_t cnt) {
    const Vec vx = load_acc<A>(x, i, cnt);
    const Vec u = has_prev ? at::vec::fmadd((vx - vm) * vr, ld_or(gp, A(1), i, cnt), ld_or(bp, A(0), i, cnt)) : vx;
    Vec z = load_acc<A>(out, i, cnt) + ld_or(bias, A(0), i, cnt);
    if (keep) z = z * ld(keep, i, cnt);
    st(at::vec::fmadd(z, c, u), x2, i, cnt);
    st(load_acc<A>(y, i, cnt) + z, y2, i, cnt);
  });
}

struct Residual {
  const void* out;
  const void* bias;  // A (widened: AccRows), or null
  const bool* mask;  // or null
  double scale, inv_c;
};

// What the forward and the backward read of a row alike: the weights, and the residual update
// recomputed from the streams and the sublayer's output.
template <typename T, typename A>
struct BoundaryRows {
  const StreamRows& g;
  const Residual& res;
  const int64_t h, width;
  const WeightPointers<A> w;
  const A *gp, *bp;  // PostNorm_prev's gamma and beta (null: no PostNorm_prev)
  const bool has_prev;
  const NormKind k;

  BoundaryRows(const StreamRows& g, const Residual& res, const NormWeights& weights, AccRows<A>& acc)
      : g(g), res(res), h(g.hidden), width(g.width()), w(acc.norms(weights)),
        gp(acc.row(weights.prev_gamma, weights.zero_centered)), bp(acc.row(weights.prev_beta)),
        has_prev(weights.prev_gamma.defined()), k{weights.has_input_norm(), weights.rms, false} {}

  // Row r's x2 = u + z / c and y2 = y + z, its dropout factors in keep; u from x with PostNorm_prev's
  // statistics (pm, pr).
  void update(const T* x, const T* y, int64_t r, A pm, A pr, A* keep, A* x2, A* y2) const {
    if (res.mask) dropout_factors(keep, res.mask + r * h, static_cast<A>(res.scale), h);
    residual_row<A>(x, y, static_cast<const T*>(res.out) + r * h, static_cast<const A*>(res.bias),
                    res.mask ? keep : nullptr, gp, bp, has_prev, pm, pr, static_cast<A>(res.inv_c), h, x2, y2);
  }
};

template <typename T, typename A>
void forward_rows(const T* streams, const StreamRows& g, const Residual& res, const NormWeights& weights,
                  AccRows<A>& acc, A eps, T* base, T* normed, A* stats) {
  const BoundaryRows<T, A> rows(g, res, weights, acc);
  const int64_t h = rows.h, width = rows.width;
  at::parallel_for(0, g.rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<A> scratch(5 * h);
    A *x2 = scratch.data(), *y2 = x2 + h, *u2 = y2 + h, *a = u2 + h, *keep = a + h;
    for (int64_t r = begin; r < end; ++r) {
      const T* x = streams + r * width;
      const T* y = g.packed ? x + h : x;
      const auto [pm, pr] = rows.has_prev ? moments<A>(x, h, weights.rms, eps) : std::pair<A, A>{A(0), A(1)};
      rows.update(x, y, r, pm, pr, keep, x2, y2);
      const RowStats<A> s = norm_row<A>(x2, y2, h, rows.w, rows.k, eps, u2, a);
      A* row_stats = stats + r * kBoundaryStatsPerRow;
      row_stats[0] = pm, row_stats[1] = pr;
      store_stats(row_stats + 2, s);
      convert_row(base + r * 2 * h, u2, h);
      convert_row(base + r * 2 * h + h, y2, h);
      convert_row(normed + r * h, a, h);
    }
  });
}

// Weight-gradient partial rows: PostNorm_prev's gamma and beta, dual_norm's six, the bias.
constexpr int64_t kPartRows = kBoundaryWeightGrads + 1;

template <typename T, typename A>
void backward_rows(const T* grad_base, const T* grad_normed, const T* streams, const A* stats, const StreamRows& g,
                   const Residual& res, const NormWeights& weights, AccRows<A>& acc, T* grad_streams, T* grad_out,
                   const torch::Tensor& grad_bias, const std::vector<torch::Tensor>& weight_grads) {
  using Vec = at::vec::Vectorized<A>;
  const BoundaryRows<T, A> boundary(g, res, weights, acc);
  const int64_t h = boundary.h, width = boundary.width, rows = g.rows;
  const A *gp = boundary.gp, *bp = boundary.bp, *bias = static_cast<const A*>(res.bias);
  const auto [blocks, rows_per_block] = row_blocks(rows);
  std::vector<A> partials(blocks * kPartRows * h, A(0));
  at::parallel_for(0, blocks, 1, [&](int64_t block_begin, int64_t block_end) {
    std::vector<A> scratch(14 * h);
    A *work = scratch.data(), *x2 = work + 5 * h, *y2 = x2 + h, *gx2 = y2 + h, *gy2 = gx2 + h, *keep = gy2 + h,
      *gx = keep + h, *convert = gx + h;
    const Vec c(static_cast<A>(res.inv_c));
    for (int64_t block = block_begin; block < block_end; ++block) {
      A* part = partials.data() + block * kPartRows * h;
      A *dgp = part, *dbp = bp ? part + h : nullptr, *dbias = part + (kPartRows - 1) * h;
      const NormGrads<A> d = NormGrads<A>::at(part + 2 * h, h);
      const int64_t end = std::min(rows, (block + 1) * rows_per_block);
      for (int64_t r = block * rows_per_block; r < end; ++r) {
        const T* x = streams + r * width;
        const T* y = g.packed ? x + h : x;
        const A* row_stats = stats + r * kBoundaryStatsPerRow;
        const A pm = row_stats[0], pr = row_stats[1];
        boundary.update(x, y, r, pm, pr, keep, x2, y2);
        const A* ga = as_acc(grad_normed + r * h, convert, h);
        const A* gbx = as_acc(grad_base == nullptr ? nullptr : grad_base + r * 2 * h, convert + h, h);
        const A* gby = as_acc(grad_base == nullptr ? nullptr : grad_base + r * 2 * h + h, convert + 2 * h, h);
        norm_backward_row<A>(x2, y2, h, load_stats(row_stats + 2), ga, gbx, gby, false, boundary.w, boundary.k, d, work,
                             gx2, gy2);
        // dL/dz = dL/dx' / c + dL/dy' (through the dropout factor), which is also dL/dbias
        A* gz = x2;  // x2 is not read again
        vec_loop<A>(h, [&](int64_t i, int64_t cnt) {
          Vec v = at::vec::fmadd(ld(gx2, i, cnt), c, ld(gy2, i, cnt));
          if (res.mask) v = v * ld(keep, i, cnt);
          st(v, gz, i, cnt);
          if (bias) st(ld(dbias, i, cnt) + v, dbias, i, cnt);
        });
        convert_row(grad_out + r * h, gz, h);
        // dL/dx: through PostNorm_prev (u = x without it); dL/dy = dL/dy'
        if (boundary.has_prev) single_norm_backward_row<A>(x, h, pm, pr, gp, weights.rms, gx2, dgp, dbp, work, gx);
        else std::copy(gx2, gx2 + h, gx);
        T* grad_row = grad_streams + r * width;
        if (g.packed) {
          convert_row(grad_row, gx, h);
          convert_row(grad_row + h, gy2, h);
        } else {
          at::vec::map2([](auto a, auto b) { return a + b; }, gx, gx, gy2, h);
          convert_row(grad_row, gx, h);
        }
      }
    }
  });
  std::vector<torch::Tensor> sums = weight_grads;  // the partial rows' order: the weights, then the bias
  sums.push_back(grad_bias);
  write_sums(partials, blocks, h, sums);
}

// ``bias``: widened to the accumulation type (AccRows::row), or null.
Residual residual_of(const ResidualInputs& r, const void* bias) {
  return {r.out.data_ptr(), bias, r.mask.defined() ? r.mask.data_ptr<bool>() : nullptr, r.scale, r.inv_c};
}

}  // namespace

void CpuKernels::residual_dual_norm(const torch::Tensor& streams, const ResidualInputs& r, const StreamRows& g,
                                    const NormWeights& w, double eps, torch::Tensor& base, torch::Tensor& normed,
                                    torch::Tensor& stats) {
  SIAMESE_DISPATCH(streams.scalar_type(), "residual_dual_norm_cpu", [&] {
    using A = at::opmath_type<scalar_t>;
    AccRows<A> acc(g.hidden);
    forward_rows<scalar_t, A>(streams.data_ptr<scalar_t>(), g, residual_of(r, acc.row(r.bias)), w, acc, static_cast<A>(eps), base.data_ptr<scalar_t>(), normed.data_ptr<scalar_t>(),
                              stats.data_ptr<A>());
  });
}

void CpuKernels::residual_dual_norm_backward(const torch::Tensor& grad_base, const torch::Tensor& grad_normed,
                                             const torch::Tensor& streams, const ResidualInputs& r,
                                             const torch::Tensor& stats, const StreamRows& g, const NormWeights& w,
                                             torch::Tensor& grad_streams, torch::Tensor& grad_out,
                                             torch::Tensor& grad_bias, std::vector<torch::Tensor>& weight_grads) {
  SIAMESE_DISPATCH(streams.scalar_type(), "residual_dual_norm_backward_cpu", [&] {
    using A = at::opmath_type<scalar_t>;
    AccRows<A> acc(g.hidden);
    backward_rows<scalar_t, A>(grad_base.defined() ? grad_base.data_ptr<scalar_t>() : nullptr,
                               grad_normed.data_ptr<scalar_t>(), streams.data_ptr<scalar_t>(), stats.data_ptr<A>(), g,
                               residual_of(r, acc.row(r.bias)), w, acc,
                               grad_streams.data_ptr<scalar_t>(), grad_out.data_ptr<scalar_t>(), grad_bias,
                               weight_grads);
  });
}

}  // namespace megatron_siamese
