"""Structured outputs on llguidance: a request's constraint compiled once into a matcher that
follows its tokens, and the batch's allowed-token bitmask.

llguidance over xgrammar (both are vLLM backends): no dependencies (7.6 MB installed, where
xgrammar pulls triton and tvm-ffi, ~1 GB, on Linux x86-64), a JSON schema compile of ~1.5 ms
here and a mask of ~20 us a row; it refuses a schema keyword it cannot enforce instead of
ignoring it. The measurements: docs/results/structured-outputs/.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import llguidance
import llguidance.hf
from llguidance.gbnf_to_lark import any_to_lark

from conveyor.sampling_params import StructuredOutputsParams

CACHE_SIZE = 1024  # compiled grammars kept (a template matcher each, a few KB to a few MB)


def bitmask_width(vocab_size: int) -> int:
    """32-bit words per row of a token bitmask."""
    return (vocab_size + 31) // 32


@dataclass
class GrammarStats:
    matchers: int = 0  # one per constrained sample
    compiles: int = 0  # the rest of the matchers came from the cache
    compile_seconds: deque[float] = field(default_factory=lambda: deque(maxlen=10_000))
    compile_seconds_total: float = 0.0

    @property
    def hit_rate(self) -> float:
        return 1 - self.compiles / self.matchers if self.matchers else 0.0


_WHAT = {"json": "JSON schema", "json_object": "JSON object", "regex": "regular expression",
         "choice": "choice", "grammar": "grammar"}


def _template(spec: StructuredOutputsParams, tokenizer: llguidance.LLTokenizer
              ) -> llguidance.LLMatcher:
    """A constraint's compiled matcher at its start; ValueError naming what is wrong when it
    cannot be enforced."""
    def refused(why: object) -> ValueError:
        return ValueError(f"this {_WHAT[spec.kind]} cannot be enforced: {why}")

    try:
        grammar = _grammar(spec)
    except ValueError:
        raise
    except Exception as e:  # llguidance's own refusals of a malformed spec
        raise refused(e) from e
    error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
    if error:
        raise refused(error)
    template = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    if template.is_error():
        raise refused(template.get_error())
    return template


def _grammar(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar of a constraint (not yet checked)."""
    options = {"whitespace_flexible": not spec.disable_any_whitespace}
    if spec.whitespace_pattern is not None and not spec.disable_any_whitespace:
        options["whitespace_pattern"] = spec.whitespace_pattern
    if spec.json is not None:
        return llguidance.LLMatcher.grammar_from_json_schema(spec.json, defaults=options)
    if spec.json_object:
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"},
                                                             defaults=options)
    if spec.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if spec.choice is not None:  # JSON's string escapes are Lark's
        return llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choice))
    try:
        return llguidance.LLMatcher.grammar_from_lark(any_to_lark(spec.grammar))
    except Exception as e:  # the GBNF converter's own errors
        raise ValueError(f"this grammar is not valid GBNF or Lark: {e}") from e


class GrammarCompiler:
    """Compiles constraints for one tokenizer, caching by (kind, spec); thread-safe, since the
    server checks a request's constraint before queueing it and the engine thread builds its
    matchers."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None  # built on first use (~0.6 s)
        self._cache: OrderedDict[tuple, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self.stats = GrammarStats()

    def llg_tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            self._tokenizer = llguidance.hf.from_tokenizer(
                self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=self._eos)
        return self._tokenizer

    def compile(self, spec: StructuredOutputsParams) -> llguidance.LLMatcher:
        """The constraint's template matcher; ValueError naming what is wrong when it cannot
        be enforced. The compile runs outside the lock: a large schema being checked for the
        server holds up no other request's cached lookup on the engine thread."""
        with self._lock:
            template = self._cache.get(spec.key)
            if template is not None:
                self._cache.move_to_end(spec.key)
                return template
            tokenizer = self.llg_tokenizer()  # built once, under the lock
        start = time.perf_counter()
        template = _template(spec, tokenizer)
        seconds = time.perf_counter() - start
        with self._lock:
            self.stats.compiles += 1
            self.stats.compile_seconds.append(seconds)
            self.stats.compile_seconds_total += seconds
            self._cache[spec.key] = template
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return template

    def matcher(self, spec: StructuredOutputsParams) -> llguidance.LLMatcher:
        """A fresh matcher at the constraint's start (a copy shares the compiled grammar)."""
        template = self.compile(spec)
        with self._lock:
            self.stats.matchers += 1
        return template.deep_copy()


class BatchBitmask:
    """Fills the allowed-token bitmask of a step's constrained rows, on llguidance's own
    threads (the GIL is released), so the runner can do it while the model runs."""

    def __init__(self) -> None:
        self._executor = llguidance.LLExecutor()

    def fill(self, matchers: list[llguidance.LLMatcher], out) -> None:
        """out: a C-contiguous int32 torch tensor [len(matchers), bitmask_width]."""
        self._executor.unsafe_compute_mask_ptr(
            [(m, i) for i, m in enumerate(matchers)], out.data_ptr(), out.shape[1] * 4,
            len(matchers))


class UnsatisfiableConstraint(ValueError):
    """The constraint needs text this model's tokenizer cannot write (a regex asking for a
    character none of its tokens holds, say): the request's own fault, found while it runs."""


def consume(matcher: llguidance.LLMatcher, token_id: int) -> None:
    """Advance a matcher by a sampled token. The mask only allows tokens the grammar takes, so a
    refusal means the grammar forces bytes the vocabulary lacks (llguidance's mask then
    offers the nearest token it has)."""
    if not matcher.consume_token(token_id):
        raise UnsatisfiableConstraint(
            f"the output's constraint cannot be satisfied with this model's vocabulary "
            f"({matcher.get_error().splitlines()[0]})")
