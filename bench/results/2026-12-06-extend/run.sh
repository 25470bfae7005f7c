set -o pipefail
T0=$(date +%s)
mkdir -p /tmp/site && xz -dc .whl/fa3.tar.xz | tar xf - -C /tmp/site && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/hfsite .whl-hf/*.whl || echo "hf install failed"
nvidia-smi --query-gpu=name --format=csv,noheader; echo "install $(( $(date +%s)-T0 ))s"
export FLASHINFER_WORKSPACE_BASE=/tmp/fi ATTNSEL_GPU_FLASHINFER=main
P="python3 -m pytest -q -p no:cacheprovider -rfs"
( timeout 140 $P tests/test_gpu_graph.py 2>&1 | tee $OUT/graph.log | tail -12 ) ; echo "graph done $(( $(date +%s)-T0 ))s"
( timeout 50 $P -m gpu tests/test_yardstick.py 2>&1 | tee $OUT/yardstick.log | tail -6 ) ; echo "yard done $(( $(date +%s)-T0 ))s"
( timeout 140 $P -m gpu tests/test_gpu_extend.py 2>&1 | tee $OUT/extend.log | tail -25 ) ; echo "extend done $(( $(date +%s)-T0 ))s"
( timeout 110 $P -s -m gpu tests/test_triton_extend.py 2>&1 | tee $OUT/triton.log | tail -25 ) ; echo "triton done $(( $(date +%s)-T0 ))s"
( timeout 70 $P tests/test_engine_loop.py tests/test_flash_extend.py -k "engine_loop or gpu_mtp" 2>&1 | tee $OUT/engine.log | tail -12 ) ; echo "engine done $(( $(date +%s)-T0 ))s"
R=$(( 585 - ($(date +%s)-T0) ))
( PYTHONPATH=/tmp/hfsite:$PYTHONPATH timeout $R $P -s tests/test_gpu_hf_graphs.py 2>&1 | tee $OUT/hfgraphs.log | tail -12 ) ; echo "hf done $(( $(date +%s)-T0 ))s"
