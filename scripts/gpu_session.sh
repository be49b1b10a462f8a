#!/usr/bin/env bash
# A device session's stages, run one after another in a process session of their own, so that the session's
# calls (10 minutes each at most, the machine given back 30 s after one) only start and poll them:
#   scripts/gpu_session.sh start STAGE...   (after every wheel part's install.sh) installs the carried service
#                                           wheels (.svc-wheels) and extra wheels (.whl), starts the stages; the
#                                           call carries .svc-wheels, .whl and sdk/src/deltamesh/v1 (the stubs)
#   scripts/gpu_session.sh wait SECONDS     prints the stages' progress until they end or SECONDS pass, then packs
#                                           every stage's $OUT into $OUT/gpu_session.tar.gz (what comes back)
# Each stage's logs and JSON go to /tmp/gpu-session/STAGE (scripts/gpu_stage.sh's $OUT).
set -u
root=/tmp/gpu-session
case ${1:?start STAGE... or wait SECONDS} in
start)
  shift
  # the gRPC stubs are generated (make protos) and git-ignored: a device call has them only where `carry` names
  # sdk/src/deltamesh/v1; without them every stage that starts a service dies on "No module named deltamesh.v1"
  ls sdk/src/deltamesh/v1/router_pb2.py > /dev/null 2>&1 \
    || { echo "gpu_session: no gRPC stubs: carry sdk/src/deltamesh/v1 (run make protos here first)"; exit 1; }
  mkdir -p "$root"
  for folder in .svc-wheels:/tmp/svc-site .whl:/tmp/extra-site; do
    src=${folder%%:*} dst=${folder#*:}
    ls "$src"/*.whl > /dev/null 2>&1 || continue
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$dst" "$src"/*.whl \
      || exit 1
  done
  export SITE_FIRST=/tmp/svc-site:/tmp/extra-site
  # the stages source the staged packages' env.sh from a copy: a later call need not carry the wheel parts again
  mkdir -p /tmp/gpu-parts/p1 && cp "${GPU_PARTS:-.gpu-wheels/p}"1/env.sh /tmp/gpu-parts/p1/ || exit 1
  export GPU_PARTS=/tmp/gpu-parts/p
  # a word NAME=VALUE among the stages is exported for the stages after it (e.g. SHAPES=qwen3.5-9b g)
  setsid nohup bash -c 'for s in "$@"; do case $s in *=*) export "$s"; continue;; esac; OUT='"$root"'/$s bash scripts/gpu_stage.sh "$s"; done; touch '"$root"'/done' \
    stages "$@" > "$root/session.log" 2>&1 < /dev/null &
  echo "started: $*"
  ;;
wait)
  limit=${2:?seconds}
  shown=0
  for ((t = 0; t < limit; t += 5)); do
    lines=$(wc -l < "$root/session.log")
    ((lines > shown)) && sed -n "$((shown + 1)),${lines}p" "$root/session.log" && shown=$lines
    [ -f "$root/done" ] && break
    sleep 5
  done
  [ -f "$root/done" ] && echo "all stages ended" || echo "still running"
  tar czf "${OUT:?}/gpu_session.tar.gz" -C "$root" --exclude='*.pt' .
  ls -la "$OUT"
  ;;
esac
