"""Where the Triton kernel tests run: on CUDA when a GPU is visible, else on the CPU through Triton's interpreter.

Importing this module sets ``TRITON_INTERPRET=1`` when no GPU is visible (before any test imports
``tqvec.kernels``: ``conftest.py`` imports it first; ``make test`` sets the variable too). The folder is on
``sys.path`` through pytest's ``pythonpath`` setting, so test modules import it as ``kernel_env``.
"""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

#: True when the Triton kernels run on the CPU interpreter
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
#: the device kernel tests put their tensors on
KERNEL_DEVICE = "cpu" if INTERPRET else "cuda"
#: mark for tests that need the kernels to run somewhere
needs_kernels = pytest.mark.skipif(not (torch.cuda.is_available() or INTERPRET),
                                   reason="needs a CUDA GPU or TRITON_INTERPRET=1")
