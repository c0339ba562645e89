/*
 * fakecuda.cc: a fake libcuda.so.1 over host memory, for the tests of the
 * CUDA path on machines without a GPU. The tests build it (g++ -shared) when
 * ZERO_FAKE_CUDA=1 and point the loader at it with ZERO_CUDA_LIBRARY.
 *
 * It implements the driver entry points of cuda_api.h with CUDA's semantics
 * where the library depends on them:
 *   - device memory and pinned memory are host allocations; a device pointer
 *     is a host address;
 *   - each stream is a thread running its queue in order; stream 0 is one
 *     more; events are positions in a stream (not ready until the stream got
 *     there, and a never-recorded event is ready); a wait on an event takes
 *     the position it has when the wait is enqueued;
 *   - copies from or to pageable memory (not allocated here) run in stream
 *     order and are complete when the call returns;
 *   - a call that needs a context fails with CUDA_ERROR_INVALID_CONTEXT when
 *     the thread has none current;
 *   - the module accepts a fatbin (checked by its magic) and knows the kernels
 *     by their C names; a launch runs the kernel bodies of kernels_dev.cuh on
 *     the stream's thread, block by block and thread by thread (emu_launch.h),
 *     so results are those of the real kernels' code.
 * Every call returns its own status. FAKECUDA_DRIVER sets the driver version
 * (default 12040), FAKECUDA_CC the compute capability (default 9.0).
 * FAKECUDA_FAIL_EVENT_SYNC, read at each call, names streams (their handles,
 * as strtoull reads them, separated by commas): cuEventSynchronize of an
 * untimed event last recorded on one waits, then returns
 * CUDA_ERROR_LAUNCH_FAILED, and nothing else fails,
 * as when the work before the event failed and only its wait can tell.
 *
 * The enqueue trace: FAKECUDA_TRACE names a file (read once, at the first
 * traced call); while that file exists, every copy, kernel launch, event
 * record, stream wait and host sync appends one line to it as it is
 * enqueued (or, for a sync, as it returns), in the order of the calls:
 *   copy S DST SRC BYTES | launch S KIND OUT | record S E GEN |
 *   wait S E GEN | waitvalue S ADDR | sync S | esync E GEN
 * (S a stream, 0 the legacy one; E an event; OUT what the kernel writes, 0
 * where it writes through descriptors). A test starts a trace by creating
 * the file and stops it by renaming the file away: a rename is atomic, and
 * the fake never creates the file itself.
 */
#include <chrono>
#include <condition_variable>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <thread>

#include "cuda_api.h"
#include "emu_launch.h"

/* ---- memory ------------------------------------------------------------------ */

static std::mutex mem_mu;
static std::map<uintptr_t, size_t> allocs; /* base -> bytes, device and pinned */
static std::map<uintptr_t, bool> pinned;   /* base -> whether it is pinned host memory */
static size_t allocated;
static const size_t total_mem = (size_t)80 << 30;

static void* fake_alloc(size_t bytes, bool host) {
	void* p = aligned_alloc(256, (bytes + 255) / 256 * 256 + 256);
	if (!p) return nullptr;
	std::lock_guard<std::mutex> g(mem_mu);
	allocs[(uintptr_t)p] = bytes;
	pinned[(uintptr_t)p] = host;
	allocated += bytes;
	return p;
}

static bool fake_free(void* p) {
	std::lock_guard<std::mutex> g(mem_mu);
	auto it = allocs.find((uintptr_t)p);
	if (it == allocs.end()) return false;
	allocated -= it->second;
	allocs.erase(it);
	pinned.erase((uintptr_t)p);
	free(p);
	return true;
}

/* Whether [p, p+n) lies in memory allocated here (device or pinned). */
static bool ours(uintptr_t p, size_t n) {
	std::lock_guard<std::mutex> g(mem_mu);
	auto it = allocs.upper_bound(p);
	if (it == allocs.begin()) return false;
	--it;
	return p >= it->first && p + n <= it->first + it->second;
}

/* Whether [p, p+n) lies in device memory allocated here (not pinned). */
static bool device(uintptr_t p, size_t n) {
	std::lock_guard<std::mutex> g(mem_mu);
	auto it = allocs.upper_bound(p);
	if (it == allocs.begin()) return false;
	--it;
	return p >= it->first && p + n <= it->first + it->second && !pinned[it->first];
}

/* ---- the enqueue trace -------------------------------------------------------------- */

static std::mutex trace_mu;

static void trace(const char* fmt, ...) {
	static const char* path = getenv("FAKECUDA_TRACE"); /* read once: no getenv beside a setenv */
	if (!path || !*path) return;
	std::lock_guard<std::mutex> g(trace_mu);
	FILE* f = fopen(path, "r+"); /* never creates it: no file, no trace */
	if (!f) return;
	fseek(f, 0, SEEK_END);
	va_list ap;
	va_start(ap, fmt);
	vfprintf(f, fmt, ap);
	va_end(ap);
	fputc('\n', f);
	fclose(f);
}

/* ---- contexts ------------------------------------------------------------------ */

struct CUctx_st {
	int dev;
};
static CUctx_st primary[8] = {{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}};
static thread_local CUcontext current = nullptr;

static int ndevices() {
	const char* v = getenv("FAKECUDA_DEVICES");
	int n = v ? atoi(v) : 1;
	return n < 0 ? 0 : n > 8 ? 8 : n;
}

#define NEED_CTX()                                          \
	do {                                                \
		if (!current) return CUDA_ERROR_INVALID_CONTEXT; \
	} while (0)

/* ---- streams and events ---------------------------------------------------------- */

struct CUstream_st {
	std::mutex mu;
	std::condition_variable cv, idle;
	std::deque<std::function<void()>> q;
	bool stop = false, busy = false;
	std::thread th;
	CUstream_st() : th([this] { run(); }) {}
	~CUstream_st() {
		{
			std::lock_guard<std::mutex> g(mu);
			stop = true;
		}
		cv.notify_all();
		th.join();
	}
	void run() {
		std::unique_lock<std::mutex> l(mu);
		for (;;) {
			cv.wait(l, [this] { return stop || !q.empty(); });
			if (q.empty()) return;
			auto f = std::move(q.front());
			q.pop_front();
			busy = true;
			l.unlock();
			f();
			l.lock();
			busy = false;
			if (q.empty()) idle.notify_all();
		}
	}
	void push(std::function<void()> f) {
		std::lock_guard<std::mutex> g(mu);
		q.push_back(std::move(f));
		cv.notify_all();
	}
	void drain() {
		std::unique_lock<std::mutex> l(mu);
		idle.wait(l, [this] { return q.empty() && !busy; });
	}
};

static CUstream_st* legacy() {
	static CUstream_st* s = new CUstream_st;
	return s;
}
static CUstream_st* S(CUstream s) { return s ? s : legacy(); }

static std::mutex streams_mu;
static std::map<CUstream, int> streams;

struct CUevent_st {
	std::mutex mu;
	std::condition_variable cv;
	uint64_t recorded = 0, completed = 0;
	bool timing = true;
	CUstream stream = nullptr; /* the stream of its last record */
	std::chrono::steady_clock::time_point at;
	/* work queued on streams that still uses the event (records, waits);
	 * a destroyed event is freed by whichever of those finishes last, as
	 * CUDA frees a destroyed event once the device is done with it */
	int users = 0;
	bool destroyed = false;
	void wait_for(uint64_t g) {
		std::unique_lock<std::mutex> l(mu);
		cv.wait(l, [&] { return completed >= g; });
	}
	void use() {
		std::lock_guard<std::mutex> l(mu);
		users++;
	}
	/* done ends one use (or, with destroy, the owner's) and frees the event
	 * when nothing uses it any more */
	static void done(CUevent_st* e, bool destroy) {
		bool last;
		{
			std::lock_guard<std::mutex> l(e->mu);
			if (destroy) e->destroyed = true;
			else e->users--;
			last = e->destroyed && e->users == 0;
		}
		if (last) delete e;
	}
};

/* ---- kernels ----------------------------------------------------------------------- */

enum kind {
	K_FLATTEN,
	K_ACC,
	K_REDUCE,
	K_ALLREDUCE,
	K_UNFLATTEN,
	K_ADAMW,
	K_SGD,
	K_CHUNKSQ,
	K_SUMCHUNKS,
	K_SUMSQ_PART,
	K_SUMSQ_FINAL,
	K_SPIN
};

struct CUfunc_st {
	kind k;
	int a, b, c, d; /* the digits of the name */
};
struct CUmod_st {
	std::map<std::string, CUfunc_st*> fns;
};

static const int dts[3] = {ZERO_F32, ZERO_BF16, ZERO_F16};
static const int ops[3] = {ZERO_SUM, ZERO_AVG, ZERO_MAX};

static CUfunc_st* parse(const char* name) {
	int a = 0, b = 0, c = 0, d = 0;
	if (sscanf(name, "zc_flatten_%1d%1d%1d", &a, &b, &c) == 3 && a < 3 && b < 3 && c < 2) return new CUfunc_st{K_FLATTEN, a, b, c};
	if (sscanf(name, "zc_acc_%1d%1d%1d%1d", &a, &b, &c, &d) == 4 && a < 3 && b < 3 && c < 2 && d < 2)
		return new CUfunc_st{K_ACC, a, b, c, d};
	if (sscanf(name, "zc_reduce_%1d%1d", &a, &b) == 2 && a < 3 && b < 3) return new CUfunc_st{K_REDUCE, a, b, 0};
	if (sscanf(name, "zc_allreduce_%1d%1d", &a, &b) == 2 && a < 3 && b < 3) return new CUfunc_st{K_ALLREDUCE, a, b, 0};
	if (sscanf(name, "zc_unflatten_%1d", &a) == 1 && a < 3) return new CUfunc_st{K_UNFLATTEN, a, 0, 0};
	if (sscanf(name, "zc_adamw_%1d", &a) == 1 && a < 3) return new CUfunc_st{K_ADAMW, a, 0, 0};
	if (sscanf(name, "zc_sgd_%1d", &a) == 1 && a < 3) return new CUfunc_st{K_SGD, a, 0, 0};
	if (sscanf(name, "zc_chunksq_%1d", &a) == 1 && a < 3) return new CUfunc_st{K_CHUNKSQ, a, 0, 0};
	if (!strcmp(name, "zc_sumchunks")) return new CUfunc_st{K_SUMCHUNKS, 0, 0, 0};
	if (!strcmp(name, "zc_sumsq_part")) return new CUfunc_st{K_SUMSQ_PART, 0, 0, 0};
	if (!strcmp(name, "zc_sumsq_final")) return new CUfunc_st{K_SUMSQ_FINAL, 0, 0, 0};
	if (!strcmp(name, "zc_spin")) return new CUfunc_st{K_SPIN, 0, 0, 0};
	return nullptr;
}

template <class T>
static T arg(void** params, int i) {
	T v;
	memcpy(&v, params[i], sizeof v);
	return v;
}

extern "C" {

CUresult cuInit(unsigned int) { return CUDA_SUCCESS; }

CUresult cuDriverGetVersion(int* v) {
	const char* e = getenv("FAKECUDA_DRIVER");
	*v = e ? atoi(e) : 12040;
	return CUDA_SUCCESS;
}

CUresult cuGetErrorName(CUresult err, const char** s) {
	switch (err) {
	case CUDA_SUCCESS: *s = "CUDA_SUCCESS"; break;
	case CUDA_ERROR_INVALID_VALUE: *s = "CUDA_ERROR_INVALID_VALUE"; break;
	case CUDA_ERROR_OUT_OF_MEMORY: *s = "CUDA_ERROR_OUT_OF_MEMORY"; break;
	case CUDA_ERROR_INVALID_DEVICE: *s = "CUDA_ERROR_INVALID_DEVICE"; break;
	case CUDA_ERROR_INVALID_IMAGE: *s = "CUDA_ERROR_INVALID_IMAGE"; break;
	case CUDA_ERROR_INVALID_CONTEXT: *s = "CUDA_ERROR_INVALID_CONTEXT"; break;
	case CUDA_ERROR_NOT_FOUND: *s = "CUDA_ERROR_NOT_FOUND"; break;
	case CUDA_ERROR_NOT_READY: *s = "CUDA_ERROR_NOT_READY"; break;
	case CUDA_ERROR_LAUNCH_FAILED: *s = "CUDA_ERROR_LAUNCH_FAILED"; break;
	default: *s = nullptr; return CUDA_ERROR_INVALID_VALUE;
	}
	return CUDA_SUCCESS;
}

CUresult cuGetErrorString(CUresult err, const char** s) {
	CUresult r = cuGetErrorName(err, s);
	if (!r) *s = "an error of the fake CUDA driver";
	return r;
}

CUresult cuDeviceGetCount(int* n) {
	*n = ndevices();
	return CUDA_SUCCESS;
}

CUresult cuDeviceGet(CUdevice* d, int ordinal) {
	if (ordinal < 0 || ordinal >= ndevices()) return CUDA_ERROR_INVALID_DEVICE;
	*d = ordinal;
	return CUDA_SUCCESS;
}

CUresult cuDeviceGetName(char* name, int len, CUdevice d) {
	if (d < 0 || d >= ndevices()) return CUDA_ERROR_INVALID_DEVICE;
	snprintf(name, (size_t)len, "Fake CUDA device (host memory)");
	return CUDA_SUCCESS;
}

CUresult cuDeviceGetAttribute(int* v, int attr, CUdevice d) {
	if (d < 0 || d >= ndevices()) return CUDA_ERROR_INVALID_DEVICE;
	const char* cc = getenv("FAKECUDA_CC");
	int major = 9, minor = 0;
	if (cc) sscanf(cc, "%d.%d", &major, &minor);
	switch (attr) {
	case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: *v = major; break;
	case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: *v = minor; break;
	case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: *v = 132; break;
	default: return CUDA_ERROR_INVALID_VALUE;
	}
	return CUDA_SUCCESS;
}

CUresult cuDeviceTotalMem_v2(size_t* bytes, CUdevice d) {
	if (d < 0 || d >= ndevices()) return CUDA_ERROR_INVALID_DEVICE;
	*bytes = total_mem;
	return CUDA_SUCCESS;
}

CUresult cuDevicePrimaryCtxRetain(CUcontext* c, CUdevice d) {
	if (d < 0 || d >= ndevices()) return CUDA_ERROR_INVALID_DEVICE;
	*c = &primary[d];
	return CUDA_SUCCESS;
}

CUresult cuCtxGetCurrent(CUcontext* c) {
	*c = current;
	return CUDA_SUCCESS;
}

CUresult cuCtxSetCurrent(CUcontext c) {
	current = c;
	return CUDA_SUCCESS;
}

CUresult cuCtxSynchronize(void) {
	NEED_CTX();
	std::lock_guard<std::mutex> g(streams_mu);
	for (auto& s : streams) s.first->drain();
	legacy()->drain();
	return CUDA_SUCCESS;
}

CUresult cuMemGetInfo_v2(size_t* f, size_t* t) {
	NEED_CTX();
	std::lock_guard<std::mutex> g(mem_mu);
	*t = total_mem;
	*f = total_mem - allocated;
	return CUDA_SUCCESS;
}

CUresult cuMemAlloc_v2(CUdeviceptr* p, size_t bytes) {
	NEED_CTX();
	if (bytes > total_mem) return CUDA_ERROR_OUT_OF_MEMORY;
	void* q = fake_alloc(bytes, false);
	if (!q) return CUDA_ERROR_OUT_OF_MEMORY;
	*p = (CUdeviceptr)(uintptr_t)q;
	return CUDA_SUCCESS;
}

CUresult cuMemFree_v2(CUdeviceptr p) {
	NEED_CTX();
	return fake_free((void*)(uintptr_t)p) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult cuMemHostAlloc(void** p, size_t bytes, unsigned int) {
	NEED_CTX();
	*p = fake_alloc(bytes, true);
	return *p ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}

CUresult cuMemFreeHost(void* p) {
	NEED_CTX();
	return fake_free(p) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult cuMemHostGetDevicePointer_v2(CUdeviceptr* d, void* p, unsigned int) {
	NEED_CTX();
	if (!ours((uintptr_t)p, 1)) return CUDA_ERROR_INVALID_VALUE;
	*d = (CUdeviceptr)(uintptr_t)p;
	return CUDA_SUCCESS;
}

CUresult cuMemsetD8Async(CUdeviceptr p, unsigned char v, size_t n, CUstream s) {
	NEED_CTX();
	if (!ours((uintptr_t)p, n)) return CUDA_ERROR_INVALID_VALUE;
	S(s)->push([=] { memset((void*)(uintptr_t)p, v, n); });
	return CUDA_SUCCESS;
}

CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s) {
	NEED_CTX();
	trace("copy %p 0x%llx 0x%llx %zu", (void*)s, (unsigned long long)dst, (unsigned long long)src, n);
	if (ours((uintptr_t)dst, n) && ours((uintptr_t)src, n)) {
		S(s)->push([=] { memmove((void*)(uintptr_t)dst, (const void*)(uintptr_t)src, n); });
		return CUDA_SUCCESS;
	}
	/* pageable memory on one side: in stream order, done when this returns */
	S(s)->drain();
	memmove((void*)(uintptr_t)dst, (const void*)(uintptr_t)src, n);
	return CUDA_SUCCESS;
}

/* The direction-named copies: the device side must be device memory, the
 * host side host memory (pinned or pageable). */
CUresult cuMemcpyDtoHAsync_v2(void* dst, CUdeviceptr src, size_t n, CUstream s) {
	NEED_CTX();
	if (!device((uintptr_t)src, n) || device((uintptr_t)dst, n)) return CUDA_ERROR_INVALID_VALUE;
	return cuMemcpyAsync((CUdeviceptr)(uintptr_t)dst, src, n, s);
}

CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void* src, size_t n, CUstream s) {
	NEED_CTX();
	if (!device((uintptr_t)dst, n) || device((uintptr_t)src, n)) return CUDA_ERROR_INVALID_VALUE;
	return cuMemcpyAsync(dst, (CUdeviceptr)(uintptr_t)src, n, s);
}

CUresult cuStreamCreate(CUstream* s, unsigned int) {
	NEED_CTX();
	*s = new CUstream_st;
	std::lock_guard<std::mutex> g(streams_mu);
	streams[*s] = 1;
	return CUDA_SUCCESS;
}

CUresult cuStreamDestroy_v2(CUstream s) {
	NEED_CTX();
	{
		std::lock_guard<std::mutex> g(streams_mu);
		if (!streams.erase(s)) return CUDA_ERROR_INVALID_VALUE;
	}
	s->drain();
	delete s;
	return CUDA_SUCCESS;
}

CUresult cuStreamSynchronize(CUstream s) {
	NEED_CTX();
	S(s)->drain();
	trace("sync %p", (void*)s);
	return CUDA_SUCCESS;
}

CUresult cuStreamWaitEvent(CUstream s, CUevent e, unsigned int) {
	NEED_CTX();
	uint64_t g;
	{
		std::lock_guard<std::mutex> l(e->mu);
		g = e->recorded;
	}
	e->use();
	trace("wait %p %p %llu", (void*)s, (void*)e, (unsigned long long)g);
	S(s)->push([=] {
		e->wait_for(g);
		CUevent_st::done(e, false);
	});
	return CUDA_SUCCESS;
}

CUresult cuStreamWaitValue32_v2(CUstream s, CUdeviceptr addr, uint32_t value, unsigned int) {
	NEED_CTX();
	if (!ours((uintptr_t)addr, 4)) return CUDA_ERROR_INVALID_VALUE;
	trace("waitvalue %p 0x%llx", (void*)s, (unsigned long long)addr);
	S(s)->push([=] {
		while (__atomic_load_n((const uint32_t*)(uintptr_t)addr, __ATOMIC_ACQUIRE) < value)
			std::this_thread::sleep_for(std::chrono::microseconds(50));
	});
	return CUDA_SUCCESS;
}

CUresult cuEventCreate(CUevent* e, unsigned int flags) {
	NEED_CTX();
	*e = new CUevent_st;
	(*e)->timing = !(flags & CU_EVENT_DISABLE_TIMING);
	return CUDA_SUCCESS;
}

CUresult cuEventRecord(CUevent e, CUstream s) {
	NEED_CTX();
	uint64_t g;
	{
		std::lock_guard<std::mutex> l(e->mu);
		g = ++e->recorded;
		e->users++;
		e->stream = s;
	}
	trace("record %p %p %llu", (void*)s, (void*)e, (unsigned long long)g);
	S(s)->push([=] {
		{
			std::lock_guard<std::mutex> l(e->mu);
			if (e->completed < g) e->completed = g;
			e->at = std::chrono::steady_clock::now();
			e->cv.notify_all();
		}
		CUevent_st::done(e, false);
	});
	return CUDA_SUCCESS;
}

CUresult cuEventSynchronize(CUevent e) {
	uint64_t g;
	bool fail = false;
	{
		std::lock_guard<std::mutex> l(e->mu);
		g = e->recorded;
		for (const char* f = getenv("FAKECUDA_FAIL_EVENT_SYNC"); f && *f && !e->timing && !fail; f += *f == ',') {
			char* end;
			fail = (uintptr_t)strtoull(f, &end, 0) == (uintptr_t)e->stream;
			if (end == f) break;
			f = end;
		}
	}
	e->wait_for(g);
	trace("esync %p %llu", (void*)e, (unsigned long long)g);
	return fail ? CUDA_ERROR_LAUNCH_FAILED : CUDA_SUCCESS;
}

CUresult cuEventQuery(CUevent e) {
	std::lock_guard<std::mutex> l(e->mu);
	return e->completed >= e->recorded ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

CUresult cuEventDestroy_v2(CUevent e) {
	/* CUDA allows destroying an event that queued work still records or
	 * waits on: it is freed when the last of that work is done */
	CUevent_st::done(e, true);
	return CUDA_SUCCESS;
}

CUresult cuEventElapsedTime(float* ms, CUevent a, CUevent b) {
	if (!a->timing || !b->timing) return CUDA_ERROR_INVALID_VALUE;
	if (cuEventQuery(a) || cuEventQuery(b)) return CUDA_ERROR_NOT_READY;
	std::lock_guard<std::mutex> la(a->mu);
	std::lock_guard<std::mutex> lb(b->mu);
	*ms = std::chrono::duration<float, std::milli>(b->at - a->at).count();
	return CUDA_SUCCESS;
}

CUresult cuModuleLoadData(CUmodule* m, const void* image) {
	NEED_CTX();
	uint32_t magic = 0;
	if (image) memcpy(&magic, image, 4);
	if (magic != 0xBA55ED50u) return CUDA_ERROR_INVALID_IMAGE;
	*m = new CUmod_st;
	return CUDA_SUCCESS;
}

CUresult cuModuleGetFunction(CUfunction* f, CUmodule m, const char* name) {
	NEED_CTX();
	auto it = m->fns.find(name);
	if (it == m->fns.end()) {
		CUfunc_st* g = parse(name);
		if (!g) return CUDA_ERROR_NOT_FOUND;
		it = m->fns.emplace(name, g).first;
	}
	*f = it->second;
	return CUDA_SUCCESS;
}

/* A kernel's attributes: the emulator has no registers or local memory,
 * so these are fixed figures in range (32 registers, none spilled, the
 * largest block CUDA allows), and the binary of the device's compute
 * capability: the record's plumbing runs, its numbers mean nothing. */
CUresult cuFuncGetAttribute(int* v, int attr, CUfunction f) {
	NEED_CTX();
	if (!f) return CUDA_ERROR_INVALID_VALUE;
	int major = 9, minor = 0;
	if (const char* cc = getenv("FAKECUDA_CC")) sscanf(cc, "%d.%d", &major, &minor);
	switch (attr) {
	case CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK: *v = 1024; break;
	case CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES:
	case CU_FUNC_ATTRIBUTE_CONST_SIZE_BYTES:
	case CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES: *v = 0; break;
	case CU_FUNC_ATTRIBUTE_NUM_REGS: *v = 32; break;
	case CU_FUNC_ATTRIBUTE_PTX_VERSION:
	case CU_FUNC_ATTRIBUTE_BINARY_VERSION: *v = major * 10 + minor; break;
	default: return CUDA_ERROR_INVALID_VALUE;
	}
	return CUDA_SUCCESS;
}

CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned, unsigned bx, unsigned, unsigned, unsigned,
                        CUstream s, void** p, void**) {
	NEED_CTX();
	if (gx == 0 || gy == 0) return CUDA_ERROR_INVALID_VALUE;
	{
		uintptr_t out = 0; /* what the kernel writes, where one pointer says it */
		switch (f->k) {
		case K_FLATTEN:
		case K_ACC: out = arg<uintptr_t>(p, 0); break;
		case K_ADAMW: out = arg<uintptr_t>(p, 5); break;
		case K_SGD: out = arg<uintptr_t>(p, 3); break;
		default: break;
		}
		trace("launch %p %d 0x%llx", (void*)s, (int)f->k, (unsigned long long)out);
	}
	switch (f->k) {
	case K_FLATTEN: {
		if (bx != ZC_THREADS) return CUDA_ERROR_INVALID_VALUE;
		char* dst = arg<char*>(p, 0);
		zc_segs_arg a = arg<zc_segs_arg>(p, 1);
		float scale = arg<float>(p, 2);
		int dt = dts[f->a], st = dts[f->b];
		S(s)->push([=] { emu_flatten(dst, dt, st, a.ext ? (const zc_dseg*)a.ext : a.inl, a.nseg, scale, gx); });
		break;
	}
	case K_ACC: {
		if (bx != ZC_THREADS) return CUDA_ERROR_INVALID_VALUE;
		char* acc = arg<char*>(p, 0);
		zc_segs_arg a = arg<zc_segs_arg>(p, 1);
		float scale = arg<float>(p, 2);
		float* flag = arg<float*>(p, 3);
		double* part = arg<double*>(p, 4);
		int at = dts[f->a], st = dts[f->b], first = f->d;
		S(s)->push([=] {
			if (emu_accumulate(acc, at, st, a.ext ? (const zc_dseg*)a.ext : a.inl, a.nseg, scale, first, gx, part) && flag)
				*flag = 1.0f;
		});
		break;
	}
	case K_REDUCE:
	case K_ALLREDUCE: {
		zc_red_arg a = arg<zc_red_arg>(p, 0);
		int dt = dts[f->a], op = ops[f->b];
		bool all = f->k == K_ALLREDUCE;
		if (!all && (int)gy != a.nout) return CUDA_ERROR_INVALID_VALUE;
		S(s)->push([=] { emu_reduce(a, dt, op, gx, all); });
		break;
	}
	case K_UNFLATTEN: {
		const char* flat = arg<const char*>(p, 0);
		zc_segs_arg a = arg<zc_segs_arg>(p, 1);
		int dt = dts[f->a];
		S(s)->push([=] { emu_unflatten(flat, dt, a.ext ? (const zc_dseg*)a.ext : a.inl, a.nseg, gx); });
		break;
	}
	case K_ADAMW:
	case K_SGD: {
		bool adam = f->k == K_ADAMW;
		int k = 0;
		float* pp = arg<float*>(p, k++);
		const float* g = arg<const float*>(p, k++);
		float* m = arg<float*>(p, k++);
		float* v = adam ? arg<float*>(p, k++) : nullptr;
		float* vmax = adam ? arg<float*>(p, k++) : nullptr;
		char* out = arg<char*>(p, k++);
		const zc_odesc* ds = arg<const zc_odesc*>(p, k++);
		int nd = arg<int>(p, k++);
		float gscale = arg<float>(p, k++);
		int dt = dts[f->a];
		S(s)->push([=] { emu_opt(adam, pp, g, m, v, vmax, out, dt, ds, nd, gscale, gx); });
		break;
	}
	case K_CHUNKSQ: {
		if (bx != ZC_THREADS) return CUDA_ERROR_INVALID_VALUE;
		const char* x = arg<const char*>(p, 0);
		int64_t n = arg<int64_t>(p, 1);
		double* part = arg<double*>(p, 2);
		int dt = dts[f->a];
		if ((int64_t)gx != (n + ZC_CHUNK - 1) / ZC_CHUNK) return CUDA_ERROR_INVALID_VALUE; /* a block per chunk */
		S(s)->push([=] { emu_chunk_squares(x, dt, n, part); });
		break;
	}
	case K_SUMCHUNKS: {
		if (bx != ZC_THREADS) return CUDA_ERROR_INVALID_VALUE;
		const double* part = arg<const double*>(p, 0);
		const zc_crange* r = arg<const zc_crange*>(p, 1);
		double* out = arg<double*>(p, 2);
		S(s)->push([=] { emu_sum_chunks(part, r, gx, out); });
		break;
	}
	case K_SUMSQ_PART: {
		const float* x = arg<const float*>(p, 0);
		int64_t n = arg<int64_t>(p, 1);
		double* part = arg<double*>(p, 2);
		S(s)->push([=] {
			double t[ZC_THREADS];
			for (unsigned b = 0; b < gx; b++) {
				for (int i = 0; i < ZC_THREADS; i++) t[i] = zc_sumsq_thread(x, n, (int64_t)b * ZC_THREADS + i, (int64_t)gx * ZC_THREADS);
				part[b] = zc_tree(t);
			}
		});
		break;
	}
	case K_SUMSQ_FINAL: {
		const double* part = arg<const double*>(p, 0);
		int nb = arg<int>(p, 1);
		double* out = arg<double*>(p, 2);
		const zc_crange all = {0, nb};
		S(s)->push([=] { emu_sum_chunks(part, &all, 1, out); });
		break;
	}
	case K_SPIN: {
		int64_t ns = arg<int64_t>(p, 0);
		S(s)->push([=] { std::this_thread::sleep_for(std::chrono::nanoseconds(ns)); });
		break;
	}
	}
	return CUDA_SUCCESS;
}

} /* extern "C" */
