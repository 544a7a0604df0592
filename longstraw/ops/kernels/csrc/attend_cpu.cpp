// Attention of queries over a block of keys that every query sees (no mask), float32, on the CPU:
// out = softmax(q k^T * scale) v and lse = log-sum-exp of the scaled scores, per row.
//
// Written for the small head dims (16-128) where PyTorch's fused CPU kernel spends most of its time around
// small matrix products: the scores of MR query rows x 32 keys stay in registers while the head dim is walked
// (keys transposed per tile of KT keys, so one vector holds 16 keys), the softmax runs in base 2 on the
// tile (a degree-5 polynomial 2^x, relative error < 3e-7 in float32), and P.V accumulates MR rows x 16 value
// dims per vector.
// Online softmax across tiles; nothing larger than one tile of scores (MR x KT floats) is kept.
//
// Layouts (float32): q [bh, rows, d], k [bh, t, d], v [bh, t, dv] with any head and row strides (the last dim
// contiguous: a view into a longer cache is read in place), out [bh, rows, dv] and lse [bh, rows] contiguous.
// dv must be a multiple of 16; d any; t >= 1. Each of `threads` std::threads takes a contiguous share of every
// head's rows. `longstraw_attend_full_8bit` reads 8-bit keys and values instead, decoded into each tile.
#include <cmath>
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <thread>
#include <vector>

namespace {

constexpr int VL = 16;     // floats per vector
constexpr int MR = 8;      // query rows per register block
constexpr int KT = 256;    // keys per tile (multiple of 2 * VL)

typedef float vf __attribute__((vector_size(VL * 4)));
typedef int32_t vi __attribute__((vector_size(VL * 4)));

inline vf load(const float* p) { vf x; std::memcpy(&x, p, sizeof x); return x; }
inline void store(float* p, vf x) { std::memcpy(p, &x, sizeof x); }
inline vf splat(float a) { return vf{} + a; }
inline vf vmax(vf a, vf b) { return a > b ? a : b; }

// 2^x for x <= 0 (0 below 2^-126.5, as float32 flushes): 2^n * 2^f with n = nearest integer (by adding 1.5 * 2^23,
// whose float rounds to an integer), |f| <= 1/2, 2^f by a degree-5 minimax polynomial (relative error < 8e-8).
// x is clamped at -127 first, where 2^n has a zero exponent field and so is 0 (as is 2^-inf).
inline vf exp2_neg(vf x0) {
    const vf x = vmax(x0, splat(-127.0f));
    const vf t = x + 12582912.0f;
    vi n;
    std::memcpy(&n, &t, sizeof n);
    const vf f = x - (t - 12582912.0f);
    vf p = splat(1.327648359968301e-03f);
    p = p * f + 9.67554143531566e-03f;
    p = p * f + 5.550713237664569e-02f;
    p = p * f + 2.4022119721331267e-01f;
    p = p * f + 6.931469670866109e-01f;
    p = p * f + 1.0000000716554565f;
    const vi bits = (n + (127 - 0x4B400000)) << 23;
    vf two_n;
    std::memcpy(&two_n, &bits, sizeof two_n);
    return p * two_n;
}

// horizontal maximum / sum by halving (4 shuffles)
inline float hmax(vf x) {
    x = vmax(x, __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
    x = vmax(x, __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
    x = vmax(x, __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
    x = vmax(x, __builtin_shufflevector(x, x, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
    return x[0];
}
inline float hsum(vf x) {
    x += __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    x += __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    x += __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    x += __builtin_shufflevector(x, x, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
    return x[0];
}

struct Args {
    const float *q, *k, *v;
    float *out, *lse;
    int64_t bh, rows, t, d, dv;
    int64_t qh, qr, kh, kr, vh, vr;  // strides (elements) of q, k, v (or of their codes) between heads and rows
    float scale;
    // 8-bit keys and values (kc non-null): codes, decoded by `lut`, times one scale per `block` tokens x head
    const uint8_t *kc = nullptr, *vc = nullptr;
    const float *ks = nullptr, *vs = nullptr, *lut = nullptr;
    int64_t block = 1, ksh = 0, vsh = 0;
};

// rows r0 .. r0 + nr of head b over all keys; per tile of KT keys the keys are transposed once
void rows_over_keys(const Args& a, int64_t b, int64_t r0, int64_t nr) {
    const int64_t d = a.d, dv = a.dv, t = a.t;
    std::vector<float> kt(d * KT), sbuf(MR * KT), qs((nr + MR) * d, 0.0f), m(nr, -INFINITY), l(nr, 0.0f);
    std::vector<float> vbuf(a.kc ? KT * dv : 0);
    float* s = sbuf.data();
    const float* q = a.q + b * a.qh + r0 * a.qr;
    float* o = a.out + (b * a.rows + r0) * dv;
    const float c = a.scale * 1.4426950408889634f;  // scores in base 2
    for (int64_t i = 0; i < nr; ++i)  // rows past the last stay zero
        for (int64_t cc = 0; cc < d; ++cc) qs[i * d + cc] = q[i * a.qr + cc] * c;
    std::memset(o, 0, sizeof(float) * nr * dv);
    for (int64_t j0 = 0; j0 < t; j0 += KT) {
        const int64_t n = t - j0 < KT ? t - j0 : KT;
        const int64_t np = (n + 2 * VL - 1) / (2 * VL) * (2 * VL);
        const float* v;  // the tile's values, row j at v + j * vr
        int64_t vr;
        if (a.kc) {  // decoded into the tiles, in float32 as the dequantized state: code value x scale
            const uint8_t *kc = a.kc + b * a.kh + j0 * a.kr, *vc = a.vc + b * a.vh + j0 * a.vr;
            const float *ks = a.ks + b * a.ksh, *vs = a.vs + b * a.vsh;
            for (int64_t j = 0; j < n; ++j) {
                const float sk = ks[(j0 + j) / a.block], sv = vs[(j0 + j) / a.block];
                for (int64_t cc = 0; cc < d; ++cc) kt[cc * KT + j] = a.lut[kc[j * a.kr + cc]] * sk;
                for (int64_t e = 0; e < dv; ++e) vbuf[j * dv + e] = a.lut[vc[j * a.vr + e]] * sv;
            }
            v = vbuf.data();
            vr = dv;
        } else {
            const float* k = a.k + b * a.kh + j0 * a.kr;
            for (int64_t j = 0; j < n; ++j)
                for (int64_t cc = 0; cc < d; ++cc) kt[cc * KT + j] = k[j * a.kr + cc];
            v = a.v + b * a.vh + j0 * a.vr;
            vr = a.vr;
        }
        for (int64_t cc = 0; cc < d; ++cc)
            for (int64_t j = n; j < np; ++j) kt[cc * KT + j] = 0.0f;
        for (int64_t i0 = 0; i0 < nr; i0 += MR) {
            const int64_t mr = nr - i0 < MR ? nr - i0 : MR;
            const float* qb = qs.data() + i0 * d;
            // scores s[i][j] = q_i . k_j (base 2), MR rows x 32 keys in registers; each row's maximum on the way
            vf mx[MR];
            for (int i = 0; i < MR; ++i) mx[i] = splat(-INFINITY);
            for (int64_t j = 0; j < np; j += 2 * VL) {
                vf acc[MR][2];
                for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = vf{};
                for (int64_t cc = 0; cc < d; ++cc) {
                    const vf k0 = load(kt.data() + cc * KT + j), k1 = load(kt.data() + cc * KT + j + VL);
                    for (int i = 0; i < MR; ++i) {
                        const float qv = qb[i * d + cc];
                        acc[i][0] += qv * k0;
                        acc[i][1] += qv * k1;
                    }
                }
                if (j + 2 * VL > n)  // padding keys: no maximum, no weight (2^-inf = 0 below)
                    for (int i = 0; i < MR; ++i)
                        for (int64_t jj = n; jj < j + 2 * VL; ++jj) acc[i][(jj - j) / VL][(jj - j) % VL] = -INFINITY;
                for (int i = 0; i < MR; ++i) {
                    store(s + i * KT + j, acc[i][0]);
                    store(s + i * KT + j + VL, acc[i][1]);
                    mx[i] = vmax(mx[i], vmax(acc[i][0], acc[i][1]));
                }
            }
            for (int64_t i = 0; i < mr; ++i) {
                float* si = s + i * KT;
                const float mold = m[i0 + i], mnew = std::fmax(mold, hmax(mx[i]));
                const float alpha = std::exp2(mold - mnew);  // 0 on the first tile (mold = -inf)
                vf sum = vf{};
                for (int64_t j = 0; j < np; j += VL) {
                    vf p = exp2_neg(load(si + j) - mnew);
                    store(si + j, p);
                    sum += p;
                }
                l[i0 + i] = l[i0 + i] * alpha + hsum(sum);
                m[i0 + i] = mnew;
                if (alpha != 1.0f) {
                    float* oi = o + (i0 + i) * dv;
                    for (int64_t e = 0; e < dv; e += VL) store(oi + e, load(oi + e) * alpha);
                }
            }
            // out[i] += sum_j p[i][j] v_j, MR rows x 16 value dims in registers
            for (int64_t e = 0; e < dv; e += VL) {
                vf acc[MR];
                for (int i = 0; i < MR; ++i) acc[i] = i < mr ? load(o + (i0 + i) * dv + e) : vf{};
                for (int64_t j = 0; j < n; ++j) {
                    const vf vj = load(v + j * vr + e);
                    for (int i = 0; i < MR; ++i) acc[i] += s[i * KT + j] * vj;
                }
                for (int i = 0; i < mr; ++i) store(o + (i0 + i) * dv + e, acc[i]);
            }
        }
    }
    for (int64_t i = 0; i < nr; ++i) {
        const float inv = 1.0f / l[i];
        for (int64_t e = 0; e < dv; ++e) o[i * dv + e] *= inv;
        a.lse[b * a.rows + r0 + i] = (m[i] + std::log2(l[i])) * 0.6931471805599453f;
    }
}

// worker w of nw: its share of every head's rows (contiguous, a multiple of MR)
// Worker w of nw takes a contiguous share of the (head, block of MR rows) pairs, heads outer: a decode step's few
// query rows (G samples x the query heads of one key head: 3 blocks at G = 8 on SmolLM2) spread over the threads
// through the heads too, where splitting the rows alone left a thread idle a third of the time. Each row is computed
// alike whichever worker takes it (its block starts at a multiple of MR), so the result does not depend on nw.
void worker(const Args& a, int w, int nw) {
    const int64_t blocks = (a.rows + MR - 1) / MR, items = a.bh * blocks;
    const int64_t lo = items * w / nw, hi = items * (w + 1) / nw;
    for (int64_t i = lo; i < hi;) {
        const int64_t b = i / blocks, first = i % blocks;
        const int64_t last = std::min(blocks, first + (hi - i));  // this head's blocks in the share
        const int64_t r0 = first * MR;
        rows_over_keys(a, b, r0, std::min(a.rows, last * MR) - r0);
        i += last - first;
    }
}

// The gradient of the queries alone (the keys and values constants: a detached replay's prompt part), rows r0 .. r0
// + nr of head b: dq_i = scale * sum_j p_ij (dp_ij - delta_i) k_j with p_ij = exp(q_i . k_j * scale - lse_i), dp_ij =
// dO_i . v_j and delta_i = dO_i . O_i (O the merged output). Per tile of KT keys, keys and values transposed once;
// the scores and dO . v of MR rows x 32 keys in registers as in the forward; dq accumulated over the tile's keys,
// MR rows x 16 head dims per vector. d must be a multiple of 16.
struct GradArgs {
    const float *q, *k, *v, *g, *o, *lse;
    float* dq;
    int64_t bh, rows, t, d, dv;
    int64_t qh, qr, kh, kr, vh, vr, gh, gr, oh, orr;
    float scale;
};

void dq_rows(const GradArgs& a, int64_t b, int64_t r0, int64_t nr) {
    const int64_t d = a.d, dv = a.dv, t = a.t;
    std::vector<float> kt(d * KT), vt(dv * KT), sbuf(MR * KT), qs((nr + MR) * d, 0.0f), gs((nr + MR) * dv, 0.0f);
    std::vector<float> m(nr + MR, 0.0f), delta(nr + MR, 0.0f);
    float* s = sbuf.data();
    const float c = a.scale * 1.4426950408889634f;  // scores in base 2
    for (int64_t i = 0; i < nr; ++i) {  // rows past the last stay zero
        const float* qi = a.q + b * a.qh + (r0 + i) * a.qr;
        const float* gi = a.g + b * a.gh + (r0 + i) * a.gr;
        const float* oi = a.o + b * a.oh + (r0 + i) * a.orr;
        for (int64_t cc = 0; cc < d; ++cc) qs[i * d + cc] = qi[cc] * c;
        float dl = 0.0f;
        for (int64_t e = 0; e < dv; ++e) {
            gs[i * dv + e] = gi[e];
            dl += gi[e] * oi[e];
        }
        delta[i] = dl;
        m[i] = a.lse[b * a.rows + r0 + i] * 1.4426950408889634f;  // the log-sum-exp in base 2
    }
    float* dq = a.dq + (b * a.rows + r0) * d;
    std::memset(dq, 0, sizeof(float) * nr * d);
    for (int64_t j0 = 0; j0 < t; j0 += KT) {
        const int64_t n = t - j0 < KT ? t - j0 : KT;
        const int64_t np = (n + 2 * VL - 1) / (2 * VL) * (2 * VL);
        const float* k = a.k + b * a.kh + j0 * a.kr;
        const float* v = a.v + b * a.vh + j0 * a.vr;
        for (int64_t j = 0; j < n; ++j) {
            for (int64_t cc = 0; cc < d; ++cc) kt[cc * KT + j] = k[j * a.kr + cc];
            for (int64_t e = 0; e < dv; ++e) vt[e * KT + j] = v[j * a.vr + e];
        }
        for (int64_t j = n; j < np; ++j) {
            for (int64_t cc = 0; cc < d; ++cc) kt[cc * KT + j] = 0.0f;
            for (int64_t e = 0; e < dv; ++e) vt[e * KT + j] = 0.0f;
        }
        for (int64_t i0 = 0; i0 < nr; i0 += MR) {
            const int64_t mr = nr - i0 < MR ? nr - i0 : MR;
            const float* qb = qs.data() + i0 * d;
            const float* gb = gs.data() + i0 * dv;
            for (int64_t j = 0; j < np; j += 2 * VL) {
                vf sc[MR][2], dp[MR][2];
                for (int i = 0; i < MR; ++i) sc[i][0] = sc[i][1] = dp[i][0] = dp[i][1] = vf{};
                for (int64_t cc = 0; cc < d; ++cc) {
                    const vf k0 = load(kt.data() + cc * KT + j), k1 = load(kt.data() + cc * KT + j + VL);
                    for (int i = 0; i < MR; ++i) {
                        const float qv = qb[i * d + cc];
                        sc[i][0] += qv * k0;
                        sc[i][1] += qv * k1;
                    }
                }
                for (int64_t e = 0; e < dv; ++e) {
                    const vf v0 = load(vt.data() + e * KT + j), v1 = load(vt.data() + e * KT + j + VL);
                    for (int i = 0; i < MR; ++i) {
                        const float gv = gb[i * dv + e];
                        dp[i][0] += gv * v0;
                        dp[i][1] += gv * v1;
                    }
                }
                for (int i = 0; i < MR; ++i) {
                    const float mi = m[i0 + i], di = delta[i0 + i];
                    for (int h = 0; h < 2; ++h)  // padding keys' columns are never read (dq sums j < n)
                        store(s + i * KT + j + h * VL, exp2_neg(sc[i][h] - mi) * (dp[i][h] - di));
                }
            }
            // dq[i] += sum_j ds[i][j] k_j, MR rows x 16 head dims in registers
            for (int64_t e = 0; e < d; e += VL) {
                vf acc[MR];
                for (int i = 0; i < MR; ++i) acc[i] = i < mr ? load(dq + (i0 + i) * d + e) : vf{};
                for (int64_t j = 0; j < n; ++j) {
                    const vf kj = load(k + j * a.kr + e);
                    for (int i = 0; i < MR; ++i) acc[i] += s[i * KT + j] * kj;
                }
                for (int i = 0; i < mr; ++i) store(dq + (i0 + i) * d + e, acc[i]);
            }
        }
    }
    for (int64_t i = 0; i < nr * d; ++i) dq[i] *= a.scale;
}

void dq_worker(const GradArgs& a, int w, int nw) {
    const int64_t blocks = (a.rows + MR - 1) / MR, items = a.bh * blocks;
    const int64_t lo = items * w / nw, hi = items * (w + 1) / nw;
    for (int64_t i = lo; i < hi;) {
        const int64_t b = i / blocks, first = i % blocks;
        const int64_t last = std::min(blocks, first + (hi - i));
        const int64_t r0 = first * MR;
        dq_rows(a, b, r0, std::min(a.rows, last * MR) - r0);
        i += last - first;
    }
}

// all workers over `a`: the calling thread and threads - 1 more
int run(const Args& a, int threads) {
    const int64_t blocks = a.bh * ((a.rows + MR - 1) / MR);
    const int nw = blocks < threads ? (int)blocks : threads;
    if (nw <= 1) {
        worker(a, 0, 1);
        return 0;
    }
    std::vector<std::thread> pool;
    for (int w = 1; w < nw; ++w) pool.emplace_back(worker, std::cref(a), w, nw);
    worker(a, 0, nw);
    for (auto& th : pool) th.join();
    return 0;
}

}  // namespace

extern "C" int longstraw_attend_full(const float* q, const float* k, const float* v, float* out, float* lse,
                                     int64_t bh, int64_t rows, int64_t t, int64_t d, int64_t dv,
                                     int64_t qh, int64_t qr, int64_t kh, int64_t kr, int64_t vh, int64_t vr,
                                     float scale, int threads) {
    if (dv % VL != 0 || t < 1 || d < 1 || threads < 1) return 1;
    return run(Args{q, k, v, out, lse, bh, rows, t, d, dv, qh, qr, kh, kr, vh, vr, scale}, threads);
}

// The same over 8-bit keys and values: codes `kc` [bh, t, d], `vc` [bh, t, dv] (strides as above, in codes),
// decoded through `lut` (code -> value) and times their scale `ks` / `vs` [bh, t / block] (head strides ksh, vsh),
// in float32 into each tile: the attention over the dequantized state without a dequantized copy of it.
extern "C" int longstraw_attend_full_8bit(const float* q, const uint8_t* kc, const float* ks, const uint8_t* vc,
                                          const float* vs, const float* lut, float* out, float* lse, int64_t bh,
                                          int64_t rows, int64_t t, int64_t d, int64_t dv, int64_t block,
                                          int64_t qh, int64_t qr, int64_t kh, int64_t kr, int64_t ksh, int64_t vh,
                                          int64_t vr, int64_t vsh, float scale, int threads) {
    if (dv % VL != 0 || t < 1 || d < 1 || block < 1 || threads < 1) return 1;
    Args a{q, nullptr, nullptr, out, lse, bh, rows, t, d, dv, qh, qr, kh, kr, vh, vr, scale};
    a.kc = kc;
    a.vc = vc;
    a.ks = ks;
    a.vs = vs;
    a.lut = lut;
    a.block = block;
    a.ksh = ksh;
    a.vsh = vsh;
    return run(a, threads);
}

// dq of `longstraw_attend_full`'s attention (see `dq_rows`): q [bh, rows, d], k [bh, t, d], v [bh, t, dv], the
// incoming gradient g and the merged output o [bh, rows, dv] (any head and row strides, last dims contiguous), lse
// [bh, rows] contiguous (natural log), dq [bh, rows, d] contiguous. d and dv multiples of 16.
extern "C" int longstraw_attend_full_dq(const float* q, const float* k, const float* v, const float* g, const float* o,
                                        const float* lse, float* dq, int64_t bh, int64_t rows, int64_t t, int64_t d,
                                        int64_t dv, int64_t qh, int64_t qr, int64_t kh, int64_t kr, int64_t vh,
                                        int64_t vr, int64_t gh, int64_t gr, int64_t oh, int64_t orr, float scale,
                                        int threads) {
    if (dv % VL != 0 || d % VL != 0 || t < 1 || threads < 1) return 1;
    const GradArgs a{q, k, v, g, o, lse, dq, bh, rows, t, d, dv, qh, qr, kh, kr, vh, vr, gh, gr, oh, orr, scale};
    const int64_t blocks = a.bh * ((a.rows + MR - 1) / MR);
    const int nw = blocks < threads ? (int)blocks : threads;
    if (nw <= 1) {
        dq_worker(a, 0, 1);
        return 0;
    }
    std::vector<std::thread> pool;
    for (int w = 1; w < nw; ++w) pool.emplace_back(dq_worker, std::cref(a), w, nw);
    dq_worker(a, 0, nw);
    for (auto& th : pool) th.join();
    return 0;
}

// The kernel's 2^x on n floats (n a multiple of 16, every x <= 0), for its tests.
extern "C" int longstraw_exp2_neg(const float* x, float* y, int64_t n) {
    if (n % VL != 0) return 1;
    for (int64_t i = 0; i < n; i += VL) store(y + i, exp2_neg(load(x + i)));
    return 0;
}
