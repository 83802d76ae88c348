#!/bin/bash
# Builds attnaux._kernels_cuda (cp312, sm_90 + the sm_90a Hopper backward) HERE, on the CPU
# machine, with the pip CUDA toolchain in /tmp/tc/root and a py3.12 venv /tmp/py312 holding
# jaxlib 0.11.2 (the device's) and pybind11; the result goes to .gpu/so for pre.sh.
set -e
cd "$(dirname "$0")/../.."
source tools/gpu_dev/toolchain.sh
O=/tmp/kbuild; mkdir -p $O
INC="-I$R/nvidia/cu13/include -I$R/nvidia/cu13/include/cccl -isystem $FFI -Icsrc"
NV="nvcc -std=c++17 -O3 --diag-suppress=940,2473 -Xcompiler -fPIC,-fvisibility=hidden"
for f in softmax small_seq probs_softmax zero_rows fold_lse; do
  $NV -gencode=arch=compute_90,code=sm_90 -gencode=arch=compute_90,code=compute_90 $INC -c csrc/cuda/$f.cu -o $O/$f.o &
done
for f in hopper_bwd hopper_bwd_packed hopper_fwd hopper_fwd_packed; do
  $NV -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -DNDEBUG -I${CUTLASS_INCLUDE:-.gpu/cutlass/include} $INC -Xptxas -v -c csrc/cuda/$f.cu -o $O/$f.o 2> $O/$f.log &
done
g++ -std=c++17 -O3 -fPIC -fvisibility=hidden -isystem $FFI -Icsrc -c csrc/common/attention_validate.cc -o $O/attention_validate.o &
g++ -std=c++17 -O3 -fPIC -fvisibility=hidden -DATTNAUX_HOPPER_CUDA=1 -isystem $FFI -I$PB -I$PYI -Icsrc -c csrc/cuda/module_kernels_cuda.cc -o $O/module.o &
wait
grep -E "spill|Used" $O/hopper_bwd.log $O/hopper_bwd_packed.log $O/hopper_fwd.log $O/hopper_fwd_packed.log || true
g++ -shared -o $O/_kernels_cuda.cpython-312-x86_64-linux-gnu.so $O/module.o $O/softmax.o $O/small_seq.o $O/probs_softmax.o $O/zero_rows.o $O/fold_lse.o $O/hopper_bwd.o $O/hopper_bwd_packed.o $O/hopper_fwd.o $O/hopper_fwd_packed.o $O/attention_validate.o $R/nvidia/cu13/lib/libcudart_static.a -ldl -lpthread -lrt -Wl,--exclude-libs,ALL
mkdir -p .gpu/so_local && cp $O/_kernels_cuda.cpython-312-x86_64-linux-gnu.so .gpu/so_local/
ls -la .gpu/so_local/
