// HF_CHECK: TORCH_CHECK with a message built without streaming numbers into a std::ostream.
//
// Why: in an extension built on the GPU machines here (g++ 13, torch 2.11's wheel), writing an integer to a
// std::ostream from the extension's own code kills the process (SIGSEGV), and TORCH_CHECK formats its message that
// way (a shape, a size, a group size): the error never reaches Python. Strings, dtypes and devices stream fine
// (benchmarks/RESULTS.md has the probe). So every message is put together here with std::to_string, and TORCH_CHECK
// receives one ready string.
#pragma once

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>

#include <string>
#include <type_traits>

namespace hf_sparse::check {

inline void append(std::string& s, const char* v) { s += v; }
inline void append(std::string& s, const std::string& v) { s += v; }
inline void append(std::string& s, char v) { s += v; }
inline void append(std::string& s, bool v) { s += v ? "true" : "false"; }
template <typename T, std::enable_if_t<std::is_integral_v<T>, int> = 0>
inline void append(std::string& s, T v) {
  s += std::to_string(v);
}
inline void append(std::string& s, double v) { s += std::to_string(v); }
inline void append(std::string& s, c10::IntArrayRef v) {
  s += '[';
  for (size_t i = 0; i < v.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(v[i]);
  }
  s += ']';
}
inline void append(std::string& s, c10::ScalarType v) { s += c10::toString(v); }
inline void append(std::string& s, const c10::Device& v) { s += v.str(); }

template <typename... Args>
std::string message(const Args&... args) {
  std::string s;
  (append(s, args), ...);
  return s;
}

}  // namespace hf_sparse::check

#define HF_CHECK(cond, ...) TORCH_CHECK(cond, ::hf_sparse::check::message(__VA_ARGS__))
