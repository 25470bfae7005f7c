# one call: transformers CB with CUDA graphs (5.25, pruned to llama), the graph-contract tests, the Triton extend sweep
set -o pipefail
T0=$(date +%s)
mkdir -p /tmp/site /tmp/hfsite && xz -dc .whl/fa3.tar.xz | tar xf - -C /tmp/site && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 || exit 1
xz -dc .whl-hfslim/hfslim.tar.xz | tar xf - -C /tmp/hfsite || echo "hf unpack failed"
nvidia-smi --query-gpu=name --format=csv,noheader; echo "install $(( $(date +%s)-T0 ))s"
export FLASHINFER_WORKSPACE_BASE=/tmp/fi
P="python3 -m pytest -v -p no:cacheprovider -rfE"
( PYTHONPATH=/tmp/hfsite:$PYTHONPATH HF_HUB_OFFLINE=1 timeout 140 $P -s tests/test_gpu_hf_graphs.py > $OUT/hf.log 2>&1 ); echo "hf done $(( $(date +%s)-T0 ))s"; grep -E "PASSED|FAILED|ERROR|passed|failed|attnsel varlen" $OUT/hf.log | cut -c1-250 | tail -12
( timeout 330 $P tests/test_gpu_graph.py > $OUT/graph.log 2>&1 ) ; echo "graph done $(( $(date +%s)-T0 ))s"
grep -E "PASSED|FAILED|ERROR|passed|failed" $OUT/graph.log | sed 's/^tests.test_gpu_graph.py:://' | cut -c1-160 | tail -60
R=$(( 520 - ($(date +%s)-T0) ))
[ $R -gt 30 ] && timeout $R python3 gpu_old/sweep_ext.py $OUT/sweep.json > $OUT/sweep.log 2>&1; echo "sweep rc $? $(( $(date +%s)-T0 ))s"
grep -v "^{" $OUT/sweep.log | tail -25 | cut -c1-200; grep "^{" $OUT/sweep.log | tail -1 | cut -c1-900
