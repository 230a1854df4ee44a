// The CUDA transport's kernels: one decode layer's attention round trip to the CPU workers,
// enqueued on the model's stream with no host synchronization (hetero/ipc/transport.py).
//
//   copy_out_signal  q, new k/v (device) -> the session's staging area (page-locked, mapped);
//                    every block fences its stores (system scope); the last block to finish
//                    publishes the job in the control segment (params, ticket, GO words).
//   wait_job         one thread spins until the job's units are all finished (FIN == UNITS)
//                    or ABORT is set (the host watchdog, or a worker that failed its job).
//   merge_partials   the split partials (mapped) -> the attention output [B, T, Hq, D] (device).
// hetero_attention_step enqueues the three; hetero_attention_post and _finish the first and the
// last two apart (the engine: its prompt chunks are attended on the device in between).
// Once ABORT is set, later layers publish nothing and merge zeros (the host raises).
//
// Plain CUDA C++ with a C ABI, loaded through ctypes (hetero/cuda/build.py compiles it with
// nvcc on first use); it links cudart statically and shares torch's primary context and streams.
// Every call runs on the calling thread's current device: the Python side selects the model's.
// Shapes (Dp = head dim padded to the workers' tile; rows = G * Tmax):
//   q_in [B, Hq, T, D], k_in/v_in [B, Hkv, T, D]              device, model dtype, contiguous
//   q_st [B, Hq, Tmax, Dp] f32, k_st/v_st [B, Hkv, Tmax, Dp]  mapped staging, storage = model dtype
//   part_o [B, Hkv, NS, rows, Dp], part_m/part_l [B, Hkv, NS, rows] f32, mapped (workers write)
//   out [B, T, Hq, D] device, model dtype; sinks [Hq] f32 device or null
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "protocol.h"

template <typename T> __device__ __forceinline__ float to_f32(T x);
template <> __device__ __forceinline__ float to_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ float to_f32<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }
template <> __device__ __forceinline__ float to_f32<__half>(__half x) { return __half2float(x); }

template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <> __device__ __forceinline__ __half from_f32<__half>(float x) { return __float2half_rn(x); }

template <typename T>
__global__ void copy_out_signal(const T* q_in, const T* k_in, const T* v_in, float* q_st, T* k_st, T* v_st,
                                Dims s, volatile int64_t* ctrl, JobParams p, unsigned int* blocks_done) {
    const int64_t nq = s.B * s.Hq * s.T * s.D, nk = s.B * s.Hkv * s.T * s.D;
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < nq + nk; i += stride) {
        if (i < nq) {
            q_st[staged_offset(i, s)] = to_f32(q_in[i]);
        } else {
            int64_t j = i - nq, o = staged_offset(j, s);
            k_st[o] = k_in[j];
            v_st[o] = v_in[j];
        }
    }
    __threadfence_system();                  // this thread's staging stores, before the job
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned int done = atomicAdd(blocks_done, 1u);
        if (done == gridDim.x - 1) {         // the last block: every block's stores are fenced
            *blocks_done = 0;                // for the next launch (stream order)
            __threadfence_system();
            if (load_word(ctrl, HW_ABORT) == 0) publish_job(ctrl, p);   // aborted: post nothing more
        }
    }
}

__global__ void wait_job(const volatile int64_t* ctrl, int64_t units) {
    while (!job_released(ctrl, units)) __nanosleep(200);
    __threadfence_system();                  // acquire: the partials are read after this
}

// One block per output row (b, t, q head), one thread per column d.
template <typename T>
__global__ void merge_partials(const float* part_o, const float* part_m, const float* part_l, Dims s,
                               int64_t nsplit, const float* sinks, T* out, const volatile int64_t* ctrl) {
    const int64_t qh = blockIdx.x % s.Hq, t = (blockIdx.x / s.Hq) % s.T, b = blockIdx.x / (s.Hq * s.T);
    const PartialRow p = partial_row(b, t, qh, s);
    const int64_t rows = p.rows;
    const volatile float* m = part_m + p.ml;                   // volatile: the workers wrote them
    const volatile float* l = part_l + p.ml;
    const volatile float* o = part_o + p.o;
    __shared__ float M, den;
    __shared__ bool aborted;
    if (threadIdx.x == 0) {
        aborted = load_word(ctrl, HW_ABORT) != 0;     // the partials may be stale: zeros, the host raises
        den = aborted ? 1.f : merge_weight_sum(m, l, rows, nsplit, sinks != nullptr, sinks ? sinks[qh] : 0.f, &M);
    }
    __syncthreads();
    for (int64_t d = threadIdx.x; d < s.D; d += blockDim.x)
        out[p.out + d] =
            from_f32<T>(aborted ? 0.f : merge_value(o, rows * s.Dp, m, rows, nsplit, M, den, d));
}

// A layer's first half: q, new k/v -> the staging, then the job published (the workers start).
template <typename T>
static cudaError_t post(cudaStream_t stream, const void* q, const void* k, const void* v, void* q_st, void* k_st,
                        void* v_st, Dims s, volatile int64_t* ctrl, JobParams p, unsigned int* blocks_done) {
    int64_t n = (s.B * s.Hq + 2 * s.B * s.Hkv) * s.T * s.D;
    int threads = 256, blocks = (int)((n + threads - 1) / threads);
    blocks = blocks < 1 ? 1 : (blocks > 64 ? 64 : blocks);
    copy_out_signal<T><<<blocks, threads, 0, stream>>>((const T*)q, (const T*)k, (const T*)v, (float*)q_st,
                                                       (T*)k_st, (T*)v_st, s, ctrl, p, blocks_done);
    return cudaGetLastError();
}

// Its second half: wait for the job's units, merge the partials into `out`.
template <typename T>
static cudaError_t finish(cudaStream_t stream, const void* part_o, const void* part_m, const void* part_l,
                          const float* sinks, void* out, Dims s, const volatile int64_t* ctrl, JobParams p) {
    wait_job<<<1, 1, 0, stream>>>(ctrl, p.units);
    int mthreads = s.D < 128 ? 64 : 128;
    merge_partials<T><<<(unsigned)(s.B * s.T * s.Hq), mthreads, 0, stream>>>(   // prefix and own splits
        (const float*)part_o, (const float*)part_m, (const float*)part_l, s, merge_slots(p), sinks, (T*)out, ctrl);
    return cudaGetLastError();
}

// LoRA deltas of one decode token per request on the CPU workers (hetero/adapters/hooks.py):
//   lora_copy_out_signal  x [rows, din] (device) -> x_st [.., in_stride] f32 (mapped staging), fenced;
//                         the last block publishes the job (publish_lora)
//   wait_lora             one thread spins until workers 0..parts-1 are DONE with it (or ABORT)
//   lora_add              out [rows, dout] (device, the base projection's output) += delta
//                         [.., out_stride] f32 (mapped), in f32 and cast back, as peft adds its
//                         f32 adapters; nothing once ABORT is set (the host raises)
template <typename T>
__global__ void lora_copy_out_signal(const T* x, float* x_st, int64_t in_stride, volatile int64_t* hdr,
                                     volatile int64_t* ctrl, LoraParams p, unsigned int* blocks_done) {
    const int64_t n = p.rows * p.din, stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        x_st[row_offset(i, p.din, in_stride)] = to_f32(x[i]);
    __threadfence_system();
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned int done = atomicAdd(blocks_done, 1u);
        if (done == gridDim.x - 1) {
            *blocks_done = 0;
            __threadfence_system();
            if (load_word(ctrl, HW_ABORT) == 0) publish_lora(ctrl, hdr, p);
        }
    }
}

__global__ void wait_lora(const volatile int64_t* ctrl, int64_t seq, int64_t parts) {
    while (!lora_released(ctrl, seq, parts)) __nanosleep(200);
    __threadfence_system();                  // acquire: the deltas are read after this
}

template <typename T>
__global__ void lora_add(T* out, const float* delta, int64_t rows, int64_t dout, int64_t out_stride,
                         const volatile int64_t* ctrl) {
    if (load_word(ctrl, HW_ABORT) != 0) return;
    const volatile float* d = delta;
    const int64_t n = rows * dout, stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const float di = d[row_offset(i, dout, out_stride)];
        if (di != 0.f) out[i] = from_f32<T>(lora_sum(to_f32(out[i]), di));
    }
}

static int blocks_for(int64_t n, int threads) {
    int64_t b = (n + threads - 1) / threads;
    return (int)(b < 1 ? 1 : (b > 64 ? 64 : b));
}

template <typename T>
static cudaError_t lora_post(cudaStream_t st, const void* x, void* x_st, int64_t in_stride, void* hdr, void* ctrl,
                             LoraParams p, unsigned int* blocks_done) {
    lora_copy_out_signal<T><<<blocks_for(p.rows * p.din, 256), 256, 0, st>>>(
        (const T*)x, (float*)x_st, in_stride, (volatile int64_t*)hdr, (volatile int64_t*)ctrl, p, blocks_done);
    return cudaGetLastError();
}

template <typename T>
static cudaError_t lora_finish(cudaStream_t st, void* out, const void* delta, int64_t out_stride, const void* ctrl,
                               LoraParams p) {
    wait_lora<<<1, 1, 0, st>>>((const volatile int64_t*)ctrl, p.seq, p.parts);
    lora_add<T><<<blocks_for(p.rows * p.dout, 256), 256, 0, st>>>((T*)out, (const float*)delta, p.rows, p.dout,
                                                                  out_stride, (const volatile int64_t*)ctrl);
    return cudaGetLastError();
}

extern "C" {

// A LoRA job's first half, enqueued on `stream` before the base projection: x to the staging,
// then the job published. params: seq, rows, din, site, dout, parts; in_stride: the staging's x
// row length (floats).
int hetero_lora_post(void* stream, int dtype, const void* x, void* x_st, int64_t in_stride, void* hdr, void* ctrl,
                     const int64_t* params, void* blocks_done) {
    LoraParams p{params[0], params[1], params[2], params[3], params[4], params[5]};
    cudaStream_t st = (cudaStream_t)stream;
    unsigned int* bd = (unsigned int*)blocks_done;
    switch (dtype) {
        case HW_F32: return lora_post<float>(st, x, x_st, in_stride, hdr, ctrl, p, bd);
        case HW_BF16: return lora_post<__nv_bfloat16>(st, x, x_st, in_stride, hdr, ctrl, p, bd);
        case HW_F16: return lora_post<__half>(st, x, x_st, in_stride, hdr, ctrl, p, bd);
    }
    return (int)cudaErrorInvalidValue;
}

// Its second half, after the base projection: wait for the workers, add the deltas into `out`.
int hetero_lora_finish(void* stream, int dtype, void* out, const void* delta, int64_t out_stride, const void* ctrl,
                       const int64_t* params) {
    LoraParams p{params[0], params[1], params[2], params[3], params[4], params[5]};
    cudaStream_t st = (cudaStream_t)stream;
    switch (dtype) {
        case HW_F32: return lora_finish<float>(st, out, delta, out_stride, ctrl, p);
        case HW_BF16: return lora_finish<__nv_bfloat16>(st, out, delta, out_stride, ctrl, p);
        case HW_F16: return lora_finish<__half>(st, out, delta, out_stride, ctrl, p);
    }
    return (int)cudaErrorInvalidValue;
}


// A layer's round trip in two halves (the engine's decode tokens, hetero.engine.paged: the model's
// device attends a step's prompt chunks while the workers run): post, then finish.
int hetero_attention_post(void* stream, int dtype, const void* q, const void* k, const void* v, void* q_st,
                          void* k_st, void* v_st, const int64_t* dims, void* ctrl, const int64_t* iparams,
                          const double* fparams, void* blocks_done) {
    const Dims s = dims_of(dims);
    const JobParams p = job_params(iparams, fparams);
    cudaStream_t st = (cudaStream_t)stream;
    volatile int64_t* c = (volatile int64_t*)ctrl;
    unsigned int* bd = (unsigned int*)blocks_done;
    switch (dtype) {
        case HW_F32: return post<float>(st, q, k, v, q_st, k_st, v_st, s, c, p, bd);
        case HW_BF16: return post<__nv_bfloat16>(st, q, k, v, q_st, k_st, v_st, s, c, p, bd);
        case HW_F16: return post<__half>(st, q, k, v, q_st, k_st, v_st, s, c, p, bd);
    }
    return (int)cudaErrorInvalidValue;
}

int hetero_attention_finish(void* stream, int dtype, const void* part_o, const void* part_m, const void* part_l,
                            const float* sinks, void* out, const int64_t* dims, const void* ctrl,
                            const int64_t* iparams, const double* fparams) {
    const Dims s = dims_of(dims);
    const JobParams p = job_params(iparams, fparams);
    cudaStream_t st = (cudaStream_t)stream;
    const volatile int64_t* c = (const volatile int64_t*)ctrl;
    switch (dtype) {
        case HW_F32: return finish<float>(st, part_o, part_m, part_l, sinks, out, s, c, p);
        case HW_BF16: return finish<__nv_bfloat16>(st, part_o, part_m, part_l, sinks, out, s, c, p);
        case HW_F16: return finish<__half>(st, part_o, part_m, part_l, sinks, out, s, c, p);
    }
    return (int)cudaErrorInvalidValue;
}

// One layer's attention round trip, enqueued on `stream` (both halves). dtype: kernel.F32 / BF16 / F16 codes.
int hetero_attention_step(void* stream, int dtype, const void* q, const void* k, const void* v, void* q_st,
                          void* k_st, void* v_st, const void* part_o, const void* part_m, const void* part_l,
                          const float* sinks, void* out, const int64_t* dims, void* ctrl, const int64_t* iparams,
                          const double* fparams, void* blocks_done) {
    int rc = hetero_attention_post(stream, dtype, q, k, v, q_st, k_st, v_st, dims, ctrl, iparams, fparams, blocks_done);
    return rc != 0 ? rc : hetero_attention_finish(stream, dtype, part_o, part_m, part_l, sinks, out, dims, ctrl,
                                                  iparams, fparams);
}

// Page-lock [ptr, ptr + nbytes) (portable, mapped) and give its device address.
int hetero_register(void* ptr, size_t nbytes, void** device_ptr) {
    cudaError_t e = cudaHostRegister(ptr, nbytes, cudaHostRegisterPortable | cudaHostRegisterMapped);
    if (e != cudaSuccess) return (int)e;
    e = cudaHostGetDevicePointer(device_ptr, ptr, 0);
    if (e != cudaSuccess) cudaHostUnregister(ptr);
    return (int)e;
}

int hetero_unregister(void* ptr) { return (int)cudaHostUnregister(ptr); }

// The copy kernel's block counter (device memory, zeroed).
int hetero_counter_alloc(void** counter) {
    cudaError_t e = cudaMalloc(counter, sizeof(unsigned int));
    if (e != cudaSuccess) return (int)e;
    e = cudaMemset(*counter, 0, sizeof(unsigned int));
    return (int)(e != cudaSuccess ? e : cudaDeviceSynchronize());   // zeroed before any stream uses it
}

int hetero_counter_free(void* counter) { return (int)cudaFree(counter); }

const char* hetero_error_string(int e) { return cudaGetErrorString((cudaError_t)e); }

}  // extern "C"
