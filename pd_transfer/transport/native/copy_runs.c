/* pd-transfer's native copy loop: every piece of a checked plan in one call.
 *
 * A plan is a list of descriptors; descriptor i is count[i] pieces of
 * nbytes[i] bytes, piece k read at src[i] + k * src_stride[i] and written at
 * dst[i] + k * dst_stride[i] (absolute addresses). The Python side
 * (pd_transfer/transport/copy/native_loop.py) bounds-checks every piece against its
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
 *
 * The SIGBUS guard (pdt_guard_*): a segment another process maps can be
 * truncated under the mapping (ftruncate by its owner, or by a hostile peer),
 * and the next load or store there is a SIGBUS that kills this process. Each
 * mapped segment is watched (its address range in a slot); a SIGBUS inside a
 * watched range replaces the rest of that mapping with anonymous zero pages,
 * counts the fault on the slot and returns, so the faulting instruction runs
 * again harmlessly, whichever code made it (this loop, numpy, torch). The copy
 * loops stop at the next piece and return -1; the Python side reads the
 * counters, fails the room with segment_truncated and drops the mapping. A
 * SIGBUS anywhere else goes to the disposition that was there before.
 */
#define _DEFAULT_SOURCE
#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#define PDT_STREAM 1
#endif

#define PDT_ABI 5
#define PREFETCH_AHEAD 2        /* descriptors */
#define PREFETCH_NBYTES 256     /* of each: the hardware prefetcher follows the rest */

int pdt_abi(void) { return PDT_ABI; }

/* -- the SIGBUS guard ------------------------------------------------------ */

#define PDT_GUARD_SLOTS 8192

struct guard_slot {
    uintptr_t base, end;   /* watched while base != 0 */
    int64_t faults;
};

static struct guard_slot guard_slots[PDT_GUARD_SLOTS];
volatile int64_t pdt_guard_faults_total;         /* read from Python: a change means look */
static struct sigaction guard_previous;
static int guard_installed;
static __thread volatile int guard_faulted;      /* the copy on this thread met a fault */

static void guard_on_sigbus(int sig, siginfo_t *info, void *context) {
    (void)context;
    uintptr_t addr = (uintptr_t)info->si_addr;
    if (info->si_code > 0) {   /* a fault, not a kill(): is it in a watched segment? */
        for (int i = 0; i < PDT_GUARD_SLOTS; i++) {
            uintptr_t base = __atomic_load_n(&guard_slots[i].base, __ATOMIC_ACQUIRE);
            uintptr_t end = guard_slots[i].end;
            if (!base || addr < base || addr >= end)
                continue;
            uintptr_t page = addr & ~((uintptr_t)sysconf(_SC_PAGESIZE) - 1);
            void *got = mmap((void *)page, end - page, PROT_READ | PROT_WRITE,
                             MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
            if (got == MAP_FAILED)
                break;
            __atomic_add_fetch(&guard_slots[i].faults, 1, __ATOMIC_SEQ_CST);
            __atomic_add_fetch(&pdt_guard_faults_total, 1, __ATOMIC_SEQ_CST);
            guard_faulted = 1;
            return;   /* the instruction runs again, on the zero pages */
        }
    }
    /* not ours: as if never installed (a fault faults again under it; a kill() is re-sent) */
    sigaction(SIGBUS, &guard_previous, NULL);
    if (info->si_code <= 0)
        raise(sig);
}

static int guard_install(void) {
    if (guard_installed)
        return 0;
    struct sigaction action;
    memset(&action, 0, sizeof action);
    action.sa_sigaction = guard_on_sigbus;
    action.sa_flags = SA_SIGINFO | SA_NODEFER;
    sigemptyset(&action.sa_mask);
    if (sigaction(SIGBUS, &action, &guard_previous) != 0)
        return -1;
    guard_installed = 1;
    return 0;
}

/* Watch [base, base + nbytes): returns the slot (>= 0), or -1 when none is free or the
 * handler cannot be installed. Called with the GIL held (one caller at a time). */
int64_t pdt_guard_watch(int64_t base, int64_t nbytes) {
    if (guard_install() != 0 || base == 0 || nbytes <= 0)
        return -1;
    for (int64_t i = 0; i < PDT_GUARD_SLOTS; i++) {
        if (__atomic_load_n(&guard_slots[i].base, __ATOMIC_ACQUIRE) == 0) {
            guard_slots[i].end = (uintptr_t)(base + nbytes);
            guard_slots[i].faults = 0;
            __atomic_store_n(&guard_slots[i].base, (uintptr_t)base, __ATOMIC_RELEASE);
            return i;
        }
    }
    return -1;
}

/* Stop watching a slot (before or after its mapping goes). */
void pdt_guard_unwatch(int64_t slot) {
    if (slot >= 0 && slot < PDT_GUARD_SLOTS)
        __atomic_store_n(&guard_slots[slot].base, 0, __ATOMIC_RELEASE);
}

/* SIGBUS faults absorbed in a slot since it was watched. */
int64_t pdt_guard_faults(int64_t slot) {
    if (slot < 0 || slot >= PDT_GUARD_SLOTS)
        return 0;
    return __atomic_load_n(&guard_slots[slot].faults, __ATOMIC_SEQ_CST);
}

/* Every copy starts clear; a piece that faulted ends it early with -1. */
#define GUARD_BEGIN() (guard_faulted = 0)
#define GUARD_STOP() (guard_faulted)
#define GUARD_END(nbytes) (guard_faulted ? -1 : landed(nbytes))

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
    GUARD_BEGIN();
    for (int64_t i = first; i < n && done < take && !GUARD_STOP(); i++) {
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
        for (; k < count[i] && done < take && !GUARD_STOP(); k++, off = 0) {
            int64_t m = len - off;
            if (m > take - done)
                m = take - done;
            char *d = (char *)(intptr_t)(dst[i] + k * dst_stride[i] + off);
            const char *s = (const char *)(intptr_t)(src[i] + k * src_stride[i] + off);
            copy_piece(d, s, m, stream_min);
            done += m;
        }
    }
    return GUARD_END(done);
}

/* Copy n runs given as (dst, src, nbytes) triples, each already checked: a
 * 1-page room's few dozen runs, with as little work around them as possible. */
int64_t pdt_copy_list(int64_t n, const int64_t *runs, int64_t stream_min) {
    int64_t done = 0;
    GUARD_BEGIN();
    for (int64_t i = 0; i < n && !GUARD_STOP(); i++) {
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
    return GUARD_END(done);
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
    GUARD_BEGIN();
    for (int64_t u = 0; u < num_units && !GUARD_STOP(); u++) {
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
    return GUARD_END(done);
}

/* Gather (gather != 0) the runs (offset[i], nbytes[i]) of the region at `region` back
 * to back into `packed`, or scatter `packed` into them. Returns the bytes copied. */
int64_t pdt_pack(int64_t n, const int64_t *offset, const int64_t *nbytes, int64_t region,
                 int64_t packed, int64_t gather, int64_t stream_min) {
    int64_t at = 0;
    GUARD_BEGIN();
    for (int64_t i = 0; i < n && !GUARD_STOP(); i++) {
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
    return GUARD_END(at);
}
