// kits/cpp portability header: the common subset of CUDA and HIP C++ that hal's kernels use.
//
// One source compiles with NVRTC (CUDA), hiprtc or hipcc (HIP) and, for the tests, with a host C++
// compiler against hal_host.h (every block's threads as CPU threads). The kit inlines this file into
// each kernel source, so no include path and no vendor header is needed at run time: half-precision
// storage types and their conversions are defined here.
//
// What a kernel may use: WARP_SIZE (32 on NVIDIA, 64 on AMD CDNA; the runtime defines HAL_WARP_SIZE
// from the device), hal::warp_xor (butterfly shuffle over a full warp), hal::load_cg (a load that
// sees other blocks' writes after their fence), hal::Pack (16-byte vector access) and the dtype
// helpers hal::to_acc / hal::from_acc.
#pragma once

#if defined(__HIPCC_RTC__) || defined(__HIP__) || defined(__HIPCC__)
#define HAL_HIP 1
#if !defined(__HIPCC_RTC__)
#include <hip/hip_runtime.h>
#endif
#elif defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define HAL_CUDA 1
#else
#define HAL_HOST 1
#include "hal_host.h"
#endif

#ifndef HAL_WARP_SIZE
#if defined(HAL_CUDA)
#define HAL_WARP_SIZE 32
#elif defined(__AMDGCN_WAVEFRONT_SIZE)
#define HAL_WARP_SIZE __AMDGCN_WAVEFRONT_SIZE
#else
#error "HAL_WARP_SIZE must be defined (the runtime passes the device's warp or wavefront size)"
#endif
#endif

#define HAL_DEVICE __device__ __forceinline__

namespace hal {

enum : int { WARP_SIZE = HAL_WARP_SIZE };

typedef unsigned int u32;
typedef unsigned short u16;
typedef long long i64;
typedef unsigned long long u64;

// --- storage types ------------------------------------------------------------------------------

struct bf16 { u16 bits; };
struct f16 { u16 bits; };

HAL_DEVICE float bits_to_float(u32 u) {
#if defined(HAL_HOST)
  return host::bit_cast<float>(u);
#else
  return __uint_as_float(u);
#endif
}

HAL_DEVICE u32 float_to_bits(float f) {
#if defined(HAL_HOST)
  return host::bit_cast<u32>(f);
#else
  return __float_as_uint(f);
#endif
}

HAL_DEVICE float bf16_to_float(bf16 v) { return bits_to_float(u32(v.bits) << 16); }

// Round to nearest even; NaN stays a (quiet) NaN of the same sign.
HAL_DEVICE bf16 float_to_bf16(float f) {
  u32 u = float_to_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16{u16((u >> 16) | 0x40u)};
  u += 0x7fffu + ((u >> 16) & 1u);
  return bf16{u16(u >> 16)};
}

HAL_DEVICE float f16_to_float(f16 v) {
#if defined(HAL_CUDA)
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v.bits));
  return f;
#else
  return float(__builtin_bit_cast(_Float16, v.bits));
#endif
}

HAL_DEVICE f16 float_to_f16(float f) {
#if defined(HAL_CUDA)
  u16 h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return f16{h};
#else
  return f16{__builtin_bit_cast(u16, _Float16(f))};
#endif
}

// to_acc<A>(v): a stored value in the accumulation type A; from_acc<T>(a): A rounded to storage T.
template <class A> HAL_DEVICE A to_acc(bf16 v) { return A(bf16_to_float(v)); }
template <class A> HAL_DEVICE A to_acc(f16 v) { return A(f16_to_float(v)); }
template <class A> HAL_DEVICE A to_acc(float v) { return A(v); }
template <class A> HAL_DEVICE A to_acc(double v) { return A(v); }

template <class T> struct Store;
template <> struct Store<bf16> { template <class A> static HAL_DEVICE bf16 from(A a) { return float_to_bf16(float(a)); } };
template <> struct Store<f16> { template <class A> static HAL_DEVICE f16 from(A a) { return float_to_f16(float(a)); } };
template <> struct Store<float> { template <class A> static HAL_DEVICE float from(A a) { return float(a); } };
template <> struct Store<double> { template <class A> static HAL_DEVICE double from(A a) { return double(a); } };
template <class T, class A> HAL_DEVICE T from_acc(A a) { return Store<T>::from(a); }

// The accumulation type of a storage type: float, or double for double data.
template <class T> struct Acc { typedef float type; };
template <> struct Acc<double> { typedef double type; };

// Runtime dtype codes of per-channel parameters (they may be x's dtype or float32 beside half x);
// the host passes hal_cpp.DTYPE_CODES.
enum DType { DT_F16 = 0, DT_BF16 = 1, DT_F32 = 2, DT_F64 = 3 };

template <class A> HAL_DEVICE A load_code(const void* p, int code, i64 i) {
  switch (code) {
    case DT_F16: return to_acc<A>(static_cast<const f16*>(p)[i]);
    case DT_BF16: return to_acc<A>(static_cast<const bf16*>(p)[i]);
    case DT_F32: return A(static_cast<const float*>(p)[i]);
    default: return A(static_cast<const double*>(p)[i]);
  }
}

template <class A> HAL_DEVICE void store_code(void* p, int code, i64 i, A v) {
  switch (code) {
    case DT_F16: static_cast<f16*>(p)[i] = float_to_f16(float(v)); break;
    case DT_BF16: static_cast<bf16*>(p)[i] = float_to_bf16(float(v)); break;
    case DT_F32: static_cast<float*>(p)[i] = float(v); break;
    default: static_cast<double*>(p)[i] = double(v); break;
  }
}

HAL_DEVICE float sqrt_acc(float v) { return sqrtf(v); }
HAL_DEVICE double sqrt_acc(double v) { return sqrt(v); }

// --- vector access --------------------------------------------------------------------------------

// N values of T moved as one access of N * sizeof(T) bytes (16 bytes for the vector paths).
template <class T, int N> struct alignas(sizeof(T) * N) Pack { T v[N]; };

// N values of T from p into acc (p aligned to the pack), as 16-byte accesses where N * sizeof(T) >= 16.
template <class T, int N, class A> HAL_DEVICE void load_pack(const T* p, A (&acc)[N]) {
  constexpr int PER = (N * int(sizeof(T)) > 16) ? 16 / int(sizeof(T)) : N;
#pragma unroll
  for (int k = 0; k < N / PER; ++k) {
    Pack<T, PER> pk = *reinterpret_cast<const Pack<T, PER>*>(p + k * PER);
#pragma unroll
    for (int j = 0; j < PER; ++j) acc[k * PER + j] = to_acc<A>(pk.v[j]);
  }
}

template <class T, int N, class A> HAL_DEVICE void store_pack(T* p, const A (&acc)[N]) {
  constexpr int PER = (N * int(sizeof(T)) > 16) ? 16 / int(sizeof(T)) : N;
#pragma unroll
  for (int k = 0; k < N / PER; ++k) {
    Pack<T, PER> pk;
#pragma unroll
    for (int j = 0; j < PER; ++j) pk.v[j] = from_acc<T>(acc[k * PER + j]);
    *reinterpret_cast<Pack<T, PER>*>(p + k * PER) = pk;
  }
}

// A load of a value another block wrote before its __threadfence (skips the incoherent L1).
template <class A> HAL_DEVICE A load_cg(const A* p) {
#if defined(HAL_CUDA)
  return __ldcg(p);
#elif defined(HAL_HIP)
  return *static_cast<const volatile A*>(p);
#else
  return host::load_acquire(p);
#endif
}

// --- warps ------------------------------------------------------------------------------------------

// Butterfly exchange over a full warp: lane l receives lane l ^ mask's v.
template <class A> HAL_DEVICE A warp_xor(A v, int mask) {
#if defined(HAL_CUDA)
  return __shfl_xor_sync(0xffffffffu, v, mask, WARP_SIZE);
#elif defined(HAL_HIP)
  return __shfl_xor(v, mask, WARP_SIZE);
#else
  return host::shfl_xor(v, mask);
#endif
}

HAL_DEVICE int flat_thread() { return int(threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z)); }

}  // namespace hal
