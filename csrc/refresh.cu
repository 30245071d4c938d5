// The packs of a compact layer (hf_sparse.nn.compact) made from its kept values, and what else reads those values
// at their positions in their on-disk form (no index or permutation is kept):
// - refresh_one / refresh_packs: the layer's own fragment-ordered pack (and the bias's cast). A training call makes
//   its own pack with refresh_one (one entry, passed by value); inference keeps the pack between calls, and after each
//   optimizer step refresh_packs rewrites every stale one in one launch: a table in device memory lists the work
//   (RefreshEntry), block b finds its entry by binary search over the entries' first blocks. With torch ops that is
//   a strided copy and a cast per layer, and on a host that needs ~20 us per launch, 144 BERT-large layers' worth of
//   launches cost what the sparse step saves on the GPU.
// - view24_from_values / transposed_from_values: the 2:4 view of a V:2:M weight and the transposed 2:4 pack, which a
//   training call makes (pack_in_call in binding.cpp); view24_from_pack: the view made from the pack, for inference
//   that holds one copy of the values.
// - gather_kept / scatter_kept: a layer's kept values out of a dense matrix (its weight gradient) and into one (a
//   transient dense weight), in one pass each.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "kernels.h"

namespace hf_sparse {
namespace {

constexpr int kThreads = 256;
constexpr int kPerThread = 4;
constexpr int64_t kPerBlock = (int64_t)kThreads * kPerThread;

__device__ __forceinline__ float load_as_float(const void* src, int64_t i, int dtype) {
  switch (dtype) {
    case kRefreshF32: return static_cast<const float*>(src)[i];
    case kRefreshBF16: return __bfloat162float(static_cast<const __nv_bfloat16*>(src)[i]);
    default: return __half2float(static_cast<const __half*>(src)[i]);
  }
}

__device__ __forceinline__ void store_float(void* dst, int64_t i, int dtype, float v) {
  switch (dtype) {
    case kRefreshF32: static_cast<float*>(dst)[i] = v; break;
    case kRefreshBF16: static_cast<__nv_bfloat16*>(dst)[i] = __float2bfloat16(v); break;
    default: static_cast<__half*>(dst)[i] = __float2half(v); break;
  }
}

// The slot that holds the only kept value of a group of 4 in a 2:4 pack made by hf_sparse.ops._layout, whose
// selectors are the kept offsets padded with the first offsets not kept, in increasing order: slot 0 when the value
// is at offset 0 (padding at 1), else slot 1 (padding at 0).
__device__ __forceinline__ int lone_slot(int offset) { return offset == 0 ? 0 : 1; }

// The sources of destination slots 2 q and 2 q + 1 of a kRefreshPack entry (one row and group of the pack; src is
// (rows, 2 * groups) row-major), -1 for a slot in the layout's padding (it reads zero).
__device__ __forceinline__ void pair_sources(const RefreshEntry& e, int64_t q, int64_t* s) {
  // values (tiles, steps, 32, 8) seen as (tile, step, g8, t, ch, rh, k): row 16 tile + 8 rh + g8, group 8 step +
  // 4 ch + t, kept value k of the group. A pack's tile_step = q >> 7 is below 2^32 (its numel below 2^40).
  const int32_t rh = q & 1, ch = (q >> 1) & 1, t = (q >> 2) & 3, g8 = (q >> 4) & 7;
  const uint32_t tile_step = (uint32_t)(q >> 7), steps = (uint32_t)e.steps;
  const uint32_t tile = tile_step / steps, step = tile_step - tile * steps;
  const int32_t row = 16 * (int32_t)tile + 8 * rh + g8, group = 8 * (int32_t)step + 4 * ch + t;
  if (row >= e.rows || group >= e.groups) {
    s[0] = s[1] = -1;
    return;
  }
  s[0] = ((int64_t)row * e.groups + group) * 2, s[1] = s[0] + 1;
}

// Each thread: kPerThread / 2 slot pairs of a pack entry (a block covers kPerBlock slots of it, as refresh_blocks
// counts), or kPerThread elements of a copy.
__device__ __forceinline__ void run_entry(const RefreshEntry& e, int64_t block) {
  if (e.kind == kRefreshCopy) {
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
      const int64_t j = block * kPerBlock + (int64_t)i * kThreads + threadIdx.x;
      if (j >= e.numel) return;
      store_float(e.dst, j, e.dst_dtype, load_as_float(e.src, j, e.src_dtype));
    }
    return;
  }
  int64_t s[kPerThread];
#pragma unroll
  for (int i = 0; i < kPerThread / 2; ++i) {
    const int64_t q = block * (kPerBlock / 2) + (int64_t)i * kThreads + threadIdx.x;
    if (2 * q < e.numel) {
      pair_sources(e, q, s + 2 * i);
    } else {
      s[2 * i] = s[2 * i + 1] = -1;
    }
  }
  float v[kPerThread];
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) v[i] = s[i] < 0 ? 0.0f : load_as_float(e.src, s[i], e.src_dtype);
#pragma unroll
  for (int i = 0; i < kPerThread / 2; ++i) {
    const int64_t q = block * (kPerBlock / 2) + (int64_t)i * kThreads + threadIdx.x;
    if (2 * q >= e.numel) return;
    store_float(e.dst, 2 * q, e.dst_dtype, v[2 * i]);
    store_float(e.dst, 2 * q + 1, e.dst_dtype, v[2 * i + 1]);
  }
}

__global__ void __launch_bounds__(kThreads) refresh_many_kernel(const RefreshEntry* table, int count) {
  int lo = 0, hi = count - 1;  // the entry of this block: the last with first_block <= blockIdx.x
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (table[mid].first_block <= (int64_t)blockIdx.x) lo = mid;
    else hi = mid - 1;
  }
  const RefreshEntry e = table[lo];
  run_entry(e, (int64_t)blockIdx.x - e.first_block);
}

__global__ void __launch_bounds__(kThreads) refresh_one_kernel(const RefreshEntry e) { run_entry(e, blockIdx.x); }

// One thread per value pair of the view (the two slots of one row and group of 4 columns: 4 bytes, so the lanes of a
// warp write 128 consecutive bytes); the 8 lanes that share a metadata word (its 2 rows x 4 groups) combine their
// selectors by shuffles and the first of them writes it. blockIdx.y is the 16-row tile, the threads of x run over
// its steps4 * 128 pairs (a multiple of 128, so every warp is whole); indices are 32-bit and m a power of two
// (log2_m), so no thread divides. The three reads a pair needs (the source's metadata word, its block's four
// column bytes as one word, the source value pair) do not depend on each other, so each thread issues them together
// and waits for memory once.
__global__ void __launch_bounds__(kThreads)
    view24_kernel(const uint32_t* __restrict__ values, const int32_t* __restrict__ meta,
                  const uint32_t* __restrict__ columns, int32_t rows, int32_t groups4, int32_t log2_m, int32_t steps,
                  int32_t steps4, uint32_t* __restrict__ out_values, int32_t* __restrict__ out_meta) {
  const int32_t p = blockIdx.x * kThreads + threadIdx.x;  // pair within the tile
  if (p >= steps4 * 128) return;
  const int32_t tile = blockIdx.y, step4 = p >> 7, within = p & 127;
  // element 2p of the tile's (steps4, 32, 8) values is (step4, g8, t, ch, rh, k = 0)
  const int32_t g8 = within >> 4, t = (within >> 2) & 3, ch = (within >> 1) & 1, rh = within & 1;
  const int32_t row = 16 * tile + 8 * rh + g8, g4 = 8 * step4 + 4 * ch + t;
  uint32_t pair = 0, sel0 = 0, sel1 = 1;
  if (row < rows && g4 < groups4) {
    const int32_t h = (4 * g4) >> log2_m;  // the V:2:M group holding these 4 columns
    const int32_t src_step = h >> 3, src_ch = (h >> 2) & 1, src_t = h & 3;
    const int64_t src_tile_step = (int64_t)tile * steps + src_step;
    const int64_t meta_at = src_tile_step * 16 + g8 * 2 + src_ch;
    const uint32_t meta_word = __ldg(reinterpret_cast<const unsigned int*>(meta) + meta_at);
    const uint32_t block = __ldg(columns + (int64_t)(row >> 6) * steps * 8 + h);
    const uint32_t source = __ldg(values + ((src_tile_step * 256 + g8 * 32 + src_t * 8 + src_ch * 4 + rh * 2) >> 1));
    const uint32_t nib = (meta_word >> (16 * rh + 4 * src_t)) & 0xF;
    const int32_t base = h << log2_m;
    const int32_t c0 = base + ((block >> (8 * (nib & 3))) & 0xFF), c1 = base + ((block >> (8 * (nib >> 2))) & 0xFF);
    const bool in0 = (c0 >> 2) == g4, in1 = (c1 >> 2) == g4;  // c0 < c1
    if (in0 && in1) {
      pair = source, sel0 = (uint32_t)(c0 & 3), sel1 = (uint32_t)(c1 & 3);
    } else if (in0 || in1) {
      const uint32_t v = in0 ? source & 0xFFFF : source >> 16;
      const uint32_t offset = (uint32_t)((in0 ? c0 : c1) & 3);
      if (lone_slot((int)offset) == 0) {
        pair = v;  // padding at offset 1
      } else {
        pair = v << 16, sel1 = offset;  // padding at offset 0
      }
    }
  }
  const int64_t tile_step = (int64_t)tile * steps4 + step4;
  out_values[tile_step * 128 + (within)] = pair;
  uint32_t word = (sel0 | sel1 << 2) << (16 * rh + 4 * t);
  word |= __shfl_xor_sync(0xffffffffu, word, 1);  // the other row half
  word |= __shfl_xor_sync(0xffffffffu, word, 4);  // the other groups of the word
  word |= __shfl_xor_sync(0xffffffffu, word, 8);
  if ((within & 0xD) == 0) out_meta[tile_step * 16 + g8 * 2 + ch] = (int32_t)word;
}

template <typename T>
__device__ __forceinline__ float as_float(T x);
template <>
__device__ __forceinline__ float as_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ float as_float<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }
template <>
__device__ __forceinline__ float as_float<__half>(__half x) { return __half2float(x); }

template <typename T>
__device__ __forceinline__ uint32_t bits16(float x);
template <>
__device__ __forceinline__ uint32_t bits16<__nv_bfloat16>(float x) { return __bfloat16_as_ushort(__float2bfloat16(x)); }
template <>
__device__ __forceinline__ uint32_t bits16<__half>(float x) { return __half_as_ushort(__float2half(x)); }

// Four consecutive elements of a row of T, written as one 8-byte (16-bit T) or 16-byte (float) store.
template <typename T>
__device__ __forceinline__ void store4(T* p, float a, float b, float c, float d);
template <>
__device__ __forceinline__ void store4<float>(float* p, float a, float b, float c, float d) {
  *reinterpret_cast<float4*>(p) = make_float4(a, b, c, d);
}
template <typename T>
__device__ __forceinline__ void store4(T* p, float a, float b, float c, float d) {
  *reinterpret_cast<uint2*>(p) = make_uint2(bits16<T>(a) | bits16<T>(b) << 16, bits16<T>(c) | bits16<T>(d) << 16);
}

// Two consecutive elements of T, written as one store.
template <typename T>
__device__ __forceinline__ void store2(T* p, float a, float b);
template <>
__device__ __forceinline__ void store2<float>(float* p, float a, float b) {
  *reinterpret_cast<float2*>(p) = make_float2(a, b);
}
template <typename T>
__device__ __forceinline__ void store2(T* p, float a, float b) {
  *reinterpret_cast<uint32_t*>(p) = bits16<T>(a) | bits16<T>(b) << 16;
}

// The group of m columns of a row that thread q of a gather_kept / scatter_kept launch handles (one thread per group,
// 32-bit indices: one division per thread, none per element), false past the last group: `q` is also the index of
// the group's pair of kept values in (rows, 2 groups), `first` the group's first element in the dense (rows, m groups)
// matrix, `o0` / `o1` the column offsets within the group of its two kept values, from the positions in their
// on-disk form (both 2-bit codes share one nibble of `sel`; for 2:4 the code is the offset, for V:2:M it picks one of
// the V-row block's four column offsets of the group).
struct KeptGroup {
  int32_t q, o0, o1;
  int64_t first;
};
__device__ __forceinline__ bool kept_group(const KeptPositions& p, KeptGroup* k) {
  const int32_t q = blockIdx.x * kThreads + threadIdx.x, groups = (int32_t)p.groups;
  if (q >= (int32_t)p.rows * groups) return false;
  const int32_t r = q / groups, g = q - r * groups;
  const uint32_t nib = (__ldg(p.sel + (int64_t)r * p.sel_row_bytes + (g >> 1)) >> (4 * (g & 1))) & 0xF;
  if (p.columns == nullptr) {
    k->o0 = nib & 3, k->o1 = nib >> 2;
  } else {
    const uint8_t* block = p.columns + ((int64_t)(r / p.v) * p.groups + g) * 4;
    k->o0 = __ldg(block + (nib & 3)), k->o1 = __ldg(block + (nib >> 2));
  }
  k->q = q;
  k->first = (int64_t)r * groups * p.m + (int64_t)g * p.m;
  return true;
}

// gather_kept: each thread reads its group's two kept values of the dense src and writes them as one pair of dst
// (rows, 2 groups).
template <typename Src, typename Dst>
__global__ void __launch_bounds__(kThreads)
    gather_kept_kernel(const Src* __restrict__ src, Dst* __restrict__ dst, KeptPositions p) {
  KeptGroup k;
  if (!kept_group(p, &k)) return;
  const Src* group = src + k.first;
  store2(dst + 2 * (int64_t)k.q, as_float(group[k.o0]), as_float(group[k.o1]));
}

// scatter_kept: each thread reads its group's two kept values and writes the group's m elements of the dense dst (the
// kept values at their offsets, zero elsewhere) four at a time.
template <typename Src, typename Dst>
__global__ void __launch_bounds__(kThreads)
    scatter_kept_kernel(const Src* __restrict__ src, Dst* __restrict__ dst, KeptPositions p) {
  KeptGroup k;
  if (!kept_group(p, &k)) return;
  const float a = as_float(src[2 * (int64_t)k.q]), b = as_float(src[2 * (int64_t)k.q + 1]);
  Dst* group = dst + k.first;
  for (int32_t c = 0; c < p.m; c += 4) {
    float v[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] = c + i == k.o0 ? a : c + i == k.o1 ? b : 0.0f;  // the first kept value wins a tie
    store4(group + c, v[0], v[1], v[2], v[3]);
  }
}

// view24_from_values: one thread per value pair of the view, laid out as in view24_kernel (a warp writes 128
// consecutive bytes). The pair's 4 columns lie in one V:2:M group h of its row: the thread reads that group's two kept
// values (adjacent), their 2-bit codes (one nibble of `sel`) and the row block's 4 column offsets of the group (one
// word of `columns`), all independent loads; m and v are powers of two, so no thread divides.
template <typename Src, typename Dst>
__global__ void __launch_bounds__(kThreads)
    view24_values_kernel(const Src* __restrict__ weight, const uint8_t* __restrict__ sel,
                         const uint32_t* __restrict__ columns, int32_t rows, int32_t groups, int32_t groups4,
                         int32_t log2_m, int32_t log2_v, int32_t sel_row_bytes, int32_t steps4,
                         uint32_t* __restrict__ out) {
  const int32_t p = blockIdx.x * kThreads + threadIdx.x;  // pair within the tile
  if (p >= steps4 * 128) return;
  const int32_t tile = blockIdx.y, step4 = p >> 7, within = p & 127;
  const int32_t g8 = within >> 4, t = (within >> 2) & 3, ch = (within >> 1) & 1, rh = within & 1;
  const int32_t row = 16 * tile + 8 * rh + g8, g4 = 8 * step4 + 4 * ch + t;
  uint32_t pair = 0;
  if (row < rows && g4 < groups4) {
    const int32_t h = (4 * g4) >> log2_m;
    const int64_t at = ((int64_t)row * groups + h) * 2;
    float a = as_float(weight[at]), b = as_float(weight[at + 1]);
    const uint32_t nib = (__ldg(sel + (int64_t)row * sel_row_bytes + (h >> 1)) >> (4 * (h & 1))) & 0xF;
    const uint32_t block = __ldg(columns + (int64_t)(row >> log2_v) * groups + h);
    const int32_t base = h << log2_m;
    int32_t c0 = base + ((block >> (8 * (nib & 3))) & 0xFF), c1 = base + ((block >> (8 * (nib >> 2))) & 0xFF);
    if (c1 < c0) {
      const int32_t c = c0;
      const float v = a;
      c0 = c1, c1 = c, a = b, b = v;
    }
    const bool in0 = (c0 >> 2) == g4, in1 = (c1 >> 2) == g4;
    if (in0 && in1) {
      pair = bits16<Dst>(a) | bits16<Dst>(b) << 16;
    } else if (in0 || in1) {
      const uint32_t v = bits16<Dst>(in0 ? a : b);
      pair = lone_slot((in0 ? c0 : c1) & 3) == 0 ? v : v << 16;
    }
  }
  out[((int64_t)tile * steps4 + step4) * 128 + within] = pair;
}

// transposed_from_values: the transposed 2:4 pack's values (W^T: rows = W's columns, groups = W's rows / 4) made from
// a 2:4 layer's kept values. One block per step of 8 groups (32 rows of W) and 8 tiles (128 columns of W): it first
// stages the rows' kept values in that column range (32 x 64) and their codes (32 x 16 bytes) in shared memory, each
// warp reading consecutive elements of one row, then each thread writes 4 value pairs, laid out as the other packs'
// (a warp writes 128 consecutive bytes). A pair's two slots hold the kept values of its column among its 4 rows, by
// row (a row keeps the column where one of its two codes in that group of 4 columns is the column's offset); 32-bit
// indices, no division.
template <typename Src, typename Dst>
__global__ void __launch_bounds__(kThreads)
    transposed_values_kernel(const Src* __restrict__ weight, const uint8_t* __restrict__ sel, int32_t rows,
                             int32_t cols, int32_t sel_row_bytes, int32_t tiles, int32_t steps,
                             uint32_t* __restrict__ out) {
  __shared__ float kept[32][65];      // [row of the block][kept value of its 128 columns], padded against conflicts
  __shared__ uint8_t codes[32][16];  // [row of the block][byte of codes of its 128 columns]
  const int32_t step = blockIdx.x, src_row = cols / 2;
  const int32_t row0 = 32 * step, c0 = 128 * blockIdx.y, k0 = c0 / 2, b0 = c0 / 8;
  for (int32_t i = threadIdx.x; i < 32 * 64; i += kThreads) {
    const int32_t r = i >> 6, k = i & 63;
    kept[r][k] = row0 + r < rows && k0 + k < src_row ? as_float(weight[(int64_t)(row0 + r) * src_row + k0 + k]) : 0.0f;
  }
  for (int32_t i = threadIdx.x; i < 32 * 16; i += kThreads) {
    const int32_t r = i >> 4, b = i & 15;
    codes[r][b] = row0 + r < rows && b0 + b < sel_row_bytes ? sel[(int64_t)(row0 + r) * sel_row_bytes + b0 + b] : 0;
  }
  __syncthreads();
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int32_t p = j * kThreads + threadIdx.x;
    const int32_t tile = blockIdx.y * 8 + (p >> 7);
    if (tile >= tiles) return;
    const int32_t within = p & 127;
    const int32_t g8 = within >> 4, t = (within >> 2) & 3, ch = (within >> 1) & 1, rh = within & 1;
    const int32_t cl = 16 * (p >> 7) + 8 * rh + g8, gl = 4 * ch + t;  // column and group within the block
    uint32_t pair = 0;
    if (c0 + cl < cols && row0 + 4 * gl < rows) {
      const int32_t want = cl & 3, kk = 2 * (cl >> 2), shift = 4 * ((cl >> 2) & 1);
      float a = 0.0f, b = 0.0f;
      int32_t found = 0, first = 0;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const uint32_t nib = (codes[4 * gl + i][cl >> 3] >> shift) & 0xF;
        const int32_t hit = (int32_t)(nib & 3) == want ? 0 : (int32_t)(nib >> 2) == want ? 1 : -1;
        if (hit < 0) continue;
        const float v = kept[4 * gl + i][kk + hit];
        if (found == 0) {
          a = v, first = i;
        } else if (found == 1) {
          b = v;
        }
        ++found;
      }
      if (found >= 2) {
        pair = bits16<Dst>(a) | bits16<Dst>(b) << 16;
      } else if (found == 1) {
        pair = lone_slot(first) == 0 ? bits16<Dst>(a) : bits16<Dst>(a) << 16;
      }
    }
    out[((int64_t)tile * steps + step) * 128 + within] = pair;
  }
}

// Calls f(Src{}) with the element type of src_dtype (kRefreshF32 / BF16 / F16).
template <typename F>
void with_src_type(int32_t src_dtype, F&& f) {
  switch (src_dtype) {
    case kRefreshF32: f(float{}); break;
    case kRefreshBF16: f(__nv_bfloat16{}); break;
    default: f(__half{}); break;
  }
}

// Calls f(Src{}, Dst{}) with the element types of src_dtype (kRefreshF32 / BF16 / F16) and dst_dtype (kRefreshBF16
// / F16): the one place the packs made from values turn their dtype codes into kernel instantiations.
template <typename F>
void with_pack_types(int32_t src_dtype, int32_t dst_dtype, F&& f) {
  with_src_type(src_dtype, [&](auto src) {
    if (dst_dtype == kRefreshBF16) {
      f(src, __nv_bfloat16{});
    } else {
      f(src, __half{});
    }
  });
}

// The same for gather_kept / scatter_kept, whose dst may also be fp32 (kRefreshF32).
template <typename F>
void with_value_types(int32_t src_dtype, int32_t dst_dtype, F&& f) {
  with_src_type(src_dtype, [&](auto src) {
    switch (dst_dtype) {
      case kRefreshF32: f(src, float{}); break;
      case kRefreshBF16: f(src, __nv_bfloat16{}); break;
      default: f(src, __half{}); break;
    }
  });
}

int32_t log2_exact(int64_t x) {
  int32_t l = 0;
  while (l < 31 && (1LL << l) < x) ++l;
  return (1LL << l) == x ? l : -1;
}

// Blocks of gather_kept_kernel / scatter_kept_kernel for the positions `pos` (one thread per group of a row), or
// cudaErrorInvalidValue where the kernels' 32-bit thread indices or 4-element stores cannot cover them.
cudaError_t group_blocks(const KeptPositions& pos, int64_t* blocks) {
  if (pos.rows * pos.groups >= (1LL << 31) - kThreads || pos.m < 4 || pos.m % 4 != 0 || pos.v <= 0)
    return cudaErrorInvalidValue;
  *blocks = (pos.rows * pos.groups + kThreads - 1) / kThreads;
  return cudaSuccess;
}

}  // namespace

cudaError_t gather_kept(const void* src, int32_t src_dtype, void* dst, int32_t dst_dtype, const KeptPositions& pos,
                        cudaStream_t stream) {
  int64_t blocks = 0;
  if (group_blocks(pos, &blocks) != cudaSuccess) return cudaErrorInvalidValue;
  if (reinterpret_cast<uintptr_t>(dst) % 8 != 0) return cudaErrorMisalignedAddress;  // pairs stored at once
  if (blocks == 0) return cudaSuccess;
  with_value_types(src_dtype, dst_dtype, [&](auto s, auto d) {
    using Src = decltype(s);
    using Dst = decltype(d);
    gather_kept_kernel<Src, Dst><<<(unsigned)blocks, kThreads, 0, stream>>>(static_cast<const Src*>(src),
                                                                          static_cast<Dst*>(dst), pos);
  });
  return cudaGetLastError();
}

cudaError_t scatter_kept(const void* src, int32_t src_dtype, void* dst, int32_t dst_dtype, const KeptPositions& pos,
                         cudaStream_t stream) {
  int64_t blocks = 0;
  if (group_blocks(pos, &blocks) != cudaSuccess) return cudaErrorInvalidValue;
  if (reinterpret_cast<uintptr_t>(dst) % 16 != 0) return cudaErrorMisalignedAddress;  // four elements stored at once
  if (blocks == 0) return cudaSuccess;
  with_value_types(src_dtype, dst_dtype, [&](auto s, auto d) {
    using Src = decltype(s);
    using Dst = decltype(d);
    scatter_kept_kernel<Src, Dst><<<(unsigned)blocks, kThreads, 0, stream>>>(static_cast<const Src*>(src),
                                                                           static_cast<Dst*>(dst), pos);
  });
  return cudaGetLastError();
}

cudaError_t view24_from_pack(const uint16_t* values, const int32_t* meta, const uint8_t* columns, int64_t rows_padded,
                             int64_t rows, int64_t cols, int32_t m, int64_t steps, uint16_t* out_values,
                             int32_t* out_meta, cudaStream_t stream) {
  const int64_t steps4 = (cols / 4 + 7) / 8, tiles = rows_padded / 16;
  const int32_t log2_m = log2_exact(m);
  if (log2_m < 0 || tiles > 65535 || steps4 * 128 >= (1LL << 31)) return cudaErrorInvalidValue;
  if (reinterpret_cast<uintptr_t>(columns) % 4 != 0) return cudaErrorMisalignedAddress;  // read as words
  if (tiles == 0 || steps4 == 0) return cudaSuccess;
  const dim3 grid((unsigned)((steps4 * 128 + kThreads - 1) / kThreads), (unsigned)tiles);
  view24_kernel<<<grid, kThreads, 0, stream>>>(reinterpret_cast<const uint32_t*>(values), meta,
                                               reinterpret_cast<const uint32_t*>(columns), (int32_t)rows,
                                               (int32_t)(cols / 4), log2_m, (int32_t)steps, (int32_t)steps4,
                                               reinterpret_cast<uint32_t*>(out_values), out_meta);
  return cudaGetLastError();
}

cudaError_t view24_from_values(const void* weight, int32_t src_dtype, const KeptPositions& pos, int64_t tiles,
                               int64_t steps4, void* out, int32_t dst_dtype, cudaStream_t stream) {
  const int64_t cols = pos.groups * pos.m, groups4 = cols / 4;
  const int32_t log2_m = log2_exact(pos.m), log2_v = log2_exact(pos.v);
  if (log2_m < 3 || log2_v < 0 || pos.columns == nullptr || dst_dtype == kRefreshF32) return cudaErrorInvalidValue;
  if (tiles > 65535 || tiles * 16 < pos.rows || steps4 * 8 < groups4 || steps4 * 128 >= (1LL << 31) ||
      pos.rows * 2 * pos.groups >= (1LL << 40))
    return cudaErrorInvalidValue;
  if (reinterpret_cast<uintptr_t>(pos.columns) % 4 != 0) return cudaErrorMisalignedAddress;  // read as words
  if (tiles == 0 || steps4 == 0) return cudaSuccess;
  const dim3 grid((unsigned)((steps4 * 128 + kThreads - 1) / kThreads), (unsigned)tiles);
  with_pack_types(src_dtype, dst_dtype, [&](auto src, auto dst) {
    using Src = decltype(src);
    view24_values_kernel<Src, decltype(dst)><<<grid, kThreads, 0, stream>>>(
        static_cast<const Src*>(weight), pos.sel, reinterpret_cast<const uint32_t*>(pos.columns), (int32_t)pos.rows,
        (int32_t)pos.groups, (int32_t)groups4, log2_m, log2_v, (int32_t)pos.sel_row_bytes, (int32_t)steps4,
        static_cast<uint32_t*>(out));
  });
  return cudaGetLastError();
}

cudaError_t transposed_from_values(const void* weight, int32_t src_dtype, const KeptPositions& pos, int64_t tiles,
                                   int64_t steps, void* out, int32_t dst_dtype, cudaStream_t stream) {
  const int64_t cols = pos.groups * 4;
  if (pos.m != 4 || pos.columns != nullptr || pos.rows % 4 != 0 || dst_dtype == kRefreshF32) return cudaErrorInvalidValue;
  if (tiles * 16 < cols || steps * 8 < pos.rows / 4 || (tiles + 7) / 8 > 65535 || steps >= (1LL << 31) ||
      cols >= (1LL << 31))
    return cudaErrorInvalidValue;
  if (tiles == 0 || steps == 0) return cudaSuccess;
  const dim3 grid((unsigned)steps, (unsigned)((tiles + 7) / 8));
  with_pack_types(src_dtype, dst_dtype, [&](auto src, auto dst) {
    using Src = decltype(src);
    transposed_values_kernel<Src, decltype(dst)><<<grid, kThreads, 0, stream>>>(
        static_cast<const Src*>(weight), pos.sel, (int32_t)pos.rows, (int32_t)cols, (int32_t)pos.sel_row_bytes,
        (int32_t)tiles, (int32_t)steps, static_cast<uint32_t*>(out));
  });
  return cudaGetLastError();
}

int64_t refresh_blocks(int64_t numel) { return (numel + kPerBlock - 1) / kPerBlock; }

cudaError_t refresh_packs(const RefreshEntry* table, int count, int64_t blocks, cudaStream_t stream) {
  if (count <= 0 || blocks <= 0) return cudaSuccess;
  if (blocks >= (1LL << 31)) return cudaErrorInvalidValue;
  refresh_many_kernel<<<(unsigned)blocks, kThreads, 0, stream>>>(table, count);
  return cudaGetLastError();
}

cudaError_t refresh_one(const RefreshEntry& entry, cudaStream_t stream) {
  const int64_t blocks = refresh_blocks(entry.numel);
  if (blocks <= 0) return cudaSuccess;
  if (blocks >= (1LL << 31)) return cudaErrorInvalidValue;
  refresh_one_kernel<<<(unsigned)blocks, kThreads, 0, stream>>>(entry);
  return cudaGetLastError();
}

}  // namespace hf_sparse
