// Device helpers shared by the wgmma kernels (csrc/spmm_sm90.cu: 2:4, csrc/spmm_vnm_sm90.cu: V:2:M, csrc/sddmm_sm90.cu,
// benchmarks/roofline_sm90.cu): wgmma fence / commit / wait, the generic->async proxy fence, the 128-byte-swizzle
// K-major and MN-major matrix descriptors and the epilogue of one m64 x BN accumulator tile. sm_90a only: callers
// include this under __CUDA_ARCH_FEAT_SM90_ALL.
#pragma once

#include "common.cuh"
#include "tma_sm90.cuh"

namespace hf_sparse {

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Bytes from a shared-memory address to the next 1024-byte boundary, where every 128-byte-swizzled tile must start
// (the swizzle pattern repeats every 8 rows of 128 bytes). Kernels add it to their dynamic shared-memory base; adding
// it to the pointer (not converting an integer back) keeps the pointer in the shared window for ptxas.
__device__ __forceinline__ uint32_t pad_to_1024(uint32_t smem_addr) { return (1024u - (smem_addr & 1023u)) & 1023u; }

// One warp's A fragments and metadata of k-tile kt (k-steps 2kt, 2kt+1) straight from global memory into registers:
// ag / eg point at this lane's k-step 0 (packed layout of hf_sparse/ops/_layout.py). An inactive tile (rows past the
// packed weight) or a k-step past `steps` gets zero A with the metadata of positions 0 and 1, so the wgmmas need no
// branch around them (ptxas serializes wgmmas across control flow).
__device__ __forceinline__ void fetch_a_tile(const uint4* ag, const uint32_t* eg, bool active, int kt, int steps,
                                             uint4 (&a)[2], uint32_t (&e)[2]) {
  // a local constant: declared at namespace scope instead, it made ptxas serialize the wgmmas of configs 13-19
  constexpr uint32_t kMetaPad = 0x44444444u;
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int s = 2 * kt + j;
    uint4 av = make_uint4(0, 0, 0, 0);
    uint32_t ev = kMetaPad;
    if (active && s < steps) {
      av = ag[(size_t)s * 32];
      ev = eg[(size_t)s * 16];
    }
    a[j] = av;
    e[j] = ev;
  }
}

// The M = 8 gather of the V:2:M kernels (spmm_vnm_sm90.cu, sddmm_sm90.cu): the 4 kept columns of one aligned group
// of 8 halves (a 16-byte chunk of X), as 8 bytes, by byte permutes. `cw` packs the group's 4 increasing offsets
// (uint8 each). Output word o takes columns 2o, 2o+1: word 0 lies in chunk words 0-2, word 1 in words 1-3. One prmt
// picks from the pair (0,1) resp. (2,3) (bytes 2(c&3), +1), a second takes a half from the third word instead where
// the column lies there (c >= 4 for word 0, c < 4 for word 1). The selectors depend on `cw` only: build once per
// group, apply to every token.
struct KeptOf8 {
  uint32_t sa[2], sb[2];
  __device__ __forceinline__ explicit KeptOf8(uint32_t cw) {
#pragma unroll
    for (int o = 0; o < 2; ++o) {
      const uint32_t c = (cw >> (16 * o)) & 0xFFFFu;
      sa[o] = (c & 0x0303u) * 0x22u + 0x1010u;
      const uint32_t m = ((c >> 2) & 0x0101u) ^ (o ? 0x0101u : 0u);  // per half: from the third word
      const uint32_t d = (m << 2) + ((m & c & 0x0101u) << 1) - ((m & 0x0100u) << 1);
      sb[o] = 0x3210u + d * 0x11u;
    }
  }
  __device__ __forceinline__ uint2 operator()(const uint4& v) const {
    uint2 o;
    o.x = __byte_perm(__byte_perm(v.x, v.y, sa[0]), v.z, sb[0]);
    o.y = __byte_perm(__byte_perm(v.z, v.w, sa[1]), v.y, sb[1]);
    return o;
  }
};

// Matrix descriptor of a K-major tile with 128-byte swizzle: start address >> 4, leading offset 1 (unused for
// swizzled K-major), stride offset 1024 B (next 8-row group), layout type 1 (128B swizzle) in bits 62-63.
__device__ __forceinline__ uint64_t desc_k128(uint32_t smem_addr) {
  return (uint64_t)((smem_addr & 0x3FFFF) >> 4) | ((uint64_t)1 << 16) | ((uint64_t)(1024 >> 4) << 32) |
         ((uint64_t)1 << 62);
}

// Descriptor of an MN-major tile with 128-byte swizzle: rows of 64 MN-contiguous 16-bit elements (128 bytes) per k,
// 8-k groups 1024 bytes apart (stride byte offset), 64-wide MN blocks `lbo` bytes apart (leading byte offset).
__device__ __forceinline__ uint64_t desc_mn128(uint32_t smem_addr, uint32_t lbo) {
  return (uint64_t)((smem_addr & 0x3FFFF) >> 4) | ((uint64_t)((lbo >> 4) & 0x3FFF) << 16) |
         ((uint64_t)(1024 >> 4) << 32) | ((uint64_t)1 << 62);
}

// Split-K at the end of a split of a tile (tile_config.h sm90_split_k): its partial sums go to the tile's scratch in
// split_ws, THREADS x FLOATS floats per split (FLOATS accumulators per thread, each array at its offset among them),
// four accumulators of a thread per 16-byte store, coalesced (accumulators 4q..4q+3 of thread i at float (q x THREADS +
// i) x 4); the last split of the tile to arrive (its counter) reads all of them back in split order, its own included,
// so the sum does not depend on the arrival order. Use: store() every array, then if last(sync), sum() every array.
// `thread` is the caller's index among the THREADS that take part, `sync` a barrier over exactly them (the whole CTA,
// or the consumer warpgroups of a warp-specialised one). A CTA may run several splits one after another.
// Arrival publishes the split's stores as CUTLASS's split-K semaphore does: a barrier over the threads that stored,
// then one thread's release fence and atomic (and the last one's acquire fence before the barrier that lets every
// thread read), instead of a fence in every thread: in a 4096 -> 4096 call at 128 tokens the per-thread fences, the
// barriers and the atomic held 14% of the warps' stall samples (benchmarks/RESULTS.md, "split-K arrival").
__device__ __forceinline__ void fence_acq_rel_gpu() { asm volatile("fence.acq_rel.gpu;\n" ::: "memory"); }
__device__ __forceinline__ int load_acquire_gpu(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}
template <int FLOATS, int THREADS>
struct SplitK {
  static_assert(FLOATS % 4 == 0, "accumulators are stored four at a time");
  static constexpr int PER_SPLIT = FLOATS * THREADS;
  float* tile_ws;  // this thread's first float of the tile's scratch (split 0)
  int* counter;    // the tile's arrival counter, zero between launches
  int split, splits, thread;
  __device__ __forceinline__ SplitK(float* split_ws, int* split_counters, int tile, int split_, int splits_, int thread_)
      : tile_ws(split_ws + (size_t)tile * splits_ * PER_SPLIT + 4 * thread_), counter(split_counters + tile),
        split(split_), splits(splits_), thread(thread_) {}
  // The split of a grid of (tiles along x and y, splits along z) CTAs that this CTA runs (all its threads take part).
  __device__ __forceinline__ static SplitK of_grid(float* split_ws, int* split_counters) {
    return SplitK(split_ws, split_counters, blockIdx.y * gridDim.x + blockIdx.x, blockIdx.z, gridDim.z, threadIdx.x);
  }
  template <int N>
  __device__ __forceinline__ void store(const float (&acc)[N], int offset) const {
    static_assert(N % 4 == 0, "accumulators are stored four at a time");
    float* ws = tile_ws + (size_t)split * PER_SPLIT + offset * THREADS;
#pragma unroll
    for (int q = 0; q < N / 4; ++q)
      __stcg(reinterpret_cast<float4*>(ws + q * 4 * THREADS),
             make_float4(acc[4 * q], acc[4 * q + 1], acc[4 * q + 2], acc[4 * q + 3]));
  }
  // The chunked shared sum (a grid of non-persistent CTAs that are all resident at once, tile_config.h
  // sm90_split_sum_shared): chunk q of warp w's accumulators (4q .. 4q + 3 among a thread's FLOATS, the same in every
  // lane) belongs to split (q + w) % splits, which adds it up from every split's partial sums and stores it, so every
  // split reads back about 1 / splits of the tile, where the last split's sum reads all of it from every split. Use:
  // store() every array, arrive(shared, sync) (false: this split stores nothing), then sum() every array (the last
  // split) or sum_owned() every array and leave() (shared), and store the chunks that sum_owned() names.
  template <typename Sync>
  __device__ __forceinline__ bool arrive(bool shared, Sync sync) const {
    if (!shared) return last(sync);
    meet(sync);
    return true;
  }
  // After every thread's store(): true in the last split of the tile to arrive, which has reset the counter for the
  // next launch. A CTA that runs another split later passes `sync` again before rewriting the flag, so every thread
  // has read it by then.
  template <typename Sync>
  __device__ __forceinline__ bool last(Sync sync) const {
    __shared__ int is_last;
    sync();  // every thread's stores before thread 0's release
    if (thread == 0) {
      fence_acq_rel_gpu();
      const bool mine = atomicAdd(counter, 1) == splits - 1;
      if (mine) {
        *counter = 0;
        fence_acq_rel_gpu();  // acquire: every split's stores before this CTA's reads
      }
      is_last = mine;
    }
    sync();
    return is_last;
  }
  __device__ __forceinline__ bool last() const {
    return last([] { __syncthreads(); });
  }
  // The shared sum, where every split of the tile runs at once (a cooperative launch): each split adds up the rows it
  // owns, from its own accumulators and every other split's partial sums, and stores them. meet(): after the store()
  // of the rows other splits own, wait until every split of the tile has stored (thread 0 spins, the rest wait at
  // `sync`). Then add_others(), and leave(): the split that leaves last zeroes the counter for the next launch (all
  // have passed their wait by then).
  template <typename Sync>
  __device__ __forceinline__ void meet(Sync sync) const {
    sync();  // every thread's stores before thread 0's release
    if (thread == 0) {
      fence_acq_rel_gpu();
      atomicAdd(counter, 1);
      while (load_acquire_gpu(counter) < splits) {
      }
    }
    sync();
  }
  template <int N>
  __device__ __forceinline__ void add_others(float (&acc)[N], int offset) const {
    for (int z = 0; z < splits; ++z) {
      if (z != split) add_split(acc, offset, z);
    }
  }
  __device__ __forceinline__ void leave() const {
    if (thread == 0 && atomicAdd(counter, 1) == 2 * splits - 1) *counter = 0;
  }
  template <int N>
  __device__ __forceinline__ void sum(float (&acc)[N], int offset) const {
#pragma unroll
    for (int j = 0; j < N; ++j) acc[j] = 0.f;
    for (int z = 0; z < splits; ++z) add_split(acc, offset, z);
  }
  // The chunks of the N accumulators at `offset` that this split owns, added up from every split's partial sums in
  // split order from zero (as sum(): the same bits either way) into acc; bit q of the result: chunk q is this
  // split's. The splits' partial sums of a chunk are loaded eight at a time, so that one round trip to the L2 serves
  // eight of them. The warp comes from this SplitK's thread, made after the main loop: a warp index the kernel keeps
  // from its start would stay live through the loop, and at the register cap of the few-token tiles the loop then
  // recomputes addresses instead (its SASS 6-10% longer).
  template <int N>
  __device__ __forceinline__ uint32_t sum_owned(float (&acc)[N], int offset) const {
    static_assert(N % 4 == 0 && N / 4 <= 32, "one bit per chunk of four accumulators");
    constexpr int kBatch = 8;
    const int warp = thread / 32;
    uint32_t owned = 0;
    int q = (split - (offset / 4 + warp) % splits + splits) % splits;  // the first chunk this split owns
    for (; q < N / 4; q += splits) {
      const float* ws = tile_ws + (offset + 4 * q) * THREADS;
      float4 t = make_float4(0.f, 0.f, 0.f, 0.f);
      for (int z0 = 0; z0 < splits; z0 += kBatch) {
        float4 v[kBatch];
#pragma unroll
        for (int i = 0; i < kBatch; ++i)
          if (z0 + i < splits) v[i] = __ldcg(reinterpret_cast<const float4*>(ws + (size_t)(z0 + i) * PER_SPLIT));
#pragma unroll
        for (int i = 0; i < kBatch; ++i) {
          if (z0 + i >= splits) break;
          t.x += v[i].x;
          t.y += v[i].y;
          t.z += v[i].z;
          t.w += v[i].w;
        }
      }
#pragma unroll
      for (int j = 0; j < N / 4; ++j) {
        if (j != q) continue;
        acc[4 * j] = t.x;
        acc[4 * j + 1] = t.y;
        acc[4 * j + 2] = t.z;
        acc[4 * j + 3] = t.w;
      }
      owned |= 1u << q;
    }
    return owned;
  }
  // acc += split z's partial sums of this thread (the add of sum() and add_others()).
  template <int N>
  __device__ __forceinline__ void add_split(float (&acc)[N], int offset, int z) const {
    const float* ws = tile_ws + (size_t)z * PER_SPLIT + offset * THREADS;
#pragma unroll
    for (int q = 0; q < N / 4; ++q) {
      const float4 v = __ldcg(reinterpret_cast<const float4*>(ws + q * 4 * THREADS));
      acc[4 * q] += v.x;
      acc[4 * q + 1] += v.y;
      acc[4 * q + 2] += v.z;
      acc[4 * q + 3] += v.w;
    }
  }
};

// Epilogue of one m64 x BN accumulator tile of a warpgroup: this warp's 16 rows start at row0. acc[4*nt + c]: row
// g + 8*(c >> 1), token n_base + 8*nt + 2t + (c & 1). Lanes g and g^1 swap halves so each lane holds two adjacent
// rows of one token: 32-bit stores of Y[n, r], r, r+1 (+ bias). Bit nt of `chunks`: whether this warp stores chunk nt
// (tokens 8nt .. 8nt + 7, acc[4nt .. 4nt + 3]; the same in every lane): all of them, or the chunks a split owns in
// SplitK's chunked shared sum.
template <typename T, int BN, int ACT = kActNone>
__device__ __forceinline__ void store_tile(const float (&acc)[BN / 2], int row0, int n_base, int lane,
                                           const T* __restrict__ bias, T* __restrict__ y, int rows, int n_tokens,
                                           uint32_t chunks = ~0u) {
  const int g = lane >> 2, t = lane & 3;
  const bool odd = g & 1;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r_even = row0 + 8 * half + (g & ~1);
    float b0, b1;
    load_bias_pair(bias, r_even, rows, b0, b1);
#pragma unroll
    for (int nt = 0; nt < BN / 8; ++nt)  // tokens n, n+1
      store_row_pair<T, ACT>(y, acc[4 * nt + 2 * half], acc[4 * nt + 2 * half + 1], odd, n_base + nt * 8 + 2 * t,
                             r_even, b0, b1, rows, n_tokens, ((chunks >> nt) & 1u) != 0);
  }
}

// Staged epilogue (the 2:4 kernel's configurations 20-27, the V:2:M X^T path) of one warpgroup's m64 x BN
// accumulator tile: this warp's rows are row0 .. row0 + 15 (g and g + 8 of each 8 x 8 block), the warpgroup's are
// wg_row0 .. + 63. Why: the direct epilogue writes Y[n, r] with 4-byte stores, 16 of each 32-byte sector per store,
// which throttled the LSU (LG throttle) for thousands of cycles per tile while the tensor pipe waited
// (benchmarks/RESULTS.md, "Profile"). Here the tile goes out in chunks of EPI_N tokens: + bias, cast, and
// stmatrix.trans of 8 x 8 blocks (rows x tokens) into a staging buffer that holds the chunk token-major, as Y is
// (16-byte lines of 8 rows; 128 bytes = the warpgroup's 64 rows per token, 128-byte swizzle: conflict-free), then
// one TMA store of the 64 x EPI_N box by the warpgroup's first thread. The store runs asynchronously: the warpgroup
// goes on to the next chunk (EPI_BUFS buffers in rotation; a buffer is rewritten only after the copy engine has read
// it, bulk_wait_group_read) and to the next tile's main loop. The tensor map clips rows >= rows and tokens >=
// n_tokens, so partial tiles need no checks. Named barrier bar_id (128 threads) orders the warpgroup's buffer writes
// against the store (fence.proxy.async: generic writes, read by the async proxy).
template <typename T, int BN, int EPI_N, int EPI_BUFS, bool EVICT_FIRST, int ACT = kActNone>
__device__ __forceinline__ void store_tile_staged(const float (&acc)[BN / 2], int row0, int wg_row0, int n_base,
                                                  int lane, int wq, uint32_t stage_u32, int bar_id,
                                                  const T* __restrict__ bias, int rows, int n_tokens,
                                                  const CUtensorMap* y_map, int chunk0 = -1) {
  // chunk0 < 0: every tile starts at buffer 0. chunk0 >= 0 (configs 34/35, RUNBUF): the buffers rotate on across
  // tiles, chunk0 = chunks this warpgroup stored before this tile, so a tile's first chunks go to the buffers whose
  // stores were issued longest ago (the previous tile's, drained during this tile's main loop).
  static_assert(BN % EPI_N == 0 && EPI_N % 16 == 0 && EPI_N <= 256, "chunks of 16..256 tokens that split the tile");
  const int g = lane >> 2;
  float b_lo = 0.f, b_hi = 0.f;
  if (bias != nullptr) {
    if (row0 + g < rows) b_lo = MmaType<T>::to_float(bias[row0 + g]);
    if (row0 + g + 8 < rows) b_hi = MmaType<T>::to_float(bias[row0 + g + 8]);
  }
  // stmatrix x4 of blocks (nt, rows g), (nt, rows g + 8), (nt + 1, g), (nt + 1, g + 8): lane i addresses row i % 8
  // (token 8 (nt + (i / 16)) + i % 8) of block i / 8; the 16-byte chunk of the rows is 2 wq + (i / 8) % 2.
  const int mi = lane >> 3, j = lane & 7;
  const uint32_t lane_off = (uint32_t)((8 * (mi >> 1) + j) * 128 + (((2 * wq + (mi & 1)) ^ j) << 4));
  const bool leader = (threadIdx.x & 127) == 0;
#pragma unroll
  for (int c = 0; c < BN / EPI_N; ++c) {
    const uint32_t buf = stage_u32 + ((chunk0 < 0 ? c : chunk0 + c) % EPI_BUFS) * (EPI_N * 128);
    if (leader) bulk_wait_group_read<EPI_BUFS - 1>();  // the store that used this buffer last has read it
    named_bar_sync(bar_id, 128);
#pragma unroll
    for (int q = 0; q < EPI_N / 16; ++q) {
      const int nt = c * (EPI_N / 8) + 2 * q;
      auto pk = [&](float v0, float v1, float b) {
        return MmaType<T>::pack(MmaType<T>::from_float(activate<ACT>(v0 + b)),
                                MmaType<T>::from_float(activate<ACT>(v1 + b)));
      };
      stmatrix_x4_trans(buf + q * 16 * 128 + lane_off, pk(acc[4 * nt], acc[4 * nt + 1], b_lo),
                        pk(acc[4 * nt + 2], acc[4 * nt + 3], b_hi), pk(acc[4 * nt + 4], acc[4 * nt + 5], b_lo),
                        pk(acc[4 * nt + 6], acc[4 * nt + 7], b_hi));
    }
    fence_proxy_async();  // this thread's stmatrix writes, visible to the copy engine after the barrier
    named_bar_sync(bar_id, 128);
    if (leader) {
      if (n_base + c * EPI_N < n_tokens) {  // a chunk wholly past the last token is skipped
        if constexpr (EVICT_FIRST) {
          tma_store_2d_hint(y_map, wg_row0, n_base + c * EPI_N, buf, l2_policy_evict_first());
        } else {
          tma_store_2d(y_map, wg_row0, n_base + c * EPI_N, buf);
        }
      }
      bulk_commit_group();  // (an empty group past the last token keeps the buffer rotation's count)
    }
  }
}

}  // namespace hf_sparse
