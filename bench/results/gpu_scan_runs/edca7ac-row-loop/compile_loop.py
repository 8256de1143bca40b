"""Registers, spills and shared memory of the experiment's group_max_loop_kernel (row_loop.patch applied) and of
group_max_kernel per tiling, compiled for sm_90a without a GPU, as ../0898a92-register-budget/compile_variants.py does
(same venv and command: ``compile_loop.py REPOSITORY_ROOT > registers.md``)."""
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

ROOT = Path(sys.argv[1]).resolve()
_spec = importlib.util.spec_from_file_location("checkout_kernels", ROOT / "kernels" / "__init__.py",
                                               submodule_search_locations=[str(ROOT / "kernels")])
sys.modules["checkout_kernels"] = _package = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_package)
nibble_levels_asm = importlib.import_module("checkout_kernels.dp4a_stage").nibble_levels_asm
_stage = importlib.import_module("checkout_kernels.int8_stage")

LEVELS = torch.tensor([-127, -100, -80, -60, -45, -30, -18, -6, 6, 18, 30, 45, 60, 80, 100, 127], dtype=torch.float32)
SIGNATURE = {"q_ptr": "*i8", "rows_ptr": "*u8", "scale_ptr": "*fp32", "bias_ptr": "*u8", "qfac_ptr": "*fp32",
             "abs_sum_ptr": "*i32", "grid_ptr": "*fp32", "out_ptr": "*fp32", "unit_ptr": "*fp32", "nq": "i32", "n": "i32",
             "group0": "i32", "stride_q": "i32", "stride_rows": "i32", "stride_out": "i32"}
DIVISIBLE = ("q_ptr", "rows_ptr", "scale_ptr", "bias_ptr", "qfac_ptr", "abs_sum_ptr", "grid_ptr", "out_ptr", "unit_ptr",
             "n", "stride_q", "stride_rows")


def compile_variant(loop: bool, fused: bool, d: int, block_q: int, rows: int, block_k: int, group: int, warps: int,
                    stages: int) -> dict:
    signature = dict(SIGNATURE, rows_ptr="*u8" if fused else "*i8")
    if loop:
        signature["lanes"] = "i32"
    names = list(signature)
    constexprs = {"K_PAD": d, "NBYTES": d // 2, "HAS_BIAS": False, "BLOCK_Q": block_q, "BLOCK_N": rows, "GROUP_N": group,
                  "BLOCK_K": block_k, "FUSED": fused, "ASM": nibble_levels_asm(LEVELS) if fused else "",
                  "FAST_MAX_ABS_SUM": _stage.FAST_CONVERSION_MAX_ABS_SUM}
    if loop:
        constexprs["STAGES"] = stages
    else:
        constexprs["GROUP_Q"] = 16
    signature.update({k: "constexpr" for k in constexprs})
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in DIVISIBLE}
    fn = _stage.group_max_loop_kernel if loop else _stage.group_max_kernel
    kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                            target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": warps, "num_stages": 1 if loop else stages})
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
    ttgir = kernel.asm["ttgir"]
    return {"regs": regs, "spill": spills, "smem_kib": smem / 1024, "blocks": blocks,
            "wgmma": "warp_group_dot" in ttgir, "async": ttgir.count("async_copy_global_to_local"),
            "tma": ttgir.count("async_tma_copy")}


VARIANTS = [  # loop, fused, d, block_q, rows, block_k, group, warps, stages
    (False, True, 128, 128, 128, 128, 128, 4, 3), (True, True, 128, 128, 128, 128, 128, 4, 2),
    (True, True, 128, 128, 128, 128, 128, 4, 3), (True, True, 128, 128, 128, 128, 128, 4, 1),
    (False, True, 384, 128, 128, 128, 64, 4, 3), (True, True, 384, 128, 128, 128, 64, 4, 2),
    (True, True, 384, 128, 128, 128, 64, 4, 1),
    (False, False, 128, 128, 128, 64, 128, 4, 3), (False, False, 128, 128, 128, 128, 128, 4, 3),
    (True, False, 128, 128, 128, 128, 128, 4, 2), (True, False, 128, 128, 128, 128, 128, 4, 3),
    (True, False, 128, 128, 128, 64, 128, 4, 2),
    (False, False, 128, 256, 128, 64, 128, 8, 3), (False, False, 128, 256, 128, 128, 128, 8, 3),
    (True, False, 128, 256, 128, 128, 128, 8, 2),
    (False, False, 384, 128, 128, 64, 64, 4, 3), (True, False, 384, 128, 128, 64, 64, 4, 2),
    (False, False, 384, 256, 128, 64, 64, 8, 3),
    (False, False, 1536, 128, 128, 64, 64, 4, 3), (True, False, 1536, 128, 128, 64, 64, 4, 2),
    (False, False, 1536, 256, 128, 64, 64, 8, 3),
]
if __name__ == "__main__":
    print("| kernel | rows | d | BQ | BN | BK | group | warps | stages | regs | spill B | smem KiB | blocks/SM "
          "| wgmma | cp.async | tma |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for v in VARIANTS:
        try:
            r = compile_variant(*v)
            print(f"| {'loop' if v[0] else 'tile'} | {'fused' if v[1] else 'decoded'} | " + " | ".join(map(str, v[2:]))
                  + f" | {r['regs']} | {r['spill']} | {r['smem_kib']:g} | {r['blocks']} | {r['wgmma']} | {r['async']} "
                  f"| {r['tma']} |",
                  flush=True)
        except Exception as exc:  # noqa: BLE001
            print(f"| {v} | error {type(exc).__name__}: {str(exc)[:200]} |", flush=True)
