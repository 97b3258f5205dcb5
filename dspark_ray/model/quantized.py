"""GGUF weights kept as their blocks: the linears, the embedding and the LM head of a GGUF model.

A decode step reads every weight once, so the bytes a weight takes set single-stream speed:
SmolLM2-135M's Q4_1 blocks and Q8_0 embedding are ~96 MB a step, against ~270 MB in bfloat16 and
~540 MB in float32. With ``quantization: auto`` (the default) the loader keeps the file's blocks for
every weight a kernel reads (``dspark_kernels.quant``: Q8_0, Q4_0, Q4_1, Q4_K, Q6_K on CPU; Q8_0,
Q4_0, Q4_1 on CUDA) and dequantizes the rest (norms, float tensors, other types) into the runtime
dtype, as ``quantization: none`` does for all of them (the oracle the tests compare with).

How a kept weight sits in the model: the module's ``weight`` becomes a uint8 *buffer* holding the
blocks ``[out_features, row bytes]`` (not a parameter: ``model.parameters()`` stays the float
tensors, whose dtype the engine reads as the model's), its ``qtype`` attribute names the format,
and its ``gemm`` (the hook ``llama.Linear`` already has for prepacked and FP8 matmuls) is a
``BlockGemm`` that multiplies through the kernel. q/k/v and gate/up of one type are fused into one
weight of stacked rows as float ones are (``llama.fuse_projections``). The embedding becomes a
``BlockEmbedding`` (a looked-up row dequantized on the fly), and a tied LM head multiplies by the
embedding's own blocks (``CausalLM.lm_gemm``): nothing is stored twice.

Tensor parallelism slices blocks: a column-parallel rank keeps whole rows, a row-parallel one a
run of whole blocks of every row; a weight whose slice would cut a block is dequantized instead.

Results equal dequantize-then-matmul up to the order of the float32 sums (the kernels widen each
block to the same floats the dequantizer gives), so greedy output matches the dequantized model
token for token except at a near-tie (tests/test_real_model.py holds it to transformers').
``quantization: int8`` rounds each 32-block of the activations to int8 first and multiplies in
integers (llama.cpp's scheme; AVX512-VNNI or AVX2): faster, and as exact as that rounding (0.3-1%
relative per matmul), so greedy answers may part from the dequantized model's after a while.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

log = logging.getLogger(__name__)


def kernel_types(device: torch.device) -> frozenset[int]:
    """The GGML type ids whose blocks a matmul runs on here (empty: keep nothing, dequantize all)."""
    from dspark_kernels import cpu, quant

    if device.type == "cuda":
        return frozenset(quant.TRITON_TYPES)
    if device.type == "cpu" and cpu.enabled() and quant._library() is not None:
        return frozenset(quant.FORMATS)
    return frozenset()


_kernel_threads = 0  # what the kernels' own thread pool was last told (quant.set_threads)


def follow_torch_threads() -> None:
    """The quantized matmuls (and the CPU attention, on the same pool) run on as many threads as
    torch's ops (the engine sets those per worker and step: AppConfig.torch_threads,
    single_thread_max_rows); their pool is told when the count changes. An eager ``BlockGemm`` checks
    at every call, a compiled model once a forward pass (``compiled.CompiledForward``)."""
    global _kernel_threads
    n = torch.get_num_threads()
    if n != _kernel_threads:
        from dspark_kernels import quant

        quant.set_threads(n)
        _kernel_threads = n


class BlockGemm:
    """``x @ W.T (+ bias)`` for W kept as GGUF blocks: the ``gemm`` of a ``llama.Linear`` (and of
    fused projections and the LM head). Activations of another dtype are widened to float32 for the
    kernel and the result narrowed back."""

    def __init__(self, blocks: torch.Tensor, qtype: int, in_features: int, int8: bool = False) -> None:
        from dspark_kernels import quant

        self.weight = quant.QuantWeight(blocks, qtype, (blocks.shape[0], in_features))  # [N, K] as blocks
        self.int8 = int8 and qtype in quant.INT8_TYPES and not blocks.is_cuda
        self._kernel = None
        if not blocks.is_cuda:
            try:
                self._kernel = quant.QuantGemm(self.weight, int8=self.int8)
            except quant.QuantError:  # the CPU kernels were turned off since load: the reference
                self._kernel = None

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes

    def bind(self, bias: torch.Tensor | None = None) -> Callable[[torch.Tensor], torch.Tensor]:
        """``x -> self(x, bias)`` for a compiled model's ``dspark::linear``: float32 x straight to the
        kernel (``QuantGemm.bind``), without checking the pool's thread count (the compiled forward
        does that once a pass: ``follow_torch_threads``); any other x through ``__call__``."""
        if self._kernel is None:
            return lambda x: self(x, bias)
        return self._kernel.bind(None if bias is None else bias.float(), fallback=lambda x: self(x, bias))

    def __call__(
        self,
        x: torch.Tensor,  # [..., K]
        bias: torch.Tensor | None = None,  # [N]
    ) -> torch.Tensor:  # [..., N], x's dtype
        from dspark_kernels import quant

        dtype = x.dtype
        x32 = x if dtype == torch.float32 else x.float()
        if self._kernel is not None:
            follow_torch_threads()
            y = self._kernel(x32, None if bias is None else bias.float())
        else:
            y = quant.quant_matmul(x32, self.weight, bias)
        return y if dtype == torch.float32 else y.to(dtype)


class BlockEmbedding(nn.Module):
    """``nn.Embedding`` whose table is kept as GGUF blocks (``weight``: a uint8 buffer [V, row bytes]);
    looked-up rows are dequantized into ``dtype``."""

    def __init__(self, num_embeddings: int, embedding_dim: int, qtype: int, row_bytes: int,
                 dtype: torch.dtype, device: torch.device | str = "meta") -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.qtype, self.dtype = qtype, dtype
        self.register_buffer("weight", torch.empty(num_embeddings, row_bytes, dtype=torch.uint8, device=device))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [...] int64 -> [..., H]
        from dspark_kernels import quant

        rows = self.weight[input_ids.reshape(-1)]  # [n, row bytes]
        values = quant.dequantize(rows, self.qtype, (rows.shape[0], self.embedding_dim))
        return values.to(self.dtype).reshape(*input_ids.shape, self.embedding_dim)

    def dequantized(self) -> torch.Tensor:
        """The whole table [V, H] in ``dtype`` (a DSpark draft that shares the target's embedding)."""
        from dspark_kernels import quant

        return quant.dequantize(self.weight, self.qtype, (self.num_embeddings, self.embedding_dim)).to(self.dtype)


def keep_blocks(model: nn.Module, tensors: dict, device: torch.device, dtype: torch.dtype) -> set[str]:
    """On the meta model (after sharding, before ``to_empty``): make every weight whose GGUF type a
    kernel reads here, and whose tensor-parallel slice keeps whole blocks, a uint8 buffer of this
    rank's blocks (module docstring). ``tensors``: name -> ``GgufTensor``. Returns the names kept."""
    from dspark_ray.model.layers import Linear
    from dspark_ray.model.llama import CausalLM
    from dspark_ray.model.parallel import shard_slice

    types = kernel_types(device)
    kept: set[str] = set()
    for name, handle in tensors.items():
        qtype = int(handle.qtype)
        if qtype not in types or not name.endswith(".weight"):
            continue
        module = model.get_submodule(name.removesuffix(".weight"))
        if isinstance(module, nn.Embedding):
            parent = model.model if isinstance(model, CausalLM) else None
            if parent is None or module is not parent.embed_tokens:
                continue
            rows, row_bytes = handle.block_shape(None)
            parent.embed_tokens = BlockEmbedding(rows, module.embedding_dim, qtype, row_bytes, dtype)
            kept.add(name)
            continue
        if not isinstance(module, (Linear, nn.Linear)) or module.weight.dim() != 2:
            continue
        local = handle.block_shape(shard_slice(model, name, tuple(handle.shape)))
        if local is None:  # the slice would cut a block: dequantized instead
            log.info("%s: its tensor-parallel slice cuts %s blocks; dequantized", name, handle.qtype.name)
            continue
        del module.weight
        module.register_buffer("weight", torch.empty(local, dtype=torch.uint8, device="meta"))
        module.qtype = qtype
        kept.add(name)
    return kept


def _int8_native() -> bool:
    from dspark_kernels import quant

    return quant.int8_native()


def attach_gemms(model: nn.Module, int8: bool = False) -> None:
    """After loading and fusing: a ``BlockGemm`` for every linear (and fused projection) holding blocks,
    and the LM head's (its own blocks, or a tied embedding's). ``int8``: their activations rounded to
    int8 per 32-block (``quantization: int8``)."""
    from dspark_ray.model.layers import FusedLinears
    from dspark_ray.model.llama import CausalLM

    if int8 and next(model.buffers()).device.type == "cpu" and not _int8_native():
        log.warning("quantization: int8 runs a portable scalar loop on this CPU (it has neither AVX2 nor AVX512-VNNI), "
                    "several times slower than the float path that quantization: auto takes")
    for module in model.modules():
        owners = [module] if isinstance(module, nn.Linear) else []
        owners += [value for value in vars(module).values() if isinstance(value, FusedLinears)]
        for owner in owners:
            if owner.weight.dtype == torch.uint8:
                owner.gemm = BlockGemm(owner.weight, owner.qtype, owner.in_features, int8)
    if isinstance(model, CausalLM):
        head = model.lm_head if model.lm_head is not None else model.model.embed_tokens
        if head.weight.dtype == torch.uint8:
            model.lm_gemm = BlockGemm(head.weight, head.qtype, model.config.hidden_size, int8)


def block_bytes(model: nn.Module) -> int:
    """Bytes of GGUF blocks the model holds (each once: fused projections share their linears' blocks)."""
    seen: set[int] = set()
    total = 0
    for buf in model.buffers():
        if buf.dtype == torch.uint8 and buf.untyped_storage().data_ptr() not in seen:
            seen.add(buf.untyped_storage().data_ptr())
            total += buf.untyped_storage().nbytes()
    return total
