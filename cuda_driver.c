//go:build cuda

/*
 * cuda_driver.c: the host side of the CUDA path, on the CUDA driver API,
 * which is opened at run time with dlopen (libcuda.so.1, or the file named by
 * ZERO_CUDA_LIBRARY): a binary built with -tags cuda starts on a host with no
 * driver, and building it needs no CUDA toolkit.
 *
 * - Every entry point makes the device's primary context (the one the CUDA
 *   runtime of a framework uses, so its streams and pointers work here) current
 *   on the calling thread, and puts back the thread's own context before it
 *   returns.
 * - Every driver call returns its own status: there is no per-thread "last
 *   error" that an earlier, harmless call (a not-ready event query) could leave
 *   behind for a later one.
 * - The kernels come from the fatbin the Go side embeds (zc_set_fatbin); each
 *   device loads it once into a module.
 */
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_api.h"
#include "cuda_abi.h"
#include "zero_cuda.h"

static struct {
#define ZC_FIELD(name, sym, ret, args) ret(*name) args;
	ZC_CUDA_FUNCS(ZC_FIELD)
#undef ZC_FIELD
} cu;

static pthread_mutex_t zc_mu = PTHREAD_MUTEX_INITIALIZER;
static int zc_loaded;   /* set once, under zc_mu; read atomically */
static int zc_version;  /* cuDriverGetVersion, e.g. 12040 */
static char zc_msg[1024]; /* why the last load failed */

static const void* zc_fatbin;
static size_t zc_fatbin_len;

/* ---- loading ------------------------------------------------------------------ */

static int zc_open(const char* path) {
	dlerror();
	void* lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
	if (!lib) {
		const char* e = dlerror();
		snprintf(zc_msg, sizeof zc_msg, "%s", e ? e : path);
		return ZC_ERR_NO_DRIVER;
	}
#define ZC_SYM(name, sym, ret, args)                                                                            \
	*(void**)(&cu.name) = dlsym(lib, sym);                                                                   \
	if (!cu.name) {                                                                                          \
		snprintf(zc_msg, sizeof zc_msg, "%s has no %s; the NVIDIA driver is too old or broken", path, sym); \
		dlclose(lib);                                                                                    \
		memset(&cu, 0, sizeof cu);                                                                       \
		return ZC_ERR_NO_DRIVER;                                                                         \
	}
	ZC_CUDA_FUNCS(ZC_SYM)
#undef ZC_SYM
	int err = cu.cuInit(0);
	if (!err) err = cu.cuDriverGetVersion(&zc_version);
	if (!err && zc_version < ZC_MIN_DRIVER) {
		snprintf(zc_msg, sizeof zc_msg,
		         "the NVIDIA driver supports CUDA %d.%d; zero needs CUDA %d.%d or newer (driver 525.60 or later)",
		         zc_version / 1000, zc_version % 1000 / 10, ZC_MIN_DRIVER / 1000, ZC_MIN_DRIVER % 1000 / 10);
		err = ZC_ERR_OLD_DRIVER;
	} else if (err) {
		const char* name = NULL;
		cu.cuGetErrorName(err, &name);
		snprintf(zc_msg, sizeof zc_msg, "cuInit: %s", name ? name : "error");
	}
	/* the library stays loaded: its symbols may be in use by other threads */
	return err;
}

int zc_driver_load(const char* path, char* msg, int msglen) {
	if (!path || !path[0]) path = getenv("ZERO_CUDA_LIBRARY");
	if (!path || !path[0]) path = "libcuda.so.1";
	pthread_mutex_lock(&zc_mu);
	int err = 0;
	if (!__atomic_load_n(&zc_loaded, __ATOMIC_ACQUIRE)) {
		err = zc_open(path);
		if (!err) __atomic_store_n(&zc_loaded, 1, __ATOMIC_RELEASE);
	}
	if (msglen > 0) snprintf(msg, (size_t)msglen, "%s", err ? zc_msg : "");
	pthread_mutex_unlock(&zc_mu);
	return err;
}

int zc_driver_version(int* v) {
	int err = zc_driver_load(NULL, NULL, 0);
	*v = err ? 0 : zc_version;
	return err;
}

void zc_set_fatbin(const void* image, uint64_t len) {
	void* copy = malloc((size_t)len);
	if (!copy) return;
	memcpy(copy, image, (size_t)len);
	pthread_mutex_lock(&zc_mu);
	if (!zc_fatbin) {
		zc_fatbin = copy;
		zc_fatbin_len = (size_t)len;
		copy = NULL;
	}
	pthread_mutex_unlock(&zc_mu);
	free(copy);
}

static int zc_ensure(void) {
	if (__atomic_load_n(&zc_loaded, __ATOMIC_ACQUIRE)) return 0;
	return zc_driver_load(NULL, NULL, 0);
}

/* ---- errors ------------------------------------------------------------------- */

const char* zc_error_name(int code) {
	switch (code) {
	case ZC_ERR_TOO_MANY_RANKS: return "zeroErrorTooManyRanks";
	case ZC_ERR_BAD_DTYPE: return "zeroErrorBadDType";
	case ZC_ERR_NO_NCCL: return "zeroErrorNoNCCL";
	case ZC_ERR_NO_DRIVER: return "zeroErrorNoDriver";
	case ZC_ERR_OLD_DRIVER: return "zeroErrorOldDriver";
	case ZC_ERR_NO_KERNELS: return "zeroErrorNoKernels";
	}
	const char* s = NULL;
	if (__atomic_load_n(&zc_loaded, __ATOMIC_ACQUIRE)) cu.cuGetErrorName(code, &s);
	return s ? s : "CUDA_ERROR_UNKNOWN";
}

const char* zc_error_string(int code) {
	switch (code) {
	case ZC_ERR_TOO_MANY_RANKS: return "more buffers than ZC_MAX_RANKS (32) in one in-process reduction";
	case ZC_ERR_BAD_DTYPE: return "dtype or reduction op code out of range";
	case ZC_ERR_NO_NCCL: return "libnccl.so.2 is not loaded";
	case ZC_ERR_NO_DRIVER:
	case ZC_ERR_OLD_DRIVER: return zc_msg;
	case ZC_ERR_NO_KERNELS: return "the kernels' fatbin is missing or lacks a kernel; rebuild it with make cuda";
	}
	const char* s = NULL;
	if (__atomic_load_n(&zc_loaded, __ATOMIC_ACQUIRE)) cu.cuGetErrorString(code, &s);
	return s ? s : "unknown CUDA error";
}

/* ---- contexts ----------------------------------------------------------------- */

static CUcontext zc_ctx[ZC_MAX_DEVICES];

/* The calling thread's context, to put back, and the device's primary one. */
typedef struct {
	CUcontext saved, ctx;
} zc_scope;

static int zc_enter(int dev, zc_scope* sc) {
	int err = zc_ensure();
	if (err) return err;
	if (dev < 0 || dev >= ZC_MAX_DEVICES) return CUDA_ERROR_INVALID_DEVICE;
	CUcontext ctx = __atomic_load_n(&zc_ctx[dev], __ATOMIC_ACQUIRE);
	if (!ctx) {
		pthread_mutex_lock(&zc_mu);
		ctx = zc_ctx[dev];
		if (!ctx) {
			CUdevice d;
			err = cu.cuDeviceGet(&d, dev);
			if (!err) err = cu.cuDevicePrimaryCtxRetain(&ctx, d);
			if (!err) __atomic_store_n(&zc_ctx[dev], ctx, __ATOMIC_RELEASE);
		}
		pthread_mutex_unlock(&zc_mu);
		if (err) return err;
	}
	sc->ctx = ctx;
	err = cu.cuCtxGetCurrent(&sc->saved);
	if (err) return err;
	if (sc->saved != ctx) err = cu.cuCtxSetCurrent(ctx);
	return err;
}

static int zc_leave(const zc_scope* sc, int err) {
	if (sc->saved != sc->ctx) {
		int e = cu.cuCtxSetCurrent(sc->saved);
		if (!err) err = e;
	}
	return err;
}

#define ZC_ENTER(dev)                                     \
	zc_scope sc_;                                     \
	do {                                              \
		int e_ = zc_enter((dev), &sc_);           \
		if (e_) return e_;                        \
	} while (0)
#define ZC_LEAVE(err) return zc_leave(&sc_, (err))

/* ---- devices and memory --------------------------------------------------------- */

int zc_device_count(int* n) {
	*n = 0;
	int err = zc_ensure();
	return err ? err : cu.cuDeviceGetCount(n);
}

int zc_device_props(int dev, char* name, int namelen, int* major, int* minor, uint64_t* total_mem, int* sms) {
	int err = zc_ensure();
	if (err) return err;
	CUdevice d;
	size_t mem = 0;
	if ((err = cu.cuDeviceGet(&d, dev))) return err;
	if ((err = cu.cuDeviceGetName(name, namelen, d))) return err;
	if ((err = cu.cuDeviceGetAttribute(major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, d))) return err;
	if ((err = cu.cuDeviceGetAttribute(minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, d))) return err;
	if ((err = cu.cuDeviceGetAttribute(sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, d))) return err;
	err = cu.cuDeviceTotalMem(&mem, d);
	*total_mem = mem;
	return err;
}

int zc_mem_info(int dev, uint64_t* free_bytes, uint64_t* total_bytes) {
	ZC_ENTER(dev);
	size_t f = 0, t = 0;
	int err = cu.cuMemGetInfo(&f, &t);
	*free_bytes = f;
	*total_bytes = t;
	ZC_LEAVE(err);
}

int zc_device_sync(int dev) {
	ZC_ENTER(dev);
	ZC_LEAVE(cu.cuCtxSynchronize());
}

/* A private stream per device for housekeeping (zeroing new memory), so
 * that it never waits for, or delays, anyone else's work. */
static CUstream zc_house[ZC_MAX_DEVICES];

static int zc_house_stream(int dev, CUstream* s) {
	pthread_mutex_lock(&zc_mu);
	int err = 0;
	if (!zc_house[dev]) err = cu.cuStreamCreate(&zc_house[dev], CU_STREAM_NON_BLOCKING);
	*s = zc_house[dev];
	pthread_mutex_unlock(&zc_mu);
	return err;
}

int zc_malloc(int dev, uint64_t bytes, uintptr_t* p) {
	ZC_ENTER(dev);
	*p = 0;
	CUdeviceptr q = 0;
	CUstream s = NULL;
	int err = cu.cuMemAlloc(&q, (size_t)bytes);
	if (!err) err = zc_house_stream(dev, &s);
	if (!err) err = cu.cuMemsetD8Async(q, 0, (size_t)bytes, s);
	if (!err) err = cu.cuStreamSynchronize(s);
	if (err && q) cu.cuMemFree(q);
	if (!err) *p = (uintptr_t)q;
	ZC_LEAVE(err);
}

int zc_free(int dev, uintptr_t p) {
	ZC_ENTER(dev);
	ZC_LEAVE(cu.cuMemFree((CUdeviceptr)p));
}

int zc_host_alloc(int dev, uint64_t bytes, uintptr_t* p) {
	ZC_ENTER(dev);
	void* q = NULL;
	*p = 0;
	int err = cu.cuMemHostAlloc(&q, (size_t)bytes, CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP);
	if (!err) {
		memset(q, 0, (size_t)bytes);
		*p = (uintptr_t)q;
	}
	ZC_LEAVE(err);
}

int zc_host_free(int dev, uintptr_t p) {
	ZC_ENTER(dev);
	ZC_LEAVE(cu.cuMemFreeHost((void*)p));
}

/* ---- streams and events ------------------------------------------------------------ */

int zc_stream_create(int dev, uintptr_t* s) {
	ZC_ENTER(dev);
	CUstream st = NULL;
	int err = cu.cuStreamCreate(&st, CU_STREAM_NON_BLOCKING);
	*s = (uintptr_t)st;
	ZC_LEAVE(err);
}

int zc_stream_destroy(int dev, uintptr_t s) {
	ZC_ENTER(dev);
	ZC_LEAVE(cu.cuStreamDestroy((CUstream)s));
}

int zc_stream_sync(int dev, uintptr_t s) {
	ZC_ENTER(dev);
	ZC_LEAVE(cu.cuStreamSynchronize((CUstream)s));
}

int zc_stream_wait(int dev, uintptr_t s, uintptr_t e) {
	ZC_ENTER(dev);
	ZC_LEAVE(cu.cuStreamWaitEvent((CUstream)s, (CUevent)e, 0));
}

int zc_stream_wait_flag(int dev, uintptr_t s, uintptr_t flag) {
	ZC_ENTER(dev);
	CUdeviceptr d = 0;
	int err = cu.cuMemHostGetDevicePointer(&d, (void*)flag, 0);
	if (!err) err = cu.cuStreamWaitValue32((CUstream)s, d, 1, CU_STREAM_WAIT_VALUE_GEQ);
	ZC_LEAVE(err);
}

int zc_record(int dev, uintptr_t s, int timing, uintptr_t* e) {
	ZC_ENTER(dev);
	if (*e) ZC_LEAVE(cu.cuEventRecord((CUevent)*e, (CUstream)s)); /* a pooled event, re-recorded */
	CUevent ev = NULL;
	int err = cu.cuEventCreate(&ev, timing ? CU_EVENT_DEFAULT : CU_EVENT_DISABLE_TIMING);
	if (!err) {
		err = cu.cuEventRecord(ev, (CUstream)s);
		if (err) cu.cuEventDestroy(ev);
	}
	if (!err) *e = (uintptr_t)ev;
	ZC_LEAVE(err);
}

int zc_event_destroy(int dev, uintptr_t e) {
	ZC_ENTER(dev);
	ZC_LEAVE(cu.cuEventDestroy((CUevent)e));
}

int zc_event_sync(int dev, uintptr_t e) {
	ZC_ENTER(dev);
	ZC_LEAVE(cu.cuEventSynchronize((CUevent)e));
}

int zc_event_query(int dev, uintptr_t e) {
	ZC_ENTER(dev);
	ZC_LEAVE(cu.cuEventQuery((CUevent)e));
}

int zc_event_elapsed(int dev, uintptr_t start, uintptr_t end, float* ms) {
	ZC_ENTER(dev);
	ZC_LEAVE(cu.cuEventElapsedTime(ms, (CUevent)start, (CUevent)end));
}

/* ---- copies ------------------------------------------------------------------------- */

int zc_memzero(int dev, uintptr_t s, uintptr_t p, uint64_t bytes) {
	if (bytes == 0) return 0;
	ZC_ENTER(dev);
	ZC_LEAVE(cu.cuMemsetD8Async((CUdeviceptr)p, 0, (size_t)bytes, (CUstream)s));
}

int zc_memcpy(int dev, uintptr_t s, uintptr_t dst, uintptr_t src, uint64_t bytes) {
	if (bytes == 0) return 0;
	ZC_ENTER(dev);
	ZC_LEAVE(cu.cuMemcpyAsync((CUdeviceptr)dst, (CUdeviceptr)src, (size_t)bytes, (CUstream)s));
}

int zc_memcpy_directed(int dev, uintptr_t s, uintptr_t dst, uintptr_t src, uint64_t bytes, int to_host) {
	if (bytes == 0) return 0;
	ZC_ENTER(dev);
	if (to_host) ZC_LEAVE(cu.cuMemcpyDtoHAsync((void*)dst, (CUdeviceptr)src, (size_t)bytes, (CUstream)s));
	ZC_LEAVE(cu.cuMemcpyHtoDAsync((CUdeviceptr)dst, (const void*)src, (size_t)bytes, (CUstream)s));
}

/* ---- the kernels ---------------------------------------------------------------------- */

enum {
	ZK_FLATTEN = 0,               /* 18: [d][s][c] */
	ZK_ACC = ZK_FLATTEN + 18,     /* 36: [d][s][c][f] */
	ZK_REDUCE = ZK_ACC + 36,      /* 9: [t][o] */
	ZK_ALLREDUCE = ZK_REDUCE + 9, /* 9: [t][o] */
	ZK_UNFLATTEN = ZK_ALLREDUCE + 9, /* 3: [t] */
	ZK_ADAMW = ZK_UNFLATTEN + 3,     /* 3: [out dtype] */
	ZK_SGD = ZK_ADAMW + 3,           /* 3: [out dtype] */
	ZK_CHUNKSQ = ZK_SGD + 3,         /* 3: [t] */
	ZK_SUMCHUNKS = ZK_CHUNKSQ + 3,
	ZK_SUMSQ_PART,
	ZK_SUMSQ_FINAL,
	ZK_SPIN,
	ZK_N
};

static void zk_name(int id, char* buf, size_t n) {
	if (id < ZK_ACC)
		snprintf(buf, n, "zc_flatten_%d%d%d", id / 6, id / 2 % 3, id % 2);
	else if (id < ZK_REDUCE)
		snprintf(buf, n, "zc_acc_%d%d%d%d", (id - ZK_ACC) / 12, (id - ZK_ACC) / 4 % 3, (id - ZK_ACC) / 2 % 2,
		         (id - ZK_ACC) % 2);
	else if (id < ZK_ALLREDUCE)
		snprintf(buf, n, "zc_reduce_%d%d", (id - ZK_REDUCE) / 3, (id - ZK_REDUCE) % 3);
	else if (id < ZK_UNFLATTEN)
		snprintf(buf, n, "zc_allreduce_%d%d", (id - ZK_ALLREDUCE) / 3, (id - ZK_ALLREDUCE) % 3);
	else if (id < ZK_ADAMW)
		snprintf(buf, n, "zc_unflatten_%d", id - ZK_UNFLATTEN);
	else if (id < ZK_SGD)
		snprintf(buf, n, "zc_adamw_%d", id - ZK_ADAMW);
	else if (id < ZK_CHUNKSQ)
		snprintf(buf, n, "zc_sgd_%d", id - ZK_SGD);
	else if (id < ZK_SUMCHUNKS)
		snprintf(buf, n, "zc_chunksq_%d", id - ZK_CHUNKSQ);
	else
		snprintf(buf, n, "%s", id == ZK_SUMCHUNKS ? "zc_sumchunks" : id == ZK_SUMSQ_PART ? "zc_sumsq_part" : id == ZK_SUMSQ_FINAL ? "zc_sumsq_final" : "zc_spin");
}

static CUmodule zc_module[ZC_MAX_DEVICES];
static CUfunction zc_fn[ZC_MAX_DEVICES][ZK_N];

/* Kernel id of device dev (whose context is current), loading the fatbin
 * into a module on first use. */
static int zc_kernel(int dev, int id, CUfunction* f) {
	*f = __atomic_load_n(&zc_fn[dev][id], __ATOMIC_ACQUIRE);
	if (*f) return 0;
	pthread_mutex_lock(&zc_mu);
	int err = 0;
	if (!zc_module[dev]) {
		if (!zc_fatbin) err = ZC_ERR_NO_KERNELS;
		if (!err) err = cu.cuModuleLoadData(&zc_module[dev], zc_fatbin);
	}
	if (!err && !zc_fn[dev][id]) {
		char name[64];
		zk_name(id, name, sizeof name);
		CUfunction g = NULL;
		err = cu.cuModuleGetFunction(&g, zc_module[dev], name);
		if (err == CUDA_ERROR_NOT_FOUND) err = ZC_ERR_NO_KERNELS;
		if (!err) __atomic_store_n(&zc_fn[dev][id], g, __ATOMIC_RELEASE);
	}
	*f = zc_fn[dev][id];
	pthread_mutex_unlock(&zc_mu);
	return err;
}

static int zc_launch(int dev, int id, unsigned gx, unsigned gy, unsigned threads, CUstream s, void** params) {
	CUfunction f;
	int err = zc_kernel(dev, id, &f);
	if (err) return err;
	return cu.cuLaunchKernel(f, gx, gy, 1, threads, 1, 1, 0, s, params, NULL);
}

/* ---- the descriptor staging ring (one per device) ------------------------------------- */

/* A batch of more than ZC_INLINE_SEGS segments has its descriptors copied to
 * the device from a pinned ring; a slot is reused only once the launch that
 * read it has run (its event fired). */
#define ZC_RING_BYTES (1u << 20)
#define ZC_RING_SLOTS 256

typedef struct {
	size_t lo, hi;
} zc_ring_ent;

typedef struct {
	pthread_mutex_t mu;
	int ready;
	char* host; /* pinned */
	CUdeviceptr dev;
	size_t head;
	zc_ring_ent q[ZC_RING_SLOTS];
	CUevent ev[ZC_RING_SLOTS];
	int qh, qn;
} zc_ring;

static zc_ring zc_rings[ZC_MAX_DEVICES];
static pthread_once_t zc_rings_once = PTHREAD_ONCE_INIT;

static void zc_rings_init(void) {
	for (int i = 0; i < ZC_MAX_DEVICES; i++) pthread_mutex_init(&zc_rings[i].mu, NULL);
}

static int zc_ring_setup(zc_ring* r) {
	if (r->ready) return 0;
	int err = cu.cuMemHostAlloc((void**)&r->host, ZC_RING_BYTES, CU_MEMHOSTALLOC_PORTABLE);
	if (err) return err;
	err = cu.cuMemAlloc(&r->dev, ZC_RING_BYTES);
	if (err) {
		cu.cuMemFreeHost(r->host);
		r->host = NULL;
		return err;
	}
	for (int i = 0; i < ZC_RING_SLOTS; i++) {
		err = cu.cuEventCreate(&r->ev[i], CU_EVENT_DISABLE_TIMING);
		if (err) { /* undo, so a later call starts clean */
			while (i-- > 0) cu.cuEventDestroy(r->ev[i]);
			cu.cuMemFree(r->dev);
			cu.cuMemFreeHost(r->host);
			r->dev = 0;
			r->host = NULL;
			return err;
		}
	}
	r->head = 0;
	r->qh = r->qn = 0;
	r->ready = 1;
	return 0;
}

static void zc_ring_pop(zc_ring* r) {
	r->qh = (r->qh + 1) % ZC_RING_SLOTS;
	r->qn--;
}

static int zc_overlaps(const zc_ring* r, size_t lo, size_t hi) {
	for (int k = 0; k < r->qn; k++) {
		const zc_ring_ent* e = &r->q[(r->qh + k) % ZC_RING_SLOTS];
		if (lo < e->hi && e->lo < hi) return 1;
	}
	return 0;
}

/* Reserve bytes in the ring (mutex held), waiting for old launches if needed. */
static int zc_ring_reserve(zc_ring* r, size_t bytes, size_t* pos) {
	bytes = (bytes + 255) & ~(size_t)255;
	for (;;) { /* retire what has run; a not-ready query is an answer, not an error */
		if (r->qn == 0) break;
		int q = cu.cuEventQuery(r->ev[r->qh]);
		if (q == CUDA_ERROR_NOT_READY) break;
		if (q) return q;
		zc_ring_pop(r);
	}
	size_t p = r->head;
	if (p + bytes > ZC_RING_BYTES) p = 0;
	while (r->qn > 0 && (r->qn == ZC_RING_SLOTS || zc_overlaps(r, p, p + bytes))) {
		int err = cu.cuEventSynchronize(r->ev[r->qh]);
		if (err) return err;
		zc_ring_pop(r);
	}
	*pos = p;
	r->head = p + bytes;
	return 0;
}

/* Mark [pos, pos+bytes) busy until the work enqueued on s so far has run. */
static int zc_ring_commit(zc_ring* r, CUstream s, size_t pos, size_t bytes) {
	int slot = (r->qh + r->qn) % ZC_RING_SLOTS;
	int err = cu.cuEventRecord(r->ev[slot], s);
	if (err) return err;
	r->q[slot].lo = pos;
	r->q[slot].hi = pos + ((bytes + 255) & ~(size_t)255);
	r->qn++;
	return 0;
}

/* One batch of descriptors through dev's ring: zc_ring_begin takes the ring's
 * lock and reserves bytes at *pos (r->host + *pos for the caller to fill, then
 * copy to r->dev + *pos on its stream and launch); zc_ring_end marks the slot
 * busy until the stream passed the launch (or the copy, if the launch failed)
 * and lets go of the lock. It returns err, or its own error where err is 0. */
static int zc_ring_begin(int dev, size_t bytes, zc_ring** rp, size_t* pos) {
	pthread_once(&zc_rings_once, zc_rings_init);
	zc_ring* r = &zc_rings[dev];
	pthread_mutex_lock(&r->mu);
	int err = zc_ring_setup(r);
	if (!err) err = zc_ring_reserve(r, bytes, pos);
	if (err) pthread_mutex_unlock(&r->mu);
	*rp = r;
	return err;
}

static int zc_ring_end(zc_ring* r, CUstream s, size_t pos, size_t bytes, int err) {
	int cerr = zc_ring_commit(r, s, pos, bytes);
	pthread_mutex_unlock(&r->mu);
	return err ? err : cerr;
}

/* Copies the descriptors at r->host + pos to the device on s. */
static int zc_ring_send(zc_ring* r, CUstream s, size_t pos, size_t bytes) {
	return cu.cuMemcpyAsync(r->dev + pos, (CUdeviceptr)(uintptr_t)(r->host + pos), bytes, s);
}

/* ---- batches of segments ------------------------------------------------------------------ */

typedef struct {
	int id; /* the kernel */
	uintptr_t dst;
	float scale;
	uintptr_t flag; /* accumulate only */
	uintptr_t part; /* accumulate only: the blocks' sums of squares, or 0 */
} zc_batch;

static int zc_launch_batch(int dev, CUstream s, const zc_batch* b, zc_segs_arg* a, int64_t blocks) {
	if (blocks > 0x7fffffffLL) return CUDA_ERROR_INVALID_VALUE;
	void* flat[] = {(void*)&b->dst, a, (void*)&b->scale};
	void* acc[] = {(void*)&b->dst, a, (void*)&b->scale, (void*)&b->flag, (void*)&b->part};
	void* unflat[] = {(void*)&b->dst, a};
	void** params = b->id < ZK_ACC ? flat : b->id >= ZK_UNFLATTEN ? unflat : acc;
	return zc_launch(dev, b->id, (unsigned)blocks, 1, ZC_THREADS, s, params);
}

/* Builds the descriptors of segs (dropping empty ones), places them inline
 * or in the ring, and launches once per batch; batches bigger than half the
 * ring are split. */
static int zc_run_segs(int dev, CUstream s, const zc_seg* segs, int nseg, const zc_batch* b) {
	const int max_ring = (int)(ZC_RING_BYTES / 2 / sizeof(zc_dseg));
	zc_segs_arg a;
	int i = 0;
	while (i < nseg) {
		int j = i, n = 0; /* the non-empty segments of this batch */
		while (j < nseg && n < max_ring) {
			if (segs[j].count > 0) n++;
			j++;
		}
		if (n == 0) return 0;
		if (n <= ZC_INLINE_SEGS) {
			int64_t blocks = 0;
			memset(&a, 0, sizeof a);
			a.nseg = zc_build_descs(segs, i, j, a.inl, &blocks);
			int err = zc_launch_batch(dev, s, b, &a, blocks);
			if (err) return err;
		} else {
			zc_ring* r;
			size_t pos = 0, bytes = (size_t)n * sizeof(zc_dseg);
			int err = zc_ring_begin(dev, bytes, &r, &pos);
			if (err) return err;
			int64_t blocks = 0;
			memset(&a, 0, sizeof a);
			a.nseg = zc_build_descs(segs, i, j, (zc_dseg*)(r->host + pos), &blocks);
			a.ext = (uintptr_t)(r->dev + pos);
			err = zc_ring_send(r, s, pos, bytes);
			if (!err) err = zc_launch_batch(dev, s, b, &a, blocks);
			if ((err = zc_ring_end(r, s, pos, bytes, err))) return err;
		}
		i = j;
	}
	return 0;
}

int zc_flatten(int dev, uintptr_t s, uintptr_t dst, int dst_dtype, const zc_seg* segs, int nseg, int src_dtype,
               float scale) {
	if (!zc_dtype_ok(dst_dtype) || !zc_dtype_ok(src_dtype)) return ZC_ERR_BAD_DTYPE;
	ZC_ENTER(dev);
	zc_batch b = {ZK_FLATTEN + zc_dt_index(dst_dtype) * 6 + zc_dt_index(src_dtype) * 2 + (scale != 1.0f), dst, scale, 0, 0};
	ZC_LEAVE(zc_run_segs(dev, (CUstream)s, segs, nseg, &b));
}

int zc_accumulate(int dev, uintptr_t s, uintptr_t acc, int acc_dtype, const zc_seg* segs, int nseg, int src_dtype,
                  int first, float scale, uintptr_t flag, uintptr_t part) {
	if (!zc_dtype_ok(acc_dtype) || !zc_dtype_ok(src_dtype)) return ZC_ERR_BAD_DTYPE;
	if (part && nseg != 1) return CUDA_ERROR_INVALID_VALUE; /* part is indexed by the one segment's chunks */
	ZC_ENTER(dev);
	zc_batch b = {ZK_ACC + zc_dt_index(acc_dtype) * 12 + zc_dt_index(src_dtype) * 4 + (scale != 1.0f) * 2 + (first != 0),
	              acc, scale, flag, part};
	ZC_LEAVE(zc_run_segs(dev, (CUstream)s, segs, nseg, &b));
}

int zc_unflatten(int dev, uintptr_t s, uintptr_t flat, int dtype, const zc_seg* segs, int nseg) {
	if (!zc_dtype_ok(dtype)) return ZC_ERR_BAD_DTYPE;
	ZC_ENTER(dev);
	zc_batch b = {ZK_UNFLATTEN + zc_dt_index(dtype), flat, 1.0f, 0, 0};
	ZC_LEAVE(zc_run_segs(dev, (CUstream)s, segs, nseg, &b));
}

/* An optimizer pass: the range descriptors go to the device through the
 * ring (up to half of it per launch), then one launch over their chunks. */
int zc_optimize(int dev, uintptr_t s, int sgd, uintptr_t p, uintptr_t g, uintptr_t m, uintptr_t v, uintptr_t vmax,
                uintptr_t out, int out_dtype, const zero_opt_range* ranges, int nr, float gscale) {
	if (out && !zc_dtype_ok(out_dtype)) return ZC_ERR_BAD_DTYPE;
	ZC_ENTER(dev);
	const int max_ring = (int)(ZC_RING_BYTES / 2 / sizeof(zc_odesc));
	int id = (sgd ? ZK_SGD : ZK_ADAMW) + (out ? zc_dt_index(out_dtype) : 0);
	int err = 0;
	for (int i = 0; i < nr && !err;) {
		int j = i + max_ring < nr ? i + max_ring : nr;
		zc_ring* r;
		size_t pos = 0, bytes = (size_t)(j - i) * sizeof(zc_odesc);
		if ((err = zc_ring_begin(dev, bytes, &r, &pos))) break;
		int64_t blocks = 0;
		int nd = zc_build_odescs(ranges, i, j, (zc_odesc*)(r->host + pos), &blocks);
		uintptr_t ds = (uintptr_t)(r->dev + pos);
		err = zc_ring_send(r, (CUstream)s, pos, bytes);
		if (!err && nd > 0 && blocks > 0x7fffffffLL) err = CUDA_ERROR_INVALID_VALUE;
		if (!err && nd > 0) {
			void* pa[] = {&p, &g, &m, &v, &vmax, &out, &ds, &nd, &gscale};
			void* ps[] = {&p, &g, &m, &out, &ds, &nd, &gscale};
			err = zc_launch(dev, id, (unsigned)blocks, 1, ZC_THREADS, (CUstream)s, sgd ? ps : pa);
		}
		err = zc_ring_end(r, (CUstream)s, pos, bytes, err);
		i = j;
	}
	ZC_LEAVE(err);
}

int zc_cast(int dev, uintptr_t s, uintptr_t dst, int dst_dtype, uintptr_t src, int src_dtype, int64_t n,
            float scale) {
	zc_seg one = {src, n, 0};
	return zc_flatten(dev, s, dst, dst_dtype, &one, 1, src_dtype, scale);
}

int zc_sumsq(int dev, uintptr_t s, uintptr_t x, int64_t n, uintptr_t scratch, uintptr_t out) {
	ZC_ENTER(dev);
	int64_t nb = (n + ZC_THREADS * 16 - 1) / (ZC_THREADS * 16);
	if (nb < 1) nb = 1;
	if (nb > ZC_SUMSQ_MAX_BLOCKS) nb = ZC_SUMSQ_MAX_BLOCKS;
	int nbi = (int)nb;
	uintptr_t res = scratch + (uintptr_t)nb * sizeof(double);
	void* p1[] = {&x, &n, &scratch};
	void* p2[] = {&scratch, &nbi, &res};
	int err = zc_launch(dev, ZK_SUMSQ_PART, (unsigned)nb, 1, ZC_THREADS, (CUstream)s, p1);
	if (!err) err = zc_launch(dev, ZK_SUMSQ_FINAL, 1, 1, ZC_THREADS, (CUstream)s, p2);
	if (!err) err = cu.cuMemcpyAsync((CUdeviceptr)out, (CUdeviceptr)res, sizeof(double), (CUstream)s);
	ZC_LEAVE(err);
}

int zc_chunk_squares(int dev, uintptr_t s, uintptr_t x, int dtype, int64_t n, uintptr_t part) {
	if (!zc_dtype_ok(dtype)) return ZC_ERR_BAD_DTYPE;
	if (n <= 0) return 0;
	const int64_t blocks = (n + ZC_CHUNK - 1) / ZC_CHUNK;
	if (blocks > 0x7fffffffLL) return CUDA_ERROR_INVALID_VALUE;
	ZC_ENTER(dev);
	void* params[] = {&x, &n, &part};
	ZC_LEAVE(zc_launch(dev, ZK_CHUNKSQ + zc_dt_index(dtype), (unsigned)blocks, 1, ZC_THREADS, (CUstream)s, params));
}

/* The ranges go to the device through the ring (up to half of it per
 * launch), then one launch of a block per range. */
int zc_sum_chunks(int dev, uintptr_t s, uintptr_t part, const zc_crange* ranges, int nr, uintptr_t out) {
	if (nr <= 0) return 0;
	ZC_ENTER(dev);
	const int max_ring = (int)(ZC_RING_BYTES / 2 / sizeof(zc_crange));
	int err = 0;
	for (int i = 0; i < nr && !err;) {
		int j = i + max_ring < nr ? i + max_ring : nr;
		zc_ring* r;
		size_t pos = 0, bytes = (size_t)(j - i) * sizeof(zc_crange);
		if ((err = zc_ring_begin(dev, bytes, &r, &pos))) break;
		memcpy(r->host + pos, ranges + i, bytes);
		uintptr_t rd = (uintptr_t)(r->dev + pos), o = out + (uintptr_t)i * sizeof(double);
		err = zc_ring_send(r, (CUstream)s, pos, bytes);
		void* params[] = {&part, &rd, &o};
		if (!err) err = zc_launch(dev, ZK_SUMCHUNKS, (unsigned)(j - i), 1, ZC_THREADS, (CUstream)s, params);
		err = zc_ring_end(r, (CUstream)s, pos, bytes, err);
		i = j;
	}
	ZC_LEAVE(err);
}

int zc_reduce(int dev, uintptr_t s, const uintptr_t* dsts, int nout, const uintptr_t* srcs, int nsrc, int dtype,
              int op, int64_t count) {
	if (nout <= 0 || nsrc <= 0 || count <= 0) return 0;
	zc_red_arg a;
	int err = zc_red_setup(&a, dsts, nout, srcs, nsrc, dtype, op, count);
	if (err) return err;
	ZC_ENTER(dev);
	void* params[] = {&a};
	unsigned g = zc_grid(((a.vec ? count / ZC_PACK : count) + ZC_UNROLL - 1) / ZC_UNROLL);
	ZC_LEAVE(zc_launch(dev, ZK_REDUCE + zc_dt_index(dtype) * 3 + zc_op_index(op), g, (unsigned)nout, ZC_THREADS,
	                   (CUstream)s, params));
}

int zc_allreduce(int dev, uintptr_t s, const uintptr_t* bufs, int n, int dtype, int op, int64_t count) {
	if (n <= 0 || count <= 0) return 0;
	zc_red_arg a;
	int err = zc_red_setup(&a, bufs, 0, bufs, n, dtype, op, count);
	if (err) return err;
	ZC_ENTER(dev);
	void* params[] = {&a};
	unsigned g = zc_grid(((a.vec ? count / ZC_PACK : count) + ZC_UNROLL - 1) / ZC_UNROLL);
	ZC_LEAVE(zc_launch(dev, ZK_ALLREDUCE + zc_dt_index(dtype) * 3 + zc_op_index(op), g, 1, ZC_THREADS, (CUstream)s,
	                   params));
}

int zc_spin(int dev, uintptr_t s, int64_t ns) {
	ZC_ENTER(dev);
	void* params[] = {&ns};
	ZC_LEAVE(zc_launch(dev, ZK_SPIN, 1, 1, 1, (CUstream)s, params));
}

/* ---- the kernels' attributes (the GPU runner's record) ----------------------- */

int zc_kernel_count(void) { return ZK_N; }

int zc_kernel_info(int dev, int id, char* name, int namelen, int* attrs) {
	static const int which[ZC_KATTR_N] = {
	    CU_FUNC_ATTRIBUTE_NUM_REGS,     CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES,      CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES,
	    CU_FUNC_ATTRIBUTE_CONST_SIZE_BYTES, CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK, CU_FUNC_ATTRIBUTE_PTX_VERSION,
	    CU_FUNC_ATTRIBUTE_BINARY_VERSION};
	if (id < 0 || id >= ZK_N) return CUDA_ERROR_INVALID_VALUE;
	zk_name(id, name, (size_t)namelen);
	ZC_ENTER(dev);
	CUfunction f;
	int err = zc_kernel(dev, id, &f);
	for (int i = 0; !err && i < ZC_KATTR_N; i++) err = cu.cuFuncGetAttribute(&attrs[i], which[i], f);
	ZC_LEAVE(err);
}

/* ---- for nccl_loader.c: NCCL takes the device from the current context ---- */

int zc_bind_device(int dev, uintptr_t* saved) {
	zc_scope sc;
	int err = zc_enter(dev, &sc);
	*saved = (uintptr_t)sc.saved;
	return err;
}

void zc_unbind_device(uintptr_t saved) {
	if (__atomic_load_n(&zc_loaded, __ATOMIC_ACQUIRE)) cu.cuCtxSetCurrent((CUcontext)saved);
}

/* ---- the calling thread's context (tests) --------------------------------- */

int zc_context_current(uintptr_t* c) {
	int err = zc_ensure();
	CUcontext x = NULL;
	if (!err) err = cu.cuCtxGetCurrent(&x);
	*c = (uintptr_t)x;
	return err;
}

int zc_context_set(uintptr_t c) {
	int err = zc_ensure();
	return err ? err : cu.cuCtxSetCurrent((CUcontext)c);
}
