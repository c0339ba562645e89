//go:build cuda && cgo

package zero

import (
	"sync"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

// NVML queries GPUs through an nvml.Interface: the real library
// (nvml.New(), which dlopens libnvidia-ml.so.1 at Init) or a mock such as
// github.com/NVIDIA/go-nvml/pkg/nvml/mock/dgxh100.
//
// Every call is gated on a successful Init: after a failed Init the real
// library has no symbols loaded, and any further call would kill the process
// with a symbol lookup error, so NVML makes none; it returns the Init error
// instead. NVML is safe for concurrent use.
type NVML struct {
	lib nvml.Interface

	mu      sync.Mutex
	tried   bool
	ok      bool
	initErr error
}

// NewNVML wraps lib; nil means the system library.
func NewNVML(lib nvml.Interface) *NVML {
	if lib == nil {
		lib = nvml.New()
	}
	return &NVML{lib: lib}
}

// Init initialises NVML once; later calls return the first result. Shutdown
// allows a new Init.
func (n *NVML) Init() error {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.initLocked()
}

func (n *NVML) initLocked() error {
	if n.tried {
		return n.initErr
	}
	n.tried = true
	if ret := n.lib.Init(); ret != nvml.SUCCESS {
		n.initErr = nvmlErr("Init", ret)
		return n.initErr
	}
	n.ok = true
	return nil
}

// Memory lists the GPUs with their memory: total, used and free bytes.
// It initialises NVML if no Init was tried yet.
func (n *NVML) Memory() ([]GPUMemory, error) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if err := n.initLocked(); err != nil {
		return nil, err
	}
	count, ret := n.lib.DeviceGetCount()
	if ret != nvml.SUCCESS {
		return nil, nvmlErr("DeviceGetCount", ret)
	}
	out := make([]GPUMemory, 0, count)
	for i := 0; i < count; i++ {
		dev, ret := n.lib.DeviceGetHandleByIndex(i)
		if ret != nvml.SUCCESS {
			return nil, nvmlErr("DeviceGetHandleByIndex", ret)
		}
		m := GPUMemory{Index: i}
		if m.Name, ret = dev.GetName(); ret != nvml.SUCCESS {
			return nil, nvmlErr("GetName", ret)
		}
		if m.UUID, ret = dev.GetUUID(); ret != nvml.SUCCESS {
			return nil, nvmlErr("GetUUID", ret)
		}
		mem, ret := dev.GetMemoryInfo()
		if ret != nvml.SUCCESS {
			return nil, nvmlErr("GetMemoryInfo", ret)
		}
		m.Total, m.Used, m.Free = mem.Total, mem.Used, mem.Free
		out = append(out, m)
	}
	return out, nil
}

// Shutdown releases NVML after a successful Init; otherwise it does nothing.
func (n *NVML) Shutdown() error {
	n.mu.Lock()
	defer n.mu.Unlock()
	if !n.ok {
		n.tried, n.initErr = false, nil
		return nil
	}
	n.ok, n.tried = false, false
	if ret := n.lib.Shutdown(); ret != nvml.SUCCESS {
		return nvmlErr("Shutdown", ret)
	}
	return nil
}

// systemNVML serves the engine's stats: initialised once, never shut down.
var systemNVML = NewNVML(nil)

// GPUMemoryInfo reads every GPU's memory from the system's NVML. On a host
// without the NVIDIA driver it returns an error wrapping ErrNVML.
func GPUMemoryInfo() ([]GPUMemory, error) {
	n := NewNVML(nil)
	defer n.Shutdown()
	return n.Memory()
}

// nvmlErr builds the error of a failed call. The name comes from a table in
// Go, not from nvmlErrorString, which must not be called when Init failed.
func nvmlErr(op string, ret nvml.Return) error {
	return &NVMLError{Code: int(ret), Name: nvmlReturnName(ret), Op: op}
}

func nvmlReturnName(ret nvml.Return) string {
	switch ret {
	case nvml.ERROR_UNINITIALIZED:
		return "ERROR_UNINITIALIZED"
	case nvml.ERROR_INVALID_ARGUMENT:
		return "ERROR_INVALID_ARGUMENT"
	case nvml.ERROR_NOT_SUPPORTED:
		return "ERROR_NOT_SUPPORTED"
	case nvml.ERROR_NO_PERMISSION:
		return "ERROR_NO_PERMISSION"
	case nvml.ERROR_NOT_FOUND:
		return "ERROR_NOT_FOUND"
	case nvml.ERROR_DRIVER_NOT_LOADED:
		return "ERROR_DRIVER_NOT_LOADED"
	case nvml.ERROR_LIBRARY_NOT_FOUND:
		return "ERROR_LIBRARY_NOT_FOUND"
	case nvml.ERROR_FUNCTION_NOT_FOUND:
		return "ERROR_FUNCTION_NOT_FOUND"
	case nvml.ERROR_GPU_IS_LOST:
		return "ERROR_GPU_IS_LOST"
	case nvml.ERROR_LIB_RM_VERSION_MISMATCH:
		return "ERROR_LIB_RM_VERSION_MISMATCH"
	case nvml.ERROR_UNKNOWN:
		return "ERROR_UNKNOWN"
	}
	return "nvmlReturn"
}
