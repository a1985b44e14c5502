"""Dynamo's cost for a graph's inputs: a toy of 10 "layers" (4 small linears and 2 norm weights each, 100
parameters) compiled as the decode segment is (inductor, dynamic, the C++ wrapper), once taking the layers as
modules and once their parameters as one flat tuple; then the same graph through torch.compile and as the
inductor callable alone. Median µs a call over 2000, three rounds. usage: python tools/probes/flat_inputs.py"""
import time, statistics, torch, torch.nn as nn


def main() -> None:
    torch.set_num_threads(2)
    class Lin(nn.Module):
        def __init__(s):
            super().__init__(); s.qweight = nn.Parameter(torch.randn(8, 8), requires_grad=False); s.dm = nn.Parameter(torch.randn(8), requires_grad=False)
        def forward(s, x): return x @ s.qweight + s.dm
    class Layer(nn.Module):
        def __init__(s):
            super().__init__(); s.a = Lin(); s.b = Lin(); s.c = Lin(); s.d = Lin()
            s.n1 = nn.Parameter(torch.ones(8), requires_grad=False); s.n2 = nn.Parameter(torch.ones(8), requires_grad=False)
        def forward(s, x): return s.d(s.c(s.b(s.a(x * s.n1)) * s.n2))
    layers = tuple(Layer() for _ in range(10))
    def f_mod(layers, x):
        for l in layers: x = l(x)
        return x
    def f_flat(ps, x):
        for j in range(10):
            p = ps[j * 10:(j + 1) * 10]
            x = x * p[8]
            for k in range(4):
                if k == 3: pass
                x = x @ p[2 * k] + p[2 * k + 1]
                if k == 1: x = x * p[9]
        return x
    flat = tuple(t for l in layers for t in (l.a.qweight, l.a.dm, l.b.qweight, l.b.dm, l.c.qweight, l.c.dm, l.d.qweight, l.d.dm, l.n1, l.n2))
    opts = {"cpp_wrapper": True}
    cm = torch.compile(f_mod, dynamic=True, options={**opts, "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe})
    cf = torch.compile(f_flat, dynamic=True, options=opts)
    x = torch.randn(3, 8)
    with torch.inference_mode():
        for _ in range(3): cm(layers, x); cf(flat, x)
        print(torch.allclose(cm(layers, x), cf(flat, x)))
        for rnd in range(3):
            for name, fn in (("modules", lambda: cm(layers, x)), ("flat tuple", lambda: cf(flat, x))):
                ts = []
                for _ in range(2000):
                    t = time.perf_counter(); fn(); ts.append(time.perf_counter() - t)
                print(name, "%.1f us" % (statistics.median(ts) * 1e6))
    from torch._inductor.compile_fx import compile_fx
    cap = {}
    def backend(gm, ex):
        fn = compile_fx(gm, ex, config_patches=opts)
        cap["fn"] = fn; cap["n"] = len(ex); cap["ex"] = ex
        return fn
    cb = torch.compile(f_flat, dynamic=True, backend=backend)
    with torch.inference_mode():
        for _ in range(3): cb(flat, x)
        print("inputs", cap["n"], [type(e).__name__ for e in cap["ex"]][:3])
        print([(type(e).__name__, getattr(e, "shape", e)) for e in cap["ex"]][:4]); args = [int(e) if isinstance(e, torch.SymInt) else e for e in cap["ex"]]
        for rnd in range(3):
            for name, fn in (("dynamo+inductor", lambda: cb(flat, x)), ("inductor fn direct", lambda: cap["fn"](*args))):
                ts = []
                for _ in range(2000):
                    t = time.perf_counter(); fn(); ts.append(time.perf_counter() - t)
                print(name, "%.1f us" % (statistics.median(ts) * 1e6))


if __name__ == "__main__":
    main()
