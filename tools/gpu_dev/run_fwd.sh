# the CUDA forward on the device, no build there: first `bash tools/gpu_dev/build_kernels.sh`
# here and copy its _kernels_cuda .so over .gpu/so/ (carry [".gpu"]; README.md)
source tools/gpu_dev/pre.sh || exit 1
export XLA_FLAGS=--xla_gpu_enable_command_buffer=
timeout -k 5 60 python3 tools/gpu_dev/fwd_mc.py 2>&1 | grep -v Warning | tail -4
timeout -k 5 150 python3 -m pytest -q -p xdist -n 8 tests/test_hopper.py -k "kernels_against_float32 and 128" -p no:cacheprovider 2>&1 | tail -3
timeout -k 5 120 python3 tools/gpu_dev/fwd_check.py 4x2048x16x128 1x8192x16x128 2>&1 | grep -v Warning | tail -16
echo "=== memcheck"; timeout -k 5 60 compute-sanitizer --tool memcheck python3 tools/gpu_dev/fwd_mc.py 2>&1 | tail -2
echo "=== racecheck"; timeout -k 5 60 compute-sanitizer --tool racecheck python3 tools/gpu_dev/fwd_mc.py 2>&1 | tail -1
