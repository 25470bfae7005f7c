set -o pipefail
mkdir -p /tmp/site && xz -dc .whl/fa3.tar.xz | tar xf - -C /tmp/site && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 || exit 1
nvidia-smi --query-gpu=name --format=csv,noheader
P="python3 -m pytest -q -p no:cacheprovider"
timeout 220 $P tests/test_gpu_graph.py -rs 2>&1 | tee $OUT/graph.log | tail -25
timeout 55 python3 scripts/canary_cost.py 2>&1 | tee $OUT/canary_cost.log | tail -12
timeout 45 $P -m gpu tests/test_yardstick.py 2>&1 | tee $OUT/yardstick.log | tail -6
timeout 35 $P tests/test_flash_api_cache.py -k "cuda_graph or new_tokens or window" 2>&1 | tee $OUT/flashapi.log | tail -4
timeout 40 $P tests/test_canary.py -k gpu tests/test_dist_agree.py::test_gpu_device_kind_names_the_gpu 2>&1 | tee $OUT/canary.log | tail -4
