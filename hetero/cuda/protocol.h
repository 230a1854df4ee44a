// The GPU side of the worker protocol (hetero/ipc/control.py), shared by the CUDA kernels
// (signal.cu) and a host build (host_test.cpp) that the tests drive against real workers on
// every machine, so the word offsets, encodings and merge math are checked without a GPU.
//
// The control segment's word offsets come from control.py on the compiler's command line
// (hetero/cuda/build.py: -DHW_TICKET=56 ...), never written down twice.
#pragma once
#include <stdint.h>

#ifdef __CUDACC__
#define HD __host__ __device__ __forceinline__
#else
#define HD inline
#include <math.h>
#endif

#ifndef HW_TICKET
#error "build with the control word offsets (hetero/cuda/build.py defines them)"
#endif

// A job's params, as KVSession.attend writes them for the CPU transport.
struct JobParams {
    int64_t seq;        // job number (pool.seq): tags the ticket and the GO words
    int64_t layer, qlen, window, nsplit, units;
    double scale, softcap;
    int64_t active;     // workers 0..active-1 are posted
    int64_t psplit;     // a shared prefix's splits (their partials: slots 0..psplit-1; the own: psplit..)
    int64_t ngroups;    // a paged pool's shared-prefix groups this job (the engine's PagedKV; a session's 0)
};

// JobParams from the host's arrays (signal.cu's entry point and the host build read them alike):
// iparams = seq, layer, T, window, nsplit, units, active, psplit, ngroups; fparams = scale, softcap.
HD JobParams job_params(const int64_t* i, const double* f) {
    return JobParams{i[0], i[1], i[2], i[3], i[4], i[5], f[0], f[1], i[6], i[7], i[8]};
}

// The split partials an output row merges: the shared prefix's (slots 0..psplit-1), then the
// request's own (KVSession.attend; the CPU transport merges the same slots).
HD int64_t merge_slots(const JobParams& p) { return p.psplit + p.nsplit; }

// Shapes of one layer's round trip (see signal.cu): batch, q heads, kv heads, this step's query
// tokens, head dim; the staging's token capacity and padded head dim; partial slots per (request,
// kv head) (SessionLayout.nparts: the splits of its own rows, and of a shared prefix).
struct Dims {
    int64_t B, Hq, Hkv, T, D, Tmax, Dp, NS;
};

// Dims from the host's array (signal.cu's entry points and the host build read it alike).
HD Dims dims_of(const int64_t* d) { return Dims{d[0], d[1], d[2], d[3], d[4], d[5], d[6], d[7]}; }

// Element i of a [B, H, T, D] tensor -> its offset in a [B, H, Tmax, Dp] staging array.
HD int64_t staged_offset(int64_t i, const Dims& s) {
    int64_t d = i % s.D, t = (i / s.D) % s.T, bh = i / (s.D * s.T);
    return (bh * s.Tmax + t) * s.Dp + d;
}

// Output row (b, t, q head qh) of out [B, T, Hq, D]: where its split partials start. The workers
// write part_m/part_l [B, Hkv, NS, G*Tmax] and part_o [.., Dp] with row r = g*T + t of kv head
// h, q head = h*G + g (kernel.run_unit); split s is at + s * rows (m, l) and + s * rows * Dp (o).
struct PartialRow {
    int64_t ml, o, rows, out;    // offsets of split 0 in part_m/l and part_o; rows = G*Tmax; out row
};

HD PartialRow partial_row(int64_t b, int64_t t, int64_t qh, const Dims& s) {
    const int64_t G = s.Hq / s.Hkv, h = qh / G, g = qh % G, rows = G * s.Tmax, r = g * s.T + t;
    const int64_t ml = ((b * s.Hkv + h) * s.NS) * rows + r;
    return PartialRow{ml, ml * s.Dp, rows, ((b * s.T + t) * s.Hq + qh) * s.D};
}

// Full fence for stores that a CPU core reads (system scope).
HD void fence_system() {
#ifdef __CUDA_ARCH__
    __threadfence_system();
#else
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
#endif
}

HD void store_word(volatile int64_t* ctrl, int64_t idx, int64_t v) { ctrl[idx] = v; }
HD int64_t load_word(const volatile int64_t* ctrl, int64_t idx) { return ctrl[idx]; }

// control.go / control.ticket
HD int64_t go_value(int64_t seq, int64_t cmd) { return (seq << HW_CMD_BITS) | cmd; }
HD int64_t ticket_value(int64_t seq, int64_t units) { return ((seq & HW_TAG_MASK) << 32) | units; }
HD int64_t go_index(int64_t rank) { return (HW_DONE_LINE + rank) * HW_LINE + 2; }

// Publish an attention job whose staged data (q, new k/v) is already written and fenced: the
// params, FIN = 0, then the tagged ticket, then each posted worker's GO word, with a fence
// between each group (a worker reads the params only after claiming a unit of the ticket).
// The same order as WorkerPool._publish. Called by one thread.
HD void publish_job(volatile int64_t* ctrl, const JobParams& p) {
    store_word(ctrl, HW_CMD, HW_CMD_ATTN);
    store_word(ctrl, HW_LAYER, p.layer);
    store_word(ctrl, HW_QLEN, p.qlen);
    store_word(ctrl, HW_WINDOW, p.window);
    store_word(ctrl, HW_NSPLIT, p.nsplit);
    store_word(ctrl, HW_PSPLIT, p.psplit);
    store_word(ctrl, HW_NGROUPS, p.ngroups);     // read by a paged pool's workers only
    store_word(ctrl, HW_UNITS, p.units);
    volatile double* f = reinterpret_cast<volatile double*>(ctrl);
    f[HW_F_SCALE] = p.scale;
    f[HW_F_SOFTCAP] = p.softcap;
    store_word(ctrl, HW_FIN, 0);
    fence_system();
    store_word(ctrl, HW_TICKET, ticket_value(p.seq, p.units));
    fence_system();
    for (int64_t r = 0; r < p.active; ++r) store_word(ctrl, go_index(r), go_value(p.seq, HW_CMD_ATTN));
    fence_system();
}

// Whether attention job `units` is finished (every unit's partials written and FIN counted),
// or waiting was aborted (ABORT != 0: a worker died, stalled or failed a job; the host raises).
HD bool job_released(const volatile int64_t* ctrl, int64_t units) {
    return load_word(ctrl, HW_FIN) == units || load_word(ctrl, HW_ABORT) != 0;
}

// Publish a LoRA job (CMD_LORA_GPU, hetero.adapters.layout.run_rows) whose x rows are already
// written and fenced: the staging header (rows, in, site, out, parts), then the posted workers' GO
// words, fenced between. hdr: the LoRA staging segment's header words. Called by one thread.
struct LoraParams {
    int64_t seq, rows, din, site, dout, parts;
};

HD void publish_lora(volatile int64_t* ctrl, volatile int64_t* hdr, const LoraParams& p) {
    store_word(hdr, 0, p.rows);
    store_word(hdr, 1, p.din);
    store_word(hdr, 2, p.site);
    store_word(hdr, 3, p.dout);
    store_word(hdr, 4, p.parts);
    store_word(ctrl, HW_CMD, HW_CMD_LORA_GPU);
    fence_system();
    for (int64_t r = 0; r < p.parts; ++r) store_word(ctrl, go_index(r), go_value(p.seq, HW_CMD_LORA_GPU));
    fence_system();
}

// Element i of a row-major [rows, cols] tensor -> its offset in a [.., stride] staging array (the
// LoRA staging's x [ROWS, in] and delta [ROWS, out]).
HD int64_t row_offset(int64_t i, int64_t cols, int64_t stride) { return (i / cols) * stride + i % cols; }

// out + delta as the LoRA add kernel computes it (in f32): a zero delta leaves out untouched (a
// request whose adapter skips the site keeps even a -0.0).
HD float lora_sum(float out, float delta) { return delta != 0.f ? out + delta : out; }

// Whether LoRA job `seq` is finished (workers 0..parts-1 published DONE = seq), or the watchdog
// aborted waiting.
HD bool lora_released(const volatile int64_t* ctrl, int64_t seq, int64_t parts) {
    if (load_word(ctrl, HW_ABORT) != 0) return true;
    for (int64_t r = 0; r < parts; ++r)
        if (load_word(ctrl, (HW_DONE_LINE + r) * HW_LINE) < seq) return false;
    return true;
}

// Merge the split partials of one output row (see KVSession.merge_partials):
//   out[d] = sum_s e^(m_s - M) o_s[d] / (sum_s e^(m_s - M) l_s + e^(sink - M)),
//   M = max(max_s m_s, sink); no sink: has_sink = false.
// o: partial s's row at o + s * o_stride; m/l: at m + s * ml_stride. d in [0, D).
HD float merge_weight_sum(const volatile float* m, const volatile float* l, int64_t ml_stride, int64_t nsplit,
                          bool has_sink, float sink, float* M_out) {
    float M = has_sink ? sink : -INFINITY;
    for (int64_t s = 0; s < nsplit; ++s) M = fmaxf(M, m[s * ml_stride]);
    float den = 0.f;
    for (int64_t s = 0; s < nsplit; ++s) den += expf(m[s * ml_stride] - M) * l[s * ml_stride];
    if (has_sink) den += expf(sink - M);
    *M_out = M;
    return den;
}

HD float merge_value(const volatile float* o, int64_t o_stride, const volatile float* m, int64_t ml_stride,
                     int64_t nsplit, float M, float den, int64_t d) {
    float acc = 0.f;
    for (int64_t s = 0; s < nsplit; ++s) acc += expf(m[s * ml_stride] - M) * o[s * o_stride + d];
    return acc / den;
}
