"""Compile :func:`tqvec.kernels.hopper_stage.group_max_kernel` on code tiles (``fused``) or on decoded rows
(``decoded``) for sm_90a without a GPU; print its SASS, resource use and shared memory as JSON.

Run as a script in a process without ``TRITON_INTERPRET`` (under the interpreter Triton's own jitted helpers, which
Gluon kernels call, are interpreter functions and do not compile): ``python hopper_sass.py fused|decoded DIM BIAS OUT_DIR``.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource

from tqvec.kernels import hopper_stage
from tqvec.kernels.dp4a_stage import nibble_levels_asm
from tqvec.kernels.int8_stage import FAST_CONVERSION_MAX_ABS_SUM

#: a symmetric 4-bit codebook on the int8 grid
LEVELS = torch.tensor([-127, -100, -80, -60, -45, -30, -18, -6, 6, 18, 30, 45, 60, 80, 100, 127], dtype=torch.float32)
TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def compile_sm90(stage: str, dim: int, bias: bool, out_dir: Path) -> dict[str, object]:
    """``{"sass", "usage", "shared"}``: SASS, the ``cuobjdump -res-usage`` line and shared memory (bytes) of the kernel
    on code tiles (``stage`` ``"fused"``) or decoded rows (``"decoded"``) for ``dim`` channels (groups of 64 rows, 3
    stages, the queries resident up to 3 steps), the cubin written to ``out_dir``."""
    decoded = stage == "decoded"
    signature = {"q_ptr": "*i8", "codes_ptr": "*i8" if decoded else "*u8", "scale_ptr": "*fp32", "bias_ptr": "*fp32",
                 "qfac_ptr": "*fp32", "abs_sum_ptr": "*i32", "out_ptr": "*fp32", "unit_ptr": "*fp32", "nq": "i32",
                 "n": "i32", "stride_q": "i32", "stride_rows": "i32", "stride_out": "i32"}
    names = list(signature)
    k_pad = -(-dim // 128) * 128
    constexprs = {"K_PAD": k_pad, "NBYTES": k_pad if decoded else dim // 2, "HAS_BIAS": bias, "GROUP_N": 64,
                  "STAGES": 3, "RESIDENT_Q": dim <= 384, "ASM": "" if decoded else nibble_levels_asm(LEVELS),
                  "FAST_MAX_ABS_SUM": FAST_CONVERSION_MAX_ABS_SUM, "DECODED": decoded}
    signature.update({name: "constexpr" for name in constexprs})
    aligned = [name for name in names if name.endswith("_ptr")] + ["n", "stride_q", "stride_rows"]
    attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    kernel = triton.compile(GluonASTSource(hopper_stage.group_max_kernel, signature, constexprs, attrs),
                            target=GPUTarget("cuda", 90, 32), options={"num_warps": hopper_stage.NUM_WARPS})
    cubin = out_dir / "kernel.cubin"
    cubin.write_bytes(kernel.asm["cubin"])
    sass = subprocess.run([TOOLS / "cuobjdump", "-sass", cubin], capture_output=True, text=True, check=True).stdout
    usage = subprocess.run([TOOLS / "cuobjdump", "-res-usage", cubin], capture_output=True, text=True,
                           check=True).stdout
    return {"sass": sass, "usage": next(line for line in usage.splitlines() if "REG:" in line),
            "shared": kernel.metadata.shared}


if __name__ == "__main__":
    print(json.dumps(compile_sm90(sys.argv[1], int(sys.argv[2]), sys.argv[3] == "True", Path(sys.argv[4]))))
