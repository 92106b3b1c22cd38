export PYTHONPATH=/tmp/site:$PWD MOKGEN_CACHE_DIR=/tmp/mokgen-cache PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null
python3 -c "from mokgen import bwd_gemm; bwd_gemm.build_library()"
T="tests/test_gpu_bwd_gemm.py -k dout_inline"
for v in "MOKGEN_BWD_STORE=held" "MOKGEN_BWD_STORE=held" "MOKGEN_BWD_STORE=held MOKGEN_BWD_TAIL=zero" "MOKGEN_BWD_STORE=held MOKGEN_BWD_STAGGER=0" "MOKGEN_BWD_STORE=held MOKGEN_BWD_STAGGER=1" "MOKGEN_BWD_STORE=buffers"; do
  echo "== $v"; env $v timeout 60 python3 -m pytest -q -x $T -p no:cacheprovider 2>&1 | tail -1
done
echo "== layer step held"; MOKGEN_BWD_STORE=held timeout 90 python3 .ci/ab_variants.py qwen3-30b-a3b:layer --backward --a MOKGEN_BWD_STORE=buffers --b MOKGEN_BWD_STORE=held --blocks 2 2>&1 | tail -2
