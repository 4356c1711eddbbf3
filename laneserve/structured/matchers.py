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
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
from llguidance import LLExecutor, LLMatcher, LLTokenizer

from laneserve.protocol import RequestOutput
from laneserve.structured.bitmask import words_for
from laneserve.structured.fence import CommitFence
from laneserve.structured.grammar import grammar_text
from laneserve.structured.params import StructuredOutputsParams

log = logging.getLogger(__name__)


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

    def add(self, handle: int, params: StructuredOutputsParams) -> None:
        matcher = LLMatcher(self._llg_tokenizer(), grammar_text(params), log_level=0)
        if matcher.is_error():  # NOTE: validated on the host that took the request
            raise ValueError(f"structured_outputs: {matcher.get_error()}")
        self._matchers[handle] = matcher

    def drop(self, handles: list[int]) -> None:
        for handle in handles:
            self._matchers.pop(handle, None)

    def constrains(self, handles: list[int]) -> bool:
        return bool(self._matchers) and any(h in self._matchers for h in handles)

    def commit(self, outputs: list[RequestOutput]) -> None:
        """Advance each matcher by its request's emitted tokens (output lane)."""
        for out in outputs:
            matcher = self._matchers.get(out.handle)
            # NOTE: a stopped matcher is complete: the EOS that follows needs no check
            if matcher is None or not out.token_ids or matcher.is_error() or matcher.is_stopped():
                continue
            if not matcher.consume_tokens(out.token_ids):
                log.warning("request %d left its grammar: %s", out.handle, matcher.get_error())

    def bitmask(self, rows: list[MaskRow], num_rows: int) -> torch.Tensor:
        """[num_rows, ceil(V / 32)] int32 on the host: every bit set (all allowed) except
        in the grammar rows' position-0 and draft rows. Waits for earlier commits."""
        self.fence.wait()
        mask = torch.full((num_rows, words_for(self.vocab_size)), -1, dtype=torch.int32)
        plain, with_drafts = [], []
        for r in rows:
            matcher = self._matchers.get(r.handle)
            # NOTE: a stopped matcher (its grammar complete) still masks: EOS only
            if matcher is None or matcher.is_error():
                continue
            if r.drafts:
                with_drafts.append((matcher, r.first, r.drafts))
            else:
                plain.append((matcher, r.first))
        row_bytes, ptr, ex = mask.shape[1] * mask.element_size(), mask.data_ptr(), None
        if plain:
            ex = ex or self._llg_executor()
            ex.unsafe_compute_mask_ptr(plain, ptr, row_bytes, num_rows)
        if with_drafts:
            ex = ex or self._llg_executor()
            ex.unsafe_compute_mask_ptr_with_draft_token(with_drafts, ptr, row_bytes, num_rows)
        return mask

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
