"""Structured outputs: a grammar the output must match, enforced token by token.

The grammar engine is llguidance (used by vLLM, SGLang and llama.cpp): it
compiles JSON schemas, regular expressions, choice lists and Lark/GBNF
grammars and computes the set of allowed next tokens, with roll-back, which
speculation needs. Measured against xgrammar on this project's tokenizer
(``bench/grammar_engines.py``, both from vLLM's environment, same machine,
same run): xgrammar's per-token masks are faster (median ~3 us against
4-15 us, p99 ~5 us against 40-75 us for a fresh matcher), llguidance
compiles JSON grammars faster cold (0.4-0.5 ms against 1-4 ms), and both
agree on every position but where llguidance allows only the canonical
tokenization of forced text. At tens of microseconds per row either is small
next to a step (``bench/structured.py``: 0.3 ms of a ~6 ms step at batch
1). llguidance was chosen because it has no dependencies: xgrammar pulls
transformers, triton and apache-tvm-ffi into the serving install.

How speculation stays lossless (the engine module docstring has the step):

- The engine keeps one ``Grammar`` per request (never per batch row): a
  matcher that has consumed exactly the request's committed output.
- Before a verification it walks the row's draft tokens through the matcher,
  recording the allowed-token bitmask at every scored position; the first
  draft token the grammar forbids ends the draft there (the target would
  reject it anyway: its probability under the masked target is 0). Then it
  rolls the matcher back. The target applies the masks to its logits before
  anything else, so greedy output is the argmax of the masked target and
  sampled output follows the masked target distribution, draft or no draft.
- Committed tokens advance the matcher; a grammar that is complete (it
  allows nothing but the end) ends the request with ``stop``.
- The draft proposer keeps its own matcher per slot (``SlotGrammars``),
  synced to the committed output each call, and masks its own proposals the
  same way, so that its drafts are valid and get accepted.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from llguidance import LLMatcher, LLTokenizer

from dspark_ray.engine.errors import InvalidRequest

# What a request may ask for; ``spec`` is the text each kind is compiled from.
KINDS = ("json_schema", "json_object", "regex", "choice", "lark")

# Any JSON object (response_format {"type": "json_object"}).
_ANY_OBJECT = '{"type": "object"}'

# JSON is written compactly (", " and ": ", no other whitespace), as vLLM's
# disable-any-whitespace option does: with free whitespace a model can pad
# forever inside an object and never close it (small models do). A schema's
# own "x-guidance" options override these.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class StructuredOutput:
    """What a request's output must match.

    ``kind`` is one of ``KINDS``; ``spec`` the JSON schema (JSON text), the
    regular expression, the JSON list of choices, or the Lark grammar;
    ``field`` names the request field it came from, for error messages.
    """

    kind: str
    spec: str = ""
    field: str = "structured_outputs"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidRequest(self.field, f"unknown structured output kind {self.kind!r}; "
                                             f"one of {', '.join(KINDS)}")
        if not isinstance(self.spec, str):
            raise InvalidRequest(self.field, "the grammar must be given as text")

    @classmethod
    def json_schema(cls, schema: dict | str | bool, field: str = "response_format") -> StructuredOutput:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise InvalidRequest(field, f"the JSON schema is not valid JSON: {exc}") from None
        if not isinstance(schema, (dict, bool)):
            raise InvalidRequest(field, "the JSON schema must be a JSON object")
        return cls("json_schema", json.dumps(schema, sort_keys=True), field)

    @classmethod
    def choice(cls, choices: Sequence[str], field: str = "guided_choice") -> StructuredOutput:
        if not choices or not all(isinstance(c, str) and c for c in choices):
            raise InvalidRequest(field, "must be a non-empty list of non-empty strings")
        return cls("choice", json.dumps(list(choices)), field)

    def grammar(self) -> str:
        """The llguidance grammar (raises InvalidRequest for a spec it cannot take)."""
        if self.kind == "json_object":
            return LLMatcher.grammar_from_json_schema(_ANY_OBJECT, defaults=JSON_OPTIONS)
        if self.kind == "json_schema":
            return LLMatcher.grammar_from_json_schema(self.spec, defaults=JSON_OPTIONS)
        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.spec)
        if self.kind == "lark":
            return LLMatcher.grammar_from_lark(self.spec)
        choices = json.loads(self.spec)
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))


class GrammarCompiler:
    """Compiles structured-output specs against one tokenizer (one per process, built lazily).

    ``tokenizer_json``: the tokenizer.json text; ``vocab_size``: ids are in
    ``[0, vocab_size)``; ``eos_ids``: the ids that end generation (a complete
    grammar allows them and nothing else).
    """

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: Sequence[int]) -> None:
        self.vocab_size = vocab_size
        self.tokenizer = LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=sorted(eos_ids))
        self.words = (vocab_size + 31) // 32  # int32 words per bitmask row
        self.eos_ids = frozenset(eos_ids)
        self._checked: dict[StructuredOutput, str] = {}  # spec -> its grammar, for specs that compiled

    @classmethod
    def of(cls, tokenizer) -> GrammarCompiler:
        """For a ``dspark_ray.tokenizer.Tokenizer``."""
        return cls(tokenizer.backend_json(), tokenizer.vocab_size, tokenizer.eos_token_ids)

    def check(self, spec: StructuredOutput) -> str:
        """The spec's grammar, validated; InvalidRequest naming the field otherwise."""
        grammar = self._checked.get(spec)
        if grammar is not None:
            return grammar
        try:
            grammar = spec.grammar()
        except (ValueError, TypeError) as exc:
            raise InvalidRequest(spec.field, f"cannot be compiled: {exc}") from None
        error = LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise InvalidRequest(spec.field, f"cannot be compiled: {_one_line(error)}")
        try:
            self.matcher(grammar).masks([])
        except GrammarError:
            raise InvalidRequest(spec.field, "no output can match it (the grammar allows no first token)") from None
        if len(self._checked) >= 256:
            self._checked.pop(next(iter(self._checked)))
        self._checked[spec] = grammar
        return grammar

    def matcher(self, grammar: str) -> Grammar:
        return Grammar(LLMatcher(self.tokenizer, grammar, log_level=0), self.words, grammar, self.eos_ids)


# How the error of a request whose grammar could not go on begins (the server answers it with a 400).
GRAMMAR_ERROR = "structured output:"


class GrammarError(RuntimeError):
    """The grammar allows no token here, or a committed token broke it."""


class Grammar:
    """One request's matcher: it has consumed exactly the tokens ``accept`` was given."""

    def __init__(self, matcher: LLMatcher, words: int, source: str, eos_ids: frozenset[int]) -> None:
        self.matcher = matcher
        self.words = words
        self.eos_ids = eos_ids
        self.source = source  # the grammar text (the draft proposer compiles its own matcher from it)
        self.consumed = 0

    def masks(self, drafts: Sequence[int]) -> tuple[torch.Tensor, int]:
        """Bitmasks at the scored positions of a verification, and how many drafts the grammar allows.

        Position j follows the committed output plus ``drafts[:j]``. The walk
        stops at the first forbidden draft token, so the result has
        ``n + 1`` rows for ``n`` allowed drafts. The matcher ends where it began.

        An EOS draft is checked but not consumed (llguidance's roll-back does
        not count a consumed EOS), and nothing after it is scored by the
        grammar: if it is accepted the request ends there.
        """
        out = torch.empty((len(drafts) + 1, self.words), dtype=torch.int32)  # [J, W]
        n = consumed = 0
        try:
            fill_mask(self.matcher, out[0])
            for tok in drafts:
                if not allowed(out[n], tok):
                    break
                if tok in self.eos_ids:
                    n += 1
                    out[n] = -1  # all allowed: a position after the end is never used
                    break
                if not self.matcher.consume_token(tok):
                    break
                n = consumed = n + 1
                fill_mask(self.matcher, out[n])
        finally:
            if consumed:
                self.matcher.rollback(consumed)
        if not self._can_go_on(out[0]):
            raise GrammarError("the grammar allows no token here: the output so far cannot be completed to "
                               "match it")
        return out[: n + 1], n

    def _can_go_on(self, mask: torch.Tensor) -> bool:
        """A token other than EOS is allowed, or the grammar is satisfied (EOS ends it rightly).
        llguidance allows EOS where nothing else can follow, even in a dead end."""
        if self.matcher.is_accepting():
            return bool(mask.any())
        eos_words: dict[int, int] = {}  # word -> its EOS bits
        for t in self.eos_ids:
            eos_words[t >> 5] = eos_words.get(t >> 5, 0) | (1 << (t & 31))
        for w in mask.nonzero().flatten().tolist():
            if (int(mask[w]) & 0xFFFFFFFF) & ~eos_words.get(w, 0):
                return True
        return False

    def accept(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise GrammarError(self.error() or f"token {token} is not allowed by the grammar")
        self.consumed += 1

    @property
    def complete(self) -> bool:
        """The grammar is satisfied and allows nothing further (but the end)."""
        return self.matcher.is_stopped() and not self.matcher.is_error()

    def error(self) -> str:
        return _one_line(self.matcher.get_error()) if self.matcher.is_error() else ""


def allowed(mask: torch.Tensor, token: int) -> bool:
    """Whether ``token``'s bit is set in one bitmask row ([W] int32)."""
    word = token >> 5
    return 0 <= word < mask.shape[0] and bool((int(mask[word]) >> (token & 31)) & 1)


def unpack(masks: torch.Tensor, vocab: int) -> torch.Tensor:
    """[..., W] int32 bitmasks -> [..., vocab] bool (ids past the mask's width: not allowed)."""
    bits = (masks[..., None] >> torch.arange(32, dtype=torch.int32, device=masks.device)) & 1  # [..., W, 32]
    flat = bits.flatten(-2).bool()  # [..., 32 W]
    width = flat.shape[-1]
    if width >= vocab:
        return flat[..., :vocab]
    return torch.nn.functional.pad(flat, (0, vocab - width), value=False)


def apply_masks(
    logits: torch.Tensor,  # [B, J, V] float32, changed in place
    masks: Sequence[torch.Tensor | None],  # per row: [J_b, W] int32 for its first J_b positions, or None
) -> torch.Tensor:
    """Forbidden ids to -inf at every masked position (positions past a row's masks are unused)."""
    rows = [b for b, m in enumerate(masks) if m is not None]
    if not rows:
        return logits
    B, J, V = logits.shape
    words = max(masks[b].shape[1] for b in rows)
    packed = torch.full((len(rows), J, words), -1, dtype=torch.int32)  # -1: every id allowed
    for i, b in enumerate(rows):
        m = masks[b][:J]
        packed[i, :m.shape[0], :m.shape[1]] = m
    keep = unpack(packed.to(logits.device), V)  # [R, J, V]; one pass for all rows
    idx = torch.tensor(rows, device=logits.device)
    logits[idx] = logits[idx].masked_fill(~keep, float("-inf"))
    return logits


class SlotGrammars:
    """The draft proposer's matchers, one per slot, each synced to its request's committed output.

    A row carries its grammar text and its output so far; a matcher is kept
    per slot (and epoch) and only rolled back / advanced by the difference,
    so a long output is not re-parsed every step.
    """

    def __init__(self, compiler_factory) -> None:
        self._factory = compiler_factory
        self._compiler: GrammarCompiler | None = None
        self._slots: dict[int, tuple[int, str, Grammar, list[int]]] = {}  # slot -> (epoch, grammar, matcher, tokens)

    def sync(self, slot: int, epoch: int, grammar: str, output: Sequence[int]) -> Grammar | None:
        """The slot's matcher, having consumed exactly ``output``; None if the output breaks the
        grammar (then the drafts go unmasked: the target's masks decide what is emitted)."""
        entry = self._slots.get(slot)
        if entry is None or entry[0] != epoch or entry[1] != grammar:
            if self._compiler is None:
                self._compiler = self._factory()
            entry = (epoch, grammar, self._compiler.matcher(grammar), [])
            self._slots[slot] = entry
        _, _, g, tokens = entry
        common = 0
        for a, b in zip(tokens, output):
            if a != b:
                break
            common += 1
        if common < len(tokens):
            g.matcher.rollback(len(tokens) - common)
            del tokens[common:]
        for tok in output[common:]:
            if not g.matcher.consume_token(tok):
                del self._slots[slot]
                return None
            tokens.append(tok)
        return g

    def drop(self, slots: Sequence[int]) -> None:
        for s in slots:
            self._slots.pop(s, None)


def fill_mask(matcher: LLMatcher, row: torch.Tensor) -> None:
    """The matcher's allowed next tokens into ``row`` ([W] int32, contiguous, on the CPU).

    What ``llguidance.torch.fill_next_token_bitmask`` does, without importing
    that module (it pulls in torch.compile: seconds of start-up)."""
    matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())


def _one_line(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()[:300]
