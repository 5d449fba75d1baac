// accelplane CUDA plugin: im2col and col2im_1d (conv.py).
#include "common.cuh"

// ---- fast division by a run-time constant (magic number, shift) ------------------------------------
struct fastdiv_t { unsigned int mul, shift, d; };
__device__ __forceinline__ unsigned int fdiv(unsigned int n, fastdiv_t f) {
    return (__umulhi(n, f.mul) + n) >> f.shift;
}
__device__ __forceinline__ fastdiv_t fdv(const i64* P, int i) {
    fastdiv_t f; f.mul = (unsigned int)P[i]; f.shift = (unsigned int)P[i + 1]; f.d = (unsigned int)P[i + 2];
    return f;
}

// ---- im2col: dst[n, oh, ow, (c, kh, kw)] ----------------------------------------------------------------
// P: [n_dst, ne_dst0..3, nbd0..3, nbx0..3, W, H, KW, KH, s0, s1, p0, p1, d0, d1,
//     fastdiv(ne0) x3, fastdiv(ne1) x3, fastdiv(ne2) x3, fastdiv(KW) x3, fastdiv(KH) x3] (from 23)
template <typename Td>
__global__ void k_im2col(const i64* __restrict__ P, char* dst, const char* x) {
    pdl_enter();
    const i64 n = P[0];
    const fastdiv_t f0 = fdv(P, 23), f1 = fdv(P, 26), f2 = fdv(P, 29), fkw = fdv(P, 32), fkh = fdv(P, 35);
    const int W = (int)P[13], H = (int)P[14];
    for (i64 t = blockIdx.x * (i64)blockDim.x + threadIdx.x; t < n; t += (i64)gridDim.x * blockDim.x) {
        unsigned int r = (unsigned int)t;
        unsigned int q = fdiv(r, f0); const unsigned int i0 = r - q * f0.d; r = q;
        q = fdiv(r, f1); const unsigned int ow = r - q * f1.d; r = q;
        q = fdiv(r, f2); const unsigned int oh = r - q * f2.d; const unsigned int nn = q;
        unsigned int qq = fdiv(i0, fkw); const int ikw = (int)(i0 - qq * fkw.d);
        const unsigned int rest = qq; qq = fdiv(rest, fkh);
        const int ikh = (int)(rest - qq * fkh.d); const int ic = (int)qq;
        const int iw = (int)ow * (int)P[17] + ikw * (int)P[21] - (int)P[19];
        const int ih = (int)oh * (int)P[18] + ikh * (int)P[22] - (int)P[20];
        float v = 0.0f;
        if (iw >= 0 && iw < W && ih >= 0 && ih < H)
            v = *(const float*)(x + iw * P[9] + ih * P[10] + ic * P[11] + (i64)nn * P[12]);
        st<Td>(dst + i0 * P[5] + ow * P[6] + oh * P[7] + nn * P[8], v);
    }
}

// ---- col2im_1d: out[b, c, t] = sum over (t_in, k) with t + p0 == t_in*s0 + k of a[b, t_in, c*K + k] ----
// P: [n, T_out, OC, B, nbd0..2, nba0..2, K, T_in, s0, p0, fastdiv(T_out) x3, fastdiv(OC) x3]
__global__ void k_col2im_1d(const i64* __restrict__ P, char* dst, const char* a) {
    pdl_enter();
    const i64 n = P[0];
    const fastdiv_t ft = fdv(P, 14), fc = fdv(P, 17);
    const int K = (int)P[10], T_in = (int)P[11], s0 = (int)P[12], p0 = (int)P[13];
    for (i64 id = blockIdx.x * (i64)blockDim.x + threadIdx.x; id < n; id += (i64)gridDim.x * blockDim.x) {
        unsigned int r = (unsigned int)id;
        unsigned int q = fdiv(r, ft); const int t = (int)(r - q * ft.d); r = q;
        q = fdiv(r, fc); const int c = (int)(r - q * fc.d); const int b = (int)q;
        const int ta = t + p0;
        int lo = ta - K + 1; lo = lo <= 0 ? 0 : (lo + s0 - 1) / s0;
        int hi = ta / s0; if (hi > T_in - 1) hi = T_in - 1;
        float acc = 0.0f;
        for (int ti = lo; ti <= hi; ++ti)
            acc += *(const float*)(a + (i64)(c * K + ta - ti * s0) * P[7] + (i64)ti * P[8] + (i64)b * P[9]);
        *(float*)(dst + t * P[4] + c * P[5] + (i64)b * P[6]) = acc;
    }
}

