#!/usr/bin/env bash
# One stage of the GPU measurements, run on the GPU host from the repo root after the wheel parts from
# `../shared/tools/gpu-wheels build --ucx --no-jit-sources` are installed. Logs and JSON go to $OUT.
#   stage a: GPU tests (kernels + whole model) and the whole-model benchmark with its per-kernel profile
#   stage k: the GDN kernel table and the paged-attention launch sweep (one GPU)
#   stage b: the 1P+1D serving sweep (prefill GPU 0, decode GPU 1)
#   stage c: the colocated serving sweep (one GPU)
#   stage t: side channel: phases of a pull (events only vs spinning), UCX's floor, pulls at once, in a row and
#            after an idle gap (as the raw copy's two rows), pulls into changing pages, a decode loop beside them,
#            a prefill loop in the holder beside them (fidelity: stage f or q)
#   stage f: disaggregated vs monolithic greedy fidelity on the two GPUs (+ the bf16 batch-invariance control)
#   stage q: the fp32 fidelity check alone (token-exact), with the decode worker's pull log lines (one GPU or two)
#   stage h: the GPU's idle time between decode steps, async scheduling on and off (35B-A3B and 9B shapes)
#   stage s: colocated serving of the 35B-A3B shape at concurrency 1 and 16, async scheduling on, then off
#   stage p: FP8 weights: the GPU FP8 tests, the FP8 projections against bf16 (with their tile sweep)
#   stage m: FP8 weights: whole 35B-A3B MoE steps and MoE layers, FP8 then bf16
#   stage 8: FP8 weights: colocated serving of the 35B-A3B shape at concurrency 1, 16 and 64
#   stage l: every GPU test, then the linear layers' GEMV against cuBLAS (with its tile sweep)
#   stage d: whole 35B-A3B decode steps, bf16, then FP8 with the one-token GEMV and with cuBLAS instead
#   stage u: multi-turn chat with and without the prefix cache (9B shape, 8k-token conversations)
#   stage o: colocated serving of the 35B-A3B shape at concurrency 1 and 16 (async scheduling)
#   stage r: one long-lived 9B worker (docs/notes/results-history.md, "A worker that slowed tenfold"): 8192/1024 at 16, the
#            same prompts again at 64 (its first 32 are cache hits), then 1024/1024 at 16; SERVE_FLAGS adds serve
#            flags (e.g. --no-prefix-cache); the log has the engine's "engine steps" lines
#   stage x: the mixed step (two 8k prefill chunks beside 63 decodes at 9k context) against its parts alone, with
#            kernel groups: 9B shape, then 35B-A3B (bench/gpu_model.py --mixed); then a lone 8k prompt's first token
#            through the engine loop, prefix cache on and off (--ttft); an eager 16-token step's host launch time
#            and its cProfile (--host-profile)
#   stage A: the async-scheduling GPU tests alone (their piecewise capture failed once on 2026-12-07)
#   stage w: piecewise CUDA graphs: the async-scheduling GPU tests (their piecewise and snapshot tests among them),
#            the host time of 16- and 1024-token prefill steps, eager and piecewise (--host-profile), then 64
#            prompts arriving at once (--burst)
#   stage v: speculative decoding (MTP), under 6 minutes in all: tests/gpu/test_gpu_spec.py (Triton verify kernels,
#            fp32 greedy equality, verify CUDA graphs against eager), then bench/gpu_spec.py on the shapes of $SHAPES
#            (default the 35B-A3B, then the 9B shape): verify steps at K = 1, 2, 3 against the plain decode step at
#            batch 1, 16, 64, 8k context, and the TPOT they project at the published acceptance ($OUT/gpu_spec.json)
#            (SPEC_ARGS adds gpu_spec.py flags, e.g. "--draft-vocab 0,32768": the reduced draft head beside the full one)
#   stage F: fused projections (issue #43): their GPU tests (bf16 tolerance against the float64 reference, graph
#            replay, a model with the fusion on and off), then bench/gpu_fusion.py: each fused op against its two
#            kernels at one token, whole decode steps of the 35B-A3B (bf16, FP8) and 9B shapes at batch 1, 4, 16
#            with the fusion off and on (GPU ms, launches, roofline; the before/after table), the kernels of a
#            fused batch-1 step; at most 350 s, JSON under $OUT
#   stage 1: P/D on one GPU (#44): fp32 greedy fidelity of 1P+1D on GPU 0 (each worker in 0.3 of it) against the
#            monolithic engine; then the 9B shape at 8192/1024 and 1024/1024, concurrency 1, 16, 64: 1P+1D on GPU 0
#            (0.45 + 0.45 of it) next to colocated (0.9), one wave per point, with the pulls of each point from the
#            decode worker's log and every process's GPU memory sampled by nvidia-smi (within 8 minutes; the full
#            run: --waves 4 and no --warm-once, about 25 minutes). In two calls if need be: SETUPS=disagg (or
#            colocated) runs that setup alone, P1_FIDELITY=0 skips the fidelity check
#   stage 1m: (a call of its own, after 1) stage u's multi-turn chats, 9B shape, through 1P+1D on GPU 0 (0.45 + 0.45)
#            with the P/D decider (--pd-direct-max-tokens 256), prefix cache off then on
#   stage T: every GPU test (#47's one run of `pytest -m gpu`), at most 7 minutes
#   stage n: every GPU test but those of stages v and F (penalties, structured outputs, memory budgets among them)
#   stage P: what sampling penalties and structured outputs cost a decode step (#41): the 35B-A3B shape colocated,
#            1024/1024 at concurrency 16 (bench/peers.py), plain, with presence/frequency/repetition penalties on
#            every request, then with a long JSON schema on every request (compare tpot_median_ms); the first shape
#            of $SHAPES if set (the 9B shape on an H100); P_FLAGS: more serve flags
#   stage g: planner profiles (deltamesh profile, one GPU, no transfers) of the shapes in $SHAPES (default the 9B
#            and 35B-A3B shapes, about three minutes each), then bench/plan_check.py gpu on those profiles;
#            PROFILE_ARGS: more profile flags (`--quantization fp8`: the files are named ...-fp8.json)
#   stage R: (CPU only, for the GPU host's 16 cores) the router at scale by simulation (#45), within 300 s: router
#            CPU per streamed token through one router process, gRPC then REST (bench/router_sim.py tokens); 1, 2
#            and 4 router processes in front of 200 + 200 simulated workers, the simulation spread over 4 worker and
#            4 load processes (router_sim.py mesh: do tokens/s grow with the processes?); then the gRPC floor per
#            token, per-request streams against one multiplexed stream (bench/grpc_floor.py), in what time is left
#   stage S: small weights through the GEMV at a few tokens (#43, #42; triton_gemv.small_weight_gemv): the GPU tests
#            of the fused projections, FP8 and speculative decoding, then bench/gpu_spec.py on the first shape of
#            $SHAPES (SPEC_ARGS adds flags, e.g. --quantization fp8 on an H100) at K = 0 and 3, batch 1 and 4, with
#            --small-weight-tokens 0 (off) and then the default; then bench/gpu_linear.py at 1, 2 and 4 tokens (the
#            GEMV against cuBLAS, bf16 and FP8), about 12 minutes on a fresh host;
#            S_AB=0 skips the whole-step A/B (the tests of test_gpu_fp8.py alone, then gpu_linear)
#   stage L: kernels compiled after the warm-up (tests/gpu/test_gpu_late_compiles.py: a burst of many prompt lengths
#            compiles nothing; the log names any kernel that does), under 2 minutes
#   stage W: what counts as a small weight (triton_gemv.SMALL_WEIGHT_BYTES; #43, #42): bench/gpu_spec.py on the
#            first shape of $SHAPES (SPEC_ARGS adds flags: --quantization fp8 on an H100, where FP8 2048-row layers
#            of 8 MiB beat cuBLAS's FP8 GEMM through the GEMV at 2-4 tokens) at K = 0, 1, 3 (W_KS), batch 1, 2, 4
#            (W_BATCHES), once for each size in W_MIB (default "4 8"), about 4 minutes each
#   stage D: programmatic dependent launch (kernels/pdl.py; #43, #42): the probe (bench/gpu_pdl.py: a GEMV + norm
#            chain in one graph, PDL off / on), the GPU tests of the kernels, fused projections, FP8, spec and model
#            with DELTAMESH_PDL=3 (D_TEST_MODE), then bench/gpu_spec.py K = 0 and 3 at batch 1 and 4 (reduced
#            draft head) with DELTAMESH_PDL in D_MODES (default 0 1 2 3) for each shape of $SHAPES (default the
#            9B; SPEC_ARGS adds flags, e.g. --quantization fp8); D_TESTS=0 runs the A/B alone
#   stage V: deltamesh next to vLLM (#43; bench/peers.py, vLLM staged in /tmp/vllm-site as
#            ../shared/notes/peers-on-h200.md says): the first shape of $SHAPES, PEER_LOADS (default 8192:1024) at
#            concurrency PEER_CONC (default 1,16,64), PEER_ARGS added to both engines' runs (e.g.
#            --max-num-batched-tokens 8192, deltamesh's step budget), deltamesh first, then vLLM once /tmp/vllm-site is installed; about
#            13 minutes (span device calls with scripts/gpu_session.sh wait); V_VLLM=0: deltamesh alone (5 minutes)
# GPU_PARTS: the prefix of the staged wheel parts (default .gpu-wheels/p; .gpu-wheels/q for the smaller parts).
# A device call carries at most 64 MiB, the repository's ~11 MB included: build the parts with PART_MB=45 (or
# split a build's chunks into 45 MB pieces: `cat p*/chunk.* | split -b 45M -d -a 2 --numeric-suffixes=1 - chunk.`,
# one per folder qN beside copies of p1's install.sh and env.sh, with install.sh's part count set to theirs).
set -u
stage=${1:?stage a, k, b, c, t, f, q, h, s, p, m, 8, l, d, u, o, r, w, x, v, F, T, n, P, g, 1, 1m, R, S, V or D}
parts=("${GPU_PARTS:-.gpu-wheels/p}"*)
. "${parts[0]}/env.sh" || exit 1
# SITE_FIRST: folders of carried wheels installed with --target (scripts/gpu_session.sh sets it), before the staged
# GPU packages and the host's own
export PYTHONPATH="$PWD/sdk/src:$PWD:${SITE_FIRST:+$SITE_FIRST:}$PYTHONPATH" PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
# SHAPES left unset: both shapes where the GPU holds the 35B-A3B shape's bf16 weights and pools (an H200's 139 GiB),
# the 9B shape alone on a smaller one (an H100's 79 GiB)
gpu_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
if [ -z "${SHAPES:-}" ] && [ -n "$gpu_mib" ] && ((gpu_mib < 100000)); then
  SHAPES=qwen3.5-9b
  echo "gpu_stage: $gpu_mib MiB of GPU memory: SHAPES=$SHAPES"
fi
# h100, h200, ...: in the names of files that hold one GPU's figures (profiles)
gpu_tag=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -o -i 'h[0-9]*' | head -1 | tr H h)
gpu_tag=${gpu_tag:-gpu}

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
  run serve_disagg 590 python bench/disagg_sweep.py --setups disagg --out "$OUT/serve_disagg.json"
  ;;
c)
  run serve_colocated 540 python bench/disagg_sweep.py --setups colocated --out "$OUT/serve_colocated.json"
  ;;
t)
  # The side channel on the GPUs (bench/RESULTS.md): where a pull's time goes (one clock for both processes),
  # UCX's own floors for the same buffers, two pulls at once, pulls into changing pages; a decode loop (9B shape,
  # batch 64 at 4k) beside the pulls, after the side-channel warm-up; a prefill loop in the holder beside them.
  pull=(python bench/transfer.py --device cuda --no-ucx-error-handling --max-tokens 32k --reps 7)
  TAIL=60 run t_pulls 300 "${pull[@]}" --lengths 1k,8k,32k --floor --in-flight 1,2 --sequence 4 --gap-ms 0,20 \
    --spin-ms 0,20 --ucx-proto-info --out "$OUT/t_pulls.json"
  grep -m 8 -E "cuda_ipc|cma|into host memory" "$OUT/t_pulls.log" | cut -c1-200
  # every pull into other pages of the puller's pools, as in a decode worker (above: the same pages every time)
  TAIL=12 run t_pulls_rotate 150 "${pull[@]}" --lengths 1k,8k,32k --spin-ms 20 --rotate 8 --out "$OUT/t_pulls_rotate.json"
  # 300 s: on a fresh host the decode loop's first steps wait for FlashInfer's JIT compilation
  # --warm: the side-channel warm-up a decode worker does when a prefill worker joins, beside the loop too
  TAIL=20 run t_overlap 300 "${pull[@]}" --lengths 1k,32k --spin-ms 0,20 --overlap-model bench/configs/qwen3.5-9b \
    --overlap-batch 64 --overlap-context 4k --warm --out "$OUT/t_overlap.json"
  # the holder's side: a prefill loop (2 x 8k-token chunks per step) beside the pulls from it; every state prepared
  # before the loop starts, so that none of the benchmark's own GPU work runs beside it
  TAIL=16 run t_overlap_prefill 240 "${pull[@]}" --lengths 1k,32k --spin-ms 20 --overlap-model bench/configs/qwen3.5-9b \
    --overlap-side prefill --overlap-batch 2 --overlap-context 8k --offers-first --out "$OUT/t_overlap_prefill.json"
  ;;
f)
  # Disaggregated (GPU 0 -> GPU 1) vs monolithic greedy output, and the bf16 batch-invariance control
  run gpu_fidelity 480 python bench/gpu_fidelity.py --out "$OUT/gpu_fidelity.json" --log-dir /tmp
  run gpu_batch_invariance 240 python bench/gpu_batch_invariance.py --out "$OUT/gpu_batch_invariance.json"
  ;;
q)
  rm -f /tmp/q-logs/*.log && mkdir -p /tmp/q-logs
  run gpu_fidelity_fp32 300 python bench/gpu_fidelity.py --only fp32 --out "$OUT/gpu_fidelity_fp32.json" --log-dir /tmp/q-logs
  grep -h 'state received' /tmp/q-logs/decode-*.log | head -n 3 | cut -c1-400
  echo "pulls: $(grep -h -c 'state received' /tmp/q-logs/decode-*.log)"
  ;;
h)
  TAIL=20 run host_gap 560 python bench/host_gap.py --out "$OUT/host_gap.json"
  ;;
s)
  sweep=(python bench/disagg_sweep.py --setups colocated --model bench/configs/qwen3.5-35b-a3b --concurrency 1,16 --waves 2)
  TAIL=12 run serve_async 290 "${sweep[@]}" --out "$OUT/serve_async.json"
  TAIL=12 run serve_sync 290 "${sweep[@]}" --serve-flag=--no-async-scheduling --out "$OUT/serve_sync.json"
  ;;
p)
  TAIL=15 run gpu_fp8_tests 240 python -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_gpu_fp8.py -rfE
  TAIL=90 run gpu_linear 300 python bench/gpu_linear.py --sweep --out "$OUT/gpu_linear.json"
  ;;
m)
  steps=(python bench/gpu_moe.py --op-tokens 1,4,16,64,256,8192 --batches 1,4,16,64 --context 2048 --prefill 2048)
  TAIL=30 run moe_fp8 280 "${steps[@]}" --quantization fp8 --out "$OUT/gpu_moe_fp8.json"
  TAIL=30 run moe_bf16 280 "${steps[@]}" --out "$OUT/gpu_moe_bf16.json"
  ;;
8)
  TAIL=14 run serve_fp8 580 python bench/disagg_sweep.py --setups colocated --model bench/configs/qwen3.5-35b-a3b \
    --concurrency 1,16,64 --waves 2 --serve-flag=--quantization=fp8 --out "$OUT/serve_fp8.json"
  ;;
l)
  run env 60 python -c "import torch, triton, flashinfer, fla, ucxx; print(torch.__version__, torch.cuda.get_device_name(0), triton.__version__, flashinfer.__version__, ucxx.__version__)"
  TAIL=30 run gpu_tests 330 python -m pytest -q -p no:cacheprovider -m gpu tests/gpu -rfE
  TAIL=100 run gpu_linear 200 python bench/gpu_linear.py --tokens 1,2,4,8,16,4096 --sweep --out "$OUT/gpu_linear.json"
  ;;
d)
  steps=(python bench/gpu_moe.py --moe triton --op-tokens 1 --batches 1,4,16,64 --context 2048 --prefill 2048)
  TAIL=22 run moe_bf16 280 "${steps[@]}" --out "$OUT/gpu_moe_bf16.json"
  TAIL=22 run moe_gemv_fp8 280 "${steps[@]}" --quantization fp8 --gemv-max-tokens 0,1 --out "$OUT/gpu_moe_gemv_fp8.json"
  ;;
u)
  TAIL=30 run multi_turn 580 python bench/multi_turn.py --device cuda --dtype bfloat16 --load-format dummy \
    --model bench/configs/qwen3.5-9b --system-len 6144 --message-len 200 --reply-len 128 --users 8 --turns 3 \
    --vocab 30000 --out "$OUT/multi_turn_gpu_9b.json"
  ;;
o)
  TAIL=12 run serve_colocated_35b 400 python bench/disagg_sweep.py --setups colocated --model bench/configs/qwen3.5-35b-a3b \
    --concurrency 1,16 --waves 2 --out "$OUT/serve_colocated_35b.json"
  ;;
x)
  TAIL=70 run gpu_mixed_9b 300 python bench/gpu_model.py --mixed --profile --out "$OUT/gpu_mixed_9b.json"
  TAIL=70 run gpu_mixed_35b 300 python bench/gpu_model.py --mixed --profile --dense bench/configs/qwen3.5-35b-a3b \
    --out "$OUT/gpu_mixed_35b.json"
  TAIL=12 run gpu_ttft 240 python bench/gpu_model.py --ttft --out "$OUT/gpu_ttft.json"
  TAIL=40 run gpu_host 180 python bench/gpu_model.py --host-profile --out "$OUT/gpu_host.json"
  ;;
A)
  TAIL=20 run gpu_async_tests 300 python -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_gpu_async.py -rfE
  ;;
w)
  TAIL=20 run gpu_async_tests 300 python -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_gpu_async.py -rfE
  TAIL=30 run gpu_host 280 python bench/gpu_model.py --host-profile --out "$OUT/gpu_host.json"
  grep -E "^\|" "$OUT/gpu_host.log" | head -12
  TAIL=8 run gpu_burst 200 python bench/gpu_model.py --burst --out "$OUT/gpu_burst.json"
  ;;
r)
  model=bench/configs/qwen3.5-9b
  python -m deltamesh.services.cli serve --model $model --load-format dummy --device cuda --dtype bfloat16 \
    --grpc-port 18101 --control-port 18102 --http-port 18103 --max-model-len 9232 --max-num-seqs 64 \
    --max-num-batched-tokens 16384 --no-ucx-error-handling --log-level info ${SERVE_FLAGS:-} --colocated \
    --decode-workers 1 --gpus 0 > "$OUT/long_lived.log" 2>&1 &
  server=$!
  for _ in $(seq 300); do
    python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:18103/ready', timeout=2)" 2>/dev/null \
      && break
    sleep 1
  done
  point() {  # point NAME INPUT OUTPUT PROMPTS CONCURRENCY SEED
    TAIL=22 run "long_$1" 200 python bench/serve.py --backend openai --base-url http://127.0.0.1:18103 \
      --model-dir $model --input-len "$2" --output-len "$3" --num-prompts "$4" --max-concurrency "$5" --seed "$6" \
      --num-warmups 1 --disable-tqdm --result-file "$OUT/long_$1.json"
  }
  point a 8192 1024 32 16 5
  point b 8192 1024 128 64 5
  point c 1024 1024 32 16 6
  kill -INT $server; wait $server
  grep "engine steps" "$OUT/long_lived.log" | tail -n 40
  ;;
F)
  # 95 + 255 s at most: under 6 minutes (pytest -v: a test run cut short still shows which tests passed).
  # gpu_fusion.py rewrites its JSON after each unit (a model's steps in one quantization, the 35B-A3B shape's
  # first; then the per-op rows) and starts none that its guess says would end past --budget-s; those it skips
  # are listed in the JSON's "skipped" and the log.
  TAIL=15 run fused_tests 95 python -m pytest -v -p no:cacheprovider -m gpu tests/gpu/test_gpu_fused_linear.py -rfE
  TAIL=90 run gpu_fusion 255 python bench/gpu_fusion.py --kernels --budget-s 235 --out "$OUT/gpu_fusion.json"
  ;;
1)
  # every 2 s, each GPU process's memory: time, pid, MiB, its deltamesh role (the 4th word of its command line)
  (while :; do
    nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits 2>/dev/null |
      while IFS=', ' read -r pid mib; do
        echo "$(date +%s),$pid,$mib,$(tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null | cut -d' ' -f4)"
      done
    sleep 2
  done) > "$OUT/p1_gpu_memory.csv" &
  sampler=$!
  if [ "${P1_FIDELITY:-1}" = 1 ]; then
    rm -rf /tmp/p1-logs && mkdir -p /tmp/p1-logs
    TAIL=3 run p1_fidelity_fp32 110 python bench/gpu_fidelity.py --only fp32 --decode-device cuda:0 \
      --worker-flag=--gpu-memory-utilization=0.3 --out "$OUT/p1_fidelity_fp32.json" --log-dir /tmp/p1-logs
    grep -h 'state received' /tmp/p1-logs/decode-*.log | head -n 2 | cut -c1-300
    echo "pulls: $(cat /tmp/p1-logs/decode-*.log | grep -c 'state received')"
  fi
  setups=${SETUPS:-disagg,colocated}
  TAIL=20 run p1_sweep 360 python bench/disagg_sweep.py --one-gpu --prefill-share 0.45 --decode-share 0.45 \
    --shapes 8192/1024,1024/1024 --concurrency 1,16,64 --warm-once --point-timeout 120 --setups "$setups" \
    --log-dir "$OUT" --out "$OUT/p1_sweep_${setups/,/_}.json"
  kill $sampler
  echo "GPU memory, the most each process held (MiB; the GPU: $(nvidia-smi --query-gpu=memory.total --format=csv,noheader))"
  awk -F, '$3 > m[$2 " " $4] {m[$2 " " $4] = $3} END {for (k in m) print "  pid", k, m[k]}' "$OUT/p1_gpu_memory.csv"
  grep -h '"engine ready"' "$OUT"/serve-*.log | grep -o '"kv_cache_gib": [0-9.]*, "gpu_memory_gib": [0-9.]*, "gpu_memory_utilization": [0-9.]*'
  ;;
1m)
  TAIL=30 run p1_multi_turn 580 python bench/multi_turn.py --setup disagg --device cuda --dtype bfloat16 \
    --load-format dummy --model bench/configs/qwen3.5-9b --system-len 6144 --message-len 200 --reply-len 128 \
    --users 8 --turns 3 --vocab 30000 --serve-flag=--gpus=0 --serve-flag=--prefill-gpu-memory-utilization=0.45 \
    --serve-flag=--decode-gpu-memory-utilization=0.45 --serve-flag=--pd-direct-max-tokens=256 \
    --serve-flag=--no-ucx-error-handling --log-dir "$OUT" --out "$OUT/p1_multi_turn_9b.json"
  ;;
T)
  TAIL=40 run gpu_tests 420 python -m pytest -q -p no:cacheprovider -m gpu tests/gpu -rfE ${N_IGNORE:-}
  ;;
n)
  TAIL=40 run gpu_tests 450 python -m pytest -q -p no:cacheprovider -m gpu tests/gpu -rfE \
    --ignore=tests/gpu/test_gpu_spec.py --ignore=tests/gpu/test_gpu_fused_linear.py ${N_IGNORE:-}
  ;;
P)
  # (SHAPES is the 9B shape on a GPU under 100 GB, above: the 35B-A3B shape needs the H200)
  # P_FLAGS: more flags of deltamesh serve, e.g. SHAPES=qwen3.5-35b-a3b P_FLAGS=--quantization=fp8 on an H100
  shapes=${SHAPES:-qwen3.5-35b-a3b}
  flags=()
  for f in ${P_FLAGS:-}; do flags+=("--deltamesh-flag=$f"); done
  peers=(python bench/peers.py --engines deltamesh --shapes "${shapes%% *}" --loads 1024:1024 --concurrency 16
    --log-dir "$OUT" ${flags[@]+"${flags[@]}"})
  # a run cut by its timeout leaves its mesh (its own process group) holding the GPU: end it before the next
  TAIL=10 run tpot_plain 200 "${peers[@]}" --out "$OUT/tpot_plain.json"
  pkill -9 -f "[d]eltamesh[.]services[.]cli"
  TAIL=10 run tpot_penalties 200 "${peers[@]}" --out "$OUT/tpot_penalties.json" \
    --serve-args='--presence-penalty 1.5 --frequency-penalty 0.5 --repetition-penalty 1.1'
  pkill -9 -f "[d]eltamesh[.]services[.]cli"
  TAIL=10 run tpot_json_schema 200 "${peers[@]}" --serve-args='--json-schema long' --out "$OUT/tpot_json_schema.json"
  pkill -9 -f "[d]eltamesh[.]services[.]cli"
  ;;
g)
  checked=()
  case ${PROFILE_ARGS:-} in *fp8*) weights=-fp8 ;; *) weights= ;; esac
  for shape in ${SHAPES:-qwen3.5-9b qwen3.5-35b-a3b}; do
    file=$OUT/profile-$gpu_tag-$shape$weights.json
    TAIL=40 run "profile_$shape" 300 python -m deltamesh.services.cli profile --model "bench/configs/$shape" \
      --load-format dummy --device cuda --no-transfer ${PROFILE_ARGS:-} --out "$file"
    [ -f "$file" ] && checked+=(--profile "$shape=$file")
  done
  TAIL=40 run plan_check 120 python bench/plan_check.py gpu ${checked[@]+"${checked[@]}"} --out "$OUT/plan_check_gpu.json"
  ;;
R)
  # 80 + 160 s at most, the floor in what is left of 285 s: under 300 s with the last run's shutdown. A run cut by
  # its bound stops its router and simulation on the SIGTERM (router_sim's finally blocks), and mesh's JSON keeps
  # the rows it finished. mesh: 512 streams at 100 tokens/s each offer 51k tokens/s, more than one router process
  # streams (~100 us of CPU a token: ~10k/s), so that tokens/s can grow with the processes; sim_workers_cores and
  # client_cores near 4 in a row mean the simulation, not the router, bounded it.
  run env 20 sh -c 'nproc; uptime; python -c "import grpc, uvloop; print(grpc.__version__)"'
  TAIL=12 run router_tokens 80 python bench/router_sim.py tokens --api grpc,rest --concurrency 64 --max-tokens 256 \
    --duration 10 --worker-processes 2 --client-processes 2 --out "$OUT/router_sim_tokens.json"
  TAIL=16 run router_mesh 160 python bench/router_sim.py mesh --prefill 200 --decode 200 --processes 1,2,4 \
    --worker-processes 4 --client-processes 4 --concurrency 512 --token-rate 100 --max-tokens 128 --duration 10 \
    --idle 3 --ready-timeout 40 --out "$OUT/router_sim_mesh.json"
  left=$((285 - SECONDS)) && ((left > 0)) || left=1  # timeout 0 would mean no limit
  TAIL=16 run grpc_floor "$left" python bench/grpc_floor.py --streams 16,64 --step-rates 50,0 --seconds 3 \
    --warmup 0.5 --out "$OUT/grpc_floor.json"
  ;;
v)
  # One device call of at most 6 minutes: the tests get 150 s, the benchmark what is left of 345 s (its JSON is
  # rewritten after each engine, so a cut run keeps its rows; the 35B-A3B shape, the issue's goal, goes first).
  # SPEC_TESTS=0 skips the tests (stage T ran them before, in the same session); VERIFY_ROWS=1 keeps 60 s for
  # bench/gpu_moe.py's `verify rows` (one request's 2-4 verify rows sharing experts, pair-wise against aligned).
  start=$SECONDS
  [ "${SPEC_TESTS:-1}" = 1 ] && TAIL=30 run gpu_spec_tests 150 python -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_spec.py -rfE
  models=$(for shape in ${SHAPES:-qwen3.5-35b-a3b qwen3.5-9b}; do printf "bench/configs/%s," "$shape"; done)
  rows_s=$((${VERIFY_ROWS:-0} == 1 ? 60 : 0))
  left=$((345 - rows_s - (SECONDS - start))) && ((left > 0)) || left=1  # timeout 0 would mean no limit
  TAIL=60 run gpu_spec "$left" python bench/gpu_spec.py --models "${models%,}" ${SPEC_ARGS:-} \
    --out "$OUT/gpu_spec.json"
  ((rows_s > 0)) && TAIL=40 run verify_rows "$rows_s" python bench/gpu_moe.py --skip-steps --moe triton \
    --op-tokens 1,4 --out "$OUT/gpu_moe_verify_rows.json"
  ;;
S)
  if [ "${S_AB:-1}" = 0 ]; then
    TAIL=30 run small_gemv_tests 200 python -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_gpu_fp8.py -rfE
  else
    TAIL=30 run small_gemv_tests 300 python -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_gpu_fused_linear.py \
      tests/gpu/test_gpu_fp8.py tests/gpu/test_gpu_spec.py -rfE
  fi
  shapes=${SHAPES:-qwen3.5-35b-a3b}
  [ "${S_AB:-1}" = 0 ] || for tokens in 0 4; do
    TAIL=25 run "small_gemv_$tokens" 150 python bench/gpu_spec.py --models "bench/configs/${shapes%% *}" --ks 0,3 \
      --batches 1,4 --draft-vocab 32768 --small-weight-tokens "$tokens" ${SPEC_ARGS:-} --out "$OUT/small_gemv_$tokens.json"
  done
  TAIL=40 run gpu_linear_few 150 python bench/gpu_linear.py --tokens 1,2,4 --out "$OUT/gpu_linear_few.json"
  ;;
L)
  TAIL=30 run late_compiles 150 python -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_gpu_late_compiles.py \
    -rfE -o log_cli=true --log-cli-level=WARNING
  ;;
W)
  shapes=${SHAPES:-qwen3.5-35b-a3b}
  for mib in ${W_MIB:-4 8}; do
    TAIL=30 run "small_weight_${mib}mib" 280 python bench/gpu_spec.py --models "bench/configs/${shapes%% *}" \
      --ks "${W_KS:-0,1,3}" --batches "${W_BATCHES:-1,2,4}" --draft-vocab 32768 --small-weight-mib "$mib" \
      --profile-batch 0 ${SPEC_ARGS:-} --out "$OUT/small_weight_${mib}mib.json"
  done
  ;;
D)
  if [ "${D_TESTS:-1}" = 1 ]; then
    TAIL=12 run gpu_pdl 120 python bench/gpu_pdl.py --out "$OUT/gpu_pdl.json"
    TAIL=30 run pdl_tests 300 env DELTAMESH_PDL=${D_TEST_MODE:-3} python -m pytest -q -p no:cacheprovider -m gpu \
      tests/gpu/test_gpu_kernels.py tests/gpu/test_gpu_fused_linear.py tests/gpu/test_gpu_fp8.py \
      tests/gpu/test_gpu_spec.py tests/gpu/test_gpu_model.py -rfE
  fi
  for shape in ${SHAPES:-qwen3.5-9b}; do
    for on in ${D_MODES:-0 1 2 3}; do
      TAIL=45 run "pdl_steps_${shape}_$on" 240 env DELTAMESH_PDL=$on python bench/gpu_spec.py \
        --models "bench/configs/$shape" --ks 0,3 --batches 1,4 --draft-vocab 32768 ${SPEC_ARGS:-} \
        --out "$OUT/pdl_steps_${shape}_$on.json"
    done
  done
  ;;
V)
  shapes=${SHAPES:-qwen3.5-35b-a3b}
  peers=(python bench/peers.py --shapes "${shapes%% *}" --loads "${PEER_LOADS:-8192:1024}"
    --concurrency "${PEER_CONC:-1,16,64}" --log-dir "$OUT" ${PEER_ARGS:-})
  TAIL=12 run peers_deltamesh 300 "${peers[@]}" --engines deltamesh --out "$OUT/peers_deltamesh.json"
  pkill -9 -f "[d]eltamesh[.]services[.]cli"
  [ "${V_VLLM:-1}" = 0 ] && exit 0  # deltamesh alone (its per-request times are in $OUT/peers-*.json)
  # vLLM's wheel parts may still be arriving (device calls made while the stages run): wait for the last one
  for _ in $(seq 60); do [ -f /tmp/vllm-site/.installed ] && break; sleep 5; done
  TAIL=12 run peers_vllm 540 "${peers[@]}" --engines vllm --out "$OUT/peers_vllm.json"
  pkill -9 -f "[v]llm[.]entrypoints"
  python bench/peers.py --compare "$OUT/peers_deltamesh.json" "$OUT/peers_vllm.json" | tee "$OUT/peers_table.txt"
  ;;
esac
