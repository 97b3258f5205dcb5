"""A GGUF file's tokenizer as a ``tokenizers`` tokenizer (what a tokenizer.json describes).

A GGUF file stores a byte-level BPE tokenizer as lists (``dspark_ray.model.gguf.TokenizerSpec``):
the tokens in id order, the merges best first, a type per token, the special ids and whether
BOS/EOS are added. What it does not store is the pre-tokenizer, the rule that cuts text into
words before BPE; it names it instead (``tokenizer.ggml.pre``), and llama.cpp maps each name to
the splitting rules of the original tokenizer. ``PRE_TOKENIZERS`` holds those rules for the
families served here, written as the ``tokenizers`` library writes them in a tokenizer.json, so
the result encodes text as the original checkpoint's tokenizer.json does.

Tokens typed CONTROL (``<|im_start|>``) become special added tokens, USER_DEFINED ones
(``<think>``) plain added tokens: both are matched whole in text, never cut into pieces.
"""

from __future__ import annotations

from collections.abc import Callable

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from dspark_ray.model.gguf import TOKEN_CONTROL, TOKEN_USER_DEFINED, GgufError, TokenizerSpec

# Splitting rules, as llama.cpp's llama-vocab.cpp assigns them to tokenizer.ggml.pre values.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _gpt2() -> pre_tokenizers.PreTokenizer:
    """GPT-2's split ('s|'t|...| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+), built into ByteLevel."""
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _digits_then_gpt2() -> pre_tokenizers.PreTokenizer:
    """Every digit its own word, then GPT-2's split (StarCoder's and SmolLM's tokenizers)."""
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2()])


def _split(pattern: str) -> Callable[[], pre_tokenizers.PreTokenizer]:
    def build() -> pre_tokenizers.PreTokenizer:
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return build


PRE_TOKENIZERS: dict[str, Callable[[], pre_tokenizers.PreTokenizer]] = {
    **dict.fromkeys(("default", "gpt-2", "gpt2", "mpt", "olmo", "jais"), _gpt2),
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"),
                    _digits_then_gpt2),
    **dict.fromkeys(("llama-bpe", "llama3", "llama-v3", "falcon3", "smaug-bpe", "dbrx"), _split(_LLAMA3_SPLIT)),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "stablelm2", "megrez"), _split(_QWEN2_SPLIT)),
}
# Pre-tokenizers whose original tokenizer looks a whole word up before merging it (Llama 3's
# tokenizer.json sets BPE's ignore_merges; llama.cpp does the same for these).
_IGNORE_MERGES = frozenset(("llama-bpe", "llama3", "llama-v3", "falcon3", "smaug-bpe", "dbrx"))


def build_backend(spec: TokenizerSpec, name: str) -> BackendTokenizer:
    """The ``tokenizers`` tokenizer ``spec`` describes. Raises GgufError for a tokenizer model or
    pre-tokenizer not supported here, naming the metadata key and the supported values."""
    if spec.model != "gpt2":
        raise GgufError(f"{name}: tokenizer.ggml.model is {spec.model!r}; only 'gpt2' (byte-level BPE: Llama 3, "
                        "Qwen, SmolLM, Mistral Nemo ...) is supported. Serve the Hugging Face folder instead, "
                        "whose tokenizer.json works for every model")
    if spec.pre not in PRE_TOKENIZERS:
        raise GgufError(f"{name}: tokenizer.ggml.pre {spec.pre!r} is not supported; supported: "
                        f"{', '.join(sorted(PRE_TOKENIZERS))}")
    vocab = {token: i for i, token in enumerate(spec.tokens)}
    if len(vocab) != len(spec.tokens):
        raise GgufError(f"{name}: tokenizer.ggml.tokens lists {len(spec.tokens) - len(vocab)} token(s) twice")
    merges = [_merge(m, name) for m in spec.merges]
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False,
                                          ignore_merges=spec.pre in _IGNORE_MERGES))
    backend.pre_tokenizer = PRE_TOKENIZERS[spec.pre]()
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, kind in zip(spec.tokens, spec.token_types) if kind == TOKEN_CONTROL])
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, kind in zip(spec.tokens, spec.token_types) if kind == TOKEN_USER_DEFINED])
    backend.post_processor = _post_processor(spec, name)
    return backend


def _merge(merge: str, name: str) -> tuple[str, str]:
    left, sep, right = merge.partition(" ")
    if not sep or not left or not right:
        raise GgufError(f"{name}: tokenizer.ggml.merges holds {merge!r}, not a pair 'a b'")
    return left, right


def _post_processor(spec: TokenizerSpec, name: str) -> processors.PostProcessor:
    """BOS/EOS around every encoded text where the file asks for them (add_bos_token, add_eos_token)."""
    ends = []
    for wanted, token_id, key in ((spec.add_bos, spec.bos_id, "bos"), (spec.add_eos, spec.eos_ids[0], "eos")):
        if wanted and token_id is None:
            raise GgufError(f"{name}: tokenizer.ggml.add_{key}_token is set but no {key} token id is given")
        ends.append((spec.tokens[token_id], token_id) if wanted else None)
    bos, eos = ends
    if bos is None and eos is None:
        return processors.ByteLevel(trim_offsets=False)
    single = " ".join(p for p in (bos and f"{bos[0]}:0", "$A:0", eos and f"{eos[0]}:0") if p)
    pair = " ".join(p for p in (single, bos and f"{bos[0]}:1", "$B:1", eos and f"{eos[0]}:1") if p)
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=[e for e in ends if e])
