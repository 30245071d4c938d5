"""Writes csrc/wgmma_dense.cuh: inline-PTX wrappers of dense ``wgmma`` m64nNk16 with A and B both MN-major in shared
memory (``imm-trans-a = imm-trans-b = 1``), one per N/dtype, for the SDDMM (csrc/sddmm_sm90.cu).

Each wrapper lists N/2 accumulator operands, too many to write by hand without mistakes. Run from the repo root:
``python csrc/gen_wgmma_dense.py`` (only after changing ``NS``; the output is
committed).
"""

from __future__ import annotations

from wgmma_codegen import accumulators, write_header

NS = (64, 128, 256)  # the SDDMM's condensed-column tiles

COMMENT = """// Dense wgmma (sm_90a) m64nNk16, A (64 x 16) and B (16 x N) both from shared memory through matrix descriptors, both
// MN-major (imm-trans-a = imm-trans-b = 1: A stored K rows of 64 M-contiguous elements, B K rows of N-contiguous
// elements); fp32 accumulators in d, scale-d = 1 (accumulate), no negation. Must only be compiled for sm_90a
// (callers guard with __CUDA_ARCH_FEAT_SM90_ALL).
"""


def wrapper(n: int, ptx_type: str, cxx_type: str) -> str:
    nd, regs, outs = accumulators(n)
    return f"""
template <>
struct WgmmaMN<{n}, {cxx_type}> {{
  static __device__ __forceinline__ void run(float (&d)[{nd}], uint64_t desc_a, uint64_t desc_b) {{
    asm volatile(
        "{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{nd + 2}, 0;\\n"
        "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{ptx_type}.{ptx_type} "
        "{{{regs}}}, "
        "%{nd}, %{nd + 1}, p, 1, 1, 1, 1;\\n}}\\n"
        : {outs}
        : "l"(desc_a), "l"(desc_b), "r"(1));
  }}
}};
"""


def main() -> None:
    write_header("wgmma_dense.cuh", "gen_wgmma_dense.py", COMMENT, [("WgmmaMN", wrapper, NS)])


if __name__ == "__main__":
    main()
