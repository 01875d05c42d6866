"""The output head in chunks (`trainer.logits_chunk_tokens`) against whole logits: time of the
trainer's log-probs, forward and backward, side by side.

    .venv/bin/python tools/bench_head.py [--tokens 1024] [--chunks 0,64,128,256,1024]
        [--vocab 151936] [--hidden 768] [--repeats 5]

One process, a one-layer Qwen2 with a tied embedding of the given vocabulary and width (the head
is most of its compute, as in a small model with a large vocabulary: an upper bound on what
chunking costs a step). Each repeat runs every chunk size in turn (0: whole logits, the
reference) on the same batch of `--tokens` random tokens in rows of 128; the table gives median
seconds and the ratio to whole logits. The memory side is `bench_scale.py --parts train`'s.
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from asyncrl.engines.head import head_logprobs
    from asyncrl.engines.sampling import SamplingParams

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--chunks", default="0,64,128,256,1024")
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    chunks = [int(c) for c in args.chunks.split(",")]
    config = Qwen2Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_hidden_layers=1,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=args.hidden // 64,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    ids = torch.randint(0, args.vocab, (max(1, args.tokens // 128), 128))
    times: dict[int, list[float]] = {c: [] for c in chunks}
    for repeat in range(args.repeats + 1):
        for chunk in chunks:
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            logp = head_logprobs(model, ids, SamplingParams(), chunk)
            logp.mean().backward()
            if repeat:  # the first round warms up
                times[chunk].append(time.perf_counter() - start)
    whole = statistics.median(times[chunks[0]])
    print("| chunk tokens | forward + backward s (median) | ratio to first |")
    print("|---|---|---|")
    for chunk in chunks:
        t = statistics.median(times[chunk])
        print(f"| {chunk or 'whole'} | {t:.3f} | {t / whole:.3f} |")


if __name__ == "__main__":
    main()
