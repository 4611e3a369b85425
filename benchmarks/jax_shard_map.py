"""JAX's jit-compiled shard_map on fake CPU devices, for ``shard_map_overhead.py``'s bodies.

    python benchmarks/jax_shard_map.py [--devices 4,8] [--calls 2000] [--repeats 7]

JAX is not a dependency of spmd: install it in a venv of its own
(``python -m venv /tmp/jax && /tmp/jax/bin/pip install "jax[cpu]"``) and run this
script with that venv's python. The same bodies on f32[64, 16] split over the devices:
``x * 2``; ``psum((x * 2).sum())``; the gradient of the latter (``jax.grad`` of the
jitted function, jitted). Each is compiled once, then called ``--calls`` times, each call
waited for (``block_until_ready``), as an eager torch call returns a finished result;
the median over ``--repeats`` of the mean time per call, microseconds. Each device count
runs in a process of its own (``XLA_FLAGS=--xla_force_host_platform_device_count``
must be set before JAX starts).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import statistics
import subprocess
import sys
import time


def _child(n: int, calls: int, repeats: int) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P
    try:
        from jax import shard_map
    except ImportError:  # JAX before 0.7
        from jax.experimental.shard_map import shard_map

    mesh = Mesh(np.array(jax.devices()[:n]), ("sp",))
    x = jax.device_put(jnp.asarray(np.random.randn(64, 16).astype(np.float32)),
                       NamedSharding(mesh, P("sp")))
    x2 = jax.jit(shard_map(lambda s: s * 2, mesh=mesh, in_specs=P("sp"), out_specs=P("sp")))
    red = jax.jit(shard_map(lambda s: jax.lax.psum((s * 2).sum(), "sp"), mesh=mesh,
                            in_specs=P("sp"), out_specs=P()))
    grad = jax.jit(jax.grad(red))

    def per_call(f) -> float:
        for _ in range(max(50, calls // 10)):
            jax.block_until_ready(f(x))
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(calls):
                jax.block_until_ready(f(x))
            times.append((time.perf_counter() - t0) / calls)
        return statistics.median(times) * 1e6

    cols = " | ".join(f"{per_call(f):.1f}" for f in (x2, red, grad))
    print(f"| {n} | jax {jax.__version__} jit | {cols} |")


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "--child":
        _child(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
        return
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", default="4,8")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=7)
    a = ap.parse_args()
    if importlib.util.find_spec("jax") is None:
        print("JAX is not installed in this python: see the docstring (a venv of its own)")
        return
    print(f"{os.cpu_count()} cores, Python {platform.python_version()}, load average "
          f"{os.getloadavg()[0]:.2f}\n")
    print("| devices | program | x * 2 (us) | psum (us) | grad psum (us) |")
    print("| ---: | --- | ---: | ---: | ---: |")
    for n in [int(d) for d in a.devices.split(",")]:
        env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={n}",
                   JAX_PLATFORMS="cpu")
        subprocess.run([sys.executable, __file__, "--child", str(n), str(a.calls),
                        str(a.repeats)], env=env, check=True)


if __name__ == "__main__":
    main()
