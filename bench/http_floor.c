/* bench/http_floor.c: bench/http_floor.py's floor in C -- what a compiled receiver pays
 * before it does anything with the spans.
 *
 * One thread, epoll, the same work as the Python floor: it reads each POST (its head, then
 * Content-Length bytes) and answers 200 with an empty body; a GET gets a small JSON body. No
 * check, no spool, no store. Under bench/ingest's fleet load its CPU per request is the
 * kernel's loopback and wake-up work plus the least a receiver outside Python adds; set
 * beside the Python floor it says how much of a fleet's per-request cost is the interpreter.
 * Built by bench/ingest.py with the system's C compiler (cc -O2); run: ./http_floor PORT.
 */
#define _GNU_SOURCE
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include "http_bench.h"

#define MAX_FD 4096

static const char OK[] = "HTTP/1.1 200 OK\r\nContent-Type: application/x-protobuf\r\nContent-Length: 0\r\n\r\n";

struct conn {
    char *buf;
    size_t len, cap;
    long need; /* body bytes still expected; -1: reading a head */
};

static struct conn conns[MAX_FD];

static void close_conn(int ep, int fd) {
    epoll_ctl(ep, EPOLL_CTL_DEL, fd, NULL);
    close(fd);
    free(conns[fd].buf);
    memset(&conns[fd], 0, sizeof conns[fd]);
}

/* answers every whole request in the buffer; returns -1 when the peer must be dropped */
static int serve(int fd, struct conn *c) {
    size_t at = 0;
    for (;;) {
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
        at += (size_t)c->need;
        c->need = -1;
        if (write(fd, OK, sizeof OK - 1) < 0) return -1;
    }
    if (c->need > 0 && at < c->len && (long)(c->len - at) <= c->need) { /* body bytes: drop as read */
        c->need -= (long)(c->len - at);
        at = c->len;
    }
    memmove(c->buf, c->buf + at, c->len - at);
    c->len -= at;
    return 0;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s PORT\n", argv[0]);
        return 2;
    }
    int ls = listen_loopback(atoi(argv[1]));
    if (ls < 0) {
        perror("http_floor");
        return 1;
    }
    int ep = epoll_create1(0);
    struct epoll_event ev = {.events = EPOLLIN, .data.fd = ls}, evs[64];
    epoll_ctl(ep, EPOLL_CTL_ADD, ls, &ev);
    for (;;) {
        int n = epoll_wait(ep, evs, 64, -1);
        for (int i = 0; i < n; i++) {
            int fd = evs[i].data.fd;
            if (fd == ls) {
                int c;
                while ((c = accept_one(ls, ep, MAX_FD)) >= 0) {
                    conns[c] = (struct conn){.buf = malloc(65536), .len = 0, .cap = 65536, .need = -1};
                }
                continue;
            }
            struct conn *c = &conns[fd];
            for (;;) {
                ssize_t r = read_more(fd, &c->buf, &c->len, &c->cap);
                if (r > 0) {
                    if (serve(fd, c) < 0) {
                        close_conn(ep, fd);
                        break;
                    }
                    continue;
                }
                if (r == 0) close_conn(ep, fd);
                break; /* EAGAIN (or an error: the peer is dropped on its next event) */
            }
        }
    }
}
