"""Structured-output grammars compiled off the engine thread, each under a time limit.

``GrammarCompiler`` (one per engine) compiles a constraint for the engine's tokenizer and keeps
the last ``GRAMMAR_CACHE_ENTRIES`` compiled grammars; ``GrammarCompileService`` runs its
compiles off the engine thread.

A request with a constraint waits outside the scheduler's queues (``Scheduler.waiting_for_grammar``)
until its grammar is compiled; the engine keeps stepping every other request meanwhile. Compiled
grammars are cached by content hash (``grammar_spec.grammar_key``): a cached one admits at once.

    node's event loop      EngineLoop.admit: submit(kind, spec) -> Future, awaited before admission
                           (a failure is the request's INVALID_ARGUMENT / 400)
    engine thread          add_request -> submit(kind, spec) -> Future (a cache hit on a node);
                           not done: the request waits in Scheduler.waiting_for_grammar
    compile thread         cache hit? -> worker process: compile under grammar_compile_timeout_s
                              timeout: kill the worker, the Future fails (GrammarTimeoutError)
                              ok:      compile again here (the GIL is let go) -> cache -> Future
    engine thread          step(): done Futures -> the request joins the queue, or ends in error

Why a process and then a thread (measured on the CI host, 512-token vocabulary): xgrammar's
compile lets go of the GIL (a 1 ms ticker thread saw at most 39 ms between ticks during a 12 s
compile of 1,000 string properties), so a thread keeps the engine stepping; but a thread cannot be
cancelled, and one 20,000-property schema kept a core busy and grew the node by 3 GiB for
minutes. A process can be killed. Its compiled grammar is too costly to bring back
(``serialize_json`` of 300 properties: 9.3 s and 40 MB against a 0.42 s compile), so the worker
only proves the compile ends in time, and the node's thread then compiles the same grammar.
Cost: each new grammar is compiled twice (milliseconds for common schemas).
"""

from __future__ import annotations

import collections
import json
import logging
import os
import queue
import select
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from pdserve.engine.grammar_spec import _grammar, grammar_key
from pdserve.engine.structured import GrammarState
from pdserve.errors import InvalidRequestError

logger = logging.getLogger(__name__)
_ROOT = str(Path(__file__).resolve().parents[2])  # the folder holding the pdserve package
# Compiled grammars kept per tokenizer (GrammarCompiler's cache).
GRAMMAR_CACHE_ENTRIES = 256


class GrammarTimeoutError(InvalidRequestError):
    """A grammar did not compile within ``grammar_compile_timeout_s``: the request fails alone."""


class GrammarCompiler:
    """One per engine: compiles constraints for a tokenizer, cached by ``grammar_key``. The
    engine's compile thread fills the cache (GrammarCompileService); the engine thread's
    matchers read it, so the cache is guarded by a lock."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int] | None = None) -> None:
        import xgrammar as xgr

        # The grammar covers the tokenizer's ids only, not the model's padded vocabulary: ids past
        # the tokenizer are no token at all, the mask kernel bans every column past the bitmask,
        # and xgrammar's accept_token costs grow with the padding (36 µs instead of 1.7 per token
        # for a 616-token tokenizer in a 128,256-row LM head: the grammar bench's Llama-1B shape).
        mask_vocab = min(vocab_size, max(len(tokenizer), max(stop_token_ids or [0]) + 1))
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=mask_vocab, stop_token_ids=stop_token_ids
        )
        self.vocab_size = vocab_size
        self.stop_ids = frozenset(info.stop_token_ids)  # what advance() checks for the end
        self.mask_vocab = mask_vocab  # ids the bitmask covers; every id from here on is banned
        self.mask_words = (mask_vocab + 31) // 32  # int32 words per bitmask row
        self.info = info  # what a compile worker process rebuilds (TokenizerInfo.serialize_json)
        # xgrammar's own cache is keyed by the grammar and unbounded: ours replaces it.
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._cache: collections.OrderedDict[str, Any] = collections.OrderedDict()
        self._lock = threading.Lock()

    def cached(self, kind: str, spec: str) -> Any | None:  # -> xgrammar.CompiledGrammar | None
        key = grammar_key(kind, spec)
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
            return compiled

    def compile(self, kind: str, spec: str) -> Any:  # -> xgrammar.CompiledGrammar
        """The cached grammar, else compiled here (xgrammar lets go of the GIL meanwhile)."""
        compiled = self.cached(kind, spec)
        if compiled is None:
            compiled = self._compiler.compile_grammar(_grammar(kind, spec))
            with self._lock:
                self._cache[grammar_key(kind, spec)] = compiled
                while len(self._cache) > GRAMMAR_CACHE_ENTRIES:
                    self._cache.popitem(last=False)
        return compiled

    def matcher(self, kind: str, spec: str) -> GrammarState:
        import xgrammar as xgr

        return GrammarState(xgr.GrammarMatcher(self.compile(kind, spec)))


class _Worker:
    """The compile worker process (pdserve.engine.grammar_worker) and its JSON-line pipes.

    Spawned at once (importing xgrammar, which imports torch, took 3.3 s of CPU and up to 10 s on
    the loaded 2-core CI host) and given the tokenizer by ``start`` when the first job needs it:
    the import overlaps the tokenizer's loading, and after a kill the next worker's import
    overlaps the wait for the next grammar."""

    def __init__(self) -> None:
        env = dict(
            os.environ, PYTHONPATH=os.pathsep.join(p for p in (_ROOT, os.environ.get("PYTHONPATH")) if p)
        )
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pdserve.engine.grammar_worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.ready = False

    def start(self, tokenizer_info_json: str, start_timeout_s: float) -> None:
        """Hand the worker its tokenizer (a file: a line that fits the pipe never blocks on a
        worker still importing) and wait until it answers ready."""
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            f.write(tokenizer_info_json)
        try:
            self.send({"tokenizer_info_path": f.name})
            self.recv(start_timeout_s, "start (grammar_worker_start_timeout_s)")
        finally:
            os.unlink(f.name)
        self.ready = True

    def send(self, msg: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()

    def recv(self, timeout_s: float, what: str) -> dict[str, Any]:
        """The worker's next line; TimeoutError after ``timeout_s``, ChildProcessError at EOF."""
        out = self.proc.stdout
        assert out is not None
        ready, _, _ = select.select([out], [], [], timeout_s)
        if not ready:
            raise TimeoutError(f"grammar worker: no answer to {what} within {timeout_s:g} s")
        line = out.readline()
        if not line:
            raise ChildProcessError(f"grammar worker exited ({self.proc.poll()}) during {what}")
        msg: dict[str, Any] = json.loads(line)
        return msg

    def kill(self) -> None:
        if getattr(self, "proc", None) is None:
            return
        self.proc.kill()
        self.proc.wait(timeout=10)
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()


class GrammarCompileService:
    """One per engine: compiles grammars on the ``pdserve-grammar-compile`` thread, one at a time,
    each proven in a killable worker process first (the module docstring says why)."""

    def __init__(
        self,
        make_compiler: Callable[[], GrammarCompiler],
        timeout_s: float,
        start_timeout_s: float,
        on_done: Callable[[], None] | None = None,
    ) -> None:
        self._make_compiler = make_compiler
        self.timeout_s = timeout_s
        self.start_timeout_s = start_timeout_s
        self.on_done = on_done  # called on the compile thread after a Future is settled
        self.compiler: GrammarCompiler | None = None  # built on the compile thread (loads the tokenizer)
        self._jobs: queue.SimpleQueue[tuple[str, str, str] | None] = queue.SimpleQueue()
        self._inflight: dict[str, Future[Any]] = {}  # key -> its Future, shared by equal submits
        self._lock = threading.Lock()
        self.num_timeouts_total = 0
        self._worker: _Worker | None = _Worker()  # importing while the first grammar's tokenizer loads
        self._thread = threading.Thread(target=self._run, name="pdserve-grammar-compile", daemon=True)
        self._thread.start()

    def submit(self, kind: str, spec: str) -> Future[Any]:  # Future[xgrammar.CompiledGrammar]
        """A Future of the compiled grammar: done at once on a cache hit; fails with
        GrammarTimeoutError past the time limit, InvalidRequestError for a grammar xgrammar refuses."""
        compiled = self.compiler.cached(kind, spec) if self.compiler is not None else None
        if compiled is not None:
            done: Future[Any] = Future()
            done.set_result(compiled)
            return done
        key = grammar_key(kind, spec)
        with self._lock:
            fut = self._inflight.get(key)
            if fut is None:
                fut = self._inflight[key] = Future()
                self._jobs.put((key, kind, spec))
        return fut

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=10)
        if self._worker is not None:
            self._worker.kill()
            self._worker = None

    # -- the compile thread ------------------------------------------------------------------------
    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            key, kind, spec = job
            with self._lock:
                fut = self._inflight[key]
            if not fut.set_running_or_notify_cancel():  # cancelled while queued: nobody waits
                with self._lock:
                    del self._inflight[key]
                continue
            try:
                fut.set_result(self._compile(kind, spec))
            except BaseException as e:  # handed to the waiting requests, never swallowed
                fut.set_exception(e)
            with self._lock:
                del self._inflight[key]
            if self.on_done is not None:
                self.on_done()

    def _compile(self, kind: str, spec: str) -> Any:
        if self.compiler is None:
            self.compiler = self._make_compiler()
        compiled = self.compiler.cached(kind, spec)
        if compiled is not None:
            return compiled
        self._prove(kind, spec)
        return self.compiler.compile(kind, spec)

    def _prove(self, kind: str, spec: str) -> None:
        """Compile in the worker process within ``timeout_s``, or kill it and raise."""
        assert self.compiler is not None
        if self._worker is None:
            self._worker = _Worker()
        if not self._worker.ready:
            try:
                self._worker.start(self.compiler.info.serialize_json(), self.start_timeout_s)
            except (TimeoutError, ChildProcessError, OSError, ValueError) as e:
                self._worker.kill()
                self._worker = None
                raise RuntimeError(f"the grammar compile worker did not start: {e}") from e
        try:
            self._worker.send({"kind": kind, "spec": spec})
            msg = self._worker.recv(self.timeout_s, f"a {kind} compile")
        except TimeoutError as e:
            self._worker.kill()
            self._worker = _Worker()  # the next one imports while nothing waits for it
            self.num_timeouts_total += 1
            raise GrammarTimeoutError(
                f"the {kind} grammar ({len(spec.encode())} bytes) did not compile within "
                f"grammar_compile_timeout_s={self.timeout_s:g} s and was cancelled; simplify it "
                "(fewer properties, alternatives or repetitions) or raise the node's "
                "grammar_compile_timeout_s",
                field=kind,
            ) from e
        except (ChildProcessError, OSError, ValueError) as e:  # a dead worker, a broken pipe
            self._worker.kill()
            self._worker = None
            raise RuntimeError(f"the grammar compile worker failed: {e}") from e
        if not msg["ok"]:
            raise InvalidRequestError(f"invalid {kind}: {msg['error']}", field=kind)
        logger.debug("grammar %s proven in %.3f s", kind, msg["compile_s"])
