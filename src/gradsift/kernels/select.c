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
#include <math.h>
#include "spec.h" /* the spec rows' fields, by name (read by kernels/many.py too) */

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
    if (j->hi - j->lo <= NB) { /* a small chunk: count straight into the (zeroed) output, no 32-bit copy to merge */
        j->ok = 1;
        if (j->g)
            for (int64_t i = j->lo; i < j->hi; i++) j->x[i] += j->g[i];
        const uint32_t *u = (const uint32_t *)j->x;
        for (int64_t i = j->lo; i < j->hi; i++) j->hist[(u[i] & 0x7fffffffu) >> SHIFT]++;
        return 0;
    }
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

/* ---------------------------------------------------------------- top-k of many tensors, one pass each
 *
 * gs_topk_many: for each of m tensors, in one pass, x += g (when g is given) and every entry whose magnitude
 * bits are >= t is recorded (index, value: the candidates, at most cap of them). If at least k and at most
 * cap entries were recorded, the exact k largest magnitudes are chosen among them (a three-way quickselect
 * on the magnitude bits finds the k-th, T; every candidate above T, then ties at T in index order, until k),
 * written in index order, and zeroed in x when zero != 0. t comes from the previous call's k-th magnitude (the
 * caller's guess): it only decides whether this pass suffices, never which entries are chosen. Status per
 * tensor: 0 chosen, 1 fewer than k candidates, 2 more than cap (then x has been accumulated and nothing
 * chosen: the caller finishes with the histogram path).
 *
 * With k == 0 the candidates are only recorded (status 2 when more than cap), never zeroed: a scan.
 *
 * With draws (an int64 array of m_draws positions, duplicates allowed), the candidates are the positions drawn,
 * each once, in index order, zeroed in x when zero != 0 (random-k's selection inside the accumulating pass); with
 * SP_DRAW_SEEDED instead, the SP_DRAWN_N positions of draw_k_marks (the seed SP_DRAW_SEED) are.
 *
 * With SP_KEEP_K (0 < keep < k), a uniformly random keep of the k chosen stay (draw_k_marks over their index order,
 * the seed SP_DRAW_SEED; rTop-k), the others put back into x, the kept written first in the output, in order.
 *
 * With prev (sorted int64 positions, their float factors fac, n_prev of them) or a base factor other than 1, the k
 * chosen are those of the largest scores |x| * factor (fac at prev's positions, base elsewhere; REGTOP-k): exact
 * when the k-th score reaches the floor (no entry below it can score higher), else status 1.
 *
 * With u, the pass is momentum correction's (DGC): u = m u + g, v = v + u (Nesterov: u = (u + g) m, v = v + u + g),
 * x being v, rounded as torch rounds each operation; the candidates are v's. With SP_SRC and SP_MOM_USRC, v and u
 * are read there and written whole into x and u (the kept tensors of a checkpoint left as they were).
 *
 * With a sample count, x[start + i * stride] for i < count is copied out as the pass updates it (DGC's sampled
 * threshold: no second, scattered read of x); with a DGC target as well, DGC's selection follows right after the
 * pass (dgc_in_scan, below).
 *
 * spec: m rows of SPEC int64, the fields named in spec.h (SIDCo's fields, when set, give its floor and levels from
 * its state instead of SP_FLOOR and the levels; DGC's run dgc_in_scan after the pass); res: m
 * rows of 4 int64 -- status, candidate count, the k-th magnitude's bits, and for scans (k == 0, nothing drawn) the
 * largest magnitude's bits of the whole accumulated tensor (>= 0x7f800000: it holds NaN or Inf; read in the pass, so
 * no caller reads x for finiteness), else 0.
 * Tensors are spread over nthreads threads, each whole. */
typedef struct {
    const int64_t *spec;
    int64_t *res;
    int64_t m;
    int64_t *cand_idx, *out_idx;
    float *cand_val, *out_val, *cand_score, *sample;
    uint16_t *out_bf16;
    int zero;
    int64_t next; /* the next tensor to take (shared, atomic) */
    int64_t scratch_n;
    int failed;
} many_job;

static uint32_t kth_largest(uint32_t *a, int64_t n, int64_t k) {
    /* the k-th largest (1-based) of a[0..n), 0 < k <= n; a is reordered */
    int64_t lo = 0, hi = n; /* the answer lies in a[lo..hi), at rank k counted from lo */
    while (hi - lo > 1) {
        uint32_t x = a[lo], y = a[lo + (hi - lo) / 2], z = a[hi - 1];
        uint32_t p = x < y ? (y < z ? y : (x < z ? z : x)) : (x < z ? x : (y < z ? z : y)); /* median of 3 */
        int64_t gt = lo, i = lo, lt = hi; /* [lo,gt) > p, [gt,i) == p, [lt,hi) < p */
        while (i < lt) {
            uint32_t v = a[i];
            if (v > p) { a[i] = a[gt]; a[gt++] = v; i++; }
            else if (v < p) { a[i] = a[--lt]; a[lt] = v; }
            else i++;
        }
        int64_t ngt = gt - lo, neq = lt - gt;
        if (k <= ngt) hi = gt;
        else if (k <= ngt + neq) return p;
        else { k -= ngt + neq; lo = lt; }
    }
    return a[lo];
}

/* x[q..q+64) += g[q..q+64) (when g), then the 64-entry mask of magnitude bits >= t */
/* ... and the running maximum of the magnitude bits (*mx): NaN and Inf show there as bits >= 0x7f800000 */
#if defined(__AVX2__)
typedef __m256i maxacc;
static inline maxacc maxacc_zero(void) { return _mm256_setzero_si256(); }
static inline uint32_t maxacc_get(maxacc a) {
    uint32_t v[8], m = 0;
    _mm256_storeu_si256((__m256i *)v, a);
    for (int q = 0; q < 8; q++) m = v[q] > m ? v[q] : m;
    return m;
}
static inline __attribute__((always_inline)) uint64_t add_mask64_(float *x, const float *src, const float *g,
                                                                    uint32_t t, maxacc *mx, const int with_top) {
    const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff);
    const __m256i below = _mm256_set1_epi32((int)t - 1);
    uint64_t m = 0;
    __m256i top = *mx;
    for (int q = 0; q < 8; q++) {
        __m256 v = _mm256_loadu_ps(src + 8 * q);
        if (g) v = _mm256_add_ps(v, _mm256_loadu_ps(g + 8 * q));
        if (g || src != x) _mm256_storeu_ps(x + 8 * q, v);
        __m256i mag = _mm256_and_si256(_mm256_castps_si256(v), abs_mask);
        if (with_top) top = _mm256_max_epu32(top, mag);
        __m256i gt = _mm256_cmpgt_epi32(mag, below);
        m |= (uint64_t)(uint32_t)_mm256_movemask_ps(_mm256_castsi256_ps(gt)) << (8 * q);
    }
    *mx = top;
    return m;
}
#else
typedef uint32_t maxacc;
static inline maxacc maxacc_zero(void) { return 0; }
static inline uint32_t maxacc_get(maxacc a) { return a; }
static inline __attribute__((always_inline)) uint64_t add_mask64_(float *x, const float *src, const float *g,
                                                                    uint32_t t, maxacc *mx, const int with_top) {
    if (g)
        for (int q = 0; q < 64; q++) x[q] = src[q] + g[q];
    else if (src != x)
        for (int q = 0; q < 64; q++) x[q] = src[q];
    const uint32_t *u = (const uint32_t *)x;
    if (with_top) {
        uint32_t top = *mx;
        for (int q = 0; q < 64; q++) top = (u[q] & 0x7fffffffu) > top ? (u[q] & 0x7fffffffu) : top;
        *mx = top;
    }
    return mask64(u, t);
}
#endif
/* the largest magnitude is tracked only for scans (k == 0, nothing drawn): top-k's pass stays as tight as before */
static uint64_t add_mask64_top(float *x, const float *src, const float *g, uint32_t t, maxacc *mx) {
    return add_mask64_(x, src, g, t, mx, 1);
}
static inline uint64_t add_mask64(float *x, const float *src, const float *g, uint32_t t, maxacc *mx) {
    return add_mask64_(x, src, g, t, mx, 0);
}

/* The k-th largest magnitude bits among cnt candidates (all >= t): a histogram of their 16-bit keys (CAND_BINS
 * bins from t's key up, the last also holding everything above; or, given the largest magnitude bits top, the
 * CAND_BINS keys up to top's, the first also holding everything below) finds the bin of the k-th; a quickselect
 * finishes among that bin's candidates only. *above (when asked): how many candidates lie above the k-th, counted
 * from the histogram and that bin, not from another read of them all. */
#define CAND_BINS 2048
static inline uint32_t cand_bin(uint32_t bits, uint32_t base) { /* below base (a damped score): bin 0 */
    uint32_t key = (bits & 0x7fffffffu) >> SHIFT;
    return key < base ? 0 : (key - base < CAND_BINS ? key - base : CAND_BINS - 1);
}
#if defined(__AVX2__)
/* lane_perm[m]: the lanes set in the 8-bit mask m, in order, then zeros (a permutation that moves them to the
 * front of a register: a branchless compaction of 8 entries) */
static int32_t lane_perm[256][8] __attribute__((aligned(32)));
__attribute__((constructor)) static void lane_perm_init(void) {
    for (int m = 0; m < 256; m++) {
        int o = 0;
        for (int b = 0; b < 8; b++)
            if ((m >> b) & 1) lane_perm[m][o++] = b;
        for (; o < 8; o++) lane_perm[m][o] = 0;
    }
}
#endif
#define RES 4
static uint32_t kth_above(const uint32_t *cu, int64_t cnt, int64_t k, uint32_t t, uint32_t top, uint32_t *keys,
                          int64_t *above_out) {
    uint32_t hist[CAND_BINS];
    memset(hist, 0, sizeof hist);
    uint32_t base = t >> SHIFT;
    const uint32_t top_key = (top & 0x7fffffffu) >> SHIFT;
    if (top && top_key >= CAND_BINS - 1 && top_key - (CAND_BINS - 1) > base) base = top_key - (CAND_BINS - 1);
    int64_t e = 0;
#if defined(__AVX2__)
    { /* cand_bin of 8 at a time: (key - base) clamped to [0, CAND_BINS - 1] */
        const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff), vbase = _mm256_set1_epi32((int)base);
        const __m256i zero = _mm256_setzero_si256(), last = _mm256_set1_epi32(CAND_BINS - 1);
        uint32_t b8[8] __attribute__((aligned(32)));
        for (; e + 8 <= cnt; e += 8) {
            __m256i key = _mm256_srli_epi32(_mm256_and_si256(_mm256_loadu_si256((const __m256i *)(cu + e)), abs_mask),
                                            SHIFT);
            _mm256_store_si256((__m256i *)b8, _mm256_min_epi32(_mm256_max_epi32(_mm256_sub_epi32(key, vbase), zero),
                                                               last));
            for (int l = 0; l < 8; l++) hist[b8[l]]++;
        }
    }
#endif
    for (; e < cnt; e++) hist[cand_bin(cu[e], base)]++;
    int64_t above = 0;
    int bin = CAND_BINS - 1;
    for (; bin > 0 && above + hist[bin] < k; bin--) above += hist[bin];
    /* the bin's magnitudes: [lo, hi) (the first bin also holds all below, the last all above) */
    const uint32_t lo = bin == 0 ? 0u : (base + (uint32_t)bin) << SHIFT;
    const uint32_t width = (bin == CAND_BINS - 1 ? 0x80000000u : (base + (uint32_t)bin + 1) << SHIFT) - lo;
    int64_t m = 0;
    e = 0;
#if defined(__AVX2__)
    { /* 8 at a time, the bin's moved to the front and stored whole at m (m + 8 <= e + 8 <= cnt: keys' room) */
        const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff), flip = _mm256_set1_epi32((int)0x80000000u);
        const __m256i vlo = _mm256_set1_epi32((int)lo), vw = _mm256_set1_epi32((int)(width ^ 0x80000000u));
        for (; e + 8 <= cnt; e += 8) {
            __m256i mag = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(cu + e)), abs_mask);
            __m256i in = _mm256_cmpgt_epi32(vw, _mm256_xor_si256(_mm256_sub_epi32(mag, vlo), flip)); /* unsigned < */
            const int m8 = _mm256_movemask_ps(_mm256_castsi256_ps(in));
            _mm256_storeu_si256((__m256i *)(keys + m),
                                _mm256_permutevar8x32_epi32(mag, _mm256_load_si256((const __m256i *)lane_perm[m8])));
            m += __builtin_popcount((unsigned)m8);
        }
    }
#endif
    for (; e < cnt; e++) {
        const uint32_t mag = cu[e] & 0x7fffffffu;
        if (mag - lo < width) keys[m++] = mag;
    }
    const uint32_t kth = kth_largest(keys, m, k - above);
    if (above_out) {
        for (int64_t e = 0; e < m; e++) above += keys[e] > kth;
        *above_out = above;
    }
    return kth;
}
static uint32_t kth_of(const uint32_t *cu, int64_t cnt, int64_t k, uint32_t t, uint32_t *keys) {
    return kth_above(cu, cnt, k, t, 0, keys, 0);
}

/* Momentum correction's update of 64 entries (DGC; torch's order of roundings: no fused multiply-add), then the
 * mask of |v| bits >= t:  u = m u + g, v = v + u   (Nesterov: u = (u + g) m, v = (v + u) + g); u and v read from
 * us and vs (the same arrays, or the kept ones a checkpoint holds: then written whole into u and v) */
#if defined(__AVX2__)
static inline uint64_t momentum_mask64(float *v, float *u, const float *vs, const float *us, const float *g, float m,
                                       int nesterov, uint32_t t, maxacc *mx) {
    const __m256 vm = _mm256_set1_ps(m);
    const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff), below = _mm256_set1_epi32((int)t - 1);
    __m256i top = *mx;
    uint64_t msk = 0;
    for (int q = 0; q < 8; q++) { /* (each operation rounded on its own, as the scalar form below) */
        __m256 uq = _mm256_loadu_ps(us + 8 * q), gq = _mm256_loadu_ps(g + 8 * q), vq = _mm256_loadu_ps(vs + 8 * q);
        if (nesterov) {
            uq = _mm256_mul_ps(_mm256_add_ps(uq, gq), vm);
            vq = _mm256_add_ps(_mm256_add_ps(vq, uq), gq);
        } else {
            uq = _mm256_add_ps(_mm256_mul_ps(uq, vm), gq);
            vq = _mm256_add_ps(vq, uq);
        }
        _mm256_storeu_ps(u + 8 * q, uq);
        _mm256_storeu_ps(v + 8 * q, vq);
        __m256i mag = _mm256_and_si256(_mm256_castps_si256(vq), abs_mask);
        top = _mm256_max_epu32(top, mag);
        msk |= (uint64_t)(uint32_t)_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(mag, below))) << (8 * q);
    }
    *mx = top;
    return msk;
}
#else
static inline uint64_t momentum_mask64(float *v, float *u, const float *vs, const float *us, const float *g, float m,
                                       int nesterov, uint32_t t, maxacc *mx) {
    uint32_t top = *mx;
    for (int q = 0; q < 64; q++) {
        float uq = us[q];
        if (nesterov) {
            uq = (uq + g[q]) * m;
            v[q] = (vs[q] + uq) + g[q];
        } else {
            uq = uq * m + g[q];
            v[q] = vs[q] + uq;
        }
        u[q] = uq;
        union { float f; uint32_t b; } w = {v[q]};
        top = (w.b & 0x7fffffffu) > top ? (w.b & 0x7fffffffu) : top;
    }
    *mx = top;
    return mask64((const uint32_t *)v, t);
}
#endif

/* Moments at levels (SIDCo's fits, read in the scan): for every level j, over the entries with magnitude bits >=
 * lev[j], the count and the sums of q1 = rint(|x| s1) and (with squares) q2 = rint((|x| s1)^2 2^-20), float32
 * products rounded to the nearest integer, ties to even (torch's round). Integer sums do not depend on their order,
 * so the torch twin gets the same numbers. The caller picks s1 (a power of two) so that q1 <= 2^20: 32-bit lanes
 * then hold 1,024 additions and are flushed into 64-bit totals every 128 blocks of 64. */
#define LMAX 8
static uint32_t f32_bits(double t) { /* the float32 bits of the magnitude t (kernels.many._bits) */
    union { float f; uint32_t u; } w = {(float)(t < 3.4028234663852886e38 ? t : 3.4028234663852886e38)};
    return w.u & 0x7fffffffu;
}

typedef struct {
    int nl, squares, blocks;
    uint32_t lev[LMAX];
    float s1;
    int64_t tc[LMAX], t1[LMAX], t2[LMAX];
#if defined(__AVX2__)
    __m256i c[LMAX], a1[LMAX], a2[LMAX];
#endif
} moments;

static inline void moments_one(moments *M, float v) {
    union { float f; uint32_t u; } w = {v};
    const uint32_t mag = w.u & 0x7fffffffu;
    w.u = mag;
    const float b = w.f * M->s1;
    const int64_t q1 = (int64_t)nearbyintf(b), q2 = M->squares ? (int64_t)nearbyintf((b * b) * 0x1p-20f) : 0;
    for (int l = 0; l < M->nl; l++)
        if (mag >= M->lev[l]) { M->tc[l]++; M->t1[l] += q1; M->t2[l] += q2; }
}

#if defined(__AVX2__)
static inline int64_t lanes_sum(__m256i a) {
    int32_t v[8];
    _mm256_storeu_si256((__m256i *)v, a);
    int64_t s = 0;
    for (int q = 0; q < 8; q++) s += v[q];
    return s;
}
static void moments_flush(moments *M) {
    for (int l = 0; l < M->nl; l++) {
        M->tc[l] -= lanes_sum(M->c[l]); /* (the lanes count down: a compare is -1) */
        M->t1[l] += lanes_sum(M->a1[l]);
        M->t2[l] += lanes_sum(M->a2[l]);
        M->c[l] = M->a1[l] = M->a2[l] = _mm256_setzero_si256();
    }
    M->blocks = 0;
}
static inline void moments64(moments *M, const float *x) {
    const __m256i absm = _mm256_set1_epi32(0x7fffffff);
    const __m256 sc = _mm256_set1_ps(M->s1), s20 = _mm256_set1_ps(0x1p-20f);
    for (int h = 0; h < 2; h++) {
        __m256i mag[4], q1[4], q2[4];
        for (int q = 0; q < 4; q++) {
            mag[q] = _mm256_and_si256(_mm256_castps_si256(_mm256_loadu_ps(x + 32 * h + 8 * q)), absm);
            __m256 b = _mm256_mul_ps(_mm256_castsi256_ps(mag[q]), sc);
            q1[q] = _mm256_cvtps_epi32(b);
            q2[q] = M->squares ? _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_mul_ps(b, b), s20)) : _mm256_setzero_si256();
        }
        for (int l = 0; l < M->nl; l++) {
            const __m256i lv = _mm256_set1_epi32((int)M->lev[l] - 1);
            __m256i c = M->c[l], a1 = M->a1[l], a2 = M->a2[l];
            for (int q = 0; q < 4; q++) {
                __m256i ge = _mm256_cmpgt_epi32(mag[q], lv);
                c = _mm256_add_epi32(c, ge);
                a1 = _mm256_add_epi32(a1, _mm256_and_si256(ge, q1[q]));
                if (M->squares) a2 = _mm256_add_epi32(a2, _mm256_and_si256(ge, q2[q]));
            }
            M->c[l] = c, M->a1[l] = a1, M->a2[l] = a2;
        }
    }
    if (++M->blocks == 128) moments_flush(M);
}
#else
static void moments_flush(moments *M) { (void)M; }
static inline void moments64(moments *M, const float *x) {
    for (int q = 0; q < 64; q++) moments_one(M, x[q]);
}
#endif

static void moments_levels(moments *M, const double *lev, int nl, int e, int squares) {
    memset(M, 0, sizeof *M);
    M->nl = nl > LMAX ? LMAX : nl;
    for (int l = 0; l < M->nl; l++) M->lev[l] = f32_bits(lev[l] < 0 ? -lev[l] : lev[l]) + 1; /* entries above them */
    M->s1 = ldexpf(1.0f, e); /* the scale, 2^e */
    M->squares = squares;
}

static void moments_init(moments *M, const int64_t *s) { /* the levels' count, values, scale and squares in spec */
    moments_levels(M, (const double *)(intptr_t)s[SP_LEV_AT], (int)s[SP_LEV_N], (int)s[SP_LEV_EXP], (int)s[SP_LEV_SQUARES]);
}

static void moments_out(moments *M, const int64_t *s) {
    moments_flush(M);
    int64_t *out = (int64_t *)(intptr_t)s[SP_LEV_OUT];
    for (int l = 0; l < M->nl; l++) out[3 * l] = M->tc[l], out[3 * l + 1] = M->t1[l], out[3 * l + 2] = M->t2[l];
}

/* SIDCo's row, worked out from its per-tensor state before the pass (sd_prepare, with sd_in_scan below) */
typedef struct {
    double floor;   /* Guess.floor's */
    uint32_t t;     /* its float32 bits: the candidates' floor */
    int nl, e;      /* the levels (SIDCo._levels) and their scale's exponent (Levels.scale_for) */
    double lev[LMAX];
} sd_prep;
static void sd_prepare(const int64_t *s, int64_t n, sd_prep *P);
static int sd_in_scan(const int64_t *s, const sd_prep *P, moments *mo, float *x, int64_t n, int64_t *ci, float *cv,
                      int64_t cnt, int complete, uint32_t top);
static void dgc_in_scan(const int64_t *s, float *x, float *mu, int64_t n, int64_t *ci, float *cv, int64_t cnt,
                        const float *sv, int64_t sn, uint32_t *keys);

/* A finite float32 v on the wire in bf16, as Compressor.wire casts it: clamped to bf16's largest finite value,
 * then rounded to nearest, ties to even (torch's conversion); the bf16 bits. */
#define BF16_MAX 3.3895313892515355e38f /* bf16's largest finite value (0x7f7f) */
static inline uint16_t bf16_bits(float v) {
    const float big = BF16_MAX;
    v = v > big ? big : (v < -big ? -big : v);
    union { float f; uint32_t u; } w = {v};
    return (uint16_t)((w.u + 0x7fffu + ((w.u >> 16) & 1u)) >> 16);
}
static inline float bf16_value(uint16_t b) {
    union { uint32_t u; float f; } w = {(uint32_t)b << 16};
    return w.f;
}
/* What stays in memory of a candidate v once sent in bf16: v - bf16(v) (exact, as torch's subtraction) */
static inline float bf16_left(float v) { return v - bf16_value(bf16_bits(v)); }

/* ---------------------------------------------------------------- random-k's draw, counter-based
 *
 * k distinct positions of [0, n) (n < 2^31), a function of (seed, n, k) alone, as marks in a zeroed bitmap:
 * positions are drawn with replacement, pos_e = floor(h_e n / 2^64) with h_e the 64 bits of two hashes (e counts the
 * draws: hi = H(2e), lo = H(2e + 1), H(i) = mix(mix(i + s0) ^ s1), s0 and s1 the seed's halves), in rounds of
 * (k - d) + (k - d) / 8 + 16 draws while fewer than k distinct (d) are marked; when more, the k with the smallest
 * keys stay, key(p) = H'(p) * 2^31 + p (H' the same hash with the seed's halves xor KEY0 and KEY1): a uniformly
 * random k-subset, up to ties of the 32-bit H' (then the lower position stays). Where 4 k > n, every position is
 * keyed and the k smallest stay. The torch twin (gradsift.kernels.draw.draw_k) computes the same positions.
 * Returns 0, or -1 when memory for the keys ran out. */
static inline uint32_t mix32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= x >> 15;
    x *= 0x846ca68bu;
    x ^= x >> 16;
    return x;
}
#define KEY0 0x9e3779b9u
#define KEY1 0x85ebca6bu
static inline uint32_t draw_hash(uint32_t i, uint32_t s0, uint32_t s1) { return mix32(mix32(i + s0) ^ s1); }
static inline uint64_t draw_key(int64_t p, uint32_t s0, uint32_t s1) {
    return ((uint64_t)draw_hash((uint32_t)p, s0 ^ KEY0, s1 ^ KEY1) << 31) | (uint64_t)p;
}
static inline int is_marked(const uint64_t *marks, int64_t p) { return (int)((marks[p >> 6] >> (p & 63)) & 1); }

static uint64_t kth_smallest64(uint64_t *a, int64_t n, int64_t k) { /* 0 < k <= n, distinct; a is reordered */
    int64_t lo = 0, hi = n;
    while (hi - lo > 1) {
        uint64_t x = a[lo], y = a[lo + (hi - lo) / 2], z = a[hi - 1];
        uint64_t p = x < y ? (y < z ? y : (x < z ? z : x)) : (x < z ? x : (y < z ? z : y));
        int64_t i = lo, lt = lo, gt = hi; /* [lo,lt) < p, [lt,i) == p, [gt,hi) > p */
        while (i < gt) {
            uint64_t v = a[i];
            if (v < p) { a[i] = a[lt]; a[lt++] = v; i++; }
            else if (v > p) { a[i] = a[--gt]; a[gt] = v; }
            else i++;
        }
        if (k <= lt - lo) hi = lt;
        else if (k <= gt - lo) return p;
        else { k -= gt - lo; lo = gt; }
    }
    return a[lo];
}

static int draw_k_marks(uint64_t *marks, int64_t n, int64_t k, uint64_t seed) {
    const uint32_t s0 = (uint32_t)seed, s1 = (uint32_t)(seed >> 32);
    if (k <= 0) return 0;
    if (k >= n || 4 * k > n) { /* every position marked (then, unless all, keyed) */
        for (int64_t w = 0; w < n / 64; w++) marks[w] = ~(uint64_t)0;
        if (n % 64) marks[n / 64] = ((uint64_t)1 << (n % 64)) - 1;
        if (k >= n) return 0;
    }
    int64_t d = 0, room = 4 * k > n ? n : 2 * k + 64;
    uint64_t *keys = (uint64_t *)malloc((size_t)room * sizeof(uint64_t));
    if (!keys) return -1;
    if (4 * k > n) {
        for (int64_t p = 0; p < n; p++) keys[p] = draw_key(p, s0, s1);
        d = n;
    } else {
        uint64_t e = 0;
        while (d < k) {
            const int64_t b = (k - d) + (k - d) / 8 + 16;
            for (int64_t r = 0; r < b; r++, e++) {
                const uint64_t hi = draw_hash((uint32_t)(2 * e), s0, s1), lo = draw_hash((uint32_t)(2 * e + 1), s0, s1);
                const int64_t p = (int64_t)((hi * (uint64_t)n + ((lo * (uint64_t)n) >> 32)) >> 32);
                if (is_marked(marks, p)) continue;
                marks[p >> 6] |= (uint64_t)1 << (p & 63);
                if (d == room) {
                    uint64_t *more = (uint64_t *)realloc(keys, (size_t)(2 * room) * sizeof(uint64_t));
                    if (!more) { free(keys); return -1; }
                    keys = more, room *= 2;
                }
                keys[d++] = draw_key(p, s0, s1);
            }
        }
    }
    if (d > k) {
        const uint64_t kth = kth_smallest64(keys, d, k);
        for (int64_t e = 0; e < d; e++)
            if (keys[e] > kth) {
                const int64_t p = (int64_t)(keys[e] & 0x7fffffffu);
                marks[p >> 6] &= ~((uint64_t)1 << (p & 63));
            }
    }
    free(keys);
    return 0;
}

/* gs_draw_k: the k positions of draw_k_marks, in order, into out (room for min(k, n)); returns how many, or -1 when
 * memory ran out. */
int64_t gs_draw_k(int64_t n, int64_t k, uint64_t seed, int64_t *out) {
    uint64_t *marks = (uint64_t *)calloc((size_t)((n + 63) / 64 + 1), sizeof(uint64_t));
    if (!marks || draw_k_marks(marks, n, k, seed) < 0) { free(marks); return -1; }
    int64_t o = 0;
    for (int64_t w = 0; w < (n + 63) / 64; w++)
        for (uint64_t m = marks[w]; m; m &= m - 1) out[o++] = 64 * w + __builtin_ctzll(m);
    free(marks);
    return o;
}

/* The candidates of a 64-entry block at q (its mask m) written at ci/cv + cnt while cnt < cap; returns cnt + their
 * count. With room for the whole block, the first two are written whatever the count (a zero mask writes two
 * entries past the count, overwritten later): at the rates top-k's floors let through (one or two a block) a loop
 * whose length follows the count missed its branch at most blocks. */
static inline int64_t take_block(uint64_t m, int64_t q, const float *x, int64_t *ci, float *cv, int64_t cnt,
                                 int64_t cap) {
    const uint64_t top = 1ull << 63; /* (ctz of m | top: the lowest set bit of m, or 63 when m is 0) */
    if (cnt + 64 <= cap) {
        const int c = __builtin_popcountll(m);
        const int64_t b0 = q + __builtin_ctzll(m | top);
        m &= m - 1;
        const int64_t b1 = q + __builtin_ctzll(m | top);
        ci[cnt] = b0, cv[cnt] = x[b0];
        ci[cnt + 1] = b1, cv[cnt + 1] = x[b1];
        if (c > 2)
            for (int64_t j = cnt + 2; (m &= m - 1); j++) {
                const int64_t e = q + __builtin_ctzll(m);
                ci[j] = e, cv[j] = x[e];
            }
        return cnt + c;
    }
    for (; m; m &= m - 1, cnt++)
        if (cnt < cap) {
            const int64_t e = q + __builtin_ctzll(m);
            ci[cnt] = e, cv[cnt] = x[e];
        }
    return cnt;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
/* topk_one's choice 16 candidates at a time (AVX-512): those above the k-th (kth), then ties at it in index order
 * while *ties lasts, compressed into oi/ov (and their bf16 bits into ob, when given) at *o, masked stores writing
 * only what is chosen. Returns where it stopped (fewer than 16 left, or k chosen); the same choice as the loop. */
static int64_t choose16(const uint32_t *cu, const int64_t *ci, const float *cv, int64_t cnt, int64_t k, uint32_t kth,
                        int64_t *ties, int64_t *oi, float *ov, uint16_t *ob, int64_t *o_io) {
    const __m512i vk = _mm512_set1_epi32((int)kth), abs_mask = _mm512_set1_epi32(0x7fffffff);
    const __m512 big = _mm512_set1_ps(BF16_MAX), nbig = _mm512_set1_ps(-BF16_MAX);
    const __m512i half = _mm512_set1_epi32(0x7fff), one = _mm512_set1_epi32(1);
    int64_t e = 0, o = *o_io, t = *ties;
    for (; e + 16 <= cnt && o < k; e += 16) {
        const __m512i b = _mm512_and_si512(_mm512_loadu_si512((const void *)(cu + e)), abs_mask);
        __mmask16 take = _mm512_cmpgt_epu32_mask(b, vk);
        for (__mmask16 eq = _mm512_cmpeq_epu32_mask(b, vk); eq && t > 0; eq &= (__mmask16)(eq - 1), t--)
            take |= (__mmask16)(eq & -eq); /* (the lowest tie left: index order) */
        if (!take) continue;
        const int c = __builtin_popcount(take), lo = __builtin_popcount(take & 0xff);
        const __mmask16 room = (__mmask16)((1u << c) - 1);
        const __m512 v = _mm512_maskz_compress_ps(take, _mm512_loadu_ps(cv + e));
        _mm512_mask_storeu_ps(ov + o, room, v);
        const __m512i i0 = _mm512_loadu_si512((const void *)(ci + e));
        const __m512i i1 = _mm512_loadu_si512((const void *)(ci + e + 8));
        _mm512_mask_storeu_epi64(oi + o, (__mmask8)((1u << lo) - 1), _mm512_maskz_compress_epi64((__mmask8)take, i0));
        _mm512_mask_storeu_epi64(oi + o + lo, (__mmask8)((1u << (c - lo)) - 1),
                                 _mm512_maskz_compress_epi64((__mmask8)(take >> 8), i1));
        if (ob) { /* bf16_bits of each: clamped to bf16's largest finite value, rounded to nearest even */
            const __m512i u = _mm512_castps_si512(_mm512_min_ps(_mm512_max_ps(v, nbig), big));
            const __m512i r = _mm512_srli_epi32(
                _mm512_add_epi32(_mm512_add_epi32(u, half), _mm512_and_si512(_mm512_srli_epi32(u, 16), one)), 16);
            _mm256_mask_storeu_epi16(ob + o, room, _mm512_cvtepi32_epi16(r));
        }
        o += c;
    }
    *o_io = o, *ties = t;
    return e;
}
#elif defined(__AVX2__)
/* The 8-bit lane mask of the 64-bit lanes set in the 4-bit mask m: each bit doubled (lane_perm of it moves those
 * lanes' 32-bit halves to the front, in order) */
static inline unsigned pairs_of(unsigned m) {
    m = (m | (m << 2)) & 0x33u;
    m = (m | (m << 1)) & 0x55u;
    return m | (m << 1);
}
/* choose16's AVX2 twin, 8 candidates at a time: what is chosen moved to the front of a register (lane_perm) and
 * stored whole while 8 more places are left below k (the rest: the loop after it). */
static int64_t choose8(const uint32_t *cu, const int64_t *ci, const float *cv, int64_t cnt, int64_t k, uint32_t kth,
                       int64_t *ties, int64_t *oi, float *ov, uint16_t *ob, int64_t *o_io) {
    const __m256i vk = _mm256_set1_epi32((int)kth), abs_mask = _mm256_set1_epi32(0x7fffffff);
    const __m256 big = _mm256_set1_ps(BF16_MAX), nbig = _mm256_set1_ps(-BF16_MAX);
    const __m256i half = _mm256_set1_epi32(0x7fff), one = _mm256_set1_epi32(1);
    int64_t e = 0, o = *o_io, t = *ties;
    for (; e + 8 <= cnt && o + 8 <= k; e += 8) { /* (magnitude bits: signed compares order them) */
        const __m256i b = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(cu + e)), abs_mask);
        unsigned take = (unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(b, vk)));
        for (unsigned eq = (unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(b, vk))); eq && t > 0;
             eq &= eq - 1, t--)
            take |= eq & -eq; /* (the lowest tie left: index order) */
        if (!take) continue;
        const int lo = __builtin_popcount(take & 0xf);
        const __m256 v = _mm256_permutevar8x32_ps(_mm256_loadu_ps(cv + e),
                                                  _mm256_load_si256((const __m256i *)lane_perm[take]));
        _mm256_storeu_ps(ov + o, v);
        const __m256i p0 = _mm256_load_si256((const __m256i *)lane_perm[pairs_of(take & 0xf)]);
        const __m256i p1 = _mm256_load_si256((const __m256i *)lane_perm[pairs_of(take >> 4)]);
        _mm256_storeu_si256((__m256i *)(oi + o),
                            _mm256_permutevar8x32_epi32(_mm256_loadu_si256((const __m256i *)(ci + e)), p0));
        _mm256_storeu_si256((__m256i *)(oi + o + lo),
                            _mm256_permutevar8x32_epi32(_mm256_loadu_si256((const __m256i *)(ci + e + 4)), p1));
        if (ob) { /* bf16_bits of each, as choose16 */
            const __m256i u = _mm256_castps_si256(_mm256_min_ps(_mm256_max_ps(v, nbig), big));
            const __m256i r = _mm256_srli_epi32(
                _mm256_add_epi32(_mm256_add_epi32(u, half), _mm256_and_si256(_mm256_srli_epi32(u, 16), one)), 16);
            _mm_storeu_si128((__m128i *)(ob + o),
                             _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
        }
        o += __builtin_popcount(take);
    }
    *o_io = o, *ties = t;
    return e;
}
#endif

static void topk_one(many_job *j, int64_t r, uint32_t *keys) {
    const int64_t *s = j->spec + SPEC * r;
    float *x = (float *)(intptr_t)s[SP_X];
    const float *g = (const float *)(intptr_t)s[SP_ADD];
    /* out of place: x = src + g (or src) written whole, src left as it was (a rollback keeps it, uncopied) */
    const float *src = s[SP_SRC] ? (const float *)(intptr_t)s[SP_SRC] : x;
    int64_t n = s[SP_N], k = s[SP_K], cap = s[SP_CAP];
    uint32_t t = (uint32_t)s[SP_FLOOR];
    int64_t *ci = j->cand_idx + s[SP_CAND_AT];
    float *cv = j->cand_val + s[SP_CAND_AT];
    int64_t cnt = 0, q = 0;
    const uint32_t *u = (const uint32_t *)x;
    const int64_t *draws = (const int64_t *)(intptr_t)s[SP_DRAWN];
    uint64_t *marks = 0;
    const int drawn = draws || s[SP_DRAW_SEEDED]; /* the candidates: positions drawn (each once), not a floor */
    if (drawn) {
        marks = (uint64_t *)calloc((size_t)((n + 63) / 64 + 1), sizeof(uint64_t));
        if (!marks) { __atomic_store_n(&j->failed, 1, __ATOMIC_RELAXED); return; }
        if (draws)
            for (int64_t e = 0; e < s[SP_DRAWN_N]; e++) marks[draws[e] >> 6] |= (uint64_t)1 << (draws[e] & 63);
        else if (draw_k_marks(marks, n, s[SP_DRAWN_N], (uint64_t)s[SP_DRAW_SEED]) < 0) {
            free(marks);
            __atomic_store_n(&j->failed, 1, __ATOMIC_RELAXED);
            return;
        }
    }
    /* with zero, drawn candidates (every one is sent) are zeroed as the pass records them, their line in cache;
     * a top-k selection zeroes its k chosen once they are known (k scattered writes where zeroing every candidate
     * in the pass and writing back those not chosen took one store a candidate and 1.4 k scattered ones) */
    const int zero = j->zero && (k > 0 || drawn);
    const int zero_in_pass = zero && drawn;
    /* the wire's bf16 cast taken here: a chosen entry is left as v - bf16(v) instead of 0 (what its sending
     * leaves) and goes out in bf16; when the tensor turns out not finite, as without (zeroed, float32 out) */
    const int wire16 = zero && k > 0 && !drawn && !s[SP_MOM_U] && s[SP_WIRE_BF16];
    float *mu = (float *)(intptr_t)s[SP_MOM_U]; /* momentum correction: x is v, mu is u */
    const float *musrc = s[SP_MOM_USRC] ? (const float *)(intptr_t)s[SP_MOM_USRC] : mu; /* (and src is v's) */
    union { uint32_t u; float f; } mom = {(uint32_t)s[SP_MOM_M]};
    const int nesterov = (int)s[SP_MOM_NESTEROV];
    maxacc vtop = maxacc_zero();
    uint32_t top = 0; /* the largest magnitude bits of the accumulated x (res[3]; scans only, else 0) */
    const int want_top = !drawn;
    /* a strided sample of the updated x (DGC's threshold estimate): x[start + i * stride], i < count */
    int64_t s_at = s[SP_SAMPLE_START], s_stride = s[SP_SAMPLE_STRIDE] > 0 ? s[SP_SAMPLE_STRIDE] : 1, s_count = s[SP_SAMPLE_N], sn = 0;
    float *sv = j->sample + s[SP_SAMPLE_AT];
    moments mo; /* moments at levels (scans only): given in spec, or SIDCo's from its state */
    sd_prep sp;
    if (s[SP_SD_INTS]) {
        sd_prepare(s, n, &sp);
        t = sp.t;
        moments_levels(&mo, sp.lev, sp.nl, sp.e, (int)((const int64_t *)(intptr_t)s[SP_SD_INTS])[1]);
    } else {
        moments_init(&mo, s);
    }
    /* the plain pass (no momentum, draws, moments or sample): 8 blocks of 64 accumulated and masked, then their
     * candidates taken while the blocks are in cache -- the branches of the taking (a miss each few candidates)
     * kept apart from the streaming. The loop after it takes candidates the same way a block at a time; one loop
     * for both, 8 blocks at a time with the other cases' tests inside, made top-k's step 0.4-0.6 ms slower on
     * ResNet-50's shapes and 1.6 ms on ViT-B/16's (benchmarks/kernel_pair.py), so the plain pass keeps its own. */
    const int plain = !mu && !marks && !mo.nl && s_count == 0 && want_top && !zero_in_pass;
    while (plain && q + 64 <= n) {
        uint64_t mk[8];
        int nb = (int)((n - q) / 64 < 8 ? (n - q) / 64 : 8);
        for (int b = 0; b < nb; b++)
            mk[b] = add_mask64_top(x + q + 64 * b, src + q + 64 * b, g ? g + q + 64 * b : 0, t, &vtop);
        for (int b = 0; b < nb; b++, q += 64)
            cnt = take_block(mk[b], q, x, ci, cv, cnt, cap);
    }
    for (; q + 64 <= n; q += 64) {
        uint64_t msk = mu ? momentum_mask64(x + q, mu + q, src + q, musrc + q, g + q, mom.f, nesterov, t, &vtop)
                          : want_top ? add_mask64_top(x + q, src + q, g ? g + q : 0, t, &vtop)
                                     : add_mask64(x + q, src + q, g ? g + q : 0, t, &vtop);
        if (mo.nl) moments64(&mo, x + q); /* (before any zeroing) */
        for (; sn < s_count && s_at < q + 64; s_at += s_stride) sv[sn++] = x[s_at]; /* before any zeroing */
        if (marks) msk = marks[q >> 6];
        while (msk) {
            int b = __builtin_ctzll(msk);
            msk &= msk - 1;
            if (cnt < cap) {
                ci[cnt] = q + b;
                cv[cnt] = x[q + b];
                if (zero_in_pass) x[q + b] = 0.0f;
            }
            cnt++;
        }
    }
    for (; q < n; q++) {
        if (mu) {
            float uq = nesterov ? (musrc[q] + g[q]) * mom.f : musrc[q] * mom.f + g[q];
            x[q] = nesterov ? (src[q] + uq) + g[q] : src[q] + uq;
            mu[q] = uq;
        } else if (g) {
            x[q] = src[q] + g[q];
        } else if (src != x) {
            x[q] = src[q];
        }
        if (want_top) top = (u[q] & 0x7fffffffu) > top ? (u[q] & 0x7fffffffu) : top;
        if (mo.nl) moments_one(&mo, x[q]);
        if (sn < s_count && s_at == q) { sv[sn++] = x[q]; s_at += s_stride; }
        if (marks ? (marks[q >> 6] >> (q & 63)) & 1 : (u[q] & 0x7fffffffu) >= t) {
            if (cnt < cap) { ci[cnt] = q; cv[cnt] = x[q]; if (zero_in_pass) x[q] = 0.0f; }
            cnt++;
        }
    }
    free(marks);
    if (mo.nl) moments_flush(&mo);
    if (mo.nl && s[SP_LEV_OUT]) moments_out(&mo, s);
    int64_t *res = j->res + RES * r;
    res[1] = cnt;
    res[3] = top > maxacc_get(vtop) ? top : maxacc_get(vtop);
    if (k == 0) { /* candidates only (zeroed only when drawn) */
        res[0] = cnt > cap ? 2 : 0;
        if (s[SP_SD_INTS] && res[3] < 0x7f800000 && sd_in_scan(s, &sp, &mo, x, n, ci, cv, cnt, cnt <= cap,
                                                       (uint32_t)res[3]) < 0)
            __atomic_store_n(&j->failed, 1, __ATOMIC_RELAXED);
        if (s[SP_DGC_K] && res[3] < 0x7f800000)
            dgc_in_scan(s, x, mu, n, ci, cv, cnt, sv, sn, keys);
        return;
    }
    if (cnt < k || cnt > cap) { /* (nothing was zeroed: k > 0 draws nothing) */
        res[0] = cnt < k ? 1 : 2;
        return;
    }
    const uint32_t *cu = (const uint32_t *)cv;
    const int64_t *prev = (const int64_t *)(intptr_t)s[SP_SCORE_POS];
    union { uint32_t u; float f; } base = {(uint32_t)s[SP_SCORE_BASE]};
    if (prev || base.f != 1.0f) { /* scores: |x| times the factor of its entry in prev (sorted), else base */
        const float *fac = (const float *)(intptr_t)s[SP_SCORE_FAC];
        float *cs = j->cand_score + s[SP_CAND_AT];
        int64_t pp = 0, np = s[SP_SCORE_N];
        for (int64_t e = 0; e < cnt; e++) {
            while (pp < np && prev[pp] < ci[e]) pp++;
            cs[e] = fabsf(cv[e]) * (pp < np && prev[pp] == ci[e] ? fac[pp] : base.f);
        }
        cu = (const uint32_t *)cs;
    }
    int64_t above = 0; /* (scores: their largest is not known, the histogram starts at the floor) */
    uint32_t kth = kth_above(cu, cnt, k, t, cu == (const uint32_t *)cv ? (uint32_t)res[3] : 0, keys, &above);
    if (cu != (const uint32_t *)cv && kth < t) { /* an entry below the floor may score higher: not here */
        res[0] = 1;
        return;
    }
    int64_t ties = k - above, o = 0;
    int64_t *oi = j->out_idx + s[SP_OUT_AT];
    float *ov = j->out_val + s[SP_OUT_AT];
    uint16_t *ob = j->out_bf16 + s[SP_OUT_AT];
    const int rounded = wire16 && res[3] < 0x7f800000; /* finite: the bf16 values out (Python reads res[3] too) */
    /* the chosen in index order, without a branch on each (about half the candidates are chosen): every candidate
     * is written at o, which moves on when it is chosen; the loop ends with the k-th chosen (o < k at each write) */
    int64_t e = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
    e = choose16(cu, ci, cv, cnt, k, kth, &ties, oi, ov, rounded ? ob : 0, &o);
#elif defined(__AVX2__)
    e = choose8(cu, ci, cv, cnt, k, kth, &ties, oi, ov, rounded ? ob : 0, &o);
#endif
    for (; e < cnt && o < k; e++) { /* (the compiler takes the test of rounded out of the loop) */
        uint32_t b = cu[e] & 0x7fffffffu;
        int64_t tie = b == kth;
        int64_t take = (b > kth) | (tie & (ties > 0));
        ties -= tie & take;
        oi[o] = ci[e];
        ov[o] = cv[e]; /* (rounded: kept for what stays in memory, so the zeroing need not read x) */
        if (rounded) ob[o] = bf16_bits(cv[e]);
        o += take;
    }
    const int64_t keep = s[SP_KEEP_K];
    if (keep > 0 && keep < k) { /* rTop-k: a random keep of the k chosen (draw_k_marks over their order) stay */
        uint64_t *km = (uint64_t *)calloc((size_t)((k + 63) / 64 + 1), sizeof(uint64_t));
        if (!km || draw_k_marks(km, k, keep, (uint64_t)s[SP_DRAW_SEED]) < 0) {
            free(km);
            __atomic_store_n(&j->failed, 1, __ATOMIC_RELAXED);
            return;
        }
        int64_t w = 0;
        for (int64_t e = 0; e < k; e++) {
            if (is_marked(km, e)) {
                oi[w] = oi[e];
                ov[w] = ov[e];
                if (rounded) ob[w] = ob[e];
                w++;
            }
        }
        free(km);
        k = keep;
    }
    if (zero) /* the chosen leave memory: wholly, or (bf16 out) but for what the cast rounds off (ov[e] is x[oi[e]]:
               * scattered stores only, no scattered reads) */
        for (int64_t e = 0; e < k; e++) {
            x[oi[e]] = rounded ? ov[e] - bf16_value(ob[e]) : 0.0f;
        }
    res[0] = 0;
    res[2] = kth;
}

static void *many_run(void *arg) {
    many_job *j = (many_job *)arg;
    uint32_t *keys = (uint32_t *)malloc((size_t)(j->scratch_n > 0 ? j->scratch_n : 1) * sizeof(uint32_t));
    if (!keys) { __atomic_store_n(&j->failed, 1, __ATOMIC_RELAXED); return 0; }
    for (;;) {
        int64_t r = __atomic_fetch_add(&j->next, 1, __ATOMIC_RELAXED);
        if (r >= j->m) break;
        topk_one(j, r, keys);
    }
    free(keys);
    return 0;
}

/* Returns 0, or -1 if memory for the scratch keys ran out (then nothing is reliable). */
int gs_topk_many(const int64_t *spec, int64_t m, int64_t *res, int64_t *cand_idx, float *cand_val,
                 float *cand_score, int64_t *out_idx, float *out_val, uint16_t *out_bf16, float *sample, int zero,
                 int nthreads) {
    many_job j = {spec, res, m, cand_idx, out_idx, cand_val, out_val, cand_score, sample, out_bf16, zero, 0, 0, 0};
    for (int64_t r = 0; r < m; r++)
        for (int f = SP_CAP; f <= SP_SAMPLE_N; f += SP_SAMPLE_N - SP_CAP) /* the cap; the sample (DGC's
                                                                            threshold is found in it) */
            if (spec[SPEC * r + f] > j.scratch_n) j.scratch_n = spec[SPEC * r + f];
    if (nthreads < 1) nthreads = 1;
    if (nthreads > 64) nthreads = 64;
    if (nthreads > m) nthreads = (int)(m > 0 ? m : 1);
    pthread_t th[64];
    int started = 1;
    for (int t = 1; t < nthreads; t++) {
        if (pthread_create(&th[t], 0, many_run, &j) != 0) break;
        started++;
    }
    many_run(&j);
    for (int t = 1; t < started; t++) pthread_join(th[t], 0);
    return j.failed ? -1 : 0;
}

/* ---------------------------------------------------------------- above a threshold, on candidates or a tensor
 *
 * gs_count_above: how many of v[0..n) have magnitude bits > t (>= t with inclusive), t the bits of a non-negative
 * float32: for finite v, exactly |v| > T (>= T) for the float T.
 * gs_take_above: those entries in order, as positions (idx[e] when idx is given, else e) and values; returns how
 * many. out_idx and out_val hold cap entries, at least gs_count_above's count; with cap >= n the loop has no branch. One read of v, no temporaries -- the torch
 * form takes |v|, a mask, a count or nonzero, and a gather for each. */
int64_t gs_count_above(const float *v, int64_t n, uint32_t t, int inclusive) {
    const uint32_t *u = (const uint32_t *)v;
    const uint32_t lo = inclusive ? t : t + 1; /* t <= the bits of Inf: no wrap */
    int64_t c = 0, e = 0;
    for (; e + 64 <= n; e += 64) c += __builtin_popcountll(mask64(u + e, lo));
    for (; e < n; e++) c += (u[e] & 0x7fffffffu) >= lo;
    return c;
}

int64_t gs_take_above(const float *v, const int64_t *idx, int64_t n, uint32_t t, int inclusive, int64_t *out_idx,
                      float *out_val, int64_t cap) {
    const uint32_t *u = (const uint32_t *)v;
    const uint32_t lo = inclusive ? t : t + 1;
    int64_t o = 0, e = 0;
    if (cap >= n) { /* room for every entry: write each and advance past the kept (no branch to mispredict) */
        for (; e < n; e++) {
            out_idx[o] = idx ? idx[e] : e;
            out_val[o] = v[e];
            o += (u[e] & 0x7fffffffu) >= lo;
        }
        return o;
    }
    for (; e + 64 <= n; e += 64) { /* few kept: a vector compare per 64, then the kept ones off the mask */
        uint64_t m = mask64(u + e, lo);
        while (m) {
            int64_t at = e + __builtin_ctzll(m);
            m &= m - 1;
            out_idx[o] = idx ? idx[at] : at;
            out_val[o++] = v[at];
        }
    }
    for (; e < n; e++) {
        if ((u[e] & 0x7fffffffu) >= lo) {
            out_idx[o] = idx ? idx[e] : e;
            out_val[o++] = v[e];
        }
    }
    return o;
}

/* GaussianK's corrections of its Gaussian threshold (gradsift.compressors.gaussiank.GaussianK.correct, the same
 * float64 operations in the same order), for m rows of GAUSSK_FIELDS int64s: the first threshold (float64 bits), k,
 * the candidates' values (float32, the pass's: every entry at or above the floor), their count, the floor's
 * magnitude bits, how many entries reached the floor, the tensor x and its length, the rounds, and 1 for the printed
 * steps (else the bracket's). Each count is Tail.count_above's: on the candidates at or above the floor; under it,
 * more than 4k/3 reached the floor: that count; else over x. Each row's threshold into thr[r]. */
#define GAUSSK_FIELDS 10
static int64_t tail_count(const int64_t *f, double t, double enough) {
    if (!(t >= 0.0)) { /* under the floor; over x, a negative threshold counts every (finite) entry, NaN none */
        if ((double)f[5] > enough) return f[5];
        return t != t ? 0 : f[7];
    }
    const float tf = (float)fmin(fabs(t), 3.4028234663852886e38); /* (kernels/moments.py's _bits) */
    uint32_t b;
    memcpy(&b, &tf, 4);
    if (b >= (uint32_t)f[4]) return gs_count_above((const float *)(intptr_t)f[2], f[3], b, 0);
    if ((double)f[5] > enough) return f[5];
    return gs_count_above((const float *)(intptr_t)f[6], f[7], b, 0);
}

void gs_gaussk_many(const int64_t *rows, int64_t m, double *thr) {
    for (int64_t r = 0; r < m; r++) {
        const int64_t *f = rows + GAUSSK_FIELDS * r;
        double t, many = 0.0, few = 0.0;
        memcpy(&t, f, 8);
        const double k = (double)f[1], lo = 2.0 * k / 3.0, hi = 4.0 * k / 3.0;
        int has_many = 0, has_few = 0;
        int64_t count = tail_count(f, t, hi);
        for (int64_t i = 0; i < f[8]; i++) {
            if ((double)count < lo) few = t, has_few = 1;
            else if ((double)count > hi) many = t, has_many = 1;
            else break;
            if (f[9] || !has_many || !has_few) t = (double)count < lo ? t * 0.5 : t * 1.5;
            else t = many > 0.0 ? sqrt(many * few) : 0.5 * (many + few);
            count = tail_count(f, t, hi);
        }
        thr[r] = t;
    }
}

/* RedSync's search (gradsift.compressors.redsync.RedSync.threshold, the same float64 operations in the same order)
 * for m rows of GAUSSK_FIELDS int64s, laid out as GaussianK's but for the first field, the mean magnitude (float64
 * bits), and the last two: the largest magnitude and the search's width tol (float64 bits). Thresholds mean + r
 * (max - mean), r halving [0, 1] until k < count < 2k or the interval is at most tol wide; each count
 * Tail.count_above's with enough = 2k (tail_count). Each row's last threshold into thr[r]. */
void gs_redsync_many(const int64_t *rows, int64_t m, double *thr) {
    for (int64_t r = 0; r < m; r++) {
        const int64_t *f = rows + GAUSSK_FIELDS * r;
        double mean, top, tol, lo = 0.0, hi = 1.0;
        memcpy(&mean, f, 8);
        memcpy(&top, f + 8, 8);
        memcpy(&tol, f + 9, 8);
        const int64_t k = f[1];
        double t = mean;
        while (hi - lo > tol) {
            const double mid = 0.5 * (lo + hi);
            t = mean + mid * (top - mean);
            const int64_t count = tail_count(f, t, 2.0 * (double)k);
            if (k < count && count < 2 * k) break;
            if (count <= k) hi = mid;
            else lo = mid;
        }
        thr[r] = t;
    }
}

/* gs_take_above_many: gs_take_above for m rows at once, each row (v, idx, n, t, inclusive, x, at, cap) as int64:
 * the entries of v[0..n) above t written at out_idx/out_val + at (room for n), and with x (else 0) zeroed there in x
 * (positions idx[e], else e); how many into counts[r]. Where cap >= 0 the wire's capacity is taken too: more than cap
 * of them, the cap of largest magnitude stay at the front in their order (keep_largest_one; the others are left in x
 * as they were, never zeroed), unless magnitudes tie across the cut or a NaN is among them (then all are zeroed, as
 * without cap); those that stay, if at most cap, take the wire's bf16 cast as well: x keeps v - bf16(v) instead of 0,
 * the value goes out as bf16(v), its bits at out_b16 + at (finite values: bf16_bits). kept[r]: how many stay (the
 * rest overflowed the wire). A threshold method's selections of a group, one call. (Without memory for the scratch
 * keys a row over its capacity is zeroed whole, as without cap: the caller's cut follows.) */
static int keep_largest_one(float *v, int64_t *ix, int64_t n, int64_t cap, uint32_t *keys, float *x);
void gs_take_above_many(const int64_t *rows, int64_t m, int64_t *out_idx, float *out_val, int64_t *counts,
                       uint16_t *out_b16, int64_t *kept) {
    uint32_t *keys = 0;
    for (int64_t r = 0; r < m; r++) {
        const int64_t *w = rows + 8 * r;
        int64_t *oi = out_idx + w[6];
        float *ov = out_val + w[6];
        const int64_t o = gs_take_above((const float *)(intptr_t)w[0], (const int64_t *)(intptr_t)w[1], w[2],
                                        (uint32_t)w[3], (int)w[4], oi, ov, w[2]);
        float *x = (float *)(intptr_t)w[5];
        int64_t keep = o;
        if (x && w[7] >= 0 && o > w[7]) { /* over the wire's capacity: cut here, the dropped left where they are */
            if (!keys) {
                int64_t most = 1;
                for (int64_t q = 0; q < m; q++) most = rows[8 * q + 2] > most ? rows[8 * q + 2] : most;
                keys = (uint32_t *)malloc((size_t)most * sizeof(uint32_t));
            }
            if (keys && keep_largest_one(ov, oi, o, w[7], keys, 0)) keep = w[7];
        }
        if (x && w[7] >= 0 && keep <= w[7])
            for (int64_t e = 0; e < keep; e++) {
                const uint16_t b = bf16_bits(ov[e]);
                x[oi[e]] = ov[e] - bf16_value(b), out_b16[w[6] + e] = b;
            }
        else if (x)
            for (int64_t e = 0; e < o; e++) x[oi[e]] = 0.0f;
        counts[r] = o, kept[r] = keep;
    }
    free(keys);
}

/* keep_largest_one: of n entries (float32 values v, int64 positions ix) the cap of largest magnitude stay (magnitude
 * bits: NaN above Inf above the rest), in their order, compacted to the front in place; each one dropped is added
 * back into x at its position (x[p] += v, an index_put_ with accumulate) where x is given. Where magnitudes tie
 * across the cut (which of them stay is torch.topk's choice, payload.fit_capacity's) or a NaN is among them,
 * nothing changes: returns 0 (else 1). keys: room for n. */
static int keep_largest_one(float *v, int64_t *ix, int64_t n, int64_t cap, uint32_t *keys, float *x) {
    const uint32_t *u = (const uint32_t *)v;
    uint32_t kth = 0xffffffffu; /* (cap 0: above every magnitude, nothing stays) */
    if (cap > 0) {
        for (int64_t e = 0; e < n; e++) keys[e] = u[e] & 0x7fffffffu;
        kth = kth_largest(keys, n, cap);
        int64_t above = 0, at = 0, nan = 0;
        for (int64_t e = 0; e < n; e++) {
            above += (u[e] & 0x7fffffffu) > kth;
            at += (u[e] & 0x7fffffffu) == kth;
            nan += (u[e] & 0x7fffffffu) > 0x7f800000u;
        }
        if (above + at > cap || nan) return 0; /* ties across the cut (torch ties NaNs of other bits too) */
    }
    int64_t o = 0;
    for (int64_t e = 0; e < n; e++) {
        if ((u[e] & 0x7fffffffu) >= kth) {
            const float ve = v[e];
            const int64_t pe = ix[e];
            v[o] = ve;
            ix[o++] = pe;
        } else if (x) {
            x[ix[e]] += v[e];
        }
    }
    return 1;
}

/* gs_keep_largest_many: a sparse payload cut to its wire capacity, for m rows (vals, idx, n, cap, x) as int64
 * (keep_largest_one with cap = max(cap, 0) where cap < n); done[r] = 1 where it was cut. Returns 0, or -1 where memory
 * for the scratch keys ran out (nothing changed then). */
int gs_keep_largest_many(const int64_t *rows, int64_t m, int64_t *done) {
    int64_t most = 1;
    for (int64_t r = 0; r < m; r++) most = rows[5 * r + 2] > most ? rows[5 * r + 2] : most;
    uint32_t *keys = (uint32_t *)malloc((size_t)most * sizeof(uint32_t));
    if (!keys) return -1;
    for (int64_t r = 0; r < m; r++) {
        const int64_t *w = rows + 5 * r;
        const int64_t n = w[2], cap = w[3] > 0 ? w[3] : 0;
        done[r] = cap < n && keep_largest_one((float *)(intptr_t)w[0], (int64_t *)(intptr_t)w[1], n, cap, keys,
                                              (float *)(intptr_t)w[4]);
    }
    free(keys);
    return 0;
}

/* ---------------------------------------------------------------- independent Bernoulli draws, counter-based
 *
 * gs_bernoulli: the positions i of p[0..n) where u_i < min(p[i] * sc, 1) (float32 product, as torch's mul and
 * clamp), in order, into out (room for cap of them); returns how many there are (more than cap: only the first
 * cap were written).
 * u_i is a uniform on [0, 1) with 24 bits, a function of (seed, i) alone: h = mix(mix(i + s0) ^ s1), s0 and s1 the
 * low and high 32 bits of seed, mix the 32-bit "lowbias32" finalizer (two multiplies, xor-shifts), u_i = (h >> 8)
 * * 2^-24. Every worker with the same seed draws the same, and the torch twin (gradsift.kernels.draw) computes the
 * same bits. 32-bit arithmetic, so 64 draws at a time vectorize; then the kept positions are read off the mask. The
 * comparison is made in units of 2^-24 (u_i 2^24 an integer, level 2^24 exact: the same outcome), the clamp a min
 * (where the level is NaN, min(1, NaN) is NaN: never kept). */
/* (mix32: the 32-bit "lowbias32" finalizer, defined with random-k's draw above) */
static inline float level(float p, float sc) { /* min(p sc, 1) as torch's mul and clamp(max=1): NaN stays NaN */
    float v = p * sc;
    return v > 1.0f ? 1.0f : v;
}

#if defined(__AVX512F__)
static inline __m512i mix32x16(__m512i x) {
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32((int)0x7feb352du));
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32((int)0x846ca68bu));
    return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
}

static inline uint64_t draw_mask64(const float *p, float sc, uint32_t at, uint32_t s0, uint32_t s1) {
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 scale = _mm512_set1_ps(0x1p-24f), vsc = _mm512_set1_ps(sc), one = _mm512_set1_ps(1.0f);
    uint64_t m = 0;
    for (int q = 0; q < 4; q++) {
        __m512i i = _mm512_add_epi32(_mm512_set1_epi32((int)(at + 16u * (uint32_t)q + s0)), lane);
        __m512i h = mix32x16(_mm512_xor_si512(mix32x16(i), _mm512_set1_epi32((int)s1)));
        __m512 u = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(h, 8)), scale);
        __m512 pq = _mm512_mul_ps(_mm512_loadu_ps(p + 16 * q), vsc);
        pq = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(pq, one, _CMP_GT_OQ), pq, one); /* min(p, 1); NaN stays NaN */
        m |= (uint64_t)_mm512_cmp_ps_mask(u, pq, _CMP_LT_OQ) << (16 * q);
    }
    return m;
}
#elif defined(__AVX2__)
static inline __m256i mix32x8(__m256i x) {
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32((int)0x7feb352du));
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32((int)0x846ca68bu));
    return _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
}

static inline uint64_t draw_mask64(const float *p, float sc, uint32_t at, uint32_t s0, uint32_t s1) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), vs1 = _mm256_set1_epi32((int)s1);
    const __m256 units = _mm256_set1_ps(0x1p24f), vsc = _mm256_set1_ps(sc), one = _mm256_set1_ps(1.0f);
    const __m256i first = _mm256_add_epi32(_mm256_set1_epi32((int)(at + s0)), lane);
    uint32_t b[8];
    for (int q = 0; q < 8; q++) {
        __m256i h = mix32x8(_mm256_xor_si256(mix32x8(_mm256_add_epi32(first, _mm256_set1_epi32(8 * q))), vs1));
        __m256 u = _mm256_cvtepi32_ps(_mm256_srli_epi32(h, 8)); /* u_i 2^24, exactly */
        __m256 lv = _mm256_min_ps(one, _mm256_mul_ps(_mm256_loadu_ps(p + 8 * q), vsc)); /* NaN stays NaN */
        b[q] = (uint32_t)_mm256_movemask_ps(_mm256_cmp_ps(u, _mm256_mul_ps(lv, units), _CMP_LT_OQ));
    }
    return (uint64_t)(b[0] | b[1] << 8 | b[2] << 16 | b[3] << 24) |
           (uint64_t)(b[4] | b[5] << 8 | b[6] << 16 | b[7] << 24) << 32;
}
#else
static inline uint64_t draw_mask64(const float *p, float sc, uint32_t at, uint32_t s0, uint32_t s1) {
    uint64_t m = 0;
    for (int e = 0; e < 64; e++) {
        float u = (float)(mix32(mix32(at + (uint32_t)e + s0) ^ s1) >> 8);
        m |= (uint64_t)(u < level(p[e], sc) * 0x1p24f) << e;
    }
    return m;
}
#endif

/* The positions of the mask m's bits, q + bit, written at out[o...] (room for all of them while o + 64 <= cap, else
 * only below cap); returns o + their count. With room, the first two are written whatever the count (a zero mask
 * writes two positions past the count, overwritten later): a loop whose length follows the count missed its branch
 * at most blocks, at the rates the sampling methods draw. */
static inline int64_t put_positions(uint64_t m, int64_t q, int64_t *out, int64_t o, int64_t cap) {
    const uint64_t top = 1ull << 63; /* (ctz of m | top: the lowest set bit of m, or 63 when m is 0) */
    if (o + 64 <= cap) {
        const int c = __builtin_popcountll(m);
        out[o] = q + __builtin_ctzll(m | top);
        m &= m - 1;
        out[o + 1] = q + __builtin_ctzll(m | top);
        if (c > 2)
            for (int64_t j = o + 2; (m &= m - 1); j++) out[j] = q + __builtin_ctzll(m);
        return o + c;
    }
    for (; m; m &= m - 1, o++)
        if (o < cap) out[o] = q + __builtin_ctzll(m);
    return o;
}

/* The scalar draw of position q: kept or not (the vector draw's outcome) */
static inline int drawn(const float *p, int64_t q, float sc, uint32_t s0, uint32_t s1) {
    return (float)(mix32(mix32((uint32_t)q + s0) ^ s1) >> 8) < level(p[q], sc) * 0x1p24f;
}

int64_t gs_bernoulli(const float *p, int64_t n, float sc, uint64_t seed, int64_t *out, int64_t cap) {
    const uint32_t s0 = (uint32_t)seed, s1 = (uint32_t)(seed >> 32);
    int64_t o = 0, q = 0;
    for (; q + 64 <= n; q += 64) o = put_positions(draw_mask64(p + q, sc, (uint32_t)q, s0, s1), q, out, o, cap);
    for (; q < n; q++)
        if (drawn(p, q, sc, s0, s1)) {
            if (o < cap) out[o] = q;
            o++;
        }
    return o;
}


/* ---------------------------------------------------------------- SIDCo's threshold after its scan
 *
 * sd_one (called by sd_in_scan, below, right after the tensor's pass): what gradsift.compressors.sidco.SIDCo.threshold
 * computes from a ScanStats (histstats.py) -- the same statistics, fits, adaptive chains and correction, the same
 * float64 operations in the same order and the same libm calls, so both give the same threshold
 * (tests/test_sidco_scan.py); the Python form is the reference and the eager backend's path. S holds the tensor, its
 * candidates' count, the floor, the largest magnitude, the fit and the levels as (value, count, sum, sum of squares),
 * ascending from 0; cv / ci / cc the candidates (cc = 0 when more than the cap reached the floor).
 *   out   SD_HEAD doubles: threshold, stages taken, length of the path, how many were selected (-1: not here), then
 *         (sd_in_scan's) whether the state was learned here, the new grow and slack (NaN: unchanged), the floor, the
 *         largest magnitude; then the path (the stages' thresholds before the last: at most SD_PATH, and fewer than
 *         the most stages its ratio allows, which the caller makes room for)
 * When the threshold lies at or above the floor, the candidates above it are the selection: they are moved to the
 * front of ci / cv (in index order) and, with zero, zeroed in x (error feedback's residual); under it, x is read
 * again for them, into the `room` slots of ci / cv when they fit (a small tensor's few entries make the fit jump).
 * Returns 0, or -1 when memory for a tensor's statistics ran out. */
#define SD_PATH 32
#define SD_HEAD 9
#define SD_SEEN (LMAX + 2 * SD_PATH + 8)

typedef struct {
    int cand;
    int64_t lo, span;
    double *n, *s1, *s2; /* suffix sums over the candidates' buckets [lo, lo + span), span + 1 each */
    const double *lev;
    int nl;
    double floor, top;
    int64_t cand_count;
    const float *x;
    int64_t nx;
    int dist;
    double fr;
} sd_stats;

static double bucket_value(int64_t b) { /* kernels.bucket_values(): the middle of the bucket's bit range */
    if (b <= 0 || b >= (0x7F800000 >> SHIFT)) return 0.0;
    union { uint32_t u; float f; } w = {((uint32_t)b << SHIFT) | (1u << (SHIFT - 1))};
    return (double)w.f;
}

static int64_t sd_at(const sd_stats *S, double t) { /* TailStats._at */
    int64_t b = 1;
    if (t > 0) { /* numpy's searchsorted(values, t, "right") over the finite buckets */
        int64_t lo = 0, hi = 0x7F800000 >> SHIFT;
        while (lo < hi) {
            int64_t mid = lo + (hi - lo) / 2;
            if (bucket_value(mid) <= t) lo = mid + 1;
            else hi = mid;
        }
        b = lo;
    }
    int64_t j = b - S->lo;
    return j < 0 ? 0 : (j > S->span ? S->span : j);
}

static void sd_stage(const sd_stats *S, double t, double r[4]) { /* ScanStats.stage */
    if (S->cand && t >= S->floor) {
        int64_t j = sd_at(S, t);
        r[0] = t, r[1] = S->n[j], r[2] = S->s1[j], r[3] = S->s2[j];
        return;
    }
    int l = S->nl - 1;
    while (l > 0 && !(S->lev[4 * l] <= t)) l--;
    memcpy(r, S->lev + 4 * l, 4 * sizeof(double));
}

static double sd_count(const sd_stats *S, double t, double enough) { /* ScanStats.count */
    if (S->cand && t >= S->floor) return S->n[sd_at(S, t)];
    for (int l = 0; l < S->nl; l++)
        if (S->lev[4 * l] == t) return S->lev[4 * l + 1];
    if (S->cand && (double)S->cand_count > enough) return (double)S->cand_count;
    return (double)gs_count_above(S->x, S->nx, f32_bits(t), 0);
}

static double sd_max0(double a) { return 0.0 > a ? 0.0 : a; } /* Python's max(a, 0.0) */

static void sd_fit(const sd_stats *S, double t, double want, int left, int first, double *thr, double *pop) {
    double st[4];
    sd_stage(S, t, st);
    const double loc = st[0], n = st[1], s1 = st[2], s2 = st[3];
    *pop = n, *thr = t;
    if (n <= want) return;
    double r = want / n;
    r = (first && left > 1 && r < S->fr) ? S->fr : pow(r, 1.0 / left);
    if (1.0 < r) r = 1.0;
    if (n < 2) return;
    if (S->dist == 0) { /* exp_threshold */
        *thr = (s1 / n - loc) * log(1.0 / r) + loc;
        return;
    }
    const double mean = s1 / n, m = mean - loc, v = sd_max0(s2 / n - mean * mean) * n / (n - 1);
    if (!(v > 0) || !(m > 0)) { /* gp_threshold */
        *thr = loc + sd_max0(m);
        return;
    }
    const double q = m * m / v, xi = 0.5 * (1.0 - q), beta = 0.5 * m * (q + 1.0);
    *thr = fabs(xi) < 1e-9 ? loc + beta * log(1.0 / r) : loc + beta / xi * expm1(-xi * log(r));
}

typedef struct { double t, c; } sd_point;

typedef struct {
    int64_t k;
    int adapt, correct, start, top_st, zero;
    double eps_l, eps_h;
} sd_opts;

static int sd_chain(const sd_stats *S, int64_t k, int stages, double hi, double *t_out, double *c_out, double *path,
                    sd_point *seen, int *ns) {
    double t = 0.0;
    int np = 0;
    for (int i = 0; i < stages; i++) {
        double nw, n;
        sd_fit(S, t, (double)k, stages - i, i == 0, &nw, &n);
        if (n <= (double)k || !(nw > t) || !isfinite(nw)) break;
        if (np < SD_PATH) path[np] = nw;
        np++;
        t = nw;
    }
    const double c = sd_count(S, t, hi);
    if (*ns < SD_SEEN) seen[(*ns)++] = (sd_point){t, c};
    *t_out = t, *c_out = c;
    np = np > 0 ? np - 1 : 0;
    return np < SD_PATH ? np : SD_PATH;
}

static double sd_miss(double c, int64_t k) { return fabs(log((0.5 > c ? 0.5 : c) / (double)k)); }

static double sd_correct(const sd_stats *S, int64_t k, double eps_l, double eps_h, sd_point *seen, int ns, double t,
                         double count) { /* SIDCo.correct */
    const double lo = (1.0 - eps_l / 2) * (double)k, hi = (1.0 + eps_h / 2) * (double)k;
    seen[ns++] = (sd_point){t, count};
    seen[ns++] = (sd_point){S->top, 0.0};
    int hb = 0, ha = 0;
    sd_point below = {0, 0}, above = {0, 0};
    for (int e = 0; e < ns; e++) {
        if (seen[e].c >= (double)k) {
            if (!hb || seen[e].t > below.t) below = seen[e], hb = 1;
        } else if (!ha || seen[e].t < above.t) {
            above = seen[e], ha = 1;
        }
    }
    if (!hb) return t;
    for (int step = 0; step < 12; step++) {
        const double t0 = below.t, n0 = below.c, t1 = above.t, n1 = above.c;
        double nxt;
        if (step % 2 == 0 && n1 > 0) {
            const double f0 = log(n0 / (double)k), f1 = log(n1 / (double)k);
            nxt = t0 + (t1 - t0) * f0 / (f0 - f1);
        } else {
            nxt = t0 > 0 ? sqrt(t0 * t1) : t1 / 2;
        }
        if (!(t0 < nxt && nxt < t1)) nxt = 0.5 * (t0 + t1);
        const double n = sd_count(S, nxt, (1.0 + eps_h) * (double)k);
        if (lo <= n && n <= hi) return nxt;
        if (n >= (double)k) below = (sd_point){nxt, n};
        else above = (sd_point){nxt, n};
    }
    return sd_miss(above.c, k) < sd_miss(below.c, k) ? above.t : below.t;
}

static int sd_one(sd_stats S, const sd_opts *o, int64_t *restrict ci, float *restrict cvw, int64_t cc, int64_t room,
                  float *x, double *out) {
    const int64_t k = o->k;
    const int adapt = o->adapt, correct = o->correct, top_st = o->top_st;
    const double eps_l = o->eps_l, eps_h = o->eps_h;
    double *buf = 0;
    if (S.cand) { /* TailStats.of_tensor of the candidates: the same suffix sums over the buckets from the floor's
                   * to the largest magnitude's (those outside the candidates' own span are empty: they add zeros) */
        const uint32_t *u = (const uint32_t *)cvw;
        int64_t lo = f32_bits(S.floor) >> SHIFT, hi = f32_bits(S.top) >> SHIFT;
        if (hi < lo) hi = lo; /* (every candidate's bits reached the floor's, none passed the largest's) */
        S.lo = lo, S.span = hi - lo + 1;
        buf = (double *)calloc((size_t)(3 * (S.span + 1)), sizeof(double));
        uint32_t *cnt = (uint32_t *)calloc((size_t)(S.span + 1), sizeof(uint32_t));
        if (!buf || !cnt) {
            free(buf), free(cnt);
            return -1;
        }
        S.n = buf, S.s1 = buf + (S.span + 1), S.s2 = buf + 2 * (S.span + 1);
        for (int64_t e = 0; e < cc; e++) {
            const int64_t j = (int64_t)((u[e] & 0x7fffffffu) >> SHIFT) - lo;
            cnt[j < 0 ? 0 : (j > S.span ? S.span : j)]++;
        }
        double a0 = 0.0, a1 = 0.0, a2 = 0.0;
        for (int64_t j = S.span - 1; j >= 0; j--) {
            const double v = bucket_value(lo + j), c = (double)cnt[j] * (v > 0 ? 1.0 : 0.0);
            a0 = a0 + c, a1 = a1 + c * v, a2 = a2 + c * v * v;
            S.n[j] = a0, S.s1[j] = a1, S.s2[j] = a2;
        }
        free(cnt);
    }
    const double lo = (1.0 - eps_l) * (double)k, hi = (1.0 + eps_h) * (double)k;
    sd_point seen[SD_SEEN + 2];
    int ns = 0;
    seen[ns++] = (sd_point){0.0, sd_count(&S, 0.0, INFINITY)};
    for (int l = 0; l < S.nl; l++) seen[ns++] = (sd_point){S.lev[4 * l], S.lev[4 * l + 1]};
    if (S.cand) seen[ns++] = (sd_point){S.floor, S.n[sd_at(&S, S.floor)]};
    int start = o->start < 1 ? 1 : o->start;
    if (start > top_st) start = top_st;
    double t, count, path[SD_PATH], best_path[SD_PATH];
    int plen, best_m = start, best_len = 0;
    if (!adapt) {
        best_len = sd_chain(&S, k, start, hi, &t, &count, best_path, seen, &ns);
    } else {
        double best_miss = 0, best_t = 0, best_c = 0;
        int have = 0;
        for (int d = 0; d < top_st; d++) {
            for (int side = 0; side < (d ? 2 : 1); side++) {
                const int m = d == 0 ? start : (side == 0 ? start + d : start - d);
                if (m < 1 || m > top_st) continue;
                plen = sd_chain(&S, k, m, hi, &t, &count, path, seen, &ns);
                const double miss = sd_miss(count, k);
                if (!have || miss < best_miss) {
                    have = 1, best_miss = miss, best_m = m, best_t = t, best_c = count, best_len = plen;
                    memcpy(best_path, path, sizeof(double) * (size_t)plen);
                }
                if (lo <= count && count <= hi) goto chosen;
            }
        }
    chosen:
        t = best_t, count = best_c;
    }
    if (correct && !(lo <= count && count <= hi)) t = sd_correct(&S, k, eps_l, eps_h, seen, ns, t, count);
    free(buf);
    out[0] = t, out[1] = best_m, out[2] = best_len, out[3] = -1;
    memcpy(out + SD_HEAD, best_path, sizeof(double) * (size_t)best_len);
    if (S.cand && t >= S.floor) { /* the selection: the candidates above t, as take_above takes them */
        const uint32_t above = f32_bits(t) + 1;
        int64_t kept = 0;
        for (int64_t e = 0; e < cc; e++) { /* every candidate written, the kept ones advanced past: no branch */
            const int64_t ie = ci[e];
            const float ve = cvw[e];
            union { float f; uint32_t u; } w = {ve};
            ci[kept] = ie, cvw[kept] = ve;
            kept += (w.u & 0x7fffffffu) >= above;
        }
        if (o->zero)
            for (int64_t e = 0; e < kept; e++) x[ci[e]] = 0.0f;
        out[3] = (double)kept;
    } else if (t >= 0) { /* under the floor (or past the cap): the tensor read again, as take_above(x) reads it,
                          * into the candidates' room of `room` slots; more than that: left to the caller */
        const uint32_t above = f32_bits(t) + 1;
        const uint32_t *xu = (const uint32_t *)x;
        int64_t kept = 0;
        for (int64_t q = 0; q < S.nx; q++)
            if ((xu[q] & 0x7fffffffu) >= above) {
                if (kept < room) ci[kept] = q, cvw[kept] = x[q];
                kept++;
            }
        if (kept <= room) {
            if (o->zero)
                for (int64_t e = 0; e < kept; e++) x[ci[e]] = 0.0f;
            out[3] = (double)kept;
        }
    }
    return 0;
}


/* SIDCo's row from its state (SP_SD_INTS..SP_SD_OUT set), everything the Python forms compute, in their float64 operations:
 *   SP_SD_INTS: int64 k, gp (squares), adapt, correct, start stages, zero, the ladder's length
 *   SP_SD_DOUBLES: double first_ratio, eps_l, eps_h, GROW (2), SLACK, LADDER, WANT, SLACK_RANGE (2), the update's grow
 *             range (2) -- the constants of sidco.py and guess.py --, then the tensor's state: kth (0: none), grow,
 *             slack (NaN: not set), top (0: none), the ladder
 *   SP_SD_OUT: the out row (sd_one's, with the learned state)
 * sd_prepare, before the pass: the floor (Guess.floor; 0 without a kth or with k >= n), the levels under it
 * (SIDCo._levels: 0, and the ladder times LADDER times the clamped growth, sorted, distinct, at most LMAX - 1 more)
 * and their scale (Levels.scale_for of the last largest magnitude). */
#define SD_DK 12 /* SP_SD_DOUBLES' constants before the tensor's state */
static double sd_clamp(double v, double lo, double hi) { /* Python's min(max(v, lo), hi) */
    v = lo > v ? lo : v;
    return hi < v ? hi : v;
}

static int sd_scale_exp(double top) { /* Levels.scale_for's exponent: top at 2^18 */
    const int e = top > 0 ? (int)floor(log2(262144.0 / top)) : 127;
    return e < -126 ? -126 : (e > 127 ? 127 : e);
}

static void sd_prepare(const int64_t *s, int64_t n, sd_prep *P) {
    const int64_t *si = (const int64_t *)(intptr_t)s[SP_SD_INTS];
    const double *d = (const double *)(intptr_t)s[SP_SD_DOUBLES];
    const double kth = d[SD_DK], grow = d[SD_DK + 1], slack = d[SD_DK + 2], top = d[SD_DK + 3];
    const double g = sd_clamp(grow != grow ? 1.0 : grow, d[3], d[4]);
    P->floor = si[0] >= n || kth == 0.0 ? 0.0 : kth * g * (slack != slack ? d[5] : slack);
    P->t = f32_bits(P->floor);
    double v[SD_PATH];
    int m = 0;
    const double g2 = d[6] * g;
    for (int64_t i = 0; i < si[6] && i < SD_PATH; i++) {
        const double x = g2 * d[SD_DK + 4 + i];
        if (0.0 < x && x < P->floor) {
            int j = m++;
            for (; j > 0 && v[j - 1] > x; j--) v[j] = v[j - 1]; /* sorted as it goes */
            v[j] = x;
        }
    }
    P->lev[0] = 0.0, P->nl = 1;
    for (int j = 0; j < m && P->nl < LMAX; j++)
        if (j == 0 || v[j] != v[j - 1]) P->lev[P->nl++] = v[j];
    P->e = sd_scale_exp(top);
}

/* What Guess.update learns from this call (its float64 operations), into out[4..8]; left to the caller (out[4] = 0)
 * when nothing was selected here, the threshold is not finite, or nothing lay above it with a non-zero largest
 * magnitude (the caller sends the largest then). */
static void sd_learn(const int64_t *si, const double *d, const sd_prep *P, int64_t cnt, double topd, double *out) {
    const double t = out[0], at = out[3], k = (double)si[0], c = (double)cnt;
    out[4] = 0.0, out[5] = out[6] = NAN, out[7] = P->floor, out[8] = topd;
    if (at < 0 || !(0.0 <= t && t < INFINITY) || (at == 0 && topd > 0.0)) return;
    const double old = d[SD_DK];
    if (old != 0.0 && t != 0.0) out[5] = sd_clamp(t / old, d[10], d[11]);
    if (t > 0 && c != at && P->floor != t) {
        const double slope = log((0.5 > c ? 0.5 : c) / (0.5 > at ? 0.5 : at)) / (P->floor - t);
        if (slope < 0) out[6] = sd_clamp(1.0 + log(d[7] * k / (0.5 > at ? 0.5 : at)) / slope / t, d[8], d[9]);
    }
    out[4] = 1.0;
}

/* SIDCo's threshold right after its scan (the tensor's lines still in cache for the zeroing): the levels' (value,
 * count, sum, sum of squares) from the pass's integer sums -- gathered again at a scale that fits when the
 * magnitudes outgrew the one given (Levels.fits / scale_for) --, then sd_one, then sd_learn. */
static int sd_in_scan(const int64_t *s, const sd_prep *P, moments *mo, float *x, int64_t n, int64_t *ci, float *cv,
                      int64_t cnt, int complete, uint32_t top) {
    const int64_t *si = (const int64_t *)(intptr_t)s[SP_SD_INTS];
    const double *sdd = (const double *)(intptr_t)s[SP_SD_DOUBLES];
    double *out = (double *)(intptr_t)s[SP_SD_OUT];
    union { uint32_t u; float f; } tw = {top};
    const double topd = (double)tw.f;
    double sc = (double)mo->s1;
    moments again;
    const moments *m = mo;
    if (!(topd * sc <= 1048576.0)) {
        const int e = sd_scale_exp(topd);
        sc = ldexp(1.0, e);
        moments_levels(&again, P->lev, P->nl, e, mo->squares);
        int64_t q = 0;
        for (; q + 64 <= n; q += 64) moments64(&again, x + q);
        for (; q < n; q++) moments_one(&again, x[q]);
        moments_flush(&again);
        m = &again;
    }
    double lev[4 * LMAX];
    for (int l = 0; l < m->nl; l++) { /* ScanStats.level_rows */
        lev[4 * l] = P->lev[l];
        lev[4 * l + 1] = (double)m->tc[l];
        lev[4 * l + 2] = (double)m->t1[l] / sc;
        lev[4 * l + 3] = (double)m->t2[l] * 1048576.0 / (sc * sc);
    }
    sd_stats S;
    memset(&S, 0, sizeof S);
    S.x = x, S.nx = n, S.cand = complete, S.cand_count = cnt, S.nl = m->nl, S.dist = (int)si[1];
    S.floor = P->floor, S.top = topd, S.fr = sdd[0], S.lev = lev;
    const double ratio = (double)si[0] / (double)n; /* sidco.max_stages */
    const int top_st = ratio >= 0.5 ? 1 : (int)fmax(1.0, ceil(log(ratio) / log(0.5) - 1e-12));
    const sd_opts o = {si[0], (int)si[2], (int)si[3], (int)si[4], top_st, (int)si[5], sdd[1], sdd[2]};
    if (sd_one(S, &o, ci, cv, complete ? cnt : 0, s[SP_CAP], x, out) < 0) return -1;
    sd_learn(si, sdd, P, cnt, topd, out);
    return 0;
}


/* ---------------------------------------------------------------- DGC's selection after its scan
 *
 * dgc_in_scan (right after the pass that updated DGC's velocity x and copied its sample sv out): what
 * gradsift.compressors.dgc.DGC.select_tail does with the pass's Tail, in the same float64 operations, so both
 * backends send the same entries (tests/test_dgc_scan.py). The threshold is the ks-th largest magnitude of the
 * sample, ks = max(1, ceil(k / n * sn)) (kth_of: a histogram of the sample's keys from the floor's up); while fewer than 0.8 k entries reach it (at most 10 times) it is lowered by 0.8, every count
 * Tail.count_above's -- on the candidates when the threshold reaches the floor (all of them recorded), the count of
 * those that reached the floor when more than 1.3 k did and it lies under it. A threshold under the floor with more
 * than 1.3 k candidates selects the exact top k among them (every entry at or above the k-th is one) and reads x once
 * for how many reached it; with fewer candidates, the counts under the floor are taken over x and what reaches the
 * threshold is taken off x into the candidates' room (more than the cap: left to the caller, out[3] = 0; a fallback
 * through Python took some 0.3 ms a tensor, 10 tensors a step on ResNet-50's shapes). The candidates at or above the
 * threshold are moved to the front of ci / cv in index order; more than 1.3 k of them: the k of largest magnitude, ties to the
 * lowest index (topk_indices), kept in index order.
 *   SP_DGC_K: k; SP_DGC_FLAGS: bit 0 whether the floor SP_FLOOR is a guess, bit 1 zero the selection in x (v; momentum
 *   correction's settling when the values go out as they are), bit 2 in u too (its masking), bit 3 (with bit 1) the
 *   wire's bf16 cast as well: x keeps v - bf16(v) instead of 0, the values become bf16(v); SP_DGC_OUT: 4 doubles
 *   out -- the threshold, how many reached it, how many were kept (the selection), 1 when done here (else 0).
 * keys: the thread's scratch, room for the cap and the sample. */
static void dgc_in_scan(const int64_t *s, float *x, float *mu, int64_t n, int64_t *ci, float *cv, int64_t cnt,
                        const float *sv, int64_t sn, uint32_t *keys) {
    const int64_t k = s[SP_DGC_K], cap = s[SP_CAP];
    const uint32_t floor = (uint32_t)s[SP_FLOOR];
    double *out = (double *)(intptr_t)s[SP_DGC_OUT];
    out[3] = 0.0;
    if (!(s[SP_DGC_FLAGS] & 1) || cnt > cap || sn <= 0 || k >= n) return; /* (no floor guessed, or candidates past the cap) */
    int64_t ks = (int64_t)ceil((double)k / (double)n * (double)sn);
    ks = ks < 1 ? 1 : (ks > sn ? sn : ks);
    union { uint32_t u; float f; } kb = {kth_of((const uint32_t *)sv, sn, ks, floor, keys)};
    double thr = (double)kb.f;
    const double enough = 1.3 * (double)k;
    const uint32_t *cu = (const uint32_t *)cv;
    int64_t count = 0;
    for (int i = 0;; i++) {
        const uint32_t b = f32_bits(thr);
        if (b >= floor) count = gs_count_above(cv, cnt, b, 1);
        else if ((double)cnt > enough) count = cnt;
        else count = gs_count_above(x, n, b, 1); /* under the floor with few candidates: counted over x */
        if (i == 10 || (double)count >= 0.8 * (double)k) break;
        thr *= 0.8;
    }
    const uint32_t b = f32_bits(thr);
    int64_t reached = -1;
    if (b < floor && (double)cnt > enough) { /* every candidate reaches the threshold and more than 1.3 k did: the
                      * exact top k of what reaches it, all among the candidates (the k-th is at or above the floor);
                      * only how many reach it is read off x, in one pass */
        reached = gs_count_above(x, n, b, 1);
    } else if (b < floor) { /* 1.3 k candidates or fewer: what reaches the threshold, counted over x by the loop
                      * (count), taken off x in index order into the candidates' room -- unless it outruns it */
        if (count > cap) return;
        const uint32_t *xu = (const uint32_t *)x;
        int64_t o = 0;
        for (int64_t q = 0; q < n; q++)
            if ((xu[q] & 0x7fffffffu) >= b) ci[o] = q, cv[o++] = x[q];
        cnt = reached = o;
    }
    int64_t sel = 0;
    for (int64_t e = 0; e < cnt; e++) { /* every candidate written, the kept ones advanced past: no branch */
        const int64_t ie = ci[e];
        const float ve = cv[e];
        union { float f; uint32_t u; } w = {ve};
        ci[sel] = ie, cv[sel] = ve;
        sel += (w.u & 0x7fffffffu) >= b;
    }
    int64_t kept = sel;
    if ((double)sel > enough) { /* the exact top k among them, ties to the lowest index, in index order */
        const uint32_t kth = kth_of(cu, sel, k, b, keys);
        int64_t above = 0;
        for (int64_t e = 0; e < sel; e++) above += (cu[e] & 0x7fffffffu) > kth;
        int64_t ties = k - above;
        kept = 0;
        for (int64_t e = 0; e < sel; e++) {
            const uint32_t mg = cu[e] & 0x7fffffffu;
            if (mg > kth || (mg == kth && ties-- > 0)) ci[kept] = ci[e], cv[kept++] = cv[e];
        }
    }
    if (s[SP_DGC_FLAGS] & 8) /* the wire's bf16 cast taken here: v keeps v - bf16(v), the value goes out as bf16(v)
                               * (float32, exact: the caller narrows it); non-finite, the caller drops the memory */
        for (int64_t e = 0; e < kept; e++) {
            const uint16_t b = bf16_bits(cv[e]);
            x[ci[e]] = cv[e] - bf16_value(b), cv[e] = bf16_value(b);
            if (s[SP_DGC_FLAGS] & 4) mu[ci[e]] = 0.0f;
        }
    else if (s[SP_DGC_FLAGS] & 2) /* the memory settled while the lines are warm: v = v - sent is 0 there, u masked */
        for (int64_t e = 0; e < kept; e++) {
            x[ci[e]] = 0.0f;
            if (s[SP_DGC_FLAGS] & 4) mu[ci[e]] = 0.0f;
        }
    out[0] = thr, out[1] = (double)(reached >= 0 ? reached : sel), out[2] = (double)kept, out[3] = 1.0;
    return;
}

/* ---------------------------------------------------------------- the sampling methods' bookkeeping
 *
 * gs_sampled: at the k sampled coordinates idx (GS, RSB, GSB; gradsift.compressors.sampling), in one sweep: the
 * values x[i] into vals, visited[i] = 1, and with a prior (RSB, GSB) prior[i] *= alpha (float32, as torch) -- its
 * values before into olds and after into news -- or with kept weights (GSB) w[i] = gsq[i] * prior[i], its values
 * before and after into olds and news instead. Returns the smallest prior written (+Inf without a prior). Every
 * array is read and written at the same k scattered places: one sweep lets their cache misses overlap, where one
 * torch operation per array walked the k places once each. */
/* gs_sampled's bookkeeping at the sampled coordinates idx[0..k); returns the smallest prior written (+Inf without) */
static float sweep_sampled(const int64_t *idx, int64_t k, const float *x, float *vals, uint8_t *visited, float *prior,
                           float alpha, float *w, const float *gsq, float *olds, float *news) {
    float least = INFINITY;
    for (int64_t j = 0; j < k; j++) {
        const int64_t i = idx[j];
        vals[j] = x[i];
        if (!visited[i]) visited[i] = 1; /* (a line left clean where it was set: no write-back) */
        if (!prior) continue;
        const float before = prior[i], now = before * alpha;
        prior[i] = now;
        least = now < least ? now : least;
        if (w) {
            const float nw = gsq[i] * now;
            olds[j] = w[i], news[j] = nw;
            w[i] = nw;
        } else {
            olds[j] = before, news[j] = now;
        }
    }
    return least;
}

float gs_sampled(const int64_t *idx, int64_t k, const float *x, float *vals, uint8_t *visited, float *prior,
                 float alpha, float *w, const float *gsq, float *olds, float *news) {
    return sweep_sampled(idx, k, x, vals, visited, prior, alpha, w, gsq, olds, news);
}

/* gs_sample_many: the sampling methods' draw and bookkeeping for a group, m rows of SAMPLE_FIELDS int64s: base, n,
 * scale (float32 bits), seed, room, idx, x, visited, prior, alpha (float32 bits), w, gsq, olds, news (pointers as
 * int64, 0 for none). Per row, gs_bernoulli's draw over base[0..n) into idx (room for room positions), the count
 * into kept[r]; where they all fit, gs_sampled's bookkeeping at them, their values into vals one row after the other
 * (row r's after the values of the rows before it: the group's values in one piece, to cast at once), the smallest
 * prior written into least[r]. A row whose count outruns its room is left as it was (its bookkeeping writes what it
 * draws from, GSB's weights or RSB's prior: the caller draws it again with room for all). (A sweep a few dozen
 * positions behind the draw, their cache lines prefetched as they were found, took as long as the draw and the sweep
 * one after the other: the sweep's scattered lines, five arrays a position, are bound by the memory's throughput,
 * not by its latency.) */
#define SAMPLE_FIELDS 14
void gs_sample_many(const int64_t *rows, int64_t m, float *vals, int64_t *kept, float *least) {
    for (int64_t r = 0; r < m; r++) {
        const int64_t *f = rows + SAMPLE_FIELDS * r;
        float sc, alpha;
        uint32_t bits = (uint32_t)f[2];
        memcpy(&sc, &bits, 4);
        bits = (uint32_t)f[9];
        memcpy(&alpha, &bits, 4);
        int64_t *idx = (int64_t *)(intptr_t)f[5];
        kept[r] = gs_bernoulli((const float *)(intptr_t)f[0], f[1], sc, (uint64_t)f[3], idx, f[4]);
        least[r] = INFINITY;
        if (kept[r] > f[4]) continue;
        least[r] = sweep_sampled(idx, kept[r], (const float *)(intptr_t)f[6], vals, (uint8_t *)(intptr_t)f[7],
                                 (float *)(intptr_t)f[8], alpha, (float *)(intptr_t)f[10], (const float *)(intptr_t)f[11],
                                 (float *)(intptr_t)f[12], (float *)(intptr_t)f[13]);
        vals += kept[r];
    }
}

/* gs_subtract_at: acc[idx[j]] -= vals[j] for j < k (as torch's index_add_ with alpha -1: acc + (-vals[j])), and with
 * zero, zero[idx[j]] = 0 in the same sweep (momentum correction's masking of u where v was sent). */
void gs_subtract_at(float *acc, const int64_t *idx, const float *vals, int64_t k, float *zero) {
    for (int64_t j = 0; j < k; j++) {
        const int64_t i = idx[j];
        acc[i] = acc[i] + (-vals[j]);
        if (zero) zero[i] = 0.0f;
    }
}

/* out[start + idx[j]] += value j for j < c, in order (v: float32 values, or bfloat16 ones made float32 exactly:
 * code 1; read byte by byte, so they need not be aligned), each position written to at from at[w]: torch's
 * index_add_ of the values made float32, one rounding an entry. Returns the next w. */
static inline int64_t add_values(float *out, int64_t start, const int64_t *idx, const uint8_t *v, int64_t code,
                                 int64_t c, int64_t *at, int64_t w) {
    if (code == 1) {
        for (int64_t j = 0; j < c; j++) {
            uint16_t b;
            memcpy(&b, v + 2 * j, 2);
            const uint32_t bits = (uint32_t)b << 16;
            float f;
            memcpy(&f, &bits, 4);
            const int64_t p = start + idx[j];
            out[p] = out[p] + f;
            if (at) at[w++] = p;
        }
    } else {
        for (int64_t j = 0; j < c; j++) {
            float f;
            memcpy(&f, v + 4 * j, 4);
            const int64_t p = start + idx[j];
            out[p] = out[p] + f;
            if (at) at[w++] = p;
        }
    }
    return w;
}

/* gs_add_segments: for m rows of ADD_FIELDS int64s in order -- count, start, universe, the indices' address (int64),
 * the values' address, their code (0 float32, 1 bfloat16) -- out[start + idx[j]] += value j for j < count, in order,
 * each position written to at (in the same order): torch's index_add_ of the values made float32 (exactly), one
 * rounding an entry. Returns 0, or 1 + the first row holding an index outside [0, universe) (nothing of that row
 * added). */
#define ADD_FIELDS 6

int64_t gs_add_segments(float *out, const int64_t *rows, int64_t m, int64_t *at) {
    int64_t w = 0;
    for (int64_t s = 0; s < m; s++) {
        const int64_t *r = rows + s * ADD_FIELDS;
        const int64_t c = r[0], start = r[1], universe = r[2], code = r[5];
        const int64_t *idx = (const int64_t *)r[3];
        for (int64_t j = 0; j < c; j++)
            if (idx[j] < 0 || idx[j] >= universe) return 1 + s;
        w = add_values(out, start, idx, (const uint8_t *)r[4], code, c, at, w);
    }
    return 0;
}

/* gs_div_at: out[p] = out[p] / d once for every distinct position p of at[0..m) (positions repeat where several
 * workers sent an entry), each p in [0, universe): the division torch's div_ makes, written once. done: a bitmap of
 * at least (universe + 63) / 64 words, all zero; the positions' words are zeroed again before returning, so the
 * caller keeps one between calls (no fresh allocation, no page faults). */
void gs_div_at(float *out, const int64_t *at, int64_t m, float d, uint64_t *done) {
    for (int64_t j = 0; j < m; j++) {
        const int64_t p = at[j];
        const uint64_t bit = (uint64_t)1 << (p & 63);
        if (!(done[p >> 6] & bit)) {
            done[p >> 6] |= bit;
            out[p] = out[p] / d;
        }
    }
    for (int64_t j = 0; j < m; j++) done[at[j] >> 6] = 0;
}

/* gs_add_at_many: for m rows of ADD_AT_FIELDS int64s in order -- count, universe, the float32 memory's address, the
 * int64 indices' address, the float32 values' address -- mem[idx[j]] += vals[j] for j < count, in order: torch's
 * index_add_, one rounding an entry; where the values' address is 0, mem[idx[j]] = 0 instead (index_fill_: momentum
 * correction's masking of u where a group's entries were sent). Returns 0, or 1 + the first row holding an index
 * outside [0, universe) (nothing of that row written). */
#define ADD_AT_FIELDS 5

int64_t gs_add_at_many(const int64_t *rows, int64_t m) {
    for (int64_t s = 0; s < m; s++) {
        const int64_t *r = rows + s * ADD_AT_FIELDS;
        const int64_t c = r[0], universe = r[1];
        float *mem = (float *)r[2];
        const int64_t *idx = (const int64_t *)r[3];
        const float *v = (const float *)r[4];
        for (int64_t j = 0; j < c; j++)
            if (idx[j] < 0 || idx[j] >= universe) return 1 + s;
        if (!v)
            for (int64_t j = 0; j < c; j++) mem[idx[j]] = 0.0f;
        else
            for (int64_t j = 0; j < c; j++) mem[idx[j]] = mem[idx[j]] + v[j];
    }
    return 0;
}

/* gs_gather_many: for m rows of ADD_AT_FIELDS int64s -- count, universe, the float32 source's address, the int64
 * positions' address, the output offset --, out[at + j] = src[idx[j]] for j < count (torch's index_select), and
 * ascending[r] = 1 where the row's positions ascend strictly (else 0). Every row is checked first: returns 1 + the
 * first row holding a position outside [0, universe) (nothing written), else 0. */
int64_t gs_gather_many(const int64_t *rows, int64_t m, float *out, int64_t *ascending) {
    for (int64_t s = 0; s < m; s++) {
        const int64_t *r = rows + s * ADD_AT_FIELDS;
        const int64_t *idx = (const int64_t *)r[3];
        int64_t up = 1;
        for (int64_t j = 0; j < r[0]; j++) {
            if (idx[j] < 0 || idx[j] >= r[1]) return 1 + s;
            up &= j == 0 || idx[j] > idx[j - 1];
        }
        ascending[s] = up;
    }
    for (int64_t s = 0; s < m; s++) {
        const int64_t *r = rows + s * ADD_AT_FIELDS;
        const float *src = (const float *)r[2];
        const int64_t *idx = (const int64_t *)r[3];
        float *o = out + r[4];
        for (int64_t j = 0; j < r[0]; j++) o[j] = src[idx[j]];
    }
    return 0;
}

/* gs_cast_bf16_many: a group's sparse values cast for the wire in bf16, what the cast rounds off put back into memory:
 * for m rows of ADD_AT_FIELDS int64s as gs_add_at_many's, then the output offset, out[at + j] = bf16_bits(v[j])
 * (finite values: Compressor.wire's cast) and mem[idx[j]] = mem[idx[j]] + (v[j] - bf16(v[j])) (the subtraction and
 * the index_add_ of memory/wirecast.py's cast_many_for_wire, the same roundings). Every row is checked first: returns
 * 1 + the first row holding an index outside [0, universe), or -1 where a value is NaN or Inf (then nothing is
 * written: the caller casts in torch); else 0. */
int64_t gs_cast_bf16_many(const int64_t *rows, int64_t m, uint16_t *out) {
    for (int64_t s = 0; s < m; s++) {
        const int64_t *r = rows + s * (ADD_AT_FIELDS + 1);
        const int64_t *idx = (const int64_t *)r[3];
        const uint32_t *u = (const uint32_t *)r[4];
        for (int64_t j = 0; j < r[0]; j++) {
            if (idx[j] < 0 || idx[j] >= r[1]) return 1 + s;
            if ((u[j] & 0x7fffffffu) >= 0x7f800000u) return -1;
        }
    }
    for (int64_t s = 0; s < m; s++) {
        const int64_t *r = rows + s * (ADD_AT_FIELDS + 1);
        float *mem = (float *)r[2];
        const int64_t *idx = (const int64_t *)r[3];
        const float *v = (const float *)r[4];
        uint16_t *o = out + r[5];
        for (int64_t j = 0; j < r[0]; j++) {
            o[j] = bf16_bits(v[j]);
            mem[idx[j]] = mem[idx[j]] + (v[j] - bf16_value(o[j]));
        }
    }
    return 0;
}

/* gs_pack_segments: write m sparse wire segments into the zeroed uint8 buf, each [int32 count | int32 flag | int64
 * checksum | indices | values] (transport/wire.py's _put, byte for byte), one row of PACK_FIELDS int64s a segment:
 * offset, count, flag, universe, slots, code (0 raw, 1 bitmap, 2 Elias-Fano), index bytes before padding, raw index
 * itemsize (4 or 8), value bytes (2 or 4), Elias-Fano's low bits L, the indices' address (int64, distinct), the
 * values' address, the bytes to copy from there into the value part and the value part's bytes before padding (for
 * values below 16 bits, transport/wire.py hands over the coded part whole; its indices come sorted). Coded indices
 * are written sorted, their values reordered with them; raw ones as given. The
 * checksum: the segment's bytes after the header as int32 words times their position (1, 2, ...), summed with
 * wrapping, plus count * 1000003 + flag * 7. Returns 0, or 1 + the segment that could not get scratch memory. */
#define PACK_FIELDS 14

typedef struct { int64_t i; int64_t j; } gs_pair;

static int gs_pair_less(const void *a, const void *b) {
    const int64_t x = ((const gs_pair *)a)->i, y = ((const gs_pair *)b)->i;
    return (x > y) - (x < y);
}

static inline void gs_set_bit(uint8_t *out, int64_t p) { out[p >> 3] |= (uint8_t)(1u << (p & 7)); }

static inline int64_t gs_pad8(int64_t n) { return (n + 7) / 8 * 8; }

/* A segment's checksum (transport/wire.py's checksum): its body's int32 words times their position (1, 2, ...),
 * summed with wrapping, plus count * 1000003 + flag * 7. */
static uint64_t gs_checksum(const uint8_t *body, int64_t nbytes, int64_t count, int64_t flag) {
    uint64_t total = 0;
    for (int64_t w = 0; w < nbytes / 4; w++) {
        int32_t word;
        memcpy(&word, body + 4 * w, 4);
        total += (uint64_t)(int64_t)word * (uint64_t)(w + 1);
    }
    return total + (uint64_t)count * 1000003ull + (uint64_t)flag * 7ull;
}

int gs_pack_segments(uint8_t *buf, const int64_t *rows, int64_t m) {
    for (int64_t s = 0; s < m; s++) {
        const int64_t *r = rows + s * PACK_FIELDS;
        const int64_t off = r[0], c = r[1], flag = r[2], slots = r[4], code = r[5], nb = r[6];
        const int64_t isz = r[7], vsz = r[8], low = r[9], vcopy = r[12], vpart = r[13];
        const int64_t *idx = (const int64_t *)(intptr_t)r[10];
        const uint8_t *val = (const uint8_t *)(intptr_t)r[11];
        uint8_t *seg = buf + off, *ix = seg + 16, *vx = ix + gs_pad8(nb);
        int32_t head[2] = {(int32_t)c, (int32_t)flag};
        memcpy(seg, head, 8);
        gs_pair *order = NULL;
        if (c && code != 0) {  /* coded indices travel sorted */
            int sorted = 1;
            for (int64_t j = 1; j < c && sorted; j++) sorted = idx[j] > idx[j - 1];
            if (!sorted) {
                order = (gs_pair *)malloc((size_t)c * sizeof(gs_pair));
                if (!order) return (int)(s + 1);
                for (int64_t j = 0; j < c; j++) order[j].i = idx[j], order[j].j = j;
                qsort(order, (size_t)c, sizeof(gs_pair), gs_pair_less);
            }
        }
#define GS_IDX(j) (order ? order[j].i : idx[j])
        if (c && code == 0) {
            if (isz == 8) memcpy(ix, idx, (size_t)c * 8);
            else for (int64_t j = 0; j < c; j++) { int32_t v = (int32_t)idx[j]; memcpy(ix + 4 * j, &v, 4); }
        } else if (c && code == 1) {
            for (int64_t j = 0; j < c; j++) gs_set_bit(ix, GS_IDX(j));
        } else if (c) {
            const int64_t planes = low / 8, rest = low % 8;
            const int64_t lo = planes * slots + (slots * rest + 7) / 8;
            /* the rest bits of entry j at bits j rest .. of their plane, lowest first: a little-endian bit stream
             * into the zeroed buffer, a byte written as it fills (not a bit at a time) */
            uint8_t *rb = ix + planes * slots;
            uint64_t acc = 0;
            int nbits = 0;
            for (int64_t j = 0; j < c; j++) {
                const int64_t i = GS_IDX(j);
                const uint64_t l = (uint64_t)i & ((low < 64 ? (1ull << low) : 0) - 1);
                for (int64_t p = 0; p < planes; p++) ix[p * slots + j] = (uint8_t)((l >> (8 * p)) & 255);
                if (rest) {
                    acc |= (l >> (low - rest)) << nbits;
                    nbits += (int)rest;
                    if (nbits >= 8) {
                        *rb++ = (uint8_t)(acc & 255);
                        acc >>= 8;
                        nbits -= 8;
                    }
                }
                gs_set_bit(ix + lo, (i >> low) + j);
            }
            if (nbits > 0) *rb = (uint8_t)(acc & 255);
        }
        if (c) {
            if (order) for (int64_t j = 0; j < c; j++) memcpy(vx + j * vsz, val + order[j].j * vsz, (size_t)vsz);
            else memcpy(vx, val, (size_t)vcopy);
        }
#undef GS_IDX
        free(order);
        const uint64_t total = gs_checksum(ix, gs_pad8(nb) + gs_pad8(vpart), c, flag);
        memcpy(seg + 8, &total, 8);
    }
    return 0;
}

/* gs_unpack_segments: read m segments gs_pack_segments wrote, one row of UNPACK_FIELDS int64s a segment: offset,
 * universe, slots, code, index bytes before padding, raw index itemsize, the value part's bytes before padding,
 * Elias-Fano's L, and where in
 * out_idx its indices go (it has room for slots of them). Per segment, into status[3 s .. 3 s + 2]: count, flag, and
 * 0 when the segment is whole (a count within the slots and a 0/1 flag, the checksum, indices that decode to exactly
 * count, increasing where coded, inside [0, universe)), else 1 (the caller reads that segment again to say why). */
#define UNPACK_FIELDS 9

static inline int gs_bit(const uint8_t *data, int64_t p) { return (data[p >> 3] >> (p & 7)) & 1; }

/* One segment of gs_unpack_segments: row r (its field 8 unused here), the indices into idx, st as there. */
static void unpack_one(const uint8_t *buf, const int64_t *r, int64_t *idx, int64_t *st) {
    const int64_t off = r[0], universe = r[1], slots = r[2], code = r[3], nb = r[4], isz = r[5], vpart = r[6];
    const int64_t low = r[7];
    const uint8_t *seg = buf + off, *ix = seg + 16;
    int32_t head[2];
    int64_t sent;
    memcpy(head, seg, 8);
    memcpy(&sent, seg + 8, 8);
    const int64_t c = head[0], flag = head[1];
    st[0] = c, st[1] = flag, st[2] = 1;
    if (c < 0 || c > slots || flag < 0 || flag > 1) return;
    if ((int64_t)gs_checksum(ix, gs_pad8(nb) + gs_pad8(vpart), c, flag) != sent) return;
    int ok = 1;
    if (code == 0) {
        for (int64_t j = 0; j < c; j++) {
            int64_t v;
            if (isz == 8) memcpy(&v, ix + 8 * j, 8);
            else { int32_t w; memcpy(&w, ix + 4 * j, 4); v = w; }
            if (v < 0 || v >= universe) { ok = 0; break; }
            idx[j] = v;
        }
    } else if (code == 1) {
        int64_t n = 0;
        for (int64_t p = 0; p < nb * 8 && ok; p++)
            if (gs_bit(ix, p)) {
                if (n >= c || p >= universe) ok = 0;
                else idx[n++] = p;
            }
        ok = ok && n == c;
    } else {
        const int64_t planes = low / 8, rest = low % 8;
        const int64_t lo = planes * slots + (slots * rest + 7) / 8;
        const int64_t upper = ((universe > 1 ? universe : 1) - 1 >> low) + slots;
        int64_t n = 0;
        const uint8_t *hb = ix + lo;
        for (int64_t q = 0; q < upper && ok; q += 64) { /* 64 bits at a time, the set ones off the word */
            uint64_t w = 0;
            const int64_t bytes = (upper - q + 7) / 8 < 8 ? (upper - q + 7) / 8 : 8;
            for (int64_t b = 0; b < bytes; b++) w |= (uint64_t)hb[q / 8 + b] << (8 * b); /* (one load, on x86) */
            if (upper - q < 64) w &= ((uint64_t)1 << (upper - q)) - 1;
            while (w) {
                const int64_t p = q + __builtin_ctzll(w);
                w &= w - 1;
                if (n >= c) { ok = 0; break; }
                idx[n] = (p - n) << low, n++;
            }
        }
        ok = ok && n == c;
        for (int64_t j = 0; j < c && ok; j++) {
            uint64_t l = 0;
            for (int64_t p = 0; p < planes; p++) l |= (uint64_t)ix[p * slots + j] << (8 * p);
            if (rest) { /* the rest bits at bit j * rest, little-endian: one 8-byte read (inside the segment: the
                         * upper bits, padding and a value part of at least 8 bytes follow them) */
                const int64_t bit = j * rest;
                uint64_t word;
                memcpy(&word, ix + planes * slots + (bit >> 3), 8);
                l |= ((word >> (bit & 7)) & (((uint64_t)1 << rest) - 1)) << (low - rest);
            }
            idx[j] |= (int64_t)l;
            if (idx[j] >= universe || (j && idx[j] <= idx[j - 1])) ok = 0;
        }
    }
    st[2] = ok ? 0 : 1;
}

void gs_unpack_segments(const uint8_t *buf, const int64_t *rows, int64_t m, int64_t *out_idx, int64_t *status) {
    for (int64_t s = 0; s < m; s++) {
        const int64_t *r = rows + s * UNPACK_FIELDS;
        unpack_one(buf, r, out_idx + r[8], status + 3 * s);
    }
}

/* gs_add_gathered: the whole of a gather route's delivery in one call. bufs: n rows of row_bytes, rank r's gathered
 * buffer in row r. Its m segments are read with gs_unpack_segments' rows (field 1: the tensor's size; field 8
 * unused) and each segment's ADD_GATHERED_FIELDS: where its tensor starts in out, its values' code (0 float32, 1
 * bfloat16) and where its value part starts from the segment's start. out (out_n entries) ends up zero but for the
 * sums: segment after segment in the order of their places in out, the stretch before it and its tensor are zeroed,
 * then every rank's part of it is added, rank after rank -- its indices decoded into scratch (room for the most slots
 * of any segment), out[start + idx[j]] += value j made float32 (one rounding an entry: torch's index_add_, as
 * gs_add_segments), each position written to at. Every entry's adds run in rank order, as rank after rank over the
 * whole buffer would, while its tensor is in cache from the zeroing. status[3 (r m + s) ..]: count, flag, and
 * whether the segment is whole, as gs_unpack_segments. With div > 0, each tensor is then divided by div where it
 * is (the mean: what gs_div_at does at the positions written, as 0 / div is 0), and at may be NULL (not written).
 * Returns how many positions were written; -(1 + r m + s) at the first segment found not whole; -(1 + n m) when
 * memory for the order ran out. */
#define ADD_GATHERED_FIELDS 3

static int gs_start_less(const void *a, const void *b) { /* (start, segment) pairs, by start */
    const int64_t *x = (const int64_t *)a, *y = (const int64_t *)b;
    return x[0] < y[0] ? -1 : (x[0] > y[0] ? 1 : (x[1] < y[1] ? -1 : x[1] > y[1]));
}

int64_t gs_add_gathered(const uint8_t *bufs, int64_t n, int64_t row_bytes, const int64_t *rows, const int64_t *adds,
                        int64_t m, int64_t *scratch, float *out, int64_t out_n, int64_t *at, int64_t *status,
                        float div) {
    int64_t *order = (int64_t *)malloc((size_t)(2 * (m > 0 ? m : 1)) * sizeof(int64_t));
    if (!order) return -(1 + n * m);
    for (int64_t s = 0; s < m; s++) {
        order[2 * s] = adds[s * ADD_GATHERED_FIELDS];
        order[2 * s + 1] = s;
    }
    qsort(order, (size_t)m, 2 * sizeof(int64_t), gs_start_less);
    int64_t w = 0, done = 0; /* out[0..done) is settled: zeroed, or holding its sums */
    for (int64_t o = 0; o < m; o++) {
        const int64_t s = order[2 * o + 1];
        const int64_t *u = rows + s * UNPACK_FIELDS, *a = adds + s * ADD_GATHERED_FIELDS;
        const int64_t start = a[0], end = start + u[1];
        if (end > done) {
            const int64_t from = start > done ? done : start; /* (the stretch before it, then the tensor) */
            memset(out + from, 0, (size_t)(end - from) * sizeof(float));
            done = end;
        }
        for (int64_t r = 0; r < n; r++) {
            const uint8_t *buf = bufs + r * row_bytes;
            int64_t *st = status + 3 * (r * m + s);
            unpack_one(buf, u, scratch, st);
            if (st[2]) {
                free(order);
                return -(1 + r * m + s);
            }
            w = add_values(out, start, scratch, buf + u[0] + a[2], a[1], st[0], at, w);
        }
        if (div > 0.0f) /* the mean: every entry of the tensor over div, while it is in cache (0 / div stays 0) */
            for (int64_t p = start; p < end; p++) out[p] = out[p] / div;
    }
    free(order);
    if (out_n > done) memset(out + done, 0, (size_t)(out_n - done) * sizeof(float));
    return w;
}

/* gs_adam_many: Adam's direction for m tensors (memory/adam.py's AdamDirection, its torch form: kernels/adam.py), one
 * pass over each instead of twenty, up to the square root. rows: m rows of ADAM_FIELDS int64: entries, then the
 * addresses of the gradient, m in, m out, v in, v out, w in, w out (0: scale=worker) (outs may equal ins: in
 * place), and the outputs: the numerator n and the second moment s of d = n / (sqrt(s) + eps), which the caller
 * finishes in torch (torch's CPU sqrt is not always the correctly rounded one; it is the same at any position).
 * per: m rows of 3 floats: the gradient's factor (the clip's, else 1), c1 = 1 - b1^t, c2 = 1 - b2^t. k: b1, 1 - b1,
 * b2, 1 - b2, (unused), 1 - r, 1/N - r, nesterov, fused. Each line is the torch operation's arithmetic, scalars rounded to
 * float32 as torch rounds them: x * s, x / s, x - y, sqrt; add_(y, alpha=a) and addcmul_(y, y, value=a) are
 * fmaf(y, a, x) and fmaf(a * y, y, x) where torch's kernels fuse them (``fused``, probed from torch), else two
 * roundings (this file is compiled without contraction). A clamp at 0 keeps NaN, as torch's. */
#define ADAM_FIELDS 10

static inline __attribute__((always_inline)) float gs_mad(float a, float b, float c, const int fused) {
    return fused ? fmaf(a, b, c) : a * b + c;
}

/* One tensor; the flags are constants at each call, so every variant is a loop without branches (vectorized). */
static inline __attribute__((always_inline)) void gs_adam_one(
        const int64_t *row, const float *per, const float *k, const int nesterov, const int mean, const int fused) {
    const float b1 = k[0], a1 = k[1], b2 = k[2], a2 = k[3], keep = k[5], coef = k[6];
    const int64_t n = row[0];
    const float *g = (const float *)row[1], *mi = (const float *)row[2], *vi = (const float *)row[4];
    const float *wi = (const float *)row[6];
    float *mo = (float *)row[3], *vo = (float *)row[5], *wo = (float *)row[7];
    float *num = (float *)row[8], *so = (float *)row[9];
    const float sc = per[0], c1 = per[1], c2 = per[2];
#pragma GCC ivdep
    for (int64_t i = 0; i < n; i++) {  /* (an out array is its in array or disjoint from every other) */
        const float x = g[i] * sc;
        const float mm = gs_mad(x, a1, mi[i] * b1, fused);
        const float vv = gs_mad(a2 * x, x, vi[i] * b2, fused);
        const float mh = mm / c1;
        float s = vv / c2;
        if (mean) {
            const float ww = gs_mad(a2 * mh, mh, wi[i] * b2, fused);
            const float wh = ww / c2;
            float q = s - wh;
            q = q < 0.0f ? 0.0f : q;
            q = q / keep;
            const float e = gs_mad(q, coef, wh, fused);
            s = e < 0.0f ? 0.0f : e;
            wo[i] = ww;
        }
        mo[i] = mm;
        vo[i] = vv;
        num[i] = nesterov ? gs_mad(x, a1, mm * b1, fused) / c1 : mh;
        so[i] = s;
    }
}

void gs_adam_many(const int64_t *rows, const float *per, int64_t m, const float *k) {
    const int nesterov = k[7] != 0.0f, fused = k[8] != 0.0f;
    for (int64_t r = 0; r < m; r++) {
        const int64_t *row = rows + ADAM_FIELDS * r;
        const float *p = per + 3 * r;
        const int mean = row[6] != 0, v = 4 * nesterov + 2 * mean + fused;
        switch (v) {
            case 0: gs_adam_one(row, p, k, 0, 0, 0); break;
            case 1: gs_adam_one(row, p, k, 0, 0, 1); break;
            case 2: gs_adam_one(row, p, k, 0, 1, 0); break;
            case 3: gs_adam_one(row, p, k, 0, 1, 1); break;
            case 4: gs_adam_one(row, p, k, 1, 0, 0); break;
            case 5: gs_adam_one(row, p, k, 1, 0, 1); break;
            case 6: gs_adam_one(row, p, k, 1, 1, 0); break;
            default: gs_adam_one(row, p, k, 1, 1, 1); break;
        }
    }
}

/* ---------------------------------------------------------------- momentum correction's tensors sent whole
 *
 * gs_momentum_whole: for m rows (u, v, g, n) as int64 -- small float32 tensors a route sends whole
 * (gradsift.memory.momentum.MomentumCorrection.send_whole_many) -- u = m u + g, v = v + u (Nesterov: u = (u + g) m,
 * v = (v + u) + g), each operation rounded on its own as torch's foreach calls round it; every v copied into out one
 * after the other (what is sent); where a row's v is all finite, v - v (+0) written back (the memory settled) and
 * finite[r] = 1, else v left as updated and finite[r] = 0 (the caller drops that memory). */
void gs_momentum_whole(const int64_t *rows, int64_t m, float mom, int nesterov, float *out, int64_t *finite) {
    for (int64_t r = 0; r < m; r++) {
        float *u = (float *)(intptr_t)rows[4 * r], *v = (float *)(intptr_t)rows[4 * r + 1];
        const float *g = (const float *)(intptr_t)rows[4 * r + 2];
        const int64_t n = rows[4 * r + 3];
        uint32_t all = 0; /* (the exponent bits of every non-finite value: 0x7f800000 there) */
        for (int64_t q = 0; q < n; q++) {
            const float uq = nesterov ? (u[q] + g[q]) * mom : u[q] * mom + g[q];
            const float vq = nesterov ? (v[q] + uq) + g[q] : v[q] + uq;
            u[q] = uq, v[q] = vq, out[q] = vq;
            union { float f; uint32_t b; } w = {vq};
            all |= ((w.b & 0x7f800000u) == 0x7f800000u) ? 1u : 0u;
        }
        finite[r] = !all;
        if (!all)
            for (int64_t q = 0; q < n; q++) v[q] = v[q] - out[q];
        out += n;
    }
}

/* ---------------------------------------------------------------- two figures of a gradient, one read
 *
 * gs_figures_many: for m float32 tensors (ptrs[r], ns[r] entries), each one's sum of squares in double (sixteen
 * running sums over the entries' positions mod 16, then added in order: a fixed order, so the same entries give the
 * same bits) into sq[r], and its largest entry into top[r] (NaN where one is NaN; -Inf for none). What
 * gradsift.runtime.gradwatch records of the gradients the hook wrote and reads again at the optimizer's step: one
 * pass where torch's foreach norm and max took two. */
#define FIG_LANES 16
static void figures_one(const float *x, int64_t n, double *sq, float *top) {
    double acc[FIG_LANES];
    float hi[FIG_LANES];
    int nan = 0;
    int64_t i = 0;
#if defined(__AVX2__)
    __m256d a0 = _mm256_setzero_pd(), a1 = a0, a2 = a0, a3 = a0;
    __m256 h0 = _mm256_set1_ps(-INFINITY), h1 = h0, bad = _mm256_setzero_ps();
    for (; i + FIG_LANES <= n; i += FIG_LANES) {
        const __m256 v0 = _mm256_loadu_ps(x + i), v1 = _mm256_loadu_ps(x + i + 8);
        const __m256d d0 = _mm256_cvtps_pd(_mm256_castps256_ps128(v0));
        const __m256d d1 = _mm256_cvtps_pd(_mm256_extractf128_ps(v0, 1));
        const __m256d d2 = _mm256_cvtps_pd(_mm256_castps256_ps128(v1));
        const __m256d d3 = _mm256_cvtps_pd(_mm256_extractf128_ps(v1, 1));
        a0 = _mm256_add_pd(a0, _mm256_mul_pd(d0, d0)), a1 = _mm256_add_pd(a1, _mm256_mul_pd(d1, d1));
        a2 = _mm256_add_pd(a2, _mm256_mul_pd(d2, d2)), a3 = _mm256_add_pd(a3, _mm256_mul_pd(d3, d3));
        h0 = _mm256_max_ps(v0, h0), h1 = _mm256_max_ps(v1, h1); /* (a NaN in v leaves h: it is counted below) */
        bad = _mm256_or_ps(bad, _mm256_cmp_ps(v0, v0, _CMP_UNORD_Q));
        bad = _mm256_or_ps(bad, _mm256_cmp_ps(v1, v1, _CMP_UNORD_Q));
    }
    _mm256_storeu_pd(acc, a0), _mm256_storeu_pd(acc + 4, a1);
    _mm256_storeu_pd(acc + 8, a2), _mm256_storeu_pd(acc + 12, a3);
    _mm256_storeu_ps(hi, h0), _mm256_storeu_ps(hi + 8, h1);
    nan = _mm256_movemask_ps(bad) != 0;
#else
    for (int j = 0; j < FIG_LANES; j++) acc[j] = 0.0, hi[j] = -INFINITY;
    for (; i + FIG_LANES <= n; i += FIG_LANES)
        for (int j = 0; j < FIG_LANES; j++) {
            const float v = x[i + j];
            acc[j] += (double)v * (double)v;
            hi[j] = v > hi[j] ? v : hi[j];
            nan |= v != v;
        }
#endif
    for (int j = 0; i < n; i++, j++) { /* the tail: lanes 0, 1, ... */
        const float v = x[i];
        acc[j] += (double)v * (double)v;
        hi[j] = v > hi[j] ? v : hi[j];
        nan |= v != v;
    }
    double total = 0.0;
    float most = -INFINITY;
    for (int j = 0; j < FIG_LANES; j++) {
        total += acc[j];
        most = hi[j] > most ? hi[j] : most;
    }
    *sq = total;
    *top = nan ? NAN : most;
}

void gs_figures_many(const int64_t *ptrs, const int64_t *ns, int64_t m, double *sq, float *top) {
    for (int64_t r = 0; r < m; r++) figures_one((const float *)(intptr_t)ptrs[r], ns[r], sq + r, top + r);
}

int gs_abi_version(void) { return 40; }
