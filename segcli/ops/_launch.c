/* One XLA FFI handler per platform launching any Warp kernel, with no Python on the call.

   At trace time `segcli.ops._native` registers a plan per distinct launch: the kernel's
   parameter block (Warp's launch bounds, then its arguments as Warp's CPU entry point takes
   them, one struct), complete but for the arrays' data pointers; where each of those comes
   from (an operand or a result buffer of the call); and the kernel's entry point on the CPU
   or on each GPU. The call carries only the plan's number (attribute `plan`). Executing a
   call copies the block, patches in the buffers' addresses and launches: on the CPU the
   entry point directly, on a GPU Warp's own `wp_cuda_launch_kernel` on XLA's stream. */

#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "xla/ffi/api/c_api.h" /* from jax.ffi.include_dir() */

/* The oldest FFI API version whose structs and functions are used here, as answered to XLA's
   metadata query: the handler runs on any jaxlib since. */
#define API_MINOR 1

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

static XLA_FFI_Error *fail(const XLA_FFI_Api *api, const char *message) {
    XLA_FFI_Error_Create_Args args = {XLA_FFI_Error_Create_Args_STRUCT_SIZE, NULL, message,
                                      XLA_FFI_Error_Code_INTERNAL};
    return api->XLA_FFI_Error_Create(&args);
}

/* Answers XLA's query for the API version and traits; true if that was the call. */
static int answered_metadata(XLA_FFI_CallFrame *frame, XLA_FFI_Handler_Traits traits) {
    XLA_FFI_Extension_Base *extension = frame->extension_start;
    if (!extension || extension->type != XLA_FFI_Extension_Metadata) return 0;
    XLA_FFI_Metadata *metadata = ((XLA_FFI_Metadata_Extension *)extension)->metadata;
    metadata->api_version.major_version = XLA_FFI_API_MAJOR;
    metadata->api_version.minor_version = API_MINOR;
    metadata->traits = traits;
    return 1;
}

/* The call's plan (its number in *id), its parameter block copied into `block` with the
   buffers' addresses. */
static const Plan *prepare(XLA_FFI_CallFrame *frame, unsigned char *block, int64_t *id) {
    if (frame->attrs.size != 1 || frame->attrs.types[0] != XLA_FFI_AttrType_SCALAR) return NULL;
    *id = *(int64_t *)((XLA_FFI_Scalar *)frame->attrs.attrs[0])->value;
    const Plan *p = plan_at(*id);
    if (!p) return NULL;
    memcpy(block, p->block, p->block_size);
    for (int32_t h = 0; h < p->n_holes; h++) {
        const int32_t *hole = &p->holes[3 * h];
        void **buffers = hole[1] ? frame->rets.rets : frame->args.args;
        void *data = ((XLA_FFI_Buffer *)buffers[hole[2]])->data;
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

XLA_FFI_Error *segcli_launch_cpu(XLA_FFI_CallFrame *frame) {
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

XLA_FFI_Error *segcli_launch_cuda(XLA_FFI_CallFrame *frame) {
    if (answered_metadata(frame, XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE)) return NULL;
    unsigned char block[MAX_BLOCK] __attribute__((aligned(16)));
    int64_t id;
    const Plan *p = prepare(frame, block, &id);
    if (!p) return fail(frame->api, "segcli: unknown kernel launch plan");
    if (!p->size) return NULL;
    XLA_FFI_DeviceOrdinal_Get_Args ordinal = {XLA_FFI_DeviceOrdinal_Get_Args_STRUCT_SIZE, NULL,
                                              frame->ctx, 0};
    XLA_FFI_Error *error = frame->api->XLA_FFI_DeviceOrdinal_Get(&ordinal);
    if (error) return error;
    if (ordinal.device_ordinal < 0 || ordinal.device_ordinal >= MAX_DEVICES)
        return fail(frame->api, "segcli: GPU ordinal out of range");
    const Entry *e = entry(p, id, ordinal.device_ordinal);
    if (!e || !cuda_launch) return fail(frame->api, "segcli: cannot load the kernel on this GPU");
    XLA_FFI_Stream_Get_Args stream = {XLA_FFI_Stream_Get_Args_STRUCT_SIZE, NULL, frame->ctx,
                                      NULL};
    error = frame->api->XLA_FFI_Stream_Get(&stream);
    if (error) return error;
    void *params[MAX_PARAMS];
    for (int32_t i = 0; i < p->n_params; i++) params[i] = block + p->params[i];
    if (cuda_launch(e->context, e->function, p->size, 0, e->block_dim, p->grid_stride,
                    e->cluster_dim, e->shared_memory_bytes, params, stream.stream, NULL))
        return fail(frame->api, "segcli: CUDA kernel launch failed");
    return NULL;
}
