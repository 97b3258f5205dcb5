"""Grammar engines for structured outputs: xgrammar against llguidance, on this project's tokenizer.

    bench/.vllm-venv/bin/python bench/grammar_engines.py               # shipped tokenizer, ~20 s
    bench/.vllm-venv/bin/python bench/grammar_engines.py --walks 400 --compiles 20
    bench/.vllm-venv/bin/python bench/grammar_engines.py --model DIR   # another tokenizer.json

It runs in the vLLM virtualenv (``bench/setup_vllm.sh``), the one install
that has both engines; the project's ``.venv`` has only llguidance. It does
not import dspark_ray: each engine is driven as vLLM / the project drive it
(llguidance as in ``dspark_ray/engine/structured.py``: an ``LLTokenizer``
from the tokenizer.json text, one ``LLMatcher`` per request, masks into an
int32 bitmask row). Both engines write the same bitmask layout (bit
``t & 31`` of word ``t >> 5`` allows token ``t``), so masks compare directly.

For each grammar (a JSON schema, any JSON object, a regular expression) a
fixed valid output is tokenized with the tokenizers library and walked token
by token, in a fresh matcher each walk: at each position the mask is
computed (timed), the next token must be allowed, and it is consumed (timed).
Figures:

- compile: spec to a matcher ready for its first mask. xgrammar cold clears
  its compile cache first; cached is a cache hit plus ``GrammarMatcher``.
  llguidance has no compile cache: cold is ``grammar_from_*`` plus
  ``LLMatcher``; cached is ``LLMatcher.deep_copy`` of a fresh matcher.
- first mask: the first mask of a cold-compiled matcher (llguidance builds
  its lexer lazily, so part of its compiling shows up here).
- mask, consume: per position over all walks, median and p99.
- rollback: consume 4 tokens, then ``rollback(4)`` (timed), at every
  position of the walk that has 4 tokens after it.
- masks differ: positions of the walk (including the one after the last
  token, where only EOS should be allowed) where xgrammar's and
  llguidance's allowed sets are not identical; the tokens in question are
  listed under the table.

A third row per grammar, "llguidance, warm copy", walks deep copies of a
matcher that has walked the output once: what a per-grammar matcher cache
(which the project does not have) would make of llguidance's figures.

Both engines are configured alike: compact JSON (", " and ": ", no other
whitespace, the project's ``JSON_OPTIONS``), additional properties spelt out
in the schema, and the control tokens <|system|> <|user|> <|assistant|>
never allowed (xgrammar takes a token whose text is empty for a control
token, so its vocabulary is built with those blanked; the footnote counts
what changes with ``TokenizerInfo.from_huggingface``, vLLM's default path).
Garbage collection is off while timing.

What the differences were (xgrammar 0.2.8, llguidance 1.7.6): where the
grammar forces text (a key, ", my "), llguidance's mask holds only the
canonical tokenization of it, though ``consume_token`` still takes other
splittings; xgrammar allows every token consistent with the bytes. In JSON
strings llguidance never allows U+007F (DEL), which RFC 8259 lets through
unescaped and xgrammar allows. Nothing else differed.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # transformers, if imported, must not reach for the hub

import torch
import xgrammar as xgr
from llguidance import LLMatcher, LLTokenizer
from tokenizers import Tokenizer

from common import OUT_DIR, TARGET

# The project's JSON options (dspark_ray/engine/structured.py JSON_OPTIONS), copied: no dspark_ray import here.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
XGR_JSON = {"any_whitespace": False, "separators": (", ", ": ")}  # the same rules, in xgrammar's terms

SCHEMA = {
    "type": "object",
    "properties": {
        "speaker": {
            "type": "object",
            "properties": {"role": {"enum": ["king", "fool", "queen"]}, "lines": {"type": "integer"}},
            "required": ["role", "lines"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"enum": ["comedy", "tragedy"]}, "maxItems": 3},
    },
    "required": ["speaker", "tags"],
    "additionalProperties": False,
}


@dataclass(frozen=True)
class Case:
    """A grammar and one output it accepts (written in the compact JSON both engines are held to)."""

    name: str
    kind: str  # "json_schema" | "regex"
    spec: str
    text: str


CASES = (
    Case("json schema", "json_schema", json.dumps(SCHEMA),
         '{"speaker": {"role": "fool", "lines": 12}, "tags": ["comedy", "tragedy"]}'),
    Case("any JSON object", "json_schema", '{"type": "object"}',
         '{"play": "Twelfth Night", "act": 3, "scene": {"where": "Olivia\'s garden", "lines": [1, 2.5, -7]}, '
         '"alive": false, "notes": null, "quote": "If music be the food of love, play on"}'),
    Case("regex", "regex", r"(Yes|No), my (lord|liege)\.", "Yes, my liege."),
)


@dataclass
class Result:
    engine: str
    case: str
    tokens: int
    compile_cold_ms: float
    compile_cached_ms: float
    first_mask_us: float
    mask_us: list[float] = field(default_factory=list)
    consume_us: list[float] = field(default_factory=list)
    rollback_us: list[float] = field(default_factory=list)
    masks: list[torch.Tensor] = field(default_factory=list)  # [W] int32 per position, first walk


class Engine:
    """What the benchmark needs of a grammar engine; ``compiled`` is whatever makes a matcher."""

    name = ""

    def compile_cold(self, case: Case) -> tuple[object, object]: ...  # (compiled, a matcher of it)
    def compile_cached(self, case: Case, compiled, matcher): ...  # -> a matcher, as a repeat would get it
    def matcher(self, compiled): ...  # a fresh matcher for one request
    def fill(self, matcher, row: torch.Tensor) -> None: ...
    def consume(self, matcher, token: int) -> bool: ...
    def rollback(self, matcher, n: int) -> None: ...
    def walked(self, compiled, matcher) -> None: ...  # a walk has ended with this matcher


class LLGuidance(Engine):
    """As the project uses it: grammar text -> LLMatcher per request, mask written through a pointer."""

    name = "llguidance"

    def __init__(self, tokenizer_json: str, vocab: int, eos: list[int]) -> None:
        self.tokenizer = LLTokenizer(tokenizer_json, n_vocab=vocab, eos_token=eos)

    def compile_cold(self, case: Case) -> tuple[str, LLMatcher]:
        if case.kind == "regex":
            grammar = LLMatcher.grammar_from_regex(case.spec)
        else:
            grammar = LLMatcher.grammar_from_json_schema(case.spec, defaults=JSON_OPTIONS)
        m = LLMatcher(self.tokenizer, grammar, log_level=0)
        if m.is_error():
            raise RuntimeError(f"llguidance cannot compile {case.name}: {m.get_error()}")
        return grammar, m

    def compile_cached(self, case: Case, compiled: str, matcher: LLMatcher) -> LLMatcher:
        return matcher.deep_copy()  # the nearest thing to a cache hit: a copy of a matcher kept aside

    def matcher(self, compiled: str) -> LLMatcher:
        return LLMatcher(self.tokenizer, compiled, log_level=0)  # what the project does per request

    def fill(self, matcher: LLMatcher, row: torch.Tensor) -> None:
        matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())

    def consume(self, matcher: LLMatcher, token: int) -> bool:
        return matcher.consume_token(token)

    def rollback(self, matcher: LLMatcher, n: int) -> None:
        matcher.rollback(n)


class LLGuidanceWarm(LLGuidance):
    """llguidance with a cache the project does not have: each request gets a deep copy of a matcher
    that has already walked the output once (and was reset), so its lazily built lexer states come with it.
    The gap to plain llguidance is what a per-grammar matcher cache would save."""

    name = "llguidance, warm copy"

    def __init__(self, tokenizer_json: str, vocab: int, eos: list[int]) -> None:
        super().__init__(tokenizer_json, vocab, eos)
        self.templates: dict[str, LLMatcher] = {}

    def matcher(self, compiled: str) -> LLMatcher:
        template = self.templates.get(compiled)
        return template.deep_copy() if template is not None else super().matcher(compiled)

    def walked(self, compiled: str, matcher: LLMatcher) -> None:
        if compiled not in self.templates:
            matcher.reset()
            self.templates[compiled] = matcher


class XGrammar(Engine):
    """As vLLM uses it: one GrammarCompiler (with its cache) per tokenizer, a GrammarMatcher per request."""

    name = "xgrammar"

    def __init__(self, info: xgr.TokenizerInfo, threads: int = 8) -> None:
        self.compiler = xgr.GrammarCompiler(info, max_threads=threads)  # cache on; 8 threads is vLLM's default

    def _compile(self, case: Case) -> xgr.CompiledGrammar:
        if case.kind == "regex":
            return self.compiler.compile_regex(case.spec)
        return self.compiler.compile_json_schema(case.spec, **XGR_JSON)

    def compile_cold(self, case: Case) -> tuple[xgr.CompiledGrammar, xgr.GrammarMatcher]:
        self.compiler.clear_cache()
        compiled = self._compile(case)
        return compiled, xgr.GrammarMatcher(compiled)

    def compile_cached(self, case: Case, compiled, matcher) -> xgr.GrammarMatcher:
        return xgr.GrammarMatcher(self._compile(case))

    def matcher(self, compiled: xgr.CompiledGrammar) -> xgr.GrammarMatcher:
        return xgr.GrammarMatcher(compiled)

    def fill(self, matcher: xgr.GrammarMatcher, row: torch.Tensor) -> None:
        matcher.fill_next_token_bitmask(row.view(1, -1))

    def consume(self, matcher: xgr.GrammarMatcher, token: int) -> bool:
        return matcher.accept_token(token)

    def rollback(self, matcher: xgr.GrammarMatcher, n: int) -> None:
        matcher.rollback(n)


def xgrammar_info(tokenizer: Tokenizer, vocab: int, eos: list[int]) -> xgr.TokenizerInfo:
    """xgrammar's view of a byte-level BPE tokenizer.json, control tokens blanked (hence never allowed).

    The text of each token is the byte-level form ("Ġmy"), which xgrammar
    decodes itself (VocabType.BYTE_LEVEL). The EOS ids are stop tokens, whose
    text does not matter."""
    pre = json.loads(tokenizer.to_str()).get("pre_tokenizer") or {}
    encoded = [""] * vocab
    for text, i in tokenizer.get_vocab(with_added_tokens=True).items():
        if i < vocab:
            encoded[i] = text
    for i, added in tokenizer.get_added_tokens_decoder().items():
        if added.special and i < vocab:
            encoded[i] = ""
    return xgr.TokenizerInfo(encoded, xgr.VocabType.BYTE_LEVEL, vocab_size=vocab, stop_token_ids=eos,
                             add_prefix_space=bool(pre.get("add_prefix_space", False)))


def xgrammar_info_hf(model: Path, vocab: int, eos: list[int]) -> xgr.TokenizerInfo | None:
    """vLLM's path: TokenizerInfo.from_huggingface (None if transformers cannot load it offline)."""
    try:
        from transformers import PreTrainedTokenizerFast
        tok = PreTrainedTokenizerFast(tokenizer_file=str(model / "tokenizer.json"))
        return xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab, stop_token_ids=eos)
    except Exception as exc:  # noqa: BLE001 - a footnote, not the benchmark
        print(f"(no from_huggingface comparison: {exc})", file=sys.stderr)
        return None


def us(ns: int) -> float:
    return ns / 1e3


def allowed(row: torch.Tensor, token: int) -> bool:
    return bool((int(row[token >> 5]) >> (token & 31)) & 1)


def timed(fn: Callable, *args) -> tuple[int, object]:
    start = time.perf_counter_ns()
    out = fn(*args)
    return time.perf_counter_ns() - start, out


def run(engine: Engine, case: Case, tokens: list[int], words: int, walks: int, compiles: int) -> Result:
    row = torch.zeros(words, dtype=torch.int32)
    cold, first = [], []
    for _ in range(compiles):  # a cold matcher each time: its first mask pays for anything built lazily
        ns, (compiled, m) = timed(engine.compile_cold, case)
        cold.append(ns)
        first.append(timed(engine.fill, m, row)[0])
    _, template = engine.compile_cold(case)  # a matcher never used, for llguidance's deep_copy
    cached = [timed(engine.compile_cached, case, compiled, template)[0] for _ in range(compiles)]
    r = Result(engine.name, case.name, len(tokens), statistics.median(cold) / 1e6, statistics.median(cached) / 1e6,
               us(statistics.median(first)))

    # Mask walk: a fresh matcher per walk, as a request gets.
    for walk in range(walks):
        m = engine.matcher(compiled)
        for i in range(len(tokens) + 1):
            ns, _ = timed(engine.fill, m, row)
            r.mask_us.append(us(ns))
            if walk == 0:
                r.masks.append(row.clone())
            if i == len(tokens):
                break
            if not allowed(row, tokens[i]):
                raise RuntimeError(f"{engine.name}, {case.name}: token {i} ({tokens[i]}) is not allowed")
            ns, ok = timed(engine.consume, m, tokens[i])
            if not ok:
                raise RuntimeError(f"{engine.name}, {case.name}: token {i} ({tokens[i]}) was refused")
            r.consume_us.append(us(ns))
        engine.walked(compiled, m)

    # Roll-back walk: at each position, 4 tokens on and back, then one on.
    for _ in range(max(1, walks // 4)):
        m = engine.matcher(compiled)
        for i in range(len(tokens) - 3):
            for t in tokens[i:i + 4]:
                engine.consume(m, t)
            r.rollback_us.append(us(timed(engine.rollback, m, 4)[0]))
            engine.consume(m, tokens[i])
    return r


@dataclass
class Diff:
    positions: int  # positions of the walk where the masks differ
    walk: int  # positions in the walk
    only: tuple[Counter, Counter]  # token -> positions where only the first / only the second engine allows it
    first_only: list[tuple[int, int]]  # (position, token) for each token only the first engine allows


def compare(a: list[torch.Tensor], b: list[torch.Tensor], vocab: int) -> Diff:
    """Where two walks' masks differ, and by which tokens."""
    bits = torch.arange(32, dtype=torch.int32)
    only: tuple[Counter, Counter] = (Counter(), Counter())
    first_only = []
    positions = 0
    for i, (x, y) in enumerate(zip(a, b)):
        if torch.equal(x, y):
            continue
        positions += 1
        ux = ((x[:, None] >> bits) & 1).flatten()[:vocab].bool()  # [W] int32 -> [vocab] bool
        uy = ((y[:, None] >> bits) & 1).flatten()[:vocab].bool()
        only[0].update((ux & ~uy).nonzero().flatten().tolist())
        only[1].update((uy & ~ux).nonzero().flatten().tolist())
        first_only += [(i, t) for t in (ux & ~uy).nonzero().flatten().tolist()]
    return Diff(positions, len(a), only, first_only)


def consumed_anyway(llg: LLGuidance, case: Case, tokens: list[int], pairs: list[tuple[int, int]]) -> Counter:
    """Of tokens xgrammar allows and llguidance's mask does not: which llguidance's consume_token takes
    all the same (its mask is stricter than its parser) and which it refuses (a real difference)."""
    grammar, _ = llg.compile_cold(case)
    out: Counter = Counter()
    for i, t in pairs:
        m = llg.matcher(grammar)
        for prev in tokens[:i]:
            llg.consume(m, prev)
        out["consumed" if llg.consume(m, t) else "refused"] += 1
    return out


def describe(case: str, d: Diff, names: tuple[str, str], decode: Callable[[int], str]) -> str:
    """One line: the tokens only one engine allows, each with the number of positions where it does."""
    parts = [f"{case}: {d.positions}/{d.walk} positions"]
    for name, only in zip(names, d.only):
        if only:
            top = ", ".join(f"{decode(t)!r} ({n})" for t, n in only.most_common(8))
            more = f" and {len(only) - 8} more tokens" if len(only) > 8 else ""
            parts.append(f"only {name} allows {top}{more}")
    return "; ".join(parts)


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def table(results: list[Result], diffs: dict[str, Diff]) -> str:
    lines = ["| engine | grammar | tokens | compile ms cold | compile ms cached | first mask µs | "
             "mask µs median | mask µs p99 | consume µs median | rollback(4) µs median | masks differ |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        d = diffs[r.case]
        lines.append(f"| {r.engine} | {r.case} | {r.tokens} | {r.compile_cold_ms:.2f} | {r.compile_cached_ms:.3f} | "
                     f"{r.first_mask_us:.1f} | {statistics.median(r.mask_us):.1f} | {pct(r.mask_us, 0.99):.1f} | "
                     f"{statistics.median(r.consume_us):.1f} | {statistics.median(r.rollback_us):.1f} | "
                     f"{d.positions}/{d.walk} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=TARGET, help="a directory with tokenizer.json")
    ap.add_argument("--walks", type=int, default=2000, help="walks of each output per engine")
    ap.add_argument("--compiles", type=int, default=50, help="compilations timed per engine and grammar")
    ap.add_argument("--xgrammar-threads", type=int, default=8, help="GrammarCompiler max_threads (vLLM: 8)")
    args = ap.parse_args()
    torch.set_num_threads(1)

    text = (args.model / "tokenizer.json").read_text()
    tokenizer = Tokenizer.from_str(text)
    config = json.loads((args.model / "config.json").read_text()) if (args.model / "config.json").exists() else {}
    vocab = config.get("vocab_size") or tokenizer.get_vocab_size(with_added_tokens=True)
    gen = args.model / "generation_config.json"
    eos = json.loads(gen.read_text()).get("eos_token_id") if gen.exists() else config.get("eos_token_id")
    eos = sorted(eos if isinstance(eos, list) else [eos])
    words = (vocab + 31) // 32

    setup_ms = {}
    ns, llg = timed(LLGuidance, text, vocab, eos)
    setup_ms["llguidance LLTokenizer"] = ns / 1e6
    ns, info = timed(xgrammar_info, tokenizer, vocab, eos)
    ns2, xg = timed(XGrammar, info, args.xgrammar_threads)
    setup_ms["xgrammar TokenizerInfo + GrammarCompiler"] = (ns + ns2) / 1e6
    engines = (xg, llg, LLGuidanceWarm(text, vocab, eos))

    results: list[Result] = []
    diffs: dict[str, Diff] = {}
    gc.disable()
    start = time.perf_counter()
    for case in CASES:
        tokens = tokenizer.encode(case.text, add_special_tokens=False).ids
        rows = [run(e, case, tokens, words, args.walks, args.compiles) for e in engines]
        results += rows
        diffs[case.name] = compare(rows[0].masks, rows[1].masks, vocab)
        if any(not torch.equal(a, b) for a, b in zip(rows[1].masks, rows[2].masks)):
            raise RuntimeError(f"{case.name}: llguidance's masks change with a warm copy")
    gc.enable()
    seconds = time.perf_counter() - start

    decode = lambda t: tokenizer.decode([t], skip_special_tokens=False)
    names = (xg.name, llg.name)
    notes = []
    for case in CASES:
        d = diffs[case.name]
        probe = consumed_anyway(llg, case, tokenizer.encode(case.text, add_special_tokens=False).ids, d.first_only)
        notes.append(f"- {describe(case.name, d, names, decode)}"
                     + (f" (of these {len(d.first_only)}, llguidance's consume_token takes {probe['consumed']} "
                        f"and refuses {probe['refused']})" if d.first_only else ""))
    # The same walks with vLLM's default TokenizerInfo, which leaves the control tokens as text.
    info_hf = xgrammar_info_hf(args.model, vocab, eos)
    hf_notes = []
    if info_hf is not None:
        xg_hf = XGrammar(info_hf)
        llg_masks = {r.case: r.masks for r in results if r.engine == llg.name}
        for case in CASES:
            r = run(xg_hf, case, tokenizer.encode(case.text, add_special_tokens=False).ids, words, 1, 1)
            d = compare(r.masks, llg_masks[case.name], vocab)
            hf_notes.append(f"- {describe(case.name, d, ('xgrammar', llg.name), decode)}")

    md = [f"# Grammar engines: xgrammar {version('xgrammar')} vs llguidance {version('llguidance')} "
          f"({time.strftime('%Y-%m-%d %H:%M')})", "",
          f"`{' '.join(['bench/.vllm-venv/bin/python', *sys.argv])}` on {os.cpu_count()} CPUs, "
          f"torch {torch.__version__}; tokenizer {args.model.name} (vocabulary {vocab}, EOS {eos}); "
          f"{args.walks} walks, {args.compiles} compilations, xgrammar compiler threads {args.xgrammar_threads}; "
          f"{seconds:.1f} s.", "",
          table(results, diffs), "",
          "Tokenizer set-up: " + "; ".join(f"{k} {v:.1f} ms" for k, v in setup_ms.items()) + ".", ""]
    md += ["Mask differences, xgrammar vs llguidance (token, and the number of positions where only one allows it):",
           *notes]
    if hf_notes:
        md += ["", "The same with xgrammar's TokenizerInfo.from_huggingface "
                   "(vLLM's path: control tokens kept as text):", *hf_notes]
    out = "\n".join(md)
    print(out)
    OUT_DIR.mkdir(exist_ok=True)
    (OUT_DIR / "grammar_engines.md").write_text(out + "\n")


if __name__ == "__main__":
    main()
