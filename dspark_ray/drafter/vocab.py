"""The draft's token choices, from the answers: its mask token and its reduced vocabulary.

- **Mask token**: a special (added) token that no prompt or answer holds and that is none of
  BOS, EOS, PAD, UNK: the block's queries after the anchor are that token's embedding.
- **Reduced vocabulary** (EAGLE-3, FR-Spec): the ``draft_vocab`` most frequent tokens of the
  target's own answers in the training split (the EOS ids always), ascending by id; the draft's
  LM head computes only those rows and ``d2t`` maps them back to the target's ids. How much of
  the answers' tokens they cover (the ceiling it puts on acceptance) is recorded.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from tokenizers import Tokenizer as BackendTokenizer


class VocabularyError(ValueError):
    """No token could serve as the draft's mask, or the vocabulary asked for is impossible."""


@dataclass(frozen=True)
class DraftVocabulary:
    mask_token_id: int
    ids: list[int] | None  # the reduced vocabulary's target ids, ascending; None: the whole vocabulary
    coverage: dict  # split -> share of answer tokens inside ``ids`` (1.0 without a reduction)

    def to_json(self) -> dict:
        return {"mask_token_id": self.mask_token_id, "ids": self.ids, "coverage": self.coverage}

    @classmethod
    def from_json(cls, raw: dict) -> DraftVocabulary:
        return cls(raw["mask_token_id"], raw["ids"], raw["coverage"])


def mask_token(tokenizer, rows: list[dict]) -> int:
    """The lowest-id added token no row uses and that is not BOS, EOS, PAD or UNK."""
    added = BackendTokenizer.from_str(tokenizer.backend_json()).get_added_tokens_decoder()
    vocab = tokenizer.get_vocab()
    reserved = {vocab[t] for t in tokenizer.special_tokens.values() if t in vocab} | set(tokenizer.eos_token_ids)
    used = {t for r in rows for t in (*r["prompt_ids"], *r["answer_ids"])}
    free = sorted(i for i in added if i not in used and i not in reserved)
    if not free:
        raise VocabularyError("no special token is free to be the draft's mask token (every added token is used "
                              "or reserved); give mask_token_id in the recipe settings")
    return free[0]


def reduced_ids(rows: list[dict], size: int, vocab_size: int, always: set[int]) -> list[int]:
    """The ``size`` most frequent answer tokens of ``rows`` (ties by id), with ``always`` among them;
    fewer distinct tokens than that: topped up with the lowest unused ids."""
    if not 1 <= size <= vocab_size:
        raise VocabularyError(f"draft_vocab {size} must be in 1..{vocab_size} (the target's vocabulary)")
    counts = Counter(t for r in rows for t in r["answer_ids"])
    ranked = sorted(counts, key=lambda t: (-counts[t], t))
    keep = list(dict.fromkeys([*sorted(always), *ranked]))[:size]
    if len(keep) < size:
        taken = set(keep)
        keep += [t for t in range(vocab_size) if t not in taken][:size - len(keep)]
    return sorted(keep)


def coverage(rows: list[dict], ids: list[int] | None) -> float:
    tokens = [t for r in rows for t in r["answer_ids"]]
    if ids is None or not tokens:
        return 1.0
    keep = set(ids)
    return round(sum(t in keep for t in tokens) / len(tokens), 5)


def choose(tokenizer, rows: list[dict], draft_vocab: int | None, vocab_size: int,
           mask_token_id: int | None = None) -> DraftVocabulary:
    """The mask token (``mask_token_id`` if given) and the reduced vocabulary (``draft_vocab`` ids;
    None or the whole vocabulary: no reduction) of the answers ``rows``."""
    mask = mask_token_id if mask_token_id is not None else mask_token(tokenizer, rows)
    train = [r for r in rows if r["split"] == "train"]
    ids = None
    if draft_vocab is not None and draft_vocab < vocab_size:
        ids = reduced_ids(train, draft_vocab, vocab_size, set(tokenizer.eos_token_ids))
    held = [r for r in rows if r["split"] == "heldout"]
    return DraftVocabulary(mask, ids, {"train": coverage(train, ids), "heldout": coverage(held, ids)})
