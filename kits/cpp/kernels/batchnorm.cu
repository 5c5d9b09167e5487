// Batch normalisation over dimension 1 (+ optional ReLU): training statistics, normalise, backward.
//
// Two layouts of a dense x of shape (N, C, spatial...) with S spatial positions:
//   rows   (channels contiguous: channels_last, or S == 1): x[r * C + c] for r < N * S "units";
//          a block is COLS threads across (each a vector of VEC channels) by BN_THREADS / COLS rows.
//   planes (NCHW): x[(n * C + c) * S + s]; a reduction block walks whole planes of one channel.
// VEC channels (rows) or positions (planes) move as one 16-byte access; VEC = 1 is the fallback for
// sizes or addresses that are not multiples of 16 bytes.
//
// Reductions are one pass over the data with Welford moments (mean and M2, with the count shared by
// the VEC lanes of a thread so one reciprocal serves them all), merged by Chan's formula across the
// lanes of a warp (shuffles), the warps of a block (shared memory) and the blocks of a launch: each
// block writes its partial moments, and the last block of a channel tile to finish (a counter per
// tile, reset by that block) merges them and writes the per-channel results. The backward pass
// accumulates the co-moment of x and dz = grad masked by the forward's ReLU, which gives sum(dz) and
// sum(dz * xhat) without a separate statistics pass.
//
// Per-channel vectors live in one (8, C) buffer `vec` in the accumulation type, rows: 0 a, 1 b
// (y = x * a + b), 2 mean, 3 1/std, 4 A, 5 B, 6 Cc (dx = A * dz + B * x + Cc).
#include "hal_cpp.cuh"

namespace hal {

constexpr int BN_THREADS = 256;
constexpr int COLS = 8;                        // rows layout: channel vectors across a block
constexpr int ROWS_PER_STEP = BN_THREADS / COLS;
constexpr int BN_WARPS = BN_THREADS / WARP_SIZE;
constexpr int UNROLL = 4;                      // independent accesses in flight per thread

// --- moments --------------------------------------------------------------------------------------

// Welford moments of K lanes that share their count.
template <class A, int K> struct Moments {
  static constexpr int FIELDS = 2;
  A n;
  A f[FIELDS][K];  // mean, M2

  HAL_DEVICE void init() {
    n = A(0);
#pragma unroll
    for (int k = 0; k < K; ++k) f[0][k] = f[1][k] = A(0);
  }
  HAL_DEVICE void add(const A (&x)[K]) {
    n += A(1);
    const A inv = A(1) / n;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const A d = x[k] - f[0][k];
      f[0][k] += d * inv;
      f[1][k] += d * (x[k] - f[0][k]);
    }
  }
  HAL_DEVICE void merge(const Moments& o) {
    if (o.n == A(0)) return;
    const A total = n + o.n, w = o.n / total, g = n * w;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const A d = o.f[0][k] - f[0][k];
      f[0][k] += d * w;
      f[1][k] += o.f[1][k] + d * d * g;
    }
    n = total;
  }
};

// Moments of x and of z, and their co-moment sum((x - mean_x) * (z - mean_z)) = sum(z * (x - mean_x)).
template <class A, int K> struct CoMoments {
  static constexpr int FIELDS = 4;
  A n;
  A f[FIELDS][K];  // mean x, M2 x, mean z, co-moment

  HAL_DEVICE void init() {
    n = A(0);
#pragma unroll
    for (int k = 0; k < K; ++k) f[0][k] = f[1][k] = f[2][k] = f[3][k] = A(0);
  }
  HAL_DEVICE void add(const A (&x)[K], const A (&z)[K]) {
    n += A(1);
    const A inv = A(1) / n;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const A dx = x[k] - f[0][k];
      f[0][k] += dx * inv;
      f[1][k] += dx * (x[k] - f[0][k]);
      f[2][k] += (z[k] - f[2][k]) * inv;
      f[3][k] += dx * (z[k] - f[2][k]);
    }
  }
  HAL_DEVICE void merge(const CoMoments& o) {
    if (o.n == A(0)) return;
    const A total = n + o.n, w = o.n / total, g = n * w;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const A dx = o.f[0][k] - f[0][k], dz = o.f[2][k] - f[2][k];
      f[0][k] += dx * w;
      f[1][k] += o.f[1][k] + dx * dx * g;
      f[2][k] += dz * w;
      f[3][k] += o.f[3][k] + dx * dz * g;
    }
    n = total;
  }
};

template <class S> HAL_DEVICE S shfl(const S& s, int mask) {
  S o;
  o.n = warp_xor(s.n, mask);
#pragma unroll
  for (int i = 0; i < S::FIELDS; ++i)
#pragma unroll
    for (int k = 0; k < int(sizeof(s.f[0]) / sizeof(s.f[0][0])); ++k) o.f[i][k] = warp_xor(s.f[i][k], mask);
  return o;
}

// The K lanes of s (same count each) merged into one.
template <template <class, int> class M, class A, int K> HAL_DEVICE M<A, 1> collapse(const M<A, K>& s) {
  M<A, 1> out;
  out.init();
#pragma unroll
  for (int k = 0; k < K; ++k) {
    M<A, 1> lane;
    lane.n = s.n;
#pragma unroll
    for (int i = 0; i < M<A, 1>::FIELDS; ++i) lane.f[i][0] = s.f[i][k];
    out.merge(lane);
  }
  return out;
}

// Merge the states of every thread whose flat index is congruent modulo STRIDE; the result is in
// threads 0 .. STRIDE-1. Every thread of the block must call it.
template <int STRIDE, class S> HAL_DEVICE void block_merge(S& s) {
  for (int m = STRIDE; m < WARP_SIZE; m <<= 1) s.merge(shfl(s, m));
  __shared__ S sh[BN_WARPS][STRIDE];
  const int t = flat_thread(), w = t / WARP_SIZE, lane = t % WARP_SIZE;
  if (lane < STRIDE) sh[w][lane] = s;
  __syncthreads();
  if (t < STRIDE)
    for (int i = 1; i < BN_WARPS; ++i) s.merge(sh[i][t]);
  __syncthreads();
}

// True in every thread of the block that finished last among the blocks sharing `counter` (the
// blocks along x); that block resets the counter for the next launch on the stream.
HAL_DEVICE bool last_block(unsigned* counter) {
  __shared__ int is_last;
  __threadfence();
  __syncthreads();
  if (flat_thread() == 0) {
    const unsigned done = atomicAdd(counter, 1u);
    is_last = done == gridDim.x - 1;
    if (is_last) *counter = 0u;
  }
  __syncthreads();
  if (is_last) __threadfence();
  return is_last;
}

// --- per-channel parameters -------------------------------------------------------------------------

// Pointers to the optional per-channel vectors (null when absent) and their dtype codes, 4 bits each
// in `codes`: weight 0, bias 4, conv_bias 8, running_mean 12, running_var 16, grad_weight 20, grad_bias 24.
struct Params {
  const void* w;
  const void* b;
  const void* cbias;
  void* rm;
  void* rv;
  void* gw;
  void* gb;
  int codes;
  HAL_DEVICE int code(int field) const { return (codes >> (4 * field)) & 15; }
  template <class A> HAL_DEVICE A get(const void* p, int field, int c, A absent) const {
    return p ? load_code<A>(p, code(field), c) : absent;
  }
};

// Batch statistics of channel c -> a, b, mean, 1/std; the running statistics updated when asked.
template <class A> HAL_DEVICE void forward_channel(int c, int C, A mean, A m2, A count, A momentum, A eps, bool update,
                                                  const Params& p, A* vec) {
  const A var = m2 / count;
  const A invstd = A(1) / sqrt_acc(var + eps);
  const A a = p.get<A>(p.w, 0, c, A(1)) * invstd;
  vec[c] = a;
  vec[C + c] = p.get<A>(p.b, 1, c, A(0)) - mean * a;
  vec[2 * C + c] = mean;
  vec[3 * C + c] = invstd;
  if (update) {
    const A cb = p.get<A>(p.cbias, 2, c, A(0));
    const A rm = load_code<A>(p.rm, p.code(3), c), rv = load_code<A>(p.rv, p.code(4), c);
    store_code<A>(p.rm, p.code(3), c, (A(1) - momentum) * rm + momentum * (mean + cb));
    store_code<A>(p.rv, p.code(4), c, (A(1) - momentum) * rv + momentum * var * (count / (count - A(1))));
  }
}

// Co-moments of channel c -> grad_weight, grad_bias and (A, B, Cc) of dx = A * dz + B * x + Cc.
template <class A> HAL_DEVICE void backward_channel(int c, int C, A mx, A m2, A mz, A cxz, A count, A eps, bool training,
                                                   const Params& p, A* vec) {
  const A sum_dz = count * mz;
  A invstd, gw, ga, gbx, gc;
  if (training) {
    invstd = A(1) / sqrt_acc(m2 / count + eps);
    gw = invstd * cxz;
    ga = p.get<A>(p.w, 0, c, A(1)) * invstd;
    gbx = -ga * invstd * invstd * cxz / count;
    gc = -ga * mz - gbx * mx;
  } else {  // the running statistics are constants
    invstd = A(1) / sqrt_acc(load_code<A>(p.rv, p.code(4), c) + eps);
    const A mean = load_code<A>(p.rm, p.code(3), c) - p.get<A>(p.cbias, 2, c, A(0));
    gw = invstd * (cxz + (mx - mean) * sum_dz);
    ga = p.get<A>(p.w, 0, c, A(1)) * invstd;
    gbx = A(0);
    gc = A(0);
  }
  store_code<A>(p.gw, p.code(5), c, gw);
  store_code<A>(p.gb, p.code(6), c, sum_dz);
  vec[4 * C + c] = ga;
  vec[5 * C + c] = gbx;
  vec[6 * C + c] = gc;
}

// --- what a reduction accumulates ----------------------------------------------------------------

template <class T, class A> struct ForwardKind {
  template <int K> using Stat = Moments<A, K>;
  template <int K> struct Sample { A x[K]; };
  const T* x;
  template <int K> HAL_DEVICE void load(Sample<K>& s, i64 off, const A (&)[K], const A (&)[K], bool) const {
    load_pack<T, K>(x + off, s.x);
  }
  template <int K> HAL_DEVICE static void add(Stat<K>& st, const Sample<K>& s) { st.add(s.x); }
  // flags bit 0: update the running statistics
  HAL_DEVICE static void finish(const A* f, int c, int C, A count, A momentum, A eps, int flags, const Params& p, A* vec) {
    forward_channel<A>(c, C, f[0], f[1], count, momentum, eps, flags & 1, p, vec);
  }
};

template <class T, class A> struct BackwardKind {
  template <int K> using Stat = CoMoments<A, K>;
  template <int K> struct Sample { A x[K]; A z[K]; };
  const T* g;
  const T* x;
  template <int K> HAL_DEVICE void load(Sample<K>& s, i64 off, const A (&a)[K], const A (&b)[K], bool relu) const {
    load_pack<T, K>(x + off, s.x);
    load_pack<T, K>(g + off, s.z);
    if (relu) {
#pragma unroll
      for (int k = 0; k < K; ++k)
        if (!(s.x[k] * a[k] + b[k] > A(0))) s.z[k] = A(0);
    }
  }
  template <int K> HAL_DEVICE static void add(Stat<K>& st, const Sample<K>& s) { st.add(s.x, s.z); }
  // flags bit 1: training (batch statistics; else the running ones)
  HAL_DEVICE static void finish(const A* f, int c, int C, A count, A, A eps, int flags, const Params& p, A* vec) {
    backward_channel<A>(c, C, f[0], f[1], f[2], f[3], count, eps, flags & 2, p, vec);
  }
};

// Units (rows, or planes of S positions) handled by reduction block b.
template <class A> HAL_DEVICE A block_count(i64 b, i64 units, i64 per_block, i64 S) {
  const i64 left = units - b * per_block;
  return A((left < per_block ? left : per_block) * S);
}

// Merge every block's partial moments of the channels c0 .. c0 + K - 1 (threads congruent modulo
// STRIDE cover the same channels and split the blocks among them).
template <int STRIDE, class St, class A, int K>
HAL_DEVICE void merge_partials(St& st, const A* part, int C, int c0, bool active, i64 units, i64 per_block, i64 S) {
  st.init();
  if (active) {
    const int first = flat_thread() / STRIDE, step = BN_THREADS / STRIDE;
#pragma unroll 4
    for (int b = first; b < int(gridDim.x); b += step) {
      St p;
      p.n = block_count<A>(b, units, per_block, S);
#pragma unroll
      for (int i = 0; i < St::FIELDS; ++i)
#pragma unroll
        for (int k = 0; k < K; ++k) p.f[i][k] = load_cg(part + (i64(b) * St::FIELDS + i) * C + c0 + k);
      st.merge(p);
    }
  }
  block_merge<STRIDE>(st);
}

template <class St, class A, int K> HAL_DEVICE void write_partial(const St& st, A* part, int C, int c0) {
#pragma unroll
  for (int i = 0; i < St::FIELDS; ++i)
#pragma unroll
    for (int k = 0; k < K; ++k) part[(i64(blockIdx.x) * St::FIELDS + i) * C + c0 + k] = st.f[i][k];
}

// --- reductions -------------------------------------------------------------------------------------

// rows layout: block (bx, tile) reduces rows [bx * per_block, ...) of channel vectors tile * COLS + tx.
// flags: bit 0 update the running statistics (forward) / ReLU mask (backward), bit 1 training (backward).
template <class Kind, class A, int VEC>
HAL_DEVICE void reduce_rows(const Kind& kind, A* part, unsigned* counters, A* vec, const Params& p, i64 units, int C,
                            i64 per_block, A count, A momentum, A eps, int flags, bool relu) {
  using St = typename Kind::template Stat<VEC>;
  using Sm = typename Kind::template Sample<VEC>;
  const int t = flat_thread(), tx = t % COLS, ty = t / COLS;
  const int c0 = (int(blockIdx.y) * COLS + tx) * VEC;
  const bool active = c0 < C;
  A a[VEC], b[VEC];
#pragma unroll
  for (int k = 0; k < VEC; ++k) {
    a[k] = relu && active ? vec[c0 + k] : A(0);
    b[k] = relu && active ? vec[C + c0 + k] : A(0);
  }
  St st;
  st.init();
  if (active) {
    const i64 r1 = (i64(blockIdx.x) + 1) * per_block < units ? (i64(blockIdx.x) + 1) * per_block : units;
    i64 r = i64(blockIdx.x) * per_block + ty;
    for (; r + (UNROLL - 1) * ROWS_PER_STEP < r1; r += UNROLL * ROWS_PER_STEP) {
      Sm s[UNROLL];
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) kind.load(s[u], (r + u * ROWS_PER_STEP) * C + c0, a, b, relu);
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) Kind::add(st, s[u]);
    }
    for (; r < r1; r += ROWS_PER_STEP) {
      Sm s;
      kind.load(s, r * C + c0, a, b, relu);
      Kind::add(st, s);
    }
  }
  block_merge<COLS>(st);
  if (t < COLS && active) write_partial<St, A, VEC>(st, part, C, c0);
  if (!last_block(counters + blockIdx.y)) return;
  merge_partials<COLS, St, A, VEC>(st, part, C, c0, active, units, per_block, 1);
  // one thread per channel of the tile finishes it (an unrolled loop over the VEC channels of a
  // thread would inline VEC copies of the dtype switches)
  __shared__ A fin[COLS * VEC][St::FIELDS];
  if (t < COLS)
#pragma unroll
    for (int i = 0; i < St::FIELDS; ++i)
#pragma unroll
      for (int k = 0; k < VEC; ++k) fin[t * VEC + k][i] = st.f[i][k];
  __syncthreads();
  const int c = int(blockIdx.y) * COLS * VEC + t;
  if (t < COLS * VEC && c < C) Kind::finish(fin[t], c, C, count, momentum, eps, flags, p, vec);
}

// planes layout: block (bx, c) reduces planes n in [bx * per_block, ...) of channel c.
template <class Kind, class A, int VEC>
HAL_DEVICE void reduce_planes(const Kind& kind, A* part, unsigned* counters, A* vec, const Params& p, i64 units, int C,
                              i64 S, i64 per_block, A count, A momentum, A eps, int flags, bool relu) {
  using St = typename Kind::template Stat<VEC>;
  using Sm = typename Kind::template Sample<VEC>;
  using St1 = typename Kind::template Stat<1>;
  const int t = flat_thread(), c = int(blockIdx.y);
  A a[VEC], b[VEC];
#pragma unroll
  for (int k = 0; k < VEC; ++k) {
    a[k] = relu ? vec[c] : A(0);
    b[k] = relu ? vec[C + c] : A(0);
  }
  // a block's items (plane, vector) are counted in 32 bits: the host keeps per_block * S / VEC < 2**31
  const u32 sv = u32(S / VEC);
  const i64 n0 = i64(blockIdx.x) * per_block;
  const i64 n1 = n0 + per_block < units ? n0 + per_block : units;
  const u32 items = u32(n1 - n0) * sv;
  St st;
  st.init();
  u32 i = t;
  for (; i + (UNROLL - 1) * BN_THREADS < items; i += UNROLL * BN_THREADS) {
    Sm s[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const u32 j = i + u * BN_THREADS;
      kind.load(s[u], ((n0 + j / sv) * C + c) * S + i64(j % sv) * VEC, a, b, relu);
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) Kind::add(st, s[u]);
  }
  for (; i < items; i += BN_THREADS) {
    Sm s;
    kind.load(s, ((n0 + i / sv) * C + c) * S + i64(i % sv) * VEC, a, b, relu);
    Kind::add(st, s);
  }
  St1 one = collapse(st);
  block_merge<1>(one);
  if (t == 0) write_partial<St1, A, 1>(one, part, C, c);
  if (!last_block(counters + c)) return;
  merge_partials<1, St1, A, 1>(one, part, C, c, true, units, per_block, S);
  if (t == 0) {
    A fin[St1::FIELDS];
#pragma unroll
    for (int i = 0; i < St1::FIELDS; ++i) fin[i] = one.f[i][0];
    Kind::finish(fin, c, C, count, momentum, eps, flags, p, vec);
  }
}

// --- elementwise passes -----------------------------------------------------------------------------

// y = act(x * a + b) (forward) or dx = A * dz + B * x + Cc (backward) for VEC values of one row/plane.
template <class T, class A, int VEC, bool BACKWARD>
HAL_DEVICE void apply_at(const T* g, const T* x, T* out, i64 off, const A (&a)[VEC], const A (&b)[VEC],
                         const A (&ga)[VEC], const A (&gb)[VEC], const A (&gc)[VEC], bool relu) {
  A xv[VEC], r[VEC];
  load_pack<T, VEC>(x + off, xv);
  if (BACKWARD) {
    load_pack<T, VEC>(g + off, r);
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      const A dz = relu && !(xv[k] * a[k] + b[k] > A(0)) ? A(0) : r[k];
      r[k] = ga[k] * dz + gb[k] * xv[k] + gc[k];
    }
  } else {
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      const A y = xv[k] * a[k] + b[k];
      r[k] = relu && y < A(0) ? A(0) : y;
    }
  }
  store_pack<T, VEC>(out + off, r);
}

template <class A, int VEC> HAL_DEVICE void load_channel(A (&dst)[VEC], const A* row, int c0, bool same) {
#pragma unroll
  for (int k = 0; k < VEC; ++k) dst[k] = row[same ? c0 : c0 + k];
}

// rows layout: block (bx, tile), rows bx * ROWS_PER_STEP + ty, striding over the grid.
template <class T, class A, int VEC, bool BACKWARD>
HAL_DEVICE void apply_rows(const T* g, const T* x, T* out, const A* vec, i64 units, int C, bool relu) {
  const int t = flat_thread(), tx = t % COLS, ty = t / COLS;
  const int c0 = (int(blockIdx.y) * COLS + tx) * VEC;
  if (c0 >= C) return;
  A a[VEC], b[VEC], ga[VEC], gb[VEC], gc[VEC];
  load_channel<A, VEC>(a, vec, c0, false);
  load_channel<A, VEC>(b, vec + C, c0, false);
  load_channel<A, VEC>(ga, vec + 4 * C, c0, false);
  load_channel<A, VEC>(gb, vec + 5 * C, c0, false);
  load_channel<A, VEC>(gc, vec + 6 * C, c0, false);
  const i64 step = i64(gridDim.x) * ROWS_PER_STEP;
  i64 r = i64(blockIdx.x) * ROWS_PER_STEP + ty;
  for (; r + (UNROLL - 1) * step < units; r += UNROLL * step) {
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) apply_at<T, A, VEC, BACKWARD>(g, x, out, (r + u * step) * C + c0, a, b, ga, gb, gc, relu);
  }
  for (; r < units; r += step) apply_at<T, A, VEC, BACKWARD>(g, x, out, r * C + c0, a, b, ga, gb, gc, relu);
}

// planes layout: block (plane, chunk) covers VEC-vectors [chunk * per_block, ...) of plane n * C + c.
template <class T, class A, int VEC, bool BACKWARD>
HAL_DEVICE void apply_planes(const T* g, const T* x, T* out, const A* vec, int C, i64 S, i64 per_block, bool relu) {
  const i64 plane = blockIdx.x;
  const int c = int(plane % C);
  A a[VEC], b[VEC], ga[VEC], gb[VEC], gc[VEC];
  load_channel<A, VEC>(a, vec, c, true);
  load_channel<A, VEC>(b, vec + C, c, true);
  load_channel<A, VEC>(ga, vec + 4 * C, c, true);
  load_channel<A, VEC>(gb, vec + 5 * C, c, true);
  load_channel<A, VEC>(gc, vec + 6 * C, c, true);
  const i64 sv = S / VEC, v0 = i64(blockIdx.y) * per_block;
  const i64 v1 = v0 + per_block < sv ? v0 + per_block : sv;
  for (i64 v = v0 + flat_thread(); v < v1; v += BN_THREADS)
    apply_at<T, A, VEC, BACKWARD>(g, x, out, plane * S + v * VEC, a, b, ga, gb, gc, relu);
}

// Eval mode: a, b, mean, 1/std from the running statistics (one thread per channel).
template <class A> HAL_DEVICE void eval_params(A* vec, const Params& p, int C, A eps) {
  const int c = int(blockIdx.x) * BN_THREADS + flat_thread();
  if (c >= C) return;
  const A mean = load_code<A>(p.rm, p.code(3), c) - p.get<A>(p.cbias, 2, c, A(0));
  const A invstd = A(1) / sqrt_acc(load_code<A>(p.rv, p.code(4), c) + eps);
  const A a = p.get<A>(p.w, 0, c, A(1)) * invstd;
  vec[c] = a;
  vec[C + c] = p.get<A>(p.b, 1, c, A(0)) - mean * a;
  vec[2 * C + c] = mean;
  vec[3 * C + c] = invstd;
}

}  // namespace hal

// --- entry points -------------------------------------------------------------------------------------
//
// One module per (storage type, vector width): the kit defines HAL_T (hal::f16, hal::bf16, float or
// double) and HAL_VEC. Every pass of a layout takes the same arguments, so the host launches them
// alike; kits/cpp/__init__.py lists the signatures.
#if !defined(HAL_T) || !defined(HAL_VEC)
#error "define HAL_T and HAL_VEC (the kit does)"
#endif

typedef HAL_T T;
typedef hal::Acc<HAL_T>::type A;
constexpr int VEC = HAL_VEC;
using hal::i64;
using Fwd = hal::ForwardKind<T, A>;
using Bwd = hal::BackwardKind<T, A>;

#define HAL_KERNEL extern "C" __global__ void __launch_bounds__(hal::BN_THREADS)
// Reductions run two blocks per multiprocessor (CUDA: registers capped for 2 resident blocks; HIP:
// 2 waves per SIMD, which is 2 blocks of 4 wavefronts per compute unit).
#define HAL_REDUCTION extern "C" __global__ void __launch_bounds__(hal::BN_THREADS, 2)

HAL_REDUCTION bn_stats_rows(const T* x, A* part, unsigned* counters, A* vec, const void* w, const void* b,
                         const void* cb, void* rm, void* rv, int codes, i64 units, int C, i64 S, i64 per_block,
                         double count, double momentum, double eps, int flags) {
  hal::reduce_rows<Fwd, A, VEC>(Fwd{x}, part, counters, vec, hal::Params{w, b, cb, rm, rv, nullptr, nullptr, codes},
                                units, C, per_block, A(count), A(momentum), A(eps), flags, false);
}

HAL_REDUCTION bn_stats_planes(const T* x, A* part, unsigned* counters, A* vec, const void* w, const void* b,
                           const void* cb, void* rm, void* rv, int codes, i64 units, int C, i64 S, i64 per_block,
                           double count, double momentum, double eps, int flags) {
  hal::reduce_planes<Fwd, A, VEC>(Fwd{x}, part, counters, vec, hal::Params{w, b, cb, rm, rv, nullptr, nullptr, codes},
                                  units, C, S, per_block, A(count), A(momentum), A(eps), flags, false);
}

HAL_REDUCTION bn_bwd_stats_rows(const T* g, const T* x, A* part, unsigned* counters, A* vec, const void* w,
                             const void* cb, void* rm, void* rv, void* gw, void* gb, int codes, i64 units, int C,
                             i64 S, i64 per_block, double count, double eps, int flags) {
  hal::reduce_rows<Bwd, A, VEC>(Bwd{g, x}, part, counters, vec, hal::Params{w, nullptr, cb, rm, rv, gw, gb, codes},
                                units, C, per_block, A(count), A(0), A(eps), flags, flags & 1);
}

HAL_REDUCTION bn_bwd_stats_planes(const T* g, const T* x, A* part, unsigned* counters, A* vec, const void* w,
                               const void* cb, void* rm, void* rv, void* gw, void* gb, int codes, i64 units, int C,
                               i64 S, i64 per_block, double count, double eps, int flags) {
  hal::reduce_planes<Bwd, A, VEC>(Bwd{g, x}, part, counters, vec, hal::Params{w, nullptr, cb, rm, rv, gw, gb, codes},
                                  units, C, S, per_block, A(count), A(0), A(eps), flags, flags & 1);
}

HAL_KERNEL bn_apply_rows(const T* g, const T* x, T* out, const A* vec, i64 units, int C, i64 S, i64 per_block, int relu) {
  hal::apply_rows<T, A, VEC, false>(g, x, out, vec, units, C, relu);
}

HAL_KERNEL bn_apply_planes(const T* g, const T* x, T* out, const A* vec, i64 units, int C, i64 S, i64 per_block, int relu) {
  hal::apply_planes<T, A, VEC, false>(g, x, out, vec, C, S, per_block, relu);
}

HAL_KERNEL bn_bwd_apply_rows(const T* g, const T* x, T* out, const A* vec, i64 units, int C, i64 S, i64 per_block,
                             int relu) {
  hal::apply_rows<T, A, VEC, true>(g, x, out, vec, units, C, relu);
}

HAL_KERNEL bn_bwd_apply_planes(const T* g, const T* x, T* out, const A* vec, i64 units, int C, i64 S, i64 per_block,
                               int relu) {
  hal::apply_planes<T, A, VEC, true>(g, x, out, vec, C, S, per_block, relu);
}

HAL_KERNEL bn_eval_params(A* vec, const void* w, const void* b, const void* cb, void* rm, void* rv, int codes, int C,
                          double eps) {
  hal::eval_params<A>(vec, hal::Params{w, b, cb, rm, rv, nullptr, nullptr, codes}, C, A(eps));
}
