/* bench/durable_floor.c: what a receiver outside Python would cost if it kept the collector's
 * promise -- a fleet request answered only once its spans are on disk.
 *
 * bench/http_floor.c plus the receiver's own work, in C, one thread, epoll:
 *   - each POST body walked as OTLP protobuf (ExportTraceServiceRequest -> ResourceSpans ->
 *     ScopeSpans -> Span, every field's wire type and length checked down to attribute values,
 *     trace and span ids 16 and 8 bytes); a malformed one answered 400, nothing kept;
 *   - a good one appended to a spool segment in the collector's own record format (collector/
 *     spool.py: magic TTP1, or TTP2 when a span has events or links; length; spans; crc32),
 *     into zeros written 256 KiB ahead (as the collector's spool does);
 *   - group commit as the collector's receiver does it: one fdatasync when every open
 *     connection waits for one, else 50 ms after the first waiting; then the 200s;
 *   - a segment sealed (zeros cut, fsync, renamed .open -> .sealed) after 2 s or 8 MiB, for
 *     bench/native_flusher.py to store with the collector's own flusher code.
 * What it leaves out of the collector's arrival check: UTF-8 validation of strings, the caps on
 * attribute maps (clipping a span), partial success; and all of the HTTP edge cases (gzip,
 * chunked bodies, tokens, 413/415/431). So its CPU per request is a floor for a compiled
 * receiver with durability, not a receiver. Run: ./durable_floor PORT SPOOL_DIR; or built as a
 * shared library (-shared -fPIC -DNO_MAIN), a thread of bench/native_flusher.py's process.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/epoll.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>
#include <zlib.h>

#include "http_bench.h"

#define MAX_FD 4096
#define ZERO_AHEAD (256 << 10)
#define SEGMENT_BYTES (8 << 20)
#define SEGMENT_AGE_S 2.0
#define COMMIT_WINDOW_S 0.05

static const char OK[] = "HTTP/1.1 200 OK\r\nContent-Type: application/x-protobuf\r\nContent-Length: 0\r\n\r\n";
static const char BAD[] = "HTTP/1.1 400 Bad Request\r\nContent-Type: text/plain\r\nContent-Length: 9\r\n\r\nmalformed";

struct conn {
    char *buf;
    size_t len, cap;
    long need; /* body bytes still expected; -1: reading a head */
    int waiting; /* its request's record written, its answer held for the next sync */
};

static struct conn conns[MAX_FD];
static int n_open, n_waiting, ep;
static int waiting_fds[MAX_FD];
static double commit_at = -1; /* when the pending requests' sync runs; -1: none pending */

/* the open segment */
static const char *spool_dir;
static int seg_fd = -1;
static long seg_seq, seg_bytes, seg_zeroed;
static double seg_since;
static char zeros[2 * ZERO_AHEAD];

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + t.tv_nsec / 1e9;
}

/* ---------------------------------------------------------------- the protobuf walk */
typedef const uint8_t *P;

static int varint(P *p, P end, uint64_t *v) {
    uint64_t x = 0;
    for (int s = 0; s < 64 && *p < end; s += 7) {
        uint8_t b = *(*p)++;
        x |= (uint64_t)(b & 0x7f) << s;
        if (!(b & 0x80)) {
            *v = x;
            return 0;
        }
    }
    return -1;
}

/* one field's key and, for a length-delimited one, its bounds; -1 when malformed */
static int field(P *p, P end, uint32_t *num, int *wt, P *lo, P *hi) {
    uint64_t key, n;
    if (varint(p, end, &key)) return -1;
    *num = (uint32_t)(key >> 3);
    *wt = (int)(key & 7);
    if (*num == 0) return -1;
    switch (*wt) {
    case 0: return varint(p, end, &n);
    case 1: if (end - *p < 8) return -1; *p += 8; return 0;
    case 5: if (end - *p < 4) return -1; *p += 4; return 0;
    case 2:
        if (varint(p, end, &n) || n > (uint64_t)(end - *p)) return -1;
        *lo = *p;
        *p += n;
        *hi = *p;
        return 0;
    default: return -1; /* groups: not in OTLP */
    }
}

static int any_value(P p, P end, int depth);

static int key_value(P p, P end, int depth) { /* 1 key (string), 2 value (AnyValue) */
    uint32_t f; int wt; P lo = 0, hi = 0;
    while (p < end) {
        if (field(&p, end, &f, &wt, &lo, &hi)) return -1;
        if ((f == 1 || f == 2) && wt != 2) return -1;
        if (f == 2 && any_value(lo, hi, depth + 1)) return -1;
    }
    return 0;
}

static int any_value(P p, P end, int depth) { /* 1 str 2 bool 3 int 4 double 5 array 6 kvlist 7 bytes */
    uint32_t f; int wt; P lo = 0, hi = 0;
    if (depth > 16) return -1;
    while (p < end) {
        if (field(&p, end, &f, &wt, &lo, &hi)) return -1;
        if ((f == 1 || f == 5 || f == 6 || f == 7) && wt != 2) return -1;
        if ((f == 2 || f == 3) && wt != 0) return -1;
        if (f == 4 && wt != 1) return -1;
        if (f == 5 || f == 6) { /* ArrayValue{1: AnyValue} / KeyValueList{1: KeyValue} */
            P q = lo; uint32_t g; int wt2; P lo2 = 0, hi2 = 0;
            while (q < hi) {
                if (field(&q, hi, &g, &wt2, &lo2, &hi2)) return -1;
                if (g == 1 && (wt2 != 2 || (f == 5 ? any_value(lo2, hi2, depth + 1) : key_value(lo2, hi2, depth + 1))))
                    return -1;
            }
        }
    }
    return 0;
}

/* a message whose field ``kv_field`` is repeated KeyValue (Resource, InstrumentationScope,
 * Span.Event, Span.Link's attributes), the other fields checked for their wire type only */
static int with_attrs(P p, P end, uint32_t kv_field) {
    uint32_t f; int wt; P lo = 0, hi = 0;
    while (p < end) {
        if (field(&p, end, &f, &wt, &lo, &hi)) return -1;
        if (f == kv_field && (wt != 2 || key_value(lo, hi, 0))) return -1;
    }
    return 0;
}

static int span(P p, P end, int *events_links) {
    uint32_t f; int wt; P lo = 0, hi = 0;
    int ids = 0;
    while (p < end) {
        if (field(&p, end, &f, &wt, &lo, &hi)) return -1;
        switch (f) {
        case 1: if (wt != 2 || hi - lo != 16) return -1; ids |= 1; break;
        case 2: if (wt != 2 || hi - lo != 8) return -1; ids |= 2; break;
        case 4: if (wt != 2 || (hi - lo != 0 && hi - lo != 8)) return -1; break;
        case 3: case 5: if (wt != 2) return -1; break;
        case 6: case 10: case 12: case 14: if (wt != 0) return -1; break;
        case 7: case 8: if (wt != 1) return -1; break;
        case 9: if (wt != 2 || key_value(lo, hi, 0)) return -1; break;
        case 11: if (wt != 2 || with_attrs(lo, hi, 3)) return -1; *events_links = 1; break;
        case 13: if (wt != 2 || with_attrs(lo, hi, 4)) return -1; *events_links = 1; break;
        case 15: if (wt != 2) return -1; break;
        case 16: if (wt != 5) return -1; break;
        default: break;
        }
    }
    return ids == 3 ? 0 : -1;
}

/* the spans of an ExportTraceServiceRequest; -1 when malformed */
static long check(P p, P end, int *events_links) {
    long spans = 0;
    uint32_t f; int wt; P lo = 0, hi = 0;
    while (p < end) { /* 1: ResourceSpans */
        if (field(&p, end, &f, &wt, &lo, &hi)) return -1;
        if (f != 1) continue;
        if (wt != 2) return -1;
        P q = lo, rend = hi;
        while (q < rend) { /* 1: Resource, 2: ScopeSpans, 3: schema_url */
            if (field(&q, rend, &f, &wt, &lo, &hi)) return -1;
            if (f == 1 && (wt != 2 || with_attrs(lo, hi, 1))) return -1;
            if (f != 2) continue;
            if (wt != 2) return -1;
            P s = lo, send = hi;
            while (s < send) { /* 1: InstrumentationScope, 2: Span */
                if (field(&s, send, &f, &wt, &lo, &hi)) return -1;
                if (f == 1 && (wt != 2 || with_attrs(lo, hi, 3))) return -1;
                if (f != 2) continue;
                if (wt != 2 || span(lo, hi, events_links)) return -1;
                spans++;
            }
        }
    }
    return spans;
}

/* ---------------------------------------------------------------- the spool */
static void die(const char *what) {
    perror(what);
    exit(1);
}

static void seal(void) {
    if (seg_fd < 0) return;
    if (seg_zeroed > seg_bytes && ftruncate(seg_fd, seg_bytes)) die("ftruncate");
    if (fsync(seg_fd)) die("fsync");
    close(seg_fd);
    seg_fd = -1;
    char a[4096], b[4096];
    snprintf(a, sizeof a, "%s/%016ld.open", spool_dir, seg_seq);
    snprintf(b, sizeof b, "%s/%016ld.sealed", spool_dir, seg_seq);
    if (rename(a, b)) die("rename");
}

static void append(const char *body, size_t n, long spans, int events_links) {
    if (seg_fd < 0) {
        char path[4096];
        seg_seq++;
        snprintf(path, sizeof path, "%s/%016ld.open", spool_dir, seg_seq);
        seg_fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        if (seg_fd < 0) die("open segment");
        seg_bytes = seg_zeroed = 0;
        seg_since = now_s();
    }
    uint32_t head[4];
    memcpy(head, events_links ? "TTP2" : "TTP1", 4);
    head[1] = (uint32_t)n;
    head[2] = (uint32_t)spans;
    head[3] = (uint32_t)crc32(0L, (const Bytef *)body, (uInt)n);
    size_t size = sizeof head + n;
    if ((long)(seg_bytes + size) > seg_zeroed && size < ZERO_AHEAD) { /* zeros a stretch ahead */
        long start = seg_zeroed > seg_bytes ? seg_zeroed : seg_bytes;
        long todo = seg_bytes + (long)size + ZERO_AHEAD - start;
        if (pwrite(seg_fd, zeros, (size_t)todo, start) != todo) die("pwrite zeros");
        seg_zeroed = seg_bytes + (long)size + ZERO_AHEAD;
    }
    struct iovec iov[2] = {{head, sizeof head}, {(void *)body, n}};
    if (pwritev(seg_fd, iov, 2, seg_bytes) != (ssize_t)size) die("pwritev");
    seg_bytes += (long)size;
}

/* ---------------------------------------------------------------- HTTP */
static void close_conn(int fd) {
    epoll_ctl(ep, EPOLL_CTL_DEL, fd, NULL);
    close(fd);
    free(conns[fd].buf);
    if (conns[fd].waiting) n_waiting--; /* its record stays: written, never acknowledged */
    memset(&conns[fd], 0, sizeof conns[fd]);
    n_open--;
}

static void commit(void) {
    if (seg_fd >= 0 && fdatasync(seg_fd)) die("fdatasync");
    int k = 0;
    for (int i = 0; i < MAX_FD && k < n_waiting; i++) {
        if (!conns[i].waiting) continue;
        conns[i].waiting = 0;
        waiting_fds[k++] = i;
    }
    n_waiting = 0;
    commit_at = -1;
    for (int i = 0; i < k; i++)
        if (write(waiting_fds[i], OK, sizeof OK - 1) < 0) close_conn(waiting_fds[i]);
    if (seg_fd >= 0 && (seg_bytes >= SEGMENT_BYTES || now_s() - seg_since >= SEGMENT_AGE_S)) seal();
}

/* handles every whole request in the buffer (a waiting connection sends no more: its client
 * waits for the answer); -1 when the peer must be dropped */
static int serve(int fd, struct conn *c) {
    size_t at = 0;
    while (!c->waiting) {
        if (c->need < 0) {
            int is_get;
            long need;
            size_t head = read_head(c->buf + at, c->len - at, &is_get, &need);
            if (!head) break;
            at += head;
            if (is_get) {
                if (write(fd, HEALTH, sizeof HEALTH - 1) < 0) return -1;
                continue;
            }
            c->need = need;
        }
        if ((long)(c->len - at) < c->need) break;
        int events_links = 0;
        long spans = check((P)c->buf + at, (P)c->buf + at + c->need, &events_links);
        if (spans < 0) {
            if (write(fd, BAD, sizeof BAD - 1) < 0) return -1;
        } else if (spans == 0) {
            if (write(fd, OK, sizeof OK - 1) < 0) return -1;
        } else {
            append(c->buf + at, (size_t)c->need, spans, events_links);
            c->waiting = 1;
            n_waiting++;
        }
        at += (size_t)c->need;
        c->need = -1;
    }
    memmove(c->buf, c->buf + at, c->len - at);
    c->len -= at;
    return 0;
}

/* serves for ever; the program's main, or (built with -shared -DNO_MAIN) a thread of
 * bench/native_flusher.py's process, called through ctypes */
int durable_floor_run(int port, const char *dir) {
    prctl(PR_SET_NAME, "c-receiver"); /* its thread's CPU, apart in /proc */
    spool_dir = dir;
    int ls = listen_loopback(port);
    if (ls < 0) die("durable_floor");
    ep = epoll_create1(0);
    struct epoll_event ev = {.events = EPOLLIN, .data.fd = ls}, evs[64];
    epoll_ctl(ep, EPOLL_CTL_ADD, ls, &ev);
    for (;;) {
        double t = now_s(), due = -1;
        if (commit_at >= 0) due = commit_at;
        else if (seg_fd >= 0) due = seg_since + SEGMENT_AGE_S;
        int timeout = due < 0 ? -1 : (due <= t ? 0 : (int)((due - t) * 1000) + 1);
        int n = epoll_wait(ep, evs, 64, timeout);
        for (int i = 0; i < n; i++) {
            int fd = evs[i].data.fd;
            if (fd == ls) {
                int c;
                while ((c = accept_one(ls, ep, MAX_FD)) >= 0) {
                    conns[c] = (struct conn){.buf = malloc(65536), .len = 0, .cap = 65536, .need = -1};
                    n_open++;
                }
                continue;
            }
            struct conn *c = &conns[fd];
            for (;;) {
                ssize_t r = read_more(fd, &c->buf, &c->len, &c->cap);
                if (r > 0) {
                    if (serve(fd, c) < 0) {
                        close_conn(fd);
                        break;
                    }
                    continue;
                }
                if (r == 0 || errno != EAGAIN) close_conn(fd);
                break;
            }
        }
        t = now_s();
        if (n_waiting > 0 && n_waiting >= n_open) commit(); /* nobody else can come first */
        else if (n_waiting > 0 && commit_at < 0) commit_at = t + COMMIT_WINDOW_S;
        else if (commit_at >= 0 && t >= commit_at) commit();
        else if (n_waiting == 0 && seg_fd >= 0 && t - seg_since >= SEGMENT_AGE_S) {
            if (fdatasync(seg_fd)) die("fdatasync");
            seal();
        }
    }
}

#ifndef NO_MAIN
int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: %s PORT SPOOL_DIR\n", argv[0]);
        return 2;
    }
    return durable_floor_run(atoi(argv[1]), argv[2]);
}
#endif
