"""Shared fixtures. Multi-rank tests launch their own processes (megatron_siamese.runtime.launch);
single-rank tests run Megatron in this process on CPU through the CPU harness.

Which stack a test runs on (docs/testing.md, "Two stacks"): every test runs on each stack of a
run, unless it is marked

* ``stack_independent``, which it may be only if it touches no Megatron API: it builds no
  Megatron model in this process (no ``megatron_single_rank``), starts no ranks (``launch``) and
  no Python process of it imports megatron (recorded through ``tests/megatron_guard``). A marked
  test that does any of these fails, naming what it did, so the mark cannot silently drop a
  version-dependent test from the second stack. It runs on the run's first stack;
* ``once(why)``: it uses Megatron, but what it proves is ours or torch's (the launch, the
  sanitizer harness, the plan's arithmetic, the baselines' layer code), and the Megatron paths it
  goes through run on every stack in other tests. It runs on the run's first stack (whose leg
  has the time: the second builds the CUDA extension first);
* ``users_stack(why)``: as ``once``, but it needs the release users install (the GPU kit carries
  megatron-core 0.19.2): it runs on the run's last stack.

``why`` says which of these holds.

Tests are independent of their order: ``megatron_single_rank`` sets up and tears down the CPU
shim, torch.distributed and Megatron's process groups around each test that asks for them.
MEGATRON_SIAMESE_TEST_ORDER=reverse or shuffle:SEED reorders the collected tests (to prove it).
"""

import contextlib
import os
import random
import sys
from pathlib import Path

import pytest
import torch

# Set by scripts/test.sh: the stacks of this run, in order, and the one running now.
RUN_STACKS = os.environ.get("MEGATRON_SIAMESE_TEST_STACKS", "").split()
THIS_STACK = os.environ.get("MEGATRON_SIAMESE_TEST_STACK", "")
ORDER_ENV = "MEGATRON_SIAMESE_TEST_ORDER"
GUARD = Path(__file__).resolve().parent / "megatron_guard"


@pytest.fixture
def two_cpu_threads():
    """The CPU kernels split their rows into one block per thread and add the blocks' weight-gradient
    partials in order (csrc/cpu_rows.h): two threads take that path whatever thread count the run gives
    torch (scripts/test.sh gives each of two stacks side by side one thread on two cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "stack_independent: touches no Megatron API (no Megatron model, no ranks, no process importing "
        "megatron; enforced in tests/conftest.py); in a run over several stacks (scripts/test.sh) it runs on the "
        "first only")
    config.addinivalue_line(
        "markers", "once(why): uses Megatron, but proves something of ours or torch's whose Megatron paths other "
        "tests run on every stack; in a run over several stacks it runs on the first only")
    config.addinivalue_line(
        "markers", "users_stack(why): as once, but needs the release users install; in a run over several stacks "
        "it runs on the last only (megatron-core 0.19)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failure of a launched job (RankFailed, one line) shows every rank's traceback and output."""
    outcome = yield
    details = getattr(call.excinfo.value, "details", "") if call.excinfo is not None else ""
    if details:
        outcome.get_result().sections.append(("every rank (RankFailed.details)", details))


def pytest_collection_modifyitems(config, items):
    order = os.environ.get(ORDER_ENV, "")
    if order == "reverse":
        items.reverse()
    elif order.startswith("shuffle:"):
        random.Random(int(order.split(":", 1)[1])).shuffle(items)
    elif order:
        raise pytest.UsageError(f"{ORDER_ENV} must be 'reverse' or 'shuffle:SEED', got {order!r}")
    for item in items:
        for name in ("once", "users_stack"):
            mark = item.get_closest_marker(name)
            if mark is not None and not (mark.args and mark.args[0]):
                raise pytest.UsageError(f"{item.nodeid}: {name} needs its reason, {name}(why)")
    if len(RUN_STACKS) < 2:
        return
    first, last = RUN_STACKS[0], RUN_STACKS[-1]
    for item in items:
        if item.get_closest_marker("stack_independent"):  # touches no Megatron: the first stack, whichever
            if THIS_STACK != first:
                item.add_marker(pytest.mark.skip(reason=f"stack-independent: ran on {first}, the first stack of this run"))
        elif mark := item.get_closest_marker("users_stack"):  # before once: a module's once, a test's users_stack
            if THIS_STACK != last:
                item.add_marker(pytest.mark.skip(reason=f"runs on {last}, the users' stack, only: {mark.args[0]}"))
        elif THIS_STACK != first and (mark := item.get_closest_marker("once")):
            item.add_marker(pytest.mark.skip(reason=f"runs once, on {first}: {mark.args[0]}"))


@pytest.fixture(autouse=True)
def stack_independent_touches_no_megatron(request, monkeypatch, tmp_path_factory):
    """For a test marked ``stack_independent``: fails it if it used Megatron after all."""
    if request.node.get_closest_marker("stack_independent") is None:
        yield
        return
    in_process = {"megatron_single_rank", "megatron_module_rank"} & set(request.fixturenames)
    if in_process:
        pytest.fail(f"marked stack_independent but builds Megatron in this process ({in_process.pop()}): "
                    "remove the mark, it runs on every stack")
    log = tmp_path_factory.mktemp("megatron-imports") / "imports.log"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(GUARD), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("MEGATRON_SIAMESE_TEST_IMPORT_LOG", str(log))
    from megatron_siamese.runtime import launch

    launched = []
    real_start_method = launch.start_method  # what every launch of ranks in this process asks for first
    monkeypatch.setattr(launch, "start_method", lambda backend, *preload: launched.append(backend)
                        or real_start_method(backend, *preload))
    yield
    if launched:
        pytest.fail("marked stack_independent but starts ranks in this process (launch): remove the mark")
    if log.exists():
        pytest.fail("marked stack_independent but a process it started imported megatron: remove the mark, it runs "
                    "on every stack\n" + log.read_text())


@contextlib.contextmanager
def single_rank():
    """torch.distributed (gloo, world size 1) and Megatron's process groups at TP=PP=1, with the
    CPU shim on a CPU machine, for the duration; what it set up is undone after (nothing when an
    enclosing one already set them up)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_siamese.runtime import cpu_shim
    from megatron_siamese.runtime.launch import free_port

    if parallel_state.model_parallel_is_initialized():  # inside a module's megatron_module_rank
        yield
        return
    shim = not torch.cuda.is_available() and not cpu_shim.is_installed()
    if shim:
        cpu_shim.install()
    owns_group = not torch.distributed.is_initialized()
    rendezvous = {name: os.environ.get(name) for name in ("MASTER_ADDR", "MASTER_PORT")}  # put back after
    if owns_group:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(free_port())
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        torch.distributed.init_process_group(backend, rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1234)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        if owns_group and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        for name, value in rendezvous.items():  # a later test's processes must not inherit them
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        if shim:
            cpu_shim.uninstall()


@pytest.fixture
def megatron_single_rank():
    """Megatron on one rank in this process for the test (``single_rank``)."""
    with single_rank():
        yield


@pytest.fixture(scope="module")
def megatron_module_rank():
    """Megatron on one rank in this process for a module's fixtures that build models once."""
    with single_rank():
        yield


# -- runs shared by the session --------------------------------------------------------------

# the model of the embedded default job (what our commands' model flags default to), smaller
SMALL_RUN = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--ffn-hidden-size", "128",
             "--seq-length", "32", "--max-position-embeddings", "32", "--normalization", "RMSNorm", "--swiglu",
             "--disable-bias-linear", "--position-embedding-type", "rope", "--micro-batch-size", "2",
             "--global-batch-size", "4", "--lr", "1e-3", "--eval-iters", "1", "--eval-interval", "100",
             "--log-interval", "1"]


def logged_losses(stdout: str) -> dict:
    """Step -> training loss, from Megatron-LM's iteration lines (--log-interval 1: one per step)."""
    import re

    return {int(step): float(loss) for step, loss in
            re.findall(r"iteration\s+(\d+)/\s*\d+ \|.*?\| lm loss: ([0-9.E+-]+) \|", stdout)}


@pytest.fixture(scope="session")
def corpus_cache(tmp_path_factory):
    """One cache directory for the session: the embedded corpus is tokenized once."""
    return str(tmp_path_factory.mktemp("corpus-cache"))


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory, corpus_cache) -> Path:
    """A run's directory as scripts/run.sh leaves one: a 4-step SiameseNorm run of Megatron-LM's loop
    on one rank (SMALL_RUN) with checkpoints at steps 2 and 4 in ``checkpoints/``, for the tests of
    the commands that read a checkpoint (a test that changes it works on a copy: shutil.copytree).
    megatron-core 0.16.1 has no such loop: the tests that need it are skipped there."""
    from cli_runs import train_here
    from megatron_siamese.versions import ships_megatron_training

    if not ships_megatron_training():
        pytest.skip("megatron-core < 0.17: no Megatron-LM loop to train the checkpoint with")
    root = tmp_path_factory.mktemp("trained") / "run"
    done = train_here(*SMALL_RUN, "--train-iters", "4", "--save", root / "checkpoints", "--save-interval", "2",
                      ranks=1, env={"MEGATRON_SIAMESE_CACHE": corpus_cache})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert sorted(logged_losses(done.stdout)) == [1, 2, 3, 4], done.stdout[-3000:]
    return root


@pytest.fixture(autouse=True)
def fresh_megatron_state():
    """After each test, Megatron's process-wide MoE and multi-token prediction state, which a
    training loop sets up per run: the aux-loss and MTP-loss gradient scales (a backward outside a
    schedule leaves the aux-loss one 0-d, and a schedule then fails to copy its [1] scale into it;
    a schedule leaves the MTP one its last step's)
    and the per-layer router and MTP loss statistics (sized by the first model that records them)."""
    yield
    mtp = sys.modules.get("megatron.core.transformer.multi_token_prediction")
    if mtp is not None:
        mtp.MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0))  # its class default
        mtp.MTPLossLoggingHelper.tracker.clear()
    moe_utils = sys.modules.get("megatron.core.transformer.moe.moe_utils")
    if moe_utils is None:
        return
    moe_utils.MoEAuxLossAutoScaler.main_loss_backward_scale = None
    try:
        from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker  # megatron-core >= 0.19
    except ImportError:  # 0.16
        moe_utils.clear_aux_losses_tracker()
        moe_utils.get_moe_layer_wise_logging_tracker().clear()  # 0.16 only zeroes it, sized by its first model
        return
    moe_utils.get_moe_metrics_tracker().clear()
    destroy_moe_metrics_tracker()
