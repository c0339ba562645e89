# zero: make test (vet + race tests), make demo (the benchmark table on the
# CPU), make bench (go test benchmarks), make cuda / make gpu-test (GPU path).
GO ?= go
SHELL := bash

.PHONY: test demo bench ci
# Each test's result (and its seed) prints as it finishes; a failure prints
# in full: go test -v without its PAUSE/CONT lines, with the exit status kept.
# Every test runs under the race detector, the kernels' sweeps lighter there
# (race_test.go: one ISA level, the parallel split once, not every size);
# then those sweeps, and the checks of C or of the source that skip under
# it, run in full without it (SWEEPS; TestMakeTestSweeps keeps it complete).
# The timeouts fit a 2-core machine under a load of 10 and more (README:
# "How long the commands take"); go test's default, 10 minutes, did not.
SWEEPS := ^(TestConvert|TestFlatten|TestAccumulate|TestCast|TestSumSq|TestReduce|TestAllReduceFused|TestOptimizerKernels|TestKernel|TestNormChunkSums|TestOwnership|TestFileLoops|TestTestRooms|TestDifferentialMatrix)
FILTER := grep -v -E '^=== (PAUSE|CONT|NAME)'
test:
	$(GO) vet ./...
	set -o pipefail; $(GO) test -race -count=1 -timeout 60m -v ./... 2>&1 | $(FILTER)
	set -o pipefail; $(GO) test -count=1 -timeout 30m -v -run '$(SWEEPS)' . 2>&1 | $(FILTER)


demo:
	@echo "make demo: compiling cmd/demo and the host C kernels (the first build takes a few minutes; later ones are cached)"
	$(GO) run ./cmd/demo

bench:
	$(GO) test -run '^$$' -bench . -benchtime 5x -count 1 .

# ci runs what CI runs on a clean clone: .ci/run.
ci:
	bash .ci/run
# ---- CUDA ---------------------------------------------------------------------
# `go build -tags cuda` needs only a C compiler: the driver and NCCL are
# loaded at run time, and the kernels are the committed zero_kernels.fatbin.
# `make cuda` regenerates that fatbin from csrc/kernels.cu with the CUDA 12
# nvrtc and nvFatbin from PyPI (scripts/install-cuda.sh, into .cuda/) and
# writes zero_kernels.stamp; `make check-fatbin` (run by CI) fails when the
# sources no longer match the stamp.
CUDA_HOME ?= $(CURDIR)/.cuda
FATBIN_LIBS := --lib $(CUDA_HOME)/nvidia/cuda_nvrtc/lib --lib $(CUDA_HOME)/nvidia/nvfatbin/lib
KERNEL_SOURCES := csrc/kernels.cu csrc/kernels_dev.cuh cuda_abi.h elementwise.h

.PHONY: cuda check-fatbin gpu-test gpu-rehearse cuda-emu
cuda: zero_kernels.fatbin

$(CUDA_HOME)/.zero-cuda-pins: scripts/install-cuda.sh
	ZERO_CUDA_HOME=$(CUDA_HOME) scripts/install-cuda.sh

zero_kernels.fatbin: $(KERNEL_SOURCES) scripts/build-fatbin.py | $(CUDA_HOME)/.zero-cuda-pins
	python3 scripts/build-fatbin.py $(FATBIN_LIBS)

check-fatbin:
	scripts/check-fatbin.sh

# `make gpu-test` builds the cuda test binary and the runner into gpu/ (ignored):
# copy gpu/ to a GPU host (no Go needed there) and run gpu/gpu-test.sh.
gpu-test:
	mkdir -p gpu
	$(GO) test -tags cuda -c -o gpu/zero.test .
	cp scripts/gpu-test.sh bench/torch_pipeline.py gpu/
	@echo "gpu/ is ready: copy it to a GPU host and run gpu/gpu-test.sh"

# `make gpu-rehearse` runs that runner here against the fake driver: every
# step that makes a GPU figure, at a small shape (the figures mean nothing;
# that each step runs, writes its records and names its skips is the point).
gpu-rehearse: gpu-test
	ZERO_FAKE_CUDA=1 OUT=gpu/rehearsal gpu/gpu-test.sh

# `make cuda-emu` runs the CUDA kernel bodies on the host against the host C
# kernels and a float64 reference (csrc/emu_test.cc): no GPU, only g++.
HOSTCC ?= gcc
HOSTCXX ?= g++
cuda-emu: csrc/emu_test
	csrc/emu_test

csrc/emu_test: csrc/emu_test.cc csrc/emu_launch.h csrc/kernels_dev.cuh cuda_abi.h elementwise.h kernels.c kernels.h
	$(HOSTCC) -O2 -ffp-contract=off -c kernels.c -o csrc/emu_kernels.o
	$(HOSTCXX) -O2 -std=c++17 -ffp-contract=off -Wall -Wno-unknown-pragmas -Icsrc csrc/emu_test.cc csrc/emu_kernels.o -o $@
