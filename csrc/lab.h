// The lab build's tuning knobs (HF_SPARSE_LAB, i.e. HF_SPARSE_BUILD_LAB=1 at build time): alternatives to the
// product's tile and pipeline choices, for benchmarks only. Set from Python through the lab build's `lab_set` binding
// (benchmarks/lab/tuning.py), read by the launchers; the product build has neither the knobs nor the alternatives.
#pragma once

#if !defined(HF_SPARSE_LAB)
#error "csrc/lab.h belongs to the lab build only (HF_SPARSE_BUILD_LAB=1)"
#endif

#include <atomic>

#include "tile_config.h"

namespace hf_sparse {
namespace lab {

struct Tuning {
  // spmm_sm90.cu: the tile configuration of the 2:4 wgmma kernel, 0 .. kSm90Configs - 1 (every token count for the
  // TMA ones, 6 and up; 0-5 above 128 tokens); -1: the product's choice (sm90_large_plan in tile_config.h).
  std::atomic<int> sm90_config{-1};
  // spmm_vnm_sm90.cu: 0 X into registers one k-tile ahead (the product's), 1 a cp.async ring of shared-memory stages
  // (where K / M <= 2048, else 0), 2 = 0 with L1 prefetches of the next k-tile, 3 warp-specialised (producer
  // warpgroups gather into a ring, consumer warpgroups issue the wgmmas; 64 tokens and more, else 0), 4 = 3 with one
  // gather for both slabs where they keep the same columns (M = 8).
  std::atomic<int> vnm_pipe{0};
  // spmm_vnm_sm90.cu: 64 forces 64-token tiles at M = 8; 0: the product's (128 above 64 tokens).
  std::atomic<int> vnm_tile{0};
  // spmm_vnm_sm90.cu: 1 takes the X^T path at every token count and weight size, 0 never; -1: the product's rule
  // (sm90_vnm_xt in tile_config.h).
  std::atomic<int> vnm_xt{-1};
  // sddmm_sm90.cu at M = 8: 0 X staged densely by TMA and gathered from shared memory (the product's), 1 X from global
  // memory into registers.
  std::atomic<int> sddmm_gather_regs{0};
  // Both sparse-wgmma SpMMs' split-K: > 0 forces that many splits of each tile's k-tiles (at most one per k-tile and
  // kSplitKMax) wherever the product's plan could split; 0: the product's count (sm90_split_k in tile_config.h).
  std::atomic<int> split_k{0};
  // spmm_sm90.cu: 1 runs the few-token tiles at every count up to 256 tokens, 0 never (the persistent configurations
  // and their split-K run instead, at any count); -1: the product's rule (sm90_sparse24_plan in tile_config.h).
  std::atomic<int> small_tiles{-1};
};

inline Tuning& tuning() {
  static Tuning t;
  return t;
}

constexpr int kSm90Configs = 36;
constexpr int kVnmPipes = 5;  // vnm_pipe takes 0 .. kVnmPipes - 1 (Tuning::vnm_pipe)

// The split count of a split-K plan: the product's (`product`), or split_k where set, capped as sm90_split_k caps it
// (<= kSplitKMax, >= one k-tile per split, no split left empty, no split above kSplitKCounters tiles).
inline int split_k_or(int product, long long tiles, long long k_tiles) {
  long long s = tuning().split_k.load(std::memory_order_relaxed);
  if (s <= 0) return product;
  if (tiles <= 0 || tiles > kSplitKCounters) return 1;
  if (s > kSplitKMax) s = kSplitKMax;
  if (s > k_tiles) s = k_tiles;
  return s <= 1 ? 1 : (int)sm90_splits_without_empty(k_tiles, s);
}

}  // namespace lab
}  // namespace hf_sparse
