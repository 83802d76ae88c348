#!/bin/bash
# Builds attnaux._ext_cuda (the cuDNN handlers: csrc/cuda/module_cuda.cc, flash_cuda.cc) HERE,
# on the CPU machine, for cp312 and the device's jaxlib 0.11.2: the same flags as CMake's target
# (the frontend loads cuDNN, the CUDA runtime and nvrtc with dlopen, so nothing CUDA is linked).
# Headers: jaxlib's FFI and pybind11 from the py3.12 venv /tmp/py312, the carried cuDNN frontend
# (.gpu/fe/include), cuDNN's from its pip wheel (CUDNN_INCLUDE, default
# /tmp/cudnnhdr/nvidia/cudnn/include: `pip download --no-deps nvidia-cudnn-cu13==9.19.*` and
# unzip its nvidia/cudnn/include), nvrtc's from its wheel (NVRTC_INCLUDE, default
# /tmp/nvrtchdr/nvidia/cu13/include) and the CUDA runtime's from the pip toolchain
# (tools/gpu_dev/toolchain.sh).
# The C++ runtime is linked statically and kept local, as CMakeLists.txt explains. The result goes
# to .gpu/so_local; copy it over .gpu/so/ for tools/gpu_dev/pre.sh.
set -e
cd "$(dirname "$0")/../.."
source tools/gpu_dev/toolchain.sh
O=/tmp/ebuild; mkdir -p $O
INC="-isystem $FFI -isystem ${CUDNN_INCLUDE:-/tmp/cudnnhdr/nvidia/cudnn/include}"
INC="$INC -isystem .gpu/fe/include -isystem ${NVRTC_INCLUDE:-/tmp/nvrtchdr/nvidia/cu13/include}"
INC="$INC -isystem $R/nvidia/cu13/include -I$PB -I$PYI -Icsrc"
CXX="g++ -std=c++17 -O2 -fPIC -fvisibility=hidden -DNV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING"
CXX="$CXX -DCUDNN_FRONTEND_SKIP_JSON_LIB -Wall -Wno-unused-parameter -Wno-unused-function"
$CXX $INC -c csrc/cuda/module_cuda.cc -o $O/module_cuda.o &
$CXX $INC -c csrc/cuda/flash_cuda.cc -o $O/flash_cuda.o &
wait
g++ -shared -o $O/_ext_cuda.cpython-312-x86_64-linux-gnu.so $O/module_cuda.o $O/flash_cuda.o \
  -ldl -lpthread -static-libstdc++ -static-libgcc -Wl,--exclude-libs,ALL
mkdir -p .gpu/so_local && cp $O/_ext_cuda.cpython-312-x86_64-linux-gnu.so .gpu/so_local/
ls -la .gpu/so_local/
