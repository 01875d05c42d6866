"""Tokens/s of the builtin torch engine against transformers' `generate(do_sample=True)`.

    python tools/bench_engine.py [--model DIR] [--batch 128] [--prompt-len 8] [--new-tokens 32]
                                 [--repeats 5] [--threads N]

Both sample the same prompts from the same model with plain temperature-1 sampling and no stop
tokens, so every row yields exactly --new-tokens tokens. Calls are interleaved and each figure
is the median over --repeats after one warm-up call. `hf_generate_scores` also asks generate for
the per-step scores, which the engine always records (behaviour log-probs). Without --model a
random tiny model (the quickstart architecture) is used. The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import cast

import torch
from transformers import AutoModelForCausalLM, GenerationMixin, PreTrainedModel

from asyncrl.engines.sampling import SamplingParams
from asyncrl.engines.torch_engine import TorchEngine
from asyncrl.tiny_model import save_random_tiny_model


def _runners(
    model: PreTrainedModel, prompts: torch.Tensor, new_tokens: int
) -> dict[str, Callable[[], None]]:
    engine = TorchEngine(model, eos_token_ids=[])
    params = SamplingParams(max_new_tokens=new_tokens, stop_token_ids=())
    ids = prompts.tolist()
    hf = cast(GenerationMixin, model)  # PreTrainedModel alone does not declare generate()
    hf_kwargs = dict(
        input_ids=prompts,
        attention_mask=torch.ones_like(prompts),
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        pad_token_id=0,
    )

    def asyncrl() -> None:
        engine.generate(ids, params)

    def hf_generate() -> None:
        hf.generate(**hf_kwargs)

    def hf_generate_scores() -> None:
        hf.generate(**hf_kwargs, output_scores=True, return_dict_in_generate=True)

    return {
        "asyncrl": asyncrl,
        "hf_generate": hf_generate,
        "hf_generate_scores": hf_generate_scores,
    }


@torch.inference_mode()
def bench_engine(
    model_dir: str, batch: int, prompt_len: int, new_tokens: int, repeats: int
) -> dict[str, float]:
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, model.config.vocab_size, (batch, prompt_len), generator=generator)
    runners = _runners(model, prompts, new_tokens)
    times: dict[str, list[float]] = {name: [] for name in runners}
    for run in runners.values():
        run()  # warm-up: allocator and kernel selection
    for _ in range(repeats):
        for name, run in runners.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    rates = {f"{n}_tokens_s": batch * new_tokens / statistics.median(t) for n, t in times.items()}
    return {
        **{k: round(v) for k, v in rates.items()},
        "ratio": round(rates["asyncrl_tokens_s"] / rates["hf_generate_tokens_s"], 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="local Hugging Face model dir (default: random tiny)")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    settings = {
        "batch": args.batch,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "threads": torch.get_num_threads(),
    }
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or str(save_random_tiny_model(tmp))
        figures = bench_engine(
            model_dir, args.batch, args.prompt_len, args.new_tokens, args.repeats
        )
    for name in ("asyncrl", "hf_generate", "hf_generate_scores"):
        print(f"{name:>20}: {figures[f'{name}_tokens_s']:>8} tokens/s")
    print(json.dumps({**figures, **settings}))


if __name__ == "__main__":
    main()
