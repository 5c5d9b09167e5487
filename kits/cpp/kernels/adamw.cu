// Multi-tensor AdamW: one launch steps a whole list of tensors (hal.ops.fused_adamw_).
//
// The host uploads, once per list (cached by the tensors' addresses), a table with one row per
// tensor (param, grad, exp_avg, exp_avg_sq and master addresses, numel, first chunk) and a chunk map
// (the row of every chunk of CHUNK elements). Block b looks its row up in two dependent loads and
// streams its chunk: each thread moves E = 8 values of every stream per step as 16-byte accesses
// (bf16/fp16 grads and params: one access; fp32 grads, moments and masters: two). A list whose
// addresses are not all 16-byte aligned takes the scalar path; the last partial vector of a tensor
// always does. Grads have the params' type, or float beside masters (float32 weights' gradients,
// the params being their half-precision copies: written in the same pass).
//
// Nothing is read back by the host: inv_scale, found_inf and the step count may be device values
// (float32; a captured optimizer's step count lives on the device, and each block then derives the
// bias corrections from it in double precision). A non-zero found_inf returns before any write (the
// step is skipped); grads are never written.
#include "hal_cpp.cuh"

#if !defined(HAL_P) || !defined(HAL_G) || !defined(HAL_S)
#error "define HAL_P (param storage type), HAL_G (grad storage type) and HAL_S (moment storage type); the kit does"
#endif

namespace hal {

constexpr int ADAMW_THREADS = 256;
constexpr int E = 8;            // values of each stream per thread and step
constexpr int TABLE_FIELDS = 8;  // param, grad, exp_avg, exp_avg_sq, master, numel, first chunk, unused

template <class A> struct AdamW {
  A inv, decay, step_size, bc2_sqrt, beta1, beta2, eps;
  // One step of one value: p (the master where there is one), moments m and v, raw grad g. The
  // first moment moves as torch.optim.AdamW's exp_avg.lerp_(grad, w), w = 1 - beta1, in
  // at::native::lerp's two forms (m + w * (g - m) for w < 0.5, else g - (g - m) * (1 - w)): the
  // number of beta1 * m + w * g up to rounding, but NaN where torch has NaN (an infinite m meeting
  // a finite or same-signed infinite g for w < 0.5, an infinite g meeting a finite m otherwise),
  // where the sum kept infinities. tests/cuda/_adamw_specials.py lists the cases.
  HAL_DEVICE void step(A& p, A& m, A& v, A g) const {
    g *= inv;
    p *= decay;
    const A w = A(1) - beta1, d = g - m;
    m = w < A(0.5) ? m + w * d : g - d * (A(1) - w);
    v = beta2 * v + (A(1) - beta2) * g * g;
    p -= step_size * m / (sqrt_acc(v) / bc2_sqrt + eps);
  }
};

template <class P, class G, class S, class A>
HAL_DEVICE void adamw_chunk(const i64* table, const int* chunk_map, i64 chunk, const float* found,
                            const float* inv_ptr, const float* step_ptr, double inv_val, double lr, double decay,
                            double step_size, double bc2_sqrt, double beta1, double beta2, double eps, int flags) {
  if (found != nullptr && *found != 0.0f) return;
  if (step_ptr != nullptr) {  // lr / (1 - beta1^t) and sqrt(1 - beta2^t) from the device's step count
    const double t = double(*step_ptr);
    step_size = lr / (1.0 - pow(beta1, t));
    bc2_sqrt = sqrt(1.0 - pow(beta2, t));
  }
  const i64* row = table + i64(chunk_map[blockIdx.x]) * TABLE_FIELDS;
  P* __restrict__ p = reinterpret_cast<P*>(row[0]);
  const G* __restrict__ g = reinterpret_cast<const G*>(row[1]);
  S* __restrict__ m = reinterpret_cast<S*>(row[2]);
  S* __restrict__ v = reinterpret_cast<S*>(row[3]);
  float* __restrict__ w = reinterpret_cast<float*>(row[4]);
  const i64 numel = row[5];
  const i64 start = (i64(blockIdx.x) - row[6]) * chunk;
  const i64 end = start + chunk < numel ? start + chunk : numel;
  const bool master = flags & 1, aligned = flags & 2;
  const AdamW<A> op{inv_ptr != nullptr ? A(*inv_ptr) : A(inv_val), A(decay), A(step_size), A(bc2_sqrt),
                    A(beta1), A(beta2), A(eps)};
  for (i64 e = start + i64(flat_thread()) * E; e < end; e += i64(ADAMW_THREADS) * E) {
    if (aligned && e + E <= end) {
      A pv[E], gv[E], mv[E], vv[E];
      load_pack<G, E>(g + e, gv);
      load_pack<S, E>(m + e, mv);
      load_pack<S, E>(v + e, vv);
      if (master) load_pack<float, E>(w + e, pv);
      else load_pack<P, E>(p + e, pv);
#pragma unroll
      for (int j = 0; j < E; ++j) op.step(pv[j], mv[j], vv[j], gv[j]);
      store_pack<S, E>(m + e, mv);
      store_pack<S, E>(v + e, vv);
      if (master) store_pack<float, E>(w + e, pv);
      store_pack<P, E>(p + e, pv);
    } else {
      const i64 stop = e + E < end ? e + E : end;
      for (i64 i = e; i < stop; ++i) {
        A pv = master ? A(w[i]) : to_acc<A>(p[i]), mv = to_acc<A>(m[i]), vv = to_acc<A>(v[i]);
        op.step(pv, mv, vv, to_acc<A>(g[i]));
        m[i] = from_acc<S>(mv);
        v[i] = from_acc<S>(vv);
        if (master) w[i] = float(pv);
        p[i] = from_acc<P>(pv);
      }
    }
  }
}

}  // namespace hal

typedef HAL_P P;
typedef HAL_G G;
typedef HAL_S S;
typedef hal::Acc<HAL_P>::type A;

// flags: bit 0 master weights (float32) are updated and rounded into the params, bit 1 every
// address of the list is 16-byte aligned.
extern "C" __global__ void __launch_bounds__(hal::ADAMW_THREADS)
adamw_step(const hal::i64* table, const int* chunk_map, hal::i64 chunk, const float* found, const float* inv_ptr,
           const float* step_ptr, double inv_val, double lr, double decay, double step_size, double bc2_sqrt, double beta1,
           double beta2, double eps, int flags) {
  hal::adamw_chunk<P, G, S, A>(table, chunk_map, chunk, found, inv_ptr, step_ptr, inv_val, lr, decay, step_size, bc2_sqrt,
                               beta1, beta2, eps, flags);
}
