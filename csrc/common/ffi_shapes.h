// Shape helpers shared by the XLA FFI handlers' input checks (CPU and CUDA): shapes in messages,
// shape comparison, absent optional inputs, dtype names.
#ifndef ATTNAUX_CSRC_COMMON_FFI_SHAPES_H_
#define ATTNAUX_CSRC_COMMON_FFI_SHAPES_H_

#include <cstdint>
#include <initializer_list>
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

// "[2, 3]", "[5]": a shape as the CUDA kernels' handlers write it in their messages.
inline std::string BracketShape(Dims dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) {
    if (i > 0) s += ", ";
    s += std::to_string(dims[i]);
  }
  return s + "]";
}

inline bool SameDims(Dims dims, std::initializer_list<int64_t> expected) {
  if (dims.size() != expected.size()) return false;
  size_t i = 0;
  for (int64_t e : expected) {
    if (dims[i++] != e) return false;
  }
  return true;
}

inline bool SameDims(Dims a, Dims b) { return a == b; }

// An optional input is absent when it has shape (0,).
inline bool Absent(Dims dims) { return dims.size() == 1 && dims[0] == 0; }
inline bool Absent(const xla::ffi::AnyBuffer& buffer) { return Absent(buffer.dimensions()); }

// The element types of attnaux's float inputs (q, k, v, logits).
inline bool IsFloat(xla::ffi::DataType t) {
  return t == xla::ffi::DataType::F32 || t == xla::ffi::DataType::BF16 ||
         t == xla::ffi::DataType::F16;
}

inline std::string DtypeName(xla::ffi::DataType t) {
  switch (t) {
    case xla::ffi::DataType::F32:
      return "float32";
    case xla::ffi::DataType::BF16:
      return "bfloat16";
    case xla::ffi::DataType::F16:
      return "float16";
    default:
      return "dtype #" + std::to_string(static_cast<int>(t));
  }
}

// "<target>: <name> must have shape <expected>, got <got>."
inline xla::ffi::Error ShapeError(const std::string& target, const std::string& name,
                                  const std::string& expected, Dims got) {
  return xla::ffi::Error::InvalidArgument(target + ": " + name + " must have shape " + expected +
                                          ", got " + Shape(got) + ".");
}

inline xla::ffi::Error ExpectShape(const std::string& target, const std::string& name, Dims dims,
                                   const std::vector<int64_t>& expected) {
  if (SameDims(dims, expected)) return xla::ffi::Error::Success();
  return ShapeError(target, name, Shape(expected), dims);
}

}  // namespace attnaux

#endif  // ATTNAUX_CSRC_COMMON_FFI_SHAPES_H_
