// TMA and mbarrier wrappers (inline PTX) for the warp-specialized sparse-wgmma SpMM (spmm_sm90.cu, config 6/7).
// Also the TMA store, bulk-group and stmatrix wrappers of its staged epilogue (configs 20-27).
// sm_90a only: callers include this under __CUDA_ARCH_FEAT_SM90_ALL. Addresses are shared-window (32-bit) addresses
// as __cvta_generic_to_shared returns them.
//
// Protocol (one ring of stages): the producer thread waits on the stage's "empty" barrier, arms the stage's "full"
// barrier with the byte count (arrive.expect_tx) and issues the TMA copy that completes those bytes on it; the
// consumer warps wait on "full" with the phase parity of their pass over the ring, and after their wgmmas have read
// the stage each consumer warp arrives once on "empty".
#pragma once

#include <cuda.h>  // CUtensorMap (type only: nothing here calls or links the driver library)
#include <stdint.h>

namespace hf_sparse {

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}

// Makes the barrier initialisations visible to the async proxy (TMA) and to the other threads after a CTA barrier.
__device__ __forceinline__ void mbar_fence_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}

// Spins until the phase with the given parity has completed. On a fresh barrier, parity 1 (the phase "before" phase
// 0) counts as completed, which lets the producer's first pass over the ring start without waiting.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}

__device__ __forceinline__ void tma_prefetch_map(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// 2-D tiled TMA load of the box at (c0 = innermost coordinate, c1) into shared memory at dst; completes its bytes
// on the mbarrier bar. Out-of-bounds elements arrive as zeros (the map's fill mode), and still count as bytes.
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap* map, int c0, int c1, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::
          "r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar)
      : "memory");
}

// Multicast form: the box lands at the same shared-memory offset dst in every CTA of the cluster named in cta_mask,
// and completes its bytes on the mbarrier at offset bar in each of them.
__device__ __forceinline__ void tma_load_2d_multicast(uint32_t dst, const CUtensorMap* map, int c0, int c1,
                                                      uint32_t bar, uint16_t cta_mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster "
      "[%0], [%1, {%2, %3}], [%4], %5;\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar), "h"(cta_mask)
      : "memory");
}

// 2-D tiled TMA store of the box at (c0 = innermost coordinate, c1) from shared memory at src (laid out as the map's
// swizzle says) into global memory, as one bulk group entry: the caller commits it (bulk_commit_group) and, before
// writing src again, waits until the copy engine has read it (bulk_wait_group_read). Elements of the box outside the
// tensor (past the last row or token) are not written: partial tiles need no checks.
__device__ __forceinline__ void tma_store_2d(const CUtensorMap* map, int c0, int c1, uint32_t src) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];\n" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(c0), "r"(c1), "r"(src)
               : "memory");
}
// The same with an L2 cache policy (createpolicy), e.g. evict-first for an output nothing in the kernel reads again.
__device__ __forceinline__ void tma_store_2d_hint(const CUtensorMap* map, int c0, int c1, uint32_t src,
                                                  uint64_t policy) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group.L2::cache_hint [%0, {%1, %2}], [%3], %4;\n" ::
                   "l"(reinterpret_cast<uint64_t>(map)),
               "r"(c0), "r"(c1), "r"(src), "l"(policy)
               : "memory");
}
__device__ __forceinline__ uint64_t l2_policy_evict_first() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
  return policy;
}
__device__ __forceinline__ void bulk_commit_group() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// At most N of this thread's committed bulk groups still read their shared-memory source.
template <int N>
__device__ __forceinline__ void bulk_wait_group_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}
// At most N of this thread's committed bulk groups are still incomplete (their global writes included).
template <int N>
__device__ __forceinline__ void bulk_wait_group() {
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory");
}

// Four 8 x 8 b16 matrices from registers into shared memory, transposed: lane i holds elements (i / 4, 2 (i % 4) ..
// + 1) of each matrix (the mma accumulator layout, packed in pairs), and lanes 8j..8j+7 give the addresses of the
// 16-byte rows 0-7 of matrix j, where row c receives column c of the matrix.
__device__ __forceinline__ void stmatrix_x4_trans(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r0),
               "r"(r1), "r"(r2), "r"(r3)
               : "memory");
}

// Named barrier `id` over `threads` threads (a multiple of 32): every participating warp waits.
__device__ __forceinline__ void named_bar_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

__device__ __forceinline__ uint32_t cluster_cta_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}

// Arrive on the mbarrier at this CTA's shared offset bar, in the cluster's CTA `rank` (mapa: the peer's address).
// RELEASE_CLUSTER: with .release.cluster, which also orders every earlier memory access of the thread at cluster scope
// first (configs 8/9). Otherwise the default semantics of mbarrier.arrive (release at CTA scope), as CUTLASS's cluster
// barrier arrives do: for the consumer release of a stage that a peer's multicast refills (configs 28-30), where the
// ordering that matters (this CTA's wgmmas have finished reading the stage) comes from wgmma.wait_group before the
// arrive. The plain form made configs 28-30 1.5-1.8x faster than the .release.cluster one (benchmarks/RESULTS.md).
template <bool RELEASE_CLUSTER>
__device__ __forceinline__ void mbar_arrive_peer(uint32_t bar, uint32_t rank) {
  if constexpr (RELEASE_CLUSTER) {
    asm volatile(
        "{\n.reg .b32 remote;\n"
        "mapa.shared::cluster.u32 remote, %0, %1;\n"
        "mbarrier.arrive.release.cluster.shared::cluster.b64 _, [remote];\n}\n" ::"r"(bar),
        "r"(rank)
        : "memory");
  } else {
    asm volatile(
        "{\n.reg .b32 remote;\n"
        "mapa.shared::cluster.u32 remote, %0, %1;\n"
        "mbarrier.arrive.shared::cluster.b64 _, [remote];\n}\n" ::"r"(bar),
        "r"(rank)
        : "memory");
  }
}

// Every thread of every CTA of the cluster (none may have exited) meets here.
__device__ __forceinline__ void cluster_sync() {
  asm volatile(
      "barrier.cluster.arrive.release.aligned;\n"
      "barrier.cluster.wait.acquire.aligned;\n" ::
          : "memory");
}

// Warpgroup-wide register reallocation (every warp of the warpgroup executes it): the producer gives registers back,
// the consumers take them.
template <int REGS>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(REGS));
}
template <int REGS>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(REGS));
}

}  // namespace hf_sparse
