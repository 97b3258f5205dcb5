"""The tokenizer against transformers' own, on a byte-level BPE built here and on the shipped files.

Covers encode/decode round trips, which special tokens encode adds, chat
templates (and their sandbox), EOS from generation_config.json, the
incremental decoder on multi-byte text, and the draft/target compatibility
check.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jinja2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import SHIPPED_DRAFT, SHIPPED_TARGET, shipped
from dspark_ray.model.errors import CheckpointFileMissing
from dspark_ray.tokenizer import (
    ChatTemplateError,
    IncrementalDecoder,
    Tokenizer,
    TokenizerError,
    TokenizerMismatch,
    check_compatible,
)

SENTENCES = [
    "To be, or not to be, that is the question:",
    "Whether 'tis nobler in the mind to suffer the slings and arrows of outrageous fortune,",
    "Or to take arms against a sea of troubles, and by opposing end them.",
    "Un café crème, s'il vous plaît — déjà vu, naïve résumé, Ærø, Straße.",
    "日本語のテキストと中文文本。",
    "Emoji: 😀 🎉 👩‍👩‍👧 🇫🇷 and math ∑∞ ≠ ≤.",
]
EOT, BOS, USER, ASSISTANT, SYSTEM, END = (
    "<|endoftext|>", "<|bos|>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>",
)
SPECIAL = [EOT, BOS, USER, ASSISTANT, SYSTEM, END]

# Uses what real templates use: bos_token, namespace, raise_exception, loop
# variables, filters, and whitespace control that trim_blocks/lstrip_blocks shape.
CHAT_TEMPLATE = """{{ bos_token }}
{%- set ns = namespace(turns=0) %}
{% for message in messages %}
    {% if message['role'] not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('unknown role: ' + message['role']) }}
    {% endif %}
    {% set ns.turns = ns.turns + 1 %}
<|{{ message['role'] }}|>
{{ message['content'] | trim }}{% if message.name is defined %} ({{ message.name }}){% endif %}<|end|>
{% endfor %}
{% if add_generation_prompt %}
<|assistant|>
{% endif %}
"""

TEXTS = [
    "",
    "To be, or not to be",
    "  leading and trailing spaces  ",
    "line one\nline two\r\n\ttabbed",
    "déjà vu — naïve café",
    "日本語 😀 👩‍👩‍👧 🇫🇷",
    f"{USER}\nHi{END}\n",
    "unseen words: xylophone quagmire",
]

CHATS = [
    [{"role": "user", "content": "Hello, good sir!"}],
    [
        {"role": "system", "content": "  Speak as a bard.  "},
        {"role": "user", "content": "Wherefore art thou? 😀", "name": "Juliet"},
        {"role": "assistant", "content": "Déjà here.", "tool_calls": None},
        {"role": "user", "content": "Again."},
    ],
]


def write_tokenizer(folder: Path, *, sentences=SENTENCES, bos_in_tokenizer_json: bool = True,
                    config: dict | None = None, generation_config: dict | None = None) -> Path:
    """A byte-level BPE checkpoint tokenizer: tokenizer.json, tokenizer_config.json, generation_config.json."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(sentences, trainer)
    if bos_in_tokenizer_json:
        backend.post_processor = processors.TemplateProcessing(
            single=f"{BOS} $A", special_tokens=[(BOS, backend.token_to_id(BOS))]
        )
    folder.mkdir(parents=True, exist_ok=True)
    backend.save(str(folder / "tokenizer.json"))
    base = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": {"content": EOT, "special": True, "__type": "AddedToken"},
        "pad_token": EOT,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps({**base, **(config or {})}))
    gen = {"eos_token_id": [0, 5]} if generation_config is None else generation_config
    (folder / "generation_config.json").write_text(json.dumps(gen))
    return folder


# Which special tokens encode adds: tokenizer.json's post-processor decides,
# and transformers 5 ignores tokenizer_config.json's add_bos/eos_token flags.
VARIANTS = {
    "bos-from-tokenizer-json": dict(bos_in_tokenizer_json=True),
    "no-post-processor": dict(bos_in_tokenizer_json=False),
    "flags-contradict-json": dict(
        bos_in_tokenizer_json=True, config={"add_bos_token": False, "add_eos_token": True}
    ),
}


@pytest.fixture(scope="module", params=VARIANTS)
def pair(request, tmp_path_factory):
    """(our Tokenizer, transformers' AutoTokenizer) on the same folder."""
    from transformers import AutoTokenizer

    folder = write_tokenizer(tmp_path_factory.mktemp("tok") / request.param, **VARIANTS[request.param])
    return Tokenizer.from_path(folder), AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def tok_folder(tmp_path_factory) -> Path:
    return write_tokenizer(tmp_path_factory.mktemp("tok") / "plain")


@pytest.fixture(scope="module")
def tok(tok_folder) -> Tokenizer:
    return Tokenizer.from_path(tok_folder)


@pytest.fixture
def folder_copy(tok_folder, tmp_path) -> Path:
    return Path(shutil.copytree(tok_folder, tmp_path / "copy"))


def assert_agrees(ours: Tokenizer, hf, text: str) -> None:
    for add in (True, False):
        ids = ours.encode(text, add_special_tokens=add)
        assert ids == hf.encode(text, add_special_tokens=add), (text, add)
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)


# --- agreement with transformers -------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_agree_with_transformers(pair, text):
    assert_agrees(*pair, text)


def test_special_tokens_added_as_transformers_adds_them(pair):
    ours, hf = pair
    plain = ours.encode("To be", add_special_tokens=False)
    with_bos = ours.encode("To be")
    assert with_bos == hf.encode("To be")
    assert with_bos in (plain, [ours.bos_token_id, *plain])
    assert 0 not in with_bos  # EOS is never added here


def test_contradicting_flags_are_logged(tmp_path, caplog):
    folder = write_tokenizer(tmp_path / "t", config={"add_bos_token": False, "add_eos_token": False})
    with caplog.at_level("WARNING", logger="dspark_ray.tokenizer"):
        tok = Tokenizer.from_path(folder)
    assert tok.encode("To be")[0] == tok.bos_token_id
    assert "add_bos_token=False but tokenizer.json's post-processor adds <|bos|>" in caplog.text
    assert "add_eos_token" not in caplog.text


def test_vocab_size_and_special_ids_agree_with_transformers(pair):
    ours, hf = pair
    assert ours.vocab_size == len(hf)
    assert ours.bos_token_id == hf.bos_token_id
    assert ours.pad_token_id == hf.pad_token_id
    assert ours.special_tokens == {"bos_token": BOS, "eos_token": EOT, "pad_token": EOT}


@pytest.mark.parametrize("chat", CHATS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_agrees_with_transformers(pair, chat, add_generation_prompt):
    ours, hf = pair
    got = ours.apply_chat_template(chat, add_generation_prompt=add_generation_prompt)
    expected = hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert got == expected
    assert got.startswith(f"{BOS}<|") and got.endswith("<|assistant|>\n" if add_generation_prompt else "<|end|>\n")
    assert ours.encode(got, add_special_tokens=False) == hf.encode(got, add_special_tokens=False)


def test_tojson_in_template_agrees_with_transformers(tmp_path):
    from transformers import AutoTokenizer

    template = "{% for m in messages %}{{ m | tojson }}{{ m | tojson(indent=2) }}\n{% endfor %}"
    folder = write_tokenizer(tmp_path / "t", config={"chat_template": template})
    chat = [{"role": "user", "content": "<b>é & 😀</b>", "meta": {"n": 1, "ok": True, "x": [1.5, None]}}]
    ours = Tokenizer.from_path(folder).apply_chat_template(chat)
    assert ours == AutoTokenizer.from_pretrained(folder).apply_chat_template(chat, tokenize=False)
    assert '"<b>é & 😀</b>"' in ours


@settings(max_examples=60, deadline=None)
@given(text=st.text(max_size=40))
def test_any_text_round_trips_and_agrees(pair, text):
    ours, hf = pair
    ids = ours.encode(text, add_special_tokens=False)
    assert ids == hf.encode(text, add_special_tokens=False)
    assert ours.decode(ids) == text
    assert ours.decode(ours.encode(text)) == text  # BOS/EOS are skipped on decode


# --- the incremental decoder -----------------------------------------------------------------

MULTIBYTE = "Crème brûlée, Ærø — 日本語 😀🎉 👩‍👩‍👧 🇫🇷 ∑∞!"


def test_incremental_decoder_never_splits_a_character(tok):
    ids = tok.encode(MULTIBYTE, add_special_tokens=False)
    assert any("\ufffd" in tok.decode([i]) for i in ids), "test text should put a character over several tokens"
    decoder = IncrementalDecoder(tok)
    pieces = [decoder.push(i) for i in ids] + [decoder.finish()]
    assert "".join(pieces) == MULTIBYTE == tok.decode(ids)
    assert all("\ufffd" not in p for p in pieces)
    assert "" in pieces[:-1], "some token should have completed no character"


def test_incremental_decoder_with_special_tokens(tok):
    ids = [tok.bos_token_id, *tok.encode("Déjà 😀", add_special_tokens=False), 0]
    for skip in (True, False):
        decoder = IncrementalDecoder(tok, skip_special_tokens=skip)
        text = "".join(decoder.push(i) for i in ids) + decoder.finish()
        assert text == tok.decode(ids, skip_special_tokens=skip)
        assert (BOS in text) != skip


def test_incremental_decoder_releases_an_incomplete_character_on_finish(tok):
    emoji = tok.encode("😀", add_special_tokens=False)
    head = emoji[:-1] if len(emoji) > 1 else pytest.skip("emoji is one token")
    decoder = IncrementalDecoder(tok)
    assert decoder.push(tok.encode("ab", add_special_tokens=False)) == "ab"
    assert decoder.push(head) == ""
    assert decoder.finish() == tok.decode(head) == "\ufffd"


@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_incremental_decoder_concatenates_to_decode(tok, data):
    """Any ids, even ones making invalid UTF-8, pushed in any chunks: the pieces join to decode(ids)."""
    ids = data.draw(st.lists(st.integers(0, tok.vocab_size - 1), max_size=30))
    skip = data.draw(st.booleans())
    decoder = IncrementalDecoder(tok, skip_special_tokens=skip)
    pieces, rest = [], list(ids)
    while rest:
        n = data.draw(st.integers(1, 4))
        pieces.append(decoder.push(rest[:n]))
        rest = rest[n:]
    pieces.append(decoder.finish())
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip)


@settings(max_examples=40, deadline=None)
@given(text=st.text(max_size=30))
def test_incremental_decoder_on_valid_text_never_emits_replacement(tok, text):
    decoder = IncrementalDecoder(tok)
    pieces = [decoder.push(i) for i in tok.encode(text)] + [decoder.finish()]
    assert "".join(pieces) == text
    if "\ufffd" not in text:
        assert all("\ufffd" not in p for p in pieces)


# --- chat template errors and the sandbox ----------------------------------------------------


def test_template_raise_exception_is_a_chat_template_error(tok):
    with pytest.raises(ChatTemplateError, match="unknown role: wizard") as err:
        tok.apply_chat_template([{"role": "wizard", "content": "abracadabra"}])
    assert isinstance(err.value.__cause__, jinja2.TemplateError)


def test_no_chat_template(folder_copy):
    config = json.loads((folder_copy / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (folder_copy / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_path(folder_copy)
    assert tok.chat_template is None
    assert tok.encode("To be")  # the rest works
    with pytest.raises(ChatTemplateError, match="has no chat template: add a 'chat_template'"):
        tok.apply_chat_template([{"role": "user", "content": "Hi"}])


def test_chat_template_jinja_file_overrides_config(folder_copy):
    (folder_copy / "chat_template.jinja").write_text("{% for m in messages %}[{{ m.content }}]{% endfor %}")
    assert Tokenizer.from_path(folder_copy).apply_chat_template([{"role": "user", "content": "Hi"}]) == "[Hi]"


def test_named_chat_templates(tmp_path):
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D{{ messages | length }}"}]
    folder = write_tokenizer(tmp_path / "named", config={"chat_template": named})
    assert Tokenizer.from_path(folder).apply_chat_template([{"role": "user", "content": "x"}]) == "D1"
    no_default = write_tokenizer(tmp_path / "nodefault", config={"chat_template": named[:1]})
    with pytest.raises(ChatTemplateError, match="none called 'default'"):
        Tokenizer.from_path(no_default)


def test_template_syntax_error_at_load(tmp_path):
    folder = write_tokenizer(tmp_path / "bad", config={"chat_template": "{% for m in messages %}{{ m }}"})
    with pytest.raises(ChatTemplateError, match="does not parse"):
        Tokenizer.from_path(folder)


@pytest.mark.parametrize("messages", [
    {"role": "user", "content": "not a list"},
    ["not a dict"],
    [{"role": "user", "content": object()}],
    [{"role": "user", "content": "x", "extra": {1, 2}}],
])
def test_messages_must_be_plain_data(tok, messages):
    with pytest.raises(ChatTemplateError, match="list of dicts|only strings, numbers, lists and dicts"):
        tok.apply_chat_template(messages)


@pytest.mark.parametrize("template", [
    "{{ ''.__class__.__mro__ }}",
    "{{ ''.__class__.mro()[1].__subclasses__() }}",
    "{{ messages.__class__.__base__.__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os }}",
    "{{ messages.append('injected') }}",
    "{{ messages[0].update({'role': 'system'}) }}",
    "{% set ns = namespace() %}{% set ns.__class__ = 1 %}",
    "{% set ns = namespace(__init__=1) %}",
])
def test_sandbox_blocks_unsafe_access(tmp_path, template):
    folder = write_tokenizer(tmp_path / "evil", config={"chat_template": template})
    tok = Tokenizer.from_path(folder)
    with pytest.raises(ChatTemplateError) as err:
        tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert isinstance(err.value.__cause__, jinja2.exceptions.SecurityError), repr(err.value.__cause__)


def test_template_runtime_error_is_a_chat_template_error(tmp_path):
    folder = write_tokenizer(tmp_path / "div", config={"chat_template": "{{ 1 // 0 }}"})
    with pytest.raises(ChatTemplateError, match="ZeroDivisionError"):
        Tokenizer.from_path(folder).apply_chat_template([])


# --- EOS --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("generation_config", "expected"), [
    ({"eos_token_id": 5}, {5}),
    ({"eos_token_id": [0, 5, 2]}, {0, 5, 2}),
    ({"bos_token_id": 1}, {0}),  # no eos_token_id: the tokenizer's eos_token
])
def test_eos_ids(tmp_path, generation_config, expected):
    folder = write_tokenizer(tmp_path / "eos", generation_config=generation_config)
    eos = Tokenizer.from_path(folder).eos_token_ids
    assert isinstance(eos, frozenset)
    assert eos == expected


def test_eos_without_generation_config(folder_copy):
    (folder_copy / "generation_config.json").unlink()
    assert Tokenizer.from_path(folder_copy).eos_token_ids == {0}


@pytest.mark.parametrize(("eos", "message"), [
    ("0", "must be an int or a non-empty list"),
    ([], "must be an int or a non-empty list"),
    ([0, True], "must be an int or a non-empty list"),
    (400, r"EOS id\(s\) \[400\] are outside the vocabulary"),
    ([-1, 0], r"EOS id\(s\) \[-1\] are outside the vocabulary"),
])
def test_bad_eos_ids(tmp_path, eos, message):
    folder = write_tokenizer(tmp_path / "eos", generation_config={"eos_token_id": eos})
    with pytest.raises(TokenizerError, match=message):
        Tokenizer.from_path(folder)


def test_no_eos_anywhere(tmp_path):
    folder = write_tokenizer(tmp_path / "noeos", generation_config={}, config={"eos_token": None})
    with pytest.raises(TokenizerError, match="set eos_token_id in generation_config.json"):
        Tokenizer.from_path(folder)


# --- files and inputs -------------------------------------------------------------------------


def test_missing_tokenizer_json(folder_copy):
    (folder_copy / "tokenizer.json").unlink()
    with pytest.raises(CheckpointFileMissing, match=r"tokenizer\.json not found"):
        Tokenizer.from_path(folder_copy)


@pytest.mark.parametrize("file", ["tokenizer.json", "tokenizer_config.json", "generation_config.json"])
def test_malformed_files(folder_copy, file):
    (folder_copy / file).write_text("{ not json")
    with pytest.raises(TokenizerError, match=file.replace(".", r"\.")):
        Tokenizer.from_path(folder_copy)


def test_special_token_not_in_vocabulary(tmp_path):
    folder = write_tokenizer(tmp_path / "t", config={"pad_token": "<|pad|>"})
    with pytest.raises(TokenizerError, match=r"pad_token '<\|pad\|>' is not in the vocabulary"):
        Tokenizer.from_path(folder)


@pytest.mark.parametrize("ids", [[1, 400], [-1], [1.5]])
def test_decode_rejects_ids_outside_the_vocabulary(tok, ids):
    with pytest.raises(TokenizerError, match=r"ids must be ints in \[0, 400\)"):
        tok.decode(ids)


def test_encode_rejects_non_text(tok):
    with pytest.raises(TokenizerError, match="encode takes a str, got bytes"):
        tok.encode(b"bytes")


# --- draft/target compatibility ---------------------------------------------------------------


def test_compatible_copies(tok, folder_copy):
    check_compatible(tok, Tokenizer.from_path(folder_copy))


def test_different_vocabulary_is_incompatible(tok, tmp_path):
    other = Tokenizer.from_path(write_tokenizer(tmp_path / "other", sentences=SENTENCES[:3]))
    with pytest.raises(TokenizerMismatch, match="vocabularies differ .* ids differ, e.g. id") as err:
        check_compatible(tok, other)
    assert "is not the target's" in str(err.value) and "same model family" in str(err.value)


def test_different_special_tokens_are_incompatible(tok, tmp_path):
    other = Tokenizer.from_path(write_tokenizer(tmp_path / "other", config={"eos_token": END}))
    with pytest.raises(TokenizerMismatch, match="special tokens differ"):
        check_compatible(tok, other)


# --- the shipped files ------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["target", "draft"])
def shipped_pair(request):
    from transformers import AutoTokenizer

    folder = shipped(SHIPPED_TARGET if request.param == "target" else SHIPPED_DRAFT, "tokenizer.json")
    return Tokenizer.from_path(folder), AutoTokenizer.from_pretrained(folder)


@pytest.mark.parametrize("text", [*TEXTS, "ROMEO.\nBut, soft! what light through yonder window breaks?"])
def test_shipped_tokenizer_agrees_with_transformers(shipped_pair, text):
    assert_agrees(*shipped_pair, text)
    ours = shipped_pair[0]
    assert ours.decode(ours.encode(text, add_special_tokens=False), skip_special_tokens=False) == text


@pytest.mark.parametrize("chat", CHATS[:1] + [[{"role": "system", "content": "Be brief."}, *CHATS[1][1:]]])
def test_shipped_chat_template_agrees_with_transformers(shipped_pair, chat):
    ours, hf = shipped_pair
    for gen in (True, False):
        assert ours.apply_chat_template(chat, gen) == hf.apply_chat_template(
            chat, tokenize=False, add_generation_prompt=gen
        )


def test_shipped_eos_and_vocab(shipped_pair):
    ours, hf = shipped_pair
    assert ours.vocab_size == len(hf)
    gen_file = Path(hf.name_or_path) / "generation_config.json"
    if gen_file.is_file():
        eos = json.loads(gen_file.read_text())["eos_token_id"]
        assert ours.eos_token_ids == set(eos if isinstance(eos, list) else [eos])
    else:
        assert ours.eos_token_ids == {hf.eos_token_id}


def test_shipped_pair_is_compatible():
    target = Tokenizer.from_path(shipped(SHIPPED_TARGET, "tokenizer.json"))
    check_compatible(target, Tokenizer.from_path(shipped(SHIPPED_DRAFT, "tokenizer.json")))
