/* One XLA FFI handler per platform launching any Warp kernel, with no Python on the call.

   At trace time `segcli.ops._native` registers a plan per distinct launch: the kernel's
   parameter block (Warp's launch bounds, then its arguments as Warp's CPU entry point takes
   them, one struct), complete but for the arrays' data pointers; where each of those comes
   from (an operand or a result buffer of the call); and the kernel's entry point on the CPU
   or on each GPU. The call carries only the plan's number (attribute `plan`). Executing a
   call copies the block, patches in the buffers' addresses and launches: on the CPU the
   entry point directly, on a GPU Warp's own `wp_cuda_launch_kernel` on XLA's stream. */

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* The part of XLA's FFI C API (xla/ffi/api/c_api.h) used here: a stable ABI, whose structs
   only ever grow at their end, declared here so that no header of a particular jaxlib is
   needed. */

#define STRUCT_SIZE(type, last) (offsetof(type, last) + sizeof(((type *)0)->last))

typedef struct Extension {
    size_t struct_size;
    int type; /* 1: metadata */
    struct Extension *next;
} Extension;

typedef struct {
    size_t struct_size;
    Extension *extension_start;
    int major_version;
    int minor_version;
} ApiVersion;

typedef struct {
    size_t struct_size;
    ApiVersion api_version;
    uint32_t traits; /* 1: command buffer compatible */
} Metadata;

typedef struct {
    Extension base;
    Metadata *metadata;
} MetadataExtension;

typedef struct XLA_FFI_Error XLA_FFI_Error;

typedef struct {
    size_t struct_size;
    Extension *extension_start;
    const char *message;
    int errc;
} ErrorCreateArgs;

typedef struct {
    size_t struct_size;
    Extension *extension_start;
    void *ctx;
    void *stream; /* out */
} StreamGetArgs;

typedef struct {
    size_t struct_size;
    Extension *extension_start;
    void *ctx;
    int32_t device_ordinal; /* out */
} DeviceOrdinalGetArgs;

typedef struct {
    size_t struct_size;
    Extension *extension_start;
    ApiVersion api_version;
    void *internal_api;
    XLA_FFI_Error *(*error_create)(ErrorCreateArgs *);
    void *error_get_message, *error_destroy, *handler_register;
    XLA_FFI_Error *(*stream_get)(StreamGetArgs *);
    void *type_id_register, *execution_context_get, *state_set, *state_get;
    void *device_memory_allocate, *device_memory_free, *thread_pool_schedule;
    void *thread_pool_num_threads, *future_create, *future_set_available, *future_set_error;
    void *run_id_get;
    XLA_FFI_Error *(*device_ordinal_get)(DeviceOrdinalGetArgs *);
} Api;

typedef struct {
    size_t struct_size;
    Extension *extension_start;
    int dtype;
    void *data;
    int64_t rank;
    int64_t *dims;
} Buffer;

typedef struct {
    size_t struct_size;
    Extension *extension_start;
    int64_t size;
    int *types;
    void **items;
} List; /* arguments, results or attributes (less their names) */

typedef struct {
    size_t struct_size;
    Extension *extension_start;
    int64_t size;
    int *types; /* 3: scalar */
    void **names;
    void **attrs;
} Attrs;

typedef struct {
    int dtype;
    void *value;
} Scalar;

typedef struct {
    size_t struct_size;
    Extension *extension_start;
    const Api *api;
    void *ctx;
    int stage;
    List args;
    List rets;
    Attrs attrs;
    void *future;
} CallFrame;

#define CHUNK 1024
#define CHUNKS 1024
#define MAX_DEVICES 64
#define MAX_PARAMS 64
#define MAX_BLOCK 4096

typedef size_t (*cuda_launch_fn)(void *context, void *kernel, size_t dim, int max_blocks,
                                 int block_dim, int grid_stride, int cluster_dim,
                                 int shared_memory_bytes, void **args, void *stream,
                                 const void *apic_info);
typedef void (*cpu_kernel_fn)(void *bounds, void *args);

typedef int32_t (*resolve_fn)(int64_t id, int32_t ordinal);

typedef struct {
    void *context;
    void *function;
    int32_t block_dim;
    int32_t cluster_dim;
    int32_t shared_memory_bytes;
} Entry;

typedef struct {
    uint64_t size; /* threads */
    int32_t grid_stride;
    int32_t block_size;  /* bytes of the parameter block */
    int32_t args_offset; /* of the arguments' struct in the block */
    int32_t n_holes;
    int32_t n_params;
    unsigned char *block;
    int32_t *holes;  /* (offset in the block, 0 operand / 1 result, its index) each */
    int32_t *params; /* offsets of the launch bounds and of each argument */
    Entry entries[MAX_DEVICES + 1]; /* [0]: the CPU; [1 + ordinal]: a GPU */
} Plan;

static Plan *chunks[CHUNKS];
static int64_t n_plans;
static pthread_mutex_t registering = PTHREAD_MUTEX_INITIALIZER;
static cuda_launch_fn cuda_launch;
static resolve_fn resolve; /* loads a plan's kernel on a device it has no entry point for */

void segcli_set_cuda_launch(void *function) { cuda_launch = (cuda_launch_fn)function; }
void segcli_set_resolve(void *function) { resolve = (resolve_fn)function; }

static Plan *plan_at(int64_t id) {
    if (id < 0 || id >= __atomic_load_n(&n_plans, __ATOMIC_ACQUIRE)) return NULL;
    return &chunks[id / CHUNK][id % CHUNK];
}

/* A new plan's number, or -1 if the table is full or a size is out of range. */
int64_t segcli_add_plan(uint64_t size, int32_t grid_stride,
                        const void *block, int32_t block_size, int32_t args_offset,
                        const int32_t *holes, int32_t n_holes, const int32_t *params,
                        int32_t n_params) {
    if (block_size > MAX_BLOCK || n_params > MAX_PARAMS) return -1;
    pthread_mutex_lock(&registering);
    int64_t id = n_plans;
    if (id >= (int64_t)CHUNK * CHUNKS) {
        pthread_mutex_unlock(&registering);
        return -1;
    }
    if (!chunks[id / CHUNK]) chunks[id / CHUNK] = calloc(CHUNK, sizeof(Plan));
    Plan *p = &chunks[id / CHUNK][id % CHUNK];
    p->size = size;
    p->grid_stride = grid_stride;
    p->block_size = block_size;
    p->args_offset = args_offset;
    p->n_holes = n_holes;
    p->n_params = n_params;
    p->block = malloc(block_size);
    memcpy(p->block, block, block_size);
    p->holes = malloc(sizeof(int32_t) * 3 * (n_holes ? n_holes : 1));
    memcpy(p->holes, holes, sizeof(int32_t) * 3 * n_holes);
    p->params = malloc(sizeof(int32_t) * (n_params ? n_params : 1));
    memcpy(p->params, params, sizeof(int32_t) * n_params);
    __atomic_store_n(&n_plans, id + 1, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&registering);
    return id;
}

/* The kernel's entry point for a plan on the CPU (ordinal -1) or on GPU `ordinal`. */
int32_t segcli_set_entry(int64_t id, int32_t ordinal, void *context, void *function,
                         int32_t block_dim, int32_t cluster_dim, int32_t shared_memory_bytes) {
    Plan *p = plan_at(id);
    if (!p || ordinal < -1 || ordinal >= MAX_DEVICES) return -1;
    Entry *e = &p->entries[ordinal + 1];
    e->context = context;
    e->block_dim = block_dim;
    e->cluster_dim = cluster_dim;
    e->shared_memory_bytes = shared_memory_bytes;
    __atomic_store_n(&e->function, function, __ATOMIC_RELEASE);
    return 0;
}

static XLA_FFI_Error *fail(const Api *api, const char *message) {
    ErrorCreateArgs args = {STRUCT_SIZE(ErrorCreateArgs, errc), NULL, message, 13 /* internal */};
    return api->error_create(&args);
}

/* Answers XLA's query for the API version and traits; true if that was the call. */
static int answered_metadata(CallFrame *frame, uint32_t traits) {
    Extension *extension = frame->extension_start;
    if (!extension || extension->type != 1) return 0;
    Metadata *metadata = ((MetadataExtension *)extension)->metadata;
    metadata->api_version.major_version = 0;
    metadata->api_version.minor_version = 1;
    metadata->traits = traits;
    return 1;
}

/* The call's plan (its number in *id), its parameter block copied into `block` with the
   buffers' addresses. */
static const Plan *prepare(CallFrame *frame, unsigned char *block, int64_t *id) {
    if (frame->attrs.size != 1 || frame->attrs.types[0] != 3) return NULL;
    *id = *(int64_t *)((Scalar *)frame->attrs.attrs[0])->value;
    const Plan *p = plan_at(*id);
    if (!p) return NULL;
    memcpy(block, p->block, p->block_size);
    for (int32_t h = 0; h < p->n_holes; h++) {
        const int32_t *hole = &p->holes[3 * h];
        void **buffers = hole[1] ? frame->rets.items : frame->args.items;
        void *data = ((Buffer *)buffers[hole[2]])->data;
        memcpy(block + hole[0], &data, sizeof data);
    }
    return p;
}

/* The plan's entry point on the CPU (ordinal -1) or a GPU, loaded first if need be. */
static const Entry *entry(const Plan *p, int64_t id, int32_t ordinal) {
    const Entry *e = &p->entries[ordinal + 1];
    if (!__atomic_load_n(&e->function, __ATOMIC_ACQUIRE) && resolve) resolve(id, ordinal);
    return __atomic_load_n(&e->function, __ATOMIC_ACQUIRE) ? e : NULL;
}

XLA_FFI_Error *segcli_launch_cpu(CallFrame *frame) {
    if (answered_metadata(frame, 0)) return NULL;
    unsigned char block[MAX_BLOCK] __attribute__((aligned(16)));
    int64_t id;
    const Plan *p = prepare(frame, block, &id);
    if (!p) return fail(frame->api, "segcli: unknown kernel launch plan");
    if (!p->size) return NULL;
    const Entry *e = entry(p, id, -1);
    if (!e) return fail(frame->api, "segcli: cannot load the kernel on the CPU");
    ((cpu_kernel_fn)e->function)(block + p->params[0], block + p->args_offset);
    return NULL;
}

XLA_FFI_Error *segcli_launch_cuda(CallFrame *frame) {
    if (answered_metadata(frame, 1 /* command buffer compatible */)) return NULL;
    unsigned char block[MAX_BLOCK] __attribute__((aligned(16)));
    int64_t id;
    const Plan *p = prepare(frame, block, &id);
    if (!p) return fail(frame->api, "segcli: unknown kernel launch plan");
    if (!p->size) return NULL;
    DeviceOrdinalGetArgs ordinal = {STRUCT_SIZE(DeviceOrdinalGetArgs, device_ordinal), NULL,
                                    frame->ctx, 0};
    XLA_FFI_Error *error = frame->api->device_ordinal_get(&ordinal);
    if (error) return error;
    if (ordinal.device_ordinal < 0 || ordinal.device_ordinal >= MAX_DEVICES)
        return fail(frame->api, "segcli: GPU ordinal out of range");
    const Entry *e = entry(p, id, ordinal.device_ordinal);
    if (!e || !cuda_launch) return fail(frame->api, "segcli: cannot load the kernel on this GPU");
    StreamGetArgs stream = {STRUCT_SIZE(StreamGetArgs, stream), NULL, frame->ctx, NULL};
    error = frame->api->stream_get(&stream);
    if (error) return error;
    void *params[MAX_PARAMS];
    for (int32_t i = 0; i < p->n_params; i++) params[i] = block + p->params[i];
    if (cuda_launch(e->context, e->function, p->size, 0, e->block_dim, p->grid_stride,
                    e->cluster_dim, e->shared_memory_bytes, params, stream.stream, NULL))
        return fail(frame->api, "segcli: CUDA kernel launch failed");
    return NULL;
}
