"""The builtin engine with a LoRA adapter: unmerged (peft's layers, what the engine runs) against
merged into the base weights, on CPU.

    .venv/bin/python tools/bench_lora_engine.py [--hidden 512] [--layers 8] [--rank 8]
        [--batch 64] [--tokens 32] [--rounds 5]

A random Qwen2 model from a config (no download). Each round times one `generate` of `batch`
prompts × `tokens` new tokens with the adapter unmerged, and the same with it merged, plus the
time a version change costs each way: copying the adapter tensors (unmerged) or W = W0 + s·BA
for every target (merged). Medians of the rounds after a warm-up; the last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from asyncrl.engines.sampling import SamplingParams
from asyncrl.engines.torch_engine import TorchEngine
from asyncrl.lora import synced, wrap
from asyncrl.model_config import LoraConfig


def model_of(args: argparse.Namespace) -> torch.nn.Module:
    config = Qwen2Config(
        vocab_size=1024,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 3,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def timed(fn) -> float:  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    lora = LoraConfig(rank=args.rank)
    unmerged = wrap(model_of(args), lora)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, p in synced(unmerged):
            p.copy_(0.02 * torch.randn(p.shape, generator=g))
    adapter = {n: p.detach().clone() for n, p in synced(unmerged)}
    merged = model_of(args)
    base = {n: p.detach().clone() for n, p in merged.named_parameters()}
    scale = lora.alpha / lora.rank
    # Each target's (base weight name, A, B) for W = W0 + s·B A.
    targets = []
    for name in adapter:
        if ".lora_A." in name:
            module = name.removeprefix("base_model.model.").split(".lora_A.")[0]
            targets.append(
                (f"{module}.weight", adapter[name], adapter[name.replace(".lora_A.", ".lora_B.")])
            )
    params = dict(merged.named_parameters())

    @torch.no_grad()
    def merge() -> None:
        for weight, a, b in targets:
            params[weight].copy_(torch.addmm(base[weight], b, a, alpha=scale))

    @torch.no_grad()
    def copy_adapter() -> None:
        live = dict(synced(unmerged))
        for name, t in adapter.items():
            live[name].copy_(t)

    prompts = [[1, 2, 3, 4, 5, 6, 7, 8][: 2 + i % 6] for i in range(args.batch)]
    sampling = SamplingParams(max_new_tokens=args.tokens, stop_token_ids=())
    engines = {
        "unmerged": TorchEngine(unmerged, eos_token_ids=[], seed=0),
        "merged": TorchEngine(merged, eos_token_ids=[], seed=0),
    }
    swaps = {"unmerged": copy_adapter, "merged": merge}
    rows: dict[str, list[tuple[float, float]]] = {k: [] for k in engines}
    for r in range(args.rounds + 1):
        for kind, engine in engines.items():
            swap_s = timed(swaps[kind])
            gen_s = timed(lambda e=engine: e.generate(prompts, sampling))
            if r:
                rows[kind].append((gen_s, swap_s))
            print(f"round {r} {kind}: generate {gen_s:.3f}s  swap {swap_s * 1000:.2f}ms")
    n_params = sum(p.numel() for p in merged.parameters())
    result: dict[str, float] = {"params_m": round(n_params / 1e6, 1)}
    for kind, vals in rows.items():
        result[f"{kind}_generate_s"] = round(statistics.median(v[0] for v in vals), 4)
        result[f"{kind}_swap_ms"] = round(1000 * statistics.median(v[1] for v in vals), 3)
    result["merged_speedup"] = round(result["unmerged_generate_s"] / result["merged_generate_s"], 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
