"""Shipping values between the kernel and a worker.

Everything goes in one cloudpickle call (shared references survive; functions and
classes defined in the notebook travel by value). Large buffers (numpy, pandas,
tensors: anything that supports pickle protocol 5) travel out of band, never through
a pipe:
- between the kernel and its own worker process, copied straight from one process's
  memory into the other's (``vmcopy``): the sender holds its buffers and says where
  they are (``vm``), the kernel copies;
- otherwise (a worker on another node, or direct copies refused here), written once
  to a new file (0600, ``create_private``) in this user's own directory in /dev/shm (``shm_dir``) or in the
  lease's artifact directory, and mapped back copy-on-write once ``open_private`` showed the reader's own file.

Both ends import this module; it must stay free of IPython imports.
"""

from __future__ import annotations

import _pickle as pickle  # the C pickler itself: `import pickle` adds re & co. (~6 ms) to a cold start
import io
import mmap
import os
import struct
import sys

from gpulease_protocol.private import create_private, open_private, private_dir

from . import vmcopy

TYPE_CHECKING = False  # typing only for the type checker: this module is on every cold start
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import IO, Any

    from .fastpath import Prefaulted

# cloudpickle is imported only when needed: a cold worker that runs a plain cell starts faster,
# and unpickling what cloudpickle wrote imports it by itself.

# Buffers smaller than this stay in-band: a file per small array costs more than it saves.
OOB_MIN_BYTES = 1 << 20
_HEADER = struct.Struct("!Q")


def user_dir(base: str) -> str:
    """This user's own directory under ``base`` (``/dev/shm``, the temporary directory): ``gpulease-<uid>``, mode
    0700, never one another user made first (``private_dir``: refused, with the path and its owner). What a kernel
    or worker keeps for itself goes there: values on their way, parked sessions, artifacts staged for upload."""
    return private_dir(os.path.join(base, f"gpulease-{os.geteuid()}"))


class TransferError(Exception):
    """A value could not be sent; the message names it."""


def versions() -> dict[str, str]:
    """Python's version, and cloudpickle's if this process has loaded it."""
    out = {"python": ".".join(str(v) for v in sys.version_info[:3])}
    cp = sys.modules.get("cloudpickle")
    if cp is not None:
        out["cloudpickle"] = cp.__version__
    return out


def check_versions(mine: dict[str, str], theirs: dict[str, str]) -> None:
    """Pickles only travel between matching Python and cloudpickle versions: say so clearly."""
    for key in ("python", "cloudpickle"):
        if key not in mine or key not in theirs:
            continue
        a, b = mine[key], theirs[key]
        if key == "python":
            a, b = a.rsplit(".", 1)[0], b.rsplit(".", 1)[0]  # patch releases pickle alike
        if a != b:
            raise TransferError(
                f"The GPU worker runs {key} {theirs.get(key)} but this kernel runs {key} {mine.get(key)}: values "
                f"cannot be exchanged. Point GpuMagics.worker_python at an interpreter with the same versions."
            )


def shm_dir() -> str:
    """This user's own directory in host memory, ``/dev/shm/gpulease-<uid>`` (0700; under the temporary directory
    where there is no /dev/shm): large values on their way, parked sessions. One that another user made there first
    is refused (``UnsafePathError`` naming it and its owner), never used."""
    d = "/dev/shm"
    if not (os.path.isdir(d) and os.access(d, os.W_OK)):
        import tempfile

        d = tempfile.gettempdir()
    return user_dir(d)


def _identity(x: Any) -> Any:
    return x


def _to_cpu(obj: Any) -> Any:
    """A reduction that brings a tensor on a device back to the CPU first (the kernel has no GPU)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor) and obj.device.type != "cpu":
        return _identity, (obj.detach().cpu(),)
    return NotImplemented


def _keep_device(obj: Any) -> Any:
    """A reduction that brings a tensor on a device to host memory and back onto that device when it is loaded
    (``on_device``): a parked session's model returns to the GPU of its next lease."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor) and obj.device.type != "cpu":
        return on_device, (obj.detach().cpu(), str(obj.device), isinstance(obj, torch.nn.Parameter),
                           bool(obj.requires_grad))
    return NotImplemented


def on_device(tensor: Any, device: str, parameter: bool, requires_grad: bool) -> Any:
    """A parked tensor back on the device it was on. A worker sees only its lease's GPUs, numbered from 0, so
    ``cuda:1`` is the lease's second GPU; a device this worker lacks (fewer GPUs, none) keeps the tensor in host
    memory and says so once."""
    import torch

    kind, _, index = device.partition(":")
    try:
        count = getattr(torch, kind).device_count() if kind != "cpu" else 0
        target = device if index and int(index) < count else kind
        moved = tensor.to(target) if count else None
    except (AttributeError, RuntimeError, AssertionError):  # no such backend here, or it cannot start
        moved = None
    if moved is None:
        if not _FELL_BACK:
            sys.stderr.write(f"gpulease: this worker has no {device} device: parked tensors stay in host memory\n")
        _FELL_BACK.append(device)
        moved = tensor
    if parameter:
        return torch.nn.Parameter(moved, requires_grad=requires_grad)
    return moved.requires_grad_(requires_grad) if requires_grad else moved


_FELL_BACK: list[str] = []
_REDUCERS = {False: _to_cpu, True: _keep_device}
_PICKLERS: dict[bool, Any] = {}


def _pickler_class(keep_devices: bool = False) -> Any:
    """cloudpickle (notebook functions and classes by value) with tensors moved to the CPU (``keep_devices``:
    and back onto their device when loaded)."""
    cls = _PICKLERS.get(keep_devices)
    if cls is None:
        import cloudpickle

        reduce = _REDUCERS[keep_devices]

        class _Pickler(cloudpickle.Pickler):
            def reducer_override(self, obj: Any) -> Any:
                reduced = reduce(obj)
                return super().reducer_override(obj) if reduced is NotImplemented else reduced

        cls = _PICKLERS[keep_devices] = _Pickler
    return cls


class _PlainPickler(pickle.Pickler):
    """The standard pickler (no cloudpickle import) with tensors moved to the CPU."""

    def reducer_override(self, obj: Any) -> Any:
        return _to_cpu(obj)


def _trivial(value: Any) -> bool:
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return True
    if isinstance(value, (list, tuple)) and len(value) < 64:
        return all(_trivial(v) for v in value)
    if isinstance(value, dict) and len(value) < 64:
        return all(isinstance(k, str) and _trivial(v) for k, v in value.items())
    return False


def dumps(value: Any, directory: str | None = None, vm: bool = False, keep_devices: bool = False,
          path: str | None = None, inline: bool = False) -> dict[str, Any]:
    """Pickle ``value``; buffers of at least OOB_MIN_BYTES travel out of band.

    Plain data uses the standard pickler; anything else cloudpickle (by value for what the
    notebook or the cell defined). Returns a small, plainly picklable dict:
    ``{"data": bytes, "file": path|None, "spans": [(off, len)]}``: the big buffers in one file
    in ``directory``. With ``vm`` they stay where they are instead: ``"vm": [(address, len)]``
    says where, and ``"_hold"`` (to pop before sending) keeps them alive until they are copied. ``keep_devices``:
    tensors on a GPU come back onto their device when loaded (see ``on_device``), not on the CPU. ``path``: the
    buffer file's name (default: a new random one in ``directory``). ``inline``: no file either, the buffers travel
    in the message itself (``"inline"``: the channel of a worker on a node without the shared artifact root), as
    ``PickleBuffer``s over the values' own memory: not copied here, only by the channel's send (``write_framed``,
    Ray's object store)."""
    big: list[pickle.PickleBuffer] = []

    def keep(buf: pickle.PickleBuffer) -> bool:
        if buf.raw().nbytes >= OOB_MIN_BYTES:
            big.append(buf)
            return False  # out of band
        return True  # serialise in band

    f = io.BytesIO()
    pickler = _PlainPickler if _trivial(value) and not keep_devices else _pickler_class(keep_devices)
    pickler(f, protocol=5, buffer_callback=keep).dump(value)
    out: dict[str, Any] = {"data": f.getvalue(), "file": None, "spans": []}
    if big:
        raws = [b.raw() for b in big]
        if vm:
            out["vm"] = vmcopy.spans(raws)
            out["_hold"] = raws
        elif inline:
            out["inline"] = big
        else:
            out["file"], out["spans"] = write_buffers(raws, directory, path)
    return out


def write_buffers(raws: list[memoryview], directory: str | None = None,
                  path: str | None = None) -> tuple[str, list[tuple[int, int]]]:
    """The buffers, one after the other, in a new file only this user can read (``path``, or a random name in
    ``directory``, by default this user's ``shm_dir``): (path, spans)."""
    path = path or os.path.join(directory or shm_dir(), f"gpulease-{os.urandom(12).hex()}.buf")
    spans = []
    try:
        with os.fdopen(create_private(path), "wb") as fh:
            off = 0
            for raw in raws:
                fh.write(raw)
                spans.append((off, raw.nbytes))
                off += raw.nbytes
    except BaseException:  # e.g. the directory is full: leave no half-written file behind
        discard({"file": path})
        raise
    return path, spans


def loads(packed: dict[str, Any], buffers: list[Any] | None = None, keep_file: bool = False) -> Any:
    """The inverse of dumps, with the out-of-band ``buffers`` when they were copied here already;
    otherwise the buffer file is mapped copy-on-write and removed at once (``keep_file``: left in place). A buffer
    file that is not this user's own regular file, or that others can write, is refused (``UnsafePathError``)."""
    path = packed.get("file")
    if buffers is None and packed.get("inline") is not None:
        buffers = list(packed["inline"])
    elif buffers is None and path:
        try:
            with os.fdopen(open_private(path), "rb") as fh:
                size = os.fstat(fh.fileno()).st_size
                mm = mmap.mmap(fh.fileno(), size, access=mmap.ACCESS_COPY) if size else None
        finally:
            if not keep_file:
                discard(packed)
        view = memoryview(mm) if mm is not None else memoryview(b"")
        buffers = [view[off : off + n] for off, n in packed["spans"]]
    return pickle.loads(packed["data"], buffers=buffers or [])


def discard(packed: dict[str, Any] | None) -> None:
    if packed and packed.get("file"):
        try:
            os.unlink(packed["file"])
        except FileNotFoundError:
            pass


# ---------------------------------------------------------------- direct copies (same host)
# Every copy is made by the kernel (the worker's parent: see vmcopy). Into the worker: it allocates,
# asks with {"type": "vm_dest", "addrs"}, the kernel copies and answers {"type": "vm_done", "ok"}
# (or, refused, with the buffers in a file). Out of the worker: its result says where its buffers
# are; the kernel copies them and answers vm_done; refused, the worker sends {"type": "vm_file"}.
def push(pid: int, hold: list[memoryview], ask: dict[str, Any], directory: str | None) -> dict[str, Any]:
    """The kernel's answer to a worker's vm_dest: the held buffers copied into it, or written to a file."""
    if vmcopy.copy_unless_refused(pid, vmcopy.spans(hold), ask["addrs"], write=True):
        return {"type": "vm_done", "ok": True}
    path, spans = write_buffers(hold, directory)
    return {"type": "vm_done", "ok": False, "file": path, "spans": spans}


def pull(pid: int, packed: dict[str, Any], into: Prefaulted | None = None) -> bool:
    """Copy the buffers a worker's result names into this process (``packed["buffers"]``), into memory cut from
    ``into`` when they fit; False if refused."""
    from .fastpath import destinations

    dests = destinations([n for _, n in packed["vm"]], into)
    if not vmcopy.copy_unless_refused(pid, vmcopy.spans(dests), packed["vm"], write=False):
        return False
    packed["buffers"] = dests
    return True


def receive(packed: dict[str, Any], ask: Any, into: Prefaulted | None = None) -> Any:
    """The worker's loads(): buffers the kernel holds are copied into memory here first (cut from ``into``, memory
    faulted in while the worker waited, when they fit)."""
    if not packed.get("vm"):
        return loads(packed)
    from .fastpath import destinations

    dests = destinations([n for _, n in packed["vm"]], into)
    reply = ask({"type": "vm_dest", "addrs": vmcopy.spans(dests)})
    if reply.get("ok"):
        return loads(packed, dests)
    return loads({**packed, "file": reply["file"], "spans": reply["spans"]})


def dumps_named(values: dict[str, Any], directory: str | None = None, vm: bool = False,
                inline: bool = False) -> dict[str, Any]:
    """dumps() a dict of named values (``inline``: see ``dumps``); on failure, find and name the culprit."""
    try:
        return dumps(values, directory, vm, inline=inline)
    except Exception as e:
        import cloudpickle

        for name, v in values.items():
            try:
                cloudpickle.dumps(v, protocol=5)
            except Exception as inner:
                raise TransferError(
                    f"Cannot send {name!r} (type {type(v).__module__}.{type(v).__qualname__}): {inner}. "
                    "Leave it out, or send something picklable that rebuilds it."
                ) from None
        raise TransferError(f"Cannot send values {sorted(values)}: {e}") from None


def dumps_result(outputs: dict[str, Any], value: Any, directory: str | None = None, vm: bool = False,
                 inline: bool = False) -> dict[str, Any]:
    """dumps() a cell's ``--out`` values and its value together (``inline``: see ``dumps``); on failure, a
    ``TransferError`` that names the user's variable (or the cell's value) and its type, never the wrapper dict
    this packs them in."""
    try:
        return dumps({"outputs": outputs, "value": value}, directory, vm, inline=inline)
    except Exception as e:
        import cloudpickle

        named = [(f"--out {name}", v) for name, v in outputs.items()] + [("the cell's value (its last line)", value)]
        for what, v in named:
            try:
                cloudpickle.dumps(v, protocol=5)
            except Exception as inner:
                raise TransferError(
                    f"{what} (type {type(v).__module__}.{type(v).__qualname__}) cannot be brought back to the "
                    f"kernel: {inner}"
                ) from None
        raise TransferError(f"the cell's results cannot be brought back to the kernel: {e}") from None


def approx_size(value: Any, limit: int) -> int:
    """A cheap upper-ish estimate of a value's payload, to guard --in auto against huge captures."""
    nbytes = getattr(value, "nbytes", None)
    if isinstance(nbytes, int):
        return nbytes
    memory_usage = getattr(value, "memory_usage", None)  # pandas
    if callable(memory_usage):
        try:
            total = memory_usage(deep=False)
            return int(getattr(total, "sum", lambda: total)())
        except Exception:
            pass
    if isinstance(value, (bytes, bytearray, str)):
        return len(value)
    if isinstance(value, (list, tuple, dict, set)) and len(value) > 0:
        items = list(value.values()) if isinstance(value, dict) else list(value)
        sample = items[:100]
        per = sum(approx_size(v, limit) for v in sample) / len(sample)
        return int(per * len(items))
    return sys.getsizeof(value)


# ---------------------------------------------------------------- framing on pipes
def send(stream: IO[bytes], msg: Any) -> None:
    data = pickle.dumps(msg, protocol=5)
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


class _Count:
    """A pickler's file that only counts what it is given."""

    def __init__(self) -> None:
        self.n = 0

    def write(self, data: Any) -> None:
        self.n += memoryview(data).nbytes


class _Pieces:
    """A pickler's file that hands what it is given on in pieces of at most ``piece`` bytes: the pickler's small
    writes joined, a large buffer (an in-band ``PickleBuffer``, passed to ``write`` as it is) sliced, not copied."""

    def __init__(self, emit: Callable[[memoryview], None], piece: int) -> None:
        self._emit, self._piece = emit, piece
        self._small = bytearray()
        self.n = 0

    def write(self, data: Any) -> None:
        view = data.raw() if isinstance(data, pickle.PickleBuffer) else memoryview(data).cast("B")
        self.n += view.nbytes
        if len(self._small) + view.nbytes <= self._piece:
            self._small += view
            return
        self.flush()
        for off in range(0, view.nbytes, self._piece):
            self._emit(view[off : off + self._piece])

    def flush(self) -> None:
        if self._small:
            small, self._small = self._small, bytearray()
            self._emit(memoryview(small))


def framed_size(msg: Any) -> int:
    """How many bytes ``send`` writes for ``msg`` (what ``write_framed`` hands on), without making them."""
    count = _Count()
    pickle.Pickler(count, protocol=5).dump(msg)
    return _HEADER.size + count.n


def write_framed(msg: Any, emit: Callable[[memoryview], None], piece: int, size: int | None = None) -> int:
    """``send``'s bytes for ``msg`` handed to ``emit`` in pieces of at most ``piece`` bytes, never joined: the
    buffers a message carries in band (a cell's inputs for a node without the shared root, ``dumps(inline=True)``)
    go out from the values' own memory, so the channel's send is the only copy of them on this host. ``size``:
    ``framed_size(msg)``, when the caller measured it already. Returns the bytes handed on."""
    size = framed_size(msg) if size is None else size
    out = _Pieces(emit, piece)
    out.write(_HEADER.pack(size - _HEADER.size))
    pickle.Pickler(out, protocol=5).dump(msg)
    out.flush()
    if out.n != size:  # the message changed while it was sent (another thread): the frame is broken
        raise TransferError(f"a message of {size} bytes changed to {out.n} bytes while it was sent")
    return out.n


def recv(stream: IO[bytes]) -> Any:
    """One message, or None at end of stream."""
    head = _read_exact(stream, _HEADER.size)
    if head is None:
        return None
    (n,) = _HEADER.unpack(head)
    body = _read_exact(stream, n)
    if body is None:
        return None
    return pickle.loads(body)


def _read_exact(stream: IO[bytes], n: int) -> bytes | None:
    chunks = []
    while n:
        b = stream.read(n)
        if not b:
            return None
        chunks.append(b)
        n -= len(b)
    return b"".join(chunks)


class FrameReader:
    """Incremental decoder for non-blocking reads (the kernel side's select loop)."""

    def __init__(self) -> None:
        self.buf = bytearray()

    def feed(self, data: bytes | bytearray) -> list[Any]:
        self.buf += data
        out = []
        while len(self.buf) >= _HEADER.size:
            (n,) = _HEADER.unpack_from(self.buf)
            if len(self.buf) < _HEADER.size + n:
                break
            with memoryview(self.buf) as whole, whole[_HEADER.size : _HEADER.size + n] as body:
                out.append(pickle.loads(body))  # not copied first (a message may carry 200 MB in band)
            del self.buf[: _HEADER.size + n]
        return out
