/* Adam's host step over tensors stored in fp32, fp16 or bf16, in place and in fp32 math.
 *
 * Built on first use by native_adam.py (plain C, no torch headers: about a second).
 * ShardedAdam calls it through ctypes for CPU shards that are 16-bit anywhere
 * (parameters, gradients or moments), where torch would need fp32 copies and several
 * passes. Two passes per step:
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
    float scale_out[2];   /* moment / scale_out = stored (update, fp16 moments) */
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
#if defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#define VECTOR_CONVERSIONS 1
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
static void maxima_range(const AdamTensor *t, const AdamGroup *group, int64_t start,
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

static void update_range(const AdamTensor *t, const AdamGroup *group, int64_t start,
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
        return 1;
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
    return failed;
}

/* largest: [count][2], written; returns 0 on success. */
int adam_moment_maxima(const AdamTensor *tensors, int count, const AdamGroup *group,
                       float *largest, int threads) {
    return run_split(tensors, count, group, largest, threads);
}

int adam_update(const AdamTensor *tensors, int count, const AdamGroup *group, int threads) {
    return run_split(tensors, count, group, NULL, threads);
}
