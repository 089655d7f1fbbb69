"""The long-reasoning benchmark suite behind ``scripts/bench_long.py``.

``configs`` names the server configurations (no-spec, stock, frozen, tts-s{S}[-sync]) and finds drafters,
``workload`` samples and formats prompts, ``runner`` launches or targets servers and records every
request, ``metrics`` aggregates records per sampling mode (pure functions), ``report`` writes results.json, report.md
and the PNG plots, ``smoke`` builds the tiny offline setup of ``--smoke`` (a ``tiny_models`` target), ``server``
launches and stops SGLang servers.
"""
