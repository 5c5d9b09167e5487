"""numba kernels of the CPU backend. Importing any module here imports numba: only
``hal_backend_cpu._numba.family`` does, on first use."""
