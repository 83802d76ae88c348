// `attnaux_zero_rows` on CUDA: x[t] = 0 for every row t with keep[t] == 0, in place (the result
// aliases x). The packed-sequence (THD) path uses it after cuDNN, whose ragged layout writes only
// the tokens that some sequence covers: the outputs and gradients of padding tokens are set to 0
// here, touching only those rows (a `where` over the whole tensor would cost a full read and write
// of it; this costs one byte per token where every token is covered).
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "cuda/ffi_utils.cuh"
#include "cuda/kernels_cuda.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace attnaux_cuda_kernels {
namespace {

// A block per kRowsPerBlock rows, a thread reading each row's flag; a block whose rows are all
// kept returns at once (one block per row took 12.5 us on an H100 for 16384 kept rows of 4 KiB,
// its launches alone). The rows to zero are written by the whole block, in 16-byte words where
// the row's byte count allows it (x's base is aligned by XLA), else bytewise.
constexpr int kRowsPerBlock = 128;  // also the block's threads

__global__ void ZeroRowsKernel(uint8_t* x, const bool* keep, int64_t rows, int64_t row_bytes) {
  __shared__ bool zero_row[kRowsPerBlock];
  const int64_t first =
      (blockIdx.x + static_cast<int64_t>(blockIdx.y) * gridDim.x) * kRowsPerBlock;
  const int64_t own = first + threadIdx.x;
  const bool zero = own < rows && !keep[own];
  zero_row[threadIdx.x] = zero;
  if (!__syncthreads_or(zero)) return;  // (also orders the flags' stores before the reads)
  for (int r = 0; r < kRowsPerBlock; ++r) {
    if (!zero_row[r]) continue;
    uint8_t* base = x + (first + r) * row_bytes;
    if (row_bytes % 16 == 0) {
      auto* words = reinterpret_cast<uint4*>(base);
      for (int64_t i = threadIdx.x; i < row_bytes / 16; i += blockDim.x) {
        words[i] = uint4{0, 0, 0, 0};
      }
    } else {
      for (int64_t i = threadIdx.x; i < row_bytes; i += blockDim.x) base[i] = 0;
    }
  }
}

ffi::Error ZeroRowsImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::PRED> keep,
                        ffi::Result<ffi::AnyBuffer> y) {
  const char* target = "attnaux_zero_rows";
  const auto dims = x.dimensions();
  if (dims.size() < 1) return AttnInvalid(target, "x must have a leading row dim.");
  const int64_t rows = dims[0];
  if (keep.dimensions().size() != 1 || keep.dimensions()[0] != rows) {
    return AttnInvalid(target,
                       "keep must be bool [" + std::to_string(rows) + "] (one per row of x).");
  }
  if (y->untyped_data() != x.untyped_data()) {
    return AttnInvalid(target, "the result must alias x (input_output_aliases={0: 0}).");
  }
  if (rows == 0 || x.size_bytes() == 0) return ffi::Error::Success();
  const int64_t row_bytes = static_cast<int64_t>(x.size_bytes()) / rows;
  constexpr int64_t kMaxGridX = 65535;
  const int64_t blocks = (rows + kRowsPerBlock - 1) / kRowsPerBlock;
  const dim3 grid(static_cast<unsigned>(blocks < kMaxGridX ? blocks : kMaxGridX),
                  static_cast<unsigned>((blocks + kMaxGridX - 1) / kMaxGridX));
  ZeroRowsKernel<<<grid, kRowsPerBlock, 0, stream>>>(static_cast<uint8_t*>(y->untyped_data()),
                                           keep.typed_data(), rows, row_bytes);
  return CudaResult(target, cudaGetLastError());
}

}  // namespace
}  // namespace attnaux_cuda_kernels

XLA_FFI_DEFINE_HANDLER_SYMBOL(AttnauxZeroRowsCuda, attnaux_cuda_kernels::ZeroRowsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()          // x [rows, ...]
                                  .Arg<ffi::Buffer<ffi::PRED>>()  // keep [rows]
                                  .Ret<ffi::AnyBuffer>(),         // x, rows with !keep zeroed
                              {ffi::Traits::kCmdBufferCompatible});
