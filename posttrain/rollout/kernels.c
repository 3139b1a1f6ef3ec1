/* Fused CPU kernels for one decode step of the fast decoder (posttrain/rollout/llama_decoder.py).
 *
 * Built on first use by posttrain/rollout/kernels.py (cc -O3 -march=native -fopenmp) and called
 * through ctypes. No torch headers, so the build takes about a second. OpenMP resolves to the
 * libgomp that torch has already loaded, so these loops share torch's thread pool and thread count.
 *
 * Why: at 16 rows a decode step spends its time in the weight matmuls and in ~20 small ops per
 * layer around them (norms, rope, cache writes, and tiny batched matmuls for attention that run
 * far below memory bandwidth; timings in docs/rollout.md). Here those are two calls per layer,
 * and rows that share a prompt (the G samples of one prompt) read the prompt's keys and values once.
 *
 * Everything is float32, contiguous in the last dimension. Sums run in float32 in another order
 * than torch's, so results agree with the torch path to float32 rounding, not bit for bit.
 */
#include <math.h>
#include <stdlib.h>
#include <stddef.h>
#include <stdint.h>

/* glibc's vector expf (libmvec), which <math.h> declares only under -ffast-math; it keeps expf's
 * special cases (exp(-inf) = 0), so the -inf of left padding needs no finite-math assumption. */
#if defined(__x86_64__) && defined(__GLIBC__)
__attribute__((__simd__("notinbranch"))) float expf(float);
#endif

/* 16 floats; aligned(4) makes loads and stores through it unaligned ones. */
typedef float v16 __attribute__((vector_size(64), aligned(4)));

/* out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w, for rows of length dim. */
void pt_rms_norm(const float *x, const float *w, float *out, int64_t rows, int64_t dim, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * dim;
        float *o = out + r * dim;
        float s = 0.f;
#pragma omp simd reduction(+ : s)
        for (int64_t i = 0; i < dim; i++) s += xr[i] * xr[i];
        const float inv = 1.f / sqrtf(s / (float)dim + eps);
#pragma omp simd
        for (int64_t i = 0; i < dim; i++) o[i] = xr[i] * inv * w[i];
    }
}

/* ---- Linear layers: out = x @ W^T (+ bias) (+ add), W "blocked" as (ceil(N/16), K, 16). ----
 * A block holds 16 output features for every input feature, so a decode step reads each weight once,
 * front to back. 16 rows of x at a time (transposed to (K, 16), zero-padded) give 16 independent
 * accumulators: one weight vector load feeds 16 FMAs. At 16 rows this runs at the FMA peak and near
 * memory bandwidth, which oneDNN's packed kernel does not (timings in docs/rollout.md). */
static inline __attribute__((always_inline)) void linear_tile(const float *xt, const float *wb, int64_t K,
                                                              v16 acc[16]) {
    v16 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, a4 = {0}, a5 = {0}, a6 = {0}, a7 = {0};
    v16 a8 = {0}, a9 = {0}, a10 = {0}, a11 = {0}, a12 = {0}, a13 = {0}, a14 = {0}, a15 = {0};
    for (int64_t k = 0; k < K; k++) {
        const v16 w = *(const v16 *)(wb + k * 16);
        const float *x = xt + k * 16;
        __builtin_prefetch(wb + k * 16 + 512, 0, 0);  /* 2 KB ahead in the weight stream */
        a0 += x[0] * w; a1 += x[1] * w; a2 += x[2] * w; a3 += x[3] * w;
        a4 += x[4] * w; a5 += x[5] * w; a6 += x[6] * w; a7 += x[7] * w;
        a8 += x[8] * w; a9 += x[9] * w; a10 += x[10] * w; a11 += x[11] * w;
        a12 += x[12] * w; a13 += x[13] * w; a14 += x[14] * w; a15 += x[15] * w;
    }
    acc[0] = a0; acc[1] = a1; acc[2] = a2; acc[3] = a3; acc[4] = a4; acc[5] = a5; acc[6] = a6; acc[7] = a7;
    acc[8] = a8; acc[9] = a9; acc[10] = a10; acc[11] = a11; acc[12] = a12; acc[13] = a13; acc[14] = a14;
    acc[15] = a15;
}

/* The same for a last chunk of at most 8 rows (half the FMAs; xt rows still 16 apart). */
static inline __attribute__((always_inline)) void linear_tile8(const float *xt, const float *wb, int64_t K,
                                                               v16 acc[16]) {
    v16 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, a4 = {0}, a5 = {0}, a6 = {0}, a7 = {0};
    for (int64_t k = 0; k < K; k++) {
        const v16 w = *(const v16 *)(wb + k * 16);
        const float *x = xt + k * 16;
        __builtin_prefetch(wb + k * 16 + 512, 0, 0);
        a0 += x[0] * w; a1 += x[1] * w; a2 += x[2] * w; a3 += x[3] * w;
        a4 += x[4] * w; a5 += x[5] * w; a6 += x[6] * w; a7 += x[7] * w;
    }
    acc[0] = a0; acc[1] = a1; acc[2] = a2; acc[3] = a3; acc[4] = a4; acc[5] = a5; acc[6] = a6; acc[7] = a7;
}

/* x (M, K), w blocked (ceil(N/16), K, 16), bias (N) or NULL, add (M, N) or NULL, out (M, N).
 * Returns 0, or -1 if the scratch for the transposed x cannot be allocated. */
int pt_linear(const float *x, int64_t M, int64_t K, const float *w, int64_t N, const float *bias,
              const float *add, float *out) {
    const int64_t chunks = (M + 15) / 16, blocks = (N + 15) / 16;
    float *xt = aligned_alloc(64, (size_t)(chunks * K * 16) * sizeof(float));
    if (!xt) return -1;
    for (int64_t c = 0; c < chunks; c++)
        for (int64_t k = 0; k < K; k++)
            for (int r = 0; r < 16; r++)
                xt[(c * K + k) * 16 + r] = c * 16 + r < M ? x[(c * 16 + r) * K + k] : 0.f;
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t col = b * 16, width = N - col < 16 ? N - col : 16;
        for (int64_t c = 0; c < chunks; c++) {  /* the block stays in cache across row chunks */
            v16 acc[16];
            const int64_t rows = M - c * 16 < 16 ? M - c * 16 : 16;
            if (rows <= 8)
                linear_tile8(xt + c * K * 16, w + b * K * 16, K, acc);
            else
                linear_tile(xt + c * K * 16, w + b * K * 16, K, acc);
            for (int64_t r = 0; r < rows; r++) {
                const int64_t at = (c * 16 + r) * N + col;
                if (width == 16) {
                    v16 v = acc[r];
                    if (bias) v += *(const v16 *)(bias + col);
                    if (add) v += *(const v16 *)(add + at);
                    *(v16 *)(out + at) = v;
                } else {
                    for (int64_t j = 0; j < width; j++)
                        out[at + j] = acc[r][j] + (bias ? bias[col + j] : 0.f) + (add ? add[at + j] : 0.f);
                }
            }
        }
    }
    free(xt);
    return 0;
}

/* out[r][i] = silu(gu[r][i]) * gu[r][m + i]: the SwiGLU product of a fused gate|up projection. */
void pt_silu_mul(const float *gu, float *out, int64_t rows, int64_t m) {
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = gu + r * 2 * m, *up = gate + m;
        float *o = out + r * m;
#pragma omp simd
        for (int64_t i = 0; i < m; i++) o[i] = gate[i] / (1.f + expf(-gate[i])) * up[i];
    }
}

/* One token per row by inverting the CDF of probs (n, V) in vocabulary order, as
 * posttrain.rollout.sampling.sample_from_probs does in torch: sums of `block` tokens in float64, the
 * block whose cumulative mass first exceeds u * total, then the token inside it. Rounding past the
 * end falls back to the last block / token with mass. tokens (n) int64, totals (n) float64. */
void pt_sample_cdf(const float *probs, int64_t n, int64_t V, int64_t block, const double *uniforms,
                   int64_t *tokens, double *totals) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < n; r++) {
        const float *p = probs + r * V;
        const int64_t blocks = (V + block - 1) / block;
        double total = 0.0;
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t end = (b + 1) * block < V ? (b + 1) * block : V;
            double s = 0.0;
#pragma omp simd reduction(+ : s)
            for (int64_t v = b * block; v < end; v++) s += (double)p[v];
            total += s;
        }
        const double target = uniforms[r] * total;
        double before = 0.0;
        int64_t chosen = -1, last_with_mass = 0;
        for (int64_t b = 0; b < blocks && chosen < 0; b++) {
            const int64_t end = (b + 1) * block < V ? (b + 1) * block : V;
            double s = 0.0;
#pragma omp simd reduction(+ : s)
            for (int64_t v = b * block; v < end; v++) s += (double)p[v];
            if (s > 0.0) last_with_mass = b;
            if (before + s > target) chosen = b;
            else before += s;
        }
        if (chosen < 0) {  /* u * total rounded up to the total */
            chosen = last_with_mass;
            before = 0.0;  /* recompute the mass before it */
            for (int64_t v = 0; v < chosen * block; v++) before += (double)p[v];
        }
        const int64_t start = chosen * block, end = start + block < V ? start + block : V;
        int64_t token = -1, last_positive = start;
        double inside = 0.0;
        for (int64_t v = start; v < end; v++) {
            if (p[v] > 0.f) last_positive = v;
            inside += (double)p[v];
            if (inside > target - before) {
                token = v;
                break;
            }
        }
        if (token < 0) {  /* rounding between the two levels: the block's last token with mass */
            for (int64_t v = last_positive; v < end; v++)
                if (p[v] > 0.f) last_positive = v;
            token = last_positive;
        }
        tokens[r] = token;
        totals[r] = total;
    }
}

typedef struct {
    float *qkv;                 /* (n, (H + 2K) * D): this layer's q|k|v projections, before rope */
    const float *cos;           /* (n, D) */
    const float *sin;           /* (n, D), signed for the roll form: [-sin[:D/2], sin[D/2:]] */
    const float *q_norm;        /* (D) or NULL: per-head RMSNorm before rope (Qwen3) */
    const float *k_norm;        /* (D) or NULL */
    float eps;
    float scale;                /* attention scaling, usually D^-0.5 */
    float *keys;                /* this layer's cache, row r and kv head h at r * row_stride + h * head_stride: */
    float *values;              /*   keys transposed, (D, S): k[j][d] at d * S + j; values (S, D) */
    int64_t row_stride;
    int64_t head_stride;
    int64_t S;                  /* cache columns (capacity), a multiple of 16 */
    const float *key_bias;      /* (n, bias_stride >= S): 0 = attend, -inf = left padding */
    int64_t bias_stride;
    const int32_t *group_start; /* (groups + 1): rows members[group_start[g] .. group_start[g + 1]) */
    const int32_t *members;     /*   have the same cache in columns [0, shared); the first leads */
    int32_t groups;
    int32_t shared;
    int32_t column;             /* the column this step writes; attention reads columns 0..column */
    int32_t H, K, D;
    float *q;                   /* scratch (n, H, D) */
    float *scores;              /* scratch (n, H, scores_stride), scores_stride > column */
    int64_t scores_stride;
    float *out;                 /* (n, H * D) */
} pt_attention_args;

/* For the test that ctypes' mirror of the struct has the same layout. */
int64_t pt_attention_args_size(void) { return sizeof(pt_attention_args); }

static void head_norm(float *x, const float *w, int D, float eps) {
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int i = 0; i < D; i++) s += x[i] * x[i];
    const float inv = 1.f / sqrtf(s / (float)D + eps);
    for (int i = 0; i < D; i++) x[i] = x[i] * inv * w[i];
}

/* dst[i * step] = (x * cos + roll(x, D/2) * sin)[i]: rotate_half with a signed sin. */
static void rope(float *dst, int64_t step, const float *x, const float *cos, const float *sin, int D) {
    const int half = D / 2;
    for (int i = 0; i < half; i++) dst[i * step] = x[i] * cos[i] + x[i + half] * sin[i];
    for (int i = half; i < D; i++) dst[i * step] = x[i] * cos[i] + x[i - half] * sin[i];
}

enum { QB = 4, MAX_D = 512 };  /* queries per tile; largest head_dim */

/* s[i][0:count] = sum_d q[i][d] * keys[d * S + 0:count] for the QB queries of a tile. Keys are
 * stored transposed (D, S): one key row load feeds QB independent FMA chains, no horizontal sums.
 * Always reads 16 columns; callers keep tiles 16-aligned and S is a multiple of 16. */
static void score_tile(float *const s[QB], const float *const q[QB], const float *keys, int64_t S, int D, int count) {
    v16 a[QB] = {{0}};
    for (int d = 0; d < D; d++) {
        const v16 k = *(const v16 *)(keys + d * S);
        for (int i = 0; i < QB; i++) a[i] += q[i][d] * k;
    }
    for (int i = 0; i < QB; i++)
        for (int j = 0; j < count; j++) s[i][j] = a[i][j];
}

/* Two 16-column tiles at once (columns 0..31, count > 16 of them stored): each q[i][d] feeds two
 * FMAs and two key rows are in flight. */
static void score_tile2(float *const s[QB], const float *const q[QB], const float *keys, int64_t S, int D, int count) {
    v16 a[QB] = {{0}}, b[QB] = {{0}};
    for (int d = 0; d < D; d++) {
        const v16 k0 = *(const v16 *)(keys + d * S), k1 = *(const v16 *)(keys + d * S + 16);
        for (int i = 0; i < QB; i++) {
            a[i] += q[i][d] * k0;
            b[i] += q[i][d] * k1;
        }
    }
    for (int i = 0; i < QB; i++) {
        for (int j = 0; j < 16; j++) s[i][j] = a[i][j];
        for (int j = 16; j < count; j++) s[i][j] = b[i][j - 16];
    }
}

/* o[i][0:D] += sum_j p[i][j] * values[j * D + 0:D] over columns j in [0, count); D % 16 == 0.
 * 64 output floats of 4 queries at a time (16 accumulators), so each value row is loaded once. */
static void value_tile(float *const o[QB], const float *const p[QB], const float *values, int D, int count) {
    int dv = 0;
    for (; dv + 64 <= D; dv += 64) {
        v16 a[QB][4] = {{{0}}};
        for (int j = 0; j < count; j++) {
            const float *row = values + (int64_t)j * D + dv;
            const v16 v0 = *(const v16 *)row, v1 = *(const v16 *)(row + 16);
            const v16 v2 = *(const v16 *)(row + 32), v3 = *(const v16 *)(row + 48);
            for (int i = 0; i < QB; i++) {
                const float w = p[i][j];
                a[i][0] += w * v0;
                a[i][1] += w * v1;
                a[i][2] += w * v2;
                a[i][3] += w * v3;
            }
        }
        for (int i = 0; i < QB; i++)
            for (int u = 0; u < 4; u++) *(v16 *)(o[i] + dv + 16 * u) += a[i][u];
    }
    for (; dv < D; dv += 16) {
        v16 a[QB] = {{0}};
        for (int j = 0; j < count; j++) {
            const v16 v = *(const v16 *)(values + (int64_t)j * D + dv);
            for (int i = 0; i < QB; i++) a[i] += p[i][j] * v;
        }
        for (int i = 0; i < QB; i++) *(v16 *)(o[i] + dv) += a[i];
    }
}

/* Scores (columns [first, last)) and weighted values of `nq` queries that read the same cache row
 * (head block `keys`/`values`): in tiles of QB queries, the last tile padded with throwaway ones. */
typedef struct {
    const float *q[QB];
    float *s[QB];
    float *o[QB];
} tile_rows;

static void attend_columns(const pt_attention_args *a, const int64_t *heads, int nq, const float *keys,
                           const float *values, int first, int last, int values_pass) {
    const int D = a->D;
    float junk_s[32], junk_o[MAX_D];
    for (int t = 0; t < nq; t += QB) {
        tile_rows rows;
        for (int i = 0; i < QB; i++) {
            const int64_t head = heads[t + i < nq ? t + i : t];
            rows.q[i] = a->q + head * D;
            rows.s[i] = t + i < nq ? a->scores + head * a->scores_stride : NULL;
            rows.o[i] = t + i < nq ? a->out + head * D : junk_o;
        }
        if (!values_pass) {
            for (int j = first; j < last; j += 32) {
                float *s[QB];
                for (int i = 0; i < QB; i++) s[i] = rows.s[i] ? rows.s[i] + j : junk_s;
                if (last - j > 16)
                    score_tile2(s, rows.q, keys + j, a->S, D, last - j < 32 ? last - j : 32);
                else
                    score_tile(s, rows.q, keys + j, a->S, D, last - j);
            }
        } else {
            const float *p[QB];
            for (int i = 0; i < QB; i++) p[i] = (rows.s[i] ? rows.s[i] : rows.s[0]) + first;
            value_tile(rows.o, p, values + (int64_t)first * D, D, last - first);
        }
    }
}

/* Rope q and k, write k and v into the cache at `column`, then attend over columns 0..column.
 * Scores are accumulated column-wise against the transposed keys (no horizontal sums); a group's
 * shared columns are read from its leading row, so after the first member they come from cache. */
void pt_decode_attention(const pt_attention_args *a) {
    const int H = a->H, K = a->K, D = a->D, rep = H / K, c = a->column;
    const int width = (H + 2 * K) * D;
    const int shared = a->shared < c + 1 ? a->shared : c + 1;
    const int64_t S = a->S, ss = a->scores_stride;

    /* One work item per (group, kv head): rope its query heads and key head, write column c of its
     * rows' cache, attend; items share nothing they write. Whole 16-column tiles below `shared` are read from the
     * group's leading row for every member; the rest from each member's own row (which holds the
     * same values in the shared columns, so the split only changes where they are read from). */
    const int lead_end = shared / 16 * 16;
#pragma omp parallel for schedule(dynamic, 1)
    for (int item = 0; item < a->groups * K; item++) {
        const int g = item / K, kh = item % K;
        const int first = a->group_start[g], last = a->group_start[g + 1];
        int64_t heads[(last - first) * rep];
        for (int m = first; m < last; m++) {  /* this item's query heads, and its column c of the cache */
            const int64_t r = a->members[m];
            float *row = a->qkv + r * width;
            const float *cs = a->cos + r * D, *sn = a->sin + r * D;
            for (int i = 0; i < rep; i++) {
                const int h = kh * rep + i;
                float *x = row + h * D, *q = a->q + (r * H + h) * D;
                heads[(m - first) * rep + i] = r * H + h;
                if (a->q_norm) head_norm(x, a->q_norm, D, a->eps);
                rope(q, 1, x, cs, sn, D);
                for (int d = 0; d < D; d++) q[d] *= a->scale;
            }
            float *x = row + (H + kh) * D;
            if (a->k_norm) head_norm(x, a->k_norm, D, a->eps);
            const int64_t at = r * a->row_stride + kh * a->head_stride;
            rope(a->keys + at + c, S, x, cs, sn, D);
            const float *v = row + (H + K + kh) * D;
            for (int d = 0; d < D; d++) a->values[at + (int64_t)c * D + d] = v[d];
        }
        const int64_t lead = a->members[first] * a->row_stride + kh * a->head_stride;
        attend_columns(a, heads, (last - first) * rep, a->keys + lead, NULL, 0, lead_end, 0);
        for (int m = first; m < last; m++) {
            const int64_t r = a->members[m], own = r * a->row_stride + kh * a->head_stride;
            const float *bias = a->key_bias + r * a->bias_stride;
            attend_columns(a, heads + (m - first) * rep, rep, a->keys + own, NULL, lead_end, c + 1, 0);
            for (int i = 0; i < rep; i++) {  /* softmax over columns 0..c */
                const int64_t head = heads[(m - first) * rep + i];
                float *s = a->scores + head * ss, top = -INFINITY, total = 0.f;
#pragma omp simd reduction(max : top)
                for (int j = 0; j <= c; j++) {
                    s[j] += bias[j];
                    top = s[j] > top ? s[j] : top;
                }
#pragma omp simd
                for (int j = 0; j <= c; j++) s[j] = expf(s[j] - top);
#pragma omp simd reduction(+ : total)
                for (int j = 0; j <= c; j++) total += s[j];
                const float inv = 1.f / total;
#pragma omp simd
                for (int j = 0; j <= c; j++) s[j] *= inv;
                float *o = a->out + head * D;
                for (int d = 0; d < D; d++) o[d] = 0.f;
            }
            attend_columns(a, heads + (m - first) * rep, rep, NULL, a->values + own, lead_end, c + 1, 1);
        }
        attend_columns(a, heads, (last - first) * rep, NULL, a->values + lead, 0, lead_end, 1);
    }
}
