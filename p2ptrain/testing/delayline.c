/* The test bed's delay line: frames read from a tap are written back into it DELAY later.
 *
 *     delayline TAP DELAY_SECONDS [ARENA_MIB]
 *
 * One FIFO (a constant delay keeps arrival order), frames stored back to back in a ring arena;
 * each wake-up drains every frame the tap holds, then sends every frame that is due. Prints
 * "ready" once attached; exits when stdin closes. Built by p2ptrain.testing.delayline. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/if.h>
#include <linux/if_tun.h>
#include <poll.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <time.h>
#include <unistd.h>

#define MAX_FRAME 65536u

typedef struct { uint64_t due; uint32_t off, len; } frame_t;

static uint64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

int main(int argc, char **argv) {
    if (argc < 3) { fprintf(stderr, "usage: delayline TAP DELAY_SECONDS [ARENA_MIB]\n"); return 2; }
    double delay_s = atof(argv[2]);
    if (!(delay_s >= 0 && delay_s <= 10)) { fprintf(stderr, "delay %s s: expected 0 .. 10\n", argv[2]); return 2; }
    uint64_t delay = (uint64_t)(delay_s * 1e9);
    size_t arena_size = (size_t)(argc > 3 ? atoi(argv[3]) : 256) << 20;
    size_t nslots = arena_size / 64;  /* a frame is at least 60 bytes on the wire */
    uint8_t *arena = malloc(arena_size);
    frame_t *q = malloc(nslots * sizeof(frame_t));
    if (!arena || !q) { fprintf(stderr, "out of memory\n"); return 1; }

    int fd = open("/dev/net/tun", O_RDWR | O_NONBLOCK);
    struct ifreq ifr;
    memset(&ifr, 0, sizeof ifr);
    ifr.ifr_flags = IFF_TAP | IFF_NO_PI;
    strncpy(ifr.ifr_name, argv[1], IFNAMSIZ - 1);
    if (fd < 0 || ioctl(fd, TUNSETIFF, &ifr) < 0) {
        fprintf(stderr, "cannot attach to tap %s: %s\n", argv[1], strerror(errno));
        return 1;
    }
    /* a frame's delay is only as exact as this process's wake-ups: ask for a real-time priority
     * (it sleeps in ppoll between frames) and keep the default where that is not allowed */
    struct sched_param sp = {.sched_priority = 10};
    sched_setscheduler(0, SCHED_FIFO, &sp);
    printf("ready\n");
    fflush(stdout);

    size_t head = 0, count = 0, wpos = 0;  /* queue of `count` frames from `head`; next write at wpos */
    uint64_t dropped = 0;
    uint8_t scratch[MAX_FRAME];
    struct pollfd fds[2] = {{.fd = fd, .events = POLLIN}, {.fd = 0, .events = POLLIN}};
    for (;;) {
        uint64_t now = now_ns();
        while (count && q[head].due <= now) {
            /* an error (ENOBUFS, link down) is a dropped frame, as on a wire */
            if (write(fd, arena + q[head].off, q[head].len) < 0) dropped++;
            head = (head + 1) % nslots;
            count--;
        }
        struct timespec ts, *tmo = NULL;
        if (count) {
            uint64_t wait = q[head].due - now;
            ts.tv_sec = (time_t)(wait / 1000000000u);
            ts.tv_nsec = (long)(wait % 1000000000u);
            tmo = &ts;
        }
        if (ppoll(fds, 2, tmo, NULL) < 0 && errno != EINTR) { perror("ppoll"); return 1; }
        if (fds[1].revents) {
            ssize_t r = read(0, scratch, sizeof scratch);
            if (r <= 0) break;  /* stdin closed: the test bed is going away */
        }
        if (!(fds[0].revents & POLLIN)) continue;
        uint64_t arrived = now_ns();
        for (;;) {
            if (!count) wpos = 0;
            size_t tail_off = count ? q[head].off : 0;
            /* room for a whole frame at wpos, else at the start of the arena, without reaching the oldest */
            if (count && wpos >= tail_off && arena_size - wpos < MAX_FRAME) wpos = tail_off >= MAX_FRAME ? 0 : arena_size;
            int room = count == 0 || (wpos >= tail_off ? arena_size - wpos >= MAX_FRAME : tail_off - wpos >= MAX_FRAME);
            room = room && count < nslots;
            ssize_t n = read(fd, room ? arena + wpos : scratch, MAX_FRAME);
            if (n < 0) {
                if (errno == EAGAIN || errno == EINTR) break;
                perror("read");
                return 1;
            }
            if (!room) { dropped++; continue; }  /* the queue is full: a tail drop */
            q[(head + count) % nslots] = (frame_t){arrived + delay, (uint32_t)wpos, (uint32_t)n};
            count++;
            wpos += ((size_t)n + 63) & ~(size_t)63;
        }
    }
    if (dropped) fprintf(stderr, "delayline: %llu frames dropped\n", (unsigned long long)dropped);
    return 0;
}
