"""Greedy generation through an offline `vllm.LLM`, one engine step at a time, keeping each step's
committed tokens: per request, the first chunk is the prefill's token and every later chunk one
decode round (accepted drafts + the bonus), comparable with `dflow.engine`'s rounds."""

from __future__ import annotations


def step_rounds(llm, prompts: list[list[int]], max_tokens: int, concurrency: int,
                ignore_eos: bool = True, stop_token_ids: list[int] | None = None) -> list[list[list[int]]]:
    """`concurrency` requests in flight at a time -> per request, the token chunks of each step."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos,
                            stop_token_ids=stop_token_ids, output_kind=RequestOutputKind.DELTA)
    engine, chunks = llm.llm_engine, [[] for _ in prompts]
    for start in range(0, len(prompts), concurrency):
        for i in range(start, min(start + concurrency, len(prompts))):
            engine.add_request(str(i), {"prompt_token_ids": prompts[i]}, params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.outputs and out.outputs[0].token_ids:
                    chunks[int(out.request_id)].append(list(out.outputs[0].token_ids))
    return chunks


def shutdown(llm) -> None:
    """Stop the engine's processes now (not at garbage collection)."""
    import gc

    llm.llm_engine.engine_core.shutdown()
    gc.collect()
