/*
 * cuda_api.h: the few types and functions of the CUDA driver API and of NCCL
 * that zero uses, declared here from their documented ABI, so that building
 * with -tags cuda needs no CUDA or NCCL header. Both libraries are opened at
 * run time with dlopen (libcuda.so.1, libnccl.so.2); these declarations are
 * the types of the function pointers, never linked against.
 */
#ifndef ZERO_CUDA_API_H
#define ZERO_CUDA_API_H

#include <stddef.h>
#include <stdint.h>

/* ---- CUDA driver API --------------------------------------------------------- */

typedef int CUresult; /* enum cudaError_enum */
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef struct CUctx_st* CUcontext;
typedef struct CUmod_st* CUmodule;
typedef struct CUfunc_st* CUfunction;
typedef struct CUstream_st* CUstream;
typedef struct CUevent_st* CUevent;

#define CUDA_SUCCESS 0
#define CUDA_ERROR_INVALID_VALUE 1
#define CUDA_ERROR_OUT_OF_MEMORY 2
#define CUDA_ERROR_NOT_INITIALIZED 3
#define CUDA_ERROR_INSUFFICIENT_DRIVER 35
#define CUDA_ERROR_NO_DEVICE 100
#define CUDA_ERROR_INVALID_DEVICE 101
#define CUDA_ERROR_INVALID_IMAGE 200
#define CUDA_ERROR_INVALID_CONTEXT 201
#define CUDA_ERROR_NO_BINARY_FOR_GPU 209
#define CUDA_ERROR_NOT_FOUND 500
#define CUDA_ERROR_NOT_READY 600
#define CUDA_ERROR_ILLEGAL_ADDRESS 700
#define CUDA_ERROR_LAUNCH_FAILED 719

#define CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT 16
#define CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR 75
#define CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR 76
#define CU_STREAM_NON_BLOCKING 0x1
#define CU_EVENT_DEFAULT 0x0
#define CU_EVENT_DISABLE_TIMING 0x2
#define CU_MEMHOSTALLOC_PORTABLE 0x1
#define CU_MEMHOSTALLOC_DEVICEMAP 0x2
#define CU_STREAM_WAIT_VALUE_GEQ 0x0
/* CUfunction_attribute values */
#define CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK 0
#define CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES 1
#define CU_FUNC_ATTRIBUTE_CONST_SIZE_BYTES 2
#define CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES 3
#define CU_FUNC_ATTRIBUTE_NUM_REGS 4
#define CU_FUNC_ATTRIBUTE_PTX_VERSION 5
#define CU_FUNC_ATTRIBUTE_BINARY_VERSION 6

/* The entry points, by the symbol each is loaded from. */
#define ZC_CUDA_FUNCS(X)                                                                                          \
	X(cuInit, "cuInit", CUresult, (unsigned int flags))                                                       \
	X(cuDriverGetVersion, "cuDriverGetVersion", CUresult, (int* version))                                     \
	X(cuGetErrorName, "cuGetErrorName", CUresult, (CUresult err, const char** s))                             \
	X(cuGetErrorString, "cuGetErrorString", CUresult, (CUresult err, const char** s))                         \
	X(cuDeviceGetCount, "cuDeviceGetCount", CUresult, (int* n))                                               \
	X(cuDeviceGet, "cuDeviceGet", CUresult, (CUdevice * d, int ordinal))                                      \
	X(cuDeviceGetName, "cuDeviceGetName", CUresult, (char* name, int len, CUdevice d))                       \
	X(cuDeviceGetAttribute, "cuDeviceGetAttribute", CUresult, (int* v, int attr, CUdevice d))                 \
	X(cuDeviceTotalMem, "cuDeviceTotalMem_v2", CUresult, (size_t * bytes, CUdevice d))                        \
	X(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain", CUresult, (CUcontext * c, CUdevice d))            \
	X(cuCtxGetCurrent, "cuCtxGetCurrent", CUresult, (CUcontext * c))                                          \
	X(cuCtxSetCurrent, "cuCtxSetCurrent", CUresult, (CUcontext c))                                            \
	X(cuCtxSynchronize, "cuCtxSynchronize", CUresult, (void))                                                 \
	X(cuMemGetInfo, "cuMemGetInfo_v2", CUresult, (size_t * free_bytes, size_t * total_bytes))                 \
	X(cuMemAlloc, "cuMemAlloc_v2", CUresult, (CUdeviceptr * p, size_t bytes))                                 \
	X(cuMemFree, "cuMemFree_v2", CUresult, (CUdeviceptr p))                                                   \
	X(cuMemHostAlloc, "cuMemHostAlloc", CUresult, (void** p, size_t bytes, unsigned int flags))              \
	X(cuMemFreeHost, "cuMemFreeHost", CUresult, (void* p))                                                    \
	X(cuMemHostGetDevicePointer, "cuMemHostGetDevicePointer_v2", CUresult,                                    \
	  (CUdeviceptr * d, void* p, unsigned int flags))                                                         \
	X(cuMemsetD8Async, "cuMemsetD8Async", CUresult, (CUdeviceptr p, unsigned char v, size_t n, CUstream s))  \
	X(cuMemcpyAsync, "cuMemcpyAsync", CUresult, (CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s))    \
	X(cuMemcpyDtoHAsync, "cuMemcpyDtoHAsync_v2", CUresult, (void* dst, CUdeviceptr src, size_t n, CUstream s)) \
	X(cuMemcpyHtoDAsync, "cuMemcpyHtoDAsync_v2", CUresult,                                                    \
	  (CUdeviceptr dst, const void* src, size_t n, CUstream s))                                               \
	X(cuStreamCreate, "cuStreamCreate", CUresult, (CUstream * s, unsigned int flags))                         \
	X(cuStreamDestroy, "cuStreamDestroy_v2", CUresult, (CUstream s))                                          \
	X(cuStreamSynchronize, "cuStreamSynchronize", CUresult, (CUstream s))                                     \
	X(cuStreamWaitEvent, "cuStreamWaitEvent", CUresult, (CUstream s, CUevent e, unsigned int flags))          \
	X(cuStreamWaitValue32, "cuStreamWaitValue32_v2", CUresult,                                                \
	  (CUstream s, CUdeviceptr addr, uint32_t value, unsigned int flags))                                     \
	X(cuEventCreate, "cuEventCreate", CUresult, (CUevent * e, unsigned int flags))                            \
	X(cuEventRecord, "cuEventRecord", CUresult, (CUevent e, CUstream s))                                      \
	X(cuEventSynchronize, "cuEventSynchronize", CUresult, (CUevent e))                                        \
	X(cuEventQuery, "cuEventQuery", CUresult, (CUevent e))                                                    \
	X(cuEventDestroy, "cuEventDestroy_v2", CUresult, (CUevent e))                                             \
	X(cuEventElapsedTime, "cuEventElapsedTime", CUresult, (float* ms, CUevent start, CUevent end))           \
	X(cuModuleLoadData, "cuModuleLoadData", CUresult, (CUmodule * m, const void* image))                      \
	X(cuModuleGetFunction, "cuModuleGetFunction", CUresult, (CUfunction * f, CUmodule m, const char* name))  \
	X(cuFuncGetAttribute, "cuFuncGetAttribute", CUresult, (int* v, int attr, CUfunction f))                  \
	X(cuLaunchKernel, "cuLaunchKernel", CUresult,                                                             \
	  (CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx, unsigned int by,     \
	   unsigned int bz, unsigned int shared, CUstream s, void** params, void** extra))

/* ---- NCCL ------------------------------------------------------------------------ */

typedef int ncclResult_t;
typedef struct ncclComm* ncclComm_t;
typedef struct {
	char internal[128];
} ncclUniqueId;

#define ncclSuccess 0
#define ncclUnhandledCudaError 1
#define ncclInvalidArgument 4
#define ncclInProgress 7

/* ncclDataType_t and ncclRedOp_t values */
#define ncclFloat16 6
#define ncclFloat32 7
#define ncclBfloat16 9
#define ncclSum 0
#define ncclMax 2
#define ncclAvg 4

/* The prefix of ncclConfig_t that NCCL 2.14 introduced. NCCL copies `size`
 * bytes of the caller's struct and takes every field past `blocking` from
 * its defaults when `version` is below the release that added it, so this
 * prefix with version 2.14.0 works with every NCCL since. */
typedef struct {
	size_t size;
	unsigned int magic; /* 0xcafebeef */
	unsigned int version;
	int blocking;
} zc_nccl_config;
#define ZC_NCCL_CONFIG_MAGIC 0xcafebeefu
#define ZC_NCCL_CONFIG_VERSION 21400 /* NCCL_VERSION(2, 14, 0) */

#define ZC_NCCL_FUNCS(X)                                                                                          \
	X(get_version, "ncclGetVersion", ncclResult_t, (int* v))                                                  \
	X(get_unique_id, "ncclGetUniqueId", ncclResult_t, (ncclUniqueId * id))                                    \
	X(init_rank_config, "ncclCommInitRankConfig", ncclResult_t,                                               \
	  (ncclComm_t * c, int world, ncclUniqueId id, int rank, zc_nccl_config* config))                         \
	X(comm_abort, "ncclCommAbort", ncclResult_t, (ncclComm_t c))                                              \
	X(comm_finalize, "ncclCommFinalize", ncclResult_t, (ncclComm_t c))                                        \
	X(comm_destroy, "ncclCommDestroy", ncclResult_t, (ncclComm_t c))                                          \
	X(async_error, "ncclCommGetAsyncError", ncclResult_t, (ncclComm_t c, ncclResult_t * state))               \
	X(error_string, "ncclGetErrorString", const char*, (ncclResult_t r))                                      \
	X(last_error, "ncclGetLastError", const char*, (ncclComm_t c))                                            \
	X(all_reduce, "ncclAllReduce", ncclResult_t,                                                              \
	  (const void* send, void* recv, size_t n, int dtype, int op, ncclComm_t c, CUstream s))                  \
	X(reduce_scatter, "ncclReduceScatter", ncclResult_t,                                                      \
	  (const void* send, void* recv, size_t n, int dtype, int op, ncclComm_t c, CUstream s))                  \
	X(all_gather, "ncclAllGather", ncclResult_t,                                                              \
	  (const void* send, void* recv, size_t n, int dtype, ncclComm_t c, CUstream s))                          \
	X(broadcast, "ncclBroadcast", ncclResult_t,                                                               \
	  (const void* send, void* recv, size_t n, int dtype, int root, ncclComm_t c, CUstream s))                \
	X(group_start, "ncclGroupStart", ncclResult_t, (void))                                                    \
	X(group_end, "ncclGroupEnd", ncclResult_t, (void))

#endif /* ZERO_CUDA_API_H */
