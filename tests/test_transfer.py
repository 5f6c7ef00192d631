"""Shipping values between kernel and worker: out-of-band buffers, shared references, clear errors."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from jupyter_gpulease import transfer
from jupyter_gpulease.cellcode import free_names, select_inputs


def test_large_buffers_travel_out_of_band_and_come_back_writable(tmp_path) -> None:  # type: ignore[no-untyped-def]
    big = np.arange(1 << 20, dtype="f8")  # 8 MiB
    small = np.arange(10)
    packed = transfer.dumps({"big": big, "alias": big, "small": small}, str(tmp_path))
    assert packed["file"] and os.path.getsize(packed["file"]) == big.nbytes  # only the big buffer went out
    assert os.stat(packed["file"]).st_mode & 0o777 == 0o600  # the user's data: no one else may read it
    assert len(packed["data"]) < 10_000
    out = transfer.loads(packed)
    assert not os.path.exists(packed["file"])  # mapped, then removed at once
    assert out["alias"] is out["big"]  # shared references survive
    assert np.array_equal(out["big"], big) and out["big"].flags.writeable
    out["big"][0] = 42.0  # copy-on-write: no effect on anything else
    assert big[0] == 0.0


def test_notebook_functions_and_classes_travel_by_value() -> None:
    ns: dict = {"__name__": "__main__"}
    exec("class P:\n    k = 3\ndef f(x):\n    return x * P.k", ns)
    out = transfer.loads(transfer.dumps({"f": ns["f"]}))
    assert out["f"](2) == 6


def test_unpicklable_value_is_named() -> None:
    with pytest.raises(transfer.TransferError, match=r"Cannot send 'lock' \(type _thread.lock\)"):
        transfer.dumps_named({"ok": 1, "lock": threading.Lock()})


def test_version_mismatch_says_so() -> None:
    transfer.check_versions({"python": "3.11.7"}, {"python": "3.11.9"})  # patch releases pickle alike
    with pytest.raises(transfer.TransferError, match="python 3.12.1 but this kernel runs python 3.11.7"):
        transfer.check_versions({"python": "3.11.7"}, {"python": "3.12.1"})
    with pytest.raises(transfer.TransferError, match="cloudpickle"):
        transfer.check_versions({"python": "3.11.7", "cloudpickle": "3.1.2"},
                                {"python": "3.11.7", "cloudpickle": "2.2.0"})


def test_free_names_and_auto_selection_guards() -> None:
    code = "import math\ny = x + math.pi\ndef g(a):\n    return a + z\nprint(y, token, big, _)\n"
    assert free_names(code) == ["x", "z", "print", "token", "big", "_"]  # in order of first use
    ns = {"x": 1, "z": 2, "token": "s3cr3t", "big": np.zeros(1 << 20), "_": 5}
    sel = select_inputs(code, ns, None, auto_max_bytes=1 << 20)
    assert sel.send == {"x": 1, "z": 2}
    assert set(sel.skipped) == {"token", "big", "_"} and "secret" in sel.skipped["token"]
    assert "MiB" in sel.skipped["big"]
    sel = select_inputs(code, ns, ["x"], auto_max_bytes=1 << 20)
    assert list(sel.send) == ["x"] and "z" in sel.skipped
    assert free_names("def broken(:\n") == []  # the worker reports the SyntaxError with the cell's lines
