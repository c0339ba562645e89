/*
 * zero_cuda.h: the C interface of the CUDA path for cuda.go, group_cuda.go
 * and nccl_cuda.go (all //go:build cuda), implemented by cuda_driver.c (the
 * CUDA driver API, loaded with dlopen) and nccl_loader.c (NCCL, likewise).
 * No CUDA or NCCL header is needed: every pointer and handle (device
 * memory, CUstream/cudaStream_t, CUevent, ncclComm_t) crosses as a
 * uintptr_t, so the Go side never converts an integer to an unsafe.Pointer.
 *
 * Conventions:
 *   - every function that can fail returns a status: 0 for success, a
 *     CUresult for CUDA failures (name and text from zc_error_name and
 *     zc_error_string), an ncclResult_t for the NCCL functions (text from
 *     zc_nccl_error_string), or one of the ZC_ERR_ codes of cuda_abi.h;
 *   - every entry point that touches a device makes its primary context
 *     current on the calling thread and restores the thread's context
 *     before it returns (a goroutine may run on any thread);
 *   - kernels and copies are enqueued on the given stream and return at once
 *     (a copy into pageable host memory completes before it returns);
 *   - dtype codes are ZERO_F32/ZERO_BF16/ZERO_F16 and op codes
 *     ZERO_SUM/ZERO_AVG/ZERO_MAX of elementwise.h.
 */
#ifndef ZERO_CUDA_H
#define ZERO_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include "cuda_abi.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- the driver ------------------------------------------------------- */

/* Load the driver (path NULL or "": $ZERO_CUDA_LIBRARY, else libcuda.so.1),
 * resolve its entry points and cuInit. 0, or ZC_ERR_NO_DRIVER /
 * ZC_ERR_OLD_DRIVER / a CUresult, with the reason in msg. A success is kept;
 * a failure is tried again on the next call. Every other entry point loads
 * the driver first. */
int zc_driver_load(const char* path, char* msg, int msglen);
/* cuDriverGetVersion, e.g. 12040 for CUDA 12.4. */
int zc_driver_version(int* v);
/* The kernels: a fatbin image, copied; the first call wins. */
void zc_set_fatbin(const void* image, uint64_t len);

/* The calling thread's current context, and setting it (tests). */
int zc_context_current(uintptr_t* c);
int zc_context_set(uintptr_t c);

/* ---- errors ------------------------------------------------------------ */

const char* zc_error_name(int code);
const char* zc_error_string(int code);

/* ---- devices and memory ------------------------------------------------- */

int zc_device_count(int* n);
/* name (NUL-terminated, truncated to namelen), compute capability, memory,
 * multiprocessors. */
int zc_device_props(int dev, char* name, int namelen, int* major, int* minor, uint64_t* total_mem, int* sms);
int zc_mem_info(int dev, uint64_t* free_bytes, uint64_t* total_bytes);
int zc_device_sync(int dev);
/* Device memory, zeroed, 256-byte aligned. */
int zc_malloc(int dev, uint64_t bytes, uintptr_t* p);
int zc_free(int dev, uintptr_t p);
/* Pinned (page-locked, portable, mapped into the device) host memory, zeroed. */
int zc_host_alloc(int dev, uint64_t bytes, uintptr_t* p);
int zc_host_free(int dev, uintptr_t p);

/* ---- streams and events ------------------------------------------------ */

/* A non-blocking stream (it does not synchronise with the legacy default
 * stream). */
int zc_stream_create(int dev, uintptr_t* s);
int zc_stream_destroy(int dev, uintptr_t s);
int zc_stream_sync(int dev, uintptr_t s);
/* Make work enqueued on s after this call wait for event e. */
int zc_stream_wait(int dev, uintptr_t s, uintptr_t e);
/* Make work enqueued on s after this call wait until the 32-bit word at flag
 * (pinned host memory from zc_host_alloc) is at least 1. */
int zc_stream_wait_flag(int dev, uintptr_t s, uintptr_t flag);
/* Create an event (with timing when timing != 0) and record it on s; when
 * *e is an event already, record that one on s instead. */
int zc_record(int dev, uintptr_t s, int timing, uintptr_t* e);
int zc_event_destroy(int dev, uintptr_t e);
int zc_event_sync(int dev, uintptr_t e);
/* 0 when the event has fired, cudaErrorNotReady (600) while pending. */
int zc_event_query(int dev, uintptr_t e);
int zc_event_elapsed(int dev, uintptr_t start, uintptr_t end, float* ms);

/* ---- copies ------------------------------------------------------------- */

/* cudaMemsetAsync(p, 0, bytes) on s. */
int zc_memzero(int dev, uintptr_t s, uintptr_t p, uint64_t bytes);
/* cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault) on s: any direction,
 * device memory, pinned and pageable host memory. */
int zc_memcpy(int dev, uintptr_t s, uintptr_t dst, uintptr_t src, uint64_t bytes);
/* The same copy through the direction-named calls, cuMemcpyDtoHAsync
 * (to_host) or cuMemcpyHtoDAsync: the yardstick the GPU runner times
 * zc_memcpy's copies of page-locked memory against. */
int zc_memcpy_directed(int dev, uintptr_t s, uintptr_t dst, uintptr_t src, uint64_t bytes, int to_host);

/* ---- kernels (csrc/kernels.cu, from the fatbin) ------------------------- */

/* flatten: dst[seg.offset + i] = dst_dtype(src_dtype(seg.ptr[i]) * scale) for
 * every segment, one launch; the multiply is skipped when scale == 1.
 * Same arithmetic as zero_flatten of kernels.h. */
int zc_flatten(int dev, uintptr_t s, uintptr_t dst, int dst_dtype, const zc_seg* segs, int nseg, int src_dtype,
               float scale);

/* accumulate (copy-vs-add) into acc of acc_dtype (fp32, bf16 or fp16):
 * acc[seg.offset + i] = acc_dtype((first ? 0 : float(acc[..])) +
 * float(seg.ptr[i]) * scale), the sum in fp32 rounded once, one launch; sets
 * the fp32 at flag (device memory, may be 0) to 1.0 when a stored value is
 * inf or NaN. Same arithmetic as zero_accumulate. With part (device memory,
 * 8-byte aligned; 0 for none) and exactly one segment, part[k] (a double)
 * becomes the sum of squares of the values stored at seg.offset +
 * [k*ZC_CHUNK, (k+1)*ZC_CHUNK), what zc_chunk_squares gives for them. */
int zc_accumulate(int dev, uintptr_t s, uintptr_t acc, int acc_dtype, const zc_seg* segs, int nseg, int src_dtype,
                  int first, float scale, uintptr_t flag, uintptr_t part);

/* The sums of squares of x[0, n) (dtype fp32, bf16 or fp16, values widened
 * to fp32, squared in double) per chunk: part[k] (double, device memory)
 * for elements [k*ZC_CHUNK, (k+1)*ZC_CHUNK). Thread t of a chunk's block adds
 * its elements t, t+ZC_THREADS, ... in order, then a fixed tree over the
 * threads: the bits depend on the values only. */
int zc_chunk_squares(int dev, uintptr_t s, uintptr_t x, int dtype, int64_t n, uintptr_t part);

/* out[i] (double) = the sum of part[ranges[i].lo, ranges[i].hi), for i < nr,
 * in zc_sumsq_final's fixed order: thread t adds the elements t, t+ZC_THREADS,
 * ... of the range in order, then the fixed tree over the threads (0 for an
 * empty range). One launch per half ring of ranges; ranges is copied before
 * the call returns. */
int zc_sum_chunks(int dev, uintptr_t s, uintptr_t part, const zc_crange* ranges, int nr, uintptr_t out);

/* unflatten: seg.ptr[i] = flat[seg.offset + i] for every segment, one dtype,
 * one launch: the inverse of flatten. */
int zc_unflatten(int dev, uintptr_t s, uintptr_t flat, int dtype, const zc_seg* segs, int nseg);

/* An optimizer pass (AdamW, or SGD when sgd != 0, elementwise.h) over the
 * ranges of the fp32 master shard p: gradient g scaled by gscale, moments m
 * and v (SGD: m is the momentum buffer, 0 without; vmax with amsgrad), the
 * new parameters cast to out_dtype into out (may be 0). */
int zc_optimize(int dev, uintptr_t s, int sgd, uintptr_t p, uintptr_t g, uintptr_t m, uintptr_t v, uintptr_t vmax,
                uintptr_t out, int out_dtype, const zero_opt_range* ranges, int nr, float gscale);

/* cast: dst[i] = dst_dtype(src_dtype(src[i]) * scale), i < n. */
int zc_cast(int dev, uintptr_t s, uintptr_t dst, int dst_dtype, uintptr_t src, int src_dtype, int64_t n,
            float scale);

/* Sum of squares of n fp32 values in double, copied to out (pinned host
 * memory, or device memory) on s: the value is there once s has passed this
 * point. scratch is device memory for ZC_SUMSQ_MAX_BLOCKS + 1 doubles.
 * Deterministic for a given n: a fixed grid, a fixed tree in each block and
 * a fixed order over the blocks. */
int zc_sumsq(int dev, uintptr_t s, uintptr_t x, int64_t n, uintptr_t scratch, uintptr_t out);

/* In-process reduce (reduce-scatter of the one-GPU group): for each output j
 * in [0, nout) and i in [0, count):
 *   dsts[j][i] = op over k in [0, nsrc) of srcs[k][j * count + i],
 * in rank order in fp32 (zero_op_combine, zero_op_finish), stored once in
 * dtype. dsts[j] may be chunk j of a src: each element reads all its inputs
 * before it writes. */
int zc_reduce(int dev, uintptr_t s, const uintptr_t* dsts, int nout, const uintptr_t* srcs, int nsrc, int dtype,
              int op, int64_t count);

/* Fused in-place all-reduce over n buffers of count elements: every element
 * is reduced in rank order in fp32 and the result, cast once, is written to
 * every buffer. */
int zc_allreduce(int dev, uintptr_t s, const uintptr_t* bufs, int n, int dtype, int op, int64_t count);

/* Test helper: a kernel that spins for about ns nanoseconds on s, to hold a
 * stream back. */
int zc_spin(int dev, uintptr_t s, int64_t ns);

/* The kernels of the fatbin, for the GPU runner's record: how many there
 * are, and kernel id's name and attributes on dev (loading it), in the
 * order of ZC_KATTR_*, each from cuFuncGetAttribute. */
enum {
	ZC_KATTR_REGS,        /* CU_FUNC_ATTRIBUTE_NUM_REGS */
	ZC_KATTR_LOCAL,       /* LOCAL_SIZE_BYTES: a thread's local memory (spills, stack) */
	ZC_KATTR_SHARED,      /* SHARED_SIZE_BYTES: static shared memory of a block */
	ZC_KATTR_CONST,       /* CONST_SIZE_BYTES */
	ZC_KATTR_MAX_THREADS, /* MAX_THREADS_PER_BLOCK */
	ZC_KATTR_PTX,         /* PTX_VERSION, major*10+minor */
	ZC_KATTR_BINARY,      /* BINARY_VERSION: the SASS the driver runs, major*10+minor */
	ZC_KATTR_N
};
int zc_kernel_count(void);
int zc_kernel_info(int dev, int id, char* name, int namelen, int* attrs);

/* ---- NCCL (nccl_loader.c), loaded with dlopen ------------------------------ */

/* Load libnccl (path NULL or "" means "libnccl.so.2") and resolve its
 * symbols. Returns 0, or ZC_ERR_NO_NCCL with the dlopen/dlsym message in
 * msg. Safe to call again: the first success is kept. */
int zc_nccl_load(const char* path, char* msg, int msglen);
/* Like zc_nccl_load, but closes the library again (a check, for tests). */
int zc_nccl_probe(const char* path, char* msg, int msglen);
/* 1 once zc_nccl_load succeeded. */
int zc_nccl_loaded(void);
/* NCCL_VERSION_CODE of the loaded library, e.g. 22707. */
int zc_nccl_version(int* version);
const char* zc_nccl_error_string(int code);
/* ncclGetLastError(comm) (comm may be 0), copied into msg. */
void zc_nccl_last_error(uintptr_t comm, char* msg, int msglen);
/* A 128-byte ncclUniqueId. */
int zc_nccl_unique_id(char* id128);
/* ncclCommInitRankConfig in non-blocking mode on device dev, then waits
 * (polling ncclCommGetAsyncError) until the communicator is ready or
 * timeout_ms passes; on timeout it aborts the communicator and returns
 * ncclInProgress (7). */
int zc_nccl_init(int dev, const char* id128, int world, int rank, int64_t timeout_ms, uintptr_t* comm);
/* The state of a communicator: ncclSuccess, ncclInProgress or an error. */
int zc_nccl_async_error(uintptr_t comm, int* state);
int zc_nccl_abort(int dev, uintptr_t comm);
/* ncclCommFinalize (flushes pending work), waits up to timeout_ms, then
 * ncclCommDestroy; aborts instead if the finalize does not finish in time
 * (and then returns ncclInProgress). */
int zc_nccl_destroy(int dev, uintptr_t comm, int64_t timeout_ms);

/* One collective of a batch. kind: 0 all-reduce, 1 reduce-scatter,
 * 2 all-gather, 3 broadcast (the values of CollectiveKind in nccl.go).
 * count is the element count NCCL takes: the whole buffer for all-reduce and
 * broadcast, the per-rank count (recv for reduce-scatter, send for all-gather)
 * otherwise. */
typedef struct {
	int32_t kind;
	int32_t dtype; /* ZERO_F32 / ZERO_BF16 / ZERO_F16 */
	int32_t op;    /* ZERO_SUM / ZERO_AVG / ZERO_MAX */
	int32_t root;
	uintptr_t send;
	uintptr_t recv;
	uint64_t count;
	uintptr_t stream;
} zc_nccl_op;

/* Runs ncclGroupStart, the n collectives, ncclGroupEnd on the calling OS
 * thread (NCCL's group state is per thread), then waits up to timeout_ms for
 * a non-blocking communicator to finish enqueueing. Returns ncclInProgress
 * (7) if it did not. */
int zc_nccl_batch(int dev, uintptr_t comm, const zc_nccl_op* ops, int n, int64_t timeout_ms);

#ifdef __cplusplus
}
#endif

#endif /* ZERO_CUDA_H */
