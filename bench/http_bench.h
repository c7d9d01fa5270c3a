/* bench/http_bench.h: what bench/http_floor.c and bench/durable_floor.c share -- the loopback
 * listener and the least HTTP/1.1 a floor server reads (a head's end, GET or not, its
 * Content-Length). A bench's, not a server's: no chunked bodies, no header limits. */
#ifndef TTFTSCOPE_HTTP_BENCH_H
#define TTFTSCOPE_HTTP_BENCH_H

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

static const char HEALTH[] =
    "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 18\r\n\r\n{\"queue_spans\": 0}";

/* a non-blocking socket listening on 127.0.0.1:port; -1 on failure (errno set) */
static int listen_loopback(int port) {
    int ls = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0), one = 1;
    setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((unsigned short)port),
                            .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    if (ls < 0 || bind(ls, (struct sockaddr *)&a, sizeof a) || listen(ls, 1024)) return -1;
    return ls;
}

/* the request head at the start of buf[0:len]: its length with the blank line (0 when it has
 * not all arrived), whether it is a GET, its Content-Length (0 when none) */
static size_t read_head(const char *buf, size_t len, int *is_get, long *content_length) {
    const char *end = memmem(buf, len, "\r\n\r\n", 4);
    if (!end) return 0;
    size_t head_len = (size_t)(end - buf);
    *is_get = head_len >= 3 && strncasecmp(buf, "get", 3) == 0;
    *content_length = 0;
    for (size_t i = 0; i + 15 <= head_len; i++) {
        if (strncasecmp(buf + i, "content-length:", 15) == 0) {
            *content_length = strtol(buf + i + 15, NULL, 10);
            break;
        }
    }
    return head_len + 4;
}

/* the next connection waiting on ``ls``, set TCP_NODELAY and watched for input on ``ep``; -1
 * when none waits. Connections numbered ``max_fd`` or more are closed at once. */
static int accept_one(int ls, int ep, int max_fd) {
    int c, one = 1;
    while ((c = accept4(ls, NULL, NULL, SOCK_NONBLOCK)) >= max_fd) close(c);
    if (c < 0) return -1;
    setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    struct epoll_event ce = {.events = EPOLLIN, .data.fd = c};
    epoll_ctl(ep, EPOLL_CTL_ADD, c, &ce);
    return c;
}

/* one read() into a connection's buffer, grown first when under 16 KiB is free */
static ssize_t read_more(int fd, char **buf, size_t *len, size_t *cap) {
    if (*cap - *len < 16384) {
        *cap *= 2;
        *buf = realloc(*buf, *cap);
    }
    ssize_t r = read(fd, *buf + *len, *cap - *len);
    if (r > 0) *len += (size_t)r;
    return r;
}

#endif
