"""Memory measurement helpers: process RSS, its peak, bytes saved for backward, the machine.

- `rss_bytes()`: resident set size of this process now.
- `peak_rss_bytes()`: its high-water mark (VmHWM; `ru_maxrss` where /proc is missing).
- `reset_peak_rss()`: restart that high-water mark from the current RSS (Linux >= 4.0), so the
  peak of one phase (a model build, a training step) can be told apart from earlier phases.
- `release_free_memory()`: `gc.collect()` plus glibc `malloc_trim(0)`, so RSS reflects live
  objects rather than freed heap pages glibc has not handed back to the kernel yet.
- `SavedTensorTracker`: a context manager that counts the bytes autograd keeps for backward,
  each storage once, and reports the live total and its peak.
- `machine_info()`: CPU model, cores, RAM, torch and deepspeed versions.

Only the standard library, psutil (optional) and torch are used, so any script or test can
import this without starting DeepSpeed.
"""
import ctypes
import ctypes.util
import gc
import os
import platform
import resource
import sys
import threading

MiB = 1 << 20


# ---------------------------------------------------------------------------------------------
# Process memory
# ---------------------------------------------------------------------------------------------
def _status_kib(field: str):
    """A `VmXXX:  1234 kB` line of /proc/self/status, in KiB (None where unavailable)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def rss_bytes() -> int:
    """Resident set size of this process, in bytes."""
    kib = _status_kib("VmRSS")
    if kib is not None:
        return kib * 1024
    import psutil
    return psutil.Process().memory_info().rss


def _ru_maxrss_bytes() -> int:
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss if sys.platform == "darwin" else maxrss * 1024  # bytes on macOS, KiB on Linux


def peak_rss_bytes() -> int:
    """Peak resident set size of this process since it started or since `reset_peak_rss()`."""
    kib = _status_kib("VmHWM")
    return kib * 1024 if kib is not None else _ru_maxrss_bytes()


def reset_peak_rss() -> bool:
    """Reset the peak RSS to the current RSS (writes 5 to /proc/self/clear_refs, Linux >= 4.0).

    Also lowers `ru_maxrss`, which reads the same counter: a caller that wants the peak over the
    process's whole life must read `peak_rss_bytes()` before each reset and keep the maximum.
    Returns False (peak untouched) where the kernel does not allow it.
    """
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


_libc = None


def release_free_memory() -> bool:
    """Collect garbage, then ask glibc to return its free heap pages to the kernel.

    Freed tensors below glibc's mmap threshold (which grows up to 32 MiB at run time) go back
    to the malloc heap, not to the kernel, so they still count in RSS until `malloc_trim`.
    Without this, RSS differences measure the allocator's history as much as live memory.
    Returns whether malloc_trim ran (False on non-glibc systems).
    """
    global _libc
    gc.collect()
    try:
        if _libc is None:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        _libc.malloc_trim(0)
        return True
    except (OSError, AttributeError):
        return False


# ---------------------------------------------------------------------------------------------
# Bytes saved for backward
# ---------------------------------------------------------------------------------------------
class _Saved:
    """What the pack hook hands autograd in place of a saved tensor.

    It holds the tensor (detached: the same storage without its grad_fn, so a saved output does
    not form a reference cycle node -> saved tensor -> grad_fn -> node) and, when autograd drops
    it, its `__del__` tells the tracker that this reference to the storage is gone.
    """
    __slots__ = ("tensor", "key", "tracker")

    def __init__(self, tensor, key, tracker):
        self.tensor, self.key, self.tracker = tensor, key, tracker

    def __del__(self):
        if self.key is not None:
            self.tracker._release(self.key)


class SavedTensorTracker:
    """Count the bytes autograd saves for backward while the context is active.

        with SavedTensorTracker(ignore=model.parameters()) as t:
            loss = model(x).sum(); loss.backward()
        t.peak_bytes, t.live_bytes

    Mechanism: `torch.autograd.graph.saved_tensors_hooks`. The pack hook runs whenever an op
    saves a tensor for backward; it returns a `_Saved` handle that autograd stores in the graph
    instead of the tensor, and the unpack hook returns the tensor back during backward. Autograd
    drops the handle when the graph frees its saved tensors (after backward without
    `retain_graph`, or when the graph itself is garbage-collected), and the handle's `__del__`
    decrements the count of its storage.

    Counting: storages, not tensors. Saved tensors are keyed by (device, storage data_ptr); the
    first reference to a storage adds its full `nbytes()` (a saved view keeps its whole storage
    alive), later references only bump a reference count, and the bytes are subtracted when the
    last reference is released. `live_bytes` is what is saved now, `peak_bytes` the maximum of
    `live_bytes` while the context was active, `total_bytes` every storage ever counted (added
    again if released and saved anew). Storages of tensors in `ignore` (e.g. the parameters,
    which exist anyway and which Linear saves for its input gradient) are not counted.

    Split backward: between a B and its W, the deferred weight-gradient work of schedules/
    weight_grad.py keeps each linear layer's input and output gradient alive outside autograd's
    graph; while the context is active the tracker counts those too (`hold`), until W has run.

    Handles outlive the context (a graph built inside may be freed after it exits); their
    releases keep `live_bytes` right but no longer raise `peak_bytes`. The saved tensors are
    handed back detached, which is fine for backward but not for double backward
    (`create_graph=True`) through saved outputs.
    """

    def __init__(self, ignore=()):
        self._ignore = {self._key(t)[0] for t in ignore}
        self._lock = threading.RLock()  # RLock: a __del__ may run from gc while the lock is held
        self._refs = {}  # storage key -> [references, nbytes]
        self._active = False
        self._hooks = None
        self.live_bytes = 0
        self.peak_bytes = 0
        self.total_bytes = 0
        self.saved_tensors = 0  # pack-hook calls counted (not ignored)

    @staticmethod
    def _key(tensor):
        storage = tensor.untyped_storage()
        return (str(tensor.device), storage.data_ptr()), storage.nbytes()

    def _pack(self, tensor):
        try:
            (key, nbytes) = self._key(tensor)
        except (RuntimeError, NotImplementedError):  # no storage (e.g. some tensor subclasses)
            return _Saved(tensor, None, self)
        if key in self._ignore or nbytes == 0:
            return _Saved(tensor, None, self)
        with self._lock:
            entry = self._refs.get(key)
            if entry is None:
                self._refs[key] = [1, nbytes]
                self.live_bytes += nbytes
                self.total_bytes += nbytes
                if self._active and self.live_bytes > self.peak_bytes:
                    self.peak_bytes = self.live_bytes
            else:
                entry[0] += 1
            self.saved_tensors += 1
        return _Saved(tensor.detach(), key, self)

    @staticmethod
    def _unpack(saved):
        return saved.tensor

    def bytes_of(self, tensor):
        """The bytes of `tensor`'s storage if it is counted as saved now, else 0."""
        try:
            key, _ = self._key(tensor)
        except (RuntimeError, NotImplementedError):
            return 0
        with self._lock:
            entry = self._refs.get(key)
            return entry[1] if entry else 0

    def hold(self, *tensors):
        """Count `tensors` as saved until the returned token is dropped."""
        return [self._pack(t) for t in tensors]

    def _release(self, key):
        with self._lock:
            entry = self._refs.get(key)
            if entry is None:
                return
            entry[0] -= 1
            if entry[0] == 0:
                del self._refs[key]
                self.live_bytes -= entry[1]

    def __enter__(self):
        import torch

        from schedules.runtime.weight_grad import register_holder
        register_holder(self)
        self._active = True
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        from schedules.runtime.weight_grad import unregister_holder
        unregister_holder(self)
        self._active = False
        self._hooks.__exit__(*exc)
        self._hooks = None
        return False


# ---------------------------------------------------------------------------------------------
# Machine
# ---------------------------------------------------------------------------------------------
def machine_info() -> dict:
    """Where a measurement ran: CPU model, cores, RAM, Python/torch/deepspeed versions."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        import psutil
        ram = psutil.virtual_memory().total
    except ImportError:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    info = {"cpu": cpu, "cores": os.cpu_count(), "ram_bytes": ram, "python": platform.python_version(),
            "platform": platform.platform()}
    try:
        import torch
        info["torch"] = torch.__version__
    except ImportError:
        info["torch"] = None
    try:  # the installed version, without importing deepspeed (slow, and it logs on import)
        from importlib.metadata import version
        info["deepspeed"] = version("deepspeed")
    except Exception:  # noqa: BLE001 - a missing package is just not reported
        info["deepspeed"] = None
    return info


def machine_line(info=None) -> str:
    """machine_info() as one line for tables and plots."""
    info = info or machine_info()
    return (f"{info['cpu']}, {info['cores']} cores, {info['ram_bytes'] / (1 << 30):.0f} GiB RAM, "
            f"torch {info['torch']}, deepspeed {info['deepspeed']}")
