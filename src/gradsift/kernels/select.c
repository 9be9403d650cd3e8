/* gradsift's selection kernels: two passes over a float32 vector, at memory speed.
 *
 * The key of an entry is the top 16 bits of its magnitude's bit pattern (sign dropped):
 * for finite non-negative floats the bit pattern orders like the value, so a histogram of
 * keys ranks magnitudes in buckets 2^-7 (0.78%) wide. Both functions split [0, n) into
 * `nthreads` equal chunks, chunk t = [n*t/nt, n*(t+1)/nt), and run one POSIX thread per
 * chunk; the same chunks in both passes let pass 2 write at offsets computed from pass 1's
 * per-thread histograms, so outputs are in index order whatever the thread count.
 *
 *   gs_hist16     pass 1: per-thread histograms of keys; with g != NULL it first adds g into
 *                 x in place (error feedback's accumulate, fused into the same pass).
 *   gs_compact16  pass 2: entries with key > b (index and value) and entries with key == b
 *                 (index only); with zero_above, zeroes the first kind in x (error feedback's
 *                 "residual = accumulated - sent" for the entries surely sent).
 *
 * The eager path in eager.py computes the same histograms and the same outputs with torch
 * operations; the Python layer does the rest (choosing the bucket, the exact second level).
 */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define NB 65536
#define SHIFT 15
#define FLUSH (1 << 30)

typedef struct {
    float *x;
    const float *g;
    int64_t lo, hi;
    int64_t *hist; /* NB counts of this chunk */
    int ok;
} hist_job;

static void count_block(const uint32_t *u, int64_t lo, int64_t hi, uint32_t *local) {
    int64_t i = lo;
    for (; i + 4 <= hi; i += 4) {
        uint32_t a = (u[i] & 0x7fffffffu) >> SHIFT, b = (u[i + 1] & 0x7fffffffu) >> SHIFT;
        uint32_t c = (u[i + 2] & 0x7fffffffu) >> SHIFT, d = (u[i + 3] & 0x7fffffffu) >> SHIFT;
        local[a]++; local[b]++; local[c]++; local[d]++;
    }
    for (; i < hi; i++) local[(u[i] & 0x7fffffffu) >> SHIFT]++;
}

#define BLOCK 4096

static void *hist_run(void *arg) {
    hist_job *j = (hist_job *)arg;
    uint32_t *local = (uint32_t *)calloc(NB, sizeof(uint32_t));
    if (!local) {
        j->ok = 0;
        return 0;
    }
    j->ok = 1;
    uint32_t *u = (uint32_t *)j->x;
    int64_t since = 0;
    for (int64_t lo = j->lo; lo < j->hi; lo += BLOCK) {
        int64_t hi = lo + BLOCK < j->hi ? lo + BLOCK : j->hi;
        if (j->g) { /* accumulate a cache-sized block (vectorized), then count it */
            float *x = j->x;
            const float *g = j->g;
            for (int64_t i = lo; i < hi; i++) x[i] += g[i];
        }
        count_block(u, lo, hi, local);
        since += hi - lo;
        if (since >= FLUSH) {
            for (int b = 0; b < NB; b++) { j->hist[b] += local[b]; local[b] = 0; }
            since = 0;
        }
    }
    for (int b = 0; b < NB; b++) j->hist[b] += local[b];
    free(local);
    return 0;
}

/* hist_out: nthreads * NB int64, zeroed by the caller. Returns the thread count, or -1 if memory ran out. */
int gs_hist16(float *x, const float *g, int64_t n, int nthreads, int64_t *hist_out) {
    if (nthreads < 1) nthreads = 1;
    if (nthreads > 64) nthreads = 64;
    pthread_t th[64];
    hist_job jobs[64];
    for (int t = 0; t < nthreads; t++) {
        jobs[t].x = x;
        jobs[t].g = g;
        jobs[t].lo = n * t / nthreads;
        jobs[t].hi = n * (t + 1) / nthreads;
        jobs[t].hist = hist_out + (int64_t)t * NB;
    }
    int started = 1;
    for (int t = 1; t < nthreads; t++) {
        if (pthread_create(&th[t], 0, hist_run, &jobs[t]) != 0) break;
        started++;
    }
    hist_run(&jobs[0]);
    for (int t = started; t < nthreads; t++) hist_run(&jobs[t]); /* threads we could not start: run here */
    for (int t = 1; t < started; t++) pthread_join(th[t], 0);
    for (int t = 0; t < nthreads; t++)
        if (!jobs[t].ok) return -1;
    return started;
}

typedef struct {
    float *x;
    int64_t lo, hi;
    uint32_t b;
    int64_t above_off, cand_off;
    int64_t *above_idx;
    float *above_val;
    int64_t *cand_idx;
    int zero_above;
} compact_job;

static inline void compact_one(compact_job *j, int64_t i, uint32_t key, int64_t *oa, int64_t *oc) {
    if (key > j->b) {
        j->above_idx[*oa] = i;
        j->above_val[*oa] = j->x[i];
        if (j->zero_above) j->x[i] = 0.0f;
        (*oa)++;
    } else {
        j->cand_idx[(*oc)++] = i;
    }
}

#if defined(__AVX2__)
#include <immintrin.h>
static inline uint64_t mask64(const uint32_t *u, uint32_t lowest) {
    const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff);
    const __m256i below = _mm256_set1_epi32((int)lowest - 1); /* magnitudes are non-negative int32: v > lowest-1 */
    uint64_t m = 0;
    for (int q = 0; q < 8; q++) {
        __m256i v = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(u + 8 * q)), abs_mask);
        __m256i gt = _mm256_cmpgt_epi32(v, below);
        m |= (uint64_t)(uint32_t)_mm256_movemask_ps(_mm256_castsi256_ps(gt)) << (8 * q);
    }
    return m;
}
#else
static inline uint64_t mask64(const uint32_t *u, uint32_t lowest) {
    uint64_t m = 0;
    for (int q = 0; q < 64; q++) m |= (uint64_t)((u[q] & 0x7fffffffu) >= lowest) << q;
    return m;
}
#endif

static void *compact_run(void *arg) {
    compact_job *j = (compact_job *)arg;
    const uint32_t *u = (const uint32_t *)j->x;
    int64_t oa = j->above_off, oc = j->cand_off;
    const uint32_t lowest = j->b << SHIFT; /* key >= b  <=>  magnitude bits >= b << SHIFT */
    int64_t i = j->lo;
    for (; i + 64 <= j->hi; i += 64) { /* a 64-entry mask first (vectorized compare), then the rare hits */
        uint64_t m = mask64(u + i, lowest);
        while (m) {
            int q = __builtin_ctzll(m);
            m &= m - 1;
            compact_one(j, i + q, (u[i + q] & 0x7fffffffu) >> SHIFT, &oa, &oc);
        }
    }
    for (; i < j->hi; i++) {
        uint32_t key = (u[i] & 0x7fffffffu) >> SHIFT;
        if (key >= j->b) compact_one(j, i, key, &oa, &oc);
    }
    return 0;
}

/* above_off / cand_off: nthreads offsets each (exclusive prefix sums of the per-chunk counts) */
int gs_compact16(float *x, int64_t n, int nthreads, int32_t b, const int64_t *above_off, const int64_t *cand_off,
                 int64_t *above_idx, float *above_val, int64_t *cand_idx, int zero_above) {
    if (nthreads < 1) nthreads = 1;
    if (nthreads > 64) nthreads = 64;
    pthread_t th[64];
    compact_job jobs[64];
    for (int t = 0; t < nthreads; t++) {
        jobs[t].x = x;
        jobs[t].lo = n * t / nthreads;
        jobs[t].hi = n * (t + 1) / nthreads;
        jobs[t].b = (uint32_t)b;
        jobs[t].above_off = above_off[t];
        jobs[t].cand_off = cand_off[t];
        jobs[t].above_idx = above_idx;
        jobs[t].above_val = above_val;
        jobs[t].cand_idx = cand_idx;
        jobs[t].zero_above = zero_above;
    }
    int started = 1;
    for (int t = 1; t < nthreads; t++) {
        if (pthread_create(&th[t], 0, compact_run, &jobs[t]) != 0) break;
        started++;
    }
    compact_run(&jobs[0]);
    for (int t = started; t < nthreads; t++) compact_run(&jobs[t]);
    for (int t = 1; t < started; t++) pthread_join(th[t], 0);
    return started;
}

int gs_abi_version(void) { return 1; }
