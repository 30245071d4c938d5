// Host entry points of the hf_sparse kernels: raw device pointers, no torch types, so the .cu files build with
// plain nvcc. binding.cpp validates tensors and calls these on the current stream.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "tile_config.h"

namespace hf_sparse {

struct SpmmArgs {
  const void* x;          // (n_tokens, k) row-major, bf16 or fp16, 16-byte aligned, k % 8 == 0
  const void* values;     // (rows_padded/16, steps, 32, 8) same dtype
  const void* meta;       // (rows_padded/16, steps, 16) uint32
  const uint8_t* columns; // (rows_padded/64, steps*8, 4)
  const void* bias;       // (rows,) or nullptr
  void* y;                // (n_tokens, rows) row-major
  int n_tokens, rows, rows_padded, k, m, steps;
  int v = 64;  // V:2:M's V, the rows of a block that keep the same columns (64 or 128): the V:2:M plan reads it
  bool is_bf16;
  int act = 0;  // epilogue activation (common.cuh kActNone / kActGelu); only spmm_sm90 takes one other than none
  // Split-K scratch of the sparse-wgmma SpMMs (tile_config.h sm90_split_k): split_ws holds the fp32 partial sums,
  // the call's SpmmPlan::split_floats() of them, no initial value needed;
  // split_counters kSplitKCounters ints, zero before the first launch and left zero by every launch, used by one
  // stream at a time. Null: the kernel does not split (the binding passes null while a CUDA graph is captured on a
  // stream that has no counters yet, which it cannot allocate and zero there).
  float* split_ws = nullptr;
  int* split_counters = nullptr;
  // X^T scratch of the V:2:M sparse-wgmma SpMM's large-token path (tile_config.h sm90_vnm_xt): the call's
  // SpmmPlan::xt_elems elements of x's dtype; required where the plan takes that path.
  void* xt = nullptr;
};
cudaError_t spmm(const SpmmArgs& args, cudaStream_t stream);

// A sparse-wgmma SpMM call's plan (the rules of tile_config.h): its path, token width and split-K. Made once per call
// by spmm_sm90_plan / spmm_vnm_sm90_plan, whose result the binding reads to size the call's scratch and hands to the
// launch, so the two never disagree and the host works it out once.
struct SpmmPlan {
  bool few_token = false;  // 2:4: the few-token tiles; else the persistent configuration `config`
  int config = 0;
  bool xt = false;                // V:2:M: the X^T path (spmm_vnm_xt_sm90.cu); else the register pipeline
  bool gemv = false;              // V:2:M: the few-token CUDA-core form (spmv_vnm.cu); takes no scratch
  Sm90SplitPlan split{0, 1, 0};  // token width, split-K parts, tiles; the launch runs one split without scratch
  int64_t xt_elems = 0;           // X^T scratch elements (x's dtype) where xt
  int64_t split_floats() const { return split.scratch_floats(); }  // split-K scratch, fp32 elements (0: unsplit)
};

// Plain 2:4 (m == 4) SpMM with sparse wgmma (csrc/spmm_sm90.cu); same arguments and layout as spmm (columns
// unused). Only where spmm_sm90_available(): current device cc 9.0 and the build included sm_90a
// (HF_SPARSE_HAS_SM90A), asked of the CUDA runtime once per device; otherwise it returns
// cudaErrorNoKernelImageForDevice. `plan` is spmm_sm90_plan(args) (n_tokens > 0; an error from it is the device's).
bool spmm_sm90_available();
cudaError_t spmm_sm90_plan(const SpmmArgs& args, SpmmPlan* plan);
cudaError_t spmm_sm90(const SpmmArgs& args, const SpmmPlan& plan, cudaStream_t stream);
#if defined(HF_SPARSE_TIMELINE)
// Timeline build only: the stamps of spmm_sm90's CTAs 0 .. ctas - 1 (rows of spmm_sm90_timeline_marks() u64; each
// row the last call that ran that CTA, zero where none since the last read) into `host`, then every row zeroed; the
// rows copied, or -1.
int spmm_sm90_timeline(unsigned long long* host, int ctas);
int spmm_sm90_timeline_marks();
#endif
// V:2:M (m >= 8) SpMM with sparse wgmma (csrc/spmm_vnm_sm90.cu), gathering the kept columns of X into shared
// memory, or through X^T where the plan says so; same arguments and layout as spmm, same availability as spmm_sm90.
cudaError_t spmm_vnm_sm90_plan(const SpmmArgs& args, SpmmPlan* plan);
cudaError_t spmm_vnm_sm90(const SpmmArgs& args, const SpmmPlan& plan, cudaStream_t stream);
// Its few-token form (csrc/spmv_vnm.cu), taken where the plan's `gemv` is set (tile_config.h sm90_vnm_gemv): the
// product on the CUDA cores, reading the same pack; X as sm90_vnm_gemv_x_fits allows, no activation, no scratch.
cudaError_t spmv_vnm(const SpmmArgs& args, cudaStream_t stream);
// Its X^T path (csrc/spmm_vnm_xt_sm90.cu), for spmm_vnm_sm90 and its plan: whether a call takes it (tile_config.h
// sm90_vnm_xt; the lab build's vnm_xt knob forces it on or off), the path's tiles and split on `sms` SMs, its X^T
// scratch, and its launch (a.xt set).
bool spmm_vnm_sm90_takes_xt(const SpmmArgs& args);
Sm90SplitPlan spmm_vnm_xt_sm90_split(const SpmmArgs& args, int sms);
int64_t spmm_vnm_xt_sm90_elems(const SpmmArgs& args);
cudaError_t spmm_vnm_xt_sm90(const SpmmArgs& args, const SpmmPlan& plan, cudaStream_t stream);
#if defined(HF_SPARSE_TIMELINE)
// Timeline build only: the cycle counters (XtCounter in spmm_vnm_xt_sm90.cuh, spmm_vnm_xt_sm90_timeline_counters() u64
// per CTA) of the X^T path's CTAs 0 .. ctas - 1 (each row the last call that ran that CTA, zero where none since the
// last read) into `host`, then zeroed; the rows copied, or -1.
int spmm_vnm_xt_sm90_timeline(unsigned long long* host, int ctas);
int spmm_vnm_xt_sm90_timeline_counters();
#endif

struct SddmmArgs {
  const void* dy;         // (n_tokens, rows) row-major
  const void* x;          // (n_tokens, k) row-major, k % 8 == 0
  const void* meta;       // packed metadata, as for spmm
  const uint8_t* columns; // packed columns, as for spmm
  float* out;             // (rows, 2 * groups) fp32, logical order
  int n_tokens, rows, rows_padded, k, m, steps;
  bool is_bf16;
};
cudaError_t sddmm(const SddmmArgs& args, cudaStream_t stream);
// The same with dense wgmma (csrc/sddmm_sm90.cu), same availability as spmm_sm90. `out` need not be zeroed (every
// logical slot is written; where the token range is split the kernel zeroes it first). Where no TMA tensor map can be
// made it zeroes `out` and runs sddmm().
cudaError_t sddmm_sm90(const SddmmArgs& args, cudaStream_t stream);

struct PackArgs {
  const void* weight;     // (rows, k) dense masked master, fp32 / bf16 / fp16
  int weight_dtype;       // 0 fp32, 1 bf16, 2 fp16
  const bool* mask;       // (rows, k)
  void* values;           // out: (rows_padded/16, steps, 32, 8) compute dtype
  uint32_t* meta;         // out: (rows_padded/16, steps, 16)
  uint8_t* columns;       // out: (rows_padded/64, steps*8, 4)
  bool* valid;            // out: (rows, 2 * groups)
  int* error;             // out: device flag, set non-zero if the mask is not V:2:M
  uint32_t* scratch;      // (rows/v) * (k/m) * ceil(m/32) words, zeroed by pack() (M > 4 only)
  int rows, rows_padded, k, v, m, steps;
  bool out_bf16;
};
cudaError_t pack(const PackArgs& args, cudaStream_t stream);

// apply_masks (csrc/mask.cu): data[t][i] = 0 (all bits) where mask[t][i] == 0, for up to kMaxMaskTensors contiguous
// tensors of one element size (2 or 4 bytes) in one launch. Block b masks chunk (b - first_block[t]) of tensor t,
// apply_masks_chunk() elements per chunk; first_block is increasing, first_block[0] == 0, blocks = the total.
constexpr int kMaxMaskTensors = 64;
struct MaskBatch {
  void* data[kMaxMaskTensors];
  const uint8_t* mask[kMaxMaskTensors];  // bool, same number of elements as data[t]
  int64_t numel[kMaxMaskTensors];
  int first_block[kMaxMaskTensors];
  bool aligned[kMaxMaskTensors];  // data 16-byte aligned and mask (16 / elem_size)-byte aligned
  int count, blocks, elem_size;
};
int64_t apply_masks_chunk();
cudaError_t apply_masks(const MaskBatch& args, cudaStream_t stream);

// Mask selection (csrc/mask_select.cu), the rules of hf_sparse.masks: `score` fp32 (rows x cols, row-major), `out`
// bool of the same shape. vnm_mask needs scratch: `sums` (rows/v x cols doubles) and `bits` ((rows/v) x (cols/m) x
// ceil(m/32) words). transposable_2to4_mask takes the 90 patterns as 16-bit row-major 4x4 bitmasks, in the order
// whose first best pattern wins.
cudaError_t nm_mask(const float* score, bool* out, int rows, int cols, int n, int m, cudaStream_t stream);
cudaError_t vnm_mask(const float* score, double* sums, uint32_t* bits, bool* out, int rows, int cols, int v, int n,
                     int m, int keep_cols, cudaStream_t stream);
cudaError_t transposable_2to4_mask(const float* score, const uint16_t* patterns, bool* out, int rows, int cols,
                                   cudaStream_t stream);

// Pack refresh (csrc/refresh.cu). Kinds of pack a compact layer computes on (hf_sparse.nn.refresh names them too):
// kRefreshPack, its own fragment-ordered pack; kRefreshTransposed, the 2:4 pack of W^T (made by
// transposed_from_values); kRefreshView24, the 2:4 view of a V:2:M weight (made by view24_from_values); kRefreshCopy, a
// converting copy (the bias in the compute dtype).
// A RefreshEntry is a kRefreshPack or kRefreshCopy: it writes `numel` destination elements, converting from src_dtype
// to dst_dtype (kRefreshF32 / BF16 / F16). A kRefreshPack entry writes the fragment-ordered pack (rows_padded/16,
// steps, 32, 8) of src ((rows, 2 * groups) row-major, the layer's kept values), zero in the layout's padding;
// kRefreshCopy: dst[j] = src[j]. The layout is fixed (kRefreshWords 8-byte words) because hf_sparse.nn.refresh writes
// the table as an int64 tensor: refresh_packs takes `count` entries in device memory, first_block increasing from 0
// by refresh_blocks(numel) per entry, `blocks` the total.
enum : int32_t { kRefreshPack = 0, kRefreshTransposed = 1, kRefreshView24 = 2, kRefreshCopy = 3 };
enum : int32_t { kRefreshF32 = 0, kRefreshBF16 = 1, kRefreshF16 = 2 };
struct RefreshEntry {
  const void* src;
  void* dst;
  int64_t numel, rows, groups, steps, first_block;
  int32_t kind, src_dtype, dst_dtype, unused;
};
constexpr int kRefreshWords = 9;
static_assert(sizeof(RefreshEntry) == 8 * kRefreshWords, "RefreshEntry is read from an int64 table of 9 words");
int64_t refresh_blocks(int64_t numel);
cudaError_t refresh_packs(const RefreshEntry* table, int count, int64_t blocks, cudaStream_t stream);
// One entry, passed by value (no table in device memory): the own pack made inside a compact layer's training call.
cudaError_t refresh_one(const RefreshEntry& entry, cudaStream_t stream);

// A compact layer's kept positions in their on-disk form (docs/format.md), read in place: `sel` (rows, sel_row_bytes)
// uint8 holds each kept value's 2-bit code, packed LSB first (2:4: its offset in the group of 4; V:2:M: its position
// among the block's 4 columns); `columns` (rows / v, groups, 4) uint8, V:2:M only (nullptr for 2:4), each V-row
// block's kept column offsets in the group. The kept value (r, 2 g + j) sits at column m g + offset.
struct KeptPositions {
  const uint8_t* sel;
  const uint8_t* columns;
  int64_t rows, groups, sel_row_bytes;
  int32_t m, v;
};
// dst (rows, 2 groups) = src (rows, m groups) at the kept positions, converted (kRefresh* dtypes): the gradient of the
// kept values out of a dense weight gradient.
cudaError_t gather_kept(const void* src, int32_t src_dtype, void* dst, int32_t dst_dtype, const KeptPositions& pos,
                        cudaStream_t stream);
// dst (rows, m groups) = the kept values src (rows, 2 groups) at their positions, zero elsewhere (a dense weight).
cudaError_t scatter_kept(const void* src, int32_t src_dtype, void* dst, int32_t dst_dtype, const KeptPositions& pos,
                         cudaStream_t stream);
// The 2:4 view of a V:2:M pack (m >= 8), made from the pack itself: `values` (rows_padded/16, steps, 32, 8) 16-bit,
// `meta` (rows_padded/16, steps, 16), `columns` (rows_padded/64, 8 steps, 4) as hf_sparse.ops._layout writes them, for
// a (rows, cols) weight; out_values (rows_padded/16, steps4, 32, 8) and out_meta (rows_padded/16, steps4, 16) the 2:4
// pack (steps4 = ceil(cols / 32)) of the same matrix in the layout's canonical form (selectors increasing, a lone value
// after the first offset below it that is not kept, padding zero with selectors 0 and 1).
cudaError_t view24_from_pack(const uint16_t* values, const int32_t* meta, const uint8_t* columns, int64_t rows_padded,
                             int64_t rows, int64_t cols, int32_t m, int64_t steps, uint16_t* out_values,
                             int32_t* out_meta, cudaStream_t stream);
// The values of the same 2:4 view made from the layer's kept values instead (what a training call's forward on the
// view reads; its metadata is the layer's, made once): `weight` (rows, 2 cols / m) in src_dtype, the positions `pos`
// in their on-disk form (m >= 8, v and m powers of two, columns 4-byte aligned), out (tiles, steps4, 32, 8) in
// dst_dtype (kRefreshBF16 / kRefreshF16), every slot written (padding zero). The bytes kRefreshView24 writes.
cudaError_t view24_from_values(const void* weight, int32_t src_dtype, const KeptPositions& pos, int64_t tiles,
                               int64_t steps4, void* out, int32_t dst_dtype, cudaStream_t stream);
// The values of a 2:4 layer's transposed pack (W^T as 2:4, for a mask whose transpose is 2:4 too) made from its kept
// values: `weight` (rows, cols / 2) in src_dtype, `pos` 2:4 (no block columns), out (tiles, steps, 32, 8) with
// tiles * 16 >= cols and steps * 8 >= rows / 4, in dst_dtype, every slot written.
cudaError_t transposed_from_values(const void* weight, int32_t src_dtype, const KeptPositions& pos, int64_t tiles,
                                   int64_t steps, void* out, int32_t dst_dtype, cudaStream_t stream);

}  // namespace hf_sparse
