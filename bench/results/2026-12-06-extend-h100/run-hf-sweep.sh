set -o pipefail
T0=$(date +%s)
mkdir -p /tmp/site /tmp/hfsite && xz -dc .whl-fa3/fa3.tar.xz | tar xf - -C /tmp/site && export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 || exit 1
xz -dc .whl-hfslim/hfslim.tar.xz | tar xf - -C /tmp/hfsite && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/hfsite .whl-hfslim/*.whl || echo "hf unpack failed"
nvidia-smi --query-gpu=name --format=csv,noheader; echo "install $(( $(date +%s)-T0 ))s"
export FLASHINFER_WORKSPACE_BASE=/tmp/fi
P="python3 -m pytest -v -p no:cacheprovider -rfE"
( PYTHONPATH=/tmp/hfsite:$PYTHONPATH HF_HUB_OFFLINE=1 timeout 150 $P -s tests/test_gpu_hf_graphs.py > $OUT/hf.log 2>&1 ); echo "hf done $(( $(date +%s)-T0 ))s"; grep -E "PASSED|FAILED|ERROR|passed|failed|attnsel varlen|Error:" $OUT/hf.log | cut -c1-250 | tail -12
cp gpu_old/sweep_ext.py /tmp/sweep_ext.py
R=$(( 480 - ($(date +%s)-T0) ))
timeout $R python3 /tmp/sweep_ext.py $OUT/sweep.json > $OUT/sweep.log 2>&1; echo "sweep rc $? $(( $(date +%s)-T0 ))s"
grep -v "^{" $OUT/sweep.log | tail -25 | cut -c1-200; grep "^{" $OUT/sweep.log | tail -1 | cut -c1-1200
