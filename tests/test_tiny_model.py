import json
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncrl.tiny_model import BOS_ID, EOS_ID, INFO_FILE, build_tiny_model


def test_short_build_is_loadable_cached_and_atomic(tmp_path: Path) -> None:
    out = tmp_path / "models" / "tiny"
    info = build_tiny_model(out, digits=2, seed=0, max_steps=5)
    assert info == json.loads((out / INFO_FILE).read_text())
    assert info["warmup_steps"] == 5 and info["eval_prompts"] == 500
    assert 0.0 <= info["sampled_accuracy"] <= 1.0 and 0.0 <= info["greedy_accuracy"] <= 1.0
    assert 100_000 < info["params"] < 150_000 and info["architecture"] == "qwen2"
    # Nothing but the model is left next to it: the build happened in a removed temp dir.
    assert [p.name for p in out.parent.iterdir()] == ["tiny"]

    tokenizer = AutoTokenizer.from_pretrained(out)
    ids = tokenizer("12+34=")["input_ids"]
    assert ids[0] == BOS_ID and len(ids) == 7
    assert tokenizer.decode([*ids[1:], EOS_ID], skip_special_tokens=True) == "12+34="
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.tie_word_embeddings and model.config.eos_token_id == EOS_ID

    mtime = (out / "model.safetensors").stat().st_mtime_ns
    assert build_tiny_model(out, digits=2, seed=0) == info  # cached: no rebuild
    assert (out / "model.safetensors").stat().st_mtime_ns == mtime
    with pytest.raises(
        ValueError, match="digits=2, seed=0, architecture=qwen2; asked for digits=3"
    ):
        build_tiny_model(out, digits=3, seed=0)
    # The MoE variant is another model: a directory holding the dense one is not it.
    with pytest.raises(ValueError, match="asked for digits=2, seed=0, architecture=qwen3_moe"):
        build_tiny_model(out, digits=2, seed=0, moe=True)


def test_refuses_to_overwrite_a_foreign_directory(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="holds no complete tiny model"):
        build_tiny_model(tmp_path, max_steps=1)
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


@pytest.mark.slow
def test_full_build_reaches_the_warm_up_targets(tmp_path: Path) -> None:
    info = build_tiny_model(tmp_path / "tiny")
    assert info["reached_target"] is True
    assert 0.2 <= info["sampled_accuracy"] <= 0.6
    assert info["greedy_accuracy"] >= 0.5
