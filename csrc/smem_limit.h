// Host side of every kernel launch that needs more than 48 KB of dynamic shared memory: the opt-in to its size.
#pragma once

#include <cuda_runtime.h>

#include <atomic>

namespace hf_sparse {

// cudaFuncSetAttribute(MaxDynamicSharedMemorySize) costs a few microseconds of host time, and the training step and
// few-token inference are host-bound on slow hosts, yet its effect lasts for the function on that device. So it runs
// once per kernel instantiation (Kernel: a distinct template argument per instantiation) and device; a failed call
// is retried next time. Devices past kMaxSmemDevices set it on every call.
constexpr int kMaxSmemDevices = 64;
template <auto Kernel>
cudaError_t raise_smem_limit_once(int smem) {
  static std::atomic<bool> done[kMaxSmemDevices];  // zero-initialised (static storage)
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  const bool cached = dev >= 0 && dev < kMaxSmemDevices;
  if (cached && done[dev].load(std::memory_order_acquire)) return cudaSuccess;
  err = cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err == cudaSuccess && cached) done[dev].store(true, std::memory_order_release);
  return err;
}

}  // namespace hf_sparse
