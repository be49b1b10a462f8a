#!/usr/bin/env bash
# One stage of the GPU measurements, run on the GPU host from the repo root after the wheel parts from
# `../shared/tools/gpu-wheels build --ucx --no-jit-sources` are installed. Logs and JSON go to $OUT.
#   stage a: GPU tests (kernels + whole model) and the kernel benchmark (one GPU)
#   stage m: the whole-model benchmark (one GPU)
#   stage b: side-channel transfer GPU0 -> GPU1 and the disaggregated vs colocated serving sweep (two GPUs)
set -u
stage=${1:?stage a or b}
parts=(.gpu-wheels2/p*)
. "${parts[0]}/env.sh" || exit 1
export PYTHONPATH="$PWD/sdk/src:$PWD:$PYTHONPATH" PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"

run() {  # run NAME SECONDS CMD...: bounded, logged, summarised
  local name=$1 limit=$2
  shift 2
  echo "=== $name ($(date -u +%H:%M:%S))"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "--- exit $? ; tail:"
  tail -n "${TAIL:-25}" "$OUT/$name.log"
}

case $stage in
a)
  run env 60 python -c "import torch, triton, flashinfer, fla, ucxx; print(torch.__version__, torch.cuda.get_device_name(0), torch.cuda.device_count(), triton.__version__, flashinfer.__version__, ucxx.__version__)"
  TAIL=30 run gpu_tests 300 python -m pytest -q -p no:cacheprovider -m gpu tests/gpu -rfE
  run gpu_kernels 180 python bench/gpu_kernels.py --out "$OUT/gpu_kernels.json"
  ;;
m)
  run gpu_model 540 python bench/gpu_model.py --out "$OUT/gpu_model.json"
  ;;
b)
  run transfer 150 python bench/transfer.py --device cuda --no-ucx-error-handling --ucx-proto-info \
    --lengths 1k,8k,32k --max-tokens 32k --reps 5 --out "$OUT/transfer_gpu.json"
  grep -m 12 -E "cuda_ipc|cuda_copy|rndv|zcopy" "$OUT/transfer.log" | cut -c1-200
  run serve_sweep 420 python bench/disagg_sweep.py --out "$OUT/serve_sweep.json"
  ;;
esac
