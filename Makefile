# deltamesh: every target runs inside the repo's own virtualenv (.venv, git-ignored).
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
PYTHON  := $(BIN)/python
PROTO_SRC := protos
PROTO_OUT := sdk/src
TORCH_PIN := torch==2.13.0
# setup-gpu: PyTorch's own index of CUDA builds (cu130 needs an NVIDIA driver for CUDA 13; cu128 runs on 570+)
TORCH_CUDA_INDEX ?= https://download.pytorch.org/whl/cu130
# run / run-gpu: more `deltamesh serve` flags, e.g. ARGS="--model /models/Qwen3.5-9B"
ARGS ?=
# run / run-gpu: the services' log level; warning keeps the terminal to serve's own lines until "mesh ready" and
# problems after it (LOG_LEVEL=info: each request and the engines' step lines; debug: every process's settings too)
LOG_LEVEL ?= warning
# run-gpu: each worker's share of its GPU's memory (1P+1D share GPU 0 unless CUDA_VISIBLE_DEVICES lists more)
GPU_SHARE ?= 0.4

.PHONY: setup setup-gpu protos run run-gpu test lint test-fast test-gpu test-docker reliability bench-cpu bench-transfer bench-multihost bench-soak bench-multi-turn bench-multi-turn-gpu \
	bench-gpu-kernels bench-gpu-model bench-transfer-gpu bench-disagg bench-gpu-fidelity bench-peers bench-host-gap \
	bench-parallel bench-disagg-parallel clean help

help:
	@echo "make setup     create .venv and install everything ($(TORCH_PIN) from pip's index: README, Quickstart)"
	@echo "make run       start the mesh (router + 1 prefill + 1 decode) on the embedded default model"
	@echo "make setup-gpu like setup, with torch built for CUDA ($(TORCH_CUDA_INDEX)) and the GPU kernels"
	@echo "make run-gpu   the mesh on CUDA in bfloat16 (ARGS=\"--model DIR\" for a checkpoint of your own)"
	@echo "make test      run the test suite (what CI runs)"
	@echo "make lint      ruff (lint + format check) and mypy; CI runs it before the tests"
	@echo "make test-docker  build the image offline, run docker-compose.yml's cpu profile and a request (Docker)"
	@echo "make protos    regenerate gRPC stubs from protos/"
	@echo "make reliability  fault-injection and attack suites; rewrites docs/RELIABILITY.md with the measured times"
	@echo "make bench-cpu      CPU engine benchmark (bench/results/engine_cpu.json)"
	@echo "make bench-transfer side-channel transfer benchmark on CPU (bench/results/transfer_cpu.json)"
	@echo "make bench-soak     10-minute soak of the CPU mesh (bench/results/soak_cpu.json)"

$(PYTHON):
	$(PY) -m venv $(VENV)
	$(PYTHON) -m pip install -q --upgrade pip

setup: $(PYTHON)
	@echo "setup 1/4: $(TORCH_PIN)"
	$(PYTHON) -m pip install -q $(TORCH_PIN)
	@echo "setup 2/4: deltamesh and its test tools (about a minute)"
	$(PYTHON) -m pip install -q -e ".[dev]"
	@echo "setup 3/4: gRPC stubs"
	$(MAKE) --no-print-directory protos
	@echo "setup 4/4: the SDK (deltamesh-client)"
	$(PYTHON) -m pip install -q -e sdk
	@echo "setup done: make run | make test"

setup-gpu: $(PYTHON)
	@echo "setup-gpu 1/4: $(TORCH_PIN) built for CUDA, from $(TORCH_CUDA_INDEX)"
	$(PYTHON) -m pip install -q $(TORCH_PIN) --index-url $(TORCH_CUDA_INDEX)
	@echo "setup-gpu 2/4: deltamesh with its GPU kernels (the gpu extra: flashinfer, fla) and test tools"
	$(PYTHON) -m pip install -q -e ".[dev,gpu]"
	@echo "setup-gpu 3/4: gRPC stubs"
	$(MAKE) --no-print-directory protos
	@echo "setup-gpu 4/4: the SDK (deltamesh-client)"
	$(PYTHON) -m pip install -q -e sdk
	$(PYTHON) -c "import torch; assert torch.cuda.is_available(), 'torch sees no CUDA GPU'; print('setup-gpu done:', torch.__version__, torch.cuda.get_device_name(0), '| make run-gpu')"

protos: $(PYTHON)
	$(PYTHON) -m grpc_tools.protoc -I $(PROTO_SRC) \
		--python_out=$(PROTO_OUT) --grpc_python_out=$(PROTO_OUT) --pyi_out=$(PROTO_OUT) \
		$(shell find $(PROTO_SRC) -name '*.proto' | sort)

run:
	$(BIN)/deltamesh serve --log-level $(LOG_LEVEL) $(ARGS)

run-gpu:
	$(BIN)/deltamesh serve --log-level $(LOG_LEVEL) --device cuda --dtype bfloat16 --gpu-memory-utilization $(GPU_SHARE) $(ARGS)

# Every test on 4 pytest-xdist workers, also on 2 cores: the real-process (e2e) tests mostly wait on their meshes.
# An e2e module's tests run on one worker, so that a mesh they share starts once (tests/conftest.py). Then the tests
# that bound wall-clock times (marker `alone`), one at a time; they run when the others failed too.
test:
	$(BIN)/pytest -q -n 4 -m "not alone" --durations=25 tests; status=$$?; \
	$(BIN)/pytest -q -m alone tests/e2e && exit $$status

# mypy checks what pyproject.toml's [tool.mypy] names: deltamesh/ and sdk/src
lint:
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

test-fast:
	$(BIN)/pytest -q -m "not e2e and not fidelity and not fault and not slow"

test-gpu:
	$(BIN)/pytest -q -m gpu

test-docker:  # the image built offline and the cpu profile of docker-compose.yml run for real (.ci/run, after test)
	DELTAMESH_DOCKER_TEST=1 $(BIN)/pytest -q -s -m docker tests/e2e/test_docker.py

reliability:
	DELTAMESH_RELIABILITY_OUT=docs/RELIABILITY.md $(BIN)/pytest -q -m "fault or security"

bench-cpu:
	$(PYTHON) bench/engine_cpu.py --out bench/results/engine_cpu.json

bench-transfer:
	$(PYTHON) bench/transfer.py --out bench/results/transfer_cpu.json

bench-multihost:  # root: state pull times between network namespaces (UCX over TCP) and on one host (bench/RESULTS.md)
	rm -f bench/results/pulls_multihost_cpu.json
	DELTAMESH_PULL_TIMES_OUT=bench/results/pulls_multihost_cpu.json $(BIN)/pytest -q tests/e2e/test_multihost.py -k pull_times

bench-soak:
	$(PYTHON) bench/load_soak.py soak --duration 600 --out bench/results/soak_cpu.json

# GPU figures (one command each; on a GPU host with the packages from gpu-wheels, see bench/RESULTS.md)
bench-gpu-kernels:
	python bench/gpu_kernels.py --out bench/results/gpu_kernels.json
	python bench/gpu_kernels.py --attention --no-gdn --out bench/results/gpu_attention.json

bench-gpu-model:
	python bench/gpu_model.py --out bench/results/gpu_model.json

bench-transfer-gpu:
	python bench/transfer.py --device cuda --no-ucx-error-handling --lengths 1k,8k,32k --max-tokens 32k --reps 7 \
		--floor --in-flight 1,2 --spin-ms 0,20 --out bench/results/transfer_gpu.json
	python bench/transfer.py --device cuda --no-ucx-error-handling --lengths 1k,32k --max-tokens 32k --reps 7 \
		--spin-ms 0,20 --overlap-model bench/configs/qwen3.5-9b --overlap-batch 64 --overlap-context 4k --warm \
		--out bench/results/transfer_overlap_gpu.json
	python bench/transfer.py --device cuda --no-ucx-error-handling --lengths 1k,32k --max-tokens 32k --reps 7 \
		--spin-ms 20 --overlap-model bench/configs/qwen3.5-9b --overlap-side prefill --overlap-batch 2 \
		--overlap-context 8k --out bench/results/transfer_overlap_prefill_gpu.json

bench-disagg:
	python bench/disagg_sweep.py --out bench/results/serve_sweep.json

bench-peers:  # GPU + vLLM staged in /tmp/vllm-site (../shared/notes/peers-on-h200.md): deltamesh next to vLLM
	$(PYTHON) bench/peers.py

bench-host-gap:  # GPU: idle time between decode steps, async scheduling on and off
	$(PYTHON) bench/host_gap.py

bench-parallel:  # 2+ GPUs: the 35B-A3B shape on one rank, tensor/expert parallel and data-parallel attention over two
	python bench/parallel.py --device cuda --model bench/configs/qwen3.5-35b-a3b --load-format dummy --layouts 1,tp2,ep2,dep2 \
		--batch 16 --prompt 8192 --decode-tokens 128 --out bench/results/parallel_gpu.json

bench-disagg-parallel:  # 4 GPUs: 1P+1D of two-GPU data-parallel expert-parallel workers (the recipe's layout) vs one colocated
	python bench/disagg_sweep.py --model bench/configs/qwen3.5-35b-a3b --gpus-per-worker 2 \
		--serve-flag=--data-parallel-size=2 --serve-flag=--enable-expert-parallel --concurrency 16,64,128 \
		--out bench/results/serve_sweep_parallel.json

bench-multi-turn:  # chats with the prefix cache off and on: CPU (default model), then the H200 shape of RESULTS
	$(PYTHON) bench/multi_turn.py --users 12 --turns 3 --out bench/results/multi_turn_cpu_colocated.json

bench-multi-turn-gpu:
	python bench/multi_turn.py --device cuda --dtype bfloat16 --load-format dummy --model bench/configs/qwen3.5-9b \
		--system-len 6144 --message-len 200 --reply-len 128 --users 8 --turns 3 --vocab 30000 \
		--out bench/results/multi_turn_gpu.json

bench-gpu-fidelity:
	python bench/gpu_fidelity.py --out bench/results/gpu_fidelity.json
	python bench/gpu_batch_invariance.py --out bench/results/gpu_batch_invariance.json

clean:
	rm -rf $(VENV) .pytest_cache $(PROTO_OUT)/deltamesh/v1/*_pb2*.py*
