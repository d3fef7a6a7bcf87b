"""The grammar compile worker process (``python -m pdserve.engine.grammar_worker``).

A compile that outlives its time limit cannot be stopped inside the node: xgrammar's compile is
native code and a Python thread cannot be cancelled. So every new grammar is compiled here first,
in a process the node kills at the time limit (``GrammarCompileService``); only a grammar that
compiled here within the limit is compiled again on the node's compile thread. The compiled
grammar itself does not come back: its JSON is ~20x slower to write than the compile (300
string properties, 512-token vocabulary: compile 0.42 s, ``serialize_json`` 9.3 s and 40 MB,
``deserialize_json`` 5.8 s; docs/architecture.md, structured outputs).

Protocol: JSON lines on stdin / stdout, never pickle. The first line is
``{"tokenizer_info_path": <a file holding TokenizerInfo.serialize_json()>}``, answered
``{"ready": true}``; then each
``{"kind": k, "spec": s}`` is answered ``{"ok": true, "compile_s": t}`` or
``{"ok": false, "error": msg}``. EOF on stdin ends the process; so does the parent's death
(PR_SET_PDEATHSIG on Linux).
"""

from __future__ import annotations

import ctypes
import json
import signal
import sys
import time
from typing import Any, TextIO

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: stdin EOF still ends an idle worker
        pass


def _reply(out: TextIO, msg: dict[str, Any]) -> None:
    out.write(json.dumps(msg) + "\n")
    out.flush()


def serve(inp: TextIO, out: TextIO) -> None:
    import xgrammar as xgr

    from pdserve.engine.grammar_spec import _grammar

    first = inp.readline()
    if not first:
        return
    with open(json.loads(first)["tokenizer_info_path"]) as f:
        info = xgr.TokenizerInfo.deserialize_json(f.read())
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    _reply(out, {"ready": True})
    for line in inp:
        job = json.loads(line)
        t0 = time.perf_counter()
        try:
            compiler.compile_grammar(_grammar(job["kind"], job["spec"]))
        except (RuntimeError, ValueError, TypeError) as e:  # xgrammar's errors
            _reply(out, {"ok": False, "error": f"{type(e).__name__}: {e}"})
            continue
        _reply(out, {"ok": True, "compile_s": time.perf_counter() - t0})


if __name__ == "__main__":
    _die_with_parent()
    serve(sys.stdin, sys.stdout)
