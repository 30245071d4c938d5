// Tile configurations of every hf_sparse kernel, in one place. Host- and device-visible, no CUDA types.
#pragma once

namespace hf_sparse {

// SpMM Y = X W^T: a CTA computes BR = 64*WR weight rows x BN tokens; a warp owns 64 rows (one 64-row slab, so
// one set of V:2:M block columns) x BN/WN tokens. A pipeline stage holds BN token rows x 8*M real columns of X
// (one mma.sp k-step = 8 groups), so the stage size grows with M: BN shrinks to keep a stage near 16 KB and
// the whole pipeline under the 99 KB that sm_86/sm_89 allow.
template <int M> struct SpmmTile;
template <> struct SpmmTile<4>   { static constexpr int BN = 128, WR = 4, WN = 2, STAGES = 4; };
template <> struct SpmmTile<8>   { static constexpr int BN = 128, WR = 4, WN = 2, STAGES = 4; };
template <> struct SpmmTile<16>  { static constexpr int BN = 64,  WR = 4, WN = 2, STAGES = 4; };
template <> struct SpmmTile<32>  { static constexpr int BN = 32,  WR = 4, WN = 2, STAGES = 4; };
template <> struct SpmmTile<64>  { static constexpr int BN = 16,  WR = 4, WN = 2, STAGES = 4; };
template <> struct SpmmTile<128> { static constexpr int BN = 16,  WR = 4, WN = 2, STAGES = 2; };

// SDDMM dW = dY^T X at kept positions: a CTA owns one 64-row slab x G groups (4G condensed columns: all four
// block columns of each group are computed, then each row keeps its two) and reduces over a range of tokens in
// chunks of SD_BT; 4 warps of 16 rows each. G shrinks with M so the dense X chunk of a stage stays <= 16 KB.
template <int M> struct SddmmTile {
  static constexpr int GROUPS = (256 / M) < 16 ? (256 / M) : 16;
  static constexpr int BT = 32, STAGES = 3, THREADS = 128;
};

}  // namespace hf_sparse
