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
#define ZC_ALIGNED8(p) ((void)0)
#else
/* A 16-byte access to a misaligned address faults on a GPU but not on x86:
 * the emulator defines this to catch the vector paths that would. */
#ifndef ZC_ALIGNED16
#define ZC_ALIGNED16(p) ((void)0)
#endif
/* an 8-byte access: p is 8-aligned when p less its bit 3 is 16-aligned */
#ifndef ZC_ALIGNED8
#define ZC_ALIGNED8(p) ZC_ALIGNED16((const char*)(p) - ((uintptr_t)(p) & 8u))
#endif
/* host emulation: the few CUDA types and intrinsics the bodies use */
#define ZC_DEV static inline
#define ZC_HD static inline
#define ZC_RESTRICT
struct uint4 {
	uint32_t x, y, z, w;
};
struct uint2 {
	uint32_t x, y;
};
static inline uint2 make_uint2(uint32_t x, uint32_t y) {
	uint2 r = {x, y};
	return r;
}
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

/* 16 or 32 bytes of raw data: 8 elements of T, two quads of 4: elements
 * 0-3 in a (fp32) or a.x, a.y (16-bit), 4-7 in b or a.z, a.w. */
struct zc_raw {
	uint4 a, b;
};

/* ---- where a thread's pack lies -------------------------------------------- */

#define ZC_WARP 32
#define ZC_SPAN (ZC_WARP * ZC_PACK) /* elements of a warp's 32 packs */

/* Pack s is its two quads. Contiguous, pack s is elements [8s, 8s+8); with
 * fp32 a warp's 16-byte accesses then fall at a 32-byte stride, half of
 * every sector per store instruction, which costs DRAM write bandwidth. So
 * kernels that touch fp32 split: a warp's span of 256 elements is cut in
 * halves and lane l takes quad l of each, [4l, 4l+4) and [128+4l, 132+4l),
 * so each access of the warp is one run of 512 bytes (fp32) or 256 (16-bit).
 * Every kernel uses one mapping for all its arrays, so elements stay paired.
 * zc_quad0 is the first quad's element offset, ZC_QUAD1 the second's from it. */
template <bool SPLIT>
ZC_HD int64_t zc_quad0(int64_t s) {
	return SPLIT ? (s & ~(int64_t)(ZC_WARP - 1)) * ZC_PACK + (s & (ZC_WARP - 1)) * 4 : s * ZC_PACK;
}
#define ZC_QUAD1(SPLIT) ((SPLIT) ? ZC_SPAN / 2 : 4)

/* How many of n elements the packs cover: whole spans when split, so a
 * warp's packs are all in or all out. */
template <bool SPLIT>
ZC_HD int64_t zc_vec_count(int64_t n) {
	return SPLIT ? n / ZC_SPAN * ZC_SPAN : n / ZC_PACK * ZC_PACK;
}

/* A 16- or 8-byte load; RO: through the read-only (non-coherent) cache, for
 * sources the kernel never writes; else plain, for buffers it writes. */
template <class V, bool RO>
ZC_DEV V zc_ld(const char* p) {
	if (sizeof(V) == 16)
		ZC_ALIGNED16(p);
	else
		ZC_ALIGNED8(p);
	return RO ? __ldg((const V*)p) : *(const V*)p;
}

template <class V>
ZC_DEV void zc_st(char* p, const V& x) {
	if (sizeof(V) == 16)
		ZC_ALIGNED16(p);
	else
		ZC_ALIGNED8(p);
	*(V*)p = x;
}

/* The pack whose first quad is element q of base (16-byte aligned). */
template <int T, bool SPLIT, bool RO>
ZC_DEV zc_raw zc_load_pack(const char* base, int64_t q) {
	const char* p0 = base + q * zc_size(T);
	const char* p1 = p0 + ZC_QUAD1(SPLIT) * zc_size(T);
	zc_raw r;
	if (T == ZERO_F32) {
		r.a = zc_ld<uint4, RO>(p0);
		r.b = zc_ld<uint4, RO>(p1);
	} else if (!SPLIT) {
		r.a = zc_ld<uint4, RO>(p0);
		r.b = r.a;
	} else {
		const uint2 lo = zc_ld<uint2, RO>(p0), hi = zc_ld<uint2, RO>(p1);
		r.a = make_uint4(lo.x, lo.y, hi.x, hi.y);
		r.b = r.a;
	}
	return r;
}

template <int T, bool SPLIT>
ZC_DEV void zc_store_pack(char* base, int64_t q, const zc_raw& r) {
	char* p0 = base + q * zc_size(T);
	char* p1 = p0 + ZC_QUAD1(SPLIT) * zc_size(T);
	if (T == ZERO_F32) {
		zc_st(p0, r.a);
		zc_st(p1, r.b);
	} else if (!SPLIT) {
		zc_st(p0, r.a);
	} else {
		zc_st(p0, make_uint2(r.a.x, r.a.y));
		zc_st(p1, make_uint2(r.a.z, r.a.w));
	}
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
	const bool SPLIT = DT == ZERO_F32 || ST == ZERO_F32;
	int64_t tail = start;
	if (((sg.src | (uintptr_t)d) & 15u) == 0) {
		const int64_t vend = start + zc_vec_count<SPLIT>(end - start);
		zc_raw in[ZC_UNROLL];
#pragma unroll
		for (int u = 0; u < ZC_UNROLL; u++) {
			const int64_t s = (int64_t)u * ZC_THREADS + tid;
			if (start + s * ZC_PACK < vend) in[u] = zc_load_pack<ST, SPLIT, true>(src, start + zc_quad0<SPLIT>(s));
		}
#pragma unroll
		for (int u = 0; u < ZC_UNROLL; u++) {
			const int64_t s = (int64_t)u * ZC_THREADS + tid;
			if (start + s * ZC_PACK < vend) {
				const int64_t q = start + zc_quad0<SPLIT>(s);
				if (DT == ST && !SCALE) { /* a bit copy, as on the host */
					zc_store_pack<DT, SPLIT>(d, q, in[u]);
					continue;
				}
				float v[ZC_PACK];
				zc_unpack<ST>(in[u], v);
				if (SCALE) {
#pragma unroll
					for (int k = 0; k < ZC_PACK; k++) v[k] = v[k] * scale;
				}
				zc_store_pack<DT, SPLIT>(d, q, zc_pack<DT>(v));
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
	const bool SPLIT = T == ZERO_F32;
	int64_t tail = start;
	if ((((uintptr_t)src | (uintptr_t)d) & 15u) == 0) {
		const int64_t vend = start + zc_vec_count<SPLIT>(end - start);
#pragma unroll
		for (int u = 0; u < ZC_UNROLL; u++) {
			const int64_t s = (int64_t)u * ZC_THREADS + tid;
			const int64_t q = start + zc_quad0<SPLIT>(s);
			if (start + s * ZC_PACK < vend) zc_store_pack<T, SPLIT>(d, q, zc_load_pack<T, SPLIT, true>(src, q));
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
 * chunk of its range; the new parameter, cast to OUT, goes to out. Split
 * packs where every array the range touches is 16-byte aligned at its first
 * element (one 4-byte element a thread kept too few loads in flight), one
 * element a thread for the rest; the same zero_*_elem either way. */
template <int OUT, bool ADAM>
ZC_DEV void zc_opt_block(float* ZC_RESTRICT p, const float* ZC_RESTRICT g, float* ZC_RESTRICT m, float* ZC_RESTRICT v,
                         float* ZC_RESTRICT vmax, char* out, const zc_odesc* ds, int nd, float gscale, int64_t b,
                         int tid) {
	const zc_odesc d = zc_find_range(ds, nd, b);
	const zero_opt_range r = d.r;
	const int64_t start = (b - d.block0) * ZC_CHUNK;
	const int64_t end = r.count < start + ZC_CHUNK ? r.count : start + ZC_CHUNK;
	const bool ams = ADAM && (r.flags & ZERO_OPT_AMSGRAD);
	const bool mwrite = m && (ADAM || r.beta1c != 0.0f);
	const bool mread = mwrite && (ADAM || !(r.flags & ZERO_OPT_FIRST));
	const int64_t o = r.offset;
	uintptr_t addr = (uintptr_t)(p + o) | (uintptr_t)(g + o);
	if (mwrite) addr |= (uintptr_t)(m + o);
	if (ADAM) addr |= (uintptr_t)(v + o);
	if (ams) addr |= (uintptr_t)(vmax + o);
	if (out) addr |= (uintptr_t)(out + o * zc_size(OUT));
	int64_t tail = start;
	if ((addr & 15u) == 0) {
		const int64_t vend = start + zc_vec_count<true>(end - start);
		for (int u = 0; u < ZC_UNROLL; u++) {
			const int64_t s = (int64_t)u * ZC_THREADS + tid;
			if (start + s * ZC_PACK >= vend) break;
			const int64_t j = o + start + zc_quad0<true>(s);
			float x[ZC_PACK], gg[ZC_PACK], mm[ZC_PACK] = {0}, vv[ZC_PACK] = {0}, vx[ZC_PACK] = {0};
			zc_unpack<ZERO_F32>(zc_load_pack<ZERO_F32, true, false>((const char*)p, j), x);
			zc_unpack<ZERO_F32>(zc_load_pack<ZERO_F32, true, true>((const char*)g, j), gg);
			if (mread) zc_unpack<ZERO_F32>(zc_load_pack<ZERO_F32, true, false>((const char*)m, j), mm);
			if (ADAM) zc_unpack<ZERO_F32>(zc_load_pack<ZERO_F32, true, false>((const char*)v, j), vv);
			if (ams) zc_unpack<ZERO_F32>(zc_load_pack<ZERO_F32, true, false>((const char*)vmax, j), vx);
#pragma unroll
			for (int k = 0; k < ZC_PACK; k++) {
				if (ADAM)
					zero_adamw_elem(&x[k], &mm[k], &vv[k], ams ? &vx[k] : (float*)0, gg[k] * gscale, &r);
				else
					zero_sgd_elem(&x[k], m ? &mm[k] : (float*)0, gg[k] * gscale, &r);
			}
			zc_store_pack<ZERO_F32, true>((char*)p, j, zc_pack<ZERO_F32>(x));
			if (mwrite) zc_store_pack<ZERO_F32, true>((char*)m, j, zc_pack<ZERO_F32>(mm));
			if (ADAM) zc_store_pack<ZERO_F32, true>((char*)v, j, zc_pack<ZERO_F32>(vv));
			if (ams) zc_store_pack<ZERO_F32, true>((char*)vmax, j, zc_pack<ZERO_F32>(vx));
			if (out) zc_store_pack<OUT, true>(out, j, zc_pack<OUT>(x));
		}
		tail = vend;
	}
	for (int64_t i = tail + tid; i < end; i += ZC_THREADS) {
		const int64_t j = r.offset + i;
		if (ADAM)
			zero_adamw_elem(&p[j], &m[j], &v[j], (r.flags & ZERO_OPT_AMSGRAD) ? &vmax[j] : (float*)0, g[j] * gscale, &r);
		else
			zero_sgd_elem(&p[j], m ? &m[j] : (float*)0, g[j] * gscale, &r);
		if (out) zero_store(out, OUT, j, p[j]);
	}
}

/* ---- accumulate: one block; returns nonzero if this thread saw inf/NaN ---- */

/* Stored bits (of dtype T) whose exponent is all ones: inf or NaN. */
template <int T>
ZC_DEV uint32_t zc_nonfinite(uint32_t bits) {
	const uint32_t top = T == ZERO_F32 ? 0x7f800000u : T == ZERO_BF16 ? 0x7f80u : 0x7c00u;
	return (uint32_t)((bits & top) == top);
}

/* The stored values of a pack of T that are inf or NaN (nonzero if any). */
template <int T>
ZC_DEV uint32_t zc_pack_nonfinite(const zc_raw& r) {
	if (T == ZERO_F32)
		return zc_nonfinite<T>(r.a.x) | zc_nonfinite<T>(r.a.y) | zc_nonfinite<T>(r.a.z) | zc_nonfinite<T>(r.a.w) |
		       zc_nonfinite<T>(r.b.x) | zc_nonfinite<T>(r.b.y) | zc_nonfinite<T>(r.b.z) | zc_nonfinite<T>(r.b.w);
	const uint32_t w[4] = {r.a.x, r.a.y, r.a.z, r.a.w};
	uint32_t bad = 0;
#pragma unroll
	for (int k = 0; k < 4; k++) bad |= zc_nonfinite<T>(w[k] & 0xffffu) | zc_nonfinite<T>(w[k] >> 16);
	return bad;
}

/* acc (dtype AT: fp32, bf16 or fp16) = AT(first ? v : float(acc) + v), v =
 * float(src) * scale: the sum in fp32, rounded once; the flag goes up when a
 * stored value is inf or NaN, so a 16-bit sum rounding to inf raises it. */
template <int AT, int ST, bool SCALE, bool FIRST>
ZC_DEV uint32_t zc_accumulate_block(char* ZC_RESTRICT acc, const zc_dseg* segs, int nseg, float scale, int64_t b,
                                    int tid) {
	const zc_dseg sg = zc_find(segs, nseg, b);
	const int64_t start = (b - sg.block0) * ZC_CHUNK;
	const int64_t end = sg.count < start + ZC_CHUNK ? sg.count : start + ZC_CHUNK;
	const char* ZC_RESTRICT src = (const char*)sg.src;
	char* ZC_RESTRICT d = acc + sg.offset * zc_size(AT);
	const bool SPLIT = AT == ZERO_F32 || ST == ZERO_F32;
	uint32_t bad = 0;
	int64_t tail = start;
	if (((sg.src | (uintptr_t)d) & 15u) == 0) {
		const int64_t vend = start + zc_vec_count<SPLIT>(end - start);
		zc_raw in[ZC_UNROLL], old[ZC_UNROLL];
#pragma unroll
		for (int u = 0; u < ZC_UNROLL; u++) {
			const int64_t s = (int64_t)u * ZC_THREADS + tid;
			const int64_t q = start + zc_quad0<SPLIT>(s);
			if (start + s * ZC_PACK < vend) {
				in[u] = zc_load_pack<ST, SPLIT, true>(src, q);
				if (!FIRST) old[u] = zc_load_pack<AT, SPLIT, false>(d, q);
			}
		}
#pragma unroll
		for (int u = 0; u < ZC_UNROLL; u++) {
			const int64_t s = (int64_t)u * ZC_THREADS + tid;
			if (start + s * ZC_PACK < vend) {
				float v[ZC_PACK], o[ZC_PACK];
				zc_unpack<ST>(in[u], v);
				if (!FIRST) zc_unpack<AT>(old[u], o);
#pragma unroll
				for (int k = 0; k < ZC_PACK; k++) {
					if (SCALE) v[k] = v[k] * scale;
					v[k] = FIRST ? v[k] : o[k] + v[k];
				}
				const zc_raw r = zc_pack<AT>(v);
				bad |= zc_pack_nonfinite<AT>(r);
				zc_store_pack<AT, SPLIT>(d, start + zc_quad0<SPLIT>(s), r);
			}
		}
		tail = vend;
	}
	for (int64_t i = tail + tid; i < end; i += ZC_THREADS) {
		float v = zero_load(src, ST, i);
		if (SCALE) v = v * scale;
		const float r = FIRST ? v : zero_load(d, AT, i) + v;
		if (AT == ZERO_F32) {
			((float*)d)[i] = r;
			bad |= zc_nonfinite<AT>(__float_as_uint(r));
		} else {
			const uint32_t h = zc_narrow<AT>(r);
			((uint16_t*)d)[i] = (uint16_t)h;
			bad |= zc_nonfinite<AT>(h);
		}
	}
	return bad;
}

/* ---- in-process reductions: one thread of a grid-stride loop --------------- */

/* Packs p0, p0+stride, ... (ZC_UNROLL of them, those below packs) of
 * output j: every rank's packs are loaded before any is combined, so each
 * thread keeps ZC_UNROLL 16-byte loads in flight instead of one. Elements
 * still combine in rank order. fp32 packs are split (zc_quad0): a warp's
 * lanes have consecutive p, the first a multiple of ZC_WARP. */
template <int T, int OP>
ZC_DEV void zc_reduce_packs(const zc_red_arg& a, int64_t base, int64_t p0, int64_t stride, int64_t packs,
                            float t[ZC_UNROLL][ZC_PACK]) {
	const bool SPLIT = T == ZERO_F32;
	zc_raw r[ZC_UNROLL];
#pragma unroll
	for (int u = 0; u < ZC_UNROLL; u++) {
		const int64_t p = p0 + u * stride;
		if (p < packs) r[u] = zc_load_pack<T, SPLIT, false>((const char*)a.src[0] + base * zc_size(T), zc_quad0<SPLIT>(p));
	}
#pragma unroll
	for (int u = 0; u < ZC_UNROLL; u++)
		if (p0 + u * stride < packs) zc_unpack<T>(r[u], t[u]);
	for (int k = 1; k < a.nsrc; k++) {
#pragma unroll
		for (int u = 0; u < ZC_UNROLL; u++) {
			const int64_t p = p0 + u * stride;
			if (p < packs) r[u] = zc_load_pack<T, SPLIT, false>((const char*)a.src[k] + base * zc_size(T), zc_quad0<SPLIT>(p));
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
	const bool SPLIT = T == ZERO_F32;
	int64_t tail = 0;
	if (a.vec) {
		const int64_t packs = zc_vec_count<SPLIT>(a.count) / ZC_PACK;
		for (int64_t p0 = gtid; p0 < packs; p0 += stride * ZC_UNROLL) {
			float t[ZC_UNROLL][ZC_PACK];
			zc_reduce_packs<T, OP>(a, base, p0, stride, packs, t);
#pragma unroll
			for (int u = 0; u < ZC_UNROLL; u++) {
				const int64_t p = p0 + u * stride;
				if (p < packs) zc_store_pack<T, SPLIT>(d, zc_quad0<SPLIT>(p), zc_pack<T>(t[u]));
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
	const bool SPLIT = T == ZERO_F32;
	int64_t tail = 0;
	if (a.vec) {
		const int64_t packs = zc_vec_count<SPLIT>(a.count) / ZC_PACK;
		for (int64_t p0 = gtid; p0 < packs; p0 += stride * ZC_UNROLL) {
			float t[ZC_UNROLL][ZC_PACK];
			zc_reduce_packs<T, OP>(a, 0, p0, stride, packs, t);
#pragma unroll
			for (int u = 0; u < ZC_UNROLL; u++) {
				const int64_t p = p0 + u * stride;
				if (p >= packs) continue;
				const zc_raw r = zc_pack<T>(t[u]);
				for (int k = 0; k < a.nsrc; k++) zc_store_pack<T, SPLIT>((char*)a.src[k], zc_quad0<SPLIT>(p), r);
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

/* ZC_UNROLL 16-byte loads in flight before any is summed, for a grid capped
 * at ZC_SUMSQ_MAX_BLOCKS blocks (on an H200 a few percent over one 4-byte
 * load at a time). The order of the sum depends only on n, the grid and
 * x's alignment, so it is the same run to run. */
ZC_DEV double zc_sumsq_thread(const float* ZC_RESTRICT x, int64_t n, int64_t gtid, int64_t stride) {
	double acc = 0.0;
	int64_t tail = 0;
	if (((uintptr_t)x & 15u) == 0) {
		const int64_t nq = n / 4; /* quads of 4 elements */
		for (int64_t q0 = gtid; q0 < nq; q0 += stride * ZC_UNROLL) {
			uint4 r[ZC_UNROLL];
#pragma unroll
			for (int u = 0; u < ZC_UNROLL; u++)
				if (q0 + u * stride < nq) r[u] = zc_ld<uint4, true>((const char*)(x + 4 * (q0 + u * stride)));
#pragma unroll
			for (int u = 0; u < ZC_UNROLL; u++) {
				if (q0 + u * stride >= nq) continue;
				const uint32_t w[4] = {r[u].x, r[u].y, r[u].z, r[u].w};
#pragma unroll
				for (int k = 0; k < 4; k++) {
					const double d = (double)__uint_as_float(w[k]);
					acc = acc + d * d;
				}
			}
		}
		tail = nq * 4;
	}
	for (int64_t i = tail + gtid; i < n; i += stride) {
		const double d = (double)x[i];
		acc = acc + d * d;
	}
	return acc;
}

/* ---- the norm: sums of squares per chunk ----------------------------------- */

/* The fixed tree over a block's ZC_THREADS doubles: at widths w =
 * ZC_THREADS/2, ..., 1, s[t] = s[t] + s[t + w] for every t < w; the result
 * is s[0]. On the host the steps run for every thread in turn. */
#ifdef __CUDACC__
ZC_DEV double zc_tree(double* s) {
	for (int w = ZC_THREADS / 2; w > 0; w >>= 1) {
		__syncthreads();
		if ((int)threadIdx.x < w) s[threadIdx.x] = s[threadIdx.x] + s[threadIdx.x + w];
	}
	__syncthreads();
	return s[0];
}
#else
ZC_DEV double zc_tree(double* s) {
	for (int w = ZC_THREADS / 2; w > 0; w >>= 1)
		for (int t = 0; t < w; t++) s[t] = s[t] + s[t + w];
	return s[0];
}
#endif

#define ZC_SQ_BATCH 8 /* loads a thread has in flight before it adds */

/* Thread tid's share of the sum of squares of x[start, end), at most
 * ZC_CHUNK elements of dtype T: (double)v * (double)v for its elements
 * start+tid, start+tid+ZC_THREADS, ..., added in that order from 0 (the
 * square of an fp32 value is exact in double). The order depends on the
 * positions in the chunk only, not on the address: the landing that stored
 * a chunk (zc_acc_sq_thread) and a later pass over it (zc_chunksq) give the
 * same bits. */
template <int T>
ZC_DEV double zc_chunk_sq_thread(const char* ZC_RESTRICT x, int64_t start, int64_t end, int tid) {
	double acc = 0.0;
	for (int64_t i0 = start + tid; i0 < end; i0 += (int64_t)ZC_SQ_BATCH * ZC_THREADS) {
		float v[ZC_SQ_BATCH];
#pragma unroll
		for (int u = 0; u < ZC_SQ_BATCH; u++) {
			const int64_t i = i0 + (int64_t)u * ZC_THREADS;
			v[u] = i < end ? zero_load(x, T, i) : 0.0f;
		}
#pragma unroll
		for (int u = 0; u < ZC_SQ_BATCH; u++) {
			if (i0 + (int64_t)u * ZC_THREADS < end) {
				const double d = (double)v[u];
				acc = acc + d * d;
			}
		}
	}
	return acc;
}

/* Thread tid's share of the squares of what block b of an accumulate
 * launch stored into acc (dtype AT): its chunk of its segment, read back
 * after the block's barrier. */
template <int AT>
ZC_DEV double zc_acc_sq_thread(const char* acc, const zc_dseg* segs, int nseg, int64_t b, int tid) {
	const zc_dseg sg = zc_find(segs, nseg, b);
	const int64_t start = (b - sg.block0) * ZC_CHUNK;
	const int64_t end = sg.count < start + ZC_CHUNK ? sg.count : start + ZC_CHUNK;
	return zc_chunk_sq_thread<AT>(acc + sg.offset * zc_size(AT), start, end, tid);
}

/* Thread tid's share of the sum of p[0, n): p[tid] + p[tid + ZC_THREADS] +
 * ..., in that order from 0; zc_tree then adds the threads' shares. */
ZC_DEV double zc_sum_thread(const double* p, int64_t n, int tid) {
	double acc = 0.0;
	for (int64_t i = tid; i < n; i += ZC_THREADS) acc = acc + p[i];
	return acc;
}

#endif /* ZERO_KERNELS_DEV_CUH */
