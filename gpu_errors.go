package zero

import (
	"errors"
	"fmt"
)

// CUDAError is a failed CUDA runtime call. It wraps ErrCUDA, so
// errors.Is(err, ErrCUDA) holds and errors.As(err, &cerr) recovers the code.
type CUDAError struct {
	Code   int    // the cudaError_t value
	Name   string // cudaGetErrorName, e.g. "cudaErrorMemoryAllocation"
	Text   string // cudaGetErrorString
	Op     string // what zero was doing, e.g. "Alloc(1048576 × bf16)"
	Device int    // the device ordinal, -1 when none applies
}

// Error says what failed, where, and what to do about it.
func (e *CUDAError) Error() string {
	dev := ""
	if e.Device >= 0 {
		dev = fmt.Sprintf(" on cuda:%d", e.Device)
	}
	return fmt.Sprintf("%v: %s%s: %s (%d): %s%s", ErrCUDA, e.Op, dev, e.Name, e.Code, e.Text, cudaHint(e.Code))
}

// Unwrap makes errors.Is(err, ErrCUDA) true, and errors.Is(err,
// ErrOutOfMemory) for an allocation the device could not satisfy.
func (e *CUDAError) Unwrap() []error {
	if e.Code == 2 { // cudaErrorMemoryAllocation, CUDA_ERROR_OUT_OF_MEMORY
		return []error{ErrCUDA, ErrOutOfMemory}
	}
	return []error{ErrCUDA}
}

// cudaHint adds what to do for the errors a user can act on.
func cudaHint(code int) string {
	switch code {
	case 2: // cudaErrorMemoryAllocation
		return "; lower BucketBytes or StagingBuffers, or free device memory"
	case 35: // cudaErrorInsufficientDriver
		return "; this host has no NVIDIA driver (libcuda.so.1) new enough for CUDA 12.0 (driver 525.60 or newer)"
	case 100: // cudaErrorNoDevice
		return "; no CUDA-capable device is visible (check CUDA_VISIBLE_DEVICES)"
	case 101: // cudaErrorInvalidDevice
		return "; use a device ordinal below the device count"
	case 700, 716, 719: // illegal address, misaligned address, launch failure
		return "; a kernel touched memory it must not (host memory passed as device memory?); the CUDA context is lost, restart the process"
	}
	return ""
}

// NCCLError is a failed NCCL call, or an error NCCL reported asynchronously
// (the watchdog's ncclCommGetAsyncError). It wraps ErrNCCL.
type NCCLError struct {
	Code int    // the ncclResult_t value
	Name string // e.g. "ncclRemoteError"
	Text string // ncclGetErrorString
	Op   string // e.g. "AllReduce(4096 × bf16, sum)"
	Rank int    // the rank that saw the error
	Last string // ncclGetLastError, when NCCL said more
}

// Error says what failed on which rank, with NCCL's own words.
func (e *NCCLError) Error() string {
	s := fmt.Sprintf("%v: rank %d: %s: %s (%d): %s", ErrNCCL, e.Rank, e.Op, e.Name, e.Code, e.Text)
	if e.Last != "" {
		s += ": " + e.Last
	}
	return s
}

// Unwrap makes errors.Is(err, ErrNCCL) true.
func (e *NCCLError) Unwrap() error { return ErrNCCL }

// ncclResultName names an ncclResult_t value.
func ncclResultName(code int) string {
	names := [...]string{"ncclSuccess", "ncclUnhandledCudaError", "ncclSystemError", "ncclInternalError",
		"ncclInvalidArgument", "ncclInvalidUsage", "ncclRemoteError", "ncclInProgress"}
	if code >= 0 && code < len(names) {
		return names[code]
	}
	return fmt.Sprintf("ncclResult(%d)", code)
}

// ErrNVML is wrapped by the errors of the NVML queries (nvml.go).
var ErrNVML = errors.New("zero: NVML unavailable")

// NVMLError is a failed NVML call. It wraps ErrNVML.
type NVMLError struct {
	Code int    // the nvmlReturn_t value
	Name string // e.g. "ERROR_LIBRARY_NOT_FOUND"
	Op   string // e.g. "Init"
}

// Error says which NVML call failed and why.
func (e *NVMLError) Error() string {
	return fmt.Sprintf("%v: %s: %s (%d)%s", ErrNVML, e.Op, e.Name, e.Code, nvmlHint(e.Name))
}

// Unwrap makes errors.Is(err, ErrNVML) true.
func (e *NVMLError) Unwrap() error { return ErrNVML }

func nvmlHint(name string) string {
	switch name {
	case "ERROR_LIBRARY_NOT_FOUND":
		return "; libnvidia-ml.so.1 is not on this host (no NVIDIA driver), so GPU memory figures are unavailable"
	case "ERROR_DRIVER_NOT_LOADED":
		return "; the NVIDIA kernel driver is not loaded"
	case "ERROR_NO_PERMISSION":
		return "; this user may not query the GPUs"
	}
	return ""
}
