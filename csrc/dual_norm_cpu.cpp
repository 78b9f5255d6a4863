// CPU kernels for the SiameseNorm norm ops (dual_norm and its entry and hybrid forms) and
// dual_residual.
//
// Rows are processed independently with at::parallel_for; all math runs in the accumulation
// type (fp32; fp64 for double inputs) with at::vec::Vectorized (cpu_rows.h). The forward reads
// 16-bit rows straight into fp32 vectors; the backward converts each row once into fp32
// scratch. Weight gradients are summed per fixed block of rows into fp32 partials and the
// partials are added in block order, so results are deterministic for a given thread count
// (and do not depend on which thread ran which block).
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>

#include <vector>

#include "cpu_rows.h"
#include "dual_norm.h"

namespace megatron_siamese {
namespace {

using namespace cpu;

// -- dual_norm forward (entry forms: no base) ------------------------------------------------

template <typename T, typename A>
void forward_rows(const T* streams, const StreamRows& g, const WeightPointers<A>& w, NormKind k, A eps, T* base,
                  T* normed, A* stats) {
  const int64_t h = g.hidden, width = g.width();
  at::parallel_for(0, g.rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<A> scratch(2 * h);  // u and a in A; x and y are read in place
    for (int64_t r = begin; r < end; ++r) {
      const T* x = streams + r * width;
      const T* y = g.packed ? x + h : x;
      T* normed_row = normed + r * h;
      A* u = base != nullptr && !k.channel_scale ? scratch.data() : nullptr;
      A* a = out_acc(normed_row, scratch.data() + h);
      store_stats(stats + r * kStatsPerRow, norm_row<A>(x, y, h, w, k, eps, u, a));
      if (base != nullptr) {
        T* base_row = base + r * 2 * h;
        if (k.channel_scale) std::copy(x, x + h, base_row);  // hybrid: the X stream continues from x
        else convert_row(base_row, u, h);
        std::copy(y, y + h, base_row + h);
      }
      finish_row(normed_row, a, h);
    }
  });
}

// -- dual_norm backward ----------------------------------------------------------------------

// grad_base: [rows, base_width] with base_width 2h ([x | y] halves), or h for an entry op on a
// single stream (its pass-through is the stream itself: x's direct gradient, none for y), or null.
template <typename T, typename A>
void backward_rows(const T* grad_base, int64_t base_width, const T* grad_normed, const T* streams, const A* stats,
                   const StreamRows& g, const WeightPointers<A>& w, NormKind k, bool base_keeps_x, T* grad_streams,
                   const std::vector<torch::Tensor>& weight_grads) {
  const int64_t h = g.hidden, width = g.width(), rows = g.rows;
  const auto [blocks, rows_per_block] = row_blocks(rows);
  std::vector<A> partials(blocks * 6 * h, A(0));
  at::parallel_for(0, blocks, 1, [&](int64_t block_begin, int64_t block_end) {
    std::vector<A> scratch(12 * h);
    A *work = scratch.data(), *gx = work + 5 * h, *gy = gx + h, *convert = gy + h;
    for (int64_t block = block_begin; block < block_end; ++block) {
      const NormGrads<A> d = NormGrads<A>::at(partials.data() + block * 6 * h, h);
      const int64_t end = std::min(rows, (block + 1) * rows_per_block);
      for (int64_t r = block * rows_per_block; r < end; ++r) {
        const T* x = streams + r * width;
        const A* xs = as_acc(x, convert, h);
        const A* ys = as_acc(g.packed ? x + h : x, convert + h, h);
        const A* ga = as_acc(grad_normed + r * h, convert + 2 * h, h);
        const T* gb = grad_base == nullptr ? nullptr : grad_base + r * base_width;
        const A* gbx = as_acc(gb, convert + 3 * h, h);
        const A* gby = base_width == 2 * h ? as_acc(gb == nullptr ? nullptr : gb + h, convert + 4 * h, h) : nullptr;
        norm_backward_row<A>(xs, ys, h, load_stats(stats + r * kStatsPerRow), ga, gbx, gby, base_keeps_x, w, k, d,
                             work, gx, gy);
        T* out = grad_streams + r * width;
        if (g.packed) {
          finish_row(out, gx, h);
          finish_row(out + h, gy, h);
        } else {
          at::vec::map2([](auto a, auto b) { return a + b; }, gx, gx, gy, h);
          finish_row(out, gx, h);
        }
      }
    }
  });
  write_sums(partials, blocks, h, weight_grads);
}

// -- dual_residual -------------------------------------------------------------------------

template <typename T, typename A>
void residual_rows(const T* base, const T* out, const A* bias, const bool* mask, A scale, A inv_c,
                   int64_t rows, int64_t h, T* packed) {
  using Vec = at::vec::Vectorized<A>;
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<A> scratch(4 * h);
    A *z = scratch.data(), *bx = z + h, *by = bx + h, *keep = by + h;
    const Vec c(inv_c);
    for (int64_t r = begin; r < end; ++r) {
      convert_row(z, out + r * h, h);
      convert_row(bx, base + r * 2 * h, h);
      convert_row(by, base + r * 2 * h + h, h);
      if (mask) dropout_factors(keep, mask + r * h, scale, h);
      vec_loop<A>(h, [&](int64_t i, int64_t cnt) {
        Vec vz = ld(z, i, cnt) + ld_or(bias, A(0), i, cnt);
        if (mask) vz = vz * ld(keep, i, cnt);
        st(at::vec::fmadd(vz, c, ld(bx, i, cnt)), bx, i, cnt);
        st(ld(by, i, cnt) + vz, by, i, cnt);
      });
      convert_row(packed + r * 2 * h, bx, h);
      convert_row(packed + r * 2 * h + h, by, h);
    }
  });
}

template <typename T, typename A>
void residual_backward_rows(const T* grad, const bool* mask, A scale, A inv_c, int64_t rows, int64_t h,
                            T* grad_out, torch::Tensor& grad_bias) {
  using Vec = at::vec::Vectorized<A>;
  const auto [blocks, rows_per_block] = row_blocks(rows);
  const bool with_bias = grad_bias.defined();
  std::vector<A> partials(with_bias ? blocks * h : 0, A(0));
  at::parallel_for(0, blocks, 1, [&](int64_t block_begin, int64_t block_end) {
    std::vector<A> scratch(3 * h);
    A *gz = scratch.data(), *gy = gz + h, *keep = gy + h;
    const Vec c(inv_c);
    for (int64_t block = block_begin; block < block_end; ++block) {
      A* part = with_bias ? partials.data() + block * h : nullptr;
      const int64_t end = std::min(rows, (block + 1) * rows_per_block);
      for (int64_t r = block * rows_per_block; r < end; ++r) {
        convert_row(gz, grad + r * 2 * h, h);
        convert_row(gy, grad + r * 2 * h + h, h);
        if (mask) dropout_factors(keep, mask + r * h, scale, h);
        vec_loop<A>(h, [&](int64_t i, int64_t cnt) {
          Vec g = at::vec::fmadd(ld(gz, i, cnt), c, ld(gy, i, cnt));  // dL/dz
          if (mask) g = g * ld(keep, i, cnt);
          if (part) st(ld(part, i, cnt) + g, part, i, cnt);
          st(g, gz, i, cnt);
        });
        convert_row(grad_out + r * h, gz, h);
      }
    }
  });
  if (with_bias) write_sums(partials, blocks, h, {grad_bias});
}

NormKind kind_of(const NormWeights& w) { return {w.has_input_norm(), w.rms, w.channel_scale}; }

}  // namespace

// -- launchers -----------------------------------------------------------------------------

void CpuKernels::dual_norm(const torch::Tensor& streams, const StreamRows& g, const NormWeights& w, double eps,
                           torch::Tensor& base, torch::Tensor& normed, torch::Tensor& stats) {
  SIAMESE_DISPATCH(streams.scalar_type(), "dual_norm_cpu", [&] {
    using A = at::opmath_type<scalar_t>;
    AccRows<A> weights(g.hidden);
    forward_rows<scalar_t, A>(streams.data_ptr<scalar_t>(), g, weights.norms(w), kind_of(w), static_cast<A>(eps),
                              base.defined() ? base.data_ptr<scalar_t>() : nullptr, normed.data_ptr<scalar_t>(),
                              stats.data_ptr<A>());
  });
}

void CpuKernels::dual_norm_backward(const torch::Tensor& grad_base, const torch::Tensor& grad_normed,
                                    const torch::Tensor& streams, const torch::Tensor& stats, const StreamRows& g,
                                    const NormWeights& w, torch::Tensor& grad_streams,
                                    std::vector<torch::Tensor>& weight_grads) {
  SIAMESE_DISPATCH(streams.scalar_type(), "dual_norm_backward_cpu", [&] {
    using A = at::opmath_type<scalar_t>;
    AccRows<A> weights(g.hidden);
    backward_rows<scalar_t, A>(grad_base.defined() ? grad_base.data_ptr<scalar_t>() : nullptr,
                               grad_base.defined() ? grad_base.size(-1) : 0, grad_normed.data_ptr<scalar_t>(),
                               streams.data_ptr<scalar_t>(), stats.data_ptr<A>(), g, weights.norms(w), kind_of(w),
                               w.base_keeps_x(), grad_streams.data_ptr<scalar_t>(), weight_grads);
  });
}

void CpuKernels::dual_residual(const torch::Tensor& base, const torch::Tensor& out, const torch::Tensor& bias,
                               const torch::Tensor& mask, double scale, double inv_c, torch::Tensor& packed) {
  SIAMESE_DISPATCH(out.scalar_type(), "dual_residual_cpu", [&] {
    using A = at::opmath_type<scalar_t>;
    AccRows<A> rows(out.size(-1));
    residual_rows<scalar_t, A>(base.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), rows.row(bias),
                               mask.defined() ? mask.data_ptr<bool>() : nullptr, static_cast<A>(scale),
                               static_cast<A>(inv_c), out.numel() / out.size(-1), out.size(-1), packed.data_ptr<scalar_t>());
  });
}

void CpuKernels::dual_residual_backward(const torch::Tensor& grad, const torch::Tensor& mask, double scale,
                                        double inv_c, torch::Tensor& grad_out, torch::Tensor& grad_bias) {
  SIAMESE_DISPATCH(grad.scalar_type(), "dual_residual_backward_cpu", [&] {
    using A = at::opmath_type<scalar_t>;
    residual_backward_rows<scalar_t, A>(grad.data_ptr<scalar_t>(), mask.defined() ? mask.data_ptr<bool>() : nullptr,
                                        static_cast<A>(scale), static_cast<A>(inv_c), grad_out.numel() / grad_out.size(-1),
                                        grad_out.size(-1), grad_out.data_ptr<scalar_t>(), grad_bias);
  });
}

}  // namespace megatron_siamese
