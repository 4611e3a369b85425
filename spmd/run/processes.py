"""Processes for ``spmd.launch(..., backend="gloo")`` and a persistent pool for tests.

The parent hosts a ``TCPStore`` on 127.0.0.1 (port 0: the OS picks a free port, no race)
and starts one "spawn" process per rank; each joins a gloo process group through the
store and then runs tasks sent over its pipe: ``fn(mesh, *args)`` inside ``with mesh:``.
Results and errors come back pickled by the child (so an unpicklable one is reported,
not lost). The parent re-raises the first error (earliest received) tagged with its rank,
gives the other ranks a short grace, then ends every process: a gloo process group is
unusable after a failure, so the pool starts fresh on the next run.
"""
from __future__ import annotations

import datetime
import math
import multiprocessing as mp
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.connection import wait as _mp_wait
from typing import Any

from ..core.errors import CommAborted, CommTimeout, SpecError, check_timeout, tag_rank

__all__ = ["ProcessPool", "launch_processes", "exit_error"]

_GRACE = 2.0  # seconds other ranks get to report after the first error
_POLL = 0.25  # seconds between looks for stopped workers while a run waits
_SLACK = 5.0  # seconds on top of ``timeout`` for a whole run


def launch_processes(fn: Callable[..., Any], mesh_shape: Sequence[int] | int,
                     axis_names: Sequence[str] | str, *, args: tuple = (),
                     timeout: float = 120.0) -> list[Any]:
    """Run ``fn(mesh, *args)`` in one fresh gloo process per rank; results in rank order.

    ``fn``, ``args`` and the results must be picklable (``fn`` a module-level function).
    Raises the first exception of any rank with ``"rank R: "`` in front of its message;
    no process is left running on any path.
    """
    shape = (mesh_shape,) if isinstance(mesh_shape, int) else tuple(mesh_shape)
    with ProcessPool(math.prod(shape), timeout=timeout) as pool:
        return pool.run(fn, shape, axis_names, args=args)


_ABORT_HINT = (
    "; gloo aborts a process when the ranks call a collective with different element "
    "counts (its stderr says 'Received data size doesn't match'): SPMD_VALIDATE=1 compares "
    "them first and raises a CommError naming the ranks instead")


class ProcessPool:
    """``world`` gloo processes, started once, running one task after another.

    Args:
        world: number of processes (ranks).
        timeout: seconds for each collective wait (the meshes' timeout and the process
            group's) and, plus ``slack``, for a whole run.
        slack: extra seconds a run may take beyond ``timeout`` before the pool gives up.
        start_timeout: seconds to start the processes and join the process group.

    Example:
        >>> with ProcessPool(2, timeout=30) as pool:      # doctest: +SKIP
        ...     pool.run(my_module.body, (2,), ("sp",))
        [0.0, 1.0]

    A task that fails or times out ends every process (a gloo process group cannot be
    used after a timeout); the next ``run`` starts fresh ones. Workers exit if the parent
    dies. Each worker keeps one ``Mesh`` per (shape, axis names, timeout).
    """

    def __init__(self, world: int, *, timeout: float = 120.0, slack: float = _SLACK,
                 start_timeout: float = 120.0):
        if not isinstance(world, int) or world < 1:
            raise SpecError(f"ProcessPool: world must be a positive int, got {world!r}")
        self.world = world
        self.timeout = check_timeout(timeout, "ProcessPool")
        self.slack = check_timeout(slack, "ProcessPool: slack")
        self.start_timeout = check_timeout(start_timeout, "ProcessPool: start_timeout")
        self._procs: list = []
        self._conns: list = []
        self._store = None
        self._tid = 0
        self._lock = threading.Lock()

    # -- lifecycle -------------------------------------------------------------------

    def __enter__(self) -> ProcessPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    @property
    def started(self) -> bool:
        return bool(self._procs)

    def close(self) -> None:
        """End every worker process (the pool can still be used: it restarts lazily)."""
        procs, conns = self._procs, self._conns
        self._procs, self._conns = [], []
        for c in conns:
            try:
                c.send_bytes(pickle.dumps(None))
            except Exception:  # noqa: BLE001 - worker already gone
                pass
        deadline = time.monotonic() + 2.0
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        _end(procs)
        for c in conns:
            c.close()
        self._store = None

    def _terminate(self) -> None:
        """End every worker now (after a failure: they may be stuck in a collective)."""
        procs, conns = self._procs, self._conns
        self._procs, self._conns = [], []
        _end(procs)
        for c in conns:
            c.close()
        self._store = None

    def _start(self) -> None:
        import torch.distributed as dist
        _check_main_guard()
        ctx = mp.get_context("spawn")
        self._store = dist.TCPStore("127.0.0.1", 0, self.world + 1, is_master=True,
                                    wait_for_workers=False,
                                    timeout=datetime.timedelta(seconds=self.start_timeout))
        port = self._store.port
        try:
            for rank in range(self.world):
                parent, child = ctx.Pipe()
                p = ctx.Process(target=_worker, name=f"spmd-rank-{rank}", daemon=True,
                                args=(rank, self.world, port, self.timeout, child, os.getpid()))
                p.start()
                child.close()
                self._procs.append(p)
                self._conns.append(parent)
            # Wait until every rank has joined the process group.
            _, errors = self._collect(0, time.monotonic() + self.start_timeout, "start")
        except BaseException:
            self._terminate()
            raise
        if errors:
            self._terminate()
            _raise_first(errors)

    # -- running -------------------------------------------------------------------------

    def run(self, fn: Callable[..., Any], mesh_shape: Sequence[int] | int,
            axis_names: Sequence[str] | str, *, args: tuple = (),
            timeout: float | None = None) -> list[Any]:
        """Run ``fn(mesh, *args)`` on every worker; return the results in rank order.

        ``timeout`` (default: the pool's) bounds each collective wait of the mesh; the
        whole run may take ``timeout + slack``. Raises the first exception of any rank
        (``"rank R: ..."``); ``CommTimeout`` naming the ranks that did not finish.
        """
        shape = (mesh_shape,) if isinstance(mesh_shape, int) else tuple(mesh_shape)
        names = (axis_names,) if isinstance(axis_names, str) else tuple(axis_names)
        if math.prod(shape) != self.world:
            raise SpecError(f"mesh shape {shape} has {math.prod(shape)} ranks but the pool has "
                            f"{self.world} processes")
        timeout = self.timeout if timeout is None else check_timeout(timeout, "ProcessPool.run")
        try:
            payload = pickle.dumps((fn, tuple(args)), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:
            raise TypeError(f"spmd.launch(backend='gloo'): fn and args must be picklable (fn a "
                            f"module-level function), got fn={fn!r}: {e}") from e
        main = sys.modules.get("__main__")
        main_file = getattr(main, "__file__", None)
        if getattr(fn, "__module__", None) == "__main__" and not (
                main_file and os.path.isfile(main_file)):
            # A spawned process re-imports __main__ to find fn: stdin, a REPL or a notebook
            # cell has no file to import, and the child would die before reporting.
            raise TypeError(
                f"spmd.launch(backend='gloo'): {getattr(fn, '__qualname__', fn)!r} is defined in "
                f"an interactive __main__ (REPL, stdin or notebook) that new processes cannot "
                f"import; define it in a .py module and import it, or use backend='threads'")
        if not self._lock.acquire(blocking=False):
            raise SpecError("ProcessPool.run: the pool is already running a task")
        ok = False
        try:
            if not self._procs or not all(p.is_alive() for p in self._procs):
                self.close()
                self._start()
            self._tid += 1
            task = pickle.dumps((self._tid, shape, names, timeout, payload),
                                protocol=pickle.HIGHEST_PROTOCOL)
            for c in self._conns:
                c.send_bytes(task)
            results, errors = self._collect(self._tid, time.monotonic() + timeout + self.slack,
                                            "run", timeout=timeout)
            if errors:
                self._terminate()
                _raise_first(errors)
            ok = True
            return results
        finally:
            if not ok:  # failure, timeout, KeyboardInterrupt: no process outlives it
                self._terminate()
            self._lock.release()

    def _collect(self, tid: int, deadline: float, what: str, timeout: float | None = None):
        """Wait for one message per rank: ``(results, errors)``, errors as
        ``[(rank, msg), ...]``, the first one received first."""
        n = self.world
        results: list[Any] = [None] * n
        done: set[int] = set()
        errors: list[tuple[int, tuple]] = []
        conn_rank = {c: r for r, c in enumerate(self._conns)}
        sent_rank = {p.sentinel: r for r, p in enumerate(self._procs)}
        stopped: dict[int, float] = {}  # rank -> when it was first seen stopped
        while len(done) < n:
            now = time.monotonic()
            if errors:
                deadline = min(deadline, errors[0][2] + _GRACE)
            if timeout is not None and self._stopped_too_long(done, stopped, now, timeout):
                r = next(r for r, t in stopped.items() if now - t >= timeout)
                done.add(r)
                errors.append((r, ("died", tid, None, f"process stopped (state T: SIGSTOP, job "
                                   f"control or a debugger) for {timeout:g} s; the other ranks' "
                                   f"collectives cannot complete without it", ""), now))
                deadline = now  # the cause: the others' timeouts are its symptoms
            if now >= deadline:
                break
            wait_s = deadline - now if timeout is None else min(deadline - now, _POLL)
            ready = _mp_wait(list(conn_rank) + list(sent_rank), timeout=wait_s)
            for obj in ready:
                if obj in conn_rank:
                    r = conn_rank[obj]
                    try:
                        msg = pickle.loads(obj.recv_bytes())
                    except (EOFError, OSError):
                        del conn_rank[obj]  # the sentinel will tell how it ended
                        continue
                    except Exception as e:  # noqa: BLE001 - a result that does not unpickle
                        msg = ("err", tid, None, f"could not unpickle its result: {e!r}", "")
                    if msg[1] != tid and msg[1] != -1:
                        continue  # stale
                    if r in done:
                        continue
                    done.add(r)
                    if msg[0] == "ok":
                        results[r] = msg[2]
                    elif msg[0] == "err":
                        errors.append((r, msg, time.monotonic()))
                else:
                    r = sent_rank.pop(obj)
                    if r in done:
                        continue
                    # Read whatever the pipe still holds before declaring it dead.
                    c = self._conns[r]
                    if c in conn_rank and c.poll():
                        sent_rank[obj] = r
                        continue
                    done.add(r)
                    self._procs[r].join(1.0)  # reap it, so its exit code is known
                    code = self._procs[r].exitcode
                    how, hint = f"exit code {code}", ""
                    if code is not None and code < 0:
                        try:
                            how = f"signal {signal.Signals(-code).name}"
                        except ValueError:
                            pass
                    if code == -signal.SIGABRT:
                        # gloo's usual abort: its message is on the process's stderr.
                        hint = _ABORT_HINT
                    errors.append((r, ("died", tid, None,
                                       f"process exited ({how}) without reporting{hint}", ""),
                                   time.monotonic()))
        if errors:
            return results, [(r, m) for r, m, _ in errors]
        if len(done) < n:
            missing = [r for r in range(n) if r not in done]
            if what == "start":
                raise CommTimeout(f"ProcessPool: ranks {missing} did not start and join the "
                                  f"process group within {self.start_timeout:g} s",
                                  op="launch", missing=tuple(missing))
            raise CommTimeout(f"spmd.launch: ranks {missing} of {n} did not finish within "
                              f"{timeout:g} s (+{self.slack:g} s slack)", op="launch",
                              missing=tuple(missing))
        return results, []


    def _stopped_too_long(self, done: set[int], stopped: dict[int, float], now: float,
                          timeout: float) -> bool:
        """Update ``stopped`` (ranks whose process is stopped, since when); whether one
        has been stopped for ``timeout``: its peers' collectives then time out, each
        naming it, a second or more later (their post-mortem), so the pool names it first."""
        for r, p in enumerate(self._procs):
            if r in done or not _is_stopped(p.pid):
                stopped.pop(r, None)
            else:
                stopped.setdefault(r, now)
        return any(now - t >= timeout for t in stopped.values())


def _is_stopped(pid: int | None) -> bool:
    """Whether process ``pid`` is stopped by a signal (Linux's /proc; elsewhere: False)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2:][:1] == "T"


def _check_main_guard() -> None:
    """Refuse to start processes from a script's top level outside
    ``if __name__ == "__main__":``: "spawn" runs the script again in every child, which
    would start processes again (multiprocessing then fails in every child with two
    tracebacks that do not say why)."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if not path or not path.endswith(".py") or not os.path.exists(path):
        return  # python -c, a notebook, an interactive session: nothing is re-run
    frame = sys._getframe(1)
    while frame is not None and not (frame.f_globals.get("__name__") == "__main__" and
                                     frame.f_code.co_name == "<module>"):
        frame = frame.f_back
    if frame is None:
        return
    import ast
    try:
        tree = ast.parse(open(path).read(), path)
    except (OSError, SyntaxError):
        return
    line = frame.f_lineno
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_main_test(node.test) and \
                node.lineno <= line <= (node.end_lineno or node.lineno):
            return
    raise RuntimeError(
        f"spmd starts gloo processes with multiprocessing's 'spawn', which runs "
        f"{os.path.basename(path)} again in every process; line {line} would then start "
        f"processes again. Put the code that runs at the top of the script under\n\n"
        f"    if __name__ == \"__main__\":\n        ...\n")


def _is_main_test(test: object) -> bool:
    """``__name__ == "__main__"``, alone or as a conjunct of ``and`` (at any depth): the
    block then never runs in a spawned child, whose ``__name__`` is ``"__mp_main__"``."""
    import ast
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
        return any(_is_main_test(v) for v in test.values)
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and
            isinstance(test.ops[0], ast.Eq)):
        return False
    sides = [test.left, test.comparators[0]]
    names = [s.id for s in sides if isinstance(s, ast.Name)]
    consts = [s.value for s in sides if isinstance(s, ast.Constant)]
    return names == ["__name__"] and consts == ["__main__"]


def exit_error(exc: SystemExit) -> RuntimeError:
    """What a rank's ``sys.exit`` becomes for the caller: an error (re-raised as it is, a
    ``SystemExit`` would end the caller's program, with code 0 for ``sys.exit(0)``, and
    lose every rank's result without a word)."""
    return RuntimeError(f"fn called sys.exit({exc.code!r}) (SystemExit); the run has no result "
                        f"from that rank: return from fn instead (or raise an exception)")


def _raise_first(errors: list[tuple[int, tuple]]):
    excs = [_load(msg[2]) for _, msg in errors]
    # A rank whose collective broke because a peer failed or died (CommAborted) shows a
    # symptom that may arrive before the cause: report the first cause, as threads do. A
    # process that died or stopped is the cause of its peers' timeouts.
    i = min(range(len(errors)), key=lambda i: (errors[i][1][0] != "died",
                                               isinstance(excs[i], CommAborted)))
    (rank, msg), exc = errors[i], excs[i]
    _, _, _, text, tb = msg
    if isinstance(exc, SystemExit):  # raised as it is, it would end the caller's program
        exc = exit_error(exc)
    if exc is None:
        detail = f"{text}" + (f"\n\ntraceback on rank {rank}:\n{tb}" if tb else "")
        raise RuntimeError(f"rank {rank}: {detail}")
    if tb and hasattr(exc, "add_note"):
        exc.add_note(f"traceback on rank {rank}:\n{tb}")
    raise tag_rank(exc, rank)


def _load(blob: bytes | None) -> BaseException | None:
    try:
        return None if blob is None else pickle.loads(blob)
    except Exception:  # noqa: BLE001 - the caller falls back to the text
        return None


def _end(procs: list) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
            try:  # a stopped process acts on SIGTERM only once continued
                os.kill(p.pid, signal.SIGCONT)
            except OSError:
                pass
    deadline = time.monotonic() + 2.0
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5.0)
    for p in procs:
        try:
            p.close()
        except ValueError:
            pass


# -- the worker ---------------------------------------------------------------------------

def _watch_parent(parent_pid: int) -> None:
    while True:
        time.sleep(0.5)
        if os.getppid() != parent_pid:
            os._exit(1)


def _send(conn, msg) -> None:
    conn.send_bytes(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))


def _error_msg(tid: int, exc: BaseException) -> tuple:
    tb = "".join(traceback.format_exception(exc))
    try:
        blob = pickle.dumps(exc, protocol=pickle.HIGHEST_PROTOCOL)
        pickle.loads(blob)  # exceptions whose __init__ wants other arguments fail here
    except Exception:  # noqa: BLE001
        blob = None
    return ("err", tid, blob, repr(exc), tb)


def _worker(rank: int, world: int, port: int, timeout: float, conn, parent_pid: int) -> None:
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    try:
        import torch
        import torch.distributed as dist
        torch.set_num_threads(1)
        # As torchrun does: where the store is, for the comm layer's post-mortems.
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
        store = dist.TCPStore("127.0.0.1", port, world + 1, is_master=False,
                              timeout=datetime.timedelta(seconds=max(timeout, 60.0)))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout))
        from ..core.mesh import Mesh
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        _send(conn, _error_msg(-1, e))
        return
    _send(conn, ("ready", -1, None))
    meshes: dict[tuple, Mesh] = {}
    while True:
        try:
            task = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            break
        if task is None:
            break
        tid, shape, names, tmo, payload = task
        try:
            fn, args = pickle.loads(payload)
            mesh = meshes.get((shape, names, tmo))
            if mesh is None:
                mesh = meshes[(shape, names, tmo)] = Mesh(shape, names, backend="torch",
                                                          timeout=tmo)
            with mesh:
                result = fn(mesh, *args)
            try:
                data = pickle.dumps(("ok", tid, result), protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as e:  # noqa: BLE001
                raise TypeError(f"the result of {getattr(fn, '__name__', fn)} on rank {rank} "
                                f"cannot be pickled: {e}") from e
            conn.send_bytes(data)
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            _send(conn, _error_msg(tid, e))
    # No destroy_process_group (it may wait on peers that are gone): just leave.
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except Exception:  # noqa: BLE001
            pass
    os._exit(0)
