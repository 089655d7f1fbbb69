"""DFLASH on a Qwen2 target (sglang_tts/sglang/dflash_capture.py): SGLang 0.5.23's Qwen2ForCausalLM has no
`set_dflash_layers_to_capture`; the plugin's hook captures the drafter's layers through the EAGLE-3 method."""

from __future__ import annotations

import json

import pytest

from sglang_tts.bench.server import sglang_server
from sglang_tts.sglang.dflash_capture import configure_capture_hook
from sglang_tts.testing.reference import generate_ids, hf_greedy

PROMPTS = [[4, 454, 607, 82, 343, 14, 357, 315, 3, 5], [4, 100, 200, 300, 3, 5]]
NEW_TOKENS = 40


class Qwen2ForCausalLM:  # the shape of SGLang's class: EAGLE-3 capture only
    def __init__(self) -> None:
        self.captured: list[int] | None = None

    def set_eagle3_layers_to_capture(self, layer_ids: list[int] | None = None) -> None:
        self.captured = layer_ids


class LlamaForCausalLM(Qwen2ForCausalLM):
    def set_dflash_layers_to_capture(self, layer_ids: list[int]) -> None:
        self.captured = ["dflash", *layer_ids]


def _call(model, dflash: bool = True, layer_ids=(1, 11, 20)):
    seen = {}

    def original(**kwargs):
        seen.update(kwargs)

    configure_capture_hook(
        original,
        model=model,
        eagle_use_aux_hidden_state=False,
        eagle_aux_hidden_state_layer_ids=None,
        dflash_use_aux_hidden_state=dflash,
        dflash_target_layer_ids=None if layer_ids is None else list(layer_ids),
        is_dspark=False,
    )
    return seen


def test_qwen2_dflash_capture_goes_through_the_eagle3_method():
    model = Qwen2ForCausalLM()
    seen = _call(model)
    assert model.captured == [1, 11, 20]
    assert seen["dflash_use_aux_hidden_state"] is False and seen["model"] is model  # SGLang does the rest


def test_other_models_and_eagle3_reach_sglang_unchanged():
    llama = LlamaForCausalLM()
    assert _call(llama)["dflash_use_aux_hidden_state"] is True and llama.captured is None
    qwen = Qwen2ForCausalLM()
    assert _call(qwen, dflash=False)["dflash_use_aux_hidden_state"] is False and qwen.captured is None
    with pytest.raises(ValueError, match="explicit target layer ids"):
        _call(Qwen2ForCausalLM(), layer_ids=None)


@pytest.fixture(scope="module")
def tiny_qwen2(tiny_dir):
    from sglang_tts.bench.tiny_models import TinyTargetSpec, write_tiny_target

    return write_tiny_target(tiny_dir / "tiny-qwen2", TinyTargetSpec(arch="qwen2", seed=2))


@pytest.mark.parametrize("algorithm", ["DFLASH", "TTS"])
def test_dflash_serves_a_qwen2_target_losslessly(tiny_qwen2, tmp_path, algorithm):
    from sglang_tts.drafters.checkpoints import write_tiny_dflash

    config = json.loads((tiny_qwen2 / "config.json").read_text())
    drafter = write_tiny_dflash(tmp_path / "dflash", config, block_size=4)
    args = ["--speculative-algorithm", algorithm, "--speculative-draft-model-path", str(drafter)]
    with sglang_server(str(tiny_qwen2), args) as server:
        for prompt in PROMPTS:
            out = generate_ids(server.base_url, prompt, NEW_TOKENS)
            assert out["output_ids"] == hf_greedy(str(tiny_qwen2), prompt, NEW_TOKENS)
            assert out["meta_info"]["spec_verify_ct"] > 0
