// Ceilings of one Hopper GPU (sm_90a) that bound the sparse-wgmma SpMMs, measured with none of their code paths:
//
//  * mma: how fast dense wgmma (A and B from shared memory, as cuBLAS runs it) and sparse wgmma (A from registers, B
//    from shared memory, as csrc/spmm_sm90.cu runs it) go with nothing else to do: one CTA per SM, two consumer
//    warpgroups on one B tile, as in the SpMMs. A third warpgroup can add shared-memory traffic in step with them
//    (bytes written and read per k-tile of 64), which models what feeds the tensor cores in a real kernel: the TMA
//    writes of X and A, a gather's reads and writes. If the tensor rate falls as that traffic grows, shared memory is
//    the shared resource that bounds the kernel, not the tensor cores.
//  * bulk: how many bytes per second the bulk-copy engine (the path of TMA loads) brings from global memory into
//    shared memory, from a buffer that stays in the L2 and from one that does not (DRAM).
//  * ldg: the same through 16-byte loads into registers (the path of a register gather).
//
// Build and run where the GPU is (no torch needed):
//
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -Icsrc benchmarks/roofline_sm90.cu -o roofline
//   ./roofline > roofline.jsonl
//
// One JSON object per line. What the figures gave and the bounds drawn from them: benchmarks/RESULTS.md ("Ceilings").
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#include "sm90_common.cuh"
#include "tma_sm90.cuh"
#include "wgmma_dense.cuh"
#include "wgmma_sp.cuh"
#endif

namespace {

using T = __nv_bfloat16;
constexpr int kMmaThreads = 384;         // consumer warpgroups 0 and 1, traffic warpgroup 2
constexpr int kTrafficBytes = 64 * 1024;  // the traffic warpgroup's own region (its writes and reads wrap in it)
constexpr int kSparse = 0, kDense = 1;

#define CHECK_CUDA(call)                                                                     \
  do {                                                                                       \
    cudaError_t err_ = (call);                                                               \
    if (err_ != cudaSuccess) {                                                               \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(err_)); \
      std::exit(1);                                                                          \
    }                                                                                        \
  } while (0)

template <int N>
struct MmaSmem {
  static constexpr int B_BYTES = N * 128;          // N tokens x 64 k, bf16, 128-byte swizzle (both kinds)
  static constexpr int A_BYTES = 2 * 64 * 128;     // dense only: one 64-row x 64-k A tile per consumer warpgroup
  static constexpr int BYTES = B_BYTES + A_BYTES + kTrafficBytes + 1024 + 16;  // + alignment slack, pacing word
};

// Every k-tile (64 k) each consumer warpgroup issues the wgmmas of a 64 x N x 64 product: sparse 2 x m64nNk32 (A in
// registers, 2:4 metadata for positions 0 and 1), dense 4 x m64nNk16 (A and B MN-major in shared memory), then waits
// for the previous k-tile's group, as the SpMMs' main loops do. Warp 0 publishes its k-tile count; the traffic
// warpgroup stays within two k-tiles of it, so its bytes land during the wgmmas and not before or after them.
// cycles[2 * cta] = the consumers' clock64 span, cycles[2 * cta + 1] = the traffic warpgroup's.
template <int KIND, int N>
__global__ void __launch_bounds__(kMmaThreads, 1)
mma_ceiling(int k_tiles, int write_bytes, int read_bytes, float* out, long long* cycles) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using S = MmaSmem<N>;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const uint32_t raw_u32 = (uint32_t)__cvta_generic_to_shared(smem_raw);
  const uint32_t pad = hf_sparse::pad_to_1024(raw_u32);
  unsigned char* smem = smem_raw + pad;
  const uint32_t base = raw_u32 + pad;
  const uint32_t traffic = base + S::B_BYTES + S::A_BYTES;
  volatile int* progress = reinterpret_cast<volatile int*>(smem + S::B_BYTES + S::A_BYTES + kTrafficBytes);
  const int tid = threadIdx.x, warp = tid >> 5, wg = warp >> 2;
  // Finite bf16 values in every operand (about 2^-8 .. 2^-7, either sign), so the tensor cores do real work.
  for (int i = tid; i < (S::B_BYTES + S::A_BYTES) / 4; i += kMmaThreads) {
    const uint32_t h = (uint32_t)i * 2654435761u;
    reinterpret_cast<uint32_t*>(smem)[i] = 0x3B803B80u ^ (h & 0x807F807Fu);
  }
  if (tid == 0) *progress = 0;
  hf_sparse::fence_proxy_async();  // generic writes, read by the wgmmas (async proxy)
  __syncthreads();
  const long long t0 = clock64();
  if (wg < 2) {
    float acc[N / 2];
#pragma unroll
    for (int j = 0; j < N / 2; ++j) acc[j] = 0.f;
    if constexpr (KIND == kSparse) {
      const uint32_t h = 0x9E3779B9u * (uint32_t)(tid + 1);
      const uint4 a[2] = {make_uint4(0x3B803B80u ^ (h & 0x807F807Fu), 0x3B803B80u, 0xBB803B80u, 0x3B80BB80u),
                          make_uint4(0x3B80BB80u, 0xBB803B80u ^ (h & 0x007F007Fu), 0x3B803B80u, 0x3B803B80u)};
      const uint32_t e = 0x44444444u;
      const uint64_t desc = hf_sparse::desc_k128(base);
      for (int kt = 0; kt < k_tiles; ++kt) {
        hf_sparse::wgmma_fence();
#pragma unroll
        for (int j = 0; j < 2; ++j) hf_sparse::WgmmaSp<N, T>::run(acc, a[j], desc + j * (64 >> 4), e);
        hf_sparse::wgmma_commit();
        hf_sparse::wgmma_wait<1>();
        if (tid == 0) *progress = kt + 1;
      }
    } else {
      const uint64_t da = hf_sparse::desc_mn128(base + S::B_BYTES + wg * 8192, 8192);
      const uint64_t db = hf_sparse::desc_mn128(base, 8192);
      for (int kt = 0; kt < k_tiles; ++kt) {
        hf_sparse::wgmma_fence();
#pragma unroll
        for (int j = 0; j < 4; ++j) hf_sparse::WgmmaMN<N, T>::run(acc, da + j * (2048 >> 4), db + j * (2048 >> 4));
        hf_sparse::wgmma_commit();
        hf_sparse::wgmma_wait<1>();
        if (tid == 0) *progress = kt + 1;
      }
    }
    hf_sparse::wgmma_wait<0>();
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < N / 2; ++j) s += acc[j];
    out[blockIdx.x * kMmaThreads + tid] = s;
    if (tid == 0) cycles[2 * blockIdx.x] = clock64() - t0;
  } else if (write_bytes > 0 || read_bytes > 0) {
    const int t = tid - 256;
    uint32_t x = 0;
    for (int kt = 0; kt < k_tiles; ++kt) {
      if (t == 0) {
        while (*progress < kt - 2) {
        }
      }
      asm volatile("bar.sync 2, 128;\n" ::: "memory");
      for (int off = 16 * t; off < write_bytes; off += 16 * 128) {
        const uint32_t addr = traffic + (uint32_t)(off & (kTrafficBytes - 1));
        asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(kt), "r"(off), "r"(x), "r"(t)
                     : "memory");
      }
      for (int off = 16 * t; off < read_bytes; off += 16 * 128) {
        const uint32_t addr = traffic + (uint32_t)(off & (kTrafficBytes - 1));
        uint32_t v0, v1, v2, v3;
        asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(v0), "=r"(v1), "=r"(v2), "=r"(v3)
                     : "r"(addr)
                     : "memory");
        x ^= v0 ^ v1 ^ v2 ^ v3;
      }
    }
    out[blockIdx.x * kMmaThreads + tid] = (float)x;
    if (t == 0) cycles[2 * blockIdx.x + 1] = clock64() - t0;
  }
#elif defined(__CUDA_ARCH__)
  __trap();
#endif
}

// One thread per CTA streams CHUNK-byte bulk copies (cp.async.bulk, the engine behind TMA loads) from `src` into a
// STAGES-deep shared-memory ring, each completing on its stage's mbarrier; chunk i of CTA c is chunk (c + i x CTAs)
// mod n_chunks of the buffer. Nothing reads the ring: this is the copy engine's rate alone.
template <int CHUNK, int STAGES>
__global__ void __launch_bounds__(32, 1) bulk_read(const unsigned char* src, int n_chunks, int per_cta) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const uint32_t base = (uint32_t)__cvta_generic_to_shared(smem_raw);
  const uint32_t bars = base + STAGES * CHUNK;
  if (threadIdx.x != 0) return;
  for (int s = 0; s < STAGES; ++s) hf_sparse::mbar_init(bars + 8 * s, 1);
  hf_sparse::mbar_fence_init();
  for (int i = 0; i < per_cta + STAGES; ++i) {
    const int slot = i % STAGES;
    if (i >= STAGES) hf_sparse::mbar_wait(bars + 8 * slot, ((i / STAGES) - 1) & 1);
    if (i >= per_cta) continue;
    const size_t chunk = ((size_t)blockIdx.x + (size_t)i * gridDim.x) % (size_t)n_chunks;
    hf_sparse::mbar_arrive_expect_tx(bars + 8 * slot, CHUNK);
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
            base + slot * CHUNK),
        "l"(src + chunk * CHUNK), "r"(CHUNK), "r"(bars + 8 * slot)
        : "memory");
  }
#elif defined(__CUDA_ARCH__)
  __trap();
#endif
}

// Every thread loads 16-byte words, UNROLL in flight, over `words` words of `src` (grid-strided, wrapping), and
// folds them into one word so the loads are not dead.
template <int UNROLL>
__global__ void __launch_bounds__(512) ldg_read(const uint4* __restrict__ src, long long words, int passes,
                                                uint32_t* out) {
  const long long stride = (long long)gridDim.x * blockDim.x;
  uint32_t x = 0;
  for (int p = 0; p < passes; ++p) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < words; i += stride * UNROLL) {
      uint4 v[UNROLL];
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const long long j = i + u * stride;
        v[u] = j < words ? __ldcg(src + j) : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) x ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
  }
  if (x == 0x12345678u) out[0] = x;  // practically never: keeps the loads live without a store per thread
}

template <typename Launch>
float median_ms(Launch launch, int reps) {
  cudaEvent_t a, b;
  CHECK_CUDA(cudaEventCreate(&a));
  CHECK_CUDA(cudaEventCreate(&b));
  launch();  // warm-up
  CHECK_CUDA(cudaDeviceSynchronize());
  std::vector<float> ms;
  for (int r = 0; r < reps; ++r) {
    CHECK_CUDA(cudaEventRecord(a));
    launch();
    CHECK_CUDA(cudaEventRecord(b));
    CHECK_CUDA(cudaEventSynchronize(b));
    float t = 0.f;
    CHECK_CUDA(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t);
  }
  CHECK_CUDA(cudaGetLastError());
  std::sort(ms.begin(), ms.end());
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return ms[ms.size() / 2];
}

// One mma configuration: TFLOP/s (dense-equivalent: 2 x 64 x N x 64 per warpgroup and k-tile), the consumers' cycles
// per k-tile (slowest CTA), and the shared-memory bytes per cycle: what the wgmmas read plus the traffic warpgroup's.
template <int KIND, int N>
void run_mma(const char* what, int sms, int write_bytes, int read_bytes) {
  using S = MmaSmem<N>;
  const int k_tiles = 20000;
  float* out;
  long long* cycles;
  CHECK_CUDA(cudaMalloc(&out, sizeof(float) * sms * kMmaThreads));
  CHECK_CUDA(cudaMalloc(&cycles, sizeof(long long) * 2 * sms));
  CHECK_CUDA(cudaMemset(cycles, 0, sizeof(long long) * 2 * sms));
  CHECK_CUDA(cudaFuncSetAttribute(mma_ceiling<KIND, N>, cudaFuncAttributeMaxDynamicSharedMemorySize, S::BYTES));
  const float ms = median_ms(
      [&] { mma_ceiling<KIND, N><<<sms, kMmaThreads, S::BYTES>>>(k_tiles, write_bytes, read_bytes, out, cycles); }, 5);
  std::vector<long long> cyc(2 * sms);
  CHECK_CUDA(cudaMemcpy(cyc.data(), cycles, sizeof(long long) * 2 * sms, cudaMemcpyDeviceToHost));
  long long mma_cyc = 0, traffic_cyc = 0;
  for (int c = 0; c < sms; ++c) {
    mma_cyc = std::max(mma_cyc, cyc[2 * c]);
    traffic_cyc = std::max(traffic_cyc, cyc[2 * c + 1]);
  }
  const double flops = 2.0 * 64 * N * 64 * 2 * (double)k_tiles * sms;
  const int wgmma_bytes = KIND == kSparse ? 2 * 2 * N * 64 : 2 * 4 * (N * 32 + 64 * 32);  // per k-tile, both wgs
  const double per_kt = (double)mma_cyc / k_tiles;
  std::printf(
      "{\"what\": \"mma\", \"case\": \"%s\", \"kind\": \"%s\", \"n\": %d, \"write_bytes\": %d, \"read_bytes\": %d, "
      "\"ms\": %.4f, \"tflops\": %.1f, \"cycles_per_k_tile\": %.1f, \"traffic_cycles_per_k_tile\": %.1f, "
      "\"smem_bytes_per_cycle\": %.1f}\n",
      what, KIND == kSparse ? "sparse" : "dense", N, write_bytes, read_bytes, ms, flops / (ms * 1e-3) / 1e12, per_kt,
      (double)traffic_cyc / k_tiles, (wgmma_bytes + write_bytes + read_bytes) / per_kt);
  cudaFree(out);
  cudaFree(cycles);
}

template <int CHUNK, int STAGES>
void run_bulk(const char* what, const unsigned char* buf, size_t bytes, int sms, int ctas_per_sm) {
  const int n_chunks = (int)(bytes / CHUNK), ctas = sms * ctas_per_sm;
  const size_t passes = bytes < ((size_t)1 << 30) ? 200 : 4;  // a few ms either way
  const int per_cta = (int)(passes * bytes / ((size_t)ctas * CHUNK));
  const int smem = STAGES * CHUNK + 8 * STAGES;
  CHECK_CUDA(cudaFuncSetAttribute(bulk_read<CHUNK, STAGES>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const float ms = median_ms([&] { bulk_read<CHUNK, STAGES><<<ctas, 32, smem>>>(buf, n_chunks, per_cta); }, 5);
  const double moved = (double)ctas * per_cta * CHUNK;
  std::printf(
      "{\"what\": \"bulk\", \"case\": \"%s\", \"buffer_mb\": %.0f, \"chunk\": %d, \"stages\": %d, \"ctas_per_sm\": %d, "
      "\"ms\": %.4f, \"tb_per_s\": %.2f}\n",
      what, bytes / 1048576.0, CHUNK, STAGES, ctas_per_sm, ms, moved / (ms * 1e-3) / 1e12);
}

void run_ldg(const char* what, const unsigned char* buf, size_t bytes, int sms, uint32_t* sink) {
  const long long words = (long long)(bytes / 16);
  const int passes = bytes < ((size_t)1 << 30) ? 200 : 4;
  const float ms = median_ms(
      [&] { ldg_read<8><<<sms * 4, 512>>>(reinterpret_cast<const uint4*>(buf), words, passes, sink); }, 5);
  std::printf("{\"what\": \"ldg\", \"case\": \"%s\", \"buffer_mb\": %.0f, \"ms\": %.4f, \"tb_per_s\": %.2f}\n", what,
              bytes / 1048576.0, ms, (double)bytes * passes / (ms * 1e-3) / 1e12);
}

}  // namespace

int main() {
  int dev = 0, sms = 0, clock_khz = 0;
  CHECK_CUDA(cudaGetDevice(&dev));
  CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  CHECK_CUDA(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, dev));
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, dev));
  std::printf("{\"what\": \"device\", \"name\": \"%s\", \"sms\": %d, \"max_clock_mhz\": %d, \"l2_mb\": %.0f}\n",
              prop.name, sms, clock_khz / 1000, prop.l2CacheSize / 1048576.0);
  std::fflush(stdout);

  // Tensor cores alone, then with the shared-memory traffic of each way of feeding them, per k-tile of 64 (k of the
  // wgmmas: condensed columns for V:2:M), 128 weight rows x N tokens:
  run_mma<kDense, 256>("dense wgmma, A and B from shared memory", sms, 0, 0);
  run_mma<kDense, 128>("dense wgmma, A and B from shared memory", sms, 0, 0);
  run_mma<kSparse, 256>("sparse wgmma alone", sms, 0, 0);
  run_mma<kSparse, 128>("sparse wgmma alone", sms, 0, 0);
  // 2:4 SpMM (TMA): X tile N x 128 B + A 8 KB + metadata 1 KB written by TMA; the consumers read A and metadata.
  run_mma<kSparse, 256>("2:4 by TMA: X, A, metadata written; A read", sms, 256 * 128 + 9216, 9216);
  run_mma<kSparse, 128>("2:4 by TMA: X, A, metadata written; A read", sms, 128 * 128 + 9216, 9216);
  // V:2:8 with X gathered in registers from global memory: the gathered tile written, A and metadata as above.
  run_mma<kSparse, 128>("V:2:8 register gather: gathered X, A, metadata written; A read", sms, 128 * 128 + 9216, 9216);
  // V:2:8 with X by TMA and a shared-memory compaction: the raw X tile (2 x the gathered one) written and read, the
  // gathered tile written, A and metadata as above.
  run_mma<kSparse, 128>("V:2:8 TMA + shared compaction", sms, 128 * 256 + 128 * 128 + 9216, 128 * 256 + 9216);
  run_mma<kSparse, 256>("V:2:8 TMA + shared compaction", sms, 256 * 256 + 256 * 128 + 9216, 256 * 256 + 9216);
  // V:2:16: the raw X is 4 x the gathered tile.
  run_mma<kSparse, 128>("V:2:16 TMA + shared compaction", sms, 128 * 512 + 128 * 128 + 9216, 128 * 512 + 9216);
  // Traffic alone, no wgmma weight: how far the shared-memory port goes (a sweep of written bytes per k-tile).
  for (int w : {16384, 32768, 65536}) run_mma<kSparse, 128>("sparse wgmma + writes only", sms, w, 0);
  std::fflush(stdout);

  // Global memory -> shared memory (bulk copies) and -> registers, from a buffer the L2 holds and from DRAM.
  const size_t l2_bytes = (size_t)16 << 20, dram_bytes = (size_t)2 << 30;
  unsigned char *l2_buf, *dram_buf;
  uint32_t* sink;
  CHECK_CUDA(cudaMalloc(&l2_buf, l2_bytes));
  CHECK_CUDA(cudaMalloc(&dram_buf, dram_bytes));
  CHECK_CUDA(cudaMalloc(&sink, 16));
  CHECK_CUDA(cudaMemset(l2_buf, 1, l2_bytes));
  CHECK_CUDA(cudaMemset(dram_buf, 1, dram_bytes));
  run_bulk<8192, 16>("bulk copy, L2-resident", l2_buf, l2_bytes, sms, 1);
  run_bulk<16384, 8>("bulk copy, L2-resident", l2_buf, l2_bytes, sms, 1);
  run_bulk<8192, 8>("bulk copy, L2-resident", l2_buf, l2_bytes, sms, 2);
  run_bulk<16384, 8>("bulk copy, DRAM", dram_buf, dram_bytes, sms, 1);
  run_ldg("16-byte loads, L2-resident", l2_buf, l2_bytes, sms, sink);
  run_ldg("16-byte loads, DRAM", dram_buf, dram_bytes, sms, sink);
  CHECK_CUDA(cudaDeviceSynchronize());
  cudaFree(l2_buf);
  cudaFree(dram_buf);
  cudaFree(sink);
  return 0;
}
