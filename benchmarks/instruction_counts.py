"""Machine instructions per shard_map call on the simulated mesh, counted by valgrind.

    python benchmarks/instruction_counts.py [--ranks 1,8] [--calls 100]
                                            [--bodies floor,x2,psum,grad]
                                            [--rng shared]

Timings on a shared 2-core VM move by 2x between runs (the same ``x * 2`` reads 4 or
8 us from one minute to the next), which hides a 10 % change. An instruction count does
not move: each body runs ``--calls`` times under ``valgrind --tool=callgrind`` with
counting switched on only around those calls (``callgrind_control``), and the table
gives the instructions per call. The bodies are ``shard_map_overhead.py``'s on
f32[64, 16]: ``x * 2``, ``psum((x * 2).sum())`` and its gradient, on a greenlets
mesh with one shared generator (``--rng per_rank``: each rank its own, the default of
``Mesh``); ``floor`` is the same ``x * 2`` with none of spmd:
each rank's narrow and multiply on a greenlet of its own, switched to in turn, and
the results concatenated (what any design with a greenlet per rank pays).

Needs valgrind (``apt install valgrind``); each row takes about 30 s (torch's import
under valgrind). Fewer instructions is not always less time (cache misses and
branches are not counted), so a change is also timed with ``shard_map_overhead.py``.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile


def _body(kind: str, n: int, rng: str = "shared"):
    import torch

    import spmd
    from spmd import P

    x = torch.randn(64, 16)
    if kind == "floor":
        from greenlet import getcurrent, greenlet
        main, res, k = getcurrent(), [None] * n, 64 // n

        def work(_):
            job = main.switch(None)
            while True:
                res[job] = x.narrow(0, k * job, k) * 2
                job = main.switch(True)
        workers = [greenlet(work, main) for _ in range(n)]
        for w in workers:
            w.switch(None)

        def floor():
            for r, w in enumerate(workers):
                w.switch(r)
            return torch.cat(res)
        return floor
    mesh = spmd.Mesh((n,), ("sp",), rng=rng, schedule="greenlets")
    if kind == "x2":
        f = spmd.shard_map(lambda x: x * 2, mesh, P("sp"), P("sp"))
        return lambda: f(x)
    s = spmd.shard_map(lambda x: spmd.psum((x * 2).sum(), "sp"), mesh, P("sp"), P())
    if kind == "psum":
        return lambda: s(x)
    xg = x.clone().requires_grad_()
    return lambda: s(xg).backward()


def _child(kind: str, n: int, calls: int, rng: str) -> None:
    """Under valgrind: warm up, then count only the timed calls."""
    fn = _body(kind, n, rng)
    for _ in range(50):
        fn()
    pid = str(os.getpid())
    subprocess.run(["callgrind_control", "-i", "on", pid], capture_output=True, check=True)
    for _ in range(calls):
        fn()
    subprocess.run(["callgrind_control", "-i", "off", pid], capture_output=True, check=True)


def count(kind: str, n: int, calls: int, rng: str = "shared") -> int:
    """Instructions per call of body ``kind`` over ``n`` ranks."""
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "callgrind.out")
        subprocess.run(["valgrind", "--tool=callgrind", "--instr-atstart=no",
                        f"--callgrind-out-file={out}", sys.executable, __file__, "--child",
                        kind, str(n), str(calls), rng], capture_output=True, check=True)
        text = subprocess.run(["callgrind_annotate", out], capture_output=True, text=True,
                              check=True).stdout
    total = re.search(r"([\d,]+)\s+\(100\.0%\)\s+PROGRAM TOTALS", text)
    if total is None:
        raise RuntimeError("callgrind_annotate printed no program total")
    return int(total.group(1).replace(",", "")) // calls


def main() -> None:
    if len(sys.argv) == 6 and sys.argv[1] == "--child":
        _child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
        return
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default="1,8")
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--bodies", default="floor,x2,psum,grad")
    ap.add_argument("--rng", default="shared", choices=("shared", "per_rank"))
    a = ap.parse_args()
    if not all(shutil.which(t) for t in ("valgrind", "callgrind_control",
                                         "callgrind_annotate")):
        print("valgrind (with callgrind_control and callgrind_annotate) is not installed: "
              "nothing to count")
        return
    bodies = a.bodies.split(",")
    print(f"instructions per call (thousands), {a.calls} calls each, rng={a.rng}, Python "
          f"{sys.version.split()[0]}\n")
    print("| ranks | " + " | ".join(bodies) + " |")
    print("| ---: |" + " ---: |" * len(bodies))
    for n in [int(r) for r in a.ranks.split(",")]:
        row = [f"{count(k, n, a.calls, a.rng) / 1e3:,.0f}" for k in bodies]
        print(f"| {n} | " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
