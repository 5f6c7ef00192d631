/*
 * A fake libnvidia-ml.so.1 for tests on machines without an NVIDIA GPU.
 *
 * It exports the NVML functions the broker's NVML inventory calls, with the
 * signatures and struct layouts the real pynvml (nvidia-ml-py) uses, so tests load
 * it through the real bindings (CDLL("libnvidia-ml.so.1") via LD_LIBRARY_PATH).
 *
 * The devices, processes and utilisation come from a line-based state file named by
 * the environment variable FAKE_NVML_STATE. It is re-read whenever its mtime or size
 * changes, so a test can change processes while a broker runs (write a temporary
 * file and rename it over the old one). One fact per line, '#' starts a comment:
 *
 *   driver 550.54.15-fake          driver version string
 *   init_error 9                   nvmlInit fails with this NVML error (9 = driver not loaded)
 *   gpu 0 uuid GPU-...             attributes of device 0 (devices are counted by index)
 *   gpu 0 name NVIDIA H100 80GB HBM3
 *   gpu 0 memory_total 85899345920 bytes
 *   gpu 0 memory_used 524288000    bytes the device uses with no process (baseline);
 *                                  processes' memory is added on top
 *   gpu 0 util 35 10               device utilisation: gpu %, memory %
 *   gpu 0 mig 1                    MIG mode (absent: NOT_SUPPORTED, as on GPUs without MIG)
 *   mig 0 1 1g.10gb 10737418240 MIG-...   a MIG device of gpu 0 at MIG index 1 (of at most 7): its profile,
 *                                  memory in bytes and UUID (default MIG-fa4e<gpu>-<index>-...); GPU instance
 *                                  id = index + 1, compute instance id 0. As on a real A100/H100 in MIG mode,
 *                                  a MIG device has no utilisation counters (device or per process): those
 *                                  calls answer NOT_SUPPORTED, on the parent too while MIG is on.
 *   gpu 0 nvlink 0                 NVLink island: GPUs of one island are NVLink peers (-1: none)
 *   gpu 0 pci_switch 0             PCIe switch; same switch -> common ancestor SINGLE
 *   gpu 0 numa 0                   NUMA node; same node -> NODE, else SYSTEM
 *   gpu 0 proc_util 0              per-process utilisation not supported on this device
 *   gpu 0 lost 1                   every call on this device fails with GPU_IS_LOST
 *   proc 0 1234 104857600 compute 35 10    process on gpu 0: pid, bytes, compute|graphics, sm %, mem %
 *   proc 0 1234 104857600 compute 0 0 1    ... on MIG device 1 of gpu 0 (a 7th field; absent or -1: the
 *                                  whole GPU)
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/time.h>

typedef int nvmlReturn_t;
enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_NOT_FOUND = 6,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_DRIVER_NOT_LOADED = 9,
    NVML_ERROR_GPU_IS_LOST = 15,
    NVML_ERROR_UNKNOWN = 999,
};

#define MAX_GPUS 64
#define MAX_PROCS 256
#define NVLINKS 4
#define MAX_MIG 7 /* MIG devices per GPU (A100/H100: at most 7) */

typedef struct {
    unsigned long long total, free, used;
} nvmlMemory_t;

typedef struct {
    unsigned int version;
    unsigned long long total, reserved, free, used;
} nvmlMemory_v2_t;

typedef struct {
    unsigned int gpu, memory;
} nvmlUtilization_t;

typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId, computeInstanceId;
} nvmlProcessInfo_t; /* pynvml's c_nvmlProcessInfo_v3_t (== _v2_t layout) */

typedef struct {
    unsigned int pid;
    unsigned long long timeStamp;
    unsigned int smUtil, memUtil, encUtil, decUtil;
} nvmlProcessUtilizationSample_t;

typedef struct {
    int present;
    char uuid[96];
    char profile[32];
    unsigned long long memory_total;
} mig_t;

typedef struct {
    int present;
    char uuid[96];
    char name[96];
    unsigned long long memory_total, memory_used;
    unsigned int util_gpu, util_mem;
    int mig; /* -1 not supported */
    int nvlink, pci_switch, numa;
    int proc_util, lost;
    mig_t migs[MAX_MIG];
} gpu_t;

typedef struct {
    int gpu;
    unsigned int pid;
    unsigned long long mem;
    int graphics;
    unsigned int sm, memutil;
    int mig; /* -1: on the whole GPU */
} proc_t;

struct nvmlDevice_st {
    int index;
    int mig; /* -1: the physical GPU; else the MIG device's index on it */
};
typedef struct nvmlDevice_st *nvmlDevice_t;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static gpu_t gpus[MAX_GPUS];
static proc_t procs[MAX_PROCS];
static struct nvmlDevice_st handles[MAX_GPUS];
static struct nvmlDevice_st mig_handles[MAX_GPUS][MAX_MIG];
static int n_gpus, n_procs, init_error, initialized;
static char driver[80] = "550.54.15-fake";
static struct timespec seen_mtime;
static off_t seen_size = -1;
static char seen_path[4096];

static void reset_state(void) {
    memset(gpus, 0, sizeof gpus);
    memset(procs, 0, sizeof procs);
    n_gpus = n_procs = init_error = 0;
    strcpy(driver, "550.54.15-fake");
}

/* The GPU at idx, made present with defaults when a line first names it. */
static gpu_t *touch_gpu(int idx) {
    gpu_t *g = &gpus[idx];
    if (!g->present) {
        g->present = 1;
        g->mig = -1;
        g->nvlink = -1;
        g->proc_util = 1;
        snprintf(g->uuid, sizeof g->uuid, "GPU-fa4e0000-0000-4000-8000-%012d", idx);
        snprintf(g->name, sizeof g->name, "Fake NVIDIA GPU");
        g->memory_total = 80ULL << 30;
    }
    if (idx + 1 > n_gpus) n_gpus = idx + 1;
    return g;
}

static void parse_line(char *line) {
    char *nl = strchr(line, '\n');
    if (nl) *nl = 0;
    char *hash = strchr(line, '#');
    if (hash) *hash = 0;
    char key[32];
    int idx, off = 0;
    if (sscanf(line, " driver %79s", driver) == 1) return;
    if (sscanf(line, " init_error %d", &init_error) == 1) return;
    int slice;
    char profile[32], uuid[96];
    unsigned long long bytes;
    int got = sscanf(line, " mig %d %d %31s %llu %95s", &idx, &slice, profile, &bytes, uuid);
    if (got >= 4 && idx >= 0 && idx < MAX_GPUS && slice >= 0 && slice < MAX_MIG) {
        gpu_t *g = touch_gpu(idx);
        mig_t *m = &g->migs[slice];
        m->present = 1;
        snprintf(m->profile, sizeof m->profile, "%s", profile);
        m->memory_total = bytes;
        if (got == 5) snprintf(m->uuid, sizeof m->uuid, "%s", uuid);
        else snprintf(m->uuid, sizeof m->uuid, "MIG-fa4e%04x-%04x-4000-8000-000000000000", idx, slice);
        return;
    }
    if (sscanf(line, " gpu %d %31s %n", &idx, key, &off) >= 2 && idx >= 0 && idx < MAX_GPUS) {
        gpu_t *g = touch_gpu(idx);
        char *val = line + off;
        if (!strcmp(key, "uuid")) snprintf(g->uuid, sizeof g->uuid, "%s", val);
        else if (!strcmp(key, "name")) snprintf(g->name, sizeof g->name, "%s", val);
        else if (!strcmp(key, "memory_total")) g->memory_total = strtoull(val, NULL, 10);
        else if (!strcmp(key, "memory_used")) g->memory_used = strtoull(val, NULL, 10);
        else if (!strcmp(key, "util")) sscanf(val, "%u %u", &g->util_gpu, &g->util_mem);
        else if (!strcmp(key, "mig")) g->mig = atoi(val);
        else if (!strcmp(key, "nvlink")) g->nvlink = atoi(val);
        else if (!strcmp(key, "pci_switch")) g->pci_switch = atoi(val);
        else if (!strcmp(key, "numa")) g->numa = atoi(val);
        else if (!strcmp(key, "proc_util")) g->proc_util = atoi(val);
        else if (!strcmp(key, "lost")) g->lost = atoi(val);
        return;
    }
    proc_t p = {0};
    p.mig = -1;
    char kind[16] = "compute";
    int n = sscanf(line, " proc %d %u %llu %15s %u %u %d", &p.gpu, &p.pid, &p.mem, kind, &p.sm, &p.memutil, &p.mig);
    if (n >= 3 && n_procs < MAX_PROCS && p.gpu >= 0 && p.gpu < MAX_GPUS) {
        p.graphics = !strcmp(kind, "graphics");
        procs[n_procs++] = p;
    }
}

/* Re-read the state file when it changed. Called with the lock held. */
static void load(void) {
    const char *path = getenv("FAKE_NVML_STATE");
    if (!path) path = "";
    struct stat st;
    if (stat(path, &st) != 0) {
        if (seen_size != -2) reset_state();
        seen_size = -2;
        return;
    }
    if (!strcmp(path, seen_path) && st.st_size == seen_size && st.st_mtim.tv_sec == seen_mtime.tv_sec &&
        st.st_mtim.tv_nsec == seen_mtime.tv_nsec)
        return;
    FILE *f = fopen(path, "r");
    if (!f) return;
    reset_state();
    char line[512];
    while (fgets(line, sizeof line, f)) parse_line(line);
    fclose(f);
    snprintf(seen_path, sizeof seen_path, "%s", path);
    seen_size = st.st_size;
    seen_mtime = st.st_mtim;
}

/* Enter a device call: load state, check init and the handle. Returns the device or sets *ret. */
static gpu_t *enter(nvmlDevice_t dev, nvmlReturn_t *ret) {
    pthread_mutex_lock(&lock);
    load();
    if (!initialized) {
        *ret = NVML_ERROR_UNINITIALIZED;
        return NULL;
    }
    if (!dev || dev->index < 0 || dev->index >= n_gpus || !gpus[dev->index].present ||
        (dev->mig >= 0 && (dev->mig >= MAX_MIG || !gpus[dev->index].migs[dev->mig].present))) {
        *ret = NVML_ERROR_INVALID_ARGUMENT;
        return NULL;
    }
    if (gpus[dev->index].lost) {
        *ret = NVML_ERROR_GPU_IS_LOST;
        return NULL;
    }
    *ret = NVML_SUCCESS;
    return &gpus[dev->index];
}

#define LEAVE(r)                         \
    do {                                 \
        nvmlReturn_t r_ = (r);           \
        pthread_mutex_unlock(&lock);     \
        return r_;                       \
    } while (0)

nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    pthread_mutex_lock(&lock);
    load();
    if (init_error) LEAVE(init_error);
    initialized++;
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }
nvmlReturn_t nvmlInit(void) { return nvmlInitWithFlags(0); }

nvmlReturn_t nvmlShutdown(void) {
    pthread_mutex_lock(&lock);
    if (!initialized) LEAVE(NVML_ERROR_UNINITIALIZED);
    initialized--;
    LEAVE(NVML_SUCCESS);
}

const char *nvmlErrorString(nvmlReturn_t r) {
    switch (r) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    default: return "Unknown Error";
    }
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    pthread_mutex_lock(&lock);
    load();
    if (!initialized) LEAVE(NVML_ERROR_UNINITIALIZED);
    if (strlen(driver) + 1 > length) LEAVE(NVML_ERROR_INSUFFICIENT_SIZE);
    strcpy(version, driver);
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
    pthread_mutex_lock(&lock);
    load();
    if (!initialized) LEAVE(NVML_ERROR_UNINITIALIZED);
    *count = (unsigned int)n_gpus;
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    pthread_mutex_lock(&lock);
    load();
    if (!initialized) LEAVE(NVML_ERROR_UNINITIALIZED);
    if (index >= (unsigned int)n_gpus || !gpus[index].present) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    handles[index].index = (int)index;
    handles[index].mig = -1;
    *device = &handles[index];
    LEAVE(NVML_SUCCESS);
}

static nvmlReturn_t copy_str(const char *src, char *dst, unsigned int length) {
    if (strlen(src) + 1 > length) return NVML_ERROR_INSUFFICIENT_SIZE;
    strcpy(dst, src);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t dev, char *uuid, unsigned int length) {
    nvmlReturn_t r;
    gpu_t *g = enter(dev, &r);
    if (!g) LEAVE(r);
    LEAVE(copy_str(dev->mig >= 0 ? g->migs[dev->mig].uuid : g->uuid, uuid, length));
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t dev, char *name, unsigned int length) {
    nvmlReturn_t r;
    gpu_t *g = enter(dev, &r);
    if (!g) LEAVE(r);
    if (dev->mig < 0) LEAVE(copy_str(g->name, name, length));
    char full[160]; /* as the driver names a MIG device: "NVIDIA A100-SXM4-40GB MIG 1g.5gb" */
    snprintf(full, sizeof full, "%s MIG %s", g->name, g->migs[dev->mig].profile);
    LEAVE(copy_str(full, name, length));
}

nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t dev, unsigned int *index) {
    nvmlReturn_t r;
    gpu_t *g = enter(dev, &r);
    if (!g) LEAVE(r);
    if (dev->mig >= 0) LEAVE(NVML_ERROR_NOT_SUPPORTED); /* a MIG device has no index among the GPUs */
    *index = (unsigned int)dev->index;
    LEAVE(NVML_SUCCESS);
}

/* Whether process i runs on this handle's device: a MIG device's own, or any on the physical GPU. */
static int on_device(int i, nvmlDevice_t dev) {
    return procs[i].gpu == dev->index && (dev->mig < 0 || procs[i].mig == dev->mig);
}

static unsigned long long used_bytes(nvmlDevice_t dev) {
    unsigned long long used = dev->mig < 0 ? gpus[dev->index].memory_used : 0;
    for (int i = 0; i < n_procs; i++)
        if (on_device(i, dev)) used += procs[i].mem;
    return used;
}

static unsigned long long total_bytes(gpu_t *g, nvmlDevice_t dev) {
    return dev->mig >= 0 ? g->migs[dev->mig].memory_total : g->memory_total;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t dev, nvmlMemory_t *mem) {
    nvmlReturn_t r;
    gpu_t *g = enter(dev, &r);
    if (!g) LEAVE(r);
    mem->total = total_bytes(g, dev);
    mem->used = used_bytes(dev);
    mem->free = mem->used < mem->total ? mem->total - mem->used : 0;
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t dev, nvmlMemory_v2_t *mem) {
    nvmlReturn_t r;
    gpu_t *g = enter(dev, &r);
    if (!g) LEAVE(r);
    mem->total = total_bytes(g, dev);
    mem->reserved = 0;
    mem->used = used_bytes(dev);
    mem->free = mem->used < mem->total ? mem->total - mem->used : 0;
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t dev, unsigned int *current, unsigned int *pending) {
    nvmlReturn_t r;
    gpu_t *g = enter(dev, &r);
    if (!g) LEAVE(r);
    if (g->mig < 0 || dev->mig >= 0) LEAVE(NVML_ERROR_NOT_SUPPORTED);
    *current = *pending = (unsigned int)g->mig;
    LEAVE(NVML_SUCCESS);
}

/* --- MIG devices (only while MIG mode is on) ---------------------------------------------- */
nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t dev, unsigned int *count) {
    nvmlReturn_t r;
    gpu_t *g = enter(dev, &r);
    if (!g) LEAVE(r);
    if (g->mig < 0 || dev->mig >= 0) LEAVE(NVML_ERROR_NOT_SUPPORTED);
    *count = MAX_MIG;
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t dev, unsigned int index, nvmlDevice_t *mig) {
    nvmlReturn_t r;
    gpu_t *g = enter(dev, &r);
    if (!g) LEAVE(r);
    if (g->mig < 0 || dev->mig >= 0) LEAVE(NVML_ERROR_NOT_SUPPORTED);
    if (index >= MAX_MIG) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    if (g->mig != 1 || !g->migs[index].present) LEAVE(NVML_ERROR_NOT_FOUND);
    mig_handles[dev->index][index].index = dev->index;
    mig_handles[dev->index][index].mig = (int)index;
    *mig = &mig_handles[dev->index][index];
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceIsMigDeviceHandle(nvmlDevice_t dev, unsigned int *is_mig) {
    nvmlReturn_t r;
    gpu_t *g = enter(dev, &r);
    if (!g) LEAVE(r);
    *is_mig = dev->mig >= 0;
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetDeviceHandleFromMigDeviceHandle(nvmlDevice_t mig, nvmlDevice_t *dev) {
    nvmlReturn_t r;
    gpu_t *g = enter(mig, &r);
    if (!g) LEAVE(r);
    if (mig->mig < 0) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    handles[mig->index].index = mig->index;
    handles[mig->index].mig = -1;
    *dev = &handles[mig->index];
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetGpuInstanceId(nvmlDevice_t dev, unsigned int *id) {
    nvmlReturn_t r;
    gpu_t *g = enter(dev, &r);
    if (!g) LEAVE(r);
    if (dev->mig < 0) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    *id = (unsigned int)dev->mig + 1;
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetComputeInstanceId(nvmlDevice_t dev, unsigned int *id) {
    nvmlReturn_t r;
    gpu_t *g = enter(dev, &r);
    if (!g) LEAVE(r);
    if (dev->mig < 0) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    *id = 0;
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t dev, nvmlUtilization_t *util) {
    nvmlReturn_t r;
    gpu_t *g = enter(dev, &r);
    if (!g) LEAVE(r);
    if (dev->mig >= 0 || g->mig == 1) LEAVE(NVML_ERROR_NOT_SUPPORTED);
    util->gpu = g->util_gpu;
    util->memory = g->util_mem;
    LEAVE(NVML_SUCCESS);
}

static nvmlReturn_t list_procs(nvmlDevice_t dev, unsigned int *count, nvmlProcessInfo_t *infos, int graphics) {
    nvmlReturn_t r;
    gpu_t *g = enter(dev, &r);
    if (!g) LEAVE(r);
    unsigned int n = 0;
    for (int i = 0; i < n_procs; i++)
        if (on_device(i, dev) && procs[i].graphics == graphics) n++;
    if (n == 0) {
        *count = 0;
        LEAVE(NVML_SUCCESS);
    }
    if (!infos || *count < n) {
        *count = n;
        LEAVE(NVML_ERROR_INSUFFICIENT_SIZE);
    }
    unsigned int k = 0;
    for (int i = 0; i < n_procs; i++) {
        if (!on_device(i, dev) || procs[i].graphics != graphics) continue;
        infos[k].pid = procs[i].pid;
        infos[k].usedGpuMemory = procs[i].mem;
        infos[k].gpuInstanceId = procs[i].mig >= 0 ? (unsigned int)procs[i].mig + 1 : 0xFFFFFFFFu;
        infos[k].computeInstanceId = procs[i].mig >= 0 ? 0 : 0xFFFFFFFFu;
        k++;
    }
    *count = k;
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t dev, unsigned int *count, nvmlProcessInfo_t *infos) {
    return list_procs(dev, count, infos, 0);
}

nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v3(nvmlDevice_t dev, unsigned int *count, nvmlProcessInfo_t *infos) {
    return list_procs(dev, count, infos, 1);
}

nvmlReturn_t nvmlDeviceGetProcessUtilization(nvmlDevice_t dev, nvmlProcessUtilizationSample_t *samples,
                                             unsigned int *count, unsigned long long lastSeen) {
    (void)lastSeen;
    nvmlReturn_t r;
    gpu_t *g = enter(dev, &r);
    if (!g) LEAVE(r);
    if (!g->proc_util || dev->mig >= 0 || g->mig == 1) LEAVE(NVML_ERROR_NOT_SUPPORTED);
    unsigned int n = 0;
    for (int i = 0; i < n_procs; i++)
        if (procs[i].gpu == dev->index) n++;
    if (n == 0) LEAVE(NVML_ERROR_NOT_FOUND);
    if (!samples || *count < n) {
        *count = n;
        LEAVE(NVML_ERROR_INSUFFICIENT_SIZE);
    }
    struct timeval tv;
    gettimeofday(&tv, NULL);
    unsigned long long now = (unsigned long long)tv.tv_sec * 1000000ULL + (unsigned long long)tv.tv_usec;
    unsigned int k = 0;
    for (int i = 0; i < n_procs; i++) {
        if (procs[i].gpu != dev->index) continue;
        samples[k].pid = procs[i].pid;
        samples[k].timeStamp = now;
        samples[k].smUtil = procs[i].sm;
        samples[k].memUtil = procs[i].memutil;
        samples[k].encUtil = samples[k].decUtil = 0;
        k++;
    }
    *count = k;
    LEAVE(NVML_SUCCESS);
}

/* nvmlGpuTopologyLevel_t: INTERNAL 0, SINGLE 10, MULTIPLE 20, HOSTBRIDGE 30, NODE 40, SYSTEM 50 */
nvmlReturn_t nvmlDeviceGetTopologyCommonAncestor(nvmlDevice_t a, nvmlDevice_t b, unsigned int *level) {
    nvmlReturn_t r;
    gpu_t *ga = enter(a, &r);
    if (!ga) LEAVE(r);
    if (a->mig >= 0 || (b && b->mig >= 0)) LEAVE(NVML_ERROR_NOT_SUPPORTED);
    if (!b || b->index < 0 || b->index >= n_gpus || !gpus[b->index].present) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    gpu_t *gb = &gpus[b->index];
    if (a->index == b->index) *level = 0;
    else if (ga->pci_switch == gb->pci_switch) *level = 10;
    else if (ga->numa == gb->numa) *level = 40;
    else *level = 50;
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetNvLinkState(nvmlDevice_t dev, unsigned int link, unsigned int *active) {
    nvmlReturn_t r;
    gpu_t *g = enter(dev, &r);
    if (!g) LEAVE(r);
    if (g->nvlink < 0 || dev->mig >= 0) LEAVE(NVML_ERROR_NOT_SUPPORTED);
    if (link >= NVLINKS) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    *active = 1;
    LEAVE(NVML_SUCCESS);
}

/* nvmlGpuP2PCapsIndex_t: NVLINK = 2; nvmlGpuP2PStatus_t: OK = 0, NOT_SUPPORTED = 5 */
nvmlReturn_t nvmlDeviceGetP2PStatus(nvmlDevice_t a, nvmlDevice_t b, int caps, int *status) {
    nvmlReturn_t r;
    gpu_t *ga = enter(a, &r);
    if (!ga) LEAVE(r);
    if (a->mig >= 0 || (b && b->mig >= 0)) LEAVE(NVML_ERROR_NOT_SUPPORTED);
    if (!b || b->index < 0 || b->index >= n_gpus || !gpus[b->index].present) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    gpu_t *gb = &gpus[b->index];
    if (caps == 2) *status = (ga->nvlink >= 0 && ga->nvlink == gb->nvlink) ? 0 : 5;
    else *status = 0;
    LEAVE(NVML_SUCCESS);
}
