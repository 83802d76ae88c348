#!/bin/bash
# Makes, on a fresh CPU machine, everything the other scripts here expect (README.md), from PyPI
# alone: ~10 minutes on 2 cores, most of it compiling. Steps already done are skipped, so it can
# be run again after a partial failure. From the repository root:
#
#     bash tools/gpu_dev/bootstrap.sh
#
# - /tmp/py312: Python 3.12 (the device's) with jaxlib/jax 0.11.2 (the device's), pybind11 and
#   the build tools, whose headers the builds name;
# - /tmp/tc/root: the pip CUDA 13.0 toolchain (nvcc, the runtime, CCCL);
# - /tmp/cutlass_hdr, /tmp/cudnnhdr, /tmp/nvrtchdr: the CUTLASS/CuTe, cuDNN and nvrtc headers;
# - /tmp/sass: cuobjdump and nvdisasm (13.5: no 13.0 wheels) for `cuobjdump -sass` here;
# - .gpu/ (git-excluded; `run`'s carry, under 64 MB): the beartype wheel (`whl/`),
#   FlashAttention-3's `dew_flash_attn` with its FA3 library alone and the FA2 load taken out
#   (`fa/`: the FA2 library is over the carry's limit), the cuDNN frontend headers (`fe/`) and the
#   three cp312 extensions (`so/`: `_ext` built by pip, `_ext_cuda` and `_kernels_cuda` by
#   build_ext_cuda.sh and build_kernels.sh).
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
DL=/tmp/gpu_dev_wheels
mkdir -p "$DL" .gpu/whl .gpu/fa .gpu/fe .gpu/so
grep -qx "/.gpu/" .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo "/.gpu/" >> .git/info/exclude; }

py312=$(command -v python3.12 || ls /root/.pyenv/versions/3.12*/bin/python 2>/dev/null | head -1)
if [ ! -x /tmp/py312/bin/python ]; then
  "$py312" -m venv /tmp/py312
  /tmp/py312/bin/pip install -q jaxlib==0.11.2 jax==0.11.2 pybind11 scikit-build-core cmake ninja numpy
fi
if [ ! -x /tmp/tc/root/nvidia/cu13/bin/nvcc ]; then
  python3 -m pip install -q --no-deps --target /tmp/tc/root "nvidia-cuda-nvcc==13.0.*" \
    "nvidia-cuda-runtime==13.0.*" "nvidia-cuda-cccl==13.0.*" "nvidia-nvvm==13.0.*" \
    "nvidia-cuda-crt==13.0.*"
fi
if [ ! -x /tmp/sass/nvidia/cu13/bin/nvdisasm ]; then
  python3 -m pip install -q --no-deps --target /tmp/sass "nvidia-cuda-cuobjdump==13.5.*" \
    "nvidia-cuda-nvdisasm==13.5.*"
fi

# the wheels (for the device's Python 3.12 where it matters)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$DL" \
  "nvidia-cudnn-cu13==9.19.*" "nvidia-cuda-nvrtc==13.0.*" nvidia-cudnn-frontend \
  dew-flash-attn-cu13 beartype nvidia-cutlass
unpack() {  # unpack WHEEL PATTERN INTO: the wheel's files matching PATTERN under INTO
  mkdir -p "$3" && (cd "$3" && unzip -qo "$DL"/$1 "$2")
}
[ -d /tmp/cutlass_hdr/include/cute ] || {
  unpack "nvidia_cutlass-*.whl" "cutlass_library/source/include/*" /tmp/cutlass_unpack
  mkdir -p /tmp/cutlass_hdr && cp -r /tmp/cutlass_unpack/cutlass_library/source/include /tmp/cutlass_hdr/
}
[ -d /tmp/cudnnhdr/nvidia/cudnn/include ] || unpack "nvidia_cudnn_cu13-*.whl" "nvidia/cudnn/include/*" /tmp/cudnnhdr
[ -f /tmp/nvrtchdr/nvidia/cu13/include/nvrtc.h ] || unpack "nvidia_cuda_nvrtc-*.whl" "nvidia/cu13/include/*" /tmp/nvrtchdr
[ -f .gpu/fe/include/cudnn_frontend.h ] || unpack "nvidia_cudnn_frontend-*.whl" "include/*" .gpu/fe
rm -f .gpu/whl/*.whl && cp "$DL"/beartype-*.whl .gpu/whl/
if [ ! -f .gpu/fa/dew_flash_attn/libdew_flash_attn3.so ]; then
  unpack "dew_flash_attn_cu13-*.whl" "dew_flash_attn/__init__.py" .gpu/fa
  unpack "dew_flash_attn_cu13-*.whl" "dew_flash_attn/libdew_flash_attn3.so" .gpu/fa
  python3 - <<'EOF'
path = ".gpu/fa/dew_flash_attn/__init__.py"
text = open(path).read()
fa2 = '_library, _two = _load("libdew_flash_attn.so", "dew_flash_architectures")'
loop = '        for suffix in ("_fwd"'
assert fa2 in text and loop in text, "dew_flash_attn's __init__.py changed: patch it by hand"
text = text.replace(fa2, "_library, _two = None, ()  # the FA2 library is left out (size)")
text = text.replace(loop, "        if library is None:\n            continue\n" + loop, 1)
open(path, "w").write(text)
EOF
fi

# the three extensions
if [ ! -f .gpu/so/_ext.cpython-312-x86_64-linux-gnu.so ]; then
  rm -rf /tmp/b312 /tmp/t312
  /tmp/py312/bin/pip install -q --no-build-isolation --no-deps -C build-dir=/tmp/b312 \
    --target /tmp/t312 .
  cp /tmp/t312/attnaux/_ext.cpython-312-x86_64-linux-gnu.so .gpu/so/
fi
if [ ! -f .gpu/so/_ext_cuda.cpython-312-x86_64-linux-gnu.so ]; then
  bash tools/gpu_dev/build_ext_cuda.sh
  mv .gpu/so_local/_ext_cuda.cpython-312-x86_64-linux-gnu.so .gpu/so/
fi
if [ ! -f .gpu/so/_kernels_cuda.cpython-312-x86_64-linux-gnu.so ]; then
  CUTLASS_INCLUDE=/tmp/cutlass_hdr/include bash tools/gpu_dev/build_kernels.sh
  mv .gpu/so_local/_kernels_cuda.cpython-312-x86_64-linux-gnu.so .gpu/so/
fi
rmdir .gpu/so_local 2>/dev/null || true
cd "$ROOT" && du -sh .gpu && ls .gpu/so
