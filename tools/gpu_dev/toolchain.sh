# source me (tools/gpu_dev/build_*.sh): the CPU machine's toolchain for builds the device runs:
# the pip CUDA toolchain in /tmp/tc/root (R, its nvcc on PATH) and a py3.12 venv /tmp/py312
# holding jaxlib 0.11.2 (the device's) and pybind11, whose headers these name (FFI: XLA's FFI,
# PB: pybind11, PYI: Python's). Run from the repository root.
R=/tmp/tc/root; export PATH=$R/nvidia/cu13/bin:$PATH
PY=/tmp/py312/bin/python
FFI=$($PY -c "import jaxlib, os; print(os.path.join(os.path.dirname(jaxlib.__file__), 'include'))")
PB=$($PY -c "import pybind11; print(pybind11.get_include())")
PYI=$($PY -c "import sysconfig; print(sysconfig.get_paths()['include'])")
