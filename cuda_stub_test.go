//go:build !cuda

package zero

import (
	"errors"
	"strings"
	"testing"
)

// TestCUDAStubs: without -tags cuda every CUDA entry point says how to get it.
func TestCUDAStubs(t *testing.T) {
	_, e1 := CUDA(0)
	_, e2 := CUDADeviceCount()
	_, e3 := CUDAStream(0, CPU())
	_, e4 := StreamHandle(NewHostStream())
	_, e5 := NewCUDALocalGroup(2, CPU())
	_, e6 := NewCUDALocalGroupTimeout(2, CPU(), 0)
	_, e7 := NewNCCL(NCCLConfig{World: 1})
	_, e8 := NewNCCLFromEnv()
	_, e9 := NCCLVersion("")
	_, e10 := GPUMemoryInfo()
	for i, err := range []error{e1, e2, e3, e4, e5, e6, e7, e8, e9, e10} {
		if !errors.Is(err, ErrNoCUDA) || strings.Contains(err.Error(), "make cuda") || !strings.Contains(err.Error(), "-tags cuda") {
			t.Errorf("entry point %d: %v; want ErrNoCUDA saying to build with -tags cuda (make cuda only regenerates the fatbin)", i+1, err)
		}
	}
}
