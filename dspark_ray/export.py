"""``dspark export``: a GGUF file as a Hugging Face folder, for the tools that read only folders.

transformers, vLLM and lm-evaluation-harness's ``hf`` backend load a folder of config.json,
model.safetensors, tokenizer.json and tokenizer_config.json; ``export`` writes exactly that
from a GGUF file: the config its metadata implies, every weight dequantized (q/k rows in
Hugging Face order) under its Hugging Face name, and the tokenizer this project builds from
the metadata, with the chat template. The benchmarks give vLLM a model through it, so both
servers run the same weights.

float32 (the default) keeps every dequantized value exactly; bfloat16 rounds them (half the
bytes, and the dtype vLLM runs on CPU).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dspark_ray.model.checkpoint import is_gguf, locate
from dspark_ray.model.errors import ModelLoadError
from dspark_ray.model.gguf import open_checkpoint
from dspark_ray.tokenizer import Tokenizer

EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def export_gguf(source: str | Path, folder: str | Path, dtype: str = "float32") -> Path:
    """Write the Hugging Face folder of the GGUF file ``source`` to ``folder`` (created; files
    already there are replaced). Returns the folder."""
    path = locate(source)
    if not is_gguf(path):
        raise ModelLoadError(f"{path} is not a .gguf file; export converts GGUF files to Hugging Face folders")
    if dtype not in EXPORT_DTYPES:
        raise ModelLoadError(f"export dtype {dtype!r} is not one of {', '.join(EXPORT_DTYPES)}")
    gguf = open_checkpoint(path)
    tokenizer = Tokenizer.from_path(path)  # refuses a file without a usable tokenizer before anything is written
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    _write_weights(gguf, out / "model.safetensors", EXPORT_DTYPES[dtype])
    ids = {key: tokenizer.get_vocab()[token] for key, token in tokenizer.special_tokens.items()}
    eos = sorted(tokenizer.eos_token_ids)
    config = {**gguf.hf_config(), "torch_dtype": dtype, "bos_token_id": ids.get("bos_token"),
              "eos_token_id": eos[0] if len(eos) == 1 else eos, "pad_token_id": ids.get("pad_token")}
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", {"bos_token_id": ids.get("bos_token"),
                                                  "eos_token_id": eos[0] if len(eos) == 1 else eos,
                                                  "pad_token_id": ids.get("pad_token")})
    (out / "tokenizer.json").write_text(tokenizer.backend_json(), encoding="utf-8")
    spec = gguf.tokenizer_spec()
    _write_json(out / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **tokenizer.special_tokens,
        "add_bos_token": spec.add_bos,
        "add_eos_token": spec.add_eos,
        "model_max_length": config["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
        **({"chat_template": tokenizer.chat_template} if tokenizer.chat_template else {}),
    })
    _write_json(out / "special_tokens_map.json", dict(tokenizer.special_tokens))
    return out


def _write_weights(gguf, file: Path, dtype: torch.dtype) -> None:
    from safetensors.torch import save_file

    tensors = {name: handle[:].to(dtype).contiguous() for name, handle in gguf.tensors()}
    save_file(tensors, str(file), metadata={"format": "pt", "source": gguf.path.name})


def _write_json(file: Path, data: dict) -> None:
    file.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
