import torch, torch.nn.functional as F, hal, time
from torch.profiler import profile, ProfilerActivity
dev = torch.device('cuda' if torch.cuda.is_available() else 'cpu')
dt = torch.bfloat16 if dev.type == 'cuda' else torch.float32
cl = torch.channels_last
x = torch.randn(2,16,8,8, device=dev, dtype=dt).to(memory_format=cl).requires_grad_()
w = torch.randn(16,16,3,3, device=dev, dtype=dt).to(memory_format=cl).requires_grad_()
gamma = (torch.rand(16, device=dev, dtype=dt)+.5).requires_grad_(); beta = torch.randn(16, device=dev, dtype=dt, requires_grad=True)
rm, rv = torch.zeros(16, device=dev, dtype=dt), torch.ones(16, device=dev, dtype=dt)
g = torch.randn(2,16,8,8, device=dev, dtype=dt).to(memory_format=cl)
def hal_l(): return hal.ops.fused_conv_bn_relu(x, w, None, gamma, beta, rm, rv, 1, 1, 1, 1, 1e-5, 0.1, True)
def t_l(): return F.relu(F.batch_norm(F.conv2d(x, w, None, 1, 1), rm, rv, gamma, beta, True, 0.1, 1e-5))
for f in (hal_l, t_l):
    o = f(); print(f.__name__, 'out', o.stride(), o.dtype, 'saved:', [ (k, tuple(getattr(o.grad_fn, k).stride()) if isinstance(getattr(o.grad_fn,k), torch.Tensor) else getattr(o.grad_fn,k)) for k in dir(o.grad_fn) if k.startswith('_saved')])
    n = o.grad_fn.next_functions[0][0]
    print('  bn saved', [(k, tuple(getattr(n, k).stride()) if isinstance(getattr(n,k), torch.Tensor) else getattr(n,k)) for k in dir(n) if k.startswith('_saved')])
    c = n.next_functions[0][0]
    print('  conv saved', [(k, tuple(getattr(c, k).stride()) if isinstance(getattr(c,k), torch.Tensor) else getattr(c,k)) for k in dir(c) if k.startswith('_saved')])
for r in range(2):
    for f in (hal_l, t_l):
        outs = [f() for _ in range(200)]
        torch.cuda.synchronize() if dev.type=='cuda' else None
        t0 = time.perf_counter()
        for o in outs: o.backward(g)
        t1 = time.perf_counter()
        print(f.__name__, 'backward host', round((t1-t0)/200*1e6,1), 'us')
for f in (hal_l, t_l):
    outs = [f() for _ in range(50)]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for o in outs: o.backward(g)
    print('==', f.__name__)
    print(prof.key_averages().table(sort_by='self_cpu_time_total', row_limit=14))
