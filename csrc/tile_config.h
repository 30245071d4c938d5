// Tile configurations of every hf_sparse kernel, in one place. Host- and device-visible, no CUDA types.
#pragma once

namespace hf_sparse {

// SpMM Y = X W^T: a CTA computes BR = 64*WR weight rows x BN tokens; a warp owns 64 rows (one 64-row slab, so
// one set of V:2:M block columns) x BN/WN tokens. A pipeline stage holds BN token rows x 8*M real columns of X
// (one mma.sp k-step = 8 groups), so the stage size grows with M: BN shrinks to keep a stage near 16 KB and
// the whole pipeline under the 99 KB that sm_86/sm_89 allow.
template <int M> struct SpmmTile;
// A stage also holds the CTA's A fragments (8 KB), metadata (1 KB) and offsets: 3 stages keep every config
// under 99 KB. MIN_BLOCKS = 2 where the accumulators are small enough for two CTAs per SM.
// Lab build only (HF_SPARSE_BUILD_LAB=1): -DHF_SPARSE_SPMM_VARIANT=1 / 2 in HF_SPARSE_NVCC_FLAGS selects alternative
// shapes (benchmarks/bench_spmm_variants.py).
#ifndef HF_SPARSE_SPMM_VARIANT
#define HF_SPARSE_SPMM_VARIANT 0
#endif
#if HF_SPARSE_SPMM_VARIANT != 0 && !defined(HF_SPARSE_LAB)
#error "HF_SPARSE_SPMM_VARIANT is a lab build flag: set HF_SPARSE_BUILD_LAB=1 too"
#endif
#if HF_SPARSE_SPMM_VARIANT == 1  // 4 warps, 128 rows, two CTAs per SM
template <> struct SpmmTile<4>   { static constexpr int BN = 128, WR = 2, WN = 2, STAGES = 4, MIN_BLOCKS = 2; };
template <> struct SpmmTile<8>   { static constexpr int BN = 128, WR = 2, WN = 2, STAGES = 4, MIN_BLOCKS = 2; };
template <> struct SpmmTile<16>  { static constexpr int BN = 64,  WR = 2, WN = 2, STAGES = 4, MIN_BLOCKS = 2; };
template <> struct SpmmTile<32>  { static constexpr int BN = 32,  WR = 2, WN = 2, STAGES = 4, MIN_BLOCKS = 3; };
template <> struct SpmmTile<64>  { static constexpr int BN = 16,  WR = 2, WN = 2, STAGES = 4, MIN_BLOCKS = 3; };
template <> struct SpmmTile<128> { static constexpr int BN = 16,  WR = 2, WN = 2, STAGES = 2, MIN_BLOCKS = 3; };
#elif HF_SPARSE_SPMM_VARIANT == 2  // 8 warps, 128 rows x twice the tokens: more reuse of A
template <> struct SpmmTile<4>   { static constexpr int BN = 256, WR = 2, WN = 4, STAGES = 3, MIN_BLOCKS = 1; };
template <> struct SpmmTile<8>   { static constexpr int BN = 256, WR = 2, WN = 4, STAGES = 3, MIN_BLOCKS = 1; };
template <> struct SpmmTile<16>  { static constexpr int BN = 128, WR = 2, WN = 4, STAGES = 3, MIN_BLOCKS = 1; };
template <> struct SpmmTile<32>  { static constexpr int BN = 64,  WR = 2, WN = 4, STAGES = 3, MIN_BLOCKS = 1; };
template <> struct SpmmTile<64>  { static constexpr int BN = 32,  WR = 2, WN = 4, STAGES = 3, MIN_BLOCKS = 2; };
template <> struct SpmmTile<128> { static constexpr int BN = 32,  WR = 2, WN = 4, STAGES = 2, MIN_BLOCKS = 2; };
#else
template <> struct SpmmTile<4>   { static constexpr int BN = 128, WR = 4, WN = 2, STAGES = 3, MIN_BLOCKS = 1; };
template <> struct SpmmTile<8>   { static constexpr int BN = 128, WR = 4, WN = 2, STAGES = 3, MIN_BLOCKS = 1; };
template <> struct SpmmTile<16>  { static constexpr int BN = 64,  WR = 4, WN = 2, STAGES = 3, MIN_BLOCKS = 1; };
template <> struct SpmmTile<32>  { static constexpr int BN = 32,  WR = 4, WN = 2, STAGES = 3, MIN_BLOCKS = 2; };
template <> struct SpmmTile<64>  { static constexpr int BN = 16,  WR = 4, WN = 2, STAGES = 3, MIN_BLOCKS = 2; };
template <> struct SpmmTile<128> { static constexpr int BN = 16,  WR = 4, WN = 2, STAGES = 2, MIN_BLOCKS = 2; };
#endif

// SDDMM dW = dY^T X at kept positions: a CTA owns SLABS 64-row slabs x G groups (4G condensed columns: all four
// block columns of each group are computed, then each row keeps its two) and reduces over a range of tokens in
// chunks of BT; 4 warps of 16 rows per slab. G shrinks with M so the dense X chunk of a stage stays <= 16 KB.
// L2 traffic ~ X * R/(64*SLABS) + dY * G_total/G: the larger the tile, the closer to the dense GEMM's.
template <int M> struct SddmmTile {
  static constexpr int GROUPS = (256 / M) < 32 ? (256 / M) : 32;
  static constexpr int SLABS = 2;
  static constexpr int BT = 32, STAGES = 3, THREADS = 128 * SLABS;
};

// SDDMM on sm_90a (sddmm_sm90.cu): a CTA owns 128 rows (two 64-row slabs) x GROUPS groups (4 * GROUPS condensed
// columns per slab, one wgmma m64n(4 * GROUPS)k16 per 16 tokens) and reduces over its token range in stages of BK
// tokens: STAGES for M >= 16 (dY 8 KB + both slabs' gathered X 32 KB per stage), STAGES_DIRECT for M = 4 (dY 8 KB + one
// shared X tile 16 KB per stage), STAGES_STAGED of BK_STAGED tokens for M = 8 (dY 4 KB + gathered X 16 KB + the dense
// X it is gathered from 16 KB per stage).
struct SddmmSm90Tile {
  static constexpr int BK = 32, GROUPS = 64, STAGES = 5, STAGES_DIRECT = 8;
  static constexpr int BK_STAGED = 16, STAGES_STAGED = 6;
};

// The 2:4 sparse-wgmma SpMM's (spmm_sm90.cu) persistent TMA configurations (numbered as in the lab build,
// csrc/README.md): 128 weight rows x 256 (config 20), 192 (27) or 128 (23) tokens per tile, one CTA per SM walking the
// tiles. Pure, host-only functions, testable alone; measured on the H200 in benchmarks/RESULTS.md ("Staged epilogue",
// "Short-K", "tiles that fit the tokens").
constexpr int kSm90Config256 = 20, kSm90Config192 = 27, kSm90Config128 = 23;
inline int sm90_config_tokens(int config) {
  return config == kSm90Config256 ? 256 : config == kSm90Config192 ? 192 : 128;
}
// Above kSm90WorkModelTokens = 512 tokens (sm90_large_plan), by how well the last round of tiles fills the SMs: 256
// where that fills >= 85% of the SM slots of all rounds, or where neither 192 nor 128 fills more than 10 points better;
// else 192 when it fills about as well as 128 (192 moves 12% fewer L2 bytes per MAC), else 128. E.g. 3072 -> 768 at
// 8192 tokens on 132 SMs: 256 fills 73%, 192 98%, 128 97%: 27.
inline double sm90_fill(long long row_blocks, long long n_tokens, int bn, int sms) {
  const long long tiles = row_blocks * ((n_tokens + bn - 1) / bn), rounds = (tiles + sms - 1) / sms;
  return (double)tiles / (double)(rounds * sms);  // share of the SM slots of all rounds that hold a tile
}
inline int sm90_large_config(long long rows_padded, long long n_tokens, int sms) {
  const long long row_blocks = (rows_padded + 127) / 128;
  const double f256 = sm90_fill(row_blocks, n_tokens, 256, sms), f192 = sm90_fill(row_blocks, n_tokens, 192, sms),
               f128 = sm90_fill(row_blocks, n_tokens, 128, sms);
  if (f256 >= 0.85 || (f192 > f128 ? f192 : f128) <= f256 + 0.1) return kSm90Config256;
  return f192 + 0.02 >= f128 ? kSm90Config192 : kSm90Config128;
}

// The cp.async 2:4 wgmma SpMM (spmm_sm90_kernel) at few tokens, and split-K. The few-token tile is 128 rows x
// sm90_small_bn tokens, kSm90SmallCtasPerSm CTAs per SM, and splits K where its tiles alone would leave SMs idle
// (sm90_sparse24_plan says where it runs rather than a persistent configuration).
// Where the tiles cannot keep every SM busy, each tile's k-tiles are split over sm90_split_k CTAs, each k range at
// least kSplitKMinKTiles k-tiles (64 condensed columns each) long (kVnmSplitMinKTiles for the V:2:M kernel, whose
// every k-tile waits about one memory round trip); the last CTA of a tile to finish adds every CTA's fp32 partial
// sums, in split order, and stores it. The CTAs run in rounds of CTA slots (SMs x CTAs per SM: two for the 2:4
// few-token tiles, three for the V:2:M 16-token tile, two for its 32-token tile, one for its 64- and 128-token
// tiles), and a round takes about as long as its CTAs' k-tiles plus a fixed cost of about kSplitKFixedKTiles k-tiles
// (pipeline fill, partial sums, epilogue), however full the round is: the count is the one with the least
// ceil(tiles x splits / slots) x (k-tiles per split + kSplitKFixedKTiles), fewer splits on a tie. A round left
// part-empty is what this weighs: e.g. 224 tiles of 32 k-tiles on 396 slots (8192 -> 28672 at M = 16, 1-16 tokens)
// fill 57% of one round unsplit (1 x 36) but 85% of two in 3 splits (2 x 15): 3. E.g. 80 tiles of 108 k-tiles on
// 132 slots: 1 split 1 x 112, 2 splits 2 x 58, 3 splits 2 x 40: 3.
// benchmarks/sweep_split_k.py measures every split count (the figures: benchmarks/RESULTS.md).
// kSplitKCounters bounds the tiles of a split launch (one arrival counter each, kept zero between launches by the last
// CTA).
constexpr int kSplitKMax = 16, kSplitKMinKTiles = 4, kVnmSplitMinKTiles = 2, kSplitKCounters = 4096;
constexpr int kSplitKFixedKTiles = 4;
inline int sm90_small_bn(long long n_tokens) { return n_tokens <= 16 ? 16 : n_tokens <= 64 ? 64 : 128; }
// The few-token tiles' shortest split in k-tiles: kSplitKMinKTiles for the 16-token tile, 16 for the 64- and
// 128-token ones, whose last CTA reads back a 32 / 64 KB fp32 partial tile per split (4096 -> 4096: at 17-64 tokens 4
// splits of 16 k-tiles ran 1.04-1.17x faster than 8 of 8, benchmarks/RESULTS.md, "tail map"; at 128 tokens 1.3x).
// kSm90SmallSharedMinKTiles where the splits that allows sum with the shared sum (sm90_small_plan).
inline int sm90_small_min_k_tiles(int bn) { return bn >= 64 ? 16 : kSplitKMinKTiles; }
constexpr int kSm90SmallSharedMinKTiles = 8;
constexpr int kSm90SmallCtasPerSm = 2;
// The V:2:M sparse-wgmma SpMM's register pipeline: its tokens per CTA by default, 16 up to 16 tokens, 32 up to 32,
// 32 up to 64 at M >= 16 and 64 at M = 8, above that 64, and at M = 8 128 (sm90_vnm_plan weighs 16 against 32 at
// 17-32 tokens and, at M = 8, 32 against 64 at 33-64), and the CTAs per SM its registers allow: three at 16 tokens,
// where each CTA waits on memory most of the time and more of them keep more loads in flight, two at 32 and at M = 8's
// 64 (the chunk gather's 123 registers), one at M >= 16's 64 and at 128 (~200 registers per thread).
inline int sm90_vnm_bn(int m, long long n_tokens) {
  if (n_tokens <= 16) return 16;
  if (n_tokens <= 32) return 32;
  if (n_tokens <= 64) return m == 8 ? 64 : 32;
  return m == 8 ? 128 : 64;
}
constexpr int sm90_vnm_ctas_per_sm(int m, int bn) { return bn == 16 ? 3 : bn == 32 || (m == 8 && bn == 64) ? 2 : 1; }
// Whether a V:2:M call runs on the CUDA cores (spmv_vnm.cu) instead of a sparse-wgmma tile: where its grid (one CTA
// per 16-row m-tile, kVnmGemvCtasPerSm per SM) fits one wave on `sms` SMs, at one token, and at 2-4 tokens (X in shared
// memory) up to 4096 features at M = 8 and up to kVnmGemvMaxK features x tokens at M >= 16. Against the 16-token tile
// (H200; benchmarks/RESULTS.md, "the V:2:M product of one token on the CUDA cores" and "... of 2-4 tokens ..."):
// - one token: 4096 -> 4096 1.13x at 64:2:8, 1.25x at 128:2:8, 1.23x at 64:2:16 (1.41-1.63x in a chain over cold
//   weights); 11008 -> 4096 0.99-1.17x (1.10-1.39x). Past one wave (from 5120 rows) 0.66-0.97x but at 64:2:16 on
//   4096 -> 11008 and 8192 -> 28672 (1.04-1.08x).
// - 2-4 tokens, X in shared memory: 4096 -> 4096 1.04-1.34x (1.06-1.41x in the chain) at 64:2:8, 128:2:8, 64:2:16
//   and 64:2:32; 11008 -> 4096 at M >= 16 1.02-1.17x (0.98-1.16x), at M = 8 0.86-0.99x (0.80-0.93x); past one wave
//   0.67-0.94x (0.63-0.93x). X read through L1 instead: 0.52-1.10x at 2 tokens, 0.34-0.93x at 4. At one token X in
//   shared memory was 0.80-0.97x of X through L1 but at 64:2:16.
constexpr int kVnmGemvMaxTokens = 4, kVnmGemvCtasPerSm = 2;
// X in shared memory: up to kVnmGemvMaxK features x tokens (96 KB, two CTAs per SM); at M = 8 up to
// kVnmGemvM8MaxK features.
constexpr int kVnmGemvMaxK = 49152, kVnmGemvM8MaxK = 4096;
constexpr int sm90_vnm_gemv_smem(long long x_elems) { return (int)(2 * x_elems); }
// Whether the form can take X of n_tokens x k (one token reads it through L1): what spmv_vnm requires, whatever the
// rule below prefers.
constexpr bool sm90_vnm_gemv_x_fits(long long n_tokens, long long k) {
  return n_tokens == 1 || (n_tokens <= kVnmGemvMaxTokens && n_tokens * k <= kVnmGemvMaxK);
}
constexpr bool sm90_vnm_gemv(int m, long long n_tokens, long long k, long long rows_padded, int sms) {
  if (m < 8 || n_tokens < 1 || !sm90_vnm_gemv_x_fits(n_tokens, k)) return false;
  if (rows_padded / 16 > (long long)kVnmGemvCtasPerSm * sms) return false;
  return n_tokens == 1 || m != 8 || k <= kVnmGemvM8MaxK;
}
// Whether the V:2:M sparse-wgmma SpMM transposes X and gathers whole kept rows of X^T (spmm_vnm_xt_sm90.cu, the
// X^T path): only the kept columns then cross L2 -> SM, for one extra pass over X. Taken from kVnmXtMinTokens
// tokens and from kVnmXtMinRows weight rows, where the GEMM is long enough against the transpose (which reads and
// writes X once). With its 128-token tiles it was faster than the register gather in 41 of the 48 cells measured at
// 72, 96 and 112 tokens (up to 3.9x; 64:2:8 / 128:2:8 / 64:2:16 / 128:2:16 at 4096 -> 4096, 11008 <-> 4096 and 28672
// -> 8192; 0.83-0.89x at 4096 -> 4096 with V = 64, 0.97x there at 128:2:8 and 72 tokens; benchmarks/RESULTS.md, "the
// X^T path from 65 tokens"), in 29 of 32 at 128 and 192 tokens and in 34 of 36 at 256-768 ("the X^T path below 1024
// tokens"). 65 is the first count past the register gather's 64-token tile. Below kVnmXtFewRowsMinTokens tokens and
// at V = 64 it needs more than kVnmXtMinRows rows: at 1024 rows (8 row blocks: the grouped-query key / value
// projections, 8192 -> 1024 and 4096 -> 1024) its few tiles are split and their partial sums cost more than the
// transpose saves; the register gather was 1.03-1.18x faster at 64:2:8 and 1.14-1.39x at 64:2:16 at 65-255 tokens
// (0.92-0.98x at 64:2:16 on 8192 -> 1024 at 192-255), while at 128:2:8 it was level (0.96-1.06x, chain 0.92-1.01x:
// one gathered tile feeds both slabs there); benchmarks/RESULTS.md, "issue 17 item 2 on every Llama-2 projection
// shape". At M = 8 the register gather keeps 1024 rows up to kVnmXtFewRowsMinTokensM8 tokens: at 256-511 tokens it
// was 1.07-1.27x faster at 64:2:8 on 4096 -> 1024 and 8192 -> 1024 (chain 1.02-1.34x) but at 511 tokens on 8192 ->
// 1024 (1.00x, chain 0.95x), while at 64:2:16 it lost from 320 tokens (0.67-0.92x; "the register pipeline on
// 1024-row weights at 256-511 tokens"). At 33-64 tokens, with its 64-token tile
// (kVnmXtFewBN), it is taken at M >= 16 from kVnmXtFewMinRows rows and for weights of kVnmXtFewMinWeights and more
// (the Llama-70B 8192 <-> 28672 projections). Against the register gather's 32-token tiles at 33, 48 and 64 tokens
// (benchmarks/RESULTS.md, "the X^T path's 64-token tile at 33-64 tokens"): 128:2:16 1.29-1.48x on the 7B/13B shapes it
// takes, 1.11-1.16x on 70B; 64:2:16 1.04-1.12x; 64:2:32 1.07-1.11x on 70B and 0.92-1.04x elsewhere (0.99-1.19x in a
// chain over cold weights). At 4096 rows it loses (64:2:16 0.72-0.74x at 4096 -> 4096, level at 11008 -> 4096).
// At M = 8 it is taken only where V = 128, where one gathered B tile feeds both of a CTA's slabs, on weights of
// kVnmXtFewMinWeightsV128 and more: against the register pipeline's 64-token tile 1.07-1.12x at 4096 -> 11008 and
// 1.00-1.06x at 11008 -> 4096 (45M weights each; chain 1.06-1.16x), 0.83-0.89x at 4096 -> 4096 (16.8M, not taken)
// ("two producer warpgroups"), 1.02-1.19x on the 13B and 70B shapes ("V in the V:2:M plan"). At V = 64 the register
// pipeline's tile is 0.99-1.09x faster than it ("two producer warpgroups").
constexpr long long kVnmXtMinTokens = 65, kVnmXtFewMinTokens = 33, kVnmXtFewRowsMinTokens = 256,
                    kVnmXtFewRowsMinTokensM8 = 512;
constexpr long long kVnmXtFewMinWeights = 1LL << 27, kVnmXtFewMinWeightsV128 = 1LL << 25;
constexpr int kVnmXtBN = 256;    // the X^T path's widest tile: 128 weight rows x 256 tokens (sm90_vnm_xt_plan)
constexpr int kVnmXtFewBN = 64;  // its tile at 64 tokens or fewer
constexpr int kVnmXtMinRows = 1024, kVnmXtFewMinRows = 4097;
inline bool sm90_vnm_xt(int m, long long n_tokens, int rows, long long k, int v) {
  if (m < 8 || rows < kVnmXtMinRows) return false;
  if (n_tokens >= (m == 8 ? kVnmXtFewRowsMinTokensM8 : kVnmXtFewRowsMinTokens)) return true;
  if (n_tokens >= kVnmXtMinTokens) return rows > kVnmXtMinRows || v >= 128;
  if (n_tokens < kVnmXtFewMinTokens) return false;
  const long long weights = (long long)rows * k;
  if (m >= 16) return rows >= kVnmXtFewMinRows || weights >= kVnmXtFewMinWeights;
  return v >= 128 && weights >= kVnmXtFewMinWeightsV128;
}
// `s` splits of k_tiles k-tiles, fewer where the k-tiles per split (rounded up) would leave the last ones empty.
inline long long sm90_splits_without_empty(long long k_tiles, long long s) {
  const long long per = (k_tiles + s - 1) / s;
  return (k_tiles + per - 1) / per;
}
// The cost of `splits` splits in the rounds model above: ceil(tiles x splits / slots) x (k-tiles per split +
// kSplitKFixedKTiles), in k-tiles of one CTA slot.
inline long long sm90_split_rounds_cost(long long tiles, long long k_tiles, long long splits, long long slots) {
  const long long per = (k_tiles + splits - 1) / splits;
  return (tiles * splits + slots - 1) / slots * (per + kSplitKFixedKTiles);
}
inline int sm90_split_k(long long tiles, long long k_tiles, int sms, int ctas_per_sm,
                        int min_k_tiles = kSplitKMinKTiles) {
  if (tiles <= 0 || tiles > kSplitKCounters || sms <= 0) return 1;
  long long most = k_tiles / min_k_tiles;
  if (most > kSplitKMax) most = kSplitKMax;
  const long long slots = (long long)sms * (ctas_per_sm > 1 ? ctas_per_sm : 1);
  long long best = 1, best_cost = -1;
  for (long long s = 1; s <= most; ++s) {
    const long long n = sm90_splits_without_empty(k_tiles, s), cost = sm90_split_rounds_cost(tiles, k_tiles, n, slots);
    if (best_cost < 0 || cost < best_cost) best = n, best_cost = cost;
  }
  return (int)best;
}
// Whether a split launch of non-persistent CTAs (the 2:4 few-token tiles, the V:2:M register pipeline) sums its
// partial tiles with the chunked shared sum (sm90_common.cuh SplitK::sum_owned: every split adds up and stores the
// chunks of the tile it owns) instead of the last split to arrive reading every split's partial tile alone: where its
// CTAs, tiles x splits, fit `slots`, the SMs x the CTAs per SM the kernel keeps resident, so that every split of a tile
// is resident at once and may wait for the others. The last-split sum is one CTA reading splits x its partial tile (16
// x 64 KB for the 128-token tile in 16 splits). Measured on the H200 (benchmarks/RESULTS.md, "the shared split-K sum
// of the few-token tiles" and "... at the CTAs per SM the kernels keep resident"): at one CTA per SM, the grouped-query
// key / value projections' 8 row blocks, 8192 -> 1024 and 4096 -> 1024 at 96-192 tokens, ran 1.17-1.38x faster at
// 64:2:8 and 1.05-1.14x at 64:2:16, and at 32-64 tokens 2:4 1.18-1.26x (with sm90_small_plan's 16 splits); at two and
// three per SM, the 88 cells of the Llama shapes at 8-64 tokens whose sum that changes, 1.02x (1.015x in a chain over
// distinct weights), 1.03x where a tile splits 6 or more ways and 1.016x in 2-5 splits, the most on 5120 -> 5120 and
// 11008 -> 4096 at 32-64 tokens, 1.05-1.15x (1.05-1.09x). Where other streams share the GPU, the launch relies on
// the GPU giving a started grid's remaining CTAs room before another grid's: such launches on two streams of
// different priorities at once finished in every run (tests/ops/test_kernels_gpu.py, concurrent streams). A
// cooperative launch would guarantee it; it measured level in GPU time and up to ~4.5 us slower in host time per
// V:2:M call, within this host's spread (benchmarks/RESULTS.md, "cooperative split-K launches").
inline bool sm90_split_sum_shared(long long tiles, int splits, long long slots) {
  return splits > 1 && tiles > 0 && tiles * splits <= slots;
}
// The split-K plan of a grid of 128-row x bn-token tiles with k_tiles k-tiles each on `sms` SMs running ctas_per_sm
// CTAs each: the splits (sm90_split_k) and the fp32 scratch their partial sums take, one 128 x bn accumulator tile
// per CTA (0 unsplit).
struct Sm90SplitPlan {
  int bn, splits;
  long long tiles;
  long long scratch_floats() const { return splits > 1 ? tiles * splits * 128 * bn : 0; }
};
// The busiest SM's work in a persistent plan, in token rows x k-tiles: its rounds of work units (ceil(units / SMs)),
// each one split's k-tiles of a tile plus, where the tile is split, its share of the split-K sum. Per k-tile a tile
// costs its width in tokens plus kSm90KTileFixedTokens: the wgmma computes every token of the width (those past the
// last one too, which the kernel does not load: it reads the last token tile in a box of its own tokens), and the A
// fragments and metadata of a k-tile (9 KB, as many bytes as 72 token rows of X) come whatever the width. The split-K
// sum costs kSm90SplitSumKTiles k-tiles per fp32 partial tile written or read back (splits + 1 for the last unit of a
// tile; 512 bytes per token row each). Fitted to the persistent configurations on the H200 (benchmarks/RESULTS.md,
// "tail map"): 4096 -> 4096 at 256 tokens, 20 in 4 splits of 16 k-tiles 26.2 µs against 23 in 2 of 32 21.8 µs; 11008 ->
// 4096 at 256, the same plans 42.5 against 38.8 µs; 28672 -> 8192 at 256, 20 in 2 splits of 224 k-tiles 130 µs against
// 23 unsplit 155 µs.
constexpr int kSm90KTileFixedTokens = 64, kSm90SplitSumKTiles = 3;
inline long long sm90_split_work(const Sm90SplitPlan& p, long long k_tiles, int sms,
                                 int fixed_tokens = kSm90KTileFixedTokens) {
  const long long sum = p.splits > 1 ? kSm90SplitSumKTiles * (p.splits + 1) : 0;
  return (p.tiles * p.splits + sms - 1) / sms * (p.bn + fixed_tokens) * ((k_tiles + p.splits - 1) / p.splits + sum);
}
// The 128-row x bn-token tiles of an output of rows_padded rows x n_tokens tokens.
inline long long sm90_tiles(long long rows_padded, long long n_tokens, int bn) {
  return ((rows_padded + 127) / 128) * ((n_tokens + bn - 1) / bn);
}
// The V:2:M X^T path's split-K (spmm_vnm_xt_sm90.cu): its 128 x bn tiles, each split in this many parts, are the
// work units its persistent CTAs (one per SM) walk. The count whose plan gives the busiest SM the least work
// (sm90_split_work with kVnmXtKTileFixedTokens), fewer splits on a tie, each split at least kSplitKMinKTiles k-tiles
// (16 groups each) long. Unlike the 2:4 configurations' rule it may leave more units than SMs: at 768 tokens, 28672
// -> 8192 (192 tiles) ran 1.2-1.4x faster in 2 splits (3 rounds of units) than unsplit (2 rounds, the second 45%
// full). Over the 48 cells measured (V:2:M, 256-768 tokens, 4096 -> 4096, 11008 <-> 4096, 28672 -> 8192;
// benchmarks/RESULTS.md, "the X^T path below 1024 tokens") its choices took 1.002x the time of the best split count
// of each cell (geometric mean), at worst 1.07x.
// A k-tile of the X^T path costs (tile tokens + kVnmXtKTileFixedTokens) in the work model: the part of a k-tile that
// does not grow with the width (A fragments, metadata, column words: the producers' per-step work). It decides only
// the 256- against 128-token choice (for one width it scales every split count's work alike). Fitted to the 58 cells
// where the plans of different values were each measured (64:2:8 and 64:2:16, 192-960 tokens, the Llama shapes;
// benchmarks/RESULTS.md, "the X^T path's width at 129-1024 tokens"): 16 took the fastest measured plan of every
// cell; 32 was 1.011x slower (geometric mean; at worst 1.13x), 64 1.058x (1.18x), 192 1.127x (1.25x).
constexpr int kVnmXtKTileFixedTokens = 16;
inline int sm90_vnm_xt_split_k(long long tiles, long long k_tiles, int sms, int bn = kVnmXtBN) {
  if (tiles <= 0 || tiles > kSplitKCounters || sms <= 0) return 1;
  long long most = k_tiles / kSplitKMinKTiles;
  if (most > kSplitKMax) most = kSplitKMax;
  Sm90SplitPlan best{bn, 1, tiles};
  long long best_work = sm90_split_work(best, k_tiles, sms, kVnmXtKTileFixedTokens);
  for (long long s = 2; s <= most; ++s) {
    const Sm90SplitPlan p{bn, (int)sm90_splits_without_empty(k_tiles, s), tiles};
    const long long work = sm90_split_work(p, k_tiles, sms, kVnmXtKTileFixedTokens);
    if (work < best_work) best = p, best_work = work;
  }
  return best.splits;
}
// The X^T path's plan: at kVnmXtFewBN tokens or fewer one tile of kVnmXtFewBN tokens per row block; above, tiles of
// kVnmXtBN or 128 tokens, each with its split count (sm90_vnm_xt_split_k), whichever gives the busiest SM the least
// work, the wider tile on a tie. E.g. 4096 -> 11008 at 512 tokens, M = 8 (86 row blocks, 32 k-tiles): 256 tokens,
// 172 tiles, 2 rounds x 272 x 32 = 17408; 128 tokens, 344 tiles, 3 x 144 x 32 = 13824: 128. The same at 1024 tokens:
// 3 x 272 x 32 = 26112 against 6 x 144 x 32 = 27648: 256.
inline Sm90SplitPlan sm90_vnm_xt_plan(long long rows_padded, long long n_tokens, long long k_tiles, int sms) {
  if (n_tokens <= kVnmXtFewBN) {
    const long long tiles = sm90_tiles(rows_padded, n_tokens, kVnmXtFewBN);
    return {kVnmXtFewBN, sm90_vnm_xt_split_k(tiles, k_tiles, sms, kVnmXtFewBN), tiles};
  }
  Sm90SplitPlan best{};
  long long best_work = -1;
  const int widths[2] = {kVnmXtBN, 128};
  for (const int bn : widths) {
    const long long tiles = sm90_tiles(rows_padded, n_tokens, bn);
    const Sm90SplitPlan p{bn, sm90_vnm_xt_split_k(tiles, k_tiles, sms, bn), tiles};
    const long long work = sm90_split_work(p, k_tiles, sms > 0 ? sms : 1, kVnmXtKTileFixedTokens);
    if (best_work < 0 || work < best_work) best = p, best_work = work;
  }
  return best;
}
// Whether an X^T-path plan of `bn`-token tiles runs them with the deeper ring (spmm_vnm_xt_sm90.cuh, XtCfg DEEP: five
// stages instead of four at 256 tokens, eight instead of six at 128, each with a 64-token staged epilogue so that they
// fit): 128- and 256-token tiles at M <= kVnmXtDeepRingMaxM and V < 128, of at most kVnmXtDeepRingMaxTokens tokens.
// At V = 64 a CTA's two slabs keep their own columns, so a k-tile takes two stages and each consumer warpgroup holds
// two of its own: the shallower ring leaves the producers waiting for a free one. Measured (benchmarks/RESULTS.md, "a
// fifth stage for the 256-token tile at V = 64" and "a deeper ring for the X^T path's 128-token tile at V = 64"):
// 64:2:16 at 96-256 tokens 1.04-1.16x faster (chain 1.01-1.16x), 64:2:8 and 64:2:32 at 128 and 256 tokens 1.01-1.18x
// (chain 1.04-1.17x), on 4096 <-> 11008 and 8192 <-> 28672; at V = 128 the fifth stage of the 256-token tile was level
// at 192-256 tokens (1.01-1.03x, chain 0.99-1.01x) and 0.94-1.07x at 8192 tokens (768 -> 3072 0.94x). Taken where it
// was measured: M = 8, 16 and 32 (the only M it is compiled for), V = 64, up to 256 tokens.
constexpr int kVnmXtDeepRingMaxM = 32;
constexpr long long kVnmXtDeepRingMaxTokens = 256;
inline bool sm90_vnm_xt_deep_ring(int m, int bn, long long n_tokens, int v) {
  return m <= kVnmXtDeepRingMaxM && (bn == kVnmXtBN || bn == 128) && v < 128 && n_tokens <= kVnmXtDeepRingMaxTokens;
}
inline Sm90SplitPlan sm90_split_plan(long long rows_padded, long long n_tokens, int bn, long long k_tiles,
                                     int sms, int ctas_per_sm, int min_k_tiles = kSplitKMinKTiles) {
  const long long tiles = sm90_tiles(rows_padded, n_tokens, bn);
  return {bn, sm90_split_k(tiles, k_tiles, sms, ctas_per_sm, min_k_tiles), tiles};
}
// The V:2:M register pipeline's plan: sm90_vnm_bn's tile, split by sm90_split_k, except where a narrower tile that
// reads the weight more often may still be faster: at 17-32 tokens the 32-token tile against two 16-token tiles, and
// at M = 8 and 33-64 tokens the 64-token tile against two 32-token tiles. It takes whichever plan's rounds
// (sm90_split_rounds_cost, in their CTA slots) cost less, the narrower on a tie, a k-tile of the wider tile costing
// so many eighths of one of the narrower:
// - 32 against 16 tokens: as much at M = 8 (16-byte chunks of X per thread), 5/4 at M >= 16 (one word per token and
//   kept column). Fitted to 84 cells, M = 8 / 16 / 32, 17-32 tokens, the Llama shapes (benchmarks/RESULTS.md, "the
//   V:2:M plan at 1-64 tokens"), time of the 16-token tiles / the 32-token tile: at M = 8 0.98-1.37x (1.04-1.44x in a
//   chain over distinct weights); at M >= 16 1.06-1.52x on 8192 <-> 28672 and, at 64:2:16, on 5120 <-> 13824,
//   0.90-1.04x elsewhere.
// - 64 against 32 tokens at M = 8: 13/8. Fitted to 56 cells, 64:2:8 and 128:2:8 at 33-64 tokens on the Llama shapes
//   ("the M = 8 64-token tile"): the 64-token tile was 1.13-1.30x faster on the 7B/13B shapes, whose rounds cost
//   1.73-2.0x as much in 32-token tiles, and 0.92-0.97x at 4096 -> 4096 (1.5x).
constexpr int kVnmWord32Cost = 10, kVnmChunk32Cost = 8, kVnmChunk64Cost = 13;  // eighths, above
inline Sm90SplitPlan sm90_vnm_plan(int m, long long rows_padded, long long n_tokens, long long k_tiles, int sms) {
  const auto plan = [&](int bn) {
    return sm90_split_plan(rows_padded, n_tokens, bn, k_tiles, sms, sm90_vnm_ctas_per_sm(m, bn), kVnmSplitMinKTiles);
  };
  const Sm90SplitPlan wide = plan(sm90_vnm_bn(m, n_tokens));
  if (sms <= 0 || n_tokens <= 16 || n_tokens > 64 || n_tokens > wide.bn) return wide;
  const Sm90SplitPlan narrow = plan(wide.bn / 2);
  const auto cost = [&](const Sm90SplitPlan& p) {
    return sm90_split_rounds_cost(p.tiles, k_tiles, p.splits, (long long)sms * sm90_vnm_ctas_per_sm(m, p.bn));
  };
  const int weight = wide.bn == 64 ? kVnmChunk64Cost : m == 8 ? kVnmChunk32Cost : kVnmWord32Cost;
  return weight * cost(wide) < 8 * cost(narrow) ? wide : narrow;
}
// The persistent configurations' plan: the configuration and its split-K. A work unit is a split of a tile, and the
// CTAs, one per SM, walk the units. A configuration splits only where its tiles leave half the SMs or more idle (e.g.
// 28672 -> 8192 at 192 tokens: 64 tiles of 448 k-tiles on 132 SMs), into as many splits as one round of units fills (2
// there), each at least kLargeSplitMinKTiles k-tiles long: the last split of a tile to finish reads back every split's
// 128 x (tile tokens) fp32 partial tile, 64-128 KB each. More units than SMs measured slower than the unsplit tiles
// (benchmarks/RESULTS.md, "split-K in the persistent 2:4 configurations": 8192 -> 28672 at 256 tokens, 224 tiles in 4
// splits, 217 against 149 µs).
constexpr int kLargeSplitMinKTiles = 16;
inline int sm90_large_split_k(long long tiles, long long k_tiles, int sms) {
  if (tiles <= 0 || tiles > kSplitKCounters || 2 * tiles > sms) return 1;
  long long s = sms / tiles;
  if (s > k_tiles / kLargeSplitMinKTiles) s = k_tiles / kLargeSplitMinKTiles;
  if (s > kSplitKMax) s = kSplitKMax;
  return s <= 1 ? 1 : (int)sm90_splits_without_empty(k_tiles, s);
}
struct Sm90LargePlan {
  int config;
  Sm90SplitPlan split;
};
inline Sm90LargePlan sm90_config_plan(int config, long long rows_padded, long long n_tokens, long long k_tiles,
                                      int sms) {
  const int bn = sm90_config_tokens(config);
  const long long tiles = sm90_tiles(rows_padded, n_tokens, bn);
  return {config, {bn, sm90_large_split_k(tiles, k_tiles, sms), tiles}};
}
// Up to kSm90WorkModelTokens tokens, the configuration whose plan gives the busiest SM the least work
// (sm90_split_work: its rounds of units x (tile tokens + 64) x (k-tiles per split + 3 x (splits + 1) where split)), the
// larger tile on a tie; above, the fill rule's (sm90_large_config), which measured well at thousands of tokens (the
// work model there was faster than the fill rule at 257-512 tokens: 8192 -> 28672 at 300-500, 1.10-1.18x; benchmarks/
// RESULTS.md, "tail map"). E.g. 28672 -> 8192 at 256 tokens (64 row blocks, 448 k-tiles): 256-token tiles,
// 64 x 2 splits, 1 x 320 x (224 + 9) = 74560; 192: 128 tiles, unsplit, 1 x 256 x 448; 128: 128 tiles, 1 x 192 x 448 =
// 86016: 20 in 2 splits. 4096 -> 4096 at 256 tokens (32 row blocks, 64 k-tiles): 20: 32 x 4 splits, 1 x 320 x (16 +
// 15) = 9920; 23: 64 x 2, 1 x 192 x (32 + 9) = 7872: 23 in 2 splits.
constexpr int kSm90WorkModelTokens = 512;
inline Sm90LargePlan sm90_large_plan(long long rows_padded, long long n_tokens, long long k_tiles, int sms) {
  if (n_tokens > kSm90WorkModelTokens)
    return sm90_config_plan(sm90_large_config(rows_padded, n_tokens, sms), rows_padded, n_tokens, k_tiles, sms);
  const int configs[3] = {kSm90Config256, kSm90Config192, kSm90Config128};  // larger tiles first: they win ties
  Sm90LargePlan best = sm90_config_plan(configs[0], rows_padded, n_tokens, k_tiles, sms);
  for (int i = 1; i < 3; ++i) {
    const Sm90LargePlan p = sm90_config_plan(configs[i], rows_padded, n_tokens, k_tiles, sms);
    if (sm90_split_work(p.split, k_tiles, sms) < sm90_split_work(best.split, k_tiles, sms)) best = p;
  }
  return best;
}

// The few-token tiles' split-K plan: splits of at least sm90_small_min_k_tiles k-tiles, or, for the 64-token tile, of
// kSm90SmallSharedMinKTiles where that gives more splits that sum with the shared sum (sm90_split_sum_shared; each
// split then reads back a 1 / splits share of the partial tiles, not the last one all of them): 8192 -> 1024 and
// 4096 -> 1024 (the grouped-query key / value projections, 8 row blocks) at 32-64 tokens in 16 / 8 splits instead of
// 8 / 4 (benchmarks/RESULTS.md, "the shared split-K sum of the few-token tiles"); 4096 -> 4096 and 5120 -> 5120 at
// 17-64 tokens in 8 / 6 instead of 4 / 5 (256 / 240 CTAs at two per SM; 0.98-1.06x, 1.00-1.03x in a chain: "... at
// the CTAs per SM the kernels keep resident").
inline Sm90SplitPlan sm90_small_plan(long long rows_padded, long long n_tokens, long long k_tiles, int sms) {
  const int bn = sm90_small_bn(n_tokens);
  const Sm90SplitPlan p =
      sm90_split_plan(rows_padded, n_tokens, bn, k_tiles, sms, kSm90SmallCtasPerSm, sm90_small_min_k_tiles(bn));
  if (bn < 64) return p;
  const Sm90SplitPlan q =
      sm90_split_plan(rows_padded, n_tokens, bn, k_tiles, sms, kSm90SmallCtasPerSm, kSm90SmallSharedMinKTiles);
  return q.splits > p.splits && sm90_split_sum_shared(q.tiles, q.splits, (long long)sms * kSm90SmallCtasPerSm) ? q : p;
}
// The 2:4 wgmma SpMM's plan (spmm_sm90.cu plan_call), each candidate made at most once: the few-token tiles
// (sm90_small_plan) where they run, else the persistent configuration `config` and its split (sm90_large_plan).
// The few-token tiles run up to kSm90FewTokens tokens. At 65-95 tokens the persistent plan was faster at the five Llama
// shapes where the few-token tiles had run there (1.05-1.26x, 1.09-1.42x in a chain over cold weights); at 65-256
// tokens a model of both (sm90_split_work, x 1.5 for the cp.async kernel's lower rate per token row and k-tile)
// preferred the few-token tiles only on exact ties (benchmarks/RESULTS.md, "tail map").
// Up to kSm90FewTokensShared tokens the few-token 128-token tile still runs where the persistent plan splits its tiles
// kSm90FewTokenLargeMinSplits or more ways (the last split of a partial tile reads back every split's 64 KB partial
// tile) into work units that fill at most half the SMs, and where the few-token plan's splits sum with the shared sum:
// the grouped-query key / value projections' 8 row blocks and BERT-base's 3072 -> 768. Measured on the H200
// (benchmarks/RESULTS.md, "the few-token tiles above 64 tokens"), GPU time (in a chain over distinct weights): 8192 ->
// 1024 at 96 / 128 tokens 1.19-1.20 / 1.01-1.04x (1.27-1.28 / 1.09x), 4096 -> 1024 at 96 / 128 / 192 1.17-1.19 /
// 1.03-1.04 / 1.07-1.10x (1.20-1.21 / 1.06-1.07 / 1.09x), 3072 -> 768 1.08-1.10 / 1.00-1.02 / 1.06x. Not taken: where
// the persistent plan is unsplit or in 2 splits (1024 -> 1024 and 1024 -> 4096 at 96-192 tokens 0.70-0.74x, 2048 ->
// 2048 0.92-1.03x), and at 256 tokens, where the persistent tiles are full (0.92-0.97x).
constexpr int kSm90FewTokens = 64, kSm90FewTokensShared = 192, kSm90FewTokenLargeMinSplits = 3;
struct Sm90Sparse24Plan {
  bool few_token;
  int config;  // the persistent configuration where !few_token
  Sm90SplitPlan split;
};
inline Sm90Sparse24Plan sm90_sparse24_plan(long long rows_padded, long long n_tokens, long long k_tiles, int sms) {
  if (n_tokens <= kSm90FewTokens) return {true, 0, sm90_small_plan(rows_padded, n_tokens, k_tiles, sms)};
  const Sm90LargePlan large = sm90_large_plan(rows_padded, n_tokens, k_tiles, sms);
  if (n_tokens <= kSm90FewTokensShared && large.split.splits >= kSm90FewTokenLargeMinSplits &&
      2 * large.split.tiles * large.split.splits <= sms) {
    const Sm90SplitPlan small = sm90_small_plan(rows_padded, n_tokens, k_tiles, sms);
    if (sm90_split_sum_shared(small.tiles, small.splits, (long long)sms * kSm90SmallCtasPerSm)) return {true, 0, small};
  }
  return {false, large.config, large.split};
}
}  // namespace hf_sparse
