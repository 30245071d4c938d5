// Thin torch binding of the hf_sparse kernels: validates tensors (one check function per op, messages name the
// op and the argument), allocates outputs through the caching allocator and launches on the current stream.
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>
#include <torch/library.h>

#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include "check.h"
#include "kernels.h"
#include "tile_config.h"
#if defined(HF_SPARSE_LAB)
#include <string>

#include "lab.h"
#endif

namespace {

#if defined(HF_SPARSE_LAB)
// The lab build's tuning knobs (csrc/lab.h), by name: sets one, returns its previous value.
int64_t lab_set(const std::string& name, int64_t value) {
  auto& t = hf_sparse::lab::tuning();
  std::atomic<int>* knob = name == "sm90_config"         ? &t.sm90_config
                           : name == "vnm_pipe"          ? &t.vnm_pipe
                           : name == "vnm_tile"          ? &t.vnm_tile
                           : name == "vnm_xt"            ? &t.vnm_xt
                           : name == "sddmm_gather_regs" ? &t.sddmm_gather_regs
                           : name == "split_k"           ? &t.split_k
                           : name == "small_tiles"       ? &t.small_tiles
                                                         : nullptr;
  HF_CHECK(knob != nullptr, "hf_sparse.lab_set: no knob ", name,
              "; use sm90_config, vnm_pipe, vnm_tile, vnm_xt, sddmm_gather_regs, split_k or small_tiles");
  HF_CHECK(name != "sm90_config" || (value >= -1 && value < hf_sparse::lab::kSm90Configs),
              "hf_sparse.lab_set: sm90_config=", value, " is not -1 (the product's choice) or 0..",
              hf_sparse::lab::kSm90Configs - 1);
  HF_CHECK(name != "vnm_pipe" || (value >= 0 && value < hf_sparse::lab::kVnmPipes), "hf_sparse.lab_set: vnm_pipe=",
              value, " is not 0 (the product's register pipeline) or 1..", hf_sparse::lab::kVnmPipes - 1,
              " (csrc/lab.h)");
  HF_CHECK(name != "vnm_xt" || (value >= -1 && value <= 1), "hf_sparse.lab_set: vnm_xt=", value,
              " is not -1 (the product's rule), 0 (never) or 1 (always)");
  return knob->exchange((int)value);
}
#endif

void check_cuda(cudaError_t err, const char* op) {
  HF_CHECK(err == cudaSuccess, "hf_sparse.", op, ": CUDA error: ", cudaGetErrorString(err));
}

void check_tensor(const at::Tensor& t, const char* op, const char* name, at::ScalarType dtype, int64_t dim) {
  HF_CHECK(t.is_cuda(), "hf_sparse.", op, ": ", name, " must be a CUDA tensor, got device ", t.device());
  HF_CHECK(t.scalar_type() == dtype, "hf_sparse.", op, ": ", name, " must be ", dtype, ", got ", t.scalar_type());
  HF_CHECK(t.dim() == dim, "hf_sparse.", op, ": ", name, " must have ", dim, " dims, got ", t.dim());
  HF_CHECK(t.is_contiguous(), "hf_sparse.", op, ": ", name, " must be contiguous");
}

// m (the V:2:M group size) is one the kernels have a layout for.
void check_group_size(const char* op, int64_t m) {
  HF_CHECK(m == 4 || m == 8 || m == 16 || m == 32 || m == 64 || m == 128, "hf_sparse.", op, ": m=", m,
              " unsupported; use 4, 8, 16, 32, 64 or 128");
}

void check_packed(const char* op, const at::Tensor& values, const at::Tensor& meta, const at::Tensor& columns,
                  int64_t rows, int64_t k, int64_t m, at::ScalarType dtype) {
  check_tensor(values, op, "packed.values", dtype, 4);
  check_tensor(meta, op, "packed.meta", at::kInt, 3);
  check_tensor(columns, op, "packed.columns", at::kByte, 3);
  check_group_size(op, m);
  HF_CHECK(k % m == 0, "hf_sparse.", op, ": in_features=", k, " is not a multiple of m=", m);
  const int64_t steps = (k / m + 7) / 8, rp = (rows + 63) / 64 * 64;
  HF_CHECK(values.size(0) == rp / 16 && values.size(1) == steps && values.size(2) == 32 && values.size(3) == 8,
              "hf_sparse.", op, ": packed.values has shape ", values.sizes(), ", expected (", rp / 16, ", ", steps,
              ", 32, 8) for a ", rows, "x", k, " weight; rebuild it with hf_sparse.ops.pack");
  HF_CHECK(meta.size(0) == rp / 16 && meta.size(1) == steps && meta.size(2) == 16, "hf_sparse.", op,
              ": packed.meta has shape ", meta.sizes(), ", expected (", rp / 16, ", ", steps, ", 16)");
  HF_CHECK(columns.size(0) == rp / 64 && columns.size(1) == steps * 8 && columns.size(2) == 4, "hf_sparse.", op,
              ": packed.columns has shape ", columns.sizes(), ", expected (", rp / 64, ", ", steps * 8, ", 4)");
}

void check_activation(const char* op, const char* name, const at::Tensor& t, int64_t features, at::ScalarType dtype) {
  check_tensor(t, op, name, dtype, 2);
  HF_CHECK(t.size(1) == features, "hf_sparse.", op, ": ", name, " has ", t.size(1), " features, expected ",
              features);
  HF_CHECK(features % 8 == 0, "hf_sparse.", op, ": ", name, " feature size ", features,
              " must be a multiple of 8 for the CUDA kernel (16-byte rows); pad the layer or use the dense path");
  HF_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, "hf_sparse.", op, ": ", name,
              " must be 16-byte aligned; pass a fresh contiguous tensor");
}

// The split-K arrival counters of the sparse-wgmma SpMMs (kernels.h SpmmArgs::split_counters): one zeroed set per
// device and stream, made on first use and kept for the process (every launch leaves it zero). Never freed: the map is
// leaked so no tensor outlives the CUDA context at exit.
// Null while the stream captures a CUDA graph and has no set yet: zeros made there would be zeroed only when the graph
// replays, and the kernel then does not split.
int* split_counters(const at::Device& device, cudaStream_t stream) {
  static std::mutex mutex;
  static auto* sets = new std::map<std::pair<int, cudaStream_t>, at::Tensor>();
  std::lock_guard<std::mutex> lock(mutex);
  const auto key = std::make_pair((int)device.index(), stream);
  const auto found = sets->find(key);
  if (found != sets->end()) return found->second.data_ptr<int>();
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &capture) != cudaSuccess || capture != cudaStreamCaptureStatusNone) return nullptr;
  auto t = at::zeros({hf_sparse::kSplitKCounters}, at::TensorOptions().dtype(at::kInt).device(device));
  return sets->emplace(key, t).first->second.data_ptr<int>();
}

at::Tensor spmm_impl(const char* op, bool wgmma, const at::Tensor& x, const at::Tensor& values,
                     const at::Tensor& meta, const at::Tensor& columns, const c10::optional<at::Tensor>& bias,
                     int64_t rows, int64_t k, int64_t v, int64_t m, int64_t act) {
  HF_CHECK(m == 4 || v == 64 || v == 128, "hf_sparse.", op, ": v=", v,
           " is not a V:2:M block height; pass the packed weight's v (64 or 128)");
  HF_CHECK(act == 0 || (act == 1 && wgmma && m == 4), "hf_sparse.", op,
              ": a fused activation (act=", act, ") is only in the 2:4 sparse-wgmma kernel; apply it after the call");
  const auto dtype = x.scalar_type();
  HF_CHECK(dtype == at::kBFloat16 || dtype == at::kHalf, "hf_sparse.", op,
              ": x must be bfloat16 or float16, got ", dtype);
  check_activation(op, "x", x, k, dtype);
  check_packed(op, values, meta, columns, rows, k, m, dtype);
  if (wgmma) {
    HF_CHECK(hf_sparse::spmm_sm90_available(), "hf_sparse.", op,
                ": the sparse-wgmma kernel needs a cc 9.0 GPU and an extension built with sm_90a "
                "(HF_SPARSE_CUDA_ARCH_LIST containing 9.0); use hf_sparse.ops.force_kernel(spmm=\"auto\") or "
                "\"mma_sp\"");
  }
  if (bias.has_value()) {
    check_tensor(*bias, op, "bias", dtype, 1);
    HF_CHECK(bias->size(0) == rows, "hf_sparse.spmm: bias has ", bias->size(0), " entries, expected ", rows);
  }
  c10::cuda::CUDAGuard guard(x.device());
  auto y = at::empty({x.size(0), rows}, x.options());
  // The kernel's grid holds at most 65535 token tiles of >= 16 tokens: larger inputs go in slices of 2^19 tokens.
  constexpr int64_t kSlice = 1LL << 19;
  if (x.size(0) > kSlice) {
    for (int64_t start = 0; start < x.size(0); start += kSlice) {
      const int64_t len = std::min(kSlice, x.size(0) - start);
      y.narrow(0, start, len)
          .copy_(spmm_impl(op, wgmma, x.narrow(0, start, len), values, meta, columns, bias, rows, k, v, m, act));
    }
    return y;
  }
  hf_sparse::SpmmArgs a;
  a.x = x.data_ptr();
  a.values = values.data_ptr();
  a.meta = meta.data_ptr();
  a.columns = columns.data_ptr<uint8_t>();
  a.bias = bias.has_value() ? bias->data_ptr() : nullptr;
  a.y = y.data_ptr();
  a.n_tokens = (int)x.size(0);
  a.rows = (int)rows;
  a.rows_padded = (int)values.size(0) * 16;
  a.k = (int)k;
  a.m = (int)m;
  a.v = m == 4 ? 64 : (int)v;
  a.steps = (int)values.size(1);
  a.is_bf16 = dtype == at::kBFloat16;
  a.act = (int)act;
  const auto stream = c10::cuda::getCurrentCUDAStream().stream();
  if (!wgmma) {
    check_cuda(hf_sparse::spmm(a, stream), op);
    return y;
  }
  hf_sparse::SpmmPlan plan;  // made once: it sizes the scratch below and the launch runs it
  check_cuda(m == 4 ? hf_sparse::spmm_sm90_plan(a, &plan) : hf_sparse::spmm_vnm_sm90_plan(a, &plan), op);
  at::Tensor split_ws;  // split-K partial sums, alive until the launch is queued (the allocator orders reuse by stream)
  const int64_t floats = plan.split_floats();
  a.split_counters = floats > 0 ? split_counters(x.device(), stream) : nullptr;
  if (a.split_counters != nullptr) {
    split_ws = at::empty({floats}, x.options().dtype(at::kFloat));
    a.split_ws = split_ws.data_ptr<float>();
  }
  at::Tensor xt;  // X^T for the V:2:M kernel's X^T path, alive until the launches are queued
  if (plan.xt) {
    xt = at::empty({plan.xt_elems}, x.options());
    a.xt = xt.data_ptr();
  }
  // plain 2:4 on spmm_sm90, V:2:M (m >= 8) on spmm_vnm_sm90 (the same packed layout over the kept columns)
  check_cuda(m == 4 ? hf_sparse::spmm_sm90(a, plan, stream) : hf_sparse::spmm_vnm_sm90(a, plan, stream), op);
  return y;
}

// v: the packed weight's V (ignored at m = 4); act: the epilogue activation (0 none, 1 exact GELU); only the 2:4
// sparse-wgmma kernel has one, the others need 0.
at::Tensor spmm(const at::Tensor& x, const at::Tensor& values, const at::Tensor& meta, const at::Tensor& columns,
                const c10::optional<at::Tensor>& bias, int64_t rows, int64_t k, int64_t v, int64_t m, int64_t act) {
  return spmm_impl("spmm", false, x, values, meta, columns, bias, rows, k, v, m, act);
}

at::Tensor spmm_wgmma(const at::Tensor& x, const at::Tensor& values, const at::Tensor& meta,
                      const at::Tensor& columns, const c10::optional<at::Tensor>& bias, int64_t rows, int64_t k,
                      int64_t v, int64_t m, int64_t act) {
  return spmm_impl("spmm(wgmma)", true, x, values, meta, columns, bias, rows, k, v, m, act);
}

bool spmm_wgmma_available() { return hf_sparse::spmm_sm90_available(); }

#if defined(HF_SPARSE_TIMELINE)
// The rows `read` copies out of the device, as (rows copied, columns) int64 (at most ctas rows); `op` names the
// binding in the error.
at::Tensor timeline_rows(const char* op, int64_t ctas, int columns, int (*read)(unsigned long long*, int)) {
  at::Tensor out = at::empty({ctas, columns}, at::kLong);
  const int n = read(reinterpret_cast<unsigned long long*>(out.data_ptr<int64_t>()), static_cast<int>(ctas));
  HF_CHECK(n >= 0, op, ": reading the timeline failed");
  return out.narrow(0, 0, n);
}
// Timeline build only (benchmarks/timeline_spmm.py): the 2:4 sparse-wgmma calls' stamps since the last read, (ctas,
// marks) int64, then cleared.
at::Tensor spmm_timeline(int64_t ctas) {
  return timeline_rows("hf_sparse.spmm_timeline", ctas, hf_sparse::spmm_sm90_timeline_marks(),
                       hf_sparse::spmm_sm90_timeline);
}
// Timeline build only (benchmarks/timeline_xt.py): the V:2:M X^T path's per-CTA cycle counters, (ctas, counters)
// int64, each row the last call that ran that CTA, then cleared.
at::Tensor spmm_xt_timeline(int64_t ctas) {
  return timeline_rows("hf_sparse.spmm_xt_timeline", ctas, hf_sparse::spmm_vnm_xt_sm90_timeline_counters(),
                       hf_sparse::spmm_vnm_xt_sm90_timeline);
}
#endif

at::Tensor sddmm_impl(const char* op, bool wgmma, const at::Tensor& dy, const at::Tensor& x, const at::Tensor& meta,
                      const at::Tensor& columns, int64_t rows, int64_t k, int64_t m) {
  const auto dtype = x.scalar_type();
  HF_CHECK(dtype == at::kBFloat16 || dtype == at::kHalf, "hf_sparse.", op, ": x must be bfloat16 or float16, got ",
              dtype);
  check_activation(op, "x", x, k, dtype);
  check_activation(op, "dy", dy, rows, dtype);
  HF_CHECK(dy.size(0) == x.size(0), "hf_sparse.", op, ": dy has ", dy.size(0), " tokens but x has ", x.size(0));
  check_tensor(meta, op, "packed.meta", at::kInt, 3);
  check_tensor(columns, op, "packed.columns", at::kByte, 3);
  check_group_size(op, m);
  const int64_t steps = (k / m + 7) / 8, rp = (rows + 63) / 64 * 64;
  HF_CHECK(k % m == 0 && meta.size(0) == rp / 16 && meta.size(1) == steps && columns.size(0) == rp / 64 &&
                  columns.size(1) == steps * 8,
              "hf_sparse.", op, ": packed tensors do not match a ", rows, "x", k, " weight with m=", m);
  if (wgmma) {
    HF_CHECK(hf_sparse::spmm_sm90_available(), "hf_sparse.", op,
                ": the wgmma kernel needs a cc 9.0 GPU and an extension built with sm_90a "
                "(HF_SPARSE_CUDA_ARCH_LIST containing 9.0); use hf_sparse.ops.force_kernel(sddmm=\"auto\") or "
                "\"mma\"");
  }
  c10::cuda::CUDAGuard guard(x.device());
  // the wgmma kernel writes every slot (or zeroes the output itself); the mma.sync kernel accumulates atomically
  auto opts = x.options().dtype(at::kFloat);
  auto out = wgmma ? at::empty({rows, 2 * (k / m)}, opts) : at::zeros({rows, 2 * (k / m)}, opts);
  hf_sparse::SddmmArgs a;
  a.dy = dy.data_ptr();
  a.x = x.data_ptr();
  a.meta = meta.data_ptr();
  a.columns = columns.data_ptr<uint8_t>();
  a.out = out.data_ptr<float>();
  a.n_tokens = (int)x.size(0);
  a.rows = (int)rows;
  a.rows_padded = (int)rp;
  a.k = (int)k;
  a.m = (int)m;
  a.steps = (int)steps;
  a.is_bf16 = dtype == at::kBFloat16;
  const auto stream = c10::cuda::getCurrentCUDAStream().stream();
  check_cuda(wgmma ? hf_sparse::sddmm_sm90(a, stream) : hf_sparse::sddmm(a, stream), op);
  return out;
}

at::Tensor sddmm(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& meta, const at::Tensor& columns,
                 int64_t rows, int64_t k, int64_t m) {
  return sddmm_impl("sddmm", false, dy, x, meta, columns, rows, k, m);
}

at::Tensor sddmm_wgmma(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& meta, const at::Tensor& columns,
                       int64_t rows, int64_t k, int64_t m) {
  return sddmm_impl("sddmm(wgmma)", true, dy, x, meta, columns, rows, k, m);
}

std::vector<at::Tensor> pack(const at::Tensor& weight, const at::Tensor& mask, int64_t v, int64_t m,
                             bool out_bf16) {
  const at::ScalarType out_dtype = out_bf16 ? at::kBFloat16 : at::kHalf;
  const char* op = "pack";
  const auto wd = weight.scalar_type();
  HF_CHECK(wd == at::kFloat || wd == at::kBFloat16 || wd == at::kHalf,
              "hf_sparse.pack: weight must be float32, bfloat16 or float16, got ", wd);
  check_tensor(weight, op, "weight", wd, 2);
  check_tensor(mask, op, "mask", at::kBool, 2);
  HF_CHECK(mask.sizes() == weight.sizes(), "hf_sparse.pack: mask shape ", mask.sizes(), " != weight shape ",
              weight.sizes());
  const int64_t rows = weight.size(0), k = weight.size(1);
  check_group_size(op, m);
  HF_CHECK(k % m == 0, "hf_sparse.pack: in_features=", k, " is not a multiple of m=", m);
  HF_CHECK(m == 4 || ((v == 64 || v == 128) && rows % v == 0), "hf_sparse.pack: v=", v,
              " must be 64 or 128 and divide out_features=", rows);
  c10::cuda::CUDAGuard guard(weight.device());
  const int64_t steps = (k / m + 7) / 8, rp = (rows + 63) / 64 * 64;
  auto opts = weight.options();
  auto values = at::empty({rp / 16, steps, 32, 8}, opts.dtype(out_dtype));
  auto meta = at::empty({rp / 16, steps, 16}, opts.dtype(at::kInt));
  auto columns = at::empty({rp / 64, steps * 8, 4}, opts.dtype(at::kByte));
  auto valid = at::empty({rows, 2 * (k / m)}, opts.dtype(at::kBool));
  auto error = at::zeros({1}, opts.dtype(at::kInt));
  const int64_t vv = m == 4 ? 64 : v;
  auto scratch = at::empty({m == 4 ? 1 : (rows / vv) * (k / m) * ((m + 31) / 32)}, opts.dtype(at::kInt));
  hf_sparse::PackArgs a;
  a.weight = weight.data_ptr();
  a.weight_dtype = wd == at::kFloat ? 0 : (wd == at::kBFloat16 ? 1 : 2);
  a.mask = mask.data_ptr<bool>();
  a.values = values.data_ptr();
  a.meta = reinterpret_cast<uint32_t*>(meta.data_ptr<int>());
  a.columns = columns.data_ptr<uint8_t>();
  a.valid = valid.data_ptr<bool>();
  a.error = error.data_ptr<int>();
  a.scratch = reinterpret_cast<uint32_t*>(scratch.data_ptr<int>());
  a.rows = (int)rows;
  a.rows_padded = (int)rp;
  a.k = (int)k;
  a.v = (int)(m == 4 ? 64 : v);
  a.m = (int)m;
  a.steps = (int)steps;
  a.out_bf16 = out_bf16;
  check_cuda(hf_sparse::pack(a, c10::cuda::getCurrentCUDAStream().stream()), op);
  return {values, meta, columns, valid, error};
}

// Zero, in place, every entry of tensors[i] where masks[i] is false: one launch per element size and per
// kMaxMaskTensors tensors. Every tensor: CUDA, contiguous, fp32 / bf16 / fp16, on the device of the first; every mask:
// bool, contiguous, same number of elements and device as its tensor.
void apply_masks_(const std::vector<at::Tensor>& tensors, const std::vector<at::Tensor>& masks) {
  const char* op = "apply_masks_";
  HF_CHECK(tensors.size() == masks.size(), "hf_sparse.", op, ": ", tensors.size(), " tensors but ", masks.size(),
              " masks");
  if (tensors.empty()) return;
  const auto device = tensors[0].device();
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& t = tensors[i];
    const auto& m = masks[i];
    HF_CHECK(t.is_cuda() && t.device() == device && t.is_contiguous(), "hf_sparse.", op, ": tensor ", i,
                " must be a contiguous CUDA tensor on ", device);
    HF_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf,
                "hf_sparse.", op, ": tensor ", i, " is ", t.scalar_type(), "; use float32, bfloat16 or float16");
    HF_CHECK(m.scalar_type() == at::kBool && m.device() == device && m.is_contiguous() && m.numel() == t.numel(),
                "hf_sparse.", op, ": mask ", i, " must be a contiguous bool tensor of ", t.numel(),
                " elements on ", device);
  }
  c10::cuda::CUDAGuard guard(device);
  const auto stream = c10::cuda::getCurrentCUDAStream().stream();
  const int64_t chunk = hf_sparse::apply_masks_chunk();
  for (const int size : {4, 2}) {
    hf_sparse::MaskBatch b{};
    auto flush = [&]() {
      check_cuda(hf_sparse::apply_masks(b, stream), op);
      b = hf_sparse::MaskBatch{};
    };
    for (size_t i = 0; i < tensors.size(); ++i) {
      const auto& t = tensors[i];
      if (t.element_size() != size || t.numel() == 0) continue;
      const int64_t blocks = (t.numel() + chunk - 1) / chunk;
      HF_CHECK(blocks < (1 << 30), "hf_sparse.", op, ": tensor ", i, " is too large");
      if (b.count == hf_sparse::kMaxMaskTensors || (int64_t)b.blocks + blocks >= (1 << 30)) flush();
      const auto data = reinterpret_cast<uintptr_t>(t.data_ptr());
      const auto mask = reinterpret_cast<uintptr_t>(masks[i].data_ptr());
      b.data[b.count] = t.data_ptr();
      b.mask[b.count] = reinterpret_cast<const uint8_t*>(masks[i].data_ptr());
      b.numel[b.count] = t.numel();
      b.first_block[b.count] = b.blocks;
      b.aligned[b.count] = data % 16 == 0 && mask % (16 / size) == 0;
      b.blocks += (int)blocks;
      b.elem_size = size;
      ++b.count;
    }
    if (b.count > 0) flush();
  }
}

void check_score(const char* op, const at::Tensor& score) {
  HF_CHECK(score.is_cuda() && score.scalar_type() == at::kFloat && score.dim() == 2 && score.is_contiguous(),
              "hf_sparse.", op, ": score must be a contiguous 2-D float32 CUDA tensor");
  HF_CHECK(score.size(0) < (1LL << 31) && score.size(1) < (1LL << 31), "hf_sparse.", op, ": score is too large");
}

at::Tensor nm_mask(const at::Tensor& score, int64_t n, int64_t m) {
  check_score("nm_mask", score);
  HF_CHECK(m > 0 && score.size(1) % m == 0, "hf_sparse.nm_mask: in_features=", score.size(1),
              " is not a multiple of m=", m);
  c10::cuda::CUDAGuard guard(score.device());
  auto out = at::empty(score.sizes(), score.options().dtype(at::kBool));
  check_cuda(hf_sparse::nm_mask(score.data_ptr<float>(), out.data_ptr<bool>(), (int)score.size(0),
                                (int)score.size(1), (int)n, (int)m, c10::cuda::getCurrentCUDAStream().stream()),
             "nm_mask");
  return out;
}

at::Tensor vnm_mask(const at::Tensor& score, int64_t v, int64_t n, int64_t m, int64_t keep_cols) {
  check_score("vnm_mask", score);
  const int64_t rows = score.size(0), cols = score.size(1);
  HF_CHECK(v > 0 && m > 0 && rows % v == 0 && cols % m == 0, "hf_sparse.vnm_mask: shape (", rows, ", ", cols,
              ") needs rows % ", v, " == 0 and cols % ", m, " == 0");
  c10::cuda::CUDAGuard guard(score.device());
  auto out = at::empty(score.sizes(), score.options().dtype(at::kBool));
  auto sums = at::empty({rows / v, cols}, score.options().dtype(at::kDouble));
  auto bits = at::empty({rows / v, cols / m, (m + 31) / 32}, score.options().dtype(at::kInt));
  check_cuda(hf_sparse::vnm_mask(score.data_ptr<float>(), sums.data_ptr<double>(),
                                 reinterpret_cast<uint32_t*>(bits.data_ptr<int>()), out.data_ptr<bool>(), (int)rows,
                                 (int)cols, (int)v, (int)n, (int)m, (int)keep_cols,
                                 c10::cuda::getCurrentCUDAStream().stream()),
             "vnm_mask");
  return out;
}

at::Tensor transposable_2to4_mask(const at::Tensor& score, const at::Tensor& patterns) {
  check_score("transposable_2to4_mask", score);
  HF_CHECK(score.size(0) % 4 == 0 && score.size(1) % 4 == 0, "hf_sparse.transposable_2to4_mask: shape (",
              score.size(0), ", ", score.size(1), ") needs both dimensions divisible by 4");
  HF_CHECK(patterns.is_cuda() && patterns.device() == score.device() && patterns.scalar_type() == at::kShort &&
                  patterns.dim() == 1 && patterns.size(0) == 90 && patterns.is_contiguous(),
              "hf_sparse.transposable_2to4_mask: patterns must be 90 int16 bitmasks on the score's device");
  c10::cuda::CUDAGuard guard(score.device());
  auto out = at::empty(score.sizes(), score.options().dtype(at::kBool));
  check_cuda(hf_sparse::transposable_2to4_mask(score.data_ptr<float>(),
                                               reinterpret_cast<const uint16_t*>(patterns.data_ptr<int16_t>()),
                                               out.data_ptr<bool>(), (int)score.size(0), (int)score.size(1),
                                               c10::cuda::getCurrentCUDAStream().stream()),
             "transposable_2to4_mask");
  return out;
}


// ---------------------------------------------------------------------------------------------------------------
// Pack refresh (csrc/refresh.cu; the table is written by hf_sparse.nn.compact, which owns the tensors it points to).

int32_t refresh_dtype(at::ScalarType t, const char* op, const char* name) {
  switch (t) {
    case at::kFloat: return hf_sparse::kRefreshF32;
    case at::kBFloat16: return hf_sparse::kRefreshBF16;
    case at::kHalf: return hf_sparse::kRefreshF16;
    default: HF_CHECK(false, "hf_sparse.", op, ": ", name, " must be float32, bfloat16 or float16, got ", t);
  }
  return 0;
}

// Runs the `table` (int64, (count, kRefreshWords), on the device of the tensors it points to: one RefreshEntry per
// row) in one launch; `blocks`: the sum of refresh_block_count(numel) over the entries.
void refresh_packs(const at::Tensor& table, int64_t blocks) {
  const char* op = "refresh_packs";
  HF_CHECK(table.is_cuda() && table.scalar_type() == at::kLong && table.dim() == 2 &&
               table.size(1) == hf_sparse::kRefreshWords && table.is_contiguous(),
           "hf_sparse.", op, ": table must be a contiguous (count, ", hf_sparse::kRefreshWords,
           ") int64 CUDA tensor, got ", table.sizes());
  HF_CHECK(table.size(0) < (1LL << 31), "hf_sparse.", op, ": too many entries");
  c10::cuda::CUDAGuard guard(table.device());
  check_cuda(hf_sparse::refresh_packs(reinterpret_cast<const hf_sparse::RefreshEntry*>(table.data_ptr()),
                                      (int)table.size(0), blocks, c10::cuda::getCurrentCUDAStream().stream()),
             op);
}

int64_t refresh_block_count(int64_t numel) { return hf_sparse::refresh_blocks(numel); }

// The 2:4 view of a V:2:M pack (m >= 8; csrc/refresh.cu view24_from_pack): [values, meta] of the 2:4 pack of the same
// (rows, cols) matrix, made from the pack in one pass, so that inference holds one copy of the values and builds the
// view per call. The 2:4 kernels take it with the 2:4 layout's identity block columns (the caller's).
std::vector<at::Tensor> view24(const at::Tensor& values, const at::Tensor& meta, const at::Tensor& columns,
                               int64_t rows, int64_t cols, int64_t m) {
  const char* op = "view24";
  HF_CHECK(m >= 8, "hf_sparse.", op, ": m=", m, " is not a V:2:M group size (8 or more); a 2:4 pack is its own view");
  const auto dtype = values.scalar_type();
  HF_CHECK(dtype == at::kBFloat16 || dtype == at::kHalf, "hf_sparse.", op, ": values must be bfloat16 or float16, got ",
           dtype);
  check_packed(op, values, meta, columns, rows, cols, m, dtype);
  c10::cuda::CUDAGuard guard(values.device());
  const int64_t steps4 = (cols / 4 + 7) / 8, tiles = values.size(0);
  auto out_values = at::empty({tiles, steps4, 32, 8}, values.options());
  auto out_meta = at::empty({tiles, steps4, 16}, meta.options());
  check_cuda(hf_sparse::view24_from_pack(reinterpret_cast<const uint16_t*>(values.data_ptr()), meta.data_ptr<int32_t>(),
                                         columns.data_ptr<uint8_t>(), tiles * 16, rows, cols, (int32_t)m,
                                         values.size(1), reinterpret_cast<uint16_t*>(out_values.data_ptr()),
                                         out_meta.data_ptr<int32_t>(), c10::cuda::getCurrentCUDAStream().stream()),
             op);
  return {out_values, out_meta};
}

// Y = X W^T (+bias) of a V:2:M weight on its 2:4 view, the view made from the pack (view24) for this call only and
// freed after it: a loaded V:2:M layer's inference holds one copy of its values and pays one launch and one host
// call for the view, not a second Python round trip. `columns24` is the view's block columns (0, 1, 2, 3 in every
// block: a constant the caller keeps).
at::Tensor spmm_view24_impl(const char* op, bool wgmma, const at::Tensor& x, const at::Tensor& values,
                            const at::Tensor& meta, const at::Tensor& columns, const at::Tensor& columns24,
                            const c10::optional<at::Tensor>& bias, int64_t rows, int64_t k, int64_t m, int64_t act) {
  const auto view = view24(values, meta, columns, rows, k, m);
  return spmm_impl(op, wgmma, x, view[0], view[1], columns24, bias, rows, k, 64, 4, act);
}

at::Tensor spmm_view24(const at::Tensor& x, const at::Tensor& values, const at::Tensor& meta,
                       const at::Tensor& columns, const at::Tensor& columns24, const c10::optional<at::Tensor>& bias,
                       int64_t rows, int64_t k, int64_t m, int64_t act) {
  return spmm_view24_impl("spmm_view24", false, x, values, meta, columns, columns24, bias, rows, k, m, act);
}

at::Tensor spmm_wgmma_view24(const at::Tensor& x, const at::Tensor& values, const at::Tensor& meta,
                             const at::Tensor& columns, const at::Tensor& columns24,
                             const c10::optional<at::Tensor>& bias, int64_t rows, int64_t k, int64_t m, int64_t act) {
  return spmm_view24_impl("spmm_view24(wgmma)", true, x, values, meta, columns, columns24, bias, rows, k, m, act);
}

// A compact layer's kept positions as the kernels read them (KeptPositions, kernels.h): `sel` the on-disk 2-bit codes
// (2:4: weight_indices; V:2:M: weight_selectors), `columns` the on-disk block columns (V:2:M: weight_columns, else
// absent), `v` the pattern's V, `m` its group size.
struct Positions {
  c10::optional<at::Tensor> sel, columns;
  int64_t v, m;
};

hf_sparse::KeptPositions kept_positions(const char* op, const Positions& p, int64_t rows, int64_t cols,
                                        const at::Device& device) {
  HF_CHECK(p.sel.has_value(), "hf_sparse.", op, ": a dense choice needs the kept positions");
  const auto& sel = *p.sel;
  HF_CHECK(p.m >= 4 && cols % p.m == 0, "hf_sparse.", op, ": group size ", p.m, " does not divide ", cols, " columns");
  const int64_t groups = cols / p.m, row_bytes = (4 * groups + 7) / 8;
  HF_CHECK(sel.device() == device && sel.scalar_type() == at::kByte && sel.is_contiguous() && sel.dim() == 2 &&
               sel.size(0) == rows && sel.size(1) == row_bytes,
           "hf_sparse.", op, ": the kept positions' codes must be a contiguous (", rows, ", ", row_bytes,
           ") uint8 tensor on the layer's device");
  const bool blocks = p.m != 4 || p.columns.has_value();
  if (blocks) {
    const auto& c = *p.columns;
    HF_CHECK(p.columns.has_value() && p.v > 0 && rows % p.v == 0 && c.device() == device &&
                 c.scalar_type() == at::kByte && c.is_contiguous() && c.numel() == rows / p.v * groups * 4,
             "hf_sparse.", op, ": a V:2:M layer's block columns must be a contiguous (rows / ", p.v, ", ", groups,
             ", 4) uint8 tensor on the layer's device");
  }
  hf_sparse::KeptPositions k{};
  k.sel = sel.data_ptr<uint8_t>();
  k.columns = blocks ? p.columns->data_ptr<uint8_t>() : nullptr;
  k.rows = rows;
  k.groups = groups;
  k.sel_row_bytes = row_bytes;
  k.m = (int32_t)p.m;
  k.v = (int32_t)(blocks ? p.v : 1);
  return k;
}

// The kept values of the (rows, cols) matrix `src` in `dtype`, (rows, 2 cols / m): one pass, gather and cast.
at::Tensor gather_kept(const at::Tensor& src, const c10::optional<at::Tensor>& sel,
                       const c10::optional<at::Tensor>& columns, int64_t rows, int64_t cols, int64_t v, int64_t m,
                       at::ScalarType dtype) {
  const char* op = "gather_kept";
  HF_CHECK(src.is_cuda() && src.is_contiguous() && src.numel() == rows * cols, "hf_sparse.", op,
           ": src must be a contiguous CUDA tensor of ", rows, " x ", cols, " elements");
  const auto pos = kept_positions(op, Positions{sel, columns, v, m}, rows, cols, src.device());
  c10::cuda::CUDAGuard guard(src.device());
  auto out = at::empty({rows, 2 * (cols / m)}, src.options().dtype(dtype));
  check_cuda(hf_sparse::gather_kept(src.data_ptr(), refresh_dtype(src.scalar_type(), op, "src"), out.data_ptr(),
                                    refresh_dtype(dtype, op, "dtype"), pos, c10::cuda::getCurrentCUDAStream().stream()),
             op);
  return out;
}

// The dense (rows, cols) matrix in `dtype` whose kept positions hold `values` ((rows, 2 cols / m)), zero elsewhere.
at::Tensor scatter_kept(const at::Tensor& values, const c10::optional<at::Tensor>& sel,
                        const c10::optional<at::Tensor>& columns, int64_t rows, int64_t cols, int64_t v, int64_t m,
                        at::ScalarType dtype) {
  const char* op = "scatter_kept";
  HF_CHECK(values.is_cuda() && values.is_contiguous() && m > 0 && values.numel() == rows * 2 * (cols / m),
           "hf_sparse.", op, ": values must be a contiguous CUDA tensor of ", rows, " x ", 2 * (cols / m),
           " elements");
  const auto pos = kept_positions(op, Positions{sel, columns, v, m}, rows, cols, values.device());
  c10::cuda::CUDAGuard guard(values.device());
  auto out = at::empty({rows, cols}, values.options().dtype(dtype));
  check_cuda(hf_sparse::scatter_kept(values.data_ptr(), refresh_dtype(values.scalar_type(), op, "values"),
                                     out.data_ptr(), refresh_dtype(dtype, op, "dtype"), pos,
                                     c10::cuda::getCurrentCUDAStream().stream()),
             op);
  return out;
}

// ---------------------------------------------------------------------------------------------------------------
// A compact layer's training call (hf_sparse.nn.compact): y = x W^T + b with W given by its kept values, as one C++
// autograd node, so that neither the forward nor the backward runs Python. ``plan`` bits: 1 forward by SpMM (else
// cuBLAS on a transient dense weight), 2 input gradient by SpMM on the transposed 2:4 pack (else dense), 4 weight
// gradient by SDDMM (else dY^T X by cuBLAS, then a gather at the kept positions). ``kernels`` bits pick the
// sparse-wgmma variant of those three kernels in the same order. ``bias_c`` is the bias in the compute dtype (the
// bias itself where it already is); ``sel`` / ``sel_columns`` / ``v_g`` the layer's kept positions in their on-disk
// form (Positions; read by the dense choices, the 2:4 view and the transposed pack made in the call). The forward
// SpMM runs on ``values, meta, columns`` with group size ``m`` (the layer's own pack, or the 2:4 view of a V:2:M
// layer: m = 4); the SDDMM on the layer's own pack metadata ``meta_g, columns_g`` with its group size ``m_g``.
// ``values`` / ``values_t`` with no elements (what a training call passes) are made inside the call from the kept
// values by pack_in_call, in the compute dtype, and freed when it returns.

at::Tensor aligned_2d(const at::Tensor& t, int64_t features, at::ScalarType dtype) {
  auto t2 = t.reshape({-1, features});
  if (t2.scalar_type() != dtype) t2 = t2.to(dtype);
  t2 = t2.contiguous();
  if (reinterpret_cast<uintptr_t>(t2.data_ptr()) % 16 != 0) t2 = t2.clone();
  return t2;
}

// x as aligned_2d makes it in `dtype`, cast once for the layers that read the same input in turn (a decoder's q, k
// and v projections, gate and up): under autocast each would otherwise cast the fp32 input itself and save its own
// copy for its weight gradient. The last cast is remembered weakly (its source, the source's version, the cast), so
// it is reused only while the source is unchanged and a saved autograd node still holds the cast, and never kept
// alive by this cache.
at::Tensor input_in(const at::Tensor& x, int64_t features, at::ScalarType dtype) {
  if (x.scalar_type() == dtype) return aligned_2d(x, features, dtype);
  using Weak = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;
  struct LastCast {
    Weak source{c10::intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>()};
    Weak cast{c10::intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>()};
    uint32_t version = 0;
  };
  static thread_local LastCast last;
  const auto source = last.source.lock();
  if (source.get() == x.unsafeGetTensorImpl() && last.version == x._version()) {
    const auto cast = last.cast.lock();
    if (cast.defined()) {
      at::Tensor t(cast);
      if (t.scalar_type() == dtype && t.size(-1) == features && t.numel() == x.numel()) return t;
    }
  }
  auto t = aligned_2d(x, features, dtype);
  last.source = Weak(x.getIntrusivePtr());
  last.cast = Weak(t.getIntrusivePtr());
  last.version = x._version();
  return t;
}

at::Tensor dense_weight(const at::Tensor& weight, const Positions& pos, int64_t rows, int64_t cols,
                        at::ScalarType dtype) {
  return scatter_kept(weight.contiguous(), pos.sel, pos.columns, rows, cols, pos.v, pos.m, dtype);
}

// A pack's values made now from the layer's kept values `weight` ((rows, cols) logical, (rows, 2 cols / pos.m) kept,
// any of fp32 / bf16 / fp16), cast to `dtype` as they are written, for the pack whose metadata is `meta`
// ((tiles, steps, 16) int32): `kind` kRefreshPack (the layer's own pack), kRefreshView24 (a V:2:M layer's 2:4 view)
// or kRefreshTransposed (the 2:4 pack of W^T); the last two find each slot's source from the kept positions `pos`.
// A call that trains computes on packs made so and frees them when it returns: between calls a layer holds its
// values and the packs' metadata only. A pack argument with no elements asks for this.
at::Tensor pack_in_call(int32_t kind, const at::Tensor& weight, const at::Tensor& meta, const Positions& pos,
                        int64_t rows, int64_t cols, at::ScalarType dtype, const char* op) {
  HF_CHECK(weight.is_cuda() && weight.numel() == rows * (2 * cols / pos.m), "hf_sparse.", op,
           ": the kept values must be a CUDA tensor of ", rows, " x ", 2 * cols / pos.m, " elements");
  HF_CHECK(meta.device() == weight.device() && meta.scalar_type() == at::kInt && meta.dim() == 3 && meta.size(2) == 16,
           "hf_sparse.", op, ": a pack's metadata must be a (tiles, steps, 16) int32 tensor on the layer's device");
  const bool transposed = kind == hf_sparse::kRefreshTransposed;
  const int64_t pack_rows = transposed ? cols : rows;
  const int64_t groups = (transposed ? rows : cols) / (kind == hf_sparse::kRefreshPack ? pos.m : 4);
  HF_CHECK(meta.size(0) * 16 >= pack_rows && meta.size(1) * 8 >= groups, "hf_sparse.", op, ": metadata of shape ",
           meta.sizes(), " cannot hold a pack of ", pack_rows, " rows and ", groups, " groups");
  const auto src = weight.contiguous();
  auto values = at::empty({meta.size(0), meta.size(1), 32, 8}, weight.options().dtype(dtype));
  c10::cuda::CUDAGuard guard(weight.device());
  const auto stream = c10::cuda::getCurrentCUDAStream().stream();
  // the view and the transposed pack have their own kernels, which read the kept positions; the own pack is one
  // refresh entry
  if (kind == hf_sparse::kRefreshView24 || kind == hf_sparse::kRefreshTransposed) {
    const auto make = kind == hf_sparse::kRefreshView24 ? hf_sparse::view24_from_values
                                                         : hf_sparse::transposed_from_values;
    check_cuda(make(src.data_ptr(), refresh_dtype(src.scalar_type(), op, "weight"),
                    kept_positions(op, pos, rows, cols, weight.device()), meta.size(0), meta.size(1),
                    values.data_ptr(), refresh_dtype(dtype, op, "dtype"), stream),
               op);
    return values;
  }
  hf_sparse::RefreshEntry e{};  // the layer's own pack: one entry of the refresh kernel, passed by value
  e.src = src.data_ptr();
  e.dst = values.data_ptr();
  e.numel = values.numel();
  e.rows = pack_rows;
  e.groups = groups;
  e.steps = meta.size(1);
  e.kind = kind;
  e.src_dtype = refresh_dtype(src.scalar_type(), op, "weight");
  e.dst_dtype = refresh_dtype(dtype, op, "dtype");
  check_cuda(hf_sparse::refresh_one(e, stream), op);
  return values;
}

// pack_in_call as a binding, for the tests that compare its bytes with the torch ops' (hf_sparse.nn.refresh).
at::Tensor pack_values(int64_t kind, const at::Tensor& weight, const at::Tensor& meta,
                       const c10::optional<at::Tensor>& sel, const c10::optional<at::Tensor>& sel_columns, int64_t rows,
                       int64_t cols, int64_t v, int64_t m, at::ScalarType dtype) {
  HF_CHECK(kind >= hf_sparse::kRefreshPack && kind <= hf_sparse::kRefreshView24, "hf_sparse.pack_values: kind ", kind,
           " is not a pack (0: the layer's own, 1: transposed, 2: the 2:4 view)");
  HF_CHECK(dtype == at::kBFloat16 || dtype == at::kHalf, "hf_sparse.pack_values: dtype must be bfloat16 or float16");
  return pack_in_call((int32_t)kind, weight, meta, Positions{sel, sel_columns, v, m}, rows, cols, dtype,
                      "pack_values");
}

c10::optional<at::Tensor> optional_of(const at::Tensor& t) {
  return t.defined() ? c10::optional<at::Tensor>(t) : c10::nullopt;
}

// The forward of a compact layer on its 2-D input in the compute dtype (no autograd): SpMM where plan & 1, else
// cuBLAS on a transient dense weight.
at::Tensor compact_forward(const at::Tensor& x2, const at::Tensor& weight, const c10::optional<at::Tensor>& bias_c,
                           const at::Tensor& values, const at::Tensor& meta, const at::Tensor& columns,
                           const c10::optional<at::Tensor>& sel, const c10::optional<at::Tensor>& sel_columns,
                           int64_t rows, int64_t cols, int64_t m, int64_t v_g, int64_t m_g, int64_t plan,
                           int64_t kernels) {
  const auto xa = aligned_2d(x2, cols, x2.scalar_type());
  const Positions pos{sel, sel_columns, v_g, m_g};
  if (plan & 1) {
    const auto made = values.numel() > 0 ? values
                                         : pack_in_call(m == m_g ? hf_sparse::kRefreshPack : hf_sparse::kRefreshView24,
                                                        weight, meta, pos, rows, cols, xa.scalar_type(), "compact_linear");
    return spmm_impl("compact_linear", kernels & 1, xa, made, meta, columns, bias_c, rows, cols, v_g, m, 0);
  }
  return at::linear(xa, dense_weight(weight, pos, rows, cols, xa.scalar_type()), bias_c);
}

// The gradients of a compact layer (no autograd) for the output gradient dy2 (2-D, the compute dtype): dx2 (the
// compute dtype) where need_dx, by SpMM on the transposed pack where plan & 2, else dense; the gradient of the kept
// values in weight's dtype where need_dw, by SDDMM on the layer's own pack metadata where plan & 4, else a GEMM and
// one gather at the kept positions; the bias gradient in bias_dtype where need_db. Tensors not asked for are
// undefined.
std::vector<at::Tensor> compact_backward(const at::Tensor& dy, const at::Tensor& x2, const at::Tensor& weight,
                                         const c10::optional<at::Tensor>& sel,
                                         const c10::optional<at::Tensor>& sel_columns,
                                         const c10::optional<at::Tensor>& values_t,
                                         const c10::optional<at::Tensor>& meta_t,
                                         const c10::optional<at::Tensor>& columns_t, const at::Tensor& meta_g,
                                         const at::Tensor& columns_g, int64_t rows, int64_t cols, int64_t v_g,
                                         int64_t m_g, int64_t plan, int64_t kernels, bool need_dx, bool need_dw,
                                         bool need_db, at::ScalarType bias_dtype) {
  HF_CHECK(!(need_dx && (plan & 2)) || (values_t.has_value() && meta_t.has_value() && columns_t.has_value()),
           "hf_sparse.compact_backward: a sparse input gradient needs the transposed pack");
  const Positions pos{sel, sel_columns, v_g, m_g};
  const auto dtype = x2.scalar_type();
  const auto dy2 = aligned_2d(dy, rows, dtype);
  const auto xa = aligned_2d(x2, cols, dtype);
  at::Tensor dx, dw, db;
  if (need_dx && (plan & 2)) {
    const auto made = values_t->numel() > 0 ? *values_t
                                            : pack_in_call(hf_sparse::kRefreshTransposed, weight, *meta_t, pos, rows,
                                                           cols, dtype, "compact_linear(input gradient)");
    dx = spmm_impl("compact_linear(input gradient)", kernels & 2, dy2, made, *meta_t, *columns_t, c10::nullopt, cols,
                   rows, 64, 4, 0);
  } else if (need_dx) {
    dx = at::mm(dy2, dense_weight(weight, pos, rows, cols, dtype));
  }
  if (need_dw) {
    dw = (plan & 4) ? sddmm_impl("compact_linear(weight gradient)", kernels & 4, dy2, xa, meta_g, columns_g, rows,
                                 cols, m_g)
                    : gather_kept(at::mm(dy2.t(), xa), sel, sel_columns, rows, cols, v_g, m_g, weight.scalar_type())
                          .view(weight.sizes());
    dw = dw.to(weight.scalar_type());
  }
  if (need_db) db = dy2.sum(0, false, at::kFloat).to(bias_dtype);
  return {dx, dw, db};
}

struct CompactLinearFn : public torch::autograd::Function<CompactLinearFn> {
  // Only x, weight and bias are autograd inputs; the packs and the positions (optional, never differentiated)
  // travel as optionals, which Function::apply does not treat as variables. Without a bias, ``bias`` is an empty
  // tensor. meta_g / columns_g / m_g: the layer's own V:2:M pack metadata, which the SDDMM reads (the forward may run
  // a 2:4 view).
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const at::Tensor& bias, bool has_bias, const c10::optional<at::Tensor>& bias_c,
                            const c10::optional<at::Tensor>& values, const c10::optional<at::Tensor>& meta,
                            const c10::optional<at::Tensor>& columns, const c10::optional<at::Tensor>& values_t,
                            const c10::optional<at::Tensor>& meta_t, const c10::optional<at::Tensor>& columns_t,
                            const c10::optional<at::Tensor>& meta_g, const c10::optional<at::Tensor>& columns_g,
                            const c10::optional<at::Tensor>& sel, const c10::optional<at::Tensor>& sel_columns,
                            int64_t rows, int64_t cols, int64_t m, int64_t v_g, int64_t m_g, int64_t plan,
                            int64_t kernels) {
    const auto dtype = values->scalar_type();
    auto x2 = input_in(x, cols, dtype);
    const at::Tensor none;
    at::Tensor y = compact_forward(x2, weight, bias_c, *values, *meta, *columns, sel, sel_columns, rows, cols, m, v_g,
                                   m_g, plan, kernels);
    ctx->save_for_backward({x2, weight});
    auto& data = ctx->saved_data;
    data["sel"] = sel.value_or(none);
    data["sel_columns"] = sel_columns.value_or(none);
    data["values_t"] = values_t.value_or(none);
    data["meta_t"] = meta_t.value_or(none);
    data["columns_t"] = columns_t.value_or(none);
    data["meta_g"] = meta_g.value_or(none);
    data["columns_g"] = columns_g.value_or(none);
    data["rows"] = rows;
    data["cols"] = cols;
    data["v_g"] = v_g;
    data["m_g"] = m_g;
    data["plan"] = plan;
    data["kernels"] = kernels;
    data["x_sizes"] = x.sizes().vec();
    data["x_dtype"] = x.scalar_type();
    data["bias_dtype"] = has_bias ? c10::IValue(bias.scalar_type()) : c10::IValue();
    auto sizes = x.sizes().vec();
    sizes.back() = rows;
    return y.view(sizes);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    auto& data = ctx->saved_data;
    const auto& bias_dtype = data["bias_dtype"];
    const bool need_db = !bias_dtype.isNone() && ctx->needs_input_grad(2);
    auto g = compact_backward(grads[0], saved[0], saved[1], optional_of(data["sel"].toTensor()),
                              optional_of(data["sel_columns"].toTensor()), optional_of(data["values_t"].toTensor()),
                              optional_of(data["meta_t"].toTensor()), optional_of(data["columns_t"].toTensor()),
                              data["meta_g"].toTensor(), data["columns_g"].toTensor(), data["rows"].toInt(),
                              data["cols"].toInt(), data["v_g"].toInt(), data["m_g"].toInt(), data["plan"].toInt(),
                              data["kernels"].toInt(), ctx->needs_input_grad(0), ctx->needs_input_grad(1), need_db,
                              need_db ? bias_dtype.toScalarType() : at::kFloat);
    torch::autograd::variable_list out(22);  // one per argument of forward
    if (g[0].defined()) out[0] = g[0].to(data["x_dtype"].toScalarType()).view(data["x_sizes"].toIntVector());
    out[1] = g[1];
    out[2] = g[2];
    return out;
  }
};

at::Tensor compact_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                          const c10::optional<at::Tensor>& bias_c, const at::Tensor& values, const at::Tensor& meta,
                          const at::Tensor& columns, const c10::optional<at::Tensor>& values_t,
                          const c10::optional<at::Tensor>& meta_t, const c10::optional<at::Tensor>& columns_t,
                          const at::Tensor& meta_g, const at::Tensor& columns_g, const c10::optional<at::Tensor>& sel,
                          const c10::optional<at::Tensor>& sel_columns, int64_t rows, int64_t cols, int64_t m,
                          int64_t v_g, int64_t m_g, int64_t plan, int64_t kernels) {
  HF_CHECK(!(plan & 2) || (values_t.has_value() && meta_t.has_value() && columns_t.has_value()),
           "hf_sparse.compact_linear: a sparse input gradient needs the transposed pack");
  HF_CHECK((plan & 7) == 7 || sel.has_value(),
           "hf_sparse.compact_linear: a dense forward, input gradient or GEMM weight gradient needs the kept positions");
  const at::Tensor b = bias.has_value() ? *bias : at::empty({0}, x.options());
  return CompactLinearFn::apply(x, weight, b, bias.has_value(), bias_c, values, meta, columns, values_t, meta_t,
                                columns_t, meta_g, columns_g, sel, sel_columns, rows, cols, m, v_g, m_g, plan,
                                kernels);
}

// The same computations as the dispatcher ops ``hf_sparse::compact_linear`` / ``hf_sparse::compact_backward``
// (schemas, autograd and CPU references in hf_sparse/nn/compiled.py), which a torch.compile graph calls with no
// Python between it and these functions. The training op's forward is compact_forward; the arguments only the
// backward reads come along so that autograd can save them.
at::Tensor compact_linear_op(const at::Tensor& x2, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                             const c10::optional<at::Tensor>& bias_c, const at::Tensor& values,
                             const at::Tensor& meta, const at::Tensor& columns,
                             const c10::optional<at::Tensor>& values_t, const c10::optional<at::Tensor>& meta_t,
                             const c10::optional<at::Tensor>& columns_t, const at::Tensor& meta_g,
                             const at::Tensor& columns_g, const c10::optional<at::Tensor>& sel,
                             const c10::optional<at::Tensor>& sel_columns, int64_t rows, int64_t cols, int64_t m,
                             int64_t v_g, int64_t m_g, int64_t plan, int64_t kernels) {
  return compact_forward(x2, weight, bias_c, values, meta, columns, sel, sel_columns, rows, cols, m, v_g, m_g, plan,
                         kernels);
}

// Gradients not asked for come back empty (0 elements), so that the op's outputs are always tensors.
std::tuple<at::Tensor, at::Tensor, at::Tensor> compact_backward_op(
    const at::Tensor& dy2, const at::Tensor& x2, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
    const c10::optional<at::Tensor>& sel, const c10::optional<at::Tensor>& sel_columns,
    const c10::optional<at::Tensor>& values_t, const c10::optional<at::Tensor>& meta_t,
    const c10::optional<at::Tensor>& columns_t, const at::Tensor& meta_g, const at::Tensor& columns_g, int64_t rows,
    int64_t cols, int64_t v_g, int64_t m_g, int64_t plan, int64_t kernels, bool need_dx, bool need_dw) {
  const bool need_db = bias.has_value();
  auto g = compact_backward(dy2, x2, weight, sel, sel_columns, values_t, meta_t, columns_t, meta_g, columns_g, rows,
                            cols, v_g, m_g, plan, kernels, need_dx, need_dw, need_db,
                            need_db ? bias->scalar_type() : at::kFloat);
  return {g[0].defined() ? g[0] : at::empty({0}, x2.options()),
          g[1].defined() ? g[1] : at::empty({0}, weight.options()),
          g[2].defined() ? g[2] : at::empty({0}, x2.options())};
}

}  // namespace

TORCH_LIBRARY_IMPL(hf_sparse, CUDA, lib) {
  lib.impl("compact_linear", &compact_linear_op);
  lib.impl("compact_backward", &compact_backward_op);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.doc() = "hf_sparse CUDA kernels (SpMM, SDDMM, pack) for V:2:M sparse weights";
#if defined(HF_SPARSE_LAB)
  mod.def("lab_set", &lab_set, "lab build: set a tuning knob of csrc/lab.h by name, return its previous value");
#endif
  mod.def("spmm", &spmm, "Y = X W^T (+bias), W packed V:2:M");
  mod.def("spmm_wgmma", &spmm_wgmma, "as spmm, with sparse wgmma (sm_90a; 2:4 and V:2:M)");
  mod.def("spmm_wgmma_available", &spmm_wgmma_available,
          "True on a cc 9.0 GPU when the extension was built with sm_90a");
#if defined(HF_SPARSE_TIMELINE)
  mod.def("spmm_timeline", &spmm_timeline,
          "timeline build: per-CTA stamps of the 2:4 sparse-wgmma calls since the last read, then cleared");
  mod.def("spmm_xt_timeline", &spmm_xt_timeline,
          "timeline build: per-CTA cycle counters of the V:2:M X^T path since the last read, then cleared");
#endif
  mod.def("sddmm", &sddmm, "dW at kept positions, fp32, logical order (R, 2G)");
  mod.def("sddmm_wgmma", &sddmm_wgmma, "as sddmm, with dense wgmma over the condensed columns (sm_90a)");
  mod.def("pack", &pack, "dense masked weight + mask -> packed (values, meta, columns, valid, error flag)");
  mod.def("nm_mask", &nm_mask, "N:M mask of an fp32 score (hf_sparse.masks.nm_mask's rule)");
  mod.def("vnm_mask", &vnm_mask, "V:N:M mask of an fp32 score (hf_sparse.masks.vnm_mask's rule)");
  mod.def("transposable_2to4_mask", &transposable_2to4_mask,
          "exact transposable 2:4 mask of an fp32 score, first best of the given 90 patterns");
  mod.def("compact_forward", &compact_forward, "a compact layer's forward on its 2-D input, no autograd");
  mod.def("compact_backward", &compact_backward, "a compact layer's gradients [dx2, dweight, dbias], no autograd");
  mod.def("compact_linear", &compact_linear,
          "a compact layer's training call: y = x W^T + b from the kept values, with C++ autograd (hf_sparse.nn.compact)");
  mod.def("pack_values", &pack_values,
          "a pack's values made from a layer's kept values, as a training call makes them (kind 0 own, 1 transposed, "
          "2 the 2:4 view)");
  mod.def("refresh_packs", &refresh_packs, "rewrite many packs from their layers' values in one launch (a table)");
  mod.def("refresh_block_count", &refresh_block_count, "blocks refresh_packs runs for an entry of numel elements");
  mod.def("view24", &view24, "the 2:4 view (values, meta) of a V:2:M pack, made from the pack in one pass");
  mod.def("spmm_view24", &spmm_view24, "as spmm on the 2:4 view of a V:2:M pack, the view made for this call");
  mod.def("spmm_wgmma_view24", &spmm_wgmma_view24, "as spmm_view24, with sparse wgmma (sm_90a)");
  mod.def("gather_kept", &gather_kept, "a layer's kept values out of a dense matrix, at their on-disk positions");
  mod.def("scatter_kept", &scatter_kept, "the dense matrix whose kept positions hold the values, zero elsewhere");
  mod.def("apply_masks_", &apply_masks_, "zero, in place, the entries of each tensor where its bool mask is false");
}
