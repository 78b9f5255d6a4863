"""Run a Megatron-LM script (e.g. pretrain_gpt.py) on CPU with gloo, for trying the
``--spec`` path without a GPU:

    torchrun --nproc-per-node 4 -m megatron_siamese.runtime.megatron_lm \\
        /path/to/Megatron-LM/pretrain_gpt.py --distributed-backend gloo \\
        --spec megatron_siamese.specs siamese_layer_spec ...

It installs the CPU shim, then runs the script as ``__main__``. On GPUs none of this is
needed: run the script itself.
"""

from __future__ import annotations

import os

# Read by torch at import: set before anything imports it. Megatron-LM warms up its
# jit fusions with torch.compile, which has no CPU compiler setup to rely on here.
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")

import runpy  # noqa: E402
import sys  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import torch  # noqa: E402

from megatron_siamese.runtime import cpu_shim  # noqa: E402

SERVER_HOST_ENV = "MEGATRON_SIAMESE_SERVER_HOST"  # where a text generation server listens (default 127.0.0.1)


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    script = os.path.abspath(sys.argv[1])
    sys.argv = [script, *sys.argv[2:]]
    sys.path.insert(0, os.path.dirname(script))  # its megatron.training, before the patches below
    serve_megatron_training_on_cpu()
    _serve_on_localhost()
    runpy.run_path(script, run_name="__main__")


def serve_megatron_training_on_cpu() -> None:
    """The CPU shim, and what Megatron-LM's training loop (not megatron-core) asks of CUDA served
    on CPU: it asserts CUDA and reads device properties and memory statistics."""
    os.environ[cpu_shim.ENV_VAR] = "1"
    cpu_shim.install()
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 1  # it sets up model parallelism only with a device
    torch.cuda.set_device = lambda *args, **kwargs: None
    torch.cuda.get_device_properties = lambda *args, **kwargs: SimpleNamespace(
        major=9, minor=0, name="CPU (megatron_siamese shim)", total_memory=0, multi_processor_count=1
    )
    for name in ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved"):
        setattr(torch.cuda, name, lambda *args, **kwargs: 0)
    torch.cuda.reset_peak_memory_stats = lambda *args, **kwargs: None
    # torch < 2.14's optimizers ask torch.cuda, then whether a CUDA graph is being captured: none is
    torch.cuda.is_current_stream_capturing = lambda: False
    # torch itself (optimizers, data loaders) asks torch.accelerator, not torch.cuda: there is none
    if hasattr(torch, "accelerator"):
        torch.accelerator.current_accelerator = lambda check_available=False: None
        torch.accelerator.is_available = lambda: False
    # its data loaders pin host memory for the GPU (a CUDA build of torch then initializes CUDA)
    original_loader_init = torch.utils.data.DataLoader.__init__

    def loader_init(self, *args, **kwargs):
        original_loader_init(self, *args, **{**kwargs, "pin_memory": False})

    torch.utils.data.DataLoader.__init__ = loader_init
    try:  # its legacy fused-kernel hook only probes nvcc's version (and needs CUDA_HOME)
        from megatron.legacy import fused_kernels

        fused_kernels.load = lambda args: None
    except ImportError:
        pass
    _keep_built_dataset_helpers()
    _activation_and_dgrad_logging_on_cpu()
    from megatron_siamese.runtime import cpu_checkpoint_worker

    cpu_checkpoint_worker.install()
    _warm_up_without_drawing_the_init()
    _build_loaders_without_drawing_dropout()


def _build_loaders_without_drawing_dropout() -> None:
    """On CPU dropout and each ``iter(DataLoader)`` draw from the one CPU generator, and ``pretrain()``
    restores a checkpoint's RNG state before building the iterators: a resumed run drew other dropout
    masks. The iterators are built on a forked RNG state (0.17+)."""
    try:
        from megatron.training import training
    except ImportError:
        return
    build = training.build_train_valid_test_data_iterators

    def build_on_forked_rng(*args, **kwargs):
        with torch.random.fork_rng(devices=[]):
            return build(*args, **kwargs)

    training.build_train_valid_test_data_iterators = build_on_forked_rng


def _warm_up_without_drawing_the_init() -> None:
    """Its start-up warms up the jit fusions on ``torch.rand`` tensors of ``seq_length / cp`` rows; on CPU
    they draw from the generator the weights are drawn from next, so each CP size built another model.
    The warm-up keeps its own RNG state here (docs/megatron-lm.md)."""
    try:
        from megatron.training import initialize
    except ImportError:
        return
    warm_up = initialize._warmup_jit_function

    def warm_up_on_forked_rng(*args, **kwargs):  # 0.19's takes the parallel sizes
        with torch.random.fork_rng(devices=[]):
            return warm_up(*args, **kwargs)

    initialize._warmup_jit_function = warm_up_on_forked_rng


def _activation_and_dgrad_logging_on_cpu() -> None:
    """Its activation and dgrad logging (``--save-activations-interval``, ``--save-dgrads-interval``): the
    module types they hook count TE's classes, MagicMocks without TE, which ``isinstance`` refuses (a
    TypeError at the first logged step); and they keep ``tensor.detach().cpu()``, a copy from a GPU, on CPU
    the tensor itself, which the cross entropy overwrites in place (the saved logits were the loss's
    gradient). Here they hook real classes, and their hooks are handed copies."""
    try:
        from megatron.training import activation_logging, dgrad_logging
    except ImportError:  # a release without them
        return

    def copies(values):
        return torch.utils._pytree.tree_map_only(torch.Tensor, lambda tensor: tensor.detach().clone(), values)

    def handing_copies(make_hook):
        def make(self, *args):
            hook = make_hook(self, *args)
            return lambda module, *values: hook(module, *copies(values))

        return make

    for module in (activation_logging, dgrad_logging):
        module.LINEAR_TYPES = tuple(kind for kind in module.LINEAR_TYPES if isinstance(kind, type))
    logger = activation_logging.ActivationLogger
    logger._make_activation_hook = handing_copies(logger._make_activation_hook)
    dgrad_logging.DataGradLogger._make_hook = handing_copies(dgrad_logging.DataGradLogger._make_hook)


def _keep_built_dataset_helpers() -> None:
    """Its start-up compiles the dataset helpers with the ``python3`` on PATH and exits if that fails;
    a tree already holding them built for this interpreter needs no compiler."""
    try:
        from megatron.core.datasets import helpers_cpp  # noqa: F401
        from megatron.core.datasets import utils
    except ImportError:
        return
    utils.compile_helpers = lambda: None


def _serve_on_localhost() -> None:
    """Its text generation servers listen on every interface (``0.0.0.0``, hard-coded): a CPU
    trial serves this machine only, unless SERVER_HOST_ENV names another address."""
    try:
        from megatron.core.inference.text_generation_server import text_generation_server
    except ImportError:  # a release without the server
        return
    host = os.environ.get(SERVER_HOST_ENV, "127.0.0.1")
    original_run = text_generation_server.MegatronServer.run

    def run(self, url, port):
        original_run(self, host, port)

    text_generation_server.MegatronServer.run = run


if __name__ == "__main__":
    main()
