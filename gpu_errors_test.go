package zero

import (
	"errors"
	"fmt"
	"strings"
	"testing"
)

func TestGPUErrorTyping(t *testing.T) {
	var err error = &CUDAError{Code: 2, Name: "cudaErrorMemoryAllocation", Text: "out of memory", Op: "Alloc(1 × fp32)", Device: 3}
	wrapped := fmt.Errorf("%w: CUDA(3): %w", ErrDevice, err)
	var ce *CUDAError
	if !errors.Is(wrapped, ErrCUDA) || !errors.Is(wrapped, ErrDevice) || !errors.As(wrapped, &ce) || ce.Code != 2 {
		t.Fatalf("CUDAError does not unwrap: %v", wrapped)
	}
	for _, want := range []string{"cuda:3", "cudaErrorMemoryAllocation", "(2)", "out of memory", "BucketBytes"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("%q lacks %q", err, want)
		}
	}
	err = &NCCLError{Code: 6, Name: ncclResultName(6), Text: "remote process exited", Op: "AllReduce(8 × bf16, sum)", Rank: 1, Last: "peer 0 gone"}
	var ne *NCCLError
	if !errors.Is(err, ErrNCCL) || errors.Is(err, ErrCUDA) || !errors.As(err, &ne) || ne.Name != "ncclRemoteError" {
		t.Fatalf("NCCLError: %v", err)
	}
	if !strings.Contains(err.Error(), "peer 0 gone") || !strings.Contains(err.Error(), "rank 1") {
		t.Errorf("%q", err)
	}
	if ncclResultName(99) != "ncclResult(99)" || ncclResultName(7) != "ncclInProgress" {
		t.Error("ncclResultName")
	}
	err = &NVMLError{Code: 12, Name: "ERROR_LIBRARY_NOT_FOUND", Op: "Init"}
	if !errors.Is(err, ErrNVML) || !strings.Contains(err.Error(), "libnvidia-ml") {
		t.Fatalf("NVMLError: %v", err)
	}
}

func TestAllocPinnedCPU(t *testing.T) {
	p, err := AllocPinned(CPU(), 1000, BF16)
	if err != nil {
		t.Fatal(err)
	}
	if p.Len() != 1000 || p.DType() != BF16 || p.Ptr() == 0 || p.Ptr()%64 != 0 {
		t.Fatalf("pinned tensor %+v", p)
	}
	for _, b := range p.hostBytes() {
		if b != 0 {
			t.Fatal("pinned memory is not zeroed")
		}
	}
	if err := FreePinned(CPU(), p); err != nil {
		t.Fatal(err)
	}
	if _, err := AllocPinned(CPU(), -1, FP32); !errors.Is(err, ErrConfig) {
		t.Errorf("negative count: %v", err)
	}
	if _, err := AllocPinned(CPU(), 1, DType(9)); !errors.Is(err, ErrConfig) {
		t.Errorf("bad dtype: %v", err)
	}
	if _, err := AllocPinned(nil, 1, FP32); !errors.Is(err, ErrConfig) {
		t.Errorf("nil device: %v", err)
	}
	if err := FreePinned(nil, p); !errors.Is(err, ErrConfig) {
		t.Errorf("nil device: %v", err)
	}
}
