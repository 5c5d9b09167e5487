// Backward of layer_norm and rms_norm over rows of N <= 4096 values (hal.ops.*_norm_backward).
//
// One block of 256 threads per row at a time: the row of x and of grad stays in registers (each
// thread holds PER = 16 values: 16 / VEC vectors of VEC values, 16-byte accesses), so the statistics
// are exact two-pass ones (mean, then the variance about it) and the row is read once. Three block
// sums per row (layer norm: mean, variance, the two gradient sums together; rms: two). Each thread
// owns fixed columns and accumulates grad_weight / grad_bias over the block's rows; the blocks'
// partial sums (one row of each per block) are added by norm_bwd_columns, 32 columns per block.
//
//   dx = rstd * (w * g - mean(w * g) - xhat * mean(w * g * xhat))   (rms: without the first mean)
#include "hal_cpp.cuh"

#if !defined(HAL_T) || !defined(HAL_VEC)
#error "define HAL_T and HAL_VEC (the kit does)"
#endif

namespace hal {

constexpr int NORM_THREADS = 256;
constexpr int NORM_WARPS = NORM_THREADS / WARP_SIZE;
constexpr int PER = 16;  // values of a row per thread: rows of up to NORM_THREADS * PER = 4096

// The block-wide sums of a and b, in every thread.
template <class A> HAL_DEVICE void block_sum2(A& a, A& b) {
  for (int m = 1; m < WARP_SIZE; m <<= 1) {
    a += warp_xor(a, m);
    b += warp_xor(b, m);
  }
  __shared__ A sh[NORM_WARPS][2];
  const int t = flat_thread();
  __syncthreads();  // the previous sum's readers are done
  if (t % WARP_SIZE == 0) {
    sh[t / WARP_SIZE][0] = a;
    sh[t / WARP_SIZE][1] = b;
  }
  __syncthreads();
  a = A(0);
  b = A(0);
  for (int w = 0; w < NORM_WARPS; ++w) {
    a += sh[w][0];
    b += sh[w][1];
  }
}

template <class T, class A, int VEC>
HAL_DEVICE void norm_bwd_rows(const T* g, const T* x, T* dx, const void* w, int wcode, A* part, i64 rows, int N,
                              A eps, i64 per_block, bool rms) {
  constexpr int K = PER / VEC;
  const int t = flat_thread();
  A wv[K][VEC], dw[K][VEC], db[K][VEC];
  bool live[K];
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int c0 = (k * NORM_THREADS + t) * VEC;
    live[k] = c0 < N;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      wv[k][j] = live[k] && w != nullptr ? load_code<A>(w, wcode, c0 + j) : A(1);
      dw[k][j] = db[k][j] = A(0);
    }
  }
  const A inv_n = A(1) / A(N);
  const i64 r0 = i64(blockIdx.x) * per_block, r1 = r0 + per_block < rows ? r0 + per_block : rows;
  for (i64 r = r0; r < r1; ++r) {
    A xv[K][VEC], gv[K][VEC];
#pragma unroll
    for (int k = 0; k < K; ++k) {
      if (live[k]) {
        load_pack<T, VEC>(x + r * N + (k * NORM_THREADS + t) * VEC, xv[k]);
        load_pack<T, VEC>(g + r * N + (k * NORM_THREADS + t) * VEC, gv[k]);
      } else {
#pragma unroll
        for (int j = 0; j < VEC; ++j) xv[k][j] = gv[k][j] = A(0);
      }
    }
    A s = A(0), unused = A(0);
    A mean = A(0);
    if (!rms) {
#pragma unroll
      for (int k = 0; k < K; ++k)
#pragma unroll
        for (int j = 0; j < VEC; ++j) s += xv[k][j];
      block_sum2(s, unused);
      mean = s * inv_n;
    }
    A q = A(0);
#pragma unroll
    for (int k = 0; k < K; ++k)
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const A d = live[k] ? xv[k][j] - mean : A(0);
        q += d * d;
      }
    unused = A(0);
    block_sum2(q, unused);
    const A rstd = A(1) / sqrt_acc(q * inv_n + eps);
    A s_wg = A(0), s_wgx = A(0);
#pragma unroll
    for (int k = 0; k < K; ++k)
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const A xh = (xv[k][j] - mean) * rstd, wg = wv[k][j] * gv[k][j];
        xv[k][j] = xh;
        s_wg += wg;
        s_wgx += wg * xh;
      }
    block_sum2(s_wg, s_wgx);
    const A c1 = rms ? A(0) : s_wg * inv_n, c2 = s_wgx * inv_n;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      if (!live[k]) continue;
      A out[VEC];
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        out[j] = rstd * (wv[k][j] * gv[k][j] - c1 - xv[k][j] * c2);
        dw[k][j] += gv[k][j] * xv[k][j];
        db[k][j] += gv[k][j];
      }
      store_pack<T, VEC>(dx + r * N + (k * NORM_THREADS + t) * VEC, out);
    }
  }
#pragma unroll
  for (int k = 0; k < K; ++k) {
    if (!live[k]) continue;
    const int c0 = (k * NORM_THREADS + t) * VEC;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      part[(i64(blockIdx.x) * 2) * N + c0 + j] = dw[k][j];
      part[(i64(blockIdx.x) * 2 + 1) * N + c0 + j] = db[k][j];
    }
  }
}

// grad_weight and grad_bias (either may be null) from the blocks' partial sums: block b covers 32
// columns, its threads 8 lanes of blocks each.
template <class A>
HAL_DEVICE void norm_bwd_columns(const A* part, int blocks, int N, void* gw, void* gb, int codes) {
  constexpr int COLS32 = 32, LANES = NORM_THREADS / COLS32;
  const int t = flat_thread(), col = int(blockIdx.x) * COLS32 + t % COLS32, lane = t / COLS32;
  A sw = A(0), sb = A(0);
  if (col < N)
    for (int b = lane; b < blocks; b += LANES) {
      sw += part[(i64(b) * 2) * N + col];
      sb += part[(i64(b) * 2 + 1) * N + col];
    }
  __shared__ A sh[LANES][COLS32][2];
  sh[lane][t % COLS32][0] = sw;
  sh[lane][t % COLS32][1] = sb;
  __syncthreads();
  if (lane == 0 && col < N) {
    for (int i = 1; i < LANES; ++i) {
      sw += sh[i][t][0];
      sb += sh[i][t][1];
    }
    if (gw != nullptr) store_code<A>(gw, codes & 15, col, sw);
    if (gb != nullptr) store_code<A>(gb, (codes >> 4) & 15, col, sb);
  }
}

}  // namespace hal

typedef HAL_T T;
typedef hal::Acc<HAL_T>::type A;

// flags: bit 0 rms_norm (no mean, no bias gradient)
extern "C" __global__ void __launch_bounds__(hal::NORM_THREADS)
norm_bwd(const T* g, const T* x, T* dx, const void* w, int wcode, A* part, hal::i64 rows, int N, double eps,
         hal::i64 per_block, int flags) {
  hal::norm_bwd_rows<T, A, HAL_VEC>(g, x, dx, w, wcode, part, rows, N, A(eps), per_block, flags & 1);
}

extern "C" __global__ void __launch_bounds__(hal::NORM_THREADS)
norm_bwd_columns(const A* part, int blocks, int N, void* gw, void* gb, int codes) {
  hal::norm_bwd_columns<A>(part, blocks, N, gw, gb, codes);
}
