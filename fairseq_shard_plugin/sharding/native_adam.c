/* Adam's host step over tensors stored in fp32, fp16 or bf16, in place and in fp32 math.
 *
 * Built on first use by native_adam.py (plain C, no torch headers: about a second).
 * ShardedAdam calls it through ctypes for CPU shards of any of these dtypes (where torch
 * would need fp32 copies of 16-bit ones and several passes), in line or per unit in a
 * background thread. Two passes per step with scaled fp16 moments, the second alone
 * otherwise:
 *
 *   adam_moment_maxima: the largest |new exp_avg| and new exp_avg_sq of each tensor, which
 *                       the scaled fp16 moments need before any of them is written
 *                       (FusedAdamV1's layout: stored = moment / scale);
 *   adam_update:        reads gradient, parameter and both moments, writes the parameter
 *                       and both moments, in one pass.
 *
 * The arithmetic is fairseq's Adam with decoupled weight decay, written as torch's fused
 * kernel rounds it, so that both give the same bits (epsilon is passed already divided by
 * sqrt(1 - beta2^t), which puts it before the bias correction as fairseq does). Both
 * passes compute the moments with the same inline function; -ffp-contract=off keeps them
 * bit-identical (the fused multiply-adds are written out).
 * With AVX2, F16C and FMA each value stays in registers from load to store, 8 at a time
 * (16 with AVX-512), and the lines AHEAD elements on are prefetched; elsewhere (and for
 * the last few elements) blocks of values pass through L1 buffers, with the same bits.
 * Work is split by element over `threads` pthreads (the caller is one of them).
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { F32 = 0, F16 = 1, BF16 = 2 };
enum { BLOCK = 512 };           /* elements per step of the inner loops (L1-resident) */
enum { MIN_PER_THREAD = 1 << 16 };
static const float FP16_LARGEST = 65504.0f;

typedef struct {
    void *param, *grad, *exp_avg, *exp_avg_sq;
    int64_t numel;
    int32_t param_dtype, grad_dtype, moment_dtype;  /* moments: F32, or F16 scaled */
    float scale_in[2];    /* stored x scale_in = moment (1 for fp32 moments) */
    float scale_out[2];   /* moment x (1 / scale_out) = stored (update, fp16 moments) */
    float step_size;      /* lr / (1 - beta1^t) */
    float bias_correction2_sqrt;
    float eps;            /* already divided by bias_correction2_sqrt */
} AdamTensor;

typedef struct {
    float beta2, avg_sq_grad_coefficient;  /* 1 - beta2 */
    float lerp_weight;    /* 1 - beta1: exp_avg moves this far towards the gradient */
    float keep;           /* 1 - lr x weight decay: what decoupled decay keeps */
    float grad_divisor;   /* 1 / the factor the gradients are multiplied by */
} AdamGroup;

/* Conversions, 8 elements at a time with AVX2 and F16C where the CPU has them (on x86
 * without F16C, GCC converts _Float16 in software, far slower), one at a time otherwise. */
#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#include <immintrin.h>
#define VECTOR_CONVERSIONS 1
#if defined(__AVX512F__) && defined(__AVX512DQ__)
#define WIDE_VECTORS 1
#endif
#endif

static inline float half_to_float(uint16_t bits) {
    _Float16 value;
    memcpy(&value, &bits, sizeof value);
    return (float)value;
}

static inline uint16_t float_to_half(float value) {
    _Float16 rounded = (_Float16)value;  /* nearest even */
    uint16_t bits;
    memcpy(&bits, &rounded, sizeof bits);
    return bits;
}

static inline float bf16_to_float(uint16_t value) {
    uint32_t bits = (uint32_t)value << 16;
    float result;
    memcpy(&result, &bits, sizeof result);
    return result;
}

static inline uint16_t float_to_bf16(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((bits >> 16) | 0x40u);                   /* a quiet NaN */
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);  /* nearest even */
}

static void halves_to_floats(const uint16_t *in, float *out, int n, float scale) {
    int i = 0;
#ifdef VECTOR_CONVERSIONS
    const __m256 factor = _mm256_set1_ps(scale);
    for (; i + 8 <= n; i += 8) {
        __m256 values = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(in + i)));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(values, factor));
    }
#endif
    for (; i < n; i++)
        out[i] = half_to_float(in[i]) * scale;
}

static void floats_to_halves(const float *in, uint16_t *out, int n) {
    int i = 0;
#ifdef VECTOR_CONVERSIONS
    for (; i + 8 <= n; i += 8) {
        __m128i halves = _mm256_cvtps_ph(_mm256_loadu_ps(in + i),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        _mm_storeu_si128((__m128i *)(out + i), halves);
    }
#endif
    for (; i < n; i++)
        out[i] = float_to_half(in[i]);
}

static void bf16s_to_floats(const uint16_t *in, float *out, int n, float scale) {
    int i = 0;
#ifdef VECTOR_CONVERSIONS
    const __m256 factor = _mm256_set1_ps(scale);
    for (; i + 8 <= n; i += 8) {
        __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(in + i)));
        __m256 values = _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(values, factor));
    }
#endif
    for (; i < n; i++)
        out[i] = bf16_to_float(in[i]) * scale;
}

static void floats_to_bf16s(const float *in, uint16_t *out, int n) {
    int i = 0;
#ifdef VECTOR_CONVERSIONS
    const __m256i one = _mm256_set1_epi32(1), half_ulp = _mm256_set1_epi32(0x7fff);
    const __m256i magnitude = _mm256_set1_epi32(0x7fffffff);
    const __m256i infinity = _mm256_set1_epi32(0x7f800000), quiet = _mm256_set1_epi32(0x40);
    for (; i + 8 <= n; i += 8) {
        __m256i bits = _mm256_castps_si256(_mm256_loadu_ps(in + i));
        __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), one);
        __m256i rounded = _mm256_srli_epi32(
            _mm256_add_epi32(bits, _mm256_add_epi32(half_ulp, odd)), 16);
        __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(bits, magnitude), infinity);
        __m256i quieted = _mm256_or_si256(_mm256_srli_epi32(bits, 16), quiet);
        __m256i result = _mm256_blendv_epi8(rounded, quieted, nan);
        /* 8 x 32 bits (each < 2^16) to 8 x 16 bits, in order */
        __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(result, result), 0xd8);
        _mm_storeu_si128((__m128i *)(out + i), _mm256_castsi256_si128(packed));
    }
#endif
    for (; i < n; i++)
        out[i] = float_to_bf16(in[i]);
}

/* n elements from `offset` as fp32 (times `scale`): the tensor itself when it is fp32 and
 * the scale 1, else `buffer`. */
static float *read_floats(void *base, int dtype, int64_t offset, int n, float scale,
                          float *buffer) {
    int i;
    if (dtype == F32) {
        float *values = (float *)base + offset;
        if (scale == 1.0f)
            return values;
        for (i = 0; i < n; i++)
            buffer[i] = values[i] * scale;
    } else if (dtype == F16) {
        halves_to_floats((const uint16_t *)base + offset, buffer, n, scale);
    } else {
        bf16s_to_floats((const uint16_t *)base + offset, buffer, n, scale);
    }
    return buffer;
}

/* Writes n fp32 values back from `values` (a no-op when they are the tensor itself). */
static void write_floats(void *base, int dtype, int64_t offset, int n, const float *values) {
    if (dtype == F32) {
        float *target = (float *)base + offset;
        if (target != values)
            memcpy(target, values, (size_t)n * sizeof(float));
    } else if (dtype == F16) {
        floats_to_halves(values, (uint16_t *)base + offset, n);
    } else {
        floats_to_bf16s(values, (uint16_t *)base + offset, n);
    }
}

/* Scaled fp16 moments: value / scale, saturated at fp16's largest (never infinite). */
static void write_scaled(void *base, int64_t offset, int n, float scale,
                         float *restrict values) {
    const float reciprocal = 1.0f / scale;  /* within a rounding of dividing, before fp16's */
    int i;
    for (i = 0; i < n; i++) {
        float stored = values[i] * reciprocal;
        stored = stored > FP16_LARGEST ? FP16_LARGEST : stored;
        values[i] = stored < -FP16_LARGEST ? -FP16_LARGEST : stored;
    }
    floats_to_halves(values, (uint16_t *)base + offset, n);
}

/* The largest of the magnitudes of n floats, compared as bit patterns (which order
 * non-negative floats as their values, and vectorise without -ffast-math); a NaN wins. */
static uint32_t largest_bits(const float *values, int n, uint32_t top) {
    const uint32_t *bits = (const uint32_t *)values;  /* -fno-strict-aliasing */
    int i;
    for (i = 0; i < n; i++) {
        uint32_t magnitude = bits[i] & 0x7fffffffu;
        top = magnitude > top ? magnitude : top;
    }
    return top;
}

/* exp_avg.lerp_(g, 1 - beta1) and exp_avg_sq * beta2 + (1 - beta2) g^2, rounded as torch's
 * fused CPU kernel rounds them (each as one fused multiply-add; checked bit for bit by
 * tests/test_native_adam.py), for n elements. */
static inline void next_moments(const AdamGroup *group, int n, const float *restrict grad,
                                const float *restrict avg, const float *restrict avg_sq,
                                float *restrict new_avg, float *new_avg_sq) {
    const float divisor = group->grad_divisor, weight = group->lerp_weight;
    const float beta2 = group->beta2, coefficient = group->avg_sq_grad_coefficient;
    /* lerp from the nearer end: exp_avg + w (g - exp_avg), or g - (1 - w)(g - exp_avg) */
    const float near_weight = weight < 0.5f ? weight : weight - 1.0f;
    const int from_avg = weight < 0.5f;
    /* dividing by a power of two is multiplying by its exact reciprocal (a loss scale
     * without clipping): the same bits, without the division's cost */
    int exponent;
    const int power_of_two = frexpf(divisor, &exponent) == 0.5f;
    const float reciprocal = 1.0f / divisor;
    float *restrict unscaled = new_avg_sq;  /* the gradient first, in place */
    int i;
    if (power_of_two)
        for (i = 0; i < n; i++)
            unscaled[i] = grad[i] * reciprocal;
    else
        for (i = 0; i < n; i++)
            unscaled[i] = grad[i] / divisor;
    for (i = 0; i < n; i++) {
        float g = unscaled[i];
        new_avg[i] = fmaf(near_weight, g - avg[i], from_avg ? avg[i] : g);
        new_avg_sq[i] = fmaf(coefficient * g, g, avg_sq[i] * beta2);
    }
}

/* The largest |exp_avg| and exp_avg_sq after this step, of elements [start, stop), as
 * bit patterns (largest[0], largest[1]). */
static void maxima_blocks(const AdamTensor *t, const AdamGroup *group, int64_t start,
                          int64_t stop, uint32_t *largest) {
    float grads[BLOCK], avgs[BLOCK], avg_sqs[BLOCK], new_avgs[BLOCK], new_avg_sqs[BLOCK];
    int64_t offset;
    for (offset = start; offset < stop; offset += BLOCK) {
        int n = (int)(stop - offset < BLOCK ? stop - offset : BLOCK);
        const float *g = read_floats(t->grad, t->grad_dtype, offset, n, 1.0f, grads);
        const float *m = read_floats(t->exp_avg, t->moment_dtype, offset, n, t->scale_in[0],
                                     avgs);
        const float *v = read_floats(t->exp_avg_sq, t->moment_dtype, offset, n,
                                     t->scale_in[1], avg_sqs);
        next_moments(group, n, g, m, v, new_avgs, new_avg_sqs);
        largest[0] = largest_bits(new_avgs, n, largest[0]);
        largest[1] = largest_bits(new_avg_sqs, n, largest[1]);
    }
}

/* The parameter after this step, from the new moments, for n elements in place. */
static inline void next_params(int n, float *restrict param, const float *restrict avg,
                               const float *restrict avg_sq, float keep, float step_down,
                               float correction, float eps) {
    int i;
    for (i = 0; i < n; i++) {
        float value = keep != 1.0f ? param[i] * keep : param[i];
        param[i] = value + step_down * avg[i] / (sqrtf(avg_sq[i]) / correction + eps);
    }
}

static void update_blocks(const AdamTensor *t, const AdamGroup *group, int64_t start,
                          int64_t stop) {
    float params[BLOCK], grads[BLOCK], avgs[BLOCK], avg_sqs[BLOCK];
    float new_avgs[BLOCK], new_avg_sqs[BLOCK];
    int64_t offset;
    for (offset = start; offset < stop; offset += BLOCK) {
        int n = (int)(stop - offset < BLOCK ? stop - offset : BLOCK);
        /* fp32 tensors are read and written where they are, 16-bit ones in the buffers */
        float *p = read_floats(t->param, t->param_dtype, offset, n, 1.0f, params);
        const float *g = read_floats(t->grad, t->grad_dtype, offset, n, 1.0f, grads);
        float *m = read_floats(t->exp_avg, t->moment_dtype, offset, n, t->scale_in[0], avgs);
        float *v = read_floats(t->exp_avg_sq, t->moment_dtype, offset, n, t->scale_in[1],
                               avg_sqs);
        next_moments(group, n, g, m, v, new_avgs, new_avg_sqs);
        next_params(n, p, new_avgs, new_avg_sqs, group->keep, -t->step_size,
                    t->bias_correction2_sqrt, t->eps);
        write_floats(t->param, t->param_dtype, offset, n, p);
        if (t->moment_dtype == F32) {
            memcpy(m, new_avgs, (size_t)n * sizeof(float));
            memcpy(v, new_avg_sqs, (size_t)n * sizeof(float));
        } else {
            write_scaled(t->exp_avg, offset, n, t->scale_out[0], new_avgs);
            write_scaled(t->exp_avg_sq, offset, n, t->scale_out[1], new_avg_sqs);
        }
    }
}

#ifdef VECTOR_CONVERSIONS
/* The step LANES elements at a time, each value kept in registers from load to store (the
 * block loops above pass every value through L1 buffers several times). The kernels below
 * are written once over a few primitives, which AVX-512 gives 16 lanes wide and AVX2 8:
 * the same operations in the same order, so a lane rounds as a scalar would. */
#ifdef WIDE_VECTORS
typedef __m512 vfloat;
typedef __m512i vbits;
enum { LANES = 16 };
#define VEC(op) _mm512_##op            /* _mm512_add_ps, ... */
#define VEC_SI(op) _mm512_##op##512    /* _mm512_and_si512, ... */
#else
typedef __m256 vfloat;
typedef __m256i vbits;
enum { LANES = 8 };
#define VEC(op) _mm256_##op
#define VEC_SI(op) _mm256_##op##256
#endif

static inline vfloat v_set(float value) { return VEC(set1_ps)(value); }
static inline vfloat v_add(vfloat a, vfloat b) { return VEC(add_ps)(a, b); }
static inline vfloat v_sub(vfloat a, vfloat b) { return VEC(sub_ps)(a, b); }
static inline vfloat v_mul(vfloat a, vfloat b) { return VEC(mul_ps)(a, b); }
static inline vfloat v_div(vfloat a, vfloat b) { return VEC(div_ps)(a, b); }
static inline vfloat v_sqrt(vfloat a) { return VEC(sqrt_ps)(a); }
static inline vfloat v_fmadd(vfloat a, vfloat b, vfloat c) { return VEC(fmadd_ps)(a, b, c); }
static inline vfloat v_min(vfloat a, vfloat b) { return VEC(min_ps)(a, b); }
static inline vfloat v_max(vfloat a, vfloat b) { return VEC(max_ps)(a, b); }
static inline vbits v_no_bits(void) { return VEC_SI(setzero_si)(); }

/* the larger of `top` and |values| in each lane, compared as bit patterns */
static inline vbits v_top_magnitude(vbits top, vfloat values) {
    vbits magnitude = VEC_SI(and_si)(VEC_SI(castps_si)(values), VEC(set1_epi32)(0x7fffffff));
    return VEC(max_epu32)(top, magnitude);
}

#ifdef WIDE_VECTORS
static inline uint32_t v_top_lane(vbits top) { return _mm512_reduce_max_epu32(top); }

static inline vfloat v_load(const void *base, int dtype, int64_t at) {
    if (dtype == F32)
        return _mm512_loadu_ps((const float *)base + at);
    __m256i halves = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + at));
    if (dtype == F16)
        return _mm512_cvtph_ps(halves);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(halves), 16));
}

static inline void v_store(void *base, int dtype, int64_t at, vfloat values) {
    if (dtype == F32) {
        _mm512_storeu_ps((float *)base + at, values);
    } else if (dtype == F16) {
        __m256i halves = _mm512_cvtps_ph(values, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        _mm256_storeu_si256((__m256i *)((uint16_t *)base + at), halves);
    } else {  /* float_to_bf16 in every lane */
        __m512i bits = _mm512_castps_si512(values);
        __m512i high = _mm512_srli_epi32(bits, 16);
        __m512i magnitude = _mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff));
        __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(
            bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                   _mm512_and_si512(high, _mm512_set1_epi32(1)))), 16);
        __mmask16 nan = _mm512_cmpgt_epu32_mask(magnitude, _mm512_set1_epi32(0x7f800000));
        __m512i result = _mm512_mask_or_epi32(rounded, nan, high, _mm512_set1_epi32(0x40));
        _mm256_storeu_si256((__m256i *)((uint16_t *)base + at), _mm512_cvtepi32_epi16(result));
    }
}
#else
static inline uint32_t v_top_lane(vbits top) {
    uint32_t lanes[8], largest = 0;
    int lane;
    _mm256_storeu_si256((__m256i *)lanes, top);
    for (lane = 0; lane < 8; lane++)
        largest = lanes[lane] > largest ? lanes[lane] : largest;
    return largest;
}

static inline vfloat v_load(const void *base, int dtype, int64_t at) {
    if (dtype == F32)
        return _mm256_loadu_ps((const float *)base + at);
    __m128i halves = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + at));
    if (dtype == F16)
        return _mm256_cvtph_ps(halves);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(halves), 16));
}

static inline void v_store(void *base, int dtype, int64_t at, vfloat values) {
    if (dtype == F32) {
        _mm256_storeu_ps((float *)base + at, values);
    } else if (dtype == F16) {
        _mm_storeu_si128((__m128i *)((uint16_t *)base + at),
                         _mm256_cvtps_ph(values, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    } else {
        float spilled[8];
        _mm256_storeu_ps(spilled, values);
        floats_to_bf16s(spilled, (uint16_t *)base + at, 8);
    }
}
#endif

/* Elements prefetched ahead of the vector loops. One thread streams only a few of its
 * tensors' lines from memory at a time; asking for them this far ahead made the 16-bit
 * step about a fifth faster on one thread (benchmarks/host_adam_passes.py). */
enum { AHEAD = 1024 };

/* Requests the cache line of element `at + AHEAD` of a tensor, when it is before `stop`. */
static inline void prefetch(const void *base, int dtype, int64_t at, int64_t stop) {
    if (at + AHEAD < stop)
        _mm_prefetch((const char *)base + (at + AHEAD) * (dtype == F32 ? 4 : 2), _MM_HINT_T0);
}

typedef struct {
    vfloat multiplier, divisor, near_weight, coefficient, beta2;
    int power_of_two, from_avg;
} VectorMoments;

static VectorMoments vector_moments(const AdamGroup *group) {
    int exponent;
    float weight = group->lerp_weight;
    VectorMoments c;
    c.power_of_two = frexpf(group->grad_divisor, &exponent) == 0.5f;
    c.multiplier = v_set(1.0f / group->grad_divisor);
    c.divisor = v_set(group->grad_divisor);
    c.near_weight = v_set(weight < 0.5f ? weight : weight - 1.0f);
    c.from_avg = weight < 0.5f;
    c.coefficient = v_set(group->avg_sq_grad_coefficient);
    c.beta2 = v_set(group->beta2);
    return c;
}

/* next_moments for the LANES elements at `at`, with the same roundings. */
static inline void vector_next_moments(const AdamTensor *t, const VectorMoments *c, int64_t at,
                                       vfloat *new_avg, vfloat *new_avg_sq) {
    vfloat g = v_load(t->grad, t->grad_dtype, at);
    vfloat m = v_load(t->exp_avg, t->moment_dtype, at);
    vfloat v = v_load(t->exp_avg_sq, t->moment_dtype, at);
    if (t->moment_dtype != F32) {
        m = v_mul(m, v_set(t->scale_in[0]));
        v = v_mul(v, v_set(t->scale_in[1]));
    }
    g = c->power_of_two ? v_mul(g, c->multiplier) : v_div(g, c->divisor);
    *new_avg = v_fmadd(c->near_weight, v_sub(g, m), c->from_avg ? m : g);
    *new_avg_sq = v_fmadd(v_mul(c->coefficient, g), g, v_mul(v, c->beta2));
}

/* maxima_range over the elements [start, stop) of a multiple of LANES. */
static void maxima_vectors(const AdamTensor *t, const AdamGroup *group, int64_t start,
                           int64_t stop, uint32_t *largest) {
    const VectorMoments c = vector_moments(group);
    vbits top_avg = v_no_bits(), top_avg_sq = v_no_bits();
    uint32_t top;
    int64_t at;
    for (at = start; at < stop; at += LANES) {
        vfloat new_avg, new_avg_sq;
        prefetch(t->grad, t->grad_dtype, at, stop);
        prefetch(t->exp_avg, t->moment_dtype, at, stop);
        prefetch(t->exp_avg_sq, t->moment_dtype, at, stop);
        vector_next_moments(t, &c, at, &new_avg, &new_avg_sq);
        top_avg = v_top_magnitude(top_avg, new_avg);
        top_avg_sq = v_top_magnitude(top_avg_sq, new_avg_sq);
    }
    top = v_top_lane(top_avg);
    largest[0] = top > largest[0] ? top : largest[0];
    top = v_top_lane(top_avg_sq);
    largest[1] = top > largest[1] ? top : largest[1];
}

/* update_range over the elements [start, stop) of a multiple of LANES. */
static void update_vectors(const AdamTensor *t, const AdamGroup *group, int64_t start,
                           int64_t stop) {
    const VectorMoments c = vector_moments(group);
    const vfloat keep = v_set(group->keep), step_down = v_set(-t->step_size);
    const vfloat correction = v_set(t->bias_correction2_sqrt), eps = v_set(t->eps);
    const vfloat largest = v_set(FP16_LARGEST), lowest = v_set(-FP16_LARGEST);
    const vfloat unscale_avg = v_set(1.0f / t->scale_out[0]);
    const vfloat unscale_avg_sq = v_set(1.0f / t->scale_out[1]);
    const int decays = group->keep != 1.0f;
    int64_t at;
    for (at = start; at < stop; at += LANES) {
        vfloat new_avg, new_avg_sq, denom, p;
        prefetch(t->param, t->param_dtype, at, stop);
        prefetch(t->grad, t->grad_dtype, at, stop);
        prefetch(t->exp_avg, t->moment_dtype, at, stop);
        prefetch(t->exp_avg_sq, t->moment_dtype, at, stop);
        p = v_load(t->param, t->param_dtype, at);
        vector_next_moments(t, &c, at, &new_avg, &new_avg_sq);
        if (decays)
            p = v_mul(p, keep);
        denom = v_add(v_div(v_sqrt(new_avg_sq), correction), eps);
        p = v_add(p, v_div(v_mul(step_down, new_avg), denom));
        v_store(t->param, t->param_dtype, at, p);
        if (t->moment_dtype == F32) {
            v_store(t->exp_avg, F32, at, new_avg);
            v_store(t->exp_avg_sq, F32, at, new_avg_sq);
        } else {
            vfloat avg = v_mul(new_avg, unscale_avg), avg_sq = v_mul(new_avg_sq, unscale_avg_sq);
            v_store(t->exp_avg, F16, at, v_max(v_min(avg, largest), lowest));
            v_store(t->exp_avg_sq, F16, at, v_max(v_min(avg_sq, largest), lowest));
        }
    }
}
#endif

/* Elements [start, stop) by vectors where the CPU has them, the rest (or all) by blocks. */
static void maxima_range(const AdamTensor *t, const AdamGroup *group, int64_t start,
                         int64_t stop, uint32_t *largest) {
#ifdef VECTOR_CONVERSIONS
    int64_t vectors_end = start + (stop - start) / LANES * LANES;
    maxima_vectors(t, group, start, vectors_end, largest);
    start = vectors_end;
#endif
    maxima_blocks(t, group, start, stop, largest);
}

static void update_range(const AdamTensor *t, const AdamGroup *group, int64_t start,
                         int64_t stop) {
#ifdef VECTOR_CONVERSIONS
    int64_t vectors_end = start + (stop - start) / LANES * LANES;
    update_vectors(t, group, start, vectors_end);
    start = vectors_end;
#endif
    update_blocks(t, group, start, stop);
}

typedef struct {
    const AdamTensor *tensors;
    int count;
    const AdamGroup *group;
    int64_t start, stop;  /* elements of the concatenation of all tensors */
    uint32_t *largest;    /* [count][2] for the maxima pass (bit patterns), else NULL */
} Work;

static void *run_work(void *argument) {
    const Work *work = (const Work *)argument;
    int64_t first = 0;
    int index;
    for (index = 0; index < work->count; index++) {
        const AdamTensor *t = &work->tensors[index];
        int64_t begin = work->start > first ? work->start - first : 0;
        int64_t end = work->stop - first < t->numel ? work->stop - first : t->numel;
        if (begin < end) {
            if (work->largest)
                maxima_range(t, work->group, begin, end, &work->largest[2 * index]);
            else
                update_range(t, work->group, begin, end);
        }
        first += t->numel;
        if (first >= work->stop)
            break;
    }
    return NULL;
}

/* What run_split returns: 0, or why it failed (sharded_adam.py words each). */
#define STEP_OK 0
#define STEP_JOIN_FAILED 1
#define STEP_NO_MEMORY 2

/* Splits the elements of all tensors evenly over up to `threads` threads. */
static int run_split(const AdamTensor *tensors, int count, const AdamGroup *group,
                     float *largest, int threads) {
    pthread_t running[256];
    Work works[256];
    int64_t total = 0;
    int index, started = 0, failed = 0;
    for (index = 0; index < count; index++)
        total += tensors[index].numel;
    if (threads > 256)
        threads = 256;
    if ((int64_t)threads * MIN_PER_THREAD > total)
        threads = (int)(total / MIN_PER_THREAD) + 1;
    if (threads < 1)
        threads = 1;
    uint32_t *partial = largest ? calloc((size_t)threads * count * 2, sizeof *partial) : NULL;
    if (largest && !partial)
        return STEP_NO_MEMORY;
    for (index = 0; index < threads; index++) {
        works[index] = (Work){tensors, count, group, total * index / threads,
                              total * (index + 1) / threads,
                              partial ? partial + (size_t)index * count * 2 : NULL};
    }
    for (index = 1; index < threads; index++) {
        if (pthread_create(&running[started], NULL, run_work, &works[index]) == 0)
            started++;
        else
            run_work(&works[index]);  /* no thread to be had: this one does it */
    }
    run_work(&works[0]);
    for (index = 0; index < started; index++)
        failed |= pthread_join(running[index], NULL) != 0;
    if (partial) {
        int thread, k;
        for (k = 0; k < 2 * count; k++) {
            uint32_t top = 0;
            for (thread = 0; thread < threads; thread++) {
                uint32_t bits = partial[(size_t)thread * count * 2 + k];
                top = bits > top ? bits : top;
            }
            memcpy(&largest[k], &top, sizeof top);
        }
        free(partial);
    }
    return failed ? STEP_JOIN_FAILED : STEP_OK;
}

/* largest: [count][2], written; returns STEP_OK on success. */
int adam_moment_maxima(const AdamTensor *tensors, int count, const AdamGroup *group,
                       float *largest, int threads) {
    return run_split(tensors, count, group, largest, threads);
}

int adam_update(const AdamTensor *tensors, int count, const AdamGroup *group, int threads) {
    return run_split(tensors, count, group, NULL, threads);
}
