/* pd-transfer's native copy loop: every piece of a checked plan in one call.
 *
 * A plan is a list of descriptors; descriptor i is count[i] pieces of
 * nbytes[i] bytes, piece k read at src[i] + k * src_stride[i] and written at
 * dst[i] + k * dst_stride[i] (absolute addresses). The Python side
 * (pd_transfer/transport/native_copy.py) bounds-checks every piece against its
 * regions before calling here; this file trusts the addresses it is given.
 *
 * Pieces of at least stream_min bytes are written with non-temporal stores
 * (SSE2, x86-64): they go to memory without first reading the destination
 * lines into the cache, which a plain memcpy of a few KiB does. That read is
 * what holds scattered copies to about half of a contiguous copy's speed.
 * Elsewhere memcpy does all of it. The first bytes of the descriptor two
 * ahead are prefetched: scattered 2 KiB sources otherwise leave the CPU
 * waiting on one piece's first cache miss after another (+20-40% here).
 *
 * A call copies one byte range of the plan, so that threads can share a plan
 * (a single huge piece included). It holds no lock and keeps no state.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#define PDT_STREAM 1
#endif

#define PDT_ABI 4
#define PREFETCH_AHEAD 2        /* descriptors */
#define PREFETCH_NBYTES 256     /* of each: the hardware prefetcher follows the rest */

int pdt_abi(void) { return PDT_ABI; }

int pdt_streams(void) {
#ifdef PDT_STREAM
    return 1;
#else
    return 0;
#endif
}

static void stream_copy(char *d, const char *s, size_t n) {
#ifdef PDT_STREAM
    size_t head = (size_t)(-(uintptr_t)d) & 15;  /* bytes up to 16-byte alignment */
    if (head > n)
        head = n;
    memcpy(d, s, head);
    d += head;
    s += head;
    n -= head;
    for (; n >= 64; n -= 64, d += 64, s += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)s);
        __m128i b = _mm_loadu_si128((const __m128i *)(s + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(s + 32));
        __m128i e = _mm_loadu_si128((const __m128i *)(s + 48));
        _mm_stream_si128((__m128i *)d, a);
        _mm_stream_si128((__m128i *)(d + 16), b);
        _mm_stream_si128((__m128i *)(d + 32), c);
        _mm_stream_si128((__m128i *)(d + 48), e);
    }
    memcpy(d, s, n);
#else
    memcpy(d, s, n);
#endif
}

/* One piece: streamed from stream_min bytes on, else memcpy. */
static inline void copy_piece(char *d, const char *s, int64_t m, int64_t stream_min) {
    if (m >= stream_min)
        stream_copy(d, s, (size_t)m);
    else
        memcpy(d, s, (size_t)m);
}

/* Every call ends here: the streamed bytes are visible to other threads and
 * processes before the caller reports them landed (a doorbell, a Done). */
static inline int64_t landed(int64_t nbytes) {
#ifdef PDT_STREAM
    _mm_sfence();
#endif
    return nbytes;
}

/* Copy `take` bytes of the plan, starting `skip` bytes into descriptor
 * `first` (bytes counted in piece order). Returns the bytes copied. */
int64_t pdt_copy_range(int64_t n, const int64_t *src, const int64_t *dst, const int64_t *nbytes,
                       const int64_t *count, const int64_t *src_stride,
                       const int64_t *dst_stride, int64_t first, int64_t skip, int64_t take,
                       int64_t stream_min) {
    int64_t done = 0;
    for (int64_t i = first; i < n && done < take; i++) {
        if (i + PREFETCH_AHEAD < n) {
            const char *next = (const char *)(intptr_t)src[i + PREFETCH_AHEAD];
            int64_t ahead = nbytes[i + PREFETCH_AHEAD];
            for (int64_t o = 0; o < ahead && o < PREFETCH_NBYTES; o += 64)
                __builtin_prefetch(next + o, 0, 0);
        }
        int64_t len = nbytes[i];
        if (len <= 0 || count[i] <= 0) {
            skip = 0;
            continue;
        }
        int64_t k = 0, off = 0;
        if (skip) {  /* a range starting inside this descriptor (64-bit division: rare) */
            k = skip / len;
            off = skip % len;
            skip = 0;
        }
        for (; k < count[i] && done < take; k++, off = 0) {
            int64_t m = len - off;
            if (m > take - done)
                m = take - done;
            char *d = (char *)(intptr_t)(dst[i] + k * dst_stride[i] + off);
            const char *s = (const char *)(intptr_t)(src[i] + k * src_stride[i] + off);
            copy_piece(d, s, m, stream_min);
            done += m;
        }
    }
    return landed(done);
}

/* Copy n runs given as (dst, src, nbytes) triples, each already checked: a
 * 1-page room's few dozen runs, with as little work around them as possible. */
int64_t pdt_copy_list(int64_t n, const int64_t *runs, int64_t stream_min) {
    int64_t done = 0;
    for (int64_t i = 0; i < n; i++) {
        char *d = (char *)(intptr_t)runs[3 * i];
        const char *s = (const char *)(intptr_t)runs[3 * i + 1];
        int64_t m = runs[3 * i + 2];
        if (i + PREFETCH_AHEAD < n)
            __builtin_prefetch((const char *)(intptr_t)runs[3 * (i + PREFETCH_AHEAD) + 1], 0, 0);
        if (m <= 0)
            continue;
        copy_piece(d, s, m, stream_min);
        done += m;
    }
    return landed(done);
}

/* Copy a grid (pd_transfer/layout/grids.py) in its order: for each unit u, index
 * pair i, position c and k < count, run bytes from
 *   src_unit[u] + src_index[i] + combo_src[c] + k * src_stride
 * to the same on the destination side (absolute unit addresses, byte offsets of the
 * index lists). The caller checked the extremes of every unit's pieces against its
 * regions. A 1-page room's whole copy is one call, with no descriptor list built. */
int64_t pdt_copy_grid(int64_t num_units, const int64_t *src_unit, const int64_t *dst_unit,
                      int64_t num_index, const int64_t *src_index, const int64_t *dst_index,
                      int64_t num_combo, const int64_t *combo_src, const int64_t *combo_dst,
                      int64_t run, int64_t count, int64_t src_stride, int64_t dst_stride,
                      int64_t stream_min) {
    int64_t done = 0;
    if (run <= 0 || count <= 0)
        return landed(0);
    for (int64_t u = 0; u < num_units; u++) {
        for (int64_t i = 0; i < num_index; i++) {
            const char *s0 = (const char *)(intptr_t)(src_unit[u] + src_index[i]);
            char *d0 = (char *)(intptr_t)(dst_unit[u] + dst_index[i]);
            if (u + 1 < num_units)  /* the next unit's first piece: another tensor */
                __builtin_prefetch((const char *)(intptr_t)(src_unit[u + 1] + src_index[i]), 0, 0);
            for (int64_t c = 0; c < num_combo; c++) {
                const char *s = s0 + combo_src[c];
                char *d = d0 + combo_dst[c];
                for (int64_t k = 0; k < count; k++, s += src_stride, d += dst_stride)
                    copy_piece(d, s, run, stream_min);
                done += run * count;
            }
        }
    }
    return landed(done);
}

/* Gather (gather != 0) the runs (offset[i], nbytes[i]) of the region at `region` back
 * to back into `packed`, or scatter `packed` into them. Returns the bytes copied. */
int64_t pdt_pack(int64_t n, const int64_t *offset, const int64_t *nbytes, int64_t region,
                 int64_t packed, int64_t gather, int64_t stream_min) {
    int64_t at = 0;
    for (int64_t i = 0; i < n; i++) {
        char *run = (char *)(intptr_t)(region + offset[i]);
        char *buf = (char *)(intptr_t)(packed + at);
        int64_t m = nbytes[i];
        if (gather && i + PREFETCH_AHEAD < n && m >= PREFETCH_NBYTES)
            __builtin_prefetch(run + offset[i + PREFETCH_AHEAD] - offset[i], 0, 0);
        if (m <= 0)
            continue;
        if (gather)
            copy_piece(buf, run, m, stream_min);
        else
            copy_piece(run, buf, m, stream_min);
        at += m;
    }
    return landed(at);
}
