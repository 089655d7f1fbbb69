"""Synthetic benchmark records for the aggregation and report tests (no servers)."""

from __future__ import annotations

from sglang_tts.bench.configs import BenchConfig, build_configs
from sglang_tts.bench.runner import RequestRecord

DRAFTERS = {"eagle3": "/d/eagle3", "dflash": "/d/dflash"}


def record(config: str, dataset: str, lengths: list[int] | None, wall_s: float, **kw) -> RequestRecord:
    """A request whose completion is the prefill token plus the rounds' tokens (as SGLang reports)."""
    tokens = kw.pop("completion_tokens", 1 + sum(lengths or []))
    return RequestRecord(
        config=config,
        dataset=dataset,
        prompt_id=kw.pop("prompt_id", f"{dataset}-0"),
        round=0,
        completion_tokens=tokens,
        wall_s=wall_s,
        accept_lengths=lengths,
        spec_verify_ct=None if lengths is None else len(lengths),
        spec_accept_length=None if not lengths else sum(lengths) / len(lengths),
        **kw,
    )


def full_configs(names=("no-spec", "stock", "frozen", "tts-s1", "tts-s5", "tts-s5-sync")) -> list[BenchConfig]:
    return build_configs(list(names), ["eagle3", "dflash"], DRAFTERS, tts_lr=1e-2)


def full_records() -> list[RequestRecord]:
    """Every configuration of :func:`full_configs` on two datasets; TTS accepts more late in the output."""
    out = []
    for dataset, late in (("aime2024", 3), ("math500", 2)):
        out.append(record("no-spec", dataset, None, 10.0, completion_tokens=100))
        for kind in ("eagle3", "dflash"):
            out.append(record(f"{kind}:stock", dataset, None, 8.0, completion_tokens=100))
            out[-1].spec_accept_length, out[-1].spec_verify_ct = 1.25, 80
            out.append(record(f"{kind}:frozen", dataset, [1] * 40 + [2] * 10, 7.0, tts_num_updates=0))
            for name, wall, sync in (("tts-s1", 5.0, False), ("tts-s5", 4.0, False), ("tts-s5-sync", 6.0, True)):
                out.append(
                    record(
                        f"{kind}:{name}",
                        dataset,
                        [1] * 20 + [late] * 20,
                        wall,
                        tts_num_updates=8 if "s5" in name else 40,
                        tts_num_skipped_updates=0,
                        tts_update_ms=800.0 if sync else 400.0,
                    )
                )
    return out
