// A host build of protocol.h (g++ or nvcc -x c++; hetero/cuda/build.py), so the tests on
// every machine publish jobs to real workers and merge their partials with the very code the
// CUDA kernels run. Shapes as in signal.cu.
#include "protocol.h"

extern "C" {

void hetero_host_publish(int64_t* ctrl, const int64_t* iparams, const double* fparams) {
    JobParams p{iparams[0], iparams[1], iparams[2], iparams[3], iparams[4], iparams[5], fparams[0], fparams[1],
                iparams[6]};
    publish_job(ctrl, p);
}

int hetero_host_released(const int64_t* ctrl, int64_t units) { return job_released(ctrl, units); }

// dims: B, Hq, Hkv, T, D, Tmax, Dp, NS; out [B, T, Hq, D] f32; sinks [Hq] or null.
void hetero_host_merge(const float* part_o, const float* part_m, const float* part_l, const int64_t* dims,
                       int64_t nsplit, const float* sinks, float* out) {
    int64_t B = dims[0], Hq = dims[1], Hkv = dims[2], T = dims[3], D = dims[4], Tmax = dims[5], Dp = dims[6],
            NS = dims[7];
    int64_t G = Hq / Hkv, rows = G * Tmax;
    for (int64_t b = 0; b < B; ++b)
        for (int64_t t = 0; t < T; ++t)
            for (int64_t qh = 0; qh < Hq; ++qh) {
                int64_t h = qh / G, r = (qh % G) * T + t;
                const float* m = part_m + ((b * Hkv + h) * NS) * rows + r;
                const float* l = part_l + ((b * Hkv + h) * NS) * rows + r;
                const float* o = part_o + (((b * Hkv + h) * NS) * rows + r) * Dp;
                float M, den = merge_weight_sum(m, l, rows, nsplit, sinks != nullptr, sinks ? sinks[qh] : 0.f, &M);
                for (int64_t d = 0; d < D; ++d)
                    out[((b * T + t) * Hq + qh) * D + d] = merge_value(o, rows * Dp, m, rows, nsplit, M, den, d);
            }
}

}  // extern "C"
