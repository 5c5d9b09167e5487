"""hal_bench: time each op's chosen kernel against eager PyTorch and torch.compile, as ratios.

- ``timing``   device-event timers (CUDA/ROCm) and host timers (CPU), median of many runs
- ``ceilings`` the device's measured copy bandwidth and matrix rate, the 100% marks
- ``cases``    typical inputs per op (large on a GPU, small on the CPU), their bytes and flops, the
               extra peers and the targets of issues 5 and 13
- ``peer``     what a named peer is (a callable, or a reason it cannot run, or a restore per run)
- ``liger``    Liger-Kernel's functions as the "liger" peer of the ops that have them
- ``published`` quack-kernels' published figures, shown beside their rows (not measured here)
- ``runner``   measures the cases and builds the result document
- ``report``   JSON and Markdown renderings
- ``roofline`` the roofline picture (PNG, matplotlib) of a result document

``hal bench`` (hal/cli/bench.py) is the command line.
"""
