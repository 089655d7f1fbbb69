"""Tiny target, prompts and a generated training set shared by the drafter-training tests.

Everything runs against the tiny random Llama of tests/conftest.py (vocab 1024, 4 layers), never
the real default model, so the whole directory stays within CI's CPU budget.
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass

import pytest
import torch

from sglang_tts.training.data import DataConfig, SequenceSet, build_sequence_set
from sglang_tts.training.target import TargetFeatures, TargetWeights, compute_features, load_target

QUESTIONS = [
    "What is {i} plus {j}? Explain each step.",
    "Write a Python function named f{i} that returns {j}.",
    "How many letters are in the word number {i}? Reason about {j}.",
]


@pytest.fixture(scope="session")
def prompts_file(tmp_path_factory) -> pathlib.Path:
    path = tmp_path_factory.mktemp("prompts") / "tiny.jsonl"
    rows = [{"id": f"q{i}", "question": QUESTIONS[i % 3].format(i=i, j=3 * i + 1)} for i in range(12)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture(scope="session")
def data_config(prompts_file) -> DataConfig:
    return DataConfig(source=str(prompts_file), num_prompts=8, max_new_tokens=24, batch_size=4)


@dataclass
class TinyTarget:
    path: pathlib.Path
    model: object
    tokenizer: object
    weights: TargetWeights


@pytest.fixture(scope="session")
def tiny_target(tiny_llama) -> TinyTarget:
    model, tokenizer, weights = load_target(tiny_llama)
    return TinyTarget(tiny_llama, model, tokenizer, weights)


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory) -> pathlib.Path:
    return tmp_path_factory.mktemp("training-data")


@pytest.fixture(scope="session")
def sequences(tiny_target, data_config, data_cache) -> SequenceSet:
    return build_sequence_set(
        tiny_target.model, tiny_target.tokenizer, tiny_target.path, data_config, data_cache, False
    )


@pytest.fixture(scope="session")
def features(tiny_target, sequences, data_cache) -> TargetFeatures:
    # Every capturable layer of the 4-layer target, so any recipe's layer choice is available.
    return compute_features(tiny_target.model, tiny_target.path, sequences, [-1, 0, 1, 2], data_cache, False)


@pytest.fixture
def call_sizes(monkeypatch):
    """``call_sizes(module, name)`` wraps ``module.name`` for the test and returns the list it appends the
    length of each call's second argument to (the prompts of a generation batch, the ids of a sequence)."""

    def wrap(module: object, name: str) -> list[int]:
        sizes: list[int] = []
        real = getattr(module, name)

        def counting(first, second, *args, **kwargs):
            sizes.append(len(second))
            return real(first, second, *args, **kwargs)

        monkeypatch.setattr(module, name, counting)
        return sizes

    return wrap


@pytest.fixture(autouse=True)
def one_thread():
    """The tiny tensors here gain nothing from intra-op parallelism, and with CI's two cores shared
    with other processes every OpenMP region can stall on a descheduled thread: run single-threaded."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
