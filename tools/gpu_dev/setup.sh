# source me: installs carried wheels, builds attnaux with its CUDA module (and the CuTe backward)
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 XLA_PYTHON_CLIENT_PREALLOCATE=false
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gpu/whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/.gpu/fa
t0=$(date +%s)
python3 -m pip install -q --no-build-isolation --no-deps -C cmake.define.ATTNAUX_CUDA=ON \
  -C cmake.define.CUDNN_FRONTEND_INCLUDE_DIR=$PWD/.gpu/fe/include \
  -C cmake.define.CUTLASS_INCLUDE_DIR=$PWD/.gpu/cutlass/include -C build-dir=/tmp/abuild . > /tmp/build.log 2>&1 || { grep -i "error" /tmp/build.log | head -30; tail -30 /tmp/build.log; exit 1; }
echo "build $(( $(date +%s) - t0 )) s"
grep -i "hopper backward\|CUTLASS" /tmp/build.log | head -3
SP=$(python3 -c "import attnaux,os; print(os.path.dirname(attnaux.__file__))")
mkdir -p .gpu/so && cp $SP/_*.so .gpu/so/ && mkdir -p $OUT/so && cp $SP/_*.so $OUT/so/
export PYTHONPATH=/tmp/site:$PWD/.gpu/fa:$PWD/src
cp .gpu/so/*.so src/attnaux/ && ln -sfn ../../introspect src/attnaux/introspect
python3 -c "import attnaux, attnaux._ffi as f; print('ext_cuda', f.ext_cuda() is not None, 'hopper_bwd', f.has_target('attnaux_hopper_bwd','cuda'))"
