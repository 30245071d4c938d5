// Host helpers every kernel launcher shares: the group sizes kernels are instantiated for, the opt-in to more than
// 48 KB of dynamic shared memory, the SM count that grid and split choices are made for, and the CTAs per SM a split
// launch keeps resident (which its split-K sum depends on). The last three are CUDA runtime calls of a few
// microseconds of host time whose answer does not change, so each is made once per kernel instantiation or device,
// not on every launch (the training step and few-token inference are host-bound on slow hosts).
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <type_traits>

#include "tile_config.h"

namespace hf_sparse {

// The group sizes M every kernel is instantiated for (4, 8, 16, 32, 64, 128; from Smallest up): f(constant) with
// std::integral_constant<int, m>, so a launcher names its template once, e.g.
//   with_group_size(a.m, [&](auto m) { return launch<T, decltype(m)::value>(a, stream); });
// Any other m: cudaErrorInvalidValue.
template <int Smallest = 4, typename F>
cudaError_t with_group_size(int m, F&& f) {
  switch (m) {
    case 4:
      if constexpr (Smallest <= 4) return f(std::integral_constant<int, 4>{});
      break;
    case 8:
      if constexpr (Smallest <= 8) return f(std::integral_constant<int, 8>{});
      break;
    case 16: return f(std::integral_constant<int, 16>{});
    case 32: return f(std::integral_constant<int, 32>{});
    case 64: return f(std::integral_constant<int, 64>{});
    case 128: return f(std::integral_constant<int, 128>{});
    default: break;
  }
  return cudaErrorInvalidValue;
}

constexpr int kMaxCachedDevices = 64;  // devices past this query on every call

// cudaFuncSetAttribute(MaxDynamicSharedMemorySize) for Kernel (a distinct template argument per instantiation) on the
// current device, once; a failed call is retried next time.
template <auto Kernel>
cudaError_t raise_smem_limit_once(int smem) {
  static std::atomic<bool> done[kMaxCachedDevices];  // zero-initialised (static storage)
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  const bool cached = dev >= 0 && dev < kMaxCachedDevices;
  if (cached && done[dev].load(std::memory_order_acquire)) return cudaSuccess;
  err = cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err == cudaSuccess && cached) done[dev].store(true, std::memory_order_release);
  return err;
}

// A per-device fact, asked of the CUDA runtime once per device: *value = what query(dev, &v) put in v for the current
// device, kept in `memo` (zero-initialised static storage; 0: not asked yet) where the query succeeded with v > 0. An
// error is returned and asked again next time.
template <typename Query>
cudaError_t once_per_device(std::atomic<int> (&memo)[kMaxCachedDevices], int* value, Query query) {
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  const bool cached = dev >= 0 && dev < kMaxCachedDevices;
  const int known = cached ? memo[dev].load(std::memory_order_relaxed) : 0;
  if (known > 0) {
    *value = known;
    return cudaSuccess;
  }
  int v = 0;
  err = query(dev, &v);
  if (err != cudaSuccess) return err;
  if (cached) memo[dev].store(v, std::memory_order_relaxed);
  *value = v;
  return cudaSuccess;
}

// The current device's number of SMs in *sms, queried once per device.
inline cudaError_t current_sm_count(int* sms) {
  static std::atomic<int> counts[kMaxCachedDevices];
  return once_per_device(counts, sms, [](int dev, int* n) {
    return cudaDeviceGetAttribute(n, cudaDevAttrMultiProcessorCount, dev);
  });
}

// Whether a split launch of Kernel (non-persistent CTAs of `threads` threads and `smem` bytes of dynamic shared memory
// each; `grid` = tiles along x and y, splits along z) sums its partial tiles with SplitK's chunked shared sum on the
// current device, in *shared: where its CTAs fit the SMs x ctas_per_sm (the CTAs per SM its plan counts on and its
// launch bounds declare), capped by the CTAs per SM the device keeps resident (asked once per device), so that a
// kernel that keeps fewer resident than planned sums the last-split way rather than waits for a split that cannot
// start (tile_config.h sm90_split_sum_shared). Call after raise_smem_limit_once.
template <auto Kernel>
cudaError_t split_sum_shared(dim3 grid, int threads, int smem, int ctas_per_sm, bool* shared) {
  *shared = false;
  if (grid.z <= 1) return cudaSuccess;
  int sms = 0, resident = 0;
  cudaError_t err = current_sm_count(&sms);
  if (err != cudaSuccess) return err;
  static std::atomic<int> resident_per_device[kMaxCachedDevices];
  err = once_per_device(resident_per_device, &resident, [&](int, int* n) {
    return cudaOccupancyMaxActiveBlocksPerMultiprocessor(n, Kernel, threads, smem);
  });
  if (err != cudaSuccess) return err;
  const int per_sm = ctas_per_sm < resident ? ctas_per_sm : resident;
  *shared = sm90_split_sum_shared((long long)grid.x * grid.y, (int)grid.z, (long long)sms * per_sm);
  return cudaSuccess;
}

#if defined(HF_SPARSE_TIMELINE)
// Timeline builds: rows 0 .. n - 1 of the __device__ array `rows_on_device` (n = min(rows, its rows)) into `host`,
// then every row zeroed, so the next read holds only later calls; n, or -1.
template <typename Row, size_t Rows>
int read_and_clear_rows(void* host, const Row (&rows_on_device)[Rows], int rows) {
  const int n = rows < (int)Rows ? rows : (int)Rows;
  void* dev = nullptr;
  if (cudaMemcpyFromSymbol(host, rows_on_device, sizeof(Row) * n) != cudaSuccess ||
      cudaGetSymbolAddress(&dev, rows_on_device) != cudaSuccess ||
      cudaMemset(dev, 0, sizeof(rows_on_device)) != cudaSuccess)
    return -1;
  return n;
}
#endif

}  // namespace hf_sparse
