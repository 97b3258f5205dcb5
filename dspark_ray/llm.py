"""LLM: the offline Python API (same engine, no Ray, no Serve).

    from dspark_ray import LLM, SamplingParams
    llm = LLM(model="models/shakespeare-target", draft="models/shakespeare-draft")
    out = llm.generate(["ROMEO:"], SamplingParams(max_tokens=32))
    print(out[0].text, out[0].spec.mean_acceptance_length)

Every SamplingParams option applies (penalties, logit_bias, min_tokens,
min_p, structured outputs: ``structured=StructuredOutput.json_schema(schema)``
...); ``logprobs=N`` / ``prompt_logprobs=N`` fill ``out.logprobs`` /
``out.prompt_logprobs`` with the target's log-probabilities, and
``max_tokens=0`` with ``prompt_logprobs`` scores prompts without generating.
"""

from __future__ import annotations

from collections.abc import Sequence

from tqdm import tqdm

from dspark_ray.engine import CompletionOutput, Engine, EngineConfig, SamplingParams
from dspark_ray.engine.local import build_local_engine


class LLM:
    """Generate from a target model, with a draft model's speculation if given.

    Keyword arguments are ``EngineConfig`` fields (``num_speculative_tokens``,
    ``capacity``, ``max_context``, ``dtype``, ``device`` ...). ``draft=None``
    runs the target alone.
    """

    def __init__(self, model: str, draft: str | None = None, **engine_args) -> None:
        self.config = EngineConfig(model=str(model), draft=str(draft) if draft else None, **engine_args)
        self.engine: Engine = build_local_engine(self.config)
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[CompletionOutput]:
        """Run every prompt to completion; results come back in prompt order.

        ``prompts`` is a string, a list of strings, or a list of token-id lists.
        ``params`` is one SamplingParams for all prompts or one per prompt.
        With ``n > 1`` a prompt gets n results in a row (sample i seeded seed + i).
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} SamplingParams")
        results: dict[str, CompletionOutput] = {}
        order = []
        try:
            for prompt, sample in ((pr, s) for pr, p in zip(prompts, params) for s in p.samples()):
                req_id = self.engine.add_request(prompt, sample)
                order.append(req_id)
                results[req_id] = CompletionOutput(req_id, self.engine.requests[req_id].prompt_token_ids,
                                                   logprobs=[] if sample.logprobs is not None else None)
        except Exception:
            for req_id in order:
                self.engine.abort(req_id)
            self.engine.step()
            raise
        with tqdm(total=len(order), disable=not use_tqdm, desc="generate") as bar:
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    res = results[out.req_id]
                    res.token_ids += out.new_token_ids
                    res.text += out.new_text
                    if out.logprobs is not None:
                        res.logprobs += out.logprobs
                    if out.prompt_logprobs is not None:
                        res.prompt_logprobs = out.prompt_logprobs
                    if out.finished:
                        res.finish_reason, res.stop_reason, res.spec = out.finish_reason, out.stop_reason, out.spec
                        res.error = out.error
                        bar.update(1)
        return [results[r] for r in order]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        params: SamplingParams | None = None,
        tools: list[dict] | None = None,
        **template_kwargs,
    ) -> list[CompletionOutput]:
        """Render each conversation with the checkpoint's chat template, then generate.

        ``tools`` (OpenAI's function specs) and ``template_kwargs`` (e.g.
        ``enable_thinking=False``) go to the template; to force a call's
        arguments, give ``params.structured`` the function's JSON schema.
        """
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.encode(self.tokenizer.apply_chat_template(c, tools=tools, **template_kwargs),
                                         add_special_tokens=False)
                   for c in convs]
        return self.generate(prompts, params)
