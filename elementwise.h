/*
 * elementwise.h: the scalar math of zero, defined once.
 *
 * Both the host C kernels (kernels.c, compiled by cgo) and the CUDA C kernels
 * (the .cu files in csrc/, which #include "../elementwise.h") use these functions, so both
 * paths convert, scale, add and compare with the same operations in the same
 * order and give the same bits.
 *
 * Determinism rules:
 *   - no FMA contraction: host C must be compiled as with -ffp-contract=off;
 *     cgo refuses that flag in #cgo CFLAGS, so this header sets it by pragma
 *     (gcc: #pragma GCC optimize, clang: #pragma STDC FP_CONTRACT OFF) for
 *     every function after the #include; nvcc must be given --fmad=false;
 *   - IEEE division and no flush-to-zero on the device: nvcc must not use
 *     --use_fast_math (keep -prec-div=true, -ftz=false, the defaults);
 *   - only the default rounding mode (round to nearest even) is assumed.
 *
 * Conversions work on the bits with <stdint.h> types; the one float operation
 * they use (the fp16 subnormal path) is an exact add whose rounding is the
 * rounding we want.
 */
#ifndef ZERO_ELEMENTWISE_H
#define ZERO_ELEMENTWISE_H

#if defined(__CUDACC_RTC__)
/* nvrtc has no C library headers */
typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef unsigned long long uint64_t;
typedef int int32_t;
typedef long long int64_t;
typedef unsigned long long uintptr_t;
#else
#include <math.h>
#include <stdint.h>
#endif

#if !defined(__CUDACC__)
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif
#endif

#ifdef __CUDACC__
#define ZERO_HD __host__ __device__ __forceinline__
#else
#define ZERO_HD static inline
#endif

/* dtype codes; they match DType in dtype.go (0 is "unset") */
#define ZERO_F32 1
#define ZERO_BF16 2
#define ZERO_F16 3

/* reduction op codes; they match ReduceOp in nccl.go */
#define ZERO_SUM 0
#define ZERO_AVG 1
#define ZERO_MAX 2

/* ---- bit casts ---------------------------------------------------------- */

ZERO_HD uint32_t zero_f2u(float f) {
#if defined(__CUDA_ARCH__)
	return __float_as_uint(f);
#else
	union { float f; uint32_t u; } c;
	c.f = f;
	return c.u;
#endif
}

ZERO_HD float zero_u2f(uint32_t u) {
#if defined(__CUDA_ARCH__)
	return __uint_as_float(u);
#else
	union { float f; uint32_t u; } c;
	c.u = u;
	return c.f;
#endif
}

/* zero_isfinite: neither inf nor NaN, decided on the exponent bits. */
ZERO_HD int zero_isfinite(float f) {
	return (zero_f2u(f) & 0x7f800000u) != 0x7f800000u;
}

/* ---- bf16 --------------------------------------------------------------- */

/* bf16 is the top half of an fp32: widening is a shift, exact for every
 * pattern (a NaN keeps its payload). */
ZERO_HD float zero_bf16_to_f32(uint16_t h) {
	return zero_u2f((uint32_t)h << 16);
}

/* Round to nearest even on the bits. bf16 has fp32's exponent range, so the
 * same add-and-truncate is right for subnormals, and a finite value past the
 * largest bf16 carries into the exponent and becomes inf, as RNE requires.
 * NaN is special-cased: truncating could clear every payload bit (-> inf) or
 * the carry could reach the sign, so it becomes a quiet NaN with its sign. */
ZERO_HD uint16_t zero_f32_to_bf16(float f) {
	uint32_t u = zero_f2u(f);
	/* all-ones if NaN; then no rounding increment, and the quiet bit set */
	uint32_t nan = 0u - (uint32_t)((int32_t)(u & 0x7fffffffu) > 0x7f800000);
	uint32_t bias = (0x7fffu + ((u >> 16) & 1u)) & ~nan;
	return (uint16_t)(((u + bias) >> 16) | (nan & 0x0040u));
}

/* ---- fp16 (IEEE binary16) ----------------------------------------------- */

/* Exact widening. Normal: rebias the exponent by 127-15 = 112. Subnormal
 * (exponent 0): m * 2^-24, formed exactly as (1 + m/1024) * 2^-14 - 2^-14.
 * inf/NaN (exponent 31): exponent 255, the payload kept and a NaN quietened. */
ZERO_HD float zero_f16_to_f32(uint16_t h) {
	uint32_t sign = ((uint32_t)h & 0x8000u) << 16;
	int32_t em = (int32_t)(h & 0x7fffu);
	int32_t e = em & 0x7c00;
	uint32_t o = (uint32_t)em << 13; /* exponent and mantissa in fp32 position */
	uint32_t normal = o + (112u << 23);
	uint32_t special = o + (224u << 23);
	uint32_t sub = zero_f2u(zero_u2f(o + (113u << 23)) - zero_u2f(113u << 23));
	/* all-ones masks instead of branches, so loops over this vectorise */
	uint32_t m_sub = 0u - (uint32_t)(e == 0);
	uint32_t m_spc = 0u - (uint32_t)(e == 0x7c00);
	uint32_t m_nan = 0u - (uint32_t)(em > 0x7c00);
	uint32_t r = (sub & m_sub) | (special & m_spc) | (normal & ~(m_sub | m_spc)) | (0x00400000u & m_nan);
	return zero_u2f(sign | r);
}

/* Round to nearest even, with fp16 subnormals, overflow to inf and quiet NaN.
 *  |x| >= 65520 (halfway between 65504 and 2^16, which ties to the even 2^16)
 *           -> inf; this also catches inf itself.
 *  |x| <  2^-14 (fp16 subnormal or zero): |x| + 0.5f lands in [0.5, 1), where
 *           the fp32 spacing is 2^-24, the fp16 subnormal step, so the add
 *           rounds |x| to a multiple of 2^-24 by RNE; the mantissa bits of
 *           the sum minus those of 0.5 are the fp16 bits (1024 carries into the
 *           smallest normal, 0x0400, which is right).
 *  otherwise: rebias the exponent (subtract 112 << 23), then RNE-drop 13 bits;
 *           a mantissa carry moves into the exponent, as it should.
 */
ZERO_HD uint16_t zero_f32_to_f16(float f) {
	uint32_t u = zero_f2u(f);
	uint32_t sign = (u >> 16) & 0x8000u;
	int32_t a = (int32_t)(u & 0x7fffffffu);
	uint32_t nan = 0x7e00u | (((uint32_t)a >> 13) & 0x01ffu);
	uint32_t sub = zero_f2u(zero_u2f((uint32_t)a) + 0.5f) - 0x3f000000u;
	uint32_t nrm = ((uint32_t)a - (112u << 23) + 0x0fffu + (((uint32_t)a >> 13) & 1u)) >> 13;
	/* all-ones masks instead of branches, so loops over this vectorise */
	uint32_t m_nan = 0u - (uint32_t)(a > 0x7f800000);
	uint32_t m_big = (0u - (uint32_t)(a >= 0x477ff000)) & ~m_nan;
	uint32_t m_sub = 0u - (uint32_t)(a < 0x38800000);
	uint32_t m_nrm = ~(m_nan | m_big | m_sub);
	uint32_t r = (nan & m_nan) | (0x7c00u & m_big) | (sub & m_sub) | (nrm & m_nrm);
	return (uint16_t)(sign | r);
}

/* ---- typed load / store ------------------------------------------------- */

ZERO_HD float zero_load(const void* p, int dtype, int64_t i) {
	switch (dtype) {
	case ZERO_BF16:
		return zero_bf16_to_f32(((const uint16_t*)p)[i]);
	case ZERO_F16:
		return zero_f16_to_f32(((const uint16_t*)p)[i]);
	default:
		return ((const float*)p)[i];
	}
}

ZERO_HD void zero_store(void* p, int dtype, int64_t i, float v) {
	switch (dtype) {
	case ZERO_BF16:
		((uint16_t*)p)[i] = zero_f32_to_bf16(v);
		break;
	case ZERO_F16:
		((uint16_t*)p)[i] = zero_f32_to_f16(v);
		break;
	default:
		((float*)p)[i] = v;
		break;
	}
}

/* A conversion between equal dtypes with no scale is a bit copy (a NaN keeps
 * its signalling bit): flatten and cast use it, on the host and the GPU. */
ZERO_HD void zero_copy_elem(void* dst, const void* src, int dtype, int64_t i) {
	if (dtype == ZERO_F32)
		((uint32_t*)dst)[i] = ((const uint32_t*)src)[i];
	else
		((uint16_t*)dst)[i] = ((const uint16_t*)src)[i];
}

/* ---- scaling and accumulation ------------------------------------------- */

/* zero_scale: v * s, skipped when s == 1 (the product would be the same bits
 * except for a signalling NaN, which the multiply would quieten; skipping it
 * keeps a copy a copy). Kernels hoist the test out of their loops. */
ZERO_HD float zero_scale(float v, float s) {
	return (s == 1.0f) ? v : v * s;
}

/* zero_accum: copy-vs-add into fp32: first ? v : acc + v. */
ZERO_HD float zero_accum(float acc, float v, int first) {
	return first ? v : acc + v;
}

/* ---- reductions across ranks -------------------------------------------- */
/* A reduction over ranks 0..n-1 is always formed in rank order, in fp32:
 *     s = x0; s = zero_op_combine(op, s, x1); ...; r = zero_op_finish(op, s, n)
 * and the result is stored once in the buffer's dtype. */

/* NaN-propagating max: x if x > s or x is NaN, else s (so a NaN in s stays).
 * Equal values, +0 and -0 included, keep the earlier rank's value. */
ZERO_HD float zero_max(float s, float x) {
	return (x > s || x != x) ? x : s;
}

ZERO_HD float zero_op_combine(int op, float s, float x) {
	return (op == ZERO_MAX) ? zero_max(s, x) : s + x;
}

/* AVG divides the rank-order sum by n once, in fp32. Where n is a power of
 * two, 1/n is exact and s * (1/n) is the same correctly rounded value as
 * s / n (subnormals included), so the cheaper multiply runs; elsewhere it is
 * an IEEE division. */
ZERO_HD float zero_op_finish(int op, float s, int n) {
	if (op != ZERO_AVG) return s;
	return (n & (n - 1)) == 0 ? s * (1.0f / (float)n) : s / (float)n;
}

/* ---- optimizers ----------------------------------------------------------- */
/* One step of an optimizer on one element of the fp32 master shard, with
 * PyTorch's formulas (torch.optim.AdamW, torch.optim.SGD) in the order and
 * fp32 rounding of their single-tensor loops. The hyperparameters of the
 * element's parameter come in a range descriptor, already in the form the
 * formulas use (computed in double on the host, rounded once to fp32). */

#define ZERO_OPT_AMSGRAD 1  /* AdamW: keep the running max of v */
#define ZERO_OPT_NESTEROV 2 /* SGD: Nesterov momentum */
#define ZERO_OPT_FIRST 4    /* SGD: the momentum buffer starts as the gradient */

typedef struct {
	int64_t offset, count; /* elements of the shard */
	float decay;   /* AdamW: 1 - lr*weight_decay;   SGD: weight_decay */
	float step;    /* AdamW: lr / (1 - beta1^t);     SGD: lr */
	float beta1c;  /* AdamW: 1 - beta1;              SGD: momentum */
	float beta2;   /* AdamW: beta2;                  SGD: 1 - dampening */
	float beta2c;  /* AdamW: 1 - beta2 */
	float bc2sqrt; /* AdamW: sqrt(1 - beta2^t) */
	float eps;     /* AdamW: eps, outside the square root */
	int32_t flags; /* ZERO_OPT_* */
} zero_opt_range;

/* AdamW: p.mul_(1 - lr*wd); m.lerp_(g, 1 - b1); v.mul_(b2).addcmul_(g, g, 1 - b2);
 * vmax = max(vmax, v) with amsgrad; p.addcdiv_(m, sqrt(v)/sqrt(bc2) + eps, -lr/bc1). */
ZERO_HD void zero_adamw_elem(float* p, float* m, float* v, float* vmax, float g, const zero_opt_range* r) {
	const float x = *p * r->decay;
	const float mm = *m + r->beta1c * (g - *m);
	const float vv = *v * r->beta2 + r->beta2c * (g * g);
	*m = mm;
	*v = vv;
	float d = vv;
	if (r->flags & ZERO_OPT_AMSGRAD) {
		d = (*vmax > vv) ? *vmax : vv;
		*vmax = d;
	}
	const float denom = sqrtf(d) / r->bc2sqrt + r->eps;
	*p = x - r->step * (mm / denom);
}

/* SGD: g += wd*p; buf = first ? g : buf*momentum + (1 - dampening)*g;
 * g = nesterov ? g + momentum*buf : buf (with momentum); p -= lr*g. */
ZERO_HD void zero_sgd_elem(float* p, float* buf, float g, const zero_opt_range* r) {
	if (r->decay != 0.0f) g = g + r->decay * *p;
	if (r->beta1c != 0.0f) {
		const float b = (r->flags & ZERO_OPT_FIRST) ? g : *buf * r->beta1c + r->beta2 * g;
		*buf = b;
		g = (r->flags & ZERO_OPT_NESTEROV) ? g + r->beta1c * b : b;
	}
	*p = *p - r->step * g;
}

#endif /* ZERO_ELEMENTWISE_H */
