/*
 * kernels.cu: the CUDA C kernels of zero and their extern "C" launchers.
 *
 * The scalar math (bf16/fp16 conversions with round-to-nearest-even, scaling,
 * copy-vs-add, the rank-order reduction) comes from ../elementwise.h, the
 * header the host C kernels (kernels.c) include too. Built with --fmad=false
 * and IEEE division/denormals (no --use_fast_math), every element goes
 * through the same operations in the same order as on the host, so both
 * paths give the same bits.
 *
 * Layout of the work:
 *   - flatten / accumulate / cast: one launch per batch ("bucket"). The
 *     segments are cut into chunks of ZC_CHUNK elements; block b finds its
 *     segment by a binary search of the segments' first-block numbers and
 *     works on one chunk. A batch of up to ZC_INLINE_SEGS segments travels in
 *     the kernel parameters (__grid_constant__); a larger one is copied into
 *     a device-side descriptor array from a pinned staging ring.
 *   - Each thread moves packs of 8 elements with 16-byte loads and stores
 *     when the segment's source and destination are 16-byte aligned (always,
 *     for buffers from cudaMalloc and offsets that are multiples of 8), and
 *     falls back to one element at a time otherwise.
 *   - The in-process reductions (reduce-scatter and the fused all-reduce of
 *     the one-GPU group) are grid-stride loops over packs of 8.
 */
#include <cuda_runtime.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#include "../elementwise.h"
#include "zero_cuda.h"

#define ZC_THREADS 256
#define ZC_PACK 8                                /* elements per pack */
#define ZC_UNROLL 4                              /* packs per thread per chunk */
#define ZC_CHUNK (ZC_THREADS * ZC_PACK * ZC_UNROLL) /* elements per block */

/* ---- descriptors ------------------------------------------------------- */

/* A segment as the kernels see it: block0 is the number of the first block
 * of the launch that works on it. */
struct zc_dseg {
	uintptr_t src;
	int64_t count;
	int64_t offset;
	int64_t block0;
};

struct zc_segs_arg {
	const zc_dseg* ext; /* device array, or NULL: use inl */
	int nseg;
	zc_dseg inl[ZC_INLINE_SEGS];
};

struct zc_red_arg {
	uintptr_t dst[ZC_MAX_RANKS];
	uintptr_t src[ZC_MAX_RANKS];
	int nout;
	int nsrc;
	int64_t count;
	int vec; /* every address and the per-output stride allow 16-byte access */
};

/* ---- typed packs of 8 --------------------------------------------------- */

__host__ __device__ constexpr int zc_size(int t) { return t == ZERO_F32 ? 4 : 2; }

template <int T>
__device__ __forceinline__ float zc_widen(uint32_t h) {
	return T == ZERO_BF16 ? zero_bf16_to_f32((uint16_t)h) : zero_f16_to_f32((uint16_t)h);
}

template <int T>
__device__ __forceinline__ uint32_t zc_narrow(float v) {
	return T == ZERO_BF16 ? (uint32_t)zero_f32_to_bf16(v) : (uint32_t)zero_f32_to_f16(v);
}

/* 16 or 32 bytes of raw data: 8 elements of T. */
struct zc_raw {
	uint4 a, b;
};

template <int T>
__device__ __forceinline__ zc_raw zc_load_raw(const char* p) {
	zc_raw r;
	r.a = __ldg((const uint4*)p);
	if (T == ZERO_F32) r.b = __ldg((const uint4*)p + 1);
	return r;
}

/* Plain (coherent) load, for buffers the same kernel writes: accumulators
 * and in-place reductions. */
template <int T>
__device__ __forceinline__ zc_raw zc_load_raw_rw(const char* p) {
	zc_raw r;
	r.a = *(const uint4*)p;
	if (T == ZERO_F32) r.b = *((const uint4*)p + 1);
	return r;
}

template <int T>
__device__ __forceinline__ void zc_unpack(const zc_raw& r, float v[ZC_PACK]) {
	if (T == ZERO_F32) {
		v[0] = __uint_as_float(r.a.x);
		v[1] = __uint_as_float(r.a.y);
		v[2] = __uint_as_float(r.a.z);
		v[3] = __uint_as_float(r.a.w);
		v[4] = __uint_as_float(r.b.x);
		v[5] = __uint_as_float(r.b.y);
		v[6] = __uint_as_float(r.b.z);
		v[7] = __uint_as_float(r.b.w);
	} else {
		/* little endian: element 2k is the low half of word k */
		v[0] = zc_widen<T>(r.a.x & 0xffffu);
		v[1] = zc_widen<T>(r.a.x >> 16);
		v[2] = zc_widen<T>(r.a.y & 0xffffu);
		v[3] = zc_widen<T>(r.a.y >> 16);
		v[4] = zc_widen<T>(r.a.z & 0xffffu);
		v[5] = zc_widen<T>(r.a.z >> 16);
		v[6] = zc_widen<T>(r.a.w & 0xffffu);
		v[7] = zc_widen<T>(r.a.w >> 16);
	}
}

template <int T>
__device__ __forceinline__ zc_raw zc_pack(const float v[ZC_PACK]) {
	zc_raw r;
	if (T == ZERO_F32) {
		r.a = make_uint4(__float_as_uint(v[0]), __float_as_uint(v[1]), __float_as_uint(v[2]), __float_as_uint(v[3]));
		r.b = make_uint4(__float_as_uint(v[4]), __float_as_uint(v[5]), __float_as_uint(v[6]), __float_as_uint(v[7]));
	} else {
		r.a = make_uint4(zc_narrow<T>(v[0]) | (zc_narrow<T>(v[1]) << 16), zc_narrow<T>(v[2]) | (zc_narrow<T>(v[3]) << 16),
		                 zc_narrow<T>(v[4]) | (zc_narrow<T>(v[5]) << 16), zc_narrow<T>(v[6]) | (zc_narrow<T>(v[7]) << 16));
		r.b = r.a;
	}
	return r;
}

template <int T>
__device__ __forceinline__ void zc_store_raw(char* p, const zc_raw& r) {
	*(uint4*)p = r.a;
	if (T == ZERO_F32) *((uint4*)p + 1) = r.b;
}

/* ---- segment lookup ------------------------------------------------------ */

/* The segment block b works on: the last one whose block0 <= b (segments of
 * zero blocks never match, since the next segment has the same block0). */
__device__ __forceinline__ zc_dseg zc_find(const zc_dseg* segs, int nseg, int64_t b) {
	int lo = 0, hi = nseg - 1;
	while (lo < hi) {
		int mid = (lo + hi + 1) >> 1;
		if (segs[mid].block0 <= b)
			lo = mid;
		else
			hi = mid - 1;
	}
	return segs[lo];
}

/* ---- flatten (and cast) -------------------------------------------------- */

template <int DT, int ST, bool SCALE>
__global__ void __launch_bounds__(ZC_THREADS)
    zc_k_flatten(char* __restrict__ dst, const __grid_constant__ zc_segs_arg a, float scale) {
	const zc_dseg* segs = a.ext ? a.ext : a.inl;
	const int64_t b = blockIdx.x;
	const zc_dseg sg = zc_find(segs, a.nseg, b);
	const int64_t start = (b - sg.block0) * ZC_CHUNK;
	const int64_t end = sg.count < start + ZC_CHUNK ? sg.count : start + ZC_CHUNK;
	const char* __restrict__ src = (const char*)sg.src;
	char* __restrict__ d = dst + sg.offset * zc_size(DT);
	int64_t tail = start;
	if (((sg.src | (uintptr_t)d) & 15u) == 0) {
		const int64_t vend = start + (end - start) / ZC_PACK * ZC_PACK;
		zc_raw in[ZC_UNROLL];
#pragma unroll
		for (int u = 0; u < ZC_UNROLL; u++) {
			int64_t i = start + ((int64_t)u * ZC_THREADS + threadIdx.x) * ZC_PACK;
			if (i < vend) in[u] = zc_load_raw<ST>(src + i * zc_size(ST));
		}
#pragma unroll
		for (int u = 0; u < ZC_UNROLL; u++) {
			int64_t i = start + ((int64_t)u * ZC_THREADS + threadIdx.x) * ZC_PACK;
			if (i < vend) {
				float v[ZC_PACK];
				zc_unpack<ST>(in[u], v);
				if (SCALE) {
#pragma unroll
					for (int k = 0; k < ZC_PACK; k++) v[k] = v[k] * scale;
				}
				zc_store_raw<DT>(d + i * zc_size(DT), zc_pack<DT>(v));
			}
		}
		tail = vend;
	}
	for (int64_t i = tail + threadIdx.x; i < end; i += ZC_THREADS) {
		float v = zero_load(src, ST, i);
		if (SCALE) v = v * scale;
		zero_store(d, DT, i, v);
	}
}

/* ---- accumulate ---------------------------------------------------------- */

template <int ST, bool SCALE, bool FIRST>
__global__ void __launch_bounds__(ZC_THREADS)
    zc_k_accumulate(float* __restrict__ acc, const __grid_constant__ zc_segs_arg a, float scale, float* flag) {
	const zc_dseg* segs = a.ext ? a.ext : a.inl;
	const int64_t b = blockIdx.x;
	const zc_dseg sg = zc_find(segs, a.nseg, b);
	const int64_t start = (b - sg.block0) * ZC_CHUNK;
	const int64_t end = sg.count < start + ZC_CHUNK ? sg.count : start + ZC_CHUNK;
	const char* __restrict__ src = (const char*)sg.src;
	float* __restrict__ d = acc + sg.offset;
	uint32_t bad = 0;
	int64_t tail = start;
	if (((sg.src | (uintptr_t)d) & 15u) == 0) {
		const int64_t vend = start + (end - start) / ZC_PACK * ZC_PACK;
		zc_raw in[ZC_UNROLL], old[ZC_UNROLL];
#pragma unroll
		for (int u = 0; u < ZC_UNROLL; u++) {
			int64_t i = start + ((int64_t)u * ZC_THREADS + threadIdx.x) * ZC_PACK;
			if (i < vend) {
				in[u] = zc_load_raw<ST>(src + i * zc_size(ST));
				if (!FIRST) old[u] = zc_load_raw_rw<ZERO_F32>((const char*)(d + i));
			}
		}
#pragma unroll
		for (int u = 0; u < ZC_UNROLL; u++) {
			int64_t i = start + ((int64_t)u * ZC_THREADS + threadIdx.x) * ZC_PACK;
			if (i < vend) {
				float v[ZC_PACK], o[ZC_PACK];
				zc_unpack<ST>(in[u], v);
				if (!FIRST) zc_unpack<ZERO_F32>(old[u], o);
#pragma unroll
				for (int k = 0; k < ZC_PACK; k++) {
					if (SCALE) v[k] = v[k] * scale;
					float r = FIRST ? v[k] : o[k] + v[k];
					v[k] = r;
					bad |= (uint32_t)!zero_isfinite(r);
				}
				zc_store_raw<ZERO_F32>((char*)(d + i), zc_pack<ZERO_F32>(v));
			}
		}
		tail = vend;
	}
	for (int64_t i = tail + threadIdx.x; i < end; i += ZC_THREADS) {
		float v = zero_load(src, ST, i);
		if (SCALE) v = v * scale;
		float r = FIRST ? v : d[i] + v;
		d[i] = r;
		bad |= (uint32_t)!zero_isfinite(r);
	}
	if (__syncthreads_or((int)bad) && threadIdx.x == 0 && flag) *flag = 1.0f;
}

/* ---- in-process reductions ---------------------------------------------- */

template <int T, int OP>
__device__ __forceinline__ void zc_combine8(float t[ZC_PACK], const float x[ZC_PACK]) {
#pragma unroll
	for (int k = 0; k < ZC_PACK; k++) t[k] = zero_op_combine(OP, t[k], x[k]);
}

/* Output j = blockIdx.y; grid-stride over packs of this output's range. */
template <int T, int OP>
__global__ void __launch_bounds__(ZC_THREADS) zc_k_reduce(const __grid_constant__ zc_red_arg a) {
	const int j = blockIdx.y;
	const int64_t base = (int64_t)j * a.count; /* element offset into every src */
	char* d = (char*)a.dst[j];
	const int64_t stride = (int64_t)gridDim.x * ZC_THREADS;
	int64_t tail = 0;
	if (a.vec) {
		const int64_t packs = a.count / ZC_PACK;
		for (int64_t p = (int64_t)blockIdx.x * ZC_THREADS + threadIdx.x; p < packs; p += stride) {
			const int64_t i = p * ZC_PACK;
			float t[ZC_PACK], x[ZC_PACK];
			zc_unpack<T>(zc_load_raw_rw<T>((const char*)a.src[0] + (base + i) * zc_size(T)), t);
			for (int k = 1; k < a.nsrc; k++) {
				zc_unpack<T>(zc_load_raw_rw<T>((const char*)a.src[k] + (base + i) * zc_size(T)), x);
				zc_combine8<T, OP>(t, x);
			}
#pragma unroll
			for (int k = 0; k < ZC_PACK; k++) t[k] = zero_op_finish(OP, t[k], a.nsrc);
			zc_store_raw<T>(d + i * zc_size(T), zc_pack<T>(t));
		}
		tail = packs * ZC_PACK;
	}
	for (int64_t i = tail + (int64_t)blockIdx.x * ZC_THREADS + threadIdx.x; i < a.count; i += stride) {
		float t = zero_load((const void*)a.src[0], T, base + i);
		for (int k = 1; k < a.nsrc; k++) t = zero_op_combine(OP, t, zero_load((const void*)a.src[k], T, base + i));
		zero_store(d, T, i, zero_op_finish(OP, t, a.nsrc));
	}
}

/* Fused in-place all-reduce: a.src are the buffers (a.nsrc of them); the
 * result is written to every one. */
template <int T, int OP>
__global__ void __launch_bounds__(ZC_THREADS) zc_k_allreduce(const __grid_constant__ zc_red_arg a) {
	const int64_t stride = (int64_t)gridDim.x * ZC_THREADS;
	int64_t tail = 0;
	if (a.vec) {
		const int64_t packs = a.count / ZC_PACK;
		for (int64_t p = (int64_t)blockIdx.x * ZC_THREADS + threadIdx.x; p < packs; p += stride) {
			const int64_t off = p * ZC_PACK * zc_size(T);
			float t[ZC_PACK], x[ZC_PACK];
			zc_unpack<T>(zc_load_raw_rw<T>((const char*)a.src[0] + off), t);
			for (int k = 1; k < a.nsrc; k++) {
				zc_unpack<T>(zc_load_raw_rw<T>((const char*)a.src[k] + off), x);
				zc_combine8<T, OP>(t, x);
			}
#pragma unroll
			for (int k = 0; k < ZC_PACK; k++) t[k] = zero_op_finish(OP, t[k], a.nsrc);
			const zc_raw r = zc_pack<T>(t);
			for (int k = 0; k < a.nsrc; k++) zc_store_raw<T>((char*)a.src[k] + off, r);
		}
		tail = packs * ZC_PACK;
	}
	for (int64_t i = tail + (int64_t)blockIdx.x * ZC_THREADS + threadIdx.x; i < a.count; i += stride) {
		float t = zero_load((const void*)a.src[0], T, i);
		for (int k = 1; k < a.nsrc; k++) t = zero_op_combine(OP, t, zero_load((const void*)a.src[k], T, i));
		const float r = zero_op_finish(OP, t, a.nsrc);
		/* store once, then copy the stored bits, as the host kernel does */
		zero_store((void*)a.src[0], T, i, r);
		if (T == ZERO_F32) {
			const uint32_t bits = ((const uint32_t*)a.src[0])[i];
			for (int k = 1; k < a.nsrc; k++) ((uint32_t*)a.src[k])[i] = bits;
		} else {
			const uint16_t bits = ((const uint16_t*)a.src[0])[i];
			for (int k = 1; k < a.nsrc; k++) ((uint16_t*)a.src[k])[i] = bits;
		}
	}
}

/* ---- sum of squares ------------------------------------------------------ */

#define ZC_SUMSQ_MAX_BLOCKS 1024

/* A fixed tree over the block's threads; the result is in s[0]. */
__device__ __forceinline__ void zc_tree(double* s) {
	for (int w = ZC_THREADS / 2; w > 0; w >>= 1) {
		__syncthreads();
		if ((int)threadIdx.x < w) s[threadIdx.x] = s[threadIdx.x] + s[threadIdx.x + w];
	}
	__syncthreads();
}

__global__ void __launch_bounds__(ZC_THREADS) zc_k_sumsq_part(const float* __restrict__ x, int64_t n, double* part) {
	__shared__ double s[ZC_THREADS];
	double acc = 0.0;
	const int64_t stride = (int64_t)gridDim.x * ZC_THREADS;
	for (int64_t i = (int64_t)blockIdx.x * ZC_THREADS + threadIdx.x; i < n; i += stride) {
		const double d = (double)x[i];
		acc = acc + d * d;
	}
	s[threadIdx.x] = acc;
	zc_tree(s);
	if (threadIdx.x == 0) part[blockIdx.x] = s[0];
}

__global__ void __launch_bounds__(ZC_THREADS) zc_k_sumsq_final(const double* part, int nb, double* out) {
	__shared__ double s[ZC_THREADS];
	double acc = 0.0;
	for (int i = threadIdx.x; i < nb; i += ZC_THREADS) acc = acc + part[i];
	s[threadIdx.x] = acc;
	zc_tree(s);
	if (threadIdx.x == 0) *out = s[0];
}

/* ---- spin (tests) ---------------------------------------------------------- */

__device__ __forceinline__ uint64_t zc_globaltimer() {
	uint64_t t;
	asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
	return t;
}

__global__ void zc_k_spin(int64_t ns) {
	const uint64_t t0 = zc_globaltimer();
	while ((int64_t)(zc_globaltimer() - t0) < ns) {
	}
}

/* ====================================================================== */
/* host side                                                                */
/* ====================================================================== */

static int zc_set(int dev) { return (int)cudaSetDevice(dev); }

static int zc_dtype_ok(int t) { return t == ZERO_F32 || t == ZERO_BF16 || t == ZERO_F16; }

/* ---- the descriptor staging ring (one per device) ---------------------- */

#define ZC_RING_BYTES (1u << 20)
#define ZC_RING_SLOTS 256

struct zc_ring_ent {
	size_t lo, hi;
};

struct zc_ring {
	pthread_mutex_t mu;
	int ready;
	char* host; /* pinned */
	char* dev;
	size_t head;
	zc_ring_ent q[ZC_RING_SLOTS];
	cudaEvent_t ev[ZC_RING_SLOTS];
	int qh, qn;
};

static zc_ring zc_rings[ZC_MAX_DEVICES];
static pthread_once_t zc_rings_once = PTHREAD_ONCE_INIT;

static void zc_rings_init(void) {
	for (int i = 0; i < ZC_MAX_DEVICES; i++) pthread_mutex_init(&zc_rings[i].mu, NULL);
}

static int zc_ring_setup(zc_ring* r) {
	if (r->ready) return 0;
	int err = (int)cudaHostAlloc((void**)&r->host, ZC_RING_BYTES, cudaHostAllocPortable);
	if (err) return err;
	err = (int)cudaMalloc((void**)&r->dev, ZC_RING_BYTES);
	if (err) {
		cudaFreeHost(r->host);
		r->host = NULL;
		return err;
	}
	for (int i = 0; i < ZC_RING_SLOTS; i++) {
		err = (int)cudaEventCreateWithFlags(&r->ev[i], cudaEventDisableTiming);
		if (err) return err; /* the ring stays not ready; the events made so far leak (rare) */
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

/* Reserve bytes in the ring (mutex held); waits for old launches if needed. */
static int zc_ring_reserve(zc_ring* r, size_t bytes, size_t* pos) {
	bytes = (bytes + 255) & ~(size_t)255;
	while (r->qn > 0 && cudaEventQuery(r->ev[r->qh]) == cudaSuccess) zc_ring_pop(r);
	size_t p = r->head;
	if (p + bytes > ZC_RING_BYTES) p = 0;
	while (r->qn > 0 && (r->qn == ZC_RING_SLOTS || zc_overlaps(r, p, p + bytes))) {
		int err = (int)cudaEventSynchronize(r->ev[r->qh]);
		if (err) return err;
		zc_ring_pop(r);
	}
	*pos = p;
	r->head = p + bytes;
	return 0;
}

/* Mark [pos, pos+bytes) busy until the work enqueued on s so far is done. */
static int zc_ring_commit(zc_ring* r, cudaStream_t s, size_t pos, size_t bytes) {
	int slot = (r->qh + r->qn) % ZC_RING_SLOTS;
	int err = (int)cudaEventRecord(r->ev[slot], s);
	if (err) return err;
	r->q[slot].lo = pos;
	r->q[slot].hi = pos + ((bytes + 255) & ~(size_t)255);
	r->qn++;
	return 0;
}

/* ---- segment batches ------------------------------------------------------ */

typedef int (*zc_seg_launch)(dim3 grid, cudaStream_t s, const zc_segs_arg& a, void* ctx);

/* Builds the descriptors of segs (dropping empty ones), places them inline
 * or in the ring, and calls launch once per batch; batches bigger than half
 * the ring are split (one launch per half-ring of descriptors). */
static int zc_run_segs(int dev, cudaStream_t s, const zc_seg* segs, int nseg, zc_seg_launch launch, void* ctx) {
	const int max_ring = (int)(ZC_RING_BYTES / 2 / sizeof(zc_dseg));
	zc_segs_arg a;
	int i = 0;
	while (i < nseg) {
		/* count the non-empty segments of this batch */
		int j = i, n = 0;
		while (j < nseg && n < max_ring) {
			if (segs[j].count > 0) n++;
			j++;
		}
		if (n == 0) return 0;
		if (n <= ZC_INLINE_SEGS) {
			int64_t blocks = 0;
			int k = 0;
			for (int m = i; m < j; m++) {
				if (segs[m].count <= 0) continue;
				a.inl[k].src = segs[m].ptr;
				a.inl[k].count = segs[m].count;
				a.inl[k].offset = segs[m].offset;
				a.inl[k].block0 = blocks;
				blocks += (segs[m].count + ZC_CHUNK - 1) / ZC_CHUNK;
				k++;
			}
			if (blocks > 0x7fffffffLL) return (int)cudaErrorInvalidConfiguration;
			a.ext = NULL;
			a.nseg = k;
			int err = launch(dim3((unsigned)blocks), s, a, ctx);
			if (err) return err;
		} else {
			pthread_once(&zc_rings_once, zc_rings_init);
			zc_ring* r = &zc_rings[dev];
			pthread_mutex_lock(&r->mu);
			int err = zc_ring_setup(r);
			size_t pos = 0, bytes = (size_t)n * sizeof(zc_dseg);
			if (!err) err = zc_ring_reserve(r, bytes, &pos);
			if (!err) {
				zc_dseg* h = (zc_dseg*)(r->host + pos);
				int64_t blocks = 0;
				int k = 0;
				for (int m = i; m < j; m++) {
					if (segs[m].count <= 0) continue;
					h[k].src = segs[m].ptr;
					h[k].count = segs[m].count;
					h[k].offset = segs[m].offset;
					h[k].block0 = blocks;
					blocks += (segs[m].count + ZC_CHUNK - 1) / ZC_CHUNK;
					k++;
				}
				if (blocks > 0x7fffffffLL) err = (int)cudaErrorInvalidConfiguration;
				if (!err) err = (int)cudaMemcpyAsync(r->dev + pos, h, bytes, cudaMemcpyHostToDevice, s);
				if (!err) {
					a.ext = (const zc_dseg*)(r->dev + pos);
					a.nseg = k;
					err = launch(dim3((unsigned)blocks), s, a, ctx);
				}
				/* the slot is reused only after this stream passed the launch,
				 * or after the copy, if the launch failed */
				int cerr = zc_ring_commit(r, s, pos, bytes);
				if (!err) err = cerr;
			}
			pthread_mutex_unlock(&r->mu);
			if (err) return err;
		}
		i = j;
	}
	return 0;
}

/* ---- kernel tables --------------------------------------------------------- */

struct zc_flatten_ctx {
	char* dst;
	float scale;
	int dt, st;
};

template <int DT, int ST, bool SC>
static void zc_launch_flatten(dim3 g, cudaStream_t s, const zc_segs_arg& a, char* dst, float scale) {
	zc_k_flatten<DT, ST, SC><<<g, ZC_THREADS, 0, s>>>(dst, a, scale);
}

typedef void (*zc_flatten_fn)(dim3, cudaStream_t, const zc_segs_arg&, char*, float);

#define ZC_FL(D, S) {zc_launch_flatten<D, S, false>, zc_launch_flatten<D, S, true>}
static const zc_flatten_fn zc_flatten_tbl[3][3][2] = {
    {ZC_FL(ZERO_F32, ZERO_F32), ZC_FL(ZERO_F32, ZERO_BF16), ZC_FL(ZERO_F32, ZERO_F16)},
    {ZC_FL(ZERO_BF16, ZERO_F32), ZC_FL(ZERO_BF16, ZERO_BF16), ZC_FL(ZERO_BF16, ZERO_F16)},
    {ZC_FL(ZERO_F16, ZERO_F32), ZC_FL(ZERO_F16, ZERO_BF16), ZC_FL(ZERO_F16, ZERO_F16)},
};
#undef ZC_FL

static int zc_flatten_launch(dim3 g, cudaStream_t s, const zc_segs_arg& a, void* ctx) {
	const zc_flatten_ctx* c = (const zc_flatten_ctx*)ctx;
	zc_flatten_tbl[c->dt][c->st][c->scale != 1.0f](g, s, a, c->dst, c->scale);
	return (int)cudaGetLastError();
}

struct zc_acc_ctx {
	float* acc;
	float* flag;
	float scale;
	int st, first;
};

template <int ST, bool SC, bool FIRST>
static void zc_launch_acc(dim3 g, cudaStream_t s, const zc_segs_arg& a, float* acc, float scale, float* flag) {
	zc_k_accumulate<ST, SC, FIRST><<<g, ZC_THREADS, 0, s>>>(acc, a, scale, flag);
}

typedef void (*zc_acc_fn)(dim3, cudaStream_t, const zc_segs_arg&, float*, float, float*);

#define ZC_AC(S) \
	{{zc_launch_acc<S, false, false>, zc_launch_acc<S, false, true>}, {zc_launch_acc<S, true, false>, zc_launch_acc<S, true, true>}}
static const zc_acc_fn zc_acc_tbl[3][2][2] = {ZC_AC(ZERO_F32), ZC_AC(ZERO_BF16), ZC_AC(ZERO_F16)};
#undef ZC_AC

static int zc_acc_launch(dim3 g, cudaStream_t s, const zc_segs_arg& a, void* ctx) {
	const zc_acc_ctx* c = (const zc_acc_ctx*)ctx;
	zc_acc_tbl[c->st][c->scale != 1.0f][c->first != 0](g, s, a, c->acc, c->scale, c->flag);
	return (int)cudaGetLastError();
}

template <int T, int OP>
static void zc_launch_reduce(dim3 g, cudaStream_t s, const zc_red_arg& a) {
	zc_k_reduce<T, OP><<<g, ZC_THREADS, 0, s>>>(a);
}

template <int T, int OP>
static void zc_launch_allreduce(dim3 g, cudaStream_t s, const zc_red_arg& a) {
	zc_k_allreduce<T, OP><<<g, ZC_THREADS, 0, s>>>(a);
}

typedef void (*zc_red_fn)(dim3, cudaStream_t, const zc_red_arg&);

#define ZC_RD(F, T) {F<T, ZERO_SUM>, F<T, ZERO_AVG>, F<T, ZERO_MAX>}
static const zc_red_fn zc_reduce_tbl[3][3] = {ZC_RD(zc_launch_reduce, ZERO_F32), ZC_RD(zc_launch_reduce, ZERO_BF16),
                                              ZC_RD(zc_launch_reduce, ZERO_F16)};
static const zc_red_fn zc_allreduce_tbl[3][3] = {ZC_RD(zc_launch_allreduce, ZERO_F32),
                                                 ZC_RD(zc_launch_allreduce, ZERO_BF16),
                                                 ZC_RD(zc_launch_allreduce, ZERO_F16)};
#undef ZC_RD

/* Blocks for a grid-stride loop over `items` threads' worth of work. */
static unsigned zc_grid(int64_t items) {
	int64_t b = (items + ZC_THREADS - 1) / ZC_THREADS;
	if (b < 1) b = 1;
	if (b > 8192) b = 8192;
	return (unsigned)b;
}

/* ---- extern "C" launchers ----------------------------------------------------- */

extern "C" int zc_flatten(int dev, uintptr_t s, uintptr_t dst, int dst_dtype, const zc_seg* segs, int nseg,
                          int src_dtype, float scale) {
	if (!zc_dtype_ok(dst_dtype) || !zc_dtype_ok(src_dtype)) return ZC_ERR_BAD_DTYPE;
	if (dev < 0 || dev >= ZC_MAX_DEVICES) return (int)cudaErrorInvalidDevice;
	int err = zc_set(dev);
	if (err) return err;
	zc_flatten_ctx c = {(char*)dst, scale, dst_dtype, src_dtype};
	return zc_run_segs(dev, (cudaStream_t)s, segs, nseg, zc_flatten_launch, &c);
}

extern "C" int zc_accumulate(int dev, uintptr_t s, uintptr_t acc, const zc_seg* segs, int nseg, int src_dtype,
                             int first, float scale, uintptr_t flag) {
	if (!zc_dtype_ok(src_dtype)) return ZC_ERR_BAD_DTYPE;
	if (dev < 0 || dev >= ZC_MAX_DEVICES) return (int)cudaErrorInvalidDevice;
	int err = zc_set(dev);
	if (err) return err;
	zc_acc_ctx c = {(float*)acc, (float*)flag, scale, src_dtype, first};
	return zc_run_segs(dev, (cudaStream_t)s, segs, nseg, zc_acc_launch, &c);
}

extern "C" int zc_cast(int dev, uintptr_t s, uintptr_t dst, int dst_dtype, uintptr_t src, int src_dtype, int64_t n,
                       float scale) {
	zc_seg one = {src, n, 0};
	return zc_flatten(dev, s, dst, dst_dtype, &one, 1, src_dtype, scale);
}

extern "C" int zc_sumsq(int dev, uintptr_t s, uintptr_t x, int64_t n, uintptr_t out) {
	int err = zc_set(dev);
	if (err) return err;
	cudaStream_t st = (cudaStream_t)s;
	int64_t nb = (n + ZC_THREADS * 16 - 1) / (ZC_THREADS * 16);
	if (nb < 1) nb = 1;
	if (nb > ZC_SUMSQ_MAX_BLOCKS) nb = ZC_SUMSQ_MAX_BLOCKS;
	double* part = NULL;
	err = (int)cudaMallocAsync((void**)&part, (size_t)nb * sizeof(double), st);
	if (err) return err;
	zc_k_sumsq_part<<<(unsigned)nb, ZC_THREADS, 0, st>>>((const float*)x, n, part);
	err = (int)cudaGetLastError();
	if (!err) {
		zc_k_sumsq_final<<<1, ZC_THREADS, 0, st>>>(part, (int)nb, (double*)out);
		err = (int)cudaGetLastError();
	}
	int ferr = (int)cudaFreeAsync(part, st);
	return err ? err : ferr;
}

static int zc_red_setup(zc_red_arg* a, const uintptr_t* dsts, int nout, const uintptr_t* srcs, int nsrc, int dtype,
                        int op, int64_t count) {
	if (!zc_dtype_ok(dtype) || op < ZERO_SUM || op > ZERO_MAX) return ZC_ERR_BAD_DTYPE;
	if (nout > ZC_MAX_RANKS || nsrc > ZC_MAX_RANKS) return ZC_ERR_TOO_MANY_RANKS;
	memset(a, 0, sizeof(*a));
	uintptr_t any = 0;
	for (int k = 0; k < nout; k++) any |= (a->dst[k] = dsts[k]);
	for (int k = 0; k < nsrc; k++) any |= (a->src[k] = srcs[k]);
	a->nout = nout;
	a->nsrc = nsrc;
	a->count = count;
	a->vec = (any & 15u) == 0 && (count * zc_size(dtype)) % 16 == 0;
	return 0;
}

extern "C" int zc_reduce(int dev, uintptr_t s, const uintptr_t* dsts, int nout, const uintptr_t* srcs, int nsrc,
                         int dtype, int op, int64_t count) {
	if (nout <= 0 || nsrc <= 0 || count <= 0) return 0;
	zc_red_arg a;
	int err = zc_red_setup(&a, dsts, nout, srcs, nsrc, dtype, op, count);
	if (err) return err;
	if ((err = zc_set(dev))) return err;
	int64_t items = a.vec ? count / ZC_PACK : count;
	dim3 g(zc_grid(items), (unsigned)nout);
	zc_reduce_tbl[dtype][op](g, (cudaStream_t)s, a);
	return (int)cudaGetLastError();
}

extern "C" int zc_allreduce(int dev, uintptr_t s, const uintptr_t* bufs, int n, int dtype, int op, int64_t count) {
	if (n <= 0 || count <= 0) return 0;
	zc_red_arg a;
	int err = zc_red_setup(&a, bufs, 0, bufs, n, dtype, op, count);
	if (err) return err;
	if ((err = zc_set(dev))) return err;
	int64_t items = a.vec ? count / ZC_PACK : count;
	zc_allreduce_tbl[dtype][op](dim3(zc_grid(items)), (cudaStream_t)s, a);
	return (int)cudaGetLastError();
}

extern "C" int zc_spin(int dev, uintptr_t s, int64_t ns) {
	int err = zc_set(dev);
	if (err) return err;
	zc_k_spin<<<1, 1, 0, (cudaStream_t)s>>>(ns);
	return (int)cudaGetLastError();
}
