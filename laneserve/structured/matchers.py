"""`GrammarBook`: the worker's grammar matchers, one per structured request.

Who touches a matcher, and when (the lanes of worker/lanes.py):

```
 command lane   add(handle, params)        compile the request's grammar
 device lane    bitmask(rows)              after fence.wait(): masks for position 0
                                           and each draft (drafts consumed, then
                                           rolled back: the state is unchanged)
 output lane    commit(outputs)            consume the step's emitted tokens (the
                                           accepted drafts + one), then fence.reclaimed()
 prepare lane   drop(handles)              forget finished requests
```
The matcher's state therefore only ever advances on committed tokens; a rejected
draft never reaches it. The device lane's masks and the output lane's commits
never overlap: the device lane waits for the previous step's commits (the fence),
and the output lane reclaims a step only after the device lane has finished it.
A dropped request may still sit in a step in flight: its rows get no mask (its
tokens are discarded by the engine anyway).

A matcher that cannot follow its grammar any more (llguidance's per-step limits:
lexer fuel, Earley items) is never left behind silently: the request is marked
failed, its matcher dropped, and the output lane reports the failure in place
of the tokens of the first step it reclaims for that request (`take_failures`),
so no unconstrained token reaches the client. Compiled grammars are kept by
their text (`MAX_CACHED`): a repeated schema is a copy, not a compile.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch
from llguidance import LLExecutor, LLMatcher, LLTokenizer

from laneserve.protocol import RequestOutput
from laneserve.structured.bitmask import words_for
from laneserve.structured.fence import CommitFence
from laneserve.structured.grammar import grammar_text, parser_limits
from laneserve.structured.params import StructuredOutputsParams

log = logging.getLogger(__name__)

MAX_CACHED = 64  # compiled grammars kept by their text (fresh matchers, copied per request)


@dataclass
class MaskRow:
    """One sampling row of a step that carries a grammar."""

    handle: int
    first: int  # its first logits row (position 0); draft i's row is first + 1 + i
    drafts: list[int] = field(default_factory=list)  # the drafts it verifies


class GrammarBook:
    def __init__(self, tokenizer_file: Path, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.tokenizer_file = tokenizer_file
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.fence = CommitFence()
        self._tokenizer: LLTokenizer | None = None  # built on first use (~1 s)
        self._executor: LLExecutor | None = None
        self._matchers: dict[int, LLMatcher] = {}
        self._compiled: OrderedDict[str, LLMatcher] = OrderedDict()  # text -> fresh matcher
        self._lock = threading.Lock()  # _failures: device and output lanes
        self._failures: dict[int, str] = {}

    def add(self, handle: int, params: StructuredOutputsParams) -> None:
        """ValueError (this request's alone) when its grammar does not compile."""
        self._matchers[handle] = self._compile(grammar_text(params)).deep_copy()

    def _compile(self, text: str) -> LLMatcher:
        cached = self._compiled.get(text)
        if cached is not None:
            self._compiled.move_to_end(text)
            return cached
        tokenizer = self._llg_tokenizer()
        try:
            matcher = LLMatcher(tokenizer, text, log_level=0, limits=parser_limits())
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # NOTE: a panic fails this request alone
            message = f"structured_outputs: the grammar engine failed: {_first_line(e)}"
            raise ValueError(message) from None
        if matcher.is_error():  # NOTE: validated on the host that took the request
            raise ValueError(f"structured_outputs: {matcher.get_error()}")
        self._compiled[text] = matcher
        if len(self._compiled) > MAX_CACHED:
            self._compiled.popitem(last=False)
        return matcher

    def drop(self, handles: list[int]) -> None:
        for handle in handles:
            self._matchers.pop(handle, None)
        with self._lock:
            for handle in handles:
                self._failures.pop(handle, None)

    def _fail(self, handle: int, matcher: LLMatcher | None, error: str = "") -> None:
        if matcher is not None:
            error = (matcher.get_error() or "unknown error").splitlines()[0]
        log.warning(
            "request %d: the grammar engine cannot follow its constraint: %s", handle, error
        )
        self._matchers.pop(handle, None)
        with self._lock:
            self._failures[handle] = (
                f"structured_outputs: the grammar engine could not follow the constraint "
                f"({error}); the request was stopped rather than left unconstrained"
            )

    def take_failures(self, handles: list[int]) -> dict[int, str]:
        """The failed requests among `handles` (each reported once)."""
        with self._lock:
            return {h: self._failures.pop(h) for h in handles if h in self._failures}

    def constrains(self, handles: list[int]) -> bool:
        return bool(self._matchers) and any(h in self._matchers for h in handles)

    def commit(self, outputs: list[RequestOutput]) -> None:
        """Advance each matcher by its request's emitted tokens (output lane)."""
        for out in outputs:
            matcher = self._matchers.get(out.handle)
            if matcher is None or not out.token_ids:
                continue
            try:
                follows = _follows(matcher, out.token_ids)
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as e:  # NOTE: a panic fails this request alone
                self._fail(out.handle, None, _first_line(e))
                continue
            if not follows:
                self._fail(out.handle, matcher)

    def bitmask(self, rows: list[MaskRow], num_rows: int) -> torch.Tensor:
        """[num_rows, ceil(V / 32)] int32 on the host: every bit set (all allowed) except
        in the grammar rows' position-0 and draft rows. Waits for earlier commits."""
        self.fence.wait()
        mask = torch.full((num_rows, words_for(self.vocab_size)), -1, dtype=torch.int32)
        plain: list[tuple[int, tuple]] = []  # (handle, executor entry)
        with_drafts: list[tuple[int, tuple]] = []
        for r in rows:
            matcher = self._matchers.get(r.handle)
            # NOTE: a stopped matcher (its grammar complete) still masks: EOS only
            if matcher is None or matcher.is_error():
                continue
            if r.drafts:
                with_drafts.append((r.handle, (matcher, r.first, r.drafts)))
            else:
                plain.append((r.handle, (matcher, r.first)))
        dest = (mask.data_ptr(), mask.shape[1] * mask.element_size(), num_rows)
        if plain:
            self._masks(plain, dest, drafts=False)
        if with_drafts:
            self._masks(with_drafts, dest, drafts=True)
        for r in rows:  # NOTE: a matcher that ran out of its limits computing this mask
            matcher = self._matchers.get(r.handle)
            if matcher is not None and matcher.is_error():
                self._fail(r.handle, matcher)
        return mask

    def _masks(self, entries: list[tuple[int, tuple]], dest: tuple, drafts: bool) -> None:
        """Masks of all `entries` in one call; if the grammar engine fails (a panic),
        one by one, so that only the requests whose masks fail are failed."""
        ex = self._llg_executor()
        compute = (
            ex.unsafe_compute_mask_ptr_with_draft_token if drafts else ex.unsafe_compute_mask_ptr
        )
        try:
            compute([e for _, e in entries], *dest)
            return
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException:
            log.warning("the grammar engine failed on a batch of masks; retrying one by one")
        for handle, entry in entries:
            try:
                compute([entry], *dest)
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as e:
                self._fail(handle, None, f"the mask computation failed: {_first_line(e)}")

    def _llg_tokenizer(self) -> LLTokenizer:
        if self._tokenizer is None:
            if not self.tokenizer_file.is_file():
                raise ValueError(f"structured output needs {self.tokenizer_file}")
            self._tokenizer = LLTokenizer(
                str(self.tokenizer_file), n_vocab=self.vocab_size, eos_token=self.eos_token_ids
            )
        return self._tokenizer

    def _llg_executor(self) -> LLExecutor:
        if self._executor is None:
            self._executor = LLExecutor()
        return self._executor


def _follows(matcher: LLMatcher, tokens: list[int]) -> bool:
    """Consume `tokens`; False when the matcher cannot (or could not already)."""
    if matcher.is_error():
        return False
    # NOTE: a stopped matcher is complete: the EOS that follows needs no check
    return matcher.is_stopped() or matcher.consume_tokens(tokens)


def _first_line(e: BaseException) -> str:
    text = str(e)
    return text.splitlines()[0] if text else type(e).__name__
