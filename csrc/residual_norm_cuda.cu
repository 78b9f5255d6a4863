// CUDA launchers for residual_dual_norm, the boundary between a layer's two sublayers
// (residual_norm_cpu.cpp has the CPU kernels and the math per row).
//
// They run the general kernels (general_kernels.cuh: a block per row, any width and
// alignment, the norms of the updated streams computed per column from the layer's streams
// and the sublayer's output), under both MEGATRON_SIAMESE_CUDA_KERNELS generations. Not yet
// run on a GPU: the layer uses the boundary ops on CUDA only when they are insisted on
// (siamese_boundary_ops=True; docs/kernels.md).
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "dual_norm.h"
#include "general_kernels.cuh"
#include "general_launch.h"

namespace megatron_siamese {
namespace {

template <typename A>
general::Params<A> boundary_params(const NormWeights& w, const StreamRows& g, double eps) {
  const WeightPointers<A> p = pointers_of<A>(w);
  return general::Params<A>{p.gx, p.bx, p.gy, p.by, p.gi, p.bi, g.rows, g.hidden, g.packed, w.rms, false, false,
                            static_cast<A>(eps)};
}

template <typename T, typename A>
general::Boundary<T, A> boundary_of(const ResidualInputs& r, const NormWeights& w) {
  auto or_null = [](const torch::Tensor& t) -> const A* { return t.defined() ? t.data_ptr<A>() : nullptr; };
  return {r.out.data_ptr<T>(), or_null(r.bias), or_null(w.prev_gamma), or_null(w.prev_beta),
          r.mask.defined() ? r.mask.data_ptr<bool>() : nullptr, static_cast<A>(r.scale), static_cast<A>(r.inv_c)};
}

}  // namespace

// The CPU twins (residual_norm_cpu.cpp) have these signatures: one host layer, a kernel set per device.
void CudaAccKernels::residual_dual_norm(const torch::Tensor& streams, const ResidualInputs& r, const StreamRows& g,
                                        const NormWeights& w, double eps, torch::Tensor& base, torch::Tensor& normed,
                                        torch::Tensor& stats) {
  const c10::cuda::CUDAGuard guard(streams.device());
  cuda_kernel_generation();  // checks the setting for every op
  SIAMESE_DISPATCH(streams.scalar_type(), "residual_dual_norm_cuda", [&] {
    using A = at::opmath_type<scalar_t>;
    general::boundary_forward_kernel<scalar_t, A><<<general::row_grid(g.rows), general::kThreads, 0,
                                                    c10::cuda::getCurrentCUDAStream()>>>(
        streams.data_ptr<scalar_t>(), boundary_params<A>(w, g, eps),
        boundary_of<scalar_t, A>(r, w), base.data_ptr<scalar_t>(),
        normed.data_ptr<scalar_t>(), stats.data_ptr<A>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

void CudaAccKernels::residual_dual_norm_backward(const torch::Tensor& grad_base, const torch::Tensor& grad_normed,
                                                 const torch::Tensor& streams, const ResidualInputs& r,
                                                 const torch::Tensor& stats, const StreamRows& g, const NormWeights& w,
                                                 torch::Tensor& grad_streams, torch::Tensor& grad_out,
                                                 torch::Tensor& grad_bias, torch::Tensor& weight_grads) {
  const c10::cuda::CUDAGuard guard(streams.device());
  cuda_kernel_generation();
  SIAMESE_DISPATCH(streams.scalar_type(), "residual_dual_norm_backward_cuda", [&] {
    using A = at::opmath_type<scalar_t>;
    const auto params = boundary_params<A>(w, g, 0.0);
    const auto boundary = boundary_of<scalar_t, A>(r, w);
    const scalar_t* gb = grad_base.defined() ? grad_base.data_ptr<scalar_t>() : nullptr;
    auto stream = c10::cuda::getCurrentCUDAStream();
    auto terms = torch::empty({g.rows, 6}, weight_grads.options());
    general::boundary_backward_rows_kernel<scalar_t, A><<<general::row_grid(g.rows), general::kThreads, 0, stream>>>(
        gb, grad_normed.data_ptr<scalar_t>(), streams.data_ptr<scalar_t>(), stats.data_ptr<A>(), params, boundary,
        grad_streams.data_ptr<scalar_t>(), grad_out.data_ptr<scalar_t>(), terms.data_ptr<A>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    const general::Strips strips = general::weight_grad_strips(g.rows, g.hidden);
    constexpr int64_t kRows = kBoundaryWeightGrads + 1;  // and the bias
    auto partials = torch::empty({strips.strips * general::kLanes, kRows, g.hidden}, weight_grads.options());
    general::boundary_weight_grad_kernel<scalar_t, A><<<dim3(strips.column_blocks, strips.strips),
                                                        dim3(general::kWarp, general::kLanes), 0, stream>>>(
        gb, grad_normed.data_ptr<scalar_t>(), streams.data_ptr<scalar_t>(), stats.data_ptr<A>(), terms.data_ptr<A>(),
        params, boundary, strips.rows_per_strip, partials.data_ptr<A>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    auto totals = torch::empty({kRows, g.hidden}, weight_grads.options());
    general::sum_parts(partials, strips.strips * general::kLanes, kRows * g.hidden, totals);
    weight_grads.copy_(totals.narrow(0, 0, kBoundaryWeightGrads));
    if (grad_bias.defined()) grad_bias.copy_(totals[kBoundaryWeightGrads]);
  });
}

}  // namespace megatron_siamese
