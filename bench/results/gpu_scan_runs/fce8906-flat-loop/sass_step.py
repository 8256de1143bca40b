"""The SASS of the committed fused int8 stage 1 at d = 384 (group_max_kernel: 100-query tiling, 128 x 128 tiles,
128-channel steps, 3 stages), compiled for sm_90a without a GPU through ../edca7ac-row-loop/compile_loop.py's
method, with the instructions of one channel step's loop body in order of the events that matter (loads, waits,
barriers, fences, tensor-core products). Same venv and command as there: ``sass_step.py REPOSITORY_ROOT``."""
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "edca7ac-row-loop"))
import compile_loop as c  # noqa: E402 - the sibling run folder's compile helpers
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

D, CONSTEXPRS = 384, {"HAS_BIAS": False, "BLOCK_Q": 128, "BLOCK_N": 128, "GROUP_N": 64, "BLOCK_K": 128, "FUSED": True,
                      "GROUP_Q": 16}
EVENTS = ("LDGSTS", "LDGDEPBAR", "DEPBAR", "BAR.SYNC", "MEMBAR", "FENCE", "WARPGROUP", "IGMMA", "BRA", "EXIT")

signature = dict(c.SIGNATURE)
names = list(signature)
constexprs = {"K_PAD": D, "NBYTES": D // 2, "ASM": c.nibble_levels_asm(c.LEVELS),
              "FAST_MAX_ABS_SUM": c._stage.FAST_CONVERSION_MAX_ABS_SUM, **CONSTEXPRS}
signature.update({k: "constexpr" for k in constexprs})
attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in c.DIVISIBLE}
kernel = triton.compile(ASTSource(fn=c._stage.group_max_kernel, signature=signature, constexprs=constexprs, attrs=attrs),
                        target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 3})
tools = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin")
with tempfile.TemporaryDirectory() as tmp:
    Path(tmp, "k.ptx").write_text(kernel.asm["ptx"])
    subprocess.run([f"{tools}/ptxas", "--gpu-name", "sm_90a", f"{tmp}/k.ptx", "-o", f"{tmp}/k.cubin"], check=True)
    sass = subprocess.run([f"{tools}/cuobjdump", "-sass", f"{tmp}/k.cubin"], capture_output=True, text=True,
                          check=True).stdout
lines = [m.group(1, 2) for m in re.finditer(r"/\*([0-9a-f]{4})\*/\s+([^;]*);", sass)]
back = next(i for i, (_, ins) in enumerate(lines) if re.match(r"@!?P\d BRA 0x", ins) and
            int(ins.split("0x")[1], 16) < int(lines[i][0], 16))
start = next(i for i, (addr, _) in enumerate(lines) if int(addr, 16) == int(lines[back][1].split("0x")[1], 16))
print(f"loop body (one channel step): {back - start + 1} instructions, {lines[start][0]}-{lines[back][0]}")
run = 0
for addr, ins in lines[start:back + 1]:
    if any(e in ins for e in EVENTS):
        if run:
            print(f"    … {run} other instructions")
        print(f"{addr}  {ins.strip()}")
        run = 0
    else:
        run += 1
