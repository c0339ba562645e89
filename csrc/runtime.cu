/*
 * runtime.cu: thin shims over the CUDA runtime for cuda.go. Every handle and
 * pointer crosses as a uintptr_t; every entry point that touches a device
 * sets it first (the current device belongs to the OS thread, and a
 * goroutine may run on any thread); every status is returned as the
 * cudaError_t value, which the Go side turns into a *CUDAError.
 */
#include <cuda_runtime.h>
#include <stdint.h>
#include <string.h>

#include "zero_cuda.h"

#define ZC_SET(dev)                                  \
	do {                                         \
		int e_ = (int)cudaSetDevice(dev);    \
		if (e_) return e_;                   \
	} while (0)

extern "C" const char* zc_error_name(int code) {
	switch (code) {
	case ZC_ERR_TOO_MANY_RANKS: return "zeroErrorTooManyRanks";
	case ZC_ERR_BAD_DTYPE: return "zeroErrorBadDType";
	case ZC_ERR_NO_NCCL: return "zeroErrorNoNCCL";
	}
	return cudaGetErrorName((cudaError_t)code);
}

extern "C" const char* zc_error_string(int code) {
	switch (code) {
	case ZC_ERR_TOO_MANY_RANKS: return "more buffers than ZC_MAX_RANKS (32) in one in-process reduction";
	case ZC_ERR_BAD_DTYPE: return "dtype or reduction op code out of range";
	case ZC_ERR_NO_NCCL: return "libnccl.so.2 is not loaded";
	}
	return cudaGetErrorString((cudaError_t)code);
}

extern "C" int zc_device_count(int* n) {
	*n = 0;
	return (int)cudaGetDeviceCount(n);
}

extern "C" int zc_device_props(int dev, char* name, int namelen, int* major, int* minor, uint64_t* total_mem,
                               int* sms) {
	cudaDeviceProp p;
	int err = (int)cudaGetDeviceProperties(&p, dev);
	if (err) return err;
	if (namelen > 0) {
		strncpy(name, p.name, (size_t)namelen - 1);
		name[namelen - 1] = 0;
	}
	*major = p.major;
	*minor = p.minor;
	*total_mem = (uint64_t)p.totalGlobalMem;
	*sms = p.multiProcessorCount;
	return 0;
}

extern "C" int zc_mem_info(int dev, uint64_t* free_bytes, uint64_t* total_bytes) {
	ZC_SET(dev);
	size_t f = 0, t = 0;
	int err = (int)cudaMemGetInfo(&f, &t);
	*free_bytes = f;
	*total_bytes = t;
	return err;
}

extern "C" int zc_device_sync(int dev) {
	ZC_SET(dev);
	return (int)cudaDeviceSynchronize();
}

extern "C" int zc_malloc(int dev, uint64_t bytes, uintptr_t* p) {
	ZC_SET(dev);
	void* q = NULL;
	*p = 0;
	int err = (int)cudaMalloc(&q, (size_t)bytes);
	if (err) return err;
	/* zero it on this thread's default stream and wait for that stream
	 * alone (not the whole device), so the zeros are in place before any
	 * stream touches the buffer */
	err = (int)cudaMemsetAsync(q, 0, (size_t)bytes, cudaStreamPerThread);
	if (!err) err = (int)cudaStreamSynchronize(cudaStreamPerThread);
	if (err) {
		cudaFree(q);
		return err;
	}
	*p = (uintptr_t)q;
	return 0;
}

extern "C" int zc_free(int dev, uintptr_t p) {
	ZC_SET(dev);
	return (int)cudaFree((void*)p);
}

extern "C" int zc_host_alloc(int dev, uint64_t bytes, uintptr_t* p) {
	ZC_SET(dev);
	void* q = NULL;
	*p = 0;
	int err = (int)cudaHostAlloc(&q, (size_t)bytes, cudaHostAllocPortable | cudaHostAllocMapped);
	if (err) return err;
	memset(q, 0, (size_t)bytes);
	*p = (uintptr_t)q;
	return 0;
}

extern "C" int zc_host_free(int dev, uintptr_t p) {
	ZC_SET(dev);
	return (int)cudaFreeHost((void*)p);
}

extern "C" int zc_stream_create(int dev, uintptr_t* s) {
	ZC_SET(dev);
	cudaStream_t st = NULL;
	int err = (int)cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking);
	*s = (uintptr_t)st;
	return err;
}

extern "C" int zc_stream_destroy(int dev, uintptr_t s) {
	ZC_SET(dev);
	return (int)cudaStreamDestroy((cudaStream_t)s);
}

extern "C" int zc_stream_sync(int dev, uintptr_t s) {
	ZC_SET(dev);
	return (int)cudaStreamSynchronize((cudaStream_t)s);
}

extern "C" int zc_stream_wait(int dev, uintptr_t s, uintptr_t e) {
	ZC_SET(dev);
	return (int)cudaStreamWaitEvent((cudaStream_t)s, (cudaEvent_t)e, 0);
}

extern "C" int zc_record(int dev, uintptr_t s, int timing, uintptr_t* e) {
	ZC_SET(dev);
	if (*e) return (int)cudaEventRecord((cudaEvent_t)*e, (cudaStream_t)s); /* re-record a pooled event */
	cudaEvent_t ev = NULL;
	int err = (int)cudaEventCreateWithFlags(&ev, timing ? cudaEventDefault : cudaEventDisableTiming);
	if (err) return err;
	err = (int)cudaEventRecord(ev, (cudaStream_t)s);
	if (err) {
		cudaEventDestroy(ev);
		return err;
	}
	*e = (uintptr_t)ev;
	return 0;
}

extern "C" int zc_event_destroy(int dev, uintptr_t e) {
	ZC_SET(dev);
	return (int)cudaEventDestroy((cudaEvent_t)e);
}

extern "C" int zc_event_sync(int dev, uintptr_t e) {
	ZC_SET(dev);
	return (int)cudaEventSynchronize((cudaEvent_t)e);
}

extern "C" int zc_event_query(int dev, uintptr_t e) {
	ZC_SET(dev);
	return (int)cudaEventQuery((cudaEvent_t)e);
}

extern "C" int zc_event_elapsed(int dev, uintptr_t start, uintptr_t end, float* ms) {
	ZC_SET(dev);
	*ms = 0;
	return (int)cudaEventElapsedTime(ms, (cudaEvent_t)start, (cudaEvent_t)end);
}

extern "C" int zc_memzero(int dev, uintptr_t s, uintptr_t p, uint64_t bytes) {
	if (bytes == 0) return 0;
	ZC_SET(dev);
	return (int)cudaMemsetAsync((void*)p, 0, (size_t)bytes, (cudaStream_t)s);
}

extern "C" int zc_memcpy(int dev, uintptr_t s, uintptr_t dst, uintptr_t src, uint64_t bytes) {
	if (bytes == 0 || dst == src) return 0;
	ZC_SET(dev);
	return (int)cudaMemcpyAsync((void*)dst, (const void*)src, (size_t)bytes, cudaMemcpyDefault, (cudaStream_t)s);
}
