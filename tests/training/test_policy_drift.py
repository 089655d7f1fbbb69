"""Policy drift checkpoints: real fine-tuning steps of the target, loadable, measured, resumable."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from sglang_tts.training.policy_drift import (
    DONE,
    DriftSettings,
    Example,
    encode,
    gsm8k_examples,
    make_drift,
    trainable_parameters,
)

PAIRS = [
    Example(f"What is {a} + {b}?", f"{a} + {b} = <<{a}+{b}={a + b}>>{a + b}\n#### {a + b}")
    for a in range(6)
    for b in range(4)
]


def _weights(folder):
    return load_file(str(next(folder.glob("*.safetensors"))))


def test_gsm8k_rows_become_pairs_and_the_loss_covers_the_answer_only(tmp_path, tiny_llama):
    from transformers import AutoTokenizer

    rows = [
        {"question": "Q1", "answer": "A1 #### 1"},
        {"question": "", "answer": "x"},
        {"question": "Q2", "answer": "2"},
    ]
    path = tmp_path / "g.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert gsm8k_examples(path) == [Example("Q1", "A1 #### 1"), Example("Q2", "2")]
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    ids, start = encode(tokenizer, PAIRS[5], 384)
    assert all(isinstance(i, int) for i in ids) and 0 < start < len(ids)
    answer = tokenizer.decode(ids[start:], skip_special_tokens=True)
    assert PAIRS[5].answer.split("\n")[0] in answer and PAIRS[5].prompt not in answer


def test_checkpoints_move_the_policy_and_a_rerun_resumes(tmp_path, tiny_llama):
    from transformers import AutoModelForCausalLM

    settings = DriftSettings(checkpoints=2, steps_per_checkpoint=3, lr=1e-3, batch_size=2, max_tokens=64)
    logs: list[str] = []
    reports = make_drift(
        tiny_llama, tmp_path / "drift", PAIRS[4:], PAIRS[:4], settings, progress=False, log=logs.append
    )
    assert [r.name for r in reports] == ["ckpt-1", "ckpt-2"] and [r.optimizer_steps for r in reports] == [3, 6]
    base = _weights(tiny_llama)
    one, two = (_weights(tmp_path / "drift" / f"ckpt-{k}") for k in (1, 2))
    layer = next(k for k in base if ".layers." in k and k.endswith("weight"))
    assert not torch.equal(base[layer], one[layer]) and not torch.equal(one[layer], two[layer])
    embed = next(k for k in base if "embed_tokens" in k)
    assert torch.equal(base[embed], one[embed])  # train="layers": embeddings stay
    # The drift is measured and grows with the steps taken; the checkpoints load as models.
    assert 0 < reports[0].kl_from_base < reports[1].kl_from_base
    assert 0.0 <= reports[1].argmax_agreement <= 1.0
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "drift" / "ckpt-2")
    assert model(input_ids=torch.tensor([[1, 2, 3]])).logits.shape[-1] == model.config.vocab_size
    assert (tmp_path / "drift" / "ckpt-2" / "tokenizer_config.json").is_file()
    # A rerun finds both finished and trains nothing; a third checkpoint continues from ckpt-2.
    stamp = (tmp_path / "drift" / "ckpt-2" / DONE).stat().st_mtime_ns
    again = make_drift(tiny_llama, tmp_path / "drift", PAIRS[4:], PAIRS[:4], settings, progress=False, log=logs.append)
    assert [r.kl_from_base for r in again] == [r.kl_from_base for r in reports]
    assert (tmp_path / "drift" / "ckpt-2" / DONE).stat().st_mtime_ns == stamp
    more = DriftSettings(checkpoints=3, steps_per_checkpoint=3, lr=1e-3, batch_size=2, max_tokens=64)
    third = make_drift(tiny_llama, tmp_path / "drift", PAIRS[4:], PAIRS[:4], more, progress=False, log=logs.append)
    assert third[-1].optimizer_steps == 9 and any("resuming from ckpt-2" in line for line in logs)
    assert not list((tmp_path / "drift").glob(".ckpt-*"))  # no partial folder left behind


def test_the_trained_subset_is_checked(tiny_llama):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    layers = trainable_parameters(model, "layers")
    assert 0 < len(layers) < len(list(model.parameters()))
    assert len(trainable_parameters(model, "all")) == len(list(model.parameters()))
    with pytest.raises(ValueError, match="layers' or 'all'"):
        trainable_parameters(model, "heads")
