"""The declared SGLang internals (sglang_tts/sglang/compat.py): the installed SGLang matches them, a
mismatch is reported by name and stops registration, and the declaration covers what the plugin uses."""

from __future__ import annotations

import inspect
import logging
import subprocess
import sys
from types import SimpleNamespace

import pytest

from sglang_tts.sglang import compat
from sglang_tts.sglang.compat import Requirement, SGLangMismatchError


def _targets(report: compat.Report) -> list[str]:
    return [d.target for d in report.differences]


def test_the_installed_sglang_matches_every_declared_internal():
    report = compat.check(("always", "tts", "cpu", "cpu-timing"))
    assert report.ok, report.format()
    assert report.found_version == compat.SGLANG_VERSION
    assert "sglang.srt.speculative.eagle_worker_v2:EAGLEWorkerV2" in report.checked
    assert "sglang.srt.speculative.dflash_worker_v2:DFlashWorkerV2" in report.checked
    assert "matches the" in report.format()


def test_every_hook_the_plugin_registers_is_declared(monkeypatch):
    """The hook targets of every module that registers hooks, captured from a stand-in registry."""
    from sglang_tts.platform import cpu
    from sglang_tts.platform.cpu import dflash, linear, memory, round_timing
    from sglang_tts.sglang import dflash_capture, metrics, requests

    monkeypatch.setenv("SGLANG_TTS_CPU_ROUND_TIMING", "/dev/null")
    monkeypatch.setattr(dflash, "allow_torch_native_draft_backend", lambda: None)
    captured: list[str] = []
    registry = SimpleNamespace(register=lambda target, hook, hook_type=None: captured.append(target))
    hook_type = SimpleNamespace(AROUND="around", AFTER="after")
    for module in (dflash, linear, memory, round_timing, dflash_capture, metrics, requests):
        module.register_hooks(registry, hook_type)
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    from sglang_tts.sglang import algorithm

    monkeypatch.setattr(HookRegistry, "register", classmethod(lambda cls, target, *a, **k: captured.append(target)))
    cpu._register_hooks()  # the CPU layer's own AROUND hooks (and the modules above again)
    monkeypatch.setattr(algorithm, "_registered", False)
    monkeypatch.setattr(algorithm, "ALGORITHM_NAME", "TTS_COMPAT_TEST")  # not registered: takes the register path
    monkeypatch.setattr(SpeculativeAlgorithm, "register", lambda *a, **k: lambda factory: factory)
    algorithm.register_tts_algorithm()  # flags, metrics, requests, weight sync, adaptive steps
    declared = {req.target.replace(":", ".") for req in compat.REQUIREMENTS}
    sglang_targets = {t for t in captured if t.startswith("sglang.")}
    assert len(sglang_targets) > 20
    assert "sglang.srt.server_args.ServerArgs.add_cli_args" in sglang_targets
    assert sglang_targets - declared == set()


def test_every_sglang_method_the_workers_override_is_declared():
    from sglang_tts.sglang.dflash_worker import TTSDFlashWorker
    from sglang_tts.sglang.eagle_worker import TTSEagleWorker

    declared = {req.target for req in compat.REQUIREMENTS if req.scope == "tts"}
    undeclared = []
    for cls in (TTSEagleWorker, TTSDFlashWorker):
        base = cls.__mro__[1]
        for name, value in vars(cls).items():
            if inspect.isfunction(value) and hasattr(base, name):
                target = f"{base.__module__}:{base.__qualname__}.{name}"
                if target not in declared:
                    undeclared.append(target)
        assert f"{base.__module__}:{base.__qualname__}" in declared
    assert undeclared == []


def test_a_missing_method_is_named(monkeypatch):
    from sglang.srt.speculative.eagle_worker_v2 import EAGLEWorkerV2

    monkeypatch.delattr(EAGLEWorkerV2, "verify")
    report = compat.check(("tts",))
    assert _targets(report) == ["sglang.srt.speculative.eagle_worker_v2:EAGLEWorkerV2.verify"]
    text = report.format()
    assert "EAGLEWorkerV2.verify: expected it to exist, found AttributeError" in text
    assert "TTSEagleWorker" in text  # why the plugin needs it


def test_a_changed_signature_is_named_with_what_was_expected_and_found(monkeypatch):
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    def _validate_one_request(self, request, ids):
        return None

    monkeypatch.setattr(TokenizerManager, "_validate_one_request", _validate_one_request)
    report = compat.check(("always",))
    assert _targets(report) == ["sglang.srt.managers.tokenizer_manager:TokenizerManager._validate_one_request"]
    line = str(report.differences[0])
    assert "expected parameters (self, obj, input_ids, ...)" in line
    assert "found (self, request, ids)" in line


def test_a_new_required_parameter_breaks_only_a_call_the_plugin_makes(monkeypatch):
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

    original = DFlashWorkerV2._can_skip_verify_logits

    def _can_skip_verify_logits(self, batch, sampling_info, forward_mode):
        return original(self, batch, sampling_info)

    monkeypatch.setattr(DFlashWorkerV2, "_can_skip_verify_logits", _can_skip_verify_logits)
    report = compat.check(("tts",))
    assert _targets(report) == ["sglang.srt.speculative.dflash_worker_v2:DFlashWorkerV2._can_skip_verify_logits"]
    assert "new required forward_mode" in str(report.differences[0])


def test_another_version_is_named(monkeypatch):
    import sglang.version

    monkeypatch.setattr(sglang.version, "__version__", "0.5.24")
    report = compat.check(("always",))
    assert not report.ok
    assert str(report.differences[0]).startswith("SGLang version: expected 0.5.23, found 0.5.24")
    assert "SGLang 0.5.24" in report.format()


def test_a_missing_attribute_is_named():
    class Worker:
        def __init__(self) -> None:
            self.draft_runner = None

    reqs = [Requirement(f"{__name__}:Worker", "reads them", attributes=("draft_runner", "target_worker"))]
    globals()["Worker"] = Worker
    try:
        report = compat.check(("always",), requirements=reqs)
    finally:
        del globals()["Worker"]
    assert [str(d).splitlines()[0] for d in report.differences] == [
        f"{__name__}:Worker: expected attribute(s) target_worker, "
        "found none of them (not on the class, not named in its methods' code)"
    ]


@pytest.mark.parametrize(
    ("expected", "signature", "calls", "problem"),
    [
        (("self", "batch"), "(self, batch, extra=None)", True, None),
        (("self", "batch"), "(self, batch, *args, **kwargs)", False, None),
        (("self", "batch"), "(self, b)", False, "positional (self, b)"),
        (("self", "batch"), "(self, batch, extra)", False, None),  # a hook passes extra on
        (("self", "batch"), "(self, batch, extra)", True, "new required extra"),
        (("*", "model"), "(*, model, other=1)", True, None),
        (("*", "model"), "(*, other=1)", False, "no keyword model"),
        (("*", "model"), "(**kwargs)", False, None),
        ((), "()", True, None),
    ],
)
def test_parameter_rules(expected, signature, calls, problem):
    namespace: dict = {}
    exec(f"def f{signature}: pass", namespace)
    found = compat.param_difference(expected, inspect.signature(namespace["f"]), calls)
    if problem is None:
        assert found is None
    else:
        assert found is not None and problem in found


@pytest.mark.parametrize(
    ("found", "ok"),
    [("0.5.23", True), ("0.5.23.post1", True), ("0.5.23+cu130", True), ("0.5.24", False), ("0.5.2", False)],
)
def test_the_version_rule(found, ok):
    assert compat.version_matches(found, "0.5.23") is ok


def test_registration_stops_on_a_mismatch(monkeypatch):
    import sglang.version

    from sglang_tts import plugin
    from sglang_tts.platform import cpu
    from sglang_tts.sglang import algorithm

    registered = []
    monkeypatch.setattr(sglang.version, "__version__", "0.4.9")
    monkeypatch.setattr(cpu, "install", lambda: False)
    monkeypatch.setattr(algorithm, "register_tts_algorithm", lambda: registered.append(True))
    monkeypatch.delenv(compat.SKIP_ENV, raising=False)
    with pytest.raises(SGLangMismatchError) as raised:
        plugin.register()
    assert isinstance(raised.value, SystemExit)  # SGLang's load_plugins() swallows Exception, not this
    assert "expected 0.5.23, found 0.4.9" in str(raised.value.code)
    assert registered == []  # nothing of TTS is registered on another SGLang


def test_a_tts_launch_stops_on_a_mismatch_in_the_worker_classes(monkeypatch):
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

    from sglang_tts.sglang.algorithm import validate_server_args

    monkeypatch.delattr(DFlashWorkerV2, "_can_skip_verify_logits")
    monkeypatch.delenv(compat.SKIP_ENV, raising=False)
    with pytest.raises(SGLangMismatchError, match="DFlashWorkerV2._can_skip_verify_logits"):
        validate_server_args(SimpleNamespace())  # before the drafter is even looked at


def test_the_escape_hatch_warns_instead(monkeypatch, caplog):
    import sglang.version

    monkeypatch.setattr(sglang.version, "__version__", "0.5.24")
    monkeypatch.setenv(compat.SKIP_ENV, "1")
    with caplog.at_level(logging.WARNING, logger=compat.__name__):
        report = compat.require(("always",))
    assert not report.ok
    assert f"{compat.SKIP_ENV}=1: starting anyway" in caplog.text
    assert "found 0.5.24" in caplog.text


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def test_the_command_exits_0_when_all_match_and_1_with_the_report():
    ok = subprocess.run([sys.executable, "-m", "sglang_tts.sglang.compat"], capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "matches the" in ok.stdout and "tts" in ok.stdout
    bad = _run(
        "import sglang.version, sys; sglang.version.__version__ = '0.6.0'\n"
        "from sglang_tts.sglang.compat import main; sys.exit(main([]))"
    )
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "SGLang version: expected 0.5.23, found 0.6.0" in bad.stdout


def test_the_registration_check_does_not_import_the_worker_modules():
    """Its cost: only modules HookRegistry.apply_hooks() imports anyway (the workers load at a TTS launch)."""
    result = _run(
        "import sys\nfrom sglang_tts.sglang import compat\n"
        "report = compat.check(compat.register_scopes(False))\n"
        "assert report.ok, report.format()\n"
        "print(sorted(m for m in sys.modules if m.endswith(('eagle_worker_v2', 'dflash_worker_v2'))))"
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"
