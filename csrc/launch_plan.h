// How the tiled CUDA kernels (tiled_kernels.cu) cover a row: a pure function of the row
// width, the vector width, the row count, the device's size and each kernel instantiation's
// resources. It includes nothing of CUDA or torch, so the same code plans on the GPU (with
// cudaFuncGetAttributes' figures) and in the CPU tests (with ptxas's figures for every
// instantiation, for every width).
//
// A row is covered by a group of `threads_per_row` threads (a multiple of the warp), each
// holding `chunks` vectors of `vec` elements per stream in registers: element
// (chunk * threads_per_row + thread) * vec. A CTA holds `rows_per_cta` such groups, and a
// persistent grid of at most SMs x resident CTAs strides over the rows. The plan keeps the
// most rows in flight per SM (what hides memory latency) among the instantiations that need
// no spills; a row no instantiation covers gets the general kernel, which takes any width.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace megatron_siamese {
namespace plan {

constexpr int kWarp = 32;

// Shared floats per warp of a row: two exchange buffers, each of (n, mean, M2) for x and y
// (2 x 3 - 1: n is shared) forward, of 4 sums backward.
constexpr int kForwardSharedPerWarp = 2 * 5;
constexpr int kBackwardSharedPerWarp = 2 * 4;

// One kernel instantiation: its chunks per thread, the shared floats it keeps per column of
// a row (weight-gradient accumulators in shared memory instead of registers; 0 when they are
// in registers), and its figures: registers and stack (spill) bytes per thread, static shared
// memory per CTA.
struct Resources {
  int chunks = 0;
  int shared_per_column = 0;
  int registers = 0;
  int local_bytes = 0;
  int static_shared = 0;
};

// What a kernel needs besides registers: shared floats per warp of a row (its reduction
// exchanges).
struct Needs {
  int shared_per_warp = 0;
};

// An SM's limits (sm_80 / sm_90 / sm_100 share these, except shared memory per SM:
// 164 KB on A100, 228 KB on H100/H200/B200).
struct Device {
  int sms = 1;
  int registers_per_sm = 65536;
  int threads_per_sm = 2048;
  int ctas_per_sm = 32;
  int shared_per_sm = 233472;
  int shared_per_cta = 232448;  // opt-in maximum of dynamic shared memory
  int reserved_shared_per_cta = 1024;
};

struct Plan {
  bool tiled = false;  // false: the general kernel
  bool shared_accumulators = false;
  int instantiation = -1;  // index into the candidates
  int chunks = 0, threads_per_row = 0, rows_per_cta = 0;
  int ctas_per_sm = 0, grid = 0;
  int dynamic_shared = 0;  // bytes
  int threads() const { return threads_per_row * rows_per_cta; }
};

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// CTAs of `threads` threads resident on one SM, by the occupancy calculator's rules
// (cuda_occupancy.h): registers are allocated per warp in units of 256 from each of the SM's
// 4 sub-partitions, and a CTA's warps are spread over them, so a CTA fits only when
// ceil(warps / 4) warps fit one sub-partition. 0 when one CTA does not fit.
inline int resident_ctas(const Device& d, int registers, int threads, int shared_bytes) {
  constexpr int kSubPartitions = 4;
  if (registers <= 0 || registers > 255 || threads <= 0 || threads > 1024) return 0;
  const int registers_per_warp = static_cast<int>(ceil_div(int64_t(registers) * kWarp, 256) * 256);
  const int warps_per_cta = static_cast<int>(ceil_div(threads, kWarp));
  const int warps_per_sub_partition = d.registers_per_sm / kSubPartitions / registers_per_warp;
  if (ceil_div(warps_per_cta, kSubPartitions) > warps_per_sub_partition) return 0;
  const int by_registers = warps_per_sub_partition * kSubPartitions / warps_per_cta;
  const int by_threads = d.threads_per_sm / (warps_per_cta * kWarp);
  int by_shared = d.ctas_per_sm;
  if (shared_bytes > 0) {
    if (shared_bytes > d.shared_per_cta) return 0;
    by_shared = d.shared_per_sm / (shared_bytes + d.reserved_shared_per_cta);
  }
  return std::max(0, std::min({by_registers, by_threads, by_shared, d.ctas_per_sm}));
}

// The plan for rows of `hidden` elements (vectors of `vec` elements; the caller has checked
// hidden % vec == 0 and alignment) among `candidates`, listed fewest chunks first
// (ties go to the fewer chunks: fewer registers idle at a row's end).
inline Plan plan_rows(int64_t hidden, int vec, int64_t rows, const Device& device,
                      const std::vector<Resources>& candidates, const Needs& needs) {
  Plan best;
  int best_rows_in_flight = 0;
  for (size_t i = 0; i < candidates.size(); ++i) {
    const Resources& r = candidates[i];
    if (r.local_bytes > 0) continue;  // spills: never planned
    const int64_t per_thread = int64_t(r.chunks) * vec;
    const int64_t threads_per_row = ceil_div(ceil_div(hidden, per_thread), kWarp) * kWarp;
    if (threads_per_row > 1024) continue;
    // small rows: several a CTA, so a CTA has at least 4 warps (and weights are reused);
    // accumulators in shared memory belong to one row group
    const int rows_per_cta =
        r.shared_per_column > 0 ? 1 : static_cast<int>(std::max<int64_t>(1, 128 / threads_per_row));
    const int threads = static_cast<int>(threads_per_row) * rows_per_cta;
    const int64_t shared64 = int64_t(rows_per_cta) * (threads_per_row / kWarp) * needs.shared_per_warp * 4 +
                             int64_t(r.shared_per_column) * hidden * 4;
    if (shared64 + r.static_shared > device.shared_per_cta) continue;
    const int shared = static_cast<int>(shared64);
    const int ctas = resident_ctas(device, r.registers, threads, shared + r.static_shared);
    if (ctas == 0) continue;
    const int rows_in_flight = ctas * rows_per_cta;
    if (rows_in_flight > best_rows_in_flight) {  // ties: the fewer chunks, found first
      best_rows_in_flight = rows_in_flight;
      best.tiled = true;
      best.instantiation = static_cast<int>(i);
      best.shared_accumulators = r.shared_per_column > 0;
      best.chunks = r.chunks;
      best.threads_per_row = static_cast<int>(threads_per_row);
      best.rows_per_cta = rows_per_cta;
      best.ctas_per_sm = ctas;
      best.dynamic_shared = shared;
    }
  }
  if (best.tiled) {
    const int64_t tiles = ceil_div(std::max<int64_t>(rows, 1), best.rows_per_cta);
    best.grid = static_cast<int>(std::min<int64_t>(tiles, int64_t(device.sms) * best.ctas_per_sm));
  }
  return best;
}

// The forward's plan among its instantiations (8, 16, 32 elements per thread).
inline Plan plan_forward_rows(int64_t hidden, int vec, int64_t rows, const Device& device,
                              const std::vector<Resources>& candidates) {
  return plan_rows(hidden, vec, rows, device, candidates, Needs{kForwardSharedPerWarp});
}

// The backward's: weight-gradient accumulators in registers where an instantiation holds the
// row (as the anchors keep them), else in shared memory.
inline Plan plan_backward_rows(int64_t hidden, int vec, int64_t rows, const Device& device,
                               const std::vector<Resources>& in_registers, const std::vector<Resources>& in_shared) {
  const Plan p = plan_rows(hidden, vec, rows, device, in_registers, Needs{kBackwardSharedPerWarp});
  return p.tiled ? p : plan_rows(hidden, vec, rows, device, in_shared, Needs{kBackwardSharedPerWarp});
}

}  // namespace plan
}  // namespace megatron_siamese
