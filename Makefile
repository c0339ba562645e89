# zero: make test (vet + race tests), make demo (the benchmark table on the
# CPU), make bench (go test benchmarks), make cuda / make gpu-test (GPU path).
GO ?= go
SHELL := bash

.PHONY: test demo bench
# Each test's result (and its seed) prints as it finishes; a failure prints
# in full: go test -v without its PAUSE/CONT lines, with the exit status kept.
test:
	$(GO) vet ./...
	set -o pipefail; $(GO) test -race -count=1 -v ./... 2>&1 | grep -v -E '^=== (PAUSE|CONT|NAME)'


demo:
	$(GO) run ./cmd/demo

bench:
	$(GO) test -run '^$$' -bench . -benchtime 5x -count 1 .
# ---- CUDA (issue 3) ---------------------------------------------------------
# `make cuda` builds csrc/libzerocuda.a (the CUDA kernels, the runtime shims
# and the dlopen NCCL loader) and copies the static CUDA runtime beside it,
# so `go build -tags cuda` / `go test -tags cuda -c` need no other flags.
# The toolchain comes from PyPI into .cuda/ (scripts/install-cuda.sh) unless
# CUDA_HOME points at another install with the same layout, or NVCC/CUDA_INC/
# CUDA_LIBDIR/NCCL_INC are given (e.g. a system toolkit:
#   make cuda NVCC=nvcc CUDA_INC=/usr/local/cuda/include CUDA_LIBDIR=/usr/local/cuda/lib64 NCCL_INC=...).
CUDA_HOME   ?= $(CURDIR)/.cuda
CUDA_CU     ?= $(CUDA_HOME)/nvidia/cu13
NVCC        ?= $(CUDA_CU)/bin/nvcc
CUDA_INC    ?= $(CUDA_CU)/include
CUDA_LIBDIR ?= $(CUDA_CU)/lib
NCCL_INC    ?= $(CUDA_HOME)/nvidia/nccl/include
NCCL_LIBDIR ?= $(CUDA_HOME)/nvidia/nccl/lib
HOSTCC      ?= gcc-12
CUDA_ARCH   ?= -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90 \
               -gencode arch=compute_90,code=compute_90
# --fmad=false: no FMA contraction, so the bits match the host C kernels
# (which use -ffp-contract=off); no --use_fast_math (IEEE division, denormals).
NVCCFLAGS   ?= -O3 --fmad=false -std=c++17 -ccbin $(HOSTCC) -Xcompiler -fPIC,-Wall $(CUDA_ARCH)
CUDA_OBJS   := $(patsubst %.cu,%.o,$(wildcard csrc/*.cu)) csrc/nccl.o
# install the PyPI toolchain first when NVCC is the one under CUDA_HOME
CUDA_TOOLCHAIN := $(if $(filter $(CUDA_HOME)/%,$(NVCC)),$(NVCC))

.PHONY: cuda cuda-clean gpu-test
cuda: csrc/libzerocuda.a csrc/libcudart_static.a zero_cuda_stamp.h

$(CUDA_HOME)/nvidia/cu13/bin/nvcc:
	ZERO_CUDA_HOME=$(CUDA_HOME) scripts/install-cuda.sh

csrc/%.o: csrc/%.cu csrc/zero_cuda.h csrc/kernels_dev.cuh elementwise.h | $(CUDA_TOOLCHAIN)
	$(NVCC) $(NVCCFLAGS) -c $< -o $@

csrc/nccl.o: csrc/nccl.c csrc/zero_cuda.h elementwise.h | $(CUDA_TOOLCHAIN)
	$(HOSTCC) -O2 -fPIC -Wall -Wextra -I$(CUDA_INC) -I$(NCCL_INC) -c $< -o $@

csrc/libzerocuda.a: $(CUDA_OBJS)
	rm -f $@ && ar rcs $@ $^

csrc/libcudart_static.a: | $(CUDA_TOOLCHAIN)
	cp $(CUDA_LIBDIR)/libcudart_static.a $@

# The go tool hashes the .h files of the package folder but not the archives
# named in #cgo LDFLAGS; this header (included by cuda.go) carries their
# hash, so a rebuilt library relinks every -tags cuda binary.
zero_cuda_stamp.h: csrc/libzerocuda.a csrc/libcudart_static.a
	@printf '#define ZERO_CUDA_STAMP "%s"\n' "$$(cat $^ | sha256sum | cut -c1-16)" >$@.tmp
	@cmp -s $@.tmp $@ && rm -f $@.tmp || mv $@.tmp $@

cuda-clean:
	rm -f csrc/*.o csrc/libzerocuda.a csrc/libcudart_static.a csrc/emu_test zero_cuda_stamp.h

# `make gpu-test` builds the cuda test binary and the runner into gpu/ (ignored):
# copy gpu/ to a GPU host (no Go needed there) and run gpu/gpu-test.sh.
gpu-test: cuda
	mkdir -p gpu
	go test -tags cuda -c -o gpu/zero.test .
	cp scripts/gpu-test.sh bench/torch_pipeline.py gpu/
	@echo "gpu/ is ready: copy it to a GPU host and run gpu/gpu-test.sh"

# `make cuda-emu` runs the CUDA kernel bodies on the host against the host C
# kernels (csrc/emu_test.cc): no GPU and no CUDA toolchain needed, only g++.
HOSTCXX ?= g++-12
.PHONY: cuda-emu
cuda-emu: csrc/emu_test
	csrc/emu_test

csrc/emu_test: csrc/emu_test.cc csrc/kernels_dev.cuh csrc/zero_cuda.h elementwise.h kernels.c kernels.h
	$(HOSTCC) -O2 -ffp-contract=off -c kernels.c -o csrc/emu_kernels.o
	$(HOSTCXX) -O2 -std=c++17 -ffp-contract=off -Wall -Wno-unknown-pragmas -Icsrc csrc/emu_test.cc csrc/emu_kernels.o -o $@
