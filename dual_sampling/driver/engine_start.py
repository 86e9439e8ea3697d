"""How an engine's processes start: forked from a server that holds vLLM imported, not spawned afresh.

On vLLM's CPU platform each engine is two processes, an EngineCore and the worker that runs the model, and vLLM
spawns both (``vllm/platforms/cpu.py`` forces ``VLLM_WORKER_MULTIPROC_METHOD=spawn``). Each spawned process imports
vLLM and torch again, about 9 s on a core, which is most of a pair's 30 s start. Here instead:

1. **One fork server per driver process** (multiprocessing's ``forkserver``) is started early and imports vLLM's
   engine, worker and model-runner modules and our plugins once (:func:`warm`), then does once what every engine's
   start would (``engine_server``). It starts no OpenMP parallel region (torch's thread pool): a process forked
   after one can hang in libgomp.
2. **Each EngineCore is forked from it.** vLLM asks ``vllm.v1.engine.utils.get_mp_context`` for the context its
   EngineCore starts in, and allows only ``spawn`` and ``fork`` there (``vllm/envs.py``), so that one name is
   replaced (:func:`_install`); the replacement answers the fork server's context only inside :func:`engine_start`,
   in the thread that builds the engine, so vLLM's own ``LLM`` and every other caller keep spawning.
3. **Its environment is carried.** A fork server's child inherits the server's environment, not the driver's at
   ``Process.start()``, so :class:`_EngineProcess` takes the driver's environment and the engine's own settings
   (its CPUs) when it starts and applies them first thing in the child, before vLLM reads any of them (``vllm.envs``
   is read lazily until the engine's start is done).
4. **The worker is forked from its EngineCore** (``VLLM_WORKER_MULTIPROC_METHOD=fork`` in the EngineCore's
   environment), so it stays the EngineCore's child, as the pair's health watch and vLLM's shutdown expect. Its
   libgomp was loaded in the fork server, so the OpenMP variables vLLM sets for the worker's CPUs come too late;
   the worker applies them itself on the fork (:func:`_bind_forked_worker`): its CPU affinity and torch's thread
   count.

The EngineCore is the fork server's child, not the driver's: the pair learns its pids from :func:`engine_start`
instead of from its own children. Kept on ``spawn``: CUDA (a forked process must not inherit a CUDA context) and
``DUAL_SAMPLING_ENGINE_START=spawn``. A Ray actor starts its engines from its own fork server too: vLLM forces spawn
there because forking the actor would copy Ray's threads into the child, but the fork server is a fresh interpreter
that never joined Ray, and its children see no Ray actor (so their workers fork as everywhere else).

vLLM's own ``LLM`` built inside :func:`vllm_engines` starts from the fork server as well (a baseline beside the
pair that starts as fast as it does).
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import multiprocessing.context
import multiprocessing.forkserver
import os
import threading
from collections.abc import Iterator

__all__ = [
    "ENGINE_START_VARIABLE",
    "PRELOAD",
    "SERVER_VARIABLE",
    "engine_start",
    "forkserver_available",
    "start_early",
    "vllm_engines",
    "warm",
]

ENGINE_START_VARIABLE = "DUAL_SAMPLING_ENGINE_START"
"""``forkserver`` (the default where it applies) or ``spawn``: how engine processes start."""

PRELOAD = (
    "vllm.v1.engine.async_llm",
    "vllm.v1.engine.core",
    "vllm.v1.executor.multiproc_executor",
    "vllm.v1.worker.cpu_worker",
    "vllm.v1.worker.cpu_model_runner",
    "processors",
    __name__,
    "dual_sampling.driver.engine_server",
)
"""What the fork server imports once, for every engine it forks: vLLM's engine, executor and CPU worker, our
plugins, this module (the EngineCore's process class is pickled by reference), and last the module that prepares
what every engine would do the same (``engine_server``)."""

SERVER_VARIABLE = "DUAL_SAMPLING_FORK_SERVER"
"""Set in the environment the fork server starts with, and in the driver's only while :func:`_start_server` holds
:data:`_LOCK` (an engine's environment is copied under it); ``engine_server`` prepares only where it is set."""

_STARTS = threading.local()
"""In the thread inside :func:`engine_start`: ``environment`` (the engine's own variables) and ``pids`` (a list the
EngineCores' pids are appended to)."""

_LOCK = threading.Lock()
_INSTALLED = False
_DRIVER = 0
"""In an EngineCore forked from the fork server and its worker: the pid of the driver that started it."""


def forkserver_available() -> bool:
    """Whether engines start from the fork server here: vLLM's CPU platform, not opted out."""
    if os.environ.get(ENGINE_START_VARIABLE, "forkserver") == "spawn":
        return False
    if os.environ.get(ENGINE_START_VARIABLE, "forkserver") != "forkserver":
        raise ValueError(
            f"{ENGINE_START_VARIABLE} must be 'forkserver' or 'spawn', got {os.environ[ENGINE_START_VARIABLE]!r}"
        )
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def warm() -> bool:
    """Start this process's fork server (if engines start from it here), so that its imports overlap the caller's
    own work; idempotent. Returns whether engines start from it."""
    if not forkserver_available():
        return False
    with _LOCK:
        _start_server()  # first: its imports overlap this process's import of vLLM's launcher below
        _install()
    return True


def start_early() -> None:
    """Start the fork server now, before this program imports torch and vLLM itself, so that both imports run at once
    (a program's first lines; public as ``dual_sampling.start_engine_server_early``, which imports nothing heavy).
    Data runs, distillation runs, ``dual-sampling serve`` and a Ray replica call it once their settings are checked.
    Only on vLLM's CPU build, told as vLLM's platform plugin tells it but without importing vLLM, and not opted out;
    :func:`warm` still decides whether engines start from it."""
    if os.environ.get(ENGINE_START_VARIABLE, "forkserver") != "forkserver" or not _vllm_cpu_build():
        return
    with _LOCK:
        _start_server()


def _vllm_cpu_build() -> bool:
    """vLLM's own test for its CPU platform (``vllm.platforms.cpu_platform_plugin``), Linux part: the target device
    set to cpu, or an installed vLLM whose version names cpu (the ``vllm-cpu`` package's does)."""
    from importlib.metadata import PackageNotFoundError, version

    if os.environ.get("VLLM_TARGET_DEVICE") == "cpu":
        return True
    for name, suffix in (("vllm", ""), ("vllm-cpu", "+cpu")):
        with contextlib.suppress(PackageNotFoundError):
            return "cpu" in version(name) + suffix
    return False


def _start_server() -> None:
    """Start the fork server with :data:`PRELOAD` (idempotent; under :data:`_LOCK`)."""
    multiprocessing.set_forkserver_preload(list(PRELOAD))
    # The server's environment is this process's now: nothing engine-specific may be in it (each engine's own
    # variables are carried by _EngineProcess). TorchInductor's thread settings are read once, at its import.
    with contextlib.ExitStack() as stack:
        for name, value in (("TORCHINDUCTOR_COMPILE_THREADS", "1"), ("TORCHINDUCTOR_CPP_DYNAMIC_THREADS", "1")):
            if name not in os.environ:
                stack.enter_context(_variable(name, value))
        stack.enter_context(_variable(SERVER_VARIABLE, "1"))
        multiprocessing.forkserver.ensure_running()


@contextlib.contextmanager
def engine_start(environment: dict[str, str], pids: list[int]) -> Iterator[None]:
    """Inside this block, engines this thread builds start from the fork server with ``environment`` on top of this
    process's, and their EngineCores' pids are appended to ``pids`` as each starts (another thread may read it then:
    the pair lists a starting engine's files by it)."""
    if not warm():
        raise RuntimeError("engine_start: engines do not start from the fork server here (see forkserver_available)")
    _STARTS.environment, _STARTS.pids = dict(environment), pids
    try:
        yield
    finally:
        del _STARTS.environment, _STARTS.pids


@contextlib.contextmanager
def vllm_engines(environment: dict[str, str] | None = None) -> Iterator[list[int]]:
    """vLLM's own engines (``vllm.LLM``) built in this block start from the fork server where the pair's do, with
    ``environment`` on top of this process's; elsewhere vLLM starts them its own way. Yields the list their
    EngineCores' pids are appended to."""
    pids: list[int] = []
    if not warm():
        yield pids
        return
    with engine_start(dict(environment or {}), pids):
        yield pids


def _install() -> None:
    """Replace the name vLLM's EngineCore launcher takes its multiprocessing context from."""
    global _INSTALLED
    if _INSTALLED:
        return
    import vllm.v1.engine.utils as launcher

    original = launcher.get_mp_context

    def get_mp_context() -> multiprocessing.context.BaseContext:
        return _EngineContext() if hasattr(_STARTS, "pids") else original()

    launcher.get_mp_context = get_mp_context
    _INSTALLED = True


class _EngineProcess(multiprocessing.context.ForkServerProcess):
    """An EngineCore forked from the fork server, with the environment the driver meant it to start in."""

    def start(self) -> None:
        # In the driver: its environment now (VLLM_RPC_BASE_PATH, what vLLM's platform set), the engine's own
        # settings, and the worker forked, not spawned.
        with _LOCK:  # not while _start_server sets the fork server's own variables
            self._carried = {**os.environ, **_STARTS.environment, "VLLM_WORKER_MULTIPROC_METHOD": "fork"}
        self._driver = os.getpid()
        super().start()
        _STARTS.pids.append(self.pid)

    def run(self) -> None:
        # In the EngineCore, before vLLM reads anything. setproctitle (vLLM names its processes with it) finds the
        # memory it rewrites by the environment's original place: it must look before the environment is replaced.
        with contextlib.suppress(ImportError):
            import setproctitle

            setproctitle.getproctitle()
        os.environ.clear()
        os.environ.update(self._carried)
        # What the fork server imported is never garbage: out of the collector's sight, vLLM's full collections in an
        # engine's start (three, each about 0.5 s over that heap) see only what this engine makes, and so do those of
        # its close (see _keep_frozen).
        gc.freeze()
        gc.unfreeze = _keep_frozen
        from dual_sampling.lockstep import watch_driver  # in the fork server's imports, unlike this module's

        global _DRIVER
        _DRIVER = self._driver
        # The fork server's child is not the driver's: nothing ends it when the driver dies, at any point of its start.
        watch_driver(_DRIVER)
        os.register_at_fork(after_in_child=_bind_forked_worker)
        super().run()


def _keep_frozen() -> None:
    """``gc.unfreeze`` in an engine's processes forked from the fork server (its EngineCore and worker): a no-op.

    vLLM's shutdown unfreezes the whole heap and then collects (``EngineCore.shutdown``, ``Worker.shutdown``,
    ``cleanup_dist_env_and_memory``) so that an engine stopped inside a process that lives on frees what it
    allocated. Here the process exits right after, and those collections walked the fork server's heap too: about
    1.1 s of a pair's close (``examples/bench_engine_start.py``). Nothing this engine allocated after the fork is hidden
    by the freeze in :meth:`_EngineProcess.run`, and the worker's, which holds the model, never froze its own."""


class _EngineContext(multiprocessing.context.ForkServerContext):
    Process = _EngineProcess


def _bind_forked_worker() -> None:
    """In a process forked from an EngineCore (its worker): the CPUs and thread count vLLM's OpenMP variables name,
    applied by hand, as libgomp read its variables long before, in the fork server. It watches the driver too, should
    its EngineCore end without ending it."""
    from dual_sampling.lockstep import watch_driver

    watch_driver(_DRIVER)
    threads = os.environ.get("OMP_NUM_THREADS")
    cpus = _omp_cpus()
    if cpus:
        os.sched_setaffinity(0, cpus)
    if threads:
        import torch

        torch.set_num_threads(int(threads))


def _omp_cpus() -> set[int]:
    """The CPUs vLLM's OpenMP variables bind a worker to (``GOMP_CPU_AFFINITY`` "0 1", ``OMP_PLACES`` "{0,1}", or
    ``KMP_AFFINITY`` "...proclist=[0,1]"); empty where none is set."""
    if value := os.environ.get("GOMP_CPU_AFFINITY"):
        return {int(c) for c in value.replace(",", " ").split()}
    if value := os.environ.get("OMP_PLACES"):
        return {int(c) for c in value.strip("{}").split(",") if c.strip()}
    if (value := os.environ.get("KMP_AFFINITY")) and "proclist=[" in value:
        return {int(c) for c in value.split("proclist=[", 1)[1].split("]", 1)[0].split(",")}
    return set()


@contextlib.contextmanager
def _variable(name: str, value: str) -> Iterator[None]:
    os.environ[name] = value
    try:
        yield
    finally:
        os.environ.pop(name, None)
