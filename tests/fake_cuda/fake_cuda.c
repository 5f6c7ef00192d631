/* A fake libcuda.so.1 for tests without a GPU: cuInit, cuDriverGetVersion, cuGetErrorName and the driver's
 * checkpoint API (cuCheckpointProcessLock/Checkpoint/Restore/Unlock/GetState/GetRestoreThreadId), keeping the
 * per-process states the real driver keeps and returning the errors measured on a real one (docs/gpu-checks.md).
 *
 * State is shared between processes in files under $FAKE_CUDA_STATE_DIR:
 *   <pid>        "state S lost L timeout_ms T": created when process <pid> calls cuInit through this library (it
 *                then "uses CUDA"); S = 0 RUNNING, 1 LOCKED, 2 CHECKPOINTED; L = 1 once a restore failed for memory
 *   <pid>.calls  one line per checkpoint call made on <pid> (by any process), in order, e.g.
 *                "lock 60000 0", "checkpoint 0", "restore GPU-aaaa...>GPU-bbbb...,... 0" (the gpuPairs received),
 *                "unlock 401" (the last field: the CUresult returned)
 *   oom          present: the next restore fails with CUDA_ERROR_OUT_OF_MEMORY, and that pid's restores fail with
 *                CUDA_ERROR_OPERATING_SYSTEM from then on (as measured)
 *   <pid>.fail   lines "CALL RC" (CALL: lock|checkpoint|restore|unlock): that call on <pid> returns RC and changes
 *                nothing (to make a step fail)
 * $FAKE_CUDA_DRIVER_VERSION: what cuDriverGetVersion reports (default 13000).
 *
 * Measured errors it copies: a call out of order -> CUDA_ERROR_ILLEGAL_STATE (unlock/restore while RUNNING, restore
 * while LOCKED, unlock while CHECKPOINTED; also lock/checkpoint out of order, not measured); a process that never
 * used CUDA -> CUDA_ERROR_NOT_INITIALIZED; a pid that does not exist -> CUDA_ERROR_OPERATING_SYSTEM.
 * A restore while the target is stopped (state T) does not finish on a real driver until the target is continued;
 * the fake waits for that up to the lock's timeout, then returns CUDA_ERROR_TIMEOUT with the state unchanged
 * (still CHECKPOINTED): the real call would simply not have returned, and TIMEOUT is what a caller bounding its
 * wait reports; like the real one, a restore after SIGCONT then succeeds. GetState of a stopped target blocks
 * as well (measured on an H200): the fake waits up to 60 s, then answers CUDA_ERROR_TIMEOUT. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

typedef int CUresult;
enum { OK = 0, E_INVALID_VALUE = 1, E_OOM = 2, E_NOT_INIT = 3, E_NO_DEVICE = 100, E_OS = 304,
       E_ILLEGAL_STATE = 401, E_NOT_SUPPORTED = 801, E_TIMEOUT = 909, E_UNKNOWN = 999 };
enum { RUNNING = 0, LOCKED = 1, CHECKPOINTED = 2, FAILED = 3 };

typedef struct { unsigned int timeoutMs; unsigned int reserved0; unsigned long long reserved1[7]; } LockArgs;
typedef struct { unsigned long long reserved[8]; } CheckpointArgs;
typedef struct { unsigned char oldUuid[16]; unsigned char newUuid[16]; } GpuPair;
typedef struct { GpuPair *gpuPairs; unsigned int gpuPairsCount; char reserved[44]; unsigned long long reserved1; }
    RestoreArgs;
typedef struct { unsigned long long reserved[8]; } UnlockArgs;

static const char *dir(void) {
    const char *d = getenv("FAKE_CUDA_STATE_DIR");
    return d && *d ? d : "/tmp/fake_cuda";
}

typedef struct { int state, lost, timeout_ms; } Proc;

static void path_of(char *buf, size_t n, int pid, const char *suffix) {
    snprintf(buf, n, "%s/%d%s", dir(), pid, suffix);
}

static int exists(int pid) {
    char p[64];
    snprintf(p, sizeof p, "/proc/%d", pid);
    return pid > 0 && access(p, F_OK) == 0;
}

static char proc_letter(int pid) {
    char p[64], buf[512];
    snprintf(p, sizeof p, "/proc/%d/stat", pid);
    FILE *f = fopen(p, "r");
    if (!f) return 'X';
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    char *r = strrchr(buf, ')');
    return r && r[1] && r[2] ? r[2] : '?';
}

/* open and lock <pid>'s state file: fd >= 0 with *p read, or -1 when the process never called cuInit */
static int open_proc(int pid, Proc *p) {
    char path[4096];
    path_of(path, sizeof path, pid, "");
    int fd = open(path, O_RDWR);
    if (fd < 0) return -1;
    flock(fd, LOCK_EX);
    char buf[256] = {0};
    ssize_t n = pread(fd, buf, sizeof buf - 1, 0);
    if (n < 0) n = 0;
    buf[n] = 0;
    p->state = RUNNING; p->lost = 0; p->timeout_ms = 0;
    sscanf(buf, "state %d lost %d timeout_ms %d", &p->state, &p->lost, &p->timeout_ms);
    return fd;
}

static void write_proc(int fd, const Proc *p) {
    char buf[256];
    int n = snprintf(buf, sizeof buf, "state %d lost %d timeout_ms %d\n", p->state, p->lost, p->timeout_ms);
    if (ftruncate(fd, 0) == 0 && pwrite(fd, buf, (size_t)n, 0) != n) { /* best effort */ }
}

static void close_proc(int fd) { flock(fd, LOCK_UN); close(fd); }

static void record(int pid, const char *what, CUresult rc) {
    char path[4096];
    path_of(path, sizeof path, pid, ".calls");
    FILE *f = fopen(path, "a");
    if (!f) return;
    fprintf(f, "%s %d\n", what, rc);
    fclose(f);
}

/* the result <pid>.fail orders for this call, or -1 */
static int injected(int pid, const char *call) {
    char path[4096], name[64];
    int rc;
    path_of(path, sizeof path, pid, ".fail");
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    int found = -1;
    while (fscanf(f, "%63s %d", name, &rc) == 2)
        if (strcmp(name, call) == 0) { found = rc; break; }
    fclose(f);
    return found;
}

static CUresult done(int pid, const char *what, CUresult rc) { record(pid, what, rc); return rc; }

CUresult cuInit(unsigned int flags) {
    if (flags != 0) return E_INVALID_VALUE;
    mkdir(dir(), 0700);
    char path[4096];
    path_of(path, sizeof path, getpid(), "");
    int fd = open(path, O_RDWR | O_CREAT | O_EXCL, 0600);
    if (fd >= 0) {  /* first cuInit of this process: it now uses CUDA, RUNNING */
        Proc p = {RUNNING, 0, 0};
        write_proc(fd, &p);
        close(fd);
    } else if (errno != EEXIST) {
        return E_UNKNOWN;
    }
    return OK;
}

CUresult cuDriverGetVersion(int *version) {
    if (!version) return E_INVALID_VALUE;
    const char *v = getenv("FAKE_CUDA_DRIVER_VERSION");
    *version = v && *v ? atoi(v) : 13000;
    return OK;
}

CUresult cuGetErrorName(CUresult rc, const char **name) {
    if (!name) return E_INVALID_VALUE;
    switch (rc) {
    case OK: *name = "CUDA_SUCCESS"; return OK;
    case E_INVALID_VALUE: *name = "CUDA_ERROR_INVALID_VALUE"; return OK;
    case E_OOM: *name = "CUDA_ERROR_OUT_OF_MEMORY"; return OK;
    case E_NOT_INIT: *name = "CUDA_ERROR_NOT_INITIALIZED"; return OK;
    case E_NO_DEVICE: *name = "CUDA_ERROR_NO_DEVICE"; return OK;
    case E_OS: *name = "CUDA_ERROR_OPERATING_SYSTEM"; return OK;
    case E_ILLEGAL_STATE: *name = "CUDA_ERROR_ILLEGAL_STATE"; return OK;
    case E_NOT_SUPPORTED: *name = "CUDA_ERROR_NOT_SUPPORTED"; return OK;
    case E_TIMEOUT: *name = "CUDA_ERROR_TIMEOUT"; return OK;
    case E_UNKNOWN: *name = "CUDA_ERROR_UNKNOWN"; return OK;
    default: *name = 0; return E_INVALID_VALUE;
    }
}

/* common entry: the pid exists and uses CUDA; returns 0 with fd and *p, or the CUresult to return */
static CUresult enter(int pid, int *fd, Proc *p) {
    if (!exists(pid)) return E_OS;
    *fd = open_proc(pid, p);
    return *fd < 0 ? E_NOT_INIT : OK;
}

/* wait (polling) while the target is stopped (state T), at most ms milliseconds: 0 once it runs, 1 on the bound */
static int wait_running(int pid, long bound_ms) {
    struct timespec t0, now, nap = {0, 2000000};
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (;;) {
        char c = proc_letter(pid);
        if (c != 'T' && c != 't') return 0;
        clock_gettime(CLOCK_MONOTONIC, &now);
        /* in nanoseconds: milliseconds of the two fields apart truncate toward zero, which let it give up up to
         * 1 ms early (a test measured 199.2 ms for a 200 ms bound) */
        long long ns = (long long)(now.tv_sec - t0.tv_sec) * 1000000000LL + (now.tv_nsec - t0.tv_nsec);
        if (ns >= (long long)bound_ms * 1000000LL) return 1;
        nanosleep(&nap, 0);
    }
}

/* Measured on an H200 (driver 580, 2026-11-26): GetState is answered by a thread inside the target, so it blocks
 * while the target is stopped. The fake blocks too, up to 60 s (a bound the real call does not have), then answers
 * CUDA_ERROR_TIMEOUT. */
#define GETSTATE_STOPPED_BOUND_MS 60000L

CUresult cuCheckpointProcessGetState(int pid, int *state) {
    if (!state) return E_INVALID_VALUE;
    if (!exists(pid)) return E_OS;
    if (wait_running(pid, GETSTATE_STOPPED_BOUND_MS)) return E_TIMEOUT;
    int fd; Proc p;
    CUresult rc = enter(pid, &fd, &p);
    if (rc) return rc;
    *state = p.state;
    close_proc(fd);
    return OK;
}

CUresult cuCheckpointProcessGetRestoreThreadId(int pid, int *tid) {
    if (!tid) return E_INVALID_VALUE;
    int fd; Proc p;
    CUresult rc = enter(pid, &fd, &p);
    if (rc) return rc;
    *tid = pid;
    close_proc(fd);
    return OK;
}

CUresult cuCheckpointProcessLock(int pid, LockArgs *args) {
    int fd; Proc p;
    char what[64];
    snprintf(what, sizeof what, "lock %u", args ? args->timeoutMs : 0);
    CUresult rc = enter(pid, &fd, &p);
    if (rc) return done(pid, what, rc);
    int inj = injected(pid, "lock");
    if (inj >= 0) rc = inj;
    else if (p.state != RUNNING) rc = E_ILLEGAL_STATE;
    else { p.state = LOCKED; p.timeout_ms = args ? (int)args->timeoutMs : 0; write_proc(fd, &p); }
    close_proc(fd);
    return done(pid, what, rc);
}

CUresult cuCheckpointProcessCheckpoint(int pid, CheckpointArgs *args) {
    (void)args;
    int fd; Proc p;
    CUresult rc = enter(pid, &fd, &p);
    if (rc) return done(pid, "checkpoint", rc);
    int inj = injected(pid, "checkpoint");
    if (inj >= 0) rc = inj;
    else if (p.state != LOCKED) rc = E_ILLEGAL_STATE;
    else { p.state = CHECKPOINTED; write_proc(fd, &p); }
    close_proc(fd);
    return done(pid, "checkpoint", rc);
}

static void uuid_text(char *out, const unsigned char *u) {
    sprintf(out, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", u[0], u[1], u[2], u[3],
            u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13], u[14], u[15]);
}

CUresult cuCheckpointProcessRestore(int pid, RestoreArgs *args) {
    char what[4096] = "restore ";
    size_t len = strlen(what);
    if (args && args->gpuPairsCount && args->gpuPairs) {
        for (unsigned i = 0; i < args->gpuPairsCount && len + 90 < sizeof what; i++) {
            char a[48], b[48];
            uuid_text(a, args->gpuPairs[i].oldUuid);
            uuid_text(b, args->gpuPairs[i].newUuid);
            len += (size_t)snprintf(what + len, sizeof what - len, "%s%s>%s", i ? "," : "", a, b);
        }
    } else {
        len += (size_t)snprintf(what + len, sizeof what - len, "-");
    }
    int fd; Proc p;
    CUresult rc = enter(pid, &fd, &p);
    if (rc) return done(pid, what, rc);
    int inj = injected(pid, "restore");
    if (inj >= 0) { close_proc(fd); return done(pid, what, inj); }
    if (p.state != CHECKPOINTED) { close_proc(fd); return done(pid, what, E_ILLEGAL_STATE); }
    if (p.lost) { close_proc(fd); return done(pid, what, E_OS); }
    char oom[4096];
    snprintf(oom, sizeof oom, "%s/oom", dir());
    if (access(oom, F_OK) == 0) {
        p.lost = 1;
        write_proc(fd, &p);
        close_proc(fd);
        return done(pid, what, E_OOM);
    }
    /* the real restore runs on a thread inside the target: it does not finish while the target is stopped */
    close_proc(fd);
    if (wait_running(pid, p.timeout_ms)) return done(pid, what, E_TIMEOUT);
    fd = open_proc(pid, &p);
    if (fd < 0) return done(pid, what, E_OS);
    if (p.state == CHECKPOINTED) { p.state = LOCKED; write_proc(fd, &p); rc = OK; }
    else rc = E_ILLEGAL_STATE;
    close_proc(fd);
    return done(pid, what, rc);
}

CUresult cuCheckpointProcessUnlock(int pid, UnlockArgs *args) {
    (void)args;
    int fd; Proc p;
    CUresult rc = enter(pid, &fd, &p);
    if (rc) return done(pid, "unlock", rc);
    int inj = injected(pid, "unlock");
    if (inj >= 0) rc = inj;
    else if (p.state != LOCKED) rc = E_ILLEGAL_STATE;
    else { p.state = RUNNING; write_proc(fd, &p); }
    close_proc(fd);
    return done(pid, "unlock", rc);
}
