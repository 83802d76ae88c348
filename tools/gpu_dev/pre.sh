# source me: carried wheels, the prebuilt extensions beside today's Python sources
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 XLA_PYTHON_CLIENT_PREALLOCATE=false
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl >/dev/null 2>&1 || exit 1
cp .gpu/so/*.so src/attnaux/ && ln -sfn ../../introspect src/attnaux/introspect
export PYTHONPATH=/tmp/site:$PWD/.gpu/fa:$PWD/src
python3 -c "import attnaux, attnaux._ffi as f; print('attnaux', attnaux.__file__, 'ext_cuda', f.ext_cuda() is not None)"
