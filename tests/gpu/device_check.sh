#!/usr/bin/env bash
# The GPU-node check of the memory index, run through the device tool on a CUDA machine (never in CI).
#
# Carried folder .gpu/: wheels (faiss-gpu, nvidia-cuda-runtime-cu12), and shim/ from
# tests/gpu/cublas12_shim/build.sh for nodes whose image has cuBLAS 13 only. A wheel larger than one
# transfer arrives in parts (split -b, NAME.whl.part-aa, -ab, ...): earlier calls copy theirs into
# /tmp/parts with `mkdir -p /tmp/parts && cp .gpuN/* /tmp/parts/` while the machine stays warm.
set -u
mkdir -p /tmp/wheels /tmp/parts
cp .gpu/*.whl /tmp/wheels/ 2>/dev/null
cp .gpu/*.part-* /tmp/parts/ 2>/dev/null
for first in /tmp/parts/*.whl.part-aa; do
  [ -e "$first" ] && cat "${first%-aa}"-* > "/tmp/wheels/$(basename "${first%.part-aa}")"
done
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  /tmp/wheels/*.whl || exit 1
export PYTHONPATH=/tmp/site:services PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
# faiss-gpu preloads libcublas.so.12 / libcublasLt.so.12 from nvidia/cublas/lib and libcurand.so.10 from
# nvidia/curand/lib; give it the shim and the node's own curand where the cu12 wheels are absent.
if [ -z "$(find / -xdev -name 'libcublas.so.12' -not -path '*/.gpu/*' 2>/dev/null | head -1)" ]; then
  cublas13="$(find / -xdev -name 'libcublas.so.13' 2>/dev/null | head -1)"
  echo "no libcublas.so.12 on this node: forwarding to $cublas13 through the test shim"
  mkdir -p /tmp/site/nvidia/cublas/lib && cp .gpu/shim/* /tmp/site/nvidia/cublas/lib/
  export LD_LIBRARY_PATH="$(dirname "$cublas13"):${LD_LIBRARY_PATH:-}"
fi
if [ ! -d /tmp/site/nvidia/curand/lib ]; then
  mkdir -p /tmp/site/nvidia/curand/lib
  ln -sf "$(find / -xdev -name 'libcurand.so.10' 2>/dev/null | head -1)" /tmp/site/nvidia/curand/lib/
fi
python3 -c "import faiss; print('faiss', faiss.__version__, 'GPUs', faiss.get_num_gpus())" || exit 2
python3 -m pytest -q -p no:cacheprovider -c /dev/null --rootdir tests/gpu tests/gpu 2>&1 | tail -5
for dev in cpu gpu; do
  python3 -m mars_tools.bench.memory_load --device "$dev" --no-ingest --searches 20000 --writes 5000
done
