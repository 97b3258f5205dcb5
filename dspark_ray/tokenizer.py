"""The tokenizer of a checkpoint folder: text <-> token ids, chat templates, EOS.

A Hugging Face checkpoint spreads its tokenizer over three files:

- ``tokenizer.json``: the tokenizer proper, run by the ``tokenizers`` library;
- ``tokenizer_config.json``: the named special tokens (bos/eos/unk/pad) and the
  ``chat_template`` (a jinja2 template; a separate ``chat_template.jinja`` file
  overrides it, as transformers saves it). Which special tokens ``encode``
  adds is up to tokenizer.json's post-processor alone, as in transformers 5,
  which ignores tokenizer_config.json's add_bos_token/add_eos_token;
- ``generation_config.json``: ``eos_token_id``, one id or a list of ids, which
  end generation (chat models often stop on several).

Chat templates come from checkpoint files, so they are untrusted code: they
are rendered in jinja2's ``ImmutableSandboxedEnvironment`` with the same
options and helpers transformers uses, and only plain JSON data (dicts, lists,
strings, numbers) is handed to them.

``IncrementalDecoder`` turns a stream of token ids into a stream of text that
never splits a multi-byte character; its pieces concatenate to ``decode`` of
all the ids.

``check_compatible`` guards speculative decoding: the draft proposes token ids
that the target verifies, so both must give every id the same meaning.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Iterable, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
import jinja2.utils
from tokenizers import Tokenizer as BackendTokenizer

from dspark_ray.model.checkpoint import is_gguf, locate
from dspark_ray.model.errors import CheckpointFileMissing

log = logging.getLogger(__name__)

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")

# A piece of decoded text ending in this character may be a multi-byte
# character whose remaining bytes are still to come.
_REPLACEMENT_CHAR = "\ufffd"


class TokenizerError(Exception):
    """The tokenizer files are inconsistent, or an input cannot be tokenized."""


class ChatTemplateError(TokenizerError):
    """The chat template is absent, malformed, unsafe, or rejected the messages."""


class TokenizerMismatch(TokenizerError):
    """A draft model's tokenizer gives token ids other meanings than the target's."""


class Tokenizer:
    """Encode, decode and render chats for one checkpoint folder.

    Build it with ``Tokenizer.from_path(folder)``. Attributes:
        vocab_size: every id this tokenizer produces is in ``[0, vocab_size)``.
        special_tokens: the named special tokens present, e.g.
            ``{"bos_token": "<s>", "eos_token": "</s>"}``.
        eos_token_ids: the ids that end generation.
        chat_template: the jinja2 source, or None if the checkpoint has none.
    """

    def __init__(
        self,
        backend: BackendTokenizer,
        special_tokens: Mapping[str, str],
        eos_token_ids: Iterable[int],
        chat_template: str | None = None,
        name: str = "tokenizer",
    ) -> None:
        self.name = name
        self._backend = backend
        vocab = backend.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1 if vocab else 0
        for key, token in special_tokens.items():
            if token not in vocab:
                raise TokenizerError(
                    f"{name}: {key} {token!r} is not in the vocabulary; "
                    "fix tokenizer_config.json or add the token to tokenizer.json"
                )
        self.special_tokens = dict(special_tokens)
        self.eos_token_ids = frozenset(eos_token_ids)
        bad = sorted(i for i in self.eos_token_ids if not 0 <= i < self.vocab_size)
        if bad:
            raise TokenizerError(
                f"{name}: EOS id(s) {bad} are outside the vocabulary [0, {self.vocab_size}); "
                "fix eos_token_id in generation_config.json"
            )
        self.chat_template = chat_template
        self._template = _compile_chat_template(chat_template, name) if chat_template is not None else None

    @classmethod
    def from_path(cls, path: str | Path) -> Tokenizer:
        """Load the tokenizer of the checkpoint folder at ``path``, or of a GGUF file (built from its
        metadata: ``dspark_ray.tokenizer_gguf``).

        Raises:
            CheckpointFileMissing: no folder, or no tokenizer.json in it.
            GgufError: a GGUF file without a tokenizer, or with one not supported here.
            TokenizerError: a file is malformed, a special token or EOS id is
                unknown, or no EOS is given anywhere.
            ChatTemplateError: the chat template does not parse.
        """
        path = locate(path)
        if is_gguf(path):
            return _from_gguf(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise CheckpointFileMissing(
                f"{tok_file} not found: the checkpoint folder needs the fast tokenizer file "
                "tokenizer.json (convert a sentencepiece tokenizer.model with transformers' "
                "AutoTokenizer.from_pretrained(...).save_pretrained(...))"
            )
        try:
            backend = BackendTokenizer.from_file(str(tok_file))
        except Exception as exc:  # the Rust side raises a bare Exception
            raise TokenizerError(f"{tok_file} cannot be read by the tokenizers library: {exc}") from exc
        config = _read_json(path / "tokenizer_config.json")
        special = _special_tokens(config)
        _warn_on_contradicting_flags(backend, config, special, path)
        eos_ids = _eos_token_ids(path, backend, special)
        return cls(backend, special, eos_ids, _chat_template(path, config), name=str(path))

    @property
    def bos_token_id(self) -> int | None:
        return self._special_id("bos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._special_id("pad_token")

    def _special_id(self, key: str) -> int | None:
        token = self.special_tokens.get(key)
        return None if token is None else self._backend.token_to_id(token)

    def backend_json(self) -> str:
        """The tokenizer as tokenizer.json text (what grammar engines build their token tables from)."""
        return self._backend.to_str()

    def get_vocab(self) -> dict[str, int]:
        """Token string -> id, added tokens included."""
        return self._backend.get_vocab(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; with ``add_special_tokens`` the BOS/EOS the checkpoint asks for."""
        if not isinstance(text, str):
            raise TokenizerError(f"encode takes a str, got {type(text).__name__}")
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """The text of ``ids``; special tokens (BOS, EOS, ...) left out unless asked for."""
        ids = list(ids)
        bad = [i for i in ids if not (isinstance(i, int) and 0 <= i < self.vocab_size)]
        if bad:
            raise TokenizerError(
                f"cannot decode token id(s) {bad[:8]}: ids must be ints in [0, {self.vocab_size}); "
                "does the model's vocabulary match this tokenizer?"
            )
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, **kwargs: Any) -> str:
        """Render ``messages`` (``[{"role": ..., "content": ...}, ...]``) with the chat template.

        With ``add_generation_prompt`` the text ends with the header that starts
        the assistant's reply. The result is text; encode it with
        ``add_special_tokens=False``, since templates write their own BOS.
        ``tools`` (OpenAI's ``[{"type": "function", "function": {...}}]``) go to
        templates that describe tools to the model; ``kwargs`` are further
        template variables (e.g. ``enable_thinking``), plain data only.

        Raises:
            ChatTemplateError: no template, messages that are not a list of
                dicts of plain data, or the template failed or raised.
        """
        if self._template is None:
            raise ChatTemplateError(
                f"{self.name} has no chat template: add a 'chat_template' to tokenizer_config.json "
                "(or a chat_template.jinja file), or use the completions API with plain text"
            )
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise ChatTemplateError("messages must be a list of dicts such as {'role': 'user', 'content': 'Hi'}")
        # As transformers does: keys whose value is None are dropped, since
        # templates test for a key's presence, not for None.
        plain = [{k: _plain_data(v) for k, v in m.items() if v is not None} for m in messages]
        try:
            return self._template.render(
                **{k: _plain_data(v) for k, v in kwargs.items()},
                messages=plain,
                add_generation_prompt=add_generation_prompt,
                tools=_plain_data(tools) if tools else None,
                documents=None,
                **self.special_tokens,
            )
        except Exception as exc:  # untrusted code: any failure is the template's, reported as such
            raise ChatTemplateError(f"the chat template of {self.name} failed: {type(exc).__name__}: {exc}") from exc


class IncrementalDecoder:
    """Text for a stream of token ids, released only as complete characters.

    Byte-level tokenizers may split one character (an emoji, an accented
    letter) over several tokens, and decoders such as SentencePiece's drop the
    leading space of a sequence's first token, so a token's text depends on its
    neighbours. The decoder therefore decodes a short window of ids: the ids
    whose text was already released (``prefix``) and the new ones, and releases
    the difference, holding it back while it ends in U+FFFD, the mark of a
    character whose bytes have not all arrived.

    ``push`` the ids as they come, then ``finish`` once: the released pieces
    concatenate to ``tokenizer.decode(all_ids, skip_special_tokens)``.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0  # start of the window: ids before it are settled
        self._read = 0  # ids before this have had their text released

    def push(self, ids: int | Iterable[int]) -> str:
        """Add one id or several; return the text they complete (often '')."""
        self.ids.extend([ids] if isinstance(ids, int) else ids)
        prefix_text, window_text = self._window()
        if window_text.endswith(_REPLACEMENT_CHAR) or len(window_text) <= len(prefix_text):
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        return window_text[len(prefix_text):]

    def finish(self) -> str:
        """Release whatever is held back, such as an incomplete character at the end."""
        prefix_text, window_text = self._window()
        self._prefix = self._read = len(self.ids)
        return window_text[len(prefix_text):]

    def _window(self) -> tuple[str, str]:
        decode = self.tokenizer.decode
        window = self.ids[self._prefix:]
        prefix_text = decode(window[: self._read - self._prefix], self.skip_special_tokens)
        return prefix_text, decode(window, self.skip_special_tokens)


def check_compatible(target: Tokenizer, draft: Tokenizer) -> None:
    """Raise TokenizerMismatch unless ``draft`` gives every token id the target's meaning.

    The draft proposes ids that the target verifies, so the two vocabularies
    (added tokens included) and the named special tokens must be the same.
    """
    problems = []
    if target.special_tokens != draft.special_tokens:
        problems.append(f"special tokens differ: target {target.special_tokens}, draft {draft.special_tokens}")
    t_vocab, d_vocab = target.get_vocab(), draft.get_vocab()
    if t_vocab != d_vocab:
        t_by_id = {i: t for t, i in t_vocab.items()}
        d_by_id = {i: t for t, i in d_vocab.items()}
        diff = sorted(i for i in t_by_id.keys() | d_by_id.keys() if t_by_id.get(i) != d_by_id.get(i))
        examples = ", ".join(f"id {i}: {t_by_id.get(i)!r} vs {d_by_id.get(i)!r}" for i in diff[:3])
        problems.append(
            f"vocabularies differ (target {len(t_vocab)} tokens, draft {len(d_vocab)}; "
            f"{len(diff)} ids differ, e.g. {examples})"
        )
    if problems:
        raise TokenizerMismatch(
            f"draft tokenizer {draft.name} is not the target's ({target.name}): " + "; ".join(problems)
            + ". A draft must share the target's tokenizer; pick a draft from the same model family."
        )


def _from_gguf(path: Path) -> Tokenizer:
    stat = path.stat()
    return _gguf_tokenizer(str(path.resolve()), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _gguf_tokenizer(path: str, size: int, mtime_ns: int) -> Tokenizer:
    """A GGUF file's tokenizer, built once per process (reading the metadata takes seconds); a
    Tokenizer is not changed by its users, so one object serves them all."""
    from dspark_ray.model.gguf import open_checkpoint
    from dspark_ray.tokenizer_gguf import build_backend

    spec = open_checkpoint(Path(path)).tokenizer_spec()
    special = {key: spec.tokens[i] for key, i in (("bos_token", spec.bos_id), ("eos_token", spec.eos_ids[0]),
                                                  ("unk_token", spec.unk_id), ("pad_token", spec.pad_id))
               if i is not None}
    return Tokenizer(build_backend(spec, str(path)), special, spec.eos_ids, spec.chat_template, name=str(path))


def _read_json(file: Path) -> dict:
    """The JSON object in ``file``, or {} if the file is absent."""
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise TokenizerError(f"{file} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise TokenizerError(f"{file} must hold a JSON object, got {type(data).__name__}")
    return data


def _special_tokens(config: dict) -> dict[str, str]:
    """Named special tokens from tokenizer_config.json: plain strings or AddedToken dicts."""
    special = {}
    for key in SPECIAL_TOKEN_NAMES:
        value = config.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if value is None:
            continue
        if not isinstance(value, str):
            raise TokenizerError(f"tokenizer_config.json: {key} must be a string, got {value!r}")
        special[key] = value
    return special


def _warn_on_contradicting_flags(backend: BackendTokenizer, config: dict, special: dict, path: Path) -> None:
    """Warn where tokenizer_config.json's add_bos/eos_token contradict tokenizer.json.

    Beside a tokenizer.json, transformers (5.x) ignores those flags: the
    post-processor in tokenizer.json alone decides what ``encode`` adds. So
    do we, but a contradiction is worth a line in the log.
    """
    added = backend.encode("", add_special_tokens=True).ids
    for flag, key in (("add_bos_token", "bos_token"), ("add_eos_token", "eos_token")):
        token = special.get(key)
        if flag not in config or token is None:
            continue
        adds = backend.token_to_id(token) in added
        if bool(config[flag]) != adds:
            log.warning(
                "%s: tokenizer_config.json sets %s=%s but tokenizer.json's post-processor %s %s; "
                "following tokenizer.json, as transformers does",
                path, flag, config[flag], "adds" if adds else "does not add", token,
            )


def _eos_token_ids(path: Path, backend: BackendTokenizer, special: dict) -> list[int]:
    """EOS ids from generation_config.json, else the tokenizer's eos_token."""
    gen = _read_json(path / "generation_config.json")
    eos = gen.get("eos_token_id")
    if eos is not None:
        ids = eos if isinstance(eos, list) else [eos]
        if not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise TokenizerError(
                f"{path / 'generation_config.json'}: eos_token_id must be an int or a non-empty "
                f"list of ints, got {eos!r}"
            )
        return ids
    token = special.get("eos_token")
    if token is not None:
        return [backend.token_to_id(token)]
    raise TokenizerError(
        f"{path} names no end-of-sequence token: set eos_token_id in generation_config.json "
        "or eos_token in tokenizer_config.json"
    )


def _chat_template(path: Path, config: dict) -> str | None:
    """The default chat template: chat_template.jinja, else tokenizer_config.json's."""
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if "default" not in named:
            raise ChatTemplateError(
                f"{path}/tokenizer_config.json has named chat templates {sorted(map(str, named))} "
                "but none called 'default'; name the one to use 'default'"
            )
        template = named["default"]
    if template is not None and not isinstance(template, str):
        raise ChatTemplateError(f"{path}/tokenizer_config.json: chat_template must be a string")
    return template


class _TemplateNamespace(jinja2.utils.Namespace):
    """jinja2's ``namespace()`` refusing underscore names, so templates cannot reach internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - jinja's signature, so namespace(self=1) works
        self, rest = args[0], args[1:]
        for name in dict(*rest, **kwargs):
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, *rest, **kwargs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check(name)
        super().__setitem__(name, value)

    @staticmethod
    def _check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates may not set {name!r} on a namespace")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # jinja's own tojson escapes HTML characters; templates expect plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _compile_chat_template(source: str, name: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _TemplateNamespace
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"the chat template of {name} does not parse (line {exc.lineno}): {exc}") from exc


def _plain_data(value: Any) -> Any:
    """A copy of ``value`` made only of JSON types; anything else is refused."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, Mapping):
        return {str(k): _plain_data(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain_data(v) for v in value]
    raise ChatTemplateError(
        f"chat messages may hold only strings, numbers, lists and dicts, got {type(value).__name__}"
    )
