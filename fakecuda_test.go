//go:build cuda

package zero

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
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

// TestCUDALeavesTheCallersContext: a framework's own context, current on
// the calling thread, is current again after every call into the library,
// which works in the device's primary context meanwhile (the fake refuses
// work with no context current).
func TestCUDALeavesTheCallersContext(t *testing.T) {
	d := fakeCUDA(t)
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	const framework = uintptr(0xf00d) // the fake takes any handle as a context
	if err := setContext(framework); err != nil {
		t.Fatal(err)
	}
	defer setContext(0)
	s, err := d.NewStream()
	if err != nil {
		t.Fatal(err)
	}
	x, err := d.Alloc(1000, FP32)
	if err != nil {
		t.Fatal(err)
	}
	steps := []func() error{
		func() error { return d.zero(s, x) },
		func() error { return d.cast(s, x, x, 2) },
		func() error { _, err := s.Record(); return err },
		s.Sync,
		func() error { return d.Free(x) },
		s.Close,
	}
	for i, step := range steps {
		if err := step(); err != nil {
			t.Fatalf("step %d: %v", i, err)
		}
		if c, err := currentContext(); err != nil || c != framework {
			t.Fatalf("after step %d the thread's context is %#x (%v), want the framework's %#x", i, c, err, framework)
		}
	}
}

// TestCUDAOldDriver: a driver older than CUDA 12.0 is refused with
// ErrNoCUDA naming both versions. The load is kept once it succeeds, so the
// old driver is tried in a process of its own.
func TestCUDAOldDriver(t *testing.T) {
	if os.Getenv("ZERO_OLD_DRIVER_CHILD") == "1" {
		_, err := CUDA(0)
		if !errors.Is(err, ErrNoCUDA) || !strings.Contains(err.Error(), "CUDA 11.8") || !strings.Contains(err.Error(), "12.0") {
			t.Fatalf("CUDA(0) on a CUDA 11.8 driver: %v; want ErrNoCUDA naming 11.8 and 12.0", err)
		}
		t.Logf("as expected: %v", err)
		return
	}
	fakeCUDA(t)
	cmd := exec.Command(os.Args[0], "-test.run", "^TestCUDAOldDriver$", "-test.v")
	cmd.Env = append(os.Environ(), "ZERO_OLD_DRIVER_CHILD=1", "FAKECUDA_DRIVER=11080")
	out, err := cmd.CombinedOutput()
	if err != nil || !strings.Contains(string(out), "as expected") {
		t.Fatalf("the child with an old driver: %v\n%s", err, out)
	}
}
