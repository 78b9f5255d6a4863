"""The CPU shim leaves torch's device contexts working, during and after it (transformers loads
models under ``with torch.device("meta")``; export and eval load them in processes that ran
Megatron through the shim)."""

import subprocess
import sys


# the first device context of a fresh process opened while the shim is installed: torch then
# builds its set of factory functions, which must hold the real factories, not the shim's wrappers
FIRST_CONTEXT_UNDER_THE_SHIM = """
import torch
from megatron_siamese.runtime import cpu_shim
cpu_shim.install()
with torch.device("meta"):
    during = torch.arange(3).device.type
cpu_shim.uninstall()
with torch.device("meta"):
    after = torch.arange(3).device.type
print(during, after)
"""


def test_device_context_applies_while_and_after_the_shim_is_installed():
    result = subprocess.run([sys.executable, "-c", FIRST_CONTEXT_UNDER_THE_SHIM], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["meta", "meta"]
