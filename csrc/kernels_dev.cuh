/*
 * kernels_dev.cuh: the bodies of the CUDA kernels, one block or one thread
 * at a time, with the block and thread numbers passed in.
 *
 * kernels.cu wraps each body in a __global__ kernel (blockIdx.x,
 * threadIdx.x). Compiled without nvcc, the same bodies run on the host:
 * csrc/emu_test.cc (`make cuda-emu`) executes every block and thread of a
 * launch in turn and checks the result against the host C kernels, so the
 * indexing, the 16-byte pack path, the tails and the descriptor layout are
 * tested on machines without a GPU.
 */
#ifndef ZERO_KERNELS_DEV_CUH
#define ZERO_KERNELS_DEV_CUH

#include "../cuda_abi.h"

#ifdef __CUDACC__
#define ZC_DEV __device__ __forceinline__
#define ZC_HD __host__ __device__ __forceinline__
#define ZC_RESTRICT __restrict__
#define ZC_ALIGNED16(p) ((void)0)
#else
/* A 16-byte access to a misaligned address faults on a GPU but not on x86:
 * the emulator defines this to catch the vector paths that would. */
#ifndef ZC_ALIGNED16
#define ZC_ALIGNED16(p) ((void)0)
#endif
/* host emulation: the few CUDA types and intrinsics the bodies use */
#define ZC_DEV static inline
#define ZC_HD static inline
#define ZC_RESTRICT
struct uint4 {
	uint32_t x, y, z, w;
};
static inline uint4 make_uint4(uint32_t x, uint32_t y, uint32_t z, uint32_t w) {
	uint4 r = {x, y, z, w};
	return r;
}
template <class T>
static inline T __ldg(const T* p) {
	return *p;
}
static inline float __uint_as_float(uint32_t u) {
	float f;
	memcpy(&f, &u, 4);
	return f;
}
static inline uint32_t __float_as_uint(float f) {
	uint32_t u;
	memcpy(&u, &f, 4);
	return u;
}
#endif

/* ---- typed packs of 8 --------------------------------------------------- */

template <int T>
ZC_DEV float zc_widen(uint32_t h) {
	return T == ZERO_BF16 ? zero_bf16_to_f32((uint16_t)h) : zero_f16_to_f32((uint16_t)h);
}

template <int T>
ZC_DEV uint32_t zc_narrow(float v) {
	return T == ZERO_BF16 ? (uint32_t)zero_f32_to_bf16(v) : (uint32_t)zero_f32_to_f16(v);
}

/* 16 or 32 bytes of raw data: 8 elements of T. */
struct zc_raw {
	uint4 a, b;
};

/* Read-only (non-coherent cache) load, for sources the kernel never writes. */
template <int T>
ZC_DEV zc_raw zc_load_raw(const char* p) {
	ZC_ALIGNED16(p);
	zc_raw r;
	r.a = __ldg((const uint4*)p);
	r.b = T == ZERO_F32 ? __ldg((const uint4*)p + 1) : r.a;
	return r;
}

/* Plain load, for buffers the same kernel writes (accumulators, in-place
 * reductions). */
template <int T>
ZC_DEV zc_raw zc_load_raw_rw(const char* p) {
	ZC_ALIGNED16(p);
	zc_raw r;
	r.a = *(const uint4*)p;
	r.b = T == ZERO_F32 ? *((const uint4*)p + 1) : r.a;
	return r;
}

template <int T>
ZC_DEV void zc_unpack(const zc_raw& r, float v[ZC_PACK]) {
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
ZC_DEV zc_raw zc_pack(const float v[ZC_PACK]) {
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
ZC_DEV void zc_store_raw(char* p, const zc_raw& r) {
	ZC_ALIGNED16(p);
	*(uint4*)p = r.a;
	if (T == ZERO_F32) *((uint4*)p + 1) = r.b;
}

/* ---- segment lookup ------------------------------------------------------ */

/* The segment block b works on: the last one whose block0 <= b. */
ZC_DEV zc_dseg zc_find(const zc_dseg* segs, int nseg, int64_t b) {
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

/* ---- flatten (and cast): one block --------------------------------------- */

template <int DT, int ST, bool SCALE>
ZC_DEV void zc_flatten_block(char* ZC_RESTRICT dst, const zc_dseg* segs, int nseg, float scale, int64_t b, int tid) {
	const zc_dseg sg = zc_find(segs, nseg, b);
	const int64_t start = (b - sg.block0) * ZC_CHUNK;
	const int64_t end = sg.count < start + ZC_CHUNK ? sg.count : start + ZC_CHUNK;
	const char* ZC_RESTRICT src = (const char*)sg.src;
	char* ZC_RESTRICT d = dst + sg.offset * zc_size(DT);
	int64_t tail = start;
	if (((sg.src | (uintptr_t)d) & 15u) == 0) {
		const int64_t vend = start + (end - start) / ZC_PACK * ZC_PACK;
		zc_raw in[ZC_UNROLL];
#pragma unroll
		for (int u = 0; u < ZC_UNROLL; u++) {
			const int64_t i = start + ((int64_t)u * ZC_THREADS + tid) * ZC_PACK;
			if (i < vend) in[u] = zc_load_raw<ST>(src + i * zc_size(ST));
		}
#pragma unroll
		for (int u = 0; u < ZC_UNROLL; u++) {
			const int64_t i = start + ((int64_t)u * ZC_THREADS + tid) * ZC_PACK;
			if (i < vend) {
				if (DT == ST && !SCALE) { /* a bit copy, as on the host */
					zc_store_raw<DT>(d + i * zc_size(DT), in[u]);
					continue;
				}
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
	for (int64_t i = tail + tid; i < end; i += ZC_THREADS) {
		if (DT == ST && !SCALE) {
			zero_copy_elem(d, src, DT, i);
			continue;
		}
		float v = zero_load(src, ST, i);
		if (SCALE) v = v * scale;
		zero_store(d, DT, i, v);
	}
}

/* ---- unflatten: one block (flatten's inverse, one dtype) ------------------- */

/* Segment seg's destination is seg.src: its elements come from
 * flat[seg.offset + i]; a bit copy. */
template <int T>
ZC_DEV void zc_unflatten_block(const char* ZC_RESTRICT flat, const zc_dseg* segs, int nseg, int64_t b, int tid) {
	const zc_dseg sg = zc_find(segs, nseg, b);
	const int64_t start = (b - sg.block0) * ZC_CHUNK;
	const int64_t end = sg.count < start + ZC_CHUNK ? sg.count : start + ZC_CHUNK;
	char* ZC_RESTRICT d = (char*)sg.src;
	const char* ZC_RESTRICT src = flat + sg.offset * zc_size(T);
	int64_t tail = start;
	if ((((uintptr_t)src | (uintptr_t)d) & 15u) == 0) {
		const int64_t vend = start + (end - start) / ZC_PACK * ZC_PACK;
#pragma unroll
		for (int u = 0; u < ZC_UNROLL; u++) {
			const int64_t i = start + ((int64_t)u * ZC_THREADS + tid) * ZC_PACK;
			if (i < vend) zc_store_raw<T>(d + i * zc_size(T), zc_load_raw<T>(src + i * zc_size(T)));
		}
		tail = vend;
	}
	for (int64_t i = tail + tid; i < end; i += ZC_THREADS) zero_copy_elem(d, src, T, i);
}

/* ---- optimizers: one block of a range --------------------------------------- */

ZC_DEV zc_odesc zc_find_range(const zc_odesc* ds, int n, int64_t b) {
	int lo = 0, hi = n - 1;
	while (lo < hi) {
		int mid = (lo + hi + 1) >> 1;
		if (ds[mid].block0 <= b)
			lo = mid;
		else
			hi = mid - 1;
	}
	return ds[lo];
}

/* AdamW (SGD when !ADAM: m is the momentum buffer, may be NULL) on block b's
 * chunk of its range; the new parameter, cast to OUT, goes to out. */
template <int OUT, bool ADAM>
ZC_DEV void zc_opt_block(float* ZC_RESTRICT p, const float* ZC_RESTRICT g, float* ZC_RESTRICT m, float* ZC_RESTRICT v,
                         float* ZC_RESTRICT vmax, char* out, const zc_odesc* ds, int nd, float gscale, int64_t b,
                         int tid) {
	const zc_odesc d = zc_find_range(ds, nd, b);
	const zero_opt_range r = d.r;
	const int64_t start = (b - d.block0) * ZC_CHUNK;
	const int64_t end = r.count < start + ZC_CHUNK ? r.count : start + ZC_CHUNK;
	for (int64_t i = start + tid; i < end; i += ZC_THREADS) {
		const int64_t j = r.offset + i;
		if (ADAM)
			zero_adamw_elem(&p[j], &m[j], &v[j], (r.flags & ZERO_OPT_AMSGRAD) ? &vmax[j] : (float*)0, g[j] * gscale, &r);
		else
			zero_sgd_elem(&p[j], m ? &m[j] : (float*)0, g[j] * gscale, &r);
		if (out) zero_store(out, OUT, j, p[j]);
	}
}

/* ---- accumulate: one block; returns nonzero if this thread saw inf/NaN ---- */

template <int ST, bool SCALE, bool FIRST>
ZC_DEV uint32_t zc_accumulate_block(float* ZC_RESTRICT acc, const zc_dseg* segs, int nseg, float scale, int64_t b,
                                    int tid) {
	const zc_dseg sg = zc_find(segs, nseg, b);
	const int64_t start = (b - sg.block0) * ZC_CHUNK;
	const int64_t end = sg.count < start + ZC_CHUNK ? sg.count : start + ZC_CHUNK;
	const char* ZC_RESTRICT src = (const char*)sg.src;
	float* ZC_RESTRICT d = acc + sg.offset;
	uint32_t bad = 0;
	int64_t tail = start;
	if (((sg.src | (uintptr_t)d) & 15u) == 0) {
		const int64_t vend = start + (end - start) / ZC_PACK * ZC_PACK;
		zc_raw in[ZC_UNROLL], old[ZC_UNROLL];
#pragma unroll
		for (int u = 0; u < ZC_UNROLL; u++) {
			const int64_t i = start + ((int64_t)u * ZC_THREADS + tid) * ZC_PACK;
			if (i < vend) {
				in[u] = zc_load_raw<ST>(src + i * zc_size(ST));
				if (!FIRST) old[u] = zc_load_raw_rw<ZERO_F32>((const char*)(d + i));
			}
		}
#pragma unroll
		for (int u = 0; u < ZC_UNROLL; u++) {
			const int64_t i = start + ((int64_t)u * ZC_THREADS + tid) * ZC_PACK;
			if (i < vend) {
				float v[ZC_PACK], o[ZC_PACK];
				zc_unpack<ST>(in[u], v);
				if (!FIRST) zc_unpack<ZERO_F32>(old[u], o);
#pragma unroll
				for (int k = 0; k < ZC_PACK; k++) {
					if (SCALE) v[k] = v[k] * scale;
					const float r = FIRST ? v[k] : o[k] + v[k];
					v[k] = r;
					bad |= (uint32_t)!zero_isfinite(r);
				}
				zc_store_raw<ZERO_F32>((char*)(d + i), zc_pack<ZERO_F32>(v));
			}
		}
		tail = vend;
	}
	for (int64_t i = tail + tid; i < end; i += ZC_THREADS) {
		float v = zero_load(src, ST, i);
		if (SCALE) v = v * scale;
		const float r = FIRST ? v : d[i] + v;
		d[i] = r;
		bad |= (uint32_t)!zero_isfinite(r);
	}
	return bad;
}

/* ---- in-process reductions: one thread of a grid-stride loop --------------- */

/* Packs p0, p0+stride, ... (ZC_UNROLL of them, those below packs) of
 * output j: every rank's packs are loaded before any is combined, so each
 * thread keeps ZC_UNROLL 16-byte loads in flight instead of one. Elements
 * still combine in rank order. */
template <int T, int OP>
ZC_DEV void zc_reduce_packs(const zc_red_arg& a, int64_t base, int64_t p0, int64_t stride, int64_t packs,
                            float t[ZC_UNROLL][ZC_PACK]) {
	zc_raw r[ZC_UNROLL];
#pragma unroll
	for (int u = 0; u < ZC_UNROLL; u++) {
		const int64_t p = p0 + u * stride;
		if (p < packs) r[u] = zc_load_raw_rw<T>((const char*)a.src[0] + (base + p * ZC_PACK) * zc_size(T));
	}
#pragma unroll
	for (int u = 0; u < ZC_UNROLL; u++)
		if (p0 + u * stride < packs) zc_unpack<T>(r[u], t[u]);
	for (int k = 1; k < a.nsrc; k++) {
#pragma unroll
		for (int u = 0; u < ZC_UNROLL; u++) {
			const int64_t p = p0 + u * stride;
			if (p < packs) r[u] = zc_load_raw_rw<T>((const char*)a.src[k] + (base + p * ZC_PACK) * zc_size(T));
		}
#pragma unroll
		for (int u = 0; u < ZC_UNROLL; u++) {
			if (p0 + u * stride >= packs) continue;
			float x[ZC_PACK];
			zc_unpack<T>(r[u], x);
#pragma unroll
			for (int e = 0; e < ZC_PACK; e++) t[u][e] = zero_op_combine(OP, t[u][e], x[e]);
		}
	}
#pragma unroll
	for (int u = 0; u < ZC_UNROLL; u++)
#pragma unroll
		for (int e = 0; e < ZC_PACK; e++) t[u][e] = zero_op_finish(OP, t[u][e], a.nsrc);
}

/* Output j; gtid is the thread's number in the grid's x dimension and
 * stride the number of threads in it. */
template <int T, int OP>
ZC_DEV void zc_reduce_thread(const zc_red_arg& a, int j, int64_t gtid, int64_t stride) {
	const int64_t base = (int64_t)j * a.count; /* element offset into every src */
	char* d = (char*)a.dst[j];
	int64_t tail = 0;
	if (a.vec) {
		const int64_t packs = a.count / ZC_PACK;
		for (int64_t p0 = gtid; p0 < packs; p0 += stride * ZC_UNROLL) {
			float t[ZC_UNROLL][ZC_PACK];
			zc_reduce_packs<T, OP>(a, base, p0, stride, packs, t);
#pragma unroll
			for (int u = 0; u < ZC_UNROLL; u++) {
				const int64_t p = p0 + u * stride;
				if (p < packs) zc_store_raw<T>(d + p * ZC_PACK * zc_size(T), zc_pack<T>(t[u]));
			}
		}
		tail = packs * ZC_PACK;
	}
	for (int64_t i = tail + gtid; i < a.count; i += stride) {
		float t = zero_load((const void*)a.src[0], T, base + i);
		for (int k = 1; k < a.nsrc; k++) t = zero_op_combine(OP, t, zero_load((const void*)a.src[k], T, base + i));
		zero_store(d, T, i, zero_op_finish(OP, t, a.nsrc));
	}
}

/* Fused in-place all-reduce over a.src[0..nsrc): the result is written to
 * every buffer. */
template <int T, int OP>
ZC_DEV void zc_allreduce_thread(const zc_red_arg& a, int64_t gtid, int64_t stride) {
	int64_t tail = 0;
	if (a.vec) {
		const int64_t packs = a.count / ZC_PACK;
		for (int64_t p0 = gtid; p0 < packs; p0 += stride * ZC_UNROLL) {
			float t[ZC_UNROLL][ZC_PACK];
			zc_reduce_packs<T, OP>(a, 0, p0, stride, packs, t);
#pragma unroll
			for (int u = 0; u < ZC_UNROLL; u++) {
				const int64_t p = p0 + u * stride;
				if (p >= packs) continue;
				const zc_raw r = zc_pack<T>(t[u]);
				for (int k = 0; k < a.nsrc; k++) zc_store_raw<T>((char*)a.src[k] + p * ZC_PACK * zc_size(T), r);
			}
		}
		tail = packs * ZC_PACK;
	}
	for (int64_t i = tail + gtid; i < a.count; i += stride) {
		float t = zero_load((const void*)a.src[0], T, i);
		for (int k = 1; k < a.nsrc; k++) t = zero_op_combine(OP, t, zero_load((const void*)a.src[k], T, i));
		/* store once, then copy the stored bits, as the host kernel does */
		zero_store((void*)a.src[0], T, i, zero_op_finish(OP, t, a.nsrc));
		if (T == ZERO_F32) {
			const uint32_t bits = ((const uint32_t*)a.src[0])[i];
			for (int k = 1; k < a.nsrc; k++) ((uint32_t*)a.src[k])[i] = bits;
		} else {
			const uint16_t bits = ((const uint16_t*)a.src[0])[i];
			for (int k = 1; k < a.nsrc; k++) ((uint16_t*)a.src[k])[i] = bits;
		}
	}
}

/* ---- sum of squares: a thread's partial sum -------------------------------- */

ZC_DEV double zc_sumsq_thread(const float* ZC_RESTRICT x, int64_t n, int64_t gtid, int64_t stride) {
	double acc = 0.0;
	for (int64_t i = gtid; i < n; i += stride) {
		const double d = (double)x[i];
		acc = acc + d * d;
	}
	return acc;
}

#endif /* ZERO_KERNELS_DEV_CUH */
