//go:build !cuda

package zero

import "time"

// This build has no CUDA: the entry points below exist so that code using
// them compiles in both builds, and each returns an error wrapping ErrNoCUDA
// that says how to build with CUDA. The -tags cuda versions are in cuda.go,
// group_cuda.go and nccl_cuda.go.

func noCUDA(what string) error {
	return errorf(ErrNoCUDA, "%s needs the CUDA build: build with `go build -tags cuda` (or `go test -tags cuda`); it needs only a C compiler, and loads the CUDA driver and NCCL at run time", what)
}

// CUDADeviceCount returns the number of CUDA devices this process sees.
func CUDADeviceCount() (int, error) { return 0, noCUDA("CUDADeviceCount") }

// DriverVersion returns the CUDA version the NVIDIA driver supports (built
// with -tags cuda; this build returns ErrNoCUDA).
func DriverVersion() (int, error) { return 0, noCUDA("DriverVersion") }

// CUDA returns the CUDA device with the given ordinal (built with -tags
// cuda; this build returns ErrNoCUDA). The same ordinal always gives the same
// Device. A host without a usable driver gives an error wrapping ErrNoCUDA;
// an ordinal the process does not see, one wrapping ErrDevice (and the CUDA
// error, if any).
//
// zero never allocates or owns the framework's tensors. A Go stack that
// keeps its tensors in CUDA memory and exposes their addresses hands them
// over as they are:
//
//	dev, _ := zero.CUDA(0)                       // the framework's device ordinal
//	stream, _ := zero.CUDAStream(handle, dev)    // its cudaStream_t, as a uintptr
//	grad := zero.RawTensor(ptr, n, zero.BF16)    // its device pointer, as a uintptr
//	ev, err := engine.GradReady(i, grad, stream) // read on that stream, in its order
//
// With gorgonia, ptr is a CUDA-backed tensor's Uintptr() and the stream the
// one its CUDA engine runs on; with a PJRT client, ptr is the buffer's device
// pointer (PJRT_Buffer_UnsafePointer / OpaqueDeviceMemoryDataPointer) and the
// stream the one the client exposes for the device, or a zero stream
// (Device.NewStream, StreamHandle) with events handed back and forth. The
// rules: the memory stays alive and unchanged until the returned event fires
// (work the framework enqueues later on the same stream is ordered after it
// anyway), the stream belongs to the same device, and RawTensor's dtype is
// the tensor's. Host Go slices (Float32s, Halfs) may be copied to and from
// the device (cudaMemcpyDefault), but kernels refuse them with ErrStream: a
// kernel that reads pageable host memory would kill the CUDA context.
func CUDA(ordinal int) (Device, error) { return nil, noCUDA("CUDA") }

// CUDAStream wraps a stream the framework owns (its cudaStream_t as an
// integer) on the CUDA device dev.
func CUDAStream(handle uintptr, dev Device) (Stream, error) { return nil, noCUDA("CUDAStream") }

// StreamHandle returns the cudaStream_t of a CUDA stream as an integer.
func StreamHandle(s Stream) (uintptr, error) { return 0, noCUDA("StreamHandle") }

// NewCUDALocalGroup returns n communicators for n ranks of one process on
// one CUDA device.
func NewCUDALocalGroup(n int, dev Device) ([]Comm, error) {
	return nil, noCUDA("NewCUDALocalGroup")
}

// NewCUDALocalGroupTimeout is NewCUDALocalGroup with a bound on how long a
// collective waits for its peers.
func NewCUDALocalGroupTimeout(n int, dev Device, timeout time.Duration) ([]Comm, error) {
	return nil, noCUDA("NewCUDALocalGroupTimeout")
}

// NewNCCL starts this process's rank of an NCCL communicator.
func NewNCCL(cfg NCCLConfig) (Comm, error) { return nil, noCUDA("NewNCCL") }

// NewNCCLFromEnv is NewNCCL with the config of NCCLConfigFromEnv.
func NewNCCLFromEnv() (Comm, error) { return nil, noCUDA("NewNCCLFromEnv") }

// NCCLVersion loads NCCL (library as in NCCLConfig.Library) and returns its
// version code, e.g. 22707 for 2.27.7.
func NCCLVersion(library string) (int, error) { return 0, noCUDA("NCCLVersion") }

// GPUMemoryInfo reads every GPU's memory from NVML, which this build does
// not include.
func GPUMemoryInfo() ([]GPUMemory, error) { return nil, noCUDA("GPUMemoryInfo") }
