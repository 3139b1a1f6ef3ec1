"""A pool worker: reads pickled ("module:function", args) tasks on stdin, answers on stdout.

Runs in its own process, in its main thread (math-verify's timeouts are signals). Stray prints
from scorers go to stderr: the real stdout is kept for the protocol.
"""

from __future__ import annotations

import importlib
import logging
import os
import pickle
import struct
import sys
import threading
import time
import traceback

_HEADER = struct.Struct("<Q")


def _die_with_parent() -> None:
    """Exit when the driving process dies (PR_SET_PDEATHSIG would fire when the *thread* that
    started us exits, and pool threads are short-lived, so poll the parent instead)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def _read_exactly(stream, size: int) -> bytes | None:
    data = stream.read(size)
    return data if data and len(data) == size else None


def main() -> None:
    """Serve tasks until stdin closes."""
    _die_with_parent()
    logging.basicConfig(level=logging.ERROR)
    requests = os.fdopen(os.dup(0), "rb")
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # print() in a scorer must not corrupt the protocol
    sys.stdout = sys.stderr
    while True:
        header = _read_exactly(requests, _HEADER.size)
        if header is None:
            return
        name, args = pickle.loads(_read_exactly(requests, _HEADER.unpack(header)[0]))
        try:
            module, _, attribute = name.partition(":")
            reply = ("ok", getattr(importlib.import_module(module), attribute)(*args))
        except BaseException as error:  # noqa: BLE001 - reported to the pool as infra_error
            last = traceback.format_exception_only(type(error), error)[-1].strip()
            reply = ("error", last)
        data = pickle.dumps(reply)
        replies.write(_HEADER.pack(len(data)) + data)
        replies.flush()


if __name__ == "__main__":
    main()
