// Host helpers for launching the general CUDA kernels (general_kernels.cuh), shared by the
// norm ops' launchers (dual_norm_cuda.cu) and the boundary op's (residual_norm_cuda.cu);
// defined in dual_norm_cuda.cu.
#pragma once

#include "dual_norm.h"

#include <cstdint>

namespace megatron_siamese {
namespace general {

// The current CUDA device.
int current_device();

// Row kernels: a block per row, grid-striding over rows.
int row_grid(int64_t rows);

// Elementwise kernels (the residual's): 256-thread blocks grid-striding over the elements.
int element_grid(int64_t elements);

// The column kernels' grid: strips of rows_per_strip rows, about 8 CTAs of 32 columns x
// kLanes lanes per SM.
struct Strips {
  int64_t column_blocks, strips, rows_per_strip;
};
Strips weight_grad_strips(int64_t rows, int64_t hidden);

// out[columns] = the sum over parts of partials [parts, columns], parts in order.
void sum_parts(const torch::Tensor& partials, int64_t parts, int64_t columns, torch::Tensor& out);

}  // namespace general
}  // namespace megatron_siamese
