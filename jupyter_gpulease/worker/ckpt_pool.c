/* The checkpoint's host memory, faulted in ahead (issue 33): preloaded into a worker (LD_PRELOAD) by
 * jupyter_gpulease/worker/ckpt_pool.py, which says why and builds it.
 *
 * The CUDA driver's checkpoint (driver 580) copies a process's GPU memory into one new anonymous mapping of the
 * footprint's size, from one thread inside the process, at the speed of page faults. gpulease_pool_prepare() faults
 * a region in beforehand (huge pages advised); the next anonymous private mapping of at least 256 MiB that fits in it
 * is served from it (its tail given back), once. Every other mmap passes through unchanged.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/mman.h>
#include <sys/types.h>
#include <unistd.h>

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

typedef void *(*mmap_fn)(void *, size_t, int, int, int, off_t);
static mmap_fn real_mmap;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static void *pool;         /* the prepared region, or NULL */
static size_t pool_len;
static long handed;        /* how many mappings were served from a pool */
static const size_t LARGE = (size_t)256 << 20;

static void init(void) {
  if (!real_mmap) real_mmap = (mmap_fn)dlsym(RTLD_NEXT, "mmap");
}

static int anonymous_large(void *addr, size_t len, int flags, int fd) {
  return addr == NULL && fd == -1 && (flags & MAP_ANONYMOUS) && (flags & MAP_PRIVATE) && !(flags & MAP_FIXED) &&
         len >= LARGE;
}

/* Map and fault in len bytes (huge pages advised) for the next large anonymous mapping; 0, or -1 (errno set). */
int gpulease_pool_prepare(size_t len) {
  init();
  pthread_mutex_lock(&mu);
  if (pool) munmap(pool, pool_len);
  pool = NULL;
  void *p = real_mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    pthread_mutex_unlock(&mu);
    return -1;
  }
  madvise(p, len, MADV_HUGEPAGE);
  if (madvise(p, len, MADV_POPULATE_WRITE) != 0) {
    if (errno != EINVAL) { /* no memory for it (ENOMEM): give up, never touch pages the kernel cannot back */
      int e = errno;
      munmap(p, len);
      pthread_mutex_unlock(&mu);
      errno = e;
      return -1;
    }
    long page = sysconf(_SC_PAGESIZE); /* before Linux 5.14 (EINVAL): touch every page */
    for (size_t i = 0; i < len; i += (size_t)page) ((volatile char *)p)[i] = 0;
  }
  pool = p;
  pool_len = len;
  pthread_mutex_unlock(&mu);
  return 0;
}

/* Give an unused pool back. */
void gpulease_pool_drop(void) {
  pthread_mutex_lock(&mu);
  if (pool) munmap(pool, pool_len);
  pool = NULL;
  pool_len = 0;
  pthread_mutex_unlock(&mu);
}

long gpulease_pool_handed(void) { return handed; }

/* The prepared region not yet handed out (its length in *len), or NULL: for the device check's variants. */
void *gpulease_pool_region(size_t *len) {
  pthread_mutex_lock(&mu);
  void *p = pool;
  *len = pool ? pool_len : 0;
  pthread_mutex_unlock(&mu);
  return p;
}

void *mmap(void *addr, size_t len, int prot, int flags, int fd, off_t off) {
  init();
  if (anonymous_large(addr, len, flags, fd)) {
    pthread_mutex_lock(&mu);
    if (pool && len <= pool_len) {
      long page = sysconf(_SC_PAGESIZE);
      size_t keep = (len + (size_t)page - 1) / (size_t)page * (size_t)page;
      void *p = pool;
      if (pool_len > keep) munmap((char *)pool + keep, pool_len - keep);
      pool = NULL;
      pool_len = 0;
      handed++;
      pthread_mutex_unlock(&mu);
      if (prot != (PROT_READ | PROT_WRITE)) mprotect(p, keep, prot);
      return p;
    }
    pthread_mutex_unlock(&mu);
  }
  return real_mmap(addr, len, prot, flags, fd, off);
}

void *mmap64(void *addr, size_t len, int prot, int flags, int fd, off_t off) {
  return mmap(addr, len, prot, flags, fd, off);
}
