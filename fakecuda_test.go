//go:build cuda

package zero

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
)

// With ZERO_FAKE_CUDA=1 the CUDA tests run against a fake libcuda.so.1
// over host memory (testdata/fakecuda), built here with g++ and loaded
// through ZERO_CUDA_LIBRARY: the loader, the contexts, streams, events,
// the descriptor ring and every launch run without a GPU, the kernels
// emulated from their own source. Run from the repository root.
func TestMain(m *testing.M) {
	if os.Getenv("ZERO_FAKE_CUDA") == "1" && os.Getenv("ZERO_CUDA_LIBRARY") == "" {
		lib, err := buildFakeCUDA()
		if err != nil {
			fmt.Fprintln(os.Stderr, "fake libcuda:", err)
			os.Exit(2)
		}
		os.Setenv("ZERO_CUDA_LIBRARY", lib)
		fmt.Fprintln(os.Stderr, "CUDA tests run against the fake driver", lib)
	}
	os.Exit(m.Run())
}

func buildFakeCUDA() (string, error) {
	dir, err := os.MkdirTemp("", "zero-fakecuda")
	if err != nil {
		return "", err
	}
	lib := filepath.Join(dir, "libcuda.so.1")
	cxx := os.Getenv("CXX")
	if cxx == "" {
		cxx = "g++"
	}
	out, err := exec.Command(cxx, "-std=c++17", "-O1", "-shared", "-fPIC", "-ffp-contract=off", "-Wno-unknown-pragmas",
		"-I.", "-Icsrc", "testdata/fakecuda/fakecuda.cc", "-o", lib, "-lpthread").CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("%v: %s", err, out)
	}
	return lib, nil
}

// fakeCUDA skips a test that needs the fake driver's hooks.
func fakeCUDA(t *testing.T) *cudaDevice {
	t.Helper()
	if os.Getenv("ZERO_FAKE_CUDA") != "1" {
		t.Skip("runs against the fake driver only (ZERO_FAKE_CUDA=1)")
	}
	return needCUDA(t)
}
