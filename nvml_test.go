//go:build cuda

package zero

import (
	"errors"
	"strings"
	"sync"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/dgxh100"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/server"
)

// TestNVMLMockDGXH100 lists the eight H100s of the DGX mock with their memory.
func TestNVMLMockDGXH100(t *testing.T) {
	srv := dgxh100.New()
	// Pretend GPU 3 holds 10 GiB.
	d3 := srv.Devices[3].(*server.Device)
	d3.MemoryInfo.Used = 10 << 30
	d3.MemoryInfo.Free = d3.MemoryInfo.Total - d3.MemoryInfo.Used

	n := NewNVML(srv)
	if err := n.Init(); err != nil {
		t.Fatal(err)
	}
	mem, err := n.Memory()
	if err != nil {
		t.Fatal(err)
	}
	if len(mem) != 8 {
		t.Fatalf("%d GPUs, want 8", len(mem))
	}
	seen := map[string]bool{}
	for i, m := range mem {
		if m.Index != i || !strings.Contains(m.Name, "H100") || m.Total != 80<<30 || m.UUID == "" || seen[m.UUID] {
			t.Fatalf("GPU %d: %+v", i, m)
		}
		seen[m.UUID] = true
		wantUsed := uint64(0)
		if i == 3 {
			wantUsed = 10 << 30
		}
		if m.Used != wantUsed || (i == 3 && m.Used+m.Free != m.Total) {
			t.Fatalf("GPU %d: used %d free %d, want used %d", i, m.Used, m.Free, wantUsed)
		}
	}
	if err := n.Shutdown(); err != nil {
		t.Fatal(err)
	}
}

// TestNVMLFailedInitMakesNoCalls: after a failed Init no other NVML function
// is called (on the real library each would kill the process): every method
// of this mock but Init is nil and would panic if called.
func TestNVMLFailedInitMakesNoCalls(t *testing.T) {
	lib := &mock.Interface{InitFunc: func() nvml.Return { return nvml.ERROR_LIBRARY_NOT_FOUND }}
	n := NewNVML(lib)
	err := n.Init()
	var ne *NVMLError
	if !errors.Is(err, ErrNVML) || !errors.As(err, &ne) || ne.Name != "ERROR_LIBRARY_NOT_FOUND" || ne.Op != "Init" {
		t.Fatalf("Init: %v", err)
	}
	var wg sync.WaitGroup
	for range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if _, err := n.Memory(); !errors.Is(err, ErrNVML) {
				t.Errorf("Memory after a failed Init: %v", err)
			}
		}()
	}
	wg.Wait()
	if err := n.Shutdown(); err != nil {
		t.Fatalf("Shutdown after a failed Init: %v", err)
	}
	if c := len(lib.InitCalls()); c != 1 {
		t.Fatalf("Init called %d times, want 1", c)
	}
	if len(lib.DeviceGetCountCalls()) != 0 || len(lib.ShutdownCalls()) != 0 {
		t.Fatal("NVML was called after a failed Init")
	}
}

// TestNVMLDeviceErrors: a failing query after a good Init is an NVMLError.
func TestNVMLDeviceErrors(t *testing.T) {
	lib := &mock.Interface{
		InitFunc:           func() nvml.Return { return nvml.SUCCESS },
		DeviceGetCountFunc: func() (int, nvml.Return) { return 0, nvml.ERROR_GPU_IS_LOST },
		ShutdownFunc:       func() nvml.Return { return nvml.SUCCESS },
	}
	n := NewNVML(lib)
	_, err := n.Memory() // initialises on first use
	var ne *NVMLError
	if !errors.As(err, &ne) || ne.Op != "DeviceGetCount" || ne.Name != "ERROR_GPU_IS_LOST" {
		t.Fatalf("Memory: %v", err)
	}
	if err := n.Shutdown(); err != nil || len(lib.ShutdownCalls()) != 1 {
		t.Fatalf("Shutdown after a good Init: %v, %d calls", err, len(lib.ShutdownCalls()))
	}
}

// TestNVMLSystem asks the real NVML: on a host without the NVIDIA driver it
// must fail cleanly with ErrNVML, not kill the process.
func TestNVMLSystem(t *testing.T) {
	mem, err := GPUMemoryInfo()
	if err != nil {
		if !errors.Is(err, ErrNVML) {
			t.Fatalf("GPUMemoryInfo: %v; want an error wrapping ErrNVML", err)
		}
		t.Logf("no NVML here, as expected on a host without a GPU: %v", err)
		return
	}
	for _, m := range mem {
		t.Logf("GPU %d %s: %d MiB used of %d MiB", m.Index, m.Name, m.Used>>20, m.Total>>20)
	}
}
