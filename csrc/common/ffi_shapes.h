// Shape helpers shared by the XLA FFI handlers' input checks (CPU and CUDA).
#ifndef ATTNAUX_CSRC_COMMON_FFI_SHAPES_H_
#define ATTNAUX_CSRC_COMMON_FFI_SHAPES_H_

#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace attnaux {

using Dims = xla::ffi::AnyBuffer::Dimensions;

// "(2, 3)", "(5,)": a shape written as Python prints tuples, for error messages.
inline std::string Shape(Dims dims) {
  std::ostringstream os;
  os << "(";
  for (size_t i = 0; i < dims.size(); ++i) os << (i ? ", " : "") << dims[i];
  os << (dims.size() == 1 ? ",)" : ")");
  return os.str();
}

inline std::string Shape(const std::vector<int64_t>& dims) {
  return Shape(Dims(dims.data(), dims.size()));
}

inline bool SameDims(Dims dims, const std::vector<int64_t>& expected) {
  if (dims.size() != expected.size()) return false;
  for (size_t i = 0; i < expected.size(); ++i) {
    if (dims[i] != expected[i]) return false;
  }
  return true;
}

// An optional input is absent when it has shape (0,).
inline bool Absent(Dims dims) { return dims.size() == 1 && dims[0] == 0; }

}  // namespace attnaux

#endif  // ATTNAUX_CSRC_COMMON_FFI_SHAPES_H_
