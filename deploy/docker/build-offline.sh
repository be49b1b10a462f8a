#!/usr/bin/env bash
# Build deltamesh's image where neither an image registry nor PyTorch's index can be reached (CI, an air-gapped
# host): only Debian's packages and a Python package index (or a wheelhouse filled elsewhere) are needed.
#
#   deploy/docker/build-offline.sh                    # deltamesh:cpu
#   EXTRAS=gpu TAG=deltamesh:gpu TORCH_INDEX=https://download.pytorch.org/whl/cu130 deploy/docker/build-offline.sh
#
# 1. The base image: BASE_IMAGE (python:3.11-slim) if it is present or can be pulled; else deltamesh-base:bookworm,
#    made once from Debian's packages (debootstrap --variant=minbase bookworm with python3, python3-venv and make;
#    `docker import`; needs root). Its tarball is kept in the cache.
# 2. The wheelhouse: every wheel the image installs (the pinned torch, the package and SDK with their
#    dependencies, grpcio-tools, pip, setuptools, wheel), downloaded with this machine's pip into the cache, one
#    folder per set of requirements (a hash of the package's and the SDK's dependencies, the extras and the torch
#    pin).
# 3. docker build with pip pointed at the wheelhouse only (PIP_FIND_LINKS=http://127.0.0.1:PORT/ PIP_NO_INDEX=1),
#    served for the length of the build from loopback (hence --network host: the wheelhouse never enters the
#    image or its build context). The classic builder is enough.
#
# Settings (environment): TAG (deltamesh:cpu), EXTRAS (""), BASE_IMAGE (python:3.11-slim), TORCH_INDEX (where
# the wheelhouse's torch comes from; empty: pip's own setup), PYTHON (python3; a Python 3.11 with pip, for
# `pip download`), DELTAMESH_DOCKER_CACHE (.cache/docker, git-ignored). Extra arguments go to `docker build`.
set -euo pipefail
cd "$(dirname "$0")/../.."

TAG=${TAG:-deltamesh:cpu}
EXTRAS=${EXTRAS:-}
BASE_IMAGE=${BASE_IMAGE:-python:3.11-slim}
TORCH_INDEX=${TORCH_INDEX:-}
PYTHON=${PYTHON:-python3}
CACHE=${DELTAMESH_DOCKER_CACHE:-.cache/docker}
OFFLINE_BASE=deltamesh-base:bookworm
TORCH_VERSION=$(sed -n 's/^TORCH_PIN := torch==//p' Makefile)
mkdir -p "$CACHE"

say() { echo "build-offline: $*" >&2; }

base_image() {
    if docker image inspect "$BASE_IMAGE" > /dev/null 2>&1 || timeout 60 docker pull -q "$BASE_IMAGE" > /dev/null 2>&1; then
        echo "$BASE_IMAGE"
        return
    fi
    say "$BASE_IMAGE cannot be pulled: using $OFFLINE_BASE, made from Debian's packages"
    if ! docker image inspect "$OFFLINE_BASE" > /dev/null 2>&1; then
        local tarball="$CACHE/base-bookworm.tar"
        if [ ! -s "$tarball" ]; then
            local root
            root=$(mktemp -d)
            say "debootstrap bookworm (about a minute)"
            debootstrap --variant=minbase --include=python3,python3-venv,make bookworm "$root" \
                http://deb.debian.org/debian > "$CACHE/debootstrap.log" 2>&1 \
                || { say "debootstrap failed: $CACHE/debootstrap.log"; rm -rf "$root"; exit 1; }
            rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
            tar -C "$root" -cf "$tarball.part" . && mv "$tarball.part" "$tarball"
            rm -rf "$root"
        fi
        docker import --change 'ENV LANG=C.UTF-8' "$tarball" "$OFFLINE_BASE" > /dev/null
    fi
    echo "$OFFLINE_BASE"
}

wheelhouse() {
    local key dir
    # the requirements themselves, not the files around them (a new test setting needs no new wheelhouse)
    key=$("$PYTHON" -c 'import sys, tomllib
for path in ("pyproject.toml", "sdk/pyproject.toml"):
    project = tomllib.load(open(path, "rb"))["project"]
    print(sorted(project["dependencies"]), sorted(project.get("optional-dependencies", {}).get(sys.argv[1], [])))
' "$EXTRAS" | cat - <(echo "$EXTRAS $TORCH_VERSION $TORCH_INDEX") | sha256sum | cut -c1-16)
    dir="$CACHE/wheelhouse-$key"
    if [ ! -f "$dir/.complete" ]; then
        say "downloading the wheelhouse into $dir"
        rm -rf "$dir"
        local torch_index=()
        [ -n "$TORCH_INDEX" ] && torch_index=(--extra-index-url "$TORCH_INDEX")
        "$PYTHON" -m pip download -q -d "$dir" "${torch_index[@]}" "torch==$TORCH_VERSION" ".${EXTRAS:+[$EXTRAS]}" ./sdk \
            "grpcio-tools>=1.70" pip "setuptools>=77" wheel >&2
        touch "$dir/.complete"
    fi
    echo "$dir"
}

base=$(base_image)
wheels=$(wheelhouse)
# The wheelhouse's URL is a build arg, and build args are part of Docker's cache key: the same port for the same
# wheelhouse keeps the layers cached (another only if that one is taken).
port=$("$PYTHON" -c 'import socket, sys, zlib
s = socket.socket()
try:
    s.bind(("127.0.0.1", 20000 + zlib.crc32(sys.argv[1].encode()) % 10000))
except OSError:
    s.bind(("127.0.0.1", 0))
print(s.getsockname()[1])' "$wheels")
"$PYTHON" -m http.server --bind 127.0.0.1 --directory "$wheels" "$port" > "$CACHE/wheelhouse-server.log" 2>&1 &
server=$!
trap 'kill $server 2> /dev/null || true' EXIT
for _ in $(seq 50); do
    "$PYTHON" -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$port/')" 2> /dev/null && break
    sleep 0.1
done
say "docker build -t $TAG (base $base, wheelhouse $wheels)"
DOCKER_BUILDKIT=0 docker build --network host -t "$TAG" \
    --build-arg BASE_IMAGE="$base" --build-arg EXTRAS="$EXTRAS" \
    --build-arg PIP_FIND_LINKS="http://127.0.0.1:$port/" --build-arg PIP_NO_INDEX=1 \
    "$@" .
