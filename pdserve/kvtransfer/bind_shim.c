/* Preloaded into a node process (LD_PRELOAD) whose Mooncake Transfer Engine would otherwise
 * listen on every interface: a bind() to the IPv4 or IPv6 wildcard becomes a bind() to the
 * address in PDSERVE_WILDCARD_BIND (an IPv4 address goes into an IPv6 socket as ::ffff:a.b.c.d,
 * as Mooncake's dual-stack data socket needs). Every other bind() is passed through untouched.
 * See pdserve/kvtransfer/bind_shim.py. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

typedef int (*bind_fn)(int, const struct sockaddr *, socklen_t);

int bind(int fd, const struct sockaddr *addr, socklen_t len) {
    static bind_fn real_bind = NULL;
    if (real_bind == NULL) real_bind = (bind_fn)dlsym(RTLD_NEXT, "bind");
    const char *to = getenv("PDSERVE_WILDCARD_BIND");
    if (to == NULL || addr == NULL) return real_bind(fd, addr, len);
    if (addr->sa_family == AF_INET && len >= (socklen_t)sizeof(struct sockaddr_in)) {
        struct sockaddr_in a;
        memcpy(&a, addr, sizeof a);
        if (a.sin_addr.s_addr == htonl(INADDR_ANY) && inet_pton(AF_INET, to, &a.sin_addr) == 1)
            return real_bind(fd, (const struct sockaddr *)&a, sizeof a);
    } else if (addr->sa_family == AF_INET6 && len >= (socklen_t)sizeof(struct sockaddr_in6)) {
        struct sockaddr_in6 a;
        memcpy(&a, addr, sizeof a);
        if (IN6_IS_ADDR_UNSPECIFIED(&a.sin6_addr)) {
            struct in_addr v4;
            if (inet_pton(AF_INET, to, &v4) == 1) {
                memset(&a.sin6_addr, 0, sizeof a.sin6_addr);
                a.sin6_addr.s6_addr[10] = 0xff;
                a.sin6_addr.s6_addr[11] = 0xff;
                memcpy(&a.sin6_addr.s6_addr[12], &v4, 4);
                return real_bind(fd, (const struct sockaddr *)&a, sizeof a);
            }
            if (inet_pton(AF_INET6, to, &a.sin6_addr) == 1)
                return real_bind(fd, (const struct sockaddr *)&a, sizeof a);
        }
    }
    return real_bind(fd, addr, len);
}
