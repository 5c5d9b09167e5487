// kits/cpp host emulation: the kernels' CUDA/HIP vocabulary on CPU threads, for the tests.
//
// A launch runs its blocks one after another; the threads of a block are std::threads, so that
// __syncthreads, shared memory and warp shuffles behave as on a GPU (a block's __shared__ arrays are
// function statics: one block runs at a time). Warps are groups of HAL_WARP_SIZE consecutive threads;
// a shuffle is a store, a barrier of the warp, a load and a second barrier. A thread that returns
// leaves its barriers, as an exited GPU thread stops counting. Slow by design: it proves numerics and
// indexing on small inputs (wave64 included), never speed.
#pragma once

#include <atomic>
#include <barrier>
#include <cmath>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

struct dim3 {
  unsigned x, y, z;
};

namespace hal {
namespace host {

inline thread_local dim3 thread_idx{0, 0, 0};
inline thread_local dim3 block_idx{0, 0, 0};
inline thread_local int flat_tid = 0;
inline dim3 block_dim{1, 1, 1};
inline dim3 grid_dim{1, 1, 1};
inline std::barrier<>* block_barrier = nullptr;
inline std::vector<std::unique_ptr<std::barrier<>>> warp_barriers;
alignas(16) inline unsigned char exchange[1024 * 8];

template <class To, class From> inline To bit_cast(From v) {
  static_assert(sizeof(To) == sizeof(From), "bit_cast sizes differ");
  To out;
  std::memcpy(&out, &v, sizeof(To));
  return out;
}

template <class A> inline A load_acquire(const A* p) {
  A out;
  __atomic_load(p, &out, __ATOMIC_ACQUIRE);
  return out;
}

template <class A> inline A shfl_xor(A v, int mask) {
  static_assert(sizeof(A) <= 8, "shuffles move at most 8 bytes");
  const int t = flat_tid, w = t / HAL_WARP_SIZE, lane = t % HAL_WARP_SIZE;
  A* slots = reinterpret_cast<A*>(exchange);
  slots[t] = v;
  warp_barriers[w]->arrive_and_wait();
  A out = slots[w * HAL_WARP_SIZE + (lane ^ mask)];
  warp_barriers[w]->arrive_and_wait();
  return out;
}

// Run body() as every thread of every block of a (grid, block) launch.
template <class F> void run(dim3 grid, dim3 block, F body) {
  const unsigned n = block.x * block.y * block.z;
  if (n == 0 || n > 1024 || n % HAL_WARP_SIZE) throw std::runtime_error("hal_host: blocks must hold 1-1024 threads, whole warps");
  block_dim = block;
  grid_dim = grid;
  for (unsigned bz = 0; bz < grid.z; ++bz)
    for (unsigned by = 0; by < grid.y; ++by)
      for (unsigned bx = 0; bx < grid.x; ++bx) {
        std::barrier<> bar(n);
        block_barrier = &bar;
        warp_barriers.clear();
        for (unsigned w = 0; w < n / HAL_WARP_SIZE; ++w) warp_barriers.emplace_back(new std::barrier<>(HAL_WARP_SIZE));
        std::vector<std::thread> threads;
        threads.reserve(n);
        for (unsigned t = 0; t < n; ++t)
          threads.emplace_back([&, t] {
            thread_idx = dim3{t % block.x, (t / block.x) % block.y, t / (block.x * block.y)};
            block_idx = dim3{bx, by, bz};
            flat_tid = int(t);
            body();
            warp_barriers[t / HAL_WARP_SIZE]->arrive_and_drop();
            bar.arrive_and_drop();
          });
        for (auto& th : threads) th.join();
      }
}

}  // namespace host
}  // namespace hal

#define threadIdx (hal::host::thread_idx)
#define blockIdx (hal::host::block_idx)
#define blockDim (hal::host::block_dim)
#define gridDim (hal::host::grid_dim)
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
#define __restrict__ __restrict

inline void __syncthreads() { hal::host::block_barrier->arrive_and_wait(); }
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline unsigned atomicAdd(unsigned* p, unsigned v) { return __atomic_fetch_add(p, v, __ATOMIC_ACQ_REL); }
inline float rsqrtf(float v) { return 1.0f / std::sqrt(v); }
using std::sqrt;
