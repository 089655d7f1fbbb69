"""Shared fixtures: tiny checkpoints built once per session, and a CPU thread budget.

Tiny models are written in the public checkpoint layouts into a session temp dir, so every test
that serves them exercises the same loaders a user's checkpoint would go through.
"""

from __future__ import annotations

import os
import pathlib

import pytest
import torch

# Two cores on CI: keep intra-op threads at 2 so server subprocesses and tests don't oversubscribe.
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> pathlib.Path:
    return tmp_path_factory.mktemp("tiny-models")


@pytest.fixture(scope="session")
def tiny_llama(tiny_dir) -> pathlib.Path:
    from sglang_tts.bench.tiny_models import TinyTargetSpec, write_tiny_target

    return write_tiny_target(tiny_dir / "tiny-llama", TinyTargetSpec(arch="llama"))


@pytest.fixture(scope="session")
def tiny_qwen3(tiny_dir) -> pathlib.Path:
    from sglang_tts.bench.tiny_models import TinyTargetSpec, write_tiny_target

    return write_tiny_target(tiny_dir / "tiny-qwen3", TinyTargetSpec(arch="qwen3", seed=1))


@pytest.fixture(scope="session")
def tiny_eagle3(tiny_dir, tiny_llama) -> pathlib.Path:
    import json

    from sglang_tts.drafters.checkpoints import write_tiny_eagle3

    target_config = json.loads((tiny_llama / "config.json").read_text())
    return write_tiny_eagle3(tiny_dir / "tiny-eagle3", target_config, layout="midlayer")


@pytest.fixture(scope="session")
def loopy_llama(tiny_dir) -> pathlib.Path:
    """A nearly-bigram tiny Llama whose greedy output falls into a short cycle (long repetitive
    outputs: the regime where test-time adaptation shows within a few hundred tokens)."""
    from sglang_tts.bench.tiny_models import TinyTargetSpec, write_tiny_target

    return write_tiny_target(tiny_dir / "loopy-llama", TinyTargetSpec(layer_std=0.02, init_std=0.6, seed=3))


@pytest.fixture(scope="session")
def loopy_eagle3(tiny_dir, loopy_llama) -> pathlib.Path:
    """A random EAGLE-3 drafter for loopy_llama over the full vocabulary."""
    import json

    from sglang_tts.drafters.checkpoints import write_tiny_eagle3

    target_config = json.loads((loopy_llama / "config.json").read_text())
    return write_tiny_eagle3(tiny_dir / "loopy-eagle3", target_config, layout="layers.0", draft_vocab_size=1024)


@pytest.fixture(scope="session")
def loopy_dflash(tiny_dir, loopy_llama) -> pathlib.Path:
    """A random DFlash drafter (block 4) for loopy_llama."""
    import json

    from sglang_tts.drafters.checkpoints import write_tiny_dflash

    target_config = json.loads((loopy_llama / "config.json").read_text())
    return write_tiny_dflash(tiny_dir / "loopy-dflash", target_config, block_size=4)


@pytest.fixture(scope="session", autouse=True)
def server_zygote(tmp_path_factory):
    """One process that imports SGLang once and forks every CPU server of the session from it
    (sglang_tts.bench.forkserver: a start takes ~5 s instead of ~35 s). Servers started by scripts the
    tests run find it through the environment too. SGLANG_TTS_TEST_FORKSERVER=0: every server is a
    fresh `python -m sglang.launch_server` process."""
    from sglang_tts.bench import forkserver

    if os.environ.get("SGLANG_TTS_TEST_FORKSERVER", "1") == "0":
        yield None
        return
    with forkserver.running(tmp_path_factory.mktemp("zygote")) as zygote:
        yield zygote
