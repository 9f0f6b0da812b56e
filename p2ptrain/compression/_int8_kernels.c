/* Fused CPU kernels for the blockwise-absmax int8 codec (p2ptrain/compression/int8.py has the
 * format and p2ptrain/compression/kernels.py the Python side, which validates every argument).
 *
 * Why C: in torch ops an int8 encode is five passes over the chunk (amax, amin, multiply, round,
 * cast) and a decode-add three; in a round those passes, not the socket, are most of an int8
 * member's time. Here each kernel is one pass over memory: the encode reads 16 blocks (16 KiB of
 * float32) for their absmaxes and reads them again from L1 to quantise them. Results are
 * bit-identical to the torch path for encode and decode (the same float32 operations in the same
 * order, no FMA contraction: setup.py passes -ffp-contract=off); decode-add may differ from torch's
 * addcmul, which fuses its multiply-add on some CPUs, by one rounding.
 *
 * Pointers arrive as integers (tensor.data_ptr()) and every kernel releases the GIL, so the round's
 * worker thread runs them beside the event loop. On x86-64 with glibc and GCC >= 12 each kernel is
 * built for three ISA levels and picked at load time (target_clones); elsewhere the compiler's
 * autovectorisation of the plain loops applies.
 *
 * On many-core hosts a call over split_min values or more runs in parts at once on split_threads
 * threads (set_threads; the caller's thread runs the first part, a small pool of POSIX threads the
 * others), all under the one release of the GIL: threads that took the GIL back per part waited for
 * it behind the event loop. Parts are whole groups of blocks (or copy pieces), so the bits are the
 * same as one call's. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#ifndef _WIN32
#include <pthread.h>
#define HAVE_SPLIT 1
#endif

#ifdef _MSC_VER
#define restrict __restrict
#define ALWAYS_INLINE __forceinline
#else
#define ALWAYS_INLINE inline __attribute__((always_inline))
#endif

#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12 && defined(__x86_64__) && defined(__GLIBC__)
#define MULTI __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define MULTI
#endif

/* Streaming stores (see decode_f32_stream): x86-64 with GCC or clang, picked at run time (AVX2) */
#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
#define HAVE_STREAM 1
#define STREAM_TARGET __attribute__((target("avx2")))
#endif
static int can_stream; /* set at import: this CPU runs the streaming kernels */

/* independent max lanes: integer max reductions vectorise without reassociating anything */
#define LANES 16
#define ABS_BITS 0x7fffffffu
#define INF_BITS 0x7f800000u
static const float TINY = 7.888609052210118e-31f; /* 2**-100, int8.py's _TINY */
static const float MAGIC = 12582912.0f;           /* 1.5 * 2**23 */

/* max |x| as a bit pattern. For non-negative floats the bit patterns order as the values do, and
 * inf (INF_BITS) and every NaN (above it) order above every finite value: one integer max both
 * finds the absmax and flags NaN/inf, where float max would have to special-case NaN. */
static ALWAYS_INLINE uint32_t absmax_bits(const float *restrict x, int64_t n) {
    const uint32_t *xi = (const uint32_t *)x;
    uint32_t m[LANES] = {0}, mm = 0;
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int l = 0; l < LANES; l++) {
            uint32_t a = xi[i + l] & ABS_BITS;
            m[l] = a > m[l] ? a : m[l];
        }
    for (; i < n; i++) {
        uint32_t a = xi[i] & ABS_BITS;
        mm = a > mm ? a : mm;
    }
    for (int l = 0; l < LANES; l++) mm = m[l] > mm ? m[l] : mm;
    return mm;
}

#define GROUP 16 /* blocks whose scales are computed together: 16 KiB of float32 at block 256 */

/* A group's scales from its blocks' absmax bit patterns: sc = step * mult (what is sent), inv =
 * 1 / step, step = max(absmax, TINY) / 127; the divisions vectorised across the group. */
static ALWAYS_INLINE void group_scales(const uint32_t *bits, float mult, float *sc, float *inv) {
    float absmax[GROUP];
    memcpy(absmax, bits, sizeof(float) * GROUP);
    for (int j = 0; j < GROUP; j++) {
        float step = (absmax[j] > TINY ? absmax[j] : TINY) / 127.0f;
        sc[j] = step * mult;
        inv[j] = 1.0f / step;
    }
}

/* One block: q = round(x * iv), ties to even; with dec, also what a receiver decodes, r * c (dec
 * may be x: each value is read before it is written). */
static ALWAYS_INLINE void quantise(const float *x, int64_t len, float iv, float c, int8_t *restrict q, float *dec) {
    if (dec == NULL) {
        for (int64_t i = 0; i < len; i++) q[i] = (int8_t)(int32_t)((x[i] * iv + MAGIC) - MAGIC);
        return;
    }
    for (int64_t i = 0; i < len; i++) {
        float r = (x[i] * iv + MAGIC) - MAGIC;
        q[i] = (int8_t)(int32_t)r;
        dec[i] = r * c;
    }
}

/* Encode n values in blocks: scales[b] = (max(absmax_b, TINY) / 127) * mult, q = round(x / step)
 * as x * (1 / step), ties to even. With dec != NULL also writes what a receiver decodes,
 * (float)q * scales[b], into dec (which may be x itself: each value is read before it is written).
 * Returns 1 on success, 0 (with scales/q/dec partly written) if a value is NaN or inf.
 *
 * Blocks go in groups: the absmaxes of a group first (its 16 KiB then sit in L1), then the two
 * divisions per block as one vector op across the group (one by one, their latency stalled every
 * block), then the quantisation. Measured per 1M cold values: 0.19 -> 0.15 ms, and with dec
 * 0.28 -> 0.17 ms. |x * inv| <= 127.5: adding and subtracting 1.5 * 2**23 rounds to the nearest
 * integer, ties to even (as torch.round does), in plain float arithmetic that vectorises on every
 * ISA level. */
MULTI static int encode_f32(const float *x, int64_t n, int64_t block, float mult,
                            float *restrict scales, int8_t *restrict q, float *dec) {
    int64_t nb = (n + block - 1) / block;
    for (int64_t g = 0; g < nb; g += GROUP) {
        int64_t gn = nb - g < GROUP ? nb - g : GROUP;
        uint32_t bits[GROUP] = {0}; /* lanes past a short last group divide zeros, unused */
        float inv[GROUP], sc[GROUP];
        uint32_t worst = 0;
        for (int64_t j = 0; j < gn; j++) {
            int64_t s = (g + j) * block, len = n - s < block ? n - s : block;
            bits[j] = absmax_bits(x + s, len);
            worst = bits[j] > worst ? bits[j] : worst;
        }
        if (worst >= INF_BITS) return 0;
        group_scales(bits, mult, sc, inv);
        memcpy(scales + g, sc, sizeof(float) * gn);
        for (int64_t j = 0; j < gn; j++) {
            int64_t s = (g + j) * block, len = n - s < block ? n - s : block;
            quantise(x + s, len, inv[j], sc[j], q + s, dec == NULL ? NULL : dec + s);
        }
    }
    return 1;
}

/* absmax_bits is inlined into each ISA clone of its callers; this is its own entry point */
MULTI static uint32_t absmax_bits_all(const float *restrict x, int64_t n) { return absmax_bits(x, n); }

static inline float load_f32(const uint8_t *p) { /* a received buffer's scales may be unaligned */
    float f;
    memcpy(&f, p, 4);
    return f;
}

/* out = (float)q * scale, per block */
MULTI static void decode_f32(const uint8_t *scales, const int8_t *restrict q, int64_t n, int64_t block,
                             float *restrict out) {
    int64_t nb = (n + block - 1) / block;
    for (int64_t b = 0; b < nb; b++) {
        int64_t s = b * block, len = n - s < block ? n - s : block;
        float sc = load_f32(scales + 4 * b);
        const int8_t *qb = q + s;
        float *ob = out + s;
        for (int64_t i = 0; i < len; i++) ob[i] = (float)qb[i] * sc;
    }
}

/* out = src + (float)q * (scale * weight), per block (src may be out itself), returning max |src|
 * as absmax_bits does, from the loads it makes anyway: an owner's first contribution to a chunk
 * reads its own values there, and this is their only check (no separate pass over its shard
 * before the round; see averaging/reducer.py); other callers drop it. The unsigned max
 * reduction may be reordered freely, so the loop still vectorises (versioned for aliasing) and
 * runs as fast as the add alone. */
MULTI static uint32_t decode_add_max_f32(const uint8_t *scales, const int8_t *restrict q, int64_t n, int64_t block,
                                         float weight, const float *src, float *out) {
    uint32_t m = 0;
    int64_t nb = (n + block - 1) / block;
    for (int64_t b = 0; b < nb; b++) {
        int64_t s = b * block, len = n - s < block ? n - s : block;
        float sc = load_f32(scales + 4 * b) * weight;
        const int8_t *qb = q + s;
        const float *sb = src + s;
        float *ob = out + s;
        for (int64_t i = 0; i < len; i++) {
            float v = sb[i];
            uint32_t a;
            memcpy(&a, &v, 4);
            a &= ABS_BITS;
            m = a > m ? a : m;
            ob[i] = v + (float)qb[i] * sc;
        }
    }
    return m;
}

/* An owner's last contribution to a chunk and the chunk's reply in one pass over memory:
 * decode_add_max_f32 (v = src + q_in * (scale * weight), into out; max |src| into *srcmax), then
 * encode_f32 of v (scales_out, q_out; the decoded values back into out), group by group, so that v
 * is quantised from L1 right after it is summed. Why: as two kernels the chunk crossed memory four
 * times (read src, write v; read v, write what receivers decode), here twice. Bit for bit what the
 * two kernels write (the same float32 operations in the same order). out may be src. Every group
 * is summed even after a non-finite one (so *srcmax is the whole chunk's); returns 0 if v holds
 * NaN/inf (scales_out/q_out then partly written), else 1. */
MULTI static int decode_add_encode_f32(const uint8_t *scales_in, const int8_t *restrict q_in, int64_t n,
                                       int64_t block, float weight, const float *src, float *out, float mult,
                                       float *restrict scales_out, int8_t *restrict q_out, uint32_t *srcmax) {
    int64_t nb = (n + block - 1) / block;
    uint32_t m = 0;
    int ok = 1;
    for (int64_t g = 0; g < nb; g += GROUP) {
        int64_t gn = nb - g < GROUP ? nb - g : GROUP;
        uint32_t bits[GROUP] = {0};
        float inv[GROUP], sc[GROUP];
        uint32_t worst = 0;
        for (int64_t j = 0; j < gn; j++) {
            int64_t s = (g + j) * block, len = n - s < block ? n - s : block;
            float w = load_f32(scales_in + 4 * (g + j)) * weight;
            const int8_t *qb = q_in + s;
            const float *sb = src + s;
            float *ob = out + s;
            uint32_t bm = 0;
            for (int64_t i = 0; i < len; i++) {
                float v = sb[i], r = v + (float)qb[i] * w;
                uint32_t a, b;
                memcpy(&a, &v, 4);
                memcpy(&b, &r, 4);
                a &= ABS_BITS;
                b &= ABS_BITS;
                m = a > m ? a : m;
                bm = b > bm ? b : bm;
                ob[i] = r;
            }
            bits[j] = bm;
            worst = bm > worst ? bm : worst;
        }
        if (worst >= INF_BITS) {
            ok = 0;
            continue;
        }
        group_scales(bits, mult, sc, inv);
        memcpy(scales_out + g, sc, sizeof(float) * gn);
        for (int64_t j = 0; j < gn; j++) {
            int64_t s = (g + j) * block, len = n - s < block ? n - s : block;
            quantise(out + s, len, inv[j], sc[j], q_out + s, out + s);
        }
    }
    *srcmax = m;
    return ok;
}

/* dst = src 16 KiB at a time, each piece checked for NaN/inf (from L1) before it is written:
 * returns how many values were copied, n unless a piece holds one. Why here: an uncompressed
 * all-reduce reply is checked and copied into the caller's tensor in one pass (it was a sum pass,
 * then a copy); src and dst do not overlap. */
#define COPY_PIECE 4096
MULTI static int64_t copy_finite_f32(const float *restrict src, float *restrict dst, int64_t n) {
    for (int64_t o = 0; o < n; o += COPY_PIECE) {
        int64_t len = n - o < COPY_PIECE ? n - o : COPY_PIECE;
        if (absmax_bits(src + o, len) >= INF_BITS) return o;
        for (int64_t i = 0; i < len; i++) dst[o + i] = src[o + i]; /* (vectorised; memcpy's rep movsb was slower) */
    }
    return n;
}

/* Streaming stores. A store to a line that is not in the cache first reads that line (read for
 * ownership), so writing a cold output costs two transfers per line; _mm256_stream_ps writes
 * around the cache in one. The right choice when nothing reads the output again before it would
 * have left the cache anyway: a round's decoded result in a tensor larger than the last-level cache
 * (the caller decides: kernels.stream_worthwhile). Measured here per 32M values decoded: 6.1-7.5 ->
 * 4.5-4.9 ms; a checked 4 MiB copy: 5.3-7.0 -> 3.1-3.4 ms. AVX2 only: the stores, not the lanes,
 * bound these loops (AVX-512 measured the same). Results are the same bits as the plain loops. */
#ifdef HAVE_STREAM
/* out[0:len] = q * sc: plain stores up to out's first 32-byte boundary and after the last */
STREAM_TARGET static ALWAYS_INLINE void decode_run_stream(const int8_t *q, int64_t len, float sc, float *out) {
    int64_t i = 0;
    for (; i < len && ((uintptr_t)(out + i) & 31); i++) out[i] = (float)q[i] * sc;
    __m256 s = _mm256_set1_ps(sc);
    for (; i + 8 <= len; i += 8) {
        __m256i v = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + i)));
        _mm256_stream_ps(out + i, _mm256_mul_ps(_mm256_cvtepi32_ps(v), s));
    }
    for (; i < len; i++) out[i] = (float)q[i] * sc;
}

STREAM_TARGET static void decode_f32_stream(const uint8_t *scales, const int8_t *restrict q, int64_t n,
                                            int64_t block, float *restrict out) {
    int64_t nb = (n + block - 1) / block;
    for (int64_t b = 0; b < nb; b++) {
        int64_t s = b * block, len = n - s < block ? n - s : block;
        decode_run_stream(q + s, len, load_f32(scales + 4 * b), out + s);
    }
    _mm_sfence(); /* streaming stores are weakly ordered: done before anyone reads out */
}

STREAM_TARGET static int64_t copy_finite_f32_stream(const float *restrict src, float *restrict dst, int64_t n) {
    int64_t done = n;
    for (int64_t o = 0; o < n; o += COPY_PIECE) {
        int64_t len = n - o < COPY_PIECE ? n - o : COPY_PIECE, i = 0;
        if (absmax_bits(src + o, len) >= INF_BITS) {
            done = o;
            break;
        }
        const float *sp = src + o;
        float *dp = dst + o;
        for (; i < len && ((uintptr_t)(dp + i) & 31); i++) dp[i] = sp[i];
        for (; i + 8 <= len; i += 8) _mm256_stream_ps(dp + i, _mm256_loadu_ps(sp + i));
        for (; i < len; i++) dp[i] = sp[i];
    }
    _mm_sfence();
    return done;
}
#endif

/* ------------------------------------------------------------ big calls in parts on a few threads */

#define MAX_PARTS 16
enum { K_ABSMAX, K_ENCODE, K_DECODE, K_DECODE_STREAM, K_DECODE_ADD, K_DECODE_ADD_ENCODE, K_COPY, K_COPY_STREAM };

/* one kernel call: its arguments, its parts' bounds and their results */
struct call {
    int kind, nparts;
    int64_t n, block;
    float weight, mult;
    const uint8_t *scales_in;
    const int8_t *q_in;
    const float *src;
    float *out, *scales_out;
    int8_t *q_out;
    int64_t bounds[MAX_PARTS + 1];
    uint32_t bits[MAX_PARTS];
    int ok[MAX_PARTS];
    int64_t done[MAX_PARTS];
};

static int split_threads = 1;           /* parts of a big call (1: never split) */
static int64_t split_min = 1 << 18;      /* calls over fewer values are not split */

static void run_part(struct call *c, int i) {
    int64_t a = c->bounds[i], len = c->bounds[i + 1] - a, sb = c->block ? a / c->block : 0;
    switch (c->kind) {
    case K_ABSMAX: c->bits[i] = absmax_bits_all(c->src + a, len); break;
    case K_ENCODE:
        c->ok[i] = encode_f32(c->src + a, len, c->block, c->mult, c->scales_out + sb, c->q_out + a,
                              c->out == NULL ? NULL : c->out + a);
        break;
    case K_DECODE: decode_f32(c->scales_in + 4 * sb, c->q_in + a, len, c->block, c->out + a); break;
    case K_DECODE_ADD:
        c->bits[i] = decode_add_max_f32(c->scales_in + 4 * sb, c->q_in + a, len, c->block, c->weight, c->src + a,
                                        c->out + a);
        break;
    case K_DECODE_ADD_ENCODE:
        c->ok[i] = decode_add_encode_f32(c->scales_in + 4 * sb, c->q_in + a, len, c->block, c->weight, c->src + a,
                                         c->out + a, c->mult, c->scales_out + sb, c->q_out + a, &c->bits[i]);
        break;
    case K_COPY: c->done[i] = copy_finite_f32(c->src + a, c->out + a, len); break;
#ifdef HAVE_STREAM
    case K_DECODE_STREAM: decode_f32_stream(c->scales_in + 4 * sb, c->q_in + a, len, c->block, c->out + a); break;
    case K_COPY_STREAM: c->done[i] = copy_finite_f32_stream(c->src + a, c->out + a, len); break;
#endif
    }
}

#ifdef HAVE_SPLIT
/* The pool: worker k runs part k of each call dispatched (generation), the caller part 0. One
 * call at a time (call_mu): rounds of several hosts in one process queue here, without the GIL. */
static pthread_mutex_t call_mu = PTHREAD_MUTEX_INITIALIZER, pool_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t work_cv = PTHREAD_COND_INITIALIZER, done_cv = PTHREAD_COND_INITIALIZER;
static struct call *current;
static uint64_t generation;
static int workers, ready, remaining;

static void *worker_main(void *arg) {
    int k = (int)(intptr_t)arg;
    pthread_mutex_lock(&pool_mu);
    uint64_t seen = generation;
    ready++;
    pthread_cond_broadcast(&done_cv);
    for (;;) {
        while (generation == seen) pthread_cond_wait(&work_cv, &pool_mu);
        seen = generation;
        struct call *c = current;
        if (c == NULL || k >= c->nparts) continue;
        pthread_mutex_unlock(&pool_mu);
        run_part(c, k);
        pthread_mutex_lock(&pool_mu);
        if (--remaining == 0) pthread_cond_broadcast(&done_cv);
    }
    return NULL;
}

/* with pool_mu held: at least want workers started and waiting (fewer if threads cannot be made) */
static void grow_pool(int want) {
    while (workers < want) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int err = pthread_create(&t, &attr, worker_main, (void *)(intptr_t)(workers + 1));
        pthread_attr_destroy(&attr);
        if (err) break;
        workers++;
    }
    while (ready < workers) pthread_cond_wait(&done_cv, &pool_mu);
}

static void forked_child(void) { /* the pool's threads did not come along */
    pthread_mutex_t m = PTHREAD_MUTEX_INITIALIZER;
    pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
    call_mu = pool_mu = m;
    work_cv = done_cv = cv;
    current = NULL;
    workers = ready = remaining = 0;
}
#endif

/* Split c->n values into up to split_threads parts of whole grains (none if too small); 1 part: one call */
static void plan(struct call *c, int64_t grain) {
    int k = c->n >= split_min ? split_threads : 1;
    int64_t per = (c->n + k - 1) / (k > 0 ? k : 1);
    per = (per + grain - 1) / grain * grain;
    if (per <= 0) per = c->n > 0 ? c->n : 1;
    c->nparts = 0;
    for (int64_t a = 0; a < c->n || c->nparts == 0; a += per) {
        c->bounds[c->nparts++] = a;
        if (c->nparts == MAX_PARTS) break;
    }
    c->bounds[c->nparts] = c->n;
}

/* Run every part of c (no GIL held), all at once where there is more than one. */
static void run_call(struct call *c) {
#ifdef HAVE_SPLIT
    if (c->nparts > 1) {
        pthread_mutex_lock(&call_mu);
        pthread_mutex_lock(&pool_mu);
        grow_pool(c->nparts - 1);
        if (workers < c->nparts - 1) { /* threads could not be made: run the parts here, in turn */
            pthread_mutex_unlock(&pool_mu);
            pthread_mutex_unlock(&call_mu);
            for (int i = 0; i < c->nparts; i++) run_part(c, i);
            return;
        }
        current = c;
        remaining = c->nparts - 1;
        generation++;
        pthread_cond_broadcast(&work_cv);
        pthread_mutex_unlock(&pool_mu);
        run_part(c, 0);
        pthread_mutex_lock(&pool_mu);
        while (remaining > 0) pthread_cond_wait(&done_cv, &pool_mu);
        current = NULL;
        pthread_mutex_unlock(&pool_mu);
        pthread_mutex_unlock(&call_mu);
        return;
    }
#endif
    for (int i = 0; i < c->nparts; i++) run_part(c, i);
}

static uint32_t max_bits(const struct call *c) {
    uint32_t m = 0;
    for (int i = 0; i < c->nparts; i++) m = c->bits[i] > m ? c->bits[i] : m;
    return m;
}

static int all_ok(const struct call *c) {
    for (int i = 0; i < c->nparts; i++)
        if (!c->ok[i]) return 0;
    return 1;
}

static PyObject *bits_to_float(uint32_t bits) {
    if (bits > INF_BITS) return PyFloat_FromDouble(Py_NAN);
    float f;
    memcpy(&f, &bits, 4);
    return PyFloat_FromDouble((double)f);
}

static PyObject *py_absmax(PyObject *self, PyObject *args) {
    unsigned long long x;
    long long n;
    struct call c = {0};
    if (!PyArg_ParseTuple(args, "KL", &x, &n)) return NULL;
    c.kind = K_ABSMAX, c.n = n, c.src = (const float *)(uintptr_t)x;
    plan(&c, COPY_PIECE);
    Py_BEGIN_ALLOW_THREADS
    run_call(&c);
    Py_END_ALLOW_THREADS
    return bits_to_float(max_bits(&c));
}

static PyObject *py_encode(PyObject *self, PyObject *args) {
    unsigned long long x, scales, q, dec;
    long long n, block;
    float mult;
    struct call c = {0};
    if (!PyArg_ParseTuple(args, "KLLfKKK", &x, &n, &block, &mult, &scales, &q, &dec)) return NULL;
    c.kind = K_ENCODE, c.n = n, c.block = block, c.mult = mult, c.src = (const float *)(uintptr_t)x;
    c.scales_out = (float *)(uintptr_t)scales, c.q_out = (int8_t *)(uintptr_t)q, c.out = (float *)(uintptr_t)dec;
    plan(&c, GROUP * block);
    Py_BEGIN_ALLOW_THREADS
    run_call(&c);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(all_ok(&c));
}

/* whether to use the streaming twin: asked for, supported, and float-aligned output */
static int use_stream(int stream, unsigned long long out) { return stream && can_stream && (out & 3) == 0; }

static PyObject *py_decode(PyObject *self, PyObject *args) {
    unsigned long long scales, q, out;
    long long n, block;
    int stream = 0;
    struct call c = {0};
    if (!PyArg_ParseTuple(args, "KKLLK|p", &scales, &q, &n, &block, &out, &stream)) return NULL;
    c.kind = use_stream(stream, out) ? K_DECODE_STREAM : K_DECODE, c.n = n, c.block = block;
    c.scales_in = (const uint8_t *)(uintptr_t)scales, c.q_in = (const int8_t *)(uintptr_t)q;
    c.out = (float *)(uintptr_t)out;
    plan(&c, GROUP * block);
    Py_BEGIN_ALLOW_THREADS
    run_call(&c);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_decode_add(PyObject *self, PyObject *args) {
    unsigned long long scales, q, src, out;
    long long n, block;
    float weight;
    struct call c = {0};
    if (!PyArg_ParseTuple(args, "KKLLfKK", &scales, &q, &n, &block, &weight, &src, &out)) return NULL;
    c.kind = K_DECODE_ADD, c.n = n, c.block = block, c.weight = weight;
    c.scales_in = (const uint8_t *)(uintptr_t)scales, c.q_in = (const int8_t *)(uintptr_t)q;
    c.src = (const float *)(uintptr_t)src, c.out = (float *)(uintptr_t)out;
    plan(&c, GROUP * block);
    Py_BEGIN_ALLOW_THREADS
    run_call(&c);
    Py_END_ALLOW_THREADS
    return bits_to_float(max_bits(&c));
}

static PyObject *py_decode_add_encode(PyObject *self, PyObject *args) {
    unsigned long long scales_in, q_in, src, out, scales_out, q_out;
    long long n, block;
    float weight, mult;
    struct call c = {0};
    if (!PyArg_ParseTuple(args, "KKLLfKKfKK", &scales_in, &q_in, &n, &block, &weight, &src, &out, &mult,
                          &scales_out, &q_out))
        return NULL;
    c.kind = K_DECODE_ADD_ENCODE, c.n = n, c.block = block, c.weight = weight, c.mult = mult;
    c.scales_in = (const uint8_t *)(uintptr_t)scales_in, c.q_in = (const int8_t *)(uintptr_t)q_in;
    c.src = (const float *)(uintptr_t)src, c.out = (float *)(uintptr_t)out;
    c.scales_out = (float *)(uintptr_t)scales_out, c.q_out = (int8_t *)(uintptr_t)q_out;
    plan(&c, GROUP * block);
    Py_BEGIN_ALLOW_THREADS
    run_call(&c);
    Py_END_ALLOW_THREADS
    PyObject *mx = bits_to_float(max_bits(&c));
    if (mx == NULL) return NULL;
    return Py_BuildValue("(NO)", mx, all_ok(&c) ? Py_True : Py_False);
}

static PyObject *py_copy_finite(PyObject *self, PyObject *args) {
    unsigned long long src, dst;
    long long n, done = 0;
    int stream = 0;
    struct call c = {0};
    if (!PyArg_ParseTuple(args, "KKL|p", &src, &dst, &n, &stream)) return NULL;
    c.n = n, c.src = (const float *)(uintptr_t)src, c.out = (float *)(uintptr_t)dst;
    plan(&c, COPY_PIECE);
    Py_BEGIN_ALLOW_THREADS
    if (c.nparts > 1) { /* every part checked first: nothing past the first NaN/inf is written, as in one call */
        c.kind = K_ABSMAX;
        run_call(&c);
        if (max_bits(&c) >= INF_BITS) c.nparts = 1, c.bounds[1] = n;
    }
    c.kind = use_stream(stream, dst) ? K_COPY_STREAM : K_COPY;
    run_call(&c);
    for (int i = 0; i < c.nparts; i++) done += c.done[i];
    Py_END_ALLOW_THREADS
    return PyLong_FromLongLong(done);
}

static PyObject *py_set_threads(PyObject *self, PyObject *args) {
    int threads;
    long long min_values;
    if (!PyArg_ParseTuple(args, "iL", &threads, &min_values)) return NULL;
#ifdef HAVE_SPLIT
    split_threads = threads < 1 ? 1 : threads > MAX_PARTS ? MAX_PARTS : threads;
#endif
    split_min = min_values > 0 ? min_values : 1;
    return PyLong_FromLong(split_threads);
}

static PyMethodDef methods[] = {
    {"absmax", py_absmax, METH_VARARGS, "absmax(x_ptr, n) -> max |x| (inf or nan if any)"},
    {"encode", py_encode, METH_VARARGS,
     "encode(x_ptr, n, block, mult, scales_ptr, q_ptr, dec_ptr or 0) -> False if NaN/inf"},
    {"decode", py_decode, METH_VARARGS, "decode(scales_ptr, q_ptr, n, block, out_ptr, stream=False)"},
    {"decode_add", py_decode_add, METH_VARARGS,
     "decode_add(scales_ptr, q_ptr, n, block, weight, src_ptr, out_ptr) -> max |src| (inf or nan if any)"},
    {"decode_add_encode", py_decode_add_encode, METH_VARARGS,
     "decode_add_encode(scales_in_ptr, q_in_ptr, n, block, weight, src_ptr, out_ptr, mult, scales_out_ptr, "
     "q_out_ptr) -> (max |src|, False if the sum holds NaN/inf)"},
    {"copy_finite", py_copy_finite, METH_VARARGS,
     "copy_finite(src_ptr, dst_ptr, n, stream=False) -> values copied (a multiple of 4096 short of n at the "
     "first NaN/inf)"},
    {"set_threads", py_set_threads, METH_VARARGS,
     "set_threads(threads, min_values) -> threads: calls over min_values values or more run in that many parts "
     "at once (1 where threads are not supported)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_int8_kernels",
                                    "Fused int8 codec kernels (private: use p2ptrain.compression.kernels)",
                                    -1, methods};

PyMODINIT_FUNC PyInit__int8_kernels(void) {
#ifdef HAVE_STREAM
    __builtin_cpu_init();
    can_stream = __builtin_cpu_supports("avx2") != 0;
#endif
#ifdef HAVE_SPLIT
    pthread_atfork(NULL, NULL, forked_child);
#endif
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && (PyModule_AddIntConstant(m, "COPY_PIECE", COPY_PIECE) < 0 ||
                      PyModule_AddIntConstant(m, "CAN_STREAM", can_stream) < 0)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
