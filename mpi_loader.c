/*
 * mpi_loader.c: MPI for zero, loaded at run time with dlopen, so that the
 * default build has no link dependency on MPI and NewMPI reports a missing
 * library as an error that says how to install one.
 *
 * Two ABIs: MPICH's (libmpi.so.12; also Intel MPI, MVAPICH and Cray MPICH),
 * whose handles are ints, and the MPI 5.0 standard ABI (libmpi_abi.so; MPICH
 * 5 ships it), whose handles are pointers. Which one a library speaks is read
 * from MPI_Abi_get_version, which only a standard-ABI library answers with a
 * version (MPICH's libmpi.so.12 answers −1, older libraries lack it). Every
 * call below is made under mpi.go's one lock (MPI_THREAD_SERIALIZED) or on
 * its MPI thread (funneled).
 *
 * MPI moves bytes only (MPI_BYTE, point to point); zero reduces on the host.
 * MPI's own collectives are loaded only as a benchmark's yardstick (zm_own).
 */
#include <dlfcn.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "mpi_api.h"

#define ZM_STATUS_INTS 16 /* ints: more than either ABI's MPI_Status */
#define ZM_MAX_ERROR_STRING 512

static int64_t zm_now_ms(void) {
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* MPICH's ABI (mpi.h of MPICH 3 to 5): handles are ints. */
static pthread_mutex_t zm_mu = PTHREAD_MUTEX_INITIALIZER;
static int zm_which; /* ZM_ABI_*, 0 until loaded and after finalize */
static void* zm_dl;

#define ZM_NS(x) zm_mpich_##x
#define ZM_H int
#define ZM_K_COMM_WORLD ((int)0x44000000)
#define ZM_K_COMM_NULL ((int)0x04000000)
#define ZM_K_BYTE ((int)0x4c00010d)
#define ZM_K_FLOAT ((int)0x4c00040a)
#define ZM_K_SUM ((int)0x58000003)
#define ZM_K_ERRORS_RETURN ((int)0x54000001)
#define ZM_K_REQUEST_NULL ((int)0x2c000000)
#define ZM_K_TAG_UB ((int)0x64400001)
#define ZM_K_INFO_NULL ((int)0x1c000000)
#define ZM_K_COMM_TYPE_SHARED 1
#define ZM_K_ANY_SOURCE (-2)
#define ZM_K_ANY_TAG (-1)
#define ZM_K_UNDEFINED (-32766)
#define ZM_K_ERR_TRUNCATE 14
#define ZM_K_THREAD_FUNNELED 1
#define ZM_K_THREAD_SERIALIZED 2
#define ZM_K_THREAD_MULTIPLE 3
#define ZM_K_SOURCE 2 /* count_lo, count_hi_and_cancelled, MPI_SOURCE, MPI_TAG, MPI_ERROR */
#define ZM_K_TAG 3
#include "mpi_loader_abi.h"
#undef ZM_NS
#undef ZM_H
#undef ZM_K_COMM_WORLD
#undef ZM_K_COMM_NULL
#undef ZM_K_BYTE
#undef ZM_K_FLOAT
#undef ZM_K_SUM
#undef ZM_K_ERRORS_RETURN
#undef ZM_K_REQUEST_NULL
#undef ZM_K_TAG_UB
#undef ZM_K_INFO_NULL
#undef ZM_K_COMM_TYPE_SHARED
#undef ZM_K_ANY_SOURCE
#undef ZM_K_ANY_TAG
#undef ZM_K_UNDEFINED
#undef ZM_K_ERR_TRUNCATE
#undef ZM_K_THREAD_FUNNELED
#undef ZM_K_THREAD_SERIALIZED
#undef ZM_K_THREAD_MULTIPLE
#undef ZM_K_SOURCE
#undef ZM_K_TAG

/* The MPI 5.0 standard ABI (mpi_abi.h): handles are pointers to small
 * constants. */
#define ZM_NS(x) zm_std_##x
#define ZM_H void*
#define ZM_K_COMM_WORLD ((void*)0x101)
#define ZM_K_COMM_NULL ((void*)0x100)
#define ZM_K_BYTE ((void*)0x247)
#define ZM_K_FLOAT ((void*)0x210)
#define ZM_K_SUM ((void*)0x21)
#define ZM_K_ERRORS_RETURN ((void*)0x143)
#define ZM_K_REQUEST_NULL ((void*)0x180)
#define ZM_K_TAG_UB 501
#define ZM_K_INFO_NULL ((void*)0x130)
#define ZM_K_COMM_TYPE_SHARED 221
#define ZM_K_ANY_SOURCE (-1)
#define ZM_K_ANY_TAG (-2)
#define ZM_K_UNDEFINED (-32766)
#define ZM_K_ERR_TRUNCATE 15
#define ZM_K_THREAD_FUNNELED 1024
#define ZM_K_THREAD_SERIALIZED 2048
#define ZM_K_THREAD_MULTIPLE 4096
#define ZM_K_SOURCE 0 /* MPI_SOURCE, MPI_TAG, MPI_ERROR, internal[5] */
#define ZM_K_TAG 1
#include "mpi_loader_abi.h"


/* Go's runtime handles the signals it relies on (SIGSEGV and SIGBUS for nil
 * dereferences, SIGURG for preemption, SIGPROF, SIGPIPE, and every signal a
 * program asks for with signal.Notify) and expects its handlers to stay. MPI
 * libraries and their transports install their own, some when they are
 * loaded (UCX's error signals, from a library constructor), some in
 * MPI_Init_thread (MPICH's SIGUSR1; Open MPI's backtrace handlers), which
 * would turn a recoverable Go panic into a crash report. The handlers are
 * saved before the library is opened and every one that changed is put
 * back after it is opened, closed or initialised, unless
 * ZERO_MPI_SIGNALS=keep. */
#define ZM_NSIG 65
typedef struct {
	struct sigaction act[ZM_NSIG];
} zm_sigs;

static void zm_signals_save(zm_sigs* s) {
	memset(s, 0, sizeof *s);
	for (int sig = 1; sig < ZM_NSIG && sig < NSIG; sig++) sigaction(sig, NULL, &s->act[sig]);
}

/* Puts back every handler that differs from s; returns the signals' bits. */
static uint64_t zm_signals_restore(const zm_sigs* s) {
	const char* keep = getenv("ZERO_MPI_SIGNALS");
	uint64_t restored = 0;
	for (int sig = 1; sig < 64 && sig < NSIG; sig++) {
		if (sig == SIGKILL || sig == SIGSTOP) continue;
		struct sigaction now;
		if (sigaction(sig, NULL, &now)) continue;
		if (now.sa_handler == s->act[sig].sa_handler && now.sa_flags == s->act[sig].sa_flags) continue;
		if (keep && !strcmp(keep, "keep")) continue;
		if (!sigaction(sig, &s->act[sig], NULL)) restored |= (uint64_t)1 << sig;
	}
	return restored;
}

/* The handlers before the process's MPI was opened (zm_load). */
static zm_sigs zm_go_sigs;
static uint64_t zm_load_restored;

/* dlopen path and resolve every symbol of its ABI into the library's table
 * (l: zm_mpich_fn or zm_std_fn, or a probe's own); 0 and *lib, or
 * ZM_ERR_NOT_LOADED with the loader's message. */
static int zm_open(const char* path, int mode, void** handle, int* abi, struct zm_mpich_lib* a, struct zm_std_lib* b,
                   char* msg, int msglen) {
	dlerror();
	void* lib = dlopen(path, mode);
	if (!lib) {
		const char* e = dlerror();
		snprintf(msg, (size_t)msglen, "%s", e ? e : path);
		return ZM_ERR_NOT_LOADED;
	}
	int (*abi_version)(int*, int*) = (int (*)(int*, int*))dlsym(lib, "MPI_Abi_get_version");
	int major = -1, minor = -1;
	if (abi_version && abi_version(&major, &minor)) major = -1;
	*abi = major >= 1 ? ZM_ABI_STANDARD : ZM_ABI_MPICH;
	int bad = *abi == ZM_ABI_STANDARD ? zm_std_resolve(b, lib, path, msg, msglen) : zm_mpich_resolve(a, lib, path, msg, msglen);
	if (bad) {
		dlclose(lib);
		return ZM_ERR_NOT_LOADED;
	}
	*handle = lib;
	return 0;
}

int zm_load(const char* path, int* abi, char* msg, int msglen) {
	if (msglen > 0) msg[0] = 0;
	pthread_mutex_lock(&zm_mu);
	int err = 0;
	if (!zm_which) {
		/* RTLD_GLOBAL: MPI libraries load plugins (fabrics, shared-memory
		 * transports) that resolve symbols of libmpi itself */
		int which = 0;
		zm_signals_save(&zm_go_sigs);
		err = zm_open(path, RTLD_NOW | RTLD_GLOBAL, &zm_dl, &which, &zm_mpich_fn, &zm_std_fn, msg, msglen);
		zm_load_restored |= zm_signals_restore(&zm_go_sigs);
		if (!err) zm_which = which;
	}
	*abi = zm_which;
	pthread_mutex_unlock(&zm_mu);
	return err;
}

int zm_probe(const char* path, int* abi, char* version, int vlen, char* msg, int msglen) {
	if (msglen > 0) msg[0] = 0;
	if (vlen > 0) version[0] = 0;
	struct zm_mpich_lib a;
	struct zm_std_lib b;
	void* lib = NULL;
	zm_sigs saved;
	zm_signals_save(&saved);
	int err = zm_open(path, RTLD_NOW | RTLD_LOCAL, &lib, abi, &a, &b, msg, msglen);
	if (err) {
		zm_signals_restore(&saved);
		return err;
	}
	char s[8192 + 1] = {0};
	int n = 0;
	if (*abi == ZM_ABI_STANDARD ? b.get_library_version(s, &n) : a.get_library_version(s, &n)) s[0] = 0;
	snprintf(version, (size_t)vlen, "%s", s);
	dlclose(lib); /* the library stays if the process holds it too */
	zm_signals_restore(&saved);
	return 0;
}

#define ZM_CALL(call)                                                                                            \
	switch (zm_which) {                                                                                      \
	case ZM_ABI_MPICH: return zm_mpich_##call;                                                               \
	case ZM_ABI_STANDARD: return zm_std_##call;                                                              \
	default: return ZM_ERR_NOT_LOADED;                                                                       \
	}

int zm_init(int want, int* level, int* was_init, uint64_t* restored) {
	*level = 0;
	*was_init = 0;
	*restored = 0;
	int err = ZM_ERR_NOT_LOADED;
	if (zm_which == ZM_ABI_MPICH) err = zm_mpich_init(want, level, was_init);
	if (zm_which == ZM_ABI_STANDARD) err = zm_std_init(want, level, was_init);
	if (!*was_init) *restored = zm_load_restored | zm_signals_restore(&zm_go_sigs);
	return err;
}

/* MPI_Finalize, then dlclose: MPICH leaves part of its finalization (PMI's
 * finalize, which tells Hydra this process ended well) to the library's exit
 * handlers, which a Go program's exit never runs; closing the library runs
 * them now. Without it Hydra takes the first process to exit for a failed one
 * and kills the rest. No MPI call can follow. */
int zm_finalize(void) {
	int err = ZM_ERR_NOT_LOADED;
	if (zm_which == ZM_ABI_MPICH) err = zm_mpich_fn.finalize();
	if (zm_which == ZM_ABI_STANDARD) err = zm_std_fn.finalize();
	if (!err) {
		pthread_mutex_lock(&zm_mu);
		dlclose(zm_dl);
		zm_dl = NULL;
		zm_which = 0;
		pthread_mutex_unlock(&zm_mu);
	}
	return err;
}

int zm_comm_create(int split, int color, uintptr_t* comm, int* rank, int* size, int* tag_ub, int* local) {
	ZM_CALL(comm_create(split, color, comm, rank, size, tag_ub, local))
}

int zm_comm_free(uintptr_t comm) { ZM_CALL(comm_free(comm)) }

int zm_post(uintptr_t comm, zm_xfer* x, int n) { ZM_CALL(post(comm, x, n)) }

int zm_test(zm_xfer* x, int n) { ZM_CALL(test(x, n)) }

int zm_cancel(zm_xfer* x, int budget_ms) { ZM_CALL(cancel(x, budget_ms)) }

int zm_own(uintptr_t comm, int gather, uintptr_t send, uintptr_t recv, int64_t part_bytes, int calls) {
	ZM_CALL(own(comm, gather, send, recv, part_bytes, calls))
}

int zm_iprobe(uintptr_t comm, int peer, int* flag, int* tag, int64_t* bytes) {
	ZM_CALL(iprobe(comm, peer, flag, tag, bytes))
}

int zm_error_string(int code, char* buf, int len, int* truncate) {
	*truncate = 0;
	if (code == ZM_ERR_NOT_LOADED) {
		snprintf(buf, (size_t)len, "no MPI library is loaded");
		return -1;
	}
	ZM_CALL(error_string(code, buf, len, truncate))
}
