// cuSPARSELt 2:4 SpMM with everything but the matmul itself cached, so a call costs one cusparseLtMatmul.
//
// torch._cslt_sparse_mm re-creates descriptors, algorithm selection and plan on every call (~0.3-0.4 ms on an
// H200, 4-10x a BERT-sized GEMM). Here one CsltWeight per compressed weight keeps the structured descriptor and
// the compressed buffer, and one plan per (token count, bias pointer) with the algorithm cusparseLtMatmulSearch
// picked for that token count's power-of-two bucket. Recompressing new values
// (after an optimizer step) writes into the same buffer and keeps every plan.
//
// Operands, chosen so nothing is copied or transposed: A = W (R x K, row-major, structured 2:4 along K),
// B = X as PyTorch hands it (N x K row-major, used with op = transpose), D = Y^T (R x N column-major, i.e. Y as
// N x R row-major). The bias (R entries, the dtype of Y) is cuSPARSELt's per-row-of-D bias.
//
// Built as its own extension (benchmarks/lab/cslt.py: load_cslt_extension), in the lab build only and only where
// cusparseLt.h is found, so the kernels of the product never depend on cuSPARSELt.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cusparseLt.h>
#include <pybind11/stl.h>
#include <torch/extension.h>

#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <utility>

namespace {

constexpr int64_t kMaxPlans = 32;  // per weight; least recently used plans are destroyed beyond this

const char* status_name(cusparseStatus_t s) {
  switch (s) {
    case CUSPARSE_STATUS_NOT_INITIALIZED: return "NOT_INITIALIZED";
    case CUSPARSE_STATUS_ALLOC_FAILED: return "ALLOC_FAILED";
    case CUSPARSE_STATUS_INVALID_VALUE: return "INVALID_VALUE (a shape, stride or alignment cuSPARSELt refuses)";
    case CUSPARSE_STATUS_ARCH_MISMATCH: return "ARCH_MISMATCH (cuSPARSELt needs compute capability 8.0 or newer)";
    case CUSPARSE_STATUS_EXECUTION_FAILED: return "EXECUTION_FAILED";
    case CUSPARSE_STATUS_INTERNAL_ERROR: return "INTERNAL_ERROR";
    case CUSPARSE_STATUS_NOT_SUPPORTED: return "NOT_SUPPORTED";
    case CUSPARSE_STATUS_INSUFFICIENT_RESOURCES: return "INSUFFICIENT_RESOURCES";
    default: return "error";
  }
}

void check(cusparseStatus_t s, const char* what) {
  TORCH_CHECK(s == CUSPARSE_STATUS_SUCCESS, "hf_sparse.cslt: ", what, " failed with status ", static_cast<int>(s),
              " (", status_name(s), ")");
}

// One cuSPARSELt handle per device for the life of the process (as torch keeps its own), never destroyed. A first
// version destroyed the handle with the last CsltWeight; on the H200 (cuSPARSELt 0.8) a test process then crashed
// (segfault) in the first matmul after a new handle was made, while processes that never dropped their last handle
// ran (benchmarks/RESULTS.md, 2026-11-22): the probable cause, not proven. A handle holds only light host
// resources. Descriptors, plans and compressed buffers are still freed with their CsltWeight.
struct Handle {
  cusparseLtHandle_t h;
  explicit Handle(int device) {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
    check(cusparseLtInit(&h), "cusparseLtInit");
    int version = 0;
    check(cusparseLtGetVersion(&h, &version), "cusparseLtGetVersion");
    // The opaque structs are sized by the header: a library of another minor version may lay them out differently.
    TORCH_CHECK(version / 100 == CUSPARSELT_VERSION / 100, "hf_sparse.cslt: the loaded cuSPARSELt is version ",
                version, " but the extension was compiled against cusparseLt.h version ", CUSPARSELT_VERSION,
                "; point HF_SPARSE_CUSPARSELT_DIR at the installation torch uses and clear the extension cache");
  }
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;
};

Handle* handle_for(int device) {
  static std::mutex mu;
  static std::map<int, Handle*>* handles = new std::map<int, Handle*>();  // never freed (see Handle)
  std::lock_guard<std::mutex> lock(mu);
  Handle*& slot = (*handles)[device];
  if (slot == nullptr) slot = new Handle(device);
  return slot;
}

cudaDataType cuda_type(at::ScalarType t) {
  TORCH_CHECK(t == at::kBFloat16 || t == at::kHalf, "hf_sparse.cslt: dtype must be bfloat16 or float16, got ", t);
  return t == at::kBFloat16 ? CUDA_R_16BF : CUDA_R_16F;
}

bool aligned16(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

// Descriptors, algorithm selection and plan of one (token count, bias pointer). Heap-allocated and never moved:
// the plan may refer to the descriptors it was made from.
struct Plan {
  const cusparseLtHandle_t* h = nullptr;
  cusparseLtMatDescriptor_t b{}, d{};
  cusparseLtMatmulDescriptor_t mm{};
  cusparseLtMatmulAlgSelection_t alg{};
  cusparseLtMatmulPlan_t plan{};
  bool has_b = false, has_d = false, has_alg = false, has_plan = false;
  size_t workspace = 0;
  int alg_id = -1;

  ~Plan() {
    if (has_plan) cusparseLtMatmulPlanDestroy(&plan);
    if (has_alg) cusparseLtMatmulAlgSelectionDestroy(&alg);
    if (has_d) cusparseLtMatDescriptorDestroy(&d);
    if (has_b) cusparseLtMatDescriptorDestroy(&b);
  }
};

class CsltWeight {
 public:
  explicit CsltWeight(const at::Tensor& weight) {
    check_weight(weight, "CsltWeight");
    rows_ = weight.size(0);
    cols_ = weight.size(1);
    dtype_ = weight.scalar_type();
    device_ = weight.device().index();
    c10::cuda::CUDAGuard guard(weight.device());
    handle_ = handle_for(device_);
    check(cusparseLtStructuredDescriptorInit(&handle_->h, &a_, rows_, cols_, cols_, 16, cuda_type(dtype_),
                                             CUSPARSE_ORDER_ROW, CUSPARSELT_SPARSITY_50_PERCENT),
          "cusparseLtStructuredDescriptorInit (weight)");
    has_a_ = true;
    size_t size = 0;
    check(cusparseLtSpMMACompressedSize2(&handle_->h, &a_, &size, &buffer_size_), "cusparseLtSpMMACompressedSize2");
    compressed_ = at::empty({static_cast<int64_t>(size)}, weight.options().dtype(at::kByte));
    compress(weight);
  }

  ~CsltWeight() {
    plans_.clear();  // plans before the descriptor they were made with
    if (has_a_) cusparseLtMatDescriptorDestroy(&a_);
  }

  CsltWeight(const CsltWeight&) = delete;
  CsltWeight& operator=(const CsltWeight&) = delete;

  // New values (same shape, dtype, device; pruned to 2:4 along K) into the same compressed buffer; plans stay.
  void compress(const at::Tensor& weight) {
    check_weight(weight, "compress");
    TORCH_CHECK(weight.size(0) == rows_ && weight.size(1) == cols_ && weight.scalar_type() == dtype_ &&
                    weight.device().index() == device_,
                "hf_sparse.cslt.compress: weight is ", weight.scalar_type(), " ", weight.sizes(), " on ",
                weight.device(), ", this compressed weight is ", dtype_, " [", rows_, ", ", cols_, "] on cuda:",
                device_);
    c10::cuda::CUDAGuard guard(weight.device());
    std::lock_guard<std::mutex> lock(mu_);
    at::Tensor scratch;
    if (buffer_size_ > 0) {
      scratch = at::empty({static_cast<int64_t>(buffer_size_)}, weight.options().dtype(at::kByte));
    }
    check(cusparseLtSpMMACompress2(&handle_->h, &a_, 1, CUSPARSE_OPERATION_NON_TRANSPOSE, weight.data_ptr(),
                                   compressed_.data_ptr(), buffer_size_ > 0 ? scratch.data_ptr() : nullptr,
                                   c10::cuda::getCurrentCUDAStream(device_).stream()),
          "cusparseLtSpMMACompress2");
    ++compressions_;
  }

  // Y = X W^T (+ bias): X (N x K) row-major, Y (N x R) row-major. search: on a token-count bucket not seen
  // before, let cusparseLtMatmulSearch pick the algorithm (it synchronizes; never while a CUDA graph captures).
  at::Tensor matmul(const at::Tensor& x, const c10::optional<at::Tensor>& bias, bool search) {
    TORCH_CHECK(x.is_cuda() && x.device().index() == device_, "hf_sparse.cslt.matmul: x must be on cuda:", device_,
                ", got ", x.device());
    TORCH_CHECK(x.scalar_type() == dtype_, "hf_sparse.cslt.matmul: x must be ", dtype_, " like the weight, got ",
                x.scalar_type());
    TORCH_CHECK(x.dim() == 2 && x.size(1) == cols_, "hf_sparse.cslt.matmul: x must be (tokens, ", cols_,
                "), got ", x.sizes());
    TORCH_CHECK(x.is_contiguous() && aligned16(x), "hf_sparse.cslt.matmul: x must be contiguous and 16-byte aligned");
    const int64_t n = x.size(0);
    TORCH_CHECK(n > 0 && n % 8 == 0, "hf_sparse.cslt.matmul: cuSPARSELt needs a token count that is a multiple of 8 ",
                "(16-bit dense operand), got ", n, "; use hf_sparse.ops.spmm or dense F.linear for this call");
    const void* bias_ptr = nullptr;
    if (bias.has_value()) {
      const auto& b = *bias;
      TORCH_CHECK(b.is_cuda() && b.device().index() == device_ && b.scalar_type() == dtype_ && b.dim() == 1 &&
                      b.size(0) == rows_ && b.is_contiguous() && aligned16(b),
                  "hf_sparse.cslt.matmul: bias must be a contiguous, 16-byte aligned ", dtype_, " vector of ", rows_,
                  " entries on cuda:", device_, ", got ", b.scalar_type(), " ", b.sizes());
      bias_ptr = b.data_ptr();
    }
    c10::cuda::CUDAGuard guard(x.device());
    std::lock_guard<std::mutex> lock(mu_);
    auto y = at::empty({n, rows_}, x.options());
    cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device_).stream();
    const float alpha = 1.0f, beta = 0.0f;
    bool fresh = false;
    Plan& p = plan_for(n, bias_ptr, &fresh);
    at::Tensor ws = workspace(p, x);
    const int64_t bucket = bucket_of(n);
    if (fresh && search && searched_.count(bucket) == 0) {
      check(cusparseLtMatmulSearch(&handle_->h, &p.plan, &alpha, compressed_.data_ptr(), x.data_ptr(), &beta,
                                   y.data_ptr(), y.data_ptr(), p.workspace > 0 ? ws.data_ptr() : nullptr, &stream, 1),
            "cusparseLtMatmulSearch");
      ++searches_;
      int alg_id = 0;
      check(cusparseLtMatmulAlgGetAttribute(&handle_->h, &p.alg, CUSPARSELT_MATMUL_ALG_CONFIG_ID, &alg_id,
                                            sizeof(alg_id)),
            "cusparseLtMatmulAlgGetAttribute(CONFIG_ID)");
      p.alg_id = alg_id;
      searched_[bucket] = alg_id;
      check(cusparseLtMatmulGetWorkspace(&handle_->h, &p.plan, &p.workspace), "cusparseLtMatmulGetWorkspace");
      ws = workspace(p, x);  // the algorithm found may need more
    }
    check(cusparseLtMatmul(&handle_->h, &p.plan, &alpha, compressed_.data_ptr(), x.data_ptr(), &beta, y.data_ptr(),
                           y.data_ptr(), p.workspace > 0 ? ws.data_ptr() : nullptr, &stream, 1),
          "cusparseLtMatmul");
    return y;
  }

  int64_t rows() const { return rows_; }
  int64_t cols() const { return cols_; }
  int64_t plan_count() const { return static_cast<int64_t>(plans_.size()); }
  int64_t plan_inits() const { return plan_inits_; }
  int64_t searches() const { return searches_; }
  int64_t compressions() const { return compressions_; }
  std::map<int64_t, int> algorithms() const { return searched_; }  // bucket -> searched algorithm id
  at::Tensor compressed() const { return compressed_; }

 private:
  using Key = std::pair<int64_t, uintptr_t>;  // (token count, bias pointer or 0)

  static int64_t bucket_of(int64_t n) {
    int64_t b = 1;
    while (b < n) b <<= 1;
    return b;
  }

  static void check_weight(const at::Tensor& w, const char* op) {
    TORCH_CHECK(w.is_cuda() && w.dim() == 2, "hf_sparse.cslt.", op, ": weight must be a 2-D CUDA tensor");
    cuda_type(w.scalar_type());
    TORCH_CHECK(w.is_contiguous() && aligned16(w), "hf_sparse.cslt.", op,
                ": weight must be contiguous (row-major) and 16-byte aligned");
    TORCH_CHECK(w.size(0) % 16 == 0 && w.size(1) % 16 == 0 && w.size(0) > 0 && w.size(1) > 0, "hf_sparse.cslt.", op,
                ": cuSPARSELt needs both weight dimensions to be multiples of 16 (16-bit structured operand), got ",
                w.sizes(), "; use hf_sparse.ops.spmm or dense F.linear for this layer");
  }

  at::Tensor workspace(const Plan& p, const at::Tensor& like) {
    if (p.workspace == 0) return at::Tensor();
    return at::empty({static_cast<int64_t>(p.workspace)}, like.options().dtype(at::kByte));
  }

  Plan& plan_for(int64_t n, const void* bias_ptr, bool* fresh) {
    const Key key{n, reinterpret_cast<uintptr_t>(bias_ptr)};
    auto it = plans_.find(key);
    if (it != plans_.end()) {
      lru_.splice(lru_.begin(), lru_, it->second.second);
      *fresh = false;
      return *it->second.first;
    }
    while (static_cast<int64_t>(plans_.size()) >= kMaxPlans) {
      plans_.erase(lru_.back());
      lru_.pop_back();
    }
    auto p = std::make_unique<Plan>();
    const auto h = &handle_->h;
    const auto type = cuda_type(dtype_);
    p->h = h;
    check(cusparseLtDenseDescriptorInit(h, &p->b, n, cols_, cols_, 16, type, CUSPARSE_ORDER_ROW),
          "cusparseLtDenseDescriptorInit (x)");
    p->has_b = true;
    check(cusparseLtDenseDescriptorInit(h, &p->d, rows_, n, rows_, 16, type, CUSPARSE_ORDER_COL),
          "cusparseLtDenseDescriptorInit (y)");
    p->has_d = true;
    check(cusparseLtMatmulDescriptorInit(h, &p->mm, CUSPARSE_OPERATION_NON_TRANSPOSE, CUSPARSE_OPERATION_TRANSPOSE,
                                         &a_, &p->b, &p->d, &p->d, CUSPARSE_COMPUTE_32F),
          "cusparseLtMatmulDescriptorInit");
    if (bias_ptr != nullptr) {
      check(cusparseLtMatmulDescSetAttribute(h, &p->mm, CUSPARSELT_MATMUL_BIAS_POINTER, &bias_ptr, sizeof(bias_ptr)),
            "cusparseLtMatmulDescSetAttribute(BIAS_POINTER)");
    }
    check(cusparseLtMatmulAlgSelectionInit(h, &p->alg, &p->mm, CUSPARSELT_MATMUL_ALG_DEFAULT),
          "cusparseLtMatmulAlgSelectionInit");
    p->has_alg = true;
    auto known = searched_.find(bucket_of(n));
    if (known != searched_.end()) {
      int alg_id = known->second;
      check(cusparseLtMatmulAlgSetAttribute(h, &p->alg, CUSPARSELT_MATMUL_ALG_CONFIG_ID, &alg_id, sizeof(alg_id)),
            "cusparseLtMatmulAlgSetAttribute(CONFIG_ID)");
      p->alg_id = alg_id;
    }
    check(cusparseLtMatmulPlanInit(h, &p->plan, &p->mm, &p->alg), "cusparseLtMatmulPlanInit");
    p->has_plan = true;
    ++plan_inits_;
    check(cusparseLtMatmulGetWorkspace(h, &p->plan, &p->workspace), "cusparseLtMatmulGetWorkspace");
    lru_.push_front(key);
    auto& slot = plans_[key];
    slot = {std::move(p), lru_.begin()};
    *fresh = true;
    return *slot.first;
  }

  Handle* handle_ = nullptr;  // per device, lives as long as the process
  cusparseLtMatDescriptor_t a_{};
  bool has_a_ = false;
  int64_t rows_ = 0, cols_ = 0;
  at::ScalarType dtype_ = at::kBFloat16;
  int device_ = 0;
  size_t buffer_size_ = 0;
  at::Tensor compressed_;
  std::map<Key, std::pair<std::unique_ptr<Plan>, std::list<Key>::iterator>> plans_;
  std::list<Key> lru_;
  std::map<int64_t, int> searched_;
  int64_t plan_inits_ = 0, searches_ = 0, compressions_ = 0;
  std::mutex mu_;
};

std::pair<int64_t, int64_t> versions() {
  // (version of the loaded library, version of the header compiled against); needs a CUDA device
  auto h = handle_for(c10::cuda::current_device());
  int version = 0;
  check(cusparseLtGetVersion(&h->h, &version), "cusparseLtGetVersion");
  return {version, CUSPARSELT_VERSION};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.doc() = "hf_sparse: cuSPARSELt 2:4 SpMM with cached plans (one cusparseLtMatmul per call)";
  py::class_<CsltWeight>(mod, "CsltWeight")
      .def(py::init<const at::Tensor&>(), py::arg("weight"),
           "compress a 2:4 (along K) R x K bf16/fp16 weight; R and K multiples of 16")
      .def("compress", &CsltWeight::compress, py::arg("weight"), "recompress new values in place; plans are kept")
      .def("matmul", &CsltWeight::matmul, py::arg("x"), py::arg("bias") = py::none(), py::arg("search") = true,
           "Y = X W^T (+ bias), X (N x K) row-major, N a multiple of 8")
      .def_property_readonly("rows", &CsltWeight::rows)
      .def_property_readonly("cols", &CsltWeight::cols)
      .def("plan_count", &CsltWeight::plan_count, "plans held now")
      .def("plan_inits", &CsltWeight::plan_inits, "cusparseLtMatmulPlanInit calls so far")
      .def("searches", &CsltWeight::searches, "cusparseLtMatmulSearch calls so far")
      .def("compressions", &CsltWeight::compressions, "cusparseLtSpMMACompress2 calls so far")
      .def("algorithms", &CsltWeight::algorithms, "token-count bucket -> algorithm id found by the search")
      .def("compressed", &CsltWeight::compressed, "the compressed buffer (uint8)");
  mod.def("versions", &versions, "(loaded cuSPARSELt version, header version compiled against)");
}
