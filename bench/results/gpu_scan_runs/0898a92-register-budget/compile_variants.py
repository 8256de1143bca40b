"""Registers, spills and shared memory of the int8 stage-1 kernel (``kernels/int8_stage.py``'s ``group_max_kernel``)
per tiling, compiled for the H100/H200 (sm_90a) on a machine without a GPU, and the blocks per multiprocessor they
allow. Run with Triton 3.6 (the device image's) and torch importable, given the checkout's root::

    python -m venv /tmp/t36 && /tmp/t36/bin/pip install triton==3.6.0 numpy
    PYTHONPATH=/tmp/t36/lib/python3.11/site-packages:.venv/lib/python3.11/site-packages \\
        /tmp/t36/bin/python compile_variants.py REPOSITORY_ROOT [committed]

committed: only the committed tilings (128-row tiles), for a checkout without subtile.patch (whose kernel cannot
take a group of several tiles).

Pointers, ``n`` and the strides are declared divisible by 16, as Triton specializes them at gpu_scan's shapes (without
that hint the counts do not match Nsight Compute's). Occupancy: 64K registers per multiprocessor allocated per warp in
steps of 8 per thread, 228 KiB of shared memory less 1 KiB per block, at most 64 warps.
"""
import importlib
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

# the checkout's kernels/ under another name (imported as "kernels" it defers to an installed package of that name)
ROOT = Path(sys.argv[1] if len(sys.argv) > 1 else ".").resolve()
_spec = importlib.util.spec_from_file_location("checkout_kernels", ROOT / "kernels" / "__init__.py",
                                               submodule_search_locations=[str(ROOT / "kernels")])
sys.modules["checkout_kernels"] = _package = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_package)
nibble_levels_asm = importlib.import_module("checkout_kernels.dp4a_stage").nibble_levels_asm
_stage = importlib.import_module("checkout_kernels.int8_stage")
FAST_CONVERSION_MAX_ABS_SUM, group_max_kernel = _stage.FAST_CONVERSION_MAX_ABS_SUM, _stage.group_max_kernel

LEVELS = torch.tensor([-127, -100, -80, -60, -45, -30, -18, -6, 6, 18, 30, 45, 60, 80, 100, 127], dtype=torch.float32)
SIGNATURE = {"q_ptr": "*i8", "rows_ptr": "*u8", "scale_ptr": "*fp32", "bias_ptr": "*u8", "qfac_ptr": "*fp32",
             "abs_sum_ptr": "*i32", "grid_ptr": "*fp32", "out_ptr": "*fp32", "unit_ptr": "*fp32", "nq": "i32", "n": "i32",
             "group0": "i32", "stride_q": "i32", "stride_rows": "i32", "stride_out": "i32"}
DIVISIBLE = ("q_ptr", "rows_ptr", "scale_ptr", "bias_ptr", "qfac_ptr", "abs_sum_ptr", "grid_ptr", "out_ptr", "unit_ptr",
             "n", "stride_q", "stride_rows")
# (fused, d, rows per tile, channels per step, rows per group); the first of each d is the committed tiling
VARIANTS = [(True, 128, 128, 128, 128), (True, 128, 64, 128, 128), (True, 128, 32, 128, 128),
            (True, 384, 128, 128, 64), (True, 384, 64, 128, 64), (True, 384, 64, 64, 64),
            (True, 1536, 128, 128, 64), (True, 1536, 64, 128, 64),
            (False, 128, 128, 64, 128), (False, 128, 64, 128, 128), (False, 128, 32, 128, 128),
            (False, 384, 128, 64, 64), (False, 384, 64, 128, 64),
            (False, 1536, 128, 64, 64), (False, 1536, 64, 128, 64)]


def compile_variant(fused: bool, d: int, rows: int, block_k: int, group: int, warps: int = 4, stages: int = 3) -> dict:
    signature = dict(SIGNATURE, rows_ptr="*u8" if fused else "*i8")
    names = list(signature)
    constexprs = {"K_PAD": d, "NBYTES": d // 2, "HAS_BIAS": False, "BLOCK_Q": 128, "BLOCK_N": rows, "GROUP_N": group,
                  "BLOCK_K": block_k, "GROUP_Q": 16, "FUSED": fused, "ASM": nibble_levels_asm(LEVELS) if fused else "",
                  "FAST_MAX_ABS_SUM": FAST_CONVERSION_MAX_ABS_SUM}
    signature.update({k: "constexpr" for k in constexprs})
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in DIVISIBLE}
    kernel = triton.compile(ASTSource(fn=group_max_kernel, signature=signature, constexprs=constexprs, attrs=attrs),
                            target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "k.ptx")
        open(ptx, "w").write(kernel.asm["ptx"])
        log = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", ptx, "-o", os.path.join(tmp, "k.cubin")],
                             capture_output=True, text=True, check=True).stderr
    regs = int(re.search(r"Used (\d+) registers", log).group(1))
    spills = int(re.search(r"(\d+) bytes spill stores", log).group(1))
    smem = kernel.metadata.shared
    blocks = min(65536 // (-(-regs // 8) * 8 * 32 * warps), (228 * 1024) // (smem + 1024), 64 // warps)
    return {"regs": regs, "spill_bytes": spills, "smem_kib": smem / 1024, "blocks_per_sm": blocks,
            "warps_per_sm": blocks * warps}


if __name__ == "__main__":
    print(f"Triton {triton.__version__}, sm_90a, 128 queries per tile, 4 warps, 3 stages\n")
    print("| rows | d | rows per tile | channels per step | rows per group | registers | spill bytes | shared KiB "
          "| blocks per SM | warps per SM |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    committed_only = sys.argv[2:] == ["committed"]
    for fused, d, rows, block_k, group in VARIANTS:
        if committed_only and rows != 128:
            continue
        r = compile_variant(fused, d, rows, block_k, group)
        print(f"| {'packed (fused)' if fused else 'decoded'} | {d} | {rows} | {block_k} | {group} | {r['regs']} | "
              f"{r['spill_bytes']} | {r['smem_kib']:g} | {r['blocks_per_sm']} | {r['warps_per_sm']} |")
