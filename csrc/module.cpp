// The extension's Python module (megatron_siamese._C). Importing it loads the ops, which
// ops.cpp registers with torch.library (torch.ops.megatron_siamese). Apart from ops.cpp, and on
// pybind11 alone, not torch/extension.h, which costs ops.cpp two thirds of its compile time.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "kernel_generation.h"
#include "launch_plan.h"

// The module carries the CUDA kernel setting and the tiled kernels' launch plan, a pure
// function, so tests plan every width on CPU with the resources ptxas reports.
namespace {
namespace py = pybind11;
using Candidate = std::tuple<int, int, int, int, int>;  // chunks, shared_per_column, registers, local, static shared

std::vector<megatron_siamese::plan::Resources> resources_of(const std::vector<Candidate>& candidates) {
  std::vector<megatron_siamese::plan::Resources> out;
  for (const auto& [chunks, shared_per_column, registers, local, static_shared] : candidates)
    out.push_back({chunks, shared_per_column, registers, local, static_shared});
  return out;
}

megatron_siamese::plan::Device device_of(int sms, int shared_per_sm, int shared_per_cta) {
  megatron_siamese::plan::Device d;
  d.sms = sms, d.shared_per_sm = shared_per_sm, d.shared_per_cta = shared_per_cta;
  return d;
}

py::dict as_dict(const megatron_siamese::plan::Plan& p) {
  py::dict d;
  d["tiled"] = p.tiled, d["shared_accumulators"] = p.shared_accumulators, d["instantiation"] = p.instantiation;
  d["chunks"] = p.chunks, d["threads_per_row"] = p.threads_per_row, d["rows_per_cta"] = p.rows_per_cta;
  d["ctas_per_sm"] = p.ctas_per_sm, d["grid"] = p.grid, d["dynamic_shared"] = p.dynamic_shared;
  return d;
}
}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using megatron_siamese::KernelGeneration;
  m.def("cuda_kernel_generation", [] {
    return megatron_siamese::cuda_kernel_generation() == KernelGeneration::kTiled ? "tiled" : "verified";
  });
  m.def(
      "plan_forward_rows",
      [](int64_t hidden, int vec, int64_t rows, int sms, int shared_per_sm, int shared_per_cta,
         const std::vector<Candidate>& candidates) {
        return as_dict(megatron_siamese::plan::plan_forward_rows(hidden, vec, rows, device_of(sms, shared_per_sm, shared_per_cta),
                                                                 resources_of(candidates)));
      });
  m.def(
      "plan_backward_rows",
      [](int64_t hidden, int vec, int64_t rows, int sms, int shared_per_sm, int shared_per_cta,
         const std::vector<Candidate>& in_registers, const std::vector<Candidate>& in_shared) {
        return as_dict(megatron_siamese::plan::plan_backward_rows(
            hidden, vec, rows, device_of(sms, shared_per_sm, shared_per_cta), resources_of(in_registers),
            resources_of(in_shared)));
      });
}
