/* A block's payload read straight into its pieces and hashed, in one call
   that Python makes with the GIL dropped (tools/xxh3_calls.py --native): the
   native scatter + check issue #45 asks about, built only to measure what it
   would gain; the library ships no compiled code. */
#define _GNU_SOURCE
#include <errno.h>
#include <stdint.h>
#include <sys/uio.h>
#include <unistd.h>

#define MAX_IOV 1024

typedef int (*update_fn)(void *state, const void *data, size_t len);

/* Fill the n pieces (addresses, sizes) from fd at offset, in runs of about
   run_bytes, feeding each run's pieces to update(state, ...) once it has
   landed, while it is in the CPU cache. Returns the bytes read, or -1 if
   the file ends first or a read fails. */
long long read_hash(int fd, long long offset, const uint64_t *addrs, const uint64_t *sizes, int n,
                    void *state, update_fn update, long long run_bytes) {
    struct iovec run[MAX_IOV], rest[MAX_IOV];
    long long total = 0;
    int i = 0;
    while (i < n) {
        int k = 0;
        long long size = 0;
        while (i + k < n && k < MAX_IOV && (k == 0 || size < run_bytes)) {
            run[k].iov_base = (void *)(uintptr_t)addrs[i + k];
            run[k].iov_len = sizes[i + k];
            size += sizes[i + k];
            k++;
        }
        long long done = 0;
        while (done < size) { /* a short read: the rest of the run */
            long long skip = done;
            int m = 0;
            for (int j = 0; j < k; j++) {
                if (skip >= (long long)run[j].iov_len) {
                    skip -= run[j].iov_len;
                    continue;
                }
                rest[m].iov_base = (char *)run[j].iov_base + skip;
                rest[m].iov_len = run[j].iov_len - skip;
                skip = 0;
                m++;
            }
            ssize_t got = preadv(fd, rest, m, offset + done);
            if (got < 0 && errno == EINTR)
                continue;
            if (got <= 0)
                return -1;
            done += got;
        }
        for (int j = 0; j < k; j++)
            update(state, run[j].iov_base, run[j].iov_len);
        offset += size;
        total += size;
        i += k;
    }
    return total;
}
