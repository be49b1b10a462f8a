#!/usr/bin/env bash
# One stage of the GPU measurements, run on the GPU host from the repo root after the wheel parts from
# `../shared/tools/gpu-wheels build --ucx --no-jit-sources` are installed. Logs and JSON go to $OUT.
#   stage a: GPU tests (kernels + whole model) and the whole-model benchmark with its per-kernel profile
#   stage k: the GDN kernel table and the paged-attention launch sweep (one GPU)
#   stage b: side-channel transfer GPU0 -> GPU1 (two UCX progress modes) and the 1P+1D serving sweep
#   stage c: the colocated serving sweep (one GPU)
#   stage t: side-channel diagnostics: phases of a pull, UCX's floor, UCX variants, pulls at once
#   stage f: a decode loop beside GPU pulls; disaggregated vs monolithic greedy fidelity on the two GPUs
set -u
stage=${1:?stage a, k, b, c, t or f}
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
  TAIL=120 run gpu_model 420 python bench/gpu_model.py --skip-hf --profile --out "$OUT/gpu_model.json"
  ;;
k)
  run gpu_kernels 180 python bench/gpu_kernels.py --out "$OUT/gpu_kernels.json"
  TAIL=70 run gpu_attention 240 python bench/gpu_kernels.py --attention --no-gdn --out "$OUT/gpu_attention.json"
  ;;
b)
  TAIL=30 run transfer 150 python bench/transfer.py --device cuda --no-ucx-error-handling --ucx-proto-info \
    --lengths 1k,8k,32k --max-tokens 32k --reps 5 --progress-modes thread,thread-polling --out "$OUT/transfer_gpu.json"
  grep -m 12 -E "cuda_ipc|cuda_copy|rndv|zcopy" "$OUT/transfer.log" | cut -c1-200
  run serve_disagg 400 python bench/disagg_sweep.py --setups disagg --out "$OUT/serve_disagg.json"
  ;;
c)
  run serve_colocated 540 python bench/disagg_sweep.py --setups colocated --out "$OUT/serve_colocated.json"
  ;;
t)
  # Where does a pull's time go? Per-phase timestamps on one clock, the same buffers moved by bare busy-polled
  # ucxx messages (UCX's own floor), UCX variants (env reaches both processes), two pulls at once
  # (bench/RESULTS.md, side channel).
  "$(python -c 'import libucx, os; print(os.path.dirname(libucx.__file__))')/bin/ucx_info" -c 2>/dev/null \
    | grep -E "CUDA_IPC|RNDV_(SCHEME|THRESH)|PROTO_ENABLE|MEMTYPE_CACHE" | head -40
  pull=(python bench/transfer.py --device cuda --no-ucx-error-handling --max-tokens 32k --reps 7
    --progress-modes thread-polling)
  TAIL=30 run t_default 180 "${pull[@]}" --lengths 1k,8k,32k --floor --in-flight 1,2 --out "$OUT/t_default.json"
  TAIL=16 run t_tiny 120 "${pull[@]}" --model-config models/deltamesh-tiny --lengths 16,1k --floor --out "$OUT/t_tiny.json"
  for v in UCXPY_ENABLE_DELAYED_SUBMISSION=0 UCX_CUDA_IPC_CACHE=n UCX_RNDV_SCHEME=put_zcopy UCX_PROTO_ENABLE=n; do
    TAIL=14 run "t_${v%%=*}" 120 env "$v" "${pull[@]}" --lengths 1k,32k --floor --out "$OUT/t_${v%%=*}.json"
  done
  ;;
f)
  # A decode loop (9B shape, batch 64 at 4k) beside GPU pulls; disaggregated (GPU 0 -> GPU 1) vs monolithic greedy
  # output, and the bf16 batch-invariance control
  TAIL=12 run t_overlap 240 python bench/transfer.py --device cuda --no-ucx-error-handling --max-tokens 32k --reps 7 \
    --lengths 1k,32k --overlap-model bench/configs/qwen3.5-9b --overlap-batch 64 --overlap-context 4k \
    --out "$OUT/t_overlap.json"
  run gpu_fidelity 480 python bench/gpu_fidelity.py --out "$OUT/gpu_fidelity.json" --log-dir /tmp
  run gpu_batch_invariance 240 python bench/gpu_batch_invariance.py --out "$OUT/gpu_batch_invariance.json"
  ;;
esac
