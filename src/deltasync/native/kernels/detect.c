/* deltasync detection kernels (plain C, loaded with ctypes; no Python or torch headers).
 *
 * ds_adamw_detect: for each element, reconstruct the pre-step fp32 value r by inverting one
 * AdamW step, widen it to [r - E, r + E] with the rigorous bound E (see adamw_bound.py), and
 * set bit i of `bits` (OR, never clear) unless both ends and the current value round to the
 * same BF16 bit pattern.  Must be compiled WITHOUT -ffast-math and with -ffp-contract=off:
 * the bound assumes IEEE round-to-nearest for every +, -, *, /, sqrt written here, in this
 * order, and the torch fallback in detect.py performs the identical operations.
 *
 * ds_adamw_detect_list: the same test, writing positions (and BF16 values) instead of bits.
 * ds_adamw_detect_list_cast: the same, and every element's BF16 bits (for the state digest).
 * ds_adamw_detect_list_many: either over several whole parameters in one call.
 * ds_bits_count / ds_bits_to_indices: expand a little-endian bitset into sorted int64 indices.
 * The file also holds the other hot loops on index lists (gathers, casts, the gap code, the
 * receivers' 2-byte scatter, the decoder's plane join); each says what it checks.
 */
#include <stdint.h>
#include <string.h>
#include <math.h>

static inline uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

/* round-to-nearest-even fp32 -> bf16 bits; only used on finite inputs (others are flagged). */
static inline uint32_t bf16_rne(uint32_t x) {
    return (x + 0x7FFFu + ((x >> 16) & 1u)) >> 16;
}

/* The test for element i (one inverted AdamW step, widened by the bound, three BF16 roundings);
 * 1 = may have changed. Shared by both detection kernels so they cannot drift apart. */
static inline uint8_t flag_at(const float *p, const float *m, const float *v, int64_t i,
                              float bc2s, float eps, float step_size, float inv_scale_c,
                              float rel_s, float rel_u, float abs_e) {
    float d = sqrtf(v[i]) / bc2s + eps;
    float u = (m[i] / d) * step_size;
    float s = p[i] + u;
    float r = s * inv_scale_c;
    float e = (fabsf(s) * rel_s + fabsf(u) * rel_u) * inv_scale_c + abs_e;
    float lo = r - e;
    float hi = r + e;
    uint32_t ulo = f2u(lo), uhi = f2u(hi), ucur = f2u(p[i]);
    uint32_t blo = bf16_rne(ulo), bhi = bf16_rne(uhi), bcur = bf16_rne(ucur);
    /* any non-finite value (inf/nan in lo, hi or current) is flagged as uncertain */
    uint32_t nonfinite = ((ulo & 0x7F800000u) == 0x7F800000u) |
                         ((uhi & 0x7F800000u) == 0x7F800000u) |
                         ((ucur & 0x7F800000u) == 0x7F800000u);
    return (uint8_t)((blo != bhi) | (blo != bcur) | nonfinite);
}

#define BLOCK 64

/* Bit j of the result = flag_at(base + j), for one block of len <= BLOCK elements: the flags
 * are computed by a vectorized loop into bytes, then packed eight at a time (one multiply
 * gathers the low bit of each of eight bytes into one byte, byte j to bit j). */
static inline uint64_t block_mask(const float *p, const float *m, const float *v, int64_t base,
                                  int64_t len, float bc2s, float eps, float step_size,
                                  float inv_scale_c, float rel_s, float rel_u, float abs_e) {
    uint8_t flags[BLOCK];
    for (int64_t j = 0; j < len; j++)
        flags[j] = flag_at(p, m, v, base + j, bc2s, eps, step_size, inv_scale_c, rel_s, rel_u,
                           abs_e);
    for (int64_t j = len; j < BLOCK; j++) flags[j] = 0;
    uint64_t mask = 0;
    for (int w = 0; w < BLOCK / 8; w++) {
        uint64_t x;
        memcpy(&x, flags + 8 * w, 8);
        mask |= ((x * 0x0102040810204080ull) >> 56) << (8 * w);
    }
    return mask;
}

/* Processes elements [0, n) of one parameter chunk. `bits` points at the byte holding element
 * 0 of the chunk; callers split work at multiples of 64 elements so threads never share a byte. */
int64_t ds_adamw_detect(const float *p, const float *m, const float *v, int64_t n,
                        float bc2s, float eps, float step_size, float inv_scale_c,
                        float rel_s, float rel_u, float abs_e, uint8_t *bits) {
    int64_t flagged = 0;
    for (int64_t base = 0; base < n; base += BLOCK) {
        int64_t len = n - base < BLOCK ? n - base : BLOCK;
        uint64_t mask = block_mask(p, m, v, base, len, bc2s, eps, step_size, inv_scale_c, rel_s,
                                   rel_u, abs_e);
        flagged += __builtin_popcountll(mask);
        for (int k = 0; k < BLOCK / 8 && (base >> 3) + k < (n + 7) / 8; k++)
            bits[(base >> 3) + k] |= (uint8_t)(mask >> (8 * k));
    }
    return flagged;
}

int64_t ds_bits_count(const uint8_t *bits, int64_t nbytes) {
    int64_t c = 0, i = 0;
    for (; i + 8 <= nbytes; i += 8) {
        uint64_t w; memcpy(&w, bits + i, 8);
        c += __builtin_popcountll(w);
    }
    for (; i < nbytes; i++) c += __builtin_popcount(bits[i]);
    return c;
}

/* Writes the positions of set bits (ascending) into out; returns how many were written.
 * `first_index` is added to every position (chunked callers). */
int64_t ds_bits_to_indices(const uint8_t *bits, int64_t nbytes, int64_t first_index, int64_t *out) {
    int64_t k = 0, i = 0;
    for (; i + 8 <= nbytes; i += 8) {
        uint64_t w; memcpy(&w, bits + i, 8);
        while (w) {
            int t = __builtin_ctzll(w);
            out[k++] = first_index + i * 8 + t;
            w &= w - 1;
        }
    }
    for (; i < nbytes; i++) {
        uint32_t w = bits[i];
        while (w) {
            int t = __builtin_ctz(w);
            out[k++] = first_index + i * 8 + t;
            w &= w - 1;
        }
    }
    return k;
}

/* ds_gather_bf16: out[k] = BF16 bits (round to nearest even) of p[idx[k]], for k < n.
 * Returns n, or -1 (out partly written) as soon as a value is NaN or an fp32 subnormal: torch's
 * own cast is the reference for what the trainer's BF16 copy holds, and CPUs with AVX512-BF16
 * conversion instructions treat subnormal inputs as zero while this integer rounding does not,
 * and NaN payloads differ between cast paths; the caller then casts that tensor with torch.
 * Finite normal values, zeros and infinities round identically on every path. */
int64_t ds_gather_bf16(const float *p, const int64_t *idx, int64_t n, uint16_t *out) {
    /* Sorted positions walk the source forward with small gaps; a prefetch a few dozen
     * positions ahead keeps the loads in flight across the 4 KiB pages the hardware
     * prefetcher stops at (measured: ~2x on a 620 MB embedding at 4.5% density). */
    const int64_t AHEAD = 32;
    for (int64_t k = 0; k < n; k++) {
        if (k + AHEAD < n) __builtin_prefetch(p + idx[k + AHEAD], 0, 0);
        uint32_t u = f2u(p[idx[k]]);
        uint32_t ex = u & 0x7F800000u, man = u & 0x007FFFFFu;
        if ((ex == 0x7F800000u && man) || (ex == 0 && man)) return -1;
        out[k] = (uint16_t)bf16_rne(u);
    }
    return n;
}

/* ds_cast_bf16: out[k] = BF16 bits (round to nearest even) of p[k], for k < n: the cast the
 * shard-state digest hashes, at memory speed (a branch-free loop the compiler vectorizes;
 * torch's own cast ran at ~0.25 G elements/s here). Returns n, or -1 (out fully written but
 * not to be used) if any value is NaN or an fp32 subnormal, for the reason given at
 * ds_gather_bf16: the caller then casts that range with torch. */
int64_t ds_cast_bf16(const float *p, int64_t n, uint16_t *out) {
    /* With a = |u| (the bits without the sign): NaN is a > 0x7F800000 and a subnormal is
     * 0 < a < 0x00800000, i.e. a - 1 < 0x007FFFFF unsigned (a = 0 wraps to the top). A max
     * and a min carried through the loop decide both at the end: ~12% faster than testing
     * each element, and the loop still vectorizes. */
    uint32_t hi = 0, lo = 0xFFFFFFFFu;
    for (int64_t k = 0; k < n; k++) {
        uint32_t u = f2u(p[k]);
        uint32_t a = u & 0x7FFFFFFFu;
        hi = a > hi ? a : hi;
        lo = a - 1u < lo ? a - 1u : lo;
        out[k] = (uint16_t)bf16_rne(u);
    }
    return (hi > 0x7F800000u || lo < 0x007FFFFFu) ? -1 : n;
}

/* ds_cast_bf16_rows: ds_cast_bf16 over a 2-D fp32 view with contiguous rows (``cols``
 * elements each, ``stride`` elements apart: a column slice such as a row-parallel shard's part
 * of o_proj) into a dense rows x cols output. Same return convention. */
int64_t ds_cast_bf16_rows(const float *p, int64_t rows, int64_t cols, int64_t stride,
                          uint16_t *out) {
    int64_t bad = 0;
    for (int64_t r = 0; r < rows; r++)
        bad |= ds_cast_bf16(p + r * stride, cols, out + r * cols) < 0;
    return bad ? -1 : rows * cols;
}

/* ds_gaps_encode: the 8-bit gap code of sorted positions (trainer/positions.py): for each
 * idx[k] (k < n), g = idx[k] - prev - 1 with prev the position before it (``prev`` for k = 0);
 * gaps[k] = g when g < 255, else 255 and the whole difference g + 1 goes to esc (in order).
 * Returns the number of escapes written (esc must hold n entries), or -1 if the positions do
 * not strictly increase. */
int64_t ds_gaps_encode(const int64_t *idx, int64_t n, int64_t prev, uint8_t *gaps, int64_t *esc) {
    int64_t e = 0;
    for (int64_t k = 0; k < n; k++) {
        int64_t d = idx[k] - prev;
        if (d < 1) return -1;
        if (d > 255) {
            gaps[k] = 255;
            esc[e++] = d;
        } else {
            gaps[k] = (uint8_t)(d - 1);
        }
        prev = idx[k];
    }
    return e;
}

/* ds_gaps_decode: the inverse: out[k] = prev + sum over j <= k of (g_j + 1), where g_j =
 * gaps[j] below 255 and esc[next] - 1 for 255 (esc in order). Returns the escapes consumed. */
int64_t ds_gaps_decode(const uint8_t *gaps, int64_t n, const int64_t *esc, int64_t prev,
                       int64_t *out) {
    int64_t e = 0;
    for (int64_t k = 0; k < n; k++) {
        prev += gaps[k] == 255 ? esc[e++] : (int64_t)gaps[k] + 1;
        out[k] = prev;
    }
    return e;
}

/* ds_first_not_increasing: the first k >= 1 with x[k] <= x[k-1], or -1 if x[0..n) strictly
 * increases (the routing tables rely on sorted, distinct indices). */
int64_t ds_first_not_increasing(const int64_t *x, int64_t n) {
    int64_t bad = 0;
    const int64_t B = 4096;
    for (int64_t base = 1; base < n; base += B) {  /* branch-free blocks, exact position after */
        int64_t end = base + B < n ? base + B : n;
        for (int64_t k = base; k < end; k++) bad |= (x[k] <= x[k - 1]);
        if (bad) {
            for (int64_t k = base; k < end; k++) if (x[k] <= x[k - 1]) return k;
        }
    }
    return -1;
}

/* ds_adamw_detect_list: ds_adamw_detect's test, element for element, but the flagged positions
 * (first_index + i, ascending) go straight into idx_out -- no bitset to clear, fill and expand --
 * and, if val_out is not NULL, the current value's BF16 bits into val_out, read while the
 * 64-element block is still in L1. Both outputs must hold n entries. Returns the count, or -1
 * if val_out was asked for and a flagged current value is NaN or an fp32 subnormal (see
 * ds_gather_bf16: the caller then lets torch cast those). */
int64_t ds_adamw_detect_list(const float *p, const float *m, const float *v, int64_t n,
                             float bc2s, float eps, float step_size, float inv_scale_c,
                             float rel_s, float rel_u, float abs_e, int64_t first_index,
                             int64_t *idx_out, uint16_t *val_out) {
    int64_t k = 0;
    for (int64_t base = 0; base < n; base += BLOCK) {
        int64_t len = n - base < BLOCK ? n - base : BLOCK;
        uint64_t mask = block_mask(p, m, v, base, len, bc2s, eps, step_size, inv_scale_c, rel_s,
                                   rel_u, abs_e);
        while (mask) {
            int t = __builtin_ctzll(mask);
            mask &= mask - 1;
            idx_out[k] = first_index + base + t;
            if (val_out) {
                uint32_t u = f2u(p[base + t]);
                uint32_t ex = u & 0x7F800000u, man = u & 0x007FFFFFu;
                if ((ex == 0x7F800000u && man) || (ex == 0 && man)) return -1;
                val_out[k] = (uint16_t)bf16_rne(u);
            }
            k++;
        }
    }
    return k;
}

/* ds_adamw_detect_list_cast: ds_adamw_detect_list (val_out may be NULL), and the BF16 bits of
 * EVERY element of the chunk into all_out (n entries): the bits the receivers' state digest
 * hashes, cast while the block the test just read is still in L1, so the digest needs no
 * second read of the parameter. Returns the count, or -1 if any value of the chunk is NaN or
 * an fp32 subnormal (all_out then not to be used; see ds_gather_bf16 for why torch decides
 * those). The cast is ds_cast_bf16's, block by block. */
int64_t ds_adamw_detect_list_cast(const float *p, const float *m, const float *v, int64_t n,
                                  float bc2s, float eps, float step_size, float inv_scale_c,
                                  float rel_s, float rel_u, float abs_e, int64_t first_index,
                                  int64_t *idx_out, uint16_t *val_out, uint16_t *all_out) {
    int64_t k = 0;
    uint32_t hi = 0, lo = 0xFFFFFFFFu;
    for (int64_t base = 0; base < n; base += BLOCK) {
        int64_t len = n - base < BLOCK ? n - base : BLOCK;
        uint64_t mask = block_mask(p, m, v, base, len, bc2s, eps, step_size, inv_scale_c, rel_s,
                                   rel_u, abs_e);
        for (int64_t j = 0; j < len; j++) {
            uint32_t u = f2u(p[base + j]);
            uint32_t a = u & 0x7FFFFFFFu;
            hi = a > hi ? a : hi;
            lo = a - 1u < lo ? a - 1u : lo;
            all_out[base + j] = (uint16_t)bf16_rne(u);
        }
        while (mask) {
            int t = __builtin_ctzll(mask);
            mask &= mask - 1;
            idx_out[k] = first_index + base + t;
            if (val_out) val_out[k] = all_out[base + t];
            k++;
        }
    }
    return (hi > 0x7F800000u || lo < 0x007FFFFFu) ? -1 : k;
}

/* ds_adamw_detect_list_many: ds_adamw_detect_list over `count` whole parameters in one call (a
 * model's many small tensors: one call from the interpreter, one release of its lock, instead
 * of one per tensor). Parameter j is n[j] elements of fp32 at the addresses p[j], m[j], v[j],
 * with its own seven scalars at sc + 7 * j (ds_adamw_detect's order); its positions (from 0)
 * and, if val_out is not NULL, its values follow those of the parameters before it in idx_out
 * / val_out, and its count goes to found[j]. If all_out is not NULL, each parameter's BF16 bits
 * of every element follow too (ds_adamw_detect_list_cast). The outputs hold the sum of n[j]
 * entries. Returns the total, or -1 as ds_adamw_detect_list(_cast) does for any parameter
 * (found and all_out then not to be used). */
int64_t ds_adamw_detect_list_many(int64_t count, const int64_t *p, const int64_t *m,
                                  const int64_t *v, const int64_t *n, const float *sc,
                                  int64_t *idx_out, uint16_t *val_out, uint16_t *all_out,
                                  int64_t *found) {
    int64_t k = 0, off = 0;
    for (int64_t j = 0; j < count; j++) {
        const float *s = sc + 7 * j;
        const float *pj = (const float *)(intptr_t)p[j], *mj = (const float *)(intptr_t)m[j],
                    *vj = (const float *)(intptr_t)v[j];
        uint16_t *vals = val_out ? val_out + k : NULL;
        int64_t got =
            all_out ? ds_adamw_detect_list_cast(pj, mj, vj, n[j], s[0], s[1], s[2], s[3], s[4],
                                                s[5], s[6], 0, idx_out + k, vals, all_out + off)
                    : ds_adamw_detect_list(pj, mj, vj, n[j], s[0], s[1], s[2], s[3], s[4], s[5],
                                           s[6], 0, idx_out + k, vals);
        if (got < 0) return -1;
        found[j] = got;
        k += got;
        off += n[j];
    }
    return k;
}

/* ds_scatter16_i32 / ds_scatter16_i64: dst[idx[k] - base] = vals[k] for k < n, into a 2-byte
 * element array of n_dst elements (BF16 or FP16 bits, copied as they are): a receiver's
 * scatter of one decoded piece into its live tensor, without widening int32 indices to int64
 * or a temporary. Every index is checked first (0 <= idx[k] - base < n_dst): on a bad one
 * nothing is written and -1 - k is returned; else n. Order is not required (a later duplicate
 * wins, as index_copy_ on the CPU); sorted indices walk dst forward and the prefetch keeps the
 * cache misses in flight. */
#define DS_SCATTER16(NAME, IDX_T)                                                              \
    int64_t NAME(uint16_t *dst, int64_t n_dst, const IDX_T *idx, const uint16_t *vals,        \
                 int64_t n, int64_t base) {                                                    \
        for (int64_t k = 0; k < n; k++) {                                                      \
            int64_t i = (int64_t)idx[k] - base;                                                \
            if (i < 0 || i >= n_dst) return -1 - k;                                            \
        }                                                                                      \
        const int64_t AHEAD = 32;                                                              \
        for (int64_t k = 0; k < n; k++) {                                                      \
            if (k + AHEAD < n) __builtin_prefetch(dst + ((int64_t)idx[k + AHEAD] - base), 1, 0); \
            dst[(int64_t)idx[k] - base] = vals[k];                                             \
        }                                                                                      \
        return n;                                                                              \
    }
DS_SCATTER16(ds_scatter16_i32, int32_t)
DS_SCATTER16(ds_scatter16_i64, int64_t)

/* ds_patch16_i32 / ds_patch16_i64: dst[0, n) = src[0, n), then dst[idx[k] - base] = vals[k] for
 * k < m (2-byte elements): one chunk of a tensor as an update will leave it, built in a
 * scratch buffer for the verify-before-write hash. Every index is checked first, as in
 * ds_scatter16 (-1 - k on a bad one, nothing written). The copy and the writes go 4096
 * elements at a time, so the writes land in lines the copy just brought in; sorted indices are
 * the fast case, any order is correct (a later duplicate wins). Returns m. */
#define DS_PATCH16(NAME, IDX_T)                                                                \
    int64_t NAME(uint16_t *dst, const uint16_t *src, int64_t n, const IDX_T *idx,              \
                 const uint16_t *vals, int64_t m, int64_t base) {                              \
        for (int64_t k = 0; k < m; k++) {                                                      \
            int64_t i = (int64_t)idx[k] - base;                                                \
            if (i < 0 || i >= n) return -1 - k;                                                \
        }                                                                                      \
        const int64_t STEP = 4096;                                                             \
        int64_t k = 0;                                                                         \
        for (int64_t s = 0; s < n; s += STEP) {                                                \
            int64_t e = n - s < STEP ? n : s + STEP;                                           \
            memcpy(dst + s, src + s, (size_t)(e - s) * 2);                                     \
            while (k < m && (int64_t)idx[k] - base >= s && (int64_t)idx[k] - base < e) {       \
                dst[(int64_t)idx[k] - base] = vals[k];                                         \
                k++;                                                                           \
            }                                                                                  \
        }                                                                                      \
        for (; k < m; k++) dst[(int64_t)idx[k] - base] = vals[k]; /* out of order: the rest */ \
        return m;                                                                              \
    }
DS_PATCH16(ds_patch16_i32, int32_t)
DS_PATCH16(ds_patch16_i64, int64_t)

/* ds_prefix_sum_i32 / ds_prefix_sum_i64: x[k] = x[0] + ... + x[k] in place, for k < n, the
 * sums wrapping modulo 2^32 / 2^64 as numpy's cumsum in the array's own dtype does (a
 * receiver's gap decode: ``first, gap, gap, ...`` to indices; its caller rules out or detects
 * a wrap). Unsigned arithmetic: a wrap is defined behaviour here. Returns n. */
#define DS_PREFIX_SUM(NAME, T, U)                                                             \
    int64_t NAME(T *x, int64_t n) {                                                            \
        U acc = 0;                                                                             \
        for (int64_t k = 0; k < n; k++) {                                                      \
            acc += (U)x[k];                                                                    \
            x[k] = (T)acc;                                                                     \
        }                                                                                      \
        return n;                                                                              \
    }
DS_PREFIX_SUM(ds_prefix_sum_i32, int32_t, uint32_t)
DS_PREFIX_SUM(ds_prefix_sum_i64, int64_t, uint64_t)

/* ds_column_block: of flat row-major indices idx[0, n) into a matrix of src_cols (> 0) columns,
 * every one whose column lies in [col_lo, col_hi): its position j + pos_base into pos_out and
 * row * dst_cols + column + shift into dst_out, in input order; returns how many. A routing
 * step for a column-split (row-parallel) weight, in one pass: the row is recomputed by one
 * division only when an index leaves the current row (sorted indices enter each row once).
 * Indices must be non-negative (the caller's bounds check); both outputs hold n entries. */
int64_t ds_column_block(const int64_t *idx, int64_t n, int64_t src_cols, int64_t col_lo,
                        int64_t col_hi, int64_t dst_cols, int64_t shift, int64_t pos_base,
                        int64_t *dst_out, int64_t *pos_out) {
    int64_t k = 0, row = 0, row_start = 0, row_end = 0;
    for (int64_t j = 0; j < n; j++) {
        int64_t i = idx[j];
        if (i < row_start || i >= row_end) {
            row = i / src_cols;
            row_start = row * src_cols;
            row_end = row_start + src_cols;
        }
        int64_t c = i - row_start;
        if (c >= col_lo && c < col_hi) {
            dst_out[k] = row * dst_cols + c + shift;
            pos_out[k] = pos_base + j;
            k++;
        }
    }
    return k;
}

/* ds_planes_join: words [a, a + m) of out, each `size` bytes (2, 4 or 8, little-endian), from
 * byte planes: byte k < w - 1 of word i is lower[k * n + i], byte w - 1 is last[i - a], and
 * the bytes from w up are zero. A record's gaps and values are stored as planes, low byte
 * first (format/section.py); this writes each word once and whole, instead of one strided
 * pass per plane over a zeroed array. Returns m, or -1 (nothing written) unless
 * 0 <= a <= a + m <= n, 1 <= w <= size and the pointers the write reads are given. One loop
 * per width of 2- and 4-byte words (the compiler widens each into vector code); 8-byte words
 * (indices of tensors above 2^31 elements) take the loop with w read at run time. */
#define DS_JOIN(T, W)                                                                          \
    for (int64_t i = 0; i < m; i++) {                                                          \
        T v = (T)((T)last[i] << (8 * ((W) - 1)));                                              \
        for (int64_t k = 0; k + 1 < (W); k++) v |= (T)((T)lower[k * n + a + i] << (8 * k));    \
        memcpy(out + (a + i) * (int64_t)sizeof(T), &v, sizeof(T));                              \
    }                                                                                          \
    return m;

int64_t ds_planes_join(uint8_t *out, int64_t size, int64_t n, int64_t w, const uint8_t *lower,
                       const uint8_t *last, int64_t a, int64_t m) {
    if ((size != 2 && size != 4 && size != 8) || w < 1 || w > size || a < 0 || m < 0 ||
        a > n - m || (m && (!out || !last)) || (m && w > 1 && !lower))
        return -1;
    switch (size * 16 + w) {
    case 2 * 16 + 1: DS_JOIN(uint16_t, 1)
    case 2 * 16 + 2: DS_JOIN(uint16_t, 2)
    case 4 * 16 + 1: DS_JOIN(uint32_t, 1)
    case 4 * 16 + 2: DS_JOIN(uint32_t, 2)
    case 4 * 16 + 3: DS_JOIN(uint32_t, 3)
    case 4 * 16 + 4: DS_JOIN(uint32_t, 4)
    default: DS_JOIN(uint64_t, w)
    }
}

/* ds_decode_sparse: one sparse record of a record section held in memory, whole: its n >= 1
 * indices and n 2-byte values from src, where the n - 1 gaps lie as w (1..8) byte planes of
 * n - 1 bytes each, low byte first, and the values' two planes of n bytes follow them
 * (format/section.py). idx[0] = first, idx[k] = idx[k - 1] + gap k, written as idx_size (4 or
 * 8) byte integers; vals[k] = value k. Every gap must be at least 1 and every index below
 * numel: a gap is compared with numel before it is added to a sum below numel <= 2^62, so no
 * sum can wrap. Returns 0 with every word written; -1 (nothing written) for arguments outside
 * those bounds (0 <= first < numel, 4-byte indices only for numel <= 2^31); -2 at the first
 * gap or index that breaks a rule (the outputs then hold garbage: the caller's checked
 * decoder reads the record again and names the fault). */
#define DS_DECODE_SPARSE(T, W)                                                                 \
    for (int64_t k = 1; k < n; k++) {                                                          \
        uint64_t g = 0;                                                                        \
        for (int64_t b = 0; b < (W); b++) g |= (uint64_t)gaps[b * (n - 1) + k - 1] << (8 * b);  \
        if (g == 0 || g >= lim) return -2;                                                     \
        s += g;                                                                                \
        if (s >= lim) return -2;                                                               \
        ((T *)idx)[k] = (T)s;                                                                  \
    }                                                                                          \
    break;

int64_t ds_decode_sparse(const uint8_t *src, int64_t n, int64_t w, int64_t first, int64_t numel,
                         void *idx, int64_t idx_size, uint16_t *vals) {
    if (!src || !idx || !vals || n < 1 || w < 1 || w > 8 || first < 0 || numel <= first ||
        numel > ((int64_t)1 << 62) || (idx_size != 4 && idx_size != 8) ||
        (idx_size == 4 && numel > ((int64_t)1 << 31)))
        return -1;
    const uint8_t *gaps = src;
    const uint8_t *lo = src + (n - 1) * w;
    const uint8_t *hi = lo + n;
    uint64_t s = (uint64_t)first, lim = (uint64_t)numel;
    if (idx_size == 4) ((int32_t *)idx)[0] = (int32_t)first;
    else ((int64_t *)idx)[0] = first;
    switch (idx_size * 16 + w) {
    case 4 * 16 + 1: DS_DECODE_SPARSE(int32_t, 1)
    case 4 * 16 + 2: DS_DECODE_SPARSE(int32_t, 2)
    case 4 * 16 + 3: DS_DECODE_SPARSE(int32_t, 3)
    case 4 * 16 + 4: DS_DECODE_SPARSE(int32_t, 4)
    case 8 * 16 + 1: DS_DECODE_SPARSE(int64_t, 1)
    case 8 * 16 + 2: DS_DECODE_SPARSE(int64_t, 2)
    default:
        if (idx_size == 4) { DS_DECODE_SPARSE(int32_t, w) }
        DS_DECODE_SPARSE(int64_t, w)
    }
    for (int64_t k = 0; k < n; k++) vals[k] = (uint16_t)(lo[k] | (uint16_t)hi[k] << 8);
    return 0;
}

/* ds_patched_digests16: the XXH3-128 digest (canonical: big-endian high half, then low half,
 * as xxhash's digest() returns it) of each of `count` 2-byte tensors as it will be after
 * writing its values at its flat positions: a receiver's verify before write, every tensor of
 * a shard in one call. Tensor t holds numel[t] elements at live[t]; its nnz[t] positions (int32
 * or int64 words, idx_size[t] bytes) at idx[t] must be strictly increasing and below numel[t],
 * its values at vals[t]. It is hashed chunk by chunk: a chunk no position falls in straight
 * from live, any other copied into scratch (which holds min(chunk, numel[t]) elements for
 * every patched tensor), patched there and hashed, so live is only read. The hash is the
 * xxhash library's own, reached through the functions in fns (XXH3_createState,
 * XXH3_freeState, XXH3_128bits_reset, XXH3_128bits_update, XXH3_128bits_digest; the caller
 * resolves them from the library and checks them against a known digest). Returns count;
 * -1 - t for the first tensor whose positions break a rule (the digests from t on are not
 * written); -1 - count for bad arguments or no hash state. */
typedef struct { uint64_t low64, high64; } ds_xxh128;
typedef void *(*ds_xxh_create)(void);
typedef int (*ds_xxh_free)(void *);
typedef int (*ds_xxh_reset)(void *);
typedef int (*ds_xxh_update)(void *, const void *, size_t);
typedef ds_xxh128 (*ds_xxh_digest)(const void *);

static void ds_put_be64(uint8_t *out, uint64_t x) {
    for (int b = 7; b >= 0; b--) { out[b] = (uint8_t)x; x >>= 8; }
}

/* copy [start, end) of src into scratch 4096 elements at a time, each block patched with its
 * positions while it is in cache (as ds_patch16) */
#define DS_PATCH_CHUNK(T)                                                                      \
    {                                                                                          \
        const T *ix = (const T *)ix0;                                                          \
        for (int64_t b0 = start; b0 < end && !bad; b0 += 4096) {                               \
            int64_t b1 = end - b0 < 4096 ? end : b0 + 4096;                                    \
            memcpy(scratch + (b0 - start), src + b0, (size_t)(b1 - b0) * 2);                   \
            while (k < m && (int64_t)ix[k] < b1) {                                             \
                int64_t i = (int64_t)ix[k];                                                    \
                if (i < b0 || (k && i <= (int64_t)ix[k - 1])) { bad = 1; break; }              \
                scratch[i - start] = v[k];                                                     \
                k++;                                                                           \
            }                                                                                  \
        }                                                                                      \
    }

int64_t ds_patched_digests16(int64_t count, const int64_t *live, const int64_t *numel,
                             const int64_t *idx, const int64_t *idx_size, const int64_t *vals,
                             const int64_t *nnz, uint16_t *scratch, int64_t chunk,
                             const int64_t *fns, uint8_t *out) {
    if (count < 0 || !live || !numel || !idx || !idx_size || !vals || !nnz || !scratch ||
        chunk < 1 || !fns || !out)
        return -1 - count;
    ds_xxh_create create = (ds_xxh_create)(intptr_t)fns[0];
    ds_xxh_free release = (ds_xxh_free)(intptr_t)fns[1];
    ds_xxh_reset reset = (ds_xxh_reset)(intptr_t)fns[2];
    ds_xxh_update update = (ds_xxh_update)(intptr_t)fns[3];
    ds_xxh_digest digest = (ds_xxh_digest)(intptr_t)fns[4];
    if (!create || !release || !reset || !update || !digest) return -1 - count;
    void *state = create();
    if (!state) return -1 - count;
    for (int64_t t = 0; t < count; t++) {
        const uint16_t *src = (const uint16_t *)(intptr_t)live[t];
        const uint16_t *v = (const uint16_t *)(intptr_t)vals[t];
        const void *ix0 = (const void *)(intptr_t)idx[t];
        int64_t n = numel[t], m = nnz[t], k = 0, bad = 0;
        if (n < 0 || m < 0 || (n && !src) || (m && (!v || !ix0)) ||
            (m && idx_size[t] != 4 && idx_size[t] != 8)) {
            release(state);
            return -1 - t;
        }
        reset(state);
        for (int64_t start = 0; start < n && !bad; start += chunk) {
            int64_t end = n - start < chunk ? n : start + chunk;
            int64_t next = k >= m ? end : idx_size[t] == 4 ? (int64_t)((const int32_t *)ix0)[k]
                                                        : ((const int64_t *)ix0)[k];
            if (next >= end) {  /* untouched: hashed where it lies */
                update(state, src + start, (size_t)(end - start) * 2);
                continue;
            }
            if (idx_size[t] == 4) DS_PATCH_CHUNK(int32_t) else DS_PATCH_CHUNK(int64_t)
            if (!bad) update(state, scratch, (size_t)(end - start) * 2);
        }
        if (bad || k != m) {  /* a position out of order, negative, or at or past numel */
            release(state);
            return -1 - t;
        }
        ds_xxh128 h = digest(state);
        ds_put_be64(out + 16 * t, h.high64);
        ds_put_be64(out + 16 * t + 8, h.low64);
    }
    release(state);
    return count;
}
