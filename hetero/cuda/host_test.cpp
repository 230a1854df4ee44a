// A host build of protocol.h (g++ or nvcc -x c++; hetero/cuda/build.py), so the tests on
// every machine publish jobs to real workers and merge their partials with the very code the
// CUDA kernels run. Shapes as in signal.cu.
#include "protocol.h"

extern "C" {

void hetero_host_publish(int64_t* ctrl, const int64_t* iparams, const double* fparams) {
    publish_job(ctrl, job_params(iparams, fparams));
}

int hetero_host_released(const int64_t* ctrl, int64_t units) { return job_released(ctrl, units); }

// params: seq, rows, din, site, dout, parts (as hetero_lora_post)
void hetero_host_publish_lora(int64_t* ctrl, int64_t* hdr, const int64_t* params) {
    publish_lora(ctrl, hdr, LoraParams{params[0], params[1], params[2], params[3], params[4], params[5]});
}

int hetero_host_lora_released(const int64_t* ctrl, int64_t seq, int64_t parts) {
    return lora_released(ctrl, seq, parts);
}

// The LoRA kernels' loops on the host, in f32: x [rows, din] -> x_st; out [rows, dout] += delta.
void hetero_host_lora_copy_out(const float* x, float* x_st, int64_t rows, int64_t din, int64_t in_stride) {
    for (int64_t i = 0; i < rows * din; ++i) x_st[row_offset(i, din, in_stride)] = x[i];
}

void hetero_host_lora_add(float* out, const float* delta, int64_t rows, int64_t dout, int64_t out_stride) {
    for (int64_t i = 0; i < rows * dout; ++i) out[i] = lora_sum(out[i], delta[row_offset(i, dout, out_stride)]);
}

// The merge kernel's loop on the host: out [B, T, Hq, D] f32; sinks [Hq] or null.
void hetero_host_merge(const float* part_o, const float* part_m, const float* part_l, const int64_t* dims,
                       const int64_t* iparams, const double* fparams, const float* sinks, float* out) {
    const Dims s = dims_of(dims);
    const int64_t nsplit = merge_slots(job_params(iparams, fparams));
    for (int64_t b = 0; b < s.B; ++b)
        for (int64_t t = 0; t < s.T; ++t)
            for (int64_t qh = 0; qh < s.Hq; ++qh) {
                const PartialRow p = partial_row(b, t, qh, s);
                const float *m = part_m + p.ml, *l = part_l + p.ml, *o = part_o + p.o;
                float M, den = merge_weight_sum(m, l, p.rows, nsplit, sinks != nullptr, sinks ? sinks[qh] : 0.f, &M);
                for (int64_t d = 0; d < s.D; ++d)
                    out[p.out + d] = merge_value(o, p.rows * s.Dp, m, p.rows, nsplit, M, den, d);
            }
}

// The copy-out kernel's loop on the host: q [B, Hq, T, D] -> q_st (f32), k/v [B, Hkv, T, D] ->
// k_st/v_st, for f32 (element_bytes 4) or bf16 (2: q widened by its bits, k/v copied as bits).
void hetero_host_copy_out(const void* q, const void* k, const void* v, float* q_st, void* k_st, void* v_st,
                          const int64_t* dims, int64_t element_bytes) {
    const Dims s = dims_of(dims);
    const int64_t nq = s.B * s.Hq * s.T * s.D, nk = s.B * s.Hkv * s.T * s.D;
    for (int64_t i = 0; i < nq + nk; ++i) {
        if (i < nq) {
            float x;
            if (element_bytes == 4) {
                x = ((const float*)q)[i];
            } else {
                uint32_t bits = (uint32_t)((const uint16_t*)q)[i] << 16;
                __builtin_memcpy(&x, &bits, 4);
            }
            q_st[staged_offset(i, s)] = x;
        } else {
            const int64_t j = i - nq, o = staged_offset(j, s);
            if (element_bytes == 4) {
                ((float*)k_st)[o] = ((const float*)k)[j];
                ((float*)v_st)[o] = ((const float*)v)[j];
            } else {
                ((uint16_t*)k_st)[o] = ((const uint16_t*)k)[j];
                ((uint16_t*)v_st)[o] = ((const uint16_t*)v)[j];
            }
        }
    }
}

}  // extern "C"
