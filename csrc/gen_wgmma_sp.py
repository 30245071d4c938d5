"""Writes csrc/wgmma_sp.cuh: inline-PTX wrappers of sparse ``wgmma`` (m64nNk32, A from registers), one per N/dtype,
with B K-major (``WgmmaSp``: X as PyTorch hands it) and MN-major (``WgmmaSpT``: the token-contiguous X^T tile of the
V:2:M SpMM's large-token path).

Each wrapper lists N/2 accumulator operands, too many to write by hand without mistakes. Run from the repo root:
``python csrc/gen_wgmma_sp.py`` (only after changing ``NS``; the output is
committed).
"""

from __future__ import annotations

from wgmma_codegen import accumulators, write_header

# 16: the SpMMs' few-token tile (<= 16 tokens); 32: the V:2:M SpMM's 17-64-token tile (17-32 at M = 8); 64, 128, 256:
# larger token tiles
NS = (16, 32, 64, 128, 256)
NS_T = (64, 128, 256)  # the X^T path's tiles (64: at 33-64 tokens)

COMMENT = """// Sparse wgmma (sm_90a) with A (2:4, compressed 64x16) from registers and B (32 x N) from shared memory through a
// matrix descriptor; fp32 accumulators in d, metadata register e with sparsity selector 0, scale-d = 1 (accumulate),
// no negation. WgmmaSp: B K-major (not transposed); WgmmaSpT: B MN-major (transposed, N contiguous). Must only be
// compiled for sm_90a (callers guard with __CUDA_ARCH_FEAT_SM90_ALL).
"""


def wrapper(n: int, ptx_type: str, cxx_type: str, transposed: bool = False) -> str:
    nd, regs, outs = accumulators(n)
    return f"""
template <>
struct WgmmaSp{"T" if transposed else ""}<{n}, {cxx_type}> {{
  static __device__ __forceinline__ void run(float (&d)[{nd}], const uint4& a, uint64_t desc, uint32_t e) {{
    asm volatile(
        "{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{nd + 6}, 0;\\n"
        "wgmma.mma_async.sp.sync.aligned.m64n{n}k32.f32.{ptx_type}.{ptx_type} "
        "{{{regs}}}, "
        "{{%{nd}, %{nd + 1}, %{nd + 2}, %{nd + 3}}}, %{nd + 4}, %{nd + 5}, 0, p, 1, 1, {int(transposed)};\\n}}\\n"
        : {outs}
        : "r"(a.x), "r"(a.y), "r"(a.z), "r"(a.w), "l"(desc), "r"(e), "r"(1));
  }}
}};
"""


def main() -> None:
    def wrapper_t(n: int, ptx_type: str, cxx_type: str) -> str:
        return wrapper(n, ptx_type, cxx_type, transposed=True)

    write_header("wgmma_sp.cuh", "gen_wgmma_sp.py", COMMENT, [("WgmmaSp", wrapper, NS), ("WgmmaSpT", wrapper_t, NS_T)])


if __name__ == "__main__":
    main()
