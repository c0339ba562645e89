//go:build cuda

/*
 * nccl_loader.c: NCCL for zero, loaded at run time with dlopen, so that a
 * binary built with -tags cuda starts on a host without NCCL and NewNCCL
 * reports a clear error instead of the dynamic loader refusing to start the
 * program.
 *
 * The types, codes and prototypes come from cuda_api.h, the project's own
 * declarations, so no nccl.h is needed to build; the functions come from
 * whatever libnccl.so.2 the host provides (PyTorch's on the GPU hosts).
 * Communicators are created non-blocking, so no NCCL call can block the
 * caller forever: a call that returns ncclInProgress is polled here with a
 * deadline, and the Go side aborts the communicator when the deadline passes.
 */
#include <dlfcn.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "cuda_api.h"
#include "zero_cuda.h"

/* NCCL takes the device from the calling thread's current context: the
 * device's primary context, made current by cuda_driver.c. */
int zc_bind_device(int dev, uintptr_t* saved);
void zc_unbind_device(uintptr_t saved);

struct zn_lib {
	int loaded;
	void* lib;
#define ZN_FIELD(name, sym, ret, args) ret(*name) args;
	ZC_NCCL_FUNCS(ZN_FIELD)
#undef ZN_FIELD
};

static struct zn_lib zn;
static pthread_mutex_t zn_mu = PTHREAD_MUTEX_INITIALIZER;

#define ZN_SYM(field, name)                                                                                      \
	do {                                                                                                     \
		*(void**)(&l->field) = dlsym(lib, name);                                                         \
		if (!l->field) {                                                                                 \
			const char* e_ = dlerror();                                                              \
			snprintf(msg, (size_t)msglen, "%s: symbol %s not found: %s", path, name, e_ ? e_ : "");  \
			goto fail;                                                                               \
		}                                                                                                \
	} while (0)

/* dlopen path and resolve every symbol into *l; ZC_ERR_NO_NCCL with the
 * loader's message on failure. */
static int zn_open(const char* path, struct zn_lib* l, char* msg, int msglen) {
	memset(l, 0, sizeof(*l));
	dlerror();
	void* lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
	if (!lib) {
		const char* e = dlerror();
		snprintf(msg, (size_t)msglen, "%s", e ? e : path);
		return ZC_ERR_NO_NCCL;
	}
#define ZN_LOAD(name, sym, ret, args) ZN_SYM(name, sym);
	ZC_NCCL_FUNCS(ZN_LOAD)
#undef ZN_LOAD
	l->lib = lib;
	l->loaded = 1;
	return 0;
fail:
	memset(l, 0, sizeof(*l));
	dlclose(lib);
	return ZC_ERR_NO_NCCL;
}

int zc_nccl_load(const char* path, char* msg, int msglen) {
	if (msglen > 0) msg[0] = 0;
	if (!path || !path[0]) path = "libnccl.so.2";
	pthread_mutex_lock(&zn_mu);
	int err = 0;
	if (!zn.loaded) {
		struct zn_lib l;
		err = zn_open(path, &l, msg, msglen);
		if (!err) zn = l;
	}
	pthread_mutex_unlock(&zn_mu);
	return err;
}

int zc_nccl_probe(const char* path, char* msg, int msglen) {
	if (msglen > 0) msg[0] = 0;
	if (!path || !path[0]) path = "libnccl.so.2";
	struct zn_lib l;
	int err = zn_open(path, &l, msg, msglen);
	if (!err) dlclose(l.lib); /* the library stays mapped if zn holds it too */
	return err;
}

int zc_nccl_loaded(void) {
	pthread_mutex_lock(&zn_mu);
	int v = zn.loaded;
	pthread_mutex_unlock(&zn_mu);
	return v;
}

int zc_nccl_version(int* version) {
	*version = 0;
	if (!zn.loaded) return ZC_ERR_NO_NCCL;
	return (int)zn.get_version(version);
}

const char* zc_nccl_error_string(int code) {
	if (code == ZC_ERR_NO_NCCL) return "libnccl.so.2 is not loaded";
	if (!zn.loaded) return "unknown NCCL error (libnccl.so.2 not loaded)";
	return zn.error_string(code);
}

void zc_nccl_last_error(uintptr_t comm, char* msg, int msglen) {
	if (msglen <= 0) return;
	msg[0] = 0;
	if (!zn.loaded) return;
	const char* e = zn.last_error((ncclComm_t)comm);
	if (e) snprintf(msg, (size_t)msglen, "%s", e);
}

int zc_nccl_unique_id(char* id128) {
	if (!zn.loaded) return ZC_ERR_NO_NCCL;
	ncclUniqueId id;
	ncclResult_t r = zn.get_unique_id(&id);
	if (r == ncclSuccess) memcpy(id128, id.internal, sizeof id.internal);
	return (int)r;
}

static int64_t zn_now_ms(void) {
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Poll a non-blocking communicator until it leaves ncclInProgress or the
 * deadline passes: first by yielding (enqueueing usually takes µs), then by
 * sleeping 100 µs between polls. */
static int zn_wait(ncclComm_t comm, int64_t timeout_ms) {
	int64_t deadline = zn_now_ms() + (timeout_ms > 0 ? timeout_ms : 0);
	for (int spin = 0;; spin++) {
		ncclResult_t state = ncclSuccess;
		ncclResult_t r = zn.async_error(comm, &state);
		if (r != ncclSuccess) return (int)r;
		if (state != ncclInProgress) return (int)state;
		if (zn_now_ms() >= deadline) return (int)ncclInProgress;
		if (spin < 1000) {
			sched_yield();
		} else {
			struct timespec ts = {0, 100000};
			nanosleep(&ts, NULL);
		}
	}
}

int zc_nccl_init(int dev, const char* id128, int world, int rank, int64_t timeout_ms, uintptr_t* comm) {
	*comm = 0;
	if (!zn.loaded) return ZC_ERR_NO_NCCL;
	uintptr_t saved = 0;
	if (zc_bind_device(dev, &saved)) return ncclUnhandledCudaError;
	ncclUniqueId id;
	memcpy(id.internal, id128, sizeof id.internal);
	zc_nccl_config config = {sizeof(zc_nccl_config), ZC_NCCL_CONFIG_MAGIC, ZC_NCCL_CONFIG_VERSION, 0 /* non-blocking */};
	ncclComm_t c = NULL;
	ncclResult_t r = zn.init_rank_config(&c, world, id, rank, &config);
	int s = r;
	if (r == ncclSuccess || r == ncclInProgress) s = zn_wait(c, timeout_ms);
	if (s != ncclSuccess && c) zn.comm_abort(c);
	if (s == ncclSuccess) *comm = (uintptr_t)c;
	zc_unbind_device(saved);
	return s;
}

int zc_nccl_async_error(uintptr_t comm, int* state) {
	*state = 0;
	if (!zn.loaded) return ZC_ERR_NO_NCCL;
	ncclResult_t st = ncclSuccess;
	ncclResult_t r = zn.async_error((ncclComm_t)comm, &st);
	*state = (int)st;
	return (int)r;
}

int zc_nccl_abort(int dev, uintptr_t comm) {
	if (!zn.loaded) return ZC_ERR_NO_NCCL;
	uintptr_t saved = 0;
	int bound = zc_bind_device(dev, &saved) == 0;
	int r = zn.comm_abort((ncclComm_t)comm);
	if (bound) zc_unbind_device(saved);
	return r;
}

int zc_nccl_destroy(int dev, uintptr_t comm, int64_t timeout_ms) {
	if (!zn.loaded) return ZC_ERR_NO_NCCL;
	uintptr_t saved = 0;
	int bound = zc_bind_device(dev, &saved) == 0;
	ncclComm_t c = (ncclComm_t)comm;
	ncclResult_t r = zn.comm_finalize(c);
	int s = (r == ncclSuccess || r == ncclInProgress) ? zn_wait(c, timeout_ms) : (int)r;
	if (s != ncclSuccess)
		zn.comm_abort(c);
	else
		s = zn.comm_destroy(c);
	if (bound) zc_unbind_device(saved);
	return s;
}

static int zn_dtype(int d) {
	switch (d) {
	case ZERO_BF16: return ncclBfloat16;
	case ZERO_F16: return ncclFloat16;
	default: return ncclFloat32;
	}
}

static int zn_op(int op) {
	switch (op) {
	case ZERO_AVG: return ncclAvg;
	case ZERO_MAX: return ncclMax;
	default: return ncclSum;
	}
}

int zc_nccl_batch(int dev, uintptr_t comm, const zc_nccl_op* ops, int n, int64_t timeout_ms) {
	if (!zn.loaded) return ZC_ERR_NO_NCCL;
	uintptr_t saved = 0;
	if (zc_bind_device(dev, &saved)) return ncclUnhandledCudaError;
	ncclComm_t c = (ncclComm_t)comm;
	ncclResult_t first = zn.group_start();
	if (first != ncclSuccess) {
		zc_unbind_device(saved);
		return first;
	}
	for (int i = 0; i < n; i++) {
		const zc_nccl_op* o = &ops[i];
		CUstream s = (CUstream)o->stream;
		int dt = zn_dtype(o->dtype);
		ncclResult_t r = ncclSuccess;
		switch (o->kind) {
		case 0: r = zn.all_reduce((const void*)o->send, (void*)o->recv, o->count, dt, zn_op(o->op), c, s); break;
		case 1: r = zn.reduce_scatter((const void*)o->send, (void*)o->recv, o->count, dt, zn_op(o->op), c, s); break;
		case 2: r = zn.all_gather((const void*)o->send, (void*)o->recv, o->count, dt, c, s); break;
		case 3: r = zn.broadcast((const void*)o->send, (void*)o->recv, o->count, dt, o->root, c, s); break;
		default: r = ncclInvalidArgument; break;
		}
		if (r != ncclSuccess && r != ncclInProgress && first == ncclSuccess) first = r;
	}
	/* the group must be closed on this thread whatever happened inside it */
	ncclResult_t r = zn.group_end();
	if (first == ncclSuccess) first = r == ncclInProgress ? zn_wait(c, timeout_ms) : r;
	zc_unbind_device(saved);
	return first;
}
