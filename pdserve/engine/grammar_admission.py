"""Admission of requests with a structured-output constraint: they wait for their grammar.

``GrammarAdmission`` owns the engine's ``GrammarCompileService`` (made by the first constrained
request), the compiles that admitted requests wait for (``pending``; the request meanwhile sits
in ``Scheduler.waiting_for_grammar``), and the hand-over of the service's compiler to the model
runner's matchers. ``LLMEngine.add_request`` submits through it (``submit``, ``admitted``),
``LLMEngine.step`` lets the requests whose grammar is settled join the queue or end in error
(``admit_compiled``), ``LLMEngine.grammar_service`` and ``wait_for_grammars`` delegate here, and
``EngineLoop`` sets ``wake``. See engine/grammar_compile.py for the compile itself.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_futures
from typing import Any

from pdserve.config.engine import EngineConfig
from pdserve.engine.executor import ModelExecutor
from pdserve.engine.grammar_compile import GrammarCompileService
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.output_processor import OutputProcessor
from pdserve.engine.outputs import GenerationDelta
from pdserve.engine.request import RequestStatus
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler
from pdserve.errors import InvalidRequestError
from pdserve.models.config import ModelArchConfig
from pdserve.models.loader import load_tokenizer


class GrammarAdmission:
    def __init__(
        self,
        config: EngineConfig,
        arch: ModelArchConfig,  # the grammar's vocabulary and stop tokens
        tokenizer: Any | None,  # None: the compiler loads the model's tokenizer when first made
        runner: ModelExecutor,
        scheduler: Scheduler,  # holds a waiting request until grammar_ready / finish_request
        output_processor: OutputProcessor,  # the final delta of a request whose compile failed
    ) -> None:
        self.config = config
        self.arch = arch
        self.tokenizer = tokenizer
        self.runner = runner
        self.scheduler = scheduler
        self.output_processor = output_processor
        # Grammars compile off this thread (made by the first constrained request).
        self.service: GrammarCompileService | None = None
        self.pending: dict[str, Future[Any]] = {}  # request id -> its grammar's Future
        self.wake: Callable[[], None] | None = None  # EngineLoop: wake the engine thread
        self._lock = threading.Lock()

    def close(self) -> None:
        """Stop the grammar compiler, if any (idempotent)."""
        if self.service is not None:
            self.service.close()
            self.service = None

    def compile_service(self) -> GrammarCompileService:
        """The engine's grammar compiler (made on first use; any thread: EngineLoop.admit asks
        from the event loop)."""
        with self._lock:
            return self._make_service()

    def _make_service(self) -> GrammarCompileService:
        if self.service is None:
            from pdserve.engine.grammar_compile import GrammarCompiler

            cfg, vocab, eos = self.config, self.arch.vocab_size, sorted(set(self.arch.eos_token_ids)) or None
            tok = self.tokenizer
            self.service = GrammarCompileService(
                lambda: GrammarCompiler(tok if tok is not None else load_tokenizer(cfg.model), vocab, eos),
                cfg.grammar_compile_timeout_s,
                cfg.grammar_worker_start_timeout_s,
                on_done=lambda: self.wake() if self.wake is not None else None,
            )
        return self.service

    def submit(self, params: SamplingParams) -> Future[Any] | None:
        """The Future of the request's compiled grammar; None for a request without a constraint."""
        if params.structured is None:
            return None
        return self.compile_service().submit(*params.structured)

    def admitted(self, request_id: str, grammar: Future[Any], waits: bool) -> None:
        """The request joined the scheduler: waiting for ``grammar`` (``waits``), or queued with
        it compiled already."""
        if waits:
            self.pending[request_id] = grammar
        else:
            self.share_compiler()

    def share_compiler(self) -> None:
        """The model runner's matchers use the compile service's compiler and its cache, so
        their first sight of a request finds its grammar compiled (never compiled on this thread)."""
        if (
            isinstance(self.runner, ModelRunner)
            and self.service is not None
            and self.service.compiler is not None
        ):
            self.runner.grammar.compiler = self.service.compiler

    def wait(self, timeout_s: float) -> bool:
        """Block up to ``timeout_s`` until a pending grammar is settled (offline use: nothing else
        to do meanwhile); False when none is pending. The compile thread settles each one within
        grammar_compile_timeout_s of its turn."""
        futs = list(self.pending.values())
        if futs:
            wait_futures(futs, timeout=timeout_s, return_when=FIRST_COMPLETED)
        return bool(futs)

    def has_ready(self) -> bool:
        """A pending grammar is settled: ``admit_compiled`` would admit or end its request."""
        return any(fut.done() for fut in self.pending.values())

    def admit_compiled(self) -> list[GenerationDelta]:
        """Requests whose grammar is ready join the queue; those whose compile failed or ran out
        of time end here with an error (they hold no blocks)."""
        out: list[GenerationDelta] = []
        for rid, fut in list(self.pending.items()):
            if not fut.done():
                continue
            del self.pending[rid]
            if rid not in self.scheduler.waiting_for_grammar:  # aborted meanwhile
                continue
            err = fut.exception()
            if err is None:
                self.share_compiler()
                self.scheduler.grammar_ready(rid)
                continue
            req = self.scheduler.finish_request(rid, RequestStatus.FINISHED_ERROR)
            assert req is not None
            d = self.output_processor.final_delta(req)
            d.finish_reason = "error"
            d.error = str(err) if isinstance(err, InvalidRequestError) else f"grammar compile failed: {err}"
            out.append(d)
        return out
