"""hal.bench: time each op's chosen kernel against eager PyTorch and torch.compile, as ratios.

- ``timing``   device-event timers (CUDA/ROCm) and host timers (CPU), median of many runs
- ``ceilings`` the device's measured copy bandwidth and matrix rate, the 100% marks
- ``cases``    typical inputs per op (large on a GPU, small on the CPU), their bytes and flops, the
               extra peers and the targets of issue 5
- ``runner``   measures the cases and builds the result document
- ``report``   JSON and Markdown renderings

``hal bench`` (hal/cli/bench.py) is the command line.
"""
