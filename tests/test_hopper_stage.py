"""The Gluon stage 1 for Hopper (tqvec.kernels.hopper_stage, on code tiles and on decoded rows), compiled for sm_90a
without a GPU.

Gluon kernels do not run under ``TRITON_INTERPRET=1``, so CI checks what the kernel is for in its machine code: the
tensor-core products of a channel step are waited for only after the next step's decode or copies (``wgmma`` groups
waited down to one outstanding inside the loop), and two blocks fit a multiprocessor without spilling. Its results are
compared with the Triton kernel's on a Hopper GPU (tests/test_kernels.py, ``test_hopper_stage_equals_triton_kernel``).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
pytest.importorskip("tqvec.kernels.hopper_stage")

#: the H100's and H200's shared memory per multiprocessor usable by blocks, and what the driver keeps per block
SHARED_PER_MULTIPROCESSOR = 227 * 1024
DRIVER_SHARED_PER_BLOCK = 1024


def compile_sm90(stage: str, dim: int, bias: bool, tmp_path: Path) -> tuple[str, str, int]:
    """SASS, ``cuobjdump -res-usage`` line and shared memory (bytes) of the kernel on code tiles (``stage`` ``"fused"``)
    or decoded rows (``"decoded"``) for ``dim`` channels, compiled by tests/support/hopper_sass.py in a process without
    ``TRITON_INTERPRET``."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).parent / "support" / "hopper_sass.py"
    done = subprocess.run([sys.executable, script, stage, str(dim), str(bias), tmp_path], env=env, capture_output=True,
                          text=True, check=True)
    result = json.loads(done.stdout)
    return result["sass"], result["usage"], result["shared"]


def loop_body(sass: str) -> list[str]:
    """The instructions of the SASS's loop holding the tensor-core products (from a backward branch's target to it)."""
    lines = [(int(m.group(1), 16), m.group(2).strip()) for m in re.finditer(r"/\*([0-9a-f]{4})\*/\s+([^;]*);", sass)]
    for i, (address, text) in enumerate(lines):
        branch = re.match(r"(@!?U?P\d )?BRA 0x([0-9a-f]+)", text)
        if branch and int(branch.group(2), 16) < address:
            body = [t for a, t in lines[: i + 1] if a >= int(branch.group(2), 16)]
            if any("IGMMA" in t for t in body):
                return body
    raise AssertionError("no loop with tensor-core products in the SASS")


STAGES = ["fused", "decoded"]


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("dim,bias", [(384, False), (1536, True)])
def test_products_are_waited_for_one_step_late(stage: str, dim: int, bias: bool, tmp_path: Path) -> None:
    """Inside the loop over channel steps the products are issued (``IGMMA``) and the warps wait only until one group
    of them is outstanding (``WARPGROUP.DEPBAR.LE gsb0, 0x1``), so a step's products run during the next step's
    decode or copies; the copies into the ring (``LDGSTS``) come after that wait; the last group is waited for after
    the loop."""
    sass, _, _ = compile_sm90(stage, dim, bias, tmp_path)
    body = loop_body(sass)
    waits = [t for t in body if t.startswith("WARPGROUP.DEPBAR")]
    assert sum("IGMMA" in t for t in body) == 8 and waits == ["WARPGROUP.DEPBAR.LE gsb0, 0x1"]
    assert "WARPGROUP.DEPBAR.LE gsb0, 0x0" in sass.split(body[-1], 1)[1]
    # the copies refilling the ring come after that wait: the slot they refill is no longer read by products
    copies = [i for i, t in enumerate(body) if "LDGSTS" in t]
    assert copies and min(copies) > body.index(waits[0])


@pytest.mark.parametrize("stage", STAGES)
def test_two_blocks_fit_a_multiprocessor(stage: str, tmp_path: Path) -> None:
    """At most 255 registers per thread and no spills to local memory; two blocks' shared memory fits a Hopper
    multiprocessor, so two tiles overlap there."""
    _, usage, shared = compile_sm90(stage, 768, True, tmp_path)
    registers = int(re.search(r"REG:(\d+)", usage).group(1))
    assert registers <= 255 and "LOCAL:0 " in usage
    assert 2 * (shared + DRIVER_SHARED_PER_BLOCK) <= SHARED_PER_MULTIPROCESSOR
