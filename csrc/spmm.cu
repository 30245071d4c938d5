// SpMM for V:2:M weights: Y (N x R) = X (N x K) * W^T (+ bias), W in the packed layout of hf_sparse/ops/_layout.py.
//
// mma.sp takes the sparse operand as A, so each warp computes a tile of Y^T = W * X^T: A = 64 weight rows
// (4 m16 tiles, fragments read straight from global memory in fragment order, one 16-byte load per lane),
// B = X^T gathered through the block's column offsets. X arrives as PyTorch stores it (tokens x K, row-major):
// a cp.async pipeline copies dense chunks of BN tokens x 8*M columns into shared memory and each lane builds its
// B fragments from the 4 kept columns of each group (one 32-bit load per register for plain 2:4, two 16-bit
// loads otherwise). The epilogue writes Y[n, r] directly (plus bias), so no transposes or copies surround it.
#include "common.cuh"
#include "kernels.h"
#include "launch.h"
#include "tile_config.h"

namespace hf_sparse {
namespace {

template <typename T, int M>
struct SpmmSmem {
  using Cfg = SpmmTile<M>;
  static constexpr int PITCH = 8 * M + 8;                         // X row pitch, elements (4M+4 words)
  static constexpr int X_BYTES = Cfg::BN * PITCH * (int)sizeof(T);
  static constexpr int A_BYTES = Cfg::WR * 4 * 512;               // 4 m16 tiles per warp row, 512 B each
  static constexpr int E_BYTES = Cfg::WR * 4 * 64;                // metadata: 16 words per m16 tile
  static constexpr int C_BYTES = Cfg::WR * 32;                    // 8 groups x 4 offsets per 64-row slab
  static constexpr int STAGE = X_BYTES + A_BYTES + E_BYTES + C_BYTES;
  static constexpr int TOTAL = Cfg::STAGES * STAGE;
};

template <typename T, int M>
__global__ void __launch_bounds__(32 * SpmmTile<M>::WR * SpmmTile<M>::WN, SpmmTile<M>::MIN_BLOCKS)
spmm_kernel(const T* __restrict__ x, const uint4* __restrict__ values, const uint32_t* __restrict__ meta,
            const uint8_t* __restrict__ columns, const T* __restrict__ bias, T* __restrict__ y, int n_tokens,
            int rows, int rows_padded, int k, int steps) {
  using Cfg = SpmmTile<M>;
  using Sm = SpmmSmem<T, M>;
  constexpr int BN = Cfg::BN, WR = Cfg::WR, WN = Cfg::WN, STAGES = Cfg::STAGES;
  constexpr int THREADS = 32 * WR * WN;
  constexpr int NT = BN / WN / 8;       // n8 tiles per warp
  constexpr int SCOLS = 8 * M;          // real columns per stage
  constexpr int PITCH = Sm::PITCH;
  static_assert(NT >= 1, "BN / WN must be a multiple of 8");

  extern __shared__ __align__(16) unsigned char smem_raw[];

  const int tid = threadIdx.x;
  const int lane = tid & 31, warp = tid >> 5;
  const int wr = warp % WR, wn = warp / WR;
  const int g = lane >> 2, t = lane & 3, h = t & 1;
  // Row blocks vary fastest: the CTAs resident at once share a few token tiles of X (read from L2 once per row
  // block) and walk the whole packed weight, which is the smaller operand and stays in L2.
  const int n_base = blockIdx.y * BN;
  const int cta_row0 = blockIdx.x * (64 * WR);
  const int row0 = cta_row0 + 64 * wr;
  const bool warp_active = row0 < rows_padded;
  const int groups_padded = steps * 8;
  const int mt_cta = cta_row0 >> 4;
  const int slab_cta = cta_row0 >> 6;
  const int mt_valid = (rows_padded - cta_row0) >> 4;  // m16 tiles of this CTA inside the packed weight

  // One pipeline stage: X chunk (BN x 8M), A fragments, metadata and column offsets of k-step s. Every thread's
  // share is fixed across steps (same rows, same 16-byte column slot), so addresses and row guards are computed
  // once here and each step only adds its offset: the main loop stays a few dozen instructions per warp.
  constexpr int X_CHUNKS = BN * M, X_ITERS = X_CHUNKS / THREADS, X_ROW_STEP = THREADS / M;
  static_assert(X_CHUNKS % THREADS == 0 && THREADS % M == 0, "X chunks must split evenly over the threads");
  const int x_r0 = tid / M, x_c = (tid % M) * 8;
  const T* x_src = x + (size_t)(n_base + x_r0) * k + x_c;
  uint32_t x_tok_ok = 0;
#pragma unroll
  for (int it = 0; it < X_ITERS; ++it)
    x_tok_ok |= (uint32_t)(n_base + x_r0 + it * X_ROW_STEP < n_tokens) << it;
  const size_t x_row_step = (size_t)X_ROW_STEP * k;
  const int x_dst = x_r0 * PITCH + x_c;

  constexpr int A_ITERS = (WR * 4 * 32) / THREADS;
  static_assert((WR * 4 * 32) % THREADS == 0, "A chunks must split evenly over the threads");
  const uint4* a_src[A_ITERS];
  bool a_ok[A_ITERS];
#pragma unroll
  for (int it = 0; it < A_ITERS; ++it) {
    const int mt = (tid >> 5) + it * (THREADS / 32);
    a_ok[it] = mt < mt_valid;
    a_src[it] = values + (size_t)(mt_cta + (a_ok[it] ? mt : 0)) * steps * 32 + lane;
  }
  const bool e_thread = tid < WR * 16;
  const int e_mt = tid >> 2, e_q = tid & 3;
  const bool e_ok = e_thread && e_mt < mt_valid;
  const uint32_t* e_src = meta + (size_t)(mt_cta + (e_ok ? e_mt : 0)) * steps * 16 + e_q * 4;
  const int c_i = tid - WR * 16;
  const bool c_thread = M != 4 && c_i >= 0 && c_i < WR * 2;
  const int c_sl = c_i >> 1;
  const bool c_ok = c_thread && c_sl * 4 < mt_valid;
  const uint8_t* c_src = columns + ((size_t)(slab_cta + (c_ok ? c_sl : 0)) * groups_padded) * 4 + (c_i & 1) * 16;

  auto load_stage = [&](int stage, int s) {
    unsigned char* base = smem_raw + stage * Sm::STAGE;
    T* xd = reinterpret_cast<T*>(base) + x_dst;
    const int col = s * SCOLS + x_c;
    const bool col_ok = col < k;
#pragma unroll
    for (int it = 0; it < X_ITERS; ++it) {
      const bool ok = col_ok && ((x_tok_ok >> it) & 1u);
      cp_async_16(xd + it * X_ROW_STEP * PITCH, ok ? x_src + it * x_row_step + s * SCOLS : x, ok);
    }
    unsigned char* ad = base + Sm::X_BYTES;
#pragma unroll
    for (int it = 0; it < A_ITERS; ++it) cp_async_16(ad + (tid + it * THREADS) * 16, a_src[it] + s * 32, a_ok[it]);
    unsigned char* ed = ad + Sm::A_BYTES;
    if (e_thread) cp_async_16(ed + tid * 16, e_src + s * 16, e_ok);
    if constexpr (M != 4) {
      unsigned char* cd = ed + Sm::E_BYTES;
      if (c_thread) cp_async_16(cd + c_i * 16, c_src + s * 32, c_ok);
    }
  };

  float acc[4][NT][4];
#pragma unroll
  for (int a = 0; a < 4; ++a)
#pragma unroll
    for (int b = 0; b < NT; ++b)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[a][b][c] = 0.f;

#pragma unroll
  for (int st = 0; st < STAGES - 1; ++st) {
    if (st < steps) load_stage(st, st);
    cp_async_commit();
  }

  int read_stage = 0, write_stage = STAGES - 1;
  for (int s = 0; s < steps; ++s) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();
    {
      const int nxt = s + STAGES - 1;
      if (nxt < steps) load_stage(write_stage, nxt);
      cp_async_commit();
      write_stage = write_stage == STAGES - 1 ? 0 : write_stage + 1;
    }
    const int cur = read_stage;
    read_stage = read_stage == STAGES - 1 ? 0 : read_stage + 1;
    if (warp_active) {
      const unsigned char* base = smem_raw + cur * Sm::STAGE;
      const T* xs = reinterpret_cast<const T*>(base);
      const uint4* as = reinterpret_cast<const uint4*>(base + Sm::X_BYTES) + wr * 4 * 32 + lane;
      const uint32_t* es = reinterpret_cast<const uint32_t*>(base + Sm::X_BYTES + Sm::A_BYTES) + wr * 4 * 16 + g * 2 + h;
      uint4 a[4];
      uint32_t e[4];
#pragma unroll
      for (int mt = 0; mt < 4; ++mt) {
        a[mt] = as[mt * 32];
        e[mt] = es[mt * 16];
      }
      const T* xw = xs + (wn * (BN / WN)) * PITCH;
      if constexpr (M == 4) {
        // B fragment of one n8 tile = four 8x8 matrices (k = 8q..8q+7) of 8 token rows: one ldmatrix.x4.
        const T* lp = xw + (lane & 7) * PITCH + (lane >> 3) * 8;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          uint32_t b[4];
          ldmatrix_x4(b, lp + nt * 8 * PITCH);
#pragma unroll
          for (int mt = 0; mt < 4; ++mt) mma_sp_16832<T>(acc[mt][nt], a[mt], b, e[mt]);
        }
      } else {
        const uint16_t* cs =
            reinterpret_cast<const uint16_t*>(base + Sm::X_BYTES + Sm::A_BYTES + Sm::E_BYTES) + wr * 16;
        int cidx[4][2];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int gl = (t >> 1) + 2 * i;
          const uint32_t off = cs[gl * 2 + h];  // offsets of positions 2h, 2h+1 of group gl
          cidx[i][0] = gl * M + (int)(off & 0xff);
          cidx[i][1] = gl * M + (int)(off >> 8);
        }
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          const T* xrow = xw + (nt * 8 + g) * PITCH;
          uint32_t b[4];
#pragma unroll
          for (int i = 0; i < 4; ++i) b[i] = MmaType<T>::pack(xrow[cidx[i][0]], xrow[cidx[i][1]]);
#pragma unroll
          for (int mt = 0; mt < 4; ++mt) mma_sp_16832<T>(acc[mt][nt], a[mt], b, e[mt]);
        }
      }
    }
  }
  cp_async_wait<0>();

  if (!warp_active) return;
  // Epilogue: acc[mt][nt] = {(r, n), (r, n+1), (r+8, n), (r+8, n+1)} with r = row0+16mt+g, n = 8nt+2t.
  // Lanes g and g^1 swap halves so each lane holds two adjacent rows of one token: 32-bit stores.
  const bool odd = g & 1;
#pragma unroll
  for (int mt = 0; mt < 4; ++mt) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r_even = row0 + 16 * mt + 8 * half + (g & ~1);
      float b0, b1;
      load_bias_pair(bias, r_even, rows, b0, b1);
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)  // tokens n, n+1 at my row
        store_row_pair(y, acc[mt][nt][2 * half], acc[mt][nt][2 * half + 1], odd,
                       n_base + wn * (BN / WN) + nt * 8 + 2 * t, r_even, b0, b1, rows, n_tokens);
    }
  }
}

template <typename T, int M>
cudaError_t launch(const SpmmArgs& a, cudaStream_t stream) {
  using Cfg = SpmmTile<M>;
  constexpr int THREADS = 32 * Cfg::WR * Cfg::WN;
  constexpr size_t SMEM = SpmmSmem<T, M>::TOTAL;
  constexpr auto kernel = spmm_kernel<T, M>;
  cudaError_t err = raise_smem_limit_once<kernel>((int)SMEM);
  if (err != cudaSuccess) return err;
  dim3 grid((a.rows_padded + 64 * Cfg::WR - 1) / (64 * Cfg::WR), (a.n_tokens + Cfg::BN - 1) / Cfg::BN);
  if (grid.y > 65535) return cudaErrorInvalidConfiguration;  // > 65535 token tiles: the binding splits the call
  kernel<<<grid, THREADS, SMEM, stream>>>(static_cast<const T*>(a.x), static_cast<const uint4*>(a.values),
                                          static_cast<const uint32_t*>(a.meta), a.columns,
                                          static_cast<const T*>(a.bias), static_cast<T*>(a.y), a.n_tokens, a.rows,
                                          a.rows_padded, a.k, a.steps);
  return cudaGetLastError();
}

template <typename T>
cudaError_t dispatch_m(const SpmmArgs& a, cudaStream_t stream) {
  return with_group_size(a.m, [&](auto m) { return launch<T, decltype(m)::value>(a, stream); });
}

}  // namespace

cudaError_t spmm(const SpmmArgs& a, cudaStream_t stream) {
  if (a.n_tokens == 0) return cudaSuccess;
  return a.is_bf16 ? dispatch_m<__nv_bfloat16>(a, stream) : dispatch_m<__half>(a, stream);
}

}  // namespace hf_sparse
