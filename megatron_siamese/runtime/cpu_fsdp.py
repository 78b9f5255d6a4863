"""Megatron's fully sharded data parallelism on the CPU shim (cpu_shim.py installs these).

The device meshes its FSDP2 wrapper and Megatron-FSDP's adapter build for CUDA are made on the CPU,
and Megatron-FSDP's parameter all-gathers finish before they return: async on gloo, they ran on the
worker thread beside the rank's own work and corrupted its heap about once in 120 runs
(docs/testing.md, "Memory safety in the ranks"). One CPU has no overlap to lose.
"""

from __future__ import annotations

import functools
from typing import Any, Dict, Tuple


class _MeshOnCpu:
    """``DeviceMesh`` where Megatron's FSDP wrappers name it: meshes asked for on CUDA, on the CPU."""

    @staticmethod
    def from_group(group, device_type: str, *args: Any, **kwargs: Any):
        from torch.distributed.device_mesh import DeviceMesh

        on_cuda = isinstance(device_type, str) and device_type.startswith("cuda")
        return DeviceMesh.from_group(group, "cpu" if on_cuda else device_type, *args, **kwargs)


def replacements() -> Dict[Tuple[Any, str], Any]:
    """(owner, attribute) -> replacement: the meshes on the CPU, Megatron-FSDP's gathers waited."""
    import importlib

    torch_fsdp2, adapter = (importlib.import_module("megatron.core.distributed.torch_fully_sharded_data_parallel"),
                            importlib.import_module("megatron.core.distributed.fsdp.mcore_fsdp_adapter"))
    buffers = importlib.import_module("megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer")
    gather = buffers.AllGatherPipeline.all_gather_params

    @functools.wraps(gather)
    def all_gather_params(self, params, *args, **kwargs):
        kwargs["async_param_gather"] = False  # waited before it returns (module docstring)
        return gather(self, params, *args, **kwargs)

    return {(torch_fsdp2, "DeviceMesh"): _MeshOnCpu, (adapter, "DeviceMesh"): _MeshOnCpu,
            (buffers.AllGatherPipeline, "all_gather_params"): all_gather_params}
