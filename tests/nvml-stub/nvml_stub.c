/*
 * A stand-in for NVIDIA's libnvidia-ml.so.1, for spotguard's tests on machines without a GPU.
 *
 * It exports, with the C ABI of NVIDIA's public nvml.h, every NVML function nvml-wrapper 0.13
 * calls on spotguard's paths (NvmlProbe: init, device enumeration, readings, field values,
 * NVLink, the XID/ECC event set, shutdown). nvml-wrapper resolves every symbol at load time but
 * keeps a missing one as an error until the function is called, so nothing else is exported: a
 * call spotguard starts making without this file learning it shows up as FailedToLoadSymbol.
 *
 * Types, enum values, struct layouts and field ids are written here from nvml.h (NVML 12.x):
 * nvmlReturn_t, nvmlMemory_v2_t, nvmlUtilization_t, nvmlFieldValue_t, nvmlEventData_t.
 *
 * Driven by a scenario file named by $NVML_STUB_SCENARIO, read at nvmlInit_v2 (missing variable
 * or unreadable file => NVML_ERROR_DRIVER_NOT_LOADED). Line format, `#` starts a comment:
 *
 *   driver 570.124.06                 driver version string
 *   init_error N                      nvmlInit_v2 returns N
 *   device                            starts a new device (index 0, 1, ...); keys below apply to it
 *   uuid GPU-...                      name NVIDIA H100 80GB HBM3
 *   temperature C                     power_mw MW            power_limit_mw MW
 *   utilization GPU MEM               memory TOTAL_BYTES USED_BYTES
 *   ecc_mode 0|1                      ecc corrected|uncorrected volatile|aggregate N
 *   retired_pages single|double N     retired_pending 0|1
 *   throttle BITS                     pcie_replay N          energy_mj N
 *   field ID VALUE                    (u64; ids not listed answer NOT_SUPPORTED per field)
 *   (a key given twice for a device: the later line wins)
 *   nvlinks N                         N links, all up, error counters from `nvlink_errors`
 *   nvlink_errors REPLAY RECOVERY CRC_FLIT CRC_DATA
 *   unsupported CALL                  CALL answers NVML_ERROR_NOT_SUPPORTED; CALL is one of
 *                                     uuid name temperature power power_limit utilization memory
 *                                     ecc_mode ecc retired_pages retired_pending throttle
 *                                     pcie_replay energy field_values nvlink events
 *   hang CALL                         CALL blocks forever (same names)
 *   lost_after MS                     every call on this device answers GPU_IS_LOST MS after init
 *   event MS xid N | sbe | dbe        delivered through nvmlEventSetWait_v2 MS after init
 *
 * $NVML_STUB_TRACE, when set, names a file each call appends its function name to.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* ---- nvml.h ---------------------------------------------------------------------------- */

typedef enum nvmlReturn_enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_NO_PERMISSION = 4,
    NVML_ERROR_NOT_FOUND = 6,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_DRIVER_NOT_LOADED = 9,
    NVML_ERROR_TIMEOUT = 10,
    NVML_ERROR_GPU_IS_LOST = 15,
    NVML_ERROR_MEMORY = 20,
    NVML_ERROR_UNKNOWN = 999
} nvmlReturn_t;

typedef enum { NVML_FEATURE_DISABLED = 0, NVML_FEATURE_ENABLED = 1 } nvmlEnableState_t;
typedef enum { NVML_TEMPERATURE_GPU = 0 } nvmlTemperatureSensors_t;
typedef enum {
    NVML_MEMORY_ERROR_TYPE_CORRECTED = 0,
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
} nvmlMemoryErrorType_t;
typedef enum { NVML_VOLATILE_ECC = 0, NVML_AGGREGATE_ECC = 1 } nvmlEccCounterType_t;
typedef enum {
    NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS = 0,
    NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR = 1
} nvmlPageRetirementCause_t;
typedef enum {
    NVML_NVLINK_ERROR_DL_REPLAY = 0,
    NVML_NVLINK_ERROR_DL_RECOVERY = 1,
    NVML_NVLINK_ERROR_DL_CRC_FLIT = 2,
    NVML_NVLINK_ERROR_DL_CRC_DATA = 3
} nvmlNvLinkErrorCounter_t;
typedef enum {
    NVML_VALUE_TYPE_DOUBLE = 0,
    NVML_VALUE_TYPE_UNSIGNED_INT = 1,
    NVML_VALUE_TYPE_UNSIGNED_LONG = 2,
    NVML_VALUE_TYPE_UNSIGNED_LONG_LONG = 3,
    NVML_VALUE_TYPE_SIGNED_LONG_LONG = 4
} nvmlValueType_t;

#define nvmlEventTypeSingleBitEccError 0x0000000000000001LL
#define nvmlEventTypeDoubleBitEccError 0x0000000000000002LL
#define nvmlEventTypeXidCriticalError 0x0000000000000008LL

#define NVML_FI_DEV_NVLINK_LINK_COUNT 91

typedef struct nvmlUtilization_st {
    unsigned int gpu;
    unsigned int memory;
} nvmlUtilization_t;

typedef struct nvmlMemory_v2_st {
    unsigned int version;
    unsigned long long total;
    unsigned long long reserved;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_v2_t;
/* NVML_STRUCT_VERSION(Memory, 2) */
#define nvmlMemory_v2 ((unsigned int)(sizeof(nvmlMemory_v2_t) | (2 << 24U)))

typedef union nvmlValue_st {
    double dVal;
    int siVal;
    unsigned int uiVal;
    unsigned long ulVal;
    unsigned long long ullVal;
    signed long long sllVal;
    unsigned short usVal;
} nvmlValue_t;

typedef struct nvmlFieldValue_st {
    unsigned int fieldId;
    unsigned int scopeId;
    long long timestamp;
    long long latencyUsec;
    nvmlValueType_t valueType;
    nvmlReturn_t nvmlReturn;
    nvmlValue_t value;
} nvmlFieldValue_t;

struct nvmlDevice_st;
typedef struct nvmlDevice_st *nvmlDevice_t;
struct nvmlEventSet_st;
typedef struct nvmlEventSet_st *nvmlEventSet_t;

typedef struct nvmlEventData_st {
    nvmlDevice_t device;
    unsigned long long eventType;
    unsigned long long eventData;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlEventData_t;

#define EXPORT __attribute__((visibility("default")))

/* ---- scenario -------------------------------------------------------------------------- */

#define MAX_DEVICES 16
#define MAX_FIELDS 32
#define MAX_EVENTS 64
#define MAX_CALLS 32

enum call {
    C_UUID, C_NAME, C_TEMPERATURE, C_POWER, C_POWER_LIMIT, C_UTILIZATION, C_MEMORY, C_ECC_MODE,
    C_ECC, C_RETIRED_PAGES, C_RETIRED_PENDING, C_THROTTLE, C_PCIE_REPLAY, C_ENERGY,
    C_FIELD_VALUES, C_NVLINK, C_EVENTS, C_COUNT
};
static const char *CALL_NAMES[C_COUNT] = {
    "uuid", "name", "temperature", "power", "power_limit", "utilization", "memory", "ecc_mode",
    "ecc", "retired_pages", "retired_pending", "throttle", "pcie_replay", "energy",
    "field_values", "nvlink", "events"
};

struct nvmlDevice_st {
    unsigned int index;
    char uuid[96];
    char name[96];
    unsigned int temperature, power_mw, power_limit_mw, util_gpu, util_mem;
    unsigned long long mem_total, mem_used;
    int ecc_mode;
    unsigned long long ecc[2][2]; /* [error type][counter type] */
    unsigned int retired[2];      /* [cause] */
    int retired_pending;
    unsigned long long throttle, energy;
    unsigned int pcie_replay;
    unsigned int field_ids[MAX_FIELDS];
    unsigned long long field_values[MAX_FIELDS];
    int nfields;
    unsigned int nvlinks;
    unsigned long long nvlink_errors[4];
    int unsupported[C_COUNT];
    int hang[C_COUNT];
    long lost_after_ms; /* -1: never */
};

struct event {
    long at_ms;
    int device;
    unsigned long long type;
    unsigned long long data;
};

struct nvmlEventSet_st {
    unsigned long long registered[MAX_DEVICES];
    int delivered[MAX_EVENTS];
};

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static int initialised; /* nvmlInit_v2 reference count */
static char driver[80] = "550.54.15";
static int init_error;
static struct nvmlDevice_st devices[MAX_DEVICES];
static int ndevices;
static struct event events[MAX_EVENTS];
static int nevents;
static struct timespec started;

static void trace(const char *fn) {
    const char *path = getenv("NVML_STUB_TRACE");
    if (!path || !*path) return;
    FILE *f = fopen(path, "a");
    if (!f) return;
    fprintf(f, "%s\n", fn);
    fclose(f);
}

static long elapsed_ms(void) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (now.tv_sec - started.tv_sec) * 1000 + (now.tv_nsec - started.tv_nsec) / 1000000;
}

static int call_by_name(const char *name) {
    for (int i = 0; i < C_COUNT; i++)
        if (strcmp(CALL_NAMES[i], name) == 0) return i;
    return -1;
}

static void chomp(char *s) {
    size_t n = strlen(s);
    while (n && (s[n - 1] == '\n' || s[n - 1] == '\r' || s[n - 1] == ' ')) s[--n] = 0;
}

/* Parse the scenario; returns 0 or -1 (with a message on stderr naming the line). */
static int load_scenario(const char *path) {
    FILE *f = fopen(path, "r");
    if (!f) {
        fprintf(stderr, "nvml-stub: cannot open scenario %s: %s\n", path, strerror(errno));
        return -1;
    }
    memset(devices, 0, sizeof devices);
    ndevices = 0;
    nevents = 0;
    init_error = 0;
    char line[512];
    int lineno = 0;
    struct nvmlDevice_st *d = NULL;
    while (fgets(line, sizeof line, f)) {
        lineno++;
        char *hash = strchr(line, '#');
        if (hash) *hash = 0;
        chomp(line);
        char key[64] = "", a[160] = "", b[160] = "", c[64] = "", e[64] = "";
        int n = sscanf(line, "%63s %159s %159s %63s %63s", key, a, b, c, e);
        if (n <= 0) continue;
        int ok = 1;
        if (strcmp(key, "driver") == 0) {
            snprintf(driver, sizeof driver, "%.79s", a);
        } else if (strcmp(key, "init_error") == 0) {
            init_error = atoi(a);
        } else if (strcmp(key, "device") == 0) {
            if (ndevices == MAX_DEVICES) { ok = 0; goto done; }
            d = &devices[ndevices];
            d->index = (unsigned int)ndevices++;
            d->lost_after_ms = -1;
            snprintf(d->uuid, sizeof d->uuid, "GPU-00000000-0000-0000-0000-%012u", d->index);
            snprintf(d->name, sizeof d->name, "NVIDIA Stub GPU");
        } else if (strcmp(key, "event") == 0) {
            if (!d || nevents == MAX_EVENTS || n < 3) { ok = 0; goto done; }
            struct event *ev = &events[nevents++];
            ev->at_ms = atol(a);
            ev->device = (int)d->index;
            if (strcmp(b, "xid") == 0 && n >= 4) {
                ev->type = nvmlEventTypeXidCriticalError;
                ev->data = strtoull(c, NULL, 0);
            } else if (strcmp(b, "sbe") == 0) {
                ev->type = nvmlEventTypeSingleBitEccError;
            } else if (strcmp(b, "dbe") == 0) {
                ev->type = nvmlEventTypeDoubleBitEccError;
            } else {
                ok = 0;
            }
        } else if (!d) {
            ok = 0;
        } else if (strcmp(key, "uuid") == 0) {
            snprintf(d->uuid, sizeof d->uuid, "%.95s", a);
        } else if (strcmp(key, "name") == 0) {
            /* the rest of the line */
            const char *rest = line + strlen("name");
            while (*rest == ' ') rest++;
            snprintf(d->name, sizeof d->name, "%.95s", rest);
        } else if (strcmp(key, "temperature") == 0) {
            d->temperature = (unsigned int)strtoul(a, NULL, 0);
        } else if (strcmp(key, "power_mw") == 0) {
            d->power_mw = (unsigned int)strtoul(a, NULL, 0);
        } else if (strcmp(key, "power_limit_mw") == 0) {
            d->power_limit_mw = (unsigned int)strtoul(a, NULL, 0);
        } else if (strcmp(key, "utilization") == 0 && n >= 3) {
            d->util_gpu = (unsigned int)strtoul(a, NULL, 0);
            d->util_mem = (unsigned int)strtoul(b, NULL, 0);
        } else if (strcmp(key, "memory") == 0 && n >= 3) {
            d->mem_total = strtoull(a, NULL, 0);
            d->mem_used = strtoull(b, NULL, 0);
        } else if (strcmp(key, "ecc_mode") == 0) {
            d->ecc_mode = atoi(a);
        } else if (strcmp(key, "ecc") == 0 && n >= 4) {
            int t = strcmp(a, "corrected") == 0 ? 0 : strcmp(a, "uncorrected") == 0 ? 1 : -1;
            int k = strcmp(b, "volatile") == 0 ? 0 : strcmp(b, "aggregate") == 0 ? 1 : -1;
            if (t < 0 || k < 0) ok = 0;
            else d->ecc[t][k] = strtoull(c, NULL, 0);
        } else if (strcmp(key, "retired_pages") == 0 && n >= 3) {
            int cause = strcmp(a, "single") == 0 ? 0 : strcmp(a, "double") == 0 ? 1 : -1;
            if (cause < 0) ok = 0;
            else d->retired[cause] = (unsigned int)strtoul(b, NULL, 0);
        } else if (strcmp(key, "retired_pending") == 0) {
            d->retired_pending = atoi(a);
        } else if (strcmp(key, "throttle") == 0) {
            d->throttle = strtoull(a, NULL, 0);
        } else if (strcmp(key, "pcie_replay") == 0) {
            d->pcie_replay = (unsigned int)strtoul(a, NULL, 0);
        } else if (strcmp(key, "energy_mj") == 0) {
            d->energy = strtoull(a, NULL, 0);
        } else if (strcmp(key, "field") == 0 && n >= 3) {
            /* A later line for the same field id replaces the earlier value. */
            unsigned int id = (unsigned int)strtoul(a, NULL, 0);
            int slot = 0;
            while (slot < d->nfields && d->field_ids[slot] != id) slot++;
            if (slot == MAX_FIELDS) ok = 0;
            else {
                d->field_ids[slot] = id;
                d->field_values[slot] = strtoull(b, NULL, 0);
                if (slot == d->nfields) d->nfields++;
            }
        } else if (strcmp(key, "nvlinks") == 0) {
            d->nvlinks = (unsigned int)strtoul(a, NULL, 0);
        } else if (strcmp(key, "nvlink_errors") == 0 && n >= 5) {
            d->nvlink_errors[0] = strtoull(a, NULL, 0);
            d->nvlink_errors[1] = strtoull(b, NULL, 0);
            d->nvlink_errors[2] = strtoull(c, NULL, 0);
            d->nvlink_errors[3] = strtoull(e, NULL, 0);
        } else if (strcmp(key, "unsupported") == 0 || strcmp(key, "hang") == 0) {
            int call = call_by_name(a);
            if (call < 0) ok = 0;
            else if (key[0] == 'u') d->unsupported[call] = 1;
            else d->hang[call] = 1;
        } else if (strcmp(key, "lost_after") == 0) {
            d->lost_after_ms = atol(a);
        } else {
            ok = 0;
        }
    done:
        if (!ok) {
            fprintf(stderr, "nvml-stub: %s:%d: cannot parse: %s\n", path, lineno, line);
            fclose(f);
            return -1;
        }
    }
    fclose(f);
    return 0;
}

/* ---- helpers --------------------------------------------------------------------------- */

static int valid(nvmlDevice_t d) {
    return d >= devices && d < devices + ndevices;
}

/* The common prologue of a device call: initialised, valid handle, lost, hang, unsupported. */
static nvmlReturn_t device_call(const char *fn, nvmlDevice_t d, int call) {
    trace(fn);
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    if (!valid(d)) return NVML_ERROR_INVALID_ARGUMENT;
    if (d->lost_after_ms >= 0 && elapsed_ms() >= d->lost_after_ms) return NVML_ERROR_GPU_IS_LOST;
    if (call >= 0 && d->hang[call]) {
        trace("hanging");
        for (;;) pause();
    }
    if (call >= 0 && d->unsupported[call]) return NVML_ERROR_NOT_SUPPORTED;
    return NVML_SUCCESS;
}

#define PROLOGUE(d, call)                                              \
    do {                                                               \
        nvmlReturn_t r_ = device_call(__func__, (d), (call));          \
        if (r_ != NVML_SUCCESS) return r_;                             \
    } while (0)

static nvmlReturn_t copy_string(char *out, unsigned int length, const char *value) {
    if (!out) return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(value) + 1 > length) return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(out, value, strlen(value) + 1);
    return NVML_SUCCESS;
}

/* ---- init / system --------------------------------------------------------------------- */

EXPORT nvmlReturn_t nvmlInit_v2(void) {
    trace(__func__);
    pthread_mutex_lock(&lock);
    nvmlReturn_t r = NVML_SUCCESS;
    if (initialised == 0) {
        const char *path = getenv("NVML_STUB_SCENARIO");
        if (!path || !*path || load_scenario(path) != 0) r = NVML_ERROR_DRIVER_NOT_LOADED;
        else if (init_error) r = (nvmlReturn_t)init_error;
        if (r == NVML_SUCCESS) clock_gettime(CLOCK_MONOTONIC, &started);
    }
    if (r == NVML_SUCCESS) initialised++;
    pthread_mutex_unlock(&lock);
    return r;
}

EXPORT nvmlReturn_t nvmlShutdown(void) {
    trace(__func__);
    pthread_mutex_lock(&lock);
    nvmlReturn_t r = initialised ? NVML_SUCCESS : NVML_ERROR_UNINITIALIZED;
    if (initialised) initialised--;
    pthread_mutex_unlock(&lock);
    return r;
}

EXPORT const char *nvmlErrorString(nvmlReturn_t result) {
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NO_PERMISSION: return "Insufficient Permissions";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case NVML_ERROR_TIMEOUT: return "Timeout";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    default: return "Unknown Error";
    }
}

EXPORT nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    trace(__func__);
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    return copy_string(version, length, driver);
}

EXPORT nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *deviceCount) {
    trace(__func__);
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    if (!deviceCount) return NVML_ERROR_INVALID_ARGUMENT;
    *deviceCount = (unsigned int)ndevices;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    trace(__func__);
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    if (!device || index >= (unsigned int)ndevices) return NVML_ERROR_INVALID_ARGUMENT;
    struct nvmlDevice_st *d = &devices[index];
    if (d->lost_after_ms >= 0 && elapsed_ms() >= d->lost_after_ms) return NVML_ERROR_GPU_IS_LOST;
    *device = d;
    return NVML_SUCCESS;
}

/* ---- device readings ------------------------------------------------------------------- */

EXPORT nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index) {
    PROLOGUE(device, -1);
    if (!index) return NVML_ERROR_INVALID_ARGUMENT;
    *index = device->index;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length) {
    PROLOGUE(device, C_UUID);
    return copy_string(uuid, length, device->uuid);
}

EXPORT nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length) {
    PROLOGUE(device, C_NAME);
    return copy_string(name, length, device->name);
}

EXPORT nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t device,
                                             nvmlTemperatureSensors_t sensorType,
                                             unsigned int *temp) {
    PROLOGUE(device, C_TEMPERATURE);
    if (!temp || sensorType != NVML_TEMPERATURE_GPU) return NVML_ERROR_INVALID_ARGUMENT;
    *temp = device->temperature;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t device, unsigned int *power) {
    PROLOGUE(device, C_POWER);
    if (!power) return NVML_ERROR_INVALID_ARGUMENT;
    *power = device->power_mw;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetEnforcedPowerLimit(nvmlDevice_t device, unsigned int *limit) {
    PROLOGUE(device, C_POWER_LIMIT);
    if (!limit) return NVML_ERROR_INVALID_ARGUMENT;
    *limit = device->power_limit_mw;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device,
                                                  nvmlUtilization_t *utilization) {
    PROLOGUE(device, C_UTILIZATION);
    if (!utilization) return NVML_ERROR_INVALID_ARGUMENT;
    utilization->gpu = device->util_gpu;
    utilization->memory = device->util_mem;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory) {
    PROLOGUE(device, C_MEMORY);
    if (!memory) return NVML_ERROR_INVALID_ARGUMENT;
    /* NVML checks the caller's struct version (NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25). */
    if (memory->version != nvmlMemory_v2) return (nvmlReturn_t)25;
    memory->total = device->mem_total;
    memory->used = device->mem_used;
    memory->reserved = 0;
    memory->free = device->mem_total > device->mem_used ? device->mem_total - device->mem_used : 0;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetEccMode(nvmlDevice_t device, nvmlEnableState_t *current,
                                         nvmlEnableState_t *pending) {
    PROLOGUE(device, C_ECC_MODE);
    if (!current || !pending) return NVML_ERROR_INVALID_ARGUMENT;
    *current = device->ecc_mode ? NVML_FEATURE_ENABLED : NVML_FEATURE_DISABLED;
    *pending = *current;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t device,
                                                nvmlMemoryErrorType_t errorType,
                                                nvmlEccCounterType_t counterType,
                                                unsigned long long *eccCounts) {
    PROLOGUE(device, C_ECC);
    if (!eccCounts || (unsigned)errorType > 1 || (unsigned)counterType > 1)
        return NVML_ERROR_INVALID_ARGUMENT;
    *eccCounts = device->ecc[errorType][counterType];
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetRetiredPages(nvmlDevice_t device,
                                              nvmlPageRetirementCause_t cause,
                                              unsigned int *pageCount,
                                              unsigned long long *addresses) {
    PROLOGUE(device, C_RETIRED_PAGES);
    if (!pageCount || (unsigned)cause > 1) return NVML_ERROR_INVALID_ARGUMENT;
    unsigned int have = device->retired[cause];
    if (*pageCount < have) {
        *pageCount = have;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    for (unsigned int i = 0; addresses && i < have; i++) addresses[i] = 0x1000ULL * (i + 1);
    *pageCount = have;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetRetiredPages_v2(nvmlDevice_t device,
                                                 nvmlPageRetirementCause_t cause,
                                                 unsigned int *pageCount,
                                                 unsigned long long *addresses,
                                                 unsigned long long *timestamps) {
    PROLOGUE(device, C_RETIRED_PAGES);
    if (!pageCount || (unsigned)cause > 1) return NVML_ERROR_INVALID_ARGUMENT;
    unsigned int have = device->retired[cause];
    if (*pageCount < have) {
        *pageCount = have;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    for (unsigned int i = 0; i < have; i++) {
        if (addresses) addresses[i] = 0x1000ULL * (i + 1);
        if (timestamps) timestamps[i] = 1700000000ULL + i;
    }
    *pageCount = have;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetRetiredPagesPendingStatus(nvmlDevice_t device,
                                                           nvmlEnableState_t *isPending) {
    PROLOGUE(device, C_RETIRED_PENDING);
    if (!isPending) return NVML_ERROR_INVALID_ARGUMENT;
    *isPending = device->retired_pending ? NVML_FEATURE_ENABLED : NVML_FEATURE_DISABLED;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetCurrentClocksThrottleReasons(
    nvmlDevice_t device, unsigned long long *clocksThrottleReasons) {
    PROLOGUE(device, C_THROTTLE);
    if (!clocksThrottleReasons) return NVML_ERROR_INVALID_ARGUMENT;
    *clocksThrottleReasons = device->throttle;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetPcieReplayCounter(nvmlDevice_t device, unsigned int *value) {
    PROLOGUE(device, C_PCIE_REPLAY);
    if (!value) return NVML_ERROR_INVALID_ARGUMENT;
    *value = device->pcie_replay;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetTotalEnergyConsumption(nvmlDevice_t device,
                                                        unsigned long long *energy) {
    PROLOGUE(device, C_ENERGY);
    if (!energy) return NVML_ERROR_INVALID_ARGUMENT;
    *energy = device->energy;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetFieldValues(nvmlDevice_t device, int valuesCount,
                                             nvmlFieldValue_t *values) {
    PROLOGUE(device, C_FIELD_VALUES);
    if (!values || valuesCount < 0) return NVML_ERROR_INVALID_ARGUMENT;
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    for (int i = 0; i < valuesCount; i++) {
        nvmlFieldValue_t *v = &values[i];
        v->timestamp = (long long)now.tv_sec * 1000000 + now.tv_nsec / 1000;
        v->latencyUsec = 0;
        v->nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
        if (v->fieldId == NVML_FI_DEV_NVLINK_LINK_COUNT && device->nvlinks) {
            v->valueType = NVML_VALUE_TYPE_UNSIGNED_INT;
            v->value.uiVal = device->nvlinks;
            v->nvmlReturn = NVML_SUCCESS;
            continue;
        }
        for (int j = 0; j < device->nfields; j++) {
            if (device->field_ids[j] == v->fieldId) {
                v->valueType = NVML_VALUE_TYPE_UNSIGNED_LONG_LONG;
                v->value.ullVal = device->field_values[j];
                v->nvmlReturn = NVML_SUCCESS;
                break;
            }
        }
    }
    return NVML_SUCCESS;
}

/* ---- NVLink ---------------------------------------------------------------------------- */

EXPORT nvmlReturn_t nvmlDeviceGetNvLinkState(nvmlDevice_t device, unsigned int link,
                                             nvmlEnableState_t *isActive) {
    PROLOGUE(device, C_NVLINK);
    if (!isActive || link >= 18) return NVML_ERROR_INVALID_ARGUMENT;
    if (link >= device->nvlinks) return NVML_ERROR_NOT_SUPPORTED;
    *isActive = NVML_FEATURE_ENABLED;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetNvLinkErrorCounter(nvmlDevice_t device, unsigned int link,
                                                    nvmlNvLinkErrorCounter_t counter,
                                                    unsigned long long *counterValue) {
    PROLOGUE(device, C_NVLINK);
    if (!counterValue || link >= 18 || (unsigned)counter > 3) return NVML_ERROR_INVALID_ARGUMENT;
    if (link >= device->nvlinks) return NVML_ERROR_NOT_SUPPORTED;
    *counterValue = device->nvlink_errors[counter];
    return NVML_SUCCESS;
}

/* ---- events ---------------------------------------------------------------------------- */

EXPORT nvmlReturn_t nvmlDeviceGetSupportedEventTypes(nvmlDevice_t device,
                                                     unsigned long long *eventTypes) {
    PROLOGUE(device, C_EVENTS);
    if (!eventTypes) return NVML_ERROR_INVALID_ARGUMENT;
    *eventTypes = nvmlEventTypeXidCriticalError |
                  (device->ecc_mode ? nvmlEventTypeSingleBitEccError |
                                          nvmlEventTypeDoubleBitEccError
                                    : 0);
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set) {
    trace(__func__);
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    if (!set) return NVML_ERROR_INVALID_ARGUMENT;
    struct nvmlEventSet_st *s = calloc(1, sizeof *s);
    if (!s) return NVML_ERROR_MEMORY;
    *set = s;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t device, unsigned long long eventTypes,
                                             nvmlEventSet_t set) {
    PROLOGUE(device, C_EVENTS);
    if (!set) return NVML_ERROR_INVALID_ARGUMENT;
    unsigned long long supported = 0;
    nvmlDeviceGetSupportedEventTypes(device, &supported);
    if (eventTypes & ~supported) return NVML_ERROR_NOT_SUPPORTED;
    pthread_mutex_lock(&lock);
    set->registered[device->index] |= eventTypes;
    pthread_mutex_unlock(&lock);
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data,
                                        unsigned int timeoutms) {
    trace(__func__);
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    if (!set || !data) return NVML_ERROR_INVALID_ARGUMENT;
    long deadline = elapsed_ms() + (long)timeoutms;
    for (;;) {
        long now = elapsed_ms();
        int due = -1;
        pthread_mutex_lock(&lock);
        for (int i = 0; i < nevents; i++) {
            const struct event *ev = &events[i];
            if (set->delivered[i] || ev->at_ms > now) continue;
            if (!(set->registered[ev->device] & ev->type)) continue;
            if (due < 0 || ev->at_ms < events[due].at_ms) due = i;
        }
        if (due >= 0) set->delivered[due] = 1;
        pthread_mutex_unlock(&lock);
        if (due >= 0) {
            char line[96];
            snprintf(line, sizeof line, "event delivered type=%llu data=%llu device=%d",
                     events[due].type, events[due].data, events[due].device);
            trace(line);
            memset(data, 0, sizeof *data);
            data->device = &devices[events[due].device];
            data->eventType = events[due].type;
            data->eventData = events[due].data;
            data->gpuInstanceId = 0xFFFFFFFF;
            data->computeInstanceId = 0xFFFFFFFF;
            return NVML_SUCCESS;
        }
        if (now >= deadline) return NVML_ERROR_TIMEOUT;
        long left = deadline - now;
        struct timespec pause_for = {0, (left < 10 ? left : 10) * 1000000L};
        nanosleep(&pause_for, NULL);
    }
}

EXPORT nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set) {
    trace(__func__);
    if (!set) return NVML_ERROR_INVALID_ARGUMENT;
    free(set);
    return NVML_SUCCESS;
}
